"""A synthetic knowledge base for CPU search training: invented people, companies and cities.

Everything is generated from a seed, so the facts exist nowhere but in the passages: the
questions can only be answered by retrieving them. Vocabulary is small and regular so that a
tiny character-level model can learn it:

    passage  "Zorvak"  Zorvak lives in Pelm. Zorvak works for Quenta.
    passage  "Quenta"  Quenta is based in Lodis. Quenta is led by Bemira.
    one-hop  Where does Zorvak live?                 -> Pelm
             Who does Zorvak work for?               -> Quenta
             Where is Quenta based?                  -> Lodis
             Who leads Quenta?                       -> Bemira
    two-hop  Where is the employer of Zorvak based?  -> Lodis
             Who leads the employer of Zorvak?       -> Bemira

Names are one capitalized invented word each (consonant-vowel-consonant + consonant-vowel,
sometimes a final consonant: "Zorvak", "Belta"); every answer is one such word. ``meta`` holds ``relation``, ``subject`` (the name in the
question), ``hops`` and the ids of the gold passages (in hop order).

    tasks, passages = synthetic_kb(seed=0, split="train")
    retriever = synthetic_kb_retriever(seed=0)          # BM25 over the passages
    teacher = SyntheticKBTeacher(seed=0).reply          # oracle replies for cold-start SFT
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import lru_cache

from masrl.tasks.retrieval.base import Passage
from masrl.types import Task

ONSETS = "bdfgklmnprstvz"
VOWELS = "aeiou"
CODAS = "klnrs"

QUESTION_TEMPLATES = {
    "lives_in": "Where does {person} live?",
    "works_for": "Who does {person} work for?",
    "based_in": "Where is {company} based?",
    "led_by": "Who leads {company}?",
    "employer_based_in": "Where is the employer of {person} based?",
    "employer_led_by": "Who leads the employer of {person}?",
}
PERSON_PASSAGE = "{person} lives in {city}. {person} works for {company}."
COMPANY_PASSAGE = "{company} is based in {city}. {company} is led by {leader}."


@dataclass
class SyntheticKB:
    seed: int
    people: dict[str, dict[str, str]]      # person -> {"city", "company"}
    companies: dict[str, dict[str, str]]   # company -> {"city", "leader"}
    cities: list[str]
    passages: list[Passage]
    splits: dict[str, list[Task]] = field(default_factory=dict)


def invent_names(rng: random.Random, n: int, taken: set[str]) -> list[str]:
    """``n`` new distinct names such as "Zorvak" or "Belta" (none of them in ``taken``)."""
    from bm25s.stopwords import STOPWORDS_EN

    names: list[str] = []
    while len(names) < n:
        word = (rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS)
                + rng.choice(ONSETS) + rng.choice(VOWELS))
        if rng.random() < 0.5:
            word += rng.choice(CODAS)
        word = word.capitalize()
        if word not in taken and word.lower() not in STOPWORDS_EN:
            taken.add(word)
            names.append(word)
    return names


@lru_cache(maxsize=8)
def generate_kb(seed: int = 0, n_people: int = 48, n_companies: int = 12, n_cities: int = 8,
                test_fraction: float = 0.2) -> SyntheticKB:
    """Build the knowledge base, its passages and its train/test questions (deterministic in the arguments)."""
    if n_people < n_companies or min(n_people, n_companies, n_cities) < 1:
        raise ValueError("need n_people >= n_companies >= 1 and n_cities >= 1")
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError("test_fraction must be in [0, 1)")
    rng = random.Random(seed)
    taken: set[str] = set()
    cities = invent_names(rng, n_cities, taken)
    company_names = invent_names(rng, n_companies, taken)
    person_names = invent_names(rng, n_people, taken)

    # every company gets at least one employee; its leader is one of its employees
    employers = [company_names[i % n_companies] for i in range(n_people)]
    rng.shuffle(employers)
    people = {p: {"city": rng.choice(cities), "company": c} for p, c in zip(person_names, employers)}
    companies = {}
    for c in company_names:
        staff = [p for p in person_names if people[p]["company"] == c]
        companies[c] = {"city": rng.choice(cities), "leader": rng.choice(staff)}

    passages, pid = [], {}
    for p in person_names:
        pid[p] = f"skb{seed}-person-{len(passages)}"
        passages.append(Passage(pid[p], p, PERSON_PASSAGE.format(person=p, **people[p])))
    for c in company_names:
        pid[c] = f"skb{seed}-company-{len(passages)}"
        passages.append(Passage(pid[c], c, COMPANY_PASSAGE.format(company=c, **companies[c])))

    questions: list[tuple[str, dict, str, list[str]]] = []  # relation, fields, answer, gold passage ids
    for p, facts in people.items():
        c = facts["company"]
        questions.append(("lives_in", {"person": p}, facts["city"], [pid[p]]))
        questions.append(("works_for", {"person": p}, c, [pid[p]]))
        questions.append(("employer_based_in", {"person": p}, companies[c]["city"], [pid[p], pid[c]]))
        if companies[c]["leader"] != p:  # the question would contain its own answer
            questions.append(("employer_led_by", {"person": p}, companies[c]["leader"], [pid[p], pid[c]]))
    for c, facts in companies.items():
        questions.append(("based_in", {"company": c}, facts["city"], [pid[c]]))
        questions.append(("led_by", {"company": c}, facts["leader"], [pid[c]]))

    order = list(range(len(questions)))
    rng.shuffle(order)
    n_test = int(round(test_fraction * len(questions)))
    split_of = {qi: ("test" if rank < n_test else "train") for rank, qi in enumerate(order)}
    splits: dict[str, list[Task]] = {"train": [], "test": []}
    for qi, (relation, fields, answer, gold) in enumerate(questions):
        split = split_of[qi]
        splits[split].append(Task(
            id=f"skb{seed}-{qi}", question=QUESTION_TEMPLATES[relation].format(**fields), answer=[answer],
            meta={"data_source": "synthetic_kb", "split": split, "relation": relation,
                  "subject": next(iter(fields.values())), "hops": len(gold), "gold_passages": gold}))
    return SyntheticKB(seed, people, companies, cities, passages, splits)


def synthetic_kb(seed: int = 0, split: str = "train", **sizes) -> tuple[list[Task], list[Passage]]:
    """``(tasks, passages)`` of one split (``train``, ``test`` or ``all``); passages are shared by splits.

    ``sizes``: ``n_people``, ``n_companies``, ``n_cities``, ``test_fraction`` (see :func:`generate_kb`).
    Fresh copies are returned, so callers may modify them.
    """
    kb = generate_kb(seed, **sizes)
    if split == "all":
        tasks = kb.splits["train"] + kb.splits["test"]
    elif split in kb.splits:
        tasks = kb.splits[split]
    else:
        raise ValueError(f"unknown split {split!r}; expected 'train', 'test' or 'all'")
    copy = [Task(t.id, t.question, list(t.answer), {**t.meta, "gold_passages": list(t.meta["gold_passages"])})
            for t in tasks]
    return copy, [Passage(p.id, p.title, p.text) for p in kb.passages]


def synthetic_kb_retriever(seed: int = 0, **settings):
    """A ready :class:`BM25Retriever` over the knowledge base of ``seed``.

    ``settings`` holds generator sizes (``n_people``, ...) and BM25 settings (``k1``, ``b``, ...).
    """
    from masrl.tasks.retrieval.bm25 import BM25Retriever

    size_keys = ("n_people", "n_companies", "n_cities", "test_fraction")
    sizes = {k: settings.pop(k) for k in size_keys if k in settings}
    _, passages = synthetic_kb(seed, "all", **sizes)
    return BM25Retriever(passages, **settings)


class SyntheticKBTeacher:
    """An oracle team for cold-start SFT on the search workflow: ``reply(agent, prompt, task)``.

    The Verifier says yes once every gold passage's text is in the prompt; the Search agent
    queries the title (entity name) of the first gold passage not yet retrieved; the Answer
    agent gives the gold answer. Works with any prompt template that shows passage text.
    """

    def __init__(self, seed: int = 0, *, think: bool = False, answer_noise: float = 0.0,
                 verifier_noise: float = 0.0, **sizes):
        kb = generate_kb(seed, **sizes)
        self.passages = {p.id: p for p in kb.passages}
        self.think = think
        # imperfect demonstrations (cold start): a wrong entity from the prompt as the answer,
        # a flipped sufficiency verdict
        self.answer_noise = answer_noise
        self.verifier_noise = verifier_noise
        self.rng = random.Random(seed + 7919)
        self.names = sorted({p.title for p in kb.passages})

    def reply(self, agent: str, prompt: str, task: Task) -> str:
        gold = [self.passages[pid] for pid in task.meta.get("gold_passages", []) if pid in self.passages]
        missing = [p for p in gold if p.text not in prompt]
        if agent == "Verifier":
            verdict = "no" if missing else "yes"
            if self.rng.random() < self.verifier_noise:
                verdict = "yes" if verdict == "no" else "no"
            thought = "<think>need more</think>" if missing else "<think>enough</think>"
            return (thought if self.think else "") + f"<verify>{verdict}</verify>"
        if agent == "Search":
            query = missing[0].title if missing else str(task.meta.get("subject", task.question))
            return (f"<think>find {query}</think>" if self.think else "") + f"<search>{query}</search>"
        if agent == "Answer":
            answer = task.answer[0]
            if self.rng.random() < self.answer_noise:
                seen = [n for n in self.names if n in prompt and n != answer and n != task.meta.get("subject")]
                answer = self.rng.choice(seen or self.names)
            return (f"<think>it is {answer}</think>" if self.think else "") + f"<answer>{answer}</answer>"
        raise ValueError(f"SyntheticKBTeacher has no reply for agent {agent!r}")
