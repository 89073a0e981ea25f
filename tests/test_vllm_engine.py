"""VLLMEngine: CPU tests of the plumbing (no vLLM needed) and GPU tests against real vLLM.

The CPU tests run against a fake ``vllm`` module that records what the engine asks for, so the
request mapping, the result conversion, weight-sync and sleep bookkeeping and the LoRA
registry are checked without a GPU. The ``gpu`` tests need CUDA and ``pip install masrl[vllm]``.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from masrl.models.tiny import build_char_tokenizer, build_tiny_model
from masrl.rollout.engine import GenRequest

TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
        "intermediate_size": 128, "max_position_embeddings": 256}


def test_import_works_and_missing_vllm_raises_a_clear_error(monkeypatch):
    import masrl.rollout.vllm_engine as vllm_engine  # importing never needs vllm

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'masrl\[vllm\]'.*CUDA"):
        vllm_engine.VLLMEngine("Qwen/Qwen3-4B")


# ----------------------------------------------------------------------------- a fake vllm


@dataclasses.dataclass
class _Logprob:
    logprob: float


@dataclasses.dataclass
class _LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclasses.dataclass
class _EngineArgs:
    model: str = ""
    logprobs_mode: str = "raw_logprobs"


class _SamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class _FakeModel:
    def __init__(self):
        self.loaded: list[str] = []

    def load_weights(self, weights):
        self.loaded.extend(name for name, _ in weights)


class _FakeLLM:
    """Every prompt continues with [last + 10, 7, EOS=2], cut at max_tokens; logprob -0.5 (k + 1)."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls: list[tuple] = []
        self.events: list[tuple] = []
        self.model = _FakeModel()
        worker = SimpleNamespace(model_runner=SimpleNamespace(model=self.model))
        self.llm_engine = SimpleNamespace(
            model_executor=SimpleNamespace(driver_worker=SimpleNamespace(worker=worker)),
            add_lora=lambda request: self.events.append(("add", request.lora_int_id)),
            remove_lora=lambda lora_id: self.events.append(("remove", lora_id)))

    def generate(self, prompts, sampling_params, use_tqdm=True, lora_request=None):
        self.calls.append((prompts, sampling_params, lora_request))
        outputs = []
        for prompt, sp in zip(prompts, sampling_params):
            ids = [prompt["prompt_token_ids"][-1] + 10, 7, 2][:sp.max_tokens]
            logprobs = [{t: _Logprob(-0.5 * (k + 1))} for k, t in enumerate(ids)]
            finish = "stop" if ids[-1] == 2 else "length"
            outputs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, logprobs=logprobs,
                                                                    finish_reason=finish)]))
        return outputs

    def sleep(self, level):
        self.events.append(("sleep", level))

    def wake_up(self, tags=None):
        self.events.append(("wake", tuple(tags or ())))

    def reset_prefix_cache(self):
        self.events.append(("reset",))


@pytest.fixture
def fake_vllm(monkeypatch):
    modules = {name: types.ModuleType(name) for name in
               ("vllm", "vllm.lora", "vllm.lora.request", "vllm.engine", "vllm.engine.arg_utils")}
    modules["vllm"].LLM = _FakeLLM
    modules["vllm"].SamplingParams = _SamplingParams
    modules["vllm.lora.request"].LoRARequest = _LoRARequest
    modules["vllm.engine.arg_utils"].EngineArgs = _EngineArgs
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")  # restored (unset) after the test
    from masrl.rollout.vllm_engine import VLLMEngine

    return VLLMEngine


