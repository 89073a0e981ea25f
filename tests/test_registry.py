"""One registry mechanism (masrl.registry) for workflows, tasks, rewards, estimators and losses: the same
unknown-name error, the duplicate-name error, decorators that return what they decorate, and installed
plugins (a real ``.dist-info`` on ``sys.path``) found by the config's name resolution."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import masrl.judges  # noqa: F401  (registers the judge and model rewards)
from masrl.algorithms import ADVANTAGE_ESTIMATORS, LOSSES, compute_advantages, policy_loss, register_advantage, \
    register_loss
from masrl.config import TaskConfig, config_from_dict
from masrl.errors import ConfigError, UserInputError
from masrl.registry import DuplicateNameError, PluginError, Registry, UnknownNameError
from masrl.registry_names import check_names
from masrl.team_runner import check_team, load_tasks
from masrl.tasks.registry import TASKS, register_task, source_loader
from masrl.tasks.rewards import REWARDS, register_reward, resolve_reward
from masrl.workflows import WORKFLOWS, get_workflow, register_workflow

ROOT = Path(__file__).resolve().parents[1]

# kind, registry, a built-in name, a typo of it, the public lookup a config's name goes through
FIVE = [
    ("workflow", WORKFLOWS, "voting", "votng", lambda n: get_workflow(n)),
    ("task", TASKS, "arithmetic", "arithmetik", lambda n: source_loader(TaskConfig(name=n))),
    ("reward", REWARDS, "qa_f1", "qa_f2", lambda n: resolve_reward(n, {})),
    ("estimator", ADVANTAGE_ESTIMATORS, "rloo", "rlo",
     lambda n: compute_advantages(torch.tensor([1.0, 0.0]), group_ids=[0, 0], agent_ids=[0, 0],
                                  episode_ids=[0, 1], estimator=n)),
    ("loss", LOSSES, "gspo", "gpso",
     lambda n: policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), loss=n)),
]
IDS = [kind for kind, *_ in FIVE]


@pytest.mark.parametrize("kind,registry,known,typo,lookup", FIVE, ids=IDS)
def test_an_unknown_name_is_the_same_error_for_the_five_kinds(kind, registry, known, typo, lookup):
    names = sorted(registry.names())
    assert known in names
    for look in (registry.get, lookup):
        with pytest.raises(UnknownNameError) as e:
            look(typo)
        message = str(e.value)
        # one line: what (kind and name), the known names (sorted, all of them), the closest one
        assert message.startswith(f"unknown {kind} {typo!r}; known: {', '.join(names)}"), message
        assert message.endswith(f"did you mean {known!r}?"), message
        assert "\n" not in message
        assert isinstance(e.value, ConfigError) and isinstance(e.value, ValueError)


@pytest.mark.parametrize("kind,registry,known,typo,lookup", FIVE, ids=IDS)
def test_a_name_far_from_every_known_one_gets_no_guess(kind, registry, known, typo, lookup):
    with pytest.raises(UnknownNameError) as e:
        registry.get("zzzzzzzzzzzz")
    assert "did you mean" not in str(e.value) and f"unknown {kind} 'zzzzzzzzzzzz'; known: " in str(e.value)


def test_the_config_reports_unknown_names_through_the_registries(tiny_cfg):
    cfg = config_from_dict(tiny_cfg(**{"task.name": "arithmetik", "workflow.name": "votng"}))
    with pytest.raises(ConfigError) as e:
        check_names(cfg)
    lines = str(e.value).splitlines()
    assert lines[0].startswith("workflow.name: unknown workflow 'votng'; known: ") and "did you mean 'voting'" in lines[0]
    assert lines[1].startswith("task.name: unknown task 'arithmetik'; known: ") and "'arithmetic'?" in lines[1]
    with pytest.raises(ConfigError, match=r"key 'algorithm.estimator': unknown estimator 'rlo'; known: .*did you "
                                          r"mean 'rloo'\?"):
        config_from_dict(tiny_cfg(**{"algorithm.estimator": "rlo"}))
    with pytest.raises(ConfigError, match=r"key 'algorithm.loss.loss': unknown loss 'gpso'; known: gspo, ppo; "
                                          r"did you mean 'gspo'\?"):
        config_from_dict(tiny_cfg(**{"algorithm.loss.loss": "gpso"}))


async def _flow(task, team):
    return team.finish(answer="")


def _episode_reward(task, episode):
    return 1.0


# the public decorator of each kind, called as users call it: (decorator(name), the object to decorate)
DECORATORS = [
    ("workflow", WORKFLOWS, lambda name, **kw: register_workflow(name, agents=("Solver",), prompts={}, **kw), _flow),
    ("task", TASKS, register_task, lambda cfg, sft_teacher: None),
    ("reward", REWARDS, register_reward, _episode_reward),
    ("estimator", ADVANTAGE_ESTIMATORS, register_advantage, lambda scores, groups, **kw: scores),
    ("loss", LOSSES, register_loss, lambda logprobs, old_logprobs, valid: logprobs - old_logprobs),
]


@pytest.mark.parametrize("kind,registry,decorator,obj", DECORATORS, ids=[d[0] for d in DECORATORS])
def test_decorators_return_the_object_and_a_taken_name_is_an_error(kind, registry, decorator, obj):
    name = f"_test_{kind}_dup"
    try:
        assert decorator(name)(obj) is obj
        assert name in registry and name in registry.names()
        with pytest.raises(DuplicateNameError, match=f"^{kind} '{name}' is already registered .*overwrite=True"):
            decorator(name)(obj)
        assert decorator(name, overwrite=True)(obj) is obj
        with pytest.raises(DuplicateNameError, match=f"{kind} 'voting' is already registered" if kind == "workflow"
                           else "already registered"):
            decorator({"workflow": "voting", "task": "arithmetic", "reward": "math", "estimator": "grpo",
                       "loss": "ppo"}[kind])(obj)
    finally:
        registry.pop(name, None)
    assert name not in registry


def test_a_registered_reward_is_a_config_name_run_like_a_user_function():
    from masrl.tasks.rewards import EpisodeReward
    from masrl.types import Task

    @register_reward("_test_len")
    def length(task, episode):
        return float(len(episode.answer or ""))

    try:
        score = resolve_reward("_test_len", {}, timeout_s=5.0)
        assert isinstance(score, EpisodeReward) and score.fn is length and score.timeout_s == 5.0
        assert score(Task(id="t", question="q", answer="a"), "abc")["reward"] == 3.0
        with pytest.raises(ConfigError, match=r"reward '_test_len' takes no options: write reward: _test_len"):
            resolve_reward({"_test_len": {}}, {})
        with pytest.raises(ConfigError, match=r"reward 'judge' takes options: write reward: \{judge: \{...\}\}"):
            resolve_reward("judge", {})
        with pytest.raises(ConfigError, match=r"reward '_test_bad' cannot be called as <lambda>\(task, episode\)"):
            register_reward("_test_bad", lambda a, b, c: 0.0)
    finally:
        REWARDS.pop("_test_len")
    assert "_test_bad" not in REWARDS


def test_registry_mechanics():
    widgets = Registry("widget", group="masrl.test_no_such_group")
    assert widgets.names() == [] and len(widgets) == 0 and "a" not in widgets
    with pytest.raises(UnknownNameError, match=r"^unknown widget 'a'; known: none registered$"):
        widgets.get("a")
    widgets.register("b", 2)
    assert widgets.register("a", 1) == 1
    assert widgets.names() == ["b", "a"] and list(widgets) == ["b", "a"] and dict(widgets) == {"b": 2, "a": 1}
    assert widgets["a"] == 1 and widgets.items() == [("b", 2), ("a", 1)] and widgets.values() == [2, 1]
    with pytest.raises(UnknownNameError, match=r"unknown widget \{'x': 1\}; known: a, b$"):
        widgets.get({"x": 1})  # an unhashable value from a config: the same error
    for bad in ("", "  ", None, 3):
        with pytest.raises(ConfigError, match="a widget name must be a non-empty string"):
            widgets.register(bad, 1)
    assert widgets.pop("a") == 1 and widgets.pop("a", "gone") == "gone"
    with pytest.raises(UnknownNameError):
        widgets.pop("a")
    hinted = Registry("gadget", hint="(or a path)")
    assert hinted.group == "masrl.gadgets"
    with pytest.raises(UnknownNameError, match=r"^unknown gadget 'x'; known: none registered \(or a path\)$"):
        hinted.get("x")


def test_preload_runs_once_before_the_first_lookup():
    calls = []
    reg = Registry("widget", group="masrl.test_no_such_group", preload=lambda: calls.append(reg.register("w", 1)))
    assert calls == []
    assert reg.get("w") == 1 and reg.names() == ["w"] and calls == [1]


# --------------------------------------------------------------------------- plugins (entry points)

PLUGIN = '''\
"""A masrl plugin: a task and an estimator registered on import, a reward by a hook."""
from masrl.algorithms import register_advantage
from masrl.tasks.registry import register_task
from masrl.tasks.rewards import register_reward, resolve_reward
from masrl.tasks.source import TaskSource
from masrl.types import Task

IMPORTS = []
IMPORTS.append(1)


@register_task("demo_count")
def demo_count(cfg, sft_teacher):
    tasks = [Task(id=f"demo/{i}", question=" ".join("x" * (i % 4 + 1)), answer=str(i % 4 + 1)) for i in range(8)]
    return TaskSource("demo_count", tasks[:6], tasks[6:], resolve_reward(cfg.params.get("reward", "demo_exact"),
                                                                         cfg.params))


@register_advantage("demo_centered")
def demo_centered(scores, groups, *, eps, unbiased_std, singleton):
    return scores - scores.mean()


def demo_exact(task, episode):
    return 1.0 if (episode.answer or "").strip() == task.answer else 0.0


def register_rewards():
    register_reward("demo_exact", demo_exact)
'''

ENTRY_POINTS = '''\
[masrl.tasks]
demo = masrl_demo_plugin
[masrl.estimators]
demo = masrl_demo_plugin
[masrl.rewards]
demo = masrl_demo_plugin:register_rewards
'''


def _dist(site: Path, dist: str, module: str, code: str, entry_points: str) -> None:
    """An installed distribution as pip leaves it: the module and its ``.dist-info`` (METADATA,
    entry_points.txt) in a folder of ``sys.path``."""
    (site / f"{module}.py").write_text(code)
    info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(entry_points)


@pytest.fixture
def demo_plugin(tmp_path, monkeypatch):
    """The demo plugin installed on ``sys.path``; the task, reward and estimator registries not yet scanned."""
    site = tmp_path / "site"
    site.mkdir()
    _dist(site, "masrl-demo-plugin", "masrl_demo_plugin", PLUGIN, ENTRY_POINTS)
    monkeypatch.syspath_prepend(str(site))
    for registry in (TASKS, REWARDS, ADVANTAGE_ESTIMATORS):
        monkeypatch.setattr(registry, "_scanned", False)
        monkeypatch.setattr(registry, "_loaded", set())
    try:
        yield site
    finally:
        for registry, name in ((TASKS, "demo_count"), (REWARDS, "demo_exact"),
                               (ADVANTAGE_ESTIMATORS, "demo_centered")):
            registry.pop(name, None)
        sys.modules.pop("masrl_demo_plugin", None)


def test_an_installed_plugin_registers_a_task_a_reward_and_an_estimator(demo_plugin, tiny_cfg):
    assert "demo_count" not in TASKS._entries and "masrl_demo_plugin" not in sys.modules
    # the estimator: found by the config model's check (the first miss loads the group)
    cfg = config_from_dict(tiny_cfg(**{"task.name": "demo_count", "task.params": {},
                                       "algorithm.estimator": "demo_centered"}))
    assert sys.modules["masrl_demo_plugin"].IMPORTS == [1]
    # the task and its reward (a hook entry point): found by the run-start check
    check_names(cfg)
    spec, source = check_team(cfg), load_tasks(cfg)
    plugin = sys.modules["masrl_demo_plugin"]
    assert spec.name == "math_solver_verifier" and source.name == "demo_count" and len(source.train) == 6
    assert source.score.fn is plugin.demo_exact and source.score.name == "demo_exact"
    task = source.train[2]
    assert source.score(task, "3")["reward"] == 1.0 and source.score(task, "2")["reward"] == 0.0
    assert plugin.IMPORTS == [1]  # imported once, for three groups
    # the plugin's names are among the known ones an unknown name lists
    with pytest.raises(UnknownNameError, match=r"known: .*demo_count.*; did you mean 'demo_count'\?"):
        TASKS.get("demo_cuont")
    assert "demo_exact" in REWARDS.names() and "demo_centered" in ADVANTAGE_ESTIMATORS
    a = compute_advantages(torch.tensor([1.0, 0.0]), group_ids=[0, 0], agent_ids=[0, 0], episode_ids=[0, 1],
                           estimator="demo_centered")
    assert a.tolist() == [0.5, -0.5]


def test_a_dataset_task_names_a_plugin_reward(demo_plugin, tiny_cfg, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"question": "a b", "answer": "2"}\n{"question": "a", "answer": "1"}\n')
    cfg = config_from_dict(tiny_cfg(**{"task.name": "dataset",
                                       "task.params": {"train": str(rows), "reward": "demo_exact"}}))
    check_names(cfg)
    source = load_tasks(cfg)
    assert source.score.fn is sys.modules["masrl_demo_plugin"].demo_exact
    assert [source.score(t, t.answer)["reward"] for t in source.train] == [1.0, 1.0]


def test_masrl_config_show_finds_an_installed_plugin(demo_plugin, tmp_path):
    """End to end: a fresh ``masrl`` process sees the plugin's names with nothing imported by hand."""
    cfg = tmp_path / "plugin.yaml"
    cfg.write_text((ROOT / "examples" / "quickstart.yaml").read_text()
                   .replace("name: arithmetic\n  params: {train_size: 2000, test_size: 200, min_terms: 2, "
                            "max_terms: 3, max_operand: 9}", "name: demo_count")
                   .replace("estimator: drmas", "estimator: demo_centered"))
    assert "name: demo_count" in cfg.read_text()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(demo_plugin), str(ROOT / "src")]))
    result = subprocess.run([sys.executable, "-m", "masrl", "config", "show", str(cfg)], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"name: demo_count", result.stdout) and "estimator: demo_centered" in result.stdout


