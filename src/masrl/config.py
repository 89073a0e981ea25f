"""The run configuration: YAML -> pydantic models. The one place defaults live.

Errors name the key, the file and what was expected (``ConfigError``; the CLI exits 2).
Dotted overrides from the command line: ``trainer.total_steps=50 algorithm.estimator=grpo``.
"""
from __future__ import annotations

import types
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from masrl.errors import ConfigError, UserInputError, read_user_text  # noqa: F401 (ConfigError lives on here)


SEED_MAX = 2**32 - 1  # the widest range every seeded generator (random, numpy, torch, vLLM) accepts


def _bool_in_number_slot(annotation: Any, value: Any) -> bool:
    """Whether ``value`` puts a boolean where ``annotation`` wants a number (also inside lists/dicts)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _bool_in_number_slot(args[0], value)
    if origin in (Union, types.UnionType):
        return bool not in args and any(_bool_in_number_slot(a, value) for a in args)
    if origin is Literal:
        return isinstance(value, bool) and all(type(a) is int for a in args)
    if annotation in (int, float):
        return isinstance(value, bool)
    if origin in (list, tuple) and isinstance(value, (list, tuple)) and args:
        slots = args if origin is tuple and Ellipsis not in args else (args[0],) * len(value)
        return any(_bool_in_number_slot(a, v) for a, v in zip(slots, value))
    if origin is dict and isinstance(value, dict) and len(args) == 2:
        return any(_bool_in_number_slot(args[1], v) for v in value.values())
    return False


class _Strict(BaseModel):
    """Unknown keys are errors; NaN/inf are not numbers; neither are booleans (YAML 1.1 reads
    ``on``/``off``/``yes``/``no`` as booleans, which pydantic would take as 1/0)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _booleans_are_not_numbers(cls, value: Any, info) -> Any:
        field = cls.model_fields.get(info.field_name) if info.field_name else None
        if field is not None and _bool_in_number_slot(field.annotation, value):
            raise ValueError("expected a number, got a boolean (YAML reads on/off/yes/no/true/false as "
                             "booleans); write a number")
        return value


class TaskConfig(_Strict):
    """Where tasks come from. ``name``: ``arithmetic`` (synthetic) or a benchmark name/file."""

    name: str = "arithmetic"
    params: dict[str, Any] = Field(default_factory=dict)
    train_limit: Optional[int] = Field(None, ge=0)
    test_limit: Optional[int] = Field(None, ge=0)


class WorkflowConfig(_Strict):
    name: str = "math_solver_verifier"
    params: dict[str, Any] = Field(default_factory=dict)
    prompts: dict[str, str] = Field(default_factory=dict)


class AgentConfig(_Strict):
    policy: str
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(256, gt=0)
    system_prompt: Optional[str] = None


class OptimConfig(_Strict):
    lr: float = Field(1e-6, gt=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(0.01, ge=0.0)
    grad_clip: Optional[float] = Field(1.0, gt=0.0)
    eps: float = Field(1e-8, ge=0.0)
    fused: bool = Field(False, description="torch's fused AdamW kernel (much faster steps for large models)")


class LoraConfig(_Strict):
    r: int = Field(8, gt=0)
    alpha: float = 16.0
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    per_agent: bool = Field(False, description=(
        "Isolated-Policy: one adapter per agent mapped to this policy, all trained in one optimizer step "
        "from one mixed batch; false: one adapter shared by the policy's agents (Shared-Policy)"))
    init_from: Optional[str] = Field(None, description=(
        "folder holding one PEFT adapter folder per adapter name (a role, or the policy's name when shared), "
        "as `masrl export` writes in POLICY/adapters: the adapters start from those weights instead of zero"))


class PolicyConfig(_Strict):
    """A trainable model: ``model`` is ``tiny``, an alias, a hub id or a local folder."""

    model: str = "tiny"
    tiny: dict[str, Any] = Field(default_factory=dict)
    tokenizer: Optional[str] = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    trainable: bool = True
    trust_remote_code: bool = False
    lora: Optional[LoraConfig] = None
    optim: OptimConfig = Field(default_factory=OptimConfig)
    init_seed: Optional[int] = Field(None, ge=0, le=SEED_MAX)
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict, description=(
        "extra arguments of the tokenizer's chat template (Qwen3: {enable_thinking: false})"))
    gradient_checkpointing: bool = Field(False, description="recompute activations in backward (memory for time)")

    @model_validator(mode="after")
    def _tiny_has_its_own_tokenizer(self):
        if self.model == "tiny" and self.tokenizer:
            raise ValueError("tokenizer is set on a tiny model, which always uses its built-in character "
                             "tokenizer; remove tokenizer or use a pretrained model")
        return self

    @model_validator(mode="after")
    def _lora_needs_training(self):
        if self.lora is not None and not self.trainable:
            raise ValueError("lora is set on a policy declared trainable: false; "
                             "drop lora or make the policy trainable")
        return self


