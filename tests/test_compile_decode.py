"""benchmarks/compile_decode.py: its decode step per layer is the engine's fast step rewritten, so that the
compiled-vs-eager figures compare like with like.

* as it is (no compilation), the rewritten step decodes bitwise the engine's tokens and log-probs;
* (slow: inductor compiles the layer) compiled, it decodes the same greedy tokens, log-probs within bf16 rounding;
* it refuses per-row LoRA routing, which it does not implement.
Each needs a CPU where oneDNN packs bf16 weights (the step it rewrites is the packed bf16 one).
"""
from __future__ import annotations

import random

import pytest
import torch

from conftest import load_benchmark
from masrl.models.packed_linear import available as packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="oneDNN does not pack bf16 weights on this CPU")


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("compile_decode.py")


def _model():
    from masrl.models.tiny import build_char_tokenizer, build_tiny_model

    # every projection at least MIN_WEIGHT entries, so each is packed as in SmolLM2's step
    return build_tiny_model(build_char_tokenizer(), {"hidden_size": 256, "num_hidden_layers": 2,
                                                     "num_attention_heads": 4, "num_key_value_heads": 2,
                                                     "intermediate_size": 512, "initializer_range": 0.1}, seed=0).eval()


@pytest.fixture(scope="module")
def model():
    return _model()


def _decode(model, step, monkeypatch, temperature: float, adapters=None):
    from masrl.models.fast_decode import FastDecode
    from masrl.rollout.engine import GenRequest, TransformersEngine

    engine = TransformersEngine(model, eos_token_ids=[10_000], pad_token_id=0, autocast="bfloat16")
    if step is not None:
        monkeypatch.setattr(FastDecode, "_step", step)
    r = random.Random(0)
    requests = [GenRequest([r.randrange(20, 90) for _ in range(12)], temperature, 1.0, 10,
                           None if adapters is None else adapters[i]) for i in range(6)]
    engine.reseed(0)
    results = engine.generate(requests)
    fast = engine._fast
    assert fast is not None and fast.packed and fast.stacked  # the step the benchmark rewrites ran
    monkeypatch.undo()
    return [r.response_ids for r in results], [r.logprobs for r in results]


def test_the_rewritten_step_as_it_is_decodes_bitwise_the_engines(bench, model, monkeypatch):
    ref = _decode(model, None, monkeypatch, 1.0)
    got = _decode(model, bench.compiled_step(bench.layer_step), monkeypatch, 1.0)
    assert got == ref


@pytest.mark.slow
def test_the_compiled_step_decodes_the_same_greedy_tokens(bench, model, monkeypatch):
    ref_ids, ref_lps = _decode(model, None, monkeypatch, 0.0)
    ids, lps = _decode(model, bench.compiled_step(torch.compile(bench.layer_step, dynamic=False)), monkeypatch, 0.0)
    assert ids == ref_ids
    assert max(abs(a - b) for row, ref in zip(lps, ref_lps) for a, b in zip(row, ref)) < 0.1


def test_it_refuses_per_row_adapters(bench, monkeypatch):
    from masrl.models.lora import attach_adapters

    lora = attach_adapters(_model(), ["A", "B"], r=4, alpha=8.0)
    try:
        with pytest.raises(SystemExit, match="base model's step only"):
            _decode(lora.eval(), bench.compiled_step(bench.layer_step), monkeypatch, 1.0, adapters=["A", "B"] * 3)
    finally:
        monkeypatch.undo()
