"""Atomic writes: a reader (or a crash, or a full disk) never sees a half-written file or folder."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

__all__ = ["write_text_atomic", "write_dir_atomically"]


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


def write_dir_atomically(final: Path, write: Callable[[Path], None], *, marker: str = "meta.json") -> None:
    """Fill a temporary sibling folder with ``write(tmp)``, then rename it to ``final``.

    If another process finished the same folder first (``final`` exists and holds ``marker``, the file
    written last), its copy is kept and ours discarded; any other failure to rename raises ``OSError``.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        write(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / marker).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
