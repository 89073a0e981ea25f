"""rollout.max_staleness: batches generated beside the update, at most k policy versions old when they train
(masrl.rollout.versioned; docs/scaling.md, "Off-policy rollouts"). Threads are ordered by conditions and events,
never by sleeping."""
import threading
from types import SimpleNamespace

import pytest
import torch

from masrl.config import config_from_dict
from masrl.errors import ConfigError
from masrl.monitoring.logger import read_metrics
from masrl.rollout.base import GenRequest, GenResult
from masrl.rollout.versioned import (RolloutsAhead, VersionedEngine, copy_unshared, rollout_copy, staleness,
                                   versioned)
from masrl.trainer import Trainer

from conftest import train_with_slow_update


class _Team:
    """A trainer's side of the bound with a slow update: the update of step t finishes only once the producer has
    gone as far ahead as the bound lets it (it is then blocked); every turn of a batch is stamped with the
    version current when it was sampled (a fast rollout)."""

    def __init__(self, k, stale, steps=6):
        self.version, self.k, self.steps = 0, k, steps
        self.trained = []  # staleness of every turn that reached the loss
        self.ahead = RolloutsAhead(self.produce, first_step=0, last_step=steps, max_staleness=k, stale=stale,
                                   versions=lambda: {"p": self.version})

    def produce(self, step):
        return [SimpleNamespace(policy="p", info={"policy_version": self.version}, step=step) for _ in range(4)]

    def lead(self, step):
        """The furthest step the producer may generate while the update of ``step`` runs."""
        return min(step + self.k + (0 if self.ahead.wait else 1), self.steps - 1)

    def run(self):
        for step in range(self.steps):
            turns = self.ahead.take(step)
            self.ahead.check(turns)
            self.trained += [a for t, a in zip(turns, staleness(turns, {"p": self.version}))
                             if not t.info.get("stale")]
            with self.ahead.cond:  # the slow update: the producer runs ahead until the bound stops it
                self.ahead.cond.wait_for(lambda: self.lead(step) in self.ahead.results or self.lead(step) == step)
                assert self.lead(step) + 1 not in self.ahead.results  # and not one batch further
            self.version += 1  # the version boundary
            self.ahead.finished_update(step)
        self.ahead.close()


@pytest.mark.parametrize("k", [1, 2])
def test_wait_no_turn_older_than_k_reaches_the_loss(k):
    team = _Team(k, "wait")
    team.run()
    assert len(team.trained) == 4 * team.steps and max(team.trained) == k  # the bound is reached, never passed


@pytest.mark.parametrize("k", [1, 2])
def test_drop_runs_further_ahead_and_drops_what_is_too_old(k):
    team = _Team(k, "drop")
    dropped = []
    check = team.ahead.check
    team.ahead.check = lambda turns: dropped.append(check(turns)["rollout/stale_dropped"])
    team.run()
    assert max(team.trained) <= k and sum(dropped) > 0
    assert len(team.trained) + sum(dropped) == 4 * team.steps


def test_wait_refuses_a_turn_past_the_bound():
    ahead = RolloutsAhead(lambda step: step, first_step=0, last_step=1, max_staleness=1, stale="wait",
                          versions=lambda: {"p": 5})
    ahead.take(0)
    with pytest.raises(RuntimeError, match="more than 1 versions old"):
        ahead.check([SimpleNamespace(policy="p", info={"policy_version": 3})])
    metrics = ahead.check([SimpleNamespace(policy="p", info={"policy_version": 4}),
                           SimpleNamespace(policy="p", info={"policy_version": 5})])
    assert metrics == {"rollout/staleness_0": 0.5, "rollout/staleness_1": 0.5, "rollout/staleness_max": 1.0,
                       "rollout/stale_dropped": 0.0}
    ahead.close()


def test_a_failed_production_is_raised_by_take():
    def produce(step):
        raise ValueError("reward exploded")

    ahead = RolloutsAhead(produce, first_step=0, last_step=3, max_staleness=1, stale="wait", versions=dict)
    with pytest.raises(ValueError, match="reward exploded"):
        ahead.take(0)
    ahead.close()


class _SlowInner:
    """An in-process engine whose batch reads a weight at its start and at its end, waiting on ``go`` between."""

    def __init__(self, model):
        self.model, self.go, self.started, self.changes = model, threading.Event(), threading.Event(), 0

    def generate(self, requests):
        first = float(self.model.weight[0, 0].detach())
        self.started.set()
        self.go.wait()
        return [GenResult([1], [first, float(self.model.weight[0, 0])], False) for _ in requests]

    def weights_changed(self, model, *, base_changed):
        self.changes += 1


