"""A user reward in a process of its own (``task.reward_isolation: process``, and ``auto`` where it can be).

A reward run in a thread of the trainer (``thread``) keeps the trainer's process, but a call that holds the
interpreter lock (a catastrophic regular expression, a C extension that does not release it) cannot be
interrupted, so the run waits for it forever, and one that ends the process (``os._exit``, a segfault, an
``abort()`` in a C library) ends the run. Here each reward function has one worker process (``python -m
masrl.usercode.process``, started at the first call, reused for every call after it): a call past its
deadline kills the worker (SIGKILL) and scores 0 with ``reason: reward_timeout``; a worker that dies during a
call is that call's error (its exit code or signal named); either way the next call starts a new worker.

The worker imports the function itself (``file.py:function`` / ``pkg.module:function``, or a registered
function by reference), so what the module loads at import is loaded again there; each call sends the task and
a copy of the episode (pickled) and receives the result and the ``reward`` of each turn. Once
``MAX_TIMEOUTS_IN_A_ROW`` calls in a row ran past their deadline, further calls are not made (each scores 0
as a timeout at once), so a reward that hangs on every call stops the run within a step or two
(``masrl.usercode.guard.check_failures``) instead of costing its deadline on every call.

Protocol (stdin / a copy of stdout of the worker; the worker's own stdout goes to stderr, so a ``print`` in
the reward cannot break it): 8-byte big-endian length, then a pickle. Parent -> worker: the function to load,
then ``(task, episode)`` per call. Worker -> parent: ``("ready",)`` or ``("load_error", text)``, then per call
``("ok", result, turn_rewards)`` or ``("error", description, traceback_text)``.
"""
from __future__ import annotations

import atexit
import os
import pickle
import queue
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
import weakref
from typing import Any

from masrl.usercode.guard import MAX_ABANDONED, RewardProcessError, RewardTimeout, describe_error, user_frames

START_TIMEOUT_S = 120.0  # for the worker to start and import the reward's module (not part of a call's deadline)
MAX_TIMEOUTS_IN_A_ROW = MAX_ABANDONED  # calls past their deadline in a row before further calls are not made
_HEADER = struct.Struct(">Q")


def _exit_reason(code: int | None) -> str:
    from masrl.sandbox.sandbox import signal_name  # here, not at the top: the worker never needs it

    if code is None:
        return "it did not exit"
    return f"killed by signal {signal_name(-code)}" if code < 0 else f"exit code {code}"


