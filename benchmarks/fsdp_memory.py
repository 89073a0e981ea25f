"""Per-rank memory of one RL update, replica vs fsdp on 2 gloo ranks, against ``masrl plan``.

For each model (tiny, SmolLM2-135M), strategy (replica, fsdp) and variant (full fine-tune, LoRA on
q/v): two processes (torch.multiprocessing, gloo) build the policy as a Ray worker does
(``build_policy``; fsdp: ``shard_policy``), then run one ``update_policy_raw`` on synthetic rows that
give every rank exactly one micro-batch of ``trainer.micro_batch_tokens`` tokens (prompt 96 +
response 32 tokens per row). Per rank it reports:

* params / grads / AdamW: bytes of this rank's parameters, gradients and optimizer state after the
  step (``masrl.training.fsdp.local_bytes``: shards under fsdp), next to the plan's terms;
* peak: the peak of anonymous memory during a second update (the steady state of a run: AdamW's
  state exists, which the first update creates only after its backward), next to the plan's
  training terms (weights + grads + optimizer + fsdp_unsharded + activations; the rollout's KV cache
  is not part of an update and not counted). Measured as the peak RSS (``VmHWM``, reset through
  ``/proc/self/clear_refs`` just before the update) minus the file-backed and shared pages after it
  (libtorch's code, paged in during the first backward) minus the anonymous RSS before the model was
  built (the interpreter, torch, transformers).

Usage (one configuration at a time; SmolLM2 runs take 1-3 minutes each on 2 shared cores):
    nice -n 2 python benchmarks/fsdp_memory.py --models tiny,smollm2 --strategies replica,fsdp --variants full,lora
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

from _benchutil import fmt_table, print_header  # noqa: E402

PROMPT, RESPONSE, TOKENS, WORLD = 96, 32, 2048, 2
MiB = 2 ** 20
MODELS = {"tiny": {"model": "tiny", "tiny": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
                                             "num_key_value_heads": 2, "intermediate_size": 768}},
          "smollm2": {"model": "smollm2-135m-instruct"}}


def config_dict(model: str, strategy: str, variant: str, checkpointing: bool) -> dict:
    policy = {**MODELS[model], "optim": {"lr": 1e-5, "weight_decay": 0.0, "grad_clip": 1.0},
              "gradient_checkpointing": checkpointing}
    if variant == "lora":
        policy["lora"] = {"r": 16, "alpha": 32, "per_agent": False}
    return {"name": "fsdp-memory", "seed": 0, "output_dir": tempfile.mkdtemp(prefix="fsdp-memory-"),
            "task": {"name": "arithmetic", "params": {"train_size": 8, "test_size": 2}},
            "workflow": {"name": "math_solver_verifier"},
            "agents": {"Solver": {"policy": "shared", "max_new_tokens": RESPONSE},
                       "Verifier": {"policy": "shared", "max_new_tokens": RESPONSE}},
            "policies": {"shared": policy}, "sft": {"steps": 0},
            "trainer": {"micro_batch_tokens": TOKENS, "threads": 1},
            "runtime": {"kind": "ray", "workers": WORLD, "strategy": strategy},
            "logging": {"progress": False, "tensorboard": False, "plots": False}}


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _trim() -> None:
    """Hand freed heap memory back to the OS, so that RSS is what is in use."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM (peak RSS) to the current RSS


