"""torch.compile (inductor, CPU) as a speed lever for the tiny model: does it pay over a 40-step run?

Not wired into masrl (measured negative result, see docs/performance.md#levers); this script patches
the two hot spots in-process so that the lever can be re-measured:

* update: ``masrl.training.update.response_logits`` calls ``torch.compile(model, dynamic=True)``
  instead of the model (one compiled module per model, forward + backward through AOTAutograd);
* decode: ``TransformersEngine._decode`` uses transformers' ``StaticCache`` (one fixed-size cache per
  batch, written at a tensor position, so a decode step has the same shapes at every step of a batch)
  and the full-length attention mask (prompt padding + every decode position; causality hides the
  unwritten tail), and the decode steps call the same compiled module. ``dynamic=True`` makes the
  batch size and the cache length symbolic, so new batch shapes do not recompile.

Sections:

* ``quickstart`` (default): ``examples/quickstart.yaml`` RL steps (SFT skipped, as
  ``quickstart_throughput.py``), ``--mode eager|compile``, every step's wall time, compile time
  (first step minus the steady median), and dynamo's counters (unique graphs, recompiles, graph breaks);
* ``exact``: compiled vs eager token log-probs and gradients of the update forward on vs_trl-shaped
  micro-batches, and the decode's sampled tokens (fixed seed) eager vs static cache vs compiled.

    python benchmarks/compile_lever.py --mode eager --steps 40
    python benchmarks/compile_lever.py --mode compile --steps 40 --cache-dir /tmp/ind_cold   # cold inductor cache
    python benchmarks/compile_lever.py --mode compile --steps 40 --cache-dir /tmp/ind_cold   # again: warm cache
    python benchmarks/compile_lever.py --section exact

Run one process at a time with ``--threads 1`` on a shared machine; every run prints its load average.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

TINY_ARCH = {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 384}


# ----------------------------------------------------------------------------- the patches

_COMPILED: dict[int, object] = {}  # id(model) -> compiled module (not a model attribute: that would be a submodule)


def compiled_module(model):
    import torch

    if id(model) not in _COMPILED:
        _COMPILED[id(model)] = torch.compile(model, dynamic=True)
    return _COMPILED[id(model)]


def install_compile_patches() -> None:
    import masrl.training.update as upd
    from masrl.rollout import engine as eng

    eager_response_logits = upd.response_logits

    def response_logits(model, batch):
        return eager_response_logits(compiled_module(model), batch)

    upd.response_logits = response_logits
    eng.TransformersEngine._decode = static_decode


def static_decode(self, model, requests, compiled=True):
    """``TransformersEngine._decode`` with a ``StaticCache`` and the full-length mask (fixed shapes per batch);
    the sampling and stopping are the engine's own decode loop (:func:`masrl.rollout.engine.run_decode`)."""
    import torch
    from transformers.cache_utils import StaticCache

    from masrl.rollout.engine import DecodeState, run_decode
    from masrl.rollout.kv_cache import with_cache

    device = next(model.parameters()).device
    batch = len(requests)
    lengths = [len(r.prompt_ids) for r in requests]
    width = max(lengths)
    input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
    attention = torch.zeros((batch, width), dtype=torch.long)
    for i, r in enumerate(requests):
        input_ids[i, width - lengths[i]:] = torch.tensor(r.prompt_ids, dtype=torch.long)
        attention[i, width - lengths[i]:] = 1
    state = DecodeState(requests, eos=self.eos, pad_token_id=self.pad_token_id, device=device,
                        generator=self.generator)
    full_mask = torch.cat([attention, torch.ones((batch, state.max_new), dtype=attention.dtype)], 1).to(device)
    positions = (full_mask[:, :width].cumsum(-1) - 1).clamp(min=0)
    cache = StaticCache(config=model.config, max_cache_len=width + state.max_new)
    out = model(input_ids=input_ids.to(device), attention_mask=full_mask, position_ids=positions, use_cache=True,
                **with_cache(cache), logits_to_keep=1, cache_position=torch.arange(width, device=device))
    step_fn = compiled_module(model) if compiled else model
    next_pos = [positions[:, -1] + 1]

    def forward(step, logits):
        out = step_fn(input_ids=state.feed().to(device)[:, None], attention_mask=full_mask,
                      position_ids=next_pos[0][:, None], **with_cache(cache), use_cache=True,
                      cache_position=torch.tensor([width + step], device=device))
        next_pos[0] = next_pos[0] + 1
        return out.logits[:, -1, :]

    run_decode(state, out.logits[:, -1, :], forward)
    results = state.results()
    self.tokens_generated += sum(len(r.response_ids) for r in results)
    return results


def dynamo_counters() -> dict:
    from torch._dynamo.utils import counters

    # torch 2.13 keeps no "recompiles" counter: every frame compiled after the first is a recompile of the
    # one compiled function (the model's forward wrapper); TORCH_LOGS=recompiles prints why
    frames = counters["frames"].get("total", 0)
    return {"unique_graphs": counters["stats"].get("unique_graphs", 0), "frames_compiled": frames,
            "recompiles": max(frames - 1, 0),
            "graph_breaks": sum(counters["graph_break"].values()) if "graph_break" in counters else 0}


# ----------------------------------------------------------------------------- sections

