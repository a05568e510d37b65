"""Rules decided from plain Kineto traces (no records): known-answer FSDP2-shaped GPU traces, numbers derived
by hand in each test (see trace_fixtures.fsdp_gpu_trace for the schedule)."""

import pytest
from trace_fixtures import fsdp_gpu_trace, gloo_known_trace

from fsdp_doctor import load_run
from fsdp_doctor.analyze import build_report
from fsdp_doctor.diagnose.base import Context
from fsdp_doctor.diagnose.rules.comm import (
    CommunicationBound,
    ExposedReduceScatter,
    NcclOnComputeStream,
    SmallCollectives,
    TraceStraggler,
)


def _report(tmp_path, *kws):
    for r, kw in enumerate(kws):
        fsdp_gpu_trace(rank=r, **kw).write(tmp_path / f"rank{r}.json")
    run = load_run(tmp_path)
    return run, build_report(run)


def _by_code(report):
    out = {}
    for f in report.findings:
        assert f.code not in out, f.code
        out[f.code] = f
    return out


def test_allgathers_94pct_exposed(tmp_path):
    # 4 units x (all-gather 94 µs alone, then compute 6 µs): 376 of every 400 µs wait for all-gathers
    _, rep = _report(tmp_path, dict(units=4, ag_us=94, fwd_us=6))
    f = _by_code(rep)
    ag = f["prefetch.exposed_allgather"]
    assert ag.evidence["measured_by"] == "trace"
    assert ag.evidence["exposed_ag_ms_per_step"] == pytest.approx(0.376)
    assert ag.evidence["exposed_share_pct"] == 94.0 and ag.evidence["exposed_ag_bwd_ms"] == 0
    # prefetching hides units 1-3's all-gathers only as far as there is compute to hide them: 24 µs per step
    assert ag.predicted["step_ms_before"] == 0.4 and ag.predicted["step_ms_after"] == pytest.approx(0.376)
    # 6% of the step: a note, not a warning (the severity follows what the fix can gain, not the exposure)
    assert ag.severity == "info"
    assert "set_modules_to_forward_prefetch" in ag.recommendation.code
    # every unit of the trace (from FSDP's labels) prefetches the next in the order the trace ran them, the root
    # never named by its display label
    from clients import module_tree, prefetch_chain

    layers = [f"layers.{i}" for i in range(4)]
    chain = prefetch_chain(ag.recommendation.code, module_tree(layers))
    assert chain == {("forward", a): [b] for a, b in zip(layers, layers[1:])}, ag.recommendation.code
    assert "(root)" not in ag.recommendation.code
    cb = f["comm.bound"]
    assert cb.evidence["exposed_comm_share_pct"] == 94.0 and cb.evidence["latency_bound"] is False
    # 1M float32 elements = 4 MB per all-gather, 94 µs each on 8 ranks: busbw 4e6 x 7/8 / 94 µs = 37.2 GB/s
    assert cb.evidence["by_size"] == ["all_gather 1-16 MiB: 4.0/step, median 3.8 MiB, busbw 37.2 GB/s, "
                                         "exposed 0.376 ms"]
    # bandwidth-bound float32 all-gathers: bf16 halves their bytes, so half their exposed 0.376 ms per step
    assert cb.predicted["step_ms_after"] == pytest.approx(0.4 - 0.188)
    assert "comm.small_collectives" not in f  # 4 calls per step
    assert rep.verdict.job.bound == "communication"


