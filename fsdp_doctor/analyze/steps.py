"""Step time, jitter, outliers and stragglers: plain functions over the recorded steps of a Run (and, for a run
known only from its traces, over the complete profiler steps)."""

from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import dataclass
from typing import Iterator, Optional

from ..records import GpuTimes, StepRecord, collective_wait_ms, counted_op_by_op, doctor_step
from ..report_sections import (CheckpointSteps, CompileSteps, DeviceSteps, LevelShift, NoGradSteps, Outlier,
                               SkippedSteps, StepsSection, StepStats, Straggler)
from ..store import Run
from ..units import unit_label

# An outlier step is slower than the rank's median by at least this fraction ...
OUTLIER_MIN_FRACTION = 0.25  # below a quarter of a step, a slow step is noise on a busy host
# ... and by at least this many robust standard deviations (1.4826 × MAD).
OUTLIER_MIN_SIGMAS = 5.0
# The job's step time that changed mid-run and stayed (level_shift: fake quantization switched on, longer
# sequences from a curriculum, a data loader past its cache, another process on the host): the later steady steps'
# median at least this many times the earlier's, or at most its inverse (a shared 2-core host moves a median ~10%) ...
SHIFT_MIN_RATIO = 1.25
SHIFT_MIN_STEPS = 5  # ... with at least this many steady steps on each side (fewer are an episode, not a level) ...
# ... of each part's steps at least this share on its side of the two medians' midpoint (a gradual drift, or halves
# of a noisy run that differ by chance, leave more of them across it) ...
SHIFT_MIN_SEPARATION = 0.8
SHIFT_MIN_MS = 1.0  # ... and the medians at least this far apart (ms), below which the timer's noise dominates
# A step time that grew (or fell) steadily, not in levels (a loop whose work grew 2 ms every step read "4 levels,
# each a step time that stayed"): the phase that moved grows within the levels at least this part of its growth
# across them (Tukey's resistant line's slopes; _drift_line)
SHIFT_DRIFT_SHARE = 0.5

# A straggler rank's own time (step minus time waiting in collectives) exceeds the others' by this much ...
STRAGGLER_MIN_FRACTION = 0.15  # under 15% ranks differ by noise and placement on a shared host
STRAGGLER_MIN_MS = 1.0  # ... and by at least a millisecond, below which timer noise dominates
STRAGGLER_MIN_STEPS = 5  # too few steps say nothing about consistency
# ... in at least this share of steps.
STRAGGLER_MIN_CONSISTENCY = 0.75  # 3 of 5 steps happens by chance on a shared host
# a step counts in the stragglers' comparison where this share of the ranks can use it (find_stragglers): one rank's
# own left-out steps (a compile, a forced full memory count) on any of a large job's ranks no longer take the step
# from every rank
STRAGGLER_STEP_QUORUM = 0.75


def compiling(s: StepRecord) -> bool:
    """torch.compile compiled in the step, on this rank or on another that this one waited for."""
    return bool(getattr(s, "compiles", 0) or getattr(s, "others_compiled", False))


def usable_steps(steps: list[StepRecord]) -> list[StepRecord]:
    """Steps that represent steady state: not the first (FSDP lazy init, allocator warm-up), not inside a
    profiler window or a FLOP-counting step (their cost is the tool's, not the model's), nor, each unless that
    leaves fewer than 3, a step in which torch.compile compiled (on this rank or one it waited for: ``compiling``),
    a step whose optimizer step the loop skipped (no update: shorter), a step that also ran the model without
    gradients (evaluation, generation: not training)
    or one whose memory was counted op by op (the high-water's dispatch mode), or one in which a rank saved a
    checkpoint (this one or another: ``StepRecord.others_saved``)."""
    out = [s for s in steps if s.step > 0 and not s.profiled]
    for keep in (lambda s: not compiling(s), lambda s: not getattr(s, "optimizer_skipped", False),
                 lambda s: not s.no_grad_forwards, lambda s: not counted_op_by_op(s),
                 lambda s: not s.checkpoints and not getattr(s, "others_saved", False)):
        kept = [s for s in out if keep(s)]
        out = kept if len(kept) >= 3 else out
    return out


def no_grad_steps(steps: list[StepRecord]) -> Optional[NoGradSteps]:
    """A rank's steps holding forward passes without gradients, and whether the statistics leave them out."""
    hit = [s for s in steps if s.no_grad_forwards]
    if not hit:
        return None
    kept = {s.step for s in usable_steps(steps)}
    return NoGradSteps(steps=[s.step for s in hit], forwards=sum(s.no_grad_forwards for s in hit),
                       ms_p50=round(statistics.median([s.no_grad_ms for s in hit]), 3),
                       excluded=not any(s.step in kept for s in hit),
                       with_autograd=sum(s.autograd_eval_forwards for s in hit), every_step=len(hit) == len(steps))


def _fsdp_framed(cfg) -> bool:
    """Whether units of the run's configuration run inside a compiled frame (compile_steps)."""
    return any(getattr(u, "compiled_in_place", False) for u in (getattr(cfg, "units", None) or ()))


def compile_steps(steps: list[StepRecord], fsdp_framed: bool = False) -> Optional[CompileSteps]:
    """A rank's steps in which torch.compile compiled, or in which it waited for another rank compiling, and whether
    the statistics leave them out; None where there are none. ``fsdp_framed``: units run inside a compiled frame
    (``UnitConfig.compiled_in_place``), where Dynamo breaks the graph at FSDP2's hooks: its breaks at a call of
    torch._dynamo.disable are theirs."""
    hit = [s for s in steps if compiling(s)]
    if not hit:
        return None
    kept = {s.step for s in usable_steps(steps)}
    own = [s for s in hit if s.compiles]
    return CompileSteps(steps=[s.step for s in own], graphs=sum(s.compiles for s in own),
                        ms_total=round(sum(s.compile_ms for s in own), 3),
                        graph_breaks=sum(s.graph_breaks for s in own),
                        fsdp_hook_breaks=sum(s.disable_breaks for s in own) if fsdp_framed else 0,
                        waited=[s.step for s in hit if not s.compiles],
                        excluded=not any(s.step in kept for s in hit))


def skipped_steps(steps: list[StepRecord]) -> Optional[SkippedSteps]:
    """A rank's steps whose optimizer step the loop skipped, and whether the statistics leave them out; None where
    there are none."""
    hit = [s.step for s in steps if getattr(s, "optimizer_skipped", False) and not _empty(s)]
    if not hit:
        return None
    kept = {s.step for s in usable_steps(steps)}
    return SkippedSteps(steps=hit, recorded=len(steps), excluded=not kept & set(hit))


def _empty(s: StepRecord) -> bool:
    """A step record with no forward, no backward and no optimizer step: a doctor.step() call repeated, recorded as
    a step (with its update skipped) by a recorder before StepRecord.repeated_calls."""
    return s.backwards == 0 and not s.forward_ms and not s.optimizer_ms and s.micro_batches <= 1


