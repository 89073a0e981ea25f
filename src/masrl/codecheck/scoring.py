"""The code reward's harness: run a model's program in the sandbox and check it against hidden tests.

The tests are *evaluated outside the untrusted process*. The candidate program runs in a
sandboxed process that only answers requests ("call this function with these arguments",
"get this attribute"); results come back as plain data (numbers, strings, containers) through
a pipe. The test code itself (MBPP asserts, HumanEval's ``check``) runs in the harness, in a
namespace where the candidate's functions are ``RemoteRef`` proxies. So the expected
values never enter the untrusted process, and nothing the candidate does (``sys.exit(0)``,
``os._exit``, printing "PASSED", patching builtins, objects whose ``__eq__`` always returns
True, ...) can make a test pass: it would have to return the right values. See
docs/sandbox.md.

    score_code(task, "```python\\ndef add(a, b):\\n    return a + b\\n```")
    # {"reward": 1.0, "correct": True, "reason": "ok", "passed": 3, "total": 3, ...}

``mode="fraction"``: reward = passed / total; ``mode="all"``: reward 1 only if every test passes
(stops at the first failure). ``correct`` is always "every test passed".

Tests: MBPP: each assert of ``test_list`` (``test_setup_code`` runs in the sandbox after the
program). HumanEval: each ``assert`` statement of ``check`` (an assert inside a loop is one test
and passes only if it holds in every iteration and the loop ran to its end; ``assert True``
lines are not counted; when ``check`` stops on an error, every assert it had not finished fails).
"""
from __future__ import annotations

import ast
import builtins
import copy
import functools
import hashlib
import importlib
import json
import logging
import sys
import threading
import time
import warnings
from collections import OrderedDict
from typing import Any, Sequence

from masrl.sandbox import (CodecError, Died, Limits, Proc, Sandbox, SandboxError, decode_value, default_sandbox,
                           encode_value)
from masrl.codecheck.extract import extract_code
from masrl.types import Task

__all__ = ["score_code", "score_many", "make_code_score", "ScoreCache", "RemoteRef", "CandidateError", "SandboxFailure",
           "free_names"]

log = logging.getLogger(__name__)
MODES = ("fraction", "all")


def free_names(trees: list[ast.AST]) -> list[str]:
    """Names read but never bound inside the given test snippets, in first-use order."""
    bound: set[str] = set()
    used: list[str] = []
    for tree in trees:
        for n in ast.walk(tree):
            if isinstance(n, ast.Name):
                if isinstance(n.ctx, ast.Load):
                    if n.id not in used:
                        used.append(n.id)
                else:
                    bound.add(n.id)
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bound.add(n.name)
            elif isinstance(n, ast.arg):
                bound.add(n.arg)
            elif isinstance(n, (ast.Import, ast.ImportFrom)):
                for a in n.names:
                    bound.add((a.asname or a.name).split(".")[0])
            elif isinstance(n, ast.ExceptHandler) and n.name:
                bound.add(n.name)
    return [u for u in used if u not in bound]


class CandidateError(Exception):
    """An exception raised inside the sandbox that has no builtin counterpart."""


class SandboxFailure(Exception):
    """The sandboxed process timed out, died, exceeded a limit or misbehaved during a call."""

    def __init__(self, status: str, detail: str = ""):
        super().__init__(f"{status}: {detail}" if detail else status)
        self.status = status
        self.detail = detail


class _LoadFailed(Exception):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


