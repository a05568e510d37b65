"""Numerics: gradients reduced in a narrower dtype than the parameters they update."""

from __future__ import annotations

from .. import estimate as E
from .. import snippets as S
from ...units import fmt_bytes
from ..base import Context, Rule, register

# bytes per element, the order "narrower than" reads
_WIDTH = E.DTYPE_WIDTH


def _reduced_in(u: E.Unit) -> str | None:
    """The dtype FSDP2 reduce-scatters the unit's gradients in: ``reduce_dtype``, else ``param_dtype`` (the
    gradients' own dtype), else the parameters'."""
    return u.reduce_dtype or u.param_dtype or (u.orig_dtypes[0] if len(u.orig_dtypes) == 1 else None)


@register
class NarrowReduceDtype(Rule):
    code = "numerics.reduce_dtype"
    name = "Gradients reduced in a narrower dtype"
    description = ("Gradients are reduce-scattered in a 16-bit dtype while the parameters (and the optimizer's "
                   "update) are 32-bit: the sum over ranks loses precision.")
    needs = ("units",)
    severities = ("warning",)

    def match(self, ctx: Context):
        narrow = []
        for u in E.param_units(ctx):
            red = _reduced_in(u)
            widest = max((_WIDTH.get(d, 0) for d in u.orig_dtypes), default=0)
            if red in _WIDTH and widest and _WIDTH[red] < widest:
                narrow.append((u, red))
        if not narrow:
            return self.quiet("every unit reduces gradients in its parameters' dtype (or wider)")
        us = [u for u, _ in narrow]
        reds = sorted({r for _, r in narrow})
        params = sorted({d for u in us for d in u.orig_dtypes})
        explicit = any(u.reduce_dtype for u in us)
        grads = sum(E.grad_shard_bytes(u) for u in us)  # the gradients' shards: their dtype is the parameters'
        world = ctx.config.world_size if ctx.config is not None else None
        labels = {E.trace_label(ctx, u.name) for u in us}
        rows = [r for r in E.trace_rows(ctx, "reduce_scatter") if r.unit in labels]
        rs_ms = sum(r.comm_ms_per_step for r in rows) / max(1, len({r.rank for r in rows})) if rows else None
        step, peak = E.step_ms(ctx), E.peak_bytes(ctx)
        # (torch 2.6's MixedPrecisionPolicy stores a reduce_dtype equal to param_dtype as None: a new-user trial's
        # reduce_dtype=torch.bfloat16 read "no reduce_dtype")
        how = ("reduce_dtype=" + "/".join(reds)) if explicit else (f"param_dtype={'/'.join(reds)} and reduce_dtype "
                                                                  "unset or the same: FSDP2 then reduces in param_dtype")
        named = E.fmt_list([u.name for u in us], 4)
        text = (f"{len(us)} unit(s) ({named}) hold {'/'.join(params)} parameters but reduce their gradients in "
                f"{'/'.join(reds)} ({how}). Summing {world or 'several'} ranks' gradients in a 16-bit dtype rounds "
                "each partial sum to 8 (bf16) or 11 (fp16) bits of mantissa: small gradients vanish against large "
                "ones and the loss can drift from a full-precision run. Keep the 16-bit all-gather and compute, and "
                "reduce in float32: it doubles the reduce-scatter's bytes")
        if rs_ms is not None:
            text += (f" (the step slows by at most its time again, {rs_ms:.1f} ms, where none of it hides behind the "
                     "backward; far less where that time is mostly waiting for the other ranks, as on gloo)")
        width = _WIDTH.get(us[0].param_dtype or "", 0)
        peak_after = _peak_reducing_in_fp32(E.peak_memory(ctx), us, width) or peak
        kept = (" (and keeps the 16-bit compute's unsharded gradients it accumulates between synced micro-batches in "
                "float32)" if 0 < width < 4 else "")
        text += (f", and FSDP2 copies each unit's gradients into a float32 reduce-scatter input{kept}: about "
                 f"{fmt_bytes(peak_after - peak)} more at the peak ({fmt_bytes(peak_after)})."
                 if peak and peak_after > peak else ", nothing else.")
        lever = E.plugin_lever(ctx)
        # (output_dtype kept as it was)
        mp = S.policy_line(S.MP, us[0].param_dtype or "", output_dtype=us[0].output_dtype or "")
        if lever:  # accelerate's FSDP2 plugin shards the model, with the policy it holds
            who, prepares = S.plugin_says(lever)
            made = ("bf16=True or fp16=True in TrainingArguments, which have no option for the policy itself"
                    if lever == "trainer" else "Accelerator(mixed_precision=...)")
            text += f" {who}, accelerate made this policy from {made}: set the plugin's policy before {prepares}."
            code = S.plugin_mp_policy(mp, lever)
        else:  # the run's sharding again, every unit's options kept, with float32 reduction in the policy
            code = S.shard_plan(S.tree(ctx), mp_line=mp, note="gradients reduced in float32, compute as before")
        return [self.finding(
            "warning", f"Gradients reduced in {'/'.join(reds)} for {'/'.join(params)} parameters "
            f"({len(us)} unit(s))",
            {"units_narrow": len(us), "reduce_dtype": "/".join(reds), "param_dtypes": params,
             "reduce_dtype_explicit": explicit, "gradient_shard_bytes": grads,
             "reducescatter_ms_per_step": None if rs_ms is None else round(rs_ms, 3)},
            text, code, where=lever or "",
            # float32 reduction doubles the reduce-scatter's bytes: at most its time again (all of it exposed), a
            # ceiling: the traced time holds the wait for the other ranks too (gloo: +38% predicted as a change,
            # +0.1% of backward measured, a new-user trial)
            predicted=E.predicted(step, step + rs_ms if (step is not None and rs_ms is not None) else None,
                                  peak, peak_after, at_most=rs_ms is not None),
            units=[u.name for u in us[:20]])]


