"""Gradient accumulation that reduce-scatters every micro-batch's gradients, or all-gathers every unit again in
every micro-batch."""

from __future__ import annotations

import statistics

from msgspec import UNSET

from .. import estimate as E
from .. import snippets as S
from .. import thresholds as T
from ..base import Context, Rule, register
from ...trace.analysis import MICRO_BATCH_STEPS_MIN
from ...units import ROOT_LABEL, fmt_bytes, fmt_share, unit_label


def _in_the_loop(ctx: Context, text: str, code: str, switch: str, now: str = "") -> tuple[str, str, str, dict]:
    """(text, code, where, inputs) of a fix in the user's loop keyed to its last micro-batch, which the doctor
    cannot see: the fix reads that one name from it (its inputs). Where torchtitan's Trainer runs the loop (its job
    config has no such setting), the change in words and no code: FSDP2's ``switch`` per micro-batch."""
    titan = E.torchtitan_version(ctx)
    if titan is None:
        return text, code, "loop", {"is_last_micro_batch": "True for the micro-batch whose backward precedes "
                                                           "optimizer.step()"}
    return (text + f" {S.titan_says(titan)}: its Trainer's train_step runs the micro-batches (its global batch "
            f"over the local batch times the data-parallel degree){now}, and its job config has no setting for it. "
            "The change goes in train_step, in a Trainer of your own: each model part's "
            f"{switch}(False) before every forward_backward_step but the last, True before the last. No code is "
            "offered for torchtitan's loop."), "", "", {}


def _accumulate_switched(ctx: Context) -> bool:
    """Whether accelerate's ``accelerator.sync_gradients`` is a last-micro-batch flag in this run's loop: accumulate()
    turned it off on some backward (RunConfig.accelerate), or nothing says otherwise (not accelerate's, or not
    read). With gradient_accumulation_steps left at 1, or a loop that never enters accumulate(), it is True on every
    micro-batch: a fix keyed to it would switch on each one."""
    acc = getattr(ctx.config, "accelerate", None)
    return acc is None or acc.unsynced_backwards > 0


def _under_accelerate(ctx: Context, per: float) -> tuple[str, str, str, bool] | None:
    """Where a loop of the user's own around accelerate's prepare() accumulates: (what accelerate did, read from its
    recorded state (RunConfig.accelerate), the fix's code or "" for the loop fix, where it goes, whether the loop's
    names are accumulate()'s); None: not such a run, or nothing of accelerate's to name. accelerator.accumulate(model)
    turns FSDP2's gradient sync off on all but the last of its gradient_accumulation_steps calls, unless the
    GradientAccumulationPlugin's sync_each_batch=True keeps it on (set to save memory: a new-user trial's Qwen2 was
    told to call set_requires_gradient_sync, which silently undid it), its distributed type is not FSDP (its no_sync
    then looks for DDP's), or the loop never enters it (sync_gradients never off)."""
    acc = getattr(ctx.config, "accelerate", None)
    if E.plugin_lever(ctx) != "accelerate" or acc is None:
        return None
    switched = _accumulate_switched(ctx)  # accumulate() said "not the last micro-batch" on some backward
    if acc.distributed_type and acc.distributed_type != "FSDP":
        return (f" accelerate's distributed type was {acc.distributed_type}, not FSDP: accelerator.accumulate(model) "
                "turns an FSDP2 model's gradient sync off only under FSDP (under another, its no_sync looks for "
                "DDP's no_sync, which an FSDP2 model lacks). Turn it off in the loop:", "", "", switched)
    if acc.sync_each_batch and switched:
        code = "\n".join(S.comment(
            f"sync_each_batch off, as GradientAccumulationPlugin has it by default: accelerator.accumulate(model) "
            f"turns gradient sync off on all but the last of every {acc.num_steps} micro-batches")
            + ['accelerator.gradient_state.plugin_kwargs["sync_each_batch"] = False'])
        return (" Your GradientAccumulationPlugin's sync_each_batch=True keeps it on: accelerator.accumulate(model) "
                f"turned it off on all but the last of its {acc.num_steps} micro-batches otherwise. Set to save "
                "memory, it costs these reduce-scatters: turn it off where the predicted peak fits.", code,
                "accelerate", True)
    if switched:
        return None  # (accumulate() switched and would have turned sync off: something else turned it on)
    wrap = ("each micro-batch's forward and backward inside `with accelerator.accumulate(model):`, which turns "
            "gradient sync off on all but the last")
    if acc.num_steps <= 1:
        return (f" accelerate's gradient_accumulation_steps is 1, its default: accelerator.accumulate(model) syncs "
                f"on every call. Let it accumulate: Accelerator(gradient_accumulation_steps={per:.0f}) and {wrap} "
                f"(accelerator.backward then divides each loss by {per:.0f}: drop a division of your own), or turn "
                "it off in the loop yourself:", "", "", False)
    return (f" accelerate's gradient_accumulation_steps is {acc.num_steps}, but no backward began with its "
            "sync_gradients off: the loop does not enter accelerator.accumulate(model). Put "
            f"{wrap}, or turn it off in the loop yourself:", "", "", False)


