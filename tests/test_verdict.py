"""The step breakdown and the verdict: known-answer traces (every number derived by hand below) and HTA's
reference traces (checked against HTA 0.5.0's own figures)."""

import json

import pytest
from msgspec.structs import asdict
from trace_fixtures import BASE_US, fsdp_gpu_trace, gloo_known_trace, gpu_known_trace

from fsdp_doctor.analyze.verdict import GROUPS, verdict
from fsdp_doctor.report_sections import Breakdown, OverlapSection
from fsdp_doctor.trace import analyze_traces, breakdown, build_window, find_trace_files, temporal_breakdown
from fsdp_doctor.trace import intervals as iv

from conftest import HTA_TRACES as HTA_DIR  # noqa: E402
EXPECTED = HTA_DIR / "HTA_0.5.0_expected.json"
PARTS = ("compute", "allgather_fwd", "allgather_bwd", "reducescatter", "model_comm", "other_comm", "offload",
         "other_gpu", "host", "sync", "input", "idle")


def _analyze(tmp_path, builders):
    for r, b in enumerate(builders):
        b.write(tmp_path / f"rank{r}.json")
    return analyze_traces(tmp_path)


def _bd(result, rank="0"):
    d = asdict(result.breakdown[rank])
    assert sum(d[k] for k in PARTS) == pytest.approx(d["window_us"], abs=1e-6)  # a partition of the window
    return d


def _check(d, **expected):
    for k in PARTS:
        assert d[k] == pytest.approx(expected.get(k, 0.0), abs=1e-3), (k, d)  # float µs on a 1.7e12 µs clock


# ------------------------------------------------------------------------------------- known answers
def test_known_gpu_trace_breakdown(tmp_path):
    """gpu_known_trace (trace_fixtures.py), per step of 1000 µs, steps 1-2 (the window is [0, 2000)):
    compute [100,400) [500,600) [640,800) [950,990) = 600; exposed AG forward [0,100) = 100; AG backward
    [450,500) = 50; RS [600,640) + [800,900) = 140; H2D alone [900,950) = 50; device idle [400,450): the
    backward all-gather was launched at 422, so [400,422) waits for the host (inside the model: host 22) and
    [422,450) for the launched kernel (idle 28); idle [990,1000): the next step's first launch comes later and
    the host is past the step's last FSDP label (T+800): input 10."""
    d = _bd(_analyze(tmp_path, [gpu_known_trace()]))
    assert d["window_us"] == 2000
    _check(d, compute=1200, allgather_fwd=200, allgather_bwd=100, reducescatter=280, offload=100, host=44,
           input=20, idle=56)


def test_known_gpu_trace_without_prefetch_and_other_collective(tmp_path):
    # without prefetch layers.1's all-gather runs alone [300,400) and its compute shrinks to 20 µs:
    # AG forward 200 per step, compute 520; the gap [420,450) waits for the host until the launch at 422
    d = _bd(_analyze(tmp_path, [gpu_known_trace(prefetch=False)]))
    _check(d, compute=1040, allgather_fwd=400, allgather_bwd=100, reducescatter=280, offload=100, host=4,
           input=20, idle=56)
    # a user all_reduce [990,995) alone: other communication 5 per step, leaving input 5
    d = _bd(_analyze(tmp_path / "x", [gpu_known_trace(extra_unit_events=True)]))
    _check(d, compute=1200, allgather_fwd=200, allgather_bwd=100, reducescatter=280, other_comm=10, offload=100,
           host=44, input=10, idle=56)


def test_known_gloo_trace_breakdown(tmp_path):
    """gloo_known_trace, steps 5-6 (window [0, 20000): the cut is step 7's start). Per step: compute
    mm 1000 + addmm 600 + backward op 600 = 2200; all-gathers exposed: unit 0's synchronous one, its gloo event
    [50,1050) and the main thread inside it, from its c10d op's start (20) to the next operator (mm, 1200) within its
    label's end (1190): 1170; unit 1's: its c10d op and label [2310,2396) and the gloo event to addmm (2400): 90, and
    its copy-out's wait [3000,3400) (the label holds no operator): 400; the reduce-scatter's: the main thread in its
    label [3610,3700) and the gloo event after the backward op [4300,4650): 440; outside the model: [T, T+1)
    before the root pre-forward and [T+3700, T+9000) after the last FSDP label, less the reduce-scatter's exposed
    [4300,4650): 1 + 4350 = 4351 input; the rest, main-thread time between operators outside collectives inside
    the model and the gap between steps: host 1349."""
    d = _bd(_analyze(tmp_path, [gloo_known_trace()]))
    assert d["window_us"] == 20000
    _check(d, compute=4400, allgather_fwd=3320, reducescatter=880, input=8702, host=2698)


