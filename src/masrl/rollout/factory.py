"""The front door of ``rollout/``: ``make_engine`` builds a policy's rollout engine from the config.

Adding a backend touches only ``rollout/`` (a subclass of ``masrl.rollout.base.Engine`` and a branch
here) and the ``rollout.engine`` choice in config.py.
"""
from __future__ import annotations

from pathlib import Path

import torch

from masrl.config import PolicyConfig, RolloutConfig
from masrl.errors import ConfigError
from masrl.rollout.base import Engine
from masrl.rollout.engine import TransformersEngine


def stop_token_ids(model: torch.nn.Module, tokenizer, name: str = "model") -> list[int]:
    """The tokenizer's EOS and the model's generation-config EOS ids, sorted.

    Each id must be a token of the model (0 <= id < the output vocabulary): an id past it could never be
    sampled, and the engine's stop table is sized by the largest id, so a stray 10**9 in a model folder's
    ``generation_config.json`` would cost gigabytes per call. Such an id is one ``ConfigError``."""
    sources = [("the tokenizer's eos_token_id", tokenizer.eos_token_id)]
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(gen_eos, (list, tuple)):
        sources += [("generation_config.eos_token_id", e) for e in gen_eos]
    elif gen_eos is not None:
        sources.append(("generation_config.eos_token_id", gen_eos))
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    vocab = head.weight.shape[0] if head is not None and hasattr(head, "weight") else \
        getattr(getattr(model, "config", None), "vocab_size", None)
    sources = [(where, value) for where, value in sources if value is not None]
    if not sources:
        raise ConfigError(f"{name}: the model has no stop token (neither the tokenizer's eos_token_id nor "
                          f"generation_config.eos_token_id is set): set one in the model folder")
    eos_ids = set()
    for where, value in sources:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0 or \
                (vocab is not None and value >= vocab):
            raise ConfigError(f"{name}: the model's stop token {where} = {value!r} is not a token id of the model "
                              f"(0 to {vocab - 1 if vocab else '?'}): fix or remove it in the model folder's "
                              f"tokenizer or generation_config.json")
        eos_ids.add(int(value))
    return sorted(eos_ids)


def make_engine(rollout: RolloutConfig | None, model: torch.nn.Module, tokenizer, *, name: str,
                policy: PolicyConfig, seed: int, max_batch_size: int, autocast: str | None = None,
                workdir: str | Path | None = None, label: str | None = None) -> Engine:
    """Policy ``name``'s rollout engine for ``model`` (``rollout.engine``: transformers or vllm; None: the
    in-process engine with its defaults). A model built in memory is written under ``workdir`` for vLLM to
    load; ``autocast``: the in-process engine decodes in that mixed precision, as ``trainer.autocast`` trains.
    ``label`` names the model in errors (default ``policy <name>``)."""
    eos_ids = stop_token_ids(model, tokenizer, label or f"policy {name}")
    if rollout is not None and rollout.engine == "vllm":
        return _vllm_engine(name, policy, rollout, model, tokenizer, eos_ids, seed, workdir)
    prefix = {} if rollout is None else {"prefix_cache": rollout.prefix_cache,
                                         "prefix_cache_mib": rollout.prefix_cache_mib,
                                         "max_running_tokens": rollout.max_running_tokens,
                                         "max_prefill_tokens": rollout.max_prefill_tokens,
                                         "compile_decode": rollout.compile_decode}
    return TransformersEngine(model, eos_token_ids=eos_ids, pad_token_id=int(tokenizer.pad_token_id),
                              max_batch_size=max_batch_size, seed=seed, autocast=autocast, **prefix)


def _vllm_engine(name: str, cfg: PolicyConfig, rollout: RolloutConfig, model, tokenizer, eos_ids: list[int],
                 seed: int, workdir: str | Path | None):
    from masrl.rollout.vllm_engine import VLLMEngine, save_for_vllm

    if cfg.model == "tiny":  # built in memory: vLLM loads it from a folder
        if workdir is None:
            raise ConfigError(f"policy {name}: a tiny model with rollout.engine=vllm needs a work folder")
        source = save_for_vllm(model, tokenizer, Path(workdir) / name)
    else:
        from masrl.models.hub import resolve_model_source

        source = resolve_model_source(cfg.model)
    lora = cfg.lora
    rank = next((r for r in (8, 16, 32, 64, 128, 256, 512) if lora is not None and r >= lora.r), 16)
    engine = VLLMEngine(source, dtype=rollout.dtype or cfg.dtype, gpu_memory_utilization=rollout.gpu_memory_utilization,
                        enable_sleep_mode=rollout.enable_sleep_mode and rollout.sleep_level > 0,
                        eos_token_ids=eos_ids, seed=seed, max_model_len=rollout.max_model_len,
                        enable_lora=lora is not None, max_loras=rollout.max_loras, max_lora_rank=rank,
                        enforce_eager=rollout.enforce_eager, tokenizer=str(Path(workdir) / name) if cfg.model == "tiny"
                        else (cfg.tokenizer and str(cfg.tokenizer)), trust_remote_code=cfg.trust_remote_code,
                        **rollout.kwargs)
    if lora is not None:
        engine.sync_adapters(model)
        if not lora.per_agent:
            engine.default_adapter = name
    return engine
