"""Per-step samples and the time of each kernel and operator, by phase, from Kineto traces: what a comparison of
two plain-trace runs needs beyond the overlap section (``fsdp_doctor.analyze.compare``).

Per file (one rank's window): the complete steps, as the report reads them (``trace.build.window_steps``:
``ProfilerStep#N`` markers, the last of two or more dropped as HTA does where it may be cut, a step ending where the
next starts; without markers the optimizer.step() calls) give the step durations; within them every kernel (a device
event, placed in the phase its launch was issued in) and every operator (``cpu_op``, self time: its nested operators
taken out) is summed by (phase, kind, name). Phases follow FSDP2's labels: ``forward`` from
``FSDP::root_pre_forward``, ``backward`` from ``FSDP::pre_backward`` or, when earlier, from the first function
autograd's engine runs after the forward (``autograd::engine::evaluate_function: ...``: the loss's backward,
``NllLossBackward0`` and the like, runs before the first FSDP unit's pre-backward hook fires), ``optimizer`` inside
``Optimizer.*`` labels. Does not import torch.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np

from ..fsdp_labels import parse_label
from .build import DEVICE_SYNC_NAMES, OPTIMIZER_PREFIX, OPTIMIZER_STEP_PREFIX, STEP_RE, unsettled_launch, window_steps
from .reader import TraceError, decode

#: the operator autograd's engine wraps each backward function in ("autograd::engine::evaluate_function: MmBackward0")
AUTOGRAD_PREFIX = "autograd::engine::evaluate_function"


@dataclass
class OpTimes:
    """Over the files read: per rank, the complete steps' durations (ms, in step order); per (phase, kind, name)
    the mean µs per step and rank (``kind``: "kernel" | "operator")."""

    steps_ms: dict[str, list[float]] = field(default_factory=dict)
    us_per_step: dict[tuple[str, str, str], float] = field(default_factory=dict)
    prefetched: dict[str, set[str]] = field(default_factory=dict)  # "forward"/"backward" -> units prefetched


def _self_times(evs: list) -> list[tuple[object, float]]:
    """(event, self µs) of one thread's nested operators: each one's duration minus its direct children's."""
    evs = sorted(evs, key=lambda e: (e.ts, -e.dur))
    out: list[list] = []
    stack: list[tuple[float, list]] = []  # (end, [event, self])
    for e in evs:
        while stack and stack[-1][0] <= e.ts:
            stack.pop()
        item = [e, float(e.dur)]
        if stack:
            stack[-1][1][1] -= min(e.dur, stack[-1][0] - e.ts)
        stack.append((e.ts + e.dur, item))
        out.append(item)
    return [(e, max(0.0, s)) for e, s in out]


def _events(trace):
    """The trace's complete events (a duration and a start), decoded whole or, for a large file
    (``reader.StreamedTrace``), a batch at a time as the file is read again: each call is a new pass."""
    batches = trace.batches() if trace.traceEvents is None else (trace.traceEvents,)
    for batch in batches:
        for e in batch:
            if e.dur is not None and e.ts is not None:
                yield e


