"""Memory: gradients kept alive between steps, the model's outputs kept past backward, evaluation with autograd
on, a peak near capacity that no one category explains, the CUDA allocator retrying its allocations, and device
memory growing every step."""

from __future__ import annotations

import statistics
from typing import NamedTuple, Optional

import msgspec

from .. import estimate as E
from .. import snippets as S
from .. import thresholds as T
from ...records import CudaMemory
from ...units import fmt_bytes, fmt_duration, fmt_ms, fmt_share, unit_label
from ..base import Context, Rule, register

_GRADS = ("sharded_grads", "unsharded_grads")
# gradients kept between steps count from this many bytes on (allocator rounding aside)
GRADS_KEPT_MIN_BYTES = 64 << 10


@register
class GradsKept(Rule):
    code = "memory.grads_kept"
    name = "Gradients kept between steps"
    description = ("Gradients stay allocated after the optimizer step (zero_grad(set_to_none=False)), so the "
                   "next forward runs with every gradient already in memory.")
    needs = ("memory",)
    severities = ("info", "warning")

    def match(self, ctx: Context):
        pm = E.peak_memory(ctx)
        first = pm.timeline[0] if pm is not None and pm.timeline else None
        if first is None:
            return self.quiet("no memory timeline of the peak step")
        if not str(first.get("phase") or "").startswith("forward"):  # (gradients there are this step's own)
            steps = [s for rd in (getattr(ctx.run, "ranks", None) or {}).values() for s in rd.steps]
            if steps and not any(s.backward_ms for s in steps):
                # (a loop of forward passes without gradients, evaluation or generation: it read "inside a function
                # compiled around the model" where nothing was compiled, a new-user trial)
                return self.quiet("no step ran a backward (evaluation or generation only): no gradient to keep")
            return self.quiet(f"the peak step's memory timeline begins at a {first.get('phase')} mark, not before "
                              "its forward (the forward ran where the doctor's marks do not reach: inside a function "
                              "compiled around the model): what the step starts with is not known")
        # what the step starts with, before its first forward: gradients there survived the last step; those of
        # trainable parameters outside the optimizer, which its zero_grad never frees, are optim.untrained_params'
        # (and unsharded ones where FSDP's gradient sync is off: never reduced, optim.no_gradients')
        # (also where the optimizer holds no state after three steps: FSDP2's post-backward never ran, the gradients
        # never left the gathered parameters, which "zeroed in place instead of freed" misnamed: a new-user trial's
        # VAE with encode() registered as its forward method)
        off = bool(getattr(ctx.config, "gradient_sync_off", None)) or getattr(ctx.config, "optimizer_state_tensors",
                                                                              None) == 0
        kept = sum(int(first.get(k) or 0) for k in _GRADS if not (off and k == "unsharded_grads"))
        ut = getattr(ctx.config, "untrained", None)
        outside = int(ut.grad_bytes) if ut is not None and ut.tensors and ut.changed is False else 0
        kept = max(0, kept - outside)
        if kept < GRADS_KEPT_MIN_BYTES:
            return self.quiet(f"{fmt_bytes(kept)} of gradients allocated when the step starts" + (
                f" (besides {fmt_bytes(outside)} of parameters outside the optimizer: optim.untrained_params)"
                if outside else ""))
        peak, cap = int(pm.peak_bytes), E.capacity_bytes(ctx)
        kinds = tuple(k for k in _GRADS if not (off and k == "unsharded_grads"))
        freed_at = _freed_before_backward(pm.timeline, kept, kinds)
        after = _peak_without_kept(pm, kept, E.param_units(ctx), freed_at)
        share = peak / cap if cap else None
        sev = "warning" if E.peak_near_capacity(ctx) else "info"
        if freed_at is None:
            why = ("After optimizer.step() the gradients are zeroed in place instead of freed, so the forward of the "
                   "next step (its activations, its all-gathers) runs with every gradient shard already allocated. "
                   "Free them: set_to_none=True is the default since torch 2.0, and FSDP2 allocates each gradient "
                   "when its unit's backward produces it.")
            instead = "call optimizer.zero_grad() instead of\n# zero_grad(set_to_none=False) in your loop"
        else:
            # (a new-user trial: Lightning's Trainer, and a loop zeroing between its loss and backward(), read "zeroed
            # in place" where they were freed, and a predicted peak 0.44 MiB under the one the fix brought)
            why = ("The gradients are freed only after the next step's forward: the loop's zero_grad runs between "
                   "the forward and the backward (Lightning's Trainer zeroes so, inside the closure it hands "
                   "optimizer.step(), after training_step), so that forward (its activations, its all-gathers) and "
                   "the loss run with every gradient shard of the last step still allocated. Free them as the "
                   "optimizer step ends; FSDP2 allocates each gradient when its unit's backward produces it.")
            instead = "call optimizer.zero_grad() right after\n# optimizer.step() in your loop"
        return [self.finding(
            sev, f"{fmt_bytes(kept)} of gradients stay allocated between steps",
            {"grads_kept_bytes": kept, "peak_bytes": peak, "peak_capacity_pct": None if share is None else
             round(100 * share, 1), "peak_phase": pm.peak_at.phase, "peak_after_bytes": after,
             "freed_before_backward": freed_at is not None},
            why,
            "# frees the gradients after every optimizer.step(), whatever your loop's\n"
            f"# zero_grad does later (or {instead})\n"
            "optimizer.register_step_post_hook(\n"
            "    lambda opt, args, kwargs: opt.zero_grad(set_to_none=True))",
            predicted=E.predicted(E.step_ms(ctx), E.step_ms(ctx), peak, after))]


def _freed_before_backward(tl, kept: int, kinds) -> int | None:
    """The index of the first mark of the peak step's timeline, before its backward, holding fewer gradients than
    the step began with: the loop freed them itself, after the forward (a zero_grad between the forward and the
    backward); None where they stay until the backward (zeroed in place)."""
    for i, row in enumerate(tl):
        phase = row.get("phase") or ""
        if phase.startswith("in_"):  # (a high-water between two marks takes its categories from one of them)
            continue
        if sum(int(row.get(k) or 0) for k in kinds) < kept:
            return i
        if phase.startswith("backward"):
            return None
    return None


def _peak_without_kept(pm, kept: int, units, freed_at: int | None = None) -> int:
    """The peak with gradients freed after the step: on the peak step's timeline every mark before backward
    loses the kept gradients; a backward mark keeps those of the units whose backward has ended (their
    shards, as FSDP2 reduce-scatters them). Where the loop frees them itself after the forward (``freed_at``, the
    first mark without them), the marks from there on lose nothing; the high-water just before it (the loss)
    still held them. Without a timeline: the peak less the kept gradients."""
    tl = pm.timeline
    if not tl:
        return max(0, int(pm.peak_bytes) - kept)
    shard = {u.name: E.grad_shard_bytes(u) for u in units}
    done, best, backward = 0, 0, False
    for i, row in enumerate(tl):
        phase = row.get("phase") or ""
        backward = backward or phase.startswith("backward")
        if phase == "backward_end":
            done += shard.get(row.get("unit"), 0)
        total = int(row.get("total") or 0)
        if freed_at is not None and i >= freed_at:
            best = max(best, total)
        else:
            best = max(best, total - kept + (min(done, kept) if backward else 0))
    return best + max(0, int(pm.peak_bytes) - max(int(r.get("total") or 0) for r in tl))