# --------------------------------------------------------------------------------------
# proxies for objects living in the sandbox
# --------------------------------------------------------------------------------------
class RemoteRef:
    """An object inside the sandbox (a function, class or instance of the candidate program).

    Calls and attribute reads go to the sandbox and return plain data (or another RemoteRef).
    It is opaque otherwise: it equals only the same reference, and has no truth value, length
    or iteration, so an object with a rigged ``__eq__``/``__bool__`` cannot satisfy a test.
    """

    __slots__ = ("_session", "_node", "_gen")

    def __init__(self, session: "_Session", node: list, gen: int | None):
        object.__setattr__(self, "_session", session)
        object.__setattr__(self, "_node", node)
        object.__setattr__(self, "_gen", gen)  # None for names (valid across restarts)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return object.__getattribute__(self, "_session").call(self, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return object.__getattribute__(self, "_session").getattr(self, name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise TypeError("cannot set attributes on an object inside the sandbox")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RemoteRef):
            return False
        g = object.__getattribute__
        return (g(self, "_session") is g(other, "_session") and g(self, "_node") == g(other, "_node")
                and g(self, "_gen") == g(other, "_gen"))

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        g = object.__getattribute__
        return hash((id(g(self, "_session")), tuple(g(self, "_node")), g(self, "_gen")))

    def __bool__(self) -> bool:
        raise TypeError("the truth value of an object inside the sandbox is not available to tests")

    def __repr__(self) -> str:
        node = object.__getattribute__(self, "_node")
        return f"<sandbox {'name ' + repr(node[1]) if node[0] == 'N' else 'object #' + str(node[1])}>"


def _map_exception(info: Any) -> BaseException:
    """An exception object for the judge from a ["TypeName", "message"] report."""
    if not (isinstance(info, list) and len(info) == 2 and all(isinstance(x, str) for x in info)):
        return SandboxFailure("protocol_error", "malformed exception report")
    name, msg = info
    cls = getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception) and cls.__module__ == "builtins" and \
            cls is not StopIteration and cls is not StopAsyncIteration:
        try:
            exc = cls(msg)
        except Exception:
            exc = CandidateError(f"{name}: {msg}")
    else:
        exc = CandidateError(f"{name}: {msg}" if msg else name)
    try:
        exc.masrl_candidate = True  # type: ignore[attr-defined]
        exc.masrl_type = name  # type: ignore[attr-defined]
    except AttributeError:  # pragma: no cover
        pass
    return exc


