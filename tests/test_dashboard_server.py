"""The dashboard's server side without a browser (Flask's test client): a run replaced or truncated while it is
followed is read again from scratch and the page says so; stream problems show as they appear; traces that fail
to decode are named on the Communication page; the ``Host:`` header is checked; malformed callback posts are
400s without a traceback in the log; the page answers are cached per run-state version."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import msgspec
import pytest

from fsdp_doctor.dashboards import guard
from fsdp_doctor.dashboards.app import create_app
from fsdp_doctor.dashboards.state import RunState
from fsdp_doctor.records import Header, Manifest, StepRecord, record_decoder, record_encoder
from fsdp_doctor.store import layout

SAMPLE = Path(__file__).resolve().parents[1] / "traces" / "sample"


def write_run(d: Path, run_id: str, steps: int, started_ns: int) -> Path:
    """The sample's records as run ``run_id`` with its first ``steps`` steps (no traces): what
    ``fsdp-doctor demo --overwrite`` leaves, a fresh manifest and fresh streams."""
    d.mkdir(parents=True, exist_ok=True)
    layout.clear_run(d)
    m = msgspec.json.decode((SAMPLE / "manifest.json").read_bytes(), type=Manifest)
    (d / "manifest.json").write_bytes(record_encoder.encode(msgspec.structs.replace(m, run_id=run_id,
                                                                                   started_ns=started_ns)))
    for src in sorted(SAMPLE.glob("rank*.records.jsonl")):
        out = []
        for ln in src.read_bytes().splitlines():
            rec = record_decoder.decode(ln)
            if isinstance(rec, Header):
                rec = msgspec.structs.replace(rec, run_id=run_id, started_ns=started_ns)
            if isinstance(rec, StepRecord) and rec.step >= steps:
                continue
            out.append(record_encoder.encode(rec) + b"\n")
        (d / src.name).write_bytes(b"".join(out))
    return d


def _steps(state: RunState) -> dict[int, list[int]]:
    return {r: c["step"] for r, c in state.snapshot().steps.items()}


def _post(client, output: str, inputs: list, state: list = (), changed=()):
    body = {"output": output, "outputs": {"id": output.split(".")[0], "property": output.split(".")[1]},
            "inputs": inputs, "state": list(state), "changedPropIds": list(changed)}
    return client.post("/_dash-update-component", data=json.dumps(body), content_type="application/json")


def _page_post(client, pathname="/overview", search="", version=1):
    return _post(client, "page.children", [{"id": "url", "property": "pathname", "value": pathname},
                                          {"id": "url", "property": "search", "value": search},
                                          {"id": "version", "property": "data", "value": version}],
                 changed=["url.pathname"])


def test_overwritten_run_is_read_again_and_the_page_says_so(tmp_path):
    run = write_run(tmp_path / "run", "aaaaaaaaaaaa", 20, 1)
    state = RunState(run, background_traces=False)
    state.refresh()
    assert _steps(state) == {0: list(range(20)), 1: list(range(20))}
    assert state.snapshot().notice == ""
    write_run(run, "bbbbbbbbbbbb", 8, 2)  # `make demo`: the old files removed, a new run written
    state.refresh()
    snap = state.snapshot()
    assert _steps(state) == {0: list(range(8)), 1: list(range(8))}  # the new run only, never 0-19 and 0-7 mixed
    assert snap.report.run.steps_recorded == {"0": 8, "1": 8}
    assert "manifest.json was" in snap.notice and "from scratch" in snap.notice
    app = create_app(run, state=state)
    page = _page_post(app.server.test_client(), "/steps", "", snap.version).get_data(as_text=True)
    assert "reload-note" in page and "from scratch" in page


def test_truncated_stream_is_read_again(tmp_path):
    run = write_run(tmp_path / "run", "cccccccccccc", 20, 1)
    state = RunState(run, background_traces=False)
    state.refresh()
    p = run / "rank1.records.jsonl"
    lines = p.read_bytes().splitlines(keepends=True)
    keep = [ln for ln in lines if b'"t":"step"' not in ln or record_decoder.decode(ln).step < 5]
    with open(p, "r+b") as f:  # the same file, cut short (no new inode)
        f.truncate(0)
        f.write(b"".join(keep))
    state.refresh()
    assert _steps(state) == {0: list(range(20)), 1: list(range(5))}
    assert "rank1.records.jsonl was truncated" in state.snapshot().notice


def test_stream_problem_shows_without_a_new_record(tmp_path):
    run = write_run(tmp_path / "run", "dddddddddddd", 10, 1)
    state = RunState(run, background_traces=False)
    state.refresh()
    v = state.version
    with open(run / "rank0.records.jsonl", "ab") as f:
        f.write(b'{"t":"step","rank":0,"step":"not a number"}\n')
    assert state.refresh() and state.version == v + 1
    assert any("rank0.records.jsonl: line" in p and "not a valid record" in p for p in state.snapshot().report.problems)
    assert _steps(state)[0] == list(range(10))


def test_communication_page_names_traces_that_failed(tmp_path):
    from fsdp_doctor.dashboards.pages import communication
    from fsdp_doctor.dashboards.pages.common import Filters

    run = write_run(tmp_path / "run", "eeeeeeeeeeee", 10, 1)
    (run / "profiler").mkdir()
    (run / "profiler" / "rank0.6.pt.trace.json").write_text('{"traceEvents": [')  # cut short
    state = RunState(run, background_traces=False)
    state.refresh()
    snap = state.snapshot()
    text = json.dumps([c.to_plotly_json() for c in communication.layout(snap, Filters())], default=str)
    assert "none could be analysed" in text and "rank0.6.pt.trace.json" in text
    assert "No Kineto traces" not in text


@pytest.fixture(scope="module")
def sample_app():
    state = RunState(SAMPLE, background_traces=False)
    state.refresh()
    return create_app(SAMPLE, state=state)


def test_host_header_is_checked(sample_app):
    c = sample_app.server.test_client()
    for host in ("localhost", "127.0.0.1:8050", "[::1]:8050", "LOCALHOST:9000"):
        assert c.get("/", headers={"Host": host}).status_code == 200, host
    for host in ("evil.example", "evil.example:8050", "127.0.0.1.evil.example", "localhost.evil.example:8050"):
        assert c.get("/", headers={"Host": host}).status_code == 403, host
        assert _page_post(c).status_code == 200  # the default test Host (localhost) is served
    assert "10.1.2.3" in guard.allowed_hosts("10.1.2.3") and "10.1.2.4" not in guard.allowed_hosts("10.1.2.3")
    wild = guard.allowed_hosts("0.0.0.0")
    assert {"localhost", "127.0.0.1"} <= wild and "evil.example" not in wild
    assert guard.host_name("[::1]:8050") == "::1" and guard.host_name("Example.COM:80") == "example.com"


BAD_BODIES = [b"", b"not json", b"[]", b"{}", b'{"output": "page.children"}',
              b'{"output": "nope.children", "outputs": {}, "inputs": [], "changedPropIds": []}',
              b'{"output": "page.children", "outputs": {"id": "page", "property": "children"}, "inputs": [], '
              b'"changedPropIds": []}',
              b'{"output": "page.children", "outputs": {"id": "page", "property": "children"}, "inputs": '
              b'[{"id": "url", "property": "pathname", "value": 5}, {"id": "url", "property": "search", "value": [1]},'
              b' {"id": "version", "property": "data", "value": 1}], "changedPropIds": []}',
              b'{"output": "page.children", "outputs": {"id": "page", "property": "children"}, "inputs": '
              b'[{"id": "url", "property": "pathname", "value": "/"}], "changedPropIds": "x"}']


def test_malformed_callback_posts_are_400_without_traceback(sample_app, caplog):
    c = sample_app.server.test_client()
    caplog.set_level(logging.INFO)
    for body in BAD_BODIES:
        caplog.clear()
        r = c.post("/_dash-update-component", data=body, content_type="application/json")
        assert r.status_code == 400, body
        assert b"Traceback" not in r.data
        assert all(rec.exc_info is None and "Traceback" not in rec.getMessage() for rec in caplog.records), body
        assert len(caplog.records) == 1 and "\n" not in caplog.records[0].getMessage()
    assert _page_post(c).status_code == 200  # and a well-formed post is still answered


def test_page_answers_are_cached_per_version(sample_app, monkeypatch):
    from fsdp_doctor.dashboards.pages import steps

    calls = []
    real = steps.layout
    monkeypatch.setattr(steps, "layout", lambda *a: calls.append(1) or real(*a))
    c = sample_app.server.test_client()
    v = sample_app._fsdp_state.version
    first = _page_post(c, "/steps", "?rank=1", v)
    again = _page_post(c, "/steps", "?rank=1", v)
    assert first.status_code == again.status_code == 200 and first.data == again.data
    assert len(calls) == 1
    assert _page_post(c, "/steps", "?rank=0", v).data != first.data and len(calls) == 2


def test_communication_page_names_a_failed_trace_beside_good_ones(tmp_path):
    from fsdp_doctor.dashboards.pages import communication
    from fsdp_doctor.dashboards.pages.common import Filters

    run = write_run(tmp_path / "run", "ffffffffffff", 10, 1)
    shutil.copytree(SAMPLE / "profiler", run / "profiler")
    (run / "profiler" / "rank1.6.pt.trace.json.gz").write_bytes(b"\x1f\x8b not gzip")
    state = RunState(run, background_traces=False)
    state.refresh()
    snap = state.snapshot()
    assert [w.rank for w in snap.windows] == [0]
    text = json.dumps([c.to_plotly_json() for c in communication.layout(snap, Filters())], default=str)
    assert "comm-trace-errors" in text and "rank1.6.pt.trace.json.gz" in text and "fig-comm-timeline" in text


def test_a_run_that_stopped_writing_is_not_live(tmp_path):
    """A run whose ranks died writes no end record: its status said "live" for good, stamped with the time of the
    page (a new-user trial: a SIGKILLed rank, minutes later). It now gives the time of its last record and, after
    STALE_S without one, says so; a finished run says finished."""
    from fsdp_doctor.dashboards.app import _run_status
    from fsdp_doctor.dashboards.pages.common import STALE_S, run_state

    run = write_run(tmp_path / "run", "eeeeeeeeeeee", 10, 1)
    for f in run.glob("rank*.records.jsonl"):  # killed: no end record
        f.write_bytes(b"".join(ln + b"\n" for ln in f.read_bytes().splitlines() if not ln.startswith(b'{"t":"end"')))
    state = RunState(run, background_traces=False)
    snap = state.snapshot()
    assert not all(snap.report.run.complete.values())  # no end record: the records stop at step 9
    assert run_state(snap.report, snap.updated, now=snap.updated + 5) == "live"
    assert run_state(snap.report, snap.updated, now=snap.updated + STALE_S + 60) == "no new record for 3 min"
    status = _run_status(snap)
    assert status.startswith("live · 10 steps × 2 ranks · last record ")
    done = RunState(SAMPLE, background_traces=False).snapshot()
    assert run_state(done.report, done.updated, now=done.updated + 1e6) == "finished"
    # a loop that raised through watch() (Ctrl-C) ended: its end record names the exception, and so does the status
    for f in run.glob("rank*.records.jsonl"):
        f.write_bytes(f.read_bytes() + b'{"t":"end","rank":%d,"steps":10,"ended_ns":1,"exception":"KeyboardInterrupt"}\n'
                      % int(f.name[4]))
    snap = RunState(run, background_traces=False).snapshot()
    assert run_state(snap.report, snap.updated, now=snap.updated + 1e6) == "stopped on KeyboardInterrupt"


def test_a_cached_page_answer_follows_the_run_going_stale(tmp_path, monkeypatch):
    """A rank killed while the dashboard follows its run: no record comes, the run state's version stays, and the
    Overview answered while the run was "live" (how its ranks stopped held back) was served from the cache for good,
    "live" minutes later (a new-user trial). The cache key holds the run's state: once stale, a new answer, with
    the line analyze gives."""
    import time as _time

    from fsdp_doctor.dashboards.app import create_app
    from fsdp_doctor.dashboards.pages.common import STALE_S

    run = write_run(tmp_path / "run", "dddddddddddd", 10, 1)
    for f in run.glob("rank*.records.jsonl"):  # killed: no end record
        f.write_bytes(b"".join(ln + b"\n" for ln in f.read_bytes().splitlines() if not ln.startswith(b'{"t":"end"')))
    state = RunState(run, background_traces=False)
    state.snapshot()  # (read: the version the pages are answered at)
    app = create_app(run, state=state)
    c = app.server.test_client()
    live = _page_post(c, "/overview", "", state.version).get_data(as_text=True)
    assert _page_post(c, "/overview", "", state.version).get_data(as_text=True) == live  # (cached)
    assert "without an end record" not in live
    later = _time.time() + STALE_S + 60
    monkeypatch.setattr(_time, "time", lambda: later)
    stale = _page_post(c, "/overview", "", state.version).get_data(as_text=True)
    assert "ranks 0, 1 stopped after step 9 without an end record" in stale, stale[:2000]


def test_a_run_that_crashed_before_the_dashboard_opened_reads_as_stopped_with_the_headers_warnings(tmp_path):
    """A run whose rank was killed ten minutes before the dashboard opened read "live", its last record the time of
    loading, and the Overview said only "finished: no" where the terminal and HTML headers say which rank did not
    finish; the Communication page still awaited traces (a new-user trial on 3 ranks). The last record's time is
    the records' files', the Overview gives analyze's line of how the ranks stopped once the run is not live, and the
    Communication page says no trace will come."""
    import os
    import time as _time

    from fsdp_doctor.dashboards.app import _run_status
    from fsdp_doctor.dashboards.pages import communication, overview
    from fsdp_doctor.dashboards.pages.common import Filters

    run = write_run(tmp_path / "run", "ffffffffffff", 10, 1)
    then = _time.time() - 600
    for f in run.glob("rank*.records.jsonl"):  # killed: no end record, ten minutes ago
        f.write_bytes(b"".join(ln + b"\n" for ln in f.read_bytes().splitlines() if not ln.startswith(b'{"t":"end"')))
        os.utime(f, (then, then))
    for f in run.glob("profiler/*"):
        f.unlink()
    snap = RunState(run, background_traces=False).snapshot()
    assert abs(snap.updated - then) < 1, (snap.updated, then)
    assert _run_status(snap).startswith("no new record for 10 min · 10 steps × 2 ranks · last record "
                                        + _time.strftime("%H:%M", _time.localtime(then)))
    text = json.dumps([c.to_plotly_json() for c in overview.layout(snap, Filters())], default=str)
    assert ("ranks 0, 1 stopped after step 9 without an end record (killed, or hung); the completed steps of every "
            "rank are used") in text, text
    comm = json.dumps([c.to_plotly_json() for c in communication.layout(snap, Filters())], default=str)
    assert "No Kineto traces in this run (no new record for 10 min)" in comm, comm
    # the same run while it writes: live, and no warning that its ranks have not finished
    for f in run.glob("rank*.records.jsonl"):
        os.utime(f)
    snap = RunState(run, background_traces=False).snapshot()
    text = json.dumps([c.to_plotly_json() for c in overview.layout(snap, Filters())], default=str)
    assert _run_status(snap).startswith("live · ") and "without an end record" not in text


def test_compare_reads_only_the_runs_it_offers_and_says_why_a_folder_cannot_be_compared(tmp_path):
    """A new-user trial posted the Compare page's callback with /etc, an empty folder and a folder of saved JSON
    answers: each drew a plausible comparison ("world_size | job | 0 | 2"). A path the lists do not offer reads
    nothing now, and a folder offered (it holds *.json) with nothing to compare gets the CLI's one line."""
    run = write_run(tmp_path / "runs" / "a", "dddddddddddd", 10, 1)
    junk = tmp_path / "runs" / "saved_answers"
    junk.mkdir()
    (junk / "page.json").write_text('{"response": {"page": {"children": []}}}')
    app = create_app(run, state=RunState(run, background_traces=False))
    c = app.server.test_client()

    def cmp(a, b):
        r = _post(c, "cmp-body.children", [{"id": "cmp-a", "property": "value", "value": a},
                                           {"id": "cmp-b", "property": "value", "value": b}])
        assert r.status_code == 200
        return json.dumps(r.get_json())

    assert "Choose two runs from the lists" in cmp("/etc", str(run.resolve()))
    out = cmp(str(junk.resolve()), str(run.resolve()))
    assert "cannot compare" in out and "nothing to analyse" in out and "world_size" not in out


