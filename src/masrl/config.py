"""The run configuration: YAML -> pydantic models. The one place defaults live.

Errors name the key, the file and what was expected (``ConfigError``; the CLI exits 2).
Dotted overrides from the command line: ``trainer.total_steps=50 algorithm.estimator=grpo``.
"""
from __future__ import annotations

import collections.abc
import difflib
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from masrl.errors import ConfigError, clip, quote  # noqa: F401 (ConfigError lives on here)
from masrl.io import bounded_yaml
from masrl.io.bounded_yaml import YamlLimit, load_bounded


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


_CHOSEN_BY_MEMORY = (" with trainer.memory_defaults: true, `masrl train` and `masrl eval` choose it from the model and the "
                     "machine's memory when the config leaves it unset (masrl.plan.memory; one line says what)")


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
    """Where tasks come from: a synthetic task, a registered benchmark, or ``dataset`` (your own files)."""

    name: str = Field("arithmetic", description=(
        "task source: arithmetic, synthetic_kb, kb_fact_check (a judge's yes/no fact checks), a math/QA/code "
        "benchmark name (gsm8k_train, nq_search, mbpp, ...) "
        "or dataset (your files or a Hugging Face dataset: train, test, format, fields, reward in params)"))
    params: dict[str, Any] = Field(default_factory=dict, description=(
        "the source's options (dataset: {train: PATH or hf:ID[:split], test: ..., format: jsonl|json|parquet|hf, "
        "fields: {question: ..., answer: ...}, reward: math|qa_em|qa_f1|code|pkg.module:function}); "
        "docs/training.md"))
    train_limit: Optional[int] = Field(None, ge=0, description="use only the first N training tasks")
    test_limit: Optional[int] = Field(None, ge=0, description="use only the first N held-out tasks")
    strict: bool = Field(False, description=(
        "stop at the first data row that does not parse (else it is skipped with a warning naming file and line)"))
    reward_timeout_s: float = Field(10.0, gt=0.0, le=86400.0, description=(
        "deadline of one call of a user reward (task.params.reward: 'file.py:function' or 'pkg.module:function'); "
        "a call past it scores 0 (reason reward_timeout) and is counted in reward/timeouts; its worker process "
        "is stopped (its thread abandoned under reward_isolation: thread); docs/reliability.md"))
    reward_isolation: Literal["auto", "process", "thread"] = Field("auto", description=(
        "where a user reward's calls run: process (a worker process of its own: a call past its deadline is "
        "stopped, a crash is one failed call), thread (a worker thread of the trainer: the reward shares its "
        "state, but a call holding the interpreter lock cannot be stopped), auto (process, or thread for a "
        "function a separate process cannot import); docs/reliability.md"))
    reward_max_error_share: float = Field(1.0, gt=0.0, le=1.0, description=(
        "the run stops (exit 2) when the reward fails (raises, returns no finite number, times out) on at least "
        "this share of a step's or an evaluation's calls; 1.0: when every call fails. Failures are counted in "
        "reward/errors and reward/timeouts"))


class WorkflowConfig(_Strict):
    """The plain-Python episode the agents play (docs/workflows.md)."""

    name: str = Field("math_solver_verifier", description=(
        "a registered workflow (math_solver_verifier, search_verifier_router, voting, ...) or 'pkg.module:function'"))
    params: dict[str, Any] = Field(default_factory=dict, description=(
        "the workflow's parameters (e.g. max_loops). Workflows external and environment (user code, "
        "docs/reliability.md): timeout_s, the deadline of one episode's program or environment (300); "
        "max_error_share, the run stops (exit 2) when its failed episodes (raised, timed out, made no model call) "
        "reach this share of a rollout's episodes, or of the SFT demonstrations' (1.0: when every one fails), counted "
        "in usercode/program/* or usercode/environment/*"))
    prompts: dict[str, str] = Field(default_factory=dict, description="prompt templates replacing the workflow's "
                                                                       "defaults, by template name")


class AgentOptimConfig(_Strict):
    """Per-agent optimizer overrides; unset keys inherit the policy's ``optim``."""

    lr: Optional[float] = Field(None, gt=0.0, description="learning rate of this agent's parameters")
    betas: Optional[tuple[float, float]] = Field(None, description="AdamW betas of this agent's parameters")
    weight_decay: Optional[float] = Field(None, ge=0.0, description="AdamW weight decay of this agent's parameters")
    eps: Optional[float] = Field(None, gt=0.0, description="AdamW epsilon of this agent's parameters")


class AgentConfig(_Strict):
    """One role of the workflow: which policy plays it and how it samples."""

    policy: str = Field(description="the policy (a key of policies) that plays this agent")
    temperature: float = Field(1.0, ge=0.0, description="sampling temperature")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling threshold")
    max_new_tokens: int = Field(256, gt=0, le=1 << 20, description=(
        "longest response of one turn, in tokens (at most 2^20: the engine allocates its KV cache for it)"))
    system_prompt: Optional[str] = Field(None, description="system message of the chat template")
    optim: Optional[AgentOptimConfig] = Field(None, description=(
        "optimizer overrides for this agent's own LoRA adapter (a policy with lora.per_agent: true): a parameter "
        "group of the policy's AdamW"))


class OptimConfig(_Strict):
    """The policy's AdamW optimizer."""

    lr: float = Field(1e-6, gt=0.0, description="learning rate")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    weight_decay: float = Field(0.01, ge=0.0, description="AdamW decoupled weight decay")
    grad_clip: Optional[float] = Field(1.0, gt=0.0, description="clip the gradient norm to this (None: no clipping)")
    eps: float = Field(1e-8, ge=0.0, description="AdamW epsilon")
    fused: Union[bool, Literal["auto"]] = Field("auto", description=(
        "torch's fused AdamW kernel: 6.3x faster steps on SmolLM2-135M (528 -> 84 ms on CPU), equal up to float "
        "rounding; auto: fused when the policy trains at least 10M parameters on CPU or CUDA (below that a step "
        "saves under 10 ms, and small models keep the reference kernel's exact numbers)"))


