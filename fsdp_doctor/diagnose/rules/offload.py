"""CPU-offload rules (GPU runs only): offloading that costs more than it saves, offloading that would
make a run fit, and offloading from pageable (unpinned) host memory."""

from __future__ import annotations

from ...analyze.report import optimizer_impl
from ...report_sections import Copies
from ...units import fmt_bytes, fmt_share
from .. import estimate as E
from .. import snippets as S
from .. import thresholds as T
from ..base import Context, Rule, register

# What offloading costs the step (host<->device copies not hidden by compute, and the optimizer step run on the
# CPU) at least this share of it makes offloading costly ...
OFFLOAD_COSTLY_SHARE = 0.10
# ... when, without offloading, the peak would still stay below this share of capacity.
OFFLOAD_FITS_SHARE = T.NEAR_CAPACITY_SHARE
# Offloading is worth proposing when the peak is at least this share of capacity ...
OFFLOAD_NEEDED_SHARE = 0.95
# ... and the sharded parameters, gradients and optimizer state are at least this share of the peak.
OFFLOAD_STATE_SHARE_MIN = T.DOMINANT_CATEGORY_SHARE
# Effective host<->device bandwidth for pinned copies (PCIe gen4 x16 reaches ~20-25 GB/s; FSDP's copies
# of many shards reach less) and for pageable ones (staged through a bounce buffer, ~2.5x slower).
PINNED_GBPS = 12.0
PAGEABLE_SLOWDOWN = 2.5
# The optimizer step on the host once the state is offloaded, per parameter element of this rank: torch's default
# implementation on FSDP2's sharded DTensors, one thread (torchrun sets OMP_NUM_THREADS=1), measured on this
# project's CPU VM (benchmarks/cpu_optimizer_cost.py: AdamW 8.05, SGD with momentum 2.44). The GPU machine's host
# ran the offloaded GPT's AdamW at 8.4 (82 ms for 9.73 M elements); an optimizer not listed counts as AdamW.
CPU_OPTIMIZER_NS_PER_ELEMENT = {"AdamW": 8.0, "Adam": 8.0, "SGD": 2.4}

_NOT_GPU = "not a GPU run: offload is judged on a GPU"  # why the offload rules are quiet on a CPU run
_STATE_KEYS = ("sharded_params", "sharded_grads", "optimizer_state")


def _copies_ms(ctx: Context) -> tuple[float | None, float | None]:
    """(h2d + d2h ms per step, exposed ms per step), the worst rank."""
    best = (None, None)
    for r, c in E.overlap(ctx).copies.items():
        n = E.steps_in_windows(ctx, r)
        tot = (c.h2d_us + c.d2h_us) / n / 1e3
        exp = c.exposed_us / n / 1e3
        if best[1] is None or exp > best[1]:
            best = (tot, exp)
    return best


def _plugin_or(ctx: Context, on: bool, code: str) -> dict:
    """The fix's code and place: where accelerate's FSDP2 plugin sharded the model (the Trainer's runs too), its
    offload policy set on the plugin before it shards (code on the model's units would never run); else ``code``."""
    lever = E.plugin_lever(ctx)
    if lever is None:
        return {"code": code}
    return {"code": S.plugin_offload(lever, on), "where": lever}


