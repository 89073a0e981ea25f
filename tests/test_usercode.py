"""The user-code service (masrl.usercode): one contract for rewards, tools, judges, reward models and agent programs.

A deadline on the whole call (an async def that blocks, a judge that trickles its reply), BaseException contained
(sys.exit in an agent program), subprocesses in their own process group (children killed, done when the program
exits, output bounded), safe numbers (a logprob of 1000, a logit of -1000), the count of agent programs that made no
model call, and the rule that nothing else in src/ starts a thread, a process or an event loop for user code."""
from __future__ import annotations

import ast
import asyncio
import json
import os
import sys
import textwrap
import threading
import time
import tracemalloc
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import GatheringScheduler

from masrl.types import Task, Turn
from masrl.workflows.base import Team, WorkflowSpec

ROOT = Path(__file__).resolve().parents[1]
TASK = Task(id="t", question="q", answer="")


# ----------------------------------------------------------------------------- calls in a thread

@pytest.mark.parametrize("error, needle", [(SystemExit(0), "called sys.exit(0)"),
                                           (KeyboardInterrupt(), "KeyboardInterrupt")])
def test_a_base_exception_in_user_code_is_a_failed_call_not_the_end_of_the_run(error, needle):
    from masrl.usercode.calls import UserCodeExit, call_async, call_in_thread

    def leave():
        raise error

    with pytest.raises(UserCodeExit, match=needle.replace("(", r"\(").replace(")", r"\)")):
        call_in_thread(leave, (), 5, kind="test", what="leave")
    with pytest.raises(UserCodeExit, match="leave"):
        asyncio.run(call_async(leave, (), 5, kind="test", what="leave"))


def test_a_blocking_async_def_neither_freezes_the_callers_loop_nor_escapes_its_deadline():
    from masrl.usercode.calls import UserCodeTimeout, abandoned, call_async

    async def blocks():
        time.sleep(1.5)  # a sync client inside an async def
        return "late"

    async def main():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.02)
                ticks += 1

        ticker = asyncio.ensure_future(tick())
        start = time.monotonic()
        with pytest.raises(UserCodeTimeout, match="within 0.3 s"):
            await call_async(blocks, (), 0.3, kind="test_block", what="blocks")
        elapsed = time.monotonic() - start
        ticker.cancel()
        return elapsed, ticks

    elapsed, ticks = asyncio.run(main())
    assert elapsed < 1.0 and ticks >= 5  # the deadline fired, and masrl's loop kept running meanwhile
    assert abandoned("test_block") == 1


def test_the_async_calls_of_one_code_share_its_loop_until_one_runs_past_its_deadline():
    from masrl.usercode.calls import UserCodeExit, UserCodeTimeout, call_async

    loops = []

    async def code(x):
        loops.append(asyncio.get_running_loop())
        if x == "exit":
            raise SystemExit(0)
        if x == "block":
            time.sleep(1.0)
        await asyncio.sleep(0.01)
        return x

    async def main():
        def one(x, timeout_s=5.0):
            return call_async(code, (x,), timeout_s, kind="test_share", what="code")

        first = await asyncio.gather(*(one(i) for i in range(3)))
        with pytest.raises(UserCodeExit, match=r"sys\.exit\(0\)"):
            await one("exit")  # contained: the loop goes on serving
        with pytest.raises(UserCodeTimeout):
            await one("block", 0.2)
        return first, await one("after"), asyncio.get_running_loop()

    first, after, callers = asyncio.run(main())
    assert first == [0, 1, 2] and after == "after"
    assert len({id(loop) for loop in loops[:5]}) == 1 and loops[0] is not callers  # one loop, not masrl's
    assert loops[5] is not loops[0]  # the blocked loop was retired: a new one serves the next call


def test_an_async_def_past_its_deadline_is_cancelled_on_its_own_loop():
    from masrl.usercode.calls import UserCodeTimeout, abandoned, call_in_thread

    ended = threading.Event()

    async def waits():
        try:
            await asyncio.sleep(60)
        finally:
            ended.set()

    with pytest.raises(UserCodeTimeout):
        call_in_thread(waits, (), 0.2, kind="test_cancel", what="waits")
    assert ended.wait(5) and _eventually(lambda: abandoned("test_cancel") == 0)