class LoraConfig(_Strict):
    """LoRA adapters on a frozen base (docs/lora.md)."""

    r: int = Field(8, gt=0, description="adapter rank")
    alpha: float = Field(16.0, description="LoRA scaling numerator (scale = alpha / r)")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapter's input")
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
                                      description="module names that get adapters")
    per_agent: bool = Field(False, description=(
        "Isolated-Policy: one adapter per agent mapped to this policy, all trained in one optimizer step "
        "from one mixed batch; false: one adapter shared by the policy's agents (Shared-Policy)"))
    init_from: Optional[str] = Field(None, description=(
        "folder holding one PEFT adapter folder per adapter name (a role, or the policy's name when shared), "
        "as `masrl export` writes in POLICY/adapters: the adapters start from those weights instead of zero"))


class PolicyConfig(_Strict):
    """A trainable model: ``model`` is ``tiny``, an alias, a hub id or a local folder."""

    model: str = Field("tiny", description="tiny (built from config), an alias (smollm2), a hub id or a local folder")
    tiny: dict[str, Any] = Field(default_factory=dict, description="the tiny model's architecture (hidden_size, ...)")
    tokenizer: Optional[str] = Field(None, description="a tokenizer other than the model's own (hub id or folder)")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="weight dtype")
    trainable: bool = Field(True, description="false: a frozen policy (no optimizer, no updates)")
    trust_remote_code: bool = Field(False, description="run the model repository's own Python code (off for safety)")
    lora: Optional[LoraConfig] = Field(None, description="train LoRA adapters instead of the full model")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="the policy's AdamW settings")
    init_seed: Optional[int] = Field(None, ge=0, le=SEED_MAX, description="seed of a tiny model's random init "
                                                                           "(None: the run's seed)")
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict, description=(
        "extra arguments of the tokenizer's chat template (Qwen3: {enable_thinking: false})"))
    gradient_checkpointing: bool = Field(False, description=(
        "recompute activations in backward (memory for time, ~+50 % of a LoRA update's compute);"
        + _CHOSEN_BY_MEMORY))

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
    """``value`` if it is one of ``known`` (a tuple of masrl.algorithms choices), else one error listing them
    (a registry name is checked by its registry, ``masrl.registry``)."""
    if value not in known:
        raise ValueError(f"unknown {kind} {quote(value)}; known: {', '.join(known)}")
    return value


class LossConfig(_Strict):
    """The policy loss on response tokens (docs/algorithms.md). Choices are checked against
    masrl.algorithms (``LOSSES``, ``AGG_MODES``, ``KL_KINDS``), so a loss added with ``@register_loss`` is
    accepted here."""

    loss: str = Field("ppo", description="a name in masrl.algorithms.LOSSES: ppo (token ratios), gspo "
                                         "(sequence-level ratio), or one added with @register_loss")
    clip_low: float = Field(0.2, ge=0.0, description="ratio clip below 1 (1 - clip_low)")
    clip_high: float = Field(0.2, ge=0.0, description="ratio clip above 1 (1 + clip_high; clip-higher when larger)")
    dual_clip: Optional[float] = Field(None, gt=1.0, description="dual-clip constant c for negative advantages")
    agg: str = Field("token-mean", description=(
        "token-mean, seq-mean-token-mean, seq-mean-token-sum-norm, or role-balanced: token mean within each agent, "
        "then the mean over the agents in the policy batch (every role the same weight; docs/algorithms.md)"))
    kl_coef: float = Field(0.0, ge=0.0, description="weight of the KL to the reference policy (0: off)")
    kl_kind: str = Field("k3", description="KL estimator: k1, k2, k3")
    entropy_coef: float = Field(0.0, description="entropy bonus weight")

    @field_validator("loss")
    @classmethod
    def _loss_registered(cls, v: str) -> str:
        from masrl.algorithms.losses import LOSSES  # imports torch: only when a config is validated

        LOSSES.get(v)  # the registry's error on an unknown name (known names listed; plugins loaded)
        return v

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

    enabled: bool = Field(False, description="weight the loss by the trainer/rollout importance ratio")
    cap: float = Field(2.0, gt=0.0, description="the ratio's cap")
    level: Literal["token", "sequence", "geometric"] = Field("token", description="ratio per token or per sequence")
    mode: Literal["truncate", "mask"] = Field("truncate", description="truncate at cap, or mask tokens above it")


class DynamicSamplingConfig(_Strict):
    """Dynamic sampling (DAPO): groups, or a group's roles, with no learning signal stay out of the loss
    (docs/algorithms.md, "Dynamic sampling")."""

    filter: Literal["none", "group", "role"] = Field("none", description=(
        "none: train on every turn; group: drop a group in which no turn has a signal (every statistic set of "
        "the estimator constant); role: drop only the dead sets under the estimator's own grouping (per group "
        "and agent for drmas; per group for grpo, where role equals group)"))
    refill: bool = Field(False, description=(
        "draw further tasks until trainer.batch_size groups have a signal, or max_rounds generation rounds "
        "are spent (then train on what there is, and say so)"))
    max_rounds: int = Field(3, ge=1, le=1000, description="generation rounds per RL step at most, with refill")


class SoftOverlongConfig(_Strict):
    """DAPO's soft overlong punishment: linear in the last ``buffer_tokens`` before the agent's max_new_tokens."""

    buffer_tokens: int = Field(gt=0, description=(
        "L_cache: a turn of |y| tokens under the agent's limit L_max gets ((L_max - L_cache) - |y|) / L_cache "
        "x factor added to its score when |y| > L_max - L_cache (-factor at the limit)"))
    factor: float = Field(1.0, ge=0.0, description="the penalty at the limit (DAPO: 1)")


class OverlongConfig(_Strict):
    """Turns cut at the agent's ``max_new_tokens`` (``turn.truncated``): mask them, shape their score, or both."""

    mask: bool = Field(False, description=(
        "leave truncated turns out of the loss (they still count in the advantages' statistics; counted "
        "as agent/<a>/overlong_masked)"))
    soft_penalty: Optional[SoftOverlongConfig] = Field(None, description="DAPO's length penalty (None: off)")