def test_known_gloo_trace_collective_wait_is_communication(tmp_path):
    """The main thread blocked in a collective's wait is that collective's communication, not host time, whether or
    not a gloo event covers it: on 4 gloo ranks sharing 2 cores (a new-user trial, FSDP + tensor parallelism) rank 0
    sat 90.7 ms of its 215.6 ms step in tensor parallelism's ``_c10d_functional::wait_tensor``, 89.8 ms of it under
    no gloo event, and read host-bound (66.5% "host (main thread between operators)"). gloo_known_trace(tp_wait):
    per step the functional all-reduce and its wait [2200,2280) are the model's collective (issued inside the
    model), 80 µs, where its gloo event covers 20; the host part loses those 80 µs."""
    d = _bd(_analyze(tmp_path, [gloo_known_trace(tp_wait=True)]))
    assert d["window_us"] == 20000
    _check(d, compute=4400, allgather_fwd=3320, reducescatter=880, model_comm=160, input=8702, host=2538)
    # in collectives, gloo events and the main thread's waits: [20,1190), [2200,2280), [2310,3400), [3610,4650)
    assert d["comm_us"] == pytest.approx(2 * (1170 + 80 + 1090 + 1040))
    v = verdict(_analyze(tmp_path / "v", [gloo_known_trace(tp_wait=True)])).per_rank["0"]
    assert v.device == "cpu" and v.shares_pct["model_comm"] == pytest.approx(0.8)
    assert v.shares_pct["host"] == pytest.approx(12.69)


@pytest.mark.parametrize("kw,parts,bound", [
    # 4 units, no prefetch, all-gather 94 µs then compute 6 µs each: 94% of the step waits for all-gathers
    (dict(units=4, ag_us=94, fwd_us=6), dict(compute=48, allgather_fwd=752), "communication"),
    # prefetched: only the first unit's all-gather (10 µs) is exposed per step of 370 µs
    (dict(units=4, ag_us=10, fwd_us=90, prefetch=True), dict(compute=720, allgather_fwd=20), "compute"),
    # CPU offload: an H2D copy-in of 50 µs on the compute stream before each 10 µs all-gather and 40 µs compute
    (dict(units=4, h2d_us=50, ag_us=10, fwd_us=40), dict(compute=320, allgather_fwd=80, offload=400), "offload"),
    # 48 tiny units, no prefetch: per unit forward AG 20 + compute 10; backward RS 20, next AG 20, compute 20
    (dict(units=48, ag_us=20, fwd_us=10, bwd_us=20, rs_us=20, nelems=65536),
     dict(compute=2880, allgather_fwd=1920, allgather_bwd=1920, reducescatter=1920), "communication"),
    # the host launches one kernel every 50 µs: 8 launches per step of 400 µs, 20 µs of device work each
    # 2 launches; the 4 post-forward labels add 0.04 µs of host time per step
    (dict(units=4, ag_us=10, fwd_us=10, launch_gap_us=50), dict(compute=80, allgather_fwd=80, host=640.08), "host"),
    # a 1000 µs data-loader label before each step of 370 µs
    (dict(units=4, ag_us=10, fwd_us=90, prefetch=True, loader_us=1000), dict(compute=720, allgather_fwd=20,
                                                                            input=2000), "input"),
    # a full step: prefetched forward (400) and backward (800), optimizer 30; exposed: the first forward
    # all-gather 40, the first backward all-gather 40, the last reduce-scatter 50
    (dict(units=4, ag_us=40, fwd_us=100, bwd_us=200, rs_us=50, prefetch=True, opt_us=30),
     dict(compute=2460, allgather_fwd=80, allgather_bwd=80, reducescatter=100), "compute"),
], ids=["ag_94pct_exposed", "compute_dominates", "h2d_on_critical_path", "48_tiny_units", "host_bound",
        "input_bound", "full_step"])
def test_simulated_fsdp_traces(tmp_path, kw, parts, bound):
    result = _analyze(tmp_path, [fsdp_gpu_trace(**kw)])
    d = _bd(result)
    _check(d, **parts)
    v = verdict(result)
    r0 = v.per_rank["0"]
    assert r0.bound == bound and r0.source == "trace" and r0.steps == 2
    assert r0.step_ms == pytest.approx(d["window_us"] / 2 / 1e3, abs=1e-3)
    for k in PARTS:
        assert r0.shares_pct[k] == pytest.approx(100 * parts.get(k, 0.0) / d["window_us"], abs=0.01)
    assert sum(r0.groups_pct.values()) == pytest.approx(100, abs=0.05)


@pytest.mark.parametrize("kw,parts", [
    (dict(units=4, ag_us=40, fwd_us=100, bwd_us=200, rs_us=50, prefetch=True, opt_us=30),
     dict(compute=2460, allgather_fwd=80, allgather_bwd=80, reducescatter=100)),
    (dict(units=4, ag_us=10, fwd_us=90, prefetch=True), dict(compute=720, allgather_fwd=20)),
    (dict(units=4, ag_us=94, fwd_us=6), dict(compute=48, allgather_fwd=752)),
], ids=["full_step", "compute_dominates", "ag_94pct_exposed"])
def test_a_host_running_ahead_of_the_device(tmp_path, kw, parts):
    """A loop without a sync: the host runs 300 µs ahead of a device-bound step, so when the profiler's first active
    step starts the device is still running the warm-up step's work (no launch of it in the trace). The window
    follows the device (it moves by the lag): the same parts as the same steps without the lag, where the earlier
    work's time read as the device idle and the end of the window's own work was cut off (the H100 fixture: 'idle-
    bound 71%', its reduce-scatters 0 ms, where the device ran NCCL kernels 97% of the window)."""
    result = _analyze(tmp_path, [fsdp_gpu_trace(host_ahead_us=300.0, **kw)])
    _check(_bd(result), **parts)
    assert result.per_rank["0"].device_lag_ms == pytest.approx(0.3)
    same = _analyze(tmp_path / "synced", [fsdp_gpu_trace(**kw)])
    assert same.per_rank["0"].device_lag_ms is None and _bd(same) == _bd(result)
    from fsdp_doctor.pipeline import comm_summary

    assert comm_summary(result).source_text == "profiler trace, steps 1–2"  # under LAG_SAID_MS: not said


