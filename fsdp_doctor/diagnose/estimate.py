"""Shared numbers for the rules: the run's step time and peak, the units as the rules read them (``Unit``:
defaults filled in, timings always there), the trace's per-unit collective rows per step (``TraceRow``), and
the gain estimates that several rules share.

Every estimate here is built from what this run measured (host-side unit timings, trace exposure, the
memory breakdown) plus the few stated assumptions below; a rule that lacks an input gets ``None`` and
leaves that side of its prediction empty rather than guessing.
"""

from __future__ import annotations

import math
import statistics
from types import SimpleNamespace
from typing import Iterable, NamedTuple, Optional

import msgspec

from ..analyze.memory import recompute_held
from ..analyze.steps import (SHIFT_MIN_SEPARATION, STRAGGLER_MIN_CONSISTENCY, late_straggler, profiled_saves,
                             read_on_straggler as read_on_late, unit_modules, unit_passes)
from ..records import (LIGHTNING_DRIVER, OLMO_DRIVER, TITAN_DRIVER, TORCHTITAN_SHARDER, TORCHTUNE_DRIVER,
                       TRAINER_DRIVER, TRANSFORMERS_SHARDER, UnitConfig, unit_defaults)
from ..report_sections import (CommUnitRow, MemoryRank, MemoryUnitRow, OverlapSection,
                               Predicted, StepsSection, UnitTiming)
from ..trace.build import MODEL_PHASE
from ..trace.collectives import dtype_bytes
from ..trace.model import OTHER_UNIT  # (collectives no FSDP unit issued: optimizer step, clipping, metrics)
from ..units import fmt_bytes, fmt_list, fmt_share, fsdp_label  # (fmt_list: rules call it E.fmt_list)
from . import thresholds as T
from .base import Context, prepared_by_user, trace_device  # noqa: F401  (trace_device: "gpu" | "cpu" | None)

# What a unit field reads as where the report (or the snapshot) has None ("unknown") for it: UnitConfig's own
# defaults (fsdp_doctor.records), the one source.
_UNIT_DEFAULTS = unit_defaults()

# A checkpointed transformer block keeps only its input; without checkpointing it keeps roughly this many
# times the input in saved tensors (Korthikanti et al. 2022: ~34·s·b·h bytes of saved activations per
# layer in 16-bit against 2·s·b·h of input, attention scores aside). Used only where the run cannot measure it.
SAVED_PER_INPUT = 16.0
# The memory target a recommendation aims for: this share of capacity leaves room for fragmentation and
# allocator caching (the CUDA caching allocator rarely runs cleanly above ~90%).
TARGET_CAPACITY_SHARE = T.NEAR_CAPACITY_SHARE


def _once(fn):
    """``fn(ctx)`` computed once per diagnosis (``Context.memo``); its callers get the same object: read only."""
    def once(ctx: Context):
        memo = getattr(ctx, "memo", None)
        if memo is None:
            return fn(ctx)
        if fn.__name__ not in memo:
            memo[fn.__name__] = fn(ctx)
        return memo[fn.__name__]

    once.__name__, once.__doc__, once.__wrapped__ = fn.__name__, fn.__doc__, fn
    return once


# ---------------------------------------------------------------------------------------------- sections
def steps(ctx: Context) -> StepsSection:
    """The steps section, empty where the run has no step records."""
    return ctx.report.steps or StepsSection()


def after_shift(ctx: Context, flagged: list[int], common: list[int]) -> Optional[str]:
    """Where the steps a rule found slow (``flagged``, of the steady steps ``common``) are the later part of the
    job's level shift, not steps now and then: mostly (SHIFT_MIN_SEPARATION) from its first step after the change on,
    and half that part's steps or more, or, where the step time grew steadily, the latest of it (a thread started on
    rank 1 at step 20 read "late in 16 of 37 steps", tests/fixtures/level_shift/busy; a loop whose work grew 2 ms a
    step read "every rank stops 26 ms outside the model in 7 of 33 steps"); the words for the rule's quiet reason
    after its subject ("rank 1 late in ..."), None otherwise."""
    shift = steps(ctx).level_shift
    later = [st for st in common if shift is not None and st >= shift.first_after]
    after = [st for st in flagged if later and st >= later[0]]
    if not later or len(after) < SHIFT_MIN_SEPARATION * len(flagged):
        return None
    if shift.drift_line:
        return (f"{len(flagged)} of {len(common)} steps, the latest of a step time that grew steadily "
                "(jitter.level_shift)")
    if 2 * len(after) < len(later):
        return None
    return f"{len(after)} of the {len(later)} steps from step {later[0]} on, where the step time changed and stayed " \
           "(jitter.level_shift)"


def overlap(ctx: Context) -> OverlapSection:
    """The trace section, empty where the run has no trace."""
    return ctx.report.overlap or OverlapSection()


# ---------------------------------------------------------------------------------------------- run-level
def step_ms(ctx: Context) -> Optional[float]:
    """The job's median step time (ms), or the median of the ranks' medians."""
    st = steps(ctx)
    if st.job is not None and st.job.p50_ms:
        return float(st.job.p50_ms)
    vals = [r.p50_ms for r in st.per_rank.values() if r.p50_ms]
    return float(statistics.median(vals)) if vals else None


def step_mean_ms(ctx: Context) -> Optional[float]:
    """The job's mean step time (ms), or the median of the ranks' means: what a run costs per step, its occasional
    long steps included (the median leaves them out: a cost paid in a few steps only is a share of the mean)."""
    st = steps(ctx)
    if st.job is not None and st.job.mean_ms:
        return float(st.job.mean_ms)
    vals = [r.mean_ms for r in st.per_rank.values() if r.mean_ms]
    return float(statistics.median(vals)) if vals else None


def window_saves(ctx: Context) -> dict[int, list[int]]:
    """Per rank, the steps of its profiler windows that saved a checkpoint (analyze.steps.profiled_saves)."""
    return {r: hit for r, rd in getattr(ctx.run, "ranks", {}).items() if (hit := profiled_saves(rd.steps))}