class AlgorithmConfig(_Strict):
    """Rewards, advantages and the loss (docs/algorithms.md)."""

    estimator: str = Field("drmas", description=(
        "advantage estimator, a name in masrl.algorithms.ADVANTAGE_ESTIMATORS: drmas (agent-wise), grpo, "
        "drmas_mean_only, drmas_std_only, rloo, ..."))
    eps: float = Field(1e-6, ge=0.0, description="added to the standard deviation")
    unbiased_std: bool = Field(True, description="standard deviation with N-1 (as the reference)")
    singleton: Literal["zero", "raw"] = Field("zero", description="advantage of a group of one value: 0 or the "
                                                                   "raw score")
    format_penalty: float = Field(0.1, description="subtracted from the score of an invalid (malformed) turn")
    reward: Literal["team", "per_turn"] = Field("team", description=(
        "team: every turn scores the team reward (Dr. MAS); per_turn: a turn scores its own reward when the "
        "reward function set one (turn.reward), else the team reward; an own reward whose turn carries "
        "info['reward_class'] is class-balanced within the step (masrl.trainer.class_weights)"))
    group_by: Literal["agent", "slot"] = Field("agent", description=(
        "agent-wise statistics per role (parallel same-role agents pooled) or per role slot"))
    loss: LossConfig = Field(default_factory=LossConfig, description="the policy loss")
    rollout_is: RolloutISConfig = Field(default_factory=RolloutISConfig, description=(
        "truncated importance sampling between trainer and rollout engine"))
    role_stages: Optional[list[list[str]]] = Field(None, description=(
        "staged updates: groups of agents that take turns at training, e.g. [[Generator], [Aggregator]]; at RL "
        "step t only the agents of group (t-1) // role_stage_steps mod len(groups) are trained (the others' turns "
        "are rolled out and scored, their advantages computed as usual, but left out of the loss). Every agent "
        "in at least one group; None: every agent every step. docs/algorithms.md"))
    role_stage_steps: int = Field(1, ge=1, description="RL steps each group of algorithm.role_stages trains in a row")
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig, description=(
        "filter groups or roles without a learning signal, and refill the batch"))
    overlong: OverlongConfig = Field(default_factory=OverlongConfig, description=(
        "truncated turns: mask from the loss, soft length penalty"))

    @field_validator("estimator")
    @classmethod
    def _estimator_registered(cls, v: str) -> str:
        from masrl.algorithms.advantages import ADVANTAGE_ESTIMATORS

        ADVANTAGE_ESTIMATORS.get(v)  # the registry's error on an unknown name (known names listed; plugins loaded)
        return v

    @model_validator(mode="after")
    def _filter_knows_estimator(self) -> "AlgorithmConfig":
        from masrl.algorithms.dynamic_sampling import SIGNAL_GROUPING

        if self.dynamic_sampling.filter != "none" and self.estimator not in SIGNAL_GROUPING:
            raise ValueError(f"dynamic_sampling.filter {self.dynamic_sampling.filter!r} needs the signal grouping of "
                             f"estimator {self.estimator!r}; name it with masrl.algorithms.register_signal_grouping")
        return self


class RolloutConfig(_Strict):
    """The rollout engine: ``transformers`` (in-process, any device) or ``vllm`` (CUDA; docs/scaling.md)."""

    engine: Literal["transformers", "vllm"] = Field("transformers", description="the rollout engine")
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0, description="vLLM: share of the GPU per engine")
    enable_sleep_mode: bool = Field(True, description="vLLM: allow releasing its memory during updates")
    sleep_level: Literal[0, 1, 2] = Field(1, description="release vLLM memory during updates (0: never)")
    max_model_len: Optional[int] = Field(None, gt=0, description="vLLM: longest sequence (None: the model's)")
    enforce_eager: bool = Field(False, description="vLLM: no CUDA graphs")
    dtype: Optional[Literal["float32", "bfloat16", "float16"]] = Field(None, description="None: the policy's")
    max_loras: int = Field(4, gt=0, description="vLLM: adapters served at once")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="passed on to vllm.LLM")
    prefix_cache: bool = Field(True, description=(
        "transformers engine: prefill each distinct prompt of a call once (a GRPO group) and reuse the "
        "keys/values of earlier rows of the same rollout whose tokens start a new prompt (the next turn "
        "of an append-only transcript); vLLM has its own (rollout.kwargs.enable_prefix_caching)"))
    prefix_cache_mib: float = Field(1024.0, gt=0.0, description=(
        "memory for the stored keys/values per policy; the size decides which prefixes are reused, and a reused "
        "prefix's keys/values differ from a recomputed one's by float rounding, so another size can change the "
        "sampled tokens (not bitwise the same run);" + _CHOSEN_BY_MEMORY))
    keep_decode_weights: bool = Field(True, description=(
        "transformers engine on a CPU under bf16 autocast: keep the decode-only copies of the weights (prepacked "
        "bf16 Linear weights, the fast decoder's stacked weights; ~1.5x the parameters in bf16) through the update "
        "(false: released before each update and rebuilt by the next decode, ~0.4 s for SmolLM2-135M, the same "
        "tokens);" + _CHOSEN_BY_MEMORY))
    max_prefill_tokens: Optional[int] = Field(None, gt=0, description=(
        "transformers engine: most prompt tokens (rows x their padded length) one prefill forward runs; a call's "
        "rows are prefilled in row ranges within it (chunked prefill, as vLLM's max_num_batched_tokens), so the "
        "forward's short-lived activations stay small: long prompts, many rows (None: every row of a call in one "
        "forward, or in up to 4 ranges where that saves padding). Rounding may differ from one forward, so the "
        "sampled tokens can"))
    compile_decode: bool = Field(False, description=(
        "transformers engine on CPU: the fast decode step of the base model (rows without LoRA adapters) as one "
        "graph compiled with inductor (masrl.models.compiled_decode: one shape-generic graph for every row count "
        "and length, cached across runs under the masrl cache folder); log-probs within bf16 / float32 rounding "
        "of the eager step. Needs a C++ compiler that builds inductor's kernels (else eager, one warning; a "
        "compiled step that fails is run eager, and so is the rest of the process, one warning). Off "
        "by default: measured 0.99-1.10x the eager step's time, and the first call compiles for ~0.5-1 min "
        "(docs/performance.md, \"compiled decode step\")"))
    continuous_batching: bool = Field(False, description=(
        "transformers engine: one running decode batch per policy that admits each agent call as its episode "
        "makes it (no barrier per round: a team's next turn joins while other rows still decode) and returns "
        "each row as soon as it stops; greedy results equal the batched engine's, sampled rows draw another "
        "random stream (docs/performance.md). vLLM and Ray worker groups keep the per-round flush"))
    max_running_tokens: int = Field(65536, gt=0, description=(
        "continuous batching: admission limit of the running batch, rows x their longest prompt + "
        "max_new_tokens (rows are also limited by trainer.max_rollout_batch)"))
    max_staleness: int = Field(0, ge=0, le=64, description=(
        "k > 0: the batches of steps t+1..t+k are generated (in a thread, with weights of their own replaced at "
        "each update) while step t trains; every turn carries the policy version that sampled it and the trainer "
        "never trains on a turn more than k versions old (docs/scaling.md, off-policy rollouts). Local runtime "
        "and Ray worker groups (strategy replica), transformers and vLLM engines, continuous batching too. "
        "0: on-policy, rollout then update"))
    stale: Literal["wait", "drop"] = Field("wait", description=(
        "with max_staleness: wait (a batch starts only when none of its turns can be more than k versions old "
        "when it trains) or drop (the producer runs one batch further ahead; turns more than k versions old are "
        "left out of the loss, counted as rollout/stale_dropped)"))


