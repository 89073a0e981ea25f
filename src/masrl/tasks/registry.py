"""Task sources by name: a train split, a held-out split, the score function and an optional teacher.

A task is a builder ``(task_cfg, sft_teacher) -> TaskSource`` registered with ``@register_task("name")``
(the config's ``task.name`` picks it); its score function comes from the reward registry
(``masrl.tasks.rewards.resolve_reward``). The math benchmarks and QA datasets are tasks by their
names too. A package registers its own through the ``masrl.tasks`` entry-point group (``masrl.registry``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from masrl.config import TaskConfig
from masrl.errors import ConfigError
from masrl.registry import Registry
from masrl.tasks.rewards import qa_reward_name, resolve_reward
from masrl.tasks.source import TaskSource, Teacher  # noqa: F401  (public here too)

TaskBuilder = Callable[[TaskConfig, dict], TaskSource]


def _register_benchmarks() -> None:
    """The math benchmarks and QA datasets, each a task by its name (read when a name is first looked up)."""
    from masrl.tasks.math_data import BENCHMARKS
    from masrl.tasks.qa import QA_DATASETS

    for name in BENCHMARKS:
        TASKS.register(name, _math_benchmark)
    for name in QA_DATASETS:
        TASKS.register(name, _qa_benchmark)
    _math_benchmark.supplies, _qa_benchmark.supplies = (), ("retriever",)


TASKS: Registry[TaskBuilder] = Registry("task", group="masrl.tasks", preload=_register_benchmarks,
                                        hint="(or dataset: your own file, with task.params.train)")
SOURCES = TASKS  # the older name


def register_task(name: str, fn: TaskBuilder | None = None, *, overwrite: bool = False,
                  supplies: tuple[str, ...] = ()):
    """Register a task builder ``fn(task_cfg, sft_teacher) -> TaskSource`` under ``name`` (a decorator without
    ``fn``, returning the function unchanged). A name that is taken is an error unless ``overwrite``.
    ``supplies``: the workflow params its ``TaskSource.workflow_params`` hands the workflow (``("retriever",)``):
    the run-start check of the workflow counts them as set, and refuses a missing one the task does not supply."""
    def add(builder: TaskBuilder) -> TaskBuilder:
        builder.supplies = tuple(supplies)  # type: ignore[attr-defined]
        return TASKS.register(name, builder, overwrite=overwrite)

    return add if fn is None else add(fn)


def task_supplies(name: str) -> tuple[str, ...] | None:
    """The workflow params task ``name`` supplies, or None when its builder does not say (a builder registered
    by an entry point without a ``supplies`` attribute: the start check then leaves those params to the episodes)."""
    return getattr(TASKS.get(name), "supplies", None)


@register_task("arithmetic")
def _arithmetic(cfg: TaskConfig, sft_teacher: dict) -> TaskSource:
    from masrl.tasks.arithmetic import ArithmeticConfig, ArithmeticTeacher, make_arithmetic_tasks

    try:
        acfg = ArithmeticConfig(**{k: v for k, v in cfg.params.items() if k != "answer_fallback"})
    except TypeError as e:
        raise ConfigError(f"task.params for arithmetic: {e}; known: {sorted(ArithmeticConfig.__dataclass_fields__)}")
    train, test = make_arithmetic_tasks(acfg)
    try:
        teacher = ArithmeticTeacher(**sft_teacher)
    except TypeError as e:
        raise ConfigError(f"sft.teacher for arithmetic: {e}") from None
    return TaskSource("arithmetic", train, test, resolve_reward("math", cfg.params), teacher.reply)


def _math_benchmark(cfg: TaskConfig, sft_teacher: dict) -> TaskSource:
    from masrl.tasks.math_data import load_benchmark

    train_name = cfg.params.get("train", cfg.name)
    test_name = cfg.params.get("test", cfg.name)
    train = load_benchmark(train_name, limit=cfg.train_limit, strict=cfg.strict)
    test = load_benchmark(test_name, limit=cfg.test_limit, strict=cfg.strict)
    return TaskSource(cfg.name, train, test, resolve_reward("math", cfg.params))


def _configured_score(cfg: TaskConfig, default: Callable[[dict], str]):
    """``task.params.reward`` when it is a mapping (``{judge: ...}``, ``{model: ...}``), else the reward
    ``default(task.params)`` names."""
    reward = cfg.params.get("reward")
    if reward is None:
        return resolve_reward(default(cfg.params), cfg.params)
    if not isinstance(reward, dict):
        raise ConfigError(f"task {cfg.name!r}: task.params.reward must be a mapping ({{judge: ...}} or "
                          f"{{model: ...}}), got {reward!r}")
    return resolve_reward(reward, cfg.params)  # judge / model: registered by masrl.judges (check_names)


@register_task("synthetic_kb", supplies=("retriever",))
def _synthetic_kb(cfg: TaskConfig, sft_teacher: dict) -> TaskSource:
    from masrl.tasks.synthetic_kb import SyntheticKBTeacher, synthetic_kb, synthetic_kb_retriever

    params = {k: v for k, v in cfg.params.items() if k not in ("reward_metric", "reward")}
    seed = int(params.pop("seed", 0))
    train, _ = synthetic_kb(seed, "train", **params)
    test, _ = synthetic_kb(seed, "test", **params)
    teacher = SyntheticKBTeacher(seed, **params, **sft_teacher)
    return TaskSource("synthetic_kb", train, test, _configured_score(cfg, qa_reward_name), teacher.reply,
                      {"retriever": synthetic_kb_retriever(seed, **params)})


@register_task("kb_fact_check")
def _kb_fact_check(cfg: TaskConfig, sft_teacher: dict) -> TaskSource:
    """Yes/no fact checks over the synthetic knowledge base (``masrl.tasks.fact_check``): a judge's data."""
    from masrl.tasks.fact_check import kb_fact_check, verdict_score, verdict_teacher

    params = dict(cfg.params)
    seed = int(params.pop("seed", 0))
    if sft_teacher:
        raise ConfigError(f"sft.teacher for kb_fact_check: no options (the teacher replies the gold verdict), "
                          f"got {sorted(sft_teacher)}")
    try:
        train = kb_fact_check(seed, "train", **params)
        test = kb_fact_check(seed, "test", **params)
    except TypeError as e:
        raise ConfigError(f"task.params for kb_fact_check: {e}") from None
    return TaskSource("kb_fact_check", train, test, verdict_score, verdict_teacher)


