"""Isolated-Policy LoRA: per-row adapter routing in training and cached decoding, gradient isolation,
one optimizer step over a mixed batch, base-only reference, adapter checkpoints."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from masrl.models.lora import (BASE, adapter_names, adapter_parameters, adapter_state_dict, attach_adapters,
                               base_only, load_adapter_state_dict, mixed_adapters, route_rows, set_all_trainable)
from masrl.models.tiny import build_char_tokenizer, build_tiny_model
from masrl.rollout.engine import GenRequest, TransformersEngine
from masrl.rollout.kv_cache import output_cache, with_cache

torch.set_num_threads(1)

ROLES = ["Solver", "Verifier", "Critic"]
TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
         "intermediate_size": 64, "max_position_embeddings": 128}
# rows of a mixed batch: interleaved roles, one base-only row
ROWS = ["Solver", "Verifier", "Solver", "Critic", BASE, "Verifier", "Critic", "Solver"]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def make(tok, dropout=0.0):
    """(peft model with 3 random non-zero adapters, untouched copy of the base model)."""
    base = build_tiny_model(tok, SMALL, seed=0)
    ref = copy.deepcopy(base).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = attach_adapters(base, ROLES, r=4, alpha=8, dropout=dropout, target_modules=TARGETS)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # lora_B starts at zero: make every adapter differ from the base and each other
        for p in adapter_parameters(model):
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model, ref


def batch(tok, n, seed=0, width=12):
    """Left-padded rows of different lengths with the trainer's attention mask and position ids."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((n, width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i in range(n):
        k = width - (i % 4)
        ids[i, width - k:] = torch.randint(10, len(tok), (k,), generator=g)
        mask[i, width - k:] = 1
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}


def native_logits(model, name, **kw):
    """Logits through PEFT's own single-adapter path (``set_adapter``) or the base (``disable_adapter``)."""
    try:
        if name == BASE:
            with model.disable_adapter():
                return model(**kw).logits
        model.set_adapter(name)
        return model(**kw).logits
    finally:
        model.set_adapter(ROLES[0])
        set_all_trainable(model)


def test_attach_freezes_base_and_trains_every_adapter(tok):
    model, _ = make(tok)
    assert adapter_names(model) == ROLES
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {id(p) for p in trainable} == {id(p) for p in adapter_parameters(model)}
    for role in ROLES:
        params = adapter_parameters(model, role)
        assert params and all(p.requires_grad for p in params)
    assert len(trainable) == sum(len(adapter_parameters(model, r)) for r in ROLES)
    opt = torch.optim.AdamW(trainable)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(adapter_parameters(model))


@pytest.mark.parametrize("rows", [ROWS, sorted(ROWS)], ids=["interleaved", "grouped"])
def test_mixed_forward_equals_per_adapter_forward_in_train_mode(tok, rows):
    model, _ = make(tok)
    model.train()
    kw = batch(tok, len(rows))
    with mixed_adapters(model, rows):
        mixed = model(**kw, logits_to_keep=5, use_cache=False).logits
    assert mixed.requires_grad
    for name in set(rows):
        own = [i for i, r in enumerate(rows) if r == name]
        ref = native_logits(model, name, **kw, logits_to_keep=5, use_cache=False)
        torch.testing.assert_close(mixed[own], ref[own], atol=1e-5, rtol=0)
    # the routing is gone after the context: the default forward uses PEFT's active adapter again
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_mixed_decoding_with_kv_cache_equals_per_adapter_decoding(tok):
    model, _ = make(tok)
    model.eval()
    kw = batch(tok, len(ROWS), seed=3)
    feed = torch.randint(10, len(tok), (len(ROWS), 4), generator=torch.Generator().manual_seed(4))

    def run(ctx):
        steps = []
        with torch.inference_mode(), ctx:
            out = model(**kw, use_cache=True)
            attn, pos = kw["attention_mask"], kw["position_ids"][:, -1:]
            steps.append(out.logits[:, -1])
            for t in range(feed.shape[1]):  # teacher-forced decode steps, one token per row
                attn = torch.cat([attn, torch.ones_like(attn[:, :1])], 1)
                pos = pos + 1
                out = model(input_ids=feed[:, t:t + 1], attention_mask=attn, position_ids=pos,
                            use_cache=True, **with_cache(output_cache(out)))
                steps.append(out.logits[:, -1])
        return torch.stack(steps, 1)

    mixed = run(mixed_adapters(model, ROWS))
    for name in set(ROWS):
        own = [i for i, r in enumerate(ROWS) if r == name]
        if name == BASE:
            ref = run(base_only(model))
        else:
            model.set_adapter(name)
            try:
                ref = run(torch.enable_grad())  # any no-op context: PEFT's own active-adapter path
            finally:
                model.set_adapter(ROLES[0])
                set_all_trainable(model)
        torch.testing.assert_close(mixed[own], ref[own], atol=1e-5, rtol=0)