@register
class OffloadCostly(Rule):
    code = "offload.costly"
    name = "CPU offload costs more than it saves"
    description = "Offload copies stall the step while the sharded state would fit on the device."
    needs = ("gpu",)
    severities = ("warning",)

    def match(self, ctx: Context):
        if not E.param_units(ctx):
            return self._from_plain_trace(ctx)
        if not E.on_gpu(ctx):
            return self.quiet(_NOT_GPU)
        off = E.offloaded_units(ctx)
        if not off:
            return self.quiet("no unit is offloaded")
        step, peak, cap = E.step_ms(ctx), E.peak_bytes(ctx), E.capacity_bytes(ctx)
        if not step:
            return self.quiet("no step time measured")
        tot, exposed = _copies_ms(ctx)
        # CPUOffloadPolicy steps the optimizer on the host, on the offloaded shards: the device waits for it
        # (the GPU rows' offloaded GPT: 82 ms of a 177 ms step, where the same model on the device steps in ~4 ms;
        # its exposed copies were 2.4 ms). Its share of the optimizer phase is the offloaded share of the state.
        opt = E.phase_ms(ctx, "optimizer") or 0.0
        every = sum(u.sharded_bytes for u in E.param_units(ctx))
        cpu_opt = opt * sum(u.sharded_bytes for u in off) / every if every else opt
        cost = (exposed or 0.0) + cpu_opt
        if cost / step < OFFLOAD_COSTLY_SHARE:
            what = "the optimizer step on the CPU" + (" and the exposed host-device copies" if exposed is not None
                                                     else " (no profiler trace: copies not measured)")
            return self.quiet(E.below_share(what, cost, step, "the step", OFFLOAD_COSTLY_SHARE, ms=True))
        bd = E.breakdown(ctx)
        host = bd.get("offloaded_host") or 0
        if not host:
            pm = E.peak_memory(ctx)
            host = pm.offloaded_host_bytes if pm else 0
        if not host:
            host = sum(u.sharded_bytes + 3 * E.grad_shard_bytes(u) for u in off)  # params; grads, 2 Adam states
        if peak is not None and cap and peak + host > OFFLOAD_FITS_SHARE * cap:  # offloading makes it fit
            return self.quiet(f"the offloaded state ({fmt_bytes(host)}) would not fit on the device: peak "
                              f"{fmt_bytes(peak + host)}, over {100 * OFFLOAD_FITS_SHARE:.0f}% of capacity "
                              f"{fmt_bytes(cap)}")
        copies = ("copies not measured (no profiler trace)" if exposed is None else
                  f"{exposed:.1f} ms of their copies not hidden by compute")
        return [self.finding(
            "warning", f"CPU offload costs {cost:.1f} ms of the step ({fmt_share(cost / step)}): the optimizer steps "
                       f"on the CPU for {cpu_opt:.1f} ms" + ("" if exposed is None else
                                                           f", copies stall {exposed:.1f} ms"),
            {"offloaded_units": len(off), "copies_ms_per_step": None if tot is None else round(tot, 3),
             "exposed_copies_ms_per_step": None if exposed is None else round(exposed, 3),
             "cpu_optimizer_ms_per_step": round(cpu_opt, 3), "offload_cost_ms_per_step": round(cost, 3),
             "offload_cost_share_pct": round(100 * cost / step, 1), "offloaded_host_bytes": host,
             "peak_bytes": peak, "capacity_bytes": cap, "step_p50_ms": step},
            f"The {len(off)} offloaded unit(s) keep their parameters, gradients and optimizer state on the host: "
            f"every step copies the parameters in and the gradients out ({copies}), and the optimizer steps on "
            f"the CPU, {cpu_opt:.1f} ms per step while the device waits. Keeping the {fmt_bytes(host)} of "
            f"offloaded state on the device still leaves the peak under {100 * OFFLOAD_FITS_SHARE:.0f}% of "
            "capacity: drop the offload policy. The prediction removes both; the optimizer step on the device "
            "that replaces the CPU's (a few ms for a foreach AdamW) is not measured in this run.",
            **_plugin_or(ctx, False, S.shard_plan(S.tree(ctx), drop=("offload_policy",),
                                                  note="no offload_policy: the state stays on the device")),
            predicted=E.predicted(step, step - cost, peak, peak + host if peak is not None else None),
            units=[u.name for u in off])]


    def _from_plain_trace(self, ctx: Context):
        """A plain Kineto GPU trace: H2D/D2H copies alone on the device (the verdict's ``offload`` part) for a
        material share of the step. Without the unit snapshot and memory there is no telling whether the
        state would fit on the device, so the finding says what to check."""

        step = E.trace_step_ms(ctx)
        exposed = E.breakdown_ms(ctx, "offload")
        if E.trace_device(ctx) != "gpu" or not step or not exposed:
            return self.quiet("not a GPU trace" if E.trace_device(ctx) != "gpu" else
                              "no host-device copy alone on the device")
        worst = max(exposed, key=exposed.get)
        ms = exposed[worst]
        if ms / step < OFFLOAD_COSTLY_SHARE:
            return self.quiet(E.below_share(f"exposed host-device copies (rank {worst})", ms, step, "the step",
                                            OFFLOAD_COSTLY_SHARE, ms=True))
        cp = E.overlap(ctx).copies.get(worst) or Copies()
        per_step = E.per_step

        return [self.finding(
            "warning", f"Host-device copies stall the step for {ms:.2f} ms ({fmt_share(ms / step)})",
            {"exposed_copies_ms_per_step": round(ms, 3), "exposed_share_pct": round(100 * ms / step, 1),
             "h2d_ms_per_step": round(per_step(ctx, worst, cp.h2d_us), 3),
             "d2h_ms_per_step": round(per_step(ctx, worst, cp.d2h_us), 3),
             "rank": int(worst), "step_ms": round(step, 3), "measured_by": "trace"},
            f"Memcpy HtoD/DtoH run with nothing else on the device for {ms:.2f} ms per step: with FSDP2's "
            "CPUOffloadPolicy these are the parameters copied in before each all-gather and the gradients "
            "copied out after each reduce-scatter. If the sharded parameters, gradients and optimizer state fit "
            "on the device (check with `fsdp-doctor` memory records, or torch.cuda.max_memory_allocated), drop "
            "the offload policy; if they do not, pin the host memory (the default) so copies can overlap.",
            S.shard_plan(S.tree(ctx), drop=("offload_policy",),
                         note="no offload_policy: the state stays on the device"),
            predicted=E.predicted(step, step - ms), ranks=[int(worst)])]