def test_one_runner_a_codes_calls_in_a_row_share_a_worker_and_one_past_its_deadline_is_replaced():
    """Rewards, tools and every other kind run on the one runner (``call_in_thread``): calls one after another
    reuse the code's worker thread (no thread start per call: a reward's thread mode and a tool cost the same),
    a worker whose call ran past its deadline is abandoned and ends once the call returns."""
    from masrl.tools import Tool, ToolBox
    from masrl.tools.parsing import ToolCall
    from masrl.usercode.calls import UserCodeTimeout, abandoned, call_in_thread
    from masrl.usercode.guard import call_with_deadline

    seen = []

    def where(text: str = "") -> str:
        """Where it ran.

        Args:
            text: ignored
        """
        seen.append(threading.current_thread())
        return "ok"

    for _ in range(3):
        call_with_deadline("where", where, (), 5.0)
    box = ToolBox([Tool(where)])
    for _ in range(3):
        assert box.run(ToolCall("where", {})).status == "ok"
    reward_threads, tool_threads = seen[:3], seen[3:]
    assert all(t is reward_threads[0] for t in reward_threads) and all(t is tool_threads[0] for t in tool_threads)
    assert threading.current_thread() not in seen
    release = threading.Event()
    with pytest.raises(UserCodeTimeout):
        call_in_thread(lambda: (seen.append(threading.current_thread()), release.wait(10)), (), 0.2, kind="test_one",
                       what="one")
    hung = seen[-1]
    assert abandoned("test_one") == 1
    call_in_thread(lambda: seen.append(threading.current_thread()), (), 5.0, kind="test_one", what="one")
    assert seen[-1] is not hung  # a new worker, while the hung one still runs
    release.set()
    assert _eventually(lambda: abandoned("test_one") == 0) and _eventually(lambda: not hung.is_alive())


