"""trainer.logprob_chunk_tokens: response log-probs and entropy from the hidden states in chunks
(masrl.training.logprobs) equal the full-logits path within 1e-5 in float32, gradients included
(hidden states, LM head, tied embeddings, a LoRA adapter), and an update step is unchanged."""
import copy

import pytest
import torch

from masrl.algorithms.losses import entropy_from_logits
from masrl.config import AlgorithmConfig, PolicyConfig, TrainerConfig
from masrl.training.logprobs import chunked_token_logprobs, lm_head_params, response_logprobs
from masrl.training.policy import build_policy
from masrl.training.update import Row, pack_rows, response_logits, token_logprobs, update_policy_raw

TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
        "intermediate_size": 64, "max_position_embeddings": 128}


def _plain(hidden, weight, bias, targets, temp):
    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temp[:, None]
    return token_logprobs(logits, targets), entropy_from_logits(logits)


@pytest.mark.parametrize("chunk", [1, 7, 16, 64])  # 16 divides the 48 tokens, 7 does not, 64 is one chunk
def test_chunked_equals_plain_with_gradients(chunk):
    g = torch.Generator().manual_seed(0)
    n, d, vocab = 48, 16, 300
    hidden = torch.randn(n, d, generator=g, requires_grad=True)
    weight = (torch.randn(vocab, d, generator=g) * 0.5).requires_grad_()
    bias = torch.randn(vocab, generator=g, requires_grad=True)
    targets = torch.randint(0, vocab, (n,), generator=g)
    temp = torch.rand(n, generator=g) + 0.5  # a temperature per token
    w_lp, w_h = torch.randn(n, generator=g), torch.randn(n, generator=g)  # arbitrary upstream gradients

    results = []
    for fn in (_plain, lambda *a: chunked_token_logprobs(*a[:4], chunk, a[4], with_entropy=True)):
        for t in (hidden, weight, bias):
            t.grad = None
        logp, ent = fn(hidden, weight, bias, targets, temp)
        ((logp * w_lp).sum() + (ent * w_h).sum()).backward()
        results.append([logp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone(), bias.grad.clone()])
    for name, a, b in zip(["logp", "entropy", "d_hidden", "d_weight", "d_bias"], *results):
        # 1e-5 of the tensor's largest entry: float32 summation order differs by CPU (one chunk per
        # token sums 48 outer products one by one where the plain path makes one matmul)
        scale = max(1.0, a.abs().max().item())
        torch.testing.assert_close(b, a, atol=1e-5 * scale, rtol=1e-5, msg=name)


def test_chunked_without_entropy_and_logprob_only_gradient():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(10, 8, generator=g, requires_grad=True)
    weight = torch.randn(50, 8, generator=g)
    targets = torch.randint(0, 50, (10,), generator=g)
    logp, ent = chunked_token_logprobs(hidden, weight, None, targets, 3)
    assert ent is None
    logp.sum().backward()
    ref = hidden.detach().clone().requires_grad_()
    token_logprobs(ref @ weight.T, targets).sum().backward()
    torch.testing.assert_close(hidden.grad, ref.grad, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="chunk_size must be > 0"):
        chunked_token_logprobs(hidden, weight, None, targets, 0)
    with pytest.raises(ValueError, match=r"hidden must be \[N, d\]"):
        chunked_token_logprobs(hidden[None], weight, None, targets, 4)


def _rows(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):  # ragged prompts and responses (one empty-prompt-free, mixed temperatures)
        prompt = torch.randint(5, 60, (3 + i % 4,), generator=g).tolist()
        resp = torch.randint(5, 60, (1 + (i * 3) % 7,), generator=g).tolist()
        rows.append(Row("A" if i % 2 else "B", prompt, resp, [-1.0] * len(resp), (-1.0) ** i * (0.5 + i / 7),
                        temperature=1.0 if i % 3 else 0.7))
    return rows


def _model_case(lora: bool):
    cfg = PolicyConfig(tiny=TINY, optim={"lr": 1e-2, "grad_clip": None})
    if lora:
        cfg = PolicyConfig(tiny=TINY, optim={"lr": 1e-2, "grad_clip": None},
                           lora={"r": 4, "target_modules": ["q_proj", "v_proj"]})
    policy = build_policy("p", cfg, seed=0, max_rollout_batch=8)
    if lora:  # lora_B starts at zero: give the adapter a non-trivial value so its gradient is informative
        with torch.no_grad():
            for name, p in policy.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    return policy


