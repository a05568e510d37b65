"""The rules as the terminal shows them: the catalogue (``fsdp-doctor rules``, and the README's table from it)
and every rule checked on a run with its outcome (``fsdp-doctor analyze --explain``). Formats, computes
nothing."""

from __future__ import annotations

from rich import box
from rich.console import Group
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from ..report_sections import RuleStatus

STATUS_STYLE = {"fired": "bold", "quiet": "green", "skipped": "dim", "failed": "red"}


def render_rule_statuses(statuses: list[RuleStatus]) -> Table:
    """``statuses``: ``report.rules``, one row per rule checked: fired, quiet, skipped or failed, and why."""
    n = {s: sum(r.status == s for r in statuses) for s in STATUS_STYLE}
    t = Table(title="Rules checked: " + ", ".join(f"{v} {k}" for k, v in n.items() if v), box=box.SIMPLE_HEAD,
              title_justify="left")
    t.add_column("rule", no_wrap=True)
    t.add_column("status", no_wrap=True)
    t.add_column("why")
    order = list(STATUS_STYLE)
    for r in sorted(statuses, key=lambda r: (order.index(r.status) if r.status in order else 9, r.code)):
        t.add_row(r.code, r.status + (f" ({r.findings})" if r.findings > 1 else ""), r.reason,
                  style=STATUS_STYLE.get(r.status))
    return t


def render_catalogue(rows: list[dict], needs: dict[str, str]) -> Group:
    """``rows``: ``fsdp_doctor.diagnose.catalogue()``; ``needs``: what each need names. One rule per entry: its
    code, severities and needs on one line, what it checks indented below, so that the text reads at any width (a
    table's text column was 12 characters wide at 80 columns)."""
    parts: list = [Text(f"{len(rows)} rules", style="italic")]
    for r in rows:
        head = Text.assemble((r["code"], "bold"), "  ", r["severity"], "  ",
                             ("needs: " + (", ".join(r["needs"]) or "—"), "dim"))
        parts += [head, Padding(Text(r["checks"]), (0, 0, 0, 4))]
    parts.append(Text("\nneeds: " + "; ".join(f"{k}: {v}" for k, v in needs.items()), style="dim"))
    return Group(*parts)


def catalogue_markdown(rows: list[dict], needs: dict[str, str]) -> str:
    """The catalogue as the README's Markdown table (``fsdp-doctor rules --markdown``), its legend below."""
    lines = ["| code | severity | needs | checks |", "|---|---|---|---|"]
    # (a need's "|" ("records|trace": either) escaped: unescaped it split the table's row into an extra column)
    lines += [f"| `{r['code']}` | {r['severity']} | {', '.join(r['needs']).replace('|', chr(92) + '|') or '—'} | "
              f"{r['checks']} |" for r in rows]
    lines += ["", "Needs: " + "; ".join(f"`{k}`: {v}" for k, v in needs.items()) + "."]
    return "\n".join(lines)
