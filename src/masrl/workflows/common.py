"""What the math team workflows share: the solve prompt, answer parsers, parameter checks, parallel calls.

Used by ``eval_opt``, ``voting``, ``orch_workers``, ``proposers_summarizer`` and ``single`` (one
module each; the first three are the workflows of the policy-sharing study, arXiv 2605.24202,
``proposers_summarizer`` is the MoA ensemble, ``single`` the single-agent baseline).

Every turn records its *slot* in ``turn.info["slot"]``: the index of a parallel same-role agent
(generator 0/1/2, worker 0/1/2, proposer 0/1/2), 0 for roles that act alone. ``Team.call`` numbers
turns in completion order, so the slot is what tells parallel agents apart; the trainer groups
advantages per role (``agent``) or per role slot (``f"{agent}#{slot}"``).

The final answer handed to ``team.finish`` is always the raw text of the deciding turn (the score
function extracts the box itself). Malformed turns are marked ``turn.valid = False``; the episode
goes on with the fallback documented per workflow. See docs/workflows.md.

Prompt fields are passed scalar fields first and model/task text last: ``render`` substitutes one
field after another, so a placeholder name inside an already inserted text (``a_{n}`` in a
question) would otherwise be substituted too.
"""
from __future__ import annotations

import asyncio
import re
from collections import Counter
from typing import Any

from masrl.errors import ConfigError
from masrl.types import Turn
from masrl.workflows.base import Team
from masrl.workflows.parsing import extract_boxed

SOLVE_PROMPT = ("Solve the following math problem. Reason step by step, and put your final answer "
                "within \\boxed{}.\n\nProblem: {question}")


def _strip_latex_text(s: str) -> str:
    r"""``\text{Correct}`` / ``\textbf{ 2 }`` / ``\mathrm{x}`` -> their content; other text unchanged."""
    prev = None
    while prev != s:
        prev = s
        s = re.sub(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox)\s*\{([^{}]*)\}", r"\1", s)
    return s.strip()


def parse_verdict(text: object) -> str | None:
    r"""``"correct"`` / ``"incorrect"`` from the last ``\boxed{...}``, or None when unparsable.

    Case-insensitive; ``\text{}`` wrappers, spaces and trailing punctuation are ignored.
    """
    boxed = extract_boxed(text)
    if boxed is None:
        return None
    word = _strip_latex_text(boxed).strip().strip(".!*").strip().lower()
    return word if word in ("correct", "incorrect") else None


def parse_index(text: object, n: int) -> int | None:
    r"""The 1-based choice in the last ``\boxed{...}`` if it is an integer in 1..n, else None.

    Accepts ``\boxed{2}``, ``\boxed{\text{2}}``, ``\boxed{Solution 2}``, ``\boxed{#2}``.
    """
    boxed = extract_boxed(text)
    if boxed is None:
        return None
    m = re.fullmatch(r"(?:(?:solution|response|candidate)\s*)?#?\s*(\d+)\s*\.?", _strip_latex_text(boxed),
                     flags=re.IGNORECASE)
    if m is None:
        return None
    index = int(m.group(1))
    return index if 1 <= index <= n else None


_SUBTASK_LINE = re.compile(r"^[\s>*_#-]*SUBTASK\s*(\d+)\s*[*_]*\s*[:.)\-]\s*[*_]*\s*(.*?)\s*$", re.IGNORECASE)


def parse_subtasks(text: object, max_subtasks: int = 3) -> list[str]:
    """Subtasks from lines ``SUBTASK k: description`` (k = 1..max_subtasks), in the order of k.

    Case-insensitive; markdown bullets/bold around the label are tolerated. The description is the
    rest of that line. Lines with k outside 1..max_subtasks, empty descriptions and repeated k
    (after the first) are ignored. Never raises; garbage gives ``[]``.
    """
    if not isinstance(text, str):
        return []
    found: dict[int, str] = {}
    for line in text[-200_000:].splitlines():
        m = _SUBTASK_LINE.match(line)
        if m is None:
            continue
        k, desc = int(m.group(1)), m.group(2).strip()
        if 1 <= k <= max_subtasks and desc and k not in found:
            found[k] = desc
    return [found[k] for k in sorted(found)]