def rank_main(rank: int, port: int, cfg_dict: dict, out_dir: str) -> None:
    import torch

    torch.set_num_threads(1)
    from masrl.config import config_from_dict
    from masrl.training.distributed import init_process_group
    from masrl.training.fsdp import FSDPOptions, ShardedDataParallel, local_bytes, shard_policy
    from masrl.training.policy import build_policy
    from masrl.training.update import Row, update_policy_raw

    cfg = config_from_dict(cfg_dict)
    _trim()
    baseline = _rss_kib("RssAnon")
    dp = init_process_group(rank, WORLD, "127.0.0.1", port, "gloo")
    policy = build_policy("shared", cfg.policies["shared"], seed=0, max_rollout_batch=8,
                          agents=["Solver", "Verifier"])
    with torch.no_grad():  # weights loaded from safetensors by mmap stay file-backed pages until written (a
        for p in policy.model.parameters():  # frozen LoRA base on a replica): make them anonymous memory, as
            p.data = p.data.clone()  # a GPU copy would be, so that they count in the peak below
    if cfg.runtime.strategy == "fsdp":
        shard_policy(policy, FSDPOptions(**cfg.runtime.fsdp.model_dump(mode="json")), torch.device("cpu"))
        dp = ShardedDataParallel(rank, WORLD)
    else:
        dp.broadcast_parameters(policy.model)
    vocab = int(policy.model.config.vocab_size)
    ids = [5 + (i * 7919) % (vocab - 5) for i in range(PROMPT + RESPONSE)]
    per_rank = TOKENS // (PROMPT + RESPONSE)
    rows = [Row("Solver" if i % 2 else "Verifier", ids[:PROMPT], ids[PROMPT:], [-1.0] * RESPONSE,
                1.0 if i % 3 else -1.0, policy="shared") for i in range(per_rank * WORLD)]
    update_policy_raw(policy, rows, cfg.algorithm, cfg.trainer, step=0, seed=0, dp=dp)  # creates AdamW's state
    _trim()
    before = _rss_kib("RssAnon")
    _reset_peak()
    update_policy_raw(policy, rows, cfg.algorithm, cfg.trainer, step=1, seed=0, dp=dp)
    peak = _rss_kib("VmHWM") - _rss_kib("RssFile") - _rss_kib("RssShmem")
    result = {"rank": rank, "baseline_mib": baseline / 1024, "before_update_mib": (before - baseline) / 1024,
              "peak_mib": (peak - baseline) / 1024, **local_bytes(policy)}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def measure(cfg_dict: dict) -> list[dict]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(rank_main, args=(port, cfg_dict, out), nprocs=WORLD)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD)]


def planned(cfg_dict: dict) -> dict[str, float]:
    from masrl.config import config_from_dict
    from masrl.plan import plan_policy

    terms = plan_policy(config_from_dict(cfg_dict), "shared", prompt_tokens=PROMPT, cuda=False).terms
    training = ("weights", "grads", "optimizer", "fsdp_unsharded", "activations")
    return {**terms, "training": sum(v for k, v in terms.items() if k in training)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,smollm2")
    ap.add_argument("--strategies", default="replica,fsdp")
    ap.add_argument("--variants", default="full,lora")
    ap.add_argument("--checkpointing", action="store_true", help="policies.<p>.gradient_checkpointing")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    print_header(threads=1)
    header = ["model", "strategy", "variant", "rank", "params MiB", "grads MiB", "AdamW MiB", "p+g+o MiB",
              "plan p+g+o", "err", "peak MiB", "plan peak", "err"]
    table, records = [], []
    for model in args.models.split(","):
        for variant in args.variants.split(","):
            for strategy in args.strategies.split(","):
                cfg = config_dict(model, strategy, variant, args.checkpointing)
                plan = planned(cfg)
                plan_pgo = plan["weights"] + plan["grads"] + plan["optimizer"]
                for r in measure(cfg):
                    pgo = r["total"]
                    table.append([model, strategy, variant, r["rank"], f"{r['params'] / MiB:.2f}",
                                  f"{r['grads'] / MiB:.2f}", f"{r['optimizer'] / MiB:.2f}", f"{pgo / MiB:.2f}",
                                  f"{plan_pgo / MiB:.2f}", f"{(plan_pgo - pgo) / pgo:+.1%}",
                                  f"{r['peak_mib']:.0f}", f"{plan['training'] / MiB:.0f}",
                                  f"{(plan['training'] / MiB - r['peak_mib']) / r['peak_mib']:+.1%}"])
                    records.append({"model": model, "strategy": strategy, "variant": variant, **r,
                                    "plan": plan})
                print("\n".join(fmt_table(header, table[-WORLD:]).splitlines()[2:]), flush=True)
    print()
    print(fmt_table(header, table))
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
