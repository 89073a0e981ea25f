"""Dr. MAS search workflow: a Verifier routes each turn to the Search agent or the Answer agent.

Turn t = 1..max_turns:
  1. Verifier reads the question and the search history -> ``<verify>yes|no</verify>``.
  2. ``no`` and t < max_turns: Search writes ``<search>query</search>``; the retriever's top-k
     passages join the history as ``<information>Doc 1: ...</information>``.
     ``no`` at t == max_turns: the episode ends without an answer (reward 0), as in the reference.
  3. ``yes``: Answer writes ``<answer>...</answer>`` and the episode ends.

Invalid turns (``turn.valid = False``; the trainer applies the format penalty): a Verifier
reply without a yes/no tag (read as ``untagged_verdict`` while turns remain, as
``untagged_last_turn`` at the last turn), a Search reply without a non-empty ``<search>`` tag
(nothing is retrieved; the history records an empty step), an Answer reply without
``<answer>`` (the answer is None).

Parameters (``team.params``): ``retriever`` (an object with ``search(queries, topk)`` or a spec
for ``masrl.retrieval.build_retriever``), ``topk``, ``max_turns``,
``history_length``, ``untagged_verdict``, ``untagged_last_turn``, ``doc_format``.
Prompts are the templates below (``Verifier``, ``Search``, ``Answer`` and the shared
``context`` / ``history`` / ``history_step``), each overridable from the config.
"""
from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass, field

import masrl.tasks.synthetic_kb  # noqa: F401 - registers the "synthetic_kb" retriever spec
from masrl.errors import ConfigError
from masrl.retrieval import Passage, format_passages, resolve_retriever
from masrl.types import Episode, Task
from masrl.workflows.base import Team, register_workflow
from masrl.workflows.base import render as fill  # one-pass {field} filling
from masrl.workflows.parsing import extract_tag, parse_choice

CONTEXT_PROMPT = """You are a member of a team of agents answering a question with the help of a search engine.
Question: {question}
{history}"""

HISTORY_PROMPT = """The team has taken {step_count} step(s) so far. Search history (<search> holds a query, <information> what the search engine returned):
{steps}
"""

HISTORY_STEP_PROMPT = "Step {step}: <search>{query}</search> <information>{information}</information>"

VERIFIER_PROMPT = """{context}You are the Verifier. Decide whether the information above is enough to answer the question. This is step {step} of {max_turns}.
First think inside <think> </think>. Then give your decision: <verify>yes</verify> if the information is sufficient, <verify>no</verify> if another search is needed."""

SEARCH_PROMPT = """{context}The Verifier found the information insufficient:
{verifier_output}
You are the Search agent. Write one search query for the missing information.
First think inside <think> </think>. Then write the query as <search>query</search>."""

ANSWER_PROMPT = """{context}You are the Answer agent. Answer the question using the information above.
First think inside <think> </think>. Then give only the final answer, as short as possible, inside <answer> </answer>. For example, <answer>Beijing</answer>."""

SEARCH_PROMPTS = {
    "Verifier": VERIFIER_PROMPT,
    "Search": SEARCH_PROMPT,
    "Answer": ANSWER_PROMPT,
    "context": CONTEXT_PROMPT,
    "history": HISTORY_PROMPT,
    "history_step": HISTORY_STEP_PROMPT,
}

# Short templates for tiny models (e.g. a character-level policy on the synthetic KB):
# pass them as the workflow's prompt overrides.
COMPACT_PROMPTS = {
    "Verifier": "{context}Enough info? <verify>yes</verify> or <verify>no</verify>.",
    "Search": "{context}Search: <search>query</search>.",
    "Answer": "{context}Answer: <answer>answer</answer>.",
    "context": "Q: {question}\n{history}",
    "history": "{steps}\n",
    "history_step": "<search>{query}</search> <information>{information}</information>",
}

SEARCH_PARAMS = {
    "retriever": None,
    "topk": 3,
    "max_turns": 4,
    "history_length": 4,
    "untagged_verdict": "no",     # an untagged Verifier reply while turns remain
    "untagged_last_turn": "yes",  # ... and at the last turn (yes: the Answer agent still answers)
    "doc_format": "Doc {rank}: {contents}",
}

VERDICTS = ("yes", "no")


@dataclass
class SearchStep:
    """One entry of the search history: the query (None when the Search turn was invalid)."""

    step: int
    query: str | None
    passages: list[Passage] = field(default_factory=list)


