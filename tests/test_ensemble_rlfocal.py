"""RL-Focal: tables against direct definitions, learning on synthetic pools, no test-time updates."""
import numpy as np
import pytest

from masrl.ensemble import Plurality, RLFocalConfig, Split, from_records, get_combiner, train_rl_focal
from masrl.ensemble.rlfocal import mask_bits, mask_tables, window_fitness_table
from masrl.ensemble.selectors import fitness


def make_data(A, y, probs=None, tasks=None):
    rows = []
    for i in range(len(y)):
        preds = {}
        for j in range(A.shape[1]):
            p = {"answer": int(A[i, j]) if A[i, j] >= 0 else None}
            if probs is not None:
                p["probs"] = [float(x) for x in probs[i, j]]
            preds[f"m{j}"] = p
        r = {"id": str(i), "label": int(y[i]), "predictions": preds}
        if tasks is not None:
            r["task"] = tasks[i]
        rows.append(r)
    return from_records(rows)


def synthetic(seed=0, n=120, N=4, K=4, good=2, abstain=0.0):
    """Model ``good`` is always right; the others answer uniformly at random."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, K, n)
    A = rng.integers(0, K, (n, N))
    A[:, good] = y
    if abstain:
        A[rng.random((n, N)) < abstain] = -1
        A[:, good] = y
    return A, y


def test_mask_bits_and_tables():
    bits = mask_bits(3)
    assert bits.shape == (8, 3) and bits[5].tolist() == [True, False, True]
    A, y = synthetic(1, n=30)
    d = make_data(A, y)
    R = mask_tables(d, np.arange(d.n), Plurality())
    for m in (3, 5, 6, 15):
        assert np.allclose(R[:, m], Plurality().correct(d, np.arange(d.n), np.flatnonzero(mask_bits(4)[m])))
    assert (R[:, 0] == 0).all()


@pytest.mark.parametrize("weights", [(0.5, 0.5, 0.0), (0.5, 0.3, 0.2), (0.0, 0.0, 1.0)])
def test_window_fitness_table_matches_direct(weights):
    A, y = synthetic(2, n=40, abstain=0.15)
    A[:, 2] = np.where(np.arange(40) % 3 == 0, (y + 1) % 4, y)  # make the good model fail sometimes
    d = make_data(A, y)
    rows = np.arange(d.n)
    R = mask_tables(d, rows, Plurality())
    w = 7
    F = window_fitness_table(d, rows, R, w, weights)
    bits = mask_bits(4)
    assert (F[0] == 0).all()
    for t in (1, 2, 5, 7, 8, 23, 40):
        lo = max(0, t - w)
        for m in range(16):
            S = list(np.flatnonzero(bits[m]))
            if len(S) < 2:
                assert F[t, m] == -1.0
                continue
            direct = fitness(d.correct[lo:t], d.answers[lo:t], d.labels[lo:t], S, weights)
            assert F[t, m] == pytest.approx(direct, abs=1e-5), (t, m)


def fast_cfg(**kw):
    base = dict(episodes=8, rollouts=8, update_every=20, window=10, fusion_epochs=150)
    base.update(kw)
    return RLFocalConfig(**base)


def test_decider_learns_the_reliable_model():
    A, y = synthetic(3, n=150)
    d = make_data(A, y)
    sp = Split(np.arange(100), np.arange(100, 150), "manual")
    res = train_rl_focal(d, sp, fast_cfg(fusion=False), seeds=(0, 1))
    assert res.summary["decider_pooled"]["mean"] >= 0.9
    for rec in res.per_seed:
        usage = rec["per_task"]["all"]["mask_usage"]
        top = max(usage, key=usage.get)
        assert "m2" in top.split("+")
    assert res.summary["mean_size"]["mean"] <= 2.0  # the size penalty keeps the ensemble small


def _relabelled(d, A, y, test_rows, seed):
    y2 = y.copy()
    rng = np.random.default_rng(seed)
    y2[test_rows] = rng.integers(0, 4, len(test_rows))
    return make_data(A, y2)


def test_no_test_time_updates_test_labels_do_not_change_choices():
    A, y = synthetic(4, n=120)
    A[:, 0] = np.where(np.arange(120) % 2 == 0, y, A[:, 0])  # a second, half-reliable model
    d1 = make_data(A, y)
    te = np.arange(90, 120)
    d2 = _relabelled(d1, A, y, te, seed=9)
    sp = Split(np.arange(90), te, "manual")
    cfg = fast_cfg(fusion=False, episodes=4)
    r1 = train_rl_focal(d1, sp, cfg, seeds=(0,))
    r2 = train_rl_focal(d2, sp, cfg, seeds=(0,))
    t1, t2 = r1.per_seed[0]["per_task"]["all"], r2.per_seed[0]["per_task"]["all"]
    assert t1["mask_usage"] == t2["mask_usage"]          # same selections on the test stream
    assert t1["train_greedy_accuracy"] == t2["train_greedy_accuracy"]
    assert t1["decider_accuracy"] != t2["decider_accuracy"]  # only the scoring used the test labels


def test_fusion_learns_a_systematic_relabelling():
    rng = np.random.default_rng(5)
    n, K = 160, 3
    y = rng.integers(0, K, n)
    shifted = (y + 1) % K                       # model 0 is always "wrong" by one position
    probs = np.full((n, 2, K), 0.1 / (K - 1))
    probs[np.arange(n), 0, shifted] = 0.9
    noise = rng.dirichlet(np.ones(K), n)
    probs[:, 1] = noise
    A = probs.argmax(-1)
    d = make_data(A, y, probs)
    sp = Split(np.arange(120), np.arange(120, 160), "manual")
    assert get_combiner("soft").accuracy(d, sp.test, [0, 1]) < 0.5
    res = train_rl_focal(d, sp, fast_cfg(decider=False, fusion_epochs=200), seeds=(0, 1))
    assert res.summary["fusion_pooled"]["mean"] >= 0.9
    assert res.summary["mean_size"]["mean"] == 2.0


def test_multi_task_macro_and_pooled_and_determinism():
    A1, y1 = synthetic(6, n=60, good=1)
    A2, y2 = synthetic(7, n=40, good=3)
    A, y = np.vstack([A1, A2]), np.concatenate([y1, y2])
    tasks = ["a"] * 60 + ["b"] * 40
    d = make_data(A, y, tasks=tasks)
    sp = Split(np.r_[0:45, 60:90], np.r_[45:60, 90:100], "manual")
    cfg = fast_cfg(fusion=False, episodes=3)
    r = train_rl_focal(d, sp, cfg, seeds=(0, 1))
    rec = r.per_seed[0]
    pa, pb = rec["per_task"]["a"]["decider_accuracy"], rec["per_task"]["b"]["decider_accuracy"]
    assert rec["decider_macro"] == pytest.approx((pa + pb) / 2)
    assert rec["decider_pooled"] == pytest.approx((15 * pa + 10 * pb) / 25)
    r_again = train_rl_focal(d, sp, cfg, seeds=(0, 1))
    assert r_again.per_seed[1]["decider_pooled"] == r.per_seed[1]["decider_pooled"]
    g = train_rl_focal(d, sp, cfg, seeds=(0,), per_task=False)
    assert g.tasks == ["all"]


def test_ppo_and_reference_reward_run():
    A, y = synthetic(8, n=60)
    d = make_data(A, y)
    sp = Split(np.arange(40), np.arange(40, 60), "manual")
    r = train_rl_focal(d, sp, fast_cfg(fusion=False, episodes=2, algo="ppo", reward="reference",
                                       test_window="stream"), seeds=(0,))
    assert 0.0 <= r.summary["decider_pooled"]["mean"] <= 1.0


def test_correctness_only_skips_fusion():
    rows = [{"id": str(i), "label": None, "split": "train" if i < 30 else "test",
             "predictions": {f"m{j}": {"answer": None, "correct": int((i + j) % (j + 2) == 0)} for j in range(3)}}
            for i in range(40)]
    d = from_records(rows)
    from masrl.ensemble import split_indices
    r = train_rl_focal(d, split_indices(d), fast_cfg(episodes=2), seeds=(0,))
    assert r.combiner == "majority" and r.summary["fusion_pooled"]["mean"] is None
    assert any("Fusion agent skipped" in n for n in r.notes)


def test_config_validation():
    A, y = synthetic(9, n=20)
    d = make_data(A, y)
    sp = Split(np.arange(10), np.arange(10, 20), "manual")
    for bad in (dict(algo="a2c"), dict(reward="x"), dict(test_window="future"), dict(fusion_loss="mse")):
        with pytest.raises(ValueError):
            train_rl_focal(d, sp, RLFocalConfig(**bad), seeds=(0,))
    with pytest.raises(ValueError):
        train_rl_focal(d, sp, RLFocalConfig(), seeds=())
