"""Low MFU's first levers, read from a GPU trace's compute kernels: attention computed eagerly (softmax kernels
between matmuls where a fused SDPA/flash kernel would run) and a step bound by launching many small kernels
(what torch.compile fuses)."""

from __future__ import annotations

from .. import estimate as E
from ...units import fmt_bytes, fmt_share
from .. import thresholds as T
from ...trace.kernels import LAUNCH_WAIT_US, SMALL_KERNEL_US
from .. import snippets as S
from ..base import Context, Rule, register

# eager attention: at least this many forward softmax kernels per step (one per layer; the loss's is a
# log-softmax and not counted), and no fused attention kernel at all
EAGER_SOFTMAX_MIN_PER_STEP = 2
# a launch-bound step: at least this share of the compute kernels is shorter than SMALL_KERNEL_US
SMALL_KERNEL_MIN_SHARE = 0.40
# ... and at least this share of them found the device waiting (started within LAUNCH_WAIT_US of their launch):
# where the host runs ahead, the device's wait for the host is elsewhere (a CPU optimizer step, a sync, the
# user's code), and fusing kernels does not shorten it. HTA's host-bound A100 trace: 79%; the H100 FSDP rows
# of traces/gpu/, their kernels queued behind loopback collectives or CPU-offload's optimizer step: 0-24%
LAUNCH_WAITED_MIN_SHARE = 0.50
# fewer units as the lever: FSDP2's own host work (its labels' time: hooks, all-gather copy-in and copy-out,
# reduce-scatter copies) takes at least this share of the profiled step. On the H200 the tiny GPT's (6 units)
# took 8.4 of its 26.3 ms (32%); one unit for the whole model measured 23.3 -> 13.8 ms, each block compiled
# 23.3 -> 29.6 ms (benchmarks/launch_levers.py)
FSDP_HOST_MIN_SHARE = 0.20


def _per_step(ctx: Context) -> dict[str, tuple[object, int]]:
    """Per GPU rank with kernel figures: (its KernelStats, steps in its windows)."""
    ov = E.overlap(ctx)
    return {r: (k, E.steps_in_windows(ctx, r)) for r, k in ov.kernels.items() if k.count}


