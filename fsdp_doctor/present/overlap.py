"""Terminal rendering of the trace section (``overlap``) of the report (rich). Formatting only."""

from __future__ import annotations

from typing import Iterable

from rich.console import Group
from rich.text import Text

from ..report_sections import CommUnitRow, OverlapSection
from .fit import Col, fitted_table
from .fmt import (MISSING, OVERLAP_RANKS_HEADER, OVERLAP_RANKS_TITLE, comm_units_title, fmt_bw,  # one convention: fmt.py
                  fmt_bytes, fmt_ms, fmt_us, overlap_rank_rows, short_unit_labels, slack_note,
                  unit_exposed_note)

TOP_UNITS = 15
_COLL = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "broadcast": "BC",
         "send_recv": "SR", "all_to_all": "A2A"}
# (a phase not here was cut to its first 3 letters: a gradient norm's all-reduce read "AR gra", a new-user trial)
_PHASE = {"forward": "fwd", "backward": "bwd", "grad_norm": "norm", "model": "model"}


def _rank_table(sec: OverlapSection, width: int):
    """Per rank, per complete profiled step (fmt.overlap_rank_rows, the HTML's too), the overlap % coloured."""
    drops = {"dev": 3, "steps": 2, "hidden": 1, "overlap": 1, "blocked AG": 2, "copies exp.": 3}
    cols = [Col(h, drop=drops.get(h, 0)) for h in OVERLAP_RANKS_HEADER]
    rows, at = [], OVERLAP_RANKS_HEADER.index("overlap")
    for rank, row in zip(sorted(sec.per_rank, key=int), overlap_rank_rows(sec)):
        pct = sec.per_rank[rank].overlap_pct
        style = "red" if pct is not None and pct < 20 else ("yellow" if pct is not None and pct < 60 else "green")
        rows.append((*row[:at], Text(row[at], style=style if pct is not None else ""), *row[at + 1:]))
    return fitted_table(OVERLAP_RANKS_TITLE, cols, rows, width)


def _unit_table(rows: list[CommUnitRow], top: int, width: int, names: Iterable[str] = ()):
    """``names``: every unit's name the run knows (the trace's unit rows), so a label is unambiguous among all the
    units, not only among those with collectives in this table (an MoE's ``experts.2`` of one layer read as if the
    only one: a new-user trial)."""
    shown = rows[:top]
    title = comm_units_title(rows, top)
    labels = short_unit_labels([*(r.unit for r in rows), *names])
    cols = [Col("rank"), Col("unit", justify="left", wrap=True), Col("op", justify="left"), Col("calls", drop=2),
            Col("comm"), Col("exposed"), Col("size", drop=1), Col("bus BW", drop=1), Col("slack", drop=3),
            Col("held", drop=3)]
    out = []
    for r in shown:
        op = _COLL.get(r.collective, r.collective[:4])
        if r.phase:
            op += " " + _PHASE.get(r.phase, r.phase[:3])
        exposed_frac = r.exposed_us / r.comm_us if r.comm_us else 0.0
        out.append((
            str(r.rank), labels[r.unit], op, MISSING if r.count_per_step is None else f"{r.count_per_step:.3g}",
            fmt_ms(r.comm_ms_per_step),
            Text(fmt_ms(r.exposed_ms_per_step), style="red" if exposed_frac > 0.5 else ""),
            fmt_bytes(r.bytes_per_call), fmt_bw(r.busbw_gbps),
            Text(fmt_us(r.slack_us, signed=True), style="red" if r.slack_us is not None and r.slack_us < 0 else ""),
            fmt_us(r.held_us)))
    return fitted_table(title, cols, out, width)


def render_overlap(section: OverlapSection | dict, top: int = TOP_UNITS, skipped: bool = True, width: int = 100,
                   names: Iterable[str] = ()):
    """A rich renderable of ``report.overlap`` or ``analyze_traces``' result (or its JSON form): per-rank
    overlap table, per-unit table (worst exposure first), skipped files (unless ``skipped=False``: the full report
    lists them once among its problems). ``names``: every unit of the run (the records' units), for labels
    unambiguous among them all."""
    sec = OverlapSection.of(section) or OverlapSection()
    parts = []
    if sec.per_rank:
        parts.append(_rank_table(sec, width))
    else:
        parts.append(Text("No traces could be analysed.", style="bold red"))
    if sec.per_unit:
        parts.append(_unit_table(sec.per_unit, top, width, [*names, *(u.name for u in sec.units or ())]))
    slack = slack_note(sec)
    if slack:
        parts.append(Text(slack, style="dim"))
    gloo = unit_exposed_note(sec)
    if gloo:
        parts.append(Text(gloo, style="dim"))
    for s in sec.skipped if skipped else []:
        parts.append(Text(f"skipped {s.file}: {s.error}", style="yellow"))
    return Group(*parts)
