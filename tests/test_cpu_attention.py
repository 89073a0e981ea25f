"""masrl's CPU attention (masrl.models.cpu_attention) computes sdpa's result.

Tiny Llama models built from config (multi-head, GQA, SmolLM2-shaped GQA 9/3): in float32, and under bf16
autocast (or with bf16 inputs) computed in float32, the function equals float32 ``sdpa`` on random inputs (masks:
none, padding, additive, batch-broadcast; keys as strided cache views) within 2e-6, closer than bf16 ``sdpa``.
The engine decodes the same greedy tokens with it as without, log-probs within 1e-5 in float32 and within 0.02
under bf16 autocast; under autocast its float32 cache gives bitwise the results of a bf16 cache; it is really
used for the decode steps, prompts still go to ``sdpa``, and the model is ``sdpa`` again after. Several query
tokens (prompts, training sequences) under bf16 autocast run float32 ``sdpa`` up to FLOAT32_MAX_KEYS keys, bitwise,
gradients included; beyond the limit and in float32 without autocast the very same ``sdpa`` call.
"""
import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from masrl.models.cpu_attention import FLOAT32_MAX_KEYS, NAME, attention_forward, cpu_attention
from masrl.models.tiny import build_char_tokenizer, build_tiny_model
from masrl.rollout.engine import GenRequest, TransformersEngine

CONFIGS = {
    "mha": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
            "intermediate_size": 64, "max_position_embeddings": 128},
    "gqa": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 64, "max_position_embeddings": 128},
    "smollm2_shaped": {"hidden_size": 144, "num_hidden_layers": 3, "num_attention_heads": 9, "num_key_value_heads": 3,
                       "intermediate_size": 96, "max_position_embeddings": 256, "tie_word_embeddings": True},
}


class _Attn(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups


@pytest.mark.parametrize("mask_kind", ["none", "padding", "additive", "broadcast"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 2)])
def test_function_equals_sdpa_for_one_token_queries(mask_kind, heads, kv_heads):
    g = torch.Generator().manual_seed(0)
    batch, length, dim = 5, 23, 16
    q = torch.randn(batch, heads, 1, dim, generator=g)
    k_buf, v_buf = (torch.randn(batch, kv_heads, length + 9, dim, generator=g) for _ in range(2))
    k, v = k_buf[:, :, :length], v_buf[:, :, :length]  # strided views, as the preallocated cache hands them
    mask = None
    if mask_kind != "none":
        mask = torch.ones(batch, 1, 1, length, dtype=torch.bool)
        mask[1, ..., :7] = False
        mask[3, ..., :2] = False
        if mask_kind == "additive":
            mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
        if mask_kind == "broadcast":  # one mask row for the whole batch
            mask = mask[1:2]
    module = _Attn(heads // kv_heads)
    expected, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=dim ** -0.5)
    got, weights = attention_forward(module, q, k, v, mask, scaling=dim ** -0.5)
    assert weights is None and got.shape == expected.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=0)  # float32: two matmuls and a softmax
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the engine's default on a bf16 CPU
        fast, _ = attention_forward(module, q, k, v, mask, scaling=dim ** -0.5)
        slow, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=dim ** -0.5)
    assert fast.dtype == torch.float32 and fast.shape == expected.shape == (batch, 1, heads, dim)
    torch.testing.assert_close(fast, expected, atol=2e-6, rtol=0)
    assert (slow.float() - expected).abs().max() > 1e-4  # what bf16 sdpa loses
    low = [t.bfloat16() for t in (q, k, v)]  # a model in bfloat16 (no autocast)
    out, _ = attention_forward(module, *low, mask, scaling=dim ** -0.5)
    reference, _ = sdpa_attention_forward(module, *(t.float() for t in low), mask, scaling=dim ** -0.5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference.bfloat16().float(), atol=0, rtol=0.008)


