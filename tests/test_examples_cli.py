"""``masrl example``: the shipped configs listed and written out, in a checkout and from a wheel installed
outside it (the README's quickstart line must run after a wheel install)."""
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from masrl.cli import main
from masrl.examples import examples_root, list_examples

REPO = Path(__file__).resolve().parents[1]


def test_list_names_every_example_config(capsys):
    names = [n for n, _ in list_examples()]
    shipped = sorted(p.relative_to(REPO / "examples").with_suffix("").as_posix()
                     for p in (REPO / "examples").rglob("*.yaml"))
    assert names == shipped and "quickstart" in names and "gpu/math_drmas_qwen3_4b" in names
    assert main(["example", "list"]) == 0
    assert "quickstart" in capsys.readouterr().out


def test_get_writes_the_config_and_the_files_it_names(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["example", "get", "dataset_jsonl"]) == 0
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert written == ["examples/data/arith_test.jsonl", "examples/data/arith_train.jsonl",
                       "examples/dataset_jsonl.yaml", "examples/rewards.py"]
    for rel in written:
        assert (tmp_path / rel).read_bytes() == (REPO / rel).read_bytes()
    # the written config is valid where it was written
    assert main(["config", "show", "examples/dataset_jsonl.yaml"]) == 0
    capsys.readouterr()
    assert main(["example", "get", "dataset_jsonl"]) == 0
    assert capsys.readouterr().out.count("unchanged") == 4


def test_get_writes_the_program_an_external_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["example", "get", "openai_client_team"]) == 0
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    # the program, and the quickstart its header compares it with
    assert written == ["examples/openai_client_team.py", "examples/openai_client_team.yaml", "examples/quickstart.yaml"]
    assert (tmp_path / written[0]).read_bytes() == (REPO / written[0]).read_bytes()


