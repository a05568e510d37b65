"""Recorded GPU runs read on the CPU (issue #22, item 4): the GPU campaign's 2-rank H100 fixture and its scenario
matrix GPU rows, copied into ``traces/gpu/`` by ``benchmarks/gpu_campaign.py --adopt --out FOLDER``. The analysis,
the diagnosis and the dashboard then run on real GPU records in every CI run, which has no GPU.

Skipped until a session with the GPU machine records and commits them (what is asserted is what the rows expect:
tests/scenario_matrix.py ``GPU_ROWS``)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import scenario_matrix as M  # noqa: E402

GPU = REPO / "traces" / "gpu"
FIXTURE = GPU / "fixture"
recorded = pytest.mark.skipif(not (FIXTURE / "manifest.json").exists(),
                              reason="traces/gpu/ not recorded yet: benchmarks/gpu_campaign.py on the GPU machine, "
                                     "then --adopt")


@pytest.fixture(scope="module")
def fixture_run():
    from fsdp_doctor import load_run
    from fsdp_doctor.pipeline import build_report

    run = load_run(FIXTURE)
    return run, build_report(run)


@recorded
def test_the_gpu_fixture_is_two_nccl_ranks_on_cuda_with_device_times(fixture_run):
    run, report = fixture_run
    assert sorted(run.ranks) == [0, 1]
    for rd in run.ranks.values():
        assert rd.config.device.startswith("cuda") and rd.config.backend == "nccl"
        assert rd.profiles, "one profiler window"
        assert rd.gpu, "device times from CUDA events, read a step later"
        steps = [s for s in rd.steps if s.memory and s.memory.peak]
        assert steps and all(s.memory.device.startswith("cuda") for s in steps)
        assert all(s.memory.cuda is not None and s.memory.cuda.max_allocated for s in steps)
    assert report.memory.peak_bytes > 0 and report.overlap is not None


@recorded
def test_the_gpu_fixtures_window_follows_the_device_that_runs_behind_its_host(fixture_run):
    """The demo's loop reads no loss per step, so its host runs ahead: when the profiler's active step 6 starts on
    the host, each device still has 184 ms (rank 0) and 204 ms (rank 1) of the warm-up step's NCCL work to run, and
    step 6's own work ends that much after the host's step. Read over the host's span, the step was 'idle-bound
    71%' with its backward collectives at 0 ms; over the device's, it is what every 2-rank run on the loopback rig
    is: communication-bound (94%), its reduce-scatters exposed, idle 1%."""
    _, report = fixture_run
    lags = {r: pr.device_lag_ms for r, pr in report.overlap.per_rank.items()}
    assert lags == {"0": pytest.approx(184.39, abs=0.01), "1": pytest.approx(203.97, abs=0.01)}
    job = report.verdict.job
    assert job.bound == "communication" and job.groups_pct["communication"] > 90 and job.groups_pct["idle"] < 2
    assert all(pr.shares_pct["reducescatter"] > 25 for pr in report.verdict.per_rank.values())
    assert "the device 194.2 ms behind the host" in report.comm.source_text


@recorded
def test_the_gpu_fixture_reads_in_every_dashboard_page(fixture_run):
    from fsdp_doctor.dashboards.pages import PAGES
    from fsdp_doctor.dashboards.pages.common import Filters
    from fsdp_doctor.dashboards.state import RunState

    st = RunState(FIXTURE, background_traces=False)
    st.refresh()
    snap = st.snapshot()
    for key, (_, page) in PAGES.items():
        assert page.layout(snap, Filters()) is not None, key


@functools.lru_cache(maxsize=None)
def _diagnosis(row: str):
    """(run, report) of a recorded GPU row, once per session; skips a row not recorded yet."""
    path = GPU / "scenarios" / row
    if not (path / "manifest.json").exists():
        pytest.skip(f"{path.relative_to(REPO)} not recorded yet")
    return M.diagnosis(path)


def _status(report, code):
    return next(s for s in report.rules if s.code == code)


@pytest.mark.parametrize("row", [r.name for r in M.GPU_ROWS])
def test_a_recorded_gpu_scenario_yields_its_finding(row):
    r = M.BY_NAME[row]
    _, report = _diagnosis(row)
    if r.code is None:
        assert not M.warnings_of(report.findings) - M.baseline_exempt(r), [f.title for f in report.findings]
    else:
        assert M.at_least(report.findings, r.code, r.min_severity), {f.code: f.severity for f in report.findings}


@recorded
def test_memory_growing_quiet_on_every_recorded_gpu_run():
    """Every run recorded on the H100 (traces/gpu, traces/gpu_device_time): quiet. The scenario runs end every
    steady step with the same bytes allocated; the reference workload's two grow 512 B a step (its loop keeps each
    step's loss, a device scalar, in a list): too little to fire, said. (Not among tests/test_diagnose_rules.py's
    known answers: the findings these runs yield are not this rule's.)"""
    import fsdp_doctor

    from conftest import REPO

    runs = sorted(p.parent for base in ("gpu", "gpu_device_time") for p in (REPO / "traces" / base).rglob(
        "manifest.json"))
    assert len(runs) >= 30, runs
    for d in runs:
        rep = fsdp_doctor.build_report(fsdp_doctor.load_run(d))
        assert not [f for f in rep.findings if f.code == "memory.growing"], d
        st = next(s for s in rep.rules if s.code == "memory.growing")
        assert st.status == "quiet", (d, st)
        if d.parent.name == "gpu_device_time":
            assert "changed by 4.00 KiB over 9 steady steps on rank 0, growing in 8 of 8" in st.reason, st.reason