def test_fake_vllm_maps_rows_and_results(fake_vllm):
    import os

    engine = fake_vllm("some/model", dtype="float16", gpu_memory_utilization=0.3, enable_sleep_mode=True,
                       eos_token_ids=[2], seed=5)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # in-process engine core by default
    kw = engine.llm.kwargs
    assert (kw["model"], kw["dtype"], kw["gpu_memory_utilization"], kw["enable_sleep_mode"], kw["seed"]) == \
        ("some/model", "float16", 0.3, True, 5)
    assert kw["logprobs_mode"] == "processed_logprobs" and "enable_lora" not in kw
    requests = [GenRequest([1, 3], temperature=1.0, top_p=1.0, max_new_tokens=8),
                GenRequest([4], temperature=0.0, max_new_tokens=0),
                GenRequest([5], temperature=0.7, top_p=0.9, max_new_tokens=2)]
    out = engine.generate(requests)
    assert [r.response_ids for r in out] == [[13, 7, 2], [], [15, 7]]
    assert out[0].logprobs == [-0.5, -1.0, -1.5] and out[2].logprobs == [-0.5, -1.0]
    assert [r.truncated for r in out] == [False, True, True]
    prompts, params, lora = engine.llm.calls[0]
    assert [p["prompt_token_ids"] for p in prompts] == [[1, 3], [5]]  # the 0-token row never reaches vLLM
    assert lora is None
    assert [(p.temperature, p.top_p, p.max_tokens, p.logprobs, p.n) for p in params] == \
        [(1.0, 1.0, 8, 0, 1), (0.7, 0.9, 2, 0, 1)]
    assert all(p.stop_token_ids == [2] and p.detokenize is False for p in params)
    assert params[0].seed != params[1].seed
    engine.reseed(5)
    engine.generate(requests)
    assert [p.seed for p in engine.llm.calls[1][1]] == [p.seed for p in params]  # same stream after reseed
    assert engine.tokens_generated == 10


def test_fake_vllm_sync_weights_and_sleep(fake_vllm):
    from masrl.rollout.vllm_engine import hf_named_tensors

    tok = build_char_tokenizer()
    model = build_tiny_model(tok, TINY)
    engine = fake_vllm("m", enable_sleep_mode=True, eos_token_ids=[2])
    assert engine.sync_weights(hf_named_tensors(model)) == len(model.state_dict())
    assert engine.llm.model.loaded == list(model.state_dict())  # straight into the in-process model
    assert engine.llm.events[-1] == ("reset",) and engine.weight_version == 1
    with pytest.raises(ValueError, match="no tensors"):
        engine.sync_weights({})

    engine.sleep(level=1)
    assert engine.is_sleeping
    engine.generate([GenRequest([1], max_new_tokens=3)])  # wakes everything first
    assert ("wake", ("weights", "kv_cache")) in engine.llm.events and not engine.is_sleeping

    engine.sleep(level=2)  # weights discarded: generating before a sync is an error
    with pytest.raises(RuntimeError, match="sync_weights"):
        engine.generate([GenRequest([1], max_new_tokens=3)])
    engine.sleep(level=2)
    engine.llm.events.clear()
    engine.sync_weights({"lm_head.weight": torch.zeros(3)})
    assert engine.llm.events == [("wake", ("weights",)), ("reset",)]  # weights only; KV cache stays freed
    assert engine.is_sleeping
    engine.generate([GenRequest([1], max_new_tokens=3)])
    assert engine.llm.events[-1] == ("wake", ("kv_cache",)) and not engine.is_sleeping
    no_sleep = fake_vllm("m")
    with pytest.raises(RuntimeError, match="enable_sleep_mode"):
        no_sleep.sleep()