# the step's own tensors alive when the optimizer step starts count from this many bytes on and this share of what
# the step's tensors take at the peak (the loss, a grad-norm scalar and allocator rounding stay far below)
OUTPUTS_KEPT_MIN_BYTES = 256 << 10
OUTPUTS_KEPT_MIN_SHARE = 0.02
OUTPUTS_KEPT_WARN_SHARE = 0.10  # of the peak, what freeing them lowers it by: a warning from here on (or near capacity)


@register
class OutputsKept(Rule):
    code = "memory.outputs_kept"
    name = "Model outputs kept past backward"
    description = ("Tensors the step made, other than gradients, are still allocated when the optimizer step "
                   "starts: the loop keeps the model's output (logits, past_key_values) through backward, the "
                   "optimizer step and the next forward.")
    needs = ("memory",)
    severities = ("info", "warning")

    def match(self, ctx: Context):
        pm = E.peak_memory(ctx)
        tl = pm.timeline if pm is not None else None
        if not tl:
            return self.quiet("no memory timeline of the peak step")
        root = [(i, r.get("phase")) for i, r in enumerate(tl) if r.get("unit") is None]
        opt = next((i for i, ph in root if ph == "optimizer_start"), None)
        if opt is None:
            return self.quiet("no optimizer step on the peak step's memory timeline")
        tmp = [int(r.get("temporaries") or 0) for r in tl]
        peak = int(pm.peak_bytes)
        if pm.cuda is msgspec.UNSET and not E.on_gpu(ctx):
            # the CPU probe counts the step's own tensors from its first mark: those alive at the optimizer step
            # are what the step made and still holds
            kept, carried, source = tmp[opt], min(tmp[opt], tmp[0]), "records"
        else:
            # on CUDA the temporaries are the allocator's bytes outside every category: its workspaces (cuBLAS),
            # tensors older than the step, the output the loop kept from the step before. Only the trace's blocks
            # tell what the step's forward made and the loop still holds when the optimizer step starts
            tr = _trace_kept(ctx, pm)
            if tr is None:
                return self.quiet(f"{fmt_bytes(tmp[opt])} outside every category when the optimizer step starts: "
                                  "on CUDA that is the allocator's rest (its workspaces, tensors older than the "
                                  "step), and no profiler window with memory events (profile_memory) tells what "
                                  "the step's forward made among them")
            kept = min(tmp[opt], int(tr.forward_kept_bytes))
            carried, source = min(kept, int(tr.pre_step_freed_bytes)), "trace"
        # outside every category at the optimizer step but not kept from the forward (CUDA: the allocator's
        # workspaces, tensors older than the step): the share counts against what the step's own tensors take
        held = max(0, tmp[opt] - kept)
        if kept < max(OUTPUTS_KEPT_MIN_BYTES, OUTPUTS_KEPT_MIN_SHARE * (peak - held)):
            what = "of the step's tensors besides gradients are" if source == "records" else \
                "of what the step's forward made is"
            return self.quiet(f"{fmt_bytes(kept)} {what} alive when the optimizer step starts"
                              + (f" (beside {fmt_bytes(held)} outside every category that it did not keep: the "
                                 "allocator's workspaces, tensors older than the step)" if held else ""))
        after = _peak_with_outputs_freed(pm, tmp, root, opt, kept, carried)
        gain = peak - after
        sev = "warning" if (gain >= OUTPUTS_KEPT_WARN_SHARE * peak
                            or (E.peak_near_capacity(ctx) and gain >= OUTPUTS_KEPT_MIN_BYTES)) else "info"
        at_peak = (f"Freeing it lowers the peak ({pm.peak_at.phase}) by {fmt_bytes(gain)}." if gain > 0 else
                   f"The peak ({pm.peak_at.phase}) does not fall: the output is still needed there.")
        evidence = {"kept_bytes": kept, "kept_peak_pct": round(100 * kept / peak, 1), "peak_bytes": peak,
                    "peak_phase": pm.peak_at.phase, "peak_after_bytes": after, "peak_gain_bytes": gain,
                    "carried_into_next_forward_bytes": carried, "other_temporaries_bytes": held, "source": source}
        head = (f"When the optimizer step starts, {fmt_bytes(kept)} of tensors made in the step's forward are still "
                "allocated besides its gradients")
        if unread := E.torchtune_unread(ctx):
            # a torchtune recipe's train() binds a forward's returns to names it never reads (DPO's reference forward:
            # `..., _, _ = self.concatenated_forward(self._model, batch)`, its logits): no `outputs` there (a new-user
            # trial's fix named one); deleted after that line, the peak fell 16.33 -> 13.77 MiB as predicted
            names, them = ", ".join(unread), "it" if len(unread) == 1 else "them"
            evidence["unread_names"] = unread
            text = (f"{head}. torchtune's recipe ({E.torchtune_recipe(ctx)}) binds a forward's returns to {names} in "
                    f"its train() and never reads {them}: the tensors bound there (logits among them) live through "
                    "backward, the optimizer step and the next forward, until bound again. Delete "
                    f"{them} right after that line. {at_peak}")
            code = (f"# right after the forward that binds {them} (never read: {fmt_bytes(kept)} kept to the next "
                    f"step)\ndel {names}")
            where, inputs = "torchtune_train", {}
        else:
            text = (f"{head}: the loop keeps what the model returned (outputs = model(...); loss = outputs.loss, as "
                    "Hugging Face's no-trainer examples do), so its logits, and any cache it returns unless "
                    "use_cache=False (a transformer's past_key_values, a Mamba's cache_params), live through "
                    "backward, the optimizer step and the next forward, until the name "
                    "is bound again. Backward needs none of them: the loss keeps what it needs. Keep the loss only, "
                    f"or delete the output before backward. {at_peak}")
            code = ("# in your loop, once the loss is computed from the model's output and before loss.backward():\n"
                    f"del outputs  # its {fmt_bytes(kept)} (logits, any cache) freed in backward, not after the "
                    "next forward")
            where = "backward"
            inputs = {"outputs": "what your loop keeps of model(...)'s return (its output object or logits)"}
        return [self.finding(sev, f"{fmt_bytes(kept)} of the model's outputs kept past backward", evidence, text,
                             code, where=where, inputs=inputs,
                             predicted=E.predicted(E.step_ms(ctx), E.step_ms(ctx), peak, after))]


def _trace_kept(ctx: Context, pm):
    """The trace's memory row (``forward_kept_bytes``, ``pre_step_freed_bytes``) of the peak rank ``pm``, else
    the rank keeping the most; None where no trace window followed the blocks."""
    tm = ctx.report.overlap.memory if ctx.report.overlap is not None else None
    rows = {k: m for k, m in (tm.per_rank.items() if tm is not None else ())
            if m.forward_kept_bytes is not msgspec.UNSET}
    if not rows:
        return None
    rank = next((k for k, m in E.memory_per_rank(ctx).items() if m is pm), None)
    return rows.get(rank) or max(rows.values(), key=lambda m: m.forward_kept_bytes)


