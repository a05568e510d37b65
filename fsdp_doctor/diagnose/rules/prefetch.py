"""Prefetch and reshard rules: all-gathers on the critical path, parameters gathered too early, a frozen unit
gathered in backward for nothing, the synchronous unshard on gloo, the last unit resharded for nothing (ZeRO-2 per
unit: rules/tradeoff.py)."""

from __future__ import annotations

import statistics
from typing import Optional

from .. import estimate as E
from .. import snippets as S
from .. import thresholds as T
from ...trace.analysis import BLOCKED_AG_SHARE, blocked_allgathers
from ...units import ROOT_LABEL, fmt_bytes, fmt_share, unit_label
from ..base import Context, Rule, register

# Exposed all-gather waits above this share of the step are worth acting on, on a GPU where the
# collectives run on their own stream and could overlap fully ...
EXPOSED_AG_WARN_SHARE_GPU = 0.10
EXPOSED_AG_INFO_SHARE_GPU = 0.05
# ... and on a CPU host, where gloo's threads compete with compute for the same cores, so a large part
# of the wait is structural (measured on the 2-rank reference workload: 20-45% of the step with async
# unshard, on a loaded host): only a majority of the step is a finding.
EXPOSED_AG_WARN_SHARE_CPU = 0.50
EXPOSED_AG_INFO_SHARE_CPU = 0.15
# Share of an all-gather that explicit prefetch hides behind the previous unit's compute: all of it on a
# GPU (own stream); none measurable on gloo (its threads and compute share the cores: benchmarks/
# predictions.py measured explicit depth-1 prefetch at +13% +- noise on the 2-rank CPU workload).
PREFETCH_OVERLAP_GPU = T.PREFETCH_OVERLAP_GPU
PREFETCH_OVERLAP_CPU = T.PREFETCH_OVERLAP_CPU
# Memory is tight when the peak is at least this share of capacity.
TIGHT_SHARE = T.NEAR_CAPACITY_SHARE
# Gathered parameters held unused this long before use (and this share of the step) cost memory for nothing.
HELD_MIN_MS = 1.0
HELD_MIN_STEP_SHARE = 0.03
# Explicit prefetch this many units ahead keeps that many extra units gathered; one ahead is the norm.
EXPLICIT_DEPTH_WARN = 2
# Synchronous unshard on gloo: the share of the backward all-gather waits that async unshard plus FSDP's
# implicit backward prefetch removed on the reference workload (2 ranks, 2 cores: waits ~3.3 -> ~1.4 ms).
GLOO_ASYNC_BWD_SAVED = 0.5
# The last unit's immediate re-gather matters when it costs at least this share of the step; measured under this
# one, it is no finding (a new-user trial's head unit, split off the root by wrap.params_in_root's plan, waited 0 µs
# for its backward all-gather and read "step unchanged, peak unchanged" as a note: one fix leading to another)
LAST_UNIT_WARN_SHARE = 0.02
LAST_UNIT_INFO_SHARE = 0.01
# An all-gather of a frozen unit that never runs backward is a warning from this share of the step on a GPU (its
# exposed time in the trace), or wherever the peak is near capacity (T.NEAR_CAPACITY_SHARE) and holds it; a note
# otherwise. Not by time on gloo: there the copies share the cores with compute and the exposure is the host's load
# (0.1-4.7% on the tuned fine-tuning baselines, and once over 15% under a loaded run of the whole table).
FROZEN_GATHER_WARN_SHARE_GPU = 0.05


# what prefetch.exposed_allgather says where explicit prefetch is set and the waits remain, and of its snippet on gloo
_PREFETCH_SET = ("if the waits remain, the all-gathers are slower than the compute they hide behind: larger units "
                 "(fewer, bigger calls) or reshard_after_forward=False on the units whose backward waits dominate "
                 "(if memory allows).")
_GLOO_NO_GAIN = (" On gloo, prefetch gains nothing measurable (gloo's threads share the cores with compute): "
                 "expect no step-time change from the snippet.")


def _exposed_severity(share: float, cpu: bool):
    """"warning", "info" or None for exposed all-gather waits taking ``share`` of the step."""
    warn, info = ((EXPOSED_AG_WARN_SHARE_CPU, EXPOSED_AG_INFO_SHARE_CPU) if cpu
                  else (EXPOSED_AG_WARN_SHARE_GPU, EXPOSED_AG_INFO_SHARE_GPU))
    return None if share < info else ("warning" if share >= warn else "info")


def _below(total: float, step: float, cpu: bool, source: str) -> str:
    info = EXPOSED_AG_INFO_SHARE_CPU if cpu else EXPOSED_AG_INFO_SHARE_GPU
    return (E.below_share("exposed all-gather waits", total, step, "the step", info, ms=True)
            + f", on {'a CPU' if cpu else 'a GPU'} ({'host timing' if source == 'host' else source})")


def _is_cpu(ctx: Context) -> bool:
    return not E.on_gpu(ctx)


def _sync_gloo_units(ctx: Context) -> list[E.Unit]:
    if E.backend(ctx) != "gloo":
        return []
    return [u for u in E.non_root(E.param_units(ctx)) if not u.unshard_async_op]


def _blocked_allgathers(ctx: Context) -> tuple[int, int]:
    """From the trace: (the all-gathers the host sat in for their whole length, the all-gathers)."""
    return blocked_allgathers(E.overlap(ctx))


def _trace_shows_sync(ctx: Context) -> bool:
    """The trace shows the synchronous unshard: on a CPU trace, the host blocked in (nearly) every all-gather
    (BLOCKED_AG_SHARE)."""
    n, total = _blocked_allgathers(ctx)
    return E.trace_device(ctx) == "cpu" and total > 0 and n >= BLOCKED_AG_SHARE * total


def _sat_in(ctx: Context) -> str:
    """The blocked all-gathers in words."""
    n, total = _blocked_allgathers(ctx)
    ranks = len(E.overlap(ctx).per_rank)
    return (f"the host sat in {n} of {total} all-gathers for their whole length (the profiled windows of {ranks} "
            f"rank{'s' if ranks != 1 else ''})")


def _forward_prefetched(ctx: Context) -> list[str]:
    """The units the trace shows FSDP2 prefetching in forward (its FSDP::forward_prefetch labels, on any rank):
    explicit forward prefetch is set."""
    return sorted({u for pr in E.overlap(ctx).per_rank.values() for u in pr.forward_prefetched})


