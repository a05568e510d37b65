"""Memory: categories over the step timeline (stacked, unit and phase on hover, capacity line), the breakdown
at the peak and the per-unit table. Built against the report's ``memory`` section; without it, a note."""

from __future__ import annotations

from fsdp_doctor.present.fmt import fmt_bytes

from .. import figures as F
from .common import Filters, graph, grid, kpi, note, section, table
from dash import html


def at_step(m: dict):
    return (m.get("peak_at") or {}).get("step")


def _pick_rank(per_rank: dict, flt: Filters):
    if flt.rank is not None:
        return str(flt.rank) if str(flt.rank) in per_rank else None
    if not per_rank:
        return None
    return max(per_rank, key=lambda r: per_rank[r].get("peak_bytes") or 0)


def layout(snap, flt: Filters) -> list:
    mem = run_mem = snap.report.get("memory")
    if not snap.has_records:
        return [note(f"No fsdp-doctor records in {snap.path} yet.", "warning", nid="empty-note")]
    if mem and mem.get("per_rank") and flt.window is not None:  # the same analysis over the selected steps
        mem = snap.sections(flt.window).get("memory")
        if not mem or not mem.get("per_rank"):
            return [note(f"No memory samples in steps {flt.window[0]}–{flt.window[1]}: widen the step window "
                         "(the memory probe leaves out step 0 when later steps exist).", "warning", nid="memory-absent")]
    if not mem or not mem.get("per_rank"):
        return [note("This report has no memory section: the run was recorded without the memory probe "
                     "(watch(memory=False), or an fsdp-doctor without memory tracking), or its memory analysis "
                     "found nothing to report. Step time, communication and units are on the other pages.",
                     "warning", nid="memory-absent")]
    per_rank = mem["per_rank"]
    key = _pick_rank(per_rank, flt)
    if key is None:
        return [note(f"No memory data for rank {flt.rank}.", "warning", nid="memory-absent")]
    m = per_rank[key]
    rank = int(key)
    cap = m.get("capacity_bytes") or (snap.report.get("run") or {}).get("capacity_bytes")
    where = f"steps {flt.window[0]}–{flt.window[1]}" if flt.window is not None else "the run"
    tl_m = m  # whose timeline (and per-unit activations) is drawn
    if not m.get("timeline") and run_mem is not mem:  # replayed steps only: their figures repeat a measured step
        tl_m = ((run_mem or {}).get("per_rank") or {}).get(key) or m
    tl_step = tl_m.get("timeline_step")
    if tl_m is not m:
        why = (f"step {tl_step}, measured in full: {where} were not (their figures replay the last measured step; "
               "watch(memory={'full_every': 1}) measures every step)")
    elif tl_step == at_step(m):
        why = f"step {tl_step}, the peak step of {where}"
    else:
        why = f"step {tl_step}, the measured step nearest to the peak step {at_step(m)} of {where}"
    picked = f"rank {rank}" + ("" if flt.rank is not None else f", the highest peak of {len(per_rank)} ranks")
    at = m.get("peak_at") or {}
    tiles = html.Div([
        kpi("Peak", fmt_bytes(m.get("peak_bytes")), f"step {at.get('step', '?')}, unit {F.unit_label(at.get('unit'))}, {at.get('phase', '?')}",
            kid="kpi-mem-peak"),
        kpi("Activations", fmt_bytes(m.get("activations_peak_bytes")), "their own peak in the step"),
        kpi("Steady state", fmt_bytes(sum((m.get("steady_bytes") or {}).values())) if m.get("steady_bytes") else "—",
            "between steps (params, grads, optimizer)"),
        kpi("Capacity", fmt_bytes(cap) if cap else "unknown",
            f"headroom {fmt_bytes(cap - m['peak_bytes'])}" if cap and m.get("peak_bytes") is not None else ""),
    ], className="kpis")
    out = [tiles,
           section(f"Memory over one step ({picked})",
                   *([note(f"Showing {why}.", "info" if tl_m is m else "warning", nid="mem-step-note")] if tl_step is not None else []),
                   graph(F.memory_timeline_figure(tl_m, None, cap, rank, categories=mem.get("categories")),
                         "fig-mem-timeline"), sid="sec-mem-timeline")]
    pu = [u for u in tl_m.get("per_unit") or [] if flt.unit is None or u.get("unit") == flt.unit]
    rows = [{"unit": F.unit_label(u.get("unit")), "sharded": fmt_bytes(u.get("sharded_bytes")),
             "unsharded": fmt_bytes(u.get("unsharded_bytes")), "activations": fmt_bytes(u.get("activation_bytes"))}
            for u in pu]
    out.append(grid(
        section("", graph(F.memory_breakdown_figure(m, rank), "fig-mem-breakdown")),
        section(f"Per unit (rank {rank})",
                table("tbl-mem-units", rows, [("unit", "unit"), ("sharded", "sharded params"), ("unsharded", "gathered params"),
                                              ("activations", "activations saved")], left=("unit",), page_size=15)
                if rows else note("No per-unit memory in the report.", "info")),
    ))
    return out