# --------------------------------------------------------------------------------------
# one candidate program in a (restartable) serve-mode sandbox
# --------------------------------------------------------------------------------------
class _Session:
    def __init__(self, sb: Sandbox, limits: Limits, program: str, setup: str, *, timeout_s: float,
                 load_timeout_s: float, deadline: float, max_restarts: int, startup_timeout_s: float = 30.0):
        self.sb, self.limits = sb, limits
        self.program, self.setup = program, setup
        self.timeout_s, self.load_timeout_s = timeout_s, load_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.deadline = deadline
        self.max_restarts = max_restarts
        self.proc: Proc | None = None
        self.gen = 0
        self.seq = 0
        self.starts = 0
        self.stdout = ""

    # -- life cycle --------------------------------------------------------------------
    def start(self) -> None:
        """Start a process and load the program; raises _LoadFailed or SandboxError."""
        self.starts += 1
        self.gen += 1
        self.seq = 0
        proc = Proc(self.sb, self.limits, mode="serve")
        self.proc = proc
        try:
            proc.start()
        except OSError as e:
            self.discard()
            raise SandboxError(f"cannot start the sandbox: {e}") from e
        try:
            hello = proc.next_frame(time.monotonic() + self.startup_timeout_s)
        except Died as e:
            self.discard()
            raise SandboxError(f"the sandbox did not come up ({e.status})") from None
        if hello.get("seq") != -1:
            self.discard()
            raise SandboxError("the sandbox did not come up (no hello)")
        now = time.monotonic()
        try:
            resp = self._exchange({"op": "load", "code": self.program, "setup": self.setup, "filename": "<candidate>"},
                                  min(now + self.load_timeout_s, max(self.deadline, now + 0.5)))
        except SandboxFailure as e:
            self.discard()
            raise _LoadFailed("load_" + e.status, e.detail) from None
        if "raise" in resp:
            info = resp["raise"]
            phase = resp.get("phase")
            self.discard()
            name, msg = (info + ["", ""])[:2] if isinstance(info, list) else ("?", "")
            if phase == "compile" and name in ("SyntaxError", "IndentationError", "TabError", "ValueError"):
                raise _LoadFailed("syntax_error", f"{name}: {msg}")
            if name == "MemoryError":
                raise _LoadFailed("load_memory", f"{name}: {msg}")
            raise _LoadFailed("load_error", f"{name}: {msg}" + (f" (in {phase})" if phase else ""))
        if resp.get("ok") is not True:
            self.discard()
            raise _LoadFailed("load_protocol_error", "unexpected reply to load")

    def discard(self) -> None:
        if self.proc is not None:
            proc, self.proc = self.proc, None
            try:
                proc.stop()
                self.stdout = proc.text("stdout")[-2000:]
            finally:
                proc.close()

    close = discard

    def _exchange(self, msg: dict, deadline: float) -> dict:
        proc = self.proc
        self.seq += 1
        msg["seq"] = self.seq
        try:
            proc.send(msg, deadline)
            resp = proc.next_frame(deadline)
        except Died as e:
            oom = e.status == "exited" and proc.oom_killed()
            self.discard()
            status = "memory" if oom else {"exited": "crashed"}.get(e.status, e.status)
            if status == "timeout" and deadline >= self.deadline:
                status = "deadline"
            raise SandboxFailure(status, e.detail) from None
        if resp.get("seq") != self.seq:
            self.discard()
            raise SandboxFailure("protocol_error", "reply out of sequence")
        return resp

    def _request(self, msg: dict) -> dict:
        now = time.monotonic()
        if now >= self.deadline:
            raise SandboxFailure("deadline", "the scoring time budget is spent")
        if self.proc is None:
            if self.starts > self.max_restarts:
                raise SandboxFailure("restart_limit", "too many restarts")
            try:
                self.start()
            except _LoadFailed as e:
                raise SandboxFailure("reload_failed", str(e)) from None
        return self._exchange(msg, min(time.monotonic() + self.timeout_s, self.deadline))

    # -- operations ------------------------------------------------------------------------
    def _encode_ref(self, obj: Any) -> list | None:
        if isinstance(obj, RemoteRef):
            g = object.__getattribute__
            if g(obj, "_session") is not self:
                return None
            gen = g(obj, "_gen")
            if gen is not None and gen != self.gen:
                raise SandboxFailure("stale_object", "object from a sandbox that was restarted")
            return g(obj, "_node")
        return None

    def _decode_ref(self, node: list) -> RemoteRef:
        if node[0] != "R" or type(node[1]) is not int:
            raise CodecError("invalid reference from the sandbox")
        return RemoteRef(self, ["R", node[1]], self.gen)

    def _target(self, ref: RemoteRef) -> list:
        node = self._encode_ref(ref)
        if self.proc is None and object.__getattribute__(ref, "_gen") is not None:
            raise SandboxFailure("stale_object", "object from a sandbox that was restarted")
        return node

    def _encode_args(self, args: tuple, kwargs: dict) -> tuple[list, list]:
        try:
            a = encode_value(list(args), self._encode_ref)
            k = encode_value(dict(kwargs), self._encode_ref)
        except CodecError as e:
            raise TypeError(f"argument cannot be sent to the sandbox: {e}") from None
        return a, k

    def _value(self, resp: dict) -> Any:
        if "raise" in resp:
            raise _map_exception(resp["raise"])
        if "value" not in resp:
            self.discard()
            raise SandboxFailure("protocol_error", "reply without a value")
        try:
            return decode_value(resp["value"], self._decode_ref)
        except (CodecError, RecursionError) as e:
            self.discard()
            raise SandboxFailure("protocol_error", f"undecodable value: {e}") from None

    def call(self, ref: RemoteRef, args: tuple, kwargs: dict) -> Any:
        target = self._target(ref)
        a, k = self._encode_args(args, kwargs)
        resp = self._request({"op": "call", "target": target, "args": a, "kwargs": k})
        value = self._value(resp)
        after = resp.get("after")
        if isinstance(after, list):  # in-place changes of list/dict/set/bytearray arguments
            for item in after[:len(args)]:
                try:
                    i, node = item
                    new = decode_value(node, self._decode_ref)
                    old = args[i]
                except (CodecError, RecursionError, TypeError, ValueError, IndexError):
                    continue
                if type(old) is type(new) and type(old) in (list, bytearray):
                    old[:] = new
                elif type(old) is type(new) and type(old) in (dict, set):
                    old.clear()
                    old.update(new)
        return value

    def getattr(self, ref: RemoteRef, name: str) -> Any:
        target = self._target(ref)
        return self._value(self._request({"op": "getattr", "target": target, "name": name}))


