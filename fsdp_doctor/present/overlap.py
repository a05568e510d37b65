"""Terminal rendering of the trace section (``overlap``) of the report (rich). Formatting only."""

from __future__ import annotations

from typing import Iterable

from rich.console import Group
from rich.text import Text

from ..report_sections import CommUnitRow, OverlapSection
from .fit import Col, fitted_table
from .fmt import (COMM_UNITS_HEADER, OVERLAP_RANKS_HEADER, OVERLAP_RANKS_TITLE,  # one convention: fmt.py
                  comm_unit_rows, comm_units_title, fmt_ms, left_out_note, overlap_keys, overlap_rank_rows,
                  ranks_left_out_line, ranks_shown, slack_note, unit_exposed_note)

TOP_UNITS = 15


def _rank_table(sec: OverlapSection, width: int):
    """Per rank, per complete profiled step (fmt.overlap_rank_rows, the HTML's too), the overlap % coloured."""
    drops = {"dev": 3, "steps": 2, "hidden": 1, "overlap": 1, "blocked AG": 2, "copies exp.": 3}
    cols = [Col(h, drop=drops.get(h, 0)) for h in OVERLAP_RANKS_HEADER]
    rows, at = [], OVERLAP_RANKS_HEADER.index("overlap")
    keys = overlap_keys(sec)  # (a larger job's: the most exposed ranks, the least)
    shown, left = ranks_shown(keys)
    for rank, row in zip(sorted(shown, key=int), overlap_rank_rows(sec, shown)):
        pct = sec.per_rank[rank].overlap_pct
        style = "red" if pct is not None and pct < 20 else ("yellow" if pct is not None and pct < 60 else "green")
        rows.append((*row[:at], Text(row[at], style=style if pct is not None else ""), *row[at + 1:]))
    line = ranks_left_out_line(left, keys, "exposed", fmt_ms)  # (under the table: a caption wraps at its width)
    table = fitted_table(OVERLAP_RANKS_TITLE, cols, rows, width)
    return Group(table, Text(line, style="dim")) if line else table


def _unit_table(rows: list[CommUnitRow], top: int, width: int, names: Iterable[str] = ()):
    """``names``: every unit's name the run knows (the trace's unit rows), for labels unambiguous among them all
    (fmt.comm_unit_rows, the HTML's too); exposed over half the collective and negative slack in red."""
    drops = {"calls": 2, "size": 1, "bus BW": 1, "slack": 3, "held": 3}
    cols = [Col(h, justify="left" if h in ("unit", "op") else "right", wrap=h == "unit", drop=drops.get(h, 0))
            for h in COMM_UNITS_HEADER]
    exposed, slack = COMM_UNITS_HEADER.index("exposed"), COMM_UNITS_HEADER.index("slack")
    out = []
    for r, row in zip(rows, comm_unit_rows(rows, top, names)):
        cells = list(row)
        cells[exposed] = Text(row[exposed], style="red" if r.comm_us and r.exposed_us / r.comm_us > 0.5 else "")
        cells[slack] = Text(row[slack], style="red" if r.slack_us is not None and r.slack_us < 0 else "")
        out.append(tuple(cells))
    return fitted_table(comm_units_title(rows, top), cols, out, width)


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
        left_out = left_out_note(sec)
        if left_out:
            parts.append(Text(left_out, style="dim"))
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
