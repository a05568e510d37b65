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
* **Units per step**: the FSDP units each complete step's labels name (the ranks of one job name the same ones:
  ``trace.admit`` tells another job's file by them).
* **Memory** from the ``[memory]`` instant events (``profile_memory=True``): their ``Total Allocated`` is the
  allocator's total on the device after each allocation or free. Per complete step: the highest total, when
  (ms from the step's start), inside which unit and phase, and the curve (at most ``TIMELINE_POINTS`` points,
  each the highest total of its slice of the step). A GPU trace's CUDA device (the one with most events) is
  read; a CPU trace's CPU allocator.
"""

from __future__ import annotations

import bisect
from array import array
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
# a CPU trace's totals count from the profiler's start (its own tally of the CPU allocations it saw): a plain trace
# of a gloo run read 8.27 MiB where the run's peak was 11.56 MiB, its parameters' shards and AdamW's state (a
# new-user trial)
MEMORY_SOURCE_CPU = ("trace: the CPU profiler's memory events, counted from the profiler's start: what was "
                     "allocated before it, such as parameters and optimizer state, is not in them")
TIMELINE_POINTS = 200
_BWD_END = ("post_backward_accumulate", "post_backward_reshard", "post_backward_reduce")
CPU_DEVICE, CUDA_DEVICE = 0, 1
_BRACKETS = ("FSDP::pre_forward", "FSDP::post_forward", "FSDP::pre_backward", "FSDP::post_backward_")


def _step_of(starts: list[float], steps: list[int], ends: list[float], t: float) -> Optional[int]:
    i = bisect.bisect_right(starts, t) - 1
    return steps[i] if i >= 0 and t < ends[i] else None


class UnitSpans:
    """Each unit's forward and backward inside the complete steps, as arrays (a window of thousands of steps holds
    one per unit and phase of each): start and end (µs), unit (an index into ``units``), backward (else
    forward), step. In the order the labels closed them."""

    __slots__ = ("start", "end", "unit", "backward", "step", "units")

    def __init__(self, start, end, unit, backward, step, units: list[str]):
        self.start = np.frombuffer(start, dtype=np.float64)
        self.end = np.frombuffer(end, dtype=np.float64)
        self.unit = np.frombuffer(unit, dtype=np.int32)
        self.backward = np.frombuffer(backward, dtype=np.int8).astype(bool)
        self.step = np.frombuffer(step, dtype=np.int64)
        self.units = units

    def __len__(self) -> int:
        return int(self.start.size)

    def release(self) -> None:
        """Frees the arrays once read (a window of thousands of steps): the spans are empty after."""
        self.start = self.end = np.zeros(0)
        self.unit, self.backward, self.step = np.zeros(0, np.int32), np.zeros(0, bool), np.zeros(0, np.int64)

    def sorted(self) -> np.ndarray:
        """The positions by (start, end, unit name, phase name, step), as tuples of these would sort."""
        rank = np.argsort(np.argsort(np.array(self.units, dtype=object), kind="stable")).astype(np.int64) \
            if self.units else np.zeros(0, dtype=np.int64)
        return np.lexsort((self.step, ~self.backward, rank[self.unit], self.end, self.start))


def unit_spans(ts: np.ndarray, end: np.ndarray, name: np.ndarray, names: list[str],
               step_bounds: dict[int, tuple[float, float]]) -> UnitSpans:
    """Each unit's forward and backward inside the complete steps. The labels as arrays, any thread: ``ts``,
    ``end`` (µs) and ``name`` (an index into ``names``), in the order that ties of start keep; ``step_bounds``:
    step -> (start, end), µs. Only the pre/post forward/backward labels are read."""
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
    units: dict[str, int] = {}
    o_s, o_e, o_u, o_b, o_n = array("d"), array("d"), array("i"), array("b"), array("q")

    def add(s: float, e: float, unit: str, backward: bool) -> None:
        step = _step_of(starts, order, ends, s)
        if step is not None:
            o_s.append(s)
            o_e.append(e)
            o_u.append(units.setdefault(unit, len(units)))
            o_b.append(backward)
            o_n.append(step)

    for t0, t1, code in zip(ts[sel].tolist(), end[sel].tolist(), name[sel].tolist()):
        unit, kind = brackets[code]
        if kind == "pre_forward":
            fwd_open.setdefault(unit, t0)
        elif kind == "post_forward" and unit in fwd_open:
            add(fwd_open.pop(unit), t1, unit, False)
        elif kind == "pre_backward":
            if unit in bwd:
                s, e = bwd.pop(unit)
                if e is not None:
                    add(s, e, unit, True)
            bwd[unit] = [t0, None]
        elif kind in _BWD_END and unit in bwd:
            bwd[unit][1] = max(bwd[unit][1] or t1, t1)
    for unit in list(bwd):
        s, e = bwd.pop(unit)
        if e is not None:
            add(s, e, unit, True)
    return UnitSpans(o_s, o_e, o_u, o_b, o_n, list(units))


# the labels FSDP2 gives a unit's own work, each naming the unit (fsdp_labels; the root's carry no name)
_UNIT_KINDS = frozenset({"pre_forward", "post_forward", "pre_backward", "all_gather", "all_gather_copy_out",
                         "post_backward_accumulate", "post_backward_reshard", "post_backward_reduce",
                         "post_backward_rs_wait", "forward_prefetch", "backward_prefetch"})


def step_units(ts: np.ndarray, name: np.ndarray, names: list[str],
               step_bounds: dict[int, tuple[float, float]]) -> dict[int, tuple[str, ...]]:
    """Per complete step, the FSDP units its labels name ("" the root), in the order first named: the labels of a
    unit's own work (``_UNIT_KINDS``), in the step their start lies in. The labels as arrays, any thread: ``ts`` (µs)
    and ``name`` (an index into ``names``); ``step_bounds``: step -> (start, end), µs. Steps naming none are left
    out; steps naming the same units share one tuple."""
    code = np.full(len(names), -1, dtype=np.int64)
    units: dict[str, int] = {}
    for i, nm in enumerate(names):
        p = parse_label(nm)
        if p is not None and p.kind in _UNIT_KINDS:
            code[i] = units.setdefault(p.fqn or "", len(units))
    if not units or not step_bounds or not name.size:
        return {}
    order = sorted(step_bounds)
    starts = np.array([step_bounds[n][0] for n in order])
    ends = np.array([step_bounds[n][1] for n in order])
    u = code[name]
    t, u = ts[u >= 0], u[u >= 0]
    k = np.searchsorted(starts, t, side="right") - 1
    inside = (k >= 0) & (t < ends[np.maximum(k, 0)])
    t, u, k = t[inside], u[inside], k[inside]
    by_time = np.lexsort((t, k))  # by step, then by start
    k, u = k[by_time], u[by_time]
    first = np.unique(k * len(units) + u, return_index=True)[1]  # each (step, unit) where first named
    first.sort()
    unit_names = list(units)
    per: dict[int, list[str]] = {}
    for step, unit in zip(k[first].tolist(), u[first].tolist()):
        per.setdefault(order[step], []).append(unit_names[unit])
    shared: dict[tuple, tuple] = {}
    return {n: shared.setdefault(tuple(v), tuple(v)) for n, v in per.items()}


def nograd_forwards(spans: UnitSpans) -> dict[int, int]:
    """step -> the forward passes it ran without a backward (evaluation or generation inside a profiled step): the
    most any unit ran forward beyond its backwards (FSDP2 labels no forward of a checkpoint's recompute, which runs
    inside the unit's backward; a micro-batch's forward has its backward). Steps with none are left out."""
    if not len(spans):
        return {}
    n_units = max(1, len(spans.units))
    keys, at = np.unique(spans.step * n_units + spans.unit, return_inverse=True)  # (step, unit)
    extra = np.bincount(at, weights=np.where(spans.backward, -1.0, 1.0)).round().astype(np.int64)
    out: dict[int, int] = {}
    for k, e in zip(keys[extra > 0].tolist(), extra[extra > 0].tolist()):
        out[k // n_units] = max(out.get(k // n_units, 0), e)
    return out


#: units in a phase above which ``time_nesting`` leaves the nesting to the module tree (its pairs are compared)
TIME_NESTING_MAX_UNITS = 512


def time_nesting(spans: UnitSpans) -> dict[str, dict[str, list[str]]]:
    """Per phase ("forward", "backward"), each unit -> the units whose span runs directly inside its own (it starts
    before theirs and ends after; none of them inside another of them), read in the first step with spans, as the
    records' backward nesting is (analyze.report): each unit's first span of the phase there (a checkpointed unit's
    recompute, a second call, later). Units holding none are left out."""
    if not len(spans):
        return {}
    first_step = int(spans.step.min())
    out: dict[str, dict[str, list[str]]] = {}
    for phase, bwd in (("forward", False), ("backward", True)):
        sel = np.flatnonzero((spans.step == first_step) & (spans.backward == bwd))
        first: dict[str, tuple[float, float]] = {}
        for i in sel[np.argsort(spans.start[sel], kind="stable")].tolist():
            first.setdefault(spans.units[int(spans.unit[i])], (float(spans.start[i]), float(spans.end[i])))
        if len(first) > TIME_NESTING_MAX_UNITS:  # (quadratic: the module tree nests them there)
            continue
        inside = {y: {x for x, (s, e) in first.items() if x != y and sy < s and e < ey}
                  for y, (sy, ey) in first.items()}
        direct = {y: sorted(x for x in xs if not any(x in inside[z] for z in xs if z != x))
                  for y, xs in inside.items() if xs}
        if direct:
            out[phase] = direct
    return out


def unit_step_times(spans: UnitSpans, device=None, busy=None) -> dict[int, dict[str, list[float]]]:
    """step -> unit -> [forward µs, backward µs] (summed over the step's spans: a unit run twice counts twice),
    the units in the order they started. Host time; with ``device`` (launch time, start, end of each compute
    kernel: numpy arrays), the device time of the kernels launched inside each span (their union); ``busy``:
    the union of all these kernels' intervals, where the caller has it (else computed)."""
    if not len(spans):
        return {}
    k_order = spans.sorted()
    s_all, e_all = spans.start[k_order], spans.end[k_order]
    if device is None:
        t = e_all - s_all
    else:
        order = np.argsort(device[0], kind="stable")
        launch = device[0][order]
        i, j = np.searchsorted(launch, s_all, side="left"), np.searchsorted(launch, e_all, side="left")
        del launch
        # kernels that never overlap one another (one compute stream): a span's union is the sum of its kernels'
        # durations, read from running sums (few copies of the arrays at once: a window may hold millions)
        dur = device[2][order]
        dur -= device[1][order]
        csum = np.concatenate(([0.0], np.cumsum(dur)))
        del dur
        if busy is None:
            busy = iv.union(device[1], device[2])
        if abs(iv.measure(busy) - float(csum[-1])) <= 1e-9 * max(1.0, float(csum[-1])):
            t = np.where(j > i, csum[j] - csum[i], 0.0)
        else:
            start, end = device[1][order], device[2][order]
            t = np.array([iv.measure(iv.union(start[a:b], end[a:b])) if b > a else 0.0
                          for a, b in zip(i.tolist(), j.tolist())])
        del order
    # summed per (step, unit) and phase in the spans' order (np.add.at adds one at a time, in order)
    step, unit = spans.step[k_order], spans.unit[k_order]
    pair = np.unique(step, return_inverse=True)[1].astype(np.int64) * len(spans.units) + unit
    _, first, inv = np.unique(pair, return_index=True, return_inverse=True)
    acc = np.zeros((first.size, 2))
    np.add.at(acc, (inv, spans.backward[k_order].astype(np.intp)), t)
    out: dict[int, dict[str, list[float]]] = {}
    units, sums = spans.units, acc.tolist()
    by_start = np.argsort(first)
    for p, n, u in zip(by_start.tolist(), step[first[by_start]].tolist(), unit[first[by_start]].tolist()):
        out.setdefault(n, {})[units[u]] = sums[p]
    return out


def memory_steps(ts: np.ndarray, total: np.ndarray, device_type: np.ndarray, device_id: np.ndarray,
                 step_bounds: dict[int, tuple[float, float]], gpu: bool, spans: UnitSpans) -> dict[int, dict]:
    """step -> {"peak": bytes, "t_ms", "unit", "phase", "timeline": [(t_ms, bytes)...]} from the ``[memory]``
    samples (time µs, total allocated, device type, device id: arrays) inside each complete step."""
    sel = _device_events(device_type, device_id, gpu)
    if not sel.any():
        return {}
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
        inside = np.flatnonzero((spans.start <= t_peak) & (t_peak <= spans.end))
        span = int(inside[np.argmax(spans.start[inside])]) if inside.size else None  # (the latest start, first)
        slot = np.minimum(TIMELINE_POINTS - 1, ((t - s0) / ((s1 - s0) / TIMELINE_POINTS)).astype(np.int64))
        pick = np.lexsort((np.arange(len(v)), -v, slot))  # per slice: the highest total, the earliest of equals
        first = pick[np.r_[True, slot[pick][1:] != slot[pick][:-1]]]
        first.sort()
        out[step] = {"peak": peak, "t_ms": (t_peak - s0) / 1e3, "unit": None if span is None else spans.units[spans.unit[span]],
                     "phase": None if span is None else ("backward" if spans.backward[span] else "forward"),
                     "timeline": [((float(t[x]) - s0) / 1e3, int(v[x])) for x in first]}
    return out


KEPT_STEPS = 8  # the complete steps of a window whose blocks are followed (their median is the figure)


def _device_events(device_type: np.ndarray, device_id: np.ndarray, gpu: bool) -> np.ndarray:
    """The mask of the ``[memory]`` events of the device a window's figures come from: a GPU trace's CUDA device
    (the one with most events), a CPU trace's CPU allocator."""
    sel = device_type == (CUDA_DEVICE if gpu else CPU_DEVICE)
    if sel.any():
        ids, counts = np.unique(device_id[sel], return_counts=True)
        sel &= device_id == ids[np.argmax(counts)]
    return sel


def kept_from_forward(memory: dict[int, dict], ts: np.ndarray, nbytes: np.ndarray, addr: np.ndarray,
                      device_type: np.ndarray, device_id: np.ndarray, gpu: bool,
                      step_bounds: dict[int, tuple[float, float]], forward: np.ndarray, backward: np.ndarray,
                      optimizer: np.ndarray) -> None:
    """Adds to each step of ``memory`` (``memory_steps``' dict) what the training loop keeps of the model's
    forward, from the ``[memory]`` events' blocks (allocation: ``Bytes`` > 0 at ``Addr``, free: < 0), followed
    from the window's start: ``forward_kept``, the bytes of the blocks allocated inside a forward of the step
    (from an ``FSDP::root_pre_forward`` to the next ``FSDP::pre_backward``) that are still allocated when its
    ``optimizer.step()`` starts (the model's output the loop still holds, nothing else a training step makes
    there outlives its backward); ``pre_step_freed``, the bytes of the blocks allocated before the step (an
    earlier step's, or before the window) that are freed between its first forward and its first backward
    (what the loop let go of when it bound the new output). Steps without a root pre-forward, an optimizer step
    after it or block addresses are left without them; at most ``KEPT_STEPS`` steps. ``forward``, ``backward``,
    ``optimizer``: the labels' start times (µs, sorted)."""
    if not forward.size or not optimizer.size:
        return
    sel = _device_events(device_type, device_id, gpu)
    order = np.argsort(ts[sel], kind="stable")
    t_all, nb_all, ad_all = ts[sel][order], nbytes[sel][order], addr[sel][order]
    steps = []
    for step, (s0, s1) in sorted(step_bounds.items()):
        if step not in memory:
            continue
        f = forward[(forward >= s0) & (forward < s1)]
        o = optimizer[(optimizer >= (f[0] if f.size else s1)) & (optimizer < s1)]
        if not f.size or not o.size:
            continue
        t_opt = float(o[0])
        f = f[f < t_opt]
        ends = [min(float(b[0]) if (b := backward[backward > x]).size else t_opt, t_opt) for x in f.tolist()]
        steps.append((step, float(s0), f.tolist(), ends, t_opt))
        if len(steps) == KEPT_STEPS:
            break
    if not steps:
        return
    j = int(np.searchsorted(t_all, steps[-1][4], side="left"))
    t_l, nb_l, ad_l = t_all[:j].tolist(), nb_all[:j].tolist(), ad_all[:j].tolist()
    live: dict[int, tuple[int, float]] = {}  # address -> (bytes, when allocated)
    i = 0
    for step, s0, starts, ends, t_opt in steps:
        first_fwd, first_bwd = starts[0], ends[0]
        freed = 0
        blind = False  # an event without an address in the step: its blocks cannot be followed
        while i < j and t_l[i] < t_opt:
            t, nb, ad = t_l[i], nb_l[i], ad_l[i]
            i += 1
            if ad < 0:
                blind = blind or t >= s0
                continue
            if nb > 0:
                live[ad] = (nb, t)
            elif nb < 0:
                had = live.pop(ad, None)
                if first_fwd <= t < first_bwd and (had is None or had[1] < s0):
                    freed -= nb
        if blind:
            continue
        kept = sum(b for b, t in live.values() if any(a <= t < e for a, e in zip(starts, ends)))
        memory[step]["forward_kept"] = int(kept)
        memory[step]["pre_step_freed"] = int(freed)


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
        parents: dict[frozenset, tuple] = {}  # the units of a step -> per phase, unit -> its direct nested units
        timed = getattr(w, "unit_nesting", None) or {}
        for step, units in w.unit_us.items():
            names = frozenset(units)
            if names not in parents:
                # nested in time where the window read it (a grouped unit holds what ran between its modules), else
                # by name
                by_name = defaultdict(list)
                for c in names:
                    by_name[_parent(c, names)].append(c)
                pair = []
                for ph in ("forward", "backward"):
                    nest = timed.get(ph)
                    pair.append({u: [c for c in kids if c in names] for u, kids in nest.items()} if nest else by_name)
                parents[names] = tuple(pair)
            fwd_kids, bwd_kids = parents[names]
            for unit, (f, b) in units.items():
                acc = per.setdefault(unit, defaultdict(list))
                if f > 0:  # (0: no forward span of the unit in the step)
                    acc["fwd_ms"].append(f / 1e3)
                    acc["fwd_self_ms"].append(max(0.0, f - sum(units[c][0] for c in fwd_kids.get(unit, ()))) / 1e3)
                if b > 0:
                    acc["bwd_ms"].append(b / 1e3)
                    acc["bwd_self_ms"].append(max(0.0, b - sum(units[c][1] for c in bwd_kids.get(unit, ()))) / 1e3)
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
    kept: dict[str, list[tuple[int, int]]] = defaultdict(list)  # rank -> (forward_kept, pre_step_freed) per step
    cpu = True
    for w in sorted(windows, key=lambda w: (w.rank, w.file)):
        if not w.memory:
            continue
        cpu = cpu and w.device == "cpu"
        k = str(w.rank)
        kept[k] += [(m["forward_kept"], m["pre_step_freed"]) for m in w.memory.values() if "forward_kept" in m]
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
    for k, rows in kept.items():
        if rows:
            per_rank[k].forward_kept_bytes = int(statistics.median_low(r[0] for r in rows))
            per_rank[k].pre_step_freed_bytes = int(statistics.median_low(r[1] for r in rows))
            per_rank[k].forward_kept_steps = len(rows)
    if not per_rank:
        return None
    top = max(per_rank, key=lambda r: per_rank[r].peak_bytes)
    return MemorySection(categories=["allocated"], peak_rank=top, peak_bytes=per_rank[top].peak_bytes,
                         per_rank=per_rank, source=MEMORY_SOURCE_CPU if cpu else MEMORY_SOURCE)
