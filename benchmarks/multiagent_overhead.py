"""What a second agent costs: throughput of the two-agent quickstart team vs one agent, and memory
per added agent for three agent -> policy mappings.

1. Throughput (tiny model, CPU, SFT skipped). The team is ``examples/quickstart.yaml``
   (``math_solver_verifier``: Solver -> Verifier -> Solver, both agents on one shared policy).
   The single-agent run is the same config with the ``single`` workflow (one Solver turn, the
   quickstart's Solver prompt and token budget). To compare at roughly equal generated tokens per
   step, the single-agent batch is ``B_single = round(B_team * team tokens per episode / single
   tokens per episode)`` (measured: the first team run gives the team's tokens per episode, a short
   calibration step of the single-agent run gives its own), unless ``--single-batch`` is given.
   Runs alternate team, single, team, single (each its own process).

2. Memory per added agent, measured on the built ``Trainer`` (no step needed) for the
   quickstart team with
   * ``shared``  : both agents on one full policy (the quickstart);
   * ``separate``: one full model copy per agent (two policies);
   * ``lora``    : one LoRA adapter per agent on one frozen shared base (``lora.per_agent: true``,
     r=8 on q/k/v/o, masrl.models.lora), if this masrl has it.
   Parameter bytes count every distinct parameter storage once; training state adds a gradient
   and two AdamW moments (float32) for every *trainable* parameter: ``bytes = params + 3 x
   trainable`` (AdamW state is allocated at the first step, so it is computed, not observed).
   ``--memory-model smollm2`` also builds the three mappings on SmolLM2-135M-Instruct.

    python benchmarks/multiagent_overhead.py
    python benchmarks/multiagent_overhead.py --steps 3 --repeats 2 --memory-model both
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchutil import (print_header, REPO, RESULTS, command_line, current_rss_mib, fmt, fmt_table,  # noqa: E402
                        peak_rss_mib, run_worker, set_threads, spread, write_json)
from quickstart_throughput import BASE_OVERRIDES, measure_steps, summarize  # noqa: E402

QUICKSTART = REPO / "examples" / "quickstart.yaml"


def load_team_config(threads: int, extra: list[str]):
    from masrl.config import load_config

    return load_config(QUICKSTART, BASE_OVERRIDES + [f"trainer.threads={threads}"] + extra)


def single_config(threads: int, batch: int, extra: list[str]):
    """The quickstart with the ``single`` workflow: one Solver turn, same model, prompt and budget."""
    from masrl.config import config_from_dict

    team = load_team_config(threads, extra)
    data = team.model_dump(mode="json")
    data["workflow"] = {"name": "single", "params": {}, "prompts": {"Solver": team.workflow.prompts["Solver"]}}
    data["agents"] = {"Solver": data["agents"]["Solver"]}
    data["trainer"]["batch_size"] = batch
    return config_from_dict(data)


# ----------------------------------------------------------------------------- throughput worker

def worker_throughput(a) -> dict:
    from masrl.trainer import Trainer

    cfg = load_team_config(a.threads, a.override) if a.kind == "team" else single_config(a.threads, a.batch, a.override)
    trainer = Trainer(cfg, progress=False)
    steps = measure_steps(trainer, a.warmup, a.steps)
    return {"kind": a.kind, "steps": steps, "peak_rss_mib": peak_rss_mib(),
            "episodes_per_step": cfg.trainer.batch_size * cfg.trainer.group_size,
            "batch_size": cfg.trainer.batch_size, "group_size": cfg.trainer.group_size}


# ----------------------------------------------------------------------------- memory worker

def mapping_config(model: str, mapping: str, threads: int):
    from masrl.config import config_from_dict

    team = load_team_config(threads, [])
    data = team.model_dump(mode="json")
    base = dict(data["policies"]["shared"])
    if model != "tiny":
        base.update(model=model, tiny={})
    if mapping == "shared":
        data["policies"] = {"shared": base}
    elif mapping == "separate":
        data["policies"] = {"solver": dict(base), "verifier": dict(base)}
        data["agents"]["Solver"]["policy"] = "solver"
        data["agents"]["Verifier"]["policy"] = "verifier"
    elif mapping == "lora":
        data["policies"] = {"shared": {**base, "lora": {"r": 8, "alpha": 16, "per_agent": True,
                                                        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}}}
    else:
        raise ValueError(mapping)
    return config_from_dict(data)


def worker_memory(a) -> dict:
    from masrl.trainer import Trainer

    rss0 = current_rss_mib()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = Trainer(mapping_config(a.model_name, a.mapping, a.threads), progress=False)
    except Exception as e:  # noqa: BLE001 - a mapping this masrl version cannot build is reported, not fatal
        return {"mapping": a.mapping, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    seen, param_bytes, trainable_bytes, params, trainable = set(), 0, 0, 0, 0
    for policy in trainer.policies.values():
        for p in policy.model.parameters():
            key = (p.untyped_storage().data_ptr(), p.data_ptr(), p.numel())
            if key in seen:
                continue
            seen.add(key)
            nbytes = p.numel() * p.element_size()
            params += p.numel()
            param_bytes += nbytes
            if p.requires_grad:
                trainable += p.numel()
                trainable_bytes += nbytes
    import torch

    with torch.no_grad():  # read every parameter once, so lazily mapped weights are resident in the RSS figure
        for policy in trainer.policies.values():
            for p in policy.model.parameters():
                p.sum()
    return {"mapping": a.mapping, "model": a.model_name, "policies": len(trainer.policies), "params": params,
            "trainable_params": trainable, "param_bytes": param_bytes, "trainable_bytes": trainable_bytes,
            # grad + AdamW exp_avg + exp_avg_sq, float32, per trainable parameter
            "train_state_bytes": param_bytes + 3 * trainable * 4,
            "rss_after_build_mib": current_rss_mib(), "rss_before_build_mib": rss0}


def worker_main(a) -> None:
    set_threads(a.threads)
    res = worker_throughput(a) if a.worker == "throughput" else worker_memory(a)
    Path(a.worker_json).write_text(json.dumps(res))


# ----------------------------------------------------------------------------- driver

ROWS = [("step_s", "seconds per RL step"), ("rollout_s", "  rollout seconds"), ("update_s", "  update seconds"),
        ("generated_tokens_per_step", "generated tokens per step"), ("trained_tokens_per_step", "trained tokens per step"),
        ("rollout_tok_s", "rollout tokens/s (whole rollout phase)"), ("engine_tok_s", "rollout tokens/s (engine only)"),
        ("rollout_tok_cpu_s", "rollout tokens per process-CPU second"), ("rollout_cpu_s", "  rollout process-CPU seconds"),
        ("train_tok_s", "training tokens/s"), ("gen_per_s_overall", "generated tokens per second of RL step"),
        ("prefill_tokens_per_step", "prompt tokens prefilled per step (after prefix reuse)"),
        ("engine_calls_per_step", "engine calls per step (sequential)"), ("mean_batch", "mean engine batch (rows)"),
        ("decode_steps_per_step", "continuous-batching engine steps per step"),
        ("turns_per_episode", "turns per episode"), ("peak_rss_mib", "peak RSS MiB")]


def throughput(a) -> dict:
    common = ["--steps", str(a.steps), "--warmup", str(a.warmup), "--threads", str(a.threads)]
    for o in a.override:
        common += ["--override", o]
    runs = {"team": [], "single": []}
    batch = a.single_batch
    team_cfg = load_team_config(a.threads, a.override)
    for rep in range(a.repeats):
        for kind in ("team", "single"):
            if kind == "single" and batch is None:
                team_tpe = statistics.fmean(r["summary"]["generated_tokens_per_step"] / r["episodes_per_step"]
                                            for r in runs["team"])
                probe = run_worker(Path(__file__), ["--worker", "throughput", "--kind", "single", "--batch",
                                                    str(team_cfg.trainer.batch_size), "--steps", "1", "--warmup", "0",
                                                    "--threads", str(a.threads)])
                single_tpe = probe["steps"][0]["generated_tokens"] / probe["episodes_per_step"]
                batch = max(1, round(team_cfg.trainer.batch_size * team_tpe / single_tpe))
                print(f"  calibration: team {team_tpe:.1f} generated tokens/episode, single {single_tpe:.1f} "
                      f"-> single-agent batch_size {batch} (team {team_cfg.trainer.batch_size})", flush=True)
            extra = ["--kind", kind] + (["--batch", str(batch)] if kind == "single" else [])
            run = run_worker(Path(__file__), ["--worker", "throughput", *extra, *common])
            s = {**summarize(run["steps"]), "peak_rss_mib": run["peak_rss_mib"]}
            s["gen_per_s_overall"] = s["generated_tokens_per_step"] / s["step_s"]
            run["summary"] = s
            runs[kind].append(run)
            print(f"  run {rep + 1}/{a.repeats} {kind:6s}: {s['step_s']:.2f} s/step, "
                  f"{s['generated_tokens_per_step']:.0f} gen tok/step, {s['rollout_tok_s']:.0f} rollout tok/s, "
                  f"{s['train_tok_s']:.0f} train tok/s", flush=True)
    table = {}
    for k, _ in ROWS:
        t = [r["summary"][k] for r in runs["team"]]
        s = [r["summary"][k] for r in runs["single"]]
        table[k] = {"team": spread(t), "single": spread(s), "ratio": spread([x / y for x, y in zip(t, s) if y])}
    return {"runs": runs, "table": table, "single_batch": batch, "team_batch": team_cfg.trainer.batch_size,
            "group_size": team_cfg.trainer.group_size}


def memory(a) -> dict:
    models = {"tiny": ["tiny"], "smollm2": ["smollm2-135m-instruct"], "both": ["tiny", "smollm2-135m-instruct"],
              "none": []}[a.memory_model]
    out = {}
    for model in models:
        out[model] = {m: run_worker(Path(__file__), ["--worker", "memory", "--mapping", m, "--model-name", model,
                                                     "--threads", str(a.threads)])
                      for m in ("shared", "separate", "lora")}
    return out


def mib(x: float) -> str:
    return fmt(x / 2**20)


def report_memory(model: str, res: dict) -> str:
    shared = res["shared"]
    rows = []
    for m, label in (("shared", "shared policy (quickstart)"), ("separate", "separate full copy per agent"),
                     ("lora", "one LoRA adapter per agent (r=8, q/k/v/o), frozen shared base")):
        r = res[m]
        if "error" in r:
            rows.append([label, "n/a", "n/a", "n/a", "n/a", f"not available: {r['error']}"])
            continue
        rows.append([label, f"{r['params'] / 1e6:.3f}M / {r['trainable_params'] / 1e6:.3f}M", mib(r["param_bytes"]),
                     mib(r["train_state_bytes"]), fmt(r["rss_after_build_mib"]), ""])
    # per added agent: the difference between this 2-agent mapping and the same model with one agent
    n_full = shared["params"]
    per_agent = [["shared policy", "0", "0"],
                 ["separate full copy", mib(n_full * 4), mib(n_full * 4 * 4)]]
    if "error" not in res["lora"]:
        lora_one = (res["lora"]["trainable_params"]) / 2  # two adapters, one per agent
        per_agent.append(["LoRA adapter (r=8, q/k/v/o)", mib(lora_one * 4), mib(lora_one * 4 * 4)])
    return ("| mapping (2 agents) | params all / trainable | parameter MiB | + grads + AdamW MiB | process RSS after build MiB | |\n"
            "|---|---|---|---|---|---|\n" + "\n".join("| " + " | ".join(r) + " |" for r in rows) +
            "\n\nper added agent (float32):\n\n" +
            fmt_table(["mapping", "parameter MiB", "training-state MiB (params + grad + 2 AdamW moments)"], per_agent))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--single-batch", type=int, default=None, help="single-agent batch_size (default: calibrated)")
    ap.add_argument("--override", action="append", default=[], help="dotted override for both runs (repeatable)")
    ap.add_argument("--memory-model", choices=["tiny", "smollm2", "both", "none"], default="both")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--worker", choices=["throughput", "memory"], help=argparse.SUPPRESS)
    ap.add_argument("--worker-json", help=argparse.SUPPRESS)
    ap.add_argument("--kind", choices=["team", "single"], help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--mapping", help=argparse.SUPPRESS)
    ap.add_argument("--model-name", default="tiny", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return worker_main(a)

    info = print_header(a.threads)
    res = {"command": command_line(), "machine": info}
    if not a.skip_throughput:
        tp = throughput(a)
        res["throughput"] = tp
        t = tp["table"]
        print(f"\n### two-agent team vs single agent (tiny model, SFT skipped; team B={tp['team_batch']}, "
              f"single B={tp['single_batch']}, G={tp['group_size']}), {a.steps} timed steps x {a.repeats} runs each\n")
        print(fmt_table(["quantity (median over runs)", "team (Solver+Verifier)", "single (Solver)",
                         "team/single median (min-max)"],
                        [[label, fmt(t[k]["team"]["median"]), fmt(t[k]["single"]["median"]),
                          f"{fmt(t[k]['ratio']['median'])} ({fmt(t[k]['ratio']['min'])}-{fmt(t[k]['ratio']['max'])})"]
                         for k, label in ROWS]))
    mem = memory(a)
    res["memory"] = mem
    for model, r in mem.items():
        print(f"\n### memory of the quickstart team's agent -> policy mappings: {model}\n")
        print(report_memory(model, r))
    path = RESULTS / "multiagent_overhead.json"
    write_json(path, res)
    print(f"\nwritten {path}")


if __name__ == "__main__":
    main()
