"""The kb_fact_check task (a judge's training data over the synthetic knowledge base), the verdict workflow, and
the trained-judge recipe end to end on a tiny model: SFT on the gold verdicts, export merged, judge a team."""
import re
from collections import Counter
from pathlib import Path

import pytest

from masrl.errors import ConfigError
from masrl.tasks.fact_check import DEFAULT_TEMPLATE, RIGHT_KINDS, WRONG_KINDS, kb_fact_check, verdict_score
from masrl.tasks.qa import normalize_answer
from masrl.types import Task

REPO = Path(__file__).resolve().parents[1]
KB = dict(n_people=60, n_companies=8, n_cities=6, name_length=5, relations=["lives_in", "works_for"],
          question_style="cloze", split_by="person")


def test_rows_are_balanced_prompts_of_the_template_with_one_row_per_candidate():
    from masrl.tasks.synthetic_kb import synthetic_kb

    questions, _ = synthetic_kb(0, "train", **KB)
    rows = kb_fact_check(0, "train", pairs=3, **KB)
    assert len(rows) == len(questions) * 3 * 2 and len({r.id for r in rows}) == len(rows)
    assert Counter(r.answer[0] for r in rows) == {"yes": len(rows) // 2, "no": len(rows) // 2}
    by_question = Counter((r.meta["kb_question"], r.answer[0]) for r in rows)
    assert set(by_question.values()) == {3}  # every question: 3 right and 3 wrong candidates
    for r in rows:
        assert r.question == DEFAULT_TEMPLATE.format(question=r.meta["kb_question"], reference=r.meta["reference"],
                                                     answer=r.meta["candidate"])
    kinds = Counter(r.meta["kind"] for r in rows)
    assert set(kinds) == set(RIGHT_KINDS) | set(WRONG_KINDS)  # every kind occurs
    assert rows == kb_fact_check(0, "train", pairs=3, **KB)  # reproducible
    assert [r.question for r in rows] != [r.question for r in kb_fact_check(1, "train", pairs=3, **KB)]


def test_gold_verdicts_are_right():
    """A yes names the reference (exact match up to case, spacing and punctuation, or inside a sentence); a no names
    something else (exact match fails and the reference is not one of its words)."""
    rows = kb_fact_check(0, "train", pairs=4, **KB) + kb_fact_check(0, "test", pairs=4, **KB)
    for r in rows:
        ref, cand = r.meta["reference"], r.meta["candidate"]
        words = re.findall(r"[A-Za-z]+", cand)
        if r.answer == ["yes"]:
            same = normalize_answer(cand) == normalize_answer(ref)
            assert same or (r.meta["kind"] == "sentence" and ref in words), (cand, ref)
        else:
            assert normalize_answer(cand) != normalize_answer(ref) and ref.lower() not in [w.lower() for w in words], \
                (cand, ref)


def test_train_and_test_rows_ask_about_different_people():
    """split_by: person: the judge's training rows never mention a held-out person of the team's knowledge base."""
    from masrl.tasks.synthetic_kb import synthetic_kb

    held_out = {t.meta["subject"] for t in synthetic_kb(0, "test", **KB)[0]}
    train = kb_fact_check(0, "train", **KB)
    test = kb_fact_check(0, "test", **KB)
    assert held_out and test
    assert not any(p in r.question for r in train for p in held_out)
    assert {r.meta["kb_question"].split()[0] for r in test} == held_out


def test_reward_is_the_verdict_against_the_gold_one():
    yes, no = Task("a", "q", ["yes"]), Task("b", "q", ["no"])
    assert verdict_score(yes, "Yes") == {"reward": 1.0, "correct": True, "pred": "yes"}
    assert verdict_score(yes, "no.")["reward"] == 0.0 and verdict_score(no, "No, it is not")["reward"] == 1.0
    assert verdict_score(no, "yes no")["reward"] == 0.0  # the first verdict counts
    for reply in ("maybe", "yesterday", "", None):
        out = verdict_score(yes, reply)
        assert out["reward"] == 0.0 and out["correct"] is False and out["reason"] == "no_verdict"


def test_bad_params_are_one_config_error():
    with pytest.raises(ConfigError, match="task.params.pairs"):
        kb_fact_check(0, "train", pairs=0, **KB)
    with pytest.raises(ConfigError, match=r"task.params.template: missing the field \{answer\}"):
        kb_fact_check(0, "train", template="{question} {reference}", **KB)


def test_the_task_and_the_verdict_workflow_by_name():
    import asyncio

    from masrl.config import load_config
    from masrl.tasks.registry import load_task_source
    from masrl.types import Turn
    from masrl.workflows import get_workflow
    from masrl.workflows.base import Team

    cfg = load_config(str(REPO / "examples" / "judge_train_smollm2.yaml"), [])
    source = load_task_source(cfg.task, cfg.sft.teacher)
    assert len(source.train) == 3200 and len(source.test) == 800
    row = source.test[0]
    assert source.teacher("Judge", row.question, row) == row.answer[0]
    with pytest.raises(ConfigError, match="sft.teacher for kb_fact_check"):
        load_task_source(cfg.task, {"answer_noise": 0.1})
    spec = get_workflow("verdict")
    for reply, valid, reward in (("yes", True, float(row.answer == ["yes"])), ("hmm", False, 0.0)):
        seen = []

        async def call(agent, prompt, reply=reply):
            seen.append((agent, prompt))
            return Turn(agent=agent, policy="judge", prompt_ids=[], response_ids=[], logprobs=[], text=reply)

        team = Team(row, spec, call, source.score, prompts=cfg.workflow.prompts, params={})
        episode = asyncio.run(spec.fn(row, team))
        assert seen == [("Judge", row.question)]  # the judge prompt as it is, nothing added
        assert episode.turns[0].valid is valid and episode.reward == reward


def test_recipe_on_a_tiny_model_trains_exports_and_judges_the_team(tmp_path, monkeypatch):
    """The recipe of examples/judge_train_smollm2.yaml at toy size: SFT of a tiny judge on the gold verdicts,
    `masrl export --merge-lora` to a folder, then examples/judge_kb_team_trained.yaml with that folder as its
    judge for one RL step."""
    import json

    from masrl.cli import main

    monkeypatch.chdir(tmp_path)
    tiny = ["policies.judge.model=tiny", "policies.judge.tiny.hidden_size=32",
            "policies.judge.tiny.num_hidden_layers=1", "policies.judge.tiny.num_attention_heads=2",
            "policies.judge.tiny.num_key_value_heads=2", "policies.judge.tiny.intermediate_size=64"]
    quiet = ["logging.tensorboard=false", "logging.plots=false", "logging.progress=false"]
    assert main(["train", str(REPO / "examples" / "judge_train_smollm2.yaml"), *tiny, *quiet, "sft.steps=2",
                 "sft.batch_size=4", "eval.limit=4", "task.train_limit=16", "agents.Judge.max_new_tokens=2",
                 "--output-dir", "run"]) == 0
    metrics = [json.loads(line) for line in Path("run/metrics.jsonl").read_text().splitlines()]
    assert any("sft/judge/loss" in m for m in metrics)
    # no RL step: one evaluation (after SFT), which is also the final one (the same weights and seed)
    assert [m["step"] for m in metrics if m.get("phase") == "eval"] == [0]
    report = json.loads(Path("run/report.json").read_text())
    assert report["eval"]["final"] == report["eval"]["sft"] and "avg@n" in report["eval"]["final"]
    assert main(["export", "run", "--out", "judges/kb", "--merge-lora"]) == 0
    folder = Path("judges/kb/judge")
    assert (folder / "config.json").is_file() and not (folder / "adapter_config.json").exists()
    # the judge example with that folder as its judge: the task's score is the exported model, judging one answer
    from masrl.config import load_config
    from masrl.tasks.registry import load_task_source

    cfg = load_config(str(REPO / "examples" / "judge_kb_team_trained.yaml"),
                      [f"task.params.reward.judge.model={folder}"])
    source = load_task_source(cfg.task, cfg.sft.teacher)
    score, task = source.score, source.test[0]
    assert score.backend.endpoint == f"local judge {str(folder)!r}"
    out = score.score_batch([(task, task.answer[0])])[0]
    assert score.stats.calls == 1 and "heldout_correct" in out and out.get("reason") in (None, "judge_unparsed")


def test_the_recipe_configs_validate(tmp_path, capsys):
    """`masrl config show` on the judge's training config, and on the team's with its judge folder missing: one
    clear line naming the key, exit 2 (the recipe's export comes first)."""
    from masrl.cli import main

    assert main(["config", "show", str(REPO / "examples" / "judge_train_smollm2.yaml")]) == 0
    shown = capsys.readouterr().out
    assert "name: kb_fact_check" in shown and "name: verdict" in shown
    assert main(["config", "show", str(REPO / "examples" / "judge_kb_team_trained.yaml"),
                 f"task.params.reward.judge.model={tmp_path / 'no_judge'}"]) == 2
    err = capsys.readouterr().err
    assert "task.params.reward.judge.model" in err and "Traceback" not in err
