"""CPU per request of the gateway's HTTP serving alone: a standing session whose team answers at once, one
keep-alive client (httpx) posting chat completions in a loop; the CPU of each thread per request (the client,
the gateway's server thread(s), the session's loop). Only the public interface (Gateway, EpisodeSession), so the
same script measures any version of the gateway (PYTHONPATH=... of the sources to measure).

    PYTHONPATH=src python3 benchmarks/gateway_request_cost.py --requests 1000
"""
from __future__ import annotations

import argparse
import asyncio
import os
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1000)
    args = p.parse_args()
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
    print("ms cpu per request: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(per.items())))
    print(f"gateway (server + session loop): {per.get('server', 0) + per.get('session-loop', 0):.2f} ms cpu per request")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
