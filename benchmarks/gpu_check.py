"""The checks of benchmarks/gpu_check.sh: one line each, exit 1 if any fails (docs/scaling.md)."""
from __future__ import annotations

import os
import sys
import tempfile
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
ENGINE_ROWS = (8, 32, 128)  # batch sizes of engine_speed_smollm2_shape
TINY = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 768, "max_position_embeddings": 512}


def _cfg(device: str, **over):
    from masrl.config import load_config

    overrides = [f"trainer.device={device}", "logging.tensorboard=false", "logging.plots=false",
                 "logging.progress=false", f"policies.shared.tiny={TINY}".replace("'", '"').replace(" ", "")]
    return load_config(ROOT / "examples" / "quickstart.yaml", overrides + [f"{k}={v}" for k, v in over.items()])


def _policy(cfg):
    from masrl.runtime.local import policy_build_args
    from masrl.training.policy import build_policy

    args = policy_build_args(cfg, Path(tempfile.mkdtemp()))["shared"]
    return build_policy("shared", cfg.policies["shared"], **args)


def _rows(policy, n=8, seed=0):
    from masrl.rollout.engine import GenRequest
    from masrl.training.update import Row

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(40, 90, (int(torch.randint(8, 24, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    results = policy.engine.generate([GenRequest(p, max_new_tokens=16) for p in prompts])
    return [Row("Solver", p, r.response_ids, r.logprobs, 1.0 if i % 2 else -1.0, policy="shared")
            for i, (p, r) in enumerate(zip(prompts, results))]


def check_engine_logprobs(device: str) -> str:
    from masrl.training.update import pack_rows, response_logits, token_logprobs

    policy = _policy(_cfg(device))
    rows = [r for r in _rows(policy) if r.response_ids]
    batch = pack_rows(rows, int(policy.tokenizer.pad_token_id), device)
    with torch.no_grad():
        trainer = token_logprobs(response_logits(policy.model, batch), batch.targets)
    diff = ((trainer - batch.old_logprobs).abs() * batch.response_mask).max().item()
    assert diff < 1e-3, f"max |engine - trainer| = {diff:.2e} (limit 1e-3, float32)"
    return f"max |engine - trainer| log-prob = {diff:.2e} over {int(batch.response_mask.sum())} tokens"


def check_rl_step_bf16(device: str) -> str:
    from masrl.trainer import Trainer

    cfg = _cfg(device, **{"trainer.autocast": "bfloat16", "trainer.total_steps": 1, "sft.steps": 2,
                          "eval.before_after": "false", "output_dir": tempfile.mkdtemp()})
    with Trainer(cfg, progress=False) as trainer:
        trainer.fit()
    import json

    last = [json.loads(x) for x in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()][-1]
    norm = last.get("policy/shared/grad_norm", float("nan"))
    assert norm == norm and norm > 0, f"grad_norm {norm}"
    return f"quickstart team, 1 RL step, bf16 autocast: grad_norm {norm:.3g}"


def check_fsdp_one_rank(device: str) -> str:
    from masrl.training.fsdp import FSDPOptions, ShardedDataParallel, shard_policy
    from masrl.training.update import update_policy

    cfg = _cfg(device)
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


def check_peak_memory_vs_plan(device: str) -> str:
    from masrl.plan import counted, plan_policy
    from masrl.training.update import update_policy

    cfg = _cfg(device)
    policy = _policy(cfg)
    rows = _rows(policy, n=32)
    prompt = max(len(r.prompt_ids) for r in rows)
    torch.cuda.reset_peak_memory_stats()
    update_policy(policy, rows, cfg.algorithm, cfg.trainer, step=0, seed=0)
    peak = torch.cuda.max_memory_allocated()
    terms = counted(plan_policy(cfg, "shared", prompt_tokens=prompt, cuda=True))
    planned = sum(v for k, v in terms.items() if k != "kv_cache")
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
    from masrl.config import load_config
    from masrl.trainer import Trainer

    out = tempfile.mkdtemp()
    cfg = load_config(ROOT / "examples" / "voting_isolated.yaml",
                      [f"trainer.device={device}", "trainer.autocast=bfloat16", "trainer.total_steps=2",
                       "sft.steps=4", "eval.before_after=false", "logging.tensorboard=false", "logging.plots=false",
                       "logging.progress=false", f"output_dir={out}"])
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

    from masrl.models.lora import attach_adapters
    from masrl.rollout.engine import GenRequest, TransformersEngine

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                      tie_word_embeddings=True, rope_theta=100000.0, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    base = LlamaForCausalLM(cfg).to(device=device, dtype=torch.bfloat16).eval()
    prompt, new = 96, 64
    parts = []
    for rows in ENGINE_ROWS:
        ids = torch.randint(3, cfg.vocab_size, (rows, prompt), device=device)
        with torch.no_grad():
            base.generate(ids[:2], attention_mask=torch.ones_like(ids[:2]), max_new_tokens=4, do_sample=True,
                          pad_token_id=2)  # warm-up
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                do_sample=True, pad_token_id=2)
            torch.cuda.synchronize()
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
        torch.cuda.synchronize()
        t = time.perf_counter()
        res = engine.generate(reqs)
        torch.cuda.synchronize()
        tps = sum(len(r.response_ids) for r in res) / (time.perf_counter() - t)
        line.append(f"{rows} rows {tps:.0f} tok/s (transformers generate, no LoRA: {hf:.0f})")
    return "SmolLM2-shaped bf16, 2 LoRA adapters: " + "; ".join(line)


CHECKS = [("engine_logprobs_vs_trainer", check_engine_logprobs, False),
          ("rl_step_bf16", check_rl_step_bf16, False),
          ("fsdp_one_rank", check_fsdp_one_rank, False),
          ("peak_memory_vs_plan", check_peak_memory_vs_plan, True),
          ("mixed_lora", check_mixed_lora, False),
          ("lora_team_rl_step_bf16", check_lora_team_rl_step_bf16, False),
          ("engine_speed_smollm2_shape", check_engine_speed_smollm2_shape, True)]


def main(names: list[str]) -> int:
    device = os.environ.get("MASRL_GPU_CHECK_DEVICE") or ("cuda" if torch.cuda.is_available() else "")
    unknown = sorted(set(names) - {name for name, _, _ in CHECKS})
    if unknown:
        print(f"gpu_check: no check named {', '.join(unknown)} (checks: {', '.join(n for n, _, _ in CHECKS)})",
              file=sys.stderr)
        return 2
    failed = 0
    for name, check, needs_cuda in CHECKS:
        if names and name not in names:
            continue
        if not device or (needs_cuda and device != "cuda"):
            print(f"SKIP {name}: no CUDA device (torch.cuda.is_available() is False)")
            continue
        try:
            print(f"PASS {name}: {check(device)}", flush=True)
        except Exception as e:  # one line per check; the traceback goes to stderr
            failed += 1
            traceback.print_exc(file=sys.stderr)
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
