"""The harness's ends of one sandboxed process's pipes: stdout and stderr read with a cap, stdin
fed without blocking, and (serve mode) length-prefixed request and response frames."""
from __future__ import annotations

import json
import marshal
import os
import re
import selectors
import subprocess
import time
from typing import Callable

from masrl.sandbox.base import Died

__all__ = ["Pipes", "json_items"]


class Pipes:
    """Pump one process's pipes with caps. ``kill(reason)`` stops the process when a cap is hit or a
    deadline passes; the method that noticed then raises ``Died``."""

    def __init__(self, *, max_output_bytes: int, max_message_bytes: int, max_message_items: int,
                 kill: Callable[[str], None]):
        self.max_output_bytes = max_output_bytes
        self.max_message_bytes = max_message_bytes
        self.max_message_items = max_message_items
        self.kill = kill
        self.out = {"stdout": bytearray(), "stderr": bytearray()}
        self.open_streams: set[str] = set()
        self.truncated = False
        self.frames = bytearray()
        self.resp_eof = False
        self.req_fd: int | None = None
        self.sel: selectors.BaseSelector | None = None
        self._stdin = None
        self._stdin_buf = memoryview(b"")

    def attach(self, proc: subprocess.Popen, *, stdin: bytes | None, req_fd: int | None, resp_fd: int | None) -> None:
        """Start watching ``proc``'s stdout/stderr (and the frame pipes), and feed it ``stdin``."""
        self.sel = selectors.DefaultSelector()
        for name, f in (("stdout", proc.stdout), ("stderr", proc.stderr)):
            os.set_blocking(f.fileno(), False)
            self.sel.register(f.fileno(), selectors.EVENT_READ, name)
            self.open_streams.add(name)
        self.req_fd = req_fd
        if resp_fd is not None:
            os.set_blocking(resp_fd, False)
            self.sel.register(resp_fd, selectors.EVENT_READ, "resp")
        if stdin is not None:
            self._stdin, self._stdin_buf = proc.stdin, memoryview(stdin)
            os.set_blocking(proc.stdin.fileno(), False)
            if self._stdin_buf:
                self.sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE, "stdin")
            else:
                proc.stdin.close()

    def watching(self) -> bool:
        """Is any pipe still open to read or write?"""
        return self.sel is not None and bool(self.sel.get_map())

    def pump(self, timeout: float) -> None:
        """Move what is ready within ``timeout`` seconds; raises ``Died`` over a cap."""
        if self.sel is None:
            return
        cap = self.max_output_bytes
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
                    self._stdin.close()
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
                if len(self.frames) > self.max_message_bytes + 4:
                    self.kill("output_limit")
                    raise Died("output_limit", "result message over the size limit")
                continue
            buf = self.out[name]
            room = cap - len(buf)
            buf += data[:max(0, room)]
            if len(data) > room:
                self.truncated = True
                self.kill("output_limit")
                raise Died("output_limit", f"{name} over {cap} bytes")

    def next_frame(self, deadline: float) -> dict:
        """Wait for one response frame (serve mode)."""
        while True:
            if len(self.frames) >= 4:
                n = int.from_bytes(self.frames[:4], "big")
                if n > self.max_message_bytes:
                    self.kill("output_limit")
                    raise Died("output_limit", "result message over the size limit")
                if len(self.frames) >= 4 + n:
                    body = bytes(self.frames[4:4 + n])
                    del self.frames[:4 + n]
                    return self._decode_frame(body)
            if self.resp_eof:
                raise Died("exited", "the sandboxed process exited")
            now = time.monotonic()
            if now >= deadline:
                self.kill("timeout")
                raise Died("timeout")
            self.pump(min(deadline - now, 0.25))
            if not self.watching() and not self.resp_eof:
                time.sleep(0.01)

    def _decode_frame(self, body: bytes) -> dict:
        """One response frame as a dict; its item count is checked before anything is built
        (a 15 MiB frame of ``{},`` would otherwise cost some 400 MiB to decode)."""
        items = json_items(body, self.max_message_items)
        if items > self.max_message_items:
            self.kill("protocol_error")
            raise Died("protocol_error", f"message with {items} items (the limit is {self.max_message_items})")
        try:
            msg = json.loads(body.decode("utf-8", "surrogatepass"))
            if not isinstance(msg, dict):
                raise ValueError("not an object")
            return msg
        except (ValueError, RecursionError, MemoryError):
            self.kill("protocol_error")
            raise Died("protocol_error", "malformed message from the sandbox") from None

    def send(self, obj: dict, deadline: float) -> None:
        """Write one request (serve mode), draining the outputs meanwhile; never blocks past
        ``deadline`` even if the child stops reading (e.g. it SIGSTOPped itself)."""
        data = marshal.dumps(obj)
        view = memoryview(len(data).to_bytes(4, "big") + data)
        fd = self.req_fd
        os.set_blocking(fd, False)
        while view:
            try:
                view = view[os.write(fd, view):]
                continue
            except BlockingIOError:
                pass
            except (BrokenPipeError, OSError):
                raise Died("exited", "the sandboxed process exited") from None
            now = time.monotonic()
            if now >= deadline:
                self.kill("timeout")
                raise Died("timeout")
            self.sel.register(fd, selectors.EVENT_WRITE, "req")
            try:
                self.pump(min(deadline - now, 0.25))
            finally:
                self.sel.unregister(fd)

    def drain(self) -> None:
        """Read whatever output is left without blocking (after the process ended)."""
        try:
            for _ in range(64):
                if not self.watching():
                    break
                before = sum(len(b) for b in self.out.values())
                self.pump(0)
                if sum(len(b) for b in self.out.values()) == before:
                    break
        except Died:
            pass

    def text(self, name: str) -> str:
        return bytes(self.out[name]).decode("utf-8", errors="replace")

    def close(self) -> None:
        if self.sel is not None:
            try:
                self.sel.close()
            except Exception:
                pass
            self.sel = None


_JSON_STRING = re.compile(rb'"[^"]*"')  # a string once its escapes are gone


def json_items(body: bytes, budget: int) -> int:
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
