"""TensorBoard presenter: the scalars of a run (one event per step and rank under ``tb/rank{R}``), written after the
fact from the pipeline's results. The live writer (``fsdp_doctor.record.tensorboard``, ``watch(tensorboard=True)``)
writes the same scalars with the same functions. Writing uses TensorBoard's own event writer; torch is not
imported (``fsdp-doctor tensorboard`` starts as fast as ``analyze``).

Tags (x axis = training step): ``step/wall_ms`` and its split ``step/forward_ms``, ``step/backward_ms``,
``step/optimizer_ms``, ``step/outside_ms``, ``step/gc_ms``; ``step/profiled``; ``memory/peak_mib`` and
``memory/<category>_mib`` at the step's peak (MiB = 2^20 bytes); ``overlap/overlap_pct``,
``overlap/exposed_comm_ms``, ``overlap/comm_ms`` on profiled steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Optional

from ..memory_categories import NAMES
from ..records import CudaMemory, MemoryStep, ProfileWindow, StepRecord
from ..store import layout

MIB = float(1 << 20)
STEP_FIELDS = ("wall_ms", "forward_ms", "backward_ms", "optimizer_ms", "outside_ms", "gc_ms")


def step_scalars(rec: StepRecord) -> dict[str, float]:
    """The scalars written for one step record (tag -> value)."""
    out = {f"step/{f}": float(getattr(rec, f)) for f in STEP_FIELDS}
    out["step/profiled"] = 1.0 if rec.profiled else 0.0
    out.update(memory_scalars(rec.memory))
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


def overlap_scalars(result: dict, rank: int) -> dict[int, dict[str, float]]:
    """Per analysed step of one trace window: overlap %, exposed and total communication (ms per step)."""
    per_rank = result.get("per_rank") or {}
    pr = per_rank.get(str(rank))
    if pr is None and len(per_rank) == 1:
        pr = next(iter(per_rank.values()))
    if pr is None or not pr.get("steps"):
        return {}
    n = len(pr["steps"])
    vals: dict[str, float] = {"overlap/exposed_comm_ms": pr["exposed_us"] / 1e3 / n,
                              "overlap/comm_ms": pr["comm_us"] / 1e3 / n}
    if pr.get("overlap_pct") is not None:
        vals["overlap/overlap_pct"] = float(pr["overlap_pct"])
    return {int(s): dict(vals) for s in pr["steps"]}


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


def step_walltime(rec: StepRecord) -> Optional[float]:
    return (rec.start_ns + rec.wall_ms * 1e6) / 1e9 if rec.start_ns else None


def export_tensorboard(run, out: Path | str | None = None, *, traces: bool = True) -> list[Path]:
    """Writes the scalars of a recorded :class:`~fsdp_doctor.store.Run` to ``<out>/tb/rank{R}`` (``out`` defaults
    to the run directory); the overlap of each profiled window comes from the pipeline (one window at a time, so
    each window's steps get that window's figures). Returns the directories written."""
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    out = Path(out) if out is not None else Path(run.path)
    written = []
    for rank, rd in sorted(run.ranks.items()):
        if not rd.steps and not rd.profiles:
            continue
        d = layout.tb_dir(out, rank)
        w = EventFileWriter(str(d), max_queue_size=1000)
        try:
            walltime = {}
            for rec in rd.steps:
                walltime[rec.step] = step_walltime(rec)
                add_scalars(w, step_scalars(rec), rec.step, walltime[rec.step])
            if traces:
                for step, vals in sorted(window_overlap_scalars(run, rank, _profiles(run, rd.profiles)).items()):
                    add_scalars(w, vals, step, walltime.get(step))
        finally:
            w.close()
        written.append(d)
    return written


def window_overlap_scalars(run, rank: int, paths: Iterable[Path]) -> dict[int, dict[str, float]]:
    """Overlap scalars per profiled step of ``rank``, each window analysed by the pipeline on its own."""
    from ..pipeline import trace_section
    from ..trace import load_window

    out: dict[int, dict[str, float]] = {}
    for p in paths:
        w = load_window(str(p))
        if not hasattr(w, "calls"):
            continue  # unreadable: `fsdp-doctor analyze` names it
        out.update(overlap_scalars(trace_section(run, windows=[w]) or {}, rank))
    return out


def _profiles(run, profiles: Iterable[ProfileWindow]) -> list[Path]:
    root = Path(run.path).resolve()
    out = []
    for pw in profiles:
        p = (Path(run.path) / pw.path).resolve()
        if p.is_relative_to(root) and p.exists():
            out.append(p)
    return out
