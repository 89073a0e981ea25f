"""User code under a contract: a tool's result always becomes a string observation, calls per reply are
capped in every format, text from outside is valid UTF-8 before it reaches a tokenizer, tools have a
deadline, and an episode whose workflow raises is invalid on its own (counted) while the step goes on."""
import json
import threading
import time

import pytest
import yaml

from conftest import tiny_config_dict
from masrl.models.tiny import build_char_tokenizer
from masrl.monitoring.logger import read_metrics
from masrl.tools import Tool, ToolBox, ToolCall, parse_tool_calls, render_tool_call
from masrl.tools.parsing import MAX_ATTEMPTS
from masrl.types import Task
from masrl.workflows.base import Team, register_workflow
from masrl.workflows.parsing import extract_boxed
from masrl.workflows.testing import run_scripted


def _returning(value):
    def result() -> object:
        """Return the prepared value."""
        return value

    return Tool(result)


class _BrokenStr:
    def __str__(self):
        raise RuntimeError("no str")

    __repr__ = __str__

    def __format__(self, spec):
        raise RuntimeError("no format")


class _BadStr(str):
    def __str__(self):
        raise RuntimeError("no str")

    def __len__(self):
        raise RuntimeError("no len")

    def __getitem__(self, item):
        raise RuntimeError("no getitem")

    def encode(self, *args, **kwargs):
        raise RuntimeError("no encode")


class _BadError(Exception):
    def __str__(self):
        raise RuntimeError("no str of the error")


def _raise_bad_error():
    raise _BadError()


class _Unprintable:
    def __repr__(self):
        raise ValueError("no repr")


@pytest.mark.parametrize("value", [
    _BrokenStr(), [_BrokenStr()], {"k": _BrokenStr()}, _BadStr("abc"), b"\xff\xfebytes", bytearray(b"ok"),
    "x" * 2_000_000, list(range(300_000)), {1, 2}, 10 ** 5000, _Unprintable(), "\ud800 lone",
], ids=["broken_str", "list_of_broken", "dict_of_broken", "str_subclass", "bytes", "bytearray", "huge_str",
        "huge_list", "set", "huge_int", "unprintable", "lone_surrogate"])
def test_any_tool_result_becomes_a_string_observation(value):
    result = ToolBox([_returning(value)], max_result_chars=1000).run(ToolCall("result", {}))
    assert type(result.content) is str and len(result.content) < 1200
    result.content.encode("utf-8")  # valid UTF-8
    assert result.message()["content"] == result.content


def test_bytes_are_shown_as_text():
    box = ToolBox([_returning(b"\xff\xfebytes")])
    assert box.run(ToolCall("result", {})).content == "\ufffd\ufffdbytes"  # not a repr "b'...'"


@pytest.mark.parametrize("value", [_BrokenStr(), {"k": _BrokenStr(), "n": 1}, [1, _BrokenStr()], _Unprintable()],
                         ids=["object", "in_a_dict", "in_a_list", "no_repr"])
def test_a_result_whose_str_raises_is_a_tool_error_not_an_ok_placeholder(value):
    box = ToolBox([_returning(value)])
    result = box.run(ToolCall("result", {}))
    assert result.status == "error", result
    assert "cannot be shown as text" in result.content
    assert box.counts.errors == 1 and box.counts.calls == 1


def test_a_tool_that_calls_sys_exit_is_an_error_observation():
    def leave() -> str:
        """Exit."""
        raise SystemExit(0)

    result = ToolBox([Tool(leave)]).run(ToolCall("leave", {}))
    assert result.status == "error" and "sys.exit(0)" in result.content


def test_a_tool_whose_exception_cannot_be_printed_is_an_error_observation():
    def bad() -> str:
        """Raise an exception that cannot be printed."""
        _raise_bad_error()

    result = ToolBox([Tool(bad)]).run(ToolCall("bad", {}))
    assert result.status == "error" and type(result.content) is str and "_BadError" in result.content


def test_a_json_list_of_5000_calls_parses_to_the_cap_and_counts_the_rest():
    calls = [{"name": "calculator", "arguments": {"expression": "1"}}] * 5000
    for text in (json.dumps(calls), "```json\n" + json.dumps(calls) + "\n```", "<|python_tag|>" + json.dumps(calls)):
        parsed = parse_tool_calls(text)
        assert len(parsed.calls) == MAX_ATTEMPTS == 32
        assert parsed.dropped == 5000 - 32
        assert "4968 more" in parsed.errors[-1].message
    hermes = "".join(render_tool_call("calculator", {"expression": "1"}) for _ in range(5000))
    parsed = parse_tool_calls(hermes)
    assert len(parsed.calls) == 32 and parsed.dropped == 5000 - 32


@register_workflow("_test_iso_chat", agents=("Solver",), prompts={})
async def _iso_chat(task: Task, team: Team):
    messages = [{"role": "user", "content": task.question}]
    result = await team.chat("Solver", messages, tools=team.params.get("tools", []), **team.params.get("chat", {}))
    return team.finish(extract_boxed(result.text), results=[(r.name, r.status, r.content) for r in result.results])


