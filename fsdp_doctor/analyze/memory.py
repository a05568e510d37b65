"""Memory by category: the report's ``memory`` section, from the probe's per-step ``MemoryStep`` records.

``analyze_memory(run)`` returns a :class:`fsdp_doctor.report_sections.MemorySection` (its fields, their units and
meaning are documented there). Step 0 (FSDP's lazy init, no optimizer state yet) is left out when later steps
exist.
"""

from __future__ import annotations

from statistics import median

import msgspec

from ..memory_categories import DEVICE
from ..records import MemoryStep
from ..report_sections import MemoryPeakAt, MemoryRank, MemorySection, MemoryUnitRow
from ..units import fmt_bytes, unit_label

CATEGORIES = DEVICE
# (a new-user trial's EMA copy of the weights, 162 KiB cloned before the loop and updated in place, +10% of the peak:
# the memory report read the same with and without it)
CPU_UNSEEN = ("On the CPU there is no allocator total to read: these figures are the model's parameters, gradients "
              "and buffers, its optimizer's state, the activations saved for backward and what the step's operators "
              "allocate; tensors the loop holds from before the step (an EMA copy of the weights, a cache, another "
              "model's) are not seen")


def analyze_memory(run) -> MemorySection | None:
    per_rank: dict[str, MemoryRank] = {}
    for r in sorted(getattr(run, "ranks", {}) or {}):
        sec = _rank_section(run.ranks[r])
        if sec is not None:
            per_rank[str(r)] = sec
    if not per_rank:
        return None
    top = max(per_rank, key=lambda k: per_rank[k].peak_bytes)
    cpu = any(m.device == "cpu" for rd in run.ranks.values() for s in rd.steps
              if (m := getattr(s, "memory", None)) is not None)
    return MemorySection(categories=list(CATEGORIES), peak_rank=top, peak_bytes=per_rank[top].peak_bytes,
                         per_rank=per_rank, unseen=CPU_UNSEEN if cpu else "")


def _rank_section(rd) -> MemoryRank | None:
    steps = [s for s in rd.steps if getattr(s, "memory", None) is not None and s.memory.peak is not None]
    if not steps:
        return None
    if len(steps) > 1:
        steps = [s for s in steps if s.step != 0] or steps
    # the highest peak; on a tie prefer a full step (measured, with its timeline), then the earliest
    best = max(steps, key=lambda s: (int(s.memory.peak.bytes), s.memory.sampling != "replayed", -s.step))
    m = best.memory
    pk = m.peak
    bd = {c: int(pk.breakdown.get(c, 0) or 0) for c in _cats(m)}
    peak = sum(bd.values())
    cfg = getattr(rd, "config", None)
    cap = getattr(cfg, "capacity_bytes", None)
    tl_step = _timeline_step(steps, best)
    out = MemoryRank(
        peak_bytes=peak,
        peak_at=MemoryPeakAt(step=best.step, unit=pk.unit, phase=pk.phase, t_ms=pk.t_ms),
        peak_breakdown=bd,
        peak_share={c: (v / peak if peak else 0.0) for c, v in bd.items()},
        offloaded_host_bytes=int(m.offloaded_host or 0),
        activations_peak_bytes=_activation_peak(steps),
        capacity_bytes=cap,
        capacity_fraction=(peak / cap) if cap else None,
        steady_bytes=_between_steps(tl_step),
        stale_optimizer_params_bytes=bd.get("stale_optimizer_params", 0),
        steps=len(steps),
        full_steps=sum(1 for s in steps if s.memory.sampling == "full"),
        activations=m.activations,
        probe_us_median=median(float(s.memory.probe_us) for s in steps),
        timeline_step=tl_step.step if tl_step is not None else None,
        timeline=timeline_rows(tl_step.memory) if tl_step is not None else [],
        per_unit=_per_unit(cfg, steps),
    )
    if m.cuda is not None:
        out.cuda = msgspec.to_builtins(m.cuda)
    unknown = sorted({c for s in steps for c in s.memory.unknown})
    if unknown:  # not measurable on this torch: their 0 in the breakdown is not a figure
        out.unknown_categories = unknown
    notes = sorted({n for s in steps for n in (s.memory.activations_note, s.memory.comm_note) if n})
    selective = {u.name for u in getattr(cfg, "units", None) or [] if getattr(u, "checkpoint_selective", False)}
    recomputed = _recomputed_at_peak(out, selective)
    if recomputed:
        notes.append(recomputed)
    ut = getattr(cfg, "untrained", None)
    if ut is not None and ut.tensors and ut.changed:  # (a new-user trial's second optimizer: its state uncounted)
        notes.append(f"optimizer state is the watched optimizer's ({cfg.optimizer}): {ut.tensors} trainable "
                     f"parameter(s) ({ut.param_count:,} elements) outside it change between steps, stepped by another "
                     "optimizer or the loop, whose state (momentum, moments) is not counted as optimizer state")
    if notes:
        out.notes = notes
    casts = [s for s in steps if s.memory.autocast]
    if casts or any(s.memory.v >= 2 for s in steps):  # ("": read, and no autocast; unset: not read)
        out.autocast = casts[-1].memory.autocast if casts else ""
    copied = [s for s in steps if s.memory.cast_copies is not None]
    if copied:
        cc = tl_step if tl_step is not None and tl_step.memory.cast_copies is not None else copied[-1]
        out.cast_copies = msgspec.to_builtins(cc.memory.cast_copies)
        if cc is not tl_step:
            out.cast_copies.pop("rows", None)  # they run along another step's timeline
    mism = sum(int(s.memory.replay_mismatches or 0) for s in steps)
    if mism:
        out.replay_mismatches = mism
    return out