@register
class ExposedAllGather(Rule):
    code = "prefetch.exposed_allgather"
    name = "All-gathers on the critical path"
    description = "Compute waits for parameter all-gathers that prefetching could have started earlier."
    # (one rank gathers from itself: FSDP copies the shards in and out, no collective to wait for; the H100's
    # one-rank tiny GPT read its host's launch time there as 7 ms of all-gather wait, the trace none)
    needs = ("records|trace", "sharded")
    severities = ("info", "warning")
    last = True  # (quiet where wrap.too_coarse fired on a model sharded whole: ctx.earlier)

    def match(self, ctx: Context):
        if not E.param_units(ctx):
            return self._from_plain_trace(ctx)
        step = E.step_ms(ctx)
        # with a straggler, the waits and the exposure are its own (E.late_rank: the others wait for its lateness)
        late = E.late_rank(ctx)
        read = "" if late is None else E.read_on_straggler(late)
        trace = E.trace_exposed_by_unit(ctx, "all_gather", ranks=E.read_ranks(ctx))
        cpu = _is_cpu(ctx)
        by_name = {u.name: u for u in E.param_units(ctx)}
        rows = []
        if not cpu and trace:
            # on a GPU the host runs ahead of the device: only the trace sees the stream waiting
            source = "trace"
            for (name, ph), w in trace.items():
                if w > 0 and name in by_name and ph in ("forward", "backward"):
                    rows.append((by_name[name], ph, w))
            us = [by_name[n] for n in by_name if by_name[n].has_timing] or list(by_name.values())
        else:
            source = "host"
            us = [u for u in by_name.values() if u.has_timing]
            for u in us:
                for ph in ("forward", "backward"):
                    w = E.ag_wait_ms(u, ph)
                    if w > 0:
                        rows.append((u, ph, w))
        # on the host, the step of median share and its own wall (the units' rows name where the waits fall); from the
        # trace, its rows against the step p50
        fwd, bwd, of = (E.median_step_ag_waits(ctx) if source == "host" else None) or (
            sum(w for _, ph, w in rows if ph == "forward"), sum(w for _, ph, w in rows if ph == "backward"), step)
        total = fwd + bwd
        if not step or not us or not total:
            return self.quiet(("no step time measured" if not step else "no unit timed" if not us else
                               "compute never waited for an all-gather") + (read and "; " + read))
        if not E.non_root(E.param_units(ctx)) and any(f.code == "wrap.too_coarse" for f in ctx.earlier):
            # (a new-user trial's nn.Sequential under fully_shard(model) alone read "Prefetch the next unit
            # explicitly" with no next unit, no snippet and 0 µs of compute to hide behind)
            return self.quiet(f"the root is the only unit: compute waits {total:.1f} ms in a step for its all-gathers "
                              "with no unit before it to prefetch them behind (wrap.too_coarse says it: its blocks "
                              "as units of their own)")
        share = total / of
        sev = _exposed_severity(share, cpu)
        if sev is None:
            return self.quiet(_below(total, of, cpu, source) + (read and "; " + read))
        # the share on the step p50: the step holding the median share may be a long one (a loaded host stretches a
        # step and its waits), and its waits beside the p50 read twice those of a typical step (a new-user trial:
        # "142.4 ms per step (29%)" beside a 308.7 ms step, from a 499.1 ms one)
        taken = of
        if source == "host" and step and of != step:
            fwd, bwd, of = fwd * step / of, bwd * step / of, step
            total = fwd + bwd
        notes = []
        sync = _sync_gloo_units(ctx)
        if sync:
            sev = "info"
            notes.append("the unshard is synchronous on gloo (see prefetch.sync_unshard): fix that first")
        rows.sort(key=lambda x: -x[2])
        # explicit forward prefetch (the snippet's chain, in the order the units' forward starts): unit i's
        # all-gather overlaps unit i-1's forward compute
        timed = {u.name: u for u in E.non_root(us)}
        order = [timed[n] for n in S.gather_order(S.tree(ctx))[0] if n in timed]
        eff = 0.0 if sync else (PREFETCH_OVERLAP_CPU if cpu else PREFETCH_OVERLAP_GPU)
        # the compute it can hide behind: on a GPU with a trace the previous unit's forward kernels on the device (the
        # host's forward time is mostly launches there: 2.0-2.6 ms per unit of the 2-rank H100 GPT, 0.05-0.13 ms on
        # the device), and no more than the step's compute that no collective overlaps yet
        device = E.device_forward_ms(ctx) if source == "trace" else {}
        saved = hideable = 0.0
        fwd_wait = {u.name: w for u, ph, w in rows if ph == "forward"}
        for prev, cur in zip(order, order[1:]):
            behind = device.get(prev.name, 0.0) if device else E.compute_fwd_ms(prev)
            hideable += behind
            saved += min(fwd_wait.get(cur.name, 0.0), behind) * eff
        free = None if cpu else E.free_compute_ms(ctx)
        if free is not None:
            saved = min(saved, free * eff)
        # where the trace measured the device's compute, the severity follows the gain the snippet can bring, not the
        # exposure alone (the H100 GPT's exposed all-gathers were 55% of its step with 0.5 ms of forward compute to
        # hide them behind: its rerun measured 74.7 -> 80.9 ms where 68.8 ms had been predicted from the host's
        # times); under the share the rule notes at all, no snippet: there is nothing for prefetching to hide behind
        by_gain = _exposed_severity(saved / step, cpu=False) if device else "warning"
        if by_gain != "warning":
            sev = "info"
        no_room = bool(device) and by_gain is None
        # the second half of the advice: reshard_after_forward=False on the resharded units removes their backward
        # all-gathers (measured host waits) at the cost of keeping them gathered until backward; only the units that
        # wait for one (a frozen prefix is never gathered in backward, nor a unit set_unshard_in_backward(False): kept
        # gathered they cost memory for nothing)
        # (the waits as reshard.zero2_affordable measures them, the GPU trace's where there is one: the host's
        # clock read ~7.9 ms beside its 70.0 ms for the same units, a new-user trial on the H100 fixture)
        waits = {u.name: E.kept_gathered_saves_ms(ctx, u)[0] or 0.0 for u in E.non_root(us)} if bwd > 0 else {}
        z2 = [u for u in E.non_root(us) if not E.kept_gathered(u) and E.gathered_in_backward(u)
              and waits.get(u.name, 0.0) > 0]
        saved_bwd = sum(waits[u.name] for u in z2)
        peak = E.peak_bytes(ctx)
        # the same memory model as reshard.zero2_affordable: each unit keeps its unsharded bytes (and its shard)
        # from its forward to its backward all-gather, added along the peak step's timeline
        z2_peak = E.zero2_peak(ctx, z2) if z2 else None
        added = (z2_peak - peak) if (z2_peak is not None and peak is not None) else sum(
            E.gathering_after_forward_bytes(u) for u in z2)
        has_fwd_prefetch = any(u.forward_prefetch for u in us)
        # lists naming units that ran before their own add all-gathers rather than hide them (prefetch.wrong_order)
        wrong = (_wrong_lists(ctx) or ([],))[0] if has_fwd_prefetch else []
        if cpu and has_fwd_prefetch:
            # the snippet pasted on gloo, the waits still there (a new-user trial's rerun kept the finding, as its
            # text had said it would): gloo's threads share the host's cores with the compute, no prefetch hides
            # them; on a GPU the finding stays and says what is left
            return self.quiet(f"explicit prefetch is set and compute still waits {total:.1f} ms per step "
                              f"({fmt_share(share)}) for all-gathers: on gloo they share the host's cores with the "
                              "compute, and no prefetch hides them (comm.bound and the verdict weigh them)"
                              + (f"; {len(wrong)} of its lists name units that ran before their own, which adds "
                                 "all-gathers (prefetch.wrong_order)" if wrong else ""))
        of_step = ("of the step" if taken == step else f"of the step p50: the median of the steps' shares, the one "
                   f"holding it {taken:.1f} ms long")
        # on the CPU both clocks are the host's, over different steps: the recorder's waits (every steady step) and
        # the profiled window's exposure (the report's headline); said where they differ, so neither reads wrong.
        # The headline's is the verdict's all-gather parts: on gloo they count the main thread's waits around each call,
        # as the recorder's do, which the per-unit rows (the collective on gloo's thread) leave out: their sum read
        # 18.7 ms beside the verdict's 40.8 ms and the recorder's 52.4 ms of waits (a new-user trial)
        fwd_ag, bwd_ag = E.breakdown_ms(ctx, "allgather_fwd"), E.breakdown_ms(ctx, "allgather_bwd")
        traced = statistics.median(a + bwd_ag[r] for r, a in fwd_ag.items()) if trace and fwd_ag else None
        other = (f" (the host's waits, timed by the recorder in every steady step; the profiled window's trace counts "
                 f"{traced:.1f} ms of exposed all-gathers in its steps)" if source == "host" and traced
                 and abs(traced - total) > 0.5 * max(traced, total) else "")
        text = (f"Compute waits {total:.1f} ms per step ({fmt_share(share)} {of_step}) for all-gathers{other}"
                f"{read and ', ' + read}: "
                f"{fwd:.1f} ms in forward, {bwd:.1f} ms in backward. "
                + ("Largest (median per unit): " + ", ".join(f"{u.name or '(root)'} {ph} {w:.1f} ms"
                                                             for u, ph, w in rows[:4]) + ". " if rows else ""))
        if no_room:
            text += (f"Prefetching cannot hide them: the device computes {hideable:.2f} ms of forward per step behind "
                     "which the next unit's all-gather could run"
                     + (f" ({free:.2f} ms of compute free of collectives in the whole step)" if free is not None
                        else "") + ", and in backward the reduce-scatters share the link with FSDP's own one-ahead "
                     "prefetch. The step waits on the collectives themselves: fewer bytes or fewer calls (16-bit "
                     "all-gathers, larger units where they are small) or more compute per byte (a larger micro-batch "
                     "per rank) shorten it; comm.bound says which.")
        elif has_fwd_prefetch and wrong:
            text += (f"Explicit prefetch is set, but {len(wrong)} of its lists name units that ran before their own: "
                     "they gather those units again rather than ahead (prefetch.wrong_order's fix sets them in the "
                     "run's order).")
        elif has_fwd_prefetch:
            text += "Explicit prefetch is already set; " + _PREFETCH_SET
        else:
            text += ("FSDP2 prefetches implicitly only in backward; in forward each unit's all-gather starts "
                     "when the unit is reached. Prefetch the next unit explicitly so that its all-gather runs "
                     "during the current unit's compute; if the backward waits dominate and memory allows, "
                     "reshard_after_forward=False on those units removes them.")
        # the gain quoted is the snippet's (explicit prefetch); reshard_after_forward=False is another fix, with
        # its own memory cost: named here, predicted by reshard.zero2_affordable
        # (set already: no snippet, and no gain "from the snippet": a new-user trial read one with none printed)
        if saved > 0 and not no_room and not has_fwd_prefetch:
            text += f" Expected from the snippet (explicit prefetch): ~{saved:.1f} ms per step."
        elif cpu and not has_fwd_prefetch:
            text += _GLOO_NO_GAIN
        if saved_bwd > 0:
            again = E.repeated_words(ctx, z2)
            text += (f" Separately, reshard_after_forward=False on the resharded units would remove up to "
                     f"~{saved_bwd:.1f} ms of {'all-gather' if again else 'backward'} waits for +{fmt_bytes(added)} "
                     f"(reshard.zero2_affordable weighs it per unit against the memory budget).{again}")
        if notes:
            text += " Note: " + "; ".join(notes) + "."
        gain = 0.0 if has_fwd_prefetch else saved  # (nothing to paste: no gain of its own)
        return [self.finding(
            sev, f"All-gathers stall compute for {total:.1f} ms per step ({fmt_share(share)})",
            {"exposed_ag_ms_per_step": round(total, 3), "exposed_ag_fwd_ms": round(fwd, 3),
             "exposed_ag_bwd_ms": round(bwd, 3), "exposed_share_pct": round(100 * share, 1), "step_p50_ms": step,
             "share_taken_of_step_wall_ms": round(taken, 3),  # (the wall of the step the share is of)
             "worst_units": [f"{u.name or '(root)'} ({ph}): {w:.2f} ms" for u, ph, w in rows[:6]],
             "trace_exposed_ag_ms_per_step": None if traced is None else round(traced, 3),
             "measured_by": source, "read_on_straggler": None if late is None else int(late.rank),
             "prefetch_overlap_assumed_pct": round(100 * eff), "expected_gain_ms": round(gain, 3),
             "compute_to_hide_behind_ms": round(hideable, 3),
             "compute_measured_by": "trace (device)" if device else "host",
             "free_compute_ms_per_step": None if free is None else round(free, 3),
             "reshard_after_forward_false_ms": round(saved_bwd, 3), "reshard_after_forward_false_bytes": added},
            text, "" if no_room or has_fwd_prefetch else S.prefetch_code(ctx),  # (set already: nothing to paste)
            # always a prediction, a zero gain included: "no change expected" is a prediction too
            predicted=E.predicted(step, step - gain, peak, peak),
            units=sorted({u.name for u, _, _ in rows[:6]}))]


    def _from_plain_trace(self, ctx: Context):
        """A plain Kineto trace (no records, no unit snapshot): units and phases from FSDP2's labels, the
        step from the trace's complete steps, the compute that could hide a forward all-gather from the
        verdict's breakdown."""

        # with a straggler, the other ranks' first all-gather of a step waits for it to arrive: its lateness
        # (straggler.trace's), which no prefetch hides; the straggler's own waits are the all-gathers' (read as the
        # median of the ranks, one late rank of 4 doubled the exposure: 1.02 ms a step against 0.08 ms without it)
        late = E.late_rank(ctx)
        trace = E.trace_exposed_by_unit(ctx, "all_gather", ranks=E.read_ranks(ctx))
        step = E.trace_step_ms(ctx)
        rows = [(u, ph, w) for (u, ph), w in trace.items() if w > 0 and ph in ("forward", "backward")
                and u not in ("(other)",)]
        read = "" if late is None else E.read_on_straggler(late)
        on_late = read and ", " + read
        if not rows or not step:
            return self.quiet("no step in the trace" if not step else f"no all-gather exposed in the trace{on_late}")
        cpu = E.trace_device(ctx) != "gpu"
        total = sum(w for _, _, w in rows)
        if {u for u, _, _ in rows} == {ROOT_LABEL} and any(f.code == "wrap.too_coarse" for f in ctx.earlier):
            # (as from the records: the H100 GPT's whole-model trace read "prefetch the next unit explicitly")
            return self.quiet(f"the root is the only unit: compute waits {total:.2f} ms in a step for its "
                              "all-gathers with no unit before it to prefetch them behind (wrap.too_coarse says it)")
        share = total / step
        sev = _exposed_severity(share, cpu)
        if sev is None:
            return self.quiet(_below(total, step, cpu, "trace") + (read and "; " + read))
        rows.sort(key=lambda x: -x[2])
        fwd = sum(w for _, ph, w in rows if ph == "forward")
        bwd = total - fwd
        # explicit forward prefetch hides every forward all-gather but the first behind the previous unit's
        # compute, as far as there is compute (GPU); none measurable on gloo
        fwd_rows = sorted((u, w) for u, ph, w in rows if ph == "forward")
        hideable = fwd - (max(w for _, w in fwd_rows) if fwd_rows else 0.0)
        verdicts = ctx.report.verdict.per_rank if ctx.report.verdict is not None else {}
        compute_ms = statistics.median(
            v.step_ms * v.groups_pct["compute"] / 100 for v in verdicts.values()) if verdicts else 0.0
        # explicit forward prefetch in the trace (FSDP2 labels a forward prefetch only where a list is set): the fix
        # pasted already. A new-user trial's rerun of it on gloo printed the same finding and fix again (its 9
        # FSDP::forward_prefetch labels a trace, the stall 8.84 -> 18.48 ms a step); there, as in record mode, quiet
        explicit = _forward_prefetched(ctx)
        # gloo's all-gathers block the host unless the unshard is asynchronous: a prefetched all-gather then runs to
        # its end before the unit computes, and prefetching hides nothing (the trial's traces: the host sat in 18 of
        # 18 all-gathers per rank, before the paste and after)
        sync = _trace_shows_sync(ctx)
        blocked, calls = _blocked_allgathers(ctx)
        sat_in = _sat_in(ctx)
        if cpu and explicit:
            return self.quiet(
                f"explicit prefetch is set (the trace's FSDP::forward_prefetch labels name {E.fmt_list(explicit)}) "
                f"and compute still waits {total:.2f} ms per step ({fmt_share(share)}) for all-gathers: "
                + (f"the unshard is synchronous on gloo ({sat_in}), and no prefetch overlaps an all-gather the host "
                   "waits in (prefetch.sync_unshard)" if sync else
                   "on gloo they share the host's cores with the compute, and no prefetch hides them (comm.bound and "
                   "the verdict weigh them)"))
        saved = 0.0 if cpu or explicit else min(hideable, compute_ms) * PREFETCH_OVERLAP_GPU
        if sync or (not cpu and _exposed_severity(saved / step, cpu=False) != "warning"):
            sev = "info"  # on a GPU the severity follows the gain prefetching can bring (the trace's compute)
        names = sorted({u for u, _, _ in rows})
        text = (f"Compute waits {total:.2f} ms per step for all-gathers{on_late} ({fwd:.2f} ms in forward, {bwd:.2f} "
                "ms in backward; from the trace: units and phases from FSDP2's labels). ")
        if sync:
            # (record mode notes it beside its snippet; here the trace is the evidence, and the snippet no help)
            text += (f"The unshard is synchronous on gloo: {sat_in}. FSDP2's all-gathers on gloo block the host unless "
                     "the unshard is asynchronous, so a prefetched all-gather too runs to its end before the current "
                     "unit computes: prefetching cannot hide them. Make the unshard asynchronous first "
                     "(prefetch.sync_unshard's fix).")
            code = ""
        elif explicit:
            text += (f"Explicit prefetch is already set (the trace's FSDP::forward_prefetch labels name "
                     f"{E.fmt_list(explicit)}); " + _PREFETCH_SET)
            code = ""
        else:
            text += ("In forward FSDP2 issues a unit's all-gather when the unit is reached; prefetch the next unit "
                     "explicitly so that it runs during the current unit's compute. Backward waits remain when an "
                     "all-gather takes longer than the unit's backward compute: larger units, or "
                     "reshard_after_forward=False where memory allows." + (_GLOO_NO_GAIN if cpu else ""))
            code = S.prefetch_code(ctx, backward=False)
        return [self.finding(
            sev, f"All-gathers stall compute for {total:.2f} ms per step ({fmt_share(share)})",
            {"exposed_ag_ms_per_step": round(total, 3), "exposed_ag_fwd_ms": round(fwd, 3),
             "exposed_ag_bwd_ms": round(bwd, 3), "exposed_share_pct": round(100 * share, 1),
             "step_ms": round(step, 3),
             "worst_units": [f"{u} ({ph}): {w:.3f} ms" for u, ph, w in rows[:6]], "measured_by": "trace",
             "ranks_read": sorted({int(r.rank) for r in E.trace_rows(ctx, "all_gather")}) if late is None
             else [int(late.rank)],
             "allgathers_blocking_host": blocked, "allgathers": calls, "forward_prefetched": explicit},
            text, code, predicted=E.predicted(step, step - saved if saved > 0 else None), units=names[:10])]


