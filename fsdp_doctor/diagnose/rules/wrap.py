"""Wrapping rules: how the model was cut into FSDP units (too coarse, too fine, parameters left in the root,
the root never sharded, a unit mixing parameter dtypes)."""

from __future__ import annotations

import dataclasses
import statistics
from typing import Optional

import msgspec

from .. import estimate as E
from .. import thresholds as T
from .. import snippets as S
from ...units import ROOT_LABEL, fmt_bytes, fmt_share
from ..base import NEEDS, Context, Rule, register
from ..thresholds import COARSE_SHARE_MIN  # one unit holding this share of the parameters is too coarse

# Splitting a coarse unit: the estimate assumes it becomes this many similar units, two of them gathered
# at a time (the one computing, the one prefetched).
COARSE_SPLIT_INTO = 4
#: off a GPU the split's gain is memory only: under this share of the peak it is no finding
COARSE_PEAK_GAIN_MIN = T.MEMORY_ONLY_MIN_PEAK_SHARE
# On a GPU the split units' all-gathers overlap with compute (own stream). On gloo they do not (the
# collectives share the host's cores with compute), and splitting adds calls and a backward re-gather:
# benchmarks/predictions.py measured whole -> block at +74% step time on the 2-rank CPU workload.
# Fixed cost of one gloo collective on a shared host: the all-gather wait of a 1 KiB LayerNorm unit in the
# leaf-wrapped reference run was 1.5-2 ms.
GLOO_CALL_MS = 1.5
# Below this many units, per-call latency times the number of calls stays small against a step.
FINE_MIN_UNITS = 12
# A unit of one leaf module (a Linear/Norm/Embedding: weight and bias) holds at most this many tensors.
FINE_LEAF_TENSORS = 2
# Collectives below this size are latency-bound on every interconnect (NCCL reaches bus bandwidth only
# in the MiB range; gloo's per-call overhead is ~0.1-1 ms).
FINE_SMALL_BYTES = 256 << 10
# A root unit holding at least this share of the parameters keeps them gathered for the whole step.
ROOT_SHARE_MIN = 0.05
#: ... and where its plan, read on the peak step's memory timeline, frees less than this share of the peak, it is no
#: finding (the gain is memory only: the new units' all-gathers are the root's, moved)
ROOT_PEAK_GAIN_MIN = T.MEMORY_ONLY_MIN_PEAK_SHARE
# Whatever the unit count, a unit far smaller than the unit holding it (its FSDP parent, not the root: a MoE router or
# a norm sharded alone inside a block) gathers a few bytes at a collective's whole fixed cost: at most this share of
# its parent's gathered bytes, and under FINE_SMALL_BYTES. (A new-user trial's tiny Mixtral, each layer's 1 KiB
# router a unit inside its 432.50 KiB layer: 4 units, quiet under FINE_MIN_UNITS, where the routers' all-gathers
# waited 17.3 ms of a 108.6 ms step; with 6 layers the rule fired, and its fix took the step 219.8 -> 168.1 ms.)
TINY_PARENT_SHARE = 1 / 16
# ... worth a finding where merging them into their parents saves at least this share of the step (their measured
# collectives less what their bytes add to their parents' all-gathers), a warning from this share on (the share
# a step-time gain is worth a warning from in thresholds.HEADROOM_WARN_GAIN_SHARE)
TINY_MIN_GAIN_SHARE = 0.05
TINY_WARN_GAIN_SHARE = T.HEADROOM_WARN_GAIN_SHARE
# under a torchtune recipe (whose config names the modules made units of their own, each alone: custom_sharded_layers),
# a module of the root's holding less than this share of what moves stays in the root: a unit of its own would cost
# its collectives for nothing (its final norm beside the output head; torchtune's own configs name the embedding
# and the head)
TUNE_LAYER_MIN_SHARE = 0.05


def _job_numbers(ctx: Context):
    return E.step_ms(ctx), E.peak_bytes(ctx)


