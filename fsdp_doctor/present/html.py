"""HTML presenter: one self-contained file (plotly.js inlined once, no network) with what the terminal shows
(the verdict, step percentiles, outliers and stragglers, throughput, the unit and collective tables, the
findings) and the figures, drawn by the dashboard's builders (:mod:`fsdp_doctor.present.figures`). Formats the
report; computes nothing.

plotly.js: the report draws only bars and scatter traces, which plotly.js's *basic* bundle holds (1.2 MB against
4.8 MB for the full one). ``make setup`` installs it from the npm registry (``plotly.js-basic-dist-min``, the
version plotly.py bundles) into ``<venv>/share/fsdp-doctor/``; ``FSDP_DOCTOR_PLOTLYJS`` may name another copy.
Without it, or when its version differs from plotly.py's, the full bundle plotly.py ships is inlined."""

from __future__ import annotations

import html
import json
import os
import sys
from pathlib import Path
from typing import Any, Optional

from ..report_sections import (Finding, MemorySection, OverlapSection, Report, StepsSection,
                               ThroughputSection, TraceUnitRow, UnitRow, Verdict)
from . import figures as F
from .fmt import (fix_heading, fixes_note, problem_text, comm_unit_rows, comm_units_title, overlap_rank_rows,
                  left_out_note, slack_note, COMM_UNITS_HEADER, MEMORY_UNITS_HEADER, OUTLIERS_HEADER, OVERLAP_RANKS_HEADER, OVERLAP_RANKS_TITLE, SEVERITY_COLORS, STEPS_HEADER,
                  THROUGHPUT_HEADER, TRACE_MEMORY_HEADER, TRACE_UNITS_HEADER, VERDICT_HEADER, comm_headline, findings_headline, fmt_bytes, fmt_ms,
                  fmt_checkpoint, fmt_unit_figures, evidence_rows, memory_lines, memory_rows, memory_unit_rows,
                  apart_texts, outlier_rows, outliers_title, predicted_text, run_facts, run_warnings, steps_rows,
                  steps_title, no_steady_text, straggler_text, throughput_rows, unit_exposed_note,
                  throughput_note, trace_memory_rows, trace_units_title, unit_label, verdict_headline, verdict_rows,
                  units_hooks_timed_note)

_CSS = """
body{font-family:-apple-system,BlinkMacSystemFont,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;margin:0;
     background:#f6f7f9;color:#222}
main{max-width:1100px;margin:0 auto;padding:16px 24px 48px}
h1{font-size:22px;margin:8px 0 4px} h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd;
     padding-bottom:4px}
.facts{color:#555;font-size:13px} .healthy{background:#e8f5e9;border-left:5px solid #2e7d32;padding:10px 14px;
     font-weight:600}
.finding{background:#fff;border-left:6px solid #999;border-radius:4px;margin:12px 0;padding:10px 14px;
     box-shadow:0 1px 2px rgba(0,0,0,.06)}
.finding h3{margin:0 0 6px;font-size:15px} .sev{font-weight:700;text-transform:uppercase;font-size:12px;
     padding:1px 6px;border-radius:3px;color:#fff;margin-right:6px}
.code{color:#666;font-family:monospace;font-size:12px;margin-left:4px}
pre{background:#1e1e1e;color:#eee;padding:10px;border-radius:4px;overflow-x:auto;font-size:12px}
table{border-collapse:collapse;font-size:12px;margin:6px 0} td,th{padding:2px 10px 2px 0;text-align:left;
     vertical-align:top} th{color:#555;font-weight:600}
.pred{color:#2e7d32;font-weight:600;margin:6px 0} .note{color:#777;font-size:13px}
.warn{color:#8a6d00;font-weight:600} .err{color:#C62828;font-weight:600} h3{font-size:14px;margin:14px 0 4px}
table.num td,table.num th{text-align:right} table.num .l{text-align:left}
.fig{background:#fff;border-radius:4px;margin:10px 0;padding:4px}
.verdict{background:#fff;border-left:6px solid #4C78A8;border-radius:4px;margin:14px 0 6px;padding:10px 14px;
     font-size:16px;font-weight:600}
"""


def _esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


# ---------------------------------------------------------------------------------------------- figures
PARTIAL_BUNDLE = "plotly-basic.min.js"  # npm plotly.js-basic-dist-min: bar and scatter, all the report draws
PLOTLYJS_ENV = "FSDP_DOCTOR_PLOTLYJS"