@register
class PrefetchTooEarly(Rule):
    code = "prefetch.too_early"
    name = "Parameters gathered too early"
    description = "Prefetched parameters sit gathered long before use while memory is tight."
    needs = ("memory", "trace")
    severities = ("info", "warning")

    def match(self, ctx: Context):
        peak, cap, step = E.peak_bytes(ctx), E.capacity_bytes(ctx), E.step_ms(ctx)
        if not peak or not cap or not step:
            return self.skip(E.no_peak_or_capacity(ctx, peak, cap) if step else "no step time measured")
        share = peak / cap
        if why := E.below_budget(ctx, peak, cap, TIGHT_SHARE):  # (optim.before_shard's stale tensors aside)
            return self.quiet(why)
        by_name = {u.name: u for u in E.units(ctx)}
        held: dict[tuple[str, str], list[float]] = {}
        for r in E.trace_rows(ctx, "all_gather"):
            if r.held_us is None:
                continue
            held.setdefault((r.unit, r.phase or ""), []).append(r.held_us / 1e3)
        rows = []
        for (unit, ph), v in held.items():
            ms = max(v)
            if ms >= max(HELD_MIN_MS, HELD_MIN_STEP_SHARE * step) and unit in by_name:
                rows.append((by_name[unit], ph, ms))
        depth = max((len(u.forward_prefetch) for u in by_name.values()), default=0)
        bdepth = max((len(u.backward_prefetch) for u in by_name.values()), default=0)
        if not rows or max(depth, bdepth) <= 1:
            # FSDP's implicit prefetch (one unit ahead) holds the next unit by design, and so does an explicit
            # list of one: this rule's own fix (it fired again on the rerun of its snippet)
            return self.quiet("prefetch is at most one unit ahead (FSDP's own)" if rows else
                              f"no all-gather is held {HELD_MIN_MS:g} ms or more before use")
        rows.sort(key=lambda x: -x[2])
        peak = E.peak_bytes(ctx)
        # one fewer unit gathered at the peak: the largest of those held early
        saved = max(u.unsharded_bytes - u.sharded_bytes for u, _, _ in rows)
        sev = "warning" if max(depth, bdepth) >= EXPLICIT_DEPTH_WARN else "info"
        one_ahead = S.prefetch_code(ctx)
        code = ("# prefetch one unit ahead at most (or clear the explicit lists to fall back to FSDP's default)\n"
                + one_ahead) if one_ahead else ""
        return [self.finding(
            sev, f"Parameters of {len(rows)} unit(s) are gathered up to {rows[0][2]:.1f} ms before use "
                       f"with memory at {fmt_share(share)} of capacity",
            {"peak_share_of_capacity_pct": round(100 * share, 1), "peak_bytes": peak,
             "capacity_bytes": E.capacity_bytes(ctx), "forward_prefetch_depth": depth,
             "backward_prefetch_depth": bdepth,
             "held_units": [f"{u.name or '(root)'} ({ph}): {ms:.1f} ms, {fmt_bytes(u.unsharded_bytes)}"
                            for u, ph, ms in rows[:6]]},
            "These all-gathers finish long before their unit computes, so their unsharded parameters occupy "
            "memory while earlier units still run, and memory is near capacity. Reduce the explicit prefetch "
            "depth to one unit (or drop it), so at most the computing unit and the next one are gathered.",
            code, predicted=E.predicted(step, step, peak, peak - saved if peak is not None else None),
            units=[u.name for u, _, _ in rows[:10]])]