def test_get_keeps_a_changed_file_unless_forced(tmp_path, capsys):
    assert main(["example", "get", "quickstart", "--dir", str(tmp_path)]) == 0
    mine = tmp_path / "examples" / "quickstart.yaml"
    mine.write_text("# my edits\n")
    assert main(["example", "get", "quickstart", "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "differs from the shipped example; --force replaces it" in err and "Traceback" not in err
    assert mine.read_text() == "# my edits\n"
    assert main(["example", "get", "quickstart", "--dir", str(tmp_path), "--force"]) == 0
    assert mine.read_bytes() == (REPO / "examples" / "quickstart.yaml").read_bytes()


@pytest.mark.parametrize("name", ["nope", "../pyproject", "gpu/../../README"])
def test_unknown_example_is_one_line(tmp_path, capsys, name):
    assert main(["example", "get", name, "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no example named" in err[0] and "quickstart" in err[0]
    assert not any(tmp_path.iterdir())


def test_wheel_outside_the_checkout_ships_the_examples(tmp_path):
    """Build the wheel, install it (no dependencies: they are this environment's) into a fresh virtualenv,
    and run the README's first steps from a folder outside the checkout."""
    wheel_dir = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(wheel_dir), str(REPO)], check=True, capture_output=True, timeout=300)
    (wheel,) = wheel_dir.glob("masrl-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, system_site_packages=True, with_pip=False)
    python = env_dir / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the venv's own masrl, not a source tree
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--ignore-installed", str(wheel)], check=True, capture_output=True, timeout=300, env=env)
    work = tmp_path / "work"
    work.mkdir()

    def masrl(*args):
        return subprocess.run([str(python), "-m", "masrl", *args], cwd=work, capture_output=True, text=True,
                              timeout=300, env=env)

    where = subprocess.run([str(python), "-c", "import masrl, masrl.paths as p; print(masrl.__file__, p.in_checkout())"],
                           cwd=work, capture_output=True, text=True, check=True, env=env).stdout.split()
    assert where[0].startswith(str(env_dir)) and where[1] == "False", where
    got = masrl("example", "get", "quickstart")
    assert got.returncode == 0, got.stderr
    assert (work / "examples" / "quickstart.yaml").read_bytes() == (REPO / "examples" / "quickstart.yaml").read_bytes()
    shown = masrl("config", "show", "examples/quickstart.yaml")
    assert shown.returncode == 0 and "name: quickstart" in shown.stdout, shown.stderr
    assert str(examples_root()) not in got.stdout  # listed from the wheel's copy, not the checkout
    got = masrl("example", "get", "openai_client_team")  # a .py the config runs travels in the wheel too
    assert got.returncode == 0, got.stderr
    assert (work / "examples" / "openai_client_team.py").read_bytes() == \
        (REPO / "examples" / "openai_client_team.py").read_bytes()
    listed = masrl("example", "list")
    assert str(env_dir) in listed.stdout and "gpu/search_drmas_hetero_7b_3b" in listed.stdout


def test_get_into_a_dangling_symlink_is_refused(tmp_path, capsys):
    (tmp_path / "examples").symlink_to(tmp_path / "nowhere")
    assert main(["example", "get", "quickstart", "--dir", str(tmp_path)]) == 2
    assert "symlink" in capsys.readouterr().err and not (tmp_path / "nowhere").exists()


def test_list_descriptions_end_on_a_word_or_a_sentence(capsys):
    """Each description is its config's first sentence, or cut at a word boundary with an ellipsis: never
    mid-word ("Dr. MAS" does not end a sentence)."""
    from masrl.examples import description

    assert main(["example", "list"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines()[:-2] if line.strip()]
    full = {name: description((REPO / "examples" / f"{name}.yaml").read_text()) for name, _ in list_examples()}
    for line in lines:
        name, shown = line.split(None, 1)
        assert len(shown) <= 100, line
        text = shown.removesuffix(" …")
        assert full[name].startswith(text), line
        following = full[name][len(text):len(text) + 1]
        assert following in ("", " ", "."), line  # the cut falls between words
    assert any("Dr. MAS math on GPUs" in line for line in lines)


def _named_files(text: str, path: str) -> set[str]:
    """The repository files under examples/ that the file ``path`` (relative to the repository) names, read
    apart from masrl.examples: every YAML string value (comments left out) and every Python string literal,
    each split into words; a word names a file written from the repository root (``examples/data/x.jsonl``),
    from the file's own folder (``include: other.yaml``, ``with_name("mod.py")``), or as a dotted module before
    ``:attr``."""
    import ast
    import posixpath
    import re

    import yaml

    if path.endswith(".py"):
        strings = [n.value for n in ast.walk(ast.parse(text))
                   if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    elif path.endswith((".yaml", ".yml")):
        def walk(node):
            if isinstance(node, dict):
                for key, value in node.items():
                    yield from walk(key)
                    yield from walk(value)
            elif isinstance(node, list):
                for value in node:
                    yield from walk(value)
            elif isinstance(node, str):
                yield node

        strings = list(walk(yaml.safe_load(text)))
    else:
        return set()
    out = set()
    for string in strings:
        for word in re.split(r"[\s\"'`,;=()\[\]{}]+", string):
            module, sep, attr = word.partition(":")
            candidates = [module]
            if sep and attr and re.fullmatch(r"\w+(\.\w+)+", module):
                candidates.append(module.replace(".", "/") + ".py")
            for candidate in candidates:
                for where in (candidate, posixpath.join(posixpath.dirname(path), candidate)):
                    where = posixpath.normpath(where)
                    if where.startswith("examples/") and (REPO / where).is_file():
                        out.add(where)
    return out


@pytest.mark.parametrize("name", [n for n, _ in list_examples()])
def test_get_copies_every_file_an_example_names(tmp_path, monkeypatch, name):
    """Every shipped example, written into an empty folder, has there every file it names, and the files those
    name (a config's programs, modules, data and included YAML; a module's sibling modules), and its config loads
    there (a masrl config with masrl.config.load_config, a sweep spec with the sweep's loader)."""
    from masrl.config import load_config
    from masrl.sweep.spec import load_spec

    assert main(["example", "get", name, "--dir", str(tmp_path)]) == 0
    written = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()}
    todo, seen = [f"examples/{name}.yaml"], set()
    while todo:
        rel = todo.pop()
        assert rel in written, f"{name}: {rel} is named (by {sorted(seen) or 'the command'}) but was not written"
        assert (tmp_path / rel).read_bytes() == (REPO / rel).read_bytes()
        if rel not in seen:
            seen.add(rel)
            todo += sorted(_named_files((REPO / rel).read_text(encoding="utf-8-sig"), rel) - seen)
    monkeypatch.chdir(tmp_path)  # the configs name their files from the folder masrl runs in
    if name.startswith("sweeps/"):
        assert load_spec(f"examples/{name}.yaml").base
    elif not name.startswith("harness/"):  # lm-evaluation-harness task files, not masrl configs
        assert load_config(f"examples/{name}.yaml", []).agents


def test_named_files_are_found_in_every_way_an_example_names_them():
    """The reference reader above finds what each way of naming a file names (its own check)."""
    assert _named_files("env: examples/verifiers_arith.py:load_environment\n", "examples/x.yaml") == \
        {"examples/verifiers_arith.py"}
    assert _named_files("include: masrl_gsm8k.yaml\n", "examples/harness/x.yaml") == \
        {"examples/harness/masrl_gsm8k.yaml"}
    assert _named_files("reward: examples.rewards:solver_verifier\n", "examples/x.yaml") == {"examples/rewards.py"}
    assert _named_files("command: python examples/openai_client_team.py --fast\n", "examples/x.yaml") == \
        {"examples/openai_client_team.py"}
    assert _named_files('p = Path(__file__).with_name("verifiers_arith.py")\n', "examples/x.py") == \
        {"examples/verifiers_arith.py"}
    assert _named_files("# examples/quickstart.yaml in a comment\nname: x\n", "examples/x.yaml") == set()