def partial_plotlyjs() -> Optional[str]:
    """plotly.js's basic bundle when one of the same version as plotly.py's is installed (see the module doc)."""
    from plotly.offline import get_plotlyjs_version

    want = f" v{get_plotlyjs_version()}\n"
    for cand in (os.environ.get(PLOTLYJS_ENV), Path(sys.prefix) / "share" / "fsdp-doctor" / PARTIAL_BUNDLE):
        if not cand or not Path(cand).is_file():
            continue
        try:
            text = Path(cand).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if want in text[:300] and "plotly.js (basic" in text[:300]:
            return text
    return None


def _plotlyjs_script(bundle: str) -> str:
    """The bundle inlined as plotly.py inlines its own (MathJax left alone, no network)."""
    safe = bundle.replace("</script", "<\\/script")
    return ("<script type='text/javascript'>window.PlotlyConfig = {MathJaxConfig: 'local'};</script>"
            f"<script type='text/javascript'>{safe}</script>")


def _figure(fig, first: bool) -> str:
    return fig.to_html(full_html=False, include_plotlyjs=True if first else False,
                       config={"displaylogo": False, "responsive": True})


# ---------------------------------------------------------------------------------------------- html parts
def _header(report: Report) -> str:
    r = report.run
    facts = run_facts(r)
    if r.capacity_bytes:
        facts.append(f"capacity {fmt_bytes(r.capacity_bytes)}")
    job = report.steps.job if report.steps is not None else None
    if job is not None and job.p50_ms:
        facts.append(f"step p50 {fmt_ms(job.p50_ms)}")
    cls = {"error": "err", "note": "note"}
    warn = "".join(f"<p class='{cls.get(w.level, 'warn')}'>{_esc(w.text)}</p>" for w in run_warnings(r))
    return (f"<h1>fsdp-doctor report</h1><div class='facts'>{_esc(r.path)}<br>"
            f"{_esc(' · '.join(facts))}<br>report schema {_esc(report.schema)}, "
            f"doctor {_esc(report.doctor_version)}</div>{warn}")


def _finding(f: Finding) -> str:
    color = SEVERITY_COLORS.get(f.severity, "#999")
    rec = f.recommendation
    ev = "".join(f"<tr><th>{_esc(label)}</th><td>{_esc(value)}</td></tr>"
                 for label, value in evidence_rows(f.evidence, max_items=10))
    code = (f"<div class='fixhead'>{_esc(fix_heading(rec))}</div><pre><code>{_esc(rec.code)}</code></pre>"
            if rec.code else "")
    expected = predicted_text(f.predicted)
    pred = f"<div class='pred'>Expected: {_esc(expected)}</div>" if expected else ""
    return (f"<div class='finding' style='border-left-color:{color}'>"
            f"<h3><span class='sev' style='background:{color}'>{_esc(f.severity)}</span>{_esc(f.title)}"
            f"<span class='code'>{_esc(f.code)}</span></h3>"
            f"<div>{_esc(rec.text)}</div>{pred}"
            f"<table>{ev}</table>{code}</div>")


def _findings(findings: list[Finding], rules: list | None = None, verdict=None) -> str:
    sevs = {f.severity for f in findings}
    cls = "healthy" if not sevs & {"warning", "critical"} else "facts"
    return (f"<div class='{cls}'>{_esc(findings_headline(findings, rules, verdict))}</div>"
            + "".join(_finding(f) for f in findings))


def _overlap_ranks_table(overlap: OverlapSection) -> str:
    """Per rank, per complete profiled step: the terminal's table, its title and columns (fmt.overlap_rank_rows)."""
    return f"<h3>{_esc(OVERLAP_RANKS_TITLE)}</h3>" + _table(OVERLAP_RANKS_HEADER, overlap_rank_rows(overlap),
                                                          "overlap-ranks-table")


def _comm_units_table(overlap: OverlapSection, names: list[str], top: int = 15) -> str:
    """The per-unit collectives, worst exposure first: the terminal's table, its title, columns and labels
    (fmt.comm_unit_rows; ``names``: the run's units, as the terminal's)."""
    if not overlap.per_unit:
        return ""
    return f"<h3>{_esc(comm_units_title(overlap.per_unit, top))}</h3>" + _table(
        COMM_UNITS_HEADER, comm_unit_rows(overlap.per_unit, top, [*names, *(u.name for u in overlap.units or ())]),
        "comm-units-table", left=(1, 2))


