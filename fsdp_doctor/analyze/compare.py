"""Did the fix help? Two runs side by side: a plain function over two :class:`~fsdp_doctor.report_sections.Report`
and their per-step samples (a :class:`Side` each, built by ``fsdp_doctor.pipeline.compare_side``), returning a
:class:`~fsdp_doctor.compare_sections.Comparison`.

Noise: the step-time change gets a bootstrap confidence interval (the steps resampled with replacement, each
step's times on every rank kept together, ``RESAMPLES`` draws, seeded). The interval covers each run's own
step-to-step noise, not the drift between two runs (host load, clocks), which one run per side cannot measure: the
change is called significant only when the interval excludes zero, the change is at least ``NOISE_FLOOR_PCT`` of
A's step, *and* A and B differ in configuration (or ``--applied`` names a fix B applies); without a change, the
difference is said to be run-to-run variation. Does not import torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import numpy as np
from msgspec import UNSET

from ..compare_sections import (CommDelta, Comparison, ConfigChange, Cost, Delta, FindingRef, FindingsDiff,
                                OpChange, PredictionCheck, RunSide, StepDelta)
from ..records import runs_compiled
from ..report_sections import CheckpointSteps, Finding, Report
from ..trace.analysis import BLOCKED_AG_SHARE, blocked_allgathers
from .steps import counted_saves, heaviest_saves, save_interval, saves_share
from ..trace.collectives import dtype_name
from ..units import (ROOT_LABEL, RUN_END_TAIL, fmt_bytes, fmt_mesh, fmt_ms, memory_peak_where, module_path, same_group,
                     shift_at)

RESAMPLES = 2000  # bootstrap draws: the 2.5/97.5 percentiles settle to ~1% of the interval's width
CONFIDENCE = 0.95
SEED = 0  # the same two runs always give the same interval
# A step-time change below this share of A's step is not called a change even when the interval excludes
# zero: two runs of one configuration on the same machine differ by a few % (host load, clocks, placement).
NOISE_FLOOR_PCT = 5.0
# StepDelta.reason when the interval excludes zero but A and B differ in no configuration: run-to-run variation
NO_CHANGE = "no config change"
# ... when one run's step times come from its records and the other's from a profiler trace (profiled steps)
OTHER_SOURCES = "records vs trace"
# ... when a phase the change does not touch moved as much: the host ran at another speed in the two runs
HOST_CHANGED = "host changed"
# fewer steps than this on a side: resampled, one step gives a zero-width interval ("+84.4% (95% CI +84.4% to
# +84.4%) ... significant: yes" from one profiled step a side, in a new-user trial): not significant, said so
MIN_STEPS = 3
FEW_STEPS = "too few steps"
# the control phase: the optimizer step, untouched by a change of wrapping, resharding, prefetching, checkpointing,
# dtypes or batch; it tells the host's speed apart where it moved by this share (and at least HOST_MIN_MS)
HOST_SHIFT_PCT = 25.0
HOST_MIN_MS = 1.0
# what changes the optimizer step itself: then it is no control (job keys, and --applied codes by prefix); a
# parameter frozen has no gradient, which the optimizer's step skips; a mesh sharding over fewer ranks gives each rank
# more of the parameters to update (4-way 1-D to 2 x 2 HSDP doubles them: "the optimizer step, which this change does
# not touch, moved -53%", a new-user trial)
OPTIMIZER_KEYS = ("optimizer", "offload", "world_size", "mesh", "backend", "device_name", "torch_version",
                  "trainable", "optimizer_impl")
OPTIMIZER_FIXES = ("optim.", "offload.", "memory.grads_kept")
# A step-time prediction holds when the predicted change lies inside the measured change's interval, or lands
# within this share of the measured step (a step prediction is an estimate from host-side timings).
STEP_TOLERANCE_PCT = 10.0
# A peak-memory prediction holds within this share of the measured peak (memory is deterministic per config), with
# at least half the predicted change measured.
PEAK_TOLERANCE_PCT = 5.0
# a predicted and a measured peak change both under this share of the peak: "about unchanged", and that held
# (identical gloo ranks' peaks differ by 1.3-1.4% from run to run, which rank is highest flipping: a fix predicting
# no peak change read "missed" at +1.38%, a new-user trial)
PEAK_UNCHANGED_PCT = 2.0
TOP_OPS = 8  # kernels/operators listed per phase
TOP_COMM = 12  # unit rows listed

# The configuration keys whose change applies a rule's fix (by code prefix), to recognise an applied fix.
FIX_KEYS: dict[str, tuple[str, ...]] = {
    "reshard.": ("reshard_after_forward",),
    "prefetch.sync_unshard": ("unshard_async_op",),
    "prefetch.": ("forward_prefetch", "backward_prefetch"),
    "ac.": ("checkpoint",),
    "wrap.": ("wrapping",),
    "comm.small_collectives": ("wrapping",),
    "offload.": ("offload",),
    "comm.bound": ("param_dtype", "reduce_dtype"),
    "precision.": ("param_dtype",),
    "throughput.low_mfu": ("tokens_per_step", "checkpoint", "wrapping"),
    "optim.untrained_params": ("trainable",),
    "optim.never_updated": ("wrapping",),  # (its fix removes the units whose output nothing reads)
    # its fix: bf16 parameters (a MixedPrecisionPolicy); the config diff showed param_dtype float32 -> bfloat16 and no
    # prediction checked (a new-user trial)
    "optim.state_dominates": ("param_dtype",),
    # its fix: set_requires_gradient_sync(is_last_micro_batch), in the loop (the config diff's gradient_sync)
    "accum.sync_every_micro_batch": ("gradient_sync",),
    # their fix on a Hugging Face model: set_attn_implementation('sdpa') (an eager Llama against its sdpa rerun read
    # "no configuration change found", its 63% shorter step the host's: a new-user trial)
    "kernels.eager_attention": ("attn_implementation",),
    # ... and a chunked loss's chunks (torchtitan's --loss.num-chunks: "no configuration change found" before)
    "memory.temporaries": ("attn_implementation", "loss_chunks"),
    # its fix: the optimizer's groups switched to fused
    "optim.foreach_temporaries": ("optimizer_impl",),
}
# The way a fix moves its setting, where the rule says one: the units checkpointed, fewer (-1) or more (+1). Its
# prediction is checked only where B moved that way: a B checkpointing all 8 layers where A checkpointed every other
# one checked A's ac.unneeded (checkpoint less) and read "missed: lower than predicted" (a new-user trial).
FIX_WAY: dict[str, int] = {"ac.unneeded": -1, "ac.fewer_units": -1, "ac.recommended": 1}
UNIT_KEYS = ("reshard_after_forward", "forward_prefetch", "backward_prefetch", "unshard_async_op",
             "unshard_in_backward", "checkpoint", "offload", "param_dtype", "reduce_dtype", "compiled", "trainable")
# What a plain trace carries of the settings, compared between two plain-trace sides only (records give the settings
# themselves): per unit, its all-gathers' dtype (the collectives' args) and, where the dtypes are the same or not
# given, their size per call; for the job, the all-gathers the host sat in (gloo's synchronous unshard). bf16
# parameters (every all-gather 774.50 -> 387.25 KiB) and async unshard (72 of 72 all-gathers blocking the host, then
# 6) read "no configuration change found", the step's change the host's (a new-user trial).
TRACE_UNIT_KEYS = ("allgather_dtype", "allgather_bytes")
# ... the setting each shows (a fix recognised by it, FIX_KEYS; a finding gone with none of its fix's settings changed).
# The host's blocking is a change where one side's is the synchronous unshard's and the other's not, as
# prefetch.sync_unshard reads them (BLOCKED_AG_SHARE of the all-gathers or more): the synchronous unshard blocks in
# every one (28 of 28 in each of this package's reruns), the async one in a varying share (0-22 of 28 in them)
SEEN_AS = {"allgather_dtype": "param_dtype", "allgathers_blocking_host": "unshard_async_op"}
# a finding of A gone in B where every setting its fix changes was read on both sides and none changed: it fell
# under its threshold (prefetch.exposed_allgather, no prefetch changed, read "resolved": a new-user trial)
NO_FIX_FOUND = "below its threshold in B; no change of its fix found"
# activations at the peak moving this much (%) with no setting changed: the batch or the sequence length did, where
# the batch's input elements at the peak differ or, where not recorded, the peak fell at the same place of the step
BATCH_SHIFT_PCT = 20.0
JOB_KEYS = ("world_size", "torch_version", "tokens_per_step", "backend", "device_name", "optimizer",
            "capacity_bytes", "attn_implementation", "loss_chunks", "optimizer_impl")


@dataclass
class Side:
    """One run to compare: its report, its step-time samples (per step, every rank's ms), where they come
    from, the kernels' and operators' times of its traces, and for plain traces the units FSDP prefetched."""

    report: Report
    samples: list[list[float]]
    source: str  # "records" | "trace"
    ops: dict[tuple[str, str, str], float] = field(default_factory=dict)  # (phase, kind, name) -> µs per step
    # (from its traces: a plain-trace folder's, or a recorded run's profiler windows; {} without any)
    prefetched: Optional[dict[str, set[str]]] = None  # trace: "forward"/"backward" -> units prefetched
    # the input elements of the step its memory peak fell in (StepRecord.input_elements); None: not recorded
    peak_input_elements: Optional[int] = None


# ------------------------------------------------------------------------------------------------ helpers
def delta(a: Optional[float], b: Optional[float], nd: int = 3) -> Delta:
    if a is None or b is None:
        return Delta(a=a, b=b)
    d = b - a
    return Delta(a=round(a, nd), b=round(b, nd), delta=round(d, nd), pct=round(100 * d / a, 1) if a else None)


def predicted_of(f: Finding) -> dict[str, Optional[float]]:
    """A finding's prediction as {step_ms_before, step_ms_after, peak_bytes_before, peak_bytes_after} (None where
    absent): the one place that reads ``Finding.predicted``."""
    p = f.predicted
    if p is UNSET or p is None:
        p = {}
    elif not isinstance(p, dict):  # a typed prediction
        import msgspec

        p = msgspec.to_builtins(p)
    out = {k: p.get(k) for k in ("step_ms_before", "step_ms_after", "peak_bytes_before", "peak_bytes_after")}
    out["at_most"] = bool(p.get("at_most"))
    out["peak_at_most"] = out["at_most"] or bool(p.get("peak_at_most"))
    return out


def _matrix(samples: list[list[float]]) -> np.ndarray:
    width = max((len(s) for s in samples), default=0)
    m = np.full((len(samples), width), np.nan)
    for i, s in enumerate(samples):
        m[i, :len(s)] = s
    return m


def _step_delta(a: list[list[float]], b: list[list[float]], q: float, rng: np.random.Generator,
                changed: bool = True, apart: str = "") -> Optional[StepDelta]:
    """The change of the ``q``-th percentile step (B − A) and its bootstrap interval; ``changed``: whether A and B
    differ in configuration (without a change, a difference is not significant: reason ``NO_CHANGE``); ``apart``:
    a reason the two runs' step times cannot be set against each other (``OTHER_SOURCES``, ``HOST_CHANGED``)."""
    ma, mb = _matrix(a), _matrix(b)
    if not ma.size or not mb.size:
        return None
    pa, pb = float(np.nanpercentile(ma, q)), float(np.nanpercentile(mb, q))
    ia = rng.integers(0, ma.shape[0], size=(RESAMPLES, ma.shape[0]))
    ib = rng.integers(0, mb.shape[0], size=(RESAMPLES, mb.shape[0]))
    ra = np.nanpercentile(ma[ia].reshape(RESAMPLES, -1), q, axis=1)
    rb = np.nanpercentile(mb[ib].reshape(RESAMPLES, -1), q, axis=1)
    alpha = (1 - CONFIDENCE) / 2 * 100
    # the interval of B's step over A's (a ratio, never below -100%), in ms of A's step: the interval of the
    # difference set against A's p50 read "-72.3% (95% CI -103.4% to -41.2%)" where A's resampled p50 ran above
    # its own (a slow outlier step: a new-user trial)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(ra > 0, rb / ra, np.nan)
    if np.isfinite(ratio).any() and pa > 0:
        rlo, rhi = np.nanpercentile(ratio, [alpha, 100 - alpha])
        lo, hi = pa * (rlo - 1), pa * (rhi - 1)
    else:
        lo, hi = np.percentile(rb - ra, [alpha, 100 - alpha])
    d = delta(pa, pb)
    big = d.pct is not None and abs(d.pct) >= NOISE_FLOOR_PCT
    reason = (apart or "within noise" if lo <= 0 <= hi else apart or "under noise floor" if not big else
              apart or ("" if changed else NO_CHANGE))
    few = not apart and min(ma.shape[0], mb.shape[0]) < MIN_STEPS
    if few:  # (no interval either: the summary says 3 or more a side give one, and the table printed one anyway)
        reason, lo, hi = FEW_STEPS, None, None
    return StepDelta(a=d.a, b=d.b, delta=d.delta, pct=d.pct, ci_low=None if few else round(float(lo), 3),
                     ci_high=None if few else round(float(hi), 3),
                     confidence=CONFIDENCE, significant=not reason, reason=reason,
                     samples_a=int(np.isfinite(ma).sum()), samples_b=int(np.isfinite(mb).sum()),
                     steps_a=int(ma.shape[0]), steps_b=int(mb.shape[0]))


