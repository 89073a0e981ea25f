"""The checks of benchmarks/gpu_check.sh: one line each, exit 1 if any fails (docs/scaling.md)."""
from __future__ import annotations

import os
import sys
import tempfile
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 768, "max_position_embeddings": 512}


def _cfg(device: str, **over):
    from masrl.config import load_config

    overrides = [f"trainer.device={device}", "logging.tensorboard=false", "logging.plots=false",
                 "logging.progress=false", f"policies.shared.tiny={TINY}".replace("'", '"').replace(" ", "")]
    return load_config(ROOT / "examples" / "quickstart.yaml", overrides + [f"{k}={v}" for k, v in over.items()])


def _policy(cfg):
    from masrl.runtime.local import policy_build_args
    from masrl.training.policy import build_policy

    args = policy_build_args(cfg, Path(tempfile.mkdtemp()))["shared"]
    return build_policy("shared", cfg.policies["shared"], **args)


def _rows(policy, n=8, seed=0):
    from masrl.rollout.engine import GenRequest
    from masrl.training.update import Row

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(40, 90, (int(torch.randint(8, 24, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    results = policy.engine.generate([GenRequest(p, max_new_tokens=16) for p in prompts])
    return [Row("Solver", p, r.response_ids, r.logprobs, 1.0 if i % 2 else -1.0, policy="shared")
            for i, (p, r) in enumerate(zip(prompts, results))]


def check_engine_logprobs(device: str) -> str:
    from masrl.training.update import pack_rows, response_logits, token_logprobs

    policy = _policy(_cfg(device))
    rows = [r for r in _rows(policy) if r.response_ids]
    batch = pack_rows(rows, int(policy.tokenizer.pad_token_id), device)
    with torch.no_grad():
        trainer = token_logprobs(response_logits(policy.model, batch), batch.targets)
    diff = ((trainer - batch.old_logprobs).abs() * batch.response_mask).max().item()
    assert diff < 1e-3, f"max |engine - trainer| = {diff:.2e} (limit 1e-3, float32)"
    return f"max |engine - trainer| log-prob = {diff:.2e} over {int(batch.response_mask.sum())} tokens"


def check_rl_step_bf16(device: str) -> str:
    from masrl.trainer import Trainer

    cfg = _cfg(device, **{"trainer.autocast": "bfloat16", "trainer.total_steps": 1, "sft.steps": 2,
                          "eval.before_after": "false", "output_dir": tempfile.mkdtemp()})
    with Trainer(cfg, progress=False) as trainer:
        trainer.fit()
    import json

    last = [json.loads(x) for x in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()][-1]
    norm = last.get("policy/shared/grad_norm", float("nan"))
    assert norm == norm and norm > 0, f"grad_norm {norm}"
    return f"quickstart team, 1 RL step, bf16 autocast: grad_norm {norm:.3g}"


def check_fsdp_one_rank(device: str) -> str:
    from masrl.training.fsdp import FSDPOptions, ShardedDataParallel, shard_policy
    from masrl.training.update import update_policy

    cfg = _cfg(device)
    ref, sharded = _policy(cfg), _policy(cfg)
    rows = _rows(ref)
    shard_policy(sharded, FSDPOptions(param_dtype="float32"), torch.device(device),
                 "nccl" if device == "cuda" else "gloo")
    a = update_policy(ref, rows, cfg.algorithm, cfg.trainer, step=0, seed=0)
    b = update_policy(sharded, rows, cfg.algorithm, cfg.trainer, step=0, seed=0, dp=ShardedDataParallel(0, 1))
    full = {n: p.full_tensor() for n, p in sharded.model.named_parameters()}
    diff = max((full[n] - p).abs().max().item() for n, p in ref.model.named_parameters())
    assert diff < 1e-5, f"max |fsdp - replica| parameter = {diff:.2e}"
    key = "policy/shared/grad_norm"
    assert abs(a[key] - b[key]) <= 1e-4 * a[key], f"grad_norm {a[key]} vs {b[key]}"
    return f"FSDP2 one rank = replica: max parameter diff {diff:.2e}, grad_norm {b[key]:.4g}"


def check_peak_memory_vs_plan(device: str) -> str:
    from masrl.plan import counted, plan_policy
    from masrl.training.update import update_policy

    cfg = _cfg(device)
    policy = _policy(cfg)
    rows = _rows(policy, n=32)
    prompt = max(len(r.prompt_ids) for r in rows)
    torch.cuda.reset_peak_memory_stats()
    update_policy(policy, rows, cfg.algorithm, cfg.trainer, step=0, seed=0)
    peak = torch.cuda.max_memory_allocated()
    terms = counted(plan_policy(cfg, "shared", prompt_tokens=prompt, cuda=True))
    planned = sum(v for k, v in terms.items() if k != "kv_cache")
    ratio = peak / planned
    assert 0.75 <= ratio <= 1.25, f"peak {peak / 2**20:.1f} MiB vs plan {planned / 2**20:.1f} MiB"
    return f"peak {peak / 2**20:.1f} MiB vs plan {planned / 2**20:.1f} MiB (ratio {ratio:.2f})"


CHECKS = [("engine_logprobs_vs_trainer", check_engine_logprobs, False),
          ("rl_step_bf16", check_rl_step_bf16, False),
          ("fsdp_one_rank", check_fsdp_one_rank, False),
          ("peak_memory_vs_plan", check_peak_memory_vs_plan, True)]


def main() -> int:
    device = os.environ.get("MASRL_GPU_CHECK_DEVICE") or ("cuda" if torch.cuda.is_available() else "")
    failed = 0
    for name, check, needs_cuda in CHECKS:
        if not device or (needs_cuda and device != "cuda"):
            print(f"SKIP {name}: no CUDA device (torch.cuda.is_available() is False)")
            continue
        try:
            print(f"PASS {name}: {check(device)}", flush=True)
        except Exception as e:  # one line per check; the traceback goes to stderr
            failed += 1
            traceback.print_exc(file=sys.stderr)
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
