"""Activation-checkpointing rules: recommended when activations push the peak to capacity, unneeded when
memory is ample, on fewer units where memory has room for some, and applied at the wrong granularity (a block's
children instead of the block)."""

from __future__ import annotations

from typing import Optional

from msgspec import UNSET

from .. import estimate as E
from .. import snippets as S
from .. import thresholds as T
from ..base import Context, Rule, register
from ...units import fmt_bytes, fmt_share

# Checkpointing is worth its recompute when the peak is at least this share of capacity ...
AC_NEAR_CAPACITY = T.NEAR_CAPACITY_SHARE
# ... and activations are at least this share of the peak (otherwise it is not what fills memory).
AC_ACT_SHARE_MIN = T.DOMINANT_CATEGORY_SHARE
# Checkpointing is unneeded when the peak is below this share of capacity: even without it the peak
# stays clear of the capacity (the estimate below checks the un-checkpointed peak too).
AC_UNNEEDED_MAX_SHARE = 0.50
# ac.fewer_units and ac.unneeded aim the peak under this share of capacity: below ac.recommended's
# (NEAR_CAPACITY_SHARE), so that a run either leaves at its aim is no case for checkpointing more, nor one of
# ac.recommended's fixes a case for less
AC_FEWER_TARGET_SHARE = T.HEADROOM_MAX_SHARE
# Recompute below this share of the step is not worth a warning.
AC_RECOMPUTE_WARN_SHARE = 0.05

#: how a rule knows what a checkpointed unit's forward would keep saved without checkpointing
MEASURED = "measured in the recompute"
ESTIMATED = f"estimated: {E.SAVED_PER_INPUT:g}x the checkpoint input"