def test_48_tiny_units(tmp_path):
    """48 units, 65536 float32 elements (256 KiB) per collective, each 20 µs: per step 48 forward and 48
    backward all-gathers, all exposed; the reduce-scatters exposed 48 x 20 µs = 0.96 ms of 4.32 ms."""
    run, rep = _report(tmp_path, *[dict(units=48, ag_us=20, fwd_us=10, bwd_us=20, rs_us=20, nelems=65536)] * 2)
    f = _by_code(rep)
    sc = f["comm.small_collectives"].evidence
    assert sc["allgathers_per_step"] == 96 and sc["units"] == 48 and sc["median_bytes_per_call"] == 262144
    assert sc["busbw_gbps_median"] == pytest.approx(262144 * 7 / 8 / 20e-6 / 1e9, abs=0.01)  # 11.47 GB/s
    assert sc["exposed_share_pct"] == pytest.approx(66.7, abs=0.05) and sc["median_ms_per_call"] == 0.02
    assert f["comm.bound"].evidence["latency_bound"] is True
    assert f["comm.bound"].predicted["step_ms_after"] is None  # latency: halving bytes says little
    rs = f["comm.exposed_reducescatter"]
    assert rs.severity == "warning" and rs.evidence["exposed_rs_ms_per_step"] == pytest.approx(0.96)
    assert rs.evidence["exposed_share_pct"] == pytest.approx(22.2, abs=0.05)
    assert rs.evidence["rs_busbw_gbps_median"] == pytest.approx(11.5, abs=0.05)
    assert rs.evidence["rs_dtype"] == "Float" and rs.predicted["step_ms_after"] == pytest.approx(4.32 - 0.48)


def test_h2d_copies_on_the_critical_path(tmp_path):
    # per unit: H2D 50 µs alone, then all-gather 10, then compute 40: offload is half the step
    _, rep = _report(tmp_path, dict(units=4, h2d_us=50, ag_us=10, fwd_us=40))
    oc = _by_code(rep)["offload.costly"]
    assert oc.severity == "warning" and oc.evidence["exposed_copies_ms_per_step"] == pytest.approx(0.2)
    assert oc.evidence["exposed_share_pct"] == 50.0 and oc.evidence["h2d_ms_per_step"] == pytest.approx(0.2)
    assert oc.predicted["step_ms_after"] == pytest.approx(0.2)
    assert rep.verdict.per_rank["0"].bound == "offload"


def test_compute_dominated_run_is_quiet(tmp_path):
    # prefetched, compute 90 µs per unit, all-gathers 10 µs: only the first (10 of 370 µs, 2.7%) is exposed
    _, rep = _report(tmp_path, dict(units=4, ag_us=10, fwd_us=90, prefetch=True))
    assert rep.findings == []
    assert rep.verdict.job.bound == "compute"


def test_nccl_on_the_compute_stream(tmp_path):
    # 4 units x (all-gather 40 µs, then compute 100 µs), all on the compute stream: 160 of 560 µs held there
    _, rep = _report(tmp_path, dict(units=4, ag_us=40, fwd_us=100, nccl_stream=7))
    f = _by_code(rep)["comm.on_compute_stream"]
    assert f.evidence["calls_on_compute_stream"] == {"0": "8 of 8"} and f.ranks == [0]
    assert f.evidence["on_compute_stream_ms_per_step"] == {"0": pytest.approx(0.16)}
    assert f.severity == "warning" and f.evidence["share_of_step_pct"] == pytest.approx(28.6, abs=0.1)
    assert f.recommendation.code == ""  # the calls are the user's: advice in words
    _, rep = _report(tmp_path / "ok", dict(units=4, ag_us=40, fwd_us=100))
    assert "comm.on_compute_stream" not in _by_code(rep)


