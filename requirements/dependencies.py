"""Print the requirements of this project's extras, one per line, without the project itself
(`python requirements/dependencies.py PYPROJECT EXTRAS`, EXTRAS comma-separated): what
requirements/install.sh installs with DEPS_ONLY=1, the images' dependency layer, which then survives
a change to the sources."""

from __future__ import annotations

import re
import sys
import tomllib


def dependencies(project: dict, extras: list[str]) -> list[str]:
    name = project["name"]
    optional = project.get("optional-dependencies", {})
    wanted, seen, out = list(extras), set(), list(project.get("dependencies", []))
    while wanted:
        extra = wanted.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for requirement in optional[extra]:
            own = re.fullmatch(rf"{re.escape(name)}\[([^\]]+)\]", requirement.replace(" ", ""))
            if own:  # the project's own extra, named as a requirement ("rlhf-operator[tracking]")
                wanted += own.group(1).split(",")
            else:
                out.append(requirement)
    return list(dict.fromkeys(out))


if __name__ == "__main__":
    with open(sys.argv[1], "rb") as f:
        print("\n".join(dependencies(tomllib.load(f)["project"], sys.argv[2].split(","))))
