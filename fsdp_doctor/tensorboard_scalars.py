"""The TensorBoard scalars of a run, one definition for both writers: the live one (``fsdp_doctor.record.tensorboard``,
``watch(tensorboard=True)``) and the after-the-fact export (``fsdp_doctor.present.tensorboard``, ``fsdp-doctor
tensorboard``). Which tags exist, how a step record or a profiled window becomes scalars, and how one step's
scalars become one event. Imports neither torch nor a presenter.

Tags (x axis = training step): ``step/wall_ms`` and its split ``step/forward_ms``, ``step/backward_ms``,
``step/optimizer_ms``, ``step/outside_ms``, ``step/gc_ms``; ``step/no_grad_ms`` (steps that evaluated);
``step/checkpoint_ms`` (steps that saved a checkpoint); ``step/profiled``; ``step/doctor_step`` (1 on the doctor's own
steps: a profiler window, a memory count op by op); ``memory/peak_mib`` and
``memory/<category>_mib`` at the step's peak (MiB = 2^20 bytes; a category from its first non-zero value on);
``overlap/overlap_pct``, ``overlap/exposed_comm_ms``, ``overlap/comm_ms`` on the steps of each profiled window (the
report's per-step figures of that window).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

from .memory_categories import NAMES
from .records import CudaMemory, MemoryStep, StepRecord, doctor_step
from .report_sections import OverlapSection

MIB = float(1 << 20)
STEP_FIELDS = ("wall_ms", "forward_ms", "backward_ms", "optimizer_ms", "outside_ms", "gc_ms")


def step_scalars(rec: StepRecord, seen: Optional[set] = None) -> dict[str, float]:
    """The scalars written for one step record (tag -> value). With ``seen`` (the memory tags that were non-zero
    at an earlier step of this writer, updated here), a memory category is written only from its first non-zero
    value on: a category that stays 0 for the whole run (no CPU offload, no temporaries on CPU) draws no flat
    chart, and one that falls back to 0 still shows it."""
    out = {f"step/{f}": float(getattr(rec, f)) for f in STEP_FIELDS}
    out["step/profiled"] = 1.0 if rec.profiled else 0.0
    # the doctor's own steps, which the report's step statistics leave out with the first step (a step whose memory
    # was counted op by op read 0 in step/profiled: a new-user trial's median of the others was not the report's)
    out["step/doctor_step"] = 1.0 if doctor_step(rec) else 0.0
    if rec.no_grad_ms:  # the model's forward passes without gradients (evaluation) in this step
        out["step/no_grad_ms"] = float(rec.no_grad_ms)
    if rec.checkpoint_ms:  # checkpoint saves in this step
        out["step/checkpoint_ms"] = float(rec.checkpoint_ms)
    mem = memory_scalars(rec.memory)
    if seen is not None:
        seen.update(t for t, v in mem.items() if v)
        mem = {t: v for t, v in mem.items() if t in seen}
    out.update(mem)
    return out


def memory_tags() -> tuple[str, ...]:
    """Every memory tag :func:`memory_scalars` can write: derived from the categories and ``CudaMemory``'s byte
    fields, so a figure the recorder writes is never dropped and nothing it does not write is listed."""
    return ("memory/peak_mib", *(f"memory/{c}_mib" for c in NAMES),
            *(_cuda_tag(k) for k in CudaMemory.BYTE_FIELDS))


def _cuda_tag(field: str) -> str:
    return f"memory/cuda_{field.removesuffix('_bytes')}_mib"


def memory_scalars(mem: Optional[MemoryStep]) -> dict[str, float]:
    """Memory by category at the step's peak, in MiB, from ``StepRecord.memory`` (see fsdp_doctor.record.memory)."""
    if mem is None:
        return {}
    out: dict[str, float] = {}
    peak = mem.peak
    if peak is not None:
        if _num(peak.bytes):
            out["memory/peak_mib"] = peak.bytes / MIB
        for cat, v in peak.breakdown.items():
            if _num(v):
                out[f"memory/{cat}_mib"] = v / MIB
    if _num(mem.offloaded_host):
        out["memory/offloaded_host_mib"] = mem.offloaded_host / MIB
    if mem.cuda is not None:
        for k in CudaMemory.BYTE_FIELDS:
            v = getattr(mem.cuda, k)
            if _num(v):
                out[_cuda_tag(k)] = v / MIB
    return out


