"""Overview: the findings (by severity, with evidence, the fix and its predicted gain), the run's facts and the
headline numbers."""

from __future__ import annotations

from dash import dcc, html

from fsdp_doctor.present.fmt import fmt_bytes, fmt_ms

from ..figures import unit_label
from .common import Filters, fmt_value, kpi, note, section

SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}


def _kpis(report: dict, flt: Filters) -> html.Div:
    steps = report.get("steps") or {}
    key = str(flt.rank) if flt.rank is not None else None
    st = (steps.get("per_rank") or {}).get(key) if key else steps.get("job")
    who = (f"rank {flt.rank}" if key else "all ranks") + (f", steps {flt.window[0]}–{flt.window[1]}" if flt.window else "")
    tp_sec = report.get("throughput") or {}
    tp = (tp_sec.get("per_rank") or {}).get(key) if key else tp_sec.get("job")
    ov = (report.get("overlap") or {}).get("per_rank") or {}
    ovs = [ov[key]] if key and key in ov else ([] if key else list(ov.values()))
    comm = sum(o["comm_us"] for o in ovs)
    ovl = sum(o["overlap_us"] for o in ovs)
    recorded = (report.get("run") or {}).get("steps_recorded") or {}
    n_steps = recorded.get(key, 0) if key else max(recorded.values(), default=0)
    st = st or {}
    tiles = [
        kpi("Step time p50", fmt_ms(st.get("p50_ms")), f"{who}, {st.get('count', 0)} steady steps", kid="kpi-p50"),
        kpi("Step time p99", fmt_ms(st.get("p99_ms")), f"max {fmt_ms(st.get('max_ms'))}", kid="kpi-p99"),
        kpi("Tokens / s", f"{tp['tokens_per_s']:,.0f}" if tp and tp.get("tokens_per_s") is not None else "—",
            (f"MFU {tp['mfu_pct']:.1f}%" if tp and tp.get("mfu_pct") is not None else
             (f"{tp['achieved_tflops']:.3g} TFLOP/s" if tp and tp.get("achieved_tflops") is not None else who)),
            kid="kpi-tokens"),
        kpi("Comm overlapped", f"{100 * ovl / comm:.0f}%" if comm > 0 else "—",
            f"exposed {fmt_ms((comm - ovl) / 1e3)} per window" if comm > 0 else "no profiled window yet", kid="kpi-overlap"),
        kpi("Steps recorded", f"{n_steps:,}", "live" if _live(report) else "run finished", kid="kpi-steps"),
    ]
    mem = ((report.get("memory") or {}).get("per_rank") or {})
    peaks = [m.get("peak_bytes") for r, m in mem.items() if (key is None or r == key) and m.get("peak_bytes")]
    if peaks:
        tiles.insert(3, kpi("Peak memory", fmt_bytes(max(peaks)), who, kid="kpi-peak"))
    return html.Div(tiles, className="kpis")


def _live(report: dict) -> bool:
    return not all((report.get("run") or {}).get("complete", {}).values() or [False])


