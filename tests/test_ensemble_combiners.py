"""Combiners on hand-made items."""
import numpy as np
import pytest

from masrl.ensemble import (Majority, Oracle, Plurality, SoftVote, Summarizer, from_records, get_combiner,
                            plurality_correct, plurality_predict, soft_vote_predict)


def test_plurality_expected_hand():
    A = np.array([[0, 0, 1], [0, 0, 1], [0, 1, 2], [0, 1, -1], [-1, -1, -1], [1, 1, 2], [0, 0, 0]])
    y = np.array([0, 1, 2, 1, 0, 1, -1])
    # majority right; majority wrong; 3-way tie incl. label; abstention ignored -> 2-way tie; no votes;
    # clear plurality; no label
    assert plurality_correct(A, y).tolist() == pytest.approx([1, 0, 1 / 3, 1 / 2, 0, 1, 0])


def test_plurality_four_way_and_masks():
    A = np.array([[1, 1, 0, 0]])
    assert plurality_correct(A, np.array([0]))[0] == pytest.approx(0.5)
    assert plurality_correct(A, np.array([0]), mask=np.array([False, True, True, True]))[0] == 1.0
    # per-row masks
    A2 = np.array([[0, 1, 1], [0, 1, 1]])
    m = np.array([[True, False, False], [False, True, True]])
    assert plurality_correct(A2, np.array([0, 0]), m).tolist() == [1.0, 0.0]
    assert plurality_correct(A2, np.array([0, 0]), np.zeros(3, bool)).tolist() == [0.0, 0.0]


def test_plurality_random_tie_break_is_uniform_and_seeded():
    A = np.tile(np.array([[3, 3, 5, 5, 7]]), (4000, 1))
    pred = plurality_predict(A, rng=np.random.default_rng(1))
    assert set(pred.tolist()) == {3, 5}
    assert abs((pred == 3).mean() - 0.5) < 0.03
    again = plurality_predict(A, rng=np.random.default_rng(1))
    assert (pred == again).all()
    assert plurality_predict(np.array([[-1, -1]]))[0] == -1


def test_plurality_combiner_random_mode_matches_expected_on_average():
    rows = [{"id": f"q{i}", "label": 0, "predictions": {"a": {"answer": 0}, "b": {"answer": 1}}} for i in range(2000)]
    d = from_records(rows)
    exp = Plurality().accuracy(d, np.arange(d.n), [0, 1])
    rnd = Plurality(tie_break="random", seed=3).accuracy(d, np.arange(d.n), [0, 1])
    assert exp == 0.5 and abs(rnd - 0.5) < 0.05
    assert Plurality(tie_break="random", seed=3).accuracy(d, np.arange(d.n), [0, 1]) == rnd
    with pytest.raises(ValueError):
        Plurality(tie_break="first")


def test_soft_vote_hand():
    P = np.array([[[0.6, 0.4], [0.3, 0.7], [0.45, 0.55]]])  # sum = (1.35, 1.65) -> 1
    assert soft_vote_predict(P)[0] == 1
    assert soft_vote_predict(P, np.array([True, False, False]))[0] == 0
    assert soft_vote_predict(P, np.zeros(3, bool))[0] == -1


def _data():
    rows = [
        {"id": "1", "label": 0, "predictions": {"a": {"answer": 0, "probs": [0.9, 0.1]},
                                                "b": {"answer": 1, "probs": [0.4, 0.6]},
                                                "c": {"answer": 1, "probs": [0.45, 0.55]}}},
        {"id": "2", "label": 1, "predictions": {"a": {"answer": 0, "probs": [0.6, 0.4]},
                                                "b": {"answer": 0, "probs": [0.55, 0.45]},
                                                "c": {"answer": 1, "probs": [0.1, 0.9]}}},
    ]
    return from_records(rows)


def test_combiners_on_data():
    d = _data()
    rows = np.arange(2)
    allm = [0, 1, 2]
    assert Plurality().correct(d, rows, allm).tolist() == [0.0, 0.0]
    assert SoftVote().correct(d, rows, allm).tolist() == [1.0, 1.0]  # (1.95, 1.05) -> 0 ; (1.25, 1.75) -> 1
    assert Oracle().correct(d, rows, allm).tolist() == [1.0, 1.0]
    assert Majority().correct(d, rows, allm).tolist() == [0.0, 0.0]
    assert Majority().correct(d, rows, [0, 1]).tolist() == [0.5, 0.0]
    assert Majority().correct(d, rows, [0, 2]).tolist() == [0.5, 0.5]
    assert Oracle().predict(d, rows, [0, 2]).tolist() == [0, 1]  # label where a member is right
    assert Oracle().predict(d, rows, [0, 1]).tolist() == [0, 0]  # else the plurality answer
    assert Plurality().accuracy(d, rows, [2]) == 0.5


def test_summarizer_callable_counts_calls():
    d = _data()
    seen = []

    def trust_c(item_id, proposals):
        seen.append((item_id, dict(proposals)))
        return proposals.get("c", next(iter(proposals.values())))

    s = Summarizer(trust_c)
    assert s.correct(d, np.arange(2), [0, 2]).tolist() == [0.0, 1.0]
    assert s.calls == 2 and seen[0] == ("1", {"a": 0, "c": 1})
    with pytest.raises(TypeError):
        Summarizer(42)


def test_get_combiner_names_and_checks(tmp_path):
    d = _data()
    assert get_combiner("auto", d).name == "plurality"
    assert get_combiner("soft_vote").name == "soft"
    corr_only = from_records([{"id": "x", "label": None,
                               "predictions": {"a": {"answer": None, "correct": 1}, "b": {"answer": None, "correct": 0}}}])
    assert get_combiner("auto", corr_only).name == "majority"
    with pytest.raises(ValueError, match="needs answers"):
        get_combiner("plurality", corr_only)
    with pytest.raises(ValueError, match="probs"):
        get_combiner("soft", corr_only)
    with pytest.raises(ValueError, match="unknown combiner"):
        get_combiner("best")
    s = get_combiner("masrl.ensemble.combiners:plurality_predict")  # any importable callable
    assert isinstance(s, Summarizer)
    with pytest.raises(ValueError, match="cannot load summarizer"):
        get_combiner("no_such_module_xyz:fn")
