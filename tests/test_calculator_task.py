"""The tools experiment: long arithmetic, the calculator_math workflow, the tool-using teacher,
and the example config training end to end with tool messages masked out of the loss."""
import re
from pathlib import Path

import pytest

from masrl.errors import ConfigError
from masrl.tasks.arithmetic import ArithmeticConfig, ArithmeticTeacher, calculator_call, make_arithmetic_tasks
from masrl.tasks.math_reward import math_score
from masrl.tools import render_tool_call
from masrl.types import Task
from masrl.workflows.testing import run_scripted

ROOT = Path(__file__).resolve().parents[1]
TASK = Task("t", "23+45-17+88", "139")


def _teacher_run(teacher, tools="calculator", task=TASK):
    return run_scripted("calculator_math", task, lambda agent, prompt: teacher.reply(agent, prompt, task),
                        score=math_score, params={"tools": tools})


def test_the_teacher_calls_the_calculator_then_boxes_its_result():
    assert calculator_call(TASK.question) == render_tool_call("calculator", {"expression": TASK.question})
    episode = _teacher_run(ArithmeticTeacher())
    assert episode.correct and episode.info["tool_calls"] == 1 and episode.info["stop"] == "answer"
    assert [t.text for t in episode.turns] == [calculator_call(TASK.question), "\\boxed{139}"]
    assert "tool: 139" in episode.turns[1].prompt_text
    direct = _teacher_run(ArithmeticTeacher(), tools="none")  # the baseline: no tools, a direct answer
    assert direct.correct and [t.text for t in direct.turns] == ["\\boxed{139}"] and direct.info["tool_calls"] == 0


def test_the_teachers_noise_skips_the_tool_or_slips_on_the_number():
    skipped = _teacher_run(ArithmeticTeacher(skip_rate=1.0))
    assert [t.text for t in skipped.turns] == ["\\boxed{139}"] and skipped.correct
    slipped = _teacher_run(ArithmeticTeacher(slip_rate=1.0))
    assert len(slipped.turns) == 2 and not slipped.correct
    assert slipped.turns[1].text != "\\boxed{139}" and slipped.turns[1].text.startswith("\\boxed{")
    teacher = ArithmeticTeacher(slip_rate=0.2, skip_rate=0.1, seed=0)
    train, _ = make_arithmetic_tasks(ArithmeticConfig(train_size=400, test_size=0, min_terms=4, max_terms=6,
                                                      max_operand=99))
    episodes = [_teacher_run(teacher, task=t) for t in train]
    correct = sum(e.correct for e in episodes) / len(episodes)
    skip = sum(e.info["tool_calls"] == 0 for e in episodes) / len(episodes)
    assert 0.72 < correct < 0.88 and 0.05 < skip < 0.16, (correct, skip)
    with pytest.raises(ConfigError, match="sft.teacher.skip_rate must be a number in"):
        ArithmeticTeacher(skip_rate=1.5)


def test_workflow_params_are_checked():
    with pytest.raises(ConfigError, match="param 'tools' must be one of \\['calculator', 'none'\\]"):
        _teacher_run(ArithmeticTeacher(), tools="abacus")
    no_box = run_scripted("calculator_math", TASK, {"Solver": ["139"]}, score=math_score)
    assert not no_box.turns[0].valid and not no_box.correct


@pytest.mark.parametrize("name", ["tools_calculator", "tools_calculator_notools", "smollm2_tools"])
def test_the_example_configs_load(name):
    from masrl.config import load_config

    cfg = load_config(ROOT / "examples" / f"{name}.yaml")
    assert cfg.workflow.params["tools"] == ("none" if name.endswith("notools") else "calculator")
    assert cfg.trainer.merge_conversations


