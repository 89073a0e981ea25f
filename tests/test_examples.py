"""Every shipped example config validates (a typo in an example would otherwise reach users first)."""
from pathlib import Path

import pytest

from masrl.config import load_config

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


def test_there_are_examples():
    assert len(EXAMPLES) >= 10


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_validates(path):
    cfg = load_config(str(path), [])
    assert cfg.agents and cfg.policies
    assert all(a.policy in cfg.policies for a in cfg.agents.values())


def _external_programs():
    out = []
    for path in EXAMPLES:
        cfg = load_config(str(path), [])
        if cfg.workflow.name == "external":
            out.append((path, cfg.workflow.params))
    return out


def test_there_is_an_external_program_example():
    assert any(p.name == "openai_client_team.yaml" for p, _ in _external_programs())


@pytest.mark.parametrize("path, params", _external_programs(), ids=lambda v: getattr(v, "name", ""))
def test_external_example_programs_load_and_use_no_masrl(path, params, monkeypatch):
    """An example's OpenAI-API program imports (from the repository root, as the README runs it), its entry is
    callable, and it is an ordinary program: no masrl import anywhere in it."""
    import ast

    from masrl.usercode.imports import import_object

    monkeypatch.chdir(path.parents[1])
    spec = params["entry"]
    assert spec, f"{path.name}: an external example names its program by entry"
    assert callable(import_object(spec, "workflow.params.entry"))
    tree = ast.parse(Path(spec.rpartition(":")[0]).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | \
               {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "openai" in imported and "masrl" not in imported
