"""Optimizer rules: an optimizer built before fully_shard, collectives outside FSDP's own (optimizer step,
gradient clipping), optimizer state dominating a tight memory budget."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import msgspec

from ...trace.build import GRAD_NORM_PHASE, LOSS_PHASE, MODEL_PHASE
from .. import estimate as E
from .. import snippets as S
from .. import thresholds as T
from ..base import Context, Rule, register
from ...units import fmt_bytes, fmt_share, unit_label

# Collectives that no FSDP unit issued are worth a look above this share of the step ...
OTHER_COMM_INFO_SHARE = 0.02
# ... and a warning when their exposed time reaches this share.
OTHER_COMM_WARN_SHARE = 0.10
# The median rank may sit this fraction below the threshold (the worst rank must reach it): one rule for
# every rank count, without flickering on the rank whose collectives happen to be timed worst.
OTHER_COMM_HYSTERESIS = 0.25
# Per step, more calls than this per rank means per-tensor collectives (clip_grad_norm_ with foreach=False
# issues one all-reduce per DTensor gradient; foreach=True batches them into a handful).
PER_TENSOR_CALLS_MIN = 8
# A gradient norm reduced in at most this many collectives per step is batched (clip_grad_norm_ with foreach, or
# torchtitan's clipping: one all-reduce of the DTensor norm's partials): what clipping needs, no lever.
GRAD_NORM_CALLS_MAX = 2
# Optimizer state is "dominant" at this share of the peak ...
STATE_SHARE_MIN = T.DOMINANT_CATEGORY_SHARE
# ... and matters only when the peak is at least this share of capacity.
STATE_TIGHT_SHARE = 0.80


@register
class OptimizerBeforeShard(Rule):
    code = "optim.before_shard"
    name = "Optimizer created before fully_shard"
    description = "The optimizer holds tensors that are not the model's parameters: nothing is trained."
    needs = ("optimizer",)
    severities = ("critical",)

    def match(self, ctx: Context):
        cfg = ctx.config
        if cfg is None or cfg.optimizer_foreign_params <= 0:
            return self.quiet("the optimizer holds the model's own parameters")
        step, peak = E.step_ms(ctx), E.peak_bytes(ctx)
        stale = cfg.optimizer_foreign_bytes
        bd = E.breakdown(ctx)
        stale_mem = bd.get("stale_optimizer_params")
        opt = cfg.optimizer or "the optimizer"
        # after the fix: the stale tensors go, the model's gradients are freed by zero_grad (this optimizer
        # never zeroes them, so they persist), and the optimizer state appears for the first time (estimate.stale_fix,
        # the one estimate the rules weighing the peak against capacity read too)
        fix = E.stale_fix(ctx)
        freed, peak_after = fix.freed, fix.after
        return [self.finding(
            "critical", f"{opt} was created before fully_shard: {cfg.optimizer_foreign_params} of its "
                        f"{cfg.optimizer_params} parameters are not the model's",
            {"optimizer": cfg.optimizer, "optimizer_params": cfg.optimizer_params,
             "foreign_params": cfg.optimizer_foreign_params, "foreign_bytes": stale,
             "stale_bytes_at_peak": stale_mem, "optimizer_ms_p50": E.phase_ms(ctx, "optimizer"),
             "optimizer_state_after_fix_bytes_est": fix.new_state if fix.state_known else None},
            "fully_shard replaces each parameter with a sharded DTensor parameter. An optimizer built before "
            "that holds the old full-size tensors: they never receive gradients, so optimizer.step() updates "
            "nothing the model uses (the loss does not train), and the stale tensors stay alive at full size "
            f"({fmt_bytes(stale)} per rank). Nor does optimizer.zero_grad() reach the model's parameters: their "
            "gradients accumulate from step to step"
            + (f" ({fmt_bytes(bd['sharded_grads'])} of them at the peak, which the predicted peak frees)"
               if freed else "") + ". Build the optimizer after your fully_shard calls (move its line, "
            "parameter groups and all), or paste this around them: it points the optimizer you have at the "
            f"sharded parameters, keeping its {_groups(cfg.optimizer_groups)}, hyper-parameters and any LR scheduler built on it.",
            S.repoint_optimizer(),
            predicted=E.predicted(step, None, peak, peak_after))]


def _groups(groups) -> str:
    """The optimizer's parameter groups (RunConfig.optimizer_groups), as the fix's text names them
    ("2 parameter groups (weight_decay 0.1 and 0)")."""
    if len(groups) < 2:
        return "parameter group"
    varies = [k for k in groups[0].options if len({str(g.options.get(k)) for g in groups}) > 1]
    shown = "; ".join(f"{k} " + " and ".join(f"{g.options.get(k):g}" if isinstance(g.options.get(k), float)
                                            else str(g.options.get(k)) for g in groups) for k in varies[:2])
    return f"{len(groups)} parameter groups" + (f" ({shown})" if shown else "")


@dataclass
class _OtherComm:
    """One rank's collectives outside FSDP's own, per step; of them, those the host issued inside
    optimizer.step() (the trace engine's phase "optimizer": the optimizer's own) and the loop's calls."""

    calls: float = 0.0
    comm_ms: float = 0.0
    exposed_ms: float = 0.0
    kinds: set[str] = field(default_factory=set)
    in_optimizer_ms: float = 0.0  # exposed
    loop_calls: float = 0.0
    norm_calls: float = 0.0  # of the loop's, those issued inside a norm operator: a gradient norm's reduction
    norm_ms: float = 0.0  # their exposed time
    loss_calls: float = 0.0  # of the loop's, those between the passes (LOSS_PHASE: the loss's code, per micro-batch)
    loss_ms: float = 0.0  # their exposed time

    def add(self, r: E.TraceRow) -> None:
        self.calls += r.count_per_step
        self.comm_ms += r.comm_ms_per_step
        self.exposed_ms += r.exposed_ms_per_step
        self.kinds.add(r.collective)
        if r.phase == "optimizer":
            self.in_optimizer_ms += r.exposed_ms_per_step
        else:
            self.loop_calls += r.count_per_step
        if r.phase == GRAD_NORM_PHASE:
            self.norm_calls += r.count_per_step
            self.norm_ms += r.exposed_ms_per_step
        if r.phase == LOSS_PHASE:
            self.loss_calls += r.count_per_step
            self.loss_ms += r.exposed_ms_per_step

    @property
    def batched_norm(self) -> bool:
        """Its gradient norm's reduction is batched (GRAD_NORM_CALLS_MAX): clipping's, not a lever."""
        return 0 < self.norm_calls <= GRAD_NORM_CALLS_MAX


