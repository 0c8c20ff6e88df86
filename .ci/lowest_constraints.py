"""Pin every direct dependency of the extras given to the lower bound pyproject.toml declares.

CI installs the README's command once more under these constraints, so each lower bound is a
version that really installs and passes the tests. torch stays at the README's pin: its bound is
documented as the tested version instead (PyPI has no older CPU-only build to test against).
Usage: python .ci/lowest_constraints.py EXTRA [EXTRA ...] > constraints.txt
"""

import re
import sys
from pathlib import Path

import tomllib

PROJECT = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*(?:\[([^\]]*)\])?\s*(.*)$")


def requirements(extras: list[str], seen: set[str]) -> list[str]:
    """The direct requirements of the base package and ``extras``, self-references expanded."""
    out = list(PROJECT["dependencies"]) if not seen else []
    for extra in extras:
        if extra in seen:
            continue
        seen.add(extra)
        for req in PROJECT["optional-dependencies"][extra]:
            name, inner, _ = REQUIREMENT.match(req).groups()
            if name == PROJECT["name"]:
                out += requirements([e.strip() for e in (inner or "").split(",")], seen)
            else:
                out.append(req)
    return out


def main(extras: list[str]) -> None:
    pins = {}
    for req in requirements(extras, set()):
        name, _, spec = REQUIREMENT.match(req).groups()
        lower = re.search(r">=\s*([0-9][0-9A-Za-z.]*)", spec)
        if lower and name != "torch":
            pins[name.lower()] = lower.group(1)
    for name, version in sorted(pins.items()):
        print(f"{name}=={version}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["dev"])
