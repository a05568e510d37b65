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

from .. import memory_categories as MC
from ..report_sections import Report
from .fmt import (VERDICT_HEADER, comm_headline, findings_headline, fmt_bw, fmt_bytes, fmt_ms, fmt_unit_figures, fmt_pct,
                  fmt_us, fmt_value, run_facts, unit_label, verdict_headline, verdict_rows)

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


def memory_figure(memory: dict):
    """Stacked bars: each rank's peak by category (MiB), with the capacity as a line."""
    import plotly.graph_objects as go

    per_rank = (memory or {}).get("per_rank") or {}
    ranks = sorted(per_rank, key=lambda r: int(r) if str(r).isdigit() else str(r))
    if not ranks:
        return None
    fig = go.Figure()
    cats = [c for c in MEMORY_CATEGORIES if any((per_rank[r].get("peak_breakdown") or {}).get(c) for r in ranks)]
    extra = sorted({c for r in ranks for c in (per_rank[r].get("peak_breakdown") or {}) if c not in MEMORY_CATEGORIES})
    for c in cats + extra:
        ys = [((per_rank[r].get("peak_breakdown") or {}).get(c) or 0) / MIB for r in ranks]
        fig.add_bar(name=c, x=[f"rank {r}" for r in ranks], y=ys, marker_color=MEMORY_COLORS.get(c),
                    hovertemplate=f"{c}: %{{y:.2f}} MiB<extra></extra>")
    caps = [per_rank[r].get("capacity_bytes") for r in ranks if per_rank[r].get("capacity_bytes")]
    if caps:
        fig.add_hline(y=max(caps) / MIB, line_dash="dash", line_color="#C62828",
                      annotation_text=f"capacity {fmt_bytes(max(caps))}", annotation_position="top left")
    where = []
    for r in ranks:
        at = per_rank[r].get("peak_at") or {}
        if at:
            where.append(f"rank {r}: step {at.get('step')}, {unit_label(at.get('unit') or '')} {at.get('phase') or ''}")
    title = "Memory at the peak, by category" + (" — " + "; ".join(where[:4]) if where else "")
    return _layout(fig, title, barmode="stack", yaxis_title="MiB")


def memory_units_figure(memory: dict):
    """Per unit on the peak rank: sharded and unsharded parameter bytes and the activations it left."""
    import plotly.graph_objects as go

    per_rank = (memory or {}).get("per_rank") or {}
    best = max(per_rank.items(), key=lambda kv: kv[1].get("peak_bytes") or 0, default=None)
    if not best or not best[1].get("per_unit"):
        return None
    rows = best[1]["per_unit"]
    names = [unit_label(u.get("unit") or "") for u in rows]
    fig = go.Figure()
    # each unit's own activations (nested units excluded): the bars add up instead of counting a parent's children twice
    own = "activation_self_bytes" if any("activation_self_bytes" in u for u in rows) else "activation_bytes"
    for key, label, color in (("sharded_bytes", "sharded", "#1F77B4"), ("unsharded_bytes", "unsharded", "#AEC7E8"),
                              (own, "activations (own)", "#D62728")):
        if any(u.get(key) for u in rows):
            fig.add_bar(name=label, x=names, y=[(u.get(key) or 0) / MIB for u in rows], marker_color=color)
    return _layout(fig, f"Memory per unit (rank {best[0]}), MiB", barmode="group", yaxis_title="MiB")


def overlap_units_figure(overlap: dict):
    """Per unit and collective: time in the collective and the part not overlapped by compute (ms per
    profiled window, summed over ranks)."""
    import plotly.graph_objects as go

    rows = (overlap or {}).get("per_unit") or []
    if not rows:
        return None
    acc: dict[tuple[str, str], list[float]] = {}
    order: list[str] = []
    for r in rows:
        unit = unit_label(r.get("unit") or "")
        if unit not in order:
            order.append(unit)
        k = (unit, f"{r.get('collective')} ({r.get('phase') or '-'})")
        a = acc.setdefault(k, [0.0, 0.0])
        a[0] += (r.get("comm_us") or 0.0) / 1e3
        a[1] += (r.get("exposed_us") or 0.0) / 1e3
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


