"""The code reward's result cache (masrl.codecheck.scoring.ScoreCache): an identical program on the same hidden
tests runs once; what depends on load or chance (timeouts, random HumanEval inputs) is always run again."""
import pytest

import masrl.codecheck.scoring as scoring
from masrl.errors import ConfigError
from masrl.codecheck.scoring import ScoreCache, cache_entries_param, make_code_score
from masrl.tasks.code.synthetic import CodeSynthConfig, code_synth_score, make_code_synth_tasks, reference
from masrl.types import Task

TASKS = make_code_synth_tasks(CodeSynthConfig(train_size=20, seed=3))[0]


def _counting(monkeypatch):
    """Count the programs the sandbox actually runs (score_code calls)."""
    runs = []
    real = scoring.score_code

    def counted(task, answer, *args, **kwargs):
        runs.append((task.id, answer))
        return real(task, answer, *args, **kwargs)

    monkeypatch.setattr(scoring, "score_code", counted)
    return runs


def _fenced(code, prose=""):
    return f"{prose}```python\n{code}\n```"


def test_an_identical_program_runs_once_and_scores_the_same(monkeypatch):
    runs = _counting(monkeypatch)
    score = code_synth_score("fraction", timeout_s=1.0)
    task = TASKS[0]
    good = reference(task.meta["template"], task.meta["k"])
    wrong = "def f(xs):\n    return 7"
    first = score(task, _fenced(wrong))
    again = score(task, _fenced(wrong, prose="Here it is again.\n"))  # other words, the same program
    assert len(runs) == 1 and first["cached"] is False and again["cached"] is True
    assert {k: v for k, v in again.items() if k not in ("cached", "duration_s")} == \
        {k: v for k, v in first.items() if k not in ("cached", "duration_s")}
    assert first["reward"] < 1.0
    assert score(task, _fenced(good))["reward"] == 1.0 and len(runs) == 2  # another program is run
    assert score(task, _fenced(good))["reward"] == 1.0 and len(runs) == 2
    assert (score.cache.hits, score.cache.misses, len(score.cache)) == (2, 2, 2)


def test_the_same_program_on_other_tests_or_options_is_run_again(monkeypatch):
    runs = _counting(monkeypatch)
    a, b = TASKS[0], next(t for t in TASKS if t.answer["tests"] != TASKS[0].answer["tests"])
    program = _fenced("def f(xs):\n    return sum(xs)")
    fraction, binary = make_code_score("fraction", timeout_s=1.0), make_code_score("all", timeout_s=1.0)
    fraction(a, program)
    fraction(b, program)
    assert len(runs) == 2  # the key holds the hidden tests, not just the program
    relabelled = Task("another-id", a.question, a.answer, a.meta)
    fraction(relabelled, program)
    assert len(runs) == 2  # the same tests under another task id: the same outcome
    binary(a, program)
    assert len(runs) == 3  # each score function has its own cache (mode, options)
    assert ScoreCache.key(a.answer, "x", "fraction", {"timeout_s": 1.0}) != \
        ScoreCache.key(a.answer, "x", "fraction", {"timeout_s": 2.0})


def test_load_dependent_outcomes_are_never_kept(monkeypatch):
    runs = _counting(monkeypatch)
    score = code_synth_score("fraction", timeout_s=0.2)
    loop = _fenced("def f(xs):\n    while True:\n        pass")
    results = [score(TASKS[0], loop) for _ in range(2)]
    assert len(runs) == 2 and all(not r["cached"] and r["reward"] == 0.0 for r in results)
    assert len(score.cache) == 0
    # what is kept: assertions, exceptions, syntax errors, no code
    for program in ("def f(xs):\n    return 1 / 0", "def f(xs):\n    return (", ""):
        score(TASKS[1], _fenced(program) if program else "no code here at all")
    assert len(score.cache) == 3
    assert not scoring._stable({"tests": [{"passed": False, "reason": "memory"}]})
    assert not scoring._stable({"tests": [{"passed": False, "reason": "exception: MemoryError: "}]})
    assert not scoring._stable({"tests": [{"passed": False, "reason": "load_timeout"}]})
    assert not scoring._stable({"tests": [{"passed": False, "reason": "sandbox_error"}]})
    assert scoring._stable({"tests": [{"passed": True, "reason": "ok"}, {"passed": False, "reason": "wrong_answer"}]})


def test_humaneval_checks_with_random_inputs_are_not_kept():
    spec = {"kind": "humaneval", "prompt": "def f(x):\n", "entry_point": "f",
            "test": "import random\ndef check(f):\n    x = random.randint(0, 9)\n    assert f(x) == x\n"}
    assert ScoreCache.key(spec, "    return x", "fraction", {}) is None
    plain = {**spec, "test": "def check(f):\n    assert f(3) == 3\n"}
    assert ScoreCache.key(plain, "    return x", "fraction", {}) is not None


def test_least_recently_used_results_are_dropped_and_results_are_copies(monkeypatch):
    runs = _counting(monkeypatch)
    score = code_synth_score("fraction", timeout_s=1.0, cache_entries=2)
    programs = [_fenced(f"def f(xs):\n    return {i}") for i in range(3)]
    for p in programs:
        score(TASKS[0], p)
    assert len(score.cache) == 2 and len(runs) == 3
    score(TASKS[0], programs[0])  # dropped: run again
    assert len(runs) == 4
    got = score(TASKS[0], programs[0])
    got["tests"][0]["passed"] = "tampered"
    assert score(TASKS[0], programs[0])["tests"][0]["passed"] is not "tampered"  # noqa: F632
    off = code_synth_score("fraction", timeout_s=1.0, cache_entries=0)
    assert off.cache is None
    off(TASKS[0], programs[1])
    off(TASKS[0], programs[1])
    assert len(runs) == 6


def test_score_cache_param_is_checked():
    assert cache_entries_param({}) == scoring.DEFAULT_CACHE_ENTRIES
    assert cache_entries_param({"score_cache": 0}) == 0
    for bad in (-1, 2.5, True, "64"):
        with pytest.raises(ConfigError, match="task.params.score_cache"):
            cache_entries_param({"score_cache": bad})


def test_task_configs_take_score_cache():
    from masrl.config import TaskConfig
    from masrl.tasks.registry import source_loader

    cfg = TaskConfig(name="code_synth", params={"train_size": 10, "score_cache": 0})
    source = source_loader(cfg)(cfg, {})
    assert source.score.cache is None
    cfg = TaskConfig(name="code_synth", params={"train_size": 10, "score_cache": 8})
    assert source_loader(cfg)(cfg, {}).score.cache.max_entries == 8
    with pytest.raises(ConfigError, match="score_cache"):
        cfg = TaskConfig(name="code_synth", params={"train_size": 10, "score_cache": -3})
        source_loader(cfg)(cfg, {})


def test_guarded_reward_counts_cached_calls_in_metrics():
    from masrl.usercode.guard import GuardedScore

    guarded = GuardedScore(code_synth_score("fraction", timeout_s=1.0))
    program = _fenced("def f(xs):\n    return len(xs)")
    for _ in range(3):
        guarded(TASKS[0], program)
    guarded(TASKS[1], program)
    counts = guarded.ledger.take().metrics()
    assert counts["reward/calls"] == 4 and counts["reward/cached"] == 2 and counts["reward/errors"] == 0
    assert guarded.ledger.take().metrics()["reward/cached"] == 0  # counted per rollout
