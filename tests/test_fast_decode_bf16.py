"""The lean decode step (masrl.models.fast_decode) in bfloat16: bf16 weights, and float32 weights under CPU bf16
autocast (``trainer.autocast``, the engine's ``autocast``), against transformers' own forward in the same precision.

Per step (MHA, GQA and biased tiny Llama configs, tiny Qwen2 and Qwen3 configs, 1-33 rows, with and without
padding): the logits and the keys/values in the cache within :data:`TOLERANCE` of ``model(...)`` with masrl's CPU
decode attention, relative to the tensor's largest entry (absolute below 1); the step computes the same casts in the
same places as transformers (autocast's casts of every ``Linear``'s input and weights, float32 norms and residual
sums by type promotion), so what is left is the BLAS's summation order. The comparison is tight enough to tell a step
that ignores autocast (float32 products) from the real one. Per-row LoRA adapters in bf16 and under autocast: within
:data:`LORA_TOLERANCE` of PEFT's forward with the row's adapter active. Through the engine: greedy tokens identical
with ``fast_decode`` on and off under a fixed seed, the fast step really used; with adapters a row may part from the
reference only at a near-tie of the reference's own logits.
"""
import pytest
import torch

from masrl.models.cpu_attention import cpu_attention
from masrl.models.fast_decode import FastDecode, precision, unsupported
from masrl.models.tiny import build_char_tokenizer
from masrl.rollout.engine import GenRequest, TransformersEngine
from masrl.rollout.kv_cache import output_cache, preallocated_cache, with_cache

from test_fast_decode import ARCHITECTURES, _model

# The step makes the bf16 products transformers makes, in the same places; only the stacked q/k/v and gate/up
# weights could change a BLAS's summation order. Measured: bitwise (error 0) on AMD EPYC (AVX2) for every config and
# mode. The tolerance is a quarter of bf16's relative step (2^-8): a step that ignores autocast is off by 2.3e-3 to
# 6.2e-3 (test_the_comparison_catches_a_step_in_the_wrong_precision).
TOLERANCE = 1e-3
# Adapters: PEFT scales B's output, the step the rank-wide activations before B, and B's zero blocks may regroup the
# sum; after the bf16 rounding of each projection's output that is a flipped last bit here and there, carried
# through the layers (measured 3e-3 to 9.4e-3 on the configs below); a swapped adapter is off by more than 2x this.
LORA_TOLERANCE = 2e-2
MODES = ["bfloat16", "autocast", "bfloat16+autocast"]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _in_mode(model, mode: str):
    """``model`` with norms that are not all ones (a misplaced bf16 rounding of a norm shows), in ``mode``'s dtype.

    The norms are drawn from their own seeded generator: from the global one, they depended on which tests ran
    before, and about 1 draw in 150 (MHA under autocast, Sapphire Rapids, one thread) meets a single-element
    rounding flip between the stacked and the separate q/k/v products (one value-cache entry one bf16 step apart
    at one row, carried into 64 logits: 1.6e-3 against the 1e-3 tolerance); now every run compares the same
    model."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(torch.rand(p.shape, generator=g, dtype=p.dtype) + 0.5)
    return model.to(torch.bfloat16) if mode.startswith("bfloat16") else model


def _autocast(mode: str):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled="autocast" in mode)


def _cache_dtype(model, mode):
    """The cache dtype the engine uses (TransformersEngine._cache_dtype): float32 for float32 weights under
    autocast, else the keys' own."""
    with _autocast(mode), cpu_attention(model):
        return TransformersEngine._cache_dtype(model)


def _steps(model, mode, rows: int, prompt: int, steps: int, padded: bool, fast: FastDecode | None, routes=None):
    """Prefill random prompts, then decode steps feeding random tokens: (logits per step, final cache buffers)."""
    g = torch.Generator().manual_seed(rows * 100 + prompt)
    ids = torch.randint(10, 90, (rows, prompt), generator=g)
    feeds = torch.randint(10, 90, (rows, steps), generator=g)
    mask = torch.ones(rows, prompt + steps, dtype=torch.long)
    if padded:
        for r in range(rows):
            mask[r, :r % prompt] = 0
    dtype = _cache_dtype(model, mode)
    out_logits = []
    with torch.no_grad(), _autocast(mode), cpu_attention(model):
        cache = preallocated_cache(model, prompt + steps, dtype)
        routing = _routing(model, routes) if fast is not None else None
        if routing is not None:
            routing.__enter__()
        out = model(input_ids=ids, attention_mask=mask[:, :prompt], use_cache=True, logits_to_keep=1,
                    **with_cache(cache))
        if routing is not None:
            routing.__exit__(None, None, None)
        cache, pos = output_cache(out), mask[:, :prompt].sum(1)
        for s in range(steps):
            length = prompt + s + 1
            if fast is not None:
                logits = fast.step(feeds[:, s], mask[:, :length], pos, cache, routes)
            else:
                out = model(input_ids=feeds[:, s:s + 1], attention_mask=mask[:, :length], position_ids=pos[:, None],
                            use_cache=True, **with_cache(cache))
                cache, logits = output_cache(out), out.logits[:, -1, :]
            out_logits.append(logits.float().clone())
            pos = pos + 1
    return torch.stack(out_logits), [torch.stack([layer._k, layer._v]).float().clone() for layer in cache.layers]


