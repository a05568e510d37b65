"""Step-jitter rules: GC pauses, time outside the model (in every step, or in some steps on every rank), straggler
ranks."""

from __future__ import annotations

import shlex
import statistics
from typing import NamedTuple, Optional

from msgspec import UNSET

from ...analyze.steps import (SHIFT_MIN_RATIO, SHIFT_MIN_SEPARATION, SHIFT_MIN_STEPS, STRAGGLER_MIN_CONSISTENCY,
                               STRAGGLER_MIN_FRACTION, STRAGGLER_MIN_MS, STRAGGLER_MIN_STEPS, device_outside_ms,
                               usable_steps)
from ...report_sections import StepStats
from .. import estimate as E
from .. import snippets as S
from ..base import Context, Rule, register
from ...units import fmt_ms, fmt_share, ranges_text, shift_at

# GC pauses that take this share of total step time are worth acting on (gc.freeze / fewer cycles).
GC_SHARE_MIN = 0.03
# ... or that explain at least this share of the outlier steps.
GC_OUTLIER_SHARE_MIN = 0.5
# The collector off inside steps, a collection every N steps between them (N at most GC_DEFER_MAX_STEPS): the
# reference cycles the loop makes wait for it, N steps' worth, at most GC_PILE_MAX objects (~0.1-0.3 GB). Where
# fewer than GC_DEFER_MIN_STEPS steps' cycles fit, the collector's work would only move between the steps (and a
# loop making 400k objects of cycles a step, its collector off, ran 60% slower on 2 gloo ranks: fresh memory for
# each step's cycles, where the collector had given the last step's back): the lever is the cycles' source, and
# freezing the set-up objects out of the full collections.
GC_PILE_MAX = 1_000_000
GC_DEFER_MAX_STEPS = 100
GC_DEFER_MIN_STEPS = 10
# A young collection's time per object it frees (400k objects of two-dict cycles a step: 40 ms of young collections
# on a 2-core CPU box): what the deferred collection costs a step, at least; the run's own young collections say
# what its host takes (a loaded host's Trainer: 27 ms for 70k objects a step, and the fix's one collection of 980k
# objects 443-488 ms), up to GC_NS_PER_OBJECT_MAX, past which their time is the survivors' traversal, not freeing
GC_NS_PER_OBJECT = 100
GC_NS_PER_OBJECT_MAX = 1000
# With the collector off the steps' own work slows by about as much as the deferred collection takes: each step's
# cycles take fresh memory where the collector had handed the last step's back (70k objects of cycles a step, a
# collection every 14 steps: the Trainer's forward, backward and optimizer 37 ms a step slower beside a 33 ms share of
# the collection, Lightning's 16 beside 17-20, torchtune's 14 beside 16-21; 400k a step ran 60% slower, see above)
GC_PILE_SLOWDOWN = 1.0
# One collection is not a pattern: the share is judged without the rank's largest single pause, and the
# outlier route needs at least this many GC outliers. (The doctor's own profiler window used to leave a
# 67-215 ms collection for a user step 3-6 steps later; it now collects in its own step, which like every
# profiled step is left out of the statistics: record/profiling.py.)
GC_MIN_OUTLIERS = 2
# Time outside the model (data loading, loss, user code) above this share of the median step starves the GPU.
OUTSIDE_SHARE_MIN = 0.15
#: jitter.data_wait: where the profiled steps' DataLoader took under this part of the time it measures, that time is
#: the loop's own code, and more loader workers would not shorten it (a Lightning Trainer's loop: 0.5 ms of 24.5)
LOADER_PART_MIN = 0.5
# Work outside the model in some steps only, on every rank at once (a save the doctor was not told of, an upload,
# a loader whose workers fall behind now and then): a step counts when its time outside the model exceeds the
# rank's median by this share of the median step (host noise on a shared machine reaches ~15%) ...
RECUR_MIN_FRACTION = 0.30
RECUR_MIN_STEPS = 2  # ... in at least this many steps (one event is not a pattern)
RECUR_STEADY_STEPS = 5  # ... of at least this many steady steps
# ... and it is a finding from this share of the steady steps' time, a warning from OUTSIDE_SHARE_MIN and 3 steps
RECUR_SHARE_NOTE = 0.05
RECUR_WARN_MIN_STEPS = 3


