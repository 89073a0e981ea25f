"""A user reward in a process of its own (task.reward_isolation: process / auto; masrl.usercode.process):
what a thread cannot bound — a call holding the interpreter lock, a call that ends its process — is one failed
call, and the run goes on or stops with one line, never hangs or ends silently."""
import json
import logging
import os
import signal
import subprocess
import sys
import time
import warnings

import pytest
import yaml

from masrl.cli import main
from masrl.errors import ConfigError
from masrl.usercode.guard import GuardedScore
from masrl.usercode.process import MAX_TIMEOUTS_IN_A_ROW
from masrl.tasks.rewards import register_reward, resolve_reward, REWARDS
from masrl.types import Episode, Task, Turn

REWARDS_PY = '''
import os, re, sys

def ok(task, episode):
    print("a print in the reward")          # goes to stderr, not into the worker's replies
    sys.stdout.write("more")
    episode.turns.reverse()                 # reordering the list does not move rewards between turns
    episode.turns[0].reward = 0.25
    return {"reward": 1.0, "pid": os.getpid()}

def holds_the_lock(task, episode):          # a catastrophic regular expression: no thread can interrupt it
    re.match(r"(a+)+$", "a" * 40 + "b")
    return 1.0

def exits(task, episode):
    os._exit(0)

def crashes(task, episode):
    import ctypes
    ctypes.string_at(0)

def returns_a_function(task, episode):
    return {"reward": 1.0, "f": lambda: 0}

def raises(task, episode):
    return {}["missing"]

def exits_once(task, episode):              # the first call ends its process, later calls (a new one) return
    flag = os.path.join(os.path.dirname(os.path.abspath(__file__)), "exited")
    if not os.path.exists(flag):
        open(flag, "w").close()
        os._exit(3)
    return 1.0
'''


@pytest.fixture
def rewards(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text(REWARDS_PY)
    return lambda name, timeout_s=5.0: GuardedScore(resolve_reward(f"{path}:{name}", {}, timeout_s=timeout_s))


def _episode(task):
    return Episode(task, [Turn(agent, "p", [1], [2], [0.0], "x") for agent in ("Solver", "Verifier")], 0.0, "1")


def test_a_reward_runs_in_a_worker_process_and_its_turn_rewards_come_back(rewards):
    score = rewards("ok")
    assert score.score.isolation == "process"
    task = Task("t/1", "q", "1")
    results = []
    for _ in range(3):
        episode = _episode(task)
        results.append(score(task, episode))
        assert [t.reward for t in episode.turns] == [None, 0.25]  # the Verifier's, the list reversed there
    assert {r["reward"] for r in results} == {1.0} and len({r["pid"] for r in results}) == 1  # one worker
    assert results[0]["pid"] != os.getpid() and score.score.process.starts == 1


def test_a_call_holding_the_interpreter_lock_ends_at_its_deadline(rewards):
    score = rewards("holds_the_lock", timeout_s=1.0)
    task = Task("t/1", "q", "1")
    t0 = time.monotonic()
    result = score(task, _episode(task))
    assert time.monotonic() - t0 < 10  # in a thread of this process it would never return
    assert result["reason"] == "reward_timeout" and "its process was stopped" in result["detail"]
    counts = score.ledger.take()
    assert (counts.calls, counts.errors, counts.timeouts, counts.abandoned) == (1, 0, 1, 0)


@pytest.mark.parametrize("name, needle", [("exits", "exit code 0"), ("crashes", "killed by signal SIGSEGV"),
                                          ("returns_a_function", "cannot be sent back"),
                                          ("raises", "KeyError: 'missing' in ")])
def test_a_call_that_ends_its_process_or_fails_there_is_one_error(rewards, name, needle):
    score = rewards(name)
    task = Task("t/1", "q", "1")
    for _ in range(2):
        result = score(task, _episode(task))
        assert result["reward"] == 0.0 and result["reason"] == "score_error" and needle in result["detail"], result
    counts = score.ledger.take()
    assert (counts.calls, counts.errors, counts.timeouts) == (2, 2, 0)
    assert score.score.process.starts == (2 if name in ("exits", "crashes") else 1)  # a new worker after a death
    if name == "raises":
        assert "rewards.py line" in result["detail"]


def test_the_call_after_a_crash_runs_in_a_new_worker(rewards):
    score = rewards("exits_once")
    task = Task("t/1", "q", "1")
    first, second = score(task, _episode(task)), score(task, _episode(task))
    assert "exit code 3" in first["detail"] and second["reward"] == 1.0 and score.score.process.starts == 2


def test_after_several_timeouts_in_a_row_calls_are_not_made(rewards):
    score = rewards("holds_the_lock", timeout_s=0.2)
    task = Task("t/1", "q", "1")
    for _ in range(MAX_TIMEOUTS_IN_A_ROW):
        assert score(task, _episode(task))["reason"] == "reward_timeout"
    starts = score.score.process.starts
    t0 = time.monotonic()
    result = score(task, _episode(task))
    assert time.monotonic() - t0 < 0.1 and "not called" in result["detail"]
    assert score.score.process.starts == starts == MAX_TIMEOUTS_IN_A_ROW


def test_a_reward_that_ends_its_process_on_every_call_stops_the_run_with_one_line(tmp_path, tiny_cfg, capsys):
    (tmp_path / "rewards.py").write_text(REWARDS_PY)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(6)))
    cfg = tiny_cfg(**{"sft.steps": 0, "trainer.total_steps": 2, "trainer.batch_size": 2, "trainer.group_size": 2,
                      "eval.before_after": False, "logging.plots": False,
                      "task": {"name": "dataset", "params": {"train": str(data), "reward": f"{tmp_path}/rewards.py:exits"}}})
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = main(["train", str(tmp_path / "cfg.yaml")])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("masrl: error")]
    assert code == 2 and len(errors) == 1, errors
    assert "rewards.py:exits failed on" in errors[0] and "its process ended during the call (exit code 0)" in errors[0]