def _routing(model, routes):
    if routes is None:
        return None
    from masrl.models.lora import mixed_adapters

    return mixed_adapters(model, routes)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp(min=1.0))


def _errors(model, mode, fast, cases=((1, 5, False), (5, 9, True), (33, 12, True))) -> tuple[float, float]:
    logit_error = cache_error = 0.0
    for rows, prompt, padded in cases:
        want, want_cache = _steps(model, mode, rows, prompt, 6, padded, None)
        got, got_cache = _steps(model, mode, rows, prompt, 6, padded, fast)
        assert got.dtype == want.dtype and got.shape == want.shape
        logit_error = max(logit_error, _relative(got, want))
        cache_error = max(cache_error, max(_relative(a, b) for a, b in zip(got_cache, want_cache)))
    return logit_error, cache_error


def _fast(model, mode) -> FastDecode:
    with _autocast(mode), cpu_attention(model):
        assert unsupported(model) is None, unsupported(model)
        fast = FastDecode.for_model(model)
    assert fast is not None
    return fast


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_step_matches_transformers_forward_in_bf16(tok, name, mode):
    model = _in_mode(_model(tok, name), mode)
    fast = _fast(model, mode)
    assert fast.dtypes == ((torch.float32 if mode == "autocast" else torch.bfloat16), torch.bfloat16)
    logit_error, cache_error = _errors(model, mode, fast)
    assert logit_error <= TOLERANCE and cache_error <= TOLERANCE, (logit_error, cache_error)


@pytest.mark.parametrize("name", ["gqa", "qwen3"])
def test_the_comparison_catches_a_step_in_the_wrong_precision(tok, name):
    """A float32 step under autocast (products not rounded to bf16) is off by more than the tolerance."""
    model = _in_mode(_model(tok, name), "autocast")
    with cpu_attention(model):
        wrong = FastDecode.for_model(model)  # built outside autocast: float32 products
    assert wrong.dtypes == (torch.float32, torch.float32)
    assert max(_errors(model, "autocast", wrong, cases=((8, 9, True), (33, 12, True)))) > 2 * TOLERANCE


