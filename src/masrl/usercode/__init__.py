"""The one runner of code masrl does not control: user rewards, tools, judges, reward models and agent programs
(docs/reliability.md, "User code").

Every call has a deadline on the whole call and runs where it cannot take the run down: a thread
(``call_in_thread``, ``call_async``; an ``async def`` on an event loop of its own there), a worker process
(``RewardProcess``) or a subprocess in a process group of its own
(``run_command``). Anything it raises, ``SystemExit`` and ``KeyboardInterrupt`` included, is a failed call;
its numbers are checked (``checked_reward``, ``masrl.usercode.numbers``); every call, error and timeout is
counted per kind (``usercode_metrics``: ``usercode/<kind>/calls|errors|timeouts``), and ``check_share``
is the one rule that stops a run whose calls fail too often.
"""
from masrl.usercode.calls import UserCodeExit, UserCodeTimeout, abandoned, call_async, call_in_thread
from masrl.usercode.command import CommandResult, run_command
from masrl.usercode.guard import (MAX_ABS_REWARD, GuardedScore, RewardCounts, RewardError, RewardLedger,
                                  RewardProcessError, RewardTimeout, RewardWarning, call_with_deadline,
                                  check_failures, checked_reward, describe_error, reward_name)
from masrl.usercode.imports import import_failure, import_object
from masrl.usercode.ledger import UserCodeError, check_share, usercode_metrics

__all__ = ["MAX_ABS_REWARD", "CommandResult", "GuardedScore", "RewardCounts", "RewardError", "RewardLedger",
           "RewardProcessError", "RewardTimeout", "RewardWarning", "UserCodeError", "UserCodeExit", "UserCodeTimeout",
           "abandoned", "call_async", "call_in_thread", "call_with_deadline", "check_failures", "check_share",
           "checked_reward", "describe_error", "import_failure", "import_object", "reward_name", "run_command",
           "usercode_metrics"]
