"""The bounded YAML reader: one YAML document parsed with limits on size, nesting and alias expansion,
every refusal one ``ConfigError`` naming the source and, where known, the line and column.

Used for run configs (``masrl.config.load_config``), sweep specs and config overrides; anything
that reads a YAML file a user names goes through ``read_yaml_file``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from masrl.errors import ConfigError, UserInputError, read_user_text

__all__ = ["CONFIG_MAX_BYTES", "YAML_MAX_DEPTH", "YAML_MAX_NODES", "YamlLimit", "BoundedLoader", "load_bounded",
           "load_yaml", "read_yaml_file"]

CONFIG_MAX_BYTES = 1 << 20  # a config file is a few KB
YAML_MAX_DEPTH = 64  # nesting of mappings/lists in one config file
YAML_MAX_NODES = 100_000  # values in a config once every alias is expanded (a real config has hundreds)


class YamlLimit(Exception):
    """A YAML text over one of the limits (``mark``: where, when known)."""

    def __init__(self, message: str, mark=None):
        super().__init__(message)
        self.mark = mark


class BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses nesting deeper than ``YAML_MAX_DEPTH`` while composing (the
    composer recurses: 20,000 levels were a RecursionError) and aliases that expand to more than
    ``YAML_MAX_NODES`` values or refer to themselves (an alias bomb expands exponentially)."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > YAML_MAX_DEPTH:
                raise YamlLimit(f"nested deeper than {YAML_MAX_DEPTH} levels", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _construct_int(loader: "BoundedLoader", node) -> int:
    """YAML's int constructor, with Python's limit on digits (``sys.get_int_max_str_digits``) as a refusal
    that names the place instead of a ``ValueError`` from deep inside PyYAML."""
    try:
        return yaml.SafeLoader.construct_yaml_int(loader, node)
    except ValueError:
        raise YamlLimit(f"the number {str(node.value)[:20]}... has {len(str(node.value)):,} characters; "
                         "Python converts at most 4,300 digits", node.start_mark) from None


BoundedLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)


def _children(node) -> list:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def _expanded_size(root) -> int:
    """Values in the document with every alias expanded (iterative; shared nodes counted per use)."""
    sizes: dict[int, int] = {}
    stack, open_ = [(root, False)], set()
    while stack:
        node, done = stack.pop()
        if done:
            open_.discard(id(node))
            sizes[id(node)] = min(1 + sum(sizes[id(c)] for c in _children(node)), YAML_MAX_NODES + 1)
            continue
        if id(node) in sizes:
            continue
        if id(node) in open_:
            raise YamlLimit("an alias refers to a value that contains it (a recursive structure)", node.start_mark)
        open_.add(id(node))
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in sizes)
    return sizes[id(root)]


def load_bounded(text: str) -> Any:
    """Parse ``text`` with the limits; raises ``yaml.YAMLError`` or ``YamlLimit``."""
    loader = BoundedLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None and _expanded_size(node) > YAML_MAX_NODES:
            raise YamlLimit(f"aliases expand to more than {YAML_MAX_NODES:,} values (an alias bomb?); "
                             "write the values out or use fewer aliases", node.start_mark)
        return loader.construct_document(node) if node is not None else None
    finally:
        loader.dispose()


def _where(mark) -> str:
    return f":{mark.line + 1}:{mark.column + 1}" if mark else ""


def load_yaml(text: str, source: str) -> Any:
    """Parse one YAML document with the limits of ``BoundedLoader``.

    Errors are one ``ConfigError`` naming ``source`` and, where known, the line and column.
    """
    try:
        return load_bounded(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise ConfigError(f"{source}{_where(mark)}: malformed YAML ({getattr(e, 'problem', e)})") from None
    except YamlLimit as e:
        raise ConfigError(f"{source}{_where(e.mark)}: YAML refused: {e}") from None


def read_yaml_file(path: str | Path, what: str = "config file") -> Any:
    """A YAML file the user named, read with the config limits (size, nesting, alias expansion, UTF-8):
    every way it cannot be read or parsed is one ``ConfigError`` naming ``what`` and the path."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{what} {str(path)!r} does not exist")
    try:
        text = read_user_text(path, what, max_bytes=CONFIG_MAX_BYTES)
    except UserInputError as e:
        raise ConfigError(str(e)) from None
    return load_yaml(text, str(path))

