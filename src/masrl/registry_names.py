"""Registry names in a config (workflow, task, reward), checked when a team is built
(``masrl.team_runner.check_team``, before any data is loaded).

Pydantic checks the shape of the config; this resolves its names against the registries
(``masrl.registry``: built-ins and installed plugins; ``pkg.module:function`` paths are imported) so
that a typo fails before any model is built, with the known names listed, instead of after SFT. It sits
above ``config`` (it imports workflows and tasks); the estimator and loss names are checked by the config
models (``masrl.config``) against the same kind of registry.
"""
from __future__ import annotations

from masrl.config import RunConfig
from masrl.errors import ConfigError


def check_names(cfg: RunConfig) -> None:
    """Raise ``ConfigError`` naming the key and the known names when a registry name is unknown."""
    import masrl.judges  # noqa: F401  (registers the judge and reward-model rewards)
    from masrl.tasks.registry import source_loader
    from masrl.tasks.rewards import resolve_reward
    from masrl.workflows.base import get_workflow

    problems = []  # estimator and loss names: validated by the config models themselves
    for key, check in (("workflow.name", lambda: get_workflow(cfg.workflow.name)),
                       ("task.name", lambda: source_loader(cfg.task))):
        try:
            check()
        except ValueError as e:
            problems.append(f"{key}: {e}")
    if cfg.task.name == "dataset" and "reward" in cfg.task.params:
        reward = cfg.task.params["reward"]
        try:
            resolve_reward(reward if isinstance(reward, dict) else str(reward), cfg.task.params)
        except ValueError as e:
            problems.append(f"task.params.reward: {e}")
    if problems:
        raise ConfigError("\n".join(problems))
