"""What one held-out evaluation of a team holds: peak resident set and peak live heap bytes, under a variant.

    python benchmarks/eval_memory.py CONFIG.yaml [--variant NAME] [--no-packs] [--no-fast-decode]
        [--mmap-threshold-mib N] [--no-call-trim] [OVERRIDES ...]

Builds the team of ``CONFIG`` with the memory defaults ``masrl train`` would choose (``trainer.memory_defaults``), no
SFT, evaluates the held-out split once (``Trainer.evaluate``) and prints one JSON line: the resident set before, the
kernel's high-water mark over the evaluation (``VmHWM``, reset just before it), the resident set after it, the peak of
glibc's live bytes (``mallinfo2``: ``uordblks + hblkhd``, sampled every 20 ms, so a short-lived peak can be missed),
and the evaluation's seconds. ``--no-packs`` / ``--no-fast-decode``: the engine decodes without its prepacked bf16
weights / the fast decode step (what each holds is the difference). ``--mmap-threshold-mib N``: after the trainer's
allocator settings, glibc maps every block of N MiB or more on its own and hands it back on free (``mallopt``
``M_MMAP_MAX`` 65536, ``M_MMAP_THRESHOLD`` N MiB). ``--no-call-trim``: the engine keeps the heap's free memory
after each decoded batch (under ``trainer.memory_defaults`` it hands it back: ``malloc_trim(0)``). Linux with glibc
only.

    python benchmarks/eval_memory.py examples/smollm2_arith_team.yaml --variant bf16 trainer.autocast=bfloat16 \\
        trainer.threads=1 eval.limit=16 output_dir=/tmp/eval_memory
"""
from __future__ import annotations

import ctypes
import json
import sys
import threading
import time

from phase_memory import _status  # this folder: the resident set's lines of /proc/self/status


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


def main(argv: list[str]) -> int:
    config, *rest = argv
    variant, no_packs, no_fast, mmap_mib, call_trim, overrides = "", False, False, 0, True, []
    it = iter(rest)
    for arg in it:
        if arg == "--variant":
            variant = next(it)
        elif arg == "--no-packs":
            no_packs = True
        elif arg == "--no-fast-decode":
            no_fast = True
        elif arg == "--mmap-threshold-mib":
            mmap_mib = int(next(it))
        elif arg == "--no-call-trim":
            call_trim = False
        else:
            overrides.append(arg)
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _MallInfo2
    from masrl.config import load_config
    from masrl.plan.memory import announce_memory_defaults
    from masrl.trainer import Trainer

    cfg = load_config(config, ["sft.steps=0", "logging.progress=false", *overrides])
    announce_memory_defaults(cfg)
    trainer = Trainer(cfg, progress=False)
    for policy in trainer.policies.values():
        if no_packs:
            policy.engine.packed_linears = None
        if no_fast:
            policy.engine.fast_decode = False
        if not call_trim:
            policy.engine.after_batch = None
    if mmap_mib:  # M_MMAP_MAX, M_MMAP_THRESHOLD (glibc's malloc.h)
        if libc.mallopt(-4, 65536) != 1 or libc.mallopt(-3, mmap_mib << 20) != 1:
            raise SystemExit("eval_memory.py: glibc refused the mmap settings")
    peak = {"live": 0.0}

    def watch():
        while True:
            info = libc.mallinfo2()
            peak["live"] = max(peak["live"], (info.uordblks + info.hblkhd) / 2**20)
            time.sleep(0.02)

    libc.malloc_trim(0)
    before = _status("VmRSS")
    threading.Thread(target=watch, daemon=True).start()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark from here
    t0 = time.perf_counter()
    results = trainer.evaluate("eval")
    seconds = time.perf_counter() - t0
    print(json.dumps({"variant": variant, "before_mib": round(before), "peak_mib": round(_status("VmHWM")),
                      "end_mib": round(_status("VmRSS")), "peak_live_mib": round(peak["live"]),
                      "seconds": round(seconds, 1), "rows": cfg.trainer.max_rollout_batch,
                      "prefix_cache_mib": cfg.rollout.prefix_cache_mib, "tune_malloc": cfg.trainer.tune_malloc,
                      "max_prefill_tokens": cfg.rollout.max_prefill_tokens, "call_trim": call_trim,
                      "accuracy": {k: round(v, 4) for k, v in results.items() if "/avg@" in k}}), flush=True)
    trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