def _local_reward(task, episode):
    return 1.0


def test_auto_runs_a_function_no_process_can_import_in_a_thread_and_process_says_why():
    def inner(task, episode):
        return 1.0

    for name, fn in (("masrl-test-inner", inner), ("masrl-test-module-level", _local_reward)):
        register_reward(name, fn, overwrite=True)
    try:
        assert resolve_reward("masrl-test-inner").isolation == "thread"
        with pytest.raises(ConfigError, match="cannot run in a process of its own .*defined in a function"):
            resolve_reward("masrl-test-inner", isolation="process")
        score = resolve_reward("masrl-test-module-level", isolation="process")  # pickled by reference
        assert score.isolation == "process" and score(Task("t", "q", "1"), "1")["reward"] == 1.0
        assert resolve_reward("masrl-test-module-level", isolation="thread").isolation == "thread"
        with pytest.raises(ConfigError, match="task.reward_isolation must be one of auto, process, thread"):
            resolve_reward("masrl-test-inner", isolation="fork")
    finally:
        for name in ("masrl-test-inner", "masrl-test-module-level"):
            REWARDS.unregister(name)


def test_the_first_failure_shows_the_traceback_from_the_reward_process(rewards, caplog):
    score = rewards("raises")
    task = Task("t/1", "q", "1")
    with caplog.at_level(logging.WARNING):
        score(task, _episode(task))
        score(task, _episode(task))
    (record,) = [r for r in caplog.records if "Traceback" in r.getMessage()]
    message = record.getMessage()
    assert "rewards.py\", line" in message and "return {}[\"missing\"]" in message and "masrl" not in message.split(
        "Traceback")[1]


ORPHAN = '''
import os, threading, time
from masrl.tasks.rewards import resolve_reward
from masrl.types import Task
score = resolve_reward({reward!r}, {{}}, 1000)
threading.Thread(target=lambda: score(Task("t", "q", "1"), "1"), daemon=True).start()
while score.process.proc is None or score.process.starts == 0:
    time.sleep(0.01)
time.sleep(0.5)   # the worker is inside the call, holding its interpreter lock
print(score.process.proc.pid, flush=True)
os._exit(0)       # the trainer ends without stopping its worker (as a SIGKILL would)
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_worker_stuck_in_a_call_dies_with_the_trainer(tmp_path):
    (tmp_path / "rewards.py").write_text(REWARDS_PY)
    script = ORPHAN.format(reward=f"{tmp_path / 'rewards.py'}:holds_the_lock")
    out = subprocess.run([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         timeout=60)  # stderr: the worker inherits it
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    alive = _alive(pid)
    if alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive  # without PR_SET_PDEATHSIG it spins on at 100% of a core, an orphan


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_worker_started_from_a_thread_that_ends_serves_the_next_call(rewards):
    """The parent-death signal follows the thread that started a worker: workers are started from one long-lived
    thread, so a call from a thread that has ended (a pool's, a server's) does not lose the worker."""
    import threading

    score = rewards("ok")
    task = Task("t/1", "q", "1")
    first = []
    thread = threading.Thread(target=lambda: first.append(score(task, _episode(task))))
    thread.start()
    thread.join()
    time.sleep(0.2)  # the kernel's signal, if it were tied to that thread, has come by now
    second = score(task, _episode(task))
    assert first[0]["reward"] == second["reward"] == 1.0 and first[0]["pid"] == second["pid"]
    assert score.score.process.starts == 1


def test_a_worker_pipe_numbered_past_1024_works(rewards):
    """A process with many files open (a Ray worker's sockets) gives the worker's pipes numbers past select()'s
    1024 limit: the replies are waited for with poll()."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        if hard != resource.RLIM_INFINITY and hard < 1200:
            pytest.skip("the file limit is below 1200 here")
        resource.setrlimit(resource.RLIMIT_NOFILE, (1200 if hard == resource.RLIM_INFINITY else min(hard, 4096),
                                                    hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        score = rewards("ok")
        task = Task("t/1", "q", "1")
        assert score(task, _episode(task))["reward"] == 1.0
        assert score.score.process.proc.stdout.fileno() > 1024
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