def _file_times(path: Path, prefetched: dict[str, set[str]]) -> tuple[int | None, list[float], dict, int]:
    """Two passes over the events (a large file is read twice, a batch at a time): the steps, phase bounds,
    optimizer spans and kernel launches; then each kernel's and operator's time in its phase."""
    trace = decode(path)
    markers: list[tuple[int, float, float]] = []
    bounds: list[tuple[float, str]] = []
    optim: list[tuple[float, float]] = []
    optim_names: list[str] = []
    launches: dict[int, float] = {}
    autograd: list[float] = []  # the starts of autograd's backward functions
    device: list[int] = []  # the device events' correlations
    device_syncs: list[float] = []  # the starts of the host's device-wide syncs
    ints, top, any_event = True, 0, False
    for e in _events(trace):
        n, a = e.name, e.args
        any_event = True
        ints = ints and e.ts.__class__ is int
        top = max(top, e.ts)
        if n.startswith("ProfilerStep"):
            m = STEP_RE.match(n)
            if m:
                markers.append((int(m.group(1)), e.ts, e.ts + e.dur))
        elif n.startswith(OPTIMIZER_PREFIX):
            optim.append((e.ts, e.ts + e.dur))
            optim_names.append(n)
        elif n.startswith(AUTOGRAD_PREFIX):
            autograd.append(e.ts)
        elif (lab := parse_label(n)) is not None:
            if lab.kind == "root_pre_forward":
                bounds.append((e.ts, "forward"))
            elif lab.kind == "pre_backward":
                bounds.append((e.ts, "backward"))
            elif lab.kind.endswith("_prefetch"):  # "FSDP::forward_prefetch for layers.1"
                prefetched.setdefault(lab.kind[: -len("_prefetch")], set()).add(lab.fqn)
        elif n in DEVICE_SYNC_NAMES:
            device_syncs.append(e.ts)
        if a is not None and a.correlation is not None and a.stream is None and e.cat == "cuda_runtime":
            launches[a.correlation] = e.ts
        elif a is not None and a.correlation is not None and a.stream is not None and e.cat not in (None, "Trace"):
            device.append(a.correlation)
    dist = trace.distributedInfo  # (a streamed trace's, if written after the events, is known once a pass ended)
    rank = dist.rank if dist is not None and dist.rank is not None else None
    # integer-nanosecond timestamps (as the trace model reads them): "ns" display unit (a streamed trace knows it
    # once a pass has ended) or too large to be µs
    scale = 1e-3 if any_event and ints and (trace.displayTimeUnit == "ns" or top > 1e17) else 1.0
    bounds = [(t * scale, ph) for t, ph in bounds]
    optim = [(a * scale, b * scale) for a, b in optim]
    launches = {k: t * scale for k, t in launches.items()}
    # the report's steps (trace.build reads them so): a kept step ends where the next starts
    ws = window_steps(((n, a * scale, b * scale) for n, a, b in markers),
                      [o for o, nm in zip(optim, optim_names) if nm.startswith(OPTIMIZER_STEP_PREFIX)],
                      [t for t, ph in bounds if ph == "forward"], top * scale,
                      unsettled_launch(np.array([launches.get(c, math.nan) for c in device], dtype=float),
                                       [t * scale for t in device_syncs]))
    kept = ws.kept
    if not kept:
        return rank, [], {}, 0
    lo, hi = ws.bounds[kept[0]][0], ws.bounds[kept[-1]][1]
    autograd = sorted(t * scale for t in autograd)
    for t in [t for t, ph in bounds if ph == "forward"]:  # backward from autograd's first function after a forward
        j = bisect.bisect_left(autograd, t)
        if j < len(autograd):
            bounds.append((autograd[j], "backward"))
    bounds.sort()
    optim.sort()
    bts = [b[0] for b in bounds]

    def phase(t: float) -> str:
        i = bisect.bisect_right(optim, (t, math.inf)) - 1
        if i >= 0 and optim[i][0] <= t < optim[i][1]:
            return "optimizer"
        j = bisect.bisect_right(bts, t) - 1
        return bounds[j][1] if j >= 0 else "forward"

    acc: dict[tuple[str, str, str], float] = {}
    threads: dict[tuple, list] = {}
    for e in _events(trace):
        a = e.args
        if a is not None and a.stream is not None and a.correlation is not None and e.cat not in (None, "Trace"):
            t = launches.get(a.correlation, e.ts * scale)  # the host time it was issued: its phase
            if lo <= t < hi:
                key = (phase(t), "kernel", e.name)
                acc[key] = acc.get(key, 0.0) + e.dur * scale
        elif e.cat == "cpu_op" and lo <= e.ts * scale < hi:
            threads.setdefault((e.pid, e.tid), []).append(e)
    for evs in threads.values():
        for e, us in _self_times(evs):
            key = (phase(e.ts * scale), "operator", e.name)
            acc[key] = acc.get(key, 0.0) + us * scale
    durs = [(b - a) / 1e3 for a, b in ws.bounds.values()]
    return rank, durs, acc, len(kept)


def op_times(paths: Iterable[Path]) -> OpTimes:
    """The step durations and per-step kernel/operator times of the trace files ``paths`` (unreadable files are
    left out: the report already names them)."""
    out = OpTimes()
    total: dict[tuple[str, str, str], float] = {}
    ranks = 0
    for i, p in enumerate(sorted(Path(x) for x in paths)):
        try:
            rank, durs, acc, n = _file_times(p, out.prefetched)
        except (TraceError, OSError):
            continue
        if not n:
            continue
        key = str(rank if rank is not None else i)
        out.steps_ms.setdefault(key, []).extend(durs)
        ranks += 1
        for k, v in acc.items():
            total[k] = total.get(k, 0.0) + v / n
    out.us_per_step = {k: v / ranks for k, v in total.items()} if ranks else {}
    return out
