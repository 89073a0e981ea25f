"""One call that checks masrl on one GPU (H100/H200), with torch, transformers and peft only (no vLLM, no Ray).

The model is Qwen-shaped (``Qwen3ForCausalLM``, Qwen3-0.6B's layers: hidden 1024, 28 layers, 16 query / 8 KV heads
of 128, intermediate 3072; masrl's character vocabulary), built from a config with random weights and written to a
temporary folder that policies load like any pretrained model. One line per check (PASS / FAIL / SKIP, with its
seconds); exit 1 if any fails, 2 for an unknown check name. Budget: under 8 minutes on one H100 (docs/scaling.md).

  python benchmarks/gpu_check.py                 # every check on CUDA (SKIP without it)
  python benchmarks/gpu_check.py --dry-run       # the same code path on CPU with a 2-layer Qwen3 (seconds)
  python benchmarks/gpu_check.py per_role_lora_logprobs fsdp_one_rank   # a subset by name
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# Qwen3-0.6B's decoder; --dry-run: two narrow layers
QWEN_SHAPE = {"hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
              "head_dim": 128, "intermediate_size": 3072}
DRY_SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "intermediate_size": 128}
TINY = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 768, "max_position_embeddings": 512}
DRY = {"on": False}  # set by --dry-run: smaller batches, shapes and lengths, same functions
_FOLDER: dict[str, str] = {}


def qwen_folder() -> str:
    """A Qwen3-shaped model with random weights and masrl's character tokenizer, saved once per process."""
    if "path" not in _FOLDER:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        from masrl.models.tiny import build_char_tokenizer

        tok = build_char_tokenizer()
        shape = DRY_SHAPE if DRY["on"] else QWEN_SHAPE
        cfg = Qwen3Config(vocab_size=len(tok), max_position_embeddings=1024, tie_word_embeddings=True,
                          rope_theta=1_000_000.0, rms_norm_eps=1e-6, bos_token_id=tok.bos_token_id,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **shape)
        torch.manual_seed(0)
        path = tempfile.mkdtemp(prefix="masrl-gpu-check-qwen3-")
        Qwen3ForCausalLM(cfg).save_pretrained(path)
        tok.save_pretrained(path)
        _FOLDER["path"] = path
    return _FOLDER["path"]


def _cfg(device: str, example: str = "quickstart.yaml", **over):
    from masrl.config import load_config

    small = {"trainer.batch_size": 2, "trainer.group_size": 2} if DRY["on"] else {}
    overrides = [f"trainer.device={device}", "logging.tensorboard=false", "logging.plots=false",
                 "logging.progress=false"]
    overrides += [f"{k}={v}" for k, v in {**small, **over}.items()]
    return load_config(ROOT / "examples" / example, overrides)


def _qwen_cfg(device: str, **over):
    return _cfg(device, **{"policies.shared.model": qwen_folder(), "policies.shared.dtype": "float32", **over})


def _policy(cfg, name: str = "shared"):
    from masrl.runtime.local import policy_build_args
    from masrl.training.policy import build_policy

    args = policy_build_args(cfg, Path(tempfile.mkdtemp()))[name]
    return build_policy(name, cfg.policies[name], **args)


