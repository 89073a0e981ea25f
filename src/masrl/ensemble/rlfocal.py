"""RL-Focal (arXiv:2502.04492): a Decider agent picks the ensemble, a Fusion agent combines it.

* **Decider** — a policy over include/exclude masks. State ``s_t = [b_{t-1}, F(b_{t-1}), |b_{t-1}|/N]``
  (previous mask, RL-Focal fitness of that mask on a sliding window of the last ``window``
  labeled rows, normalised size); network ``Linear(N+2, 128) -> ReLU -> N heads of 2 logits``
  (independent Bernoulli include/exclude per model). Reward on item ``t``:
  ``(2 c_t - 1) - alpha |b_t| / N`` with ``c_t`` the combiner's correctness (``reward="spec"``), or
  the reference's ``+1`` if correct else ``-1 - alpha |b_t| / N`` (``reward="reference"``).
  Trained with REINFORCE (discounted returns standardised per update buffer) or PPO-clip.
* **Fusion** — a learned combiner: ``MLP(N*K -> 100 -> 100 -> K)``, sigmoid hidden layers,
  Xavier init, over the concatenated per-choice probabilities with unselected models zeroed.
  Trained with cross-entropy on the training labels (``fusion_loss="ce"``, default) or, as in the
  reference, with REINFORCE on a ±1 reward (``"reinforce"``; it learns far more slowly here).

Schedule: train the Decider with the vote combiner, freeze it, train Fusion on the Decider's
masks, evaluate both on the test split. **Deviation from the reference:** there are no
test-time updates (the reference keeps updating both agents from test labels). By default the
test-time state uses the fitness of the last ``window`` *training* rows, so no test label is
read at all (``test_window="stream"`` slides the window over already-answered test items).

Everything is vectorised: the reward and fitness of every mask at every stream position are
precomputed as tables (``2^N`` masks, ``N <= 12``), and all (task, seed) pairs train in lockstep
as one batch of independent networks (batched matmuls, per-network Adam state is elementwise).
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np
import torch

from masrl.ensemble.combiners import Combiner, get_combiner
from masrl.ensemble.data import EnsembleData, InputError, Split

__all__ = ["RLFocalConfig", "RLFocalResult", "train_rl_focal", "mask_bits", "mask_tables", "window_fitness_table",
           "BBH_PRESET", "PRESETS"]

MAX_TABLE_MODELS = 12


@dataclass
class RLFocalConfig:
    # Decider
    decider: bool = True                     # False: no Decider, every item uses all models (ablation)
    alpha: float = 0.6                       # size penalty
    fitness_weights: tuple = (0.5, 0.5, 0.0)  # (focal diversity, vote accuracy, Fleiss' kappa) in the state
    window: int = 50                         # sliding window (rows) for the state's fitness
    episodes: int = 20                       # passes over the training stream
    rollouts: int = 8                        # parallel rollouts per network
    update_every: int = 50                   # stream steps per policy update
    gamma: float = 0.0                       # return discount (reference: 0.99; see docs)
    lr: float = 1e-2
    hidden: int = 128
    algo: str = "reinforce"                  # "reinforce" | "ppo"
    ppo_epochs: int = 4
    clip: float = 0.2
    reward: str = "spec"                     # "spec" | "reference"
    test_window: str = "train"               # "train" | "stream"
    combiner: str = "auto"                   # Decider's combiner: plurality (answers) or majority (correctness only)
    # Fusion
    fusion: bool = True
    fusion_hidden: tuple = (100, 100)
    fusion_epochs: int = 300
    fusion_lr: float = 3e-3
    fusion_loss: str = "ce"                  # "ce" | "reinforce" (reference-style, learns far slower)
    fusion_weight_decay: float = 0.0
    threads: int | None = 1                  # torch threads while training (small ops: 1 avoids oversubscription)

    def to_dict(self) -> dict:
        return asdict(self)


BBH_PRESET = dict(alpha=0.6, fitness_weights=(0.5, 0.5, 0.0))
PRESETS = {
    "bbh": BBH_PRESET,
    "musr": BBH_PRESET,
    "mmlu": dict(alpha=1.0, fitness_weights=(0.5, 0.0, 0.5)),
    "gsm8k": dict(alpha=1.0, fitness_weights=(0.3, 0.3, 0.3)),
    "gpqa": dict(alpha=0.6, fitness_weights=(0.3, 0.3, 0.3)),
}


# ----------------------------------------------------------------------------- tables
def mask_bits(n_models: int) -> np.ndarray:
    """``(2^N, N)`` bool: bit i of mask integer m is ``(m >> i) & 1``."""
    m = np.arange(2 ** n_models)
    return ((m[:, None] >> np.arange(n_models)[None, :]) & 1).astype(bool)


def mask_tables(data: EnsembleData, rows: np.ndarray, combiner: Combiner) -> np.ndarray:
    """``(len(rows), 2^N)``: the combiner's correctness of every member mask on every row."""
    bits = mask_bits(data.n_models)
    out = np.zeros((len(rows), len(bits)), dtype=np.float32)
    for m in range(1, len(bits)):
        out[:, m] = combiner.correct_masked(data, rows, bits[m])
    return out