def test_precision_follows_weights_and_autocast(tok):
    model = _model(tok, "mha")
    assert precision(model) == (torch.float32, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert precision(model) == (torch.float32, torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.float16):
        assert precision(model) is None
    model.to(torch.bfloat16)
    assert precision(model) == (torch.bfloat16, torch.bfloat16)
    with cpu_attention(model):
        assert unsupported(model) is None
        model.model.layers[0].mlp.up_proj.float()  # one projection in another dtype
        assert "bfloat16" in unsupported(model)


def test_fast_decoder_rebuilt_when_the_precision_changes(tok):
    model = _model(tok, "gqa")
    with cpu_attention(model):
        plain = FastDecode.for_model(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = FastDecode.for_model(model, plain)
            assert low is not plain and low.layers[0]["o"][0].dtype == torch.bfloat16
            assert FastDecode.for_model(model, low) is low
        assert FastDecode.for_model(model, low) is not low


from masrl.models import fast_decode as fast_decode_module  # noqa: E402
from masrl.models.packed_linear import available as packing_available  # noqa: E402

needs_packing = pytest.mark.skipif(not packing_available(), reason="no oneDNN prepacked bf16 linear here (torch "
                                                                   "build or an AVX2-only CPU)")


def _packed_fast(model, mode, monkeypatch) -> FastDecode:
    """The fast step with every base weight prepacked (the tiny configs are below the packing threshold)."""
    monkeypatch.setattr(fast_decode_module, "MIN_WEIGHT", 0)
    with _autocast(mode), cpu_attention(model):
        fast = FastDecode.for_model(model, packed=True)
    assert fast.packed and all(w.is_mkldnn for layer in fast.layers
                               for w, _ in [*layer["qkv"], layer["o"], *layer["gate_up"], layer["down"]])
    assert fast.head[0].is_mkldnn
    return fast


@needs_packing
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_packed_step_is_bitwise_the_unpacked_step(tok, name, mode, monkeypatch):
    """oneDNN-prepacked bf16 weights (Qwen2's q/k/v biases included) give the step's logits and cache bitwise."""
    model = _in_mode(_model(tok, name), mode)
    plain = _fast(model, mode)
    assert not plain.packed and not plain.head[0].is_mkldnn
    packed = _packed_fast(model, mode, monkeypatch)
    for rows, prompt, padded in ((1, 5, False), (8, 9, True), (33, 12, True)):
        want, want_cache = _steps(model, mode, rows, prompt, 5, padded, plain)
        got, got_cache = _steps(model, mode, rows, prompt, 5, padded, packed)
        assert torch.equal(got, want), (rows, prompt, padded)
        assert all(torch.equal(a, b) for a, b in zip(got_cache, want_cache))


@needs_packing
def test_the_packed_comparison_catches_a_dropped_bias(tok, monkeypatch):
    """The bitwise check can fail: a packed product that drops Qwen2's q/k/v biases changes the logits."""
    model = _in_mode(_model(tok, "qwen2"), "autocast")
    with torch.no_grad():  # transformers initialises biases to 0, which dropping would not change
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.uniform_(-0.5, 0.5)
    plain = _fast(model, "autocast")
    packed = _packed_fast(model, "autocast", monkeypatch)
    real = fast_decode_module.packed_linear
    monkeypatch.setattr(fast_decode_module, "packed_linear", lambda x, w, b=None: real(x, w, None))
    want, _ = _steps(model, "autocast", 8, 9, 3, True, plain)
    got, _ = _steps(model, "autocast", 8, 9, 3, True, packed)
    assert not torch.equal(got, want)


@needs_packing
def test_packing_follows_the_engine_flag_and_the_precision(tok, monkeypatch):
    monkeypatch.setattr(fast_decode_module, "MIN_WEIGHT", 0)
    model = _model(tok, "gqa")
    with cpu_attention(model):
        assert not FastDecode.for_model(model, packed=True).packed  # float32 products: F.linear (MKL), never packed
        with torch.autocast("cpu", dtype=torch.bfloat16):
            packed = FastDecode.for_model(model, packed=True)
            assert packed.packed and FastDecode.for_model(model, packed, packed=True) is packed
            assert not FastDecode.for_model(model, packed, packed=False).packed
    engine = TransformersEngine(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id,
                                autocast="bfloat16", packed_linear=False)
    engine.generate([GenRequest(tok("Q 1+2\nS ")["input_ids"], 1.0, 1.0, 4)])
    assert engine._fast is not None and not engine._fast.packed
    engine = TransformersEngine(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id,
                                autocast="bfloat16")
    engine.generate([GenRequest(tok("Q 1+2\nS ")["input_ids"], 1.0, 1.0, 4)])
    assert engine._fast is not None and engine._fast.packed


@needs_packing
@pytest.mark.parametrize("name", ["gqa", "qwen2"])
def test_the_fast_step_shares_the_engines_packs(tok, name, monkeypatch):
    """o, down and the LM head decode on the very tensors the engine's PackedLinears keep for the prefill (one copy
    and one packing per weight), with the logits and cache of a step that packs its own; the engine wires it."""
    from masrl.models import packed_linear as packed_linear_module
    from masrl.models.packed_linear import PackedLinears

    monkeypatch.setattr(packed_linear_module, "MIN_WEIGHT", 0)  # the tiny configs are below both thresholds
    model = _in_mode(_model(tok, name), "autocast")
    own = _packed_fast(model, "autocast", monkeypatch)
    shared = PackedLinears()
    with _autocast("autocast"), cpu_attention(model):
        common = FastDecode.for_model(model, packed=True, shared_packs=shared)
    blocks = model.model.layers
    assert shared.packs == 2 * len(blocks) + 1  # o and down of every layer, the head; nothing else
    for layer, block in zip(common.layers, blocks):
        assert layer["o"][0] is shared.packed_weight(block.self_attn.o_proj)
        assert layer["down"][0] is shared.packed_weight(block.mlp.down_proj)
        assert all(w.is_mkldnn for w, _ in [*layer["qkv"], *layer["gate_up"]])  # stacked: the step's own
    assert common.head[0] is shared.packed_weight(model.lm_head) and shared.packs == 2 * len(blocks) + 1
    want, want_cache = _steps(model, "autocast", 8, 9, 4, True, own)
    got, got_cache = _steps(model, "autocast", 8, 9, 4, True, common)
    assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(got_cache, want_cache))

    engine = TransformersEngine(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id,
                                autocast="bfloat16")
    engine.generate([GenRequest(tok("Q 1+2\nS ")["input_ids"], 1.0, 1.0, 4)])
    assert engine._fast.layers[0]["o"][0] is engine.packed_linears.packed_weight(blocks[0].self_attn.o_proj)


peft = pytest.importorskip("peft")

ADAPTERS = {
    "Solver": dict(r=4, lora_alpha=6, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "Verifier": dict(r=8, lora_alpha=3, target_modules=["v_proj", "gate_proj", "down_proj", "lm_head"]),
}


def _lora_model(tok, name, mode):
    """Adapters as masrl makes them for a bf16 policy: float32 adapter weights (PEFT's autocast_adapter_dtype)."""
    base = _in_mode(_model(tok, name), mode)
    model = peft.get_peft_model(base, peft.LoraConfig(**ADAPTERS["Solver"]), adapter_name="Solver")
    model.add_adapter("Verifier", peft.LoraConfig(**ADAPTERS["Verifier"]))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


@needs_packing
def test_the_fast_step_shares_the_engines_packs_under_adapters(tok, monkeypatch):
    """With LoRA adapters (o_proj, down_proj and the LM head carry some) the step shares the packs of the base
    layers, which the prefill's PEFT layers call."""
    from masrl.models import packed_linear as packed_linear_module
    from masrl.models.lora_decode import base_linear
    from masrl.models.packed_linear import PackedLinears

    monkeypatch.setattr(packed_linear_module, "MIN_WEIGHT", 0)
    monkeypatch.setattr(fast_decode_module, "MIN_WEIGHT", 0)
    model = _lora_model(tok, "gqa", "autocast")
    shared = PackedLinears()
    with _autocast("autocast"), cpu_attention(model):
        fast = FastDecode.for_model(model, packed=True, shared_packs=shared)
    causal = model.base_model.model
    for layer, block in zip(fast.layers, causal.model.layers):
        assert layer["o"][0] is shared.packed_weight(base_linear(block.self_attn.o_proj))
        assert layer["down"][0] is shared.packed_weight(base_linear(block.mlp.down_proj))
    assert fast.head[0] is shared.packed_weight(base_linear(causal.lm_head))
    assert shared.packs == 2 * len(causal.model.layers) + 1


def _peft_reference(model, mode, rows, prompt, routes):
    logits, caches = None, None
    for adapter in set(routes):
        if adapter is None:
            with model.disable_adapter():
                got, cache = _steps(model, mode, rows, prompt, 5, True, None)
        else:
            model.set_adapter(adapter)
            got, cache = _steps(model, mode, rows, prompt, 5, True, None)
        index = torch.tensor([i for i, a in enumerate(routes) if a == adapter])
        if logits is None:
            logits, caches = torch.zeros_like(got), [torch.zeros_like(c) for c in cache]
        logits[:, index] = got[:, index]
        for mine, theirs in zip(caches, cache):
            mine[:, index] = theirs[:, index]
    return logits, caches


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["gqa", "qwen2"])
def test_rows_decode_with_their_adapter_in_bf16(tok, name, mode):
    model = _lora_model(tok, name, mode)
    assert {p.dtype for n, p in model.named_parameters() if ".lora_" in n} == {torch.float32}
    fast = _fast(model, mode)
    assert fast.lora_dtype == (torch.bfloat16 if "autocast" in mode else torch.float32)
    for rows, prompt in [(1, 5), (9, 8)]:
        routes = [("Solver", "Verifier", None)[(i + i // 3) % 3] for i in range(rows)]
        want, want_cache = _peft_reference(model, mode, rows, prompt, routes)
        got, got_cache = _steps(model, mode, rows, prompt, 5, True, fast, routes)
        logit_error = _relative(got, want)
        cache_error = max(_relative(a, b) for a, b in zip(got_cache, want_cache))
        assert logit_error <= LORA_TOLERANCE and cache_error <= LORA_TOLERANCE, (rows, logit_error, cache_error)
    swapped = [{"Solver": "Verifier", "Verifier": "Solver"}.get(a, a) for a in routes]  # the check matters
    assert _relative(_steps(model, mode, rows, prompt, 5, True, fast, swapped)[0], want) > 2 * LORA_TOLERANCE


def _requests(tok, adapters=(None,)):
    questions = ["Q 1+2\nS ", "Q 12+13-4\nS ", "Q 7\nS ", "Q 29-3+11\nS "]
    ids = [tok(q, add_special_tokens=False)["input_ids"] for q in questions]
    return [GenRequest(ids[i % len(ids)], temperature=0.0, top_p=1.0, max_new_tokens=[24, 9, 17, 30][i % 4],
                       adapter=adapters[i % len(adapters)]) for i in range(10)]


# The base step is bitwise here, so greedy tokens are identical. With adapters the step is within LORA_TOLERANCE,
# not bitwise: a near-tie can flip a greedy token, after which the row's continuation differs. There a row may part
# from the reference only where the reference's own top two logits are within NEAR_TIE of each other (checked by
# teacher-forcing the shared prefix through PEFT's forward with the row's adapter); a row routed to the wrong
# adapter parts at a clear winner (test_greedy_check_catches_a_wrong_adapter).
NEAR_TIE = 2 * LORA_TOLERANCE


def _reference_margin(model, mode, prompt_ids, adapter) -> float:
    """The top-two logit gap of PEFT's forward after ``prompt_ids``, relative to the largest logit (at least 1)."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad(), _autocast(mode), cpu_attention(model):
        if adapter is None:
            with model.disable_adapter():
                logits = model(input_ids=ids).logits[0, -1].float()
        else:
            model.set_adapter(adapter)
            logits = model(input_ids=ids).logits[0, -1].float()
    top = logits.topk(2).values
    return float((top[0] - top[1]) / logits.abs().max().clamp(min=1.0))


def _assert_same_or_near_tie(model, mode, requests, got, want):
    for req, a, b in zip(requests, got, want):
        if a == b:
            continue
        first = next(i for i in range(min(len(a), len(b)) + 1) if i == min(len(a), len(b)) or a[i] != b[i])
        margin = _reference_margin(model, mode, req.prompt_ids + b[:first], req.adapter)
        assert margin <= NEAR_TIE, (f"a row ({req.adapter}) parted from the reference at token {first} where "
                                    f"the reference's top two logits are {margin:.3g} apart (not a near-tie)")


def test_greedy_check_catches_a_wrong_adapter(tok):
    """Rows decoded with the other role's adapter part from the reference at a clear winner: the check fails."""
    import dataclasses

    model = _lora_model(tok, "gqa", "bfloat16")
    requests = _requests(tok, ("Solver", "Verifier", None))
    swapped = [dataclasses.replace(r, adapter={"Solver": "Verifier", "Verifier": "Solver"}.get(r.adapter, r.adapter))
               for r in requests]
    out = {}
    for fast, reqs in ((True, swapped), (False, requests)):
        engine = TransformersEngine(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, seed=5,
                                    fast_decode=fast)
        out[fast] = [r.response_ids for r in engine.generate(reqs)]
    with pytest.raises(AssertionError, match="not a near-tie"):
        _assert_same_or_near_tie(model, "bfloat16", requests, out[True], out[False])


@pytest.mark.parametrize("mode,name,adapters", [("autocast", "gqa", (None,)), ("bfloat16", "qwen3", (None,)),
                                                ("bfloat16", "gqa", ("Solver", "Verifier", None)),
                                                ("autocast", "qwen2", ("Solver", "Verifier", None))])
def test_engine_greedy_tokens_identical_with_and_without(tok, mode, name, adapters, monkeypatch):
    model = _lora_model(tok, name, mode) if adapters != (None,) else _in_mode(_model(tok, name), mode)
    calls = []
    step = FastDecode.step
    monkeypatch.setattr(FastDecode, "step", lambda self, *a: calls.append(self.dtypes) or step(self, *a))
    results = {}
    requests = _requests(tok, adapters)
    for fast in (True, False):
        engine = TransformersEngine(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, seed=5,
                                    fast_decode=fast, autocast="bfloat16" if "autocast" in mode else None)
        first = engine.generate(requests)
        results[fast] = [r.response_ids for r in first]
        if fast:
            assert calls and calls[0][1] == torch.bfloat16, "the fast step was not used in bf16"
            n_fast = len(calls)
    assert len(calls) == n_fast
    if adapters == (None,):
        assert results[True] == results[False]
    else:
        _assert_same_or_near_tie(model, mode, requests, results[True], results[False])
        assert sum(a == b for a, b in zip(results[True], results[False])) >= len(requests) // 2
    assert sum(len(ids) for ids in results[True]) > 100
