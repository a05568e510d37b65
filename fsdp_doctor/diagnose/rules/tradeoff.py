"""The trade-offs the field argues about, as findings with predicted time and memory.

``reshard.zero2_affordable``: ZeRO-2 against ZeRO-3 per unit. Keeping a unit gathered after forward
(``reshard_after_forward=False``) costs its unsharded parameters from its forward to its backward, at the
step's peak (the peak step's memory timeline says which units are held at which mark), and saves its backward
all-gather (the measured exposed wait). Units are flipped best time saved per byte first, as long as the
predicted peak stays within the memory budget.

``throughput.low_mfu``: a low MFU with its levers in the order the evidence gives them: exposed
communication (fewer, larger units when the collectives are small; overlap when they are large), batch size
(compute dominates but runs far below the device's peak: the kernels are too small), host overhead (CUDA
graphs / compile / fewer launches), input and offload. Each lever gets the step time it could recover, and
the largest is the one the finding points to.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import NamedTuple, Optional

from .. import estimate as E
from .. import snippets as S
from ..base import Context, register
from ...records import runs_compiled
from ...report_sections import ThroughputRank, ThroughputSection
from ...units import fmt_bytes, fmt_share
from ..base import Rule
from ..thresholds import (BOUND_MIN_SHARE, HEADROOM_MAX_SHARE, HEADROOM_MIN_GAIN_SHARE, HEADROOM_WARN_GAIN_SHARE,
                          PREFETCH_OVERLAP_CPU, PREFETCH_OVERLAP_GPU, SMALL_MAX_MEDIAN_BYTES)

# ZeRO-2 on a unit is affordable while the predicted peak stays below this share of capacity; worth a finding
# when the flipped units save at least the next share of the step, a warning from the last (a tenth of the step for
# memory that is there anyway): thresholds.py's, for every fix that spends headroom
ZERO2_MAX_SHARE = HEADROOM_MAX_SHARE
ZERO2_MIN_GAIN_SHARE = HEADROOM_MIN_GAIN_SHARE
ZERO2_WARN_GAIN_SHARE = HEADROOM_WARN_GAIN_SHARE
# The code lists at most this many units one per line; more go in a loop over their names.
ZERO2_LINES = 8

# MFU below this is low: well-tuned FSDP transformer training reaches 35-55% on A100/H100 (torchtitan's
# Llama 3 8B ~40% on H100, PaLM 46%, MegaScale 55%), so below 35% some lever is left.
LOW_MFU_PCT = 35.0
# ... and a warning below this, half of a tuned run: a large lever is left.
LOW_MFU_WARN_PCT = 20.0
# Share of the peak that well-sized kernels reach while computing (large bf16 GEMMs 60-80% of the dense
# peak; the transformer's other ops pull the average down): compute below it means kernels too small.
KERNEL_EFFICIENCY_TARGET = 0.6
# Levers recovering less than this share of the step are left out of the list.
LEVER_MIN_SHARE = 0.01


def _median(xs) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return float(statistics.median(xs)) if xs else None


# ------------------------------------------------------------------------------------------------ ZeRO-2 vs 3
def _unit_fix(us: list[E.Unit]) -> str:
    head = ("# keep these units gathered from forward to backward (ZeRO-2 for them),\n"
            "# best time saved per byte first;\n"
            f"{S.RESHARD_IN_CALLS}\n")
    return head + S.set_on_units([u.name for u in us], "set_reshard_after_forward(False, recurse=False)",
                                 loop_over=ZERO2_LINES)


@dataclass
class _Candidate:
    """A resharded unit that waits for its backward all-gather: what keeping it gathered saves and costs."""

    u: E.Unit
    saved: float  # ms per step: its backward all-gather wait
    held: int  # bytes held from its forward to its backward (its unsharded parameters)
    at_peak: int  # bytes it alone adds at the peak
    comm: Optional[float]  # ms per step: its whole backward all-gather (trace), the saving's upper bound
    flip: bool = False  # chosen: it fits the budget

    @property
    def row(self) -> str:
        """The evidence line: saved (of its whole all-gather), bytes held (what it alone adds at the peak: units
        that add nothing alone can add together, where their holding overlaps), ms per MiB."""
        return (f"{self.u.name}: -{self.saved:.2f} ms" + (f" (of {self.comm:.2f})" if self.comm is not None else "")
                + f" for {fmt_bytes(self.held)} held (+{fmt_bytes(self.at_peak)} at the peak alone) = "
                f"{self.saved / (self.held / (1 << 20)):.2f} ms/MiB: " + ("flip" if self.flip else "does not fit"))


@register
class Zero2PerUnit(Rule):
    code = "reshard.zero2_affordable"
    name = "ZeRO-2 vs ZeRO-3 per unit"
    description = ("Units whose backward all-gather costs more time than keeping them gathered costs memory, "
                   "flipped best time saved per byte first while the peak fits the budget.")
    needs = ("units", "memory", "sharded")  # (one rank per shard group: nothing re-gathered in backward)
    severities = ("info", "warning")

    def match(self, ctx: Context):
        peak, cap, step = E.peak_bytes(ctx), E.capacity_bytes(ctx), E.step_ms(ctx)
        if not cap:
            return self.skip(E.no_capacity(ctx))
        if peak is None or not step:
            return self.quiet("needs the step records' memory and step times")
        budget = ZERO2_MAX_SHARE * cap
        if peak >= budget:
            return self.quiet(f"the peak is already {fmt_share(peak / cap)} of capacity "
                              f"(budget {100 * ZERO2_MAX_SHARE:.0f}%)")
        last = E.resharded_last_unit(ctx)
        resharded = [u for u in E.non_root(E.param_units(ctx)) if u.reshard_after_forward is True]
        # units FSDP2 never gathers in backward (set_unshard_in_backward(False)): keeping them gathered saves nothing
        # and holds their parameters (a new-user trial's embedding was flipped for its hooks' 0.04 ms)
        never = [u.name for u in resharded if not E.gathered_in_backward(u)]
        if last is not None and last.name in never:
            last = None
        cands = [u for u in resharded if u.name not in never
                 and (last is None or u.name != last.name)]  # the last unit is reshard.last_unit's
        not_gathered = (f"{E.fmt_list(never)} {'is' if len(never) == 1 else 'are'} never all-gathered in backward "
                        "(set_unshard_in_backward(False)): kept gathered, only memory is held") if never else ""
        rows: list[_Candidate] = []
        source = ""
        for u in cands:
            saved, src = E.kept_gathered_saves_ms(ctx, u)
            if saved is None or saved <= 0 or u.unsharded_bytes <= 0:
                continue
            source = source or src
            rows.append(_Candidate(u, saved, u.unsharded_bytes, E.zero2_peak(ctx, [u]) - peak,
                                   E.backward_allgather_comm_ms(ctx, u.name)))
        if not rows:
            # (units resharding to a smaller group, reshard_after_forward=<int>, re-gather in backward too, over
            # that group: not weighed here, and "no resharded unit waits" read as false beside their waits)
            partial = sorted({u.reshard_after_forward for u in E.param_units(ctx)
                              if type(u.reshard_after_forward) is int})
            return self.quiet("no resharded unit waits for a backward all-gather" + (
                f"; units resharded to a smaller group (reshard_after_forward="
                f"{', '.join(map(str, partial))}) are not weighed" if partial else "")
                + (f"; {not_gathered}" if never else ""))
        rows.sort(key=lambda r: (-r.saved / r.held, r.u.name))
        for r in rows:
            r.flip = E.zero2_peak(ctx, [c.u for c in rows if c.flip] + [r.u]) <= budget
        chosen = [r for r in rows if r.flip]
        if not chosen:
            return self.quiet(f"no unit fits: headroom {fmt_bytes(budget - peak)} below the budget, the cheapest "
                              f"unit holds {fmt_bytes(min(r.held for r in rows))}")
        saved = sum(r.saved for r in chosen)
        if saved < ZERO2_MIN_GAIN_SHARE * step:
            return self.quiet(f"the units that fit save {saved:.2f} ms, under "
                              f"{100 * ZERO2_MIN_GAIN_SHARE:.0f}% of the {step:.1f} ms step")
        us = [r.u for r in chosen]
        peak_after = E.zero2_peak(ctx, us)
        left = [r.u.name for r in rows if not r.flip]
        # torchtitan's setting keeps every unit gathered after forward, or none (its default: all but the last):
        # its lever where all of them fit the budget
        titan = E.torchtitan_version(ctx)
        where, code = "", None
        if titan is not None and not left and last is None and not never:  # ('never' would keep those too)
            every = E.zero2_peak(ctx, cands)
            code = S.titan_settings(titan, fsdp_reshard_after_forward="never") if every <= budget else None
            if code:
                where, us, peak_after = "torchtitan", cands, every
        upper = sum(r.comm for r in chosen if r.comm is not None) if any(r.comm for r in chosen) else None
        sev = "warning" if saved >= ZERO2_WARN_GAIN_SHARE * step else "info"
        names, n_of = [u.name for u in us], len(cands) if where else len(rows)
        text = (f"The peak is {fmt_share(peak / cap, 1)} of capacity ({fmt_bytes(peak)} of {fmt_bytes(cap)}; the budget "
                f"is {100 * ZERO2_MAX_SHARE:.0f}%). Keeping a unit gathered after forward (ZeRO-2 for that unit) "
                "holds its unsharded parameters from its forward to its backward and removes its backward "
                f"all-gather.{E.repeated_words(ctx, us)} Flip {len(us)} of {n_of} unit(s), best time saved per byte "
                "first: "
                f"{E.fmt_list(names)}: -{saved:.1f} ms per step (the measured wait), peak "
                f"{fmt_bytes(peak)} -> {fmt_bytes(peak_after)} ({fmt_share(peak_after / cap, 1)} of capacity).")
        if left:
            text += f" {E.fmt_list(left)} would not fit the budget."
        if never:
            text += f" Left out: {not_gathered}."
        if last is not None and E.calls_beyond_model(ctx, last.name) >= 1:  # (reshard.last_unit is quiet there)
            text += (f" The last unit {last.name!r} is left as it is: code outside the model's forward runs it and "
                     "sets its resharding (torchtitan's chunked loss).")
        elif last is not None:
            text += f" The last unit {last.name!r} is reshard.last_unit's finding."
        if where:
            text += (f" {S.titan_says(titan)}: its fsdp_reshard_after_forward 'never' keeps every unit gathered "
                     f"after forward, all {len(us)} here (the predicted peak holds them all).")
        elif S.lacks_reshard_switch(ctx.config):
            text += S.reshard_in_calls_words(names, False)
            code = ""
        return [self.finding(
            sev, f"ZeRO-2 on {len(us)} of {n_of} units: {saved:.1f} ms/step faster, "
                 f"{fmt_bytes(peak_after - peak)} more at the peak",
            {"peak_bytes": peak, "capacity_bytes": cap, "budget_bytes": int(budget),
             "headroom_bytes": int(budget - peak), "peak_after_bytes": peak_after,
             "added_at_peak_bytes": peak_after - peak, "peak_after_share_pct": round(100 * peak_after / cap, 1),
             "saved_ms_per_step": round(saved, 3),
             "saved_upper_ms_per_step": None if upper is None else round(upper, 3),
             "step_p50_ms": step, "units_flipped": names, "units_not_fitting": left,
             **({"units_not_gathered_in_backward": never} if never else {}),  # (left out, said in the text)
             "per_unit": [r.row for r in rows], "measured_by": source,
             "memory_model": "timeline" if E.peak_memory(ctx).timeline else "peak"},
            text, _unit_fix(us) if code is None else code, where=where, predicted=E.predicted(step, step - saved, peak, peak_after),
            units=[u.name for u in us])]


# ------------------------------------------------------------------------------------------------ low MFU
def _mfu(tp: ThroughputSection) -> Optional[float]:
    if tp.job.mfu_pct is not None:
        return float(tp.job.mfu_pct)
    return _median(r.mfu_pct for r in tp.per_rank.values())


class _Sizes(NamedTuple):
    calls_per_step: float  # all-gathers per step (the rank with the most)
    median_bytes: float
    busbw_gbps: Optional[float]
    source: str  # "trace" | "unit snapshot"


def _collective_sizes(ctx: Context) -> Optional[_Sizes]:
    """All-gathers per step, median message and achieved bus bandwidth: from the trace, else the unit snapshot
    (each unit all-gathers its unsharded parameters once in forward, once in backward unless kept gathered or never
    gathered there)."""
    rows = [r for r in E.trace_rows(ctx, "all_gather") if r.bytes_per_call]
    if rows:
        ranks = {r.rank for r in rows}
        calls = max(sum(r.count_per_step for r in rows if r.rank == k) for k in ranks)
        return _Sizes(round(calls, 1), statistics.median(r.bytes_per_call for r in rows),
                      _median(r.busbw_gbps for r in rows), "trace")
    us = E.non_root(E.param_units(ctx))
    if not us:
        return None
    calls = sum(1 + (u.reshard_after_forward is not False and E.gathered_in_backward(u)) for u in us)
    return _Sizes(calls, statistics.median(u.unsharded_bytes for u in us), None, "unit snapshot")


@dataclass
class _Lever:
    lever: str
    recoverable_ms: float  # step time it could recover
    evidence: str
    fix: str
    code: str = ""
    mfu_after_pct: float = 0.0

    @property
    def line(self) -> str:
        return f"{self.lever}: ~{self.recoverable_ms:.1f} ms/step -> MFU {self.mfu_after_pct:.1f}% ({self.evidence})"


def _comm_lever(ctx: Context, comm: float, groups: dict[str, float], compute_ms: float) -> _Lever:
    """Exposed communication: small collectives -> fewer, larger units; large ones -> overlap."""
    sizes = _collective_sizes(ctx)
    exposed = f"exposed communication {comm:.1f} ms ({fmt_share(groups['communication'] / 100)}); "
    size_ev = (f"{sizes.calls_per_step} all-gathers per step, median {fmt_bytes(sizes.median_bytes, 1)}"
               + (f", busbw {sizes.busbw_gbps:.1f} GB/s" if sizes.busbw_gbps else "")
               + f" ({sizes.source})") if sizes else "no collective sizes"
    plan = E.grouped_plan(ctx) if sizes is not None and sizes.median_bytes < SMALL_MAX_MEDIAN_BYTES else None
    if plan is not None and plan.units_after < plan.units_before:
        # latency-bound calls: the plan's units pay one call's latency where the run's paid one each (4 blocks per
        # unit: 3/4 of it)
        return _Lever("fewer, larger units", comm * (1 - plan.units_after / plan.units_before),
                      exposed + f"{size_ev}: under {fmt_bytes(SMALL_MAX_MEDIAN_BYTES, 1)}, latency-bound; "
                      f"{plan.units_before} -> {plan.units_after} units",
                      f"fewer, larger FSDP units ({E.plan_words(plan.group)})", plan.code)
    overlapped = _median(pr.overlap_us / E.steps_in_windows(ctx, r) / 1e3 for r, pr in E.overlap(ctx).per_rank.items())
    hideable = max(0.0, compute_ms - (overlapped or 0.0))
    eff = PREFETCH_OVERLAP_GPU if E.on_gpu(ctx) else PREFETCH_OVERLAP_CPU
    regime = (f"latency-bound, and no fewer units to group ({plan.why})" if plan is not None else "bandwidth-bound")
    return _Lever("overlap", min(comm, hideable) * eff,
                  exposed + f"{size_ev}: {regime}; compute free to hide it {hideable:.1f} ms",
                  "explicit forward/backward prefetch, reshard_after_forward=False where memory allows "
                  "(reshard.zero2_affordable), 16-bit collectives", S.prefetch_code(ctx))


def _levers(ctx: Context, step: float, groups: dict[str, float], records: bool, mfu: float,
            tp_rows: list[ThroughputRank]) -> list[_Lever]:
    def ms(group):
        return step * groups.get(group, 0.0) / 100

    out = []
    comm = ms("communication")
    if comm > 0:
        out.append(_comm_lever(ctx, comm, groups, ms("compute")))
    # batch size: compute dominates but runs far below the peak -> the kernels are too small
    comp = ms("compute")
    flops = _median(r.flops_per_step for r in tp_rows)
    peak_tf = _median(r.peak_tflops for r in tp_rows)
    cfg = ctx.config
    tokens = (cfg.tokens_per_step / max(1, cfg.world_size)) if cfg is not None and cfg.tokens_per_step else None
    if comp > 0 and flops and peak_tf:
        eff = flops / (comp / 1e3) / (peak_tf * 1e12)
        ideal = flops / (peak_tf * 1e12 * KERNEL_EFFICIENCY_TARGET) * 1e3
        out.append(_Lever("batch size", max(0.0, comp - ideal),
                          f"compute {comp:.1f} ms ({fmt_share(groups['compute'] / 100)}) at {fmt_share(eff)} of peak "
                          f"while computing (well-sized kernels reach {100 * KERNEL_EFFICIENCY_TARGET:.0f}%)"
                          + (f"; {tokens:.0f} tokens per rank per step" if tokens else ""),
                          "a larger micro-batch per rank (more tokens per kernel); activation checkpointing "
                          "if memory does not allow it"))
    host = ms("host")
    gpu = E.trace_device(ctx) != "cpu"
    # CPUOffloadPolicy's optimizer steps the shards on the host while the device waits: host time no launch lever
    # recovers (the H100 row gpu_gpt_offload: AdamW's loop on the host, 86.4 ms of the 98.3 ms read as the device
    # waiting for launches, where torch.compile was named first)
    host_opt = (min(host, E.phase_ms(ctx, "optimizer") or 0.0) if gpu and E.on_gpu(ctx) and E.offloaded_units(ctx)
                else 0.0)
    if host_opt > 0:
        out.append(_Lever("optimizer on the host", host_opt, f"the optimizer stepping the offloaded shards on the CPU "
                          f"{host_opt:.1f} ms ({fmt_share(host_opt / step)})",
                          "the optimizer's fused CPU step (optim.unfused_step says what it saves), or the state kept "
                          "on the device where it fits (offload.costly: all of it)"))
        host -= host_opt
    if host > 0:
        gc = records  # from step records the host part is GC pauses
        # (on the CPU the trace's host time is the main thread outside operators and collectives: no launches, no CUDA
        # graphs, which a new-user trial's U-Net on gloo was told of)
        what = ("GC pauses" if gc else "device waiting for launches" if gpu
                else "the main thread outside operators and collectives")
        # units compiled already: compiling them again changes nothing (a new-user trial's Qwen2-MoE was given the same
        # unit.compile() lines after pasting them)
        compiled = [u.name for u in (getattr(cfg, "units", None) or []) if runs_compiled(u)]
        if gc:
            fix, code = "gc.freeze() after setup and scheduled collections (jitter.gc)", ""
        elif compiled:
            fix, code = (f"torch.compile is on already ({len(compiled)} unit(s)): the host time left is what it does "
                         "not fuse (FSDP2's hooks and the Python between units)"
                         + ("; CUDA graphs (mode='reduce-overhead') cut the launches left" if gpu else ""), "")
        else:
            fix = ("fewer launches: torch.compile on the blocks, CUDA graphs (mode='reduce-overhead')" if gpu
                   else "fewer, fused operators: torch.compile on the blocks (on a CPU host what it recovers is not "
                   "predicted: a new-user trial's tiny MoE gained nothing)")
            code = (S.unit_list(S.tree(ctx)) + "\nfor unit in units:\n    unit.compile()"
                    + ("  # fused kernels; mode='reduce-overhead' adds CUDA graphs" if gpu else "  # fused operators"))
        out.append(_Lever("GC pauses" if gc else "host overhead", host,
                          f"{what} {host:.1f} ms ({fmt_share(host / step)})", fix, code))
    for group, lever, fix in (
            ("input", "input pipeline", "DataLoader workers, pinned memory, prefetch (jitter.data_wait)"),
            ("offload", "offload copies", "keep the state on the device if it fits (offload.costly)")):
        t = ms(group)
        if t > 0:
            out.append(_Lever(lever, t, f"{group} {t:.1f} ms ({fmt_share(groups[group] / 100)})", fix))
    out = [lv for lv in out if lv.recoverable_ms >= LEVER_MIN_SHARE * step]
    for lv in out:
        lv.mfu_after_pct = round(mfu * step / max(1e-9, step - lv.recoverable_ms), 1)
    out.sort(key=lambda lv: -lv.recoverable_ms)
    return out


@register
class LowMfu(Rule):
    code = "throughput.low_mfu"
    name = "Low MFU"
    description = ("Model FLOPs utilisation below what tuned FSDP runs reach, with its levers ordered by the "
                   "step time each could recover.")
    needs = ("records",)
    severities = ("info", "warning")

    def match(self, ctx: Context):
        tp = ctx.report.throughput
        rows = list(tp.per_rank.values()) if tp is not None else []
        if not rows:
            cfg = ctx.config
            compiled = any(runs_compiled(u) for u in (getattr(cfg, "units", None) or []))
            if compiled and not getattr(cfg, "flops_per_step", None):  # (a U-Net's blocks compiled: "pass
                # tokens_per_step" to a model without tokens, a new-user trial)
                return self.skip("no throughput: FLOPs are not counted where units are compiled (the counter steps "
                                  "aside for compiled code), and the analytic estimate needs tokens_per_step= in "
                                  "watch(), a transformer's tokens per optimizer step")
            # (skipped, not quiet: it could not look, a figure missing; a new-user trial read "quiet" as checked)
            return self.skip(f"no throughput: {E.pass_option(ctx, 'tokens_per_step', 'N')} (FLOPs are counted from it)")
        mfu = _mfu(tp)
        if mfu is None:
            why = ("no FLOP count" if not any(r.flops_per_step for r in rows) else
                   "no peak TFLOP/s for this device (a CPU, or a GPU not in the table)")
            return self.quiet(f"MFU unknown: {why}; {E.pass_option(ctx, 'peak_tflops', 'N')}")
        if mfu >= LOW_MFU_PCT:
            return self.quiet(f"MFU {mfu:.1f}% is not below {LOW_MFU_PCT:.0f}%")
        step = E.step_ms(ctx) or _median(r.step_p50_ms for r in rows)
        job = ctx.report.verdict.job if ctx.report.verdict is not None else None
        if not step or not job:
            return self.quiet("needs the verdict (what bounds the step) and a step time")
        groups = job.groups_pct
        levers = _levers(ctx, step, groups, job.source.startswith("records"), mfu, rows)
        if not levers:
            return self.quiet("no lever recovers 1% of the step")
        first = levers[0]
        sev = "warning" if mfu < LOW_MFU_WARN_PCT else "info"
        # the device idle with work launched (a sync, another rank) has no lever of MFU's: said first, not hidden
        # behind a lever that recovers a sliver of the step
        idle = job.bound == "idle" and groups.get("idle", 0.0) >= 100 * BOUND_MIN_SHARE
        text = (f"MFU is {mfu:.1f}% (below the {LOW_MFU_PCT:.0f}% tuned FSDP runs reach; the step is "
                f"{job.summary or job.bound}). Levers by the step time each could recover: "
                + "; ".join(f"{i + 1}. {lv.lever} ~{lv.recoverable_ms:.1f} ms -> MFU {lv.mfu_after_pct:.1f}%"
                            for i, lv in enumerate(levers[:4]))
                + (f". First, the step is idle-bound ({fmt_share(groups['idle'] / 100)}): the device waits with work "
                   "launched (a synchronisation, another rank), which none of these levers addresses (verdict.severe "
                   f"says where to look); then {first.lever}: {first.evidence}. Fix: {first.fix}." if idle else
                   f". The evidence points to {first.lever} first: {first.evidence}. Fix: {first.fix}."))
        if first.lever == "batch size":
            # a larger micro-batch: the same step time per token falls; the activations grow with the batch
            # (and under activation checkpointing the recomputed ones at a peak in a backward, in the temporaries:
            # a checkpointed ViT's doubled batch peaked 45% over the activations alone, a new-user trial)
            rec = E.recomputed_at_peak(ctx)
            acts = (E.breakdown(ctx).get("activations") or 0) + rec
            peak, cap = E.peak_bytes(ctx), E.capacity_bytes(ctx)
            after = peak + acts if (peak is not None and acts) else None
            pred = E.predicted(step, None, peak, after)
            text += (" Doubling the micro-batch doubles the activations (the predicted peak" +
                     (f", the {fmt_bytes(rec)} recomputed at the peak by activation checkpointing with them" if rec
                      else "") + ")." +
                     (f" That peak, {fmt_bytes(after)}, is over the {fmt_bytes(cap)} memory budget: a smaller step "
                      "up in batch, or more memory freed first." if after and cap and after > cap else ""))
        elif (first.lever == "host overhead" and (not first.code or E.trace_device(ctx) == "cpu")
              or first.lever == "optimizer on the host"):
            pred = None  # (no code, or torch.compile on a CPU host: a gain this rule cannot size; the host's
            # optimizer: what its two fixes recover differs, each rule sizes its own)
        else:
            pred = E.predicted(step, step - first.recoverable_ms)
        notes = sorted({r.flops_note for r in rows if r.flops_note})
        return [self.finding(
            sev, (f"MFU {mfu:.1f}%: the step is idle-bound ({fmt_share(groups['idle'] / 100)}), no MFU lever for that"
                  if idle
                  else f"MFU {mfu:.1f}%: the evidence points to {first.lever} first"),
            {"mfu_pct": round(mfu, 2), "threshold_pct": LOW_MFU_PCT, "step_p50_ms": round(step, 3),
             "achieved_tflops_per_rank": _median(r.achieved_tflops for r in rows),
             "peak_tflops": _median(r.peak_tflops for r in rows),
             "flops_source": ", ".join(sorted({r.flops_source for r in rows if r.flops_source})),
             **({"flops_note": "; ".join(notes)} if notes else {}),  # analytic FLOPs: which parameters counted
             "bound": job.bound,
             "groups_pct": {k: v for k, v in groups.items() if v}, "first_lever": first.lever,
             "levers": [lv.line for lv in levers],
             "lever_order": [lv.lever for lv in levers],
             "recoverable_ms": {lv.lever: round(lv.recoverable_ms, 3) for lv in levers}},
            text, first.code, predicted=pred)]
