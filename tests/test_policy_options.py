"""Policy options: gradient checkpointing (same gradients, recomputed activations; with per-agent LoRA
adapters too), chat-template kwargs."""
import pytest
import torch

from masrl.config import AlgorithmConfig, PolicyConfig, TrainerConfig
from masrl.training.policy import build_policy
from masrl.training.update import Row, pack_rows, response_logits, token_logprobs, update_policy

TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
        "intermediate_size": 64, "max_position_embeddings": 128}


def _grads(checkpointing: bool) -> dict[str, torch.Tensor]:
    policy = build_policy("p", PolicyConfig(tiny=TINY, gradient_checkpointing=checkpointing), seed=0,
                          max_rollout_batch=8)
    assert getattr(policy.model, "is_activation_checkpointing", None) == checkpointing
    rows = [Row("A", [5, 6, 7, 8], [9, 10, 11], [0.0] * 3, 1.0), Row("A", [5, 6], [12, 13], [0.0] * 2, -1.0)]
    batch = pack_rows(rows, int(policy.tokenizer.pad_token_id))
    policy.model.train()
    logp = token_logprobs(response_logits(policy.model, batch), batch.targets)
    (-(logp * batch.response_mask * batch.advantages[:, None]).sum()).backward()
    return {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_gives_the_same_gradients():
    plain, checkpointed = _grads(False), _grads(True)
    assert set(plain) == set(checkpointed) and len(plain) > 5
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-7)


def _per_agent_lora_grads(checkpointing: bool) -> dict[str, torch.Tensor]:
    policy = build_policy("p", PolicyConfig(tiny=TINY, gradient_checkpointing=checkpointing,
                                            lora={"r": 4, "alpha": 8, "per_agent": True}),
                          seed=0, max_rollout_batch=8, agents=["A", "B"])
    llama = policy.model.base_model.model
    assert llama.is_activation_checkpointing == checkpointing  # still on under PEFT's wrapper
    # count the decoder layers' forwards (module hooks do not run in the recomputation: wrap forward itself)
    calls = []
    for layer in llama.model.layers:
        forward = layer.mlp.forward
        layer.mlp.forward = lambda *a, _f=forward, **k: calls.append(torch.is_grad_enabled()) or _f(*a, **k)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # lora_B starts at zero (no gradient for lora_A): give every adapter weights
        for name, p in sorted(policy.model.named_parameters()):
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    rows = [Row("A", [5, 6, 7, 8], [9, 10, 11], [-2.0] * 3, 1.0), Row("B", [5, 6], [12, 13], [-2.0] * 2, -1.0),
            Row("A", [7, 8], [14, 15, 16], [-2.0] * 3, -0.5), Row("B", [9, 6, 5], [11], [-2.0], 0.5)]
    update_policy(policy, rows, AlgorithmConfig(), TrainerConfig(autocast="float32"), step=0, seed=0)
    # the update's forwards with gradients (old log-probs come from the rows): once per layer, twice with
    # checkpointing (the recomputation in backward)
    assert sum(calls) == len(llama.model.layers) * (2 if checkpointing else 1), calls
    return {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_with_per_agent_adapters_gives_the_same_gradients():
    """Rows are routed to their agent's adapter during the recomputation in backward, too, and the layers really
    are recomputed (a checkpointing left off by the adapters' wrapper would pass the gradient comparison)."""
    plain, checkpointed = _per_agent_lora_grads(False), _per_agent_lora_grads(True)
    assert set(plain) == set(checkpointed) and any(".B." in n for n in plain) and any(".A." in n for n in plain)
    assert all(float(g.abs().max()) > 0 for g in plain.values())
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-7)


