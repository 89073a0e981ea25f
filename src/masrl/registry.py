"""Registries by name: the one mechanism behind workflows, tasks, rewards, estimators and losses.

A ``Registry`` maps names to objects of one kind::

    LOSSES = Registry("loss", group="masrl.losses")

    @LOSSES.register("ppo")           # a decorator; returns the function unchanged
    def ppo_log_ratio(...): ...

    LOSSES.get("ppo")                 # the object; one ConfigError listing the known names otherwise
    LOSSES.names()                    # the names, in registration order

The five registries of masrl and their public decorators:

============  =====================================  ================================  ==================
kind          registry                               decorator                         entry-point group
============  =====================================  ================================  ==================
workflow      ``masrl.workflows.base.WORKFLOWS``     ``@register_workflow``            ``masrl.workflows``
task          ``masrl.tasks.registry.TASKS``         ``@register_task``                ``masrl.tasks``
reward        ``masrl.tasks.rewards.REWARDS``        ``@register_reward``              ``masrl.rewards``
estimator     ``masrl.algorithms.ADVANTAGE_...``     ``@register_advantage``           ``masrl.estimators``
loss          ``masrl.algorithms.LOSSES``            ``@register_loss``                ``masrl.losses``
============  =====================================  ================================  ==================

**Plugins.** An installed package registers its own names through an entry point of the kind's group
(``pyproject.toml``: ``[project.entry-points."masrl.tasks"] my_task = "my_pkg.tasks"``). The entry points
of a group are loaded once, on the first lookup of a name the registry does not hold (or the first
``names()``): an entry point that names a module is imported (its ``@register_*`` decorators run); one
that names a callable (``my_pkg:register``) is called with no arguments, unless importing its module
already registered the entry point's name. A plugin that fails to load is one ``PluginError``
naming its distribution.

Bottom layer: imports nothing from masrl but ``masrl.errors``.
"""
from __future__ import annotations

import difflib
import importlib.metadata
import inspect
import threading
from typing import Any, Callable, Generic, Iterator, TypeVar

from masrl.errors import ConfigError, UserInputError, quote

T = TypeVar("T")


class UnknownNameError(ConfigError):
    """A name no registry entry (built-in or plugin) has: the message lists the known names."""


class DuplicateNameError(ConfigError):
    """A name registered a second time (without ``overwrite=True``): the message says who holds it."""


class PluginError(UserInputError):
    """An installed plugin's entry point failed to load: the message names its distribution."""


def _origin(obj: Any) -> tuple[str, str] | None:
    """Where ``obj`` was defined (module, qualified name): the duplicate-name error says who holds a name."""
    obj = inspect.unwrap(obj) if callable(obj) else obj
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return (module, qualname) if module and qualname else None


