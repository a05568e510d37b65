"""Communication: per rank a timeline of compute vs all-gather / reduce-scatter in a profiled step, per-unit
exposed vs overlapped communication, and all-gather prefetch slack per unit."""

from __future__ import annotations

import statistics

from dash import html

from fsdp_doctor.present.fmt import fmt_bytes, fmt_ms, unit_exposed_note
from fsdp_doctor.report_sections import CommUnitRow, OverlapSection

from fsdp_doctor.present import figures as F
from .common import Filters, fmt_value, graph, grid, kpi, note, run_state, section, table


_TIMELINES: dict[int, tuple] = {}


def _timeline(win) -> dict:
    """Timeline data per window; the state caches WindowTrace objects per file, so identity is stable."""
    hit = _TIMELINES.get(id(win))
    if hit is None or hit[0] is not win:
        if len(_TIMELINES) > 256:
            _TIMELINES.clear()
        hit = _TIMELINES[id(win)] = (win, F.window_timeline_data(win))
    return hit[1]


def pick_windows(windows: list, flt: Filters) -> tuple[list, bool]:
    """Per selected rank, the first profiled window that lies in the step window (else the rank's first), and
    whether every window picked lies in the step window."""
    out = {}
    for w in windows:
        if flt.rank is not None and w.rank != flt.rank:
            continue
        inside = flt.window is None or any(flt.window[0] <= s <= flt.window[1] for s in w.steps)
        cur = out.get(w.rank)
        if cur is None or (inside and not cur[0]):
            out[w.rank] = (inside, w)
    return [w for _, (_, w) in sorted(out.items())], all(i for i, _ in out.values())


def shown_steps_note(wins: list, inside: bool, flt: Filters) -> str:
    """Which profiled step the timeline shows, and why."""
    steps = sorted({s for w in wins for s in w.steps})
    if not steps:
        return ""
    shown = ("step " if len(steps) == 1 else "steps ") + ", ".join(map(str, steps))
    if flt.window is None:
        return f"Showing profiled {shown}: the first profiled window of the run."
    sel = f"steps {flt.window[0]}–{flt.window[1]}"
    if inside:
        return f"Showing profiled {shown}: the first profiled window inside {sel}."
    return (f"Showing profiled {shown}, outside the selected {sel}: no profiled window lies inside them "
            "(the profiler records only a few steps; widen the window to include one).")


def unit_row(r: CommUnitRow) -> dict:
    """One row of the collectives table: display strings, and the raw numbers (``*_v``) they sort by."""
    return {"rank": r.rank, "unit": F.unit_label(r.unit), "collective": r.collective, "phase": r.phase or "—",
            "count": r.count, "comm": fmt_ms(r.comm_us / 1e3), "exposed": fmt_ms(r.exposed_us / 1e3),
            "bytes": fmt_bytes(r.bytes_per_call), "busbw": fmt_value("busbw_gbps", r.busbw_gbps),
            "slack": fmt_ms(r.slack_us / 1e3) if r.slack_us is not None else "—",
            "comm_v": r.comm_us, "exposed_v": r.exposed_us, "bytes_v": r.bytes_per_call,
            "busbw_v": r.busbw_gbps, "slack_v": r.slack_us}


