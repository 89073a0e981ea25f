"""One AdamW step, reference (foreach) vs fused kernel, on the parameter shapes masrl trains.

Shapes come from the models' configs (built on the meta device, then real float32 tensors with random
gradients): the tiny quickstart policy (all parameters), SmolLM2-135M (full fine-tuning) and SmolLM2's
LoRA adapters (r=16 on q/k/v/o/gate/up/down, two agents, as ``examples/smollm2_arith_lora.yaml``).
Process CPU seconds of one ``optimizer.step()``, min over ``--reps`` after a warm-up step. Also reports
what ``policies.<p>.optim.fused: auto`` picks for each and the largest difference between the two
kernels' updated parameters after one step. Also the step's gradient-norm + clip: the norm measured twice
(once for the metric, once inside ``clip_grad_norm_``) vs once (``update._step_norm`` +
``clip_grads_with_norm_``), and whether the clipped gradients are bit-identical.

    python benchmarks/adamw_kernel.py [--threads 1] [--reps 5]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchutil import RESULTS, command_line, fmt_table, print_header, set_threads, write_json  # noqa: E402


def shapes(name: str) -> list[tuple[int, ...]]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if name == "tiny":
        from masrl.models.tiny import build_char_tokenizer, build_tiny_model

        with torch.device("meta"):  # the quickstart's policy
            model = build_tiny_model(build_char_tokenizer(), {"hidden_size": 128, "num_hidden_layers": 4,
                                                              "num_attention_heads": 4, "intermediate_size": 384})
        return [tuple(p.shape) for p in model.parameters()]
    from masrl.models.smollm import smollm2_path

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(smollm2_path()))
    full = [tuple(p.shape) for p in model.parameters()]
    if name == "smollm2":
        return full
    lora = []  # per agent, per layer: A (r x in) and B (out x r) for each target module
    for mod_name, mod in model.named_modules():
        if mod_name.split(".")[-1] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            lora += [(16, mod.in_features), (mod.out_features, 16)] * 2
    return lora


def step_seconds(shape_list, fused: bool, reps: int):
    import torch

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in shape_list]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, **({"fused": True} if fused else {}))
    opt.step()
    first = [p.detach().clone() for p in params]
    times = []
    for _ in range(reps):
        t = time.process_time()
        opt.step()
        times.append(time.process_time() - t)
    return min(times), first


def clip_seconds(shape_list, reps: int):
    """Process CPU seconds (min over reps) of the norm + clip, two passes vs one; clipped gradients bit-equal?"""
    import torch
    from masrl.training.update import _step_norm

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in shape_list]
    grads = [torch.randn_like(p) for p in params]

    def two():
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params])))
        torch.nn.utils.clip_grad_norm_(params, 1e-3)
        return norm

    def one():
        norm = _step_norm(params)
        torch.nn.utils.clip_grads_with_norm_(params, 1e-3, norm)
        return float(norm)

    times, clipped = {two: [], one: []}, {}
    for _ in range(reps + 1):
        for f in (two, one):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            t = time.process_time()
            f()
            times[f].append(time.process_time() - t)
            clipped[f] = [p.grad for p in params]
    equal = all(torch.equal(x, y) for x, y in zip(clipped[two], clipped[one]))
    return min(times[two][1:]), min(times[one][1:]), equal


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    set_threads(a.threads)
    info = print_header(a.threads)
    import torch
    from masrl.training.policy import use_fused_adamw

    rows, out = [], {"command": command_line(), "machine": info, "cases": {}}
    for name in ("tiny", "smollm2", "smollm2_lora"):
        sh = shapes(name)
        n = sum(torch.Size(s).numel() for s in sh)
        ref, p_ref = step_seconds(sh, False, a.reps)
        fused, p_fused = step_seconds(sh, True, a.reps)
        diff = max(float((x - y).abs().max()) for x, y in zip(p_ref, p_fused))
        auto = use_fused_adamw("auto", p_ref)
        clip2, clip1, clip_equal = clip_seconds(sh, a.reps)
        out["cases"][name] = {"params": n, "tensors": len(sh), "foreach_s": ref, "fused_s": fused,
                              "max_abs_diff_after_one_step": diff, "auto_picks_fused": auto,
                              "norm_clip_two_passes_s": clip2, "norm_clip_one_pass_s": clip1,
                              "clipped_grads_bit_equal": clip_equal}
        rows.append([name, f"{n / 1e6:.2f}M", len(sh), f"{ref * 1e3:.1f}", f"{fused * 1e3:.1f}",
                     f"{ref / fused:.1f}x", f"{diff:.1e}", "fused" if auto else "foreach",
                     f"{clip2 * 1e3:.1f} → {clip1 * 1e3:.1f}", "yes" if clip_equal else "NO"])
    print(fmt_table(["parameters", "count", "tensors", "foreach ms", "fused ms", "speed-up",
                     "max |diff| after 1 step", "auto picks", "norm+clip ms, 2 passes → 1", "clip bit-equal"], rows))
    write_json(RESULTS / "adamw_kernel.json", out)


if __name__ == "__main__":
    main()
