"""Steps: step time per rank over steps, jitter, the rank × step heatmap, outliers with their causes and
stragglers."""

from __future__ import annotations

from dash import html

from fsdp_doctor.present.fmt import apart_texts, fmt_ms
from fsdp_doctor.report_sections import StepsSection

from fsdp_doctor.present import figures as F
from .common import Filters, graph, grid, note, section, table


def layout(snap, flt: Filters) -> list:
    steps = snap.steps
    if not snap.has_records:
        if not steps:
            return [note(f"No fsdp-doctor records in {snap.path} yet, and no complete ProfilerStep in its traces.",
                         "warning", nid="empty-note")]
        return _trace_layout(snap, flt)
    sec = snap.report.steps or StepsSection()
    win_sec = snap.sections(flt.window).steps or sec  # stragglers over the selected steps
    ranks = flt.ranks
    phase_rank = flt.rank if flt.rank is not None else min(steps, default=0)
    out = [
        section("Step time", graph(F.step_time_figure(steps, ranks, flt.window, shift=sec.level_shift),
                                   "fig-step-time"), sid="sec-step-time"),
        grid(section("", graph(F.step_heatmap(steps, ranks, flt.window), "fig-step-heatmap")),
             section("", graph(F.jitter_histogram(steps, ranks, flt.window), "fig-jitter"))),
        section("", graph(F.phase_split_figure(steps, phase_rank, flt.window), "fig-phases")),
    ]
    out += [note(line, "info", nid=f"{key}-note") for key, line in apart_texts(sec)]
    outs = [o for o in sec.outliers
            if (flt.rank is None or o.rank == flt.rank)
            and (flt.window is None or flt.window[0] <= o.step <= flt.window[1])]
    rows = [{"rank": o.rank, "step": o.step, "ms": fmt_ms(o.ms), "median": fmt_ms(o.median_ms),
             "excess": fmt_ms(o.excess_ms), "cause": o.cause, "detail": o.detail}
            for o in outs]
    out.append(section(f"Outlier steps ({len(rows)})",
                       table("tbl-outliers", rows, [("rank", "rank"), ("step", "step"), ("ms", "time"), ("median", "rank median"),
                                                    ("excess", "excess"), ("cause", "cause"), ("detail", "likely cause")],
                             left=("cause", "detail"), page_size=10)
                       if rows else note("No outlier steps in this selection.", "ok"), sid="sec-outliers"))
    strag = [s for s in win_sec.stragglers if flt.rank is None or s.rank == flt.rank]
    items = [html.Li(f"rank {s.rank} spends +{s.excess_ms_per_step:.1f} ms/step in {s.phase} "
                     f"({s.steps_slower} of {s.steps} steps)") for s in strag]
    out.append(section("Stragglers", html.Ul(items) if items else note("No straggler rank.", "ok"), sid="sec-stragglers"))
    return out


def _trace_layout(snap, flt: Filters) -> list:
    """A plain-trace folder: the complete ``ProfilerStep``s' wall times (``report.trace_steps``' figures); phases,
    outliers and stragglers need records."""
    steps, ranks = snap.steps, flt.ranks
    return [
        note("From the profiler traces' complete ProfilerStep markers (each step from its start to the next's); "
             "step phases, outliers and stragglers need a run recorded with fsdp_doctor.watch(...).", "info",
             nid="trace-steps-note"),
        section("Step time", graph(F.step_time_figure(steps, ranks, flt.window), "fig-step-time"), sid="sec-step-time"),
        grid(section("", graph(F.step_heatmap(steps, ranks, flt.window), "fig-step-heatmap")),
             section("", graph(F.jitter_histogram(steps, ranks, flt.window), "fig-jitter"))),
    ]
