"""No class under src/masrl is longer than MAX_LINES (docs/architecture.md, "Size"): a class that grows past it
gets collaborators of its own, as the rollout engine has (static decode, prefix reuse, continuous batching)."""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "masrl"
MAX_LINES = 300

# class name -> why it may be longer (each must still exist and still be longer: otherwise drop it here)
ALLOWED: dict[str, str] = {}
# module file name -> why its classes may be longer: the sandbox child is one process's whole life (set-up,
# limits, the request loop), written to run on its own, importing nothing of masrl
ALLOWED_MODULES = {"_child.py": "the sandbox child process"}


def long_classes(root: Path, limit: int = MAX_LINES) -> list[tuple[str, str, int]]:
    """(file relative to ``root``, class name, lines) of every class longer than ``limit`` lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append((str(path.relative_to(root)), node.name, lines))
    return found


def test_no_class_is_longer_than_the_limit():
    too_long = [(f, name, n) for f, name, n in long_classes(SRC)
                if name not in ALLOWED and Path(f).name not in ALLOWED_MODULES]
    assert too_long == [], (f"classes over {MAX_LINES} lines: {too_long}; give them collaborators (their own "
                            "classes or modules), or name them in ALLOWED with the reason")


def test_every_allowed_class_is_still_long_and_every_allowed_module_exists():
    long_names = {name for _, name, _ in long_classes(SRC)}
    assert sorted(set(ALLOWED) - long_names) == [], "no longer over the limit (or renamed): drop them from ALLOWED"
    files = {p.name for p in SRC.rglob("*.py")}
    assert sorted(set(ALLOWED_MODULES) - files) == []


def test_the_check_catches_a_long_class(tmp_path):
    body = "\n".join(f"    def m{i}(self):\n        return {i}\n" for i in range(MAX_LINES // 3 + 1))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "big.py").write_text(f"class Big:\n{body}\n\nclass Small:\n    x = 1\n")
    found = long_classes(tmp_path)
    assert [(f, name) for f, name, _ in found] == [("pkg/big.py", "Big")]
    assert found[0][2] > MAX_LINES
    assert long_classes(tmp_path, limit=found[0][2]) == []
