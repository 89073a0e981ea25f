"""runtime.strategy = fsdp: 2 CPU ranks (gloo) on a local Ray cluster shard each policy with FSDP2.

One sharded update equals the one-process update, each rank holds half the bytes, per-agent LoRA
trains only the adapters, a dead rank is the runtime's usual clear error, and checkpoints resume
at another number of ranks. One cluster for the module (start-up takes seconds)."""
import json
from pathlib import Path

import pytest
import torch

from masrl.config import config_from_dict
from masrl.training.fsdp import local_bytes
from masrl.trainer import Trainer
from test_ray_runtime import _rows, assert_dead_rank_fails_fast  # the replica tests' rows and dead-rank check

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


def test_per_agent_optimizer_groups_survive_sharding(tiny_cfg, tmp_path):
    """agents.<A>.optim under fsdp: each role's adapter moves by its own lr (AdamW's first step moves every
    parameter with a nonzero gradient by lr), as in the one-process test (test_agent_optim.py)."""
    over = {"policies.shared.lora": {"r": 4, "alpha": 8.0, "per_agent": True},
            "policies.shared.optim": {"lr": 1e-3, "weight_decay": 0.0, "grad_clip": None},
            "agents.Solver.optim": {"lr": 1e-2}, "agents.Verifier.optim": {"lr": 1e-4}}
    d = tiny_cfg(**QUIET, **FSDP, **over)
    d["output_dir"] = str(tmp_path / "groups")
    with Trainer(config_from_dict(d), progress=False) as trainer:
        group = trainer.runtime.groups["shared"]
        before = group.all("parameters")[0]
        trainer.runtime.update(trainer.policies, {"shared": _rows()}, step=0)
        after = group.all("parameters")[0]
    for agent, lr in (("Solver", 1e-2), ("Verifier", 1e-4)):
        names = [n for n in after if "lora_" in n and f".{agent}." in n]
        assert names
        moved = max(float((after[n] - before[n]).abs().max()) for n in names)
        assert moved == pytest.approx(lr, rel=1e-3), (agent, moved)


@pytest.mark.timeout(180)
def test_dead_rank_fails_the_sharded_update_with_the_usual_error(tiny_cfg, tmp_path):
    assert_dead_rank_fails_fast(tiny_cfg(**QUIET, **FSDP))


def _metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {m["step"]: m for m in rows if m.get("phase") == "train"}


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """A checkpoint's whole weights, from either format."""
    from safetensors.torch import load_file

    from masrl.training.checkpoint import dcp_weights

    pdir = run_dir / "checkpoints" / f"step_{step}" / "policies" / "shared"
    return dcp_weights(pdir) if (pdir / "dcp").is_dir() else load_file(str(pdir / "model.safetensors"))


def _assert_sharded_save(ckpt_dir: Path, ranks: int) -> None:
    """A DCP checkpoint: one safetensors file per rank, each with about 1/ranks of the optimizer state."""
    from safetensors import safe_open

    pdir = ckpt_dir / "policies" / "shared"
    assert not (pdir / "model.safetensors").exists() and (pdir / "optimizer.json").is_file()
    files = sorted((pdir / "dcp").glob("*.safetensors"))
    assert len(files) == ranks, files
    per_file = []
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            per_file.append(sum(st.get_slice(k).get_shape()[0] if st.get_slice(k).get_shape() else 0
                                for k in st.keys() if k.startswith("optim.") and k.endswith(".exp_avg")))
    assert min(per_file) > 0 and max(per_file) <= 0.55 * sum(per_file) * 2 / ranks, per_file  # exp_avg rows
    manifest = json.loads((ckpt_dir / "manifest.json").read_text())["files"]
    assert {f"policies/shared/dcp/{f.name}" for f in files} <= set(manifest)  # checksummed like the rest


