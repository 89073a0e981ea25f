"""Code tasks: loaders, code extraction and the sandboxed code reward (score_code)."""
from __future__ import annotations

import json
import sys
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from masrl.paths import data_dir
from masrl.tasks.code.data import MalformedRowWarning, load_humaneval, load_mbpp
from masrl.codecheck.extract import extract_code
from masrl.types import Task

linux = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox needs Linux")
MBPP = data_dir() / "code" / "mbpp.jsonl"
HUMANEVAL = data_dir() / "code" / "HumanEval.jsonl.gz"
needs_mbpp = pytest.mark.skipif(not MBPP.is_file(), reason="MBPP data not available")
needs_humaneval = pytest.mark.skipif(not HUMANEVAL.is_file(), reason="HumanEval data not available")


# ----------------------------------------------------------------------------------------
# extraction
# ----------------------------------------------------------------------------------------
def test_extract_last_python_block():
    text = "Plan\n```python\nx = 1\n```\nbetter:\n```python\ndef f():\n    return 2\n```\n```\noutput: 2\n```"
    assert extract_code(text) == "def f():\n    return 2"


def test_extract_untagged_block_and_fallbacks():
    assert extract_code("Here:\n```\ny = 3\n```\nDone") == "y = 3"
    assert extract_code("def g():\n    return 1\n") == "def g():\n    return 1"
    assert extract_code("    return a + b\n") == "    return a + b"  # body completion keeps indentation
    assert extract_code("```python\ndef h():\n    return 0") == "def h():\n    return 0"  # unclosed fence
    assert extract_code("```Python3\nz = 1\n```") == "z = 1"
    assert extract_code("~~~python\nw = 2\n~~~") == "w = 2"
    assert extract_code(None) == ""
    assert extract_code(42) == "42"
    assert extract_code("<think>```python\nbad = 1\n```</think>\n```python\ngood = 1\n```") == "good = 1"


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_extract_never_raises(text):
    out = extract_code(text)
    assert isinstance(out, str)


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_characters="`~\r"), min_size=1))
def test_extract_is_identity_without_fences(text):
    assert extract_code(text) == text.strip("\n")


# ----------------------------------------------------------------------------------------
# loaders
# ----------------------------------------------------------------------------------------
def _mbpp_row(tid, **over):
    row = {"text": "Add two numbers.", "code": "def add(a, b):\n    return a + b", "task_id": tid,
           "test_setup_code": "", "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"],
           "challenge_test_list": []}
    row.update(over)
    return json.dumps(row)


def test_load_mbpp_malformed_rows(tmp_path):
    path = tmp_path / "mbpp.jsonl"
    lines = [
        _mbpp_row(11),
        "{not json",
        _mbpp_row(12, test_list=[]),
        _mbpp_row(13, code="def add(a, b) return"),
        _mbpp_row(14, test_list=["assert add(1,"]),
        "",
        _mbpp_row(15, text=7),
        json.dumps([1, 2]),
        _mbpp_row(16),
        _mbpp_row(16),
        _mbpp_row(700),
        json.dumps({"text": "x", "code": "def f(): pass", "test_list": ["assert f() is None"]}),
    ]
    path.write_text("\n".join(lines) + "\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tasks = load_mbpp(path, split="test")
    msgs = [str(w.message) for w in caught if issubclass(w.category, MalformedRowWarning)]
    assert [t.id for t in tasks] == ["mbpp/11", "mbpp/16"]
    for lineno in (2, 3, 4, 5, 7, 8, 10, 12):
        assert any(f"{path}:{lineno}:" in m for m in msgs), (lineno, msgs)
    assert len(msgs) == 8
    with pytest.raises(ValueError, match=f"{path}:2:"):
        load_mbpp(path, split="test", strict=True)
    with pytest.warns(MalformedRowWarning):
        assert [t.id for t in load_mbpp(path, split="train")] == ["mbpp/700"]
    with pytest.raises(ValueError):
        load_mbpp(path, split="nope")


def test_load_mbpp_task_shape(tmp_path):
    path = tmp_path / "mbpp.jsonl"
    path.write_text(_mbpp_row(20) + "\n")
    (task,) = load_mbpp(path, split="all")
    assert "def add(a, b)" in task.question and "assert" not in task.question
    assert task.answer["kind"] == "mbpp" and task.answer["entry_point"] == "add"
    assert task.answer["tests"] == ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]
    assert task.meta["task_id"] == 20 and task.meta["data_source"] == "mbpp"
    (shown,) = load_mbpp(path, split="all", show_tests=True)
    assert "assert add(1, 2) == 3" in shown.question
    assert load_mbpp(path, split="all", limit=0) == []


