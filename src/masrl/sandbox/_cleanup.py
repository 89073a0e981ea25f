"""Removing what an execution left on the host: never raises, never recurses, bounded in time.

A sandboxed program controls the shape of its work directory: a 2,000-deep chain of
directories (``shutil.rmtree`` recurses once per level and raises ``RecursionError`` on
Python 3.11), a million empty files, directories it made unreadable (``chmod 000``).
``remove_tree`` walks the tree with a constant number of file descriptors and no
recursion: every subdirectory is moved up to the top directory (a rename within one file
system) and emptied there, so depth costs nothing. It works for ``budget_s`` seconds on the
caller's thread; what is left then is finished by one background thread (and, at interpreter
exit, by an ``atexit`` hook), so the directory never stays behind and the caller never waits
longer than its budget.
"""
from __future__ import annotations

import atexit
import itertools
import logging
import os
import stat
import threading
import time

log = logging.getLogger(__name__)
_COUNTER = itertools.count()
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_dir(name: str, dir_fd: int | None) -> int | None:
    """An fd of directory ``name`` (made traversable first if its owner locked it)."""
    for attempt in range(2):
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
        except PermissionError:
            if attempt:
                return None
            try:  # the tree's processes are dead: nothing can swap this for a symlink now
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    os.chmod(name, 0o700, dir_fd=dir_fd)
            except OSError:
                return None
        except OSError:
            return None
    return None


def _empty_one(top_fd: int, name: str, deadline: float) -> bool:
    """Unlink the files of ``top/name``, move its subdirectories up into ``top``, rmdir it.
    False when the deadline passed first."""
    fd = _open_dir(name, top_fd)
    if fd is not None:
        try:
            try:
                os.fchmod(fd, 0o700)
            except OSError:
                pass
            with os.scandir(fd) as it:
                for entry in it:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            os.rename(entry.name, f".masrl-rm-{next(_COUNTER)}", src_dir_fd=fd, dst_dir_fd=top_fd)
                        else:
                            os.unlink(entry.name, dir_fd=fd)
                    except OSError:
                        pass
                    if time.monotonic() > deadline:
                        return False
        except OSError:
            pass
        finally:
            os.close(fd)
    try:
        os.rmdir(name, dir_fd=top_fd)
    except FileNotFoundError:
        pass
    except OSError:
        try:  # not a directory after all (a file that replaced it)
            os.unlink(name, dir_fd=top_fd)
        except OSError:
            pass
    return True


def _remove_for(path: str, budget_s: float) -> bool:
    """Work on ``path`` for at most ``budget_s`` seconds; True when it is gone."""
    deadline = time.monotonic() + max(0.0, budget_s)
    parent, base = os.path.split(os.path.abspath(path))
    try:
        parent_fd = os.open(parent, _DIR_FLAGS)
    except OSError:
        return not os.path.lexists(path)
    try:
        top_fd = _open_dir(base, parent_fd)
        if top_fd is None:
            try:
                os.unlink(base, dir_fd=parent_fd)  # a file or symlink, or already gone
            except FileNotFoundError:
                return True
            except OSError:
                return False
            return True
        try:
            stuck = 0
            while True:
                with os.scandir(top_fd) as it:
                    entries = [(e.name, _is_dir(e)) for e in itertools.islice(it, 4096)]
                if not entries:
                    break
                progress = False
                for name, is_dir in entries:
                    if is_dir:
                        if not _empty_one(top_fd, name, deadline):
                            return False
                        progress = progress or not _lexists(name, top_fd)
                    else:
                        try:
                            os.unlink(name, dir_fd=top_fd)
                            progress = True
                        except FileNotFoundError:
                            progress = True
                        except OSError:
                            pass
                    if time.monotonic() > deadline:
                        return False
                stuck = 0 if progress else stuck + 1
                if stuck > 3:
                    return False
        finally:
            os.close(top_fd)
        os.rmdir(base, dir_fd=parent_fd)
        return True
    except OSError:
        return not os.path.lexists(path)
    finally:
        os.close(parent_fd)


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return True  # let _empty_one find out


def _lexists(name: str, dir_fd: int) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except OSError:
        return False


class _Reaper:
    """One background thread finishing removals that ran over their budget. A path stays in
    ``pending`` until it is gone, and one drain runs at a time (the thread's or the atexit
    one), so exiting never skips a tree the thread was still working on."""

    def __init__(self) -> None:
        self.pending: list[str] = []
        self.lock = threading.Lock()
        self.drain_lock = threading.Lock()
        self.wake = threading.Event()
        self.thread: threading.Thread | None = None

    def add(self, path: str) -> None:
        with self.lock:
            if path not in self.pending:
                self.pending.append(path)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._loop, name="masrl-sandbox-cleanup", daemon=True)
                self.thread.start()
        self.wake.set()

    def _loop(self) -> None:
        while True:
            self.wake.wait(5.0)
            self.wake.clear()
            self.drain(2.0)  # in rounds, so that an exiting interpreter takes over soon

    def drain(self, budget_s: float) -> list[str]:
        """Work on every pending removal for up to ``budget_s`` in all; returns what is left."""
        end = time.monotonic() + budget_s
        with self.drain_lock:
            with self.lock:
                todo = list(self.pending)
            for path in todo:
                try:
                    done = _remove_for(path, max(0.0, end - time.monotonic()))
                except Exception:  # pragma: no cover - _remove_for handles OSError itself
                    done = False
                if done or not os.path.lexists(path):
                    with self.lock:
                        if path in self.pending:
                            self.pending.remove(path)
            with self.lock:
                return list(self.pending)


_REAPER = _Reaper()


def remove_tree(path: str, budget_s: float = 1.0) -> bool:
    """Remove ``path`` (a directory tree, a file or nothing); never raises and never recurses.

    Works for at most ``budget_s`` seconds here; what is left is removed in the background.
    Returns True when the tree is gone on return.
    """
    try:
        if _remove_for(path, budget_s):
            return True
    except Exception as e:  # pragma: no cover - defensive: cleanup must never raise
        log.warning("sandbox cleanup of %s failed: %s", path, e)
    _REAPER.add(path)
    return False


def pending_removals() -> list[str]:
    """Trees still waiting for the background cleanup."""
    with _REAPER.lock:
        return list(_REAPER.pending)


def finish_pending(budget_s: float = 60.0) -> list[str]:
    """Finish background removals now (at most ``budget_s``); returns what could not be removed."""
    return _REAPER.drain(budget_s)


@atexit.register
def _at_exit() -> None:
    left = finish_pending(60.0)
    if left:
        log.warning("sandbox cleanup: could not remove %s", ", ".join(left))
