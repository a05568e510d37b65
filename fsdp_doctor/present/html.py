"""HTML presenter: one self-contained file (plotly.js inlined once, no network) with the findings, the
memory breakdown at the peak, per-unit communication exposure and the step timeline. Formats the report;
computes nothing.

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

from msgspec import UNSET

from .. import memory_categories as MC
from ..report_sections import (CommUnitRow, Finding, MemorySection, OverlapSection, Report, StepsSection, UnitRow,
                               Verdict)
from .fmt import (VERDICT_HEADER, comm_headline, findings_headline, fmt_bw, fmt_bytes, fmt_ms, fmt_pct, fmt_unit_figures,
                  fmt_us, fmt_value, predicted_text, run_facts, unit_label, verdict_headline, verdict_rows)

PHASES = ("forward", "backward", "optimizer", "outside")
PHASE_COLORS = {"forward": "#4C78A8", "backward": "#F58518", "optimizer": "#54A24B", "outside": "#B279A2",
                "gc": "#E45756"}
MEMORY_CATEGORIES = MC.NAMES
MEMORY_COLORS = MC.COLOURS
COLLECTIVE_COLORS = {"all_gather (forward)": "#4C78A8", "all_gather (backward)": "#72B7B2",
                     "reduce_scatter (backward)": "#F58518", "all_reduce": "#E45756"}
SEVERITY_COLORS = {"critical": "#C62828", "warning": "#E0A100", "info": "#1E88E5"}
MIB = float(1 << 20)

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
.fig{background:#fff;border-radius:4px;margin:10px 0;padding:4px}
.verdict{background:#fff;border-left:6px solid #4C78A8;border-radius:4px;margin:14px 0 6px;padding:10px 14px;
     font-size:16px;font-weight:600}
table.verdict-table td,table.verdict-table th{text-align:right} table.verdict-table .l{text-align:left}
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


def _layout(fig, title: str, height: int = 340, **kw):
    fig.update_layout(title={"text": title, "x": 0.01, "xanchor": "left", "font": {"size": 15}},
                      template="plotly_white", height=height, margin={"l": 60, "r": 20, "t": 56, "b": 44},
                      legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "xanchor": "right", "x": 1.0},
                      **kw)
    return fig


def memory_figure(memory: MemorySection):
    """Stacked bars: each rank's peak by category (MiB), with the capacity as a line."""
    import plotly.graph_objects as go

    per_rank = memory.per_rank
    ranks = sorted(per_rank, key=lambda r: int(r) if str(r).isdigit() else str(r))
    if not ranks:
        return None
    fig = go.Figure()
    cats = [c for c in MEMORY_CATEGORIES if any(per_rank[r].peak_breakdown.get(c) for r in ranks)]
    extra = sorted({c for r in ranks for c in per_rank[r].peak_breakdown if c not in MEMORY_CATEGORIES})
    for c in cats + extra:
        ys = [(per_rank[r].peak_breakdown.get(c) or 0) / MIB for r in ranks]
        fig.add_bar(name=c, x=[f"rank {r}" for r in ranks], y=ys, marker_color=MEMORY_COLORS.get(c),
                    hovertemplate=f"{c}: %{{y:.2f}} MiB<extra></extra>")
    caps = [per_rank[r].capacity_bytes for r in ranks if per_rank[r].capacity_bytes]
    if caps:
        fig.add_hline(y=max(caps) / MIB, line_dash="dash", line_color="#C62828",
                      annotation_text=f"capacity {fmt_bytes(max(caps))}", annotation_position="top left")
    where = []
    for r in ranks:
        at = per_rank[r].peak_at
        if at.step is not None:
            where.append(f"rank {r}: step {at.step}, {unit_label(at.unit or '')} {at.phase or ''}")
    title = "Memory at the peak, by category" + (" — " + "; ".join(where[:4]) if where else "")
    return _layout(fig, title, barmode="stack", yaxis_title="MiB")


def memory_units_figure(memory: MemorySection):
    """Per unit on the peak rank: sharded and unsharded parameter bytes and the activations it left."""
    import plotly.graph_objects as go

    best = max(memory.per_rank.items(), key=lambda kv: kv[1].peak_bytes or 0, default=None)
    if not best or not best[1].per_unit:
        return None
    rows = best[1].per_unit
    names = [unit_label(u.unit or "") for u in rows]
    fig = go.Figure()
    # each unit's own activations (nested units excluded): the bars add up instead of counting a parent's children
    # twice; a report written before own activations existed has the inclusive figure only
    own = any(u.activation_self_bytes is not UNSET for u in rows)
    series = (("sharded", "#1F77B4", [u.sharded_bytes for u in rows]),
              ("unsharded", "#AEC7E8", [u.unsharded_bytes for u in rows]),
              ("activations (own)", "#D62728", [(u.activation_self_bytes or 0) if own else u.activation_bytes
                                                for u in rows]))
    for label, color, values in series:
        if any(values):
            fig.add_bar(name=label, x=names, y=[(v or 0) / MIB for v in values], marker_color=color)
    return _layout(fig, f"Memory per unit (rank {best[0]}), MiB", barmode="group", yaxis_title="MiB")


