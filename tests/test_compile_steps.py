"""Runs under torch.compile (a new-user trial: FSDP2 with inductor on CPU, 2 gloo ranks): the steps in which
torch.compile compiled are read from Dynamo's own timing table, named as compilation and left out of the step
statistics; an outlier of a run whose forward and backward were not recorded claims no phase; a compiled step
function the doctor was not given is a note of the header, not a problem (exit 3); a forward all-gather wait
inside a compiled call reads unknown in the evidence."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from fsdp_doctor.records import RunConfig, StepRecord, UnitConfig, UnitStep
from fsdp_doctor.store import Run
from fsdp_doctor.store.reader import RankData


def test_the_compile_clock_reads_each_compile_once():
    """A function compiled (Dynamo's frame), called again (nothing), recompiled for a new shape (one more frame),
    and a compiled module's backward, which AOT autograd compiles lazily at the first backward."""
    import torch

    from fsdp_doctor.record.compile_time import CompileClock

    torch._dynamo.reset()
    clock = CompileClock()
    assert clock.take() == (0, 0.0)
    f = torch.compile(lambda x: (x.sin() * 2).sum(), backend="aot_eager", dynamic=False)
    f(torch.randn(4))
    n, ms = clock.take()
    assert n == 1 and ms > 0
    f(torch.randn(4))
    assert clock.take() == (0, 0.0)
    f(torch.randn(7))  # a shape change: a recompile
    n, ms = clock.take()
    assert n == 1 and ms > 0
    class Net(torch.nn.Module):  # (torch.nn's own modules' frames are not compiled on their own)
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x).relu()

    lin = Net()
    lin.compile(backend="aot_eager")
    loss = lin(torch.randn(2, 4)).sum()
    assert clock.take()[0] == 1  # the forward's frame
    loss.backward()
    n, ms = clock.take()
    assert n == 1 and ms > 0  # the backward, compiled at its first call
    torch._dynamo.reset()  # (clears the table: nothing new is read as new)
    assert clock.take() == (0, 0.0)


def _step(rank, k, *, wall, fwd=30.0, bwd=40.0, opt=8.0, wait=10.0, compiles=0, compile_ms=0.0):
    return StepRecord(rank=rank, step=k, start_ns=k, wall_ms=wall, forward_ms=fwd + (wall - 80.0),
                      backward_ms=bwd, optimizer_ms=opt, outside_ms=2.0, compiles=compiles, compile_ms=compile_ms,
                      units=[UnitStep(name="", fwd_ms=fwd, ag_wait_fwd_ms=wait, bwd_ms=bwd)])


def _run(steps: dict) -> Run:
    from fsdp_doctor.store.reader import _mark_others_compiled

    run = Run(path="constructed")
    for r, st in steps.items():
        run.ranks[r] = RankData(rank=r, steps=st)
    _mark_others_compiled(run)
    return run


def test_a_recompile_is_named_as_compilation_and_left_out_of_the_statistics():
    """The trial's shape change at step 10 of 16 (each block compiled in place): both ranks recompiled, ~1.5 s. It
    read "compute +1595.8 ms in forward/backward/optimizer", kept in the statistics (p99 1526.8 ms, cv 184.4%)."""
    from fsdp_doctor.analyze.steps import analyze_steps, usable_steps
    from fsdp_doctor.present.fmt import apart_texts

    def rank(r, ms10):
        return [_step(r, k, wall=6000.0 if k == 0 else 1600.0 if k == 10 else 80.0 + (k % 3),
                      compiles=2 if k == 0 else 1 if k == 10 else 0,
                      compile_ms=5692.3 if k == 0 else ms10 if k == 10 else 0.0) for k in range(16)]

    run = _run({0: rank(0, 1351.4), 1: rank(1, 1484.2)})
    assert [s.step for s in usable_steps(run.ranks[0].steps)] == [k for k in range(1, 16) if k != 10]
    sec = analyze_steps(run)
    assert sec.per_rank["0"].p99_ms < 85.0 and sec.per_rank["0"].cv < 0.02  # (1526.8 ms and 184.4% before)
    assert [(o.rank, o.step, o.cause) for o in sec.outliers] == [(0, 10, "compilation"), (1, 10, "compilation")]
    assert sec.outliers[1].detail == "compilation: torch.compile compiled 1 graph (1484.2 ms)"
    assert sec.compiled["1"].steps == [0, 10] and sec.compiled["1"].graphs == 3 and sec.compiled["1"].excluded
    assert dict(apart_texts(sec))["compile"] == (
        "torch.compile compiled in steps 0, 10: 3 graphs, 7.18 s on rank 1; those steps are left out of the step "
        "statistics above")


