"""The dashboard without a browser: pure figure builders, the server-side run follower, page layouts (including
the documented memory section), the app's HTTP surface and ``serve()``'s messages."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgspec
import plotly.graph_objects as go
import pytest

from fsdp_doctor import memory_categories as MC

from fsdp_doctor.present import figures as F
from fsdp_doctor.dashboards.pages import PAGES
from fsdp_doctor.dashboards.pages.common import ALL, ROOT, Filters, fmt_value
from fsdp_doctor.dashboards.state import RunState
from fsdp_doctor.pipeline import steps_columns
from fsdp_doctor.report_sections import (Finding, MemoryRank, MemorySection, OverlapSection, Recommendation, StepsSection, Verdict, VerdictEntry)
from fsdp_doctor.store import load_run

SAMPLE = Path(__file__).resolve().parents[1] / "traces" / "sample"
CATS = ("sharded_params", "unsharded_params", "sharded_grads", "unsharded_grads", "optimizer_state", "activations",
        "comm_buffers", "temporaries", "offloaded_host")


@pytest.fixture(scope="module")
def sample_run():
    return load_run(SAMPLE)


@pytest.fixture(scope="module")
def steps(sample_run):
    return steps_columns(sample_run)


@pytest.fixture(scope="module")
def snap():
    st = RunState(SAMPLE, background_traces=False)
    st.refresh()
    return st.snapshot()


def _is_note(fig: go.Figure) -> bool:
    return not fig.data and bool(fig.layout.annotations)


def memory_section(ranks=(0, 1), steps=(3, 4), **rank_fields) -> MemorySection:
    """A memory section of the documented shape (built by hand: the analysis is another module's);
    ``rank_fields`` are set on every rank."""
    per_rank = {}
    units = ["", "layers.0", "layers.1"]
    for r in ranks:
        timeline = []
        for s in steps:
            for i, (u, ph) in enumerate([(x, "forward") for x in units] + [(x, "backward") for x in units[::-1]]):
                row = {"step": s, "unit": u, "phase": ph}
                for j, c in enumerate(CATS):
                    row[c] = (j + 1) * (1 << 20) + i * (1 << 18) * (c == "activations")
                timeline.append(row)
        peak = max(timeline, key=lambda x: sum(x[c] for c in CATS))
        per_rank[str(r)] = {
            "peak_bytes": sum(peak[c] for c in CATS) + r, "peak_at": {"step": peak["step"], "unit": peak["unit"], "phase": peak["phase"]},
            "peak_breakdown": {c: peak[c] for c in CATS}, "activations_peak_bytes": peak["activations"],
            "capacity_bytes": 64 << 20, "timeline": timeline,
            "per_unit": [{"unit": u, "sharded_bytes": 1 << 20, "unsharded_bytes": 2 << 20, "activation_bytes": 3 << 20}
                         for u in units], **rank_fields,
        }
    return msgspec.convert({"per_rank": per_rank}, MemorySection)


# ---------------------------------------------------------------- step figures

def test_step_time_figure_per_rank_and_filters(steps):
    fig = F.step_time_figure(steps)
    assert [t.name for t in fig.data] == ["rank 0", "rank 1"]
    assert list(fig.data[0].x) == steps[0]["step"] and list(fig.data[0].y) == steps[0]["wall_ms"]
    # profiled steps are hollow markers
    sym = list(fig.data[0].marker.symbol)
    assert [s for s, p in zip(steps[0]["step"], steps[0]["profiled"]) if p] == \
        [s for s, m in zip(steps[0]["step"], sym) if m == "circle-open"]
    one = F.step_time_figure(steps, ranks=[1], window=(5, 9))
    assert [t.name for t in one.data] == ["rank 1"] and list(one.data[0].x) == [5, 6, 7, 8, 9]
    assert _is_note(F.step_time_figure({}, None, None))
    assert _is_note(F.step_time_figure(steps, ranks=[7]))


def test_heatmap_jitter_and_phases(steps):
    hm = F.step_heatmap(steps)
    assert len(hm.data[0].z) == 2 and len(hm.data[0].z[0]) == len(steps[0]["step"])
    assert hm.data[0].z[1][3] == steps[1]["wall_ms"][3]
    steady = [w for s, w, p in zip(steps[0]["step"], steps[0]["wall_ms"], steps[0]["profiled"]) if s > 0 and not p]
    assert hm.data[0].zmax == max(steady + [w for s, w, p in zip(steps[1]["step"], steps[1]["wall_ms"], steps[1]["profiled"])
                                            if s > 0 and not p])
    jit = F.jitter_histogram(steps, ranks=[0])
    assert len(jit.data) == 1 and len(jit.data[0].x) == len(steady)
    assert sorted(jit.data[0].x)[len(steady) // 2] == pytest.approx(0.0, abs=1e-9) or len(steady) % 2 == 0
    ph = F.phase_split_figure(steps, 0, window=(2, 4))
    assert [t.name for t in ph.data] == ["forward", "backward", "optimizer", "outside"]
    assert list(ph.data[1].y) == steps[0]["backward_ms"][2:5]
    assert _is_note(F.phase_split_figure(steps, 5))
    assert _is_note(F.jitter_histogram(steps, window=(0, 1)))


def test_a_long_run_is_drawn_in_groups_that_keep_its_spikes(steps):
    """A run followed for 5,000 steps drew every step: 873 KiB of figures per Steps page (a new-user trial), ~17 MB
    at 100,000 steps, sent again on each refresh. The sample run's real step columns repeated to 5,000 steps (one
    step made 100x slower on rank 1) are drawn at most STEP_POINTS positions wide, and nothing is lost on the way:
    the slowest and fastest steps stay, each phase's total is kept, every steady step is counted in the jitter."""
    reps = 5000 // len(steps[0]["step"]) + 1
    long = {}
    for r, cols in steps.items():
        n = len(cols["step"])
        long[r] = {key: [v for _ in range(reps) for v in vals] for key, vals in cols.items()}
        long[r]["step"] = [j * n + s for j in range(reps) for s in cols["step"]]
        long[r]["steady"] = [j > 0 or _steady for j in range(reps) for _steady in cols["steady"]]
        long[r]["profiled"] = [j == 0 and p for j in range(reps) for p in cols["profiled"]]  # one window
    spike = len(long[1]["step"]) // 2
    long[1]["wall_ms"] = list(long[1]["wall_ms"])
    long[1]["wall_ms"][spike] *= 100
    total = len(long[0]["step"])
    assert total > 5 * F.STEP_POINTS
    st = F.step_time_figure(long)
    k = -(-total // F.STEP_POINTS)
    assert f"{k} steps per point" in st.layout.title.text
    for t, r in zip(st.data, (0, 1)):
        assert len(t.x) <= 2 * (F.STEP_POINTS + 1) + sum(long[r]["profiled"])
        assert max(t.y) == max(long[r]["wall_ms"]) and min(t.y) == min(long[r]["wall_ms"])
    hm = F.step_heatmap(long)
    assert len(hm.data[0].x) <= F.STEP_POINTS + 1
    assert long[1]["wall_ms"][spike] in hm.data[0].z[1]  # the spike's group shows it
    ph = F.phase_split_figure(long, 0)
    assert len(ph.data[0].x) <= F.STEP_POINTS + 1
    width = {x: len([s for s in long[0]["step"] if s // k * k == x // k * k]) for x in ph.data[0].x}
    assert sum(m * width[x] for x, m in zip(ph.data[0].x, ph.data[0].y)) == pytest.approx(sum(long[0]["forward_ms"]))
    jit = F.jitter_histogram(long)
    assert [sum(t.y) for t in jit.data] == [sum(long[r]["steady"]) for r in (0, 1)]
    size = sum(len(f.to_json()) for f in (st, hm, ph, jit))
    assert size < 600 << 10, size  # (2.3 MiB before)


# ---------------------------------------------------------------- memory figures

def test_memory_timeline_stacks_categories_with_unit_and_phase():
    m = memory_section().per_rank["0"]
    fig = F.memory_timeline_figure(m, rank=0)
    # named by the categories' labels, as the terminal and the HTML tables name them
    assert [t.name for t in fig.data] == [MC.label(c) for c in CATS] and fig.data[0].name == "sharded params"
    assert all(t.stackgroup == "mem" for t in fig.data)
    assert len(fig.data[0].x) == len(m.timeline)
    act = fig.data[CATS.index("activations")]
    assert act.y[2] == pytest.approx(m.timeline[2]["activations"] / F.MIB)
    assert act.customdata[1][1] == "layers.0" and act.customdata[1][2] == "forward"
    assert act.customdata[0][1] == "(root)"
    assert any(s.type == "line" for s in fig.layout.shapes)  # capacity line
    assert list(fig.layout.xaxis.ticktext) == ["step 3", "step 4"]
    # step window
    only4 = F.memory_timeline_figure(m, window=(4, 4))
    assert len(only4.data[0].x) == len(m.timeline) // 2


def test_memory_timeline_accepts_a_columns_rows_table_and_nested_categories():
    # the recorder's columns/rows table, as a timeline may hold it (built directly: the struct does not convert it)
    m = MemoryRank(timeline={"columns": ["t_ms", "unit", "phase", "activations", "sharded_params"],
                             "rows": [[0.1, "a", "forward", 1 << 20, 2 << 20], [0.2, "b", "backward", 3 << 20, 2 << 20]]})
    fig = F.memory_timeline_figure(m)
    assert [t.name for t in fig.data] == ["sharded params", "activations"]
    nested = MemoryRank(timeline=[{"unit": "a", "phase": "forward", "bytes": {"activations": 5 << 20}}])
    assert list(F.memory_timeline_figure(nested).data[0].y) == [5.0]


def test_memory_breakdown_and_absent_section():
    m = memory_section().per_rank["1"]
    fig = F.memory_breakdown_figure(m, rank=1)
    bars = dict(zip(fig.data[0].y, fig.data[0].x))
    assert set(bars) == {MC.label(c) for c in CATS}
    assert bars["optimizer state"] == pytest.approx(m.peak_breakdown["optimizer_state"] / F.MIB)
    assert "step 4" in fig.layout.xaxis.title.text or "step 3" in fig.layout.xaxis.title.text
    assert _is_note(F.memory_breakdown_figure(None))
    assert _is_note(F.memory_timeline_figure(MemoryRank()))


def test_memory_category_not_measured_is_unknown_not_a_measured_zero(snap):
    """A category this torch could not measure (``MemoryRank.unknown_categories``) reads 0 in the figures: the
    dashboard says "unknown", as the terminal does, and never draws that 0 as a measurement; a measured 0 stays
    an empty bar."""
    import dataclasses

    mem = memory_section(unknown_categories=["comm_buffers"])
    for m in mem.per_rank.values():  # what the probe writes for a category it cannot read: 0 everywhere
        m.peak_breakdown["comm_buffers"] = 0
        m.peak_breakdown["offloaded_host"] = 0  # measured: nothing offloaded
        for row in m.timeline:
            row["comm_buffers"] = 0
    m = mem.per_rank["0"]
    bd = F.memory_breakdown_figure(m, rank=0)
    text = dict(zip(bd.data[0].y, bd.data[0].text))
    hover = dict(zip(bd.data[0].y, bd.data[0].hovertemplate))
    comm, host = MC.label("comm_buffers"), MC.label("offloaded_host")
    assert text[comm] == "unknown" and "unknown (not measurable" in hover[comm]
    assert text[host] == "" and "%{x:.1f} MiB" in hover[host]  # a measured 0 is not unknown
    assert text["optimizer state"] == "5.00 MiB"
    m.peak_breakdown["comm_buffers"] = 1 << 20  # whatever the record holds, an unknown category claims no bytes
    assert dict(zip(*(F.memory_breakdown_figure(m).data[0][k] for k in ("y", "x"))))[comm] == 0
    tl = F.memory_timeline_figure(m, categories=CATS)
    assert comm not in [t.name for t in tl.data] and "activations" in [t.name for t in tl.data]
    # even where every category reads 0 (the figure then stacks them all), the unknown one is not stacked
    zeros = MemoryRank(timeline=[{"step": 3, "unit": "", "phase": "forward", **{c: 0 for c in CATS}}],
                       unknown_categories=["comm_buffers"])
    assert [t.name for t in F.memory_timeline_figure(zeros).data] == [MC.label(c) for c in CATS if c != "comm_buffers"]
    # the page names it once, above the figures
    s2 = dataclasses.replace(snap, report=msgspec.structs.replace(snap.report, memory=mem))
    page = PAGES["memory"][1].layout(s2, Filters())
    notes = [c for c in _walk(page) if getattr(c, "id", None) == "mem-unknown-note"]
    assert len(notes) == 1 and "comm buffers" in notes[0].children and "unknown" in notes[0].children
    measured = dataclasses.replace(snap, report=msgspec.structs.replace(snap.report, memory=memory_section()))
    assert "mem-unknown-note" not in _ids(PAGES["memory"][1].layout(measured, Filters()))


# ---------------------------------------------------------------- communication figures

def test_comm_timeline_from_a_real_trace(snap):
    assert len(snap.windows) == 2
    data = [F.window_timeline_data(w) for w in snap.windows]
    assert data[0]["rank"] == 0 and data[0]["calls"]
    s, e = data[0]["compute"]
    assert len(s) == len(e) > 0 and all(b >= a for a, b in zip(s, e))
    fig = F.comm_timeline_figure(data)
    lanes = {y for t in fig.data for y in t.y}
    assert {"rank 0 compute", "rank 0 all_gather", "rank 0 reduce_scatter", "rank 1 compute"} <= lanes
    n_calls = sum(len(d["calls"]) for d in data)
    assert sum(len(t.x) for t in fig.data if t.name != "compute") == n_calls
    # a selected unit greys the others out
    hi = F.comm_timeline_figure(data, unit="layers.1")
    mine = [t for t in hi.data if t.name == "all_gather (layers.1)"]
    others = [t for t in hi.data if t.name == "all_gather (other units)"]
    assert mine and others and mine[0].marker.color == F.COLLECTIVE_COLORS["all_gather"]
    assert others[0].marker.color == "#D8D8D8"  # the legend shows both, each in its own colour
    assert all(c[0] == "layers.1" for t in mine for c in t.customdata)
    assert sum(len(t.x) for t in hi.data if t.name != "compute") == n_calls
    # merging keeps the figure light on long windows
    merged = F.window_timeline_data(snap.windows[0], max_intervals=50)
    assert len(merged["compute"][0]) <= 60
    assert _is_note(F.comm_timeline_figure([]))


def test_unit_exposure_and_slack(snap):
    per_unit = snap.report.overlap.per_unit
    fig = F.unit_exposure_figure(per_unit)
    exp, ovl = fig.data
    total_exposed = sum(r.exposed_us for r in per_unit) / 1e3
    assert sum(exp.x) == pytest.approx(total_exposed)
    assert sum(exp.x) + sum(ovl.x) == pytest.approx(sum(r.comm_us for r in per_unit) / 1e3)
    r1 = F.unit_exposure_figure(per_unit, ranks=[1], unit="layers.2")
    assert all(lbl.startswith("layers.2") for lbl in r1.data[0].y)
    slack = F.prefetch_slack_figure(per_unit, ranks=[0])
    ag = [r for r in per_unit if r.rank == 0 and r.collective == "all_gather" and r.slack_us is not None]
    assert sum(len(t.x) for t in slack.data) == len(ag)
    assert sorted(x for t in slack.data for x in t.x) == pytest.approx(sorted(r.slack_us / 1e3 for r in ag))
    assert _is_note(F.prefetch_slack_figure([], None))
    ov = F.overlap_by_rank_figure(snap.report.overlap.per_rank)
    assert len(ov.data[0].y) == 2


def test_unit_timing(snap):
    units = snap.report.units
    fig = F.unit_timing_figure(units)
    fwd = next(t for t in fig.data if t.name == "forward")
    assert "(root)" in fwd.y and len(fwd.x) == len(units)
    sel = F.unit_timing_figure(units, unit="layers.0")
    ops = sel.data[0].marker.opacity
    assert sorted(set(ops)) == [0.3, 1.0]


def test_value_formatting():
    assert fmt_value("peak_bytes", 3 << 30) == "3.00 GiB"
    assert fmt_value("gc_ms_per_step", 12.0) == "12.0 ms"
    assert fmt_value("exposed_us", 2500.0) == "2.50 ms"
    assert fmt_value("share_pct", 8.123) == "8.1%"
    assert fmt_value("units", ["", "layers.0"]) == "(root), layers.0"
    assert Filters.from_controls(ALL, [0, 5], ROOT) == Filters(rank=None, window=(0, 5), unit="")
    assert Filters.from_controls("1", None, ALL) == Filters(rank=1, window=None, unit=None)


# ---------------------------------------------------------------- state: incremental following

def test_run_state_follows_a_growing_run_incrementally(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    src = SAMPLE / "rank0.records.jsonl"
    lines = src.read_bytes().splitlines(keepends=True)
    cut = 8
    (run / src.name).write_bytes(b"".join(lines[:cut]) + lines[cut][:40])  # a line cut mid-write
    st = RunState(run, background_traces=False)
    assert st.refresh() is True
    snap1 = st.snapshot()
    n1 = len(snap1.steps[0]["step"])
    assert n1 == sum(1 for ln in lines[:cut] if ln.startswith(b'{"t":"step"'))
    off1 = st._follower._streams[0].offset
    assert off1 == len(b"".join(lines[:cut]))  # the partial line is left for later
    assert st.refresh() is False and st.snapshot().version == snap1.version  # nothing new: no rebuild
    with open(run / src.name, "ab") as f:
        f.write(lines[cut][40:] + b"".join(lines[cut + 1:]))
    assert st.refresh() is True
    snap2 = st.snapshot()
    assert snap2.version == snap1.version + 1
    assert len(snap2.steps[0]["step"]) == sum(1 for ln in lines if ln.startswith(b'{"t":"step"'))
    assert snap2.report.steps.per_rank["0"].count > snap1.report.steps.per_rank["0"].count
    assert st._follower._streams[0].offset == src.stat().st_size


def test_the_poll_rebuilds_a_long_runs_report_a_share_of_the_time(tmp_path, monkeypatch):
    """A new-user trial's dashboard, following a run at 15,000 steps, answered its one-second poll in 5-9 s: every poll
    with new records rebuilt the whole report (~2 s of CPU there). The poll's refresh (throttle=True) rebuilds at
    most REBUILD_SHARE of the time: records that arrive sooner wait, read, and come with the next rebuild; a page's
    own refresh and a new problem are not held back."""
    import fsdp_doctor.dashboards.state as S

    run = tmp_path / "run"
    run.mkdir()
    src = SAMPLE / "rank0.records.jsonl"
    lines = src.read_bytes().splitlines(keepends=True)
    (run / src.name).write_bytes(b"".join(lines[:8]))
    steps = lambda upto: sum(1 for ln in lines[:upto] if ln.startswith(b'{"t":"step"'))  # noqa: E731
    clock = [1000.0]
    monkeypatch.setattr(S.time, "monotonic", lambda: clock[0])
    st = RunState(run, background_traces=False)
    assert st.refresh(throttle=True) is True  # the first read: at once
    v = st.snapshot().version
    with open(run / src.name, "ab") as f:
        f.write(b"".join(lines[8:12]))
    # the rebuild took no time on this clock: the next may come at once; 0.5 s ones wait 2 s (share 0.2)
    st._next_rebuild = clock[0] + 2.0
    clock[0] += 1.0
    assert st.refresh(throttle=True) is False and st.snapshot().version == v  # read, held back
    assert st._follower._streams[0].offset == len(b"".join(lines[:12]))
    clock[0] += 1.5
    assert st.refresh(throttle=True) is True  # nothing newer was read, but what waited is rebuilt now
    assert len(st.snapshot().steps[0]["step"]) == steps(12)
    # a page's refresh does not wait
    st._next_rebuild = clock[0] + 100.0
    with open(run / src.name, "ab") as f:
        f.write(b"".join(lines[12:16]))
    assert st.refresh() is True and len(st.snapshot().steps[0]["step"]) == steps(16)
    # the wait follows the rebuild's own time: 0.5 s of rebuilding holds the next for 2 s
    real = st._rebuild
    monkeypatch.setattr(st, "_rebuild", lambda r: (real(r), clock.__setitem__(0, clock[0] + 0.5)))
    with open(run / src.name, "ab") as f:
        f.write(b"".join(lines[16:20]))
    st._next_rebuild = 0.0
    assert st.refresh(throttle=True) is True
    assert st._next_rebuild == pytest.approx(clock[0] + 2.0)


def test_run_state_caches_trace_analysis_per_file(tmp_path, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(SAMPLE, run)
    import fsdp_doctor.trace as A

    calls = []
    real = A.load_window
    monkeypatch.setattr(A, "load_window", lambda p: calls.append(p) or real(p))
    st = RunState(run, background_traces=True)
    st.refresh()
    st.wait_traces(60)
    snap = st.snapshot()
    assert len(calls) == 2 and len(snap.windows) == 2
    assert snap.report.overlap.per_rank.keys() == {"0", "1"}
    assert snap.report.run.trace_files == 2
    with open(run / "rank0.records.jsonl", "ab") as f:  # one more step: report rebuilt, traces not re-read
        last = [ln for ln in (SAMPLE / "rank0.records.jsonl").read_bytes().splitlines() if ln.startswith(b'{"t":"step"')][-1]
        f.write(last.replace(b'"step":29', b'"step":30') + b"\n")
    assert st.refresh() is True
    assert len(calls) == 2
    assert st.snapshot().report.overlap == snap.report.overlap


# ---------------------------------------------------------------- pages

def _ids(component) -> set:
    out = set()

    def walk(c):
        if isinstance(c, (list, tuple)):
            for x in c:
                walk(x)
            return
        if hasattr(c, "to_plotly_json"):
            cid = getattr(c, "id", None)
            if cid:
                out.add(cid)
            walk(getattr(c, "children", None))

    walk(component)
    return out


@pytest.mark.parametrize("flt", [Filters(), Filters(rank=1, window=(3, 20), unit="layers.1"), Filters(unit="")])
def test_every_page_lays_out_the_sample(snap, flt):
    ids = {key: _ids(mod.layout(snap, flt)) for key, (_, mod) in PAGES.items()}
    assert {"kpi-p50", "findings", "run-facts"} <= ids["overview"]
    assert ("fig-mem-timeline" if snap.report.memory else "memory-absent") in ids["memory"]
    assert {"fig-comm-timeline", "fig-unit-exposure", "fig-prefetch-slack"} <= ids["communication"]
    outliers = [o for o in snap.report.steps.outliers if flt.rank in (None, o.rank)]
    assert {"fig-step-time", "fig-step-heatmap", "fig-jitter", "fig-phases", "tbl-outliers" if outliers else "sec-outliers"} <= ids["steps"]
    assert {"tbl-units", "fig-unit-timing"} <= ids["units"]


def test_memory_page_with_the_documented_section(snap):
    import dataclasses

    report = msgspec.structs.replace(snap.report, memory=memory_section())
    s2 = dataclasses.replace(snap, report=report)
    ids = _ids(PAGES["memory"][1].layout(s2, Filters()))
    assert {"fig-mem-timeline", "fig-mem-breakdown", "tbl-mem-units", "kpi-mem-peak", "fig-mem-steps"} <= ids
    page = PAGES["memory"][1].layout(s2, Filters(rank=0, unit="layers.0"))
    table = next(c for c in _walk(page) if getattr(c, "id", None) == "tbl-mem-units")
    assert [r["unit"] for r in table.rowData] == ["layers.0"]
    assert "kpi-peak" in _ids(PAGES["overview"][1].layout(s2, Filters()))


def test_memory_per_step_draws_each_peak_and_the_allocation_left_at_each_end(steps):
    """Each step's peak per rank (the sample: CPU, no allocator figures) and, on CUDA (the H100 fixture), what stays
    allocated at each step's end, flat at 956.1 MiB there: a loop keeping something from every step shows as a
    dotted line rising (memory.growing). A window keeps its steps; a plain trace's steps carry none."""
    run = load_run(SAMPLE)
    fig = F.memory_per_step_figure(steps)
    assert [t.name for t in fig.data] == ["rank 0 peak", "rank 1 peak"]
    peaks = {s.step: s.memory.peak.bytes / (1 << 20) for s in run.ranks[0].steps if s.memory and s.memory.peak}
    assert dict(zip(fig.data[0].x, fig.data[0].y)) == pytest.approx(peaks)
    fig = F.memory_per_step_figure(steps, ranks=[1], window=(3, 5))
    assert [t.name for t in fig.data] == ["rank 1 peak"] and list(fig.data[0].x) == [3, 4, 5]
    gpu = Path(__file__).resolve().parents[1] / "traces" / "gpu" / "fixture"
    if (gpu / "manifest.json").exists():
        fig = F.memory_per_step_figure(steps_columns(load_run(gpu)))
        ends = [t for t in fig.data if t.name.endswith("allocated at the end")]
        assert len(ends) == 2 and all(t.line.dash == "dot" and len(t.x) == 10 for t in ends), fig.data
        assert all(round(y, 1) == 956.1 for t in ends for y in t.y)
    # (a plain trace's steps: no memory columns)
    assert _is_note(F.memory_per_step_figure({0: {k: v[:3] for k, v in steps[0].items()
                                                  if k in ("step", "wall_ms")}}))


def _walk(c):
    if isinstance(c, (list, tuple)):
        for x in c:
            yield from _walk(x)
    elif hasattr(c, "to_plotly_json"):
        yield c
        yield from _walk(getattr(c, "children", None))


def test_findings_are_cards_with_evidence_and_a_copyable_fix(snap):
    import dataclasses

    finding = {"code": "x.test", "severity": "critical", "title": "Something is wrong",
               "evidence": {"exposed_ms": 12.5, "peak_bytes": 1 << 30}, "ranks": [1], "units": ["layers.0"],
               "recommendation": {"text": "Do this.", "code": "model.fix()"},
               "predicted": {"step_ms_before": 100.0, "step_ms_after": 80.0, "peak_bytes_before": None, "peak_bytes_after": None}}
    findings = msgspec.convert([{**finding, "severity": "info", "code": "y"}, finding], list[Finding])
    s2 = dataclasses.replace(snap, report=msgspec.structs.replace(snap.report, findings=findings))
    page = PAGES["overview"][1].layout(s2, Filters())
    comps = list(_walk(page))
    cards = [c for c in comps if "finding-" in (getattr(c, "className", "") or "") and getattr(c, "id", "").startswith("finding-")]
    assert cards[0].className.endswith("critical")  # by severity
    text = json.dumps([c.to_plotly_json() for c in cards], default=str)
    assert "12.5 ms" in text and "1.00 GiB" in text and "model.fix()" in text and "20% faster" in text
    clip = [c for c in comps if type(c).__name__ == "Clipboard"]
    assert clip and clip[0].target_id == "fix-code-0"
    # filtered out for another rank / unit
    page0 = PAGES["overview"][1].layout(s2, Filters(rank=0))
    assert "Something is wrong" not in json.dumps([c.to_plotly_json() for c in _walk(page0)], default=str)


# ---------------------------------------------------------------- app and serve()

@pytest.fixture
def client():
    from fsdp_doctor.dashboards.app import create_app

    app = create_app(SAMPLE)
    return app, app.server.test_client()


def test_app_serves_layout_and_callbacks_but_no_run_files(client):
    app, c = client
    assert c.get("/").status_code == 200
    layout = c.get("/_dash-layout").get_json()
    assert "fsdp-doctor" in json.dumps(layout)
    deps = c.get("/_dash-dependencies").get_json()
    page_cb = next(d for d in deps if d["output"] == "page.children")
    body = {"output": "page.children", "outputs": {"id": "page", "property": "children"},
            "inputs": [{"id": "url", "property": "pathname", "value": "/steps"},
                       {"id": "url", "property": "search", "value": "?rank=1&steps=5-9"},
                       {"id": "version", "property": "data", "value": 1}],
            "changedPropIds": ["url.pathname"], "state": []}
    r = c.post("/_dash-update-component", json=body)
    assert r.status_code == 200, r.data[:500]
    page = r.get_data(as_text=True)
    assert "fig-step-time" in page and "rank 1" in page and "rank 0" not in page  # the URL's filters applied
    assert page_cb
    # every page has its own URL (an unknown path is the overview)
    for path, marker in (("/memory", "fig-mem-timeline"), ("/communication", "comm"), ("/units", "tbl-units"),
                         ("/nonsense", "kpi-p50"), ("/", "kpi-p50")):
        body["inputs"][0]["value"] = path
        body["inputs"][1]["value"] = ""
        r = c.post("/_dash-update-component", json=body)
        assert r.status_code == 200 and marker in r.get_data(as_text=True), path
    # nothing of the run directory is served: Dash answers unknown paths with its index page
    records = (SAMPLE / "rank0.records.jsonl").read_text()[:60]
    for p in ("/rank0.records.jsonl", "/manifest.json", "/assets/../rank0.records.jsonl", "/profiler/rank0.6.pt.trace.json.gz",
              "/assets/../../traces/sample/rank0.records.jsonl"):
        resp = c.get(p)
        assert records not in resp.get_data(as_text=True)
        assert resp.status_code in (200, 404) and resp.mimetype != "application/gzip"


def test_serve_messages_and_safe_defaults(tmp_path, capsys, monkeypatch):
    from dash import Dash

    from fsdp_doctor.dashboards.app import serve

    assert serve(tmp_path / "missing" / "run") == 2
    assert "no such run directory (nor its parent" in capsys.readouterr().err
    f = tmp_path / "file.json"
    f.write_text("{}")
    assert serve(f) == 2
    assert "not a directory" in capsys.readouterr().err
    seen = {}
    monkeypatch.setattr(Dash, "run", lambda self, **kw: seen.update(kw))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert serve(empty) == 0
    out = capsys.readouterr()
    assert "no fsdp-doctor records" in out.err
    # plain profiler traces: the pages show them, no wait for records that never come (a new-user trial)
    import shutil

    shutil.copytree(SAMPLE / "profiler", tmp_path / "plain")
    assert serve(tmp_path / "plain") == 0
    assert "2 profiler trace file(s), no fsdp-doctor records: the pages show the traces" in capsys.readouterr().err
    # a manifest the store refuses (a format version it does not read, another tool's format): the line analyze exits
    # on, exit 2 (a new-user trial's dashboard showed the traces and a verdict where analyze refused the run)
    from fsdp_doctor.cli import main

    for name, edit in (("v7", {"version": 7}), ("other", {"format": "other-tool"})):
        run = shutil.copytree(SAMPLE, tmp_path / name, ignore=shutil.ignore_patterns("tb", "report.json"))
        (run / "manifest.json").write_text(json.dumps({**json.loads((run / "manifest.json").read_text()), **edit}))
        assert main(["analyze", str(run)]) == 2
        refused = capsys.readouterr().err
        assert serve(run) == 2
        assert capsys.readouterr().err == refused and refused.count("\n") == 1, refused
        assert ("format version 7 is not one this fsdp-doctor reads" if name == "v7" else "'other-tool'") in refused
    # started before the run creates its directory (a new-user trial: it refused): it waits for it
    assert serve(tmp_path / "not_yet") == 0
    assert "does not exist yet" in capsys.readouterr().err
    assert "http://127.0.0.1:8050/" in out.out
    assert seen["host"] == "127.0.0.1" and seen["debug"] is False
    assert serve(SAMPLE, host="0.0.0.0", port=9999) == 0
    out = capsys.readouterr()
    assert "http://127.0.0.1:9999/" in out.out and "anyone who can reach" in out.err
    assert seen["host"] == "0.0.0.0" and seen["port"] == 9999


def test_cli_dashboard_command_uses_serve(monkeypatch, tmp_path, capsys):
    import fsdp_doctor.dashboards.app as appmod
    from fsdp_doctor.cli import main

    seen = {}
    monkeypatch.setattr(appmod, "serve", lambda path, host, port: seen.update(path=path, host=host, port=port) or 0)
    assert main(["dashboard", str(SAMPLE)]) == 0
    assert seen == {"path": SAMPLE, "host": "127.0.0.1", "port": 8050}
    assert main(["dashboard", str(tmp_path / "nope" / "run")]) == 2  # (a missing folder whose parent exists is waited for)


def test_step_window_recomputes_sections_with_the_same_analyses(snap):
    from fsdp_doctor.analyze.steps import analyze_steps
    from fsdp_doctor.store.reader import RankData, Run

    run = load_run(SAMPLE)
    sub = Run(path=run.path, ranks={r: RankData(rank=r, config=rd.config, steps=[s for s in rd.steps if 10 <= s.step <= 20])
                                     for r, rd in run.ranks.items()})
    got = snap.sections((10, 20))
    assert got.steps.per_rank == StepsSection.of(analyze_steps(sub)).per_rank
    assert got.steps.per_rank["0"].count == 11
    assert snap.sections(None).steps is snap.report.steps
    page = PAGES["overview"][1].layout(snap, Filters(window=(10, 20)))
    kp = next(c for c in _walk(page) if getattr(c, "id", None) == "kpi-p50")
    from fsdp_doctor.present.fmt import fmt_ms

    assert fmt_ms(got.steps.job.p50_ms) in json.dumps(kp.to_plotly_json(), default=str)


def test_every_package_is_installed_and_dashboard_under_fsdp_doctor():
    """pyproject lists packages explicitly (the dashboard folder installs as fsdp_doctor.dashboards through the link fsdp_doctor/dashboards): every package
    folder must be listed, and the dashboard package is the dashboards/ folder under the fsdp_doctor name."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    import fsdp_doctor.dashboards as dash_pkg

    root = Path(__file__).resolve().parents[1]
    cfg = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    on_disk = {".".join(p.parent.relative_to(root).parts) for p in (root / "fsdp_doctor").rglob("__init__.py")
               if "dashboards" not in p.parts}
    on_disk |= {"fsdp_doctor." + ".".join(p.parent.relative_to(root).parts) for p in (root / "dashboards").rglob("__init__.py")}
    assert on_disk == listed
    assert "package-dir" not in cfg and (root / "fsdp_doctor" / "dashboards").resolve() == root / "dashboards"
    assert Path(dash_pkg.__file__).resolve().parent == root / "dashboards"


# ---------------------------------------------------------------- issue 13: filters, URLs, honest figures

def test_profiler_steps_are_drawn_apart_from_stalls(steps):
    cols = steps[0]
    prof = [s for s, p in zip(cols["step"], cols["profiled"]) if p]
    assert 8 in prof  # the sample's step 8 exports the profiler window (625 ms outside the model)
    ph = F.phase_split_figure(steps, 0)
    names = [t.name for t in ph.data]
    assert names == ["forward", "backward", "optimizer", "outside", F.PROFILER_OUTSIDE]
    outside = dict(zip(ph.data[3].x, ph.data[3].y))
    assert all(outside[s] is None for s in prof)  # not drawn as time outside the model (a loader stall) ...
    tool = dict(zip(ph.data[4].x, ph.data[4].y))
    assert sorted(tool) == prof and tool[8] == cols["outside_ms"][cols["step"].index(8)] > 600  # ... but as the tool's
    assert ph.data[4].marker.pattern.shape == "/"
    st = F.step_time_figure(steps)
    bands = [(s.x0, s.x1) for s in st.layout.shapes]
    assert any(a < 8 < b for a, b in bands) and not any(a < 12 < b for a, b in bands)
    from fsdp_doctor.units import runs

    assert runs([1, 5, 6, 7, 8]) == [(1, 1), (5, 8)]
    # the outlier analysis does not count the profiler step as a stall
    from fsdp_doctor.analyze.steps import find_outliers

    assert all(o["step"] not in prof for o in find_outliers(load_run(SAMPLE)))
    # one step window without profiled steps: no hatched trace
    assert [t.name for t in F.phase_split_figure(steps, 0, window=(10, 20)).data] == ["forward", "backward", "optimizer", "outside"]


def test_query_string_round_trip_and_bad_input():
    from fsdp_doctor.dashboards.pages.common import Query

    q = Query.parse("?rank=1&steps=5-20&unit=tok_emb,+pos_emb")
    assert q == Query(rank=1, lo=5, hi=20, unit="tok_emb, pos_emb")
    assert Query.parse(q.search()) == q
    assert Query.parse("?unit=(root)").unit == "" and Query(unit="").search() == "?unit=(root)"
    assert Query.parse("?steps=7-").filters(0, 29) == Filters(window=(7, 29))
    assert Query.parse("?steps=0-").filters(0, 29) == Filters()  # every step: no window
    assert Query.parse("?steps=20-5").slider(0, 29) == [5, 20]
    assert Query.parse("?steps=40-50").slider(0, 29) == [29, 29]
    for bad in ("?rank=x&steps=a-b", "?rank=-3", "?steps=", "", None, "?unit=__all__"):
        assert Query.parse(bad) == Query()
    # from the controls: a window reaching the newest step stays open-ended (a live run keeps following)
    assert Query.from_controls("1", [3, 29], "layers.0", 0, 29).search() == "?rank=1&steps=3-&unit=layers.0"
    assert Query.from_controls(ALL, [0, 29], ALL, 0, 29).search() == ""
    assert Query.from_controls(ALL, [0, 12], ROOT, 0, 29).search() == "?steps=-12&unit=(root)"
    from fsdp_doctor.dashboards.pages import page_key

    assert [page_key(p) for p in ("/", "/memory", "/units/", "/nope", "")] == ["overview", "memory", "units", "overview",
                                                                                "overview"]


def test_unit_timing_title_names_the_selection(snap):
    units = snap.sections(None, 1).units
    assert "rank 1" in F.unit_timing_figure(units, who="rank 1").layout.title.text
    # rank 1's own medians, not all ranks'
    all_r = {u.name: u.timing_p50.fwd_ms for u in snap.report.units if u.timing_p50}
    r1 = {u.name: u.timing_p50.fwd_ms for u in units if u.timing_p50}
    assert r1.keys() == all_r.keys() and r1 != all_r
    page = PAGES["units"][1].layout(snap, Filters(rank=1, window=(3, 12)))
    fig = next(c for c in _walk(page) if getattr(c, "id", None) == "fig-unit-timing").figure
    assert "rank 1, steps 3–12" in fig.layout.title.text


def test_memory_and_communication_pages_follow_the_window(snap):
    page = PAGES["memory"][1].layout(snap, Filters(window=(10, 20)))
    txt = json.dumps([c.to_plotly_json() for c in _walk(page)], default=str, ensure_ascii=False)
    per_rank = snap.sections((10, 20)).memory.per_rank
    assert all(10 <= m.peak_at.step <= 20 for m in per_rank.values())
    assert "mem-step-note" in txt and "steps 10–20" in txt
    # a window holding a measured step draws that step, not the run's peak step 1
    page = PAGES["memory"][1].layout(snap, Filters(window=(2, 5)))
    txt = json.dumps([c.to_plotly_json() for c in _walk(page)], default=str, ensure_ascii=False)
    assert "Showing step 2, the peak step of steps 2–5" in txt
    fig = next(c for c in _walk(page) if getattr(c, "id", None) == "fig-mem-timeline").figure
    assert "step 2 " in fig.layout.title.text
    from fsdp_doctor.dashboards.pages.communication import pick_windows, shown_steps_note

    wins, inside = pick_windows(snap.windows, Filters(window=(10, 20)))
    assert wins and not inside
    assert "outside the selected steps 10–20" in shown_steps_note(wins, inside, Filters(window=(10, 20)))
    wins, inside = pick_windows(snap.windows, Filters(window=(5, 7)))
    assert inside and "inside steps 5–7" in shown_steps_note(wins, inside, Filters(window=(5, 7)))


def test_communication_tiles_are_one_definition(snap):
    """The "Host blocked in all-gather" tile summed the ranks' windows (37.5 ms of 2 ranks) beside tiles "per step,
    median over 2 ranks" (a new-user trial): it is the same median per step. The sample run: rank 0 blocked 7.26 ms
    over its 1-step window, rank 1 2.86 ms; median 5.06 ms (the sum read 10.1 ms)."""
    from fsdp_doctor.present.fmt import fmt_ms

    page = PAGES["communication"][1].layout(snap, Filters())
    tile = next(c for c in _walk(page) if getattr(c, "id", None) == "kpi-comm-blocked")
    txt = json.dumps(tile.to_plotly_json(), default=str, ensure_ascii=False)
    ov = snap.report.overlap
    per = sorted(ov.blocking[k].us / ov.per_rank[k].step_count for k in ov.per_rank)
    assert len(per) == 2 and per[0] != per[1]
    assert fmt_ms((per[0] + per[1]) / 2e3) in txt and fmt_ms(sum(per) / 1e3) not in txt


def _finding(severity: str, title: str) -> Finding:
    return Finding(code="x.test", severity=severity, title=title, evidence={}, recommendation=Recommendation(text=""))


def test_overview_headline_and_one_exposed_figure(snap):
    from fsdp_doctor.dashboards.pages.overview import exposed_comm, headline

    info = _finding("info", "All-gathers stall compute")
    warn = _finding("warning", "GC pauses")
    assert headline([]).children.startswith("Healthy")
    assert headline([info]).children == ("No warnings; 1 note below, each with its measured cost. "
                                         "First: All-gathers stall compute")
    assert headline([warn, info, info]).children == "1 warning, 2 notes. First: GC pauses"
    v, src, definition = exposed_comm(snap.report, None)
    assert v is not None and src and definition
    if snap.report.comm is not None:  # the pipeline's one figure, where the report has it
        assert v == snap.report.comm.exposed_ms_per_step
    else:
        waits = [u.timing_p50.ag_wait_fwd_ms + u.timing_p50.ag_wait_bwd_ms for u in snap.report.units
                 if u.timing_p50]
        assert v == pytest.approx(sum(waits)) and "records" in src
    page = PAGES["overview"][1].layout(snap, Filters())
    txt = json.dumps([c.to_plotly_json() for c in _walk(page)], default=str, ensure_ascii=False)
    assert "kpi-exposed" in txt and "per window" not in txt and "Healthy" not in txt


def test_units_table_hides_empty_columns_and_selects_by_row_id(snap):
    from fsdp_doctor.dashboards.pages.units import columns, unit_rows

    rows = unit_rows(snap.report.units)
    cols = [c for c, _ in columns(rows)]
    assert "offload" not in cols and "rec" not in cols  # CPU run, no checkpointing
    assert rows[0]["rid"] == ROOT and rows[0]["unit"] == "(root)"
    rows[1]["offload"] = "cpu"
    assert "offload" in [c for c, _ in columns(rows)]


# ---------------------------------------------------------------- verdict

def _known_verdict() -> Verdict:
    """Two GPU ranks, two profiled steps each, parts in µs chosen by hand (the analysis turns them into shares).
    rank 0: 10 ms window = compute 5, other device work 0.5, AG fwd 2, AG bwd 1, RS 0.5, host 1 (ms);
    rank 1: 8 ms window = compute 1, AG fwd 4, host 3 (ms)."""
    from fsdp_doctor.analyze.verdict import verdict

    parts = {"0": dict(window_us=10_000.0, compute=5_000.0, other_gpu=500.0, allgather_fwd=2_000.0,
                       allgather_bwd=1_000.0, reducescatter=500.0, host=1_000.0),
             "1": dict(window_us=8_000.0, compute=1_000.0, allgather_fwd=4_000.0, host=3_000.0)}
    per_rank = {r: {"steps": [6, 7], "device": "gpu"} for r in parts}
    return verdict(OverlapSection.of({"breakdown": parts, "per_rank": per_rank}))


def test_verdict_bar_known_answers():
    from fsdp_doctor.present.fmt import verdict_headline, verdict_rows

    v = _known_verdict()
    fig = F.verdict_figure(v)
    labels = ["rank 0 · 5.00 ms", "rank 1 · 4.00 ms", "job · 2 ranks"]
    # one trace per share kind present, in the fixed order, each in its one colour; other kinds are left out
    assert [t.name for t in fig.data] == ["compute", "AG fwd", "AG bwd", "RS", "host"]
    assert [t.marker.color for t in fig.data] == [F.VERDICT_COLORS[t.name] for t in fig.data]
    assert len(set(F.VERDICT_COLORS.values())) == len(F.VERDICT_COLORS)
    assert all(t.orientation == "h" and list(t.y) == labels for t in fig.data)
    x = {t.name: list(t.x) for t in fig.data}
    assert x["compute"] == pytest.approx([55.0, 12.5, 6_500 / 180], abs=0.005)  # compute + other device work
    assert x["AG fwd"] == pytest.approx([20.0, 50.0, 6_000 / 180], abs=0.005)
    assert x["AG bwd"] == pytest.approx([10.0, 0.0, 1_000 / 180], abs=0.005)
    assert x["RS"] == pytest.approx([5.0, 0.0, 500 / 180], abs=0.005)
    assert x["host"] == pytest.approx([10.0, 37.5, 4_000 / 180], abs=0.005)
    for i in range(3):
        assert sum(xs[i] for xs in x.values()) == pytest.approx(100.0, abs=0.02)
    # labelled in % with the terminal's one decimal; a segment under 3% only on hover
    assert list(fig.data[0].text) == ["55.0%", "12.5%", "36.1%"]
    assert list(fig.data[3].text) == ["5.0%", "", ""]
    assert fig.layout.barmode == "stack" and tuple(fig.layout.xaxis.range) == (0, 100)
    assert fig.layout.yaxis.autorange == "reversed"  # rank 0 on top, the job last
    assert fig.layout.title.text == "Verdict: % of the step (trace); step: the mean of 2 profiled steps"
    assert fig.layout.height == 96 + 30 * 3
    # the same rows as the terminal and the HTML table
    rows = verdict_rows(v)
    assert rows[0] == ("0", "compute", "5.00 ms", "55.0", "35.0", "20.0", "10.0", "5.0", "0.0", "10.0", "0.0", "0.0")
    assert rows[1] == ("1", "communication", "4.00 ms", "12.5", "50.0", "50.0", "0.0", "0.0", "0.0", "37.5", "0.0", "0.0")
    assert rows[2] == ("job", "communication", "", "36.1", "41.7", "33.3", "5.6", "2.8", "0.0", "22.2", "0.0", "0.0")
    assert verdict_headline(v) == ("Verdict: communication-bound (42% of the step: exposed all-gather (forward) 33%, "
                                   "exposed all-gather (backward) 6%, exposed reduce-scatter 3%); then compute 36% "
                                   "(compute 33%, other device work (memset, D2D) 3%), "  # groups compared as wholes
                                   "host-bound (GPU waits for launches) 22%")
    assert verdict_headline(v, 1) == f"Verdict, rank 1: {v.per_rank['1'].summary}"
    # a rank selected: that rank and the job; more ranks than shown: the title counts them
    one = F.verdict_figure(v, rank=1)
    assert list(one.data[0].y) == ["rank 1 · 4.00 ms", "job · 2 ranks"]
    slowest = F.verdict_figure(v, max_ranks=1)  # (rank 0's 5.00 ms step against rank 1's 4.00)
    assert slowest.layout.title.text.startswith("Verdict: % of the step (trace), 1 of 2 ranks (the slowest);")
    assert list(slowest.data[0].y) == ["rank 0 · 5.00 ms", "job · 2 ranks"]
    assert _is_note(F.verdict_figure(None)) and _is_note(F.verdict_figure(Verdict(job=VerdictEntry(bound="compute"))))


def test_verdict_rows_count_the_ranks_not_shown():
    from fsdp_doctor.present.fmt import VERDICT_HEADER, verdict_rows

    v = _known_verdict()
    # 10 ranks, each step 1 ms longer than the rank before, but rank 3's the longest: the 7 slowest and the fastest
    steps = {r: 10.0 + r for r in range(10)} | {3: 30.0}
    many = Verdict(job=v.job, per_rank={str(r): msgspec.structs.replace(v.per_rank["0"], step_ms=ms)
                                        for r, ms in steps.items()})
    rows = verdict_rows(many)
    assert [r[0] for r in rows] == ["0", "3", "4", "5", "6", "7", "8", "9", "+2", "job"], rows
    assert rows[8][:2] == ("+2", "more ranks") and all(len(r) == len(VERDICT_HEADER) for r in rows)
    assert [r[0] for r in verdict_rows(Verdict(job=v.job, per_rank={"0": v.per_rank["0"]}))] == ["0"]


def test_html_report_draws_the_same_verdict_bar_first():
    from fsdp_doctor.present.html import render_html

    v = _known_verdict()
    doc = render_html({"verdict": v, "findings": []})
    i = doc.index("id='verdict'")
    assert i < doc.index('class="plotly-graph-div"') < doc.index("<table class='num verdict-table'") < doc.index("<h2>Diagnosis")
    assert all(F.VERDICT_COLORS[k] in doc for k in ("compute", "AG fwd", "AG bwd", "RS", "host"))
    assert json.dumps("rank 0 · 5.00 ms") in doc


def test_checkpoint_saves_drawn_as_their_own_bars():
    """A step that saved a checkpoint draws the save as its own bar ("checkpoint saves"), not as time outside the
    model; a window without a save draws none (the dashboard and the HTML report share this figure)."""
    from fsdp_doctor.pipeline import steps_columns
    from test_outlier_cause import _save_run

    cols = steps_columns(_save_run({3, 6, 9}))
    ph = F.phase_split_figure(cols, 0)
    assert [t.name for t in ph.data] == ["forward", "backward", "optimizer", "outside", "checkpoint saves"]
    saves = dict(zip(ph.data[4].x, ph.data[4].y))
    assert {s: v for s, v in saves.items() if v} == {3: 250.0, 6: 250.0, 9: 250.0}
    assert all(v == 5.0 for v in ph.data[3].y)  # the outside bars hold no save
    assert [t.name for t in F.phase_split_figure(cols, 0, window=(10, 11)).data] == [
        "forward", "backward", "optimizer", "outside"]


def test_the_jitter_histogram_counts_the_steps_the_report_counts(sample_run_path):
    """A new-user trial: the histogram held 144 steps per rank where the report counted 143 (a full memory count,
    step 2, left out of the statistics, drawn in the histogram). It reads the analysis's own steady column now."""
    from fsdp_doctor import build_report, load_run
    from fsdp_doctor.pipeline import steps_columns

    run = load_run(sample_run_path)
    cols, report = steps_columns(run), build_report(run)
    for r in (0, 1):
        jit = F.jitter_histogram(cols, ranks=[r])
        assert len(jit.data[0].x) == report.steps.per_rank[str(r)].count == sum(cols[r]["steady"])
    # a step left out for its full memory count, not profiled: out of the histogram too
    cols[0]["steady"][cols[0]["steady"].index(True)] = False
    assert len(F.jitter_histogram(cols, ranks=[0]).data[0].x) == report.steps.per_rank["0"].count - 1


def test_overview_step_count_says_rank_steps_for_the_job(snap):
    """The Overview's p50 tile counted the job's rank-steps as "steady steps" (66 where the CLI shows 33 per rank, a
    new-user trial); for all ranks it says rank-steps, for one rank its steps."""
    import json as _json

    job = snap.report.steps.job
    per = snap.report.steps.per_rank["0"]

    def tile(flt):
        page = _json.dumps([x.to_plotly_json() for x in PAGES["overview"][1].layout(snap, flt)],
                           default=lambda o: o.to_plotly_json() if hasattr(o, "to_plotly_json") else str(o))
        return page

    assert f"all ranks, {job.count} steady rank-steps" in tile(Filters())
    assert f"rank 0, {per.count} steady steps" in tile(Filters(rank=0))


def test_memory_cards_of_a_step_window_that_replays_another_step(snap):
    """?rank=1&steps=9-11 on the sample (steps 9-11 replay a measured step, and the curve is step 1's, measured in
    full): the Steady state card read "—" (5.34 MiB without the filter: what every step starts with) and the Peak
    card "step 9" beside a curve of step 1 (a new-user trial). The steady state is the drawn step's, and both cards
    say which step the curve is."""
    def cards(flt):
        page = PAGES["memory"][1].layout(snap, flt)
        return {c.id: [x.children for x in c.children] for c in _walk(page) if getattr(c, "id", None) in
                ("kpi-mem-peak", "kpi-mem-steady")}

    run, window = cards(Filters(rank=1)), cards(Filters(rank=1, window=(9, 11)))
    assert run["kpi-mem-steady"][1] == "5.34 MiB" == window["kpi-mem-steady"][1], (run, window)
    assert window["kpi-mem-steady"][2].endswith("(step 1's, the curve's)") and "curve" not in run["kpi-mem-steady"][2]
    assert window["kpi-mem-peak"][1:] == ["14.63 MiB", "step 9 (replayed; the curve is step 1's), unit norm, lm_head, "
                                                       "backward_end"], window
    assert run["kpi-mem-peak"][1:] == ["14.63 MiB", "step 1, unit norm, lm_head, backward_end"], run
