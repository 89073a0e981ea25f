"""docs/config.md, generated from the config schema (``masrl.config``): every key, type, default, description.

    python -m masrl.config_docs            # rewrite docs/config.md
    python -m masrl.config_docs --check    # exit 1 when docs/config.md is stale

A test runs the check, so a new config field without a description, or a changed default,
shows up as a stale reference until the file is regenerated.
"""
from __future__ import annotations

import argparse
import json
import sys
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from masrl.config import RunConfig

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "config.md"

_HEADER = """# Config reference

Generated from `src/masrl/config.py` by `python -m masrl.config_docs` (do not edit by hand; a test
fails when this file is stale). A run's config is YAML; every key below can be overridden on the
command line (`masrl train CONFIG trainer.total_steps=50`, before or after the options), and
`masrl config show CONFIG [overrides]` prints the resolved config: every default spelled out, the
workflow's default prompt templates and the trackers in effect included. `<name>` stands for a key you
choose (an agent, a policy).

Relative paths in a config (data files, reward and tool modules, corpora, `output_dir`) start at the
folder you run masrl from, not at the config file's folder, as in TRL and verl scripts: run the shipped
examples from the repository root. Benchmarks and corpora can also be named (`gsm8k`, `wiki18_sample1000`):
names are looked up in the data folders ([data.md](data.md)).
"""


def _submodels(annotation) -> list[tuple[str, type[BaseModel]]]:
    """Models inside an annotation: ``("", M)`` for ``M``/``Optional[M]``, ``(".<name>", M)`` for ``dict[str, M]``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [("", annotation)]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is dict and len(args) == 2:
        return [(".<name>", m) for _, m in _submodels(args[1])]
    return [item for a in args for item in _submodels(a)]


def _type_name(annotation) -> str:
    if typing.get_origin(annotation) is typing.Literal:  # the values as YAML writes them: true, not True
        return "Literal[" + ", ".join(json.dumps(a) for a in typing.get_args(annotation)) + "]"
    if typing.get_origin(annotation) is typing.Union and any(typing.get_origin(a) is typing.Literal
                                                             for a in typing.get_args(annotation)):
        args = typing.get_args(annotation)
        names = [_type_name(a) for a in args if a is not type(None)]
        return f"Optional[{' | '.join(names)}]" if type(None) in args else " | ".join(names)
    text = repr(annotation) if not isinstance(annotation, type) else annotation.__name__
    for noise in ("typing.", "masrl.config.", "<class '", "'>", "NoneType"):
        text = text.replace(noise, "None" if noise == "NoneType" else "")
    return text


def _default(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        return "(section)" if isinstance(value, BaseModel) else f"`{json.dumps(value)}`"
    if field.default is PydanticUndefined:
        return "required"
    return f"`{json.dumps(field.default, default=str)}`"


def _rows(model: type[BaseModel], prefix: str, sections: list) -> None:
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        subs = _submodels(field.annotation)
        if subs:
            rows.append(f"| `{key}` | section | {_default(field)} | {field.description or ''} |")
            for suffix, sub in subs:
                _rows(sub, f"{key}{suffix}.", sections)
        else:
            desc = (field.description or "").replace("|", "\\|").replace("\n", " ")
            type_name = _type_name(field.annotation).replace("|", "\\|")
            rows.append(f"| `{key}` | `{type_name}` | {_default(field)} | {desc} |")
    doc = (model.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
    title = prefix.rstrip(".") or "top level"
    sections.insert(0, (title, doc, rows))


def render() -> str:
    sections: list = []
    _rows(RunConfig, "", sections)
    sections.sort(key=lambda s: (s[0] != "top level", s[0]))
    out = [_HEADER]
    for title, doc, rows in sections:
        out += [f"## {title}", ""] + ([doc, ""] if doc else [])
        out += ["| key | type | default | description |", "|---|---|---|---|", *rows, ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m masrl.config_docs", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the file is stale instead of writing it")
    parser.add_argument("--out", type=Path, default=DOC_PATH)
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text() if args.out.is_file() else ""
        if current != text:
            print(f"{args.out} is stale: run python -m masrl.config_docs", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
