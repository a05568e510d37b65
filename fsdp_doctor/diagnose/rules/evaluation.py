"""Forward passes without gradients (evaluation, generation) that all-gather every unit again in each pass."""

from __future__ import annotations

import statistics
from typing import Optional

from .. import estimate as E
from .. import snippets as S
from .. import thresholds as T
from ..base import Context, Rule, register
from ...units import fmt_bytes, fmt_share

# forwards without gradients whose all-gathers take under this share of as many training forwards' keep the units
# gathered already: the first pass gathers them, a unit kept gathered returns from FSDP's pre-forward at once (the
# GPU row's CPU shape, 2 gloo ranks, 8 passes: 53 ms before the fix, 9 ms after; a training forward's waits 6 ms)
KEPT_SHARE = 0.5


def _evaluations(ctx: Context) -> list[tuple[int, float, float, Optional[tuple[int, int]]]]:
    """(forwards without gradients and autograd, their time ms, their all-gathers ms, (the units entered not
    gathered, the units entered)) of each step that ran two or more, every rank's (records before
    ``no_grad_gather_ms`` have none, before ``no_grad_gathers`` no count: None); those outside profiler windows where
    there are two or more per rank (a window slows them as it slows the step; one alone was the run's first, cold
    evaluation: a new-user trial's 152 ms each, where the later two took 60-80 ms in all, "up to 98.3 ms less per
    evaluation" claimed)."""
    rows = []
    for rd in (getattr(ctx.run, "ranks", None) or {}).values():
        for s in rd.steps:
            n = s.no_grad_forwards - s.autograd_eval_forwards
            if n >= 2 and s.no_grad_gather_ms is not None:
                counted = (s.no_grad_gathers, s.no_grad_units) if s.no_grad_units else None
                rows.append((s.profiled, (n, s.no_grad_ms, s.no_grad_gather_ms, counted)))
    plain = [r for p, r in rows if not p]
    ranks = len(getattr(ctx.run, "ranks", None) or {}) or 1
    return plain if len(plain) >= 2 * ranks else [r for _, r in rows]


def _one_per_micro_batch(ctx: Context) -> bool:
    """Whether every step of every rank ran as many forwards without gradients as backwards (micro-batches): one per
    micro-batch (DPO's reference forward, between its training forward and backward), not passes in a row."""
    steps = [s for rd in (getattr(ctx.run, "ranks", None) or {}).values() for s in rd.steps]
    return bool(steps) and all(s.backwards and s.no_grad_forwards - s.autograd_eval_forwards == s.backwards
                               for s in steps)


def _training_gather_ms(ctx: Context) -> float:
    """One training forward's all-gather waits (ms): each unit's per step over its forward passes, summed."""
    passes = E.micro_batches(ctx)
    return sum(E.ag_wait_ms(u, "forward") / max(1.0, passes.get(u.name, 1.0)) for u in E.param_units(ctx))


