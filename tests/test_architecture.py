"""The import rule (docs/architecture.md): the import-linter contracts in pyproject.toml hold, and they
catch a wrong-way import and a cycle (checked on a copy of the package with one bad import added)."""
from __future__ import annotations

import os
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


def test_the_layer_table_of_architecture_md_is_the_contract():
    """docs/architecture.md's layer table lists the contract's layers, top to bottom, with the same modules."""
    import re
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["id"] == "layers")["layers"]
    contract = [set(re.findall(r"masrl\.(\w+)", layer)) - {"__main__"} for layer in layers]
    contract = [names for names in contract if names]  # __main__ sits with cli in the table's first row
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("| layer (top to bottom) |", 1)[1].split("\n\n", 1)[0]
    rows = [line.split(" | ", 1)[0] for line in table.splitlines()[2:] if line.startswith("| `masrl.")]
    documented = [set(re.findall(r"`masrl\.(\w+)`", row)) for row in rows]
    assert documented == contract
