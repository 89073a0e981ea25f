"""How to add per-row LoRA deltas in a decode step on a CPU: three ways, timed on one layer's LoRA'd projections.

Rows of one decode batch use different adapters; for each LoRA-wrapped projection the delta is
``scale_a * (x @ A_a^T) @ B_a^T`` with ``a`` the row's adapter. Per configuration (model shape, adapters, rows),
the time of the deltas of q/k/v (one group) and o, i.e. masrl's default ``target_modules``:

* ``bmm``: the A/B of every row gathered once per batch (``[rows, r, in]``), two ``torch.bmm`` per group;
* ``grouped``: per adapter, ``index_select`` of its rows, two matmuls, ``* scale``, ``index_add_``;
* ``stacked``: every adapter's A stacked (one matmul for all rows), a per-row scale mask (0 off the row's adapter),
  then one matmul with every adapter's B side by side (the masrl fast decode step's way).

Median (min-max) of 7 alternated repeats of 200 calls each, one thread; the load average is printed (shared machine).

    python benchmarks/lora_delta_kernels.py
"""
import os
import statistics
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(1)
SHAPES = {"tiny": dict(hidden=128, q=128, kv=128), "smollm2-135m": dict(hidden=576, q=576, kv=192)}
R = 8


def make(shape, n_adapters, rows, g):
    h, q, kv = shape["hidden"], shape["q"], shape["kv"]
    outs = {"qkv": [q, kv, kv], "o": [h]}
    per = {name: [[(torch.randn(R, h, generator=g), torch.randn(o, R, generator=g)) for o in os_]
                  for _ in range(n_adapters)] for name, os_ in outs.items()}
    scale = [2.0 / (a + 1) for a in range(n_adapters)]
    route = torch.arange(rows) % n_adapters
    x = torch.randn(rows, h, generator=g)
    return per, scale, route, x


def prep(per, scale, route, rows):
    n = len(scale)
    bmm, stacked, groups = {}, {}, [(route == a).nonzero().squeeze(1) for a in range(n)]
    for name, adapters in per.items():
        # bmm: per row [sum r, in] and block B [out, sum r] for its adapter
        A_a = [torch.cat([A for A, _ in projs]) for projs in adapters]
        B_a = [torch.block_diag(*[B for _, B in projs]) for projs in adapters]
        bmm[name] = (torch.stack([A_a[a] for a in route.tolist()]).transpose(1, 2).contiguous(),
                     torch.stack([B_a[a] * scale[a] for a in route.tolist()]).transpose(1, 2).contiguous())
        A = torch.cat(A_a)
        B = torch.cat(B_a, 1)
        k = A_a[0].shape[0]
        mask = torch.zeros(rows, n * k)
        for a in range(n):
            mask[route == a, a * k:(a + 1) * k] = scale[a]
        stacked[name] = (A, B, mask)
    return bmm, stacked, groups


def run_bmm(x, bmm):
    return [torch.bmm(torch.bmm(x[:, None, :], A), B)[:, 0] for A, B in bmm.values()]


def run_stacked(x, stacked):
    return [F.linear(F.linear(x, A) * mask, B) for A, B, mask in stacked.values()]


def run_grouped(x, per, scale, groups):
    out = []
    for name, adapters in per.items():
        width = sum(B.shape[0] for _, B in adapters[0])
        y = x.new_zeros(x.shape[0], width)
        for a, idx in enumerate(groups):
            sub = x.index_select(0, idx)
            d = torch.cat([F.linear(F.linear(sub, A), B) for A, B in adapters[a]], 1) * scale[a]
            y.index_add_(0, idx, d)
        out.append(y)
    return out


def main():
    print(f"load average {os.getloadavg()} on {os.cpu_count()} logical CPUs (shared machine); torch {torch.__version__}")
    print("| shape | adapters | rows | bmm µs | grouped µs | stacked µs |\n|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for sname, shape in SHAPES.items():
        for n in (2, 4):
            for rows in (8, 32, 64):
                per, scale, route, x = make(shape, n, rows, g)
                bmm, stacked, groups = prep(per, scale, route, rows)
                ref = run_grouped(x, per, scale, groups)
                for got in (run_bmm(x, bmm), run_stacked(x, stacked)):
                    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-3) for a, b in zip(got, ref))
                fns = {"bmm": lambda: run_bmm(x, bmm), "grouped": lambda: run_grouped(x, per, scale, groups),
                       "stacked": lambda: run_stacked(x, stacked)}
                times = {k: [] for k in fns}
                for _ in range(7):
                    for k, f in fns.items():
                        t = time.perf_counter()
                        for _ in range(200):
                            f()
                        times[k].append((time.perf_counter() - t) / 200 * 1e6)
                cell = {k: f"{statistics.median(v):.0f} ({min(v):.0f}-{max(v):.0f})" for k, v in times.items()}
                print(f"| {sname} | {n} | {rows} | {cell['bmm']} | {cell['grouped']} | {cell['stacked']} |", flush=True)
    print(f"load average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