def test_engine_generates_each_row_with_its_adapter(tok):
    model, _ = make(tok)
    engine = TransformersEngine(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    prompts = batch(tok, len(ROWS), seed=5, width=6)["input_ids"].tolist()  # equal lengths: no padding
    reqs = [GenRequest(p, temperature=0.0, max_new_tokens=6) for p in prompts]
    with mixed_adapters(model, ROWS):
        mixed = engine.generate(reqs)
    assert model.training  # the engine restored train mode
    for name in set(ROWS):
        own = [i for i, r in enumerate(ROWS) if r == name]
        with mixed_adapters(model, [name] * len(own)):
            alone = engine.generate([reqs[i] for i in own])
        for i, res in zip(own, alone):
            assert mixed[i].response_ids == res.response_ids
            assert mixed[i].logprobs == pytest.approx(res.logprobs, abs=1e-5)
    # the adapters really differ: not every row generated the same thing
    assert len({tuple(r.response_ids) for r in mixed}) > 1


def _grads(model, role):
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in adapter_parameters(model, role)]


def _row_loss(logits, ids):
    """Sum over rows and positions of the next-token log-prob (a sum-reduced loss)."""
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return -logp.sum(-1)


def test_each_adapter_gets_gradient_only_from_its_rows(tok):
    model, _ = make(tok, dropout=0.1)  # LoRA dropout is active in train mode: still no cross-talk
    model.train()
    kw = batch(tok, len(ROWS), seed=7)
    solver = torch.tensor([r == "Solver" for r in ROWS])
    with mixed_adapters(model, ROWS):
        per_row = _row_loss(model(**kw, use_cache=False).logits, kw["input_ids"])
    (per_row * solver).sum().backward()  # loss on the Solver's rows only
    assert all(float(g.abs().sum()) > 0 for g in _grads(model, "Solver"))
    for role in ("Verifier", "Critic"):
        for p in adapter_parameters(model, role):
            assert p.grad is None or torch.count_nonzero(p.grad) == 0
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


