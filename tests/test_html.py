"""The HTML report: one self-contained file (plotly.js inline, nothing fetched) with findings and figures."""

from __future__ import annotations

import json
import re

from fsdp_doctor.present.html import render_html, write_html

MiB = 1 << 20


def _report(findings=None):
    mem_rank = {"peak_bytes": 24 * MiB, "peak_at": {"step": 3, "unit": "norm, lm_head", "phase": "forward_end"},
                "peak_breakdown": {"sharded_params": 2 * MiB, "unsharded_params": MiB // 4, "optimizer_state": 4 * MiB,
                                   "activations": 16 * MiB, "comm_buffers": 0, "temporaries": 0},
                "activations_peak_bytes": 16 * MiB, "capacity_bytes": 12 * MiB,
                "per_unit": [{"unit": f"layers.{i}", "sharded_bytes": 396_544, "unsharded_bytes": 793_088,
                              "activation_bytes": 4 * MiB} for i in range(4)]}
    per_unit = [{"rank": r, "unit": f"layers.{i}", "collective": c, "phase": p, "count": 1, "comm_us": 3000.0,
                 "exposed_us": 1500.0, "bytes_per_call": None, "busbw_gbps": None, "slack_us": None, "held_us": None}
                for r in (0, 1) for i in range(4)
                for c, p in (("all_gather", "forward"), ("all_gather", "backward"), ("reduce_scatter", "backward"))]
    ph = {"forward": 34.0, "backward": 61.0, "optimizer": 13.0, "outside": 2.0, "gc": 0.0}
    st = {"count": 8, "p50_ms": 110.0, "p90_ms": 120.0, "p99_ms": 130.0, "max_ms": 131.0, "cv": 0.08,
          "phases_p50_ms": ph}
    return {
        "schema": "fsdp-doctor-report/1", "doctor_version": "0.1.0",
        "run": {"path": "runs/x", "world_size": 2, "units": 7, "model_param_count": 932_608, "backend": "gloo",
                "capacity_bytes": 12 * MiB},
        "steps": {"per_rank": {"0": st, "1": st}, "job": {"p50_ms": 110.0, "phases_p50_ms": ph},
                  "outliers": [{"rank": 1, "step": 9, "ms": 180.0, "median_ms": 110.0, "excess_ms": 70.0,
                                "cause": "gc", "detail": "GC 60 ms"}], "stragglers": []},
        "units": [{"name": "", "modules": [""], "is_root": True, "param_count": 0, "n_params": 0, "sharded_bytes": 0,
                   "unsharded_bytes": 0, "orig_dtypes": [],
                   "timing_p50": {"fwd_ms": 34.0, "ag_wait_fwd_ms": 0.2, "bwd_ms": 0.0, "ag_wait_bwd_ms": 0.0,
                                  "fwd_self_ms": 10.0, "bwd_self_ms": None}}]
                 + [{"name": f"layers.{i}", "modules": [f"layers.{i}"], "is_root": False, "param_count": 198_272,
                     "n_params": 6, "sharded_bytes": 396_544, "unsharded_bytes": 793_088, "orig_dtypes": ["float32"],
                     "depth": 1,
                     "timing_p50": {"fwd_ms": 6.0, "ag_wait_fwd_ms": 3.0, "bwd_ms": 6.0, "ag_wait_bwd_ms": 1.0,
                                    "recompute_ms": 0.0, "fwd_self_ms": 6.0, "bwd_self_ms": 6.0}} for i in range(4)],
        "memory": {"per_rank": {"0": mem_rank, "1": mem_rank}},
        "overlap": {"per_rank": {"0": {"comm_us": 36000.0, "overlap_us": 18000.0, "exposed_us": 18000.0,
                                       "overlap_pct": 50.0, "steps": [6], "device": "cpu"}},
                    "per_unit": per_unit},
        "findings": findings if findings is not None else [
            {"code": "ac.recommended", "severity": "critical", "title": "Activations are 67% of the peak </script>",
             "evidence": {"peak_bytes": 24 * MiB, "recompute_ms_added": 20.0, "blocks_to_checkpoint": ["layers.0"]},
             "recommendation": {"text": "Checkpoint <blocks> & co.", "code": "apply_activation_checkpointing(model)"},
             "predicted": {"step_ms_before": 110.0, "step_ms_after": 130.0, "peak_bytes_before": 24 * MiB,
                           "peak_bytes_after": 10 * MiB}, "ranks": [], "units": ["layers.0"]}],
        "problems": [],
    }