def _peak_with_outputs_freed(pm, tmp: list[int], root, opt: int, kept: int, carried: int) -> int:
    """The peak step's peak with the output deleted before backward: from the optimizer step on the rows lose what
    was kept; from the first backward mark, the part of it that backward does not hold itself (what the forward
    left outside every category when the model returned: the logits; past_key_values are saved activations
    there, freed layer by layer); the forward up to the model's return loses the output carried from the step
    before (only a GPU's allocator sees it; the CPU's count starts at the step), the model's return too (the
    loop binds the new output after it). The loss phase between the return and the first backward mark loses
    both: its high-water (taken to be the loss's gradient, after the deletion) counts from the return, where the
    carried output was still allocated (the counter follows the step's own tensors, not their frees)."""
    tl = pm.timeline
    out = next((i for i, ph in root if ph == "loss_start"), opt)
    bwd = next((i for i in range(out + 1, opt) if (tl[i].get("phase") or "").startswith("backward")), opt)
    unsaved = min(kept, max(0, tmp[out] - tmp[0]))
    return E.timeline_peak(pm, [([(0, out + 1)], -carried), ([(out + 1, bwd)], -(carried + unsaved)),
                                ([(bwd, opt)], -unsaved), ([(opt, len(tl))], -kept)])


@register
class EvalAutograd(Rule):
    code = "memory.eval_autograd"
    name = "Evaluation with autograd on"
    description = ("The model ran forward passes in eval mode with autograd on and no backward after them: an "
                   "evaluation without torch.no_grad(), which records the autograd graph and holds every "
                   "activation a training forward saves.")
    needs = ("records",)
    severities = ("info", "warning")

    def match(self, ctx: Context):
        per = {r: ng for r, ng in E.steps(ctx).no_grad.items() if ng.with_autograd}
        if not per:
            return self.quiet("no forward in eval mode with autograd on was left without a backward")
        rank, ng = max(per.items(), key=lambda kv: kv[1].with_autograd)
        # the steps that ran them, not every step with forwards without gradients (a new-user trial's RL loop read
        # "10 step(s)" for the 5 that evaluated in eval mode, and the generation's time as theirs)
        hit = {r: [s for s in rd.steps if s.autograd_eval_forwards] for r, rd in ctx.run.ranks.items()}
        steps = sorted({s.step for ss in hit.values() for s in ss})
        mine = hit.get(int(rank)) or hit.get(rank) or []
        ms = round(statistics.median(s.no_grad_ms for s in mine), 3) if mine else ng.ms_p50
        acts = max((int(u.activation_bytes or 0) for u in E.memory_units(ctx).values()), default=0)
        peak, cap = E.peak_bytes(ctx), E.capacity_bytes(ctx)
        held = (f" (the training forward's are {fmt_bytes(acts)} at its batch size)" if acts else "")
        # the peak in a step that ran them may hold their graphs (one trial's 3.22 MiB peak came down to 2.27
        # with the fix, where "unchanged" was predicted): not predicted there
        pm = E.peak_memory(ctx)
        at = pm.peak_at.step if pm is not None else None
        in_peak = at is not None and at in steps
        peak_words = (f"The training steps' time does not change: the doctor already leaves these forwards out "
                      f"of it. Their peak may: it lies in step {at}, which ran them, and may hold their graphs."
                      if in_peak else "The training steps' time and peak do not change: the doctor already leaves "
                      "these forwards out of them.")
        return [self.finding(
            "warning" if E.peak_near_capacity(ctx) else "info",
            f"{ng.with_autograd} evaluation forward passes ran with autograd on",
            {"forwards": ng.with_autograd, "rank": int(rank), "steps": steps, "ms_per_step_p50": ms,
             "training_forward_activation_bytes": acts or None, "peak_bytes": peak,
             "peak_capacity_pct": round(100 * peak / cap, 1) if peak and cap else None},
            f"In {len(steps)} step(s) ({E.fmt_list([str(s) for s in steps])}) the model ran {ng.with_autograd} forward "
            "passes in eval mode with autograd on, and no backward followed them: an evaluation without "
            "torch.no_grad(). Each records the autograd graph and keeps every activation it saves for a backward "
            f"that never comes{held} until its output is freed; under torch.no_grad() each layer's are freed as "
            "the next runs. An evaluation batch larger than the training one runs out of memory here first. "
            + peak_words,
            "with torch.no_grad():  # the model's forward passes that no backward follows\n"
            "    evaluate()",
            where="evaluation",
            inputs={"evaluate": "your evaluation: the code that runs the model in eval mode"},
            predicted=E.predicted(E.step_ms(ctx), E.step_ms(ctx), peak, None if in_peak else peak),
            ranks=sorted(int(r) for r in per))]


# resharding that frees less than this share of the peak is no lever for it
SPREAD_MIN_FREED_SHARE = 0.01


