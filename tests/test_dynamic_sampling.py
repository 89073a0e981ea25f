"""algorithm.dynamic_sampling: groups, or a group's roles, without a learning signal never reach the loss; the
batch is refilled with further tasks (docs/algorithms.md, "Dynamic sampling"). Hand-built groups, hand-computed
expectations."""
import random
from types import SimpleNamespace

import pytest
import torch

from masrl.algorithms import SIGNAL_GROUPING, compute_advantages, signal_mask
from masrl.config import config_from_dict
from masrl.monitoring.logger import read_metrics
from masrl.usercode.guard import RewardCounts
from masrl.trainer import Trainer
from masrl.training.batch_select import BatchSelector
from masrl.types import Episode, Task, Turn

# Three groups of two episodes, a Solver (S) and a Verifier (V) turn each, per-turn scores:
#   group 0: ep0 S=1   V=1 | ep1 S=0 V=1   -> Solver live (1 vs 0), Verifier dead (1, 1); episode values 1, 0.5: live
#   group 1: ep2 S=1   V=1 | ep3 S=1 V=1   -> dead for both roles and as a group
#   group 2: ep4 S=0.9 V=0 | ep5 S=1 V=0   -> Solver live (0.9 vs 1), Verifier dead; episode values .45, .5: live
SCORES = [1, 1, 0, 1, 1, 1, 1, 1, 0.9, 0, 1, 0]
GROUPS = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
EPISODES = [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
AGENTS = ["S", "V"] * 6
TURN_INDEX = [0, 1] * 6


def _mask(filter, estimator="drmas", **kw):
    args = dict(group_ids=GROUPS, agent_ids=AGENTS, episode_ids=EPISODES, turn_index=TURN_INDEX)
    return signal_mask(torch.tensor(SCORES, dtype=torch.float64), estimator=estimator, filter=filter,
                       **{**args, **kw}).tolist()


def test_role_filter_drops_a_group_for_its_dead_roles_only():
    assert _mask("role") == [True, False, True, False, False, False, False, False, True, False, True, False]


def test_group_filter_drops_only_the_groups_dead_for_every_role():
    assert _mask("group") == [True] * 4 + [False] * 4 + [True] * 4


def test_none_keeps_everything():
    assert _mask("none") == [True] * 12


def test_for_grpo_role_is_the_episode_grouping_and_equals_group():
    assert _mask("role", "grpo") == _mask("group", "grpo") == [True] * 4 + [False] * 4 + [True] * 4


def test_turnwise_uses_its_own_grouping():
    # a third turn (index 2, Solver) only in ep0 and ep1 of group 0, scores 1 and 1: that (g, t, k) set is dead
    # while the Solver's index-0 set of group 0 (1 vs 0) is live
    scores = torch.tensor(SCORES[:4] + [1.0, 1.0], dtype=torch.float64)
    kw = dict(group_ids=GROUPS[:4] + [0, 0], agent_ids=AGENTS[:4] + ["S", "S"], episode_ids=EPISODES[:4] + [0, 1],
              turn_index=TURN_INDEX[:4] + [2, 2])
    assert signal_mask(scores, estimator="drmas_turnwise", filter="role", **kw).tolist() == \
        [True, False, True, False, False, False]
    # drmas pools the Solver's three... four turns of group 0 (1, 0, 1, 1): live
    assert signal_mask(scores, estimator="drmas", filter="role", **kw).tolist() == \
        [True, False, True, False, True, True]


def test_a_singleton_set_is_dead_under_zero_and_live_under_raw():
    kw = dict(group_ids=[0, 0, 0], agent_ids=["S", "S", "V"], episode_ids=[0, 1, 1], turn_index=[0, 0, 1])
    scores = torch.tensor([1.0, 0.0, 1.0])
    assert signal_mask(scores, estimator="drmas", filter="role", **kw).tolist() == [True, True, False]
    assert signal_mask(scores, estimator="drmas", filter="role", singleton="raw", **kw).tolist() == [True] * 3


def test_mean_only_needs_both_its_sets_live():
    # the Solver's set varies (1, 0) but the group's episode values are equal (0.5, 0.5): A = x / (0 + eps) -> 0
    kw = dict(group_ids=[0] * 4, agent_ids=["S", "V"] * 2, episode_ids=[0, 0, 1, 1], turn_index=[0, 1] * 2)
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0])
    assert signal_mask(scores, estimator="drmas_mean_only", filter="role", **kw).tolist() == [False] * 4
    assert signal_mask(scores, estimator="drmas", filter="role", **kw).tolist() == [True] * 4