def _scripts(text: str) -> list[str]:
    return re.findall(r"<script[^>]*>", text)


def test_self_contained_with_findings_and_figures(tmp_path):
    out = write_html(_report(), tmp_path / "sub" / "report.html")
    text = out.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>")
    # plotly.js inlined exactly once, nothing loaded from the network
    assert len(text) > 1_000_000
    assert text.count("plotly.js v") >= 1 or "Plotly" in text
    assert not any("src=" in s for s in _scripts(text))
    assert not re.search(r"<(script|link)[^>]+(src|href)=['\"]https?://", text)
    # the figures: step timeline, memory breakdown (+ per unit), communication per unit, unit waits
    assert text.count("Plotly.newPlot") >= 5
    for title in ("Step timeline", "Memory at the peak", "Communication per unit", "Memory per unit"):
        assert title in text
    assert "<h2>FSDP units</h2>" in text and "unreadable" not in text  # every section of the report read
    # the finding, escaped, with its code and prediction
    assert "ac.recommended" in text and "Checkpoint &lt;blocks&gt; &amp; co." in text
    assert "apply_activation_checkpointing(model)" in text
    assert "110.0 ms → 130.0 ms" in text and "24.00 MiB → 10.00 MiB" in text
    # the embedded report cannot close its script tag early
    body = text.split("id='fsdp-doctor-report'>", 1)[1].split("</script>", 1)[0]
    assert json.loads(body.replace("<\\/", "</"))["findings"][0]["code"] == "ac.recommended"


def test_healthy_and_missing_sections(tmp_path):
    r = _report(findings=[])
    text = render_html(r)
    assert "Healthy: no findings." in text
    info = [{"code": "prefetch.exposed_allgather", "severity": "info", "title": "t", "evidence": {},
             "recommendation": {"text": "x", "code": ""}}]
    text = render_html(_report(findings=info))
    assert "No warnings; 1 note below" in text and "Healthy" not in text  # a note is not "healthy"
    bare = render_html({"run": {"path": "p"}})
    assert "Healthy: no findings." in bare and "No memory measurements" in bare and "No step records" in bare
    # no finding under a communication-bound verdict (gloo: verdict.severe quiet, its levers gain nothing measurable
    # there) read "Healthy: no findings." beside "Verdict: communication-bound (54% ...)" (a new-user trial)
    from fsdp_doctor.present.fmt import findings_headline
    from fsdp_doctor.report_sections import Verdict, VerdictEntry

    def verdict(bound, pct):
        return Verdict(job=VerdictEntry(bound=bound, groups_pct={bound: pct}))

    head = findings_headline([], [], verdict("communication", 54.2))
    assert head.startswith("No findings, though the step is communication-bound (54%): ") and "Healthy" not in head
    assert findings_headline([], [], verdict("compute", 80.0)) == "Healthy: no findings."
    text = render_html({**_report(findings=[]), "verdict": {"job": {"bound": "input", "groups_pct": {"input": 61.0}}}})
    assert "No findings, though the step is input-bound (61%)" in text and "Healthy" not in text
    assert "Plotly.newPlot" not in bare


def test_sample_run_report(sample_run_path, tmp_path):
    rep = json.loads((sample_run_path / "report.json").read_text())
    out = write_html(rep, tmp_path / "sample.html")
    text = out.read_text()
    assert "Step timeline" in text and "Communication per unit" in text
    assert not re.search(r"<(script|link)[^>]+(src|href)=['\"]https?://", text)