def normalize_answer(answer: str | None) -> str | None:
    r"""A light normal form for voting: no spaces, no ``\text{}``/``\left``/``\right``/``$``, lowercase."""
    if answer is None:
        return None
    s = _strip_latex_text(answer)
    s = re.sub(r"\\left|\\right|\$|\s+", "", s).rstrip(".").lower()
    return s or None


def majority_vote(answers: list[str | None]) -> int | None:
    """Index of the first answer of the most common (normalized) non-None answer; ties -> earliest."""
    normal = [normalize_answer(a) for a in answers]
    counts = Counter(a for a in normal if a is not None)
    if not counts:
        return None
    top = max(counts.values())
    for i, a in enumerate(normal):
        if a is not None and counts[a] == top:
            return i
    return None  # pragma: no cover


def require_box(turn: Turn) -> str | None:
    """Mark ``turn`` invalid when it has no ``\\boxed{}``; return the boxed content."""
    answer = extract_boxed(turn.text)
    turn.valid = answer is not None
    turn.info["answer"] = answer
    return answer


def require_answer(team: Team, turn: Turn) -> str | None:
    """``answer_format: boxed`` (math) needs ``\\boxed{}``; ``code`` needs a fenced code block."""
    fmt = choice_param(team, "answer_format", ("boxed", "code"))
    if fmt == "boxed":
        return require_box(turn)
    from masrl.codecheck.extract import extract_code

    has_block = isinstance(turn.text, str) and "```" in turn.text
    turn.valid = has_block
    turn.info["answer"] = extract_code(turn.text) if has_block else None
    return turn.info["answer"]


def check_params(team: Team) -> None:
    """Unknown parameter names are an error (a typo must not silently fall back to a default)."""
    unknown = sorted(set(team.params) - set(team.spec.params))
    if unknown:
        raise ConfigError(f"workflow {team.spec.name!r}: unknown param(s) {unknown}; "
                          f"known: {sorted(team.spec.params)}")


def positive_int(team: Team, key: str, low: int = 1, high: int | None = None) -> int:
    value = team.params.get(key)
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"workflow {team.spec.name!r}: param {key!r} must be an integer, got {value!r}") from None
    if n < low or (high is not None and n > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise ConfigError(f"workflow {team.spec.name!r}: param {key!r} must be {bound}, got {n}")
    return n


def choice_param(team: Team, key: str, choices: tuple[str, ...]) -> str:
    value = str(team.params.get(key)).lower()
    if value not in choices:
        raise ConfigError(f"workflow {team.spec.name!r}: param {key!r} must be one of {list(choices)}, "
                          f"got {team.params.get(key)!r}")
    return value


def judge_correct(team: Team, text: str | None) -> bool | None:
    """Ground-truth correctness of an intermediate answer (for verdict accuracy), if the team can score."""
    score = getattr(team, "score", None)
    if score is None:
        return None
    result = score(text)
    return bool(result["correct"]) if "correct" in result else float(result["reward"]) >= 1.0


async def parallel_calls(team: Team, agent: str, prompts: list[str]) -> list[Turn]:
    """Call ``agent`` once per prompt concurrently; turn i gets ``info["slot"] = i``."""
    turns = await asyncio.gather(*(team.call(agent, p) for p in prompts))
    for slot, turn in enumerate(turns):
        turn.info["slot"] = slot
    return list(turns)


def numbered(team: Team, template: str, texts: list[str], **extra: Any) -> str:
    return "".join(team.render(template, index=i + 1, **{k: v[i] for k, v in extra.items()}, text=t)
                   for i, t in enumerate(texts))
