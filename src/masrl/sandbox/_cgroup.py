"""A memory (and pids) cgroup per execution, where the harness may create one.

``RLIMIT_AS`` bounds each process's address space, but not memory the kernel holds on a
process's behalf (``memfd`` files that are written but never mapped, SysV shared memory, tmpfs
files, pipes) and not the sum over a program's processes. A cgroup counts all of it. Two
layouts are handled:

* cgroup v2 (unified): a child of the harness's own cgroup, with ``memory.max``,
  ``memory.swap.max = 0``, ``memory.oom.group = 1`` and ``pids.max``; possible only when those
  controllers are already enabled for the harness's children (a cgroup that holds processes
  cannot enable them itself);
* cgroup v1: a child of the harness's cgroup in the ``memory`` hierarchy
  (``memory.limit_in_bytes``, ``memory.memsw.limit_in_bytes``) and in the ``pids`` one.

The child process joins the cgroup first thing (before it unshares namespaces or drops
privileges), so every process of the execution is counted. Creating cgroups needs write
access to the hierarchy (root, or a delegated subtree); ``available`` says whether it works
here, and ``Sandbox.describe()`` reports it.
"""
from __future__ import annotations

import functools
import os
import signal
import time
import uuid

_ROOT = "/sys/fs/cgroup"


def _own_paths() -> dict[str, str]:
    """controller (or "" for v2) -> this process's cgroup path, from /proc/self/cgroup."""
    out = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) != 3:
                    continue
                if parts[1] == "":
                    out[""] = parts[2]
                for c in parts[1].split(","):
                    if c:
                        out[c] = parts[2]
    except OSError:
        pass
    return out


def _mounts() -> dict[str, str]:
    """controller (or "" for the v2 mount) -> mount point."""
    out = {}
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, rfields = left.split(), right.split()
                if len(rfields) < 3 or len(fields) < 5:
                    continue
                if rfields[0] == "cgroup2":
                    out.setdefault("", fields[4])
                elif rfields[0] == "cgroup":
                    for opt in rfields[2].split(","):
                        if opt in ("memory", "pids"):
                            out.setdefault(opt, fields[4])
    except OSError:
        pass
    return out


@functools.lru_cache(maxsize=1)
def layout() -> tuple[str, dict[str, str]] | None:
    """("v2", {"": parent dir}) or ("v1", {"memory": parent, "pids": parent}) where this process
    may create per-execution cgroups with a memory limit, else None."""
    mounts, own = _mounts(), _own_paths()
    if "" in mounts and "" in own:
        mine = os.path.join(mounts[""], own[""].lstrip("/"))
        # our own cgroup if memory is enabled for its children, else (our cgroup holds processes,
        # so it cannot enable it) its parent when delegated to us: the executions are siblings
        for parent in (mine, os.path.dirname(mine.rstrip("/"))):
            if not _is_under(parent, mounts[""]):
                break
            try:
                with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                    enabled = f.read().split()
            except OSError:
                enabled = []
            if "memory" in enabled and os.access(parent, os.W_OK):
                return "v2", {"": parent}
    if "memory" in mounts and "memory" in own:
        parents = {"memory": os.path.join(mounts["memory"], own["memory"].lstrip("/"))}
        if "pids" in mounts and "pids" in own:
            parents["pids"] = os.path.join(mounts["pids"], own["pids"].lstrip("/"))
        if os.access(parents["memory"], os.W_OK) and os.path.exists(
                os.path.join(parents["memory"], "memory.limit_in_bytes")):
            return "v1", parents
    return None


def _is_under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _write(path: str, value: str) -> bool:
    try:
        with open(path, "w") as f:
            f.write(value)
        return True
    except OSError:
        return False


