"""A rank late in some steps only: each late step shows as that rank's own time above the other ranks' in the
same step (they wait for it in their collectives), not often enough to be the consistent straggler that
``straggler.rank`` reports. Lateness in the optimizer step comes after the step's last collective: the others wait
for it in the next step's first all-gather, and for none of it after the last recorded step (``_unwaited``)."""

from __future__ import annotations

import statistics

from .. import estimate as E
from ...analyze.steps import (STRAGGLER_MIN_CONSISTENCY, STRAGGLER_MIN_FRACTION,
                              STRAGGLER_MIN_MS, own_ms, usable_steps)
from ..base import Context, Rule, register

# a late step: the rank's own time exceeds the other ranks' median in that step by this share of the median
# own time (and STRAGGLER_MIN_MS); host noise on a shared machine reaches ~15%, a planted stall is well above
LATE_MIN_FRACTION = 2 * STRAGGLER_MIN_FRACTION
# a pattern, not one event
LATE_MIN_STEPS = 2
# ... and a warning from this many late steps: two late steps happen by chance on a loaded host (a tuned 2-rank
# run here showed rank 0 late by +46 ms in 2 of 6 steps with nothing planted), three make a pattern
LATE_WARN_MIN_STEPS = 3
# late steps listed in the evidence (their count beside): a long run's list fits a screen
LATE_LISTED = 50
# a late step's excess counts in the pattern's cost up to this many times the median late step's
LATE_SPIKE_FACTOR = 3.0
# One rank's pattern: late in at least this many times as many steps as any other rank. Lateness spread over the
# ranks is not one rank's work (a new-user trial's slow DataLoader, the same on both ranks, read "Rank 0 is late in
# 96 of 243 steps" as a warning beside jitter.data_wait's finding of the same cause, the rank named changing
# between analyses of the same run, and its advice (a checkpoint on rank 0, async_save) fitting none of it)
LATE_DOMINANCE = 2.0
# A late step's excess stands this many times the other ranks' step-to-step spread (standard deviation of their own
# time) out of it: clean 2-rank runs on a shared host read "Rank 1 is late in 3 of 33 steps (+4 to +10 ms)" against a
# spread of 2-3 ms (a new-user trial); planted stalls stand tens of times out
LATE_SPREAD_FACTOR = 2.0
_PHASES = ("outside", "forward", "backward", "optimizer")


def _unwaited(excess: float, opt_excess: float, others_next: bool) -> float:
    """Of a late step's ``excess`` (ms), the part no other rank waited for: its optimizer step's excess
    (``opt_excess``: after the step's last collective, waited for in the next step's first all-gather) where the other
    ranks recorded no next step (``others_next``). A new-user trial's rank 0 took +1,663 ms in the optimizer step of
    the run's last step, the other rank's step 214 ms: "mean step 389.7 ms -> 45.2 ms" subtracted it from every rank,
    below the shortest step (211 ms)."""
    return 0.0 if others_next else min(excess, max(0.0, opt_excess))


def _optimizer_noise(excess: float, opt_excess: float, opt_ms: float, others_opt_max: float, least: float) -> bool:
    """A late step whose lateness is its optimizer step's alone (without that excess it would not be late: under
    ``least``), the rank's optimizer step no longer than the other ranks' own take in some of the checked steps
    (``others_opt_max``): the same code on every rank, on identical shards, varying with the host's load. A new-user
    trial on a shared 2-core host read "Rank 1 is late in 3 of 5 steps (+31 ms each)" as a warning: its AdamW steps of
    28-32 ms against the other rank's 7-15 ms in those steps and up to 36.8 ms in others, nothing rank-specific in
    the loop. One rank's work now and then (a save, an evaluation, a sleep) sits outside the model."""
    return opt_excess > 0 and excess - opt_excess < least and opt_ms <= others_opt_max