def test_fake_vllm_versioned_for_rollouts_ahead(fake_vllm):
    """rollout.max_staleness with vLLM: no copy of the weights (vLLM has its own), the new ones pushed at the
    version boundary through the engine's weight sync, every result stamped with its version, and no sleep
    during the update (the engine generates the next batches meanwhile)."""
    from masrl.config import RolloutConfig
    from masrl.rollout.versioned import versioned
    from masrl.training.policy import before_update

    tok = build_char_tokenizer()
    model = build_tiny_model(tok, TINY)
    inner = fake_vllm("m", enable_sleep_mode=True, eos_token_ids=[2])
    engine = versioned(inner, model)
    assert engine.inner is inner and not engine.copies and engine.shares_training_model is False
    assert engine.generate([GenRequest([1], max_new_tokens=3)])[0].version == 0
    engine.weights_changed(model, base_changed=True)  # the update of a full model
    assert inner.llm.model.loaded == list(model.state_dict()) and inner.weight_version == 1
    assert engine.version == 1 and engine.generate([GenRequest([1], max_new_tokens=3)])[0].version == 1
    policy = SimpleNamespace(engine=engine)
    before_update(policy, RolloutConfig(engine="vllm", max_staleness=1))
    assert not inner.is_sleeping  # it stays awake for the rollouts beside the update
    before_update(policy, RolloutConfig(engine="vllm"))
    assert inner.is_sleeping  # on-policy: asleep during the update, as before


def test_fake_vllm_lora_registry(fake_vllm, tmp_path):
    from safetensors.torch import load_file

    from masrl.models.lora import adapter_state_dict, attach_adapters
    from masrl.rollout.vllm_engine import hf_named_tensors

    tok = build_char_tokenizer()
    base = build_tiny_model(tok, TINY)
    names = list(base.state_dict())
    peft_model = attach_adapters(base, ["Solver", "Verifier"], r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    assert [n for n, _ in hf_named_tensors(peft_model)] == names  # base names, no base_layer, no LoRA

    engine = fake_vllm("m", enable_lora=True, max_lora_rank=8, eos_token_ids=[2], enable_sleep_mode=True)
    assert engine.llm.kwargs["enable_lora"] is True and engine.llm.kwargs["max_lora_rank"] == 8
    assert engine.sync_adapters(peft_model) == ["Solver", "Verifier"]
    first = dict(engine._adapters)
    folder = Path(first["Solver"].lora_path)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8, "LORA")
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    saved = load_file(str(folder / "adapter_model.safetensors"))
    assert sorted(saved) == sorted(adapter_state_dict(peft_model, "Solver"))

    engine.generate([GenRequest([1], max_new_tokens=3, adapter="Verifier"), GenRequest([1], max_new_tokens=3)])
    assert engine.llm.calls[-1][2] == [first["Verifier"], None]  # one batch, per-row adapters

    engine.sync_adapters(peft_model, ["Solver"])  # after an update: a new id, the old one evicted
    new = engine._adapters["Solver"]
    assert new.lora_int_id != first["Solver"].lora_int_id and new.lora_name == f"Solver@{new.lora_int_id}"
    assert ("remove", first["Solver"].lora_int_id) in engine.llm.events
    assert not folder.exists() and Path(new.lora_path).is_dir()
    ids = {name: request.lora_int_id for name, request in engine._adapters.items()}
    engine.sleep(level=2)  # drops the GPU LoRA slots: adapters come back under new ids on wake
    engine.sync_weights({"lm_head.weight": torch.zeros(3)})
    engine.generate([GenRequest([1], max_new_tokens=1, adapter="Solver")])
    assert all(engine._adapters[name].lora_int_id != i for name, i in ids.items())
    assert ("add", engine._adapters["Verifier"].lora_int_id) in engine.llm.events
    assert Path(engine._adapters["Solver"].lora_path) == Path(new.lora_path)  # same files, reloaded
    with pytest.raises(KeyError, match="Answer"):
        engine.generate([GenRequest([1], adapter="Answer")])
    with pytest.raises(ValueError, match="peft_config"):
        engine.load_adapter("x", adapter_state_dict(peft_model, "Solver"))
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        engine.load_adapter("x", tmp_path)
    with pytest.raises(ValueError, match="enable_lora"):
        fake_vllm("m").load_adapter("x", tmp_path)
    root = engine._adapter_root
    engine.close()
    assert not root.exists()


