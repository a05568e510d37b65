"""Analyses over :class:`~fsdp_doctor.trace.model.WindowTrace` and the top-level ``analyze_traces``.

Metrics (per rank, summed over that rank's windows; times in µs):

* ``comm_us``: measure of the union of communication; ``overlap_us``: measure of (communication ∩ compute);
  ``exposed_us = comm_us - overlap_us``; ``overlap_pct = 100·overlap_us/comm_us`` (None without comm).
  On GPU this is HTA 0.5.0's ``get_comm_comp_overlap``.
* Per FSDP unit × collective × phase: ``count``; ``comm_us`` (sum of the calls' durations);
  ``exposed_us`` (sum over calls of the part not overlapped by compute); ``bytes_per_call`` (mean message
  size S, the unsharded size, where the trace has it); ``busbw_gbps`` = S·count·f / Σduration with
  f = (n-1)/n for all_gather/reduce_scatter and 2(n-1)/n for all_reduce (NCCL-tests convention);
  ``slack_us`` (mean over calls of need - finish: negative means compute waited for the all-gather);
  ``held_us`` (mean over calls of max(0, need - finish): how long the gathered parameters sat unused).
* ``copies``: union of Memcpy HtoD / DtoH and the part of their union not overlapped by compute.
* ``idle``: on GPU the compute stream (most compute-kernel time) — its span minus its busy time
  (``idle_us``) and its busy time (``kernel_us``); on CPU the same for the main thread's compute.
* ``breakdown``: the complete steps' wall time (``window_us``) split into exclusive parts, in µs (see
  :func:`breakdown`); the verdict (``fsdp_doctor.analyze.verdict``) turns it into shares.
* ``blocking`` (gloo): all-gathers during which the host thread sat in the all-gather (its
  ``FSDP::all_gather`` label or the c10d op) from the collective's start to its end: count and total µs.

``analyze_windows`` / ``analyze_traces`` return these as an
:class:`~fsdp_doctor.report_sections.OverlapSection` (the report's ``overlap``); the per-window functions
(``overlap``, ``copies``, ``breakdown``, ...) return plain dicts of µs, comparable with HTA's.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np

from ..report_sections import (Blocking, Breakdown, CommUnitRow, Copies, DeviceIdle, KernelStats, OverlapRank,
                               OverlapSection, SkippedFile)
from . import intervals as iv
from .admit import admit
from .build import MODEL_PHASE, _gc_paused
from .loader import load_windows
from .model import OTHER_UNIT, CollectiveCall, WindowTrace
from .reader import find_trace_files
from .steps_detail import trace_memory, trace_unit_rows

PathLike = Union[str, os.PathLike]
# A plain trace shows the unshard synchronous where the host sat in at least this share of the all-gathers (gloo):
# with it, nearly every one (18 of 18 per rank on a new-user trial's 2-rank GPT with per-block units, the root's
# included; 36 of 36 in each of its reruns). With async unshard gloo's thread may still finish a small all-gather
# before the host's call returns, which reads as blocking: 0-4 of 36 in the trial GPT's reruns, but 11 of 22 in the
# sample run's own window (traces/sample, a loaded host; 7 of 11 on one rank). prefetch.sync_unshard reads it so.
BLOCKED_AG_SHARE = 0.9

# ---------------------------------------------------------------- per-window analyses


def overlap(win: WindowTrace) -> dict:
    comm = iv.measure(win.comm)
    ov = iv.intersection_measure(win.comm, win.compute)
    return {"comm_us": comm, "overlap_us": ov, "exposed_us": comm - ov}


def copies(win: WindowTrace) -> dict:
    both = iv.union_many(win.h2d, win.d2h)
    exposed = iv.measure(both) - iv.intersection_measure(both, win.compute)
    return {"h2d_us": iv.measure(win.h2d), "d2h_us": iv.measure(win.d2h), "exposed_us": exposed}


def idle(win: WindowTrace) -> dict:
    busy = iv.measure(win.stream_busy)
    span = win.span[1] - win.span[0] if win.stream_busy[0].size else 0.0
    return {"idle_us": max(span - busy, 0.0), "kernel_us": busy}


# Exposed communication by collective and phase, in the order an instant is given to: when several
# collectives run exposed at once, compute is waiting for the all-gather (it needs the parameters).
COMM_PARTS = Breakdown.COMM_PARTS
FSDP_COMM_PARTS = Breakdown.FSDP_COMM_PARTS
BREAKDOWN_PARTS = Breakdown.PARTS  # one definition, the report's (tests/test_verdict.py checks COMM_PARTS in it)


def _comm_part(c: CollectiveCall) -> str:
    if c.unit == OTHER_UNIT:  # no FSDP unit's: the model's own (tensor parallelism's), or the loop's and optimizer's
        return "model_comm" if c.phase == MODEL_PHASE else "other_comm"
    if c.collective == "all_gather":
        return "allgather_bwd" if c.phase == "backward" else "allgather_fwd"
    return "reducescatter"  # a unit's gradient reduction: its reduce-scatter, HSDP's all-reduce across replicas


def _clip(a: iv.Intervals, w0: float, w1: float) -> iv.Intervals:
    s, e = a
    s, e = np.maximum(s, w0), np.minimum(e, w1)
    keep = e > s
    return s[keep], e[keep]


def breakdown(win: WindowTrace, window: Optional[tuple[float, float]] = None) -> dict:
    """The window (default: the complete steps' host span) split into exclusive parts, µs. At each instant,
    in this order: ``compute`` (a compute kernel runs / the main thread runs an operator); exposed
    communication (``allgather_fwd``, ``allgather_bwd``, ``reducescatter``, ``model_comm``: the model's own, such as
    tensor parallelism's, ``other_comm``); ``offload``
    (Memcpy HtoD/DtoH alone on the device); ``other_gpu`` (memsets, device-to-device copies alone). Where
    the device is idle: ``sync`` (the next device work was not launched yet because the host sat in a device sync:
    ``cudaDeviceSynchronize``, ``cudaStreamSynchronize``, ``aten::item``...), ``host`` (the next device work was
    not launched yet and the host was inside the
    model: launch/framework overhead; on CPU, main-thread time outside operators and collectives: on gloo the
    main thread's time inside a collective, its wait included, is its call's communication), ``input`` (the same while
    the host was outside the model: data loading, the user's code), ``idle`` (launched work waiting:
    synchronisation, launch latency). The parts add up to ``window_us``."""
    out = {k: 0.0 for k in BREAKDOWN_PARTS}
    w = window or win.window or (win.span if win.span[1] > win.span[0] else None)
    if w is None or w[1] <= w[0]:
        out["window_us"] = out["comm_us"] = 0.0
        return out
    w0, w1 = w
    full = (np.array([w0]), np.array([w1]))
    compute = _clip(win.compute, w0, w1)
    out["compute"] = iv.measure(compute)
    taken = compute
    exposed = iv.subtract(_clip(win.comm, w0, w1), compute)
    by_part: dict = defaultdict(lambda: ([], []))
    for c in win.calls:
        s, e = by_part[_comm_part(c)]
        s.append(c.start)
        e.append(c.end)
    for a, b, c in win.comm_waits:  # gloo: the main thread inside a collective, in the part of the call it waited for
        s, e = by_part[_comm_part(c) if c is not None else "other_comm"]
        s.append(a)
        e.append(b)
    for part in COMM_PARTS:
        if part in by_part and exposed[0].size:
            mine = iv.intersect(exposed, iv.union(*by_part[part]))
            out[part] = iv.measure(mine)
            exposed = iv.subtract(exposed, mine)
    out["other_comm"] += iv.measure(exposed)  # communication no call accounts for
    taken = iv.union_many(taken, _clip(win.comm, w0, w1))
    copies_iv = iv.subtract(_clip(iv.union_many(win.h2d, win.d2h), w0, w1), taken)
    out["offload"] = iv.measure(copies_iv)
    taken = iv.union_many(taken, copies_iv)
    if win.device == "gpu":
        other = iv.subtract(_clip(win.other_dev, w0, w1), taken)
        out["other_gpu"] = iv.measure(other)
        busy = _clip(win.gpu_busy, w0, w1)
        free = iv.subtract(full, busy)
        waiting = iv.intersect(free, win.host_wait) if win.host_wait[0].size else iv.EMPTY
        sync = iv.intersect(waiting, win.sync) if win.sync[0].size and waiting[0].size else iv.EMPTY
        out["sync"] = iv.measure(sync)
        rest = iv.subtract(waiting, sync) if sync[0].size else waiting
        outside = iv.intersect(rest, win.outside) if win.outside[0].size else iv.EMPTY
        out["input"] = iv.measure(outside)
        out["host"] = iv.measure(rest) - out["input"]
        out["idle"] = iv.measure(free) - iv.measure(waiting)
    else:
        free = iv.subtract(full, taken)
        outside = iv.intersect(free, win.outside) if win.outside[0].size else iv.EMPTY
        out["input"] = iv.measure(outside)
        out["host"] = iv.measure(free) - out["input"]
    out["window_us"] = w1 - w0
    out["comm_us"] = iv.measure(_clip(win.comm, w0, w1))
    return out


def temporal_breakdown(win: WindowTrace) -> dict:
    """HTA 0.5.0's ``get_temporal_breakdown`` for a GPU window, µs: ``kernel_us`` (first device event start to
    last end), ``idle_us`` (of that, no device event runs), ``compute_us`` (union of compute kernels),
    ``non_compute_us`` (the rest: communication, copies and memsets alone)."""
    busy = win.gpu_busy
    if not busy[0].size:
        return {"kernel_us": 0.0, "idle_us": 0.0, "compute_us": 0.0, "non_compute_us": 0.0}
    kernel = float(busy[1][-1] - busy[0][0])
    idle_us = kernel - iv.measure(busy)
    comp = iv.measure(win.compute)
    return {"kernel_us": kernel, "idle_us": idle_us, "compute_us": comp, "non_compute_us": kernel - comp - idle_us}


def blocking(win: WindowTrace) -> dict:
    blk = [c for c in win.calls if c.blocking]
    return {"count": len(blk), "us": float(sum(c.end - c.start for c in blk))}


def blocked_allgathers(section: OverlapSection) -> tuple[int, int]:
    """(the all-gathers during which the host sat in the collective for its whole length, the all-gathers), over every
    rank's windows of the trace section. Only gloo's block (trace.build: on a GPU the host launches and goes on)."""
    return (sum(b.count for b in section.blocking.values()),
            sum(r.count for r in section.per_unit if r.collective == "all_gather"))


def call_exposure(win: WindowTrace) -> np.ndarray:
    """Per call in ``win.calls``: the µs of the call not overlapped by compute."""
    if not win.calls:
        return np.zeros(0)
    s = np.array([c.start for c in win.calls])
    e = np.array([c.end for c in win.calls])
    return (e - s) - iv.overlap_each(s, e, win.compute)


def busbw_factor(collective: str, n: Optional[int]) -> Optional[float]:
    if not n or n < 1:
        return None
    if collective in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("broadcast", "reduce", "send_recv", "send", "recv"):
        return 1.0
    return None


def _per_step(pr: OverlapRank, bd: Optional[dict]) -> None:
    """The rank's per-step figures (ms) from its complete steps' breakdown (µs, summed over its windows): the
    exposed communication is the breakdown's communication parts, so it is the verdict's by construction."""
    n = pr.step_count
    if not n or not bd or bd["window_us"] <= 0:
        return
    exposed = sum(bd[k] for k in COMM_PARTS)
    pr.step_ms = bd["window_us"] / n / 1e3
    pr.comm_ms_per_step = bd["comm_us"] / n / 1e3
    pr.exposed_ms_per_step = exposed / n / 1e3
    pr.hidden_ms_per_step = max(0.0, bd["comm_us"] - exposed) / n / 1e3
    pr.step_overlap_pct = 100.0 * (bd["comm_us"] - exposed) / bd["comm_us"] if bd["comm_us"] > 0 else None


def row_time_in_steps(win: WindowTrace) -> dict:
    """Per (unit, collective, phase) of the window's calls: those inside the complete steps, as (their count, the
    union of their time inside the steps in µs, the part of it during which no compute ran). A call counts where
    it ran into the steps and was issued before they end, so that the count and the time are of the same calls (a
    window of one ProfilerStep keeps what ran after it: HTA's reference gloo trace holds one step of 210 ms, 2 of
    its 10 all-reduces start inside it and the other 8 after it, the last ending 1.06 s after it; counted whole,
    its row read 10 calls a step beside the 2's 178.8 ms). Unions, not sums: calls of one row that run at once
    (gloo's threads, several NCCL streams) count once, so a row's time per step never exceeds the step."""
    if win.window is None or not win.calls:
        return {}
    w0, w1 = win.window
    by: dict = defaultdict(lambda: ([], []))
    for c in win.calls:
        if c.end > w0 and c.issue < w1:
            s, e = by[(c.unit, c.collective, c.phase)]
            s.append(c.start)
            e.append(c.end)
    out = {key: (0, 0.0, 0.0) for key in {(c.unit, c.collective, c.phase) for c in win.calls}}
    for key, (s, e) in by.items():
        u = _clip(iv.union(s, e), w0, w1)
        out[key] = (len(s), iv.measure(u), iv.measure(iv.subtract(u, win.compute)) if u[0].size else 0.0)
    return out


def _step_spans(win: WindowTrace) -> tuple[list[int], np.ndarray, np.ndarray]:
    """The window's complete steps and their spans (starts, ends): one after the other from the window's start (on
    a GPU moved with the device, ``device_lag_us``), the last ending at the window's end at the latest, so that they
    tile the breakdown's window."""
    w0, w1 = win.window
    steps = sorted(win.step_us)
    ends = w0 + np.cumsum([win.step_us[n] for n in steps])
    starts = np.concatenate(([w0], ends[:-1]))
    return steps, starts, np.minimum(ends, w1)


def step_exposed_us(win: WindowTrace) -> dict:
    """Per complete step: its exposed communication (collectives while no compute ran), µs; the steps add up to the
    breakdown's communication parts (``_step_spans``)."""
    if win.window is None or not win.step_us:
        return {}
    steps, starts, ends = _step_spans(win)
    exposed = iv.overlap_each(starts, ends, iv.subtract(_clip(win.comm, *win.window), win.compute))
    return dict(zip(steps, exposed.tolist()))


#: a complete profiled step this many times the median of its rank's other complete steps is unlike them (a GC
#: pause, a stall of the data loader, a checkpoint save, the first step's initialization in the window): the
#: verdict says what the shares read without it (analyze.verdict). Not less: on a loaded 2-core host the profiled
#: steps of a steady gloo run differ by up to 1.49x among themselves (102 ms against 70 and 67)
ATYPICAL_STEP_FACTOR = 2.0


#: profiler steps per optimizer.step() from which a rank's profiler steps are micro-batches (prof.step() called per
#: micro-batch of gradient accumulation): a window of 2 steps sees at best one micro-batch beside its optimizer
#: step; under it, a step whose optimizer.step() was skipped (a GradScaler's inf) is not gradient accumulation
MICRO_BATCH_STEPS_MIN = 2.0


def steps_per_optimizer_step(pr) -> Optional[float]:
    """A rank's complete profiler steps per optimizer.step(): its backward passes per optimizer step over those per
    profiler step where the windows counted both (``OverlapRank.backwards_per_optimizer_step``, ``backwards_per_step``:
    a window of 3 profiler steps per micro-batch, 2 micro-batches an optimizer step, held 1 or 2 calls as the window
    fell, and read 1.5 or 3: Lightning's profiler, accum.sync_every_micro_batch quiet, a new-user trial); else its
    steps less those whose ProfilerStep holds no optimizer.step() (``steps_without_optimizer``); None where none
    holds one."""
    if pr.backwards_per_optimizer_step and pr.backwards_per_step:
        return pr.backwards_per_optimizer_step / pr.backwards_per_step
    with_opt = pr.step_count - len(pr.steps_without_optimizer)
    return pr.step_count / with_opt if with_opt > 0 else None


def atypical_steps(step_ms: dict) -> list:
    """The steps of ``step_ms`` (step -> wall time) that take ``ATYPICAL_STEP_FACTOR`` times the median of the
    others or more; none where there are fewer than two steps or where as many are so as not (no typical step to
    compare with: a window of two steps far apart names the longer)."""
    if len(step_ms) < 2:
        return []
    out = [n for n, ms in step_ms.items()
           if ms >= ATYPICAL_STEP_FACTOR * float(np.median([v for m, v in step_ms.items() if m != n]))]
    return sorted(out) if 2 * len(out) <= len(step_ms) else []


def step_breakdowns(win: WindowTrace, steps) -> dict:
    """Per complete step of ``steps`` that the window holds: its breakdown's parts (µs, ``breakdown`` over its span,
    ``_step_spans``)."""
    if win.window is None or not win.step_us:
        return {}
    order, starts, ends = _step_spans(win)
    return {n: {k: v for k, v in breakdown(win, (float(a), float(b))).items() if k in BREAKDOWN_PARTS}
            for n, a, b in zip(order, starts, ends) if n in steps}


def on_compute_stream_us(win: WindowTrace) -> float:
    """µs inside the complete steps during which collectives' kernels ran on the compute stream (their union)."""
    mine = [(c.start, c.end) for c in win.calls if c.on_compute_stream]
    if win.window is None or not mine:
        return 0.0
    s, e = zip(*mine)
    return iv.measure(_clip(iv.union(list(s), list(e)), *win.window))


def unit_rows(rank: int, calls: list[tuple[CollectiveCall, float]], steps: int = 1,
              in_steps: Optional[dict] = None) -> list[CommUnitRow]:
    """One row per (unit, collective, phase) of the rank's calls; the per-step figures divide by ``steps`` the
    row's calls and time inside the complete steps (``in_steps``, see :func:`row_time_in_steps`; without it, its
    sums)."""
    groups: dict = defaultdict(list)
    for c, exp in calls:
        groups[(c.unit, c.collective, c.phase)].append((c, exp))
    rows = []
    for (unit, coll, phase), items in groups.items():
        durs = [c.end - c.start for c, _ in items]
        comm = float(sum(durs))
        sizes = [c.bytes for c, _ in items]
        bytes_per_call = float(np.mean(sizes)) if sizes and all(b is not None for b in sizes) else None
        n = items[0][0].group_size
        f = busbw_factor(coll, n)
        busbw = None
        if bytes_per_call is not None and f is not None and comm > 0:
            busbw = bytes_per_call * len(items) * f / comm / 1e3  # bytes/µs → GB/s
        slacks = [c.need - c.end for c, _ in items if c.need is not None]
        rows.append(per_step_row(CommUnitRow(
            rank=rank, unit=unit, collective=coll, phase=phase, count=len(items), comm_us=comm,
            exposed_us=float(sum(exp for _, exp in items)), bytes_per_call=bytes_per_call, busbw_gbps=busbw,
            group_size=n, slack_us=float(np.mean(slacks)) if slacks else None,
            held_us=float(np.mean([max(0.0, s) for s in slacks])) if slacks else None,
            dtype=items[0][0].dtype), steps, (in_steps or {}).get((unit, coll, phase))))
    return rows


def per_step_row(row: CommUnitRow, steps: int, in_steps: Optional[tuple[int, float, float]] = None) -> CommUnitRow:
    """``row`` with its figures per complete step: calls, and communication and exposed ms (the row's calls and time
    inside the complete steps, ``in_steps`` = (calls, comm µs, exposed µs); without it its sums) divided by
    ``steps`` (the rank's complete profiled steps, at least 1). The one definition of a unit row's per-step
    figures."""
    n = max(1, int(steps))
    count, comm, exposed = in_steps if in_steps is not None else (row.count, row.comm_us, row.exposed_us)
    row.steps, row.count_per_step = n, count / n
    row.comm_ms_per_step, row.exposed_ms_per_step = comm / n / 1e3, exposed / n / 1e3
    return row


# ---------------------------------------------------------------- top level


def analyze_windows(windows: list[WindowTrace], ended: Optional[dict[int, float]] = None,
                    started: Optional[dict[int, float]] = None,
                    ranks: Optional[dict[int, int]] = None) -> OverlapSection:
    """The overlap section of ``windows`` (each rank's windows summed); ``files`` names them, in order. Windows
    of another job, without a rank among several, of a rank already read for the same steps, or started after their
    rank's run ended (``ended``, see ``trace.admit``) or ended before its records started (``started``) are left out
    and listed in ``skipped`` (``trace.admit``). ``ranks`` renumbers the traces' ranks (the process group's,
    distributedInfo.rank) as the run numbers them, where only some ranks train (``RunConfig.world_ranks``: ranks 1-2
    of 3 are the run's 0-1; read unrenumbered, a new-user trial's verdict had rows 0, 1, 2 and read the job on the
    wrong rank)."""
    if ranks:
        windows = [replace(w, rank=ranks.get(w.rank, w.rank)) for w in windows]
    kept, skipped = admit(windows, ended, started)
    kept, evaluation = training_windows(kept)
    with _gc_paused():  # tens of thousands of (call, exposure) pairs: no cycles, nothing for the GC to find
        result = _analyze_windows(kept)
    result.skipped = skipped
    result.evaluation_windows = evaluation
    return result


def evaluation_only(w: WindowTrace) -> bool:
    """Every complete step of the window ran forwards without a backward and no optimizer.step(): an evaluation's
    own profiler window."""
    return bool(w.steps) and all(n in w.nograd_forwards and n in w.steps_without_optimizer for n in w.steps)


def training_windows(windows: list[WindowTrace]) -> tuple[list[WindowTrace], dict[str, list[str]]]:
    """(the windows the training figures read, rank -> the files of its evaluation-only windows left out): a rank's
    evaluation-only windows go where it has a training window too (Lightning's PyTorchProfiler writes a window for
    validation_step beside training_step's: its validation batch read as a profiled step, "1 of 2 hold no
    optimizer.step(): prof.step() called per micro-batch" and the training step "7x the other profiled steps", a
    new-user trial); a rank with evaluation windows alone keeps them (a profiled evaluation is what there is)."""
    evaluating = [evaluation_only(w) for w in windows]
    training = {w.rank for w, e in zip(windows, evaluating) if not e}
    left: dict[str, list[str]] = {}
    kept = []
    for w, e in zip(windows, evaluating):
        if e and w.rank in training:
            left.setdefault(str(w.rank), []).append(Path(w.file).name)
        else:
            kept.append(w)
    return kept, left


def _sum_into(acc: dict[str, dict], rank: str, part: dict) -> None:
    """Adds one window's figures (``part``) to the rank's running totals."""
    tot = acc.setdefault(rank, dict.fromkeys(part, 0))
    for f, v in part.items():
        tot[f] += v


def _analyze_windows(windows: list[WindowTrace]) -> OverlapSection:
    per_rank: dict[str, OverlapRank] = {}
    sums: dict[str, dict[str, dict]] = {"copies": {}, "idle": {}, "blocking": {}, "breakdown": {}}
    calls: dict = defaultdict(list)
    in_steps: dict = defaultdict(dict)  # rank -> (unit, collective, phase) -> [calls, comm µs, exposed µs] in steps
    times: dict[str, dict] = defaultdict(dict)  # rank -> complete step -> µs, over its windows
    per_opt: dict[str, list] = {}  # rank -> its windows' backward passes per optimizer step
    for w in windows:
        times[str(w.rank)].update(w.step_us)
    odd = {k: atypical_steps(t) for k, t in times.items()}
    for w in sorted(windows, key=lambda w: (w.rank, w.file)):
        k = str(w.rank)
        o = overlap(w)
        pr = per_rank.setdefault(k, OverlapRank(device=w.device, step_times_ms={}, step_exposed_ms={},
                                                atypical_steps={}))
        pr.comm_calls += len(w.calls)
        pr.comm_calls_on_compute_stream += sum(1 for c in w.calls if c.on_compute_stream)
        pr.comm_us += o["comm_us"]
        pr.overlap_us += o["overlap_us"]
        pr.exposed_us += o["exposed_us"]
        pr.steps = sorted(set(pr.steps) | set(w.steps))
        pr.step_count += len(w.steps)
        pr.steps_left_out = {**pr.steps_left_out, **{str(n): why for n, why in w.steps_dropped.items()}}
        pr.step_times_ms.update({str(n): us / 1e3 for n, us in w.step_us.items()})
        pr.step_exposed_ms.update({str(n): us / 1e3 for n, us in step_exposed_us(w).items()})
        pr.atypical_steps.update({str(n): {p: round(us / 1e3, 4) for p, us in parts.items()}
                                  for n, parts in step_breakdowns(w, odd[k]).items()})
        pr.loop_comm_ms_per_step = (pr.loop_comm_ms_per_step or 0.0) + w.loop_comm_us / 1e3  # sums until divided
        pr.loop_comm_wait_ms_per_step = (pr.loop_comm_wait_ms_per_step or 0.0) + w.loop_comm_wait_us / 1e3
        pr.between_comm_ms_per_step = (pr.between_comm_ms_per_step or 0.0) + w.between_comm_us / 1e3
        if w.loader_us is not None:
            pr.dataloader_ms_per_step = (pr.dataloader_ms_per_step or 0.0) + w.loader_us / 1e3
        pr.driver = pr.driver or w.driver
        pr.fsdp_host_ms_per_step = (pr.fsdp_host_ms_per_step or 0.0) + w.fsdp_host_us / 1e3
        if w.roots_per_forward is not None:
            pr.roots_per_forward = max(pr.roots_per_forward or 0.0, w.roots_per_forward)
        pr.forward_prefetched = sorted(set(pr.forward_prefetched) | set(w.forward_prefetched))
        pr.nograd_forwards = {**pr.nograd_forwards, **{str(n): c for n, c in w.nograd_forwards.items()}}
        pr.steps_without_optimizer = sorted(set(pr.steps_without_optimizer) | set(w.steps_without_optimizer))
        pr.backwards_per_step = (pr.backwards_per_step or 0.0) + w.step_backwards  # (sums until divided)
        if w.backwards_per_optimizer_step is not None:
            per_opt.setdefault(k, []).append(w.backwards_per_optimizer_step)
        pr.comm_ms_on_compute_stream_per_step = ((pr.comm_ms_on_compute_stream_per_step or 0.0)
                                                 + on_compute_stream_us(w) / 1e3)
        if w.device_lag_us > 0:
            pr.device_lag_ms = max(pr.device_lag_ms or 0.0, round(w.device_lag_us / 1e3, 3))
        if w.device == "gpu":
            pr.device = "gpu"
        for name, fn in (("copies", copies), ("idle", idle), ("blocking", blocking), ("breakdown", breakdown)):
            _sum_into(sums[name], k, fn(w))
        if w.kernels:
            _sum_into(sums.setdefault("kernels", {}), k, w.kernels)
        calls[w.rank].extend(zip(w.calls, call_exposure(w).tolist()))
        for key, figures in row_time_in_steps(w).items():
            acc = in_steps[w.rank].setdefault(key, [0, 0.0, 0.0])
            for i, v in enumerate(figures):
                acc[i] += v
    for k, pr in per_rank.items():
        pr.comm_us, pr.overlap_us, pr.exposed_us = float(pr.comm_us), float(pr.overlap_us), float(pr.exposed_us)
        pr.overlap_pct = 100.0 * pr.overlap_us / pr.comm_us if pr.comm_us > 0 else None
        for f in ("loop_comm_ms_per_step", "loop_comm_wait_ms_per_step", "between_comm_ms_per_step",
                  "comm_ms_on_compute_stream_per_step", "fsdp_host_ms_per_step"):
            setattr(pr, f, getattr(pr, f) / pr.step_count if pr.step_count else None)
        if pr.dataloader_ms_per_step is not None:
            pr.dataloader_ms_per_step = round(pr.dataloader_ms_per_step / pr.step_count, 4) if pr.step_count else None
        pr.backwards_per_step = (round(pr.backwards_per_step / pr.step_count, 4) if pr.step_count and
                                 pr.backwards_per_step else None)
        pr.backwards_per_optimizer_step = float(np.median(per_opt[k])) if k in per_opt else None
        _per_step(pr, sums["breakdown"].get(k))
    rows = []
    for rank in sorted(calls):
        rows.extend(unit_rows(rank, calls[rank], steps=max(1, per_rank[str(rank)].step_count),
                              in_steps=in_steps[rank]))
    rows.sort(key=lambda r: (-r.exposed_us, r.rank, r.unit, r.collective, str(r.phase)))

    def typed(cls, name):
        return {k: cls(**{f: float(v) for f, v in d.items()}) for k, d in sums[name].items()}

    return OverlapSection(
        per_rank=per_rank, per_unit=rows, copies=typed(Copies, "copies"), idle=typed(DeviceIdle, "idle"),
        blocking={k: Blocking(count=int(d["count"]), us=float(d["us"])) for k, d in sums["blocking"].items()},
        breakdown=typed(Breakdown, "breakdown"), kernels=typed(KernelStats, "kernels") if "kernels" in sums else {},
        files=[w.file for w in windows], units=trace_unit_rows(windows), memory=trace_memory(windows))


def analyze_traces(path_or_paths, *, progress: Optional[Callable[[int, int], None]] = None,
                   workers: Optional[int] = None, ended: Optional[dict[int, float]] = None,
                   started: Optional[dict[int, float]] = None,
                   ranks: Optional[dict[int, int]] = None) -> OverlapSection:
    """Analyse Kineto traces: a file, a directory (searched recursively), or a list of either.

    Returns the overlap section (see the module docstring). Files that cannot be read are listed in ``skipped``
    (a :class:`~fsdp_doctor.report_sections.SkippedFile` each, with a one-line error); everything else is still
    analysed. ``ended`` and ``ranks``: those of :func:`analyze_windows`."""
    if isinstance(path_or_paths, (str, os.PathLike)):
        inputs = [Path(path_or_paths)]
    else:
        inputs = [Path(p) for p in path_or_paths]
    skipped: list[SkippedFile] = []
    files: list[Path] = []
    roots: dict[Path, Optional[Path]] = {}
    for p in inputs:
        unreadable: list = []
        try:
            found = find_trace_files(p, unreadable)
        except FileNotFoundError:
            skipped.append(SkippedFile(file=str(p), error="no such file or directory"))
            continue
        skipped.extend(SkippedFile(file=str(q), error=why) for q, why in unreadable)
        if not found and not unreadable:
            skipped.append(SkippedFile(file=str(p), error="no Kineto trace files (*.json, *.json.gz) found"))
        for f in found:
            if f not in roots:
                roots[f] = p if p.is_dir() else None
                files.append(f)
    if not files:
        return OverlapSection(skipped=skipped)
    common = Path(os.path.commonpath([str(f.parent) for f in files])) if len(files) > 1 else None
    empty_last: list = []
    windows, unread = load_windows(files, progress=progress, workers=workers,
                                   root=common if common is not None else roots[files[0]], empty_last=empty_last)
    result = analyze_windows(windows, ended, started, ranks)
    result.exit_windows, bad = exit_windows(empty_last, windows)
    result.skipped = skipped + unread + bad + result.skipped
    return result


def exit_windows(empty: list, windows: list[WindowTrace]) -> tuple[list[SkippedFile], list[SkippedFile]]:
    """Of the files whose one profiler step ran nothing (``empty``: (SkippedFile, trace.reader.EmptyLastStep)
    pairs), (those that are torch.profiler's window at its exit, those skipped): a file is the exit's where no
    window of its rank (of any, its rank unknown) holds that step or a later one; one before a rank's later
    windows is no exit's, and is skipped."""
    ends, bad = [], []
    for f, e in empty:
        later = any(n >= e.step for w in windows if e.rank is None or w.rank == e.rank for n in w.steps)
        if later:
            bad.append(f)
        else:
            ends.append(SkippedFile(file=f.file, error=f"nothing ran in its profiler step (#{e.step}): the window "
                                    "torch.profiler saves at its exit where its schedule was recording as the loop "
                                    "ended (the step the loop's last prof.step() began); not analysed"))
    return ends, bad


def gpu_overlap_pct(result: OverlapSection, rank) -> Optional[float]:
    """HTA-comparable overlap % for a rank: None unless the rank is a GPU rank with communication kernels."""
    pr = result.per_rank.get(str(rank))
    if pr is None or pr.device != "gpu":
        return None
    return pr.overlap_pct