class ToolsConfig(_Strict):
    """Limits of the tools agents call through ``team.chat`` (docs/reliability.md, "User code: tools and episodes")."""

    timeout_s: float = Field(5.0, gt=0.0, le=86400.0, description=(
        "deadline of one tool call (a tool's own timeout_s, workflow.params.tool_timeout_s or team.chat(timeout_s=) "
        "win); a call past it is a timeout observation, counted in tool/timeouts, its thread abandoned "
        "(tool/abandoned_threads)"))


class SFTConfig(_Strict):
    """Cold-start supervised stage on teacher demonstrations (``steps: 0`` turns it off)."""

    steps: int = Field(0, ge=0, description="SFT steps (0: no SFT)")
    batch_size: int = Field(64, gt=0, description="demonstration turns per SFT step")
    lr: float = Field(3e-3, gt=0.0, description="peak SFT learning rate (warmup, then cosine)")
    warmup_steps: int = Field(20, ge=0, description="linear warmup steps")
    teacher: dict[str, Any] = Field(default_factory=dict, description="the task's teacher options (error_rate, ...)")
    train_base: bool = Field(False, description=(
        "with LoRA policies: SFT trains the base weights too (a tiny model built from config starts "
        "random), then freezes them for RL"))
    filter_agents: list[str] = Field(default_factory=list, description=(
        "rejection-sampled SFT: drop these agents' demonstrations whose own answer scores incorrect "
        "(they still appear as context in later prompts)"))
    concurrency: int = Field(8, gt=0, le=1024, description=(
        "workflow external and environment: programs (episodes) run at once to collect the demonstrations, each task drawing the teacher's "
        "noise from its own stream (1: one after another from one stream, as a built-in workflow's); collection "
        "stops once every policy has steps x batch_size demonstrations, all SFT draws"))


