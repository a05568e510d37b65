"""One pipeline, one truth: the committed sample run rendered in the terminal, JSON, HTML and the dashboard shows
the same figures; the run directory holds one run (readers never mix runs); the diagnosis always predicts."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import msgspec
import pytest
from rich.console import Console

from fsdp_doctor.pipeline import build_report
from fsdp_doctor.present.fmt import VERDICT_COLUMNS, comm_headline, fmt_bw, fmt_bytes, fmt_ms, verdict_headline, verdict_share
from fsdp_doctor.present.terminal import render_report
from fsdp_doctor.report_sections import Report
from fsdp_doctor.store import load_run

SAMPLE = Path(__file__).resolve().parents[1] / "traces" / "sample"


@pytest.fixture(scope="module")
def cli_report():
    return build_report(load_run(SAMPLE))


@pytest.fixture(scope="module")
def snap():
    from fsdp_doctor.dashboards.state import RunState

    st = RunState(SAMPLE, background_traces=False)
    st.refresh()
    return st.snapshot()


def _terminal(report: Report) -> str:
    c = Console(width=100, record=True, color_system=None)
    render_report(report, c)
    return c.export_text()


def _walk_text(component) -> str:
    return json.dumps(component.to_plotly_json() if hasattr(component, "to_plotly_json") else component,
                      default=lambda o: o.to_plotly_json() if hasattr(o, "to_plotly_json") else str(o))


def test_dashboard_report_is_the_cli_report(cli_report, snap):
    """The dashboard's state goes through the same pipeline: every figure of the report is equal (sizes from
    the unit snapshot included: all 34 per-unit rows of the sample carry bytes and bus bandwidth)."""
    dash = Report.of(snap.report)
    for key in ("steps", "units", "throughput", "memory", "comm", "findings"):
        assert getattr(dash, key) == getattr(cli_report, key), key
    rows, cli_rows = dash.overlap.per_unit, cli_report.overlap.per_unit
    assert len(rows) == 34
    assert sum(r.bytes_per_call is not None for r in rows) == 34
    assert sum(r.busbw_gbps is not None for r in rows) == 34
    key = lambda r: (r.rank, r.unit, r.collective, str(r.phase))  # noqa: E731
    assert sorted(rows, key=key) == sorted(cli_rows, key=key)
    assert dash.overlap.per_rank == cli_report.overlap.per_rank


def test_same_figures_in_terminal_json_html_and_dashboard(cli_report, snap, tmp_path):
    from fsdp_doctor.cli import main
    from fsdp_doctor.dashboards.pages import PAGES
    from fsdp_doctor.dashboards.pages.common import Filters

    out_json, out_html = tmp_path / "r.json", tmp_path / "r.html"
    assert main(["analyze", str(SAMPLE), "--json", str(out_json), "--html", str(out_html)]) == 0
    js = json.loads(out_json.read_text())
    html = out_html.read_text()
    term = _terminal(cli_report)
    dash = "".join(_walk_text(c) for name in ("overview", "memory", "communication", "units")
                   for c in PAGES[name][1].layout(snap, Filters()))

    p50 = js["steps"]["job"]["p50_ms"]
    peak = max(m["peak_bytes"] for m in js["memory"]["per_rank"].values())
    dash_report = Report.of(snap.report)
    assert p50 == cli_report.steps.job.p50_ms == dash_report.steps.job.p50_ms
    assert fmt_ms(p50) in html and fmt_ms(p50) in dash
    assert fmt_bytes(peak) in term and fmt_bytes(peak) in html and fmt_bytes(peak) in dash
    # the one exposed-communication figure, with its source, in the terminal and the HTML report
    comm = js["comm"]
    assert comm["source"] == "trace" and comm == msgspec.to_builtins(dash_report.comm)
    head = comm_headline(cli_report.comm)
    assert fmt_ms(comm["exposed_ms_per_step"]) in head and "source: profiler trace, steps 6–7" in head
    assert " ".join(head.split()) in " ".join(term.split())  # the terminal wraps it at 100 columns
    assert head in html.replace("&#x27;", "'")
    # per-unit message size and bus bandwidth: same numbers, same formatter (binary bytes, decimal bandwidth)
    top = js["overlap"]["per_unit"][0]
    assert fmt_bytes(top["bytes_per_call"]) == "774.50 KiB" and fmt_bw(top["busbw_gbps"]) == "49.6 MB/s"
    line = next(ln for ln in term.splitlines() if top["unit"] in ln and "RS bwd" in ln)
    assert "774.50 KiB" in line and "49.6 MB/s" in line
    assert "<td>774.50 KiB</td><td>49.6 MB/s</td>" in html
    assert "774.50 KiB" in dash
    assert "793.1 kB" not in term + html + dash  # one convention: no decimal byte units left
    # finding codes and the prediction
    codes = [f["code"] for f in js["findings"]]
    assert codes == [f.code for f in dash_report.findings] == ["prefetch.exposed_allgather"]
    for c in codes:
        assert c in term and c in html and c in dash
    pred = js["findings"][0]["predicted"]
    # (the sample's prefetch fix predicts no change on gloo: "unchanged", not "136.1 ms → 136.1 ms (0% faster)")
    assert pred["step_ms_after"] == pred["step_ms_before"]
    arrow = f"step {fmt_ms(pred['step_ms_before'])} unchanged"
    assert arrow in term and arrow in html
    # the verdict: the same bound, sentence and shares everywhere, first in every presenter
    v = js["verdict"]
    assert v == msgspec.to_builtins(cli_report.verdict) == msgspec.to_builtins(dash_report.verdict)
    assert v["job"]["bound"] == "compute" and v["job"]["source"] == "trace"
    head = verdict_headline(cli_report.verdict)
    # communication's parts compared as one group when naming the runner-up (35% > 17% of its largest part); the
    # main thread's waits in FSDP's synchronous collectives are communication (host read 33%, communication 22%)
    assert head == ("Verdict: compute-bound (42% of the step); then exposed communication 35% (exposed "
                    "reduce-scatter 17%, exposed all-gather (forward) 11%, exposed all-gather (backward) 8%), "
                    "host (main thread outside operators and collectives) 20%")
    flat = " ".join(term.split())
    assert head in flat and flat.index(head) < flat.index("Step time per rank")
    assert html.index(head) < html.index("<h2>Diagnosis</h2>")
    page = PAGES["overview"][1].layout(snap, Filters())
    assert _walk_text(page[0]).count(head) == 1 and head not in "".join(_walk_text(c) for c in page[1:])
    for r, want in (("0", ["39.4", "35.0", "10.9", "7.8", "16.4", "0.0", "22.0", "3.5", "0.0"]),
                    ("1", ["44.0", "35.4", "10.4", "8.3", "16.6", "0.0", "18.5", "2.1", "0.0"]),
                    ("job", ["41.7", "35.2", "10.6", "8.1", "16.5", "0.0", "20.3", "2.8", "0.0"])):
        entry = cli_report.verdict.job if r == "job" else cli_report.verdict.per_rank[r]
        assert [f"{verdict_share(entry, c):.1f}" for c in VERDICT_COLUMNS] == want
        step = fmt_ms(entry.step_ms) if r != "job" else ""
        line = next(ln for ln in term.splitlines() if ln.split()[:2] == [r, "compute"])
        assert line.split() == [r, "compute", *step.split(), *want]
        cells = "".join(f"<td>{x}</td>" for x in (step, *want))
        assert f"<td>{r}</td><td class=l>compute</td>{cells}</tr>" in html
        assert all(f'"{x}"' in dash for x in (r, "compute", *want))  # the overview's table cells
        label = json.dumps(f"rank {r} · {step}" if step else "job · 2 ranks")  # the bar's label, as JSON holds it
        assert label in dash and label in html


def test_prefetch_finding_always_predicts(cli_report):
    """The quoted gain is the snippet's own (explicit prefetch): on gloo it hides nothing (the collectives share
    the cores with compute), so the prediction is "no change", said as such; keeping units gathered after forward
    (reshard_after_forward=False), a different fix, is quoted apart in the evidence with its memory cost."""
    f = next(f for f in cli_report.findings if f.code == "prefetch.exposed_allgather")
    p = f.predicted
    assert p["step_ms_after"] is not None and p["step_ms_after"] == p["step_ms_before"]
    assert f.evidence["prefetch_overlap_assumed_pct"] == 0
    assert f.evidence["expected_gain_ms"] == pytest.approx(p["step_ms_before"] - p["step_ms_after"], abs=2e-3)
    assert p["peak_bytes_after"] == p["peak_bytes_before"]  # explicit prefetch gathers no earlier than FSDP does
    assert f.evidence["reshard_after_forward_false_ms"] > 0 and f.evidence["reshard_after_forward_false_bytes"] > 0


def test_no_warning_is_not_called_healthy(cli_report):
    term = _terminal(cli_report)
    assert "Healthy" not in term and "No warnings; 1 note below" in term


def test_profiler_export_step_is_marked(cli_report, snap):
    ps = cli_report.steps.profiler_steps
    assert ps == {"0": {"window": [6, 7], "export": [8]}, "1": {"window": [6, 7], "export": [8]}}
    cols = snap.steps[0]
    i = cols["step"].index(8)
    assert cols["profiler_export"][i] is True and cols["outside_ms"][i] > 500  # the 625 ms "outside" is the export
    assert sum(cols["profiler_export"]) == 1
    # the one steady-state rule, as a column: as many steady steps as the statistics counted
    assert sum(cols["steady"]) == cli_report.steps.per_rank["0"].count and not cols["steady"][i]


# ------------------------------------------------------------------------------------------- one run per directory
def _with_run_ids(dst: Path, ids: dict[int, str], manifest_id: str, world_size: int | None = None) -> None:
    """Stamps run ids into a copy of the sample (written before run ids existed): header of each rank, manifest."""
    m = json.loads((dst / "manifest.json").read_text())
    m["run_id"] = manifest_id
    if world_size is not None:
        m["world_size"] = world_size
    (dst / "manifest.json").write_text(json.dumps(m))
    for r, rid in ids.items():
        p = dst / f"rank{r}.records.jsonl"
        lines = p.read_bytes().splitlines(keepends=True)
        head = json.loads(lines[0])
        assert head["t"] == "header"
        head["run_id"] = rid
        lines[0] = json.dumps(head).encode() + b"\n"
        p.write_bytes(b"".join(lines))


def test_readers_accept_files_without_run_id():
    run = load_run(SAMPLE)
    assert run.run_id == "" and sorted(run.ranks) == [0, 1] and not run.problems
    assert len(run.trace_files) == 2


def test_reader_refuses_to_mix_runs(tmp_path):
    d = tmp_path / "run"
    shutil.copytree(SAMPLE, d)
    # a stale rank 2 of an earlier 3-rank run, and rank 1 of another run
    shutil.copy(d / "rank1.records.jsonl", d / "rank2.records.jsonl")
    shutil.copy(d / "profiler" / "rank1.6.pt.trace.json.gz", d / "profiler" / "rank2.6.pt.trace.json.gz")
    _with_run_ids(d, {0: "aaaaaaaaaaaa", 1: "bbbbbbbbbbbb", 2: "aaaaaaaaaaaa"}, "aaaaaaaaaaaa")
    run = load_run(d)
    assert sorted(run.ranks) == [0] and run.run_id == "aaaaaaaaaaaa"
    probs = "\n".join(run.problems)
    assert "rank1.records.jsonl: records of another run (run id bbbbbbbbbbbb, manifest.json says aaaaaaaaaaaa)" in probs
    assert "rank2.records.jsonl: rank 2 is outside this run's 2 ranks" in probs
    # rank 1's and rank 2's profiler windows are not this run's: only rank 0's trace is analysed
    assert [p.name for p in run.trace_files] == ["rank0.6.pt.trace.json.gz"]
    assert "profiler/rank2.6.pt.trace.json.gz: a profiler window of another run" in probs
    rep = build_report(run)
    assert rep.run.ranks == [0] and sorted(rep.overlap.per_rank) == ["0"]
    assert {r.rank for r in rep.overlap.per_unit} == {0}
    # the header counts the windows left out, as it counts traces the trace analysis skips (another run's traces in
    # profiler/ read "2 trace files" alone, one folder up "2 trace files · 2 left out": a new-user trial)
    from fsdp_doctor.present.fmt import run_facts

    assert (rep.run.trace_files, rep.run.trace_files_unread) == (1, 2)
    assert run_facts(rep.run)[-2:] == ["1 trace file", "2 left out (listed at the end)"]


def test_cli_names_the_mixed_run_and_exits_3(tmp_path, capsys):
    from fsdp_doctor.cli import main

    d = tmp_path / "run"
    shutil.copytree(SAMPLE, d)
    _with_run_ids(d, {0: "aaaaaaaaaaaa", 1: "cccccccccccc"}, "aaaaaaaaaaaa")
    assert main(["analyze", str(d)]) == 3
    out = capsys.readouterr().out
    flat = " ".join(out.split())
    assert re.search(r"\b1 trace file\b", flat) and "rank1.records.jsonl: records of another run" in flat
    steps_rows = re.findall(r"^\s+(\d+)\s+\d+\s+[\d.]+\s+[\d.]+", out.split("Step time per rank")[1].split("Throughput")[0], re.M)
    assert steps_rows == ["0"]  # rank 1 of the other run is in no table


def test_manifest_and_header_carry_the_run_id():
    from fsdp_doctor.records import Header, Manifest, record_decoder, record_encoder

    h = record_decoder.decode(record_encoder.encode(Header(rank=0, run_id="0123456789ab")))
    assert h.run_id == "0123456789ab"
    assert msgspec.json.decode(b'{"format":"fsdp-doctor-run","version":1}', type=Manifest).run_id == ""


def test_exposed_comm_without_traces_comes_from_the_records_and_says_so():
    import statistics

    run = load_run(SAMPLE)
    rep = build_report(run, traces=False)
    comm = rep.comm
    assert comm.source == "records" and "all-gather waits" in comm.source_text
    per_rank = {}
    for r, rd in run.ranks.items():
        waits = [sum(u.ag_wait_fwd_ms + u.ag_wait_bwd_ms for u in s.units) for s in rd.steps if s.step > 0 and not s.profiled]
        per_rank[str(r)] = statistics.median(waits)
    assert comm.exposed_ms_per_step == pytest.approx(statistics.median(per_rank.values()), abs=1e-3)
    assert comm.comm_ms_per_step is None and "reduce-scatters need a profiler trace" in comm.definition
    assert "source: recorded all-gather waits" in comm_headline(comm)


def test_a_failing_rule_is_a_problem_not_a_silent_healthy(sample_run_path, monkeypatch):
    """A rule that raises is listed under problems (the analysis says what it could not check)."""
    from fsdp_doctor.diagnose.rules.prefetch import ExposedAllGather
    from fsdp_doctor.pipeline import build_report
    from fsdp_doctor.store import load_run

    def boom(self, ctx):
        raise ZeroDivisionError("injected")

    monkeypatch.setattr(ExposedAllGather, "match", boom)
    report = build_report(load_run(sample_run_path))
    assert "prefetch.exposed_allgather" not in {f.code for f in report.findings}
    assert any(p.startswith("prefetch.exposed_allgather not checked: the rule failed (ZeroDivisionError: injected)")
               for p in report.problems)


def test_a_report_of_nothing_says_so_from_python(tmp_path):
    """``build_report(load_run(empty))`` was a report of no finding and no problem, where the CLI says "no
    fsdp-doctor records..." and exits 2 (a new-user trial's script): the report's first problem is the CLI's line."""
    from fsdp_doctor import build_report, load_run

    rep = build_report(load_run(tmp_path))
    assert rep.findings == [] and rep.problems == [
        f"{tmp_path}: no fsdp-doctor records and no Kineto traces (*.json, *.json.gz) found"], rep.problems


