"""Where masrl finds benchmark data and keeps its caches."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from masrl.errors import UserInputError

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
    check_output_dir(path, "$MASRL_CACHE_DIR" if env else "cache folder")
    path.mkdir(parents=True, exist_ok=True)
    return path


def sha256_file(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes, read in 1 MiB blocks (hex)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_output_dir(path: str | os.PathLike, what: str = "output folder") -> Path:
    """``path`` can be (or become) a writable folder that masrl writes into; creates nothing.

    Every command that writes a folder the user chose calls this before any work (docs/reliability.md):
    - a symlink on the path whose target does not exist (dangling) is refused: ``mkdir`` and ``open``
      would follow it and write wherever it points;
    - ``path`` itself being a symlink is allowed only when it leads to an existing folder (the user points
      at a real folder); a symlink to a file is refused;
    - ``path`` or one of its parents being a file is refused; the nearest existing folder must be writable.
    - the path must be usable at all (``check_path_name``: no control characters, no component longer than
      the filesystem's NAME_MAX, the whole within PATH_MAX less room for what masrl writes inside).
    Each refusal is one ``UserInputError`` naming ``what``, the path and the part at fault.
    """
    path = Path(path)
    check_path_name(path, what)
    probe = _check_no_dangling(path, what)
    if probe != path and not probe.is_dir():
        raise UserInputError(f"{what} {path}: {probe} is a file, not a folder; choose another path")
    if probe == path and path.exists() and not path.is_dir():
        kind = f"a symlink to the file {os.path.realpath(path)}" if path.is_symlink() else "a file"
        raise UserInputError(f"{what} {path} is {kind}, not a folder; choose a folder path")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UserInputError(f"{what} {path}: {probe} is not writable; choose a folder you can write to")
    return path


def check_output_file(path: str | os.PathLike, what: str = "output file") -> Path:
    """``path`` can become a file masrl writes: its folder passes ``check_output_dir``; ``path`` is not a
    folder and not a symlink (masrl replaces the files it writes, so a symlink would not lead where it
    points). Creates nothing; one ``UserInputError`` naming ``what``."""
    path = Path(path)
    if path.is_symlink():
        raise UserInputError(f"{what} {path} is a symlink (to {os.readlink(path)}); give the real file path")
    if path.is_dir():
        raise UserInputError(f"{what} {path} is a folder; give a file name, e.g. {path / 'out.jsonl'}")
    check_output_dir(path.parent, what)
    return path


ROOM_INSIDE = 256  # bytes of path masrl may add inside a folder it writes (checkpoints/.step_N.tmp-PID/policies/...)


def _limits(path: Path) -> tuple[int, int]:
    """(NAME_MAX, PATH_MAX) of the filesystem that holds ``path``'s nearest existing folder (255, 4096 if unknown)."""
    probe = Path(os.path.abspath(path))
    while not os.path.isdir(probe) and probe != probe.parent:
        probe = probe.parent
    try:
        return os.pathconf(probe, "PC_NAME_MAX"), os.pathconf(probe, "PC_PATH_MAX")
    except (OSError, ValueError):
        return 255, 4096


def check_path_name(path: str | os.PathLike, what: str, room: int = ROOM_INSIDE) -> Path:
    """``path`` (derived from what the user set: a run name, an output folder) can exist on this filesystem: no
    NUL or other control character, no component longer than NAME_MAX bytes, the absolute path with ``room``
    bytes to spare within PATH_MAX. One ``UserInputError`` naming ``what``, the part at fault and the limit;
    creates nothing. (Otherwise ``mkdir`` fails deep inside a run with ``OSError: [Errno 36]``.)"""
    path = Path(path)
    text = os.fspath(path)
    bad = next((c for c in text if ord(c) < 32 or ord(c) == 127), None)
    if bad is not None:
        raise UserInputError(f"{what} {text[:80]!r}: a path may not hold the control character {bad!r}; "
                             "choose a name of printable characters")
    name_max, path_max = _limits(path)
    for part in path.parts:
        size = len(os.fsencode(part))
        if size > name_max:
            raise UserInputError(f"{what} {text[:60]}...: the path component {part[:40]}... is {size} bytes; this "
                                 f"filesystem allows {name_max} per name: choose a shorter name (the run name and "
                                 "output_dir make the run folder's name)")
    size = len(os.fsencode(os.path.abspath(text)))
    if size + room > path_max:
        raise UserInputError(f"{what} {text[:60]}...: the path is {size} bytes; with the {room} bytes masrl writes "
                             f"inside it, it passes this filesystem's limit of {path_max}: choose a shorter path")
    return path


def _check_no_dangling(path: Path, what: str) -> Path:
    """The nearest existing ancestor of ``path`` (``path`` itself when it exists), after refusing a dangling
    symlink or an unusable name anywhere on the way."""
    parts = [path, *path.parents]
    for probe in reversed(parts):  # from the root down: a dangling link high up is named, not its children
        try:
            if probe.is_symlink() and not probe.exists():
                raise UserInputError(f"{what} {path}: {probe} is a symlink to {os.readlink(probe)}, which does "
                                     "not exist; create its target or choose another path")
        except OSError as e:  # a name too long (pathlib answers False for a missing part or a loop)
            raise UserInputError(f"{what} {path}: cannot use {probe} ({e.strerror or e})") from None
    for probe in parts:
        try:
            if probe.exists() or probe.is_symlink():
                return probe
        except OSError as e:
            raise UserInputError(f"{what} {path}: cannot use {probe} ({e.strerror or e})") from None
    return Path(".")


def __getattr__(name: str):
    """``write_text_atomic`` moved to ``masrl.io.atomic``: it still resolves here, with a
    ``DeprecationWarning``, for one release."""
    if name == "write_text_atomic":
        import warnings

        from masrl.io.atomic import write_text_atomic

        warnings.warn("masrl.paths.write_text_atomic is deprecated: import it from masrl.io.atomic (this path "
                      "goes away in the next release)", DeprecationWarning, stacklevel=2)
        return write_text_atomic
    raise AttributeError(f"module 'masrl.paths' has no attribute {name!r}")
