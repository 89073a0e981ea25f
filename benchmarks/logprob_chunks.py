"""SmolLM2-135M update with ``trainer.logprob_chunk_tokens`` on vs off: time and peak RSS.

One fresh process per setting (peak RSS is per process), run one after the other. The update is
the SmolLM2 LoRA example's (examples/smollm2_arith_lora.yaml): per-agent LoRA r=16 on a frozen base,
two agents, PPO token-mean, fused AdamW, the default micro-batch (``micro_batch_tokens`` 4096):
``--rows`` rows of ``--prompt-len`` random prompt tokens + ``--response-len`` response tokens fill
one micro-batch. One warm-up update, then ``--repeats`` timed updates. ``--full`` trains every
weight (no LoRA) instead. ``--head-only``: only what the lever changes — log-probs + entropy metric,
forward and backward, of the micro-batch's response tokens from random hidden states through
SmolLM2's tied 49,152 x 576 LM head (no model load, seconds).

    python benchmarks/logprob_chunks.py                       # chunk 1024 (default) vs 0 (plain)
    python benchmarks/logprob_chunks.py --chunks 1024 512 0 --full
    python benchmarks/logprob_chunks.py --head-only --chunks 1024 256 0
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchutil import command_line, machine_info, machine_line, peak_rss_mib, run_worker, set_threads  # noqa: E402


def head_worker(a) -> dict:
    """The LM-head part alone: response tokens' hidden states -> log-probs + entropy, forward and backward."""
    import torch

    from masrl.algorithms.losses import entropy_from_logsumexp
    from masrl.training.logprobs import chunked_token_logprobs
    from masrl.training.update import token_logprobs_lse

    g = torch.Generator().manual_seed(0)
    rows, resp, d, vocab = a.rows, a.response_len, 576, 49152
    weight = (torch.randn(vocab, d, generator=g) * 0.02).requires_grad_()
    targets = torch.randint(0, vocab, (rows, resp), generator=g)
    rss_built = peak_rss_mib()
    times = []
    for _ in range(a.repeats + 1):
        hidden = torch.randn(rows, resp, d, generator=g, requires_grad=True)
        weight.grad = None
        t = time.perf_counter()
        if a.chunk:
            logp, entropy = chunked_token_logprobs(hidden.reshape(-1, d), weight, None, targets.reshape(-1),
                                                   a.chunk, 1.0, with_entropy=True)
        else:  # the plain path: float32 logits [rows, R, V]
            logits = torch.nn.functional.linear(hidden, weight).float()
            logp, lse = token_logprobs_lse(logits, targets)
            with torch.no_grad():
                entropy = entropy_from_logsumexp(logits.detach(), lse.detach())
        logp.sum().backward()
        times.append(time.perf_counter() - t)
        del logp, entropy
        logits = None
    return {"chunk": a.chunk, "update_s": times[1:], "peak_rss_mib": peak_rss_mib(), "rss_after_build_mib": rss_built,
            "pg_loss": float("nan"), "entropy": float("nan")}


def worker(a) -> dict:
    set_threads(a.threads)
    if a.head_only:
        return head_worker(a)
    from masrl.config import AlgorithmConfig, PolicyConfig, TrainerConfig
    from masrl.models.smollm import smollm2_path
    from masrl.training.policy import build_policy
    from masrl.training.update import Row, update_policy

    lora = None if a.full else {"r": 16, "alpha": 32, "per_agent": True}
    policy = build_policy("p", PolicyConfig(model=str(smollm2_path()), lora=lora,
                                            optim={"lr": 1e-6, "fused": True}, gradient_checkpointing=a.grad_ckpt),
                          seed=0, max_rollout_batch=64, agents=["Solver", "Verifier"] if lora else None)
    rng = random.Random(0)
    rows = [Row(["Solver", "Verifier"][i % 2], [rng.randrange(10, 40000) for _ in range(a.prompt_len)],
                [rng.randrange(10, 40000) for _ in range(a.response_len)], [-1.0] * a.response_len,
                rng.choice([-1.0, 1.0]), 1.0, policy="p") for i in range(a.rows)]
    trainer = TrainerConfig(logprob_chunk_tokens=a.chunk, micro_batch_tokens=a.micro_batch_tokens,
                            autocast=None if a.autocast == "float32" else a.autocast)
    algo = AlgorithmConfig(estimator="grpo")
    rss_built = peak_rss_mib()
    update_policy(policy, rows, algo, trainer, step=0, seed=0)
    times = []
    for step in range(1, a.repeats + 1):
        t = time.perf_counter()
        out = update_policy(policy, rows, algo, trainer, step=step, seed=0)
        times.append(time.perf_counter() - t)
    return {"chunk": a.chunk, "update_s": times, "peak_rss_mib": peak_rss_mib(), "rss_after_build_mib": rss_built,
            "pg_loss": out["policy/p/pg_loss"], "entropy": out.get("agent/Solver/entropy")}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, nargs="+", default=[1024, 0])
    ap.add_argument("--chunk", type=int, default=1024, help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=int, default=20)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--response-len", type=int, default=96)
    ap.add_argument("--micro-batch-tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--grad-ckpt", action="store_true", help="policies.<p>.gradient_checkpointing: true")
    ap.add_argument("--autocast", default="float32", help="trainer.autocast (float32: off)")
    ap.add_argument("--head-only", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--worker-json", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker_json:
        Path(a.worker_json).write_text(json.dumps(worker(a)))
        return
    print(f"command: {command_line()}")
    print(f"machine: {machine_line(machine_info(a.threads))}", flush=True)
    common = ["--rows", str(a.rows), "--prompt-len", str(a.prompt_len), "--response-len", str(a.response_len),
              "--micro-batch-tokens", str(a.micro_batch_tokens), "--repeats", str(a.repeats),
              "--threads", str(a.threads), "--autocast", a.autocast] + (["--full"] if a.full else []) + \
        (["--head-only"] if a.head_only else []) + (["--grad-ckpt"] if a.grad_ckpt else [])
    what = "LM head only" if a.head_only else "full" if a.full else "per-agent LoRA"
    what += f", autocast {a.autocast}" + (", gradient checkpointing" if a.grad_ckpt else "")
    print(f"{a.rows} rows x ({a.prompt_len} + {a.response_len}) tokens, {what}")
    for chunk in a.chunks:
        r = run_worker(Path(__file__), ["--chunk", str(chunk), *common])
        times = ", ".join(f"{t:.3f}" for t in r["update_s"])
        print(f"logprob_chunk_tokens={chunk:5d}: update {times} s, peak RSS {r['peak_rss_mib']:,.0f} MiB "
              f"(after build {r['rss_after_build_mib']:,.0f}), pg_loss {r['pg_loss']:.6f}, "
              f"entropy {r['entropy']:.6f}", flush=True)


if __name__ == "__main__":
    main()
