"""``masrl example``: the shipped example configs, wherever masrl is installed.

In a source checkout they are the repository's ``examples/`` folder; a wheel carries a copy as
``masrl/_examples`` (setup.py: every file of it). ``masrl example get NAME`` writes ``examples/NAME.yaml`` under the
working folder, with every file under ``examples/`` that it names, and every file those name, so the README's
``masrl train examples/quickstart.yaml`` runs the same after a wheel install as in a checkout.

What counts as naming a file is one rule for every kind of file (``named_files``): a word of the file's text that,
read as a path from the repository root (``env: examples/verifiers_arith.py:load_environment``, ``command: python
examples/agent.py``, ``base: examples/quickstart.yaml``) or from the file's own folder (a YAML ``include:
masrl_gsm8k.yaml``, a module's ``Path(__file__).with_name("verifiers_arith.py")``), or as a dotted module before
``:attr`` (``examples.rewards:solver_verifier``), is a file of the examples folder. A file merely mentioned (in a
comment) is copied too: a few extra bytes, never a missing one.
"""
from __future__ import annotations

import posixpath
import re
import shutil
import textwrap
from pathlib import Path, PurePosixPath

from masrl.errors import UserInputError
from masrl.paths import REPO_ROOT, check_output_dir, in_checkout

_PATH_WORD = re.compile(r"[\w./-]+\.\w+")  # a word with a suffix: examples/data/x.jsonl, verifiers_arith.py
_MODULE_WORD = re.compile(r"(?<![\w./-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+):[A-Za-z_]")  # examples.rewards:fn


def examples_root() -> Path:
    """The folder the examples are read from: ``examples/`` in a checkout, ``masrl/_examples`` in a wheel."""
    if in_checkout():
        return REPO_ROOT / "examples"
    return Path(__file__).resolve().parent / "_examples"


def description(text: str) -> str:
    """The opening comment paragraph of a config (its lines joined; indented command lines and what follows a
    blank comment line left out)."""
    words = []
    for line in text.splitlines():
        if not line.startswith("#"):
            if words:
                break
            continue
        body = line[1:]
        if not body.strip() or body.startswith("   "):  # a blank comment line, or an indented command
            if words:
                break
            continue
        words.append(body.strip())
    return " ".join(words)


def list_examples() -> list[tuple[str, str]]:
    """``(name, opening comment paragraph)`` of every example config, ``gpu/...`` and ``sweeps/...`` included."""
    root = examples_root()
    return [(path.relative_to(root).with_suffix("").as_posix(), description(path.read_text(encoding="utf-8-sig")))
            for path in sorted(root.rglob("*.yaml"))]


def summary(text: str, width: int = 100) -> str:
    """``text``'s first sentence (a period after a two-letter title such as "Dr" does not end it), shortened at a
    word boundary (with an ellipsis) to ``width`` characters."""
    ends = (m.end() for m in re.finditer(r"(?<![A-Z][a-z])(?<!\.[a-z])\.(?= |$)", text))  # not after Dr, e.g
    first = text[:next(ends, len(text))].rstrip(".")
    return textwrap.shorten(first, width=width, placeholder=" …")


def example_files(name: str) -> list[Path]:
    """The example config ``name`` (``quickstart``, ``gpu/math_drmas_qwen3_4b``) and the files under
    ``examples/`` it names, relative to the examples folder."""
    root = examples_root()
    rel = Path(name.removeprefix("examples/")).with_suffix(".yaml")
    if not root.is_dir():
        raise UserInputError(f"this masrl install has no examples (looked in {root}); reinstall from a wheel or a "
                             "checkout built with setup.py")
    if ".." in rel.parts or not (root / rel).is_file():
        known = ", ".join(n for n, _ in list_examples())
        raise UserInputError(f"no example named {name!r}; known: {known} (masrl example list)")
    files, todo = [], [rel]
    while todo:
        current = todo.pop()
        if current in files:
            continue
        files.append(current)
        try:
            text = (root / current).read_text(encoding="utf-8-sig")
        except UnicodeDecodeError:  # a binary file names nothing
            continue
        todo.extend(sorted(named_files(root, current, text) - set(files)))
    return files


