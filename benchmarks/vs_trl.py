"""masrl vs TRL ``GRPOTrainer``: seconds per single-agent GRPO step on CPU, same workload.

Both sides train the *same* model (same weights, same tokenizer, loaded from the same folder) on
the same prompts with the same step shape and hyper-parameters:

* prompts: the synthetic arithmetic train split (``masrl.tasks.arithmetic.make_arithmetic_tasks``),
  rendered with the Solver template of masrl's ``single`` workflow and sent as one *conversational*
  user message (both sides apply the tokenizer's chat template with ``add_generation_prompt``);
  tiny model: the quickstart's terse template ``"Q {question}\\nS "``; SmolLM2: masrl's default
  Solver template;
* one step = B prompts x G samples; temperature 1.0, top_p 1.0, no top-k, ``--max-new-tokens``;
* loss: PPO-clip with eps 0.2 (both sides), token-mean aggregation (TRL ``loss_type="dapo"``),
  advantages = group-normalised reward (masrl ``estimator: grpo``, TRL ``scale_rewards="group"``),
  no KL (``beta=0``), one optimizer step per batch (TRL ``num_iterations=1``,
  ``steps_per_generation=1``, no gradient accumulation), AdamW lr ``--lr``, weight decay 0,
  grad clip 1.0, constant lr, float32 everywhere (TRL: ``bf16=False``, ``gradient_checkpointing=False``);
* reward: ``masrl.tasks.math_reward.math_score`` on the completion (masrl ``format_penalty: 0``);
* no vLLM, no logging, no saving, no evaluation.

Timing. masrl: ``Trainer.train_step()`` (wall time, plus its ``perf/rollout_seconds`` and
``perf/update_seconds``). TRL: a ``TrainerCallback`` timing ``on_step_begin`` -> ``on_step_end``
(one optimizer step); the rollout part is the time spent in ``_generate_and_score_completions``
(generation + reward + advantages; wrapped, not changed), the update part is the rest. The first
``--warmup`` steps of every run are dropped. Generated tokens are the completion tokens including
the stop token; training tokens are prompt + completion tokens of the step (no padding).

Repeat r runs both frameworks with seed ``--seed + r``. Every run is its own subprocess (peak RSS = ``ru_maxrss`` of that process, loading included);
runs alternate masrl, TRL, masrl, TRL, ... so slow drift of a shared machine hits both.

    python benchmarks/vs_trl.py                         # both models, default sizes
    python benchmarks/vs_trl.py --model tiny --steps 5 --repeats 3
    python benchmarks/vs_trl.py --model smollm2 --B 2 --G 4 --max-new-tokens 64
    python benchmarks/vs_trl.py --model smollm2 --max-new-tokens 32 --steps 1 --repeats 1 \
        --autocast bfloat16 --rollout-autocast                     # masrl bf16 decoding too (TRL: float32)

Defaults: masrl's shipped defaults (``trainer.autocast: auto`` = bfloat16 update and decoding
on a CPU with native bf16, float32 elsewhere; ``trainer.logprob_chunk_tokens: 1024``) against TRL's float32.
``--autocast float32`` compares float32 with float32; ``--autocast bfloat16`` forces bf16,
``--rollout-autocast`` (the engine decodes under it too; already so with the trainer),
``--micro-batch-tokens``, ``--primitive-cache N`` (``trainer.primitive_cache``) and ``--compile``
(``trainer.compile``; ``on`` compiles in the warm-up steps, so the timed steps are the steady state of a long run,
where ``auto`` compiles too) change masrl only; ``--trl-bf16`` sets
TRL's ``bf16=True``. The optimizer kernel is the same on both sides: masrl's ``optim.fused`` (``--fused-adamw
auto|true|false``, default ``auto`` = fused from 10M trained parameters: SmolLM2 yes, tiny no) and TRL's
``adamw_torch_fused`` (transformers' default) or ``adamw_torch`` to match. ``--masrl-malloc default`` turns off
masrl's glibc malloc settings (``trainer.tune_malloc``, on by default), ``--trl-malloc tuned`` gives TRL's process
the same settings (``masrl.runtime.malloc.tune_malloc()`` before anything is loaded). Besides wall time, every step
records its process CPU time (``cpu_s``), which other jobs on a shared machine inflate less.

``--profile`` runs cProfile and torch.profiler over every run's timed steps and prints, per framework, the CPU
seconds per step by op group (matrix products, attention, optimizer, weight packing, sampling, copies/casts,
elementwise), the time outside aten ops, the top ops and the top Python functions
(``vs_trl_<model>_profile.json``; the profilers' overhead inflates the timings: read the shares).

Writes ``benchmarks/results/vs_trl_<model>.json`` and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchutil import (RESULTS, command_line, fmt, fmt_table, machine_info, machine_line,  # noqa: E402
                        peak_rss_mib, run_worker, set_threads, spread, write_json)

TINY_ARCH = {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 384}
TASK_PARAMS = {"train_size": 2000, "test_size": 200, "min_terms": 2, "max_terms": 3, "max_operand": 30}
TERSE_SOLVER = "Q {question}\n{context}S "

DEFAULTS = {  # per model: B, G, max new tokens, lr, steps, warmup, repeats
    "tiny": {"B": 8, "G": 8, "max_new_tokens": 40, "lr": 1e-4, "steps": 5, "warmup": 1, "repeats": 3},
    "smollm2": {"B": 2, "G": 4, "max_new_tokens": 64, "lr": 1e-6, "steps": 2, "warmup": 1, "repeats": 2},
}


# ----------------------------------------------------------------------------- shared setup

def solver_template(model: str) -> str:
    if model == "tiny":
        return TERSE_SOLVER
    from masrl.workflows.single import SINGLE_PROMPTS

    return SINGLE_PROMPTS["Solver"]


def prepare_tiny_folder(folder: Path) -> Path:
    """The quickstart-sized tiny Llama (seed 0) + char tokenizer, saved so both frameworks load it by path."""
    from masrl.models.tiny import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    model = build_tiny_model(tok, TINY_ARCH, seed=0)
    model.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return folder


def model_folder(model: str, tmp: Path) -> Path:
    if model == "tiny":
        return prepare_tiny_folder(tmp / "tiny")
    from masrl.models.smollm import smollm2_path

    return Path(smollm2_path())


# ----------------------------------------------------------------------------- profiling (--profile)

OP_GROUPS = [  # (group, exact aten names, substrings); the first group that matches wins
    ("weight packing", {"_reorder_linear_weight"}, ()),
    ("matrix products", {"mm", "bmm", "addmm", "addmm_", "baddbmm", "baddbmm_", "addbmm", "matmul", "linear",
                         "addmv", "mv", "dot"},
     ("mkldnn", "onednn", "_pack", "_linear")),
    ("attention", set(), ("scaled_dot_product", "flash_attention", "efficient_attention")),
    ("optimizer", set(), ("adam", "_foreach_", "clip_grad")),
    ("softmax, sampling and log-probs", {"multinomial", "cumsum", "searchsorted", "topk", "sort", "argmax", "max",
                                "exponential_", "uniform_", "logsumexp", "softmax", "log_softmax"},
     ("_softmax", "_log_softmax")),
    ("copies, casts and views", {"copy_", "_to_copy", "to", "contiguous", "clone", "cat", "stack", "index",
                                 "index_select", "gather", "scatter", "scatter_", "fill_", "zero_", "zeros",
                                 "ones", "full", "empty", "empty_like", "zeros_like", "resize_", "as_strided",
                                 "view", "reshape", "_reshape_alias", "_unsafe_view", "transpose", "permute",
                                 "expand", "slice", "select", "unsqueeze", "squeeze", "t", "narrow", "split",
                                 "chunk", "detach", "detach_", "alias", "lift_fresh", "item",
                                 "_local_scalar_dense", "index_put_", "masked_fill", "masked_fill_", "where",
                                 "nonzero", "arange", "new_zeros", "new_empty", "flatten", "unbind", "pad",
                                 "constant_pad_nd", "embedding", "embedding_dense_backward"}, ()),
]


def op_group(name: str) -> str:
    short = name.split("::", 1)[-1]
    for group, exact, subs in OP_GROUPS:
        if short in exact or any(k in short for k in subs):
            return group
    return "elementwise and other ops"


class StepProfiler:
    """cProfile + torch.profiler over the timed steps (``--profile``): where each framework's CPU time goes.

    The torch ops' self CPU time by group, plus the remainder of the steps' process CPU time that no aten op
    accounts for (Python, the frameworks' own code, the reward, the tokenizer), the top aten ops and the top
    Python functions by own time. Profiling adds overhead (per op and per Python call), so a profiled run's
    timings are not the comparison's figures; the shares are."""

    def __init__(self, top: int = 15):
        import cProfile
        from torch.profiler import ProfilerActivity, profile

        self.top, self.cpu = top, 0.0
        self.cprof = cProfile.Profile()
        self.tprof = profile(activities=[ProfilerActivity.CPU])
        self.running = False

    def start(self) -> None:
        self.tprof.start()
        self.cprof.enable()
        self.c0, self.running = time.process_time(), True

    def stop(self) -> None:
        if self.running:
            self.cprof.disable()
            self.cpu, self.running = time.process_time() - self.c0, False  # before the profiler's own wrap-up
            self.tprof.stop()

    def summary(self) -> dict:
        import io
        import pstats

        events = self.tprof.key_averages()
        ops = {e.key: [e.self_cpu_time_total / 1e6, e.count] for e in events}
        top_ops = [{"op": e.key, "self_cpu_s": e.self_cpu_time_total / 1e6, "calls": e.count}
                   for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:self.top]]
        out = io.StringIO()
        pstats.Stats(self.cprof, stream=out).sort_stats("tottime").print_stats(self.top)
        lines = out.getvalue().strip().splitlines()
        start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
        return {"cpu_s": self.cpu, "ops": ops, "top_ops": top_ops,
                "cprofile_top": "\n".join(lines[start:start + self.top + 1])}