@pytest.mark.parametrize("save_ranks,resume_ranks", [(2, 1), (1, 2), (2, 0)])
def test_fsdp_checkpoint_resumes_at_another_number_of_ranks(tiny_cfg, tmp_path, save_ranks, resume_ranks):
    """Save at N ranks (DCP shards), resume at M (0: the local runtime, which reassembles them): step 3's
    metrics equal an uninterrupted one-process run's; the export of the sharded step-2 checkpoint has the
    uninterrupted run's step-2 weights."""
    over = {**QUIET, "eval.before_after": False, "trainer.save_every": 1, "trainer.batch_size": 2}
    full = config_from_dict(tiny_cfg(**over, **{"trainer.total_steps": 3, "output_dir": str(tmp_path / "full")}))
    with Trainer(full, progress=False) as trainer:
        trainer.fit()
    part_dict = tiny_cfg(**over, **{**FSDP, "trainer.total_steps": 2, "runtime.workers": save_ranks,
                                     "output_dir": str(tmp_path / "part")})
    with Trainer(config_from_dict(part_dict), progress=False) as trainer:
        trainer.fit()
    _assert_sharded_save(tmp_path / "part" / "checkpoints" / "step_2", save_ranks)
    part_dict["trainer"]["total_steps"] = 3
    if resume_ranks:
        part_dict["runtime"]["workers"] = resume_ranks
    else:
        part_dict["runtime"] = {"kind": "local"}
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
    # the step after the resume used the restored AdamW moments: step 3's weights are the uninterrupted run's
    final, reference = _weights(tmp_path / "part", 3), _weights(tmp_path / "full", 3)
    assert set(final) == set(reference)
    for name, tensor in reference.items():
        torch.testing.assert_close(final[name], tensor, rtol=0, atol=1e-5)
    if resume_ranks == 1:
        from safetensors.torch import load_file

        from masrl.export import export_run

        out = export_run(tmp_path / "part", tmp_path / "export", step=2)
        exported = load_file(str(out / "shared" / "model.safetensors"))
        reference = load_file(str(tmp_path / "full" / "checkpoints" / "step_2" / "policies" / "shared" /
                                  "model.safetensors"))
        assert set(reference) <= set(exported)
        for name, tensor in reference.items():
            torch.testing.assert_close(exported[name], tensor, rtol=0, atol=1e-5)


def _gather_rank(rank: int, port: int, out: str) -> None:
    """One of 2 gloo ranks: the replica's HF state dict, then the same model sharded and gathered back."""
    import weakref

    import torch.distributed as dist

    from masrl.config import config_from_dict
    from masrl.models.loading import load_model_and_tokenizer
    from masrl.rollout.vllm_engine import hf_named_tensors
    from masrl.training.fsdp import FSDPOptions, gather_full, shard_module

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from conftest import tiny_config_dict

    cfg = config_from_dict(tiny_config_dict(Path(out), **{"policies.shared.lora": {"r": 4, "alpha": 8}}))
    model, _ = load_model_and_tokenizer(cfg.policies["shared"], seed=0)
    from masrl.models.lora import attach_adapters

    model = attach_adapters(model, ["shared"], r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"])
    replica = [(n, t.clone()) for n, t in hf_named_tensors(model)]
    shard_module(model, FSDPOptions(), torch.device("cpu"))
    gathered, alive = [], []
    for name, tensor in gather_full(hf_named_tensors(model)):
        assert not any(r() is not None for r in alive), "the helper kept an earlier gathered tensor"
        gathered.append((name, tensor.clone()))
        alive.append(weakref.ref(tensor))
        del tensor
    assert [n for n, _ in gathered] == [n for n, _ in replica]
    for (name, got), (_, want) in zip(gathered, replica):
        assert got.shape == want.shape and torch.equal(got, want), name
    dist.destroy_process_group()
    Path(out, f"ok{rank}").write_text(str(len(gathered)))


def test_gather_full_yields_the_replicas_weights_one_tensor_at_a_time(tmp_path):
    """For vLLM's weight sync under fsdp: the sharded model's HF weights gathered lazily equal the replica's."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_gather_rank, args=(port, str(tmp_path)), nprocs=2)
    counts = {(tmp_path / f"ok{r}").read_text() for r in range(2)}
    assert len(counts) == 1 and int(counts.pop()) > 10
