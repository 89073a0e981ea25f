#!/usr/bin/env bash
# GPU smoke test for vLLM rollouts, on a machine with one CUDA GPU:
#   1. installs what is missing: vllm and ray (torch held at the installed version), masrl (-e .)
#   2. builds a tiny character-level model from config and saves it to a folder
#   3. engine check: VLLMEngine generates, its log-probs are compared with the float32 trainer's,
#      weights are synced in place, sleep/wake frees and restores memory
#   4. a 3-step Solver + Verifier run (benchmarks/gpu_smoke.yaml) with vLLM rollouts; prints metrics
# Every stage prints its elapsed time. Not a benchmark: figures are indicative.
#   bash benchmarks/gpu_smoke.sh
# Environment: PYTHON (python3), OUT (/tmp/masrl-gpu-smoke), STEPS (3),
#   VLLM_SPEC (vllm; e.g. "vllm==0.10.2" to match the installed torch), SKIP_INSTALL=1,
#   EXTRA_OVERRIDES (more dotted overrides for the training run, space-separated)
set -euo pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/masrl-gpu-smoke}
STEPS=${STEPS:-3}
VLLM_SPEC=${VLLM_SPEC:-vllm}
mkdir -p "$OUT"
SECONDS=0
stamp() { printf '[gpu_smoke %4ds] %s\n' "$SECONDS" "$*"; }

stamp "checking the GPU"
if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "gpu_smoke: nvidia-smi not found: this script needs a machine with an NVIDIA GPU" >&2
  exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_smoke: torch is missing or does not see a CUDA GPU (install a CUDA build of torch first)" >&2
  exit 1
fi

if [[ "${SKIP_INSTALL:-0}" != 1 ]]; then
  stamp "installing what is missing (torch held at the installed version)"
  TORCH_VERSION=$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')
  echo "torch==${TORCH_VERSION}" > "$OUT/constraints.txt"
  pip_install() { "$PY" -m pip install --quiet --constraint "$OUT/constraints.txt" "$@"; }
  if ! "$PY" -c 'import vllm' >/dev/null 2>&1; then
    pip_install "$VLLM_SPEC" || {
      echo "gpu_smoke: no '$VLLM_SPEC' build works with torch ${TORCH_VERSION}; set VLLM_SPEC to the vllm" \
           "release built for this torch (e.g. VLLM_SPEC='vllm==0.10.2' for torch 2.8)" >&2
      exit 1
    }
  fi
  "$PY" -c 'import ray' >/dev/null 2>&1 || pip_install "ray[default]>=2.41"
  "$PY" -c 'import masrl' >/dev/null 2>&1 || pip_install -e .
fi
"$PY" -c 'import torch, vllm, masrl; print(f"torch {torch.__version__}, vllm {vllm.__version__}, masrl {masrl.__file__}")'

stamp "building the tiny model folder"
"$PY" - "$OUT/tiny" <<'PYEOF'
import sys

from masrl.models.tiny import build_char_tokenizer, build_tiny_model
from masrl.rollout.vllm_engine import save_for_vllm

tok = build_char_tokenizer()
model = build_tiny_model(tok, {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
                               "num_key_value_heads": 4, "intermediate_size": 768,
                               "max_position_embeddings": 1024}, seed=0)
print("saved", save_for_vllm(model, tok, sys.argv[1]))
PYEOF

stamp "engine check: generate, log-probs vs the trainer, weight sync, sleep/wake"
"$PY" - "$OUT/tiny" <<'PYEOF'
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from masrl.rollout.engine import GenRequest
from masrl.rollout.vllm_engine import VLLMEngine, hf_named_tensors

folder = sys.argv[1]
tok = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
t = time.perf_counter()
engine = VLLMEngine(folder, dtype="bfloat16", gpu_memory_utilization=0.3, enable_sleep_mode=True,
                    enforce_eager=True, eos_token_ids=[tok.eos_token_id], seed=0)
report = {"engine_start_s": round(time.perf_counter() - t, 1)}
prompts = [tok(f"Q {a}+{b}\nS ", add_special_tokens=False)["input_ids"] for a, b in [(3, 4), (12, 5)]]
requests = [GenRequest(p, temperature=1.0, max_new_tokens=64) for p in prompts for _ in range(64)]
t = time.perf_counter()
results = engine.generate(requests)
seconds = time.perf_counter() - t
report["rows"], report["tokens"] = len(results), sum(len(r.response_ids) for r in results)
report["tokens_per_s"] = round(report["tokens"] / seconds, 1)
diffs = []
with torch.no_grad():
    for req, res in zip(requests[::16], results[::16]):
        ids = torch.tensor([req.prompt_ids + res.response_ids], device="cuda")
        logp = torch.log_softmax(model(input_ids=ids).logits[0, len(req.prompt_ids) - 1:-1].float(), -1)
        train = logp.gather(-1, ids[0, len(req.prompt_ids):, None]).squeeze(-1).cpu()
        diffs.append((train - torch.tensor(res.logprobs)).abs())
diffs = torch.cat(diffs)
report["logprob_abs_diff_mean"] = round(float(diffs.mean()), 5)
report["logprob_abs_diff_max"] = round(float(diffs.max()), 5)
greedy = [GenRequest(prompts[0], temperature=0.0, max_new_tokens=32)]
before = engine.generate(greedy)[0].response_ids
with torch.no_grad():
    for p in model.parameters():
        p.add_(torch.randn_like(p) * 0.05)
t = time.perf_counter()
engine.sync_weights(hf_named_tensors(model))
report["sync_weights_s"] = round(time.perf_counter() - t, 3)
report["greedy_changed_after_sync"] = engine.generate(greedy)[0].response_ids != before
free = torch.cuda.mem_get_info()[0]
t = time.perf_counter()
engine.sleep(level=1)
report["sleep_s"] = round(time.perf_counter() - t, 3)
report["sleep_freed_gib"] = round((torch.cuda.mem_get_info()[0] - free) / 2**30, 2)
t = time.perf_counter()
engine.wake_up()
report["wake_s"] = round(time.perf_counter() - t, 3)
engine.close()
print(json.dumps(report, indent=1))
ok = report["greedy_changed_after_sync"] and report["logprob_abs_diff_mean"] < 0.05
sys.exit(0 if ok else 1)
PYEOF

stamp "${STEPS}-step two-agent run with vLLM rollouts"
read -r -a EXTRA <<< "${EXTRA_OVERRIDES:-}"
"$PY" -m masrl train benchmarks/gpu_smoke.yaml --overwrite \
  "policies.shared.model=$OUT/tiny" "output_dir=$OUT/run" "trainer.total_steps=$STEPS" \
  rollout.engine=vllm rollout.gpu_memory_utilization=0.3 rollout.enable_sleep_mode=true \
  rollout.sleep_level=1 rollout.enforce_eager=true \
  algorithm.rollout_is.enabled=true algorithm.rollout_is.cap=2.0 \
  ${EXTRA[@]+"${EXTRA[@]}"}

stamp "metrics"
"$PY" - "$OUT/run/metrics.jsonl" <<'PYEOF'
import json
import sys

records = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
train = [r for r in records if r.get("phase") == "train"]
if not train:
    sys.exit("gpu_smoke: no RL step was logged")
keys = sorted({k for r in train for k in r if k.startswith(("team/", "policy/", "agent/", "time/", "rollout"))})
for r in train:
    print(f"step {r['step']}: " + ", ".join(f"{k}={r[k]:.4g}" for k in keys
                                             if isinstance(r.get(k), (int, float))))
PYEOF
stamp "done"
