"""Terminal rendering of the trace section (``overlap``) of the report (rich). Formatting only."""

from __future__ import annotations


from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from .fmt import fmt_bw, fmt_bytes, fmt_pct, fmt_us, unit_label  # noqa: F401  (one convention, see fmt.py)

TOP_UNITS = 15
_COLL = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "broadcast": "BC",
         "send_recv": "SR", "all_to_all": "A2A"}
_PHASE = {"forward": "fwd", "backward": "bwd"}


def _rank_table(result: dict) -> Table:
    t = Table(title="Communication / compute overlap per rank", box=box.SIMPLE_HEAD, padding=(0, 1),
              title_justify="left", pad_edge=False)
    for name, kw in (("Rank", {"justify": "right"}), ("Dev", {}), ("Steps", {"justify": "right"}),
                     ("Comm", {"justify": "right"}), ("Hidden", {"justify": "right"}),
                     ("Exposed", {"justify": "right"}), ("Overlap", {"justify": "right"}),
                     ("Blocked AG", {"justify": "right"}), ("Copy exp.", {"justify": "right"}),
                     ("Idle", {"justify": "right"})):
        t.add_column(name, no_wrap=True, **kw)
    for rank in sorted(result.get("per_rank", {}), key=int):
        pr = result["per_rank"][rank]
        blk = result.get("blocking", {}).get(rank, {"count": 0, "us": 0.0})
        cp = result.get("copies", {}).get(rank, {})
        idle = result.get("idle", {}).get(rank, {})
        pct = pr["overlap_pct"]
        style = "red" if pct is not None and pct < 20 else ("yellow" if pct is not None and pct < 60 else "green")
        steps = pr.get("steps") or []
        t.add_row(
            rank,
            pr["device"],
            f"{len(steps)}" if steps else "–",
            fmt_us(pr["comm_us"]),
            fmt_us(pr["overlap_us"]),
            fmt_us(pr["exposed_us"]),
            Text(fmt_pct(pct), style=style if pct is not None else ""),
            f"{blk['count']}× {fmt_us(blk['us'])}" if blk["count"] else "0",
            fmt_us(cp.get("exposed_us")) if (cp.get("h2d_us") or cp.get("d2h_us")) else "–",
            fmt_us(idle.get("idle_us")),
        )
    return t


def _unit_table(result: dict, top: int) -> Table:
    rows = result.get("per_unit", [])
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
        op = _COLL.get(r["collective"], r["collective"][:4])
        if r["phase"]:
            op += " " + _PHASE.get(r["phase"], r["phase"][:3])
        exposed_frac = r["exposed_us"] / r["comm_us"] if r["comm_us"] else 0.0
        slack = r["slack_us"]
        t.add_row(
            str(r["rank"]),
            unit_label(r["unit"]),
            op,
            str(r["count"]),
            fmt_us(r["comm_us"]),
            Text(fmt_us(r["exposed_us"]), style="red" if exposed_frac > 0.5 else ""),
            fmt_bytes(r["bytes_per_call"]),
            fmt_bw(r["busbw_gbps"]),
            Text(fmt_us(slack, signed=True), style="red" if slack is not None and slack < 0 else ""),
            fmt_us(r["held_us"]),
        )
    return t


def render_overlap(result: dict, top: int = TOP_UNITS, skipped: bool = True):
    """A rich renderable: per-rank overlap table, per-unit table (worst exposure first), skipped files (unless
    ``skipped=False``: the full report lists them once among its problems)."""
    parts = []
    if result.get("per_rank"):
        parts.append(_rank_table(result))
    else:
        parts.append(Text("No traces could be analysed.", style="bold red"))
    if result.get("per_unit"):
        parts.append(_unit_table(result, top))
        parts.append(Text("Slack: need − finish of the all-gather (negative: compute waited). "
                          "Held: gathered params unused before need.", style="dim"))
    for s in result.get("skipped", []) if skipped else []:
        parts.append(Text(f"skipped {s['file']}: {s['error']}", style="yellow"))
    return Group(*parts)