class ExecCgroup:
    """The cgroup(s) of one execution. ``procs_files``: what the child writes its pid into."""

    def __init__(self, memory_bytes: int, pids: int):
        lay = layout()
        if lay is None:
            raise OSError("no writable cgroup hierarchy with a memory controller")
        self.version, parents = lay
        name = f"masrl-sbx-{uuid.uuid4().hex[:12]}"
        self.dirs: list[str] = []
        self.procs_files: list[str] = []
        try:
            for ctrl, parent in parents.items():
                d = os.path.join(parent, name)
                os.mkdir(d)
                self.dirs.append(d)
                self._limit(ctrl, d, memory_bytes, pids)
        except OSError:
            self.remove()
            raise
        self.procs_files = [os.path.join(d, "cgroup.procs") for d in self.dirs]

    def _limit(self, ctrl: str, d: str, memory_bytes: int, pids: int) -> None:
        if self.version == "v2":
            if not _write(os.path.join(d, "memory.max"), str(memory_bytes)):
                raise OSError(f"cannot set memory.max in {d}")
            _write(os.path.join(d, "memory.swap.max"), "0")
            _write(os.path.join(d, "memory.oom.group"), "1")
            _write(os.path.join(d, "pids.max"), str(pids))
        elif ctrl == "memory":
            if not _write(os.path.join(d, "memory.limit_in_bytes"), str(memory_bytes)):
                raise OSError(f"cannot set memory.limit_in_bytes in {d}")
            _write(os.path.join(d, "memory.memsw.limit_in_bytes"), str(memory_bytes))  # no swap
        elif ctrl == "pids":
            _write(os.path.join(d, "pids.max"), str(pids))

    def oom_killed(self) -> bool:
        """Did the kernel kill a process of this execution for the memory limit?"""
        for d in self.dirs:
            for name in ("memory.events", "memory.oom_control"):
                try:
                    with open(os.path.join(d, name)) as f:
                        for line in f:
                            key, _, value = line.partition(" ")
                            if key == "oom_kill" and value.strip() not in ("", "0"):
                                return True
                except OSError:
                    continue
        return False

    def pids(self) -> list[int]:
        out: set[int] = set()
        for f in self.procs_files:
            try:
                with open(f) as fh:
                    out.update(int(x) for x in fh.read().split())
            except (OSError, ValueError):
                pass
        return sorted(out)

    def kill_all(self, budget_s: float = 1.0) -> None:
        """SIGKILL every process still in the cgroup (cgroup.kill on v2, else one by one)."""
        end = time.monotonic() + budget_s
        for d in self.dirs:
            _write(os.path.join(d, "cgroup.kill"), "1")
        while time.monotonic() < end:
            left = self.pids()
            if not left:
                return
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.005)

    def remove(self, budget_s: float = 1.0) -> bool:
        """Kill what is left and remove the cgroup directories; never raises."""
        if not self.dirs:
            return True
        self.kill_all(budget_s)
        end = time.monotonic() + budget_s
        left = []
        for d in self.dirs:
            while True:
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > end:
                        left.append(d)
                        break
                    time.sleep(0.005)
        self.dirs = left
        return not left


def sweep_stale(min_age_s: float = 600.0) -> int:
    """Remove ``masrl-sbx-*`` cgroups left by a harness that was killed: empty ones created more
    than ``min_age_s`` ago (a live execution joins its cgroup at once, and an occupied cgroup
    cannot be removed anyway). Returns how many were removed; never raises."""
    lay = layout()
    if lay is None:
        return 0
    removed, now = 0, time.time()
    for parent in lay[1].values():
        try:
            names = [n for n in os.listdir(parent) if n.startswith("masrl-sbx-")]
        except OSError:
            continue
        for name in names:
            d = os.path.join(parent, name)
            try:
                if now - os.stat(d).st_mtime < min_age_s:
                    continue
                with open(os.path.join(d, "cgroup.procs")) as f:
                    if f.read().strip():
                        continue
                os.rmdir(d)
                removed += 1
            except OSError:
                continue
    return removed


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Can this process create a per-execution memory cgroup? (Sweeps stale ones once.)"""
    try:
        ExecCgroup(64 << 20, 16).remove()
    except OSError:
        return False
    sweep_stale()
    return True