@register
class OptimizerStepComm(Rule):
    code = "optim.step_comm"
    name = "Collectives outside FSDP's own"
    description = "Collectives no FSDP unit issued (optimizer step, gradient clipping, metrics) take step time."
    needs = ("trace",)
    severities = ("info", "warning")

    def match(self, ctx: Context):
        step = E.step_ms(ctx) or E.trace_step_ms(ctx)  # the records' median, else the trace's (a plain trace)
        every = E.trace_rows(ctx)
        rows = [r for r in every if r.unit == E.OTHER_UNIT and r.phase != MODEL_PHASE]
        # collectives issued inside the model (its tensor parallelism's): neither the loop's nor the optimizer's
        model = max((sum(r.count_per_step for r in every if r.unit == E.OTHER_UNIT and r.phase == MODEL_PHASE
                         and r.rank == rank) for rank in {r.rank for r in every}), default=0.0)
        besides = (f" (besides the model's own: {model:.0f} per step issued inside it, its tensor parallelism's)"
                   if model else "")
        if not rows or not step:
            return self.quiet("no step time measured" if not step else
                              f"the only collectives outside FSDP's own are the model's ({model:.0f} per step issued "
                              "inside it: its tensor parallelism's), not the loop's or the optimizer's" if model else
                              "every collective in the trace belongs to an FSDP unit")
        if len(rows) == len(every) and not E.param_units(ctx) and not E.overlap(ctx).units:
            # no FSDP unit anywhere (DDP's all-reduces): nothing tells the user's collectives from the framework's
            return self.quiet("no FSDP unit in the trace (no FSDP2 label, no unit's collective)")
        saves = E.window_saves(ctx)
        if saves:  # torch.distributed.checkpoint plans a save with collectives of its own (gather, scatter, broadcast)
            r, hit = min(saves.items())
            return self.quiet(f"the profiler window's step{'s' * (len(hit) > 1)} {', '.join(map(str, hit))} saved a "
                              f"checkpoint (rank {r}): "
                              "its collectives outside FSDP's are the save's too (checkpoint.blocking reads the "
                              "saves); a window without a save tells the loop's own")
        by_rank: dict[int, _OtherComm] = {}
        for r in rows:
            by_rank.setdefault(r.rank, _OtherComm()).add(r)
        if all(a.calls == a.norm_calls and a.batched_norm for a in by_rank.values()):
            n = max(a.norm_calls for a in by_rank.values())
            return self.quiet(f"the only collectives outside FSDP's own{besides} reduce a gradient norm ({n:.0f} per "
                              "step, issued inside a norm operator: clip_grad_norm_'s total norm), which clipping "
                              "needs")
        rank, worst = max(by_rank.items(), key=lambda kv: kv[1].exposed_ms)
        share = worst.exposed_ms / step
        # decided on the median rank, not the worst one: a single noisy rank near the threshold made the
        # finding come and go between otherwise identical runs
        typical = statistics.median(a.exposed_ms for a in by_rank.values()) / step
        if share < OTHER_COMM_INFO_SHARE or typical < OTHER_COMM_INFO_SHARE * (1 - OTHER_COMM_HYSTERESIS):
            return self.quiet(E.below_share(f"exposed collectives outside FSDP (rank {rank})", worst.exposed_ms,
                                            step, "the step", OTHER_COMM_INFO_SHARE, ms=True)
                              + f"; the median rank's {fmt_share(typical)}{besides}")
        sev = "warning" if share >= OTHER_COMM_WARN_SHARE else "info"
        kinds = sorted(worst.kinds)
        # where the host issued them (the trace engine's phase): inside optimizer.step() the optimizer's own,
        # elsewhere the user's loop (a gradient-norm log or clipping between backward and the step, metrics)
        inside, loop_calls = worst.in_optimizer_ms, worst.loop_calls
        loop = worst.exposed_ms - inside
        code_ms = E.other_comm_loop_ms(ctx, rank, removable=True)  # the loop's code that issues them, less the wait
        mostly_loop = loop > 0.5 * worst.exposed_ms
        # a Hugging Face Trainer's loop is not the user's: its own collectives are the loss gathered at each logging
        # step and the token counts (R2, a new-user trial: "your loop" read for the Trainer's)
        trainer = E.trainer_driven(ctx)
        lightning = E.lightning_driven(ctx)
        loop_owner = ("the Trainer's loop" if trainer else "the Lightning Trainer's loop and your training_step"
                      if lightning else "your loop")
        where = (f"outside optimizer.step(): {loop_owner}" if inside <= 0.5 * worst.exposed_ms else
                 "both inside optimizer.step() and outside it") if mostly_loop else "inside optimizer.step()"
        evidence = {"rank": rank, "calls_per_step": round(worst.calls, 1), "comm_ms_per_step": round(worst.comm_ms, 3),
                    "exposed_ms_per_step": round(worst.exposed_ms, 3), "collectives": kinds,
                    "optimizer_ms_p50": E.phase_ms(ctx, "optimizer"), "step_p50_ms": step,
                    "in_optimizer_step_ms": round(inside, 3), "in_loop_ms": round(loop, 3),
                    "in_loop_calls_per_step": round(loop_calls, 1), "in_loop_code_ms": round(code_ms, 3),
                    "attribution": where}
        title = f"{worst.calls:.0f} collectives per step outside FSDP's own ({worst.exposed_ms:.1f} ms exposed)"
        said = (f"The trace shows collectives that no FSDP unit issued, {where} ({inside:.1f} ms exposed inside "
                f"optimizer.step(), {loop:.1f} ms outside it). ")
        # a torchtune recipe's reductions, read from its train(): DPO's all-reduce each running metric (9 calls a
        # step, read as a per-tensor norm log with its grad-norm code: a new-user trial)
        recipe = E.torchtune_recipe(ctx)
        reduced, scaled_by = E.torchtune_reductions(ctx)
        # those between a forward and its backward are the loss's code's, once per micro-batch (TRL's SFTTrainer
        # gathers 4 metrics there: 8 calls a step over 2 micro-batches, read as a per-tensor norm log with its code),
        # not a gradient-norm log's, which runs after the last backward
        passes = _between_passes(worst, "lightning" if lightning else "recipe" if recipe is not None else
                                 (getattr(ctx.config, "trainer_args", None) or "trainer") if trainer else "loop")
        if passes:
            evidence["between_passes_calls_per_step"] = round(worst.loss_calls, 1)
            evidence["between_passes_exposed_ms"] = round(worst.loss_ms, 3)
        around = loop_calls - worst.loss_calls
        if mostly_loop and around > PER_TENSOR_CALLS_MIN and not (recipe is not None and reduced):
            # the user's loop, one collective per tensor: what a per-parameter norm log does (full_tensor() of each
            # gradient: an all-gather each), or clip_grad_norm_(..., foreach=False)
            text = (said + f"{around:.0f} calls per step around the passes look like one collective per tensor: "
                    "usually a gradient-norm log that calls full_tensor() (or .norm().full_tensor()) on each "
                    "parameter's gradient. The code computes the same per-parameter norms from each rank's shard "
                    "with one all-reduce for all of them, every LOG_EVERY steps: put it where your loop computes "
                    "them, in place of that code (clipping instead? clip_grad_norm_(model.parameters(), max_norm, "
                    f"foreach=True) reduces the total norm in one call). The prediction removes the {code_ms:.1f} ms "
                    "per step from the end of the first of those calls (its wait for the other ranks stays) to the "
                    "last one's end: the code that issues them, its collectives included." + passes)
            return [self.finding(sev, title, evidence, text, S.GRAD_NORMS_CODE, where="after_backward",
                                 inputs={"step": "the index of the optimizer step"},
                                 predicted=E.predicted(step, step - code_ms), ranks=[int(rank)])]
        # a batched gradient norm's reduction stays: clipping needs it
        kept = worst.norm_ms if worst.batched_norm else 0.0
        # a few batched calls of the loop: what removing them gains is their code's time less the first one's wait
        # for the other ranks (the step keeps that wait at its next collective): E.other_comm_loop_ms's figure
        gain = max(0.0, code_ms - kept) if mostly_loop else worst.exposed_ms
        # a torchtune recipe all-reduces each optimizer step's token count (its gradient scaling needs it) and the
        # running loss (for its log alone): one of the loop's calls beside the norm's stays, in the prediction too (a
        # new-user trial's full_finetune_distributed read "reduce metrics every N steps" with both counted as gain)
        if mostly_loop and recipe is not None:
            if not reduced:  # (recorded before the recipe's source was read: full_finetune's)
                reduced, scaled_by = ["num_tokens", "running_loss"], "num_tokens"
            others = loop_calls - (worst.norm_calls if worst.batched_norm else 0)
            kept_calls = 1 if scaled_by else 0
            gain *= max(0.0, others - kept_calls) / others if others > 0 else 0.0
        if mostly_loop and gain < OTHER_COMM_INFO_SHARE * step:
            return self.quiet(f"{worst.calls:.0f} batched collectives per step outside FSDP's own, "
                              f"{worst.exposed_ms:.1f} ms exposed: a wait for the other ranks that the step keeps at "
                              f"its next collective without them (removing them gains {gain:.1f} ms){besides}"
                              + (f". {passes.strip()}" if passes else ""))
        name = getattr(ctx.config, "optimizer", None) or ""
        text = said + (
            # (a trial: torch.optim.Muon beside AdamW on FSDP2's shards, 108 collectives per step inside its steps for
            # 8 matrices, 204.3 ms of a 238.5 ms step on 2 gloo ranks)
            f"The optimizer issues them: Muon ({name}) orthogonalises each matrix's update with Newton-Schulz "
            "iterations (ns_steps, 5 by default), and on FSDP2's sharded DTensor parameters each iteration's matrix "
            "products redistribute the shards: collectives for each matrix at each iteration. A Muon written for "
            "sharded parameters gathers each matrix once, orthogonalises it whole and keeps its own shard of the "
            "update (torch.optim.Muon does not, as of torch 2.13); no code is offered for it here."
            if not mostly_loop and "muon" in name.lower() else
            "The optimizer issues them: an optimizer that calls full_tensor() or redistributes DTensors (an "
            "orthogonalising one such as Muon or Shampoo gathers whole matrices). Look for its option to work on "
            "the local shards, or batch the gathers; no code is offered for an optimizer the doctor does not know."
            if not mostly_loop else
            f"{loop_calls:.0f} calls per step are batched: the Trainer issues them itself. It gathers the loss at "
            "every logging step and each batch's token count with average_tokens_across_devices (which the loss "
            "needs: keep it), and, where you turned include_num_input_tokens_seen on, the tokens seen. Log every N "
            "steps (TrainingArguments(logging_steps=N)); a callback of yours that reduces metrics each step, every "
            "N steps too."
            if trainer else
            f"{loop_calls:.0f} calls per step: " + _recipe_reductions(recipe, reduced, scaled_by)
            if recipe is not None else
            # (Lightning's self.log(..., sync_dist=True) reduces each logged value over the ranks when it is logged:
            # a barrier and an all-reduce each, in training_step, every batch)
            f"{loop_calls:.0f} calls per step are batched: Lightning's, for your logging and its own work between "
            "batches. "
            "self.log(..., sync_dist=True) in training_step reduces the value over the ranks at every batch, a "
            "collective or two per value: log step values without sync_dist (each rank's own), or with "
            "on_step=False, on_epoch=True, which reduces them once per epoch; a callback of yours that reduces "
            "metrics each batch, every N batches."
            if lightning else
            f"{loop_calls:.0f} calls per step are already batched (clip_grad_norm_ with foreach=True, or a few "
            "metric reductions such as a loss all-reduce read with .item()): what remains is their exposure. "
            "Reduce metrics every N steps instead of every step (if step % N == 0: ...), and on a GPU keep the "
            f"values on the device until then. {S.NO_LOOP_CODE}")
        text += passes
        if kept:
            evidence["grad_norm_ms_kept"] = round(kept, 3)
            text += (f" Of them, {worst.norm_calls:.0f} per step reduce a gradient norm (clip_grad_norm_'s total "
                     f"norm, {kept:.1f} ms exposed), which clipping needs: the prediction keeps it.")
        if mostly_loop:
            text += (" The prediction is their code's time less the first call's wait for the other ranks, which "
                     "the step keeps at its next collective.")
        return [self.finding(sev, title, evidence, text, "", predicted=E.predicted(step, step - gain),
                             ranks=[int(rank)])]


