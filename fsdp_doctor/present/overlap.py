"""Terminal rendering of the trace section (``overlap``) of the report (rich). Formatting only."""

from __future__ import annotations

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from ..report_sections import Blocking, CommUnitRow, OverlapSection
from .fmt import fmt_bw, fmt_bytes, fmt_pct, fmt_us, unit_label  # noqa: F401  (one convention, see fmt.py)

TOP_UNITS = 15
_COLL = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "broadcast": "BC",
         "send_recv": "SR", "all_to_all": "A2A"}
_PHASE = {"forward": "fwd", "backward": "bwd"}


def _rank_table(sec: OverlapSection) -> Table:
    t = Table(title="Communication / compute overlap per rank", box=box.SIMPLE_HEAD, padding=(0, 1),
              title_justify="left", pad_edge=False)
    for name, kw in (("Rank", {"justify": "right"}), ("Dev", {}), ("Steps", {"justify": "right"}),
                     ("Comm", {"justify": "right"}), ("Hidden", {"justify": "right"}),
                     ("Exposed", {"justify": "right"}), ("Overlap", {"justify": "right"}),
                     ("Blocked AG", {"justify": "right"}), ("Copy exp.", {"justify": "right"}),
                     ("Idle", {"justify": "right"})):
        t.add_column(name, no_wrap=True, **kw)
    for rank in sorted(sec.per_rank, key=int):
        pr = sec.per_rank[rank]
        blk = sec.blocking.get(rank) or Blocking()
        cp = sec.copies.get(rank)
        idle = sec.idle.get(rank)
        pct = pr.overlap_pct
        style = "red" if pct is not None and pct < 20 else ("yellow" if pct is not None and pct < 60 else "green")
        t.add_row(
            rank,
            pr.device,
            f"{len(pr.steps)}" if pr.steps else "–",
            fmt_us(pr.comm_us),
            fmt_us(pr.overlap_us),
            fmt_us(pr.exposed_us),
            Text(fmt_pct(pct), style=style if pct is not None else ""),
            f"{blk.count}× {fmt_us(blk.us)}" if blk.count else "0",
            fmt_us(cp.exposed_us) if cp is not None and (cp.h2d_us or cp.d2h_us) else "–",
            fmt_us(idle.idle_us if idle is not None else None),
        )
    return t


def _unit_table(rows: list[CommUnitRow], top: int) -> Table:
    shown = rows[:top]
    title = "FSDP units, worst exposure first"
    if len(rows) > top:
        title += f" (top {top} of {len(rows)})"
    t = Table(title=title, box=box.SIMPLE_HEAD, padding=(0, 1), title_justify="left", pad_edge=False)
    t.add_column("Rank", justify="right", no_wrap=True)
    t.add_column("Unit", max_width=12, overflow="ellipsis", no_wrap=True)
    t.add_column("Op", no_wrap=True)
    t.add_column("N", justify="right", no_wrap=True)
    t.add_column("Comm", justify="right", no_wrap=True)
    t.add_column("Exposed", justify="right", no_wrap=True)
    t.add_column("Size", justify="right", no_wrap=True)
    t.add_column("Bus BW", justify="right", no_wrap=True)
    t.add_column("Slack", justify="right", no_wrap=True)
    t.add_column("Held", justify="right", no_wrap=True)
    for r in shown:
        op = _COLL.get(r.collective, r.collective[:4])
        if r.phase:
            op += " " + _PHASE.get(r.phase, r.phase[:3])
        exposed_frac = r.exposed_us / r.comm_us if r.comm_us else 0.0
        t.add_row(
            str(r.rank),
            unit_label(r.unit),
            op,
            str(r.count),
            fmt_us(r.comm_us),
            Text(fmt_us(r.exposed_us), style="red" if exposed_frac > 0.5 else ""),
            fmt_bytes(r.bytes_per_call),
            fmt_bw(r.busbw_gbps),
            Text(fmt_us(r.slack_us, signed=True), style="red" if r.slack_us is not None and r.slack_us < 0 else ""),
            fmt_us(r.held_us),
        )
    return t


def render_overlap(section: OverlapSection | dict, top: int = TOP_UNITS, skipped: bool = True):
    """A rich renderable of ``report.overlap`` or ``analyze_traces``' result (or its JSON form): per-rank
    overlap table, per-unit table (worst exposure first), skipped files (unless ``skipped=False``: the full report
    lists them once among its problems)."""
    sec = OverlapSection.of(section) or OverlapSection()
    parts = []
    if sec.per_rank:
        parts.append(_rank_table(sec))
    else:
        parts.append(Text("No traces could be analysed.", style="bold red"))
    if sec.per_unit:
        parts.append(_unit_table(sec.per_unit, top))
        parts.append(Text("Slack: need − finish of the all-gather (negative: compute waited). "
                          "Held: gathered params unused before need.", style="dim"))
    for s in sec.skipped if skipped else []:
        parts.append(Text(f"skipped {s.file}: {s.error}", style="yellow"))
    return Group(*parts)
