"""The GPU example configs load with today's config and keep the Dr. MAS paper's settings.

Only configs are read: no model, tokenizer or dataset is loaded.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from masrl.config import config_from_dict, load_config

ROOT = Path(__file__).resolve().parents[1]
GPU_EXAMPLES = sorted((ROOT / "examples" / "gpu").glob("*.yaml"))
SMOKE = ROOT / "benchmarks" / "gpu_smoke.yaml"

# file -> the paper settings it must keep (arXiv 2602.08847; reference run_math.sh / run_search.sh)
EXPECTED = {
    "math_drmas_qwen3_4b.yaml": dict(
        workflow="math_solver_verifier", workflow_params={"max_loops": 2},
        mapping={"Solver": "solver", "Verifier": "verifier"},
        models={"solver": "Qwen/Qwen3-4B", "verifier": "Qwen/Qwen3-4B"},
        group_size=8, batch_size=32, minibatches=1, max_new_tokens=4096, format_penalty=0.1, entropy_coef=0.0,
        workers=4),
    "search_drmas_qwen25_3b.yaml": dict(
        workflow="search_verifier_router", workflow_params={"max_turns": 4, "topk": 3, "history_length": 4},
        mapping={"Verifier": "verifier", "Search": "search", "Answer": "answer"},
        models={"verifier": "Qwen/Qwen2.5-3B", "search": "Qwen/Qwen2.5-3B", "answer": "Qwen/Qwen2.5-3B"},
        group_size=5, batch_size=128, minibatches=5, max_new_tokens=800, format_penalty=0.01, entropy_coef=0.001,
        workers=4),
    "search_drmas_hetero_7b_3b.yaml": dict(
        workflow="search_verifier_router", workflow_params={"max_turns": 4, "topk": 3, "history_length": 4},
        mapping={"Verifier": "verifier", "Search": "search", "Answer": "answer"},
        models={"verifier": "Qwen/Qwen2.5-7B", "search": "Qwen/Qwen2.5-3B", "answer": "Qwen/Qwen2.5-3B"},
        group_size=5, batch_size=128, minibatches=5, max_new_tokens=800, format_penalty=0.01, entropy_coef=0.001,
        workers=8),
    "math_drmas_qwen3_8b_fsdp.yaml": dict(  # runtime.strategy: fsdp (docs/scaling.md)
        workflow="math_solver_verifier", workflow_params={"max_loops": 2},
        mapping={"Solver": "solver", "Verifier": "verifier"},
        models={"solver": "Qwen/Qwen3-8B", "verifier": "Qwen/Qwen3-8B"},
        group_size=8, batch_size=32, minibatches=1, max_new_tokens=4096, format_penalty=0.1, entropy_coef=0.0,
        workers=8),
    "search_drmas_qwen25_7b_fsdp.yaml": dict(
        workflow="search_verifier_router", workflow_params={"max_turns": 4, "topk": 3, "history_length": 4},
        mapping={"Verifier": "verifier", "Search": "search", "Answer": "answer"},
        models={"verifier": "Qwen/Qwen2.5-7B", "search": "Qwen/Qwen2.5-7B", "answer": "Qwen/Qwen2.5-7B"},
        group_size=5, batch_size=128, minibatches=5, max_new_tokens=800, format_penalty=0.01, entropy_coef=0.001,
        workers=8),
}
VLLM_EXAMPLES = [p for p in GPU_EXAMPLES if not p.name.endswith("_fsdp.yaml")]  # fsdp: the in-process engine

def test_every_gpu_example_declares_its_settings():
    assert GPU_EXAMPLES, "no examples/gpu/*.yaml"
    assert {p.name for p in GPU_EXAMPLES} == set(EXPECTED)


@pytest.mark.parametrize("path", GPU_EXAMPLES, ids=lambda p: p.name)
def test_gpu_example_keeps_the_paper_settings(path):
    cfg = load_config(path)
    want = EXPECTED[path.name]
    assert cfg.workflow.name == want["workflow"]
    assert {k: cfg.workflow.params[k] for k in want["workflow_params"]} == want["workflow_params"]
    assert {a: ac.policy for a, ac in cfg.agents.items()} == want["mapping"]  # LLM non-sharing
    assert {p: pc.model for p, pc in cfg.policies.items()} == want["models"]
    assert cfg.trainer.group_size == want["group_size"] and cfg.trainer.batch_size == want["batch_size"]
    assert cfg.trainer.minibatches == want["minibatches"] and cfg.trainer.epochs == 1
    assert cfg.trainer.device == "cuda"
    for name, pc in cfg.policies.items():
        assert pc.optim.lr == pytest.approx(1e-6), name
        assert pc.dtype == "bfloat16" and pc.lora is None and pc.trainable
    for name, ac in cfg.agents.items():
        assert ac.max_new_tokens == want["max_new_tokens"], name
        assert ac.temperature == 1.0 and ac.top_p == 1.0
    algo = cfg.algorithm
    assert algo.estimator == "drmas" and algo.eps == 1e-6 and algo.unbiased_std
    assert algo.format_penalty == pytest.approx(want["format_penalty"])
    loss = algo.loss
    assert (loss.loss, loss.clip_low, loss.clip_high, loss.agg) == ("ppo", 0.2, 0.2, "token-mean")
    assert loss.kl_coef == 0.0 and loss.entropy_coef == pytest.approx(want["entropy_coef"])
    assert cfg.eval.n == 16 and cfg.eval.temperature == pytest.approx(0.6)
    assert cfg.runtime.kind == "ray" and cfg.runtime.workers == want["workers"]
    assert {cfg.runtime.for_policy(p).placement for p in cfg.policies} == {"colocated"}


def test_llm_sharing_variant_is_one_override_away():
    path = ROOT / "examples" / "gpu" / "math_drmas_qwen3_4b.yaml"
    data = yaml.safe_load(path.read_text())
    data["agents"]["Verifier"]["policy"] = "solver"
    del data["policies"]["verifier"]
    cfg = config_from_dict(data, str(path))
    assert {a.policy for a in cfg.agents.values()} == {"solver"}


def test_smoke_config_loads():
    cfg = load_config(SMOKE, ["policies.shared.model=/tmp/tiny"])
    assert set(cfg.agents) == {"Solver", "Verifier"} and cfg.trainer.total_steps == 3
    assert cfg.trainer.device == "cuda" and cfg.policies["shared"].model == "/tmp/tiny"


@pytest.mark.parametrize("path", VLLM_EXAMPLES + [SMOKE], ids=lambda p: p.name)
def test_gpu_configs_use_vllm_rollouts_with_is_correction(path):
    cfg = load_config(path, ["policies.shared.model=/tmp/tiny"] if path == SMOKE else [])
    assert cfg.rollout.engine == "vllm" and cfg.rollout.enable_sleep_mode and cfg.rollout.sleep_level == 1
    ris = cfg.algorithm.rollout_is
    assert (ris.enabled, ris.cap, ris.level, ris.mode) == (True, 2.0, "token", "truncate")


def test_colocated_vllm_engines_must_fit_on_one_device():
    from masrl.config import ConfigError

    path = ROOT / "examples" / "gpu" / "search_drmas_qwen25_3b.yaml"
    with pytest.raises(ConfigError, match=r"3 vLLM engines sharing a GPU is 1.20 of its memory"):
        load_config(path, ["rollout.gpu_memory_utilization=0.4"])
    cfg = load_config(path, ["rollout.gpu_memory_utilization=0.4", "runtime.placement=dedicated"])
    assert cfg.rollout.gpu_memory_utilization == 0.4


# file -> the hardware its header names: (GPUs, GiB per GPU). A new example states its hardware here.
STATED_HARDWARE = {"math_drmas_qwen3_4b.yaml": (4, 80), "search_drmas_qwen25_3b.yaml": (4, 80),
                   "search_drmas_hetero_7b_3b.yaml": (8, 80), "math_drmas_qwen3_8b_fsdp.yaml": (8, 80),
                   "search_drmas_qwen25_7b_fsdp.yaml": (8, 80)}


@pytest.mark.parametrize("path", GPU_EXAMPLES, ids=lambda p: p.name)
def test_every_shipped_gpu_example_fits_its_stated_hardware(path):
    """``masrl plan`` of each example (its own prompt length: max_model_len less the response budget)
    fits the GPUs it names, on as many as it names."""
    from masrl.plan import GiB, plan

    gpus, gib = STATED_HARDWARE[path.name]
    cfg = load_config(path)
    assert cfg.runtime.workers == gpus
    response = max(a.max_new_tokens for a in cfg.agents.values())
    prompt = (cfg.rollout.max_model_len - response) if cfg.rollout.max_model_len else 512
    report = plan(cfg, device_gib=gib, prompt_tokens=prompt)
    assert report["fits"], f"{path.name}: {report['need'] / GiB:.1f} GiB per device on {gpus} x {gib} GiB"


def test_plan_counts_the_lm_head_chunk_and_turn_taking_engines():
    """The two terms that made the Qwen3-4B example look 106 GiB: full-vocabulary float32 logits for every
    response token (the trainer computes logprob_chunk_tokens at a time), and a vLLM pool added to an update
    (colocated engines sleep while a policy updates)."""
    from masrl.plan import GiB, plan, plan_policy

    path = ROOT / "examples" / "gpu" / "math_drmas_qwen3_4b.yaml"
    chunked = plan_policy(load_config(path), "solver").terms["activations"]
    full = plan_policy(load_config(path, ["trainer.logprob_chunk_tokens=0"]), "solver").terms["activations"]
    assert full - chunked > 30 * GiB  # 3 x 21,845 response tokens x 151,936 x 4 bytes vs 1,024 tokens
    asleep = plan(load_config(path), device_gib=80)
    awake = plan(load_config(path, ["rollout.enable_sleep_mode=false"]), device_gib=80)
    assert asleep["fits"] and not awake["fits"]
    assert any(k.endswith("vllm_awake") for k in awake["per_device"])
