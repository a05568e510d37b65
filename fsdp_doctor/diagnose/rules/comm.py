"""Communication rules decided from a plain Kineto trace (no records needed): exposed reduce-scatters,
communication-bound steps with the achieved bus bandwidth per collective size, many small latency-bound
collectives (too-fine wrapping), NCCL kernels queued on the compute stream, and a straggler rank across the
files of one job.

Evidence comes from the trace section (``report.overlap``): units and phases from FSDP2's
``record_function`` labels, bytes and group size from the NCCL kernels' args, the step's exclusive split from
``breakdown`` and the verdict. A rule whose evidence is missing stays quiet; ``why_quiet`` says why.
"""

from __future__ import annotations

import statistics
from typing import NamedTuple, Optional

from .. import estimate as E
from .. import snippets as S
from ...report_sections import Breakdown
from ...trace.build import MODEL_PHASE
from ...units import ROOT_LABEL, fmt_bytes, fmt_share
from ..base import Context, Rule, register
from ..estimate import GLOO_QUIET, breakdown_ms, per_step, trace_device, trace_step_ms, trace_verdicts  # noqa: F401
from ..thresholds import BOUND_MIN_SHARE, SMALL_MAX_MEDIAN_BYTES

# Exposed reduce-scatter worth acting on, as a share of the step (GPU: it could hide behind backward compute).
EXPOSED_RS_WARN_SHARE = 0.10
EXPOSED_RS_INFO_SHARE = 0.05
# A step is communication-bound when exposed communication is the largest group of the verdict and at least
# this share of the step.
COMM_BOUND_MIN_SHARE = BOUND_MIN_SHARE
# Message-size buckets (bytes) for the bandwidth table: NCCL's latency regime ends around 1 MiB on NVLink and
# IB (nccl-tests: bus bandwidth reaches half its peak between 1 and 8 MiB).
SIZE_BUCKETS = ((1 << 20, "< 1 MiB"), (16 << 20, "1-16 MiB"), (128 << 20, "16-128 MiB"), (float("inf"), ">= 128 MiB"))
# Too-fine wrapping: at least this many all-gathers per step ...
SMALL_MIN_CALLS_PER_STEP = 24
# ... whose median message is below this size (latency-bound on any fabric) ...
# ... with exposed communication at least this share of the step.
SMALL_MIN_EXPOSED_SHARE = 0.10
# Grouping this many units into one keeps the per-call latency of one call in k.
# A collective moving 32-bit floats moves half the bytes in bf16; on the bandwidth-bound (large-message)
# side its time halves with them. The gain is stated only for exposed time of 32-bit collectives.
FP32_NAMES = frozenset({"float", "float32", "fp32"})
HALF_BYTES_SAVING = 0.5


def fp32_exposed_ms(rows: list[E.TraceRow]) -> float:
    """Exposed ms per step of the rows whose NCCL dtype is 32-bit float (median over ranks)."""
    by_rank: dict[int, float] = {}
    for r in rows:
        if (r.dtype or "").lower() in FP32_NAMES:
            by_rank[r.rank] = by_rank.get(r.rank, 0.0) + r.exposed_ms_per_step
    return statistics.median(by_rank.values()) if by_rank else 0.0
# Collectives holding the compute stream: a note from this share of the step, a warning from the second (a scalar
# all-reduce of the loss takes microseconds: not a finding).
ON_COMPUTE_STREAM_INFO_SHARE = 0.02
ON_COMPUTE_STREAM_WARN_SHARE = 0.10


def _bucket(nbytes: float) -> str:
    for lim, name in SIZE_BUCKETS:
        if nbytes < lim:
            return name
    return SIZE_BUCKETS[-1][1]


