"""MBPP and HumanEval loaders.

=========  ===============================  ===========================================
loader     default file (under a data folder)  splits
=========  ===============================  ===========================================
MBPP       code/mbpp.jsonl                  prompt 1-10, test 11-510, validation 511-600,
                                            train 601-974 (by ``task_id``), or ``all``
HumanEval  code/HumanEval.jsonl(.gz)        test (all 164 problems)
=========  ===============================  ===========================================

``Task.question`` is what the model sees: the MBPP problem text plus the signature of the
function to write (and, with ``show_tests=True``, the three asserts as in the original MBPP
prompt), or the HumanEval prompt (signature + docstring to complete). ``Task.answer`` holds the
hidden tests, as a dict read by ``masrl.codecheck.scoring.score_code``::

    {"kind": "mbpp", "tests": [assert, ...], "setup": str, "entry_point": str,
     "remote_names": [...], "challenge_tests": [...]}
    {"kind": "humaneval", "prompt": str, "test": str, "entry_point": str}

``Task.meta`` has ``data_source``/``benchmark`` (``mbpp``/``humaneval``), ``task_id``,
``entry_point``, ``split`` and ``reference_solution`` (the dataset's canonical code; for
HumanEval the body completion). Malformed rows are skipped with a
``MalformedRowWarning`` naming ``file:line``, or raise ``ValueError`` with
``strict=True`` (see ``masrl.io.rows``).
"""
from __future__ import annotations

import ast
import warnings
from pathlib import Path

from masrl.catalog import DataNotFoundError, get_hint
from masrl.codecheck.scoring import free_names
from masrl.paths import data_file
from masrl.io.rows import MalformedRowWarning  # noqa: F401 - re-exported (the one warning class)
from masrl.io.rows import BadRow, RowPos, read_rows
from masrl.types import Task

MBPP_SPLITS = {"prompt": (1, 10), "test": (11, 510), "validation": (511, 600), "train": (601, 974)}


def _find(path: str | Path | None, *names: str) -> Path:
    if path is not None:
        p = Path(path).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"code benchmark file {p} not found")
        return p
    for name in names:
        if data_file(f"code/{name}").is_file():
            return data_file(f"code/{name}")
    raise DataNotFoundError(f"none of {', '.join(names)} found under code/: {get_hint('code/' + names[0])}")


def _str_field(obj: dict, key: str, *, allow_empty: bool = False) -> str:
    if key not in obj:
        raise BadRow(f"missing field {key!r}")
    v = obj[key]
    if not isinstance(v, str):
        raise BadRow(f"field {key!r} is not a string ({type(v).__name__})")
    if not allow_empty and not v.strip():
        raise BadRow(f"field {key!r} is empty")
    return v


def _parse(src: str, what: str) -> ast.Module:
    try:
        with warnings.catch_warnings():  # invalid escape sequences in dataset code
            warnings.simplefilter("ignore", (DeprecationWarning, SyntaxWarning))
            return ast.parse(src)
    except (SyntaxError, ValueError) as e:
        raise BadRow(f"{what} does not parse ({e.__class__.__name__}: {e})") from None


def _top_level_names(tree: ast.Module, imports: bool = True) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        names.add(n.id)
        elif imports and isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                names.add((a.asname or a.name).split(".")[0])
    return names


def _called_names(trees: list[ast.AST]) -> list[str]:
    out: list[str] = []
    for tree in trees:
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id not in out:
                out.append(n.func.id)
    return out


def _signature(tree: ast.Module, name: str) -> str | None:
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return f"def {name}({ast.unparse(node.args)})"
        if isinstance(node, ast.ClassDef) and node.name == name:
            return f"class {name}"
    return None


