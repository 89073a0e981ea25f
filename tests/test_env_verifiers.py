"""verifiers (v0) environments as masrl tasks (task: verifiers, workflow: environment): dataset rows -> tasks, each
episode the environment's own rollout through masrl's gateway (recorded turns of the agent named as `model`), the
rubric's reward as the episode reward and each rubric function's score as `env/<name>`; single- and multi-turn,
and a tool environment. Skipped without the verifiers extra (pip install masrl[verifiers])."""
import json
import os
import textwrap
from pathlib import Path

import pytest

vf = pytest.importorskip("verifiers", reason="the verifiers extra is not installed: pip install masrl[verifiers]")
pytest.importorskip("openai", reason="the environment's client is the openai package: pip install masrl[openai]")

ENV_MODULE = '''
import verifiers as vf
from datasets import Dataset


def rows(n):
    return [{"question": f"{i}+{i}", "answer": str(2 * i), "info": {"n": i}} for i in range(n)]


def load_environment(n=4):
    def exact(completion, answer, **kw):
        return float(completion[-1]["content"].strip() == answer)

    def length(completion, **kw):
        return float(len(completion[-1]["content"]))

    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows(n)), rubric=vf.Rubric(funcs=[exact, length], weights=[1.0, 0.01]))


class TwoRounds(vf.MultiTurnEnv):
    """The environment answers once ("again"), then the episode ends after the agent's second turn."""

    async def env_response(self, messages, state, **kw):
        return [{"role": "user", "content": "again"}]


def load_two_rounds(n=4):
    def turns(state, **kw):
        return float(len(state["trajectory"]))

    return TwoRounds(dataset=Dataset.from_list(rows(n)), max_turns=2, rubric=vf.Rubric(funcs=[turns]))


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def load_tool_env(n=4):
    def answered(completion, **kw):
        return float(bool(completion))

    return vf.ToolEnv(dataset=Dataset.from_list(rows(n)), tools=[add], max_turns=3, rubric=vf.Rubric(funcs=[answered]))


def load_broken(n=4):
    return 42


class EmptyOnOdd(vf.SingleTurnEnv):
    """An untrained model's empty reply, as verifiers reports it, on the odd rows."""

    async def get_model_response(self, state, prompt, **kw):
        response = await super().get_model_response(state, prompt, **kw)
        if int(state["answer"]) % 4 == 2:
            raise vf.EmptyModelResponseError("Model returned no content and did not call any tools")
        return response


def load_empty_on_odd(n=4):
    return EmptyOnOdd(dataset=Dataset.from_list(rows(n)), rubric=vf.Rubric(funcs=[lambda completion, **kw: 1.0]))
'''


def _cfg(tiny_cfg, tmp_path, env, **over):
    from masrl.config import config_from_dict

    (tmp_path / "my_env.py").write_text(ENV_MODULE)
    d = tiny_cfg(**{"task": {"name": "verifiers", "params": {"env": f"{tmp_path / 'my_env.py'}:{env}"}},
                    "workflow": {"name": "environment", "params": {"timeout_s": 120}}, "sft.steps": 0,
                    "trainer.total_steps": 1, "trainer.batch_size": 2, "trainer.group_size": 2,
                    "eval.before_after": False, "logging.plots": False, **over})
    d["agents"] = {"Solver": {"policy": "shared", "max_new_tokens": 8}}
    return config_from_dict(d)


def test_rows_become_tasks_and_a_training_step_logs_each_rubric_function(tiny_cfg, tmp_path):
    from masrl.trainer import Trainer

    cfg = _cfg(tiny_cfg, tmp_path, "load_environment")
    with Trainer(cfg) as trainer:
        task = trainer.source.train[1]
        assert (task.question, task.answer) == ("1+1", "2")
        assert task.meta["row"]["info"] == {"n": 1} and task.meta["row"]["prompt"][-1]["content"] == "1+1"
        episodes = trainer.rollout(trainer.source.train[:2], [0, 1], seed=1)
        for ep in episodes:
            assert ep.error is None and [t.agent for t in ep.turns] == ["Solver"]
            turn = ep.turns[0]
            assert turn.prompt_ids and len(turn.response_ids) == len(turn.logprobs) > 0
            assert ep.answer == turn.text  # the environment saw exactly the sampled reply
            exact = float(turn.text.strip() == ep.task.answer)
            assert ep.info["env_metrics"]["length"] == len(turn.text)
            assert ep.reward == pytest.approx(exact + 0.01 * len(turn.text))  # the rubric's weighted sum
            assert ep.correct == (ep.reward >= 0.5)  # verifiers' pass_threshold, not reward >= 1
        trainer.fit()
    rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["phase"] == "train"]
    assert len(train) == 1 and "env/exact" in train[0] and train[0]["env/length"] > 0