# ----------------------------------------------------------------------------- real vLLM (GPU)
# One engine (fp16, LoRA and sleep mode on) is shared by the tests below, which run in file order;
# each leaves it serving the original weights.

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (masrl[vllm])")

# fp16 vLLM vs the float32 trainer on the same weights (teacher-forced on vLLM's samples):
# per-token |log-prob difference| at most LOGP_ATOL_MAX, on average at most LOGP_ATOL_MEAN
LOGP_ATOL_MAX = 0.05
LOGP_ATOL_MEAN = 0.01
GPU_TINY = {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
            "intermediate_size": 512, "max_position_embeddings": 512}


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from masrl.rollout.vllm_engine import save_for_vllm

    tok = build_char_tokenizer()
    model = build_tiny_model(tok, GPU_TINY, seed=0)
    folder = save_for_vllm(model, tok, tmp_path_factory.mktemp("tiny-vllm"))
    return folder, tok, model.cuda().eval()


@pytest.fixture(scope="module")
def engine(tiny_folder):
    from masrl.rollout.vllm_engine import VLLMEngine

    folder, tok, _ = tiny_folder
    eng = VLLMEngine(folder, dtype="float16", gpu_memory_utilization=0.25, enable_sleep_mode=True,
                     enable_lora=True, max_loras=2, max_lora_rank=8, enforce_eager=True,
                     eos_token_ids=[tok.eos_token_id], seed=0)
    yield eng
    eng.close()


@torch.no_grad()
def _trainer_logprobs(model, prompt_ids, response_ids, temperature):
    """log softmax(logits / T) of each response token under the float32 model (teacher forcing),
    the quantity TransformersEngine reports and the trainer recomputes."""
    ids = torch.tensor([list(prompt_ids) + list(response_ids)], device="cuda")
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float()
    logits = logits / (temperature if temperature > 0 else 1.0)
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt_ids):, None]).squeeze(-1).cpu()


def _prompt(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _max_diff(result, expected):
    return float((torch.tensor(result.logprobs) - expected).abs().max())


def _assert_close(result, expected):
    diff = (torch.tensor(result.logprobs) - expected).abs()
    assert float(diff.max()) < LOGP_ATOL_MAX and float(diff.mean()) < LOGP_ATOL_MEAN, diff


@pytest.mark.gpu
@needs_cuda
@needs_vllm
def test_gpu_generation_logprobs_match_the_trainer(engine, tiny_folder):
    _, tok, model = tiny_folder
    requests = [GenRequest(_prompt(tok, "Q 3+4\nS "), temperature=1.0, max_new_tokens=24),
                GenRequest(_prompt(tok, "Q 12-5\nS "), temperature=0.7, max_new_tokens=24)]
    results = engine.generate(requests)
    for req, res in zip(requests, results):
        assert 1 <= len(res.response_ids) <= 24 and len(res.logprobs) == len(res.response_ids)
        assert all(math.isfinite(lp) and lp <= 0 for lp in res.logprobs)
        assert res.truncated == (res.response_ids[-1] != tok.eos_token_id)
        _assert_close(res, _trainer_logprobs(model, req.prompt_ids, res.response_ids, req.temperature))


@pytest.mark.gpu
@needs_cuda
@needs_vllm
def test_gpu_lora_rows_decode_with_their_adapter(engine, tiny_folder):
    import copy

    from masrl.models.lora import attach_adapters

    _, tok, model = tiny_folder
    # random A and B (not PEFT's zero B): the adapter changes the model from the first token
    peft_model = attach_adapters(copy.deepcopy(model), ["A"], r=8, alpha=16, init_lora_weights=False,
                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]).eval()
    engine.sync_adapters(peft_model)
    prompt = _prompt(tok, "Q 7+8\nS ")
    with_adapter, base = engine.generate([GenRequest(prompt, temperature=1.0, max_new_tokens=16, adapter="A"),
                                          GenRequest(prompt, temperature=1.0, max_new_tokens=16)])
    _assert_close(with_adapter, _trainer_logprobs(peft_model, prompt, with_adapter.response_ids, 1.0))
    _assert_close(base, _trainer_logprobs(model, prompt, base.response_ids, 1.0))
    # the adapter changed the distribution: the base model scores the adapter row's tokens differently
    assert _max_diff(with_adapter, _trainer_logprobs(model, prompt, with_adapter.response_ids, 1.0)) > 0.1