class TraceRule(Rule):
    """A rule over a GPU trace's collectives."""

    def gpu_calls(self, ctx: Context, collective: str, label: str):
        """(rows, step ms) of ``collective`` in a GPU trace, or None after saying why the rule stays quiet."""
        rows, step = E.trace_rows(ctx, collective), trace_step_ms(ctx)
        why = (GLOO_QUIET if trace_device(ctx) != "gpu" else f"no {label} in the trace" if not rows
               else "no step time" if not step else "")
        if why:
            self.quiet(why)
            return None
        return rows, step


def reshard_snippet(ctx: Context, kwargs: str = "", prelude: tuple[str, ...] = (), mp_line=None) -> str:
    """The run's sharding (diagnose/snippets.py: every block of every container, the other units as the run
    had them, the root last) with ``kwargs`` added to every fully_shard call."""
    return "\n".join(list(prelude) + [S.shard_plan(S.tree(ctx), extra_kwargs=kwargs, mp_line=mp_line)])


def _mp_snippet(ctx: Context, prelude: tuple[str, ...] = ()) -> str:
    """16-bit parameters (all-gathers and compute) for every unit; gradients still reduced in float32, as
    numerics.reduce_dtype asks: the all-gathers' bytes halve, the reduce-scatters' stay."""
    return reshard_snippet(ctx, f", mp_policy={S.MP}", prelude,
                           S.policy_line(S.MP, "bfloat16"))


_ONE_UNIT_RS = ("The whole model is one unit: its reduce-scatter of every gradient starts when the whole backward "
                "has run, with no compute left to hide it. With each repeated block a unit of its own "
                "(wrap.too_coarse), each block's reduce-scatter runs while the blocks before it compute their "
                "backward, and only the first unit's is left exposed")


@register
class ExposedReduceScatter(TraceRule):
    code = "comm.exposed_reducescatter"
    name = "Reduce-scatters on the critical path"
    description = "Gradient reduce-scatters that no backward compute hides, mostly those of the last units."
    needs = ("gpu_trace",)
    severities = ("info", "warning")

    def match(self, ctx: Context):
        got = self.gpu_calls(ctx, "reduce_scatter", "reduce-scatter")
        if got is None:
            return []
        rows, step = got
        by_unit: dict[str, list[float]] = {}
        for r in rows:
            by_unit.setdefault(r.unit, []).append(r.exposed_ms_per_step)
        exposed = {u: statistics.median(v) for u, v in by_unit.items()}
        total = sum(exposed.values())
        share = total / step
        if share < EXPOSED_RS_INFO_SHARE:
            return self.quiet(E.below_share("exposed reduce-scatters", total, step, "the step", EXPOSED_RS_INFO_SHARE,
                                            ms=True))
        worst = sorted(exposed.items(), key=lambda kv: -kv[1])
        bw = [r.busbw_gbps for r in rows if r.busbw_gbps]
        sizes = [r.bytes_per_call for r in rows if r.bytes_per_call]
        fp32_ms = fp32_exposed_ms(rows)
        # the whole model one unit: "keep the first unit small" read for the H100 GPT's whole-model trace
        one_unit = {r.unit for r in E.trace_rows(ctx) if r.unit != E.OTHER_UNIT} == {ROOT_LABEL}
        # (the 16-bit lever only where float32 reduce-scatters are exposed: on a bf16 run it read "would halve the
        # bytes of the float32 ones (the expected gain below)" with none below, a new-user trial on the H100 fixture)
        sixteen = (" A 16-bit reduce dtype would halve the bytes of the float32 ones (the expected gain below) at the "
                   "cost of precision in the sum over ranks (numerics.reduce_dtype): a trade-off for you to make, so "
                   "no code is offered for it." if fp32_ms else
                   " They reduce in 16 bits already (numerics.reduce_dtype weighs that choice).")
        return [self.finding(
            "warning" if share >= EXPOSED_RS_WARN_SHARE else "info",
            f"Reduce-scatters stall the step for {total:.2f} ms ({fmt_share(share)})",
            {"exposed_rs_ms_per_step": round(total, 3), "exposed_share_pct": round(100 * share, 1),
             "step_ms": round(step, 3), "worst_units": [f"{u or '(root)'}: {ms:.3f} ms" for u, ms in worst[:6]],
             "rs_bytes_per_call_median": statistics.median(sizes) if sizes else None,
             "rs_busbw_gbps_median": round(statistics.median(bw), 1) if bw else None,
             "rs_dtype": rows[0].dtype, "measured_by": "trace"},
            (_ONE_UNIT_RS if one_unit else
             "These gradient reduce-scatters run while no compute is left to hide them: the units that finish "
             "backward last (the first in forward: embeddings, the first blocks) reduce with nothing after them "
             "but the optimizer. Keep the first unit small (its reduce-scatter is always exposed)")
            + "; with gradient accumulation, reduce-scatter on the last micro-batch only "
            "(accum.sync_every_micro_batch)."
            + sixteen,
            predicted=E.predicted(step, step - HALF_BYTES_SAVING * fp32_ms if fp32_ms else None),
            units=[u for u, _ in worst[:6]])]


