"""Gradient accumulation that reduce-scatters every micro-batch's gradients."""

from __future__ import annotations

import statistics

from ...analyze.steps import unit_modules, unit_passes
from .. import estimate as E
from .. import snippets as S
from ..base import Context, Rule, register


def _micro_batches(ctx: Context) -> dict[str, float]:
    """Per unit, forward passes per optimizer step (median over steady steps and ranks): the larger of the
    recorder's micro-batch count (``doctor.step()`` calls between two optimizer steps, 1 when it is called once
    per optimizer step) and the unit's forward calls per module (what the model ran, however the loop calls
    ``doctor.step()``)."""
    per: dict[str, list[float]] = {}
    mods = unit_modules(E.units(ctx))
    for rd in (getattr(ctx.run, "ranks", None) or {}).values():
        for s in rd.steps[1:]:
            mb = getattr(s, "micro_batches", None)
            for us in s.units:
                calls = unit_passes(us, mods)
                n = max(mb or 0, calls or 0) or None
                if n:
                    per.setdefault(us.name, []).append(float(n))
    return {k: statistics.median(v) for k, v in per.items()}


@register
class AccumulationSyncsEveryMicroBatch(Rule):
    code = "accum.sync_every_micro_batch"
    name = "Gradient accumulation without set_requires_gradient_sync(False)"
    description = ("Several backward passes per optimizer step, each unit reduce-scattering its gradients after "
                   "every one of them instead of once.")
    needs = ("trace",)
    severities = ("info", "warning")

    def match(self, ctx: Context):
        rows = [r for r in E.trace_rows(ctx, "reduce_scatter") if r.unit not in ("", "(other)", None)]
        if not rows:
            return self.quiet("no reduce-scatter per unit in the trace")
        per_unit: dict[str, list[E.TraceRow]] = {}
        for r in rows:
            per_unit.setdefault(r.unit, []).append(r)
        counts = {u: statistics.median(r.count_per_step for r in rs) for u, rs in per_unit.items()}
        n = statistics.median(counts.values())
        micro = _micro_batches(ctx)
        mb = statistics.median(micro.values()) if micro else None
        if n < 1.5:
            return self.quiet(f"{n:.0f} reduce-scatter per unit per step" +
                              (f" over {mb:.0f} micro-batches" if mb and mb > 1 else ""))
        ranks = {r.rank for r in rows}
        comm = sum(r.comm_ms_per_step for r in rows) / len(ranks)
        exposed = sum(r.exposed_ms_per_step for r in rows) / len(ranks)
        saved = exposed * (1 - 1 / n)  # one reduce-scatter per unit per step instead of n
        step, peak = E.trace_step_ms(ctx), E.peak_bytes(ctx)
        by_name = {u.name: u for u in E.param_units(ctx)}
        # FSDP2 then accumulates the unsharded gradients between micro-batches (in the reduce dtype)
        grow = sum(E.grad_unsharded_bytes(by_name[u]) for u in counts if u in by_name) if by_name else None
        share = saved / step if step else None
        sev = "warning" if share is None or share >= 0.05 else "info"
        text = (f"Each unit reduce-scatters its gradients {n:.0f} times per optimizer step"
                + (f" ({mb:.0f} micro-batches)" if mb else "") +
                f": {comm:.1f} ms of reduce-scatters per step, {exposed:.1f} ms of it exposed. Turn gradient sync "
                "off for all but the last micro-batch; FSDP2 then accumulates unsharded gradients locally and "
                "reduce-scatters once, at the cost of holding them (the predicted peak).")
        per = f"{mb:.0f}" if mb and mb > 1 else f"{n:.0f}"
        # a loop edit: the doctor cannot see the user's loop, so the fix reads one name from it (its inputs)
        code = (f"# before each micro-batch's backward ({per} per optimizer step in this run):\n"
                "model.set_requires_gradient_sync(is_last_micro_batch)  # reduce-scatter on the last one only")
        where, inputs = "loop", {"is_last_micro_batch": "True for the micro-batch whose backward precedes "
                                                        "optimizer.step()"}
        titan = E.torchtitan_version(ctx)
        if titan is not None:  # the loop is torchtitan's, and its job config has no such setting
            text += (f" {S.titan_says(titan)}: its Trainer's train_step runs the micro-batches (its global batch "
                     "over the local batch times the data-parallel degree) with gradient sync on for every one, and "
                     "its job config has no setting for it. The change goes in train_step, in a Trainer of your "
                     "own: each model part's set_requires_gradient_sync(False) before every forward_backward_step "
                     "but the last, True before the last. No code is offered for torchtitan's loop.")
            code, where, inputs = "", "", {}
        return [self.finding(
            sev, f"{n:.0f} reduce-scatters per unit per optimizer step: gradient accumulation syncs every micro-batch",
            {"reducescatters_per_unit_per_step": round(n, 2), "micro_batches_per_step": mb,
             "units": len(counts), "reducescatter_ms_per_step": round(comm, 3),
             "reducescatter_exposed_ms_per_step": round(exposed, 3), "saved_ms_per_step": round(saved, 3),
             "unsharded_grads_bytes": grow},
            text, code, where=where, inputs=inputs,
            predicted=E.predicted(step, step - saved if step else None, peak,
                                  peak + grow if (peak is not None and grow is not None) else None),
            units=sorted(counts)[:20])]
