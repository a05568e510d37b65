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
from fsdp_doctor.report_sections import CompileSteps
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


@pytest.mark.compat
def test_the_compile_clock_reads_the_graph_breaks_and_those_at_a_disabled_hook():
    """Dynamo's graph-break counter, read as it grew: a function that calls a hook the way FSDP2 calls each of its own
    (``torch._dynamo.disable(hook, recursive=True)(x)`` inside the compiled code) breaks twice, once at the call of
    disable (FSDP2's break: counted), once at the call of the function it wrapped, not FSDP's (not counted); a
    user-inserted break is not one; the counters cleared read nothing new. Alike on torch 2.6, 2.13 and 2.15, whose
    reasons are worded differently (the reasons below are theirs, as Dynamo gives them)."""
    import torch

    from fsdp_doctor.record.compile_time import CompileClock, at_disable

    torch._dynamo.reset()
    clock = CompileClock()
    assert clock.breaks() == (0, 0)

    def hook(x):
        return x.cos()

    def calls_hook(x):
        return torch._dynamo.disable(hook, recursive=True)(x.sin()) * 2

    def breaks(x):
        x = x.sin()
        torch._dynamo.graph_break()
        return x * 2

    torch.compile(calls_hook, backend="eager")(torch.randn(4))
    assert clock.breaks() == (2, 1)
    assert clock.breaks() == (0, 0)  # (nothing compiled since)
    torch.compile(breaks, backend="eager")(torch.randn(4))
    assert clock.breaks() == (1, 0)
    torch._dynamo.reset()
    assert clock.breaks() == (0, 0)
    fsdp = ["'skip function disable in file /venv/torch/_dynamo/decorators.py'",  # 2.6
            "Attempted to call function marked as skipped\n  Explanation: Dynamo developers have intentionally marked "
            "that the function `disable` in file `/venv/torch/_dynamo/decorators.py` should not be traced.",  # 2.13
            "Call to `torch._dynamo.disable()`\n  Explanation: `torch._dynamo.disable()` was called inside a compiled "
            "region.",  # 2.15
            "Skip calling `torch.compiler.disable()`d function\n  Explanation: Skip calling function `<function "
            "FSDPState._pre_forward at 0x7f>` since it was wrapped with `torch.compiler.disable`"]
    others = ["call torch._dynamo.disable() wrapped function <function hook at 0x7f4e>",
              "Skip calling `torch.compiler.disable()`d function\n  Explanation: Skip calling function `<function "
              "hook at 0x7fec>` since it was wrapped with `torch.compiler.disable` (reason: None)",
              "'skip function graph_break in file /venv/torch/_dynamo/decorators.py'",
              "Call to `torch._dynamo.graph_break()`\n  Explanation: User-inserted graph break. Message: None"]
    assert [at_disable(r) for r in fsdp] == [True] * 4 and [at_disable(r) for r in others] == [False] * 4


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
    assert sec.outliers[1].detail == "compilation: torch.compile compiled 1 time (1484.2 ms)"
    assert sec.compiled["1"].steps == [0, 10] and sec.compiled["1"].graphs == 3 and sec.compiled["1"].excluded
    assert dict(apart_texts(sec))["compile"] == (
        "torch.compile compiled in steps 0, 10: 3 compiles, 7.18 s on rank 1; those steps are left out of the step "
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
    # blocks inside the model's compiled frame (model = torch.compile(model) after sharding), timed from FSDP2's hooks:
    # both waits unknown (both read "0 µs", beside a unit table of "—")
    for u in units[1:]:
        u.compiled_call_timed, u.compiled_in_place, u.fsdp_hooks_timed = False, True, True
    ev = evidence(None)
    assert ev["ag_wait_fwd_ms"] is None and ev["ag_wait_bwd_ms"] is None, ev


def _whole_compiled_run(hooks_timed: bool) -> Run:
    """A constructed run of a model compiled whole after sharding: the root timed around its compiled call, two blocks
    inside the frame (timed from FSDP2's hooks, or, ``hooks_timed`` False, records before they were: the same step
    records, the units' forwards 0); 4 steps, the first left out."""
    base = dict(param_count=50_000, n_params=12, sharded_bytes=99_968, unsharded_bytes=199_936,
                orig_dtypes=["float32"], unshard_async_op=False)
    units = [UnitConfig(name="", modules=[""], is_root=True, compiled_call_timed=True, **base),
             *(UnitConfig(name=f"layers.{i}", modules=[f"layers.{i}"], is_root=False, parent="", depth=1,
                          compiled_in_place=True, fsdp_hooks_timed=hooks_timed, **base) for i in range(2))]
    cfg = RunConfig(rank=0, world_size=2, backend="gloo", device="cpu", optimizer="AdamW", units=units)
    fwd = [(900.0, 400.0, 400.0), (30.0, 10.0, 8.0), (31.0, 11.0, 9.0), (35.0, 12.0, 7.0)]
    bwd = [(0.0, 60.0, 50.0), (0.0, 20.0, 15.0), (0.0, 21.0, 16.0), (0.0, 22.0, 14.0)]
    run = Run(path="constructed")
    run.ranks[0] = RankData(rank=0, config=cfg, steps=[
        StepRecord(rank=0, step=k, start_ns=k, wall_ms=120.0, forward_ms=f[0] + 1.0, backward_ms=sum(b) + 5.0,
                   units=[UnitStep(name=u.name, fwd_ms=f[i] if hooks_timed or i == 0 else 0.0,
                                   fwd_calls=1 if hooks_timed or i == 0 else 0, bwd_ms=b[i])
                          for i, u in enumerate(units)])
        for k, (f, b) in enumerate(zip(fwd, bwd))])
    return run


def test_units_timed_from_fsdps_hooks_read_their_times_and_unknown_waits():
    """Known answers: the blocks inside the compiled frame read their recorded medians (forward 11 and 8 ms, backward
    21 and 15 ms), their all-gather waits unknown (None: "—", recorded 0.0), the root its own forward, 31 less 11 and 8
    (a root without parameters: no backward of its own); one line under the table says why the waits read "—". Records
    before the blocks were timed read them unknown, and the root's own time with them. The rules read such a unit
    untimed, as before: its waits are not apart."""
    from fsdp_doctor.analyze.report import unit_table
    from fsdp_doctor.diagnose.estimate import Unit
    from fsdp_doctor.present.fmt import units_hooks_timed_note

    rows = {u.name: u for u in unit_table(_whole_compiled_run(True))}
    for name, fwd, bwd in (("layers.0", 11.0, 21.0), ("layers.1", 8.0, 15.0)):
        t = rows[name].timing_p50
        assert (t.fwd_ms, t.fwd_self_ms, t.bwd_ms, t.bwd_self_ms) == (fwd, fwd, bwd, bwd), t
        assert t.ag_wait_fwd_ms is None and t.ag_wait_bwd_ms is None and t.recompute_ms == 0.0, t
        assert not Unit.of(rows[name]).has_timing
    root = rows[""].timing_p50
    assert root.fwd_ms == 31.0 and root.fwd_self_ms == 12.0 and root.bwd_self_ms is None, root
    assert units_hooks_timed_note(list(rows.values())) == (
        "AG wait —: 2 units in a compiled frame (layers.0, layers.1) timed by FSDP2's own hooks, whose spans hold each "
        "wait inside fwd and bwd; the doctor's hooks, which time it apart, would break the graph")
    old = {u.name: u for u in unit_table(_whole_compiled_run(False))}
    assert not old["layers.0"].timing_p50 and not old["layers.1"].timing_p50
    assert old[""].timing_p50.fwd_ms == 31.0 and old[""].timing_p50.fwd_self_ms is None
    assert units_hooks_timed_note(list(old.values())) is None


def test_the_compile_line_counts_the_graph_breaks_and_names_fsdps():
    """Known answers: the breaks of the steps that compiled, and of them those at FSDP2's hooks where units run inside
    the compiled frame (at a call of torch._dynamo.disable elsewhere: not said to be FSDP's)."""
    from fsdp_doctor.analyze.steps import compile_steps
    from fsdp_doctor.present.fmt import breaks_text

    steps = [StepRecord(rank=0, step=k, start_ns=k, wall_ms=80.0, compiles=c, compile_ms=c * 100.0, graph_breaks=g,
                        disable_breaks=d) for k, (c, g, d) in enumerate([(5, 4, 3), (0, 0, 0), (1, 1, 1), (0, 0, 0)])]
    framed, elsewhere = compile_steps(steps, fsdp_framed=True), compile_steps(steps)
    assert (framed.graphs, framed.graph_breaks, framed.fsdp_hook_breaks) == (6, 5, 4)
    assert (elsewhere.graph_breaks, elsewhere.fsdp_hook_breaks) == (5, 0)
    tail = " at FSDP2's hooks, which torch.compile runs outside its graphs: FSDP's, not the doctor's)"
    assert breaks_text(framed) == ", 5 graph breaks (4" + tail
    assert breaks_text(elsewhere) == ", 5 graph breaks"
    one = CompileSteps(steps=[0], graphs=2, ms_total=9.0, graph_breaks=1, fsdp_hook_breaks=1)
    assert breaks_text(one) == ", 1 graph break (" + tail[1:]
    two = msgspec.structs.replace(one, graph_breaks=2, fsdp_hook_breaks=2)
    assert breaks_text(two) == ", 2 graph breaks (both" + tail
    assert breaks_text(msgspec.structs.replace(one, graph_breaks=0, fsdp_hook_breaks=0)) == ""


#: the head of a 2-rank gloo worker of the reference GPT (3 blocks, 6 steps) under torch.compile: its imports and the
#: process group; the script's own loop follows it, indented in ``worker``
COMPILED_WORKER = """
import contextlib
import json
import os

import torch
import torch.distributed as dist


def worker(rank, port, out, fix):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    import fsdp_doctor
    from torch._dynamo.utils import counters
    from fsdp_doctor.workloads import WorkloadConfig
    from fsdp_doctor.workloads.data import batches
    from fsdp_doctor.workloads.train import build_training, next_token_loss

    cfg = WorkloadConfig(steps=6, n_layers=3, d_model=64)
"""
#: the reference GPT, each block and the root sharded, then compiled whole (``model = torch.compile(model)``, Dynamo's
#: eager backend: no C++ toolchain), trained 6 steps on 2 gloo ranks under watch(); each rank writes Dynamo's own
#: counters beside the run (``<out>.dynamo<rank>``, JSON)
WHOLE_COMPILED = COMPILED_WORKER + """    model, opt = build_training(cfg)
    model = torch.compile(model, backend="eager")
    data = batches(cfg, rank)
    with fsdp_doctor.watch(model, opt, out_dir=out, profile=False) as doctor:
        for _ in range(cfg.steps):
            tokens, targets = next(data)
            next_token_loss(model(tokens), targets).backward()
            opt.step()
            opt.zero_grad()
            doctor.step()
    with open(f"{out}.dynamo{rank}", "w") as f:
        json.dump({"graph_breaks": sum(counters["graph_break"].values()), "frames": counters["frames"]["total"]}, f)
    dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_model_compiled_whole_after_sharding_has_its_units_timed_from_fsdps_own_hooks(tmp_path):
    """``model = torch.compile(model)`` after fully_shard, 2 ranks: every unit but the root runs inside the compiled
    frame, where the doctor puts none of its hooks (they would add frames and graph breaks of their own). FSDP2's
    hooks run outside compiled code, and their logs time each unit's forward (its all-gather inside it) and backward:
    the unit table read "—" for every unit's four times, though the records held each one's backward. Now the times
    are the records' medians, the waits "—" with one line saying why, and the compile line says how many graph breaks
    Dynamo met, at FSDP2's hooks (4 in a new-user trial's Llama, said nowhere)."""
    import io
    import json

    from rich.console import Console

    from conftest import record_two_ranks
    from fsdp_doctor import load_run
    from fsdp_doctor.present.fmt import fmt_ms_cell
    from fsdp_doctor.present.terminal import render_units

    rep = record_two_ranks(tmp_path, WHOLE_COMPILED, "run")
    run = load_run(tmp_path / "run")
    inner = ["tok_emb, pos_emb", "layers.0", "layers.1", "layers.2", "norm, lm_head"]
    assert not any(e for rd in run.ranks.values() for e in rd.errors)
    units = {u.name: u for u in rep.units}
    assert [n for n, u in units.items() if u.compiled_in_place] == inner and units[""].compiled_call_timed
    for r, rd in run.ranks.items():
        for s in rd.steps[1:]:  # (the first compiled)
            by = {u.name: u for u in s.units}
            # each unit's forward, once, inside the model's compiled call; the root holds no parameters, so FSDP
            # brackets no backward of its own and the units' backwards lie one after the other within the step's
            assert all(by[n].fwd_calls == 1 and by[n].fwd_ms > 0 and by[n].bwd_ms > 0 for n in inner), (r, s)
            assert sum(by[n].fwd_ms for n in inner) < by[""].fwd_ms <= s.forward_ms, (r, s)
            assert sum(by[n].bwd_ms for n in inner) < s.backward_ms, (r, s)
    console = Console(file=io.StringIO(), width=100, color_system=None)
    console.print(render_units(rep.units, 100))
    text = console.file.getvalue()
    lines = {ln.split()[0]: ln.split() for ln in text.splitlines() if ln.strip().startswith("layers.")}
    for name in inner[1:4]:
        t = units[name].timing_p50
        assert t.ag_wait_fwd_ms is None and t.ag_wait_bwd_ms is None, t
        # the row: fwd, AG wait, bwd, AG wait, each unit's own (a block nests none: its own are its times)
        assert t.fwd_self_ms == t.fwd_ms and t.bwd_self_ms == t.bwd_ms, t
        assert lines[name][-4:] == [fmt_ms_cell(t.fwd_ms), "—", fmt_ms_cell(t.bwd_ms), "—"], (lines[name], t)
    why = ("AG wait —: 5 units in a compiled frame ([tok_emb, pos_emb], layers.0 … (+3)) timed by FSDP2's own hooks, "
           "whose spans hold each wait inside fwd and bwd; the doctor's hooks, which time it apart, would break the graph")
    assert why in " ".join(text.split()), text
    # the verdict from the records (no profiler window) says where the units' waits went: the root's forward one
    # inside its compiled call, the others' both inside their forward and backward ("the forward all-gather waits of
    # 6 units", the backward's unsaid)
    assert ("the forward all-gather waits of 1 unit compiled by torch.compile ((root)) are inside its forward, and "
            "the forward and backward ones of 5 units in a compiled frame ([tok_emb, pos_emb], layers.0, layers.1 … "
            "(+2)) inside their forward and backward: counted as compute here" in rep.verdict.job.summary), \
        rep.verdict.job.summary
    # the HTML report's table and the dashboard's say it under theirs too (the same rows)
    import html
    from types import SimpleNamespace

    from fsdp_doctor.dashboards.pages.common import Filters
    from fsdp_doctor.dashboards.pages.units import layout
    from fsdp_doctor.present.html import render_html

    assert html.escape(why) in render_html(rep)
    page = layout(SimpleNamespace(sections=lambda *a: SimpleNamespace(units=None), report=rep), Filters())
    assert why in str(page), str(page)[:3000]
    # the graph breaks Dynamo met compiling, each at FSDP2's hooks (a call of torch._dynamo.disable: 2 on torch 2.13
    # and 2.15, 3 on 2.6), all in the first step, as its own counter has them
    for r, rd in run.ranks.items():
        dynamo = json.loads((tmp_path / f"run.dynamo{r}").read_text())
        got = [(s.graph_breaks, s.disable_breaks) for s in rd.steps]
        assert got[0] == (dynamo["graph_breaks"],) * 2 and dynamo["graph_breaks"] > 0, (got, dynamo)
        assert set(got[1:]) == {(0, 0)}, got
        c = rep.steps.compiled[str(r)]
        assert c.graph_breaks == c.fsdp_hook_breaks == dynamo["graph_breaks"], c
    from fsdp_doctor.present.fmt import compile_text

    n = rep.steps.compiled["0"].graph_breaks  # (the line names the rank that compiled longest: as many)
    assert (f"{n} graph breaks ({'both ' if n == 2 else 'all '}at FSDP2's hooks, which torch.compile runs outside "
            "its graphs: FSDP's, not the doctor's)") in compile_text(rep.steps), compile_text(rep.steps)


#: the reference GPT sharded (embeddings, each block, [norm, lm_head]; the root holds no parameter) and given to
#: watch(), while the loop trains ``torch.compile(model)`` (Dynamo's eager backend), 6 steps on 2 gloo ranks; first
#: the same loop without the doctor, Dynamo reset between the two. Each rank writes both runs' losses and Dynamo's
#: counters beside the run (``<out>.dynamo<rank>``, JSON)
UNSEEN_COMPILED = COMPILED_WORKER + """    got = {}
    for watched in (False, True):
        torch._dynamo.reset()
        counters.clear()
        model, opt = build_training(cfg)
        compiled = torch.compile(model, backend="eager")
        data = batches(cfg, rank)
        doctor = fsdp_doctor.watch(model, opt, out_dir=out, profile=False) if watched else None
        losses = []
        with doctor if doctor is not None else contextlib.nullcontext():
            for _ in range(cfg.steps):
                tokens, targets = next(data)
                loss = next_token_loss(compiled(tokens), targets)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
                if doctor is not None:
                    doctor.step()
        got["watched" if watched else "plain"] = {
            "losses": losses, "graph_breaks": sum(counters["graph_break"].values()),
            "unique_graphs": counters["stats"]["unique_graphs"], "frames": counters["frames"]["total"]}
    with open(f"{out}.dynamo{rank}", "w") as f:
        json.dump(got, f)
    dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_compiled_wrapper_the_doctor_was_not_given_has_its_units_timed_from_fsdps_logs(tmp_path):
    """watch(model) while the loop trains ``torch.compile(model)``, 2 ranks: the doctor's hooks sit inside the
    wrapper's frame, where they do nothing. The first step said so once its backward ended, and every unit's forward
    read "—" and the step's forward 0 ms (its time outside the model: the verdict read input-bound, 55% of the step).
    Now FSDP2's first pre-forward logged with none of the doctor's hooks around it tells, in the first step: each
    unit's forward is timed from FSDP2's own pre/post-forward logs, as inside a compiled frame the doctor was given,
    and the step's forward from the same logs, from the first unit's pre-forward to the last one's post-forward (this
    root holds no parameter: FSDP2 logs no forward of its own, and it reads unknown); the backward from the first
    pre-backward to autograd's end. The units one after the other fill that span but for FSDP2's hooks' own work past
    their logs, Dynamo's guards and the model's add of its two embeddings between them: on this 2-core kind of host
    95-97% of it in steps 2-5 (24.9 of 26.0 ms), 73-75% in step 1, the first after compiling (on one rank, where no
    collective waits inside the units, 86-88%: 7.3 of 8.4 ms); so each step's sum is asked to lie within half the
    span, their median within 30% of it. Losses, graph breaks and graphs as without the doctor (Dynamo's frames are
    not: the doctor's own model and unit hooks, which return at once there, are 3 frames of their own, as before)."""
    import io
    import json
    import statistics

    from rich.console import Console

    from conftest import record_two_ranks
    from fsdp_doctor import load_run
    from fsdp_doctor.present.fmt import fmt_ms_cell, units_hooks_timed_note
    from fsdp_doctor.present.terminal import render_units
    from fsdp_doctor.record.config_snapshot import FRAME_UNSEEN

    rep = record_two_ranks(tmp_path, UNSEEN_COMPILED, "run")
    run = load_run(tmp_path / "run")
    inner = ["tok_emb, pos_emb", "layers.0", "layers.1", "layers.2", "norm, lm_head"]
    assert not any(e for rd in run.ranks.values() for e in rd.errors)
    assert [u.name for u in run.config.units if u.compiled_in_place and u.fsdp_hooks_timed] == inner
    root = next(u for u in run.config.units if u.name == "")
    assert root.compiled_in_place and not root.fsdp_hooks_timed
    # said in the first step's config, how it was timed first; the units timed from FSDP2's hooks and the root not
    assert rep.run.notes[0] == FRAME_UNSEEN and FRAME_UNSEEN not in rep.problems, rep.run.notes
    assert rep.run.notes[1:] == [
        "5 unit(s) run inside a compiled frame ([tok_emb, pos_emb], layers.0, layers.1, layers.2 … (+1)): the doctor "
        "was not given it, its hooks do nothing there; these units are timed from FSDP2's own hooks, which run outside "
        "compiled code (the units table says which times that leaves unknown)",
        "1 unit(s) run inside a compiled frame ((root)): the doctor's hooks do nothing there, so these units' timings "
        "are not recorded (no parameters of their own: FSDP2 logs no forward of theirs to time it from)"]
    ratios = []
    for r, rd in run.ranks.items():
        for s in rd.steps:  # the first step too: seen at its first pre-forward
            by = {u.name: u for u in s.units}
            assert all(by[n].fwd_calls == 1 and by[n].fwd_ms > 0 and by[n].bwd_ms > 0 for n in inner), (r, s)
            assert by[""].fwd_calls == 0 and s.backward_ms > 0, (r, s)
            fwd = sum(by[n].fwd_ms for n in inner)
            # (each rounded to the µs); their backwards one after the other within the step's
            assert 0.5 * s.forward_ms <= fwd <= s.forward_ms + 0.005, (r, s.step, fwd, s.forward_ms)
            assert sum(by[n].bwd_ms for n in inner) < s.backward_ms, (r, s)
            if s.step:
                ratios.append(fwd / s.forward_ms)
    assert statistics.median(ratios) >= 0.7, ratios
    # the report: the step split, the units' times in the table with the line on their waits, a verdict of them
    phases = rep.steps.per_rank["0"].phases_p50_ms
    assert phases["forward"] > 0 and phases["backward"] > 0, phases
    assert "jitter.data_wait" not in {f.code for f in rep.findings}
    assert rep.verdict.job.source == "records" and rep.verdict.job.bound != "input", rep.verdict.job
    # (the root, without parameters of its own, gathers nothing: not among the units whose waits are inside)
    assert ("the forward and backward all-gather waits of 5 units in a compiled frame ([tok_emb, pos_emb], layers.0, "
            "layers.1 … (+2)) are inside their forward and backward" in rep.verdict.job.summary), rep.verdict.job.summary
    console = Console(file=io.StringIO(), width=100, color_system=None)
    console.print(render_units(rep.units, 100))
    text = console.file.getvalue()
    lines = {ln.split()[0]: ln.split() for ln in text.splitlines() if ln.strip().startswith(("layers.", "(root)"))}
    units = {u.name: u for u in rep.units}
    for name in inner[1:4]:
        t = units[name].timing_p50
        assert lines[name][-4:] == [fmt_ms_cell(t.fwd_ms), "—", fmt_ms_cell(t.bwd_ms), "—"], (lines[name], t)
    assert lines["(root)"][-4:] == ["—"] * 4 and not units[""].timing_p50, lines["(root)"]
    why = units_hooks_timed_note(rep.units)
    assert why.startswith("AG wait —: 5 units in a compiled frame") and why in " ".join(text.split()), text
    # Dynamo as without the doctor: the same losses, graph breaks (at FSDP2's hooks) and graphs
    for r in run.ranks:
        got = json.loads((tmp_path / f"run.dynamo{r}").read_text())
        plain, watched = got["plain"], got["watched"]
        assert watched["losses"] == plain["losses"], got
        assert (watched["graph_breaks"], watched["unique_graphs"]) == (plain["graph_breaks"], plain["unique_graphs"])