def test_committed_sample_report_is_this_versions(sample_run_path, tmp_path, monkeypatch):
    """traces/sample/report.json, which the README reads back as "a --json file (here the demo's)", is what this
    version's analysis writes for the sample run (it had gone stale: a finding's share 25.1% where the analysis
    reads 30.4%, its fix an older snippet). Regenerate: fsdp-doctor analyze traces/sample --json
    traces/sample/report.json."""
    from fsdp_doctor.cli import main

    monkeypatch.chdir(sample_run_path.parent.parent)  # the paths in the report are as given: from the repo root
    main(["analyze", "traces/sample", "--json", str(tmp_path / "report.json")])
    fresh = json.loads((tmp_path / "report.json").read_text())
    assert fresh == json.loads((sample_run_path / "report.json").read_text()), "traces/sample/report.json is stale: regenerate it (see this test's docstring)"


def test_cli_writes_html(sample_run_path, tmp_path):
    from fsdp_doctor.cli import main

    out = tmp_path / "r.html"
    rc = main(["analyze", str(sample_run_path), "--html", str(out)])
    assert rc in (0, 3)
    assert out.exists() and "fsdp-doctor report" in out.read_text()


def test_basic_plotly_bundle_when_installed_else_the_full_one(tmp_path, monkeypatch):
    """The report draws only bars and scatters: plotly.js's basic bundle (installed by `make setup` from npm) is
    inlined when its version is plotly.py's; otherwise, or with another version, the full bundle."""
    from plotly.offline import get_plotlyjs_version

    from fsdp_doctor.present import html as H

    ver = get_plotlyjs_version()
    fake = tmp_path / "plotly-basic.min.js"
    fake.write_text(f"/**\n* plotly.js (basic - minified) v{ver}\n*/\nwindow.FAKE_BASIC_BUNDLE=1;</script>x")
    monkeypatch.setattr(H.sys, "prefix", str(tmp_path / "no-venv"))  # ignore a bundle installed in this venv
    monkeypatch.setenv(H.PLOTLYJS_ENV, str(fake))
    text = render_html(_report())
    assert text.count("FAKE_BASIC_BUNDLE") == 1 and len(text) < 200_000  # inlined once; no full bundle
    assert "<\\/script>x" in text  # the bundle cannot close its script tag early
    assert text.count("Plotly.newPlot") >= 5
    fake.write_text("/**\n* plotly.js (basic - minified) v0.0.1\n*/\nwindow.FAKE_BASIC_BUNDLE=1;")
    text = render_html(_report())
    assert "FAKE_BASIC_BUNDLE" not in text and len(text) > 1_000_000 and f"plotly.js v{ver}" in text


def _html_tables(text: str) -> dict[str, list[list[str]]]:
    """The report's tables by id: rows of cell texts (header row first)."""
    from html.parser import HTMLParser

    class P(HTMLParser):
        def __init__(self):
            super().__init__()
            self.tables, self.cur, self.row, self.cell = {}, None, None, None

        def handle_starttag(self, tag, attrs):
            if tag == "table":
                self.cur = self.tables.setdefault(dict(attrs).get("id") or f"anon{len(self.tables)}", [])
            elif tag == "tr" and self.cur is not None:
                self.row = []
                self.cur.append(self.row)
            elif tag in ("td", "th") and self.row is not None:
                self.cell = []

        def handle_endtag(self, tag):
            if tag in ("td", "th") and self.cell is not None:
                self.row.append("".join(self.cell))
                self.cell = None
            elif tag == "table":
                self.cur = None

        def handle_data(self, data):
            if self.cell is not None:
                self.cell.append(data)

    p = P()
    p.feed(text)
    return p.tables


def _rich_rows(table) -> list[list[str]]:
    """A rich Table's header and rows as the terminal prints them (cell texts)."""
    cols = table.columns
    return [[c.header for c in cols]] + [[str(c._cells[i]) for c in cols] for i in range(table.row_count)]


