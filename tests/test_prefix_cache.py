"""Prefix reuse in the transformers engine: a GRPO group's prompt is prefilled once, and a
prompt that continues an earlier row of the same rollout reuses that row's keys and values.

Every test compares against the same engine with ``prefix_cache=False`` (which is bitwise the old
decode loop, tests/test_perf_levers.py) at the same seed: the sampled tokens must be identical and
the log-probs equal up to float rounding (the reused keys/values were computed in another batch
shape), while the counters show how many prompt tokens were not run through the model again.
"""
import pytest
import torch

from masrl.rollout.engine import GenRequest, PrefixCache, TransformersEngine
from masrl.rollout.scheduler import RolloutScheduler

TOL = 1e-5  # log-prob difference allowed between reused and recomputed keys/values (observed: <= 5e-7)


def _enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _engines(model, tok, seed=5, **kw):
    make = lambda cache: TransformersEngine(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id,  # noqa: E731
                                            seed=seed, prefix_cache=cache, **kw)
    return make(False), make(True)


def _same(plain, cached):
    assert [r.response_ids for r in plain] == [r.response_ids for r in cached]
    assert [r.truncated for r in plain] == [r.truncated for r in cached]
    diff = max((abs(a - b) for p, c in zip(plain, cached) for a, b in zip(p.logprobs, c.logprobs)), default=0.0)
    assert diff < TOL, diff


def _transcript(tok, first, results, marker):
    """The next turn's prompt: the earlier prompt, the reply as decoded text, a new marker."""
    return [GenRequest(list(req.prompt_ids) + _enc(tok, tok.decode(res.response_ids, skip_special_tokens=True))
                       + _enc(tok, marker), temperature=req.temperature, top_p=req.top_p, max_new_tokens=12)
            for req, res in zip(first, results)]


QUESTIONS = ["Q 12+13-4, then add the first number\nSolver: ", "Q 7*3, and say it in words please\nSolver: ",
             "Q 5\nSolver: "]  # the last one is shorter than a block: never looked up


def test_three_turn_transcript_reuses_every_earlier_turn(tiny):
    model, tok = tiny
    plain, cached = _engines(model, tok)
    first = [GenRequest(_enc(tok, q), temperature=[1.0, 0.7, 1.3][i % 3], top_p=0.9 if i % 4 == 0 else 1.0,
                        max_new_tokens=[20, 8, 15][i % 3]) for i, q in enumerate(QUESTIONS * 4)]
    outs = {}
    for name, engine in (("plain", plain), ("cached", cached)):
        r1 = engine.generate(first)
        second = _transcript(tok, first, r1, "\nVerifier: ")
        r2 = engine.generate(second)
        third = _transcript(tok, second, r2, "\nSolver: ")
        r3 = engine.generate(third)
        outs[name] = (r1, r2, r3, second, third)
    for turn in range(3):
        _same(outs["plain"][turn], outs["cached"][turn])
    store = cached.prefix_cache
    # 12 rows, 3 distinct prompts: turn 1 prefills 3 prompts; turns 2 and 3 reuse all but a few tokens
    second, third = outs["cached"][3], outs["cached"][4]
    total = sum(len(r.prompt_ids) for r in first + second + third)
    assert plain.prefill_tokens == total
    assert cached.prefill_tokens < 0.4 * total
    assert store.hits >= 2 * 8  # every long prompt of turns 2 and 3 found its earlier row (distinct ones)
    assert store.reused_tokens > 0.5 * total


def test_group_prompts_are_prefilled_once(tiny):
    model, tok = tiny
    plain, cached = _engines(model, tok, seed=9)
    reqs = [GenRequest(_enc(tok, q), max_new_tokens=10) for q in QUESTIONS for _ in range(4)]
    _same(plain.generate(reqs), cached.generate(reqs))
    assert plain.prefill_tokens == sum(len(r.prompt_ids) for r in reqs)
    assert cached.prefill_tokens == sum(len(_enc(tok, q)) for q in QUESTIONS)


def test_no_reuse_after_the_weights_change(tiny):
    """An optimizer step changes the parameters in place: stored keys/values must not be reused
    (a stale reuse would shift the log-probs by far more than TOL after this large step)."""
    model, tok = tiny
    plain, cached = _engines(model, tok, seed=3)
    first = [GenRequest(_enc(tok, q), max_new_tokens=10) for q in QUESTIONS[:2]]
    for engine in (plain, cached):
        engine.generate(first)
    hits = cached.prefix_cache.hits
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    batch = torch.tensor([_enc(tok, QUESTIONS[0])])
    model.train()
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    model.eval()
    again = [GenRequest(_enc(tok, QUESTIONS[0]) + _enc(tok, "abc\nVerifier: "), max_new_tokens=10)]
    _same(plain.generate(again), cached.generate(again))
    assert cached.prefix_cache.hits == hits