def op_groups(profile: dict) -> dict:
    """Self seconds of a profile's ops by group, plus ``outside aten ops``: the profiled CPU time that no op
    accounts for (0 where the ops' self times, measured as wall time, exceed it on a loaded machine)."""
    groups: dict[str, float] = {}
    for name, (self_s, _) in profile["ops"].items():
        groups[op_group(name)] = groups.get(op_group(name), 0.0) + self_s
    groups["outside aten ops"] = max(profile["cpu_s"] - sum(groups.values()), 0.0)
    return groups


# ----------------------------------------------------------------------------- workers

def warm_reward() -> None:
    """Import math-verify's LaTeX parser before timing (its first use imports sympy/antlr: ~0.5 s)."""
    from masrl.tasks.math_reward import math_score
    from masrl.types import Task

    math_score(Task("warm", "1/2", "1/2"), "\\boxed{\\frac{2}{4}}")


def worker_masrl(a) -> dict:
    from masrl.config import config_from_dict
    from masrl.trainer import Trainer

    cfg = config_from_dict({
        "name": "bench-vs-trl", "seed": a.seed, "output_dir": str(Path(tempfile.gettempdir()) / "masrl-bench-unused"),
        "task": {"name": "arithmetic", "params": TASK_PARAMS},
        "workflow": {"name": "single", "prompts": {"Solver": solver_template(a.model)}},
        "agents": {"Solver": {"policy": "policy", "temperature": 1.0, "top_p": 1.0,
                              "max_new_tokens": a.max_new_tokens}},
        "policies": {"policy": {"model": a.model_path, "dtype": "float32",
                                "optim": {"lr": a.lr, "weight_decay": 0.0, "grad_clip": 1.0,
                                          "fused": {"auto": "auto", "true": True, "false": False}[a.fused_adamw]}}},
        "algorithm": {"estimator": "grpo", "format_penalty": 0.0,
                      "loss": {"loss": "ppo", "clip_low": 0.2, "clip_high": 0.2, "agg": "token-mean"}},
        "sft": {"steps": 0},
        "trainer": {"total_steps": a.warmup + a.steps, "batch_size": a.B, "group_size": a.G,
                    "threads": a.threads, "autocast": a.autocast, "tune_malloc": a.masrl_malloc == "tuned",
                    "compile": a.compile,
                    **({"micro_batch_tokens": a.micro_batch_tokens} if a.micro_batch_tokens else {}),
                    **({"primitive_cache": a.primitive_cache} if a.primitive_cache else {})},
        "eval": {"before_after": False},
        "logging": {"tensorboard": False, "progress": False, "plots": False},
    })
    t0 = time.perf_counter()
    trainer = Trainer(cfg, progress=False)
    if a.rollout_autocast:  # the engine decodes under the same autocast as the update
        for policy in trainer.policies.values():
            policy.engine.autocast = a.autocast
    load_s = time.perf_counter() - t0
    warm_reward()
    stats = trainer.scheduler.stats
    steps = []
    prof = StepProfiler() if a.profile else None
    for i in range(a.warmup + a.steps):
        tokens_before, gen_before = stats.generated_tokens, stats.generate_seconds
        if prof and i == a.warmup:
            prof.start()
        t, c = time.perf_counter(), time.process_time()
        m = trainer.train_step()
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        trainer.step += 1
        trained = m["perf/train_tokens_per_s"] * m["perf/update_seconds"]  # prompt + response tokens
        steps.append({"step_s": wall, "cpu_s": cpu, "rollout_s": m["perf/rollout_seconds"],
                      "update_s": m["perf/update_seconds"],
                      "generate_s": stats.generate_seconds - gen_before,
                      "generated_tokens": stats.generated_tokens - tokens_before, "trained_tokens": round(trained),
                      "reward": m["team/reward"], "warmup": i < a.warmup})
    if prof:
        prof.stop()
    return {"framework": "masrl", "load_s": load_s, "steps": steps, **({"profile": prof.summary()} if prof else {})}


