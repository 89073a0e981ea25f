"""Run untrusted Python in a separate, locked-down process (Linux).

    res = run_python("print(1 + 1)", timeout_s=5)
    res.status, res.stdout          # ("ok", "2\\n")

    sb = Sandbox(max_workers=8)
    results = sb.run_many(["print(1)", "while True: pass"], timeout_s=2)

Each execution gets a fresh process started with ``python -I -S -B`` in a new session, a fresh
temporary working directory (removed afterwards), a minimal environment, rlimits (CPU time,
address space, processes, file size, open files, no core dumps), a wall-clock timeout that
kills the whole process tree, and capped stdout/stderr. Where the kernel allows it (root, or
unprivileged user namespaces) the process also gets new mount, network, PID, IPC and UTS
namespaces: no network, a read-only file system with home directories, /tmp, the repository
and the data folder hidden, and (as root) an unprivileged uid of its own. Without namespaces an
audit hook inside the child is a best-effort fallback. See docs/sandbox.md for the threat model.

The RPC mode (``Proc`` with ``mode="serve"``, used by the code task's
scorer) runs the candidate program once and then answers function calls whose results come back
as plain data, so that tests are checked outside the untrusted process.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Iterable, Sequence

from masrl.sandbox import _cgroup
from masrl.sandbox.base import Died, Isolation, Limits, SandboxError, SandboxResult
from masrl.sandbox.isolation import (default_hide_paths, normalize_hide, probe, python_dirs, seccomp_available,
                                     uid_pool, untraversable_ancestors)
from masrl.sandbox.process import Proc

__all__ = ["Sandbox", "default_sandbox", "run_python", "sandbox_capabilities"]


class Sandbox:
    """A configured sandbox; thread-safe. ``max_workers`` bounds parallel executions.

    ``isolation``: ``"auto"`` (best available), ``"namespaces"`` (root), ``"userns"``
    (unprivileged user namespaces) or ``"basic"`` (no namespaces, audit-hook guard).
    ``hide_paths`` replaces the default list of directories made empty inside the sandbox;
    ``extra_hide_paths`` adds to it. ``site_packages`` exposes third-party packages (off by
    default: the child runs with ``-S``).
    """

    def __init__(self, *, max_workers: int = 4, limits: Limits | None = None, isolation: str = "auto",
                 hide_paths: Iterable[str] | None = None, extra_hide_paths: Iterable[str] = (),
                 site_packages: bool = False, tmp_root: str | None = None, python: str | None = None,
                 uid_range: tuple[int, int] = (1_500_000_000, 1_600_000_000),
                 max_message_bytes: int = 16 << 20, max_message_items: int = 1 << 18,
                 cgroups: bool | None = None):
        if sys.platform != "linux":
            raise SandboxError("the sandbox needs Linux")
        self.max_workers = max(1, int(max_workers))
        self.limits = limits or Limits()
        self.python = python or sys.executable
        if not self.python:
            raise SandboxError("no Python executable to run (sys.executable is empty)")
        self.same_python = os.path.realpath(self.python) == os.path.realpath(sys.executable)
        self.site_packages = site_packages
        self.tmp_root = tmp_root
        self.max_message_bytes = int(max_message_bytes)
        self.max_message_items = int(max_message_items)
        # a memory/pids cgroup per execution where the harness may create one (None: if possible)
        self.cgroups = _cgroup.available() if cgroups is None else bool(cgroups)
        self.seccomp = seccomp_available()
        self.python_dirs = list(python_dirs(self.python, bool(site_packages)))
        hide = list(default_hide_paths() if hide_paths is None else hide_paths) + list(extra_hide_paths)
        # an ancestor of the Python install that other users cannot traverse (pyenv under a
        # 0700 /root) is replaced by an empty directory through which the install is re-exposed
        hide += untraversable_ancestors(self.python_dirs)
        self.hide_paths = normalize_hide(hide)
        self.read_roots = self.python_dirs + ["/usr/lib", "/usr/lib64", "/usr/share", "/usr/local/lib", "/lib",
                                              "/lib64", "/etc/localtime", "/etc/ld.so.cache"]
        self.uids = uid_pool(*uid_range)
        self._request = isolation
        self.isolation: Isolation | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._resolved = False
        self._resolve_lock = threading.Lock()

    # -- isolation -------------------------------------------------------------------
    def resolve(self) -> Isolation:
        """Probe (once) which isolation works here; raises ``SandboxError`` if none."""
        with self._resolve_lock:
            if not self._resolved:
                self.isolation = probe(self, self._request)
                self._resolved = True
                if self.isolation.name == "basic" and self._request == "auto":
                    warnings.warn("masrl sandbox: no namespaces available, using the best-effort audit-hook "
                                  "fallback (" + "; ".join(self.isolation.notes) + "); see docs/sandbox.md",
                                  RuntimeWarning, stacklevel=3)
        return self.isolation

    def describe(self) -> dict:
        iso = self.resolve()
        lay = _cgroup.layout() if self.cgroups else None
        return {"isolation": iso.name, "setuid": iso.setuid, "userns": iso.userns, "mount_ns": iso.mntns,
                "net_ns": iso.netns, "pid_ns": iso.pidns, "audit_guard": iso.guard, "fork_allowed": iso.allow_fork,
                "memory_cgroup": lay[0] if lay else None, "seccomp": self.seccomp,
                "notes": list(iso.notes), "hidden_paths": list(self.hide_paths),
                "python": self.python, "site_packages": self.site_packages}

    # -- executions ------------------------------------------------------------------
    def _limits(self, **overrides) -> Limits:
        overrides = {k: v for k, v in overrides.items() if v is not None}
        return replace(self.limits, **overrides) if overrides else self.limits

    def run(self, code: str, *, stdin: str | bytes | None = None, timeout_s: float | None = None,
            memory_mb: int | None = None, cpu_s: float | None = None, max_output_bytes: int | None = None,
            network: bool = False, nproc: int | None = None) -> SandboxResult:
        """Run ``code`` as a script (``__name__ == "__main__"``) and collect its output."""
        self.resolve()
        limits = self._limits(timeout_s=timeout_s, memory_mb=memory_mb, cpu_s=cpu_s,
                              max_output_bytes=max_output_bytes, nproc=nproc)
        if isinstance(stdin, str):
            stdin = stdin.encode("utf-8", "surrogatepass")
        return self._run_script(code if isinstance(code, str) else str(code), limits, stdin=stdin, network=network)

    def _run_script(self, code: str, limits: Limits, *, stdin: bytes | None, network: bool) -> SandboxResult:
        if len(code) > limits.max_disk_bytes // 4 and len(code.encode("utf-8", "surrogatepass")) > limits.max_disk_bytes:
            return SandboxResult("error", None, "", "", 0.0, detail="program larger than max_disk_bytes")
        proc = Proc(self, limits, mode="script", script=code, stdin=stdin, network=network)
        try:
            proc.start()
            died: Died | None = None
            try:
                proc.wait_exit(proc.t0 + limits.timeout_s)
            except Died as e:
                died = e
            code_, sig, ready, setup_error = proc.stop()
            duration = time.monotonic() - proc.t0
            stdout, stderr = proc.text("stdout"), proc.text("stderr")
            if not ready and died is None:
                raise SandboxError(f"sandbox set-up failed ({self.isolation.name}): "
                                   f"{setup_error or stderr.strip()[-500:] or 'no details'}")
            res = _classify(code_, sig, died, stdout, stderr, duration, proc.truncated)
            if res.status in ("killed", "error") and proc.oom_killed():
                res.status, res.detail = "memory", "memory limit of the execution (cgroup)"
            return res
        finally:
            proc.close()

    def run_many(self, codes: Sequence[str], **kwargs) -> list[SandboxResult]:
        """Run several programs in parallel (at most ``max_workers`` at a time), in order."""
        return self.map(lambda c: self.run(c, **kwargs), codes)

    def map(self, fn, items: Iterable) -> list:
        """``[fn(x) for x in items]`` on the sandbox's thread pool (``max_workers`` at a time), in
        order; ``masrl.codecheck.scoring.score_many`` scores through it."""
        self.resolve()
        return list(self._executor().map(fn, items))

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_workers, thread_name_prefix="masrl-sandbox")
            return self._pool

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _classify(code: int | None, sig: int | None, died: Died | None, stdout: str, stderr: str,
              duration: float, truncated: bool) -> SandboxResult:
    detail = ""
    if died is not None and died.status in ("timeout", "output_limit"):
        status = died.status
        detail = died.detail or ("wall-clock timeout" if status == "timeout" else "")
        code = code if code is not None else -signal.SIGKILL
        sig = sig if sig is not None else signal.SIGKILL
    elif sig is not None:
        if sig == signal.SIGXCPU:
            status, detail = "timeout", "CPU time limit"
        elif sig == signal.SIGXFSZ:
            status, detail = "output_limit", "file size limit"
        elif sig == signal.SIGKILL and "MemoryError" in stderr[-2000:]:
            status = "memory"
        else:
            status, detail = "killed", f"signal {sig} ({signal_name(sig)})"
    elif code == 0:
        status = "ok"
    else:
        tail = stderr[-2000:]
        if "MemoryError" in tail or "Cannot allocate memory" in tail or "std::bad_alloc" in tail:
            status = "memory"
        else:
            status = "error"
    return SandboxResult(status, code, stdout, stderr, duration, sig, truncated, detail)

def signal_name(sig: int) -> str:
    """``SIGKILL`` for 9; the number itself for one this platform does not name."""
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)


_DEFAULT: Sandbox | None = None
_DEFAULT_LOCK = threading.Lock()


def default_sandbox() -> Sandbox:
    """The process-wide ``Sandbox`` used by ``run_python`` and ``score_code``."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            workers = int(os.environ.get("MASRL_SANDBOX_WORKERS", "0")) or max(1, min(8, os.cpu_count() or 1))
            _DEFAULT = Sandbox(max_workers=workers, isolation=os.environ.get("MASRL_SANDBOX_ISOLATION", "auto"))
        return _DEFAULT


def run_python(code: str, *, timeout_s: float = 10.0, memory_mb: int = 1024, cpu_s: float | None = None,
               max_output_bytes: int = 1 << 20, network: bool = False, stdin: str | bytes | None = None,
               sandbox: Sandbox | None = None) -> SandboxResult:
    """Run ``code`` in a fresh sandboxed process; never raises for anything the code does."""
    sb = sandbox or default_sandbox()
    return sb.run(code, stdin=stdin, timeout_s=timeout_s, memory_mb=memory_mb, cpu_s=cpu_s,
                  max_output_bytes=max_output_bytes, network=network)


def sandbox_capabilities(sandbox: Sandbox | None = None) -> dict:
    """What the sandbox can enforce on this machine (probes once)."""
    return (sandbox or default_sandbox()).describe()
