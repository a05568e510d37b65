"""Terminal presenter: formats a report (rich), computes nothing."""

from __future__ import annotations

from rich import box
from rich.console import Console, Group
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from ..report_sections import (Finding, Report, StepsSection, ThroughputJob, ThroughputRank, ThroughputSection,
                               UnitRow, Verdict)
from .fmt import (MISSING, VERDICT_HEADER, comm_headline, findings_headline, fmt_ms,
                  fmt_unit_figures, fmt_value, predicted_text, run_facts, unit_label, verdict_headline, verdict_rows,
                  verdict_title)

SEVERITY_STYLE = {"critical": "bold red", "warning": "yellow", "info": "cyan"}


def render_header(report: Report):
    r = report.run
    parts = [f"[bold]{r.path}[/]"]
    facts = run_facts(r)
    if r.trace_files:
        facts.append(f"{r.trace_files} trace files")
    parts.append(" · ".join(facts))
    incomplete = [k for k, done in r.complete.items() if not done]
    if incomplete:
        parts.append(f"[yellow]ranks {', '.join(incomplete)} did not finish (run still going, or killed); their completed steps are used[/]")
    for e in r.doctor_errors or []:
        parts.append(f"[red]doctor stepped aside on rank {e.rank} at step {e.step} ({e.where}): {e.message}[/]")
    return Panel("\n".join(parts), title="fsdp-doctor", box=box.ROUNDED, expand=False)


def render_verdict(section: Verdict):
    """The verdict's sentence and table: the text every presenter shows (fsdp_doctor.present.fmt)."""
    t = Table(title=verdict_title(section), box=box.SIMPLE_HEAD, title_justify="left", padding=(0, 0))
    for c in VERDICT_HEADER:
        t.add_column(c, justify="left" if c == "bound" else "right", no_wrap=True)
    for row in verdict_rows(section):
        t.add_row(*row, style="bold" if row[0] == "job" else None)
    return Group(Text(verdict_headline(section), style="bold"), t)


def render_steps(section: StepsSection):
    """``section``: ``report.steps``."""
    sec = section or StepsSection()
    t = Table(title="Step time per rank, ms (steady state: first step and profiled steps excluded)",
              box=box.SIMPLE_HEAD, title_justify="left")
    for col in ("rank", "steps", "p50", "p90", "p99", "max", "cv", "fwd", "bwd", "optim", "outside", "GC"):
        t.add_column(col, justify="right", no_wrap=True)
    for r, st in sec.per_rank.items():
        if not st.count:
            t.add_row(r, f"{st.recorded or 0}", *["—"] * 10)
            continue
        ph = st.phases_p50_ms  # phase -> ms
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


def render_throughput(section: ThroughputSection):
    """``section``: ``report.throughput``; a figure not known is "—"."""
    sec = section or ThroughputSection()
    t = Table(title="Throughput", box=box.SIMPLE_HEAD, title_justify="left")
    for col in ("rank", "tokens/s", "TFLOP/s", "MFU", "HFU"):
        t.add_column(col, justify="right", no_wrap=True)
    for r, row in sec.per_rank.items():
        t.add_row(r, *_throughput_cells(row))
    job = sec.job
    if any(x is not None for x in (job.tokens_per_s, job.achieved_tflops, job.mfu_pct)):
        t.add_row("job", *_throughput_cells(job), style="bold")
    return t


def _throughput_cells(x: ThroughputRank | ThroughputJob) -> tuple[str, str, str, str]:
    """MFU: model FLOPs; HFU: with activation checkpointing's recompute (the same without checkpointing)."""
    return (MISSING if x.tokens_per_s is None else f"{x.tokens_per_s:,.0f}",
            MISSING if x.achieved_tflops is None else f"{x.achieved_tflops:.3f}",
            MISSING if x.mfu_pct is None else f"{x.mfu_pct:.1f}%",
            MISSING if x.hfu_pct is None else f"{x.hfu_pct:.1f}%")


def render_units(units: list[UnitRow]):
    """``units``: ``report.units``; each unit's own times, "—" where not timed."""
    t = Table(title=f"FSDP units ({len(units)}); per-step medians in ms, each unit's own time (nested units "
                    "excluded)", box=box.SIMPLE_HEAD, title_justify="left")
    t.add_column("unit", justify="left", min_width=12, max_width=26, overflow="fold")
    for col in ("params", "shard", "gathered", "reshard", "AC", "fwd", "AG wait", "bwd", "AG wait"):
        t.add_column(col, justify="right", no_wrap=True)
    for u in units[:24]:
        tm = u.timing_p50
        times = (tm.fwd_self_ms, tm.ag_wait_fwd_ms, tm.bwd_self_ms, tm.ag_wait_bwd_ms) if tm else (None,) * 4
        t.add_row(("  " * u.depth) + unit_label(u.name), *fmt_unit_figures(u), u.checkpoint, *map(_num, times))
    if len(units) > 24:
        t.add_row(f"… {len(units) - 24} more", *[""] * 9)
    return t


def _num(x) -> str:
    if x is None:
        return "—"
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def render_findings(findings: list[Finding]):
    """``findings``: ``report.findings``, each with its evidence, fix and expected gain."""
    head = findings_headline(findings)
    if not findings:
        return Text(head, style="green")
    items = []
    worst = {f.severity for f in findings}
    items.append(Text(head, style="green" if not worst & {"critical", "warning"} else "bold"))
    for f in findings:
        ev = "\n".join(f"  {k}: {fmt_value(k, v)}" for k, v in f.evidence.items())
        rec = f.recommendation
        body = [Text(rec.text), Text("Evidence:\n" + ev, style="dim")]
        expected = predicted_text(f.predicted)
        if expected:
            body.append(Text(f"Expected: {expected}", style="green"))
        if rec.code:
            body.append(Syntax(rec.code, "python", theme="ansi_dark", word_wrap=True))
        style = SEVERITY_STYLE.get(f.severity, "")
        items.append(Panel(Group(*body), title=f"[{style}]{f.severity.upper()}[/] {f.code}: {f.title}",
                           title_align="left", box=box.ROUNDED, border_style=style))
    return Group(*items)


def render_report(report: Report | dict, console: Console | None = None) -> None:
    """Prints the report (a :class:`~fsdp_doctor.report_sections.Report`, or its JSON form) section by section."""
    report = Report.of(report)
    console = console or Console(width=100)
    console.print(render_header(report))
    if report.verdict is not None:
        console.print(render_verdict(report.verdict))
    if report.steps is not None:
        console.print(render_steps(report.steps))
    if report.throughput is not None:
        console.print(render_throughput(report.throughput))
    if report.units:
        console.print(render_units(report.units))
    if report.memory is not None:
        from .memory import render_memory

        console.print(render_memory(report.memory))
    if report.overlap is not None:
        from .overlap import render_overlap

        console.print(render_overlap(report.overlap, skipped=False))  # listed once below, with the problems
    head = comm_headline(report.comm)
    if head:
        console.print(Text(head, style="bold"))
    console.rule("Diagnosis")
    console.print(render_findings(report.findings))
    for p in report.problems:
        console.print(Text(f"skipped: {p}", style="yellow"))
