"""Build a policy's model and tokenizer from its config: tiny-from-config, alias, hub id or folder."""
from __future__ import annotations

import os

import torch

from masrl.config import PolicyConfig
from masrl.models.hub import ModelLoadError
from masrl.models.tiny import build_char_tokenizer, build_tiny_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model_and_tokenizer(cfg: PolicyConfig, seed: int = 0):
    """Return ``(model, tokenizer)`` for a policy; the tokenizer always has a chat template."""
    if cfg.model == "tiny":
        tokenizer = build_char_tokenizer(cfg.tiny.get("extra_tokens"))
        overrides = {k: v for k, v in cfg.tiny.items() if k != "extra_tokens"}
        model = build_tiny_model(tokenizer, overrides, seed=cfg.init_seed if cfg.init_seed is not None else seed)
        model.to(DTYPES[cfg.dtype])
    else:
        from masrl.models.hub import load_pretrained, resolve_model_source  # hub/alias/folder loading

        try:
            model, tokenizer = load_pretrained(cfg.model, dtype=DTYPES[cfg.dtype],
                                               trust_remote_code=cfg.trust_remote_code)
        except Exception as e:  # one clear line, whatever layer failed
            raise ModelLoadError(f"policy model {cfg.model!r}: {e}") from e
        if cfg.tokenizer:
            from transformers import AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(resolve_model_source(cfg.tokenizer),
                                                          trust_remote_code=cfg.trust_remote_code)
            except ModelLoadError as e:
                raise ModelLoadError(f"policy tokenizer {cfg.tokenizer!r}: {e}") from None
            except Exception as e:  # one clear line, as for the model
                raise ModelLoadError(f"policy tokenizer {cfg.tokenizer!r}: {type(e).__name__}: "
                                     f"{(str(e).strip().splitlines() or [''])[0]}") from e
    if not getattr(tokenizer, "chat_template", None):
        raise ModelLoadError(f"tokenizer of {(cfg.tokenizer or cfg.model)!r} has no chat template; set one "
                             "(tokenizer.chat_template), point the policy's `tokenizer` at one that has it, "
                             "or use a chat/instruct model")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def load_tokenizer(cfg: PolicyConfig):
    """The policy's tokenizer alone (what a driver needs when the model lives in remote workers)."""
    if cfg.model == "tiny":
        tokenizer = build_char_tokenizer(cfg.tiny.get("extra_tokens"))
    else:
        from transformers import AutoTokenizer

        from masrl.models.hub import peft_adapter_base, resolve_model_source

        name = cfg.tokenizer or cfg.model
        try:
            source = resolve_model_source(name)
            base = peft_adapter_base(source)  # a PEFT adapter folder without a tokenizer: its base's
            if base is not None and not os.path.isfile(os.path.join(source, "tokenizer_config.json")):
                source = resolve_model_source(base)
            tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
        except ModelLoadError as e:
            raise ModelLoadError(f"policy tokenizer {name!r}: {e}") from None
        except Exception as e:  # one clear line
            raise ModelLoadError(f"policy tokenizer {name!r}: {type(e).__name__}: "
                                 f"{(str(e).strip().splitlines() or [''])[0]}") from e
    if not getattr(tokenizer, "chat_template", None):
        raise ModelLoadError(f"tokenizer of {(cfg.tokenizer or cfg.model)!r} has no chat template")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
