"""Terminal view of the memory section: the breakdown at the peak, per rank (fits 100 columns)."""

from __future__ import annotations

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from ..memory_categories import DEVICE, label
from .fmt import fmt_bytes, unit_label

_BAR = 20


def _bar(frac: float) -> str:
    n = max(0, min(_BAR, round(frac * _BAR)))
    return "█" * n + "·" * (_BAR - n)


def _where(at: dict) -> str:
    unit = at.get("unit")
    unit = "(model)" if unit is None else unit_label(unit)
    return f"step {at.get('step')}, {unit} {at.get('phase') or ''}".strip()


def render_memory(section: dict):
    """Per rank: peak, where it happened, and each category in MiB/GiB with its share of the peak."""
    per_rank = (section or {}).get("per_rank") or {}
    if not per_rank:
        return Text("No memory measurements.")
    ranks = sorted(per_rank, key=lambda r: int(r) if str(r).isdigit() else 0)
    cats = list(section.get("categories") or DEVICE)
    unknown = {c for r in ranks for c in per_rank[r].get("unknown_categories") or ()}
    shown = [c for c in cats if c in unknown or any((per_rank[r].get("peak_breakdown") or {}).get(c) for r in ranks)]
    table = Table(title="Memory at the peak, by category (device bytes per rank)", box=box.SIMPLE_HEAD,
                  title_justify="left", pad_edge=False)
    table.add_column("category", style="bold", no_wrap=True)
    many = len(ranks) > 2
    for r in ranks:
        table.add_column(f"rank {r}", justify="right", no_wrap=True)
        table.add_column("%", justify="right", no_wrap=True)
    if not many:
        table.add_column(f"share (rank {ranks[0]})", no_wrap=True)
    for c in shown:
        row = [label(c)]
        for r in ranks:
            pr = per_rank[r]
            v = (pr.get("peak_breakdown") or {}).get(c, 0) or 0
            peak = pr.get("peak_bytes") or 0
            if c in (pr.get("unknown_categories") or ()):
                row += ["unknown", "—"]
                continue
            row += [fmt_bytes(v), f"{100 * v / peak:.1f}" if peak else "—"]
        if not many:
            p0 = per_rank[ranks[0]]
            v0 = (p0.get("peak_breakdown") or {}).get(c, 0) or 0
            row.append(_bar(v0 / p0["peak_bytes"]) if p0.get("peak_bytes") else "")
        style = "bold red" if c == "stale_optimizer_params" else None
        table.add_row(*row, style=style)
    total = ["peak"]
    for r in ranks:
        total += [fmt_bytes(per_rank[r].get("peak_bytes")), "100"]
    if not many:
        total.append("")
    table.add_row(*total, style="bold", end_section=True)
    lines = []
    for r in ranks:
        pr = per_rank[r]
        parts = [f"rank {r}: peak {fmt_bytes(pr.get('peak_bytes'))} at {_where(pr.get('peak_at') or {})}"]
        cap = pr.get("capacity_bytes")
        if cap:
            parts.append(f"{100 * pr['peak_bytes'] / cap:.0f}% of {fmt_bytes(cap)}")
        if pr.get("offloaded_host_bytes"):
            parts.append(f"host (offloaded) {fmt_bytes(pr['offloaded_host_bytes'])}")
        if pr.get("activations") and pr["activations"] != "exact":
            parts.append(f"activations {pr['activations']}")
        lines.append(Text("; ".join(parts)))
        if pr.get("stale_optimizer_params_bytes"):
            lines.append(Text(f"  rank {r}: the optimizer holds {fmt_bytes(pr['stale_optimizer_params_bytes'])} "
                              "of tensors the model no longer uses (created before fully_shard)", style="red"))
        for n in pr.get("notes") or []:
            lines.append(Text(f"  rank {r}: {n}", style="yellow"))
    top = per_rank[section.get("peak_rank") or ranks[0]]
    units = [u for u in top.get("per_unit") or [] if u.get("activation_bytes") is not None or u.get("sharded_bytes")]
    parts = [table, *lines]
    if units:
        ut = Table(title=f"Per unit (rank {section.get('peak_rank') or ranks[0]})", box=box.SIMPLE_HEAD,
                   title_justify="left", pad_edge=False)
        for col, j in (("unit", "left"), ("sharded", "right"), ("unsharded", "right"),
                       ("activations (own)", "right"), ("activations (incl. nested)", "right")):
            ut.add_column(col, justify=j, no_wrap=(col != "unit"), max_width=36 if col == "unit" else None)
        for u in units:
            ut.add_row(unit_label(u.get("unit") or ""), fmt_bytes(u.get("sharded_bytes")), fmt_bytes(u.get("unsharded_bytes")),
                       fmt_bytes(u.get("activation_self_bytes")), fmt_bytes(u.get("activation_bytes")))
        parts.append(ut)
    return Group(*parts)