def test_a_lone_surrogate_in_a_tool_result_does_not_break_the_next_prompt():
    from masrl.config import PolicyConfig
    from masrl.training.policy import PolicyText

    class _Text(PolicyText):
        def __init__(self, tokenizer):
            self.tokenizer, self.cfg, self.adapter_of = tokenizer, PolicyConfig(), {}

    text = _Text(build_char_tokenizer())
    prompts = []

    def reply(agent, prompt):
        prompts.append(text.encode_prompt(prompt))  # tokenized as in a rollout
        return render_tool_call("result", {}) if len(prompts) == 1 else "\\boxed{1}"

    episode = run_scripted("_test_iso_chat", Task("s", "Q\ud800?", "1"), reply,
                           params={"tools": [_returning("doc \ud800 end")]})
    assert episode.correct and len(prompts) == 2 and all(t.valid for t in episode.turns)
    assert episode.info["results"][0][2] == "doc \ufffd end"
    assert "\ufffd" in episode.turns[1].prompt_text and "\ud800" not in episode.turns[1].prompt_text


def test_a_tool_that_never_returns_is_cut_at_the_deadline():
    from masrl.tools.execute import abandoned_tool_threads

    release = threading.Event()

    def hang() -> str:
        """Wait for an hour."""
        release.wait(3600)
        return "never"

    t0 = time.monotonic()
    box = ToolBox([Tool(hang)], timeout_s=0.3)
    result = box.run(ToolCall("hang", {}))
    assert result.status == "timeout" and time.monotonic() - t0 < 3
    assert box.counts.timeouts == 1 and box.counts.calls == 1
    # in a workflow: the deadline comes from the episode (tools.timeout_s), the timeout is counted
    episode = run_scripted("_test_iso_chat", Task("h", "Q", "1"), {"Solver": [render_tool_call("hang", {}), "\\boxed{1}"]},
                           params={"tools": [Tool(hang)], "chat": {"timeout_s": 0.3}})
    assert episode.info["results"][0][1] == "timeout" and time.monotonic() - t0 < 5
    assert episode.tool_counts["timeouts"] == 1 and episode.tool_counts["calls"] == 1
    assert abandoned_tool_threads() >= 2  # both threads still wait
    release.set()
    deadline = time.monotonic() + 5
    while abandoned_tool_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert abandoned_tool_threads() == 0


# --- rollout isolation: one episode's exception is that episode's, not the step's

FAILURES = {"left": 0}


@register_workflow("_test_flaky", agents=("Solver", "Verifier"), prompts={"Solver": "Q {question}\nS "})
async def _flaky(task: Task, team: Team):
    turn = await team.call("Solver", team.render("Solver", question=task.question))
    if FAILURES["left"] != 0:
        FAILURES["left"] -= 1
        raise KeyError("the workflow broke on " + task.id)
    return team.finish(turn.text)


def _flaky_config(tmp_path, failures: int) -> dict:
    FAILURES["left"] = failures
    return tiny_config_dict(tmp_path, **{"workflow.name": "_test_flaky", "workflow.params": {},
                                         "workflow.prompts": {"Solver": "Q \ud800{question}\nS "},  # a lone surrogate
                                         "agents.Solver.system_prompt": "sys \udfff", "sft.steps": 0,
                                         "trainer.total_steps": 1, "eval.before_after": False})


def test_an_episode_that_raises_is_invalid_and_counted_and_the_step_goes_on(tmp_path, caplog):
    from masrl.config import config_from_dict
    from masrl.trainer import Trainer

    cfg = config_from_dict(_flaky_config(tmp_path, failures=1))
    with Trainer(cfg) as trainer:
        trainer.fit()
        [row] = [m for m in read_metrics(trainer.run_dir) if m.get("phase", "train") == "train"]
    assert row["rollout/episode_errors"] == 1.0 and row["step"] == 1
    assert row["agent/Solver/turns"] == 3 * 4 - 1  # the failed episode's turn is not trained
    assert row["tool/errors"] == row["tool/timeouts"] == row["tool/calls"] == 0.0  # counted every step
    tracebacks = [r.exc_info[0] for r in caplog.records if r.exc_info]
    assert tracebacks == [KeyError]  # the first failure's traceback, once


def test_a_failed_episode_is_reward_0_without_turns():
    from masrl.rollout.runner import run_episodes
    from masrl.rollout.scheduler import RolloutScheduler
    from masrl.workflows.base import get_workflow
    from masrl.evaluation.summary import summarize_episodes
    from masrl.types import Turn
    from masrl.workflows.testing import exact_match_score

    async def call(agent, prompt):
        return Turn(agent, "p", [1], [2], [0.0], "1")

    FAILURES["left"] = 1
    episodes = run_episodes(get_workflow("_test_flaky"), [Task("a", "1", "1"), Task("b", "1", "1")], [0, 1], call=call,
                            scheduler=RolloutScheduler({}), score=exact_match_score, prompts={}, params={},
                            format_penalty=0.1)
    failed, fine = episodes
    assert not failed.valid and failed.reward == 0.0 and failed.turns == [] and not failed.correct
    assert failed.error.startswith("KeyError: 'the workflow broke on a'") and failed.episode_id == 0
    assert fine.valid and fine.error is None and len(fine.turns) == 1
    summary = summarize_episodes(episodes, [1])
    assert summary["episode_errors"] == 1.0 and summary["avg@n"] == 0.5  # a failed episode counts as wrong


def test_every_episode_failing_stops_the_run_with_one_error_line(tmp_path, capsys):
    from masrl.cli import main

    path = tmp_path / "flaky.yaml"
    path.write_text(yaml.safe_dump(_flaky_config(tmp_path, failures=-1)))  # every episode raises
    code = main(["train", str(path)])
    err = capsys.readouterr().err
    assert code != 0
    [line] = [ln for ln in err.splitlines() if ln.startswith("masrl:")]
    assert "every episode" in line and "KeyError: 'the workflow broke on" in line