def test_ranks_a_step_apart_in_a_run_being_written_are_not_named_stopped(tmp_path):
    """A run still writing is read one stream after the other, so its ranks can be a step apart: "rank 0 stopped first
    (last record: step 28; rank 1 step 29) and wrote no end record: it died or hung" read in 1 of a new-user trial's
    12 analyses of a live run (exit 3). Streams written lately, none with an end record, are a run still going (a
    note, each rank's last step); the same streams left alone past STALE_S are named, the first to stop first."""
    import os
    import time

    from fsdp_doctor import load_run
    from fsdp_doctor.store.reader import STALE_S

    d = tmp_path / "run"
    shutil.copytree(SAMPLE, d)
    for r, keep in ((0, 28), (1, 29)):  # no end records; rank 0 a step behind
        s = d / f"rank{r}.records.jsonl"
        lines = [ln for ln in s.read_bytes().splitlines(keepends=True) if not ln.startswith(b'{"t":"end"')]
        s.write_bytes(b"".join(ln for ln in lines if not (ln.startswith(b'{"t":"step","step":')
                                                         and int(ln.split(b",")[1].split(b":")[1]) > keep)))
    run = load_run(d)
    assert not [p for p in run.problems if "stopped" in p] and run.notes == [
        "the run is still going (no rank has ended; last records: step 28 on rank 0, step 29 on rank 1)"]
    old = time.time() - STALE_S - 60
    for r in (0, 1):
        os.utime(d / f"rank{r}.records.jsonl", (old, old))
    run = load_run(d)
    (named,) = [p for p in run.problems if "stopped first" in p]
    assert named.startswith("rank 0 stopped first, after step 28, without an end record (killed, or hung); rank 1 "
                            "stopped after step 29"), named
    assert run.notes == []


