"""Runtimes: where policies live and train. ``local`` (this process) or ``ray`` (worker groups).

The trainer (the single controller) talks to a runtime through four calls: ``build_policies``,
``update``, ``sft`` and ``phase_end``; workflows and algorithms never see which one runs.
"""
from __future__ import annotations

from masrl.runtime.local import LocalRuntime, WorkerGroupError


def make_runtime(cfg, run_dir=None):
    """The runtime named by ``cfg.runtime.kind`` (``run_dir``: where the run writes; default ``cfg.run_dir``)."""
    if cfg.runtime.kind == "ray":
        from masrl.runtime.ray_runtime import RayRuntime

        return RayRuntime(cfg, run_dir)
    return LocalRuntime(cfg, run_dir)


__all__ = ["LocalRuntime", "WorkerGroupError", "make_runtime"]
