"""Old import paths of the services (docs/architecture.md, "Old import paths"): each still imports for one
release, warns with the new path, and gives the very object of the new path; masrl's own files use only
the new paths."""
from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIMS = ROOT / "src" / "masrl" / "tasks" / "retrieval"

MODULES = [  # (old module, a name in it, new module)
    ("masrl.tasks.code.sandbox", "Sandbox", "masrl.sandbox"),
    ("masrl.tasks.code.scoring", "score_code", "masrl.codecheck"),
    ("masrl.tasks.code.extract", "extract_code", "masrl.codecheck"),
    ("masrl.tasks.retrieval", "BM25Retriever", "masrl.retrieval"),
    ("masrl.tasks.retrieval.synthetic_kb", "synthetic_kb_retriever", "masrl.tasks.synthetic_kb"),
    ("masrl.tasks.rows", "read_rows", "masrl.io.rows"),
    ("masrl.tasks.lines", "text_lines", "masrl.io.lines"),
    ("masrl.evaluation.runner", "summarize_episodes", "masrl.evaluation.summary"),
    ("masrl.retrieval.guard", None, "masrl.http.guard"),
    ("masrl.tasks.retrieval.guard", None, "masrl.http.guard"),
    ("masrl.tasks.reward_guard", None, "masrl.usercode.guard"),
    ("masrl.tasks.reward_process", None, "masrl.usercode.process"),
    ("masrl.tasks.user_code", None, "masrl.usercode.imports"),
] + [(f"masrl.tasks.retrieval.{p.stem}", None, f"masrl.retrieval.{p.stem}")
     for p in sorted(SHIMS.glob("*.py")) if p.stem not in ("__init__", "synthetic_kb", "guard")]

NAMES = [  # (old module, moved name, new module)
    ("masrl.tasks.code", "run_python", "masrl.sandbox"),
    ("masrl.tasks.code", "Sandbox", "masrl.sandbox"),
    ("masrl.config", "read_yaml_file", "masrl.io.bounded_yaml"),
    ("masrl.config", "YAML_MAX_NODES", "masrl.io.bounded_yaml"),
    ("masrl.paths", "write_text_atomic", "masrl.io.atomic"),
]


@pytest.mark.parametrize("old,name,new", MODULES, ids=[f"{m[0]}.{m[1]}" for m in MODULES])
def test_an_old_module_path_warns_and_gives_the_same_object(old, name, new, monkeypatch):
    if old.endswith((".dense", ".server", ".guard")):
        pytest.importorskip("torch" if old.endswith(".dense") else "fastapi")
    monkeypatch.delitem(sys.modules, old, raising=False)  # import it afresh: the warning comes on import
    with pytest.warns(DeprecationWarning, match=re.escape(new)) as record:
        module = importlib.import_module(old)
    assert any(str(w.message).startswith(f"{old} is deprecated") for w in record)
    target = importlib.import_module(new)
    if name is None:  # a moved module: the old name is the new module itself
        assert module is target
    else:
        assert getattr(module, name) is getattr(target, name)


def test_the_private_names_the_scorer_imported_are_the_public_ones(monkeypatch):
    monkeypatch.delitem(sys.modules, "masrl.tasks.code.sandbox", raising=False)
    with pytest.warns(DeprecationWarning):
        old = importlib.import_module("masrl.tasks.code.sandbox")
    import masrl.sandbox

    assert old._Proc is masrl.sandbox.Proc and old._Died is masrl.sandbox.Died


@pytest.mark.parametrize("old,name,new", NAMES, ids=[f"{n[0]}.{n[1]}" for n in NAMES])
def test_an_old_name_warns_and_gives_the_same_object(old, name, new):
    module, target = importlib.import_module(old), importlib.import_module(new)
    with pytest.warns(DeprecationWarning, match=re.escape(f"{old}.{name} is deprecated: import it from {new}")):
        value = getattr(module, name)
    assert value is getattr(target, name)


def test_an_unknown_name_is_still_an_attribute_error():
    import masrl.config
    import masrl.paths
    import masrl.tasks.code

    for module in (masrl.config, masrl.paths, masrl.tasks.code):
        with pytest.raises(AttributeError):
            module.no_such_name  # noqa: B018


OLD_PATHS = re.compile(r"masrl\.tasks\.(retrieval|rows\b|lines\b|reward_guard\b|reward_process\b|user_code\b|code\.(sandbox|scoring|extract)\b|code\._(child|cgroup|cleanup))"
                       r"|masrl\.retrieval\.guard\b|retrieval/guard\.py"
                       r"|masrl\.evaluation\.runner\b|evaluation/runner\.py"
                       r"|tasks/(retrieval/|rows\.py|lines\.py|reward_guard\.py|reward_process\.py|user_code\.py|code/(sandbox|scoring|extract|_child|_cgroup|_cleanup)\.py)"
                       r"|from masrl\.tasks\.code import[^\n]*\b(run_python|Sandbox|Limits|SandboxError|SandboxResult"
                       r"|Isolation|default_sandbox|sandbox_capabilities)\b"
                       r"|from masrl\.paths import[^\n]*write_text_atomic|from masrl\.config import[^\n]*read_yaml_file")
ALLOWED = {"docs/architecture.md",  # the table of old paths
           "tests/test_moved_paths.py"}


def _says_deprecated(text: str, at: int) -> bool:
    """Is the match at ``at`` in a paragraph that tells the reader the path is deprecated?"""
    start, end = text.rfind("\n\n", 0, at), text.find("\n\n", at)
    return "DeprecationWarning" in text[start:end if end >= 0 else None]


def test_masrl_itself_uses_only_the_new_paths():
    roots = ["src", "tests", "examples", "benchmarks", "docs", "scripts", ".ci", "README.md"]
    found = []
    for root in roots:
        base = ROOT / root
        files = [base] if base.is_file() else sorted(base.rglob("*")) if base.is_dir() else []
        for f in files:
            rel = f.relative_to(ROOT).as_posix()
            if any(part.endswith(".egg-info") or part in ("__pycache__", "build", "dist") for part in f.parts):
                continue  # build output, not masrl's files
            if not f.is_file() or f.suffix not in (".py", ".md", ".yaml", ".yml", ".toml", ".sh", "") or rel in ALLOWED:
                continue
            if rel.startswith("src/masrl/tasks/retrieval/") or rel in (
                    "src/masrl/tasks/rows.py", "src/masrl/tasks/lines.py", "src/masrl/tasks/code/sandbox.py",
                    "src/masrl/tasks/code/scoring.py", "src/masrl/tasks/code/extract.py",
                    "src/masrl/tasks/reward_guard.py", "src/masrl/tasks/reward_process.py", "src/masrl/tasks/user_code.py",
                    "src/masrl/evaluation/runner.py", "src/masrl/retrieval/guard.py"):
                continue  # the deprecated modules themselves
            try:
                text = f.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            found += [f"{rel}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}" for m in OLD_PATHS.finditer(text)
                      if not (f.suffix == ".md" and _says_deprecated(text, m.start()))]
    assert found == []