def _registered(kind: str, value: str, known) -> str:
    """``value`` if it names an entry of ``known`` (a registry or tuple of masrl.algorithms), else one error
    listing the known names."""
    if value not in known:
        raise ValueError(f"unknown {kind} {value!r}; known: {', '.join(known)}")
    return value


class LossConfig(_Strict):
    """Choices are checked against masrl.algorithms (``LOSSES``, ``AGG_MODES``, ``KL_KINDS``), so a
    loss added with ``@register_loss`` is accepted here."""

    loss: str = "ppo"
    clip_low: float = Field(0.2, ge=0.0)
    clip_high: float = Field(0.2, ge=0.0)
    dual_clip: Optional[float] = Field(None, gt=1.0)
    agg: str = Field("token-mean", description=(
        "token-mean, seq-mean-token-mean, seq-mean-token-sum-norm, or role-balanced: token mean within each agent, "
        "then the mean over the agents in the policy batch (every role the same weight; docs/algorithms.md)"))
    kl_coef: float = Field(0.0, ge=0.0)
    kl_kind: str = "k3"
    entropy_coef: float = 0.0

    @field_validator("loss")
    @classmethod
    def _loss_registered(cls, v: str) -> str:
        from masrl.algorithms.losses import LOSSES  # imports torch: only when a config is validated

        return _registered("loss", v, LOSSES)

    @field_validator("agg")
    @classmethod
    def _agg_known(cls, v: str) -> str:
        from masrl.algorithms.losses import AGG_MODES

        return _registered("agg", v, AGG_MODES)

    @field_validator("kl_kind")
    @classmethod
    def _kl_known(cls, v: str) -> str:
        from masrl.algorithms.losses import KL_KINDS

        return _registered("KL kind", v, KL_KINDS)


class RolloutISConfig(_Strict):
    """Truncated importance sampling between the trainer's and the rollout engine's log-probs.

    With a separate rollout engine (vLLM) the trainer recomputes the old log-probs and each
    token's loss is weighted by ``min(exp(logp_old - logp_rollout), cap)`` (docs/scaling.md).
    """

    enabled: bool = False
    cap: float = Field(2.0, gt=0.0)
    level: Literal["token", "sequence", "geometric"] = "token"
    mode: Literal["truncate", "mask"] = "truncate"


class AlgorithmConfig(_Strict):
    estimator: str = Field("drmas", description="a name in masrl.algorithms.ADVANTAGE_ESTIMATORS")
    eps: float = Field(1e-6, ge=0.0)
    unbiased_std: bool = True
    singleton: Literal["zero", "raw"] = "zero"
    format_penalty: float = 0.1
    group_by: Literal["agent", "slot"] = Field("agent", description=(
        "agent-wise statistics per role (parallel same-role agents pooled) or per role slot"))
    loss: LossConfig = Field(default_factory=LossConfig)
    rollout_is: RolloutISConfig = Field(default_factory=RolloutISConfig)

    @field_validator("estimator")
    @classmethod
    def _estimator_registered(cls, v: str) -> str:
        from masrl.algorithms.advantages import ADVANTAGE_ESTIMATORS

        return _registered("estimator", v, sorted(ADVANTAGE_ESTIMATORS))


class RolloutConfig(_Strict):
    """The rollout engine: ``transformers`` (in-process, any device) or ``vllm`` (CUDA; docs/scaling.md)."""

    engine: Literal["transformers", "vllm"] = "transformers"
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0)
    enable_sleep_mode: bool = True
    sleep_level: Literal[0, 1, 2] = Field(1, description="release vLLM memory during updates (0: never)")
    max_model_len: Optional[int] = Field(None, gt=0)
    enforce_eager: bool = False
    dtype: Optional[Literal["float32", "bfloat16", "float16"]] = Field(None, description="None: the policy's")
    max_loras: int = Field(4, gt=0)
    kwargs: dict[str, Any] = Field(default_factory=dict, description="passed on to vllm.LLM")
    prefix_cache: bool = Field(True, description=(
        "transformers engine: prefill each distinct prompt of a call once (a GRPO group) and reuse the "
        "keys/values of earlier rows of the same rollout whose tokens start a new prompt (the next turn "
        "of an append-only transcript); vLLM has its own (rollout.kwargs.enable_prefix_caching)"))
    prefix_cache_mib: float = Field(1024.0, gt=0.0, description="memory for the stored keys/values per policy")


