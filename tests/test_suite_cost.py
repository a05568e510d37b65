"""benchmarks/suite_cost.py: its summary of known rows, and its plugin on a pytest run of its own."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("suite_cost", REPO / "benchmarks" / "suite_cost.py")
suite_cost = importlib.util.module_from_spec(_spec)  # (from its file: benchmarks/ stays off the suite's path)
_spec.loader.exec_module(suite_cost)

ROWS = [{"test": "tests/test_a.py::test_x", "wall_s": 0.1, "busy_core_s": 0.1, "subprocesses": 0, "long": False},
        {"test": "tests/test_a.py::test_y", "wall_s": 12.0, "busy_core_s": 20.0, "subprocesses": 2, "long": True},
        {"test": "tests/test_b.py::test_z", "wall_s": 3.9, "busy_core_s": 4.0, "subprocesses": 1, "long": False}]


def test_summary_of_known_rows():
    out = suite_cost.summary(ROWS, top=2).splitlines()
    assert out[0].split()[1:] == ["3", "tests", "16.0", "s", "wall", "24.1", "core-s", "busy", "(", "75%", "of", "2",
                                  "cores)"]
    assert "make test (not long)" in out[1] and " 2 tests" in out[1] and "4.0 s wall" in out[1]
    assert "make test-long (long)" in out[2] and "12.0 s wall" in out[2] and "( 83% of 2 cores)" in out[2]
    files = out[out.index("the 2 files of most wall time:") + 1:][:2]
    assert files[0].split()[0] == "tests/test_a.py" and "12.1 s wall" in files[0]
    tests = out[-2:]
    assert tests[0].split()[:5] == ["12.0", "s", "20.0", "core-s", "long"] and tests[0].endswith("test_a.py::test_y")
    assert tests[1].endswith("tests/test_b.py::test_z")


def test_plugin_writes_a_line_per_test_with_its_tier(tmp_path):
    (tmp_path / "test_two.py").write_text(
        "import subprocess, sys, pytest\n"
        "def test_plain():\n    pass\n"
        "@pytest.mark.long\n"
        "def test_starts_one():\n    subprocess.run([sys.executable, '-c', 'pass'], check=True)\n")
    out = tmp_path / "cost.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO / "benchmarks"), "SUITE_COST_OUT": str(out)}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "suite_cost", "-p", "no:cacheprovider",
                        "-W", "ignore::pytest.PytestUnknownMarkWarning", str(tmp_path / "test_two.py")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = {x["test"].split("::")[1]: x for x in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"test_plain", "test_starts_one"}
    assert (rows["test_plain"]["long"], rows["test_starts_one"]["long"]) == (False, True)
    assert (rows["test_plain"]["subprocesses"], rows["test_starts_one"]["subprocesses"]) == (0, 1)
    assert rows["test_starts_one"]["wall_s"] > 0 and rows["test_starts_one"]["busy_core_s"] >= 0
    assert suite_cost.main([str(tmp_path / "missing.jsonl")]) == 2