RECORDED = [r.name for r in M.recorded_gpu_rows()]


def test_a_synchronous_loss_allreduce_on_the_compute_stream_is_a_note():
    """The tuned GPT whose loop all-reduces its loss synchronously every step (gpu_gpt_loss_allreduce): torch 2.8+
    launches that NCCL kernel on the compute stream. Expected to hold it for microseconds (a 4-byte all-reduce);
    on the H200 its kernel held it until the other rank arrived: 6.9 ms on rank 0, 2.4 ms on rank 1, 7.9% of the
    87 ms step. So the rule notes it (from 2%; a warning from 10%: it warned on any collective there before), the
    tuned baseline keeps no warning of it, and the advice stays in words (the call is the user's loop)."""
    _, report = _diagnosis("gpu_gpt_loss_allreduce")
    on = {r: pr.comm_calls_on_compute_stream for r, pr in report.overlap.per_rank.items()}
    assert all(n >= 1 for n in on.values()), on  # the step's all-reduce, on the stream of the model's kernels
    (f,) = [x for x in report.findings if x.code == "comm.on_compute_stream"]
    ev = f.evidence
    assert f.severity == "info" and ev["calls_on_compute_stream"] == {"0": "1 of 18", "1": "1 of 18"}
    assert ev["on_compute_stream_ms_per_step"] == {"0": 6.914, "1": 2.441} and ev["share_of_step_pct"] == 7.9
    assert f.recommendation.code == "" and "async_op=True" in f.recommendation.text


@recorded
def test_the_recorded_straggler_is_found_on_the_devices():
    """Rank 1 sleeps 30 ms before each forward. On the GPU the hosts' step times converge (105 ms on both ranks)
    and so do their own times (91 ms; the all-gathers are asynchronous: rank 0's host waits in its loss.item()
    instead), so the host path sees nothing; rank 0's device waits in the step's first all-gather (its forward
    49 ms against rank 1's 17 ms) while rank 1's device idles 33 ms before its forward for its host (rank 0's:
    0.4 ms): rank 0's device waits 34 ms per step, and rank 1's own time less those waits exceeds rank 0's by
    30 ms per step in all 7 steady steps, outside the model."""
    _, report = _diagnosis("gpu_gpt_straggler")
    (s,) = report.steps.stragglers
    assert s.rank == 1 and s.phase == "outside" and (s.steps_slower, s.steps) == (7, 7)
    assert s.excess_ms_per_step == pytest.approx(30.35, abs=0.01)  # the planted 30 ms and the wake-up's latency
    assert s.device_wait_ms_per_step == pytest.approx(33.96, abs=0.01)
    f = next(f for f in report.findings if f.code == "straggler.rank")
    assert f.severity == "warning" and f.evidence["measured_by"] == "device"
    assert f.predicted.step_ms_after == pytest.approx(105.395 - 30.347, abs=1e-3)  # rank 1's p50 less the excess


