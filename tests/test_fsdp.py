"""runtime.strategy = fsdp: 2 CPU ranks (gloo) on a local Ray cluster shard each policy with FSDP2.

One sharded update equals the one-process update, each rank holds half the bytes, per-agent LoRA
trains only the adapters, a dead rank is the runtime's usual clear error, and checkpoints resume
at another number of ranks. One cluster for the module (start-up takes seconds)."""
import json
from pathlib import Path

import pytest
import torch

from masrl.config import config_from_dict
from masrl.runtime import WorkerGroupError
from masrl.training.fsdp import local_bytes
from masrl.trainer import Trainer
from test_ray_runtime import _rows  # the same ten rows the replica tests update on

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.distributed  # Ray start-up and 2-rank runs: minutes on 2 shared cores (.ci/run runs them)

QUIET = {"trainer.threads": 1, "logging.tensorboard": False, "logging.plots": False, "sft.steps": 0,
         # sharded vs one process to float32 rounding: the same precision and log-prob path on both sides
         "trainer.autocast": "float32", "trainer.logprob_chunk_tokens": 0}
FSDP = {"runtime.kind": "ray", "runtime.strategy": "fsdp", "runtime.workers": 2}


@pytest.fixture(scope="module", autouse=True)
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="masrl-fsdp-tests")
    yield
    ray.shutdown()


def _update(tiny_cfg, tmp_path, kind: str, **over):
    """(metrics, whole parameters after one update, per-rank bytes) of one update on ``_rows()``."""
    d = tiny_cfg(**QUIET, **over, **{"trainer.micro_batch_tokens": 40, "policies.shared.optim.grad_clip": 0.05})
    d["output_dir"] = str(tmp_path / kind)
    with Trainer(config_from_dict(d), progress=False) as trainer:
        if kind == "local":
            policy = trainer.policies["shared"]
            before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
            metrics = trainer.runtime.update(trainer.policies, {"shared": _rows()}, step=0)
            after = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
            return metrics, before, after, [local_bytes(policy)]
        group = trainer.runtime.groups["shared"]
        before = group.all("parameters")[0]
        metrics = trainer.runtime.update(trainer.policies, {"shared": _rows()}, step=0)
        return metrics, before, group.all("parameters")[0], group.all("memory_bytes")


def test_sharded_update_equals_one_process_update_with_half_the_bytes_per_rank(tiny_cfg, tmp_path):
    ckpt = {"policies.shared.gradient_checkpointing": True}  # recomputation inside the FSDP units, too
    ml, before, wl, (bl,) = _update(tiny_cfg, tmp_path, "local", **ckpt)
    mf, _, wf, bytes_f = _update(tiny_cfg, tmp_path, "fsdp", **FSDP, **ckpt)
    assert set(wf) == set(wl)
    moved = max(float((wl[n] - before[n]).abs().max()) for n in wl)
    assert moved > 1e-4  # the step did something (clipped: grad_norm above grad_clip)
    for name in wl:
        torch.testing.assert_close(wf[name], wl[name], rtol=0, atol=1e-6)
    assert ml["policy/shared/grad_norm"] > 0.05
    for key in ("policy/shared/grad_norm", "agent/Solver/grad_norm", "agent/Verifier/grad_norm"):
        assert mf[key] == pytest.approx(ml[key], rel=1e-5), key
    # params + grads + AdamW moments: each rank holds half (the tiny model's dims split evenly)
    for rank_bytes in bytes_f:
        assert rank_bytes["total"] == pytest.approx(bl["total"] / 2, rel=0.02), (rank_bytes, bl)
        assert rank_bytes["optimizer"] == pytest.approx(bl["optimizer"] / 2, rel=0.02)


def test_lora_per_role_under_fsdp_trains_only_the_adapters(tiny_cfg, tmp_path):
    lora = {"policies.shared.lora": {"r": 4, "alpha": 8, "per_agent": True}, "policies.shared.optim.lr": 1e-2}
    ml, before_l, after_l, _ = _update(tiny_cfg, tmp_path, "local", **lora)
    mf, before, after, _ = _update(tiny_cfg, tmp_path, "fsdp", **FSDP, **lora)
    adapters = [n for n in after if "lora_" in n]
    assert adapters and {n for n in after if ".Solver." in n} and {n for n in after if ".Verifier." in n}
    for name in after:
        if "lora_" in name:
            continue
        assert torch.equal(after[name], before[name]), f"base weight {name} changed"
    assert any(not torch.equal(after[n], before[n]) for n in adapters)
    for name in adapters:  # and the same step as one process
        torch.testing.assert_close(after[name], after_l[name], rtol=0, atol=1e-6)
    for key in ("agent/Solver/grad_norm", "agent/Verifier/grad_norm"):
        assert mf[key] == pytest.approx(ml[key], rel=1e-5), key


@pytest.mark.timeout(180)
def test_dead_rank_fails_the_sharded_update_with_the_usual_error(tiny_cfg, tmp_path):
    import time

    d = tiny_cfg(**QUIET, **FSDP)
    with Trainer(config_from_dict(d), progress=False) as trainer:
        ray.kill(trainer.runtime.groups["shared"].actors[1])
        start = time.monotonic()
        with pytest.raises(WorkerGroupError, match=r"policy 'shared': worker \d (died|failed) during update"):
            trainer.runtime.update(trainer.policies, {"shared": _rows()}, step=0)
        assert time.monotonic() - start < 60


def _metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {m["step"]: m for m in rows if m.get("phase") == "train"}


@pytest.mark.parametrize("save_ranks,resume_ranks", [(2, 1), (1, 2)])
def test_fsdp_checkpoint_resumes_at_another_number_of_ranks(tiny_cfg, tmp_path, save_ranks, resume_ranks):
    """Save at N ranks, resume at M: step 3's metrics equal an uninterrupted one-process run's."""
    over = {**QUIET, "eval.before_after": False, "trainer.save_every": 1, "trainer.batch_size": 2}
    full = config_from_dict(tiny_cfg(**over, **{"trainer.total_steps": 3, "output_dir": str(tmp_path / "full")}))
    with Trainer(full, progress=False) as trainer:
        trainer.fit()
    part_dict = tiny_cfg(**over, **{**FSDP, "trainer.total_steps": 2, "runtime.workers": save_ranks,
                                     "output_dir": str(tmp_path / "part")})
    with Trainer(config_from_dict(part_dict), progress=False) as trainer:
        trainer.fit()
    part_dict["trainer"]["total_steps"] = 3
    part_dict["runtime"]["workers"] = resume_ranks
    with Trainer(config_from_dict(part_dict), progress=False) as trainer:
        trainer.fit(resume=True)
    a, b = _metrics(tmp_path / "full"), _metrics(tmp_path / "part")
    assert sorted(b) == [1, 2, 3]
    compared, off = 0, []
    for key, value in a[3].items():
        # valid_tokens is a per-micro-batch count: averaged over 2 ranks' micro-batches it halves (as with
        # the replica strategy's data parallelism)
        if key.startswith(("team/", "agent/", "policy/")) and isinstance(value, float) \
                and not key.endswith("valid_tokens"):
            if b[3][key] != pytest.approx(value, rel=1e-4, abs=1e-6):
                off.append((key, value, b[3][key]))
            compared += 1
    assert not off
    assert compared > 10