def test_ag_94pct_exposed_verdict_text(tmp_path):
    v = verdict(_analyze(tmp_path, [fsdp_gpu_trace(units=4, ag_us=94, fwd_us=6)]))
    r0 = v.per_rank["0"]
    assert r0.shares_pct["allgather_fwd"] == 94.0 and r0.groups_pct["communication"] == 94.0
    # the one exposed collective named (an HSDP 2x1 mesh read "communication-bound (51% of the step)", naming none of
    # its parts: a new-user trial); a group's namesake part alone is not ("compute-bound (90%: compute 90%)")
    assert r0.summary == "communication-bound (94% of the step: exposed all-gather (forward) 94%); then compute 6%"
    busy = verdict(_analyze(tmp_path, [fsdp_gpu_trace(units=4, ag_us=6, fwd_us=94, prefetch=True)])).per_rank["0"]
    assert busy.summary.startswith("compute-bound (") and ": compute" not in busy.summary, busy.summary


def test_job_verdict_over_ranks(tmp_path):
    # rank 0 waits for all-gathers, rank 1 computes: the job sums both ranks' time
    result = _analyze(tmp_path, [fsdp_gpu_trace(units=4, ag_us=94, fwd_us=6, rank=0),
                                 fsdp_gpu_trace(units=4, ag_us=10, fwd_us=90, prefetch=True, rank=1)])
    v = verdict(result)
    assert v.per_rank["0"].bound == "communication" and v.per_rank["1"].bound == "compute"
    assert v.job.ranks_by_bound == {"communication": [0], "compute": [1]}
    # (752 + 20) / (800 + 740) all-gather, (48 + 720) / 1540 compute
    assert v.job.shares_pct["allgather_fwd"] == pytest.approx(100 * 772 / 1540, abs=0.01)
    assert v.job.bound == "communication"


def test_no_data_no_verdict():
    assert verdict(None) is None
    assert verdict(OverlapSection.of({"breakdown": {"0": {"window_us": 0.0}}})) is None


def test_one_list_of_breakdown_parts():
    """The analysis, the verdict and the report's Breakdown name the same parts; each group holds its own."""
    from fsdp_doctor.trace.analysis import BREAKDOWN_PARTS, COMM_PARTS

    assert BREAKDOWN_PARTS == Breakdown.PARTS == PARTS
    assert set(COMM_PARTS) < set(PARTS) and GROUPS["communication"] == COMM_PARTS
    assert sorted(k for ks in GROUPS.values() for k in ks) == sorted(PARTS)


def test_step_start_times_are_the_steps_own(recorded_run):
    """Each recorded step starts where it starts: its start plus its wall time never runs past the next step's start,
    the step that exported the profiler window (step 8) included (its start used to be stamped after the export,
    which its wall time counts, so TensorBoard drew it after step 9)."""
    run, _, _ = recorded_run
    for rd in run.ranks.values():
        steps = sorted(rd.steps, key=lambda s: s.step)
        for a, b in zip(steps, steps[1:]):
            assert a.start_ns + a.wall_ms * 1e6 <= b.start_ns + 2e6, (a.step, a.start_ns, a.wall_ms, b.start_ns)


def test_verdict_from_records_of_a_real_run(recorded_run):
    """The recorded 2-rank gloo run has one profiler window (its trace gives ranks a trace verdict); without
    the trace, the step records give one: its parts add up to the step and its input share is the recorded
    time outside the model."""
    from fsdp_doctor.analyze.steps import usable_steps

    run, _, _ = recorded_run
    v = verdict(None, run)
    assert set(v.per_rank) == {"0", "1"}
    for r, rv in v.per_rank.items():
        assert rv.source == "records"
        steps = usable_steps(run.ranks[int(r)].steps)
        # the expectation from the same records, by the verdict's definition: a step's parts are its all-gather
        # waits, GC, time outside the model and the rest; where GC ran outside the model (counted in both) the
        # step counts as their sum. Exact whatever the machine's load did to the timings (rounding: 0.01 point).
        total = sum(max(s.wall_ms, sum(u.ag_wait_fwd_ms + u.ag_wait_bwd_ms for u in s.units) + s.gc_ms + s.outside_ms)
                    for s in steps)
        assert rv.shares_pct["input"] == pytest.approx(100 * sum(s.outside_ms for s in steps) / total, abs=0.006)
        assert rv.step_ms == pytest.approx(total / len(steps), abs=1e-3)
        assert sum(rv.shares_pct.values()) == pytest.approx(100, abs=0.05)