def repeated_calls(rd) -> list[int]:
    """The steps of a rank after which doctor.step() was called again with nothing run since the call before (no
    forward, backward or optimizer step), once per such call: ``StepRecord.repeated_calls`` (before the step's work:
    the step before's), ``End.repeated_calls`` (after the last step), and the empty step records of a recorder
    before those fields (one each: the step before's; a new-user trial's doctor.step() twice per step read "10 of 20
    steps skipped the optimizer step")."""
    out = [s.step - 1 for s in rd.steps for _ in range(max(s.repeated_calls, _empty(s)))]
    if rd.end is not None and rd.steps:
        out += [rd.steps[-1].step] * rd.end.repeated_calls
    return out


def profiled_saves(steps: list[StepRecord]) -> list[int]:
    """The steps of a rank's profiler windows that saved a checkpoint: the trace's figures hold those saves (their
    time outside the model, torch.distributed.checkpoint's planning collectives), which the step statistics leave
    out (a new-user trial's torchtitan run saved inside the window and read "input-bound", and the save's
    collectives as a gradient-norm log's)."""
    return [s.step for s in steps if s.profiled and s.checkpoints]


#: a first step this many times the others' median is its own (initialization, a load, compilation): out of the saves'
#: share of the recorded time
FIRST_STEP_LONG = 2.0


#: unmarked time around the saves counts as theirs from this much (ms, and the marked saves' own time)
UNMARKED_MIN_MS = 10.0


def checkpoint_steps(steps: list[StepRecord]) -> Optional[CheckpointSteps]:
    """A rank's steps that saved a checkpoint (torch.distributed.checkpoint's saves, ``doctor.checkpointing()``), and
    whether the statistics leave them out. The saves' time and its share are those of the steps outside profiler
    windows and the first step, where there are saves: a window slows a save as it slows the step (the doctor's own
    window: its cost)."""
    hit = [s for s in steps if s.checkpoints]
    if not hit:
        return None
    kept = {s.step for s in usable_steps(steps)}
    counted = [s for s in steps if not s.profiled]
    windows_out = any(s.checkpoints for s in counted)  # (else every save fell in a window: all steps counted)
    if not windows_out:
        counted = steps
    # nor a first step that ran long without saving (FSDP's lazy initialization, a checkpoint loaded before it,
    # compilation: paid once; a load inside watch() made a 13.7% share of one that was 18.9%, a new-user trial)
    plain = [s.wall_ms for s in counted if s.step > 0 and not s.checkpoints]
    if plain and any(s.checkpoints for s in counted if s.step > 0):
        long_first = FIRST_STEP_LONG * statistics.median(plain)
        counted = [s for s in counted if s.step > 0 or s.checkpoints or s.wall_ms <= long_first]
    ms = [s.checkpoint_ms for s in counted if s.checkpoints]
    # work around the saves outside their marks (the save steps' time outside the model beyond the other steps'
    # median), at least as long as the marked saves, counts as theirs, spread over the save steps: a full state dict
    # gathered on every rank before rank 0's torch.save in the mark (20 ms marked, ~400 ms around it) read 2.1% of
    # the time, and no rule spoke (a new-user trial). Counted here, once, for the finding, the report's line and
    # compare's check of a fix alike
    # It is the save steps' typical excess (the lower median), in every save step: one save step slowed by the
    # host (a 2-rank torchtitan run's, async saves of ~20 ms, one of its two counted save steps 40 ms long outside
    # the model) is no work around the saves, and read as one, made 9.6% of the time where 3.8% was predicted
    others = [s.outside_ms for s in counted if not s.checkpoints and s.step > 0]
    base = statistics.median(others) if others else None
    excess = [max(0.0, s.outside_ms - base) for s in counted if s.checkpoints] if base is not None else []
    unmarked = statistics.median_low(excess) * len(excess) if excess else 0.0
    if unmarked >= max(UNMARKED_MIN_MS, sum(ms)):
        ms = [m + unmarked / len(ms) for m in ms]
    else:
        unmarked = 0.0
    return CheckpointSteps(steps=[s.step for s in hit], saves=sum(s.checkpoints for s in hit),
                           counted_saves=sum(s.checkpoints for s in counted if s.checkpoints),
                           async_saves=sum(s.async_saves for s in hit),
                           ms_p50=round(statistics.median(ms), 3), ms_total=round(sum(ms), 3),
                           wall_ms_total=round(sum(s.wall_ms for s in counted), 3),
                           excluded=not any(s.step in kept for s in hit), counted_steps=len(counted),
                           profiled=sorted(s.step for s in hit if s.profiled and windows_out),
                           first_ms=round(ms[0], 3), unmarked_ms=round(unmarked, 3))


def heaviest_saves(checkpoints: Optional[dict]) -> Optional[tuple[str, CheckpointSteps]]:
    """(rank, its saves) of the rank whose checkpoint saves take the largest share of its recorded time (the
    report's per-rank ``checkpoints``): the saves checkpoint.blocking quotes and compare checks; None without a
    save."""
    per = [(r, c) for r, c in (checkpoints or {}).items() if c.wall_ms_total > 0]
    return max(per, key=lambda rc: rc[1].ms_total / rc[1].wall_ms_total, default=None)


def save_interval(c: CheckpointSteps) -> Optional[float]:
    """Steps between a rank's saves (their steps' median distance); None with one save."""
    return statistics.median(b - a for a, b in zip(c.steps, c.steps[1:])) if len(c.steps) > 1 else None


def counted_saves(c: CheckpointSteps) -> int:
    """The saves whose time ``c.ms_total`` holds: those outside profiler windows."""
    return c.counted_saves or c.saves


def first_save_setup(c: CheckpointSteps) -> float:
    """The first counted save's excess over the median save (ms): a process's first save also sets up (an
    async_save its staging: 45-68 ms against 31 ms for the next ones in torchtitan's), once however often it saves;
    0 with one save, or where the first was not slower. Of two saves, its excess over the other: their median is
    their mean, which halves it (OLMo-core's asynchronous saves, 1,094 ms then 100 ms, read 497 ms of set-up and
    12.9% of the time without it, where the second save's share was 4.1%)."""
    n, first = counted_saves(c), c.first_ms or 0.0
    typical = c.ms_total - first if n == 2 else c.ms_p50
    return max(0.0, first - typical) if n > 1 else 0.0


def save_ms_each(c: CheckpointSteps) -> float:
    """A save's time (ms): the counted saves' mean without the first one's set-up (``first_save_setup``)."""
    # (per save counted: a 16-step torchtitan run saving every 2 steps, 2 of its 7 saves in the profiler's window,
    # priced each save at 5/7 of its time and was told every 4 steps for 4.5%: 6.4% measured)
    return (c.ms_total - first_save_setup(c)) / max(1, counted_saves(c))


