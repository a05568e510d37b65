"""A severe verdict is never "healthy": when the step is mostly communication, host, input or idle time and no
other rule found its cause, the verdict itself is the finding, with the levers for that bound."""

from __future__ import annotations

from .. import estimate as E
from .. import thresholds as T
from .. import snippets as S
from ..base import Context, Rule, register
from ...report_sections import Breakdown
from ...units import fmt_share

def _compile(ctx: Context) -> str:
    return S.compile_code(S.tree(ctx))


# bound -> (what takes the step, the levers in the order to try them, the fix: a function of the context
# writing code from the run's module tree, or None where the lever is the user's loop or data pipeline)
_LEVERS = {
    "communication": (
        "exposed collectives",
        "hide them behind compute: explicit forward/backward prefetch, the last "
        "unit kept gathered (reshard_after_forward=False), fewer and larger units where calls are small, 16-bit "
        "all-gathers (MixedPrecisionPolicy(param_dtype=torch.bfloat16))",
        S.prefetch_code),  # (explicit prefetch over the run's units; never on gloo: the rule is quiet there)
    "model_parallel": (
        "exposed model-parallel collectives (tensor parallelism's, issued inside the model)",
        "these are the model's own collectives, not FSDP's: keep the tensor-parallel group within a node (NVLink), "
        "a smaller tensor-parallel degree with more FSDP ranks, asynchronous tensor parallelism (torch.compile "
        "with torch._inductor.config._micro_pipeline_tp = True; torchtitan: --parallelism.enable-async-tensor-parallel "
        "with --compile.enable), sequence parallelism (torchtitan's default)", None),
    "all_reduce": (
        "exposed collectives (all-reduce: no FSDP all-gather in the trace)",
        "overlap the gradient all-reduce with backward (DDP's buckets; sharding with FSDP2's fully_shard "
        "overlaps reduce-scatters by unit), fewer and larger buckets where calls are small (DDP's "
        "bucket_cap_mb), 16-bit gradients", None),
    "host": (
        "the host launching work (Python, operator dispatch)",
        "give the device more work per launch: a larger micro-batch, torch.compile on the blocks (fuses the small "
        "kernels, and CUDA graphs with mode='reduce-overhead'), no .item()/.cpu() syncs inside the step",
        _compile),
    "input": (
        "time outside the model (data loading, the user's code between steps)",
        "load data in DataLoader worker processes (num_workers) with pinned memory and prefetching "
        "(pin_memory=True, prefetch_factor, persistent_workers=True); move logging, metrics and "
        "checkpointing off the step", None),
    "idle": (
        "the device idle with work launched (waiting on a synchronisation or another rank)",
        "find what the step waits on: host syncs (.item(), .cpu(), torch.cuda.synchronize(): keep the loss on "
        "the device and read it every N steps), collectives waiting for a slower rank, blocking copies; profile "
        "one step and look at the idle gaps", None),
}


# bound -> the findings (code prefixes) whose levers address it: another rule's warning keeps the verdict from being a
# finding of its own only where it names a lever for that bound (a precision warning does not explain an idle step)
_COMM = ("comm.", "prefetch.", "reshard.", "wrap.too_fine", "wrap.too_coarse", "accum.", "optim.step_comm",
         "straggler.")
_ADDRESSED_BY = {
    "communication": _COMM, "model_parallel": _COMM,
    "all_reduce": ("comm.", "accum.", "optim.step_comm", "straggler."),
    "host": ("kernels.", "jitter.gc", "prefetch.sync_unshard", "offload.", "optim.step_comm", "optim.unfused_step"),
    "input": ("jitter.data_wait", "checkpoint.blocking", "memory.eval_autograd", "optim.step_comm", "straggler."),
    "idle": ("straggler.", "jitter.data_wait", "memory.alloc_retries", "offload.", "comm.on_compute_stream"),
}
_COMM_KINDS = ("communication", "model_parallel", "all_reduce")
# throughput.low_mfu names one lever first (its evidence's first_lever): the bound that lever addresses
_MFU_LEVER_BOUND = {"overlap": "communication", "fewer, larger units": "communication", "GC pauses": "host",
                    "host overhead": "host", "optimizer on the host": "host", "input pipeline": "input"}