def window_fitness_table(data: EnsembleData, rows: np.ndarray, vote: np.ndarray, window: int,
                         weights: Sequence[float], floor: float = -1.0) -> np.ndarray:
    """``(len(rows)+1, 2^N)``: fitness of every mask on rows ``[max(0, t-window), t)`` of the stream ``rows``.

    ``vote`` is ``mask_tables`` on the same rows (vote accuracy). Fitness is
    ``w_f * focal + w_v * vote + w_k * fleiss``; masks with fewer than 2 members get ``floor``
    (RL-Focal uses -99, which would swamp a network input); an empty window gives 0.
    Computed with cumulative sums, so the cost does not depend on the window length.
    """
    wf, wv, wk = weights
    n, N = len(rows), data.n_models
    bits = mask_bits(N)
    C = data.correct[rows]
    fail = ~C
    out = np.zeros((n + 1, len(bits)), dtype=np.float32)
    t = np.arange(n + 1)
    lo = np.maximum(0, t - window)
    nw = (t - lo).astype(np.float64)

    def wsum(x: np.ndarray) -> np.ndarray:  # window sums of per-row values along axis 0
        cs = np.concatenate([np.zeros((1,) + x.shape[1:]), np.cumsum(x, axis=0)], axis=0)
        return cs[t] - cs[lo]

    ratings = None
    if wk:
        if data.has_answers:
            ratings = data.answers[rows] + 1  # 0 = abstain category
        else:
            ratings = C.astype(np.int64)
        _, ratings = np.unique(ratings, return_inverse=True)
        ratings = ratings.reshape(n, N)
        n_cat = int(ratings.max()) + 1
        if n_cat > 2000:
            raise InputError(f"Fleiss' kappa in the fitness with {n_cat} answer categories is not supported; "
                             "set its weight to 0")
    with np.errstate(divide="ignore", invalid="ignore"):
        for m in range(len(bits)):
            S = np.flatnonzero(bits[m])
            M = len(S)
            if M < 2:
                out[1:, m] = floor
                continue
            val = np.zeros(n + 1)
            if wf:
                f = fail[:, S].sum(1).astype(np.float64)
                s1 = wsum(fail[:, S] * f[:, None])
                s2 = wsum(fail[:, S] * (f * (f - 1))[:, None])
                lam = np.where(s1 > 0, 1.0 - s2 / ((M - 1) * s1), 1.0)
                val += wf * lam.mean(1)
            if wv:
                val += wv * np.where(nw > 0, wsum(vote[:, m].astype(np.float64)) / np.maximum(nw, 1), 0.0)
            if wk:
                r = ratings[:, S]
                counts = np.zeros((n, n_cat))
                np.add.at(counts, (np.repeat(np.arange(n), M), r.ravel()), 1.0)
                p_i = (counts * (counts - 1)).sum(1) / (M * (M - 1))
                tot = wsum(counts)
                pbar = wsum(p_i) / np.maximum(nw, 1)
                pe = ((tot / np.maximum(nw, 1)[:, None] / M) ** 2).sum(1)
                kappa = np.where(pe >= 1 - 1e-12, 1.0, (pbar - pe) / (1 - pe))
                val += wk * np.where(nw > 0, kappa, 0.0)
            val[0] = 0.0
            out[:, m] = val
    return out