# --------------------------------------------------------------------------------------
# test programs (trusted dataset code), compiled once per task
# --------------------------------------------------------------------------------------
class _Recorder:
    class Abort(Exception):
        """Stop the check (mode "all" after a failure)."""

    def __init__(self, n: int, stop_on_fail: bool):
        # None: not reached; "held": held every time so far, its statement not finished yet;
        # True/False: final
        self.status: list[bool | str | None] = [None] * n
        self.reasons: list[str] = [""] * n
        self.stop_on_fail = stop_on_fail

    def begin(self, i: int) -> None:
        pass

    def ok(self, i: int) -> None:
        if self.status[i] is None:
            self.status[i] = "held"

    def settle(self, ids: tuple[int, ...]) -> None:
        """The statement holding asserts ``ids`` finished (its loops ran to the end): the ones
        that held every time pass."""
        for i in ids:
            if self.status[i] == "held":
                self.status[i] = True

    def finish(self, completed: bool, why: str) -> None:
        """``check`` returned (``completed``) or stopped: asserts still open pass only if it returned."""
        for i, st in enumerate(self.status):
            if st == "held" and completed:
                self.status[i] = True
            elif st is None or st == "held":
                self.status[i] = False
                self.reasons[i] = why

    def fail(self, i: int, exc: BaseException) -> None:
        if self.status[i] is not False:
            self.status[i] = False
            self.reasons[i] = _reason(exc)
        if self.stop_on_fail:
            raise self.Abort()


def _reason(exc: BaseException) -> str:
    if isinstance(exc, SandboxFailure):
        return exc.status + (f": {exc.detail}" if exc.detail else "")
    if getattr(exc, "masrl_candidate", False):
        name = getattr(exc, "masrl_type", type(exc).__name__)
        if name == "MemoryError":
            return "memory"
        return f"exception: {name}: {str(exc)[:300]}"
    if type(exc) is AssertionError:
        return "wrong_answer"
    return f"error: {type(exc).__name__}: {str(exc)[:300]}"


def _private_random() -> Any:
    """A ``random`` module of the judge's own: test code that draws random inputs (HumanEval)
    must not advance or reseed the trainer's global generator."""
    import random
    import types

    rng = random.Random()
    mod = types.ModuleType("random")
    for name in dir(random):
        if not name.startswith("_"):
            attr = getattr(random, name)
            bound = getattr(rng, name, None)
            setattr(mod, name, bound if callable(bound) and not isinstance(attr, type) else attr)
    return mod


def _judge_namespace() -> dict:
    real_import = builtins.__import__
    rand = _private_random()

    def judge_import(name, globals=None, locals=None, fromlist=(), level=0):
        if name == "random" and level == 0:
            return rand
        return real_import(name, globals, locals, fromlist, level)

    b = dict(builtins.__dict__)
    b["__import__"] = judge_import
    return {"__builtins__": b, "__name__": "__masrl_judge__"}