def test_a_rank_waiting_for_another_ranks_compile_is_not_blamed_on_its_all_gather():
    """The trial's compiled optimizer step: rank 1 compiled ~1.1 s longer in step 0, and rank 0 waited for it in
    step 1's first all-gather: "all-gather wait +1092.3 ms (largest in unit (root): 1096.7 ms)", kept in its
    statistics (p99 1107.7 ms, cv 186%). Its records' figures."""
    from fsdp_doctor.analyze.steps import analyze_steps, usable_steps

    def rank(r):
        out = [_step(r, k, wall=48.0 + (k % 3), fwd=14.0, bwd=28.0, opt=1.0, wait=8.0) for k in range(12)]
        out[0] = _step(r, 0, wall=57244.0 if r == 0 else 58343.0, compiles=4,
                       compile_ms=55989.4 if r == 0 else 57021.0)
        return out

    steps = rank(0)
    steps[1] = _step(0, 1, wall=1173.0, fwd=1124.0, bwd=30.0, opt=1.0, wait=1103.0)
    run = _run({0: steps, 1: rank(1)})
    assert run.ranks[0].steps[1].others_compiled and not run.ranks[1].steps[1].others_compiled
    assert 1 not in [s.step for s in usable_steps(run.ranks[0].steps)]
    sec = analyze_steps(run)
    assert sec.per_rank["0"].max_ms < 60.0  # (p99 1107.7 ms before)
    (o,) = sec.outliers
    assert (o.rank, o.step, o.cause) == (0, 1, "compilation")
    assert o.detail == ("compilation: waiting for rank 1, late from its step 0, which compiled (torch.compile: "
                        "57021.0 ms)")
    assert sec.compiled["0"].waited == [1]


def test_an_outlier_claims_no_phase_the_doctor_did_not_record():
    """A compiled step function the doctor was not given (the trial's MODE=stepfn): forward_ms and backward_ms 0.0 in
    every step, outside_ms the whole step but the optimizer's. Step 9 of rank 1, 157.2 ms against 86.3 ms, read
    "time outside the model +59.3 ms (data loading or user code)"."""
    from fsdp_doctor.analyze.steps import find_outliers

    def step(k, wall):
        return StepRecord(rank=1, step=k, start_ns=k, wall_ms=wall, optimizer_ms=1.2, outside_ms=wall - 1.2)

    walls = [900.0, 86.3, 85.1, 87.0, 86.0, 88.2, 86.5, 85.9, 86.1, 157.2, 86.3]
    run = Run(path="constructed")
    run.ranks[1] = RankData(rank=1, steps=[step(k, w) for k, w in enumerate(walls)])
    (o,) = find_outliers(run)
    assert o.step == 9 and o.cause == "unrecorded", o
    assert o.detail == ("+70.9 ms in the model's forward or backward or outside the model, not told apart (forward "
                        "and backward not recorded)")
    assert "data loading" not in o.detail


def test_a_forward_in_a_frame_the_doctor_was_not_given_is_a_note_not_a_problem():
    """The line that says so is the header's (run.notes), not the report's last ("skipped: ..."), and the run exits 0:
    exit 3 says files or lines were skipped. Records written before this listed it among what torch did not let
    the recorder read (RunConfig.unavailable): read as a note too."""
    from fsdp_doctor.analyze.report import run_facts
    from fsdp_doctor.pipeline import build_report
    from fsdp_doctor.record.config_snapshot import FRAME_UNSEEN

    run = Run(path="constructed")
    cfg = RunConfig(rank=0, world_size=1, backend="gloo", device="cpu",
                    unavailable=[FRAME_UNSEEN, "torch 2.6: FSDPState._x not read"])
    run.ranks[0] = RankData(rank=0, config=cfg, steps=[
        StepRecord(rank=0, step=k, start_ns=k, wall_ms=90.0, outside_ms=90.0) for k in range(4)])
    assert run_facts(run).notes == [FRAME_UNSEEN]
    rep = build_report(run, diagnosis=False)
    assert FRAME_UNSEEN not in rep.problems and "torch 2.6: FSDPState._x not read" in rep.problems


