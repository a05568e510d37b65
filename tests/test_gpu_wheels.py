"""The wheels carried to the GPU machine (benchmarks/gpu_wheels.sh) are the whole of what it lacks.

They are installed there with ``--no-deps``: a dependency neither the machine has nor ``.whl/`` carries fails
only when imported, mid-campaign (dash without narwhals did, in the Python 3.12 / torch 2.11 rehearsal)."""

from __future__ import annotations

import importlib.metadata as md
import re
import shlex
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import wheel_closure as W  # noqa: E402


def _shell_var(name: str) -> list[str]:
    text = (REPO / "benchmarks" / "gpu_wheels.sh").read_text()
    m = re.search(rf'^{name}="([^"]*)"', text, re.M)
    assert m, f"gpu_wheels.sh has no {name}=\"...\""
    return shlex.split(m.group(1))


def _bare(spec: str) -> str:
    return W.norm(re.split(r"[<>=!~ \[;]", spec, maxsplit=1)[0])


def test_the_wheels_hold_every_dependency_the_machine_lacks():
    """Read from this interpreter's installed metadata (its versions are the ones gpu_wheels.sh downloads):
    fsdp-doctor's dependencies and expecttest, with theirs, less what the machine's own packages pull in."""
    machine = [_bare(s) for s in _shell_var("MACHINE")]
    absent = [m for m in machine + ["expecttest"] if not list(md.distributions(name=m))]
    if absent:
        pytest.skip(f"not installed here, so their dependencies cannot be read: {', '.join(absent)}")
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+ (at module level it stopped the suite's collection on 3.10)
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    ours = W.closure([_bare(d) for d in deps if _bare(d) != "torch"] + ["expecttest"])
    needed = ours - W.closure(machine)
    carried = {_bare(p) for p in _shell_var("PKGS")}
    assert not needed - carried, f"gpu_wheels.sh's PKGS lacks {sorted(needed - carried)}"


def _dist(site: Path, name: str, version: str, requires: list[str]) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\n" + f"Name: {name}\nVersion: {version}\n"
                                   + "".join(f"Requires-Dist: {r}\n" for r in requires))


def test_unmet_names_a_missing_or_too_old_requirement(tmp_path):
    pv = md.version("packaging")
    _dist(tmp_path, "carried-a", "1.0", ["carried-b>=2", "packaging", 'not-there-xyz; python_version < "3"',
                                         "also-not-there-xyz[extra]"])
    _dist(tmp_path, "carried-b", "2.1", [f"packaging>{pv}", 'only-with-extra-xyz; extra == "x"'])
    assert W.unmet(tmp_path) == [
        "carried-a 1.0 requires also-not-there-xyz[extra]: not installed",
        f"carried-b 2.1 requires packaging>{pv}: {pv} installed",
    ]
    assert W.closure(["carried-a"], path=[str(tmp_path)]) == {"carried-a", "carried-b", "packaging",
                                                               "also-not-there-xyz"}


def test_the_rehearsal_finds_the_readme_device_command():
    """benchmarks/gpu_rehearsal.sh runs the README's device command itself, with --dry-run after its --budget-s N
    and its own folders for /tmp/site, /tmp/c and $OUT: the line it looks for is there, once, with those parts, its
    budget inside the device tool's 10 minutes a command with room for the install and the packing."""
    lines = [ln.strip() for ln in (REPO / "README.md").read_text().splitlines()
             if re.match(r"^ *python3 -m pip install .*--budget-s [0-9]+", ln)]
    assert len(lines) == 1, lines
    for part in ("--target /tmp/site .whl/*.whl", "PYTHONPATH=/tmp/site:$PWD", "--out /tmp/c --budget-s ",
                 "--out /tmp/c --pack $OUT"):
        assert part in lines[0], part
    assert int(re.search(r"--budget-s ([0-9]+)", lines[0])[1]) <= 540
    script = (REPO / "benchmarks" / "gpu_rehearsal.sh").read_text()
    assert r"--budget-s \\1 --dry-run" in script and "README.md" in script


def test_a_child_keeps_the_callers_pythonpath(tmp_path, monkeypatch):
    """On the GPU machine the dependencies are on PYTHONPATH (/tmp/site): a test's child process that set
    PYTHONPATH to the tree alone could not import msgspec (tests/test_bad_inputs.py did, in the rehearsal)."""
    import os
    import subprocess

    from conftest import child_pythonpath

    (tmp_path / "carried_sentinel_xyz.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    env = {**os.environ, "PYTHONPATH": child_pythonpath(REPO)}
    r = subprocess.run([sys.executable, "-c", "import fsdp_doctor, carried_sentinel_xyz"], env=env, cwd=tmp_path.parent,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO), str(tmp_path)]