@register
class AccumulationSyncsEveryMicroBatch(Rule):
    code = "accum.sync_every_micro_batch"
    name = "Gradient accumulation without set_requires_gradient_sync(False)"
    description = ("Several backward passes per optimizer step, each unit reduce-scattering its gradients after "
                   "every one of them instead of once.")
    needs = ("records|trace",)
    severities = ("info", "warning")

    def match(self, ctx: Context):
        if why := E.updated_between(ctx):
            return self.quiet(why)
        rows = [r for r in E.trace_rows(ctx, "reduce_scatter") if r.unit not in ("", "(other)", None)]
        if not rows and ctx.report.overlap is None:  # no trace in the steps analysed: what the records counted
            return self._from_records(ctx)
        if not rows:
            return self.quiet("no reduce-scatter per unit in the trace")
        per_unit: dict[str, list[E.TraceRow]] = {}
        for r in rows:
            per_unit.setdefault(r.unit, []).append(r)
        counts = {u: statistics.median(r.count_per_step for r in rs) for u, rs in per_unit.items()}
        n = statistics.median(counts.values())
        micro = E.micro_batches(ctx)
        mb = statistics.median(micro.values()) if micro else None
        # a loop calling prof.step() per micro-batch: its profiler steps are micro-batches, most of them without an
        # optimizer.step(), each reduce-scattering once (a new-user trial's 4 micro-batches a step read "1
        # reduce-scatter per unit per step", quiet): per optimizer step, the steps' count times the steps per one
        per_opt = E.trace_steps_per_optimizer_step(ctx)
        micro_steps = per_opt is not None and per_opt >= MICRO_BATCH_STEPS_MIN
        if micro_steps:
            n *= per_opt
        if n < 1.5:
            return self.quiet(f"{n:.0f} reduce-scatter per unit per step" +
                              (f" over {mb:.0f} micro-batches" if mb and mb > 1 else ""))
        # FSDP names a root in no label: several roots (fully_shard never applied to the model) are one "(root)"
        # in the trace, their reduce-scatters counted together, as one root's over several micro-batches would be
        if mb is not None and mb < 1.5:
            return self.quiet(f"{n:.0f} reduce-scatters per unit per step, but 1 forward pass per unit per step: no "
                              "micro-batches (several FSDP roots, which FSDP's labels do not name, count as one)")
        # FSDP2 reduce-scatters a unit once per backward however many forwards fed it (its post-backward reduces the
        # gradients there are; a second forward's finds none): with one backward per step, the rest is another FSDP
        # model's under the same unit names. A new-user trial's GAN, the generator run twice into one backward, read
        # "2 reduce-scatters per unit: gradient accumulation syncs every micro-batch (2 micro-batches)" with the
        # accumulation fix: its units reduce-scattered once a step, the discriminator's same-named ones twice
        if (backwards := E.backward_passes(ctx)) is not None and backwards < 1.5:
            others = E.other_fsdp_units(ctx)
            return self.quiet(
                f"{n:.0f} reduce-scatters per unit per step in the trace, but {backwards:.0f} backward pass through "
                "the model per optimizer step" + (f" ({mb:.0f} forward passes feeding it)" if mb and mb > 1 else "") +
                ": no gradient accumulation; FSDP2 reduce-scatters a unit once per backward" + (
                    f". {others} FSDP2 units of another model are alive in this process: the trace counts their "
                    "collectives under same-named units (its labels do not name the model)" if others else ""))
        if mb is None and set(counts) == {ROOT_LABEL}:
            return self.quiet(f"only the root's reduce-scatters are labelled ({n:.0f} per step): several FSDP roots, "
                              "which FSDP's labels do not name, would count the same as micro-batches")
        ranks = {r.rank for r in rows}
        comm = sum(r.comm_ms_per_step for r in rows) / len(ranks)
        exposed = sum(r.exposed_ms_per_step for r in rows) / len(ranks)
        saved = exposed * (1 - 1 / n)  # one reduce-scatter per unit per step instead of n
        window, peak = E.trace_step_ms(ctx), E.peak_bytes(ctx)
        # a plain trace: the peak its [memory] events show, one total (not what the peak held of the gradient shards)
        trace_peak = peak is None and (peak := E.trace_peak_bytes(ctx)) is not None
        # the share of the profiled step it saves, applied to the steady step the report's other findings start from
        # (the records' median; a profiled step runs slower: 293.6 ms against 219.5 in one trial)
        share = saved / window if window else None
        step = E.step_ms(ctx) or window
        gain = share * step if share is not None and step else saved
        # (by the trace's labels: the root's "(root)"; its gradients were left out of the figures: a new-user trial)
        by_name = {E.trace_label(ctx, u.name): u for u in E.param_units(ctx)}
        # FSDP2 then accumulates the unsharded gradients between micro-batches (in the reduce dtype), and holds no
        # sharded ones until the last micro-batch reduce-scatters them: those the peak held go (a new-user trial:
        # +7.8% over the measured peak without them, exact with them; the matrix's GPT row +9.8%, now +0.6%)
        # Where the peak is a trace's (one total), every shard is taken as held at it (an estimate: which shards it
        # held the trace does not say, and a CPU trace's peak moves by a unit's reduce-scatter buffer). Without a
        # unit snapshot (a plain trace), the reduce-scatters' sizes (a new-user trial's plain trace read no figure,
        # and the fix's peak rose 2.79 MiB unwarned; a 2-rank GPT's: +0.90 MiB measured, +1.02 MiB predicted)
        if by_name:
            unsharded, freed = _grads_held(ctx, [by_name[u] for u in counts if u in by_name], trace_peak)
        else:
            unsharded, freed = E.trace_grad_bytes(rows)
            # (sizes unknown: "sharded grads freed: 0 B" read a plain gloo trace's evidence, a new-user trial)
            freed = None if unsharded is None else freed
        # HSDP with set_requires_all_reduce(is_last_micro_batch): the all-reduce runs once per step already, and
        # each unit's reduce-scatter outputs wait in comm buffers between micro-batches for it; without the
        # reduce-scatters they go, but one unit's input at a time (a new-user trial's 2 x 2 mesh: comm buffers
        # 518.62 -> 129.75 KiB at the peak; predicted 3.06 MiB with them, 2.62 MiB measured)
        ars = [r.count_per_step for r in E.trace_rows(ctx, "all_reduce") if r.unit in counts]
        ar_n = statistics.median(ars) if ars else None
        held = None  # (comm buffers go only where HSDP's all-reduce waits for the last micro-batch)
        if ar_n is not None and ar_n < 1.5 and by_name:
            largest = max((E.grad_unsharded_bytes(by_name[u]) for u in counts if u in by_name), default=0)
            held = max(0, E.breakdown(ctx).get("comm_buffers", 0) - largest)
        grow = None if unsharded is None else unsharded - (freed or 0) - (held or 0)
        sev = "warning" if share is None or share >= 0.05 else "info"
        if micro_steps:
            stepper = ("Lightning's profiler steps once per batch" if E.lightning_driven(ctx) else
                       "your loop calls prof.step() per micro-batch")
            text = (f"Each unit reduce-scatters its gradients once per profiler step, and the profiled steps hold "
                    f"one optimizer.step() per {per_opt:.0f} of them: {stepper}, "
                    f"so each step of this report is a micro-batch, and each unit reduce-scatters {n:.0f} times per "
                    f"optimizer step (those the window saw): {comm:.1f} ms of reduce-scatters per profiled step, "
                    f"{exposed:.1f} ms of it exposed. ")
        else:
            text = (f"Each unit reduce-scatters its gradients {n:.0f} times per optimizer step"
                    + (f" ({mb:.0f} micro-batches)" if mb else "") +
                    f": {comm:.1f} ms of reduce-scatters per step, {exposed:.1f} ms of it exposed. ")
        if ar_n is not None and ar_n < 1.5:
            text += (f"HSDP's all-reduce across the replicas runs {ar_n:.0f} time per unit per step already "
                     "(set_requires_all_reduce on the last micro-batch only): the reduce-scatter alone runs per "
                     f"micro-batch, and its outputs wait in comm buffers for that all-reduce ({fmt_bytes(held or 0)} at "
                     "the peak beyond one unit's, which go with it). ")
        after = peak + grow if (peak is not None and grow is not None) else None
        text += ("Turn gradient sync off for all but the last micro-batch; FSDP2 then accumulates unsharded "
                 "gradients locally and reduce-scatters once, at the cost of holding them"
                 + _holding(unsharded, freed, after, trace_peak, plain=not by_name))
        # (a plain trace's micro-batches: its reduce-scatters per unit per step)
        per = mb if mb and mb > 1 else n
        text, code, where, inputs, accumulated, cause = _sync_fix(ctx, text, per, micro_steps)
        return [self.finding(
            sev, f"{n:.0f} reduce-scatters per unit per optimizer step: gradient accumulation syncs every "
                 f"micro-batch{cause}",
            {"reducescatters_per_unit_per_step": round(n, 2), "micro_batches_per_step": per,
             "units": len(counts), "reducescatter_ms_per_step": round(comm, 3),
             "reducescatter_exposed_ms_per_step": round(exposed, 3), "saved_ms_per_step": round(saved, 3),
             # (the figures above are the profiled step's; the prediction applies their share to the median step:
             # "saved per step: 76.4 ms" beside "790.2 -> 734.1 ms" read as a contradiction, a new-user trial)
             "profiled_step_ms": None if window is None else round(window, 3),
             "saved_ms_per_median_step": round(gain, 3),
             "saved_share_pct": None if share is None else round(100 * share, 1), "unsharded_grads_bytes": unsharded,
             "sharded_grads_freed_bytes": freed, "allreduces_per_unit_per_step": ar_n, "comm_buffers_freed_bytes": held},
            text, code, where=where, inputs=inputs, accumulated=accumulated,
            # (an estimate, not a ceiling, where the peak is a plain trace's: the trial's run with the fix measured
            # 4.1% above it, a CPU trace's peak moving by a unit's reduce-scatter buffer from run to run)
            predicted=E.predicted(step, step - gain if step else None, peak, after),
            units=sorted(counts)[:20])]


    def _from_records(self, ctx: Context):
        """Without a trace in the steps analysed (no profiler window, ``profile=False``, or one outside ``analyze
        --steps``): the backward passes per optimizer step the records counted and those that ran with FSDP2's
        gradient sync on (RunFacts' most common pair over the steady steps), each a reduce-scatter of every unit.
        Their time is not measured (on the GPU they overlap the backward; on gloo they sit inside it), so no step
        time is predicted; the memory the fix costs is, from the unit snapshot and the peak. (A new-user trial's
        torchtune recipe accumulating 2 micro-batches with sync on both, analysed past its window, was skipped:
        "needs a torch.profiler trace".)"""
        facts = ctx.report.run
        n, synced = (getattr(facts, k, None) for k in ("backwards_per_step", "synced_backwards_per_step"))
        n, synced = (None if x is UNSET else x for x in (n, synced))
        if not n or synced is None:
            return self.quiet("no reduce-scatter in a profiler trace, and the records count no backward passes per "
                              "optimizer step with gradient sync on (one backward per step, or records before that "
                              "count)")
        if synced < 2:
            return self.quiet(f"{synced} of the {n} backward passes per optimizer step ran with gradient sync on (the "
                              "records; no profiler trace in the steps analysed)")
        micro = E.micro_batches(ctx)
        mb = statistics.median(micro.values()) if micro else None
        if mb is None or mb < 1.5:  # (no micro-batches: backward() called more than once over one forward; records
            # before the count of backward passes through the model read torchtitan's Trainer, one forward a step, as
            # 9 backward passes, 2 with gradient sync on, where its trace showed 1 reduce-scatter per unit)
            return self.quiet(f"the records count {n} backward passes per optimizer step, {synced} with gradient sync "
                              f"on, but {'no' if mb is None else f'{mb:.0f}'} forward pass per unit: no micro-batches "
                              "(no profiler trace in the steps analysed)")
        units = E.param_units(ctx)
        unsharded, freed = _grads_held(ctx, units) if units else (None, 0)
        peak = E.peak_bytes(ctx)
        after = peak + unsharded - freed if peak is not None and unsharded is not None else None
        text = (f"{synced} of the {n} backward passes per optimizer step ran with FSDP2's gradient sync on (the "
                "records), each reduce-scattering every unit's gradients: the reduce-scatters of all but the last are "
                "work the optimizer step does not need. Their time is not measured without a profiler window in the "
                "steps analysed (a window's trace shows it), so no step time is predicted. Turn gradient sync off "
                "for all but the last micro-batch; FSDP2 then accumulates unsharded gradients locally and "
                "reduce-scatters once, at the cost of holding them" + _holding(unsharded, freed, after, False, False))
        text, code, where, inputs, accumulated, cause = _sync_fix(ctx, text, float(n), False)
        step = E.step_ms(ctx)
        return [self.finding(
            "warning", f"{synced} reduce-scatters per unit per optimizer step: gradient accumulation syncs every "
                       f"micro-batch{cause}",
            {"reducescatters_per_unit_per_step": synced, "micro_batches_per_step": n,
             "units": len(units), "measured_by": "records (no profiler trace)", "unsharded_grads_bytes": unsharded,
             "sharded_grads_freed_bytes": freed},
            text, code, where=where, inputs=inputs, accumulated=accumulated,
            predicted=E.predicted(step, None, peak, after), units=sorted(u.name for u in units)[:20])]


