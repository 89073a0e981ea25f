"""Where one SmolLM2-135M update's memory goes: the tensors autograd keeps for backward.

Builds the update's micro-batch as ``benchmarks/logprob_chunks.py`` does (the SmolLM2 LoRA example:
per-agent LoRA r=16 on the frozen base, two agents; ``--full``: every weight trained), runs the
update's forward (``masrl.training.update.policy_logprobs`` + the PPO loss, the same code as
``update_policy``) under ``torch.autograd.graph.saved_tensors_hooks`` and sums the bytes of every
distinct storage saved for backward (parameters excluded), grouped by where they were saved: a
decoder layer's submodule (``self_attn.q_proj``, ``mlp.act_fn``, the attention kernel, ...), the
final norm, or the LM head / log-prob part. No backward, no optimizer: seconds per setting.

    python benchmarks/update_memory.py                           # LoRA, chunked log-probs (1024), sdpa
    python benchmarks/update_memory.py --chunk 0 --attn eager    # full logits, eager attention
    python benchmarks/update_memory.py --full --autocast bfloat16
"""
from __future__ import annotations

import argparse
import contextlib
import random
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchutil import print_header, set_threads  # noqa: E402


def _tagger(model):
    """Forward pre/post hooks that keep the qualified name of the innermost module running."""
    stack = ["(outside modules)"]
    handles = []
    for name, module in model.named_modules():
        if not name:
            continue
        handles.append(module.register_forward_pre_hook(lambda m, a, _n=name: stack.append(_n)))
        handles.append(module.register_forward_hook(lambda m, a, o: stack.pop() and None))
    return stack, handles


def _group(name: str) -> tuple[str, str]:
    """(layer index or '-', the submodule path inside a decoder layer, LoRA and PEFT wrappers dropped)."""
    parts = name.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        rest = [p for p in parts[i + 2:] if p not in ("base_layer", "lora_A", "lora_B", "lora_dropout")
                and not p[:1].isupper()]
        sub = ".".join(p for p in rest if p not in ("Solver", "Verifier", "default", "p")) or "(layer)"
        return parts[i + 1], sub
    return "-", ".".join(p for p in parts if p not in ("base_model", "model")) or name


def saved_bytes(policy, rows, trainer, algo) -> dict:
    import torch

    from masrl.algorithms import policy_loss
    from masrl.training.update import pack_rows, policy_logprobs

    params = {p.untyped_storage().data_ptr() for p in policy.model.parameters()}
    stack, handles = _tagger(policy.model)
    seen: dict[int, tuple[int, str]] = {}
    kinds: dict[int, str] = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            ptr = s.data_ptr()
            if ptr not in params and ptr not in seen:
                seen[ptr] = (s.nbytes(), stack[-1])
                kinds[ptr] = f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"
        return t

    rows = sorted(rows, key=lambda r: r.agent)
    batch = pack_rows(rows, int(policy.tokenizer.pad_token_id))
    routing = contextlib.nullcontext()
    if policy.adapter_of:
        from masrl.models.lora import mixed_adapters

        routing = mixed_adapters(policy.model, [policy.adapter_of[r.agent] for r in rows], backward_inside=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), routing:
        logprobs, _ = policy_logprobs(policy, batch, trainer, entropy_grad=False)
        loss, _ = policy_loss(logprobs, logprobs.detach(), batch.advantages, batch.response_mask, loss="ppo",
                              clip_low=0.2, clip_high=0.28, dual_clip=None, agg="token-mean",
                              norm_length=batch.targets.shape[1])
    for h in handles:
        h.remove()
    by_sub: dict[str, int] = defaultdict(int)
    by_layer: dict[str, int] = defaultdict(int)
    shapes: dict[str, str] = {}
    for ptr, (nbytes, where) in seen.items():
        layer, sub = _group(where)
        by_sub[sub] += nbytes
        by_layer[layer] += nbytes
        shapes.setdefault(sub, kinds[ptr])
    del loss, logprobs
    return {"total": sum(n for n, _ in seen.values()), "by_sub": dict(by_sub), "by_layer": dict(by_layer),
            "shapes": shapes, "tokens": int(batch.attention_mask.numel()), "scored": batch.num_tokens}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunk", type=int, default=1024, help="trainer.logprob_chunk_tokens")
    ap.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa")
    ap.add_argument("--autocast", default=None, help="trainer.autocast (bfloat16)")
    ap.add_argument("--full", action="store_true", help="train every weight (no LoRA)")
    ap.add_argument("--grad-ckpt", action="store_true", help="policies.<p>.gradient_checkpointing")
    ap.add_argument("--rows", type=int, default=20)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--response-len", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    set_threads(a.threads)
    print_header(a.threads)
    from masrl.config import AlgorithmConfig, PolicyConfig, TrainerConfig
    from masrl.models.smollm import smollm2_path
    from masrl.training.policy import build_policy
    from masrl.training.update import Row

    lora = None if a.full else {"r": 16, "alpha": 32, "per_agent": True}
    pcfg = PolicyConfig(model=str(smollm2_path()), lora=lora, gradient_checkpointing=a.grad_ckpt)
    policy = build_policy("p", pcfg, seed=0, max_rollout_batch=64, agents=["Solver", "Verifier"] if lora else None)
    policy.model.config._attn_implementation = a.attn
    policy.model.train()
    rng = random.Random(0)
    rows = [Row(["Solver", "Verifier"][i % 2], [rng.randrange(10, 40000) for _ in range(a.prompt_len)],
                [rng.randrange(10, 40000) for _ in range(a.response_len)], [-1.0] * a.response_len,
                rng.choice([-1.0, 1.0]), 1.0, policy="p") for i in range(a.rows)]
    trainer = TrainerConfig(logprob_chunk_tokens=a.chunk, autocast=a.autocast)
    r = saved_bytes(policy, rows, trainer, AlgorithmConfig())
    mib = 2 ** 20
    n_layers = sum(1 for k in r["by_layer"] if k != "-")
    what = f"{'full' if a.full else 'LoRA'}{', checkpointed' if a.grad_ckpt else ''}"
    print(f"{what}, chunk {a.chunk}, attn {a.attn}, autocast {a.autocast}: "
          f"{a.rows} rows x {a.prompt_len + a.response_len} = {r['tokens']} tokens, {r['scored']} scored")
    print(f"saved for backward: {r['total'] / mib:,.0f} MiB = {r['total'] / r['tokens'] / 1024:,.1f} KiB per token; "
          f"decoder layers {sum(v for k, v in r['by_layer'].items() if k != '-') / mib:,.0f} MiB "
          f"({n_layers} layers), outside layers {r['by_layer'].get('-', 0) / mib:,.0f} MiB")
    print("| where (per decoder layer: summed over layers / layers) | MiB total | KiB per token | first shape |")
    print("|---|---|---|---|")
    for sub, n in sorted(r["by_sub"].items(), key=lambda kv: -kv[1]):
        print(f"| {sub} | {n / mib:,.1f} | {n / r['tokens'] / 1024:,.2f} | {r['shapes'][sub]} |")


if __name__ == "__main__":
    main()