class Registry(Generic[T]):
    """Objects of one ``kind`` by name (see the module docstring).

    ``group``: the entry-point group of plugins (``masrl.<kind>s``). ``hint``: appended to the
    unknown-name error (what else a config may give). ``preload``: called once before the first lookup
    (a registry whose built-ins are registered by importing modules). ``definition``: the function an
    entry was defined from (a workflow's spec holds its function), named by the duplicate-name error.
    """

    def __init__(self, kind: str, *, group: str | None = None, hint: str = "",
                 preload: Callable[[], None] | None = None, definition: Callable[[T], Any] | None = None):
        self.kind = kind
        self.group = group or f"masrl.{kind}s"
        self.hint = hint
        self._entries: dict[str, T] = {}
        self._preload = preload
        self._definition = definition or (lambda obj: obj)
        self._scanned = False
        self._loaded: set[tuple[str, str]] = set()  # (name, value) of the entry points loaded
        self._lock = threading.RLock()  # the entries
        self._load_lock = threading.RLock()  # the preload and the plugins (held while they load)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {len(self._entries)} names)"

    # ------------------------------------------------------------------ registering

    def register(self, name: str, obj: T | None = None, *, overwrite: bool = False) -> Any:
        """Register ``obj`` under ``name``; without ``obj``, a decorator that registers what it decorates
        and returns it unchanged. A name that is taken is a ``DuplicateNameError`` (even for the same
        object: a module imported twice under two names) unless ``overwrite``, which replaces it."""
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"a {self.kind} name must be a non-empty string, got {quote(name)}")
        if obj is None:
            def deco(fn: T) -> T:
                self.register(name, fn, overwrite=overwrite)
                return fn
            return deco
        with self._lock:
            old = self._entries.get(name)
            if old is not None and not overwrite:
                where = _origin(self._definition(old))
                by = f" (by {where[0]}.{where[1]})" if where else ""
                raise DuplicateNameError(f"{self.kind} {name!r} is already registered{by}; register it under "
                                         "another name, or pass overwrite=True to replace it")
            self._entries[name] = obj
        return obj

    def unregister(self, name: str) -> T:
        """Remove ``name`` and return its object (tests; a plugin replacing a name it owns)."""
        with self._lock:
            if name not in self._entries:
                raise self._unknown(name)
            return self._entries.pop(name)

    # ------------------------------------------------------------------ looking up

    def get(self, name: str) -> T:
        """The object registered under ``name``; an ``UnknownNameError`` listing the known names (and
        the closest one) otherwise. Plugins are loaded on the first miss."""
        self._ensure_preloaded()
        try:
            return self._entries[name]
        except (KeyError, TypeError):  # TypeError: an unhashable value from a config
            pass
        self.load_plugins()
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise self._unknown(name) from None

    def names(self) -> list[str]:
        """Every registered name (built-ins and installed plugins), in registration order."""
        self._ensure_preloaded()
        self.load_plugins()
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        try:
            self.get(name)  # type: ignore[arg-type]
        except UnknownNameError:
            return False
        return True

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def keys(self) -> list[str]:
        return self.names()

    def values(self) -> list[T]:
        return [self._entries[n] for n in self.names()]

    def items(self) -> list[tuple[str, T]]:
        return [(n, self._entries[n]) for n in self.names()]

    def pop(self, name: str, *default: Any) -> Any:
        """Like ``dict.pop`` (tests remove what they registered)."""
        with self._lock:
            if name in self._entries or not default:
                return self.unregister(name)
            return default[0]

    def _unknown(self, name: Any) -> UnknownNameError:
        known = sorted(self._entries)
        close = difflib.get_close_matches(str(name), known, n=1) if isinstance(name, str) else []
        guess = f"; did you mean {close[0]!r}?" if close else ""
        listed = ", ".join(known) or "none registered"
        hint = f" {self.hint}" if self.hint else ""
        return UnknownNameError(f"unknown {self.kind} {quote(name)}; known: {listed}{hint}{guess}")

    # ------------------------------------------------------------------ plugins

    def _ensure_preloaded(self) -> None:
        if self._preload is None:
            return
        with self._load_lock:  # another thread's lookup waits until the built-ins are in
            preload, self._preload = self._preload, None  # a lookup from within the preload goes on
            if preload is not None:
                preload()

    def load_plugins(self) -> None:
        """Load the entry points of ``group`` (once per process: later calls do nothing, except after a
        plugin failed to load, when the ones not loaded yet are tried again)."""
        if self._scanned:
            return
        with self._load_lock:  # another thread's lookup waits until the plugins are in
            if self._scanned:
                return
            self._scanned = True  # a lookup from within a plugin's import goes on
            try:
                for ep in importlib.metadata.entry_points(group=self.group):
                    if (ep.name, ep.value) not in self._loaded:
                        self._load_entry_point(ep)
                        self._loaded.add((ep.name, ep.value))
            except BaseException:
                self._scanned = False
                raise

    def _load_entry_point(self, ep: importlib.metadata.EntryPoint) -> None:
        dist = getattr(ep, "dist", None)
        who = f"distribution {dist.name} {dist.version}" if dist is not None else "an unknown distribution"
        what = f"masrl plugin {ep.name!r} ({who}; entry point {ep.name} = {ep.value} in group {self.group})"
        try:
            obj = ep.load()
            if not inspect.ismodule(obj) and ep.name not in self._entries:
                if not callable(obj):
                    raise TypeError(f"{ep.value} is a {type(obj).__name__}, not a module or a callable")
                obj()
        except BaseException as e:  # noqa: BLE001 - any failure of the plugin's code: one line naming it
            if isinstance(e, KeyboardInterrupt):
                raise
            detail = " ".join(f"{type(e).__name__}: {e}".split())[:500]
            fix = f"fix it or uninstall it (pip uninstall {dist.name})" if dist is not None else "fix or remove it"
            raise PluginError(f"{what} failed to load: {detail}; {fix}") from e