@register
class NearCapacitySpread(Rule):
    code = "memory.near_capacity_spread"
    name = "Peak near capacity, no dominant category"
    description = ("The peak is near capacity and no memory category dominates it (so no activation, optimizer "
                   "or offload rule applies), while units are kept unsharded after forward; or over capacity with "
                   "no finding whose fix brings it under.")
    needs = ("memory", "units")
    severities = ("warning", "critical")
    last = True  # (over capacity it reads the earlier findings' fixes: ctx.earlier)

    def match(self, ctx: Context):
        pm, cap, skip, quiet = E.near_capacity(ctx)  # (optim.before_shard's stale tensors aside)
        if skip or quiet:
            return self.skip(skip) if skip else self.quiet(quiet)
        peak = int(pm.peak_bytes)
        share = peak / cap
        # over capacity: with optim.before_shard's fix in (its stale tensors are no lever of this rule's)
        over = E.budget_peak(ctx) >= cap
        bd = {k: v for k, v in pm.peak_breakdown.items() if v}
        # (temporaries as memory.temporaries weighs them: those the step made, not the workspaces held before it)
        made = {**bd, "temporaries": E.step_temporaries(pm)[0]} if "temporaries" in bd else bd
        top = max(made, key=made.get) if made else None
        # (temporaries: where memory.temporaries fired; it names no lever for a peak outside the loss and the units'
        # forward and backward, and a trial's torchtitan peak at 91% read no memory finding, both rules quiet)
        told = top != "temporaries" or any(f.code == "memory.temporaries" for f in ctx.earlier)
        if top is not None and made[top] / peak >= T.DOMINANT_CATEGORY_SHARE and told:
            return self.quiet(f"{top} dominates the peak ({fmt_share(made[top] / peak)}): "
                              + ("memory.temporaries applies" if top == "temporaries" else "its own rule applies"))
        kept = [u for u in E.non_root(E.param_units(ctx)) if E.kept_gathered(u)]
        if not kept:
            if over:
                return self._over_capacity(ctx, peak, cap, bd)
            return self.quiet("no unit is kept unsharded after forward: no reshard lever")
        # the last unit of forward stays gathered: FSDP2's backward gathers it at once, with nothing to overlap
        # (reshard.last_unit's advice; resharding it, a new-user trial's only unit kept gathered, made that rule ask
        # for it back, and the peak with it)
        last = E.last_forward_unit(ctx)
        flip = [u for u in kept if last is None or u.name != last.name]
        if not flip:
            if over:
                return self._over_capacity(ctx, peak, cap, bd)
            return self.quiet(f"the one unit kept gathered after forward is {last.name!r}, the last unit of forward, "
                              "whose backward gathers it again at once with nothing to overlap (reshard.last_unit "
                              "keeps it gathered): no reshard lever")
        after = _peak_resharded(pm, flip)
        freed = peak - after
        if freed < SPREAD_MIN_FREED_SHARE * peak:  # (a selective checkpoint's recompute set the peak, in
            # the last block's backward, where the unit kept gathered is gathered anyway: "peak unchanged", a warning)
            if over:
                return self._over_capacity(ctx, peak, cap, bd)
            return self.quiet(f"resharding {len(flip)} unit(s) kept gathered after forward frees {fmt_bytes(freed)} "
                              f"at the peak (its step's timeline), under "
                              f"{100 * SPREAD_MIN_FREED_SHARE:.0f}% of it")
        waits = [u.timing.ag_wait_fwd_ms for u in flip if u.has_timing and u.timing.ag_wait_fwd_ms is not None]
        step = E.step_ms(ctx)
        # each flipped unit all-gathers once more in backward: about what its forward all-gather waits
        slower = sum(waits) if len(waits) == len(flip) else None
        names = [u.name for u in flip]
        sev = "critical" if over else "warning"
        # at run time, on the modules fully_shard was applied to (a grouped unit: any of its modules)
        # (as reshard.zero2_affordable's: a loop past 80 columns or 6 units, a unit inside accelerate's
        # CheckpointWrapper reached through the wrapper's place; one line per unit named
        # "model.get_submodule('model.layers.0._checkpoint_wrapped_module')" read 111 columns: a new-user trial)
        if len(flip) > 12:
            lines = ["from torch.distributed.fsdp import FSDPModule",
                     "for module in model.modules():  # every unit but the root",
                     "    if isinstance(module, FSDPModule) and module is not model:",
                     "        module.set_reshard_after_forward(True, recurse=False)"]
        else:
            lines = S.set_on_units([u.modules[0] if u.modules else u.name for u in flip],
                                   "set_reshard_after_forward(True, recurse=False)").splitlines()
        lacks = S.lacks_reshard_switch(ctx.config)
        if lacks:
            lines = []
        return [self.finding(
            sev, f"Peak at {fmt_share(share)} of capacity, spread over categories; "
            f"{len(kept)} unit(s) kept gathered after forward",
            {"peak_bytes": peak, "capacity_bytes": cap, "peak_capacity_pct": round(100 * share, 1),
             "largest_category": top, "largest_category_pct": round(100 * bd[top] / peak, 1) if top else None,
             "breakdown_bytes": dict(sorted(bd.items(), key=lambda kv: -kv[1])),
             "units_kept_gathered": len(kept), "freed_bytes": freed},
            f"The peak is {fmt_share(share)} of capacity and no category holds {100 * T.DOMINANT_CATEGORY_SHARE:.0f}% "
            f"of it; {len(kept)} unit(s) keep their gathered parameters from forward to backward "
            f"(reshard_after_forward=False, ZeRO-2). Resharding {len(flip)} of them after forward lowers the peak by "
            f"{fmt_bytes(freed)}, at the price of one more all-gather per unit in backward (the last unit of forward "
            "aside: its backward starts at once)." + (S.reshard_in_calls_words(names, True) if lacks else ""),
            "\n".join(lines),
            predicted=E.predicted(step, step + slower if (step is not None and slower is not None) else None,
                                  peak, after),
            units=names)]


    def _over_capacity(self, ctx: Context, peak: int, cap: int, bd: dict) -> list:
        """Over capacity, no category dominating and no unit kept gathered: a new-user trial's peak at 104% of its
        budget (optimizer state 39%, under the 40% optim.state_dominates fires from) had no memory finding at all.
        The finding says where the bytes are and what lowers each part, in words (which lever fits is the user's
        choice: more ranks, a dtype, checkpointing); quiet where an earlier finding's fix brings the peak under."""
        for f in ctx.earlier:
            after = getattr(f.predicted, "peak_bytes_after", None) if f.predicted else None
            if f.severity in ("warning", "critical") and after is not None and after < cap:
                return self.quiet(f"the peak is {fmt_share(peak / cap)} of capacity, and {f.code}'s fix brings it "
                                  f"under ({fmt_bytes(after)} of {fmt_bytes(cap)})")
        parts = sorted(bd.items(), key=lambda kv: -kv[1])
        said = ", ".join(f"{k.replace('_', ' ')} {fmt_bytes(v)} ({fmt_share(v / peak)})" for k, v in parts[:4])
        big = [k for k, v in parts if v >= 0.1 * peak]  # (a tenth of the peak or more: a part worth lowering)
        levers = [text for cats, text in _OVER_LEVERS if any(k in cats for k in big)]
        return [self.finding(
            "critical", f"Peak at {fmt_share(peak / cap)} of capacity, spread over categories: it does not fit",
            {"peak_bytes": peak, "capacity_bytes": cap, "peak_capacity_pct": round(100 * peak / cap, 1),
             "largest_category": parts[0][0] if parts else None,
             "breakdown_bytes": dict(parts), "units_kept_gathered": 0},
            f"The peak is {fmt_bytes(peak)} of {fmt_bytes(cap)} of capacity ({fmt_share(peak / cap)}) and no category "
            f"holds {100 * T.DOMINANT_CATEGORY_SHARE:.0f}% of it, so no single rule's lever is enough and none of "
            f"this run's findings brings it under: {said}. What lowers its largest parts: " + "; ".join(levers)
            + ". Which fits is your choice (the ranks you have, the precision you train in): no code is offered.")]


@register
class TemporariesDominate(Rule):
    code = "memory.temporaries"
    name = "Temporaries dominate a peak near capacity"
    description = ("The operators' temporaries (what an operation allocates and frees within the step: the loss's "
                   "logits and their gradients, attention's scores where attention runs eagerly) hold the largest "
                   "part of a peak near capacity, which no FSDP setting or checkpointing lowers; where they are "
                   "says what does.")
    needs = ("memory",)
    severities = ("warning", "critical")

    def match(self, ctx: Context):
        pm, cap, skip, quiet = E.near_capacity(ctx)
        if skip or quiet:
            return self.skip(skip) if skip else self.quiet(quiet)
        peak, at = int(pm.peak_bytes), pm.peak_at
        tmp, held = E.step_temporaries(pm)  # (on CUDA the workspaces and what was kept from before: not the step's)
        if tmp / peak < T.DOMINANT_CATEGORY_SHARE:
            return self.quiet(E.below_share("temporaries made in the step", tmp, peak, "the peak",
                                            T.DOMINANT_CATEGORY_SHARE)
                              + (f" (beside {fmt_bytes(held)} already outside every category at its first mark)"
                                 if held else ""))
        roots = {u.name for u in E.roots(E.units(ctx))} or {""}
        inside, half = at.phase in ("in_forward", "in_backward"), "forward" if at.phase == "in_forward" else "backward"
        if at.phase in ("in_loss", "loss_start"):
            where, place = "loss", "in the loss, after the model returned"
        elif inside and at.unit in roots and (part := _root_part(pm, roots)) is not None:
            # before the first unit's forward, or between units: the root's modules there, not the head (a new-user
            # trial's DETR: its ResNet stem on 128 x 128 images read "the logits ... tokens x vocabulary")
            mods = _root_modules_at(ctx, part)
            named = f" ({E.fmt_list(mods[:4] + ([f'{len(mods) - 4} more'] if len(mods) > 4 else []))})" if mods else ""
            where = "root"
            place = f"in the root's own forward, {'before its first unit' if part == 'lead' else 'between units'}"
            place += named
        elif inside and at.unit in roots:
            where, place = "loss", (f"in the root's own {half} (its operators outside every other unit: the output "
                                    "head and, where the model computes it, the loss)")
        elif inside and at.unit and S.block_of(at.unit) == S.strip_ckpt(at.unit):  # a repeated block
            where, place = "unit", f"inside {at.unit}'s {half}"
        elif inside and at.unit and at.unit == _last_to_end(pm, roots):  # after every block: a [norm, head] unit
            where, place = "loss", f"inside {at.unit}'s {half}, the last unit of forward: the output head"
        else:
            return self.quiet(f"the peak's temporaries ({fmt_bytes(tmp)}, {fmt_share(tmp / peak)} of it) lie "
                              f"{at.phase or 'outside the marks'}, outside the loss and every unit's forward and "
                              "backward: " + ("the optimizer step's (optim.foreach_temporaries weighs them)"
                                              if "optimizer" in (at.phase or "") else "no lever named for them"))
        low = _what_lowers(ctx, where, pm, held)
        sev = "critical" if E.budget_peak(ctx) >= cap else "warning"
        step = f"step {at.step}, " if at.step is not None else ""
        return [self.finding(
            sev, f"Temporaries hold {fmt_share(tmp / peak)} of a peak at {fmt_share(peak / cap)} of capacity, "
                 + ("in the loss and output head" if where == "loss" else "in the root's own forward" if where == "root"
                    else "inside " + unit_label(at.unit)),
            {"peak_bytes": peak, "capacity_bytes": cap, "peak_capacity_pct": round(100 * peak / cap, 1),
             "temporaries_bytes": tmp, "temporaries_pct": round(100 * tmp / peak, 1), "held_before_bytes": held,
             "where": where, "peak_unit": unit_label(at.unit), "peak_phase": at.phase, "loss_chunks": low.chunks},
            f"At the peak ({step}{place}) the temporaries the step's operators made hold {fmt_bytes(tmp)} of "
            f"{fmt_bytes(peak)} ({fmt_share(tmp / peak)}), and the peak is {fmt_share(peak / cap)} of "
            f"{fmt_bytes(cap)} of capacity. {low.text}", low.code, where=low.where,
            predicted=E.predicted(E.step_ms(ctx), None, peak, low.peak_after) if low.peak_after is not None else None)]


