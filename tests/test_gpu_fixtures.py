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


@pytest.mark.parametrize("row", [pytest.param(r.name, marks=pytest.mark.xfail(reason=M.RERECORD[r.name], strict=True))
                                 if r.name in M.RERECORD else r.name for r in M.GPU_ROWS])
def test_a_recorded_gpu_scenario_yields_its_finding(row):
    r = M.BY_NAME[row]
    _, report = _diagnosis(row)
    if r.code is None:
        assert not M.warnings_of(report.findings) - M.baseline_exempt(r), [f.title for f in report.findings]
    else:
        assert M.at_least(report.findings, r.code, r.min_severity), {f.code: f.severity for f in report.findings}


RECORDED = [r.name for r in M.GPU_ROWS]


@recorded
def test_the_recorded_straggler_is_found_on_the_devices():
    """Rank 1 sleeps 30 ms before each forward. On the GPU the hosts' step times converge (105 ms on both ranks)
    and so do their own times (the all-gathers are asynchronous: rank 0's host waits in its loss.item() instead),
    so the host path sees nothing; rank 0's device waits in the step's first all-gather (its forward 51 ms against
    rank 1's 17 ms) while rank 1's device idles 35 ms longer for its host: 35 ms per step, outside the model."""
    _, report = _diagnosis("gpu_gpt_straggler")
    (s,) = report.steps.stragglers
    assert s.rank == 1 and s.phase == "outside" and (s.steps_slower, s.steps) == (6, 7)
    assert s.excess_ms_per_step == pytest.approx(35.07, abs=0.01)  # the planted 30 ms and the wake-up's latency
    assert s.device_wait_ms_per_step == pytest.approx(35.01, abs=0.01)
    f = next(f for f in report.findings if f.code == "straggler.rank")
    assert f.severity == "warning" and f.evidence["measured_by"] == "device"
    assert f.predicted.step_ms_after == pytest.approx(105.049 - 35.072, abs=1e-3)


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
    queue behind the collectives (or, offloaded, behind the CPU's optimizer step): at most 24% of them start within
    50 µs of their launch, where HTA's host-bound A100 trace has 79%. The offloaded GPT's device waits for its host
    62% of the step, in the optimizer step on the CPU: offload.costly's, not a launch count's."""
    for row in RECORDED:
        if M.BY_NAME[row].code == "kernels.launch_bound" and row not in M.RERECORD:
            continue
        report = _diagnosis(row)[1]
        assert _status(report, "kernels.launch_bound").status == "quiet", row
        for k in report.overlap.kernels.values():
            assert k.launched_count == k.count and k.launch_waited_count / k.count <= 0.25, row
    st = _status(_diagnosis("gpu_gpt_offload")[1], "kernels.launch_bound")
    assert st.reason.startswith("the device waits for the host 62% of the step (rank 1), but only 3% of its "
                                "compute kernels started within 50 µs"), st.reason


@recorded
def test_the_two_rank_tiny_gpt_recording_is_not_launch_bound():
    """M.RERECORD's figures: the tiny GPT recorded on 2 ranks queues its kernels behind the collectives."""
    if "gpu_gpt_tiny_launch_bound" not in M.RERECORD:
        pytest.skip("recorded again on one rank")
    report = _diagnosis("gpu_gpt_tiny_launch_bound")[1]
    k = report.overlap.kernels
    assert (k["0"].launch_waited_count, k["1"].launch_waited_count, k["0"].count) == (11, 7, 247)
    comm = {r: v.groups_pct["communication"] for r, v in report.verdict.per_rank.items()}
    assert comm == pytest.approx({"0": 61.1, "1": 51.5}, abs=0.05)  # bound by the collectives
    st = _status(report, "kernels.launch_bound")
    assert st.reason == ("the device waits for launches 11% of the step (< 25%; rank 1); 3% of its compute kernels "
                         "started within 50 µs of their launch"), st.reason


@recorded
def test_the_recorded_cpu_offload_costs_its_optimizer_step():
    """CPUOffloadPolicy on a GPT that fits the H100 many times: the copies are 2.9 ms per step (2.4 ms exposed, 1%
    of the step), the optimizer steps on the CPU for 82 ms (the same GPT on the device: ~4 ms). The prediction
    drops both: 176.9 -> 92.5 ms (the same shape unoffloaded, gpu_gpt_exposed_allgather, steps in 74.5 ms)."""
    _, report = _diagnosis("gpu_gpt_offload")
    f = next(f for f in report.findings if f.code == "offload.costly")
    assert f.severity == "warning"
    assert f.evidence["cpu_optimizer_ms_per_step"] == pytest.approx(81.91, abs=0.01)
    assert f.evidence["exposed_copies_ms_per_step"] == pytest.approx(2.44, abs=0.01)
    assert f.evidence["offload_cost_share_pct"] == pytest.approx(47.7, abs=0.05)
    assert f.predicted.step_ms_after == pytest.approx(176.874 - 84.35, abs=0.01)
    assert f.predicted.peak_bytes_after > f.predicted.peak_bytes_before
    assert f.predicted.peak_bytes_after < 0.01 * f.evidence["capacity_bytes"]
    assert "offload_policy" not in f.recommendation.code.split("no offload_policy")[-1]
    for row in RECORDED:  # quiet where nothing is offloaded
        if "offload" not in row:
            assert _status(_diagnosis(row)[1], "offload.costly").reason == "no unit is offloaded", row