# ----------------------------------------------------------------------------- batched nets
class _BatchedMLP:
    """Q independent MLPs evaluated with batched matmuls; params are (Q, in, out) tensors."""

    def __init__(self, Q: int, sizes: Sequence[int], gens: Sequence[torch.Generator], init: str,
                 act: str):
        self.act = act
        self.W, self.b = [], []
        for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
            W = torch.empty(Q, fan_in, fan_out)
            for q in range(Q):
                if init == "xavier":
                    bound = math.sqrt(6.0 / (fan_in + fan_out))
                else:  # torch.nn.Linear default
                    bound = 1.0 / math.sqrt(fan_in)
                W[q].uniform_(-bound, bound, generator=gens[q])
            if init == "xavier":
                b = torch.full((Q, 1, fan_out), 0.01)
            else:
                b = torch.empty(Q, 1, fan_out)
                for q in range(Q):
                    b[q].uniform_(-1.0 / math.sqrt(fan_in), 1.0 / math.sqrt(fan_in), generator=gens[q])
            self.W.append(W.requires_grad_())
            self.b.append(b.requires_grad_())

    def params(self) -> list[torch.Tensor]:
        return self.W + self.b

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for i, (W, b) in enumerate(zip(self.W, self.b)):
            x = torch.baddbmm(b, x, W)
            if i < len(self.W) - 1:
                x = torch.relu(x) if self.act == "relu" else torch.sigmoid(x)
        return x

    def state(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.params()]

    def load_rows(self, saved: list[torch.Tensor], which: torch.Tensor) -> None:
        """Copy the saved params of networks ``which`` (bool (Q,)) back in place."""
        with torch.no_grad():
            for p, s in zip(self.params(), saved):
                p[which] = s[which]


# ----------------------------------------------------------------------------- results
@dataclass
class RLFocalResult:
    config: dict
    seeds: list[int]
    tasks: list[str]
    combiner: str
    per_seed: list[dict]
    summary: dict
    seconds: float
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _mean_std(vals: Sequence[float]) -> dict:
    a = np.asarray([v for v in vals if v is not None and not np.isnan(v)], dtype=float)
    if len(a) == 0:
        return {"mean": None, "std": None, "n": 0}
    return {"mean": float(a.mean()), "std": float(a.std(ddof=1)) if len(a) > 1 else 0.0, "n": int(len(a))}


# ----------------------------------------------------------------------------- training
def train_rl_focal(data: EnsembleData, split: Split, config: RLFocalConfig | None = None,
                   seeds: Sequence[int] = (0, 1, 2, 3, 4), per_task: bool = True,
                   verbose: bool = False) -> RLFocalResult:
    """Train Decider (+ Fusion) per task (or once on all rows) for each seed; evaluate on the test split.

    Returns per-seed test accuracies (pooled over items and macro over tasks), the mean ensemble
    size, mask usage, and mean ± std over seeds.
    """
    cfg = config or RLFocalConfig()
    prev_threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        return _train_rl_focal(data, split, cfg, seeds, per_task, verbose)
    finally:
        torch.set_num_threads(prev_threads)


