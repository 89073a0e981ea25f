"""One Isolated-Policy training step: a mixed batch through per-row LoRA routing vs per-adapter passes.

A step is forward + backward + one AdamW step over ``adapters x rows`` rows of ``tokens``
tokens (the last ``response`` of them scored, as the trainer does with ``logits_to_keep``).

* ``sequential``   : one forward/backward per adapter sub-batch (PEFT ``set_adapter``), then one step
* ``mixed/grouped``: one forward/backward over the whole batch inside ``mixed_adapters``, rows
                     ordered by adapter (contiguous slices, no gathers)
* ``mixed/interl.``: the same with the adapters' rows interleaved (index_select/index_add)
* ``one adapter``  : the whole batch through one adapter (same FLOPs as mixed, no routing): the
                     difference to ``mixed`` is the cost of the routing itself
* ``peft-mixed``   : PEFT's own ``_mixed_batch_forward`` forced under training by injecting
                     ``adapter_names`` with pre-hooks on the LoRA layers (what PEFT refuses in
                     train mode; measured only for comparison)

    python benchmarks/lora_mixed_step.py                      # tiny (hidden 128, 4 layers)
    python benchmarks/lora_mixed_step.py --size large         # hidden 512, 8 layers
    python benchmarks/lora_mixed_step.py --decode             # also batched KV-cache decoding:
                                                              # per adapter / mixed_adapters / PEFT adapter_names=

Median CPU and wall time over ``--reps`` repetitions (after one warm-up), one intra-op thread.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import warnings

import torch

from masrl.models.lora import adapter_names, attach_adapters, mixed_adapters, set_all_trainable
from masrl.models.tiny import build_char_tokenizer, build_tiny_model
from masrl.rollout.kv_cache import output_cache, with_cache

SIZES = {
    "tiny": {},
    "large": {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8,
              "intermediate_size": 1536},
}


def build(size: str, n_adapters: int, r: int, targets: list[str]):
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, SIZES[size], seed=0)
    names = [f"role{i}" for i in range(n_adapters)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = attach_adapters(model, names, r=r, alpha=2 * r, dropout=0.0, target_modules=targets,
                                init_lora_weights=False)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return model, opt, names, len(tok)


def loss_fn(model, ids, response):
    out = model(input_ids=ids, logits_to_keep=response + 1, use_cache=False)
    logits = out.logits[:, :-1].float()
    targets = ids[:, -response:]
    logp = logits.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(logits, -1)
    return -logp.sum() / targets.numel()


def step_sequential(model, opt, names, ids, owner, response):
    opt.zero_grad(set_to_none=True)
    for name in names:
        rows = [i for i, o in enumerate(owner) if o == name]
        model.base_model.set_adapter(name)
        loss = loss_fn(model, ids[rows], response) * (len(rows) / len(owner))
        loss.backward()
    set_all_trainable(model)  # set_adapter froze the other adapters; the optimizer holds them all
    opt.step()


def step_mixed(model, opt, names, ids, owner, response):
    opt.zero_grad(set_to_none=True)
    with mixed_adapters(model, owner):
        loss = loss_fn(model, ids, response)
    loss.backward()
    opt.step()


def step_peft_mixed(model, opt, names, ids, owner, response):
    from peft.tuners.lora.layer import LoraLayer

    opt.zero_grad(set_to_none=True)
    hooks = [m.register_forward_pre_hook(lambda mod, args, kw: (args, {**kw, "adapter_names": owner}),
                                         with_kwargs=True)
             for m in model.modules() if isinstance(m, LoraLayer)]
    try:
        loss = loss_fn(model, ids, response)
    finally:
        for h in hooks:
            h.remove()
    loss.backward()
    opt.step()


@torch.inference_mode()
def decode(model, ids, owner, steps, how: str):
    """Prefill + ``steps`` greedy decode steps.

    ``sequential``: one batch per adapter; ``mixed``: one batch inside ``mixed_adapters``;
    ``peft``: one batch with PEFT's inference-only ``adapter_names=`` argument on every call.
    """
    if how == "sequential":
        groups = [([n] * owner.count(n), [i for i, o in enumerate(owner) if o == n]) for n in dict.fromkeys(owner)]
    else:
        groups = [(owner, list(range(len(owner))))]
    for row_names, rows in groups:
        ctx = mixed_adapters(model, row_names) if how != "peft" else contextlib.nullcontext()
        extra = {"adapter_names": row_names} if how == "peft" else {}
        with ctx:
            out = model(input_ids=ids[rows], use_cache=True, **extra)
            for _ in range(steps):
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
                out = model(input_ids=tok, use_cache=True, **with_cache(output_cache(out)), **extra)


def timed(fns: dict, reps: int) -> dict[str, tuple[float, float]]:
    """(median CPU seconds, median wall seconds) per call of each function.

    Repetitions run round-robin so that load drift on a shared machine hits every variant
    alike; with one intra-op thread the process CPU time is the steadier figure there.
    """
    for fn in fns.values():  # warm-up
        fn()
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    wall: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for key, fn in fns.items():
            c0, w0 = time.process_time(), time.perf_counter()
            fn()
            cpu[key].append(time.process_time() - c0)
            wall[key].append(time.perf_counter() - w0)
    return {k: (statistics.median(cpu[k]), statistics.median(wall[k])) for k in fns}


def report(prefix: str, results: dict[str, tuple[float, float]], baseline: str) -> None:
    ref_cpu, ref_wall = results[baseline]
    for label, (c, w) in results.items():
        print(f"{prefix} {label:14s} cpu {c * 1e3:8.1f} ms  wall {w * 1e3:8.1f} ms   "
              f"x{ref_cpu / c:5.2f} (cpu) x{ref_wall / w:5.2f} (wall) vs {baseline}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--adapters", type=int, default=3)
    ap.add_argument("--rows", type=int, default=32, help="rows per adapter")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--response", type=int, default=32)
    ap.add_argument("--r", type=int, default=8)
    ap.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--decode", action="store_true", help="also time KV-cache decoding (prefill + steps)")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--skip-peft", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model, opt, names, vocab = build(args.size, args.adapters, args.r, args.targets.split(","))
    n = args.adapters * args.rows
    ids = torch.randint(5, vocab, (n, args.tokens), generator=torch.Generator().manual_seed(0))
    grouped = [names[i // args.rows] for i in range(n)]
    interleaved = [names[i % args.adapters] for i in range(n)]
    params = sum(p.numel() for p in model.parameters())
    lora = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"size={args.size} params={params / 1e6:.2f}M lora={lora / 1e6:.3f}M ({len(adapter_names(model))} "
          f"adapters, r={args.r}, {args.targets}) batch={args.adapters}x{args.rows} rows x {args.tokens} tokens "
          f"(response {args.response}) threads={torch.get_num_threads()} reps={args.reps}")

    cases = [("sequential", step_sequential, grouped), ("mixed/grouped", step_mixed, grouped),
             ("mixed/interl.", step_mixed, interleaved), ("one adapter", step_mixed, [names[0]] * n)]
    if not args.skip_peft:
        cases.append(("peft-mixed", step_peft_mixed, interleaved))
    results = timed({label: (lambda fn=fn, owner=owner: fn(model, opt, names, ids, owner, args.response))
                     for label, fn, owner in cases}, args.reps)
    report("train step", results, "sequential")

    if args.decode:
        model.eval()
        dec = {how: (lambda how=how: decode(model, ids, grouped if how == "sequential" else interleaved,
                                            args.decode_steps, how))
               for how in ("sequential", "mixed", "peft")}
        times = timed(dec, args.reps)
        report("decode    ", times, "sequential")


if __name__ == "__main__":
    main()