def test_versioned_engine_swaps_weights_only_between_batches():
    training = torch.nn.Linear(2, 2)
    with torch.no_grad():
        training.weight.fill_(1.0)
    inner = _SlowInner(training)
    engine = VersionedEngine(inner, training)
    assert inner.model is not training and engine.shares_training_model is False
    out = {}
    batch = threading.Thread(target=lambda: out.setdefault("first", engine.generate([None])))
    batch.start()
    inner.started.wait()  # the batch is decoding with version 0
    with torch.no_grad():
        training.weight.fill_(2.0)  # the trainer's update
    swap = threading.Thread(target=lambda: engine.weights_changed(training, base_changed=True))
    swap.start()
    inner.go.set()
    batch.join(), swap.join()
    first = out["first"][0]
    assert first.logprobs == [1.0, 1.0] and first.version == 0  # one version for the whole batch
    second = engine.generate([None])[0]
    assert second.logprobs == [2.0, 2.0] and second.version == 1 and engine.version == 1
    assert float(training.weight[0, 0]) == 2.0 and inner.changes == 2  # at the wrap and at the boundary


def _cfg(tiny_cfg, **over):
    return config_from_dict(tiny_cfg(**{"sft.steps": 4, "eval.before_after": False, "logging.plots": False,
                                        "logging.tensorboard": False, **over}))


def test_training_with_rollouts_ahead(tiny_cfg, monkeypatch):
    cfg = _cfg(tiny_cfg, **{"rollout.max_staleness": 1, "trainer.total_steps": 3,
                            "algorithm.rollout_is.enabled": True})
    seen = []
    with Trainer(cfg, progress=False) as trainer:
        real = trainer.runtime.update

        def recording(policies, rows, **kwargs):
            versions = {n: p.engine.version for n, p in policies.items()}
            seen.append(versions)
            return real(policies, rows, **kwargs)

        monkeypatch.setattr(trainer.runtime, "update", recording)
        trainer.fit()
        assert isinstance(trainer.policies["shared"].engine, VersionedEngine)
        assert trainer.policies["shared"].engine.version == 3  # one version per RL update
    assert [v["shared"] for v in seen] == [0, 1, 2]
    train = [r for r in read_metrics(cfg.run_dir) if r["phase"] == "train"]
    assert len(train) == 3 and all(r["rollout/staleness_max"] <= 1 for r in train)
    assert all(r["rollout/stale_dropped"] == 0 for r in train)
    # the trainer recomputes the old log-probs (the engine decodes with a copy) and corrects by rollout_is
    assert all(any(k.startswith("policy/shared/rollout_is/") for k in r) for r in train)


@pytest.mark.parametrize("stale", ["wait", "drop"])
def test_a_slow_update_never_trains_on_a_turn_older_than_k(tiny_cfg, stale):
    """The real trainer (local runtime): the producer runs as far ahead as the bound lets it before each update."""
    cfg = _cfg(tiny_cfg, **{"rollout.max_staleness": 1, "rollout.stale": stale, "trainer.total_steps": 3,
                            "sft.steps": 0, "trainer.batch_size": 1, "trainer.group_size": 2})
    ages, dropped, versions = train_with_slow_update(cfg)
    assert ages and None not in ages
    if stale == "wait":  # the bound is reached (the batch of step 2 was sampled before the update of step 1)
        assert max(ages) == 1 and sum(dropped) == 0 and versions == {"shared": 3}
    else:  # one batch further ahead: step 2's turns are 2 versions old when they would train, and left out
        assert max(ages) <= 1 and dropped[-1] > 0
        assert versions == {"shared": 2}  # nothing left to train on at step 2: no update, no new version


def test_rollout_copy_shares_the_frozen_base_and_copies_the_trainable_part():
    training = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    training[0].requires_grad_(False)  # the frozen base; training[1] is the trainable part (an adapter)
    engine = VersionedEngine(_SlowInner(training), training)
    engine.inner.go.set()
    copy = engine.inner.model
    assert copy[0].weight is training[0].weight and copy[1].weight is not training[1].weight
    with torch.no_grad():
        training[1].weight.add_(1.0)
    before = copy[1].weight.clone()
    assert copy_unshared(training, copy) == (8 + 2) * 4  # only the trainable weight and bias
    assert torch.equal(copy[1].weight, training[1].weight) and not torch.equal(before, copy[1].weight)