@pytest.mark.parametrize("us, severity", [(5.0, None), (20.0, "info"), (80.0, "warning")])
def test_synchronous_loop_allreduce_on_the_compute_stream(tmp_path, us, severity):
    """torch 2.8+ launches a synchronous collective (async_op=False: a loss all-reduced for logging) on the current
    stream: 5 µs of a 565 µs step is no finding (it fired on any such call); 20 of 580 µs (3.4%) a note, 80 of 640
    µs (12.5%) a warning. The step: 4 units x (all-gather 40 µs exposed, compute 100 µs), the all-reduce after."""
    _, rep = _report(tmp_path, dict(units=4, ag_us=40, fwd_us=100, sync_allreduce_us=us))
    pr = rep.overlap.per_rank["0"]
    assert pr.comm_calls_on_compute_stream == 2 and pr.comm_ms_on_compute_stream_per_step == pytest.approx(us / 1e3)
    f = _by_code(rep).get("comm.on_compute_stream")
    status = next(s for s in rep.rules if s.code == "comm.on_compute_stream")
    if severity is None:
        assert f is None and status.status == "quiet", status
        assert "0.005 ms of the 0.56 ms step (0.9%, rank 0)" in status.reason and "async_op=False" in status.reason
    else:
        assert f.severity == severity and f.evidence["on_compute_stream_ms_per_step"] == {"0": pytest.approx(us / 1e3)}
        assert f.recommendation.code == "" and "async_op=True" in f.recommendation.text


def test_straggler_across_the_ranks_files(tmp_path):
    """Rank 1 spends 1000 µs more per step on the host before its forward; ranks 0, 2, 3 wait that long in
    their first all-gather: rank 1's own work is 2.2 ms per step against 1.2 ms on the others."""
    kws = [dict(units=4, ag_us=40, fwd_us=100, bwd_us=200, rs_us=50, prefetch=True,
                step_skew_us=1000 if r == 1 else 0, first_ag_wait_us=0 if r == 1 else 1000) for r in range(4)]
    run, rep = _report(tmp_path, *kws)
    s = _by_code(rep)["straggler.trace"]
    ev = s.evidence
    assert s.ranks == [1] and ev["rank"] == 1 and ev["rank_largest_part"] == "host"
    assert ev["own_ms_per_step"] - ev["others_own_ms_median"] == pytest.approx(1.0, abs=0.01)
    assert ev["others_wait_ms_median"] == pytest.approx(1.07, abs=0.01)
    # what the others wait for rank 1 is its lateness, not their all-gathers' cost: prefetch.exposed_allgather reads
    # the straggler's own waits (0.08 ms a step, as in the job without it: of the longer 2.3 ms step, under the 5%
    # it notes from), where the median of the ranks read 1.02 ms, 45% of the step
    ag = next(s for s in rep.rules if s.code == "prefetch.exposed_allgather")
    assert ag.status == "quiet" and "0.1 ms: 4% of the step 2.3 ms" in ag.reason, ag
    assert ag.reason.endswith("(fires from 5%), on a GPU (trace); read on rank 1, the straggler (the other ranks' "
                              "waits for it, +1.00 ms a step, are straggler.trace's)"), ag.reason
    # 5 ms late: the others wait in their collectives 61% of their step, the job's verdict communication-bound; the
    # straggler's own step is host-bound (its collectives 2% of it): no comm.bound (its levers send fewer bytes,
    # which would not make rank 1 arrive sooner), straggler.trace says it
    kws = [dict(units=4, ag_us=40, fwd_us=100, bwd_us=200, rs_us=50, prefetch=True,
                step_skew_us=5000 if r == 1 else 0, first_ag_wait_us=0 if r == 1 else 5000) for r in range(4)]
    run, rep = _report(tmp_path / "late5", *kws)
    assert rep.verdict.job.bound == "communication" and rep.verdict.job.groups_pct["communication"] > 60
    assert set(_by_code(rep)) == {"straggler.trace"}, _by_code(rep).keys()
    cb = next(s for s in rep.rules if s.code == "comm.bound")
    assert cb.reason.startswith("the step is host-bound, read on rank 1, the straggler (the other ranks' waits for "
                                "it, +5.00 ms a step, are straggler.trace's); communication 2% of it"), cb.reason
    # the same job without the late rank: no straggler, every rank's all-gathers read
    kws = [dict(units=4, ag_us=40, fwd_us=100, bwd_us=200, rs_us=50, prefetch=True) for _ in range(4)]
    run, rep = _report(tmp_path / "even", *kws)
    assert "straggler.trace" not in _by_code(rep)
    ag = _by_code(rep)["prefetch.exposed_allgather"]
    assert ag.evidence["exposed_ag_ms_per_step"] == pytest.approx(0.08) and ag.evidence["ranks_read"] == [0, 1, 2, 3]
    # one complete profiled step is no pattern (a new-user trial's single-step window fired; its rerun was quiet)
    kws = [dict(units=4, ag_us=40, fwd_us=100, bwd_us=200, rs_us=50, prefetch=True, steps=1,
                step_skew_us=1000 if r == 1 else 0, first_ag_wait_us=0 if r == 1 else 1000) for r in range(4)]
    run, rep = _report(tmp_path / "one", *kws)
    st = next(s for s in rep.rules if s.code == "straggler.trace")
    assert st.status == "quiet" and st.reason.endswith("in 1 complete profiled step: one step is not a pattern"), st
    # a rank slower on its own whom the others do not wait for as long (the trial: +88 ms, waits 3.5 ms longer)
    kws = [dict(units=4, ag_us=40, fwd_us=100, bwd_us=200, rs_us=50, prefetch=True,
                step_skew_us=1000 if r == 1 else 0, first_ag_wait_us=0 if r == 1 else 200) for r in range(4)]
    run, rep = _report(tmp_path / "nowait", *kws)
    st = next(s for s in rep.rules if s.code == "straggler.trace")
    assert st.status == "quiet" and "but the others wait" in st.reason, st


