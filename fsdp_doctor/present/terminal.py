"""Terminal presenter: formats a report (rich), computes nothing."""

from __future__ import annotations

from rich import box
from rich.console import Console, Group
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from ..report_sections import StepsSection
from .fmt import (VERDICT_HEADER, comm_headline, findings_headline, fmt_bytes, fmt_ms, fmt_unit_figures, fmt_value,
                  run_facts, unit_label, verdict_headline, verdict_rows, verdict_title)

SEVERITY_STYLE = {"critical": "bold red", "warning": "yellow", "info": "cyan"}


def render_header(report: dict):
    r = report.get("run", {})
    parts = [f"[bold]{r.get('path', '')}[/]"]
    facts = run_facts(r)
    if r.get("trace_files"):
        facts.append(f"{r['trace_files']} trace files")
    parts.append(" · ".join(facts))
    incomplete = [k for k, v in (r.get("complete") or {}).items() if not v]
    if incomplete:
        parts.append(f"[yellow]ranks {', '.join(incomplete)} did not finish (run still going, or killed); their completed steps are used[/]")
    for e in r.get("doctor_errors", []):
        parts.append(f"[red]doctor stepped aside on rank {e['rank']} at step {e['step']} ({e['where']}): {e['message']}[/]")
    return Panel("\n".join(parts), title="fsdp-doctor", box=box.ROUNDED, expand=False)


# --- verdict (e11): printed first; port with the rest at merge ---
def render_verdict(section: dict):
    """The verdict's sentence and table: the text every presenter shows (fsdp_doctor.present.fmt)."""
    t = Table(title=verdict_title(section), box=box.SIMPLE_HEAD, title_justify="left", padding=(0, 0))
    for c in VERDICT_HEADER:
        t.add_column(c, justify="left" if c == "bound" else "right", no_wrap=True)
    for row in verdict_rows(section):
        t.add_row(*row, style="bold" if row[0] == "job" else None)
    return Group(Text(verdict_headline(section), style="bold"), t)
# --- end verdict ---


def render_steps(section):
    """``section``: ``report["steps"]``, read as :class:`fsdp_doctor.report_sections.StepsSection`."""
    sec = StepsSection.of(section) or StepsSection()
    t = Table(title="Step time per rank, ms (steady state: first step and profiled steps excluded)",
              box=box.SIMPLE_HEAD, title_justify="left")
    for col in ("rank", "steps", "p50", "p90", "p99", "max", "cv", "fwd", "bwd", "optim", "outside", "GC"):
        t.add_column(col, justify="right", no_wrap=True)
    for r, st in sec.per_rank.items():
        if not st.count:
            t.add_row(r, f"{st.recorded or 0}", *["—"] * 10)
            continue
        ph = st.phases_p50_ms
        t.add_row(r, str(st.count), *(_num(v) for v in (st.p50_ms, st.p90_ms, st.p99_ms, st.max_ms)),
                  f"{100 * st.cv:.1f}%" if st.cv is not None else "—",
                  *(_num(ph[k]) for k in ("forward", "backward", "optimizer", "outside", "gc")))
    items = [t]
    outs = sec.outliers
    if outs:
        o = Table(title=f"Outlier steps ({len(outs)}, worst first)", box=box.SIMPLE_HEAD, title_justify="left")
        for col, j in (("rank", "right"), ("step", "right"), ("time", "right"), ("median", "right"), ("likely cause", "left")):
            o.add_column(col, justify=j, no_wrap=(j == "right"))
        for x in outs[:8]:
            o.add_row(str(x.rank), str(x.step), fmt_ms(x.ms), fmt_ms(x.median_ms), x.detail)
        items.append(o)
    for s in sec.stragglers:
        items.append(Text(f"Straggler: rank {s.rank} spends +{s.excess_ms_per_step:.1f} ms/step in {s.phase} "
                          f"({s.steps_slower} of {s.steps} steps)", style="yellow"))
    return Group(*items)


