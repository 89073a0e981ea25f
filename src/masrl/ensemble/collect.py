"""``masrl ensemble collect``: run your proposers -> summarizer team on benchmark tasks and write
each proposer's answer as an ensemble predictions file (the JSONL read by ``masrl.ensemble.data``).

The team is built exactly as ``masrl eval`` builds it (config + dotted overrides, optional trained
checkpoint, ``masrl.team_runner.TeamRunner.benches`` for the tasks, their score function and
the rollout). The workflow must record the proposers' answers in
``episode.info["proposals"]`` (one entry per proposer slot, as ``proposers_summarizer`` does).

One row per (task, sample)::

    {"id": "test/arith/test/0", "task": "test", "label": "12",
     "predictions": {"Proposer#0@team": {"answer": "12", "correct": 1},
                     "Proposer#1@team": {"answer": "13", "correct": 0}, ...},
     "task_id": "arith/test/0", "summarizer_answer": "12", "summarizer_correct": 1}

* model name = ``<agent>#<slot>@<policy>`` of the proposer turn (stable across rows);
* ``correct`` = the bench's score function on the proposer's full response (as the team's final
  answer is scored);
* ``answer`` is a voting key: the gold label itself when the proposal is scored correct (so that
  equivalent right answers such as ``0.5`` and ``1/2`` vote together and ``answer == label`` agrees
  with ``correct``), otherwise the light normal form of the extracted answer (``None`` = no answer);
* the summarizer's answer and correctness are top-level scalar fields (kept in
  ``EnsembleData.extras``), not a model: it is not a proposer, and as a pool member every selector,
  oracle and vote would count it.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from masrl.ensemble.data import InputError
from masrl.io.atomic import write_text_atomic
from masrl.paths import check_output_file
from masrl.types import Episode, Task

__all__ = ["WORKFLOWS_WITH_PROPOSALS", "check_workflow", "proposer_slots", "episode_rows", "collect",
           "write_jsonl", "cmd_collect"]

#: built-in workflows that record ``episode.info["proposals"]``; other built-ins are refused up front.
WORKFLOWS_WITH_PROPOSALS = ("proposers_summarizer",)

_HOW_TO = ("ensemble collect needs a proposers -> summarizer team: set workflow.name: proposers_summarizer "
           "(agents Proposer and Summarizer), or have your own workflow call "
           "team.finish(..., proposals=[each proposer's answer, in slot order])")


def _no_proposals(where: str, name: str, detail: str = "") -> ValueError:
    from masrl.errors import ConfigError

    return ConfigError(f"{where}: workflow {name!r} records no proposals (episode.info['proposals']{detail}); "
                       + _HOW_TO)


def check_workflow(spec, where: str) -> None:
    """Refuse a built-in workflow that records no proposals, before any model is loaded."""
    module = getattr(spec.fn, "__module__", "") or ""
    if module.startswith("masrl.") and spec.name not in WORKFLOWS_WITH_PROPOSALS:
        raise _no_proposals(where, spec.name)


def proposer_slots(episode: Episode) -> list[tuple[str, str | None]]:
    """``(model name, full response text)`` per entry of ``episode.info["proposals"]``.

    The proposer turns are the turns of the agents other than the one that acted last (the
    summarizer), ordered by ``turn.info["slot"]``; name ``<agent>#<slot>@<policy>``. If they cannot
    be matched one-to-one with the proposals, names fall back to ``proposer#<i>`` and the text to
    ``None`` (the proposal is then scored as ``\\boxed{proposal}``).
    """
    proposals = episode.info["proposals"]
    final_agent = episode.turns[-1].agent if episode.turns else None
    turns = [t for t in episode.turns if t.agent != final_agent]
    turns.sort(key=lambda t: (t.info.get("slot", 0), t.turn_index))
    if len(turns) == len(proposals) and len({(t.agent, t.info.get("slot", 0)) for t in turns}) == len(turns):
        return [(f"{t.agent}#{t.info.get('slot', 0)}@{t.policy}", t.text) for t in turns]
    return [(f"proposer#{i}", None) for i in range(len(proposals))]


def _json_label(value: Any) -> Any:
    """The task's gold answer as a JSON value the loader accepts (scalars, lists of scalars)."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, int, float, bool)) or v is None for v in value):
        return list(value)
    return str(value)


