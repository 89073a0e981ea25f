"""Fact checks over the synthetic knowledge base: data to train a yes/no judge with masrl itself.

Each row is a judge prompt, the judge template rendered with a knowledge-base question, its reference
answer and a candidate answer; the row's gold answer is the verdict, ``yes`` or ``no``::

    Question: Bulzi lives in?
    Reference answer: Kovar
    Answer: kovar
    Does the answer name the same thing as the reference? Reply yes or no.        -> yes

Candidates come in equal numbers of right and wrong ones: for every question, ``pairs`` pairs of one
right and one wrong candidate, each of a kind drawn at random.

- right (``yes``): the reference itself; a case variant (``kovar``, ``KOVAR``); a whitespace or
  punctuation variant (`` Kovar``, ``Kovar.``); the reference inside a sentence (``Bulzi lives in Kovar.``,
  ``It is Kovar.``). All of them name the reference, and exact match (``qa_em``) passes all but the
  sentences.
- wrong (``no``): another entity of the same type (another city for a city); an entity of another type
  (the question's subject, a company for a city); a near miss of the reference (a letter dropped, added
  or changed at its start, middle or end); a wrong entity inside a sentence or in another case; letters
  that name nothing.

The questions are the knowledge base's own (``masrl.tasks.synthetic_kb``, same generator arguments and
split): the train rows use only training questions, the test rows only held-out ones, so a judge trained
on the train rows has never seen the held-out people a team is evaluated on (with ``split_by: person``).

The reward is whether the reply's first standalone yes/no (``masrl.tasks.parsing.parse_yes_no``) equals the
gold verdict: 1 or 0; a reply without one is 0 with ``reason: no_verdict``.
"""
from __future__ import annotations

import random
from typing import Any, Mapping

from masrl.errors import ConfigError
from masrl.tasks.parsing import parse_yes_no
from masrl.tasks.synthetic_kb import ONSETS, VOWELS, SyntheticKB, kb_args, generate_kb
from masrl.types import Task

# the judge template of the judge example (examples/judge_kb_team.yaml)
DEFAULT_TEMPLATE = ("Question: {question}\nReference answer: {reference}\nAnswer: {answer}\nDoes the answer name "
                    "the same thing as the reference? Reply yes or no.")
RIGHT_KINDS = ("same", "case", "spacing", "sentence")
WRONG_KINDS = ("other_same_type", "other_type", "near_miss", "wrong_sentence", "wrong_case", "nonsense")
ANSWER_TYPE = {"lives_in": "city", "based_in": "city", "employer_based_in": "city", "works_for": "company",
               "led_by": "person", "employer_led_by": "person"}
LETTERS = ONSETS + VOWELS


def entity_pools(kb: SyntheticKB, split: str) -> dict[str, list[str]]:
    """The entity names wrong candidates are drawn from, by type: ``city``, ``company``, ``person``; for the train
    split without the held-out questions' subjects (the people a team is evaluated on, with ``split_by: person``)."""
    hidden = {t.meta["subject"] for t in kb.splits["test"]} if split == "train" else set()
    return {"city": sorted(kb.cities), "company": sorted(kb.companies),
            "person": sorted(p for p in kb.people if p not in hidden)}