def saves_share(c: CheckpointSteps, step_ms: float, saves: float, steps: int) -> tuple[float, float]:
    """(the saves' share of the time, their time in ms) in a run of ``steps`` steps of ``step_ms`` with ``saves``
    saves (a run saving every n steps: steps / n), each as those of ``c`` (``save_ms_each``), the first one's set-up
    paid once (a 16-step torchtitan run saving every 2 steps, asynchronously, was predicted 3.8% at a save every 8
    steps from the mean of all saves, and measured 6.7%: its two saves' first took 60 ms). checkpoint.blocking's
    save-less-often plan, and compare's check of it with the saves a rerun made."""
    after = first_save_setup(c) + saves * save_ms_each(c)
    return after / (steps * step_ms + after), after


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method), q in [0, 100]."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def wall_stats(xs: list[float]) -> StepStats:
    """Statistics of step wall times ``xs`` (ms): count, percentiles, max, mean, cv, total."""
    if not xs:
        return StepStats()
    mean = statistics.fmean(xs)
    sd = statistics.pstdev(xs) if len(xs) > 1 else 0.0
    return StepStats(count=len(xs), p50_ms=round(percentile(xs, 50), 3), p90_ms=round(percentile(xs, 90), 3),
                     p99_ms=round(percentile(xs, 99), 3), max_ms=round(max(xs), 3), mean_ms=round(mean, 3),
                     cv=round(sd / mean, 4) if mean > 0 else None, wall_ms_total=round(sum(xs), 3))


def step_stats(steps: list[StepRecord]) -> StepStats:
    """Step-time statistics of ``steps`` (ms); only ``count`` (0) and the percentiles (None) without any. A save
    step kept for want of others counts without its save (``checkpoint_ms``, reported apart): a 10-step resumed
    run's p50 held its ~190 ms saves where the 20-step run it was compared with left them out (+65.8%: a new-user
    trial)."""
    out = wall_stats([s.wall_ms - getattr(s, "checkpoint_ms", 0.0) for s in steps])
    # (no forward and no backward in any step: the doctor's hooks did not see the model run, inside a compiled frame
    # it was not given; its phases are unknown, not a step spent outside the model)
    if steps and phases_recorded(steps):
        out.phases_p50_ms = {k: round(statistics.median([getattr(s, k + "_ms") for s in steps]), 3)
                             for k in ("forward", "backward", "optimizer", "outside", "gc")}
        between = [s.between_ms for s in steps]
        if None not in between:  # (of outside: between optimizer.step() and the next forward)
            out.phases_p50_ms["between"] = round(statistics.median(between), 3)
        others = [getattr(s, "other_models_ms", 0.0) for s in steps]
        if any(others):  # (of outside: another FSDP model's forward and backward, a teacher's, a GAN's other network)
            out.phases_p50_ms["other_models"] = round(statistics.median(others), 3)
    if steps:
        out.gc_ms_total = round(sum(s.gc_ms for s in steps), 3)
        out.gc_count_total = sum(s.gc_count for s in steps)
        if all(s.gc_collected is not None for s in steps):
            out.gc_full_ms_total = round(sum(s.gc_full_ms for s in steps), 3)
            out.gc_collected_total = sum(s.gc_collected for s in steps)
        if any(s.gc_disabled_count for s in steps):
            out.gc_disabled_count_total = sum(s.gc_disabled_count for s in steps)
            out.gc_disabled_ms_total = round(sum(s.gc_disabled_ms for s in steps), 3)
    return out


# How the device's idle between two steps was found (DeviceSteps.idle_source).
IDLE_MEASURED = "events"  # the recorder's events: the previous step's end to this step's start
IDLE_FROM_PERIOD = "host wall - device step"  # files written before those events: the periods are equal


def _median(xs: list) -> Optional[float]:
    """The median of the values that are not None, rounded to the microsecond; None without any."""
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 3) if xs else None


def device_outside_ms(g: GpuTimes) -> Optional[float]:
    """The device's time in one step between ``optimizer.step()`` and the forward: its start to its first forward
    plus its last phase's end to its end (None where either bracket was not recorded)."""
    if g.before_forward_ms is None or g.after_model_ms is None:
        return None
    return g.before_forward_ms + g.after_model_ms


def unit_modules(units) -> dict[str, int]:
    """Unit name -> the modules it groups (at least 1): a grouped unit's modules each count a forward call."""
    return {u.name: max(1, len(u.modules)) for u in units}


def unit_passes(u, modules: dict[str, int]) -> Optional[float]:
    """A unit's forward passes in one step (``u``: its ``UnitStep``): its forward calls per module (``modules``:
    :func:`unit_modules`); None where it ran none."""
    return u.fwd_calls / modules.get(u.name, 1) if u.fwd_calls else None


def forward_passes(s: StepRecord, modules: dict[str, int]) -> float:
    """The model's forward passes in one step: the micro-batches ``doctor.step()`` was told of, or the fewest
    forward passes of a unit (:func:`unit_passes`), if more."""
    calls = [n for n in (unit_passes(u, modules) for u in s.units) if n is not None]
    return max(s.micro_batches, min(calls, default=1))


def called_outside_forward(ranks: dict) -> Optional[set[str]]:
    """The units whose forward started outside the model's, after the root unit's forward ended and before its
    backward began, in any step with a memory timeline (a loss that runs the output head per chunk: torchtitan's
    ChunkedLossWrapper); None where no step's timeline marks the root's forward (no root unit, no timeline)."""
    found: set[str] = set()
    marked = False  # (a timeline marking the root's forward)
    for rd in ranks.values():
        for s in rd.steps:
            tl = s.memory.timeline if s.memory is not None else None
            if tl is None or not tl.rows or "unit" not in tl.columns or "phase" not in tl.columns:
                continue
            iu, ip = tl.columns.index("unit"), tl.columns.index("phase")
            after = False
            for row in tl.rows:
                unit, phase = row[iu], row[ip]
                if unit == "":
                    marked = True
                    after = phase == "forward_end" or (after and phase not in ("forward_start", "backward_start"))
                elif after and unit is not None and phase == "forward_start":
                    found.add(unit)
    return found if marked else None


def unit_calls(config, ranks: dict) -> Iterator[tuple[str, int, float, float]]:
    """Per usable step of every rank (``ranks``: a Run's), per unit: (its name, its forward calls, the calls the
    model's forward passes make of it, one per module per pass, those passes: :func:`forward_passes`)."""
    modules = unit_modules(config.units if config is not None else [])
    for rd in ranks.values():
        for s in usable_steps(rd.steps):
            passes = forward_passes(s, modules)
            for u in s.units:
                yield u.name, u.fwd_calls, modules.get(u.name, 1) * passes, passes


def calls_beyond_model(config, ranks: dict) -> dict[str, list[tuple[float, float]]]:
    """Per unit, per usable step of every rank (``ranks``: a Run's): its forward calls beyond those the model's forward
    passes make (one per module per pass: :func:`forward_passes`), and those passes; in one pass over the steps. Code
    outside the model's forward called a unit with calls beyond (a loss that runs the output head per chunk:
    torchtitan's ChunkedLossWrapper). A unit the timelines show called inside the model's forward only has none: the
    model calls it several times (ALBERT's one shared layer group, applied once per layer, read as an output head
    run in 6 chunks of the loss: a new-user trial)."""
    outside = called_outside_forward(ranks)
    out: dict[str, list[tuple[float, float]]] = {}
    for name, calls, model_calls, passes in unit_calls(config, ranks):
        out.setdefault(name, []).append((calls - model_calls if outside is None or name in outside else 0.0, passes))
    return out