def _terminal_tables(report) -> dict[str, list[list[str]]]:
    from rich.table import Table

    from fsdp_doctor.present import terminal as T

    out = {}
    steps = [x for x in T.render_steps(report.steps).renderables if isinstance(x, Table)]
    out["steps-table"] = _rich_rows(steps[0])
    if len(steps) > 1:
        out["outliers-table"] = _rich_rows(steps[1])
    out["throughput-table"] = _rich_rows(T.render_throughput(report.throughput).renderables[0])
    return out


def _with_throughput(rep: dict) -> dict:
    rep["throughput"] = {"per_rank": {"0": {"step_p50_ms": 110.0, "tokens_per_s": 37_236.4, "achieved_tflops": 0.0412},
                                      "1": {"step_p50_ms": 111.0, "tokens_per_s": 36_900.0}},
                         "job": {"tokens_per_s": 73_800.0, "achieved_tflops": 0.082, "mfu_pct": 12.25}}
    rep["steps"]["stragglers"] = [{"rank": 1, "phase": "backward", "steps_slower": 7, "steps": 8, "own_ms_p50": 100.0,
                                   "others_own_ms_p50": 90.0, "excess_ms_per_step": 10.04,
                                   "phase_excess_ms_per_step": 9.0}]
    return rep


def test_html_carries_the_terminals_step_throughput_and_outlier_figures(sample_run_path):
    """Every cell of the terminal's step table (p50/p90/p99/max/cv and phases per rank), outlier table and
    throughput table is in the HTML report, in the same row and column; so are the stragglers."""
    from fsdp_doctor.pipeline import build_report
    from fsdp_doctor.report_sections import Report
    from fsdp_doctor.store import load_run

    known = Report.of(_with_throughput(_report()))
    for report in (known, build_report(load_run(sample_run_path))):
        text = render_html(report)
        tables = _html_tables(text)
        term = _terminal_tables(report)
        assert term["steps-table"][1:] and term["throughput-table"][1:]
        for tid, rows in term.items():
            assert tables[tid] == rows, tid
    known_text = render_html(known)
    assert "Straggler: rank 1 spends +10.0 ms/step in backward (7 of 8 steps)" in known_text
    assert _html_tables(known_text)["outliers-table"][1] == ["1", "9", "180.0 ms", "110.0 ms", "GC 60 ms"]
    assert _html_tables(known_text)["throughput-table"][-1] == ["job", "73,800", "0.082", "12.2%", "—"]


def test_step_figure_p50_never_written_over_a_bar():
    """The p50 is in the rank's axis label and drawn as a tick, never as text over the stacked phases."""
    from fsdp_doctor.present.figures import step_summary_figure
    from fsdp_doctor.report_sections import Report

    fig = step_summary_figure(Report.of(_report()).steps)
    assert not fig.layout.annotations
    bars = [t for t in fig.data if t.type == "bar"]
    assert list(bars[0].y) == ["rank 0 · p50 110.0 ms", "rank 1 · p50 110.0 ms"]
    assert all(not t.text for t in bars)
    tick = next(t for t in fig.data if t.name == "p50")
    assert list(tick.x) == [110.0, 110.0]


