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
sometimes a final consonant: "Zorvak", "Belta"; ``name_length`` fixes the length); every answer
is one such word. ``meta`` holds ``relation``, ``subject`` (the name in the question), ``hops``
and the ids of the gold passages (in hop order).

Options of ``generate_kb`` for tiny models (the defaults keep the layout above):
``relations`` (a subset of the six, e.g. one-hop ``lives_in`` + ``works_for``),
``question_style="cloze"`` (the passages' own wording: "Zorvak lives in?"),
``split_by="person"`` (held-out people: every question about them is a test question; their
passages are in the corpus, but with the person relations no training question's gold passage
mentions them, so held-out answers cannot have been memorized) and ``name_length``.

    tasks, passages = synthetic_kb(seed=0, split="train")
    retriever = synthetic_kb_retriever(seed=0)          # BM25 over the passages
    teacher = SyntheticKBTeacher(seed=0).reply          # oracle replies for cold-start SFT
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from functools import lru_cache

from masrl.errors import ConfigError
from masrl.retrieval import register_retriever_type
from masrl.retrieval.base import Passage
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
# the same facts asked with the passages' own wording ("Zorvak lives in?"): easier for tiny models
CLOZE_TEMPLATES = {
    "lives_in": "{person} lives in?",
    "works_for": "{person} works for?",
    "based_in": "{company} is based in?",
    "led_by": "{company} is led by?",
    "employer_based_in": "The employer of {person} is based in?",
    "employer_led_by": "The employer of {person} is led by?",
}
FACT_SENTENCE = re.compile(r"[A-Z][a-z]+ (?:lives in|works for|is based in|is led by) [A-Z][a-z]+\.")
QUESTION_STYLES = {"natural": QUESTION_TEMPLATES, "cloze": CLOZE_TEMPLATES}
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


def invent_names(rng: random.Random, n: int, taken: set[str], length: int | None = None) -> list[str]:
    """``n`` new distinct names such as "Zorvak" or "Belta" (none of them in ``taken``).

    ``length``: None (5 or 6 letters, at random), or exactly 4 ("Bena"), 5 ("Belta") or 6 ("Zorvak").
    """
    from bm25s.stopwords import STOPWORDS_EN

    names: list[str] = []
    while len(names) < n:
        if length == 4:
            word = rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(ONSETS) + rng.choice(VOWELS)
        else:
            word = (rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS)
                    + rng.choice(ONSETS) + rng.choice(VOWELS))
            if length == 6 or (length is None and rng.random() < 0.5):
                word += rng.choice(CODAS)
        word = word.capitalize()
        if word not in taken and word.lower() not in STOPWORDS_EN:
            taken.add(word)
            names.append(word)
    return names


SPLIT_MODES = ("question", "person")
SIZE_KEYS = ("n_people", "n_companies", "n_cities", "test_fraction", "relations", "split_by", "question_style",
             "name_length")


def kb_args(sizes: dict) -> dict:
    """Generator arguments in hashable form (a YAML list of relations becomes a tuple)."""
    out = dict(sizes)
    if out.get("relations") is not None:
        out["relations"] = tuple(out["relations"])
    return out


@lru_cache(maxsize=8)
def generate_kb(seed: int = 0, n_people: int = 48, n_companies: int = 12, n_cities: int = 8,
                test_fraction: float = 0.2, relations: tuple[str, ...] | None = None,
                split_by: str = "question", question_style: str = "natural",
                name_length: int | None = None) -> SyntheticKB:
    """Build the knowledge base, its passages and its train/test questions (deterministic in the arguments).

    ``relations``: the question relations to generate (default: all of ``QUESTION_TEMPLATES``).
    ``split_by``: ``"question"`` (a random ``test_fraction`` of the questions is held out; passages
    are shared) or ``"person"`` (a random ``test_fraction`` of the people is held out: every question
    about them is a test question, and every company is led by a training person when it employs
    one, so that company passages rarely name held-out people; with only the person relations
    (``lives_in``, ``works_for``), no training question's gold passage names a held-out person).
    ``question_style``: ``"natural"`` ("Where does Zorvak live?") or ``"cloze"`` ("Zorvak lives in?").
    ``name_length``: None (names of 5 or 6 letters) or 4, 5 or 6 (every name that long: passages of one
    shape all have the same length, which makes copying easier for a tiny model).
    """
    if n_people < n_companies or min(n_people, n_companies, n_cities) < 1:
        raise ConfigError("need n_people >= n_companies >= 1 and n_cities >= 1")
    if not 0.0 <= test_fraction < 1.0:
        raise ConfigError("test_fraction must be in [0, 1)")
    if split_by not in SPLIT_MODES:
        raise ConfigError(f"split_by must be one of {SPLIT_MODES}, got {split_by!r}")
    if question_style not in QUESTION_STYLES:
        raise ConfigError(f"question_style must be one of {sorted(QUESTION_STYLES)}, got {question_style!r}")
    templates = QUESTION_STYLES[question_style]
    relations = tuple(QUESTION_TEMPLATES) if relations is None else tuple(relations)
    unknown = sorted(set(relations) - set(QUESTION_TEMPLATES))
    if unknown or not relations:
        raise ConfigError(f"relations: unknown or none {unknown}; known: {sorted(QUESTION_TEMPLATES)}")
    if name_length not in (None, 4, 5, 6):
        raise ConfigError(f"name_length must be 4, 5, 6 or None, got {name_length!r}")
    rng = random.Random(seed)
    taken: set[str] = set()
    cities = invent_names(rng, n_cities, taken, name_length)
    company_names = invent_names(rng, n_companies, taken, name_length)
    person_names = invent_names(rng, n_people, taken, name_length)

    # every company gets at least one employee; its leader is one of its employees
    employers = [company_names[i % n_companies] for i in range(n_people)]
    rng.shuffle(employers)
    people = {p: {"city": rng.choice(cities), "company": c} for p, c in zip(person_names, employers)}
    test_people: set[str] = set()
    if split_by == "person":  # its own generator: the facts are the same as with split_by="question"
        n_test = int(round(test_fraction * n_people))
        test_people = set(random.Random(seed + 104_729).sample(person_names, n_test))
    companies = {}
    for c in company_names:
        staff = [p for p in person_names if people[p]["company"] == c]
        staff = [p for p in staff if p not in test_people] or staff
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
    if split_by == "person":
        split_of = {qi: ("test" if q[1].get("person") in test_people else "train") for qi, q in enumerate(questions)}
    splits: dict[str, list[Task]] = {"train": [], "test": []}
    for qi, (relation, fields, answer, gold) in enumerate(questions):
        if relation not in relations:
            continue
        split = split_of[qi]
        splits[split].append(Task(
            id=f"skb{seed}-{qi}", question=templates[relation].format(**fields), answer=[answer],
            meta={"data_source": "synthetic_kb", "split": split, "relation": relation,
                  "subject": next(iter(fields.values())), "hops": len(gold), "gold_passages": gold}))
    return SyntheticKB(seed, people, companies, cities, passages, splits)