def _units_table(units: list[UnitRow] | list[TraceUnitRow]) -> str:
    if not units:
        return ""
    if isinstance(units[0], TraceUnitRow):  # a plain trace's: times only (the terminal's table)
        rows = [(("\u2003" * u.depth) + unit_label(u.name), fmt_ms(u.timing_p50.fwd_self_ms),
                 fmt_ms(u.timing_p50.bwd_self_ms)) for u in units[:64]]
        return f"<p class='note'>{_esc(trace_units_title(units))}</p>" + _table(TRACE_UNITS_HEADER, rows, "units-table")
    head = ("<tr><th>unit</th><th>params</th><th>shard</th><th>gathered</th><th>reshard</th><th>AC</th>"
            "<th>fwd</th><th>AG wait</th><th>bwd</th><th>AG wait</th></tr>")
    rows = []
    for u in units[:64]:
        t = u.timing_p50
        times = (t.fwd_self_ms, t.ag_wait_fwd_ms, t.bwd_self_ms, t.ag_wait_bwd_ms) if t else (None,) * 4
        rows.append(f"<tr><td style='padding-left:{12 * u.depth}px'>{_esc(unit_label(u.name or ''))}</td>" + "".join(
            f"<td>{_esc(x)}</td>" for x in (*fmt_unit_figures(u), fmt_checkpoint(u), *map(fmt_ms, times))) + "</tr>")
    more = f"<tr><td>… {len(units) - 64} more</td></tr>" if len(units) > 64 else ""
    hooked = units_hooks_timed_note(units)
    return (f"<p class='note'>Per-step medians; each unit's own time (nested units excluded).</p>"
            f"<table>{head}{''.join(rows)}{more}</table>"
            + (f"<p class='note'>{_esc(hooked)}</p>" if hooked else ""))


def _table(header, rows, tid: str, left: tuple[int, ...] = (0,), cls: str = "num") -> str:
    """A table of text cells (the terminal's cells: fsdp_doctor.present.fmt): numbers right-aligned, the columns
    ``left`` left-aligned, the job's row (first cell "job") in bold."""
    def cells(row, tag):
        return "".join(f"<{tag}{' class=l' if i in left else ''}>{_esc(x)}</{tag}>" for i, x in enumerate(row))
    body = "".join(f"<tr{' style=font-weight:600' if r[0] == 'job' else ''}>{cells(r, 'td')}</tr>" for r in rows)
    return f"<table class='{cls}' id='{tid}'><tr>{cells(header, 'th')}</tr>{body}</table>"


def _steps(section: StepsSection) -> str:
    """The terminal's step table (percentiles and phases per rank), its outliers and stragglers."""
    none = no_steady_text(section)
    out = (f"<p class='note'>{_esc(none)}</p>" if none else
           f"<h3>{_esc(steps_title(section))}</h3>" + _table(STEPS_HEADER, steps_rows(section), "steps-table"))
    out += "".join(f"<p class='{key}'>{_esc(line)}</p>" for key, line in apart_texts(section))
    if section.outliers:
        out += f"<h3>{_esc(outliers_title(section.outliers))}</h3>" + _table(
            OUTLIERS_HEADER, outlier_rows(section.outliers), "outliers-table", left=(4,))
    out += "".join(f"<p class='warn'>{_esc(straggler_text(s))}</p>" for s in section.stragglers)
    return out


def _memory(section: MemorySection) -> str:
    """The terminal's breakdown at the peak (bytes and % of the peak per category and rank) and its lines."""
    if not section.per_rank:
        return ""
    if section.source != "records":  # a plain trace's allocator totals (the terminal's table)
        return (f"<p class='note'>Peak allocated per rank over the complete steps ({_esc(section.source)})</p>" +
                _table(TRACE_MEMORY_HEADER, trace_memory_rows(section), "memory-table", left=(4,)))
    header, rows = memory_rows(section)
    lines = "".join(f"<p class='{ {'error': 'err', 'warning': 'warn'}.get(kind, 'note') }'>{_esc(text)}</p>"
                    for text, kind in memory_lines(section))
    rank, units = memory_unit_rows(section)
    per_unit = (f"<h3>Per unit (rank {_esc(rank)})</h3>" + _table(MEMORY_UNITS_HEADER, units, "memory-units-table")
                if units else "")
    return _table(header, rows, "memory-table") + lines + per_unit


def _throughput(section: ThroughputSection) -> str:
    rows = throughput_rows(section)
    note = "".join(f"<p class='note'>{_esc(line)}</p>" for line in throughput_note(section).splitlines())
    return "<h2>Throughput</h2>" + _table(THROUGHPUT_HEADER, rows, "throughput-table") + note if rows else ""


def _verdict_table(section: Verdict) -> str:
    """The terminal's verdict table, the same rows (fsdp_doctor.present.fmt.verdict_rows)."""
    return _table(VERDICT_HEADER, verdict_rows(section), "verdict-table", left=(1,), cls="num verdict-table")