def trl_fused(a) -> bool:
    """TRL's optimizer kernel: the one masrl's ``optim.fused`` setting resolves to for this model (both train
    every parameter), so the optimizer step is compared like for like."""
    if a.fused_adamw != "auto":
        return a.fused_adamw == "true"
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from masrl.training.policy import use_fused_adamw

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(a.model_path))
    return use_fused_adamw("auto", [torch.empty(p.shape) for p in model.parameters()])


def worker_trl(a) -> dict:
    if a.trl_malloc == "tuned":  # masrl's glibc malloc settings for TRL's process too (masrl.runtime.malloc)
        from masrl.runtime.malloc import tune_malloc

        tune_malloc()
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from masrl.tasks.arithmetic import ArithmeticConfig, make_arithmetic_tasks
    from masrl.tasks.math_reward import math_score
    from masrl.types import Task
    from masrl.workflows.base import render

    train, _ = make_arithmetic_tasks(ArithmeticConfig(**TASK_PARAMS))
    template = solver_template(a.model)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": render(template, context="", question=t.question)}],
                               "task_id": t.id, "question": t.question, "answer": t.answer} for t in train])
    counters = {"generated": 0, "prompt": 0}

    def correctness(prompts, completions, completion_ids, task_id, question, answer, **_):
        counters["generated"] += sum(len(c) for c in completion_ids)
        out = []
        for c, i, q, ans in zip(completions, task_id, question, answer):
            text = c[-1]["content"] if isinstance(c, list) else c
            out.append(float(math_score(Task(i, q, ans), text)["reward"]))
        return out

    tokenizer = AutoTokenizer.from_pretrained(a.model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    out_dir = tempfile.mkdtemp(prefix="trl-bench-")
    args = GRPOConfig(
        output_dir=out_dir, seed=a.seed, use_cpu=True, bf16=a.trl_bf16, fp16=False, gradient_checkpointing=False,
        model_init_kwargs={"dtype": torch.float32},
        per_device_train_batch_size=a.B * a.G, gradient_accumulation_steps=1, num_generations=a.G,
        steps_per_generation=1, num_iterations=1, max_completion_length=a.max_new_tokens,
        temperature=1.0, top_p=1.0, top_k=0, beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group",
        learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        optim="adamw_torch_fused" if trl_fused(a) else "adamw_torch", max_steps=a.warmup + a.steps, use_vllm=False,
        report_to="none", logging_strategy="no", save_strategy="no", eval_strategy="no",
        disable_tqdm=True, log_completions=False, dataloader_num_workers=0,
    )
    t0 = time.perf_counter()
    trainer = GRPOTrainer(model=a.model_path, reward_funcs=correctness, args=args, train_dataset=data,
                          processing_class=tokenizer)
    load_s = time.perf_counter() - t0
    set_threads(a.threads)  # after TRL/accelerate set up, in case they touched the thread count
    warm_reward()

    phase = {"rollout_s": 0.0, "generate_s": 0.0, "prompt_tokens": 0, "completion_tokens": 0}
    inner = trainer._generate_and_score_completions
    model_generate = trainer.model.generate  # what unwrap_model_for_generation hands back on one CPU process

    def timed_model_generate(*args, **kwargs):
        t = time.perf_counter()
        try:
            return model_generate(*args, **kwargs)
        finally:
            phase["generate_s"] += time.perf_counter() - t

    trainer.model.generate = timed_model_generate

    def timed_generate_and_score(inputs):
        t = time.perf_counter()
        out = inner(inputs)
        phase["rollout_s"] += time.perf_counter() - t
        phase["prompt_tokens"] += int(out["prompt_mask"].sum())
        phase["completion_tokens"] += int(out["completion_mask"].sum())
        return out

    trainer._generate_and_score_completions = timed_generate_and_score
    steps: list[dict] = []

    prof = StepProfiler() if a.profile else None

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            phase.update(rollout_s=0.0, generate_s=0.0, prompt_tokens=0, completion_tokens=0)
            counters["generated"] = 0
            if prof and len(steps) == a.warmup:
                prof.start()
            self.t, self.c = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kw):
            wall, cpu = time.perf_counter() - self.t, time.process_time() - self.c
            steps.append({"step_s": wall, "cpu_s": cpu, "rollout_s": phase["rollout_s"],
                          "update_s": wall - phase["rollout_s"],
                          "generate_s": phase["generate_s"], "generated_tokens": counters["generated"],
                          "trained_tokens": phase["prompt_tokens"] + phase["completion_tokens"],
                          "warmup": len(steps) < a.warmup})
            if prof and len(steps) == a.warmup + a.steps:
                prof.stop()

    trainer.add_callback(StepTimer())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    if prof:
        prof.stop()  # no-op unless training ended early
    if not steps or any(s["generate_s"] <= 0 for s in steps):
        raise RuntimeError("the generation timer saw no model.generate call: TRL's generation path changed")
    return {"framework": "trl", "load_s": load_s, "steps": steps, **({"profile": prof.summary()} if prof else {})}