def test_load_humaneval_malformed(tmp_path):
    good = {"task_id": "HumanEval/0", "prompt": "def f(x):\n    \"\"\"Id.\"\"\"\n", "entry_point": "f",
            "canonical_solution": "    return x\n", "test": "def check(candidate):\n    assert candidate(1) == 1\n"}
    rows = [json.dumps(good), json.dumps({**good, "task_id": "HumanEval/1", "test": "def nope(): pass"}),
            json.dumps({**good, "task_id": "HumanEval/2", "entry_point": "not valid"}),
            json.dumps({**good, "task_id": "HumanEval/0"})]
    path = tmp_path / "he.jsonl"
    path.write_text("\n".join(rows) + "\n")
    with pytest.warns(MalformedRowWarning) as rec:
        tasks = load_humaneval(path)
    assert [t.id for t in tasks] == ["HumanEval/0"]
    assert {f"{path}:2:", f"{path}:3:", f"{path}:4:"} <= {str(w.message).split(" ")[0] for w in rec}
    with pytest.raises(ValueError):
        load_humaneval(path, strict=True)


@needs_mbpp
def test_real_mbpp_splits():
    sizes = {s: len(load_mbpp(split=s)) for s in ("prompt", "test", "validation", "train")}
    assert sizes == {"prompt": 10, "test": 500, "validation": 90, "train": 374}
    ids = [t.meta["task_id"] for t in load_mbpp(split="test")]
    assert min(ids) == 11 and max(ids) == 510
    assert len(load_mbpp(split="all")) == 974


@needs_humaneval
def test_real_humaneval():
    tasks = load_humaneval()
    assert len(tasks) == 164
    assert tasks[0].id == "HumanEval/0" and tasks[0].answer["entry_point"] == "has_close_elements"
    assert tasks[0].question.startswith("from typing import List")


# ----------------------------------------------------------------------------------------
# scoring: synthetic tasks (no data needed)
# ----------------------------------------------------------------------------------------
if sys.platform == "linux":
    from masrl.sandbox import Sandbox
    from masrl.codecheck.scoring import make_code_score, score_code, score_many

ADD = Task("t/add", "Write add(a, b).", {
    "kind": "mbpp", "entry_point": "add", "remote_names": ["add"], "setup": "",
    "tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(10, 5) == 15"]})

HE = Task("t/he", "", {
    "kind": "humaneval", "entry_point": "double_all",
    "prompt": ("from typing import List\n\n\ndef _helper(x):\n    return x * 2\n\n\n"
               "def double_all(xs: List[int]) -> List[int]:\n    \"\"\"Double every item.\"\"\"\n"),
    "test": ("METADATA = {}\n\n\ndef check(candidate):\n"
             "    assert candidate([]) == []\n"
             "    assert candidate([1, 2]) == [2, 4]\n"
             "    for i in range(5):\n"
             "        assert candidate([i]) == [_helper(i)]\n"
             "    assert True, 'not a test'\n"
             "    assert candidate([-3]) == [-6], 'negative'\n")})


@pytest.fixture(scope="module")
def sb():
    if sys.platform != "linux":
        pytest.skip("the sandbox needs Linux")
    box = Sandbox(max_workers=3)
    box.resolve()
    yield box
    box.close()


def _score(sb, task, answer, **kw):
    kw.setdefault("timeout_s", 2.0)
    return score_code(task, answer, sandbox=sb, **kw)


