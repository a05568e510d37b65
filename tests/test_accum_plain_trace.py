"""accum.sync_every_micro_batch on plain torch.profiler traces (no doctor records): the micro-batches are the
reduce-scatters per unit per step, each unit's reduce-scatter input its unsharded gradients (output: its shard),
and the peak the trace's ``[memory]`` events'. A new-user trial (gradient accumulation over 2 micro-batches, a plain
gloo trace with profile_memory) read "at the cost of holding them (the predicted peak)" beside a null prediction,
"micro batches per step: —" beside a snippet saying 2, and its fix raised the peak 2.79 MiB (+12.7%) unwarned."""

from __future__ import annotations

import re

import pytest

from trace_fixtures import ProfileWindow, TraceBuilder
from fsdp_doctor.pipeline import build_report
from fsdp_doctor.store import load_run

CODE = "accum.sync_every_micro_batch"
UNITS = {"layers.0": 1000, "layers.1": 3000}  # float32 parameters per unit (the reduce-scatters' input elements)
WORLD = 2


def _accum_trace(rank: int, micro: int, memory: bool, shapes: bool) -> TraceBuilder:
    """A gloo trace of 2 units over ``micro`` micro-batches per ProfilerStep (steps 1 and 2 complete, 3 cut), each
    micro-batch 4000 µs from T = 10000 * i: forward of each unit (an all-gather, then compute), backward in reverse
    (compute, then its reduce-scatter: c10d's op, and gloo's event on its thread). ``shapes``: the c10d ops carry
    record_shapes' input dims (a unit's gradients and their shard); ``memory``: the CPU allocator's total is 1 MB
    at the step's start and 5 MB + 1000 * rank (the peak) in the last micro-batch's first backward."""
    b = TraceBuilder(rank=rank, world_size=WORLD)
    b.pid = b.main_tid = 100
    for i, n in enumerate((1, 2, 3)):
        T = 10000.0 * i
        b.step(n, T, 9900.0)
        if memory:
            b.memory(T + 5, 1_000_000)
        for m in range(micro):
            t = T + 10 + 4000.0 * m
            b.label("FSDP::root_pre_forward", t, 2)
            for k, (unit, elems) in enumerate(UNITS.items()):
                f = t + 10 + 1000 * k
                b.label(f"FSDP::pre_forward ({unit})", f, 120)
                b.label(f"FSDP::all_gather ({unit})", f + 5, 110)
                dims = {"Input Dims": [[elems // WORLD], [elems]], "Input type": ["float", "float"]} if shapes else {}
                b.op("c10d::_allgather_base_", f + 10, 100, **dims)
                b.gloo("all_gather", f + 20, 80)
                b.op("aten::mm", f + 200, 700)
            for k, (unit, elems) in enumerate(reversed(UNITS.items())):
                g = t + 2100 + 900 * k
                b.label(f"FSDP::pre_backward ({unit})", g, 20)
                b.op("autograd::engine::evaluate_function: MmBackward0", g + 30, 500)
                if memory and m == micro - 1 and k == 0:
                    b.memory(g + 300, 5_000_000 + 1000 * rank)
                b.label(f"FSDP::post_backward_reduce ({unit})", g + 600, 200)
                dims = {"Input Dims": [[elems], [elems // WORLD]], "Input type": ["float", "float"]} if shapes else {}
                b.op("c10d::_reduce_scatter_base_", g + 610, 180, **dims)
                b.gloo("all_reduce", g + 620, 150)
        b.op("Optimizer.step#AdamW.step", T + 9000, 500)
        if memory:
            b.memory(T + 9600, 1_000_000)
    return b


def _finding(tmp_path, **kw):
    for r in range(WORLD):
        _accum_trace(r, **kw).write(tmp_path / f"rank{r}.json")
    rep = build_report(load_run(tmp_path))
    hits = [f for f in rep.findings if f.code == CODE]
    assert hits, [(s.code, s.status, s.reason) for s in rep.rules if s.code == CODE]
    return rep, hits[0]


def _snippet_count(f) -> int:
    return int(re.search(r"\((\d+) per optimizer step in this run\)", f.recommendation.code).group(1))


def test_plain_trace_sizes_the_held_gradients_and_predicts_the_peak(tmp_path):
    rep, f = _finding(tmp_path, micro=2, memory=True, shapes=True)
    ev, p = f.evidence, f.predicted
    # the micro-batches: 2 reduce-scatters per unit per step, the same count in the evidence and in the snippet
    assert ev["reducescatters_per_unit_per_step"] == 2
    assert ev["micro_batches_per_step"] == _snippet_count(f) == 2
    # each unit's reduce-scatter input is its unsharded gradients, its output (over the 2 ranks) its shard
    full = 4 * sum(UNITS.values())
    assert ev["unsharded_grads_bytes"] == full and ev["sharded_grads_freed_bytes"] == full // WORLD
    # the peak the report shows (the trace's memory events, the highest rank's), holding the unsharded gradients
    # in place of the shards, as if it held every shard: the trace does not say which units had reduce-scattered at its
    # peak (an estimate, not a ceiling: the trial's run with the fix measured 4.1% above it)
    peak = rep.memory_section().peak_bytes
    assert peak == 5_000_000 + 1000 * (WORLD - 1)
    assert p.peak_bytes_before == peak and p.peak_bytes_after == peak + full - full // WORLD
    assert not p.peak_at_most
    assert "(the predicted peak: " in f.recommendation.text and "as if the peak held every shard" in f.recommendation.text


@pytest.mark.parametrize("memory, shapes", [(False, True), (False, False), (True, False)])
def test_plain_trace_says_no_prediction_it_does_not_make(tmp_path, memory, shapes):
    """Without memory events no peak is predicted, and without message sizes (gloo without record_shapes) the
    gradients' size is not known: the text says so, and refers to no predicted peak."""
    _, f = _finding(tmp_path, micro=2, memory=memory, shapes=shapes)
    ev, p, text = f.evidence, f.predicted, f.recommendation.text
    assert ev["micro_batches_per_step"] == _snippet_count(f) == 2
    assert p.peak_bytes_after is None and "predicted peak" not in text
    if shapes:
        assert ev["unsharded_grads_bytes"] == 4 * sum(UNITS.values())
        assert "profile_memory=True" in text
    else:  # (not "sharded grads freed: 0 B": a new-user trial's evidence)
        assert ev["unsharded_grads_bytes"] is None and ev["sharded_grads_freed_bytes"] is None, ev
        assert "record_shapes=True" in text
    assert ev["comm_buffers_freed_bytes"] is None, ev  # (no HSDP all-reduce waiting for the last micro-batch)


@pytest.mark.slow
def test_real_plain_traces_size_the_model_gradients(tmp_path):
    """2 gloo ranks, 2 micro-batches per step, plain traces with profile_memory and record_shapes: the unsharded
    gradients are the model's parameters in float32, their shards half of them, and the predicted peak the one the
    report shows with them in place of the shards. (Not checked against a run with the fix here: a CPU trace's
    peak moves from run to run by a unit's reduce-scatter buffer, up to 0.79 MB of this run's 9 MB, where the
    profiler's tally misses a free on gloo's thread; the trial's run with the fix measured 4.1% above the prediction.)"""
    workloads = pytest.importorskip("fsdp_doctor.workloads")
    from fsdp_doctor.workloads.gpt import GPT

    hook = ProfileWindow(tmp_path, warmup=1, active=3, profile_memory=True, record_shapes=True)
    cfg = workloads.WorkloadConfig(steps=hook.steps_needed(), d_model=128, n_layers=2, seq_len=64, grad_accum=2)
    workloads.launch(cfg, nproc=2, on_step=hook, timeout_s=300)
    rep = build_report(load_run(tmp_path))
    (f,) = [f for f in rep.findings if f.code == CODE]
    ev, p = f.evidence, f.predicted
    assert ev["micro_batches_per_step"] == _snippet_count(f) == 2
    full = 4 * sum(x.numel() for x in GPT(cfg).parameters())
    assert ev["unsharded_grads_bytes"] == full and ev["sharded_grads_freed_bytes"] == full // 2
    assert p.peak_bytes_before == rep.memory_section().peak_bytes
    assert p.peak_bytes_after == p.peak_bytes_before + full - full // 2 and not p.peak_at_most


def _micro_batch_steps_trace(rank: int, micro: int, every: bool) -> TraceBuilder:
    """A gloo trace of a loop calling prof.step() per micro-batch: ProfilerSteps 1..2*micro hold one micro-batch
    each (the last, cut), optimizer.step() in every ``micro``-th (steps micro, 2*micro). Each micro-batch's forward
    all-gathers each unit, its backward reduce-scatters each unit (``every``) or, with
    set_requires_gradient_sync(is_last_micro_batch), only in the step of the optimizer."""
    b = TraceBuilder(rank=rank, world_size=WORLD)
    b.pid = b.main_tid = 100
    for i in range(2 * micro + 1):
        n, T = i + 1, 5000.0 * i
        b.step(n, T, 4900.0)
        last = n % micro == 0
        b.label("FSDP::root_pre_forward", T + 10, 2)
        for k, unit in enumerate(UNITS):
            f = T + 20 + 1000 * k
            b.label(f"FSDP::pre_forward ({unit})", f, 120)
            b.label(f"FSDP::all_gather ({unit})", f + 5, 110)
            b.op("c10d::_allgather_base_", f + 10, 100)
            b.gloo("all_gather", f + 20, 80)
            b.op("aten::mm", f + 200, 700)
        for k, unit in enumerate(reversed(list(UNITS))):
            g = T + 2100 + 900 * k
            b.label(f"FSDP::pre_backward ({unit})", g, 20)
            b.op("autograd::engine::evaluate_function: MmBackward0", g + 30, 500)
            if every or last:
                b.label(f"FSDP::post_backward_reduce ({unit})", g + 600, 200)
                b.op("c10d::_reduce_scatter_base_", g + 610, 180)
                b.gloo("all_reduce", g + 620, 150)
        if last:
            b.op("Optimizer.step#AdamW.step", T + 4200, 500)
    return b


def test_profiler_steps_of_micro_batches_count_per_optimizer_step(tmp_path):
    """A new-user trial (HF Llama, 4 micro-batches without set_requires_gradient_sync(False), 2 gloo ranks) called
    prof.step() per micro-batch: each ProfilerStep reduce-scattered each unit once and the rule read "1 reduce-scatter
    per unit per step", quiet. Its steps without an optimizer.step() are micro-batches: per optimizer step, the
    count times the steps per optimizer step; with the fix pasted, quiet."""
    for r in range(WORLD):
        _micro_batch_steps_trace(r, micro=2, every=True).write(tmp_path / "bad" / f"rank{r}.json")
        _micro_batch_steps_trace(r, micro=2, every=False).write(tmp_path / "fixed" / f"rank{r}.json")
    rep = build_report(load_run(tmp_path / "bad"))
    assert [pr.steps_without_optimizer for pr in rep.overlap.per_rank.values()] == [[1, 3], [1, 3]]
    f = next((f for f in rep.findings if f.code == CODE), None)
    assert f is not None, [(s.code, s.status, s.reason) for s in rep.rules if s.code == CODE]
    assert f.evidence["reducescatters_per_unit_per_step"] == 2 and f.evidence["micro_batches_per_step"] == 2
    assert "your loop calls prof.step() per micro-batch" in f.recommendation.text
    assert "(at least 2 per optimizer step):" in f.recommendation.code
    # the header says the report's steps are micro-batches (its step table and verdict read them as steps unsaid)
    assert rep.run.notes == ["the profiled steps are micro-batches: 2 of 4 hold no optimizer.step() (rank 0: "
                             "prof.step() called per micro-batch, one optimizer step per 2 of them), so the step "
                             "times, the verdict's step and the per-step figures are per micro-batch, not per "
                             "optimizer step"], rep.run.notes
    rep = build_report(load_run(tmp_path / "fixed"))
    assert not [f for f in rep.findings if f.code == CODE]
    assert next(s for s in rep.rules if s.code == CODE).status == "quiet"
