"""`masrl serve RUN --team` (the team as one model) scored by external harnesses: lm-evaluation-harness
(local-chat-completions) and Inspect AI (its OpenAI provider with a base URL) on local GSM8K rows agree with
`masrl eval` on the same rows at temperature 0, reply for reply. Skipped without the harness extra
(pip install masrl[harness]) or the shared GSM8K rows."""
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

openai = pytest.importorskip("openai", reason="pip install masrl[openai]")
ROWS = 3


def _gsm8k():
    from masrl.paths import data_dir

    path = data_dir() / "math" / "gsm8k_test.jsonl"
    if not path.is_file():
        pytest.skip(f"GSM8K rows not in {data_dir()} (MASRL_DATA_DIR)")
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A one-step run of the tiny two-agent team, served with --team; yields (url, run folder, masrl eval samples)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import tiny_config_dict

    from masrl.config import config_from_dict
    from masrl.trainer import Trainer

    _gsm8k()
    tmp = tmp_path_factory.mktemp("harness")
    d = tiny_config_dict(tmp, **{"sft.steps": 0, "trainer.total_steps": 1, "trainer.batch_size": 2,
                                 "trainer.group_size": 2, "eval.before_after": False, "logging.plots": False,
                                 "policies.shared.tiny.max_position_embeddings": 1024,
                                 "agents.Solver.max_new_tokens": 12})
    cfg = config_from_dict(d)
    with Trainer(cfg) as trainer:
        trainer.fit()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-m", "masrl", "serve", str(cfg.run_dir), "--team", "--port", "0",
                             "--max-seconds", "300", "--debug-turns"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    from masrl.cli import main  # masrl eval on the same rows, while the server starts

    out = tmp / "eval"
    assert main(["eval", str(cfg.run_dir / "config.yaml"), "--checkpoint", str(cfg.run_dir), "--bench", "gsm8k",
                 "--limit", str(ROWS), "--n", "1", "--out", str(out), "eval.temperature=0"]) == 0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    try:
        line = proc.stdout.readline()
        assert "-> http://" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        yield line.split("-> ", 1)[1].split(" ", 1)[0], cfg, samples
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_team_as_one_model(served):
    url, cfg, samples = served
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    question = [json.loads(line) for line in _gsm8k().read_text().splitlines()[:1]][0]["question"]
    messages = [{"role": "system", "content": "ignored"}, {"role": "user", "content": question}]
    a = client.chat.completions.create(model=cfg.name, messages=messages, temperature=0)
    b = client.chat.completions.create(model=cfg.name, messages=messages, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content == samples[0]["answer"]
    turns = a.model_extra["masrl"]["turns"]
    assert [t["agent"] for t in turns][:2] == ["Solver", "Verifier"]
    # usage counts every agent's tokens
    assert a.usage.completion_tokens > len(a.choices[0].message.content.encode()) // 4 and len(turns) >= 2
    c = client.completions.create(model=cfg.name, prompt=question, temperature=0)
    assert c.choices[0].text == samples[0]["answer"]
    assert [m.id for m in client.models.list()] == [cfg.name]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=cfg.name, messages=[{"role": "system", "content": "no user"}])


def test_lm_eval_agrees_with_masrl_eval(served, tmp_path):
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed: pip install masrl[harness]")
    from lm_eval.tasks import TaskManager

    url, cfg, samples = served
    text = (Path(__file__).parents[1] / "examples" / "harness" / "masrl_gsm8k.yaml").read_text()
    (tmp_path / "masrl_gsm8k.yaml").write_text(text.replace("../shared/data/math/gsm8k_test.jsonl", str(_gsm8k())))
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    results = lm_eval.simple_evaluate(
        model="local-chat-completions", tasks=["masrl_gsm8k"], limit=ROWS, apply_chat_template=True,
        model_args=f"base_url={url}/chat/completions,model={cfg.name},num_concurrent=1,max_retries=1,"
                   "tokenized_requests=False", task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False), log_samples=True)
    replies = [s["resps"][0][0] for s in sorted(results["samples"]["masrl_gsm8k"], key=lambda s: s["doc_id"])]
    assert replies == [s["answer"] for s in samples]
    accuracy = results["results"]["masrl_gsm8k"]["exact_match,boxed"]
    assert accuracy == pytest.approx(sum(s["correct"] for s in samples) / ROWS)


def test_inspect_ai_agrees_with_masrl_eval(served, tmp_path, monkeypatch):
    pytest.importorskip("inspect_ai", reason="inspect-ai is not installed: pip install masrl[harness]")
    from inspect_ai import eval as inspect_eval

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "examples" / "harness"))
    from inspect_gsm8k import masrl_gsm8k

    url, cfg, samples = served
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    # Inspect adds a handler to the root logger for the rest of the process, which raises every debug record of a
    # logger named *http* (masrl.http's hang-ups) to its own level 15: it goes with this test
    monkeypatch.setattr(logging.root, "handlers", list(logging.root.handlers))
    monkeypatch.setattr(logging.root, "level", logging.root.level)
    logs = inspect_eval(masrl_gsm8k(limit=ROWS), model=f"openai/{cfg.name}", model_base_url=url, temperature=0,
                        log_dir=str(tmp_path), display="none")
    log = logs[0]
    assert log.status == "success", log.error
    replies = [s.output.completion for s in sorted(log.samples, key=lambda s: s.id)]
    assert replies == [s["answer"] for s in samples]
    accuracy = log.results.scores[0].metrics["accuracy"].value
    assert accuracy == pytest.approx(sum(s["correct"] for s in samples) / ROWS)