@linux
def test_score_correct_and_partial(sb):
    r = _score(sb, ADD, "```python\ndef add(a, b):\n    return a + b\n```")
    assert r["reward"] == 1.0 and r["correct"] and r["reason"] == "ok" and (r["passed"], r["total"]) == (3, 3)
    r = _score(sb, ADD, "def add(a, b):\n    return a + b if a > 0 else 99")
    assert r["reward"] == pytest.approx(2 / 3) and not r["correct"] and r["reason"] == "wrong_answer"
    assert [t["passed"] for t in r["tests"]] == [True, False, True]
    r = _score(sb, ADD, "def add(a, b):\n    return a + b if a > 0 else 99", mode="all")
    assert r["reward"] == 0.0 and not r["correct"]


@linux
def test_score_malformed_code(sb):
    for answer, reason in [(None, "no_code"), ("", "no_code"), ("```python\n\n```", "no_code"),
                           ("def add(a, b) return a", "syntax_error"), ("def add(a, b):\nreturn a", "syntax_error"),
                           ("raise RuntimeError('x')", "load_error"), ("import not_a_module_xyz", "load_error")]:
        r = _score(sb, ADD, answer)
        assert r["reward"] == 0.0 and not r["correct"] and r["reason"] == reason, (answer, r)
        assert len(r["tests"]) == 3


@linux
def test_score_timeouts(sb):
    r = _score(sb, ADD, "while True:\n    pass", timeout_s=0.5)
    assert r["reward"] == 0.0 and r["reason"] == "load_timeout"
    # hangs on one input only: that test times out, the others still count
    r = _score(sb, ADD, "def add(a, b):\n    while a < 0:\n        pass\n    return a + b", timeout_s=0.5)
    assert r["reward"] == pytest.approx(2 / 3)
    assert [t["reason"] for t in r["tests"]] == ["ok", "timeout", "ok"]
    r = _score(sb, ADD, "import time\ndef add(a, b):\n    time.sleep(30)", timeout_s=0.3)
    assert r["reward"] == 0.0 and r["reason"] == "timeout" and r["duration_s"] < 10


@linux
def test_score_resource_abuse(sb):
    r = _score(sb, ADD, "def add(a, b):\n    return len(bytearray(64 << 30))", memory_mb=256)
    assert r["reward"] == 0.0 and r["reason"] == "memory", r
    r = _score(sb, ADD, "def add(a, b):\n    while True:\n        print('x' * 100000)")
    assert r["reward"] == 0.0 and r["reason"] == "output_limit", r
    r = _score(sb, ADD, "import os\ndef add(a, b):\n    while True:\n        try:\n            os.fork()\n"
                        "        except Exception:\n            pass", timeout_s=0.5)
    assert r["reward"] == 0.0


CHEATS = {
    "exit_at_import": "import sys\nsys.exit(0)",
    "os_exit_at_import": "import os\nos._exit(0)",
    "exit_in_call": "import sys\ndef add(a, b):\n    sys.exit(0)",
    "os_exit_in_call": "import os\ndef add(a, b):\n    os._exit(0)",
    "kill_self": "import os, signal\ndef add(a, b):\n    os.kill(os.getpid(), signal.SIGKILL)",
    "fake_pass_output": "print('PASSED\\nall tests passed\\nOK')\ndef add(a, b):\n    print('PASSED')\n    return None",
    "always_equal": ("class Eq:\n    def __eq__(self, o):\n        return True\n    __hash__ = object.__hash__\n"
                     "    def __bool__(self):\n        return True\n"
                     "def add(a, b):\n    return Eq()"),
    "always_equal_int": ("class Eq(int):\n    def __eq__(self, o):\n        return True\n    __hash__ = int.__hash__\n"
                         "def add(a, b):\n    return Eq(7)"),
    "patch_builtins": ("import builtins\nbuiltins.AssertionError = type('Nope', (Exception,), {})\n"
                       "builtins.all = lambda *a: True\nbuiltins.isinstance = lambda *a: True\n"
                       "def add(a, b):\n    return 7"),
    "raise_systemexit_class": "def add(a, b):\n    raise SystemExit",
    "return_lambda": "def add(a, b):\n    return lambda *a: True",
    "stack_snooping": ("import sys, gc\n"
                       "def add(a, b):\n"
                       "    seen = []\n"
                       "    f = sys._getframe()\n"
                       "    while f:\n"
                       "        seen.extend(v for v in f.f_locals.values() if type(v) is int and v not in (a, b))\n"
                       "        f = f.f_back\n"
                       "    seen += [o for o in gc.get_objects() if type(o) is tuple and len(o) == 3]\n"
                       "    return 7"),
    "read_dataset": ("import glob\n"
                     "def add(a, b):\n"
                     "    for p in glob.glob('/work/**/*.jsonl', recursive=True) + glob.glob('/root/**/*.jsonl'):\n"
                     "        return open(p).read()\n"
                     "    return -1"),
    "forge_rpc_reply": ("import os\n"
                        "def add(a, b):\n"
                        "    for fd in range(3, 64):\n"
                        "        try:\n"
                        "            os.write(fd, b'\\x00\\x00\\x00\\x17{\"seq\":1,\"value\":3}')\n"
                        "        except OSError:\n"
                        "            pass\n"
                        "    return 7"),
    "kill_parent": "import os, signal\ndef add(a, b):\n    os.kill(os.getppid(), signal.SIGKILL)\n    return 7",
    "sigstop_self": "import os, signal\ndef add(a, b):\n    os.kill(os.getpid(), signal.SIGSTOP)\n    return 3",
    "close_channels": "import os\nfor fd in range(3, 64):\n    try:\n        os.close(fd)\n    except OSError:\n"
                      "        pass\ndef add(a, b):\n    return a + b",
}