#: what TRL's trainers gather over the ranks in compute_loss at every micro-batch, by their arguments' class (TRL 1.16:
#: 4 all-gathers a micro-batch for SFT, 15 for DPO, each read with .item())
TRL_METRICS = {"trl.SFTConfig": "the token counts, entropy and accuracy it logs",
               "trl.DPOConfig": "the rewards, margins, log-probabilities, entropy and token counts it logs"}


def _between_passes(worst: _OtherComm, driver: str) -> str:
    """optim.step_comm's words on the loop's collectives issued between a forward and its backward (LOSS_PHASE): the
    loss's code reduces there once per micro-batch, which the prediction leaves (its figure is the code around the
    passes); "" where there are none. ``driver``: "loop" (the user's own), "lightning", "recipe" (torchtune's),
    "trainer" or a Hugging Face Trainer's arguments' class (RunConfig.trainer_args: "trl.SFTConfig")."""
    if not worst.loss_calls:
        return ""
    said = (f" {worst.loss_calls:.0f} of the calls per step ({worst.loss_ms:.1f} ms exposed) are issued between a "
            "forward and its backward, outside every unit, where the code computing the loss reduces values once per "
            "micro-batch: ")
    if driver.startswith("trl."):
        who = (f"TRL's trainer ({driver}) gathers {TRL_METRICS.get(driver, 'the metrics it logs')} there over the "
               "ranks, in its compute_loss, and no option of its turns that off.")
    elif driver == "lightning":
        who = "your training_step reduces there (self.log(..., sync_dist=True) after its forward)."
    elif driver == "recipe":
        who = "the recipe reduces there."
    elif driver != "loop":
        who = ("a compute_loss of your Trainer subclass's (or a loss function of yours) reduces there: reduce what it "
               "logs every N steps instead.")
    else:
        who = "your loss code reduces there: reduce what it logs every N steps instead."
    return said + who + " The prediction leaves them."


def _recipe_reductions(recipe: str, reduced: list[str], scaled_by: Optional[str]) -> str:
    """optim.step_comm's words on a torchtune recipe's all-reduces at each optimizer step (its train()'s, read from its
    source): the one its gradient scaling divides by kept, the others, for its log alone, reduced only on the steps
    that log them (knowledge distillation's running_class_loss and running_kd_loss; DPO's num_tokens, which only its
    tokens/s reads, and each running_metrics[key])."""
    logged = [n for n in reduced if n != scaled_by]
    text = (f"torchtune's recipe ({recipe}) all-reduces {', '.join(reduced)} before each optimizer step. "
            + (f"Its gradient scaling by the step's token count needs {scaled_by} (the prediction keeps it). "
               if scaled_by else ""))
    if not logged:
        return text
    them = "it" if len(logged) == 1 else "them"
    return text + (f"Only its log reads {', '.join(logged)}. In your copy of the recipe (tune cp), reduce {them} "
                   f"only on the steps that log {them} "
                   "(self.global_step % self._log_every_n_steps == 0): the other ranks' values are not needed "
                   "elsewhere.")


def _halved_by_bf16(units) -> set[str]:
    """The memory categories a bf16 model (and a bf16 param_dtype) halves; with parameters not all fp32, the
    optimizer state only (its bf16 copy)."""
    if not units or any(set(u.orig_dtypes or ["float32"]) != {"float32"} for u in units):
        return {"optimizer_state"} if units else set()
    out = {"sharded_params", "sharded_grads", "optimizer_state"}
    if all(u.param_dtype in (None, "", "float32") for u in units):  # computed in fp32 until now
        out |= {"unsharded_params", "unsharded_grads", "activations", "temporaries"}
    return out