@pytest.mark.parametrize("estimator", sorted(SIGNAL_GROUPING))
@pytest.mark.parametrize("singleton", ["zero", "raw"])
def test_every_filtered_turn_has_advantage_zero(estimator, singleton):
    """What the filter drops carried no gradient: its advantage under the estimator is exactly 0."""
    gen = random.Random(7)
    for _ in range(20):
        n_groups, rows = 4, []
        for g in range(n_groups):
            for e in range(gen.choice([1, 2, 3])):
                for t in range(gen.choice([1, 2, 3])):
                    rows.append((g, f"{g}-{e}", gen.choice("SV"), t, gen.choice([0.0, 1.0, 1.0, 0.9])))
        g, e, k, t, r = zip(*rows)
        kw = dict(group_ids=g, agent_ids=k, episode_ids=e, turn_index=t, estimator=estimator, singleton=singleton)
        scores = torch.tensor(r, dtype=torch.float64)
        adv = compute_advantages(scores, **kw)
        for filter in ("role", "group"):
            dropped = ~signal_mask(scores, filter=filter, **kw)
            assert adv[dropped].abs().max().item() == 0.0 if dropped.any() else True, (filter, rows)


def test_unknown_estimator_and_filter_are_errors():
    with pytest.raises(ValueError, match="filter must be one of"):
        _mask("episode")
    with pytest.raises(ValueError, match="register_signal_grouping"):
        _mask("role", "my_unknown")


# ---------------------------------------------------------------------- the trainer's side

def _turn(agent, n=3, truncated=False):
    return Turn(agent, "p", [1, 2], list(range(n)), [0.0] * n, "x", truncated=truncated)


def _episode(group, episode, reward, agents=("S", "V")):
    turns = [_turn(a) for a in agents]
    for i, t in enumerate(turns):
        t.turn_index = i
    return Episode(Task(f"t{group}", "q", "a"), turns, reward, group_id=group, episode_id=episode)


def _cfg(tiny_cfg, **over):
    return config_from_dict(tiny_cfg(**{"sft.steps": 0, "eval.before_after": False, "logging.plots": False,
                                        "logging.tensorboard": False, **over}))


def test_select_keeps_only_live_turns_and_counts_them(tiny_cfg):
    cfg = _cfg(tiny_cfg, **{"algorithm.dynamic_sampling.filter": "role", "agents.Solver.max_new_tokens": 8})
    episodes = [_episode(0, 0, 1.0), _episode(0, 1, 0.0), _episode(1, 2, 1.0), _episode(1, 3, 1.0)]
    episodes = [SimpleNamespace(**{**e.__dict__, "turns": [
        Turn("Solver" if t.agent == "S" else "Verifier", "shared", t.prompt_ids, t.response_ids, t.logprobs, t.text,
             turn_index=t.turn_index) for t in e.turns]}) for e in episodes]
    trainer = SimpleNamespace(cfg=cfg)
    turns, keys, scores = Trainer.score_turns(trainer, episodes)
    advantages = Trainer.advantages(trainer, turns, keys, scores)
    kept, kept_adv, metrics = BatchSelector(cfg).select(turns, keys, scores, advantages)
    # team reward: group 0 is live for both roles (1 vs 0), group 1 is dead for both
    assert kept == turns[:4] and kept_adv.tolist() == advantages[:4].tolist()
    assert metrics["agent/Solver/filtered_share"] == 0.5 and metrics["train/groups_with_signal"] == 1.0
    assert metrics["agent/Solver/generated_per_trained_token"] == 2.0


def test_filter_off_passes_the_same_objects(tiny_cfg):
    cfg = _cfg(tiny_cfg)
    turns, adv = [_turn("S")], torch.tensor([0.0])
    kept, kept_adv, metrics = BatchSelector(cfg).select(turns, [(0, 0)], torch.tensor([1.0]), adv)
    assert kept is turns and kept_adv is adv and metrics == {}


class _ScriptedTeam:
    """A trainer's rollout/source/scoring as BatchSelector.refill sees them: generation r returns episodes whose
    rewards come from ``script[r]`` (one list of G rewards per task drawn)."""

    def __init__(self, cfg, script):
        self.cfg, self.script, self.calls = cfg, script, []
        self.source = SimpleNamespace(train=[Task(f"t{i}", "q", "a") for i in range(20)])
        self.team = SimpleNamespace(last_reward_counts=RewardCounts(calls=6))  # the first generation's

    def rollout(self, tasks, groups, *, seed, where):
        rewards = self.script[len(self.calls) + 2]  # the first generation is given
        self.calls.append((len(tasks), sorted(set(groups)), where))
        self.team.last_reward_counts = RewardCounts(calls=len(tasks), errors=1)
        out = []
        for i, (task, g) in enumerate(zip(tasks, groups)):
            r = rewards[sorted(set(groups)).index(g)][i % self.cfg.trainer.group_size]
            e = _episode(g, i, r, agents=("Solver", "Verifier"))
            e.task = task
            out.append(e)
        return out

    def score_turns(self, episodes):
        return Trainer.score_turns(self, episodes)


