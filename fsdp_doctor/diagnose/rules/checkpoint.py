"""Checkpoint saves that training waits for (the records' saves: torch.distributed.checkpoint's save and async_save,
others under ``doctor.checkpointing()``, torchtitan's Trainer's under ``python -m fsdp_doctor.titan``, a Hugging
Face Trainer's under ``DoctorCallback``)."""

from __future__ import annotations

import math
from typing import Optional

from .. import estimate as E
from .. import snippets as S
from ..base import Context, Rule, register
from ...analyze.steps import (counted_saves, first_save_setup, heaviest_saves, save_interval, save_ms_each,
                              saves_share)
from ...units import fmt_share

#: saves taking at least this share of the recorded time are a finding, a warning from the second
SHARE_NOTE, SHARE_WARN = 0.05, 0.15
#: the share a save-less-often fix aims at: under SHARE_NOTE, with room for the saves' own spread
SHARE_AIM = 0.04


def save_every(save_ms: float, step_ms: float, aim: float = SHARE_AIM) -> int:
    """Steps between saves for saves of ``save_ms`` each to take ``aim`` of the time, steps of ``step_ms``
    between them: a save every n steps takes save / (n x step + save)."""
    return max(1, math.ceil(save_ms * (1 - aim) / (aim * step_ms)))


def less_often_plan(c, step_ms: float, every: Optional[float], steps: int) -> tuple[int, float, float, float]:
    """(steps between saves, the saves' share of the time then, ms per step gained, the share in a long run) for
    the saves of ``c`` (a rank's CheckpointSteps) between steps of ``step_ms``, over a run of ``steps`` steps as
    recorded, to take ``SHARE_AIM`` of the time; never as often as now (``every`` steps apart, where known: a
    new-user trial's loop saving every 10 steps was told "save every 8 steps"). The interval comes from the saves'
    mean without the first save's set-up (``first_save_setup``), which the share then keeps: paid once in a run as
    long (``saves_share``)."""
    save_ms = save_ms_each(c)
    n = save_every(save_ms, step_ms)
    if every:
        n = max(n, math.floor(every) + 1)
    share, after = saves_share(c, step_ms, steps / n, steps)  # in a run as long, saving every n steps
    return n, share, (c.ms_total - after) / steps, save_ms / (n * step_ms + save_ms)


def _sharded_saves(ctx: Context, setting: str) -> str:
    """The cheaper-save lever where accelerate's FSDP2 plugin saves whole state dicts (its save_state, a Trainer's
    checkpoints), ``setting`` naming where its user sets the sharded kind; "" otherwise."""
    if getattr(ctx.config, "plugin_state_dict_type", None) != "FULL_STATE_DICT":
        return ""
    return (" Or make each save cheaper: accelerate's plugin saves FULL_STATE_DICT here, gathering the model and the "
            f"optimizer state whole for rank 0 to write; with {setting} every rank writes its own shards, and the "
            "checkpoints hold no model.safetensors (accelerate merge-weights makes one).")