@register
class OptimizerStateDominates(Rule):
    code = "optim.state_dominates"
    name = "Optimizer state dominates memory"
    description = "Optimizer state is the largest part of a peak that is close to capacity."
    needs = ("memory",)
    severities = ("warning",)
    last = True  # (names optim.foreach_temporaries' lever first where it fired: ctx.earlier)

    def match(self, ctx: Context):
        peak, cap = E.peak_bytes(ctx), E.capacity_bytes(ctx)
        if not peak or not cap:
            return self.skip(E.no_peak_or_capacity(ctx, peak, cap))
        # judged on the peak the fused step leaves where foreach's intermediates hold the peak (optim.foreach_
        # temporaries): the state is 40% of that step's peak less the activations, just under the share, and its
        # fix alone made this finding appear, the next lever (a torchtitan trial: 58.81 -> 55.35 MiB, state 42%)
        judged, once = E.peak_with_fused_step(ctx, peak)
        if why := E.below_budget(ctx, judged, cap, STATE_TIGHT_SHARE):  # (optim.before_shard's stale tensors aside)
            return self.quiet(why + once)
        bd = E.breakdown(ctx)
        st = bd.get("optimizer_state") or 0
        if not st or st / judged < STATE_SHARE_MIN:
            return self.quiet(E.below_share("optimizer state", st, judged, "the peak", STATE_SHARE_MIN) + once)
        step = E.step_ms(ctx)
        cfg = ctx.config
        opt = (cfg.optimizer if cfg is not None else None) or "the optimizer"
        # the snippet's bf16 model halves what is held in the parameters' dtype: the state, the parameters and
        # gradients, and, where they were fp32, the gathered parameters and the activations computed from them
        # (halving the state alone predicted 3.38 MiB where the rerun measured 2.25 MiB)
        saved = sum(bd.get(k) or 0 for k in _halved_by_bf16(E.param_units(ctx))) / 2
        first = (f" First, with no such trade-off: {opt}'s fused step (optim.foreach_temporaries) frees the "
                 f"step's foreach intermediates, and the peak falls to {fmt_bytes(judged)}: the state's share above "
                 "is of that peak." if once else "")
        return [self.finding(
            "warning", f"{opt} state is {fmt_share(st / judged)} of a peak at {fmt_share(judged / cap)} of capacity"
                       + (" with the fused step" if once else ""),
            {"optimizer": opt, "optimizer_state_bytes": st, "peak_bytes": peak, "capacity_bytes": cap,
             "state_share_pct": round(100 * st / judged, 1), "world_size": cfg.world_size if cfg else None,
             **({"peak_with_fused_step_bytes": judged} if once else {})},
            f"{opt}'s per-parameter state ({fmt_bytes(st)} per rank, already sharded) is the largest part of "
            "the peak. Options: shard over more ranks; offload the parameters and their state to the host "
            "(CPUOffloadPolicy, GPU only: the optimizer then steps on the CPU); an optimizer with smaller state "
            "that takes FSDP2's DTensor parameters (8-bit Adam; torch 2.13's own Adafactor raises on them); or "
            "parameters, and so the state, in bf16, below, which halves them but is a numerics trade-off: bf16 "
            "keeps 8 bits of mantissa, so an update smaller than about |w|/256 is rounded away (norm weights near "
            "1.0 stop moving at lr 1e-3; FSDP2 wants one dtype per unit, so they cannot stay fp32 alone) unless "
            "the optimizer rounds stochastically (torchao's AdamW with bf16_stochastic_round=True). Compare the "
            "loss curve against this run's before keeping it." + first,
            "# bf16 parameters and optimizer state, fp32 reduce: halves them, and rounds away updates smaller than "
            "about |w|/256 (norm weights near 1.0 stop moving at lr 1e-3): compare the loss against this run's\n"
            "model.to(torch.bfloat16)\n"
            + S.shard_plan(S.tree(ctx), extra_kwargs=f", mp_policy={S.MP}",
                           mp_line=S.policy_line(S.MP, "bfloat16"))
            # a plan goes where the fully_shard calls are, before the optimizer exists: rebuilding the optimizer
            # there read an `optimizer` not yet built (tested by applying it)
            + "\n# then build the optimizer as before, after fully_shard: its state takes the parameters' bf16",
            predicted=E.predicted(step, step, peak, peak - saved))]


# the marks of the optimizer step on a memory timeline
_OPTIMIZER_PHASES = ("optimizer_start", "in_optimizer", "optimizer_end")
# The optimizer step's own temporaries are worth a finding from this share of a peak that lies in the step, and
# the fused step's a warning where it lowers the peak by this share of it (or under NEAR_CAPACITY_SHARE): below, the
# next highest mark, outside the step, sets a peak nearly as high (a note; an HF Trainer trial's Qwen2: 20% of the
# peak foreach's, the fused step 1.0% lower, measured as predicted)
STEP_TEMPORARIES_SHARE_MIN = 0.10
FUSED_WARN_DROP_SHARE = 0.05


def _not_fusable(ctx: Context, opt: str) -> Optional[str]:
    """Why the fused switch is no fix for ``opt`` here, or None where it is: torch fuses it on DTensor parameters,
    its groups hold the switch, some are not fused yet, and no group would mix DTensor and plain parameters."""
    if opt not in T.FUSED_OPTIMIZERS:
        return (f"{opt}'s fused kernel has no DTensor sharding rule in torch: fused=True raises on FSDP2's parameters"
                if opt in T.UNFUSABLE_OPTIMIZERS else f"{opt} has no fused implementation in torch")
    groups = getattr(ctx.config, "optimizer_groups", None) or []
    if not groups or any("fused" not in g.flags for g in groups):
        return f"{opt}'s groups hold no 'fused' switch: not torch's own (or recorded before the switches were)"
    if all(g.flags.get("fused") for g in groups):
        return f"{opt} runs fused already"
    if getattr(ctx.config, "unmanaged_param_bytes", None):  # (aten._fused_adamw_ "got mixed torch.Tensor and
        # DTensor": a group holding both raises, fused as foreach)
        return "parameters outside every FSDP unit: a group holding them beside DTensor parameters cannot run fused"
    return None


@register
class ForeachTemporaries(Rule):
    code = "optim.foreach_temporaries"
    name = "The optimizer step's temporaries at the peak"
    description = ("A peak near capacity lies in the optimizer step, where the foreach implementation (torch's "
                   "default for Adam and AdamW on CUDA, DTensor parameters included) makes intermediates as large "
                   "as a moment of the state; the fused implementation makes none.")
    needs = ("memory",)
    severities = ("info", "warning", "critical")

    def match(self, ctx: Context):
        pm, cap, skip, quiet = E.near_capacity(ctx)
        if skip or quiet:
            return self.skip(skip) if skip else self.quiet(quiet)
        peak, at = int(pm.peak_bytes), pm.peak_at
        if at.phase not in _OPTIMIZER_PHASES:
            return self.quiet(f"the peak lies {at.phase or 'outside the marks'}, not in the optimizer step")
        opt = getattr(ctx.config, "optimizer", None) or "the optimizer"
        tmp, held = E.step_temporaries(pm)
        if tmp / peak < STEP_TEMPORARIES_SHARE_MIN:
            return self.quiet(E.below_share("temporaries made in the step", tmp, peak, "the peak",
                                            STEP_TEMPORARIES_SHARE_MIN))
        if why := _not_fusable(ctx, opt):
            return self.quiet(f"{why}; its step's temporaries: {fmt_bytes(tmp)}, {fmt_share(tmp / peak)} of the peak")
        # fused: no intermediates (a new-user trial's AdamW on the CPU: 16.01 MiB of foreach temporaries, 0 fused)
        added = [-max(0, int(r.get("temporaries") or 0) - held) if r.get("phase") in _OPTIMIZER_PHASES else 0
                 for r in pm.timeline or []]
        after = E.peak_with_rows(pm, added) if pm.timeline and pm.timeline_step == at.step else peak - tmp
        if peak - after < T.MEMORY_ONLY_MIN_PEAK_SHARE * peak:
            least = fmt_share(T.MEMORY_ONLY_MIN_PEAK_SHARE)
            return self.quiet(f"the fused step would leave a peak of {fmt_bytes(after)}, under {least} below this "
                              f"one: the next highest mark, outside the step, is as high (the step's temporaries: "
                              f"{fmt_bytes(tmp)})")
        code, where, how = _fused_fix(ctx)
        sev = ("critical" if E.budget_peak(ctx) >= cap else "warning" if peak - after >= FUSED_WARN_DROP_SHARE * peak
               or after < T.NEAR_CAPACITY_SHARE * cap else "info")
        return [self.finding(
            sev, f"The optimizer step's temporaries hold {fmt_share(tmp / peak)} of a peak at "
                 f"{fmt_share(peak / cap)} of capacity: {opt} runs unfused",
            {"optimizer": opt, "peak_bytes": peak, "capacity_bytes": cap, "temporaries_bytes": tmp,
             "temporaries_pct": round(100 * tmp / peak, 1), "peak_phase": at.phase},
            f"The peak ({fmt_bytes(peak)}, {fmt_share(peak / cap)} of {fmt_bytes(cap)}) lies in {opt}'s step, where "
            f"its operators' temporaries hold {fmt_bytes(tmp)}: its foreach implementation (torch's default for "
            "FSDP2's DTensor parameters on CUDA) computes each update over every tensor of a group at once, making "
            "intermediates as large as a moment of its state (the square root of the second moment, and for Adam "
            f"with weight_decay the decayed gradients). {opt}'s fused implementation (fused=True) updates in one "
            "kernel and makes none, with the same arithmetic (and is usually the faster on a GPU; the step time is "
            f"not predicted). The peak with it: {fmt_bytes(after)}, {fmt_share(after / cap)} of capacity"
            + (", set by the next highest mark, outside the step." if after > peak - tmp else ".") + how,
            code, where=where, predicted=E.predicted(E.step_ms(ctx), None, peak, after))]