def test_refill_draws_until_the_batch_has_signal(tiny_cfg, capsys):
    cfg = _cfg(tiny_cfg, **{"algorithm.dynamic_sampling.filter": "group", "algorithm.dynamic_sampling.refill": True,
                            "algorithm.dynamic_sampling.max_rounds": 3, "trainer.batch_size": 3,
                            "trainer.group_size": 2})
    # first generation: 3 groups, one live; second: 2 groups drawn, one live; third: 1 group drawn, live -> 3 live
    script = {2: [[1, 1], [0, 1]], 3: [[1, 0]]}
    team = _ScriptedTeam(cfg, script)
    first = [_episode(g, 2 * g + j, r, agents=("Solver", "Verifier"))
             for g, rs in enumerate([[0, 0], [1, 0], [1, 1]]) for j, r in enumerate(rs)]
    selector = BatchSelector(cfg)
    batch = team.source.train[:3]
    out = selector.refill(team, first, batch, random.Random(0), seed=1, step=0)
    assert [c[:2] for c in team.calls] == [(4, [3, 4]), (2, [5])]
    assert selector.rounds == 3 and selector.live_groups(team, out) == {1, 4, 5}
    assert [t.info.get("generation", 1) for e in out for t in e.turns][::2] == [1] * 6 + [2] * 4 + [3] * 2
    ids = [e.episode_id for e in out]
    assert len(set(ids)) == len(ids) == 12
    drawn = {e.task.id for e in out[6:]}
    assert not drawn & {t.id for t in batch}  # later generations draw tasks not yet used this step
    counts = team.team.last_reward_counts  # the step's reward calls: every generation's
    assert (counts.calls, counts.errors) == (6 + 4 + 2, 2)
    assert capsys.readouterr().err == ""


def test_refill_stops_at_max_rounds_and_says_so_once(tiny_cfg, capsys):
    cfg = _cfg(tiny_cfg, **{"algorithm.dynamic_sampling.filter": "role", "algorithm.dynamic_sampling.refill": True,
                            "algorithm.dynamic_sampling.max_rounds": 2, "trainer.batch_size": 2,
                            "trainer.group_size": 2})
    team = _ScriptedTeam(cfg, {2: [[1, 1], [0, 0]]})
    first = [_episode(g, 2 * g + j, 1.0, agents=("Solver", "Verifier")) for g in range(2) for j in range(2)]
    selector = BatchSelector(cfg)
    selector.refill(team, first, team.source.train[:2], random.Random(0), seed=1, step=4)
    assert len(team.calls) == 1 and selector.rounds == 2
    err = capsys.readouterr().err
    assert err.count("[masrl] step 5: dynamic sampling found 0 of 2 groups") == 1


def test_a_filtered_turn_never_reaches_the_update(tiny_cfg, monkeypatch):
    cfg = _cfg(tiny_cfg, **{"algorithm.dynamic_sampling.filter": "role", "trainer.total_steps": 2, "sft.steps": 40})
    seen, chosen = [], []
    with Trainer(cfg, progress=False) as trainer:
        real_update, real_select = trainer.runtime.update, trainer.selector.select

        def recording_update(policies, rows, **kwargs):
            seen.append(sorted((r.agent, tuple(r.prompt_ids), tuple(r.response_ids), r.advantage)
                               for prows in rows.values() for r in prows))
            return real_update(policies, rows, **kwargs)

        def recording_select(turns, keys, scores, advantages):
            out = real_select(turns, keys, scores, advantages)
            live = trainer.selector.signal(turns, keys, scores)
            chosen.append((sorted((t.agent, tuple(t.prompt_ids), tuple(t.response_ids), float(a))
                                  for t, a, s in zip(turns, advantages.tolist(), live.tolist()) if s and t.response_ids),
                           [a for a, s in zip(advantages.tolist(), live.tolist()) if not s]))
            return out

        monkeypatch.setattr(trainer.runtime, "update", recording_update)
        monkeypatch.setattr(trainer.selector, "select", recording_select)
        trainer.fit()
    assert len(seen) == 2
    assert sum(len(rows) for rows in seen) > 0 and sum(len(d) for _, d in chosen) > 0  # some kept, some dropped
    for rows, (live, dropped_adv) in zip(seen, chosen):
        assert rows == live  # exactly the live turns, each once, with their own advantage
        assert all(a == 0.0 for a in dropped_adv)
    train = [r for r in read_metrics(cfg.run_dir) if r["phase"] == "train"]
    assert all("agent/Solver/filtered_share" in r and r["train/sampling_rounds"] == 1.0 for r in train)
