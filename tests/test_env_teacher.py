"""Cold-start SFT for environment tasks (task.params.teacher): the teacher answers the agent's calls while the
environment's own episodes run through the gateway, one demonstration row per call; its options come from
sft.teacher (seed: its random stream). Skipped without the extras (pip install masrl[verifiers], masrl[openai])."""
import random
from pathlib import Path

import pytest

pytest.importorskip("openai", reason="the episode's client is the openai package: pip install masrl[openai]")
EXAMPLES = Path(__file__).parents[1] / "examples"


def _trainer_cfg(tiny_cfg, task, agent, **over):
    from masrl.config import config_from_dict

    d = tiny_cfg(**{"task": task, "workflow": {"name": "environment", "params": {"timeout_s": 120}},
                    "sft.steps": 2, "sft.batch_size": 4, "sft.concurrency": 2, "trainer.total_steps": 0,
                    "eval.before_after": False, "logging.plots": False, **over})
    d["agents"] = {agent: {"policy": "shared", "max_new_tokens": 8}}
    return config_from_dict(d)


def test_the_guess_teacher_bisects_through_the_tool_results_and_each_call_is_a_row(tiny_cfg):
    from masrl.tasks.environments.tool_env import tool_env_source
    from masrl.config import TaskConfig
    from masrl.trainer import Trainer, demonstrations

    guess = str(EXAMPLES / "tool_env_guess.py")
    task = {"name": "tool_env", "params": {"env": f"{guess}:GuessNumber", "train": f"{guess}:test_rows",
                                           "max_turns": 4, "teacher": f"{guess}:teacher"}}
    cfg = _trainer_cfg(tiny_cfg, task, "Player", **{"sft.teacher": {"slip_rate": 0.0, "seed": 3}})
    with Trainer(cfg) as trainer:
        trainer.source.train = [t for t in trainer.source.train if t.meta["row"]["target"] in (3, 5)]
        rows = demonstrations(trainer)
        policy = trainer.policies["shared"]
        texts = [policy.tokenizer.decode(r.response_ids, skip_special_tokens=False) for r in rows]
    # target 3: 5 (lower) -> 2 (higher) -> 3 (correct, done: no further call); target 5: 5 at once
    assert [t.count('"n": ') for t in texts] == [1, 1, 1, 1]
    assert [int(t.split('"n": ')[1].split("}")[0]) for t in texts] == [5, 2, 3, 5]
    assert all("<tool_call>" in t and '"name": "guess"' in t for t in texts)
    source = tool_env_source(TaskConfig(name="tool_env", params=task["params"]), {"slip_rate": 1.0, "seed": 0})
    assert source.teacher is not None  # a slip_rate 1 teacher guesses anywhere in the range
    assert {getattr(source.teacher, "__self__").rng.__class__} == {random.Random}


ENV_MODULE = '''
import verifiers as vf
from datasets import Dataset


def load_environment(n=4):
    def exact(completion, answer, **kw):
        return float(completion[-1]["content"].strip() == answer)

    rows = [{"question": f"{i}+{i}", "answer": str(2 * i)} for i in range(n)]
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[exact]))


def teacher(agent, messages, row, rng, prefix=""):
    return prefix + row["answer"]


def bad_teacher(agent, messages):
    return "x"
'''


def test_a_verifiers_environment_collects_its_teacher_demonstrations_and_trains_sft(tiny_cfg, tmp_path):
    pytest.importorskip("verifiers", reason="the verifiers extra is not installed: pip install masrl[verifiers]")
    from masrl.trainer import Trainer, demonstrations

    (tmp_path / "my_env.py").write_text(ENV_MODULE)
    task = {"name": "verifiers", "params": {"env": f"{tmp_path / 'my_env.py'}:load_environment",
                                            "teacher": f"{tmp_path / 'my_env.py'}:teacher"}}
    cfg = _trainer_cfg(tiny_cfg, task, "Solver", **{"sft.teacher": {"prefix": "=", "seed": 0}})
    with Trainer(cfg) as trainer:
        rows = demonstrations(trainer)
        policy = trainer.policies["shared"]
        texts = sorted(policy.tokenizer.decode(r.response_ids, skip_special_tokens=True) for r in rows)
        assert texts == ["=0", "=2", "=4", "=6"]  # one call per single-turn episode, the row's answer
        assert all(r.agent == "Solver" and r.prompt_ids for r in rows)
        before = [p.detach().clone() for p in policy.model.parameters()]
        trainer.fit()  # the cold start, no RL step
        assert any((a != b).any() for a, b in zip(before, policy.model.parameters()))


