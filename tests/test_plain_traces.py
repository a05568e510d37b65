"""Plain traces are first-class: per-unit times from FSDP2's labels and peak memory from the profiler's
``[memory]`` events, per complete step, in every view (terminal, HTML, JSON, the dashboard's Steps, Units and Memory
pages), on known-answer traces, an HTA reference GPU trace and a real 2-rank gloo run profiled with
``profile_memory=True``."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import msgspec
import pytest
from rich.console import Console

from conftest import HTA_TRACES
from fsdp_doctor.pipeline import build_report
from fsdp_doctor.present.fmt import fmt_bytes, fmt_ms
from fsdp_doctor.records import LIGHTNING_DRIVER
from fsdp_doctor.trace import steps_detail as STEPS_DETAIL
from fsdp_doctor.present.terminal import render_report
from fsdp_doctor.report_sections import Report, TraceUnitRow
from fsdp_doctor.store import load_run
from fsdp_doctor.trace import analyze_traces, build_window
from fsdp_doctor.trace.reader import decode
import numpy as np

from fsdp_doctor.trace import intervals as iv
from trace_fixtures import BASE_US, ProfileWindow, TraceBuilder, gloo_gather_trace, gpu_known_trace


_mem = TraceBuilder.memory  # (b, ts, total, device_type=0, device_id=-1)


def _cpu_nested_trace() -> TraceBuilder:
    """Known answer, CPU, 3 ProfilerSteps (1 and 2 complete, 3 cut). Per step at T = 1000 * i:
    root ("") forward [T+10, T+400) holding layers.0's [T+20, T+120) (its module's pre_forward labelled twice, as
    FSDP2 does for a unit of two modules) and layers.1's [T+130, T+330); backward: layers.1 [T+450, T+600),
    layers.0 [T+610, T+700) (post_backward_reshard then _reduce: the later end counts), root [T+440, T+800).
    Memory (CPU allocator, device type 0): 100 at T+5, 300 + 10i at T+200 (inside layers.1's forward), 250 at
    T+650 (layers.0's backward); a CUDA event of 10**9 that a CPU trace ignores."""
    b = TraceBuilder(rank=0, world_size=1)
    for i, n in enumerate((1, 2, 3)):
        T = 1000.0 * i
        b.step(n, T, 1000.0)
        b.label("FSDP::root_pre_forward", T + 1, 2)
        b.label("FSDP::pre_forward", T + 10, 3)
        b.label("FSDP::pre_forward (layers.0)", T + 20, 5)
        b.label("FSDP::pre_forward (layers.0)", T + 30, 5)
        b.op("aten::mm", T + 40, 60)
        b.label("FSDP::post_forward (layers.0)", T + 110, 10)
        b.label("FSDP::pre_forward (layers.1)", T + 130, 5)
        b.op("aten::mm", T + 140, 150)
        b.label("FSDP::post_forward (layers.1)", T + 320, 10)
        b.label("FSDP::post_forward", T + 390, 10)
        b.label("FSDP::pre_backward", T + 440, 5)
        b.label("FSDP::pre_backward (layers.1)", T + 450, 5)
        b.label("FSDP::post_backward_reduce (layers.1)", T + 590, 10)
        b.label("FSDP::pre_backward (layers.0)", T + 610, 5)
        b.label("FSDP::post_backward_reduce (layers.0)", T + 680, 5)
        b.label("FSDP::post_backward_reshard (layers.0)", T + 690, 10)
        b.label("FSDP::post_backward_reshard", T + 790, 10)
        _mem(b, T + 5, 100)
        _mem(b, T + 200, 300 + 10 * i)
        _mem(b, T + 650, 250)
        _mem(b, T + 660, 10 ** 9, device_type=1, device_id=0)
    return b


def test_unit_times_and_memory_known_answer(tmp_path):
    b = _cpu_nested_trace()
    path = b.write(tmp_path / "rank0.json")
    for full in (False, True):  # the fast decoder keeps the [memory] instants as the full one does
        w = build_window(path, decode(path, full=full))
        assert w.steps == [1, 2]
        assert w.unit_us == {n: {"": [400 - 10, 800 - 440], "layers.0": [120 - 20, 700 - 610],
                                 "layers.1": [330 - 130, 600 - 450]} for n in (1, 2)}
        assert {n: (m["peak"], m["t_ms"], m["unit"], m["phase"]) for n, m in w.memory.items()} == {
            1: (300, 0.2, "layers.1", "forward"), 2: (310, 0.2, "layers.1", "forward")}
        assert w.memory[1]["timeline"] == [(0.005, 100), (0.2, 300), (0.65, 250)]
    ov = analyze_traces(path)
    rows = {u.name: u for u in ov.units}
    assert list(rows) == ["", "layers.0", "layers.1"]
    root, l0, l1 = rows[""], rows["layers.0"], rows["layers.1"]
    assert (root.depth, root.parent, l0.depth, l0.parent) == (0, None, 1, "")
    assert (l0.timing_p50.fwd_ms, l0.timing_p50.bwd_ms, l1.timing_p50.fwd_self_ms) == (0.1, 0.09, 0.2)
    assert root.timing_p50.fwd_ms == 0.39 and root.timing_p50.fwd_self_ms == pytest.approx(0.39 - 0.1 - 0.2)
    assert root.timing_p50.bwd_self_ms == pytest.approx(0.36 - 0.15 - 0.09)
    assert root.samples == 2 and "host spans" in root.source
    m = ov.memory.per_rank["0"]
    assert ov.memory.source.startswith("trace") and (m.peak_bytes, m.peak_at.step, m.steps) == (310, 2, 2)
    # a CPU trace's totals count from the profiler's start: the figure says what it leaves out (it read as the
    # run's peak: 8.27 MiB for 11.56 MiB, a new-user trial)
    assert ov.memory.source == STEPS_DETAIL.MEMORY_SOURCE_CPU and "not in them" in ov.memory.source


def test_grouped_unit_own_time_leaves_out_what_ran_between_its_modules(tmp_path):
    """A tied [embed, head] unit (accelerate's plugin groups a tied embedding and head): FSDP2 labels its pre-forward
    at each module and its post-forward once, after the last, so its forward span holds the blocks between them,
    which the module tree does not nest in it (the Trainer trial's Whisper read its decoder's whole forward, 23.0 ms,
    as the unit's own time, and the root's own as 0.00). Known answer, one CPU step at T = 0: root forward
    [10, 500), the group's [20, 450) (pre-forward again at 420, the head), layers.0 [100, 200), layers.1 [210, 400);
    backward: the root [600, 900), the group [605, 920) (its reduce ends after the root's), layers.1 [620, 700),
    layers.0 [710, 800). Own time: forward, the group 430 - 100 - 190 = 140 us, the root 490 - 430 = 60 us;
    backward, each holds both layers (the group not inside the root): the root 300 - 170 = 130 us, the group 315 -
    170 = 145 us."""
    b = TraceBuilder(rank=0, world_size=1)
    for n, T in ((1, 0.0), (2, 1000.0)):
        b.step(n, T, 1000.0)
        b.label("FSDP::root_pre_forward", T + 1, 2)
        b.label("FSDP::pre_forward", T + 10, 3)
        b.label("FSDP::pre_forward (embed, head)", T + 20, 5)
        b.label("FSDP::pre_forward (layers.0)", T + 100, 5)
        b.label("FSDP::post_forward (layers.0)", T + 190, 10)
        b.label("FSDP::pre_forward (layers.1)", T + 210, 5)
        b.label("FSDP::post_forward (layers.1)", T + 390, 10)
        b.label("FSDP::pre_forward (embed, head)", T + 420, 5)
        b.label("FSDP::post_forward (embed, head)", T + 440, 10)
        b.label("FSDP::post_forward", T + 490, 10)
        b.label("FSDP::pre_backward", T + 600, 2)
        b.label("FSDP::pre_backward (embed, head)", T + 605, 5)
        b.label("FSDP::pre_backward (layers.1)", T + 620, 5)
        b.label("FSDP::post_backward_reduce (layers.1)", T + 690, 10)
        b.label("FSDP::pre_backward (layers.0)", T + 710, 5)
        b.label("FSDP::post_backward_reduce (layers.0)", T + 790, 10)
        b.label("FSDP::post_backward_reshard", T + 890, 10)
        b.label("FSDP::post_backward_reduce (embed, head)", T + 910, 10)
    path = b.write(tmp_path / "rank0.json")
    w = build_window(path, decode(path))
    assert w.unit_nesting == {"forward": {"": ["embed, head"], "embed, head": ["layers.0", "layers.1"]},
                              "backward": {"": ["layers.0", "layers.1"], "embed, head": ["layers.0", "layers.1"]}}
    rows = {u.name: u.timing_p50 for u in analyze_traces(path).units}
    assert (rows["embed, head"].fwd_self_ms, rows[""].fwd_self_ms) == (0.14, 0.06)
    assert (rows[""].bwd_self_ms, rows["embed, head"].bwd_self_ms) == (0.13, 0.145)
    assert (rows["layers.1"].fwd_self_ms, rows["layers.1"].bwd_self_ms) == (0.19, 0.08)


def _prefetch_rules(tmp_path, trace):
    """The report of one trace file, and prefetch.exposed_allgather's and prefetch.sync_unshard's finding (None where
    quiet) and status."""
    trace.write(tmp_path / "rank0.5.pt.trace.json.gz")
    rep = build_report(load_run(tmp_path))
    found = {f.code: f for f in rep.findings}
    status = {r.code: r for r in rep.rules}
    return rep, {c: (found.get(c), status[c]) for c in ("prefetch.exposed_allgather", "prefetch.sync_unshard")}


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
@pytest.mark.parametrize("prefetch", [False, True], ids=["implicit", "explicit"])
def test_plain_gloo_trace_prefetch_advice_follows_blocked_allgathers(tmp_path, sync, prefetch):
    """A new-user trial's plain traces of a 2-rank gloo GPT (synchronous unshard; 18 of 18 all-gathers a rank blocked
    the host): prefetch.exposed_allgather offered explicit forward prefetch, and after the paste (9
    FSDP::forward_prefetch labels a trace) the same finding and fix again; prefetch.sync_unshard was skipped for want
    of the unit snapshot. Known answer (gloo_gather_trace): 2 all-gathers a step, 1 ms exposed each (20% of a 10 ms
    step), 2 steps. Where the host sat in them, sync_unshard fires from the trace with the async fix and the prefetch
    rule offers no prefetch; where the trace shows explicit prefetch, no prefetch fix again (quiet on gloo, as in
    record mode); async and implicit, the prefetch snippet with record mode's 'no measurable gain on gloo'."""
    rep, got = _prefetch_rules(tmp_path, gloo_gather_trace(sync=sync, prefetch=prefetch))
    assert rep.overlap.blocking["0"].count == (4 if sync else 0)
    assert rep.overlap.per_rank["0"].forward_prefetched == (["1"] if prefetch else [])
    (ag, ag_status), (su, su_status) = got["prefetch.exposed_allgather"], got["prefetch.sync_unshard"]
    if sync:
        assert su is not None and su.severity == "warning"
        assert su.title == "Synchronous unshard on gloo: the host blocked in 4 of 4 all-gathers (trace)"
        assert su.evidence["allgathers_blocking_host"] == 4 and su.evidence["allgathers"] == 4
        assert su.evidence["blocking_ms_per_step"] == 2.0 and su.evidence["ag_overlap_pct"] == 0.0
        assert su.recommendation.code.endswith("for module in model.modules():\n    if isinstance(module, FSDPModule):\n"
                                               "        module._set_unshard_async_op(True)")
    else:
        assert su is None and su_status.status == "quiet"
        assert su_status.reason.startswith("the host sat in 0 of 4 all-gathers for their whole length")
    if prefetch:  # the prefetch fix pasted: quiet on gloo, saying why
        assert ag is None and ag_status.status == "quiet"
        assert ag_status.reason.startswith("explicit prefetch is set (the trace's FSDP::forward_prefetch labels name "
                                           "1) and compute still waits 2.00 ms per step (20%)")
        assert ("prefetch.sync_unshard" in ag_status.reason) == sync
        return
    assert ag is not None and ag.severity == "info" and ag.evidence["exposed_ag_ms_per_step"] == 2.0
    if sync:  # no prefetch snippet: it cannot help while each all-gather blocks the host
        assert ag.recommendation.code == ""
        assert "The unshard is synchronous on gloo: the host sat in 4 of 4 all-gathers" in ag.recommendation.text
        assert "(prefetch.sync_unshard's fix)" in ag.recommendation.text
    else:
        assert "set_modules_to_forward_prefetch" in ag.recommendation.code
        assert "On gloo, prefetch gains nothing measurable" in ag.recommendation.text


def test_plain_gpu_trace_with_explicit_prefetch_offers_no_prefetch_again(tmp_path):
    """gpu_known_trace with layers.1 prefetched under FSDP::forward_prefetch: the exposure left (0.15 ms of a 1 ms
    step) is named, with no prefetch snippet (it is set) and no gain predicted; without the label the snippet."""
    rep, got = _prefetch_rules(tmp_path / "explicit", gpu_known_trace(prefetch=True))
    assert rep.overlap.per_rank["0"].forward_prefetched == ["layers.1"]
    ag, _ = got["prefetch.exposed_allgather"]
    assert ag.evidence["exposed_ag_ms_per_step"] == 0.15 and ag.recommendation.code == ""
    assert "Explicit prefetch is already set (the trace's FSDP::forward_prefetch labels name layers.1)" in \
        ag.recommendation.text
    assert ag.predicted.step_ms_after is None
    assert got["prefetch.sync_unshard"][1].reason == "a GPU trace: its all-gathers run on their own stream"
    _, got = _prefetch_rules(tmp_path / "implicit", gpu_known_trace(prefetch=False))
    assert "set_modules_to_forward_prefetch" in got["prefetch.exposed_allgather"][0].recommendation.code


def test_gpu_known_trace_unit_device_time():
    """The known-answer GPU trace labels pre_backward (layers.1) [T+420 ..] and post_backward_reduce (layers.1)
    [.. T+595) and no post_forward. Launched inside that host span: an all-gather (NCCL, left out), one compute
    kernel [T+500, T+600) (launched at T+431) and a reduce-scatter; the compute kernel launched at T+596 is
    outside it. So layers.1's backward is 100 µs of device time per step, no forward time, no other unit."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        ov = analyze_traces(gpu_known_trace().write(Path(d) / "rank0.json"))
    assert [(u.name, u.timing_p50.bwd_ms, u.timing_p50.bwd_self_ms, u.timing_p50.fwd_self_ms, u.samples)
            for u in ov.units] == [("layers.1", 0.1, 0.1, None, 2)]
    assert "device time of the compute kernels" in ov.units[0].source
    assert ov.memory is None  # no [memory] events: no memory figure


@pytest.mark.skipif(not (HTA_TRACES / "v100_allreduce_rank1").is_dir(), reason="reference traces not found")
def test_hta_v100_trace_memory_matches_its_memory_events():
    """The V100 reference trace was recorded with profile_memory: its peak is the highest CUDA "Total Allocated"
    inside the complete steps (ProfilerStep#2..#6: the last kept, torch.profiler's cudaDeviceSynchronize follows its
    last launch, and it ends at its marker's end), read here straight from the JSON."""
    folder = HTA_TRACES / "v100_allreduce_rank1"
    events = json.loads(gzip.decompress(next(folder.glob("*.json.gz")).read_bytes()))["traceEvents"]
    marks = [e for e in events if e.get("name", "").startswith("ProfilerStep#") and e["cat"] != "gpu_user_annotation"]
    starts = sorted((e["ts"], int(e["name"].split("#")[1])) for e in marks)
    t0, t1 = starts[0][0], max(e["ts"] + e["dur"] for e in marks)
    mem = [(e["ts"], e["args"]["Total Allocated"]) for e in events if e.get("name") == "[memory]"
           and e["args"].get("Device Type") == 1 and t0 <= e["ts"] < t1]
    ts, peak = max(mem, key=lambda x: (x[1], -x[0]))
    step = max(n for s, n in starts if s <= ts)
    rep = build_report(load_run(folder))
    m = rep.memory_section().per_rank["1"]
    assert (m.peak_bytes, m.peak_at.step) == (peak, step)
    assert rep.memory_section().source == STEPS_DETAIL.MEMORY_SOURCE  # a GPU's allocator total: the whole of it
    assert m.peak_at.t_ms == pytest.approx((ts - dict((n, s) for s, n in starts)[step]) / 1e3, abs=1e-3)
    assert rep.memory is None and rep.overlap.units == []  # records' memory absent; no FSDP labels: no unit rows
    assert m.steps == len(starts)


# ------------------------------------------------------------------ a real gloo run, profile_memory=True


@pytest.fixture(scope="module")
def gloo_memory_run(tmp_path_factory):
    workloads = pytest.importorskip("fsdp_doctor.workloads")
    out = tmp_path_factory.mktemp("plain_mem")
    hook = ProfileWindow(out, warmup=1, active=3, profile_memory=True)
    cfg = workloads.WorkloadConfig(steps=hook.steps_needed(), async_unshard=True, d_model=128, n_layers=2,
                                   seq_len=64)
    workloads.launch(cfg, nproc=2, on_step=hook, timeout_s=300)
    return out, build_report(load_run(out))


@pytest.mark.slow
def test_real_gloo_trace_units_and_memory(gloo_memory_run):
    path, rep = gloo_memory_run
    assert rep.units is None and rep.memory is None  # no records
    units = {u.name: u for u in rep.unit_rows()}
    assert set(units) == {"tok_emb, pos_emb", "layers.0", "layers.1", "norm, lm_head"}
    for u in units.values():
        assert isinstance(u, TraceUnitRow) and u.samples == 6  # 2 ranks x 3 complete steps
        assert u.timing_p50.fwd_self_ms > 0 and u.timing_p50.bwd_self_ms > 0
    step = rep.trace_steps.job
    assert sum(u.timing_p50.fwd_self_ms + u.timing_p50.bwd_self_ms for u in units.values()) < step.max_ms
    # memory: the highest CPU "Total Allocated" inside each rank's complete steps, read straight from the JSON
    mem = rep.memory_section()
    for f in sorted(Path(path).glob("*.json.gz")):
        d = json.loads(gzip.decompress(f.read_bytes()))
        rank = str(d["distributedInfo"]["rank"])
        marks = [e for e in d["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")]
        t0, t1 = min(e["ts"] for e in marks), max(e["ts"] + e["dur"] for e in marks)  # (the last step whole too)
        peak = max(e["args"]["Total Allocated"] for e in d["traceEvents"] if e.get("name") == "[memory]"
                   and e["args"]["Device Type"] == 0 and t0 <= e["ts"] < t1)
        m = mem.per_rank[rank]
        assert m.peak_bytes == peak and m.steps == 3 and m.peak_at.step in (1, 2, 3)
        assert max(s["allocated"] for s in m.timeline) == peak


@pytest.mark.slow
def test_real_gloo_trace_in_every_view(gloo_memory_run, tmp_path):
    """Terminal, HTML, JSON and the dashboard's Steps, Units and Memory pages show the trace's figures."""
    from fsdp_doctor.dashboards.app import _step_bounds
    from fsdp_doctor.dashboards.pages import PAGES
    from fsdp_doctor.dashboards.pages.common import Filters
    from fsdp_doctor.dashboards.state import RunState
    from fsdp_doctor.present.html import write_html
    from fsdp_doctor.present.fmt import fmt_ms_cell as _num

    path, rep = gloo_memory_run
    back = Report.of(json.loads(json.dumps(rep.to_builtins())))
    assert back.overlap.units == rep.overlap.units and back.overlap.memory == rep.overlap.memory
    c = Console(width=100, record=True, color_system=None, file=open("/dev/null", "w"))
    render_report(rep, c)
    term = c.export_text()
    html = write_html(rep, tmp_path / "r.html").read_text()
    st = RunState(path, background_traces=False)
    st.refresh()
    snap = st.snapshot()
    assert _step_bounds(snap) == (1, 3)  # the slider spans the trace's complete steps
    pages = {}
    for key in ("steps", "units", "memory"):
        page = json.dumps([x.to_plotly_json() for x in PAGES[key][1].layout(snap, Filters())],
                          default=lambda o: o.to_plotly_json() if hasattr(o, "to_plotly_json") else str(o),
                          ensure_ascii=False)
        assert "No fsdp-doctor records" not in page, key
        pages[key] = page
    assert "fig-step-time" in pages["steps"]
    assert "per-step medians in ms over" in term  # (the terminal's cells are bare numbers: the title gives the unit)
    for u in rep.unit_rows():
        t = u.timing_p50
        assert any(ln.split()[-2:] == [_num(t.fwd_self_ms), _num(t.bwd_self_ms)] for ln in term.splitlines()
                   if u.name.split(",")[0] in ln), u.name
        assert f"<td>{fmt_ms(t.fwd_self_ms)}</td><td>{fmt_ms(t.bwd_self_ms)}</td>" in html
        assert fmt_ms(t.fwd_self_ms) in pages["units"] and fmt_ms(t.bwd_self_ms) in pages["units"]
    for r, m in rep.memory_section().per_rank.items():
        assert fmt_bytes(m.peak_bytes) in term and fmt_bytes(m.peak_bytes) in html
        assert fmt_bytes(m.peak_bytes) in pages["memory"]


@pytest.mark.slow
def test_compare_reads_the_steps_the_report_reads(gloo_memory_run):
    """compare's step samples of plain traces (trace.ops) are the report's trace steps, step for step: a kept step
    ends where the next one starts (trace.build's steps, HTA's; the window's last, kept whole, at its marker's end),
    not where its ``ProfilerStep`` marker ends (what trace.ops read before: every step shorter by the gap between the
    markers)."""
    from fsdp_doctor.trace.ops import op_times

    path, rep = gloo_memory_run
    ops = op_times(load_run(path).trace_files)
    assert set(ops.steps_ms) == set(rep.overlap.per_rank) == {"0", "1"}
    for r, pr in rep.overlap.per_rank.items():
        assert ops.steps_ms[r] == pytest.approx(list(pr.step_times_ms.values()), abs=1e-6), r
    # and the markers' own durations are shorter: what the two views used to disagree by
    for f in sorted(Path(path).glob("*.json.gz")):
        d = json.loads(gzip.decompress(f.read_bytes()))
        marks = sorted((e["ts"], e["dur"]) for e in d["traceEvents"] if e.get("name", "").startswith("ProfilerStep#"))
        rank = str(d["distributedInfo"]["rank"])
        assert [dur / 1e3 for _, dur in marks] != pytest.approx(ops.steps_ms[rank], abs=1e-6)
        assert marks[-1][1] / 1e3 == pytest.approx(ops.steps_ms[rank][-1], abs=1e-6)


@pytest.mark.slow
def test_real_gloo_straggler_is_found_step_after_step(tmp_path):
    """A real 2-rank gloo run profiled with plain torch.profiler (5 complete steps), rank 1 sleeping 300 ms before
    each forward: its own work (each step less its exposed communication, which on rank 0 holds the wait for it)
    exceeds rank 0's in every step, and straggler.trace names it (now that it asks for the same rank step after
    step: tests/test_trace_rules.py's trial figures). (Not a rank late in every other step: on this 2-core host at
    load ~11 the other steps' own work differed between the ranks by up to 80 ms, and in 5 of 8 such runs a third
    step was slower by 15%: 3 of 4, what straggler.rank would name too.)"""
    workloads = pytest.importorskip("fsdp_doctor.workloads")
    hook = ProfileWindow(tmp_path, warmup=1, active=5)
    # (300 ms: with 150 it failed once in make test's quick tier beside a fix helper's runs, load ~4, passing alone)
    cfg = workloads.WorkloadConfig(steps=hook.steps_needed(), d_model=64, n_layers=2, seq_len=32, sleep_rank=1,
                                   sleep_ms=300.0)
    workloads.launch(cfg, nproc=2, on_step=hook, timeout_s=300)
    rep = build_report(load_run(tmp_path))
    per = rep.overlap.per_rank
    for pr in per.values():  # the steps' exposed communication is the rank's, split by step
        assert sum(pr.step_exposed_ms.values()) == pytest.approx(pr.exposed_ms_per_step * pr.step_count)
    steps = sorted(per["0"].step_exposed_ms, key=int)
    own = {r: [pr.step_times_ms[st] - pr.step_exposed_ms[st] for st in steps] for r, pr in per.items()}
    assert len(steps) == 5 and all(b - a > 100 for a, b in zip(own["0"], own["1"])), own  # the sleep, less noise
    f = next(f for f in rep.findings if f.code == "straggler.trace")
    assert f.ranks == [1] and f.evidence["own_ms_per_step"] - f.evidence["others_own_ms_median"] > 100, f


def test_streamed_trace_gives_the_same_units_and_memory(tmp_path, monkeypatch):
    """A trace decoded in batches (past STREAM_MIN_BYTES) keeps its [memory] instants and FSDP2 labels: the same
    unit times and memory as decoded whole."""
    from fsdp_doctor.trace import reader

    path = _cpu_nested_trace().write(tmp_path / "rank0.json.gz")
    whole = build_window(path)
    monkeypatch.setattr(reader, "STREAM_MIN_BYTES", 0)
    monkeypatch.setattr(reader, "BATCH_BYTES", 1500)
    monkeypatch.setattr(reader, "READ_BYTES", 333)
    trace = decode(path)
    assert isinstance(trace, reader.StreamedTrace)
    streamed = build_window(path, trace)
    assert streamed.unit_us == whole.unit_us and streamed.memory == whole.memory and whole.memory


def test_odd_memory_events_are_left_out_not_fatal(tmp_path):
    """[memory] instants with a string, an absurd or another device's total are left out; the file is still read
    and the peak is the plausible samples' (310 at step 2)."""
    b = _cpu_nested_trace()
    for e in b.events:
        if e.get("name") == "[memory]" and e["args"]["Total Allocated"] == 250:
            e["args"]["Total Allocated"] = 1.5e300
    _mem(b, 1300, 0)
    b.events[-1]["args"]["Total Allocated"] = "lots"
    _mem(b, 1310, 0)
    b.events[-1]["args"]["Device Id"] = [1]
    ov = analyze_traces(b.write(tmp_path / "rank0.json"))
    assert ov.skipped == [] and ov.memory.per_rank["0"].peak_bytes == 310


def test_unit_spans_and_times_from_label_arrays_known_answer():
    """The builder's compact path: labels as arrays (name indices), a unit run twice in a step summed, units in
    the order they started, device times through the running sums (disjoint kernels) and through unions
    (overlapping kernels, a kernel without a launch)."""
    import numpy as np
    from fsdp_doctor.trace.steps_detail import unit_spans, unit_step_times
    names = ["FSDP::pre_forward (a)", "FSDP::post_forward (a)", "FSDP::pre_backward (a)",
             "FSDP::post_backward_reduce (a)", "FSDP::all_gather (a)", "FSDP::pre_forward (b)",
             "FSDP::post_forward (b)"]
    labels = [(10, 11, 0), (25, 30, 1), (40, 41, 0), (45, 50, 1), (60, 61, 2), (70, 80, 3), (62, 63, 4),
              (110, 111, 0), (115, 120, 1), (102, 103, 5), (105, 108, 6)]
    ts, end, name = (np.array(c, dtype=dt) for c, dt in zip(zip(*labels), (float, float, np.int32)))
    bounds = {1: (0.0, 100.0), 2: (100.0, 200.0)}
    spans = unit_spans(ts, end, name, names, bounds)
    assert len(spans) == 5
    assert unit_step_times(spans) == {1: {"a": [20.0 + 10.0, 20.0]}, 2: {"b": [6.0, 0.0], "a": [10.0, 0.0]}}
    launch = np.array([12, 42, 65, 112, 500], dtype=float)
    start, stop = np.array([300, 310, 320, 400, 500], dtype=float), np.array([305, 312, 330, 401, 600], dtype=float)
    assert unit_step_times(spans, device=(launch, start, stop)) == {1: {"a": [7.0, 10.0]},
                                                                    2: {"b": [0.0, 0.0], "a": [1.0, 0.0]}}
    launch, start, stop = (np.append(x, v) for x, v in zip((launch, start, stop), ([66, np.nan], [325, 0],
                                                                                    [335, 1000])))
    assert unit_step_times(spans, device=(launch, start, stop)) == {1: {"a": [7.0, 15.0]},
                                                                    2: {"b": [0.0, 0.0], "a": [1.0, 0.0]}}


def test_step_units_from_label_arrays_known_answer():
    """Each complete step's FSDP units, in the order first named, from every label of a unit's own work (a
    prefetch names its target, ``[pg=N]`` is not part of the name, the root's labels name none: ""); labels that
    name no unit, outside the steps or of no FSDP kind are left out; steps with the same units share one tuple."""
    import numpy as np
    from fsdp_doctor.trace.steps_detail import step_units
    names = ["FSDP::root_pre_forward", "FSDP::pre_forward", "FSDP::forward_prefetch for b",
             "FSDP::all_gather (a) [pg=1]", "FSDP::post_backward_rs_wait ()", "FSDP::post_backward_reduce (c)",
             "FSDP::pre_forward (a)", "ProfilerStep#1", "FSDP::root_post_backward_callback"]
    labels = [(1, 0), (2, 1), (3, 2), (4, 3), (5, 8), (6, 7), (50, 5),  # step 1: "", b, a, c
              (101, 6), (102, 2), (150, 4),  # step 2: a, b, "" (rs_wait of the root)
              (201, 6), (202, 2), (203, 1),  # step 3: a, b, ""
              (310, 5)]  # past the last step: left out
    ts, name = np.array([t for t, _ in labels], dtype=float), np.array([n for _, n in labels], dtype=np.int32)
    bounds = {1: (0.0, 100.0), 2: (100.0, 200.0), 3: (200.0, 300.0), 4: (300.0, 300.0)}
    got = step_units(ts, name, names, bounds)
    assert got == {1: ("", "b", "a", "c"), 2: ("a", "b", ""), 3: ("a", "b", "")}
    assert got[2] is got[3]
    assert step_units(ts[:1], name[:1], names, bounds) == {}  # the root's pre-forward names no unit
    assert step_units(ts, name, names, {}) == {}


def test_no_findings_from_a_plain_trace_is_not_called_healthy(sample_run_path):
    """The recorded run's own profiler traces read as plain traces: most rules need the doctor's records, so "no
    findings" says how few rules could check (it said "Healthy: no findings." on a one-unit model with 0%
    overlap, a new-user trial), in the terminal, the HTML and the dashboard alike; the same run with its records
    is checked by most rules, and there "Healthy" keeps its meaning."""
    from fsdp_doctor.dashboards.pages import PAGES
    from fsdp_doctor.dashboards.pages.common import Filters
    from fsdp_doctor.dashboards.state import RunState
    from fsdp_doctor.present.fmt import findings_headline
    from fsdp_doctor.present.html import render_html

    report = build_report(load_run(sample_run_path / "profiler"))
    checked = [r for r in report.rules if r.status != "skipped"]
    assert not report.findings and 0 < len(checked) < len(report.rules) / 2
    head = findings_headline(report.findings, report.rules)
    assert head == (f"No findings, but only {len(checked)} of {len(report.rules)} rules could check this run: the "
                    "others need what it lacks (fsdp-doctor analyze --explain lists them).")
    console = Console(width=200, record=True)
    render_report(report, console)
    assert head in console.export_text() and "Healthy" not in console.export_text()
    assert "Healthy" not in render_html(report) and "No findings, but only" in render_html(report)
    st = RunState(sample_run_path / "profiler", background_traces=False)
    st.refresh()
    assert head in repr(PAGES["overview"][1].layout(st.snapshot(), Filters()))
    full = build_report(load_run(sample_run_path))
    assert 2 * sum(r.status != "skipped" for r in full.rules) >= len(full.rules)
    assert findings_headline([], full.rules) == "Healthy: no findings."
    # with notes or warnings from a plain trace too (a new-user trial read "No warnings; 1 note below" of traces where
    # 43 of 49 rules never looked, two of them warnings of the same loop under watch())
    note, warn = (msgspec.structs.replace(f, severity=s) for f, s in ((full.findings[0], "info"),
                                                                         (full.findings[0], "warning")))
    few = f"only {len(checked)} of {len(report.rules)} rules could check this run"
    assert findings_headline([note], report.rules).startswith(f"No warnings, but {few}") and \
        findings_headline([note], report.rules).endswith("; 1 note below.")
    assert findings_headline([warn], report.rules).startswith(f"1 warning. Only {len(checked)} of")
    assert findings_headline([note], full.rules) == "No warnings; 1 note below, each with its measured cost."


@pytest.mark.slow
def test_html_steps_of_plain_traces_are_the_terminals(gloo_memory_run):
    """The HTML report of plain traces said "Steps: No step records." while the terminal printed their complete
    ProfilerSteps (a new-user trial): the HTML's Steps section now has the same rows."""
    from fsdp_doctor.present.fmt import steps_rows
    from fsdp_doctor.present.html import render_html

    _, rep = gloo_memory_run
    page = render_html(rep)
    steps = page[page.index("<h2>Steps</h2>"):page.index("<h2>Memory</h2>")]
    assert "No step records." not in steps
    for row in steps_rows(rep.trace_steps):
        assert all(cell in steps for cell in row[:3]), row


def test_a_unit_run_after_the_roots_forward_is_not_a_second_root():
    """A new-user trial analysed torchtitan's own traces: "fully_shard was never applied to the root: 2 FSDP roots
    per forward", and the printed fully_shard(model) raised (applied twice). torchtitan's chunked loss calls its
    [norm, output] unit per chunk after the model's forward returned, and each call claims FSDP's root (a second
    FSDP::root_pre_forward). A root whose forward reaches several units is a root over the model; blocks sharded
    with no root over them each reach only their own unit. Known answers on label times and names."""
    from fsdp_doctor.trace.build import _roots_per_forward

    def pattern(groups):  # [[units whose pre_forward follows one root_pre_forward], ...] per forward, then backward
        ts, bwd, pre, t = [], [], [], 0.0
        for fwd in groups:
            for units in fwd:
                ts.append(t), bwd.append(False)
                for u in units:
                    t += 1.0
                    pre.append((t, f"FSDP::pre_forward ({u})"))
                t += 1.0
            ts.append(t), bwd.append(True)
            t += 10.0
        return ts, bwd, pre

    titan = [[["", "layers.0", "layers.1"], ["norm, output"], ["norm, output"]]] * 3  # two loss chunks
    assert _roots_per_forward(*pattern(titan)[:2], 0.0, pattern(titan)[2]) == 1.0
    assert _roots_per_forward(*pattern(titan)[:2], 0.0) == 3.0  # without the units: three roots, as before
    blocks = [[["layers.0"], ["layers.1"], ["layers.2"]]] * 3  # fully_shard on the blocks only
    assert _roots_per_forward(*pattern(blocks)[:2], 0.0, pattern(blocks)[2]) == 3.0


def _passes_trace(passes: list[bool], gathers: bool = False, logged: bool = False) -> TraceBuilder:
    """A gloo trace of units "0" and "1", steps 5 and 6 (and 7, cut): each step runs ``passes``, a forward of both
    units, and where True its backward (FSDP2's labels: pre_forward/post_forward, pre_backward/post_backward_reduce).
    ``gathers``: an all-gather no FSDP unit issues inside unit "1"'s forward (a tensor-parallel layer's) and one
    after each forward without a backward (an evaluation loop's metric gather); ``logged``: one between each forward
    and its backward (a logged loss synced over the ranks: Lightning's self.log(sync_dist=True))."""
    b = TraceBuilder(rank=0)
    b.pid = b.main_tid = 100

    def gather(t):
        b.op("c10d::allgather_", t, 40)
        b.gloo("all_gather", t + 5, 30)

    for i, n in enumerate((5, 6, 7)):
        t = 20000.0 * i
        b.step(n, t, 19000.0)
        for with_backward in passes:
            if gathers:
                b.label("FSDP::root_pre_forward", t + 1, 2)
            for unit in ("0", "1"):
                b.label(f"FSDP::pre_forward ({unit})", t + 10, 5)
                b.op("aten::mm", t + 20, 500)
                if gathers and unit == "1":
                    gather(t + 450)
                b.label(f"FSDP::post_forward ({unit})", t + 530, 5)
                t += 600
            if (gathers and not with_backward) or (logged and with_backward):
                gather(t + 20)
                t += 100
            for unit in ("1", "0") if with_backward else ():
                b.label(f"FSDP::pre_backward ({unit})", t + 10, 5)
                b.op("aten::mm", t + 20, 800)
                b.label(f"FSDP::post_backward_reduce ({unit})", t + 830, 20)
                t += 900
    return b


@pytest.mark.parametrize("passes, note", [
    ([True, False, False], "2 of 2 profiled steps ran 2 forward pass(es) without a backward (rank 0: evaluation or "
                           "generation inside them)"),
    ([True, True], None),  # gradient accumulation: each forward has its backward
])
def test_plain_trace_says_where_steps_ran_forwards_without_a_backward(tmp_path, passes, note):
    """A new-user trial's plain traces with 3 no-grad evaluation forwards after each training step: 41% of the step
    read as exposed forward all-gathers, the units' forward times 4-7x the training's, and nothing said the steps
    held those forwards. Known answer: a training pass and two forwards without a backward in each step; FSDP2
    labels no forward of a checkpoint's recompute, and micro-batches each have their backward (no note)."""
    _passes_trace(passes).write(tmp_path / "rank0.5.pt.trace.json.gz")
    rep = build_report(load_run(tmp_path))
    assert rep.overlap.per_rank["0"].nograd_forwards == ({"5": 2, "6": 2} if note else {})
    notes = [n for n in rep.run.notes or [] if "without a backward" in n]
    assert (notes[0].startswith(note) if note else notes == []), notes


def test_an_evaluations_own_collectives_between_its_forwards_are_the_loops(tmp_path):
    """A Trainer evaluating inside a profiled step gathers its metrics between the evaluation's forwards, inside the
    model's region (its first forward to its last FSDP label): the trace verdict read them as "exposed
    model-parallel collectives" (a new-user trial, no model parallelism there). In a step with forwards without a
    backward, the model's collectives are those inside a unit's forward or backward: the tensor-parallel-like gather
    inside unit 1 stays the model's, the evaluation's are the loop's."""
    from fsdp_doctor.trace import load_window

    _passes_trace([True, False, False], gathers=True).write(tmp_path / "rank0.5.pt.trace.json.gz")
    w = load_window(tmp_path / "rank0.5.pt.trace.json.gz")
    phases = [c.phase for c in w.calls if c.collective == "all_gather"][:5]
    # step 5: the training pass's gather (model), two evaluation forwards each with one inside and one after
    assert phases == ["model", "model", None, "model", None], phases


@pytest.mark.parametrize("groups, phases", [
    ([2, 1], ["model", "loss", "model", "loss"]),  # the world's group and a 1-rank tensor-parallel dim: no TP
    ([4, 2, 2], ["model", "model", "model", "model"]),  # 4 ranks, 2 x 2: a loss-parallel all-reduce is the model's
    (None, ["model", "model", "model", "model"]),  # no group list: not known, as before
])
def test_a_collective_between_forward_and_backward_is_the_loops_without_model_parallel_groups(tmp_path, groups,
                                                                                             phases):
    """Lightning's ``self.log(..., sync_dist=True)`` in training_step syncs the logged value between the model's
    forward and its backward, inside the model's region (its first forward to its last FSDP label): the trace verdict
    read it as "exposed model-parallel collectives" (a new-user trial: the run's only groups were the world's and
    Lightning's tensor-parallel mesh dimension of 1 rank). Where every process group the trace lists is the world's
    or one rank's, no model-parallel group exists: a collective outside every unit's forward and backward is the
    loop's, its loss code's (phase "loss": between the passes, not around them where a gradient-norm log runs); the
    one inside unit "1"'s forward stays the model's. With a group smaller than the world (a
    tensor-parallel dimension: its vocabulary-parallel loss all-reduces after the units), or none listed, the
    model's region keeps it."""
    from fsdp_doctor.trace import load_window

    b = _passes_trace([True, True], gathers=True, logged=True)
    doc = b.document()
    world = max(groups) if groups else 2
    doc["distributedInfo"] = {"backend": "gloo", "rank": 0, "world_size": world,
                              **({"pg_config": [{"pg_size": n} for n in groups]} if groups else {})}
    path = tmp_path / "rank0.5.pt.trace.json"
    path.write_text(json.dumps(doc))
    w = load_window(path)
    got = [c.phase for c in w.calls if c.collective == "all_gather"][:4]  # step 5: 2 micro-batches
    assert got == phases, got
    assert w.model_groups == (groups != [2, 1])


def test_a_gpu_trace_without_device_events_is_said_and_gets_no_verdict(tmp_path):
    """A GPU run profiled without ProfilerActivity.CUDA: the trace names its GPU (deviceProperties) and holds only
    the host's events. It was read as a CPU run: "host-bound 53%: 53% faster", exit 0 (a new-user trial's A100 trace
    with its device events removed). Now one line says what is missing, and no verdict is given."""
    # (before the events, where Kineto writes it)
    doc = {"deviceProperties": [{"id": 0, "name": "NVIDIA A100-SXM4-80GB", "totalGlobalMem": 85_899_345_920}],
           **gpu_known_trace(rank=0).document()}
    doc["traceEvents"] = [e for e in doc["traceEvents"]
                          if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation")]
    (tmp_path / "rank0.json").write_text(json.dumps(doc))
    rep = build_report(load_run(tmp_path))
    assert rep.verdict is None and "verdict.severe" not in {f.code for f in rep.findings}
    assert any("but hold no device event (kernel, memcpy): the profiler did not record CUDA activity" in p
               for p in rep.problems), rep.problems


# one gloo rank profiled with plain torch.profiler (``plain_one_rank``): a step of FSDP2 training
_PLAIN_ONE_RANK = """
from torch.profiler import ProfilerActivity, profile, record_function, schedule, tensorboard_trace_handler

out = sys.argv[1]
os.makedirs(out)
model = fully_shard(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)


def step():
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    opt.zero_grad()


with profile(activities=[ProfilerActivity.CPU]) as prof:
    with record_function("ProfilerStep#0"):
        step()
        dist.all_reduce(torch.ones(8))
    for _ in range(3):
        dist.all_reduce(torch.ones(8))
prof.export_chrome_trace(os.path.join(out, "one_step.json"))
for name, steps in (("early", 2), ("repeat0", 6)):
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=2),
                 on_trace_ready=tensorboard_trace_handler(os.path.join(out, name))) as prof:
        for _ in range(steps):
            step()
            prof.step()
"""


@pytest.fixture(scope="module")
def plain_one_rank(tmp_path_factory):
    """Plain torch.profiler traces of 1 gloo rank: ``one_step.json``, one ProfilerStep marked by hand (as Kineto's
    on-demand traces mark their one iteration: HTA's reference gloo trace) holding an all-reduce, 3 more after it;
    ``repeat0/`` and ``early/``, schedule(wait=1, warmup=1, active=2) (repeat=0, its default) over loops of 6 and 2
    steps."""
    from conftest import run_one_rank

    out, _ = run_one_rank(tmp_path_factory.mktemp("plain_one_rank"), _PLAIN_ONE_RANK)
    return out


def _profiler_steps(path: Path) -> list[str]:
    return [e["name"] for e in json.loads(path.read_text())["traceEvents"]
            if e.get("name", "").startswith("ProfilerStep")]


def test_a_one_step_windows_calls_per_step_are_those_its_time_holds(plain_one_rank):
    """A window of one ProfilerStep keeps what ran after the step (HTA's reference gloo trace: 2 of its 10 all-reduces
    in the step, "10 calls per step" beside the 2's 178.8 ms). Per step, calls and time are of the same calls now:
    here 1 all-reduce of the 4, and its time."""
    path = plain_one_rank / "one_step.json"
    ev = json.loads(path.read_text())["traceEvents"]
    (step,) = [e for e in ev if e.get("name") == "ProfilerStep#0"]
    gloo = [e for e in ev if e.get("name") == "gloo:all_reduce"]
    inside = [e for e in gloo if step["ts"] <= e["ts"] < step["ts"] + step["dur"]]
    assert len(gloo) == 4 and len(inside) == 1
    ov = analyze_traces(path)
    (row,) = [r for r in ov.per_unit if r.collective == "all_reduce"]
    assert (row.count, row.steps, row.count_per_step) == (4, 1, 1.0)
    assert row.comm_ms_per_step == pytest.approx(inside[0]["dur"] / 1e3, abs=1e-6)  # (ms: to the ns)


def test_the_window_torch_profiler_saves_at_exit_is_a_note_and_exit_0(plain_one_rank, tmp_path, capsys):
    """schedule(..., repeat=0) over a loop that ends as a cycle begins recording: torch.profiler's exit saves one more
    file, its one ProfilerStep (the one the loop's last prof.step() began) empty. It was a skipped input: exit 3, a
    new-user trial's CI check failed on a normal folder. It is a note now, exit 0; beside a really empty file the
    exit is 3, and such a step before its rank's later windows (a rerun into the folder) is no exit's: skipped."""
    import shutil

    from fsdp_doctor import cli

    folder = plain_one_rank / "repeat0"
    steps = {f.name: _profiler_steps(f) for f in folder.iterdir()}
    assert sorted(steps.values()) == [["ProfilerStep#2", "ProfilerStep#3"], ["ProfilerStep#6"]], steps
    last = next(n for n, s in steps.items() if s == ["ProfilerStep#6"])
    rep = build_report(load_run(folder))
    assert rep.overlap.skipped == [] and [f.file for f in rep.overlap.exit_windows] == [last]
    assert rep.problems == [] and (rep.run.trace_files, rep.run.trace_files_unread) == (1, 0)
    assert [n for n in rep.run.notes if last in n] == [
        f"{last}: nothing ran in its profiler step (#6): the window torch.profiler saves at its exit where its "
        "schedule was recording as the loop ended (the step the loop's last prof.step() began); not analysed"]
    assert cli.main(["analyze", str(folder)]) == cli.EXIT_OK
    assert capsys.readouterr().out.count(f"{last}:") == 1

    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    (broken / "empty.pt.trace.json").write_text('{"traceEvents": []}')
    assert cli.main(["analyze", str(broken)]) == cli.EXIT_PARTIAL

    (early,) = (plain_one_rank / "early").iterdir()
    assert _profiler_steps(early) == ["ProfilerStep#2"]  # the 2-step loop's exit window, alone in its folder
    rerun = tmp_path / "rerun"
    shutil.copytree(folder, rerun)
    shutil.copy(early, rerun / early.name)  # before the 6-step loop's window of steps 2-3
    rep = build_report(load_run(rerun))
    assert [(f.file, f.error) for f in rep.overlap.skipped] == [
        (early.name, "nothing ran in its profiler step (#2): no operator, kernel or collective; not analysed")]
    assert [f.file for f in rep.overlap.exit_windows] == [last]
    assert cli.main(["analyze", str(rerun)]) == cli.EXIT_PARTIAL


def _closure_trace(accumulate: int = 1) -> TraceBuilder:
    """A gloo trace shaped as Lightning's Trainer and its PyTorchProfiler write one (µs from T = 10000·i): each
    iteration's ``optimizer.step(closure)`` label [T, T+9000) holds the closure, the forward of units "0" and "1"
    [T+100, T+2300), a logged loss synced over the ranks (an all-reduce at T+2500, 200 µs: ``self.log(...,
    sync_dist=True)``) and the backward [T+3000, T+6000), then AdamW's own work [T+7000, T+8800); the loop's
    DataLoader [T+9200, T+9900) before the next iteration; between the closure and AdamW, Lightning's gradient
    clipping [T+6100, T+6700), its norm's all-reduce at T+6200. The profiler steps after training_step, between the
    loss and the backward: step n runs [T+2800, T+12800). ``accumulate``: the optimizer steps after every that many
    batches (Lightning's accumulate_grad_batches), the other batches' closures run bare; each backward ends with
    FSDP2's root post-backward label and each unit reduce-scatters (no gradient sync switched off)."""
    b = TraceBuilder(rank=0)
    b.pid = b.main_tid = 100
    for i in range(4 if accumulate == 1 else 6):
        T = 10000.0 * i
        if (i + 1) % accumulate == 0:
            b.label("Optimizer.step#AdamW.step", T, 9000)
        b.label("FSDP::root_pre_forward", T + 100, 20)
        # (the forward's units, then the logged loss's all-reduce, then the backward's units)
        for units, t0, every, pre, post in ((("0", "1"), T + 200, 1000, "pre_forward", "post_forward"),
                                             (("1", "0"), T + 3000, 1500, "pre_backward", "post_backward_reduce")):
            for k, unit in enumerate(units):
                t = t0 + every * k
                b.label(f"FSDP::{pre} ({unit})", t, 10)
                b.op("aten::mm", t + 20, every - 100)
                b.label(f"FSDP::{post} ({unit})", t + every - 70, 40)
                if post == "post_backward_reduce":
                    b.op("c10d::_reduce_scatter_base_", t + every - 65, 20)
                    b.gloo("reduce_scatter", t + every - 60, 15)
            if pre == "pre_forward":
                b.op("c10d::allreduce_", T + 2500, 200)
                b.gloo("all_reduce", T + 2510, 150)
        b.label("FSDP::root_post_backward_callback", T + 6000, 50)
        if (i + 1) % accumulate == 0:  # Lightning's gradient clipping, after the closure: the norm's all-reduce
            b.label("[pl][profile][LightningModule]LM.configure_gradient_clipping", T + 6100, 600)
            b.op("aten::linalg_vector_norm", T + 6150, 300)
            b.op("c10d::allreduce_", T + 6200, 100)
            b.gloo("all_reduce", T + 6210, 80)
        if (i + 1) % accumulate == 0:
            b.op("aten::_foreach_add_", T + 7000, 1800)
        b.label("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", T + 9200, 700)
        b.label("[pl][profile]run_training_batch", T - 50, 9030)
        if i < (3 if accumulate == 1 else 4):
            b.step(5 + i, T + 2800, 10000)
    return b


def test_a_closure_step_and_a_profiler_stepping_mid_pass_keep_the_model_and_the_loop_apart(tmp_path):
    """Lightning's Trainer steps AdamW as ``optimizer.step(closure)``: the optimizer's label holds the forward, the
    logged loss's all-reduce and the backward, and its profiler steps between the loss and the backward. A
    new-user trial's trace read the all-reduce as the optimizer's own ("an optimizer that calls full_tensor(), such
    as Muon", on AdamW), and each step's backward, before its first root pre-forward, as time outside the model
    (input 13.5% of the step, host 7.8%: now 6.7% and 14.7%). Known answer, steps 5 and 6: the optimizer's own part
    of its label is [T+5970, T+9000) (after the closure's last FSDP label), the all-reduce is no optimizer's; the
    time outside the model per step is the optimizer's end to the next forward, [T+9000, T+10100), 1100 µs; the
    loop's collectives between optimizer.step() and the next forward: none; the clipping's norm the clipping's, not
    the optimizer's own (Lightning clips inside optimizer.step()). Lightning's profiler labels say whose
    loop it is (WindowTrace.lightning: optim.step_comm then says Lightning's logging, not "your loop")."""
    from fsdp_doctor.trace import load_window

    path = _closure_trace().write(tmp_path / "rank0.5.pt.trace.json.gz")
    w = load_window(path)
    assert w.steps == [5, 6] and w.driver == LIGHTNING_DRIVER, (w.steps, w.driver)  # (its labels: Lightning's profiler's)
    # the logged loss's all-reduce the loop's, the clipping norm's the clipping's, in both steps (the optimizer's
    # before: "an optimizer that gathers whole matrices", on AdamW)
    assert [c.phase for c in w.calls if c.collective == "all_reduce"][:4] == [None, "grad_norm"] * 2
    # outside the model in step 5 [2800, 12800): the optimizer's end (9000) to the next root pre-forward (10100)
    outside = iv.intersect(w.outside, (np.array([2800.0]) + BASE_US, np.array([12800.0]) + BASE_US))
    assert iv.measure(outside) == pytest.approx(1100), outside
    assert w.between_comm_us == 0


def test_profiler_steps_per_batch_under_accumulation_count_the_micro_batches_and_say_the_fix_in_training_step(
        tmp_path):
    """The closure trace with accumulate_grad_batches=2: Lightning's profiler steps once per batch (mid-pass), the
    optimizer every other batch, so the window's 3 complete steps hold 2 optimizer.step() calls (or 1, as the window
    falls): "1.5 profiler steps per optimizer step", and accum.sync_every_micro_batch stayed quiet with each unit
    reduce-scattering every batch (a new-user trial). Counted by the backward passes between two optimizer steps
    (2) over those per profiler step (1), each unit reduce-scatters 2 times per optimizer step; the fix goes into
    training_step (the trace's Lightning labels), made on every FSDP unit the LightningModule holds, which the trace
    does not name; run there with a stand-in Trainer it switches gradient sync off on the odd batches only."""
    import types

    from fsdp_doctor import build_report, load_run

    _closure_trace(accumulate=2).write(tmp_path / "rank0.5.pt.trace.json.gz")
    report = build_report(load_run(tmp_path))
    pr = report.overlap.per_rank["0"]
    assert (pr.backwards_per_step, pr.backwards_per_optimizer_step) == (1.0, 2.0), pr
    (f,) = [f for f in report.findings if f.code == "accum.sync_every_micro_batch"]
    assert f.evidence["reducescatters_per_unit_per_step"] == 2, f.evidence
    rec = f.recommendation
    assert rec.where == "training_step" and "Lightning's profiler steps once per batch" in rec.text, rec
    assert max(map(len, rec.code.splitlines())) <= 80, rec.code

    stand_in = type("FSDPModule", (), {})  # (what the fix's isinstance() reads)

    class Unit(stand_in):
        def __init__(self):
            self.calls = []

        def set_requires_gradient_sync(self, on, recurse=True):
            self.calls.append((on, recurse))

    import torch.distributed.fsdp as fsdp

    units = [Unit(), Unit()]
    for batch_idx in range(4):
        me = types.SimpleNamespace(modules=lambda: iter(units), trainer=types.SimpleNamespace(
            accumulate_grad_batches=2, num_training_batches=4, is_last_batch=batch_idx == 3))
        exec(rec.code.replace("from torch.distributed.fsdp import FSDPModule", ""),
             {"self": me, "batch_idx": batch_idx, "FSDPModule": stand_in})
    assert "from torch.distributed.fsdp import FSDPModule" in rec.code and hasattr(fsdp, "FSDPModule")
    assert units[0].calls == units[1].calls == [(False, False), (True, False), (False, False), (True, False)]


def test_an_evaluation_only_window_beside_training_windows_is_left_out_of_the_training_figures(tmp_path):
    """Lightning's PyTorchProfiler writes a trace for validation_step beside training_step's, on every rank: read as
    one window set, its validation batch was a profiled step ("1 of 2 profiled steps hold no optimizer.step():
    prof.step() called per micro-batch", the training step "7x the other profiled steps": a new-user trial). A window
    whose every complete step ran forwards without a backward or an optimizer step is left out of its rank's
    training figures, said in one note; a rank whose windows all evaluate keeps them."""
    from fsdp_doctor import build_report, load_run

    _closure_trace().write(tmp_path / "run" / "rank0.train.pt.trace.json.gz")
    val = _passes_trace([False])  # steps 5-7, a forward each, no backward, no optimizer
    for i in range(3):  # each unit's all-gather in its pre-forward (FSDP2's, as a validation forward issues them)
        for k, unit in enumerate(("0", "1")):
            t = 20000.0 * i + 600 * k
            val.label(f"FSDP::all_gather ({unit})", t + 11, 3)
            val.op("c10d::_allgather_base_", t + 12, 2, **{"Input Dims": [[200], [100]],
                                                           "Input type": ["float", "float"]})
            val.gloo("all_gather", t + 12, 2)
    for e in val.events:
        e["ts"] += 100_000.0  # (after the training window: another profiler session of the same run)
        if e["name"].startswith("ProfilerStep#"):
            e["name"] = f"ProfilerStep#{int(e['name'][13:]) + 4}"
    val.write(tmp_path / "run" / "rank0.val.pt.trace.json.gz")
    report = build_report(load_run(tmp_path / "run"))
    assert report.overlap.evaluation_windows == {"0": ["rank0.val.pt.trace.json.gz"]}
    pr = report.overlap.per_rank["0"]
    assert pr.steps == [5, 6] and pr.steps_without_optimizer == [] and not pr.nograd_forwards, pr
    notes = [n for n in report.run.notes if "left out of the training figures" in n]
    assert len(notes) == 1 and "rank0.val.pt.trace.json.gz" in notes[0], report.run.notes
    assert not [n for n in report.run.notes if "micro-batches" in n], report.run.notes
    val.write(tmp_path / "alone" / "rank0.val.pt.trace.json.gz")  # evaluation alone: what there is, analysed
    alone = build_report(load_run(tmp_path / "alone"))
    assert alone.overlap.evaluation_windows == {} and alone.overlap.per_rank["0"].steps == [9, 10]


def test_optimizers_stepped_one_after_the_other_are_one_update_when_backward_passes_are_counted():
    """Backward passes per optimizer step are counted between consecutive optimizer.step() calls (build's
    _backwards_counted): two optimizers stepped back to back (Muon beside AdamW, a GAN's two) read 0 backward passes
    between them, and the median of [0, 2, 0] (accumulation 2) was 0, so the count fell back to the profiler
    steps'. Calls with no backward between them are one update: 2."""
    from fsdp_doctor.trace.build import _backwards_counted

    ends = np.array([1.0, 11.0, 21.0, 31.0, 41.0])  # one backward a batch, each ending at these times
    one = iv.union([15.0, 35.0], [16.0, 36.0])  # one optimizer, after every 2nd batch
    two = iv.union([15.0, 16.5, 35.0, 36.5], [16.0, 17.0, 36.0, 37.0])  # two, back to back
    assert _backwards_counted(ends, one, [(0.0, 20.0)]) == (2, 2.0)
    assert _backwards_counted(ends, two, [(0.0, 20.0)]) == (2, 2.0)
    assert _backwards_counted(ends, iv.union([15.0, 16.5], [16.0, 17.0]), [])[1] is None  # (no backward between)
