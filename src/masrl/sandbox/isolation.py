"""Which isolation a sandbox gets, and what it needs: the uid pool, the paths to hide and to expose,
the probe that finds the strongest isolation that works on this machine."""
from __future__ import annotations

import functools
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

from masrl.sandbox import _child
from masrl.sandbox.base import Isolation, Limits, SandboxError

if TYPE_CHECKING:
    from masrl.sandbox.sandbox import Sandbox

# never hide these: the interpreter and the C library need them
_ESSENTIAL = ("/", "/usr", "/lib", "/lib32", "/lib64", "/bin", "/sbin", "/etc", "/dev", "/proc", "/sys")


# --------------------------------------------------------------------------------------
# uid pool: every concurrent execution runs under its own uid, so RLIMIT_NPROC counts exactly
# its own processes and sandboxes cannot signal each other
# --------------------------------------------------------------------------------------
class UidPool:
    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi
        self.active: set[int] = set()
        self.lock = threading.Lock()
        self.rng = random.SystemRandom()  # not the global generator: training code may seed it

    def acquire(self) -> int:
        with self.lock:
            while True:
                uid = self.rng.randrange(self.lo, self.hi)
                if uid not in self.active:
                    self.active.add(uid)
                    return uid

    def release(self, uid: int) -> None:
        with self.lock:
            self.active.discard(uid)


_UID_POOLS: dict[tuple[int, int], UidPool] = {}
_UID_POOLS_LOCK = threading.Lock()


def uid_pool(lo: int, hi: int) -> UidPool:
    with _UID_POOLS_LOCK:
        return _UID_POOLS.setdefault((lo, hi), UidPool(lo, hi))


# --------------------------------------------------------------------------------------
# paths
# --------------------------------------------------------------------------------------
_DIRS_QUERY = ("import json, sys\n"
               "dirs = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]\n"
               "if sys.argv[1] == '1':\n"
               "    import site\n"
               "    dirs += site.getsitepackages() + [site.getusersitepackages()]\n"
               "print(json.dumps(dirs))\n")


@functools.lru_cache(maxsize=16)
def python_dirs(executable: str, site_packages: bool) -> tuple[str, ...]:
    """Directories the interpreter needs: its install prefixes, its folder (and site-packages)."""
    if os.path.realpath(executable) == os.path.realpath(sys.executable):
        dirs = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
        if site_packages:
            import site

            dirs += site.getsitepackages() + [site.getusersitepackages()]
    else:
        try:
            out = subprocess.run([executable, "-I"] + ([] if site_packages else ["-S"]) +
                                 ["-c", _DIRS_QUERY, "1" if site_packages else "0"],
                                 capture_output=True, text=True, timeout=60, check=True, env={})
            dirs = json.loads(out.stdout)
        except (OSError, subprocess.SubprocessError, ValueError) as e:
            raise SandboxError(f"cannot run {executable}: {e}") from e
    dirs += [os.path.dirname(os.path.realpath(executable)), os.path.dirname(os.path.abspath(executable))]
    return tuple(sorted({os.path.realpath(d) for d in dirs if d and os.path.isdir(d)}))


def default_hide_paths() -> list[str]:
    """Paths made empty inside the sandbox: homes, temp dirs, host state, repo and data."""
    paths = ["/root", "/home", "/tmp", "/var/tmp", "/run", "/mnt", "/media", "/srv", "/opt", "/var/lib",
             "/var/log", "/var/mail", "/var/spool", "/var/cache", "/var/backups", tempfile.gettempdir(),
             os.path.expanduser("~")]
    try:
        from masrl.paths import REPO_ROOT, data_roots

        paths += [str(REPO_ROOT)] + [str(root) for root in data_roots()]
    except Exception:  # pragma: no cover - masrl.paths always importable in the package
        pass
    return paths