@register
class EvalRegather(Rule):
    code = "eval.regather"
    name = "Evaluation gathering every unit in every forward"
    description = ("Forward passes without gradients (evaluation, generation) all-gather every unit again in each "
                   "pass; kept gathered for the whole evaluation, they are gathered once.")
    needs = ("records", "sharded")
    severities = ("info", "warning")

    def match(self, ctx: Context):
        evals = _evaluations(ctx)
        if not evals:
            return self.quiet("no step ran two or more forward passes without gradients (their all-gathers timed)")
        if _one_per_micro_batch(ctx):
            # (a new-user trial's torchtune DPO: its reference forward per micro-batch, read as a 2-pass evaluation,
            # with a fix wrapping an evaluate() the recipe does not have)
            return self.quiet("every step runs as many forward passes without gradients as backwards, one per "
                              "micro-batch (a reference forward, as DPO's): not an evaluation of several passes in a "
                              "row to keep gathered")
        passes = statistics.median(r[0] for r in evals)
        ms, gathered = statistics.median(r[1] for r in evals), statistics.median(r[2] for r in evals)
        once = _training_gather_ms(ctx)
        if once <= 0:
            return self.quiet("no training forward's all-gather was timed")
        counted = [r[3] for r in evals]
        per_unit = None if None in counted else statistics.median(g / u for g, u in counted)
        typical = None  # (all-gathers, units entered) of the step nearest that median
        if per_unit is not None:
            typical = min(counted, key=lambda c: abs(c[0] / c[1] - per_unit))
            # counted: gathered at most once for the whole evaluation where kept (the time read it borderline under
            # the host's load: a 2-rank generation's 8 forwards went quiet once; and on a GPU the host's time of an
            # all-gather is its issue, not its wait)
            if per_unit <= 1.0:
                return self.quiet(f"the units stay gathered across those forwards: {typical[0]} all-gathers for the "
                                  f"{typical[1]} units entered in {passes:.0f} forwards")
        elif gathered < KEPT_SHARE * passes * once:
            return self.quiet(f"the units stay gathered across those forwards: {gathered:.1f} ms of all-gathers for "
                              f"{passes:.0f} forwards, under {100 * KEPT_SHARE:.0f}% of as many training forwards' "
                              f"({passes * once:.1f} ms)")
        cap, peak, step = E.capacity_bytes(ctx), E.peak_bytes(ctx), E.step_ms(ctx)
        if not cap:
            return self.skip(E.no_capacity(ctx))
        if peak is None or not step:
            return self.quiet("needs the step records' memory and step times")
        us = E.param_units(ctx)
        if any(E.reshards_to_group(u) for u in us):
            return self.quiet("a unit reshards to a smaller group after forward (an int reshard_after_forward), which "
                              "the switch the fix uses does not restore")
        held = sum(u.unsharded_bytes for u in us if u.reshard_after_forward is not False)
        pm = E.peak_memory(ctx)
        base = int(pm.timeline[0].get("total") or 0) if pm is not None and pm.timeline else peak
        # every unit gathered at once, over what the step starts with, and the last one's all-gather buffers
        during = base + held + max((u.unsharded_bytes for u in us), default=0)
        if during > T.HEADROOM_MAX_SHARE * cap:
            return self.quiet(f"every unit gathered at once would hold about {fmt_bytes(during)} during the "
                              f"evaluation, over {100 * T.HEADROOM_MAX_SHARE:.0f}% of capacity {fmt_bytes(cap)}")
        saved = gathered * (1 - 1 / passes)  # per step that evaluates: one pass's gathering is left
        # how many steps evaluate, of how many: one rank's (the median rank's), profiled steps counted (their timing
        # is left out above, not their evaluation): "20 of 60 steps (every rank's)" read for 14 of 30
        counts = sorted((sum(1 for s in rd.steps if s.no_grad_forwards - s.autograd_eval_forwards >= 2), len(rd.steps))
                        for rd in ctx.run.ranks.values() if rd.steps)
        hits, runs = counts[len(counts) // 2] if counts else (len(evals), len(evals))
        runs = max(1, runs)
        per_step = saved * hits / runs  # spread over every step of the run
        if per_step < T.HEADROOM_MIN_GAIN_SHARE * step:
            return self.quiet(f"{saved:.1f} ms saved in each of {hits} of {runs} steps, under "
                              f"{100 * T.HEADROOM_MIN_GAIN_SHARE:.0f}% of the {step:.1f} ms step spread over the run")
        sev = "warning" if per_step >= T.HEADROOM_WARN_GAIN_SHARE * step else "info"
        restore = [u.name for u in us if u.reshard_after_forward is True]
        text = (f"{hits} of {runs} steps ran {passes:.0f} forward passes without gradients "
                f"(evaluation, generation): {ms:.1f} ms each, {gathered:.1f} ms of it all-gathering, since every unit "
                "is resharded after each pass and gathered again for the next. Kept gathered for the whole "
                f"evaluation, the units are gathered once: up to {saved:.1f} ms less per evaluation ({per_step:.1f} ms a "
                f"step over the run; on gloo part of an all-gather's time is the wait for the other ranks, which "
                f"stays: a trial's predicted 70.6 ms came out 39 ms), holding {fmt_bytes(held)} of unsharded parameters meanwhile (about "
                f"{fmt_bytes(during)} then, {fmt_share(during / cap, 1)} of capacity). The training steps do not change.")
        code, where, inputs = "", "", {}
        if S.lacks_reshard_switch(ctx.config):
            text += (" This torch's FSDPModule has no set_reshard_after_forward, the switch the fix turns (a newer "
                     "torch has it).")
        elif E.trainer_driven(ctx):  # the Trainer's own evaluations (eval_strategy): no code of the user's around them
            text += " Under the Trainer, a callback keeps them gathered through each evaluation it runs in train()."
            code, where, inputs = S.trainer_gathered_for_evaluation(restore), "trainer", dict(S.TRAINER_INPUTS)
        elif E.olmo_driven(ctx):  # OLMo-core's evaluator callbacks run them inside its Trainer's steps
            text += (" Under OLMo-core's Trainer its evaluator callbacks run them (EvaluatorCallback.perform_eval, at "
                     "their eval_interval): the lines wrap each one's on the built Trainer.")
            code, where = S.olmo_gathered_for_evaluation(restore), "olmo_trainer"
        else:
            code = S.gathered_around_evaluation(restore)
            where, inputs = "evaluation", {"evaluate": "your evaluation or generation: the model's forward passes "
                                                        "without a backward after them"}
        return [self.finding(
            sev, f"{passes:.0f} forward passes without gradients gather every unit each: up to {saved:.1f} ms less "
            "per evaluation kept gathered",
            {"forwards_per_evaluation": passes, "evaluation_steps": hits, "steps": runs,
             "evaluation_ms_p50": ms, "evaluation_allgather_ms_p50": gathered,
             "training_forward_allgather_ms": round(once, 3), "saved_ms_per_evaluation": round(saved, 3),
             "saved_ms_per_step": round(per_step, 3), "unsharded_held_bytes": held,
             "evaluation_peak_bytes": int(during), "capacity_bytes": cap,
             "allgathers_per_unit": None if per_unit is None else round(per_unit, 2),
             # the counts themselves: a unit resharded after forward gathers once a pass, one kept gathered (FSDP's
             # root) once in all; the ratio alone read 6.25 for (3 x 8 + 1) / 4 (a new-user trial)
             "allgathers_per_evaluation": typical[0] if typical else None,
             "units_entered": typical[1] if typical else None},
            text, code, where=where, inputs=inputs,
            # (the training steps' time is not what changes: the evaluation's is, in the evidence)
            predicted=E.predicted(None, None, peak, max(peak, during)))]
