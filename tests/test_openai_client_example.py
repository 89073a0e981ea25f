"""examples/openai_client_team.py: the quickstart's Solver + Verifier written with the plain openai client, trained
through the gateway. Its cold-start demonstrations are the built-in team's, row for row; its rollouts follow the
built-in `math_solver_verifier` rules (prompts, validity, stop on approve), as a command too."""
import copy
import sys
from pathlib import Path

import pytest
import torch

from masrl.config import load_config
from masrl.trainer import Trainer
from masrl.training.sft import collect_demonstrations
from masrl.workflows.base import render
from masrl.workflows.parsing import extract_boxed, parse_choice

pytest.importorskip("openai")
REPO = Path(__file__).resolve().parents[1]
SMALL = ["policies.shared.tiny={hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 2, "
         "num_key_value_heads: 2, intermediate_size: 64}", "sft.steps=0", "logging.progress=false",
         "task.params.train_size=64", "task.params.test_size=8"]


@pytest.fixture
def repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)  # the example names its program as examples/openai_client_team.py
    torch.set_num_threads(1)


def _trainer(name, tmp_path, *over):
    cfg = load_config(f"examples/{name}.yaml", [*SMALL, f"output_dir={tmp_path / name}", *over])
    return Trainer(cfg, progress=False)


def _demonstrations(trainer, tasks):
    cfg = trainer.cfg
    teacher = copy.deepcopy(trainer.source.teacher)  # the same random stream for both teams
    rows = collect_demonstrations(trainer.spec, tasks, teacher, policies=trainer.policies, agents=cfg.agents,
                                  score=trainer.source.score, prompts=cfg.workflow.prompts, params=trainer.params)
    return [(r.agent, r.prompt_ids, r.response_ids) for r in rows]


def test_the_program_gets_the_built_in_teams_demonstrations(repo_cwd, tmp_path):
    """The teacher answers the program's gateway calls reading the rendered prompt: same rows, same order, the
    Verifier's verdicts included (as a conversation the teacher would box an answer instead)."""
    with _trainer("quickstart", tmp_path) as builtin, _trainer("openai_client_team", tmp_path) as external:
        tasks = builtin.source.train[:40]
        assert [t.question for t in tasks] == [t.question for t in external.source.train[:40]]
        want, got = _demonstrations(builtin, tasks), _demonstrations(external, tasks)
    tok = builtin.policies["shared"].tokenizer
    verdicts = [tok.decode(r) for a, _, r in want if a == "Verifier"]
    assert len(want) > len(tasks) and any("reject" in v for v in verdicts) and any("approve" in v for v in verdicts)
    assert got == want


def test_rollouts_follow_the_built_in_rules(repo_cwd, tmp_path):
    """An untrained model writes mostly malformed replies: every prompt is the quickstart's template over the
    episode's earlier replies, a reply without a box / verdict is an invalid turn (invalid_calls), an untagged
    verdict counts as a rejection and an approval ends the episode."""
    with _trainer("openai_client_team", tmp_path, "trainer.batch_size=4", "trainer.group_size=4") as tr:
        quick = load_config("examples/quickstart.yaml", []).workflow.prompts
        tasks = tr.source.train[:12]
        episodes = tr.rollout(tasks, list(range(len(tasks))), seed=3)
        tok = tr.policies["shared"].tokenizer
    validity = set()
    for ep in episodes:
        assert ep.error is None and ep.answer == [t for t in ep.turns if t.agent == "Solver"][-1].text
        context, agents = "", []
        for turn in ep.turns:
            prompt = render(quick[turn.agent], question=ep.task.question, context=context)
            assert turn.prompt_ids == tok(prompt, add_special_tokens=False)["input_ids"]
            if turn.agent == "Solver":
                assert turn.valid == (extract_boxed(turn.text) is not None)
            else:
                assert turn.valid == (parse_choice(turn.text, "verify", ("approve", "reject")) is not None)
            validity.add(turn.valid)
            agents.append(turn.agent)
            context += render(quick["context"], text=turn.text)
        verdict = parse_choice(ep.turns[1].text, "verify", ("approve", "reject")) or "reject"
        assert agents == ["Solver", "Verifier"] + (["Solver"] if verdict == "reject" else [])
    assert validity == {True, False}  # both kinds occurred


def test_the_program_as_a_command(repo_cwd, tmp_path):
    """`python examples/openai_client_team.py`: one process per episode, task on stdin, result on stdout."""
    command = f"workflow.params={{command: '{sys.executable} examples/openai_client_team.py', timeout_s: 120}}"
    with _trainer("openai_client_team", tmp_path, command) as tr:
        assert tr.params["entry"] is None
        episodes = tr.rollout(tr.source.train[:2], [0, 1], seed=1)
    for ep in episodes:
        assert ep.error is None and [t.agent for t in ep.turns][:2] == ["Solver", "Verifier"]
        assert all(t.valid == (extract_boxed(t.text) is not None) for t in ep.turns if t.agent == "Solver")


def test_concurrent_demonstrations_do_not_depend_on_arrival_order_and_stop_at_the_need(repo_cwd, tmp_path):
    """sft.concurrency programs at once: each task draws the teacher's noise from its own stream, so 2 and 6 at
    once give the same rows; with a need (SFT's steps x batch size) collection stops after the shortest prefix of
    tasks that gives it, the same rows as the full collection's start; progress is reported per task."""
    with _trainer("openai_client_team", tmp_path) as external:
        cfg, tasks = external.cfg, external.source.train[:24]

        def rows(concurrency, need=None, on_task=None):
            teacher = copy.deepcopy(external.source.teacher)
            got = collect_demonstrations(external.spec, tasks, teacher, policies=external.policies, agents=cfg.agents,
                                         score=external.source.score, prompts=cfg.workflow.prompts,
                                         params=external.params, concurrency=concurrency, need=need, on_task=on_task)
            return [(r.agent, r.prompt_ids, r.response_ids) for r in got]

        full = rows(2)
        assert rows(6) == full and len(full) > 2 * len(tasks)
        reports = []
        cut = rows(6, need=20, on_task=lambda *a: reports.append(a))
    assert 20 <= len(cut) < len(full) and cut == full[:len(cut)]
    assert len(cut) - 20 < 4  # the last task's turns at most past the need: the prefix is the shortest
    assert reports and reports[-1][0] < len(tasks) and reports[-1][2] < len(tasks)  # (done, turns, expected)


def test_the_trainer_collects_an_external_programs_demonstrations_with_progress(repo_cwd, tmp_path, capsys):
    from masrl.trainer import demonstrations

    cfg = load_config("examples/openai_client_team.yaml", [*SMALL, f"output_dir={tmp_path}", "sft.steps=2",
                                                           "sft.batch_size=8"])
    with Trainer(cfg, progress=True) as tr:
        rows = demonstrations(tr)
    out = capsys.readouterr().out
    assert 16 <= len(rows) < 24, len(rows)
    assert "[demonstrations " in out and "eta" in out
    assert f"[masrl] {len(rows)} demonstrations in " in out and "of the 64 training tasks run" in out


def test_the_example_cites_nothing_a_wheel_user_lacks():
    """The example ships in the wheel, benchmarks/ does not: its text points at the docs, and names its extra."""
    for name in ("openai_client_team.py", "openai_client_team.yaml"):
        text = (REPO / "examples" / name).read_text()
        assert "benchmarks/" not in text, name
        assert "pip install 'masrl[openai]'" in text, name