def finding_card(i: int, f: dict) -> html.Div:
    sev = f.get("severity", "info")
    ev = f.get("evidence") or {}
    rows = [html.Tr([html.Th(k.replace("_", " ")), html.Td(fmt_value(k, v))]) for k, v in ev.items()]
    rec = f.get("recommendation") or {}
    body = [html.P(rec.get("text", ""), className="finding-text")]
    if rows:
        body.append(html.Details([html.Summary("Evidence"), html.Table(rows, className="evidence")], open=True,
                                 className="finding-evidence"))
    pred = f.get("predicted") or {}
    gain = []
    if pred.get("step_ms_before") is not None and pred.get("step_ms_after") is not None:
        b, a = pred["step_ms_before"], pred["step_ms_after"]
        pct = f" ({100 * (b - a) / b:.0f}% faster)" if b else ""
        gain.append(f"step {fmt_ms(b)} → {fmt_ms(a)}{pct}")
    if pred.get("peak_bytes_before") is not None and pred.get("peak_bytes_after") is not None:
        gain.append(f"peak memory {fmt_bytes(pred['peak_bytes_before'])} → {fmt_bytes(pred['peak_bytes_after'])}")
    if gain:
        body.append(html.Div("Expected: " + "; ".join(gain), className="finding-gain"))
    if rec.get("code"):
        cid = f"fix-code-{i}"
        body.append(html.Div([
            dcc.Clipboard(target_id=cid, title="copy the fix", className="copy-btn"),
            html.Pre(rec["code"], id=cid, className="fix-code"),
        ], className="fix"))
    who = []
    if f.get("ranks"):
        who.append("ranks " + ", ".join(map(str, f["ranks"])))
    if f.get("units"):
        who.append("units " + ", ".join(unit_label(u) for u in f["units"][:6]))
    head = html.Div([html.Span(sev.upper(), className=f"badge badge-{sev}"), html.Span(f.get("title", ""), className="finding-title"),
                     html.Span(f.get("code", "") + (" · " + " · ".join(who) if who else ""), className="finding-code")],
                    className="finding-head")
    return html.Div([head, *body], className=f"finding finding-{sev}", id=f"finding-{i}")


def run_facts(run: dict) -> html.Table:
    facts = [
        ("path", run.get("path")), ("world size", run.get("world_size")), ("backend", run.get("backend")),
        ("device", run.get("device_name") or run.get("device")), ("torch", run.get("torch_version")),
        ("optimizer", run.get("optimizer")), ("FSDP units", run.get("units")),
        ("parameters", f"{run['model_param_count'] / 1e6:.2f} M" if run.get("model_param_count") else None),
        ("memory capacity", fmt_bytes(run["capacity_bytes"]) if run.get("capacity_bytes") else "unknown"),
        ("tokens / step", f"{run['tokens_per_step']:,}" if run.get("tokens_per_step") else None),
        ("steps recorded", ", ".join(f"r{k}: {v}" for k, v in (run.get("steps_recorded") or {}).items())),
        ("finished", ", ".join(f"r{k}: {'yes' if v else 'no'}" for k, v in (run.get("complete") or {}).items())),
        ("trace files", run.get("trace_files")),
    ]
    return html.Table([html.Tr([html.Th(k), html.Td(str(v))]) for k, v in facts if v not in (None, "")],
                      className="facts")


def layout(snap, flt: Filters) -> list:
    report = snap.report
    if not snap.has_records:
        return [note(f"No fsdp-doctor records in {snap.path} yet. This page updates on its own when a run "
                     "wrapped in fsdp_doctor.watch(...) starts writing here (rank*.records.jsonl).",
                     "warning", nid="empty-note")]
    windowed = dict(report, **{k: v for k, v in snap.sections(flt.window).items() if v is not None})
    out = [_kpis(windowed, flt)]
    run = report.get("run") or {}
    for e in run.get("doctor_errors", []):
        out.append(note(f"The doctor stepped aside on rank {e['rank']} at step {e['step']} ({e['where']}): {e['message']}", "error"))
    findings = [f for f in report.get("findings") or []
                if (flt.rank is None or not f.get("ranks") or flt.rank in f["ranks"])
                and (flt.unit is None or not f.get("units") or flt.unit in f["units"])]
    findings.sort(key=lambda f: SEVERITY_ORDER.get(f.get("severity"), 3))
    counts = {s: sum(1 for f in findings if f.get("severity") == s) for s in SEVERITY_ORDER}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n) or "none"
    if findings:
        cards = [finding_card(i, f) for i, f in enumerate(findings)]
    else:
        cards = [note("No findings: nothing the rules flag in this run" +
                      (" for this selection." if flt.rank is not None or flt.unit is not None else "."), "ok")]
    out.append(html.Div([
        section(f"Findings ({summary})", *cards, cls="findings", sid="findings"),
        html.Div([section("Run", run_facts(run), sid="run-facts")] +
                 ([section("Problems", html.Ul([html.Li(p) for p in report["problems"]]), cls="problems")]
                  if report.get("problems") else []), className="side"),
    ], className="overview-cols"))
    return out