class SizeRow(NamedTuple):
    """One collective's calls of one size bucket, per step."""

    collective: str
    size: str  # the bucket's name (SIZE_BUCKETS)
    calls_per_step: float
    median_bytes: float
    busbw_gbps: Optional[float]  # achieved bus bandwidth (median over the calls' groups)
    algbw_gbps: Optional[float]  # bytes moved / time
    exposed_ms_per_step: float


def _size_table(rows: list[E.TraceRow]) -> list[SizeRow]:
    """Per collective and size bucket: calls per step, median message, achieved bus bandwidth, exposed."""
    groups: dict[tuple[str, str], list[E.TraceRow]] = {}
    for r in rows:
        if r.bytes_per_call:
            groups.setdefault((r.collective, _bucket(r.bytes_per_call)), []).append(r)
    out = []
    for (coll, bucket), rs in sorted(groups.items()):
        comm_us = sum(r.comm_us for r in rs)
        moved = sum(r.bytes_per_call * r.count for r in rs)
        bw = [r.busbw_gbps for r in rs if r.busbw_gbps]
        out.append(SizeRow(collective=coll, size=bucket, calls_per_step=round(sum(r.count_per_step for r in rs), 1),
                           median_bytes=statistics.median(r.bytes_per_call for r in rs),
                           busbw_gbps=round(statistics.median(bw), 1) if bw else None,
                           algbw_gbps=round(moved / comm_us / 1e3, 1) if comm_us > 0 else None,
                           exposed_ms_per_step=round(sum(r.exposed_ms_per_step for r in rs), 3)))
    return out