def test_rollout_copy_of_a_team_with_one_adapter_per_role(tiny):
    from masrl.models.lora import attach_adapters

    model = attach_adapters(tiny[0], ["Solver", "Verifier"], r=4, alpha=8, dropout=0.0, target_modules=None)
    copy = rollout_copy(model)
    shared = {n for (n, p), q in zip(model.named_parameters(), copy.parameters()) if p is q}
    assert shared and all("lora_" not in n for n in shared)  # the base is shared, every adapter copied
    assert all(p.requires_grad for n, p in model.named_parameters() if n not in shared)
    adapters = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n)
    assert copy_unshared(model, copy) == adapters  # a version boundary copies the adapters only


class _OwnWeights:
    """An engine with its own weights (vLLM): it takes new ones through its weight-sync call only."""

    shares_training_model = False

    def __init__(self):
        self.synced = []

    def generate(self, requests):
        return [GenResult([1], [0.0], False) for _ in requests]

    def weights_changed(self, model, *, base_changed):
        self.synced.append((float(model.weight[0, 0]), base_changed))


def test_an_engine_with_its_own_weights_is_versioned_without_a_copy():
    training = torch.nn.Linear(2, 2)
    inner = _OwnWeights()
    engine = versioned(inner, training)
    assert engine.inner is inner and not engine.copies and versioned(engine, training) is engine
    assert engine.generate([None])[0].version == 0 and inner.synced == []
    with torch.no_grad():
        training.weight.fill_(3.0)
    engine.weights_changed(training, base_changed=False)
    assert inner.synced == [(3.0, False)] and engine.generate([None])[0].version == 1


def test_staleness_config_errors(tiny_cfg):
    cfg = _cfg(tiny_cfg, **{"rollout.max_staleness": 1, "runtime.kind": "ray", "runtime.strategy": "fsdp"})
    from masrl.trainer import rollouts_ahead

    with pytest.raises(ConfigError, match="runtime.strategy: replica"):
        rollouts_ahead(SimpleNamespace(cfg=cfg))


def test_a_continuous_batch_takes_new_weights_between_two_decode_steps(tiny):
    """rollout.continuous_batching: rows decoding at the version boundary go on with the new weights (prefilled
    again with them, no keys/values of the old ones kept); each token is the greedy choice, and its behaviour
    log-prob, of the version that sampled it; the row is stamped with the older version."""
    import copy

    from masrl.rollout.engine import TransformersEngine

    model, tok = tiny
    old = copy.deepcopy(model)
    new = copy.deepcopy(model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.5)

    def engine_on(m):  # no stop token: every row decodes its whole budget
        return TransformersEngine(m, eos_token_ids=[10**6], pad_token_id=tok.pad_token_id, seed=0)

    prompts = [tok(q, add_special_tokens=False)["input_ids"] for q in ("Q 12+13\nS ", "Q 7*3-2\nS ")]
    budget, before = 12, 5
    training = copy.deepcopy(old)
    engine = VersionedEngine(engine_on(training), training)
    got = {}
    with engine.continuous():
        for i, prompt in enumerate(prompts):
            engine.enqueue(GenRequest(prompt, temperature=0.0, max_new_tokens=budget), i)
        for _ in range(before):
            assert engine.step() == []
        training.load_state_dict(new.state_dict())  # the trainer's update
        engine.weights_changed(training, base_changed=True)
        while engine.busy:
            got.update(engine.step())
    assert engine.version == 1 and not engine.queued
    for i, prompt in enumerate(prompts):
        first = engine_on(old).generate([GenRequest(prompt, temperature=0.0, max_new_tokens=before)])[0]
        rest = engine_on(new).generate([GenRequest(prompt + first.response_ids, temperature=0.0,
                                                   max_new_tokens=budget - before)])[0]
        unswapped = engine_on(old).generate([GenRequest(prompt, temperature=0.0, max_new_tokens=budget)])[0]
        result = got[i]
        assert result.version == 0 and result.response_ids == first.response_ids + rest.response_ids
        assert result.response_ids != unswapped.response_ids  # the new weights did decode the rest
        expected = first.logprobs + rest.logprobs
        assert max(abs(a - b) for a, b in zip(result.logprobs, expected)) < 1e-5


def test_training_with_rollouts_ahead_and_continuous_batching(tiny_cfg):
    cfg = _cfg(tiny_cfg, **{"rollout.max_staleness": 1, "rollout.continuous_batching": True,
                            "trainer.total_steps": 3, "sft.steps": 0, "trainer.batch_size": 1, "trainer.group_size": 2})
    ages, dropped, versions = train_with_slow_update(cfg)
    assert versions == {"shared": 3} and ages and None not in ages and max(ages) <= 1 and sum(dropped) == 0