def _resolve_free(ns: dict, names: list[str], remote: set[str], session: _Session) -> None:
    """Bind the names test code reads: candidate names -> RemoteRef, stdlib modules -> the
    judge's own import, builtins stay builtins; anything else is looked up in the sandbox."""
    for name in names:
        if name in ns:
            continue
        if name in remote:
            ns[name] = RemoteRef(session, ["N", name], None)
        elif hasattr(builtins, name):
            continue
        elif name in sys.stdlib_module_names:
            try:
                ns[name] = ns["__builtins__"]["__import__"](name) if "." not in name else importlib.import_module(name)
            except ImportError:
                ns[name] = RemoteRef(session, ["N", name], None)
        else:
            ns[name] = RemoteRef(session, ["N", name], None)


_WARN_LOCK = threading.Lock()


@functools.lru_cache(maxsize=4096)
def _prepare_mbpp(tests: tuple[str, ...], remote: tuple[str, ...]) -> tuple[list, list[str], frozenset]:
    with _WARN_LOCK, warnings.catch_warnings():  # invalid escapes in dataset code
        warnings.simplefilter("ignore", (DeprecationWarning, SyntaxWarning))
        trees = [ast.parse(t) for t in tests]
        codes = [compile(tree, f"<test {i}>", "exec", dont_inherit=True, optimize=0) for i, tree in enumerate(trees)]
    return codes, free_names(trees), frozenset(remote)


class _Instrument(ast.NodeTransformer):
    """Each ``assert`` of ``check`` records its outcome and execution goes on. An assert passes
    only when the top-level statement of ``check`` holding it finished (so an assert inside a
    loop passes only when the loop ran to its end) or, inside a nested function, when ``check``
    returned; ``settle_statements`` adds the calls that say so."""

    def __init__(self) -> None:
        self.count = 0
        self.depth = 0  # nested function/class definitions inside check

    def visit_Assert(self, node: ast.Assert) -> ast.AST:
        if isinstance(node.test, ast.Constant) and node.test.value:
            return node  # `assert True` / `assert True, "..."` lines are not tests
        i = self.count
        self.count += 1
        if self.depth == 0:
            self.settled.append(i)
        wrapper = ast.parse(
            f"try:\n    __masrl_rec__.begin({i})\n    pass\n"
            f"except __masrl_rec__.Abort:\n    raise\n"
            f"except Exception as __masrl_exc__:\n    __masrl_rec__.fail({i}, __masrl_exc__)\n"
            f"else:\n    __masrl_rec__.ok({i})\n").body[0]
        wrapper.body[1] = node
        return ast.copy_location(wrapper, node)

    def _nested(self, node: ast.AST) -> ast.AST:
        self.depth += 1
        try:
            return self.generic_visit(node)
        finally:
            self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = visit_Lambda = _nested

    def settle_statements(self, check: ast.FunctionDef) -> None:
        """Instrument ``check``: after each of its top-level statements, settle its asserts."""
        body = []
        for stmt in check.body:
            self.settled: list[int] = []
            body.append(self.visit(stmt))
            if self.settled:
                call = ast.parse(f"__masrl_rec__.settle({tuple(self.settled)!r})").body[0]
                body.append(ast.copy_location(call, stmt))
        check.body = body


@functools.lru_cache(maxsize=1024)
def _prepare_humaneval(prompt: str, test: str, entry_point: str):
    with _WARN_LOCK, warnings.catch_warnings():
        warnings.simplefilter("ignore", (DeprecationWarning, SyntaxWarning))
        return _prepare_humaneval_inner(prompt, test)


def _prepare_humaneval_inner(prompt: str, test: str):
    prompt_code = compile(prompt, "<prompt>", "exec", dont_inherit=True, optimize=0)
    tree = ast.parse(test)
    inst = _Instrument()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "check":
            inst.settle_statements(node)
    ast.fix_missing_locations(tree)
    code = compile(tree, "<test>", "exec", dont_inherit=True, optimize=0)
    names = free_names([ast.parse(test)])
    return prompt_code, code, names, inst.count