@register
class EagerAttention(Rule):
    code = "kernels.eager_attention"
    name = "Attention computed eagerly"
    description = ("Softmax kernels run between attention matmuls and no fused attention kernel (flash, "
                   "memory-efficient, cuDNN SDPA) runs: the score matrix is written to and read from memory.")
    needs = ("gpu_trace",)
    severities = ("info", "warning")

    def match(self, ctx: Context):
        rows = _per_step(ctx)
        if not rows:
            return self.quiet("no compute kernels in the trace")
        fused = {r: k.fused_attention_count for r, (k, _) in rows.items()}
        if any(fused.values()):
            return self.quiet(f"fused attention kernels run ({int(max(fused.values()))} on one rank)")
        per_step = {r: k.softmax_count / n for r, (k, n) in rows.items()}
        if max(per_step.values()) < EAGER_SOFTMAX_MIN_PER_STEP:
            return self.quiet(f"{max(per_step.values()):.0f} attention softmax kernels per step")
        rank = max(per_step, key=per_step.get)
        k, n = rows[rank]
        softmax_ms, gemm_ms = k.softmax_us / n / 1e3, k.gemm_us / n / 1e3
        step = E.trace_step_ms(ctx)
        share = softmax_ms / step if step else None
        sev = "warning" if share is not None and share >= 0.05 else "info"
        # code only where the model can switch: a Hugging Face model's own setting (the attention module of any
        # other model is the user's code, which the trace does not show). With records the run says whether the
        # model has set_attn_implementation, whatever its layout (GPT-2's transformer.h, BERT's encoder.layer);
        # a plain trace only has its units' names: a decoder's model.layers.N
        cfg = ctx.config
        impl = cfg.attn_implementation if cfg is not None else None
        hf = impl is not None if cfg is not None else S.hf_layout(S.tree(ctx))
        asked = impl is not None and impl != "eager"  # sdpa, flash, flex asked for: the fused kernel did not run
        # what the model says it can switch to (None: not read, as from a plain trace); without sdpa (Gemma2, whose
        # attention soft-caps its scores) set_attn_implementation('sdpa') raises: flex_attention where it has it
        can = getattr(cfg, "attn_implementations", None)
        to = "" if not hf or asked else "sdpa" if can is None or "sdpa" in can else \
            "flex_attention" if "flex_attention" in can else ""
        code = S.ATTN_SWITCH.get(to, "")
        flash = "; or to flash_attention_2, where the flash-attn package is installed" \
            if can and "flash_attention_2" in can else ""
        no_sdpa = ("" if not hf or asked or to == "sdpa" else
                   "This Hugging Face model cannot run scaled_dot_product_attention (transformers marks it "
                   "unsupported, as where attention soft-caps its scores), so set_attn_implementation('sdpa') would "
                   f"raise; it supports {E.fmt_list(list(can)) if can else 'no fused implementation'}: ")
        if asked:
            advice = (f"This Hugging Face model already asks for {impl!r}, yet no fused kernel ran: its attention "
                      "fell back to the math path (output_attentions=True, a head mask, or a mask or dtype the fused "
                      "kernels do not take).")
        elif to == "flex_attention":
            advice = (f"{no_sdpa}switch it to flex_attention, which fuses attention with what the model does to its "
                      f"scores (torch.compile builds the kernel in the first steps){flash}.")
        elif no_sdpa:
            advice = (f"{no_sdpa}its attention stays eager"
                      f"{flash and ' unless you install flash-attn and switch it to flash_attention_2'}.")
        elif hf:
            advice = ("This is a Hugging Face model: switch its attention implementation (older transformers, "
                      "without set_attn_implementation: from_pretrained(..., attn_implementation='sdpa')).")
        else:
            advice = "Call it in your attention module's forward in place of the matmul-softmax-matmul."
        lever = bool(to or flash or not no_sdpa)  # a model with no fused implementation to switch to has none
        return [self.finding(
            sev, f"Eager attention: {per_step[rank]:.0f} softmax kernels per step, no fused attention kernel",
            {"softmax_kernels_per_step": round(per_step[rank], 1), "softmax_ms_per_step": round(softmax_ms, 3),
             "matmul_ms_per_step": round(gemm_ms, 3), "fused_attention_kernels": 0,
             "softmax_share_pct": None if share is None else round(100 * share, 1), "rank": int(rank)},
            "Attention runs as matmul, softmax, matmul: the full score matrix (sequence x sequence per head) is "
            "written by the first matmul, read and written by the softmax, and read by the second. "
            "torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True) dispatches to a fused "
            "kernel (flash or memory-efficient) that keeps the scores on chip: the softmax pass goes away and "
            "attention's activation memory falls from quadratic to linear in the sequence. " + advice,
            code,
            # the prediction counts only the softmax pass removed (the matmuls' own share also falls): a floor
            predicted=E.predicted(step, step - softmax_ms if step and lever else None),
            ranks=[int(rank)])]