class TrainerConfig(_Strict):
    """The RL loop: batch sizes, update schedule, checkpoints, device."""

    total_steps: int = Field(50, ge=0, description="RL steps")
    batch_size: int = Field(8, gt=0, le=65536, description="tasks per step")
    group_size: int = Field(8, gt=0, le=4096, description=(
        "episodes per task (G); batch_size x group_size episodes per step, at most 2^20"))
    epochs: int = Field(1, gt=0, description="passes over each step's turns")
    minibatches: int = Field(1, gt=0, description="optimizer steps per epoch (the turns split in this many parts)")
    micro_batch_tokens: int = Field(4096, gt=0, description=(
        "padded tokens (rows x longest row) per forward/backward micro-batch; on the CPU quickstart 4096 takes "
        "0.75-0.84x the update time of 16384 and 0.8-0.9 GB instead of 1.5-1.6 GB peak RSS (benchmarks/RESULTS.md);"
        + _CHOSEN_BY_MEMORY))
    logprob_chunk_tokens: int = Field(1024, ge=0, description=(
        "> 0: the update, old/reference log-prob passes and SFT compute response-token log-probs and entropy "
        "from the last hidden states, this many tokens at a time (LM head, log-softmax and gather per chunk; "
        "backward recomputes each chunk), never materialising [tokens, vocabulary] logits; equal to the plain "
        "path within float32 rounding, not bit-identical. 0: full logits (the plain path; the default under "
        "runtime.strategy fsdp, which does not support chunks). docs/performance.md"))
    compile: Literal["auto", "on", "off"] = Field("auto", description=(
        "the update's decoder layers as compiled graphs (torch.compile with inductor: forward and backward; the "
        "first micro-batch shape static, then one shape-generic graph; cached across runs under the masrl cache "
        "folder). auto: on a CPU with native bf16 and a C++ compiler that builds inductor's kernels (a small "
        "function compiled first; a compiler without Python's headers fails it), for policies without LoRA or gradient "
        "checkpointing, in runs of at least masrl.models.compiled_layers.AUTO_MIN_STEPS RL steps (the measured "
        "break-even); on: wherever the compiler and the policy allow; off: eager. One line says what runs and "
        "why. docs/performance.md"))
    save_every: int = Field(10, ge=0, description=(
        "checkpoint every N RL steps, besides the ones after the cold start and at the end (a run killed midway "
        "resumes from the last; 0: only those two)"))
    keep_checkpoints: int = Field(2, gt=0, description="checkpoints kept, the newest (older ones deleted)")
    log_every: int = Field(1, gt=0, description="log metrics every N steps")
    threads: Optional[int] = Field(None, gt=0, le=4096, description="torch CPU threads (None: torch's default)")
    tune_malloc: Literal[True, False, "lean"] = Field(True, description=(
        "glibc (Linux) malloc settings, process-wide (masrl.runtime.malloc; results bitwise the same in every "
        "mode). true: serve every tensor from malloc's heap and keep freed memory (up to 2 GiB) for reuse, "
        "instead of a fresh mmap per large tensor that is faulted in page by page (a SmolLM2-135M update: ~360k "
        "-> ~3.5k page faults, 8.1 -> 5.6 CPU s); the heap stays near its high-water mark. lean: every block "
        "above 128 KiB is its own mapping, handed back on free (as MALLOC_MMAP_THRESHOLD_=131072): the least "
        "memory (a SmolLM2 team run 2.0-2.3 vs 8.3-10.6 GB), ~1.5x the step time. false: glibc's defaults. "
        "With true and trainer.memory_defaults the trainer hands the heap's free memory back with malloc_trim at "
        "its phase boundaries (after SFT, around each evaluation, before each update) and its in-process engines "
        "after each decoded batch." + _CHOSEN_BY_MEMORY))
    memory_defaults: bool = Field(False, description=(
        "true: masrl train and masrl eval choose the memory settings the config leaves unset (micro_batch_tokens, "
        "max_rollout_batch, rollout.prefix_cache_mib, rollout.keep_decode_weights, gradient checkpointing, "
        "tune_malloc, primitive_cache) from the model and the machine's memory, one line says what, and the trainer "
        "hands the heap's free memory back at its phase boundaries and after each decoded batch (masrl.plan.memory; "
        "a run then depends on the machine's memory; the SmolLM2 team example ships it on: 3.3 vs 7.4 GiB peak RSS in "
        "float32, 0.97x the CPU seconds; 2.9-3.0 GiB under bf16 autocast); false: the fixed defaults, the same run on "
        "every machine"))
    primitive_cache: Optional[int] = Field(None, ge=1, le=1_000_000, description=(
        "entries of oneDNN's primitive cache and of PyTorch's ideep cache in front of it (ONEDNN_PRIMITIVE_CACHE_"
        "CAPACITY, LRU_CACHE_CAPACITY), set for the process before a model is built (each Ray policy worker too); "
        "a capacity the environment already sets is kept. bf16 matmuls on a CPU add an entry of ~0.6-0.85 MiB per "
        "new shape: with the libraries' 1024 the SmolLM2 team's heap grew ~0.6 GiB over its first steps, with 64 it "
        "stayed flat in the same step time (masrl.runtime.malloc.cap_primitive_caches). null: the libraries' "
        "defaults." + _CHOSEN_BY_MEMORY))
    device: str = Field("cpu", description="cpu, cuda, cuda:1, mps")
    per_agent_grad_norm: bool = Field(True, description="log each agent's gradient norm (one extra backward "
                                                         "bookkeeping per agent)")
    skip_nonfinite: bool = Field(True, description="skip an optimizer step whose gradient is NaN/inf")
    max_rollout_batch: int = Field(512, gt=0, description=(
        "most sequences decoded together per policy (an engine call with more decodes them in several batches);"
        + _CHOSEN_BY_MEMORY))
    autocast: Optional[Literal["auto", "bfloat16", "float16", "float32"]] = Field("auto", description=(
        "mixed precision for the update's forward/backward (torch.autocast; float32 master weights, "
        "gradients and optimizer state, loss math in float32). auto: bfloat16 on a CUDA device with native "
        "bf16 and on a CPU with avx512_bf16 or amx_bf16 in its flags, else float32; float32 or null: off. "
        "With autocast on, the PPO old log-probs are the trainer's own (free with 1 epoch x 1 minibatch), not "
        "the engine's. The in-process engine decodes, and SFT trains, under the same autocast. "
        "docs/performance.md#precision"))
    export: bool = Field(False, description=(
        "at the end of `masrl train`, export the trained policies into RUN_DIR/export as Hugging Face / PEFT "
        "folders (as `masrl export RUN_DIR --out RUN_DIR/export`; docs/export.md)"))
    merge_conversations: bool = Field(False, description=(
        "train an agent's turn that extends its earlier turn in the episode (team.chat: same tokens up to the "
        "earlier reply) in one row with it, the tokens between them (tool output) masked out of the loss, so "
        "the prefix is encoded once; the same loss and gradient under loss ppo + agg token-mean, which it "
        "requires (masrl/training/conversation.py)"))

    @model_validator(mode="after")
    def _episodes_per_step_bounded(self):
        if self.batch_size * self.group_size > 1 << 20:
            raise ValueError(f"batch_size x group_size = {self.batch_size * self.group_size:,} episodes per step; "
                             "at most 2^20 (1,048,576): lower trainer.batch_size or trainer.group_size")
        return self


class EvalConfig(_Strict):
    every: int = Field(0, ge=0, description="evaluate every N RL steps (0: only before/after)")
    n: int = Field(4, gt=0, le=4096, description="samples per task (avg@n)")
    k: list[Annotated[int, Field(gt=0)]] = Field(default_factory=lambda: [1, 4],
                                                 description="k values of pass@k and maj@k")
    temperature: Optional[float] = Field(None, ge=0.0, description="sampling temperature (None: each agent's)")
    limit: Optional[int] = Field(None, gt=0, description="tasks per benchmark (None: all)")
    benches: list[str] = Field(default_factory=list, description="benchmarks besides the held-out split")
    before_after: bool = Field(True, description="evaluate before RL (after SFT) and at the end")
    prices: dict[str, float] = Field(default_factory=dict,
                                     description="USD per 1M generated tokens, by policy (cost estimate)")