@linux
@pytest.mark.parametrize("name", sorted(CHEATS))
def test_cheats_get_no_reward(sb, name):
    r = _score(sb, ADD, CHEATS[name], timeout_s=0.5)
    assert r["reward"] == 0.0 and not r["correct"], (name, r)
    assert r["passed"] == 0


@linux
def test_stopped_sandbox_cannot_block_the_harness(sb):
    """A request larger than a pipe buffer to a process that stopped itself: send() must give up
    at the deadline instead of blocking the scoring thread forever."""
    import time

    from masrl.codecheck.scoring import RemoteRef, SandboxFailure, _Session

    code = ("import os, signal, threading, time\ndef f(x):\n    return 1\n"
            "threading.Thread(target=lambda: (time.sleep(0.1), os.kill(os.getpid(), signal.SIGSTOP))).start()\n")
    session = _Session(sb, sb._limits(timeout_s=30), code, "", timeout_s=1.0, load_timeout_s=5,
                       deadline=time.monotonic() + 20, max_restarts=0)
    try:
        session.start()
        time.sleep(0.4)
        t0 = time.monotonic()
        with pytest.raises(SandboxFailure) as err:
            RemoteRef(session, ["N", "f"], None)([0] * 500_000)
        assert err.value.status == "timeout" and time.monotonic() - t0 < 5
    finally:
        session.close()


@linux
@needs_humaneval
def test_judge_does_not_touch_global_random(sb):
    import random

    task = next(t for t in load_humaneval() if t.id == "HumanEval/53")  # draws random inputs
    random.seed(1234)
    expected = random.random()
    random.seed(1234)
    assert _score(sb, task, task.meta["reference_solution"])["reward"] == 1.0
    assert random.random() == expected


@linux
def test_cheats_cannot_help_a_half_right_solution(sb):
    # right on the first test only; prints fake markers and exits "successfully" afterwards
    code = ("import sys, atexit\n"
            "atexit.register(lambda: print('3 passed'))\n"
            "def add(a, b):\n"
            "    if (a, b) == (1, 2):\n"
            "        return 3\n"
            "    print('ok')\n"
            "    sys.exit(0)\n")
    r = _score(sb, ADD, code)
    assert r["passed"] == 1 and r["reward"] == pytest.approx(1 / 3)