@register
class CheckpointBlocking(Rule):
    code = "checkpoint.blocking"
    name = "Checkpoint saves stop training"
    description = "Checkpoint saves take a material share of the run's time, training waiting for each."
    needs = ("records",)
    severities = ("info", "warning")

    def match(self, ctx: Context):
        checkpoints = E.steps(ctx).checkpoints
        if (heaviest := heaviest_saves(checkpoints)) is None:
            return self.quiet("no checkpoint save recorded (torch.distributed.checkpoint's save and async_save; "
                              "others with doctor.checkpointing() around them; torchtitan's Trainer's under python "
                              "-m fsdp_doctor.titan, a Hugging Face Trainer's under DoctorCallback)")
        rank, c = int(heaviest[0]), heaviest[1]
        share = c.ms_total / c.wall_ms_total
        if share < SHARE_NOTE:
            return self.quiet(f"checkpoint saves take {fmt_share(share, 1)} of the recorded time (rank {rank}; fires "
                              f"from {100 * SHARE_NOTE:.0f}%)")
        setup = first_save_setup(c)
        if setup and (rest := (c.ms_total - setup) / (c.wall_ms_total - setup)) < SHARE_NOTE:
            # (the share left once the set-up is taken out of the saves' time)
            return self.quiet(f"checkpoint saves take {fmt_share(share, 1)} of the recorded time (rank {rank}), "
                              f"{setup:.0f} ms of it the first save's excess over "
                              f"{'the other' if counted_saves(c) == 2 else 'the median'} (set-up, once a process); "
                              f"without it {fmt_share(rest, 1, SHARE_NOTE)} "
                              f"(fires from {100 * SHARE_NOTE:.0f}%)")
        steps = c.counted_steps or len(ctx.run.ranks[rank].steps)
        every = save_interval(c)
        per_step = c.ms_total / steps
        evidence = {"saves": c.saves, "save_ms_p50": c.ms_p50, "saves_ms_total": c.ms_total,
                    # (the steps outside profiler windows: a window slows a save as it slows the step)
                    "counted_ms_total": c.wall_ms_total, "share_pct": round(100 * share, 1),
                    "steps_between_saves": every, "steps_counted": steps, "profiled_save_steps": c.profiled,
                    # the most an asynchronous save gains: all of the save but its copy to host memory
                    "gain_ms_per_step_at_most": round(per_step, 3)}
        often = f", one every {every:g} steps" if every else ""
        # the total and the steps it is spread over, said: "one every 10 steps: 40.6 ms per step over the run" of 284 ms
        # saves read as a wrong division (2 saves over the 14 steps counted of a 20-step run: the doctor's profiler
        # window steps are not; a new-user trial)
        said = (f"{f'Each of the {c.saves} saves stops' if c.saves > 1 else 'The save stops'} training for "
                f"{c.ms_p50:.1f} ms{often}: {c.ms_total:.1f} ms over the {steps} steps counted, {per_step:.1f} ms "
                f"per step (rank {rank}).")
        if c.unmarked_ms:  # the unmarked time around the saves counted (analyze.steps.checkpoint_steps)
            evidence["unmarked_ms_total"] = round(c.unmarked_ms, 3)
            said += (f" Of it, {c.unmarked_ms:.0f} ms in all ran outside the marks around the saves, in the "
                     "save steps' time outside the model beyond the other steps' (a state dict gathered before a "
                     "torch.save in doctor.checkpointing()?): put the whole save in the mark, on every rank, and "
                     "the report counts it as the save's.")
        code = where = ""
        interval_lever = True  # the interval is the fix (its gain the prediction), not an alternative to async_save
        # how often: the lever where the saves cannot be made asynchronous, or already are
        step_ms = (c.wall_ms_total - c.ms_total) / steps
        n, share_after, gain, steady = less_often_plan(c, step_ms, every, steps)
        # the share then: in a long run; and in one as long as this (its first save's set-up kept), what a rerun shows
        # (a run as long as this one saving every n steps, n over its steps, would hold no save: "save every 24
        # steps ... 4.8% in a run as long as this one" of a 20-step run, a new-user trial; the long run's share)
        then = (f"{fmt_share(share_after, 1)} of the time" if not setup else
                f"{fmt_share(steady, 1)} of the time" if n > steps else
                f"{fmt_share(steady, 1)} of the time ({fmt_share(share_after, 1)} in a run as long as this one, whose first "
                f"save's {setup:.0f} ms of set-up stays)")
        less_often = {"save_steps_after": n, "share_pct_after": round(100 * share_after, 1),
                      "share_pct_after_long_run": round(100 * steady, 1), "first_save_setup_ms": round(setup, 1),
                      "gain_ms_per_step": round(gain, 3)}
        evidence |= less_often  # every branch says how often
        if E.trainer_driven(ctx):
            # the Hugging Face Trainer saves synchronously (no asynchronous option): its lever is how often
            text = (f"{said} The Trainer saves synchronously: save every {n} optimizer steps instead, and the saves "
                    f"take {then} ({gain:.1f} ms per step gained), at the "
                    f"cost of more steps to redo after a failure. With load_best_model_at_end, keep save_steps a "
                    "multiple of eval_steps.")
            text += _sharded_saves(ctx, "fsdp_config={..., 'state_dict_type': 'SHARDED_STATE_DICT'}")
            code = (f"trainer.args.save_strategy = \"steps\"  # saves by step count (read by trainer.train())\n"
                    f"trainer.args.save_steps = {n}  # optimizer steps between saves: {c.ms_p50:.0f} ms each, "
                    f"{fmt_share(steady, 1)} of the time")
            where = "trainer"
        elif c.async_saves == c.saves:
            evidence.pop("gain_ms_per_step_at_most")  # (asynchronous already)
            evidence["async_saves"] = c.async_saves
            text = (f"{said} The saves are asynchronous already (torch.distributed.checkpoint.async_save): the step "
                    "waits while each one copies the state to host memory. Save every "
                    f"{n} steps instead, and the saves take {then} "
                    f"({gain:.1f} ms per step gained), at the cost of more steps to redo after a failure.")
            if E.titan_trainer_driven(ctx):  # torchtitan's Trainer: how often it saves is its command line's
                code = S.titan_command_line(E.torchtitan_version(ctx) or "", f"--checkpoint.interval {n}")
                where = "torchtitan"
            elif E.olmo_driven(ctx):  # OLMo-core's Trainer: its checkpointer callback's intervals
                code, where = S.olmo_checkpointer(n), "olmo_trainer"
                text += S.OLMO_CHECKPOINTER
            else:
                text += f" {S.NO_SAVE_CODE}"
        elif E.plugin_lever(ctx) == "accelerate":
            # accelerate's save_state saves synchronously (no asynchronous option): how often, and how much
            text = (f"{said} accelerate's save_state saves synchronously: call it every {n} optimizer steps instead, "
                    f"and the saves take {then} ({gain:.1f} ms per step "
                    "gained), at the cost of more steps to redo after a failure. (torch.distributed.checkpoint's "
                    "async_save would take the model's and optimizer's state dicts from you, in place of save_state.)"
                    + _sharded_saves(ctx, "FullyShardedDataParallelPlugin(..., state_dict_type='SHARDED_STATE_DICT')")
                    + f" {S.NO_SAVE_CODE}")
        elif E.olmo_driven(ctx):  # OLMo-core's checkpointer saves asynchronously on a group of its own when told
            interval_lever = False
            text = (f"{said} OLMo-core's checkpointer saves asynchronously with save_async=True (on a process group "
                    "it makes for the saves): the step then waits only while the state is copied to host memory "
                    f"(at most {per_step:.1f} ms per step to gain, less that copy). Or save every {n} steps, and the "
                    f"saves take {then}." + S.OLMO_CHECKPOINTER)
            code, where = S.olmo_checkpointer(None), "olmo_trainer"
        else:
            interval_lever = False
            text = (f"{said} Save asynchronously (torch.distributed.checkpoint.async_save): the step then waits "
                    "only while the state is copied to host memory, and the write goes on in the background "
                    f"(at most {per_step:.1f} ms per step to gain, less that copy). Give it a process group of its "
                    "own, made once (process_group=dist.new_group(backend=\"gloo\")): on the training's default "
                    "group its collectives and training's interleave and the job can hang (a 2-rank gloo run hung at "
                    "its second save); keep the future it returns and call .result() before the next save and before "
                    f"the process ends. Or save every {n} steps, and "
                    f"the saves take {then}."
                    + _sharded_saves(ctx, "FullyShardedDataParallelPlugin(..., state_dict_type='SHARDED_STATE_DICT')")
                    + f" {S.NO_SAVE_CODE}")
        return [self.finding(
            "warning" if share >= SHARE_WARN else "info",
            f"Training waits for checkpoint saves {fmt_share(share)} of the recorded time",
            evidence, text, code, where=where,
            predicted=E.predicted(c.wall_ms_total / steps, c.wall_ms_total / steps - gain) if interval_lever else None,
            ranks=sorted(int(r) for r, x in checkpoints.items()
                         if x.wall_ms_total > 0 and x.ms_total >= SHARE_NOTE * x.wall_ms_total),
        )]
