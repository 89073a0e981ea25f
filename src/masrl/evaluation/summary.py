"""Team-level metrics of evaluated episodes: avg@n, pass@k, maj@k per bench and per-agent facts."""
from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from masrl.evaluation.metrics import TaskResult, auc, judge_agreement, summarize_groups
from masrl.types import Episode


def summarize_episodes(episodes: Sequence[Episode], ks: Sequence[int], bench: str = "test") -> dict[str, float]:
    """avg@n, pass@k, maj@k over tasks (one value per episode), plus per-agent facts."""
    by_task: dict[int, list[Episode]] = defaultdict(list)
    for e in episodes:
        by_task[e.group_id].append(e)
    results = [TaskResult(task_id=eps[0].task.id, benchmark=bench, correct=[e.correct for e in eps],
                          answers=[e.info.get("pred") for e in eps], rewards=[e.reward for e in eps])
               for _, eps in sorted(by_task.items())]
    summary = dict(summarize_groups(results, ks)[bench])
    summary.update(agent_facts(episodes))
    summary.update(heldout_check(episodes))
    failed = sum(not e.valid for e in episodes)
    if failed:  # episodes whose workflow raised: scored wrong (masrl.rollout.runner)
        summary["episode_errors"] = float(failed)
    return summary


def heldout_check(episodes: Sequence[Episode]) -> dict[str, float]:
    """``heldout_check``: the share of episodes a judge's rule-based check (``reward: {judge: {check: ...}}``)
    found correct, on the same samples as avg@n, and ``heldout_agreement``: how often the judge's correct flag
    equals the check's (``judge_approve_rate``, ``heldout_agreement_right`` / ``_wrong``: on the answers the check
    passes / fails, ``masrl.evaluation.metrics.judge_agreement``); ``judge_score``: their mean reward, and ``heldout_auc`` (when the check both passes and
    fails some): how well that reward ranks the answers the check passes above the others (0.5: chance); empty
    when no episode carries a check."""
    checked = [e for e in episodes if "heldout_correct" in e.info]
    if not checked:
        return {}
    labels = [bool(e.info["heldout_correct"]) for e in checked]
    agree = judge_agreement([bool(e.correct) for e in checked], labels)
    out = {"heldout_check": sum(labels) / len(checked), "judge_score": sum(e.reward for e in checked) / len(checked),
           "judge_approve_rate": agree["approve_rate"], "heldout_agreement": agree["agreement"],
           **{f"heldout_{k}": v for k, v in agree.items() if k.startswith("agreement_")}}
    ranked = auc([e.reward for e in checked], labels)
    if ranked is not None:
        out["heldout_auc"] = ranked
    return out


def agent_facts(episodes: Sequence[Episode]) -> dict[str, float]:
    """Per-agent tokens and calls per episode; where verdicts were judged, the verdict accuracy, approval precision,
    recall (approvals among correct answers) and approvals among wrong answers."""
    out: dict[str, float] = {}
    tokens, calls, refused = defaultdict(int), defaultdict(int), defaultdict(int)
    verdicts = defaultdict(lambda: {"tp": 0, "fp": 0, "fn": 0, "tn": 0})
    for e in episodes:
        for t in e.turns:
            tokens[t.agent] += len(t.response_ids)
            calls[t.agent] += 1
            refused[t.agent] += "refused" in t.info
            if "verdict" in t.info and "judged_correct" in t.info:
                approve = t.info["verdict"] in ("approve", "yes", "correct")
                key = ("tp" if t.info["judged_correct"] else "fp") if approve else \
                      ("fn" if t.info["judged_correct"] else "tn")
                verdicts[t.agent][key] += 1
    n = max(len(episodes), 1)
    for agent in sorted(tokens):
        out[f"agent/{agent}/tokens_per_episode"] = tokens[agent] / n
        out[f"agent/{agent}/calls_per_episode"] = calls[agent] / n
        if refused[agent]:  # prompts over the model's context: invalid turns, nothing generated
            out[f"agent/{agent}/refused_prompts"] = refused[agent]
    for agent, c in verdicts.items():
        judged = sum(c.values())
        out[f"agent/{agent}/verdict_accuracy"] = (c["tp"] + c["tn"]) / judged
        if c["tp"] + c["fp"]:
            out[f"agent/{agent}/approve_precision"] = c["tp"] / (c["tp"] + c["fp"])
        if c["tp"] + c["fn"]:
            out[f"agent/{agent}/approve_recall"] = c["tp"] / (c["tp"] + c["fn"])
        if c["fp"] + c["tn"]:  # approvals among wrong answers: near approve_recall = a rubber stamp
            out[f"agent/{agent}/approve_rate_wrong"] = c["fp"] / (c["fp"] + c["tn"])
    return out
