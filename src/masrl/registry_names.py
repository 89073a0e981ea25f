"""Registry names in a config (workflow, task, reward), checked when a run starts.

Pydantic checks the shape of the config; this resolves its names against the registries
(:mod:`masrl.registry`: built-ins and installed plugins; ``pkg.module:function`` paths are imported) so
that a typo fails before any model is built, with the known names listed, instead of after SFT. It sits
above ``config`` (it imports workflows and tasks); the estimator and loss names are checked by the config
models (``masrl.config``) against the same kind of registry.
"""
from __future__ import annotations

import dataclasses

from masrl.config import RunConfig
from masrl.errors import ConfigError


def check_names(cfg: RunConfig) -> None:
    """Raise :class:`ConfigError` naming the key and the known names when a registry name is unknown."""
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


def check_run(cfg: RunConfig):
    """Everything a run checks before it builds a model: the registry names, the workflow's agents and prompt
    templates against the config's, and the task (its params and data rows: the task source is loaded).
    Returns ``(workflow spec, task source)``. ``masrl train`` and ``masrl config show`` both call it, so a
    config that ``show`` prints is one that ``train`` starts."""
    from masrl.tasks.registry import load_task_source
    from masrl.workflows.base import get_workflow

    check_names(cfg)
    spec = get_workflow(cfg.workflow.name)
    if not spec.agents:  # a workflow open to any agents (external): the config's agents are its roles
        if not cfg.agents:
            raise ConfigError(f"workflow {spec.name!r} takes its agents from the config: name at least one "
                              "under agents (the names the program puts in `model`)")
        spec = dataclasses.replace(spec, agents=tuple(cfg.agents))
    missing = [a for a in spec.agents if a not in cfg.agents]
    extra = [a for a in cfg.agents if a not in spec.agents]
    if missing or extra:
        raise ConfigError(f"workflow {spec.name!r} has agents {list(spec.agents)}; the config's "
                          f"agents section is missing {missing} and has unknown {extra}")
    unknown_prompts = sorted(set(cfg.workflow.prompts) - set(spec.prompts))
    if unknown_prompts:
        raise ConfigError(f"workflow.prompts: unknown template(s) {unknown_prompts}; "
                          f"{spec.name} uses {sorted(spec.prompts)}")
    return spec, load_task_source(cfg.task, cfg.sft.teacher)