def render_history(team: Team, history: list[SearchStep], history_length: int, doc_format: str) -> str:
    """The last ``history_length`` steps, ``Step k: <search>q</search> <information>...</information>``."""
    shown = history[-history_length:] if history_length > 0 else []
    if not shown:
        return ""
    lines = [fill(team.prompts["history_step"], step=s.step, query=s.query or "",
                  information=format_passages(s.passages, doc_format) if s.passages else "")
             for s in shown]
    return fill(team.prompts["history"], step_count=len(history), steps="\n".join(lines))


async def run_search(retriever, query: str, topk: int) -> list[Passage]:
    """One query through the retriever, off the event loop (other episodes keep running)."""
    asearch = getattr(retriever, "asearch", None)
    if asearch is not None and inspect.iscoroutinefunction(asearch):
        results = await asearch([query], topk)
    else:
        results = await asyncio.to_thread(retriever.search, [query], topk)
    return list(results[0]) if results else []


def _check_params(p: dict, need_retriever: bool = True) -> None:
    """The workflow's params. At start a retriever the task supplies (``synthetic_kb``, the search QA tasks:
    ``register_task(..., supplies=("retriever",))``) stands in as set; ``need_retriever=False`` when the task does
    not say what it supplies (an entry-point task without ``supplies``: each episode checks it again)."""
    for key in ("untagged_verdict", "untagged_last_turn"):
        if p[key] not in VERDICTS:
            raise ConfigError(f"search_verifier_router: {key} must be 'yes' or 'no', got {p[key]!r}")
    for key in ("max_turns", "topk"):
        if not isinstance(p[key], int) or p[key] < 1:
            raise ConfigError(f"search_verifier_router: {key} must be an integer >= 1, got {p[key]!r}")
    if not isinstance(p["history_length"], int) or p["history_length"] < 0:
        raise ConfigError(f"search_verifier_router: history_length must be an integer >= 0, got {p['history_length']!r}")
    if need_retriever and p["retriever"] is None:
        raise ConfigError("search_verifier_router needs params['retriever']: an object with "
                          "search(queries, topk), a corpus path, 'synthetic_kb', a URL, or {'type': ..., ...}")


@register_workflow("search_verifier_router", agents=("Verifier", "Search", "Answer"), prompts=SEARCH_PROMPTS,
                   params=SEARCH_PARAMS, check=lambda team: _check_params({**SEARCH_PARAMS, **team.params},
                                                                          team.task_supplies is not None))
async def search_verifier_router(task: Task, team: Team) -> Episode:
    """Dr. MAS search: Verifier routes to Search (<search>) or Answer (<answer>), up to max_turns."""
    p = {**SEARCH_PARAMS, **team.params}
    _check_params(p)
    retriever = resolve_retriever(p["retriever"])
    max_turns = p["max_turns"]
    history: list[SearchStep] = []
    verdicts: list[str] = []
    answer: str | None = None
    stop = "turn_limit"

    for step in range(1, max_turns + 1):
        context = fill(team.prompts["context"], question=task.question,
                       history=render_history(team, history, p["history_length"], p["doc_format"]))
        last = step == max_turns

        verifier = await team.call("Verifier", fill(team.prompts["Verifier"], step=step, max_turns=max_turns,
                                                    context=context))
        verdict = parse_choice(verifier.text, "verify", VERDICTS)
        if verdict is None:
            verifier.valid = False
            verdict = p["untagged_last_turn"] if last else p["untagged_verdict"]
        verifier.info.update(step=step, verdict=verdict)
        verdicts.append(verdict)

        if verdict == "yes":
            turn = await team.call("Answer", fill(team.prompts["Answer"], step=step, max_turns=max_turns,
                                                  context=context))
            answer = extract_tag(turn.text, "answer")
            if answer is None:
                turn.valid = False
            turn.info.update(step=step, answer=answer)
            stop = "answer"
            break
        if last:
            break

        turn = await team.call("Search", fill(team.prompts["Search"], step=step, max_turns=max_turns,
                                              verifier_output=verifier.text.strip(), context=context))
        query = extract_tag(turn.text, "search")
        if not query:
            turn.valid = False
            history.append(SearchStep(step, None))
        else:
            history.append(SearchStep(step, query, await run_search(retriever, query, p["topk"])))
        turn.info.update(step=step, query=query or None, passages=[x.id for x in history[-1].passages])

    return team.finish(answer, stop=stop, steps=len(verdicts), verdicts=verdicts,
                       num_searches=sum(s.query is not None for s in history),
                       queries=[s.query for s in history])