def _mbpp_row(obj: dict, show_tests: bool) -> tuple[str, dict, dict]:
    text = _str_field(obj, "text").strip()
    code = _str_field(obj, "code").replace("\r\n", "\n")
    setup = _str_field(obj, "test_setup_code", allow_empty=True).replace("\r\n", "\n") \
        if "test_setup_code" in obj else ""
    tests = obj.get("test_list")
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) and t.strip() for t in tests):
        raise BadRow("field 'test_list' must be a non-empty list of strings")
    challenge = obj.get("challenge_test_list") or []
    if not isinstance(challenge, list) or not all(isinstance(t, str) for t in challenge):
        raise BadRow("field 'challenge_test_list' must be a list of strings")
    code_tree = _parse(code, "field 'code'")
    trees = []
    for i, t in enumerate(tests):
        tree = _parse(t, f"test {i}")
        if not any(isinstance(n, ast.Assert) for n in ast.walk(tree)):
            raise BadRow(f"test {i} has no assert")
        trees.append(tree)
    defined = _top_level_names(code_tree, imports=False)
    setup_defined = _top_level_names(_parse(setup, "field 'test_setup_code'")) if setup.strip() else set()
    entry = next((n for n in _called_names(trees) if n in defined), None)
    if entry is None:
        raise BadRow("no function called by the tests is defined by the reference code")
    # names the tests take from the candidate's program (not from the judge's builtins/stdlib;
    # modules the reference code imports, like ``sys``, are imported by the judge itself)
    remote = [n for n in free_names(trees) if n in defined or n in setup_defined]
    sig = _signature(code_tree, entry) or f"def {entry}(...)"
    question = f"{text}\nThe function must be defined as: {sig}:"
    if show_tests:
        question = f"{text}\nYour code should pass these tests:\n" + "\n".join(t.strip() for t in tests)
    answer = {"kind": "mbpp", "tests": [t.strip() for t in tests], "setup": setup, "entry_point": entry,
              "remote_names": remote, "challenge_tests": [t.strip() for t in challenge]}
    meta = {"entry_point": entry, "signature": sig, "reference_solution": code}
    return question, answer, meta


def load_mbpp(path: str | Path | None = None, split: str = "test", limit: int | None = None,
              strict: bool = False, *, show_tests: bool = False) -> list[Task]:
    """MBPP tasks of one standard split (``prompt``/``test``/``validation``/``train``/``all``)."""
    if split not in MBPP_SPLITS and split != "all":
        raise ValueError(f"MBPP split must be one of {sorted(MBPP_SPLITS) + ['all']}, not {split!r}")
    lo, hi = MBPP_SPLITS.get(split, (-10 ** 9, 10 ** 9))
    p = _find(path, "mbpp.jsonl", "mbpp.jsonl.gz")
    seen: set[int] = set()

    def parse(obj: dict, pos: RowPos) -> Task | None:
        tid = obj.get("task_id")
        if isinstance(tid, str) and tid.strip().isdigit():
            tid = int(tid)
        if not isinstance(tid, int) or isinstance(tid, bool):
            raise BadRow("missing or non-integer 'task_id'")
        if not lo <= tid <= hi:
            return None
        if tid in seen:
            raise BadRow(f"duplicate task_id {tid}")
        question, answer, meta = _mbpp_row(obj, show_tests)
        seen.add(tid)
        meta = {"data_source": "mbpp", "benchmark": "mbpp", "task_id": tid, "split": split, **meta}
        return Task(id=f"mbpp/{tid}", question=question, answer=answer, meta=meta)

    tasks, _ = read_rows(p, parse, strict=strict, limit=limit, format="jsonl")
    return tasks


def _humaneval_row(obj: dict) -> tuple[str, str, dict, dict]:
    tid = _str_field(obj, "task_id").strip()
    prompt = _str_field(obj, "prompt")
    entry = _str_field(obj, "entry_point").strip()
    test = _str_field(obj, "test")
    if not entry.isidentifier():
        raise BadRow(f"entry_point {entry!r} is not an identifier")
    _parse(prompt, "field 'prompt'")
    tree = _parse(test, "field 'test'")
    if not any(isinstance(n, ast.FunctionDef) and n.name == "check" for n in tree.body):
        raise BadRow("field 'test' defines no check(candidate) function")
    canonical = obj.get("canonical_solution", "")
    answer = {"kind": "humaneval", "prompt": prompt, "test": test, "entry_point": entry}
    meta = {"entry_point": entry, "reference_solution": canonical if isinstance(canonical, str) else ""}
    return tid, prompt, answer, meta


def load_humaneval(path: str | Path | None = None, split: str = "test", limit: int | None = None,
                   strict: bool = False) -> list[Task]:
    """The 164 HumanEval problems (only a ``test`` split exists)."""
    if split not in ("test", "all"):
        raise ValueError(f"HumanEval has only the 'test' split, not {split!r}")
    p = _find(path, "HumanEval.jsonl.gz", "HumanEval.jsonl", "humaneval.jsonl")
    seen: set[str] = set()

    def parse(obj: dict, pos: RowPos) -> Task:
        tid, question, answer, meta = _humaneval_row(obj)
        if tid in seen:
            raise BadRow(f"duplicate task_id {tid!r}")
        seen.add(tid)
        meta = {"data_source": "humaneval", "benchmark": "humaneval", "task_id": tid, "split": "test", **meta}
        return Task(id=tid if tid.lower().startswith("humaneval/") else f"humaneval/{tid}",
                    question=question, answer=answer, meta=meta)

    tasks, _ = read_rows(p, parse, strict=strict, limit=limit, format="jsonl")
    return tasks
