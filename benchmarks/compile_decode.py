"""The engine's decode step compiled with torch.compile (inductor, C++) against its eager fast step.

The question: does compiling the decode step make ``TransformersEngine`` decode faster on this CPU? The engine
decodes with ``masrl.models.fast_decode.FastDecode`` (eager operators, bf16 products on weights prepacked for
oneDNN under ``autocast: auto``). Two ways of compiling it are measured:

* ``whole``: the engine's own option, ``rollout.compile_decode`` (``TransformersEngine(compile_decode=True)``,
  ``masrl.models.compiled_decode``): every layer and the LM head in one graph with symbolic sizes;
* ``static`` / ``dynamic``: this script replaces, in this process only, the step by one compiled function per
  decoder layer (``layer_step``, the same function for all layers: the weights are its inputs), compiled for the
  batch's shapes or with ``dynamic=True`` (symbolic sizes).

In each, the layer's element-wise work (RMSNorm, rotary embeddings, SiLU and product, residual sums, casts) is
inductor's fused C++; the packed bf16 products stay oneDNN's inner product on the prepacked weights
(``masrl::packed_linear``, a custom operator: inductor lowers ``mkldnn._linear_pointwise`` only for weights frozen
into the graph as constants, which a policy whose weights change at every RL step cannot use); the cache write and
the 1-token attention stay the engine's (``masrl::cache_attention``, a custom operator around
``masrl.models.cpu_attention.grouped_decode_attention``); the filled length travels as a 0-d tensor, so the graph
does not change as the cache grows.

``eager`` is the engine as shipped. Each mode decodes the same prompts at ``--rows`` rows; ms per decode step = (a
call with ``--new`` new tokens - a call with 1) / (new - 1), process CPU time, one thread, median of ``--reps``
alternated pairs, after a warm-up call that compiles. Exactness: the greedy tokens (temperature 0) of each
compiled mode against eager's, and the largest difference of their log-probs over the tokens both chose alike.
(``first_call_cpu_s`` in the JSON: this process's CPU in the warm-up call; inductor compiles in child processes,
and not at all from a warm cache.)

``--profile ROWS``: a ``torch.profiler`` table of one decode step per mode at ROWS rows (the step's fifth call in a
call of ``--new`` tokens), operators and compiled regions by self CPU time, in the JSON under ``profile``.

Only the base model's step (no LoRA routing) is measured. ``static`` and ``dynamic`` rewrite the stacked, packed
step (SmolLM2 under bf16 autocast on a CPU that packs bf16; the script stops with a message otherwise); ``--model
tiny`` (the float32 tiny model, no autocast) measures ``whole`` only.

    python benchmarks/compile_decode.py --rows 8 32 --out benchmarks/results/compile_decode/smollm2_amx_rows8_32.json
    python benchmarks/compile_decode.py --rows 8 32 --modes whole     # the engine's option only
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchutil import command_line, machine_info, set_threads, write_json  # noqa: E402
from masrl.models.compiled_decode import cache_attention, packed_linear  # noqa: E402


def layer_step(h, x, cos, sin, qkv_w, o_w, gate_up_w, down_w, norm2_w, next_norm_w, key_buffer, value_buffer,
               filled, mask, scale: float, n_q: int, n_kv: int, dim: int, n_inner: int, eps: float):
    """One decoder layer of ``FastDecode._step`` (base model, stacked packed weights, float32 residual stream,
    bf16 products): returns (the residual stream, the next norm's bf16 output)."""
    batch = h.shape[0]
    qkv = packed_linear(x, qkv_w, None, n_q + 2 * n_kv)
    q_heads, kv_heads = n_q // dim, n_kv // dim
    qk = qkv[:, :n_q + n_kv].view(batch, q_heads + kv_heads, dim)
    half = dim // 2
    qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), -1) * sin
    values = qkv[:, n_q + n_kv:].view(batch, kv_heads, dim)
    attn = cache_attention(qk[:, :q_heads], qk[:, q_heads:], values, key_buffer, value_buffer, filled, mask, scale)
    attn = attn.reshape(batch, n_q).to(torch.bfloat16)
    h = h + packed_linear(attn, o_w, None, h.shape[1])
    x = F.rms_norm(h, (h.shape[-1],), norm2_w, eps).to(torch.bfloat16)
    gate_up = packed_linear(x, gate_up_w, None, 2 * n_inner)
    inner = F.silu(gate_up[:, :n_inner]) * gate_up[:, n_inner:]
    h = h + packed_linear(inner, down_w, None, h.shape[1])
    return h, F.rms_norm(h, (h.shape[-1],), next_norm_w, eps).to(torch.bfloat16)


