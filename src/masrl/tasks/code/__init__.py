"""Code tasks: MBPP / HumanEval loaders and the code reward (``masrl.codecheck``: programs run in
``masrl.sandbox``, checked against the hidden tests outside it).

See docs/sandbox.md for the threat model and how pass/fail is decided outside the sandbox.
"""
import warnings

from masrl.codecheck.extract import extract_code
from masrl.codecheck.scoring import make_code_score, score_code, score_many
from masrl.io.rows import MalformedRowWarning
from masrl.tasks.code.data import load_humaneval, load_mbpp

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