def render_throughput(section: dict):
    t = Table(title="Throughput", box=box.SIMPLE_HEAD, title_justify="left")
    for col in ("rank", "tokens/s", "TFLOP/s", "MFU"):
        t.add_column(col, justify="right", no_wrap=True)
    for r, row in section.get("per_rank", {}).items():
        t.add_row(r, f"{row['tokens_per_s']:,.0f}" if "tokens_per_s" in row else "—",
                  f"{row['achieved_tflops']:.3f}" if "achieved_tflops" in row else "—",
                  f"{row['mfu_pct']:.1f}%" if "mfu_pct" in row else "—")
    job = section.get("job", {})
    if job:
        t.add_row("job", f"{job['tokens_per_s']:,.0f}" if "tokens_per_s" in job else "—",
                  f"{job['achieved_tflops']:.3f}" if "achieved_tflops" in job else "—",
                  f"{job['mfu_pct']:.1f}%" if "mfu_pct" in job else "—", style="bold")
    return t


def render_units(units: list[dict]):
    t = Table(title=f"FSDP units ({len(units)}); per-step medians in ms, each unit's own time (nested units "
                    "excluded)", box=box.SIMPLE_HEAD, title_justify="left")
    t.add_column("unit", justify="left", min_width=12, max_width=26, overflow="fold")
    for col in ("params", "shard", "gathered", "reshard", "AC", "fwd", "AG wait", "bwd", "AG wait"):
        t.add_column(col, justify="right", no_wrap=True)
    for u in units[:24]:
        tm = u.get("timing_p50", {})
        name = unit_label(u["name"])
        t.add_row(("  " * u.get("depth", 0)) + name, *fmt_unit_figures(u),
                  u.get("checkpoint", "none"), *(_num(tm.get(k, tm.get(k.replace("_self", "")))) for k in
                    ("fwd_self_ms", "ag_wait_fwd_ms", "bwd_self_ms", "ag_wait_bwd_ms")))
    if len(units) > 24:
        t.add_row(f"… {len(units) - 24} more", *[""] * 9)
    return t


def _num(x) -> str:
    if x is None:
        return "—"
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def render_findings(findings: list[dict]):
    head = findings_headline(findings)
    if not findings:
        return Text(head, style="green")
    items = []
    worst = {f["severity"] for f in findings}
    items.append(Text(head, style="green" if not worst & {"critical", "warning"} else "bold"))
    for f in findings:
        ev = "\n".join(f"  {k}: {fmt_value(k, v)}" for k, v in f["evidence"].items())
        body = [Text(f["recommendation"]["text"]), Text("Evidence:\n" + ev, style="dim")]
        pred = f.get("predicted")
        if pred and (pred.get("step_ms_after") is not None or pred.get("peak_bytes_after") is not None):
            bits = []
            if pred.get("step_ms_before") is not None and pred.get("step_ms_after") is not None:
                bits.append(f"step {fmt_ms(pred['step_ms_before'])} → {fmt_ms(pred['step_ms_after'])}")
            if pred.get("peak_bytes_before") is not None and pred.get("peak_bytes_after") is not None:
                bits.append(f"peak {fmt_bytes(pred['peak_bytes_before'])} → {fmt_bytes(pred['peak_bytes_after'])}")
            body.append(Text("Expected: " + ", ".join(bits), style="green"))
        if f["recommendation"].get("code"):
            body.append(Syntax(f["recommendation"]["code"], "python", theme="ansi_dark", word_wrap=True))
        style = SEVERITY_STYLE.get(f["severity"], "")
        items.append(Panel(Group(*body), title=f"[{style}]{f['severity'].upper()}[/] {f['code']}: {f['title']}",
                           title_align="left", box=box.ROUNDED, border_style=style))
    return Group(*items)


def render_report(report: dict, console: Console | None = None) -> None:
    console = console or Console(width=100)
    console.print(render_header(report))
    if report.get("verdict"):
        console.print(render_verdict(report["verdict"]))  # e11
    if report.get("steps"):
        console.print(render_steps(report["steps"]))
    if report.get("throughput"):
        console.print(render_throughput(report["throughput"]))
    if report.get("units"):
        console.print(render_units(report["units"]))
    if report.get("memory"):
        from .memory import render_memory

        console.print(render_memory(report["memory"]))
    if report.get("overlap"):
        from .overlap import render_overlap

        console.print(render_overlap(report["overlap"], skipped=False))  # listed once below, with the problems
    head = comm_headline(report.get("comm"))
    if head:
        console.print(Text(head, style="bold"))
    console.rule("Diagnosis")
    console.print(render_findings(report.get("findings", [])))
    for p in report.get("problems", []):
        console.print(Text(f"skipped: {p}", style="yellow"))
