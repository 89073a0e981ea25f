"""Versions of masrl and the libraries that decide a run's numbers, recorded in every run folder
(``versions.json``, ``report.json``, a comment atop ``config.yaml``): a figure can be reproduced
only with the library versions it was measured with (``constraints.txt``)."""
from __future__ import annotations

import platform
import subprocess
from importlib import metadata

from masrl.paths import REPO_ROOT

KEY_LIBRARIES = ("torch", "transformers", "peft", "numpy", "safetensors", "accelerate", "math-verify", "vllm", "ray")


def git_sha() -> str | None:
    """The commit of the masrl checkout (``+dirty`` with uncommitted changes), or None outside a git checkout."""
    if not (REPO_ROOT / ".git").exists():
        return None
    try:
        sha = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (sha + ("+dirty" if dirty else "")) if sha else None


def library_versions() -> dict[str, str | None]:
    """``{"masrl", "masrl_git", "python", <library>: version}`` for the installed key libraries."""
    from masrl import __version__

    out: dict[str, str | None] = {"masrl": __version__, "masrl_git": git_sha(), "python": platform.python_version()}
    for name in KEY_LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    try:
        import torch

        out["torch_cuda"] = torch.version.cuda
    except ImportError:
        pass
    return out


def versions_comment(versions: dict) -> str:
    """One YAML comment line naming the versions (the top of a run's config.yaml)."""
    return "# " + ", ".join(f"{k} {v}" for k, v in versions.items() if v is not None) + "\n"