# Each rank's own work per profiled step (ms: the step less its exposed communication), as read from a new-user
# trial's plain gloo traces (2 ranks on a 2-core host at load ~8, 4 complete steps; the same script, in the last
# with rank 1 sleeping 50 ms every step)
TRIAL_OWN_MS = {
    "root": ((43.8, 97.2, 32.3, 59.0), (92.0, 62.0, 88.9, 57.2)),  # the slower rank changes: rank 1 in 2 of 4
    "async": ((77.9, 61.2, 25.6, 33.0), (71.7, 74.7, 85.2, 57.0)),  # rank 1 in 3 of 4, by -6.2 to +59.6 ms
    "sleep": ((43.0, 42.1, 25.4, 24.5), (76.0, 76.1, 75.4, 88.4)),  # the 50 ms sleep: +33.0 to +63.9 ms in each
}


@pytest.mark.parametrize("case", list(TRIAL_OWN_MS))
def test_a_straggler_is_the_same_rank_step_after_step(tmp_path, case):
    """straggler.trace asks of the traces' steps what straggler.rank asks of the records': the same rank slower, in
    75% of the steps, by more than the step-to-step spread of its excess. The trial's ranks' own work per step is
    planted on the known-answer job (each rank's own host time, the faster waiting for the slower in its first
    all-gather): on the mean of its 4 steps rank 1 exceeded rank 0 by 16.95 and 22.75 ms, each named a straggler
    (7 of 20 such runs, none planted, the rank flipping), which silenced prefetch.exposed_allgather on rank 0."""
    own = TRIAL_OWN_MS[case]
    kws = [dict(units=4, ag_us=40, fwd_us=100, bwd_us=200, rs_us=50, prefetch=True, world_size=2, steps=4,
                step_skew_us=[1e3 * ms for ms in own[r]],
                first_ag_wait_us=[1e3 * (max(both) - both[r]) for both in zip(*own)]) for r in range(2)]
    _, rep = _report(tmp_path, *kws)
    # each step's own work, from its wall time less its exposed communication: the planted excess, step by step
    per = rep.overlap.per_rank
    steps = sorted(per["0"].step_exposed_ms, key=int)
    got = [(per["1"].step_times_ms[st] - per["1"].step_exposed_ms[st])
           - (per["0"].step_times_ms[st] - per["0"].step_exposed_ms[st]) for st in steps]
    assert got == pytest.approx([b - a for a, b in zip(*own)], abs=0.01)
    for pr in per.values():  # the steps' exposed communication is the rank's, split by step
        assert sum(pr.step_exposed_ms.values()) == pytest.approx(pr.exposed_ms_per_step * pr.step_count)
    st = next(s for s in rep.rules if s.code == "straggler.trace")
    ag = next(s for s in rep.rules if s.code == "prefetch.exposed_allgather")
    if case == "sleep":
        f = _by_code(rep)["straggler.trace"]
        assert f.ranks == [1] and f.title.startswith("Rank 1 is a straggler: +45.2"), f.title
        assert f.evidence["own_ms_per_step"] - f.evidence["others_own_ms_median"] == pytest.approx(45.225, abs=0.01)
        assert "the straggler" in ag.reason
        return
    assert st.status == "quiet", st
    assert st.reason == {
        "root": "rank 1 is the slowest on the mean (+16.95 ms of its own work per step), but by 15% in 2 of 4 steps "
                "only (a straggler is slower in 75% of them): not the same rank step after step (host noise, or a "
                "rank late now and then)",
        "async": "rank 1 is slower in 3 of 4 steps, by 18.75 ms per step (median), within the step-to-step spread "
                 "of the other ranks' own work (24.41 ms, standard deviation): host noise on like ranks, not one "
                 "rank the others wait for"}[case]
    # no straggler: the all-gather waits are read on every rank (rank 0's waits for rank 1 are exposed all-gathers)
    assert ag.status == "fired" and "the straggler" not in ag.reason, ag