@pytest.mark.slow
def test_steps_before_the_compiled_wrapper_trains_keep_the_doctors_own_timings(tmp_path):
    """The loop trains the model given to watch() for 2 steps, then ``torch.compile(model)`` (one gloo rank, the
    reference GPT, Dynamo's eager backend): steps 0-1 are timed by the doctor's own hooks (the forward's all-gather
    waits apart), from step 2 on from FSDP2's logs (none apart); the note says from which step, and how the steps
    before it were timed."""
    from conftest import run_one_rank
    from fsdp_doctor import load_run
    from fsdp_doctor.record.config_snapshot import unseen_note

    out, _ = run_one_rank(tmp_path, """
        from fsdp_doctor.workloads import WorkloadConfig
        from fsdp_doctor.workloads.data import batches
        from fsdp_doctor.workloads.train import build_training, next_token_loss

        torch.set_num_threads(1)
        cfg = WorkloadConfig(steps=5, n_layers=2, d_model=64)
        model, opt = build_training(cfg)
        compiled = torch.compile(model, backend="eager")
        data = batches(cfg, 0)
        with fsdp_doctor.watch(model, opt, out_dir=sys.argv[1], profile=False) as doctor:
            for step in range(cfg.steps):
                tokens, targets = next(data)
                next_token_loss((model if step < 2 else compiled)(tokens), targets).backward()
                opt.step()
                opt.zero_grad()
                doctor.step()
        """)
    run = load_run(out)
    inner = ["tok_emb, pos_emb", "layers.0", "layers.1", "norm, lm_head"]
    assert run.config.measured_notes[0] == unseen_note(True, 2), run.config.measured_notes
    assert unseen_note(True, 2).startswith(
        "the model's forward runs in a compiled frame the doctor was not given from step 2 on (steps 0-1 ran their "
        "forward outside it, timed by the doctor's own hooks): ")
    assert [u.name for u in run.config.units if u.fsdp_hooks_timed] == inner
    steps = run.ranks[0].steps
    assert not any(e for rd in run.ranks.values() for e in rd.errors)
    for s in steps:
        by = {u.name: u for u in s.units}
        # (the doctor's hooks count a grouped unit's calls per module: 2 of [tok_emb, pos_emb]; FSDP2 logs one span)
        assert all(by[n].fwd_calls >= 1 and by[n].fwd_ms > 0 for n in inner) and s.forward_ms > 0, s
        assert s.step < 2 or all(by[n].fwd_calls == 1 for n in inner), s
        # the doctor's hooks: the root's forward (the model's, holding its units'), each unit's wait apart
        assert (by[""].fwd_calls == 1) == (s.step < 2), s
        assert (s.step < 2) == any(by[n].ag_wait_fwd_ms > 0 for n in inner), s
        assert sum(by[n].fwd_ms for n in inner) <= s.forward_ms + 0.005, s