def _cats(m: MemoryStep) -> list[str]:
    cats = list(m.categories or CATEGORIES)
    for c in m.peak.breakdown if m.peak is not None else ():
        if c not in cats:
            cats.append(c)
    return cats


def _activation_peak(steps) -> int:
    best = 0
    for s in steps:
        m = s.memory
        best = max(best, int((m.peak.breakdown.get("activations", 0) if m.peak is not None else 0) or 0),
                   m.activations_high)
        tl = m.timeline
        if tl is not None and "activations" in tl.columns:
            i = tl.columns.index("activations")
            best = max([best] + [int(row[i] or 0) for row in tl.rows])
    return best


def _timeline_step(steps, best):
    if best.memory.timeline is not None:
        return best
    earlier = [s for s in steps if s.memory.timeline is not None and s.step <= best.step]
    if earlier:
        return earlier[-1]
    later = [s for s in steps if s.memory.timeline is not None]
    return later[0] if later else None


def _between_steps(step) -> dict[str, int]:
    """What stays allocated between steps: the categories at a step's first mark, before its forward (after the
    loop's zero_grad, wherever the loop calls it), of a step after the first; {} where no such mark is at hand (no
    timeline, one step only, or a timeline that begins inside a compiled forward). Not ``MemoryStep.end``, the mark
    after optimizer.step(): it holds the gradients zero_grad() frees next (a new-user trial's "steady state" counted
    326 KiB of gradients in 1.40 MiB with optimizer.zero_grad(), as much as with zero_grad(set_to_none=False))."""
    tl = step.memory.timeline if step is not None and step.step > 0 else None
    if tl is None or not tl.rows or not str(tl.rows[0][2] or "").startswith("forward"):
        return {}
    return {c: int(v or 0) for c, v in zip(tl.columns[3:], tl.rows[0][3:])}


def timeline_rows(m: MemoryStep) -> list[dict]:
    """A step's memory timeline as rows keyed by its columns ("t_ms", "unit", "phase", the categories), each with
    its ``total``; [] without one."""
    cols = m.timeline.columns if m.timeline is not None else []
    out = []
    for row in m.timeline.rows if m.timeline is not None else ():
        d = dict(zip(cols, row))
        d["total"] = sum(int(d.get(c, 0) or 0) for c in cols[3:])
        out.append(d)
    return out


def _latest(steps, field: str) -> dict[str, int]:
    """A per-unit figure of the latest step that has it (full steps only record them), of one without forwards in
    eval mode with autograd on where there is one: those add their graphs' activations to the units' (a new-user
    trial's layers read 1.08 MiB each, four evaluation forwards' worth, for 275.5 KiB of a training forward)."""
    for clean in (True, False):
        for s in reversed(steps):
            got = getattr(s.memory, field)
            if got and (not clean or not getattr(s, "autograd_eval_forwards", 0)):
                return {k: int(v) for k, v in got.items()}
    return {}