def named_files(root: Path, current: Path, text: str) -> set[Path]:
    """The files of the examples folder ``root`` that ``text`` (the file ``current``, relative to ``root``) names
    (the module docstring's rule), relative to ``root``."""
    words = set(_PATH_WORD.findall(text)) | {m.replace(".", "/") + ".py" for m in _MODULE_WORD.findall(text)}
    out = set()
    for word in words:
        candidates = [posixpath.join(current.parent.as_posix(), word)]  # from the file's own folder
        if posixpath.normpath(word).startswith("examples/"):  # from the repository root
            candidates.append(posixpath.normpath(word).removeprefix("examples/"))
        for candidate in candidates:
            rel = PurePosixPath(posixpath.normpath(candidate))
            if rel.is_absolute() or rel.parts[:1] in (("..",), (".",)) or not (root / rel).is_file():
                continue
            if (root / rel).resolve().is_relative_to(root.resolve()):  # no link out of the folder
                out.add(Path(rel))
    return out


def write_examples(names: list[str], dest: Path, force: bool = False) -> list[tuple[Path, str]]:
    """Copy the examples ``names`` (or every one, for ``all``) to ``dest/examples/``; ``(path, status)`` per file.
    An existing different file is kept unless ``force`` (nothing is written then: one error names it)."""
    root = examples_root()
    if names == ["all"]:
        names = [n for n, _ in list_examples()]
    rels = sorted({rel for name in names for rel in example_files(name)})
    target_root = check_output_dir(Path(dest).expanduser() / "examples", "masrl example get --dir")
    plan = []
    for rel in rels:
        target = target_root / rel
        if target.is_symlink() or (target.exists() and not target.is_file()):
            raise UserInputError(f"{target} exists and is not a plain file; remove it or choose another --dir")
        same = target.is_file() and target.read_bytes() == (root / rel).read_bytes()
        if target.exists() and not same and not force:
            raise UserInputError(f"{target} exists and differs from the shipped example; --force replaces it")
        plan.append((rel, target, "unchanged" if same else ("replaced" if target.exists() else "written")))
    for rel, target, status in plan:
        if status != "unchanged":
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / rel, target)
    return [(target, status) for _, target, status in plan]


def _cmd_list(args) -> int:
    rows = list_examples()
    width = max(len(n) for n, _ in rows)
    for name, first in rows:
        print(f"{name:<{width}}  {summary(first)}")
    print(f"\n{len(rows)} examples in {examples_root()}; write one out with: masrl example get NAME")
    return 0


def _cmd_get(args) -> int:
    for path, status in write_examples(args.names, Path(args.dir), force=args.force):
        print(f"{status:<9} {path}")
    first = args.names[0] if args.names != ["all"] else "quickstart"
    print(f"run it with: masrl train examples/{Path(first.removeprefix('examples/')).with_suffix('.yaml').as_posix()}"
          + (f"  (from {args.dir})" if args.dir != "." else ""))
    return 0


def register(sub) -> None:
    """``masrl example list | get NAME [NAME ...] | get all [--dir DIR] [--force]``."""
    ex = sub.add_parser("example", help="the shipped example configs: list them, write them to ./examples/")
    ex_sub = ex.add_subparsers(dest="example_command", required=True)
    ls = ex_sub.add_parser("list", help="every example config with its first comment line")
    ls.set_defaults(func=_cmd_list)
    get = ex_sub.add_parser("get", help="write examples/NAME.yaml (and the files it names) under --dir")
    get.add_argument("names", nargs="+", metavar="NAME", help="example names (masrl example list), or all")
    get.add_argument("--dir", default=".", help="folder to write examples/ into (default: the working folder)")
    get.add_argument("--force", action="store_true", help="replace files that differ from the shipped ones")
    get.set_defaults(func=_cmd_get)