def test_a_rank_the_run_does_not_have_shows_every_rank_and_says_so(tmp_path):
    """?rank=7 on a 2-rank run (a link from a bigger run, a typo) read "no steps recorded yet" on every page, as if
    the run were empty. It shows every rank now, under one line naming the run's ranks; a rank it has is applied."""
    run = write_run(tmp_path / "run", "eeeeeeeeeeee", 12, 1)
    app = create_app(run, state=RunState(run, background_traces=False))
    c = app.server.test_client()
    for path in ("/overview", "/steps"):
        out = json.dumps(_page_post(c, path, "?rank=7").get_json())
        assert "This run has no rank 7 (its ranks: 0, 1): showing all ranks." in out, out[:2000]
        assert "no steps recorded yet" not in out.lower()
    assert "has no rank" not in json.dumps(_page_post(c, "/steps", "?rank=1").get_json())


def test_memory_page_unit_table_has_the_terminals_columns_and_rows(tmp_path):
    """The Memory page's per-unit table showed one activations column (nested units' included) where the terminal
    shows two (the unit's own, and with its nested units'): one row builder now feeds both, on the peak rank."""
    from fsdp_doctor import build_report, load_run
    from fsdp_doctor.present.fmt import memory_unit_rows

    run = write_run(tmp_path / "run", "ffffffffffff", 12, 1)
    rank, rows = memory_unit_rows(build_report(load_run(run)).memory)
    app = create_app(run, state=RunState(run, background_traces=False))
    out = json.dumps(_page_post(app.server.test_client(), "/memory", f"?rank={rank}").get_json())
    assert "activations saved (own)" in out and "activations saved (incl. nested)" in out
    for row in rows:
        own, nested = (json.dumps(c)[1:-1] for c in row[3:])
        assert f'"act_own": "{own}", "activations": "{nested}"' in out, (row, out[:3000])


