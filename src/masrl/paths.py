"""Where masrl finds benchmark data and keeps its caches."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def in_checkout() -> bool:
    """True when masrl runs from a source checkout (``src/masrl`` under a folder with ``pyproject.toml``),
    not from an installed wheel."""
    return (REPO_ROOT / "pyproject.toml").is_file() and (REPO_ROOT / "src" / "masrl").is_dir()


def user_data_dir() -> Path:
    """The user data folder ``masrl data get`` downloads to: platformdirs' user data dir for masrl
    (``~/.local/share/masrl/data`` on Linux)."""
    try:
        import platformdirs
        return Path(platformdirs.user_data_dir("masrl", appauthor=False)) / "data"
    except ImportError:  # pragma: no cover - platformdirs is a dependency
        return Path.home() / ".local" / "share" / "masrl" / "data"


def data_roots() -> list[Path]:
    """The data folders masrl reads benchmark files from, in order: ``$MASRL_DATA_DIR`` alone when it is
    set; otherwise ``../shared/data`` beside the repository (in a source checkout), then the user data
    folder (``user_data_dir()``)."""
    env = os.environ.get("MASRL_DATA_DIR")
    if env:
        return [Path(env).expanduser()]
    roots = [REPO_ROOT.parent / "shared" / "data"] if in_checkout() else []
    return roots + [user_data_dir()]


def data_dir() -> Path:
    """The first data folder (``data_roots()[0]``); find one file with ``data_file``."""
    return data_roots()[0]


def data_file(rel: str | os.PathLike) -> Path:
    """``rel`` (a path under a data folder) in the first data folder that holds it; when none does, its
    path under ``data_dir()`` (so that a message can name it: ``masrl.catalog.get_hint`` says how to get it)."""
    for root in data_roots():
        if (root / rel).is_file():
            return root / rel
    return data_dir() / rel


def cache_dir() -> Path:
    """Cache folder for converted models and retrieval indexes: ``$MASRL_CACHE_DIR`` or ``~/.cache/masrl``."""
    env = os.environ.get("MASRL_CACHE_DIR")
    path = Path(env).expanduser() if env else Path.home() / ".cache" / "masrl"
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary sibling and a rename: a reader (or a crash, or a full
    disk) never sees a half-written file, and a file that was there stays whole until the new one is."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def sha256_file(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes, read in 1 MiB blocks (hex)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
