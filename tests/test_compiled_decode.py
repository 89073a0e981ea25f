"""rollout.compile_decode: the engine's base-model decode step as one compiled graph (masrl.models.compiled_decode).

* run as it is (not compiled), ``decode_step`` decodes bitwise the eager fast step's tokens and log-probs: float32
  Llama with padding, Qwen2 (biased q/k/v), Qwen3 (q/k norms), the packed bf16 step under autocast;
* compiled with inductor, the same greedy tokens, log-probs within float32 rounding (bf16, slow: the same
  greedy tokens until two candidates tie within bf16 rounding);
* rows with LoRA adapters, a process without a working C++ compiler, and a compiled step that fails decode eager
  (the latter two say so once; the failed step loses nothing);
* the config option reaches the engine.
"""
from __future__ import annotations

import logging
import random

import pytest
import torch

import masrl.models.compiled_decode as compiled_decode
from masrl.models.compiled_layers import cxx_compiler, inductor_cache
from masrl.models.packed_linear import available as packing_available


def _tiny(arch: str = "llama", **extra):
    """A 2-layer model at init std 0.1 (a wrong rotary sign or norm changes the tokens, not only the decimals):
    tiny Llama, or transformers' Qwen2 (biased q/k/v) / Qwen3 (RMSNorm on the query and key heads)."""
    from masrl.models.tiny import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    if arch == "llama":
        return build_tiny_model(tok, {"num_hidden_layers": 2, "initializer_range": 0.1, **extra}, seed=0).eval()
    import transformers

    prefix = {"qwen2": "Qwen2", "qwen3": "Qwen3"}[arch]
    config = getattr(transformers, f"{prefix}Config")(
        vocab_size=len(tok), pad_token_id=tok.pad_token_id, tie_word_embeddings=True, hidden_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=160,
        initializer_range=0.1, **({"head_dim": 24} if arch == "qwen3" else {}))
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    with torch.no_grad():  # norms and biases that are not ones and zeros, so that one left out shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif n.endswith(".bias"):
                p.normal_(0, 0.1)
    return model


@pytest.fixture
def calls(monkeypatch):
    """The decode steps that went through ``decode_step``, run as it is (the compiled one replaced by it)."""
    seen = []

    def plain(*args, **kwargs):
        seen.append(args[0].shape[0])
        return compiled_decode.decode_step(*args, **kwargs)

    monkeypatch.setattr(compiled_decode, "compiled_decode_step", lambda: plain)
    monkeypatch.setattr(compiled_decode, "_REFUSED", {})
    return seen


def _decode(model, compiled: bool, temperature: float = 1.0, autocast=None, adapters=None, rows: int = 6):
    from masrl.rollout.engine import GenRequest, TransformersEngine

    engine = TransformersEngine(model, eos_token_ids=[10_000], pad_token_id=0, autocast=autocast,
                                compile_decode=compiled)
    r = random.Random(0)
    requests = [GenRequest([r.randrange(20, 90) for _ in range(r.randrange(5, 14))], temperature, 1.0, 10,
                           None if adapters is None else adapters[i]) for i in range(rows)]
    engine.reseed(0)
    results = engine.generate(requests)
    assert engine._fast is not None  # the fast step ran (eager or compiled)
    return [x.response_ids for x in results], [x.logprobs for x in results]


def _largest_difference(a, b) -> float:
    return max(abs(x - y) for row_a, row_b in zip(a[1], b[1]) for x, y in zip(row_a, row_b))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_the_step_as_it_is_decodes_bitwise_the_eager_step(arch, calls):
    model = _tiny(arch)
    ref = _decode(model, False)
    assert calls == []
    got = _decode(model, True)
    assert calls and calls[0] == 6  # every decode step of the call went through decode_step
    assert got == ref


@pytest.mark.skipif(not packing_available(), reason="oneDNN does not pack bf16 weights on this CPU")
def test_the_packed_bf16_step_as_it_is_is_bitwise_too(calls):
    # every projection at least MIN_WEIGHT entries, so each is packed as in SmolLM2's step
    model = _tiny(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)
    ref = _decode(model, False, autocast="bfloat16")
    got = _decode(model, True, autocast="bfloat16")
    assert calls and got == ref