def test_a_multi_turn_environment_continues_the_agent_conversation(tiny_cfg, tmp_path):
    from masrl.trainer import Trainer

    cfg = _cfg(tiny_cfg, tmp_path, "load_two_rounds")
    with Trainer(cfg) as trainer:
        episodes = trainer.rollout(trainer.source.train[:1], [0], seed=1)
    ep = episodes[0]
    assert ep.error is None and len(ep.turns) == 2 and ep.reward == 2.0
    first, second = ep.turns
    # the second call extends the first's ids (no re-tokenization): prompt = first prompt + reply + ...
    assert second.prompt_ids[:len(first.prompt_ids)] == first.prompt_ids
    assert "again" in second.prompt_text


def test_a_tool_environment_runs_through_the_gateway(tiny_cfg, tmp_path):
    from masrl.trainer import Trainer

    cfg = _cfg(tiny_cfg, tmp_path, "load_tool_env")
    with Trainer(cfg) as trainer:
        episodes = trainer.rollout(trainer.source.train[:2], [0, 1], seed=1)
    for ep in episodes:
        assert ep.error is None and ep.turns and ep.reward == 1.0
        assert "total_tool_calls" in ep.info["env_metrics"]


def test_empty_replies_are_counted_and_reported_in_one_line_per_run(tiny_cfg, tmp_path, caplog, capfd):
    import logging

    from masrl.rollout.runner import rollout_metrics
    from masrl.trainer import Trainer

    cfg = _cfg(tiny_cfg, tmp_path, "load_empty_on_odd")
    with Trainer(cfg) as trainer, caplog.at_level(logging.INFO):
        runs = [trainer.rollout(trainer.source.train[:4], [0, 1, 2, 3], seed=s) for s in (1, 2)]
    for episodes in runs:
        assert [e.valid for e in episodes] == [True, False, True, False]
        assert [e.info.get("reason") for e in episodes if not e.valid] == ["empty_reply"] * 2
        assert rollout_metrics(episodes)["rollout/empty_replies"] == 2.0
    records = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("masrl")]
    assert [r.exc_info for r in records] == [None] and "empty model reply" in records[0].getMessage()
    assert "Aborted rollout" not in capfd.readouterr().err  # verifiers' own line per episode is dropped


def test_bad_environment_specs_are_one_clear_error(tiny_cfg, tmp_path):
    from masrl.errors import ConfigError
    from masrl.team_runner import load_tasks

    with pytest.raises(ConfigError, match="not a verifiers Environment"):
        load_tasks(_cfg(tiny_cfg, tmp_path, "load_broken"))
    with pytest.raises(ConfigError, match="has no attribute"):
        load_tasks(_cfg(tiny_cfg, tmp_path, "nothing_here"))
    with pytest.raises(ConfigError, match="not installed|Could not import"):
        load_tasks(_cfg(tiny_cfg, tmp_path, "x", **{"task.params.env": "no_such_environment_pkg"}))
    with pytest.raises(ConfigError, match="unknown keys"):
        load_tasks(_cfg(tiny_cfg, tmp_path, "load_environment", **{"task.params.envargs": {}}))


def test_the_gsm8k_example_environment_loads_shared_rows():
    import importlib.util

    example = Path(__file__).parents[1] / "examples" / "verifiers_gsm8k.py"
    spec = importlib.util.spec_from_file_location("verifiers_gsm8k_example", example)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    data = module._data_dir()  # the example's own lookup (it imports nothing from masrl), not masrl.paths'
    if not (data / "math" / "gsm8k_train.jsonl").is_file():
        pytest.skip(f"GSM8K rows not in {data} (MASRL_DATA_DIR, else ../shared/data beside the checkout)")
    from masrl.tasks.environments.verifiers_env import load_environment, rows_to_tasks

    env = load_environment(f"{example}:load_environment", {"num_train": 3, "num_eval": 2})
    tasks = rows_to_tasks(env.get_dataset(), "gsm8k")
    assert len(tasks) == 3 and tasks[0].answer == "72" and "Natalia" in tasks[0].question
