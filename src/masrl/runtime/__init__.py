"""Runtimes: where policies live and train. ``local`` (this process) or ``ray`` (worker groups).

The trainer (the single controller) talks to a runtime through four calls: ``build_policies``,
``update``, ``sft`` and ``phase_end``; workflows and algorithms never see which one runs.
"""
from __future__ import annotations

from masrl.runtime.local import LocalRuntime, WorkerGroupError


def make_runtime(cfg):
    """The runtime named by ``cfg.runtime.kind``."""
    if cfg.runtime.kind == "ray":
        from masrl.runtime.ray_runtime import RayRuntime

        return RayRuntime(cfg)
    return LocalRuntime(cfg)


__all__ = ["LocalRuntime", "WorkerGroupError", "make_runtime"]
