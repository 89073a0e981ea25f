"""An LLM judge as a task's score function: ``(task, answer) -> {"reward", "correct", ...}``.

``score_batch(pairs)`` judges many answers with one batched greedy generate (``yes_prob``: one batched
forward pass); the rollout scores every episode's final answer this way once the episodes are done
(``masrl.workflows.batch_score``);
calling the judge with one answer (``team.score`` mid-episode) is a batch of one. Replies are cached
by prompt within a step, so the same (question, answer) is judged once.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from masrl.judges.backends import NO_REPLY, Reply
from masrl.judges.config import DEFAULT_TEMPLATES, JudgeOptions, check_template
from masrl.judges.stats import JudgeStats, judged, unjudged
from masrl.judges.verdicts import pairwise_preference, parse_choice, parse_score, parse_yes_no, yes_share
from masrl.types import Task
from masrl.workflows.base import render


def reference_text(gold: Any) -> str:
    """A task's gold answer as the judge reads it: a list of golds joined by `` or ``."""
    if isinstance(gold, (list, tuple)):
        return " or ".join(str(g) for g in gold)
    return "" if gold is None else str(gold)


def _shown(reply: Reply) -> str:
    """A reply as ``judge_output`` records it: its text, and for ``yes_prob`` the two probabilities."""
    text = (reply.text or "")[:200]
    if reply.p_yes is None:
        return text
    return f"{text!r} P(yes)={reply.p_yes:.4f} P(no)={reply.p_no:.4f}"


class JudgeReward:
    """The judge ``reward: {judge: {...}}`` (options: ``masrl.judges.config.JudgeOptions``)."""

    def __init__(self, opts: JudgeOptions, backend, check: Callable | None = None):
        self.opts, self.backend, self.check = opts, backend, check
        self.template = check_template(opts.template or DEFAULT_TEMPLATES[opts.verdict], opts.verdict, "judge")
        self.stats = JudgeStats(backend.endpoint, max_share=opts.max_error_share)
        self._cache: dict[str, Reply] = {}
        self.__name__ = f"judge:{opts.verdict}"

    def __call__(self, task: Task, answer: str | None) -> dict:
        return self.score_batch([(task, answer)])[0]

    def prompts(self, task: Task, answer: str, opponents: Sequence[str] = ()) -> list[str]:
        """One prompt (score, yes_no), or two per opponent (pairwise: the answer as A against the opponent as B,
        then swapped; the opponents are the reference unless others are given). An opponent equal to the
        answer is a tie without a call (no prompt)."""
        reference = reference_text(task.answer)
        if self.opts.verdict == "pairwise":
            out = []
            for other in opponents or [reference]:
                if other != answer:
                    out += [render(self.template, question=task.question, answer_a=answer, answer_b=other),
                            render(self.template, question=task.question, answer_a=other, answer_b=answer)]
            return out
        lo, hi = self.opts.scale
        return [render(self.template, question=task.question, answer=answer, reference=reference,
                       lo=f"{lo:g}", hi=f"{hi:g}")]

    def opponents(self, pairs: Sequence[tuple[Task, str | None]]) -> list[list[str]]:
        """For ``pairwise_against: group``: each answer's opponents, the next ``opponents`` answers of its group
        (the answers to the same task in ``pairs``, in order, cyclically); none (the reference) for an answer
        alone in its group, and for every answer with ``pairwise_against: reference``."""
        out: list[list[str]] = [[] for _ in pairs]
        if self.opts.verdict != "pairwise" or self.opts.pairwise_against != "group":
            return out
        groups: dict[tuple, list[int]] = {}
        for i, (task, answer) in enumerate(pairs):
            if answer is not None:
                groups.setdefault((task.id, task.question), []).append(i)
        for members in groups.values():
            m = len(members)
            for j, i in enumerate(members):
                out[i] = [pairs[members[(j + d) % m]][1] for d in range(1, min(self.opts.opponents, m - 1) + 1)]
        return out

    def score_batch(self, pairs: Sequence[tuple[Task, str | None]]) -> list[dict]:
        start = time.perf_counter()
        opponents = self.opponents(pairs)
        asked = [self.prompts(task, answer, opp) if answer is not None else []
                 for (task, answer), opp in zip(pairs, opponents)]
        todo = list(dict.fromkeys(p for ps in asked for p in ps if p not in self._cache))
        size = self.opts.max_batch_size
        ask = self.backend.yes_probabilities if self.opts.verdict == "yes_prob" else self.backend.complete
        for i in range(0, len(todo), size):
            chunk = todo[i:i + size]
            for prompt, reply in zip(chunk, ask(chunk)):
                self.stats.calls += 1
                if reply.error is not None:
                    self.stats.error(reply.error, timeout=reply.error.startswith(NO_REPLY))
                self._cache[prompt] = reply
        results = [self._result(task, answer, [self._cache[p] for p in ps], ties=self._ties(task, answer, opp))
                   for (task, answer), ps, opp in zip(pairs, asked, opponents)]
        self.stats.seconds += time.perf_counter() - start
        return results

    def _ties(self, task: Task, answer: str | None, opponents: Sequence[str]) -> int:
        """Comparisons of a pairwise answer with an equal opponent (each a tie, 0.5, without a call)."""
        if self.opts.verdict != "pairwise" or answer is None:
            return 0
        return sum(other == answer for other in opponents or [reference_text(task.answer)])

    def _verdict(self, replies: list[Reply], ties: int = 0) -> float | None:
        texts = [r.text or "" for r in replies]
        if self.opts.verdict == "pairwise":  # the mean preference over the comparisons with a verdict
            prefs = [pairwise_preference(parse_choice(texts[i]), parse_choice(texts[i + 1]))
                     for i in range(0, len(texts), 2)]
            prefs = [p for p in prefs if p is not None] + [0.5] * ties
            return sum(prefs) / len(prefs) if prefs else None
        if self.opts.verdict == "yes_no":
            return parse_yes_no(texts[0])
        if self.opts.verdict == "yes_prob":
            reply = replies[0]
            if reply.p_yes is None or reply.p_no is None:
                return None
            return yes_share(reply.p_yes, reply.p_no, self.opts.min_verdict_mass)
        return parse_score(texts[0], *self.opts.scale)

    def _result(self, task: Task, answer: str | None, replies: list[Reply], ties: int = 0) -> dict:
        if answer is None:
            return unjudged(self.stats, self.check, task, answer, "no_answer")
        errors = [r.error for r in replies if r.error is not None]
        if errors:
            return unjudged(self.stats, self.check, task, answer, "judge_error", detail=errors[0])
        value = self._verdict(replies, ties)
        shown = " | ".join(_shown(r) for r in replies)
        if value is None:
            self.stats.no_verdict(shown)
            return unjudged(self.stats, self.check, task, answer, "judge_unparsed", judge_output=shown)
        return {**judged(self.stats, self.check, task, answer, value, self.opts.correct_threshold),
                "judge_output": shown}

    def step_metrics(self) -> dict[str, float]:
        """The step's ``judge/*`` and ``perf/judge_seconds`` metrics; the cache and call budget start afresh."""
        self._cache.clear()
        self.backend.new_step()
        return self.stats.pop()