def test_records_appended_after_the_read_are_not_a_cut_off_record(tmp_path):
    """A run still writing: a whole step record appended between the reader's pass and its check of the stream's
    end was named "last record is incomplete (1346 bytes, the run was cut off mid-write)" and the analysis exited 3
    (a new-user trial, 2 of 12 analyses of a live run). Only bytes the reader read without their line end are a
    record cut off; a torn last line, as a kill leaves, is still named with its size."""
    from fsdp_doctor.store.reader import RunFollower, closing_problems

    d = tmp_path / "run"
    shutil.copytree(SAMPLE, d)
    s0 = d / "rank0.records.jsonl"
    lines = s0.read_bytes().splitlines(keepends=True)
    assert lines[-2].startswith(b'{"t":"step","step":29,') and lines[-1].startswith(b'{"t":"end"')
    s0.write_bytes(b"".join(lines[:-2]))  # the run is at step 28
    follower = RunFollower(d)
    run, _ = follower.poll()
    assert max(s.step for s in run.ranks[0].steps) == 28
    with open(s0, "ab") as f:  # step 29 lands after the read, in one write, as the recorder writes it
        f.write(lines[-2])
    got, _, _ = closing_problems(follower, run)
    assert not [q for q in got if "rank0.records.jsonl" in q], got

    # a kill mid-write: the reader reads 40 bytes of step 29 without their line end
    s0.write_bytes(b"".join(lines[:-2]) + lines[-2][:40])
    follower = RunFollower(d)
    run, _ = follower.poll()
    got, _, _ = closing_problems(follower, run)
    assert [q for q in got if "rank0.records.jsonl" in q] == [
        "rank 0's records stop after step 28 in the middle of a record (40 bytes at the end of rank0.records.jsonl): a "
        "write of the doctor's failed there (a full disk?), the rank may have trained on; rank 1 finished after step "
        "29; the completed steps of every rank are used"]
    assert max(s.step for s in run.ranks[0].steps) == 28
