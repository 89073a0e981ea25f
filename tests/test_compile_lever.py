"""torch.compile on the whole model (benchmarks/compile_lever.py; the wired lever is trainer.compile,
tests/test_compiled_layers.py).

These pin the exactness of the benchmark's patched paths, so that the numbers it reports compare like
with like and so that wiring the lever later starts from measured tolerances:

* the static-cache decode (fixed-size cache, full-length mask) samples the same tokens as the engine;
* (slow: ~20-45 s of inductor compilation) compiled update log-probs match eager within 1e-4
  (measured max 9.5e-7 on vs_trl-shaped micro-batches) and compiled decoding samples the same tokens.
"""
from __future__ import annotations

import random

import pytest
import torch

from conftest import load_benchmark


@pytest.fixture(scope="module")
def lever():
    return load_benchmark("compile_lever.py")


@pytest.fixture(scope="module")
def tiny():
    from masrl.models.tiny import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    return tok, build_tiny_model(tok, {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                                       "num_key_value_heads": 2, "intermediate_size": 128}, seed=0)


def _requests(seed: int, n: int):
    from masrl.rollout.engine import GenRequest

    r = random.Random(seed)
    return [GenRequest([r.randrange(20, 100) for _ in range(r.randint(5, 15))], max_new_tokens=r.choice([8, 16]))
            for _ in range(n)]


def _decode(lever, tok, model, reqs, mode: str, seed: int):
    from masrl.rollout.engine import TransformersEngine

    engine = TransformersEngine(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, seed=seed)
    if mode == "eager":
        return engine.generate(reqs)
    model.eval()
    with torch.inference_mode():
        return lever.static_decode(engine, model, reqs, compiled=(mode == "compiled"))


def test_static_cache_decode_matches_engine(lever, tiny):
    tok, model = tiny
    for seed, n in ((0, 7), (1, 16)):
        reqs = _requests(seed, n)
        a = _decode(lever, tok, model, reqs, "eager", seed)
        b = _decode(lever, tok, model, reqs, "static", seed)
        assert [x.response_ids for x in a] == [y.response_ids for y in b]
        for x, y in zip(a, b):
            assert max((abs(p - q) for p, q in zip(x.logprobs, y.logprobs)), default=0.0) < 1e-5


@pytest.mark.slow
def test_compiled_update_and_decode_match_eager(lever, tiny):
    from masrl.training.update import micro_batches, pack_rows, response_logits, token_logprobs

    tok, model = tiny
    model.train()
    compiled = lever.compiled_module(model)
    for chunk in micro_batches(lever.vs_trl_rows(0), 4096)[:3]:
        batch = pack_rows(chunk, 0)
        eager = token_logprobs(response_logits(model, batch), batch.targets)
        comp = token_logprobs(response_logits(compiled, batch), batch.targets)
        mask = batch.response_mask.bool()
        assert float((eager - comp)[mask].abs().max()) < 1e-4
    reqs = _requests(2, 9)
    a = _decode(lever, tok, model, reqs, "eager", 2)
    b = _decode(lever, tok, model, reqs, "compiled", 2)
    assert [x.response_ids for x in a] == [y.response_ids for y in b]