def overlap_units_figure(overlap: OverlapSection):
    """Per unit and collective: time in the collective and the part not overlapped by compute (ms per
    profiled window, summed over ranks)."""
    import plotly.graph_objects as go

    rows = overlap.per_unit
    if not rows:
        return None
    acc: dict[tuple[str, str], list[float]] = {}
    order: list[str] = []
    for r in rows:
        unit = unit_label(r.unit or "")
        if unit not in order:
            order.append(unit)
        a = acc.setdefault((unit, f"{r.collective} ({r.phase or '-'})"), [0.0, 0.0])
        a[0] += r.comm_us / 1e3
        a[1] += r.exposed_us / 1e3
    series = sorted({k[1] for k in acc})
    fig = go.Figure()
    for s in series:
        color = COLLECTIVE_COLORS.get(s) or COLLECTIVE_COLORS.get(s.split(" ")[0], "#9D9D9D")
        xs = [u for u in order if (u, s) in acc]
        fig.add_bar(name=f"{s} exposed", x=xs, y=[acc[(u, s)][1] for u in xs], marker_color=color,
                    offsetgroup=s, hovertemplate="%{x}: %{y:.2f} ms exposed<extra>" + s + "</extra>")
        fig.add_bar(name=f"{s} overlapped", x=xs, y=[acc[(u, s)][0] - acc[(u, s)][1] for u in xs],
                    marker_color=color, opacity=0.35, offsetgroup=s, base=[acc[(u, s)][1] for u in xs],
                    hovertemplate="%{x}: %{y:.2f} ms overlapped<extra>" + s + "</extra>")
    fig = _layout(fig, "Collectives per unit: exposed (solid) and overlapped (light), ms in the profiled windows",
                  height=420, barmode="group", yaxis_title="ms")
    fig.update_layout(legend={"orientation": "h", "yanchor": "top", "y": -0.12, "xanchor": "left", "x": 0.0},
                      margin={"b": 110})
    return fig


def unit_waits_figure(units: list[UnitRow]):
    """Host-measured per-unit medians: forward/backward own time and the all-gather waits inside them."""
    import plotly.graph_objects as go

    rows = [u for u in units if u.timing_p50]
    if not rows:
        return None
    names = [unit_label(u.name or "") for u in rows]
    fig = go.Figure()
    ts = [u.timing_p50 for u in rows]
    series = (("forward", "#4C78A8", 0.35, [t.fwd_self_ms for t in ts]),
              ("AG wait (fwd)", "#4C78A8", 1.0, [t.ag_wait_fwd_ms for t in ts]),
              ("backward", "#F58518", 0.35, [t.bwd_self_ms for t in ts]),
              ("AG wait (bwd)", "#F58518", 1.0, [t.ag_wait_bwd_ms for t in ts]),
              ("recompute", "#E45756", 1.0, [t.recompute_ms for t in ts]))
    for label, color, op, values in series:
        ys = [v or 0 for v in values]
        if any(ys):
            fig.add_bar(name=label, x=names, y=ys, marker_color=color, opacity=op)
    return _layout(fig, "Per unit, median per step (host-measured; own time, nested units excluded)",
                   barmode="group", yaxis_title="ms")