class SpikeConfig(_Strict):
    """Gradient-spike detector: robust z-score of each policy's and role's grad norm (docs/monitoring.md)."""

    action: Literal["log", "skip", "scale"] = Field("log", description="on a spike: log it, skip the step, or "
                                                                        "scale the gradient down")
    window: int = Field(50, ge=2, description="steps of history")
    threshold: float = Field(6.0, gt=0.0, description="robust z-score that counts as a spike")
    min_history: int = Field(10, ge=1, description="steps before the detector acts")


class CollapseConfig(_Strict):
    """Collapse detector: team reward and each agent's length, entropy, invalid share against running baselines
    (masrl.monitoring.collapse; docs/monitoring.md)."""

    action: Literal["log", "stop", "rollback"] = Field("log", description=(
        "on a collapse event: log it; stop RL after the step; or stop and restore the newest checkpoint saved "
        "before the first breach (final evaluation, report and export are of those weights)"))
    window: int = Field(10, ge=1, description="accepted steps in each signal's running median")
    min_history: int = Field(2, ge=1, description="accepted steps before a signal is judged")
    patience: int = Field(2, ge=1, description="consecutive breaching steps that raise an event")
    reward_drop: float = Field(0.5, gt=0.0, lt=1.0, description="breach: team reward below this x its baseline")
    reward_floor: float = Field(0.05, ge=0.0, description="the reward is judged only while its baseline is at "
                                                          "least this")
    length_ratio: float = Field(1.5, gt=1.0, description="breach: mean reply length beyond baseline x/÷ this")
    entropy_ratio: float = Field(1.5, gt=1.0, description="breach: entropy above baseline x this ...")
    entropy_floor: float = Field(0.05, ge=0.0, description="... and above baseline + this (nats)")
    invalid_rise: float = Field(0.2, gt=0.0, le=1.0, description="breach: invalid-turn share above baseline + this")


class NoSignalConfig(_Strict):
    """RL steps in which every advantage is 0 (masrl.monitoring.signal; docs/monitoring.md)."""

    action: Literal["log", "stop"] = Field("log", description=(
        "after `patience` such steps in a row: warn (again after a step with signal), or stop the run (exit 2)"))
    patience: int = Field(5, ge=1, description="consecutive RL steps with every advantage 0 that warn or stop")


class MonitoringConfig(_Strict):
    """Per-role instruments (docs/monitoring.md)."""

    drift: bool = Field(True, description="log each agent's response drift from step 0")
    kl_to_base: bool = Field(False, description=(
        "log agent/<a>/kl_ref (k3 to the reference: the initial model, or the base without adapters) "
        "even when algorithm.loss.kl_coef is 0; costs one extra no-grad forward per micro-batch"))
    spike: SpikeConfig = Field(default_factory=SpikeConfig, description="gradient-spike detector")
    collapse: CollapseConfig = Field(default_factory=CollapseConfig, description="collapse detector")
    no_signal: NoSignalConfig = Field(default_factory=NoSignalConfig, description="steps without a learning signal "
                                                                                  "(every advantage 0)")
    capture_threshold: float = Field(0.8, gt=0.0, lt=1.0, description="role-capture: grad-mass share")
    capture_patience: int = Field(10, ge=1, description="role-capture: consecutive steps")


class PlacementConfig(_Strict):
    """Where one policy's worker group runs (Ray runtime; docs/scaling.md). Unset keys inherit ``runtime``."""

    placement: Optional[Literal["colocated", "dedicated"]] = Field(None, description="runtime.placement for "
                                                                                       "this policy")
    workers: Optional[int] = Field(None, gt=0, description="runtime.workers for this policy")
    cpus_per_worker: Optional[float] = Field(None, gt=0.0, description="runtime.cpus_per_worker for this policy")
    gpus_per_worker: Optional[float] = Field(None, ge=0.0, description="runtime.gpus_per_worker for this policy")
    offload: Optional[bool] = Field(None, description="runtime.offload for this policy")


class FSDPConfig(_Strict):
    """``runtime.strategy: fsdp`` (PyTorch FSDP2; docs/scaling.md)."""

    param_dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="compute dtype of the unsharded parameters (auto: bfloat16 on CUDA, float32 on CPU); "
                            "master weights and optimizer state stay float32")
    reduce_dtype: Literal["bfloat16", "float32"] = Field("float32", description="gradient reduce-scatter dtype")
    cpu_offload: bool = Field(False, description="CPUOffloadPolicy: parameter shards, gradients and optimizer "
                                                 "state in CPU memory (the optimizer step runs on CPU)")


class RuntimeConfig(_Strict):
    """How policies are run: in this process (``local``) or as Ray worker groups (``ray``).

    With Ray, each policy is a group of ``workers`` actors (data-parallel ranks; rollout requests
    and training rows are sharded across them, gradients all-reduced with torch.distributed).
    ``colocated`` policies share one resource pool of ``workers`` bundles (the Dr. MAS default: each
    bundle's devices are time-sliced between the policies, idle ones offloaded to CPU when
    ``offload``); a ``dedicated`` policy gets a pool of its own.
    """

    kind: Literal["local", "ray"] = Field("local", description="local (this process) or ray (worker groups)")
    address: Optional[str] = Field(None, description="existing Ray cluster ('auto', 'ray://host:10001'); "
                                                     "None starts a local one")
    num_cpus: Optional[int] = Field(None, gt=0, description="CPUs of a local Ray cluster")
    num_gpus: Optional[int] = Field(None, ge=0, description="GPUs of a local Ray cluster")
    dashboard: bool = Field(False, description="start Ray's dashboard")
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="torch.distributed backend inside a "
                                                                          "worker group (auto: nccl on CUDA)")
    placement: Literal["colocated", "dedicated"] = Field("colocated", description=(
        "colocated: policies share one resource pool; dedicated: a pool per policy"))
    workers: int = Field(1, gt=0, description="data-parallel actors per policy")
    cpus_per_worker: float = Field(1.0, gt=0.0, description="CPUs of each actor")
    gpus_per_worker: float = Field(0.0, ge=0.0, description="GPUs of each actor (fractions share a GPU)")
    offload: bool = Field(True, description="colocated: move idle policies' weights and optimizer state to CPU")
    policies: dict[str, PlacementConfig] = Field(default_factory=dict, description="per-policy overrides")
    strategy: Literal["replica", "fsdp"] = Field("replica", description="replica: every rank holds the whole "
                                                 "policy; fsdp: its ranks shard it with FSDP2 (runtime.kind: ray)")
    fsdp: FSDPConfig = Field(default_factory=FSDPConfig, description=(
        "FSDP2 settings used when strategy = fsdp: parameter and reduce dtypes, CPU offload "
        "(docs/scaling.md)"))

    def for_policy(self, name: str) -> PlacementConfig:
        """The effective placement of policy ``name`` (its overrides over the runtime defaults)."""
        own = self.policies.get(name, PlacementConfig())
        return PlacementConfig(**{k: (getattr(own, k) if getattr(own, k) is not None else getattr(self, k))
                                  for k in PlacementConfig.model_fields})


