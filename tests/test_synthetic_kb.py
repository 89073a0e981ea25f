"""The synthetic knowledge base: deterministic, well-formed, answerable by retrieval."""
from __future__ import annotations

import re

from masrl.tasks.qa import qa_score
from masrl.tasks.synthetic_kb import generate_kb, synthetic_kb, synthetic_kb_retriever
from masrl.workflows.testing import run_scripted

NAME = re.compile(r"^[A-Z][a-z]{4,5}$")


def test_deterministic_from_seed():
    a_tasks, a_passages = synthetic_kb(seed=7, split="all")
    b_tasks, b_passages = synthetic_kb(seed=7, split="all")
    assert [(t.id, t.question, t.answer) for t in a_tasks] == [(t.id, t.question, t.answer) for t in b_tasks]
    assert a_passages == b_passages
    c_tasks, c_passages = synthetic_kb(seed=8, split="all")
    assert [p.text for p in c_passages] != [p.text for p in a_passages]


def test_splits_disjoint_and_cover_everything():
    train, passages = synthetic_kb(seed=0, split="train")
    test, same_passages = synthetic_kb(seed=0, split="test")
    assert passages == same_passages
    assert not {t.id for t in train} & {t.id for t in test}
    assert not {t.question for t in train} & {t.question for t in test}
    assert 0.15 < len(test) / (len(train) + len(test)) < 0.25
    assert {t.meta["hops"] for t in test} == {1, 2} and {t.meta["hops"] for t in train} == {1, 2}
    assert all(t.meta["split"] == "test" for t in test)


def test_small_regular_vocabulary_and_single_word_answers():
    tasks, passages = synthetic_kb(seed=0, split="all")
    kb = generate_kb(0)
    names = set(kb.people) | set(kb.companies) | set(kb.cities)
    assert len(names) == len(kb.people) + len(kb.companies) + len(kb.cities)
    assert all(NAME.match(n) for n in names)
    for t in tasks:
        [answer] = t.answer
        assert answer in names and answer not in t.question
    words = {w for p in passages for w in re.findall(r"[A-Za-z]+", p.text)} - names
    assert words == {"lives", "in", "works", "for", "is", "based", "led", "by"}
    chars = set("".join(t.question for t in tasks) + "".join(p.contents for p in passages))
    assert chars <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .?\"\n")


def test_facts_are_consistent_with_answers():
    kb = generate_kb(0)
    tasks, _ = synthetic_kb(seed=0, split="all")
    truth = {
        "lives_in": lambda s: kb.people[s]["city"],
        "works_for": lambda s: kb.people[s]["company"],
        "based_in": lambda s: kb.companies[s]["city"],
        "led_by": lambda s: kb.companies[s]["leader"],
        "employer_based_in": lambda s: kb.companies[kb.people[s]["company"]]["city"],
        "employer_led_by": lambda s: kb.companies[kb.people[s]["company"]]["leader"],
    }
    assert {t.meta["relation"] for t in tasks} == set(truth)
    for t in tasks:
        subject = t.meta["subject"]
        assert subject in t.question.split()[-3:] or subject + "?" in t.question
        assert truth[t.meta["relation"]](subject) == t.answer[0]
        assert t.meta["data_source"] == "synthetic_kb"


def test_one_hop_answers_retrievable_by_bm25_top3():
    tasks, passages = synthetic_kb(seed=0, split="all")
    retriever = synthetic_kb_retriever(seed=0)
    one_hop = [t for t in tasks if t.meta["hops"] == 1]
    results = retriever.search([t.question for t in one_hop], topk=3)
    by_id = {p.id: p for p in passages}
    for task, top in zip(one_hop, results):
        [gold] = task.meta["gold_passages"]
        assert gold in [p.id for p in top], task.question
        assert task.answer[0] in by_id[gold].text
    two_hop = [t for t in tasks if t.meta["hops"] == 2]
    for task in two_hop:  # the second hop is reachable by searching the first hop's answer
        first, second = task.meta["gold_passages"]
        bridge = by_id[second].title
        assert bridge in by_id[first].text
        assert retriever.search([bridge], 1)[0][0].id == second


def test_sizes_are_configurable():
    tasks, passages = synthetic_kb(seed=1, split="all", n_people=10, n_companies=3, n_cities=2)
    assert len(passages) == 13
    assert len(synthetic_kb_retriever(seed=1, n_people=10, n_companies=3, n_cities=2, k1=1.2)) == 13


def test_workflow_solves_two_hop_task_with_scripted_team():
    [task] = [t for t in synthetic_kb(seed=0, split="test")[0] if t.meta["relation"] == "employer_based_in"][:1]
    kb = generate_kb(0)
    person = task.meta["subject"]
    company = kb.people[person]["company"]
    episode = run_scripted(
        "search_verifier_router", task,
        {"Verifier": ["<verify>no</verify>", "<verify>no</verify>", "<verify>yes</verify>"],
         "Search": [f"<search>{person}</search>", f"<search>{company}</search>"],
         "Answer": [f"<answer>{task.answer[0]}</answer>"]},
        score=qa_score, params={"retriever": {"type": "synthetic_kb", "seed": 0}})
    assert episode.reward == 1.0
    assert f"{company} is based in {task.answer[0]}" in episode.turns[-1].prompt_text


