"""Precision: torch.autocast over FSDP2 parameters gathered in 32 bits."""

from __future__ import annotations

from .. import estimate as E
from .. import snippets as S
from ...units import fmt_bytes, fmt_share, unit_label
from ..base import Context, Rule, register

_FORWARD = ("forward_start", "in_forward", "forward_end")
# copies from this share of the peak on make it a warning (below: a note)
WARN_SHARE = 0.05


@register
class AutocastFp32Params(Rule):
    code = "precision.autocast_fp32_params"
    name = "torch.autocast over 32-bit FSDP2 parameters"
    description = ("The forward runs under torch.autocast while FSDP2 gathers float32 parameters: each matmul's "
                   "weight is all-gathered in float32, cast to 16 bits, and autograd keeps that copy from the "
                   "unit's forward to its backward, where resharding frees only the float32 original.")
    needs = ("units", "memory")
    severities = ("info", "warning")

    def match(self, ctx: Context):
        mem = E.peak_memory(ctx)
        read = [m.autocast for m in (ctx.report.memory.per_rank.values() if ctx.report.memory is not None else ())
                if isinstance(m.autocast, str)]
        if not read:
            return self.quiet("autocast was not recorded (a run recorded before the doctor read it)")
        dtype = next((d for d in read if d), None)
        if not dtype:
            return self.quiet("no forward ran under torch.autocast")
        units = E.param_units(ctx)
        # (gathered in float32: without a param_dtype, or with float32's, as OLMo-core's policy states its model's
        # dtype: a new-user trial's autocast run read "every unit gathers ... in its param_dtype", float32)
        units32 = [u for u in units if u.param_dtype == "float32"
                   or (not u.param_dtype and "float32" in u.orig_dtypes)]
        if not units32:
            return self.quiet(f"the forward runs under torch.autocast({dtype}), and every unit gathers its "
                              "parameters in its MixedPrecisionPolicy's param_dtype")
        cc = (mem.cast_copies if mem is not None and mem.cast_copies else None) or {}
        peak = int(mem.peak_bytes) if mem is not None else None
        at_peak, most = int(cc.get("peak") or 0), int(cc.get("most") or 0)
        gathered = sum(int(u.unsharded_bytes or 0) for u in units32)
        peak_after = _peak_after(mem, cc, units32) if peak else None
        share = at_peak / peak if peak else 0.0
        sev = "warning" if share >= WARN_SHARE else "info"
        names = [u.name for u in units32]
        # the run's own policy, where some units have one, keeps its name (``S.MP``, as the plan writes it)
        var = "autocast_mp" if any(u.param_dtype or u.reduce_dtype for u in units) else S.MP
        mp = S.policy_line(var, dtype)
        text = (f"The forward runs under torch.autocast({dtype}) while FSDP2 gathers {len(units32)} unit(s)' "
                f"parameters in float32 ({fmt_bytes(gathered)} when all are gathered): every all-gather moves "
                f"twice the bytes it would in {dtype}, and autocast then casts each gathered weight to {dtype} for "
                "its matmul. ")
        if most:
            text += (f"Autograd keeps that copy for the backward: {fmt_bytes(at_peak)} of the activations at the peak "
                     f"({fmt_share(share)}; {fmt_bytes(most)} at most), held from each unit's forward to its backward "
                     "although FSDP reshards the float32 original after the forward, so sharding does not shrink "
                     "them. ")
        else:
            text += ("Activation checkpointing keeps none of these copies for the backward (it recomputes them "
                     "there), but autocast's cache holds each one until the autocast region exits, at the end of "
                     "the forward: they show among the temporaries, not counted here. ")
        text += (f"A MixedPrecisionPolicy with param_dtype={dtype} gathers the weights already in {dtype}: autocast "
                 f"has nothing left to cast, the gathered parameters and their buffers halve, and the matmuls see the "
                 f"same {dtype} weights; reduce_dtype=float32 keeps the gradients' reduction and the optimizer's "
                 f"float32 master weights as now. Activations computed from the parameters outside autocast's "
                 f"matmuls (the embeddings' output and the residual stream, norms) become {dtype} too: they shrink "
                 f"as well, which the predicted peak does not count (it is a ceiling).")
        title = f"torch.autocast({dtype}) over float32 FSDP2 parameters: {fmt_bytes(gathered)} gathered in float32"
        if at_peak:
            title += f", {fmt_bytes(at_peak)} of {dtype} weight copies held at the peak ({fmt_share(share)})"
        lever = E.plugin_lever(ctx)
        if lever:  # accelerate's FSDP2 plugin shards the model, with the policy it holds
            who, prepares = S.plugin_says(lever)
            text += f" {who}: set the plugin's policy before {prepares}."
            code = S.plugin_mp_policy(mp, lever)
        else:  # the run's sharding again, every unit's options kept, with the policy on the float32 units
            plan = S.shard_plan(S.tree(ctx), extra_kwargs=f", mp_policy={var}", mp_line=mp if var == S.MP else None,
                                only=set(names), note=f"parameters gathered in {dtype}; your torch.autocast stays")
            code = plan if var == S.MP else mp + "\n" + plan
        return [self.finding(
            sev, title,
            {"autocast_dtype": dtype, "units_float32": len(units32), "cast_copies_at_peak_bytes": at_peak,
             "cast_copies_most_bytes": most, "cast_copies_share_of_peak": round(share, 4),
             "gathered_float32_bytes": gathered,
             "cast_copies_by_unit": _own_by_unit(cc.get("units") or {}, E.units(ctx))},
            text, code, where=lever or "",
            predicted=E.predicted(peak_before=peak, peak_after=peak_after, at_most=True),
            units=names[:20])]


