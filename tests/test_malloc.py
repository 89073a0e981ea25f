"""masrl.runtime.malloc: glibc keeps freed tensor memory for reuse instead of faulting it in again."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from masrl.models.precision import cpu_has_native_bf16
from masrl.runtime import malloc

glibc = pytest.mark.skipif(malloc._glibc() is None, reason="glibc's mallopt (Linux) only")

_PROBE = r"""
import json, resource, sys
import torch
if sys.argv[1] == "tuned":
    from masrl.runtime.malloc import tune_malloc
    assert tune_malloc()["M_MMAP_MAX"] == 0
if sys.argv[1] == "trim":
    from masrl.runtime.malloc import tune_malloc, trim
    tune_malloc()
if sys.argv[1] == "lean":
    from masrl.runtime.malloc import tune_malloc
    assert tune_malloc("lean")["M_MMAP_THRESHOLD"] == 128 << 10
torch.set_num_threads(1)
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = torch.randn(8, 132, 576)      # 2.4 MB: SmolLM2's activations
w = torch.randn(6000, 2048)       # 49 MB: above glibc's largest mmap threshold (32 MiB)
out = {}
for name, fn, n in (("medium", lambda: x.pow(2) * x, 200), ("large", lambda: w.clone(), 5)):
    fn(); fn()
    f = faults()
    for _ in range(n):
        y = fn(); del y
    out[name] = (faults() - f) / n
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
acts = [torch.full((8, 132, 576), 1.0) for _ in range(200)]  # 480 MiB of activations
before = rss()
acts = acts[::4]  # free 3 of every 4 (360 MiB); the ones kept sit between the freed ones
if sys.argv[1] == "trim":
    out["trimmed"] = trim()