def synthetic_kb(seed: int = 0, split: str = "train", **sizes) -> tuple[list[Task], list[Passage]]:
    """``(tasks, passages)`` of one split (``train``, ``test`` or ``all``); passages are shared by splits.

    ``sizes``: ``n_people``, ``n_companies``, ``n_cities``, ``test_fraction``, ``relations``,
    ``split_by``, ``question_style``, ``name_length`` (see ``generate_kb``).
    Fresh copies are returned, so callers may modify them.
    """
    kb = generate_kb(seed, **kb_args(sizes))
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
    """A ready ``BM25Retriever`` over the knowledge base of ``seed``.

    ``settings`` holds generator sizes (``n_people``, ...) and BM25 settings (``k1``, ``b``, ...).
    """
    from masrl.retrieval.bm25 import BM25Retriever

    sizes = {k: settings.pop(k) for k in SIZE_KEYS if k in settings}
    _, passages = synthetic_kb(seed, "all", **sizes)
    return BM25Retriever(passages, **settings)


# the retriever spec "synthetic_kb" / {"type": "synthetic_kb", "seed": 3, ...} (masrl.retrieval.build_retriever)
register_retriever_type("synthetic_kb", synthetic_kb_retriever, shorthand=True)


class SyntheticKBTeacher:
    """An oracle team for cold-start SFT on the search workflow: ``reply(agent, prompt, task)``.

    The Verifier says yes once every gold passage's text is in the prompt; the Search agent
    queries the title (entity name) of the first gold passage not yet retrieved; the Answer
    agent gives the gold answer. Works with any prompt template that shows passage text.

    Options: ``quote`` (the Answer agent first cites the passage sentence that ends with its
    answer, "Zorvak lives in Pelm. <answer>Pelm</answer>", which a tiny model learns to copy far
    sooner than a bare answer); ``think`` (a short ``<think>`` before each tag); imperfect
    demonstrations for cold start: ``answer_noise`` (that fraction of answers is another entity
    named in the prompt, e.g. the employer instead of the city, cited as such with ``quote``)
    and ``verifier_noise`` (that fraction of verdicts is flipped). When the gold passages are
    not in the prompt (a premature yes), the Answer agent can only guess: an entity named in
    the prompt, else any name.
    """

    def __init__(self, seed: int = 0, *, think: bool = False, quote: bool = False, answer_noise: float = 0.0,
                 verifier_noise: float = 0.0, **sizes):
        kb = generate_kb(seed, **kb_args(sizes))
        self.passages = {p.id: p for p in kb.passages}
        self.think = think
        self.quote = quote
        # imperfect demonstrations (cold start): another entity of the prompt as the answer,
        # a flipped sufficiency verdict
        self.answer_noise = answer_noise
        self.verifier_noise = verifier_noise
        self.rng = random.Random(seed + 7919)
        self.names = sorted({p.title for p in kb.passages} | set(kb.cities))  # every entity, cities included

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
            wrong = [n for n in self.names if n in prompt and n != answer and n != task.meta.get("subject")]
            if missing:  # the facts are not in the prompt: a guess (a name it can see, else any name)
                answer = self.rng.choice(wrong or self.names)
            elif self.rng.random() < self.answer_noise:
                answer = self.rng.choice(wrong or self.names)
            reply = f"<answer>{answer}</answer>"
            if self.quote:  # cite the sentence of a retrieved passage that ends with the answer
                cited = [c for c in FACT_SENTENCE.findall(prompt) if c.endswith(f" {answer}.")]
                reply = (cited[0] + " " if cited else "") + reply
            return (f"<think>it is {answer}</think>" if self.think else "") + reply
        raise ValueError(f"SyntheticKBTeacher has no reply for agent {agent!r}")