@register
class LaunchBound(Rule):
    code = "kernels.launch_bound"
    name = "Step bound by launching small kernels"
    description = ("The device waits for the host to launch work for a quarter of the step or more, and most "
                   "kernels are shorter than a launch: fusing them (torch.compile) is the lever.")
    needs = ("gpu_trace", "verdict")
    severities = ("info", "warning")

    def match(self, ctx: Context):
        rows = _per_step(ctx)
        if not rows:
            return self.quiet("no compute kernels in the trace")
        hb = E.host_bound(ctx, ranks=rows)
        if hb is None:
            return self.quiet("no trace verdict for the GPU ranks")
        rank, share = hb
        k, n = rows[rank]
        # (a report of an older trace analysis has no launch delays: the shares decide alone)
        waited = k.launch_waited_count / k.launched_count if k.launched_count else None
        queued = "" if waited is None else (f"; {fmt_share(waited)} of its compute kernels started within "
                                            f"{LAUNCH_WAIT_US:.0f} µs of their launch")
        if share < T.BOUND_MIN_SHARE:
            return self.quiet(f"the device waits for launches {fmt_share(share)} of the step "
                              f"(< {100 * T.BOUND_MIN_SHARE:.0f}%; rank {rank}){queued}")
        small = k.small_count / k.count
        if small < SMALL_KERNEL_MIN_SHARE:
            return self.quiet(f"host-bound, but {fmt_share(small)} of the kernels are under {SMALL_KERNEL_US:.0f} µs: "
                              "not a launch-count problem")
        if waited is not None and waited < LAUNCH_WAITED_MIN_SHARE:
            return self.quiet(f"the device waits for the host {fmt_share(share)} of the step (rank {rank}), but "
                              f"only {fmt_share(waited)} of its compute kernels started within "
                              f"{LAUNCH_WAIT_US:.0f} µs of their launch: the host runs ahead and they wait in the "
                              "queue, so the host's time is spent elsewhere (an optimizer step on the CPU, a sync, "
                              "code between steps), not in launching them")
        trace_step = E.trace_step_ms(ctx)
        step = E.step_ms(ctx) or trace_step  # the records' steady step where recorded (the trace's is profiled)
        scale = step / trace_step if step and trace_step else 1.0
        host_ms = trace_step * share if trace_step else None
        pr = E.overlap(ctx).per_rank.get(rank)
        fsdp_ms = pr.fsdp_host_ms_per_step if pr is not None else None
        sev = "warning" if share >= T.SEVERE_BOUND_SHARE else "info"
        mean_us = k.busy_us / k.count
        evidence = {"kernels_per_step": round(k.count / n, 1), "small_kernel_share_pct": round(100 * small, 1),
                    "small_kernel_us": SMALL_KERNEL_US, "mean_kernel_us": round(mean_us, 2),
                    "host_bound_pct": round(100 * share, 1), "host_bound_ms_per_step": None if host_ms is None
                    else round(host_ms, 3), "rank": int(rank),
                    "launch_waited_pct": None if waited is None else round(100 * waited, 1),
                    "fsdp_host_ms_per_step": None if fsdp_ms is None else round(fsdp_ms, 3)}
        title = (f"Launch-bound: {k.count / n:.0f} kernels per step, {fmt_share(small)} shorter than "
                 f"{SMALL_KERNEL_US:.0f} µs; the device waits for launches {fmt_share(share)} of the step")
        lead = ("The device runs each kernel faster than the host can launch the next one, so it idles between "
                "them. A larger batch per step amortises the launches: the same kernels, each doing more work, "
                "so tokens per second grow while the device has time to spare.")
        one = self._one_unit(ctx, pr, trace_step, fsdp_ms, scale)
        if one is not None:
            saved, units, peak, peak_after, hidden, code = one
            evidence.update(units=units, fsdp_host_share_pct=round(100 * fsdp_ms / trace_step, 1))
            hid = (f" and the collectives' overlap with compute ({hidden:.1f} ms per step hidden today, counted "
                   "against the gain)" if hidden else "")
            cap = E.capacity_bytes(ctx)
            room = f", {fmt_bytes(peak_after)} of the device's {fmt_bytes(cap)}" if cap and peak_after else ""
            return [self.finding(
                sev, title, evidence,
                f"{lead} Here FSDP2's own host work, its hooks around each of the {units} units' forward and "
                f"backward with their all-gather copies and reduce-scatter copies, takes {fsdp_ms:.1f} ms of the "
                f"{trace_step:.1f} ms profiled step ({fmt_share(fsdp_ms / trace_step)}), whatever the batch. One "
                f"unit for the whole model runs those hooks once: the prediction removes {units - 1}/{units} of "
                f"that time. It costs the whole model gathered from forward to backward "
                f"({fmt_bytes(peak_after - peak) if peak is not None else 'the unsharded parameters'} more at the "
                f"peak{room}){hid}. Compiling each block instead keeps every unit's hooks and per-parameter work: "
                "on the H200 it measured slower on a 6-unit GPT of this kind (23.3 -> 29.6 ms), one unit faster "
                "(13.8 ms).",
                code, predicted=E.predicted(step, step - saved, peak, peak_after), ranks=[int(rank)])]
        # no step time is quoted for compiling: what it removes is the fused elementwise kernels' launches, not the
        # GEMMs', FSDP2's hooks, autograd's or the optimizer's, and each compiled region adds its own call. Measured
        # on the H200's tiny GPT (benchmarks/launch_levers.py): -12% with one FSDP unit, +27% with six; a model of
        # the trace's "small kernels gone" predicted 64% and 78% faster
        # (a trace naming no FSDP unit, a DDP run's: its code compiles the whole model, and the words say so: "each
        # FSDP block" read beside it, a new-user trial on HTA's DDP traces)
        tree = S.tree(ctx)
        fsdp = bool(tree.containers() or tree.unit_labels())  # (as compile_code decides what it compiles)
        return [self.finding(
            sev, title, evidence,
            f"{lead} torch.compile fuses chains of small elementwise kernels into a few (and "
            "mode='reduce-overhead' replays them as CUDA graphs, one launch per graph). "
            + ("Compile each FSDP block in place: the FSDP hooks and module names stay." if fsdp else
               "The trace names no FSDP unit: compile the model in place.")
            + " No gain is quoted: compiling removes the fused "
            "elementwise kernels' launches, not those of the matrix multiplies, of FSDP2's own hooks"
            + (f" ({fsdp_ms:.1f} ms of the step's host time here)" if fsdp_ms else "")
            + ", of autograd or of the optimizer, and each compiled block adds a call of its own; on the H200 it "
            "measured from 12% faster (a tiny GPT as one FSDP unit) to 27% slower (the same GPT as six units). "
            "Time a few steps with and without it.",
            S.compile_code(tree), predicted=E.predicted(step, None), ranks=[int(rank)],
            where="" if fsdp else "model")]  # (it read "after your fully_shard calls" on a DDP trace)

    @staticmethod
    def _one_unit(ctx: Context, pr, trace_step, fsdp_ms, scale):
        """(ms saved per step, units, peak, peak after, collectives hidden today in ms, code) of one unit for the
        whole model, where FSDP2's host work is FSDP_HOST_MIN_SHARE of the step or more over 3 units or more and the
        whole model gathered fits under T.NEAR_CAPACITY_SHARE of the device; None otherwise (a plain trace: no
        snapshot of the units' options to keep)."""
        us = E.param_units(ctx)
        if not us or len(us) < 3 or not trace_step or fsdp_ms is None or fsdp_ms < FSDP_HOST_MIN_SHARE * trace_step:
            return None
        if any(u.unsharded_bytes is None for u in us):
            return None
        peak, cap = E.peak_bytes(ctx), E.capacity_bytes(ctx)
        # every unit gathered from forward to backward, where one (the largest) at least was at the peak already
        peak_after = peak + sum(u.unsharded_bytes for u in us) - max(u.unsharded_bytes for u in us) \
            if peak is not None else None
        if peak_after is not None and cap and peak_after > T.NEAR_CAPACITY_SHARE * cap:
            return None
        hidden = (pr.hidden_ms_per_step or 0.0) if pr is not None else 0.0  # one unit's collectives overlap nothing
        saved = (fsdp_ms * (1 - 1 / len(us)) - hidden) * scale
        if saved <= 0:
            return None
        code = S.one_unit_plan(S.tree(ctx), note=f"one FSDP unit for the whole model ({len(us)} units -> 1)")
        return saved, len(us), peak, peak_after, hidden * scale, code