def _steps_of(s: StepDelta) -> str:
    return f"A {s.steps_a} step{'s' * (s.steps_a != 1)}, B {s.steps_b} step{'s' * (s.steps_b != 1)}"


def step_summary(s: Optional[StepDelta], changed: bool = True, host: str = "", outside: str = "") -> str:
    """One line: the step-time verdict (``changed``: whether A and B differ in configuration; ``host``: what showed
    the host's speed changed, where it did; ``outside``: where the time outside the model made most of the change,
    how it moved)."""
    if s is None or s.pct is None:
        return "step time not comparable (a run has no steps)"
    ci = ("" if s.ci_low is None else  # (too few steps: none)
          f"{100 * s.ci_low / s.a:+.1f}% to {100 * s.ci_high / s.a:+.1f}%" if s.a else f"{s.ci_low} to {s.ci_high} ms")
    interval = f"{round(100 * s.confidence)}% CI {ci}"
    if s.reason == OTHER_SOURCES:
        return ("step times not set against each other: one run's come from its records (every steady step), the "
                "other's from a profiler trace (its profiled steps, slower with the profiler on): compare the phase "
                "shares, not the times")
    if s.reason == HOST_CHANGED:
        return (f"step time p50 {s.pct:+.1f}% ({interval}), not the change's alone: {host}; rerun both on a quiet "
                "host to tell the change's part")
    if s.reason == NO_CHANGE and outside:  # (a loader's fix read as "run-to-run variation of the host": a new-user
        # trial's DataLoader with 4 workers, its time outside the model 32.9 -> 1.4 ms, the step -59.5%)
        return (f"no configuration change found: step time p50 {s.pct:+.1f}% ({interval}), most of it the time outside "
                f"the model ({outside}): data loading or your loop changed, which compare does not read; for a fix "
                "made there, pass --applied CODE to check its prediction")
    if s.reason == NO_CHANGE:
        return (f"no configuration change found: step time p50 {s.pct:+.1f}% ({interval}) is run-to-run variation of "
                "the host (load, clocks), not the effect of a change, unless something compare does not read changed "
                "(code, data loading, a setting the runs do not record); the interval covers each run's step-to-step "
                "noise only: to tell, rerun each side a few times and compare the medians")
    if s.reason == FEW_STEPS:
        return (f"step time p50 {s.pct:+.1f}%, from too few steps to tell ({_steps_of(s)}; {MIN_STEPS} or more a side "
                "give an interval): not called a change")
    if not s.significant:
        why = (f"under the {NOISE_FLOOR_PCT:g}% noise floor between runs" if s.reason == "under noise floor"
               else "within noise")
        head = "no" if changed else "no configuration change found, and no"
        return f"{head} significant change in step time: p50 {s.pct:+.1f}% ({interval}: {why})"
    return f"step time p50 {s.pct:+.1f}% ({interval}): {'faster' if s.pct < 0 else 'slower'}"