class _Lowering(NamedTuple):
    """What lowers a peak's temporaries (memory.temporaries): the levers in words, the fix (code, where it goes: ""
    for none), its predicted peak (None: not predicted), and the chunks the output is computed in already."""

    text: str
    code: str = ""
    where: str = ""
    peak_after: int | None = None
    chunks: int | None = None


def _what_lowers(ctx: Context, where: str, pm, held: int) -> _Lowering:
    """By where the temporaries lie (``where``: "loss" or "unit"): inside a repeated block, its operators' levers and,
    for a Hugging Face model running attention eagerly that can run scaled_dot_product_attention, its own switch (a
    trial's eager Llama at 1,024 tokens: peak 116.65 MiB, 95% temporaries; with sdpa 27.37 MiB); in the loss, the
    logits' levers, less the chunked loss a model or loss has already (torchtune's num_output_chunks; a loss running
    the head per chunk from outside the model's forward, torchtitan's ChunkedLossWrapper, whose chunks double on its
    command line)."""
    cfg = ctx.config
    if where == "root":  # (16-bit compute named where the run computes in 32 bits)
        half = {"bfloat16", "float16"}
        low16 = any(u.param_dtype in half or (bool(u.orig_dtypes) and set(u.orig_dtypes) <= half) for u in E.units(ctx))
        return _Lowering(f"{_ROOT_LEVERS}{'.' if low16 else _ROOT_16BIT} {_NO_CODE}")
    if where == "unit":
        impl, can = getattr(cfg, "attn_implementation", None), getattr(cfg, "attn_implementations", None)
        if impl == "eager" and (can is None or "sdpa" in can):
            return _Lowering(f"{_UNIT_LEVERS} {_EAGER_SWITCH}", S.ATTN_SWITCH["sdpa"])
        return _Lowering(f"{_UNIT_LEVERS} {_NO_CODE}")
    chunks = getattr(cfg, "output_chunks", None) or 0
    if chunks >= 2:  # torchtune's CEWithChunkedOutputLoss already (not to be advised again)
        return _Lowering(f"{_CHUNKED_LEVERS.format(chunks)} {_NO_CODE}", chunks=chunks)
    titan = E.torchtitan_version(ctx)
    head = E.chunked_head(ctx)
    if head is None:
        return _Lowering(f"{_LOSS_LEVERS}{_TITAN_CHUNKED if titan is not None else ''} {_NO_CODE}")
    n, text = head[1], _LOSS_CHUNKED_LEVERS.format(head=head[0], n=head[1])
    lengths = E.sequence_lengths(ctx) if titan is not None else set()
    m = more_chunks(n, lengths)
    # (with no count that divides, the doubled one only asks whether this torchtitan's table knows the setting)
    code = S.titan_settings(titan, loss_num_chunks=m or 2 * n) if titan is not None else None
    if not code:
        return _Lowering(f"{text} {_NO_CODE}", chunks=n)
    says, seq = f"{S.titan_says(titan)}, whose loss takes its number of chunks", "/".join(map(str, sorted(lengths)))
    if m is None:
        return _Lowering(f"{text} {says}, but no number from {n + 1} to {4 * n} divides the sequence length ({seq} "
                         "tokens), as its ChunkedLossWrapper requires: no code is offered.", chunks=n)
    size = "halves them" if m == 2 * n else f"makes them {fmt_share(n / m)} of their size"
    fits = (f"{m} divides the sequence length, {seq} tokens, as its ChunkedLossWrapper requires" if lengths else
            "the training sequence length must be a multiple of it")
    return _Lowering(f"{text} {says}: {m} {size} ({fits}).", code, "torchtitan", _loss_chunks_shrunk(pm, held, n / m),
                     n)


def more_chunks(n: int, lengths: set[int]) -> Optional[int]:
    """The chunks to advise for a loss computed in ``n`` chunks of sequences ``lengths`` tokens long, a number that
    divides every length (torchtitan's ChunkedLossWrapper raises otherwise: "sequence length must be divisible by
    num_chunks"): twice as many where that divides them (or the lengths are not known), else the fewest from 2n to 4n
    that do, else the most above n that do; None where no number from n + 1 to 4n does."""
    if all(length % (2 * n) == 0 for length in lengths):
        return 2 * n
    fits = [m for m in range(n + 1, 4 * n + 1) if all(length % m == 0 for length in lengths)]
    return next((m for m in fits if m >= 2 * n), fits[-1] if fits else None)


def _loss_chunks_shrunk(pm, held: int, scale: float) -> int:
    """The peak with a chunked loss's chunks ``scale`` of their size (n / m where n chunks become m): at every mark of
    the loss, from its first start to its last high-water (the head's marks between them), the chunk's tensors shrink
    so: the temporaries the step made (less ``held``, those at its first mark: each chunk's logits and their
    gradients) and the activations beyond those the model's forward saved (what the chunk's loss saves for its
    backward, its log-softmax: a new-user trial's 16 of 23.54 MiB; with the temporaries alone 89.09 MiB was predicted
    where 81.45 MiB was measured)."""
    tl, cut = pm.timeline or [], 1.0 - scale
    rows = [i for i, r in enumerate(tl) if r.get("phase") in ("loss_start", "in_loss")]
    if not rows:
        return int(pm.peak_bytes) - int(max(0, int(pm.peak_breakdown.get("temporaries") or 0) - held) * cut)
    added, saved = [0.0] * len(tl), int(tl[rows[0]].get("activations") or 0)
    for i in range(rows[0], rows[-1] + 1):
        r = tl[i]
        made = max(0, int(r.get("temporaries") or 0) - held) + max(0, int(r.get("activations") or 0) - saved)
        added[i] = -made * cut
    return E.peak_with_rows(pm, added)