def _fused_fix(ctx: Context) -> tuple[str, str, str]:
    """(code, where, the words that say what it does): the user's optimizer switched to fused, or the config that
    built it where torchtitan or a torchtune recipe did."""
    titan = E.torchtitan_version(ctx)
    code = S.titan_settings(titan, optimizer_implementation="fused") if titan is not None else None
    if code:
        return code, "torchtitan", f" {S.titan_says(titan)}, whose optimizer takes its implementation: 'fused'."
    if (recipe := E.torchtune_recipe(ctx)) is not None:
        return (S.torchtune_fused_optimizer(), "torchtune_config",
                f" torchtune's recipe ({recipe}) builds the optimizer from its config's optimizer keys, its arguments: "
                "fused: True there (as torchtune's own configs set it where they offload).")
    trainer = E.trainer_driven(ctx)
    whose = "the Trainer's optimizer" if trainer else "the optimizer you built"
    return (S.fused_optimizer(), "optimizer",
            f" The snippet switches every group of {whose} to it, before its first step (a step count restored "
            "from a checkpoint is moved to the parameters' device, as the fused step wants it); or "
            + ("TrainingArguments(optim='adamw_torch_fused'), the Trainer's default from torch 2.8." if trainer
               else "pass fused=True where you build it"
               + (", in configure_optimizers." if E.lightning_driven(ctx) else ".")))


# The fused step is worth a note from this share of the step saved, and on a GPU run (offloaded shards) a warning
# from this share on; on a CPU run a note at most: there the device's parameters step on the host, where a GPU's
# step foreach on the device by default
UNFUSED_MIN_GAIN_SHARE = 0.02
UNFUSED_WARN_GAIN_SHARE = 0.05


@register
class UnfusedHostStep(Rule):
    code = "optim.unfused_step"
    name = "The optimizer's unfused step on the CPU"
    description = ("Adam or AdamW steps FSDP2's sharded parameters on the host (CPUOffloadPolicy's, or a CPU run's) "
                   "in torch's default for-loop (or foreach) implementation, a material share of the step; its "
                   "fused CPU kernel makes the same update in a fraction of the time.")
    needs = ("records", "optimizer", "units")
    severities = ("info", "warning")

    def match(self, ctx: Context):
        cfg = ctx.config
        opt = getattr(cfg, "optimizer", None) or "the optimizer"
        impl = ctx.report.run.optimizer_impl if isinstance(ctx.report.run.optimizer_impl, str) else None
        if getattr(cfg, "optimizer_in_backward", 0):
            return self.quiet(f"{opt} steps inside the backward, one optimizer per parameter: a fused step over one "
                              "tensor is not predicted, nor does the fix reach those optimizers")
        if why := _not_fusable(ctx, opt):
            return self.quiet(why)
        if impl not in T.CPU_STEP_COST:
            return self.quiet(f"{opt}'s groups step in different implementations: the step's time is not predicted")
        us, offloaded = E.param_units(ctx), E.offloaded_units(ctx)
        gpu = E.on_gpu(ctx)
        if gpu and not offloaded:
            return self.quiet(f"{opt} steps the parameters on the GPU ({impl}): the fused step's time there is not "
                              "predicted (only the host's is)")
        opt_ms, step = E.phase_ms(ctx, "optimizer"), E.step_ms(ctx)
        if not opt_ms or not step:
            return self.quiet("no optimizer step was timed")
        elements = E.optimizer_shard_elements(ctx, us)
        tensors = E.optimizer_tensors(ctx)
        fused_ms = opt_ms * E.cpu_step_ratio("fused", impl, elements, tensors)
        gain = opt_ms - fused_ms
        if gain < UNFUSED_MIN_GAIN_SHARE * step:
            return self.quiet(E.below_share(f"the fused step's saving ({impl} {opt_ms:.1f} ms -> {fused_ms:.1f} ms)",
                                            gain, step, "the step", UNFUSED_MIN_GAIN_SHARE, ms=True))
        code, where, how = _fused_fix(ctx)
        sev = "warning" if gpu and gain >= UNFUSED_WARN_GAIN_SHARE * step else "info"
        where_words = (f"CPUOffloadPolicy keeps {'them' if len(offloaded) == len(us) else 'some of them'} in host "
                       "memory, and the device waits while they step" if gpu else
                       "this run trains on the CPU (on a GPU the device's parameters step there, foreach by default: "
                       "a note here)")
        peak = E.peak_bytes(ctx) if impl == "for-loop" else None  # (foreach's intermediates: foreach_temporaries')
        return [self.finding(
            sev, f"{opt}'s {impl} step on the CPU takes {opt_ms:.1f} ms ({fmt_share(opt_ms / step)} of the step): "
                 f"fused, about {fused_ms:.1f} ms",
            {"optimizer": opt, "implementation": impl, "optimizer_ms_per_step": round(opt_ms, 3),
             "step_p50_ms": round(step, 3), "fused_optimizer_ms_est": round(fused_ms, 3),
             "tensors": tensors, "elements_per_rank": elements},
            f"The optimizer steps FSDP2's sharded parameters on the CPU: {where_words}. {opt} takes {opt_ms:.1f} ms "
            f"of the {step:.1f} ms step over this rank's {tensors} tensors of {elements / 1e6:.2f} M elements, in "
            f"torch's {impl} implementation (the CPU's default loop dispatches every operator of the update once per "
            "tensor, each a DTensor dispatch). Its fused implementation (fused=True, CPU kernels from torch 2.4) "
            f"makes the same update in one call: about {fused_ms:.1f} ms, this step's own time scaled by what the two "
            "cost per element and per tensor on one CPU thread (benchmarks/cpu_optimizer_cost.py)." + how,
            code, where=where, predicted=E.predicted(step, step - gain, peak, peak))]


