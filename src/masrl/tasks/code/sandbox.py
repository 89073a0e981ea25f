"""Deprecated: the process sandbox moved to ``masrl.sandbox``. This path re-exports it for one
release and warns on import; import from ``masrl.sandbox`` instead."""
import warnings

from masrl.sandbox import (STATUSES, Died, Isolation, Limits, Proc, Sandbox, SandboxError, SandboxResult,
                           default_hide_paths, default_sandbox, run_python, sandbox_capabilities)

__all__ = ["SandboxResult", "Limits", "Isolation", "Sandbox", "SandboxError", "run_python", "sandbox_capabilities",
           "default_sandbox", "default_hide_paths", "STATUSES"]
_Proc, _Died = Proc, Died  # the private names the code scorer imported before the move

warnings.warn("masrl.tasks.code.sandbox is deprecated: import from masrl.sandbox (this path goes away in the "
              "next release)", DeprecationWarning, stacklevel=2)
