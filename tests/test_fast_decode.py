"""The lean decode step (masrl.models.fast_decode) is bitwise transformers' forward, and applies only where it should.

Per step (MHA, GQA and biased tiny Llama configs, tiny Qwen2 and Qwen3 configs, 1-33 rows, with and without padding,
stacked and one-by-one projections): the same logits and the same keys/values in the cache as ``model(...)`` with masrl's CPU decode
attention. Through the engine (sampled at temperature 1, prefix reuse, finished rows compacted, continuous
batching): the same tokens and log-probs with ``fast_decode`` on and off, the fast step really used. It steps
aside for autocast, LoRA variants (DoRA), hooks, sliding windows, training mode and other architectures, and rebuilds its stacked
weights after an in-place update.
"""
import pytest
import torch

from masrl.models import fast_decode
from masrl.models.cpu_attention import cpu_attention
from masrl.models.fast_decode import FastDecode, unsupported
from masrl.models.tiny import build_char_tokenizer, build_tiny_model
from masrl.rollout.engine import GenRequest, TransformersEngine
from masrl.rollout.kv_cache import output_cache, preallocated_cache, with_cache

CONFIGS = {
    "mha": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
            "intermediate_size": 96},
    "gqa": {"hidden_size": 96, "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 2,
            "intermediate_size": 160},
    "biased": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "intermediate_size": 96, "attention_bias": True, "mlp_bias": True},
}
# transformers' Qwen2 (biased q/k/v) and Qwen3 (RMSNorm on the query and key heads, its own head size)
QWEN = {
    "qwen2": {"hidden_size": 96, "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 2,
              "intermediate_size": 160},
    "qwen3": {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 24, "intermediate_size": 160},
}
ARCHITECTURES = [*CONFIGS, *QWEN]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _model(tok, name, **extra):
    if name in CONFIGS:
        return build_tiny_model(tok, {**CONFIGS[name], **extra}, seed=1).eval()
    import transformers

    prefix = {"qwen2": "Qwen2", "qwen3": "Qwen3"}[name]
    config = getattr(transformers, f"{prefix}Config")(vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                                      tie_word_embeddings=True, **QWEN[name], **extra)
    torch.manual_seed(1)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    with torch.no_grad():  # norms that are not all ones, so that a norm left out or misplaced shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    return model


def _steps(model, rows: int, prompt: int, steps: int, padded: bool, fast: FastDecode | None):
    """Prefill random prompts, then greedy decode steps; returns (logits per step, final cache buffers)."""
    g = torch.Generator().manual_seed(rows * 100 + prompt)
    ids = torch.randint(10, 90, (rows, prompt), generator=g)
    mask = torch.ones(rows, prompt + steps, dtype=torch.long)
    if padded:  # left padding of different lengths, as the engine lays out prompts
        for r in range(rows):
            mask[r, :r % prompt] = 0
    out_logits = []
    with torch.inference_mode(), cpu_attention(model):
        cache = preallocated_cache(model, prompt + steps)
        out = model(input_ids=ids, attention_mask=mask[:, :prompt], use_cache=True, logits_to_keep=1,
                    **with_cache(cache))
        cache = output_cache(out)
        feed, pos = out.logits[:, -1].argmax(-1), mask[:, :prompt].sum(1)
        for s in range(steps):
            length = prompt + s + 1
            if fast is not None:
                assert unsupported(model) is None
                logits = fast.step(feed, mask[:, :length], pos, cache)
            else:
                out = model(input_ids=feed[:, None], attention_mask=mask[:, :length], position_ids=pos[:, None],
                            use_cache=True, **with_cache(cache))
                cache, logits = output_cache(out), out.logits[:, -1, :]
            out_logits.append(logits.clone())
            feed, pos = logits.argmax(-1), pos + 1
    return torch.stack(out_logits), [(layer._k.clone(), layer._v.clone()) for layer in cache.layers]


@pytest.mark.parametrize("name", ARCHITECTURES)
@pytest.mark.parametrize("stacked", [True, False])
def test_step_is_bitwise_transformers_forward(tok, name, stacked, monkeypatch):
    model = _model(tok, name)
    if not stacked:
        monkeypatch.setattr(fast_decode, "STACK_MAX_BYTES", 0)
    with cpu_attention(model):
        fast = FastDecode.for_model(model)
    assert fast is not None and fast.stacked is stacked
    for rows, prompt, padded in [(1, 5, False), (5, 9, True), (33, 12, True), (8, 7, False)]:
        want, want_cache = _steps(model, rows, prompt, 6, padded, None)
        got, got_cache = _steps(model, rows, prompt, 6, padded, fast)
        assert torch.equal(got, want), (rows, prompt, padded)
        for (k1, v1), (k2, v2) in zip(got_cache, want_cache):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)


def _requests(tok):
    questions = ["Q 1+2\nS ", "Q 12+13-4\nS ", "Q 7\nS ", "Q 29-3+11\nS "]
    ids = [tok(q, add_special_tokens=False)["input_ids"] for q in questions]
    return [GenRequest(ids[i % len(ids)], temperature=1.0, top_p=1.0 if i % 3 else 0.9,
                       max_new_tokens=[24, 9, 17, 30][i % 4]) for i in range(14)]


