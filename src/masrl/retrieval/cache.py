"""On-disk cache keys for retrieval indexes (written atomically, ``masrl.io.atomic``)."""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any, Callable, TypeVar

from masrl.io.atomic import write_dir_atomically
from masrl.paths import cache_dir

log = logging.getLogger(__name__)
T = TypeVar("T")

CACHE_FORMAT_VERSION = 1


def corpus_fingerprint(path: str | Path) -> dict[str, Any]:
    """What identifies a corpus file version: absolute path, size and modification time."""
    path = Path(path).expanduser().resolve()
    st = path.stat()
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def cache_key(kind: str, corpus_path: str | Path, settings: dict[str, Any]) -> str:
    """Key for an index of ``corpus_path`` built with ``settings`` (JSON-serializable)."""
    payload = {"kind": kind, "v": CACHE_FORMAT_VERSION, "corpus": corpus_fingerprint(corpus_path),
               "settings": settings}
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:20]
    return f"{kind}-{Path(corpus_path).name}-{digest}"


def retrieval_cache_dir(root: str | Path | None = None) -> Path:
    path = Path(root).expanduser() if root is not None else cache_dir() / "retrieval"
    path.mkdir(parents=True, exist_ok=True)
    return path


def discard_dir(folder: Path) -> None:
    """Remove a stale or damaged cache folder (best effort)."""
    shutil.rmtree(folder, ignore_errors=True)


def cached_index(kind: str, corpus_path: str | Path, settings: dict[str, Any], *, cache_root: str | Path | None,
                 load: Callable[[Path, dict], T | None], build: Callable[[], T],
                 save: Callable[[T, Path], dict], what: str = "index") -> T:
    """The index-cache step of every retriever: load the cached index of ``corpus_path`` built with
    ``settings``, or build it and cache it.

    ``load(folder, meta)`` returns the cached index, or ``None`` when it does not match the corpus;
    ``build()`` makes a fresh one; ``save(index, tmp)`` writes its files into a temporary folder and
    returns what goes into ``meta.json``. A stale or unreadable cache is rebuilt, never fatal; a
    cache that cannot be written is only a warning. ``what`` names the cached thing in log lines.
    """
    folder = retrieval_cache_dir(cache_root) / cache_key(kind, corpus_path, settings)
    if (folder / "meta.json").is_file():
        try:
            index = load(folder, json.loads((folder / "meta.json").read_text()))
            if index is not None:
                return index
            log.warning("%s cache %s does not match the corpus; rebuilding", kind, folder)
        except Exception as e:  # a damaged cache is rebuilt, never fatal
            log.warning("%s cache %s unreadable (%s); rebuilding", kind, folder, e)
        discard_dir(folder)
    index = build()

    def write(tmp: Path) -> None:
        meta = save(index, tmp)
        (tmp / "meta.json").write_text(json.dumps(meta))

    try:
        write_dir_atomically(folder, write)
    except OSError as e:
        log.warning("could not cache the %s %s in %s: %s", kind, what, folder, e)
    return index