@register
class CommunicationBound(TraceRule):
    code = "comm.bound"
    name = "Communication-bound step"
    description = "Exposed communication is the largest share of the step; bandwidth per collective size says why."
    needs = ("verdict", "gpu_trace")
    severities = ("warning",)

    def match(self, ctx: Context):
        if ctx.report.verdict is None:
            return self.quiet("no verdict")
        job = ctx.report.verdict.job
        if trace_device(ctx) != "gpu":
            return self.quiet(GLOO_QUIET)
        # with a straggler the other ranks' collectives wait for it to arrive: its lateness (E.late_rank), which
        # fewer bytes would not shorten; the straggler's own step says what its collectives cost (one rank 5 ms late
        # of 4 read "communication-bound, 61% of the step" and advised 16-bit all-gathers)
        late = E.late_rank(ctx)
        only, on_late = None, ""  # (the rank whose collectives are read, where one is)
        if late is not None and late.rank in ctx.report.verdict.per_rank:
            only, job = late.rank, ctx.report.verdict.per_rank[late.rank]
            on_late = ", " + E.read_on_straggler(late)
        share = job.groups_pct["communication"] / 100
        if job.bound != "communication" or share < COMM_BOUND_MIN_SHARE:
            return self.quiet(f"the step is {job.bound}-bound{on_late}; communication {fmt_share(share)} of it (fires "
                              f"when communication-bound at {100 * COMM_BOUND_MIN_SHARE:.0f}% or more)")
        fsdp_pct = sum(job.shares_pct.get(k, 0.0) for k in Breakdown.FSDP_COMM_PARTS)
        model_pct = job.shares_pct.get("model_comm", 0.0)
        if model_pct >= fsdp_pct:
            return self.quiet(f"communication-bound mostly by the model's own collectives (model-parallel "
                              f"{fmt_share(model_pct / 100)} of the step, FSDP's {fmt_share(fsdp_pct / 100)}), "
                              "which FSDP's levers do not reach (verdict.severe names theirs)")
        rows = [r for r in E.trace_rows(ctx) if r.phase != MODEL_PHASE and only in (None, str(r.rank))]
        table = _size_table(rows)
        step = trace_step_ms(ctx)
        small = [t for t in table if t.size == SIZE_BUCKETS[0][1]]
        small_exp = sum(t.exposed_ms_per_step for t in small)
        all_exp = sum(t.exposed_ms_per_step for t in table) or None
        latency_bound = bool(all_exp and small_exp / all_exp >= 0.5)
        plan = E.grouped_plan(ctx) if latency_bound else None
        # the 16-bit parameters halve the float32 all-gathers; the reduce-scatters stay in float32
        fp32 = 0.0 if latency_bound else fp32_exposed_ms([r for r in rows if r.collective == "all_gather"])
        if plan is not None and plan.units_after < plan.units_before:
            text = ("Most exposed communication is in small messages (< 1 MiB), where NCCL is latency-bound and "
                    "reaches a fraction of the link's bandwidth: fewer, larger collectives (larger FSDP units) "
                    f"move the same bytes in less time: {plan.units_after} units instead of {plan.units_before} "
                    f"({plan.why}).")
            code = plan.code
        elif latency_bound:  # no plan of fewer units: no repeated blocks, or too few to group and still overlap
            text = ("Most exposed communication is in small messages (< 1 MiB), where NCCL is latency-bound; "
                    + (f"no plan groups the blocks into fewer units ({plan.why})" if plan is not None else
                       "the model shows no repeated blocks to group into fewer units")
                    + ". Give each call more compute instead: a larger micro-batch per rank.")
            code = ""
        elif fp32 > 0:
            text = ("The collectives move large messages at the bandwidth they reach, so the step waits on bytes: "
                    "send fewer (16-bit parameters: all-gathers of half the bytes, gradients still reduced in "
                    "float32; HSDP, which all-gathers within a node and reduces across nodes), or give each byte "
                    "more compute (a larger micro-batch per rank).")
            hsdp = (getattr(ctx.config, "fsdp_dims", 0) or 0) >= 2  # (the run's FSDP mesh is HSDP's already)
            code = _mp_snippet(ctx, () if hsdp else ("# HSDP instead of the 1-D mesh: mesh = init_device_mesh(\n"
                                                     "#     'cuda', (nodes, gpus_per_node), mesh_dim_names="
                                                     "('replicate', 'shard'))",))
        else:
            # no float32 all-gather exposed: the 16-bit lever is spent (the run's own policy would be pasted back,
            # changing nothing); the levers left need the cluster's shape or the user's batch: words, no code
            text = ("The collectives move large messages at the bandwidth they reach, so the step waits on bytes. "
                    "The all-gathers already move 16-bit parameters; what is left is to send fewer bytes across "
                    "the slow link (HSDP: all-gathers within a node, reductions across nodes) or to give each byte "
                    "more compute (a larger micro-batch per rank).")
            code = ""
        sh = job.shares_pct
        return [self.finding(
            "warning", f"Communication-bound: exposed collectives take {fmt_share(share)} of the step",
            {"exposed_comm_share_pct": round(100 * share, 1), "allgather_fwd_pct": sh["allgather_fwd"],
             "allgather_bwd_pct": sh["allgather_bwd"], "reducescatter_pct": sh["reducescatter"],
             "other_comm_pct": sh["other_comm"], "compute_pct": job.groups_pct["compute"],
             "step_ms": None if step is None else round(step, 3), "latency_bound": latency_bound,
             "by_size": [f"{t.collective} {t.size}: {t.calls_per_step}/step, median "
                         f"{fmt_bytes(t.median_bytes, 1)}, busbw {t.busbw_gbps} GB/s, exposed "
                         f"{t.exposed_ms_per_step:.3f} ms" for t in table]},
            text, code, predicted=E.predicted(step, step - HALF_BYTES_SAVING * fp32 if (step and fp32) else None))]


