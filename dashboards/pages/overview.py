"""Overview: the findings (by severity, with evidence, the fix and its predicted gain), the run's facts and the
headline numbers."""

from __future__ import annotations

from typing import Optional

import msgspec
from dash import dcc, html
from msgspec import UNSET

from fsdp_doctor.present.fmt import (evidence_rows, fix_heading, SEVERITY_ORDER, VERDICT_HEADER, experts_fact, findings_headline,
                                     fmt_bytes, fmt_ms, optimizer_fact, params_fact, predicted_text, problem_text,
                                     severity_counts,
                                     run_warnings, throughput_note, unit_label, verdict_headline, verdict_rows)
from fsdp_doctor.report_sections import Finding, Report, RunFacts, StepStats, Verdict

from fsdp_doctor.present.figures import verdict_figure
from ..state import RECORD_SECTIONS
from .common import Filters, fmt_value, graph, kpi, note, run_state, section

def _kpis(report: Report, flt: Filters, traces_only: bool = False, state: str = "") -> html.Div:
    key = str(flt.rank) if flt.rank is not None else None
    steps, tp_sec = report.steps or report.trace_steps, report.throughput  # plain traces: their ProfilerSteps
    st = (steps.per_rank.get(key) if key else steps.job) if steps else None
    st = st or StepStats()
    who = (f"rank {flt.rank}" if key else "all ranks") + (f", steps {flt.window[0]}–{flt.window[1]}" if flt.window else "")
    tp = (tp_sec.per_rank.get(key) if key else tp_sec.job) if tp_sec else None
    exposed, source, definition = exposed_comm(report, key)
    recorded = report.run.steps_recorded
    n_steps = recorded.get(key, 0) if key else max(recorded.values(), default=0)
    tiles = [
        # (all ranks: the job's statistics count every rank's steps, "66 steady steps" for the CLI's 33 per rank)
        kpi("Step time p50", fmt_ms(st.p50_ms), f"{who}, {st.count} {'steady' if report.steps else 'complete profiled'} "
            f"{'rank-steps' if not key and steps and len(steps.per_rank) > 1 else 'steps'}", kid="kpi-p50"),
        kpi("Step time p99", fmt_ms(st.p99_ms), f"max {fmt_ms(st.max_ms)}", kid="kpi-p99"),
        kpi("Tokens / s", f"{tp.tokens_per_s:,.0f}" if tp and tp.tokens_per_s is not None else "—",
            (f"MFU {tp.mfu_pct:.1f}%" if tp and tp.mfu_pct is not None else
             (f"{tp.achieved_tflops:.3g} TFLOP/s" if tp and tp.achieved_tflops is not None else who)),
            kid="kpi-tokens", title=throughput_note(tp_sec) if tp_sec else ""),  # analytic FLOPs: what they count
        kpi("Exposed communication", f"{fmt_ms(exposed)} / step" if exposed is not None else "—",
            source or "no profiled window or all-gather timing yet", kid="kpi-exposed", title=definition or ""),
        kpi("Steps recorded", f"{n_steps:,}", "run finished" if state == "finished" else state, kid="kpi-steps"),
    ]
    if traces_only:  # throughput and the steps recorded need records; step times come from the ProfilerSteps
        tiles = [t for t in tiles if getattr(t, "id", None) in ("kpi-p50", "kpi-exposed")] + [
            kpi("Comm overlapped", fmt_value("overlap_pct", _overlap_pct(report, key)), "profiler traces", kid="kpi-overlap")]
    mem_sec = report.memory_section()
    mem = mem_sec.per_rank if mem_sec else {}
    peaks = [m.peak_bytes for r, m in mem.items() if (key is None or r == key) and m.peak_bytes]
    if peaks:
        tiles.insert(3, kpi("Peak memory", fmt_bytes(max(peaks)), who, kid="kpi-peak"))
    return html.Div(tiles, className="kpis")


def exposed_comm(report: Report, rank: Optional[str]) -> tuple:
    """The one exposed-communication figure (ms per step), where it comes from, and what it means: the report's
    ``comm`` section (the pipeline picks the trace's ``OverlapRank.exposed_ms_per_step`` or the records' waits),
    or nothing."""
    comm = report.comm
    if comm is None:
        return None, "", ""
    row = comm.per_rank.get(rank) if rank is not None else None
    v = row.exposed_ms_per_step if row else (None if rank is not None else comm.exposed_ms_per_step)
    src = comm.source_text or comm.source
    return v, (f"rank {rank}, " if rank is not None else "median over ranks, ") + src, comm.definition