def _addresses(f, kind: str) -> bool:
    """Whether finding ``f`` names a lever for a ``kind``-bound step."""
    if f.code == "throughput.low_mfu":
        lever = _MFU_LEVER_BOUND.get(str(f.evidence.get("first_lever")))
        return lever is not None and (lever == kind or (lever == "communication" and kind in _COMM_KINDS))
    return f.code.startswith(_ADDRESSED_BY.get(kind, ()))


@register
class SevereVerdict(Rule):
    code = "verdict.severe"
    name = "Step bound by communication, host, input or idle"
    description = ("The verdict gives half the step or more to exposed communication, host, input or idle time "
                   "and no other rule warned with a lever for that bound: the verdict is the finding, with its "
                   "levers.")
    needs = ("verdict",)
    severities = ("warning",)
    last = True

    def match(self, ctx: Context):
        if ctx.report.verdict is None:
            return self.quiet("no verdict")
        job = ctx.report.verdict.job
        share = (job.groups_pct.get(job.bound) or 0.0) / 100
        if job.bound not in _LEVERS:
            return self.quiet(f"the step is {job.bound}-bound")
        if share < T.SEVERE_BOUND_SHARE:
            return self.quiet(f"{job.bound} is {fmt_share(share)} of the step "
                              f"(< {100 * T.SEVERE_BOUND_SHARE:.0f}%)")
        fsdp = bool(E.trace_rows(ctx, "all_gather") or E.trace_rows(ctx, "reduce_scatter") or E.param_units(ctx))
        sh = job.shares_pct
        model = sh.get("model_comm", 0.0) > sum(sh.get(k, 0.0) for k in Breakdown.FSDP_COMM_PARTS)
        kind = job.bound if job.bound != "communication" else ("model_parallel" if model else
                                                               "communication" if fsdp else "all_reduce")
        if kind == "communication" and E.backend(ctx) == "gloo":  # (comm.*'s GPU rules stay out of gloo runs too)
            return self.quiet(f"communication-bound ({fmt_share(share)}) on gloo, whose collectives share the CPU "
                              "cores with compute: FSDP's overlap levers (prefetch, kept-gathered units) gain nothing "
                              "measurable there, so no gain is promised (prefetch.exposed_allgather and "
                              "prefetch.sync_unshard judge what gloo allows)")
        methods = [m for u in E.units(ctx) if u.is_root for m in (getattr(u, "forward_methods", None) or [])]
        if kind == "input" and "trace" not in (job.source or "") and methods:
            # (a VAE-shaped model, the whole model one unit, encode() registered, decode() not: decode's compute
            # read "input-bound (53%)" from its records, a warning of this rule; analyze/verdict.py's clause says so)
            return self.quiet(f"input-bound ({fmt_share(share)}) from the records, where the model runs through "
                              f"its registered forward method(s) ({', '.join(f'{m}()' for m in methods)}): the "
                              "work of its other methods the loop calls counts as outside the model too; a profiler "
                              "window tells them apart")
        warned = [f.code for f in ctx.earlier if f.severity in ("warning", "critical") and _addresses(f, kind)]
        if warned:
            return self.quiet(f"{job.bound}-bound ({fmt_share(share)}), and {', '.join(sorted(set(warned)))} "
                              "already name levers")
        what, levers, write = _LEVERS[kind]
        # code from the run's module tree where the lever is a setting of the model; the others are the user's
        # loop or data pipeline: the levers in words
        code = write(ctx) if write is not None and S.tree(ctx).unit_labels() else ""
        step = job.step_ms or E.trace_step_ms(ctx)
        bound_ms = step * share if step else None
        return [self.finding(
            "warning", f"{job.bound.capitalize()}-bound: {what} take {fmt_share(share)} of the step",
            {"bound": job.bound, "bound_pct": round(100 * share, 1), "step_ms": step,
             "bound_ms_per_step": None if bound_ms is None else round(bound_ms, 3),
             "groups_pct": {k: v for k, v in job.groups_pct.items() if v}, "source": job.source,
             "summary": job.summary},
            f"{(job.summary or job.bound).rstrip('.')}. No other rule pinned it on one cause, so the levers for "
            f"{'an' if job.bound[:1] in 'aeiou' else 'a'} {job.bound}-bound step, in the order to try them: "
            f"{levers}. The prediction is the bound: the step if all {fmt_share(share)} were recovered.",
            code,
            predicted=E.predicted(step, step - bound_ms if bound_ms is not None else None))]