@register
class SmallCollectives(TraceRule):
    code = "comm.small_collectives"
    name = "Many small, latency-bound collectives"
    description = "Too-fine wrapping seen in the trace: many all-gathers of small messages per step."
    needs = ("gpu_trace",)
    severities = ("warning",)

    def match(self, ctx: Context):
        got = self.gpu_calls(ctx, "all_gather", "all-gather")
        if got is None:
            return []
        rows, step = got
        sized = [r for r in rows if r.bytes_per_call]
        if not sized:
            return self.quiet("the trace has no message sizes (NCCL args 'In msg nelems' / 'dtype')")
        ranks = {r.rank for r in rows}
        calls = max(sum(r.count_per_step for r in rows if r.rank == k) for k in ranks)
        median_bytes = statistics.median(r.bytes_per_call for r in sized)
        exposed = {k: sum(r.exposed_ms_per_step for r in E.trace_rows(ctx) if r.rank == k) for k in ranks}
        exp = statistics.median(exposed.values())
        if calls < SMALL_MIN_CALLS_PER_STEP or median_bytes >= SMALL_MAX_MEDIAN_BYTES:
            return self.quiet(f"{calls} all-gathers per step of median {fmt_bytes(median_bytes)} (fires from "
                              f"{SMALL_MIN_CALLS_PER_STEP} calls under {fmt_bytes(SMALL_MAX_MEDIAN_BYTES)})")
        if exp / step < SMALL_MIN_EXPOSED_SHARE:
            return self.quiet(E.below_share("exposed communication", exp, step, "the step", SMALL_MIN_EXPOSED_SHARE,
                                            ms=True))
        units = sorted({r.unit for r in rows})
        # per-call time of the smallest messages bounds the latency a merged call still pays once
        per_call_ms = statistics.median(r.comm_ms_per_step / r.count_per_step for r in rows if r.count_per_step)
        bw = [r.busbw_gbps for r in sized if r.busbw_gbps]
        plan = E.grouped_plan(ctx)
        merged = plan is not None and plan.units_after < plan.units_before
        saved = latency_saved_ms(ctx, plan.units_after / plan.units_before) if merged else 0.0
        base = E.step_ms(ctx) or step  # the records' step p50 where there are records (the trace's is profiled)
        plan_ev = ({"plan_blocks_per_unit": plan.group, "plan_units": f"{plan.units_before} -> {plan.units_after}",
                    "plan_group_set_by": plan.why} if plan is not None else {"plan_blocks_per_unit": None})
        return [self.finding(
            "warning", f"{calls:.0f} all-gathers per step of {fmt_bytes(median_bytes, 1)} each: latency-bound",
            {"allgathers_per_step": round(calls, 1), "units": len(units), "median_bytes_per_call": median_bytes,
             "median_ms_per_call": round(per_call_ms, 4),
             "busbw_gbps_median": round(statistics.median(bw), 2) if bw else None,
             "exposed_comm_ms_per_step": round(exp, 3), "exposed_share_pct": round(100 * exp / step, 1),
             "step_ms": round(step, 3), "measured_by": "trace", **plan_ev,
             "expected_gain_ms": round(saved, 3)},
            f"The model is wrapped into {len(units)} units whose all-gathers move {fmt_bytes(median_bytes, 1)} "
            "each: every call pays a fixed cost (NCCL's latency, the ranks meeting) that its few bytes cannot "
            "amortise, and each unit's compute is too short to hide the next call. Wrap coarser (this is "
            "wrap.too_fine, seen from the trace)"
            + (f": {plan.units_after} units instead of {plan.units_before} ({E.plan_words(plan.group)}; "
               f"{plan.why}). Each collective removed saves what a call of it exposes in the trace (its median): "
               f"~{saved:.1f} ms per step." if merged else
               f"; but no plan groups these blocks further ({plan.why})." if plan is not None else
               ": no repeated blocks seen to group."),
            plan.code if merged else "",
            predicted=E.predicted(base, base - saved if merged and base else None), units=units[:10])]


