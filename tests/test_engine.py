"""Rollout engine and scheduler: batched KV-cache sampling, logprobs that match training."""
import asyncio

import pytest
import torch

from masrl.models.tiny import build_char_tokenizer, build_tiny_model
from masrl.rollout.engine import Engine, GenRequest, GenResult, TransformersEngine
from masrl.rollout.scheduler import RolloutScheduler
from masrl.training.update import Row, pack_rows, response_logits, token_logprobs

SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
         "intermediate_size": 64, "max_position_embeddings": 128}


@pytest.fixture(scope="module")
def model_tok():
    tok = build_char_tokenizer()
    return build_tiny_model(tok, SMALL, seed=0), tok


def _engine(model, tok, seed=0):
    return TransformersEngine(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, seed=seed)


def test_rollout_logprobs_match_training_forward(model_tok):
    """Rollout logprobs (left-padded, cached decoding) equal the trainer's recomputation."""
    model, tok = model_tok
    prompts = [tok("Q 1+2\nS ", add_special_tokens=False)["input_ids"],
               tok("Q 12+3-4\nS ", add_special_tokens=False)["input_ids"]]
    reqs = [GenRequest(p, temperature=0.7, max_new_tokens=10) for p in prompts]
    results = _engine(model, tok).generate(reqs)
    rows = [Row("a", p, r.response_ids, r.logprobs, 1.0, 0.7) for p, r in zip(prompts, results)]
    batch = pack_rows(rows, tok.pad_token_id)
    with torch.no_grad():
        recomputed = token_logprobs(response_logits(model, batch), batch.targets)
    diff = ((recomputed - batch.old_logprobs) * batch.response_mask).abs().max()
    assert all(len(r.response_ids) > 0 for r in results)
    assert float(diff) < 1e-4


def test_per_row_budget_and_greedy_determinism(model_tok):
    model, tok = model_tok
    p = tok("Q 5\nS ", add_special_tokens=False)["input_ids"]
    reqs = [GenRequest(p, temperature=0.0, max_new_tokens=3), GenRequest(p, temperature=0.0, max_new_tokens=7)]
    a, b = _engine(model, tok).generate(reqs)
    assert len(a.response_ids) <= 3 and len(b.response_ids) <= 7
    assert b.response_ids[:len(a.response_ids)] == a.response_ids  # same greedy path
    if len(a.response_ids) == 3:
        assert a.truncated


def test_sampling_is_seeded(model_tok):
    model, tok = model_tok
    p = tok("Q 7-3\nS ", add_special_tokens=False)["input_ids"]
    reqs = [GenRequest(p, max_new_tokens=8) for _ in range(4)]
    one = [r.response_ids for r in _engine(model, tok, seed=3).generate(reqs)]
    two = [r.response_ids for r in _engine(model, tok, seed=3).generate(reqs)]
    other = [r.response_ids for r in _engine(model, tok, seed=4).generate(reqs)]
    assert one == two and one != other


class _CountingEngine(Engine):
    def __init__(self):
        self.calls = []

    def generate(self, requests):
        from masrl.rollout.engine import GenResult

        self.calls.append(len(requests))
        return [GenResult([1, 2], [-0.1, -0.2], False) for _ in requests]


def test_scheduler_batches_across_episodes_and_agents():
    """All pending calls of every episode go out in one engine call per policy."""
    shared, other = _CountingEngine(), _CountingEngine()
    sched = RolloutScheduler({"shared": shared, "other": other})

    async def episode(i):
        await sched.generate("shared", GenRequest([1]))               # "Solver"
        await asyncio.gather(sched.generate("shared", GenRequest([2])),  # "Verifier" on the same policy
                             sched.generate("other", GenRequest([3])))
        if i % 2 == 0:
            await sched.generate("shared", GenRequest([4]))
        return i

    assert sched.run([episode(i) for i in range(6)]) == list(range(6))
    assert shared.calls == [6, 6, 3]
    assert other.calls == [6]


def test_scheduler_propagates_workflow_errors():
    sched = RolloutScheduler({"p": _CountingEngine()})

    async def bad():
        await sched.generate("p", GenRequest([1]))
        raise RuntimeError("workflow bug")

    async def good():
        await sched.generate("p", GenRequest([1]))
        await sched.generate("p", GenRequest([1]))

    with pytest.raises(RuntimeError, match="workflow bug"):
        sched.run([bad(), good()])


def test_a_backend_needs_only_generate_and_reseed():
    """The Engine protocol's defaults cover what the scheduler and the update hooks ask of a backend."""
    from types import SimpleNamespace

    from masrl.config import RolloutConfig
    from masrl.training.policy import after_update, before_update

    class Echo(Engine):
        def __init__(self):
            self.batches = []

        def generate(self, requests):
            self.batches.append(len(requests))
            return [GenResult(list(r.prompt_ids), [0.0] * len(r.prompt_ids), False) for r in requests]

        def reseed(self, seed):
            pass

    engine = Echo()
    sched = RolloutScheduler({"p": engine})

    async def episode(i):
        return (await sched.generate("p", GenRequest([i, i]))).response_ids

    assert sched.run([episode(i) for i in range(3)]) == [[0, 0], [1, 1], [2, 2]]
    assert engine.batches == [3]  # submitted once, generated in one call at collect
    policy = SimpleNamespace(engine=engine, model=None, cfg=SimpleNamespace(lora=None), base_trained=False)
    before_update(policy, RolloutConfig(sleep_level=1))  # cannot sleep: not asked to
    after_update(policy)
    assert not engine.shares_training_model and not engine.can_sleep
