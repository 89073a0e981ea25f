"""Where one masrl RL step spends its time, and what the speed levers are worth.

``profile`` (default): one ``Trainer.train_step()`` of the quickstart (tiny model, SFT skipped,
after one warm-up step) under cProfile (top Python functions by own time) and torch.profiler
(top aten ops by self CPU time), rollout and update separately.

``levers``: micro-benchmarks of changes masrl could make, each variant timed alternately
(A B A B ..., median of ``--reps``) in one process; nothing in masrl is modified (variants are
built here, outside masrl):

* ``prefill``  : rollout prefill with logits for every prompt position (what the engine does now)
                 vs ``logits_to_keep=1`` (only the last position is used);
* ``adamw``    : ``torch.optim.AdamW`` default (for-loop/foreach) vs ``fused=True`` on the model's params;
* ``bf16``     : one training forward+backward in float32 vs under ``torch.autocast("cpu", bfloat16)``
                 (float32 master weights) vs bfloat16 weights;
* ``logits``   : training forward+backward with ``logits_to_keep`` = response+1 (masrl) vs logits on
                 every position, and a no-grad forward alone (the pass that reusing the rollout
                 logprobs as "old" logprobs saves);
* ``kvcache``  : transformers ``generate`` with the dynamic KV cache vs ``cache_implementation="static"``
                 (SmolLM2 and tiny);
* ``bucketing``: the quickstart update with length-bucketed micro-batches (masrl) vs the same token
                 budget filled in arrival order, with the padding overhead of each;
* ``decode``   : the masrl engine's time per decode step vs the model forward alone (sampling and
                 bookkeeping overhead per step), tiny model; bare forwards under inference_mode vs no_grad;
* ``sampler``  : ``torch.multinomial`` vs the engine's inverse-CDF draw over SmolLM2's vocabulary;
* ``decode_attention``: the engine's decode steps with ``sdpa`` vs ``masrl.models.cpu_attention``;
* ``train_attention``: a training forward+backward under bf16 autocast with transformers'
                 ``sdpa`` (bf16 flash kernel) vs masrl's CPU attention (float32 ``sdpa`` up to 256 keys),
                 SmolLM2 and the tiny model, left-padded rows of mixed lengths;
* ``packed_linear``: bf16 engine calls with autocast's ``F.linear`` vs oneDNN-prepacked weights
                 (``masrl.models.packed_linear``), SmolLM2 with the packs reused and repacked every call (full
                 fine-tuning changes the weights every step), and the tiny model;
* ``fast_decode``: float32 engine calls with transformers' forward vs the lean decode step
                 (``masrl.models.fast_decode``): the tiny model at a team's and a single agent's batch shapes,
                 and SmolLM2 (its projections one by one: stacking them would exceed the memory limit);
* ``shared_packs``: after a full fine-tuning weight change, the fast decode step's o/down/LM-head projections
                 packed once (shared with the engine's packed Linear layers) vs a second time (SmolLM2);
* ``compile``  : ``torch.compile`` of the tiny model, one fixed shape (compile time + per-step time);
                 slow (~40 s of compilation), only with ``--levers compile``.

    python benchmarks/profile_step.py                     # profile the quickstart step
    python benchmarks/profile_step.py --section levers    # prefill, adamw, bf16, kvcache, decode on SmolLM2/tiny
    python benchmarks/profile_step.py --section levers --levers compile
    python benchmarks/profile_step.py --section levers --levers prefix   # prefix reuse, row compaction
    python benchmarks/profile_step.py --section levers --levers sampler decode_attention --reps 5   # decode kernels
    python benchmarks/profile_step.py --section levers --levers train_attention packed_linear --reps 5   # bf16 kernels
    python benchmarks/profile_step.py --section levers --levers fast_decode --reps 5   # fast decode steps
    python benchmarks/profile_step.py --section levers --levers shared_packs --reps 5   # one pack per weight
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchutil import (ab, print_header, REPO, RESULTS, command_line, fmt, fmt_table,  # noqa: E402
                        set_threads, write_json)
from quickstart_throughput import BASE_OVERRIDES  # noqa: E402

SMOLLM2 = "smollm2-135m-instruct"


# ----------------------------------------------------------------------------- profile

def profile_quickstart(a) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from masrl.config import load_config
    from masrl.trainer import Trainer

    cfg = load_config(REPO / "examples" / "quickstart.yaml", BASE_OVERRIDES + [f"trainer.threads={a.threads}"] + a.override)
    trainer = Trainer(cfg, progress=False)
    trainer.train_step()  # warm-up
    trainer.step += 1

    # cProfile over one whole step
    pr = cProfile.Profile()
    pr.enable()
    m = trainer.train_step()
    pr.disable()
    trainer.step += 1
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(a.top)
    cprof = s.getvalue()
    perf = {k: v for k, v in m.items() if k.startswith("perf/")}

    # torch.profiler, rollout and update separately (wrapping the two stage methods)
    tables = {}
    inner_rollout, inner_update = trainer.rollout, trainer.update

    def wrap(name, fn):
        def run(*args, **kw):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                out = fn(*args, **kw)
            tables[name] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.top)
            ka = prof.key_averages()
            total = sum(e.self_cpu_time_total for e in ka)
            tables[name + "_shares"] = {e.key: e.self_cpu_time_total / total for e in
                                        sorted(ka, key=lambda e: -e.self_cpu_time_total)[:a.top]}
            return out
        return run

    trainer.rollout, trainer.update = wrap("rollout", inner_rollout), wrap("update", inner_update)
    m2 = trainer.train_step()
    return {"perf_cprofile_step": perf, "perf_torchprof_step": {k: v for k, v in m2.items() if k.startswith("perf/")},
            "cprofile_top": cprof, "torch_rollout": tables["rollout"], "torch_update": tables["update"],
            "rollout_op_shares": tables["rollout_shares"], "update_op_shares": tables["update_shares"],
            "threads": torch.get_num_threads()}


# ----------------------------------------------------------------------------- levers


def load_smollm2(dtype=None):
    import torch
    from transformers import AutoModelForCausalLM

    from masrl.models.smollm import smollm2_path

    return AutoModelForCausalLM.from_pretrained(str(smollm2_path()), dtype=dtype or torch.float32)


def lever_prefill(a, model):
    import torch

    x = torch.randint(10, 40000, (a.rows, a.prompt_len))
    model.eval()

    def run(keep):
        def f():
            with torch.inference_mode():
                model(input_ids=x, use_cache=True, logits_to_keep=keep)
        return f

    return {"what": f"SmolLM2 prefill of {a.rows} x {a.prompt_len} prompt tokens",
            "results": ab({"logits for all positions (engine now)": run(0), "logits_to_keep=1": run(1)}, a.reps)}


def lever_adamw(a, model):
    import torch

    params = [p for p in model.parameters()]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opts = {"AdamW default": torch.optim.AdamW(params, lr=1e-7),
            "AdamW foreach=True": torch.optim.AdamW(params, lr=1e-7, foreach=True),
            "AdamW fused=True": torch.optim.AdamW(params, lr=1e-7, fused=True)}
    res = ab({k: o.step for k, o in opts.items()}, a.reps)
    for p in params:
        p.grad = None
    return {"what": f"one optimizer step over SmolLM2's {sum(p.numel() for p in params) / 1e6:.1f}M parameters",
            "results": res}


def lever_bf16(a, model):
    import torch

    model.train()
    mb = load_smollm2(torch.bfloat16).train()
    width = a.prompt_len + a.response_len
    x = torch.randint(10, 40000, (a.rows, width))

    def step(mod, ctx):
        def f():
            with ctx():
                out = mod(input_ids=x, use_cache=False, logits_to_keep=a.response_len + 1)
            out.logits.float().logsumexp(-1).mean().backward()
            mod.zero_grad(set_to_none=True)
        return f

    res = ab({"float32": step(model, contextlib.nullcontext),
              "autocast bfloat16 (float32 weights)": step(model, lambda: torch.autocast("cpu", dtype=torch.bfloat16)),
              "bfloat16 weights": step(mb, contextlib.nullcontext)}, a.reps)
    model.eval()
    return {"what": f"SmolLM2 training forward+backward, {a.rows} rows x {width} tokens "
                    f"(LM head on the last {a.response_len + 1})", "results": res}


def lever_logits(a, model):
    """Training forward+backward with the LM head on the scored positions only vs on every position;
    and a forward-only (no-grad) pass: what recomputing "old" logprobs would cost if rollout logprobs
    were not reused."""
    import torch

    model.train()
    width = a.prompt_len + a.response_len
    x = torch.randint(10, 40000, (a.rows, width))
    tgt = x[:, -a.response_len:]

    def train(keep):
        def f():
            out = model(input_ids=x, use_cache=False, logits_to_keep=keep)
            logits = out.logits[:, -(a.response_len + 1):-1].float()
            lp = logits.gather(-1, tgt[..., None]).squeeze(-1) - logits.logsumexp(-1)
            (-lp.mean()).backward()
            model.zero_grad(set_to_none=True)
        return f

    def forward_only():
        with torch.no_grad():
            out = model(input_ids=x, use_cache=False, logits_to_keep=a.response_len + 1)
            logits = out.logits[:, :-1].float()
            logits.gather(-1, tgt[..., None]).squeeze(-1) - logits.logsumexp(-1)

    res = ab({f"fwd+bwd, logits_to_keep={a.response_len + 1} (masrl)": train(a.response_len + 1),
              "fwd+bwd, logits for all positions": train(0),
              "no-grad forward only (an old-logprob pass)": forward_only}, a.reps)
    model.eval()
    return {"what": f"SmolLM2, {a.rows} rows x {width} tokens, {a.response_len} response tokens", "results": res}


def lever_bucketing(a):
    """Update on the rows of a real quickstart step: length-bucketed micro-batches (masrl) vs the same
    token budget filled in arrival order (no sorting), plus the padding each leaves."""
    import masrl.training.update as upd
    from masrl.config import load_config
    from masrl.trainer import Trainer

    cfg = load_config(REPO / "examples" / "quickstart.yaml", BASE_OVERRIDES + [f"trainer.threads={a.threads}"])
    trainer = Trainer(cfg, progress=False)
    captured = {}
    inner = trainer.update

    def capture(turns, adv):
        captured["args"] = (turns, adv)
        return inner(turns, adv)

    trainer.update = capture
    trainer.train_step()
    trainer.update = inner
    sorted_chunks = upd.micro_batches

    def arrival_order(rows, budget):
        chunks, cur, width = [], [], 0
        for r in rows:
            w = max(width, r.length)
            if cur and (len(cur) + 1) * w > budget:
                chunks.append(cur)
                cur, w = [], r.length
            cur.append(r)
            width = w
        if cur:
            chunks.append(cur)
        return chunks

    def padding(chunker):
        rows = [r for r in _rows(trainer, *captured["args"])]
        real = sum(r.length for r in rows)
        padded = 0
        for agent in sorted({r.agent for r in rows}):
            for c in chunker([r for r in rows if r.agent == agent], cfg.trainer.micro_batch_tokens):
                padded += len(c) * max(r.length for r in c)
        return padded / real - 1

    def run(chunker):
        def f():
            upd.micro_batches = chunker
            try:
                inner(*captured["args"])
            finally:
                upd.micro_batches = sorted_chunks
        return f

    res = ab({"length-bucketed (masrl)": run(sorted_chunks), "arrival order, same token budget": run(arrival_order)},
             a.reps)
    res["length-bucketed (masrl)"]["padding_overhead"] = padding(sorted_chunks)
    res["arrival order, same token budget"]["padding_overhead"] = padding(arrival_order)
    return {"what": f"quickstart update (tiny), micro_batch_tokens={cfg.trainer.micro_batch_tokens}", "results": res}


def _rows(trainer, turns, advantages):
    from masrl.training.update import Row

    for t, adv in zip(turns, advantages.tolist()):
        if t.response_ids:
            yield Row(t.agent, t.prompt_ids, t.response_ids, t.logprobs, adv, t.info.get("temperature", 1.0),
                      policy=t.policy)


def lever_kvcache(a, model):
    import torch

    model.eval()
    x = torch.randint(10, 40000, (a.rows, a.prompt_len))
    kw = dict(attention_mask=torch.ones_like(x), do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
              max_new_tokens=a.response_len, min_new_tokens=a.response_len, pad_token_id=2)

    def gen(ci):
        def f():
            torch.manual_seed(0)
            model.generate(x, cache_implementation=ci, **kw)
        return f

    res = ab({"SmolLM2, dynamic cache": gen(None), "SmolLM2, static cache": gen("static")}, a.reps)

    from masrl.models.tiny import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    tiny = build_tiny_model(tok, {}, seed=0).eval()
    xt = torch.randint(4, 100, (128, 60))
    kwt = dict(attention_mask=torch.ones_like(xt), do_sample=True, top_k=0, max_new_tokens=40, min_new_tokens=40,
               pad_token_id=tok.pad_token_id)

    def gen_tiny(ci):
        def f():
            torch.manual_seed(0)
            tiny.generate(xt, cache_implementation=ci, **kwt)
        return f

    res.update(ab({"tiny 128 x 60 prompt, 40 new, dynamic cache": gen_tiny(None),
                   "tiny 128 x 60 prompt, 40 new, static cache": gen_tiny("static")}, a.reps))
    return {"what": f"transformers generate: SmolLM2 {a.rows} rows x {a.prompt_len} prompt, {a.response_len} "
                    "new tokens; tiny 128 rows x 60 prompt, 40 new tokens (time ratios within each model)",
            "results": res}


def lever_decode(a):
    """masrl engine time per decode step vs the bare model forward per step (tiny model)."""
    import torch

    from masrl.models.tiny import build_char_tokenizer, build_tiny_model
    from masrl.rollout.engine import GenRequest, TransformersEngine
    from masrl.rollout.kv_cache import output_cache, with_cache

    tok = build_char_tokenizer()
    model = build_tiny_model(tok, {}, seed=0).eval()
    engine = TransformersEngine(model, eos_token_ids=[10**6], pad_token_id=tok.pad_token_id)  # never stops
    rows, new = 128, 40
    prompt = tok("Q 12+13-4\nS ", add_special_tokens=False)["input_ids"]
    reqs = [GenRequest(prompt, 1.0, 1.0, new) for _ in range(rows)]
    x = torch.tensor([prompt] * rows)

    def bare():
        with torch.inference_mode():
            out = model(input_ids=x, use_cache=True)
            cache, nxt = output_cache(out), out.logits[:, -1].argmax(-1)
            for _ in range(new - 1):
                out = model(input_ids=nxt[:, None], use_cache=True, **with_cache(cache))
                cache, nxt = output_cache(out), out.logits[:, -1].argmax(-1)

    def bare_no_grad():
        with torch.no_grad():
            out = model(input_ids=x, use_cache=True)
            cache, nxt = output_cache(out), out.logits[:, -1].argmax(-1)
            for _ in range(new - 1):
                out = model(input_ids=nxt[:, None], use_cache=True, **with_cache(cache))
                cache, nxt = output_cache(out), out.logits[:, -1].argmax(-1)

    def hf_generate():
        model.generate(x, attention_mask=torch.ones_like(x), do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                       max_new_tokens=new, min_new_tokens=new, pad_token_id=tok.pad_token_id)

    res = ab({"masrl engine (sampling, logprobs, masks)": lambda: engine.generate(reqs),
              "bare model forwards (greedy argmax), inference_mode": bare,
              "bare model forwards (greedy argmax), no_grad": bare_no_grad,
              "transformers generate (sampling)": hf_generate}, a.reps)
    for v in res.values():
        v["ms_per_step"] = 1000 * v["median_s"] / new
    return {"what": f"tiny model, {rows} rows, {len(prompt)} prompt tokens, {new} decode steps", "results": res}


def lever_sampler(a):
    """Drawing the next token over SmolLM2's 49,152-token vocabulary: ``torch.multinomial`` (one exponential
    per vocabulary entry) vs the engine's inverse-CDF draw (float64 cumulative sum + one uniform per row), in
    ``_sample`` alone (random logits, 8-64 rows) and in whole SmolLM2 engine calls; process CPU time."""
    import torch

    from masrl.rollout import sampling
    from masrl.rollout.engine import GenRequest, TransformersEngine, _sample, _SamplePlan

    threshold = sampling.INVERSE_CDF_MIN_VOCAB

    def with_sampler(inverse_cdf: bool, fn):
        def f():
            sampling.INVERSE_CDF_MIN_VOCAB = threshold if inverse_cdf else 10**9
            try:
                fn()
            finally:
                sampling.INVERSE_CDF_MIN_VOCAB = threshold
        return f

    results = {}
    g = torch.Generator().manual_seed(0)
    for rows in (8, 16, 32, 64):
        logits = torch.randn(rows, 49152, generator=g) * 3
        ones = torch.ones(rows)
        plan = _SamplePlan(ones, ones)

        def draw(n=20):
            for _ in range(n):
                _sample(logits, ones, ones, g, plan=plan)
        res = ab({"multinomial": with_sampler(False, draw), "inverse CDF": with_sampler(True, draw)}, a.reps,
                 clock=time.process_time)
        for k, v in res.items():
            v["ms_per_step"] = 1000 * v["median_s"] / 20
            results[f"_sample, {rows} rows: {k}"] = v
    model = load_smollm2()
    reqs = [GenRequest(torch.randint(10, 40000, (a.prompt_len - 10 * (i % 2),), generator=g).tolist(), 1.0, 1.0,
                       a.response_len) for i in range(a.rows)]
    engine = TransformersEngine(model, eos_token_ids=[10**6], pad_token_id=2, autocast="auto")
    res = ab({"multinomial": with_sampler(False, lambda: engine.generate(reqs)),
              "inverse CDF": with_sampler(True, lambda: engine.generate(reqs))}, a.reps, clock=time.process_time)
    for k, v in res.items():
        v["ms_per_step"] = 1000 * v["median_s"] / a.response_len
        results[f"SmolLM2 engine call ({a.rows} rows, autocast auto): {k}"] = v
    return {"what": "sampling over 49,152 tokens (process CPU; ms per decode step in the last column)",
            "results": results}


def lever_decode_attention(a):
    """The engine's decode steps with transformers' sdpa (under autocast: its bf16 cache) vs
    masrl.models.cpu_attention (two batched matmuls in float32 on the grouped view; under autocast a float32
    cache), SmolLM2 (GQA 9/3) and the tiny model (MHA), float32 and bf16 autocast, prompts of equal length (no
    mask: transformers' enable_gqa path) and mixed lengths (padding mask); process CPU time."""
    import torch

    from masrl.models.tiny import build_char_tokenizer, build_tiny_model
    from masrl.rollout.engine import GenRequest, TransformersEngine

    g = torch.Generator().manual_seed(0)
    tok = build_char_tokenizer()
    tiny = build_tiny_model(tok, {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                                  "intermediate_size": 384}, seed=0).eval()
    workloads = [("tiny, 64 rows, mixed lengths", tiny, 64, (18, 24), 40, 100),
                 ("tiny, 128 rows, long prompts (a team's later turns)", tiny, 128, (60, 90), 40, 100)]
    if not a.no_smollm2:
        big = load_smollm2()
        workloads += [(f"SmolLM2, {a.rows} rows, {name}", big, a.rows, lengths, a.response_len, 40000)
                      for name, lengths in (("equal lengths", (a.prompt_len,)),
                                            ("mixed lengths", (a.prompt_len, a.prompt_len - 20)))]
    results = {}
    for name, model, rows, lengths, new, vocab in workloads:
        reqs = [GenRequest(torch.randint(10, vocab, (lengths[i % len(lengths)],), generator=g).tolist(), 1.0, 1.0, new)
                for i in range(rows)]
        for precision in (None, "bfloat16"):
            engines = {fast: TransformersEngine(model, eos_token_ids=[10**6], pad_token_id=2, autocast=precision,
                                                decode_attention=fast) for fast in (False, True)}
            res = ab({"sdpa": lambda: engines[False].generate(reqs),
                      "decode attention": lambda: engines[True].generate(reqs)}, a.reps, clock=time.process_time)
            for k, v in res.items():
                v["ms_per_step"] = 1000 * v["median_s"] / new
                results[f"{name}, {precision or 'float32'}: {k}"] = v
    return {"what": "engine calls, sdpa vs decode attention (process CPU; ms per decode step, prefill included)",
            "results": results}


def lever_train_attention(a):
    """A training forward + backward (sum of the response positions' log-softmax, as a loss would take) under
    bf16 autocast: transformers' ``sdpa`` (its CPU flash kernel in bf16) vs ``masrl.models.cpu_attention``
    (float32 ``sdpa`` up to ``FLOAT32_MAX_KEYS`` keys), rows left-padded to mixed lengths; process CPU time."""
    import torch

    from masrl.models.cpu_attention import cpu_attention
    from masrl.models.tiny import build_char_tokenizer, build_tiny_model

    g = torch.Generator().manual_seed(0)
    tok = build_char_tokenizer()
    tiny = build_tiny_model(tok, {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                                  "intermediate_size": 384}, seed=0)
    workloads = [("tiny, 64 rows x 60 tokens", tiny, 64, 60, 40, 100), ("tiny, 30 rows x 130 tokens", tiny, 30, 130, 40, 100)]
    if not a.no_smollm2:
        width = a.prompt_len + a.response_len
        workloads += [(f"SmolLM2, {a.rows} rows x {width} tokens", load_smollm2(), a.rows, width, a.response_len, 40000),
                      ("SmolLM2, 32 rows x 128 tokens (a 4096-token micro-batch)", None, 32, 128, 64, 40000),
                      ("SmolLM2, 4 rows x 512 tokens (above the float32 limit)", None, 4, 512, 64, 40000)]
    results, model = {}, None
    for name, m, rows, width, resp, vocab in workloads:
        model = (m if m is not None else model).train()
        ids = torch.randint(10, vocab, (rows, width), generator=g)
        lengths = torch.randint(width // 2, width + 1, (rows,), generator=g)
        attention = (torch.arange(width)[None] >= (width - lengths)[:, None]).long()
        positions = (attention.cumsum(-1) - 1).clamp(min=0)

        def step(fast):
            def f():
                with cpu_attention(model) if fast else contextlib.nullcontext():
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        out = model(input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=False,
                                    logits_to_keep=resp + 1)
                    out.logits.float().log_softmax(-1).amax(-1).sum().backward()
                model.zero_grad(set_to_none=True)
            return f

        res = ab({"sdpa (bf16)": step(False), "cpu attention": step(True)}, a.reps, clock=time.process_time)
        for k, v in res.items():
            results[f"{name}: {k}"] = v
    return {"what": "training forward+backward under bf16 autocast, sdpa vs masrl's CPU attention (process CPU)",
            "results": results}


def lever_packed_linear(a):
    """Engine calls under bf16 autocast with autocast's ``F.linear`` (a cast weight, reordered by oneDNN every
    call) vs prepacked weights (``masrl.models.packed_linear``): SmolLM2 (packs reused; and repacked before every
    call, what full fine-tuning pays once per step) and the tiny model; process CPU per decode step."""
    import torch

    from masrl.models.tiny import build_char_tokenizer, build_tiny_model
    from masrl.rollout.engine import GenRequest, TransformersEngine

    g = torch.Generator().manual_seed(0)
    tok = build_char_tokenizer()
    tiny = build_tiny_model(tok, {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                                  "intermediate_size": 384}, seed=0).eval()
    workloads = [("tiny, 64 rows", tiny, 64, (18, 24), 40, 100)]
    if not a.no_smollm2:
        workloads.append((f"SmolLM2, {a.rows} rows", load_smollm2().eval(), a.rows, (a.prompt_len, a.prompt_len - 20),
                          a.response_len, 40000))
    results = {}
    for name, model, rows, lengths, new, vocab in workloads:
        reqs = [GenRequest(torch.randint(10, vocab, (lengths[i % len(lengths)],), generator=g).tolist(), 1.0, 1.0, new)
                for i in range(rows)]
        engines = {packed: TransformersEngine(model, eos_token_ids=[10**6], pad_token_id=2, autocast="bfloat16",
                                              packed_linear=packed) for packed in (False, True)}

        def repacked():
            engines[True].packed_linears.clear()
            engines[True].generate(reqs)

        variants = {"autocast F.linear": lambda: engines[False].generate(reqs),
                    "packed weights (reused)": lambda: engines[True].generate(reqs)}
        if engines[True].packed_linears is not None and vocab > 1000:
            variants["packed weights (repacked every call)"] = repacked
        res = ab(variants, a.reps, clock=time.process_time)
        for k, v in res.items():
            v["ms_per_step"] = 1000 * v["median_s"] / new
            results[f"{name}: {k}"] = v
    return {"what": "bf16 engine calls, autocast F.linear vs prepacked weights (process CPU; ms per decode step, "
                    "prefill included)", "results": results}


def lever_shared_packs(a):
    """Full fine-tuning changes every weight each step, so the rollout repacks them: the prefill's Linear layers
    (``PackedLinears``) and the fast decode step's o/down/LM-head projections once each with the step sharing the
    engine's copies (masrl), twice with the step packing its own (the variant built here). SmolLM2 under bf16
    autocast: engine calls after ``weights_changed(base_changed=True)`` (process CPU, ms per decode step,
    prefill and repacking included), the fast step's build alone after the prefill has packed, and the bf16
    bytes the step holds beyond the engine's packs."""
    import torch

    from masrl.models.cpu_attention import cpu_attention
    from masrl.models.fast_decode import FastDecode
    from masrl.models.packed_linear import PackedLinears
    from masrl.rollout.engine import GenRequest, TransformersEngine

    class OwnPacks(TransformersEngine):  # the engine's fast_decoder without shared_packs: the step packs its own
        def fast_decoder(self, model, cache):
            if (not self.fast_decode or self.sharded_model or cache is None or not self.preallocate_cache
                    or not self.preallocatable(model)):
                return None
            self._fast = FastDecode.for_model(model, self._fast, packed=self.packed_linears is not None)
            return self._fast

    def own_mib(fast, packs: PackedLinears) -> float:
        """bf16 MiB of the step's packed weights that are not the engine's ``packs``."""
        shared = {id(w) for _, w in packs._packed.values()}
        tensors = [w for layer in fast.layers for w, _ in [*layer["qkv"], layer["o"], *layer["gate_up"],
                                                           layer["down"]]] + [fast.head[0]]
        return sum(2 * w.numel() for w in tensors if w.is_mkldnn and id(w) not in shared) / 2**20

    model = load_smollm2().eval()
    g = torch.Generator().manual_seed(0)
    reqs = [GenRequest(torch.randint(10, 40000, (a.prompt_len - 20 * (i % 2),), generator=g).tolist(), 1.0, 1.0,
                       a.response_len) for i in range(a.rows)]
    engines = {"shared with the engine's packs (masrl)": TransformersEngine(
                   model, eos_token_ids=[10**6], pad_token_id=2, autocast="bfloat16"),
               "the step's own packs": OwnPacks(model, eos_token_ids=[10**6], pad_token_id=2, autocast="bfloat16")}
    if engines["the step's own packs"].packed_linears is None:
        return {"what": "shared packs: this CPU does not pack bf16 weights (no AVX-512 BF16 path)", "results": {}}

    def call(engine):
        def f():
            engine.weights_changed(model, base_changed=True)
            engine.generate(reqs)
        return f

    res = ab({k: call(e) for k, e in engines.items()}, a.reps, clock=time.process_time)
    for k, v in res.items():
        v["ms_per_step"] = 1000 * v["median_s"] / a.response_len
        v["own_bf16_mib"] = own_mib(engines[k]._fast, engines[k].packed_linears)
    packs = PackedLinears()
    modules = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    for m in modules:  # what the prefill leaves packed
        packs.packed_weight(m)
    with torch.autocast("cpu", dtype=torch.bfloat16), cpu_attention(model):  # as the engine decodes
        assert FastDecode.for_model(model, packed=True) is not None
        build = ab({"build, sharing": lambda: FastDecode.for_model(model, packed=True, shared_packs=packs),
                    "build, own packs": lambda: FastDecode.for_model(model, packed=True)}, a.reps,
                   clock=time.process_time)
        build["build, sharing"]["own_bf16_mib"] = own_mib(FastDecode.for_model(model, packed=True,
                                                                              shared_packs=packs), packs)
        build["build, own packs"]["own_bf16_mib"] = own_mib(FastDecode.for_model(model, packed=True), packs)
    res.update(build)
    return {"what": "SmolLM2 bf16 engine calls after a full fine-tuning weight change (process CPU; ms per decode "
                    "step, prefill and packing included); the fast step's build after the prefill, and its own "
                    "packed bf16 MiB", "results": res}


def lever_fast_decode(a):
    """float32 engine calls (autocast off) with transformers' forward per decode step vs
    ``masrl.models.fast_decode`` (the same arithmetic in about half the operator calls): the tiny model with 16
    rows (per-step overhead), 128 rows of long prompts (a team's later turns), 304 rows of short prompts (the
    single agent of ``multiagent_overhead.py``), and SmolLM2; process CPU per decode step, prefill included. The
    two variants' tokens and log-probs are checked equal first. With the trainer's allocator settings
    (``masrl.runtime.malloc.tune_malloc``, on by default in training): with glibc's defaults every call maps its KV
    cache afresh, and the page faults scatter these timings by up to 2x."""
    import torch

    from masrl.models.tiny import build_char_tokenizer, build_tiny_model
    from masrl.rollout.engine import GenRequest, TransformersEngine
    from masrl.runtime.malloc import tune_malloc

    tune_malloc()

    g = torch.Generator().manual_seed(0)
    tok = build_char_tokenizer()
    tiny = build_tiny_model(tok, {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                                  "intermediate_size": 384}, seed=0).eval()
    workloads = [("tiny, 16 rows, prompts 10", tiny, 16, (10,), 40, 100),
                 ("tiny, 128 rows, prompts 60/90 (a team's later turns)", tiny, 128, (60, 90), 40, 100),
                 ("tiny, 304 rows, prompts 10/20 (the single agent)", tiny, 304, (10, 20), 40, 100)]
    if not a.no_smollm2:
        workloads.append((f"SmolLM2, {a.rows} rows, prompts {a.prompt_len}/{a.prompt_len - 20}", load_smollm2().eval(),
                          a.rows, (a.prompt_len, a.prompt_len - 20), a.response_len, 40000))
    results = {}
    for name, model, rows, lengths, new, vocab in workloads:
        reqs = [GenRequest(torch.randint(10, vocab, (lengths[i % len(lengths)],), generator=g).tolist(), 1.0, 1.0, new)
                for i in range(rows)]
        engines = {fast: TransformersEngine(model, eos_token_ids=[10**6], pad_token_id=2, autocast=None,
                                            fast_decode=fast, seed=0) for fast in (False, True)}
        outs = {fast: [(r.response_ids, r.logprobs) for r in engines[fast].generate(reqs)] for fast in (False, True)}
        assert outs[False] == outs[True], f"{name}: fast decode changed the results"
        for e in engines.values():
            e.reseed(0)
        res = ab({"transformers forward": lambda: engines[False].generate(reqs),
                  "fast decode": lambda: engines[True].generate(reqs)}, a.reps, clock=time.process_time)
        for k, v in res.items():
            v["ms_per_step"] = 1000 * v["median_s"] / new
            results[f"{name}: {k}"] = v
    return {"what": "float32 engine calls, transformers' forward vs fast decode (process CPU; ms per decode step, "
                    "prefill included; results checked equal)", "results": results}


def lever_prealloc(a):
    """Decode with the engine's preallocated KV cache (written in place) vs transformers' growing cache
    (``torch.cat`` per layer per step); tiny model, 128 rows, short and long generations. Same outputs."""
    from masrl.models.tiny import build_char_tokenizer, build_tiny_model
    from masrl.rollout.engine import GenRequest, TransformersEngine

    tok = build_char_tokenizer()
    model = build_tiny_model(tok, {}, seed=0).eval()
    prompt = tok("Q 12+13-4\nS ", add_special_tokens=False)["input_ids"]
    variants = {}
    for new in (40, 160):
        reqs = [GenRequest(prompt, 1.0, 1.0, new) for _ in range(128)]
        for pre in (False, True):
            engine = TransformersEngine(model, eos_token_ids=[10**6], pad_token_id=tok.pad_token_id,
                                        preallocate_cache=pre)
            variants[f"{new} new tokens, {'preallocated' if pre else 'growing (torch.cat)'} cache"] = \
                (lambda e, r: lambda: e.generate(r))(engine, reqs)
    return {"what": "tiny model, 128 rows, masrl engine (never stops); compare within each length",
            "results": ab(variants, a.reps)}


ENGINE_VARIANTS = {  # name -> TransformersEngine options
    "plain (no reuse, no compaction)": {"prefix_cache": False, "compact_finished": False},
    "finished rows leave the batch": {"prefix_cache": False, "compact_finished": True},
    "+ prefix reuse (default)": {"prefix_cache": True, "compact_finished": True},
}


def lever_prefix(a, smollm2=None):
    """The engine's prefix reuse and row compaction on three workloads: a GRPO batch of the tiny model (vs_trl's
    shape), the quickstart team's three turns (Solver, Verifier, Solver; each turn's prompt is the
    previous one + reply, as the quickstart renders it with a transcript-style template), and
    SmolLM2 with 2 prompts x 4 samples. Same seed for every variant: same tokens (tested)."""
    import random

    from masrl.models.smollm import smollm2_path
    from masrl.models.tiny import build_char_tokenizer, build_tiny_model
    from masrl.rollout.engine import GenRequest, TransformersEngine

    tok = build_char_tokenizer()
    tiny = build_tiny_model(tok, {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                                  "intermediate_size": 384}, seed=0).eval()
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    rng = random.Random(0)
    questions = [f"{rng.randint(1, 9)}+{rng.randint(1, 9)}-{rng.randint(1, 9)}" for _ in range(16)]
    results, stats = {}, {}

    def engine_for(model, opts, eos, pad):
        return TransformersEngine(model, eos_token_ids=eos, pad_token_id=pad, seed=0, max_batch_size=512, **opts)

    def grpo(engine, prompts, group, new):
        reqs = [GenRequest(p, 1.0, 1.0, new) for p in prompts for _ in range(group)]

        def f():
            engine.generate(reqs)
            engine.clear_prefix_cache()  # the next step's prompts are new (and the weights changed)
        return f

    def team(engine):
        def f():
            first = [GenRequest(enc(f"Q {q}\nSolver: "), 1.0, 1.0, 40) for q in questions for _ in range(8)]
            r1 = engine.generate(first)
            second = [GenRequest(q.prompt_ids + enc(tok.decode(r.response_ids, skip_special_tokens=True) + "\nVerifier: "),
                                 1.0, 1.0, 12) for q, r in zip(first, r1)]
            r2 = engine.generate(second)
            third = [GenRequest(q.prompt_ids + enc(tok.decode(r.response_ids, skip_special_tokens=True) + "\nSolver: "),
                                1.0, 1.0, 40) for q, r in zip(second, r2)]
            engine.generate(third)
            engine.clear_prefix_cache()  # one rollout per call, as the scheduler does
        return f

    workloads = {"tiny GRPO 8x8, 40 new": lambda e: grpo(e, [enc(f"Q {q}\nS ") for q in questions[:8]], 8, 40),
                 "tiny team, 3 turns of 128 rows": team}
    for wname, make in workloads.items():
        variants = {}
        for vname, opts in ENGINE_VARIANTS.items():
            engine = engine_for(tiny, opts, [tok.eos_token_id], tok.pad_token_id)
            variants[f"{wname}: {vname}"] = make(engine)
            stats[f"{wname}: {vname}"] = engine
        results.update(ab(variants, a.reps))
    if smollm2 is not None:
        from transformers import AutoTokenizer

        stok = AutoTokenizer.from_pretrained(str(smollm2_path()))
        prompts = [stok.apply_chat_template([{"role": "user", "content": f"Compute {q}. Put the answer in \\boxed{{}}."}],
                                            tokenize=True, add_generation_prompt=True) for q in questions[:2]]
        prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
        variants = {}
        for vname, opts in ENGINE_VARIANTS.items():
            engine = engine_for(smollm2.eval(), opts, [stok.eos_token_id], stok.pad_token_id or 0)
            variants[f"SmolLM2 2x4, 32 new: {vname}"] = grpo(engine, prompts, 4, 32)
            stats[f"SmolLM2 2x4, 32 new: {vname}"] = engine
        results.update(ab(variants, a.reps))
    for k, engine in stats.items():
        results[k]["prefill_tokens_per_call"] = engine.prefill_tokens / (a.reps + 1)
    return {"what": "engine variants (compare within a workload); prefill tokens per call in the last column",
            "results": results}


def lever_rollout_bf16(a, model):
    """SmolLM2 decoding with the engine in float32 vs under bf16 autocast (weights cast once per batch)."""
    import torch

    from masrl.rollout.engine import GenRequest, TransformersEngine

    g = torch.Generator().manual_seed(0)
    reqs = [GenRequest(torch.randint(10, 40000, (a.prompt_len,), generator=g).tolist(), 1.0, 1.0, a.response_len)
            for _ in range(a.rows)]
    engines = {"float32": TransformersEngine(model, eos_token_ids=[10**6], pad_token_id=2),
               "autocast bfloat16": TransformersEngine(model, eos_token_ids=[10**6], pad_token_id=2,
                                                       autocast="bfloat16")}
    res = ab({k: (lambda e: lambda: e.generate(reqs))(e) for k, e in engines.items()}, a.reps)
    return {"what": f"SmolLM2 engine, {a.rows} rows x {a.prompt_len} prompt tokens, {a.response_len} new tokens",
            "results": res}


def lever_entropy(a):
    """The entropy metric: entropy_from_logits vs entropy_from_logsumexp reusing the log-probs' logsumexp."""
    import torch

    from masrl.algorithms.losses import entropy_from_logits, entropy_from_logsumexp

    z = torch.randn(a.rows, a.response_len, 49152, generator=torch.Generator().manual_seed(0)) * 3
    lse = torch.logsumexp(z, -1)
    res = ab({"entropy_from_logits": lambda: entropy_from_logits(z),
              "entropy_from_logsumexp (lse reused)": lambda: entropy_from_logsumexp(z, lse)}, a.reps)
    return {"what": f"entropy of {a.rows} x {a.response_len} x 49152 float32 logits", "results": res}


def lever_compile(a):
    import torch

    from masrl.models.tiny import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    model = build_tiny_model(tok, {}, seed=0).train()
    x = torch.randint(4, 100, (64, 60))

    def step(mod):
        def f():
            out = mod(input_ids=x, use_cache=False, logits_to_keep=41)
            out.logits.float().logsumexp(-1).mean().backward()
            mod.zero_grad(set_to_none=True)
        return f

    t = time.perf_counter()
    compiled = torch.compile(model, dynamic=False)
    step(compiled)()
    compile_s = time.perf_counter() - t
    res = ab({"eager": step(model), "torch.compile (one fixed shape)": step(compiled)}, a.reps)
    return {"what": "tiny model training forward+backward, 64 rows x 60 tokens", "compile_seconds": compile_s,
            "results": res}


def run_levers(a) -> dict:
    out = {}
    wanted = a.levers
    big = None
    if any(k in wanted for k in ("prefill", "adamw", "bf16", "kvcache", "logits", "rollout_bf16")):
        big = load_smollm2()
    for name in wanted:
        t = time.perf_counter()
        if name == "decode":
            out[name] = lever_decode(a)
        elif name == "compile":
            out[name] = lever_compile(a)
        elif name == "bucketing":
            out[name] = lever_bucketing(a)
        elif name == "prealloc":
            out[name] = lever_prealloc(a)
        elif name == "entropy":
            out[name] = lever_entropy(a)
        elif name == "sampler":
            out[name] = lever_sampler(a)
        elif name == "decode_attention":
            out[name] = lever_decode_attention(a)
        elif name == "train_attention":
            out[name] = lever_train_attention(a)
        elif name == "packed_linear":
            out[name] = lever_packed_linear(a)
        elif name == "fast_decode":
            out[name] = lever_fast_decode(a)
        elif name == "shared_packs":
            out[name] = lever_shared_packs(a)
        elif name == "prefix":
            out[name] = lever_prefix(a, None if a.no_smollm2 else load_smollm2())
        else:
            out[name] = {"prefill": lever_prefill, "adamw": lever_adamw, "bf16": lever_bf16,
                         "rollout_bf16": lever_rollout_bf16,
                         "kvcache": lever_kvcache, "logits": lever_logits}[name](a, big)
        print(f"\n#### {name}: {out[name]['what']}  [{time.perf_counter() - t:.0f}s]\n")
        extra = {"decode": ("ms_per_step", "ms / decode step"), "sampler": ("ms_per_step", "ms / decode step"),
                 "decode_attention": ("ms_per_step", "ms / decode step"),
                 "packed_linear": ("ms_per_step", "ms / decode step"), "fast_decode": ("ms_per_step", "ms / decode step"),
                 "shared_packs": ("own_bf16_mib", "step's own packed MiB"),
                 "bucketing": ("padding_overhead", "padding / real tokens"),
                 "prefix": ("prefill_tokens_per_call", "prefill tokens / call")}
        rows = [[k, fmt(v["median_s"]), fmt(v["min_s"]), fmt(v["ratio_to_first"])] +
                ([fmt(v[extra[name][0]])] if name in extra else [])
                for k, v in out[name]["results"].items()]
        header = ["variant", "median s", "min s", "time vs first"] + ([extra[name][1]] if name in extra else [])
        print(fmt_table(header, rows))
        if "compile_seconds" in out[name]:
            print(f"\ncompilation + first call: {out[name]['compile_seconds']:.1f} s")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--section", choices=["profile", "levers", "both"], default="profile")
    ap.add_argument("--levers", nargs="+",
                    default=["prefill", "logits", "adamw", "bf16", "kvcache", "decode", "bucketing"],
                    choices=["prefill", "logits", "adamw", "bf16", "kvcache", "decode", "bucketing", "compile",
                             "prealloc", "rollout_bf16", "entropy", "prefix", "sampler", "decode_attention",
                             "train_attention", "packed_linear", "fast_decode", "shared_packs"])
    ap.add_argument("--no-smollm2", action="store_true", help="prefix, decode_attention, train_attention, packed_linear, "
                                                              "fast_decode levers: tiny workloads only")
    ap.add_argument("--override", action="append", default=[], help="quickstart config override (profile)")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=8, help="SmolLM2 levers: rows")
    ap.add_argument("--prompt-len", type=int, default=90, help="SmolLM2 levers: prompt tokens")
    ap.add_argument("--response-len", type=int, default=32, help="SmolLM2 levers: response tokens")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    set_threads(a.threads)
    info = print_header(a.threads)
    res = {"command": command_line(), "machine": info}
    if a.section in ("profile", "both"):
        p = profile_quickstart(a)
        res["profile"] = p
        print("\n### quickstart train_step (tiny model, 128 episodes, SFT skipped), perf metrics of the profiled step\n")
        print(fmt_table(["metric", "value"], [[k, fmt(v)] for k, v in p["perf_cprofile_step"].items()]))
        print("\n### cProfile, top functions by own time (one whole train_step)\n")
        print("```\n" + "\n".join(p["cprofile_top"].strip().splitlines()[:a.top + 8]) + "\n```")
        for stage in ("rollout", "update"):
            print(f"\n### torch.profiler, {stage} stage, top ops by self CPU time\n")
            print("```\n" + p[f"torch_{stage}"].strip() + "\n```")
    if a.section in ("levers", "both"):
        print("\n### levers (alternated A/B timings, median of --reps)")
        res["levers"] = run_levers(a)
    path = RESULTS / f"profile_step_{a.section}.json"
    write_json(path, res)
    print(f"\nwritten {path}")


if __name__ == "__main__":
    main()