# Trainable parameters outside the optimizer: a warning from this share of the trainable elements on (a note below).
UNTRAINED_WARN_SHARE = 0.10


@register
class UntrainedParams(Rule):
    code = "optim.untrained_params"
    name = "Trainable parameters the optimizer never steps"
    description = ("Parameters with requires_grad=True that the optimizer does not hold and nothing updates: every "
                   "step computes, reduce-scatters and keeps their gradients, and saves the activations their "
                   "backward needs, for nothing.")
    needs = ("optimizer", "units")
    severities = ("info", "warning")

    def match(self, ctx: Context):
        cfg = ctx.config
        ut = getattr(cfg, "untrained", None)
        if ut is None:
            return self.quiet("which parameters the optimizer holds was not recorded (a snapshot older than this "
                              "check)")
        if not ut.tensors:
            return self.quiet("the optimizer holds every trainable parameter")
        if cfg.optimizer_foreign_params:  # built before fully_shard: it holds the replaced tensors instead
            return self.quiet(f"the optimizer holds {cfg.optimizer_foreign_params} tensor(s) that are not the model's "
                              "parameters (optim.before_shard): the parameters it lacks are that rule's")
        if ut.changed is None:
            return self.quiet(f"{ut.tensors} trainable parameter(s) outside the optimizer, not checked: the run ended "
                              "before its third step, when the doctor checks whether anything updates them")
        if ut.changed:
            return self.quiet(f"{ut.tensors} trainable parameter(s) outside the optimizer change between steps: "
                              "another optimizer, or the loop, updates them")
        trainable = int(cfg.model_trainable_param_count or 0) or ut.param_count
        share = ut.param_count / trainable
        stem, prefix = _frozen_prefix(ctx, ut)
        pm = E.peak_memory(ctx)
        mem = E.memory_units(ctx)
        acts = {n: int(r.activation_bytes or 0) for n, r in mem.items()}
        inputs = {n: int(r.input_bytes) for n, r in mem.items() if r.input_bytes is not msgspec.UNSET}
        stem_acts = _stem_saved(pm.timeline if pm is not None else [], stem)
        rest = E.in_forward_order(ctx, E.non_root(E.param_units(ctx)))[len(prefix):]
        after = rest[0].name if rest and (stem or prefix) else None  # (the first trained unit: its input is passed)
        prefix_acts = stem_acts + sum(acts.get(u.name, 0) for u in prefix)
        step = E.step_ms(ctx)
        # frozen, the prefix never runs backward, but the first trained unit's backward would still prefetch the
        # last of it (FSDP2's default, the previous unit: prefetch.frozen_gathered): the fix gives that unit a
        # list without it (None: a unit with several parameter groups, not modelled, so that gather stays)
        idle = {u.name for u in prefix}
        found = E.frozen_prefetches(E.post_forward_order(E.units(ctx), S.run_order(ctx)[0]), idle) if prefix else []
        lists = E.prefetch_lists_without(found, idle) if found else {}
        gathered = [u for u in prefix if found is not None or u is not prefix[-1]]
        # their backward's compute goes, their backward all-gathers (on a GPU the trace's exposed time: the host
        # runs ahead there) and their reduce-scatters (exposed, from a GPU trace; a gloo trace times the host's side)
        compute = sum(max(0.0, (u.timing.bwd_self_ms if u.timing.bwd_self_ms is not None else u.timing.bwd_ms)
                          - u.timing.ag_wait_bwd_ms) for u in prefix if u.has_timing)
        ag = sum(E.backward_allgather_ms(ctx, u)[0] or 0.0 for u in gathered)
        rs_exposed = E.trace_exposed_by_unit(ctx, "reduce_scatter") if E.on_gpu(ctx) else {}
        rs = sum(rs_exposed.get((u.name, "backward"), 0.0) for u in prefix)
        bwd = compute + ag + rs
        text = (f"{ut.tensors} parameter tensor(s) ({ut.param_count / 1e6:.2f} M elements, {fmt_share(share)} of "
                f"the trainable ones) have requires_grad=True but are not in the optimizer given to watch(), and "
                f"their values did not change from the first step to the third: nothing updates them. Yet every "
                f"backward computes their gradients, FSDP2 reduce-scatters them, and their gradient shards "
                f"({fmt_bytes(ut.grad_bytes)} on this rank) stay and accumulate, since optimizer.zero_grad() frees "
                f"only the optimizer's own.")
        if stem:
            text += (f" The root's own {E.fmt_list(stem.own)} run before its nested units and train nothing (the "
                     f"optimizer trains its {E.fmt_list(stem.trained)}, after them): frozen, autograd saves nothing "
                     f"for them ({fmt_bytes(stem_acts)} now)" + (", nor for the units after them up to the first "
                                                                  "trained one." if prefix else "."))
        if prefix:
            text += (f" The first {len(prefix)} unit(s) in forward order ({E.fmt_list([u.name for u in prefix], 4)}) "
                     f"hold nothing the optimizer trains: their backward ({bwd:.1f} ms per step, with its "
                     f"all-gathers{' and reduce-scatters' if rs else ''}) runs only for these gradients, and their "
                     f"forward saves {fmt_bytes(prefix_acts - stem_acts)} of activations for it.")
            if lists:
                text += (f" Frozen, they run no backward, but FSDP2's default backward prefetch would still gather "
                         f"{E.fmt_list(sorted({t for _, t, _ in found}))} in every backward, for nothing "
                         f"(prefetch.frozen_gathered): the fix also gives "
                         f"{E.fmt_list([S.module_expr(S.members(n)[0]) for n in lists])} a backward "
                         f"prefetch list without it.")
        text += (" If they are meant to be frozen, say so with requires_grad_(False) before the first forward: FSDP2 "
                 "then neither computes nor reduces their gradients, and autograd saves nothing for a frozen prefix. "
                 "If they are meant to train, add them to the optimizer (its state then grows by theirs).")
        code = ("# after building the optimizer, before the first forward: the trainable parameters it does not hold "
                "(nothing updates them), frozen\n"
                "stepped = {id(p) for group in optimizer.param_groups for p in group[\"params\"]}\n"
                "for param in model.parameters():\n"
                "    if param.requires_grad and id(param) not in stepped:\n"
                "        param.requires_grad_(False)  # no gradient computed, reduce-scattered or kept for it")
        if lists:
            code += ("\n# the frozen units run no backward: the first trained unit's backward prefetch leaves them out\n"
                     + S.backward_prefetch_lists(lists))
        peak = int(pm.peak_bytes) if pm is not None else None
        return [self.finding(
            "warning" if share >= UNTRAINED_WARN_SHARE else "info",
            # (99.6% read "100%", as if the optimizer trained nothing: a new-user trial's fc was; fmt_share says 99.6%)
            f"{fmt_share(share)} of the trainable parameters ({ut.tensors} tensors) are never stepped: their "
            f"gradients computed and kept for nothing",
            {"tensors": ut.tensors, "param_count": ut.param_count, "share_of_trainable": round(share, 4),
             "grad_bytes_kept": ut.grad_bytes, "names": ut.names[:8],
             "frozen_prefix_units": [u.name for u in prefix], "frozen_root_modules": stem.own if stem else [],
             "frozen_prefix_activation_bytes": prefix_acts,
             "frozen_prefix_backward_ms": round(bwd, 3),
             "frozen_prefix_reduce_scatter_ms": round(rs, 3) if E.on_gpu(ctx) else None},
            text, code, where="optimizer",
            predicted=E.predicted(step, step - bwd if step is not None else None, peak,
                                  _peak_untrained_frozen(pm, ut, stem, prefix, after, acts, inputs) if peak
                                  else None,
                                  at_most=True),
            units=sorted(ut.units)[:20])]


