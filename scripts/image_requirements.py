"""The image's Python packages: the project's dependencies as pip resolves them, less the packages that
pyproject.toml's `[tool.loraplex.image] leave-out` names and whatever only they pull in.

Run by the Dockerfile's build stage with the image's venv Python (`packaging` installed):
  image_requirements.py requirements PYPROJECT        the project's dependencies, one a line
  image_requirements.py pins PYPROJECT REPORT         `name==version` for each package of a
                                                      `pip install --dry-run --report REPORT` that the
                                                      image keeps (left out: `# left-out NAME` lines)
  image_requirements.py check PINS                    `pip check`, failing on anything but a
                                                      requirement on a package PINS leaves out
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

LEFT_OUT = "# left-out "


def _pyproject(path: str) -> dict:
    return tomllib.loads(Path(path).read_text())


def requirements(pyproject: str) -> list[str]:
    return list(_pyproject(pyproject)["project"]["dependencies"])


def pins(pyproject: str, report: str) -> list[str]:
    """Every package pip would install that is reachable from a requested one without passing through
    a left-out package, pinned to the version pip chose; the left-out ones as comments."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    leave_out = {canonicalize_name(n) for n in _pyproject(pyproject)["tool"]["loraplex"]["image"]["leave-out"]}
    items = {canonicalize_name(i["metadata"]["name"]): i for i in json.loads(Path(report).read_text())["install"]}
    keep: set[str] = set()
    todo = [name for name, item in items.items() if item.get("requested") and name not in leave_out]
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        keep.add(name)
        extras = items[name].get("requested_extras") or [""]
        for spec in items[name]["metadata"].get("requires_dist") or []:
            req = Requirement(spec)
            dep = canonicalize_name(req.name)
            wanted = req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras)
            if wanted and dep in items and dep not in leave_out:
                todo.append(dep)
    lines = [f"{items[n]['metadata']['name']}=={items[n]['metadata']['version']}" for n in sorted(keep)]
    return lines + [f"{LEFT_OUT}{n}" for n in sorted(set(items) - keep)]


def check(pins_file: str) -> int:
    """`pip check`; a requirement on a left-out package is what the image intends, anything else fails."""
    from packaging.utils import canonicalize_name

    left_out = {canonicalize_name(line[len(LEFT_OUT):]) for line in Path(pins_file).read_text().splitlines()
                if line.startswith(LEFT_OUT)}
    out = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True).stdout

    def intended(line: str) -> bool:  # "xgrammar 0.2.9 requires triton, which is not installed."
        missing = line.split(" requires ")[-1].split(",")[0]
        return line.endswith(" which is not installed.") and canonicalize_name(missing) in left_out

    problems = [line for line in out.splitlines() if line.strip() and not intended(line)]
    print(out, end="")
    if problems:
        print("broken requirements beyond the packages the image leaves out:", *problems, sep="\n", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str]) -> int:
    command, *args = argv
    if command == "requirements":
        print(*requirements(*args), sep="\n")
    elif command == "pins":
        print(*pins(*args), sep="\n")
    elif command == "check":
        return check(*args)
    else:
        raise SystemExit(f"unknown command {command!r}: requirements, pins or check")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