REPORT_TO = ("tensorboard", "wandb", "mlflow", "trackio")


class LoggingConfig(_Strict):
    """Where metrics go besides metrics.jsonl (always written): docs/monitoring.md."""

    report_to: Optional[list[Literal["tensorboard", "wandb", "mlflow", "trackio"]]] = Field(None, description=(
        "trackers that receive every metric, through their own libraries (pip install masrl[wandb], "
        "masrl[mlflow], masrl[trackio]); None: [tensorboard] when logging.tensorboard is true"))
    tensorboard: bool = Field(True, description="TensorBoard in RUN_DIR/tensorboard (kept for older configs: "
                                                 "report_to replaces it when set)")
    project: Optional[str] = Field(None, description="W&B / trackio project and MLflow experiment (None: masrl)")
    mlflow_tracking_uri: Optional[str] = Field(None, description=(
        "MLflow tracking URI (None: $MLFLOW_TRACKING_URI, else a file store in RUN_DIR/mlruns); e.g. "
        "http://host:5000, file:///path/mlruns, sqlite:///path/mlflow.db (full mlflow)"))
    init_kwargs: dict[str, dict[str, Any]] = Field(default_factory=dict, description=(
        "extra arguments of each tracker's init call, by tracker: {wandb: {entity: ..., mode: offline}}"))
    progress: bool = Field(True, description=(
        "progress bar with ETA for SFT, RL and evaluation (not a terminal: a line every 5%, at most one a "
        "second; an evaluation also reports its agent turns, at most every 10 s)"))
    plots: bool = Field(True, description="PNG training curves in RUN_DIR/plots at the end")

    @model_validator(mode="after")
    def _report_to_agrees(self):
        if self.report_to is not None and not self.tensorboard and "tensorboard" in self.report_to:
            raise ValueError("logging.tensorboard is false but logging.report_to lists tensorboard; "
                             "drop one of them")
        unknown = sorted(set(self.init_kwargs) - set(REPORT_TO))
        if unknown:
            raise ValueError(f"logging.init_kwargs names unknown trackers {unknown}; known: {list(REPORT_TO)}")
        return self

    @property
    def sinks(self) -> list[str]:
        """The trackers in effect (``report_to``, else TensorBoard when ``tensorboard``), without repeats."""
        chosen = self.report_to if self.report_to is not None else (["tensorboard"] if self.tensorboard else [])
        return list(dict.fromkeys(chosen))


class RunConfig(_Strict):
    """One masrl run: ``masrl train CONFIG``."""

    seed: int = Field(0, ge=0, le=SEED_MAX, description="seed of sampling, tiny-model init and task order")
    output_dir: str = Field("runs/{name}-{estimator}-seed{seed}", description=(
        "the run folder; placeholders {name} {estimator} {seed}"))
    name: str = Field("run", description="the run's name (in output_dir, reports and trackers)")
    task: TaskConfig = Field(default_factory=TaskConfig, description="where tasks and rewards come from")
    workflow: WorkflowConfig = Field(default_factory=WorkflowConfig, description="the episode the agents play")
    agents: dict[str, AgentConfig] = Field(description="the workflow's roles, by name: policy and sampling")
    policies: dict[str, PolicyConfig] = Field(description="the trainable models, by name")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="rewards, advantages, loss")
    sft: SFTConfig = Field(default_factory=SFTConfig, description="the supervised cold start")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="the RL loop")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="held-out evaluation")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="metric trackers, progress, plots")
    monitoring: MonitoringConfig = Field(default_factory=MonitoringConfig, description="per-role instruments")
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig, description="local or Ray worker groups")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="the rollout engine")
    tools: ToolsConfig = Field(default_factory=ToolsConfig, description="limits of the agents' tool calls")

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
        if self.runtime.strategy == "fsdp" and self.runtime.kind != "ray":
            raise ValueError("runtime.strategy = fsdp shards each policy over its Ray worker group: "
                             "set runtime.kind: ray (runtime.workers: ranks per policy)")
        if self.runtime.strategy == "fsdp" and self.rollout.engine != "transformers":
            raise ValueError("runtime.strategy = fsdp decodes with the in-process engine through the sharded "
                             "model: set rollout.engine: transformers (vLLM with fsdp is not supported yet)")
        if self.runtime.strategy == "fsdp" and self.trainer.logprob_chunk_tokens:
            if "logprob_chunk_tokens" not in self.trainer.model_fields_set:  # the default: full logits under fsdp
                self.trainer.logprob_chunk_tokens = 0
            else:
                raise ValueError("trainer.logprob_chunk_tokens calls the decoder and the LM head directly, around "
                                 "FSDP2's root module: set it to 0 with runtime.strategy = fsdp")
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
    def _merge_needs_token_mean(self):
        loss = self.algorithm.loss
        if self.trainer.merge_conversations and (loss.agg != "token-mean" or loss.loss != "ppo"):
            raise ValueError(f"trainer.merge_conversations needs algorithm.loss.loss: ppo and agg: token-mean (got "
                             f"{loss.loss!r}, {loss.agg!r}): a merged row is one sequence for sequence-level terms")
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

    @model_validator(mode="after")
    def _role_stages_name_the_agents(self):
        stages = self.algorithm.role_stages
        if stages is None:
            return self
        if not stages or any(not group for group in stages):
            raise ValueError("algorithm.role_stages must be a non-empty list of non-empty lists of agent names, "
                             f"e.g. [[{', '.join(list(self.agents)[:1]) or 'Solver'}], [...]]; got {stages!r}")
        named = [a for group in stages for a in group]
        unknown = sorted(set(named) - set(self.agents))
        if unknown:
            raise ValueError(f"algorithm.role_stages names unknown agents {unknown}; agents: {sorted(self.agents)}")
        missing = sorted(set(self.agents) - set(named))
        if missing:
            raise ValueError(f"algorithm.role_stages leaves agents {missing} out of every stage (they would never "
                             "train); put each agent in at least one stage")
        return self

    @model_validator(mode="after")
    def _agent_optim_needs_own_adapter(self):
        for agent, acfg in self.agents.items():
            pcfg = self.policies.get(acfg.policy)
            if acfg.optim is not None and pcfg is not None and not (pcfg.lora and pcfg.lora.per_agent):
                raise ValueError(f"agents.{agent}.optim needs parameters of its own: policy {acfg.policy!r} must have "
                                 f"lora.per_agent: true (one adapter per agent); otherwise set "
                                 f"policies.{acfg.policy}.optim")
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir.replace("{name}", self.name).replace("{seed}", str(self.seed))
                    .replace("{estimator}", self.algorithm.estimator))