def test_the_overview_names_what_analyze_names_once_the_run_stopped(tmp_path):
    """A run with rank 1's records file emptied, and another with its last record cut mid-line: analyze names both,
    the dashboard's Overview named neither (a new-user trial). Once the run is not live, the Problems section has
    the same lines as analyze's; while it is live (a stream being written), not."""
    import os
    import time as _time

    from fsdp_doctor import load_run
    from fsdp_doctor.dashboards.pages import overview
    from fsdp_doctor.dashboards.pages.common import Filters

    then = _time.time() - 600
    cases = {"empty": lambda f: f.write_bytes(b""), "cut": lambda f: f.write_bytes(f.read_bytes()[:-40])}
    for name, damage in cases.items():
        run = write_run(tmp_path / name, "ffffffffffff", 10, 1)
        damage(run / "rank1.records.jsonl")
        for f in run.glob("rank*.records.jsonl"):
            os.utime(f, (then, then))
        said = [p.removesuffix("; skipped")  # (under the "Problems" heading: the word not said again)
                for p in load_run(run).problems if "rank1.records.jsonl" in p]
        assert said, name
        snap = RunState(run, background_traces=False).snapshot()
        text = json.dumps([c.to_plotly_json() for c in overview.layout(snap, Filters())], default=str)
        assert all(p in text for p in said), (name, said, text[-2000:])
        assert snap.problems(live=True) == list(snap.report.problems)
