"""Whether the wheels carried to the GPU machine (benchmarks/gpu_wheels.sh) are complete.

    python benchmarks/wheel_closure.py --site /tmp/site     # after `pip install --no-index --no-deps --target`

``--no-deps`` installs each wheel alone, so a dependency that neither the machine nor ``.whl/`` has shows up only
when its importer runs (dash without narwhals: ``ModuleNotFoundError`` in the dashboard's step, not at install).
This reads every distribution installed in ``--site`` and prints the requirements (markers evaluated for the
running interpreter, extras left out) that nothing on ``sys.path`` (the site folder first, then the interpreter's
own packages: the machine's) satisfies, name and version both; exit status 1 when there is one.

:func:`closure` serves ``tests/test_gpu_wheels.py``: the dependencies a set of names pulls in, read from the
installed metadata of the running interpreter.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import sys
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(dist: md.Distribution) -> list[Requirement]:
    """The distribution's unconditional requirements for this interpreter (no extras)."""
    out = []
    for line in dist.requires or ():
        try:
            r = Requirement(line)
        except InvalidRequirement:
            continue
        if r.marker is not None and not r.marker.evaluate({"extra": ""}):
            continue
        out.append(r)
    return out


def closure(names: list[str], path: list[str] | None = None) -> set[str]:
    """The normalised names of ``names`` and everything they require, transitively, as installed on ``path``
    (default sys.path). A requirement that is not installed is still listed (its own requirements unknown)."""
    seen: set[str] = set()
    todo = [norm(n) for n in names]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        try:
            dist = next(iter(md.distributions(name=n, path=path if path is not None else sys.path)))
        except StopIteration:
            continue
        todo += [norm(r.name) for r in requirements(dist)]
    return seen


def unmet(site: Path) -> list[str]:
    """A line per requirement of a distribution in ``site`` that nothing on [site] + sys.path satisfies."""
    path = [str(site)] + [p for p in sys.path if Path(p or ".").resolve() != site.resolve()]
    lines = []
    for dist in sorted(md.distributions(path=[str(site)]), key=lambda d: norm(d.metadata["Name"])):
        for r in requirements(dist):
            found = next(iter(md.distributions(name=norm(r.name), path=path)), None)
            if found is None:
                lines.append(f"{dist.metadata['Name']} {dist.version} requires {r}: not installed")
                continue
            try:
                ok = not r.specifier or r.specifier.contains(found.version, prereleases=True)
            except InvalidVersion:
                ok = True
            if not ok:
                lines.append(f"{dist.metadata['Name']} {dist.version} requires {r}: {found.version} installed")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--site", type=Path, required=True, help="the --target folder the wheels were installed into")
    a = ap.parse_args()
    n = len(list(md.distributions(path=[str(a.site)])))
    lines = unmet(a.site)
    print("\n".join(lines) if lines else f"wheel-closure: the {n} distributions in {a.site} have every requirement")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
