"""task: {name: dataset}: jsonl/json/parquet/hf files with field mapping, built-in and user rewards
(per-turn rewards with algorithm.reward: per_turn), the shipped example, and the shared data files."""
import json
import warnings
from pathlib import Path

import pytest
import yaml

from masrl.config import TaskConfig, config_from_dict, load_config
from masrl.paths import data_dir
from masrl.tasks.dataset import load_rows_as_tasks
from masrl.tasks.math_data import DatasetLoadError
from masrl.io.rows import MalformedRowWarning
from masrl.tasks.registry import load_task_source
from masrl.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
DATA = data_dir()
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason=f"benchmark data not found at {DATA} (MASRL_DATA_DIR)")


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_rows_that_do_not_parse_name_file_and_line(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"p": "1+1", "sol": "so #### 2"}, "{not json", {"p": "2+2"},
                                         {"p": "", "sol": "0"}, {"p": "3*3", "sol": "#### 9"}])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tasks = load_rows_as_tasks(str(path), fields={"question": "p", "answer": "sol"}, reward="math")
    assert [(t.question, t.answer) for t in tasks] == [("1+1", "2"), ("3*3", "9")]
    msgs = [str(w.message) for w in caught if w.category is MalformedRowWarning]
    assert len(msgs) == 3
    assert msgs[0].startswith(f"{path}:2: invalid JSON") and msgs[1].startswith(f"{path}:3: missing field 'sol'")
    assert msgs[2].startswith(f"{path}:4: field 'p' is not a non-empty string")
    with pytest.raises(DatasetLoadError, match=rf"{path}:2: invalid JSON"):
        load_rows_as_tasks(str(path), fields={"question": "p", "answer": "sol"}, reward="math", strict=True)


def test_json_and_parquet_with_nested_fields_and_qa_reward(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"question": "who?", "reward_model": {"ground_truth": {"target": ["Ada", "Ada Lovelace"]}}},
            {"question": "where?", "reward_model": {"ground_truth": {"target": ["Paris"]}}}]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    for name in ("d.json", "d.parquet"):
        cfg = TaskConfig(name="dataset", params={"train": str(tmp_path / name), "reward": "qa_em",
                                                 "fields": {"answer": "reward_model.ground_truth.target"}})
        source = load_task_source(cfg)
        assert [t.answer for t in source.train] == [["Ada", "Ada Lovelace"], ["Paris"]] and source.test == []
        assert source.score(source.train[0], "ada lovelace")["reward"] == 1.0
        assert source.score(source.train[1], "London")["reward"] == 0.0


def test_hf_source_through_datasets_and_offline_error_names_the_cache(tmp_path, monkeypatch):
    pytest.importorskip("datasets")
    folder = tmp_path / "hfdata"
    folder.mkdir()
    _jsonl(folder / "train.jsonl", [{"question": "2+3", "answer": 5}, {"question": "4*4", "answer": "16"}])
    cfg = TaskConfig(name="dataset", params={"train": f"hf:{folder}:train", "reward": "math"})
    assert [(t.question, t.answer) for t in load_task_source(cfg).train] == [("2+3", "5"), ("4*4", "16")]
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # what HF_HUB_OFFLINE=1 sets at import
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf")
    with pytest.raises(DatasetLoadError) as err:
        load_task_source(TaskConfig(name="dataset", params={"train": "hf:nobody/no-such-set:train"}))
    message = str(err.value)
    assert "'nobody/no-such-set' split 'train'" in message and str(tmp_path / "hf") in message
    assert "offline=True" in message and "\n" not in message


USER_REWARD = '''
import os

def reward(task, episode):  # the turns it saw, one line per call (the reward runs in a process of its own)
    with open(os.environ["MASRL_TEST_CALLS"], "a") as f:
        f.write(f"{len(episode.turns)}\\n")
    for turn in episode.turns:
        turn.reward = 0.25 if turn.agent == "Verifier" else None
    return {"reward": 1.0 if episode.answer and task.answer in episode.answer else 0.0, "correct": False}
'''


