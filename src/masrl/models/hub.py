"""Where a model comes from: an alias, a local folder, or a Hugging Face Hub id.

    resolve_model_source("smollm2-135m-instruct")   # alias -> converted local copy
    resolve_model_source("/models/my-checkpoint")    # local folder (must exist)
    resolve_model_source("Qwen/Qwen2.5-0.5B-Instruct")  # hub id, returned as is

``load_pretrained`` turns any of these into ``(model, tokenizer)`` and reports every failure
as one ``ModelLoadError`` line (missing folder, offline hub, missing optional package).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from masrl.models.errors import ModelLoadError

__all__ = ["ALIASES", "ModelLoadError", "load_pretrained", "resolve_model_source"]


def _smollm2_135m_instruct() -> str:
    from masrl.models.smollm import smollm2_path

    return str(smollm2_path())


# alias (lower case) -> resolver returning a local folder usable by from_pretrained
ALIASES: dict[str, Callable[[], str]] = {
    "smollm2-135m-instruct": _smollm2_135m_instruct,
}


def _looks_like_path(name: str) -> bool:
    if name.startswith(("/", "./", "../", "~", ".\\", "..\\")) or "\\" in name or name in (".", ".."):
        return True
    # a hub id is "name" or "owner/name"; more separators can only be a path
    return name.count("/") > 1


def resolve_model_source(name_or_path: str | os.PathLike) -> str:
    """Local folder or hub id for ``from_pretrained``.

    Aliases (``ALIASES``, case-insensitive) are resolved (which may convert and cache a model);
    existing local folders are returned as absolute paths; things that look like paths but do not
    exist raise ``ModelLoadError("model path X does not exist")``; anything else is taken as a
    Hugging Face Hub id and returned unchanged.
    """
    name = os.fspath(name_or_path).strip()
    if not name:
        raise ModelLoadError("empty model name")
    resolver = ALIASES.get(name.lower())
    if resolver is not None:
        return resolver()
    p = Path(name).expanduser()
    if p.exists():
        if not p.is_dir():
            raise ModelLoadError(f"model path {name} is a file, expected a model folder "
                                 "(config.json + weights)")
        return str(p.resolve())
    if _looks_like_path(name):
        raise ModelLoadError(f"model path {name} does not exist")
    return name


def _dtype(dtype: Any):
    import torch

    if dtype is None or dtype == "auto":
        return dtype
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        key = dtype.lower().removeprefix("torch.")
        table = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
                 "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                 "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
        if key in table:
            return table[key]
    raise ModelLoadError(f"unknown dtype {dtype!r} (use float32, bfloat16, float16 or auto)")


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    first = text.splitlines()[0].strip() if text else ""
    if len(first) > 300:
        first = first[:297] + "..."
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def load_pretrained(name_or_path: str | os.PathLike, dtype: Any = None, trust_remote_code: bool = False,
                    **model_kwargs: Any):
    """``(model, tokenizer)`` for an alias, a local folder or a hub id (see ``resolve_model_source``).

    ``dtype``: a ``torch.dtype``, a name (``"float32"``, ``"bfloat16"``, ...), ``"auto"`` or None
    (transformers' default). The tokenizer gets ``pad_token = eos_token`` when it has none.
    Every failure raises ``ModelLoadError`` with a single line. The model is in eval mode.
    """
    source = resolve_model_source(name_or_path)
    base = peft_adapter_base(source)
    if base is not None:
        return _load_merged_adapter(source, base, dtype, trust_remote_code, **model_kwargs)
    torch_dtype = _dtype(dtype)
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:  # pragma: no cover - transformers is a core dependency
        raise ModelLoadError(f"transformers is not importable: {_one_line(e)}") from None
    is_local = os.path.isdir(source)
    kwargs = dict(model_kwargs)
    if torch_dtype is not None:
        kwargs["dtype"] = torch_dtype
    if _offline():  # honour HF_HUB_OFFLINE set after huggingface_hub was imported: no network retries
        kwargs.setdefault("local_files_only", True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code,
                                                  local_files_only=kwargs.get("local_files_only", False))
        model = AutoModelForCausalLM.from_pretrained(source, trust_remote_code=trust_remote_code, **kwargs)
    except Exception as e:  # noqa: BLE001 - one clear line for every cause
        if is_local:
            raise ModelLoadError(f"cannot load model from local folder {source}: {_one_line(e)}") from None
        why = ("HF_HUB_OFFLINE is set and it is not in the local Hugging Face cache" if _offline()
               else "the Hugging Face Hub is unreachable or the id is wrong, and it is not in the local cache")
        raise ModelLoadError(f"cannot load model {source!r}: {why} ({_one_line(e)})") from None
    if getattr(tokenizer, "pad_token", None) is None and getattr(tokenizer, "eos_token", None) is not None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    return model, tokenizer


def peft_adapter_base(source: str) -> str | None:
    """The base model of a local PEFT adapter folder (``adapter_config.json``), None for anything else;
    a relative base path is taken relative to the adapter folder when it exists there."""
    import json

    config = Path(source) / "adapter_config.json"
    if not config.is_file():
        return None
    try:
        base = json.loads(config.read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError) as e:
        raise ModelLoadError(f"{config}: unreadable adapter config ({_one_line(e)})") from None
    if not base:
        raise ModelLoadError(f"{config}: no base_model_name_or_path; load the base model and the adapter "
                             "with PeftModel.from_pretrained, or set it")
    near = Path(source) / base
    return str(near.resolve()) if not Path(base).is_absolute() and near.exists() else base


def _load_merged_adapter(source: str, base: str, dtype: Any, trust_remote_code: bool, **model_kwargs: Any):
    """A PEFT adapter folder as a plain model: its base with the adapter merged in (tokenizer: the
    adapter folder's when it has one, else the base's)."""
    model, tokenizer = load_pretrained(base, dtype=dtype, trust_remote_code=trust_remote_code, **model_kwargs)
    try:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, source).merge_and_unload()
    except Exception as e:  # noqa: BLE001 - one clear line for every cause
        raise ModelLoadError(f"cannot apply the PEFT adapter in {source} to {base}: {_one_line(e)}") from None
    if (Path(source) / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
        if tokenizer.pad_token is None and tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
    return model.eval(), tokenizer