def test_rows_reuse_only_their_own_adapter(tiny):
    from masrl.models.lora import attach_adapters

    model, tok = tiny
    model = attach_adapters(model, ["A", "B"], r=4, alpha=8.0).eval()
    with torch.no_grad():  # LoRA starts as the identity: make the adapters differ
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5 if ".A." in name else 0.05)
    plain, cached = _engines(model, tok, seed=4)
    prompt = _enc(tok, QUESTIONS[0])
    first = [GenRequest(prompt, max_new_tokens=10, adapter="A")]
    outs = {}
    for name, engine in (("plain", plain), ("cached", cached)):
        r1 = engine.generate(first)
        cont = prompt + r1[0].response_ids[:-1] + _enc(tok, "\nV ")
        # the same continuation with each adapter: only row 0 may reuse adapter A's keys/values
        r2 = engine.generate([GenRequest(cont, max_new_tokens=10, adapter=a) for a in ("A", "B", None)])
        outs[name] = r1 + r2
    _same(outs["plain"], outs["cached"])
    assert cached.prefix_cache.hits == 1


def test_memory_bound_drops_the_oldest_calls(tiny):
    model, tok = tiny
    plain, cached = _engines(model, tok, seed=2, prefix_cache_mib=0.1)
    outs = {}
    for name, engine in (("plain", plain), ("cached", cached)):
        reqs, outs[name], sizes = [GenRequest(_enc(tok, QUESTIONS[0]), max_new_tokens=30)], [], []
        for _ in range(6):  # each call continues the previous one: its buffers are larger
            out = engine.generate(reqs)
            outs[name] += out
            if engine.prefix_cache is not None:
                sizes.append(engine.prefix_cache.batches[-1].nbytes)
            reqs = [GenRequest(reqs[0].prompt_ids + out[0].response_ids[:-1] + _enc(tok, "\nS "), max_new_tokens=30)]
    _same(outs["plain"], outs["cached"])
    store = cached.prefix_cache
    assert sum(sizes) > 0.1 * 2**20 >= store.nbytes  # older calls were dropped to stay in budget
    assert 0 < len(store.batches) < 6 and store.hits == 5  # the newest row is kept: every call reused it


def test_scheduler_frees_the_stored_keys_after_a_rollout(tiny):
    model, tok = tiny
    engine = _engines(model, tok)[1]
    sched = RolloutScheduler({"p": engine})

    async def episode(q):
        r = await sched.generate("p", GenRequest(_enc(tok, q), max_new_tokens=6))
        return await sched.generate("p", GenRequest(_enc(tok, q) + r.response_ids[:-1] + _enc(tok, "\nV "),
                                                    max_new_tokens=6))

    sched.run([episode(q) for q in QUESTIONS])
    assert engine.prefix_cache.hits >= 2 and engine.prefix_cache.batches == []