@pytest.mark.parametrize("lora", [False, True])
def test_model_logprobs_and_gradients_match_plain(lora):
    policy = _model_case(lora)
    model = policy.model
    weight, _ = lm_head_params(model)
    assert weight is model.get_input_embeddings().weight  # tiny ties the LM head to the embeddings
    batch = pack_rows(_rows(), int(policy.tokenizer.pad_token_id))
    mask = batch.response_mask
    params = [p for p in model.parameters() if p.requires_grad]
    assert any("lora_" in n for n, p in model.named_parameters() if p.requires_grad) == lora

    def run(chunked: bool):
        model.zero_grad(set_to_none=True)
        if chunked:
            logp, ent = response_logprobs(model, batch, 4, with_entropy=True)
        else:
            logits = response_logits(model, batch)
            logp, ent = token_logprobs(logits, batch.targets), entropy_from_logits(logits)
        (((logp * 0.7 - ent * 0.3) * mask).sum() / mask.sum()).backward()
        return logp.detach() * mask, ent.detach() * mask, [p.grad.clone() for p in params]

    plain, chunked = run(False), run(True)
    torch.testing.assert_close(chunked[0], plain[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked[1], plain[1], atol=1e-5, rtol=1e-5)
    assert float(plain[0].abs().sum()) > 0 and float(plain[1].abs().sum()) > 0
    for (name, _), a, b in zip([(n, p) for n, p in model.named_parameters() if p.requires_grad], plain[2], chunked[2]):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=name)
    assert float(plain[2][0].abs().sum()) > 0


def test_lora_on_the_lm_head_gives_the_merged_weight_and_its_gradient():
    policy = build_policy("p", PolicyConfig(tiny=TINY, lora={"r": 4, "target_modules": ["q_proj", "lm_head"]}),
                          seed=0, max_rollout_batch=8)
    model = policy.model
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    batch = pack_rows(_rows(seed=3), int(policy.tokenizer.pad_token_id))
    head_a = [p for n, p in model.named_parameters() if "lm_head" in n and "lora_A" in n][0]
    grads = []
    for chunked in (False, True):
        model.zero_grad(set_to_none=True)
        logp = response_logprobs(model, batch, 5)[0] if chunked else token_logprobs(response_logits(model, batch),
                                                                                      batch.targets)
        (logp * batch.response_mask).sum().backward()
        grads.append((logp.detach() * batch.response_mask, head_a.grad.clone()))
    torch.testing.assert_close(grads[1][0], grads[0][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[1][1], grads[0][1], atol=1e-5, rtol=1e-5)
    assert float(grads[0][1].abs().sum()) > 0


def test_softcapped_logits_take_the_plain_path():
    policy = _model_case(False)
    policy.model.config.final_logit_softcapping = 30.0
    batch = pack_rows(_rows(), int(policy.tokenizer.pad_token_id))
    assert lm_head_params(policy.model) is None and response_logprobs(policy.model, batch, 8) is None
    assert response_logprobs(_model_case(False).model, batch, 0) is None  # 0: the plain path


def _no_full_logits(*args, **kwargs):
    raise AssertionError("full-vocabulary logits built with trainer.logprob_chunk_tokens > 0")


@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_update_step_equal_with_the_lever_on_and_off(entropy_coef, monkeypatch):
    rows = _rows(7, seed=5)
    params, metrics = [], []
    algo = AlgorithmConfig(loss={"entropy_coef": entropy_coef})
    # lr 1e-3 (Adam): an element whose gradient is ~1e-8 (a rarely-used vocabulary row) moves by ~lr whatever its
    # last digits, so the parameter tolerance scales with lr; at 1e-2 the largest gap is 1.7e-6, at 1e-3 ~2e-7
    base = _model_case(False)
    for g in base.optimizer.param_groups:
        g["lr"] = 1e-3
    for chunk_tokens in (0, 6):
        policy = copy.deepcopy(base)
        if chunk_tokens:  # the lever on never builds full logits
            monkeypatch.setattr("masrl.training.update.response_logits", _no_full_logits)
        trainer = TrainerConfig(micro_batch_tokens=40, logprob_chunk_tokens=chunk_tokens, autocast="float32")
        raw = update_policy_raw(policy, rows, algo, trainer, step=0, seed=0)
        params.append([p.detach().clone() for p in policy.model.parameters()])
        metrics.append(raw)
    moved = max(float((a - b.detach()).abs().max()) for a, b in zip(params[0], base.model.parameters()))
    assert moved > 1e-4  # the step changed the model
    for a, b in zip(*params):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)
    assert metrics[0].keys() == metrics[1].keys()
    for key in ("pg_loss", "agent/A/entropy", "agent/B/entropy"):
        assert metrics[1][key] == pytest.approx(metrics[0][key], abs=1e-5)