# ------------------------------------------------------------------------------------------------ config
def _path(name: Optional[str]) -> str:
    """The key a unit is matched by across the two runs: its module path (``module_path``: a layer sharded inside
    its checkpoint_wrapper, "layers.0._checkpoint_wrapped_module", is the layer "layers.0" it was without one), the
    root "(root)"."""
    return module_path(name) or ROOT_LABEL


def _units(side: Side) -> dict[str, dict[str, Any]]:
    """Unit module path (``_path``) -> the configuration keys compared (from the unit snapshot, or for a plain trace
    the units its collectives name and whether FSDP prefetched them). A wrapper's own unit without parameters
    (accelerate's, around the layer's unit) and the unit inside it are one path: the settings are the inner one's.
    (Matched by name, each layer checkpointed read as a rewrap, "2 units differ, 5 units -> 7 units", and its
    collectives as gone and new: a new-user trial.)"""
    rep = side.report
    out: dict[str, dict[str, Any]] = {}
    if rep.units:  # (a unit without parameters, a root left empty, gathers nothing: its settings do nothing)
        for u in rep.units:
            path, settings = _path(u.name), {k: _setting(u, k) for k in UNIT_KEYS} if u.param_count != 0 else {}
            if settings or path not in out:
                out[path] = settings
        return out
    pf = side.prefetched or {}
    for r in rep.overlap.per_unit if rep.overlap else []:
        if r.unit == "(other)":
            continue
        seen = out.setdefault(_path(r.unit), {"forward_prefetch": False, "backward_prefetch": False})
        for k, phase in (("forward_prefetch", "forward"), ("backward_prefetch", "backward")):
            seen[k] = seen[k] or r.unit in pf.get(phase, set())
        if r.collective == "all_gather":  # (TRACE_UNIT_KEYS: the unit's whole parameters, on every rank)
            seen["allgather_dtype"] = dtype_name(r.dtype) or seen.get("allgather_dtype")
            seen["allgather_bytes"] = max(r.bytes_per_call or 0, seen.get("allgather_bytes") or 0) or None
    for seen in out.values():
        seen["allgather_bytes"] = fmt_bytes(seen["allgather_bytes"]) if seen.get("allgather_bytes") else None
    return out


def _blocking(side: Side) -> Optional[tuple[str, bool]]:
    """A CPU plain trace's all-gathers the host sat in, in words ("72 of 72"), and whether that is the synchronous
    unshard's (``BLOCKED_AG_SHARE`` of them or more); None without all-gathers, or on a GPU (the host launches them
    and goes on)."""
    ov = side.report.overlap if side.source == "trace" else None
    if ov is None or any(pr.device != "cpu" for pr in ov.per_rank.values()):
        return None
    n, total = blocked_allgathers(ov)
    if not total:
        return None
    return f"{n} of {total}", n >= BLOCKED_AG_SHARE * total


def _setting(u, key: str):
    """A unit's setting as it acts: no MixedPrecisionPolicy dtype is the parameters' own dtype (reduce: the
    gathered one), no offload policy is "none", where the snapshot read the unit's groups (its resharding known);
    None stays unknown. Turning bf16 or CPU offload on read as no configuration change, the slowdown as the host's
    (a new-user trial): the snapshot's None was taken as unknown. "compiled": the unit runs in a frame torch.compile
    compiled (in place, or timed around its compiled call): U-Net blocks compiled read "no configuration change"."""
    if key == "compiled":
        return runs_compiled(u)
    if key == "trainable":
        return _trainable_share(u.trainable_unsharded_bytes, u.unsharded_bytes)
    v = getattr(u, key)
    if key == "checkpoint" and v not in (None, "none") and getattr(u, "checkpoint_selective", False):
        # (selective to full read "no configuration change found", ac.selective_to_full's fix unmatched: the
        # snapshots differed only there, a new-user trial on torchtitan)
        return f"{v} (selective)"
    if key in ("forward_prefetch", "backward_prefetch") and v:  # the units it prefetches, by module path too
        return [module_path(n) for n in v]
    if v is not None or getattr(u, "reshard_after_forward", None) is None:
        return v
    if key == "offload":
        return "none"
    own = list(getattr(u, "orig_dtypes", None) or [])
    param = getattr(u, "param_dtype", None) or (own[0] if len(own) == 1 else None)
    return param if key in ("param_dtype", "reduce_dtype") else v


def _trainable_share(trainable, total) -> Optional[str]:
    """The trainable (requires_grad) share of a unit's gathered parameter bytes, or of the model's parameters, in
    words ("100%", "0%", "73.5%"); None where not read. optim.untrained_params' fix (requires_grad_(False) on what the
    optimizer never steps) read "no configuration change found" and its activations' fall as the batch's, though the
    headers said 0.70 M params against 0.70 M (0.18% trainable) (a new-user trial)."""
    if trainable is None or not total:
        return None
    share = f"{100 * trainable / total:.3g}%"
    # (one bias frozen in a large unit is not all of it)
    return f"{100 * trainable / total:.6g}%" if share == "100%" and trainable != total else share


def _mesh(run) -> Optional[str]:
    """The parameters' device mesh in words ("replicate 2 × shard 2", "dp 2 × tp 2"), "1-D" where FSDP shards over
    every rank alone; None where not known (no records: a plain trace's run)."""
    if getattr(run, "units", UNSET) in (UNSET, None):  # (the snapshot's facts: only a run with records has them)
        return None
    mesh = getattr(run, "mesh", UNSET)
    return fmt_mesh(mesh) if mesh not in (UNSET, None) and mesh else "1-D"


def _gradient_sync(run) -> Optional[tuple[str, str]]:
    """(how the run syncs its micro-batches' gradients, in words: "every micro-batch (4 of 4)", "last micro-batch
    (1 of 4)"; the way compared, the counts left out) under gradient accumulation; None without it, or where the
    run did not record it (RunFacts.backwards_per_step). Accumulation's fix read "no configuration change found" and
    its step-time change as the host's: the sync is set in the loop, which no snapshot holds."""
    n, synced = (getattr(run, k, UNSET) for k in ("backwards_per_step", "synced_backwards_per_step"))
    if n in (UNSET, None) or synced in (UNSET, None):
        return None
    way = "every" if synced == n else "last" if synced == 1 else "no" if synced == 0 else f"{synced / n:.3g}"
    words = f"{way} micro-batch ({synced} of {n})" if way in ("every", "last", "no") else \
        f"{synced} of {n} micro-batches"
    return words, way


def _norm(v):
    return tuple(v) if isinstance(v, list) else v