def _root_part(pm, roots: set) -> str | None:
    """Where in the root's own forward the peak step's highest mark lies: "lead" before any other unit's forward
    starts (the root's modules there: a vision model's stem, the embeddings), "between" two units' forwards; None after
    the last one (the output head and a loss computed in the forward), for a root without other units, or without the
    peak step's timeline."""
    tl = pm.timeline or []
    if not tl or pm.timeline_step != pm.peak_at.step:
        return None
    i = max(range(len(tl)), key=lambda j: int(tl[j].get("total") or 0))
    if tl[i].get("unit") not in roots or tl[i].get("phase") != "in_forward":
        return None
    is_root = lambda j, ph: tl[j].get("unit") in roots and tl[j].get("phase") == ph  # noqa: E731
    start = next((j for j in range(i, -1, -1) if is_root(j, "forward_start")), 0)
    end = next((j for j in range(i, len(tl)) if is_root(j, "forward_end") or is_root(j, "backward_start")), len(tl))
    unit_starts = lambda js: any(tl[j].get("phase") == "forward_start" and tl[j].get("unit") not in roots  # noqa: E731
                                 and tl[j].get("unit") is not None for j in js)
    before, after = unit_starts(range(start, i)), unit_starts(range(i, end))
    return None if not after else "between" if before else "lead"


def _root_modules_at(ctx: Context, part: str) -> list[str]:
    """The root's own modules in that part of its forward (``_root_part``), from the snapshot: those before its first
    unit (``leading_modules``) for "lead", the others but the trailing ones for "between"; [] where not recorded."""
    tree = S.tree(ctx)
    root = tree.root()
    leading = getattr(root, "leading_modules", None) if root is not None else None
    if leading is None:
        return []
    trailing = set(root.trailing_modules or [])
    mods = [m for m in leading if m] if part == "lead" else \
        [m for m in root.own_modules or [] if m and m not in leading and m not in trailing]
    return S.as_planned(mods, tree.containers(), S.kept_in_root(tree)[1])  # (named as the plans name them)


def _last_to_end(pm, roots: set) -> str | None:
    """The unit other than the root whose forward ends last on the peak step's timeline (None: no timeline)."""
    ends = [u for u in E.timeline_units(pm, "forward_end") if u not in roots]
    return ends[-1] if ends else None


#: memory.temporaries: what they are and what lowers them, by where the peak lies
_LOGITS = "There they are the logits the output head makes for every token of the micro-batch (tokens x vocabulary)"
_UNMOVED = "Resharding, offloading and checkpointing the blocks leave them as they are."
_SMALLER = "a smaller micro-batch with gradient accumulation (they shrink with its tokens)"
_LOSS_LEVERS = (
    f"{_LOGITS}, their log-softmax and their gradients, in float32 where the loss upcasts them. {_UNMOVED} What "
    "lowers them: the loss computed in chunks of the tokens, each chunk's logits made from the head's input and freed "
    "before the next (a fused linear cross-entropy: Liger Kernel's, which Hugging Face's "
    f"TrainingArguments(use_liger_kernel=True) applies; torchtune's CEWithChunkedOutputLoss), or {_SMALLER}.")
# a model that computes its output in chunks already (torchtune's num_output_chunks, RunConfig.output_chunks)
_CHUNKED_LEVERS = (
    f"{_LOGITS} and their gradients. The model computes them in {{}} chunks already (num_output_chunks, for "
    "torchtune's CEWithChunkedOutputLoss), which upcasts one chunk at a time but keeps every chunk's logits from the "
    f"forward to the loss's backward. {_UNMOVED} What lowers them: {_SMALLER}, or a loss fused with the head that "
    "never holds the whole micro-batch's logits (Liger Kernel's fused linear cross-entropy).")
# a loss outside the model's forward that runs the head per chunk (E.chunked_head: torchtitan's ChunkedLossWrapper)
_LOSS_CHUNKED_LEVERS = (
    "There they are the logits the output head makes for one chunk of the micro-batch's tokens (its tokens x "
    "vocabulary), their log-softmax and their gradients: the loss computes them in {n} chunks already, code outside "
    "the model's forward running the head (in the unit {head!r}) once per chunk and freeing each chunk's before the "
    f"next (torchtitan's ChunkedLossWrapper does). {_UNMOVED} What lowers them: more chunks (each chunk's logits "
    f"shrink with its tokens), or {_SMALLER}.")
# the root's own operators before its first unit or between units (a vision model's stem)
_ROOT_LEVERS = (
    "There they are what the root's own operators make from the micro-batch's inputs before the next unit runs (a "
    "vision model's stem: each convolution's, normalization's and activation's output at the input's resolution). "
    "Resharding, offloading and checkpointing leave them as they are, and so would a unit of their own (it gathers "
    "parameters, not activations). What lowers them: a smaller micro-batch with gradient accumulation (they shrink "
    "with it)")
_ROOT_16BIT = (", or 16-bit compute (MixedPrecisionPolicy(param_dtype=torch.bfloat16) on the root casts its "
               "floating-point inputs too: what its operators compute in 16 bits takes half the bytes).")
_NO_CODE = ("No code is offered: they are made by your model's operators or your loss, which the doctor does not "
            "rewrite.")
_EAGER_SWITCH = ("This Hugging Face model runs its attention eagerly (attn_implementation 'eager') and can run "
                 "scaled_dot_product_attention: the snippet switches every attention layer.")
# torchtitan with a loss that is not chunked
_TITAN_CHUNKED = (" torchtitan has such a loss: its ChunkedLossWrapper (its llama3 configs' default), set in your "
                  "config_registry function on the Trainer.Config it returns: config.loss = "
                  "ChunkedLossWrapper.Config(num_chunks=8).")
_UNIT_LEVERS = (
    "There they are intermediates that the unit's operators allocate and free (where attention runs eagerly, its "
    "score matrix, batch x heads x sequence x sequence; an MLP's hidden activations between its matmuls; a "
    "convolution's workspace). Checkpointing does not lower them (its recompute makes them again in backward), nor "
    "does any FSDP setting. What lowers them: a smaller micro-batch with gradient accumulation (they shrink with its "
    "size), and where attention runs eagerly a fused kernel (torch.nn.functional.scaled_dot_product_attention; "
    "attn_implementation=\"sdpa\" for a Hugging Face model).")


#: over capacity, what lowers each of the peak's largest categories (memory.near_capacity_spread)
_OVER_LEVERS = (
    (("sharded_params", "sharded_grads", "optimizer_state"),
     "the sharded state (parameters, gradients, optimizer state: each rank holds 1/N of it) shrinks with more ranks, "
     "with bf16 parameters (MixedPrecisionPolicy(param_dtype=torch.bfloat16)), or moves to the host "
     "(CPUOffloadPolicy)"),
    (("activations",), "activations shrink with activation checkpointing on the blocks, or a smaller micro-batch "
                       "with gradient accumulation"),
    (("unsharded_params", "unsharded_grads", "comm_buffers"),
     "gathered parameters and their buffers shrink with smaller units (fewer parameters gathered at once) and no "
     "explicit forward prefetch"),
    (("temporaries",), "temporaries (what operators allocate within the step: the loss's logits, attention's scores "
                       "where it runs eagerly) shrink with a smaller micro-batch, the logits with a loss computed in "
                       "chunks"),
)


