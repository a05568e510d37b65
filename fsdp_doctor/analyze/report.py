"""Pieces of the report: the run's facts, the unit table, message sizes from the unit snapshot. The report itself
is assembled by :mod:`fsdp_doctor.pipeline`."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Optional

import msgspec

from ..records import config_notes, offloads_params, optimizer_of_another_model
from ..report_sections import OverlapSection, RunFacts, SteppedAside, UnitRow, UnitTiming
from ..store import Run
from ..units import fsdp_label, same_group
from .steps import loss_chunks, usable_steps

from ..report_sections import SCHEMA  # noqa: F401  (re-exported)


def optimizer_impl(cfg, on_host: bool = False) -> Optional[str]:
    """How torch's optimizer steps, from its groups' switches (OptimizerGroup.flags) as torch resolves them: "fused"
    where fused is set, "foreach" where foreach is or where neither is and the parameters are on CUDA (torch's
    default for them, DTensor included), else "for-loop" (the CPU's default, and CPUOffloadPolicy's: the offloaded
    shards it steps are host tensors, foreach only where every tensor of a group is on the device); "mixed" where the
    groups differ. None where no group holds the switches (another library's optimizer, or records before them).
    ``on_host``: how it would step the parameters offloaded to the host."""
    groups = [g.flags for g in getattr(cfg, "optimizer_groups", None) or []]
    if not groups or any("fused" not in f and "foreach" not in f for f in groups):
        return None
    offloaded = on_host or offloads_params(cfg)
    default = "foreach" if str(getattr(cfg, "device", "") or "").startswith("cuda") and not offloaded else "for-loop"
    impls = {"fused" if f.get("fused") else "foreach" if f.get("foreach") else
             "for-loop" if f.get("foreach") is False else default for f in groups}
    return impls.pop() if len(impls) == 1 else "mixed"


def precision_facts(units) -> tuple[str, str]:
    """The units' mixed precision and CPU offload in words, for the header ("" where no unit with parameters has
    them): a new-user trial found neither anywhere in the report of a bf16 or an offloaded run."""
    us = [u for u in units if u.param_count]
    with_mp = [u for u in us if u.param_dtype or u.reduce_dtype]
    pol = {(u.param_dtype, u.reduce_dtype) for u in with_mp}
    mp = ""
    if len(pol) == 1:
        p, r = pol.pop()
        mp = ", ".join(x for x in (f"params {p}" if p else "", f"reduce {r}" if r else "") if x)
        if len(with_mp) < len(us):
            mp += f" ({len(with_mp)} of {len(us)} units)"
    elif pol:
        mp = f"mixed: {len(pol)} policies over the units"
    off = [u for u in us if u.offload]
    offload = "" if not off else "CPU offload" + (f" ({len(off)} of {len(us)} units)" if len(off) < len(us) else "")
    return mp, offload


def gradient_sync(run: Run) -> Optional[tuple[int, int]]:
    """(backward passes per optimizer step, of them those run with FSDP2's gradient sync on): the pair most steady
    steps of every rank recorded, where they accumulate gradients over more than one backward; None without
    accumulation, or where not recorded (records before ``StepRecord.synced_backwards``). A backward after the
    step's optimizer step (a second loss through the model after its update) is no micro-batch: such steps are
    left out."""
    pairs = Counter((s.backwards, s.synced_backwards) for rd in run.ranks.values() for s in usable_steps(rd.steps)
                    if s.backwards and s.synced_backwards is not None and not s.backward_after_optimizer)
    if not pairs:
        return None
    (n, synced), _ = pairs.most_common(1)[0]
    return (n, synced) if n > 1 else None


def run_facts(run: Run) -> RunFacts:
    cfg = run.config
    single = not run.ranks and len(run.trace_files) == 1  # one trace file given: name it, not its folder
    facts = RunFacts(path=str(run.trace_files[0] if single else run.path), ranks=sorted(run.ranks),
                     world_size=run.world_size, run_id=run.run_id or None, trace_files=len(run.trace_files),
                     trace_files_unread=run.trace_files_left_out)
    if cfg is not None:
        facts = msgspec.structs.replace(
            facts, backend=cfg.backend, device=cfg.device, device_name=cfg.device_name,
            torch_version=cfg.torch_version, optimizer=cfg.optimizer, units=len(cfg.units),
            model_param_count=cfg.model_param_count, model_trainable_param_count=cfg.model_trainable_param_count,
            experts=cfg.experts, capacity_bytes=cfg.capacity_bytes,
            tokens_per_step=cfg.tokens_per_step)
        if cfg.optimizer_groups:
            facts.optimizer_groups = list(cfg.optimizer_groups)
        if cfg.optimizer_in_backward:
            facts.optimizer_in_backward = cfg.optimizer_in_backward
        if cfg.mesh:  # tensor (or other model) parallelism beside FSDP, or HSDP's 2-D mesh
            facts.mesh = dict(cfg.mesh)
        if cfg.attn_implementation:  # (a Hugging Face model's: compare reads its change)
            facts.attn_implementation = cfg.attn_implementation
        if chunks := loss_chunks(cfg, run.ranks):  # (compare reads its change: memory.temporaries' fix)
            facts.loss_chunks = chunks
        if impl := optimizer_impl(cfg):  # (... and this: optim.foreach_temporaries' fix)
            facts.optimizer_impl = impl
        if cfg.torch_lacks:  # FSDP2 features this torch release does not have (labels, private APIs)
            facts.torch_lacks = list(cfg.torch_lacks)
        mp, off = precision_facts(cfg.units)
        if mp:
            facts.mixed_precision = mp
        if off:
            facts.offload = off
        if notes := config_notes(cfg):  # units compiled by torch.compile: how they were timed, or that they were not
            facts.notes = notes
        if getattr(cfg, "model_has_forward", None) is False:  # (a new-user trial's teacher-and-student wrapper)
            facts.notes = [*(facts.notes or []), (
                "watch() was given a module with no forward() of its own (a container of models called one by one): "
                "its models' steps, units and findings are mixed here; give watch() the model you train and its "
                "optimizer (README: loops with more than one model)")]
        if said := optimizer_of_another_model(cfg):  # (a teacher watched with its student's optimizer)
            facts.notes = [*(facts.notes or []), said[0].upper() + said[1:]]
        others = other_fsdp_units(run)
        if others:  # (a new-user trial's distillation: the teacher's all-gathers in the student's same-named units)
            facts.notes = [*(facts.notes or []), (
                f"{others} FSDP2 unit(s) of another model are alive in this process (a teacher, a GAN's other network, "
                "an earlier model still referenced): where it runs during the watched steps, FSDP's trace labels do "
                "not name the model, so the trace's per-unit figures of same-named units count its collectives too; "
                "its work between the steps reads as time outside the model, and its memory (its parameters, "
                "gradients and activations) is not in the categories: on CUDA it falls into temporaries")]
    elif run.trace_files:  # plain traces: their own metadata (distributedInfo, deviceProperties)
        from ..trace.meta import meta_facts

        meta = meta_facts(run.trace_files)
        if meta:
            facts = msgspec.structs.replace(facts, **meta, facts_source="trace metadata")
            if "device_name" in meta:
                facts.device = "cuda"
    if run.notes:  # (a run still being written: load_run)
        facts.notes = [*run.notes, *(facts.notes or [])]
    errs = [SteppedAside(rank=e.rank, where=e.where, message=e.message, step=e.step)
            for rd in run.ranks.values() for e in rd.errors]
    if errs:
        facts.doctor_errors = errs
    if sync := gradient_sync(run):
        facts.backwards_per_step, facts.synced_backwards_per_step = sync
    facts.steps_recorded = {str(r): len(rd.steps) for r, rd in sorted(run.ranks.items())}
    facts.complete = {str(r): rd.end is not None and not rd.end.exception for r, rd in sorted(run.ranks.items())}
    cut = sorted(str(r) for r in getattr(run, "records_cut", ()) if r in run.ranks and run.ranks[r].end is None)
    if cut:
        facts.records_cut = cut
    stopped = {str(r): rd.end.exception for r, rd in sorted(run.ranks.items())
               if rd.end is not None and rd.end.exception}
    if stopped:
        facts.stopped_on = stopped
    if len(set(stopped.values())) > 1:  # (a new-user trial's header dropped the planted error for the others')
        ends = sorted((run.ranks[int(r)].end.ended_ns, r) for r in stopped)
        facts.stopped_first = ends[0][1]
        facts.stopped_first_by_ms = round((ends[1][0] - ends[0][0]) / 1e6, 1)
    return facts


_TIMING_KEYS = ("fwd_ms", "ag_wait_fwd_ms", "bwd_ms", "ag_wait_bwd_ms", "recompute_ms")


def unit_table(run: Run, ranks: Optional[list[int]] = None) -> list[UnitRow]:
    """The configuration snapshot of each unit (lowest rank), with median per-step timings across ranks (those of
    ``ranks`` where given: a straggler's own, diagnose.estimate.units).

    ``timing_p50``'s ``fwd_ms`` and ``bwd_ms`` include nested units (as recorded); ``fwd_self_ms`` and
    ``bwd_self_ms`` are the unit's own time, its direct nested units' times taken out (for a leaf unit, the
    same). A unit whose backward FSDP never brackets (a root without parameters) has ``bwd_self_ms`` None."""
    cfg = run.config
    if cfg is None:
        return []
    children: dict[str, list[str]] = {}
    for u in cfg.units:
        if u.parent is not None:
            children.setdefault(u.parent, []).append(u.name)
    # a backward nests by time, not by the module tree: FSDP brackets a grouped unit's backward from its first
    # module's to its last's, so a tied [embedding, head] unit's holds the blocks' and the root's backward (the
    # blocks counted twice, the root's own read 0.00 ms: a new-user trial); where a memory timeline has the marks
    bwd_children = _backward_nesting(run) or children
    timings: dict[str, dict[str, list[float]]] = {}
    not_run: dict[str, int] = {}
    # steps in which a unit ran its forward and no backward (not a root's: one holding no parameters of its own is timed
    # by none)
    no_backward: dict[str, int] = {}
    roots = {u.name for u in cfg.units if u.is_root}
    # (one pass over every unit of every step: a 20,000-step run's 240,000, attributes read directly)
    for r, rd in run.ranks.items():
        if ranks is not None and r not in ranks:
            continue
        for s in usable_steps(rd.steps):
            by_name = {u.name: u for u in s.units} if (children or bwd_children) else {}
            for u in s.units:
                if not (u.fwd_calls or u.fwd_ms or u.bwd_ms):  # did not run in this step: its zeros are no time
                    # (an MoE expert masked in 2 of 4 steps read 0.67 ms against 4.44 ms where it ran: a new-user
                    # trial)
                    not_run[u.name] = not_run.get(u.name, 0) + 1
                    continue
                if not u.bwd_ms and u.name not in roots:
                    no_backward[u.name] = no_backward.get(u.name, 0) + 1
                t = timings.get(u.name)
                if t is None:
                    t = timings[u.name] = {k: [] for k in (*_TIMING_KEYS, "fwd_self_ms", "bwd_self_ms")}
                t["fwd_ms"].append(u.fwd_ms)
                t["ag_wait_fwd_ms"].append(u.ag_wait_fwd_ms)
                t["bwd_ms"].append(u.bwd_ms)
                t["ag_wait_bwd_ms"].append(u.ag_wait_bwd_ms)
                t["recompute_ms"].append(u.recompute_ms)
                kids = [by_name[c] for c in children.get(u.name, ()) if c in by_name]
                t["fwd_self_ms"].append(max(0.0, u.fwd_ms - sum(c.fwd_ms for c in kids)))
                if bwd_children is not children:
                    kids = [by_name[c] for c in bwd_children.get(u.name, ()) if c in by_name]
                if u.bwd_ms > 0 or not kids:
                    t["bwd_self_ms"].append(max(0.0, u.bwd_ms - sum(c.bwd_ms for c in kids)))
    # the doctor's hooks stay out of a compiled frame: a unit inside one is untimed, unless timed from FSDP2's own hooks
    blind = {u.name for u in cfg.units if u.compiled_in_place and not getattr(u, "fsdp_hooks_timed", False)}
    out = []
    for u in cfg.units:
        row = UnitRow(**msgspec.structs.asdict(u))
        t = timings.get(u.name) if u.name not in blind else None
        if t:
            row.timing_p50 = UnitTiming(**{k: round(statistics.median(v), 3) for k, v in t.items() if v},
                                        not_run=not_run.get(u.name, 0), samples=len(t["fwd_ms"]),
                                        no_backward=no_backward.get(u.name, 0))
            if blind & set(children.get(u.name, ())):  # a nested unit's time unknown: so is this one's own
                row.timing_p50.fwd_self_ms = row.timing_p50.bwd_self_ms = None
            if u.compiled_call_timed or getattr(u, "forward_methods", None):
                # FSDP's pre-forward inside the compiled call, or inside a registered forward method: its wait is in
                # fwd_ms (a score() method's root read 0.00 ms of all-gather wait, as if measured: a new-user trial)
                row.timing_p50.ag_wait_fwd_ms = None
            if u.compiled_in_place:  # (timed from FSDP2's own hooks: its waits inside its forward and backward)
                row.timing_p50.ag_wait_fwd_ms = row.timing_p50.ag_wait_bwd_ms = None
                if u.checkpoint != "none":  # (re-run inside the compiled backward: not timed, not 0)
                    row.timing_p50.recompute_ms = None
        out.append(row)
    return out


def _backward_nesting(run: Run) -> Optional[dict[str, list[str]]]:
    """Per unit, the units whose backward runs directly inside its own (its first backward_start mark before theirs,
    its last backward_end after), from the latest memory timeline of the lowest rank that has backward marks; None
    without one."""
    from .memory import timeline_rows

    for rd in sorted(run.ranks.values(), key=lambda rd: rd.rank):
        for s in reversed(rd.steps):
            if s.memory is None or s.memory.timeline is None:
                continue
            span: dict[str, list[int]] = {}
            for i, row in enumerate(timeline_rows(s.memory)):
                unit, phase = row.get("unit"), row.get("phase")
                if unit is None or phase not in ("backward_start", "backward_end"):
                    continue
                sp = span.setdefault(unit, [i, i])
                if phase == "backward_start":
                    sp[0] = min(sp[0], i)
                else:
                    sp[1] = max(sp[1], i)
            if len(span) < 2:
                continue
            inside = {y: {x for x in span if x != y and span[y][0] < span[x][0] and span[x][1] < span[y][1]}
                      for y in span}
            return {y: sorted(x for x in xs if not any(x in inside[z] for z in xs if z != x))
                    for y, xs in inside.items() if xs}
    return None


def name_groups_as_records(overlap: OverlapSection, run: Run) -> None:
    """A grouped unit's trace rows (``per_unit``, ``units``) renamed to the records' name where its modules are listed
    in another order: FSDP2's labels list them in module-tree order, the records as ``fully_shard`` was given them
    (accelerate's plugin groups a tied model's final norm, embedding and head: the records' "model.norm,
    model.embed_tokens, lm_head", the trace's "model.embed_tokens, model.norm, lm_head"; the rules' joins found no
    such unit, the unit snapshot filled no sizes for its rows, and the report named it two ways: a new-user trial)."""
    cfg = run.config
    if cfg is None:
        return
    roots = [u.name for u in cfg.units if u.is_root]
    alias = same_group([fsdp_label(u.name, roots) for u in cfg.units],
                       {n for r in overlap.units for n in (r.name, r.parent)} | {r.unit for r in overlap.per_unit})
    if not alias:
        return
    for row in overlap.per_unit:
        row.unit = alias.get(row.unit, row.unit)
    for row in overlap.units:
        row.name, row.parent = alias.get(row.name, row.name), alias.get(row.parent, row.parent)


def fill_sizes_from_units(overlap: OverlapSection, run: Run) -> None:
    """Bytes per call and bus bandwidth from the unit snapshot where the trace has no message sizes, or no group
    (gloo's all-reduces on a 2-D mesh: HSDP's): an all-gather moves the unit's unsharded parameters in param dtype, a
    reduce-scatter its unsharded gradients in reduce dtype, HSDP's all-reduce across replicas the reduce-scatter's
    output (one shard of them) over the replicas; the dtype and group as torch names them where the trace gives
    none."""
    from ..trace.analysis import busbw_factor
    from ..trace.collectives import dtype_bytes

    cfg = run.config
    if cfg is None:
        return
    roots = [u.name for u in cfg.units if u.is_root]
    units = {fsdp_label(u.name, roots): u for u in cfg.units}  # (as the trace names them: the root "(root)")
    for row in overlap.per_unit:
        u = units.get(row.unit)
        if u is None or (row.bytes_per_call is not None and row.busbw_gbps is not None) or not u.param_count \
                or not u.unsharded_bytes:
            continue
        stored = u.orig_dtypes[0] if u.orig_dtypes else "float32"
        group = u.shard_size or cfg.world_size  # (FSDP's shard group)
        gathered = u.param_dtype or stored  # (the all-gather's dtype)

        def elements(unsharded: int, sharded: Optional[int]) -> float:
            # the elements FSDP2 moves (with tensor parallelism its shard's): each parameter's shard padded to dim
            # 0's ceil(rows / group) (sharded bytes, stored dtype) on every rank of the group; the unpadded figure where
            # the snapshot has no shard (an HSDP all-reduce of 45,600 B for the 46,000 B that FSDP2 sends on 2 x 2)
            return max(unsharded / (dtype_bytes(gathered) or 4), (sharded or 0) / (dtype_bytes(stored) or 4) * group)

        elems = elements(u.unsharded_bytes, u.sharded_bytes)
        # gradients, in the reduce dtype: FSDP2 reduces in the compute dtype where the policy names none (bf16
        # parameters' gradients read as float32, twice their bytes); of the trainable parameters only: a frozen base's
        # unit reduces its adapters' gradients (a LoRA layer's 3,584 B, not its 151,552 B)
        reduce = u.reduce_dtype or gathered
        grads = elems if u.trainable_unsharded_bytes is None else elements(u.trainable_unsharded_bytes,
                                                                             u.trainable_sharded_bytes)
        reduced = grads * (dtype_bytes(reduce) or 4)
        if row.collective == "all_gather":
            nbytes, dtype = elems * (dtype_bytes(gathered) or 4), gathered
        elif row.collective == "reduce_scatter":
            nbytes, dtype = reduced, reduce
        elif row.collective == "all_reduce" and cfg.fsdp_dims == 2 and cfg.mesh and u.shard_size:  # HSDP's
            nbytes, group, dtype = reduced / u.shard_size, next(iter(cfg.mesh.values())), reduce  # (replicas: dim 0)
        else:
            continue
        if row.bytes_per_call is None:
            row.bytes_per_call = float(nbytes)
            row.bytes_source = "unit snapshot"
        # (a gloo trace without record_shapes names neither: the doctor's windows record none, see record.profiling)
        row.dtype = row.dtype or dtype
        row.group_size = row.group_size or group
        nbytes = row.bytes_per_call  # (the trace's where it has them; the group the snapshot's: gloo's has none)
        f = busbw_factor(row.collective, group)
        if f is not None and row.comm_us > 0:
            row.busbw_gbps = nbytes * row.count * f / row.comm_us / 1e3


def other_fsdp_units(run) -> int:
    """FSDP2 units of another model alive in the run's processes at its exit (a frozen teacher, a GAN's other network:
    ``End.other_fsdp_units``), the most over the ranks; 0 where none, or not recorded."""
    return max((rd.end.other_fsdp_units for rd in (getattr(run, "ranks", None) or {}).values()
                if getattr(rd, "end", None) is not None), default=0)
