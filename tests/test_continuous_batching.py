"""Continuous batching (``rollout.continuous_batching``): the in-process engine keeps one running decode batch that
admits requests between decode steps, and the scheduler hands each row back to its episode as soon as it stops.

Greedy rows must equal the batched engine's (tokens identical, log-probs within 1e-5: the same keys/values computed
in other batch shapes), including rows admitted mid-decode, rows of different prompt lengths and per-agent LoRA
adapters; sampled rows draw another random stream, so their log-probs are checked against a fresh teacher-forced
forward of prompt + response instead.
"""
import asyncio

import pytest
import torch

from masrl.rollout.engine import GenRequest, TransformersEngine
from masrl.rollout.scheduler import RolloutScheduler

TOL = 1e-5
QUESTIONS = ["Q 12+13-4, then add the first number\nS ", "Q 7*3\nS ", "Q 5\nS ",
             "Q a much longer question about 17 and 4, and then some more words\nS "]


def _enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _engine(model, tok, seed=3, eos=None, **kw):
    return TransformersEngine(model, eos_token_ids=eos or [tok.eos_token_id], pad_token_id=tok.pad_token_id,
                              seed=seed, **kw)


def _drive(engine, requests, schedule):
    """Run ``engine`` continuously: request ``i`` is queued before step ``schedule[i]``; results by request."""
    got, step = {}, 0
    with engine.continuous():
        while engine.busy or step <= max(schedule):
            for i, at in enumerate(schedule):
                if at == step:
                    engine.enqueue(requests[i], i)
            for ticket, result in engine.step():
                assert ticket not in got
                got[ticket] = result
            step += 1
    assert not engine.busy
    return [got[i] for i in range(len(requests))]


def _same(plain, cont):
    assert [r.response_ids for r in plain] == [r.response_ids for r in cont]
    assert [r.truncated for r in plain] == [r.truncated for r in cont]
    diff = max((abs(a - b) for p, c in zip(plain, cont) for a, b in zip(p.logprobs, c.logprobs)), default=0.0)
    assert diff < TOL, diff


def _lora(model):
    from masrl.models.lora import attach_adapters

    model = attach_adapters(model, ["A", "B"], r=4, alpha=8.0).eval()
    with torch.no_grad():  # LoRA starts as the identity: make the adapters differ
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    return model


@pytest.mark.parametrize("lora", [False, True])
def test_greedy_rows_admitted_mid_decode_equal_the_batched_engine(tiny, lora):
    model, tok = tiny
    model = _lora(model) if lora else model
    adapters = [None, "A", "B", "A"] if lora else [None] * 4
    # "\n" also stops rows: lengths differ, so rows finish (and leave) at different steps
    eos = [tok.eos_token_id, tok.convert_tokens_to_ids("\n")]
    requests = [GenRequest(_enc(tok, q), temperature=0.0, max_new_tokens=[20, 8, 15, 30, 3][i % 5],
                           adapter=adapters[i % 4]) for i, q in enumerate(QUESTIONS * 4)]
    reference = _engine(model, tok, eos=eos).generate(requests)
    engine = _engine(model, tok, eos=eos)
    # four waves: an empty batch, then requests joining after 2, 5 and 11 decode steps of the running rows
    got = _drive(engine, requests, [0] * 5 + [2] * 4 + [5] * 4 + [11] * 3)
    _same(reference, got)
    assert engine.readmitted_tokens > 0  # rows were carried into a new segment at an admission
    assert engine.tokens_generated == sum(len(r.response_ids) for r in got)


def test_a_continued_turn_joins_the_running_batch_and_reuses_its_rows(tiny):
    """A second turn whose prompt continues a finished row of the running batch finds that row's keys/values."""
    model, tok = tiny
    first = [GenRequest(_enc(tok, QUESTIONS[0]), temperature=0.0, max_new_tokens=n) for n in (4, 30)]
    plain = _engine(model, tok)
    r1 = plain.generate(first)
    second = GenRequest(first[0].prompt_ids + r1[0].response_ids + _enc(tok, "\nV "), temperature=0.0,
                        max_new_tokens=6)
    reference = r1 + plain.generate([second])
    engine = _engine(model, tok)
    got = _drive(engine, first + [second], [0, 0, 5])  # row 0 stopped after 4 tokens; row 1 still decodes
    _same(reference, got)
    # the prompt once, then at most "\nV " + the last reply token (the match may run on into row 1's reply)
    assert len(first[0].prompt_ids) < engine.prefill_tokens <= len(first[0].prompt_ids) + 4