def _peak_resharded(pm, flip) -> int:
    """The peak with ``flip`` resharded after forward: on the peak step's timeline each unit's gathered bytes
    leave the marks from its forward's end to its backward all-gather (``estimate.held_windows``, the windows
    ZeRO-2 adds them in), and the new peak is the highest mark. Without a timeline: the peak less the
    gathered parameters it holds."""
    tl = pm.timeline
    if not tl:
        held = pm.peak_breakdown.get("unsharded_params", 0)
        return int(pm.peak_bytes) - min(held, sum(u.unsharded_bytes for u in flip))
    return E.timeline_peak(pm, [(E.held_windows(tl, u.name), -u.unsharded_bytes) for u in flip])


# one step with retries is not a pattern: from this many steady steps with retries the finding is a warning
RETRY_MIN_STEPS = 2
# the peak allocation fills this share of what the allocator may reserve or more: the retries come from the peak
# itself, with what each CUDA stream keeps cached beside it (FSDP2 allocates its all-gather and reduce-scatter
# buffers on streams of their own, and no stream reuses another's cached memory without a retry), not from blocks
# too small to reuse. Measured on the H200 (benchmarks/alloc_retries_probe.py, the GPU row gpu_gpt_alloc_retries):
# at a peak 76% of the limit 6 retries in 5 steps, 4 with expandable segments; at 65%, none with either
RETRY_PEAK_FILLS_SHARE = 0.70
# what expandable segments left of the retries there (4 of 6), quoted when the peak fills the limit
RETRY_EXPANDABLE_LEFT = "4 of 6"


class _Retries(NamedTuple):
    """One rank's cudaMalloc retries over its steady steps (step records' allocator figures)."""

    steps: dict[int, int]  # steady step -> the retries it added
    steady: int  # steady steps with allocator figures
    with_ms: list[float]  # wall times of the steps with retries
    without_ms: list[float]  # ... and of the others
    ooms: int  # out-of-memory errors the allocator raised (and the program caught) in those steps
    worst: CudaMemory  # the allocator figures of the steady step that reserved the most


def _retries(ctx: Context) -> dict[int, _Retries]:
    """Per rank: the allocator's cumulative counts read at each step's end, differenced step to step (a count
    first read at a step holds everything since the process started: no step's own)."""
    from ...analyze.steps import usable_steps

    out = {}
    for rank, rd in (getattr(ctx.run, "ranks", None) or {}).items():
        steady = {s.step for s in usable_steps(rd.steps)}
        read = sorted((s for s in rd.steps if s.memory is not None and s.memory.cuda is not None
                       and s.memory.cuda.alloc_retries is not None), key=lambda s: s.step)
        steps, with_ms, without_ms, ooms, worst, prev = {}, [], [], 0, None, None
        for s in read:
            c = s.memory.cuda
            if prev is not None and s.step in steady:
                added = c.alloc_retries - prev.alloc_retries
                if added > 0:
                    steps[s.step] = added
                (with_ms if added > 0 else without_ms).append(s.wall_ms)
                ooms += max(0, (c.ooms or 0) - (prev.ooms or 0))
                if worst is None or (c.reserved or 0) > (worst.reserved or 0):
                    worst = c
            prev = c
        if worst is not None:
            out[int(rank)] = _Retries(steps, len(with_ms) + len(without_ms), with_ms, without_ms, ooms, worst)
    return out


@register
class AllocRetries(Rule):
    code = "memory.alloc_retries"
    name = "CUDA allocator retries"
    description = ("cudaMalloc failed inside steps, and PyTorch's caching allocator released its cached blocks "
                   "(a device synchronization) and tried again: the device is full of reserved memory the next "
                   "allocation cannot use. Expandable segments remove that fragmentation.")
    needs = ("memory", "gpu")
    severities = ("info", "warning")

    def match(self, ctx: Context):
        per = _retries(ctx)
        if not per:
            return self.quiet("no allocator figures in the steady steps' records (CUDA runs record them)")
        rank = max(per, key=lambda r: (len(per[r].steps), sum(per[r].steps.values())))
        rt = per[rank]
        if not rt.steps:
            return self.quiet(f"no cudaMalloc retries in {rt.steady} steady steps on any rank")
        cfg, w = ctx.config, rt.worst
        conf = dict(cfg.alloc_conf) if cfg is not None else {}
        settings = ",".join(conf.values()).replace(" ", "").lower()
        total = w.allocator_limit or w.device_total or E.capacity_bytes(ctx)  # what the allocator may reserve
        pm = E.peak_memory(ctx)
        peak = int(pm.peak_bytes) if pm is not None else None
        fills = bool(peak and total and peak >= RETRY_PEAK_FILLS_SHARE * total)
        n, count = len(rt.steps), sum(rt.steps.values())
        step = E.step_ms(ctx)
        # the steps with retries at the others' median; the median step moves only if they are half or more. Where
        # the steps with retries are no slower than the others (their work differs: sequence lengths that vary),
        # the retries' cost is not measurable here: no step gain is quoted
        after = None
        if rt.without_ms and step is not None:
            base = statistics.median(rt.without_ms)
            after = min(step, statistics.median(rt.without_ms + [base] * len(rt.with_ms))) \
                if statistics.median(rt.with_ms) > base else step
        evidence = {
            "rank": rank, "retries": count, "steps_with_retries": n, "steady_steps": rt.steady,
            "retry_steps": sorted(rt.steps)[:20], "ooms": rt.ooms,
            "step_ms_with_retries": round(statistics.median(rt.with_ms), 3),
            "step_ms_without_retries": round(statistics.median(rt.without_ms), 3) if rt.without_ms else None,
            "reserved_bytes": w.reserved, "allocated_bytes": w.allocated, "fragmentation_bytes": w.fragmentation,
            "inactive_split_bytes": w.inactive_split_bytes, "largest_free_block_bytes": w.largest_free_block,
            "device_total_bytes": w.device_total, "allocator_limit_bytes": w.allocator_limit, "peak_bytes": peak,
            "alloc_conf": conf or None}
        sev = "warning" if n >= RETRY_MIN_STEPS else "info"
        title = (f"cudaMalloc retried {count} time(s) in {n} of {rt.steady} steady steps on rank {rank}: each "
                 "retry frees the allocator's cache and synchronizes the device")
        why = ("When no cached block fits an allocation and the device has no room for a new segment, the caching "
               "allocator releases every unused cached block, which waits for the device to finish its work, and "
               f"calls cudaMalloc again. At the step that reserved the most, {fmt_bytes(w.reserved or 0)} were "
               f"reserved for {fmt_bytes(w.allocated or 0)} allocated at the step's end")
        already = ("Expandable segments are" if "expandable_segments:true" in settings else
                   "The cudaMallocAsync backend is" if "backend:cudamallocasync" in settings else None)
        predicted = E.predicted(step, after, peak, peak)
        if already or fills:  # the allocator is not the lever: the peak is (advice in words)
            below = int(peak - RETRY_PEAK_FILLS_SHARE * total) if fills else 0
            cause = (f". {already} already on ({', '.join(f'{k}={v}' for k, v in conf.items())}), so the "
                     "allocations themselves meet the device's memory" if already else
                     f"; the peak allocation itself ({fmt_bytes(peak)}) fills {fmt_share(peak / total)} of the "
                     f"{fmt_bytes(total)} the allocator may reserve"
                     + ("" if not w.allocator_limit else " (this process's memory fraction)")
                     + ". Each CUDA stream keeps its own cached memory (FSDP2 allocates its all-gather and "
                     "reduce-scatter buffers on streams of their own), and one stream's cache reaches another only "
                     "through a retry, expandable segments or not: in this project's H200 measurement they left "
                     f"{RETRY_EXPANDABLE_LEFT} retries at a peak 76% of the limit, and at 65% there were none with or "
                     "without them")
            lower = (f" by {fmt_bytes(below)} or more (to {100 * RETRY_PEAK_FILLS_SHARE:.0f}% of the limit)"
                     if below > 0 else "")
            return [self.finding(
                sev, title, evidence,
                f"{why}{cause}: lower the peak{lower} (the memory findings above: checkpointing, resharding after "
                "forward, offload) or the batch.", predicted=predicted, ranks=[rank])]
        return [self.finding(
            sev, title, evidence,
            f"{why}: blocks cached for earlier sizes (sequence lengths that vary, the all-gather and "
            "reduce-scatter buffers of units of different sizes) that the next allocation cannot reuse. With "
            "expandable segments the allocator maps more memory into one segment as it grows instead of "
            "reserving fixed-size segments, so freed memory is reused whatever the sizes and the retries go. The "
            "setting takes effect when the allocator starts; the allocation itself does not change (the peak "
            "stays), the step loses the retries' synchronizations"
            + ("" if not rt.without_ms else f" (the steps with retries take {evidence['step_ms_with_retries']:.1f} "
               f"ms, the others {evidence['step_ms_without_retries']:.1f} ms)") + ".",
            S.expandable_segments_code(conf), where="startup", predicted=predicted, ranks=[rank])]


