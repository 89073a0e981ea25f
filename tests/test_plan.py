"""`masrl plan`: its formula against memory measured on CPU (tiny models), and its verdicts."""
from pathlib import Path

import pytest
import torch

from masrl.cli import main
from masrl.config import ConfigError, config_from_dict, load_config
from masrl.plan import plan, plan_policy
from masrl.training.fsdp import local_bytes
from masrl.training.policy import build_policy
from masrl.training.update import Row, pack_rows, response_logits, token_logprobs

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "gpu"
WIDER = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 768}


def _saved_activation_bytes(policy, rows) -> int:
    """Bytes autograd keeps for backward after one forward (each storage counted once)."""
    seen, total = set(), [0]

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.dtype)
        if key not in seen:
            seen.add(key)
            total[0] += t.untyped_storage().nbytes()
        return t

    batch = pack_rows(rows, 0)
    policy.model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = (token_logprobs(response_logits(policy.model, batch), batch.targets) * batch.response_mask).sum()
    loss.backward()
    return total[0]


@pytest.mark.parametrize("tiny,lora", [({}, None), (WIDER, None), (WIDER, {"r": 16, "alpha": 32})],
                         ids=["tiny", "wider", "wider-lora"])
def test_plan_matches_memory_measured_on_cpu(tiny_cfg, tiny, lora):
    """Activations (saved tensors of one micro-batch) within 25%; weights + grads + AdamW state exact.
    LoRA (a frozen base keeps fewer inputs): 135.4 MiB measured, 124.7 planned (172.7 before the LoRA terms)."""
    prompt, response, tokens = 96, 32, 2048
    d = tiny_cfg(**{"trainer.micro_batch_tokens": tokens, "policies.shared.tiny": tiny, "policies.shared.lora": lora,
                    "trainer.autocast": "float32",  # the measured path below is float32
                    "agents.Solver.max_new_tokens": response, "agents.Verifier.max_new_tokens": response})
    cfg = config_from_dict(d)
    policy = build_policy("shared", cfg.policies["shared"], seed=0, max_rollout_batch=8)
    rows = [Row("Solver", list(range(5, 5 + prompt)), list(range(5, 5 + response)), [-1.0] * response, 1.0)
            for _ in range(tokens // (prompt + response))]
    measured = _saved_activation_bytes(policy, rows)
    policy.optimizer.step()  # AdamW state exists after the first step
    terms = plan_policy(cfg, "shared", prompt_tokens=prompt, cuda=False).terms
    assert terms["activations"] == pytest.approx(measured, rel=0.25), (terms["activations"], measured)
    persistent = local_bytes(policy)
    assert terms["weights"] == persistent["params"]
    assert terms["grads"] == persistent["grads"]
    assert terms["optimizer"] == persistent["optimizer"]


def test_plan_fsdp_halves_the_persistent_terms(tiny_cfg):
    base = config_from_dict(tiny_cfg(**{"runtime.kind": "ray", "runtime.workers": 2}))
    fsdp = config_from_dict(tiny_cfg(**{"runtime.kind": "ray", "runtime.workers": 2, "runtime.strategy": "fsdp"}))
    a, b = plan_policy(base, "shared").terms, plan_policy(fsdp, "shared").terms
    for key in ("weights", "grads", "optimizer"):
        assert b[key] == a[key] / 2
    assert b["fsdp_unsharded"] > 0 and "fsdp_unsharded" not in a


def test_plan_verdicts_for_the_paper_settings(capsys):
    """Qwen3-8B math with fsdp fits on 8 x 80 GiB; as replicas both policies' state on every GPU does not,
    and the plan says why (with offload the two take turns: one 8B replica's bf16 state, 61 GiB, fits)."""
    path = str(EXAMPLES / "math_drmas_qwen3_8b_fsdp.yaml")
    assert main(["plan", path, "--gpu-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "fits on 8 x 80 GiB" in out and "Qwen/Qwen3-8B 8.19B params, fsdp over 8 rank(s)" in out
    assert main(["plan", path, "runtime.strategy=replica", "runtime.offload=true", "--gpu-gib", "80"]) == 0
    capsys.readouterr()
    assert main(["plan", path, "runtime.strategy=replica", "runtime.offload=false", "--gpu-gib", "80"]) == 1
    out = capsys.readouterr().out
    assert "does not fit on 8 x 80 GiB (largest term: solver/optimizer 30.51 GiB)" in out
    report = plan(load_config(EXAMPLES / "search_drmas_qwen25_7b_fsdp.yaml", []), device_gib=80)
    assert report["fits"] and set(report["policies"]) == {"verifier", "search", "answer"}


@pytest.mark.parametrize("args", [["--gpu-gib", "nan"], ["--gpu-gib", "-5"], ["--gpu-gib", "1e400"],
                                  ["--gpus", "0"], ["--prompt-tokens", "-1"], ["--gpus", "two"]])
def test_plan_refuses_impossible_devices_and_lengths(args, capsys):
    """No verdict from a NaN, negative or zero device size, a count below its minimum, or a non-number."""
    with pytest.raises(SystemExit) as e:
        main(["plan", str(EXAMPLES.parent / "quickstart.yaml"), *args])
    assert e.value.code == 2 and args[0] in capsys.readouterr().err


def test_fsdp_config_errors(tiny_cfg):
    with pytest.raises(ConfigError, match="runtime.strategy = fsdp .* set runtime.kind: ray"):
        config_from_dict(tiny_cfg(**{"runtime.strategy": "fsdp"}))
    with pytest.raises(ConfigError, match="runtime.strategy"):
        config_from_dict(tiny_cfg(**{"runtime.kind": "ray", "runtime.strategy": "zero3"}))


def test_gpu_check_script_skips_every_check_without_cuda():
    import subprocess

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.sh"
    env = {**__import__("os").environ, "CUDA_VISIBLE_DEVICES": "", "MASRL_GPU_CHECK_DEVICE": ""}
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [line.split()[:2] for line in lines] == [["SKIP", f"{name}:"] for name in
                                                    ("engine_logprobs_vs_trainer", "decode_bf16", "rl_steps_bf16",
                                                     "fsdp_one_rank", "per_role_lora_logprobs", "peak_memory_vs_plan",
                                                     "mixed_lora", "lora_team_rl_step_bf16",
                                                     "engine_speed_smollm2_shape")]
    # a subset by name; a name that is no check is refused with the list
    out = subprocess.run(["bash", str(script), "fsdp_one_rank"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and [line.split()[1] for line in out.stdout.splitlines()] == ["fsdp_one_rank:"]
    out = subprocess.run(["bash", str(script), "fsdp"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2 and "no check named fsdp" in out.stderr and "mixed_lora" in out.stderr


def _dry_run(*names):
    import subprocess

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.sh"
    out = subprocess.run(["bash", str(script), "--dry-run", *names], capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    return [line for line in out.stdout.splitlines() if not line.startswith("total ")]


def test_gpu_check_dry_run_on_cpu():
    """The GPU check's own functions on CPU with a 2-layer Qwen3: bf16 greedy decoding against transformers,
    FSDP2 on one rank, and each role's sampled log-probs equal to the trainer's under its adapter."""
    lines = _dry_run("decode_bf16", "fsdp_one_rank", "per_role_lora_logprobs")
    assert [line.split()[:2] for line in lines] == [["PASS", "decode_bf16"], ["PASS", "fsdp_one_rank"],
                                                    ["PASS", "per_role_lora_logprobs"]]


@pytest.mark.slow
def test_gpu_check_dry_run_every_check():
    """Every check but the Voting team's two RL steps (minutes to half an hour on two shared cores; run it by
    name: gpu_check.sh --dry-run lora_team_rl_step_bf16)."""
    from conftest import load_benchmark

    names = [n for n, _ in load_benchmark("gpu_check.py").CHECKS if n != "lora_team_rl_step_bf16"]
    lines = _dry_run(*names)
    assert [line.split()[:2] for line in lines] == [["PASS", n] for n in names], lines


def test_colocated_workers_put_their_engines_to_sleep_when_the_rollout_ends():
    """What the plan's update phase assumes: a colocated worker's vLLM engine (sleep mode) sleeps at the
    rollout's end, and only there (after an update its synced weights stay for the next rollout)."""
    from types import SimpleNamespace

    from masrl.config import RolloutConfig
    from masrl.runtime.worker import PolicyWorker

    class Engine:
        can_sleep, slept = True, []

        def sleep(self, level):
            self.slept.append(level)

        def clear_prefix_cache(self):
            pass

    worker = object.__new__(PolicyWorker)
    engine = Engine()
    worker.policy = SimpleNamespace(engine=engine)
    worker.rollout = RolloutConfig(sleep_level=1)
    worker.offload_enabled, worker.on_device = True, False
    worker.end_rollout()
    assert engine.slept == [1]
    worker.offload()  # after an update: the engine keeps its synced weights
    assert engine.slept == [1]
    worker.offload_enabled = False  # not colocated with another policy: its engine stays awake
    worker.end_rollout()
    assert engine.slept == [1]