def _train_rl_focal(data: EnsembleData, split: Split, cfg: RLFocalConfig, seeds: Sequence[int], per_task: bool,
                    verbose: bool) -> RLFocalResult:
    """The stages: check the config, build each problem's tables, train the Deciders (one per problem and
    seed), evaluate them greedily, train the Fusion agents, aggregate per seed."""
    t_start = time.time()
    _check_config(cfg, data.n_models)
    comb = get_combiner(cfg.combiner, data)
    notes = []
    do_fusion = cfg.fusion and data.has_probs
    if cfg.fusion and not data.has_probs:
        notes.append("Fusion agent skipped: the data has no per-choice probabilities")
    seeds = list(seeds)
    if not seeds:
        raise InputError("need at least one seed")
    probs_ = _problems(data, split, per_task)
    tables = _Tables.build(data, probs_, comb, cfg)
    if verbose:
        print(f"tables for {len(probs_)} problem(s), {2 ** data.n_models} masks: {time.time() - t_start:.1f}s")

    decider = _Decider(tables, cfg, seeds)
    best_episode, history = decider.train(cfg, verbose)
    tr_masks, tr_corr, _ = decider.greedy_pass(decider.R_tr, decider.F_tr, decider.T_tr)
    te_masks, te_corr, _ = decider.greedy_pass(decider.R_te, decider.F_te, decider.T_te)
    fusion_corr = None
    if do_fusion:
        fusion_corr = _train_fusion(data, probs_, cfg, decider.prob_of, decider.gens, tr_masks, te_masks,
                                    tables.bits, tables.T_tr, tables.T_te, decider.Q)

    tasks = [p[0] for p in probs_]
    per_seed = [_seed_record(data, tables, tasks, s, si, len(seeds), tr_corr,
                             te_masks.numpy(), te_corr.numpy(), fusion_corr, best_episode)
                for si, s in enumerate(seeds)]
    summary = {key: _mean_std([r.get(key) for r in per_seed])
               for key in ("decider_pooled", "decider_macro", "fusion_pooled", "fusion_macro", "mean_size")}
    summary["history"] = history
    return RLFocalResult(config=cfg.to_dict(), seeds=seeds, tasks=tasks, combiner=comb.name, per_seed=per_seed,
                         summary=summary, seconds=time.time() - t_start, notes=notes)


def _check_config(cfg: RLFocalConfig, n_models: int) -> None:
    if n_models > MAX_TABLE_MODELS:
        raise InputError(f"RL-Focal here precomputes 2^N mask tables; N={n_models} > {MAX_TABLE_MODELS} "
                         "is not supported")
    if cfg.fusion_loss not in ("ce", "reinforce"):
        raise ValueError(f"fusion_loss must be 'ce' or 'reinforce', got {cfg.fusion_loss!r}")
    if cfg.algo not in ("reinforce", "ppo"):
        raise ValueError(f"algo must be 'reinforce' or 'ppo', got {cfg.algo!r}")
    if cfg.reward not in ("spec", "reference"):
        raise ValueError(f"reward must be 'spec' or 'reference', got {cfg.reward!r}")
    if cfg.test_window not in ("train", "stream"):
        raise ValueError(f"test_window must be 'train' or 'stream', got {cfg.test_window!r}")


def _problems(data: EnsembleData, split: Split, per_task: bool) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """``(name, train rows, test rows)`` per task with both (or one problem ``all``)."""
    if per_task:
        probs_ = [(t, data.task_rows(t, split.train), data.task_rows(t, split.test)) for t in data.task_names()]
        probs_ = [p for p in probs_ if len(p[1]) > 0 and len(p[2]) > 0]
    else:
        probs_ = [("all", np.sort(split.train), np.sort(split.test))]
    if not probs_:
        raise InputError("no task has both training and test rows")
    return probs_


