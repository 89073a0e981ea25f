"""Imports every workflow module of this package so that their @register_workflow runs."""
import importlib
import pkgutil

import masrl.workflows as _pkg

_NOT_WORKFLOWS = {"base", "builtin", "common", "parsing", "testing"}

for _info in pkgutil.iter_modules(_pkg.__path__):
    if _info.name not in _NOT_WORKFLOWS:
        importlib.import_module(f"masrl.workflows.{_info.name}")
