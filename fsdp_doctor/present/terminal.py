"""Terminal presenter: formats a report (rich), computes nothing."""

from __future__ import annotations

from rich import box
from rich.console import Console, Group
from rich.markup import escape
from rich.panel import Panel
from rich.syntax import Syntax
from rich.text import Text

from ..report_sections import (FIX_LANGUAGES, Finding, Report, StepsSection, ThroughputSection, TraceUnitRow, UnitRow,
                               Verdict)
from .fit import Col, fitted_table
from .fmt import (fix_heading, fix_inputs, THROUGHPUT_HEADER, TRACE_UNITS_HEADER, VERDICT_HEADER, comm_headline,
                  findings_headline, fmt_checkpoint, fmt_ms, fmt_ms_cell, fmt_unit_figures, evidence_rows, apart_texts, outlier_rows,
                  outliers_title, predicted_text, printable_report, run_facts, run_warnings, short_unit_labels, steps_rows,
                  steps_title, steps_traced, no_steady_text, straggler_text, throughput_note, throughput_rows,
                  trace_units_title, units_not_run_note, verdict_headline, verdict_rows, verdict_steps, verdict_title,
                  units_hooks_timed_note, ranks_left_out_line, ranks_shown, steps_keys, steps_ranks,
                  fit_comments, fixes_note, folded_problems, problem_line)

SEVERITY_STYLE = {"critical": "bold red", "warning": "yellow", "info": "cyan"}


STYLE = {"error": "red", "note": "dim"}  # a header line's style by its level (warning: yellow)


def render_header(report: Report, width: int = 100):
    r = report.run
    parts = [f"[bold]{escape(r.path)}[/]"]
    # the facts packed into lines of the panel's width, each fact whole ("1 trace file" never split over two lines)
    lines: list[str] = []
    for fact in run_facts(r):
        if lines and len(lines[-1]) + 3 + len(fact) <= width - 4:
            lines[-1] += " · " + fact
        else:
            lines.append(fact)
    parts.append(escape("\n".join(lines)))
    for w in run_warnings(r):  # (the HTML's lines too)
        parts.append(f"[{STYLE.get(w.level, 'yellow')}]{escape(w.text)}[/]")
    return Panel("\n".join(parts), title="fsdp-doctor", box=box.ROUNDED, expand=False)


def render_verdict(section: Verdict, width: int = 100):
    """The verdict's sentence and table: the text every presenter shows (fsdp_doctor.present.fmt)."""
    rows = verdict_rows(section)
    cols = [Col(c, justify="left" if c == "bound" else "right", drop=_verdict_drop(c, [r[k] for r in rows]))
            for k, c in enumerate(VERDICT_HEADER)]
    t = fitted_table(verdict_title(section) + verdict_steps(section), cols, rows, width,
                     styles=["bold" if r[0] == "job" else None for r in rows], compact=True)
    return Group(Text(verdict_headline(section), style="bold"), t)


# the verdict's columns dropped first at narrow widths: the comm parts (the "comm" column holds their sum), then
# the rarely non-zero ones
_VERDICT_DROP = {"AG fwd": 3, "AG bwd": 3, "RS": 3, "offload": 2, "idle": 1, "input": 1}


def _verdict_drop(column: str, cells: list) -> int:
    """A droppable column that reads 0.0 on every row goes before any other: at 80 columns the RS column, 24% of a
    gradient-accumulation run's step and the subject of its warning, was left out while offload and idle, 0.0 on
    every row, were kept (a new-user trial)."""
    drop = _VERDICT_DROP.get(column, 0)
    if drop and all(c in ("", "0.0", "-0.0") for c in cells):
        return max(_VERDICT_DROP.values()) + 1
    return drop


_STRAGGLERS = "and any straggler"  # (fmt.steps_ranks pins them)