def median_step_ag_waits(ctx: Context) -> Optional[tuple[float, float, float]]:
    """(forward waits, backward waits, wall; ms) of the step whose recorded all-gather waits take the median share
    of it (the lower of two), among every rank's usable steps (those of the step statistics; the straggler's alone
    where there is one: ``read_ranks``); None without step
    records. Each step's waits against its own wall: the host's load stretches a step's waits with it, while the
    median waits over the median wall pair steps of different lengths (40% on a loaded run whose steps waited
    42-67% of themselves). Nor the sum of the units' medians over the step p50: which unit waits moves from step to
    step (on a shared host, the unit where the other rank arrives late), so that sum leaves most steps' largest
    waits out (22% on a run of the reference GPT whose median step waited 27%; 14.6% where it waited 17.2%).
    A short run's statistics keep the steps whose memory the doctor counted op by op (fewer than 3 would remain):
    here they are left out wherever another usable step remains, since the counting stretches the step and its
    waits (a new-user trial's 8-step run read "152.5 ms per step" from a 548 ms step of a 233 ms run)."""
    from ..analyze.steps import counted_op_by_op, usable_steps

    read = read_ranks(ctx)  # (a straggler's own steps: the others' waits hold their wait for it)
    usable = [s for r, rd in (getattr(ctx.run, "ranks", None) or {}).items() if read is None or str(r) in read
              for s in usable_steps(rd.steps) if s.wall_ms > 0]
    usable = [s for s in usable if not counted_op_by_op(s)] or usable
    steps = sorted(((sum(u.ag_wait_fwd_ms for u in s.units), sum(u.ag_wait_bwd_ms for u in s.units), s.wall_ms)
                    for s in usable), key=lambda w: (w[0] + w[1]) / w[2])
    return steps[(len(steps) - 1) // 2] if steps else None


def other_fsdp_units(ctx: Context) -> int:
    """FSDP2 units of another model alive in the run's processes at its exit (analyze.report.other_fsdp_units)."""
    from ..analyze.report import other_fsdp_units as of_run

    return of_run(ctx.run)


def calls_beyond_model(ctx: Context, name: str) -> float:
    """The median forward calls per step of a unit's modules (``name``) beyond those the model's forward passes make
    (analyze.steps.calls_beyond_model), over every rank's usable steps: code outside the model's forward called them
    (a loss that runs the output head per chunk: torchtitan's ChunkedLossWrapper); 0 without step records."""
    from ..analyze.steps import calls_beyond_model as beyond

    extra = [x for x, _ in beyond(ctx.config, getattr(ctx.run, "ranks", None) or {}).get(name, [])]
    return max(0.0, statistics.median(extra)) if extra else 0.0


def chunked_head(ctx: Context) -> Optional[tuple[str, int]]:
    """The unit a loss outside the model's forward runs once per chunk (the output head), and those chunks
    (analyze.steps.chunked_head); None where no such code calls any."""
    from ..analyze.steps import chunked_head as head

    return head(ctx.config, getattr(ctx.run, "ranks", None) or {})


def sequence_lengths(ctx: Context) -> set[int]:
    """The model's input lengths along its second dimension, the sequence (analyze.steps.sequence_lengths)."""
    from ..analyze.steps import sequence_lengths as lengths

    return lengths(getattr(ctx.run, "ranks", None) or {})


def phase_ms(ctx: Context, phase: str) -> Optional[float]:
    """The job's median time in one phase of the step (forward, backward, optimizer, outside, gc), or the
    median over the ranks."""
    st = steps(ctx)
    job = st.job.phases_p50_ms if st.job is not None and st.job.phases_p50_ms else {}
    if phase in job:
        return float(job[phase])
    vals = [r.phases_p50_ms[phase] for r in st.per_rank.values() if r.phases_p50_ms and phase in r.phases_p50_ms]
    return float(statistics.median(vals)) if vals else None


def backend(ctx: Context) -> Optional[str]:
    cfg = ctx.config
    if cfg is not None and cfg.backend:
        return cfg.backend
    return ctx.report.run.backend or None


def device(ctx: Context) -> str:
    cfg = ctx.config
    if cfg is not None and cfg.device:
        return cfg.device
    return ctx.report.run.device or ""


def on_gpu(ctx: Context) -> bool:
    return device(ctx).startswith("cuda")


def trainer_driven(ctx: Context) -> bool:
    """A Hugging Face Trainer drove the run (fsdp_doctor.DoctorCallback): its fixes go where a Trainer's user can
    put them (snippets.for_trainer)."""
    return getattr(ctx.config, "driver", None) == TRAINER_DRIVER


def lightning_accumulate(ctx: Context) -> int | None:
    """PyTorch Lightning's Trainer drove the run: its accumulate_grad_batches (a loop fix goes into the
    LightningModule's training_step: snippets.for_lightning); where only its profiler's trace says so, the backward
    passes its windows counted between two optimizer steps (the trace section's ``backwards_per_optimizer_step``);
    None: not such a run, or not counted."""
    if not lightning_driven(ctx):
        return None
    if ctx.config is not None:
        return getattr(ctx.config, "lightning_accumulate", None)
    counted = [pr.backwards_per_optimizer_step for pr in overlap(ctx).per_rank.values()
               if pr.backwards_per_optimizer_step]
    return max(1, round(statistics.median(counted))) if counted else None


def _driven_by(ctx: Context, driver: str) -> bool:
    """``driver`` drove the run: the records say so (``RunConfig.driver``), or a rank's trace (``OverlapRank.driver``,
    from its labels or Python frames)."""
    return getattr(ctx.config, "driver", None) == driver or any(
        pr.driver == driver for pr in overlap(ctx).per_rank.values())


def lightning_driven(ctx: Context) -> bool:
    """PyTorch Lightning's Trainer drove the run: a watched LightningModule attached to one, or a trace of its own
    profiler's (its labels, ``OverlapRank.driver``)."""
    return _driven_by(ctx, LIGHTNING_DRIVER)


def dataloader_ms(ctx: Context, rank) -> Optional[float]:
    """Ms per step ``rank``'s DataLoader took for its next batch in the profiled steps (the trace's
    ``enumerate(DataLoader)#...`` labels: the wait for its workers, or the loading without them); None without a trace
    of complete steps, or where none held such a label (the loop feeds its batches otherwise)."""
    pr = overlap(ctx).per_rank.get(str(rank))
    return pr.dataloader_ms_per_step if pr is not None else None


def titan_trainer_driven(ctx: Context) -> bool:
    """torchtitan's own Trainer drove the run (python -m fsdp_doctor.titan): its fixes go on its command line or
    in the user's config_registry function (snippets.for_titan_trainer)."""
    return getattr(ctx.config, "driver", None) == TITAN_DRIVER


def olmo_driven(ctx: Context) -> bool:
    """OLMo-core's Trainer drove the run (fsdp_doctor.olmo.DoctorCallback, or a trace of its ProfilerCallback's: its
    Python frames, ``OverlapRank.driver``): its fixes go into the configs it builds the train module from, or after
    that build (snippets.for_olmo)."""
    return _driven_by(ctx, OLMO_DRIVER)


def torchtune_recipe(ctx: Context) -> Optional[str]:
    """The file of the torchtune recipe that drove the run (watch() called in its method): its loop and its
    _setup_model are where the user, in a copy (`tune cp`), puts a fix, and its config shards the model
    (snippets.for_torchtune); None: not such a run."""
    if getattr(ctx.config, "driver", None) != TORCHTUNE_DRIVER:
        return None
    return getattr(ctx.config, "recipe", None) or "your recipe"


def torchtune_reductions(ctx: Context) -> tuple[list[str], Optional[str]]:
    """What the torchtune recipe's train() all-reduces at each optimizer step, as written, and the one its gradient
    scaling divides by (RunConfig.recipe_reduced, recipe_scaled_by); ([], None): not read (a run recorded before
    these fields: full_finetune's num_tokens and running_loss assumed)."""
    cfg = ctx.config
    return list(getattr(cfg, "recipe_reduced", None) or []), getattr(cfg, "recipe_scaled_by", None)


def torchtune_unread(ctx: Context) -> list[str]:
    """The names the torchtune recipe's train() binds a forward's returns to and never reads (RunConfig.recipe_unread:
    DPO's reference forward's `_`); [] none, not read, or no recipe."""
    return list(getattr(ctx.config, "recipe_unread", None) or []) if torchtune_recipe(ctx) is not None else []


def plugin_lever(ctx: Context) -> Optional[str]:
    """Where a fix of a setting of accelerate's FSDP2 plugin goes (report_sections.FIX_PLACES), when that plugin
    sharded the model: "trainer" (a Trainer drove the run), "accelerate" (the user's accelerator.prepare); None:
    the user's own fully_shard calls."""
    if trainer_driven(ctx):
        return "trainer"
    return "accelerate" if prepared_by_user(ctx.config) else None


def transformers_sharded(ctx: Context) -> bool:
    """transformers sharded the model itself (from_pretrained with a DistributedConfig): snippets.for_transformers."""
    return getattr(ctx.config, "sharded_by", None) == TRANSFORMERS_SHARDER


def torchtitan_version(ctx: Context) -> Optional[str]:
    """The torchtitan version whose parallelize function sharded the model from its job config ("" when torchtitan
    sharded it but its version is unknown); None: not torchtitan. Its fixes are that config's settings
    (snippets.titan_settings)."""
    if getattr(ctx.config, "sharded_by", None) != TORCHTITAN_SHARDER:
        return None
    return getattr(ctx.config, "sharder_version", None) or ""


# ---------------------------------------------------------------------------------------------- memory
def memory_per_rank(ctx: Context) -> dict[str, MemoryRank]:
    """The memory section's ``per_rank``; without one (a report built without it), the same section computed
    from the run's step records by the one analysis that builds it (fsdp_doctor.analyze.memory)."""
    mem = ctx.report.memory
    if mem is not None and mem.per_rank:
        return mem.per_rank
    from ..analyze.memory import analyze_memory

    derived = analyze_memory(ctx.run)  # None without ranks or memory records
    return derived.per_rank if derived is not None else {}


def peak_memory(ctx: Context) -> Optional[MemoryRank]:
    """The memory record of the rank with the highest measured peak (the first such rank)."""
    per_rank = memory_per_rank(ctx)
    return max(per_rank.values(), key=lambda m: m.peak_bytes) if per_rank else None


def timeline_units(pm: Optional[MemoryRank], phase: str) -> list[str]:
    """The units of the peak step's timeline rows at ``phase``, in order, the root ("") and rows outside every unit
    left out ([] without a timeline)."""
    return [r.get("unit") for r in (pm.timeline or [] if pm is not None else [])
            if r.get("phase") == phase and r.get("unit") not in (None, "")]


def step_temporaries(pm: MemoryRank) -> tuple[int, int]:
    """(made by the step's operators, held at its first mark) of the peak's temporaries. On CUDA the temporaries are
    the allocator's bytes outside every category, and the step's first mark already holds some (cuBLAS's and NCCL's
    workspaces, the batch, tensors kept from before: 65-74 MiB on the H100 rows, 68.78 of a 99.28 MiB peak's
    78.76 MiB on one); on the CPU it holds none (the probe counts from that mark)."""
    tl = pm.timeline or []
    held = int(tl[0].get("temporaries") or 0) if tl and pm.timeline_step == pm.peak_at.step else 0
    return max(0, int(pm.peak_breakdown.get("temporaries") or 0) - held), held


def peak_bytes(ctx: Context) -> Optional[int]:
    pm = peak_memory(ctx)
    return int(pm.peak_bytes) if pm else None


def trace_peak_bytes(ctx: Context) -> Optional[int]:
    """The highest rank's peak from a plain trace's ``[memory]`` events (``overlap.memory``, the memory the report
    shows without records: one total, no categories; a CPU's counted from the profiler's start); None without them."""
    tm = ctx.report.overlap.memory if ctx.report.overlap is not None else None
    return int(tm.peak_bytes) if tm is not None and tm.per_rank else None


def capacity_bytes(ctx: Context) -> Optional[int]:
    pm = peak_memory(ctx)
    if pm and pm.capacity_bytes:
        return int(pm.capacity_bytes)
    cfg = ctx.config
    if cfg is not None and cfg.capacity_bytes:
        return int(cfg.capacity_bytes)
    cap = ctx.report.run.capacity_bytes  # UNSET (no configuration record) or None read as unknown
    return int(cap) if cap else None


def peak_near_capacity(ctx: Context) -> bool:
    """Whether the peak rank's peak is near its capacity (thresholds.NEAR_CAPACITY_SHARE of it or more); False
    where either is unknown. Where the optimizer was built before fully_shard, the peak its fix leaves
    (``budget_peak``): the stale tensors it gives back are no memory to find elsewhere."""
    peak, cap = budget_peak(ctx), capacity_bytes(ctx)
    return bool(peak and cap) and peak / cap >= T.NEAR_CAPACITY_SHARE


# Optimizer state per parameter byte (fp32 state on fp32 params), for predicting the state a fixed optimizer
# creates: Adam-family keep exp_avg and exp_avg_sq; SGD with momentum one buffer (assumed on).
STATE_PER_PARAM = {"adamw": 2, "adam": 2, "nadam": 2, "radam": 2, "adamax": 2, "sgd": 1, "rmsprop": 1,
                   "adagrad": 1}


class StaleFix(NamedTuple):
    """optim.before_shard's fix, in bytes at the peak rank's peak: the ``stale`` full-size tensors the optimizer built
    before fully_shard keeps alive go, the model's gradients it never zeroes (``freed``: those at the peak, from the
    steps before) are freed by its zero_grad, and its state appears for the first time (``new_state``)."""

    peak: Optional[int]  # None: no memory records
    stale: int  # 0: not known
    freed: int
    new_state: int
    state_known: bool  # the optimizer's state per parameter is known (STATE_PER_PARAM): ``new_state`` counted

    @property
    def after(self) -> Optional[int]:
        """The peak once the fix is applied; None where the peak or the stale bytes are not known."""
        return self.peak - self.stale - self.freed + self.new_state if self.peak is not None and self.stale else None


@_once
def stale_fix(ctx: Context) -> Optional[StaleFix]:
    """What optim.before_shard's fix does to the peak (``StaleFix``); None where the optimizer holds the model's own
    parameters. The one estimate of it: optim.before_shard predicts its ``after``, and the rules that weigh the peak
    against capacity read it (``budget_peak``, ``below_budget``)."""
    cfg = ctx.config
    if cfg is None or (cfg.optimizer_foreign_params or 0) <= 0:
        return None
    peak, bd = peak_bytes(ctx), breakdown(ctx)
    stale = bd.get("stale_optimizer_params") or cfg.optimizer_foreign_bytes or 0
    # the state only for trainable parameters, where the optimizer held none (its state on the stale tensors,
    # which never receive gradients, does not exist)
    shard = sum(grad_shard_bytes(u) for u in param_units(ctx))
    per_param = STATE_PER_PARAM.get((cfg.optimizer or "").lower())
    new_state = 0 if bd.get("optimizer_state") else (per_param or 0) * shard
    # the gradients at the peak go with the fix where they are the previous steps' (one forward a step); under
    # gradient accumulation the peak holds this step's earlier micro-batches' too, which stay (a new-user
    # trial's 2 micro-batches: 4.59 MiB predicted, 5.00 measured, the new state replacing the stale tensors)
    passes = backward_passes(ctx)
    accumulating = (passes if passes is not None else max(micro_batches(ctx).values(), default=1.0)) > 1
    freed = 0 if accumulating else (bd.get("sharded_grads") or 0)
    return StaleFix(None if peak is None else int(peak), int(stale), int(freed), int(new_state), per_param is not None)


def budget_peak(ctx: Context) -> Optional[int]:
    """The peak a rule weighs against capacity: the measured one, or where the optimizer was built before
    fully_shard, the one optim.before_shard's fix leaves (``stale_fix``): a user applies that critical fix first,
    and advice to free memory (checkpointing, resharding, offload) for bytes it gives back would change what need
    not change. None without a peak."""
    after = getattr(stale_fix(ctx), "after", None)
    return after if after is not None else peak_bytes(ctx)


def stale_words(ctx: Context, cap: Optional[int] = None, under: Optional[float] = None) -> str:
    """"peak 17.79 MiB holds 3.56 MiB of stale parameters the optimizer keeps (optim.before_shard): its fix leaves
    16.01 MiB (the model's gradients at the peak, 1.78 MiB, freed by zero_grad; 3.56 MiB of optimizer state
    created)" and, with ``cap``, ", 81% of capacity 19.76 MiB" (``under``: the threshold said beside it, as
    ``fmt_share``'s); "" where the optimizer holds the model's own parameters."""
    fix = stale_fix(ctx)
    if fix is None or fix.after is None:
        return ""
    parts = ([f"the model's gradients at the peak, {fmt_bytes(fix.freed)}, freed by zero_grad"] if fix.freed else []) \
        + ([f"{fmt_bytes(fix.new_state)} of optimizer state created"] if fix.new_state else [])
    return (f"peak {fmt_bytes(fix.peak)} holds {fmt_bytes(fix.stale)} of stale parameters the optimizer keeps "
            f"(optim.before_shard): its fix leaves {fmt_bytes(fix.after)}"
            + (f" ({'; '.join(parts)})" if parts else "")
            + (f", {fmt_share(fix.after / cap, under=under)} of capacity {fmt_bytes(cap)}" if cap else ""))


#: what a rule judging on peak_with_fused_step's peak adds to its quiet reasons
ONCE_FUSED = " once the fused step frees foreach's intermediates"


def peak_with_fused_step(ctx: Context, peak: int) -> tuple[int, str]:
    """(the peak a rule weighing a costlier lever judges on, what its quiet reasons add): where
    optim.foreach_temporaries fired before (the rule reading it runs ``last``), the peak once the optimizer steps
    fused (its prediction) and ONCE_FUSED; else ``peak`` and "". The fused step frees foreach's intermediates at no
    cost (a torchtitan trial's state, 40% of the step's peak less the activations, was 42% of the peak the fused step
    left, and its rule fired only after that fix)."""
    f = next((f for f in ctx.earlier if f.code == "optim.foreach_temporaries"), None)
    after = f.predicted.peak_bytes_after if f is not None and f.predicted is not None else None
    return (int(after), ONCE_FUSED) if after and int(after) != peak else (peak, "")


def near_capacity(ctx: Context) -> tuple[Optional[MemoryRank], int, Optional[str], Optional[str]]:
    """For a rule about a peak near capacity (from thresholds.NEAR_CAPACITY_SHARE on): (the peak step's memory, the
    capacity, why the rule is skipped: no peak or no capacity, why it is quiet: the peak below that share,
    ``below_budget``); a reason None: not so."""
    pm, cap = peak_memory(ctx), capacity_bytes(ctx)
    if pm is None or not cap:
        return pm, cap or 0, no_peak_or_capacity(ctx, pm, cap), None
    return pm, cap, None, below_budget(ctx, int(pm.peak_bytes), cap, T.NEAR_CAPACITY_SHARE)


def below_budget(ctx: Context, peak: int, cap: int, threshold: float) -> Optional[str]:
    """Why a rule that frees memory once the peak reaches ``threshold`` of capacity is quiet: the peak below it
    (``below_share``), or above it only by what optim.before_shard's fix gives back (``stale_words``, "... (fires
    from 85%)"); None: it fires."""
    if peak / cap < threshold:
        return below_share("peak", peak, cap, "capacity", threshold)
    after = budget_peak(ctx)
    if after is not None and after / cap < threshold:
        return f"{stale_words(ctx, cap, threshold)} (fires from {fmt_share(threshold)})"
    return None


def stale_offset(ctx: Context) -> int:
    """What optim.before_shard's fix takes off the peak (bytes; 0 without that fix, or where it adds): a rule that
    sizes its lever against the budget aims that much higher on this run's timeline, which still holds the stale
    tensors."""
    fix = stale_fix(ctx)
    return max(0, fix.peak - fix.after) if fix is not None and fix.after is not None else 0


def breakdown(ctx: Context) -> dict[str, int]:
    """The peak rank's memory at its peak by category (bytes)."""
    pm = peak_memory(ctx)
    return dict(pm.peak_breakdown) if pm else {}


def recomputed_at_peak(ctx: Context) -> int:
    """Bytes of the peak rank's temporaries at its peak that are the recomputed activations of a checkpointed unit
    (a peak in its backward: up to its recompute's saved bytes, at most the temporaries); 0 otherwise. They grow
    with the batch as the saved activations do."""
    pm = peak_memory(ctx)
    if pm is None or pm.peak_at.unit is None or "backward" not in (pm.peak_at.phase or ""):
        return 0
    unit = next((u for u in units(ctx) if u.name == pm.peak_at.unit), None)
    held = recompute_held(next((u for u in pm.per_unit if u.unit == pm.peak_at.unit), None),
                          bool(getattr(unit, "checkpoint_selective", False)))
    return int(min(held, pm.peak_breakdown.get("temporaries", 0)))


def memory_units(ctx: Context) -> dict[str, MemoryUnitRow]:
    """Per-unit memory rows of the peak rank, by unit name."""
    pm = peak_memory(ctx)
    return {u.unit: u for u in pm.per_unit} if pm else {}


# ---------------------------------------------------------------------------------------------- units
class Unit(UnitConfig, kw_only=True):
    """A unit as the rules read it: its configuration with every "unknown" (None) figure at UnitConfig's
    default, and its median timings (zeros, with ``has_timing`` False, where no steady step timed it)."""

    timing: UnitTiming = msgspec.field(default_factory=UnitTiming)
    has_timing: bool = False

    @classmethod
    def of(cls, row: UnitConfig) -> "Unit":
        """From a report row (``UnitRow``) or the run's snapshot (``UnitConfig``, never timed)."""
        fields = {f: getattr(row, f) for f in UnitConfig.__struct_fields__}
        fields.update({f: d for f, d in _UNIT_DEFAULTS.items() if fields[f] is None})
        timing = getattr(row, "timing_p50", msgspec.UNSET)
        if fields["compiled_in_place"]:
            # inside another module's compiled frame, timed from FSDP2's own hooks: its forward and backward hold its
            # all-gather waits, which most rules read apart; the rules read it untimed, as they did before it was timed
            timing = msgspec.UNSET
        return cls(**fields, timing=timing or UnitTiming(), has_timing=bool(timing))


def units(ctx: Context) -> list[Unit]:
    """The report's units, from the run's config where the report has no unit table; their timings the
    straggler's own where there is one (``late_unit_rows``)."""
    rows = late_unit_rows(ctx) or ctx.report.units
    if not rows and ctx.config is not None:
        rows = ctx.config.units
    return [Unit.of(r) for r in rows or []]


@_once
def late_unit_rows(ctx: Context) -> list:
    """The report's unit table read on the straggler's own steps (``late_rank``, from step records), or [] without
    one: the others' all-gather waits hold their wait for it (its lateness), and the rules read a unit's waits and
    its compute (its time less its wait) from one rank's steps. The trial's root waited 155.2 ms in forward (the
    median of 4 ranks, 3 of them waiting for rank 2) and 3.8-13.6 ms on rank 2."""
    late = late_rank(ctx) if steps(ctx).stragglers and ctx.report.units else None
    if late is None or late.rule != "straggler.rank":
        return []
    from ..analyze.report import unit_table

    return unit_table(ctx.run, ranks=[int(late.rank)])


def grad_shard_bytes(u: Unit) -> int:
    """This rank's gradient shard bytes of the unit (= its optimizer's per-parameter state size): its trainable
    parameters' local shards; a frozen base has no gradient. A run recorded before the snapshot read which
    parameters train: every parameter's."""
    return u.sharded_bytes if u.trainable_sharded_bytes is None else u.trainable_sharded_bytes


def optimizer_shard_elements(ctx: Context, us: Iterable[Unit]) -> int:
    """This rank's parameter elements the optimizer steps: the units' trainable shards less the parameters it does
    not hold (RunConfig.untrained's per-unit split; an optimizer over the last block steps that block's only)."""
    split = getattr(getattr(ctx.config, "untrained", None), "units", None) or {}
    total = 0
    for u in us:
        n = grad_shard_bytes(u) // (dtype_bytes(u.orig_dtypes[0] if u.orig_dtypes else "float32") or 4)
        outside, held = split.get(u.name) or (0, 0)
        total += n * held // (outside + held) if outside else n
    return total


def optimizer_tensors(ctx: Context) -> int:
    """The parameter tensors the optimizer's groups hold (RunConfig.optimizer_groups)."""
    return sum(g.params for g in getattr(ctx.config, "optimizer_groups", None) or [])


def cpu_step_ratio(to: str, frm: str, elements: int, tensors: int) -> float:
    """How long an Adam or AdamW step in implementation ``to`` ("for-loop", "foreach", "fused") takes on one CPU
    thread against one in ``frm``, over ``tensors`` DTensor parameters of ``elements`` elements in all, by
    T.CPU_STEP_COST's model: it scales a step measured in ``frm`` (only the ratio is read: the host's speed cancels)."""
    def ms(impl):
        ns, us = T.CPU_STEP_COST[impl]
        return elements * ns / 1e6 + tensors * us / 1e3

    return ms(to) / ms(frm)


#: bytes per element of the floating dtypes a unit's parameters, compute and reduction use
DTYPE_WIDTH = {"float8_e4m3fn": 1, "float8_e5m2": 1, "bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


def grad_unsharded_bytes(u: Unit) -> int:
    """The unit's unsharded gradients as FSDP2 accumulates them without gradient sync: its trainable parameters',
    in the reduce dtype where that differs from the dtype they are computed in (FSDPParam's
    to_accumulated_grad_if_needed upcasts them: a new-user trial's bf16 policy reducing in float32 held 2.84 MiB
    against the 1.52 MiB predicted in bf16), else in that dtype (``unsharded_bytes``'s)."""
    b = u.unsharded_bytes if u.trainable_unsharded_bytes is None else u.trainable_unsharded_bytes
    compute = u.param_dtype or (u.orig_dtypes[0] if len(u.orig_dtypes or []) == 1 else None)
    reduce = u.reduce_dtype
    if b and compute in DTYPE_WIDTH and reduce in DTYPE_WIDTH and reduce != compute:
        return b * DTYPE_WIDTH[reduce] // DTYPE_WIDTH[compute]
    return b


def trace_grad_bytes(rows: Iterable[TraceRow]) -> tuple[Optional[int], int]:
    """(unsharded, shard) gradient bytes of the units of a trace's reduce-scatter rows, where no unit snapshot sizes
    them: a unit's reduce-scatter input is its unsharded gradients in the reduce dtype, as FSDP2 accumulates them
    without gradient sync (``grad_unsharded_bytes``), its output, the input over the call's group, its gradient shard
    (0 where the group is not known). (None, 0) where a unit's calls carry no message size (gloo without
    record_shapes)."""
    per: dict[str, list[TraceRow]] = {}
    for r in rows:
        per.setdefault(r.unit, []).append(r)
    full = shard = 0
    for rs in per.values():
        sizes = [r.bytes_per_call for r in rs if r.bytes_per_call]
        if not sizes:
            return None, 0
        size, group = statistics.median(sizes), max((r.group_size or 0 for r in rs), default=0)
        full, shard = full + size, shard + (size / group if group else 0)
    return int(full), int(shard)


def param_units(ctx: Context) -> list[Unit]:
    return [u for u in units(ctx) if u.param_count > 0]


def offloaded_units(ctx: Context) -> list[Unit]:
    """The units with parameters that CPUOffloadPolicy keeps in host memory (their optimizer steps on the CPU)."""
    return [u for u in param_units(ctx) if u.offload == "cpu"]


def non_root(us: Iterable[Unit]) -> list[Unit]:
    return [u for u in us if not u.is_root]


def roots(us: Iterable[Unit]) -> list[Unit]:
    return [u for u in us if u.is_root]


def running_stats_under(us: Iterable[Unit], modules: Iterable[str], but: Iterable[str] = ()) -> list[str]:
    """Of the units' modules that update running statistics in training (``running_stats_modules``: BatchNorm and
    the like), the fqns at or under one of ``modules`` and under none of ``but`` (checkpoint wrappers' names
    stripped): those a fix checkpointing ``modules`` runs once more per step in the recompute, or one
    un-checkpointing them once less (``but``: what stays checkpointed either way)."""
    def under(fqn: str, tops: list[str]) -> bool:
        return any(t in ("", fqn) or fqn.startswith(t + ".") for t in tops)

    tops, kept = [strip_ckpt(m) for m in modules], [strip_ckpt(m) for m in but]
    names = [strip_ckpt(n) for u in us for n in u.running_stats_modules or []]
    return [n for n in dict.fromkeys(names) if under(n, tops) and not under(n, kept)]


def post_forward_order(us: list[Unit], forward: Iterable[str] = ()) -> list[Unit]:
    """The units with parameters in FSDP2's post-forward order (``comm_ctx.post_forward_order``, which its implicit
    backward prefetch walks back along: each unit's pre-backward gathers the one before it): each unit after the
    units nested in it, siblings in the order the run started their forward (``forward``, snippets.run_order) where
    it recorded each of them, else in module order, the root last. (Module order alone put a CLIP's text tower
    first, which its forward runs second: the first text layer's default prefetch of the frozen vision tower's last
    layer in every backward read "no frozen unit comes before" it, a new-user trial.)"""
    names = {u.name for u in us}
    pos = _first_at(forward)
    kids: dict[Optional[str], list[Unit]] = {}
    for u in us:
        kids.setdefault(u.parent if u.parent in names else None, []).append(u)
    for sibs in kids.values():
        if len(sibs) > 1 and all(u.name in pos for u in sibs):
            sibs.sort(key=lambda u: pos[u.name])
    out: list[Unit] = []

    def visit(u: Unit) -> None:
        for c in kids.get(u.name, []):
            visit(c)
        out.append(u)

    for u in kids.get(None, []):
        visit(u)
    return [u for u in out if u.param_count > 0]


def _first_at(names: Iterable[str]) -> dict[str, int]:
    """Each name's first position in ``names``."""
    pos: dict[str, int] = {}
    for i, n in enumerate(names):
        pos.setdefault(n, i)
    return pos


def in_forward_order(ctx, us: list[Unit]) -> list[Unit]:
    """``us`` in the order the run started their forward (snippets.run_order) where it recorded each of them, else as
    given (module order: a CLIP's text tower before its vision tower, which its forward runs first)."""
    pos = _first_at(S.run_order(ctx)[0])
    return sorted(us, key=lambda u: pos[u.name]) if all(u.name in pos for u in us) else list(us)


def frozen_prefetches(us: list[Unit], idle: set[str]) -> Optional[list[tuple[Unit, str, bool]]]:
    """The backward prefetches that gather a unit of ``idle`` (frozen, before every trainable one: it never runs
    backward): (the unit whose pre-backward prefetches, the idle unit's name, from its explicit list or FSDP2's
    default, the previous unit in post-forward order), for ``us`` in that order. None where a unit that runs
    backward has several parameter groups (torch's backward prefetch per group is not modelled)."""
    wasted = []
    for i, u in enumerate(us):
        if u.name in idle:
            continue
        if (u.param_groups or 1) > 1:
            return None
        explicit = list(u.backward_prefetch or [])
        targets = explicit or ([us[i - 1].name] if i > 0 else [])
        wasted += [(u, t, bool(explicit)) for t in targets if t in idle]
    return wasted


def prefetch_lists_without(wasted: list[tuple[Unit, str, bool]], idle: set[str]) -> dict[str, list[str]]:
    """Each prefetching unit's backward prefetch list without the idle units (empty: the unit itself, written by
    snippets.backward_prefetch_lists)."""
    return {u.name: [t for t in u.backward_prefetch or [] if t not in idle] for u, _, _ in wasted}


def total_params(us: Iterable[Unit]) -> int:
    return sum(u.param_count for u in us)


def mib(n: Optional[float]) -> Optional[float]:
    return None if n is None else round(n / (1 << 20), 2)


# ---------------------------------------------------------------------------------------------- why a rule is quiet
# (``Rule.quiet``'s reasons: the figure the rule measured against the threshold it fires at)
def _bytes_or_ms(n: float, ms: bool) -> str:
    return f"{n:.1f} ms" if ms else fmt_bytes(n)


def below_share(what: str, part: float, whole: float, of: str, threshold: float, ms: bool = False,
                fires: str = "from") -> str:
    """"activations 8.03 MiB: 50% of the peak 16.13 MiB (fires from 60%)"; ``ms``: times, not bytes; ``fires``:
    "below" for a rule that fires under its threshold (``above_share``)."""
    share = fmt_share(part / whole, under=threshold if fires == "from" else None)
    return (f"{what} {_bytes_or_ms(part, ms)}: {share} of {of} {_bytes_or_ms(whole, ms)} "
            f"(fires {fires} {fmt_share(threshold)})")


def above_share(what: str, part: float, whole: float, of: str, threshold: float, ms: bool = False) -> str:
    """"peak 16.13 MiB: 60% of capacity 24.00 MiB (fires below 50%)"."""
    return below_share(what, part, whole, of, threshold, ms, fires="below")


def period(steps: list[int], checked: list[int], least: int = 2) -> Optional[int]:
    """The steps' period: the largest n (over 1) they are all a multiple of n apart by, where every checked step at
    that spacing is among them (a step between two of them left out of the statistics, a profiled one, does not
    break the period); None where there are fewer than ``least`` steps, or no such n."""
    if len(steps) < max(2, least):
        return None
    n = math.gcd(*(b - a for a, b in zip(steps, steps[1:])))
    return n if n > 1 and all(st in steps for st in checked if st % n == steps[0] % n) else None


def one_stretch(steps: list[int], checked: list[int]) -> bool:
    """Whether ``steps`` are T.STRETCH_MIN_STEPS or more consecutive ones of ``checked`` and no others, before its last:
    one stretch that slowed and recovered, not work done every few steps (a trial's loader slowed in steps 15-24 of
    40, read as "work done every few steps does this: a checkpoint save ...")."""
    if len(steps) < T.STRETCH_MIN_STEPS or steps[0] not in checked or steps[-1] == checked[-1]:
        return False
    at = checked.index(steps[0])
    return checked[at:at + len(steps)] == list(steps)


def no_capacity(ctx: Context) -> str:
    """Why a rule that weighs memory against the budget cannot: the budget is unknown (a CPU run, or plain traces
    without the device's memory), and how this run's user gives it: on torchtitan's command line, to the Hugging
    Face Trainer's callback, or to watch() (a new-user trial under torchtitan was told to pass it to watch())."""
    if ctx.config is None:
        return "memory capacity unknown: the traces do not say the device's memory; record the run with watch(..., " \
               "capacity_bytes=...)"
    return f"memory capacity unknown: {pass_option(ctx, 'capacity_bytes', 'SIZE (80GiB)')}"


def pass_option(ctx: Context, name: str, example: str) -> str:
    """How this run's user gives the doctor an option: on torchtitan's command line, to the Hugging Face Trainer's
    callback, or to watch() (under the Trainer, a new-user trial was told to pass tokens_per_step= to watch())."""
    if titan_trainer_driven(ctx):
        return f"pass --doctor.{name.replace('_', '-')} {example} on the command line"
    if trainer_driven(ctx):
        return f"pass {name}= to fsdp_doctor.DoctorCallback(...)"
    return f"pass {name}= to watch()"


def no_peak_or_capacity(ctx: Context, peak, cap) -> str:
    return "no memory peak recorded" if not peak else no_capacity(ctx)


# ---------------------------------------------------------------------------------------------- trace rows
TraceRow = CommUnitRow  # a trace row carries its figures per step (fsdp_doctor.trace.analysis.unit_rows)


def steps_in_windows(ctx: Context, rank) -> int:
    """The complete steps the rank's profiler windows covered (at least 1): what its per-step figures divide by."""
    pr = overlap(ctx).per_rank.get(str(rank))
    return max(1, pr.step_count or len(pr.steps)) if pr is not None else 1


def trace_rows(ctx: Context, collective: Optional[str] = None) -> list[TraceRow]:
    """The trace's per-unit collective rows (of one collective, or all), with their figures per step (filled by
    the trace engine's definition where a section was written without them)."""
    from ..trace.analysis import per_step_row

    return [r if r.steps is not None else per_step_row(msgspec.structs.replace(r), steps_in_windows(ctx, r.rank))
            for r in overlap(ctx).per_unit if collective is None or r.collective == collective]


def other_comm_between_ms(ctx: Context, rank) -> float:
    """Of other_comm_loop_ms, the ms per step between optimizer.step() and the next forward (a token count's
    all-reduce before the forward; not a grad-norm log between backward and the optimizer), where the trace split
    it; all of it where the trace section has no split (an older report)."""
    pr = overlap(ctx).per_rank.get(str(rank))
    split = pr.between_comm_ms_per_step if pr is not None else None
    return other_comm_loop_ms(ctx, rank) if split is None else split


def other_comm_loop_ms(ctx: Context, rank, removable: bool = False) -> float:
    """Ms per step that the loop's code issuing collectives no FSDP unit issued takes on ``rank``, outside
    optimizer.step(): the trace's host time from the first such call's issue to the last one's end
    (``OverlapRank.loop_comm_ms_per_step``: the code between them included, a grad-norm log's norms and reads),
    at least their exposed time: time outside the model that is the user's code, not data loading.
    ``removable``: what removing those calls gains (optim.step_comm's figure): less the first calls' wait for the
    other ranks, which the step keeps at its next collective; where the trace section has no span (an older
    report), their exposed time."""
    exposed = sum(r.exposed_ms_per_step for r in trace_rows(ctx)
                  if r.unit == OTHER_UNIT and r.phase not in ("optimizer", MODEL_PHASE) and str(r.rank) == str(rank))
    pr = overlap(ctx).per_rank.get(str(rank))
    span = pr.loop_comm_ms_per_step if pr is not None else None
    if span is None:
        return exposed
    return max(0.0, span - (pr.loop_comm_wait_ms_per_step or 0.0)) if removable else max(span, exposed)


def trace_label(ctx: Context, name: str) -> str:
    """The trace rows' name (FSDP2's label) of the run's unit ``name`` (units.fsdp_label): a LightningModule's
    "model.blocks.0" is the trace's "blocks.0". A Lightning Trainer's trace read no reduce-scatter of any unit as
    the records' and accum.sync_every_micro_batch predicted its fix's peak unchanged (measured +6.5%)."""
    return fsdp_label(name, [u.name for u in units(ctx) if u.is_root])


def trace_exposed_by_unit(ctx: Context, collective: str = "all_gather",
                          ranks: Optional[Iterable[str]] = None) -> dict[tuple[str, str], float]:
    """Exposed ms per step per (unit, phase), the median over ranks (over ``ranks`` where given)."""
    keep = None if ranks is None else {str(r) for r in ranks}
    acc: dict[tuple[str, str], list[float]] = {}
    for r in trace_rows(ctx, collective):
        if keep is None or str(r.rank) in keep:
            acc.setdefault((r.unit, r.phase or ""), []).append(r.exposed_ms_per_step)
    return {k: statistics.median(v) for k, v in acc.items()}


# ---------------------------------------------------------------------------------------------- trace figures
GLOO_QUIET = ("needs a GPU trace: on gloo the collectives share the cores with compute (prefetch.* and wrap.* "
              "cover CPU runs)")


def trace_verdicts(ctx: Context) -> dict:
    """Per rank, the verdict entries decided from a trace."""
    v = ctx.report.verdict
    return {r: x for r, x in v.per_rank.items() if x.source == "trace"} if v is not None else {}


def host_bound(ctx: Context, ranks=None) -> Optional[tuple[str, float]]:
    """(rank, share of its step) of the GPU trace's rank whose device waits longest for its host to launch work (the
    trace verdict's "host" group), among ``ranks`` when given; None without a GPU trace or a verdict for them."""
    per_rank = overlap(ctx).per_rank
    shares = {r: x.groups_pct.get("host", 0.0) / 100 for r, x in trace_verdicts(ctx).items()
              if (ranks is None or r in ranks) and getattr(per_rank.get(r), "device", None) == "gpu"}
    if not shares:
        return None
    rank = max(shares, key=shares.get)
    return rank, shares[rank]


class Straggler(NamedTuple):
    """A rank of a traced job whose own work (its step less its exposed communication) is longer, and whom the
    other ranks wait for inside their collectives (``trace_straggler``)."""
    rank: str
    excess_ms: float  # its own work per step beyond the other ranks' median
    own_ms: dict  # rank -> own work per step (ms)
    waits_ms: dict  # rank -> exposed communication per step (ms)
    others_own_ms: float  # the other ranks' median own work
    others_wait_ms: Optional[float]  # the other ranks' median exposed communication (None: not from a trace)
    rule: str = "straggler.trace"  # the rule that reports it (straggler.rank where the job has step records)


def trace_straggler(ctx: Context) -> tuple[Optional[Straggler], str]:
    """The straggler of the traced job, or None and why not: the slowest rank's own work exceeds the others'
    median by ``T.TRACE_STRAGGLER_MIN_MS`` and ``T.TRACE_STRAGGLER_MIN_FRACTION``, the others wait for it in their
    collectives (half its excess at least, beyond what it waits itself), over two or more complete profiled steps,
    the same rank step after step (``_unsteady``), in a job without step records (their straggler.rank decides
    there). What the other ranks wait for it is its lateness, not their collectives' cost: straggler.trace reports
    it, and the rules that read the trace's exposed collectives read the straggler's own (it waits for no one's
    lateness)."""
    from ..report_sections import Breakdown

    if ctx.run is not None and getattr(ctx.run, "has_records", False):
        return None, "the job has step records: straggler.rank decides from them"
    tr = trace_verdicts(ctx)
    if len(tr) < 2:
        return None, "needs the trace files of two or more ranks of one job"
    own = {r: x.step_ms * (1 - sum(x.shares_pct[k] for k in Breakdown.COMM_PARTS) / 100) for r, x in tr.items()}
    waits = {r: x.step_ms - own[r] for r, x in tr.items()}
    worst = max(own, key=own.get)
    base = statistics.median(own[r] for r in own if r != worst)
    excess = own[worst] - base
    if excess < T.TRACE_STRAGGLER_MIN_MS or excess < T.TRACE_STRAGGLER_MIN_FRACTION * base:
        return None, (f"the slowest rank's ({worst}) own work exceeds the others' median by {excess:.2f} ms "
                      f"(fires from {T.TRACE_STRAGGLER_MIN_MS:g} ms and {100 * T.TRACE_STRAGGLER_MIN_FRACTION:.0f}%)")
    # the others must be the ones waiting, about as long as it is late: their exposed communication exceeds the
    # straggler's by half its excess at least (a new-user trial: +88 ms "late", the others waiting 3.5 ms more)
    others_wait = statistics.median(waits[r] for r in own if r != worst)
    if others_wait - waits[worst] < 0.5 * excess:
        return None, (f"rank {worst} is the slowest (+{excess:.2f} ms of its own work), but the others wait "
                      f"{others_wait - waits[worst]:.2f} ms more than it in collectives, not that long")
    ov = overlap(ctx)
    n = min((ov.per_rank[r].step_count for r in tr if r in ov.per_rank), default=0)
    if n < 2:  # one step is not a pattern (the identical rerun was quiet)
        return None, (f"rank {worst} is the slowest (+{excess:.2f} ms), in {n} complete profiled step: "
                      "one step is not a pattern")
    why = _unsteady(worst, excess, _step_own_ms(ov, tr))
    if why:
        return None, why
    return Straggler(worst, excess, own, waits, base, others_wait), ""


def _step_own_ms(ov: OverlapSection, ranks) -> dict[str, dict[str, float]]:
    """Per rank, per complete step that every rank in ``ranks`` profiled: its own work (the step less its exposed
    communication), ms."""
    per = {r: ov.per_rank[r] for r in ranks if r in ov.per_rank}
    common = set.intersection(*(set(pr.step_times_ms) & set(pr.step_exposed_ms) for pr in per.values()))
    return {r: {st: pr.step_times_ms[st] - pr.step_exposed_ms[st] for st in sorted(common, key=int)}
            for r, pr in per.items()}


def _unsteady(worst: str, excess: float, own: dict[str, dict[str, float]]) -> str:
    """Why the slowest rank on the mean (``worst``, ``excess`` ms of own work a step over the others' median) is no
    straggler step by step (``own``: ``_step_own_ms``), or "". What the records require of one
    (analyze.steps.find_stragglers): slower by the margin in STRAGGLER_MIN_CONSISTENCY of the steps; and its excess
    (median over the steps) beyond the step-to-step spread of the other ranks' own work (standard deviation, median
    over them): the noise the host puts on a rank that is not late. On a 2-core host at load ~8 two like ranks' own
    work differed by tens of ms from step to step, the slower one changing: a new-user trial's 4 profiled steps
    named a straggler in 7 of 20 runs with none planted (+3.45 to +22.75 ms on the mean, the rank flipping from run
    to run; in that of +22.75 ms, rank 1 slower in 3 of 4 steps by +18.73 ms (median), rank 0's own work spread
    24.40 ms), where the planted 50 ms sleep was slower in each of its 4 steps, by +41.99 ms (median), the other's
    spread 10.19 ms.
    (The spread is the others', not that of the excess: a straggler's own hiccups widen the latter.)"""
    steps = list(own[worst]) if worst in own else []
    if len(steps) < 2:
        return (f"rank {worst} is the slowest (+{excess:.2f} ms of its own work per step), but the ranks' traces "
                f"share {len(steps)} complete step with per-step figures: one step is not a pattern")
    others = [r for r in own if r != worst]
    diffs, slower = [], 0
    for st in steps:
        theirs = statistics.median(own[r][st] for r in others)
        diffs.append(own[worst][st] - theirs)
        slower += diffs[-1] > max(T.TRACE_STRAGGLER_MIN_FRACTION * theirs, T.TRACE_STRAGGLER_MIN_MS)
    if slower < STRAGGLER_MIN_CONSISTENCY * len(steps):
        return (f"rank {worst} is the slowest on the mean (+{excess:.2f} ms of its own work per step), but by "
                f"{100 * T.TRACE_STRAGGLER_MIN_FRACTION:.0f}% in {slower} of {len(steps)} steps only (a straggler "
                f"is slower in {100 * STRAGGLER_MIN_CONSISTENCY:.0f}% of them): not the same rank step after step "
                "(host noise, or a rank late now and then)")
    typical = statistics.median(diffs)
    spread = statistics.median(statistics.stdev(own[r].values()) for r in others)
    if typical <= spread:
        return (f"rank {worst} is slower in {slower} of {len(steps)} steps, by {typical:.2f} ms per step (median), "
                f"within the step-to-step spread of the other ranks' own work ({spread:.2f} ms, standard "
                "deviation): host noise on like ranks, not one rank the others wait for")
    return ""


def read_on_straggler(late: Straggler) -> str:
    """What a rule that read the straggler's own collectives says of it."""
    return read_on_late(late.rank, late.excess_ms, late.rule)


@_once
def late_rank(ctx: Context) -> Optional[Straggler]:
    """The straggler the other ranks wait for in their collectives, or None: with step records straggler.rank's
    (the one they wait for longest: analyze.steps.late_straggler), else the trace's (``trace_straggler``). What the
    others wait for it is its lateness, which no prefetch or fewer bytes would shorten: the rules that read
    all-gather waits or exposure read its own (``units``, ``median_step_ag_waits``, ``read_ranks``), as the verdict
    does (a new-user trial's rank 2 of 4, sleeping 150 ms before each forward, read "All-gathers stall compute for
    211.7 ms per step (81%)", 155.2 ms of it the others' root all-gather waiting for rank 2)."""
    s = late_straggler(steps(ctx).stragglers)
    if s is not None and s.rank in (getattr(ctx.run, "ranks", None) or {}):  # (its steps: what the rules read)
        return Straggler(str(s.rank), s.excess_ms_per_step, {str(s.rank): s.own_ms_p50}, {}, s.others_own_ms_p50,
                         None, "straggler.rank")
    return trace_straggler(ctx)[0]


def read_ranks(ctx: Context) -> Optional[list[str]]:
    """The ranks whose collectives the rules read: the straggler's alone where there is one (``late_rank``), else
    None (every rank)."""
    late = late_rank(ctx)
    return None if late is None else [late.rank]


def trace_step_ms(ctx: Context) -> Optional[float]:
    """Median over ranks of the trace's step time (complete steps' wall time / steps), else the records'."""
    ms = [x.step_ms for x in trace_verdicts(ctx).values() if x.step_ms]
    return float(statistics.median(ms)) if ms else step_ms(ctx)


def per_step(ctx: Context, rank, us: float) -> float:
    """µs over a rank's windows -> ms per step."""
    return us / steps_in_windows(ctx, str(rank)) / 1e3


def breakdown_ms(ctx: Context, part: str) -> dict[str, float]:
    """Per rank, one part of the step's breakdown in ms per step."""
    return {r: per_step(ctx, r, b.parts()[part]) for r, b in overlap(ctx).breakdown.items()}


def device_forward_ms(ctx: Context) -> dict[str, float]:
    """Per unit, the device time of its own forward compute per step (a GPU trace's kernels launched inside FSDP2's
    labels, nested units' excluded); {} where the trace timed none on the device."""
    from ..trace.steps_detail import UNIT_SOURCE_DEVICE

    return {u.name: u.timing_p50.fwd_self_ms if u.timing_p50.fwd_self_ms is not None else u.timing_p50.fwd_ms
            for u in overlap(ctx).units or [] if u.source == UNIT_SOURCE_DEVICE}


def free_compute_ms(ctx: Context) -> Optional[float]:
    """Device compute per step that no collective overlaps yet (the breakdown's compute less the communication it
    already hides; median over GPU ranks): what any more overlap can hide behind, at most. None without a GPU
    breakdown."""
    ov = overlap(ctx)
    vals = [max(0.0, per_step(ctx, r, b.compute) - (ov.per_rank[r].hidden_ms_per_step or 0.0))
            for r, b in ov.breakdown.items() if r in ov.per_rank and ov.per_rank[r].device == "gpu"]
    return statistics.median(vals) if vals else None


# ---------------------------------------------------------------------------------------------- estimates
def predicted(step_before=None, step_after=None, peak_before=None, peak_after=None, at_most: bool = False,
              peak_at_most: bool = False, step_mean: bool = False) -> Predicted:
    """A finding's prediction: step time (ms) and peak (bytes) before and after its fix; None where unknown.
    ``at_most``: the after-figures are ceilings (the fix gains at least that much); ``peak_at_most``: the peak
    after alone is; ``step_mean``: the step figures are the mean step's, not the median's."""
    def r(x, nd):
        return None if x is None else round(float(x), nd)

    if step_after is not None and step_after <= 0:  # figures of different steps (a trace window's against the
        step_after = None  # records' median): no step can take no time, and none is predicted
    return Predicted(step_ms_before=r(step_before, 3), step_ms_after=r(step_after, 3),
                     peak_bytes_before=None if peak_before is None else int(peak_before),
                     peak_bytes_after=None if peak_after is None else int(max(0, peak_after)), at_most=at_most,
                     peak_at_most=peak_at_most, step_mean=step_mean)


def ag_wait_ms(u: Unit, phase: str) -> float:
    """A unit's all-gather wait in ``phase`` (ms); 0 where not known apart (a unit compiled in place: its forward's
    wait is inside its forward), and 0 in backward for a unit FSDP2 never gathers there (``gathered_in_backward``):
    the recorder's span from its pre-backward to its first gradient is then its hooks' own (0.04 ms on a new-user
    trial's embedding, which reshard.zero2_affordable flipped for it)."""
    if phase == "forward":
        return u.timing.ag_wait_fwd_ms or 0.0
    return u.timing.ag_wait_bwd_ms if gathered_in_backward(u) else 0.0


@_once
def own_waits(ctx: Context) -> dict[str, tuple[float, float]]:
    """Per unit, its forward and backward all-gather waits (ms) as what the collective itself costs: in each step the
    least any read rank (``read_ranks``) waited, median over the steps. On gloo the host blocks in an all-gather until
    every rank is in it: the last rank to arrive waits for the collective alone, the others for it as well, and that
    lateness does not go with the collective (without it they wait at their next one). The report's medians pool
    every rank's waits: the scenario matrix's 3 tiny routers (mixtral_router_units) read 6.3 ms of all-gathers per
    step there, 5.3 ms on the rank that arrived last; merged, the step gained 12% (11.8% predicted, 13.6% from the
    pooled waits; a CI host's run had predicted 15% from them and gained 3.5%). {} without step records. A
    straggler's own steps are one rank's: its waits."""
    from ..analyze.steps import counted_op_by_op, usable_steps

    read = read_ranks(ctx)
    by_step: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for r, rd in (getattr(ctx.run, "ranks", None) or {}).items():
        if read is not None and str(r) not in read:
            continue
        usable = usable_steps(rd.steps)
        for s in [s for s in usable if not counted_op_by_op(s)] or usable:
            for u in s.units:
                if u.fwd_calls or u.fwd_ms or u.bwd_ms:  # (a unit that did not run in a step waited nothing)
                    by_step.setdefault((s.step, u.name), []).append((u.ag_wait_fwd_ms, u.ag_wait_bwd_ms))
    per_unit: dict[str, tuple[list[float], list[float]]] = {}
    for (_, name), waits in by_step.items():
        fwd, bwd = per_unit.setdefault(name, ([], []))
        fwd.append(min(w[0] for w in waits))
        bwd.append(min(w[1] for w in waits))
    return {n: (float(statistics.median(f)), float(statistics.median(b))) for n, (f, b) in per_unit.items()}


def own_wait_ms(ctx: Context, u: Unit, phase: str) -> float:
    """``ag_wait_ms`` as the collective's own cost (``own_waits``), the report's figure where no step records
    say."""
    own = own_waits(ctx).get(u.name)
    if own is None or (phase == "forward" and u.timing.ag_wait_fwd_ms is None):
        return ag_wait_ms(u, phase)
    if phase == "forward":
        return own[0]
    return own[1] if gathered_in_backward(u) else 0.0


def gathered_in_backward(u: Unit) -> bool:
    """Whether FSDP2 all-gathers the unit for its backward: not after ``set_unshard_in_backward(False)`` (its
    parameters needed in forward only, an embedding's), where keeping it gathered after forward only holds memory.
    Unknown reads as FSDP's default (gathered)."""
    return u.unshard_in_backward is not False


def compute_fwd_ms(u: Unit) -> float:
    """A unit's forward time minus its own all-gather wait (still inclusive of nested units; the wait included
    where it is not known apart)."""
    return max(0.0, u.timing.fwd_ms - ag_wait_ms(u, "forward"))


# ---------------------------------------------------------------------------------------------- code names
# the module tree as code lives in diagnose/snippets.py (the one writer of snippets); re-exported for evidence
from .snippets import block_containers, block_of, module_expr, strip_ckpt, unit_expr  # noqa: E402,F401


def kept_gathered(u: Unit) -> bool:
    """Whether the unit keeps its parameters gathered from forward to backward (reshard_after_forward False; an int
    reshards to that many ranks, still resharded). Unknown reads as FSDP's default (Unit: resharded)."""
    return u.reshard_after_forward in (False, 0)


def last_forward_unit(ctx: Context):
    """The unit that computes last in forward and first in backward, whose backward all-gather, resharded after
    forward, has nothing to overlap (reshard.last_unit's; memory.near_capacity_spread never reshards it): a root with
    parameters resharded after forward (FSDP's default keeps a root gathered; torch honours the explicit setting, and
    the records say which); a grouped unit whose modules run first and last in forward (a tied [embedding, head]
    unit); else the last unit that ran, where the root holds no parameters to compute after it. None where a root
    with parameters (kept gathered) may compute between that unit's forward and its backward."""
    allu = param_units(ctx)
    # (not a unit no step ran: a trial's never-routed last expert read as "the last unit ... in forward")
    us = [u for u in non_root(allu) if u.name not in S.never_ran(ctx)]
    rts = roots(allu)
    if len(rts) == 1 and not kept_gathered(rts[0]):
        return rts[0]
    # a grouped unit whose modules run first and last in forward (a tied [embedding, head] unit): the peak step's
    # marks end its forward twice, the last after every other unit's, and start its backward first (the root's
    # aside): it is gathered again at once, whatever the root holds, since its last module computes after the root's
    # own (it stayed quiet on "the root holds parameters", beside the run's largest backward wait, 10.1 ms: a
    # new-user trial). A last block ends its forward once, before the root's final norm and head: as below
    pm = peak_memory(ctx)
    ends, starts = timeline_units(pm, "forward_end"), timeline_units(pm, "backward_start")
    if ends and starts and ends[-1] == starts[0] and ends.count(ends[-1]) > 1:
        last = next((u for u in us if u.name == ends[-1]), None)
        if last is not None and len(last.modules) > 1:
            return last
    if not us or rts:
        return None  # a root with parameters computes between the last unit's forward and its backward
    return last_in_forward(ctx, us)


def last_in_forward(ctx: Context, us: list[Unit]) -> Unit:
    """Of ``us`` (not empty), the unit whose forward ended last in the peak step, from its timeline's forward_end
    marks (a unit nested in another ends before it), where every one of them has its mark; else the last in module
    order, which is forward order for sequential models but not for a UNet: diffusers registers ``mid_block`` after
    ``up_blocks`` (a new-user trial's UNet read "the last unit (mid_block.resnets.1) in forward")."""
    pm = peak_memory(ctx)
    names = {u.name: u for u in us}
    ends = [r.get("unit") for r in (pm.timeline or [] if pm is not None else [])
            if r.get("phase") == "forward_end" and r.get("unit") in names]
    return names[ends[-1]] if ends and set(ends) == set(names) else us[-1]


def resharded_last_unit(ctx: Context):
    """The last unit of forward (``last_forward_unit``) when it is resharded after forward only to be gathered
    again at once for backward, else None."""
    last = last_forward_unit(ctx)
    return None if last is None or kept_gathered(last) else last


# ---------------------------------------------------------------------------------------------- ZeRO-2 per unit
def held_windows(timeline: list[dict], name: str) -> list[tuple[int, int]]:
    """Rows [start, end) of the peak step's memory timeline (rows keyed "unit", "phase", "total", ...) during
    which unit ``name`` would hold its unsharded parameters if it were not resharded after forward, and does
    not now: from after its (last) forward_end to the point its backward all-gather is issued, once per
    backward of the step (gradient accumulation runs several forward/backward pairs in one step). FSDP2
    issues that all-gather one unit early (implicit backward prefetch, at the pre-backward of the unit that
    runs backward just before it), so a window ends with that unit's backward_start row; a unit with no
    predecessor in backward ends at its own. Empty when the timeline does not show the unit's forward and
    backward."""
    out, lo = [], 0
    for bs, r in enumerate(timeline):
        if r.get("unit") != name or r.get("phase") != "backward_start":
            continue
        fe = max((i for i in range(lo, bs) if timeline[i].get("unit") == name
                  and timeline[i].get("phase") == "forward_end"), default=None)
        if fe is not None:
            prev = max((i for i in range(fe + 1, bs) if timeline[i].get("phase") == "backward_start"
                        and timeline[i].get("unit") not in (None, "", name)), default=None)
            out.append((fe + 1, (prev if prev is not None else bs) + 1))
        lo = bs + 1
    return out


@_once
def micro_batches(ctx: Context) -> dict[str, float]:
    """Per unit, forward passes per optimizer step (median over steady steps and ranks): the larger of the
    recorder's micro-batch count (``doctor.step()`` calls between two optimizer steps, 1 when it is called once
    per optimizer step) and the unit's forward calls per module (what the model ran, however the loop calls
    ``doctor.step()``)."""
    per: dict[str, list[float]] = {}
    mods = unit_modules(units(ctx))
    for rd in (getattr(ctx.run, "ranks", None) or {}).values():
        for s in rd.steps[1:]:
            mb = getattr(s, "micro_batches", None)
            for us in s.units:
                calls = unit_passes(us, mods)
                n = max(mb or 0, calls or 0) or None
                if n:
                    per.setdefault(us.name, []).append(float(n))
    return {k: statistics.median(v) for k, v in per.items()}


def trace_steps_per_optimizer_step(ctx: Context) -> Optional[float]:
    """Complete profiler steps per optimizer.step() in the traces (median over ranks): 1 where the loop calls
    ``prof.step()`` once per optimizer step, more where it calls it per micro-batch of gradient accumulation (its
    ProfilerSteps without an optimizer.step(): ``OverlapRank.steps_without_optimizer``). None: no trace, or no
    complete step holding an optimizer.step()."""
    from ..trace.analysis import steps_per_optimizer_step

    per = [n for pr in overlap(ctx).per_rank.values() if (n := steps_per_optimizer_step(pr)) is not None]
    return float(statistics.median(per)) if per else None


@_once
def backward_passes(ctx: Context) -> Optional[float]:
    """Backward passes through the model per optimizer step (median over steady steps and ranks): gradient
    accumulation's micro-batches, where :func:`micro_batches` counts forward passes (a GAN's generator run twice
    into one loss: 2 forward passes, 1 backward). None: not recorded (records before ``StepRecord.backwards``, plain
    traces)."""
    n = [s.backwards for rd in (getattr(ctx.run, "ranks", None) or {}).values() for s in rd.steps[1:]
         if getattr(s, "backwards", None) and not getattr(s, "optimizer_skipped", False)]
    return float(statistics.median(n)) if n else None


def regather_windows(timeline: list[dict], name: str) -> list[tuple[int, int]]:
    """Rows [start, end) of the peak step's memory timeline during which unit ``name`` would hold its unsharded
    parameters if it were kept gathered after its backward until its next forward in the same step (gradient
    accumulation with ``set_reshard_after_backward(False)`` on all but the last micro-batch), and does not now:
    from after its backward_end to its next forward_start (whose mark already holds them: FSDP2's pre-forward
    all-gather runs before it), once per micro-batch but the last. Empty without a later forward."""
    out = []
    for be, r in enumerate(timeline):
        if r.get("unit") != name or r.get("phase") != "backward_end":
            continue
        fs = next((i for i in range(be + 1, len(timeline)) if timeline[i].get("unit") == name
                   and timeline[i].get("phase") == "forward_start"), None)
        if fs is not None:
            out.append((be + 1, fs))
    return out


def gather_transient(timeline: list[dict], fs: int, unsharded: int) -> int:
    """The all-gather buffers of the unit whose forward_start is row ``fs`` of the peak step's timeline, in the
    high-water row before that mark (an "in_..." row: FSDP2's pre-forward all-gather runs before the mark): what the
    temporaries there exceed those at the mark by, up to twice the unit's ``unsharded`` bytes (the gathered output
    and its copy; gloo, a Llama layer of 9,441,280 B: 18,620,416 B). A unit kept gathered into that forward has no
    such buffers. 0 without such a row."""
    if fs < 1 or not str(timeline[fs - 1].get("phase") or "").startswith("in_"):
        return 0
    extra = int(timeline[fs - 1].get("temporaries") or 0) - int(timeline[fs].get("temporaries") or 0)
    return max(0, min(extra, 2 * unsharded))


def kept_between_micro_batches(timeline: list[dict]) -> Optional[int]:
    """The unsharded parameters held where a micro-batch after the first starts its forward (the first forward_start
    mark after each backward_end; the most of them): kept gathered since the previous micro-batch's backward. That
    mark is the watched model's own, or its outermost unit's where the model's forward never runs (a LightningModule
    whose training_step calls self.model: read from the model's marks alone, the fix pasted there, which halved the
    forward all-gathers, still read as not kept, and the rule fired on). None without a second micro-batch in the
    timeline."""
    starts, after_backward = [], False
    for r in timeline:
        if r.get("phase") == "backward_end":
            after_backward = True
        elif r.get("phase") == "forward_start" and after_backward:
            starts.append(r)
            after_backward = False
    return max((int(r.get("unsharded_params") or 0) for r in starts), default=None)


def unused_gather_windows(timeline: list[dict], by: str, target: str) -> list[tuple[int, int]]:
    """Rows [start, end) of the peak step's memory timeline during which unit ``target``'s parameters, all-gathered
    by unit ``by``'s backward prefetch but never used (``target`` runs no backward), are held: from after ``by``'s
    backward_start (the prefetch is issued inside its pre-backward, after the mark) through ``target``'s
    backward_end, which the root's final callback logs just before it waits for that all-gather and frees it (else
    to the end of that backward); once per backward of the step."""
    out = []
    for s, r in enumerate(timeline):
        if r.get("unit") != by or r.get("phase") != "backward_start":
            continue
        end = len(timeline)
        for i in range(s + 1, len(timeline)):
            if timeline[i].get("phase") == "backward_end" and timeline[i].get("unit") in (target, None):
                end = i + 1 if timeline[i].get("unit") == target else i  # the step's own backward_end: freed before
                break
        out.append((s + 1, end))
    return out


def gathering_after_forward_bytes(u: Unit) -> int:
    """What keeping ``u`` gathered from its forward to its backward (reshard_after_forward=False) adds: its
    unsharded bytes, less the copy it keeps now when it reshards to a smaller world (an int N: each rank keeps
    1/N of the unsharded parameters, ``unsharded_bytes // N``)."""
    raf = u.reshard_after_forward
    kept = u.unsharded_bytes // raf if reshards_to_group(u) and raf > 1 else 0
    return int(u.unsharded_bytes) - int(kept)


def reshards_to_group(u: Unit) -> bool:
    """The unit's reshard_after_forward is an int (after forward it reshards to a group of that many ranks), not a
    bool."""
    raf = u.reshard_after_forward
    return isinstance(raf, int) and not isinstance(raf, bool)


def timeline_peak(pm: MemoryRank, changes: list[tuple[list[tuple[int, int]], int]], flat: int = 0) -> int:
    """The peak (bytes) of the peak step ``pm`` with each change's bytes added (removed where negative) at the
    rows of its timeline inside the change's windows ([start, end) row ranges), and ``flat`` bytes everywhere:
    the highest mark, moved by as much as the recorded peak sits above the timeline's highest row."""
    if not pm.timeline:
        return int(pm.peak_bytes) + flat
    added = [0] * len(pm.timeline)
    for windows, nbytes in changes:
        for w in windows:
            for i in range(*w):
                added[i] += nbytes
    return peak_with_rows(pm, added) + flat


def phase_rows(timeline: list[dict], name: str, phase: str) -> list[int]:
    """The rows of a memory timeline (rows keyed "unit", "phase", ...) where unit ``name`` marks ``phase``."""
    return [i for i, r in enumerate(timeline) if r.get("unit") == name and r.get("phase") == phase]


def peak_with_rows(pm: MemoryRank, added: list[float]) -> int:
    """The peak (bytes) of the peak step ``pm`` (a timeline required) with ``added[i]`` bytes at row i of its
    timeline: the highest mark, moved by as much as the recorded peak sits above the timeline's highest row."""
    totals = [int(r.get("total") or 0) for r in pm.timeline]
    return int(pm.peak_bytes) + int(max(t + a for t, a in zip(totals, added))) - max(totals)


def zero2_peak(ctx: Context, us: list[Unit]) -> Optional[int]:
    """The peak (bytes, peak rank) with reshard_after_forward=False on the units ``us``.

    Each such unit keeps its unsharded parameters (``unsharded_bytes``: FSDP2 keeps the sharded ones too; less
    the smaller world's copy of an int reshard_after_forward, ``gathering_after_forward_bytes``) from its forward
    to its backward all-gather; they are added at every mark of the peak step's timeline
    that falls in one of its windows (``held_windows``), and the new peak is the highest mark. Without a timeline,
    or for a unit the timeline does not show, its bytes are added at the peak (the start of backward holds
    every such unit)."""
    pm = peak_memory(ctx)
    if not pm:
        return None
    changes, flat = [], 0
    for u in us:
        ws = held_windows(pm.timeline, u.name) if pm.timeline else []
        if ws:
            changes.append((ws, gathering_after_forward_bytes(u)))
        else:
            flat += gathering_after_forward_bytes(u)
    return timeline_peak(pm, changes, flat)


def allgather_ms(ctx: Context, u: Unit, phase: str) -> tuple[Optional[float], str]:
    """(ms per step that compute waits for this unit's all-gathers in ``phase``, source): on a GPU with a trace the
    trace's exposed time (the host runs ahead of the device there: the host's time in FSDP's hooks is the launches',
    off the step's critical path unless the host sets the step), else the recorder's wait (``ag_wait_ms``)."""
    if on_gpu(ctx):
        tr = trace_exposed_by_unit(ctx, "all_gather", ranks=read_ranks(ctx))
        if tr:
            return tr.get((trace_label(ctx, u.name), phase), 0.0), "trace"
    return (ag_wait_ms(u, phase), "host") if u.has_timing else (None, "")


def backward_allgather_ms(ctx: Context, u: Unit) -> tuple[Optional[float], str]:
    """``allgather_ms`` in backward."""
    return allgather_ms(ctx, u, "backward")


@_once
def _calls_per_pass(ctx: Context) -> dict[str, int]:
    """``calls_per_pass`` of every unit called more than once a pass (one pass over the records)."""
    from ..analyze.steps import called_outside_forward, unit_calls

    ranks = getattr(ctx.run, "ranks", None) or {}
    outside = called_outside_forward(ranks)
    if outside is None:
        return {}
    per: dict[str, list[float]] = {}
    for name, calls, model_calls, _ in unit_calls(ctx.config, ranks):
        if calls and name not in outside:
            per.setdefault(name, []).append(calls / model_calls)
    return {n: k for n, v in per.items() if (k := round(statistics.median(v))) > 1}


def calls_per_pass(ctx: Context, name: str) -> int:
    """The times the model's forward calls unit ``name`` in one pass (ALBERT's one shared layer group: once per
    layer), the median over every rank's usable steps; 1 where not recorded, or where code outside the model's
    forward makes the calls beyond one (a loss running the output head per chunk: analyze.steps)."""
    return _calls_per_pass(ctx).get(name, 1)


def kept_gathered_saves_ms(ctx: Context, u: Unit) -> tuple[Optional[float], str]:
    """(ms per step that keeping unit ``u`` gathered after forward saves, source; as ``allgather_ms``): its backward
    all-gather wait; for a unit the model calls k times a pass, its k - 1 later forward calls' all-gathers too, and of
    its backward ones only the first's: FSDP2 reshards it after each call's backward. (ALBERT's shared layer group, 6
    calls a pass, kept gathered: 6 -> 1 all-gathers in forward, 6 -> 5 in backward; "its backward all-gather" alone
    read 3.9 ms of the 21.1 ms its forward calls waited: a new-user trial.)"""
    bwd, src = backward_allgather_ms(ctx, u)
    k = calls_per_pass(ctx, u.name)
    if bwd is None or k < 2:
        return bwd, src
    fwd, _ = allgather_ms(ctx, u, "forward")
    return bwd / k + (fwd or 0.0) * (k - 1) / k, src


def repeated_words(ctx: Context, us: Iterable[Unit]) -> str:
    """What keeping gathered the units of ``us`` the model calls several times a pass saves
    (``kept_gathered_saves_ms``), as a sentence; "" for none."""
    said = [f"{u.name}, called {k} times a forward pass, is all-gathered once a pass instead of {k} times, and "
            f"{k - 1} times in backward instead of {k} (FSDP2 reshards it after each call's backward)"
            for u in us if (k := calls_per_pass(ctx, u.name)) >= 2]
    return f" Kept gathered, {'; '.join(said)}." if said else ""


def backward_allgather_comm_ms(ctx: Context, name: str) -> Optional[float]:
    """The GPU trace's whole backward all-gather time for a unit (ms per step, median over ranks), exposed or
    not: what keeping it gathered removes at most. None on a CPU: a gloo trace times the host's side of each call
    (an asynchronous one, its launch), under the host's measured wait (a trial: -5.58 ms saved "of 2.29")."""
    if not on_gpu(ctx):
        return None
    label = trace_label(ctx, name)
    vals = [r.comm_ms_per_step for r in trace_rows(ctx, "all_gather") if r.unit == label and r.phase == "backward"]
    return statistics.median(vals) if vals else None


# ---------------------------------------------------------------------------------------------- fewer, larger units
class GroupPlan(msgspec.Struct, frozen=True):
    """A plan of fewer, larger units (comm.small_collectives; comm.bound and throughput.low_mfu where the
    collectives are latency-bound): ``group`` consecutive blocks of every block container per unit, the units
    inside a block dropped (leaf wrapping), the run's other units as they were (snippets.shard_plan)."""

    group: int  # consecutive blocks per unit
    blocks: int  # blocks of the largest container
    block_bytes: Optional[float]  # one block's all-gather (unsharded, in the gathered dtype), median over blocks
    block_share: Optional[float]  # the largest block's share of the parameters
    units_before: int  # units with parameters in the run
    units_after: int  # ... and in the plan
    why: str  # what set the group size
    code: str


def plan_words(group: int) -> str:
    """What a grouped plan does, in words."""
    return f"{group} consecutive blocks per unit" if group > 1 else "one unit per block"


def _sized_units(ctx: Context) -> list[tuple[list[str], float, float, list[str], list[int]]]:
    """(modules, parameters, gathered bytes, own modules, their bytes) of every unit with parameters: the snapshot's,
    else (a plain trace) the trace's forward all-gathers, whose bytes stand for the parameters too."""
    us = param_units(ctx)
    if us:
        return [(list(u.modules) or S.members(u.name), float(u.param_count), float(u.unsharded_bytes),
                 list(u.own_modules or []), list(u.own_bytes or [])) for u in us]
    return [(S.members(n), b, b, [], []) for n, b in trace_gathered_bytes(ctx).items()]


def trace_gathered_bytes(ctx: Context) -> dict[str, float]:
    """A plain trace's units (FSDP2's labels, the root "(root)") -> the bytes their forward all-gather moves (the
    median over ranks: the message is the unit's whole gathered parameters); units whose size the trace does not
    record (record_shapes off) are absent."""
    got: dict[str, list[float]] = {}
    for r in trace_rows(ctx, "all_gather"):
        if r.bytes_per_call and r.phase == "forward" and r.unit != OTHER_UNIT:
            got.setdefault(r.unit, []).append(float(r.bytes_per_call))
    return {n: statistics.median(b) for n, b in got.items()}


def grouped_plan(ctx: Context) -> Optional[GroupPlan]:
    """The plan of fewer, larger units for this run's tree, None where it has no block container. The group is the
    fewest consecutive blocks whose all-gather leaves the latency regime (T.SMALL_MAX_MEDIAN_BYTES), and never more
    than T.GROUP_FACTOR, nor so many that a container keeps fewer than T.MIN_BLOCK_UNITS units (all its blocks where
    it has fewer) or that a group holds T.COARSE_SHARE_MIN of the parameters (wrap.too_coarse's threshold): one
    unit per block where any of these allows no more. (Four blocks per unit on the 4-block GPT, all its blocks in
    one unit, traded the finding for wrap.too_coarse on the H100 rerun.)"""
    t = S.tree(ctx)
    conts = t.containers()
    if not conts:
        return None
    sized = _sized_units(ctx)

    def container(blk: Optional[str]) -> Optional[str]:  # ("" for the root's children: an nn.Sequential model)
        return S.container_of(blk, conts) if blk else None

    per_block: dict[str, list[float]] = {}  # block -> [parameters, gathered bytes]

    def add(blk: str, params: float, nbytes: float) -> None:
        acc = per_block.setdefault(blk, [0.0, 0.0])
        acc[0] += params
        acc[1] += nbytes

    outside = inner = 0  # units with parameters outside every block (embeddings, head; a root holding some); inside one
    blocks_are_units = False
    for mods, params, nbytes, own, own_b in sized:
        blks = {block_of(m) for m in mods}
        # a block, several, or a unit inside one (leaf wrapping, experts)
        if all(container(b) is not None for b in blks):
            for b in blks:
                add(b, params / len(blks), nbytes / len(blks))
            whole = all(block_of(m) == S.strip_ckpt(m) for m in mods)
            blocks_are_units |= whole
            inner += not whole
            continue
        outside += 1
        stored = sum(own_b)
        held = S.block_bytes(SimpleNamespace(own_modules=own, own_bytes=own_b)) if stored else {}
        for b, n in held.items():  # the blocks a unit holds as its own modules (the whole model, the root)
            if container(b) is not None:
                add(b, params * n / stored, nbytes * n / stored)
    total = sum(params for _, params, _, _, _ in sized)
    c = max(conts, key=lambda k: len(conts[k]))
    n = len(conts[c])
    sizes = [v for b, v in per_block.items() if container(b) == c]
    block_bytes = statistics.median(v[1] for v in sizes) if sizes else None
    share = max(v[0] for v in sizes) / total if sizes and total > 0 else None
    limits: dict[str, int] = {}
    if block_bytes:
        need = max(1, math.ceil(T.SMALL_MAX_MEDIAN_BYTES / block_bytes))
        limits[(f"a block's all-gather, {fmt_bytes(block_bytes, 1)}, is out of the latency regime already" if need == 1
                else f"{need} blocks gather {fmt_bytes(need * block_bytes, 1)}, out of the latency regime")
               + f" (from {fmt_bytes(T.SMALL_MAX_MEDIAN_BYTES, 1)})"] = need
    spread = n // T.MIN_BLOCK_UNITS
    limits[(f"{n} blocks: {spread} per unit keep {T.MIN_BLOCK_UNITS} units or more" if spread > 1 else
            f"{n} blocks: grouped, fewer than {T.MIN_BLOCK_UNITS} units would be left")
           + ", each all-gather overlapping the previous unit's compute"] = max(1, spread)
    if share:
        most = max(1, math.ceil(T.COARSE_SHARE_MIN / share) - 1)
        limits[f"a block holds {fmt_share(share)} of the parameters: {most} keep a unit under "
               f"{100 * T.COARSE_SHARE_MIN:.0f}% (wrap.too_coarse)"] = most
    limits[f"at most {T.GROUP_FACTOR} blocks per unit"] = T.GROUP_FACTOR
    why = min(limits, key=limits.get)
    g = limits[why]
    # units inside the blocks stay where the blocks are units already (a mixture of experts' experts, sharded for
    # memory) and one block per unit; they give way to their blocks otherwise (leaf wrapping, or grouped blocks)
    nested = g == 1 and blocks_are_units
    after = outside + sum(math.ceil(len(idx) / g) for idx in conts.values()) + (inner if nested else 0)
    before = len(sized)
    code = S.shard_plan(t, group=g, nested=nested, note=f"{plan_words(g)} ({before} units -> {after})")
    return GroupPlan(group=g, blocks=n, block_bytes=block_bytes, block_share=share, units_before=before,
                     units_after=after, why=why, code=code)


from . import snippets as S  # noqa: E402  (snippets imports nothing of this module)


def updated_between(ctx: Context) -> str:
    """Why the rules of gradient accumulation and of the time between steps stay quiet on a run whose steps run a
    backward through the model after its optimizer.step() ("" when none does): its several backward passes are not
    micro-batches of one update (a new-user trial's GAN, the discriminator watched: accum.sync_every_micro_batch's
    fix, pasted, changed the losses and the finding stayed), and its time after optimizer.step() holds the model's own
    second pass (jitter.data_wait read 49% of the step as data loading)."""
    hit = sorted({r for r, rd in (getattr(ctx.run, "ranks", None) or {}).items()
                  if any(s.backward_after_optimizer for s in rd.steps)})
    if not hit:
        return ""
    return (f"a backward through the model runs after its optimizer.step() within a step on rank(s) "
            f"{', '.join(map(str, hit))} (a second loss through the model after its update, as a GAN's generator "
            "update through its discriminator): its backward passes are not micro-batches of one update")