def chunked_head(config, ranks: dict) -> Optional[tuple[str, int]]:
    """The unit that code outside the model's forward runs once per chunk of each micro-batch (the output head), and
    those chunks: its calls beyond the model's per forward pass (:func:`calls_beyond_model`), and the one the model's
    forward skips (torchtitan's ChunkedLossWrapper: the model's forward with _skip_lm_head, then lm_head and the loss
    once per chunk of the sequence, each chunk's backward before the next); the unit with the most, the first of them
    in the units' order; None where no such code calls any."""
    if config is None:
        return None
    beyond, best = calls_beyond_model(config, ranks), None
    for u in config.units:
        per_pass = [x / n for x, n in beyond.get(u.name, []) if n]
        extra = statistics.median(per_pass) if per_pass and not u.is_root else 0.0
        if extra >= 1 and (best is None or round(extra) + 1 > best[1]):
            best = (u.name, round(extra) + 1)
    return best


def loss_chunks(config, ranks: dict) -> Optional[int]:
    """The chunks the model's output is computed in, where it is: torchtune's num_output_chunks (inside its forward,
    ``RunConfig.output_chunks``), or those a loss outside it runs the head in (:func:`chunked_head`)."""
    if config is None:
        return None
    head = chunked_head(config, ranks)
    return config.output_chunks or (head[1] if head else None)


def sequence_lengths(ranks: dict) -> set[int]:
    """The lengths along the second dimension of the model's first input (a batch's tokens: batch x sequence) over
    every usable step of every rank (``StepRecord.input_shape``): what a loss chunking the sequence must divide
    (torchtitan's ChunkedLossWrapper); empty where none was recorded."""
    return {int(s.input_shape[1]) for rd in ranks.values() for s in usable_steps(rd.steps)
            if s.input_shape is not None and len(s.input_shape) >= 2}


def device_stats(pairs: list[tuple[StepRecord, GpuTimes]], modules: dict[str, int]) -> Optional[DeviceSteps]:
    """The device's view of steady steps (``pairs``: each step's record and its ``GpuTimes``; ``modules`` as
    :func:`forward_passes` takes it), medians in ms; None without any. The idle between steps is the events'
    where the recorder timed it, else the host's median wall less the device's median step (over steady steps
    both run at the same period; clamped at 0)."""
    if not pairs:
        return None
    gs = [g for _, g in pairs]
    step = _median([g.step_ms for g in gs])
    idle = [g.idle_before_ms for g in gs]
    measured = any(x is not None for x in idle)
    if measured:
        idle_ms = _median(idle)
        period = _median([g.step_ms + g.idle_before_ms for g in gs if g.idle_before_ms is not None])
    else:
        wall = statistics.median([s.wall_ms for s, _ in pairs])
        idle_ms, period = round(max(0.0, wall - step), 3), round(max(wall, step), 3)
    return DeviceSteps(
        count=len(gs), step_ms=step, forward_ms=_median([g.forward_ms for g in gs]),
        backward_ms=_median([g.backward_ms for g in gs]), optimizer_ms=_median([g.optimizer_ms for g in gs]),
        # micro-batches: forward (first begun .. last ended) spans backward, and the difference means nothing
        outside_phases_ms=None if any(forward_passes(s, modules) > 1 for s, _ in pairs) else
        _median([max(0.0, g.step_ms - g.forward_ms - g.backward_ms - g.optimizer_ms) for g in gs]),
        idle_between_ms=idle_ms, idle_source=IDLE_MEASURED if measured else IDLE_FROM_PERIOD, period_ms=period,
        before_forward_ms=_median([g.before_forward_ms for g in gs]),
        after_model_ms=_median([g.after_model_ms for g in gs]),
        outside_ms=_median([device_outside_ms(g) for g in gs]),
    )


def device_pairs(rd, steps: list[StepRecord]) -> list[tuple[StepRecord, GpuTimes]]:
    """``steps`` of one rank with the device times the recorder wrote for them (CUDA only; none elsewhere)."""
    gpu = getattr(rd, "gpu", None) or {}
    return [(s, gpu[s.step]) for s in steps if s.step in gpu]


def trace_steps(overlap) -> Optional[StepsSection]:
    """The steps section of a run known only from its traces: per rank, the wall times of the complete
    ``ProfilerStep``s (``OverlapRank.step_times_ms``; no phase split, no outliers: those need records), the steps
    left out (``OverlapRank.steps_left_out``: a window's last, where it may be cut) counted as recorded and excluded;
    None without any complete step."""
    ranks = overlap.per_rank if overlap is not None else {}
    per = {r: list(pr.step_times_ms.values()) for r, pr in ranks.items() if pr.step_times_ms}
    if not per:
        return None
    per_rank = {r: wall_stats(xs) for r, xs in sorted(per.items(), key=lambda kv: int(kv[0]))}
    for r, st in per_rank.items():
        st.excluded = len(ranks[r].steps_left_out)
        st.recorded = st.count + st.excluded
    return StepsSection(per_rank=per_rank, job=wall_stats([x for xs in per.values() for x in xs]))


def own_ms(s: StepRecord) -> float:
    """The rank's own time in the step: what it did not spend waiting for others (GC pauses are jitter.gc's)."""
    return s.wall_ms - collective_wait_ms(s) - s.gc_ms


@dataclass
class _Base:
    wall: float
    gc: float
    outside: float
    no_grad: float
    checkpoint: float
    wait: float
    fwd: float
    bwd: float
    opt: float
    probe: float
    doctor: float


def probe_ms(s: StepRecord) -> float:
    """The memory probe's own cost in the step's wall (ms): its marks inside the forward and backward, and on a step
    whose memory was counted op by op (the high-water's dispatch mode: steps 0-2, and every so often), each op's;
    not its work at the step's end, which the next step's doctor_ms holds."""
    m = s.memory
    return max(0.0, m.probe_us - m.probe_end_us) / 1e3 if m is not None else 0.0


def _baseline(steps: list[StepRecord]) -> _Base:
    med = statistics.median
    return _Base(
        wall=med([s.wall_ms for s in steps]), gc=med([s.gc_ms for s in steps]),
        outside=med([s.outside_ms for s in steps]), no_grad=med([s.no_grad_ms for s in steps]),
        checkpoint=med([s.checkpoint_ms for s in steps]),
        wait=med([collective_wait_ms(s) for s in steps]),
        fwd=med([s.forward_ms for s in steps]), bwd=med([s.backward_ms for s in steps]),
        opt=med([s.optimizer_ms for s in steps]), probe=med([probe_ms(s) for s in steps]),
        doctor=med([s.doctor_ms for s in steps]),
    )


def phases_recorded(steps: list[StepRecord]) -> bool:
    """Whether the steps' forward and backward were recorded: where no step has either, the doctor's hooks did not
    see the model run (inside a compiled frame it was not given), and the time it did not see is in outside_ms."""
    return any(s.forward_ms or s.backward_ms for s in steps)