def _overlap_pct(report: Report, rank: Optional[str]):
    ov = report.overlap.per_rank if report.overlap else {}
    rows = [o for r, o in ov.items() if rank is None or r == rank]
    comm = sum(o.comm_us for o in rows)
    return 100 * sum(o.overlap_us for o in rows) / comm if comm else None


def headline(findings: list[Finding]) -> html.Div:
    """The presenters' line above the findings (fsdp_doctor.present.fmt) and the first finding's title."""
    text = findings_headline(findings) + (f" First: {findings[0].title}" if findings else "")
    kind = ("ok" if not findings else "error" if any(f.severity == "critical" for f in findings) else
            "warning" if any(f.severity == "warning" for f in findings) else "info")
    return note(text, kind, nid="headline")


def verdict_panel(section: Verdict, flt: Filters) -> html.Section:
    """What bounds the step, first on the page: the terminal's sentence, the shares as a bar per rank and the job
    (the HTML report's figure), and the terminal's table under "Shares". The verdict covers the profiled windows
    (or, without a trace, every steady step); the step filter does not change it, the rank filter picks a rank."""
    rank = flt.rank if flt.rank is not None and str(flt.rank) in section.per_rank else None
    rows = verdict_rows(section)
    if rank is not None:
        rows = [r for r in rows if r[0] in (str(rank), "job")]
    cell = {"textAlign": "right", "padding": "1px 0 1px 14px", "whiteSpace": "nowrap"}
    tbl = html.Table([html.Tr([html.Th(c, style=cell) for c in VERDICT_HEADER])] +
                     [html.Tr([html.Td(x, style=cell) for x in r], style={"fontWeight": 700} if r[0] == "job" else None)
                      for r in rows], className="verdict-table", style={"fontSize": "13px", "borderCollapse": "collapse"})
    return html.Section([
        html.Div(verdict_headline(section, rank), id="verdict-head", style={"fontWeight": 700, "fontSize": "16px"}),
        graph(verdict_figure(section, rank), "fig-verdict"),
        html.Details([html.Summary("Shares as a table (% of the step)", style={"cursor": "pointer"}), tbl],
                     className="verdict-shares", style={"color": "#1f2933"}),
    ], className="panel verdict", id="verdict", style={"borderLeft": "5px solid #4C78A8"})


def finding_card(i: int, f: Finding) -> html.Div:
    sev = f.severity
    rows = [html.Tr([html.Th(label), html.Td(value)]) for label, value in evidence_rows(f.evidence, fmt=fmt_value)]
    rec = f.recommendation
    body = [html.P(rec.text, className="finding-text")]
    if rows:
        body.append(html.Details([html.Summary("Evidence"), html.Table(rows, className="evidence")], open=True,
                                 className="finding-evidence"))
    gain = predicted_text(f.predicted)
    if gain:
        body.append(html.Div("Expected: " + gain, className="finding-gain"))
    if rec.code:
        cid = f"fix-code-{i}"
        body.append(html.Div(fix_heading(rec), className="fix-where"))
        body.append(html.Div([
            dcc.Clipboard(target_id=cid, title="copy the fix", className="copy-btn"),
            html.Pre(rec.code, id=cid, className="fix-code"),
        ], className="fix"))
    who = []
    if f.ranks:
        who.append("ranks " + ", ".join(map(str, f.ranks)))
    if f.units:
        who.append("units " + ", ".join(unit_label(u) for u in f.units[:6]))
    head = html.Div([html.Span(sev.upper(), className=f"badge badge-{sev}"), html.Span(f.title, className="finding-title"),
                     html.Span(f.code + (" · " + " · ".join(who) if who else ""), className="finding-code")],
                    className="finding-head")
    return html.Div([head, *body], className=f"finding finding-{sev}", id=f"finding-{i}")