class RewardProcess:
    """The worker process of one reward function (see the module docstring); ``load``: ``("spec", "file.py:fn")``
    or ``("pickle", bytes)`` (a registered function pickled by reference)."""

    def __init__(self, name: str, load: tuple[str, Any], start_timeout_s: float = START_TIMEOUT_S):
        self.name, self.load, self.start_timeout_s = name, load, start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()
        self.starts = 0  # workers started so far (1 + restarts after a timeout or a crash)
        self.timeouts_in_a_row = 0
        _LIVE.add(self)

    def __getstate__(self) -> dict:  # sent to another process (a Ray worker): it starts a worker of its own
        return {"name": self.name, "load": self.load, "start_timeout_s": self.start_timeout_s}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    # --------------------------------------------------------------- the worker's life
    def _start(self, deadline: float) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p or os.curdir) for p in sys.path)
        env.pop("PYTHONSTARTUP", None)
        env["MASRL_REWARD_PARENT"] = str(os.getpid())
        self.proc = _spawn(lambda: subprocess.Popen([sys.executable, "-m", "masrl.usercode.process"],
                                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                                    start_new_session=True))
        self.starts += 1
        self._send(pickle.dumps(self.load, protocol=pickle.HIGHEST_PROTOCOL))
        reply = self._receive(deadline, f"to start and load the function (within {self.start_timeout_s:g} s)")
        if reply[0] != "ready":
            self.stop()
            raise RewardProcessError(f"its process could not load the function: {reply[1]}")

    def __del__(self) -> None:
        try:
            self.stop()
        except Exception:  # noqa: BLE001 - at interpreter shutdown
            pass

    def stop(self) -> None:
        """Kill the worker (if any); the next call starts a new one."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass

    # --------------------------------------------------------------- messages
    def _send(self, data: bytes) -> None:
        """One pickled message to the worker."""
        try:
            self.proc.stdin.write(_HEADER.pack(len(data)) + data)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self._died("before the call was sent")

    def _read(self, n: int, deadline: float, what: str) -> bytes:
        fd, chunks, left = self.proc.stdout.fileno(), [], n
        ready = select.poll()  # poll, not select: no limit on the descriptor's number (a process with many open)
        ready.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        while left:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not ready.poll(max(1, int(remaining * 1000))):
                raise _Overrun(what)
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                self._died("during the call")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def _receive(self, deadline: float, what: str) -> tuple:
        try:
            (size,) = _HEADER.unpack(self._read(_HEADER.size, deadline, what))
            return pickle.loads(self._read(size, deadline, what))
        except _Overrun:
            self.stop()
            raise

    def _died(self, when: str):
        proc = self.proc
        code = proc.wait() if proc is not None else None
        self.stop()
        raise RewardProcessError(f"its process ended {when} ({_exit_reason(code)}); the next call starts a new one")

    # --------------------------------------------------------------- a call
    def call(self, task: Any, episode: Any, timeout_s: float) -> tuple[Any, list]:
        """``fn(task, episode)`` in the worker: (its result, each turn's ``reward`` after the call).
        ``RewardTimeout`` past ``timeout_s`` (the worker is killed), ``RewardProcessError`` when it
        raised there or the worker died."""
        with self.lock:
            if self.timeouts_in_a_row >= MAX_TIMEOUTS_IN_A_ROW:
                raise RewardTimeout(f"not called: the last {self.timeouts_in_a_row} calls of reward {self.name} ran "
                                    "past their deadline")
            try:
                payload = pickle.dumps((task, episode), protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as e:  # noqa: BLE001 - something in the episode (info, meta) cannot be pickled
                raise RewardProcessError(
                    f"the task or episode cannot be sent to the reward's process "
                    f"({type(e).__name__}: {e}); set task.reward_isolation: thread") from None
            if self.proc is None or self.proc.poll() is not None:
                self.stop()
                try:
                    self._start(time.monotonic() + self.start_timeout_s)
                except _Overrun as e:
                    raise RewardProcessError(f"its process did not start {e.what}") from None
            start = time.monotonic()
            self._send(payload)
            try:
                reply = self._receive(start + timeout_s, "")
            except _Overrun:
                self.timeouts_in_a_row += 1
                raise RewardTimeout(f"reward {self.name} ran past its deadline of {timeout_s:g} s "
                                    "(task.reward_timeout_s); its process was stopped") from None
            self.timeouts_in_a_row = 0
        if reply[0] == "ok":
            return reply[1], reply[2]
        raise RewardProcessError(reply[1], reply[2])


_SPAWNS: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
_SPAWNER: list[threading.Thread] = []
_SPAWN_LOCK = threading.Lock()


def _spawn(start):
    """``start()`` (a Popen) on one long-lived thread of this process: Linux's parent-death signal, which ends a
    worker with the trainer, fires when the *thread* that started the worker ends, so no worker is started from
    a thread that may end before the process does (a pool's, a server's per-request thread)."""
    with _SPAWN_LOCK:
        if not _SPAWNER or not _SPAWNER[0].is_alive():
            thread = threading.Thread(target=_spawner, name="masrl-reward-spawner", daemon=True)
            thread.start()
            _SPAWNER[:] = [thread]
    done = queue.SimpleQueue()
    _SPAWNS.put((start, done))
    ok, value = done.get()
    if not ok:
        raise value
    return value


def _spawner() -> None:
    while True:
        start, done = _SPAWNS.get()
        try:
            done.put((True, start()))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            done.put((False, e))


class _Overrun(Exception):
    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


_LIVE: "weakref.WeakSet[RewardProcess]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for worker in list(_LIVE):
        worker.stop()


# ----------------------------------------------------------------------------- the worker side

def _user_traceback(error: BaseException) -> str:
    return "".join(traceback.format_exception(type(error), error, user_frames(error.__traceback__)))


def _load(load: tuple[str, Any]):
    kind, value = load
    if kind == "spec":
        from masrl.usercode.imports import import_object

        return import_object(value, "reward")
    return pickle.loads(value)


def _die_with_the_trainer() -> None:
    """Linux: the kernel kills this worker when the trainer ends (a worker stuck in a call that holds the
    interpreter lock never reads the closed pipe, and no thread of its own could run to notice)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if str(os.getppid()) != os.environ.get("MASRL_REWARD_PARENT", str(os.getppid())):
        os._exit(0)  # the trainer ended before the line above ran


def serve() -> None:
    """The worker's loop (``python -m masrl.usercode.process``)."""
    _die_with_the_trainer()
    inbox = sys.stdin.buffer
    outbox = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # the reward's print() goes to stderr, not into the protocol

    def receive() -> bytes | None:
        header = inbox.read(_HEADER.size)
        if len(header) < _HEADER.size:
            return None  # the trainer closed the pipe (it ended): exit
        (size,) = _HEADER.unpack(header)
        return inbox.read(size)

    def reply(message: tuple) -> None:
        try:
            data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - the reward returned what cannot be pickled
            data = pickle.dumps(("error", f"the reward returned a value that cannot be sent back to the trainer "
                                          f"({type(e).__name__}: {e}); return a number or a dict of plain values", ""))
        outbox.write(_HEADER.pack(len(data)) + data)
        outbox.flush()

    try:
        fn = _load(pickle.loads(receive()))
    except BaseException as e:  # noqa: BLE001 - anything the import raises (SystemExit too) is reported
        reply(("load_error", " ".join(f"{type(e).__name__}: {e}".split())[:500]))
        return
    reply(("ready",))
    while (message := receive()) is not None:
        try:
            task, episode = pickle.loads(message)
        except Exception as e:  # noqa: BLE001 - e.g. a class in episode.info that only the trainer's __main__ has
            reply(("error", f"the task or episode cannot be read in the reward's process ({type(e).__name__}: "
                            f"{e}); set task.reward_isolation: thread", ""))
            continue
        turns = list(episode.turns)  # the rewards go back in this order, whatever the function does to the list
        try:
            result = fn(task, episode)
        except BaseException as e:  # noqa: BLE001 - SystemExit, KeyboardInterrupt in the function: a failed call
            reply(("error", describe_error(e), _user_traceback(e)))
            continue
        reply(("ok", result, [turn.reward for turn in turns]))


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the trainer, which stops this worker
    serve()
