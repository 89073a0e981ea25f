"""Imports every workflow module of this package so that their @register_workflow runs."""
import importlib
import pkgutil

import masrl.workflows as _pkg

_NOT_WORKFLOWS = {"base", "builtin", "common", "parsing", "testing"}

for _info in pkgutil.iter_modules(_pkg.__path__):
    if _info.name not in _NOT_WORKFLOWS:
        importlib.import_module(f"masrl.workflows.{_info.name}")

# the external workflow checks its params (entry or command, timeout_s, port) per episode; the same check runs at
# start (masrl train, masrl config show), before any model is built
_external = importlib.import_module("masrl.workflows.external")
_pkg.WORKFLOWS.get("external").check = _external._params