def test_bf16_autocast_matches_the_plain_path_under_autocast():
    policy = _model_case(False)
    model = policy.model
    batch = pack_rows(_rows(), int(policy.tokenizer.pad_token_id))
    mask = batch.response_mask
    out = []
    for chunked in (False, True):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logp = (response_logprobs(model, batch, 4)[0] if chunked
                    else token_logprobs(response_logits(model, batch), batch.targets))
        assert logp.dtype == torch.float32
        ((logp * mask).sum() / mask.sum()).backward()
        emb = model.get_input_embeddings().weight.grad
        assert emb.dtype == torch.float32
        out.append((logp.detach() * mask, emb.clone()))
    # the same bf16 matmuls and float32 softmax; only the summation order of the tokens' matmul differs
    torch.testing.assert_close(out[1][0], out[0][0], atol=2e-2, rtol=0)
    torch.testing.assert_close(out[1][1], out[0][1], atol=2e-3, rtol=5e-2)


def test_bfloat16_weights_without_autocast():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(12, 16, generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(90, 16, generator=g) * 0.5).bfloat16().requires_grad_()
    targets = torch.randint(0, 90, (12,), generator=g)
    out = []
    for chunked in (False, True):
        hidden.grad = weight.grad = None
        if chunked:
            logp = chunked_token_logprobs(hidden, weight, None, targets, 5)[0]
        else:
            logp = token_logprobs(torch.nn.functional.linear(hidden, weight).float(), targets)
        logp.sum().backward()
        assert logp.dtype == torch.float32 and hidden.grad.dtype == weight.grad.dtype == torch.bfloat16
        out.append((logp.detach(), hidden.grad.float(), weight.grad.float()))
    for a, b in zip(*out):
        torch.testing.assert_close(b, a, atol=3e-2, rtol=3e-2)


def test_chunks_are_on_by_default_and_off_by_default_under_fsdp(tiny_cfg):
    from masrl.config import config_from_dict

    assert TrainerConfig().logprob_chunk_tokens == 1024
    fsdp = {"runtime.kind": "ray", "runtime.workers": 2, "runtime.strategy": "fsdp"}
    assert config_from_dict(tiny_cfg(**fsdp)).trainer.logprob_chunk_tokens == 0
    with pytest.raises(Exception, match="logprob_chunk_tokens"):  # asked for explicitly: one clear error
        config_from_dict(tiny_cfg(**fsdp, **{"trainer.logprob_chunk_tokens": 512}))


def test_an_agents_entropy_is_a_mean_over_its_tokens_whatever_the_micro_batch_size():
    """`agent/<a>/entropy` of one update is the same at micro-batches of 40 tokens and of 4096 (one micro-batch):
    the mean over the agent's response tokens, not a mean of micro-batch means, which moved with the micro-batch
    size (and so with trainer.memory_defaults)."""
    from masrl.training.update import update_policy

    rows = _rows(7, seed=5)
    base = _model_case(False)
    values = []
    for tokens in (40, 4096):
        trainer = TrainerConfig(micro_batch_tokens=tokens, autocast="float32")
        out = update_policy(copy.deepcopy(base), rows, AlgorithmConfig(), trainer, step=0, seed=0)
        assert not any("#" in key for key in out)  # the token counts are not metrics of their own
        values.append({k: v for k, v in out.items() if k.endswith("/entropy")})
    assert values[0].keys() == values[1].keys() == {"agent/A/entropy", "agent/B/entropy"}
    for key in values[0]:
        assert values[0][key] == pytest.approx(values[1][key], abs=1e-5)