@recorded
def test_no_other_recorded_gpu_row_has_a_straggler():
    """Every other row's ranks differ by under 10% of the step on the devices (the offloaded GPT's rank 1: 9.5%;
    the tuned baseline's rank 1: 7.1%), below the 15% a straggler needs."""
    for row in RECORDED:
        if row != "gpu_gpt_straggler":
            assert not _diagnosis(row)[1].steps.stragglers, row


@recorded
def test_no_other_recorded_gpu_row_is_launch_bound():
    """Two ranks over loopback sockets: every row's host runs ahead of its device, whose compute kernels wait in the
    queue behind the collectives (or, offloaded, behind the CPU's optimizer step): at most 20% of them start within
    50 µs of their launch (gpu_gpt_ac_ample's rank 1: 50 of 251), where HTA's host-bound A100 trace has 79% and the
    one-rank tiny GPT 100%. The offloaded GPT's device waits for its host 61% of the step, in the optimizer step on
    the CPU: offload.costly's, not a launch count's. A kernel may lack its launch: gpu_gpt_ac_some's rank 0 starts
    its window with 3 of the previous step's optimizer kernels, launched before the trace began. The rows of one rank
    have no collectives to queue behind: the tiny GPT (the test below), the 16 compiled-in-place HF Llama layers of
    compile.recompile_limit's row, half of them eager, whose host may well set the step."""
    for row in RECORDED:
        if M.BY_NAME[row].world == 1:
            continue
        report = _diagnosis(row)[1]
        assert _status(report, "kernels.launch_bound").status == "quiet", row
        for k in report.overlap.kernels.values():
            assert k.count - 3 <= k.launched_count <= k.count and k.launch_waited_count / k.count <= 0.25, row
    st = _status(_diagnosis("gpu_gpt_offload")[1], "kernels.launch_bound")
    assert st.reason.startswith("the device waits for the host 61% of the step (rank 0), but only 4% of its "
                                "compute kernels started within 50 µs"), st.reason


@recorded
def test_the_one_rank_tiny_gpt_recording_is_launch_bound():
    """The tiny GPT (4 blocks of d_model 64, 2 x 32 tokens) alone on the GPU (recorded on the H200, 2026-11-30):
    nothing to wait for but its host. 225 compute kernels per step, 215 of them (96%) under 10 µs (3.0 µs on
    average: 0.68 ms busy of a 40.5 ms profiled step), and 223 of them started within 50 µs of their launch (the
    2-rank rows: at most 20%); the device waits for launches 84% of the step, communication 0%. 13.55 ms of the
    step is the host inside FSDP2's labels over its 6 units, so the fix is one unit for the whole model: predicted
    30.26 -> 21.82 ms on the records' steady step, measured 19.30 ms on its rerun there (each block compiled,
    printed before, measured 18.9 -> 31.3 ms in an earlier call)."""
    run, report = _diagnosis("gpu_gpt_tiny_launch_bound")
    assert sorted(run.ranks) == [0] and run.ranks[0].config.device.startswith("cuda")
    (k,) = report.overlap.kernels.values()
    assert (k.count, k.small_count, k.launched_count, k.launch_waited_count) == (225, 215, 225, 223)
    groups = report.verdict.per_rank["0"].groups_pct
    assert report.verdict.per_rank["0"].bound == "host"
    assert (groups["host"], groups["communication"]) == pytest.approx((83.97, 0.0), abs=0.005)
    f = next(f for f in report.findings if f.code == "kernels.launch_bound")
    ev = f.evidence
    assert f.severity == "warning" and ev["rank"] == 0
    assert (ev["kernels_per_step"], ev["small_kernel_share_pct"], ev["launch_waited_pct"]) == (225.0, 95.6, 99.1)
    assert ev["host_bound_pct"] == 84.0 and ev["mean_kernel_us"] == pytest.approx(3.01)
    assert ev["host_bound_ms_per_step"] == pytest.approx(34.009, abs=1e-3)
    assert (ev["units"], ev["fsdp_host_ms_per_step"]) == (6, pytest.approx(13.552, abs=1e-3))
    assert f.predicted.step_ms_before == pytest.approx(30.26)
    assert f.predicted.step_ms_after == pytest.approx(21.822, abs=1e-3)
    measured = 19.301  # traces/gpu/scenarios_gpu.json, its recheck (step_ms_measured): more than the gain predicted
    assert measured <= f.predicted.step_ms_after
    assert f.recommendation.code.endswith("fully_shard(model, mesh=mesh)")