def find_outliers(run: Run) -> list[Outlier]:
    by_rank = {r: usable_steps(rd.steps) for r, rd in run.ranks.items()}
    base = {r: _baseline(st) for r, st in by_rank.items() if len(st) >= 3}
    index = {(r, s.step): s for r, st in by_rank.items() for s in st}
    out = []
    for r, steps in by_rank.items():
        if r not in base:
            continue
        b = base[r]
        mad = statistics.median([abs(s.wall_ms - b.wall) for s in steps])
        thresh = b.wall + max(OUTLIER_MIN_FRACTION * b.wall, OUTLIER_MIN_SIGMAS * 1.4826 * mad)
        # the steps in which torch.compile compiled, left out of the statistics as the first step is, are named
        # among the outliers, as compilation (a recompile at step 10 read "compute +1595.8 ms in
        # forward/backward/optimizer", and stayed in the statistics: a new-user trial)
        kept, recorded = {s.step for s in steps}, phases_recorded(steps)
        compiled = [s for s in run.ranks[r].steps if s.step > 0 and compiling(s) and s.step not in kept]
        usual = statistics.median(s.micro_batches for s in steps)
        for s in sorted(steps + compiled, key=lambda s: s.step):
            if s.wall_ms <= thresh:
                continue
            cause, detail = (("compilation", _compile_detail(r, s, run)) if compiling(s)
                             else _cause(r, s, b, base, index, recorded))
            if s.micro_batches >= 2 * usual and cause != "compilation":
                # more micro-batches than the others: doctor.step() calls with no step of the watched optimizer
                # between them (a NaN guard's skipped step read as one step of twice the time, named nothing: a
                # new-user trial)
                cause, detail = "micro_batches", (
                    f"{s.micro_batches} micro-batches in this step (usually {usual:g}): no step of the watched "
                    f"optimizer between its doctor.step() calls (an optimizer step skipped, or another optimizer's); "
                    + detail)
            out.append(Outlier(rank=r, step=s.step, ms=round(s.wall_ms, 3), median_ms=round(b.wall, 3),
                               excess_ms=round(s.wall_ms - b.wall, 3), cause=cause, detail=detail))
    out.sort(key=lambda o: -o.excess_ms)
    return out


def _compile_detail(rank: int, s: StepRecord, run: Run) -> str:
    """An outlier step's compilation, in words: this rank's compiles, else the other rank's it waited for (in this
    step or the one before, the longest)."""
    if s.compiles:
        # (compiles, not graphs: a frame Dynamo compiled, or a backward compiled lazily; the reference GPT compiled
        # whole read "5 graphs" for 2 unique ones)
        return (f"compilation: torch.compile compiled {s.compiles} time{'s' if s.compiles > 1 else ''} "
                f"({s.compile_ms:.1f} ms)")
    theirs = [(s2.compile_ms, r2, s2.step) for r2, rd in run.ranks.items() if r2 != rank
              for s2 in rd.steps if s2.step in (s.step, s.step - 1) and s2.compiles]
    if not theirs:
        return "compilation"
    ms, r2, st = max(theirs)
    when = "compiling in this step" if st == s.step else f"late from its step {st}, which compiled"
    return f"compilation: waiting for rank {r2}, {when} (torch.compile: {ms:.1f} ms)"


def _largest_unit_wait(s: StepRecord) -> tuple[str | None, float]:
    """The unit whose all-gathers kept this step's host waiting longest, and that wait (ms)."""
    best, best_ms = None, 0.0
    for u in s.units:
        w = u.ag_wait_fwd_ms + u.ag_wait_bwd_ms
        if w > best_ms:
            best, best_ms = u.name, w
    return best, best_ms


def _cause(rank: int, s: StepRecord, b: _Base, base: dict, index: dict, recorded: bool = True) -> tuple[str, str]:
    """An outlier step's likely cause and its words; ``recorded``: the rank's forward and backward were recorded
    (``phases_recorded``), else its time outside the model holds them and neither is named."""
    excess = s.wall_ms - b.wall
    parts = {
        "gc": s.gc_ms - b.gc,
        "outside": s.outside_ms - b.outside - max(0.0, s.gc_ms - b.gc),
        "no_grad": s.no_grad_ms - b.no_grad,
        "checkpoint": s.checkpoint_ms - b.checkpoint,
        "wait": collective_wait_ms(s) - b.wait,
    }
    # the doctor's own time: its work at the step's start (doctor_ms, outside every phase) and the memory probe's,
    # inside the forward and backward, which the compute part is counted without
    parts["doctor"] = s.doctor_ms + probe_ms(s) - b.doctor - b.probe
    own_compute = (s.forward_ms + s.backward_ms + s.optimizer_ms) - collective_wait_ms(s) - probe_ms(s)
    parts["compute"] = own_compute - (b.fwd + b.bwd + b.opt - b.wait - b.probe)
    if not recorded:
        # forward and backward not recorded (a compiled step function the doctor was not given): the time outside
        # the model holds them, and no part of it is data loading or compute as far as the doctor knows (a new-user
        # trial's step 9 read "time outside the model +59.3 ms (data loading or user code)", forward_ms and
        # backward_ms 0.0 in every step); the optimizer, timed by its own hooks, stays
        parts["unrecorded"] = parts.pop("outside")
        parts["compute"] = s.optimizer_ms - b.opt
    # Another rank arriving late shows up here as waiting, and there as time outside or computing: in the same
    # step, or at the end of the previous one (its optimizer step or code after it ran long after this rank had
    # moved on, so this rank waits in this step's first collective). The late rank is the one whose own time (not
    # its waits) ran longer than this rank's in that step: two ranks slow together never each wait for the other.
    def own_excess(r: int, s2: StepRecord) -> float:
        return (s2.wall_ms - base[r].wall) - (collective_wait_ms(s2) - base[r].wait)

    late_rank, late_ms = None, 0.0
    for (r2, st), s2 in index.items():
        if st not in (s.step, s.step - 1) or r2 == rank or r2 not in base:
            continue
        mine = index.get((rank, st))
        x = own_excess(r2, s2)
        if x > late_ms and (mine is None or x > own_excess(rank, mine)):
            late_rank, late_ms = r2, x
    def said(key: str) -> tuple[str, str]:
        if key == "wait" and late_rank is not None and late_ms > 0.5 * parts["wait"]:
            return "late_rank", f"waiting for rank {late_rank} (late by {late_ms:.1f} ms)"
        if key == "gc":
            return "gc", f"GC pause {s.gc_ms:.1f} ms ({s.gc_count} collections)"
        if key == "no_grad":
            return "no_grad", (f"{s.no_grad_forwards} forward passes without gradients (evaluation or generation) "
                               f"+{parts['no_grad']:.1f} ms")
        if key == "checkpoint":
            return "checkpoint", f"checkpoint save +{parts['checkpoint']:.1f} ms"
        if key == "outside":
            return "outside", f"time outside the model +{parts['outside']:.1f} ms (data loading or user code)"
        if key == "unrecorded":
            return "unrecorded", (f"+{parts['unrecorded']:.1f} ms in the model's forward or backward or outside the "
                                  "model, not told apart (forward and backward not recorded)")
        if key == "compute" and not recorded:
            return "compute", f"optimizer +{parts['compute']:.1f} ms (of +{excess:.1f} ms)"
        if key == "doctor":
            how = ("counting this step's memory op by op" if counted_op_by_op(s)
                   else "on its records and memory figures")
            return "doctor", f"the doctor: +{parts['doctor']:.1f} ms {how}"
        if key == "wait":
            unit, ms = _largest_unit_wait(s)
            # (the unit by its label: the root read '' in a new-user trial's table)
            return "allgather_wait", (f"all-gather wait +{parts['wait']:.1f} ms (largest in unit "
                                      f"{unit_label(unit) if unit is not None else 'none'}: {ms:.1f} ms)")
        return "compute", f"compute +{parts['compute']:.1f} ms in forward/backward/optimizer (of +{excess:.1f} ms)"

    first, second = sorted(parts, key=parts.get, reverse=True)[:2]
    kind, text = said(first)
    # a second cause of a third of the excess or more is named too: a step that both counted its memory op by op
    # and evaluated read "the doctor" on one rank and "compute" on the other, never the evaluation (a new-user trial)
    if excess > 0 and parts[second] >= excess / 3:
        text += "; also " + said(second)[1]
    return kind, text