def test_prompts_run_sdpa_in_float32_under_autocast_up_to_the_key_limit():
    """Several query tokens (prompts, training sequences) go to transformers' sdpa: under bf16 autocast on a CPU
    with float32 inputs and autocast off (bitwise float32 sdpa, rounded to bf16 as sdpa's output would be), up to
    FLOAT32_MAX_KEYS keys; beyond, and in float32 without autocast, the very same sdpa call."""
    g = torch.Generator().manual_seed(1)
    module = _Attn(2)
    for length, float32 in [(6, True), (FLOAT32_MAX_KEYS, True), (FLOAT32_MAX_KEYS + 1, False)]:
        q = torch.randn(2, 4, length, 8, generator=g)
        k, v = torch.randn(2, 2, length, 8, generator=g), torch.randn(2, 2, length, 8, generator=g)
        mask = torch.ones(length, length, dtype=torch.bool).tril()[None, None].repeat(2, 1, 1, 1)
        mask[1, ..., :3] = False
        mask[1, 0, :3, 0] = True  # padding rows still see one key, as transformers' sdpa mask makes them
        for m in (None, mask):
            plain, _ = sdpa_attention_forward(module, q, k, v, m, scaling=0.3)
            got, _ = attention_forward(module, q, k, v, m, scaling=0.3)
            assert torch.equal(got, plain)  # float32, no autocast: the same call
            with torch.autocast("cpu", dtype=torch.bfloat16):
                bf16, _ = sdpa_attention_forward(module, q, k, v, m, scaling=0.3)
                got, _ = attention_forward(module, q, k, v, m, scaling=0.3)
            assert got.dtype == bf16.dtype == torch.bfloat16
            if float32:
                assert torch.equal(got, plain.bfloat16())
                assert not torch.equal(got, bf16)  # what bf16 sdpa loses
            else:
                assert torch.equal(got, bf16)
            low = [t.bfloat16() for t in (q, k, v)]  # a bf16 model, no autocast
            got, _ = attention_forward(module, *low, m, scaling=0.3)
            reference, _ = sdpa_attention_forward(module, *(t.float() for t in low), m, scaling=0.3)
            expected = reference.bfloat16() if float32 else sdpa_attention_forward(module, *low, m, scaling=0.3)[0]
            assert got.dtype == torch.bfloat16 and torch.equal(got, expected)