@pytest.mark.gpu
@needs_cuda
@needs_vllm
def test_gpu_sync_weights_changes_greedy_output(engine, tiny_folder):
    from masrl.rollout.vllm_engine import hf_named_tensors

    _, tok, model = tiny_folder
    other = build_tiny_model(tok, GPU_TINY, seed=1).cuda().eval()
    prompt = _prompt(tok, "Q 9-2\nS ")
    greedy = [GenRequest(prompt, temperature=0.0, max_new_tokens=16)]
    before = engine.generate(greedy)[0]
    version = engine.weight_version
    assert engine.sync_weights(hf_named_tensors(other)) == len(other.state_dict())  # GPU tensors, no disk
    after = engine.generate(greedy)[0]
    assert engine.weight_version == version + 1
    assert after.response_ids != before.response_ids
    _assert_close(after, _trainer_logprobs(other, prompt, after.response_ids, 0.0))
    engine.sync_weights(hf_named_tensors(model))  # back to the original weights
    _assert_close(engine.generate(greedy)[0], _trainer_logprobs(model, prompt, before.response_ids, 0.0))


@pytest.mark.gpu
@needs_cuda
@needs_vllm
def test_gpu_sleep_frees_memory_and_wake_restores(engine, tiny_folder):
    from masrl.rollout.vllm_engine import hf_named_tensors

    _, tok, model = tiny_folder
    prompt = _prompt(tok, "Q 1+1\nS ")
    greedy = [GenRequest(prompt, temperature=0.0, max_new_tokens=12)]
    before = engine.generate(greedy)[0]
    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep(level=1)
    assert torch.cuda.mem_get_info()[0] > free_awake  # KV cache released, weights offloaded
    assert engine.generate(greedy)[0].response_ids == before.response_ids  # generate wakes it; weights kept
    engine.sleep(level=2)
    with pytest.raises(RuntimeError, match="sync_weights"):
        engine.generate(greedy)
    engine.sync_weights(hf_named_tensors(model))
    assert engine.generate(greedy)[0].response_ids == before.response_ids


@pytest.mark.gpu
@needs_cuda
@needs_vllm
def test_gpu_versioned_vllm_takes_new_weights_at_the_version_boundary(engine, tiny_folder):
    """rollout.max_staleness: the batch before the boundary decodes with the old weights and carries version 0,
    the next with the new ones (pushed by the engine's weight sync, no copy in the trainer) and version 1. That
    a batch in flight finishes on its version is the lock's (tests/test_staleness.py)."""
    from masrl.rollout.versioned import versioned

    _, tok, model = tiny_folder
    other = build_tiny_model(tok, GPU_TINY, seed=1).cuda().eval()
    prompt = _prompt(tok, "Q 6+2\nS ")
    greedy = [GenRequest(prompt, temperature=0.0, max_new_tokens=16)]
    versioned_engine = versioned(engine, model)
    assert versioned_engine.inner is engine and not versioned_engine.copies
    old = versioned_engine.generate(greedy)[0]
    versioned_engine.weights_changed(other, base_changed=True)
    new = versioned_engine.generate(greedy)[0]
    assert old.version == 0 and new.version == 1 and new.response_ids != old.response_ids
    _assert_close(old, _trainer_logprobs(model, prompt, old.response_ids, 0.0))
    _assert_close(new, _trainer_logprobs(other, prompt, new.response_ids, 0.0))
    versioned_engine.weights_changed(model, base_changed=True)  # back to the original weights