_PHASES = ("outside", "forward", "backward", "optimizer")


def device_waits(run: Run, by_rank: dict, common) -> Optional[dict]:
    """On CUDA, per rank and step, the device time (ms) it waited in the step's collectives for a late rank.

    There the hosts do not wait in FSDP's collectives (they are asynchronous): a rank whose host is late leaves
    its device idle, and the other ranks' devices wait that long inside the step's first collectives, so the
    host step times converge and the hosts' own times no longer tell the ranks apart. Read from the device
    times (``GpuTimes``): a rank's forward and backward spans beyond the shortest rank's (the same model does
    the same work on every rank: the rest is waiting), but no more than another rank's device sat idle outside
    those phases (waiting for its host, the doctor's own time and GC aside) beyond its own. None unless every
    rank has the phases' device times of every step in ``common``."""
    gpu = {r: run.ranks[r].gpu for r in by_rank}
    if not all(st in gpu[r] and gpu[r][st].forward_ms > 0 for r in by_rank for st in common):
        return None
    out: dict = {r: {} for r in by_rank}
    for st in common:
        g = {r: gpu[r][st] for r in by_rank}
        floor = {ph: min(getattr(x, ph + "_ms") for x in g.values()) for ph in ("forward", "backward")}
        idle = {r: _device_idle(x, by_rank[r][st]) for r, x in g.items()}
        for r, x in g.items():
            spans = sum(getattr(x, ph + "_ms") - floor[ph] for ph in floor)
            late = max(idle[o] for o in g if o != r) - idle[r]
            out[r][st] = max(0.0, min(spans, late))
    return out


def _device_idle(g, s: StepRecord) -> float:
    """The device's time in a step outside the forward, backward and optimizer spans, the doctor's own time and
    GC aside (ms): where it waited for its host."""
    return g.step_ms - g.forward_ms - g.backward_ms - g.optimizer_ms - s.doctor_ms - s.gc_ms


def _host_phase_ms(s: StepRecord) -> dict[str, float]:
    """The step's phases on the host, less the all-gather waits inside forward and backward: the rank's own time in
    each (a rank given 4x the rows of the other was named a straggler "outside the model": the other rank's forward
    held its 198 ms of waits for it, so the forward's excess read 23 ms where its own was 222 ms)."""
    waits = {"forward": sum(u.ag_wait_fwd_ms for u in s.units), "backward": sum(u.ag_wait_bwd_ms for u in s.units)}
    return {ph: max(0.0, getattr(s, ph + "_ms") - waits.get(ph, 0.0)) for ph in _PHASES}


def _device_phase_ms(g, s: StepRecord) -> dict[str, float]:
    """The step's phases on the device, ``outside`` being its idle time outside them (``_device_idle``)."""
    return {"outside": _device_idle(g, s), "forward": g.forward_ms, "backward": g.backward_ms,
            "optimizer": g.optimizer_ms}


def find_stragglers(run: Run) -> list[Straggler]:
    """Ranks whose own time (step minus collective waits) is consistently above the others'. The waits are the
    host's (gloo: the host blocks in every collective), and on CUDA also the device's (``device_waits``): there
    a straggler's excess must reach STRAGGLER_MIN_FRACTION of the step, since the host's own time holds its
    syncs on its device."""
    by_rank = {r: {s.step: s for s in usable_steps(rd.steps)} for r, rd in run.ranks.items()}
    if len(by_rank) < 2:
        return []
    common = sorted(set.intersection(*(set(d) for d in by_rank.values())))
    # a step one rank left out (its own instrumented step: a compile, a forced full memory count) stays in the others'
    # comparison: a step counts where STRAGGLER_STEP_QUORUM of the ranks can use it, each rank compared on its own
    # usable ones with those of the others (the device's waits want every rank's: those from the common steps)
    need = max(2, math.ceil(STRAGGLER_STEP_QUORUM * len(by_rank)))
    shared = sorted(st for st in set().union(*by_rank.values()) if sum(st in d for d in by_rank.values()) >= need)
    if len(shared) < STRAGGLER_MIN_STEPS:
        return []
    host = {r: {st: own_ms(d[st]) for st in shared if st in d} for r, d in by_rank.items()}
    waits = device_waits(run, by_rank, common) if len(common) >= STRAGGLER_MIN_STEPS else None
    own = None if waits is None else {o: {st: host[o][st] - waits[o][st] for st in common} for o in by_rank}
    out = []
    for r in by_rank:
        found = _straggler(r, host, lambda o, st: _host_phase_ms(by_rank[o][st]),
                           lambda theirs, st: theirs * STRAGGLER_MIN_FRACTION)
        if found is None and own is not None:
            walls = {st: statistics.median(by_rank[o][st].wall_ms for o in by_rank if o != r) for st in common}
            walls[None] = statistics.median(walls.values())
            found = _straggler(r, own, lambda o, st: _device_phase_ms(run.ranks[o].gpu[st], by_rank[o][st]),
                               lambda theirs, st: walls[st] * STRAGGLER_MIN_FRACTION)
            if found is not None:
                found.device_wait_ms_per_step = round(statistics.median(
                    statistics.median(waits[o][st] for o in by_rank if o != r) for st in common), 3)
        if found is not None:
            out.append(found)
    return out