def _call_ms(ctx: Context):
    """One collective's cost in this run (ms), what each all-gather and reduce-scatter of a new small unit adds: on
    gloo the forward all-gathers of the smallest quarter of the units besides the root (their median), as the last
    rank to reach each waited in it (E.own_wait_ms: the collective's own cost; the host blocks there); in a run with
    no such unit the root's own, at most GLOO_CALL_MS (the root's carries the whole model); on a GPU those units'
    exposed forward all-gathers in the trace (the host runs ahead of the device there). None without them."""
    us = E.param_units(ctx)

    def smallest(units: list) -> list:  # the smallest quarter by bytes, those as small as its largest with them
        units = sorted(units, key=lambda u: u.unsharded_bytes)
        return [u for u in units if u.unsharded_bytes <= units[max(1, len(units) // 4) - 1].unsharded_bytes]
    if E.on_gpu(ctx):
        trace = E.trace_exposed_by_unit(ctx, "all_gather", ranks=E.read_ranks(ctx))
        seen = [u for u in E.non_root(us) if (u.name, "forward") in trace]
        return statistics.median(trace[(u.name, "forward")] for u in smallest(seen)) if seen else None
    timed = [u for u in E.non_root(us) if u.has_timing]
    if timed:  # (equal blocks: the median of them all, the first block's forward wait, 8.2 ms, not alone)
        return statistics.median(E.own_wait_ms(ctx, u, "forward") for u in smallest(timed))
    root = next((u for u in E.roots(us) if u.has_timing), None)
    return min(GLOO_CALL_MS, E.own_wait_ms(ctx, root, "forward")) if root is not None else None


def _leftover_costs(ctx: Context) -> S.LeftoverCosts:
    """What a plan weighs the root's own modules against (snippets.leftover_stays): the step's peak, the step and one
    collective's cost in this run."""
    step, peak = _job_numbers(ctx)
    return S.LeftoverCosts(peak_bytes=peak, step_ms=step, call_ms=_call_ms(ctx))


def _root_plan(ctx: Context, costs: Optional[S.LeftoverCosts] = None, split: bool = False) -> str:
    """The whole sharding with the root's own modules units of their own where that gains more than it costs
    (``costs``: ``_leftover_costs``, read here where not given); ``split``: blocks too large to be one unit split, and
    the blocks a unit held whole made units of their own (wrap.too_coarse's; otherwise that unit stays)."""
    return S.shard_plan(S.tree(ctx), root_leftovers=True, leftover_costs=costs or _leftover_costs(ctx), split=split,
                        split_held=split)


def _plugin_wrap(ctx: Context, did: str, blocks: Optional[list[str]] = None) -> dict:
    """Where accelerate's FSDP2 plugin sharded the model (the Trainer's runs too), its auto-wrap policy cut the units
    (``did``: what it did, in words): the fix sets its transformer-based policy over the model's block classes (its
    _no_split_modules), on the plugin before it shards ({} for the user's own fully_shard calls, or a model without
    _no_split_modules). ``blocks``: the plan's units, where the run's units are some of them: the classes of those
    (a ConvNeXt's _no_split_modules names its layers and the stages holding them, and the plugin's policy, over
    both, nested them: the fix named both again, changing nothing, under words of a size-based policy; a new-user
    trial). "noop": the run's units are already those classes, which the fix would name again."""
    lever = E.plugin_lever(ctx)
    classes = getattr(ctx.config, "no_split_modules", None) if lever else None
    if not classes:
        return {}
    of = {m: c for u in E.non_root(E.units(ctx)) for m, c in zip(u.modules, u.module_classes)}
    ran = sorted({c for c in of.values() if c in classes})  # its transformer-based policy's classes, as run
    want = sorted({of[b] for b in blocks or [] if b in of} & set(classes)) if blocks else []
    chosen = want or list(classes)
    fix = {"code": S.plugin_wrap(lever, chosen), "where": lever}
    if ran and blocks is not None:  # (the units cut by class: which classes, as run)
        return {**fix, "noop": set(chosen) == set(ran),
                "text": f"{S.plugin_says(lever)[0]}, the plugin's transformer-based policy over {', '.join(ran)} "
                        "(the model's _no_split_modules) cut these units"
                        + (", one inside another" if len(ran) > 1 else "")
                        + f": over {', '.join(chosen)} alone it makes each block one unit."}
    return {**fix, "noop": False,
            "text": f"{S.plugin_says(lever)[0]}, the plugin's auto-wrap policy {did}: its transformer-based policy "
                    f"over the model's block classes ({', '.join(chosen)}) makes each block one unit."}


@register
class TooCoarse(Rule):
    code = "wrap.too_coarse"
    name = "Unit too coarse"
    description = "One unit holds most parameters: its all-gather dominates unsharded memory and cannot overlap."
    needs = ("units|trace",)
    severities = ("warning",)

    def match(self, ctx: Context):
        if not E.units(ctx):
            return self._from_plain_trace(ctx)
        us = E.param_units(ctx)
        total = E.total_params(us)
        if not us or total <= 0:
            return self.quiet("no unit holds parameters")
        big = max(us, key=lambda u: u.param_count)
        share = big.param_count / total
        if share < COARSE_SHARE_MIN:
            return self.quiet(f"the largest unit, {big.name or '(root)'}, holds "
                              f"{fmt_share(share, under=COARSE_SHARE_MIN)} of the parameters "
                              f"(fires from {100 * COARSE_SHARE_MIN:.0f}%)")
        if big.is_root and len(us) > 1:  # a root holding most parameters next to wrapped units
            return self.quiet("the root holds most parameters beside other units: wrap.params_in_root says it")
        hb = E.host_bound(ctx)
        if hb is not None and hb[1] >= T.BOUND_MIN_SHARE and not E.peak_near_capacity(ctx):
            # each unit adds FSDP2's hooks, copies and collectives to the host's work, which the device waits for
            # already (the H200's tiny GPT: 6 units 30.3 ms, one unit 19.3 ms), and the memory is not needed
            return self.quiet(f"{big.name or '(root)'} holds {fmt_share(share)} of the parameters, but the device "
                              f"waits for its host {fmt_share(hb[1])} of the profiled step (rank {hb[0]}): more "
                              "units would add FSDP2's per-unit host work to that wait (kernels.launch_bound), for "
                              "memory the run does not need (its peak is not near capacity)")
        step, peak = _job_numbers(ctx)
        t = big.timing
        ag = E.ag_wait_ms(big, "forward") + E.ag_wait_ms(big, "backward")
        # (a block too large to be one unit split into its own, as the plan does)
        blocks = list(S.block_bytes(big, S.tree(ctx).split_blocks()).values())
        own = sum(big.own_bytes)
        # the units the plan makes of it: its blocks where the snapshot sizes them (4 said of every plan read
        # gloo's step 8-25% short: a timm ViT's 6 blocks, +8% predicted, +20% measured; 6 said, +11%)
        k = len(blocks) if len(blocks) >= 2 and own else COARSE_SPLIT_INTO
        # the plan also makes units of a whole-model root's other modules (an embedding, a final norm and head): on
        # gloo each pays its collectives too (a new-user trial's DeepSeek-V3, 4 layers and 2 such units: +27%
        # predicted from the layers alone, +65-82% measured)
        # (how the plan groups the root's other modules, read once for both estimates below)
        split_root = big.is_root and len(blocks) >= 2 and own
        lg = S.leftover_groups(S.tree(ctx), _leftover_costs(ctx)) if split_root else None
        more = len(lg.lead) + bool(lg.tail) if lg is not None else 0
        # after the split only the first of k units waits in each phase; the rest overlap with compute
        step_after = None
        if step is not None and big.has_timing:
            if E.on_gpu(ctx):
                step_after = step - ag * (k - 1) / k
            else:  # backward re-gathers the resharded parts, and 3(k-1) more collectives pay their fixed cost
                step_after = step + E.ag_wait_ms(big, "forward") * (k - 1) / k + 3 * (k + more - 1) * GLOO_CALL_MS
        gathered_extra = big.unsharded_bytes - big.sharded_bytes
        peak_after = peak - gathered_extra * (1 - 2 / k) if peak is not None else None
        if peak is not None and len(blocks) >= 2 and own:
            # from the unit's own modules: after the split at most two consecutive blocks are gathered (the one
            # computing, the one FSDP prefetches); what the whole unit had gathered at the peak (its unsharded
            # parameters and its all-gather buffers) shrinks to that pair's share of the unit
            pair = max(a + b for a, b in zip(blocks, blocks[1:]))
            bd = E.breakdown(ctx)
            at_peak = (bd.get("unsharded_params") or 0) + (bd.get("comm_buffers") or 0)
            peak_after = peak - at_peak * (1 - min(1.0, pair / own))
            if lg is not None and len(us) == 1 and (floor := _after_forward_floor(ctx, big, pair, lg)) is not None:
                peak_after = max(peak_after, floor)
        name = big.name or "(root)"
        if own and len(blocks) < 2 and len(us) > 1 and S.tree(ctx).containers():
            # the blocks are units already; this one holds the model's ends (a tied embedding and output head over a
            # large vocabulary, as accelerate groups them: a new-user trial's Qwen2, 151,936 tokens beside 64-wide
            # blocks, read "holds 99%: each block a unit", its fix the plugin's policy the run had, 9% slower)
            mods = list(big.own_modules or [])
            tied = [m for m in mods if m in (big.tied_modules or [])]
            return self.quiet(f"{name} holds {fmt_share(share)} of the parameters but no repeated block (the blocks "
                              "are units of their own): its modules' "
                              + (f"shared weight ({E.fmt_list(tied)}: tied), which must stay in one unit"
                                 if len(tied) >= 2 else f"own weights ({E.fmt_list(mods)})")
                              + ", which no finer wrap of the blocks shrinks")
        if own and len(blocks) < 2 and not S.tree(ctx).containers():
            # (a unit of one Linear in a 2-unit model: "split into 4 similar units" of a module that has none, its
            # plan the run's own sharding again, predicted 156% slower and no memory saved: a new-user trial)
            return self.quiet(f"{name} holds {fmt_share(share)} of the parameters, but neither it nor the model "
                              "holds repeated blocks to make units of")
        if not E.on_gpu(ctx) and peak is not None and peak_after is not None and \
                peak - peak_after < COARSE_PEAK_GAIN_MIN * peak:
            return self.quiet(f"{name} holds {fmt_share(share)} of the parameters, but splitting it saves "
                              f"{fmt_bytes(max(0, peak - peak_after))} of a {fmt_bytes(peak)} peak here, and on "
                              "gloo its smaller collectives only lengthen the step")
        whole = big.is_root and len(us) == 1
        # every block of every container (from the modules the coarse unit holds), the rest as the run had it
        code = _root_plan(ctx, split=True)
        text = (f"Unit {name!r} holds {fmt_share(share)} of the parameters, so FSDP gathers "
                f"{fmt_bytes(big.unsharded_bytes)} in one all-gather with nothing to overlap it with"
                + (" (the whole model is one unit: fully_shard was applied only to the root). " if whole else ". ")
                + "Apply fully_shard to each repeated block first, then to the root: only two blocks are "
                "gathered at a time, and on a GPU each block's all-gather overlaps with the previous block's "
                "compute." + ("" if E.on_gpu(ctx) else " On a CPU/gloo host the gain is memory only: more, "
                              "smaller collectives that cannot overlap make the step longer."))
        plug = _plugin_wrap(ctx, "left the blocks in one unit (no policy, or a size-based one above them)")
        if plug:  # the plugin's policy, not fully_shard calls of the user's, is the lever
            code = plug["code"]
            text = text.replace("Apply fully_shard to each repeated block first, then to the root:",
                                "With each repeated block a unit of its own,") + " " + plug["text"]
        return [self.finding(
            "warning", f"Unit {name!r} holds {fmt_share(share)} of all parameters",
            {"unit": name, "param_share_pct": round(100 * share, 1), "param_count": big.param_count,
             "unsharded_bytes": big.unsharded_bytes, "units_with_params": len(us),
             "ag_wait_fwd_ms": t.ag_wait_fwd_ms, "ag_wait_bwd_ms": t.ag_wait_bwd_ms,
             "step_p50_ms": step,
             "estimate_assumes": (f"its {len(blocks)} blocks split off, 2 consecutive ones gathered at a time"
                                  if len(blocks) >= 2 and own else f"split into {k} similar units, 2 gathered at a time")},
            text, code,
            where=plug.get("where", ""),
            predicted=E.predicted(step, step_after, peak, peak_after), units=[big.name])]

    def _from_plain_trace(self, ctx: Context):
        """A plain trace (no unit snapshot): each unit's forward all-gather moves its whole gathered parameters
        (FSDP2's labels name the unit), so the messages' sizes give the units' shares. A new-user trial's Whisper
        under fully_shard(model) alone, traced with torch.profiler, read "No findings" (its records: this warning,
        the peak 34.04 -> 23.79 MiB predicted, 25.03 measured with its blocks as units). No code: a trace names no
        module, and the plan is built from the model's tree."""
        sized = E.trace_gathered_bytes(ctx)
        if not sized:
            return self.quiet("the trace records no FSDP all-gather's size (torch.profiler's record_shapes=True "
                              "records them)" if E.trace_rows(ctx, "all_gather") else
                              "no FSDP all-gather in the trace")
        name, big = max(sized.items(), key=lambda kv: kv[1])
        total = sum(sized.values())
        share = big / total
        if share < COARSE_SHARE_MIN:
            return self.quiet(f"the largest unit in the trace, {name}, gathers "
                              f"{fmt_share(share, under=COARSE_SHARE_MIN)} of the bytes the units' forward all-gathers "
                              f"move (fires from {100 * COARSE_SHARE_MIN:.0f}%)")
        roots = [pr.roots_per_forward for pr in ctx.report.overlap.per_rank.values() if pr.roots_per_forward]
        if roots and statistics.median(roots) >= 2:  # several roots read as one "(root)": FSDP's labels name none
            return self.quiet("the trace shows several FSDP roots in each forward: wrap.root_not_sharded says it")
        if name == ROOT_LABEL and len(sized) > 1:
            return self.quiet("the root holds most parameters beside other units (wrap.params_in_root weighs that "
                              "from the unit snapshot, which fsdp_doctor.watch records)")
        if name.rpartition(".")[2].isdigit():  # (a known-answer trace's model.layers.1 beside a smaller layers.0
            # read "apply fully_shard to each repeated block" of a block: a trace does not say what a unit holds)
            return self.quiet(f"the largest unit in the trace, {name}, gathers {fmt_share(share)} of the units' "
                              "bytes, but it is one of a numbered container's blocks: a trace does not say whether it "
                              "holds smaller repeated blocks of its own")
        hb = E.host_bound(ctx)
        if hb is not None and hb[1] >= T.BOUND_MIN_SHARE:
            return self.quiet(f"{name} gathers {fmt_share(share)} of the units' bytes, but the device waits for its "
                              f"host {fmt_share(hb[1])} of the profiled step (rank {hb[0]}): more units would add "
                              "FSDP2's per-unit host work to that wait (kernels.launch_bound)")
        # split into k similar units, two of them gathered at a time: all but 2/k of its gathered bytes freed at
        # the peak (k unknown from a trace: the records' default)
        freed = big * (1 - 2 / COARSE_SPLIT_INTO)
        gpu = E.trace_device(ctx) == "gpu"
        peak = E.trace_peak_bytes(ctx)
        if not gpu and peak and freed < COARSE_PEAK_GAIN_MIN * peak:
            return self.quiet(f"{name} gathers {fmt_share(share)} of the units' bytes, but splitting it would free "
                              f"about {fmt_bytes(freed)} of a {fmt_bytes(peak)} peak, and on gloo its smaller "
                              "collectives only lengthen the step")
        whole = len(sized) == 1 and name == ROOT_LABEL
        waits = E.trace_exposed_by_unit(ctx, "all_gather", ranks=E.read_ranks(ctx))
        fwd, bwd = (waits.get((name, ph), 0.0) for ph in ("forward", "backward"))
        step = E.trace_step_ms(ctx)
        text = (f"Unit {name!r} gathers {fmt_share(share)} of the parameters the trace's units all-gather: "
                f"{fmt_bytes(big)} in one all-gather with nothing to overlap it with"
                + (" (the whole model is one unit: fully_shard was applied only to the root). " if whole else ". ")
                + "Apply fully_shard to each repeated block first (each transformer layer), then to the root: only "
                "two blocks are gathered at a time, so with n blocks all but 2/n of these bytes are freed at the "
                f"peak (about {fmt_bytes(freed)} with 4)"
                + (", and each block's all-gather overlaps with the previous block's compute. " if gpu else
                   ". On a CPU/gloo host the gain is memory only: more, smaller collectives that cannot overlap make "
                   "the step longer. ")
                + "A trace names no module, so no code is offered: record the run with fsdp_doctor.watch(model, "
                "optimizer) for the plan built from your model's modules, and its figures.")
        return [self.finding(
            "warning", f"Unit {name!r} gathers {fmt_share(share)} of all parameters (trace)",
            {"unit": name, "gathered_share_pct": round(100 * share, 1), "gathered_bytes": int(big),
             "units_in_trace": len(sized), "trace_exposed_ag_fwd_ms": round(fwd, 3),
             "trace_exposed_ag_bwd_ms": round(bwd, 3), "step_ms": None if step is None else round(step, 3),
             "measured_by": "trace (FSDP2's labels, the all-gathers' sizes)"},
            text, units=[name])]


@register
class TooFine(Rule):
    code = "wrap.too_fine"
    name = "Units too fine"
    description = ("Many small units, or a few far smaller than the units holding them: their collectives are too "
                   "small to reach bandwidth and pay per-call latency.")
    needs = ("units",)
    severities = ("info", "warning")

    def match(self, ctx: Context):
        us = E.non_root(E.param_units(ctx))
        many = self._many(ctx, us)
        if not isinstance(many, str):
            return many
        # whatever the count: a few units far smaller than the units holding them, whose collectives cost time
        tiny = self._tiny(ctx, us)
        return tiny if not isinstance(tiny, str) else self.quiet(f"{many}; {tiny}")

    def _many(self, ctx: Context, us: list):
        """Many small units (FINE_MIN_UNITS or more, the median one a leaf or small): the finding, or why not."""
        if len(us) < FINE_MIN_UNITS:
            return (f"{len(us)} unit{'s' if len(us) != 1 else ''} besides the root (fires from "
                    f"{FINE_MIN_UNITS})")
        # the median unit, one of the units (with an even count the lower middle one: the mean of the two middle ones
        # is no unit's size, "216.75 KiB" read beside units of 1 KiB and 432.5 KiB: a new-user trial)
        med_tensors = statistics.median_low(u.n_params for u in us)
        med_bytes = statistics.median_low(u.unsharded_bytes for u in us)
        if med_tensors > FINE_LEAF_TENSORS and med_bytes >= FINE_SMALL_BYTES:
            return (f"the median unit holds {med_tensors:g} tensors, {fmt_bytes(med_bytes)} gathered (fires "
                    f"at {FINE_LEAF_TENSORS} tensors or fewer, or under {fmt_bytes(FINE_SMALL_BYTES)})")
        small = [u for u in us if u.unsharded_bytes < FINE_SMALL_BYTES or u.n_params <= FINE_LEAF_TENSORS]
        step, _ = _job_numbers(ctx)
        timed = [u for u in us if u.has_timing]
        waits = [E.ag_wait_ms(u, "forward") for u in timed]
        ag_total = sum(E.ag_wait_ms(u, p) for u in timed for p in ("forward", "backward"))
        # per-call fixed cost: the all-gather wait of the smallest quarter of the units (their bytes are ~0), the
        # ranks' waits pooled: merging many units saves their hooks and copies beside the collectives (the matrix's
        # gpt_leaf, 28 units merged into 8 on a loaded host: 383 -> 226 ms, 207 ms predicted so; from the wait of
        # the rank that reached each collective last, what the few tiny units below are counted at, 279 ms)
        by_size = sorted(timed, key=lambda u: u.unsharded_bytes)[:max(1, len(timed) // 4)]
        latency = statistics.median(E.ag_wait_ms(u, "forward") for u in by_size) if by_size else None
        # group the units by repeated block: what the calls would be after re-wrapping
        group = {u.name: E.block_of(u.modules[0] if u.modules else u.name) or (u.modules[0] if u.modules else u.name)
                 for u in us}
        after = len({E.block_of(m) or m for u in us for m in u.modules})
        tree = S.tree(ctx)
        if after >= len(us):  # no repeated blocks (a U-Net's enc1, enc2, ...): the modules holding the leaves
            # (the blocks' plan kept every leaf its unit, "18 units -> ~18", and pasted it changed nothing: a
            # new-user trial)
            held = S.holders(tree)
            after = len(us) - sum(len(v) for v in held.values()) + len(held)
            group = {u.name: u.name for u in us} | {h.name: p for p, hs in held.items() for h in hs}
            code = S.holder_plan(tree, f"the modules holding the leaves instead of them ({len(us)} units -> {after})") \
                if held else ""
        else:
            code = S.shard_plan(tree, nested=False,  # the leaves' units give way to their blocks
                                note=f"whole blocks instead of their leaves ({len(us)} units -> ~{after})")
        calls_before = 2 * len(us)  # one all-gather in forward, one in backward
        calls_after = 2 * after
        step_after = None
        if step is not None and latency is not None and waits:
            step_after = step - max(0, calls_before - calls_after) * latency
        plug = _plugin_wrap(ctx, "cut these units (a size-based policy: every module over min_num_params)",
                            blocks=sorted(set(group.values())))
        if plug.get("noop"):
            return self.quiet(f"{len(small)} of {len(us)} units are small, but the plugin's policy already wraps "
                              "the classes of the blocks that would hold them: its fix would change nothing")
        code = plug.get("code", code)
        title, said = _fine_units(us, small)
        # what replaces what: the units' bytes summed by what holds them after the re-wrap
        groups: dict[str, int] = {}
        params: dict[str, int] = {}
        for u in us:
            groups[group[u.name]] = groups.get(group[u.name], 0) + u.unsharded_bytes
            params[group[u.name]] = params.get(group[u.name], 0) + (u.param_count or 0)
        # a block that would hold most of the model: wrap.too_coarse's on the rerun (a ConvNeXt's last stage, 64% of
        # the parameters, its layers merged into it: the rerun warned of it, its peak 32.56 -> 36.42 MiB; a new-user
        # trial)
        total = E.total_params(E.param_units(ctx))
        big = max(params, key=params.get) if params else None
        if big is not None and total and params[big] / total >= COARSE_SHARE_MIN and len(groups) < len(us):
            return self.quiet(f"{len(small)} of {len(us)} units are small, but merged into their blocks they would "
                              f"leave {big} holding {fmt_share(params[big] / total)} of the parameters, too coarse "
                              f"(wrap.too_coarse from {100 * COARSE_SHARE_MIN:.0f}%)")
        replaced = (f" so that each pass (forward, then backward) makes {len(groups)} all-gather"
                    f"{'s' if len(groups) != 1 else ''} of {_each(groups.values())} in place of these {len(us)}"
                    if len(groups) < len(us) and (code or plug) else "")
        return [self.finding(
            "warning", title,
            {"units": len(us), "small_units": len(small),
             "largest_small_unit_bytes": max(u.unsharded_bytes for u in small) if small else None,
             "larger_units": len(us) - len(small),
             "smallest_larger_unit_bytes": min((u.unsharded_bytes for u in us if u not in small), default=None),
             "units_after": len(groups), "largest_unit_after_bytes": max(groups.values()),
             "all_gathers_per_step": calls_before,
             "ag_wait_ms_per_step": round(ag_total, 3),
             "ag_latency_ms_per_call": None if latency is None else round(latency, 3),
             "step_p50_ms": step, "examples": [u.name for u in small[:6]]},
            f"{said}: every such unit pays a fixed cost per collective (launch, synchronisation, latency) that its few "
            "bytes cannot amortise, and FSDP's prefetching only looks one unit ahead. Wrap whole blocks (as "
            f"torchtitan does: each transformer block a unit){replaced}."
            + ("" if code or plug else " The module names show no blocks holding several of these units: wrap "
               "the modules of your model that hold several layers each.")
            + (" " + plug["text"] if plug else ""),
            code, where=plug.get("where", ""), predicted=E.predicted(step, step_after),
            units=[u.name for u in small[:20]])]

    def _tiny(self, ctx: Context, us: list):
        """Units far smaller than the units holding them (TINY_PARENT_SHARE of their FSDP parent's bytes, the parent
        not the root), whose collectives take a material share of the step whatever the unit count: the finding
        (their fully_shard calls dropped, each merged into the unit holding it), or why not. The cost is what the
        run measured: on gloo the host's waits in their all-gathers (the records'; the host blocks in each), on a
        GPU the trace's exposed all-gathers and reduce-scatters (the host runs ahead of the device there)."""
        by_name = {u.name: u for u in E.units(ctx)}
        pairs, apart = [], []
        for u in us:
            p = by_name.get(u.parent) if u.parent is not None else None
            if p is None or p.is_root or not p.param_count:
                continue  # beside the root: an embedding, a final norm and head (wrap.params_in_root's units)
            if u.unsharded_bytes >= FINE_SMALL_BYTES or u.unsharded_bytes > TINY_PARENT_SHARE * p.unsharded_bytes:
                continue
            (apart if _kept_apart(u, p) else pairs).append((u, p))
        if not pairs:
            return (f"no unit far smaller than the unit holding it (under {fmt_bytes(FINE_SMALL_BYTES)} and "
                    f"1/{round(1 / TINY_PARENT_SHARE)} of its bytes)" if not apart else
                    f"the units far smaller than the units holding them ({E.fmt_list([u.name for u, _ in apart], 3)}) "
                    f"have options of their own ({_kept_apart(*apart[0])}): kept apart on purpose")
        names = E.fmt_list([u.name for u, _ in pairs], 3)
        step = E.step_ms(ctx)
        gpu = E.on_gpu(ctx)
        ranks = E.read_ranks(ctx)
        ag = E.trace_exposed_by_unit(ctx, "all_gather", ranks=ranks)
        rs = E.trace_exposed_by_unit(ctx, "reduce_scatter", ranks=ranks)
        trace_ag = lambda u: sum(v for (n, _), v in ag.items() if n == u.name)  # noqa: E731
        trace_rs = lambda u: sum(v for (n, _), v in rs.items() if n == u.name)  # noqa: E731
        if gpu:  # on a GPU the host runs ahead of the device: only the trace sees the stream waiting
            if not ag and not rs:
                return (f"{len(pairs)} unit(s) far smaller than the units holding them ({names}): timing their "
                        "collectives on a GPU needs a profiler trace")
            ag_ms, rs_ms = trace_ag, trace_rs
        else:
            if not all(u.has_timing and p.has_timing for u, p in pairs):
                return f"{len(pairs)} unit(s) far smaller than the units holding them ({names}), not timed"
            # what each collective itself costs: the wait of the rank that arrived last (E.own_waits), not the
            # others' wait for it, which merging leaves at their next collective
            ag_ms = lambda u: E.own_wait_ms(ctx, u, "forward") + E.own_wait_ms(ctx, u, "backward")  # noqa: E731
            # the records time no reduce-scatter: one of the same few bytes, in the same backward, costs what the
            # unit's backward all-gather waited (the trial's 6 routers: 26.1 ms forward and 12.2 ms backward
            # all-gather waits, 50.5 ms with their reduce-scatters so counted; merged, the step gained 51.7 ms)
            rs_ms = lambda u: (E.own_wait_ms(ctx, u, "backward")  # noqa: E731
                               if u.trainable_unsharded_bytes != 0 else 0.0)
        cost = {u.name: ag_ms(u) + rs_ms(u) for u, _ in pairs}
        # what their bytes add to their parents' collectives, at the parents' own rate
        added = sum((ag_ms(p) + rs_ms(p)) * u.unsharded_bytes / p.unsharded_bytes for u, p in pairs
                    if p.unsharded_bytes)
        total = sum(cost.values())
        gain = total - added
        if not step or gain <= 0 or gain < TINY_MIN_GAIN_SHARE * step:
            return (f"{len(pairs)} unit(s) far smaller than the units holding them ({names}) cost "
                    f"{total:.1f} ms per step in their collectives" + (
                        f", {fmt_share(max(0.0, gain) / step, under=TINY_MIN_GAIN_SHARE)} of the step once merged "
                        f"(fires from {100 * TINY_MIN_GAIN_SHARE:.0f}%)" if step else ", no step time measured"))
        share = gain / step
        tiny = [u for u, _ in pairs]
        ag_total, rs_total = sum(ag_ms(u) for u in tiny), sum(rs_ms(u) for u in tiny)
        parents = list(dict.fromkeys(p.name for _, p in pairs))
        title, said = _fine_units(us, tiny)
        drop = {u.name for u in tiny}
        t = S.tree(ctx)
        kept = dataclasses.replace(
            t, units=[x for x in t.units if x.name not in drop], names=[n for n in t.names if n not in drop],
            forward=[n for n in t.forward if n not in drop],
            backward=None if t.backward is None else [n for n in t.backward if n not in drop])
        code = S.shard_plan(kept, note=f"your units but {E.fmt_list([u.name for u in tiny], 2)}: each merged into "
                                       f"the unit holding it ({len(us)} units -> {len(us) - len(tiny)})")
        plug = _plugin_wrap(ctx, "cut these units (a size-based policy, or one naming their classes)")
        each = _each(u.unsharded_bytes for u in tiny)
        text = (f"{said}: each pays a collective's fixed cost (launch, synchronisation, latency) for its few bytes, "
                "in an all-gather in forward, another in backward and a reduce-scatter, and FSDP's prefetching only "
                "looks one unit ahead. "
                + (f"Their all-gathers and reduce-scatters are exposed {ag_total:.1f} and {rs_total:.1f} ms per step "
                   "in the trace" if gpu else
                   f"Their all-gathers take {ag_total:.1f} ms per step (what the last rank to reach each waits in "
                   "it: on gloo the host blocks there) and their reduce-scatters, as many bytes in the same "
                   f"backward, about {rs_total:.1f} ms more")
                + f": {fmt_share(total / step)} of the step p50. Drop their fully_shard calls: each then belongs to "
                f"the unit holding it ({E.fmt_list(parents, 3)}), whose collectives carry its "
                f"{each.removesuffix(' each')} too ({len(us) - len(tiny)} units in place of {len(us)}).")
        if plug:
            text += " " + plug["text"]
        return [self.finding(
            "warning" if share >= TINY_WARN_GAIN_SHARE else "info",
            f"{title}: {total:.1f} ms of collectives per step ({fmt_share(total / step)})",
            {"units": len(us), "small_units": [u.name for u in tiny],
             "largest_small_unit_bytes": max(u.unsharded_bytes for u in tiny),
             "holding_units": parents,
             "smallest_holding_unit_bytes": min(p.unsharded_bytes for _, p in pairs),
             "per_unit": [f"{n}: {c:.2f} ms" for n, c in cost.items()],
             ("ag_exposed_ms_per_step" if gpu else "ag_wait_ms_per_step"): round(ag_total, 3),
             ("rs_exposed_ms_per_step" if gpu else "rs_estimated_ms_per_step"): round(rs_total, 3),
             "collectives_ms_per_step": round(total, 3),
             "merge_adds_ms_per_step": round(added, 3),
             "step_share_pct": round(100 * total / step, 1), "step_p50_ms": step,
             "measured_by": ("trace (exposed collectives)" if gpu else
                             "records (the last-arriving rank's all-gather waits; reduce-scatters as the backward all-gathers)")},
            text, plug.get("code", code), where=plug.get("where", ""),
            predicted=E.predicted(step, step - gain), units=[u.name for u in tiny])]


def _kept_apart(u, p) -> str:
    """Why unit ``u`` is kept apart from ``p``, the unit holding it, on purpose ("" where nothing says so): options of
    its own that merging would drop (a MoE router kept in float32 under its layer's bfloat16 policy, an offload,
    another mesh), or parameter dtypes its parent has not (merged: a unit mixing dtypes, wrap.mixed_dtype_unit)."""
    for what, a, b in (("mixed precision", (u.param_dtype, u.reduce_dtype, u.output_dtype),
                        (p.param_dtype, p.reduce_dtype, p.output_dtype)), ("offload", u.offload, p.offload),
                       ("mesh", (u.shard_size, tuple(u.shard_dims)), (p.shard_size, tuple(p.shard_dims)))):
        if a != b:
            return what
    if not set(u.orig_dtypes) <= set(p.orig_dtypes):
        return "parameter dtypes"
    return ""


def _each(sizes) -> str:
    """Sizes in words: "1.00 KiB each" where all are the same, else "1.00 KiB to 258.00 KiB"."""
    sizes = list(sizes)
    lo, hi = min(sizes), max(sizes)
    return f"{fmt_bytes(lo)} each" if lo == hi else f"{fmt_bytes(lo)} to {fmt_bytes(hi)}"


def _fine_units(us: list, small: list) -> tuple[str, str]:
    """wrap.too_fine's (title, subject of its text): the small units by their names within their blocks and their
    sizes, beside the others' (blocks where they are), each a size some unit has: "6 of 12 units are single small
    layers (mlp.gate, 1.00 KiB each) beside 6 blocks of 432.50 KiB". (Its text read "12 units with a median of
    216.75 KiB each", the mean of the two middle sizes, under the title "most of them single layers", where half
    were whole decoder layers: a new-user trial's MoE routers, each its own unit.)"""
    def rel(u) -> str:  # the unit's module(s) within its block: "mlp.gate" for "model.layers.0.mlp.gate"
        m = S.strip_ckpt(u.modules[0]) if len(u.modules) == 1 else u.name
        b = E.block_of(m)
        return m[len(b) + 1:] if b and m != b else m

    leaves = all(len(u.modules) <= 1 and u.n_params <= FINE_LEAF_TENSORS for u in small)
    tiny = all(u.unsharded_bytes < FINE_SMALL_BYTES for u in small)
    what = ("single small layers" if tiny else "single layers") if leaves else "small units"
    kinds = list(dict.fromkeys(rel(u) for u in small))
    sizes = _each(u.unsharded_bytes for u in small)
    named = f"{E.fmt_list(kinds)}, {sizes}"
    others = [u for u in us if u not in small]
    if not others:  # the title names the kinds where they are few (a leaf-wrapped GPT's 6 read as a list)
        said = f"All {len(us)} units are {what} ({named})"
        short = said if len(kinds) <= 2 else f"All {len(us)} units are {what} ({sizes})"
        return f"{short}: latency-bound collectives", said
    blocks = all(len(u.modules) == 1 and E.block_of(u.modules[0]) == S.strip_ckpt(u.modules[0]) for u in others)
    kind = ("block" if blocks else "larger unit") + ("s" if len(others) != 1 else "")
    size = _each(u.unsharded_bytes for u in others)
    said = (f"{len(small)} of {len(us)} units are {what} ({named}) beside {len(others)} {kind} of "
            f"{size.removesuffix(' each')}")
    return said, said


@register
class ParamsInRoot(Rule):
    code = "wrap.params_in_root"
    name = "Parameters left in the root"
    description = "A material share of the parameters sits in the root unit, gathered for the whole step."
    needs = ("units", "sharded")  # (a 2x1 HSDP mesh: no all-gather, nothing held gathered)
    severities = ("info", "warning")

    def match(self, ctx: Context):
        allu = E.units(ctx)
        us = E.param_units(ctx)
        rts = E.roots(us)
        others = E.non_root(us)
        total = E.total_params(us)
        if len(rts) != 1 or not others or total <= 0:
            # (a root unit without parameters read "no root unit" beside root_not_sharded's "the root module is an
            # FSDP unit": a new-user trial)
            return self.quiet("several roots: wrap.root_not_sharded says it" if len(rts) > 1 else
                              "the root is the only unit: wrap.too_coarse says it" if rts else
                              "the root unit holds no parameters" if E.roots(allu) else "no root unit")
        root = rts[0]
        share = root.param_count / total
        if share < ROOT_SHARE_MIN:
            return self.quiet(f"the root holds {fmt_share(share, 1, ROOT_SHARE_MIN)} of the parameters "
                              f"(fires from {100 * ROOT_SHARE_MIN:.0f}%)")
        own = [m for m in root.own_modules if m]
        # an output head the model calls once per chunk of the sequence stays in the root as tied modules do (as in
        # the plans: snippets.tree)
        # (and so do modules whose parameters are read outside their forward)
        chunked, unread = S.per_chunk(ctx.config, root), S.read_outside_forward(root)
        if chunked or unread:
            root = msgspec.structs.replace(root, tied_modules=[*root.tied_modules, *chunked, *unread])
        staying = _staying_words(root, chunked, ctx, unread)
        if own and set(own) <= set(root.tied_modules):  # what the snippet would move: nothing (rerun on a tied model)
            return self.quiet(f"the root's parameters are those of {staying}: they stay in the root")
        tied = [m for m in own if m in root.tied_modules]
        # beside tied modules the root stays gathered anyway: what would gain less as units of their own than their
        # collectives cost stays there with them (snippets.leftover_stays, from this run's peak, step and waits)
        costs = _leftover_costs(ctx)  # (the plan below weighs the same)
        tree = S.tree(ctx)
        groups, head_of = S.kept_in_root(tree, costs)
        # the modules as the plan names them: each collapsed to the one it shards (a module, not its children)
        conts = tree.containers()
        heads = lambda ms: list(dict.fromkeys(head_of.get(m, m) for m in ms))  # noqa: E731

        def named(ms: list[str]) -> str:  # (blocks left in the root: their containers, each module named 30 times)
            return E.fmt_list(S.as_planned(ms, conts, head_of))
        kept = [m for ms, _ in groups for m in ms]
        if kept and all(m in kept or m in tied for m in own):  # (blocks left in the root are neither)
            return self.quiet(f"the root's parameters are those of {staying}, which stay there, and of modules "
                              "that gain less as units of their own than they cost: " + _kept_words(groups, heads)
                              if tied else
                              f"the root's parameters are those of modules that gain less as units of their own than "
                              f"they cost: {E.fmt_list(heads(kept))}, each a unit, and one unit of them all "
                              f"{groups[0][1]}")
        movable = _movable_share(root, kept)
        if share * movable < ROOT_SHARE_MIN:  # a tied embedding and head are most of it (T5's shared embedding)
            if not tied and not chunked:  # nothing tied: what stays is what costs more as units than it frees
                # (a Wav2Vec2's projection, positional conv and head read "those of tied modules stay there": a trial)
                rest = [m for m in own if m not in kept]
                # (weighed together where the root has no parameters of its own to be gathered for anyway: one why)
                why = (f"{E.fmt_list(heads(kept))} gain less as units of their own than they cost (each a unit, and "
                       f"one unit of them all, {groups[0][1]})" if len({str(w) for _, w in groups}) == 1 else
                       _kept_words(groups, heads))
                return self.quiet(f"{fmt_share(share)} of the parameters are in the root: {why}; the rest"
                                  + (f", {named(rest)}," if rest else "") + f" is {100 * share * movable:.2f}% "
                                  f"(fires from {100 * ROOT_SHARE_MIN:.0f}%)")
            return self.quiet(f"{fmt_share(share)} of the parameters are in the root, but those of {staying} stay "
                              f"there; the rest is {100 * share * movable:.2f}%"
                              + (f", of which {E.fmt_list(heads(kept))} stay too" if kept else ""))
        # the gathered copy beside the shard; under a 16-bit param_dtype on 2 ranks it can equal the fp32 shard's
        # size (a torchtitan llama: difference 0), and the root is still gathered for the whole step; tied modules
        # (and what stays with them) stay in the root gathered: only the rest is freed
        held = int(max(0, root.unsharded_bytes - root.sharded_bytes) * movable) or _freed_gathered(root, kept)
        step, peak = _job_numbers(ctx)
        moved = [m for m in own if m not in root.tied_modules and m not in kept]
        # where a torchtune recipe shards the model, its config names the new units (each alone); what is too small
        # to be one stays in the root with what the plan keeps
        tune = _torchtune_layers(ctx, root, others, moved)
        small = [m for m in moved if tune is not None and m not in tune]
        moved = [m for m in moved if m not in small]
        # the new units' copies where they run, from the peak step's timeline; without one, the copy off the peak
        peak_after = _peak_after_plan(ctx, root, others, [*kept, *small], peak, conts)
        if peak_after is not None and peak - peak_after < ROOT_PEAK_GAIN_MIN * peak:
            # what the plan frees where the peak is, from the peak step's timeline (exact to the byte where pasted):
            # a DiT whose root kept its patch embedding and output projections (5.3% of the parameters) read a warning
            # "peak 1.02 MiB -> 1.02 MiB"; its plan pasted, 1,072,148 -> 1,064,692 B as predicted (0.7%), for two
            # units more of collectives: a new-user trial. (Without a timeline, the copy off the peak stays the
            # estimate: below what a fix measured on a GPU trace, GPT-2's wpe, 0.6% against 1.2%.)
            return self.quiet(f"{fmt_share(share)} of the parameters are in the root, but making "
                              f"{named(moved)} units of their own would lower the "
                              f"peak by {fmt_bytes(max(0, peak - peak_after))}, "
                              f"{fmt_share(max(0, peak - peak_after) / peak, 1, ROOT_PEAK_GAIN_MIN)} of the "
                              f"{fmt_bytes(peak)} peak (worth it from {100 * ROOT_PEAK_GAIN_MIN:g}%; as the peak step "
                              "of the rank with the lowest peak shows it on its memory timeline)")
        ceiling, freed = False, 0  # (the blocks' estimate: a ceiling, _blocks_freed)
        if peak is not None and peak_after is None:
            freed = _blocks_freed(root, [*kept, *small], conts)
            peak_after, ceiling = peak - max(held, freed), freed > held
        t = root.timing
        wrapped = {m for u in allu if not u.is_root for m in u.modules}
        passed_on = getattr(ctx.config, "recipe_custom_layers", None) is not False
        # under accelerate's plugin, blocks left in the root are its policy's doing (no policy, or none matched;
        # accelerate gives the embedding and the final norm and head units of their own)
        # (blocks of the tree's containers: a Qwen2.5-VL's merger.mlp, an nn.Sequential(Linear, GELU, Linear), is
        # none, and read "the blocks model.visual.merger.mlp.0, ..." above the plugin's policy the run already had)
        blocks = list(dict.fromkeys(S.block_of(m) for m in root.own_modules if S.container_of(m, conts) is not None))
        plug = _plugin_wrap(ctx, "left the blocks in the root (no policy, or none that matched them)") \
            if blocks else {}
        # the plugin's policy matched the blocks and left other modules in the root (a Qwen2.5-VL's vision merger,
        # between its block stacks): the user shards them before prepare(), which shards the rest around them (a plan
        # of every fully_shard call read "in place of your fully_shard calls" to an accelerate user, who has none)
        lever = E.plugin_lever(ctx) if not blocks and tune is None else None
        # the fix: every module holding the root's parameters a unit of its own (tied ones stay, and the kept ones),
        # the run's units as they were; under the plugin those modules alone, before prepare()
        code = (S.plugin_leftovers(tree, lever, costs) if lever else _root_plan(ctx, costs) if tune is None else
                S.torchtune_layers(tune, passed_on))
        # (a root given reshard_after_forward=True is resharded after its forward: a new-user trial's report said
        # it was not, beside reshard.last_unit saying it was; its forward and backward span the model's all the same)
        held_text = ("The root is not resharded after forward, so these stay gathered from the first forward to the "
                     "end of backward, and their all-gather is the first of the step with nothing to overlap."
                     if root.reshard_after_forward is not True else
                     "The root is resharded after its forward here, but its forward and its backward span the whole "
                     "model's: these stay gathered through every block's forward and backward, and their all-gathers "
                     "are the first of each with nothing to overlap.")
        text = (f"The root unit manages {fmt_bytes(root.unsharded_bytes)} of parameters outside the wrapped units: "
                f"the blocks {E.fmt_list(blocks)} among them. {held_text} {plug['text']}" if plug else
                f"The root unit manages {fmt_bytes(root.unsharded_bytes)} of parameters outside the wrapped "
                f"units. {held_text} "
                + ("Make them units of their own " if lever else
                   "Wrap them as units of their own before wrapping the root ")
                # named as the snippet names them, from the user's `model` (the fqns "model.embed_tokens, lm_head" read
                # beside code on model.model.embed_tokens and model.lm_head: a new-user trial's CausalLM)
                + f"({named(moved)}"
                # (a transformer's embeddings, final norm and head, said of a U-Net's mid block: a new-user trial)
                + ("; modules tied to another one, such as an output head sharing the embedding's weight, must "
                   "stay together: the snippet leaves them in the root" if set(root.tied_modules) - set(chunked) else
                   "")
                + (f"; {named(kept)} stay in the root: units of their own would gain less than their collectives "
                   "cost" + (" (the snippet says why)" if tune is None else "") if kept else "") + ").")
        if lever:
            says, prepares = S.plugin_says(lever)
            text += (f" {says}, the plugin's auto-wrap policy made each block a unit and left these in the root: "
                     f"sharded by you before {prepares}, each is a unit of its own, and the plugin shards the rest "
                     "around them (it leaves a module already sharded as it is).")
        if chunked:
            text += _PER_CHUNK.format(E.fmt_list([S.module_expr(m) for m in chunked]), ctx.config.output_chunks)
        if tune is not None:
            text += (f" torchtune's recipe ({E.torchtune_recipe(ctx)}) shards the model from its config "
                     "(training.shard_model: each layer, then each module custom_sharded_layers names, then the root):"
                     " name them there" + (f"; {E.fmt_list([S.module_expr(m) for m in small])} "
                                           f"{'stays' if len(small) == 1 else 'stay'} in the root, too small to gain "
                                           "from a unit of its own" if small else "") + ".")
            if not passed_on:
                text += (" Its setup() does not pass custom_sharded_layers on to the _setup_model that builds this "
                         "model (torchtune's knowledge distillation passes it to its teacher's only): add it to that "
                         "call, as the lines below say, or the config line changes nothing here.")
        # the step: on a GPU the new units' all-gathers overlap the compute as the blocks' do (unchanged); on gloo each
        # new unit adds collectives of its own that the host's cores run beside the compute, at a fixed cost per call
        # (a new-user trial's 2-rank Qwen2 measured +63% and +85% where "unchanged" was predicted): not predicted
        cpu = not E.on_gpu(ctx)
        if cpu:
            text += (" On gloo each new unit adds all-gathers and reduce-scatters of its own, which share the host's "
                     "cores with the compute: the step time is not predicted (the gain is the memory).")
        # the gain is memory only: a warning where memory matters (the peak near capacity, a tenth of it or more
        # freed, or the capacity unknown), a note where a small share of a peak far below a known capacity is freed
        # (a new-user trial's CLIP, its peak at 2% of 200 MiB: a warning for 4.18 -> 4.08 MiB)
        cap = E.capacity_bytes(ctx)
        note = bool(cap and peak and peak_after is not None and not E.peak_near_capacity(ctx)
                    and peak - peak_after < T.HEADROOM_WARN_GAIN_SHARE * peak)
        if note:
            text += (f" A note: the plan frees {fmt_share((peak - peak_after) / peak, 1)} of a peak at "
                     f"{fmt_share(peak / cap, 1)} of the {fmt_bytes(cap)} capacity (a warning from "
                     f"{100 * T.HEADROOM_WARN_GAIN_SHARE:g}% of the peak, or with the peak near capacity).")
        return [self.finding(
            "info" if note else "warning", f"{fmt_share(share)} of the parameters are left in the root unit",
            {"root_param_share_pct": round(100 * share, 1), "root_param_count": root.param_count,
             "root_unsharded_bytes": root.unsharded_bytes, "held_gathered_bytes": held,
             **({"blocks_freed_bytes": freed} if ceiling else {}),
             "root_ag_wait_fwd_ms": t.ag_wait_fwd_ms,  # (a straggler's own: E.late_rank)
             "read_on_straggler": None if (late := E.late_rank(ctx)) is None else int(late.rank),
             "wrapped_units": len(others),
             "wrapped_examples": sorted(wrapped)[:6]},
            text, plug.get("code", code),
            where=plug.get("where", lever or ("torchtune_config" if tune is not None else "")),
            inputs={"model": "your model, before accelerator.prepare(model) and the optimizer"}
            if lever == "accelerate" and not plug else None,
            predicted=E.predicted(step, None if cpu else step, peak, peak_after, peak_at_most=ceiling), units=[""])]


def _kept_words(groups: list, heads) -> str:
    """Why each group of the root's modules stays there beside tied modules (``snippets.kept_in_root``'s groups,
    ``heads`` naming their modules as the plan does): groups whose units would cost the same said once, with each
    one's bytes (Whisper's six small modules read the same cost six times, 20 lines of ``--explain``)."""
    said: dict = {}  # what the share is of and the cost -> [(names, how many, parts, why)], in order
    for ms, why in groups:
        p = getattr(why, "parts", None)
        said.setdefault(p[2:] if p else why, []).append((E.fmt_list(heads(ms)), len(heads(ms)), p, why))
    out = []
    for key, xs in said.items():
        if len(xs) == 1 or not xs[0][2]:
            out += [f"{names}, a unit of {'its' if n == 1 else 'their'} own, {why}" for names, n, _, why in xs]
        else:
            of, rest = key
            out.append(", ".join(f"{names} {p[0]} ({p[1]})" for names, _, p, _ in xs)
                       + f": each, a unit of its own, would free at most that share of {of}{rest}")
    return "; ".join(out)


def _torchtune_layers(ctx: Context, root, others, moved: list[str]) -> list[str] | None:
    """Where a torchtune recipe drove the run and its config can say the plan (the root's own modules before the
    layers, each a unit of its own): the modules its custom_sharded_layers names, those already units of their own
    beside the layers (named there before) and those of ``moved`` holding TUNE_LAYER_MIN_SHARE of what moves; None:
    not such a run, or blocks left in the root (the recipe shards every ``layers.N``: another model's layout)."""
    if E.torchtune_recipe(ctx) is None or any(S.block_of(m) for m in moved):
        return None
    sizes = dict(zip(root.own_modules or [], root.own_bytes or []))
    total = sum(sizes.get(m, 0) for m in moved)
    new = [m for m in moved if not total or sizes.get(m, 0) >= TUNE_LAYER_MIN_SHARE * total]
    named = sorted({m for u in others for m in u.modules if m and S.block_of(m) is None})
    return [*named, *new] if new else None


# why a chunked output head stays in the root: a new-user trial's torchtune full_finetune_distributed (8 chunks, 2
# gloo ranks) with `output` a unit of its own aborted at its second step resharded after forward ("Received data size
# doesn't match expected size": 16384 vs 64 B) and hung kept gathered, with or without the doctor
_PER_CHUNK = (" {} stays in the root: the model calls it once per chunk of the sequence (num_output_chunks={}, "
              "torchtune's chunked output for CEWithChunkedOutputLoss), as many calls as each rank's sequence length "
              "splits into, and a unit of its own would follow the calls with its collectives: ranks whose sequences "
              "split differently issue different collectives (measured on gloo: the run aborted, or hung where the "
              "unit was kept gathered after forward).")


def _staying_words(root, chunked: list[str], ctx: Context, unread: list[str] = ()) -> str:
    """The root's modules that stay in it, said: tied modules, an output head called once per chunk, and modules
    whose parameters are read outside their forward (``unread``: snippets.read_outside_forward)."""
    tied = [m for m in root.tied_modules if m not in chunked and m not in unread]
    return " and ".join(([f"tied modules ({E.fmt_list(tied)})"] if tied else []) + (
        [f"{E.fmt_list(chunked)}, called once per chunk of the sequence (num_output_chunks="
         f"{ctx.config.output_chunks})"] if chunked else []) + (
        [f"{E.fmt_list(list(unread))}, whose parameters the run read outside their forward (as a unit of their "
         "own they would not be gathered there)"] if unread else [])) or "tied modules"


def _after_forward_floor(ctx: Context, root, pair: int, groups) -> int | None:
    """A floor under a whole-model unit's peak once its plan splits it (wrap.too_coarse): from the end of its forward
    to its backward's start (the loss) the plan's units hold the trailing unit (the final norm and head, kept gathered
    after forward) and what stays in the root (tied modules, the small groups kept there) where the whole unit held
    all of its gathered parameters and all-gather buffers; every other byte of those marks stays. Its backward's
    high-water mark holds that too where its temporaries are the forward's end's or more (the logits' gradients beside
    them: the loss's backward, which a whole model's pre-backward hook precedes, and the head's, both before the
    trailing unit reshards; an HF Llama of a 4,096-token vocabulary split measured its peak there, 22,360,924 B), else
    the smaller of that and a pair of blocks (``pair``: their own bytes) with what stays in the root beside them
    (``groups``: snippets.leftover_groups, how the plan groups the root's other modules). A new-user trial's Jamba
    (labels=, 2 gloo ranks) read 30.60 -> 27.34 MiB from the pair of blocks gathered at the peak: its peak moved into
    the loss, 28.45 MiB measured (a GPT whose logits read its embedding, 9.83 predicted, 10.58 measured). None without
    the peak step's timeline or the root's module sizes."""
    pm = E.peak_memory(ctx)
    tl = (pm.timeline or []) if pm is not None and pm.timeline_step == pm.peak_at.step else []
    sizes, stored = _root_sizes(root)
    end = next((i for i, r in enumerate(tl) if r.get("unit") == root.name and r.get("phase") == "forward_end"), None)
    if end is None or not sizes or stored <= 0:
        return None
    start = next((i for i in range(end, len(tl)) if tl[i].get("phase") == "backward_start"), None)
    high = next((i for i in range(end, len(tl)) if tl[i].get("phase") == "in_backward"), None)
    if start is None or high is None:
        return None
    # what stays in the root (the groups kept there, and tied modules: with them those read outside their forward, an
    # MPT-style GPT's wte) and the trailing unit, in their stored bytes
    stay = groups.nbytes([h for hs, _ in groups.small for h in hs]) + sum(sizes.get(m, 0) for m in groups.skip)
    gathered = lambda b: int(root.unsharded_bytes * min(1.0, b / stored))  # noqa: E731 (own bytes, as gathered)
    after = gathered(groups.nbytes(groups.tail) + stay)
    logits = int(tl[high].get("temporaries") or 0) >= int(tl[end].get("temporaries") or 0) > 0
    held = {**{i: after for i in range(end, start + 1)}, high: after if logits else min(after, gathered(pair + stay))}
    added = [held[i] - int(r.get("unsharded_params") or 0) - int(r.get("comm_buffers") or 0) if i in held else
             -int(r.get("total") or 0) for i, r in enumerate(tl)]
    return E.peak_with_rows(pm, added)


def _root_sizes(root) -> tuple[dict[str, int], int]:
    """The root's own modules' parameter bytes ({fqn: bytes}, from its snapshot) and all of its parameters' bytes in
    their stored dtype, padding aside (its shard times the shard group's size)."""
    return dict(zip(root.own_modules or [], root.own_bytes or [])), root.sharded_bytes * (root.shard_size or 0)


def _freed_gathered(root, kept=()) -> int:
    """Where the gathered copy equals the shard (a 16-bit param_dtype on 2 ranks; the estimate above reads 0 B): the
    bytes of the gathered copy the plan frees after forward, those of the root's own modules that become units, in the
    dtype they are gathered in; not those of tied modules (they stay in the root) nor those after the blocks (the final
    norm and head: one unit kept gathered after forward). A new-user trial's 2-rank LM under a bfloat16 param_dtype
    (root: embedding, norm, head; 40% of the parameters) read a warning predicting "peak 1.26 MiB unchanged"; its fix
    pasted freed the embedding's gathered copy, 32,768 B: peak 1,286,880 -> 1,254,112 B measured, as now predicted.
    (Elsewhere the estimate above stays: it is checked by the fixes rerun on HF, accelerate and the scenario matrix.)"""
    sizes, stored = _root_sizes(root)
    if not sizes or stored <= 0 or root.leading_modules is None:
        return 0
    skip = set(root.trailing_modules or []) | set(root.tied_modules or []) | set(kept)
    freed = sum(b for m, b in sizes.items() if m and m not in skip)
    return int(root.unsharded_bytes * min(1.0, freed / stored))


def _blocks_freed(root, kept, conts) -> int:
    """Where the root holds blocks of a container (no timeline figure: ``_peak_after_plan``), what the plan frees
    wherever the peak is in the step: the root's gathered copy of every module it moves to units of their own, less
    the largest moved block's (a block gathered where the peak is), in the dtype they are gathered in; 0 without
    blocks or the root's module sizes. Where it exceeds the copy off the peak (the gathered copy less the shard),
    the peak after is a ceiling: what the blocks cost in the root besides (the root's temporaries where the peak
    was, their gradients held to the end of backward) is not counted. A diffusers Flux whose every block
    accelerate's plugin left in the root (no policy): the copy off the peak 4.15 MiB, this estimate 6.03, its fix
    pasted freed 14.98 MiB of 110.30; the plugin tests' Flux: 1.05 and 1.52, and 3.73 MiB of 13.38 freed. An HF
    Llama's two layers in the root: 9.00 MiB both, 4.29 MiB of 64.84 freed (the copy off the peak stays)."""
    sizes, stored = _root_sizes(root)
    stay = set(root.tied_modules or []) | set(kept)
    blocks: dict[str, int] = {}
    for m, b in sizes.items():
        if m and m not in stay and S.container_of(m, conts) is not None:
            blk = S.block_of(m)
            blocks[blk] = blocks.get(blk, 0) + b
    if not blocks or stored <= 0:
        return 0
    moved = sum(b for m, b in sizes.items() if m and m not in stay)
    return int(root.unsharded_bytes * min(1.0, (moved - max(blocks.values())) / stored))


def _peak_after_plan(ctx: Context, root, blocks, kept, peak, conts=None) -> int | None:
    """The job's peak once the plan has made the root's modules units of their own: the peak less the gain the peak
    step of the rank with the lowest peak shows on its timeline (``_peak_as_units``; the highest rank's where that
    one gives no figure). FSDP's ranks run one model on equal shards, and what differs between their timelines is
    timing: on gloo a finished all-gather's output is freed when gloo's worker thread is next scheduled, which
    raises one rank's peak and can move it. A torchtitan llama on 2 ranks (bf16, blocks and root only) saw one
    rank's peak move into the loss by a 73,984 B gathered copy held there from the first block's forward on, where
    the plan frees the embedding's copy: 2.69% of that rank's peak, -0.01% of the other's, whose peak stayed in the
    last block's backward; read on the highest rank the rule warned in 1 of 6 runs of the same row (and in CI). The
    least gain of all ranks then read 0 B on an HF Llama whose head the plan frees where the peak is (2.6%): its
    disturbed rank's peak had moved (CI's long tier missed the row's planted finding). None where no rank's
    timeline gives a figure."""
    pm = E.peak_memory(ctx)
    if peak is None or pm is None:
        return None
    conts = S.tree(ctx).containers() if conts is None else conts  # (the plan's block containers)
    if any(S.container_of(m, conts) is not None for m in [*(root.leading_modules or []), *(root.trailing_modules or [])]
           if m not in kept):
        # blocks the plan makes units of their own before or after the wrapped ones (a diffusers Flux wrapped by its
        # double-stream blocks alone: its single-stream blocks ran after them in the root), each gathered where it
        # runs and not one leading or trailing unit: the timeline read them as one trailing unit, held gathered from
        # the last wrapped block's forward end, and the plan as freeing 0 B where its pasting freed 4.15 MiB of 99.53
        return None
    calm = min((m for m in E.memory_per_rank(ctx).values() if m.timeline), key=lambda m: m.peak_bytes, default=pm)
    for m in (calm, pm):
        if (after := _peak_as_units(m, root, blocks, kept)) is not None:
            return peak - (m.peak_bytes - after)
    return None


def _peak_as_units(pm, root, blocks, kept=()) -> int | None:
    """The peak (bytes) of the peak step ``pm`` once the plan has made the root's modules units of their own, from
    its timeline: at each mark the root's gathered copy, held the whole step, gives way to what the new units hold
    there, and the new peak is the highest mark. The leading units (the embeddings) are gathered from the root's
    forward start to the first block's, and from that block's backward start on (prefetched there); the trailing one
    (the final norm and head, kept gathered after forward) from the last block's forward end to the first block's
    backward start; tied modules and the root's own parameters stay in the root as they were. The root's all-gather
    buffers before its forward shrink to those of what is gathered there. Where the loss is computed in the model's
    forward (no loss phase between the model's return and the root's backward: Hugging Face's ``labels=``) and the
    root keeps nothing, the first block's all-gather, which the root's pre-backward prefetched before the loss's
    backward, is issued by the trailing unit after it. The trailing modules' gradients are reduce-scattered by their
    own unit after their backward (not by the root at the end of it): their shard held from then on, their unsharded
    ones in the reduce dtype until the first block's reduce-scatter, then freed (a backward making fresh gradient
    shards). A new-user trial's 4-layer HF Llama (labels=, 2 gloo ranks) read 5.08 -> 4.96 MiB (the root's copy
    less its shard, at the old peak); its fix measured 4.80 MiB, the peak moved into the loss with the 160.50 KiB
    prefetch gone beside the embedding's 128 KiB: 5,034,340 B, as now predicted. None without a timeline showing
    the root's forward, or without the root's module sizes."""
    tl = pm.timeline or []
    sizes, stored = _root_sizes(root)
    name, bl, full, n = root.name, {u.name: u.unsharded_bytes for u in blocks}, root.unsharded_bytes, len(tl)
    at = lambda j, unit, phase: tl[j].get("unit") == unit and tl[j].get("phase") == phase  # noqa: E731
    if not sizes or stored <= 0 or full <= 0 or root.leading_modules is None or not any(
            at(j, name, "forward_start") for j in range(n)):
        return None
    tied = set(root.tied_modules or []) | set(kept)  # (and what the plan keeps beside them)
    trailing = {m for m in root.trailing_modules or [] if m and m not in tied}
    leading = [m for m in sizes if m and m not in tied and m not in trailing]
    if any(sizes[m] for m in leading if m not in root.leading_modules):
        return None  # modules between the units (blocks left in the root): gathered where they run, not shown
    share = lambda ms: min(1.0, sum(sizes.get(m, 0) for m in ms) / stored)  # noqa: E731
    # gathered bytes (the root's dtype) of the new leading units, the trailing one, and what stays in the root
    lead, trail = int(full * share(leading)), int(full * share(trailing))
    stay = max(0, full - lead - trail)
    # the trailing modules' gradients: computed (trainable ones), reduce-scattered (upcast to the reduce dtype), shard
    computed = full if root.trainable_unsharded_bytes is None else root.trainable_unsharded_bytes
    g_full = min(computed, trail)
    g_upcast = int(g_full * (E.grad_unsharded_bytes(root) / computed - 1)) if computed else 0
    g_shard = min(E.grad_shard_bytes(root), int(root.sharded_bytes * share(trailing)))
    more, f = [False] * n, False  # whether a block's forward starts after the row, in the same forward
    for i in range(n - 1, -1, -1):
        more[i] = f
        ph = tl[i].get("phase")
        f = (tl[i].get("unit") in bl and ph == "forward_start") or (
            f and ph != "backward_start" and not (at(i, name, "forward_start") or at(i, name, "forward_end")))
    added = [0] * n
    state, bwd, resharded, first, loss, early, nxt, grads = "out", False, False, None, None, 0, None, 0
    for i, r in enumerate(tl):
        unit, ph = r.get("unit"), r.get("phase")
        if unit == name and ph == "forward_start":
            state, bwd, first, loss = "lead", False, None, None
            if i and str(tl[i - 1].get("phase") or "").startswith("in_"):  # the root's all-gather before it
                added[i - 1] -= int(E.gather_transient(tl, i, full) * (1 - (stay + lead) / full))
        elif ph == "loss_start":
            loss = i
        elif unit == name and ph == "forward_end":
            resharded = root.reshard_after_forward is True  # (torch honours it on a root)
        elif unit == name and ph == "backward_start":
            bwd, resharded = True, False
            end = next((j for j in range(i, n) if at(j, name, "backward_end")), n)
            nxt = next((tl[j].get("unit") for j in range(i, end) if tl[j].get("unit") in bl
                        and tl[j].get("phase") == "backward_start"), None)
            in_forward = loss is not None and not any(tl[j].get("phase") == "in_loss" for j in range(loss, i))
            early = bl.get(nxt, 0) if in_forward and not stay else 0
            # gradient shards made in this backward (reduce-scattered: not under no_sync), none held before it
            until = next((j for j in range(i, n) if at(j, name, "forward_start")), n)
            fresh = not r.get("sharded_grads") and any(tl[j].get("sharded_grads") for j in range(i, until))
            grads = g_shard + g_upcast if fresh else 0
        elif unit in bl and not bwd and ph == "forward_start":
            state, first = "blocks", first or unit
        elif unit in bl and not bwd and ph == "forward_end" and not more[i]:
            state = "trail"
        elif unit in bl and ph == "backward_start":
            bwd, early = True, 0
            # the first block in forward prefetches the leading unit (not where its backward never runs: frozen)
            state = "lead_bwd" if unit == first or state == "lead_bwd" else "blocks"
        held = {"lead": lead, "trail": trail, "lead_bwd": lead}.get(state, 0)
        gone = (0 if state == "out" or resharded else full - stay) - held
        added[i] -= min(gone, int(r.get("unsharded_params") or 0)) if gone > 0 else gone
        added[i] -= min(early, int(r.get("comm_buffers") or 0))
        if bwd and state != "trail":
            added[i] += grads
        if grads and unit == nxt and ph == "backward_end":  # the first block's reduce-scatter frees theirs
            grads, nxt = g_shard - g_full, None
        if unit == name and ph == "backward_end":
            state, grads = "out", 0
    return E.peak_with_rows(pm, added)


def _movable_share(root, kept=()) -> float:
    """The share of the root's parameters a plan can move to units of their own: all but those of tied modules
    (which stay together in the root) and the ``kept`` ones beside them, from the snapshot's own-module sizes; 1
    without tied modules or sizes."""
    tied = set(root.tied_modules or []) | set(kept)
    sizes, stored = _root_sizes(root)
    if not tied or not sizes or stored <= 0:
        return 1.0
    return min(1.0, sum(b for m, b in sizes.items() if m and m not in tied) / stored)


@register
class RootNotSharded(Rule):
    code = "wrap.root_not_sharded"
    name = "Root never sharded"
    description = "Blocks were wrapped but fully_shard was never applied to the root module."
    needs = ("records|trace",)
    severities = ("warning", "critical")

    def match(self, ctx: Context):
        if not E.units(ctx):
            if ctx.report.overlap is None or not ctx.report.overlap.per_rank:
                return self.skip(NEEDS["units"].missing)
            return self._from_plain_trace(ctx)
        allu = E.units(ctx)
        us = [u for u in allu if u.param_count > 0 or u.is_root]
        if len(us) < 2:
            return self.quiet("one unit: nothing left unsharded beside it")
        rts = E.roots(us)
        nested = [u for u in us if u.parent is not None or u.depth > 0]
        if len(rts) < 2 and (nested or any(not u.modules or "" in u.modules for u in us)):
            return self.quiet("the root module is an FSDP unit")
        cfg = ctx.config
        if len(rts) > 1 and getattr(cfg, "model_has_forward", None) is False:
            # (a wrapper holding a teacher and its student: its fix, a unit of the wrapper, changed nothing, the
            # wrapper never being called: a new-user trial)
            return self.quiet(f"the watched module has no forward() of its own: its {len(rts)} models are called one "
                              "by one, each its own FSDP root, as they should be (give watch() the model you train)")
        unmanaged = cfg.unmanaged_param_bytes if cfg is not None else 0
        step, peak = _job_numbers(ctx)
        # each root stays gathered from its forward to its backward (ZeRO-2-like); with a real root only the
        # block computing (and the one prefetched) would be gathered
        # (a root given reshard_after_forward=True explicitly reshards: torch honours it, and the records say so)
        kept = [u for u in rts if E.kept_gathered(u)]
        extra = sorted((u.unsharded_bytes - u.sharded_bytes for u in kept), reverse=True)
        # every root is gathered from its forward on; with a real root only the block computing is (and the one
        # prefetched), and the root's parameters (those no unit managed: replicated until now) are gathered and
        # sharded: +1/ws of them, while their optimizer state shrinks to 1/ws (its share per parameter byte from
        # the breakdown). ws: the blocks' shard group, whose mesh the fix shards the root on; under tensor
        # parallelism or HSDP smaller than the world (the world, 4, on a dp 2 x tp 2 mesh predicted 2,371,272 B
        # for 2,528,220 measured; the dp group, 2: 2,469,980 B, what the rerun held at the old peak's mark)
        groups = [u.shard_size for u in us if u.shard_size and u.param_count]
        ws = max(1, max(groups) if groups else (cfg.world_size if cfg is not None else 1))
        bd = E.breakdown(ctx)
        state_per_byte = (bd.get("optimizer_state") or 0) / bd["sharded_params"] if bd.get("sharded_params") else 0
        own = unmanaged or 0
        peak_after = (_peak_under_a_root(E.peak_memory(ctx), rts) + own / ws - state_per_byte * own * (1 - 1 / ws)
                      if peak is not None else None)
        # and the backward all-gathers come back: roughly the forward waits again
        refetch = sum(E.ag_wait_ms(u, "forward") for u in rts[1:])
        step_after = step + refetch if step is not None else None
        names = [u.name for u in rts] or [u.name for u in us]
        sev = "critical" if unmanaged > 0 else "warning"
        text = (f"{len(rts)} units are each their own FSDP root ({E.fmt_list(names)}): fully_shard was applied "
                "to the blocks but not to the model. "
                + ("Every root keeps its parameters gathered after forward (FSDP's default for a root), so all "
                   "blocks are unsharded at once at the start of backward." if len(kept) == len(rts) else
                   f"{len(kept)} of them keep their parameters gathered after forward (FSDP's default for a root; "
                   "the others were given reshard_after_forward=True), so those blocks are unsharded at once at the "
                   "start of backward." if kept else
                   "Each was given reshard_after_forward=True, so none stays gathered; but each root all-gathers on "
                   "its own, with no prefetch from one root to the next, and its own lazy initialization."))
        if unmanaged:
            text += (f" {fmt_bytes(unmanaged)} of parameters belong to no unit: they are plain replicated "
                     "tensors whose gradients are never reduced across ranks, so the replicas drift apart.")
        text += " Apply fully_shard to the root module after the blocks: one line after your own calls."
        code = ("# after your fully_shard calls on the blocks, on their mesh:\n" + S.root_mesh(ctx.config) + "\n"
                "fully_shard(model, mesh=mesh)  # the root: manages the rest and drives lazy init")
        return [self.finding(
            sev, f"fully_shard was never applied to the root: {len(rts)} independent FSDP roots",
            {"roots": names, "root_count": len(rts), "unmanaged_param_bytes": unmanaged,
             "held_gathered_bytes": sum(extra), "step_p50_ms": step},
            text, code, predicted=E.predicted(step, step_after, peak, peak_after), units=names)]


    def _from_plain_trace(self, ctx: Context):
        """A plain trace (no unit snapshot): FSDP's labels name no root, but each root runs ``FSDP::root_pre_forward``
        once a forward; several in one forward (no backward between) are several roots. A new-user trial's Llama
        with fully_shard on its 4 layers and not the model read as one "(root)" unit called 4 times a step, and "No
        findings"; its embeddings and head replicated on every rank."""
        per = {r: pr.roots_per_forward for r, pr in ctx.report.overlap.per_rank.items() if pr.roots_per_forward}
        if not per:
            return self.quiet("the trace shows no FSDP root's forward (no FSDP::root_pre_forward label)")
        n = statistics.median(per.values())
        if n < 2:
            return self.quiet(f"{n:.0f} FSDP root per forward in the trace (FSDP::root_pre_forward once a forward)")
        text = (f"The trace shows {n:.0f} FSDP roots in each forward (FSDP::root_pre_forward {n:.0f} times with no "
                "backward between): fully_shard was applied to blocks but not to the model that holds them. Each "
                "root keeps its parameters gathered from its forward to its backward (FSDP's default for a root), "
                "all-gathers with no prefetch from one root to the next, and what no block holds (embeddings, the "
                "output head, final norms) is a plain replicated tensor whose gradients are never reduced across "
                "ranks. Apply fully_shard to the model after your own calls: one line. (From a trace alone the "
                "memory it frees cannot be told: record the run with fsdp_doctor.watch for the figures.)")
        code = ("# after your fully_shard calls on the blocks, on their mesh:\n" + S.root_mesh(None) + "\n"
                "fully_shard(model, mesh=mesh)  # the root: manages the rest and drives lazy init")
        return [self.finding(
            "warning", f"fully_shard was never applied to the root: {n:.0f} FSDP roots per forward",
            {"roots_per_forward": n, "ranks": sorted(per, key=int), "measured_by": "trace (FSDP::root_pre_forward)"},
            text, code)]

def _peak_under_a_root(pm, roots) -> int:
    """The peak with the roots' blocks resharded after forward by a real root over them: at each mark of the peak
    step's timeline the gathered parameters it shows (every root's, from its forward on) become at most the two
    largest roots' (the block computing and the one FSDP prefetches), and none in the loss phase (every block
    resharded after its forward); the new peak is the highest mark. Without a timeline, the two largest stay
    gathered at the peak. (Kept at the peak, BERT's was predicted 11% high: 2,363,067 B for 2,122,096 measured,
    the peak moving from the loss phase into backward; from the timeline 2,122,043 B.)"""
    keep = sum(sorted(u.unsharded_bytes for u in roots)[-2:])
    peak, tl = int(pm.peak_bytes), pm.timeline
    if not tl:
        return peak - max(0, sum(u.unsharded_bytes for u in roots) - keep)
    totals = [int(r.get("total") or 0) for r in tl]
    after = [t - int(r.get("unsharded_params") or 0)
             + (0 if r.get("phase") in ("loss_start", "in_loss") else min(int(r.get("unsharded_params") or 0), keep))
             for t, r in zip(totals, tl)]
    return peak - max(totals) + max(after)


# Narrowest first: the dtype a MixedPrecisionPolicy should gather a mixed unit in.
_DTYPE_ORDER = ("float8_e4m3fn", "float8_e5m2", "bfloat16", "float16", "float32", "float64")


@register
class MixedDtypeUnit(Rule):
    code = "wrap.mixed_dtype_unit"
    name = "Unit mixing parameter dtypes"
    description = "A unit whose parameters have several dtypes is all-gathered byte-wise."
    needs = ("units",)
    severities = ("warning",)

    def match(self, ctx: Context):
        out, under_mp = [], 0
        for u in E.param_units(ctx):
            dts = sorted({d for d in u.orig_dtypes if d})
            if len(dts) < 2:
                continue
            if u.param_dtype:
                # a MixedPrecisionPolicy casts every parameter to param_dtype before the all-gather (frozen
                # bf16 weights beside trainable fp32 ones under a bf16 policy): one dtype on the wire
                under_mp += 1
                continue
            name = u.name or "(root)"
            rank = lambda d: _DTYPE_ORDER.index(d) if d in _DTYPE_ORDER else len(_DTYPE_ORDER)  # noqa: E731
            narrow, wide = min(dts, key=rank), max(dts, key=rank)
            out.append(self.finding(
                "warning", f"Unit {name!r} mixes parameter dtypes ({', '.join(dts)})",
                {"unit": name, "dtypes": dts, "unsharded_bytes": u.unsharded_bytes,
                 "param_count": u.param_count},
                "FSDP2 all-gathers a unit in one flat buffer; with several dtypes it falls back to a byte-wise "
                "all-gather plus per-dtype copies. A MixedPrecisionPolicy gathers every parameter in its "
                f"param_dtype ({narrow} here) without touching the stored weights (frozen low-precision "
                "weights stay as they are, trainable ones keep their dtype for the optimizer); or give the "
                "odd-dtype parameters a unit of their own.",
                # the run's whole sharding with one policy (torchtitan's way): a plan that names only this unit
                # would replace the other fully_shard calls by nothing (tested by applying it)
                S.shard_plan(S.tree(ctx), extra_kwargs=f", mp_policy={S.MP}",
                             note=f"every unit with a MixedPrecisionPolicy: parameters all-gathered in {narrow}, "
                                  f"outputs in {wide} (what the next units expect)",
                             mp_line=S.policy_line(S.MP, narrow, output_dtype=wide)),
                units=[u.name]))
        if not out:
            return self.quiet("every unit's parameters have one dtype" if not under_mp else
                              f"{under_mp} unit(s) mix dtypes under a MixedPrecisionPolicy: one dtype gathered")
        return out


@register
class UnreducedParams(Rule):
    code = "wrap.unreduced_params"
    name = "Trainable parameters outside every unit"
    description = "Trainable parameters no FSDP unit manages (ignored_params): their gradients are never reduced."
    needs = ("records",)
    severities = ("critical",)

    def match(self, ctx: Context):
        cfg = ctx.config
        names = list(getattr(cfg, "unmanaged_trainable_names", None) or []) if cfg is not None else []
        if not names:
            return self.quiet("every trainable parameter belongs to an FSDP unit")
        if len(E.roots(E.units(ctx))) > 1:  # with the same drift
            return self.quiet("several roots: wrap.root_not_sharded says it")
        # their values on every rank at the third step (RunConfig.unmanaged_digest): the same where the loop averages
        # their gradients itself (a new-user trial's did, and read CRITICAL "replicas drift apart")
        digests = {r: rd.config.unmanaged_digest for r, rd in ctx.run.ranks.items()
                   if rd.config is not None and getattr(rd.config, "unmanaged_digest", None) is not None}
        if len(digests) > 1 and len(set(digests.values())) == 1:
            return self.quiet(f"{len(names)} trainable parameter(s) outside every FSDP unit hold the same values on "
                              f"all {len(digests)} ranks at the third step: your code averages their gradients")
        apart = len(set(digests.values())) > 1
        nbytes = getattr(cfg, "unmanaged_trainable_bytes", None)
        return [self.finding(
            "critical", f"{len(names)} trainable parameter(s) outside every FSDP unit: replicas drift apart"
            + (" (their values differ across ranks)" if apart else ""),
            {"params": names[:12], "param_tensors": len(names), "trainable_unmanaged_bytes": nbytes,
             "world_size": cfg.world_size, "values_differ_across_ranks": apart if digests else None},
            f"{E.fmt_list(names, 4)} require{'s' if len(names) == 1 else ''} gradients but no FSDP unit manages "
            f"{'it' if len(names) == 1 else 'them'} (passed as ignored_params, "
            "or set on a module after fully_shard). FSDP neither shards them nor reduces their gradients, so "
            "each rank updates its own copy from its own data and the replicas drift apart"
            + (f": at the third step their values already differed across the {len(digests)} ranks. "
               if apart else ", unless your code all-reduces their gradients itself. ")
            + "Let FSDP manage them, or average their gradients before optimizer.step(), or freeze them.",
            # a hook on the optimizer, not lines in the loop: pasted once, it runs before every step (a loop
            # version pasted after the optimizer was built ran once, before any gradient existed)
            "# either drop them from ignored_params (FSDP then shards and reduces them), or average the "
            f"gradients of {E.fmt_list(names, 3)} before every optimizer.step():\n"
            "import torch.distributed as dist\n"
            "from torch.distributed.tensor import DTensor\n"
            "unmanaged = [p for p in model.parameters()\n"
            "             if p.requires_grad and not isinstance(p, DTensor)]\n"
            "def average_unmanaged_grads(opt, args, kwargs):\n"
            "    for p in unmanaged:\n"
            "        if p.grad is not None:\n"
            "            dist.all_reduce(p.grad)  # a sum (gloo has no AVG)\n"
            "            p.grad /= dist.get_world_size()\n"
            "optimizer.register_step_pre_hook(average_unmanaged_grads)",
            units=[""])]


#: TRL's trainers whose reference model TRL shards itself (trl.models.prepare_fsdp: one fully_shard call on the whole
#: model under FSDP2, no auto-wrap), by their arguments' class (RunConfig.trainer_args); a reference already sharded
#: it leaves as it is
TRL_REFERENCE_TRAINERS = {"trl.DPOConfig": "DPOTrainer"}
#: the whole reference gathered at once is a warning from this share of the device's capacity
REFERENCE_WHOLE_WARN_SHARE = 0.05


@register
class ReferenceOneUnit(Rule):
    code = "wrap.reference_one_unit"
    name = "TRL's reference model one FSDP unit"
    description = ("TRL sharded the reference model of its DPOTrainer with one fully_shard call on the whole model: "
                   "each reference forward gathers all of its parameters at once.")
    needs = ("units",)
    severities = ("info", "warning")

    def match(self, ctx: Context):
        cfg = ctx.config
        args = getattr(cfg, "trainer_args", None) if cfg is not None else None
        trainer = TRL_REFERENCE_TRAINERS.get(args or "")
        if trainer is None:
            return self.skip("not a TRL trainer with a reference model (recorded: "
                             f"{args or 'no Hugging Face Trainer'})")
        others = E.other_fsdp_units(ctx)
        if others != 1:
            return self.quiet(f"{others} FSDP2 units of another model (the reference) in the process: "
                              + ("none: no reference model (PEFT's adapters off, or precomputed log-probabilities)"
                                 if not others else "sharded in more than one unit"))
        if cfg.mesh or cfg.world_ranks:
            return self.quiet("the model's mesh is not one FSDP dimension over every rank: the reference's own mesh "
                              "is the plugin's, which this fix does not rebuild")
        units = E.param_units(ctx)
        t = S.tree(ctx)
        conts = t.containers()
        if len(units) < 2 or not conts:
            return self.quiet("the watched model is one unit too, without repeated blocks to shard apart")
        whole = sum(u.unsharded_bytes or 0 for u in units)
        largest = max(u.unsharded_bytes or 0 for u in units)
        cap = E.capacity_bytes(ctx)
        sev = "warning" if cap and whole >= REFERENCE_WHOLE_WARN_SHARE * cap else "info"
        blocks = sum(len(v) for v in conts.values())
        # the policy's plan on the reference (its header line, which says it replaces the user's calls, left out)
        plan = "\n".join(ln for ln in S.renamed(S.shard_plan(t, drop=("reshard_after_forward",)),
                                                  {S.ROOT: "ref_model"}) if S.BEFORE_SHARDING not in ln)
        code = ("from transformers import AutoModelForCausalLM\n\n"
                "# TRL shards a reference it builds with one fully_shard call on the whole model, and leaves one "
                "already sharded as it is: build it as TRL does (from the policy's checkpoint, in its dtype), its "
                "blocks sharded one by one as the policy's, and pass it to the trainer\n"
                "ref_model = AutoModelForCausalLM.from_pretrained(\n"
                "    model.config._name_or_path, dtype=model.dtype,\n"
                "    attn_implementation=model.config._attn_implementation)\n"
                + plan + "\nref_model.eval()\n"
                f"# then: {trainer}(..., ref_model=ref_model)")
        n = len(E.units(ctx))
        evidence = {"trainer_args": args, "reference_units": others, "reference_gathered_bytes": whole,
                    "policy_units": n, "policy_largest_unit_bytes": largest, "blocks": blocks,
                    "capacity_bytes": cap}
        text = (f"TRL's {trainer} shards the reference model it builds (from the policy's checkpoint) with one "
                "fully_shard call on the whole model (trl.models.prepare_fsdp under FSDP2: no wrap policy), so the "
                f"run holds 1 FSDP2 unit of another model beside the policy's {n}: each reference forward "
                f"all-gathers all of its parameters at once, about {fmt_bytes(whole)} per rank (the policy's, same "
                f"architecture and dtype), where the policy's largest unit gathers {fmt_bytes(largest)}, and keeps "
                "them until that forward ends. Built and sharded by you, block by block as the policy is, the "
                "reference is left as it is by TRL and gathers one block at a time. On a GPU that is the "
                "difference at the reference forward's peak; this run's memory figures do not hold the reference "
                "(another model's), so no peak is predicted.")
        return [self.finding(sev, f"TRL's reference model is one FSDP unit: {fmt_bytes(whole)} gathered at once "
                                  "in each reference forward", evidence, text, code, where="trl_reference",
                             inputs={"model": f"your policy model, before you pass it to {trainer}"},
                             predicted=E.predicted(E.step_ms(ctx), E.step_ms(ctx)))]
