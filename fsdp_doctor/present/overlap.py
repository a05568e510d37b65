"""Terminal rendering of the trace section (``overlap``) of the report (rich). Formatting only."""

from __future__ import annotations

from typing import Iterable

from rich.console import Group
from rich.text import Text

from ..report_sections import Blocking, CommUnitRow, OverlapSection
from ..trace.model import OTHER_UNIT
from .fit import Col, fitted_table
from .fmt import (MISSING, fmt_bw, fmt_bytes, fmt_ms, fmt_pct, fmt_us, short_unit_labels,  # one convention: fmt.py
                  unit_exposed_note)

TOP_UNITS = 15
_COLL = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "broadcast": "BC",
         "send_recv": "SR", "all_to_all": "A2A"}
# (a phase not here was cut to its first 3 letters: a gradient norm's all-reduce read "AR gra", a new-user trial)
_PHASE = {"forward": "fwd", "backward": "bwd", "grad_norm": "norm", "model": "model"}


def _rank_table(sec: OverlapSection, width: int):
    """Per rank, per complete profiled step (OverlapRank's ``*_per_step`` figures); the overlap % is HTA's, over
    the whole window."""
    cols = [Col("rank"), Col("dev", drop=3), Col("steps", drop=2), Col("step"), Col("comm"), Col("hidden", drop=1),
            Col("exposed"), Col("overlap", drop=1), Col("blocked AG", drop=2), Col("copies exp.", drop=3)]
    rows = []
    for rank in sorted(sec.per_rank, key=int):
        pr = sec.per_rank[rank]
        blk = sec.blocking.get(rank) or Blocking()
        cp = sec.copies.get(rank)
        pct = pr.overlap_pct
        style = "red" if pct is not None and pct < 20 else ("yellow" if pct is not None and pct < 60 else "green")
        rows.append((
            rank, pr.device, f"{pr.step_count}" if pr.step_count else "–", fmt_ms(pr.step_ms),
            fmt_ms(pr.comm_ms_per_step), fmt_ms(pr.hidden_ms_per_step), fmt_ms(pr.exposed_ms_per_step),
            Text(fmt_pct(pct), style=style if pct is not None else ""),
            f"{blk.count} in window" if blk.count else "0",
            fmt_us(cp.exposed_us) if cp is not None and (cp.h2d_us or cp.d2h_us) else "–"))
    return fitted_table("Communication per complete profiled step, per rank (overlap %: whole window, as HTA)",
                        cols, rows, width)


def _unit_table(rows: list[CommUnitRow], top: int, width: int, names: Iterable[str] = ()):
    """``names``: every unit's name the run knows (the trace's unit rows), so a label is unambiguous among all the
    units, not only among those with collectives in this table (an MoE's ``experts.2`` of one layer read as if the
    only one: a new-user trial)."""
    shown = rows[:top]
    fsdp = any(r.unit != OTHER_UNIT for r in rows)  # (a DDP trace's all-reduces read "FSDP units": a new-user trial)
    title = ("FSDP units" if fsdp else "Collectives (no FSDP unit in the traces)") + \
        ", worst exposure first, per profiled step"
    if len(rows) > top:
        title += f" (top {top} of {len(rows)})"
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
    if any(r.unit != OTHER_UNIT for r in sec.per_unit):  # (all-gathers' figures)
        parts.append(Text("Slack: need − finish of the all-gather (negative: compute waited). "
                          "Held: gathered params unused before need.", style="dim"))
    gloo = unit_exposed_note(sec)
    if gloo:
        parts.append(Text(gloo, style="dim"))
    for s in sec.skipped if skipped else []:
        parts.append(Text(f"skipped {s.file}: {s.error}", style="yellow"))
    return Group(*parts)