def _grads_held(ctx: Context, units: list, trace_peak: bool = False) -> tuple[int, int]:
    """(the units' unsharded gradients FSDP2 holds with gradient sync off, of their shards those the peak held, which
    go): every shard where the peak is a plain trace's one total (``trace_peak``), else at most the peak's sharded
    gradients."""
    shards = sum(E.grad_shard_bytes(u) for u in units)
    return (sum(E.grad_unsharded_bytes(u) for u in units),
            shards if trace_peak else min(E.breakdown(ctx).get("sharded_grads", 0), shards))


def _sync_fix(ctx: Context, text: str, per: float, micro_steps: bool) -> tuple[str, str, str, dict, bool, str]:
    """(text, code, where, inputs, accumulated, the cause said in the title) of the fix: gradient sync on the last
    micro-batch only, in the loop (its ``per`` micro-batches per optimizer step; at least that many where the profiler
    stepped per micro-batch), or accelerate's own setting where its plugin kept it on."""
    # (the window saw part of an optimizer step's micro-batches where the profiler stepped per micro-batch)
    count = f"at least {per:.0f} per optimizer step" if micro_steps else f"{per:.0f} per optimizer step in this run"
    code = (f"# before each micro-batch's backward ({count}):\n"
            "model.set_requires_gradient_sync(is_last_micro_batch)  # reduce-scatter on the last one only")
    text, code, where, inputs = _in_the_loop(ctx, text, code, "set_requires_gradient_sync",
                                             " with gradient sync on for every one")
    accumulated, cause = True, ""
    if (accel := _under_accelerate(ctx, per)) is not None:
        said, plugin_code, plugin_where, accumulated = accel
        text += said
        if plugin_code:  # accelerate's own setting, in place of the loop's line
            code, where, inputs, cause = plugin_code, plugin_where, None, " (sync_each_batch=True)"
    return text, code, where, inputs, accumulated, cause


