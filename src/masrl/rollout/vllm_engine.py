"""vLLM rollout engine (GPU): the ``Engine`` protocol on top of vLLM's offline ``LLM``.

    engine = VLLMEngine("Qwen/Qwen3-4B", dtype="bfloat16", gpu_memory_utilization=0.5,
                        enable_sleep_mode=True, eos_token_ids=[151645, 151643])
    results = engine.generate([GenRequest(prompt_ids, temperature=1.0, max_new_tokens=4096)])
    ...                                   # trainer update
    engine.sync_weights(hf_named_tensors(policy.model))   # no reload from disk
    engine.sleep(level=1)                 # colocated: free the GPU for the trainer ...
    engine.wake_up()                      # ... and take it back (generate() also wakes it)

Same contract as ``masrl.rollout.engine.TransformersEngine``: per-row temperature, top-p,
token budget and LoRA adapter; a result holds the response ids (a stop token included, as
emitted), the log-prob of every sampled token and whether the budget ran out first.

**Log-probs.** Requested with ``SamplingParams(logprobs=0)`` (the sampled token only) and
``logprobs_mode="processed_logprobs"`` (vLLM >= 0.10.2), i.e. log-softmax of the logits after
temperature, which is what the trainer recomputes when ``top_p == 1``. With ``top_p < 1``
vLLM renormalizes over the nucleus while the trainer does not, so keep ``top_p: 1`` for
training rollouts. Older vLLM returns raw (temperature-free) log-probs; the engine warns
when a row has a temperature other than 0 or 1. Even then the numbers are not the trainer's:
vLLM runs other kernels (bf16, fused attention, another reduction order), so rollout
log-probs differ from the trainer's by ~1e-3..1e-2 nats per token and the mismatch grows
with length. Do not use them as PPO old log-probs as they are: recompute old log-probs with
the trainer and correct with ``masrl.algorithms.rollout_correction.truncated_is_weights``
(``algorithm.rollout_is``; docs/scaling.md).

**Weight sync.** ``sync_weights`` hands ``(name, tensor)`` pairs with Hugging Face
checkpoint names to the vLLM model's ``load_weights`` (the way TRL's colocate mode and verl's
sharding manager do). By default the engine core runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the model object is reached directly:
``llm.llm_engine.model_executor.driver_worker[.worker].model_runner.model``. Otherwise the
tensors go through ``llm.collective_rpc`` (pickled; vLLM then needs
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, acceptable only for local, trusted processes). The
prefix cache is reset after every sync.

**LoRA.** One vLLM engine serves a policy's base model and all its adapters. Adapters are
registered with ``load_adapter`` (a PEFT folder, or a state dict + LoRA config that the
engine writes to a private temp folder) and re-registered after every update under a new
integer id, so vLLM never serves a stale cached copy (``masrl.rollout.vllm_lora.VLLMAdapters``).
Rows with ``GenRequest.adapter`` decode with that adapter, rows without it with the base, all in one batch.

**Sleep mode** (``enable_sleep_mode=True``): ``sleep(1)`` offloads weights to CPU and drops
the KV cache; ``sleep(2)`` drops both (weights must be synced before the next generate).

GPU only: nothing here is exercised by the CPU test suite except the request/response
plumbing against a fake ``vllm`` module (tests/test_vllm_engine.py).
"""
from __future__ import annotations

import dataclasses
import gc
import itertools
import os
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch

from masrl.errors import install_command
from masrl.rollout.base import Engine, GenRequest, GenResult
from masrl.rollout.vllm_lora import VLLMAdapters

VLLM_INSTALL_HINT = (f"VLLMEngine needs vLLM: {install_command('vllm')} on a Linux machine with a CUDA GPU "
                     "(the transformers engine is the CPU path)")

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def import_vllm():
    """``import vllm`` with one clear error when it is missing or broken."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"{VLLM_INSTALL_HINT} (import vllm failed: {e})") from e
    except Exception as e:  # noqa: BLE001 - a broken install (CUDA/torch mismatch) fails in many ways
        raise ImportError(f"vllm is installed but failed to import ({type(e).__name__}: {e}); check that the "
                          f"installed torch matches the one vllm was built for. {VLLM_INSTALL_HINT}") from e
    return vllm


def _engine_arg_names() -> set[str]:
    """Field names of vLLM's ``EngineArgs`` (to pass only options this vLLM version knows)."""
    try:
        from vllm.engine.arg_utils import EngineArgs
    except Exception:  # noqa: BLE001
        return set()
    if dataclasses.is_dataclass(EngineArgs):
        return {f.name for f in dataclasses.fields(EngineArgs)}
    return set(getattr(EngineArgs, "__annotations__", {}))


