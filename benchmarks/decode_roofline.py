"""How close masrl's decode step gets to this machine's limits (decode roofline).

1. The machine, measured here: matmul peak (``torch.mm`` of square matrices in float32 and bfloat16, GFLOP/s =
   2 n^3 / time, the best of n = 512, 1024, 2048; an emulated bf16 below 10 GFLOP/s at 512 stops there) and memory bandwidth (``copy_`` of a 512 MiB float32 tensor into another: bytes
   read + written / time), each on ``--threads`` intra-op threads, the median of ``--reps``.
2. The decode step: ``TransformersEngine.generate`` (the shipped defaults: the fast decode step, masrl's CPU decode
   attention, the preallocated cache; precision ``--autocast`` resolved as ``trainer.autocast`` does, ``auto``: bf16
   only on a CPU with native bf16; the allocator settings of a training run, ``--malloc``) at 1, 8, 32 and 128
   rows, ``--prompt`` prompt tokens, ``--new`` new tokens, no stop
   token, sampled at temperature 1. Tokens per second = rows x (new - 1) / (time of a call with ``new`` tokens -
   time of a call with 1 token): the prefill cancels. Time is process CPU time (one thread: the step's own time,
   less moved by other processes on a shared machine than the wall clock; both are recorded); the calls alternate,
   median (min-max) over ``--reps``. With ``--lora``: two LoRA adapters (r 16, alpha 32 on q/k/v/o, as
   ``examples/smollm2_arith_team.yaml``; random ``lora_B``), the first half of the rows ``Solver``, the second half
   ``Verifier`` (a team's row groups), one prompt per adapter.
3. The limit per batch size, the lower of
   * the bandwidth bound: rows x bandwidth / bytes read per step, bytes = every matrix the step multiplies by (the
     decoder's projections, the LM head; the adapters' A and B with ``--lora``) in the dtype of its products, plus
     the keys and values the step attends over (the mean context of the timed steps, in the cache's dtype);
   * the compute bound: matmul peak / (2 x parameters multiplied per token): 2 params x rows FLOPs per step.
   ``fraction_of_limit`` = tokens_per_s / limit_tokens_per_s.

``--profile ROWS``: also a ``torch.profiler`` table of one ``new``-token call at ROWS rows (ATen ops by self CPU
time, and the time outside any op), in the JSON under ``profile``.

Writes ``benchmarks/results/decode_roofline_<model>[_lora].json``: ``{"rows": {"1": {...}, ...}, "machine": ...}``.

    python benchmarks/decode_roofline.py --model smollm2
    python benchmarks/decode_roofline.py --model smollm2 --lora
    python benchmarks/decode_roofline.py --model tiny --rows 1 8 --reps 1     # a quick look
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchutil import RESULTS, command_line, machine_info, set_threads, write_json  # noqa: E402


def matmul_peak(dtype: torch.dtype, sizes=(512, 1024, 2048), reps: int = 3) -> dict:
    out = {}
    for n in sizes:
        if out and max(out.values()) < 10:  # an emulated dtype (bf16 without native support): a larger n only waits
            break
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        torch.mm(a, b)
        inner = max(1, int(1e9 // (2 * n ** 3)))  # ~1 GFLOP per sample
        times = []
        for _ in range(reps):
            t = time.process_time()
            for _ in range(inner):
                torch.mm(a, b)
            times.append((time.process_time() - t) / inner)
        out[str(n)] = 2 * n ** 3 / statistics.median(times) / 1e9
    return {"gflops_by_size": out, "peak_gflops": max(out.values())}


def copy_bandwidth(mib: int = 512, reps: int = 5) -> dict:
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        t = time.process_time()
        dst.copy_(src)
        times.append(time.process_time() - t)
    moved = 2 * src.numel() * 4  # read + write
    return {"tensor_mib": mib, "gb_per_s": moved / statistics.median(times) / 1e9,
            "gb_per_s_runs": [moved / x / 1e9 for x in times]}


def build(name: str, lora: bool):
    """(model, vocabulary size): the base model, with two LoRA adapters when ``lora`` (as lora_decode.py)."""
    from lora_decode import build_base, with_adapters

    base = build_base(name)
    return (with_adapters(base) if lora else base), base.config.vocab_size


def step_cost(model, rows: int, context: float, product_dtype: torch.dtype, cache_dtype: torch.dtype) -> dict:
    """Bytes read and FLOPs of one decode step at ``rows`` rows over ``context`` cached positions."""
    from masrl.models.fast_decode import _causal_lm

    llama = _causal_lm(model)[0]
    config = llama.config
    size = torch.empty((), dtype=product_dtype).element_size()
    matrices = sum(p.numel() for n, p in llama.named_parameters()
                   if p.dim() == 2 and "embed_tokens" not in n and ".lora_" not in n)
    if config.tie_word_embeddings:  # the LM head multiplies by the embedding matrix
        matrices += llama.get_input_embeddings().weight.numel()
    adapters = sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * context * rows
    # each row multiplies by one adapter: the A/B of one of the two (the bytes are both adapters' matrices)
    per_row_adapter = adapters / 2 if adapters else 0
    return {"weight_bytes": (matrices + adapters) * size, "kv_bytes": kv * torch.empty((), dtype=cache_dtype).element_size(),
            "flops": 2 * (matrices + per_row_adapter) * rows, "params_multiplied": matrices + per_row_adapter}


def timed(engine, requests) -> tuple[float, float, list]:
    engine.reseed(0)
    engine.clear_prefix_cache()
    cpu, wall = time.process_time(), time.perf_counter()
    results = engine.generate(requests)
    return time.process_time() - cpu, time.perf_counter() - wall, results


def profile_call(engine, requests, top: int = 15) -> dict:
    from torch.profiler import ProfilerActivity, profile

    engine.generate(requests)
    engine.reseed(0)
    engine.clear_prefix_cache()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.process_time()
        engine.generate(requests)
        total = time.process_time() - start
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    events.sort(key=lambda e: -e.self_cpu_time_total)
    ops_s = sum(e.self_cpu_time_total for e in events) / 1e6
    return {"call_cpu_s_profiled": total, "aten_self_s": ops_s,
            "top_ops": [{"op": e.key, "self_s": e.self_cpu_time_total / 1e6, "calls": e.count} for e in events[:top]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["smollm2", "smollm2-shape", "tiny"], default="smollm2")
    ap.add_argument("--lora", action="store_true", help="two LoRA adapters, one per half of the rows")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--autocast", default="auto", help="as trainer.autocast (auto: bf16 on a CPU with native bf16)")
    ap.add_argument("--profile", type=int, nargs="*", default=[], metavar="ROWS")
    ap.add_argument("--malloc", choices=["fast", "lean", "default"], default="fast",
                    help="glibc allocator settings as trainer.tune_malloc (fast: a training run's default; default: "
                         "glibc's own)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    set_threads(args.threads)
    from masrl.runtime.malloc import tune_malloc

    malloc = tune_malloc(args.malloc) if args.malloc != "default" else {"mode": "default"}
    from masrl.models.precision import resolve_autocast
    from masrl.rollout.engine import GenRequest, TransformersEngine
    from masrl.versions import git_sha

    info = {**machine_info(args.threads), "commit": git_sha(), "command": command_line(),
            "loadavg_at_start": [round(x, 2) for x in os.getloadavg()]}
    print(f"command: {info['command']}\nmachine: {info['cpu']}, torch {info['torch']}, load {info['loadavg_at_start']}",
          flush=True)
    peaks = {name: matmul_peak(dtype, reps=args.reps) for name, dtype in
             (("float32", torch.float32), ("bfloat16", torch.bfloat16))}
    bandwidth = copy_bandwidth(reps=max(3, args.reps))
    print(f"matmul peak float32 {peaks['float32']['peak_gflops']:.1f}, bfloat16 {peaks['bfloat16']['peak_gflops']:.1f} "
          f"GFLOP/s; copy bandwidth {bandwidth['gb_per_s']:.2f} GB/s", flush=True)

    model, vocab = build(args.model, args.lora)
    autocast = resolve_autocast(args.autocast, "cpu")
    # the stop id one past the vocabulary: never sampled, and the engine's stop-token table stays vocabulary-sized
    engine = TransformersEngine(model, eos_token_ids=[vocab], pad_token_id=0, autocast=autocast)
    product_dtype = torch.bfloat16 if autocast == "bfloat16" else torch.float32
    cache_dtype = torch.float32  # float32 weights: a float32 cache, also under autocast (TransformersEngine)
    peak = peaks["bfloat16" if product_dtype == torch.bfloat16 else "float32"]["peak_gflops"] * 1e9
    used = []
    from masrl.models.fast_decode import FastDecode

    step = FastDecode.step

    def counting(self, *a, **k):
        used.append(1)
        return step(self, *a, **k)

    FastDecode.step = counting
    g = torch.Generator().manual_seed(0)
    adapters = ["Solver", "Verifier"] if args.lora else [None]
    prompts = {a: torch.randint(5, min(vocab, 5000), (args.prompt,), generator=g).tolist() for a in adapters}
    out_rows = {}
    print("| rows | tokens/s (CPU) | tokens/s (wall) | limit tokens/s | bound | fraction of limit |\n|---|---|---|---|---|---|")
    for rows in args.rows:
        row_adapters = [adapters[min(i * len(adapters) // rows, len(adapters) - 1)] for i in range(rows)]

        def requests(n):
            return [GenRequest(prompts[a], 1.0, 1.0, n, a) for a in row_adapters]

        engine.generate(requests(2))  # warm-up (the fast step's stacked weights)
        cpu_rates, wall_rates = [], []
        for _ in range(args.reps):
            c1, w1, _ = timed(engine, requests(1))
            cn, wn, results = timed(engine, requests(args.new))
            assert all(len(r.response_ids) == args.new for r in results)
            cpu_rates.append(rows * (args.new - 1) / (cn - c1))
            wall_rates.append(rows * (args.new - 1) / (wn - w1))
        context = args.prompt + args.new / 2  # mean cached positions over the timed steps
        cost = step_cost(model, rows, context, product_dtype, cache_dtype)
        bw_bound = rows * bandwidth["gb_per_s"] * 1e9 / (cost["weight_bytes"] + cost["kv_bytes"])
        compute_bound = rows * peak / cost["flops"]
        limit = min(bw_bound, compute_bound)
        rate = statistics.median(cpu_rates)
        entry = {"tokens_per_s": rate, "tokens_per_s_runs": cpu_rates,
                 "tokens_per_s_wall": statistics.median(wall_rates), "tokens_per_s_wall_runs": wall_rates,
                 "limit_tokens_per_s": limit, "bound": "bandwidth" if bw_bound <= compute_bound else "compute",
                 "bandwidth_bound_tokens_per_s": bw_bound, "compute_bound_tokens_per_s": compute_bound,
                 "fraction_of_limit": rate / limit, "step_ms": 1e3 * rows / rate, **cost,
                 "mean_context": context}
        out_rows[str(rows)] = entry
        print(f"| {rows} | {rate:.1f} ({min(cpu_rates):.1f}-{max(cpu_rates):.1f}) | {entry['tokens_per_s_wall']:.1f} | "
              f"{limit:.1f} | {entry['bound']} | {entry['fraction_of_limit']:.3f} |", flush=True)
    fast_used = bool(used)
    profiles = {}
    for rows in args.profile:
        row_adapters = [adapters[min(i * len(adapters) // rows, len(adapters) - 1)] for i in range(rows)]
        profiles[str(rows)] = profile_call(engine, [GenRequest(prompts[a], 1.0, 1.0, args.new, a) for a in row_adapters])
        print(f"profile at {rows} rows:", flush=True)
        for op in profiles[str(rows)]["top_ops"][:10]:
            print(f"  {op['op']:40s} {op['self_s']:.3f} s  {op['calls']} calls")
    info["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    data = {"rows": out_rows, "model": args.model, "lora": args.lora, "precision": str(product_dtype)[6:],
            "fast_decode_used": fast_used, "malloc": malloc, "prompt_tokens": args.prompt, "new_tokens": args.new, "reps": args.reps,
            "matmul_peak": peaks, "copy_bandwidth": bandwidth, "machine": info}
    if profiles:
        data["profile"] = profiles
    path = args.out or RESULTS / f"decode_roofline_{args.model}{'_lora' if args.lora else ''}.json"
    write_json(path, data)
    print(f"fast decode step used: {fast_used}; load at end {info['loadavg_at_end']}; wrote {path}")


if __name__ == "__main__":
    main()