@register
class FrozenGathered(Rule):
    code = "prefetch.frozen_gathered"
    name = "Frozen unit gathered in backward for nothing"
    description = ("A frozen unit before every trainable parameter never runs backward, yet a backward prefetch "
                   "(FSDP2's default: the previous unit in forward order) all-gathers it in every backward.")
    needs = ("units",)
    severities = ("info", "warning")

    def match(self, ctx: Context):
        us = E.post_forward_order(E.units(ctx), S.run_order(ctx)[0])
        if any(u.trainable_sharded_bytes is None for u in us):
            return self.quiet("which parameters train was not recorded (a snapshot older than its trainable bytes)")
        first = next((i for i, u in enumerate(us) if E.grad_shard_bytes(u) > 0), None)
        if first is None:
            return self.quiet("no unit holds a trainable parameter")
        lowest = unit_label(us[first].name)
        # before the first trainable unit no output needs a gradient: FSDP2 never runs those units' pre-backward
        # (a unit whose backward the records timed ran one)
        idle = {u.name: u for u in us[:first] if not u.is_root and not (u.has_timing and u.timing.bwd_ms > 0)}
        if not idle:
            # (a trainable unit whose output reaches no gradient runs none either: a Llava's unread vision layer)
            later = [u.name for u in us[first:] if not u.is_root and u.has_timing and not u.timing.bwd_ms > 0]
            return self.quiet(("every unit runs backward: " if not later else "") + "no frozen unit comes before "
                              f"{lowest}, the first trainable one in forward order"
                              + (f" ({E.fmt_list(later)}, after it, runs no backward: optim.never_updated)"
                                 if later else ""))
        found = E.frozen_prefetches(us, set(idle))
        if found is None:
            return self.quiet("a unit has several parameter groups (torch's backward prefetch per group is not modelled)")
        # (the unit whose pre-backward prefetches, the idle unit it gathers, from an explicit list)
        wasted = [(u, idle[t], explicit) for u, t, explicit in found]
        if not wasted:
            why = (f"{lowest}'s explicit list leaves them out" if us[first].backward_prefetch else
                   f"{unit_label(us[first - 1].name)}, which {lowest} prefetches by default, runs backward")
            return self.quiet(f"no backward prefetch gathers the frozen unit(s) that never run backward "
                              f"({E.fmt_list(list(idle))}): {why}")
        # the trace confirms: a backward all-gather of the unit, and no pre-backward of it
        ag = E.trace_rows(ctx, "all_gather")
        seen: dict[str, list] = {}
        for r in ag:
            if r.phase == "backward":
                seen.setdefault(r.unit, []).append(r)
        ran = {x.name for x in E.overlap(ctx).units or [] if x.timing_p50.bwd_ms > 0}
        if ag:
            missing = [t.name for _, t, _ in wasted if t.name not in seen or t.name in ran]
            wasted = [w for w in wasted if w[1].name not in missing]
            if not wasted:
                return self.quiet(f"the trace does not show it: no backward all-gather of {E.fmt_list(missing)} "
                                  "there, or one with a backward of its own")
        # each prefetching unit's list without them (empty: the unit itself, written by the snippet)
        lists = E.prefetch_lists_without(wasted, set(idle))
        step, peak, pm = E.step_ms(ctx), E.peak_bytes(ctx), E.peak_memory(ctx)
        tl = pm.timeline if pm is not None else []
        changes, rows = [], []
        gathered = comm = exposed = 0.0
        for u, t, explicit in wasted:
            tr = seen.get(t.name, [])
            ws = E.unused_gather_windows(tl, u.name, t.name) if tl else []
            changes.append((ws, -t.unsharded_bytes))
            gathered += (statistics.median(r.count_per_step for r in tr) if tr else len(ws) or 1) * t.unsharded_bytes
            comm += statistics.median(r.comm_ms_per_step for r in tr) if tr else 0.0
            exposed += statistics.median(r.exposed_ms_per_step for r in tr) if tr else 0.0
            rows.append(f"{t.name} ({fmt_bytes(t.unsharded_bytes)}), prefetched by {unit_label(u.name)}'s "
                        + ("explicit list" if explicit else "default (the previous unit in forward order)"))
        peak_after = E.timeline_peak(pm, changes) if pm is not None and all(ws for ws, _ in changes) else None
        cap = E.capacity_bytes(ctx)
        tight = bool(cap and peak and peak_after is not None and peak_after < peak
                     and E.peak_near_capacity(ctx))  # (optim.before_shard's stale tensors aside)
        share = exposed / step if (seen and step) else None
        by_time = share is not None and not _is_cpu(ctx) and share >= FROZEN_GATHER_WARN_SHARE_GPU
        sev = "warning" if tight or by_time else "info"
        names = E.fmt_list(list(dict.fromkeys(t.name for _, t, _ in wasted)))
        held = ("" if peak_after is None else "; the peak is elsewhere" if peak_after >= peak else
                f"; it is held at the peak: without it the peak is {fmt_bytes(peak_after)} "
                f"({fmt_bytes(peak - peak_after)} lower)")
        timed = (f" The trace shows it: {comm:.2f} ms of all-gather per step, {exposed:.2f} ms of it exposed "
                 f"({fmt_share(share, 1)} of the step), and no pre-backward of it." if share is not None else "")
        text = (f"{names} holds no trainable parameter and runs before every trainable one: no output of it needs "
                "a gradient, so FSDP2 never runs its backward. Yet a backward prefetch all-gathers it in every "
                f"backward: {fmt_bytes(gathered)} per step for nothing, held until the root's final callback frees it "
                f"when backward ends{held}.{timed} FSDP2's default prefetch gathers the previous unit in forward "
                "order (torch's own comment: \"may have mistargeted prefetches if not all modules used in forward are "
                "used in this backward\"). A non-empty explicit backward prefetch list turns that default off for its "
                "unit (set_modules_to_backward_prefetch([]) does not: an empty list means the default): the snippet "
                f"gives {E.fmt_list([S.module_expr(S.members(n)[0]) for n in lists])} a list without the frozen unit, the unit itself where nothing else "
                "is left, which is gathered already when its backward starts, so nothing is all-gathered. Losses are "
                "unchanged: the frozen unit's parameters are not used in backward.")
        return [self.finding(
            sev, f"{names} all-gathered in every backward for nothing ({fmt_bytes(gathered)} per step): "
                 "frozen, it never runs backward",
            {"gathered_for_nothing": rows, "first_trainable_unit": lowest,
             "frozen_units_without_backward": [unit_label(n) for n in idle],
             "allgather_bytes_per_step": int(gathered),
             "trace_allgather_ms_per_step": round(comm, 3) if seen else None,
             "trace_exposed_ms_per_step": round(exposed, 3) if seen else None,
             "exposed_share_pct": round(100 * share, 2) if share is not None else None, "step_p50_ms": step,
             "peak_bytes": peak, "peak_bytes_without": peak_after,
             "confirmed_by": ("trace: its backward all-gather, no pre-backward of it" if seen else
                              "records: trainable bytes, forward order, no backward timed")},
            text, S.backward_prefetch_lists(lists),
            predicted=E.predicted(step, step - exposed if (seen and step) else None, peak, peak_after),
            units=sorted({t.name for _, t, _ in wasted} | set(lists)))]


