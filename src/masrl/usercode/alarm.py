"""A deadline by ``ITIMER_REAL`` for a call in the main thread: for library code that cannot be moved to a worker
(math-verify's sympy work holds the GIL, so a thread's deadline could not stop it). Outside the main thread, or where
the platform has no ``setitimer``, the call runs without one. Any timer already set (pytest-timeout's) gets its
remaining time back afterwards."""
from __future__ import annotations

import signal
import threading
import time

__all__ = ["AlarmTimeout", "call_with_alarm"]


class AlarmTimeout(BaseException):
    """Raised by the alarm's handler; a BaseException so that the library's ``except Exception`` lets it through."""


def call_with_alarm(fn, seconds: float | None):
    """Run ``fn()`` under an ITIMER_REAL alarm of ``seconds`` when in the main thread (else without one)."""
    if (seconds is None or seconds <= 0 or threading.current_thread() is not threading.main_thread()
            or not hasattr(signal, "setitimer")):
        return fn()

    def handler(signum, frame):
        raise AlarmTimeout()

    try:
        old_handler = signal.signal(signal.SIGALRM, handler)
    except ValueError:  # not the main interpreter
        return fn()
    start = time.monotonic()
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay > 0:  # give the previous timer (e.g. pytest-timeout) its remaining time back
            remaining = max(old_delay - (time.monotonic() - start), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, remaining, old_interval)
