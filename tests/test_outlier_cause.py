"""The outlier table names the right cause when another rank was late."""

from __future__ import annotations


def test_outlier_waiting_for_a_rank_late_in_the_previous_step():
    """Rank 1 is late at the end of step 5 (its optimizer step runs 300 ms long, after rank 0 has finished step
    5): rank 0 waits for it in step 6's first all-gather. The outlier table names the late rank, not the
    all-gather wait (issue #23)."""
    from fsdp_doctor.analyze.steps import find_outliers
    from fsdp_doctor.records import StepRecord, UnitStep
    from fsdp_doctor.store import Run
    from fsdp_doctor.store.reader import RankData

    def step(n, *, opt=20.0, wait=5.0):
        fwd, bwd = 40.0 + wait, 40.0
        return StepRecord(rank=0, step=n, start_ns=n, wall_ms=fwd + bwd + opt + 5.0, forward_ms=fwd,
                          backward_ms=bwd, optimizer_ms=opt, outside_ms=5.0,
                          units=[UnitStep(name="layers.0", fwd_ms=fwd, ag_wait_fwd_ms=wait)])

    run = Run(path="constructed")
    run.ranks[0] = RankData(rank=0, steps=[step(n, wait=305.0 if n == 6 else 5.0) for n in range(1, 10)])
    run.ranks[1] = RankData(rank=1, steps=[step(n, opt=320.0 if n == 5 else 20.0) for n in range(1, 10)])
    out = {(o.rank, o.step): o for o in find_outliers(run)}
    assert out[(1, 5)].cause == "compute"  # the late rank's own step
    assert out[(0, 6)].cause == "late_rank" and "rank 1" in out[(0, 6)].detail