def test_memory_figures_known_answers():
    """The HTML's memory figures (present/figures.py): each rank's peak categories stacked in MiB with where the
    peak happened under its bar and the capacity line; per unit the own activations."""
    from fsdp_doctor.present.figures import MEMORY_COLORS, memory_peaks_figure, memory_units_figure
    from fsdp_doctor.report_sections import Report

    mem = Report.of(_report()).memory
    fig = memory_peaks_figure(mem)
    bars = {t.name: t for t in fig.data}
    assert set(bars) == {"sharded params", "unsharded params", "optimizer state", "activations"}  # zeros left out
    assert list(bars["activations"].y) == [16.0, 16.0] and bars["activations"].marker.color == MEMORY_COLORS["activations"]
    assert [sum(t.y[i] for t in fig.data) for i in (0, 1)] == [22.25, 22.25]  # 2 + 0.25 + 4 + 16 MiB
    assert list(bars["activations"].x) == [f"rank {r}<br>step 3 · unit norm, lm_head · forward_end" for r in (0, 1)]
    assert fig.layout.shapes[0].y0 == 12.0  # the capacity, MiB
    units = memory_units_figure(mem)
    assert [t.name for t in units.data] == ["sharded", "unsharded", "activations"]
    assert list(units.data[2].y) == [4.0] * 4 and list(units.data[0].x) == [f"layers.{i}" for i in range(4)]


def test_html_carries_the_terminals_memory_table_and_lines(sample_run_path):
    """The terminal's breakdown at the peak (bytes and % per category and rank, the peak row), its per-rank
    lines (where the peak was, share of the capacity, notes) and its per-unit table are in the HTML report, cell
    for cell."""
    def got_units(text):
        return _html_tables(text)["memory-units-table"]

    from rich.console import Console
    from rich.table import Table

    from fsdp_doctor.pipeline import build_report
    from fsdp_doctor.present.memory import render_memory
    from fsdp_doctor.report_sections import Report
    from fsdp_doctor.store import load_run

    for report in (Report.of(_report()), build_report(load_run(sample_run_path))):
        group = render_memory(report.memory)
        term = next(x for x in group.renderables if isinstance(x, Table))
        want = [[c for c in row if "█" not in c and "·" not in c] for row in _rich_rows(term)]  # the bar: a drawing
        want[0] = [c for c in want[0] if not c.startswith("share")]
        text = render_html(report)
        got = _html_tables(text)["memory-table"]
        assert [[c for c in row if c] for row in got] == [[c for c in row if c] for row in want]
        units = [x for x in group.renderables if isinstance(x, Table)][1:]
        if units:
            assert got_units(text) == _rich_rows(units[0])
        console = Console(width=200, record=True)
        for x in group.renderables:
            if not isinstance(x, Table):
                console.print(x)
        for line in console.export_text().splitlines():
            if line.strip():
                assert line.strip() in text.replace("&#x27;", "'"), line


def test_html_header_warns_as_the_terminal_does():
    """Where the doctor stepped aside: the terminal's header lines, in the HTML. How ranks stopped is the report's
    problems' to say (store.reader.run_end_line), never the header's own words."""
    rep = _report()
    rep["run"].update(complete={"0": True, "1": False}, trace_files=2,
                      doctor_errors=[{"rank": 1, "step": 4, "where": "memory", "message": "probe failed"}])
    text = render_html(rep)
    assert "did not finish" not in text
    # the doctor stepping aside is an error line, red as in the terminal (it was the warning's yellow here)
    assert "<p class='err'>doctor stepped aside on rank 1 at step 4 (memory): probe failed</p>" in text
    assert "2 trace files" in text


def test_traces_of_some_ranks_of_a_job_are_said_in_the_header():
    """A folder holding rank 0's trace of a 2-rank job read as a whole job with no word (a new-user trial): the
    header says which ranks have no trace, in the terminal and the HTML alike."""
    from fsdp_doctor.present.fmt import run_warnings
    from fsdp_doctor.report_sections import RunFacts

    said = [w.text for w in run_warnings(RunFacts(world_size=2, trace_ranks=[0]))]
    assert said == ["the traces hold 1 of the job's 2 ranks (no trace of rank 1 here): the figures are rank 0's, and "
                    "a straggler among the others cannot be seen"]
    assert run_warnings(RunFacts(world_size=2, trace_ranks=[0, 1])) == []
    assert run_warnings(RunFacts(world_size=4, trace_ranks=[0, 1], steps_recorded={"0": 3}))  == []  # (records)


