"""Memory: gradients kept alive between steps, the model's outputs kept past backward, evaluation with autograd
on, and a peak near capacity that no one category explains."""

from __future__ import annotations

from .. import estimate as E
from .. import thresholds as T
from ...units import fmt_bytes
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
        # what the step starts with, before its first forward: gradients there survived the last step
        kept = sum(int(first.get(k) or 0) for k in _GRADS)
        if kept < GRADS_KEPT_MIN_BYTES:
            return self.quiet(f"{fmt_bytes(kept)} of gradients allocated when the step starts")
        peak, cap = int(pm.peak_bytes), E.capacity_bytes(ctx)
        after = _peak_without_kept(pm, kept, E.param_units(ctx))
        share = peak / cap if cap else None
        sev = "warning" if E.peak_near_capacity(ctx) else "info"
        return [self.finding(
            sev, f"{fmt_bytes(kept)} of gradients stay allocated between steps",
            {"grads_kept_bytes": kept, "peak_bytes": peak, "peak_capacity_pct": None if share is None else
             round(100 * share, 1), "peak_phase": pm.peak_at.phase, "peak_after_bytes": after},
            "After optimizer.step() the gradients are zeroed in place instead of freed, so the forward of the "
            "next step (its activations, its all-gathers) runs with every gradient shard already allocated. "
            "Free them: set_to_none=True is the default since torch 2.0, and FSDP2 allocates each gradient when "
            "its unit's backward produces it.",
            "# frees the gradients after every optimizer.step(), whatever your loop's zero_grad does later\n"
            "# (or call optimizer.zero_grad() instead of zero_grad(set_to_none=False) in your loop)\n"
            "optimizer.register_step_post_hook(lambda opt, args, kwargs: opt.zero_grad(set_to_none=True))",
            predicted=E.predicted(E.step_ms(ctx), E.step_ms(ctx), peak, after))]


def _peak_without_kept(pm, kept: int, units) -> int:
    """The peak with gradients freed after the step: on the peak step's timeline every mark before backward
    loses the kept gradients; a backward mark keeps those of the units whose backward has ended (their
    shards, as FSDP2 reduce-scatters them). Without a timeline: the peak less the kept gradients."""
    tl = pm.timeline
    if not tl:
        return max(0, int(pm.peak_bytes) - kept)
    shard = {u.name: E.grad_shard_bytes(u) for u in units}
    done, best, backward = 0, 0, False
    for row in tl:
        phase = row.get("phase") or ""
        backward = backward or phase.startswith("backward")
        if phase == "backward_end":
            done += shard.get(row.get("unit"), 0)
        total = int(row.get("total") or 0)
        best = max(best, total - kept + (min(done, kept) if backward else 0))
    return best + max(0, int(pm.peak_bytes) - max(int(r.get("total") or 0) for r in tl))


# the step's own tensors alive when the optimizer step starts count from this many bytes on and this share of the
# peak (the loss, a grad-norm scalar and allocator rounding stay far below)
OUTPUTS_KEPT_MIN_BYTES = 256 << 10
OUTPUTS_KEPT_MIN_SHARE = 0.02
OUTPUTS_KEPT_WARN_SHARE = 0.10  # of the peak: a warning from here on (or with the peak near capacity)


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
        kept, peak = int(tl[opt].get("temporaries") or 0), int(pm.peak_bytes)
        if kept < max(OUTPUTS_KEPT_MIN_BYTES, OUTPUTS_KEPT_MIN_SHARE * peak):
            return self.quiet(f"{fmt_bytes(kept)} of the step's tensors besides gradients are alive when the "
                              "optimizer step starts")
        # Freed before backward, they leave every mark from the optimizer step on; in backward only the part
        # that backward does not hold itself (the logits: what is a temporary when the model's forward returns;
        # past_key_values are saved activations there, freed layer by layer); in the next step's forward, until
        # the loop rebinds the name, as far as the step's first mark sees them (a GPU's allocator does; the CPU's
        # per-step count starts at 0)
        out = next((i for i, ph in root if ph == "loss_start"), opt)
        in_backward = min(kept, int(tl[out].get("temporaries") or 0))
        carried = min(kept, int(tl[0].get("temporaries") or 0))
        after = E.timeline_peak(pm, [([(opt, len(tl))], -kept), ([(out, opt)], -in_backward),
                                     ([(0, out)], -carried)])
        sev = "warning" if E.peak_near_capacity(ctx) or kept >= OUTPUTS_KEPT_WARN_SHARE * peak else "info"
        code = ("# in your loop, once the loss is computed from the model's output and before loss.backward():\n"
                f"del outputs  # its {fmt_bytes(kept)} (logits, past_key_values) freed in backward, not after the next forward")
        return [self.finding(
            sev, f"{fmt_bytes(kept)} of the model's outputs kept past backward",
            {"kept_bytes": kept, "kept_peak_pct": round(100 * kept / peak, 1), "peak_bytes": peak,
             "peak_phase": pm.peak_at.phase, "peak_after_bytes": after, "carried_into_next_forward_bytes": carried},
            f"When the optimizer step starts, {fmt_bytes(kept)} of tensors made in the step are still allocated "
            "besides its gradients: the loop keeps what the model returned (outputs = model(...); loss = "
            "outputs.loss, as Hugging Face's no-trainer examples do), so its logits, and its past_key_values "
            "unless use_cache=False, live through backward, the optimizer step and the next forward, until the "
            "name is bound again. Backward needs none of them: the loss keeps what it needs. Keep the loss only, "
            "or delete the output before backward.",
            code, where="backward",
            inputs={"outputs": "what your loop keeps of model(...)'s return (its output object or logits)"},
            predicted=E.predicted(E.step_ms(ctx), E.step_ms(ctx), peak, after))]


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
        steps = sorted({s for n in per.values() for s in n.steps})
        acts = max((int(u.activation_bytes or 0) for u in E.memory_units(ctx).values()), default=0)
        peak, cap = E.peak_bytes(ctx), E.capacity_bytes(ctx)
        held = (f" (the training forward's are {fmt_bytes(acts)} at its batch size)" if acts else "")
        return [self.finding(
            "warning" if E.peak_near_capacity(ctx) else "info",
            f"{ng.with_autograd} evaluation forward passes ran with autograd on",
            {"forwards": ng.with_autograd, "rank": int(rank), "steps": steps, "ms_per_step_p50": ng.ms_p50,
             "training_forward_activation_bytes": acts or None, "peak_bytes": peak,
             "peak_capacity_pct": round(100 * peak / cap, 1) if peak and cap else None},
            f"In {len(steps)} step(s) ({E.fmt_list([str(s) for s in steps])}) the model ran {ng.with_autograd} forward "
            "passes in eval mode with autograd on, and no backward followed them: an evaluation without "
            "torch.no_grad(). Each records the autograd graph and keeps every activation it saves for a backward "
            f"that never comes{held} until its output is freed; under torch.no_grad() each layer's are freed as "
            "the next runs. An evaluation batch larger than the training one runs out of memory here first. The "
            "training steps' time and peak do not change: the doctor already leaves these forwards out of them.",
            "with torch.no_grad():  # the model's forward passes that no backward follows\n"
            "    evaluate()",
            where="evaluation",
            inputs={"evaluate": "your evaluation: the code that runs the model in eval mode"},
            predicted=E.predicted(E.step_ms(ctx), E.step_ms(ctx), peak, peak),
            ranks=sorted(int(r) for r in per))]