@recorded
def test_one_unit_for_a_launch_bound_step_is_not_too_coarse():
    """The one-unit fix's rerun on the H200 (traces/gpu/rechecks/gpu_gpt_tiny_launch_bound_fixed): 30.26 -> 19.30
    ms, and wrap.too_coarse warned there, its fix the 7 units back (predicted 19.3 -> 17.9 ms from the host's
    all-gather wait). The device still waits for its host 82% of the step: more units add FSDP2's per-unit host
    work, and the peak is 0.05% of the device. The rule is now quiet on it, saying why; on the loopback rig's
    2-rank whole-model row, communication-bound, it still fires."""
    from fsdp_doctor import load_run
    from fsdp_doctor.pipeline import build_report

    report = build_report(load_run(GPU / "rechecks" / "gpu_gpt_tiny_launch_bound_fixed"))
    assert sorted(f.code for f in report.findings if f.severity == "warning") == ["kernels.launch_bound",
                                                                                 "throughput.low_mfu"]
    reason = _status(report, "wrap.too_coarse").reason
    assert reason.startswith("(root) holds 100% of the parameters, but the device waits for its host 82% of the "
                             "profiled step (rank 0)"), reason
    assert "wrap.too_coarse" in {f.code for f in _diagnosis("gpu_gpt_whole")[1].findings}


@recorded
def test_the_recorded_cpu_offload_costs_its_optimizer_step():
    """CPUOffloadPolicy on a GPT that fits the H100 many times: the copies are 2.9 ms per step (2.4 ms exposed, 1%
    of the step), the optimizer steps on the CPU for 86 ms (the same GPT on the device: ~6 ms, the optimizer of
    gpu_gpt_exposed_allgather). The prediction drops both: 170.5 -> 81.8 ms (the same shape unoffloaded,
    gpu_gpt_exposed_allgather, steps in 76.3 ms)."""
    _, report = _diagnosis("gpu_gpt_offload")
    f = next(f for f in report.findings if f.code == "offload.costly")
    assert f.severity == "warning"
    assert f.evidence["cpu_optimizer_ms_per_step"] == pytest.approx(86.39, abs=0.01)
    assert f.evidence["exposed_copies_ms_per_step"] == pytest.approx(2.38, abs=0.01)
    assert f.evidence["offload_cost_share_pct"] == pytest.approx(52.1, abs=0.05)
    assert f.predicted.step_ms_after == pytest.approx(170.514 - 88.762, abs=0.01)
    assert f.predicted.peak_bytes_after > f.predicted.peak_bytes_before
    assert f.predicted.peak_bytes_after < 0.01 * f.evidence["capacity_bytes"]
    assert "offload_policy" not in f.recommendation.code.split("no offload_policy")[-1]
    for row in RECORDED:  # quiet where nothing is offloaded
        if "offload" not in row:
            assert _status(_diagnosis(row)[1], "offload.costly").reason == "no unit is offloaded", row


def _recorded_row(row):
    path = GPU / "scenarios" / row
    if not (path / "manifest.json").exists():
        pytest.skip(f"{path.relative_to(REPO)} not recorded yet")
    return M.diagnosis(path)


def _one(report, code):
    (f,) = [f for f in report.findings if f.code == code]
    return f