def latency_saved_ms(ctx: Context, keep: float) -> float:
    """ms per step that merging units into ``keep`` as many saves: on each rank, each collective and phase (forward
    and backward all-gathers, reduce-scatters) loses that share of its calls, each of which exposed what its median
    call exposes (latency-bound calls: a call's time is its fixed cost, the bytes moved the same after merging), at
    most the rank's exposed communication; the median over ranks. (The 2-rank H100 GPT with every Linear a unit,
    28 units -> 8 per block, two recordings: 116.0 and 133.7 ms predicted, 126.4 ms measured on the rerun, 209.8 ->
    83.5 ms. The smallest messages' calls alone read 132.1 and 171.5: on two ranks sharing a GPU which rank waits
    out a call alternates, not with its size.)"""
    rows = [r for r in E.trace_rows(ctx) if r.unit != E.OTHER_UNIT and r.count_per_step]
    per_rank = E.overlap(ctx).per_rank
    out = []
    for rank in sorted({r.rank for r in rows}):
        mine = [r for r in rows if r.rank == rank]
        saved = 0.0
        for key in {(r.collective, r.phase) for r in mine}:
            rs = [r for r in mine if (r.collective, r.phase) == key]
            per_call = statistics.median(r.exposed_ms_per_step / r.count_per_step for r in rs)
            saved += sum(r.count_per_step for r in rs) * (1 - keep) * per_call
        pr = per_rank.get(str(rank))
        union = pr.exposed_ms_per_step if pr is not None and pr.exposed_ms_per_step is not None else None
        out.append(min(saved, union if union is not None else sum(r.exposed_ms_per_step for r in mine)))
    return statistics.median(out) if out else 0.0