def config_diff(a: Side, b: Side, read: Optional[set[str]] = None) -> list[ConfigChange]:
    """The configuration changes from A to B; ``read``, where given, gets the keys known on both sides (those whose
    change would have been found)."""
    out: list[ConfigChange] = []
    read = set() if read is None else read
    ra, rb = a.report.run, b.report.run
    for k in JOB_KEYS:
        va, vb = getattr(ra, k, None), getattr(rb, k, None)
        va, vb = (None if v is UNSET else v for v in (va, vb))
        if va is not None and vb is not None:
            read.add(k)
        if va != vb and (va is not None and vb is not None or k == "world_size"):
            out.append(ConfigChange(key=k, a=va, b=vb))
    ma, mb = _mesh(ra), _mesh(rb)
    if ma is not None and mb is not None:
        read.add("mesh")
    if ma is not None and mb is not None and ma != mb:  # (4 ranks 1-D against HSDP 2 x 2 read "no configuration
        out.append(ConfigChange(key="mesh", a=ma, b=mb))  # change" and its step time as the host's: a new-user trial)
    ga, gb = _gradient_sync(ra), _gradient_sync(rb)
    if ga is not None and gb is not None:
        read.add("gradient_sync")
    if ga is not None and gb is not None and ga[1] != gb[1]:
        out.append(ConfigChange(key="gradient_sync", a=ga[0], b=gb[0]))
    ba, bb = _blocking(a), _blocking(b)
    if ba is not None and bb is not None:
        read.add("allgathers_blocking_host")
        if ba[1] != bb[1]:
            out.append(ConfigChange(key="allgathers_blocking_host", a=ba[0], b=bb[0]))
    ua, ub = _units(a), _units(b)
    alias = same_group(ua, ub)  # (a records run and a plain trace name a group's modules in other orders)
    ub = {alias.get(k, k): v for k, v in ub.items()}
    if a.source != b.source:  # a trace names the units it saw gather (those with parameters), and no settings: a
        # records' unit's prefetch targets and a trace's "was prefetched" are not one setting
        ua, ub = ({n: {} for n, v in u.items() if v or side.source == "trace"} for u, side in ((ua, a), (ub, b)))
    if ua and ub:
        read.add("wrapping")
    if ua and ub and set(ua) != set(ub):
        # ("1 units" for a whole-model unit: a new-user trial's T5 root against its plan)
        a_n, b_n = (f"{len(u)} unit{'s' * (len(u) != 1)}" for u in (ua, ub))
        out.append(ConfigChange(key="wrapping", a=a_n, b=b_n, units=sorted(set(ua) ^ set(ub))))
    grouped: dict[tuple, list[str]] = {}
    for name in sorted(set(ua) & set(ub)):
        da, db = ua[name].get("allgather_dtype"), ub[name].get("allgather_dtype")
        for k in (*UNIT_KEYS, *TRACE_UNIT_KEYS):
            va, vb = ua[name].get(k), ub[name].get(k)
            if va is None or vb is None:  # (None: unknown, not a change)
                continue
            read.add(k)
            if _norm(va) != _norm(vb) and not (k == "allgather_bytes" and None not in (da, db) and da != db):
                # (an all-gather's size where its dtype changed: the dtype's change says it)
                grouped.setdefault((k, _norm(va), _norm(vb)), []).append(name)
    for (k, va, vb), names in grouped.items():
        out.append(ConfigChange(key=k, a=list(va) if isinstance(va, tuple) else va,
                                b=list(vb) if isinstance(vb, tuple) else vb, units=names))
    # the model's trainable share, where the units' do not say it (a snapshot without their trainable bytes)
    sa, sb = (_trainable_share(*(None if v is UNSET else v for v in (getattr(r, "model_trainable_param_count", None),
                                                                     getattr(r, "model_param_count", None))))
              for r in (ra, rb))
    if sa is not None and sb is not None:
        read.add("trainable")
    if not any(c.key == "trainable" for c in out) and sa is not None and sb is not None and sa != sb:
        out.append(ConfigChange(key="trainable", a=sa, b=sb))
    return out


# ------------------------------------------------------------------------------------------------ sections
def _phases(side: Side) -> dict[str, float]:
    rep = side.report
    if side.source == "records" and rep.steps and rep.steps.job and rep.steps.job.phases_p50_ms:
        return dict(rep.steps.job.phases_p50_ms)
    ov = rep.overlap
    if ov is None or not ov.breakdown:
        return {}
    acc: dict[str, list[float]] = {}
    for r, bd in ov.breakdown.items():
        n = len(ov.per_rank[r].steps) if r in ov.per_rank else 0
        if n:
            for k, us in bd.parts().items():
                acc.setdefault(k, []).append(us / 1e3 / n)
    return {k: sum(v) / len(v) for k, v in acc.items()}


def _peak_rank(rep: Report):
    """(rank, its ``MemoryRank``) of the highest rank's memory; (None, None) without a memory section."""
    m = rep.memory_section()
    if m is None or not m.per_rank:
        return None, None
    r = m.peak_rank if m.peak_rank in m.per_rank else next(iter(m.per_rank))
    return r, m.per_rank[r]


def _memory(rep: Report) -> tuple[Optional[int], dict[str, int]]:
    """(peak bytes, bytes by category at it) of the highest rank, as the report's views show them: the records', else
    a plain trace's memory events (no categories; a new-user trial read analyze's peak and compare's "—")."""
    _, pr = _peak_rank(rep)
    return (None, {}) if pr is None else (pr.peak_bytes, dict(pr.peak_breakdown))


def _activations_moved(a: Side, b: Side, act: Delta) -> str:
    """What the peak's activations moving by ``BATCH_SHIFT_PCT`` or more with no setting changed say, for the
    summary: the batch changed where the input elements of the peaks' steps differ, or (not recorded) where both
    peaks fell at the same place of the step (unit and phase); where the peak moved, that it did ("" where the batch
    and the place are the same). Two runs alike but for their DataLoader read "the batch or the sequence length
    differs" at -24%: A's peak fell in the loss (rank 0, 203.53 KiB of activations), B's in unit 2's backward
    (155.03 KiB), and both recorded 64 input elements on every step (a new-user trial)."""
    ea, eb = a.peak_input_elements, b.peak_input_elements
    (ra, pa), (rb, pb) = _peak_rank(a.report), _peak_rank(b.report)
    same = (pa.peak_at.unit, pa.peak_at.phase) == (pb.peak_at.unit, pb.peak_at.phase)
    known = ea is not None and eb is not None
    batch = (f"; but the peak's activations moved {act.pct:+.0f}% with no setting changed: the batch or the sequence "
             "length differs")
    if known and ea != eb:
        return f"{batch} (the peak step's input elements {ea:,} -> {eb:,})"
    if not known and same:
        # (a batch of 4 against 2 read "no configuration change found" beside +99.7% of activations: a new-user
        # trial; runs recorded before StepRecord.input_elements hold the loop's batch only as tokens_per_step)
        return f"{batch}, which compare reads only as watch()'s tokens_per_step"
    if same:
        return ""
    return (f"; the memory peak moved, from rank {ra}, {memory_peak_where(pa.peak_at)} (A) to rank {rb}, "
            f"{memory_peak_where(pb.peak_at)} (B): its activations ({act.pct:+.0f}%) are those of another moment of "
            "the step" + (f", the batch the same ({ea:,} input elements in the peak step)" if known else ""))


def _comm(side: Side, source: str) -> dict[tuple[str, str, Optional[str]], float]:
    """(unit, collective, phase) -> exposed ms per step, mean over ranks."""
    rep = side.report
    out: dict[tuple[str, str, Optional[str]], float] = {}
    if source == "trace":
        ov = rep.overlap
        ranks = [r for r, pr in ov.per_rank.items() if pr.steps]
        for row in ov.per_unit:
            n = len(ov.per_rank[str(row.rank)].steps) if str(row.rank) in ov.per_rank else 0
            if n:
                k = (_path(row.unit), row.collective, row.phase)
                out[k] = out.get(k, 0.0) + row.exposed_us / 1e3 / n / len(ranks)
    else:
        for u in rep.units or []:
            t = u.timing_p50
            if t is not UNSET:
                for phase, ms in (("forward", t.ag_wait_fwd_ms), ("backward", t.ag_wait_bwd_ms)):
                    if ms is not None:  # (None: not known apart, a unit compiled in place)
                        k = (_path(u.name), "all_gather", phase)  # (a wrapper's unit and the one inside: one path)
                        out[k] = out.get(k, 0.0) + ms
    return out