def test_small_collectives_plans_units_that_wrap_too_coarse_accepts():
    """Every Linear its own unit on the 4-block GPT (28 units): the plan was 4 blocks per unit, all four in one, and
    its rerun warned wrap.too_coarse. 4 blocks leave no room to group (fewer than 4 units overlap little; a block's
    5.3 MiB all-gather is out of the latency regime already): one unit per block, wrap.too_fine's plan. The gain is
    that plan's: 20 of 28 units' collectives gone, each what its median call exposed: 131.8 ms, 209.1 -> 77.3 ms
    predicted; the campaign's rerun of the plan measured 85.9 ms (123.2 ms gained), comm.small_collectives and
    wrap.too_fine gone, no new warning (/tmp/gc2 scenarios_gpu.json, gpu_gpt_leaf's recheck)."""
    from fsdp_doctor.diagnose import Context
    from fsdp_doctor.diagnose import estimate as E
    from fsdp_doctor.diagnose.thresholds import COARSE_SHARE_MIN

    run, report = _recorded_row("gpu_gpt_leaf")
    f = _one(report, "comm.small_collectives")
    ev = f.evidence
    assert (ev["plan_blocks_per_unit"], ev["plan_units"]) == (1, "28 -> 8")
    code = f.recommendation.code
    assert "for block in model.layers.children():" in code and "range(0, len(blocks)" not in code
    assert "model.layers.0.attn" not in code  # the leaves' units give way to their blocks

    def sharding(c):
        return [ln for ln in c.splitlines() if not ln.startswith("# ")]

    assert sharding(code) == sharding(_one(report, "wrap.too_fine").recommendation.code)
    plan = E.grouped_plan(Context(run=run, report=report))
    assert plan.block_share == pytest.approx(2_758_400 / 19_685_376)
    assert plan.group * plan.block_share < COARSE_SHARE_MIN
    # per rank, 20/28 of each collective's calls times its median call's exposed time: 162.2 and 101.4 ms, median 131.8
    assert ev["expected_gain_ms"] == pytest.approx(131.79, abs=0.005)
    assert f.predicted.step_ms_before == report.steps.job.p50_ms == pytest.approx(209.123)
    assert f.predicted.step_ms_after == pytest.approx(209.123 - 131.79, abs=0.005)
    # the throughput lever prints the same plan
    assert sharding(_one(report, "throughput.low_mfu").recommendation.code) == sharding(code)
    # comm.bound prints it only where the collectives are latency-bound: the small messages' (< 1 MiB) share of the
    # exposed communication in its size table at 50% or more. The first recording (f599da8) had 51.1% (194.7 of
    # 381.0 ms); this one 49.8% (190.4 of 382.0 ms), so comm.bound reads the step as bandwidth-bound and prints its
    # bandwidth advice, not the plan; its all-gathers are already bf16 (the row's MixedPrecisionPolicy), so the
    # advice is HSDP or a larger micro-batch in words, and no code: the 16-bit snippet it printed before pasted the
    # run's own policy back (no change, no predicted gain)
    cb = _one(report, "comm.bound")

    def exposed(rows):
        return sum(float(r.rsplit("exposed ", 1)[1].split()[0]) for r in rows)

    small = exposed(r for r in cb.evidence["by_size"] if "< 1 MiB" in r)
    assert small / exposed(cb.evidence["by_size"]) == pytest.approx(190.373 / 382.012, abs=1e-5)
    assert cb.evidence["latency_bound"] is False
    assert cb.recommendation.code == "" and "already move 16-bit parameters" in cb.recommendation.text
    assert cb.predicted.step_ms_after is None


def test_exposed_allgather_gain_is_bounded_by_the_device_compute():
    """FSDP's implicit prefetch only, on two ranks sharing a GPU over loopback sockets: the all-gathers are 41% of
    the step (31.5 of 76.3 ms), but the device computes 0.54 ms of forward per step before the next unit (0.05-0.14
    ms a unit) where the host spent 0.5-1.3 ms a unit in it, launching it. An earlier recording's snippet, predicted
    from the host's times at 74.7 -> 68.8 ms, measured 80.9 ms on its rerun. Now ~0.5 ms (0.7% of the step), under
    the 5% the rule notes: a note, and no snippet (the campaign's row: info, no fix code, so no rerun)."""
    _, report = _recorded_row("gpu_gpt_exposed_allgather")
    f = _one(report, "prefetch.exposed_allgather")
    ev = f.evidence
    assert ev["exposed_share_pct"] == pytest.approx(41.3) and ev["compute_measured_by"] == "trace (device)"
    assert ev["compute_to_hide_behind_ms"] == pytest.approx(0.540, abs=1e-3)
    assert ev["expected_gain_ms"] == pytest.approx(0.540, abs=1e-3)
    assert ev["expected_gain_ms"] <= ev["free_compute_ms_per_step"] == pytest.approx(0.794, abs=1e-3)
    assert f.severity == "info" and f.recommendation.code == ""
    assert "Prefetching cannot hide them" in f.recommendation.text
    assert f.predicted.step_ms_after == pytest.approx(76.325 - 0.540, abs=1e-3)


