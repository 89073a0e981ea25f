"""Code tasks: MBPP / HumanEval loaders, code extraction, sandboxed execution and the code reward.

See docs/sandbox.md for the threat model and how pass/fail is decided outside the sandbox.
"""
from masrl.tasks.code.sandbox import (Isolation, Limits, Sandbox, SandboxError, SandboxResult, default_sandbox,
                                      run_python, sandbox_capabilities)
from masrl.tasks.code.data import load_humaneval, load_mbpp
from masrl.tasks.code.extract import extract_code
from masrl.tasks.code.scoring import make_code_score, score_code, score_many
from masrl.tasks.rows import MalformedRowWarning

__all__ = ["Isolation", "Limits", "Sandbox", "SandboxError", "SandboxResult", "default_sandbox", "run_python",
           "sandbox_capabilities", "MalformedRowWarning", "load_humaneval", "load_mbpp", "extract_code",
           "make_code_score", "score_code", "score_many"]
