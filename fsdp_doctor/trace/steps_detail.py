"""Per complete step of a plain trace: each FSDP unit's forward and backward time, and the allocator's peak.

Built from what torch.profiler writes, no fsdp-doctor records needed:

* **Unit times** from FSDP2's ``record_function`` labels (``fsdp_doctor.fsdp_labels``): a unit's forward runs
  from its first ``FSDP::pre_forward (fqn)`` (a unit grouping several modules labels each module's pre-forward)
  to the next ``FSDP::post_forward (fqn)``'s end; its backward from ``FSDP::pre_backward (fqn)`` to the end of
  its last ``FSDP::post_backward_{accumulate,reshard,reduce} (fqn)`` before its next pre-backward. The root's
  labels carry no fqn (``FSDP::pre_forward``): the root is ``""``. These are host spans (the time the host spent
  between the brackets, nested units included: ``fwd_ms``/``bwd_ms``, as the recorder's); a span belongs to the
  complete step its start lies in. On a GPU trace the host runs ahead of the device, so a unit's time is the
  device time of the compute kernels launched inside its span (the union of their intervals; NCCL and copies
  left out); the rows' ``source`` says which.
* **Memory** from the ``[memory]`` instant events (``profile_memory=True``): their ``Total Allocated`` is the
  allocator's total on the device after each allocation or free. Per complete step: the highest total, when
  (ms from the step's start), inside which unit and phase, and the curve (at most ``TIMELINE_POINTS`` points,
  each the highest total of its slice of the step). A GPU trace's CUDA device (the one with most events) is
  read; a CPU trace's CPU allocator.
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from typing import Optional

import numpy as np

from ..fsdp_labels import parse_label
from ..report_sections import MemoryPeakAt, MemoryRank, MemorySection, TraceUnitRow, UnitTiming
from . import intervals as iv

UNIT_SOURCE_HOST = "trace: host spans between FSDP2's labels"
UNIT_SOURCE_DEVICE = "trace: device time of the compute kernels launched inside FSDP2's labels"
MEMORY_SOURCE = "trace: the profiler's memory events, allocator total"
TIMELINE_POINTS = 200
_BWD_END = ("post_backward_accumulate", "post_backward_reshard", "post_backward_reduce")
CPU_DEVICE, CUDA_DEVICE = 0, 1
_BRACKETS = ("FSDP::pre_forward", "FSDP::post_forward", "FSDP::pre_backward", "FSDP::post_backward_")


def _step_of(starts: list[float], steps: list[int], ends: list[float], t: float) -> Optional[int]:
    i = bisect.bisect_right(starts, t) - 1
    return steps[i] if i >= 0 and t < ends[i] else None


def unit_spans(ts: np.ndarray, end: np.ndarray, name: np.ndarray, names: list[str],
               step_bounds: dict[int, tuple[float, float]]) -> list[tuple[float, float, str, str, int]]:
    """(start, end, unit, phase, step) of each unit's forward and backward inside the complete steps. The labels
    as arrays, any thread: ``ts``, ``end`` (µs) and ``name`` (an index into ``names``), in the order that ties of
    start keep; ``step_bounds``: step -> (start, end), µs. Only the pre/post forward/backward labels are read."""
    order = sorted(step_bounds)
    starts = [step_bounds[n][0] for n in order]
    ends = [step_bounds[n][1] for n in order]
    brackets = {}  # name index -> (unit, kind) of the labels read (most labels are collectives': left out)
    for i, nm in enumerate(names):
        if nm.startswith(_BRACKETS) and (p := parse_label(nm)) is not None:
            brackets[i] = (p.fqn or "", p.kind)
    sel = np.flatnonzero(np.isin(name, list(brackets))) if brackets else np.zeros(0, dtype=np.intp)
    sel = sel[np.argsort(ts[sel], kind="stable")]
    fwd_open: dict[str, float] = {}
    bwd: dict[str, list] = {}  # unit -> [start, end] of the backward being read
    out = []

    def close_bwd(unit: str) -> None:
        s, e = bwd.pop(unit)
        if e is not None:
            step = _step_of(starts, order, ends, s)
            if step is not None:
                out.append((s, e, unit, "backward", step))

    for t0, t1, code in zip(ts[sel].tolist(), end[sel].tolist(), name[sel].tolist()):
        unit, kind = brackets[code]
        if kind == "pre_forward":
            fwd_open.setdefault(unit, t0)
        elif kind == "post_forward" and unit in fwd_open:
            s = fwd_open.pop(unit)
            step = _step_of(starts, order, ends, s)
            if step is not None:
                out.append((s, t1, unit, "forward", step))
        elif kind == "pre_backward":
            if unit in bwd:
                close_bwd(unit)
            bwd[unit] = [t0, None]
        elif kind in _BWD_END and unit in bwd:
            bwd[unit][1] = max(bwd[unit][1] or t1, t1)
    for unit in list(bwd):
        close_bwd(unit)
    return out


def unit_step_times(spans, device=None) -> dict[int, dict[str, list[float]]]:
    """step -> unit -> [forward µs, backward µs] (summed over the step's spans: a unit run twice counts twice),
    the units in the order they started. Host time; with ``device`` (launch time, start, end of each compute
    kernel: numpy arrays), the device time of the kernels launched inside each span (their union)."""
    spans = sorted(spans)
    if device is not None:
        order = np.argsort(device[0], kind="stable")
        launch, start, end = (a[order] for a in device)
        cut = np.searchsorted(launch, [(sp[0], sp[1]) for sp in spans], side="left").tolist() if spans else []
        # kernels that never overlap one another (one compute stream): a span's union is the sum of its kernels'
        # durations, read from running sums
        dur = end - start
        csum = np.concatenate(([0.0], np.cumsum(dur)))
        disjoint = abs(iv.measure(iv.union(start, end)) - float(csum[-1])) <= 1e-9 * max(1.0, float(csum[-1]))
    out: dict[int, dict[str, list[float]]] = defaultdict(dict)
    for k, (s, e, unit, phase, step) in enumerate(spans):
        acc = out[step].setdefault(unit, [0.0, 0.0])
        if device is None:
            t = e - s
        else:
            i, j = cut[k]
            if j <= i:
                t = 0.0
            elif disjoint:
                t = float(csum[j] - csum[i])
            else:
                t = iv.measure(iv.union(start[i:j], end[i:j]))
        acc[0 if phase == "forward" else 1] += t
    return dict(out)


def memory_steps(ts: np.ndarray, total: np.ndarray, device_type: np.ndarray, device_id: np.ndarray,
                 step_bounds: dict[int, tuple[float, float]], gpu: bool, spans) -> dict[int, dict]:
    """step -> {"peak": bytes, "t_ms", "unit", "phase", "timeline": [(t_ms, bytes)...]} from the ``[memory]``
    samples (time µs, total allocated, device type, device id: arrays) inside each complete step."""
    want = CUDA_DEVICE if gpu else CPU_DEVICE
    sel = device_type == want
    if not sel.any():
        return {}
    ids, counts = np.unique(device_id[sel], return_counts=True)
    sel &= device_id == ids[np.argmax(counts)]  # the device with most events
    order = np.argsort(ts[sel], kind="stable")
    t_all, v_all = ts[sel][order], total[sel][order]
    out = {}
    for step, (s0, s1) in sorted(step_bounds.items()):
        i, j = np.searchsorted(t_all, [s0, s1], side="left")
        if j <= i or s1 <= s0:
            continue
        t, v = t_all[i:j], v_all[i:j]
        k = int(np.argmax(v))  # the first (earliest) highest total
        t_peak, peak = float(t[k]), int(v[k])
        span = max((sp for sp in spans if sp[0] <= t_peak <= sp[1]), key=lambda sp: sp[0], default=None)
        slot = np.minimum(TIMELINE_POINTS - 1, ((t - s0) / ((s1 - s0) / TIMELINE_POINTS)).astype(np.int64))
        pick = np.lexsort((np.arange(len(v)), -v, slot))  # per slice: the highest total, the earliest of equals
        first = pick[np.r_[True, slot[pick][1:] != slot[pick][:-1]]]
        first.sort()
        out[step] = {"peak": peak, "t_ms": (t_peak - s0) / 1e3, "unit": None if span is None else span[2],
                     "phase": None if span is None else span[3],
                     "timeline": [((float(t[x]) - s0) / 1e3, int(v[x])) for x in first]}
    return out


# ---------------------------------------------------------------- over windows (the report's figures)


def _parent(name: str, names: set[str]) -> Optional[str]:
    first = name.split(", ")[0]  # a unit grouping modules is named by them all
    best = None
    for other in names:
        if other and other != name and first.startswith(other + ".") and (best is None or len(other) > len(best)):
            best = other
    if best is None and name and "" in names:
        return ""
    return best


def trace_unit_rows(windows) -> list[TraceUnitRow]:
    """Each unit's median per-step forward and backward over every rank's complete steps (ms), and its own time
    (direct nested units' taken out), in the order the units first ran forward. Empty without FSDP2 labels."""
    per: dict[str, dict[str, list[float]]] = {}
    gpu = False
    for w in windows:
        gpu = gpu or w.device == "gpu"
        parents: dict[frozenset, dict] = {}  # the units of a step -> unit -> its direct nested units
        for step, units in w.unit_us.items():
            names = frozenset(units)
            if names not in parents:
                nested = parents[names] = defaultdict(list)
                for c in names:
                    nested[_parent(c, names)].append(c)
            for unit, (f, b) in units.items():
                kids = [units[c] for c in parents[names].get(unit, ())]
                acc = per.setdefault(unit, defaultdict(list))
                if f > 0:  # (0: no forward span of the unit in the step)
                    acc["fwd_ms"].append(f / 1e3)
                    acc["fwd_self_ms"].append(max(0.0, f - sum(k[0] for k in kids)) / 1e3)
                if b > 0:
                    acc["bwd_ms"].append(b / 1e3)
                    acc["bwd_self_ms"].append(max(0.0, b - sum(k[1] for k in kids)) / 1e3)
    names = set(per)
    rows = []
    source = UNIT_SOURCE_DEVICE if gpu else UNIT_SOURCE_HOST
    for unit in sorted(per, key=lambda u: u != ""):  # the root first, then in the order they ran
        acc = per[unit]
        med = {k: round(statistics.median(v), 3) for k, v in acc.items() if v}
        parent = _parent(unit, names)
        depth, p = 0, parent
        while p is not None:
            depth += 1
            p = _parent(p, names)
        rows.append(TraceUnitRow(name=unit, parent=parent, depth=depth, samples=max(len(acc["fwd_ms"]), len(acc["bwd_ms"])), source=source,
                                 timing_p50=UnitTiming(fwd_ms=med.get("fwd_ms", 0.0), bwd_ms=med.get("bwd_ms", 0.0),
                                                       fwd_self_ms=med.get("fwd_self_ms"),
                                                       bwd_self_ms=med.get("bwd_self_ms"))))
    return rows


def trace_memory(windows) -> Optional[MemorySection]:
    """Per rank, the highest allocator total over its complete steps (bytes), the step, time, unit and phase
    where it happened, and that step's curve. None where no window carries ``[memory]`` events."""
    per_rank: dict[str, MemoryRank] = {}
    for w in sorted(windows, key=lambda w: (w.rank, w.file)):
        if not w.memory:
            continue
        k = str(w.rank)
        step, m = max(w.memory.items(), key=lambda kv: (kv[1]["peak"], -kv[0]))
        prev = per_rank.get(k)
        steps = len(w.memory) + (prev.steps if prev else 0)
        if prev is None or m["peak"] > prev.peak_bytes:
            per_rank[k] = MemoryRank(
                peak_bytes=m["peak"], peak_breakdown={"allocated": m["peak"]}, peak_share={"allocated": 1.0},
                peak_at=MemoryPeakAt(step=step, unit=m["unit"], phase=m["phase"],
                                                           t_ms=round(m["t_ms"], 3)),
                timeline_step=step, timeline=[{"t_ms": round(t, 3), "allocated": v} for t, v in m["timeline"]])
        per_rank[k].steps = per_rank[k].full_steps = steps
    if not per_rank:
        return None
    top = max(per_rank, key=lambda r: per_rank[r].peak_bytes)
    return MemorySection(categories=["allocated"], peak_rank=top, peak_bytes=per_rank[top].peak_bytes,
                         per_rank=per_rank, source=MEMORY_SOURCE)