class _Stem(NamedTuple):
    """The root's own modules that stay trainable (``trained``: its head, after its nested units) and those it holds
    beside them (``own``: its stem, frozen by the fix), the root unit's ``name``."""

    name: str
    own: list[str]
    trained: list[str]


def _frozen_prefix(ctx: Context, ut) -> tuple[Optional[_Stem], list]:
    """What runs, in forward order, before the first module the optimizer trains: frozen, autograd saves nothing for
    it and runs none of its backward. The root's stem, its own modules before its nested units, where each module
    it trains comes after its last one (its head; None: no such stem), then the units before the first one holding
    a trained parameter. Neither where the root trains, or may train, a module before its last nested unit (its
    embeddings; a root holding trained and untrained parameters in a run recorded before
    ``Untrained.trained_modules``). The ResNet trial's root held conv1, bn1 and the trained fc: read as a trained
    first unit, its frozen layer1..layer4 (8.48 MiB of saves) predicted 14.67 MiB for a measured 6.50 MiB."""
    us = E.param_units(ctx)
    root = next((u for u in us if u.is_root), None)
    stem = None
    if root is not None and ut.units.get(root.name, [0, 1])[1] > 0:
        own, trailing = root.own_modules or [], set(root.trailing_modules or [])
        # (a root not in ut.units holds nothing outside the optimizer: each of its modules trains)
        trained = [m for m in ut.trained_modules or [] if m in own] if root.name in ut.units else own
        if not trained or not set(trained) <= trailing:
            return None, []
        if any(m not in trailing for m in own):
            stem = _Stem(root.name, [m for m in own if m not in trailing], trained)
    out = []
    for u in E.in_forward_order(ctx, E.non_root(us)):
        untrained, trained = ut.units.get(u.name, [0, 0])
        if trained or (not untrained and u.trainable_unsharded_bytes):
            break
        out.append(u)
    return stem, out


def _stem_saved(tl: list[dict], stem: Optional[_Stem]) -> int:
    """Bytes the root's forward saved before its first nested unit's forward (its stem's; 0 without a timeline)."""
    start, nested = _stem_window(tl, stem)
    return int(tl[nested].get("activations") or 0) - int(tl[start].get("activations") or 0) if nested else 0


def _stem_window(tl: list[dict], stem: Optional[_Stem]) -> tuple[int, Optional[int]]:
    """The timeline rows of the root's forward start and of the first nested unit's forward start after it (None:
    not in the timeline)."""
    starts = E.phase_rows(tl, stem.name, "forward_start") if stem else []
    if not starts:
        return 0, None
    nested = next((i for i in range(starts[0] + 1, len(tl)) if tl[i].get("phase") == "forward_start"
                   and tl[i].get("unit") not in (None, stem.name)), None)
    return starts[0], nested


def _peak_untrained_frozen(pm, ut, stem: Optional[_Stem], prefix: list, after: Optional[str],
                           acts: dict[str, int], inputs: dict[str, int]) -> int:
    """The peak (bytes), at most, with the parameters outside the optimizer frozen: their gradient shards go from every
    mark, each frozen-prefix unit's saved activations from its forward's end to its backward's end, and the root's
    stem's from the first nested unit's forward to the root's backward end. What the frozen part passes on (each
    prefix unit's input, and ``after``'s, the unit after them) stays, unsaved, from the end of what made it to the
    forward's end: the forward's code may hold it (the ResNet trial's root held its stem's output, layer1's input,
    through layer1..layer4: with layer4's input, 640 KiB the saves' subtraction alone missed). Without a timeline:
    the units' saves at the peak."""
    tl = pm.timeline
    if not tl:
        return int(pm.peak_bytes) - ut.grad_bytes - sum(acts.get(u.name, 0) for u in prefix)
    added = [-float(ut.grad_bytes)] * len(tl)
    _, nested = _stem_window(tl, stem)
    if nested is not None:
        ends = [i for i in E.phase_rows(tl, stem.name, "backward_end") if i > nested]
        for k in range(nested, ends[0] if ends else len(tl)):
            added[k] -= _stem_saved(tl, stem)
    for u in prefix:
        start = None
        for i, r in enumerate(tl):
            if r.get("unit") == u.name and r.get("phase") == "forward_end":
                start = i
            elif r.get("unit") == u.name and r.get("phase") == "backward_end" and start is not None:
                for k in range(start, i):
                    added[k] -= acts.get(u.name, 0)
                start = None
    # each passed tensor, from the row its maker's saves go (the stem's: the first nested forward; a unit's: its
    # forward's end; the first unit's input, made unfrozen, its own) to the root's forward end (the root: the first
    # unit whose forward starts)
    ends = {u.name: next(iter(E.phase_rows(tl, u.name, "forward_end")), None) for u in prefix}
    makers = [nested] if nested is not None else [ends[prefix[0].name]] if prefix else []
    root = next((r.get("unit") for r in tl if r.get("phase") == "forward_start" and r.get("unit") is not None), None)
    for name, made in zip([u.name for u in prefix] + ([after] if after else []), makers + list(ends.values())):
        end = next((i for i in E.phase_rows(tl, root, "forward_end") if made is not None and i > made), None)
        for k in range(made, end) if end is not None else ():
            added[k] += inputs.get(name, 0)
    return E.peak_with_rows(pm, added)


@register
class NoGradients(Rule):
    code = "optim.no_gradients"
    name = "No gradient reaches the optimizer"
    description = ("The optimizer has stepped three times and holds no state: none of its parameters had a gradient "
                   "when it stepped, so nothing trains (FSDP2's gradient sync left off, most often).")
    needs = ("optimizer", "records")
    severities = ("critical",)

    def match(self, ctx: Context):
        cfg = ctx.config
        state = getattr(cfg, "optimizer_state_tensors", None)
        name = (cfg.optimizer or "") if cfg is not None else ""
        if state is None:
            return self.quiet("the optimizer held state at the third step (or the run ended sooner, or was recorded "
                              "before this check)")
        if state:
            return self.quiet(f"the optimizer held {state} state tensor(s) at the third step")
        if cfg.optimizer_foreign_params:  # built before fully_shard: optim.before_shard's
            return self.quiet("the optimizer holds tensors that are not the model's parameters (optim.before_shard)")
        momentum = any(float(g.options.get("momentum", 0) or 0) > 0 for g in cfg.optimizer_groups or [])
        if name.lower() not in E.STATE_PER_PARAM:
            return self.quiet(f"{name or 'the optimizer'} is not one whose state the doctor knows: no state tells "
                              "nothing there")
        if name.lower() == "sgd" and not momentum:
            return self.quiet("SGD without momentum keeps no state to tell whether gradients reached it")
        off = list(cfg.gradient_sync_off or [])
        pm = E.peak_memory(ctx)
        first = pm.timeline[0] if pm is not None and pm.timeline else {}
        held = int(first.get("unsharded_grads") or 0)  # what the step starts with: never reduced
        text = (f"After three optimizer steps {name} holds no state: it creates its state for a parameter at the "
                "first step that parameter has a gradient, so none of its parameters had one. Nothing trains: the "
                "loss moves only with the batches.")
        if off:
            text += (f" FSDP2's gradient sync is off on {len(off)} unit(s) ({E.fmt_list(off, 4)}): "
                     "set_requires_gradient_sync(False), meant for the micro-batches of gradient accumulation, was "
                     "never set back to True before the last backward, so each backward leaves its gradients on the "
                     f"unsharded parameters ({fmt_bytes(held)} held when a step starts), never reduce-scattered "
                     "into the sharded ones the optimizer steps. Turn the sync on for the backward of the last "
                     "micro-batch of every optimizer step (every backward, without accumulation).")
            code = ("# in your loop, before each micro-batch's backward (without gradient accumulation, every backward"
                    " is the last): reduce-scatter the gradients into the sharded parameters on the last one\n"
                    "model.set_requires_gradient_sync(is_last_micro_batch)")
            where, inputs = "loop", {"is_last_micro_batch": "True on the last micro-batch of an optimizer step"}
        elif held:  # never reduced, with the sync on: FSDP2's post-backward never ran
            methods = [(u.name, m) for u in E.units(ctx) for m in (getattr(u, "forward_methods", None) or [])]
            text += (f" The gradients stay on the gathered parameters ({fmt_bytes(held)} held when a step starts): "
                     "FSDP2's post-backward, which reduce-scatters them into the sharded parameters the optimizer "
                     "steps, never ran. FSDP2 runs it from hooks on the tensors a unit's forward returns")
            if methods:
                shown = E.fmt_list([f"{m}() of {'the model' if not n else unit_label(n)}" for n, m in methods], 4)
                text += (f", and {shown} ran as forward (register_fsdp_forward_method): a method that returns an "
                         "object FSDP2 cannot read into tensors (diffusers' AutoencoderKL.encode returns a "
                         "distribution) gives them nothing to hook. Register the method it calls that returns the "
                         "tensor instead (the VAE's _encode), or shard its blocks as units of their own (their "
                         "backward then runs the root's post-backward at the end).")
            else:
                text += (": an output the loss is not computed from, or one returned as an object FSDP2 cannot read "
                         "into tensors, gives them nothing to hook.")
            code, where, inputs = "", "", {}
        else:
            text += (" Look for what clears or detaches the gradients between the backward and optimizer.step() "
                     "(a zero_grad there, a no_grad or detached forward, parameters replaced after the optimizer was "
                     "built).")
            code, where, inputs = "", "", {}
        return [self.finding(
            "critical", f"No gradient reached {name} in three steps: nothing trains"
            + (f" (gradient sync off on {len(off)} unit(s))" if off else ""),
            {"optimizer": name, "optimizer_state_tensors": 0, "gradient_sync_off_units": off[:20],
             "unsharded_grads_held_bytes": held},
            text, code, where=where, inputs=inputs, units=off[:20])]


