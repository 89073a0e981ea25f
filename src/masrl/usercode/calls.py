"""A call of user code in a thread, with a deadline on the whole call (docs/reliability.md, "User code").

``call_in_thread`` (from synchronous code) and ``call_async`` (awaited on masrl's event loop, which it
never blocks) run ``fn(*args)`` in a worker thread of the code (``what``): a daemon thread that runs one call at a
time and, once its call has returned, waits for the code's next call (a thread is started only when every worker of
the code is busy, so calls made one after another, such as a reward's, run in the same thread and cost no thread
start, and concurrent calls, such as the tools of many episodes, each get one). An ``async def`` runs on an event
loop of its own in a thread of its own (``call_async``: one loop per piece of code, shared by its concurrent calls,
so a client it keeps per loop is made once; ``call_in_thread``: one loop per call), so a coroutine that blocks
(``time.sleep``, a synchronous client inside it) cannot freeze masrl's loop and its deadline fires; a shared loop
whose call ran past its deadline is retired (it stops once its calls have ended) and the next call gets a new
one. Anything the code raises, ``SystemExit`` and ``KeyboardInterrupt`` included, comes back as an
``Exception`` (``UserCodeExit`` for the two that are not one): it never ends the run.

Python cannot stop a thread: a call past its deadline raises ``UserCodeTimeout`` and its worker is abandoned
(it ends once the call returns, its result dropped; an ``async def`` is cancelled on its own loop, which ends it
at its next ``await``). ``abandoned`` counts those still running per kind; once ``max_abandoned`` of one kind
are (``MAX_ABANDONED`` unless the caller gives its own bound), further calls of that kind are refused at once
(``UserCodeRefused``, a ``UserCodeTimeout``) instead of piling up threads.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import queue
import threading
from typing import Any, Callable

MAX_ABANDONED = 64  # calls of one kind still running past their deadline; beyond this, calls are refused
MAX_IDLE = 64  # idle workers kept per piece of code (more retire once their call returns)
_LOCK = threading.Lock()
_ABANDONED: dict[str, list[threading.Thread]] = {}


class UserCodeTimeout(Exception):
    """A call of user code ran past its deadline (or was refused: too many of its kind still run past theirs)."""


class UserCodeRefused(UserCodeTimeout):
    """A call not made: too many calls of its kind still run past their deadline (``max_abandoned``)."""


class UserCodeExit(RuntimeError):
    """User code raised ``SystemExit`` or ``KeyboardInterrupt`` (or another ``BaseException``): a failed call,
    never the end of the run."""


def contained(error: BaseException, what: str) -> Exception:
    """``error`` itself when it is an ``Exception``; else a ``UserCodeExit`` naming it (``sys.exit(0)``
    inside ``what``), with its traceback."""
    if isinstance(error, Exception):
        return error
    if isinstance(error, SystemExit):
        text = f"{what} called sys.exit({error.code!r}); user code must return, not exit"
    else:
        text = f"{what} raised {type(error).__name__}({error})"
    return UserCodeExit(text).with_traceback(error.__traceback__)


def abandoned(kind: str) -> int:
    """Calls of ``kind`` still running past their deadline, in this process."""
    with _LOCK:
        threads = _ABANDONED.setdefault(kind, [])
        threads[:] = [t for t in threads if t.is_alive()]
        return len(threads)


def abandon(kind: str, thread: threading.Thread) -> None:
    """Count ``thread`` among the calls of ``kind`` running past their deadline (``abandoned``)."""
    with _LOCK:
        _ABANDONED.setdefault(kind, []).append(thread)


def _check_room(kind: str, max_abandoned: int | None) -> None:
    if max_abandoned is not None and (running := abandoned(kind)) >= max_abandoned:
        raise UserCodeRefused(f"not called: {running} earlier {kind} calls are still running past their deadline")


class _Worker:
    """A daemon thread of one piece of code: runs its calls one at a time, and between them waits for the next."""

    def __init__(self, key: tuple[str, str]):
        self.key = key
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name=f"masrl-usercode {key[1]}"[:60], daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while (call := self.jobs.get()) is not None:
            call.run()
            if not _returned(self, call):
                return  # abandoned past its deadline, or too many idle: this worker ends


_IDLE: dict[tuple[str, str], list[_Worker]] = {}


def _returned(worker: _Worker, call: "_Call") -> bool:
    """The worker's call has ended: back among the code's idle workers, unless the call was abandoned (its
    worker ends now) or enough are idle already."""
    with _LOCK:
        call.finished = True
        idle = _IDLE.setdefault(worker.key, [])
        if call.abandoned or len(idle) >= MAX_IDLE:
            return False
        idle.append(worker)
        return True


def _start(call: "_Call", kind: str) -> None:
    """``call`` on an idle worker of its code, or on a new one."""
    key = (kind, call.what)
    with _LOCK:
        idle = _IDLE.get(key)
        worker = idle.pop() if idle else None
    if worker is None:
        worker = _Worker(key)
    call.thread = worker.thread
    worker.jobs.put(call)


def _give_up(call: "_Call", kind: str) -> bool:
    """Past the deadline: abandon ``call`` (counted, its worker ends once it returns; an ``async def`` is cancelled
    on its own loop); False when it finished meanwhile (its worker is idle again, nothing to abandon)."""
    with _LOCK:
        if call.finished:
            return False
        call.abandoned = True
        _ABANDONED.setdefault(kind, []).append(call.thread)
    call.cancel()
    return True


class _Call:
    """One call: runs ``fn(*args)`` (an ``async def`` on a loop of its own) in a worker and hands the outcome to
    ``settle(value, error)``."""

    def __init__(self, fn: Callable, args: tuple, what: str, settle: Callable[[Any, BaseException | None], None]):
        self.fn, self.args, self.what, self.settle = fn, args, what, settle
        self.loop: asyncio.AbstractEventLoop | None = None
        self.task: asyncio.Task | None = None
        self.thread: threading.Thread | None = None
        self.finished = self.abandoned = False

    def run(self) -> None:
        try:
            value = self.fn(*self.args)
            if inspect.isawaitable(value):
                value = self._await(value)
            outcome: tuple[Any, BaseException | None] = (value, None)
        except BaseException as e:  # noqa: BLE001 - SystemExit, KeyboardInterrupt in user code: a failed call
            outcome = (None, contained(e, self.what))
        self.fn = self.args = None  # the worker keeps no reference to the call's objects
        self.settle(*outcome)

    def _await(self, awaitable) -> Any:
        loop = self.loop = asyncio.new_event_loop()  # the code's own loop: blocking it blocks only this thread
        try:
            self.task = loop.create_task(_as_coroutine(awaitable))
            return loop.run_until_complete(self.task)
        finally:
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()
                self.loop = self.task = None

    def cancel(self) -> None:
        """Past the deadline: cancel an ``async def`` on its own loop (it ends at its next ``await``)."""
        loop, task = self.loop, self.task
        if loop is not None and task is not None:
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # its loop is already closed: the call has ended
                pass


async def _as_coroutine(awaitable) -> Any:
    return await awaitable


def _timeout(what: str, timeout_s: float) -> UserCodeTimeout:
    return UserCodeTimeout(f"{what} did not return within {timeout_s:g} s")


def call_in_thread(fn: Callable, args: tuple, timeout_s: float, *, kind: str, what: str,
                   max_abandoned: int | None = MAX_ABANDONED) -> Any:
    """``fn(*args)`` in a worker thread of ``what``; its value, or what it raised (contained, see ``contained``);
    ``UserCodeTimeout`` after ``timeout_s`` seconds (the call is abandoned). ``kind`` counts abandoned calls
    (``abandoned``), ``what`` names the code in messages and owns the workers."""
    _check_room(kind, max_abandoned)
    done, box = threading.Event(), {}

    def settle(value, error):
        box["value"], box["error"] = value, error
        done.set()

    call = _Call(fn, args, what, settle)
    _start(call, kind)
    if not done.wait(timeout_s) and _give_up(call, kind):
        raise _timeout(what, timeout_s)
    done.wait()  # (set: it finished just as the deadline passed)
    if box["error"] is not None:
        raise box["error"]
    return box["value"]


class _Loop:
    """An event loop running in a daemon thread of its own, shared by the concurrent calls of one ``async def``."""

    def __init__(self, kind: str, what: str):
        self.kind, self.what, self.running, self.retired = kind, what, 0, False
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._serve, name=f"masrl-usercode-loop {what}"[:60], daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    def submit(self, fn: Callable, args: tuple) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(self._counted(fn, args), self.loop)

    async def _counted(self, fn: Callable, args: tuple) -> Any:
        self.running += 1
        try:
            return await fn(*args)
        except (SystemExit, KeyboardInterrupt) as e:  # they would end the loop (asyncio re-raises them): contain
            raise contained(e, self.what) from None
        finally:
            self.running -= 1
            if self.retired and not self.running:
                self.loop.stop()

    def retire(self) -> None:
        """No new calls: stop once the calls still running have ended (counted as abandoned until then)."""
        self.retired = True
        abandon(self.kind, self.thread)
        try:
            self.loop.call_soon_threadsafe(lambda: self.running or self.loop.stop())
        except RuntimeError:  # already closed
            pass


_LOOPS: dict[tuple[str, str], _Loop] = {}


def _loop_for(kind: str, what: str) -> _Loop:
    with _LOCK:
        shared = _LOOPS.get((kind, what))
        if shared is None or shared.retired or not shared.thread.is_alive():
            shared = _LOOPS[(kind, what)] = _Loop(kind, what)
        return shared


def _retire(shared: _Loop) -> None:
    with _LOCK:
        if _LOOPS.get((shared.kind, shared.what)) is shared:
            del _LOOPS[(shared.kind, shared.what)]
    if not shared.retired:
        shared.retire()


async def _call_on_loop(fn: Callable, args: tuple, timeout_s: float | None, kind: str, what: str) -> Any:
    shared = _loop_for(kind, what)
    future = asyncio.wrap_future(shared.submit(fn, args))
    try:
        return await asyncio.wait_for(future, timeout_s)
    except asyncio.TimeoutError:  # wait_for cancelled the call on its loop (it ends at its next await)
        _retire(shared)  # a loop that may be blocked serves no new call
        raise _timeout(what, timeout_s) from None


async def call_async(fn: Callable, args: tuple, timeout_s: float | None, *, kind: str, what: str,
                     max_abandoned: int | None = MAX_ABANDONED) -> Any:
    """``call_in_thread`` awaited on the running loop, which keeps running meanwhile (every episode of a
    rollout runs at once: no shared pool leaves calls queued). ``timeout_s`` None: no deadline here (for
    masrl's own code that keeps the user code's deadline itself)."""
    _check_room(kind, max_abandoned)
    if inspect.iscoroutinefunction(fn):
        return await _call_on_loop(fn, args, timeout_s, kind, what)
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle_here(value, error):
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(value)

    def settle(value, error):
        try:
            loop.call_soon_threadsafe(settle_here, value, error)
        except RuntimeError:  # the caller's loop is closed: the call was given up
            pass

    call = _Call(fn, args, what, settle)
    _start(call, kind)
    try:
        return await asyncio.wait_for(future, timeout_s)
    except asyncio.TimeoutError:
        _give_up(call, kind)
        raise _timeout(what, timeout_s) from None
    except asyncio.CancelledError:  # the caller gave the call up (its episode was cancelled)
        _give_up(call, kind)
        raise