def section_quickstart(a) -> dict:
    from _benchutil import set_threads
    from quickstart_throughput import BASE_OVERRIDES

    set_threads(a.threads)
    if a.mode == "compile":
        install_compile_patches()
    from masrl.config import load_config
    from masrl.trainer import Trainer

    cfg = load_config(a.config, BASE_OVERRIDES + [f"trainer.threads={a.threads}", f"trainer.total_steps={a.steps}"])
    trainer = Trainer(cfg, progress=False)
    steps = []
    for i in range(a.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        m = trainer.train_step()
        trainer.step += 1
        steps.append({"step_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
                      "rollout_s": m["perf/rollout_seconds"], "update_s": m["perf/update_seconds"],
                      "counters": dynamo_counters()})
        print(f"step {i}: {steps[-1]['step_s']:.2f} s (rollout {m['perf/rollout_seconds']:.2f}, "
              f"update {m['perf/update_seconds']:.2f}) {steps[-1]['counters']}", flush=True)
    steady = steps[min(5, len(steps) - 1):]
    med = lambda k: statistics.median(s[k] for s in steady)  # noqa: E731
    return {"mode": a.mode, "cache_dir": a.cache_dir, "steps": steps, "total_s": sum(s["step_s"] for s in steps),
            "first_step_s": steps[0]["step_s"], "steady_step_s": med("step_s"), "steady_cpu_s": med("cpu_s"),
            "steady_rollout_s": med("rollout_s"), "steady_update_s": med("update_s"),
            "compile_s_estimate": steps[0]["step_s"] - med("step_s"), "counters": dynamo_counters()}


def vs_trl_rows(seed: int):
    from masrl.training.update import Row

    r = random.Random(seed)
    rows = []
    for _ in range(64):  # B=8 x G=8, char-level prompts of 14-24 tokens, responses of 3-40 tokens
        k = r.randint(3, 40)
        rows.append(Row("a", [r.randrange(20, 100) for _ in range(r.randint(14, 24))],
                        [r.randrange(20, 100) for _ in range(k)], [0.0] * k, r.gauss(0.0, 1.0)))
    return rows


def section_exact(a) -> dict:
    import torch

    from _benchutil import set_threads
    from masrl.models.tiny import build_char_tokenizer, build_tiny_model
    from masrl.rollout.engine import GenRequest, TransformersEngine
    from masrl.training.update import micro_batches, pack_rows, response_logits, token_logprobs

    set_threads(a.threads)
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, TINY_ARCH, seed=0)
    cm = compiled_module(model)
    d_logp = d_grad = 0.0
    for seed in range(3):
        for chunk in micro_batches(vs_trl_rows(seed), 4096):
            b = pack_rows(chunk, 0)
            outs = []
            for f in (model, cm):
                model.zero_grad()
                lp = token_logprobs(response_logits(f, b), b.targets)
                (lp * b.response_mask).sum().backward()
                outs.append((lp.detach(), [p.grad.clone() for p in model.parameters()]))
            m = b.response_mask.bool()
            d_logp = max(d_logp, float((outs[0][0] - outs[1][0])[m].abs().max()))
            d_grad = max(d_grad, max(float((x - y).abs().max() / x.abs().max().clamp(min=1e-12))
                                     for x, y in zip(outs[0][1], outs[1][1])))
    out = {"update_max_abs_dlogp": d_logp, "update_max_rel_dgrad": d_grad}
    model.eval()
    decoded = {}
    for mode in ("eager", "static", "compiled"):
        engine = TransformersEngine(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, seed=0)
        res = []
        for k in range(4):
            r = random.Random(k)
            reqs = [GenRequest([r.randrange(20, 100) for _ in range(r.randint(14, 24))], max_new_tokens=40)
                    for _ in range(r.choice([48, 64, 128]))]
            engine.reseed(k)
            if mode == "eager":
                res += engine.generate(reqs)
            else:
                with torch.inference_mode():
                    res += static_decode(engine, model, reqs, compiled=(mode == "compiled"))
        decoded[mode] = res
    for mode in ("static", "compiled"):
        same = sum(x.response_ids == y.response_ids for x, y in zip(decoded["eager"], decoded[mode]))
        dlp = max((abs(p - q) for x, y in zip(decoded["eager"], decoded[mode]) if x.response_ids == y.response_ids
                   for p, q in zip(x.logprobs, y.logprobs)), default=0.0)
        out[f"decode_{mode}_identical_rows"] = f"{same}/{len(decoded['eager'])}"
        out[f"decode_{mode}_max_abs_dlogp"] = dlp
    out["counters"] = dynamo_counters()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--section", choices=["quickstart", "exact"], default="quickstart")
    ap.add_argument("--mode", choices=["eager", "compile"], default="compile")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "examples" / "quickstart.yaml"))
    ap.add_argument("--cache-dir", help="TORCHINDUCTOR_CACHE_DIR (a fresh folder = a cold compile)")
    ap.add_argument("--out", help="JSON file (default benchmarks/results/compile_lever_<section>_<mode>.json)")
    a = ap.parse_args(argv)
    if a.cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = a.cache_dir  # before inductor reads it
    from _benchutil import RESULTS, command_line, machine_info, machine_line, write_json

    info = machine_info(a.threads)
    print(command_line())
    print(machine_line(info), flush=True)
    res = section_quickstart(a) if a.section == "quickstart" else section_exact(a)
    res.update({"command": command_line(), "machine": info, "load_avg_end": os.getloadavg()})
    name = f"compile_lever_{a.section}" + (f"_{a.mode}" if a.section == "quickstart" else "")
    path = Path(a.out) if a.out else RESULTS / f"{name}.json"
    write_json(path, res)
    print(json.dumps({k: v for k, v in res.items() if k not in ("steps", "machine")}, indent=1))


if __name__ == "__main__":
    main()