def _engine(model, tok, fast: bool) -> TransformersEngine:
    return TransformersEngine(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, seed=5,
                              fast_decode=fast)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_engine_results_bitwise_with_and_without(tok, name, monkeypatch):
    model = _model(tok, name)
    calls = []
    step = FastDecode.step
    monkeypatch.setattr(FastDecode, "step", lambda self, *a: calls.append(1) or step(self, *a))
    results = {}
    for fast in (True, False):
        engine = _engine(model, tok, fast)
        first = engine.generate(_requests(tok))
        # a second round whose prompts continue the first's rows: prefix reuse from the store
        again = [GenRequest(list(r.prompt_ids) + res.response_ids + [tok.convert_tokens_to_ids("V")], 1.0, 1.0, 11)
                 for r, res in zip(_requests(tok), first)]
        second = engine.generate(again)
        results[fast] = [(r.response_ids, r.logprobs) for r in first + second]
        if fast:
            assert calls, "the fast step was not used"
            n_fast = len(calls)
    assert len(calls) == n_fast  # off: never called
    assert results[True] == results[False]
    assert sum(len(ids) for ids, _ in results[True]) > 150


def test_continuous_batching_bitwise_with_and_without(tok):
    model = _model(tok, "gqa")
    out = {}
    for fast in (True, False):
        engine = _engine(model, tok, fast)
        done = {}
        with engine.continuous():
            for i, r in enumerate(_requests(tok)[:6]):
                engine.enqueue(r, i)
            steps = 0
            while engine.busy:
                for ticket, res in engine.step():
                    done[ticket] = (res.response_ids, res.logprobs)
                if steps == 3:  # requests joining the running batch
                    for i, r in enumerate(_requests(tok)[6:]):
                        engine.enqueue(r, 6 + i)
                steps += 1
        out[fast] = done
    assert out[True] == out[False] and len(out[True]) == 14


def test_stacked_weights_reused_until_a_weight_changes(tok):
    model = _model(tok, "mha")
    with cpu_attention(model):
        first = FastDecode.for_model(model)
        assert FastDecode.for_model(model, first) is first
        with torch.no_grad():
            model.model.layers[0].mlp.up_proj.weight.mul_(0.5)  # an optimizer step, in place
        second = FastDecode.for_model(model, first)
    assert second is not first
    want, _ = _steps(model, 4, 6, 4, True, None)
    got, _ = _steps(model, 4, 6, 4, True, second)
    assert torch.equal(got, want)
    stale, _ = _steps(model, 4, 6, 4, True, first)
    assert not torch.equal(stale, want)  # the stacked copy really is a copy: the check matters


def test_steps_aside_where_it_is_not_bitwise(tok):
    model = _model(tok, "mha")
    assert "attention" in unsupported(model)  # not switched to masrl's CPU decode attention
    with cpu_attention(model):
        assert unsupported(model) is None
        with torch.autocast("cpu", dtype=torch.float16):  # bf16 runs (tests/test_fast_decode_bf16.py), fp16 not
            assert FastDecode.for_model(model) is None
        model.train()
        assert "training" in unsupported(model)
        model.eval()
        hook = model.model.layers[1].mlp.register_forward_hook(lambda *a: None)
        assert "hooks" in unsupported(model)
        hook.remove()
        assert unsupported(model) is None
    peft = pytest.importorskip("peft")  # plain LoRA adapters run in the fast step (tests/test_multi_adapter_decode.py)
    dora = peft.get_peft_model(_model(tok, "mha"), peft.LoraConfig(r=4, target_modules=["q_proj"], use_dora=True)).eval()
    with cpu_attention(dora):
        assert "variant" in unsupported(dora)
    sliding = _model(tok, "qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    with cpu_attention(sliding):
        assert "sliding" in unsupported(sliding)
    from transformers import MistralConfig, MistralForCausalLM

    other = MistralForCausalLM(MistralConfig(vocab_size=120, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                             num_key_value_heads=2, intermediate_size=96)).eval()
    with cpu_attention(other):
        assert "Qwen3" in unsupported(other)


def test_engine_of_a_sharded_model_keeps_transformers_forward(tok, monkeypatch):
    """FSDP2 (``model_sharded``): the engine never builds a fast decoder, even if the hooks were gone."""
    model = _model(tok, "mha")
    built = []
    for_model = FastDecode.for_model.__func__
    monkeypatch.setattr(FastDecode, "for_model", classmethod(lambda cls, *a, **k: built.append(1) or for_model(cls, *a, **k)))
    engine = _engine(model, tok, True)
    engine.model_sharded()
    assert sum(len(r.response_ids) for r in engine.generate(_requests(tok))) > 50
    assert not built and engine._fast is None
    plain = _engine(model, tok, True)
    plain.generate(_requests(tok))
    assert built  # the same engine unsharded does build one