def test_tight_capacity_checkpointing_brings_the_cuda_peak_under_the_target():
    """Batch 8 under a budget 5% above its peak: on CUDA the peak (in the loss) also holds the fp32 logits' loss
    temporaries (256 MiB over the step's start) and the 66 MiB the allocator held when the step started, so the
    activations are 45.5% of it (368.8 of 811.5 MiB): they dominate (40% or more), and checkpointing two of the four
    blocks brings the peak under 85% of capacity: predicted 702.36 MiB against a 726.05 MiB target; the campaign's
    rerun measured 703.09 MiB, the finding gone, no new warning (/tmp/gc2 scenarios_gpu.json, gpu_gpt_tight_capacity).
    (The first recording, f599da8, started each step with 179.5 MiB, the previous row's model still allocated
    before the campaign collected it between rows: 39.9% of a 925 MiB peak, under the 40%, where the finding fired
    because checkpointing alone brought the peak under the target.)"""
    _, report = _recorded_row("gpu_gpt_tight_capacity")
    f = _one(report, "ac.recommended")
    ev = f.evidence
    assert f.severity == "warning" and ev["activation_share_pct"] == 45.5
    assert ev["fires_because"] == "activations are 40% of the peak or more"
    assert ev["blocks_to_checkpoint"] == ["layers.0", "layers.1"]
    assert f.predicted.peak_bytes_before == 850_881_544
    assert f.predicted.peak_bytes_after == 736_480_234
    assert f.predicted.peak_bytes_after < 0.85 * ev["capacity_bytes"] < f.predicted.peak_bytes_before
    measured = 737_239_560  # /tmp/gc2 scenarios_gpu.json, gpu_gpt_tight_capacity's recheck (peak_measured)
    assert measured < 0.85 * ev["capacity_bytes"]
    assert abs(measured - f.predicted.peak_bytes_after) <= 0.01 * measured


def test_comm_bound_on_float32_allgathers_predicts_the_16_bit_gain():
    """float32 parameters all-gathered by two ranks over the loopback link (1.2-1.5 GB/s): exposed collectives 77% of
    the trace's 110.8 ms step, bandwidth-bound (messages of 10-17 MiB). 16-bit parameters halve the all-gathers'
    bytes: half their exposed time, 60.0 ms per step (median over the ranks), is the predicted gain, and the snippet
    sets exactly that policy on the run's own units. Its rerun on the H100 (the campaign's recheck) measured
    105.3 -> 74.6 ms per step (records' median), -30.7 ms against the -30.0 predicted."""
    _, report = _diagnosis("gpu_gpt_fp32_comm")
    f = _one(report, "comm.bound")
    assert f.severity == "warning" and f.evidence["latency_bound"] is False
    assert f.evidence["exposed_comm_share_pct"] == pytest.approx(77.1)
    assert f.predicted.step_ms_before == pytest.approx(110.841)
    assert f.predicted.step_ms_after == pytest.approx(80.841)
    code = f.recommendation.code
    assert "mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16,\n" \
        "                                 reduce_dtype=torch.float32)" in code
    assert "for block in model.layers.children():\n    fully_shard(block, mesh=mesh, mp_policy=mp_policy)" in code


@recorded
def test_no_recorded_gpu_run_retries_its_allocations():
    """memory.alloc_retries on real H100 and H200 records: every row but the one that plants retries, and the
    fixture, read the allocator's cumulative num_alloc_retries at each step's end, 0 throughout, so the rule is
    quiet and says over how many steps."""
    from fsdp_doctor import load_run
    from fsdp_doctor.pipeline import build_report

    reports = [_diagnosis(row)[1] for row in RECORDED if row != "gpu_gpt_alloc_retries"] \
        + [build_report(load_run(FIXTURE))]
    assert len(reports) >= 19
    for report in reports:
        reason = _status(report, "memory.alloc_retries").reason
        assert reason.startswith("no cudaMalloc retries in ") and reason.endswith(" steady steps on any rank"), reason
        assert int(reason.split()[4]) >= 3, reason


