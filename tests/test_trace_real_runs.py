"""Real CPU/gloo FSDP2 runs of the reference workload, profiled with plain torch.profiler."""

import pytest

from fsdp_doctor.trace import analyze_traces
from trace_fixtures import ProfileWindow

workloads = pytest.importorskip("fsdp_doctor.workloads")

pytestmark = pytest.mark.slow


def _all_gather_overlap_pct(result, rank):
    rows = [r for r in result.per_unit if r.rank == rank and r.collective == "all_gather"]
    comm = sum(r.comm_us for r in rows)
    exposed = sum(r.exposed_us for r in rows)
    return 100.0 * (comm - exposed) / comm, rows


def _profile(tmp_path, async_unshard):
    hook = ProfileWindow(tmp_path, warmup=1, active=3)
    cfg = workloads.WorkloadConfig(steps=hook.steps_needed(), async_unshard=async_unshard, d_model=256,
                                   n_layers=4, seq_len=128)
    workloads.launch(cfg, nproc=2, on_step=hook, timeout_s=120)
    return analyze_traces(tmp_path)


@pytest.mark.parametrize("async_unshard", [False, True], ids=["sync", "async"])
def test_gloo_all_gather_overlap(tmp_path, async_unshard):
    r = _profile(tmp_path, async_unshard)
    assert r.skipped == [] and len(r.files) == 2
    assert sorted(r.per_rank) == ["0", "1"]
    for rank in (0, 1):
        pr = r.per_rank[str(rank)]
        assert pr.device == "cpu" and len(pr.steps) == 2 and pr.comm_us > 0
        pct, rows = _all_gather_overlap_pct(r, rank)
        units = {row.unit for row in rows}
        assert {"layers.0", "layers.1", "layers.2", "layers.3"} <= units or len(units) >= 4, units
        assert {row.phase for row in rows} == {"forward", "backward"}
        assert all(row.slack_us is not None for row in rows)
        rs = [x for x in r.per_unit if x.rank == rank and x.collective == "reduce_scatter"]
        assert rs and all(x.phase == "backward" for x in rs)
        blocking = r.blocking[str(rank)]
        n_ag = sum(row.count for row in rows)
        if async_unshard:
            assert pct > 10.0, pct
            assert blocking.count < n_ag / 2
        else:
            assert pct < 5.0, pct
            assert blocking.count >= n_ag - 1  # the host sat in (nearly) every all-gather
