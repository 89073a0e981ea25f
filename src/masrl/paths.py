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