def test_chat_template_kwargs_reach_the_template():
    template = ("{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}"
                "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    ids = {}
    for kwargs in ({}, {"enable_thinking": False}):
        policy = build_policy("p", PolicyConfig(tiny=TINY, chat_template_kwargs=kwargs), seed=0, max_rollout_batch=8)
        policy.tokenizer.chat_template = template
        ids[bool(kwargs)] = policy.decode(policy.encode_prompt("hi"))
    assert ids[False] == "hi" and ids[True] == "/no_think hi"


def test_fused_adamw_auto_picks_the_kernel_by_trained_size_and_explicit_values_win():
    """``optim.fused: auto`` (the default): the fused kernel from 10M trained parameters (SmolLM2 full fine-tuning),
    the reference kernel below (tiny models keep their exact numbers); true / false are taken as given."""
    from masrl.training.policy import FUSED_ADAMW_MIN_PARAMS, use_fused_adamw

    assert PolicyConfig().optim.fused == "auto"
    small = [torch.zeros(FUSED_ADAMW_MIN_PARAMS // 2), torch.zeros(FUSED_ADAMW_MIN_PARAMS // 2 - 1)]
    assert not use_fused_adamw("auto", small)
    assert use_fused_adamw("auto", small + [torch.zeros(1)])
    assert not use_fused_adamw("auto", small + [torch.zeros(1, dtype=torch.int64)])  # not a float tensor
    assert use_fused_adamw(True, small) and not use_fused_adamw(False, small + [torch.zeros(1)])
    for fused, expect in (("auto", None), (True, True)):
        policy = build_policy("p", PolicyConfig(tiny=TINY, optim={"fused": fused}), seed=0, max_rollout_batch=8)
        assert policy.optimizer.defaults["fused"] is expect


def _sft_run(autocast):
    """Two SFT steps on one tiny policy; returns (per-step losses, the dtypes the q_proj matmuls ran in)."""
    from masrl.config import SFTConfig
    from masrl.training.sft import run_sft

    policy = build_policy("p", PolicyConfig(tiny=TINY), seed=0, max_rollout_batch=8)
    rows = [Row("A", [5, 6, 7, 8], [9, 10, 11], [0.0] * 3, 0.0, policy="p"),
            Row("A", [5, 6], [12, 13, 14, 15], [0.0] * 4, 0.0, policy="p")]
    seen = set()
    hook = policy.model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.add(o.dtype))
    losses = []
    run_sft({"p": policy}, rows, SFTConfig(steps=2, batch_size=2, warmup_steps=0), seed=0, micro_batch_tokens=4096,
            on_step=lambda step, m: losses.append(m["sft/p/loss"]), autocast=autocast)
    hook.remove()
    return losses, seen


def test_sft_runs_under_trainer_autocast():
    """SFT follows ``trainer.autocast`` like the RL update: the forward's matmuls in bfloat16 (the loss in float32),
    float32 when off; the two losses agree to bf16 precision."""
    plain, dtypes_plain = _sft_run(None)
    bf16, dtypes_bf16 = _sft_run("bfloat16")
    assert dtypes_plain == {torch.float32} and dtypes_bf16 == {torch.bfloat16}
    assert plain != bf16
    torch.testing.assert_close(torch.tensor(bf16), torch.tensor(plain), rtol=2e-2, atol=2e-2)
    assert _sft_run("float32")[0] == plain


@pytest.mark.parametrize("checkpointing", [False, True])
def test_sft_trains_each_agents_own_adapter(checkpointing):
    """Per-agent LoRA: a demonstration trains its agent's adapter only. (Before the fix SFT ran unrouted, i.e.
    through PEFT's first active adapter: every agent's demonstrations trained the first agent's adapter and the
    others stayed at their zero start, so a SmolLM2 Verifier never learned its tag.)"""
    from masrl.config import SFTConfig
    from masrl.training.sft import run_sft

    policy = build_policy("p", PolicyConfig(tiny=TINY, gradient_checkpointing=checkpointing,
                                            lora={"r": 4, "alpha": 8, "per_agent": True}),
                          seed=0, max_rollout_batch=8, agents=["A", "B"])
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters() if "lora_" in n}
    rows = [Row("B", [5, 6, 7, 8], [9, 10, 11], [0.0] * 3, 0.0, policy="p"),
            Row("B", [5, 6], [12, 13], [0.0] * 2, 0.0, policy="p")]
    run_sft({"p": policy}, rows, SFTConfig(steps=3, batch_size=2, lr=1e-2, warmup_steps=0), seed=0,
            micro_batch_tokens=4096)
    moved = {n for n, p in policy.model.named_parameters() if "lora_" in n and not torch.equal(p, before[n])}
    assert moved and all(".B." in n for n in moved)  # B's adapter trained, A's untouched
    assert any(".A." in n for n in before)