@dataclass
class _Tables:
    """Per problem (padded to the longest stream): each mask's correctness per row ``R`` and the
    window fitness of each mask before each row ``F``, for the train and test streams."""

    R_tr: np.ndarray   # (P, Tm, masks)
    R_te: np.ndarray   # (P, Tme, masks)
    F_tr: np.ndarray   # (P, Tm + 1, masks)
    F_te: np.ndarray   # (P, Tme + 1, masks)
    T_tr: np.ndarray   # (P,) train rows per problem
    T_te: np.ndarray   # (P,) test rows per problem
    bits: np.ndarray   # (masks, N) mask -> included models
    sizes: np.ndarray  # (masks,) models per mask

    @classmethod
    def build(cls, data: EnsembleData, probs_: list, comb: Combiner, cfg: RLFocalConfig) -> "_Tables":
        N = data.n_models
        n_masks = 2 ** N
        bits_np = mask_bits(N)
        P = len(probs_)
        T_tr = np.array([len(p[1]) for p in probs_])
        T_te = np.array([len(p[2]) for p in probs_])
        Tm, Tme = int(T_tr.max()), int(T_te.max())
        R_tr = np.zeros((P, Tm, n_masks), np.float32)
        R_te = np.zeros((P, Tme, n_masks), np.float32)
        F_tr = np.zeros((P, Tm + 1, n_masks), np.float32)
        F_te = np.zeros((P, Tme + 1, n_masks), np.float32)
        for i, (task, tr, te) in enumerate(probs_):
            stream = np.concatenate([tr, te])
            R = mask_tables(data, stream, comb)
            w = max(1, min(cfg.window, len(tr)))
            F = window_fitness_table(data, stream, R, w, cfg.fitness_weights)
            R_tr[i, :len(tr)] = R[:len(tr)]
            R_te[i, :len(te)] = R[len(tr):]
            F_tr[i, :len(tr) + 1] = F[:len(tr) + 1]
            if cfg.test_window == "stream":
                F_te[i, :len(te) + 1] = F[len(tr):]
            else:
                F_te[i, :] = F[len(tr)][None, :]  # frozen at the end of the training stream
        return cls(R_tr, R_te, F_tr, F_te, T_tr, T_te, bits_np, bits_np.sum(1))