def test_rules_quiet_with_a_reason_when_evidence_is_missing(tmp_path):
    # a CPU/gloo trace: the GPU-only rules say why they are quiet
    gloo_known_trace().write(tmp_path / "cpu" / "rank0.json")
    run = load_run(tmp_path / "cpu")
    ctx = Context(run=run, report=build_report(run))
    for cls in (ExposedReduceScatter, NcclOnComputeStream, CommunicationBound, SmallCollectives):
        rule = cls()
        assert rule.match(ctx) == [] and "GPU trace" in rule.why_quiet
    rule = TraceStraggler()
    assert rule.match(ctx) == [] and "two or more ranks" in rule.why_quiet
    # all-gathers without NCCL message-size args: no size, no small-collectives verdict
    fsdp_gpu_trace(units=48, ag_us=20, fwd_us=10, nelems=None).write(tmp_path / "nosize" / "rank0.json")
    run = load_run(tmp_path / "nosize")
    rule = SmallCollectives()
    assert rule.match(Context(run=run, report=build_report(run))) == [] and "message sizes" in rule.why_quiet
    rule = CommunicationBound()
    assert rule.match(Context(run=run, report={})) == [] and rule.why_quiet == "no verdict"


def test_terminal_prints_the_verdict_first_within_100_columns(tmp_path):
    from rich.console import Console

    from fsdp_doctor.present.terminal import render_report

    _, rep = _report(tmp_path, *[dict(units=48, ag_us=20, fwd_us=10, bwd_us=20, rs_us=20, nelems=65536)] * 2)
    console = Console(width=100, record=True, color_system=None)
    render_report(rep, console)
    lines = console.export_text().splitlines()
    assert all(len(line) <= 100 for line in lines)
    first = next(i for i, line in enumerate(lines) if line.startswith("Verdict"))
    assert lines[first].startswith("Verdict: communication-bound (67% of the step")
    assert first < next(i for i, line in enumerate(lines) if "overlap" in line.lower())
    row0 = next(line for line in lines if line.split()[:2] == ["0", "communication"])
    assert row0.split()[2:] == ["4.32", "ms", "33.3", "66.7", "22.2", "22.2", "22.2", "0.0", "0.0", "0.0", "0.0"]