def test_a_straggler_is_read_on_its_own_step(tmp_path):
    """Rank 1 of 2 sleeps 150 ms before each forward (a new-user trial planted it on rank 2 of 4): rank 0 waits for it
    in its first all-gather, the root's. That wait is rank 1's lateness, not the all-gathers' cost: the job's verdict
    is rank 1's own step (it waits for no one) and the rules that quote all-gather waits read rank 1's, saying so
    (measured on this run before: "communication-bound (51% of the step: exposed all-gather (forward) 31%, ...)", the
    root's forward wait 76.9 ms, the host blocked 185.3 ms a step in all-gathers; read on rank 1: "input-bound (46% of
    the step) ...", 1.97 ms, 76.1 ms)."""
    import statistics

    from conftest import record

    from fsdp_doctor import ProfileSchedule
    from fsdp_doctor.analyze import build_report
    from fsdp_doctor.analyze.steps import usable_steps

    _, run = record(tmp_path, steps=14, wrap="blocks_only", sleep_rank=1, sleep_ms=150.0,
                    watch_extra={"profile": ProfileSchedule(first=6, active=2, warmup=1, every=0)})
    rep = build_report(run)
    (late,) = rep.steps.stragglers
    assert late.rank == 1 and late.phase == "outside" and late.excess_ms_per_step > 100  # the 150 ms sleep
    read = (f"read on rank 1, the straggler (the other ranks' waits for it, +{late.excess_ms_per_step:.2f} ms a step, "
            "are straggler.rank's)")
    v = rep.verdict
    assert v.per_rank["0"].source == v.per_rank["1"].source == "trace"
    # rank 0's forward all-gathers hold its wait for rank 1; the job is rank 1's own step, and says so
    assert v.per_rank["0"].shares_pct["allgather_fwd"] > v.per_rank["1"].shares_pct["allgather_fwd"]
    assert v.job.shares_pct == v.per_rank["1"].shares_pct and v.job.bound == v.per_rank["1"].bound
    assert v.job.summary == v.per_rank["1"].summary + "; " + read, v.job.summary
    from fsdp_doctor.present.fmt import verdict_rows

    assert v.job.read_on == 1 and verdict_rows(v)[-1][:2] == ("job", f"{v.per_rank['1'].bound} (rank 1)")
    # the root's forward all-gather wait, per step: rank 0 waits out the sleep, rank 1 hardly (its median is quoted)
    root = {r: statistics.median(u.ag_wait_fwd_ms for s in usable_steps(run.ranks[r].steps) for u in s.units
                                 if u.name == "") for r in (0, 1)}
    assert root[0] > 100 and root[1] < root[0] / 2, root
    by_code = {f.code: f for f in rep.findings}
    wrap = by_code["wrap.params_in_root"].evidence
    assert wrap["root_ag_wait_fwd_ms"] == pytest.approx(root[1], abs=1e-3) and wrap["read_on_straggler"] == 1
    # the synchronous unshard's host blocking: rank 1's trace (rank 0's holds the wait for rank 1)
    sync = by_code["prefetch.sync_unshard"]
    pr = rep.overlap.per_rank
    blocking = {r: b.us / max(1, pr[r].step_count or len(pr[r].steps)) / 1e3 for r, b in rep.overlap.blocking.items()}
    assert sync.evidence["read_on_straggler"] == 1 and read in sync.recommendation.text
    assert sync.evidence["blocking_ms_per_step"] == pytest.approx(blocking["1"], abs=1e-3) and \
        blocking["0"] > blocking["1"], blocking
    # the exposed all-gathers: rank 1's steps, fired (a loaded host stretches its gloo waits) or quiet, saying so
    ag = next(s for s in rep.rules if s.code == "prefetch.exposed_allgather")
    if ag.status == "fired":
        f = by_code["prefetch.exposed_allgather"]
        assert f.evidence["read_on_straggler"] == 1 and f", {read}: " in f.recommendation.text
        assert "straggler rank(s)" not in f.recommendation.text  # (the old note beside the waits for it)
    else:
        assert ag.status == "quiet" and ag.reason.endswith("; " + read), ag


# ------------------------------------------------------------------------------------- HTA references
def _hta_cases():
    if not EXPECTED.exists():
        return []
    res = json.loads(EXPECTED.read_text())["results"]
    return [(f, e) for f, e in sorted(res.items())
            if f in ("a100_rank3_of_8", "a100_sendrecv_16rank_rank0", "a100_sendrecv_2rank", "v100_allreduce_rank1",
                     "v100_rank1_of_2")]


@pytest.mark.skipif(not EXPECTED.exists(), reason="reference traces not found")
@pytest.mark.parametrize("folder,expected", _hta_cases(), ids=[c[0] for c in _hta_cases()])
def test_breakdown_over_htas_window_matches_htas_figures(folder, expected, monkeypatch):
    """Over HTA's window (first to last device event), our partition gives HTA's numbers: compute = HTA's
    compute time; host + input + idle = HTA's idle time; exposed communication + offload + other device work
    = HTA's non-compute time; and exposed communication = communication × (1 - HTA's overlap %). Over HTA's event
    set: the device events whose launch the trace holds (ours also keeps those without one that run inside the
    window, build.KEEP_LAUNCHLESS: test_launchless_device_work_inside_the_window_is_counted)."""
    from fsdp_doctor.trace import build as B

    monkeypatch.setattr(B, "KEEP_LAUNCHLESS", False)
    monkeypatch.setattr(B, "HTA_LAST_STEP", True)
    for path in find_trace_files(HTA_DIR / folder):
        w = build_window(path)
        busy = w.gpu_busy
        d = breakdown(w, window=(float(busy[0][0]), float(busy[1][-1])))
        hta = expected["temporal_breakdown"][str(w.rank)]
        assert d["compute"] == pytest.approx(hta["compute_time(us)"], abs=1e-6)
        assert d["host"] + d["sync"] + d["input"] + d["idle"] == pytest.approx(hta["idle_time(us)"], abs=1e-6)
        comm = sum(d[k] for k in ("allgather_fwd", "allgather_bwd", "reducescatter", "model_comm", "other_comm"))
        assert comm + d["offload"] + d["other_gpu"] == pytest.approx(hta["non_compute_time(us)"], abs=1e-6)
        pct = expected["comm_comp_overlap_pct"][str(w.rank)]
        comm_total = sum(e - s for s, e in zip(*w.comm))
        assert comm == pytest.approx(comm_total * (1 - pct / 100), rel=0.005, abs=1.0)
        assert temporal_breakdown(w)["kernel_us"] == d["window_us"]