def overlap_scalars(section: Optional[OverlapSection], rank: int,
                    window_steps: Iterable[int] = ()) -> dict[int, dict[str, float]]:
    """The per-step figures of one trace window (``section``: the pipeline's overlap section of that window; the
    report's ``OverlapRank.*_per_step``: exposed and total communication in ms per complete step, and the share
    of it overlapped), at each step of the window: its complete steps and ``window_steps`` (the steps the
    window recorded, its last cut one included), so that even a one-window run draws a line, not a lone point
    TensorBoard does not show. A window holding one rank counts for ``rank``."""
    per_rank = section.per_rank if section is not None else {}
    pr = per_rank.get(str(rank))
    if pr is None and len(per_rank) == 1:
        pr = next(iter(per_rank.values()))
    if pr is None or pr.exposed_ms_per_step is None:
        return {}
    vals: dict[str, float] = {"overlap/exposed_comm_ms": float(pr.exposed_ms_per_step),
                              "overlap/comm_ms": float(pr.comm_ms_per_step)}
    if pr.step_overlap_pct is not None:
        vals["overlap/overlap_pct"] = float(pr.step_overlap_pct)
    return {int(s): dict(vals) for s in sorted({*pr.steps, *window_steps})}


def window_overlap_scalars(rank: int, windows: Iterable, failed: Optional[list] = None) -> dict[int, dict[str, float]]:
    """Overlap scalars per profiled step of ``rank``, each window analysed by the trace engine on its own (so each
    window's steps get that window's figures; no report is built). ``windows``: (trace path, the window's steps)
    pairs; a window that cannot be decoded is left out, and added to ``failed`` as (its path, why)."""
    from .trace import analyze_windows, load_window

    out: dict[int, dict[str, float]] = {}
    for p, steps in windows:
        w = load_window(str(p))
        if not hasattr(w, "calls"):
            if failed is not None:
                failed.append((p, w))
            continue
        out.update(overlap_scalars(analyze_windows([w]), rank, steps))
    return out


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def add_scalars(writer, values: dict[str, float], step: int, walltime: Optional[float]) -> None:
    """One event holding every scalar of a step, built straight as a Summary proto (~1 µs a value instead of
    ~30 µs through ``SummaryWriter.add_scalar``). ``writer`` has ``add_event`` (TensorBoard's EventFileWriter)."""
    import time

    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary

    summary = Summary(value=[Summary.Value(tag=t, simple_value=float(v)) for t, v in values.items()])
    writer.add_event(Event(summary=summary, step=int(step), wall_time=time.time() if walltime is None else walltime))


def step_walltime(rec: StepRecord, next_start_ns: Optional[int] = None) -> Optional[float]:
    """The step's wall-clock end (s since the epoch), or None when the record has no start time; never after the
    next step's start (``next_start_ns``: records written before the recorder's fix started a step that exported a
    profiler window after the export, while its ``wall_ms`` counts it, so its end fell after the next step's)."""
    if not rec.start_ns:
        return None
    end = rec.start_ns + rec.wall_ms * 1e6
    return (min(end, next_start_ns) if next_start_ns else end) / 1e9


def step_walltimes(records: Iterable[StepRecord]) -> dict[int, Optional[float]]:
    """Each step's wall-clock end (see :func:`step_walltime`), in step order: increasing with the step."""
    recs = sorted(records, key=lambda r: r.step)
    return {r.step: step_walltime(r, recs[i + 1].start_ns if i + 1 < len(recs) else None)
            for i, r in enumerate(recs)}
