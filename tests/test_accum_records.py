"""accum.sync_every_micro_batch without a profiler trace in the steps analysed (``watch(..., profile=False)``, a run
shorter than the first window, ``analyze --steps`` past it): the records count the backward passes per optimizer step
and those run with FSDP2's gradient sync on; the finding, its fix and its memory prediction are the trace's, and no
step time is predicted (the reduce-scatters' time needs the trace). The recorded run is torchtune 0.6.1's
full_finetune_distributed accumulating 2 micro-batches (traces/cpu/torchtune_recipe_accumulate), read whole (its
window at steps 5-8) and from step 9 on."""

from __future__ import annotations

from pathlib import Path

import fsdp_doctor
from fsdp_doctor.pipeline import window_run
from fsdp_doctor.records import RunConfig, StepRecord, UnitStep
from fsdp_doctor.store import Run, load_run
from fsdp_doctor.store.reader import STEPS_END, RankData

REPO = Path(__file__).resolve().parents[1]
CODE = "accum.sync_every_micro_batch"


def _finding(rep):
    found = [f for f in rep.findings if f.code == CODE]
    return (found[0] if found else None), next(s for s in rep.rules if s.code == CODE)


def test_past_the_window_the_records_give_the_same_fix_and_peak():
    run = load_run(REPO / "traces" / "cpu" / "torchtune_recipe_accumulate")
    whole, _ = _finding(fsdp_doctor.build_report(run))
    part, _ = _finding(fsdp_doctor.build_report(window_run(run, (9, STEPS_END))))
    assert whole is not None and part is not None
    assert part.severity == "warning" and part.title == ("2 reduce-scatters per unit per optimizer step: gradient "
                                                         "accumulation syncs every micro-batch") == whole.title
    assert (part.recommendation.code, part.recommendation.where) == (whole.recommendation.code,
                                                                     whole.recommendation.where)
    assert "self._model.set_requires_gradient_sync(is_last_micro_batch)" in part.recommendation.code
    assert part.evidence["measured_by"] == "records (no profiler trace)"
    assert part.evidence["unsharded_grads_bytes"] == whole.evidence["unsharded_grads_bytes"]
    assert part.predicted.peak_bytes_after == whole.predicted.peak_bytes_after == 13_225_952, part.predicted
    assert part.predicted.step_ms_after is None and whole.predicted.step_ms_after is not None
    assert "Their time is not measured without a profiler window" in part.recommendation.text


def _run(backwards: int, synced: int) -> Run:
    run = Run(path="constructed")
    for r in (0, 1):
        steps = [StepRecord(rank=r, step=k, start_ns=k, wall_ms=100.0, forward_ms=30.0, backward_ms=50.0,
                            optimizer_ms=15.0, outside_ms=5.0, backwards=backwards, synced_backwards=synced,
                            micro_batches=backwards, units=[UnitStep(name="layers.0")]) for k in range(8)]
        run.ranks[r] = RankData(rank=r, steps=steps, config=RunConfig(rank=r, world_size=2, backend="gloo",
                                                                      device="cpu"))
    return run


def test_records_with_sync_on_the_last_micro_batch_only_are_quiet():
    f, status = _finding(fsdp_doctor.build_report(_run(4, 1)))
    assert f is None and status.status == "quiet"
    assert status.reason == ("1 of the 4 backward passes per optimizer step ran with gradient sync on (the records; "
                             "no profiler trace in the steps analysed)")


def test_records_with_sync_on_every_micro_batch_fire_without_a_peak():
    """No unit snapshot or memory here: the finding and its fix, no figure it cannot have."""
    f, _ = _finding(fsdp_doctor.build_report(_run(4, 4)))
    assert f is not None and f.title.startswith("4 reduce-scatters per unit per optimizer step"), f
    assert f.predicted.peak_bytes_after is None and f.predicted.step_ms_after is None
    assert f.recommendation.where == "loop" and "model.set_requires_gradient_sync(is_last_micro_batch)" in \
        f.recommendation.code


def test_backward_passes_without_micro_batches_are_quiet():
    """Backward passes counted without a forward pass per unit for each (torchtitan's Trainer read 9 a step, 2 with
    gradient sync on, its trace 1 reduce-scatter per unit): no micro-batches, quiet."""
    run = _run(9, 2)
    for rd in run.ranks.values():
        for s in rd.steps:
            s.micro_batches = 1
    f, status = _finding(fsdp_doctor.build_report(run))
    assert f is None and status.status == "quiet" and status.reason.startswith(
        "the records count 9 backward passes per optimizer step, 2 with gradient sync on, but "), status.reason


def test_one_backward_per_step_is_quiet():
    f, status = _finding(fsdp_doctor.build_report(_run(1, 1)))
    assert f is None and status.status == "quiet" and "no backward passes per optimizer step" in status.reason


def test_a_chunked_loss_is_no_micro_batches_to_the_data_wait_words():
    """torchtitan's chunked loss: 9 backward() calls a step (8 through its head, one chunk each, then the rest), one
    forward of the model: jitter.data_wait's window is the time between optimizer.step() and the next forward, not
    also "between micro-batches"."""
    run = _run(9, 2)
    for rd in run.ranks.values():
        for s in rd.steps:
            s.micro_batches, s.outside_ms, s.between_ms = 1, 40.0, 40.0
    rep = fsdp_doctor.build_report(run)
    f = next(f for f in rep.findings if f.code == "jitter.data_wait")
    assert f.title.startswith("40% of each step is spent between optimizer.step() and the next forward (data "), f.title
    run = _run(4, 4)  # (micro-batches: the gaps between them are in that time too)
    for rd in run.ranks.values():
        for s in rd.steps:
            s.outside_ms, s.between_ms = 40.0, 40.0
    f = next(f for f in fsdp_doctor.build_report(run).findings if f.code == "jitter.data_wait")
    assert "next forward and between micro-batches (" in f.title, f.title