def _eventually(check, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# ----------------------------------------------------------------------------- agent programs: entry

class _Scripted:
    """A team.call backend that counts the calls."""

    def __init__(self):
        self.n = 0

    async def __call__(self, agent, prompt):
        self.n += 1
        return Turn(agent=agent, policy="p", prompt_ids=[1, 2], response_ids=[3, self.n], logprobs=[-0.5, -0.5],
                    text=f"reply {self.n}", prompt_text=str(prompt))


def _team(params):
    from masrl.workflows.external import external

    spec = WorkflowSpec("external", external, ("Solver",), {}, params={"entry": None, "command": None,
                                                                        "timeout_s": 300.0, "host": "127.0.0.1",
                                                                        "port": 0, "env": {},
                                                                        "max_error_share": 1.0})
    return Team(TASK, spec, _Scripted(), lambda t, a: {"reward": 1.0, "correct": True}, params=params)


def _external(params):
    from masrl.workflows.external import external

    team = _team(params)
    return asyncio.run(external(TASK, team))


def test_an_entry_that_calls_sys_exit_fails_its_episode_only(tmp_path):
    from masrl.workflows.external import ExternalAgentError

    (tmp_path / "leaves.py").write_text("import sys\n\ndef run(task, client_kwargs):\n    sys.exit(0)\n")
    with pytest.raises(ExternalAgentError, match=r"sys\.exit\(0\)"):
        _external({"entry": f"{tmp_path / 'leaves.py'}:run", "timeout_s": 10})


def test_an_async_entry_that_blocks_times_out_at_its_deadline(tmp_path):
    from masrl.workflows.external import ExternalAgentError

    (tmp_path / "blocks.py").write_text(textwrap.dedent('''
        import time

        async def run(task, client_kwargs):
            time.sleep(4)  # a blocking call inside an async def
            return "late"
    '''))
    start = time.monotonic()
    with pytest.raises(ExternalAgentError, match="did not return within 0.5 s") as err:
        _external({"entry": f"{tmp_path / 'blocks.py'}:run", "timeout_s": 0.5})
    assert time.monotonic() - start < 3.0 and err.value.program_outcome == "timeout"


def test_an_entry_that_makes_no_model_call_is_an_invalid_counted_episode(tmp_path):
    from masrl.rollout.runner import failed_episode, rollout_metrics
    from masrl.workflows.external import ExternalAgentError

    (tmp_path / "lazy.py").write_text("def run(task, client_kwargs):\n    return {'reward': 1.0}\n")
    team = _team({"entry": f"{tmp_path / 'lazy.py'}:run", "timeout_s": 10})
    with pytest.raises(ExternalAgentError, match="made no model call") as err:
        _external({"entry": f"{tmp_path / 'lazy.py'}:run", "timeout_s": 10})
    episode = failed_episode(TASK, team, err.value)
    assert not episode.valid and episode.info["reason"] == "no_model_call"
    metrics = rollout_metrics([episode])
    assert metrics["rollout/episodes_without_calls"] == 1.0 and metrics["rollout/episode_errors"] == 1.0
    assert metrics["usercode/program/calls"] == 1.0 and metrics["usercode/program/errors"] == 1.0


PROGRAM = """
import os, sys, threading
import openai

LOCK, SEEN = threading.Lock(), []


def run(task, client_kwargs):
    mode = os.environ["MASRL_TEST_PROGRAM_MODE"]
    if mode == "lazy":
        return {"reward": 1.0}  # no model call
    with LOCK:
        SEEN.append(task["id"])
        first = len(SEEN) == 1
    if first:
        sys.exit(0)  # the first episode to start leaves
    client = openai.OpenAI(**client_kwargs)
    reply = client.chat.completions.create(model="Solver", messages=[{"role": "user", "content": task["question"]}])
    return reply.choices[0].message.content
"""


def test_a_program_that_exits_fails_one_episode_and_one_that_never_calls_a_model_stops_the_run(tiny_cfg, tmp_path,
                                                                                                  monkeypatch):
    pytest.importorskip("openai")
    from masrl.config import config_from_dict
    from masrl.rollout.runner import EpisodeError, rollout_metrics
    from masrl.trainer import Trainer

    (tmp_path / "prog.py").write_text(PROGRAM)
    cfg = config_from_dict(tiny_cfg(**{"workflow": {"name": "external", "params": {
        "entry": f"{tmp_path / 'prog.py'}:run", "timeout_s": 60}}, "sft.steps": 0, "trainer.total_steps": 1,
        "trainer.batch_size": 2, "trainer.group_size": 2, "eval.before_after": False, "logging.plots": False}))
    cfg.agents = {"Solver": cfg.agents["Solver"]}
    with Trainer(cfg) as trainer:
        monkeypatch.setenv("MASRL_TEST_PROGRAM_MODE", "exit_first")
        episodes = trainer.rollout(trainer.source.train[:2], [0, 1], seed=1)  # the run goes on
        failed = [e for e in episodes if not e.valid]
        assert len(episodes) == 2 and len(failed) == 1 and "sys.exit(0)" in failed[0].error
        assert all(len(e.turns) == 1 for e in episodes if e.valid)
        assert rollout_metrics(episodes)["usercode/program/errors"] == 1.0
        monkeypatch.setenv("MASRL_TEST_PROGRAM_MODE", "lazy")
        with pytest.raises(EpisodeError) as err:
            trainer.rollout(trainer.source.train[:2], [0, 1], seed=1)
    message = str(err.value)
    assert "no episode of the rollout made a model call (2 of 2" in message and "\n" not in message


HALF = """
import openai


def run(task, client_kwargs):
    client = openai.OpenAI(max_retries=0, **client_kwargs)
    reply = client.chat.completions.create(model="Solver", messages=[{"role": "user", "content": task["question"]}])
    if task["meta"]["row"]["fails"]:
        raise ValueError("this one fails")
    return {"reward": 1.0, "answer": reply.choices[0].message.content, "seen": task["meta"]["row"]}
"""


def _program_rollout(tmp_path, fails, **params):
    """One episode per entry of ``fails`` of workflow external running ``HALF`` (the task's row says whether it
    fails)."""
    import dataclasses

    from masrl.rollout.runner import run_episodes
    from masrl.workflows.base import get_workflow

    pytest.importorskip("openai")
    (tmp_path / "half.py").write_text(HALF)
    spec = dataclasses.replace(get_workflow("external"), agents=("Solver",))
    tasks = [Task(id=f"t{i}", question="q", answer="", meta={"row": {"fails": f, "i": i}}) for i, f in enumerate(fails)]
    return run_episodes(spec, tasks, list(range(len(tasks))), call=_Scripted(), scheduler=GatheringScheduler(),
                        score=lambda t, a: {"reward": 0.0}, prompts={}, format_penalty=0.0,
                        params={**spec.params, "entry": f"{tmp_path / 'half.py'}:run", **params})


def test_the_failure_share_of_an_agent_program_is_configurable(tmp_path):
    from masrl.errors import ConfigError
    from masrl.rollout.runner import EpisodeError, rollout_metrics
    from masrl.workflows.external import _params

    episodes = _program_rollout(tmp_path, [True, False, False])  # default 1.0: one of three failing goes on
    assert [e.valid for e in episodes] == [False, True, True]
    metrics = rollout_metrics(episodes)
    assert (metrics["usercode/program/calls"], metrics["usercode/program/errors"]) == (3.0, 1.0)
    with pytest.raises(EpisodeError) as err:
        _program_rollout(tmp_path, [True, False, False], max_error_share=0.3)
    message = str(err.value)
    assert message.startswith(f"{tmp_path / 'half.py'}:run failed on 1 of 3 calls in the rollout (1 error; first: ")
    assert "this one fails" in message and "max_error_share (now 0.3)" in message and "\n" not in message
    for bad in (0, 1.5, "half", True):
        with pytest.raises(ConfigError, match="workflow.params.max_error_share must be a number in"):
            _params(_team({"entry": "x:y", "command": None, "timeout_s": 1, "host": "h", "port": 0, "env": {},
                           "max_error_share": bad}))


def test_a_program_gets_its_tasks_row(tmp_path):
    """``task.meta`` (a verifiers row, a tool environment's reset arguments, a dataset's extra fields) reaches the
    program: ``task["meta"]`` for an entry, the same JSON on a command's stdin."""
    episodes = _program_rollout(tmp_path, [False, False])
    assert [e.valid for e in episodes] == [True, True]
    from masrl.workflows.external import task_payload

    task = Task(id="t", question="q", answer="gold", meta={"row": {"prompt": [{"role": "user", "content": "q"}]}})
    payload = task_payload(task)
    assert payload == {"id": "t", "question": "q", "meta": {"row": {"prompt": [{"role": "user", "content": "q"}]}}}
    assert "gold" not in json.dumps(payload)  # the gold answer is not given


# ----------------------------------------------------------------------------- agent programs: command

class _Session:
    base_url, key = "http://127.0.0.1:9/v1", "k"


def _command(tmp_path, body, timeout_s=5.0):
    from masrl.workflows.external import _run_command

    (tmp_path / "p.py").write_text(textwrap.dedent(body))
    return asyncio.run(_run_command(f"{sys.executable} {tmp_path / 'p.py'}", TASK, _Session(), timeout_s, {}))


def _dead(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return "\nState:\tZ" in status  # a zombie has ended (its parent has not reaped it yet)


def test_a_commands_background_child_is_killed_at_the_end_of_its_episode(tmp_path):
    pid_file = tmp_path / "child.pid"
    result = _command(tmp_path, f'''
        import json, subprocess
        child = subprocess.Popen(["sleep", "60"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        open({str(pid_file)!r}, "w").write(str(child.pid))
        print(json.dumps({{"answer": "done"}}))
    ''')
    assert result == {"answer": "done"}
    assert _eventually(lambda: _dead(int(pid_file.read_text())), 5.0)


def test_a_command_that_exits_while_its_child_holds_stdout_completes_at_its_exit(tmp_path):
    start = time.monotonic()
    result = _command(tmp_path, '''
        import json, subprocess, sys
        subprocess.Popen(["sleep", "30"])  # inherits stdout and stderr: the pipes stay open after this exits
        print(json.dumps({"answer": "done"}))
        sys.stdout.flush()
    ''', timeout_s=3.0)
    assert result == {"answer": "done"} and time.monotonic() - start < 2.5


def test_a_commands_output_is_read_with_a_bound(tmp_path):
    from masrl.usercode.command import MAX_OUTPUT

    tracemalloc.start()
    try:
        result = _command(tmp_path, '''
            import json, sys
            block = b"x" * (1 << 20) + b"\\n"
            for _ in range(24):
                sys.stdout.buffer.write(block)
            print(json.dumps({"answer": "end"}))
        ''', timeout_s=30.0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result == {"answer": "end"}
    assert peak < 6 * MAX_OUTPUT  # 24 MiB printed; only the tail was kept


def test_run_command_keeps_the_tail_and_counts_every_byte():
    from masrl.usercode.command import run_command

    code = "import sys; sys.stdout.write('a' * 3000 + 'END')"
    result = asyncio.run(run_command([sys.executable, "-c", code], b"", dict(os.environ), 10, max_output=100))
    assert result.returncode == 0 and result.stdout.endswith(b"END") and len(result.stdout) == 100
    assert result.stdout_bytes == 3003


# ----------------------------------------------------------------------------- judges

class _Trickle(BaseHTTPRequestHandler):
    """A chat-completions endpoint that sends its reply one byte every 0.1 s (about 8 s in all)."""

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        data = json.dumps({"choices": [{"message": {"content": "yes"}}]}).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            for i in range(len(data)):
                self.wfile.write(data[i:i + 1])
                self.wfile.flush()
                time.sleep(0.1)
        except OSError:
            pass

    def log_message(self, *args):
        pass


def test_a_remote_judge_that_trickles_its_reply_times_out_at_the_deadline(monkeypatch):
    pytest.importorskip("httpx")
    from masrl import judges

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Trickle)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        judge = judges.build_judge({"remote": {"base_url": f"http://127.0.0.1:{httpd.server_address[1]}/v1",
                                               "model": "j", "api_key_env": None, "timeout_s": 1, "retries": 0}}, {})
        start = time.monotonic()
        result = judge(TASK, "4")
        elapsed = time.monotonic() - start
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert result["reason"] == "judge_error" and "no reply within 1 s" in result["detail"]
    assert elapsed < 2.0


def test_judge_and_reward_counts_are_also_usercode_metrics():
    from masrl.judges.stats import JudgeStats
    from masrl.usercode.guard import RewardCounts

    stats = JudgeStats("endpoint", kind="reward_model")
    stats.calls, stats.rewards = 3, [1.0]
    stats.error("no reply within 1 s", timeout=True)
    stats.error("HTTP 400")
    out = stats.pop()
    assert (out["judge/calls"], out["judge/errors"]) == (3.0, 2.0)
    assert (out["usercode/reward_model/calls"], out["usercode/reward_model/errors"],
            out["usercode/reward_model/timeouts"]) == (3.0, 1.0, 1.0)
    assert stats.kind == "reward_model" and stats.calls == 0  # reset, same kind
    counts = RewardCounts(calls=4, errors=1, timeouts=2).metrics()
    assert (counts["reward/errors"], counts["usercode/reward/errors"], counts["usercode/reward/timeouts"]) == \
        (1.0, 1.0, 2.0)


def test_a_logprob_of_1000_is_a_clear_error_not_an_overflow():
    from masrl.judges.verdicts import top_logprob_masses

    with pytest.raises(ValueError, match="logprob of token 'yes' is 1000; a log-probability is at most 0"):
        top_logprob_masses([{"token": "yes", "logprob": 1000}])
    assert top_logprob_masses([{"token": "yes", "logprob": -1e6}, {"token": "no", "logprob": 0.0}]) == (0.0, 1.0)


def test_a_reward_model_logit_of_minus_1000_scores_about_0():
    from masrl.judges.reward_model import RewardModelReward

    rm = SimpleNamespace(opts=SimpleNamespace(normalize="sigmoid"))
    low, high, mid = RewardModelReward.normalize(rm, [-1000.0, 1000.0, 0.0])
    assert low == pytest.approx(0.0, abs=1e-300) and high == 1.0 and mid == 0.5


def test_safe_numbers():
    from masrl.usercode.numbers import finite, safe_exp, sigmoid

    assert safe_exp(1e9) > 1e300 and sigmoid(-1e9) == 0.0 and sigmoid(1e9) == 1.0
    for bad in (float("nan"), float("inf"), True, "1", 10 ** 400):
        with pytest.raises(ValueError, match="the value"):
            finite(bad, "the value")


# ----------------------------------------------------------------------------- one runner of user code

STARTERS = {  # what starts a thread, a process or an event loop: (the module by its last dotted part, the name)
    ("threading", "Thread"), ("threading", "Timer"), ("_thread", "start_new_thread"),
    ("subprocess", "Popen"), ("subprocess", "run"), ("subprocess", "call"), ("subprocess", "check_call"),
    ("subprocess", "check_output"), ("subprocess", "getoutput"), ("subprocess", "getstatusoutput"),
    ("asyncio", "new_event_loop"), ("asyncio", "run"), ("asyncio", "Runner"), ("asyncio", "create_subprocess_exec"),
    ("asyncio", "create_subprocess_shell"), ("asyncio", "to_thread"),
    ("futures", "ThreadPoolExecutor"), ("futures", "ProcessPoolExecutor"),
    ("multiprocessing", "Process"), ("multiprocessing", "Pool"), ("multiprocessing", "spawn"),
    ("os", "fork"), ("os", "forkpty"), ("os", "system"), ("os", "popen"), ("os", "posix_spawn"), ("os", "posix_spawnp"),
    ("os", "spawnv"), ("os", "spawnvp"), ("os", "spawnl"), ("os", "spawnlp"), ("os", "execv"), ("os", "execvp"),
    ("os", "execve"), ("os", "execl"), ("os", "execlp"), ("pty", "spawn"),
}
ANY_OWNER = {"run_in_executor", "subprocess_exec", "subprocess_shell"}  # loop.X(...), whatever the loop is called
CONTEXTS = {"Process", "Pool"}  # multiprocessing.get_context(...).Process(...), ctx.Pool(...)
ALLOWED = {  # the only files that start one, each with why it is not user code (or is the service itself)
    # the user-code service: the one runner of user code
    "src/masrl/usercode/calls.py": "user code in a worker thread, an async def on a loop of its own",
    "src/masrl/usercode/process.py": "a user reward's worker process (and the one thread that starts them)",
    "src/masrl/usercode/command.py": "an agent program's subprocess, in its own process group",
    # the sandbox: model-written programs under the sandbox's own limits (a service of its own)
    "src/masrl/sandbox/_child.py": "the sandboxed child's own forks (setuid drop, the RPC server)",
    "src/masrl/sandbox/_cleanup.py": "the sandbox's background removal of work folders",
    "src/masrl/sandbox/isolation.py": "probing the Python the sandbox runs",
    "src/masrl/sandbox/process.py": "the sandboxed process",
    "src/masrl/sandbox/sandbox.py": "the sandbox's pool that runs programs side by side (score_many)",
    # masrl's own servers, loops and commands
    "src/masrl/http/server.py": "the uvicorn loop's thread of masrl's own HTTP servers (gateway, serve --team, "
                                "retrieval)",
    "src/masrl/rollout/scheduler.py": "the rollout's event loop (masrl's own generation)",
    "src/masrl/rollout/versioned.py": "rollouts-ahead: the producer thread of the next batch (masrl's own rollout)",
    "src/masrl/serve.py": "masrl serve: the team's loop, and generation off it",
    "src/masrl/sweep/run.py": "masrl sweep runs masrl train as subprocesses (masrl's own command)",
    "src/masrl/training/sft.py": "the loop that collects SFT demonstrations (masrl's own rollout)",
    "src/masrl/versions.py": "git and library versions of a run (masrl's own command)",
    "src/masrl/judges/remote.py": "concurrent HTTP requests to a judge endpoint; each request's deadline is kept by "
                                  "masrl.usercode.call_in_thread",
    "src/masrl/workflows/search.py": "a query to masrl's own retriever (masrl.retrieval), off the rollout's loop",
    "src/masrl/workflows/testing.py": "the loop of a scripted test episode (masrl's own test helper)",
}


def _starts(path: Path) -> list[tuple[int, str]]:
    """(line, what) for each call in ``path`` that starts a thread, a process or an event loop: ``module.name(...)``
    (the module by its last dotted part) or ``name(...)`` imported ``from module import name``, any
    ``.run_in_executor(...)`` / ``.subprocess_exec(...)``, and ``get_context(...).Process(...)``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imported = {alias.asname or alias.name: (node.module.split(".")[-1], alias.name)
                for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module for alias in node.names}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Attribute):
            owner = ast.unparse(node.func.value)
            key = (owner.split(".")[-1], node.func.attr)
            if node.func.attr in ANY_OWNER:
                key = ("loop", node.func.attr)
            elif node.func.attr in CONTEXTS and ("get_context(" in owner or owner.split(".")[-1] in ("ctx", "mp")):
                key = ("multiprocessing", node.func.attr)
        elif isinstance(node.func, ast.Name) and node.func.id in imported:
            key = imported[node.func.id]
        else:
            continue
        if key in STARTERS or key[0] == "loop" and key[1] in ANY_OWNER:
            found.append((node.lineno, ".".join(key)))
    return sorted(found)


def test_only_the_usercode_service_starts_threads_processes_or_loops_for_user_code():
    offenders, unused = [], set(ALLOWED)
    for path in sorted((ROOT / "src" / "masrl").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        starts = _starts(path)
        if rel in ALLOWED:
            unused.discard(rel) if starts else None
            continue
        offenders += [f"{rel}:{line}: {what}" for line, what in starts]
    assert offenders == [], ("start user code through masrl.usercode (or justify the file in ALLOWED): "
                             + "; ".join(offenders))
    assert unused == set(), f"ALLOWED names files that start nothing (take them out): {sorted(unused)}"


def test_the_scan_sees_each_way_of_starting_something(tmp_path):
    sample = tmp_path / "s.py"
    sample.write_text(textwrap.dedent('''
        import asyncio, multiprocessing, os, subprocess, threading
        from concurrent.futures import ThreadPoolExecutor, ProcessPoolExecutor
        from threading import Thread
        threading.Thread(target=print).start()
        Thread(target=print)
        subprocess.Popen(["true"])
        asyncio.run(None)
        asyncio.new_event_loop()
        ThreadPoolExecutor(2)
        ProcessPoolExecutor(2)
        multiprocessing.Process(target=print)
        multiprocessing.get_context("spawn").Process(target=print)
        loop.run_in_executor(None, print)
        loop.subprocess_exec(lambda: None, "true")
        os.posix_spawn("/bin/true", ["true"], {})
        subprocess.check_output(["true"])
        psutil.Process()
    '''))
    assert [line for line, _ in _starts(sample)] == list(range(5, 18))  # not psutil.Process()


def test_the_empty_reply_line_and_the_traceback_each_name_a_failure_of_their_own_kind(caplog):
    """A rollout whose lowest-numbered failure is a program error and whose next is an empty model reply: the
    one empty-reply line quotes the empty reply, and the traceback and the summary name the program error."""
    import logging

    from masrl.rollout.runner import report_failures
    from masrl.rollout.scheduler import RolloutStats
    from masrl.types import Episode

    task = Task(id="t0", question="1+1", answer="2")
    boom = ValueError("the environment's own bug")
    crashed = Episode(task=task, turns=[], reward=0.0, episode_id=0, error=f"ValueError: {boom}")
    empty = Episode(task=task, turns=[], reward=0.0, episode_id=1, info={"reason": "empty_reply"},
                    error="EmptyModelResponseError: Model returned no content")
    ok = Episode(task=task, turns=[], reward=1.0, episode_id=2)
    scheduler = SimpleNamespace(stats=RolloutStats())
    with caplog.at_level(logging.INFO, logger="masrl"):
        report_failures(SimpleNamespace(name="environment"), [crashed, empty, ok],
                        [(empty, RuntimeError("empty")), (crashed, boom)], scheduler)
    empty_line = next(r.getMessage() for r in caplog.records if "empty model reply" in r.getMessage())
    assert "(EmptyModelResponseError: Model returned no content)" in empty_line
    error_line = next(r for r in caplog.records if r.levelno == logging.ERROR)
    assert error_line.getMessage().startswith("episode 0 ") and error_line.exc_info[1] is boom
    summary = next(r.getMessage() for r in caplog.records if "episodes failed and are invalid" in r.getMessage())
    assert "the first: ValueError: the environment's own bug in episode 0" in summary
    assert (scheduler.stats.episode_errors, scheduler.stats.empty_replies) == (2, 1)