class SFTConfig(_Strict):
    """Cold-start supervised stage on teacher demonstrations (``steps: 0`` turns it off)."""

    steps: int = Field(0, ge=0)
    batch_size: int = Field(64, gt=0)
    lr: float = Field(3e-3, gt=0.0)
    warmup_steps: int = Field(20, ge=0)
    teacher: dict[str, Any] = Field(default_factory=dict)
    train_base: bool = Field(False, description=(
        "with LoRA policies: SFT trains the base weights too (a tiny model built from config starts "
        "random), then freezes them for RL"))
    filter_agents: list[str] = Field(default_factory=list, description=(
        "rejection-sampled SFT: drop these agents' demonstrations whose own answer scores incorrect "
        "(they still appear as context in later prompts)"))


class TrainerConfig(_Strict):
    total_steps: int = Field(50, ge=0)
    batch_size: int = Field(8, gt=0, description="tasks per step")
    group_size: int = Field(8, gt=0, description="episodes per task (G)")
    epochs: int = Field(1, gt=0)
    minibatches: int = Field(1, gt=0)
    micro_batch_tokens: int = Field(4096, gt=0, description=(
        "padded tokens (rows x longest row) per forward/backward micro-batch; 4096 since issue #7 (was 16384): "
        "quickstart update 0.74-0.84x the time, peak RSS 1.5-1.6 -> 0.9 GB on CPU (docs/performance.md)"))
    logprob_chunk_tokens: int = Field(1024, ge=0, description=(
        "the update, old/reference log-prob passes and SFT compute response-token log-probs and entropy from "
        "the last hidden states, this many tokens at a time (LM head, log-softmax and gather per chunk; "
        "backward recomputes each chunk), never materialising [tokens, vocabulary] logits; equal to the plain "
        "path within float32 rounding. 0: full logits (the plain path). docs/performance.md"))
    save_every: int = Field(0, ge=0)
    keep_checkpoints: int = Field(2, gt=0)
    log_every: int = Field(1, gt=0)
    threads: Optional[int] = Field(None, gt=0)
    device: str = "cpu"
    per_agent_grad_norm: bool = True
    skip_nonfinite: bool = True
    max_rollout_batch: int = Field(512, gt=0)
    autocast: Optional[Literal["bfloat16", "float16"]] = Field(None, description=(
        "mixed precision for the update's forward/backward (torch.autocast; float32 master weights, "
        "gradients and optimizer state, loss math in float32). The PPO old log-probs are then the "
        "trainer's own (free with 1 epoch x 1 minibatch), not the engine's. The in-process engine decodes "
        "under the same autocast. docs/performance.md"))
    export: bool = Field(False, description=(
        "at the end of `masrl train`, export the trained policies into RUN_DIR/export as Hugging Face / PEFT "
        "folders (as `masrl export RUN_DIR --out RUN_DIR/export`; docs/export.md)"))


class EvalConfig(_Strict):
    every: int = Field(0, ge=0, description="evaluate every N RL steps (0: only before/after)")
    n: int = Field(4, gt=0)
    k: list[Annotated[int, Field(gt=0)]] = Field(default_factory=lambda: [1, 4])
    temperature: Optional[float] = Field(None, ge=0.0)
    limit: Optional[int] = Field(None, gt=0)
    benches: list[str] = Field(default_factory=list)
    before_after: bool = True
    prices: dict[str, float] = Field(default_factory=dict,
                                     description="USD per 1M generated tokens, by policy (cost estimate)")


class SpikeConfig(_Strict):
    """Gradient-spike detector: robust z-score of each policy's and role's grad norm (docs/monitoring.md)."""

    action: Literal["log", "skip", "scale"] = "log"
    window: int = Field(50, ge=2)
    threshold: float = Field(6.0, gt=0.0)
    min_history: int = Field(10, ge=1)


class MonitoringConfig(_Strict):
    drift: bool = True
    kl_to_base: bool = Field(False, description=(
        "log agent/<a>/kl_ref (k3 to the reference: the initial model, or the base without adapters) "
        "even when algorithm.loss.kl_coef is 0; costs one extra no-grad forward per micro-batch"))
    spike: SpikeConfig = Field(default_factory=SpikeConfig)
    capture_threshold: float = Field(0.8, gt=0.0, lt=1.0, description="role-capture: grad-mass share")
    capture_patience: int = Field(10, ge=1, description="role-capture: consecutive steps")