@recorded
def test_the_recorded_allocator_retries_point_to_the_peak():
    """memory.alloc_retries on its H200 row (sequence lengths that vary, the allocator capped from step 2 at 1.1x
    the longest step's peak): 6 retries in steps 5, 6 and 8 of 5 steady steps, the steady peak 76% of the 548.96
    MiB the memory fraction leaves. Expandable segments, the fix printed when this was recorded, left 4 of them
    (benchmarks/alloc_retries_probe.py there: none at 65% with or without them), so the advice is the peak, in
    words, with how far to lower it, and nothing to paste. The steps with retries were the shorter ones here (77 ms
    against 129 ms: their sequences differ), so no step gain is quoted (it quoted the step 52 ms slower)."""
    _, report = _diagnosis("gpu_gpt_alloc_retries")
    (f,) = [x for x in report.findings if x.code == "memory.alloc_retries"]
    ev = f.evidence
    assert f.severity == "warning" and (ev["retries"], ev["retry_steps"], ev["steady_steps"]) == (6, [5, 6, 8], 5)
    assert ev["allocator_limit_bytes"] == 575_630_387 and ev["peak_bytes"] == 439_413_768
    rec = f.recommendation
    assert rec.code == ""
    assert "fills 76% of the 548.96 MiB the allocator may reserve (this process's memory fraction)" in rec.text
    assert "lower the peak by 34.78 MiB or more (to 70% of the limit)" in rec.text
    assert f.predicted.step_ms_after == f.predicted.step_ms_before == pytest.approx(77.34)


@recorded
def test_offloading_is_predicted_with_the_optimizer_on_the_host():
    """offload.recommended on its H200 row (one 64-token sequence per rank, a budget 3% above the peak). First
    recorded on 2026-11-28, its fix pasted slowed the step 74.5 -> 173.4 ms against a prediction of 84.2 ms, the
    host-device copies alone. AdamW on the host, 9.73 M elements per rank on one thread at 8 ns each
    (benchmarks/cpu_optimizer_cost.py; the H100 row's offloaded optimizer phase ran at 8.4), replacing its time on
    the device, was added to the prediction; recorded again on 2026-11-30 with it: 71.9 -> 155.8 ms predicted,
    146.1 ms measured (-6%), the peak 107.0 MB predicted, 111.1 MB measured, the finding gone."""
    _, report = _diagnosis("gpu_gpt_offload_needed")
    (f,) = [x for x in report.findings if x.code == "offload.recommended"]
    ev = f.evidence
    assert (ev["copy_ms_per_step_est"], ev["cpu_optimizer_ms_per_step_est"], ev["optimizer_ms_per_step"]) == \
        (9.728, 77.824, 3.721)
    measured = 146.109  # traces/gpu/scenarios_gpu.json, gpu_gpt_offload_needed's recheck (step_ms_measured)
    assert f.predicted.step_ms_after == pytest.approx(71.943 + 9.728 + 77.824 - 3.721, abs=1e-3)
    assert abs(f.predicted.step_ms_after - measured) <= 0.10 * measured
    assert "AdamW steps on the CPU, about 78 ms for this rank's 9.73 M elements" in f.recommendation.text


@recorded
def test_untrained_parameters_frozen_with_their_reduce_scatters_and_prefetch():
    """optim.untrained_params on its H200 row (the optimizer over layers.3 and the head; 2 NCCL ranks over loopback,
    every collective exposed). Its fix then, freezing what the optimizer does not hold, measured 73.0 -> 40.6 ms
    against a prediction of 67.1: it counted the frozen prefix's backward compute and host-side all-gather waits,
    not the reduce-scatters of its gradients (19.4 / 17.1 ms exposed per step on the two ranks) nor the trace's
    backward all-gathers. And the rerun warned prefetch.frozen_gathered: layers.3's default backward prefetch still
    gathered layers.2, frozen, 2.41 ms exposed per step. The fix now gives layers.3 a prefetch list without it, and
    the prediction counts the trace's exposed backward all-gathers and reduce-scatters of the prefix. Recorded again
    with both (a second call that day): 77.26 -> 38.31 ms predicted, 40.79 ms measured (+6%), the finding gone,
    no new warning, the peak under its ceiling (363.20 MiB against 365.17)."""
    _, report = _diagnosis("gpu_gpt_top_optimizer")
    (f,) = [x for x in report.findings if x.code == "optim.untrained_params"]
    ev = f.evidence
    assert ev["frozen_prefix_units"] == ["tok_emb, pos_emb", "layers.0", "layers.1", "layers.2"]
    assert ev["frozen_prefix_reduce_scatter_ms"] == pytest.approx(22.613, abs=1e-3)
    assert f.predicted.step_ms_before == pytest.approx(77.261)
    assert f.predicted.step_ms_after == pytest.approx(38.309, abs=1e-3)
    measured = 40.791  # traces/gpu/scenarios_gpu.json, gpu_gpt_top_optimizer's recheck (step_ms_measured)
    assert abs(f.predicted.step_ms_after - measured) <= 0.10 * measured
    assert f.recommendation.code.endswith("unit = model.get_submodule('layers.3')\n"
                                          "# itself: gathered already, nothing to gather\n"
                                          "unit.set_modules_to_backward_prefetch([unit])")