@linux
def test_score_remote_objects_setup_and_mutation(sb):
    task = Task("t/obj", "", {
        "kind": "mbpp", "entry_point": "longest", "remote_names": ["longest", "Pair", "root"],
        "setup": "root = Pair(7, 8)\n",
        "tests": ["assert longest([Pair(1, 2), Pair(3, 9)]) == 6",
                  "assert longest([root]) == 1",
                  "x = [3, 1, 2]; assert sort_in_place(x) is None and x == [1, 2, 3]",
                  "assert Pair(1, 5).b == 5",
                  "assert types_of([1, 'a']) == [int, str]",
                  "assert set(pairs_keys({1: 2, 3: 4})) == {1, 3}",
                  "assert list(gen(3)) == [0, 1, 2]"]})
    code = ("class Pair:\n    def __init__(self, a, b):\n        self.a, self.b = a, b\n"
            "def longest(ps):\n    return max(p.b - p.a for p in ps)\n"
            "def sort_in_place(x):\n    x.sort()\n"
            "def types_of(xs):\n    return [type(x) for x in xs]\n"
            "def pairs_keys(d):\n    return d.keys()\n"
            "def gen(n):\n    yield from range(n)\n")
    r = _score(sb, task, code)
    assert r["reward"] == 1.0, r


@linux
def test_score_humaneval_style(sb):
    body = "    return [_helper(x) for x in xs]\n"
    full = "```python\ndef double_all(xs):\n    return [2 * x for x in xs]\n```"
    for answer in (body, full):
        r = _score(sb, HE, answer)
        assert r["reward"] == 1.0 and r["total"] == 4, r
    # wrong only for negative numbers: 3 of the 4 asserts hold (the loop assert counts once)
    r = _score(sb, HE, "    return [abs(2 * x) for x in xs]\n")
    assert r["total"] == 4 and r["passed"] == 3 and r["reward"] == pytest.approx(0.75)
    r = _score(sb, HE, "    return [abs(2 * x) for x in xs]\n", mode="all")
    assert r["reward"] == 0.0
    # a crash before the loop: the asserts after it are not reached
    r = _score(sb, HE, "    if xs == [1, 2]:\n        raise ValueError('no')\n    return [2 * x for x in xs]\n")
    assert [t["passed"] for t in r["tests"]] == [True, False, True, True]
    assert r["tests"][1]["reason"].startswith("exception: ValueError")


@linux
def test_score_many_and_score_fn(sb):
    answers = ["def add(a, b):\n    return a + b", "def add(a, b):\n    return 0", None] * 2
    results = score_many([ADD] * len(answers), answers, sandbox=sb)
    assert [r["reward"] for r in results] == [1.0, pytest.approx(1 / 3), 0.0] * 2
    fn = make_code_score("all", sandbox=sb, timeout_s=2.0)
    out = fn(ADD, "def add(a, b):\n    return a + b")
    assert out["reward"] == 1.0 and out["correct"] is True and isinstance(out["reason"], str)


# ----------------------------------------------------------------------------------------
# scoring: the datasets' reference solutions pass (a sample; the full run is
# `python -m masrl.tasks.code.verify`)
# ----------------------------------------------------------------------------------------
@linux
@needs_mbpp
def test_mbpp_reference_solutions_pass(sb):
    tasks = load_mbpp(split="all")
    special = {"mbpp/367", "mbpp/533", "mbpp/596", "mbpp/601", "mbpp/927"}  # setup code, classes, types, sys
    sample = [t for t in tasks if t.id in special] + tasks[::60]
    results = score_many(sample, [t.meta["reference_solution"] for t in sample], mode="all", timeout_s=10, sandbox=sb)
    bad = [(t.id, r["reason"], r["detail"]) for t, r in zip(sample, results) if not r["correct"]]
    assert not bad


@linux
@needs_humaneval
def test_humaneval_reference_solutions_pass(sb):
    tasks = load_humaneval()
    special = {"HumanEval/32", "HumanEval/33", "HumanEval/38", "HumanEval/50", "HumanEval/53", "HumanEval/151"}
    sample = [t for t in tasks if t.id in special] + tasks[::20]
    results = score_many(sample, [t.meta["reference_solution"] for t in sample], mode="all", timeout_s=10, sandbox=sb)
    bad = [(t.id, r["reason"], r["detail"]) for t, r in zip(sample, results) if not r["correct"]]
    assert not bad
    wrong = score_many(sample[:4], ["    return None\n"] * 4, sandbox=sb)
    assert all(r["reward"] < 1.0 for r in wrong)