# memory.growing: the device memory allocated at each step's end grows step after step (tensors the loop keeps from
# every step: outputs or logits appended to a list for metrics, a cache that keeps filling). The 32 scenario runs
# recorded on the H100 (traces/gpu) end every steady step with the same bytes allocated, to the byte; the reference
# workload's two (traces/gpu_device_time) grow 512 B a step, its loop keeping each step's loss in a list: growth in
# this share of the consecutive steady steps or more ...
GROW_MIN_SHARE = 0.8
GROW_MIN_STEPS = 5  # ... of this many steady steps or more ...
GROW_MIN_BYTES = 1 << 20  # ... by this much or more over them (the allocator rounds a kept scalar to 512 B)
# the device full within this many steps at that rate: a warning (a leak, however slow, ends a long run in an
# out-of-memory error); beyond it a note
GROW_WARN_STEPS = 100_000


class _Growth(NamedTuple):
    """One rank's device memory allocated at the end of its steady steps (CUDA), growing."""

    steps: list[int]
    allocated: list[int]  # bytes, at each of those steps' end
    grew: int  # consecutive steps whose end allocation grew
    per_step: float  # bytes a step (the resistant line's slope)
    last: CudaMemory  # the last step's figures


def _growth(ctx: Context) -> dict[int, _Growth]:
    """Per rank, the allocator's bytes at each steady step's end (records of a CUDA run; {} elsewhere)."""
    from ...analyze.steps import resistant_slope, usable_steps

    out = {}
    for rank, rd in (getattr(ctx.run, "ranks", None) or {}).items():
        read = [s for s in usable_steps(rd.steps) if s.memory is not None and s.memory.cuda is not None
                and s.memory.cuda.allocated is not None]
        if not read:
            continue
        steps, alloc = [s.step for s in read], [int(s.memory.cuda.allocated) for s in read]
        out[int(rank)] = _Growth(steps, alloc, sum(b > a for a, b in zip(alloc, alloc[1:])),
                                 resistant_slope(steps, alloc), read[-1].memory.cuda)
    return out


@register
class Growing(Rule):
    code = "memory.growing"
    name = "Device memory growing every step"
    description = ("The device memory allocated at the end of each step grows step after step: tensors the loop keeps "
                   "from every step (outputs or logits appended to a list, a loss summed without .item(), a cache "
                   "that keeps filling), which end the run in an out-of-memory error. When, and how fast.")
    needs = ("memory", "gpu")
    severities = ("info", "warning")

    def match(self, ctx: Context):
        per = _growth(ctx)
        if not per:
            return self.quiet("no allocator figures in the steady steps' records (CUDA runs record them)")
        rank = max(per, key=lambda r: per[r].allocated[-1] - per[r].allocated[0])
        g = per[rank]
        n = len(g.steps)
        grown = g.allocated[-1] - g.allocated[0]
        if n < GROW_MIN_STEPS:
            return self.quiet(f"{n} steady steps with allocator figures (needs {GROW_MIN_STEPS})")
        if g.grew < GROW_MIN_SHARE * (n - 1) or grown < GROW_MIN_BYTES or g.per_step <= 0:
            return self.quiet(f"the memory allocated at a step's end changed by {fmt_bytes(grown)} over {n} steady "
                              f"steps on rank {rank}, growing in {g.grew} of {n - 1}: not "
                              f"steady growth (fires from {fmt_bytes(GROW_MIN_BYTES)}, growing in "
                              f"{100 * GROW_MIN_SHARE:.0f}% of the steps)")
        peak = E.peak_bytes(ctx)
        w = g.last
        limit = w.allocator_limit or w.device_total or E.capacity_bytes(ctx)
        top = w.max_allocated or peak
        left = int((limit - top) / g.per_step) if limit and top and limit > top else None
        step = E.step_ms(ctx)
        when = ""
        if left is not None:
            when = (f" At this rate the step's peak ({fmt_bytes(top)}) reaches the {fmt_bytes(limit)} the allocator "
                    f"may use in about {left:,} more steps"
                    + (f" ({fmt_duration(left * step / 1000)} at {fmt_ms(step)} a step)" if step else "") + ".")
        a, b = g.steps[0], g.steps[-1]
        text = (f"The device memory allocated at the end of each step grew by about {fmt_bytes(g.per_step)} a step on "
                f"rank {rank}, from {fmt_bytes(g.allocated[0])} after step {a} to {fmt_bytes(g.allocated[-1])} after "
                f"step {b} (growing in {g.grew} of {n - 1} steps): tensors kept from every step that nothing frees. "
                "In a training loop that is most often a list it appends to: outputs or logits kept for metrics "
                "(keep loss.item(), or logits.detach().cpu()), a loss summed without .item() (each keeps its "
                "step's graph), or a cache keyed by something that keeps changing." + when
                + " To see what holds it: torch.cuda.memory._record_memory_history() before a few steps and "
                "torch.cuda.memory._dump_snapshot('grow.pickle') after them; PyTorch's memory_viz shows each live "
                "allocation's stack. What keeps it is in your loop, which the doctor does not see: no code is "
                "offered.")
        return [self.finding(
            "warning" if left is None or left <= GROW_WARN_STEPS else "info",
            f"Device memory grows {fmt_bytes(g.per_step)} every step on rank {rank} "
            f"({fmt_bytes(g.allocated[0])} -> {fmt_bytes(g.allocated[-1])} over steps {a}-{b})",
            {"rank": rank, "bytes_per_step": int(g.per_step), "first_step": a, "last_step": b,
             "allocated_first_bytes": g.allocated[0], "allocated_last_bytes": g.allocated[-1],
             "steps_growing": g.grew, "steps_checked": n, "limit_bytes": limit, "max_allocated_bytes": top,
             "steps_to_limit": left, "step_p50_ms": step},
            text, predicted=E.predicted(step, step, peak, peak - grown if peak is not None else None),
            ranks=[rank])]