def _run_mbpp(spec: dict, session: _Session, stop_on_fail: bool) -> _Recorder:
    tests = tuple(spec["tests"])
    remote = spec.get("remote_names")
    if remote is None:
        remote = [spec["entry_point"]] if spec.get("entry_point") else []
    codes, names, remote_set = _prepare_mbpp(tests, tuple(remote))
    ns: dict[str, Any] = _judge_namespace()
    _resolve_free(ns, names, set(remote_set) | ({spec["entry_point"]} if spec.get("entry_point") else set()),
                  session)
    rec = _Recorder(len(codes), stop_on_fail)
    for i, code in enumerate(codes):
        try:
            exec(code, ns)
        except Exception as e:
            try:
                rec.fail(i, e)
            except _Recorder.Abort:
                break
        else:
            rec.ok(i)
            rec.settle((i,))
    return rec


def _run_humaneval(spec: dict, session: _Session, stop_on_fail: bool) -> _Recorder:
    entry = spec["entry_point"]
    prompt_code, test_code, names, n = _prepare_humaneval(spec["prompt"], spec["test"], entry)
    ns: dict[str, Any] = _judge_namespace()
    exec(prompt_code, ns)  # trusted: the helpers the tests use (poly, encode_cyclic, ...)
    candidate = RemoteRef(session, ["N", entry], None)
    ns[entry] = candidate
    _resolve_free(ns, names, {entry}, session)
    rec = _Recorder(max(n, 1), stop_on_fail)
    ns["__masrl_rec__"] = rec
    exec(test_code, ns)
    try:
        ns["check"](candidate)
    except _Recorder.Abort:
        rec.finish(False, "skipped")
    except Exception as e:
        # check stopped: an assert it did not finish (not reached, or inside a loop that did
        # not run to its end) fails
        check_error = _reason(e)
        if n == 0:
            rec.status[0], rec.reasons[0] = False, check_error
        rec.finish(False, f"not_reached ({check_error})")
    else:
        if n == 0:
            rec.status[0] = True
        rec.finish(True, "not_reached")
    return rec


# --------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------
def _program(spec: dict, code: str) -> tuple[str, str]:
    kind = spec.get("kind")
    if kind == "mbpp":
        return code, spec.get("setup") or ""
    if kind == "humaneval":
        prompt = spec["prompt"]
        return (prompt if prompt.endswith("\n") else prompt + "\n") + code, ""
    raise ValueError(f"unknown code task kind {kind!r}")


def _n_tests(spec: dict) -> int:
    if spec.get("kind") == "mbpp":
        return len(spec["tests"])
    return max(_prepare_humaneval(spec["prompt"], spec["test"], spec["entry_point"])[3], 1)


def _result(reward: float, correct: bool, reason: str, passed: int, total: int, tests: list, mode: str,
            t0: float, detail: str = "") -> dict:
    return {"reward": float(reward), "correct": bool(correct), "reason": reason, "passed": passed, "total": total,
            "tests": tests, "mode": mode, "duration_s": round(time.monotonic() - t0, 4), "detail": detail}


