"""Write constraints.txt: the exact installed version of every package masrl's install pulls.

    python .ci/freeze_constraints.py          # rewrite constraints.txt from this environment
    python .ci/freeze_constraints.py --check  # exit 1 when an installed version differs from constraints.txt

The set is the dependency closure of masrl's core requirements and the extras in EXTRAS, as
installed here (`pip freeze` filtered to what masrl pulls). Local version labels are dropped
(torch 2.13.0+cpu -> torch==2.13.0; pip then takes the CPU or CUDA build the index offers).
Use: pip install -c constraints.txt torch==2.13.0 -e ".[test]"
"""
from __future__ import annotations

import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "constraints.txt"
# not vllm/bench/embed (GPU, heavy) nor trackio (trackio 0.43 wants pillow<13; the figures used pillow 13)
EXTRAS = ("test", "server", "smollm", "hf", "wandb", "mlflow", "ray")


def _wanted(req: Requirement, extras: set[str]) -> bool:
    return req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras | {""})


def closure() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    queue = [Requirement(r) for r in project["dependencies"]]
    queue += [Requirement(r) for e in EXTRAS for r in project["optional-dependencies"].get(e, [])]
    pins: dict[str, str] = {}
    seen: set[tuple[str, frozenset]] = set()
    while queue:
        req = queue.pop()
        key = (canonicalize_name(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            continue  # an optional dependency not installed here (a platform marker, an extra of an extra)
        pins[key[0]] = dist.version.split("+")[0]
        for text in dist.requires or []:
            sub = Requirement(text)
            if _wanted(sub, set(req.extras)):
                queue.append(sub)
    return dict(sorted(pins.items()))


def render(pins: dict[str, str]) -> str:
    head = ("# Exact versions the published figures were measured with (python .ci/freeze_constraints.py).\n"
            "# pip install -c constraints.txt torch==2.13.0 -e \".[test]\"\n")
    return head + "".join(f"{name}=={version}\n" for name, version in pins.items())


def main() -> int:
    text = render(closure())
    if "--check" in sys.argv:
        if OUT.read_text() != text:
            print(f"{OUT} differs from the installed versions: python .ci/freeze_constraints.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"{OUT}: {text.count(chr(10)) - 2} packages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