def test_sampled_logprobs_equal_a_teacher_forced_forward(tiny):
    model, tok = tiny
    model = _lora(model)
    temps, top_ps, adapters = [1.0, 0.7, 1.3, 1.0], [1.0, 0.9, 1.0, 0.8], [None, "A", "B", "B"]
    requests = [GenRequest(_enc(tok, q), temperature=temps[i % 4], top_p=top_ps[i % 4], max_new_tokens=[12, 25, 7][i % 3],
                           adapter=adapters[i % 4]) for i, q in enumerate(QUESTIONS * 3)]
    engine = _engine(model, tok, seed=11)
    got = _drive(engine, requests, [0] * 4 + [3] * 4 + [9] * 4)
    assert engine.readmitted_tokens > 0
    from masrl.models.lora import mixed_adapters

    for req, res in zip(requests, got):
        assert len(res.response_ids) == req.max_new_tokens or res.response_ids[-1] == tok.eos_token_id
        assert res.truncated == (len(res.response_ids) == req.max_new_tokens and res.response_ids[-1] != tok.eos_token_id)
        assert tok.eos_token_id not in res.response_ids[:-1]
        ids = torch.tensor([req.prompt_ids + res.response_ids])
        with torch.no_grad(), mixed_adapters(model, [req.adapter]):
            logits = model(input_ids=ids).logits[0, len(req.prompt_ids) - 1:-1].float()
        logp = torch.log_softmax(logits / req.temperature, -1).gather(-1, torch.tensor(res.response_ids)[:, None])
        assert torch.allclose(logp.squeeze(1), torch.tensor(res.logprobs), atol=TOL, rtol=0)


def test_the_admission_limit_bounds_the_running_batch(tiny):
    model, tok = tiny
    requests = [GenRequest(_enc(tok, QUESTIONS[i % 2]), temperature=0.0, max_new_tokens=10) for i in range(12)]
    reference = _engine(model, tok).generate(requests)
    extent = max(len(r.prompt_ids) for r in requests) + 10
    rows_seen = []
    engine = _engine(model, tok, max_batch_size=5, max_running_tokens=3 * extent)
    hook = model.register_forward_hook(lambda m, args, kwargs, out: rows_seen.append(kwargs["input_ids"].shape[0]),
                                       with_kwargs=True)
    try:
        got = _drive(engine, requests, [0] * 12)
    finally:
        hook.remove()
    _same(reference, got)
    assert max(rows_seen) == 3  # the token limit (3 rows) binds before max_batch_size (5)
    one = _engine(model, tok, max_running_tokens=1)  # a request larger than the limit still runs, alone
    _same(reference[:2], _drive(one, requests[:2], [0, 0]))


def _two_turn_episodes(scheduler, tok, prompts, budgets):
    """Episodes of two greedy turns: the second continues the first's ids (a team's transcript)."""

    async def episode(i):
        first = GenRequest(_enc(tok, prompts[i]), temperature=0.0, max_new_tokens=budgets[i])
        r1 = await scheduler.generate("p", first)
        second = GenRequest(first.prompt_ids + r1.response_ids + _enc(tok, "\nV "), temperature=0.0,
                            max_new_tokens=2 if budgets[i] == 30 else 8)
        r2 = await scheduler.generate("p", second)
        return i, r1, r2

    return [episode(i) for i in range(len(prompts))]


def test_scheduler_returns_each_row_to_its_episode_without_a_round_barrier(tiny):
    model, tok = tiny
    prompts, budgets = QUESTIONS * 2, [3, 30, 5, 12, 20, 4, 9, 16]
    runs, steps = {}, {}
    for continuous in (False, True):
        engine = _engine(model, tok)
        scheduler = RolloutScheduler({"p": engine}, continuous=continuous)
        runs[continuous] = scheduler.run(_two_turn_episodes(scheduler, tok, prompts, budgets))
        steps[continuous] = scheduler.stats
        assert not engine.busy
    for (i, a1, a2), (j, b1, b2) in zip(runs[False], runs[True]):
        assert i == j
        _same([a1, a2], [b1, b2])
    assert steps[True].requests == steps[False].requests == 16
    assert steps[True].generated_tokens == steps[False].generated_tokens
    # batched: one call per round, >= 30 + 8 decode steps; continuous: the other episodes' second turns (8 tokens)
    # run beside the longest first turn (30), so the rollout takes the longest episode's 30 + 2 steps
    assert steps[False].engine_calls == 2 and steps[True].engine_calls == 0
    assert 30 <= steps[True].decode_steps <= 30 + 2


def test_a_cancelled_or_failing_episode_does_not_hang_the_others(tiny):
    model, tok = tiny
    engine = _engine(model, tok)
    scheduler = RolloutScheduler({"p": engine}, continuous=True)
    request = GenRequest(_enc(tok, QUESTIONS[0]), temperature=0.0, max_new_tokens=20)

    async def gives_up():  # cancels its own call while its row decodes
        call = asyncio.ensure_future(scheduler.generate("p", request))
        for _ in range(4):  # the scheduler runs an engine step between these
            await asyncio.sleep(0)
        assert engine.busy and not call.done()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        return "gave up"

    async def normal():
        return (await scheduler.generate("p", request)).response_ids

    out = scheduler.run([gives_up(), normal(), normal()])
    assert out[0] == "gave up" and out[1] == out[2] == _engine(model, tok).generate([request])[0].response_ids

    async def fails():
        await scheduler.generate("p", GenRequest(request.prompt_ids, temperature=0.0, max_new_tokens=2))
        raise RuntimeError("episode broke")

    with pytest.raises(RuntimeError, match="episode broke"):
        scheduler.run([fails(), normal(), normal()])
    assert not engine.busy  # the others' rows were dropped with the failed rollout
    assert scheduler.run([normal()]) == [out[1]]  # and the next rollout runs normally