def _added_without_checkpointing(ctx: Context, ck: list[E.Unit], pm) -> tuple[dict[str, int], Optional[str]]:
    """Per checkpointed unit, the bytes its forward would keep saved without checkpointing on top of what it keeps
    now, per forward/backward pair, and how that is known. Measured: the recompute runs the checkpointed forward
    again inside backward and saves exactly what the un-checkpointed forward would have kept (the memory probe
    counts what each recompute creates and still holds when it ends, ``recompute_saved_bytes``; the step's sum,
    divided by the unit's backwards in the peak step's timeline). Else (plain traces, no counted step) estimated:
    ``SAVED_PER_INPUT - 1`` times what the unit keeps now, its input: a transformer layer's ratio."""
    mem = E.memory_units(ctx)
    rows = [mem[u.name] for u in ck if u.name in mem]
    if any(r.recompute_saved_bytes is not UNSET for r in rows):
        tl = pm.timeline if pm is not None else []

        def backwards(name: str) -> int:
            return max(1, sum(1 for r in tl if r.get("unit") == name and r.get("phase") == "backward_start"))

        return {r.unit: int(r.recompute_saved_bytes or 0) // backwards(r.unit) for r in rows}, MEASURED
    per_unit = _unit_activations(ctx, ck)
    if not per_unit:
        return {}, None
    return {u: int(b * (E.SAVED_PER_INPUT - 1)) for u, b in per_unit.items()}, ESTIMATED


def _peak_with(pm, extra: dict[str, int], held: Optional[dict[str, int]] = None,
               regather: Optional[dict[str, int]] = None, order: Optional[list[str]] = None) -> int:
    """The peak with each unit's saved activations changed by ``extra`` (bytes, per forward/backward pair):
    without checkpointing (ac.unneeded: what the unit would keep on top of what it keeps now) or with it
    (ac.recommended: negative, what it would no longer keep). The change lives from the unit's forward's end to its
    backward's start, once per forward/backward pair of the peak step's timeline (from its backward's start on,
    both runs hold the activations: checkpointing recomputes them there, which the high-water between marks
    measures), so the peak can move; the new peak is the highest mark. Without a timeline the change is taken at
    the peak, flat (on the reference GPT with every block checkpointed, 2 ranks: 15% over for ac.unneeded;
    from the timeline with the recompute's measurement 16,916,700 B, as measured without checkpointing).

    ``held`` (ac.recommended: per unit to checkpoint, its activations): inside the unit's backward the recompute
    keeps what it recomputed until that backward ends, where the un-checkpointed backward frees each saved tensor
    as soon as its node has run; the activations the timeline shows freed there are added back, up to the unit's.
    (A Qwen2 whose last block alone trains: predicted at the old backward high-water, 2,545,404 B; measured
    2,807,804 B; the same +262,656 B at that block's backward without FSDP, one process.)

    ``regather`` (per unit, its unsharded parameter bytes): the checkpoint wraps the unit from outside (the
    wrapper around the sharded layer, as accelerate's FSDP2 plugin applies it), so the recompute runs the unit's
    forward hooks and all-gathers its parameters again while its backward holds them (transformers' "redundant
    AllGather"): that much more inside the unit's backward. (accelerate's Llama, width 128: predicted 10,046,172 B
    without it, 10,637,020 B with it; measured 11,098,844 B.)

    A unit compiled in place has no forward marks (the doctor's hooks inside it return at once; its backward's,
    FSDP's, are there): its change starts at the first forward mark of a unit after it in ``order`` (the units in
    forward order). A unit with no backward mark either is taken at the peak, flat."""
    tl = pm.timeline if pm is not None else []
    if not tl:
        return int(pm.peak_bytes) + int(sum(extra.values()))
    added = [0.0] * len(tl)
    flat = 0  # units the timeline does not show at all
    pos = {n: i for i, n in enumerate(order or [])}  # forward order
    for name, b in extra.items():
        ends, backs = E.phase_rows(tl, name, "forward_end"), E.phase_rows(tl, name, "backward_start")
        blind = not ends and bool(backs) and name in pos
        if blind:  # compiled in place: from the next unit's forward on
            nxt = next((i for i, r in enumerate(tl) if pos.get(r.get("unit"), -1) > pos[name]
                        and r.get("phase") in ("forward_start", "forward_end")), None)
            ends = [nxt] if nxt is not None and nxt < backs[0] else []
        if not ends or not backs:
            flat += b  # taken at the peak, as without a timeline
            continue
        for fe, be in zip(ends, backs):
            # (a unit compiled in place has no mark inside its backward: its backward_start, FSDP's pre-backward,
            # comes before its recompute, so the change holds there too)
            for i in range(fe, be + 1 if blind else be):
                added[i] += b
            if held and name in held:  # the unit's backward marks, from its start, its nested units' among them
                # (whose backward runs inside it: a U-Net's up block holding the plugin's nested units, its recompute
                # held through theirs)
                act0, i = int(tl[be].get("activations") or 0), be
                while i < len(tl) and _within_backward(tl[i], name):
                    added[i] += min(held[name], max(0, act0 - int(tl[i].get("activations") or 0)))
                    added[i] += (regather or {}).get(name, 0)
                    i += 1
    return E.peak_with_rows(pm, added) + flat


def _within_backward(row: dict, name: str) -> bool:
    """A timeline mark inside unit ``name``'s backward before its end: its own backward_start and in_backward marks,
    and any backward mark of a unit nested inside it (an fqn under its own)."""
    unit, phase = row.get("unit"), row.get("phase")
    if unit == name:
        return phase in ("backward_start", "in_backward")
    return bool(name) and str(unit).startswith(name + ".") and phase in ("backward_start", "in_backward",
                                                                          "backward_end")


def _unit_activations(ctx: Context, us: list[E.Unit]) -> dict[str, int]:
    """Activation bytes per unit from the memory section; without per-unit figures, the peak's activations
    spread evenly over the given units. A unit with no figure where others have one (compiled in place: the
    doctor's hooks inside return at once, and the root's figure holds its) gets what its backward freed in the
    peak step's timeline; without those marks, such units share evenly what the outermost units with a figure
    leave of the peak's activations."""
    mem = E.memory_units(ctx)
    got = {u.name: int(mem[u.name].activation_bytes or 0) for u in us if u.name in mem}
    blind = [u.name for u in us if u.name in mem and mem[u.name].activation_bytes is None]
    pm = E.peak_memory(ctx)
    for n in list(blind):  # what its backward freed: its saved activations (its own; FSDP's hooks mark it)
        freed = _backward_freed(pm.timeline if pm is not None else [], n)
        if freed is not None:
            got[n] = freed
            blind.remove(n)
    if blind and any(got.values()):
        named = [n for n in mem if n]  # the non-root units
        outer = [n for n in named if mem[n].activation_bytes is not None
                 and not any(n.startswith(o + ".") for o in named if o != n)]
        rest = (E.breakdown(ctx).get("activations") or 0) - sum(int(mem[n].activation_bytes) for n in outer)
        got.update({n: max(0, int(rest)) // len(blind) for n in blind})
    if any(got.values()):
        return got
    acts = E.breakdown(ctx).get("activations")
    if not acts or not us:
        return {}
    return {u.name: int(acts / len(us)) for u in us}


def _backward_freed(tl: list[dict], name: str) -> Optional[int]:
    """The activations unit ``name``'s first backward freed in the peak step's timeline (its backward_start
    mark's less its backward_end's), or None without both marks."""
    start = next((r for r in tl if r.get("unit") == name and r.get("phase") == "backward_start"), None)
    end = next((r for r in tl if r.get("unit") == name and r.get("phase") == "backward_end"), None)
    if start is None or end is None or start.get("activations") is None or end.get("activations") is None:
        return None
    return max(0, int(start["activations"]) - int(end["activations"]))


def _checkpointed(ctx: Context) -> list[E.Unit]:
    """The checkpointed units: those with parameters, then the root(s)."""
    return ([u for u in E.non_root(E.param_units(ctx)) if u.checkpoint != "none"]
            + [u for u in E.roots(E.units(ctx)) if u.checkpoint != "none"])


def _checkpointed_under_budget(rule: Rule, ctx: Context) -> Optional[tuple[list[E.Unit], int, int]]:
    """(the checkpointed units, the peak, capacity); None, the rule's reason why quiet said, without either."""
    ck = _checkpointed(ctx)
    if not ck:
        return rule.quiet("no unit is checkpointed") or None
    peak, cap = E.peak_bytes(ctx), E.capacity_bytes(ctx)
    if not peak or not cap:
        return rule.skip(E.no_peak_or_capacity(ctx, peak, cap)) or None
    return ck, peak, cap


def _recompute_ms(u: E.Unit) -> float:
    """A checkpointed unit's recompute per step: measured, else its forward compute (0: not timed; a selective
    checkpoint re-runs only what its policy did not save, a share of the forward no record tells)."""
    if u.timing.recompute_ms > 0 or _selective(u):
        return u.timing.recompute_ms
    return E.compute_fwd_ms(u)


def _selective(u: E.Unit) -> bool:
    return bool(getattr(u, "checkpoint_selective", False))


def _selective_beyond_inputs(ctx: Context) -> tuple[list[E.Unit], dict[str, int]]:
    """(the units that checkpoint selectively, what each keeps beyond its inputs where a full memory step counted
    them): the policy's saved outputs (the memory probe counts selective checkpointing's cache as the unit's
    activations), which full checkpointing recomputes instead."""
    sel = [u for u in E.non_root(E.param_units(ctx)) if u.checkpoint != "none" and _selective(u)]
    per_unit, mem = _unit_activations(ctx, sel), E.memory_units(ctx)
    return sel, {u.name: max(0, per_unit.get(u.name, 0) - int(mem[u.name].input_bytes)) for u in sel
                 if u.name in mem and mem[u.name].input_bytes is not UNSET}


def _selective_saves(ctx: Context) -> str:
    """Where units checkpoint selectively, what their policy saves beyond their inputs (a forward's worth, from a
    full memory step), which full checkpointing would not keep: the lever left when every unit is checkpointed (a
    new-user trial's selective blocks at 96% of capacity, quiet without a word of it)."""
    sel, saves = _selective_beyond_inputs(ctx)
    if not sum(saves.values()):
        return ""
    return (f" ({len(sel)} selectively: what their policy saves beyond their inputs, {fmt_bytes(sum(saves.values()))} "
            "a forward, full checkpointing would recompute instead: ac.selective_to_full)")


def _reruns(ck: list[E.Unit]) -> str:
    """What checkpointing the units re-runs in backward, said for selective checkpointing as it is."""
    if all(_selective(u) for u in ck):
        return f"Selective checkpointing re-runs the operators its policy does not save in {len(ck)} unit(s)"
    return f"Checkpointing re-runs the forward of {len(ck)} unit(s)"


def _blocks_inside(u: E.Unit) -> list[str]:
    """The repeated blocks (``layers.3``) whose parameters the unit holds, besides the unit's own modules (the root
    of a model whose blocks are no units holds them all); [] for a block's own unit."""
    own = {S.strip_ckpt(m) for m in (u.modules or [u.name])}
    return sorted({b for m in (u.own_modules or []) if (b := S.block_of(m)) is not None and b not in own})


def _blocks_owner(ctx: Context, holders: list[E.Unit]) -> str:
    """The rule that says units hold whole blocks: wrap.params_in_root where the root holds them beside other units
    (its case), else wrap.too_coarse (the root the only unit, or a unit below it holding several blocks)."""
    others = E.non_root(E.param_units(ctx))
    return "wrap.params_in_root" if others and all(u.is_root for u in holders) else "wrap.too_coarse"


def _blocks_of(u: E.Unit) -> list[str]:
    """The blocks ac.wrong_granularity checkpoints whole for unit ``u``: its own modules; a root's, the blocks its
    CheckpointWrappers lie in (the root itself cannot be wrapped in place, nor does apply_activation_checkpointing
    wrap it); else its name."""
    own = [m for m in u.modules if m]
    blocks = [b for b in (S.block_of(w) for w in u.checkpoint_wrappers) if b is not None]
    return own or blocks or [u.name]


def _wrappers(us: list[E.Unit]) -> tuple[list[str], list[str]]:
    """(the CheckpointWrappers of the units, fqns; the checkpointed units that have none: checkpoint(...) calls)."""
    wrappers = [w for u in us for w in u.checkpoint_wrappers]
    functional = [u.name for u in us if not u.checkpoint_wrappers]
    return wrappers, functional


def _uncheckpointed_stats(ctx: Context, us: list[E.Unit]) -> tuple[list[str], bool]:
    """(the modules keeping running statistics that turning the units' checkpointing off no longer re-runs: inside
    their CheckpointWrappers, or the whole unit where it checkpoints itself (a checkpoint(...) call around it,
    transformers' flag); whether some of them are only possibly so: a unit's checkpoint(...) calls on some of its
    children, which the records do not name, cover some of that unit's (a new-user trial's ResNet stages checkpointing
    their blocks so: 14 BatchNorms updated twice, no word said))."""
    sure = E.running_stats_under(E.units(ctx), [w for u in us for w in u.checkpoint_wrappers]
                                 + [m for u in us if not u.checkpoint_wrappers and u.checkpoint == "unit"
                                    for m in u.modules or [u.name]])
    maybe = E.running_stats_under(E.units(ctx), [m for u in us if not u.checkpoint_wrappers
                                                 and u.checkpoint in ("children", "partial")
                                                 for m in u.modules or [u.name]], but=sure)
    return sure + [n for n in maybe if n not in sure], bool(maybe)


def _running_stats(names: list[str], on: bool, lead: str = "Checkpointed,", now: str = "", up_to: bool = False) -> str:
    """The sentence of a fix changing which modules are checkpointed, where that changes how often the modules
    keeping running statistics (BatchNorm) among them are updated: the recompute runs them in training mode, so
    checkpointed they are updated twice per step (a new-user trial's ResNet: buffer checksum 792.65 -> 844.52 with
    checkpointing on, parameters identical). ``lead``, ``now``: the words before and after the layers' where a fix
    checkpoints only some of them anew (ac.wrong_granularity's blocks). ``up_to``: some are only possibly among them
    (checkpoint(...) calls of the user's code cover which, the records do not say)."""
    if not names:
        return ""
    said = (", ".join(names[:2]) + f" and {len(names) - 2} more" if len(names) > 3
            else " and ".join([", ".join(names[:-1]), names[-1]]) if len(names) > 1 else names[0])
    n = (f"{'up to ' if up_to else ''}{len(names)} normalization layer(s) with running statistics{now} ({said}"
         + ("; those your checkpoint(...) calls cover" if up_to else "") + ")")
    if on:
        return (f" {lead} {n} run again in the recompute, in training mode: their running statistics are "
                "updated twice per step, which changes the statistics evaluation uses.")
    return (f" {n[0].upper()}{n[1:]} run again in the recompute now, in training mode, updating their running "
            "statistics twice per step; without checkpointing that second update ends, so the statistics evaluation "
            "uses will differ from the checkpointed runs'.")


@register
class AcRecommended(Rule):
    code = "ac.recommended"
    name = "Activation checkpointing recommended"
    description = "Activations dominate a peak that is near or above capacity."
    needs = ("memory",)
    severities = ("warning", "critical")

    def match(self, ctx: Context):
        peak, cap = E.peak_bytes(ctx), E.capacity_bytes(ctx)
        if not peak or not cap:
            return self.skip(E.no_peak_or_capacity(ctx, peak, cap))
        share = peak / cap
        bd = E.breakdown(ctx)
        acts = bd.get("activations") or 0
        if why := E.below_budget(ctx, peak, cap, AC_NEAR_CAPACITY):  # (what optim.before_shard's fix gives back aside)
            return self.quiet(why)
        dominant = acts / peak >= AC_ACT_SHARE_MIN
        cands = [u for u in E.non_root(E.param_units(ctx)) if u.checkpoint == "none"]
        per_unit = _unit_activations(ctx, cands)
        cands = [u for u in cands if per_unit.get(u.name, 0) > 0]
        if not cands:
            return self.quiet((E.below_share("activations", acts, peak, "the peak", AC_ACT_SHARE_MIN) if not dominant
                               else "no unit left to checkpoint: every one with activations is checkpointed")
                              + _selective_saves(ctx))
        # the target on this run's timeline: higher by what optim.before_shard's fix gives back (its stale tensors
        # are no activations to checkpoint away)
        stale = E.stale_offset(ctx)
        pm, target = E.peak_memory(ctx), E.TARGET_CAPACITY_SHARE * cap + stale

        lever = E.plugin_lever(ctx)  # accelerate's FSDP2 plugin checkpoints every layer it shards, or none
        titan = E.torchtitan_version(ctx)  # torchtitan's config checkpoints every block, or none
        titan_code = S.titan_settings(titan, activation_checkpoint="full") if titan is not None else None

        # what a checkpointed unit keeps of its forward: its inputs, where a full memory step counted them (a conv
        # block keeps about a quarter of its activations; a transformer layer's 1/16, assumed, predicted 12.80 MiB
        # where checkpointing a ResNet-like net measured 13.55: a new-user trial), else the 1/16
        mem = E.memory_units(ctx)
        inputs = {c.name: int(mem[c.name].input_bytes) for c in cands
                  if c.name in mem and mem[c.name].input_bytes is not UNSET}

        def kept(name: str) -> int:
            return min(per_unit[name], inputs[name]) if name in inputs else int(per_unit[name] / E.SAVED_PER_INPUT)

        def peak_with(chosen):
            return _peak_with(pm, {c.name: -(per_unit[c.name] - kept(c.name)) for c in chosen},
                              {c.name: per_unit[c.name] for c in chosen},
                              # (accelerate wraps the sharded layer: its recompute gathers again; torchtitan
                              # shards the wrapper, as a fix of the user's own does)
                              {c.name: int(c.unsharded_bytes or 0) for c in chosen} if lever else None,
                              [u.name for u in E.units(ctx)])

        if lever or titan_code:
            # the plugin checkpoints every module its policy shards, by class, nested ones too (a diffusers U-Net's
            # _no_split_modules names its up blocks and the resnets and transformer blocks inside them: the rule
            # counted the 5 units that are blocks of the tree, "peak <= 139.11 MiB" and 222.6 ms, where the plugin's
            # checkpointing of all 32 measured 51.22 MiB and +410 ms; a new-user trial)
            chosen = (_policy_units(ctx, cands) if lever else None) or [
                u for u in cands if S.strip_ckpt(u.name) == S.block_of(u.name)]
            if not chosen:
                return self.quiet(("no layer of accelerate's FSDP2 plugin (a repeated block) is left to checkpoint"
                                   if lever else "no block of torchtitan's model is left to checkpoint")
                                  + _selective_saves(ctx))
            peak_after = peak_with(chosen)
        else:
            # checkpoint the largest activation holders first until the peak is under the target
            cands.sort(key=lambda u: -per_unit[u.name])
            # the peak moves: a checkpointed unit keeps only its input until its backward, where its recompute
            # holds its activations again; so each choice is judged on the peak step's timeline (the saving at the
            # old peak, flat, was 41% under the measured peak on the reference GPT at 8 sequences per rank)
            chosen, peak_after = [], peak
            for u in cands:
                if chosen and peak_after <= target:
                    break
                chosen.append(u)
                peak_after = peak_with(chosen)
        # activations under the share they dominate from: checkpointing is still the lever where it alone brings the
        # peak under the target (on CUDA the peak also holds the loss's fp32 logits and the allocator's temporaries:
        # the 2-rank H100 GPT at 8 sequences first recorded 369 of 925 MiB activations at the peak, 39.9%, with the
        # previous row's model still allocated, and checkpointing two of its four blocks predicted at 816 MiB against
        # an 828 MiB target; the fixture recorded since holds 45.5% of 811.5 MiB: tests/test_gpu_fixtures.py)
        if not dominant and peak_after > target:
            return self.quiet(_short_of_target(acts, peak, peak_after - stale, cap,
                                               f"checkpointing {len(chosen)} unit(s)"
                                               + (" and optim.before_shard's fix" if stale else "")))
        saved = peak - peak_after
        # their forward compute; none timed: inside a module compiled in place, where the doctor's hooks return at once
        # (a unit inside another one chosen re-runs in that one's recompute, up to where it stops early, and again in
        # its own: not counted twice, the U-Net's 31 units under the plugin 1.30 -> 1.80 s predicted so, 1.71
        # measured, 1.96 counted twice)
        recompute = sum(E.compute_fwd_ms(u) for u in chosen) or None
        step = E.step_ms(ctx)
        sev = "critical" if peak - stale >= cap else "warning"  # (over capacity once optim.before_shard's fix is in)
        # checkpoint the blocks themselves, in forward order
        order = {u.name: i for i, u in enumerate(E.units(ctx))}
        chosen.sort(key=lambda u: order.get(u.name, 0))
        mods = [m for u in chosen for m in u.modules]
        stats = E.running_stats_under(E.units(ctx), mods)
        return [self.finding(
            sev, f"Activations are {fmt_share(acts / peak)} of a peak at {fmt_share(share)} of capacity: "
                 f"checkpoint {len(chosen)} block(s)",
            {"peak_bytes": peak, "capacity_bytes": cap, "peak_share_of_capacity_pct": round(100 * share, 1),
             "activation_bytes": acts, "activation_share_pct": round(100 * acts / peak, 1),
             "fires_because": (f"activations are {100 * AC_ACT_SHARE_MIN:.0f}% of the peak or more" if dominant else
                               f"checkpointing brings the peak under {100 * E.TARGET_CAPACITY_SHARE:.0f}% of capacity"),
             "blocks_to_checkpoint": [u.name for u in chosen], "memory_saved_bytes": int(saved),
             "activation_source": ("measured saved activations; a checkpointed unit keeps its inputs (measured)"
                                   if all(u.name in inputs for u in chosen) else
                                   f"measured saved activations; a checkpointed unit keeps 1/{E.SAVED_PER_INPUT:g} "
                                   "of them (its input: estimated)"),
             "recompute_ms_added": None if recompute is None else round(recompute, 3), "step_p50_ms": step,
             **({"running_stats_layers": stats} if stats else {})},
            f"Saved activations fill {fmt_bytes(acts)} of the {fmt_bytes(peak)} peak (capacity "
            f"{fmt_bytes(cap)}). Checkpointing {len(chosen)} block(s) keeps only their inputs and recomputes "
            f"their forward in backward: about {fmt_bytes(saved)} less at the peak for "
            + (f"~{recompute:.1f} ms more per step (their forward compute). " if recompute is not None else
               "their forward compute more per step (not measured: the blocks run in a compiled frame, where the "
               "doctor's hooks do not time them). ")
            + (f"{S.plugin_says(lever)[0]}, FSDP's own checkpointing (the plugin's activation_checkpointing, which "
               "transformers advises under FSDP) checkpoints every layer the plugin shards: all "
               f"{len(chosen)} here." if lever else
               f"{S.titan_says(titan)}: its activation checkpointing wraps every block, all {len(chosen)} here, "
               "and full checkpointing keeps only their inputs (selective, its default, keeps some operators' "
               "outputs and saves less)." if titan_code else
               "Apply checkpointing to whole blocks, before fully_shard.")
            + (f" The peak also holds {fmt_bytes(stale)} that optim.before_shard's fix gives back (the stale "
               "parameters the optimizer keeps and the gradients it never zeroes, less the state it then creates): "
               f"with both fixes it comes to about {fmt_bytes(peak_after - stale)}, "
               f"{fmt_share((peak_after - stale) / cap)} of capacity." if stale else "")
            + _over_budget(peak_after - stale, cap, bd) + _running_stats(stats, on=True)
            # (the plugin's fix turns the KV cache off too: a new-user trial's Llama held both layers' keys and
            # values, 1.1 MiB, at its peak without checkpointing; pasted, 9,523,932 B against 10,637,020 predicted)
            + (" The fix also turns off the Hugging Face KV cache (use_cache), which the plugin's checkpointing "
               "leaves on (each recompute would append its keys and values to it again): where the run held the "
               "cache at its peak, the peak falls that much further, so the figure is a ceiling."
               if lever and _kv_cache(ctx) else ""),
            S.plugin_checkpointing(True, lever, kv_cache=_kv_cache(ctx)) if lever else
            titan_code or S.checkpoint_modules(mods, "checkpoint whole blocks", kv_cache=_kv_cache(ctx)),
            where=lever or ("torchtitan" if titan_code else ""),
            predicted=E.predicted(step, step + recompute if step is not None and recompute is not None else None,
                                  peak, peak_after, peak_at_most=bool(lever)),
            units=[u.name for u in chosen])]


def _policy_units(ctx: Context, cands: list[E.Unit]) -> list[E.Unit]:
    """Of ``cands``, the units accelerate's plugin made by its transformer-based policy, whose checkpointing
    (activation_checkpointing=True) wraps every module that policy shards: those whose class the model's
    _no_split_modules names (UnitConfig.module_classes; none in runs recorded before it)."""
    classes = set(getattr(ctx.config, "no_split_modules", None) or [])
    return [u for u in cands if classes & set(u.module_classes)]


def _short_of_target(acts: int, peak: int, peak_after: int, cap: int, lever: str) -> str:
    """Why a checkpointing rule is quiet where activations do not dominate the peak and its lever leaves the peak
    over the target share of capacity."""
    return (E.below_share("activations", acts, peak, "the peak", AC_ACT_SHARE_MIN) + f"; {lever} leaves the peak at "
            f"{fmt_bytes(peak_after)}, over {100 * E.TARGET_CAPACITY_SHARE:.0f}% of capacity {fmt_bytes(cap)}")


def _over_budget(peak_after: int, cap: int, bd: dict) -> str:
    """What the text adds where checkpointing leaves the peak over the capacity: that it does not fit alone, and
    where the model's own sharded parameters and optimizer state exceed the budget, that the budget may not be in
    bytes (a new-user trial's capacity_bytes=1_000_000 read "checkpoint 4 blocks: 26.03 -> 13.54 MiB", 14x the
    budget after the fix, with no word of it)."""
    if peak_after <= cap:
        return ""
    state = int((bd.get("sharded_params") or 0) + (bd.get("optimizer_state") or 0))
    text = (f" Even so the peak stays {fmt_bytes(peak_after)}, {fmt_share(peak_after / cap)} of the capacity: "
            "checkpointing alone does not fit this budget")
    if state >= cap:
        return text + (f"; the sharded parameters and optimizer state alone take {fmt_bytes(state)}, "
                       f"{state / cap:.1f}x the capacity given ({cap:,} B): is capacity_bytes in bytes?")
    return text + ("; the other levers are more ranks to shard over, CPU offload (offload.*) or a smaller "
                   "micro-batch.")


@register
class AcSelectiveToFull(Rule):
    code = "ac.selective_to_full"
    name = "Full checkpointing in place of selective"
    description = ("Selective checkpointing keeps operators' outputs at a peak near capacity: full checkpointing "
                   "keeps only the units' inputs.")
    needs = ("memory",)
    severities = ("warning", "critical")

    def match(self, ctx: Context):
        peak, cap = E.peak_bytes(ctx), E.capacity_bytes(ctx)
        if not peak or not cap:
            return self.skip(E.no_peak_or_capacity(ctx, peak, cap))
        sel, saves = _selective_beyond_inputs(ctx)
        if not sel:
            return self.quiet("no unit checkpoints selectively")
        share = peak / cap
        if why := E.below_budget(ctx, peak, cap, AC_NEAR_CAPACITY):  # (what optim.before_shard's fix gives back aside)
            return self.quiet(why)
        if not any(saves.values()):
            return self.quiet("what the selective units keep beyond their inputs is not counted (no full memory "
                              "step)" if not saves else "the selective units keep nothing beyond their inputs")
        # units not checkpointed at all holding more: ac.recommended's lever first (the embeddings' and the head's
        # few KiB are not: the reference GPT's, 4.6 KiB beside the blocks' 9 MiB of saved matmul outputs)
        plain = [u for u in E.non_root(E.param_units(ctx)) if u.checkpoint == "none"]
        held = sum(_unit_activations(ctx, plain).values()) if plain else 0
        if held >= sum(saves.values()):
            return self.quiet(f"{len(plain)} unit(s) not checkpointed hold {fmt_bytes(held)} of activations, more "
                              "than the selective ones keep beyond their inputs "
                              f"({fmt_bytes(sum(saves.values()))}): checkpointing them comes first (ac.recommended)")
        sel = [u for u in sel if saves.get(u.name)]
        pm, bd = E.peak_memory(ctx), E.breakdown(ctx)
        acts = bd.get("activations") or 0
        peak_after = _peak_with(pm, {u.name: -saves[u.name] for u in sel}, order=[u.name for u in E.units(ctx)])
        stale = E.stale_offset(ctx)  # (what optim.before_shard's fix gives back: no lever of this rule's)
        if acts / peak < AC_ACT_SHARE_MIN and peak_after - stale > E.TARGET_CAPACITY_SHARE * cap:
            return self.quiet(_short_of_target(acts, peak, peak_after - stale, cap, "full checkpointing"
                                               + (" and optim.before_shard's fix" if stale else "")))
        # the recompute full checkpointing adds, the saved operators', is no more than the units' forward compute
        bound = sum(E.compute_fwd_ms(u) for u in sel) or None
        step = E.step_ms(ctx)
        wrappers, functional = _wrappers(sel)
        titan = E.torchtitan_version(ctx) if wrappers and not functional else None
        code = (S.titan_settings(titan, activation_checkpoint="full") if titan is not None else None) or ""
        if code:
            how = f" {S.titan_says(titan)}: its full checkpointing wraps every block, all {len(sel)} here."
        elif not functional:
            code = S.full_checkpointing(wrappers)
            how = " Their checkpoint wrappers then checkpoint without the policy (their context_fn)."
        else:  # checkpoint(..., context_fn=) in the units' forward: the user's own code
            how = (" They call checkpoint(..., context_fn=...) in their forward: leave context_fn out there "
                   f"({', '.join(functional[:4])}{', ...' if len(functional) > 4 else ''}).")
        saved_total = sum(saves.values())
        return [self.finding(
            "critical" if peak - stale >= cap else "warning",
            f"Selective checkpointing keeps {fmt_bytes(saved_total)} of operator outputs at a peak at "
            f"{fmt_share(share)} of capacity: checkpoint {len(sel)} unit(s) fully",
            {"peak_bytes": peak, "capacity_bytes": cap, "peak_share_of_capacity_pct": round(100 * share, 1),
             "activation_bytes": acts, "selective_units": [u.name for u in sel],
             "saved_beyond_inputs_bytes": int(saved_total), "memory_saved_bytes": int(peak - peak_after),
             "recompute_ms_added_at_most": None if bound is None else round(bound, 3), "step_p50_ms": step},
            f"{len(sel)} unit(s) checkpoint selectively: their policy saves operators' outputs (a forward's "
            f"{fmt_bytes(saved_total)} beyond their inputs), held from each unit's forward to its backward. Full "
            f"checkpointing keeps only the inputs and recomputes those operators too: about "
            f"{fmt_bytes(peak - peak_after)} less at the {fmt_bytes(peak)} peak (capacity {fmt_bytes(cap)}), for more "
            "recompute per step: "
            + (f"at most {bound:.1f} ms, the units' forward compute (selective checkpointing already re-runs the "
               "rest)." if bound is not None else "not timed (the units run in a compiled frame).")
            + how + _over_budget(peak_after, cap, bd),
            code, where="torchtitan" if titan is not None and code else "",
            predicted=E.predicted(step, None, peak, peak_after), units=[u.name for u in sel])]


@register
class AcUnneeded(Rule):
    code = "ac.unneeded"
    name = "Activation checkpointing not needed"
    description = "Checkpointing recomputes the forward while the peak is far below capacity."
    needs = ("units", "memory")
    severities = ("info", "warning")

    def match(self, ctx: Context):
        got = _checkpointed_under_budget(self, ctx)
        if got is None:
            return []
        ck, peak, cap = got
        if peak / cap >= AC_UNNEEDED_MAX_SHARE:
            return self.quiet(E.above_share("peak", peak, cap, "capacity", AC_UNNEEDED_MAX_SHARE))
        step = E.step_ms(ctx)
        # recompute time: measured when the recorder saw it, else the blocks' forward compute
        measured = sum(u.timing.recompute_ms for u in ck)
        estimated = sum(E.compute_fwd_ms(u) for u in ck)
        recompute = bound = None  # (bound: a selective checkpoint's, not timed)
        if measured > 0:
            recompute, how = measured, "measured"
        elif any(_selective(u) for u in ck):
            # a selective checkpoint's recompute, cut short, is not timed: its forward's time is only a bound (a
            # new-user trial's 19.9 ms "measured" where turning selective checkpointing off saved 2-5 ms)
            bound = estimated
            how = f"not timed (selective checkpointing: at most the units' forward compute, {bound:.1f} ms)"
            said = (f"its time not measured: it stops once it has what backward needs, and the units' forward "
                    f"compute, ~{bound:.1f} ms per step, bounds it")
        elif estimated > 0:
            recompute, how = estimated, "estimated from the units' forward compute"
        else:  # the units are not timed (inside a module compiled in place: the doctor's hooks return at once)
            how = "not timed (units in a compiled frame)"
            said = "its time not measured: the units run in a compiled frame, where the doctor's hooks do not time them"
        if recompute is not None:
            said = f"~{recompute:.1f} ms per step"
        pm = E.peak_memory(ctx)
        extra, source = _added_without_checkpointing(ctx, ck, pm)
        peak_after = _peak_with(pm, extra, order=[u.name for u in E.units(ctx)]) if source is not None else None
        # checkpointing earns its keep where the peak without it passes the headroom a fix spending memory for time
        # keeps (T.HEADROOM_MAX_SHARE, as ac.fewer_units'), under where ac.recommended fires: at the latter's own
        # threshold a prediction 4% low flipped the rules (a new-user trial's Wav2Vec2 under the Trainer: 27.13 MiB
        # predicted, 84.8% of 32 MiB; pasted, 28.33 MiB measured and ac.recommended checkpointed all 4 layers again)
        if peak_after is not None and peak_after > AC_FEWER_TARGET_SHARE * cap:
            return self.quiet(f"without checkpointing the peak would be {fmt_bytes(peak_after)}, over "
                              f"{100 * AC_FEWER_TARGET_SHARE:.0f}% of capacity {fmt_bytes(cap)}"
                              + (" (ac.fewer_units weighs checkpointing some of them)" if len(ck) > 1 else ""))
        share = recompute / step if step and recompute is not None else None
        sev = "warning" if bound is None and (share is None or share >= AC_RECOMPUTE_WARN_SHARE) else "info"
        wrappers, functional = _wrappers(ck)
        # where accelerate's FSDP2 plugin sharded the model, its settings: CheckpointWrappers are FSDP's own (the
        # plugin wraps the layers it shards); checkpoint(...) calls are Hugging Face's, under the Trainer its
        # training argument, else the user's own call (the fix on the unsharded model, as without the plugin)
        lever = E.plugin_lever(ctx) if wrappers or E.trainer_driven(ctx) else None
        # torchtitan's config wraps its blocks (selective, its default, or full): the setting turns them off
        titan = E.torchtitan_version(ctx) if wrappers and not functional else None
        titan_code = S.titan_settings(titan, activation_checkpoint="none") if titan is not None else None
        # (the wrappers turned off where they are, after the user's fully_shard calls: made before sharding, after it,
        # or in one loop with it, they exist there; snippets.remove_checkpointing)
        code = S.remove_checkpointing(wrappers, functional)
        stats, up_to = _uncheckpointed_stats(ctx, ck)
        if titan_code:
            code = titan_code
        elif lever == "trainer":
            code = S.plugin_checkpointing(False, lever, plugin=bool(wrappers), hf=bool(functional))
        elif lever:
            code = S.plugin_checkpointing(False, lever) + (
                "\n" + S.remove_checkpointing([], functional) if functional else "")
        # the model's own switch, under accelerate's plugin without its wrappers: before prepare(), where the model
        # is the user's ("before your fully_shard calls" read to a diffusers U-Net's accelerate user, who has none: a
        # new-user trial)
        prepared = not lever and not titan_code and E.plugin_lever(ctx) == "accelerate"
        return [self.finding(
            # (under 1%: one decimal; "the peak is 0% of capacity" beside 0.5% in its evidence, a new-user trial)
            sev, f"Activation checkpointing on {len(ck)} unit(s) while the peak is {fmt_share(peak / cap)} of capacity",
            {"peak_bytes": peak, "capacity_bytes": cap, "peak_share_of_capacity_pct": round(100 * peak / cap, 1),
             "checkpointed_units": [u.name or "(root)" for u in ck],
             "recompute_ms_per_step": None if recompute is None else round(recompute, 3),
             "recompute_source": how,
             "activation_bytes_added": int(sum(extra.values())) if source is not None else None,
             "activation_source": source, "step_p50_ms": step,
             **({"running_stats_layers": stats} if stats else {})},
            f"{_reruns(ck)} during backward ("
            + said
            + f") to save memory this run does not need: the peak is {fmt_bytes(peak)} of {fmt_bytes(cap)}"
            + (f", and about {fmt_bytes(peak_after)} without it ({source})" if peak_after is not None else "") + ". "
            "Turn it off and spend the headroom on speed." + _running_stats(stats, on=False, up_to=up_to)
            + (f" {S.plugin_says(lever)[0]}, turn off the setting that applied it before {S.plugin_says(lever)[1]} "
               + ("(the training argument, or the model's own switch where your code turned it on; "
                  if lever == "trainer" and functional else "(")
               + "checkpoint wrappers of your own: build the model without them)." if lever else "")
            + (f" {S.titan_says(titan)}: turn its activation checkpointing off there." if titan is not None else ""),
            code, where=lever or ("torchtitan" if titan_code else "accelerate" if prepared else ""),
            inputs={"model": "your model, before accelerator.prepare(model)"} if prepared else None,
            predicted=E.predicted(step, step - recompute if step is not None and recompute is not None else None,
                                  peak, peak_after),
            units=[u.name for u in ck])]


@register
class AcWrongGranularity(Rule):
    code = "ac.wrong_granularity"
    name = "Checkpointing the block's children"
    description = "Checkpointing wraps a block's children instead of the block."
    needs = ("units",)
    severities = ("warning",)

    def match(self, ctx: Context):
        ch = [u for u in E.units(ctx) if u.checkpoint in ("children", "partial")]
        if not ch:
            return self.quiet("no unit checkpoints its children instead of itself")
        # a unit holding whole blocks of the model (the root, where no block is a unit of its own): the children it
        # checkpoints are those blocks, at the block's granularity (a new-user trial's Trainer with NO_WRAP: its
        # decoder layers, checkpointed by gradient_checkpointing, read as the root's children, and the fix
        # checkpointed the whole model); that they are no units is wrap.params_in_root's beside other units, and
        # wrap.too_coarse's where the root is the only unit or a unit below it holds several blocks (the rule that
        # says it: a new-user trial's whole model in one unit read "wrap.params_in_root's", itself quiet there)
        inside = {u.name: _blocks_inside(u) if all(S.strip_ckpt(w) == S.block_of(w) for w in u.checkpoint_wrappers)
                  else [] for u in ch}  # (wrappers on the blocks' children: the wrong granularity all the same)
        if all(inside.values()):
            blocks = sorted({b for bs in inside.values() for b in bs})
            return self.quiet(f"the checkpointing is inside unit(s) holding whole blocks of the model "
                              f"({E.fmt_list([u.name or '(root)' for u in ch])}: {len(blocks)} blocks, "
                              f"{E.fmt_list(blocks[:3])}{', ...' if len(blocks) > 3 else ''}), the blocks' own: "
                              f"their granularity; that the blocks are no units is {_blocks_owner(ctx, ch)}'s")
        ch = [u for u in ch if not inside[u.name]]
        # transformers' own layers checkpointing themselves inside the unit (no wrapper of the user's): whole blocks
        # of the model, at their granularity (a Swin's stage units holding its blocks: the fix checkpointed the
        # stages, where the blocks' switches, left on, nested their recompute in the stages', ac.nested's case)
        layers = getattr(ctx.config, "checkpoint_layers", None) or []
        own = {u.name: [m for m in layers if m.startswith(S.strip_ckpt((u.modules or [u.name])[0]) + ".")]
               for u in ch if not u.checkpoint_wrappers}
        if ch and all(own.get(u.name) for u in ch):
            found = [m for u in ch for m in own[u.name]]
            return self.quiet(f"the checkpointing inside {E.fmt_list([u.name or '(root)' for u in ch])} is "
                              f"transformers' own layers checkpointing themselves ({len(found)}: "
                              f"{E.fmt_list(found[:3])}{', ...' if len(found) > 3 else ''}), whole blocks of the "
                              "model: their granularity")
        ch = [u for u in ch if not own.get(u.name)]
        step, peak = E.step_ms(ctx), E.peak_bytes(ctx)
        cap = E.capacity_bytes(ctx)
        # a peak far below capacity: whole blocks checkpointed spare memory the run does not need, and ac.unneeded
        # weighs checkpointing off; said here, so that the two findings read as one choice (both fired on a new-user
        # trial's MLP-only checkpointing, each fix read as undoing the other)
        ample = bool(peak and cap and peak / cap < AC_UNNEEDED_MAX_SHARE)
        mods = list(dict.fromkeys(m for u in ch for m in _blocks_of(u)))
        per_unit = _unit_activations(ctx, ch)
        acts = sum(per_unit.values()) if per_unit else None
        # what checkpointing the children spares now: measured in their recompute (else unknown)
        spared, source = _added_without_checkpointing(ctx, ch, E.peak_memory(ctx))
        # checkpointed whole, each block regrows in its recompute at once what its children's recomputes held one at
        # a time: where that raises the peak, the children are the better granularity (a diffusers U-Net's blocks,
        # each checkpointing its resnets and transformer blocks: the fix pasted raised the peak 58.52 -> 86.79 MiB,
        # its full-resolution up block's 52.7 MiB regrown at once; a new-user trial)
        peak_after = _peak_whole(ctx, ch, per_unit, spared) if source == MEASURED and per_unit else None
        if peak and peak_after is not None and peak_after > peak:
            return self.quiet(f"checkpointing {E.fmt_list([u.name or '(root)' for u in ch])} whole would raise the "
                              f"peak from {fmt_bytes(peak)} to {fmt_bytes(peak_after)} at least: each one's recompute "
                              "would hold at once what its children's recomputes hold one at a time (measured in "
                              "them)")
        wrappers, functional = _wrappers(ch)
        # checkpointed whole, the blocks' modules outside the inner wrappers re-run too (under checkpoint(...) calls
        # in a forward, which those are is not known)
        stats = E.running_stats_under(E.units(ctx), [m for u in ch if u.checkpoint_wrappers for m in u.modules],
                                      but=wrappers)
        return [self.finding(
            "warning", f"Checkpointing is applied inside {len(ch)} unit(s) instead of to the whole block",
            {"units": [u.name or "(root)" for u in ch], "checkpoint": sorted({u.checkpoint for u in ch}),
             "activation_bytes": acts,
             "activation_bytes_spared": int(sum(spared.values())) if source == MEASURED else None,
             "activation_source": source if source == MEASURED else None, "step_p50_ms": step,
             **({"running_stats_layers": stats} if stats else {})},
            "Checkpointing re-runs the blocks' children (attention, MLP: checkpoint wrappers on them, or "
            "checkpoint(self.mlp, h) calls in the block's forward), not the blocks: every tensor passed between "
            "the children and the residual adds and norms around them stays saved, so a large part of the "
            "activations survives (seen in the wild: 29 of 40.8 GB at peak), while the recompute is paid in "
            # (what the recompute spares is no part of what the units keep: more than it on a transformer block)
            "full." + (f" Here their recompute spares {fmt_bytes(sum(spared.values()))}, while these units still "
                       f"keep {fmt_bytes(acts)} saved." if source == MEASURED and acts else "")
            + " Checkpoint the blocks themselves, and drop the inner wrappers or checkpoint calls."
            + (f" That is where memory is needed: here the peak is {fmt_share(peak / cap)} of capacity, and "
               "turning checkpointing off (ac.unneeded) gains more than checkpointing the blocks." if ample else "")
            + _running_stats(stats, on=True, lead="With the blocks checkpointed,", now=" not checkpointed now"),
            _granularity_code(wrappers, functional, mods, _kv_cache(ctx)),
            predicted=E.predicted(step, step, peak, None), units=[u.name for u in ch])]


def _peak_whole(ctx: Context, ch: list[E.Unit], kept: dict[str, int], spared: dict[str, int]) -> Optional[int]:
    """The peak (bytes) with the units ``ch``, whose children are checkpointed, checkpointed whole instead, from the
    peak step's timeline: from its forward's end to its backward's start each keeps its input alone in place of
    what it keeps now (``kept``: the tensors between its children); at its backward's start its recompute regrows
    the whole forward's saves at once, what it keeps now and what its children's recomputes regrow one at a time
    (``spared``, measured in them), above that mark. A floor: the backward's own bytes beside the recompute (its
    gradients, its temporaries) come on top, and the mark holds none of them (the U-Net: 76.68 MiB for 86.79
    measured; the non-activation bytes of its backward's high-water, which hold the children's recompute too, on top
    read 97.45). None without a timeline showing every one of them."""
    pm = E.peak_memory(ctx)
    tl = pm.timeline if pm is not None else None
    if not tl:
        return None
    mem = E.memory_units(ctx)
    added = [0.0] * len(tl)
    for u in ch:
        if u.name not in kept or u.name not in spared:
            return None
        row = mem.get(u.name)
        inp = int(row.input_bytes) if row is not None and row.input_bytes is not UNSET else 0
        ends, backs = E.phase_rows(tl, u.name, "forward_end"), E.phase_rows(tl, u.name, "backward_start")
        if not ends or len(ends) != len(backs):
            return None
        for fe, be in zip(ends, backs):
            for i in range(fe, be):
                added[i] -= max(0, kept[u.name] - inp)
            added[be] += inp + spared[u.name]
    return E.peak_with_rows(pm, added)


def _kv_cache(ctx: Context) -> bool:
    """Whether a checkpointing fix turns a Hugging Face KV cache off (snippets.no_kv_cache): a config under the
    model had use_cache on (RunConfig.kv_cache), or may have (not recorded: plain traces, older records). Its lines
    printed on the reference GPT, torchtitan's llama and diffusers' Flux, which have no such config."""
    return getattr(ctx.config, "kv_cache", None) is not False


def _granularity_code(wrappers: list[str], functional: list[str], blocks: list[str], kv_cache: bool) -> str:
    """ac.wrong_granularity's fix. CheckpointWrappers on the blocks' children: turned off where they are and each
    block wrapped in place, both after the user's fully_shard calls, where every wrapper exists however the user's
    code made it (before them, a loop that wraps each block's children and shards the block in the same pass ran
    after the fix: it set the children's wrappers on the blocks' wrappers, never called, or, checking its blocks'
    type, sharded none of them; tests/test_ac_granularity_fix_where_wrapped.py). checkpoint(...) calls only (no
    wrapper of the user's to wait for): the blocks wrapped before fully_shard, as ``apply_activation_checkpointing``
    wraps them, and the switches inside them turned off (a diffusers U-Net's blocks checkpoint their resnets and
    transformer blocks by their own switches, which the blocks' recompute would re-run checkpointed, nested: a
    new-user trial)."""
    if not wrappers:
        return S.checkpoint_modules(blocks, "checkpoint whole blocks", kv_cache,
                                    then=S.switches_off_inside("names", "inside the blocks"))
    return (S.remove_checkpointing(wrappers, functional, note="on the blocks' children") + "\n"
            + S.checkpoint_in_place(blocks, "then whole blocks checkpointed", kv_cache))



@register
class AcFewerUnits(Rule):
    code = "ac.fewer_units"
    name = "Checkpointing more units than memory needs"
    description = ("Some checkpointed units would fit in memory with their activations kept: their recompute is "
                   "paid for memory the run does not need.")
    needs = ("units", "memory")
    severities = ("info", "warning")

    def match(self, ctx: Context):
        got = _checkpointed_under_budget(self, ctx)
        if got is None:
            return []
        ck, peak, cap = got
        target = AC_FEWER_TARGET_SHARE * cap
        if peak >= target:
            return self.quiet(E.above_share("peak", peak, cap, "capacity", AC_FEWER_TARGET_SHARE))
        pm, order = E.peak_memory(ctx), [u.name for u in E.units(ctx)]
        extra, source = _added_without_checkpointing(ctx, ck, pm)
        if source != MEASURED:  # (the estimate, a transformer layer's ratio, is too coarse to spend headroom on)
            return self.quiet("what the checkpointed units would keep without checkpointing was not measured in "
                              "their recompute (the memory probe's counted steps)")
        if peak / cap < AC_UNNEEDED_MAX_SHARE and _peak_with(pm, extra, order=order) <= target:
            return self.quiet("checkpointing is not needed on any unit: ac.unneeded's case")
        if E.torchtitan_version(ctx) is not None:
            return self.quiet("torchtitan's job config checkpoints every block or none (its selective and "
                              "memory-budget modes choose operators, not blocks)")
        lever = E.plugin_lever(ctx) if any(u.checkpoint_wrappers for u in ck) else None
        if lever:
            return self.quiet(f"{S.plugin_says(lever)[0]}, the plugin's activation_checkpointing checkpoints every "
                              "layer it shards or none")
        # units whose checkpointing a fix can turn off alone: a CheckpointWrapper of their own, or transformers' flag;
        # not one inside a module that checkpoints itself, whose recompute re-runs it whatever its own does (a Swin's
        # blocks inside its stages: the fix turned 6 blocks' flags off for "26.26 -> 32.52 MiB" and the peak stayed
        # at 26.11, a new-user trial; ac.nested says it)
        nesting = _nesting(ctx) or {S.strip_ckpt(w): [S.strip_ckpt(i) for i in ins]
                                    for w, ins in _wrapper_nesting(ctx).items()}
        cands = [u for u in ck if u.checkpoint == "unit" and (u.checkpoint_wrappers or u.checkpoint_flag)
                 and extra.get(u.name) is not None and not _in_nesting(u, nesting)]
        if not cands and any(_in_nesting(u, nesting) for u in ck):
            return self.quiet("the checkpointed units are, hold or lie inside layers that checkpoint inside others: "
                              "one's checkpointing off leaves the other's recompute (ac.nested)")
        if not cands:
            return self.quiet("the checkpointed units re-run through checkpoint(...) calls in code, which only that "
                              "code can change for some of them")
        # the fewest bytes kept first (the most units, each sparing its forward), among equals the later units: held
        # from their forward's end to their backward's start, the shortest (on an HF Llama of 3 layers, 2.14 MiB
        # with the last two un-checkpointed, 2.21 with the first and last); bytes measured exactly, not timings,
        # so that the same run gets the same fix
        pos = {n: i for i, n in enumerate(order)}
        cands.sort(key=lambda u: (extra[u.name], -pos.get(u.name, 0)))

        def peak_without(k: int) -> int:
            return _peak_with(pm, {u.name: extra[u.name] for u in cands[:k]}, order=order)

        lo, hi = 0, len(cands)  # the most units the target holds (the peak grows with each one)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if peak_without(mid) <= target else (lo, mid - 1)
        if lo == 0:
            return self.quiet(f"without checkpointing on even one unit ({cands[0].name}) the peak would be "
                              f"{fmt_bytes(peak_without(1))}, over {100 * AC_FEWER_TARGET_SHARE:.0f}% of capacity "
                              f"{fmt_bytes(cap)}")
        chosen = sorted(cands[:lo], key=lambda u: pos.get(u.name, 0))
        peak_after = peak_without(lo)
        spared = sum(_recompute_ms(u) for u in chosen)
        step = E.step_ms(ctx)
        sev = "warning" if step and spared / step >= AC_RECOMPUTE_WARN_SHARE else "info"
        names = [u.name for u in chosen]
        stats, up_to = _uncheckpointed_stats(ctx, chosen)
        every = len(chosen) == len(ck)
        some = f"all {len(ck)}" if every else f"{len(chosen)} of the {len(ck)}"
        return [self.finding(
            sev, f"{some.capitalize()} checkpointed unit(s) fit in memory without checkpointing",
            {"peak_bytes": peak, "capacity_bytes": cap, "peak_share_of_capacity_pct": round(100 * peak / cap, 1),
             "checkpointed_units": [u.name for u in ck], "units_to_uncheckpoint": names,
             "peak_after_bytes": int(peak_after),
             "peak_after_share_of_capacity_pct": round(100 * peak_after / cap, 1),
             "target_share_of_capacity_pct": round(100 * AC_FEWER_TARGET_SHARE),
             "activation_bytes_added": int(sum(extra[n] for n in names)), "activation_source": source,
             "recompute_ms_spared": round(spared, 3) if spared else None, "step_p50_ms": step,
             **({"running_stats_layers": stats} if stats else {})},
            f"{_reruns(ck)} in backward to keep the peak at {fmt_bytes(peak)} "
            f"of {fmt_bytes(cap)} ({fmt_share(peak / cap)}). {some.replace(' the ', ' ').capitalize()} can keep their "
            f"activations (measured in their recompute): the peak would be about {fmt_bytes(peak_after)} "
            f"({fmt_share(peak_after / cap)}, under {100 * AC_FEWER_TARGET_SHARE:.0f}%), and the step "
            + (f"~{spared:.1f} ms shorter" if spared else "shorter by their recompute (not timed here)")
            + (". Turn checkpointing off (ac.unneeded stays quiet: the peak is at half of capacity or more)."
               if every else ". Turn checkpointing off on those and keep it on the others.")
            + _running_stats(stats, on=False, up_to=up_to),
            _fewer_code(chosen, f"on {some} checkpointed units"),
            predicted=E.predicted(step, step - spared if step is not None and spared else None, peak, peak_after),
            units=names)]


def _fewer_code(chosen: list[E.Unit], note: str) -> str:
    """ac.fewer_units' fix: the chosen units' CheckpointWrappers turned off (after the user's fully_shard calls,
    where every wrapper exists), then transformers' layers' own flags off (anywhere: alone, after fully_shard, where a
    Trainer's callback can run it)."""
    wrappers = [w for u in chosen for w in u.checkpoint_wrappers]
    flagged = [u.modules[0] for u in chosen if not u.checkpoint_wrappers and u.modules]
    return "\n".join(([S.remove_checkpointing(wrappers, [], note=note)]
                      if wrappers else [])
                     + ([S.checkpoint_flags_off(flagged, note)] if flagged else []))


def _nesting(ctx: Context) -> Optional[dict[str, list[str]]]:
    """transformers' switched-on layers that hold others (RunConfig.checkpoint_layers), each with those inside it;
    None where the run did not record them."""
    on = getattr(ctx.config, "checkpoint_layers", None)
    if on is None:
        return None
    return {n: ins for n in on if (ins := [i for i in on if i != n and (not n or i.startswith(n + "."))])}


def _wrapper_nesting(ctx: Context) -> dict[str, list[str]]:
    """CheckpointWrappers (fqns as the units name them) that hold others, each with those inside it: accelerate's
    plugin wraps every module of its policy's classes, nested ones too (a ConvNeXt's stages and the layers inside
    them, both in its _no_split_modules)."""
    ws = list(dict.fromkeys(w for u in E.units(ctx) for w in u.checkpoint_wrappers))
    plain = {w: S.strip_ckpt(w) for w in ws}
    return {w: ins for w in ws
            if (ins := [i for i in ws if i != w and (not plain[w] or plain[i].startswith(plain[w] + "."))])}


def _peak_inputs_held(ctx: Context, outer: list[E.Unit], inside: dict[str, list[E.Unit]],
                      inputs: dict[str, int]) -> int:
    """The peak once each outer unit stops checkpointing and its inner units' inputs are held from forward to
    backward (ac.nested, every layer a unit): from the outer unit's backward the outer recompute regrew them anyway,
    so they are held longer only from its forward's end to there (a unit of no parameters has no backward mark: to
    its last inner unit's, the first whose backward runs), on the peak step's timeline (``_peak_with``). A ConvNeXt's
    stages and layers, each a unit under accelerate's plugin, peak inside the first stage's backward: every input
    added at the peak read "14.13 -> 16.12 MiB", pasted 13.99. ``inside``: each outer unit's inner units;
    ``inputs``: each inner unit's input bytes."""
    pm = E.peak_memory(ctx)
    tl = pm.timeline if pm is not None else []
    held: dict[str, int] = {}
    for o in outer:
        ins = inside[o.name]
        key = o.name if E.phase_rows(tl or [], o.name, "backward_start") or not ins else ins[-1].name
        held[key] = held.get(key, 0) + sum(inputs[i.name] for i in ins)
    return _peak_with(pm, held, order=[u.name for u in E.units(ctx)])


def _in_nesting(u: E.Unit, nested: dict[str, list[str]]) -> bool:
    """Whether the unit's module is one of ``_nesting``'s layers, lies inside one or holds one: its
    own checkpointing turned off leaves the others' recompute (the Swin's blocks inside its stages, or its stages as
    units holding its blocks)."""
    m = S.strip_ckpt((u.modules or [u.name])[0])
    layers = [*nested, *(i for ins in nested.values() for i in ins)]
    return any(m == x or not m or x.startswith(m + ".") or m.startswith(x + ".") for x in layers)


@register
class AcNested(Rule):
    code = "ac.nested"
    name = "Checkpointing inside checkpointing"
    description = ("Layers that checkpoint themselves inside a layer that checkpoints its own forward: the outer "
                   "recompute re-runs them and their own re-runs them again, three forwards a step where two do.")
    needs = ("units",)
    severities = ("info", "warning")

    def match(self, ctx: Context):
        """transformers' ``gradient_checkpointing_enable()`` switches every GradientCheckpointingLayer on, and some
        models nest them: a Swin's stages hold its blocks (each block's attention ran 3 times a step, a new-user
        trial). Turning the outer layers' switch off leaves each inner one checkpointing itself: one forward of each
        spared, and their inputs (their checkpoints' own) held from forward to backward where the outer checkpoint
        held only its input, beside what the outer layers' other operators save (a patch merging's)."""
        nested = _nesting(ctx)
        # CheckpointWrappers nested the same way (accelerate's plugin over a ConvNeXt's stages and layers: each
        # layer's forward ran three times a step, a new-user trial), where no switches are
        wrapped = {} if nested else _wrapper_nesting(ctx)
        if nested is None and not wrapped:
            return self.skip("the run does not record its checkpointing layers (recorded before checkpoint_layers)")
        if not nested and not wrapped:
            return self.quiet("no layer that checkpoints its own forward holds another switched on, and no "
                              "checkpoint wrapper holds another")
        nested = nested or wrapped
        outer = [S.strip_ckpt(o) for o in nested]
        inner = list(dict.fromkeys(S.strip_ckpt(i) for ins in nested.values() for i in ins))
        by_module = {S.strip_ckpt(u.modules[0]): u for u in E.units(ctx) if u.modules}
        inner_units = [by_module[i] for i in inner if i in by_module]  # (the Swin's blocks as units)
        outer_units = [by_module[o] for o in outer if o in by_module]  # (its stages as units, blocks inside)
        # a nested unit's recompute, timed, is both re-runs in backward (the outer one's and its own): one is spared
        # (the Swin's 8 blocks: 30.3 ms timed, 12-15 ms a step spared measured; their recompute 12.9 ms after); an
        # outer unit's inner layers are most of its forward, which they run once more
        spared = sum(u.timing.recompute_ms / 2 if u.timing.recompute_ms > 0 else _recompute_ms(u)
                     for u in inner_units)
        inside = {o.name: [i for i in inner_units
                           if S.strip_ckpt(i.modules[0]).startswith(S.strip_ckpt(o.modules[0]) + ".")]
                  for o in outer_units}  # (each outer unit's inner units)
        spared += sum(E.compute_fwd_ms(u) for u in outer_units if not inside[u.name])
        step, peak = E.step_ms(ctx), E.peak_bytes(ctx)
        mem = E.memory_units(ctx)
        inputs = {u.name: int(mem[u.name].input_bytes) for u in inner_units
                  if u.name in mem and mem[u.name].input_bytes is not UNSET}
        # their inputs held at the peak where every inner layer is a unit whose inputs were counted; else not
        held = sum(inputs.values()) if inner_units and len(inputs) == len(inner) else None
        peak_after = peak + held if peak is not None and held is not None else None
        if peak_after is not None and outer_units and len(outer_units) == len(outer):
            peak_after = _peak_inputs_held(ctx, outer_units, inside, inputs)
        sev = "warning" if step and spared / step >= AC_RECOMPUTE_WARN_SHARE else "info"
        shown = E.fmt_list(inner[:4] + ([f"{len(inner) - 4} more"] if len(inner) > 4 else []))
        keeps = f"on the {len(outer)} layer(s) holding other checkpointed layers (each of those keeps its own)"
        lever = E.plugin_lever(ctx) if wrapped else None
        return [self.finding(
            sev, f"{len(inner)} checkpointed layer(s) re-run inside {len(outer)} checkpointed layer(s) around them",
            {"outer_layers": outer, "inner_layers": inner, "forward_runs_per_step": 3,
             "recompute_ms_spared": round(spared, 3) if spared else None, "step_p50_ms": step,
             "inputs_held_bytes": held},
            (f"{E.fmt_list(outer)} checkpoint their own forward in a CheckpointWrapper, and so do {len(inner)} "
             f"layers inside them ({shown})" if wrapped else
             f"{E.fmt_list(outer)} checkpoint their own forward with transformers' switch (gradient_checkpointing) "
             f"on, and so do {len(inner)} layers inside them ({shown})")
            + ": in backward the outer recompute re-runs each "
            "inner layer's forward, then its own checkpoint re-runs it again, three forwards a step where two do. "
            + (f"{S.plugin_says(lever)[0]}, the plugin's activation_checkpointing wraps every module its policy "
               "shards, those inside others too. " if lever else "")
            + ("Turning the outer wrappers' checkpointing off (each stays, calling its module as it is) leaves each "
               "inner one checkpointing itself: " if wrapped else
               "Turning the outer layers' switch off leaves each inner one checkpointing itself: ")
            + (f"~{spared:.1f} ms of recompute a step spared" if spared else "one forward of each spared (not timed "
               "here)")
            + (f", for their inputs ({fmt_bytes(held)}) held from forward to backward where the outer checkpoints "
               "held only theirs, beside what the outer layers' own operators save (not measured apart)"
               if held is not None else ", for their inputs and what the outer layers' own operators save, held "
               "from forward to backward (not measured apart)")
            + (". The wrappers exist once the model is wrapped and sharded: the lines go after that." if wrapped else
               ". The switch is each layer's attribute: set it after checkpointing is switched on "
               "(gradient_checkpointing_enable(), or a Trainer's gradient_checkpointing=True, at train()'s start)."),
            S.remove_checkpointing(list(nested), [], header=f"activation checkpointing off {keeps}: each wrapper "
                                   "stays, calling its module as it is") if wrapped else
            S.checkpoint_flags_off(outer, keeps),
            predicted=E.predicted(step, step - spared if step is not None and spared else None, peak, peak_after),
            units=[u.name for u in [*outer_units, *inner_units]])]
