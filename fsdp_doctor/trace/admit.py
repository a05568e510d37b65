"""Which decoded windows may be analysed together: one job, one file per rank and window. Traces carry their
identity (``distributedInfo``: rank, world size, backend; ``baseTimeNanoseconds`` and the timestamps: when
each step ran), and a folder may hold more than one job or the same file twice. A window left out is named
with the reason, never summed with another or dropped without a word:

* a file with no rank (no ``distributedInfo.rank``, none in its name) among several: it cannot be told apart
  from the other ranks' files (one file alone is read as rank 0);
* another job: a world size or backend other than the other files' (the most files' wins; on a tie the first
  file's), or the same step run more than ``JOB_SKEW_S`` apart from the other ranks' same step;
* a rank claimed twice: two files of one rank whose steps (or, without steps, time spans) overlap; the first
  file (by name) is kept.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from ..report_sections import SkippedFile
from .model import WindowTrace

JOB_SKEW_S = 600.0  # the ranks of one job run a step within this of each other (clocks of one cluster)


def admit(windows: list[WindowTrace]) -> tuple[list[WindowTrace], list[SkippedFile]]:
    """``(kept, skipped)``: the windows that belong to one job, one per rank and window, in their order."""
    if len(windows) < 2:
        return list(windows), []
    names = _display_names(windows)
    skipped: dict[int, str] = {}
    order = sorted(range(len(windows)), key=lambda i: windows[i].file)

    for i in order:
        if not windows[i].rank_known:
            skipped[i] = ("no rank (no distributedInfo.rank, none in the file name): among several files it cannot "
                          "be told apart from the other ranks'; skipped")
    for attr, what in (("world_size", "world size"), ("backend", "backend")):
        vals = {i: getattr(windows[i], attr) for i in order if i not in skipped and getattr(windows[i], attr)}
        if len(set(vals.values())) > 1:
            counts = Counter(vals.values())
            top = max(counts.values())
            main = next(v for v in vals.values() if counts[v] == top)  # first file's among the most common
            for i, v in vals.items():
                if v != main:
                    skipped[i] = f"another job ({what} {v}; the other files' is {main}); skipped"

    # the same step on different ranks runs at the same time: far apart, it is another job's
    by_step: dict[int, list[int]] = {}
    for i in order:
        if i not in skipped:
            for n in windows[i].steps:
                by_step.setdefault(n, []).append(i)
    for n, idx in sorted(by_step.items()):
        idx = [i for i in idx if i not in skipped]
        if len(idx) < 2:
            continue
        starts = {i: _start_s(windows[i]) for i in idx}
        known = {i: t for i, t in starts.items() if t is not None}
        if len(known) < 2:
            continue
        ts = sorted(known.values())
        mid = ts[(len(ts) - 1) // 2]
        for i, t in known.items():
            if abs(t - mid) > JOB_SKEW_S:
                skipped[i] = (f"another job (its step {n} ran {abs(t - mid) / 3600:.1f} h from the other files' "
                              f"step {n}); skipped")

    # one file per rank and window
    kept_by_rank: dict[int, list[int]] = {}
    for i in order:
        if i in skipped:
            continue
        w = windows[i]
        for j in kept_by_rank.get(w.rank, []):
            if _overlap(windows[j], w):
                shared = sorted(set(windows[j].steps) & set(w.steps))
                what = f"step {_steps(shared)}" if shared else "the same time span"
                skipped[i] = (f"rank {w.rank} again ({what} also in {names[j]}): two files of one rank are never "
                              "summed; skipped")
                break
        else:
            kept_by_rank.setdefault(w.rank, []).append(i)

    kept = [w for i, w in enumerate(windows) if i not in skipped]
    return kept, [SkippedFile(file=names[i], error=skipped[i]) for i in order if i in skipped]


def _start_s(w: WindowTrace):
    # (the host's start: a window that follows a device running behind it starts later)
    t = w.window[0] - w.device_lag_us if w.window is not None else (w.span[0] if w.span[1] > w.span[0] else None)
    return None if t is None else (t + w.clock_us) / 1e6


def _overlap(a: WindowTrace, b: WindowTrace) -> bool:
    if a.steps and b.steps:
        return bool(set(a.steps) & set(b.steps))
    sa, sb = _start_s(a), _start_s(b)
    if sa is None or sb is None:
        return True  # nothing tells them apart
    ea = sa + (a.span[1] - a.span[0]) / 1e6
    eb = sb + (b.span[1] - b.span[0]) / 1e6
    return sa <= eb and sb <= ea


def _steps(steps: list[int]) -> str:
    return str(steps[0]) if len(steps) == 1 else f"{steps[0]}–{steps[-1]}"


def _display_names(windows: list[WindowTrace]) -> list[str]:
    """Each window's file, relative to the folder the files share."""
    paths = [Path(w.file) for w in windows]
    try:
        root = Path(os.path.commonpath([str(p.parent) for p in paths]))
    except ValueError:
        return [str(p) for p in paths]
    out = []
    for p in paths:
        try:
            out.append(str(p.relative_to(root)))
        except ValueError:
            out.append(str(p))
    return out