def worker_main(a) -> None:
    set_threads(a.threads)
    result = worker_masrl(a) if a.worker == "masrl" else worker_trl(a)
    import torch

    result.update(peak_rss_mib=peak_rss_mib(), threads=torch.get_num_threads())
    Path(a.worker_json).write_text(json.dumps(result))


# ----------------------------------------------------------------------------- driver

def summarize_run(run: dict) -> dict:
    timed = [s for s in run["steps"] if not s["warmup"]]
    med = lambda k: spread([s[k] for s in timed])["median"]  # noqa: E731
    gen = sum(s["generated_tokens"] for s in timed)
    trained = sum(s["trained_tokens"] for s in timed)
    return {"step_s": med("step_s"), "cpu_s": med("cpu_s"), "rollout_s": med("rollout_s"), "update_s": med("update_s"),
            "generate_s": med("generate_s"),
            "gen_tok_s": gen / max(sum(s["generate_s"] for s in timed), 1e-9),
            "rollout_tok_s": gen / max(sum(s["rollout_s"] for s in timed), 1e-9),
            "train_tok_s": trained / max(sum(s["update_s"] for s in timed), 1e-9),
            "gen_tokens_per_step": gen / max(len(timed), 1), "train_tokens_per_step": trained / max(len(timed), 1),
            "peak_rss_mib": run["peak_rss_mib"], "load_s": run["load_s"]}