def unit_waits_figure(units: list[dict]):
    """Host-measured per-unit medians: forward/backward time and the all-gather waits inside them."""
    import plotly.graph_objects as go

    rows = [u for u in units or [] if u.get("timing_p50")]
    if not rows:
        return None
    names = [unit_label(u.get("name") or "") for u in rows]
    fig = go.Figure()
    for key, label, color, op in (("fwd", "forward", "#4C78A8", 0.35), ("ag_wait_fwd_ms", "AG wait (fwd)", "#4C78A8", 1.0),
                                  ("bwd", "backward", "#F58518", 0.35), ("ag_wait_bwd_ms", "AG wait (bwd)", "#F58518", 1.0),
                                  ("recompute_ms", "recompute", "#E45756", 1.0)):
        ys = [(_own(u["timing_p50"], key) if key in ("fwd", "bwd") else u["timing_p50"].get(key)) or 0 for u in rows]
        if any(ys):
            fig.add_bar(name=label, x=names, y=ys, marker_color=color, opacity=op)
    return _layout(fig, "Per unit, median per step (host-measured; own time, nested units excluded)",
                   barmode="group", yaxis_title="ms")


def step_timeline_figure(steps: dict):
    """The median step of each rank as a timeline of its phases, with outlier steps marked."""
    import plotly.graph_objects as go

    per_rank = (steps or {}).get("per_rank") or {}
    ranks = [r for r in sorted(per_rank, key=lambda r: int(r) if str(r).isdigit() else str(r))
             if per_rank[r].get("count")]
    if not ranks:
        return None
    fig = go.Figure()
    labels = [f"rank {r}" for r in ranks]
    for ph in PHASES:
        xs = [(per_rank[r].get("phases_p50_ms") or {}).get(ph) or 0 for r in ranks]
        fig.add_bar(name=ph, y=labels, x=xs, orientation="h", marker_color=PHASE_COLORS[ph],
                    hovertemplate=f"{ph}: %{{x:.1f}} ms<extra></extra>")
    outs = (steps or {}).get("outliers") or []
    if outs:
        fig.add_scatter(name="outlier steps", mode="markers", marker={"symbol": "x", "size": 10, "color": "#C62828"},
                        x=[o["ms"] for o in outs], y=[f"rank {o['rank']}" for o in outs],
                        text=[f"step {o['step']}: {o.get('detail', '')}" for o in outs],
                        hovertemplate="%{text}<br>%{x:.1f} ms<extra></extra>")
    for r, lab in zip(ranks, labels):
        p50 = per_rank[r].get("p50_ms")
        if p50:
            fig.add_annotation(x=p50, y=lab, text=f"p50 {fmt_ms(p50)}", showarrow=False, xanchor="left",
                               font={"size": 11, "color": "#444"})
    return _layout(fig, "Step timeline: median time per phase (ms); × = outlier steps",
                   height=max(220, 90 + 50 * len(ranks)), barmode="stack", xaxis_title="ms")


# ---------------------------------------------------------------------------------------------- html parts
def _header(report: dict) -> str:
    r = report.get("run") or {}
    facts = run_facts(r)
    if r.get("capacity_bytes"):
        facts.append(f"capacity {fmt_bytes(r['capacity_bytes'])}")
    job = ((report.get("steps") or {}).get("job") or {})
    if job.get("p50_ms"):
        facts.append(f"step p50 {fmt_ms(job['p50_ms'])}")
    return (f"<h1>fsdp-doctor report</h1><div class='facts'>{_esc(r.get('path', ''))}<br>"
            f"{_esc(' · '.join(facts))}<br>report schema {_esc(report.get('schema', ''))}, "
            f"doctor {_esc(report.get('doctor_version', ''))}</div>")


