"""Code tasks: MBPP / HumanEval loaders, code extraction and the code reward (programs run in
``masrl.sandbox``).

See docs/sandbox.md for the threat model and how pass/fail is decided outside the sandbox.
"""
import warnings

from masrl.io.rows import MalformedRowWarning
from masrl.tasks.code.data import load_humaneval, load_mbpp
from masrl.tasks.code.extract import extract_code
from masrl.tasks.code.scoring import make_code_score, score_code, score_many

__all__ = ["MalformedRowWarning", "load_humaneval", "load_mbpp", "extract_code", "make_code_score", "score_code",
           "score_many"]

_MOVED = ("Isolation", "Limits", "Sandbox", "SandboxError", "SandboxResult", "default_sandbox", "run_python",
          "sandbox_capabilities")


def __getattr__(name: str):
    """The sandbox names this package re-exported before the sandbox moved: they still resolve, with a
    ``DeprecationWarning``, for one release."""
    if name in _MOVED:
        import masrl.sandbox

        warnings.warn(f"masrl.tasks.code.{name} is deprecated: import it from masrl.sandbox (this path goes "
                      f"away in the next release)", DeprecationWarning, stacklevel=2)
        return getattr(masrl.sandbox, name)
    raise AttributeError(f"module 'masrl.tasks.code' has no attribute {name!r}")