@pytest.mark.parametrize("mode, isolation", [("team", "process"), ("per_turn", "process"), ("per_turn", "thread")])
def test_user_reward_sees_all_turns_and_sets_per_turn_rewards(tiny_cfg, tmp_path, monkeypatch, mode, isolation):
    (tmp_path / "my_rewards.py").write_text(USER_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("MASRL_TEST_CALLS", str(tmp_path / "calls.txt"))
    data = _jsonl(tmp_path / "d.jsonl", [{"question": f"{i}+1", "answer": str(i + 1)} for i in range(6)])
    cfg = config_from_dict(tiny_cfg(**{"task": {"name": "dataset", "reward_isolation": isolation, "params": {
        "train": str(data), "reward": "my_rewards:reward"}}, "sft.steps": 0, "algorithm.reward": mode,
        "workflow.params.max_loops": 2}))

    with Trainer(cfg, progress=False) as trainer:
        assert trainer.source.score.isolation == isolation
        episodes = trainer.rollout(trainer.source.train[:3], [0, 1, 2])
        turns, _, scores = trainer.score_turns(episodes)
    calls = [int(n) for n in (tmp_path / "calls.txt").read_text().split()]
    final_calls = calls[-len(episodes):]  # team.finish is the last call of each episode
    assert sorted(final_calls) == sorted(len(e.turns) for e in episodes)
    assert all(not e.info["correct"] for e in episodes)
    team = {id(t): e.reward for e in episodes for t in e.turns}
    for t, s in zip(turns, scores.tolist()):
        penalty = 0.0 if t.valid else cfg.algorithm.format_penalty
        want = 0.25 if (mode == "per_turn" and t.agent == "Verifier") else team[id(t)]
        assert s == pytest.approx(want - penalty)
    assert any(t.agent == "Verifier" for t in turns)


def test_example_dataset_config_trains_from_yaml_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the example's paths start at the repository root
    cfg = load_config(ROOT / "examples" / "dataset_jsonl.yaml",
                      [f"output_dir={tmp_path / 'run'}", "trainer.total_steps=2", "trainer.batch_size=2",
                       "trainer.group_size=2", "eval.limit=2", "logging.progress=false", "logging.plots=false"])
    with Trainer(cfg) as trainer:
        report = trainer.fit()
    assert report["steps"] == 2 and len(trainer.source.train) == 300 and len(trainer.source.test) == 50
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["phase"] == "train"] == [1, 2]
    assert "eval/test/avg@n" in records[-1] and "eval/test/pass@2" in records[-1]


@needs_data
@pytest.mark.parametrize("rel, fields, reward, bench", [
    ("math/gsm8k_test.jsonl", {}, "math", "gsm8k"),
    ("math/math500_test.jsonl", {"question": "problem"}, "math", "math500"),
])
def test_shared_math_files_match_the_benchmark_loaders(rel, fields, reward, bench):
    from masrl.tasks.math_data import load_benchmark

    tasks = load_rows_as_tasks(str(DATA / rel), fields=fields, reward=reward, limit=200)
    ref = load_benchmark(bench, limit=200)
    assert [(t.question, t.answer) for t in tasks] == [(t.question, t.answer) for t in ref]


@needs_data
def test_shared_searchr1_parquet_and_mbpp():
    from masrl.codecheck.scoring import score_code
    from masrl.tasks.qa import load_qa

    qa = load_rows_as_tasks(str(DATA / "qa/searchr1_nq_search_test.parquet"), reward="qa_em", limit=50,
                            fields={"answer": "reward_model.ground_truth.target"})
    ref = load_qa("searchr1_nq_test", limit=50)
    assert [(t.question, t.answer) for t in qa] == [(t.question, t.answer) for t in ref]
    code = load_rows_as_tasks(str(DATA / "code/mbpp.jsonl"), reward="code", limit=3,
                              fields={"question": "text", "answer": "test_list", "setup": "test_setup_code"})
    rows = [json.loads(line) for line in (DATA / "code/mbpp.jsonl").read_text().splitlines()[:3]]
    for task, row in zip(code, rows):
        assert score_code(task, "```python\n" + row["code"] + "\n```")["correct"], task.id
        assert not score_code(task, "```python\ndef nothing(): pass\n```")["correct"]


def test_gpu_example_reads_a_verl_format_dapo_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "dapo", "prompt": [{"role": "user", "content": f"Q{i} Let's think"}],
             "reward_model": {"style": "rule", "ground_truth": str(10 + i)},
             "extra_info": {"index": i, "question": f"Q{i}"}} for i in range(3)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    cfg = load_config(ROOT / "examples" / "gpu" / "math_drmas_qwen3_4b.yaml",
                      [f"task.params.train={tmp_path / 'train.parquet'}", "task.params.test=null"])
    source = load_task_source(cfg.task)
    assert [(t.question, t.answer) for t in source.train] == [("Q0", "10"), ("Q1", "11"), ("Q2", "12")]
    assert source.score(source.train[1], "so \\boxed{11}")["correct"]
    via_prompt = load_rows_as_tasks(str(tmp_path / "train.parquet"), reward="math",
                                    fields={"question": "prompt.0.content", "answer": "reward_model.ground_truth"})
    assert via_prompt[2].question == "Q2 Let's think"


def test_train_strict_stops_at_the_bad_row_with_exit_2(tiny_cfg, tmp_path, capsys):
    from masrl.cli import main

    data = _jsonl(tmp_path / "d.jsonl", [{"question": "1+1", "answer": "2"}, {"question": "2+2"}])
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(tiny_cfg(**{"task": {"name": "dataset", "params": {"train": str(data)}},
                                               "sft.steps": 0})))
    assert main(["train", str(path), "--strict"]) == 2
    assert f"{data}:2: missing field 'answer'" in capsys.readouterr().err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