def _findings(a: Report, b: Report, changes: Iterable[ConfigChange] = (), read: Iterable[str] = (),
              applied: Iterable[str] = ()) -> FindingsDiff:
    """A's and B's findings by code; one of A's gone in B is resolved unless B's report could not look for it
    (unchecked) or every setting its fix changes (FIX_KEYS) was ``read`` on both sides and none of the ``changes``
    is one of them, nor is it ``applied``: then it fell below its threshold in B (NO_FIX_FOUND)."""
    def ref(f, why=""):
        return FindingRef(code=f.code, severity=f.severity, title=f.title, why=why)

    ca, cb = {f.code: f for f in a.findings}, {f.code: f for f in b.findings}
    # a finding B's report could not look for (its rule skipped there: a plain trace has no unit snapshot) is not
    # resolved: a run against its own trace read "resolved wrap.params_in_root ... pass --applied" (a new-user trial)
    skipped = {s.code: s.reason for s in b.rules if s.status == "skipped"}
    gone = [f for c, f in ca.items() if c not in cb and c not in skipped]
    seen, changed = ({SEEN_AS.get(k, k) for k in keys} for keys in (read, (c.key for c in changes)))
    fixes = {f.code: set(_fix_keys(f.code)) for f in gone}
    below = [f for f in gone if fixes[f.code] and fixes[f.code] <= seen and not fixes[f.code] & changed
             and f.code not in applied]
    return FindingsDiff(resolved=[ref(f) for f in gone if f not in below],
                        below_threshold=[ref(f, NO_FIX_FOUND) for f in below],
                        unchecked=[ref(f, skipped[c]) for c, f in ca.items() if c not in cb and c in skipped],
                        new=[ref(f) for c, f in cb.items() if c not in ca],
                        persisting=[ref(cb[c]) for c in ca if c in cb])


def _unfinished(rep: Report) -> list[str]:
    """The ranks whose run did not finish: killed, still going, or stopped on an exception in the loop."""
    return sorted((r for r, done in (rep.run.complete or {}).items() if not done), key=int)


# The settings a fix's code changes beside its own key, by what the code calls (optim.untrained_params' fix also sets
# the first trained unit's backward prefetch: compare read that as prefetch.exposed_allgather applied, "missed")
CODE_SETS = (("set_modules_to_backward_prefetch", "backward_prefetch"),
             ("set_modules_to_forward_prefetch", "forward_prefetch"),
             ("set_reshard_after_forward", "reshard_after_forward"), ("_set_unshard_async_op", "unshard_async_op"),
             ("requires_grad_(False)", "trainable"))


def _code_sets(code: str) -> set[str]:
    return {key for call, key in CODE_SETS if call in (code or "")}


def _fix_keys(code: str) -> tuple[str, ...]:
    for prefix, keys in FIX_KEYS.items():  # the most specific prefix first (dict order)
        if code == prefix or code.startswith(prefix) and prefix.endswith("."):
            return keys
    return ()


def _fix_way(code: str, changes: list[ConfigChange]) -> bool:
    """Whether B's configuration changes went the way ``code``'s fix goes (FIX_WAY: units checkpointed, net of
    those that stopped), or the fix names no way."""
    way = FIX_WAY.get(code)
    if way is None:
        return True
    moved = sum(((c.b != "none") - (c.a != "none")) * len(c.units) for c in changes if c.key == "checkpoint")
    return moved * way > 0


def _step_verdict(d: float, p50: StepDelta, pred: float) -> str:
    """Whether a predicted step change ``d`` (ms; ``pred`` the predicted step) held against the measured change:
    inconclusive from too few steps (``MIN_STEPS``), or when the measured interval holds both ``d`` and zero while
    ``d`` is a change (at least the noise floor; half of it where the interval is over twice the floor wide),
    held when the interval holds ``d`` or ``pred`` lands within
    ``STEP_TOLERANCE_PCT`` of B's step."""
    if p50.reason == FEW_STEPS:  # (one step a side: a zero-width interval, no measure of its noise)
        return "inconclusive"
    inside = p50.ci_low is not None and p50.ci_low <= d <= p50.ci_high
    floor = NOISE_FLOOR_PCT / 100 * p50.a
    # (an interval wider than twice the floor tells no change of half the floor's size or more from none: a
    # predicted -4.6% against -30% measured in an interval from -55% to +6% read "held", a new-user trial)
    wide = p50.ci_high - p50.ci_low > 2 * floor if inside else False
    if inside and p50.ci_low <= 0 <= p50.ci_high and (abs(d) >= floor or (wide and abs(d) >= floor / 2)):
        return "inconclusive"
    # a predicted "no change" in an interval that tells neither a slowdown nor a speedup of twice the tolerance
    # from none (a new-user trial's -38% ... +119% read "held" beside +26% measured)
    blind = 2 * STEP_TOLERANCE_PCT / 100 * p50.a
    if inside and p50.ci_low <= -blind and p50.ci_high >= blind:
        return "inconclusive"
    # within the tolerance of B's step, unless a predicted change (at least the noise floor) went the other way: a
    # predicted -7.2% against a measured +1.9% outside its interval "held" (a new-user trial)
    against = abs(d) >= NOISE_FLOOR_PCT / 100 * p50.a and (p50.delta or 0.0) * d < 0
    return "held" if inside or (abs(pred - p50.b) <= STEP_TOLERANCE_PCT / 100 * p50.b and not against) else "missed"


#: fixes whose gain lies in steps the step statistics leave out, checked by the share of the time B measures
#: (``_share``); their --applied does not make a step-time change significant
SHARE_FIXES = frozenset({"checkpoint.blocking"})
#: a share prediction holds where B's share fell by at least this part of the predicted drop (async_save's: all of A's
#: share but the copy to host memory, which the rule does not price; measured here, 25.9% -> 6.2% on the reference
#: GPT's 2 gloo ranks, torchtitan's async mode 13.7% -> 4.4%)
SHARE_HELD = 0.5


def _saves(rep: Report) -> Optional[CheckpointSteps]:
    """The saves of the rank whose saves take the largest share of its recorded time, as checkpoint.blocking quotes
    them; None without a save."""
    got = heaviest_saves(rep.steps.checkpoints) if rep.steps else None
    return got[1] if got else None


def _share(rep: Report) -> Optional[float]:
    """B's figure of a SHARE_FIXES fix: checkpoint.blocking's, the saves' largest share of a rank's recorded time
    (%; 0 without a save); None without step records."""
    if rep.steps is None or not rep.steps.per_rank:
        return None
    c = _saves(rep)
    return round(100 * c.ms_total / c.wall_ms_total, 1) if c is not None else 0.0


def _every(c: CheckpointSteps) -> Optional[float]:
    """Steps between a run's saves: their median distance; with one save, the steps counted (the run held no
    second one)."""
    return save_interval(c) or (c.counted_steps / c.saves if c.counted_steps else None)


def _how(c: CheckpointSteps) -> str:
    """How a run's saves were made, in words: "asynchronously", "synchronously", "2 of 5 asynchronously"."""
    return ("asynchronously" if c.async_saves == c.saves else "synchronously" if not c.async_saves else
            f"{c.async_saves} of {c.saves} asynchronously")


def _mostly_async(c: CheckpointSteps) -> bool:
    """Whether most of a run's saves were asynchronous (async_save's alternative taken: a run in torchtitan's async
    mode also saves its last step synchronously)."""
    return 2 * c.async_saves > c.saves


