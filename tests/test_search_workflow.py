"""Routing of the search_verifier_router workflow with scripted agent replies."""
from __future__ import annotations

import functools

import pytest

from masrl.tasks.qa import qa_score
from masrl.retrieval import BM25Retriever, Passage
from masrl.types import Task
from masrl.workflows.base import get_workflow
from masrl.workflows.search import COMPACT_PROMPTS, SEARCH_PARAMS
from masrl.workflows.testing import run_scripted

PASSAGES = [Passage("p0", "Zorvak", "Zorvak lives in Pelm. Zorvak works for Quenta."),
            Passage("p1", "Quenta", "Quenta is based in Lodis. Quenta is led by Bemira."),
            Passage("p2", "Bemira", "Bemira lives in Tarvo. Bemira works for Quenta.")]
TASK = Task("t1", "Where is the employer of Zorvak based?", ["Lodis"], {"data_source": "test"})


class RecordingRetriever:
    def __init__(self):
        self.inner = BM25Retriever(PASSAGES)
        self.calls = []

    def search(self, queries, topk):
        self.calls.append((list(queries), topk))
        return self.inner.search(queries, topk)


def run(replies, retriever=None, **params):
    retriever = retriever or RecordingRetriever()
    episode = run_scripted("search_verifier_router", TASK, replies, score=qa_score,
                           params={"retriever": retriever, **params})
    return episode, retriever


def agents(episode):
    return [t.agent for t in episode.turns]


def test_registered_with_agents_prompts_and_params():
    spec = get_workflow("search_verifier_router")
    assert spec.agents == ("Verifier", "Search", "Answer")
    assert {"Verifier", "Search", "Answer"} <= set(spec.prompts)
    assert spec.params["max_turns"] == 4 and spec.params["history_length"] == 4 and spec.params["topk"] == 3
    assert spec.params["untagged_verdict"] == "no"


def test_yes_first_answers_without_search():
    episode, retriever = run({"Verifier": ["<think>easy</think><verify>yes</verify>"],
                              "Answer": ["<answer>Lodis</answer>"]})
    assert agents(episode) == ["Verifier", "Answer"]
    assert retriever.calls == []
    assert episode.answer == "Lodis" and episode.reward == 1.0 and episode.info["em"] == 1.0
    assert episode.info["stop"] == "answer" and all(t.valid for t in episode.turns)
    assert [t.turn_index for t in episode.turns] == [0, 1]


def test_two_hop_search_then_answer_and_history_in_prompts():
    episode, retriever = run({
        "Verifier": ["<verify>no</verify>", "<verify>NO</verify>", "<verify>yes</verify>"],
        "Search": ["<think>first hop</think><search>Zorvak</search>", "<search>Quenta</search>"],
        "Answer": ["<answer>lodis</answer>"]}, topk=2)
    assert agents(episode) == ["Verifier", "Search", "Verifier", "Search", "Verifier", "Answer"]
    assert retriever.calls == [(["Zorvak"], 2), (["Quenta"], 2)]
    assert episode.reward == 1.0 and episode.info["num_searches"] == 2
    assert episode.info["queries"] == ["Zorvak", "Quenta"] and episode.info["verdicts"] == ["no", "no", "yes"]
    answer_prompt = episode.turns[-1].prompt_text
    assert 'Step 1: <search>Zorvak</search> <information>Doc 1: "Zorvak"\nZorvak lives in Pelm.' in answer_prompt
    assert "Step 2: <search>Quenta</search> <information>Doc 1: \"Quenta\"" in answer_prompt
    assert "Doc 3:" not in answer_prompt  # topk=2
    assert TASK.question in answer_prompt
    first_verifier = episode.turns[0].prompt_text
    assert "Step 1" not in first_verifier and "step 1 of 4" in first_verifier
    assert "<verify>no</verify>" in episode.turns[1].prompt_text  # the Search agent sees the Verifier's output
    assert episode.turns[1].info["passages"][0] == "p0"


def test_no_at_last_turn_ends_without_answer():
    episode, retriever = run({"Verifier": ["<verify>no</verify>"] * 4,
                              "Search": [f"<search>Zorvak {i}</search>" for i in range(3)]})
    assert agents(episode) == ["Verifier", "Search"] * 3 + ["Verifier"]
    assert len(retriever.calls) == 3
    assert episode.answer is None and episode.reward == 0.0 and episode.info["stop"] == "turn_limit"
    assert all(t.valid for t in episode.turns)


def test_max_turns_param():
    episode, _ = run({"Verifier": ["<verify>no</verify>"] * 2, "Search": ["<search>Zorvak</search>"]}, max_turns=2)
    assert agents(episode) == ["Verifier", "Search", "Verifier"]
    episode, _ = run({"Verifier": ["<verify>no</verify>"]}, max_turns=1)
    assert agents(episode) == ["Verifier"] and episode.reward == 0.0


def test_untagged_verdict_defaults_to_no_while_turns_remain():
    episode, _ = run({"Verifier": ["I think we need more info", "<verify>yes</verify>"],
                      "Search": ["<search>Quenta</search>"], "Answer": ["<answer>Lodis</answer>"]})
    assert agents(episode) == ["Verifier", "Search", "Verifier", "Answer"]
    assert episode.turns[0].valid is False and episode.turns[0].info["verdict"] == "no"
    assert all(t.valid for t in episode.turns[1:]) and episode.reward == 1.0


def test_untagged_verdict_yes_option_routes_to_answer():
    episode, _ = run({"Verifier": ["<verify>maybe</verify>"], "Answer": ["<answer>Pelm</answer>"]},
                     untagged_verdict="yes")
    assert agents(episode) == ["Verifier", "Answer"]
    assert episode.turns[0].valid is False and episode.reward == 0.0