class PlacementConfig(_Strict):
    """Where one policy's worker group runs (Ray runtime; docs/scaling.md). Unset keys inherit ``runtime``."""

    placement: Optional[Literal["colocated", "dedicated"]] = None
    workers: Optional[int] = Field(None, gt=0)
    cpus_per_worker: Optional[float] = Field(None, gt=0.0)
    gpus_per_worker: Optional[float] = Field(None, ge=0.0)
    offload: Optional[bool] = None


class RuntimeConfig(_Strict):
    """How policies are run: in this process (``local``) or as Ray worker groups (``ray``).

    With Ray, each policy is a group of ``workers`` actors (data-parallel ranks; rollout requests
    and training rows are sharded across them, gradients all-reduced with torch.distributed).
    ``colocated`` policies share one resource pool of ``workers`` bundles (the Dr. MAS default: each
    bundle's devices are time-sliced between the policies, idle ones offloaded to CPU when
    ``offload``); a ``dedicated`` policy gets a pool of its own.
    """

    kind: Literal["local", "ray"] = "local"
    address: Optional[str] = Field(None, description="existing Ray cluster ('auto', 'ray://host:10001'); "
                                                     "None starts a local one")
    num_cpus: Optional[int] = Field(None, gt=0, description="CPUs of a local Ray cluster")
    num_gpus: Optional[int] = Field(None, ge=0, description="GPUs of a local Ray cluster")
    dashboard: bool = False
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="torch.distributed backend inside a "
                                                                          "worker group (auto: nccl on CUDA)")
    placement: Literal["colocated", "dedicated"] = "colocated"
    workers: int = Field(1, gt=0, description="data-parallel actors per policy")
    cpus_per_worker: float = Field(1.0, gt=0.0)
    gpus_per_worker: float = Field(0.0, ge=0.0)
    offload: bool = Field(True, description="colocated: move idle policies' weights and optimizer state to CPU")
    policies: dict[str, PlacementConfig] = Field(default_factory=dict, description="per-policy overrides")

    def for_policy(self, name: str) -> PlacementConfig:
        """The effective placement of policy ``name`` (its overrides over the runtime defaults)."""
        own = self.policies.get(name, PlacementConfig())
        return PlacementConfig(**{k: (getattr(own, k) if getattr(own, k) is not None else getattr(self, k))
                                  for k in PlacementConfig.model_fields})


class LoggingConfig(_Strict):
    tensorboard: bool = True
    progress: bool = True
    plots: bool = True


class RunConfig(_Strict):
    seed: int = Field(0, ge=0, le=SEED_MAX)
    output_dir: str = "runs/{name}-{estimator}-seed{seed}"  # placeholders: {name} {estimator} {seed}
    name: str = "run"
    task: TaskConfig = Field(default_factory=TaskConfig)
    workflow: WorkflowConfig = Field(default_factory=WorkflowConfig)
    agents: dict[str, AgentConfig]
    policies: dict[str, PolicyConfig]
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    monitoring: MonitoringConfig = Field(default_factory=MonitoringConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)

    @model_validator(mode="after")
    def _runtime_names_policies(self):
        unknown = sorted(set(self.runtime.policies) - set(self.policies))
        if unknown:
            raise ValueError(f"runtime.policies names unknown policies {unknown}; declared: {sorted(self.policies)}")
        colocated = {n: self.runtime.for_policy(n).workers for n in self.policies
                     if self.runtime.for_policy(n).placement == "colocated"}
        if len(set(colocated.values())) > 1:
            raise ValueError(f"colocated policies share one resource pool and need the same number of workers; "
                             f"got {colocated}: make them equal or set placement: dedicated")
        return self

    @model_validator(mode="after")
    def _vllm_engines_fit_on_a_device(self):
        """Colocated vLLM engines (all policies in the local runtime) are awake together during rollout."""
        if self.rollout.engine != "vllm":
            return self
        if self.runtime.kind == "ray":
            sharing = sum(1 for n in self.policies if self.runtime.for_policy(n).placement == "colocated")
        else:
            sharing = len(self.policies)
        total = sharing * self.rollout.gpu_memory_utilization
        if total > 0.95:
            raise ValueError(f"rollout.gpu_memory_utilization = {self.rollout.gpu_memory_utilization} for each of "
                             f"{sharing} vLLM engines sharing a GPU is {total:.2f} of its memory; keep the product "
                             f"under 0.95 (e.g. {0.9 / sharing:.2f}) or give policies dedicated placement")
        return self

    @model_validator(mode="after")
    def _mapping_is_complete(self):
        for agent, acfg in self.agents.items():
            if acfg.policy not in self.policies:
                raise ValueError(f"agents.{agent}.policy = {acfg.policy!r} is not a declared policy; "
                                 f"declared: {sorted(self.policies)}")
        unused = sorted(set(self.policies) - {a.policy for a in self.agents.values()})
        if unused:
            raise ValueError(f"policies {unused} are not used by any agent; map an agent to them or remove them")
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir.replace("{name}", self.name).replace("{seed}", str(self.seed))
                    .replace("{estimator}", self.algorithm.estimator))