out["returned_mib"] = before - rss()
print(json.dumps(out))
"""


def _probe(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    proc = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@glibc
def test_tuned_malloc_reuses_freed_tensor_memory_instead_of_faulting_it_in_again():
    pages_medium = 8 * 132 * 576 * 4 / 4096 * 2   # pow's result and the product
    pages_large = 6000 * 2048 * 4 / 4096
    default, tuned = _probe("default"), _probe("tuned")
    # glibc's defaults: a fresh mmap per tensor, faulted in page by page (the problem this fixes)
    assert default["large"] > 0.9 * pages_large, default
    # tuned: the heap's freed blocks are reused, including blocks above glibc's mmap threshold
    assert tuned["medium"] < 0.02 * pages_medium, tuned
    assert tuned["large"] < 0.02 * pages_large, tuned


@glibc
def test_lean_malloc_hands_freed_activations_back_to_the_kernel():
    """``lean``: the resident set follows the live tensors — 150 freed activations (360 MiB) among 50 live ones go
    back to the kernel; the fast heap and glibc's defaults (once their threshold has risen) keep the holes. The
    price: every such tensor is faulted in afresh."""
    pages_medium = 8 * 132 * 576 * 4 / 4096 * 2
    lean, tuned, default = _probe("lean"), _probe("tuned"), _probe("default")
    assert lean["returned_mib"] > 330, lean
    assert tuned["returned_mib"] < 50 and default["returned_mib"] < 50, (tuned, default)
    assert lean["medium"] > 0.9 * pages_medium and lean["large"] > 0.9 * 6000 * 2048 * 4 / 4096, lean


@glibc
def test_trim_hands_the_fast_heaps_free_memory_back_between_phases():
    """The fast heap keeps the holes between live tensors (above); ``trim()`` at a phase boundary hands them back
    (``malloc_trim(0)``), and inside a phase freed blocks are still reused without page faults."""
    trimmed = _probe("trim")
    assert trimmed["trimmed"] is True and trimmed["returned_mib"] > 330, trimmed
    pages_medium = 8 * 132 * 576 * 4 / 4096 * 2
    assert trimmed["medium"] < 0.02 * pages_medium and trimmed["large"] < 0.02 * 6000 * 2048 * 4 / 4096, trimmed


def test_trim_does_nothing_outside_the_fast_mode(monkeypatch):
    for applied in (None, {"mode": "lean"}):
        monkeypatch.setattr(malloc, "_applied", applied)
        assert malloc.trim() is False


@glibc
def test_trimming_at_phase_boundaries_and_after_each_decoded_batch_leaves_a_run_bitwise_the_same(tmp_path,
                                                                                                 monkeypatch):
    """The tiny team, SFT + 2 RL steps + both evaluations, with and without ``trim()`` at the trainer's phase
    boundaries and after each batch its engine decodes (the fast mode applied in this process): every logged value
    but times and memory equal, and every decoded batch was followed by a trim."""
    import json

    import masrl.trainer as trainer_mod
    from masrl.config import load_config
    from masrl.rollout.engine import TransformersEngine

    if malloc.tune_malloc()["mode"] != "fast":
        pytest.skip("this process runs another allocator mode")
    real_trim, calls, batches = malloc.trim, [], []
    decode_batch = TransformersEngine._generate_batch

    def counted(self, requests):
        batches.append(len(requests))
        return decode_batch(self, requests)

    monkeypatch.setattr(TransformersEngine, "_generate_batch", counted)

    def runs(trim_fn, name):
        monkeypatch.setattr(trainer_mod, "trim", trim_fn)
        cfg = load_config("examples/quickstart.yaml", [
            "sft.steps=2", "sft.batch_size=8", "trainer.total_steps=2", "trainer.batch_size=2", "trainer.group_size=2",
            "eval.limit=2", "eval.n=2", "trainer.threads=1", "trainer.memory_defaults=true",
            f"output_dir={tmp_path / name}"])
        with trainer_mod.Trainer(cfg, progress=False) as t:
            assert all(p.engine.after_batch is not None for p in t.policies.values())
            t.fit()
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if not k.startswith("perf/") and "seconds" not in k and "time" not in k}
                for r in rows]

    plain = runs(lambda: False, "plain")
    batches.clear()
    trimmed = runs(lambda: calls.append(1) or real_trim(), "trimmed")
    # after SFT, before and after each of the 2 evaluations, before each of the 2 updates: 7; then one per batch
    assert len(batches) > 4 and len(calls) == 7 + len(batches)
    assert trimmed == plain


@glibc
def test_without_memory_defaults_the_engine_does_not_trim(tmp_path):
    from masrl.config import load_config
    from masrl.trainer import Trainer

    cfg = load_config("examples/quickstart.yaml", ["trainer.memory_defaults=false", f"output_dir={tmp_path}"])
    with Trainer(cfg, progress=False) as t:
        assert all(p.engine.after_batch is None for p in t.policies.values())


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="'slim' is not one of fast, lean"):
        malloc.tune_malloc("slim")


@glibc
def test_tune_malloc_is_idempotent_and_reports_what_it_set():
    first = malloc.tune_malloc()
    assert first == malloc.tune_malloc() == malloc.applied()
    assert first["M_MMAP_MAX"] == 0 and first["M_TRIM_THRESHOLD"] == malloc.TRIM_THRESHOLD
    assert first["M_TOP_PAD"] == malloc.TOP_PAD and first["glibc"] and first["mode"] == "fast"
    assert malloc.tune_malloc("lean") == first  # once per process: the first mode stays


def test_no_glibc_means_no_change(monkeypatch):
    monkeypatch.setattr(malloc, "_applied", None)
    monkeypatch.setattr(malloc, "_glibc", lambda: None)
    assert malloc.tune_malloc() is None and malloc.applied() is None


@pytest.mark.parametrize("setting, mode", [("true", "fast"), ("false", None), ("lean", "lean")])
def test_trainer_applies_it_unless_turned_off(tmp_path, monkeypatch, setting, mode):
    from masrl.config import load_config
    import masrl.trainer as trainer_mod

    calls = []
    monkeypatch.setattr(trainer_mod, "tune_malloc", lambda mode="fast": calls.append(mode))
    cfg = load_config("examples/quickstart.yaml", ["sft.steps=0", f"trainer.tune_malloc={setting}",
                                                   f"output_dir={tmp_path}"])
    trainer_mod.Trainer(cfg, progress=False)
    assert calls == ([mode] if mode else [])


def test_an_unknown_setting_is_one_config_error():
    from masrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"trainer.tune_malloc': Input should be True, False or 'lean' \(got 'slim'\)"):
        load_config("examples/quickstart.yaml", ["trainer.tune_malloc=slim"])


_KERNELS = r"""
import ctypes, json, sys
if sys.argv[1] != "default":
    from masrl.runtime.malloc import cap_primitive_caches
    cap_primitive_caches(int(sys.argv[1]))  # before the process's first oneDNN product