@pytest.mark.skipif(not EXPECTED.exists(), reason="reference traces not found")
def test_launchless_device_work_inside_the_window_is_counted():
    """HTA's 16-rank A100 send/recv trace holds 705 kernels whose launch it does not (CUPTI lost their runtime
    records; one a 23.8 ms send/recv launched before the window): run inside the complete steps, they are its device
    work. Known answer, by hand from the JSON (a new-user trial): the NCCL kernels' union over the steps, shifted by
    the device's lag, is 33.3 ms a step over steps 550-553, where 27.1 read before, the rest as device idle; 32.9 ms
    over 550-554 (its last step kept: torch.profiler's cudaDeviceSynchronize follows its last launch, the window
    [first step's start, last step's end] moved by the lag, 3.2 ms)."""
    (path,) = find_trace_files(HTA_DIR / "a100_sendrecv_16rank_rank0")
    w = build_window(path)
    steps = len(w.steps)
    inside = iv.intersect(w.comm, iv.as_intervals([w.window[0]], [w.window[1]]))
    assert (w.steps, round(w.device_lag_us)) == ([550, 551, 552, 553, 554], 3223)
    assert iv.measure(inside) / steps / 1e3 == pytest.approx(32.88, abs=0.05)


@pytest.mark.skipif(not EXPECTED.exists(), reason="reference traces not found")
def test_verdict_on_reference_traces_is_sensible(tmp_path):
    """Over the complete steps: v100_rank1_of_2 (HTA: 68% compute, 7.5% idle over its kernel span) is
    compute-bound; the DDP trace (HTA: 78% idle) has a GPU that mostly waits for the host; each verdict's
    shares add up to 100% of the steps' wall time."""
    v = verdict(analyze_traces(HTA_DIR / "v100_rank1_of_2")).per_rank["1"]
    assert v.bound == "compute" and 60 < v.groups_pct["compute"] < 85
    v = verdict(analyze_traces(HTA_DIR / "a100_ddp_allreduce_rank0")).per_rank["0"]
    assert v.bound == "host" and v.groups_pct["host"] + v.groups_pct["idle"] > 70
    for folder in ("a100_sendrecv_2rank", "a100_rank3_of_8", "cpu_only_gloo", "amd_mi250"):
        for rv in verdict(analyze_traces(HTA_DIR / folder)).per_rank.values():
            assert sum(rv.groups_pct.values()) == pytest.approx(100, abs=0.05)


def test_host_in_a_device_sync_is_named_as_such(tmp_path):
    """The GPU idle while the host sits in cudaDeviceSynchronize (after the step's last FSDP label, so outside the
    model) is ``sync``, not input: in step 1 the host syncs over [985, 999) while the device is idle from 990 (its
    last kernel ends) to 1000 (the next step's first kernel): 9 µs move from input to sync, the rest unchanged."""
    plain = gpu_known_trace()
    synced = gpu_known_trace()
    synced.x("cudaDeviceSynchronize", 985.0, 14.0, cat="cuda_runtime")
    plain.write(tmp_path / "plain.json")
    synced.write(tmp_path / "synced.json")
    a, b = breakdown(build_window(tmp_path / "plain.json")), breakdown(build_window(tmp_path / "synced.json"))
    assert a["sync"] == 0.0 and b["sync"] == pytest.approx(9.0)
    assert b["input"] == pytest.approx(a["input"] - 9.0)
    assert all(b[k] == pytest.approx(a[k]) for k in PARTS if k not in ("sync", "input"))
    v = verdict(analyze_traces(tmp_path / "synced.json")).per_rank["0"]
    assert v.shares_pct["sync"] == pytest.approx(100 * 9.0 / b["window_us"], abs=0.01)
    assert v.groups_pct["host"] == pytest.approx(v.shares_pct["host"] + v.shares_pct["sync"], abs=0.011)


def test_hsdp_gradient_reduction_is_named_with_its_all_reduce(tmp_path):
    """HSDP's all-reduce across replicas is counted in the units' gradient reduction (the reducescatter part): the
    verdict names both where an FSDP unit all-reduces (a new-user trial's 2 x 2 HSDP run read "exposed
    reduce-scatter 19%" while its largest exposed collective was the replicas' all-reduce)."""
    from fsdp_doctor.analyze.verdict import HSDP_REDUCE_LABEL
    from fsdp_doctor.report_sections import CommUnitRow

    result = _analyze(tmp_path, [fsdp_gpu_trace(units=4, ag_us=10, fwd_us=40, bwd_us=40, rs_us=300)])
    assert "exposed reduce-scatter" in verdict(result).job.summary
    result.per_unit.append(CommUnitRow(rank=0, unit="layers.3", collective="all_reduce", phase="backward", count=1,
                                       comm_us=100.0, exposed_us=100.0))
    v = verdict(result)
    assert HSDP_REDUCE_LABEL in v.job.summary and "exposed reduce-scatter" not in v.job.summary, v.job.summary
    assert HSDP_REDUCE_LABEL in v.per_rank["0"].summary