def step_timeline_figure(steps: StepsSection):
    """The median step of each rank as a timeline of its phases, with outlier steps marked."""
    import plotly.graph_objects as go

    per_rank = steps.per_rank
    ranks = [r for r in sorted(per_rank, key=lambda r: int(r) if str(r).isdigit() else str(r)) if per_rank[r].count]
    if not ranks:
        return None
    fig = go.Figure()
    labels = [f"rank {r}" for r in ranks]
    for ph in PHASES:
        xs = [(per_rank[r].phases_p50_ms or {}).get(ph) or 0 for r in ranks]
        fig.add_bar(name=ph, y=labels, x=xs, orientation="h", marker_color=PHASE_COLORS[ph],
                    hovertemplate=f"{ph}: %{{x:.1f}} ms<extra></extra>")
    outs = steps.outliers
    if outs:
        fig.add_scatter(name="outlier steps", mode="markers", marker={"symbol": "x", "size": 10, "color": "#C62828"},
                        x=[o.ms for o in outs], y=[f"rank {o.rank}" for o in outs],
                        text=[f"step {o.step}: {o.detail}" for o in outs],
                        hovertemplate="%{text}<br>%{x:.1f} ms<extra></extra>")
    for r, lab in zip(ranks, labels):
        p50 = per_rank[r].p50_ms
        if p50:
            fig.add_annotation(x=p50, y=lab, text=f"p50 {fmt_ms(p50)}", showarrow=False, xanchor="left",
                               font={"size": 11, "color": "#444"})
    return _layout(fig, "Step timeline: median time per phase (ms); × = outlier steps",
                   height=max(220, 90 + 50 * len(ranks)), barmode="stack", xaxis_title="ms")


# ---------------------------------------------------------------------------------------------- html parts
def _header(report: Report) -> str:
    r = report.run
    facts = run_facts(r)
    if r.capacity_bytes:
        facts.append(f"capacity {fmt_bytes(r.capacity_bytes)}")
    job = report.steps.job if report.steps is not None else None
    if job is not None and job.p50_ms:
        facts.append(f"step p50 {fmt_ms(job.p50_ms)}")
    return (f"<h1>fsdp-doctor report</h1><div class='facts'>{_esc(r.path)}<br>"
            f"{_esc(' · '.join(facts))}<br>report schema {_esc(report.schema)}, "
            f"doctor {_esc(report.doctor_version)}</div>")


def _finding(f: Finding) -> str:
    color = SEVERITY_COLORS.get(f.severity, "#999")
    rec = f.recommendation
    ev = "".join(f"<tr><th>{_esc(k)}</th><td>{_esc(fmt_value(k, v, max_items=10))}</td></tr>"
                 for k, v in f.evidence.items())
    code = f"<pre><code>{_esc(rec.code)}</code></pre>" if rec.code else ""
    expected = predicted_text(f.predicted)
    pred = f"<div class='pred'>Expected: {_esc(expected)}</div>" if expected else ""
    return (f"<div class='finding' style='border-left-color:{color}'>"
            f"<h3><span class='sev' style='background:{color}'>{_esc(f.severity)}</span>{_esc(f.title)}"
            f"<span class='code'>{_esc(f.code)}</span></h3>"
            f"<div>{_esc(rec.text)}</div>{pred}"
            f"<table>{ev}</table>{code}</div>")


def _findings(findings: list[Finding]) -> str:
    sevs = {f.severity for f in findings}
    cls = "healthy" if not sevs & {"warning", "critical"} else "facts"
    return f"<div class='{cls}'>{_esc(findings_headline(findings))}</div>" + "".join(_finding(f) for f in findings)


def _overlap_ranks_table(overlap: OverlapSection) -> str:
    """Per rank, per complete profiled step (the report's ``OverlapRank.*_per_step``, as the terminal)."""
    rows = "".join(
        f"<tr><td>{_esc(r)}</td><td>{fmt_ms(v.step_ms)}</td><td>{fmt_ms(v.comm_ms_per_step)}</td>"
        f"<td>{fmt_ms(v.exposed_ms_per_step)}</td><td>{fmt_pct(v.overlap_pct)}</td></tr>"
        for r, v in sorted(overlap.per_rank.items()))
    return ("<table><tr><th>rank</th><th>step</th><th>communication / step</th><th>exposed / step</th>"
            f"<th>overlap</th></tr>{rows}</table>")


def _comm_units_table(per_unit: list[CommUnitRow], top: int = 15) -> str:
    """The per-unit collectives, worst exposure first: the terminal's table, same formatters."""
    if not per_unit:
        return ""
    head = ("<tr><th>rank</th><th>unit</th><th>collective</th><th>phase</th><th>calls / step</th><th>time / step</th>"
            "<th>exposed / step</th><th>bytes / call</th><th>bus BW</th><th>slack</th></tr>")
    rows = "".join(
        "<tr>" + "".join(f"<td>{_esc(x)}</td>" for x in (
            r.rank, unit_label(r.unit), r.collective, r.phase or "—",
            "—" if r.count_per_step is None else f"{r.count_per_step:.3g}",
            fmt_ms(r.comm_ms_per_step), fmt_ms(r.exposed_ms_per_step), fmt_bytes(r.bytes_per_call),
            fmt_bw(r.busbw_gbps), fmt_us(r.slack_us, signed=True))) + "</tr>"
        for r in per_unit[:top])
    more = f"<p class='note'>top {top} of {len(per_unit)}</p>" if len(per_unit) > top else ""
    return f"<table>{head}{rows}</table>{more}"