def _qa_benchmark(cfg: TaskConfig, sft_teacher: dict) -> TaskSource:
    import masrl.tasks.synthetic_kb  # noqa: F401 - registers the "synthetic_kb" retriever spec
    from masrl.retrieval import resolve_retriever
    from masrl.tasks.qa import load_qa

    train = load_qa(cfg.params.get("train", cfg.name), limit=cfg.train_limit, strict=cfg.strict)
    test = load_qa(cfg.params.get("test", cfg.name), limit=cfg.test_limit, strict=cfg.strict)
    retriever = cfg.params.get("retriever")
    if retriever is None:
        raise ConfigError(f"task {cfg.name!r} is a search QA task: set task.params.retriever "
                          "(a corpus path, a retrieval server URL, or a {type: ...} mapping)")
    return TaskSource(cfg.name, train, test, resolve_reward(qa_reward_name(cfg.params), cfg.params), None,
                      {"retriever": resolve_retriever(retriever)})


@register_task("mbpp")
@register_task("humaneval")
def _code(cfg: TaskConfig, sft_teacher: dict) -> TaskSource:
    """MBPP (train split for training, test split held out) or HumanEval (test only), sandboxed reward."""
    from masrl.tasks.code import load_humaneval, load_mbpp

    score = resolve_reward("code", cfg.params)  # its reward_mode checked before any data is read
    if cfg.name == "mbpp":
        train = load_mbpp(split=cfg.params.get("train_split", "train"), strict=cfg.strict)
        test = load_mbpp(split=cfg.params.get("test_split", "test"), strict=cfg.strict)
    else:
        train = test = load_humaneval(strict=cfg.strict)
    return TaskSource(cfg.name, train, test, score)


