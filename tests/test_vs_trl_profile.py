"""``benchmarks/vs_trl.py --profile``: the op grouping and the profiler's accounting (no TRL needed)."""
from __future__ import annotations

import pytest
import torch

from conftest import load_benchmark


@pytest.fixture(scope="module")
def vs_trl():
    return load_benchmark("vs_trl.py", "vs_trl_under_test")


@pytest.mark.parametrize("op, group", [
    ("aten::mm", "matrix products"), ("aten::addmm_", "matrix products"), ("mkldnn::_linear_pointwise", "matrix products"),
    ("mkldnn::_reorder_linear_weight", "weight packing"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "attention"),
    ("aten::_fused_adamw_", "optimizer"), ("aten::_foreach_mul_", "optimizer"),
    ("aten::topk", "softmax, sampling and log-probs"), ("aten::_log_softmax_backward_data", "softmax, sampling and log-probs"),
    ("aten::to", "copies, casts and views"), ("aten::t", "copies, casts and views"),
    ("aten::copy_", "copies, casts and views"),
    ("aten::tanh", "elementwise and other ops"), ("aten::mul", "elementwise and other ops"),
    ("aten::threshold_backward", "elementwise and other ops"),  # no prefix match on 't' or 'to'
])
def test_op_groups(vs_trl, op, group):
    assert vs_trl.op_group(op) == group


def test_outside_aten_is_the_cpu_no_op_accounts_for(vs_trl):
    profile = {"cpu_s": 1.0, "ops": {"aten::mm": [0.3, 10], "aten::copy_": [0.1, 5], "aten::mul": [0.2, 7]}}
    g = vs_trl.op_groups(profile)
    assert g["matrix products"] == pytest.approx(0.3) and g["copies, casts and views"] == pytest.approx(0.1)
    assert g["outside aten ops"] == pytest.approx(0.4)
    profile["cpu_s"] = 0.5  # ops timed by the wall clock can exceed the process CPU on a loaded machine
    assert vs_trl.op_groups(profile)["outside aten ops"] == 0.0


def test_step_profiler_records_the_window_only(vs_trl):
    a = torch.randn(64, 64)
    torch.mm(a, a)  # before start: not recorded
    prof = vs_trl.StepProfiler(top=5)
    prof.start()
    for _ in range(7):
        torch.mm(a, a)
    prof.stop()
    torch.mm(a, a)  # after stop: not recorded
    s = prof.summary()
    assert s["ops"]["aten::mm"][1] == 7
    assert s["cpu_s"] > 0 and s["top_ops"][0]["self_cpu_s"] > 0
    assert "ncalls" in s["cprofile_top"]