# ----------------------------------------------------------------------------- loading
# (the bounded YAML reader is masrl.io.bounded_yaml)

_MOVED_TO_IO = ("CONFIG_MAX_BYTES", "YAML_MAX_DEPTH", "YAML_MAX_NODES", "load_yaml", "read_yaml_file")


def __getattr__(name: str):
    """The YAML reader's names this module held before they moved to ``masrl.io.bounded_yaml``: they
    still resolve, with a ``DeprecationWarning``, for one release."""
    if name in _MOVED_TO_IO:
        import warnings

        warnings.warn(f"masrl.config.{name} is deprecated: import it from masrl.io.bounded_yaml (this path goes "
                      f"away in the next release)", DeprecationWarning, stacklevel=2)
        return getattr(bounded_yaml, name)
    raise AttributeError(f"module 'masrl.config' has no attribute {name!r}")


def _parse_scalar(text: str, item: str = "") -> Any:
    """An override's value as YAML (``5`` is a number, ``[1, 4]`` a list); text that is not YAML stays text."""
    try:
        return load_bounded(text)
    except yaml.YAMLError:
        return text
    except YamlLimit as e:
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


def _model_of(annotation: Any):
    """The pydantic model an annotation holds (``Model``, ``Optional[Model]``, ``dict[str, Model]``: then
    ``(model, True)``, a mapping by name), else ``(None, False)``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    args = get_args(annotation)
    if get_origin(annotation) in (dict, collections.abc.Mapping) and len(args) == 2:
        return _model_of(args[1])[0], True
    for arg in args:  # Optional / Union
        model, by_name = _model_of(arg)
        if model is not None:
            return model, by_name
    return None, False


def known_keys(loc: Sequence[Any], root: type[BaseModel] | None = None) -> list[str]:
    """The keys a config accepts beside the last part of ``loc`` (``("trainer", "totl_steps")``: the trainer's
    keys; ``("policies", "shared", "lr")``: a policy's), or [] where ``loc`` leaves the schema."""
    model, parts = root or RunConfig, [str(p) for p in loc[:-1]]
    while parts:
        field = model.model_fields.get(parts.pop(0))
        inner, by_name = _model_of(field.annotation) if field is not None else (None, False)
        if inner is None or (by_name and not parts):
            return []
        if by_name:
            parts.pop(0)  # the entry's name (a policy, an agent)
        model = inner
    return list(model.model_fields)


def format_validation_error(err: ValidationError, source: str, *, unknown_hint: str = (
        "check the spelling; see the config reference in docs/config.md"), hidden_loc: tuple[str, ...] = (),
        overrides: Mapping[str, str] | None = None, root: type[BaseModel] | None = None) -> str:
    """One line per pydantic error, naming ``source`` (or the command-line override that set the key, a section
    above it or a key under it) and the dotted key (``hidden_loc``: path parts left out); an unknown key gets the
    closest known ones."""
    lines = []
    for e in err.errors():
        parts = [p for p in e["loc"] if p not in hidden_loc]
        loc = ".".join(str(p) for p in parts) or "(top level)"
        where = next((f"override {item!r}" for key, item in (overrides or {}).items()
                      if key == loc or loc.startswith(key + ".") or key.startswith(loc + ".")), source)
        if e["type"] == "extra_forbidden":
            close = difflib.get_close_matches(str(parts[-1]), known_keys(parts, root), n=3, cutoff=0.6) if parts \
                else []
            mean = f"did you mean {' or '.join(repr('.'.join([*map(str, parts[:-1]), c])) for c in close)}? " \
                if close else ""
            lines.append(f"{where}: unknown key '{loc}' ({mean}{unknown_hint})")
        elif e["type"] == "missing":
            lines.append(f"{where}: missing required key '{loc}'")
        else:
            got = e.get("input")
            got = f" (got {quote(got)})" if not isinstance(got, dict) else ""
            lines.append(f"{where}: key '{loc}': {clip(e['msg'].removeprefix('Value error, '), 500)}{got}")
    return "\n".join(lines)


def config_from_dict(data: dict, source: str = "<config>", overrides: Mapping[str, str] | None = None) -> RunConfig:
    """``data`` checked against the schema; an error names ``source``, or the override (``{key: "key=value"}``)
    that set the key at fault."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of keys, got {type(data).__name__}")
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source, overrides=overrides)) from None



def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    path = Path(path)
    data = bounded_yaml.read_yaml_file(path) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys")
    data = apply_overrides(data, overrides or [])
    given = {item.partition("=")[0].strip(): item for item in overrides or []}
    return config_from_dict(data, str(path), given)


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
