"""User code a config names by ``pkg.module:attr`` or ``path/to/file.py:attr`` (rewards, workflows, entries),
imported with one clear ``ConfigError`` line when it cannot be; a ``.py`` file is imported
once per process (the config check, then the run)."""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from masrl.errors import ConfigError, extra_hint

_FILE_MODULES: dict[Path, Any] = {}  # user files imported once per process (the config check, then the run)


def import_object(spec: str, what: str) -> Any:
    """``pkg.module:attr`` or ``path/to/file.py:attr``; one clear ConfigError naming ``what`` otherwise."""
    mod_name, sep, attr = spec.rpartition(":")
    if not sep or not mod_name or not attr:
        raise ConfigError(f"{what} {spec!r} is not of the form 'pkg.module:function' or 'file.py:function'")
    if mod_name.endswith(".py"):
        module = _import_file(Path(mod_name).expanduser().resolve(), spec, what)
    else:
        try:
            module = importlib.import_module(mod_name)
        except ImportError as e:
            hint = extra_hint(e) or "is it installed or on PYTHONPATH?"
            raise ConfigError(f"{what} {spec!r}: cannot import module {mod_name!r} ({e}); {hint}") from e
        except BaseException as e:  # noqa: BLE001 - the module fails (or exits) when imported: say which and why
            raise ConfigError(f"{what} {spec!r}: importing module {mod_name!r} failed ({import_failure(e)})") from None
    obj = getattr(module, attr, None)
    if obj is None:
        raise ConfigError(f"{what} {spec!r}: module {mod_name!r} has no attribute {attr!r}")
    return obj


def _import_file(path: Path, spec: str, what: str):
    """A user's ``.py`` file as a module, imported once per process (the config check, then the run)."""
    if path in _FILE_MODULES:
        return _FILE_MODULES[path]
    if not path.is_file():
        raise ConfigError(f"{what} {spec!r}: file {path} does not exist (relative paths start at the current "
                          f"folder, {Path.cwd()})")
    loader_spec = importlib.util.spec_from_file_location(f"masrl_user_{path.stem}", path)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[module.__name__] = module  # importable by its name (verifiers resolves a taskset's id so)
    try:
        loader_spec.loader.exec_module(module)
    except BaseException as e:  # noqa: BLE001 - the user's file fails (or exits) when imported: say which and why
        sys.modules.pop(module.__name__, None)
        raise ConfigError(f"{what} {spec!r}: importing {path} failed ({import_failure(e)})") from None
    _FILE_MODULES[path] = module
    return module


def import_failure(error: BaseException) -> str:
    """One line for an exception raised while importing user code (``SystemExit(0)``: ``sys.exit(0)``)."""
    if isinstance(error, SystemExit):
        return f"it called sys.exit({error.code!r}) on import; a module a config names must not exit"
    if isinstance(error, KeyboardInterrupt):
        return "interrupted (KeyboardInterrupt) while importing"
    hint = extra_hint(error)
    return " ".join(f"{type(error).__name__}: {error}".split())[:500] + (f"; {hint}" if hint else "")
