"""Memory: categories over the step timeline (stacked, unit and phase on hover, capacity line), the breakdown
at the peak and the per-unit table. Built against the report's ``memory`` section; without it, a note. A
category this torch could not measure is named "unknown", never drawn as a measured 0."""

from __future__ import annotations

from typing import Optional

from fsdp_doctor.memory_categories import label
from fsdp_doctor.present.fmt import fmt_bytes, memory_unit_cells
from fsdp_doctor.report_sections import MemoryRank, MemorySection

from fsdp_doctor.present import figures as F
from .common import Filters, graph, grid, kpi, note, section, table
from dash import html


def _pick_rank(per_rank: dict[str, MemoryRank], flt: Filters) -> Optional[str]:
    if flt.rank is not None:
        return str(flt.rank) if str(flt.rank) in per_rank else None
    if not per_rank:
        return None
    return max(per_rank, key=lambda r: per_rank[r].peak_bytes)


def unknown_note(m: MemoryRank, rank: int) -> list:
    """A note naming the categories this torch could not measure on the rank (the terminal's "unknown")."""
    unknown = F.unknown_categories(m)
    if not unknown:
        return []
    return [note(f"Not measured on rank {rank}: {', '.join(label(c) for c in unknown)} ({F.NOT_MEASURED}); "
                 "shown as unknown, their 0 is no figure.", "warning", nid="mem-unknown-note")]


def layout(snap, flt: Filters) -> list:
    mem = run_mem = snap.report.memory
    if not snap.has_records:
        trace_mem = snap.report.memory_section()
        if trace_mem is None or not trace_mem.per_rank:
            return [note(f"No fsdp-doctor records in {snap.path} yet, and its profiler traces carry no memory events "
                         "(torch.profiler.profile(profile_memory=True) writes them).", "warning", nid="empty-note")]
        return _trace_layout(trace_mem, flt)
    if mem and mem.per_rank and flt.window is not None:  # the same analysis over the selected steps
        mem = snap.sections(flt.window).memory
        if not mem or not mem.per_rank:
            return [note(f"No memory samples in steps {flt.window[0]}–{flt.window[1]}: widen the step window "
                         "(the memory probe leaves out step 0 when later steps exist).", "warning", nid="memory-absent")]
    if not mem or not mem.per_rank:
        return [note("This report has no memory section: the run was recorded without the memory probe "
                     "(watch(memory=False), or an fsdp-doctor without memory tracking), or its memory analysis "
                     "found nothing to report. Step time, communication and units are on the other pages.",
                     "warning", nid="memory-absent")]
    per_rank = mem.per_rank
    key = _pick_rank(per_rank, flt)
    if key is None:
        return [note(f"No memory data for rank {flt.rank}.", "warning", nid="memory-absent")]
    m = per_rank[key]
    rank = int(key)
    cap = m.capacity_bytes or snap.report.run.capacity_bytes or None  # UNSET (no configuration record): unknown
    where = f"steps {flt.window[0]}–{flt.window[1]}" if flt.window is not None else "the run"
    tl_m = _timeline_rank(m, run_mem, mem, key)  # whose timeline (and per-unit activations) is drawn
    tl_step = tl_m.timeline_step
    if tl_m is not m:
        why = (f"step {tl_step}, measured in full: {where} were not (their figures replay the last measured step; "
               "watch(memory={'full_every': 1}) measures every step)")
    elif tl_step == m.peak_at.step:
        why = f"step {tl_step}, the peak step of {where}"
    else:
        why = f"step {tl_step}, the measured step nearest to the peak step {m.peak_at.step} of {where}"
    picked = f"rank {rank}" + ("" if flt.rank is not None else f", the highest peak of {len(per_rank)} ranks")
    at = m.peak_at
    # the steps picked replay a measured step, drawn below: the cards say so, and the steady state (what every step
    # starts with) is that step's (?steps=9-11 read "—" there, 1.33 MiB without the filter, and a peak at "step 9"
    # beside a curve of step 2: a new-user trial)
    drawn = f" (replayed; the curve is step {tl_step}'s)" if tl_m is not m else ""
    steady = m.steady_bytes or tl_m.steady_bytes
    tiles = html.Div([
        kpi("Peak", fmt_bytes(m.peak_bytes),
            f"step {_or_q(at.step)}{drawn}, unit {F.unit_label(at.unit)}, {_or_q(at.phase)}", kid="kpi-mem-peak"),
        kpi("Activations", fmt_bytes(m.activations_peak_bytes), "their own peak in the step"),
        kpi("Steady state", fmt_bytes(sum(steady.values())) if steady else "—",
            "kept between steps: what a step starts with, before its forward"
            + (f" (step {tl_step}'s, the curve's)" if steady is not m.steady_bytes else ""), kid="kpi-mem-steady"),
        kpi("Capacity", fmt_bytes(cap) if cap else "unknown", f"headroom {fmt_bytes(cap - m.peak_bytes)}" if cap else ""),
    ], className="kpis")
    out = [tiles, *unknown_note(m, rank),
           section(f"Memory over one step ({picked})",
                   *([note(f"Showing {why}.", "info" if tl_m is m else "warning", nid="mem-step-note")] if tl_step is not None else []),
                   graph(F.memory_timeline_figure(tl_m, None, cap, rank, categories=mem.categories),
                         "fig-mem-timeline"), sid="sec-mem-timeline")]
    out.append(section("Memory per step", graph(F.memory_per_step_figure(snap.steps, flt.ranks, flt.window),
                                                "fig-mem-steps"), sid="sec-mem-steps"))
    pu = [u for u in tl_m.per_unit if flt.unit is None or u.unit == flt.unit]
    keys = ("unit", "sharded", "unsharded", "act_own", "activations")  # MEMORY_UNITS_HEADER's columns, as the terminal
    rows = [dict(zip(keys, memory_unit_cells(u))) for u in pu]
    out.append(grid(
        section("", graph(F.memory_breakdown_figure(m, rank), "fig-mem-breakdown")),
        section(f"Per unit (rank {rank})",
                table("tbl-mem-units", rows, [("unit", "unit"), ("sharded", "sharded params"), ("unsharded", "gathered params"),
                                              ("act_own", "activations saved (own)"),
                                              ("activations", "activations saved (incl. nested)")],
                      left=("unit",), page_size=15)
                if rows else note("No per-unit memory in the report.", "info")),
    ))
    return out