# A unit "never" runs its backward from this many steady (rank, step)s on, in every one of which it ran its forward.
NEVER_UPDATED_MIN_STEPS = 3


@register
class NeverUpdated(Rule):
    code = "optim.never_updated"
    name = "Trainable units that never get a gradient"
    description = ("A unit holding trainable parameters runs its forward every step and never its backward: its "
                   "output reaches the loss through no gradient (unused, detached or computed under no_grad), so its "
                   "parameters never change, and its forward and all-gathers run for nothing.")
    needs = ("units", "records")
    severities = ("warning",)

    def match(self, ctx: Context):
        timed = [u for u in E.units(ctx) if u.has_timing]
        if not any(u.timing.bwd_ms > 0 for u in timed):
            return self.quiet("no unit ran a backward in the steady steps")
        if any(u.trainable_sharded_bytes is None for u in timed):  # (a frozen unit would read as trainable)
            return self.quiet("which parameters train was not recorded (a snapshot older than its trainable bytes)")
        idle = [u for u in timed if not u.is_root and E.grad_shard_bytes(u) > 0
                and u.timing.samples >= NEVER_UPDATED_MIN_STEPS and u.timing.no_backward == u.timing.samples]
        if not idle:
            return self.quiet("every unit holding trainable parameters ran its backward in the steps it ran")
        names = [u.name for u in idle]
        fwd = sum(u.timing.fwd_ms for u in idle)
        # on gloo the host blocks in each all-gather: the backward prefetch that gathers such a unit in vain (FSDP2's
        # default, the previous unit in forward order) is step time too; on a GPU the host-timed forward is not the
        # device's: no step figure
        wasted = fwd + sum(E.own_wait_ms(ctx, u, "backward") for u in idle)
        step, peak = E.step_ms(ctx), E.peak_bytes(ctx)
        params = sum(u.param_count for u in idle)
        cut = _feature_layer_cut(ctx, names)
        lever = E.plugin_lever(ctx)  # (accelerate's prepare() or a Trainer shards the model: the fix goes before it)
        its = "its" if len(idle) == 1 else "their"
        text = (f"{E.fmt_list(names, 4)} ({params / 1e6:.2f} M trainable parameters) ran {its} forward in every "
                f"steady step ({fwd:.1f} ms a step, with {its} all-gathers) and never {its} backward: the output "
                "reaches the loss through no gradient, so these parameters never get one and the optimizer never "
                "changes them.")
        code = ""
        if cut is not None:
            cont, first, v = cut
            text += (f" The model's vision_feature_layer={v} takes the vision tower's hidden state before them: the "
                     f"layers from {cont}.{first} on compute an output nothing reads. The fix removes them and takes "
                     "the last hidden state, the same one (the loss is unchanged).")
            # (under a Trainer, the model it holds: its fixes read `trainer`)
            m = "trainer.model" if lever == "trainer" else S.ROOT
            code = (f"# {S.BEFORE_SHARDING} (before it is sharded): the layers vision_feature_layer={v} leaves unread\n"
                    f"del {S.module_expr(cont, m)}[{first}:]\n"
                    f"{m}.config.vision_feature_layer = -1  # the same hidden state: now the last\n"
                    "# the tower's config counts its layers (transformers 5 finds its hidden states by it)\n"
                    f"{m}.config.vision_config.num_hidden_layers = {first}")
        else:
            text += (" If they should train, find where their output leaves the graph (torch.no_grad(), .detach(), "
                     "an output left unused); if not, freeze them (requires_grad_(False)) and, where their output is "
                     "unused, leave them out of the forward.")
        saves = cut is not None and not E.on_gpu(ctx)
        # removed: their parameters' shards at least (a ceiling: what their forward saved for a backward that never
        # comes is freed too where the peak holds it: the trial's Llava in its own loop, 36.16 -> 34.12 MiB for a
        # 258.75 KiB shard; under accelerate's prepare(), 30.52 -> 30.27 MiB, the shard alone)
        freed = sum(u.sharded_bytes for u in idle)
        return [self.finding(
            "warning", f"{len(idle)} unit(s) with trainable parameters never run backward",
            {"units": names, "params": params, "forward_ms_per_step": round(fwd, 3),
             "step_ms": step, "wasted_ms_per_step": round(wasted, 3) if not E.on_gpu(ctx) else None},
            text, code,
            where=(lever or "") if code else "",
            predicted=E.predicted(step, step - wasted if saves and step else None, peak,
                                  peak - freed if cut is not None and peak is not None else None,
                                  # (ceilings: the trial's Llava, 3 runs each way, 118.0 -> 108.2 ms measured, 102.9
                                  # predicted; what else the layer cost is not counted)
                                  at_most=True),
            units=names)]


def _feature_layer_cut(ctx: Context, names: list[str]) -> tuple[str, int, int] | None:
    """(the container, its first block, vision_feature_layer) where the units that never run backward are exactly
    the blocks of one container after the hidden state a Hugging Face vision-language model's vision_feature_layer
    takes (hidden_states[v] of a tower of n blocks, n + 1 states: blocks from index v on, or n + 1 + v where v < 0,
    read nothing; Llava's -2 leaves its last block unread); None otherwise."""
    v = getattr(ctx.config, "vision_feature_layer", None)
    if v is None:
        return None
    for cont, idx in S.tree(ctx).containers().items():
        n = len(idx)
        first = v if v >= 0 else n + 1 + v
        if cont and sorted(idx) == list(range(n)) and 0 < first < n and \
                set(names) == {f"{cont}.{i}" for i in range(first, n)}:
            return cont, first, v
    return None