def _run_orders(ctx: Context) -> tuple[list[str], list[str], bool]:
    """(forward, backward, recorded): every unit with parameters, the root first, in the order the run started its
    forward and its backward (``snippets.gather_order``: recorded, else the tree's order with the backward FSDP2
    derives; the root's hooks open both passes). Units that never run backward (frozen before every trainable one)
    are not in the backward order."""
    fwd, bwd, recorded = S.gather_order(S.tree(ctx))
    rts = [u.name for u in E.roots(E.param_units(ctx))]
    return rts + fwd, rts + bwd, recorded


def _allgathers_per_step(ctx: Context) -> tuple[Optional[float], dict[tuple[str, str], float]]:
    """From the trace: all-gathers per step (the median over ranks of each rank's sum) and, per (unit label, phase),
    the median calls per step; (None, {}) without a trace."""
    per_rank: dict[str, float] = {}
    per_unit: dict[tuple[str, str], list[float]] = {}
    for r in E.trace_rows(ctx, "all_gather"):
        if r.unit == E.OTHER_UNIT or r.count_per_step is None:
            continue
        per_rank[str(r.rank)] = per_rank.get(str(r.rank), 0.0) + r.count_per_step
        per_unit.setdefault((r.unit, r.phase or ""), []).append(r.count_per_step)
    if not per_rank:
        return None, {}
    return statistics.median(per_rank.values()), {k: statistics.median(v) for k, v in per_unit.items()}