def _predicted(pred: Optional[dict]) -> str:
    if not pred:
        return ""
    bits = []
    if pred.get("step_ms_before") is not None and pred.get("step_ms_after") is not None:
        bits.append(f"step {fmt_ms(pred['step_ms_before'])} → {fmt_ms(pred['step_ms_after'])}")
    if pred.get("peak_bytes_before") is not None and pred.get("peak_bytes_after") is not None:
        bits.append(f"peak {fmt_bytes(pred['peak_bytes_before'])} → {fmt_bytes(pred['peak_bytes_after'])}")
    return f"<div class='pred'>Expected: {_esc(', '.join(bits))}</div>" if bits else ""


def _finding(f: dict) -> str:
    sev = f.get("severity", "info")
    color = SEVERITY_COLORS.get(sev, "#999")
    rec = f.get("recommendation") or {}
    ev = "".join(f"<tr><th>{_esc(k)}</th><td>{_esc(fmt_value(k, v, max_items=10))}</td></tr>"
                 for k, v in (f.get("evidence") or {}).items())
    code = f"<pre><code>{_esc(rec['code'])}</code></pre>" if rec.get("code") else ""
    return (f"<div class='finding' style='border-left-color:{color}'>"
            f"<h3><span class='sev' style='background:{color}'>{_esc(sev)}</span>{_esc(f.get('title', ''))}"
            f"<span class='code'>{_esc(f.get('code', ''))}</span></h3>"
            f"<div>{_esc(rec.get('text', ''))}</div>{_predicted(f.get('predicted'))}"
            f"<table>{ev}</table>{code}</div>")


def _findings(findings: list[dict]) -> str:
    sevs = {f.get("severity") for f in findings}
    cls = "healthy" if not sevs & {"warning", "critical"} else "facts"
    return f"<div class='{cls}'>{_esc(findings_headline(findings))}</div>" + "".join(_finding(f) for f in findings)


def _comm_units_table(per_unit: list[dict], top: int = 15) -> str:
    """The per-unit collectives, worst exposure first: the terminal's table, same formatters."""
    if not per_unit:
        return ""
    head = ("<tr><th>rank</th><th>unit</th><th>collective</th><th>phase</th><th>calls</th><th>time</th>"
            "<th>exposed</th><th>bytes / call</th><th>bus BW</th><th>slack</th></tr>")
    rows = "".join(
        "<tr>" + "".join(f"<td>{_esc(x)}</td>" for x in (
            r["rank"], unit_label(r["unit"]), r["collective"], r.get("phase") or "—", r["count"],
            fmt_us(r["comm_us"]), fmt_us(r["exposed_us"]), fmt_bytes(r.get("bytes_per_call")),
            fmt_bw(r.get("busbw_gbps")), fmt_us(r.get("slack_us"), signed=True))) + "</tr>"
        for r in per_unit[:top])
    more = f"<p class='note'>top {top} of {len(per_unit)}</p>" if len(per_unit) > top else ""
    return f"<table>{head}{rows}</table>{more}"


def _own(t: dict, phase: str):
    """A unit's own time in ``phase`` (nested units excluded); reports written before it: the inclusive time."""
    return t.get(f"{phase}_self_ms") if f"{phase}_self_ms" in t else t.get(f"{phase}_ms")


def _units_table(units: list[dict]) -> str:
    if not units:
        return ""
    head = ("<tr><th>unit</th><th>params</th><th>shard</th><th>gathered</th><th>reshard</th><th>AC</th>"
            "<th>fwd</th><th>AG wait</th><th>bwd</th><th>AG wait</th></tr>")
    rows = []
    for u in units[:64]:
        t = u.get("timing_p50") or {}
        pad = 12 * int(u.get("depth", 0) or 0)
        rows.append(f"<tr><td style='padding-left:{pad}px'>{_esc(unit_label(u.get('name') or ''))}</td>" + "".join(
            f"<td>{_esc(x)}</td>" for x in (
            *fmt_unit_figures(u), u.get("checkpoint", "none"), fmt_ms(_own(t, "fwd")), fmt_ms(t.get("ag_wait_fwd_ms")),
            fmt_ms(_own(t, "bwd")), fmt_ms(t.get("ag_wait_bwd_ms")))) + "</tr>")
    more = f"<tr><td>… {len(units) - 64} more</td></tr>" if len(units) > 64 else ""
    return (f"<p class='note'>Per-step medians; each unit's own time (nested units excluded).</p>"
            f"<table>{head}{''.join(rows)}{more}</table>")