def _sample_copy(sample_run_path, tmp_path):
    import shutil

    dst = tmp_path / "run"
    shutil.copytree(sample_run_path, dst, ignore=shutil.ignore_patterns("report.json", "tb"))
    return dst


def test_a_rank_whose_trace_is_unreadable_does_not_dilute_the_jobs_verdict(sample_run_path, tmp_path):
    """A new-user trial truncated one rank's trace in a watch() folder: that rank's verdict row came from its records
    (which cannot tell communication from compute) and the job's exposed reduce-scatter fell from 6% to 0.3%. The
    job's verdict is the traced ranks' now, and says so."""
    import fsdp_doctor

    run = _sample_copy(sample_run_path, tmp_path)
    whole = fsdp_doctor.build_report(fsdp_doctor.load_run(run)).verdict
    g = run / "profiler" / "rank0.6.pt.trace.json.gz"
    g.write_bytes(g.read_bytes()[: g.stat().st_size // 2])
    v = fsdp_doctor.build_report(fsdp_doctor.load_run(run)).verdict
    assert v.per_rank["0"].source == "records" and v.per_rank["1"].source == "trace"
    assert v.job.source == "trace" and v.job.shares_pct == v.per_rank["1"].shares_pct
    assert v.job.summary.endswith("(from the traces of rank 1; the others' from their records)"), v.job.summary
    assert whole.job.source == "trace" and "from the traces of" not in whole.job.summary


def test_a_checkpoint_save_in_the_profiler_window_is_said_and_its_collectives_are_not_the_loops(sample_run_path,
                                                                                                 tmp_path):
    """A new-user trial's torchtitan run saved a checkpoint inside the doctor's profiler window: the verdict read
    "input-bound (35%)" without a word of the save, and optim.step_comm called the save's collectives a
    gradient-norm log, predicting a step of -785 ms. The verdict says the window's save is in its shares
    (optim.step_comm's side: tests/test_diagnose_rules.py), and no prediction is of a step below zero."""
    import json

    import fsdp_doctor
    from fsdp_doctor.diagnose import estimate as E

    run = _sample_copy(sample_run_path, tmp_path)
    for r in (0, 1):
        p = run / f"rank{r}.records.jsonl"
        lines = []
        for ln in p.read_text().splitlines():
            d = json.loads(ln)
            if d.get("t") == "step" and d.get("profiled"):
                d.update(checkpoints=1, checkpoint_ms=50.0)
            lines.append(json.dumps(d))
        p.write_text("\n".join(lines) + "\n")
    loaded = fsdp_doctor.load_run(run)
    saved = sorted({s.step for s in loaded.ranks[0].steps if s.profiled and s.checkpoints})
    assert saved
    report = fsdp_doctor.build_report(loaded)
    assert "saved a checkpoint: the save is in these shares" in report.verdict.job.summary
    assert E.predicted(491.7, -785.3).step_ms_after is None and E.predicted(491.7, 117.6).step_ms_after == 117.6


def test_a_window_on_the_first_step_says_so(sample_run_path):
    """A profiler window from step 0 (ProfileSchedule(first=0)) on a model compiled in place read "compute-bound (97%
    of the step)" from its compilation, which no later step does, unsaid (a new-user trial): the verdict says its
    window holds the first step. The sample run's window (step 6) says nothing of it."""
    import copy

    import fsdp_doctor
    from fsdp_doctor.analyze.verdict import verdict

    run = fsdp_doctor.load_run(sample_run_path)
    rep = fsdp_doctor.build_report(run)
    assert "holds step 0" not in rep.verdict.job.summary
    ov = copy.deepcopy(rep.overlap)
    for pr in ov.per_rank.values():
        pr.steps = [0]
    assert verdict(ov, run).job.summary.endswith(
        " (the profiler window holds step 0, the first: FSDP's lazy initialization and any torch.compile compilation "
        "run in it, as in no later step)")


def test_the_records_verdict_counts_another_models_work_as_compute(sample_run_path):
    """A nested watch() of a distillation's teacher: the student's step, between the teacher's, read as 72% input
    (a new-user trial). Another FSDP model's forward and backward in the step (StepRecord.other_models_ms) is model
    work: compute, not input."""
    import msgspec

    from fsdp_doctor.analyze.verdict import verdict
    from fsdp_doctor.store import load_run

    run = load_run(sample_run_path)
    before = verdict(None, run).job.groups_pct
    for rd in run.ranks.values():
        rd.steps = [msgspec.structs.replace(s, outside_ms=s.outside_ms + 300.0, wall_ms=s.wall_ms + 300.0,
                                            other_models_ms=300.0) for s in rd.steps]
    after = verdict(None, run).job
    assert after.bound == "compute" and after.groups_pct["input"] <= before["input"] + 0.1, (before, after.groups_pct)


def test_a_model_without_a_backward_of_its_own_says_the_reduce_scatter_is_another_models(sample_run_path):
    """A frozen teacher watched with its student's optimizer (the teacher runs under torch.no_grad) read
    "communication-bound (56% of the step: exposed reduce-scatter 26%, ...)": the student's reduce-scatters, whose
    units FSDP's trace labels name as the teacher's (a new-user trial). Where the records show no backward of the
    watched model in any step, the verdict says the trace's reduce-scatter and backward are another model's. The
    sample run (its own backward) says nothing of it."""
    import msgspec

    import fsdp_doctor
    from fsdp_doctor.analyze.verdict import verdict

    run = fsdp_doctor.load_run(sample_run_path)
    rep = fsdp_doctor.build_report(run)
    said = ("(the watched model ran no backward in its steps and reduce-scatters no gradients: the forward and "
            "backward of another FSDP model run in its steps are in these shares, the reduce-scatter and the "
            "backward's all-gathers all of them; watch that model for its own bound)")
    assert rep.verdict.job.shares_pct["reducescatter"] > 0 and said not in rep.verdict.job.summary
    for rd in run.ranks.values():
        rd.steps = [msgspec.structs.replace(s, backward_ms=0.0, backwards=0, units=[
            msgspec.structs.replace(u, bwd_ms=0.0, ag_wait_bwd_ms=0.0) for u in s.units]) for s in rd.steps]
    assert verdict(rep.overlap, run).job.summary.endswith(said)


def test_which_profiled_steps_are_unlike_the_others():
    """A step twice the median of its rank's other profiled steps or more is unlike them; none where as many are so
    as not (nothing typical to compare with), nor under two steps."""
    from fsdp_doctor.trace.analysis import ATYPICAL_STEP_FACTOR, atypical_steps

    assert ATYPICAL_STEP_FACTOR == 2.0
    assert atypical_steps({1: 10.0, 2: 19.9}) == [] and atypical_steps({1: 10.0, 2: 20.0}) == [2]
    assert atypical_steps({1: 10.0, 2: 25.0, 3: 26.0}) == []  # 1.4x and 1.5x the others' median
    assert atypical_steps({1: 10.0, 2: 30.0, 3: 31.0, 4: 10.0}) == [2, 3]
    assert atypical_steps({1: 10.0, 2: 30.0, 3: 31.0}) == [] and atypical_steps({7: 500.0}) == []


def _stretched(tmp_path, steps, gap_us):
    """gloo_known_trace's steps with ``gap_us`` of nothing added at the end of its second step."""
    b = gloo_known_trace(steps=steps)
    for e in b.events:
        if e["ts"] >= BASE_US + 20000:
            e["ts"] += gap_us
    tmp_path.mkdir()
    b.write(tmp_path / "rank0.json")
    return analyze_traces(tmp_path)


def test_a_profiled_step_unlike_the_others_is_said_with_the_verdict_without_it(tmp_path):
    """A verdict read off a window whose one step was unlike the others (a GC pause, a stalled loader: profiled
    steps 5, 6, 7 of 10, 30 and 10 ms, step 6 holding 20 ms of nothing) said nothing of it: its bound was the
    pause's. The shares keep it (the report's other per-step figures do), and the verdict says which step, how far
    from the others, where its extra time went, and what the shares read without it: the known answer, the verdict
    of the same trace's steps 5 and 6 with no gap."""
    odd = _stretched(tmp_path / "odd", (5, 6, 7), 20000.0)
    plain = _stretched(tmp_path / "plain", (5, 6), 0.0)
    pr = odd.per_rank["0"]
    assert pr.step_times_ms == {"5": 10.0, "6": 30.0, "7": 10.0} and list(pr.atypical_steps) == ["6"]
    assert sum(pr.atypical_steps["6"].values()) == pytest.approx(30.0, abs=1e-3)  # its parts tile its span
    assert plain.per_rank["0"].atypical_steps == {}
    want = verdict(plain).per_rank["0"]
    assert want.summary.startswith("input-bound (44% of the step)") and "profiled step" not in want.summary
    got = verdict(odd)
    assert got.per_rank["0"].summary.startswith("host-bound (48% of the step)")
    assert got.per_rank["0"].summary.endswith(
        "; profiled step 6 took 3.0x the other profiled steps (30.0 ms against 10.0 ms), most of the extra time host "
        "(main thread outside operators and collectives): without it, input-bound (44% of the step)")
    assert got.job.summary.endswith("without it, input-bound (44% of the step)")  # one rank: its ranks unnamed
    assert "on rank" not in got.job.summary


@pytest.mark.long
def test_a_real_stall_in_one_profiled_step_is_said(tmp_path):
    """A real 2-rank gloo run watched with a profiler window of steps 6-8, rank 0 stalling 400 ms before step 7's
    forward (a loader hiccup): step 7 is unlike the others on both ranks, rank 0's extra time outside the model and
    rank 1's in the forward all-gather waiting for it, and the verdicts say what the shares read without it."""
    from fsdp_doctor import build_report, load_run
    from fsdp_doctor.record.profiling import ProfileSchedule
    from fsdp_doctor.workloads import WorkloadConfig, launch

    cfg = WorkloadConfig(steps=10, d_model=64, n_layers=2, seq_len=32, sleep_rank=0, sleep_ms=400.0, sleep_steps=[7])
    launch(cfg, nproc=2, watch_kwargs={"out_dir": str(tmp_path), "profile": ProfileSchedule(first=6, active=3,
                                                                                             warmup=1, every=0)},
           timeout_s=300)
    rep = build_report(load_run(tmp_path))
    for r, part in (("0", "input / outside the model"), ("1", "exposed all-gather (forward)")):
        assert list(rep.overlap.per_rank[r].atypical_steps) == ["7"], rep.overlap.per_rank[r].step_times_ms
        said = rep.verdict.per_rank[r].summary.split("; profiled step 7 took ", 1)[1]
        assert f", most of the extra time {part}: without it, " in said, said
        assert not said.split("without it, ")[1].startswith("input-bound"), said
    assert "; profiled step 7 took " in rep.verdict.job.summary and " on ranks 0, 1, " in rep.verdict.job.summary


def test_profiled_steps_far_slower_than_the_steady_ones_say_the_profilers_cost(sample_run_path):
    """A new-user trial's Mamba (the selective scan's reference PyTorch path on CPU, 62,000 operators a step): its
    profiled steps took 16.6 s against 936 ms steady ones, the profiler's cost per operator, and a rank it slowed
    more kept the other waiting: "compute-bound (76%); then exposed reduce-scatter 23%" read off the window, unsaid.
    Where every traced rank's profiled steps take PROFILED_SLOW_FACTOR times its steady median or more, the verdict
    says so, with the records' split of the steady steps (the known answer: the records' verdict of the same run).
    The sample run's window (about its steady steps) says nothing of it."""
    import copy
    import statistics

    import fsdp_doctor
    from fsdp_doctor.analyze.steps import usable_steps
    from fsdp_doctor.analyze.verdict import PROFILED_SLOW_FACTOR, verdict

    run = fsdp_doctor.load_run(sample_run_path)
    rep = fsdp_doctor.build_report(run)
    steady = {r: statistics.median(s.wall_ms for s in usable_steps(rd.steps)) for r, rd in run.ranks.items()}
    assert all(rep.overlap.per_rank[str(r)].step_ms < PROFILED_SLOW_FACTOR * ms for r, ms in steady.items())
    assert "the profiled steps ran" not in rep.verdict.job.summary
    ov = copy.deepcopy(rep.overlap)
    for r, ms in steady.items():
        pr = ov.per_rank[str(r)]
        pr.step_ms = ms * (17.7 if r == 0 else 16.0)
        pr.step_times_ms = {st: pr.step_ms for st in pr.step_times_ms}
    got = verdict(ov, run).job.summary
    records = verdict(None, run).job.summary
    lead = (f"; the profiled steps ran 16.0-17.7x the steady steps ({fsdp_doctor.units.fmt_ms(steady[0] * 17.7)} "
            f"against {fsdp_doctor.units.fmt_ms(steady[0])} on rank 0): the profiler's own cost per operator is in "
            "these shares, and a rank it slowed more than another makes that one wait in their collectives")
    assert got.endswith(lead + "; the records' split of the steady steps: " + records), got
    assert got.startswith(rep.verdict.job.summary)  # (the trace's shares kept, as the table's)
    # a profiled step slower than the other, in that slow window: the window's own reading is set aside whole, and
    # the atypical step's clause with it (both stood in the Mamba's verdict)
    pr = ov.per_rank["0"]
    first = min(pr.step_times_ms, key=int)
    pr.step_times_ms = {**pr.step_times_ms, first: pr.step_times_ms[first] * 3}
    pr.atypical_steps = {first: {"compute": pr.step_times_ms[first]}}
    alone = verdict(ov, run).job.summary
    assert "; profiled step" not in alone and alone.endswith(lead + "; the records' split of the steady steps: "
                                                             + records), alone
    # one rank under the factor: its window is its steps, and nothing is said
    ov.per_rank["1"].step_ms = steady[1] * 1.5
    ov.per_rank["1"].step_times_ms = {st: steady[1] * 1.5 for st in ov.per_rank["1"].step_times_ms}
    assert "the profiled steps ran" not in verdict(ov, run).job.summary


def test_a_recorded_window_twice_the_steady_steps_says_so():
    """A real recorded run whose profiled steps took 2.8x its steady ones (torchtune's full-finetune recipe with
    gradient accumulation on 2 gloo ranks, profiled with shapes and memory: 371.0 ms against 134.0 ms): the verdict
    says so, and its records' split, which reads the steady steps compute-bound where the window read communication."""
    import fsdp_doctor
    from conftest import REPO

    run = fsdp_doctor.load_run(REPO / "traces" / "cpu" / "torchtune_recipe_accumulate")
    s = fsdp_doctor.build_report(run).verdict.job.summary
    assert s.startswith("communication-bound"), s
    assert "; the profiled steps ran 2.8x the steady steps (371.0 ms against 134.0 ms on rank 0)" in s, s
    assert "; the records' split of the steady steps: compute-bound (" in s, s


def test_an_offloaded_host_bound_step_says_the_host_is_the_optimizer():
    """The recorded H100 runs with CPUOffloadPolicy (2 NCCL ranks, AdamW foreach on the host's shards) read
    "host-bound (58% of the step)", whose levers are Python and operator dispatch, where most of that time is the
    optimizer stepping the offloaded shards on the CPU (86.4 ms of the 170.5 ms step): the verdict says it. A GPU run
    bound by its launches (no offload) says nothing of the kind."""
    import fsdp_doctor
    from conftest import REPO

    said = "(the host's time is mostly the optimizer's step on the CPU, over the shards CPU offload keeps there: "
    for name, ms in (("gpu_gpt_offload", "86.4 ms of the 170.5 ms step)"),
                     ("gpu_gpt_offload_unpinned", "65.3 ms of the 174.6 ms step)")):
        job = fsdp_doctor.build_report(fsdp_doctor.load_run(REPO / "traces" / "gpu" / "scenarios" / name)).verdict.job
        assert job.bound == "host" and job.summary.endswith(said + ms), (name, job.summary)
    launch = REPO / "traces" / "gpu" / "scenarios" / "gpu_gpt_tiny_launch_bound"
    job = fsdp_doctor.build_report(fsdp_doctor.load_run(launch)).verdict.job
    assert job.bound == "host" and "optimizer" not in job.summary, job.summary