def near_miss(name: str, rng: random.Random) -> str:
    """``name`` with one letter dropped, added or changed at its start, middle or end (never equal to it in any
    case): "Kovar" -> "Ovar", "Kova", "Kovars", "Bovar", "Kobar"."""
    while True:
        low = name.lower()
        i = rng.choice([0, len(low) // 2, len(low) - 1])
        edit = rng.choice(("drop", "add", "change"))
        if edit == "drop":
            out = low[:i] + low[i + 1:]
        elif edit == "add":
            out = low[:i + 1] + rng.choice(LETTERS) + low[i + 1:] if i else rng.choice(LETTERS) + low
        else:
            out = low[:i] + rng.choice(LETTERS.replace(low[i], "")) + low[i + 1:]
        if out and out != low:
            return out.capitalize()


def sentence(question: str, name: str, rng: random.Random) -> str:
    """``name`` inside a sentence: the cloze question completed ("Bulzi lives in Kovar."), else a stock one."""
    if question.endswith("?") and rng.random() < 0.5 and not question.startswith(("Where", "Who")):
        return f"{question[:-1]} {name}."
    return rng.choice(("It is {}.", "The answer is {}.", "{}, I think.", "I believe it is {}.")).format(name)


def right_candidate(kind: str, question: str, reference: str, rng: random.Random) -> str:
    if kind == "same":
        return reference
    if kind == "case":
        return rng.choice((reference.lower(), reference.upper()))
    if kind == "spacing":
        return rng.choice((f" {reference}", f"{reference} ", f"{reference}.", f"  {reference}"))
    return sentence(question, reference, rng)


def wrong_candidate(kind: str, question: str, reference: str, subject: str, pools: Mapping[str, list[str]],
                    answer_type: str, rng: random.Random) -> str:
    same = [n for n in pools[answer_type] if n != reference]
    if kind == "other_same_type":
        return rng.choice(same)
    if kind == "other_type":
        others = [n for t, names in pools.items() if t != answer_type for n in names if n != reference]
        return subject if rng.random() < 0.3 else rng.choice(others)
    if kind == "near_miss":
        return near_miss(reference, rng)
    if kind == "wrong_sentence":
        return sentence(question, rng.choice(same), rng)
    if kind == "wrong_case":
        return rng.choice(same).lower()
    while True:  # letters that name nothing
        out = "".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 8)))
        if out != reference.lower():
            return out


def fact_check_rows(questions: list[Task], kb: SyntheticKB, *, template: str, pairs: int, seed: int,
                    split: str) -> list[Task]:
    """``pairs`` (right, wrong) rows per question, in question order; reproducible in ``seed``."""
    rng = random.Random(f"fact-check-{seed}-{split}")
    pools = entity_pools(kb, split)
    rows: list[Task] = []
    for q in questions:
        reference, relation = q.answer[0], q.meta["relation"]
        subject = str(q.meta.get("subject", ""))
        for p in range(pairs):
            kind_right, kind_wrong = rng.choice(RIGHT_KINDS), rng.choice(WRONG_KINDS)
            candidates = [("yes", kind_right, right_candidate(kind_right, q.question, reference, rng)),
                          ("no", kind_wrong, wrong_candidate(kind_wrong, q.question, reference, subject, pools,
                                                             ANSWER_TYPE[relation], rng))]
            rng.shuffle(candidates)
            for verdict, kind, candidate in candidates:
                rows.append(Task(
                    id=f"{q.id}-check{p}-{verdict}",
                    question=template.format(question=q.question, reference=reference, answer=candidate),
                    answer=[verdict],
                    meta={"data_source": "kb_fact_check", "split": split, "kind": kind, "candidate": candidate,
                          "reference": reference, "kb_question": q.question, "relation": relation}))
    return rows


def kb_fact_check(seed: int = 0, split: str = "train", *, template: str = DEFAULT_TEMPLATE, pairs: int = 2,
                  **sizes: Any) -> list[Task]:
    """The fact-check rows of one split (``train`` or ``test``) of the knowledge base of ``seed`` and ``sizes``
    (the arguments of ``masrl.tasks.synthetic_kb.generate_kb``)."""
    if split not in ("train", "test"):
        raise ValueError(f"unknown split {split!r}; expected 'train' or 'test'")
    if not isinstance(pairs, int) or isinstance(pairs, bool) or pairs < 1:
        raise ConfigError(f"task.params.pairs: a positive integer (right/wrong pairs per question), got {pairs!r}")
    for field in ("{question}", "{reference}", "{answer}"):
        if field not in template:
            raise ConfigError(f"task.params.template: missing the field {field} (a fact-check template uses "
                              "{question}, {reference} and {answer}, as the yes/no judge's)")
    kb = generate_kb(seed, **kb_args(sizes))
    return fact_check_rows(kb.splits[split], kb, template=template, pairs=pairs, seed=seed, split=split)


def verdict_score(task: Task, answer: str | None) -> dict:
    """1 when the reply's first standalone yes/no is the gold verdict, else 0 (``reason: no_verdict`` without one)."""
    said = parse_yes_no(answer)
    gold = task.answer[0] if task.answer else None
    if said is None:
        return {"reward": 0.0, "correct": False, "reason": "no_verdict", "pred": None}
    pred = "yes" if said == 1.0 else "no"
    return {"reward": float(pred == gold), "correct": pred == gold, "pred": pred}


def verdict_teacher(agent: str, prompt: str, task: Task) -> str:
    """Cold-start demonstrations: the gold verdict, as the reply."""
    return task.answer[0]
