"""The import rule (docs/architecture.md): the import-linter contracts in pyproject.toml hold, and they
catch a wrong-way import and a cycle (checked on a copy of the package with one bad import added)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter", reason="the import rule is checked with import-linter: pip install 'masrl[test]'")

ROOT = Path(__file__).resolve().parents[1]
_LINT = ("import sys; from importlinter.cli import lint_imports; "
         "sys.exit(lint_imports(config_filename=sys.argv[1], no_cache=True, no_logo=True))")


def _lint(src: Path, config: Path) -> subprocess.CompletedProcess:
    """import-linter on the ``masrl`` package under ``src`` (a subprocess: grimp imports the package)."""
    env = dict(os.environ, PYTHONPATH=str(src))
    return subprocess.run([sys.executable, "-c", _LINT, str(config)], cwd=config.parent, env=env,
                          capture_output=True, text=True, timeout=300)


def test_import_contracts_hold():
    result = _lint(ROOT / "src", ROOT / "pyproject.toml")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def _copy(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "src" / "masrl", tmp_path / "src" / "masrl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path / "src" / "masrl"


def _append(path: Path, code: str) -> None:
    path.write_text(path.read_text() + "\n\n" + code + "\n")


def test_contracts_catch_a_wrong_way_import_and_a_cycle(tmp_path):
    pkg = _copy(tmp_path)
    # rollout must not import training (even lazily, inside a function)
    _append(pkg / "rollout" / "base.py", "def _upward():\n    from masrl.training.policy import Policy\n    return Policy")
    # models.hub <-> models.loading: a cycle inside one layer
    _append(pkg / "models" / "hub.py", "def _cycle():\n    from masrl.models.loading import load_model_and_tokenizer\n"
                                       "    return load_model_and_tokenizer")
    result = _lint(tmp_path / "src", tmp_path / "pyproject.toml")
    assert result.returncode != 0
    assert "masrl.rollout.base -> masrl.training.policy" in result.stdout
    assert "No cycles are allowed in masrl.models" in result.stdout


def test_every_top_level_module_is_in_the_layer_contract():
    """A new module or package of masrl gets a place in the import rule (pyproject.toml's layers)."""
    import re
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["id"] == "layers")["layers"]
    listed = {name.split(".", 1)[1] for layer in layers for name in re.findall(r"masrl\.\w+", layer)}
    src = ROOT / "src" / "masrl"
    modules = {p.stem for p in src.glob("*.py") if p.stem != "__init__"}
    packages = {p.parent.name for p in src.glob("*/__init__.py")}
    assert sorted((modules | packages) - listed) == []


def _contract_layers() -> list[set[str]]:
    import re
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = [set(re.findall(r"masrl\.(\w+)", layer)) for layer in next(c for c in contracts if c["id"] == "layers")["layers"]]
    if layers and layers[0] == {"__main__"}:  # the docs show __main__ with the cli
        main = layers.pop(0)
        layers[0] |= main
    return layers


def _doc_layers(text: str) -> list[set[str]]:
    import re

    section = text.split("| layer (top to bottom) |", 1)[1].split("\n\n", 1)[0]
    rows = [line for line in section.splitlines()[2:] if line.startswith("|")]
    layers = []
    for row in rows:
        first = re.split(r"(?<!\\)\|", row)[1]  # the first cell ("\|" separates modules inside it)
        names = set(re.findall(r"`masrl\.(\w+)`", first)) | ({"__main__"} if "`__main__`" in first else set())
        layers.append(names)
    return layers


def test_the_layer_table_in_the_docs_is_the_contract():
    """docs/architecture.md lists the layers of pyproject.toml's contract, top to bottom, module for module."""
    doc = _doc_layers((ROOT / "docs" / "architecture.md").read_text())
    assert doc == _contract_layers()


def test_the_layer_table_check_sees_a_missing_or_moved_layer():
    text = (ROOT / "docs" / "architecture.md").read_text()
    doc = _doc_layers(text)
    assert {"sandbox", "retrieval"} in doc and {"io", "registry"} in doc
    dropped = text.replace("| `masrl.io` \\|", "| `masrl.iox` \\|")
    assert _doc_layers(dropped) != _contract_layers()
    rows = text.split("\n")
    i = next(k for k, r in enumerate(rows) if r.startswith("| `masrl.sandbox`"))
    rows[i], rows[i + 1] = rows[i + 1], rows[i]  # services and config swapped
    assert _doc_layers("\n".join(rows)) != _contract_layers()


def _private_imports(src: Path) -> list[str]:
    """``from masrl.x import _name`` / ``import masrl.x._mod`` across packages: a private name (or a private
    module) is used only inside the package that defines it."""
    import ast

    found = []
    for f in sorted(src.rglob("*.py")):
        module = ".".join(f.relative_to(src).with_suffix("").parts)
        package = module.rsplit(".", 1)[0] if f.name != "__init__.py" else module.removesuffix(".__init__")
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("masrl"):
                targets = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("masrl")]
            else:
                continue
            for target in targets:
                parts = target.split(".")
                for i, part in enumerate(parts):
                    if part.startswith("_") and not part.startswith("__"):
                        owner = ".".join(parts[:i])  # the package the private name belongs to
                        if package != owner and not package.startswith(owner + "."):
                            found.append(f"{module}:{node.lineno} imports {target}")
                        break
    return found


def test_no_private_name_is_imported_across_packages(tmp_path):
    assert _private_imports(ROOT / "src") == []
    pkg = tmp_path / "masrl" / "rollout"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text("from masrl.sandbox import _child\nfrom masrl.training.fsdp import _full\n")
    assert _private_imports(tmp_path) == ["masrl.rollout.x:1 imports masrl.sandbox._child",
                                          "masrl.rollout.x:2 imports masrl.training.fsdp._full"]


def test_tasks_hold_only_tasks():
    """``masrl.tasks`` holds tasks (datasets, rewards, answer parsers) and the deprecated paths of what moved out, under
    3,500 lines; what runs code (the code reward's harness: ``masrl.codecheck``; user code: ``masrl.usercode``; the
    sandbox, retrieval) lives in the services below it."""
    files = sorted((ROOT / "src" / "masrl" / "tasks").rglob("*.py"))
    lines = sum(len(f.read_text(encoding="utf-8").splitlines()) for f in files)
    assert lines < 3500, f"src/masrl/tasks holds {lines} lines: move what is not a task into a service"
    for f in files:
        text = f.read_text(encoding="utf-8")
        if "is deprecated" in text:  # a re-export of a moved path, for one release
            continue
        assert not re.search(r"^(import|from) (subprocess|multiprocessing|concurrent\.futures)\b", text, re.M), f
