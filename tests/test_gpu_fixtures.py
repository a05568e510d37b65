"""Recorded GPU runs read on the CPU (issue #22, item 4): the GPU campaign's 2-rank H100 fixture and its scenario
matrix GPU rows, copied into ``traces/gpu/`` by ``benchmarks/gpu_campaign.py --adopt --out FOLDER``. The analysis,
the diagnosis and the dashboard then run on real GPU records in every CI run, which has no GPU.

Skipped until a session with the GPU machine records and commits them (what is asserted is what the rows expect:
tests/scenario_matrix.py ``GPU_ROWS``)."""

from __future__ import annotations

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


@pytest.mark.parametrize("row", [r.name for r in M.GPU_ROWS])
def test_a_recorded_gpu_scenario_yields_its_finding(row):
    path = GPU / "scenarios" / row
    if not (path / "manifest.json").exists():
        pytest.skip(f"{path.relative_to(REPO)} not recorded yet")
    r = M.BY_NAME[row]
    _, report = M.diagnosis(path)
    if r.code is None:
        assert not M.warnings_of(report.findings) - M.baseline_exempt(r), [f.title for f in report.findings]
    else:
        assert M.at_least(report.findings, r.code, r.min_severity), {f.code: f.severity for f in report.findings}