@register
class OffloadRecommended(Rule):
    code = "offload.recommended"
    name = "CPU offload would make the run fit"
    description = "The sharded state dominates a peak at capacity; offloading it to the host frees it."
    needs = ("gpu", "memory")
    severities = ("warning",)
    last = True  # (judged on the peak the fused step leaves where optim.foreach_temporaries fired: ctx.earlier)

    def match(self, ctx: Context):
        if not E.on_gpu(ctx) or E.offloaded_units(ctx):
            return self.quiet("offload is on" if E.on_gpu(ctx) else _NOT_GPU)
        peak, cap, step = E.peak_bytes(ctx), E.capacity_bytes(ctx), E.step_ms(ctx)
        if not peak or not cap:
            return self.skip(E.no_peak_or_capacity(ctx, peak, cap))
        # (the fused step's peak first: the recorded H100 row gpu_gpt_offload_needed peaked in AdamW's foreach step,
        # 37.06 MiB of its 250.50 MiB foreach's, one copy of the 37.11 MiB of sharded parameters: 97% of the budget,
        # 90% predicted with the fused step, where offloading, at twice the step, is no longer needed)
        judged, once = E.peak_with_fused_step(ctx, peak)
        if why := E.below_budget(ctx, judged, cap, OFFLOAD_NEEDED_SHARE):  # (optim.before_shard's stale tensors aside)
            return self.quiet(why + once)
        bd = E.breakdown(ctx)
        state = sum(bd.get(k) or 0 for k in _STATE_KEYS)
        if state / judged < OFFLOAD_STATE_SHARE_MIN:
            return self.quiet(E.below_share("sharded state", state, judged, "the peak", OFFLOAD_STATE_SHARE_MIN)
                              + once)
        us = E.param_units(ctx)
        shard = sum(u.sharded_bytes for u in us)
        # per step: params host->device twice (forward and backward unshard), grads device->host once
        copy_ms = (2 * shard + sum(E.grad_shard_bytes(u) for u in us)) / (PINNED_GBPS * 1e9) * 1e3
        # and the optimizer steps on the host instead of the device (the H200's offloaded GPT: 74.5 -> 173 ms a
        # step, predicted 84 ms from the copies alone)
        optim = ctx.config.optimizer if ctx.config is not None and ctx.config.optimizer else "AdamW"
        ns = CPU_OPTIMIZER_NS_PER_ELEMENT.get(optim, CPU_OPTIMIZER_NS_PER_ELEMENT["AdamW"])
        elements = E.optimizer_shard_elements(ctx, us)
        cpu_opt_ms = elements * ns / 1e6  # (torch's default there, the loop)
        # in the implementation the user's optimizer would take on the host (fused where its groups say so: the GPU
        # row gpu_gpt_offload_needed builds AdamW fused), scaled from the loop's by T.CPU_STEP_COST; and fused's
        # figure where it loops and could fuse (optim.unfused_step's lever once offloaded)
        impl, fused_ms = optimizer_impl(ctx.config, on_host=True), None
        if optim in T.FUSED_OPTIMIZERS and impl in T.CPU_STEP_COST:
            tensors = E.optimizer_tensors(ctx)
            cpu_opt_ms, fused_ms = (cpu_opt_ms * E.cpu_step_ratio(i, "for-loop", elements, tensors)
                                    for i in (impl, "fused"))
        gpu_opt_ms = E.phase_ms(ctx, "optimizer") or 0.0
        after = step + copy_ms + cpu_opt_ms - gpu_opt_ms if step is not None else None
        return [self.finding(
            "warning", f"Sharded parameters, gradients and optimizer state are {fmt_share(state / peak)} of a "
                       f"peak at {fmt_share(peak / cap)} of capacity",
            {"peak_bytes": peak, "capacity_bytes": cap, "sharded_state_bytes": state,
             "sharded_params_bytes": bd.get("sharded_params"), "sharded_grads_bytes": bd.get("sharded_grads"),
             "optimizer_state_bytes": bd.get("optimizer_state"), "copy_ms_per_step_est": round(copy_ms, 3),
             "cpu_optimizer_ms_per_step_est": round(cpu_opt_ms, 3), "optimizer_ms_per_step": round(gpu_opt_ms, 3),
             "step_p50_ms": step},
            f"The persistent sharded state ({fmt_bytes(state)}) is what fills the device. CPUOffloadPolicy keeps "
            "it on the host: parameters are copied in for each unshard, gradients out after each "
            f"reduce-scatter (about {copy_ms:.1f} ms per step), and {optim} steps on the CPU"
            + (f" ({impl})" if fused_ms is not None else "") + f", about {cpu_opt_ms:.0f} ms for this rank's "
            f"{elements / 1e6:.2f} M elements on one thread against {gpu_opt_ms:.1f} ms on the device now: the step "
            f"slows by about {copy_ms + cpu_opt_ms - gpu_opt_ms:.0f} ms"
            + (f" (build {optim} with fused=True for about {fused_ms:.0f} ms there: optim.unfused_step)"
               if fused_ms is not None and impl != "fused" else "")
            + ". Prefer more ranks or checkpointing first if they are an option.",
            **_plugin_or(ctx, True, S.shard_plan(
                S.tree(ctx), extra_kwargs=", offload_policy=CPUOffloadPolicy(pin_memory=True)")),
            predicted=E.predicted(step, after, peak, peak - state),
            units=[u.name for u in us])]