def _one_per_unit(ctx: Context, bwd: list[str]) -> float:
    """All-gathers per step with each unit gathered once per pass: once in each forward, and once in each backward
    where it runs backward resharded (reshard_after_forward not False) and FSDP2 gathers it there (not after
    set_unshard_in_backward(False)), times its forward passes per step."""
    mb = E.micro_batches(ctx)
    runs_bwd = set(bwd)
    n = 0.0
    for u in E.param_units(ctx):
        passes = mb.get(u.name, 1.0)
        n += passes * (1 + (u.name in runs_bwd and not E.kept_gathered(u) and E.gathered_in_backward(u)))
    return n


def _wrong_lists(ctx: Context):
    """The explicit prefetch lists naming a unit that ran before their own in that pass: ([(unit, "forward" |
    "backward", the targets that ran before it)], forward order, backward order, recorded), forward lists first;
    None where no unit has a list."""
    us = {u.name: u for u in E.param_units(ctx)}
    lists = [(u, kind, list(getattr(u, f"{kind}_prefetch") or [])) for kind in ("forward", "backward")
             for u in us.values()]
    lists = [x for x in lists if x[2]]
    if not lists:
        return None
    fwd, bwd, recorded = _run_orders(ctx)
    pos = {"forward": {n: i for i, n in enumerate(fwd)}, "backward": {n: i for i, n in enumerate(bwd)}}
    # a target run more often per step than the unit naming it (a module called twice in one forward) may run again
    # after it: its prefetch can be ahead of that later call, not counted
    passes = E.micro_batches(ctx)
    wrong = []
    for u, kind, got in lists:
        at = pos[kind]
        if u.name not in at:  # (a frozen unit's backward list: never read, its pre-backward never runs)
            continue
        before = [t for t in got if t in at and at[t] < at[u.name]
                  and passes.get(t, 1.0) <= passes.get(u.name, 1.0)]
        if before:
            wrong.append((u, kind, before))
    return wrong, fwd, bwd, recorded


@register
class PrefetchWrongOrder(Rule):
    code = "prefetch.wrong_order"
    name = "Explicit prefetch against the run order"
    description = ("An explicit prefetch list names a unit that ran before its own unit (in forward, or in backward): "
                   "it all-gathers that unit again after its reshard and keeps it gathered, for nothing.")
    needs = ("units",)
    severities = ("warning",)

    def match(self, ctx: Context):
        found = _wrong_lists(ctx)
        if found is None:
            return self.quiet("no unit has an explicit prefetch list")
        wrong, fwd, bwd, recorded = found
        how = "as the run recorded it" if recorded else "module order, the run recorded none"
        if not wrong:
            return self.quiet(f"every explicit prefetch list names units that run after their own unit ({how})")
        observed, by_unit = _allgathers_per_step(ctx)
        expected = _one_per_unit(ctx, bwd)
        extra = (observed - expected) if observed is not None and observed > expected else None
        passes = E.micro_batches(ctx)
        again = [f"{unit_label(n)} {ph}: {c:g} per step" for (n, ph), c in sorted(by_unit.items())
                 if c > passes.get("" if n == "(root)" else n, 1.0)]
        step, peak = E.step_ms(ctx), E.peak_bytes(ctx)
        rows = [f"{unit_label(u.name)} {kind} prefetches [{', '.join(map(unit_label, getattr(u, kind + '_prefetch')))}]"
                f": {E.fmt_list([unit_label(t) for t in before])} ran {'its' if len(before) == 1 else 'their'} {kind} "
                "before it" for u, kind, before in wrong]
        kinds = list(dict.fromkeys(k for _, k, _ in wrong))
        code = S.prefetch_code(ctx)
        if not code:  # (no chain: one unit besides the root) the lists cleared
            code = "\n".join(f"{S.module_expr(S.members(u.name)[0])}.set_modules_to_{kind}_prefetch([])"
                             for u, kind, _ in wrong)
        counted = (f" The trace counts {observed:g} all-gathers per step where one per unit and pass is {expected:g}"
                   + (f" ({E.fmt_list(again)})" if again else "") + "." if observed is not None else "")
        text = (f"{len(wrong)} explicit prefetch list(s) name a unit that ran before their own ({how}): "
                + "; ".join(rows[:4]) + ("; ..." if len(rows) > 4 else "") + ". A prefetch issued after its target "
                "has run all-gathers it again, for nothing: in forward the target was resharded after its own forward "
                "and is gathered again, then held until its backward; in backward it has finished its backward and "
                f"is gathered again until the step ends.{counted} Each list should name the unit that runs next in its "
                "pass: in forward the next unit of forward, in backward the next of backward (forward's reverse). "
                "The snippet sets both chains in the order the run ran its units and clears the lists "
                "the chain does not reach (an empty forward list prefetches nothing; an empty backward list is FSDP2's "
                "default); or drop your set_modules_to_*_prefetch calls: FSDP2's default prefetches in backward.")
        return [self.finding(
            "warning", f"Explicit {' and '.join(kinds)} prefetch names units that already ran: "
                       f"{len(wrong)} list(s) in the wrong order"
                       + (f", {extra:g} extra all-gather{'s' if extra != 1 else ''} per step" if extra else ""),
            {"wrong_lists": rows, "run_order_forward": [unit_label(n) for n in fwd],
             "run_order_backward": [unit_label(n) for n in bwd], "run_order_from": "records" if recorded else
             "module order", "allgathers_per_step": observed, "allgathers_one_per_unit": expected,
             "extra_allgathers_per_step": extra, "gathered_again": again, "step_p50_ms": step, "peak_bytes": peak},
            text, code, predicted=E.predicted(step, None, peak, None),
            units=sorted({u.name for u, _, _ in wrong} | {t for _, _, b in wrong for t in b}))]