def test_an_unknown_forward_wait_reads_unknown_in_the_evidence():
    """Blocks compiled in place, timed around their compiled call: their forward's all-gather wait is inside the
    call, "—" in the unit table; prefetch.sync_unshard's evidence read "AG wait fwd: 0 µs"."""
    from fsdp_doctor.diagnose import diagnose
    from fsdp_doctor.report_sections import Report
    from fsdp_doctor.units import evidence_labels, fmt_value

    base = dict(param_count=50_000, n_params=12, sharded_bytes=99_968, unsharded_bytes=199_936,
                orig_dtypes=["float32"], unshard_async_op=False)
    units = [UnitConfig(name="", modules=[""], is_root=True, **base),
             *(UnitConfig(name=f"layers.{i}", modules=[f"layers.{i}"], is_root=False, parent="", depth=1,
                          compiled_call_timed=True, **base) for i in range(3))]
    cfg = RunConfig(rank=0, world_size=2, backend="gloo", device="cpu", optimizer="AdamW", units=units)
    run = SimpleNamespace(config=cfg, ranks={}, path="constructed", has_records=True)

    def row(u, fwd_wait):
        timing = {"fwd_ms": 8.35, "ag_wait_fwd_ms": fwd_wait, "bwd_ms": 1.37, "ag_wait_bwd_ms": 0.35}
        return {**msgspec.to_builtins(u), "timing_p50": timing}

    def evidence(fwd_wait):
        report = msgspec.convert({"run": {"backend": "gloo", "device": "cpu"},
                                  "steps": {"per_rank": {"0": {"count": 8, "p50_ms": 80.0}}, "job": {"p50_ms": 80.0}},
                                  "units": [row(units[0], 4.31), *(row(u, fwd_wait) for u in units[1:])]}, Report)
        (f,) = [f for f in diagnose(run, report) if f.code == "prefetch.sync_unshard"]
        return f.evidence

    ev = evidence(None)
    assert ev["ag_wait_fwd_ms"] is None and ev["ag_wait_bwd_ms"] == 1.05
    assert fmt_value("ag_wait_fwd_ms", ev["ag_wait_fwd_ms"]) == "—"
    assert evidence_labels(ev)["ag_wait_fwd_ms"] == "AG wait fwd ms"
    assert evidence(0.5)["ag_wait_fwd_ms"] == 1.5  # measured waits: their sum, as before


@pytest.mark.compat
def test_the_recompile_limit_tap_reads_dynamos_warning_and_else_its_count():
    """Ten modules compiled in place, each guarded on a string of its own (never made dynamic, on 2.6 as on 2.13):
    the ninth hits the limit, Dynamo warns once, and the tap takes it with the code, the limit's name on this torch
    (2.6: cache_size_limit), its value, the last reason and the module whose call was running; with Dynamo's
    warnings turned off in this process's logging, the hit Dynamo counts is taken, its code unknown. The handler is
    Dynamo's logger's no more once removed."""
    import logging

    import torch
    import torch.nn as nn

    from fsdp_doctor.record import fsdp2 as F2
    from fsdp_doctor.record.compile_time import RecompileLimitTap

    class Block(nn.Module):
        def __init__(self, i):
            super().__init__()
            self.tag, self.lin = "b" * (i + 1), nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x) * len(self.tag)

    class Other(Block):  # (a code object of its own: Dynamo's cache of Block's is full, and runs it eager)
        def forward(self, x):
            return self.lin(x) + len(self.tag)

    def blocks(cls, n):
        out = [cls(i) for i in range(n)]
        for b in out:
            b.compile(backend="eager")
        return out, cls.forward.__code__

    torch._dynamo.reset()
    limit_name = next(iter(F2.dynamo_limits()))
    current, failed = [None], []
    tap = RecompileLimitTap(lambda: current[0], lambda where, e: failed.append((where, e)))
    handlers = list(F2.dynamo_logger().handlers)
    tap.install()
    quiet = logging.getLogger("torch._dynamo")
    level = quiet.level
    try:
        mods, code = blocks(Block, 10)
        for i, b in enumerate(mods):
            current[0] = f"layers.{i}"
            b(torch.randn(2, 4))
        (hit,) = tap.take()
        assert (hit.limit_type, hit.limit, hit.module) == (limit_name, 8, "layers.8"), hit
        assert (hit.function, hit.file, hit.line) == ("forward", code.co_filename, code.co_firstlineno), hit
        assert hit.reason and "\n" not in hit.reason
        assert tap.take() == []
        quiet.setLevel(logging.ERROR)  # (TORCH_LOGS="-dynamo", or a logging config)
        mods, _ = blocks(Other, 9)
        for b in mods:
            b(torch.randn(2, 4))
        (hit,) = tap.take()
        assert (hit.limit_type, hit.limit, hit.function, hit.module) == (limit_name, 8, "", ""), hit
    finally:
        quiet.setLevel(level)
        tap.uninstall()
        torch._dynamo.reset()
    assert F2.dynamo_logger().handlers == handlers and not failed
