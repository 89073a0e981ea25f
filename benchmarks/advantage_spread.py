"""Per-agent advantage scales under a global baseline (grpo) vs agent-wise normalisation (drmas).

Synthetic math-like batch: 64 groups x G=8 episodes. In each episode the Solver makes 1-3
attempts (it retries after a wrong attempt; each attempt is right with the task's solve rate)
and a Verifier then judges the final answer once.

* Solver turn score = team reward (final answer right) - 0.5 if that turn is malformed (15%).
* Verifier score = its own reward: 1 if its verdict is right (85%), else 0, - 0.5 if
  malformed (5%). Different reward statistics from the Solver, as in the Dr. MAS paper.

Estimators: any registry name, plus ``global_turn``: one baseline over all turns of the
group whatever the agent, A_i = (r_i - mu_g)/(sigma_g + eps) over turn scores (computed as
``drmas`` with a single agent id) - the "global normalization baseline" of the paper.
``grpo`` is the reference's vanilla GRPO (episode-averaged scores).

For each estimator and agent the script prints the number of turns, mean A, RMS of A (the
scale a policy gradient sees), pooled std, mean |A|, and the mean within-(group, agent) std
over sets whose scores are not all equal, and the share of turns with A = 0 exactly (sets
whose scores are all equal carry no signal under any estimator), and the correlation of
an agent's advantages with its own scores. Dr. MAS's point: under a global baseline these
differ between agents and from 1; agent-wise normalisation brings each agent's to ~1.

    python benchmarks/advantage_spread.py --out benchmarks/advantage_spread.png --seed 0
"""
from __future__ import annotations

import argparse
import random

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from masrl.algorithms import compute_advantages  # noqa: E402

AGENTS = ("Solver", "Verifier")


def synthetic_batch(num_groups: int, group_size: int, seed: int) -> dict:
    rng = random.Random(seed)
    rows = {"scores": [], "group_ids": [], "agent_ids": [], "episode_ids": [], "turn_index": []}

    def add(score, group, agent, episode, turn):
        for key, value in zip(rows, (score, group, agent, episode, turn)):
            rows[key].append(value)

    episode = 0
    for group in range(num_groups):
        solve_rate = rng.betavariate(1.5, 1.5)
        for _ in range(group_size):
            attempts = []
            while True:
                attempts.append(rng.random() < solve_rate)
                if attempts[-1] or len(attempts) == 3:
                    break
            team_reward = float(attempts[-1])
            for turn in range(len(attempts)):
                penalty = 0.5 if rng.random() < 0.15 else 0.0
                add(team_reward - penalty, group, "Solver", episode, turn)
            verdict_right = rng.random() < 0.85
            penalty = 0.5 if rng.random() < 0.05 else 0.0
            add(float(verdict_right) - penalty, group, "Verifier", episode, len(attempts))
            episode += 1
    rows["scores"] = torch.tensor(rows["scores"], dtype=torch.float64)
    return rows


def agent_figures(batch: dict, advantages: torch.Tensor, agent: str) -> dict[str, float]:
    rows = torch.tensor([a == agent for a in batch["agent_ids"]])
    a = advantages[rows]
    scores = batch["scores"][rows]
    groups = torch.tensor(batch["group_ids"])[rows]
    within = []
    for g in groups.unique():
        sel = groups == g
        if sel.sum() >= 2 and scores[sel].unique().numel() >= 2:
            within.append(float(a[sel].std()))
    return {
        "turns": float(rows.sum()),
        "mean_A": float(a.mean()),
        "rms_A": float(a.square().mean().sqrt()),
        "std_A": float(a.std()),
        "mean_abs_A": float(a.abs().mean()),
        "within_std_A": sum(within) / max(len(within), 1),
        "zero_A": float((a == 0).double().mean()),
        "corr_A_r": float(torch.corrcoef(torch.stack([a, scores]))[0, 1]),
    }


def advantages_for(batch: dict, estimator: str) -> torch.Tensor:
    ids = {k: batch[k] for k in ("group_ids", "agent_ids", "episode_ids", "turn_index")}
    if estimator == "global_turn":
        return compute_advantages(batch["scores"], estimator="drmas", **{**ids, "agent_ids": ["team"] * len(batch["scores"])})
    return compute_advantages(batch["scores"], estimator=estimator, **ids)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/advantage_spread.png", help="PNG to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--estimators", default="grpo,global_turn,drmas",
                        help="comma-separated registry names or global_turn (each is plotted)")
    args = parser.parse_args(argv)

    batch = synthetic_batch(args.groups, args.group_size, args.seed)
    estimators = args.estimators.split(",")
    advantages = {est: advantages_for(batch, est) for est in estimators}

    print(f"{args.groups} groups x G={args.group_size}, {len(batch['scores'])} turns, seed {args.seed}")
    for agent in AGENTS:
        s = batch["scores"][torch.tensor([a == agent for a in batch["agent_ids"]])]
        print(f"  {agent:<8} raw scores: mean {float(s.mean()):.3f}  std {float(s.std()):.3f}")
    header = f"{'estimator':<20}{'agent':<10}{'turns':>6}{'mean A':>9}{'rms A':>8}{'std A':>8}{'mean|A|':>9}{'std in (g,k)':>14}{'A=0':>7}{'corr(A,r)':>11}"
    print(header)
    print("-" * len(header))
    figures = {}
    for est in estimators:
        for agent in AGENTS:
            f = figures[est, agent] = agent_figures(batch, advantages[est], agent)
            print(f"{est:<20}{agent:<10}{f['turns']:>6.0f}{f['mean_A']:>9.3f}{f['rms_A']:>8.3f}"
                  f"{f['std_A']:>8.3f}{f['mean_abs_A']:>9.3f}{f['within_std_A']:>14.3f}{f['zero_A']:>7.0%}{f['corr_A_r']:>11.3f}")

    fig, axes = plt.subplots(2, len(estimators), figsize=(4.5 * len(estimators), 7), squeeze=False)
    bins = torch.linspace(-3, 3, 41).tolist()
    for ax, est in zip(axes[0], estimators):
        for agent in AGENTS:
            rows = torch.tensor([a == agent for a in batch["agent_ids"]])
            ax.hist(advantages[est][rows].tolist(), bins=bins, alpha=0.55, density=True, label=agent)
        ax.set_title(f"{est}: advantage per turn")
        ax.set_xlabel("A")
        ax.legend()
    panels = [("within_std_A", "std of A within (group, agent)", 1.0), ("mean_A", "mean A per agent", 0.0),
              ("corr_A_r", "corr(A, own score) per agent", None)]
    width = 0.8 / len(estimators)
    for ax in axes[1][len(panels):]:
        ax.axis("off")
    for ax, (key, title, reference) in zip(axes[1], panels):
        for j, est in enumerate(estimators):
            xs = [i + j * width for i in range(len(AGENTS))]
            ax.bar(xs, [figures[est, agent][key] for agent in AGENTS], width=width, label=est)
        if reference is not None:
            ax.axhline(reference, color="grey", lw=0.8, ls="--")
        ax.set_xticks([i + width * (len(estimators) - 1) / 2 for i in range(len(AGENTS))], AGENTS)
        ax.set_title(title)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