def test_rows_with_adapters_decode_eager(calls):
    from masrl.models.lora import attach_adapters

    model = attach_adapters(_tiny(), ["A", "B"], r=4, alpha=8.0).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    ref = _decode(model, False, adapters=["A", "B", None] * 2)
    got = _decode(model, True, adapters=["A", "B", None] * 2)
    assert calls == [] and got == ref


def test_without_a_working_compiler_it_decodes_eager_and_says_so_once(calls, monkeypatch, caplog):
    monkeypatch.setattr("masrl.models.compiled_layers.cxx_compiler", lambda: None)
    model = _tiny()
    ref = _decode(model, False)
    with caplog.at_level(logging.WARNING, logger="masrl.models.compiled_decode"):
        got = _decode(model, True)
        _decode(model, True)
    assert calls == [] and got == ref
    lines = [r.getMessage() for r in caplog.records if "compile_decode" in r.getMessage()]
    assert lines == ["rollout.compile_decode: true, eager decode steps: "
                     "no C++ compiler found ($CXX, g++, clang++, c++)"]


def test_a_compiled_step_that_fails_is_run_eager_and_so_is_the_rest(monkeypatch, caplog):
    monkeypatch.setattr(compiled_decode, "_REFUSED", {})
    failed = []

    def failing(h, cos, sin, layers, caches, filled, *args):
        failed.append(h.shape[0])
        keys, values = caches[0]  # as a graph that fails after its first layer's cache write
        keys[:, :, int(filled)] = 7.0
        values[:, :, int(filled)] = -7.0
        raise RuntimeError("InductorError: a kernel failed\nthe rest of the message")

    monkeypatch.setattr(compiled_decode, "compiled_decode_step", lambda: failing)
    monkeypatch.setattr(compiled_decode, "compiler_failure", lambda: compiled_decode._REFUSED.get(inductor_cache()))
    model = _tiny()
    ref = _decode(model, False)
    with caplog.at_level(logging.WARNING, logger="masrl.models.compiled_decode"):
        got = _decode(model, True)
        again = _decode(model, True)
    assert got == ref and again == ref
    assert failed == [6]  # tried once; every later step of the process eager
    lines = [r.getMessage() for r in caplog.records if "compile_decode" in r.getMessage()]
    assert lines == ["rollout.compile_decode: true, eager decode steps: the compiled step failed "
                     "(RuntimeError: InductorError: a kernel failed)"]


def test_the_config_option_reaches_the_engine():
    from masrl.config import RolloutConfig
    from masrl.models.tiny import build_char_tokenizer
    from masrl.config import PolicyConfig
    from masrl.rollout.factory import make_engine

    tokenizer = build_char_tokenizer()
    model = _tiny()
    policy = PolicyConfig(model="tiny")
    on = make_engine(RolloutConfig(compile_decode=True), model, tokenizer, name="p", policy=policy, seed=0,
                     max_batch_size=8)
    off = make_engine(RolloutConfig(), model, tokenizer, name="p", policy=policy, seed=0, max_batch_size=8)
    assert on.compile_decode is True and off.compile_decode is False


@pytest.mark.skipif(cxx_compiler() is None, reason="needs a C++ compiler for inductor")
def test_compiled_it_decodes_the_same_greedy_tokens():
    model = _tiny()
    ref = _decode(model, False, temperature=0.0)
    got = _decode(model, True, temperature=0.0)
    assert got[0] == ref[0]
    assert _largest_difference(got, ref) < 1e-4
    fewer = _decode(model, True, temperature=0.0, rows=3)  # another row count: the same shape-generic graph
    assert fewer[0] == ref[0][:3]


@pytest.mark.slow
@pytest.mark.skipif(cxx_compiler() is None or not packing_available(), reason="needs a C++ compiler and bf16 packing")
def test_compiled_packed_bf16_decodes_the_same_greedy_tokens():
    model = _tiny(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)
    ref = _decode(model, False, temperature=0.0, autocast="bfloat16")
    got = _decode(model, True, temperature=0.0, autocast="bfloat16")
    same = 0
    for ids, ref_ids, lps, ref_lps in zip(got[0], ref[0], got[1], ref[1]):
        for a, b, la, lb in zip(ids, ref_ids, lps, ref_lps):
            assert abs(la - lb) < 0.1  # where the greedy tokens part, two candidates tied within bf16 rounding
            if a != b:
                break
            same += 1
    assert same >= 0.8 * sum(map(len, ref[0]))