def _is_correct(result: dict) -> bool:
    return bool(result["correct"]) if "correct" in result else float(result["reward"]) >= 1.0


def episode_rows(episodes: Sequence[Episode], score: Callable[[Task, str | None], dict], *, bench: str,
                 n_samples: int = 1, where: str = "config", workflow: str = "in use") -> tuple[list[dict], dict]:
    """Prediction rows (see module doc), one per episode, and facts about the collection.

    ``episodes`` are in task order with ``n_samples`` consecutive episodes per task (as
    ``masrl.rollout.runner.repeat_tasks`` makes them). Raises ``ValueError`` if an episode has
    no proposals or the proposer set changes between episodes.
    """
    from masrl.ensemble.data import answer_key as _vocab_key
    from masrl.workflows.common import normalize_answer

    rows: list[dict] = []
    models: list[str] | None = None
    conflicts = 0
    for i, ep in enumerate(episodes):
        proposals = ep.info.get("proposals")
        if not isinstance(proposals, (list, tuple)) or not proposals:
            raise _no_proposals(where, workflow,
                                f" of task {ep.task.id!r} is {'missing' if proposals is None else repr(proposals)}")
        slots = proposer_slots(ep)
        names = [name for name, _ in slots]
        if models is None:
            models = names
        elif names != models:
            raise InputError(f"task {ep.task.id!r}: proposers {names} differ from the first task's {models}; "
                             "every episode must have the same proposers")
        label = _json_label(ep.task.answer)
        preds = {}
        for (name, text), proposal in zip(slots, proposals):
            if text is None:
                text = None if proposal is None else f"\\boxed{{{proposal}}}"
            result = score(ep.task, text)
            ok = _is_correct(result)
            if ok and label is not None:
                answer = label
            else:
                pred = result.get("pred") if result.get("pred") is not None else proposal
                answer = normalize_answer(pred) if isinstance(pred, str) else _json_label(pred)
                if not ok and answer is not None and label is not None and _vocab_key(answer) == _vocab_key(label):
                    answer, conflicts = None, conflicts + 1  # scored wrong but spelled like the label
            preds[name] = {"answer": answer, "correct": int(ok)}
        sample = i % n_samples
        row = {"id": f"{bench}/{ep.task.id}" + (f"#{sample}" if n_samples > 1 else ""), "task": bench,
               "label": label, "predictions": preds, "task_id": str(ep.task.id)}
        if n_samples > 1:
            row["sample"] = sample
        summary = ep.info.get("pred") if ep.info.get("pred") is not None else ep.info.get("summary_answer")
        row["summarizer_answer"] = summary if summary is None or isinstance(summary, (str, int, float)) else str(summary)
        row["summarizer_correct"] = int(ep.correct)
        rows.append(row)
    return rows, {"models": models or [], "conflicts": conflicts}


