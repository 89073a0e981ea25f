"""Project text describes the software as it is, not the steps it was built in.

Docs, example comments, docstrings, benchmark reports and test comments name a default, what it does and a
measured figure with its command; they never number development steps ("session 12", "round 4",
"issue #7", "§0000", "this stop"). History lives in git. The test reads every text file of the areas below
and fails with file:line of each such phrase.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DEV_STEP = re.compile(
    r"\bsessions? [0-9]+|\bsession-[0-9]+|\bround [0-9]+|\bround-[0-9]+|\bround[0-9]|issue #[0-9]+|§0"
    r"|\bstop [0-9]+|\bthis stop\b|\bthis session\b",
    re.IGNORECASE,
)

# (file, text of the flagged line): lines in pages another part of the project edits; each entry names why
# it is here. Empty this list as those pages are reworded; an entry whose line is gone fails the test.
ALLOWED: list[tuple[str, str, str]] = [
]

SUFFIXES = {".md", ".py", ".yaml", ".yml", ".txt", ".toml", ".cfg"}


def _files() -> list[Path]:
    out = [ROOT / "README.md"]
    for folder in ("docs", "examples", "src/masrl", "tests", ".ci"):
        out += [p for p in (ROOT / folder).rglob("*") if p.is_file() and p.suffix in SUFFIXES]
    bench = ROOT / "benchmarks"
    out += [p for p in bench.glob("*") if p.is_file() and p.suffix in SUFFIXES]
    out += [p for p in (bench / "study").rglob("*") if p.is_file() and p.suffix in {".py", ".yaml", ".md"}]
    out += list((bench / "results").rglob("*.md"))
    me = Path(__file__).resolve()
    return sorted(p for p in set(out) if p.resolve() != me and "__pycache__" not in p.parts)


def _hits() -> list[tuple[str, int, str]]:
    hits = []
    for path in _files():
        rel = path.relative_to(ROOT).as_posix()
        for no, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if DEV_STEP.search(line):
                hits.append((rel, no, line.strip()))
    return hits


def _allowed(rel: str, line: str) -> bool:
    return any(rel == f and text in line for f, text, _ in ALLOWED)


def test_no_development_step_wording():
    bad = [f"{rel}:{no}: {line[:160]}" for rel, no, line in _hits() if not _allowed(rel, line)]
    assert not bad, ("project text numbers development steps; say what the software does now "
                     "(default, effect, figure with its command):\n" + "\n".join(bad))


def test_every_allowed_line_still_exists():
    hits = _hits()
    stale = [f"{f}: {text!r}" for f, text, _ in ALLOWED
             if not any(rel == f and text in line for rel, _, line in hits)]
    assert not stale, "allow-list entries whose line is gone (remove them):\n" + "\n".join(stale)


def test_the_pattern_catches_each_form():
    for phrase in ("Since round 4 the defaults", "session 12's fast decode", "issue #7 (was 16384)",
                   "RESULTS.md §0000", "results/round4/s12", "sessions 10-11", "the session-10 defaults",
                   "in this stop", "measured this session"):
        assert DEV_STEP.search(phrase), phrase
    for phrase in ("rounds to the nearest", "the stop token", "a session cookie", "max_loops 2"):
        assert not DEV_STEP.search(phrase), phrase
