"""One sequence per conversation: an agent's later turn that extends its earlier one is trained in
the same row, with the tokens between them (tool output, the next user message, the chat
template's markers) masked out of the loss.

``team.chat`` records every model call as a turn whose prompt is the whole conversation so
far. When turn b's prompt starts with turn a's prompt + response (token for token; the chat
rendering keeps that prefix, see docs/workflows.md), the rows

    a: prompt P,           response R_a
    b: prompt P R_a T,     response R_b      (T: tool output and template markers)

merge into one row ``prompt P, response R_a T R_b`` with ``loss_mask`` 1 on R_a and R_b and 0 on T.

Equivalence. A causal LM's log-prob of a token depends only on the tokens before it and their
positions. In the merged row every token of R_b has exactly the tokens and positions it has
in row b (left padding does not shift positions: they count from the first real token), so
its log-prob, its ratio, its entropy and KL terms are the same; the tokens of T add nothing to
the loss and nothing to the token count. With ``token-mean`` aggregation the loss and its
gradient are therefore those of the separate rows (up to floating-point summation order), while
the prefix P R_a is encoded once instead of twice. Sequence-level aggregations
(``seq-mean-*``) and GSPO's sequence ratio weight a merged row as one sequence, a different
objective: merge only under token-mean. Rows merge only with equal agent, policy, temperature
and advantage (one advantage per row), and when both or neither carry rollout log-probs.
"""
from __future__ import annotations

from typing import Sequence

from masrl.training.update import Row


def merge_extending_rows(rows: Sequence[Row]) -> list[Row]:
    """Merge each row into an earlier row it extends (see the module docstring); order kept by first row."""
    merged: list[Row] = []
    open_chains: dict[tuple, list[int]] = {}  # key -> indexes in merged
    for row in rows:
        key = (row.agent, row.policy, row.temperature, row.advantage, row.rollout_logprobs is None)
        for i in reversed(open_chains.get(key, [])):
            if _extends(row, merged[i]):
                merged[i] = _join(merged[i], row)
                break
        else:
            open_chains.setdefault(key, []).append(len(merged))
            merged.append(row)
    return merged


def _extends(row: Row, base: Row) -> bool:
    n = len(base.prompt_ids) + len(base.response_ids)
    return (len(row.prompt_ids) >= n and row.prompt_ids[:len(base.prompt_ids)] == base.prompt_ids
            and row.prompt_ids[len(base.prompt_ids):n] == base.response_ids)


def _join(base: Row, row: Row) -> Row:
    gap = row.prompt_ids[len(base.prompt_ids) + len(base.response_ids):]
    mask = (base.loss_mask or [1] * len(base.response_ids)) + [0] * len(gap) + \
        (row.loss_mask or [1] * len(row.response_ids))
    rollout = None
    if base.rollout_logprobs is not None:  # both rows have them or neither (part of the merge key)
        rollout = base.rollout_logprobs + [0.0] * len(gap) + row.rollout_logprobs
    return Row(base.agent, base.prompt_ids, base.response_ids + gap + row.response_ids,
               base.old_logprobs + [0.0] * len(gap) + row.old_logprobs, base.advantage, base.temperature,
               policy=base.policy, rollout_logprobs=rollout, loss_mask=mask)