def _load_weights_rpc(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs inside a vLLM worker (``collective_rpc``): load HF-named tensors into its model."""
    runner = worker.model_runner
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    model.load_weights(weights)


def hf_named_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The base weights of a transformers model, possibly PEFT-wrapped, under checkpoint names.

    PEFT's ``...q_proj.base_layer.weight`` becomes ``...q_proj.weight``; LoRA parameters are
    skipped (adapters go to vLLM through ``VLLMEngine.load_adapter``). Tensors are detached
    and stay on their device (a GPU trainer hands GPU tensors over without a host copy).
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for name, tensor in base.state_dict().items():
        if any(part.startswith("lora_") for part in name.split(".")) or ".modules_to_save." in name:
            continue
        yield name.replace(".base_layer.", "."), tensor.detach()


def save_for_vllm(model: torch.nn.Module, tokenizer, folder: str | os.PathLike) -> Path:
    """Write ``model`` (base weights only when PEFT-wrapped) and ``tokenizer`` as a HF folder vLLM loads.

    For models built in memory (a tiny model from config, or weights changed by SFT) that vLLM
    cannot load from a hub id.
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if base is model:
        model.save_pretrained(folder)
    else:
        tensors = dict(hf_named_tensors(model))
        if getattr(base.config, "tie_word_embeddings", False):
            tensors.pop("lm_head.weight", None)  # shared storage: the embedding is saved once
        save_file({k: v.to("cpu").contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
                  metadata={"format": "pt"})
        base.config.save_pretrained(folder)
        if getattr(base, "generation_config", None) is not None:
            base.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


class VLLMEngine(Engine):
    """Rollouts with vLLM's offline ``LLM``; see the module docstring for log-probs, sync and LoRA.

    ``model`` is a hub id or a local HF folder (see ``save_for_vllm``). ``eos_token_ids``
    are passed as ``stop_token_ids`` (default: vLLM's own EOS handling). ``in_process`` runs the
    engine core in this process so that ``sync_weights`` reaches the model object directly.
    ``per_request_seed`` gives every row its own seed from ``(seed, row counter)``, so a row's
    sample does not depend on what else is in the batch (vLLM samples seeded rows a bit slower).
    ``llm_kwargs`` go to ``vllm.LLM`` unchanged (``max_num_seqs``, ``tensor_parallel_size``, ...).
    """

    def __init__(self, model: str | os.PathLike, *, dtype: str = "bfloat16",
                 gpu_memory_utilization: float = 0.5, enable_sleep_mode: bool = False,
                 eos_token_ids: Sequence[int] | None = None, seed: int = 0,
                 max_model_len: int | None = None, enable_lora: bool = False, max_loras: int = 4,
                 max_lora_rank: int = 16, enforce_eager: bool = False, in_process: bool = True,
                 logprobs_mode: str = "processed_logprobs", tokenizer: str | None = None,
                 trust_remote_code: bool = False, per_request_seed: bool = True, **llm_kwargs: Any):
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1]; got {gpu_memory_utilization!r}")
        self._vllm = import_vllm()
        if in_process:  # engine core in this process: the model object is reachable for weight sync
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        known = _engine_arg_names()
        kwargs: dict[str, Any] = dict(model=str(model), dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
                                      enable_sleep_mode=enable_sleep_mode, seed=seed, enforce_eager=enforce_eager,
                                      trust_remote_code=trust_remote_code)
        if tokenizer is not None:
            kwargs["tokenizer"] = str(tokenizer)
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if enable_lora:
            kwargs.update(enable_lora=True, max_loras=max_loras, max_lora_rank=max_lora_rank)
        self.logprobs_mode: str | None = None
        if "logprobs_mode" in known:
            kwargs["logprobs_mode"] = logprobs_mode
            self.logprobs_mode = logprobs_mode
        kwargs.update(llm_kwargs)
        self.llm = self._vllm.LLM(**kwargs)
        self.model_source = str(model)
        self.enable_lora = enable_lora
        self.enable_sleep_mode = enable_sleep_mode
        self.eos = sorted({int(t) for t in eos_token_ids}) if eos_token_ids else []
        self._eos_set = set(self.eos)
        self.seed = seed
        self._requests = itertools.count()
        self.tokens_generated = 0
        self.weight_version = 0        # bumped by every sync_weights
        self.weights_stale = False     # True after sleep(2) until the next sync_weights
        self._asleep: set[str] = set()  # "weights", "kv_cache"
        self.lora = VLLMAdapters(lambda: self.llm, lambda: not self._asleep)  # the LoRA adapters served
        self._warned_raw_logprobs = False
        self.per_request_seed = per_request_seed
        self.default_adapter: str | None = None  # rows without an adapter (one LoRA shared by a policy's agents)

    # ------------------------------------------------------------------ generation

    def reseed(self, seed: int) -> None:
        """Restart the per-request seed stream (row k of the run after this call gets the same seed)."""
        self.seed = seed
        self._requests = itertools.count()

    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        results: list[GenResult | None] = [None] * len(requests)
        prompts, params, loras, rows = [], [], [], []
        for i, r in enumerate(requests):
            if r.max_new_tokens <= 0:  # as TransformersEngine: nothing emitted, budget exhausted
                results[i] = GenResult([], [], truncated=True)
                continue
            prompts.append({"prompt_token_ids": [int(t) for t in r.prompt_ids]})
            params.append(self._sampling_params(r))
            loras.append(self._lora_request(r.adapter))
            rows.append(i)
        if prompts:
            self._ready_to_generate()
            kwargs: dict[str, Any] = {"use_tqdm": False}
            if any(lora is not None for lora in loras):
                kwargs["lora_request"] = loras
            outputs = self.llm.generate(prompts, params, **kwargs)
            if len(outputs) != len(prompts):
                raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
            for i, output in zip(rows, outputs):
                results[i] = self._to_result(output)
        return results  # type: ignore[return-value]

    def _sampling_params(self, r: GenRequest):
        if (self.logprobs_mode is None and r.temperature not in (0.0, 1.0) and not self._warned_raw_logprobs):
            warnings.warn("this vLLM has no logprobs_mode option: its log-probs ignore the temperature "
                          f"({r.temperature}); upgrade to vllm>=0.10.2 or sample at temperature 1", stacklevel=3)
            self._warned_raw_logprobs = True
        seed = (self.seed * 1_000_003 + next(self._requests)) % (2 ** 31 - 1) if self.per_request_seed else None
        return self._vllm.SamplingParams(n=1, temperature=max(float(r.temperature), 0.0), top_p=float(r.top_p),
                                         max_tokens=int(r.max_new_tokens), logprobs=0, seed=seed,
                                         stop_token_ids=list(self.eos) or None, detokenize=False)

    def _to_result(self, output) -> GenResult:
        completion = output.outputs[0]
        ids = [int(t) for t in completion.token_ids]
        positions = completion.logprobs
        if positions is None or len(positions) != len(ids):
            raise RuntimeError(f"vLLM returned {0 if positions is None else len(positions)} log-prob positions "
                               f"for {len(ids)} tokens (SamplingParams.logprobs=0 is required)")
        logprobs = []
        for k, token in enumerate(ids):
            entry = positions[k].get(token)
            if entry is None:
                raise RuntimeError(f"vLLM returned no log-prob for the sampled token {token} at position {k}")
            logprobs.append(float(getattr(entry, "logprob", entry)))
        stopped = bool(ids) and ids[-1] in self._eos_set
        truncated = completion.finish_reason in ("length", "abort") and not stopped
        self.tokens_generated += len(ids)
        return GenResult(ids, logprobs, truncated=truncated)

    def _ready_to_generate(self) -> None:
        if self._asleep:
            self.wake_up()
        if self.weights_stale:
            raise RuntimeError("the engine's weights were discarded by sleep(level=2); call "
                               "sync_weights(...) before generating")

    # ------------------------------------------------------------------ weight sync

    def sync_weights(self, named_tensors: NamedTensors) -> int:
        """Load ``(name, tensor)`` pairs (HF checkpoint names) into the serving model; returns the count.

        Partial updates are fine (only the named weights change). Tensors may be on the CPU or
        the GPU and in any float dtype (vLLM's weight loaders copy and cast). Wakes the weights
        (not the KV cache) of a sleeping engine; the prefix cache is reset afterwards.
        """
        items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
        if not items:
            raise ValueError("sync_weights got no tensors")
        if "weights" in self._asleep:
            self.wake_up(tags=["weights"])
        with torch.no_grad():
            model = self._driver_model()
            if model is not None:
                model.load_weights((name, tensor.detach()) for name, tensor in items)
            else:
                host = [(name, tensor.detach().to("cpu")) for name, tensor in items]
                try:
                    self.llm.collective_rpc(_load_weights_rpc, args=(host,))
                except Exception as e:  # noqa: BLE001 - version-dependent: one clear message
                    raise RuntimeError(
                        "cannot sync weights into vLLM: the engine core runs in another process and "
                        f"collective_rpc failed ({type(e).__name__}: {e}). Construct VLLMEngine with "
                        "in_process=True (VLLM_ENABLE_V1_MULTIPROCESSING=0), or set "
                        "VLLM_ALLOW_INSECURE_SERIALIZATION=1 (local, trusted processes only)") from e
        self._reset_prefix_cache()
        self.weights_stale = False
        self.weight_version += 1
        return len(items)

    def _driver_model(self):
        """vLLM's model object when the engine core runs in this process, else None."""
        executor = getattr(getattr(self.llm, "llm_engine", None), "model_executor", None)
        driver = getattr(executor, "driver_worker", None)
        for worker in (getattr(driver, "worker", None), driver):  # V1 wraps the worker; V0 does not
            runner = getattr(worker, "model_runner", None)
            if runner is None:
                continue
            model = runner.get_model() if hasattr(runner, "get_model") else getattr(runner, "model", None)
            if model is not None and hasattr(model, "load_weights"):
                return model
        return None

    def _reset_prefix_cache(self) -> None:
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if reset is not None:
            reset()

    def weights_changed(self, model: torch.nn.Module, *, base_changed: bool) -> None:
        """Serve ``model``'s new weights: the base when it changed (or sleep(2) dropped it), then the LoRA
        adapters when the engine serves adapters."""
        if base_changed or self.weights_stale:
            self.sync_weights(hf_named_tensors(model))
        if self.enable_lora:
            self.sync_adapters(model)

    # ------------------------------------------------------------------ LoRA

    def load_adapter(self, name: str, path_or_state: str | os.PathLike | Mapping[str, torch.Tensor], *,
                     peft_config: Any = None) -> None:
        """Register (or replace) adapter ``name``: a PEFT adapter folder, or a state dict + its LoRA config.

        A state dict uses PEFT's saved keys (``masrl.models.lora.adapter_state_dict``);
        ``peft_config`` is a ``peft.LoraConfig`` or a mapping with at least ``r``,
        ``lora_alpha`` and ``target_modules``. Every call gives the adapter a new vLLM id, so
        rows decode with the newest weights; the previous version is evicted.
        """
        if not self.enable_lora:
            raise ValueError("this VLLMEngine was built without LoRA support; construct it with enable_lora=True")
        self.lora.load(name, path_or_state, peft_config=peft_config)

    def sync_adapters(self, peft_model: torch.nn.Module, names: Sequence[str] | None = None) -> list[str]:
        """Re-register the current weights of a PEFT model's adapters (all by default); returns their names."""
        from masrl.models.lora import adapter_names, adapter_state_dict

        names = list(names) if names is not None else adapter_names(peft_model)
        for name in names:
            self.load_adapter(name, adapter_state_dict(peft_model, name), peft_config=peft_model.peft_config[name])
        return names

    def _lora_request(self, adapter: str | None):
        return self.lora.request(adapter if adapter is not None else self.default_adapter)

    @property
    def adapters(self) -> list[str]:
        return sorted(self.lora.requests)

    @property
    def _adapters(self) -> dict[str, Any]:  # name -> LoRARequest
        return self.lora.requests

    @property
    def _adapter_root(self) -> Path | None:
        return self.lora.root

    # ------------------------------------------------------------------ sleep mode

    def sleep(self, level: int = 1) -> None:
        """Free GPU memory for the trainer: level 1 offloads weights to CPU and drops the KV cache,
        level 2 drops both (then ``sync_weights`` must run before the next generate)."""
        if not self.enable_sleep_mode:
            raise RuntimeError("sleep() needs a VLLMEngine built with enable_sleep_mode=True")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2; got {level!r}")
        if self._asleep:
            return
        self.llm.sleep(level=level)
        self._asleep = {"weights", "kv_cache"}
        if level == 2:
            self.weights_stale = True
            self.lora.refresh_on_wake = True

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Take the memory back (``tags``: ``weights`` and/or ``kv_cache``; default both)."""
        wanted = [t for t in (tags or ("weights", "kv_cache")) if t in self._asleep]
        if not wanted:
            return
        try:
            self.llm.wake_up(tags=wanted)
        except TypeError:  # vLLM without tags: everything wakes
            self.llm.wake_up()
            wanted = list(self._asleep)
        self._asleep -= set(wanted)
        if not self._asleep:
            self.lora.woke_up()

    @property
    def can_sleep(self) -> bool:
        return self.enable_sleep_mode

    @property
    def is_sleeping(self) -> bool:
        return bool(self._asleep)

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Release the engine and the adapter folders it wrote."""
        llm, self.llm = getattr(self, "llm", None), None
        del llm
        gc.collect()
        self.lora.close()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def __enter__(self) -> "VLLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