def render_steps(section: StepsSection, width: int = 100):
    """``section``: ``report.steps``."""
    sec = section or StepsSection()
    cols = [Col("rank"), Col("steps", drop=2), Col("p50"), Col("p90", drop=3), Col("p99"), Col("max", drop=2),
            Col("cv"), Col("fwd", drop=1), Col("bwd", drop=1), Col("optim", drop=1), Col("outside", drop=1),
            Col("GC", drop=1)]
    keys = steps_keys(sec)
    shown, left = steps_ranks(sec)
    rows = steps_rows(sec, shown)
    if steps_traced(sec):  # no phase split from a trace: those columns would only hold dashes
        cols, rows = cols[:7], [r[:7] for r in rows]
    none = no_steady_text(sec)
    items = [Text(none) if none else fitted_table(steps_title(sec), cols, rows, width)]
    # (a line of its own under the table, not its caption, which wraps at the table's width: render_throughput)
    if not none and (line := ranks_left_out_line(left, keys, "step p50", fmt_ms, _STRAGGLERS)):
        items.append(Text(line, style="dim"))
    items += [Text(line) for _, line in apart_texts(sec)]
    if sec.outliers:
        items.append(fitted_table(outliers_title(sec.outliers),
                                  [Col("rank"), Col("step"), Col("time"), Col("median", drop=1),
                                   Col("likely cause", justify="left", wrap=True)],
                                  outlier_rows(sec.outliers), width))
    for s in sec.stragglers:
        items.append(Text(straggler_text(s), style="yellow"))
    return Group(*items)


def render_throughput(section: ThroughputSection, width: int = 100, steps: StepsSection | None = None):
    """``section``: ``report.throughput``; a figure not known is "—" (MFU: model FLOPs; HFU: with activation
    checkpointing's recompute). ``steps``: ``report.steps``, whose table's ranks a larger job's shows."""
    sec = section or ThroughputSection()
    keys = {r: row.step_p50_ms for r, row in sec.per_rank.items()}
    shown, left = steps_ranks(steps) if steps is not None and steps.per_rank else ranks_shown(keys)
    shown, left = [r for r in shown if r in keys], [r for r in left if r in keys]
    rows = throughput_rows(sec, shown)
    cols = [Col(h, drop=1 if h == "HFU" else 0) for h in THROUGHPUT_HEADER]
    table = fitted_table("Throughput", cols, rows, width, styles=["bold" if r[0] == "job" else None for r in rows])
    # the note under the table, not its caption: a caption wraps at the table's width ("job tokens/s: paced by the
    # slowest rank, rank 1 (step p50 …)" over three lines of 40 columns on a 200-column terminal: a new-user trial)
    notes = [ranks_left_out_line(left, keys, "step p50", fmt_ms, _STRAGGLERS), throughput_note(sec)]
    return Group(table, *(Text(n, style="dim") for n in notes if n))


UNIT_ROWS = 24


def render_units(units: list[UnitRow] | list[TraceUnitRow], width: int = 100):
    """``units``: ``report.unit_rows()``; each unit's own times, "—" where not timed. A plain trace's rows
    (``TraceUnitRow``: no configuration, no waits) give the times and where they come from."""
    labels = short_unit_labels(u.name for u in units)
    if units and isinstance(units[0], TraceUnitRow):
        rows = [(("  " * u.depth) + labels[u.name], *map(fmt_ms_cell, (u.timing_p50.fwd_self_ms, u.timing_p50.bwd_self_ms)))
                for u in units[:UNIT_ROWS]]
        if len(units) > UNIT_ROWS:
            rows.append((f"… {len(units) - UNIT_ROWS} more", "", ""))
        return Group(Text(trace_units_title(units)),
                     fitted_table("", [Col(TRACE_UNITS_HEADER[0], justify="left", wrap=True),
                                       *map(Col, TRACE_UNITS_HEADER[1:])], rows, width))
    cols = [Col("unit", justify="left", wrap=True), Col("params", drop=2), Col("shard", drop=3),
            Col("gathered", drop=1), Col("reshard", drop=2), Col("AC", drop=1), Col("fwd"), Col("AG wait"),
            Col("bwd"), Col("AG wait")]
    rows = []
    for u in units[:UNIT_ROWS]:
        tm = u.timing_p50
        times = (tm.fwd_self_ms, tm.ag_wait_fwd_ms, tm.bwd_self_ms, tm.ag_wait_bwd_ms) if tm else (None,) * 4
        rows.append((("  " * u.depth) + labels[u.name], *fmt_unit_figures(u), fmt_checkpoint(u), *map(fmt_ms_cell, times)))
    if len(units) > UNIT_ROWS:
        rows.append((f"… {len(units) - UNIT_ROWS} more", *[""] * 9))
    notes = [n for n in (units_not_run_note(units), units_hooks_timed_note(units)) if n]
    return fitted_table(f"FSDP units ({len(units)}); per-step medians in ms, each unit's own time (nested units "
                        "excluded); AG wait: forward, then backward", cols, rows, width,
                        caption="\n".join(notes) or None)