class _Decider:
    """Q = P * S independent Decider networks (problem p, seed s -> network p * S + s) and their tables."""

    def __init__(self, tables: _Tables, cfg: RLFocalConfig, seeds: list[int]):
        self.cfg = cfg
        N = self.N = tables.bits.shape[1]
        S = len(seeds)
        Q = self.Q = len(tables.T_tr) * S
        self.prob_of = torch.arange(Q) // S          # network q -> problem
        seed_of = [seeds[q % S] for q in range(Q)]
        self.gens = [torch.Generator().manual_seed(1_000_003 * s + 7919 * (q // S)) for q, s in enumerate(seed_of)]
        self.sample_gen = torch.Generator().manual_seed(int(sum(seeds) * 31 + len(seeds)))
        self.policy = _BatchedMLP(Q, [N + 2, cfg.hidden, 2 * N], self.gens, init="default", act="relu")
        self.opt = torch.optim.Adam(self.policy.params(), lr=cfg.lr)
        self.R_tr = torch.from_numpy(tables.R_tr)[self.prob_of]        # (Q, Tm, masks)
        self.F_tr = torch.from_numpy(tables.F_tr)[self.prob_of]        # (Q, Tm+1, masks)
        self.R_te = torch.from_numpy(tables.R_te)[self.prob_of]
        self.F_te = torch.from_numpy(tables.F_te)[self.prob_of]
        self.T_tr = torch.from_numpy(tables.T_tr)[self.prob_of]
        self.T_te = torch.from_numpy(tables.T_te)[self.prob_of]
        self.bits = torch.from_numpy(tables.bits).float()  # (masks, N)
        self.sizes = torch.from_numpy(tables.sizes).float()
        self.pow2 = (2 ** torch.arange(N)).long()
        self.full_mask = 2 ** N - 1

    def reward_of(self, c: torch.Tensor, size: torch.Tensor) -> torch.Tensor:
        pen = self.cfg.alpha * size / self.N
        if self.cfg.reward == "spec":
            return 2 * c - 1 - pen
        return c - (1 - c) * (1 + pen)

    def state_of(self, mask: torch.Tensor, F_at: torch.Tensor) -> torch.Tensor:
        # mask (Q, B) long; F_at (Q, masks) fitness table row at this step
        f = torch.gather(F_at, 1, mask)
        return torch.cat([self.bits[mask], f.unsqueeze(-1), (self.sizes[mask] / self.N).unsqueeze(-1)], dim=-1)

    def logits_of(self, x: torch.Tensor) -> torch.Tensor:
        return self.policy(x).view(self.Q, x.shape[1], self.N, 2)

    def greedy_pass(self, R: torch.Tensor, F: torch.Tensor, T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                     torch.Tensor]:
        """Deterministic rollout (mode of each head); returns (masks (Q, Tmax), correct, valid)."""
        Tmax = R.shape[1]
        mask = torch.full((self.Q, 1), self.full_mask, dtype=torch.long)
        masks = torch.zeros(self.Q, Tmax, dtype=torch.long)
        with torch.no_grad():
            for t in range(Tmax):
                x = self.state_of(mask, F[:, t])
                act = self.logits_of(x).argmax(-1)  # (Q, 1, N), 1 = include
                mask = (act * self.pow2).sum(-1)
                masks[:, t] = mask[:, 0]
        corr = torch.gather(R, 2, masks.unsqueeze(-1)).squeeze(-1)
        valid = torch.arange(Tmax)[None, :] < T[:, None]
        return masks, corr * valid, valid

    def train(self, cfg: RLFocalConfig, verbose: bool) -> tuple[torch.Tensor, list[dict]]:
        """``cfg.episodes`` passes over the training stream, keeping each network's best episode
        (judged by its greedy mean reward on the training stream). Returns (best episode per network,
        history). Without a Decider (``cfg.decider`` false) every network always includes every model."""
        Q, N = self.Q, self.N
        if not cfg.decider:
            with torch.no_grad():  # a Decider that always includes every model
                self.policy.W[-1].zero_()
                self.policy.b[-1].copy_(torch.tensor([-1.0, 1.0]).repeat(N).view(1, 1, 2 * N))
        episodes = cfg.episodes if cfg.decider else 0
        best_score = torch.full((Q,), -math.inf)
        best_state = self.policy.state()
        best_episode = torch.zeros(Q, dtype=torch.long)
        history = []
        for ep in range(episodes):
            self._episode(cfg)
            masks, corr, valid = self.greedy_pass(self.R_tr, self.F_tr, self.T_tr)
            score = (self.reward_of(corr, self.sizes[masks]) * valid).sum(1) / self.T_tr
            improved = score > best_score
            best_score = torch.where(improved, score, best_score)
            best_episode = torch.where(improved, torch.full_like(best_episode, ep), best_episode)
            for bs, s in zip(best_state, self.policy.state()):
                bs[improved] = s[improved]
            train_acc = (corr.sum(1) / self.T_tr)
            history.append({"episode": ep, "train_greedy_acc_mean": float(train_acc.mean()),
                            "train_greedy_reward_mean": float(score.mean())})
            if verbose:
                print(f"episode {ep}: greedy train acc {float(train_acc.mean()):.4f} reward {float(score.mean()):.4f}")
        if episodes:
            self.policy.load_rows(best_state, torch.ones(Q, dtype=torch.bool))
        return best_episode, history

    def _episode(self, cfg: RLFocalConfig) -> None:
        """One pass of ``cfg.rollouts`` sampled rollouts per network, updated every ``update_every`` steps."""
        Q, B, U = self.Q, cfg.rollouts, max(1, cfg.update_every)
        Tm = self.R_tr.shape[1]
        mask = torch.full((Q, B), self.full_mask, dtype=torch.long)
        buf_x, buf_a, buf_r, buf_v = [], [], [], []
        for t in range(Tm):
            with torch.no_grad():
                x = self.state_of(mask, self.F_tr[:, t])
                p_in = torch.softmax(self.logits_of(x), -1)[..., 1]
                act = (torch.rand(p_in.shape, generator=self.sample_gen) < p_in).long()
                mask = (act * self.pow2).sum(-1)
                c = torch.gather(self.R_tr[:, t], 1, mask)
                r = self.reward_of(c, self.sizes[mask])
                valid = (t < self.T_tr).unsqueeze(1).expand(Q, B)
            buf_x.append(x)
            buf_a.append(act)
            buf_r.append(r * valid)
            buf_v.append(valid)
            if len(buf_x) == U or t == Tm - 1:
                _update(self.policy, self.opt, cfg, buf_x, buf_a, buf_r, buf_v, Q, self.N)
                buf_x, buf_a, buf_r, buf_v = [], [], [], []


def _seed_record(data: EnsembleData, tables: _Tables, tasks: list[str], seed: int, si: int, S: int,
                 tr_corr: torch.Tensor, te_masks_np: np.ndarray, te_corr_np: np.ndarray,
                 fusion_corr: np.ndarray | None, best_episode: torch.Tensor) -> dict:
    """One seed's test results: per task and pooled over items / macro over tasks."""
    per_task = {}
    dec_c, fus_c, n_tot, size_tot = 0.0, 0.0, 0, 0.0
    for pi in range(len(tasks)):
        q = pi * S + si
        n_te = int(tables.T_te[pi])
        ms = te_masks_np[q, :n_te]
        acc = float(te_corr_np[q, :n_te].mean())
        vals, counts = np.unique(ms, return_counts=True)
        usage = {"+".join(data.models[j] for j in np.flatnonzero(tables.bits[v])) or "(none)": int(c)
                 for v, c in sorted(zip(vals, counts), key=lambda vc: -vc[1])}
        entry = {"n_test": n_te, "decider_accuracy": acc, "mean_size": float(tables.sizes[ms].mean()),
                 "mask_usage": usage, "train_greedy_accuracy": float(tr_corr[q, :tables.T_tr[pi]].mean()),
                 "best_episode": int(best_episode[q])}
        dec_c += acc * n_te
        size_tot += float(tables.sizes[ms].sum())
        n_tot += n_te
        if fusion_corr is not None:
            facc = float(fusion_corr[q, :n_te].mean())
            entry["fusion_accuracy"] = facc
            fus_c += facc * n_te
        per_task[tasks[pi]] = entry
    rec = {"seed": seed, "decider_pooled": dec_c / n_tot,
           "decider_macro": float(np.mean([e["decider_accuracy"] for e in per_task.values()])),
           "mean_size": size_tot / n_tot, "per_task": per_task}
    if fusion_corr is not None:
        rec["fusion_pooled"] = fus_c / n_tot
        rec["fusion_macro"] = float(np.mean([e["fusion_accuracy"] for e in per_task.values()]))
    return rec


def _update(policy: _BatchedMLP, opt: torch.optim.Optimizer, cfg: RLFocalConfig, buf_x, buf_a, buf_r, buf_v,
            Q: int, N: int) -> None:
    """One REINFORCE / PPO update on a segment of the stream (returns truncated at the segment end)."""
    X = torch.stack(buf_x, 1)           # (Q, L, B, D)
    A = torch.stack(buf_a, 1)           # (Q, L, B, N)
    Rw = torch.stack(buf_r, 1)          # (Q, L, B)
    V = torch.stack(buf_v, 1).float()   # (Q, L, B)
    L = X.shape[1]
    G = torch.zeros_like(Rw)
    run = torch.zeros_like(Rw[:, 0])
    for i in range(L - 1, -1, -1):
        run = Rw[:, i] + cfg.gamma * run * V[:, i]
        G[:, i] = run
    nv = V.sum((1, 2)).clamp(min=1)
    mean = (G * V).sum((1, 2)) / nv
    var = (((G - mean[:, None, None]) ** 2) * V).sum((1, 2)) / (nv - 1).clamp(min=1)
    Adv = (G - mean[:, None, None]) / (var.sqrt()[:, None, None] + 1e-9) * V
    Xf = X.reshape(Q, -1, X.shape[-1])
    Af = A.reshape(Q, -1, N)
    Advf = Adv.reshape(Q, -1)
    Vf = V.reshape(Q, -1)

    def logp() -> torch.Tensor:
        lp = torch.log_softmax(policy(Xf).view(Q, Xf.shape[1], N, 2), -1)
        return torch.gather(lp, -1, Af.unsqueeze(-1)).squeeze(-1)  # (Q, L*B, N)

    if cfg.algo == "reinforce":
        lp = logp()
        loss = -((Advf.unsqueeze(-1) * lp).sum((1, 2)) / (nv * N)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return
    with torch.no_grad():
        old = logp().sum(-1)
    for _ in range(cfg.ppo_epochs):
        new = logp().sum(-1)
        ratio = torch.exp(new - old)
        surr = torch.min(ratio * Advf, torch.clamp(ratio, 1 - cfg.clip, 1 + cfg.clip) * Advf)
        loss = -((surr * Vf).sum(1) / nv).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _train_fusion(data: EnsembleData, probs_, cfg: RLFocalConfig, prob_of: torch.Tensor, gens, tr_masks, te_masks,
                  bits_np: np.ndarray, T_tr: np.ndarray, T_te: np.ndarray, Q: int) -> np.ndarray:
    """Train one Fusion MLP per (problem, seed) on the frozen Decider's training masks; test-set correctness."""
    N = data.n_models
    K = data.probs.shape[2]
    P = len(probs_)
    Tm, Tme = int(T_tr.max()), int(T_te.max())

    def inputs(which: int, Tmax: int):
        X = np.zeros((P, Tmax, N, K), np.float32)
        Y = np.full((P, Tmax), -1, np.int64)
        choice_ok = np.zeros((P, Tmax, K), bool)
        for i, p in enumerate(probs_):
            rows = p[which]
            X[i, :len(rows)] = data.probs[rows]
            Y[i, :len(rows)] = data.labels[rows]
            nc = data.n_choices[rows] if data.n_choices is not None else np.full(len(rows), K)
            choice_ok[i, :len(rows)] = np.arange(K)[None, :] < np.where(nc > 0, nc, K)[:, None]
        return torch.from_numpy(X)[prob_of], torch.from_numpy(Y)[prob_of], torch.from_numpy(choice_ok)[prob_of]

    Xtr, Ytr, OKtr = inputs(1, Tm)
    Xte, Yte, OKte = inputs(2, Tme)
    bits_t = torch.from_numpy(bits_np).float()
    Xtr = (Xtr * bits_t[tr_masks][..., None]).reshape(Q, Tm, N * K)
    Xte = (Xte * bits_t[te_masks][..., None]).reshape(Q, Tme, N * K)
    Ttr = torch.from_numpy(T_tr)[prob_of]
    valid = (torch.arange(Tm)[None, :] < Ttr[:, None]) & (Ytr >= 0)
    nv = valid.sum(1).clamp(min=1)
    sizes = [N * K, *cfg.fusion_hidden, K]
    net = _BatchedMLP(Q, sizes, gens, init="xavier", act="sigmoid")
    opt = torch.optim.Adam(net.params(), lr=cfg.fusion_lr, weight_decay=cfg.fusion_weight_decay)
    sample_gen = torch.Generator().manual_seed(12345 + Q)
    neg = torch.finfo(torch.float32).min
    Ysafe = Ytr.clamp(min=0)
    for _ in range(cfg.fusion_epochs):
        logits = net(Xtr).masked_fill(~OKtr, neg)
        logp = torch.log_softmax(logits, -1)
        if cfg.fusion_loss == "ce":
            nll = -torch.gather(logp, -1, Ysafe.unsqueeze(-1)).squeeze(-1)
            loss = ((nll * valid).sum(1) / nv).sum()
        else:
            with torch.no_grad():
                a = torch.multinomial(logp.exp().reshape(-1, K), 1, generator=sample_gen).reshape(Q, Tm)
                r = torch.where(a == Ytr, 1.0, -1.0)
                base = (r * valid).sum(1, keepdim=True) / nv[:, None]
            lpa = torch.gather(logp, -1, a.unsqueeze(-1)).squeeze(-1)
            loss = -(((r - base) * lpa * valid).sum(1) / nv).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        pred = net(Xte).masked_fill(~OKte, neg).argmax(-1)
    return ((pred == Yte) & (Yte >= 0)).float().numpy()
