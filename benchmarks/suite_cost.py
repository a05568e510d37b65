"""What the test suite costs, per test: wall time, the host's busy core-seconds (``/proc/stat``, every process: the
ranks a test forks included) and the subprocesses it started. Two uses:

    # a pytest plugin: one JSON line per test in SUITE_COST_OUT (default suite_cost.jsonl)
    PYTHONPATH=benchmarks .venv/bin/python -m pytest -q -p suite_cost [-m "not long"]
    # the summary of such a file: totals, the tiers (marker ``long``), the files and tests that cost most
    .venv/bin/python benchmarks/suite_cost.py suite_cost.jsonl

Busy time is the whole host's: run it with nothing else running. Linux only (``/proc/stat``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

_started = {"n": 0}


def _audit(event: str, args) -> None:
    if event == "subprocess.Popen":
        _started["n"] += 1


def _busy_s() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


# ------------------------------------------------------------------------------------------ the pytest plugin
_out = None


def pytest_configure(config):
    global _out
    sys.addaudithook(_audit)
    _out = open(os.environ.get("SUITE_COST_OUT", "suite_cost.jsonl"), "w")


def pytest_unconfigure(config):
    if _out is not None:
        _out.close()


try:
    import pytest

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        _started["n"] = 0
        t, b = time.perf_counter(), _busy_s()
        yield
        _out.write(json.dumps({"test": item.nodeid, "wall_s": round(time.perf_counter() - t, 3),
                               "busy_core_s": round(_busy_s() - b, 2), "subprocesses": _started["n"],
                               "long": item.get_closest_marker("long") is not None}) + "\n")
        _out.flush()
except ImportError:  # the summary needs no pytest
    pass


# ------------------------------------------------------------------------------------------------ the summary
def summary(rows: list[dict], top: int = 15) -> str:
    def line(label: str, rs: list[dict]) -> str:
        w, b = sum(r["wall_s"] for r in rs), sum(r["busy_core_s"] for r in rs)
        return (f"{label:<44} {len(rs):>5} tests {w:8.1f} s wall {b:8.1f} core-s busy "
                f"({100 * b / (2 * w) if w else 0:3.0f}% of 2 cores)")

    out = [line("all", rows), line("make test (not long)", [r for r in rows if not r["long"]]),
           line("make test-long (long)", [r for r in rows if r["long"]]), ""]
    for lo, hi in ((0, 0.2), (0.2, 1), (1, 5), (5, 10), (10, 30), (30, float("inf"))):
        out.append(line(f"tests of {lo:g}-{hi:g} s", [r for r in rows if lo <= r["wall_s"] < hi]))
    by: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by[r["test"].split("::")[0]].append(r)
    out += ["", f"the {top} files of most wall time:"]
    out += ["  " + line(f, rs) for f, rs in sorted(by.items(), key=lambda kv: -sum(r["wall_s"] for r in kv[1]))[:top]]
    out += ["", f"the {top} tests of most wall time (the first test to use a shared fixture pays for it):"]
    out += [f"  {r['wall_s']:7.1f} s {r['busy_core_s']:7.1f} core-s {'long ' if r['long'] else '     '}{r['test'][:100]}"
            for r in sorted(rows, key=lambda r: -r["wall_s"])[:top]]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", type=Path, help="the plugin's JSON lines")
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args(argv)
    try:
        rows = [json.loads(x) for x in a.file.read_text().splitlines() if x.strip()]
    except (OSError, ValueError) as e:
        print(f"suite_cost: {a.file}: {e}", file=sys.stderr)
        return 2
    print(summary(rows, a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