def _holding(unsharded, freed: int, after, trace_peak: bool, plain: bool) -> str:
    """The end of the text's sentence on what holding the unsharded gradients costs: the predicted peak where there is
    one (as if the peak held every shard where it is a plain trace's), else what is known of them and why no peak is predicted."""
    if after is not None:
        return (" (the predicted peak)." if not trace_peak else
                f" (the predicted peak: {fmt_bytes(unsharded)} of unsharded gradients in place of their "
                f"{fmt_bytes(freed)} of shards, as if the peak held every shard; the trace's memory events do not "
                "say which it held).")
    if unsharded is None:
        return (": their size is not known here, and no peak is predicted" + (
            " (the trace's collectives carry no message sizes: torch.profiler's record_shapes=True records them)"
            if plain else "") + ".")
    return (f": {fmt_bytes(unsharded)} of unsharded gradients in place of their {fmt_bytes(freed)} of shards. No "
            "peak is predicted: the run has no memory figures" + (
                " (torch.profiler's profile_memory=True records them)" if plain else "") + ".")


@register
class AccumulationRegathers(Rule):
    code = "accum.regather"
    name = "Parameters gathered again in every micro-batch"
    description = ("Gradient accumulation reshards each unit after every micro-batch's backward and all-gathers it "
                   "again in the next one's forward; kept gathered until the last, it is gathered once.")
    needs = ("units", "memory")
    severities = ("info", "warning")

    def match(self, ctx: Context):
        if why := E.updated_between(ctx):
            return self.quiet(why)
        micro = E.micro_batches(ctx)
        n = statistics.median(micro.values()) if micro else 1.0
        if n < 2:
            return self.quiet(f"{n:.0f} forward pass per unit per optimizer step: no micro-batches to gather between")
        if (backwards := E.backward_passes(ctx)) is not None and backwards < 2:
            return self.quiet(f"{n:.0f} forward passes per unit per optimizer step feed {backwards:.0f} backward: no "
                              "micro-batches to gather between")
        pm, peak, cap, step = E.peak_memory(ctx), E.peak_bytes(ctx), E.capacity_bytes(ctx), E.step_ms(ctx)
        if not cap:
            return self.skip(E.no_capacity(ctx))
        tl = pm.timeline if pm is not None else []
        if not tl or peak is None or not step:
            return self.quiet("needs the peak step's memory timeline and the step times")
        us = E.param_units(ctx)
        kept = E.kept_between_micro_batches(tl)
        if kept and kept >= 0.5 * sum(u.unsharded_bytes for u in us):
            return self.quiet(f"the units are kept gathered between micro-batches already ({fmt_bytes(kept)} "
                              "unsharded where the next one starts)")
        budget = T.HEADROOM_MAX_SHARE * cap
        if peak >= budget:
            return self.quiet(E.above_share("peak", peak, cap, "capacity", T.HEADROOM_MAX_SHARE))
        # What set_reshard_after_backward(False) removes (FSDP2's post_backward skips reshard(), the next pre_forward
        # finds the unit unsharded: no copy-in, all-gather, copy-out nor unsharded-parameter allocation), measured on
        # the matrix's gpt_regather and hf_llama_regather (2 gloo ranks, 4 micro-batches): the forward all-gathers of
        # every micro-batch but the first (44 -> 26 and 36 -> 21 per profiled step, 6 and 5 units x 3), each with its
        # host work, all inside the recorder's forward wait (FSDP's pre-forward: 171 -> 28 ms a step); the post-
        # backward reshards' frees, 0.3-2 ms a step, which no record times apart; not the backward all-gathers:
        # reshard_after_forward still reshards after the next forward. So the forward waits are the prediction. On
        # gloo the ranks meet at each all-gather, and without them they meet later: the first micro-batch's wait and
        # the backward waits absorb part of what goes (the remaining forward wait a third of the old, not a quarter),
        # which no record can split: on a 2-core host at load averages 4 to 6 the step moved -40.5 to +32 ms against
        # 40-60 ms predicted (README). On a GPU the host runs ahead: its time in FSDP's pre-forward is the
        # launches', and what compute waits for is the trace's exposed all-gathers (E.allgather_ms), the prediction
        # there where there is a trace
        rows = []  # (unit, forward all-gather wait saved per step, its windows)
        source = "host"
        for u in us:
            passes = micro.get(u.name, n)
            wait, src = E.allgather_ms(ctx, u, "forward")
            source = src or source
            saved = (wait or 0.0) * (passes - 1) / passes if passes > 1 else 0.0
            windows = E.regather_windows(tl, u.name)
            if saved > 0 and windows and u.unsharded_bytes > 0 and u.offload is None:
                rows.append((u, saved, windows))
        if not rows:
            return self.quiet("no unit waits for a forward all-gather after the first micro-batch")

        def peak_with(chosen) -> int:
            """Each chosen unit's parameters held from its backward's end to its next forward, where its all-gather
            buffers no longer come (the HF Trainer's Llama: 87.7 MiB predicted with them, 73.2 MiB measured)."""
            return E.timeline_peak(pm, [(windows, u.unsharded_bytes) for u, _, windows in chosen]
                                   + [([(hi - 1, hi)], -E.gather_transient(tl, hi, u.unsharded_bytes))
                                      for u, _, windows in chosen for lo, hi in windows if hi - 1 >= lo])

        rows.sort(key=lambda r: (-r[1] / r[0].unsharded_bytes, r[0].name))
        chosen: list = []
        for r in rows:  # the most time per byte held first, while the peak fits the budget
            if peak_with(chosen + [r]) <= budget:
                chosen.append(r)
        if not chosen:
            return self.quiet(f"no unit fits: kept gathered, the cheapest would take the peak over "
                              f"{100 * T.HEADROOM_MAX_SHARE:.0f}% of capacity {fmt_bytes(cap)}")
        saved = sum(r[1] for r in chosen)
        if saved < T.HEADROOM_MIN_GAIN_SHARE * step:
            return self.quiet(f"the units that fit save {saved:.2f} ms, under "
                              f"{100 * T.HEADROOM_MIN_GAIN_SHARE:.0f}% of the {step:.1f} ms step")
        peak_after = peak_with(chosen)
        names = [r[0].name for r in chosen]
        every = len(chosen) == len(us)
        sev = "warning" if saved >= T.HEADROOM_WARN_GAIN_SHARE * step else "info"
        waits = ("the trace's exposed forward all-gathers" if source == "trace" else
                 "the measured forward all-gather waits")
        text = (f"Each optimizer step runs {n:.0f} micro-batches, and every unit is resharded after each "
                "micro-batch's backward and all-gathered again in the next one's forward. Kept gathered until the "
                f"last micro-batch's backward ({'every unit' if every else f'{len(chosen)} of {len(us)} units'}, "
                "the most time per byte first, while the peak stays under "
                f"{100 * T.HEADROOM_MAX_SHARE:.0f}% of capacity), they are gathered once in forward per step: "
                f"-{saved:.1f} ms per step ({waits} after the first micro-batch), peak "
                f"{fmt_bytes(peak)} -> {fmt_bytes(peak_after)} ({fmt_share(peak_after / cap, 1)} of capacity).")
        call = "set_reshard_after_backward(is_last_micro_batch" + (")" if every else ", recurse=False)")
        calls = f"model.{call}" if every else S.set_on_units(names, call)
        if E.trainer_driven(ctx):  # the Trainer runs the micro-batches: a callback switches before each
            text += " Under the Trainer, a callback switches it before each micro-batch."
            code, where, inputs = S.trainer_micro_batch_switch(calls), "trainer", dict(S.TRAINER_INPUTS)
        else:
            # (one paragraph wrapped at 80 columns: broken by hand at 99, it left a stray "# the parameters
            # gathered" line in every report of a new-user trial's accelerate loop)
            code = "\n".join(S.comment(f"before each micro-batch's backward ({n:.0f} per optimizer step in this "
                                        "run): keep the parameters gathered until the last one's backward, which "
                                        "reshards them before optimizer.step()") + [calls])
            text, code, where, inputs = _in_the_loop(ctx, text, code, "set_reshard_after_backward")
        return [self.finding(
            sev, f"Gathered again in each of {n:.0f} micro-batches: kept gathered, {saved:.1f} ms/step faster",
            {"micro_batches_per_step": n, "units_kept_gathered": [unit_label(x) for x in names], "units": len(us),
             "forward_allgather_wait_saved_ms": round(saved, 3), "measured_by": source, "peak_bytes": peak,
             "capacity_bytes": cap, "peak_after_bytes": int(peak_after), "budget_bytes": int(budget),
             "step_p50_ms": step},
            text, code, where=where, inputs=inputs, accumulated=_accumulate_switched(ctx),
            predicted=E.predicted(step, step - saved, peak, peak_after), units=names)]