import torch
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks "
                                               "fordblks keepcost".split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
live = lambda: (libc.mallinfo2().uordblks + libc.mallinfo2().hblkhd) / 2**20
torch.set_num_threads(1)
w = torch.randn(576, 1536, dtype=torch.bfloat16)
xs = [torch.randn(64 + 7 * i, 576, dtype=torch.bfloat16) for i in range(48)]  # 48 row counts: 48 new shapes
xs[0] @ w
before = live()
for x in xs:
    x @ w
print(json.dumps({"grew_mib": live() - before}))
"""


def _kernels(capacity: str) -> float:
    env = {k: v for k, v in os.environ.items() if k not in malloc.PRIMITIVE_CACHE_VARS}
    proc = subprocess.run([sys.executable, "-c", _KERNELS, capacity], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["grew_mib"]


@glibc
@pytest.mark.skipif(not cpu_has_native_bf16(), reason="bf16 matmuls run oneDNN's JIT kernels on CPUs with native bf16")
def test_capped_primitive_caches_keep_fewer_matmul_kernels():
    """48 bf16 matmul shapes: with the libraries' 1024 entries every shape's kernels stay (~0.85 MiB each on an AMX
    Xeon); capped at 4 entries the heap keeps 4 shapes' worth."""
    default, capped = _kernels("default"), _kernels("4")
    assert default > 10, default  # the kernels of 47 new shapes, kept
    assert capped < default / 3, (capped, default)


def _no_capacity(monkeypatch) -> None:
    """No kernel-cache capacity in this process's environment (restored after the test)."""
    for var in malloc.PRIMITIVE_CACHE_VARS:
        monkeypatch.delenv(var, raising=False)


def test_cap_primitive_caches_sets_both_capacities_and_keeps_the_users(monkeypatch):
    _no_capacity(monkeypatch)
    assert malloc.cap_primitive_caches(64) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "64"}
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64" and os.environ["LRU_CACHE_CAPACITY"] == "64"
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    monkeypatch.setenv("DNNL_PRIMITIVE_CACHE_CAPACITY", "500")  # oneDNN's older name, the user's: kept
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "300")
    assert malloc.cap_primitive_caches(16) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "500", "LRU_CACHE_CAPACITY": "300"}
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in os.environ
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="is not a positive int"):
            malloc.cap_primitive_caches(bad)


@pytest.mark.parametrize("setting, expected", [("64", "64"), ("null", None)])
def test_the_local_runtime_caps_them_before_it_builds_a_model(tmp_path, monkeypatch, setting, expected):
    from masrl.config import load_config
    import masrl.runtime.local as local

    _no_capacity(monkeypatch)
    seen = []
    monkeypatch.setattr(local, "build_policy", lambda *a, **k: seen.append(os.environ.get("LRU_CACHE_CAPACITY"))
                        or type("P", (), {})())
    cfg = load_config("examples/quickstart.yaml", [f"trainer.primitive_cache={setting}", f"output_dir={tmp_path}"])
    local.LocalRuntime(cfg).build_policies()
    assert seen and set(seen) == {expected}
    assert os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY") == expected


def test_each_ray_policy_worker_caps_them_before_it_builds_its_model(monkeypatch):
    import masrl.runtime.worker as worker

    _no_capacity(monkeypatch)

    class Built(Exception):
        pass

    def build_policy(*args, **kwargs):
        raise Built(os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY"), os.environ.get("LRU_CACHE_CAPACITY"))

    monkeypatch.setattr(worker, "build_policy", build_policy)
    from masrl.config import load_config

    cfg = load_config("examples/quickstart.yaml")
    name = next(iter(cfg.policies))
    build = {"seed": 0, "rollout": cfg.rollout.model_dump(mode="json")}
    with pytest.raises(Built) as seen:
        worker.PolicyWorker(name, cfg.policies[name].model_dump(mode="json"), build, rank=0, world=1, threads=1,
                            device="cpu", base_trained=False, spike={}, offload=False, tune_malloc=False,
                            primitive_cache=32)
    assert seen.value.args == ("32", "32")
