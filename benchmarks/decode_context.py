"""What a decode step of the quickstart's tiny model costs by batch rows and context length (why a team's
later turns decode slower than a single agent): per configuration, the process CPU time of the prefill (+ first token) and of each further decode step,
best of 2, one thread, no stop token (every row runs its budget), no prefix reuse.

    python benchmarks/decode_context.py
"""
import time, torch
torch.set_num_threads(1)
from masrl.models.tiny import build_char_tokenizer, build_tiny_model
from masrl.rollout.engine import GenRequest, TransformersEngine
tok = build_char_tokenizer()
model = build_tiny_model(tok, {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 384}, seed=0).eval()
eng = TransformersEngine(model, eos_token_ids=[10**6], pad_token_id=tok.pad_token_id, seed=0, prefix_cache=False)
import random
rng = random.Random(0)
for rows, ctx, new in [(304, 10, 40), (128, 10, 40), (128, 60, 12), (128, 80, 40), (32, 60, 12)]:
    reqs = [GenRequest([rng.randrange(5, 90) for _ in range(ctx)], 1.0, 1.0, new) for _ in range(rows)]
    eng.generate(reqs[:4])
    def cpu(n):
        rs = [GenRequest(r.prompt_ids, 1.0, 1.0, n) for r in reqs]
        best = []
        for _ in range(2):
            c = time.process_time(); eng.generate(rs); best.append(time.process_time() - c)
        return min(best)
    t1, tn = cpu(1), cpu(new)
    step = (tn - t1) / (new - 1)
    print(f"rows {rows:3d} ctx {ctx:3d} new {new:3d}: prefill+first {t1*1000:6.1f} CPU ms ({rows*ctx/t1:7.0f} prompt tok/s), "
          f"decode {step*1000:5.1f} CPU ms/step = {rows/step:7.0f} tok/CPU-s", flush=True)