@register_task("code_synth")
def _code_synth(cfg: TaskConfig, sft_teacher: dict) -> TaskSource:
    """Synthetic ``def f(xs)`` tasks with hidden tests (masrl.tasks.code.synthetic), sandboxed reward."""
    from masrl.tasks.code.synthetic import CodeSynthConfig, CodeSynthTeacher, code_synth_score, make_code_synth_tasks

    params = {k: v for k, v in cfg.params.items() if k not in ("reward_mode", "timeout_s", "score_cache")}
    try:
        train, test = make_code_synth_tasks(CodeSynthConfig(**params))
    except TypeError as e:
        raise ConfigError(f"task.params for code_synth: {e}; known: "
                          f"{sorted(CodeSynthConfig.__dataclass_fields__) + ['reward_mode', 'score_cache', 'timeout_s']}") from None
    try:
        teacher = CodeSynthTeacher(**sft_teacher)
    except TypeError as e:
        raise ConfigError(f"sft.teacher for code_synth: {e}; known: slip_rate, verifier_noise, seed") from None
    from masrl.codecheck.scoring import cache_entries_param

    score = code_synth_score(cfg.params.get("reward_mode", "fraction"), cfg.params.get("timeout_s", 1.0),
                             cache_entries_param(cfg.params))
    return TaskSource("code_synth", train, test, score, teacher.reply)


@register_task("dataset")
def _dataset(cfg: TaskConfig, sft_teacher: dict) -> TaskSource:
    from masrl.tasks.dataset import dataset_source

    return dataset_source(cfg, sft_teacher)


@register_task("verifiers", supplies=("env_episode",))
def _verifiers(cfg: TaskConfig, sft_teacher: dict) -> TaskSource:
    """A verifiers v0 environment (masrl.tasks.environments.verifiers_env); workflow: environment plays it."""
    from masrl.tasks.environments.verifiers_env import verifiers_source

    return verifiers_source(cfg, sft_teacher)


@register_task("verifiers_v1", supplies=("env_episode",))
def _verifiers_v1(cfg: TaskConfig, sft_teacher: dict) -> TaskSource:
    """A verifiers v1 Env, one or several agents (masrl.tasks.environments.verifiers_v1)."""
    from masrl.tasks.environments.verifiers_v1 import verifiers_v1_source

    return verifiers_v1_source(cfg, sft_teacher)


@register_task("tool_env", supplies=("env_episode",))
def _tool_env(cfg: TaskConfig, sft_teacher: dict) -> TaskSource:
    """A class per episode whose public methods are tools (masrl.tasks.environments.tool_env)."""
    from masrl.tasks.environments.tool_env import tool_env_source

    return tool_env_source(cfg, sft_teacher)


def source_loader(cfg: TaskConfig) -> TaskBuilder:
    """The builder of task ``cfg.name`` (no data is read): a registered task, or a math benchmark / QA dataset
    named by ``task.params.train``; the registry's error listing the known tasks otherwise."""
    if cfg.name not in TASKS:
        from masrl.tasks.math_data import BENCHMARKS
        from masrl.tasks.qa import QA_DATASETS

        train = cfg.params.get("train")
        if isinstance(train, str) and train in BENCHMARKS:
            return _math_benchmark
        if isinstance(train, str) and train in QA_DATASETS:
            return _qa_benchmark
    return TASKS.get(cfg.name)


def load_task_source(cfg: TaskConfig, sft_teacher: dict | None = None) -> TaskSource:
    source = source_loader(cfg)(cfg, sft_teacher or {})
    if cfg.train_limit is not None:
        source.train = source.train[:cfg.train_limit]
    if cfg.test_limit is not None:
        source.test = source.test[:cfg.test_limit]
    if not source.train:
        why = ("task.train_limit is 0" if cfg.train_limit == 0 else
               "check task.params.train and the data file" if cfg.name == "dataset" else
               "check task.params (e.g. train_size) or the data file")
        raise ConfigError(f"task {cfg.name!r}: the training split is empty ({why})")
    return source


def load_bench_tasks(name: str, source, task_cfg, limit: int | None, strict: bool):
    """``(tasks, score)``: 'test' is the task source's held-out split; otherwise a math or QA benchmark
    name, or a QA file; each is scored by its kind's reward (math-verify or EM)."""
    if name == "test":
        return (source.test[:limit] if limit else source.test), source.score
    from masrl.tasks.math_data import BENCHMARKS, load_benchmark
    from masrl.tasks.qa import QA_DATASETS, load_qa

    if name in BENCHMARKS:
        return load_benchmark(name, limit=limit, strict=strict), resolve_reward("math", task_cfg.params)
    if name in QA_DATASETS or Path(name).is_file():
        return load_qa(name, limit=limit, strict=strict), resolve_reward(qa_reward_name(task_cfg.params),
                                                                         task_cfg.params)
    known = ", ".join(["test", *sorted(BENCHMARKS), *sorted(QA_DATASETS)])
    raise ConfigError(f"--bench: unknown benchmark {name!r}; known: {known}")
