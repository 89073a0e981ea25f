"""Peak resident memory of a training run, phase by phase (SFT, each rollout, update, evaluation, checkpoint save).

    python benchmarks/phase_memory.py CONFIG.yaml --output-dir RUN [--limit-mib 4800] [OVERRIDES ...]

runs ``masrl train`` in this process with the trainer's phases wrapped: before each phase the kernel's high-water
mark (``VmHWM``) is reset (``echo 5 > /proc/self/clear_refs``, Linux), after it the phase's peak and the resident
set at its end are printed as one line (``[phase] NAME peak MiB / end MiB / seconds / CPU s``) and appended to
RUN/phase_memory.jsonl. ``--limit-mib``: the process ends itself (exit 3) when its resident set passes that many
MiB, checked every 0.1 s, so that a trial stays within a shared machine's memory. ``--trim``: ``malloc_trim(0)``
before every phase as well (the trainer itself trims at its phase boundaries under ``trainer.tune_malloc: true``).
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path


def _status(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def _reset_hwm() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _watch(limit_mib: float) -> None:
    while True:
        rss = _status("VmRSS")
        if rss > limit_mib:
            print(f"[phase] resident set {rss:.0f} MiB passed --limit-mib {limit_mib:.0f}: stopping", flush=True)
            os._exit(3)
        time.sleep(0.1)


_TRIM: list = []


def _wrap(cls, name: str, label, log: list) -> None:
    inner = getattr(cls, name)

    def wrapped(self, *args, **kwargs):
        if _TRIM:
            _TRIM[0].malloc_trim(0)
        _reset_hwm()
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            return inner(self, *args, **kwargs)
        finally:
            rec = {"phase": label(self, args), "peak_mib": round(_status("VmHWM")),
                   "end_mib": round(_status("VmRSS")), "seconds": round(time.perf_counter() - t0, 1),
                   "cpu_s": round(time.process_time() - c0, 1)}
            log.append(rec)
            print(f"[phase] {rec['phase']}: peak {rec['peak_mib']} MiB, end {rec['end_mib']} MiB, "
                  f"{rec['seconds']} s, {rec['cpu_s']} CPU s", flush=True)
    setattr(cls, name, wrapped)


def main(argv: list[str]) -> int:
    limit = None
    if "--limit-mib" in argv:
        i = argv.index("--limit-mib")
        limit = float(argv[i + 1])
        del argv[i:i + 2]
    if "--trim" in argv:  # malloc_trim(0) before each phase
        import ctypes

        argv.remove("--trim")
        _TRIM.append(ctypes.CDLL(None))
    out = Path(argv[argv.index("--output-dir") + 1])
    if limit:
        threading.Thread(target=_watch, args=(limit,), daemon=True).start()
    from masrl import trainer as tr
    from masrl.cli import main as cli_main

    log: list = []
    _wrap(tr.Trainer, "sft", lambda t, a: "sft", log)
    _wrap(tr.Trainer, "collect", lambda t, a: f"rollout {a[0] + 1}", log)
    _wrap(tr.Trainer, "update", lambda t, a: f"update {t.step + 1}", log)
    _wrap(tr.Trainer, "evaluate", lambda t, a: f"eval {a[0]}", log)
    _wrap(tr.Trainer, "save", lambda t, a: f"save {a[0]}", log)
    code = cli_main(["train", *argv])
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "phase_memory.jsonl", "w") as f:
        for rec in log:
            f.write(json.dumps(rec) + "\n")
    print(f"[phase] whole run: peak {_status('VmHWM'):.0f} MiB (since the last reset); "
          f"ru_maxrss below in /usr/bin/time -v", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
