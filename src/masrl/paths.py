"""Where masrl finds benchmark data and keeps its caches."""
from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def data_dir() -> Path:
    """Benchmark data folder: ``$MASRL_DATA_DIR``, else ``../shared/data`` beside the repository."""
    env = os.environ.get("MASRL_DATA_DIR")
    return Path(env).expanduser() if env else (REPO_ROOT.parent / "shared" / "data")


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
