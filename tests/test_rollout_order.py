"""Rollouts and SFT demonstrations do not depend on the order in which threads finish.

The search workflow runs each retriever call in a thread (``asyncio.to_thread``), so episodes reach
their next agent call in whatever order those threads finish. The scheduler puts each flush in
episode order and SFT collection runs one task after another, so a seed gives the same episodes and
the same demonstrations in every process. The retriever here sleeps a random (system-random, not
seeded) time per call to shuffle the finishing order; the tests fail without those two orderings.
"""
import asyncio
import copy
import random
import time

import pytest
import torch

from masrl.config import load_config
from masrl.rollout.engine import Engine, GenRequest, GenResult
from masrl.rollout.scheduler import RolloutScheduler
from masrl.retrieval import BM25Retriever
from masrl.training.sft import collect_demonstrations
from masrl.trainer import Trainer

_jitter = random.SystemRandom()


@pytest.fixture()
def trainer(monkeypatch, tmp_path):
    search = BM25Retriever.search

    def slow_search(self, *args, **kwargs):
        time.sleep(_jitter.random() * 0.004)
        return search(self, *args, **kwargs)

    monkeypatch.setattr(BM25Retriever, "search", slow_search)
    torch.set_num_threads(1)
    cfg = load_config("examples/quickstart_search.yaml", ["sft.steps=0", "logging.progress=false",
                                                          f"output_dir={tmp_path}"])
    with Trainer(cfg, progress=False) as tr:
        yield tr


def test_demonstrations_do_not_depend_on_thread_timing(trainer):
    def collect():
        cfg = trainer.cfg
        teacher = copy.deepcopy(trainer.source.teacher)  # the same random state for both collections
        rows = collect_demonstrations(trainer.spec, trainer.source.train[:120], teacher, policies=trainer.policies,
                                      agents=cfg.agents, score=trainer.source.score, prompts=cfg.workflow.prompts,
                                      params=trainer.params)
        return [(r.agent, r.prompt_ids, r.response_ids) for r in rows]

    assert collect() == collect()


class _RecordingEngine(Engine):
    """Answers every request with its own prompt; records the order of each batch."""

    def __init__(self):
        self.batches = []

    def generate(self, requests):
        self.batches.append([tuple(r.prompt_ids) for r in requests])
        return [GenResult(list(r.prompt_ids), [0.0] * len(r.prompt_ids), False) for r in requests]


def test_engine_batches_are_in_episode_order_whatever_order_threads_finish():
    engine = _RecordingEngine()
    sched = RolloutScheduler({"p": engine})

    async def episode(i):
        for turn in range(3):
            await asyncio.to_thread(time.sleep, _jitter.random() * 0.004)  # a retriever call
            await sched.generate("p", GenRequest([i, turn], max_new_tokens=1))
        return i

    assert sched.run([episode(i) for i in range(12)]) == list(range(12))
    assert engine.batches == [[(i, turn) for i in range(12)] for turn in range(3)]