def compiled_step(layer):
    """A replacement for ``FastDecode._step`` that runs ``layer`` (``layer_step``, compiled or as it is) per
    layer; as it is, the step is bitwise the engine's (``tests/test_compile_decode.py``)."""
    def step(self, ids, mask, positions, cache, routes):
        if routes is not None or any(g is not None for groups in self.loras for g in groups.values()):
            raise SystemExit("compile_decode.py compiles the base model's step only (no LoRA adapters)")
        h = F.embedding(ids, self.embed)
        cos, sin = self.llama.model.rotary_emb(h, positions[:, None])
        padded = mask == 0
        additive = (torch.zeros(padded.shape, dtype=torch.float32).masked_fill_(padded, float("-inf"))
                    [:, None, None, :] if bool(padded.any()) else None)
        layers = self.layers
        first = layers[0]["norm1"]
        x = F.rms_norm(h, (h.shape[-1],), first[0], first[1]).to(torch.bfloat16)
        filled = cache.layers[0]._filled
        at = torch.tensor(filled)
        for i, (spec, cache_layer) in enumerate(zip(layers, cache.layers)):
            assert cache_layer._filled == filled and cache_layer._rows == slice(None)
            following = layers[i + 1]["norm1"] if i + 1 < len(layers) else self.norm
            h, x = layer(h, x, cos, sin, spec["qkv"][0][0], spec["o"][0], spec["gate_up"][0][0], spec["down"][0],
                         spec["norm2"][0], following[0], cache_layer._k, cache_layer._v, at, additive,
                         spec["scaling"], spec["n_q"], spec["n_kv"], spec["head_dim"], spec["n_inner"],
                         spec["norm2"][1])
        for cache_layer in cache.layers:
            cache_layer._filled = filled + 1
            cache_layer.keys = cache_layer._k[:, :, :filled + 1]
            cache_layer.values = cache_layer._v[:, :, :filled + 1]
        return self._linear(x, self.head)
    return step


