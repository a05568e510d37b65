"""The run directory's layout: the one module that knows which file is where. Everyone else asks it.

::

    manifest.json                                  the run manifest (format, version, run id, world size)
    rank{R}.records.jsonl                          one append-only record stream per rank
    profiler/rank{R}.{first_step}.pt.trace.json.gz Kineto traces of the profiled windows (TensorBoard layout)
    tb/rank{R}/events.out.tfevents.*               TensorBoard scalars (``fsdp-doctor tensorboard`` / the demo)
    report.json                                    the demo's saved report

This module imports nothing from the rest of the package (the record schema imports it).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Optional

MANIFEST_NAME = "manifest.json"
PROFILER_DIR = "profiler"
TB_DIR = "tb"
REPORT_NAME = "report.json"
STREAM_GLOB = "rank*.records.jsonl"
# JSON files of a run directory that are not Kineto traces.
NON_TRACE_NAMES = frozenset({MANIFEST_NAME, REPORT_NAME})

_STREAM_RE = re.compile(r"^rank(\d+)\.records\.jsonl$")
_TRACE_RANK_RE = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)


def stream_name(rank: int) -> str:
    return f"rank{rank}.records.jsonl"


def stream_rank(name: str) -> Optional[int]:
    """The rank of a record stream's file name, None for any other file."""
    m = _STREAM_RE.match(name)
    return int(m.group(1)) if m else None


def streams(run_dir: Path | str) -> dict[int, Path]:
    """The record streams in a run directory, by rank."""
    p = Path(run_dir)
    if not p.is_dir():
        return {}
    out = {}
    for q in sorted(p.iterdir()):
        r = stream_rank(q.name)
        if r is not None:
            out[r] = q
    return out


def manifest_path(run_dir: Path | str) -> Path:
    return Path(run_dir) / MANIFEST_NAME


def profiler_dir(run_dir: Path | str) -> Path:
    return Path(run_dir) / PROFILER_DIR


def profiler_trace_name(rank: int, first_step: int) -> str:
    """A profiled window's trace, relative to the run directory (torch-tb-profiler's worker.span layout)."""
    return f"{PROFILER_DIR}/rank{rank}.{first_step}.pt.trace.json.gz"


def trace_rank(path: Path | str) -> Optional[int]:
    """The rank a trace file's name says (``rank3.12.pt.trace.json.gz``, ``host_rank-3...``), or None."""
    m = _TRACE_RANK_RE.search(Path(path).name)
    return int(m.group(1)) if m else None


def tb_dir(run_dir: Path | str, rank: int) -> Path:
    return Path(run_dir) / TB_DIR / f"rank{rank}"


def report_path(run_dir: Path | str) -> Path:
    return Path(run_dir) / REPORT_NAME


def is_trace_name(path: Path) -> bool:
    """A file name that can hold a Kineto trace (``*.json``, ``*.json.gz``), known run files excluded."""
    n = path.name
    if n in NON_TRACE_NAMES or n.endswith(".jsonl") or n.endswith(".tmp"):
        return False
    return n.endswith(".json") or n.endswith(".json.gz")


def has_run(run_dir: Path | str) -> bool:
    """True when ``run_dir`` already holds a run's records (a manifest or a record stream)."""
    p = Path(run_dir)
    return p.is_dir() and (manifest_path(p).exists() or bool(streams(p)))


def clear_run(run_dir: Path | str) -> list[Path]:
    """Removes a previous run's files from ``run_dir`` (manifest, record streams, profiler traces, TensorBoard
    scalars, saved report), nothing else. Returns what was removed."""
    p = Path(run_dir)
    gone: list[Path] = []
    for q in [manifest_path(p), report_path(p), *streams(p).values()]:
        if q.is_file():
            q.unlink()
            gone.append(q)
    for d in (profiler_dir(p), p / TB_DIR):
        if d.is_dir() and not d.is_symlink():
            shutil.rmtree(d)
            gone.append(d)
    return gone


def new_run_id() -> str:
    """A fresh run id: 12 random hex digits."""
    return os.urandom(6).hex()