def score_code(task: Task, answer: str | None, mode: str = "fraction", *, sandbox: Sandbox | None = None,
               timeout_s: float = 5.0, load_timeout_s: float | None = None, total_timeout_s: float | None = None,
               memory_mb: int | None = None, extract: bool = True) -> dict:
    """Score ``answer`` (a model reply; the code is extracted from it) on ``task``'s hidden tests.

    ``timeout_s`` bounds each call into the candidate program (one MBPP test; one candidate
    call of a HumanEval check); ``load_timeout_s`` (default ``timeout_s``) bounds running the
    program's top level; ``total_timeout_s`` (default ``load + timeout_s * tests + 1``) bounds
    everything. Returns ``reward``, ``correct``, ``reason`` (``ok``, ``no_code``, ``syntax_error``,
    ``load_error``, ``load_timeout``, ``wrong_answer``, ``timeout``, ``tests_failed``, ...),
    ``passed``/``total``, per-test ``tests`` ({passed, reason}), ``duration_s`` and ``detail``.
    Never raises for anything the candidate does.
    """
    t0 = time.monotonic()
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    spec = task.answer
    if not isinstance(spec, dict) or spec.get("kind") not in ("mbpp", "humaneval"):
        raise ValueError(f"task {task.id!r} is not a code task (answer must be a dict with kind mbpp/humaneval)")
    total = _n_tests(spec)
    code = extract_code(answer) if extract else ("" if answer is None else str(answer))
    if not code.strip():
        tests = [{"passed": False, "reason": "no_code"} for _ in range(total)]
        return _result(0.0, False, "no_code", 0, total, tests, mode, t0)
    program, setup = _program(spec, code)
    sb = sandbox or default_sandbox()
    load_timeout = timeout_s if load_timeout_s is None else load_timeout_s
    budget = total_timeout_s if total_timeout_s is not None else load_timeout + timeout_s * total + 1.0
    limits = sb._limits(timeout_s=budget, memory_mb=memory_mb, cpu_s=budget + 1)
    try:
        sb.resolve()
    except SandboxError as e:
        raise SandboxError(f"code scoring needs a working sandbox: {e}") from e
    session = _Session(sb, limits, program, setup, timeout_s=timeout_s, load_timeout_s=load_timeout,
                       deadline=t0 + budget, max_restarts=total)
    try:
        try:
            session.start()
        except _LoadFailed as e:
            tests = [{"passed": False, "reason": e.reason} for _ in range(total)]
            return _result(0.0, False, e.reason, 0, total, tests, mode, t0, e.detail)
        except SandboxError as e:
            warnings.warn(f"sandbox failure while scoring {task.id}: {e}", RuntimeWarning, stacklevel=2)
            tests = [{"passed": False, "reason": "sandbox_error"} for _ in range(total)]
            return _result(0.0, False, "sandbox_error", 0, total, tests, mode, t0, str(e))
        runner = _run_mbpp if spec["kind"] == "mbpp" else _run_humaneval
        rec = runner(spec, session, stop_on_fail=(mode == "all"))
    finally:
        session.close()
    tests = []
    for st, why in zip(rec.status, rec.reasons):
        if st is True:
            tests.append({"passed": True, "reason": "ok"})
        else:
            tests.append({"passed": False, "reason": why or "skipped"})
    passed = sum(1 for t in tests if t["passed"])
    n = len(tests)
    correct = passed == n
    if mode == "all":
        reward = 1.0 if correct else 0.0
    else:
        reward = passed / n if n else 0.0
    if correct:
        reason = "ok"
    else:
        kinds = {t["reason"].split(":")[0].split(" (")[0] for t in tests if not t["passed"]} - {"skipped"}
        reason = kinds.pop() if len(kinds) == 1 else "tests_failed"
    detail = next((t["reason"] for t in tests if not t["passed"]), "")
    return _result(reward, correct, reason, passed, n, tests, mode, t0, detail)


def score_many(tasks: Sequence[Task], answers: Sequence[str | None], mode: str = "fraction", *,
               sandbox: Sandbox | None = None, **kwargs: Any) -> list[dict]:
    """Score several (task, answer) pairs in parallel on ``sandbox``'s pool, in order."""
    if len(tasks) != len(answers):
        raise ValueError(f"tasks and answers must have the same length ({len(tasks)} != {len(answers)})")
    sb = sandbox or default_sandbox()
    return sb.map(lambda ta: score_code(ta[0], ta[1], mode=mode, sandbox=sb, **kwargs), zip(tasks, answers))


# per-test reasons whose outcome depends on the program's text alone (not on load, timing or memory): results made
# of these alone are kept by ScoreCache
_STABLE_TEST_REASONS = ("ok", "wrong_answer", "skipped", "no_code", "syntax_error", "load_error")
DEFAULT_CACHE_ENTRIES = 4096