@pytest.mark.slow
def test_evaluation_through_a_compiled_wrapper_the_doctor_was_not_given_is_counted_apart(tmp_path):
    """watch(model) while the loop trains and evaluates ``torch.compile(model)`` (one gloo rank, Dynamo's eager
    backend): 3 forwards without gradients after steps 2 and 4. They read as time outside the model (the reference
    GPT: "time outside the model +26.4 ms (data loading or user code)" for an outlier step, jitter.recurring_outside
    on 2 of 7 steps, the verdict 29% input-bound); now each is timed from its units' FSDP2 logs, counted as a
    forward without gradients, and its steps are left out of the statistics, as the model's own hooks do for the
    plain model: on a root without parameters (the reference GPT: from its first unit's pre-forward to the last
    post-forward before the next) and on one holding them (its own post-forward ends each)."""
    from conftest import run_one_rank
    from fsdp_doctor import build_report, load_run

    out, _ = run_one_rank(tmp_path, """
        from torch.distributed.fsdp import fully_shard
        from fsdp_doctor.workloads import WorkloadConfig
        from fsdp_doctor.workloads.data import batches
        from fsdp_doctor.workloads.train import build_training, next_token_loss

        class Net(nn.Module):  # its root holds parameters (emb, head), its blocks are units
            def __init__(self):
                super().__init__()
                self.emb, self.head = nn.Embedding(512, 32), nn.Linear(32, 512)  # (the workload's vocabulary)
                self.blocks = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))

            def forward(self, x):
                return self.head(self.blocks(self.emb(x)))

        torch.set_num_threads(1)
        cfg = WorkloadConfig(steps=7, n_layers=2, d_model=64)
        gpt, gpt_opt = build_training(cfg)
        net = Net()
        for b in net.blocks:
            fully_shard(b)
        fully_shard(net)
        net_opt = torch.optim.AdamW(net.parameters())
        for name, model, opt in (("gpt", gpt, gpt_opt), ("net", net, net_opt)):
            compiled = torch.compile(model, backend="eager")
            data = batches(cfg, 0)
            with fsdp_doctor.watch(model, opt, out_dir=f"{sys.argv[1]}/{name}", profile=False) as doctor:
                for step in range(cfg.steps):
                    tokens, targets = next(data)
                    next_token_loss(compiled(tokens), targets).backward()
                    opt.step()
                    opt.zero_grad()
                    if step in (2, 4):
                        model.eval()
                        with torch.no_grad():
                            for _ in range(3):
                                compiled(tokens)
                        model.train()
                    doctor.step()
        """)
    for name in ("gpt", "net"):
        run = load_run(out / name)
        steps = run.ranks[0].steps
        assert not any(e for rd in run.ranks.values() for e in rd.errors), name
        assert [s.no_grad_forwards for s in steps] == [0, 0, 3, 0, 3, 0, 0], (name, steps)
        for s in steps:
            assert (s.no_grad_ms > 0) == (s.step in (2, 4)), (name, s)
        # step 4 (step 2 compiles the forward without gradients): its evaluation out of the time outside the model
        ordinary = sorted(s.outside_ms for s in steps[1:] if s.step not in (2, 4))
        assert steps[4].outside_ms < ordinary[-1] + 0.5 * steps[4].no_grad_ms, (name, steps[4], ordinary)
        report = build_report(run)
        assert report.steps.no_grad["0"].steps == [2, 4] and report.steps.no_grad["0"].excluded, report.steps.no_grad
        assert not [o for o in report.steps.outliers if o.step == 4], report.steps.outliers
        assert "jitter.recurring_outside" not in {f.code for f in report.findings}, name


@pytest.mark.slow
def test_units_inside_a_model_compiled_whole_open_device_spans_from_fsdps_logs(tmp_path):
    """The GPU tier's test of the same run (tests/test_gpu_timing.py) on the CPU: the model compiled whole after
    sharding, one gloo rank, 12 steps, the device timeline attached as on CUDA with torch.cuda.Event stood in for by
    the host's clock (tests/compiled_whole.py). FSDP2's pre/post-forward logs of the units inside the frame open and
    close their spans: on steps 0 and 10 (every UNIT_EVERY-th) each has a forward and a backward, within the root's
    and the phases as on a GPU, and, one clock for both, each forward the host's own for that unit."""
    import compiled_whole

    run = compiled_whole.record(tmp_path / "run", "cpu", "eager")
    assert not any(e for rd in run.ranks.values() for e in rd.errors)
    assert compiled_whole.check_device_unit_times(run, host_clock=True) == [0, 10]


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
