"""The sandbox's records: limits of one execution, the isolation it gets, its result, and the errors."""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["STATUSES", "SandboxError", "SandboxResult", "Limits", "Isolation", "Died"]

STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "killed")


class SandboxError(RuntimeError):
    """The sandbox itself could not be set up (not a failure of the code that ran in it)."""


@dataclass
class SandboxResult:
    """Outcome of one execution.

    ``status``: ``ok`` (exit code 0), ``error`` (non-zero exit), ``timeout`` (wall clock or CPU
    time), ``memory`` (MemoryError / allocation failure), ``output_limit`` (stdout/stderr over
    the cap, or a file over the size limit), ``killed`` (any other signal).
    """

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    duration_s: float
    signal: int | None = None
    truncated: bool = False
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(frozen=True)
class Limits:
    """Per-execution limits. ``cpu_s=None`` means ``ceil(timeout_s) + 1``."""

    timeout_s: float = 10.0
    memory_mb: int = 1024
    cpu_s: float | None = None
    max_output_bytes: int = 1 << 20
    max_file_bytes: int = 16 << 20
    nproc: int = 32
    nofile: int = 256
    max_disk_bytes: int = 64 << 20  # the work directory (a tmpfs with namespaces)
    max_inodes: int = 8192

    def cpu_seconds(self) -> int:
        return int(math.ceil(self.cpu_s if self.cpu_s is not None else self.timeout_s + 1))


@dataclass(frozen=True)
class Isolation:
    """Which protections an execution gets (resolved once per ``Sandbox``)."""

    name: str  # "namespaces" | "userns" | "basic"
    setuid: bool = False  # run the candidate under a fresh unprivileged uid (needs root)
    userns: bool = False
    mntns: bool = False
    netns: bool = False
    pidns: bool = False
    guard: bool = False  # audit-hook guard inside the child (fallback)
    allow_fork: bool = True
    notes: tuple[str, ...] = ()


class Died(Exception):
    """The sandboxed process ended or was stopped while the harness waited for it.

    ``status``: ``timeout``, ``output_limit``, ``protocol_error`` (a malformed or oversized message)
    or ``exited``; ``detail`` says more.
    """

    def __init__(self, status: str, detail: str = ""):
        super().__init__(f"{status}: {detail}" if detail else status)
        self.status = status
        self.detail = detail