def _saves_check(chk: PredictionCheck, f: Finding, ra: Report, rb: Report) -> None:
    """checkpoint.blocking's check, of the alternative B took by its own records (its saves asynchronous where A's
    were not, or fewer of them: a longer interval), filled into ``chk``. A user who applied async_save had B's share
    checked against the save-less-often prediction, which "held" by chance (a new-user trial; on the reference GPT
    here, dcp.save every 4 steps 25.9% of the time, async_save's 6.2% against 5.2% predicted for a save every 38).

    - async_save (most of B's saves asynchronous, most of A's not; the synchronous ones, torchtitan's last save, stay
      in B's share, ``share_why`` says how many): the rule prices no figure: the step waits for the copy to host
      memory only, at most A's saves' time per step to gain, less that copy. Held where B's share fell by at least
      ``SHARE_HELD`` of the most it can fall (A's share, less B's synchronous saves at A's time a save), its gain in
      ms per step beside the most (``gain_ms_per_step_*``).
    - a save less often: the share A's saves would take with B's saves (their count in B's steps counted, at B's
      interval, the advised one or not), held where B's share fell by at least ``SHARE_HELD`` of that drop. (A's
      ``share_pct_after`` counts a fraction of a save: a 23-step run saving every 8 steps, 2.9 saves, 17.1%, where
      B's 2 saves took 13.0% and A's saves would have taken 12.9%.)
    - both, or neither (as often or more, or synchronous where A saved asynchronously), or no save: nothing checked,
      ``share_why`` says what B did."""
    ca, cb, before, got = _saves(ra), _saves(rb), f.evidence.get("share_pct"), _share(rb)
    if ca is None or not ca.counted_steps or before is None or got is None or cb is not None and not cb.counted_steps:
        return  # (counted_steps 0: a report written before the field)
    chk.share_pct_before, chk.share_pct_measured = before, got
    if cb is None:
        chk.share_fix, chk.share_why = "no save", "B recorded no checkpoint save: no prediction of this fix applies"
        return
    ea, eb = _every(ca), _every(cb)
    chk.share_every_a, chk.share_every_b = ea, eb
    chk.share_every_advised = f.evidence.get("save_steps_after")
    how_a, how_b = _how(ca), _how(cb)
    known = ea is not None and eb is not None
    same, less = known and round(eb, 1) == round(ea, 1), known and round(eb, 1) > round(ea, 1)
    # (mostly: torchtitan's async mode saves its last step synchronously, "4 of 5 asynchronously" read "neither")
    now_async = _mostly_async(cb) and not _mostly_async(ca)
    if now_async and not same:
        chk.share_fix = "both"
    elif now_async:
        chk.share_fix = "async_save"
        if cb.async_saves < cb.saves:  # (the synchronous ones' time is in B's share)
            chk.share_why = f"B saved {how_b}"
        chk.gain_ms_per_step_at_most = round(ca.ms_total / ca.counted_steps, 3)
        chk.gain_ms_per_step_measured = round(ca.ms_total / ca.counted_steps - cb.ms_total / cb.counted_steps, 3)
        # the synchronous ones' share at A's time a save: the most async_save can take away is the rest
        floor = 100 * (cb.saves - cb.async_saves) * (ca.ms_total / counted_saves(ca)) / cb.wall_ms_total
        chk.share_held = got <= before - SHARE_HELD * (before - floor)
        return
    elif less and how_a == how_b:
        chk.share_fix = "less often"
        step_ms, chk.share_saves_b = (ca.wall_ms_total - ca.ms_total) / ca.counted_steps, counted_saves(cb)
        chk.share_pct_predicted = round(100 * saves_share(ca, step_ms, chk.share_saves_b, cb.counted_steps)[0], 1)
        chk.share_held = got <= before - SHARE_HELD * (before - chk.share_pct_predicted)
        return
    else:
        chk.share_fix = "neither"
    every = {k: f"every {'?' if e is None else f'{e:g}'} steps" for k, e in (("a", ea), ("b", eb))}
    a_did = "as A" if same and how_a == how_b else f"A {how_a} {every['a']}"
    chk.share_why = f"B saved {how_b} {every['b']}, {a_did}: " + (
        "how and how often both changed, and each of the fix's alternatives predicts one alone"
        if chk.share_fix == "both" else "not the fix (a save less often)" if how_a == "asynchronously"
        else "neither of the fix's alternatives (async_save, a save less often)")


def _peak_change(p: dict) -> Optional[float]:
    """A prediction's expected peak change (bytes); None where it has none or only a ceiling."""
    if p["peak_at_most"] or p["peak_bytes_before"] is None or p["peak_bytes_after"] is None:
        return None
    return (p["peak_bytes_after"] - p["peak_bytes_before"]) or None


def _predictions(a: Side, b: Side, changes: list[ConfigChange], applied: Iterable[str],
                 p50: Optional[StepDelta], peak_a: Optional[int], peak_b: Optional[int]) -> list[PredictionCheck]:
    shown = {SEEN_AS.get(c.key, c.key): c.key for c in changes}  # the settings changed (a plain trace's: SEEN_AS)
    changed = set(shown)
    applied = set(applied)
    in_b = {f.code for f in b.report.findings}
    hits = {f.code: [k for k in _fix_keys(f.code) if k in changed] for f in a.report.findings}
    # the settings a fix that B resolved changed: a finding of A still in B whose fix changes only those was not
    # what B applied (a rewrap that resolved wrap.too_fine checked wrap.params_in_root's prediction, "missed",
    # where B still raised it: a new-user trial)
    resolved_keys = {k for code, ks in hits.items() if code not in in_b for k in ks}
    # the settings a recognised fix's own code changed beside its key: another finding whose keys are only those was
    # not what B applied
    claimed = {code: _code_sets(f.recommendation.code) & changed for f in a.report.findings
               if (code := f.code) in applied or hits[code]}
    checked = []
    for f in a.report.findings:
        if f.code not in applied:
            hit = hits[f.code]
            if not hit or (f.code in in_b and set(hit) <= resolved_keys) or not _fix_way(f.code, changes):
                continue
            # (a fix whose own key is one of these, another prefetch rule's, claims nothing here: which of the two
            # B applied stays open, as before)
            if any(set(hit) <= keys for code, keys in claimed.items()
                   if code != f.code and not set(_fix_keys(code)) & set(hit)):
                continue
        checked.append(f)
    # the fixes B applies, for the peak each moves: those checked, and those in the loop (no setting to read) whose
    # finding B resolved; a ceiling ("may rise by up to") is no expected change
    loop_fixed = [g for g in a.report.findings if g.code not in in_b and not _fix_keys(g.code) and g not in checked]
    moving = {g.code: d for g in [*checked, *loop_fixed] if (d := _peak_change(predicted_of(g)))}
    out = []
    for f in checked:
        how = "--applied" if f.code in applied else "config diff: " + ", ".join(shown[k] for k in hits[f.code])
        p = predicted_of(f)
        chk = PredictionCheck(code=f.code, recognised_by=how)
        if f.code in SHARE_FIXES:  # its gain is not in the step p50 (the saves' steps are out of it): its share
            _saves_check(chk, f, a.report, b.report)
            out.append(chk)
            continue
        if p["step_ms_before"] and p["step_ms_after"] is not None and p50 is not None and p50.a and p50.b:
            ratio = p["step_ms_after"] / p["step_ms_before"]
            pred = p50.a * ratio
            chk.step_ms_predicted, chk.step_ms_measured = round(pred, 3), p50.b
            chk.step_pct_predicted, chk.step_pct_measured = round(100 * (ratio - 1), 1), p50.pct
            chk.step_verdict = ("inconclusive" if p50.reason in (HOST_CHANGED, OTHER_SOURCES)
                                else "held" if p["at_most"] and p50.b <= pred  # a ceiling: at or under it
                                else _step_verdict(pred - p50.a, p50, pred))
        if p["peak_bytes_before"] is not None and p["peak_bytes_after"] is not None and peak_a and peak_b:
            # with the peak changes of the other fixes B applies on other settings: B's peak is theirs too (the
            # prefetch fix pasted with memory.outputs_kept's `del outputs`, the peak 896 KiB under A's as the latter
            # predicted, read "missed: lower than predicted" against the prefetch's "unchanged", a new-user trial)
            chk.peak_with = [code for code in moving if code != f.code
                             and not set(_fix_keys(code)) & set(_fix_keys(f.code))]
            pred = (peak_a + (p["peak_bytes_after"] - p["peak_bytes_before"])
                    + sum(moving[code] for code in chk.peak_with))
            chk.peak_bytes_predicted, chk.peak_bytes_measured = int(round(pred)), int(peak_b)
            chk.peak_pct_error = round(100 * (pred - peak_b) / peak_b, 2)
            # a ceiling holds when the peak came out at or under it; a change, when the error is within the
            # tolerance and at least half the predicted change happened, in its direction (a run against itself
            # "held" a predicted -3.4%: inside the 5% tolerance, no change passes; a new-user trial)
            # a predicted change under 1% of the peak says "about unchanged": held when the peak moved under 1%
            # too (ZeRO-2 under checkpointing predicted +0.17%, measured 0: "missed", a new-user trial)
            moved, change = peak_b - peak_a, pred - peak_a
            slight = max(abs(change), abs(moved)) <= PEAK_UNCHANGED_PCT / 100 * peak_a
            chk.peak_held = (chk.peak_pct_error >= -PEAK_TOLERANCE_PCT if p["peak_at_most"]
                             else abs(chk.peak_pct_error) <= PEAK_TOLERANCE_PCT
                             and (slight or (moved * change > 0 and abs(moved) >= 0.5 * abs(change))))
        out.append(chk)
    return out