@register
class NearCapacitySpread(Rule):
    code = "memory.near_capacity_spread"
    name = "Peak near capacity, no dominant category"
    description = ("The peak is near capacity and no memory category dominates it (so no activation, optimizer "
                   "or offload rule applies), while units are kept unsharded after forward.")
    needs = ("memory", "units")
    severities = ("warning", "critical")

    def match(self, ctx: Context):
        pm, cap = E.peak_memory(ctx), E.capacity_bytes(ctx)
        if pm is None or not cap:
            return self.quiet(E.NO_CAPACITY)
        peak = int(pm.peak_bytes)
        share = peak / cap
        if share < T.NEAR_CAPACITY_SHARE:
            return self.quiet(E.below_share("peak", peak, cap, "capacity", T.NEAR_CAPACITY_SHARE))
        bd = {k: v for k, v in pm.peak_breakdown.items() if v}
        top = max(bd, key=bd.get) if bd else None
        if top is not None and bd[top] / peak >= T.DOMINANT_CATEGORY_SHARE:
            return self.quiet(f"{top} dominates the peak ({100 * bd[top] / peak:.0f}%): its own rule applies")
        kept = [u for u in E.non_root(E.param_units(ctx)) if u.reshard_after_forward is False]
        if not kept:
            return self.quiet("no unit is kept unsharded after forward: no reshard lever")
        # keep the last unit of forward gathered (its backward starts at once; reshard.last_unit's advice)
        last = E.non_root(E.param_units(ctx))[-1]
        flip = [u for u in kept if u.name != last.name] or kept
        after = _peak_resharded(pm, flip)
        freed = peak - after
        waits = [u.timing.ag_wait_fwd_ms for u in flip if u.has_timing]
        step = E.step_ms(ctx)
        # each flipped unit all-gathers once more in backward: about what its forward all-gather waits
        slower = sum(waits) if len(waits) == len(flip) else None
        names = [u.name for u in flip]
        sev = "critical" if share >= 1.0 else "warning"
        # at run time, on the modules fully_shard was applied to (a grouped unit: any of its modules)
        lines = [f"{E.module_expr(u.modules[0] if u.modules else u.name)}.set_reshard_after_forward(True, recurse=False)"
                 for u in flip[:12]]
        if len(flip) > 12:
            lines = ["from torch.distributed.fsdp import FSDPModule",
                     "for m in model.modules():  # every unit but the root",
                     "    if isinstance(m, FSDPModule) and m is not model:",
                     "        m.set_reshard_after_forward(True, recurse=False)"]
        return [self.finding(
            sev, f"Peak at {100 * share:.0f}% of capacity, spread over categories; "
            f"{len(flip)} unit(s) kept gathered after forward",
            {"peak_bytes": peak, "capacity_bytes": cap, "peak_capacity_pct": round(100 * share, 1),
             "largest_category": top, "largest_category_pct": round(100 * bd[top] / peak, 1) if top else None,
             "breakdown_bytes": dict(sorted(bd.items(), key=lambda kv: -kv[1])),
             "units_kept_gathered": len(kept), "freed_bytes": freed},
            f"The peak is {100 * share:.0f}% of capacity and no category holds {100 * T.DOMINANT_CATEGORY_SHARE:.0f}% "
            f"of it, so no single remedy (checkpointing, offload) is indicated; but {len(kept)} unit(s) keep their "
            "gathered parameters from forward to backward (reshard_after_forward=False, ZeRO-2). Resharding them "
            f"after forward lowers the peak by {fmt_bytes(freed)}, at the price of one more all-gather per "
            "unit in backward (the last unit of forward aside: its backward starts at once).",
            "\n".join(lines),
            predicted=E.predicted(step, step + slower if (step is not None and slower is not None) else None,
                                  peak, after),
            units=names)]


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