def _units_table(units: list[UnitRow]) -> str:
    if not units:
        return ""
    head = ("<tr><th>unit</th><th>params</th><th>shard</th><th>gathered</th><th>reshard</th><th>AC</th>"
            "<th>fwd</th><th>AG wait</th><th>bwd</th><th>AG wait</th></tr>")
    rows = []
    for u in units[:64]:
        t = u.timing_p50
        times = (t.fwd_self_ms, t.ag_wait_fwd_ms, t.bwd_self_ms, t.ag_wait_bwd_ms) if t else (None,) * 4
        rows.append(f"<tr><td style='padding-left:{12 * u.depth}px'>{_esc(unit_label(u.name or ''))}</td>" + "".join(
            f"<td>{_esc(x)}</td>" for x in (*fmt_unit_figures(u), u.checkpoint, *map(fmt_ms, times))) + "</tr>")
    more = f"<tr><td>… {len(units) - 64} more</td></tr>" if len(units) > 64 else ""
    return (f"<p class='note'>Per-step medians; each unit's own time (nested units excluded).</p>"
            f"<table>{head}{''.join(rows)}{more}</table>")


def _verdict_table(section: Verdict) -> str:
    """The terminal's verdict table, the same rows (fsdp_doctor.present.fmt.verdict_rows)."""
    def cells(row, tag):
        return "".join(f"<{tag}{' class=l' if i == 1 else ''}>{_esc(x)}</{tag}>" for i, x in enumerate(row))
    body = "".join(f"<tr{' style=font-weight:600' if r[0] == 'job' else ''}>{cells(r, 'td')}</tr>"
                   for r in verdict_rows(section))
    return f"<table class='verdict-table'><tr>{cells(VERDICT_HEADER, 'th')}</tr>{body}</table>"


def _verdict(section: Verdict, first: bool) -> tuple[str, bool]:
    """What bounds the step, first: the sentence, the shares as a bar per rank and the job, and the table.
    Returns the HTML and whether it drew a figure (plotly.js goes with the first one)."""
    from ..dashboards.figures import verdict_figure  # the dashboard's builder: one bar, one palette

    out = f"<div class='verdict' id='verdict'>{_esc(verdict_headline(section))}</div>"
    try:
        out += f"<div class='fig'>{_figure(verdict_figure(section), first)}</div>"
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
    sections = [
        ("Step timeline", step_timeline_figure, report.steps, "No step records."),
        ("Memory", memory_figure, report.memory, "No memory measurements in this report."),
        (None, memory_units_figure, report.memory, None),
        ("Communication per unit", overlap_units_figure, report.overlap,
         "No profiler traces: per-unit overlap needs a profiled window."),
        (None, unit_waits_figure, report.units, None),
    ]
    bundle = partial_plotlyjs()
    if bundle is not None:
        parts.append(_plotlyjs_script(bundle))
    first = bundle is None
    if report.verdict is not None:
        text, drew = _verdict(report.verdict, first)
        parts.append(text)
        first = first and not drew
    parts += ["<h2>Diagnosis</h2>", _findings(report.findings)]
    for title, builder, data, missing in sections:
        if title:
            parts.append(f"<h2>{_esc(title)}</h2>")
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
    if report.overlap is not None and report.overlap.per_rank:
        parts.append(_overlap_ranks_table(report.overlap))
        parts.append(_comm_units_table(report.overlap.per_unit))
    head = comm_headline(report.comm)
    if head:
        parts.append(f"<p class='pred'>{_esc(head)}</p>")
    if report.units:
        parts.append("<h2>FSDP units</h2>" + _units_table(report.units))
    if report.problems:
        parts.append("<h2>Skipped</h2><ul>" + "".join(f"<li>{_esc(p)}</li>" for p in report.problems) + "</ul>")
    data = json.dumps(report.to_builtins(), default=str).replace("</", "<\\/")
    parts.append(f"<script type='application/json' id='fsdp-doctor-report'>{data}</script>")
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<title>fsdp-doctor — {_esc(report.run.path or 'report')}</title>"
            f"<style>{_CSS}</style></head><body><main>{''.join(parts)}</main></body></html>")


def write_html(report: Report | dict, path: Path) -> Path:
    """Writes the report (a Report, or its JSON form) as one self-contained HTML file (no network needed to view
    it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)  # the CLI checks --html's directory exists before any work
    path.write_text(render_html(report), encoding="utf-8")
    return path