def _ops(a: Side, b: Side) -> list[OpChange]:
    if not a.ops or not b.ops:  # (a side without a trace has no figure here: not 0 µs; a new-user trial read "0 µs")
        return []
    rows = [OpChange(phase=k[0], kind=k[1], name=k[2], a_us=round(a.ops.get(k, 0.0), 2), b_us=round(b.ops.get(k, 0.0), 2),
                     delta_us=round(b.ops.get(k, 0.0) - a.ops.get(k, 0.0), 2)) for k in set(a.ops) | set(b.ops)]
    out = []
    for ph in sorted({r.phase for r in rows}):
        mine = sorted((r for r in rows if r.phase == ph and r.delta_us), key=lambda r: -abs(r.delta_us))
        out.extend(mine[:TOP_OPS])
    return out


def _world(rep: Report) -> Optional[int]:
    """Ranks in the job: the records' world size, else the ranks with a trace."""
    return rep.run.world_size or (len(rep.overlap.per_rank) if rep.overlap else None) or None


def _cost(a: Report, b: Report, price: float) -> Cost:
    def per_billion(rep: Report) -> Optional[float]:
        tps = rep.throughput.job.tokens_per_s if rep.throughput else None
        gpus = _world(rep)
        return price * gpus * (1e9 / tps) / 3600 if tps and gpus else None

    ca, cb = per_billion(a), per_billion(b)
    d = delta(ca, cb, 2)
    note = "" if ca and cb else "tokens/s unknown for " + " and ".join(
        n for n, c in (("A", ca), ("B", cb)) if not c) + " (pass tokens_per_step= to watch())"
    return Cost(gpu_hour_price=price, a=d.a, b=d.b, delta=d.delta, pct=d.pct, note=note)


def _host_shift(a: Side, b: Side, pa: dict[str, float], pb: dict[str, float], changes: list[ConfigChange],
                applied: Iterable[str]) -> str:
    """Where the runs' records time the optimizer step and nothing changed touches it (its job keys, an optimizer
    or offload fix, applied or resolved in B), how far it moved, in words, when at least ``HOST_SHIFT_PCT`` (and
    ``HOST_MIN_MS``): the host ran at another speed (a new-user trial on a loaded host: the optimizer step 29.4 ->
    79.8 ms beside a rewrap); "" otherwise. (optim.before_shard's fix makes an optimizer that stepped stale tensors
    step the model's: 0.1 -> 8.4 ms, read as the host's, its finding resolved in the same comparison: a new-user
    trial.)"""
    resolved = {f.code for f in a.report.findings} - {f.code for f in b.report.findings}
    if a.source != "records" or b.source != "records" or any(c.key in OPTIMIZER_KEYS for c in changes) or \
            any(c.startswith(OPTIMIZER_FIXES) for c in (*applied, *resolved)):
        return ""
    oa, ob = pa.get("optimizer"), pb.get("optimizer")
    if not oa or ob is None or abs(ob - oa) < HOST_MIN_MS or 100 * abs(ob - oa) / oa < HOST_SHIFT_PCT:
        return ""
    return (f"the optimizer step, which this change does not touch, moved {100 * (ob - oa) / oa:+.0f}% too "
            f"({oa:.1f} -> {ob:.1f} ms): the host ran at another speed in the two runs")


def _outside_moved(pa: dict[str, float], pb: dict[str, float], p50: Optional[StepDelta]) -> str:
    """How the time outside the model moved ("32.9 -> 1.4 ms") where it makes most of the step's change; ""
    otherwise, or without the records' phases."""
    oa, ob = pa.get("outside"), pb.get("outside")
    if oa is None or ob is None or p50 is None or not p50.delta:
        return ""
    return f"{oa:.1f} -> {ob:.1f} ms" if (ob - oa) * p50.delta > 0 and abs(ob - oa) >= 0.5 * abs(p50.delta) else ""


