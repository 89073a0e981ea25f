"""Prepacked bf16 Linear weights for CPU decoding (masrl.models.packed_linear) give bitwise autocast's results.

Per layer (row counts 1-33, 2-D and 3-D inputs) and through the engine (tiny Llama configs wide enough to be
packed, with and without per-row LoRA adapters): the same tokens and log-probs as without packing; packs are
reused while the weights are unchanged and redone after an in-place update; outside bf16 autocast, with
gradients, or on small/biased layers nothing changes; the modules are plain again after the context.
"""
import pytest
import torch

from masrl.models.packed_linear import MIN_WEIGHT, PackedLinears, available
from masrl.models.tiny import build_char_tokenizer, build_tiny_model
from masrl.rollout.engine import GenRequest, TransformersEngine

needs_packing = pytest.mark.skipif(not available(), reason="no oneDNN prepacked bf16 linear here (torch build or "
                                                           "an AVX2-only CPU)")


def test_available_probes_the_cpu_and_the_engine_decodes_without_packing(monkeypatch):
    """On a CPU without AVX-512 / AVX-NE-CONVERT oneDNN raises when packing a bf16 weight: ``available()`` says
    no and a bf16 engine decodes with autocast's F.linear instead of failing."""
    import masrl.models.packed_linear as packed_linear

    def refuse(*args, **kwargs):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or "
                           "avx512bw, avx512vl and avx512dq")

    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        pytest.skip("this torch build has no oneDNN prepacked linear")
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    packed_linear.available.cache_clear()
    try:
        assert not packed_linear.available()
        tok = build_char_tokenizer()
        model = build_tiny_model(tok, WIDE, seed=0).eval()
        engine = TransformersEngine(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id,
                                    autocast="bfloat16")
        assert engine.packed_linears is None
        assert sum(len(r.response_ids) for r in engine.generate(_requests(tok))) > 40
    finally:
        monkeypatch.undo()
        packed_linear.available.cache_clear()

WIDE = {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 384, "max_position_embeddings": 128}


@needs_packing
def test_packed_layer_is_bitwise_autocast_linear():
    g = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(512, 256, bias=False)
    assert layer.weight.numel() >= MIN_WEIGHT
    small = torch.nn.Linear(64, 64, bias=False)  # below MIN_WEIGHT: its own forward
    biased = torch.nn.Linear(512, 256)  # a bias: its own forward
    model = torch.nn.ModuleList([layer, small, biased])
    packs = PackedLinears()
    for rows in (1, 2, 7, 8, 33):
        for shape in ((rows, 512), (rows, 1, 512), (2, rows, 512)):
            x = torch.randn(*shape, generator=g)
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                expected = layer(x)
                with packs.active(model) as switched:
                    got = layer(x)
                    assert switched == 1
            assert got.dtype == expected.dtype == torch.bfloat16 and torch.equal(got, expected)
    assert packs.packs == 1  # packed once, reused for every call since
    assert "forward" not in layer.__dict__  # plain again
    with torch.no_grad():  # an in-place update (an optimizer step): packed again, results follow the new weight
        layer.weight.mul_(0.5)
    x = torch.randn(5, 512, generator=g)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = layer(x)
        with packs.active(model):
            got = layer(x)
    assert packs.packs == 2 and torch.equal(got, expected)


@needs_packing
def test_no_packing_outside_bf16_autocast_inference():
    layer = torch.nn.Linear(512, 256, bias=False)
    x = torch.randn(4, 512)
    packs = PackedLinears()
    with packs.active(layer):
        with torch.no_grad():
            assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))  # float32
        with torch.autocast("cpu", dtype=torch.bfloat16):  # gradients on: the plain (differentiable) forward
            out = layer(x)
            assert out.requires_grad
    assert packs.packs == 0
    with pytest.raises(RuntimeError), packs.active(layer):
        raise RuntimeError("a failing decode")
    assert "forward" not in layer.__dict__


def _requests(tok):
    questions = ["Q 1+2\nS ", "Q 12+13-4\nS ", "Q 7\nS "]
    ids = [tok(q, add_special_tokens=False)["input_ids"] for q in questions]
    return [GenRequest(ids[i % 3], temperature=1.0, top_p=1.0, max_new_tokens=[24, 9, 17][i % 3]) for i in range(9)]


def _run(engine, requests, adapters=None):
    engine.reseed(11)
    if adapters is not None:
        requests = [GenRequest(r.prompt_ids, r.temperature, r.top_p, r.max_new_tokens, adapters[i % len(adapters)])
                    for i, r in enumerate(requests)]
    return [(r.response_ids, r.logprobs) for r in engine.generate(requests)]


@needs_packing
@pytest.mark.parametrize("lora", [False, True])
def test_engine_decodes_bitwise_with_packed_weights(lora):
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, WIDE, seed=0).eval()
    adapters = None
    if lora:
        from masrl.models.lora import attach_adapters

        model = attach_adapters(model, ["solver", "verifier"], r=4, target_modules=["q_proj", "v_proj", "up_proj"])
        with torch.no_grad():  # adapters that change the outputs
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
        adapters = ["solver", "verifier", None]
    requests = _requests(tok)
    kw = dict(eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, autocast="bfloat16")
    plain = TransformersEngine(model, packed_linear=False, **kw)
    packed = TransformersEngine(model, **kw)
    expected = _run(plain, requests, adapters)
    assert _run(packed, requests, adapters) == expected
    assert sum(len(ids) for ids, _ in expected) > 40
    first = packed.packed_linears.packs
    assert first >= 4  # the 256-wide projections (and the MLP) of both layers
    assert _run(packed, requests, adapters) == expected and packed.packed_linears.packs == first  # reused
    with torch.no_grad():  # the trainer's step changed the base weights: the engine is told, packs are redone
        for name, p in model.named_parameters():
            if "lora" not in name:
                p.mul_(0.9)
    packed.weights_changed(model, base_changed=True)
    changed = _run(plain, requests, adapters)
    assert changed != expected and _run(packed, requests, adapters) == changed
    assert packed.packed_linears.packs == 2 * first
    # float32 decoding: no packing at all
    f32 = dict(kw, autocast=None)
    assert _run(TransformersEngine(model, **f32), requests, adapters) == _run(
        TransformersEngine(model, packed_linear=False, **f32), requests, adapters)


@needs_packing
def test_released_decode_weights_are_rebuilt_with_the_same_tokens():
    """rollout.keep_decode_weights: false: before an update the engine drops its packs and the fast decoder's stacked
    weights (``before_update``); the next decode packs again and samples the same tokens and log-probs."""
    from types import SimpleNamespace

    from masrl.config import RolloutConfig
    from masrl.training.policy import before_update

    tok = build_char_tokenizer()
    model = build_tiny_model(tok, WIDE, seed=0).eval()
    requests = _requests(tok)
    engine = TransformersEngine(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id,
                                autocast="bfloat16")
    expected = _run(engine, requests, None)
    first = engine.packed_linears.packs
    assert first >= 4 and len(engine.packed_linears._packed) > 0
    policy = SimpleNamespace(engine=engine)
    before_update(policy, RolloutConfig())  # kept by default
    assert len(engine.packed_linears._packed) > 0
    before_update(policy, RolloutConfig(keep_decode_weights=False, max_staleness=1))  # decoding beside the update
    assert len(engine.packed_linears._packed) > 0
    before_update(policy, RolloutConfig(keep_decode_weights=False))
    assert len(engine.packed_linears._packed) == 0 and engine._fast is None
    assert _run(engine, requests, None) == expected and engine.packed_linears.packs == 2 * first
