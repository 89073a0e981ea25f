"""CPU per request of the gateway's HTTP serving alone: a standing session whose team answers at once, one
keep-alive client (httpx) posting chat completions in a loop; the CPU of each thread per request (the client,
the gateway's server thread(s), the session's loop). Only the public interface (Gateway, EpisodeSession), so the
same script measures any version of the gateway (PYTHONPATH=... of the sources to measure).

    PYTHONPATH=src python3 benchmarks/gateway_request_cost.py --requests 1000

With ``--arm NAME=SRC[,PYTHON]`` (twice or more) it measures each version in its own process, alternately
(A B A B ...) for ``--rounds`` rounds, and prints each run and the mean, median, min and max per version of the
gateway's CPU per request (server thread + session loop) and of the client's (the same work in every arm, yet
charged more or less CPU by the load: a gauge of it) and of the whole process (every thread: client and server). ``PYTHON``: the interpreter of that arm (an environment with or
without httptools / uvloop); default this one.

    python3 benchmarks/gateway_request_cost.py --requests 500 --rounds 6 \
        --arm before=../old-checkout/src --arm now=src,.venv/bin/python
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading

import httpx

from _benchutil import print_header
from masrl.gateway import EpisodeSession, Gateway
from masrl.types import Turn


class _Team:
    agents = ("Planner",)

    async def call(self, agent, prompt):
        return Turn(agent=agent, policy="p", prompt_ids=[1, 2, 3], response_ids=[4, 5], logprobs=[-1.0, -0.5],
                    text="ok")


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of each live thread, by name (Linux /proc)."""
    out = {}
    for t in threading.enumerate():
        try:
            with open(f"/proc/self/task/{t.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = "server" if t.name.startswith("masrl-gateway") or "process_request" in t.name else t.name
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def _alternate(args) -> int:
    arms = {}
    for arm in args.arm:
        name, _, where = arm.partition("=")
        src, _, python = where.partition(",")
        arms[name] = (os.path.abspath(src), python or sys.executable)
    runs: dict[str, list[dict]] = {name: [] for name in arms}
    for r in range(args.rounds):
        for name, (src, python) in arms.items():
            env = dict(os.environ, PYTHONPATH=src)
            got = subprocess.run([python, __file__, "--requests", str(args.requests), "--json"], env=env,
                                 capture_output=True, text=True, check=True)
            run = json.loads(got.stdout.strip().splitlines()[-1])
            runs[name].append(run)
            print(f"round {r + 1} {name:>10}: gateway {run['gateway']:.2f} ms, client {run['client']:.2f} ms cpu per "
                  f"request ({', '.join(f'{k} {v:.2f}' for k, v in sorted(run['threads'].items()))}; "
                  f"load {os.getloadavg()[0]:.1f})", flush=True)
    for what in ("gateway", "client", "total"):
        for name, rs in runs.items():
            v = [r[what] for r in rs]
            print(f"{what:>7} {name:>10}: mean {statistics.mean(v):.2f}, median {statistics.median(v):.2f}, "
                  f"min {min(v):.2f}, max {max(v):.2f} ms cpu per request over {len(v)} runs")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--arm", action="append", default=[], help="NAME=SRC[,PYTHON]: alternate versions")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.arm:
        print_header(threads=1)
        return _alternate(args)
    if not args.json:
        print_header(threads=1)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="session-loop", daemon=True).start()
    gw = Gateway()
    gw.default = EpisodeSession(_Team(), loop, key="", base_url=gw.url + "/v1", standing=True)
    body = {"model": "Planner", "messages": [{"role": "system", "content": "s" * 200},
                                             {"role": "user", "content": "q" * 300}]}
    with httpx.Client(base_url=gw.url) as client:
        for _ in range(50):
            client.post("/v1/chat/completions", json=body)
        before = _thread_cpu()
        for _ in range(args.requests):
            assert client.post("/v1/chat/completions", json=body).status_code == 200
        after = _thread_cpu()
    gw.shutdown()
    per = {k: 1000 * (after[k] - before.get(k, 0.0)) / args.requests for k in after}
    if args.json:
        print(json.dumps({"gateway": per.get("server", 0) + per.get("session-loop", 0),
                          "client": per.get("MainThread", 0), "total": sum(per.values()), "threads": per}))
        return 0
    print("ms cpu per request: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(per.items())))
    print(f"gateway (server + session loop): {per.get('server', 0) + per.get('session-loop', 0):.2f} ms cpu per request")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