def profile_step(fast_decode, run, nth: int = 5, top: int = 20) -> dict:
    """Self CPU time by operator (and compiled region) of the ``nth`` decode step of ``run()``."""
    from torch.profiler import ProfilerActivity, profile

    step, seen, found = fast_decode.step, [], {}

    def profiled(self, *a, **k):
        seen.append(1)
        if len(seen) != nth:
            return step(self, *a, **k)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = step(self, *a, **k)
        found["prof"] = prof
        return out

    fast_decode.step = profiled
    try:
        run()
    finally:
        fast_decode.step = step
    events = sorted(found["prof"].key_averages(), key=lambda e: -e.self_cpu_time_total)
    return {"step_self_ms": sum(e.self_cpu_time_total for e in events) / 1e3,
            "top": [{"op": e.key, "self_ms": e.self_cpu_time_total / 1e3, "calls": e.count} for e in events[:top]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["smollm2", "smollm2-shape", "tiny"], default="smollm2")
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    modes = ["static", "dynamic", "whole"]
    ap.add_argument("--modes", nargs="+", choices=modes, default=modes)
    ap.add_argument("--profile", type=int, nargs="*", default=[], metavar="ROWS")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    set_threads(1)
    from masrl.models.compiled_layers import cxx_compiler
    from masrl.models.fast_decode import FastDecode
    from masrl.models.precision import resolve_autocast
    from masrl.rollout.engine import GenRequest, TransformersEngine
    from masrl.runtime.malloc import tune_malloc
    from masrl.versions import git_sha
    from lora_decode import build_base

    if cxx_compiler() is None:
        raise SystemExit("compile_decode.py needs a C++ compiler for inductor (g++, clang++ or $CXX)")
    malloc = tune_malloc("fast")
    info = {**machine_info(1), "commit": git_sha(), "command": command_line(),
            "loadavg_at_start": [round(x, 2) for x in os.getloadavg()], "malloc": malloc}
    print(f"command: {info['command']}\nmachine: {info['cpu']}, torch {info['torch']}, load {info['loadavg_at_start']}",
          flush=True)
    model = build_base(args.model)
    vocab = model.config.vocab_size
    packed_step = args.model != "tiny"
    if not packed_step and set(args.modes) != {"whole"}:
        raise SystemExit("compile_decode.py --model tiny measures --modes whole only (float32)")
    autocast = resolve_autocast("auto", "cpu") if packed_step else None
    if packed_step and autocast != "bfloat16":
        raise SystemExit("compile_decode.py measures the bf16 packed step (a CPU with native bf16)")
    engine = TransformersEngine(model, eos_token_ids=[vocab], pad_token_id=0, autocast=autocast)
    eager = FastDecode._step
    layers = {"static": torch.compile(layer_step, dynamic=False), "dynamic": torch.compile(layer_step, dynamic=True)}
    steps = {"eager": eager, **{m: eager if m == "whole" else compiled_step(layers[m]) for m in args.modes}}
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(5, min(vocab, 5000), (args.prompt,), generator=g).tolist()

    def call(mode: str, rows: int, new: int, temperature: float = 1.0):
        FastDecode._step = steps[mode]
        engine.compile_decode = mode == "whole"
        engine.reseed(0)
        engine.clear_prefix_cache()
        start = time.process_time()
        results = engine.generate([GenRequest(prompt, temperature, 1.0, new, None) for _ in range(rows)])
        return time.process_time() - start, results

    out = {}
    print("| rows | mode | ms per decode step | vs eager | greedy tokens equal | max abs log-prob diff |\n"
          "|---|---|---|---|---|---|", flush=True)
    for rows in args.rows:
        warm = {}
        for mode in steps:
            start = time.process_time()
            call(mode, rows, args.new)
            warm[mode] = time.process_time() - start
            if engine._fast is None or not engine._fast.stacked or (packed_step and not engine._fast.packed):
                raise SystemExit("the engine's fast step is not the stacked, packed bf16 step here")
        per_step = {mode: [] for mode in steps}
        for _ in range(args.reps):
            for mode in steps:
                one, _ = call(mode, rows, 1)
                full, results = call(mode, rows, args.new)
                assert all(len(r.response_ids) == args.new for r in results)
                per_step[mode].append(1e3 * (full - one) / (args.new - 1))
        greedy = {mode: call(mode, rows, args.new, 0.0)[1] for mode in steps}
        base = statistics.median(per_step["eager"])
        entry = {}
        for mode in steps:
            same, diff = 0, 0.0
            for ref, got in zip(greedy["eager"], greedy[mode]):
                for a, b, la, lb in zip(ref.response_ids, got.response_ids, ref.logprobs, got.logprobs):
                    if a != b:
                        break
                    same += 1
                    diff = max(diff, abs(la - lb))
            total = sum(len(r.response_ids) for r in greedy["eager"])
            ms = statistics.median(per_step[mode])
            entry[mode] = {"ms_per_step": ms, "ms_per_step_runs": per_step[mode], "vs_eager": ms / base,
                           "first_call_cpu_s": warm[mode], "greedy_tokens_equal": same, "greedy_tokens": total,
                           "max_abs_logprob_diff": diff}
            print(f"| {rows} | {mode} | {ms:.1f} ({min(per_step[mode]):.1f}-{max(per_step[mode]):.1f}) | "
                  f"{ms / base:.2f}x | {same}/{total} | {diff:.2e} |", flush=True)
        out[str(rows)] = entry
    profiles = {str(rows): {mode: profile_step(FastDecode, lambda: call(mode, rows, args.new)) for mode in steps}
                for rows in args.profile}
    for rows, table in profiles.items():
        for mode, ops in table.items():
            print(f"profile, {rows} rows, {mode}: one step {ops['step_self_ms']:.1f} ms of operators' self time")
            for op in ops["top"][:12]:
                print(f"  {op['op'][:60]:60s} {op['self_ms']:7.2f} ms  {op['calls']:4d} calls")
    FastDecode._step = eager
    info["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    data = {"rows": out, "profile": profiles, "machine": info, "model": args.model, "prompt_tokens": args.prompt,
            "new_tokens": args.new, "reps": args.reps}
    if args.out is not None:
        write_json(args.out, data)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