_SYNC_WHY = ("On gloo, CPU streams and events are no-ops, so with the default synchronous unshard the all-gather runs "
             "to completion inside FSDP's pre-forward/pre-backward hook: nothing overlaps it, including the "
             "all-gathers FSDP prefetches (explicitly in forward, by default in backward). Make the unshard "
             "asynchronous on every unit (private API, torch >= 2.4): the collective then runs on gloo's threads "
             "while the host computes, and FSDP waits for it only when the unit is needed.")


@register
class SyncUnshard(Rule):
    code = "prefetch.sync_unshard"
    name = "Synchronous unshard on gloo"
    description = ("On gloo the default synchronous unshard blocks the host inside every all-gather (the unit "
                   "snapshot's setting, or a trace's all-gathers that blocked the host).")
    # (one rank per shard group: its all-gathers are local copies.) A plain trace has no unit snapshot: its blocked
    # all-gathers are the evidence, and the fix (every FSDPModule of the model) needs no unit's name
    needs = ("records|trace", "sharded")
    severities = ("warning",)

    def match(self, ctx: Context):
        if not E.param_units(ctx):
            return self._from_plain_trace(ctx)
        sync = _sync_gloo_units(ctx)
        if not sync:
            if E.backend(ctx) != "gloo":
                return self.quiet("not gloo")
            # (the root alone: "every unit unshards asynchronously" read for a synchronous root, a new-user trial)
            return self.quiet("every unit unshards asynchronously" if E.non_root(E.param_units(ctx)) else
                              "the root is the only unit: its all-gather opens the step, with nothing before it to "
                              "overlap (wrap.too_coarse weighs one unit for the whole model)")
        step = E.step_ms(ctx)
        # with a straggler, its own waits and blocking (E.late_rank: the others' hold their wait for it; the trial's
        # rank 2 of 4 late by 150 ms read "blocking per step: 193.6 ms", the most of any rank, a waiting one's)
        late, read = E.late_rank(ctx), E.read_ranks(ctx)
        blk = {r: b for r, b in E.overlap(ctx).blocking.items() if read is None or str(r) in read}
        blocking_ms = [b.us / E.steps_in_windows(ctx, r) / 1e3 for r, b in blk.items()]
        ag_rows = [r for r in E.trace_rows(ctx, "all_gather") if read is None or str(r.rank) in read]
        ag_comm = sum(r.comm_us for r in ag_rows)
        ag_exp = sum(r.exposed_us for r in ag_rows)
        ag_overlap_pct = round(100 * (1 - ag_exp / ag_comm), 1) if ag_comm > 0 else None
        bwd_waits = sum(E.ag_wait_ms(u, "backward") for u in sync if u.has_timing)
        # (unknown where a unit's forward wait is inside its compiled call, as its table's "—": the evidence read
        # "AG wait fwd: 0 µs" for blocks compiled in place, a new-user trial; both unknown where units run inside
        # another module's compiled frame, whose waits are inside their times: with model = torch.compile(model)
        # both read 0 µs beside a unit table of "—")
        framed = any(u.compiled_in_place for u in sync)
        fwd = [u.timing.ag_wait_fwd_ms for u in sync if u.has_timing]
        fwd_waits = None if None in fwd or framed else round(sum(fwd), 3)
        saved = bwd_waits * GLOO_ASYNC_BWD_SAVED
        names = [u.name for u in sync]
        # the memory: a prefetched all-gather now lands while the unit before it still computes, one more unit's
        # gathered parameters at the peak at most (a new-user trial's rank 0 rose 4.30 -> 4.49 MiB, one block's
        # 195 KiB, rank 1 not at all, where no peak was predicted)
        peak, extra = E.peak_bytes(ctx), max((u.unsharded_bytes for u in sync), default=0)
        held = (f" The peak may rise by up to one unit's gathered parameters ({fmt_bytes(extra)}): a prefetched "
                "unit arrives while the one before it still computes." if peak is not None and extra else "")
        cap = E.capacity_bytes(ctx)
        if held and cap and peak + extra > T.NEAR_CAPACITY_SHARE * cap:  # (a new-user trial's 4 MiB budget: 3.59 ->
            # 4.10 MiB predicted, said nowhere)
            held += (f" That is {fmt_share((peak + extra) / cap)} of the {fmt_bytes(cap)} capacity"
                     + (": past it, so free memory first (or keep the unshard synchronous)." if peak + extra > cap
                        else "."))
        return [self.finding(
            "warning", f"Synchronous unshard on gloo: the host blocks in every all-gather ({len(sync)} "
                       f"unit{'s' if len(sync) != 1 else ''} besides the root)",
            {"backend": "gloo", "units_sync": len(sync), "ag_wait_fwd_ms": fwd_waits,
             "ag_wait_bwd_ms": None if framed else round(bwd_waits, 3), "step_p50_ms": step,
             "blocking_ms_per_step": round(max(blocking_ms), 3) if blocking_ms else None,
             "blocking_calls": sum(b.count for b in blk.values()) if blk else None,
             "ag_overlap_pct": ag_overlap_pct, "read_on_straggler": None if late is None else int(late.rank)},
            _SYNC_WHY + held + " (The root's own all-gather opens the step, with nothing before it to overlap: it is "
            "not counted; the snippet sets every unit alike.)"
            + ("" if late is None else f" The waits are {E.read_on_straggler(late)}."),
            S.async_unshard_code(),
            predicted=E.predicted(step, step - saved if step is not None and saved > 0 else None, peak,
                                  peak + extra if peak is not None else None, peak_at_most=True),
            units=names)]

    def _from_plain_trace(self, ctx: Context):
        """A plain trace (no unit snapshot): the all-gathers the host sat in for their whole length (gloo's, with
        the synchronous unshard; trace.build) are the evidence."""
        if E.trace_device(ctx) != "cpu":
            return self.quiet("a GPU trace: its all-gathers run on their own stream" if E.trace_device(ctx) else
                              "no trace")
        blocked, calls = _blocked_allgathers(ctx)
        ag_rows = E.trace_rows(ctx, "all_gather")
        units = sorted({r.unit for r in ag_rows if r.unit != E.OTHER_UNIT})
        if not units:  # (gloo's blocking all-gathers of the loop's own code are no unshard's)
            return self.quiet("no FSDP all-gather in the trace")
        if units == [ROOT_LABEL]:  # (as from the records: a trial's whole-model unit read a warning whose fix, the
            # root's all-gather made asynchronous, has nothing to overlap it with, and predicted no gain)
            return self.quiet("the root is the only unit in the trace: its all-gather opens the step, with nothing "
                              "before it to overlap")
        if not _trace_shows_sync(ctx):
            return self.quiet(f"{_sat_in(ctx)}, under {100 * BLOCKED_AG_SHARE:.0f}% of them: the unshard is "
                              "asynchronous (the synchronous one blocks in nearly every one)")
        step = E.trace_step_ms(ctx)
        ag_comm = sum(r.comm_us for r in ag_rows)
        ag_overlap_pct = round(100 * (1 - sum(r.exposed_us for r in ag_rows) / ag_comm), 1) if ag_comm > 0 else None
        blk = E.overlap(ctx).blocking
        blocking_ms = [b.us / E.steps_in_windows(ctx, r) / 1e3 for r, b in blk.items()]
        # as from the records: async unshard and FSDP's implicit backward prefetch remove about half of the backward
        # waits (GLOO_ASYNC_BWD_SAVED); here the trace's exposed backward all-gathers, the median over ranks
        waits = E.trace_exposed_by_unit(ctx, "all_gather")
        bwd = sum(w for (u, ph), w in waits.items() if ph == "backward" and u not in ("(root)", E.OTHER_UNIT))
        fwd = sum(w for (u, ph), w in waits.items() if ph == "forward" and u not in ("(root)", E.OTHER_UNIT))
        saved = bwd * GLOO_ASYNC_BWD_SAVED
        return [self.finding(
            "warning", f"Synchronous unshard on gloo: the host blocked in {blocked} of {calls} all-gathers (trace)",
            {"backend": E.backend(ctx), "allgathers_blocking_host": blocked, "allgathers": calls,
             "blocking_ms_per_step": round(max(blocking_ms), 3) if blocking_ms else None,
             # (the root's own all-gather left out, as the records' figures do: "exposed AG fwd" beside
             # prefetch.exposed_allgather's, which counts it, read as two figures of one thing in a new-user trial)
             "trace_exposed_ag_fwd_ms_but_root": round(fwd, 3), "trace_exposed_ag_bwd_ms_but_root": round(bwd, 3),
             "step_ms": None if step is None else round(step, 3), "ag_overlap_pct": ag_overlap_pct,
             "measured_by": "trace"},
            f"The trace shows it: {_sat_in(ctx)}. " + _SYNC_WHY
            + " (The snippet sets every FSDP module of the model alike, the root included.)",
            S.async_unshard_code(),
            predicted=E.predicted(step, step - saved if step is not None and saved > 0 else None),
            units=units[:10])]


