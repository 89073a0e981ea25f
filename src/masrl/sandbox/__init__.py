"""Run untrusted Python in a separate, locked-down process (Linux): the process sandbox.

    from masrl.sandbox import run_python, Sandbox
    run_python("print(1 + 1)", timeout_s=5).stdout      # "2\n"

A service below the tasks and tools (the code task's scorer and ``tools.python_tool`` use it); it
imports nothing above ``masrl.paths``. See docs/sandbox.md for the threat model.

- ``Sandbox``, ``run_python``, ``default_sandbox``, ``sandbox_capabilities``: run programs;
- ``Limits``, ``Isolation``, ``SandboxResult``, ``SandboxError``: the records;
- ``Proc``, ``Died``: one sandboxed process, for callers that talk to it while it runs
  (``mode="serve"``: framed requests and responses);
- ``encode_value``, ``decode_value``, ``CodecError``: the value codec both sides share.
"""
from masrl.sandbox._child import CodecError, decode_value, encode_value
from masrl.sandbox.base import STATUSES, Died, Isolation, Limits, SandboxError, SandboxResult
from masrl.sandbox.isolation import default_hide_paths
from masrl.sandbox.process import Proc
from masrl.sandbox.sandbox import Sandbox, default_sandbox, run_python, sandbox_capabilities

__all__ = ["Sandbox", "run_python", "default_sandbox", "sandbox_capabilities", "Limits", "Isolation",
           "SandboxResult", "SandboxError", "STATUSES", "Proc", "Died", "default_hide_paths",
           "CodecError", "decode_value", "encode_value"]