def _stable(result: dict) -> bool:
    """Whether ``result`` would come out the same for the same program on another run: every test passed, failed
    an assertion, raised (not a ``MemoryError``), or the program did not compile / load. Timeouts, memory and
    output limits, killed processes and sandbox failures depend on the machine's load and are never kept."""
    for t in result.get("tests", ()):
        why = str(t.get("reason", ""))
        if why in _STABLE_TEST_REASONS or (why.startswith("exception: ") and not why.startswith("exception: Memory")):
            continue
        return False
    return True


class ScoreCache:
    """Results of (hidden tests, program, scoring options) already run, least recently used dropped past
    ``max_entries``; thread-safe. In a GRPO group many samples are the same program (2/3 of the sandbox
    executions of a code Eval-Opt run after 100 RL steps); each is run once.

    Only results whose outcome depends on the program's text alone are kept (``_stable``), and not those of
    HumanEval checks that draw random inputs. A program whose outcome varies from run to run on its own (it
    reads the clock, the order of a set of strings) gets its first outcome for every identical copy while it is
    kept."""

    def __init__(self, max_entries: int = DEFAULT_CACHE_ENTRIES):
        self.max_entries = int(max_entries)
        self._entries: "OrderedDict[bytes, dict]" = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @staticmethod
    def key(spec: dict, code: str, mode: str, options: dict) -> bytes | None:
        """The entry of ``code`` on ``spec``'s tests (None: not cacheable: a HumanEval check that uses ``random``)."""
        if spec.get("kind") == "humaneval" and "random" in str(spec.get("test", "")):
            return None
        payload = json.dumps([spec, code, mode, sorted(options.items())], sort_keys=True, default=repr)
        return hashlib.blake2b(payload.encode("utf-8", "surrogatepass"), digest_size=20).digest()

    def get(self, key: bytes) -> dict | None:
        with self._lock:
            hit = self._entries.get(key)
            if hit is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
        return copy.deepcopy(hit)

    def put(self, key: bytes, result: dict) -> None:
        if self.max_entries <= 0 or not _stable(result):
            return
        with self._lock:
            self._entries[key] = copy.deepcopy(result)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


def cache_entries_param(params: Any, where: str = "task.params.score_cache") -> int:
    """``task.params.score_cache`` (entries of the code reward's ``ScoreCache``; 0 turns it off)."""
    from masrl.errors import ConfigError

    value = params.get("score_cache", DEFAULT_CACHE_ENTRIES) if hasattr(params, "get") else DEFAULT_CACHE_ENTRIES
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{where} must be a whole number of cached results >= 0 (0: run every program), "
                          f"got {value!r}")
    return value


def make_code_score(mode: str = "fraction", *, cache_entries: int = DEFAULT_CACHE_ENTRIES, **kwargs: Any):
    """A ``ScoreFn`` ``(task, answer) -> dict`` bound to ``mode`` and scoring options (``score_code``'s keywords).

    ``cache_entries`` > 0: a ``ScoreCache`` of that many results (the function's ``cache``); a program
    already scored on the same task is not run again, and its result has ``cached: True`` and the lookup's
    ``duration_s``. 0: every answer is run."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    cache = ScoreCache(cache_entries) if cache_entries else None
    extract = kwargs.pop("extract", True)

    def score(task: Task, answer: str | None) -> dict:
        if cache is None:
            return score_code(task, answer, mode=mode, extract=extract, **kwargs)
        t0 = time.monotonic()
        code = extract_code(answer) if extract else ("" if answer is None else str(answer))
        key = ScoreCache.key(task.answer, code, mode, kwargs) if isinstance(task.answer, dict) else None
        hit = cache.get(key) if key is not None else None
        if hit is not None:
            hit["cached"], hit["duration_s"] = True, round(time.monotonic() - t0, 4)
            return hit
        result = score_code(task, code, mode=mode, extract=False, **kwargs)
        if key is not None:
            cache.put(key, result)
        result["cached"] = False
        return result

    score.__name__ = f"code_score_{mode}"
    score.cache = cache
    return score