@recorded
def test_reshard_after_forward_is_quoted_alike_by_both_findings(fixture_run):
    """prefetch.exposed_allgather names keeping the resharded units gathered (reshard.zero2_affordable's lever) with
    what it would save: the host's waits read ~7.9 ms beside zero2's 70.0 ms for the same 9 units and bytes (a
    new-user trial on this fixture). Both read the GPU trace's backward waits now: one figure."""
    _, report = fixture_run
    ag, z2 = _one(report, "prefetch.exposed_allgather"), _one(report, "reshard.zero2_affordable")
    assert ag.evidence["reshard_after_forward_false_ms"] == pytest.approx(z2.evidence["saved_ms_per_step"], abs=0.01)
    assert ag.evidence["reshard_after_forward_false_bytes"] == z2.evidence["added_at_peak_bytes"]


@recorded
def test_reduce_scatters_already_in_16_bits_are_not_told_to_halve_their_float32_bytes(fixture_run):
    """The fixture reduces in bfloat16: comm.exposed_reducescatter read "A 16-bit reduce dtype would halve the bytes of
    the float32 ones (the expected gain below)" with none below (a new-user trial). It says they are 16-bit already."""
    _, report = fixture_run
    f = _one(report, "comm.exposed_reducescatter")
    assert f.evidence["rs_dtype"].lower() in ("bfloat16", "bf16") and f.predicted.step_ms_after is None
    assert "would halve the bytes" not in f.recommendation.text
    assert f.recommendation.text.endswith("They reduce in 16 bits already (numerics.reduce_dtype weighs that choice).")


def test_temporaries_held_before_the_step_are_not_the_steps():
    """On CUDA the temporaries are the allocator's bytes outside every category, and each step of the H100 rows starts
    with 65-74 MiB of them (cuBLAS's and NCCL's workspaces, the batch): on the HF Llama row that keeps its outputs,
    68.78 of the peak's 78.76 MiB of temporaries (79% of a 99.28 MiB peak). Given a budget 5% above that peak,
    memory.temporaries weighs what the step's operators made (9.99 MiB, 10%) and stays quiet, saying what was held;
    read from the whole category it would have blamed the loss for the workspaces."""
    from fsdp_doctor.diagnose import diagnose
    from fsdp_doctor.units import fmt_bytes

    run, report = _recorded_row("gpu_hf_llama_outputs_kept")
    pm = max(report.memory.per_rank.values(), key=lambda m: m.peak_bytes)
    raw = pm.peak_breakdown["temporaries"]
    held = pm.timeline[0]["temporaries"]
    assert raw / pm.peak_bytes >= 0.40 and (raw - held) / pm.peak_bytes < 0.40, (raw, held, pm.peak_bytes)
    for m in report.memory.per_rank.values():
        m.capacity_bytes = int(pm.peak_bytes / 0.95)
    statuses = []
    assert "memory.temporaries" not in {f.code for f in diagnose(run, report, statuses=statuses)}
    (st,) = [s for s in statuses if s.code == "memory.temporaries"]
    assert st.status == "quiet" and f"beside {fmt_bytes(held)} already outside every category" in st.reason, st
    # nor does memory.near_capacity_spread leave it to that rule: it weighs the same temporaries
    (spread,) = [s for s in statuses if s.code == "memory.near_capacity_spread"]
    assert "memory.temporaries applies" not in spread.reason, spread