# ------------------------------------------------------------------------------------------------ compare
def compare(a: Side, b: Side, *, applied: Iterable[str] = (), gpu_hour_price: Optional[float] = None,
            path_a: str = "", path_b: str = "") -> Comparison:
    """The comparison of run ``b`` against run ``a`` (B − A)."""
    ra, rb = a.report, b.report
    applied = tuple(applied)
    known = [c for c in applied if c in {f.code for f in ra.findings}]  # (an unknown code changes nothing)
    read: set[str] = set()
    changes = config_diff(a, b, read)
    # (--applied: a change the user declares, e.g. one a plain trace cannot show; not one whose gain the step
    # statistics leave out: --applied checkpoint.blocking made host noise "significant: faster", a new-user trial)
    changed = bool(changes or [c for c in known if c not in SHARE_FIXES])
    pa, pb = _phases(a), _phases(b)
    host = _host_shift(a, b, pa, pb, changes, known) if changed else ""
    apart = OTHER_SOURCES if a.source != b.source else HOST_CHANGED if host else ""
    rng = np.random.default_rng(SEED)
    p50 = _step_delta(a.samples, b.samples, 50, rng, changed, apart)
    p90 = _step_delta(a.samples, b.samples, 90, rng, changed, apart)
    summary = step_summary(p50, changed, host, _outside_moved(pa, pb, p50))
    diff = _findings(ra, rb, changes, read, known)
    # (a note's fix too where it predicted something: accum.sync_every_micro_batch and memory.grads_kept as notes,
    # fixed in the loop, read "no configuration change found" with no word of --applied: a new-user trial)
    mine = {f.code: predicted_of(f) for f in ra.findings}
    gone = [f.code for f in sorted(diff.resolved, key=lambda f: f.severity == "info")
            if f.severity != "info" or mine[f.code]["step_ms_after"] is not None
            or mine[f.code]["peak_bytes_after"] is not None]
    if not changed and gone and p50 is not None and p50.pct is not None:
        summary += (f"; A's {', '.join(gone[:3])} {'is' if len(gone) == 1 else 'are'} gone in B: for a fix applied in "
                    f"your loop (which compare cannot read), pass --applied {gone[0]} to check its prediction")
    cmp = Comparison(a=RunSide(path=path_a or ra.run.path, source=a.source, world_size=_world(ra),
                               steps=len(a.samples), unfinished=_unfinished(ra), problems=list(ra.problems)),
                     b=RunSide(path=path_b or rb.run.path, source=b.source, world_size=_world(rb),
                               steps=len(b.samples), unfinished=_unfinished(rb), problems=list(rb.problems)),
                     summary=summary, config=changes, step_p50=p50, step_p90=p90)
    if a.source != b.source:
        cmp.notes.append(f"A's step times come from {a.source}, B's from {b.source}: compare shares, not times")
    for name, side in (("A", cmp.a), ("B", cmp.b)):
        if side.unfinished:  # (a killed run's last steps, or what it was doing when killed, may be in its times)
            # how it ended is its "run ended" line, printed with its problems: named, not guessed at ("killed, still
            # going, or stopped on an exception" beside "rank 1 stopped first, after step 69, ...": a new-user trial)
            told = any(p.endswith(RUN_END_TAIL) for p in side.problems)
            cmp.notes.append(f"{name}: rank{'s' * (len(side.unfinished) > 1)} {', '.join(side.unfinished)} did not "
                             + ("finish (how: its \"run ended\" line)" if told else
                                "finish (killed, still going, or stopped on an exception)")
                             + ": its figures are those of the steps completed")
    for name, rep in (("A", ra), ("B", rb)):
        ls = rep.steps.level_shift if rep.steps is not None else None
        if ls is not None:  # (its samples mix the parts: a delta of p50s reads the mix, not either part)
            cmp.notes.append(
                f"{name}'s step time {ls.drift_verb()} steadily "
                f"({fmt_ms(ls.drift_ms_per_step(), signed=True)} a step: jitter.level_shift): its times mix its early "
                "and late steps" if ls.drift_line else
                f"{name}'s step time changed {shift_at(ls)} and stayed ({fmt_ms(ls.ms_before)} before, "
                f"{fmt_ms(ls.ms_after)} after: jitter.level_shift): its times mix the parts; "
                f"--steps-{name.lower()} {ls.last_from()}- compares its last part alone")
    if cmp.a.world_size and cmp.b.world_size and cmp.a.world_size != cmp.b.world_size:
        cmp.notes.append(f"world size {cmp.a.world_size} in A, {cmp.b.world_size} in B: a step does not do the same "
                         "work on both sides (the job's tokens per step, its collectives' sizes); compare throughput, "
                         "not step times")
    na, nb = getattr(ra.run, "model_param_count", None), getattr(rb.run, "model_param_count", None)
    if isinstance(na, int) and isinstance(nb, int) and na and nb and na != nb:
        # (two different models read "step time p50 -40.1%: faster, significant" with a quarter of the work done: a
        # new-user trial)
        cmp.notes.append(f"A trains a model of {na:,} parameters, B one of {nb:,}: a step does not do the same work "
                         "on both sides; compare throughput, not step times")
    cmp.phases = {k: delta(pa.get(k), pb.get(k)) for k in dict.fromkeys([*pa, *pb])}
    cmp.phases_source = a.source if a.source == b.source else "mixed"
    peak_a, cat_a = _memory(ra)
    peak_b, cat_b = _memory(rb)
    if peak_a is not None or peak_b is not None:
        cmp.memory_peak = delta(peak_a, peak_b, 0)
        # the categories both sides split their peak into (a plain trace's is one figure, "allocated")
        cmp.memory = {k: delta(cat_a[k], cat_b[k], 0) for k in cat_a if k in cat_b}
        act = cmp.memory.get("activations")
        if not changed and act is not None and act.pct is not None and abs(act.pct) >= BATCH_SHIFT_PCT:
            cmp.summary += _activations_moved(a, b, act)
    source = "trace" if ra.overlap is not None and rb.overlap is not None and ra.overlap.per_unit \
        and rb.overlap.per_unit else "records"
    # the headline total beside the rows, where both reports took it from the rows' source (a 1-rank run's records
    # against a 2-rank run's trace read 0 µs against 31.0 ms of trace exposure over rows of recorded waits, under a
    # title saying "from the records": a new-user trial)
    if ra.comm is not None and rb.comm is not None and ra.comm.source == rb.comm.source == source:
        cmp.comm_exposed = delta(ra.comm.exposed_ms_per_step, rb.comm.exposed_ms_per_step)
    ca, cb = _comm(a, source), _comm(b, source)
    alias = same_group({k[0] for k in ca}, {k[0] for k in cb})
    cb = {(alias.get(k[0], k[0]), *k[1:]): v for k, v in cb.items()}
    # (Δ% of each row too: it was "—" on every row but the total's, unexplained; a new-user trial)
    rows = [CommDelta(unit=k[0], collective=k[1], phase=k[2], a_ms=round(ca[k], 3) if k in ca else None,
                      b_ms=round(cb[k], 3) if k in cb else None, delta_ms=round(cb.get(k, 0.0) - ca.get(k, 0.0), 3),
                      pct=round(100 * (cb.get(k, 0.0) - ca[k]) / ca[k], 1) if ca.get(k) else None)
            for k in dict.fromkeys([*ca, *cb])]
    cmp.comm = sorted(rows, key=lambda r: (-abs(r.delta_ms or 0.0), -max(r.a_ms or 0.0, r.b_ms or 0.0)))[:TOP_COMM]
    cmp.comm_rows = len(rows)
    cmp.comm_source = source if rows else ""
    ta = ra.throughput.job if ra.throughput else None
    tb = rb.throughput.job if rb.throughput else None
    if ta is not None or tb is not None:
        # (TFLOP/s as the report keeps them, 4 significant figures: a CPU run's 0.004 read 0 at 2 decimals, and at
        # 4 its Δ% (140.0) was not tokens/s' (141.0): a new-user trial)
        cmp.throughput = {k: delta(getattr(ta, k, None), getattr(tb, k, None), nd)
                          for k, nd in (("tokens_per_s", 2), ("achieved_tflops", 9), ("mfu_pct", 2))
                          if getattr(ta, k, None) is not None or getattr(tb, k, None) is not None}
    cmp.findings = diff
    cmp.predictions = _predictions(a, b, changes, known, p50, peak_a, peak_b)
    cmp.ops = _ops(a, b)
    if gpu_hour_price is not None:
        cmp.cost = _cost(ra, rb, gpu_hour_price)
    for code in applied:
        if code not in {f.code for f in ra.findings}:
            cmp.notes.append(f"--applied {code}: A's report has no such finding, so no prediction to check")
    return cmp


def samples_from_records(run) -> list[list[float]]:
    """Per steady step, every rank's wall time (ms), in step order."""
    from .steps import usable_steps

    by_step: dict[int, list[float]] = {}
    for rd in run.ranks.values():
        for s in usable_steps(rd.steps):
            by_step.setdefault(s.step, []).append(s.wall_ms)
    return [by_step[k] for k in sorted(by_step)]


def peak_input_elements(run, rep: Report) -> Optional[int]:
    """The input elements of the step the report's memory peak fell in, on its rank (StepRecord.input_elements);
    None where not recorded (records before the field, or a plain trace)."""
    r, pr = _peak_rank(rep)
    rd = run.ranks.get(int(r)) if r is not None and str(r).isdigit() else None
    if rd is None or pr.peak_at.step is None:
        return None
    return next((s.input_elements for s in rd.steps if s.step == pr.peak_at.step), None)


def samples_from_ranks(steps_ms: dict[str, list[float]]) -> list[list[float]]:
    """Per step index, every rank's duration (ms) (trace files: the i-th complete step of each rank)."""
    n = max((len(v) for v in steps_ms.values()), default=0)
    return [[v[i] for v in steps_ms.values() if i < len(v) and math.isfinite(v[i])] for i in range(n)]
