"""Terminal view of the memory section: the breakdown at the peak, per rank (fits the console's width)."""

from __future__ import annotations

from msgspec import UNSET
from rich.console import Group
from rich.text import Text

from ..report_sections import MemorySection
from .fit import Col, fitted_table
from .fmt import (TRACE_MEMORY_HEADER, fmt_bytes, memory_categories_shown, memory_keys, memory_lines, memory_rows,
                  rank_order, ranks_left_out_line, ranks_shown, short_unit_labels, trace_memory_rows)

#: memory_lines' kinds as the terminal styles them
_LINE_STYLE = {"error": "red", "warning": "yellow"}

_BAR = 20


def _bar(frac: float) -> str:
    n = max(0, min(_BAR, round(frac * _BAR)))
    return "█" * n + "·" * (_BAR - n)




def render_memory(section: MemorySection, width: int = 100):
    """Per rank: peak, where it happened, and each category in MiB/GiB with its share of the peak (``section``:
    ``report.memory``)."""
    sec = section
    per_rank = sec.per_rank if sec is not None else {}
    if not per_rank:
        return Text("No memory measurements.")
    ranks = sorted(per_rank, key=rank_order)
    if sec.source != "records":  # a plain trace's allocator totals: no categories
        head = Text(f"Memory: peak allocated per rank over the complete steps ({sec.source})")
        return Group(head, fitted_table("", [Col(n, justify="left" if n == "unit, phase" else "right",
                                                 wrap=n == "unit, phase") for n in TRACE_MEMORY_HEADER],
                                        trace_memory_rows(sec), width))
    # a larger job's ranks: the highest peaks and the lowest (fmt.ranks_shown)
    keys = memory_keys(sec)
    ranks, left = ranks_shown(keys)
    many = len(ranks) > 2
    # at a narrow width the shares go first, then the ranks with the lower peaks (the first rank's column stays)
    by_peak = sorted(ranks[1:], key=lambda r: -(keys[r] or 0))
    cols = [Col("category", justify="left", wrap=True)]
    for r in ranks:
        cols += [Col(f"rank {r}", drop=0 if r == ranks[0] else 11 + by_peak.index(r)), Col("%", drop=1, follows=True)]
    if not many:
        cols.append(Col(f"share (rank {ranks[0]})", justify="left", drop=2))
    rows, styles = [], []
    # the cells: fmt.memory_rows, the HTML's too; the categories' rows, then the peak's
    for c, row in zip([*memory_categories_shown(sec), "peak"], memory_rows(sec, ranks)[1]):
        if not many:
            p0 = per_rank[ranks[0]]
            v0 = p0.peak_breakdown.get(c, 0) or 0
            row += (_bar(v0 / p0.peak_bytes) if p0.peak_bytes and c != "peak" else "",)
        rows.append(row)
        styles.append("bold red" if c == "stale_optimizer_params" else "bold" if c == "peak" else None)
    table = fitted_table("Memory at the peak, by category (device bytes per rank)", cols, rows, width, styles=styles)
    # where each shown rank's peak happened, and its notes (fmt.memory_lines, the HTML's too)
    lines = [Text(text, style=_LINE_STYLE.get(kind, "")) for text, kind in memory_lines(sec, ranks)]
    if line := ranks_left_out_line(left, keys, "peak", fmt_bytes):  # (under the table: a caption wraps at its width)
        lines.insert(0, Text(line, style="dim"))
    top_rank = sec.peak_rank or ranks[0]
    top = per_rank.get(top_rank) or per_rank[ranks[0]]
    units = [u for u in top.per_unit if u.activation_bytes is not None or u.sharded_bytes]
    parts = [table, *lines]
    if units:
        labels = short_unit_labels(u.unit or "" for u in units)
        ut = fitted_table(f"Per unit (rank {top_rank})",
                          [Col("unit", justify="left", wrap=True), Col("sharded", drop=2), Col("unsharded", drop=1),
                           Col("activations (own)"), Col("activations (incl. nested)", drop=3)],
                          [(labels[u.unit or ""], fmt_bytes(u.sharded_bytes), fmt_bytes(u.unsharded_bytes),
                            fmt_bytes(None if u.activation_self_bytes is UNSET else u.activation_self_bytes),
                            fmt_bytes(u.activation_bytes)) for u in units], width)
        parts.append(ut)
    return Group(*parts)
