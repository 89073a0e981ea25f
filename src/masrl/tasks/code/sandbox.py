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

The RPC mode used by :mod:`masrl.tasks.code.scoring` (``_Session``) runs the candidate program
once and then answers function calls whose results come back as plain data, so that tests
are checked outside the untrusted process.
"""
from __future__ import annotations

import functools
import json
import marshal
import math
import os
import random
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Sequence

from masrl.tasks.code import _cgroup, _child
from masrl.tasks.code._cleanup import remove_tree

__all__ = [
    "SandboxResult", "Limits", "Isolation", "Sandbox", "SandboxError", "run_python", "sandbox_capabilities",
    "default_sandbox",
]

STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "killed")
_CHILD_SOURCE = Path(_child.__file__).read_text(encoding="utf-8")
_CHILD_CODE = marshal.dumps(compile(_CHILD_SOURCE, "<masrl-sandbox>", "exec"))
# the child reads (code, config) from a file in its work directory, then deletes it; the code
# is precompiled when the sandbox runs this very interpreter (saves ~30 ms per start)
_BOOT = ("import marshal,os,sys\n"
         "with open(sys.argv[1],'rb') as f: c,cfg=marshal.loads(f.read())\n"
         "os.unlink(sys.argv[1])\n"
         "exec(compile(c,'<masrl-sandbox>','exec') if type(c) is str else marshal.loads(c))\n"
         "main(cfg)\n")
# never hide these: the interpreter and the C library need them
_ESSENTIAL = ("/", "/usr", "/lib", "/lib32", "/lib64", "/bin", "/sbin", "/etc", "/dev", "/proc", "/sys")


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
    """Which protections an execution gets (resolved once per :class:`Sandbox`)."""

    name: str  # "namespaces" | "userns" | "basic"
    setuid: bool = False  # run the candidate under a fresh unprivileged uid (needs root)
    userns: bool = False
    mntns: bool = False
    netns: bool = False
    pidns: bool = False
    guard: bool = False  # audit-hook guard inside the child (fallback)
    allow_fork: bool = True
    notes: tuple[str, ...] = ()


# --------------------------------------------------------------------------------------
# uid pool: every concurrent execution runs under its own uid, so RLIMIT_NPROC counts exactly
# its own processes and sandboxes cannot signal each other
# --------------------------------------------------------------------------------------
class _UidPool:
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


_UID_POOLS: dict[tuple[int, int], _UidPool] = {}
_UID_POOLS_LOCK = threading.Lock()


def _uid_pool(lo: int, hi: int) -> _UidPool:
    with _UID_POOLS_LOCK:
        return _UID_POOLS.setdefault((lo, hi), _UidPool(lo, hi))


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
def _python_dirs(executable: str, site_packages: bool) -> tuple[str, ...]:
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


def _normalize_hide(paths: Iterable[str]) -> list[str]:
    out = set()
    for p in paths:
        if not p:
            continue
        r = os.path.realpath(os.path.expanduser(str(p)))
        if r in _ESSENTIAL or not os.path.isdir(r):
            continue
        out.add(r)
    return sorted(out, key=lambda s: (s.count("/"), s))


def _is_under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


# --------------------------------------------------------------------------------------
# the harness side of one sandboxed process
# --------------------------------------------------------------------------------------
class _Died(Exception):
    """The sandboxed process ended or was stopped while the harness waited for it."""

    def __init__(self, status: str, detail: str = ""):
        super().__init__(f"{status}: {detail}" if detail else status)
        self.status = status
        self.detail = detail


class _Proc:
    """One sandboxed process: start, pump its pipes with caps, stop, clean up."""

    def __init__(self, sb: "Sandbox", limits: Limits, *, mode: str, script: str | None = None,
                 stdin: bytes | None = None, network: bool = False):
        self.sb, self.limits, self.mode = sb, limits, mode
        self.script, self.stdin_data, self.network = script, stdin, network
        self.iso = sb.isolation
        self.uid: int | None = None
        self.workdir: str | None = None
        self.proc: subprocess.Popen | None = None
        self.out = {"stdout": bytearray(), "stderr": bytearray()}
        self.open_streams: set[str] = set()
        self.truncated = False
        self.stop_reason: str | None = None  # why the harness killed it
        self.frames = bytearray()
        self.resp_eof = False
        self.fds: dict[str, int] = {}
        self.t0 = time.monotonic()
        self.killed = False
        self.status_buf = b""
        self.cgroup: _cgroup.ExecCgroup | None = None

    # -- start ---------------------------------------------------------------------
    def start(self) -> None:
        sb, iso = self.sb, self.iso
        self.t0 = time.monotonic()
        self.workdir = tempfile.mkdtemp(prefix="masrl-sbx-", dir=sb.tmp_root)
        child_fds: list[int] = []
        try:
            if iso.setuid or (iso.userns and os.geteuid() == 0):
                self.uid = sb._uids.acquire()
                os.chown(self.workdir, self.uid, self.uid)
            if self.script is not None:
                path = os.path.join(self.workdir, "main.py")
                with open(path, "wb") as f:  # lone surrogates pass: compiling them fails in the child
                    f.write(self.script.encode("utf-8", "surrogatepass"))
                if self.uid is not None:
                    os.chown(path, self.uid, self.uid)
            if sb.cgroups:
                # the whole execution's memory (memfd, SysV shm, tmpfs, all its processes) and pids
                try:
                    self.cgroup = _cgroup.ExecCgroup(int(self.limits.memory_mb) << 20, int(self.limits.nproc) + 8)
                except OSError as e:
                    raise SandboxError(f"cannot create the execution's cgroup: {e}") from e
            ready_r, ready_w = os.pipe()
            self.fds["ready"] = ready_r
            child_fds.append(ready_w)
            cfg = self._child_config(ready_w)
            if iso.pidns:
                status_r, status_w = os.pipe()
                self.fds["status"] = status_r
                child_fds.append(status_w)
                cfg["status_fd"] = status_w
            if self.mode == "serve":
                req_r, req_w = os.pipe()
                resp_r, resp_w = os.pipe()
                self.fds["req"], self.fds["resp"] = req_w, resp_r
                child_fds += [req_r, resp_w]
                cfg["req_fd"], cfg["resp_fd"] = req_r, resp_w
            if self.cgroup is not None:
                cfg["cgroups"] = self.cgroup.procs_files
            env = {"PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
                   "LANG": os.environ.get("LANG", "C.UTF-8"), "HOME": self.workdir, "TMPDIR": self.workdir,
                   "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
            boot = os.path.join(self.workdir, ".masrl-boot")
            with open(boot, "wb") as f:
                f.write(marshal.dumps((_CHILD_CODE if sb.same_python else _CHILD_SOURCE, cfg)))
            argv = [sb.python, "-I", "-B"] + ([] if sb.site_packages else ["-S"]) + ["-c", _BOOT, boot]
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE if self.stdin_data is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=child_fds, start_new_session=True,
                env=env, cwd=self.workdir, close_fds=True)
        except BaseException:
            for fd in child_fds:
                _close(fd)
            self.close()
            raise
        for fd in child_fds:
            _close(fd)
        self.sel = selectors.DefaultSelector()
        for name, f in (("stdout", self.proc.stdout), ("stderr", self.proc.stderr)):
            os.set_blocking(f.fileno(), False)
            self.sel.register(f.fileno(), selectors.EVENT_READ, name)
            self.open_streams.add(name)
        if "resp" in self.fds:
            os.set_blocking(self.fds["resp"], False)
            self.sel.register(self.fds["resp"], selectors.EVENT_READ, "resp")
        if self.stdin_data is not None:
            self._stdin_buf = memoryview(self.stdin_data)
            os.set_blocking(self.proc.stdin.fileno(), False)
            if self._stdin_buf:
                self.sel.register(self.proc.stdin.fileno(), selectors.EVENT_WRITE, "stdin")
            else:
                self.proc.stdin.close()

    def _child_config(self, ready_w: int) -> dict[str, Any]:
        """What the child needs to set itself up (the pipes are added by :meth:`start`)."""
        sb, iso, lim = self.sb, self.iso, self.limits
        return {
            "mode": self.mode, "workdir": self.workdir, "network": bool(self.network),
            "ready_fd": ready_w, "harness_pid": os.getpid(),
            "iso": {"userns": iso.userns, "mntns": iso.mntns, "netns": iso.netns, "pidns": iso.pidns,
                    "guard": iso.guard, "allow_fork": iso.allow_fork, "uid": self.uid, "gid": self.uid},
            "limits": {"cpu_s": lim.cpu_seconds(), "memory_bytes": int(lim.memory_mb) << 20,
                       "file_bytes": int(lim.max_file_bytes), "nofile": int(lim.nofile), "nproc": int(lim.nproc),
                       "disk_bytes": int(lim.max_disk_bytes), "inodes": int(lim.max_inodes), "shm_bytes": 16 << 20},
            "keyring": True, "seccomp": sb.seccomp,
            "hide": sb.hide_paths, "expose": sb.python_dirs, "read_roots": sb.read_roots,
        }

    # -- i/o -------------------------------------------------------------------------
    def _exited(self) -> bool:
        """Has the top process exited? (without reaping it, so its pid/pgid stays ours)"""
        try:
            return os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True

    def _pump_once(self, timeout: float) -> None:
        cap = self.limits.max_output_bytes
        for key, _ in self.sel.select(timeout=max(0.0, timeout)):
            name = key.data
            if name == "req":
                continue  # writable again: send() retries
            if name == "stdin":
                try:
                    n = os.write(key.fd, self._stdin_buf[:65536])
                    self._stdin_buf = self._stdin_buf[n:]
                except (BrokenPipeError, OSError):
                    self._stdin_buf = self._stdin_buf[:0]
                if not self._stdin_buf:
                    self.sel.unregister(key.fd)
                    self.proc.stdin.close()
                continue
            try:
                data = os.read(key.fd, 1 << 16)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                self.sel.unregister(key.fd)
                if name == "resp":
                    self.resp_eof = True
                else:
                    self.open_streams.discard(name)
                continue
            if name == "resp":
                self.frames += data
                if len(self.frames) > self.sb.max_message_bytes + 4:
                    self.kill("output_limit")
                    raise _Died("output_limit", "result message over the size limit")
                continue
            buf = self.out[name]
            room = cap - len(buf)
            buf += data[:max(0, room)]
            if len(data) > room:
                self.truncated = True
                self.kill("output_limit")
                raise _Died("output_limit", f"{name} over {cap} bytes")

    def next_frame(self, deadline: float) -> dict:
        """Wait for one response frame (serve mode)."""
        while True:
            if len(self.frames) >= 4:
                n = int.from_bytes(self.frames[:4], "big")
                if n > self.sb.max_message_bytes:
                    self.kill("output_limit")
                    raise _Died("output_limit", "result message over the size limit")
                if len(self.frames) >= 4 + n:
                    body = bytes(self.frames[4:4 + n])
                    del self.frames[:4 + n]
                    return self._decode_frame(body)
            if self.resp_eof:
                raise _Died("exited", "the sandboxed process exited")
            now = time.monotonic()
            if now >= deadline:
                self.kill("timeout")
                raise _Died("timeout")
            self._pump_once(min(deadline - now, 0.25))
            if not self.sel.get_map() and not self.resp_eof:
                time.sleep(0.01)

    def _decode_frame(self, body: bytes) -> dict:
        """One response frame as a dict; its item count is checked before anything is built
        (a 15 MiB frame of ``{},`` would otherwise cost some 400 MiB to decode)."""
        items = _json_items(body, self.sb.max_message_items)
        if items > self.sb.max_message_items:
            self.kill("protocol_error")
            raise _Died("protocol_error", f"message with {items} items (the limit is {self.sb.max_message_items})")
        try:
            msg = json.loads(body.decode("utf-8", "surrogatepass"))
            if not isinstance(msg, dict):
                raise ValueError("not an object")
            return msg
        except (ValueError, RecursionError, MemoryError):
            self.kill("protocol_error")
            raise _Died("protocol_error", "malformed message from the sandbox") from None

    def send(self, obj: dict, deadline: float) -> None:
        """Write one request (serve mode), draining the outputs meanwhile; never blocks past
        ``deadline`` even if the child stops reading (e.g. it SIGSTOPped itself)."""
        data = marshal.dumps(obj)
        view = memoryview(len(data).to_bytes(4, "big") + data)
        fd = self.fds["req"]
        os.set_blocking(fd, False)
        while view:
            try:
                view = view[os.write(fd, view):]
                continue
            except BlockingIOError:
                pass
            except (BrokenPipeError, OSError):
                raise _Died("exited", "the sandboxed process exited") from None
            now = time.monotonic()
            if now >= deadline:
                self.kill("timeout")
                raise _Died("timeout")
            self.sel.register(fd, selectors.EVENT_WRITE, "req")
            try:
                self._pump_once(min(deadline - now, 0.25))
            finally:
                self.sel.unregister(fd)

    def wait_exit(self, deadline: float) -> None:
        """Pump output until the process exits and its pipes close (script mode)."""
        exited_at = None
        while True:
            now = time.monotonic()
            if self._exited():
                exited_at = exited_at or now
                if not self.open_streams or now - exited_at > 0.2:
                    return  # leftover descendants holding the pipes are killed in stop()
            if now >= deadline:
                self.kill("timeout")
                raise _Died("timeout")
            if self.sel.get_map():
                self._pump_once(min(deadline - now, 0.05))
            else:
                time.sleep(0.005)

    def drain(self) -> None:
        """Read whatever output is left without blocking (after the process ended)."""
        try:
            for _ in range(64):
                if not self.sel.get_map():
                    break
                before = sum(len(b) for b in self.out.values())
                self._pump_once(0)
                if sum(len(b) for b in self.out.values()) == before:
                    break
        except _Died:
            pass

    # -- stop ------------------------------------------------------------------------
    def _status_lines(self) -> list[dict]:
        self.status_buf += self._read_fd("status")
        out = []
        for line in self.status_buf.decode(errors="replace").splitlines():
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                out.append(obj)
        return out

    def kill(self, reason: str | None = None) -> None:
        if reason and self.stop_reason is None:
            self.stop_reason = reason
        if self.proc is None or self.killed:
            return
        self.killed = True
        if self.iso.pidns and not self._exited():
            # kill the namespace's init: the kernel then kills everything inside, and B reaps
            # it and reports, so no orphan is left for the host's init to reap
            init_pid = next((x["init_pid"] for x in self._status_lines() if isinstance(x.get("init_pid"), int)), None)
            if init_pid:
                try:
                    os.kill(init_pid, signal.SIGKILL)
                    end = time.monotonic() + 1.0
                    while not self._exited() and time.monotonic() < end:
                        time.sleep(0.002)
                except (ProcessLookupError, PermissionError):
                    pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.uid is not None and not self.iso.pidns and os.geteuid() == 0:
            _kill_uid(self.uid)
        if self.cgroup is not None:
            self.cgroup.kill_all()

    def _read_fd(self, name: str) -> bytes:
        fd = self.fds.get(name)
        if fd is None:
            return b""
        data = b""
        try:
            os.set_blocking(fd, False)
            while True:
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                data += chunk
        except (BlockingIOError, OSError):
            pass
        return data

    def stop(self) -> tuple[int | None, int | None, bool, str]:
        """Kill what is left, reap, and return (exit code, signal, ready, setup error)."""
        if self.proc is None:
            return None, None, False, "not started"
        self.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL'd processes go away
            pass
        self.drain()
        ready = self._read_fd("ready") == b"1"
        code, sig, setup_error = None, None, ""
        if self.iso.pidns:
            info: dict = {}
            for line in self._status_lines():
                info.update(line)
            setup_error = info.get("setup_error", "")
            st = info.get("wstatus")
            if isinstance(st, int):
                if os.WIFSIGNALED(st):
                    sig = os.WTERMSIG(st)
                elif os.WIFEXITED(st):
                    code = os.WEXITSTATUS(st)
        else:
            rc = self.proc.returncode
            if rc is not None and rc < 0:
                sig = -rc
            else:
                code = rc
        if sig is not None and code is None:
            code = -sig
        return code, sig, ready, setup_error

    def close(self) -> None:
        if getattr(self, "sel", None) is not None:
            try:
                self.sel.close()
            except Exception:
                pass
        if self.proc is not None:
            for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
                if f is not None:
                    try:
                        f.close()
                    except OSError:
                        pass
        for fd in self.fds.values():
            _close(fd)
        self.fds.clear()
        if self.cgroup is not None:
            self.cgroup.remove()
            self.cgroup = None
        if self.workdir:
            remove_tree(self.workdir, _CLEANUP_BUDGET_S)
            self.workdir = None
        if self.uid is not None:
            self.sb._uids.release(self.uid)
            self.uid = None

    def text(self, name: str) -> str:
        return bytes(self.out[name]).decode("utf-8", errors="replace")

    def oom_killed(self) -> bool:
        """Did the execution's cgroup hit its memory limit?"""
        return self.cgroup is not None and self.cgroup.oom_killed()


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


