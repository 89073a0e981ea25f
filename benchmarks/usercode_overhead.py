"""Per-call cost of the user-code contract: a trivial reward and a trivial tool, called directly and through
masrl's runner of user code (``masrl.usercode.calls.call_in_thread``: the code's worker thread, reused by calls one
after another, for a reward's thread mode and a tool alike; a reward's worker process).

    PYTHONPATH=src python3 benchmarks/usercode_overhead.py --calls 2000

Each figure is the median over ``--repeats`` runs of ``--calls`` calls in a row, in microseconds per call, minus
nothing (the direct call is its own row). Run it with an older checkout's ``src`` on PYTHONPATH to compare
(the script finds the runner under its old module paths too).
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _benchutil import print_header

REWARD = "def reward(task, episode):\n    return 1.0\n"


def _per_call_us(fn, calls: int, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(runs)


def _per_async_call_us(one, calls: int, repeats: int) -> float:
    async def many():
        for _ in range(calls):
            await one()

    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        asyncio.run(many())
        runs.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(runs)


def _guard():
    try:
        from masrl.usercode import guard, process
    except ImportError:  # an older checkout
        from masrl.tasks import reward_guard as guard, reward_process as process
    return guard, process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print_header()
    import masrl
    from masrl.tools import Tool, ToolBox
    from masrl.tools.parsing import ToolCall
    from masrl.types import Episode, Task, Turn

    guard, process = _guard()
    task = Task(id="t", question="q", answer="a")
    episode = Episode(task=task, turns=[Turn(agent="A", policy="p", prompt_ids=[1], response_ids=[2], logprobs=[-1.0],
                                             text="x", prompt_text="q")], reward=0.0, answer="a")

    def reward(task, episode):
        return 1.0

    def echo(text: str) -> str:
        """Return the text.

        Args:
            text: the text to return.
        """
        return text

    box = ToolBox([Tool(echo)])
    call = ToolCall("echo", {"text": "hi"})
    rows = [("reward, direct call", _per_call_us(lambda: reward(task, episode), args.calls, args.repeats)),
            ("reward, thread mode (its worker thread, deadline)",
             _per_call_us(lambda: guard.call_with_deadline("bench", reward, (task, episode), 10.0), args.calls,
                          args.repeats))]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench_reward.py"
        path.write_text(REWARD)
        worker = process.RewardProcess("bench", ("spec", f"{path}:reward"))
        worker.call(task, episode, 60.0)  # started (and the module imported) before timing
        rows.append(("reward, process mode (its worker process, deadline)",
                     _per_call_us(lambda: worker.call(task, episode, 10.0), args.calls, args.repeats)))
        worker.stop()
    rows += [("tool, direct call", _per_call_us(lambda: box.observe(echo(text="hi")), args.calls, args.repeats)),
             ("tool, ToolBox.run (the tool's worker thread, deadline)",
              _per_call_us(lambda: box.run(call), args.calls, args.repeats))]
    arms = [("tool, asyncio.to_thread(ToolBox.run) on an event loop (team.chat's way before ToolBox.arun)",
             lambda: asyncio.to_thread(box.run, call))]
    if hasattr(box, "arun"):
        arms.append(("tool, ToolBox.arun on an event loop (team.chat: worker threads, deadline)",
                     lambda: box.arun(call)))
    for name, one in arms:
        rows.append((name, _per_async_call_us(one, args.calls, args.repeats)))
    print(f"masrl from {Path(masrl.__file__).parent}; python {sys.version.split()[0]}")
    print(f"{args.calls} calls x {args.repeats} repeats, median µs per call\n")
    print("| call | µs per call |\n|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.1f} |")


if __name__ == "__main__":
    main()