@register
class NcclOnComputeStream(TraceRule):
    code = "comm.on_compute_stream"
    name = "Collectives on the compute stream"
    description = ("Collective kernels queued on the compute stream hold it for a material share of the step: compute "
                   "behind them waits, the other ranks' arrival included.")
    needs = ("gpu_trace",)
    severities = ("info", "warning")

    def match(self, ctx: Context):
        per_rank = E.overlap(ctx).per_rank
        if trace_device(ctx) != "gpu":
            return self.quiet("needs a GPU trace")
        bad = {r: pr for r, pr in per_rank.items() if pr.comm_calls_on_compute_stream}
        if not bad:
            return self.quiet("every collective runs on a stream of its own")
        # the time they hold the compute stream, per step (a report without the figure: every call counts)
        ms = {r: pr.comm_ms_on_compute_stream_per_step for r, pr in bad.items()}
        steps = {r: pr.step_ms or trace_step_ms(ctx) for r, pr in bad.items()}
        share = {r: (ms[r] / steps[r] if ms[r] is not None and steps[r] else 1.0) for r in bad}
        worst = max(share, key=share.get)
        calls = {r: f"{pr.comm_calls_on_compute_stream} of {pr.comm_calls}" for r, pr in sorted(bad.items())}
        held = (f"{ms[worst]:.3f} ms of the {steps[worst]:.2f} ms step "
                f"({fmt_share(share[worst], 1, ON_COMPUTE_STREAM_INFO_SHARE)}, rank {worst})"
                if ms[worst] is not None and steps[worst] else f"rank {worst}")
        if share[worst] < ON_COMPUTE_STREAM_INFO_SHARE:
            return self.quiet(f"{calls[worst]} collectives on rank {worst} run on the compute stream, holding it "
                              f"{held} (fires from {100 * ON_COMPUTE_STREAM_INFO_SHARE:.0f}%): since torch 2.8 a "
                              "synchronous torch.distributed call (async_op=False) is launched on the current stream "
                              "by design")
        sev = "warning" if share[worst] >= ON_COMPUTE_STREAM_WARN_SHARE else "info"
        return [self.finding(
            sev, f"Collectives hold the compute stream {fmt_share(share[worst])} of the step",
            {"ranks": sorted(int(r) for r in bad), "calls_on_compute_stream": calls,
             "on_compute_stream_ms_per_step": {r: None if v is None else round(v, 3) for r, v in sorted(ms.items())},
             "share_of_step_pct": round(100 * share[worst], 1),
             "collectives": sorted({r.collective for r in E.trace_rows(ctx)}), "step_ms": steps[worst]},
            f"Collective kernels ran on the stream that runs the model's kernels, {held}: compute queued behind "
            "them waits for them, and for the other ranks to reach them. FSDP2 issues its all-gathers and "
            "reduce-scatters on streams of its own; on the compute stream are collectives your code issues "
            "synchronously (a loss or metric all-reduce, a token count, a custom sync: since torch 2.8, "
            "async_op=False launches them on the current stream, as code that waits for them at once would have "
            "waited anyway). Issue them with async_op=True and call .wait() on the work only where the result is "
            f"read (the next logging point), or reduce less often: at most {ms[worst] or 0:.2f} ms per step to "
            f"gain, less what the read still waits for. {S.NO_LOOP_CODE}",
            "", predicted=E.predicted(steps[worst], None), ranks=sorted(int(r) for r in bad))]


@register
class TraceStraggler(TraceRule):
    code = "straggler.trace"
    name = "Straggler rank (from the trace)"
    description = "One rank's own work per step is longer; the others wait for it inside their collectives."
    needs = ("trace", "multi_rank")
    severities = ("warning",)

    def match(self, ctx: Context):
        found, why = E.trace_straggler(ctx)
        if found is None:
            return self.quiet(why)
        tr = trace_verdicts(ctx)
        worst, excess, own, waits = found.rank, found.excess_ms, found.own_ms, found.waits_ms
        x = tr[worst]

        def group_ms(r, g):
            return tr[r].step_ms * tr[r].groups_pct[g] / 100

        # where the extra time is: the group that grew most against the other ranks' median
        top = max(("compute", "host", "input", "offload", "idle"),
                  key=lambda g: group_ms(worst, g) - statistics.median(group_ms(r, g) for r in tr if r != worst))
        return [self.finding(
            "warning", f"Rank {worst} is a straggler: +{excess:.2f} ms of its own work per step",
            {"rank": int(worst), "own_ms_per_step": round(own[worst], 3),
             "others_own_ms_median": round(found.others_own_ms, 3),
             "others_wait_ms_median": round(found.others_wait_ms, 3),
             "rank_wait_ms": round(waits[worst], 3), "rank_bound": x.bound, "rank_largest_part": top,
             "own_ms_by_rank": {r: round(ms, 3) for r, ms in sorted(own.items(), key=lambda kv: int(kv[0]))}},
            f"Rank {worst} spends {excess:.2f} ms more per step on its own work (mostly {top}) than the median "
            "rank, and the other ranks wait that long in their collectives. Look at what differs on that rank: "
            "its data (longer sequences, a slower loader), its host (CPU contention, throttling), or its GPU "
            "(clocks, a different model).",
            "", predicted=E.predicted(x.step_ms, x.step_ms - excess), ranks=[int(worst)])]
