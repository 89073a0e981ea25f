"""Metric sinks: metrics.jsonl (every number a user sees), TensorBoard, the trackers of
``logging.report_to`` (W&B, MLflow, trackio: ``masrl.monitoring.trackers``), and the console."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Mapping, Sequence


def _clean(value: float) -> float | None:
    return value if math.isfinite(value) else None


class MetricsLogger:
    """Appends one JSON object per step to ``metrics.jsonl`` and mirrors scalars to TensorBoard and to
    ``trackers`` (objects with ``log(step, metrics, phase)`` and ``close()``; closed with this logger)."""

    def __init__(self, run_dir: Path, tensorboard: bool = True, resume_from_step: int | None = None,
                 trackers: Sequence = (), redo_eval_at_resume_step: bool = False):
        self.trackers = list(trackers)
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_from_step is not None and self.path.exists():
            self._truncate_after(resume_from_step, redo_eval_at_resume_step)
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = self._tb_sft = None
        self._tb_dir = Path(run_dir) / "tensorboard"
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                # on resume, TensorBoard hides the points of the steps that are redone (step > checkpoint)
                purge = resume_from_step + 1 if resume_from_step is not None else None
                self._tb = SummaryWriter(str(self._tb_dir), purge_step=purge)
                self._writer = SummaryWriter
            except Exception as e:  # TensorBoard is optional; say so once
                print(f"[masrl] TensorBoard disabled: {e}")

    def _truncate_after(self, step: int, redo_eval: bool = False) -> None:
        """On resume, drop RL/eval records after the checkpoint's step (those steps are redone), and with
        ``redo_eval`` the evaluation records of that step too (written after its checkpoint: redone); keep SFT."""
        kept = []
        for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
            record = parse_record(line)
            if record is None:
                continue  # a partial last line from a crash
            redone = record["step"] > step or (redo_eval and record["step"] == step and record.get("phase") == "eval")
            if record.get("phase") == "sft" or not redone:
                kept.append(line)
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(k + "\n" for k in kept), encoding="utf-8")
        tmp.replace(self.path)

    def log(self, step: int, metrics: Mapping[str, float], phase: str = "train") -> None:
        record = {"step": step, "phase": phase}
        record.update({k: (_clean(float(v)) if isinstance(v, (int, float)) else v) for k, v in metrics.items()})
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for tracker in self.trackers:
            tracker.log(step, metrics, phase)
        if self._tb is not None:
            writer = self._tb
            if phase == "sft":  # SFT steps have their own axis: a run of their own, untouched by resume purges
                if self._tb_sft is None:
                    self._tb_sft = self._writer(str(self._tb_dir / "sft"))
                writer = self._tb_sft
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    writer.add_scalar(k, v, step)

    def close(self) -> None:
        self._file.close()
        for writer in (self._tb, self._tb_sft):
            if writer is not None:
                writer.close()
        for tracker in self.trackers:
            tracker.close()


def read_metrics(run_dir: Path) -> list[dict]:
    """Records of ``metrics.jsonl``, skipping lines that are not records (a partial last line, garbage)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    records = (parse_record(line) for line in path.read_text(encoding="utf-8", errors="replace").splitlines())
    return [r for r in records if r is not None]


def parse_record(line: str) -> dict | None:
    """One metrics record, or None for a line that is not one (partial, not UTF-8, not an object with a
    finite numeric ``step``): such lines are skipped, never fatal. Every reader (plots, dashboard, sweep
    report, resume) goes through here, so a record holds only what the logger writes: numbers, ``null``
    (a non-finite value) and the ``phase`` string; any other value (a string, list, object or boolean where
    a metric belongs) is left out of the record."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(record, dict):
        return None
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step):
        return None
    return {k: v for k, v in record.items() if (k == "phase" and isinstance(v, str)) or v is None
            or (isinstance(v, (int, float)) and not isinstance(v, bool))}