METRICS = [("step_s", "s / step", "lower is better"),
           ("cpu_s", "process CPU s / step", "lower is better; robust to time-slicing on a loaded machine"),
           ("rollout_s", "rollout s / step", "lower is better"),
           ("update_s", "update s / step", "lower is better"),
           ("generate_s", "generation s / step (engine only)", "lower is better"),
           ("gen_tok_s", "generated tok/s (engine only)", "higher is better"),
           ("rollout_tok_s", "generated tok/s (whole rollout phase)", "higher is better"),
           ("train_tok_s", "training tok/s", "higher is better"),
           ("gen_tokens_per_step", "generated tokens / step", "workload: should be ~1"),
           ("train_tokens_per_step", "training tokens / step", "workload: should be ~1"),
           ("peak_rss_mib", "peak RSS MiB", "lower is better")]


def run_model(model: str, a, tmp: Path) -> dict:
    d = DEFAULTS[model]
    p = {k: (getattr(a, k) if getattr(a, k) is not None else d[k])
         for k in ("B", "G", "max_new_tokens", "lr", "steps", "warmup", "repeats")}
    folder = model_folder(model, tmp)
    worker_args = ["--model", model, "--model-path", str(folder), "--B", str(p["B"]), "--G", str(p["G"]),
                   "--max-new-tokens", str(p["max_new_tokens"]), "--lr", str(p["lr"]), "--steps", str(p["steps"]),
                   "--warmup", str(p["warmup"]), "--threads", str(a.threads)]
    worker_args += ["--autocast", a.autocast] + \
        (["--rollout-autocast"] if a.rollout_autocast else []) + ["--fused-adamw", a.fused_adamw] + \
        (["--micro-batch-tokens", str(a.micro_batch_tokens)] if a.micro_batch_tokens else []) + \
        (["--primitive-cache", str(a.primitive_cache)] if a.primitive_cache else []) + \
        (["--trl-bf16"] if a.trl_bf16 else []) + ["--masrl-malloc", a.masrl_malloc, "--trl-malloc", a.trl_malloc] + \
        ["--compile", a.compile]
    worker_args += ["--profile"] if a.profile else []
    runs = {"masrl": [], "trl": []}
    order = ["masrl", "trl"] if not a.trl_first else ["trl", "masrl"]
    print(f"\n## {model}: B={p['B']} G={p['G']} max_new_tokens={p['max_new_tokens']} lr={p['lr']} "
          f"steps={p['steps']} (+{p['warmup']} warmup) repeats={p['repeats']}", flush=True)
    for rep in range(p["repeats"]):
        for fw in order:
            t = time.perf_counter()
            # repeat r uses seed + r on both sides: the pair (masrl r, TRL r) shares prompts-sampling seed and
            # time slot; different repeats sample different completions (EOS timing varies the workload)
            run = run_worker(Path(__file__), ["--worker", fw, *worker_args, "--seed", str(a.seed + rep)])
            run["summary"] = summarize_run(run)
            runs[fw].append(run)
            s = run["summary"]
            print(f"  run {rep + 1}/{p['repeats']} {fw:5s}: {s['step_s']:.3f} s/step (cpu {s['cpu_s']:.3f}, "
                  f"rollout {s['rollout_s']:.3f}, "
                  f"update {s['update_s']:.3f}), {s['gen_tokens_per_step']:.0f} gen tok/step, "
                  f"peak RSS {s['peak_rss_mib']:.0f} MiB [{time.perf_counter() - t:.0f}s]", flush=True)
    table = {}
    for key, _, _ in METRICS:
        m = [r["summary"][key] for r in runs["masrl"]]
        t = [r["summary"][key] for r in runs["trl"]]
        ratios = [x / y for x, y in zip(m, t) if y]  # run i of masrl vs run i of TRL (adjacent in time)
        table[key] = {"masrl": spread(m), "trl": spread(t), "ratio": spread(ratios)}
    settings = {"masrl_autocast": a.autocast, "masrl_rollout_autocast": a.rollout_autocast,
                "masrl_fused_adamw": a.fused_adamw, "masrl_micro_batch_tokens": a.micro_batch_tokens,
                "masrl_compile": a.compile, "masrl_primitive_cache": a.primitive_cache,
                "trl_bf16": a.trl_bf16, "masrl_malloc": a.masrl_malloc, "trl_malloc": a.trl_malloc}
    return {"model": model, "model_path": str(folder) if model != "tiny" else "tiny (quickstart size, seed 0)",
            "params": p, "settings": settings, "threads": a.threads, "runs": runs, "table": table}