def _own_by_unit(saved: dict[str, int], units) -> dict[str, int]:
    """Each unit's own cast copies (bytes; the recorder's count a unit's nested units' too, so the list added up to
    more than was alive), by its label ("(root)", not ""): a new-user trial read ": 327,680, blocks.0: 98,304, ..."
    where the root's own were 32,768. The 20 largest."""
    parent = {u.name: u.parent for u in units}
    own = dict(saved)
    for name, b in saved.items():
        p = parent.get(name)
        if p is not None and p in own:
            own[p] -= b
    top = sorted(((unit_label(n), max(0, b)) for n, b in own.items()), key=lambda x: -x[1])[:20]
    return dict(sorted(top))


def _peak_after(mem, cc: dict, units32) -> int:
    """The peak (bytes) with the units ``units32`` gathered in 16 bits, at most: at each mark of the peak step's
    timeline, autocast's copies go (those of these units: no more than they hold) and the gathered parameters halve,
    in the forward their all-gather buffers too (in the backward the buffers also hold the float32 reduce-scatter's,
    which stay). Without a timeline: the copies at the peak and half the gathered parameters there."""
    held = sum(int(u.unsharded_bytes or 0) for u in units32) // 2  # the units' copies, every one alive at once
    rows, tl = cc.get("rows") or [0] * len(mem.timeline or []), mem.timeline
    if not tl or len(rows) != len(tl):
        bd = mem.peak_breakdown
        return int(mem.peak_bytes - min(int(cc.get("peak") or 0), held)
                   - 0.5 * min(int(bd.get("unsharded_params", 0)), 2 * held))
    biggest = max(int(u.unsharded_bytes or 0) for u in units32)
    added = []
    for r, c in zip(tl, rows):
        gone = min(int(c), held) + 0.5 * min(int(r.get("unsharded_params") or 0), 2 * held)
        if r.get("phase") in _FORWARD:
            gone += 0.5 * min(int(r.get("comm_buffers") or 0), biggest)
        added.append(-gone)
    return E.peak_with_rows(mem, added)