def test_teacher_solves_every_task_through_the_workflow():
    from masrl.tasks.synthetic_kb import SyntheticKBTeacher
    from masrl.workflows.search import COMPACT_PROMPTS

    tasks, _ = synthetic_kb(seed=0, split="all")
    teacher = SyntheticKBTeacher(seed=0)
    retriever = synthetic_kb_retriever(seed=0)
    for prompts in (None, COMPACT_PROMPTS):
        for task in tasks:
            episode = run_scripted("search_verifier_router", task,
                                   lambda agent, prompt, task=task: teacher.reply(agent, prompt, task),
                                   score=qa_score, params={"retriever": retriever}, prompts=prompts)
            assert episode.reward == 1.0, task.question
            # a person who leads their employer brings the company passage up with their own
            assert 1 <= episode.info["num_searches"] <= task.meta["hops"]
            assert all(t.valid for t in episode.turns)
    assert "<think>" in SyntheticKBTeacher(seed=0, think=True).reply("Answer", "", tasks[0])


HELD_OUT = dict(n_people=60, n_companies=8, n_cities=6, relations=["lives_in", "works_for"], split_by="person")


def test_person_split_holds_out_people_and_their_facts():
    train, passages = synthetic_kb(seed=0, split="train", **HELD_OUT)
    test, _ = synthetic_kb(seed=0, split="test", **HELD_OUT)
    assert {t.meta["relation"] for t in train + test} == {"lives_in", "works_for"}
    assert len(test) == 2 * 12 and len(train) == 2 * 48   # test_fraction 0.2 of the people, two questions each
    test_people = {t.meta["subject"] for t in test}
    assert not test_people & {t.meta["subject"] for t in train}
    # no training question's gold passage mentions a held-out person (companies are led by training people)
    by_id = {p.id: p for p in passages}
    for t in train:
        for pid in t.meta["gold_passages"]:
            assert not any(person in by_id[pid].text for person in test_people)
    # same facts as the question split: only the split and the relations differ
    kb, default = generate_kb(0, **{**HELD_OUT, "relations": tuple(HELD_OUT["relations"])}), generate_kb(0, 60, 8, 6)
    assert kb.people == default.people and kb.cities == default.cities


def test_bad_relations_or_split_mode_are_refused():
    import pytest

    with pytest.raises(ValueError, match="relations"):
        synthetic_kb(seed=0, relations=["lives_in", "born_in"])
    with pytest.raises(ValueError, match="split_by"):
        synthetic_kb(seed=0, split_by="company")


def test_teacher_noise_picks_the_other_entity_and_guesses_without_evidence():
    from masrl.tasks.synthetic_kb import SyntheticKBTeacher

    train, passages = synthetic_kb(seed=0, split="train", **HELD_OUT)
    by_id = {p.id: p for p in passages}
    task = next(t for t in train if t.meta["relation"] == "lives_in")
    passage = by_id[task.meta["gold_passages"][0]]
    company = generate_kb(0, 60, 8, 6).people[task.meta["subject"]]["company"]
    noisy = SyntheticKBTeacher(seed=0, answer_noise=1.0, **HELD_OUT)
    assert noisy.reply("Answer", f"Q {task.question}\n{passage.text}\nA ", task) == f"<answer>{company}</answer>"
    clean = SyntheticKBTeacher(seed=0, **HELD_OUT)
    assert clean.reply("Answer", f"Q {task.question}\n{passage.text}\nA ", task) == f"<answer>{task.answer[0]}</answer>"
    # without the gold passage in the prompt, the teacher cannot know: it guesses
    guesses = {clean.reply("Answer", f"Q {task.question}\nA ", task) for _ in range(20)}
    assert len(guesses) > 1


def test_cloze_questions_and_fixed_name_length():
    sizes = dict(n_people=30, n_companies=5, n_cities=4, question_style="cloze", name_length=5)
    tasks, passages = synthetic_kb(seed=2, split="all", **sizes)
    kb = generate_kb(2, **sizes)
    names = set(kb.people) | set(kb.companies) | set(kb.cities)
    assert all(re.fullmatch(r"[A-Z][a-z]{4}", n) for n in names)
    assert len({len(p.text) for p in passages if p.id.split("-")[1] == "person"}) == 1
    by_relation = {t.meta["relation"]: t for t in tasks}
    person = by_relation["lives_in"].meta["subject"]
    assert by_relation["lives_in"].question == f"{person} lives in?"
    assert by_relation["employer_led_by"].question.startswith("The employer of ")
    retriever = synthetic_kb_retriever(seed=2, **sizes)
    one_hop = [t for t in tasks if t.meta["hops"] == 1]
    top = retriever.search([t.meta["subject"] for t in one_hop], 1)
    assert all(r[0].id == t.meta["gold_passages"][0] for r, t in zip(top, one_hop))
    import pytest

    with pytest.raises(ValueError, match="name_length"):
        synthetic_kb(seed=0, name_length=7)
    with pytest.raises(ValueError, match="question_style"):
        synthetic_kb(seed=0, question_style="yoda")


def test_teacher_quote_cites_the_sentence_it_answers_from():
    from masrl.tasks.synthetic_kb import SyntheticKBTeacher

    sizes = dict(HELD_OUT, question_style="cloze")
    train, passages = synthetic_kb(seed=0, split="train", **sizes)
    by_id = {p.id: p for p in passages}
    task = next(t for t in train if t.meta["relation"] == "works_for")
    text = by_id[task.meta["gold_passages"][0]].text
    prompt = f"Q {task.question}\n<information>{text}</information>\nA "
    subject, answer = task.meta["subject"], task.answer[0]
    teacher = SyntheticKBTeacher(seed=0, quote=True, **sizes)
    assert teacher.reply("Answer", prompt, task) == f"{subject} works for {answer}. <answer>{answer}</answer>"
    city = generate_kb(0, 60, 8, 6).people[subject]["city"]
    noisy = SyntheticKBTeacher(seed=0, quote=True, answer_noise=1.0, **sizes)
    assert noisy.reply("Answer", prompt, task) == f"{subject} lives in {city}. <answer>{city}</answer>"
    assert teacher.reply("Answer", f"Q {task.question}\nA ", task).startswith("<answer>")  # nothing to cite
