"""The harness side of one sandboxed process: start it with its configuration, wait for it, kill
what is left, reap it and clean up (its pipes are pumped by ``masrl.sandbox.pipes.Pipes``).

``mode="script"`` runs a program once (``Sandbox.run``); ``mode="serve"`` runs it and then
answers requests framed on two extra pipes (``Proc.send``, ``Proc.next_frame``), which
the code task's scorer uses to call the candidate's functions.
"""
from __future__ import annotations

import json
import marshal
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from masrl.sandbox import _cgroup, _child
from masrl.sandbox._cleanup import remove_tree
from masrl.sandbox.base import Died, Limits, SandboxError
from masrl.sandbox.pipes import Pipes

if TYPE_CHECKING:
    from masrl.sandbox.sandbox import Sandbox

__all__ = ["Proc"]

_CHILD_SOURCE = Path(_child.__file__).read_text(encoding="utf-8")
_CHILD_CODE = marshal.dumps(compile(_CHILD_SOURCE, "<masrl-sandbox>", "exec"))
# the child reads (code, config) from a file in its work directory, then deletes it; the code
# is precompiled when the sandbox runs this very interpreter (saves ~30 ms per start)
_BOOT = ("import marshal,os,sys\n"
         "with open(sys.argv[1],'rb') as f: c,cfg=marshal.loads(f.read())\n"
         "os.unlink(sys.argv[1])\n"
         "exec(compile(c,'<masrl-sandbox>','exec') if type(c) is str else marshal.loads(c))\n"
         "main(cfg)\n")
_CLEANUP_BUDGET_S = 1.0  # the caller waits at most this long for the work dir; the rest goes on in the background


class Proc:
    """One sandboxed process: start, wait with caps and deadlines, stop, clean up."""

    def __init__(self, sb: Sandbox, limits: Limits, *, mode: str, script: str | None = None,
                 stdin: bytes | None = None, network: bool = False):
        self.sb, self.limits, self.mode = sb, limits, mode
        self.script, self.stdin_data, self.network = script, stdin, network
        self.iso = sb.isolation
        self.uid: int | None = None
        self.workdir: str | None = None
        self.proc: subprocess.Popen | None = None
        self.pipes = Pipes(max_output_bytes=limits.max_output_bytes, max_message_bytes=sb.max_message_bytes,
                           max_message_items=sb.max_message_items, kill=self.kill)
        self.stop_reason: str | None = None  # why the harness killed it
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
                self.uid = sb.uids.acquire()
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
        self.pipes.attach(self.proc, stdin=self.stdin_data, req_fd=self.fds.get("req"), resp_fd=self.fds.get("resp"))

    def _child_config(self, ready_w: int) -> dict[str, Any]:
        """What the child needs to set itself up (the pipes are added by ``start``)."""
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

    def next_frame(self, deadline: float) -> dict:
        """Wait for one response frame (serve mode); raises ``Died``."""
        return self.pipes.next_frame(deadline)

    def send(self, obj: dict, deadline: float) -> None:
        """Write one request (serve mode); raises ``Died``."""
        self.pipes.send(obj, deadline)

    def wait_exit(self, deadline: float) -> None:
        """Pump output until the process exits and its pipes close (script mode)."""
        exited_at = None
        while True:
            now = time.monotonic()
            if self._exited():
                exited_at = exited_at or now
                if not self.pipes.open_streams or now - exited_at > 0.2:
                    return  # leftover descendants holding the pipes are killed in stop()
            if now >= deadline:
                self.kill("timeout")
                raise Died("timeout")
            if self.pipes.watching():
                self.pipes.pump(min(deadline - now, 0.05))
            else:
                time.sleep(0.005)

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
        self.pipes.drain()
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
        self.pipes.close()
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
            self.sb.uids.release(self.uid)
            self.uid = None

    @property
    def truncated(self) -> bool:
        """Was stdout or stderr cut at the cap?"""
        return self.pipes.truncated

    def text(self, name: str) -> str:
        return self.pipes.text(name)

    def oom_killed(self) -> bool:
        """Did the execution's cgroup hit its memory limit?"""
        return self.cgroup is not None and self.cgroup.oom_killed()



def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass



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