def run_facts(run: RunFacts) -> html.Table:
    facts = [
        ("path", run.path), ("world size", run.world_size), ("backend", run.backend),
        ("device", run.device_name or run.device), ("torch", run.torch_version),
        ("optimizer", optimizer_fact(run)), ("FSDP units", run.units),
        ("mixed precision", run.mixed_precision), ("offload", run.offload),
        ("parameters", params_fact(run)), ("mixture of experts", experts_fact(run)),
        ("memory capacity", fmt_bytes(run.capacity_bytes) if run.capacity_bytes else "unknown"),
        ("tokens / step", f"{run.tokens_per_step:,}" if run.tokens_per_step else None),
        ("steps recorded", ", ".join(f"r{k}: {v}" for k, v in run.steps_recorded.items())),
        ("finished", ", ".join(f"r{k}: {'yes' if v else 'no'}" for k, v in run.complete.items())),
        ("trace files", run.trace_files),
    ]
    return html.Table([html.Tr([html.Th(k), html.Td(str(v))]) for k, v in facts
                       if v is not UNSET and v not in (None, "", 0)], className="facts")  # UNSET: no configuration record


def windowed(snap, window) -> Report:
    """The report with its record sections over the step ``window`` where the window has them (the run's
    otherwise): the headline numbers follow the step filter."""
    win = snap.sections(window)
    return msgspec.structs.replace(snap.report, **{k: getattr(win, k) for k in RECORD_SECTIONS
                                                   if getattr(win, k) is not None})


def layout(snap, flt: Filters) -> list:
    report = snap.report
    traces_only = not snap.has_records and (snap.windows or report.overlap is not None)
    if not snap.has_records and not traces_only:
        if snap.traces_pending:
            return [note(f"Analysing {snap.traces_pending} trace file(s) …", "info", nid="empty-note")]
        return [note(f"No fsdp-doctor records or profiler traces in {snap.path} yet. This page updates on its own "
                     "when a run wrapped in fsdp_doctor.watch(...) starts writing here (rank*.records.jsonl), or "
                     "when Kineto traces appear.", "warning", nid="empty-note")]
    out = []
    if traces_only:
        n = len(snap.windows) or len(report.overlap.files if report.overlap else [])
        out.append(note(f"Plain profiler traces ({n} Kineto file(s)), no fsdp-doctor records: communication and "
                        "its findings, step times (ProfilerStep markers), per-unit times (FSDP2's labels) and memory "
                        "(where the profiler recorded it) come from the traces; step phases, memory by category and "
                        "the unit configuration need a run recorded with fsdp_doctor.watch(...).", "info", nid="traces-only-note"))
    state = run_state(report, snap.updated)
    out.append(_kpis(windowed(snap, flt.window), flt, traces_only=bool(traces_only), state=state))
    run = report.run
    # the header's warnings, as the terminal and the HTML report give them; how the ranks stopped is a problem, in the
    # Problems below once the run is not live (a crashed rank's run read only "finished: no" here: a new-user trial)
    for w in run_warnings(run):
        if w.level == "warning" and state == "live":
            continue
        out.append(note(w.text, {"error": "error", "note": "info"}.get(w.level, "warning")))
    findings = [f for f in report.findings
                if (flt.rank is None or not f.ranks or flt.rank in f.ranks)
                and (flt.unit is None or not f.units or flt.unit in f.units)]
    findings.sort(key=lambda f: SEVERITY_ORDER.get(f.severity, 3))
    if findings:  # without any, the findings panel says so
        out.insert(0, headline(findings))
    if report.verdict is not None:  # what bounds the step comes first (from the records or the traces)
        out.insert(0, verdict_panel(report.verdict, flt))
    summary = severity_counts(findings)
    if findings:
        cards = [finding_card(i, f) for i, f in enumerate(findings)]
    else:
        cards = [note(findings_headline([], report.rules, report.verdict) if flt.rank is None and flt.unit is None
                      else "No findings: nothing the rules flag in this run for this selection.", "ok")]
    out.append(html.Div([
        section(f"Findings ({summary})", *cards, cls="findings", sid="findings"),
        html.Div([section("Run", run_facts(run), sid="run-facts")] +
                 ([section("Problems", html.Ul([html.Li(problem_text(p)) for p in problems]), cls="problems")]
                  if (problems := snap.problems(live=state == "live")) else []), className="side"),
    ], className="overview-cols"))
    return out