def _rows(policy, n=8, seed=0, agents=("Solver",), new_tokens=16):
    from masrl.rollout.engine import GenRequest
    from masrl.training.update import Row

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(40, 90, (int(torch.randint(8, 24, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    roles = [agents[i % len(agents)] for i in range(n)]
    results = policy.engine.generate([GenRequest(p, max_new_tokens=new_tokens,
                                                 adapter=policy.adapter_of.get(a) if policy.adapter_of else None)
                                      for p, a in zip(prompts, roles)])
    return [Row(a, p, r.response_ids, r.logprobs, 1.0 if i % 2 else -1.0, policy=policy.name)
            for i, (p, r, a) in enumerate(zip(prompts, results, roles))]


def check_engine_logprobs(device: str) -> str:
    """float32: the engine's sampled log-probs are the trainer's (within 1e-3)."""
    from masrl.training.update import pack_rows, response_logits, token_logprobs

    policy = _policy(_qwen_cfg(device))
    rows = [r for r in _rows(policy) if r.response_ids]
    batch = pack_rows(rows, int(policy.tokenizer.pad_token_id), device)
    with torch.no_grad():
        trainer = token_logprobs(response_logits(policy.model, batch), batch.targets)
    diff = ((trainer - batch.old_logprobs).abs() * batch.response_mask).max().item()
    assert diff < 1e-3, f"max |engine - trainer| = {diff:.2e} (limit 1e-3, float32)"
    return f"Qwen3-shaped float32: max |engine - trainer| log-prob = {diff:.2e} over {int(batch.response_mask.sum())} tokens"


def check_decode_bf16(device: str) -> str:
    """bf16 greedy decoding: every token the engine picks is transformers' own bf16 argmax on the same sequence,
    or within 0.1 of it in logit (bf16 kernels of another shape may break near-ties); tokens/s reported."""
    from transformers import AutoModelForCausalLM

    from masrl.rollout.engine import GenRequest, TransformersEngine

    model = AutoModelForCausalLM.from_pretrained(qwen_folder(), dtype=torch.bfloat16).to(device).eval()
    engine = TransformersEngine(model, eos_token_ids=[-1], pad_token_id=0, seed=0, autocast="bfloat16")
    g = torch.Generator().manual_seed(3)
    rows, prompt, new = (4, 12, 8) if DRY["on"] else (32, 64, 64)
    prompts = torch.randint(40, 90, (rows, prompt), generator=g)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    engine.generate([GenRequest(prompts[0].tolist(), temperature=0.0, max_new_tokens=2)])  # warm-up
    sync()
    t = time.perf_counter()
    res = engine.generate([GenRequest(p.tolist(), temperature=0.0, max_new_tokens=new) for p in prompts])
    sync()
    seconds = time.perf_counter() - t
    seq = torch.cat([prompts, torch.tensor([r.response_ids for r in res])], 1).to(device)
    with torch.no_grad():
        logits = model(input_ids=seq).logits[:, prompt - 1:-1].float()
    chosen = logits.gather(-1, seq[:, prompt:, None])[..., 0]
    gap = (logits.max(-1).values - chosen).max().item()
    exact = (logits.argmax(-1) == seq[:, prompt:]).float().mean().item()
    assert gap <= 0.1, f"a greedy token {gap:.3f} below transformers' bf16 argmax logit (limit 0.1)"
    return (f"bf16 greedy decode, {rows} rows x {new}: {exact:.1%} of tokens transformers' argmax, the rest within "
            f"{gap:.3f} in logit; {rows * new / seconds:.0f} tok/s")


def check_rl_steps_bf16(device: str) -> str:
    """Two RL steps of the quickstart team on the Qwen-shaped policy under bf16 autocast."""
    import json

    from masrl.trainer import Trainer

    cfg = _qwen_cfg(device, **{"trainer.autocast": "bfloat16", "trainer.total_steps": 2, "sft.steps": 2,
                               "eval.before_after": "false", "output_dir": tempfile.mkdtemp()})
    with Trainer(cfg, progress=False) as trainer:
        trainer.fit()
    lines = [json.loads(x) for x in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    norms = [m["policy/shared/grad_norm"] for m in lines if "policy/shared/grad_norm" in m]
    # an untrained model may score 0 everywhere in a step (no advantage, no gradient); finite, and moving once
    assert len(norms) >= 2 and all(n == n for n in norms) and max(norms) > 0, f"grad_norm per step {norms}"
    return f"Qwen3-shaped, quickstart team, 2 RL steps, bf16 autocast: grad_norm {', '.join(f'{n:.3g}' for n in norms)}"


def check_fsdp_one_rank(device: str) -> str:
    """FSDP2 over a one-rank group: one update equals the unsharded replica's."""
    from masrl.training.fsdp import FSDPOptions, ShardedDataParallel, shard_policy
    from masrl.training.update import update_policy

    cfg = _qwen_cfg(device)
    ref, sharded = _policy(cfg), _policy(cfg)
    rows = _rows(ref)
    shard_policy(sharded, FSDPOptions(param_dtype="float32"), torch.device(device),
                 "nccl" if device == "cuda" else "gloo")
    a = update_policy(ref, rows, cfg.algorithm, cfg.trainer, step=0, seed=0)
    b = update_policy(sharded, rows, cfg.algorithm, cfg.trainer, step=0, seed=0, dp=ShardedDataParallel(0, 1))
    full = {n: p.full_tensor() for n, p in sharded.model.named_parameters()}
    diff = max((full[n] - p).abs().max().item() for n, p in ref.model.named_parameters())
    assert diff < 1e-5, f"max |fsdp - replica| parameter = {diff:.2e}"
    key = "policy/shared/grad_norm"
    assert abs(a[key] - b[key]) <= 1e-4 * a[key], f"grad_norm {a[key]} vs {b[key]}"
    return f"FSDP2 one rank = replica: max parameter diff {diff:.2e}, grad_norm {b[key]:.4g}"


def check_per_role_lora_logprobs(device: str) -> str:
    """One LoRA adapter per role, after an update: each role's sampled log-probs are the trainer's under that
    role's adapter (a trained adapter that never reaches the sampler fails here), and not another role's."""
    import dataclasses

    from masrl.models.lora import adapter_parameters
    from masrl.training.policy import after_update
    from masrl.training.update import update_policy, with_trainer_logprobs

    lora = {"r": 8, "alpha": 16, "per_agent": True,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
    cfg = _qwen_cfg(device, **{"policies.shared.lora": str(lora).replace("'", '"').replace(" ", "")})
    policy = _policy(cfg)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # adapters far apart, so that a row decoded with the wrong one shows
        for p in adapter_parameters(policy.model):
            p.copy_((torch.randn(p.shape, generator=g) * 0.05).to(p.device))
    update_policy(policy, _rows(policy, agents=("Solver", "Verifier")), cfg.algorithm, cfg.trainer, step=0, seed=0)
    after_update(policy)  # what the runtime does after every update
    rows = [r for r in _rows(policy, n=12, seed=1, agents=("Solver", "Verifier")) if r.response_ids]
    scored = with_trainer_logprobs(policy, rows, cfg.trainer)
    swapped = with_trainer_logprobs(policy, [dataclasses.replace(r, agent={"Solver": "Verifier"}.get(r.agent, "Solver"))
                                             for r in rows], cfg.trainer)
    worst, other = {}, float("inf")
    for r, s, w in zip(rows, scored, swapped):
        d = max(abs(a - b) for a, b in zip(s.old_logprobs, s.rollout_logprobs))
        worst[r.agent] = max(worst.get(r.agent, 0.0), d)
        other = min(other, max(abs(a - b) for a, b in zip(w.old_logprobs, s.rollout_logprobs)))
    assert set(worst) == {"Solver", "Verifier"} and max(worst.values()) < 1e-3, f"max |engine - trainer| {worst}"
    assert other > 10 * max(worst.values()), f"another role's adapter scores as close ({other:.2e}): check is blind"
    return ("per-role LoRA after an update: max |sampled - trainer| log-prob " +
            ", ".join(f"{a} {d:.1e}" for a, d in sorted(worst.items())) + f"; under the other role's adapter >= {other:.2f}")


def check_peak_memory_vs_plan(device: str) -> str:
    """One update's peak device memory against ``masrl plan``'s weights + grads + optimizer + activations."""
    from masrl.plan import counted, plan_policy
    from masrl.training.update import update_policy

    cfg = _qwen_cfg(device, **{"trainer.autocast": "bfloat16"})
    policy = _policy(cfg)
    rows = _rows(policy, n=32)
    prompt = max(len(r.prompt_ids) for r in rows)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    update_policy(policy, rows, cfg.algorithm, cfg.trainer, step=0, seed=0)
    terms = counted(plan_policy(cfg, "shared", prompt_tokens=prompt, cuda=device == "cuda"))
    planned = sum(v for k, v in terms.items() if k != "kv_cache")
    if device != "cuda":
        return f"plan {planned / 2**20:.1f} MiB (peak device memory is measured on CUDA only)"
    peak = torch.cuda.max_memory_allocated()
    ratio = peak / planned
    assert 0.75 <= ratio <= 1.25, f"peak {peak / 2**20:.1f} MiB vs plan {planned / 2**20:.1f} MiB"
    return f"peak {peak / 2**20:.1f} MiB vs plan {planned / 2**20:.1f} MiB (ratio {ratio:.2f})"


def check_mixed_lora(device: str) -> str:
    """One mixed batch through per-agent LoRA (masrl.models.lora.mixed_adapters) on ``device``: each row's logits
    equal PEFT's own single-adapter forward, and each adapter's gradient equals the gradient of its rows alone."""
    import copy
    import warnings

    from masrl.models.lora import BASE, adapter_parameters, attach_adapters, mixed_adapters, set_all_trainable
    from masrl.models.tiny import build_char_tokenizer, build_tiny_model

    roles = ["Solver", "Verifier", "Critic"]
    order = ["Solver", "Verifier", "Solver", "Critic", BASE, "Verifier", "Critic", "Solver"]
    tok = build_char_tokenizer()
    base = build_tiny_model(tok, {**TINY, "hidden_size": 64, "intermediate_size": 128}, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = attach_adapters(copy.deepcopy(base), roles, r=4, alpha=8,
                                target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"])
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in adapter_parameters(model):
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    model.to(device).train()
    ids = torch.randint(10, len(tok), (len(order), 12), generator=g).to(device)
    worst = 0.0
    with torch.no_grad():
        with mixed_adapters(model, order):
            mixed = model(input_ids=ids, use_cache=False).logits
        for i, name in enumerate(order):
            if name == BASE:
                with model.disable_adapter():
                    native = model(input_ids=ids[i:i + 1], use_cache=False).logits
            else:
                model.set_adapter(name)
                native = model(input_ids=ids[i:i + 1], use_cache=False).logits
            worst = max(worst, (mixed[i] - native[0]).abs().max().item())
    model.set_adapter(roles[0])
    set_all_trainable(model)
    assert worst < 1e-4, f"max |mixed - PEFT's own adapter forward| logit = {worst:.2e}"

    def loss(rows_ids):
        logits = model(input_ids=rows_ids, use_cache=False).logits
        return -torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, rows_ids[:, 1:, None]).sum()

    with mixed_adapters(model, order):
        loss(ids).backward()
    grads = {r: [p.grad.clone() for p in adapter_parameters(model, r)] for r in roles}
    gworst = 0.0
    for role in roles:
        model.zero_grad(set_to_none=True)
        own = [i for i, r in enumerate(order) if r == role]
        with mixed_adapters(model, [role] * len(own)):
            loss(ids[own]).backward()
        for got, want in zip(grads[role], (p.grad for p in adapter_parameters(model, role))):
            gworst = max(gworst, ((got - want).abs().max() / want.abs().max().clamp(min=1e-12)).item())
    assert gworst < 1e-4, f"max relative |mixed - own rows| adapter gradient = {gworst:.2e}"
    return f"mixed batch of 3 adapters + base: logits within {worst:.1e} of PEFT, gradients within {gworst:.1e}"


def check_lora_team_rl_step_bf16(device: str) -> str:
    """Two RL steps of the Voting team with one LoRA adapter per role (examples/voting_isolated.yaml) under bf16
    autocast: the engine decodes each row with its role's adapter, one optimizer step moves every adapter."""
    from masrl.trainer import Trainer

    out = tempfile.mkdtemp()
    full = {"trainer.batch_size": 8, "trainer.group_size": 4}  # the example's own batch: some group differs
    cfg = _cfg(device, "voting_isolated.yaml", **{"trainer.autocast": "bfloat16", "trainer.total_steps": 2,
                                                  "sft.steps": 4, "eval.before_after": "false", "output_dir": out,
                                                  **full})
    with Trainer(cfg, progress=False) as trainer:
        trainer.fit()
    import json

    last = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()][-1]
    norms = {k: v for k, v in last.items() if k.endswith("grad_norm") and isinstance(v, (int, float))}
    # an agent whose groups all scored alike has no gradient this step; the policy's norm must move
    assert norms.get("policy/team/grad_norm", 0) > 0 and all(v == v for v in norms.values()), f"grad norms {norms}"
    return "Voting, one adapter per role, 2 RL steps, bf16: " + ", ".join(f"{k} {v:.3g}" for k, v in norms.items())


def check_engine_speed_smollm2_shape(device: str) -> str:
    """Tokens per second of the in-process engine on a randomly initialised SmolLM2-135M-shaped Llama (bf16, two
    LoRA adapters routed per row, as in a team) next to transformers' own ``generate`` on the same base model and
    batch (sampling, no stop token). A figure, not a pass/fail line (exact numbers: docs/scaling.md)."""
    import time
    import warnings

    from transformers import LlamaConfig, LlamaForCausalLM

    ENGINE_ROWS = (8, 32, 128)

    from masrl.models.lora import attach_adapters
    from masrl.rollout.engine import GenRequest, TransformersEngine

    torch.manual_seed(0)
    shape = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3) if not DRY["on"] else dict(hidden_size=64, intermediate_size=128,
                                                                  num_hidden_layers=2, num_attention_heads=4,
                                                                  num_key_value_heads=2)
    cfg = LlamaConfig(vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True, rope_theta=100000.0,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2, **shape)
    base = LlamaForCausalLM(cfg).to(device=device, dtype=torch.bfloat16).eval()
    prompt, new = (96, 64) if not DRY["on"] else (8, 4)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    parts = []
    for rows in ENGINE_ROWS if not DRY["on"] else (2,):
        ids = torch.randint(3, cfg.vocab_size, (rows, prompt), device=device)
        with torch.no_grad():
            base.generate(ids[:2], attention_mask=torch.ones_like(ids[:2]), max_new_tokens=4, do_sample=True,
                          pad_token_id=2)  # warm-up
            sync()
            t = time.perf_counter()
            out = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                do_sample=True, pad_token_id=2)
            sync()
            hf = rows * (out.shape[1] - prompt) / (time.perf_counter() - t)
        parts.append((rows, hf))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = attach_adapters(base, ["Solver", "Verifier"], r=16, alpha=32,
                                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj"])
    model.eval()
    line = []
    for rows, hf in parts:
        engine = TransformersEngine(model, eos_token_ids=[2], pad_token_id=2, seed=0, autocast="bfloat16")
        reqs = [GenRequest(torch.randint(3, cfg.vocab_size, (prompt,)).tolist(), max_new_tokens=new,
                           adapter=("Solver", "Verifier")[i % 2]) for i in range(rows)]
        engine.generate(reqs[:2])  # warm-up
        sync()
        t = time.perf_counter()
        res = engine.generate(reqs)
        sync()
        tps = sum(len(r.response_ids) for r in res) / (time.perf_counter() - t)
        line.append(f"{rows} rows {tps:.0f} tok/s (transformers generate, no LoRA: {hf:.0f})")
    return ("2-layer " if DRY["on"] else "") + "SmolLM2-shaped bf16, 2 LoRA adapters: " + "; ".join(line)


CHECKS = [("engine_logprobs_vs_trainer", check_engine_logprobs),
          ("decode_bf16", check_decode_bf16),
          ("rl_steps_bf16", check_rl_steps_bf16),
          ("fsdp_one_rank", check_fsdp_one_rank),
          ("per_role_lora_logprobs", check_per_role_lora_logprobs),
          ("peak_memory_vs_plan", check_peak_memory_vs_plan),
          ("mixed_lora", check_mixed_lora),
          ("lora_team_rl_step_bf16", check_lora_team_rl_step_bf16),
          ("engine_speed_smollm2_shape", check_engine_speed_smollm2_shape)]


def main(argv: list[str]) -> int:
    DRY["on"] = "--dry-run" in argv
    names = [a for a in argv if a != "--dry-run"]
    device = "cpu" if DRY["on"] else (os.environ.get("MASRL_GPU_CHECK_DEVICE") or
                                      ("cuda" if torch.cuda.is_available() else ""))
    unknown = sorted(set(names) - {name for name, _ in CHECKS})
    if unknown:
        print(f"gpu_check: no check named {', '.join(unknown)} (checks: {', '.join(n for n, _ in CHECKS)})",
              file=sys.stderr)
        return 2
    failed, start = 0, time.perf_counter()
    for name, check in CHECKS:
        if names and name not in names:
            continue
        if not device:
            print(f"SKIP {name}: no CUDA device (torch.cuda.is_available() is False; --dry-run runs it on CPU)")
            continue
        t = time.perf_counter()
        try:
            line = check(device)
            print(f"PASS {name} ({time.perf_counter() - t:.1f} s): {line}", flush=True)
        except Exception as e:  # one line per check; the traceback goes to stderr
            failed += 1
            traceback.print_exc(file=sys.stderr)
            print(f"FAIL {name} ({time.perf_counter() - t:.1f} s): {type(e).__name__}: {e}", flush=True)
    if device:
        print(f"total {time.perf_counter() - start:.1f} s on {device}{' (dry run)' if DRY['on'] else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