def test_float32_short_attention_gradients_flow_to_bf16_inputs():
    """Training under autocast: the float32 attention's gradients reach the bf16 queries, keys and values
    (through the casts) and equal float32 sdpa's, rounded to bf16."""
    g = torch.Generator().manual_seed(2)
    module = _Attn(3)
    q = torch.randn(2, 9, 12, 16, generator=g).bfloat16().requires_grad_()
    k, v = (torch.randn(2, 3, 12, 16, generator=g).bfloat16().requires_grad_() for _ in range(2))
    grad = torch.randn(2, 12, 9, 16, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attention_forward(module, q, k, v, None, scaling=0.25)
    out.float().backward(grad)
    ref = [t.detach().float().requires_grad_() for t in (q, k, v)]
    expected, _ = sdpa_attention_forward(module, *ref, None, scaling=0.25)
    expected.backward(grad.bfloat16().float())
    assert torch.equal(out, expected.bfloat16())
    for t, r in zip((q, k, v), ref):
        assert t.grad.dtype == torch.bfloat16 and torch.equal(t.grad, r.grad.bfloat16())


def _requests(tok, equal_lengths: bool) -> list[GenRequest]:
    questions = ["Q 12+13-4\nS ", "Q 29-3+11\nS "] if equal_lengths else ["Q 1+2\nS ", "Q 12+13-4\nS ", "Q 7\nS "]
    ids = [tok(q, add_special_tokens=False)["input_ids"] for q in questions]
    return [GenRequest(ids[i % len(ids)], temperature=0.0, top_p=1.0, max_new_tokens=[24, 9, 17][i % 3])
            for i in range(9)]


def _generate(model, tok, requests, *, fast: bool, autocast=None, seen=None):
    engine = TransformersEngine(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, seed=3,
                                decode_attention=fast, autocast=autocast)
    hook = None
    if seen is not None:  # the attention implementation each forward ran with, by query length
        hook = model.model.layers[0].self_attn.register_forward_pre_hook(
            lambda mod, args, kw: seen.add((kw["hidden_states"].shape[1] == 1, mod.config._attn_implementation)),
            with_kwargs=True)
    try:
        return engine.generate(requests)
    finally:
        if hook is not None:
            hook.remove()


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("equal_lengths", [False, True])  # padding mask / no mask (transformers' enable_gqa path)
def test_engine_greedy_tokens_identical_and_logprobs_close(name, equal_lengths):
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, CONFIGS[name], seed=0).eval()
    requests = _requests(tok, equal_lengths)
    seen = set()
    fast = _generate(model, tok, requests, fast=True, autocast="bfloat16", seen=seen)
    slow = _generate(model, tok, requests, fast=False, autocast="bfloat16")
    assert seen == {(False, NAME), (True, NAME)}  # prompts (falling back to sdpa) and decode steps
    assert model.config._attn_implementation == "sdpa"
    assert [r.response_ids for r in fast] == [r.response_ids for r in slow]
    assert sum(len(r.response_ids) for r in fast) > 40
    for a, b in zip(fast, slow):  # measured max 0.0039 (sdpa rounds its inputs to bf16)
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=0.02, rtol=0)
    assert fast != slow  # the attention really changed
    # float32: the same greedy tokens, log-probs within float32 rounding
    fast, slow = _generate(model, tok, requests, fast=True), _generate(model, tok, requests, fast=False)
    assert [r.response_ids for r in fast] == [r.response_ids for r in slow]
    for a, b in zip(fast, slow):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["gqa", "smollm2_shaped"])
def test_float32_cache_under_autocast_gives_the_bf16_cache_results(name, monkeypatch):
    """Under bf16 autocast the engine keeps float32 keys/values (the bf16 values exactly), so the decode
    attention reads them in place: the same tokens and log-probs, bitwise, as a bf16 cache."""
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, CONFIGS[name], seed=0).eval()
    requests = _requests(tok, equal_lengths=False)
    dtypes = []
    original = TransformersEngine._cache_dtype

    def spy(model):
        dtypes.append(original(model))
        return dtypes[-1]

    monkeypatch.setattr(TransformersEngine, "_cache_dtype", staticmethod(spy))
    float32_cache = _generate(model, tok, requests, fast=True, autocast="bfloat16")
    assert dtypes == [torch.float32]
    monkeypatch.setattr(TransformersEngine, "_cache_dtype", staticmethod(lambda model: None))
    bf16_cache = _generate(model, tok, requests, fast=True, autocast="bfloat16")
    assert float32_cache == bf16_cache and sum(len(r.response_ids) for r in bf16_cache) > 40
    dtypes.clear()
    monkeypatch.setattr(TransformersEngine, "_cache_dtype", staticmethod(spy))
    _generate(model, tok, requests, fast=True)  # float32 without autocast: the keys' own dtype
    _generate(model, tok, requests, fast=False, autocast="bfloat16")  # sdpa decoding: its bf16 cache
    assert dtypes == [None, None]


def test_only_cpu_sdpa_models_switch_and_the_switch_is_undone():
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, CONFIGS["gqa"], seed=0)
    with cpu_attention(model) as switched:
        assert switched and model.config._attn_implementation == NAME
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError), cpu_attention(model):
        raise RuntimeError("a failing decode")
    assert model.config._attn_implementation == "sdpa"
    model.set_attn_implementation("eager")
    with cpu_attention(model) as switched:
        assert not switched and model.config._attn_implementation == "eager"
