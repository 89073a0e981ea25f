"""A user's program run as a subprocess (an agent program's ``command``), under the user-code contract.

The program starts in a process group of its own; the call ends when *the program* exits (not when its
output pipes close: a background child that keeps stdout open does not hold the call), or at the deadline on
the whole call. Either way the whole group is then killed (SIGKILL), so no child it started outlives its
episode. Its output is read as it comes and only the last ``max_output`` bytes are kept (stdout; stderr keeps
``STDERR_TAIL`` bytes): a program that prints gigabytes costs that bound in memory, not its output.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from dataclasses import dataclass

MAX_OUTPUT = 1 << 20  # bytes of a program's stdout kept (the end of it)
STDERR_TAIL = 64 << 10  # bytes of its stderr kept (the end of it: the error line)
DRAIN_S = 1.0  # after the program exits, how long its output is read before the pipes are given up
_CHUNK = 1 << 16


@dataclass
class CommandResult:
    """How a program's run ended: ``returncode`` (None: killed at the deadline), the ends of its output."""

    returncode: int | None
    stdout: bytes
    stderr: bytes
    timed_out: bool = False
    stdout_bytes: int = 0  # all the bytes it printed on stdout (``stdout`` holds the last ``max_output``)


class _Tail:
    """The last ``limit`` bytes read from a stream (and how many were read in all)."""

    def __init__(self, limit: int):
        self.limit, self.data, self.total = limit, bytearray(), 0

    async def read(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(_CHUNK):
            self.total += len(chunk)
            self.data += chunk
            if len(self.data) > self.limit:
                del self.data[:len(self.data) - self.limit]


def kill_group(pid: int) -> None:
    """SIGKILL to the process group ``pid`` leads (the program and every child it started); never raises."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class _Protocol(asyncio.subprocess.SubprocessStreamProtocol):
    """asyncio's protocol, plus an event set when the program exits (``Process.wait`` also waits for its pipes to
    close on some Python versions: a background child holding them would hold the call)."""

    def __init__(self, loop):
        super().__init__(limit=_CHUNK, loop=loop)
        self.exited = asyncio.Event()

    def process_exited(self) -> None:
        super().process_exited()
        self.exited.set()


async def run_command(argv: list[str], stdin: bytes, env: dict, timeout_s: float, *,
                      max_output: int = MAX_OUTPUT) -> CommandResult:
    """Run ``argv`` with ``stdin`` (see the module docstring). ``OSError`` when it cannot start."""
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.subprocess_exec(lambda: _Protocol(loop), *argv, stdin=subprocess.PIPE,
                                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                                     start_new_session=True)
    proc = asyncio.subprocess.Process(transport, protocol, loop)
    out, err = _Tail(max_output), _Tail(STDERR_TAIL)
    readers = [asyncio.ensure_future(out.read(proc.stdout)), asyncio.ensure_future(err.read(proc.stderr))]
    timed_out = False
    try:
        try:
            await asyncio.wait_for(_feed_and_wait(proc, protocol, stdin), timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
    finally:
        kill_group(proc.pid)  # the program's children too, whether it finished, timed out or was cancelled
        await asyncio.wait([asyncio.ensure_future(protocol.exited.wait())], timeout=DRAIN_S)
        await _drain(readers)
        transport.close()
    return CommandResult(None if timed_out else transport.get_returncode(), bytes(out.data), bytes(err.data),
                         timed_out, out.total)


async def _feed_and_wait(proc, protocol: _Protocol, data: bytes) -> None:
    """Write ``data`` to the program's stdin, close it, wait for the program (not its pipes) to exit."""
    try:
        proc.stdin.write(data)
        await proc.stdin.drain()
    except (BrokenPipeError, ConnectionResetError):  # it exited (or closed stdin) without reading it all
        pass
    finally:
        proc.stdin.close()
    await protocol.exited.wait()


async def _drain(readers: list) -> None:
    """Let the readers take what is left in the pipes (at most ``DRAIN_S``), then stop them."""
    done, pending = await asyncio.wait(readers, timeout=DRAIN_S)
    for task in pending:
        task.cancel()
    for task in done:
        task.exception()  # a reader's error (a closed pipe) is not the program's