def _trace_layout(mem: MemorySection, flt: Filters) -> list:
    """A plain trace's memory: per rank the allocator's peak over the complete steps and that step's curve."""
    key = _pick_rank(mem.per_rank, flt)
    if key is None:
        return [note(f"No memory data for rank {flt.rank}.", "warning", nid="memory-absent")]
    m, rank = mem.per_rank[key], int(key)
    at = m.peak_at
    picked = f"rank {rank}" + ("" if flt.rank is not None else f", the highest peak of {len(mem.per_rank)} ranks")
    rows = [{"rank": r, "peak": fmt_bytes(x.peak_bytes), "step": _or_q(x.peak_at.step),
             "at": f"{x.peak_at.t_ms:.1f} ms" if x.peak_at.t_ms is not None else "?",
             "where": f"{F.unit_label(x.peak_at.unit)} {x.peak_at.phase or ''}".strip(), "steps": x.steps}
            for r, x in sorted(mem.per_rank.items(), key=lambda kv: int(kv[0]))]
    return [
        note(f"From the profiler traces ({mem.source}), over the complete steps: the allocator's total, no "
             "categories (those need a run recorded with fsdp_doctor.watch(...)).", "info", nid="trace-memory-note"),
        html.Div([kpi("Peak allocated", fmt_bytes(m.peak_bytes),
                      f"{picked}: step {_or_q(at.step)}, unit {F.unit_label(at.unit)}, {_or_q(at.phase)}",
                      kid="kpi-mem-peak")], className="kpis"),
        section(f"Memory over step {m.timeline_step} ({picked})",
                graph(F.memory_timeline_figure(m, None, None, rank, categories=mem.categories), "fig-mem-timeline"),
                sid="sec-mem-timeline"),
        section("Peak per rank", table("tbl-mem-ranks", rows, [("rank", "rank"), ("peak", "peak allocated"),
                                                                ("step", "step"), ("at", "into the step"),
                                                                ("where", "unit, phase"), ("steps", "steps")],
                                       left=("where",), page_size=16)),
    ]


def _timeline_rank(m: MemoryRank, run_mem: Optional[MemorySection], mem: MemorySection, key: str) -> MemoryRank:
    """The rank's figures whose timeline is drawn: the window's own, or, where the window holds replayed steps
    only (their figures repeat a measured step), the whole run's."""
    if m.timeline or run_mem is mem or run_mem is None:
        return m
    return run_mem.per_rank.get(key) or m


def _or_q(v) -> str:
    """A figure of the peak's place, "?" where it is not known."""
    return "?" if v is None else str(v)
