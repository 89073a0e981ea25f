"""One metric scheme and one loud-stop rule for every kind of user code.

Each kind (``reward``, ``tool``, ``judge``, ``reward_model``, ``program``, ``environment``) counts its calls, errors
and timeouts per step; ``usercode_metrics`` names them ``usercode/<kind>/calls|errors|timeouts`` (beside the older
names of each kind, kept as aliases: ``reward/*``, ``tool/*``, ``judge/*``, ``rollout/episode_errors``).
``check_share`` is the rule: a step whose failed calls of one code reach ``max_share`` of its calls stops the
run (``UserCodeError``, exit 2) with one line naming the code, the counts and the first error.
"""
from __future__ import annotations

from masrl.errors import UserInputError

KINDS = ("reward", "tool", "judge", "reward_model", "program", "environment")


class UserCodeError(UserInputError):
    """User code failed on too many calls of a step: the run stops (exit 2) with one line."""


def usercode_metrics(kind: str, calls: float, errors: float, timeouts: float) -> dict[str, float]:
    """``usercode/<kind>/calls``, ``.../errors`` (raised, or returned what cannot be used), ``.../timeouts``."""
    return {f"usercode/{kind}/calls": float(calls), f"usercode/{kind}/errors": float(errors),
            f"usercode/{kind}/timeouts": float(timeouts)}


def failure_line(name: str, calls: int, errors: int, timeouts: int, first: str | None, where: str) -> str:
    """``NAME failed on F of N calls in WHERE (E errors, T timeouts; first: ...)``."""
    kinds = ", ".join(f"{n} {w}{'s' if n != 1 else ''}" for n, w in ((errors, "error"), (timeouts, "timeout")) if n)
    return f"{name} failed on {errors + timeouts} of {calls} calls in {where} ({kinds}; first: {first})"


def share_reached(calls: int, failed: int, max_share: float) -> bool:
    """The rule: some calls failed, and at least ``max_share`` of them."""
    return bool(failed) and failed >= max_share * calls


def check_share(name: str, calls: int, errors: int, timeouts: int, first: str | None, max_share: float,
                where: str, fix: str, error: type[UserInputError] = UserCodeError, **extra) -> None:
    """Raise ``error`` (one line: ``failure_line``, then ``fix``) when the step's failures reach
    ``max_share`` of its calls."""
    if share_reached(calls, errors + timeouts, max_share):
        raise error(f"{failure_line(name, calls, errors, timeouts, first, where)}; {fix}", **extra)