@register
class GcPauses(Rule):
    code = "jitter.gc"
    name = "Garbage-collection pauses"
    description = "Python's cyclic GC runs inside training steps and takes a material share of step time."
    needs = ("records",)
    severities = ("warning",)

    def match(self, ctx: Context):
        steps = E.steps(ctx)
        outliers = steps.outliers
        gc_out = [o for o in outliers if o.cause == "gc"]
        worst = None
        for r, st in steps.per_rank.items():
            if not st.count:
                continue
            share = st.gc_ms_total / st.wall_ms_total if st.wall_ms_total else 0.0
            if worst is None or share > worst[1]:
                worst = (int(r), share, st)
        if worst is None:
            return self.quiet("no steady step recorded")
        rank, share, st = worst
        out_share = len(gc_out) / len(outliers) if outliers else 0.0
        largest = _largest_pause_ms(ctx, rank)
        recurring = (st.gc_ms_total - largest) / st.wall_ms_total if st.wall_ms_total else 0.0
        if recurring < GC_SHARE_MIN and not (len(gc_out) >= GC_MIN_OUTLIERS and out_share >= GC_OUTLIER_SHARE_MIN):
            # no pattern: a single collection (or none of note)
            return self.quiet(f"GC takes {fmt_share(share, 1)} of rank {rank}'s step time, "
                              f"{fmt_share(recurring, 1, GC_SHARE_MIN)} without its largest pause "
                              f"(fires from {100 * GC_SHARE_MIN:.0f}%)"
                              + (f", and explains {len(gc_out)} of {len(outliers)} outlier steps" if outliers else ""))
        per_step = st.gc_ms_total / st.count
        p50 = st.p50_ms
        full = st.gc_full_ms_total / st.count if st.gc_full_ms_total is not UNSET else None
        made = st.gc_collected_total / st.count if st.gc_collected_total is not UNSET else None
        evidence = {"gc_ms_per_step": round(per_step, 3), "gc_collections": st.gc_count_total,
                    "gc_share_pct": round(100 * share, 2), "outlier_steps_from_gc": len(gc_out),
                    "outlier_steps": len(outliers), "largest_pause_ms": round(largest, 3), "step_p50_ms": p50,
                    "excluded": "steps of the doctor's profiler windows and their export (its own collection)"}
        if made is not None:
            evidence.update(gc_full_ms_per_step=round(full, 3), gc_collected_per_step=round(made))
        if st.gc_disabled_count_total and st.gc_disabled_ms_total >= st.gc_ms_total / 2:  # (UNSET is falsy)
            return self._collected_by_hand(rank, st, made, evidence)
        title = f"GC pauses take {fmt_share(share, 1)} of step time on rank {rank}"
        if made is None or made * GC_DEFER_MIN_STEPS <= GC_PILE_MAX:
            every = GC_DEFER_MAX_STEPS if not made else min(GC_DEFER_MAX_STEPS, int(GC_PILE_MAX // made))
            cost = _deferred_ms(per_step, full, made)  # the deferred collection, a step's share
            # (and the steps' own slowdown while the cycles pile up: the prediction's)
            slowdown = cost * GC_PILE_SLOWDOWN
            return [self.finding(
                "warning", title, {**evidence, "collect_every_steps": every},
                "Python's cyclic garbage collector pauses the training loop. Freeze the objects that live for the "
                "whole run after set-up, and collect at a moment of your choosing: every "
                f"{every} steps on all ranks at once, so that no rank waits for another's pause"
                + (f" ({made:,.0f} objects of reference cycles a step wait for it: {made * every:,.0f} at most, "
                   f"a pause of about {fmt_ms(cost * every)} each time at the pace this run's collections freed "
                   "them)." if made and made >= 1000 else "."),
                S.gc_between_steps(every), where="optimizer",
                predicted=_gc_gain(st, per_step, cost + slowdown),
                ranks=[rank],
            )]
        # the loop makes reference cycles every step: the collector must free them, off or on
        young = per_step - full
        freeze = full / p50 >= GC_SHARE_MIN if p50 else False
        return [self.finding(
            "warning", title, evidence,
            f"The loop makes reference cycles that only Python's cyclic garbage collector frees, {made:,.0f} objects "
            f"a step, and collecting them takes {young:.1f} ms a step. Turning the collector off would not remove "
            f"that work, only move it and let the cycles pile up ({made * GC_DEFER_MIN_STEPS:,.0f} objects in "
            f"{GC_DEFER_MIN_STEPS} steps). The lever is the code that makes them: for one step, "
            "gc.set_debug(gc.DEBUG_SAVEALL) keeps what the collector frees in gc.garbage, by type."
            + (f" The full collections, {full:.1f} ms a step, traverse every object set-up made as well: freezing "
               "those takes them out." if freeze else ""),
            S.GC_FROZEN if freeze else "", where="optimizer" if freeze else "",
            predicted=_gc_gain(st, full) if freeze else None,
            ranks=[rank],
        )]

    def _collected_by_hand(self, rank: int, st: StepStats, made: Optional[float], evidence: dict):
        """The collector off (gc.disable()), the pauses are the loop's explicit gc.collect() calls: a new-user trial
        that pasted this rule's fix (collect_between_steps every 50 steps) beside its own gc.collect() every 20
        steps was told to freeze and disable the collector again (12.2% of step time, one call every 15 steps).
        Turning nothing off is left: the calls' period is. Each call's time grows with the cycles it frees (that
        trial: 4-9 ms for 20k objects, 42-215 ms for 400k, the collector's set-up objects frozen), so fewer calls
        make fewer, longer pauses: no gain is predicted (that loop with the fix's calls alone, 4 of 478 ms in 243
        steps where 16 had taken 189 ms each: 13.9% of the step, 14.0% before), and at the period this rule advises
        it stays quiet."""
        n, ms = st.gc_disabled_count_total, st.gc_disabled_ms_total
        share = ms / st.wall_ms_total
        every = GC_DEFER_MAX_STEPS if not made else max(1, min(GC_DEFER_MAX_STEPS, int(GC_PILE_MAX // made)))
        often = f"{n / st.count:.1f} a step" if n >= st.count else f"one every {st.count / n:.0f} steps"
        calls = f"{n} in {st.count} steps ({often}), {ms / n:.1f} ms each"
        lever = ("for one step, gc.set_debug(gc.DEBUG_SAVEALL) keeps what the collector frees in gc.garbage, by "
                 "type")
        if n <= st.count // every + 1:  # (collections every `every` steps: at most this many in these steps)
            return self.quiet(
                f"rank {rank}'s GC pauses ({fmt_share(share, 1)} of its step time) are explicit gc.collect() calls with "
                f"the collector off, {calls}: at the period advised (every {every} steps) or rarer. Their time grows "
                "with the reference cycles they free" + (f" ({made:,.0f} objects a step)" if made else "")
                + f": fewer calls would only make longer pauses; the lever left is the code that makes them ({lever})")
        evidence.update(gc_disabled_collections=n, gc_disabled_ms_each=round(ms / n, 3),
                        gc_disabled_share_pct=round(100 * share, 2), collect_every_steps=every)
        return [self.finding(
            "warning", f"Explicit gc.collect() calls take {fmt_share(share, 1)} of step time on rank {rank} (the "
                       "collector is off)", evidence,
            "The collector is disabled (gc.disable()), so every pause here is an explicit gc.collect() call in the "
            f"loop: {calls}. Call it less often: every {every} steps, on all ranks at once (below, after "
            "optimizer.step()), and remove the loop's other gc.collect() calls"
            + (f" ({made:,.0f} objects of reference cycles a step wait for it: {made * every:,.0f} at most)"
               if made and made >= 1000 else "")
            + ". A call's time grows with the cycles it frees: fewer calls make fewer, longer pauses, and their time "
            f"together is the cycles' own, which only the code that makes them cuts ({lever}).",
            S.gc_collect_every(every), where="optimizer", ranks=[rank],
        )]


def _deferred_ms(per_step: float, full: Optional[float], made: Optional[float]) -> float:
    """A step's share of the deferred collection that frees ``made`` objects of cycles a step: at the time per object
    the run's young collections took to free them (``per_step`` less ``full`` ms, the collections' and the full ones'
    a step), within GC_NS_PER_OBJECT and GC_NS_PER_OBJECT_MAX. At 100 ns alone, a loaded host's Trainer freeing 70k
    objects a step was predicted 7 ms a step for it, where its one collection every 14 steps took 32."""
    if not made:
        return 0.0
    ns = (per_step - full) * 1e6 / made if full is not None else GC_NS_PER_OBJECT
    return made * min(GC_NS_PER_OBJECT_MAX, max(GC_NS_PER_OBJECT, ns)) * 1e-6


def _gc_gain(st: StepStats, gone: float, cost: float = 0.0):
    """The prediction of a fix that takes ``gone`` ms of GC pauses out of a step (a mean over the steps) and adds
    ``cost`` ms: on the median step, which loses its own pauses at most; where the pauses are mostly in some steps
    (the median step holds under half their mean: a full collection every few steps), on the mean step, said so. A
    Trainer's full collections every second step (22% of its time, 5 ms in the median step) were told a 5.6 ms gain
    of 429, where the fix pasted took its mean step from 515 to 402 ms (400 predicted on it) and its median from 431
    to 404."""
    per_step = st.gc_ms_total / st.count
    typical = (st.phases_p50_ms or {}).get("gc", per_step)  # (UNSET is falsy)
    if typical < per_step / 2 and st.mean_ms:
        return E.predicted(st.mean_ms, max(0.0, st.mean_ms - gone + cost), step_mean=True)
    return E.predicted(st.p50_ms, max(0.0, st.p50_ms - min(gone, typical) + cost))


def _largest_pause_ms(ctx: Context, rank: int) -> float:
    """The rank's largest GC pause in one steady step (0 when the run's steps are not at hand)."""
    from ...analyze.steps import usable_steps

    rd = ctx.run.ranks.get(rank) if getattr(ctx.run, "ranks", None) else None
    return max((s.gc_ms for s in usable_steps(rd.steps)), default=0.0) if rd is not None else 0.0


def _outside_ms(ctx: Context, rank, st: StepStats, measured: Optional[float] = None,
                between: Optional[bool] = None) -> float:
    """A rank's median time between optimizer.step() and the next forward: the host's where its records timed that
    window (``between`` None: where the phases have it), ``measured``, another clock's figure of it (``between``
    True), else all the host's time outside the model, which also holds the loss between forward and backward and
    the code between backward and the optimizer; without GC and without the collectives no FSDP unit issued there
    (a grad-norm log's full_tensor() per parameter, a loss all-reduce): those are optim.step_comm's, from the
    trace, and their gain is counted there once."""
    phases = st.phases_p50_ms or {}
    between = "between" in phases if between is None else between
    outside = measured if measured is not None else phases.get("between" if between else "outside", 0.0)
    comm = E.other_comm_between_ms(ctx, rank) if between else E.other_comm_loop_ms(ctx, rank)
    # (and without another FSDP model's forward and backward: a teacher's forward read as a 24-72% data wait, a
    # new-user trial)
    return max(0.0, outside - phases.get("gc", 0.0) - comm - phases.get("other_models", 0.0))


class _Share(NamedTuple):
    """One rank's time outside the model against its step, on the clock that measured it."""

    share: float
    outside_ms: float
    step_ms: float
    clock: str  # CLOCK_HOST | CLOCK_DEVICE | CLOCK_BOUND
    # the figure is (at most) the time between optimizer.step() and the next forward: the device's, or the host's
    # where its records timed that window; else the host's time outside the model
    between: bool


CLOCK_HOST = "host"  # the step records' outside_ms: CPU runs, and GPU runs without device times
CLOCK_DEVICE = "device"  # the CUDA events' time between the optimizer's end and the next forward
# GPU runs recorded before the events timed that: the device step's time outside its phases, which also holds the
# loss and the wait for the last reduce-scatters after backward, or the host's if lower (the host's alone under
# gradient accumulation). A bound, never a finding.
CLOCK_BOUND = "device, upper bound"


def _share(ctx: Context, rank, st: StepStats) -> _Share:
    """The rank's share of its step outside the model. On CUDA the host's figure holds every wait for the device
    (a ``loss.item()`` or a pageable ``.to(device)`` once per step spends the device's backlog there: up to 82% of
    the step on the H100 runs under traces/gpu, none of which has a slow loader), so where the recorder's events
    timed the device (``StepStats.device``) its view decides: the device idling between ``optimizer.step()`` and
    the forward, over the device's period."""
    dev = st.device if st.device is not UNSET else None
    timed = "between" in (st.phases_p50_ms or {})
    host = _outside_ms(ctx, rank, st)
    if dev is None or not dev.count or not dev.period_ms:
        return _Share(host / st.p50_ms, host, st.p50_ms, CLOCK_HOST, timed)
    if dev.outside_ms is not None:
        out = _outside_ms(ctx, rank, st, dev.outside_ms, between=True)
        return _Share(out / dev.period_ms, out, dev.period_ms, CLOCK_DEVICE, True)
    if dev.outside_phases_ms is not None:  # (None under gradient accumulation: the phases span each other)
        host = min(host, _outside_ms(ctx, rank, st, dev.outside_phases_ms, between=True))
    return _Share(host / dev.period_ms, host, dev.period_ms, CLOCK_BOUND, True)  # (an upper bound on that window)


def _loop_words(ctx: Context) -> str:
    """Whose host code the time between the steps is, in the words of the loop that drove the run."""
    if E.lightning_driven(ctx):
        return ("the Lightning Trainer's own work between batches (its hooks and callbacks, self.log calls, the "
                "batch's move to the device) and your training_step's code outside the model")
    if E.trainer_driven(ctx):
        return ("the Trainer's own work between steps (its callbacks, logging, the batch's move to the device) and "
                "your compute_loss's code outside the model")
    return "your loop's code between the steps"


def _other_models(ctx: Context) -> str:
    """What the time outside the model may hold besides data loading where another model's FSDP2 units are alive in
    the process ("" where none): a new-user trial's distillation read its frozen teacher's forward as a 41% data
    wait. Alive is not running (a Trainer's earlier model, still referenced), so it is said, not assumed."""
    others = E.other_fsdp_units(ctx)
    return (f" {others} FSDP2 unit(s) of another model are alive in this process: where that model runs between the "
            "steps (a teacher's forward, a GAN's other network), this time is its work, not the data's, and the "
            "levers above do not shorten it." if others else "")


@register
class DataWait(Rule):
    code = "jitter.data_wait"
    name = "Time outside the model"
    description = "Data loading and user code between steps take a material share of the step."
    needs = ("records",)
    severities = ("warning",)

    def match(self, ctx: Context):
        steps = E.steps(ctx)
        shares = {int(r): _share(ctx, r, st) for r, st in steps.per_rank.items()
                  if st.count and st.p50_ms and st.phases_p50_ms}
        if not shares:
            return self.quiet("no step phases measured (the time outside the model is unknown)")
        rank = max(shares, key=lambda r: shares[r].share)  # the first of equal shares
        top = shares[rank]
        # under gradient accumulation the host's window also holds the gaps between micro-batches (their loading)
        # (the backward passes where recorded: forwards feeding one backward leave no gap between micro-batches)
        # (and forward passes: records before the count of backward passes through the model read torchtitan's
        # chunked loss, each chunk's backward() its own, as 9 a step with one forward, "and between micro-batches")
        backwards = E.backward_passes(ctx)
        micro = E.micro_batches(ctx)
        many = (backwards is None or backwards > 1) and bool(micro) and statistics.median(micro.values()) > 1
        accum = " and between micro-batches" if many else ""
        if top.share < OUTSIDE_SHARE_MIN:
            on = {CLOCK_HOST: "", CLOCK_DEVICE: ", device clock", CLOCK_BOUND: ", an upper bound on the device clock"}
            what = (f"time between optimizer.step() and the next forward{accum if top.clock == CLOCK_HOST else ''}"
                    if top.between else "time outside the model")
            return self.quiet(f"{what} is at most {fmt_share(top.share, under=OUTSIDE_SHARE_MIN)} of the step "
                              f"(rank {rank}"
                              f"{on[top.clock]}; fires from {100 * OUTSIDE_SHARE_MIN:.0f}%)")
        if why := E.updated_between(ctx):  # (the time after optimizer.step() holds the model's own second pass)
            return self.quiet(f"{why}; the time outside the model holds that work, not data loading")
        ranks = [r for r, sh in shares.items() if sh.share >= OUTSIDE_SHARE_MIN]
        strag = {s.rank for s in steps.stragglers if s.phase == "outside"}
        if strag and set(ranks) <= strag:
            return self.quiet(f"the time outside the model is rank(s) {', '.join(map(str, ranks))}' own delay: "
                              "straggler.rank reports it")
        decided = [r for r in ranks if shares[r].clock != CLOCK_BOUND]
        if not decided:
            return self.quiet(
                f"on CUDA the host's time outside the model holds its waits for the device; this run's device times "
                f"were recorded before the recorder timed the device's idle before the forward, and bound it at "
                f"{fmt_share(top.share)} of the step (rank {rank}) together with the loss and the wait for the last "
                f"reduce-scatters after backward: not data loading for certain (fires from "
                f"{100 * OUTSIDE_SHARE_MIN:.0f}% on the device's own figure; record again to get it)")
        rank = max(decided, key=lambda r: shares[r].share)
        sh, st = shares[rank], steps.per_rank[str(rank)]
        phases = st.phases_p50_ms or {}
        comm = E.other_comm_between_ms(ctx, rank) if sh.between else E.other_comm_loop_ms(ctx, rank)
        # the figures are this rank's (its step p50 is not the job's of the step table): said first
        evidence = {"rank": rank, "outside_ms_p50": round(sh.outside_ms, 3), "step_p50_ms": round(sh.step_ms, 3),
                    "host_outside_model_ms_p50": phases.get("outside"),
                    "outside_share_pct": round(100 * sh.share, 1), "clock": sh.clock,
                    "collectives_outside_fsdp_ms": round(comm, 3),  # left to optim.step_comm, not counted here
                    "forward_ms_p50": phases.get("forward"), "backward_ms_p50": phases.get("backward")}
        if sh.clock == CLOCK_DEVICE:
            dev = st.device
            evidence.update(forward_ms_p50=dev.forward_ms, backward_ms_p50=dev.backward_ms,
                            before_forward_ms_p50=dev.before_forward_ms, after_model_ms_p50=dev.after_model_ms,
                            host_outside_ms_p50=round(_outside_ms(ctx, rank, st), 3))
        p50 = st.p50_ms
        loader = E.dataloader_ms(ctx, rank)
        if loader is not None:
            evidence["dataloader_ms_per_step"] = round(loader, 3)
        loop = loader is not None and loader < LOADER_PART_MIN * sh.outside_ms
        what = (f"the loop's own code: the DataLoader took {fmt_ms(loader)} of it" if loop else
                "data loading or user code")
        if loop:
            text = (f"In the profiled steps the DataLoader's next batch took {fmt_ms(loader)} a step of this "
                    f"{fmt_ms(sh.outside_ms)}: more loader workers would not shorten it. The rest is "
                    f"{_loop_words(ctx)}: read and log metrics (.item(), .cpu(), a metric's all-reduce) every N "
                    "steps rather than every step, and move per-step work out of callbacks. The profiler trace "
                    "shows that code on the main thread outside FSDP's labels and optimizer.step(). "
                    f"{S.NO_LOOP_CODE}")
        else:
            # pinned host memory speeds copies to a GPU; on a CPU-only run torch warns that there is no device for it
            pinned, pin = (" with pinned memory", "pin_memory=True, ") if E.on_gpu(ctx) else ("", "")
            took = (f" (in the profiled steps the DataLoader's next batch took {fmt_ms(loader)} a step)"
                    if loader is not None else "")
            text = ("Between optimizer.step() and the next forward the devices idle. Load batches in background "
                    f"workers{pinned} and prefetching (torch.utils.data.DataLoader(..., num_workers=4, {pin}"
                    "prefetch_factor=4, persistent_workers=True), the workers within the CPU cores each rank has), and "
                    f"move host-side work (logging, metrics, .item() calls) off the step's critical path{took}. "
                    f"{S.NO_PIPELINE_CODE}")
        return [self.finding(
            "warning",
            (f"The device idles {fmt_share(sh.share)} of each step between optimizer.step() and the next forward "
             f"({what})" if sh.clock == CLOCK_DEVICE else
             f"{fmt_share(sh.share)} of each step is spent between optimizer.step() and the next forward"
             f"{accum} ({what})" if sh.between else
             f"{fmt_share(sh.share)} of each step is spent outside the model ({what})"),
            evidence,
            text + _other_models(ctx) + _outside_since(ctx, rank),
            predicted={"step_ms_before": p50, "step_ms_after": round(p50 - sh.outside_ms, 3),
                       "peak_bytes_before": None, "peak_bytes_after": None},
            ranks=sorted(decided),
        )]


def _outside_since(ctx: Context, rank: int) -> str:
    """Where the step time rose mid-run by the rank's time outside the model (jitter.level_shift): that this time is
    the later part's, and what the earlier part spent there ("" otherwise). A new-user trial's loader slowed at step
    20 of 40 read "43% of each step" over steps that spent 1 ms there before it."""
    ls = E.steps(ctx).level_shift
    before, after = ((ls.phases_before_ms.get(str(rank)), ls.phases_after_ms.get(str(rank))) if ls is not None
                     else (None, None))
    if before is None or after is None or ls.ms_after <= ls.ms_before or after["outside"] - before["outside"] < (
            SHIFT_PHASE_PART * (ls.ms_after - ls.ms_before)):
        return ""
    if ls.drift_line:
        return (f" This time grew with the run, as the step time did (jitter.level_shift): "
                f"{fmt_ms(after['outside'])} a step outside the model in the latest steps, "
                f"{fmt_ms(before['outside'])} in the earliest (rank {rank}, medians).")
    return (f" Most of this time came with the change of step time {shift_at(ls)} (jitter.level_shift): "
            f"{fmt_ms(after['outside'])} a step outside the model from it on, {fmt_ms(before['outside'])} before it "
            f"(rank {rank}, medians).")


def _outside_by_step(ctx: Context, rd) -> Optional[dict[int, tuple[float, float]]]:
    """A rank's steady steps: step -> (time outside the model, the step's time), ms. On the CPU the host's (its GC
    pauses left to jitter.gc); on CUDA the device's between optimizer.step() and the forward, over the step and the
    idle before it (the host's time outside there holds its waits for the device: a loss.item() every N steps
    spends the device's backlog in that step), None where the recorder did not time it."""
    steps = usable_steps(rd.steps)
    if not E.on_gpu(ctx):
        return {s.step: (max(0.0, s.outside_ms - s.gc_ms), s.wall_ms) for s in steps}
    gpu = getattr(rd, "gpu", None) or {}
    out = {}
    for s in steps:
        g = gpu.get(s.step)
        x = device_outside_ms(g) if g is not None else None
        if x is not None:
            out[s.step] = (x, g.step_ms + (g.idle_before_ms or 0.0))
    return out or None


@register
class RecurringOutside(Rule):
    code = "jitter.recurring_outside"
    name = "Work outside the model in some steps"
    description = ("Every rank spends much longer outside the model in some steps than in the others (work done "
                   "every N steps that the doctor was not told of), a material share of the run's time.")
    needs = ("records",)
    severities = ("info", "warning")

    def match(self, ctx: Context):
        per = {}
        for r, rd in (ctx.run.ranks or {}).items():
            got = _outside_by_step(ctx, rd)
            if got is None:
                return self.quiet("on CUDA the time outside the model is the device's, which this run's records do "
                                  "not time per step (the host's holds its waits for the device)")
            per[int(r)] = got
        common = sorted(set.intersection(*(set(d) for d in per.values()))) if per else []
        if len(common) < RECUR_STEADY_STEPS:
            return self.quiet(f"{len(common)} steady steps common to the ranks (needs {RECUR_STEADY_STEPS})")
        excess: dict[int, dict[int, float]] = {}
        for r, d in per.items():
            base = statistics.median(d[st][0] for st in common)
            floor = max(STRAGGLER_MIN_MS, RECUR_MIN_FRACTION * statistics.median(d[st][1] for st in common))
            excess[r] = {st: d[st][0] - base for st in common if d[st][0] - base >= floor}
        hit = sorted(set.intersection(*(set(e) for e in excess.values())))
        if len(hit) >= RECUR_MIN_STEPS and (since := E.after_shift(ctx, hit, common)):  # (not every few steps)
            return self.quiet(f"every rank longer outside the model in {since}")
        some = sorted(r for r, e in excess.items() if len(e) >= RECUR_MIN_STEPS)
        if len(hit) < RECUR_MIN_STEPS:
            if some and len(per) > 1:
                return self.quiet(f"rank(s) {', '.join(map(str, some))} only spend much longer outside the model in "
                                  "some steps, not every rank at once (straggler.intermittent weighs one rank's "
                                  "late steps)")
            return self.quiet(f"no {RECUR_MIN_STEPS} steps in which every rank spends {100 * RECUR_MIN_FRACTION:.0f}% "
                              "of a step longer outside the model than in its other steps"
                              + (f" (step {hit[0]} only: one event is not a pattern)" if hit else ""))
        # every rank pays it; the figures of the rank it costs the largest share
        shares = {r: sum(excess[r][st] for st in hit) / sum(per[r][st][1] for st in common) for r in per}
        rank = max(shares, key=shares.get)
        share, ex = shares[rank], [excess[rank][st] for st in hit]
        typical = statistics.median(ex)
        every = E.period(hit, common)
        said = f"{len(hit)} of {len(common)} steady steps" + (f", every {every} steps" if every else "")
        if share < RECUR_SHARE_NOTE:
            return self.quiet(f"every rank spends {typical:.0f} ms longer outside the model in {said}: "
                              f"{fmt_share(share, 1, RECUR_SHARE_NOTE)} of the time (rank {rank}; "
                              f"fires from {100 * RECUR_SHARE_NOTE:.0f}%)")
        per_step = sum(ex) / len(common)
        clock = "the device idles" if E.on_gpu(ctx) else "every rank spends"
        # one stretch of consecutive steps, then no more, is no work done every few steps (a trial's loader slowed in
        # steps 15-24 of 40: "work done every few steps does this: a checkpoint save ...")
        severity = "warning" if share >= OUTSIDE_SHARE_MIN and len(hit) >= RECUR_WARN_MIN_STEPS else "info"
        evidence = {"steps": hit, "steps_checked": len(common), "every_n_steps": every,
                    "excess_ms": [round(x, 1) for x in ex], "outside_ms_median": round(statistics.median(
                        per[rank][st][0] for st in common), 3), "share_pct": round(100 * share, 1),
                    "cost_ms_per_step": round(per_step, 3), "rank": rank,
                    "measured_by": "device" if E.on_gpu(ctx) else "host"}
        if E.one_stretch(hit, common):
            return [self._stretch(ctx, severity, {**evidence, "consecutive": True}, typical, share, per_step, rank)]
        return [self.finding(
            severity, f"Every rank stops {typical:.0f} ms outside the model in {said} ({fmt_share(share)} of the "
            "time)", evidence,
            f"In steps {', '.join(map(str, hit))} {clock} {typical:.0f} ms more outside the model "
            f"than in the other steps, on every rank at once: {per_step:.1f} ms per step over the run, "
            f"{fmt_share(share)} of the time (rank {rank}). The median step does not show it. Work done every few "
            "steps does this: a checkpoint save the doctor was not told of (torch.distributed.checkpoint's saves it "
            "finds by itself; time another, a torch.save of a gathered state dict, with doctor.checkpointing(), and "
            "checkpoint.blocking weighs it), an upload or a log line that waits on the network, a data loader "
            "whose workers fall behind now and then"
            + (f", or one that starts its workers again at every epoch: if {every} steps is your epoch, "
               "DataLoader(..., persistent_workers=True) keeps them (a new-user trial's 3-batch epochs: 154 ms a "
               "step, 42 ms with it)" if every else "")
            + ". Do it less often, in the background, or off the training "
            "loop. What it is lives in your loop, which the doctor does not see: no code is offered.",
            ranks=sorted(per))]

    def _stretch(self, ctx: Context, severity: str, evidence: dict, typical, share, per_step, rank):
        """The finding where the steps longer outside the model are one stretch of consecutive steps, before and
        after which they were not: something outside the model slowed for a while, no work done every few steps."""
        hit = evidence["steps"]
        clock = "the device idled" if E.on_gpu(ctx) else "every rank spent"
        return self.finding(
            severity, f"Every rank spent {typical:.0f} ms more outside the model in steps {hit[0]}-{hit[-1]} "
            f"({len(hit)} in a row), then no longer ({fmt_share(share)} of the time)", evidence,
            f"In steps {hit[0]} to {hit[-1]}, {len(hit)} steps in a row, {clock} {typical:.0f} ms more outside the "
            "model than in the steps before and after them, on every rank at once: "
            f"{per_step:.1f} ms per step over the run, {fmt_share(share)} of the time (rank {rank}). Not work done "
            "every few steps: something outside the model slowed for a while and recovered. A data loader reading a "
            "slow part of the data set or a file system under load, another process on the host, an evaluation or a "
            "save the doctor was not told of do this. Look at what the loop and the host did in those steps. What it "
            "was lives in your loop or on your host, which the doctor does not see: no code is offered.",
            ranks=sorted(int(r) for r in ctx.run.ranks))


#: jitter.level_shift: one rank changed and the others waited for it where the others' own time changed by under this
#: part of that rank's
SHIFT_ONE_RANK_OTHERS = 1 / 3
#: a phase is named where it moved by this part of the step's change or more
SHIFT_PHASE_PART = 0.15
#: the later part's step this many times the earlier's or more, not in the model's own work: a warning
SHIFT_WARN_RATIO = 1.5

# what each phase's change says, (grew, shrank)
_SHIFT_WORDS = {
    "compute": ("the model's own work grew: its inputs (longer sequences, larger images or batches: a curriculum, a "
                "bucketing sampler), what it trains (layers unfrozen, fake quantization switched on, a second loss), "
                "or the cores it runs on (another process on them, a thermal limit)",
                "the model's own work shrank: shorter inputs, layers frozen, or the earlier steps still warming up "
                "(allocator, autotuning, caches)"),
    "outside": ("the time outside the model grew: the data loader falling behind (a data set past the page cache, "
                "slower storage, workers started again at an epoch) or code in your loop that started then (logging, "
                "evaluation, a callback)",
                "the time outside the model shrank: the data loader caught up (its cache warm) or code in your loop "
                "that stopped then"),
    "optimizer": ("the optimizer step grew: more parameters to update (layers unfrozen) or work added to it (a "
                  "gradient-norm log, a schedule's new phase)",
                  "the optimizer step shrank: fewer parameters to update, or work taken out of it"),
    "gc": ("garbage collection grew: objects left in reference cycles piling up since then (jitter.gc weighs it)",
           "garbage collection shrank"),
    "ag_wait": ("the waits for all-gathers grew: the collectives slowed (another job on the links, a slower route)",
                "the waits for all-gathers shrank"),
}
# what each phase's steady growth says (a drift: analyze.steps.SHIFT_DRIFT_SHARE)
_DRIFT_WORDS = {
    "compute": "the model's own work grows with the run: its inputs growing (a curriculum lengthening the sequences), "
               "or work added to it every step (a hook registered again in the loop, a cache it keeps filling)",
    "outside": "the time outside the model grows with the run: code in your loop whose work grows with every step (a "
               "metric or a log over everything so far, a list it appends to and walks again), or batches that grow",
    "optimizer": "the optimizer step grows with the run: work added to it every step (a hook or a callback registered "
                 "again in the loop, a list it walks)",
    "gc": "garbage collection grows with the run: objects that pile up step after step (a list of tensors, reference "
          "cycles: jitter.gc weighs it)",
    "ag_wait": "the waits for all-gathers grow with the run: the collectives slowing step after step (another job "
               "ramping up on the links)",
}
_SHIFT_PHASE = {"compute": "forward and backward compute", "outside": "outside the model", "optimizer": "optimizer",
                "gc": "GC", "ag_wait": "all-gather waits"}


def _shift_deltas(before: dict, after: dict) -> dict[str, float]:
    """A rank's change per phase (ms) across a level shift: compute is forward and backward without all-gather waits."""
    def compute(p):
        return p["forward"] + p["backward"] - p["ag_wait"]

    out = {k: after[k] - before[k] for k in ("outside", "optimizer", "gc", "ag_wait")}
    out["compute"] = compute(after) - compute(before)
    return out


def _window_words(windows: list[int], shift) -> str:
    """Which part of a level shift the profiler windows' steps lie in, in words ("" without windows)."""
    if not windows:
        return ""
    early = [w for w in windows if w <= shift.last_before]
    late = [w for w in windows if w >= shift.first_after]
    span = f"steps {windows[0]}-{windows[-1]}" if len(windows) > 1 else f"step {windows[0]}"
    if early and not late:
        return (f" The profiler window ({span}) lies in the earlier part: the verdict's and the trace's figures "
                "describe the steps before the change.")
    if late and not early:
        return f" The profiler window ({span}) lies in the later part: the trace's figures describe it."
    return f" Profiler windows ({span}) lie in both parts: the trace's figures mix them."


@register
class LevelShiftRule(Rule):
    code = "jitter.level_shift"
    name = "Step time changed mid-run"
    description = ("The step time changed mid-run and stayed (once, or more than once the same way), or grew steadily: "
                   "when and how fast, what changed (the phase, on every rank or on one), and that the step statistics "
                   "and the findings' figures mix the parts.")
    needs = ("records",)
    severities = ("info", "warning")

    def match(self, ctx: Context):
        steps = E.steps(ctx)
        ls = steps.level_shift
        if ls is None:
            return self.quiet(f"no cut of the steady steps every rank kept into two parts of {SHIFT_MIN_STEPS} steps "
                              f"or more whose medians differ {SHIFT_MIN_RATIO:g} times, with "
                              f"{100 * SHIFT_MIN_SEPARATION:.0f}% of each part's steps on its own side")
        deltas = {int(r): _shift_deltas(ls.phases_before_ms[r], ls.phases_after_ms[r]) for r in ls.phases_after_ms}
        change = ls.ms_after - ls.ms_before
        grew = change > 0
        own = {r: ls.phases_after_ms[str(r)]["own"] - ls.phases_before_ms[str(r)]["own"] for r in deltas}
        first = max(own, key=lambda r: own[r] if grew else -own[r])  # the rank whose own time moved most
        others = [r for r in own if r != first]
        one_rank = bool(others) and abs(own[first]) >= abs(change) / 2 and all(
            abs(own[r]) < SHIFT_ONE_RANK_OTHERS * abs(own[first]) for r in others)
        # the phases that moved, on that rank; one rank changing, its all-gather waits are not its own change
        d = deltas[first]
        named = sorted((k for k in d if (d[k] > 0) == grew and abs(d[k]) >= SHIFT_PHASE_PART * abs(change)
                        and not (one_rank and k == "ag_wait")), key=lambda k: -abs(d[k]))
        moved = ", ".join(f"{_SHIFT_PHASE[k]} {fmt_ms(d[k], signed=True)}" for k in named) or "no phase alone"
        if one_rank:
            waits = ", ".join(f"rank {r} {fmt_ms(deltas[r]['ag_wait'], signed=True)}" for r in others[:3])
            who = (f"on rank {first} (its own time {fmt_ms(own[first], signed=True)}: {moved}); the other ranks wait "
                   f"for it in their collectives (all-gather waits: {waits}{', ...' if len(others) > 3 else ''})")
            why = (f"Something on rank {first}'s host or in its code started then: another process on its cores, a "
                   "thread in your process holding the GIL (a spinning logger, a metrics thread), its data shard."
                   if grew else f"Something on rank {first} stopped then.")
        else:
            who = f"on every rank (rank {first}: {moved})" if others else f"in {moved}"
            key = named[0] if named else "compute"
            words = _DRIFT_WORDS[key] if ls.drift_line and grew else _SHIFT_WORDS[key][0 if grew else 1]
            why = words[0].upper() + words[1:] + "."
        # a slowdown by half or more that is not the model's own work (a loader, another process): a warning
        alarm = one_rank or named[:1] != ["compute"]
        evidence = {**{f"{k}_change_ms": round(v, 3) for k, v in d.items()},
                    "changed_rank_own_change_ms": round(own[first], 3),
                    "other_ranks_own_change_ms": max((round(own[r], 3) for r in others), key=abs, default=None)}
        ranks = [first] if one_rank else sorted(deltas)
        if ls.drift_line:
            return [self._drift(ctx, ls, f"From the earliest steps to the latest it {'grew' if grew else 'fell'} "
                                         f"{who}. {why}", alarm, evidence, ranks, first if one_rank else None)]
        ratio = ls.ms_after / ls.ms_before
        at = shift_at(ls)
        sides = ("every step of each part on its side of the midpoint between the two" if ls.separation >= 1 else
                 f"{100 * ls.separation:.0f}% or more of each part's steps on its side of the midpoint between the two")
        p50 = steps.job.p50_ms if steps.job is not None else None
        held = (f" The step statistics and every finding's figures hold {'every part' if ls.levels else 'both parts'} "
                f"(step p50 {fmt_ms(p50)} over the run, {fmt_ms(ls.ms_after)} now)." if p50 is not None else "")
        windows = sorted({w for pw in steps.profiler_steps.values() for w in pw.get("window", [])})
        parts = (f"two parts: {ls.steps_before} before step {ls.first_after} at {fmt_ms(ls.ms_before)} (median) and "
                 f"{ls.steps_after} from it on at {fmt_ms(ls.ms_after)}, {sides}" if not ls.levels else
                 f"{len(ls.levels)} levels, each a step time that stayed: "
                 + ", ".join(f"{fmt_ms(ms)} in steps {int(a)}-{int(b)}" for a, b, ms in ls.levels[:-1])
                 + f", {fmt_ms(ls.levels[-1][2])} from step {ls.last_from()} on (medians)")
        text = (f"The steady steps fall into {parts}. "
                f"The change is {who}. {why}{held}{_window_words(windows, ls)} "
                f"`fsdp-doctor analyze {shlex.quote(str(ctx.run.path))} --steps {ls.last_from()}-` reads the last part alone"
                + (" (with the profiler windows inside it); watch(..., profile=fsdp_doctor.ProfileSchedule(first=N)) "
                   "puts the next run's window at a step N after the change" if windows else "")
                + ". What changed is in your loop, your data or on your host, which the doctor does not see: no code "
                "is offered.")
        severity = "warning" if grew and ratio >= SHIFT_WARN_RATIO and alarm else "info"
        return [self.finding(
            severity,
            f"Step time {'rose' if grew else 'fell'} from {fmt_ms(ls.ms_before)} to {fmt_ms(ls.ms_after)} "
            f"({ratio:.2f}x) {at} and stayed" + (f", in {len(ls.levels) - 1} changes" if ls.levels else "")
            + (f", on rank {first}" if one_rank else ""),
            {"first_step_after": ls.first_after, "last_step_before": ls.last_before,
             "steps_before": ls.steps_before, "steps_after": ls.steps_after,
             "step_ms_before": ls.ms_before, "step_ms_after": ls.ms_after, "ratio": round(ratio, 3),
             "separated_pct": round(100 * ls.separation, 1), "rank": first if one_rank else None,
             "level_first_steps": [int(lv[0]) for lv in ls.levels], "level_ms": [lv[2] for lv in ls.levels],
             **evidence, "step_p50_ms_all": p50},
            text, ranks=ranks)]

    def _drift(self, ctx: Context, ls, change: str, alarm: bool, evidence: dict, ranks: list, rank):
        """The finding where the step time grew or fell steadily (``ls.drift_line``) rather than in levels (a loop
        whose work grew 2 ms every step read "4 levels, each a step time that stayed", with the flag to read the last
        "part" alone): ``change``, what changed and why, in words; ``alarm``: not the model's own work, or one
        rank's (``rank``)."""
        steps = E.steps(ctx)
        (a, ms_a), (b, ms_b) = ls.drift_line
        per_step = ls.drift_ms_per_step()
        ratio = ms_b / ms_a if ms_a > 0 else ls.ms_after / ls.ms_before
        p50 = steps.job.p50_ms if steps.job is not None else None
        held = (f" The step statistics and every finding's figures hold the whole run (step p50 {fmt_ms(p50)}, "
                f"{fmt_ms(ls.ms_after)} in the latest steps)." if p50 is not None else "")
        verb = ls.drift_verb()
        grew = verb == "grew"
        text = (f"The steady steps' time {verb} by about {fmt_ms(abs(per_step))} every step, not at one step: it "
                f"{verb} within each stretch of steps as it did across them (a line through them runs "
                f"from {fmt_ms(ms_a)} at step {int(a)} to {fmt_ms(ms_b)} at step {int(b)}). {change}"
                + (" Left as it is, each step keeps slowing." if grew else "") + held
                + " What changes is in your loop, your data or on your host, which the doctor does not see: no code "
                "is offered.")
        return self.finding(
            "warning" if grew and ratio >= SHIFT_WARN_RATIO and alarm else "info",
            f"Step time {verb} steadily from {fmt_ms(ms_a)} to {fmt_ms(ms_b)} ({ratio:.2f}x) "
            f"over steps {int(a)}-{int(b)}, {fmt_ms(per_step, signed=True)} a step"
            + (f", on rank {rank}" if rank is not None else ""),
            {"drift_ms_per_step": round(per_step, 3), "first_step": int(a), "last_step": int(b),
             "line_ms_first": ms_a, "line_ms_last": ms_b, "ratio": round(ratio, 3), "rank": rank, **evidence,
             "step_p50_ms_all": p50},
            text, ranks=ranks)


_STRAGGLER_WHERE = {"outside": "outside the model (data loading or user code)", "forward": "forward compute",
                    "backward": "backward compute", "optimizer": "the optimizer step"}


def _straggler_groups(stragglers: list, hosts: dict[int, str]) -> list[list]:
    """The stragglers, those on one host together (every straggler one group where no host is recorded, or where
    every rank's is the same), each group in rank order. A slow node's ranks are late together: a 16-rank run whose
    4 ranks of one host loaded their batches 150 ms late read four warnings, one per rank."""
    many = len(set(hosts.values())) > 1
    groups: dict[str, list] = {}
    for s in sorted(stragglers, key=lambda s: s.rank):
        groups.setdefault(hosts.get(s.rank, "") if many else "", []).append(s)
    return list(groups.values())


@register
class Straggler(Rule):
    code = "straggler.rank"
    name = "Straggler rank"
    description = "One rank is consistently slower; the others spend that time waiting in collectives."
    needs = ("records", "multi_rank")
    severities = ("warning",)

    def match(self, ctx: Context):
        out = []
        steps = E.steps(ctx)
        hosts = {r: rd.header.host for r, rd in (getattr(ctx.run, "ranks", None) or {}).items()
                 if rd.header is not None and rd.header.host}
        for group in _straggler_groups(steps.stragglers, hosts):
            if len(group) > 1:
                out.append(self._group(group, steps, hosts))
                continue
            s = group[0]
            st = steps.per_rank.get(str(s.rank))
            p50 = st.p50_ms if st is not None else None
            where = _STRAGGLER_WHERE[s.phase]
            dev = s.device_wait_ms_per_step
            seen = "" if dev is None else (
                f"On the GPU their hosts do not wait (the collectives are asynchronous): their devices wait "
                f"{dev:.1f} ms per step in the step's collectives while rank {s.rank}'s device sits idle for its "
                "host. ")
            out.append(self.finding(
                "warning",
                f"Rank {s.rank} is a straggler: +{s.excess_ms_per_step:.1f} ms per step "
                + ("" if s.phase == "outside" else "in ") + where,
                {"rank": s.rank, "phase": s.phase, "own_ms_p50": s.own_ms_p50,
                 "others_own_ms_p50": s.others_own_ms_p50, "excess_ms_per_step": s.excess_ms_per_step,
                 "steps_slower": f"{s.steps_slower} of {s.steps}", "measured_by": "host" if dev is None else "device",
                 "others_device_wait_ms_per_step": dev},
                f"Every other rank waits for rank {s.rank} at the next collective. {seen}Look at what differs on "
                f"that rank in {where}: its host (other processes, thermal throttling, a slower device), its data "
                "shard (longer sequences, slower storage) or rank-specific code (logging, checkpointing on rank 0): "
                "move that work off the step or balance the shards. What differs is in your code and on your host, "
                "which the doctor does not see: no code is offered.",
                "",
                predicted={"step_ms_before": p50, "step_ms_after": round(p50 - s.excess_ms_per_step, 3) if p50 else None,
                           "peak_bytes_before": None, "peak_bytes_after": None},
                ranks=[s.rank],
            ))
        if not out:
            return self.quiet(f"no rank's own time in one phase exceeds the others' by "
                              f"{100 * STRAGGLER_MIN_FRACTION:.0f}% and {STRAGGLER_MIN_MS:g} ms in "
                              f"{100 * STRAGGLER_MIN_CONSISTENCY:.0f}% of the steps (at least {STRAGGLER_MIN_STEPS})")
        return out

    def _group(self, group: list, steps, hosts: dict[int, str]):
        """Several stragglers on one host (or in a run on one host): one finding naming them, the whole host where
        they are all its ranks; the step gains the longest lateness (the others wait for the latest of them)."""
        ranks = [s.rank for s in group]
        who = "ranks " + ranges_text(ranks)
        host = hosts.get(ranks[0])
        on_host = sorted(r for r, h in hosts.items() if h == host) if host and len(set(hosts.values())) > 1 else []
        whole = bool(on_host) and on_host == ranks
        phases = sorted({s.phase for s in group}, key=list(_STRAGGLER_WHERE).index)
        where = " and ".join(_STRAGGLER_WHERE[ph] for ph in phases)
        lo, hi = min(s.excess_ms_per_step for s in group), max(s.excess_ms_per_step for s in group)
        excess = f"+{hi:.1f}" if f"{lo:.1f}" == f"{hi:.1f}" else f"+{lo:.1f}-{hi:.1f}"
        p50s = [st.p50_ms for s in group if (st := steps.per_rank.get(str(s.rank))) is not None and st.p50_ms]
        p50 = max(p50s) if p50s else None
        dev = [s.device_wait_ms_per_step for s in group if s.device_wait_ms_per_step is not None]
        place = (f" (all {len(ranks)} ranks of host {host})" if whole else
                 f" (on host {host}, of its {len(on_host)} ranks)" if on_host else "")
        text = (f"Every other rank waits for {who}{place} at the next collective, for the latest of them. "
                + (f"All of host {host}'s ranks are late, and no other: look at that host first (other processes, "
                   "thermal throttling, a slower device or network link, its local storage or data loading), then "
                   "at what its ranks' data shards hold. " if whole else
                   f"Look at what differs on those ranks in {where}: their host (other processes, thermal "
                   "throttling, a slower device), their data shards (longer sequences, slower storage) or "
                   "rank-specific code. ")
                + "Move that work off the step or balance the shards; the step gains the latest one's lateness "
                "only once all of them are on time. What differs is in your code and on your hosts, which the doctor "
                "does not see: no code is offered.")
        return self.finding(
            "warning",
            f"{who[0].upper()}{who[1:]} are stragglers{place}: {excess} ms per step "
            + ("" if phases == ["outside"] else "in ") + where,
            {"ranks": ranks, "host": host or None, "host_ranks": on_host or None,
             "phases": phases, "excess_ms_per_step": {str(s.rank): s.excess_ms_per_step for s in group},
             "steps_slower": {str(s.rank): f"{s.steps_slower} of {s.steps}" for s in group},
             "measured_by": "device" if dev else "host",
             "others_device_wait_ms_per_step": max(dev) if dev else None},
            text, "",
            predicted={"step_ms_before": p50, "step_ms_after": round(p50 - hi, 3) if p50 else None,
                       "peak_bytes_before": None, "peak_bytes_after": None},
            ranks=ranks)
