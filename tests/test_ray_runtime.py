"""The Ray runtime on a local 2-CPU cluster: same results as the local runtime, DDP replicas in
lockstep, clear errors when a worker dies. One cluster for the module (start-up takes seconds)."""
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from masrl.config import ConfigError, config_from_dict
from masrl.runtime import WorkerGroupError
from masrl.runtime.malloc import PRIMITIVE_CACHE_VARS
from masrl.trainer import Trainer
from masrl.training.update import Row

from conftest import train_with_slow_update

ray = pytest.importorskip("ray")

QUIET = {"trainer.threads": 1, "logging.tensorboard": False, "logging.plots": False}


@pytest.fixture(scope="module", autouse=True)
def cluster():
    # the workers inherit the environment the cluster starts with: no kernel-cache capacity an earlier test set
    kept = {v: os.environ.pop(v) for v in PRIMITIVE_CACHE_VARS if v in os.environ}
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="masrl-tests")
    finally:
        os.environ.update(kept)
    yield
    ray.shutdown()


def _two_policy_team(tiny_cfg, **over):
    d = tiny_cfg(**QUIET, **{"agents.Solver.policy": "solver", "agents.Verifier.policy": "verifier",
                             "sft.steps": 6}, **over)
    shared = d["policies"].pop("shared")
    d["policies"] = {"solver": shared, "verifier": json.loads(json.dumps(shared))}
    return d


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_ray_two_policies_match_local_runtime(tiny_cfg, tmp_path):
    """Each policy in its own actor: 2 RL steps give the local runtime's metrics and weights.

    Tolerance: exact equality is expected (same ops, same seeds, one thread); we allow 1e-6
    relative for floating-point noise across processes.
    """
    runs = {}
    for kind in ("local", "ray"):
        d = _two_policy_team(tiny_cfg, **{"runtime.kind": kind})
        d["output_dir"] = str(tmp_path / kind)
        with Trainer(config_from_dict(d), progress=False) as trainer:
            trainer.fit()
            if kind == "ray":
                assert set(trainer.runtime.groups) == {"solver", "verifier"}
                assert all(len(g.actors) == 1 for g in trainer.runtime.groups.values())
        runs[kind] = _metrics(tmp_path / kind)
    local, remote = runs["local"], runs["ray"]
    assert [(m["step"], m.get("phase")) for m in local] == [(m["step"], m.get("phase")) for m in remote]
    assert any(m.get("phase") == "train" for m in local)
    compared = 0
    for a, b in zip(local, remote):
        assert set(a) == set(b)
        for key, value in a.items():
            if key.startswith("perf/") or not isinstance(value, float):
                continue
            assert b[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
            compared += 1
    assert compared > 50
    for policy in ("solver", "verifier"):  # checkpoints written through the workers hold the same weights
        wl = load_file(str(tmp_path / "local/checkpoints/step_2/policies" / policy / "model.safetensors"))
        wr = load_file(str(tmp_path / "ray/checkpoints/step_2/policies" / policy / "model.safetensors"))
        assert set(wl) == set(wr)
        for name in wl:
            torch.testing.assert_close(wr[name], wl[name], rtol=1e-6, atol=1e-7)


def _rows() -> list[Row]:
    g = torch.Generator().manual_seed(3)
    rows = []
    for i in range(10):
        prompt = torch.randint(5, 60, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        resp = torch.randint(5, 60, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
        rows.append(Row("Solver" if i % 3 else "Verifier", prompt, resp, [-4.0] * len(resp),
                        float(torch.randn(1, generator=g)), policy="shared"))
    return rows


def test_ddp_two_workers_identical_replicas_equal_to_one_process(tiny_cfg, tmp_path):
    """2 data-parallel CPU workers (gloo): after a step both replicas are bitwise identical, and equal
    the single-process update on the same rows (to summation-order precision)."""
    rows = _rows()
    params = {}
    for kind in ("local", "ray"):
        d = tiny_cfg(**QUIET, **{"runtime.kind": kind, "runtime.workers": 2, "sft.steps": 0,
                                 "trainer.micro_batch_tokens": 40, "trainer.autocast": "float32"})
        d["output_dir"] = str(tmp_path / kind)
        with Trainer(config_from_dict(d), progress=False) as trainer:
            metrics = trainer.runtime.update(trainer.policies, {"shared": rows}, step=0)
            assert metrics["policy/shared/grad_norm"] > 0
            assert metrics["agent/Solver/grad_norm"] > 0 and metrics["agent/Verifier/grad_norm"] > 0
            params[kind] = metrics
            if kind == "ray":
                group = trainer.runtime.groups["shared"]
                digests = group.all("parameter_digest")
                assert len(digests) == 2 and digests[0] == digests[1]
                weights = group.get([group.actors[1].parameters.remote()], "test")[0]
            else:
                weights = {n: p.detach().clone() for n, p in trainer.policies["shared"].model.named_parameters()}
            params[kind] = (metrics, weights)
    (ml, wl), (mr, wr) = params["local"], params["ray"]
    for name in wl:
        torch.testing.assert_close(wr[name], wl[name], rtol=1e-5, atol=1e-6)
    for key in ("policy/shared/grad_norm", "agent/Solver/grad_norm", "agent/Verifier/grad_norm"):
        assert mr[key] == pytest.approx(ml[key], rel=1e-5), key


def test_dead_worker_is_one_clear_error_naming_policy_and_step(tiny_cfg, tmp_path):
    d = tiny_cfg(**QUIET, **{"runtime.kind": "ray", "sft.steps": 0})
    with Trainer(config_from_dict(d), progress=False) as trainer:
        trainer.step = 1
        ray.kill(trainer.runtime.groups["shared"].actors[0])
        with pytest.raises(WorkerGroupError, match=r"policy 'shared': worker 0 died during .* at step 1"):
            trainer.train_step()


@pytest.mark.distributed  # two worker groups and three steps beside their updates: a minute on 2 shared cores
def test_ray_rollouts_ahead_never_train_on_a_turn_older_than_k(tiny_cfg, tmp_path):
    """rollout.max_staleness with worker groups: each rank's engine samples with a copy of the weights replaced
    at the update (the actor generates in one thread while it updates in another); with a slow update the
    producer runs to the bound, the turns carry the workers' versions, and none older than k reaches the loss."""
    d = _two_policy_team(tiny_cfg, **{"runtime.kind": "ray", "rollout.max_staleness": 1, "trainer.total_steps": 3,
                                      "eval.before_after": False, "trainer.batch_size": 1, "trainer.group_size": 2})
    d["sft"]["steps"] = 0
    d["output_dir"] = str(tmp_path / "ray")
    ages, dropped, versions = train_with_slow_update(config_from_dict(d))
    assert versions == {"solver": 3, "verifier": 3}  # one version per update, counted in the workers
    assert ages and None not in ages and max(ages) == 1 and sum(dropped) == 0


def test_runtime_config_errors(tiny_cfg):
    d = tiny_cfg(**{"runtime.policies": {"nope": {"workers": 2}}})
    with pytest.raises(ConfigError, match="runtime.policies names unknown policies"):
        config_from_dict(d)
    d = _two_policy_team(tiny_cfg, **{"runtime.policies": {"solver": {"workers": 2}}})
    with pytest.raises(ConfigError, match="colocated policies .* same number of workers"):
        config_from_dict(d)
    d = _two_policy_team(tiny_cfg, **{"runtime.policies": {"solver": {"workers": 2, "placement": "dedicated"}}})
    cfg = config_from_dict(d)
    assert cfg.runtime.for_policy("solver").workers == 2 and cfg.runtime.for_policy("verifier").workers == 1


def test_ray_run_resumes_from_its_checkpoint_like_an_uninterrupted_local_run(tiny_cfg, tmp_path):
    """Stop a Ray run after step 2, resume it to step 3: the same metrics as 3 uninterrupted local steps
    (checkpoints are written from rank 0's state and loaded into every worker, spike state included)."""
    over = {**QUIET, "sft.steps": 4, "eval.before_after": False, "trainer.save_every": 1}
    full = config_from_dict(tiny_cfg(**over, **{"trainer.total_steps": 3, "output_dir": str(tmp_path / "full")}))
    with Trainer(full, progress=False) as trainer:
        trainer.fit()
    part = config_from_dict(tiny_cfg(**over, **{"trainer.total_steps": 2, "runtime.kind": "ray",
                                                "output_dir": str(tmp_path / "part")}))
    with Trainer(part, progress=False) as trainer:
        trainer.fit()
    part.trainer.total_steps = 3
    with Trainer(part, progress=False) as trainer:
        trainer.fit(resume=True)
    a = {m["step"]: m for m in _metrics(tmp_path / "full") if m.get("phase") == "train"}
    b = {m["step"]: m for m in _metrics(tmp_path / "part") if m.get("phase") == "train"}
    assert sorted(b) == [1, 2, 3]
    for key, value in a[3].items():
        if key.startswith(("team/", "agent/", "policy/")):
            assert b[3][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


@pytest.mark.timeout(180)
def test_dead_data_parallel_rank_fails_fast_not_at_the_collective_timeout(tiny_cfg, tmp_path):
    """Rank 1 of 2 dies: the update raises at once (its peer would otherwise wait in an all-reduce)."""
    assert_dead_rank_fails_fast(tiny_cfg(**QUIET, **{"runtime.kind": "ray", "runtime.workers": 2, "sft.steps": 0}))


def assert_dead_rank_fails_fast(config: dict) -> None:
    """Kill rank 1 of policy 'shared', then update: the usual WorkerGroupError within 60 s (also used by
    test_fsdp for the sharded strategy)."""
    import time

    with Trainer(config_from_dict(config), progress=False) as trainer:
        ray.kill(trainer.runtime.groups["shared"].actors[1])
        start = time.monotonic()
        with pytest.raises(WorkerGroupError, match=r"policy 'shared': worker \d (died|failed) during update"):
            trainer.runtime.update(trainer.policies, {"shared": _rows()}, step=0)
        assert time.monotonic() - start < 60


def test_each_worker_caps_the_kernel_caches_it_is_given(tiny_cfg, tmp_path):
    """trainer.primitive_cache reaches every policy worker's process (set there before its model is built)."""
    d = _two_policy_team(tiny_cfg, **{"runtime.kind": "ray", "trainer.primitive_cache": 8})
    d["output_dir"] = str(tmp_path)
    with Trainer(config_from_dict(d), progress=False) as trainer:
        actors = [a for g in trainer.runtime.groups.values() for a in g.actors]
        seen = ray.get([a.__ray_call__.remote(lambda self: os.environ.get("LRU_CACHE_CAPACITY")) for a in actors])
    assert len(actors) == 2 and seen == ["8", "8"]