def test_lookup_checks_tokens_not_only_hashes():
    store = PrefixCache(block=4)
    store._chain = lambda tokens, adapter: ((4 * (k + 1), 0) for k in range(len(tokens) // 4))  # all collide
    keys = [torch.zeros(1, 1, 8, 2)]
    from masrl.rollout.prefix_cache import StoredBatch
    store.add(StoredBatch(keys, keys, [(1, 2, 3, 4, 5, 6)], [torch.arange(6)], [None], 64))
    assert store.lookup((1, 2, 3, 4, 5, 9, 9), None)[2] == 5
    assert store.lookup((9, 9, 9, 9, 9, 9, 9), None) is None  # same hash chain, other tokens


def _decode_batch_sizes(model):
    sizes = []
    handle = model.register_forward_pre_hook(
        lambda mod, args, kwargs: sizes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    return sizes, handle


@pytest.mark.parametrize("lora", [False, True])
def test_finished_rows_leave_the_batch_without_changing_the_samples(tiny, lora):
    """Rows that stopped are dropped from the model's batch; the sampled tokens stay the same
    (sampling still draws for every row) and later calls still reuse the dropped rows."""
    model, tok = tiny
    names = [None] * 16
    if lora:
        from masrl.models.lora import attach_adapters

        model = attach_adapters(model, ["A", "B"], r=4, alpha=8.0).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.3)
        names = [None, "B", "A", "B"] * 4  # the longest rows decode with the base model: after the last
        # compaction only base rows are left, and they must still be routed as such
    eos = [tok.eos_token_id, tok.convert_tokens_to_ids("\n")]  # "\n" ends rows early
    outs, sizes = {}, {}
    for compact in (False, True):
        engine = TransformersEngine(model, eos_token_ids=eos, pad_token_id=tok.pad_token_id, seed=7,
                                    compact_finished=compact)
        first = [GenRequest(_enc(tok, QUESTIONS[i % 2]), temperature=1.3, max_new_tokens=[40, 6, 25, 12][i % 4],
                            adapter=names[i]) for i in range(16)]
        recorded, handle = _decode_batch_sizes(model)
        try:
            r1 = engine.generate(first)
            before = engine.prefill_tokens
            second = [GenRequest(q.prompt_ids + r.response_ids[:-1] + _enc(tok, "ok\nV "), max_new_tokens=8,
                                 adapter=q.adapter) for q, r in zip(first, r1)]
            r2 = engine.generate(second)
        finally:
            handle.remove()
        outs[compact], sizes[compact] = r1 + r2, [b for b, n in recorded if n == 1]
        # every row, dropped early or not, is found again: only "ok\nV " is prefilled per distinct prompt
        distinct = {(q.adapter, tuple(q.prompt_ids)) for q in second}
        assert engine.prefill_tokens - before == len(_enc(tok, "ok\nV ")) * len(distinct)
    _same(outs[False], outs[True])
    assert set(sizes[False]) == {16}
    assert min(sizes[True]) < 8 and sizes[True][0] == 16  # the batch shrank as rows finished


def test_fill_prefixes_gathers_each_rows_stored_slots_bitwise():
    """The reused prefixes land in the new buffers exactly as the stored rows' slots hold them: rows from two
    earlier calls (one covering a subset of the new rows), a prefix shorter than the width (its gap repeats a
    slot), and a row with no hit (left zero)."""
    from types import SimpleNamespace

    from masrl.rollout.prefix_cache import StoredBatch

    g = torch.Generator().manual_seed(0)
    heads, cap, dim, layers, width = 3, 11, 4, 2, 6

    def stored(rows):
        keys = [torch.randn(rows, heads, cap, dim, generator=g) for _ in range(layers)]
        values = [torch.randn(rows, heads, cap, dim + 1, generator=g) for _ in range(layers)]
        slots = [torch.randperm(cap, generator=g)[:width] for _ in range(rows)]
        return StoredBatch(keys, values, [()] * rows, slots, [None] * rows, 0)

    a, b = stored(4), stored(2)
    hits = [(a, 2, 6), None, (b, 1, 4), (a, 0, 5), (b, 0, 6)]
    filled = {}

    class Layer:
        def __init__(self, li):
            self.li = li

        def prefill(self, k, v, n):
            filled[self.li] = (k, v, n)

    def check(hits):
        cache = SimpleNamespace(layers=[Layer(li) for li in range(layers)])
        TransformersEngine._fill_prefixes(cache, hits, None, width, 9, torch.device("cpu"))
        for li in range(layers):
            check_layer(li, hits)

    def check_layer(li, hits):
        k, v, n = filled[li]
        assert n == width and k.shape == (len(hits), heads, 9, dim) and v.shape == (len(hits), heads, 9, dim + 1)
        for u, hit in enumerate(hits):
            if hit is None:
                assert not k[u].any() and not v[u].any()
                continue
            src, row, m = hit
            slots = src.slots[row][:m].tolist()
            slots = [slots[0]] * (width - m) + slots
            assert torch.equal(k[u, :, :width], src.keys[li][row][:, slots])
            assert torch.equal(v[u, :, :width], src.values[li][row][:, slots])
            assert not k[u, :, width:].any() and not v[u, :, width:].any()

    check(hits)
    check([(a, 3, 6), (a, 1, 2), (a, 1, 6), (a, 0, 3)])  # every row from one earlier call (one copy per layer)


@pytest.mark.parametrize("prefix", [False, True])
def test_a_prefill_token_budget_runs_the_prompts_in_forwards_within_it(tiny, prefix):
    """``rollout.max_prefill_tokens``: a call's prompts are prefilled in row ranges of at most that many tokens
    (rows x the range's longest prompt), every prompt once, and the samples are those of one forward."""
    model, tok = tiny
    reqs = [GenRequest(_enc(tok, QUESTIONS[i % 3] * (1 + i % 2)), temperature=1.0, max_new_tokens=10)
            for i in range(12)]
    budget = 3 * max(len(r.prompt_ids) for r in reqs) // 2
    outs, prefills = {}, {}
    for limit in (None, budget):
        engine = TransformersEngine(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, seed=3,
                                    prefix_cache=prefix, max_prefill_tokens=limit)
        recorded, handle = _decode_batch_sizes(model)
        try:
            outs[limit] = engine.generate(reqs)
        finally:
            handle.remove()
        prefills[limit] = [(rows, n) for rows, n in recorded if n > 1]
    _same(outs[None], outs[budget])
    distinct = 6 if prefix else 12  # a group's prompt is prefilled once with the prefix cache
    assert sum(rows for rows, _ in prefills[budget]) == sum(rows for rows, _ in prefills[None]) == distinct
    assert all(rows * n <= budget for rows, n in prefills[budget])
    assert max(rows * n for rows, n in prefills[None]) > budget  # the budget made the difference
    assert len(prefills[budget]) > len(prefills[None])