def _peak_reducing_in_fp32(pm, us: list[E.Unit], grad_width: int):
    """The peak with the gradients of the units ``us`` reduced in float32. FSDP2 copies a unit's gradients into one
    flat reduce-scatter input in the reduce dtype (its shard group's size times its padded trainable shard) and holds
    it from the unit's post-backward to the next one's (``_rs_inputs``), in comm_buffers: it grows by 4 / width of
    the dtype it is reduced in now. Where the compute (``param_dtype``, ``grad_width`` bytes an element) is 16-bit,
    FSDP2 also keeps the unsharded gradients it accumulates between synced micro-batches in reduce_dtype, so whatever
    the peak step's timeline holds as unsharded gradients at a mark counts 4 / grad_width times. The new peak is the
    highest mark. (A Trainer's Llama, bf16, 2 micro-batches: predicted 63,382,488 B, measured 63,874,652 B; the peak
    was 53,678,040 B. A new-user trial's bf16 blocks reducing in bf16 without accumulation: "peak 1.04 MiB
    unchanged" predicted, 1,094,104 -> 1,144,024 B measured, the float32 reduce-scatter input of the block whose
    post-backward ran last; the unit's input now.) None where nothing changes or no peak was measured."""
    if pm is None or not pm.peak_bytes:
        return None
    grow = 4 / grad_width - 1 if 0 < grad_width < 4 else 0
    rs_grow = {u.name: _rs_input_bytes(u, 4) - _rs_input_bytes(u, _WIDTH.get(_reduced_in(u) or "", 4)) for u in us}
    if not grow and not any(rs_grow.values()):
        return None
    if not pm.timeline:  # (the peak in a backward holds one unit's reduce-scatter input at most)
        held = max(rs_grow.values()) if "backward" in (pm.peak_at.phase or "") else 0
        return int(pm.peak_bytes + grow * (pm.peak_breakdown.get("unsharded_grads") or 0) + held)
    return E.peak_with_rows(pm, [grow * int(r.get("unsharded_grads") or 0) + rs
                                 for r, rs in zip(pm.timeline, _rs_inputs(pm.timeline, rs_grow))])


def _rs_input_bytes(u: E.Unit, width: int) -> int:
    """The unit's reduce-scatter input in a dtype of ``width`` bytes: its padded trainable shard's elements (the
    gradient shard, in its parameters' dtype) times the ranks it is sharded over; 0 where unknown."""
    orig = _WIDTH.get(u.orig_dtypes[0], 0) if len(u.orig_dtypes or []) == 1 else 0
    return E.grad_shard_bytes(u) // orig * (u.shard_size or 1) * width if orig and E.grad_shard_bytes(u) else 0


def _rs_inputs(timeline: list[dict], size: dict[str, int]) -> list[int]:
    """``size[unit]`` at each row of a step's timeline where FSDP2 holds that unit's reduce-scatter input: from its
    post-backward, which runs right after its backward_end mark, to the next unit's post-backward, which frees it
    before issuing its own (one input in flight: torch's reduce_scatter_max_input_buffers default), or the end of
    the backward. Nothing where the post-backward did not reduce (no gradient sync): there the unit's unsharded
    gradients stay, where a reduction frees them by the next mark."""
    marks = [i for i, r in enumerate(timeline) if not str(r.get("phase") or "").startswith("in_")]
    out, held = [], 0
    for i, r in enumerate(timeline):
        unit, phase = r.get("unit"), r.get("phase")
        if unit is None and phase in ("forward_start", "backward_end"):
            held = 0
        out.append(held)
        if phase == "backward_end" and unit is not None:
            nxt = next((timeline[j] for j in marks if j > i), None)
            if nxt is not None and (nxt.get("unsharded_grads") or 0) < (r.get("unsharded_grads") or 0):
                held = size.get(unit, 0)
    return out