def _verdict(section: Verdict, first: bool) -> tuple[str, bool]:
    """What bounds the step, first: the sentence, the shares as a bar per rank and the job, and the table.
    Returns the HTML and whether it drew a figure (plotly.js goes with the first one)."""
    out = f"<div class='verdict' id='verdict'>{_esc(verdict_headline(section))}</div>"
    try:
        out += f"<div class='fig'>{_figure(F.verdict_figure(section), first)}</div>"
        drew = True
    except Exception as e:  # noqa: BLE001  (a figure must never take the report down)
        out += f"<p class='note'>figure unavailable ({_esc(type(e).__name__)}: {_esc(e)})</p>"
        drew = False
    return out + _verdict_table(section), drew


def render_html(report: Report | dict) -> str:
    """The whole report (a :class:`~fsdp_doctor.report_sections.Report`, or its JSON form) as one HTML document
    (plotly.js inlined once, before the first figure)."""
    report = Report.of(report)
    parts = [_header(report)]
    ov = report.overlap
    # (heading, what precedes the figure, figure builder, its section, what to say without it, the tables that
    # follow the figure)
    sections = [
        # (plain traces: their complete ProfilerSteps, as the terminal shows them; "No step records." read as none)
        ("Steps", None, F.step_summary_figure, report.steps or report.trace_steps, "No step records.",
         lambda: _steps(report.steps or report.trace_steps)
         + (_throughput(report.throughput) if report.throughput is not None else "")),
        ("Memory", None, F.memory_peaks_figure, report.memory_section(), "No memory measurements in this report.",
         lambda: _memory(report.memory_section())),
        (None, None, F.memory_units_figure, report.memory, None, None),
        # the terminal's two tables, each under its own title: per rank, then per unit below their figure
        ("Communication", ov and ov.per_rank and (lambda: _overlap_ranks_table(ov)), F.unit_exposure_figure,
         ov and ov.per_unit, "No profiler traces: per-unit overlap needs a profiled window.",
         lambda: _comm_units_table(ov, [u.name for u in report.units or []]) + "".join(
             f"<p class='note'>{_esc(n)}</p>" for n in (left_out_note(ov), slack_note(ov), unit_exposed_note(ov))
             if n)),
        (None, None, F.unit_timing_figure, report.unit_rows(), None, None),
    ]
    bundle = partial_plotlyjs()
    if bundle is not None:
        parts.append(_plotlyjs_script(bundle))
    first = bundle is None
    if report.verdict is not None:
        text, drew = _verdict(report.verdict, first)
        parts.append(text)
        first = first and not drew
    note = fixes_note(report.findings)
    parts += ["<h2>Diagnosis</h2>", *([f"<p class='note'>{_esc(note)}</p>"] if note else []),
              _findings(report.findings, report.rules, report.verdict)]
    for title, lead, builder, data, missing, tables in sections:
        if title:
            parts.append(f"<h2>{_esc(title)}</h2>")
        if lead:
            parts.append(lead())
        fig = None
        try:
            fig = builder(data) if data else None
        except Exception as e:  # noqa: BLE001  (a figure must never take the report down)
            parts.append(f"<p class='note'>figure unavailable ({_esc(type(e).__name__)}: {_esc(e)})</p>")
        if fig is not None:
            parts.append(f"<div class='fig'>{_figure(fig, first)}</div>")
            first = False
        elif missing:
            parts.append(f"<p class='note'>{_esc(missing)}</p>")
        if tables is not None and data:
            parts.append(tables())
    head = comm_headline(report.comm)
    if head:
        parts.append(f"<p class='pred'>{_esc(head)}</p>")
    if report.unit_rows():
        parts.append("<h2>FSDP units</h2>" + _units_table(report.unit_rows()))
    if report.problems:
        parts.append("<h2>Problems: files left out, ranks that did not finish</h2><ul>" + "".join(f"<li>{_esc(problem_text(p))}</li>" for p in report.problems)
                     + "</ul>")
    data = json.dumps(report.to_builtins(), default=str).replace("</", "<\\/")
    parts.append(f"<script type='application/json' id='fsdp-doctor-report'>{data}</script>")
    return html_page(f"fsdp-doctor — {report.run.path or 'report'}", "".join(parts))


def html_page(title: str, body: str) -> str:
    """One self-contained HTML document: the report's style, ``title`` (escaped here) and ``body`` (HTML)."""
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<title>{_esc(title)}</title><style>{_CSS}</style></head><body><main>{body}</main></body></html>")


def write_html(report: Report | dict, path: Path) -> Path:
    """Writes the report (a Report, or its JSON form) as one self-contained HTML file (no network needed to view
    it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)  # the CLI checks --html's directory exists before any work
    from ..store.layout import write_atomic

    write_atomic(path, render_html(report))
    return path
