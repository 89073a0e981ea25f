#!/usr/bin/env bash
# One script for the moment a GPU is lent (needs torch, transformers, peft and masrl's own light deps;
# no Ray, no vLLM). Prints one line per check (PASS / FAIL / SKIP) and exits non-zero on a failure.
# Without CUDA every check is skipped (exit 0); --dry-run runs the same checks on CPU with a 2-layer Qwen3.
# Names as arguments run only those checks:  bash benchmarks/gpu_check.sh mixed_lora lora_team_rl_step_bf16
#   bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} exec python benchmarks/gpu_check.py "$@"