@register
class OffloadUnpinned(Rule):
    code = "offload.unpinned"
    name = "CPU offload from pageable memory"
    description = "Offloaded tensors in pageable host memory make every copy synchronous and slower."
    needs = ("gpu", "units")
    severities = ("warning",)

    def match(self, ctx: Context):
        if not E.on_gpu(ctx):
            return self.quiet(_NOT_GPU)
        off = E.offloaded_units(ctx)
        bad = [u for u in off if u.offload_pin_memory is False]
        if not bad:
            return self.quiet("no unit offloads to pageable memory" if off else "no unit is offloaded")
        step = E.step_ms(ctx)
        tot, exposed = _copies_ms(ctx)
        saved = (tot or 0) * (1 - 1 / PAGEABLE_SLOWDOWN)
        return [self.finding(
            "warning", f"{len(bad)} offloaded unit(s) use pageable host memory",
            {"units": [u.name or "(root)" for u in bad], "copies_ms_per_step": None if tot is None else round(tot, 3),
             "exposed_copies_ms_per_step": None if exposed is None else round(exposed, 3), "step_p50_ms": step},
            "With CPUOffloadPolicy(pin_memory=False) the host copies of parameters and gradients are pageable: "
            "each transfer is staged through a driver buffer, cannot overlap with compute and runs at a "
            "fraction of the bandwidth. Pin them (the default).",
            **_plugin_or(ctx, True, S.shard_plan(
                S.tree(ctx), extra_kwargs=", offload_policy=CPUOffloadPolicy(pin_memory=True)")),
            predicted=E.predicted(step, step - saved if (step is not None and saved > 0) else None),
            units=[u.name for u in bad])]
