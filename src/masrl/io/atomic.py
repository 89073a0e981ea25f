"""Atomic writes: a reader (or a crash, or a full disk) never sees a half-written file or folder."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

__all__ = ["write_text_atomic", "write_file_atomic", "write_dir_atomically", "as_if_opened"]


def _umask() -> int:
    """The process's umask, read without changing it where the system says it (Linux), else set and restored."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def as_if_opened(*paths: str | os.PathLike) -> None:
    """Give each file the mode a plain ``open`` would have given it (0666 less the umask: 0644 under umask 022).
    A file written through ``tempfile`` or by safetensors comes out 0600, readable by its owner only, unlike every
    other file of a run folder; every atomic write here ends with this."""
    mode = 0o666 & ~_umask()
    for path in paths:
        os.chmod(path, mode)


def write_file_atomic(path: str | os.PathLike, write: Callable[[Path], None], suffix: str = "") -> Path:
    """``write(tmp)`` into a temporary sibling of ``path`` (``suffix``: its extension, for writers that read it),
    then the mode a plain ``open`` gives and a rename: a reader never sees a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        as_if_opened(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
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