def test_mixed_gradient_equals_gradient_of_own_rows_alone(tok):
    model, _ = make(tok)
    model.train()
    kw = batch(tok, len(ROWS), seed=8)
    with mixed_adapters(model, ROWS):
        _row_loss(model(**kw, use_cache=False).logits, kw["input_ids"]).sum().backward()
    mixed = {role: _grads(model, role) for role in ROLES}
    for role in ROLES:
        model.zero_grad(set_to_none=True)
        own = [i for i, r in enumerate(ROWS) if r == role]
        sub = {k: v[own] for k, v in kw.items()}
        with mixed_adapters(model, [role] * len(own)):
            _row_loss(model(**sub, use_cache=False).logits, sub["input_ids"]).sum().backward()
        for got, want in zip(mixed[role], _grads(model, role)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_one_optimizer_step_updates_every_adapter_and_not_the_base(tok):
    model, _ = make(tok)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    lora_before = {r: [p.detach().clone() for p in adapter_parameters(model, r)] for r in ROLES}
    kw = batch(tok, len(ROWS), seed=9)
    with mixed_adapters(model, ROWS):
        loss = _row_loss(model(**kw, use_cache=False).logits, kw["input_ids"]).mean()
    loss.backward()
    opt.step()
    for role in ROLES:
        for before, p in zip(lora_before[role], adapter_parameters(model, role)):
            assert not torch.equal(before, p)
    for n, p in model.named_parameters():
        if n in base_before:
            assert torch.equal(base_before[n], p), n


def test_base_only_gives_the_base_model(tok):
    model, ref = make(tok)
    model.train()
    ref.train()
    kw = batch(tok, len(ROWS), seed=10)
    want = ref(**kw).logits
    with base_only(model):
        torch.testing.assert_close(model(**kw).logits, want, atol=1e-6, rtol=0)
        with mixed_adapters(model, ROWS):  # the base wins over an inner routing too
            torch.testing.assert_close(model(**kw).logits, want, atol=1e-6, rtol=0)
    with mixed_adapters(model, ROWS):
        with base_only(model):
            torch.testing.assert_close(model(**kw).logits, want, atol=1e-6, rtol=0)
        routed = model(**kw).logits
    # PEFT's disable_adapter leaves only the active adapter trainable on exit; base_only undoes that
    assert all(p.requires_grad for p in adapter_parameters(model))
    # BASE rows of a mixed batch are base rows; adapter rows are not
    base_rows = [i for i, r in enumerate(ROWS) if r == BASE]
    torch.testing.assert_close(routed[base_rows], want[base_rows], atol=1e-5, rtol=0)
    assert not torch.allclose(routed[0], want[0], atol=1e-3)


def test_route_rows_takes_adapter_indices(tok):
    model, _ = make(tok)
    kw = batch(tok, 3, seed=11)
    with route_rows(model, [2, -1, 0]):
        a = model(**kw).logits
    with mixed_adapters(model, ["Critic", None, "Solver"]):
        b = model(**kw).logits
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_adapter_state_dict_round_trip(tok, tmp_path):
    from safetensors.torch import load_file, save_file

    model, _ = make(tok)
    sd = adapter_state_dict(model, "Solver")
    assert sd and all(".Solver." not in k and ("lora_A" in k or "lora_B" in k) for k in sd)
    assert len(sd) == len(adapter_parameters(model, "Solver"))
    assert all(t.device.type == "cpu" and t.is_contiguous() and not t.requires_grad for t in sd.values())
    save_file(sd, tmp_path / "solver.safetensors")  # refuses shared storage or non-contiguous tensors
    loaded = load_file(tmp_path / "solver.safetensors")
    params_before = [id(p) for p in adapter_parameters(model, "Verifier")]
    load_adapter_state_dict(model, "Verifier", loaded)
    assert [id(p) for p in adapter_parameters(model, "Verifier")] == params_before  # optimizer stays valid
    kw = batch(tok, 2, seed=12)
    with mixed_adapters(model, ["Solver", "Verifier"]):
        out = model(**kw).logits
    with mixed_adapters(model, ["Verifier", "Solver"]):
        swapped = model(**kw).logits
    torch.testing.assert_close(out, swapped, atol=1e-6, rtol=0)
    sd["Solver"] = sd.popitem()[1]  # a wrong key
    with pytest.raises(KeyError):
        load_adapter_state_dict(model, "Critic", sd)
    with pytest.raises(KeyError):
        adapter_state_dict(model, "Nobody")


def test_routing_errors(tok):
    model, _ = make(tok)
    kw = batch(tok, 3, seed=13)
    with pytest.raises(ValueError, match="unknown adapter"):
        with mixed_adapters(model, ["Solver", "Solvr", "Critic"]):
            pass
    with pytest.raises(ValueError, match="batch size"):
        with mixed_adapters(model, ["Solver", "Critic"]):
            model(**kw)
    assert all("forward" not in m.__dict__ for m in model.modules())  # restored after the error
    model.train()
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    with pytest.raises(NotImplementedError, match="checkpointing"):
        with mixed_adapters(model, ["Solver"] * 3):
            pass