def report(res: dict) -> str:
    rows = []
    for key, label, note in METRICS:
        t = res["table"][key]
        r = t["ratio"]
        rows.append([label, fmt(t["masrl"]["median"]), fmt(t["trl"]["median"]),
                     f"{fmt(r['median'])} ({fmt(r['min'])}-{fmt(r['max'])})", note])
    p = res["params"]
    head = (f"### {res['model']}: B={p['B']} prompts x G={p['G']}, max_new_tokens={p['max_new_tokens']}, "
            f"{p['steps']} timed steps per run (+{p['warmup']} warm-up), {p['repeats']} runs each (alternated); "
            f"settings {res.get('settings')}\n\n")
    return head + fmt_table(["metric (median over runs)", "masrl", "TRL", "masrl/TRL median (min-max)", ""], rows)


def profile_report(res: dict) -> str:
    """Per framework, the first run's profile: CPU seconds per timed step by op group, then the top ops and
    Python functions."""
    steps = res["params"]["steps"]
    profs = {fw: res["runs"][fw][0]["profile"] for fw in ("masrl", "trl")}
    grouped = {fw: op_groups(p) for fw, p in profs.items()}
    rows = []
    for g in [g for g, _, _ in OP_GROUPS] + ["elementwise and other ops", "outside aten ops", "total"]:
        vals = [(profs[fw]["cpu_s"] if g == "total" else grouped[fw].get(g, 0.0)) / steps for fw in ("masrl", "trl")]
        label = "outside aten ops (Python, framework code, reward, tokenizer)" if g == "outside aten ops" else g
        rows.append([label, fmt(vals[0]), fmt(vals[1]), fmt(vals[0] / vals[1]) if vals[1] else "-"])
    calls = {fw: sum(c for _, c in p["ops"].values()) for fw, p in profs.items()}
    rows.append(["aten op calls per step", fmt(calls["masrl"] / steps), fmt(calls["trl"] / steps),
                 fmt(calls["masrl"] / max(calls["trl"], 1))])
    out = [f"### {res['model']}: profiled CPU s per timed step (first run of each framework; profiler overhead "
           "included)\n", fmt_table(["", "masrl", "TRL", "masrl/TRL"], rows)]
    for fw in ("masrl", "trl"):
        p = profs[fw]
        out.append(f"\n#### {fw}: top aten ops by self CPU (s per step)\n")
        out.append(fmt_table(["op", "group", "s / step", "calls / step"],
                             [[o["op"], op_group(o["op"]), fmt(o["self_cpu_s"] / steps), fmt(o["calls"] / steps)]
                              for o in p["top_ops"]]))
        out.append(f"\n#### {fw}: top Python functions by own time (cProfile, all timed steps)\n")
        out.append("```\n" + p["cprofile_top"] + "\n```")
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["tiny", "smollm2", "both"], default="both")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per run (default per model)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed warm-up steps per run (default 1)")
    ap.add_argument("--repeats", type=int, default=None, help="runs per framework, alternated (default per model)")
    ap.add_argument("--B", type=int, default=None, help="prompts per step")
    ap.add_argument("--G", type=int, default=None, help="samples per prompt (group size)")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads in every run (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trl-first", action="store_true", help="alternate T M T M instead of M T M T")
    # masrl speed settings (defaults: masrl's shipped defaults)
    ap.add_argument("--autocast", choices=["auto", "bfloat16", "float32"], default="auto",
                    help="masrl trainer.autocast (auto: the shipped default; float32: off, as TRL)")
    ap.add_argument("--rollout-autocast", action="store_true", help="masrl engine decodes under --autocast too")
    ap.add_argument("--fused-adamw", choices=["auto", "true", "false"], default="auto",
                    help="masrl policies.*.optim.fused (auto: the shipped default); TRL gets the same kernel "
                         "(adamw_torch_fused, its own default, or adamw_torch)")
    ap.add_argument("--micro-batch-tokens", type=int, default=None, help="masrl trainer.micro_batch_tokens")
    ap.add_argument("--primitive-cache", type=int, default=None,
                    help="masrl trainer.primitive_cache (oneDNN's and ideep's kernel caches; default: the libraries')")
    ap.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                    help="masrl trainer.compile (auto: the shipped default, eager in a run this short; on: the "
                         "decoder layers compiled during the warm-up steps)")
    ap.add_argument("--trl-bf16", action="store_true", help="TRL GRPOConfig(bf16=True) (CPU autocast)")
    ap.add_argument("--masrl-malloc", choices=["tuned", "default"], default="tuned",
                    help="masrl trainer.tune_malloc (tuned: the shipped default; masrl.runtime.malloc)")
    ap.add_argument("--trl-malloc", choices=["default", "tuned"], default="default",
                    help="TRL's process with glibc's malloc defaults, or with masrl's settings (masrl.runtime.malloc)")
    ap.add_argument("--profile", action="store_true",
                    help="profile the timed steps of every run (cProfile + torch.profiler): CPU time by op group, "
                         "outside aten, top ops and Python functions; writes vs_trl_<model>_profile.json (profiled "
                         "timings carry the profilers' overhead: use the shares, not the ratio)")
    ap.add_argument("--out-dir", type=Path, default=None,
                    help="folder of the JSON written (default benchmarks/results/, the file RESULTS.md links)")
    # internal: one measured run
    ap.add_argument("--worker", choices=["masrl", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("--worker-json", help=argparse.SUPPRESS)
    ap.add_argument("--model-path", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return worker_main(a)

    info = machine_info(a.threads)
    print(f"command: {command_line()}")
    print(f"machine: {machine_line(info)}")
    models = ["tiny", "smollm2"] if a.model == "both" else [a.model]
    with tempfile.TemporaryDirectory(prefix="masrl-vs-trl-") as tmp:
        for model in models:
            res = run_model(model, a, Path(tmp))
            res.update(command=command_line(), machine=info)
            path = (a.out_dir or RESULTS) / f"vs_trl_{model}{'_profile' if a.profile else ''}.json"
            write_json(path, res)
            print()
            print(report(res))
            if a.profile:
                print()
                print(profile_report(res))
            print(f"\nwritten {path}")


if __name__ == "__main__":
    main()