def test_steps_table_has_the_jobs_row_the_findings_quote(sample_run_path):
    """The findings and compare quote the job's step p50 (every rank's steps together), which no row of the step
    table showed (a new-user trial read 58.6 ms in every finding and 55.8 / 62.0 in the table); with two ranks or
    more the table ends with the job's row, in the terminal and the HTML alike (both draw steps_rows)."""
    from fsdp_doctor import load_run
    from fsdp_doctor.pipeline import build_report
    from fsdp_doctor.present.fmt import fmt_ms_cell, steps_rows

    steps = build_report(load_run(sample_run_path)).steps
    rows = steps_rows(steps)
    assert [r[0] for r in rows] == ["0", "1", "job"]
    assert rows[-1][:3] == ("job", str(steps.job.count), fmt_ms_cell(steps.job.p50_ms))
    assert steps.job.count == sum(st.count for st in steps.per_rank.values())
    one = steps.__class__(per_rank={"0": steps.per_rank["0"]}, job=steps.job)
    assert [r[0] for r in steps_rows(one)] == ["0"]  # one rank: its row is the job's


def test_communication_tables_are_the_terminals_under_their_titles():
    """The HTML's per-rank communication table had 5 of the terminal's 10 columns (no hidden, blocked AG, dev,
    copies exp.) under the heading "Collectives per unit" (a new-user trial): it is the terminal's table now, every
    cell, under the terminal's title, and the per-unit table carries the terminal's title and its held column.
    On the sample run (gloo) and the recorded GPU run (host-device copies exposed: 168 µs on rank 0 over its 2
    steps)."""
    from pathlib import Path

    from fsdp_doctor.pipeline import build_report
    from fsdp_doctor.present.overlap import _rank_table, _unit_table
    from fsdp_doctor.store import load_run

    traces = Path(__file__).resolve().parents[1] / "traces"
    for run, rank0 in (("sample", ["0", "cpu", "2", "196.4 ms", "75.2 ms", "6.49 ms", "68.8 ms", "8.6%",
                                   "14 in window", "–"]),
                       ("gpu/fixture", ["0", "gpu", "2", "259.0 ms", "252.8 ms", "8.01 ms", "244.8 ms", "3.2%", "0",
                                        "168 µs"])):
        report = build_report(load_run(traces / run))
        text = render_html(report)
        html_rows = _html_tables(text)["overlap-ranks-table"]
        assert html_rows == _rich_rows(_rank_table(report.overlap, 200)), run
        assert html_rows[0] == ["rank", "dev", "steps", "step", "comm", "hidden", "exposed", "overlap", "blocked AG",
                                "copies exp."] and html_rows[1] == rank0, html_rows
        assert ("<h2>Communication</h2><h3>Communication per complete profiled step, per rank (overlap %: whole "
                "window, as HTA)</h3><table class='num' id='overlap-ranks-table'>") in text
        assert re.search(r"<h3>FSDP units, worst exposure first, per profiled step \(top 15 of \d+\)</h3>"
                         r"<table class='num' id='comm-units-table'>", text), run
        # the per-unit table: the terminal's columns and labels, cell for cell (the HTML had its own columns,
        # "collective", "phase", "time / step", and full names, "model.layers.2.mlp.down_proj" beside the
        # terminal's "2.mlp.down_proj": a new-user trial)
        units = _html_tables(text)["comm-units-table"]
        names = [u.name for u in report.units or []]
        assert units == _rich_rows(_unit_table(report.overlap.per_unit, 15, 200, names)), run
        assert units[0] == ["rank", "unit", "op", "calls", "comm", "exposed", "size", "bus BW", "slack", "held"]
        assert len(units) == 16 and {r[2] for r in units[1:]} >= {"AG fwd", "RS bwd"}, units