@register
class IntermittentStraggler(Rule):
    code = "straggler.intermittent"
    name = "Rank late in some steps"
    description = ("One rank's own work is much longer than the others' in some steps (two or more, fewer than "
                   "a consistent straggler's): the others wait for it in those steps' collectives.")
    needs = ("records", "multi_rank")
    severities = ("info", "warning")

    def match(self, ctx: Context):
        by_rank = {r: {s.step: s for s in usable_steps(rd.steps)} for r, rd in (ctx.run.ranks or {}).items()}
        common = sorted(set.intersection(*(set(d) for d in by_rank.values()))) if len(by_rank) > 1 else []
        if len(common) < 4:
            return self.quiet(f"{len(common)} steady steps common to the ranks (needs 4)")
        base = statistics.median(own_ms(d[st]) for d in by_rank.values() for st in common)
        least = max(STRAGGLER_MIN_MS, LATE_MIN_FRACTION * base)
        recorded = {r: {s.step for s in rd.steps} for r, rd in ctx.run.ranks.items()}
        late: dict[int, list[tuple[int, float, str]]] = {}
        # late steps left out, per rank: (step, excess ms) no other rank waited for; (step, optimizer ms, the others'
        # most) of optimizer steps within the others' own
        unwaited: dict[int, list[tuple[int, float]]] = {}
        noise: dict[int, list[tuple[int, float, float]]] = {}
        for r, d in by_rank.items():
            rest = [o for o in by_rank if o != r]
            others_opt_max = max(by_rank[o][st].optimizer_ms for o in rest for st in common)
            for st in common:
                others = [by_rank[o][st] for o in rest]
                excess = own_ms(d[st]) - statistics.median(own_ms(s) for s in others)
                if excess < least:
                    continue
                opt_x = d[st].optimizer_ms - statistics.median(s.optimizer_ms for s in others)
                lost = _unwaited(excess, opt_x, all(st + 1 in recorded[o] for o in rest))
                if lost:
                    unwaited.setdefault(r, []).append((st, lost))
                    excess -= lost
                    opt_x -= lost
                    if excess < least:
                        continue
                if _optimizer_noise(excess, opt_x, d[st].optimizer_ms, others_opt_max, least):
                    noise.setdefault(r, []).append((st, d[st].optimizer_ms, others_opt_max))
                    continue
                phase = max(_PHASES, key=lambda ph: getattr(d[st], ph + "_ms") - (lost if ph == "optimizer" else 0.0)
                            - statistics.median(getattr(s, ph + "_ms") for s in others))
                late.setdefault(r, []).append((st, excess, phase))

        def quiet(reason: str):
            # what the late steps left out were: said beside any reason the rule is quiet for
            for r, xs in sorted(unwaited.items()):
                reason += (f"; rank {r}'s lateness in its optimizer step in step(s) "
                           f"{E.fmt_list([str(st) for st, _ in xs], 6)} (+{max(x for _, x in xs):,.0f} ms at most) "
                           "came after the other ranks' last recorded step: no rank waited for it")
            for r, xs in sorted(noise.items()):
                lo, hi = min(x for _, x, _ in xs), max(x for _, x, _ in xs)
                took = f"{lo:.1f}-{hi:.1f} ms" if f"{lo:.1f}" != f"{hi:.1f}" else f"{hi:.1f} ms"
                reason += (f"; rank {r} late in step(s) {E.fmt_list([str(st) for st, _, _ in xs], 6)} by its "
                           f"optimizer step alone ({took}), no longer than the other ranks' own take in some steps "
                           f"({xs[0][2]:.1f} ms): the same code on every rank, host noise")
            return self.quiet(reason)

        if not late:
            return quiet(f"no rank's own time exceeds the others' by {100 * LATE_MIN_FRACTION:.0f}% in any step"
                         + (" but those that follow" if unwaited or noise else ""))
        rank, rows = max(late.items(), key=lambda kv: (len(kv[1]), sum(x for _, x, _ in kv[1])))
        if len(rows) < LATE_MIN_STEPS:
            return quiet(f"rank {rank} late in {len(rows)} step only (step {rows[0][0]}): one event is not a "
                         "pattern")
        runner_up = max((len(v) for r, v in late.items() if r != rank), default=0)
        if runner_up * LATE_DOMINANCE > len(rows):
            counts = ", ".join(f"rank {r} in {len(v)}" for r, v in sorted(late.items()))
            return quiet(f"late steps spread over the ranks ({counts} of {len(common)} steps): not one rank's "
                         f"work (one rank's pattern is late {LATE_DOMINANCE:.0f}x as often as any other); "
                         "what every rank does at different moments (data loading, host noise)")
        if any(x.rank == int(rank) for x in E.steps(ctx).stragglers) or \
                len(rows) / len(common) >= STRAGGLER_MIN_CONSISTENCY:
            return quiet(f"rank {rank} late in {len(rows)} of {len(common)} steps: a consistent straggler "
                         "(straggler.rank)")
        steps = [st for st, _, _ in rows]
        if since := E.after_shift(ctx, steps, common):  # (not now and then: from a step on)
            return quiet(f"rank {rank} late in {since}")
        phase = statistics.mode(ph for _, _, ph in rows)
        # the pattern's cost: each late step's excess up to LATE_SPIKE_FACTOR times the typical one (a single 101 ms
        # host hiccup among +5 ms late steps made a 9% "gain" and a warning: a new-user trial); the spike is one event
        typical = statistics.median(x for _, x, _ in rows)
        # a late step stands out of the others' own step-to-step spread (a new-user trial's clean 2-rank runs read
        # "Rank 1 is late in 3 of 33 steps (+4 ms each)" on a shared host; the trace path's straggler asks the same)
        spread = statistics.median(statistics.pstdev(own_ms(by_rank[o][st]) for st in common)
                                   for o in by_rank if o != rank)
        if typical <= LATE_SPREAD_FACTOR * spread:
            return quiet(f"rank {rank} late in {len(rows)} of {len(common)} steps by +{typical:.1f} ms (median), "
                         f"within {LATE_SPREAD_FACTOR:.0f}x the other ranks' step-to-step spread of their own "
                         f"time ({spread:.1f} ms): host noise, not a pattern")
        cap = LATE_SPIKE_FACTOR * typical
        per_step = sum(min(x, cap) for _, x, _ in rows) / len(common)
        # no mean step below what the steps without the lateness take (every rank's, their median): the late rank's
        # own time outside the pattern is no gain of its fix
        floor = statistics.median(d[st].wall_ms for d in by_rank.values() for st in common if st not in steps)
        mean = E.step_mean_ms(ctx)
        if mean:
            per_step = min(per_step, max(0.0, mean - floor))
        step = E.step_ms(ctx)
        sev = "warning" if step and per_step >= 0.05 * step and len(rows) >= LATE_WARN_MIN_STEPS else "info"
        where = {"outside": "outside the model (data loading, logging, checkpointing, user code)",
                 "forward": "forward", "backward": "backward", "optimizer": "the optimizer step"}[phase]
        # a period from 3 late steps on, each at that spacing (two are one interval: not yet a period)
        gap = E.period(steps, common, least=3)
        # a range where the late steps differ ("+110 ms each" read for +18.5 and +200.9 ms: a new-user trial)
        lo, hi = min(x for _, x, _ in rows), max(x for _, x, _ in rows)
        each = f"+{lo:.0f} to +{hi:.0f} ms" if hi > 2 * lo else f"+{typical:.0f} ms each"
        waits = ("first collective of the next step" if phase == "optimizer" else "collectives of the same step")
        loop = "the Trainer's loop or your callbacks" if E.trainer_driven(ctx) else "your loop"
        stretch = E.one_stretch(steps, common)  # (consecutive steps, then no more: no work done now and then)
        return [self.finding(
            sev, (f"Rank {rank} was late in steps {steps[0]}-{steps[-1]} ({len(rows)} in a row), then no longer "
                  f"({each})") if stretch else f"Rank {rank} is late in {len(rows)} of {len(common)} steps ({each})",
            # (the first LATE_LISTED of each list: a 20,000-step run's held 1,230 steps, 15.6 KB of JSON)
            {"rank": int(rank), "late_steps": steps[:LATE_LISTED], "late_step_count": len(steps),
             "steps_checked": len(common), "late_excess_ms": [round(x, 1) for _, x, _ in rows][:LATE_LISTED],
             "phase": phase,
             "every_n_steps": gap, "own_ms_median": round(base, 3), "cost_ms_per_step": round(per_step, 3),
             "spikes_capped_at_ms": round(cap, 1) if any(x > cap for _, x, _ in rows) else None,
             **({"consecutive": True} if stretch else {})},
            f"In steps {steps[0]} to {steps[-1]}, {len(rows)} steps in a row, rank {rank} spent {typical:.0f} ms "
            f"more than the other ranks on its own work, mostly {where}, and then no longer; the other ranks waited "
            f"that long in the {waits}, so every rank paid it. Not work done now and then: something on rank {rank} "
            "slowed for a while and recovered (another process on its host, a slow stretch of its data shard, its "
            f"device throttled). Look at what rank {rank} and its host did in those steps. What it was lives in {loop} "
            "or on that host, which the doctor does not see: no code is offered." if stretch else
            f"In steps {E.fmt_list([str(x) for x in steps], 12)} rank {rank} spends {typical:.0f} ms "
            f"more than the other ranks on its own work, mostly {where}; the other ranks wait that long in the "
            f"{waits}, so every rank pays it. Work done now and then on one rank (a "
            "checkpoint or evaluation on rank 0, a log line with a host sync, an occasional long sequence in its "
            "data shard) does this: run it on every rank at once, asynchronously (a checkpoint: "
            "torch.distributed.checkpoint.async_save), or off the training loop. What it is lives in "
            # (a Trainer's loop is not the user's: R2, a new-user trial)
            f"{loop}, which the doctor does not see: no code is offered.",
            # its cost is paid in the late steps only: a share of the mean step, which the median leaves out (on a
            # fast host the median step is shorter than the cost per step: 100 against 129 ms, no prediction)
            # (down to the median step without the lateness: ``floor``)
            predicted=E.predicted(mean, mean - per_step if mean else None, step_mean=True),
            ranks=[int(rank)])]
