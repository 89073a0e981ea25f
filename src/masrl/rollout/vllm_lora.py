"""The LoRA adapters a ``masrl.rollout.vllm_engine.VLLMEngine`` serves (``VLLMAdapters``).

Adapters are registered from a PEFT folder, or from a state dict + LoRA config that is written to a private
temp folder, and re-registered after every update under a new integer id, so vLLM never serves a stale cached
copy; the previous version is evicted. After ``sleep(2)`` (the GPU LoRA slots dropped) every adapter is
registered again on wake-up.
"""
from __future__ import annotations

import enum
import itertools
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

__all__ = ["VLLMAdapters"]


def _json_default(value: Any):
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, enum.Enum):
        return value.value
    return str(value)


class VLLMAdapters:
    """Adapter name -> vLLM ``LoRARequest`` of one engine. ``llm``: the engine's ``vllm.LLM`` now (None once
    closed); ``awake``: whether the engine holds its GPU memory (adapters are loaded at once then)."""

    def __init__(self, llm: Callable[[], Any], awake: Callable[[], bool]):
        self._llm, self._awake = llm, awake
        self.requests: dict[str, Any] = {}          # name -> LoRARequest
        self.paths: dict[str, Path] = {}            # name -> its PEFT folder
        self.owned_dirs: dict[str, Path] = {}       # name -> folder written here (removed when replaced)
        self.versions: dict[str, int] = {}
        self._lora_ids = itertools.count(1)
        self.root: Path | None = None               # parent of the folders written here
        self.refresh_on_wake = False                # sleep(2) dropped the GPU LoRA slots too

    def load(self, name: str, path_or_state: str | os.PathLike | Mapping[str, torch.Tensor], *,
             peft_config: Any = None) -> None:
        """Register (or replace) adapter ``name``: a PEFT adapter folder, or a state dict + its LoRA config."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"adapter name must be a non-empty string; got {name!r}")
        version = self.versions.get(name, 0) + 1
        if isinstance(path_or_state, (str, os.PathLike)):
            path, owned = Path(path_or_state), False
            if not (path / "adapter_config.json").is_file():
                raise FileNotFoundError(f"{path} is not a PEFT adapter folder (no adapter_config.json)")
        else:
            path, owned = self._write(name, version, path_or_state, peft_config), True
        self._register(name, version, path, owned)

    def _write(self, name: str, version: int, state: Mapping[str, torch.Tensor], peft_config: Any) -> Path:
        from safetensors.torch import save_file

        if peft_config is None:
            raise ValueError(f"adapter {name!r}: a state dict needs peft_config (r, lora_alpha, target_modules)")
        config = dict(peft_config.to_dict() if hasattr(peft_config, "to_dict") else peft_config)
        missing = [k for k in ("r", "lora_alpha", "target_modules") if config.get(k) is None]
        if missing:
            raise ValueError(f"adapter {name!r}: peft_config lacks {missing}")
        config.setdefault("peft_type", "LORA")
        if not state:
            raise ValueError(f"adapter {name!r}: empty state dict")
        bad = [k for k in state if not any(part.startswith("lora_") for part in k.split("."))]
        if bad:
            raise ValueError(f"adapter {name!r}: keys are not LoRA weights in PEFT's saved layout, e.g. {bad[:2]}")
        if self.root is None:
            self.root = Path(tempfile.mkdtemp(prefix="masrl-vllm-lora-"))
        folder = self.root / f"{name}-v{version}"
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().to("cpu").contiguous() for k, v in state.items()},
                  str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
        (folder / "adapter_config.json").write_text(json.dumps(config, default=_json_default, indent=1))
        return folder

    def _register(self, name: str, version: int, path: Path, owned: bool) -> None:
        from vllm.lora.request import LoRARequest

        lora_id = next(self._lora_ids)
        # a unique name per registration: vLLM compares (and hashes) LoRA requests by name
        request = LoRARequest(f"{name}@{lora_id}", lora_id, str(path))
        old, old_dir = self.requests.get(name), self.owned_dirs.pop(name, None)
        self.requests[name] = request
        self.paths[name] = path
        self.versions[name] = version
        if owned:
            self.owned_dirs[name] = path
        if self._awake():  # load now: a broken adapter fails here, not in the middle of a rollout
            add = getattr(getattr(self._llm(), "llm_engine", None), "add_lora", None)
            if add is not None:
                add(request)
        if old is not None:
            remove = getattr(getattr(self._llm(), "llm_engine", None), "remove_lora", None)
            if remove is not None:
                try:
                    remove(old.lora_int_id)
                except Exception:  # noqa: BLE001 - never loaded (or already evicted): nothing to free
                    pass
        if old_dir is not None and old_dir != path:
            shutil.rmtree(old_dir, ignore_errors=True)

    def request(self, adapter: str | None):
        """The ``LoRARequest`` of ``adapter`` (None: the base model)."""
        if adapter is None:
            return None
        if adapter not in self.requests:
            raise KeyError(f"no LoRA adapter {adapter!r} in this engine; load_adapter() it first "
                           f"(loaded: {sorted(self.requests)})")
        return self.requests[adapter]

    def woke_up(self) -> None:
        """The engine took its memory back: after ``sleep(2)`` every adapter is registered again under a new
        id (vLLM reloads it from disk)."""
        if not self.refresh_on_wake:
            return
        self.refresh_on_wake = False
        for name in list(self.requests):
            self._register(name, self.versions[name], self.paths[name], owned=name in self.owned_dirs)

    def close(self) -> None:
        """Remove the folders written here."""
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None