def _straggler(r, own: dict, phase_ms, margin) -> Optional[Straggler]:
    """Rank ``r`` as a straggler by ``own`` ({rank: {step: own ms}}): its own time above the others' median by
    ``margin(theirs, step)`` (and STRAGGLER_MIN_MS) in STRAGGLER_MIN_CONSISTENCY of the steps, and in the medians
    over the steps (``margin(theirs, None)``); its phase is the one (``phase_ms(rank, step)``: {phase: ms}) it
    exceeds the others' median in most."""
    common = [st for st in sorted(own[r]) if any(st in own[o] for o in own if o != r)]
    if len(common) < STRAGGLER_MIN_STEPS:
        return None
    slower = 0
    excess_phase = dict.fromkeys(_PHASES, 0.0)
    own_r, own_o = [], []
    for st in common:
        others = [o for o in own if o != r and st in own[o]]  # (the ranks that could use the step too)
        mine = own[r][st]
        theirs = statistics.median([own[o][st] for o in others])
        own_r.append(mine)
        own_o.append(theirs)
        if mine - theirs > max(margin(theirs, st), STRAGGLER_MIN_MS):
            slower += 1
        mine_ph, theirs_ph = phase_ms(r, st), [phase_ms(o, st) for o in others]
        for ph in excess_phase:
            excess_phase[ph] += mine_ph[ph] - statistics.median([x[ph] for x in theirs_ph])
    share = slower / len(common)
    m_r, m_o = statistics.median(own_r), statistics.median(own_o)
    if share < STRAGGLER_MIN_CONSISTENCY or m_r - m_o <= max(margin(m_o, None), STRAGGLER_MIN_MS):
        return None
    phase = max(excess_phase, key=excess_phase.get)
    return Straggler(rank=r, phase=phase, steps_slower=slower, steps=len(common), own_ms_p50=round(m_r, 3),
                     others_own_ms_p50=round(m_o, 3), excess_ms_per_step=round(m_r - m_o, 3),
                     phase_excess_ms_per_step=round(excess_phase[phase] / len(common), 3))


def late_straggler(stragglers: list[Straggler]) -> Optional[Straggler]:
    """Of the records' stragglers, the one the other ranks wait for longest, or None: what the others wait for it
    in their collectives is its lateness, not the collectives' cost, so the verdict and the rules that read
    all-gather waits read its own step (it waits for no one's lateness; diagnose.estimate.late_rank)."""
    return max(stragglers, key=lambda s: s.excess_ms_per_step, default=None)


def read_on_straggler(rank, excess_ms: float, rule: str) -> str:
    """What a figure read on the straggler's own step says of it (the verdict's, and the rules' that read waits)."""
    return (f"read on rank {rank}, the straggler (the other ranks' waits for it, +{excess_ms:.2f} ms a step, "
            f"are {rule}'s)")


def _sorted_median(xs: list[float]) -> float:
    """The median of a sorted list."""
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def _best_cut(xs: list[float]) -> Optional[tuple[int, float, float, float]]:
    """Of the places to cut ``xs`` in two (SHIFT_MIN_STEPS or more each side), the one whose parts differ as levels
    (SHIFT_*) leaving the most of each part on its side of the two medians' midpoint, then the larger ratio:
    (index of the later part's first, earlier median, later median, the lesser share on its side); None where none
    does. The parts are kept sorted as the cut moves (one insertion and one removal a step): a 20,000-step run is read
    in well under a second."""
    n = len(xs)
    if n < 2 * SHIFT_MIN_STEPS:
        return None
    left, right = sorted(xs[:SHIFT_MIN_STEPS - 1]), sorted(xs[SHIFT_MIN_STEPS - 1:])
    best = None
    for k in range(SHIFT_MIN_STEPS, n - SHIFT_MIN_STEPS + 1):
        x = xs[k - 1]  # moves from the later part to the earlier
        bisect.insort(left, x)
        del right[bisect.bisect_left(right, x)]
        a, b = _sorted_median(left), _sorted_median(right)
        lo, hi = min(a, b), max(a, b)
        if lo <= 0 or hi < SHIFT_MIN_RATIO * lo or hi - lo < SHIFT_MIN_MS:
            continue
        mid = (a + b) / 2
        if b > a:  # each part's steps on its own side of the midpoint: below it before, above it after
            sa, sb = bisect.bisect_left(left, mid), len(right) - bisect.bisect_right(right, mid)
        else:
            sa, sb = len(left) - bisect.bisect_right(left, mid), bisect.bisect_left(right, mid)
        sa, sb = sa / len(left), sb / len(right)
        if min(sa, sb) < SHIFT_MIN_SEPARATION:
            continue
        key = (sa + sb, hi / lo)
        if best is None or key > best[0]:
            best = (key, k, a, b, min(sa, sb))
    return None if best is None else best[1:]


def resistant_slope(xs: list[float], ys: list[float]) -> float:
    """Tukey's resistant line's slope through the points: its outer thirds' medians (by x); 0 where undefined."""
    pts = sorted(zip(xs, ys))
    t = len(pts) // 3
    med = statistics.median
    dx = med(x for x, _ in pts[-t:]) - med(x for x, _ in pts[:t]) if t else 0
    return (med(y for _, y in pts[-t:]) - med(y for _, y in pts[:t])) / dx if dx > 0 else 0.0


# a step's time in each phase a level shift reports per part (ms: LevelShift.phases_before_ms, phases_after_ms) ...
_PART_PHASES = {"forward": lambda s: s.forward_ms, "backward": lambda s: s.backward_ms,
                "optimizer": lambda s: s.optimizer_ms, "outside": lambda s: max(0.0, s.outside_ms - s.gc_ms),
                "gc": lambda s: s.gc_ms, "ag_wait": collective_wait_ms, "own": own_ms}
# ... and in each it can move, as jitter.level_shift names them (compute: forward and backward less the waits)
_SHIFT_PHASES = {"compute": lambda s: s.forward_ms + s.backward_ms - collective_wait_ms(s),
                 **{k: _PART_PHASES[k] for k in ("outside", "optimizer", "gc", "ag_wait")}}


def _drift_line(steps: list[int], walls: list[float], by_rank: dict, bounds: list[int],
                up: bool) -> Optional[list[list[float]]]:
    """Where the step times ``walls`` (of the steady ``steps``, each the median over the ranks ``by_rank``) grew
    (``up``; else fell) steadily rather than in the levels ``bounds`` cut them into: the phase that moved most grows
    within the parts as across them (SHIFT_DRIFT_SHARE); the step time's resistant line [[first step, ms], [last
    step, ms]], None where it changed in levels.  The phase alone, not the step: the other phases' noise hid a
    recorded 3 ms a step outside the model (tests/fixtures/level_shift/drift: the step time's own slope within its
    levels 0.43 of its slope across them, the phase's 0.96; recorded and constructed changes in levels 0.27 or
    less)."""
    med = statistics.median
    parts = list(zip(bounds, bounds[1:]))
    moved = None
    for fn in _SHIFT_PHASES.values():
        ys = [med(fn(d[st]) for d in by_rank.values()) for st in steps]
        delta = med(ys[parts[-1][0]:]) - med(ys[:parts[0][1]])
        if moved is None or (delta if up else -delta) > moved[0]:
            moved = (delta if up else -delta, ys)
    ys = moved[1]
    across = resistant_slope(steps, ys)
    centred = [(x - mx, y - my) for i, j in parts for mx, my in [(med(steps[i:j]), med(ys[i:j]))]
               for x, y in zip(steps[i:j], ys[i:j])]
    within = resistant_slope([x for x, _ in centred], [y for _, y in centred])
    slope = resistant_slope(steps, walls)
    if across == 0 or (across > 0) != up or within / across < SHIFT_DRIFT_SHARE or slope == 0 or (slope > 0) != up:
        return None
    icpt = med(y - slope * x for x, y in zip(steps, walls))
    return [[steps[0], round(icpt + slope * steps[0], 3)], [steps[-1], round(icpt + slope * steps[-1], 3)]]


