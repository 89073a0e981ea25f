"""``trainer.compile``: the decision (auto / on / off, the C++ compiler, LoRA, checkpointing, run length), the
eager fallback without a compiler or with one that cannot build inductor's kernels, and compiled decoder layers
against eager (log-probs, loss, gradients)."""
from __future__ import annotations

import logging

import pytest
import torch
from conftest import load_benchmark

from masrl.config import config_from_dict
from masrl.models import compiled_layers as cl
from masrl.training.policy import build_policy
from masrl.training.update import Row, update_policy

ARCH = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
        "intermediate_size": 128}


def _cfg(tiny_cfg, setting: str, **over):
    return config_from_dict(tiny_cfg(**{"policies.shared.tiny": ARCH, "trainer.compile": setting,
                                        "trainer.autocast": "float32", "trainer.logprob_chunk_tokens": 0, **over}))


def _rows(n: int = 6):
    return [Row("Solver", list(range(10, 20 + i)), list(range(30, 36 + i)), [-2.0] * (6 + i), (-1.0) ** i,
                policy="shared") for i in range(n)]


def test_decision_names_what_runs_and_why(monkeypatch):
    monkeypatch.setenv("CXX", "g++") if cl.shutil.which("g++") else pytest.skip("no g++ here")
    if cl.inductor_failure() is not None:
        pytest.skip(f"g++ cannot build inductor's kernels here: {cl.inductor_failure()}")
    ok = dict(device="cpu", total_steps=cl.AUTO_MIN_STEPS, lora=False, checkpointing=False, native_bf16=True)
    assert cl.compile_decision("auto", **ok)[0] and cl.compile_decision("on", **{**ok, "total_steps": 1})[0]
    assert not cl.compile_decision("off", **ok)[0]
    short = cl.compile_decision("auto", **{**ok, "total_steps": cl.AUTO_MIN_STEPS - 1})
    assert not short[0] and "do not repay the compile time" in short[1]
    avx2 = cl.compile_decision("auto", **{**ok, "native_bf16": False})
    assert not avx2[0] and "not measured faster than eager" in avx2[1]
    assert cl.compile_decision("on", **{**ok, "native_bf16": False})[0]  # on: the user's call
    for key, value, words in (("lora", True, "LoRA"), ("checkpointing", True, "checkpointing"),
                              ("sharded", True, "FSDP2"), ("device", "cuda", "on cuda")):
        decided, line = cl.compile_decision("on", **{**ok, key: value})
        assert not decided and words in line and "eager" in line


def _eager_as_off(tiny_cfg, caplog) -> logging.LogRecord:
    """Two updates with trainer.compile on and two with off: on must run eager, say so in one line, and train
    exactly as off does. Returns on's line."""
    results, said = {}, {}
    for setting in ("on", "off"):
        cfg = _cfg(tiny_cfg, setting)
        policy = build_policy("shared", cfg.policies["shared"], seed=0, max_rollout_batch=8)
        with caplog.at_level(logging.INFO, logger="masrl.training.update"):
            caplog.clear()
            for step in range(2):
                update_policy(policy, _rows(), cfg.algorithm, cfg.trainer, step=step, seed=0)
        lines = [r for r in caplog.records if "trainer.compile" in r.getMessage()]
        assert len(lines) == 1 and policy.compile_layers is False
        said[setting] = lines[0]
        results[setting] = [p.detach().clone() for p in policy.model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(results["on"], results["off"]))
    return said["on"]


def test_no_cxx_compiler_falls_back_to_eager_with_one_line(tiny_cfg, monkeypatch, caplog):
    """$CXX naming a missing binary: trainer.compile on runs eager, says so once, and updates as off does."""
    monkeypatch.setenv("CXX", "/nonexistent/bin/g++")
    assert cl.cxx_compiler() is None
    line = _eager_as_off(tiny_cfg, caplog)
    assert line.levelno == logging.WARNING and "no C++ compiler" in line.getMessage()


def test_a_compiler_that_cannot_build_falls_back_to_eager_with_one_line(tiny_cfg, tmp_path, monkeypatch, caplog):
    """A C++ compiler on PATH that fails on inductor's kernels (as g++ does where Python's development headers are
    missing): trainer.compile on runs eager, says why once (the compiler's error), and updates as off does."""
    import torch._inductor.config as inductor_config

    fake = tmp_path / "g++"
    fake.write_text('#!/bin/sh\nif [ "$1" = "--version" ]; then echo "g++ (GCC) 12.2.0"; exit 0; fi\n'
                    'echo "kernel.cpp:1:10: fatal error: Python.h: No such file or directory" >&2\nexit 1\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setattr(inductor_config.cpp, "cxx", (str(fake),))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # no kernel cached by earlier runs
    monkeypatch.setattr(cl, "_BUILDS", {})
    torch._dynamo.reset()
    assert cl.cxx_compiler() == str(fake)
    line = _eager_as_off(tiny_cfg, caplog)
    message = line.getMessage()
    assert line.levelno == logging.WARNING and "cannot build inductor's kernels" in message
    assert "Python.h: No such file or directory" in message
    torch._dynamo.reset()


def test_auto_is_eager_for_a_short_run(tiny_cfg):
    cfg = _cfg(tiny_cfg, "auto", **{"trainer.total_steps": 3})
    policy = build_policy("shared", cfg.policies["shared"], seed=0, max_rollout_batch=8)
    update_policy(policy, _rows(), cfg.algorithm, cfg.trainer, step=0, seed=0)
    assert policy.compile_layers is False and not any("forward" in vars(m) for m in cl.decoder_layers(policy.model))


@pytest.mark.slow  # inductor compiles forward and backward twice: 40-170 s on 2 shared cores
@pytest.mark.skipif(cl.cxx_compiler() is None, reason="no C++ compiler for inductor")
def test_compiled_layers_match_eager(tiny_cfg, tmp_path, monkeypatch):
    """Log-probs within 1e-5, loss within 1e-5 relative, gradients within 1e-4 relative (float32; measured 1e-6),
    on two micro-batch shapes (the static graph, then the shape-generic one)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    cfg = _cfg(tiny_cfg, "on")
    policy = build_policy("shared", cfg.policies["shared"], seed=0, max_rollout_batch=8)
    bench = load_benchmark("compile_layers.py")
    for chunk in (_rows(3), _rows(5)[1:]):
        got = bench.compiled_vs_eager(policy, cfg.trainer, chunk)
        assert got["max_abs_logprob_diff"] < 1e-5 and got["max_rel_grad_diff"] < 1e-4
        assert got["loss_compiled"] == pytest.approx(got["loss_eager"], rel=1e-5)
    assert not any("forward" in vars(m) for m in cl.decoder_layers(policy.model))  # restored after the context
    assert any(tmp_path.iterdir())  # inductor wrote its cache where it was told