def test_untagged_verdict_at_last_turn():
    replies = {"Verifier": ["<verify>no</verify>", "no tag at all"], "Search": ["<search>Quenta</search>"],
               "Answer": ["<answer>Lodis</answer>"]}
    episode, _ = run(replies, max_turns=2)  # default: the Answer agent still answers at the last turn
    assert agents(episode) == ["Verifier", "Search", "Verifier", "Answer"] and episode.reward == 1.0
    assert episode.turns[2].valid is False
    episode, _ = run(replies, max_turns=2, untagged_last_turn="no")
    assert agents(episode) == ["Verifier", "Search", "Verifier"] and episode.answer is None


def test_search_without_tag_is_invalid_and_retrieves_nothing():
    episode, retriever = run({"Verifier": ["<verify>no</verify>", "<verify>no</verify>", "<verify>yes</verify>"],
                              "Search": ["Zorvak please", "<search>   </search>"],
                              "Answer": ["<answer>Lodis</answer>"]})
    assert retriever.calls == []
    searches = [t for t in episode.turns if t.agent == "Search"]
    assert [t.valid for t in searches] == [False, False]
    prompt = episode.turns[-1].prompt_text
    assert "Step 1: <search></search> <information></information>" in prompt
    assert "Step 2: <search></search> <information></information>" in prompt
    assert episode.info["num_searches"] == 0 and episode.info["queries"] == [None, None]


def test_answer_without_tag_is_invalid_and_scores_zero():
    episode, _ = run({"Verifier": ["<verify>yes</verify>"], "Answer": ["Lodis"]})
    assert episode.turns[-1].valid is False and episode.answer is None and episode.reward == 0.0


def test_history_length_shows_only_recent_steps():
    episode, _ = run({"Verifier": ["<verify>no</verify>"] * 3 + ["<verify>yes</verify>"],
                      "Search": ["<search>Zorvak</search>", "<search>Quenta</search>", "<search>Bemira</search>"],
                      "Answer": ["<answer>x</answer>"]}, history_length=2)
    prompt = episode.turns[-1].prompt_text
    assert "Step 1:" not in prompt and "Step 2: <search>Quenta</search>" in prompt and "Step 3:" in prompt
    assert "taken 3 step(s)" in prompt


def test_f1_reward_and_prompt_override():
    score = functools.partial(qa_score, metric="f1")
    episode = run_scripted("search_verifier_router", TASK,
                           {"Verifier": ["<verify>yes</verify>"], "Answer": ["<answer>Lodis city</answer>"]},
                           score=score, params={"retriever": BM25Retriever(PASSAGES)}, prompts=COMPACT_PROMPTS)
    assert episode.reward == pytest.approx(2 / 3) and episode.info["correct"] is False
    assert episode.turns[0].prompt_text.startswith("Q: " + TASK.question)


def test_retrieved_text_is_not_rescanned_for_placeholders():
    tricky = [Passage("x", "T", "see {question} and {history} literally")]
    episode, _ = run({"Verifier": ["<verify>no</verify>", "<verify>yes</verify>"],
                      "Search": ["<search>literally</search>"], "Answer": ["<answer>x</answer>"]},
                     retriever=BM25Retriever(tricky))
    assert "see {question} and {history} literally" in episode.turns[-1].prompt_text


def test_retriever_spec_and_missing_retriever():
    task = Task("s", "Where does Zorvak live?", ["Pelm"])
    episode = run_scripted("search_verifier_router", task,
                           {"Verifier": ["<verify>yes</verify>"], "Answer": ["<answer>Pelm</answer>"]},
                           score=qa_score, params={"retriever": "synthetic_kb"})
    assert episode.reward == 1.0
    with pytest.raises(ValueError, match="needs params\\['retriever'\\]"):
        run_scripted("search_verifier_router", task, {"Verifier": ["<verify>yes</verify>"]}, score=qa_score)
    with pytest.raises(ValueError, match="untagged_verdict"):
        run({"Verifier": []}, untagged_verdict="maybe")
    assert SEARCH_PARAMS["retriever"] is None


from hypothesis import given, settings
from hypothesis import strategies as st

_reply = st.one_of(st.text(max_size=30), st.sampled_from([
    "<verify>yes</verify>", "<verify>no</verify>", "<verify>No</verify>", "<verify></verify>",
    "<search>Zorvak</search>", "<search></search>", "<answer>Lodis</answer>", "<answer></answer>",
    "<verify>yes", "</verify>no<verify>", "<search>Quenta"]))


@settings(max_examples=60, deadline=None)
@given(replies=st.lists(_reply, min_size=1, max_size=12), max_turns=st.integers(1, 5))
def test_any_replies_give_a_well_formed_episode(replies, max_turns):
    feed = iter(replies * 20)
    retriever = BM25Retriever(PASSAGES)
    episode = run_scripted("search_verifier_router", TASK, lambda agent, prompt: next(feed), score=qa_score,
                           params={"retriever": retriever, "max_turns": max_turns})
    verifiers = [t for t in episode.turns if t.agent == "Verifier"]
    assert 1 <= len(verifiers) <= max_turns
    assert episode.turns[0].agent == "Verifier"
    assert sum(t.agent == "Answer" for t in episode.turns) <= 1
    assert episode.reward in (0.0, 1.0) and (episode.answer is not None or episode.reward == 0.0)
    for t in verifiers:
        assert t.info["verdict"] in ("yes", "no")
        if t.valid:
            assert f"<verify>{t.info['verdict']}</verify>" in t.text.lower()
    for t in episode.turns:
        if t.agent == "Search":
            assert t.valid == bool(t.info["query"])