def recompute_held(row: MemoryUnitRow | None, selective: bool) -> int:
    """Bytes a checkpointed unit's recompute holds for its backward: what it saved (``recompute_saved_bytes``) and,
    under selective checkpointing, what its forward's cache handed it (the policy's saves: its forward's saved bytes
    beyond its inputs), which the cache no longer holds once taken. 0 where unknown."""
    if row is None:
        return 0
    saved = row.recompute_saved_bytes if row.recompute_saved_bytes is not msgspec.UNSET else 0
    if selective and row.activation_bytes and row.input_bytes is not msgspec.UNSET:
        saved = (saved or 0) + max(0, row.activation_bytes - row.input_bytes)
    return int(saved or 0)


def _recomputed_at_peak(rank: MemoryRank, selective: set[str] = frozenset()) -> str:
    """Where the peak falls in the backward of a unit whose forward activation checkpointing recomputes: the
    recomputed activations it holds are counted as temporaries (they are no saved activations of the forward), and
    the line says up to how much of the temporaries they are (:func:`recompute_held`, at most the temporaries).
    Without it a new-user trial read 6.23 MiB of "temporaries" at the peak of an HF model under
    gradient_checkpointing_enable() and went hunting for operator temporaries: 4.01 MiB of it was the recompute; under
    selective checkpointing the line counted only what the recompute made, not the cached outputs it took (256 of
    512 KiB: another trial)."""
    at = rank.peak_at
    if at.unit is None or "backward" not in (at.phase or ""):
        return ""
    saved = recompute_held(next((u for u in rank.per_unit if u.unit == at.unit), None), at.unit in selective)
    temps = rank.peak_breakdown.get("temporaries", 0)
    if not saved or not temps:
        return ""
    how = "selective activation checkpointing" if at.unit in selective else "activation checkpointing"
    return (f"the peak is in {unit_label(at.unit)}'s backward, which recomputes its forward ({how}): up to "
            f"{fmt_bytes(min(saved, temps))} of the {fmt_bytes(temps)} of temporaries at the peak are its recomputed "
            "activations")


def _per_unit(cfg, steps) -> list[MemoryUnitRow]:
    acts = _latest(steps, "unit_activations")
    own = _latest(steps, "unit_activations_own") if acts else {}
    inputs = _latest(steps, "unit_inputs") if acts else {}
    recomputed = _latest(steps, "unit_recompute_saved")
    units = list(getattr(cfg, "units", None) or [])
    rows = []
    names = [u.name for u in units] or list(acts)
    children: dict[str, list[str]] = {}
    for u in units:
        if u.parent is not None:
            children.setdefault(u.parent, []).append(u.name)
    by_name = {u.name: u for u in units}
    for name in names:
        u = by_name.get(name)
        a = acts.get(name)
        row = MemoryUnitRow(
            unit=name,
            sharded_bytes=int(u.sharded_bytes) if u is not None and u.sharded_bytes is not None else None,
            unsharded_bytes=int(u.unsharded_bytes) if u is not None and u.unsharded_bytes is not None else None,
            activation_bytes=a)
        if any(c not in acts and getattr(by_name.get(c), "compiled_in_place", False) for c in children.get(name, [])):
            pass  # a nested unit's saves unknown (compiled in place: its hooks do nothing in the frame), which the
            # parent's "own" then held: unknown too (blocks compiled in place read the root's own 2.14 MiB of 2.14 MiB,
            # against 130 KiB where the blocks were compiled before sharding: a new-user trial). A nested unit that
            # did not run in that step (an MoE expert no token reached) saved nothing: the parent's own is measured
            # (it read "—", a new-user trial)
        elif name in own:  # measured: the saves no unit nested in its forward made
            row.activation_self_bytes = own[name]
        elif a is not None:  # (older runs) its figure less its children's, unknown where they ran outside it
            rest = a - sum(acts.get(c, 0) for c in children.get(name, []))
            if rest >= 0:
                row.activation_self_bytes = rest
        if name in inputs:
            row.input_bytes = inputs[name]
        if name in recomputed:
            row.recompute_saved_bytes = recomputed[name]
        rows.append(row)
    return rows