def layout(snap, flt: Filters) -> list:
    ov = snap.report.overlap
    if not snap.windows and ov is None:
        if snap.traces_pending:
            msg = "Analysing the profiler traces …"
        elif snap.trace_errors:  # the traces are there: say why none could be used
            return [note(f"{len(snap.trace_errors)} Kineto trace file(s) found, none could be analysed:", "error",
                         nid="comm-absent"), html.Ul([html.Li(e) for e in snap.trace_errors], id="comm-trace-errors")]
        elif (state := run_state(snap.report, snap.updated)) != "live":  # none will come: say so, and why
            msg = (f"No Kineto traces in this run ({state}): communication is measured from the profiler windows "
                   f"({snap.path}/profiler/rank*.pt.trace.json.gz), which this run did not write: "
                   + ("watch(profile=False), or it ended before its first window."
                      if snap.has_records else "nothing recorded."))
        else:
            msg = ("No Kineto traces in this run yet: communication is measured from the profiler windows "
                   f"({snap.path}/profiler/rank*.pt.trace.json.gz), written after the first profiled steps.")
        return [note(msg, "warning", nid="comm-absent")]
    ov = ov or OverlapSection()  # the windows are still being analysed
    per_rank = ov.per_rank
    keys = [str(flt.rank)] if flt.rank is not None else sorted(per_rank, key=int)
    sel = [per_rank[k] for k in keys if k in per_rank]
    per_unit = ov.per_unit
    prof = sorted({s for p in sel for s in p.steps})
    who = (f"sum over {len(sel)} ranks" if len(sel) > 1 else f"rank {keys[0]}" if sel else "no rank") + \
        (f", profiled step{'s' * (len(prof) > 1)} {', '.join(map(str, prof))}" if prof else ", profiled windows")
    per_step = [p for p in sel if p.comm_ms_per_step is not None and p.exposed_ms_per_step is not None]
    if flt.unit is None and per_step and len(per_step) == len(sel):
        # per complete step, the median over the ranks: the report's headline figure, as the terminal and the
        # Overview give it (the sum over ranks of whole windows read 61.3 ms beside the headline's 30.6 ms per step,
        # "one figure, one definition everywhere": a new-user trial)
        comm = 1e3 * statistics.median(p.comm_ms_per_step for p in per_step)
        ovl = comm - 1e3 * statistics.median(p.exposed_ms_per_step for p in per_step)
        who = (f"per step, median over {len(sel)} ranks" if len(sel) > 1 else f"per step, rank {keys[0]}") + \
            (f", profiled step{'s' * (len(prof) > 1)} {', '.join(map(str, prof))}" if prof else "")
    elif flt.unit is None:
        comm = sum(p.comm_us for p in sel)
        ovl = sum(p.overlap_us for p in sel)
    else:  # the selected unit's collectives only (the per-unit attribution of the same windows)
        mine = [r for r in per_unit if r.unit == flt.unit and (flt.rank is None or r.rank == flt.rank)]
        comm = sum(r.comm_us for r in mine)
        ovl = comm - sum(r.exposed_us for r in mine)
        who = f"unit {F.unit_label(flt.unit)}, {who}"
    blk = sum(ov.blocking[k].us for k in keys if k in ov.blocking)
    if flt.unit is None and per_step and len(per_step) == len(sel) and blk:  # per step, median over the ranks as
        # the tiles beside it (their sum over 2 ranks read 37.5 ms beside a median's 18.7: a new-user trial)
        blk = statistics.median(ov.blocking[k].us / max(1, per_rank[k].step_count or len(per_rank[k].steps))
                                if k in ov.blocking else 0.0 for k in keys if k in per_rank)
    cp = sum(ov.copies[k].exposed_us for k in keys if k in ov.copies)
    tiles = html.Div([
        kpi("Communication", fmt_ms(comm / 1e3), who, kid="kpi-comm-total"),
        kpi("Overlapped", f"{100 * ovl / comm:.0f}%" if comm else "—", f"{fmt_ms(ovl / 1e3)} under compute", kid="kpi-comm-overlap"),
        kpi("Exposed", fmt_ms((comm - ovl) / 1e3), "compute waited", kid="kpi-comm-exposed"),
        kpi("Host blocked in all-gather", fmt_ms(blk / 1e3), "gloo: host sat in the collective" +
            ("" if flt.unit is None else " (all units: not split per unit)"), kid="kpi-comm-blocked") if blk else
        kpi("Exposed copies", fmt_ms(cp / 1e3), "H2D / D2H not under compute"),
    ], className="kpis")
    wins, inside = pick_windows(snap.windows, flt)
    why = shown_steps_note(wins, inside, flt)
    out = [tiles,
           section("Timeline", *([note(why, "info" if inside else "warning", nid="comm-step-note")] if why else []),
                   graph(F.comm_timeline_figure([_timeline(w) for w in wins], flt.unit), "fig-comm-timeline"),
                   sid="sec-comm-timeline")]
    out.append(grid(
        section("", graph(F.unit_exposure_figure(per_unit, flt.ranks, flt.unit), "fig-unit-exposure")),
        section("", graph(F.prefetch_slack_figure(per_unit, flt.ranks, flt.unit), "fig-prefetch-slack")),
    ))
    rows = [unit_row(r) for r in per_unit if (flt.rank is None or r.rank == flt.rank) and (flt.unit is None or r.unit == flt.unit)]
    gloo = unit_exposed_note(ov, flt.rank)
    out.append(section("Collectives per unit", *([note(gloo, nid="comm-units-gloo")] if gloo else []),
                       table("tbl-comm-units", rows, [("rank", "rank"), ("unit", "unit"), ("collective", "collective"),
                                                      ("phase", "phase"), ("count", "calls"), ("comm", "time"),
                                                      ("exposed", "exposed"), ("bytes", "bytes / call"),
                                                      ("busbw", "bus bandwidth"), ("slack", "slack")],
                             left=("unit", "collective", "phase"), page_size=15,
                             sort_keys={c: c + "_v" for c in ("comm", "exposed", "bytes", "busbw", "slack")})))
    if snap.trace_errors:  # the windows shown are not all there are
        out.insert(0, note(f"{len(snap.trace_errors)} Kineto trace file(s) could not be analysed: "
                           + "; ".join(snap.trace_errors[:3]) + (" …" if len(snap.trace_errors) > 3 else ""),
                           "warning", nid="comm-trace-errors"))
    if snap.traces_pending:
        out.insert(0, note(f"Analysing {snap.traces_pending} more trace file(s) …", "info"))
    return out