# ----------------------------------------------------------------------------- loading

CONFIG_MAX_BYTES = 1 << 20  # a config file is a few KB
YAML_MAX_DEPTH = 64  # nesting of mappings/lists in one config file
YAML_MAX_NODES = 100_000  # values in a config once every alias is expanded (a real config has hundreds)


class _YamlLimit(Exception):
    def __init__(self, message: str, mark=None):
        super().__init__(message)
        self.mark = mark


class _BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses nesting deeper than ``YAML_MAX_DEPTH`` while composing (the
    composer recurses: 20,000 levels were a RecursionError) and aliases that expand to more than
    ``YAML_MAX_NODES`` values or refer to themselves (an alias bomb expands exponentially)."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > YAML_MAX_DEPTH:
                raise _YamlLimit(f"nested deeper than {YAML_MAX_DEPTH} levels", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _children(node) -> list:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def _expanded_size(root) -> int:
    """Values in the document with every alias expanded (iterative; shared nodes counted per use)."""
    sizes: dict[int, int] = {}
    stack, open_ = [(root, False)], set()
    while stack:
        node, done = stack.pop()
        if done:
            open_.discard(id(node))
            sizes[id(node)] = min(1 + sum(sizes[id(c)] for c in _children(node)), YAML_MAX_NODES + 1)
            continue
        if id(node) in sizes:
            continue
        if id(node) in open_:
            raise _YamlLimit("an alias refers to a value that contains it (a recursive structure)", node.start_mark)
        open_.add(id(node))
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in sizes)
    return sizes[id(root)]


def _load_bounded(text: str) -> Any:
    loader = _BoundedLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None and _expanded_size(node) > YAML_MAX_NODES:
            raise _YamlLimit(f"aliases expand to more than {YAML_MAX_NODES:,} values (an alias bomb?); "
                             "write the values out or use fewer aliases", node.start_mark)
        return loader.construct_document(node) if node is not None else None
    finally:
        loader.dispose()


def _where(mark) -> str:
    return f":{mark.line + 1}:{mark.column + 1}" if mark else ""


def load_yaml(text: str, source: str) -> Any:
    """Parse one YAML document of a config with the limits of ``_BoundedLoader``.

    Errors are one ``ConfigError`` naming ``source`` and, where known, the line and column.
    """
    try:
        return _load_bounded(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise ConfigError(f"{source}{_where(mark)}: malformed YAML ({getattr(e, 'problem', e)})") from None
    except _YamlLimit as e:
        raise ConfigError(f"{source}{_where(e.mark)}: YAML refused: {e}") from None


def _parse_scalar(text: str, item: str = "") -> Any:
    """An override's value as YAML (``5`` is a number, ``[1, 4]`` a list); text that is not YAML stays text."""
    try:
        return _load_bounded(text)
    except yaml.YAMLError:
        return text
    except _YamlLimit as e:
        raise ConfigError(f"override {item!r}: YAML refused: {e}") from None


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` overrides (values parsed as YAML scalars/lists)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key.path=value")
        key, _, raw = item.partition("=")
        parts = key.strip().split(".")
        node = data
        for part in parts[:-1]:
            if not isinstance(node.get(part, {}), dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node = node.setdefault(part, {})
        node[parts[-1]] = _parse_scalar(raw, item)
    return data


def _format_error(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            lines.append(f"{source}: unknown key '{loc}' (check the spelling; see the config reference "
                         "in docs/training.md)")
        elif e["type"] == "missing":
            lines.append(f"{source}: missing required key '{loc}'")
        else:
            got = e.get("input")
            got = f" (got {got!r})" if not isinstance(got, dict) else ""
            lines.append(f"{source}: key '{loc}': {e['msg'].removeprefix('Value error, ')}{got}")
    return "\n".join(lines)


def config_from_dict(data: dict, source: str = "<config>") -> RunConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of keys, got {type(data).__name__}")
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_error(e, source)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        text = read_user_text(path, "config file", max_bytes=CONFIG_MAX_BYTES)
    except UserInputError as e:
        raise ConfigError(str(e)) from None
    data = load_yaml(text, str(path)) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys")
    data = apply_overrides(data, overrides or [])
    return config_from_dict(data, str(path))


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