def write_jsonl(rows: Sequence[dict], path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def _bench_name(bench: str) -> str:
    return Path(bench).stem if Path(bench).suffix else bench


def collect(cfg, benches: Sequence[str], *, limit: int | None = None, n_samples: int = 1, seed: int | None = None,
            temperature: float | None = None, checkpoint: str | None = None, strict: bool = False,
            where: str = "config") -> tuple[list[dict], dict]:
    """Run the configured team on ``benches`` and return ``(rows, facts)`` (see ``episode_rows``)."""
    from masrl.team_runner import TeamRunner
    from masrl.workflows.base import get_workflow

    if n_samples < 1:
        raise InputError(f"--n-samples must be >= 1, got {n_samples}")
    check_workflow(get_workflow(cfg.workflow.name), where)
    with TeamRunner(cfg, progress=False) as team:  # a Ray runtime's workers end with the collection
        ckpt_path = team.load_checkpoint(checkpoint) if checkpoint else None
        rows: list[dict] = []
        facts: dict[str, Any] = {"models": None, "conflicts": 0, "checkpoint": str(ckpt_path) if ckpt_path else None,
                                 "benches": {}}
        for run in team.benches(benches, n=n_samples, seed=cfg.seed if seed is None else seed,
                                limit=limit or cfg.eval.limit, temperature=temperature, strict=strict,
                                error=InputError):
            bench = run.bench
            bench_rows, f = episode_rows(run.episodes, run.score, bench=_bench_name(bench), n_samples=n_samples,
                                         where=where, workflow=cfg.workflow.name)
            if facts["models"] is not None and f["models"] != facts["models"]:
                raise InputError(f"--bench {bench}: proposers {f['models']} differ from {facts['models']}")
            facts["models"] = f["models"]
            facts["conflicts"] += f["conflicts"]
            facts["benches"][_bench_name(bench)] = len(run.tasks)
            rows.extend(bench_rows)
    ids = [r["id"] for r in rows]
    if len(set(ids)) != len(ids):
        raise InputError("duplicate row ids: give each benchmark once in --bench")
    return rows, facts


def cmd_collect(args) -> int:
    """``masrl ensemble collect CONFIG [overrides] --bench B [--limit N] [--out FILE] ...``."""
    from masrl.config import load_config
    from masrl.ensemble import report as rep
    from masrl.ensemble.data import load_jsonl
    from masrl.models.hub import ModelLoadError
    from masrl.tasks.math_data import DatasetLoadError
    from masrl.training.checkpoint import CheckpointError

    cfg = load_config(args.config, args.overrides)
    benches = [b.strip() for b in args.bench.split(",") if b.strip()]
    if not benches:
        raise InputError("--bench: give at least one benchmark ('test' = the task's held-out split)")
    if args.out:
        check_output_file(args.out, "--out")
    try:
        rows, facts = collect(cfg, benches, limit=args.limit, n_samples=args.n_samples, seed=args.seed,
                              temperature=args.temperature, checkpoint=args.checkpoint, strict=args.strict,
                              where=str(args.config))
    except (ModelLoadError, DatasetLoadError, CheckpointError) as e:
        raise InputError(str(e)) from e
    if args.out:
        out = Path(args.out)
    else:
        stem = "_".join(facts["benches"])
        ckpt = facts["checkpoint"]
        out = (Path(ckpt).parents[1] if ckpt else Path("runs")) / "ensemble" / f"{stem}.jsonl"
    write_jsonl(rows, out)
    data = load_jsonl(out)  # the file must load back exactly as written
    head = ["model", "accuracy"]
    table = [[m, rep.pct(float(a))] for m, a in zip(data.models, data.accuracy())]
    table.append(["oracle (any proposer right)", rep.pct(float(data.correct.any(axis=1).mean()))])
    summ = data.extras.get("summarizer_correct")
    if summ is not None:
        table.append(["summarizer (team answer)", rep.pct(sum(int(v) for v in summ) / max(len(summ), 1))])
    rep.print_table(f"ensemble collect: {data.n} rows, {data.n_models} proposers "
                    f"({', '.join(f'{b}: {n} tasks' for b, n in facts['benches'].items())}"
                    f"{f', {args.n_samples} samples each' if args.n_samples > 1 else ''})", head, table)
    if facts["conflicts"]:
        print(f"note: {facts['conflicts']} proposal(s) scored wrong although spelled like the label; "
              "written as answer null", file=sys.stderr)
    print(f"wrote {out}  (next: masrl ensemble select --data {out} --method forward --k 2)")
    return 0