@register
class LastUnitResharded(Rule):
    code = "reshard.last_unit"
    name = "Last unit resharded after forward"
    description = "The last unit of forward is resharded only to be gathered again at once for backward."
    needs = ("units", "sharded")
    severities = ("info", "warning")

    def match(self, ctx: Context):
        last = E.resharded_last_unit(ctx)
        if last is None:
            # (which: a new-user trial's root held only the embedding and a norm that ran before its head unit, and
            # read "the root computes after it")
            rts = E.roots(E.param_units(ctx))
            # (the last that ran: a trial's never-routed last expert, moe.experts.3, read as the last in forward)
            us = [u for u in E.non_root(E.param_units(ctx)) if u.name not in S.never_ran(ctx)]
            if rts and us and not E.kept_gathered(last := E.last_in_forward(ctx, us)):
                own = [m for m in (rts[0].own_modules or []) if m]
                return self.quiet(f"the root holds parameters of its own ({E.fmt_list(own) if own else 'its modules'}),"
                                  f" which may compute after the last unit ({last.name}) in forward, before its "
                                  "backward (an output head left in the root does): the records do not say whether "
                                  "they do")
            return self.quiet("the last unit of forward is kept gathered" if us else "no unit beside the root")
        name = last.name or "(root)"
        if not E.gathered_in_backward(last):  # (its resharding frees memory and costs no all-gather)
            return self.quiet(f"{name!r}, the last unit of forward, is never all-gathered in backward "
                              "(set_unshard_in_backward(False)): resharding it after forward costs nothing")
        extra = E.calls_beyond_model(ctx, last.name)
        if extra >= 1:  # its resharding is that code's to set
            return self.quiet(
                f"{name!r} is called {extra:.0f} more times per step than the model's forward calls it: code outside "
                "the model's forward runs it and sets its resharding around those calls (torchtitan's chunked loss "
                "runs the output head once per chunk, then reshards it and sets reshard_after_forward back to True)")
        step, peak = E.step_ms(ctx), E.peak_bytes(ctx)
        wait = E.ag_wait_ms(last, "backward") if last.has_timing else None
        share = (wait / step) if (wait is not None and step) else None
        if share is not None and share < LAST_UNIT_INFO_SHARE:
            return self.quiet(E.below_share(f"the backward all-gather wait of {name!r}", wait, step, "the step",
                                            LAST_UNIT_INFO_SHARE, ms=True)
                              + ": gathered again at once, but with nothing to wait for")
        sev = "warning" if share is None or share >= LAST_UNIT_WARN_SHARE else "info"
        extra = E.gathering_after_forward_bytes(last)  # FSDP2 keeps the sharded parameters meanwhile
        code = (f"# on the sharded model {S.RESHARD_IN_CALL}\n"  # (the root's alone: its units keep theirs)
                + S.set_on_units([last.name], "set_reshard_after_forward(False"
                                 + (", recurse=False)" if last.is_root else ")")))
        lacks = S.lacks_reshard_switch(ctx.config)
        if lacks:
            code = ""
        return [self.finding(
            sev, f"Last unit {name!r} is resharded after forward and gathered again at once",
            {"unit": name, "unsharded_bytes": last.unsharded_bytes,
             "ag_wait_bwd_ms": None if wait is None else round(wait, 3),
             "step_p50_ms": step, "regather_share_pct": None if share is None else round(100 * share, 2)},
            f"{name!r} runs last in forward and first in backward: resharding it after forward frees "
            f"{fmt_bytes(extra)} only for the length of the loss computation, then backward all-gathers it "
            "again with nothing to overlap. Keep it gathered (as torchtitan does for the final norm and output "
            "head)." + (S.reshard_in_calls_words([last.name], False) if lacks else ""),
            code, predicted=E.predicted(step, step - wait if (step is not None and wait) else None, peak,
                                        E.zero2_peak(ctx, [last])),
            units=[last.name])]