def _verdict_table(section: dict) -> str:
    """The terminal's verdict table, the same rows (fsdp_doctor.present.fmt.verdict_rows)."""
    def cells(row, tag):
        return "".join(f"<{tag}{' class=l' if i == 1 else ''}>{_esc(x)}</{tag}>" for i, x in enumerate(row))
    body = "".join(f"<tr{' style=font-weight:600' if r[0] == 'job' else ''}>{cells(r, 'td')}</tr>"
                   for r in verdict_rows(section))
    return f"<table class='verdict-table'><tr>{cells(VERDICT_HEADER, 'th')}</tr>{body}</table>"


def _verdict(section: dict, first: bool) -> tuple[str, bool]:
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


def render_html(report: dict) -> str:
    """The whole report as one HTML document (plotly.js inlined once, before the first figure)."""
    parts = [_header(report)]
    sections = [
        ("Step timeline", step_timeline_figure, report.get("steps"), "No step records."),
        ("Memory", memory_figure, report.get("memory"), "No memory measurements in this report."),
        (None, memory_units_figure, report.get("memory"), None),
        ("Communication per unit", overlap_units_figure, report.get("overlap"),
         "No profiler traces: per-unit overlap needs a profiled window."),
        (None, unit_waits_figure, report.get("units"), None),
    ]
    bundle = partial_plotlyjs()
    if bundle is not None:
        parts.append(_plotlyjs_script(bundle))
    first = bundle is None
    if report.get("verdict"):
        text, drew = _verdict(report["verdict"], first)
        parts.append(text)
        first = first and not drew
    parts += ["<h2>Diagnosis</h2>", _findings(report.get("findings") or [])]
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
    ov = report.get("overlap") or {}
    if ov.get("per_rank"):
        rows = "".join(
            f"<tr><td>{_esc(r)}</td><td>{fmt_ms((v.get('comm_us') or 0) / 1e3)}</td>"
            f"<td>{fmt_ms((v.get('exposed_us') or 0) / 1e3)}</td><td>{fmt_pct(v.get('overlap_pct'))}</td></tr>"
            for r, v in sorted(ov["per_rank"].items()))
        parts.append("<table><tr><th>rank</th><th>communication</th><th>exposed</th><th>overlap</th></tr>"
                     f"{rows}</table>")
        parts.append(_comm_units_table(ov.get("per_unit") or []))
    head = comm_headline(report.get("comm"))
    if head:
        parts.append(f"<p class='pred'>{_esc(head)}</p>")
    if report.get("units"):
        parts.append("<h2>FSDP units</h2>" + _units_table(report["units"]))
    probs = report.get("problems") or []
    if probs:
        parts.append("<h2>Skipped</h2><ul>" + "".join(f"<li>{_esc(p)}</li>" for p in probs) + "</ul>")
    data = json.dumps(Report.of(report).to_builtins(), default=str).replace("</", "<\\/")
    parts.append(f"<script type='application/json' id='fsdp-doctor-report'>{data}</script>")
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<title>fsdp-doctor — {_esc((report.get('run') or {}).get('path', 'report'))}</title>"
            f"<style>{_CSS}</style></head><body><main>{''.join(parts)}</main></body></html>")


def write_html(report: dict, path: Path) -> Path:
    """Writes the report as one self-contained HTML file (no network needed to view it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)  # the CLI checks --html's directory exists before any work
    path.write_text(render_html(report), encoding="utf-8")
    return path
