"""Checkpoint saves that training waits for (the records' saves: ``doctor.checkpointing()``, torchtitan's Trainer's
under ``python -m fsdp_doctor.titan``)."""

from __future__ import annotations

import statistics

from .. import estimate as E
from .. import snippets as S
from ..base import Context, Rule, register

#: saves taking at least this share of the recorded time are a finding, a warning from the second
SHARE_NOTE, SHARE_WARN = 0.05, 0.15


@register
class CheckpointBlocking(Rule):
    code = "checkpoint.blocking"
    name = "Checkpoint saves stop training"
    description = "Checkpoint saves take a material share of the run's time, training waiting for each."
    needs = ("records",)
    severities = ("info", "warning")

    def match(self, ctx: Context):
        per = {int(r): c for r, c in E.steps(ctx).checkpoints.items() if c.wall_ms_total > 0}
        if not per:
            return self.quiet("no checkpoint save recorded (with doctor.checkpointing() around it, or torchtitan's "
                              "Trainer's under python -m fsdp_doctor.titan)")
        rank = max(per, key=lambda r: per[r].ms_total / per[r].wall_ms_total)
        c = per[rank]
        share = c.ms_total / c.wall_ms_total
        if share < SHARE_NOTE:
            return self.quiet(f"checkpoint saves take {100 * share:.1f}% of the recorded time (rank {rank}; fires "
                              f"from {100 * SHARE_NOTE:.0f}%)")
        steps = len(ctx.run.ranks[rank].steps)
        every = statistics.median(b - a for a, b in zip(c.steps, c.steps[1:])) if len(c.steps) > 1 else None
        per_step = c.ms_total / steps
        evidence = {"saves": c.saves, "save_ms_p50": c.ms_p50, "saves_ms_total": c.ms_total,
                    "recorded_ms_total": c.wall_ms_total, "share_pct": round(100 * share, 1),
                    "steps_between_saves": every, "recorded_steps": steps,
                    # the most an asynchronous save gains: all of the save but its copy to host memory
                    "gain_ms_per_step_at_most": round(per_step, 3)}
        often = f", one every {every:g} steps" if every else ""
        return [self.finding(
            "warning" if share >= SHARE_WARN else "info",
            f"Training waits for checkpoint saves {100 * share:.0f}% of the recorded time",
            evidence,
            f"Each of the {c.saves} saves stops training for {c.ms_p50:.1f} ms{often}: {per_step:.1f} ms per step "
            f"over the run (rank {rank}). Save asynchronously (torch.distributed.checkpoint.async_save): the step "
            "then waits only while the state is copied to host memory, and the write goes on in the background "
            f"(at most {per_step:.1f} ms per step to gain, less that copy); or save less often. {S.NO_SAVE_CODE}",
            ranks=sorted(r for r in per if per[r].ms_total >= SHARE_NOTE * per[r].wall_ms_total),
        )]