_CLEANUP_BUDGET_S = 1.0  # the caller waits at most this long for the work dir; the rest goes on in the background
_JSON_STRING = re.compile(rb'"[^"]*"')  # a string once its escapes are gone


def _json_items(body: bytes, budget: int) -> int:
    """An upper bound on the number of values (and keys) in the JSON text ``body``, exact
    enough to compare with ``budget``; C-speed scans only, nothing is built. Strings are taken
    out first (their commas and brackets are text) only when the plain count is over budget."""
    def structure(b: bytes) -> int:
        return b.count(b",") + b.count(b":") + b.count(b"[") + b.count(b"{") + 1

    n = structure(body)
    if n <= budget or b'"' not in body:
        return n
    # in valid JSON a backslash only starts an escape, read left to right: drop escaped
    # backslashes, then escaped quotes; every quote left opens or closes a string
    plain = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    strings = plain.count(b'"') // 2
    if strings > budget:  # each string is an object of its own
        return strings
    return max(strings, structure(_JSON_STRING.sub(b"", plain)))


def _is_zombie(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid`` (fallback without a PID namespace; needs root)."""
    for _ in range(50):
        found = False
        try:
            entries = os.listdir("/proc")
        except OSError:
            return
        for e in entries:
            if not e.isdigit():
                continue
            try:
                if os.stat(f"/proc/{e}").st_uid != uid or _is_zombie(e):
                    continue
                os.kill(int(e), signal.SIGKILL)
                found = True
            except (OSError, ValueError):
                continue
        if not found:
            return
        time.sleep(0.01)


# --------------------------------------------------------------------------------------
# isolation probing
# --------------------------------------------------------------------------------------
def _untraversable_ancestors(dirs: Sequence[str]) -> list[str]:
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


def _python_reachable_by_others(dirs: Sequence[str]) -> bool:
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


def _candidates(request: str, dirs: Sequence[str]) -> list[Isolation]:
    root = os.geteuid() == 0
    full = Isolation("namespaces", setuid=True, mntns=True, netns=True, pidns=True,
                     notes=("new mount/net/pid/ipc/uts namespaces", "fresh unprivileged uid per execution"))
    userns = Isolation("userns", userns=True, mntns=True, netns=True, pidns=True,
                       notes=("user namespace with mount/net/pid/ipc/uts namespaces, no capabilities",)
                       + (("uid 0 in the namespace is a fresh unprivileged host uid",) if root else
                          ("runs under the harness uid (the only one it may map)",)))
    setuid_ok = root and _python_reachable_by_others(dirs)
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


def _probe(sb: "Sandbox", request: str) -> Isolation:
    key = (request, sb.python, tuple(sb.hide_paths), sb.tmp_root, sb.site_packages)
    with _PROBE_LOCK:
        if key in _PROBE_CACHE:
            return _PROBE_CACHE[key]
        errors = []
        for iso in _candidates(request, sb.python_dirs):
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


# --------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------
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
        self.seccomp = _seccomp_available()
        self.python_dirs = list(_python_dirs(self.python, bool(site_packages)))
        hide = list(default_hide_paths() if hide_paths is None else hide_paths) + list(extra_hide_paths)
        # an ancestor of the Python install that other users cannot traverse (pyenv under a
        # 0700 /root) is replaced by an empty directory through which the install is re-exposed
        hide += _untraversable_ancestors(self.python_dirs)
        self.hide_paths = _normalize_hide(hide)
        self.read_roots = self.python_dirs + ["/usr/lib", "/usr/lib64", "/usr/share", "/usr/local/lib", "/lib",
                                              "/lib64", "/etc/localtime", "/etc/ld.so.cache"]
        self._uids = _uid_pool(*uid_range)
        self._request = isolation
        self.isolation: Isolation | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._resolved = False
        self._resolve_lock = threading.Lock()

    # -- isolation -------------------------------------------------------------------
    def resolve(self) -> Isolation:
        """Probe (once) which isolation works here; raises :class:`SandboxError` if none."""
        with self._resolve_lock:
            if not self._resolved:
                self.isolation = _probe(self, self._request)
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
        proc = _Proc(self, limits, mode="script", script=code, stdin=stdin, network=network)
        try:
            proc.start()
            died: _Died | None = None
            try:
                proc.wait_exit(proc.t0 + limits.timeout_s)
            except _Died as e:
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
        order; ``masrl.tasks.code.scoring.score_many`` scores through it."""
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


def _classify(code: int | None, sig: int | None, died: _Died | None, stdout: str, stderr: str,
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
            status, detail = "killed", f"signal {sig} ({_signame(sig)})"
    elif code == 0:
        status = "ok"
    else:
        tail = stderr[-2000:]
        if "MemoryError" in tail or "Cannot allocate memory" in tail or "std::bad_alloc" in tail:
            status = "memory"
        else:
            status = "error"
    return SandboxResult(status, code, stdout, stderr, duration, sig, truncated, detail)


def _seccomp_available() -> bool:
    """Can the child install a seccomp filter (kernel support, known system call table)?"""
    try:
        with open("/proc/sys/kernel/seccomp/actions_avail") as f:
            actions = f.read().split()
    except OSError:
        return False
    return "errno" in actions and os.uname().machine in _child._SYSCALLS


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)


_DEFAULT: Sandbox | None = None
_DEFAULT_LOCK = threading.Lock()


def default_sandbox() -> Sandbox:
    """The process-wide :class:`Sandbox` used by :func:`run_python` and ``score_code``."""
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