BROKEN = '''\
raise RuntimeError("the plugin's import fails")
'''


def test_a_plugin_that_fails_to_load_is_one_error_naming_its_distribution(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    _dist(site, "masrl-broken-plugin", "masrl_broken_plugin", BROKEN, "[masrl.test_widgets]\nbroken = masrl_broken_plugin\n")
    _dist(site, "masrl-hook-plugin", "masrl_hook_plugin", "CALLS = []\n\ndef register():\n    CALLS.append(1)\n",
          "[masrl.test_gadgets]\nhook = masrl_hook_plugin:register\nnot_callable = masrl_hook_plugin:CALLS\n")
    monkeypatch.syspath_prepend(str(site))
    try:
        widgets = Registry("widget", group="masrl.test_widgets")
        widgets.register("w", 1)
        assert widgets.get("w") == 1  # a hit loads no plugin
        with pytest.raises(PluginError) as e:
            widgets.get("x")
        message = str(e.value)
        assert isinstance(e.value, UserInputError) and "\n" not in message
        assert message.startswith("masrl plugin 'broken' (distribution masrl-broken-plugin 0.1; entry point broken "
                                  "= masrl_broken_plugin in group masrl.test_widgets) failed to load: RuntimeError: "
                                  "the plugin's import fails"), message
        assert message.endswith("fix it or uninstall it (pip uninstall masrl-broken-plugin)")
        with pytest.raises(PluginError):  # not forgotten: the next miss says it again
            widgets.names()

        gadgets = Registry("gadget", group="masrl.test_gadgets")
        with pytest.raises(PluginError, match=r"'not_callable' .* failed to load: TypeError: masrl_hook_plugin:CALLS "
                                              r"is a list, not a module or a callable"):
            gadgets.names()
        assert sys.modules["masrl_hook_plugin"].CALLS == [1]  # the hook ran, once, before the bad entry point
        with pytest.raises(PluginError):
            gadgets.names()
        assert sys.modules["masrl_hook_plugin"].CALLS == [1]  # a loaded entry point is not loaded again
    finally:
        for module in ("masrl_broken_plugin", "masrl_hook_plugin"):
            sys.modules.pop(module, None)


def test_a_plugin_registering_a_built_in_name_names_its_distribution(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    _dist(site, "masrl-clash-plugin", "masrl_clash_plugin",
          "from masrl.algorithms import register_loss\n\n@register_loss('ppo')\ndef ppo(a, b, c):\n    return a - b\n",
          "[masrl.test_clash]\nclash = masrl_clash_plugin\n")
    monkeypatch.syspath_prepend(str(site))
    try:
        with pytest.raises(PluginError, match=r"\(distribution masrl-clash-plugin 0.1; .* DuplicateNameError: loss "
                                              r"'ppo' is already registered \(by masrl.algorithms.losses.ppo_log_ratio\)"):
            Registry("widget", group="masrl.test_clash").get("x")
        assert LOSSES.get("ppo").__name__ == "ppo_log_ratio"
    finally:
        sys.modules.pop("masrl_clash_plugin", None)


def test_the_registry_module_imports_nothing_from_masrl_but_errors():
    source = (ROOT / "src" / "masrl" / "registry.py").read_text()
    imports = set(re.findall(r"^\s*(?:from|import) (masrl[\w.]*)", source, re.MULTILINE))
    assert imports == {"masrl.errors"}
    code = textwrap.dedent("""
        import sys, masrl.registry
        print(sorted(m for m in sys.modules if m.startswith("masrl")))
    """)
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(ROOT / "src")),
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "['masrl', 'masrl.errors', 'masrl.registry']", out.stdout + out.stderr