def test_a_teacher_with_the_wrong_signature_or_without_a_task_teacher_is_one_clear_error(tiny_cfg, tmp_path):
    pytest.importorskip("verifiers", reason="the verifiers extra is not installed: pip install masrl[verifiers]")
    from masrl.config import TaskConfig
    from masrl.errors import ConfigError
    from masrl.tasks.environments.verifiers_env import verifiers_source

    (tmp_path / "my_env.py").write_text(ENV_MODULE)
    env = f"{tmp_path / 'my_env.py'}:load_environment"
    with pytest.raises(ConfigError, match=r"\(agent, messages, row, rng, \*\*options\)"):
        verifiers_source(TaskConfig(name="verifiers", params={"env": env, "teacher": f"{tmp_path / 'my_env.py'}:"
                                                                                      "bad_teacher"}), {})
    with pytest.raises(ConfigError, match="sft.teacher"):  # an option the teacher does not take
        verifiers_source(TaskConfig(name="verifiers", params={"env": env, "teacher": f"{tmp_path / 'my_env.py'}:"
                                                                                      "teacher"}), {"nope": 1})
    assert verifiers_source(TaskConfig(name="verifiers", params={"env": env}), {}).teacher is None


def test_the_arithmetic_example_environment_and_its_teacher_agree_with_its_rubric():
    pytest.importorskip("verifiers", reason="the verifiers extra is not installed: pip install masrl[verifiers]")
    import ast

    from masrl.tasks.environments.verifiers_env import load_environment, rows_to_tasks

    path = EXAMPLES / "verifiers_arith.py"
    tree = ast.parse(path.read_text())
    assert not any(isinstance(n, (ast.Import, ast.ImportFrom)) and "masrl" in ast.dump(n) for n in ast.walk(tree))
    env = load_environment(f"{path}:load_environment", {"num_train": 30, "num_eval": 10})
    train, test = rows_to_tasks(env.get_dataset(), "a"), rows_to_tasks(env.get_eval_dataset(), "a")
    assert len(train) == 30 and len(test) == 10 and not {t.question for t in train} & {t.question for t in test}
    from masrl.usercode.imports import import_object

    teacher = import_object(f"{path}:teacher", "teacher")
    row = {"question": "7-3+9", "answer": "13"}
    assert teacher("Solver", [], row, random.Random(0)) == "7-3=4\n4+9=13\n\\boxed{13}"
    slipped = teacher("Solver", [], row, random.Random(0), slip_rate=1.0)
    assert slipped.startswith("7-3=4\n4+9=13\n\\boxed{") and not slipped.endswith("{13}")
    score = next(f for f in env.rubric._get_reward_funcs() if f.__name__ == "correct_answer")
    assert [score(completion=[{"role": "assistant", "content": t}], answer="13") for t in
            ("7-3=4\n4+9=13\n\\boxed{13}", slipped)] == [1.0, 0.0]


def test_a_teacher_is_user_code_its_exit_comes_back_as_an_error_not_the_end_of_the_run(tmp_path):
    from masrl.types import Task
    from masrl.usercode.calls import UserCodeExit
    from masrl.usercode.teacher import load_teacher

    (tmp_path / "t.py").write_text("import sys\ndef teacher(agent, messages, row, rng):\n    sys.exit(0)\n"
                                   "def good(agent, messages, row, rng):\n    return {'name': 'f', 'arguments': {'x': 1}}\n")
    task = Task(id="t0", question="q", answer=None, meta={"row": {}})
    with pytest.raises(UserCodeExit):
        load_teacher(f"{tmp_path / 't.py'}:teacher", {})("A", "prompt", task)
    reply = load_teacher(f"{tmp_path / 't.py'}:good", {})("A", "prompt", task)
    assert reply == '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