def normalize_hide(paths: Iterable[str]) -> list[str]:
    out = set()
    for p in paths:
        if not p:
            continue
        r = os.path.realpath(os.path.expanduser(str(p)))
        if r in _ESSENTIAL or not os.path.isdir(r):
            continue
        out.add(r)
    return sorted(out, key=lambda s: (s.count("/"), s))


# --------------------------------------------------------------------------------------
# isolation probing
# --------------------------------------------------------------------------------------
def untraversable_ancestors(dirs: Sequence[str]) -> list[str]:
    out = []
    for d in dirs:
        p = "/"
        for part in Path(d).parts[1:]:
            p = os.path.join(p, part)
            try:
                if not os.stat(p).st_mode & 0o001:
                    out.append(p)
                    break
            except OSError:
                break
    return out


def python_reachable_by_others(dirs: Sequence[str]) -> bool:
    """Can an unprivileged uid traverse to (and read) the Python install without namespaces?"""
    for d in dirs:
        p = "/"
        for part in Path(d).parts[1:]:
            p = os.path.join(p, part)
            try:
                if not os.stat(p).st_mode & 0o001:
                    return False
            except OSError:
                return False
    return True


def candidates(request: str, dirs: Sequence[str]) -> list[Isolation]:
    root = os.geteuid() == 0
    full = Isolation("namespaces", setuid=True, mntns=True, netns=True, pidns=True,
                     notes=("new mount/net/pid/ipc/uts namespaces", "fresh unprivileged uid per execution"))
    userns = Isolation("userns", userns=True, mntns=True, netns=True, pidns=True,
                       notes=("user namespace with mount/net/pid/ipc/uts namespaces, no capabilities",)
                       + (("uid 0 in the namespace is a fresh unprivileged host uid",) if root else
                          ("runs under the harness uid (the only one it may map)",)))
    setuid_ok = root and python_reachable_by_others(dirs)
    basic = Isolation("basic", setuid=setuid_ok, guard=True, allow_fork=setuid_ok,
                      notes=("no namespaces: audit-hook guard inside the child (best effort)",)
                      + (("fresh unprivileged uid per execution",) if setuid_ok else
                         ("runs under the harness uid: fork/exec blocked by the guard",)))
    if request == "auto":
        return ([full] if root else []) + [userns, basic]
    table = {"namespaces": [full], "userns": [userns], "basic": [basic]}
    if request not in table:
        raise ValueError(f"isolation must be 'auto', 'namespaces', 'userns' or 'basic', not {request!r}")
    return table[request]


_PROBE_CACHE: dict[tuple, Isolation] = {}
_PROBE_LOCK = threading.Lock()


def probe(sb: Sandbox, request: str) -> Isolation:
    key = (request, sb.python, tuple(sb.hide_paths), sb.tmp_root, sb.site_packages)
    with _PROBE_LOCK:
        if key in _PROBE_CACHE:
            return _PROBE_CACHE[key]
        errors = []
        for iso in candidates(request, sb.python_dirs):
            sb.isolation = iso
            try:
                res = sb._run_script("import sys, json\nprint('masrl-probe', sys.version_info[0])\n",
                                     Limits(timeout_s=30), stdin=None, network=False)
            except SandboxError as e:
                errors.append(f"{iso.name}: {e}")
                continue
            if res.status == "ok" and "masrl-probe 3" in res.stdout:
                _PROBE_CACHE[key] = iso
                return iso
            errors.append(f"{iso.name}: {res.status} {res.stderr.strip()[-300:]}")
        sb.isolation = None
        raise SandboxError("no sandbox isolation works on this machine: " + "; ".join(errors))


def seccomp_available() -> bool:
    """Can the child install a seccomp filter (kernel support, known system call table)?"""
    try:
        with open("/proc/sys/kernel/seccomp/actions_avail") as f:
            actions = f.read().split()
    except OSError:
        return False
    return "errno" in actions and os.uname().machine in _child._SYSCALLS