def test_the_two_calculator_arms_differ_only_in_the_tools():
    """E6 compares tools_calculator with tools_calculator_notools: the task (2-term expressions, products
    included, so copying is easy and mental arithmetic hard), SFT, noise and RL must be identical."""
    from masrl.io.bounded_yaml import read_yaml_file

    arms = [read_yaml_file(ROOT / "examples" / f"{n}.yaml") for n in ("tools_calculator", "tools_calculator_notools")]
    for arm in arms:
        arm.pop("name"), arm["workflow"]["params"].pop("tools")
    assert arms[0] == arms[1]
    assert arms[0]["task"]["params"]["max_terms"] == 2 and "*" in arms[0]["task"]["params"]["ops"]


def test_the_tool_team_trains_end_to_end_with_tool_tokens_masked(tmp_path):
    """examples/tools_calculator.yaml at tiny sizes: SFT, 2 RL steps; the episodes hold tool messages and the
    merged rows train the call and the answer with the tool output (and template markers) masked out."""
    from masrl.config import apply_overrides, config_from_dict
    from masrl.io.bounded_yaml import read_yaml_file
    from masrl.trainer import Trainer

    data = apply_overrides(read_yaml_file(ROOT / "examples" / "tools_calculator.yaml"), [
        f"output_dir={tmp_path / 'run'}", "task.params.train_size=64", "task.params.test_size=4",
        "policies.solver.tiny.hidden_size=64", "policies.solver.tiny.num_hidden_layers=2",
        "policies.solver.tiny.num_attention_heads=2", "policies.solver.tiny.num_key_value_heads=2",
        "policies.solver.tiny.intermediate_size=128",
        "sft.steps=60", "sft.batch_size=16", "sft.lr=1.0e-2", "trainer.total_steps=2", "trainer.batch_size=4",
        "trainer.group_size=4", "eval.n=1", "eval.k=[1]", "eval.limit=2", "logging.progress=false",
        "logging.tensorboard=false", "logging.plots=false"])
    trainer = Trainer(config_from_dict(data))
    seen: dict[str, list] = {"episodes": [], "rows": []}
    rollout, update = trainer.rollout, trainer.runtime.update

    def spy_rollout(*args, **kwargs):
        episodes = rollout(*args, **kwargs)
        seen["episodes"] += episodes
        return episodes

    def spy_update(policies, rows, **kwargs):
        seen["rows"] += rows["solver"]
        return update(policies, rows, **kwargs)

    trainer.rollout, trainer.runtime.update = spy_rollout, spy_update
    report = trainer.fit()
    assert report is not None and trainer.step == 2
    tokenizer = trainer.policies["solver"].tokenizer
    with_tool = [e for e in seen["episodes"] if e.info.get("tool_calls")]
    assert with_tool, "no episode called the calculator"
    merged = [r for r in seen["rows"] if r.loss_mask is not None and 0 in r.loss_mask]
    assert merged, "no call + answer pair was trained as one sequence"
    replies = {tuple(i for t in e.turns[a:b] for i in t.response_ids)  # consecutive replies of one episode
               for e in with_tool for a in range(len(e.turns)) for b in range(a + 2, len(e.turns) + 1)}
    for row in merged:
        masked = tokenizer.decode([i for i, m in zip(row.response_ids, row.loss_mask) if not m],
                                  skip_special_tokens=False)
        assert re.fullmatch(r"((</s>)?(<tool_response>.*?</tool_response>)+)+", masked, re.S), masked
        assert tuple(i for i, m in zip(row.response_ids, row.loss_mask) if m) in replies


def test_the_e6_sweep_compares_the_two_example_configs(monkeypatch):
    from masrl.sweep.spec import expand_runs, load_spec

    monkeypatch.chdir(ROOT)  # sweep paths are relative to the repository root
    spec = load_spec("benchmarks/study/e6_tools.yaml")
    runs = expand_runs(spec, Path("runs/study/e6"))
    assert [(r.cell.labels, r.seed) for r in runs][:2] == [((("tools", "none"),), 0), ((("tools", "calculator"),), 0)]
    assert sorted({r.seed for r in runs}) == [0, 1, 2] and len(runs) == 6
    tools = {r.config().workflow.params["tools"] for r in runs}
    assert tools == {"none", "calculator"}