def level_shift(usable: dict) -> Optional[LevelShift]:
    """Where the job's steady steps (``usable_steps`` of each rank, {rank: steps}; the steps every rank kept, each
    its median over the ranks, whose collectives keep them in step) fall into an earlier and a later part whose step
    times differ as levels, not as noise (``_best_cut``); then, each part cut again where it holds a further change
    the same way (a step that went 57 ms -> 240 ms at step 20 and -> 3.3 s at step 26, a new-user trial's thread
    started on one rank: the one cut alone dated it at 26). A step's time is counted without its save, as in
    ``step_stats``. None where no cut is found."""
    by_rank = {r: {s.step: s for s in st} for r, st in usable.items()}
    common = sorted(set.intersection(*(set(d) for d in by_rank.values()))) if by_rank else []
    xs = [statistics.median(d[st].wall_ms - getattr(d[st], "checkpoint_ms", 0.0) for d in by_rank.values())
          for st in common]
    top = _best_cut(xs)
    if top is None:
        return None
    k, a, b, sep = top
    up = b > a
    cuts = [k]
    if (early := _best_cut(xs[:k])) is not None and (early[2] > early[1]) == up:
        cuts.insert(0, early[0])
    if (late := _best_cut(xs[k:])) is not None and (late[2] > late[1]) == up:
        cuts.append(k + late[0])
    bounds = [0, *cuts, len(xs)]
    parts = [common[i:j] for i, j in zip(bounds, bounds[1:])]
    med = statistics.median

    def phases(part: list[int], d: dict) -> dict[str, float]:
        return {k: round(med(fn(d[st]) for st in part), 3) for k, fn in _PART_PHASES.items()}

    first, last = parts[0], parts[-1]
    line = _drift_line(common, xs, by_rank, bounds, up)
    return LevelShift(drift_line=line or [], first_after=parts[1][0], last_before=first[-1], steps_before=len(first),
                      steps_after=len(common) - len(first), ms_before=round(med(xs[:cuts[0]]), 3),
                      ms_after=round(med(xs[cuts[-1]:]), 3), separation=round(sep, 3),
                      levels=[[p[0], p[-1], round(med(xs[i:j]), 3)] for p, i, j in zip(parts, bounds, bounds[1:])]
                      if len(parts) > 2 else [],
                      phases_before_ms={str(r): phases(first, d) for r, d in by_rank.items()},
                      phases_after_ms={str(r): phases(last, d) for r, d in by_rank.items()})


def profiler_export_steps(rd) -> list[int]:
    """Steps whose time includes writing a profiler window's trace (the step after the window: its "outside"
    time is the export, not data loading)."""
    recorded = {s.step: s for s in rd.steps}
    out = set()
    for pw in rd.profiles:
        if pw.steps:
            nxt = recorded.get(max(pw.steps) + 1)
            if nxt is not None and nxt.profiled:
                out.add(nxt.step)
    return sorted(out)


def analyze_steps(run: Run) -> StepsSection:
    per_rank = {}
    job_device = []
    modules = unit_modules(run.config.units if run.config is not None else [])
    usable = {r: usable_steps(rd.steps) for r, rd in sorted(run.ranks.items())}
    for r, rd in sorted(run.ranks.items()):
        st = usable[r]
        stats = step_stats(st)
        stats.recorded = len(rd.steps)
        stats.excluded = len(rd.steps) - len(st)
        pairs = device_pairs(rd, st)
        if pairs:  # on CUDA: the device's view of the same steps
            stats.device = device_stats(pairs, modules)
            job_device += pairs
        per_rank[str(r)] = stats
    job = [s for st in usable.values() for s in st]
    job_stats = step_stats(job) if job else None
    if job_stats is not None and job_device:
        job_stats.device = device_stats(job_device, modules)
    return StepsSection(
        per_rank=per_rank,
        job=job_stats,
        outliers=find_outliers(run),
        stragglers=find_stragglers(run),
        # per rank, the profiled windows' steps and the step that exported each window (left out of the
        # statistics like every profiled step; a presenter marks them instead of reading them as a stall)
        profiler_steps={str(r): {"window": sorted({s for pw in rd.profiles for s in pw.steps}),
                                 "export": profiler_export_steps(rd)} for r, rd in sorted(run.ranks.items())},
        no_grad={str(r): ng for r, rd in sorted(run.ranks.items()) if (ng := no_grad_steps(rd.steps)) is not None},
        checkpoints={str(r): c for r, rd in sorted(run.ranks.items())
                     if (c := checkpoint_steps(rd.steps)) is not None},
        compiled={str(r): c for r, rd in sorted(run.ranks.items())
                  if (c := compile_steps(rd.steps, _fsdp_framed(rd.config or run.config))) is not None},
        skipped={str(r): k for r, rd in sorted(run.ranks.items()) if (k := skipped_steps(rd.steps)) is not None},
        repeated={str(r): c for r, rd in sorted(run.ranks.items()) if (c := repeated_calls(rd))},
        counted_kept={str(r): kept for r, st in usable.items() if (kept := counted_kept(st))},
        doctor_own_ms={str(r): own for r, rd in sorted(run.ranks.items()) if (own := doctor_own(rd.steps, usable[r]))},
        level_shift=level_shift(usable),
    )


def doctor_own(steps: list[StepRecord], usable: list[StepRecord]) -> list[float]:
    """[the doctor's own ms, the steps' ms, its ms on an ordinary step, the median step's ms, of its own ms the part in
    its own steps] over a rank's steps after the first: its work between steps (each step's doctor_ms) and, in its
    own steps (a profiler window, a memory count op by op), their time over the median step beyond that; [] without
    steady steps. (A new-user trial's long run: 7.1 s of 156 s, said nowhere; a 12-step one read 79% of its time,
    nearly all one profiler window's export: what every step costs is said apart, and what the windows cost once.)"""
    rest = [s for s in steps if s.step > 0]
    if not usable or not rest:
        return []
    med = statistics.median(s.wall_ms for s in usable)
    once = sum(s.doctor_ms + max(0.0, s.wall_ms - med - s.doctor_ms) for s in rest if doctor_step(s))
    own = sum(s.doctor_ms for s in rest if not doctor_step(s)) + once
    every = statistics.median(s.doctor_ms for s in usable)
    return [round(own, 3), round(sum(s.wall_ms for s in rest), 3), round(every, 3), round(med, 3), round(once, 3)]


def counted_kept(usable: list[StepRecord]) -> list[int]:
    """Of a rank's ``usable_steps``, those whose memory the doctor counted op by op (slower than the others: its own
    cost), kept since fewer than 3 steps would remain without them (a short run: the title said they were left out)."""
    return [s.step for s in usable if counted_op_by_op(s)]