def test_a_share_of_the_peak_under_0_05_percent_never_reads_0():
    """The memory table's % column read "0.0" for a new-user trial's buffers, 64 B of a 3.17 MiB peak (JSON share
    1.9e-05): "<0.1" in the terminal and the HTML alike (units.fmt_share's rule); the others keep their decimal."""
    from rich.console import Console

    from fsdp_doctor.present.memory import render_memory
    from fsdp_doctor.report_sections import Report

    rep = _report()
    for r in ("0", "1"):
        rep["memory"]["per_rank"][r] = {**rep["memory"]["per_rank"][r], "peak_bytes": 24 * MiB + 64}
        rep["memory"]["per_rank"][r]["peak_breakdown"] = {**rep["memory"]["per_rank"][r]["peak_breakdown"],
                                                          "buffers": 64}
    report = Report.of(rep)
    rows = {r[0]: r[1:] for r in _html_tables(render_html(report))["memory-table"][1:]}
    assert rows["buffers"] == ["64 B", "<0.1", "64 B", "<0.1"], rows
    assert rows["activations"] == ["16.00 MiB", "66.7", "16.00 MiB", "66.7"], rows
    console = Console(width=200, record=True)
    console.print(render_memory(report.memory, 200))
    line = next(x for x in console.export_text().splitlines() if x.strip().startswith("buffers"))
    assert line.split()[:5] == ["buffers", "64", "B", "<0.1", "64"], line


def test_the_pacing_note_wraps_at_the_terminals_width(sample_run_path):
    """"job tokens/s: paced by the slowest rank, rank 1 (step p50 …)" wrapped at the throughput table's 40 columns
    on a 200-column terminal (a table's caption): it is a line of its own under the table now."""
    from rich.console import Console

    from fsdp_doctor.pipeline import build_report
    from fsdp_doctor.present.fmt import throughput_note
    from fsdp_doctor.present.terminal import render_throughput
    from fsdp_doctor.store import load_run

    tp = build_report(load_run(sample_run_path)).throughput
    note = throughput_note(tp)
    assert len(note) > 60 and "\n" not in note
    console = Console(width=200, record=True)
    console.print(render_throughput(tp, 200))
    lines = console.export_text().splitlines()
    assert note in [x.rstrip() for x in lines], lines
    assert max(len(x.rstrip()) for x in lines if "paced" not in x) < 60  # (the table itself is narrower)


def test_the_job_tokens_per_s_names_the_rank_that_paces_it(sample_run_path):
    """The job's tokens/s is every rank's tokens over the slowest rank's step (a new-user trial: 2,243 tokens/s, 114.1
    ms a step on rank 1, beside the step table's job p50 of 112.9 ms over both ranks' steps): the report names that
    rank, and the terminal and the HTML say so under the table."""
    from fsdp_doctor.pipeline import build_report
    from fsdp_doctor.present.fmt import throughput_note
    from fsdp_doctor.store import load_run

    report = build_report(load_run(sample_run_path))
    tp = report.throughput
    slow = max(tp.per_rank, key=lambda r: tp.per_rank[r].step_p50_ms)
    p50 = tp.per_rank[slow].step_p50_ms
    assert tp.job.paced_by == slow and tp.job.tokens_per_s == round(512 / (p50 / 1e3), 1)
    assert p50 != report.steps.job.p50_ms  # (the job's p50 is over every rank's steps)
    # and its FLOP rate: every rank's FLOPs per step over that rank's step, not the sum of the ranks' own rates (a
    # new-user trial's job read 0.00147 TFLOP/s, its ranks' 0.00061 + 0.000862, paced: 0.00122)
    flops = sum(row.flops_per_step for row in tp.per_rank.values())
    assert tp.job.achieved_tflops == float(f"{flops / (p50 / 1e3) / 1e12:.4g}")
    assert tp.job.achieved_tflops < sum(row.achieved_tflops for row in tp.per_rank.values())
    line = f"job tokens/s and TFLOP/s: paced by the slowest rank, rank {slow} (step p50 {p50:.1f} ms)"
    assert throughput_note(tp).splitlines() == [line]
    assert f"<p class='note'>{line}</p>" in render_html(report)