def findings_summary(findings: list[Finding], rules: list | None = None, verdict=None):
    """The findings' headlines, one line each (severity, code, title, expected change): printed right after the
    verdict so that they sit on the first screen; the details follow under "Diagnosis"."""
    head = findings_headline(findings, rules, verdict)
    worst = {f.severity for f in findings}
    lines = [Text(head, style="green" if not worst & {"critical", "warning"} else "bold")]
    for f in findings:
        line = Text("  ")
        line.append(f.severity.upper(), style=SEVERITY_STYLE.get(f.severity, ""))
        line.append(f" {f.code}: {f.title}")
        expected = predicted_text(f.predicted)
        if expected:
            line.append(f" ({expected})", style="green")
        lines.append(line)
    return Group(*lines)


def finding_details(f: Finding) -> list:
    """One finding's details: title, advice, evidence with units, expected change, and the fix as plain code (no
    border: a copy pastes as code)."""
    style = SEVERITY_STYLE.get(f.severity, "")
    title = Text()
    title.append(f.severity.upper(), style=style)
    title.append(f" {f.code}: {f.title}", style="bold")
    rec = f.recommendation
    items = [title, Text(rec.text)]
    if f.evidence:
        rows = evidence_rows(f.evidence)
        items.append(Text("Evidence:\n" + "\n".join(f"  {label}: {value}" for label, value in rows),
                          style="dim"))
    expected = predicted_text(f.predicted)
    if expected:
        items.append(Text(f"Expected: {expected}", style="green"))
    if rec.code:
        # the names it reads from the user's code on a line of their own before the heading: wrapped after it, a
        # terminal's continuation line sat right above the code and was copied with it (a SyntaxError: a new-user
        # trial); the line right above the code is the heading alone
        if rec.inputs:
            items.append(Text(f"The fix uses from your code: {fix_inputs(rec)}", style="dim"))
        items.append(Text(fix_heading(rec, inputs=False), style="dim"))
        # (a command line, a config's YAML: not Python)
        lexer = {"command line": "bash", "YAML": "yaml", "shell": "bash"}.get(FIX_LANGUAGES.get(rec.where, ""),
                                                                             "python")
        code = rec.code if lexer != "python" else fit_comments(rec.code)
        items.append(Syntax(code, lexer, theme="ansi_dark", background_color="default", word_wrap=False))
    return items


def render_findings(findings: list[Finding]):
    """``findings``: ``report.findings``: the headlines, then each finding with its evidence, fix and expected
    gain."""
    items = [findings_summary(findings)]
    for f in findings:
        items += [Text(""), *finding_details(f)]
    return Group(*items)


def render_report(report: Report | dict, console: Console | None = None) -> None:
    """Prints the report (a :class:`~fsdp_doctor.report_sections.Report`, or its JSON form): first what a reader
    needs on the first screen (run facts, the verdict, exposed communication, the findings' headlines), then the
    sections, then each finding in full. Tables fit the console's width."""
    report = printable_report(Report.of(report))  # no escape sequence from a module or file name reaches the terminal
    console = console or Console(width=100)
    w = console.width
    console.print(render_header(report, w))
    if report.verdict is not None:
        console.print(render_verdict(report.verdict, w))
    head = comm_headline(report.comm)
    if head:
        console.print(Text(head, style="bold"))
    console.print(findings_summary(report.findings, report.rules, report.verdict))
    if report.steps is not None or report.trace_steps is not None:
        console.print(render_steps(report.steps or report.trace_steps, w))
    if report.throughput is not None:
        console.print(render_throughput(report.throughput, w, report.steps))
    if report.unit_rows():
        console.print(render_units(report.unit_rows(), w))
    if report.memory_section() is not None:
        from .memory import render_memory

        console.print(render_memory(report.memory_section(), w))
    if report.overlap is not None:
        from .overlap import render_overlap

        console.print(render_overlap(report.overlap, skipped=False, width=w,  # skipped: listed with the problems
                                     names=[u.name for u in report.units or []]))
    if report.findings:
        console.rule("Diagnosis")
        if note := fixes_note(report.findings):
            console.print(Text(note, style="dim"))
    for f in report.findings:
        for item in finding_details(f):
            # code lines are never folded: the terminal wraps a long one on screen, a copy stays one line
            console.print(item, soft_wrap=isinstance(item, Syntax))
        console.print()
    # one line each, never folded (as code lines): a copy or a grep gets it whole; a larger job's lines that differ
    # only in the rank they name, one line (fmt.folded_problems)
    for p in folded_problems(report.problems):
        console.print(Text(problem_line(p), style="yellow"), soft_wrap=True)
