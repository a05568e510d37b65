"""The verdict: what bounds the step, per rank and for the job, with the share of the step each cause takes.

From a Kineto trace (``report.overlap.breakdown``, see ``fsdp_doctor.trace.analysis.breakdown``) the
complete steps' wall time is split into exclusive parts at every instant: compute; exposed communication
(all-gather in forward / backward, reduce-scatter, other collectives); offload copies alone on the device;
other device work alone (memsets, device-to-device copies); and, where the device is idle, host-bound (the
next work was not launched yet while the host was in the model), input (the same while the host was outside
the model: data loading, the user's code) and idle (work launched but waiting). On a CPU/gloo trace, compute
is the main thread's operators, its time inside collectives (their operators and waits, FSDP2's in its labels) is
the collectives' communication, and host the main thread's time outside both.

Without a trace for a rank, the rank's step records give a coarser split on the host clock: exposed
all-gather waits per phase, GC pauses (host), time outside the model (input) and the rest (compute). On a
GPU the host runs ahead of the device, so that split is marked ``"records (host clock)"``; there, input is the
device's idle between ``optimizer.step()`` and the forward where the recorder's CUDA events timed it
(``analyze.steps.device_outside_ms``), not the host's time outside the model, which holds its waits for the
device (a ``loss.item()`` per step): those fall to the rest here.

``bound`` is the group with the largest share: ``communication``, ``compute``, ``host``, ``input``,
``offload`` or ``idle``.
"""

from __future__ import annotations

import statistics
from typing import Optional

from ..records import offloads_params, runs_compiled
from ..report_sections import OverlapSection, Straggler, Verdict, VerdictEntry
from ..store import Run
from ..trace.analysis import BREAKDOWN_PARTS, COMM_PARTS
from ..trace.model import OTHER_UNIT
from ..units import fmt_list, fmt_ms, fmt_share, ranks_phrase, steps_phrase
from .steps import device_outside_ms, device_pairs, profiled_saves, read_on_straggler, usable_steps

GROUPS: dict[str, tuple[str, ...]] = {
    "communication": COMM_PARTS,
    "compute": ("compute", "other_gpu"),
    "host": ("host", "sync"),
    "input": ("input",),
    "offload": ("offload",),
    "idle": ("idle",),
}

PART_LABELS = {
    "compute": "compute",
    "allgather_fwd": "exposed all-gather (forward)",
    "allgather_bwd": "exposed all-gather (backward)",
    "reducescatter": "exposed reduce-scatter",
    "model_comm": "exposed model-parallel collectives",
    "other_comm": "exposed other collectives",
    "offload": "offload copies (H2D/D2H)",
    "other_gpu": "other device work (memset, D2D)",
    "host": "host-bound (GPU waits for launches)",
    "sync": "host in device syncs (cudaDeviceSynchronize, .item())",
    "input": "input / outside the model",
    "idle": "idle (launched work waiting)",
}
GROUP_LABELS = {"communication": "exposed communication", "compute": "compute", "host": "host", "input": "input",
                "offload": "offload", "idle": "idle"}
# on a CPU/gloo trace the "device" is the main thread
# (host was "between operators", and held the main thread's time blocked in collective waits: a new-user trial's
# rank of tensor parallelism on gloo read host-bound, 66.5%, sitting 90.7 ms of 215.6 in wait_tensor)
CPU_LABELS = {"compute": "compute (operators)", "host": "host (main thread outside operators and collectives)"}


def _shares(parts_us: dict[str, float], total_us: float) -> tuple[dict, dict]:
    shares = {k: round(100.0 * parts_us.get(k, 0.0) / total_us, 2) for k in BREAKDOWN_PARTS}
    groups = {g: round(100.0 * sum(parts_us.get(k, 0.0) for k in ks) / total_us, 2) for g, ks in GROUPS.items()}
    return shares, groups


#: the gradient reduction's label where FSDP's units also all-reduce across replicas (HSDP): the part holds both
HSDP_REDUCE_LABEL = "exposed gradient reduction (reduce-scatter + HSDP all-reduce)"


def _entry(parts_us: dict[str, float], total_us: float, steps: Optional[int], source: str,
           device: str, step_ms: Optional[float] = None, hsdp: bool = False) -> VerdictEntry:
    """The verdict of one rank's parts (µs) over ``steps`` steps, or of the job's (``steps`` None); ``hsdp``: the
    units' gradient reduction holds an all-reduce across replicas."""
    shares, groups = _shares(parts_us, total_us)
    labels = _labels(device, source, hsdp)
    ranked = sorted(groups, key=lambda g: (-groups[g], g != "compute"))  # groups as wholes, their parts added
    bound = ranked[0]
    rest = [g for g in ranked[1:3] if groups[g] >= 0.5]
    parts = _parts(bound, shares)
    summary = f"{bound}-bound ({fmt_share(groups[bound] / 100)} of the step"
    # one part is named too where it is not the group's namesake (an HSDP 2x1 mesh's "communication-bound (51% of
    # the step)" named no collective: its gradient all-reduce across replicas, a new-user trial)
    if len(parts) > 1 or (parts and parts[0] != bound):
        summary += ": " + ", ".join(f"{labels[k]} {fmt_share(shares[k] / 100)}" for k in parts)
    summary += ")"
    if rest:
        summary += "; then " + ", ".join(_runner_up(g, groups, shares, labels) for g in rest)
    return VerdictEntry(bound=bound, shares_pct=shares, groups_pct=groups, summary=summary, source=source,
                        device=device, steps=steps, step_ms=None if step_ms is None else round(step_ms, 3))


def _labels(device: str, source: str, hsdp: bool) -> dict[str, str]:
    """The parts' labels for a verdict of ``device`` from ``source`` (trace, records)."""
    labels = {**PART_LABELS, **CPU_LABELS} if device == "cpu" else dict(PART_LABELS)
    if hsdp:
        labels["reducescatter"] = HSDP_REDUCE_LABEL
    if source.startswith("records"):
        labels.update(host="GC pauses", compute="forward, backward and optimizer (less waits)")
    return labels


def _parts(g: str, shares: dict) -> list[str]:
    """The parts of group ``g`` worth naming (at least 0.5% of the step), largest first."""
    return sorted((k for k in GROUPS[g] if shares[k] >= 0.5), key=lambda k: -shares[k])


def _runner_up(g: str, groups: dict, shares: dict, labels: dict) -> str:
    """A group after the bound, compared as a whole: "exposed communication 34% (exposed reduce-scatter 15%,
    ...)" where several of its parts count, else the one part's label: "host (main thread ...) 25%"."""
    parts = _parts(g, shares)
    if len(parts) > 1:
        return (f"{GROUP_LABELS[g]} {fmt_share(groups[g] / 100)} ("
                + ", ".join(f"{labels[k]} {fmt_share(shares[k] / 100)}" for k in parts) + ")")
    return f"{labels[parts[0]] if parts else GROUP_LABELS[g]} {fmt_share(groups[g] / 100)}"


def _trace_parts(overlap: Optional[OverlapSection]) -> dict[str, tuple[dict, float, int, str, Optional[float]]]:
    out: dict = {}
    for r, parts in (overlap.breakdown if overlap is not None else {}).items():
        if parts.window_us <= 0:
            continue
        pr = overlap.per_rank.get(r)
        n = (pr.step_count or len(pr.steps) if pr is not None else 0) or 1
        dev = (pr.device if pr is not None else "") or "gpu"
        step_ms = pr.step_ms if pr is not None and pr.step_ms is not None else parts.window_us / n / 1e3
        out[str(r)] = ({k: float(v) for k, v in parts.parts().items()}, float(parts.window_us), n, dev, step_ms)
    return out


def _atypical(overlap: Optional[OverlapSection], ranks: list[str]) -> dict[str, dict[str, dict]]:
    """Of ``ranks``' traces, each rank's complete steps unlike its others (``OverlapRank.atypical_steps``): step ->
    its breakdown's parts (µs)."""
    out = {}
    for r in ranks:
        pr = overlap.per_rank.get(r) if overlap is not None else None
        if pr is not None and pr.atypical_steps:
            out[r] = {st: {k: v * 1e3 for k, v in parts.items()} for st, parts in pr.atypical_steps.items()}
    return out


def _atypical_clause(odd: dict[str, dict[str, dict]], used: dict[str, tuple[dict, float]], overlap: OverlapSection,
                     run: Optional[Run], labels: dict, bound: str, hsdp: bool, name_ranks: bool) -> str:
    """"; profiled step 7 took 2.3x the other profiled steps (412.0 ms against 180.0 ms), most of the extra time
    input / outside the model: without it, compute-bound (61% of the step)": what the shares of ``used``'s ranks
    (parts µs, total µs) hold of their steps unlike the others (``odd``, ``_atypical``), and what they read without
    them; "" where none is. The shares keep them, as the report's other per-step figures do (one window, one set
    of figures); a window of two steps, one of them a GC pause, read as the pause's bound unsaid."""
    odd = {r: o for r, o in odd.items() if r in used}
    if not odd:
        return ""
    rest = {k: 0.0 for k in BREAKDOWN_PARTS}
    rest_total = 0.0
    excess = {k: 0.0 for k in BREAKDOWN_PARTS}
    factors, odd_ms, typical_ms, why = [], [], [], []
    for r, (parts, total) in used.items():
        steps = odd.get(r, {})
        mine = {k: max(0.0, parts.get(k, 0.0) - sum(p.get(k, 0.0) for p in steps.values())) for k in BREAKDOWN_PARTS}
        mine_total = max(0.0, total - sum(sum(p.get(k, 0.0) for k in BREAKDOWN_PARTS) for p in steps.values()))
        for k in BREAKDOWN_PARTS:
            rest[k] += mine[k]
        rest_total += mine_total
        if not steps:
            continue
        times = overlap.per_rank[r].step_times_ms
        typical = [ms for st, ms in times.items() if st not in steps]
        n = len(typical) or 1
        for st, p in steps.items():
            for k in BREAKDOWN_PARTS:
                excess[k] += p.get(k, 0.0) - mine[k] / n
            med = statistics.median(typical) if typical else None
            if med:
                factors.append(times[st] / med)
                odd_ms.append(times[st])
                typical_ms.append(med)
            rec = next((x for x in (run.ranks[int(r)].steps if run is not None and int(r) in run.ranks else [])
                        if x.step == int(st)), None)
            if rec is not None and rec.step == 0:
                why.append("the first step: FSDP's lazy initialization and any compilation run in it")
            elif rec is not None and rec.checkpoints:
                why.append("it saved a checkpoint")
            elif rec is not None and med and rec.gc_ms >= 0.5 * (times[st] - med):
                why.append(f"a GC pause of {fmt_ms(rec.gc_ms)} in it (the records)")
    if rest_total <= 0 or not factors:
        return ""
    without = _entry(rest, rest_total, None, "trace", "cpu", hsdp=hsdp)
    steps = sorted({int(st) for o in odd.values() for st in o})
    top = max(excess, key=excess.get)
    where = f" on {ranks_phrase(sorted(odd, key=int))}" if name_ranks else ""
    lo, hi = f"{min(factors):.1f}", f"{max(factors):.1f}"
    took = (f"{hi}x the other profiled steps ({fmt_ms(odd_ms[0])} against {fmt_ms(typical_ms[0])})"
            if len(factors) == 1 else f"{hi if lo == hi else f'{lo}-{hi}'}x the other profiled steps")
    same = " too" if without.bound == bound else ""
    reason = f" ({sorted(set(why))[0]})" if len(set(why)) == 1 else ""
    it = "it" if len(steps) == 1 else "them"
    return (f"; profiled {steps_phrase(steps)} took {took}{where}{reason}, most of the extra time "
            f"{labels.get(top, top)}: without {it}, {without.bound}-bound{same} "
            f"({fmt_share(without.groups_pct[without.bound] / 100)} of the step)")


#: profiled steps this many times the records' steady step or more: the profiler's own cost is most of them
PROFILED_SLOW_FACTOR = 2.0


def _slow_window_clause(overlap: Optional[OverlapSection], run: Optional[Run], ranks: list[str]) -> str:
    """"; the profiled steps ran 17.7x the steady steps (...): ...; the records' split of the steady steps:
    compute-bound (...)" where each of ``ranks``' traced steps took ``PROFILED_SLOW_FACTOR`` times its steady
    median (the records', which leave the profiled steps out) or more; "" otherwise. The profiler's cost per operator
    and per event is in the trace's shares then, and a rank it slowed more than another makes that one wait in their
    collectives: a new-user trial's Mamba (the selective scan's reference path, 62,000 operators per step) ran 16.6 s
    profiled steps against 936 ms ones, and its trace read exposed reduce-scatter 23%, rank 0 waiting for rank 1."""
    if overlap is None or run is None or not run.has_records or not ranks:
        return ""
    factors, traced_ms, steady_ms = [], [], []
    for r in ranks:
        pr, rd = overlap.per_rank.get(r), run.ranks.get(int(r))
        steady = [s.wall_ms for s in usable_steps(rd.steps)] if rd is not None else []
        if pr is None or not pr.step_ms or len(steady) < 3:
            return ""
        med = statistics.median(steady)
        if med <= 0:
            return ""
        # the window's steps like each other (a stalled step is the atypical clause's, not the profiler's cost: a
        # 400 ms loader stall in one of 3 profiled steps made their mean twice the steady step)
        typical = [ms for st, ms in pr.step_times_ms.items() if st not in pr.atypical_steps]
        window = statistics.median(typical) if typical else pr.step_ms
        factors.append(window / med)
        traced_ms.append(window)
        steady_ms.append(med)
    if min(factors) < PROFILED_SLOW_FACTOR:
        return ""
    rec = {r: v for r, v in _record_parts(run).items() if r in ranks and v[1] > 0}
    lo, hi = min(factors), max(factors)
    ran = f"{hi:.1f}x" if f"{lo:.1f}" == f"{hi:.1f}" else f"{lo:.1f}-{hi:.1f}x"
    i = factors.index(hi)
    said = (f"; the profiled steps ran {ran} the steady steps ({fmt_ms(traced_ms[i])} against {fmt_ms(steady_ms[i])}"
            f"{' on rank ' + ranks[i] if len(ranks) > 1 else ''}): the profiler's own cost per operator is in these "
            "shares, and a rank it slowed more than another makes that one wait in their collectives")
    if rec:
        gpu = any(v[3] for v in rec.values())
        split = _entry({k: sum(v[0][k] for v in rec.values()) for k in BREAKDOWN_PARTS},
                       sum(v[1] for v in rec.values()), None, "records", "gpu" if gpu else "cpu")
        said += f"; the records' split of the steady steps: {split.summary}"
    return said


def _record_parts(run: Run) -> dict[str, tuple[dict, float, int, bool]]:
    out = {}
    for r, rd in sorted(run.ranks.items()):
        steps = usable_steps(rd.steps)
        if not steps:
            continue
        parts = {k: 0.0 for k in BREAKDOWN_PARTS}
        total = 0.0
        cfg = rd.config or run.config
        gpu = bool(cfg is not None and str(cfg.device).startswith("cuda"))
        device = {s.step: g for s, g in device_pairs(rd, steps)} if gpu else {}
        for s in steps:
            fwd = sum(u.ag_wait_fwd_ms for u in s.units)
            bwd = sum(u.ag_wait_bwd_ms for u in s.units)
            dev = device_outside_ms(device[s.step]) if s.step in device else None
            outside = s.outside_ms if dev is None else min(dev, s.outside_ms)
            # another FSDP model's forward and backward in the step (a teacher's, a GAN's other network): model work,
            # compute, not input (a nested watch of a teacher read its student's step as 72% input-bound: a trial)
            outside = max(0.0, outside - getattr(s, "other_models_ms", 0.0))
            rest = max(0.0, s.wall_ms - fwd - bwd - s.gc_ms - outside)
            for k, v in (("allgather_fwd", fwd), ("allgather_bwd", bwd), ("host", s.gc_ms),
                         ("input", outside), ("compute", rest)):
                parts[k] += v * 1e3
            total += max(s.wall_ms, fwd + bwd + s.gc_ms + outside) * 1e3
        out[str(r)] = (parts, total, len(steps), gpu)
    return out


def _waits_inside(run: Optional[Run], ranks: list[str]) -> tuple[list[str], list[str], list[str]]:
    """Of the units of ``ranks`` (split from their records), those whose all-gather waits are inside their own
    times, by name, the most of any rank: (the forward's only: compiled in place and timed around their compiled
    call; both waits: in a compiled frame the doctor's hooks are not in, timed from FSDP2's own logs or untimed; the
    forward's only: run through a registered forward method)."""
    called: list[str] = []
    framed: list[str] = []
    methods: list[str] = []
    for cfg in _configs(run, ranks):
        if cfg is not None:
            called = max(called, [u.name for u in cfg.units if getattr(u, "compiled_call_timed", False)], key=len)
            # (a unit without parameters of its own gathers nothing: a root whose parameters are all in its blocks)
            framed = max(framed, [u.name for u in cfg.units if runs_compiled(u) and u.unsharded_bytes != 0
                                  and not getattr(u, "compiled_call_timed", False)], key=len)
            methods = max(methods, [u.name for u in cfg.units
                                    if not runs_compiled(u) and getattr(u, "forward_methods", None)], key=len)
    return called, framed, methods


def _root_methods(run: Optional[Run], ranks: list[str]) -> list[str]:
    """The methods of the root unit's module registered as forward methods (register_fsdp_forward_method), from the
    records of ``ranks``."""
    for cfg in _configs(run, ranks):
        for u in (cfg.units if cfg is not None else []):
            if u.parent is None and getattr(u, "forward_methods", None):
                return list(u.forward_methods)
    return []


def _configs(run: Optional[Run], ranks: list[str]):
    """Each of ``ranks``' unit snapshot (its records' RunConfig, else the run's; None where neither is)."""
    for r in ranks:
        rd = run.ranks.get(int(r)) if run is not None else None
        yield (rd.config if rd is not None else None) or (run.config if run is not None else None)


def _waits_inside_clause(called: list[str], framed: list[str], methods: list[str]) -> str:
    """The verdict's words on the all-gather waits its records count as compute (``_waits_inside``'s lists), "" for
    none."""
    def units(names: list[str], what: str) -> str:
        return f"{len(names)} unit{'s' * (len(names) > 1)} {what} ({fmt_list(names, 3)})"

    fwd = " and ".join(units(names, what) for names, what in ((called, "compiled by torch.compile"),
                                                              (methods, "run through a registered forward method"))
                       if names)
    their = "its" if len(called) + len(methods) == 1 else "their"
    said = [f"the forward all-gather waits of {fwd} are inside {their} forward"] if fwd else []
    if framed:
        whose, its = units(framed, "in a compiled frame"), "its" if len(framed) == 1 else "their"
        said.append(f"the forward and backward ones of {whose} inside {its} forward and backward" if said else
                    f"the forward and backward all-gather waits of {whose} are inside {its} forward and backward")
    if not said:
        return ""
    return f" (from the records, {', and '.join(said)}: counted as compute here; a profiler window tells them apart)"


def _host_optimizer_clause(run: Optional[Run], ranks: list[str], host_share: float) -> str:
    """Where a GPU step is host-bound and its optimizer steps CPUOffloadPolicy's shards on the host for half that
    time or more, the verdict says so ("" otherwise): an offloaded H100 run read "host-bound (58% of the step)", the
    "Python, operator dispatch" of its levers, where 86.4 ms of its 170.5 ms step was AdamW on the CPU (the findings
    below said it; the verdict, read first, did not)."""
    if run is None or not run.has_records or not offloads_params(run.config):
        return ""
    steps = [s for r in ranks if int(r) in run.ranks for s in usable_steps(run.ranks[int(r)].steps)]
    if not steps:
        return ""
    opt, wall = statistics.median(s.optimizer_ms for s in steps), statistics.median(s.wall_ms for s in steps)
    if opt < 0.5 * host_share * wall:
        return ""
    return (f" (the host's time is mostly the optimizer's step on the CPU, over the shards CPU offload keeps there: "
            f"{fmt_ms(opt)} of the {fmt_ms(wall)} step)")


def _no_backward_of_its_own(run: Optional[Run]) -> bool:
    """Whether the records say the watched model ran no backward in any of its steps (a frozen teacher run under
    torch.no_grad): its units have no gradients to reduce-scatter."""
    steps = [s for rd in (run.ranks.values() if run is not None and run.has_records else []) for s in rd.steps]
    return bool(steps) and all(not getattr(s, "backwards", None) and not s.backward_ms
                               and not any(u.bwd_ms for u in s.units) for s in steps)


def verdict(overlap: Optional[OverlapSection], run: Optional[Run] = None,
            late: Optional[Straggler] = None) -> Optional[Verdict]:
    """The :class:`~fsdp_doctor.report_sections.Verdict` from the report's ``overlap`` section (the traces) and
    the run's records, per rank and for the job (see the module docstring), or None without any data. With a
    straggler (``late``: the records', ``analyze.steps.late_straggler``) the job's is its rank's own step."""
    per_rank: dict[str, VerdictEntry] = {}
    used: dict[str, tuple[dict, float]] = {}
    # an FSDP unit's all-reduce (HSDP's across replicas) is counted in its gradient reduction: named so
    hsdp = any(u.collective == "all_reduce" and u.unit != OTHER_UNIT for u in (overlap.per_unit if overlap else []))
    traced_parts = _trace_parts(overlap)
    odd = _atypical(overlap, list(traced_parts))
    for r, (parts, total, n, dev, step_ms) in traced_parts.items():
        per_rank[r] = _entry(parts, total, n, "trace", dev, step_ms, hsdp)
        used[r] = (parts, total)
        per_rank[r].summary += _atypical_clause(odd, {r: used[r]}, overlap, run, _labels(dev, "trace", hsdp),
                                                per_rank[r].bound, hsdp, name_ranks=False)
    if run is not None and run.has_records:
        for r, (parts, total, n, gpu) in _record_parts(run).items():
            if r in per_rank or total <= 0:
                continue
            per_rank[r] = _entry(parts, total, n, "records (host clock)" if gpu else "records", "gpu" if gpu else "cpu",
                                 total / n / 1e3)
            used[r] = (parts, total)
    if not per_rank:
        return None
    # the job from the traces where some ranks have one: a rank whose trace could not be read has only its records'
    # split, which cannot tell communication from compute, and read beside the others' it hid the job's exposed
    # reduce-scatter (a new-user trial truncated one rank's trace: the job's 6% became 0.3%)
    traced = {r for r, v in per_rank.items() if v.source == "trace"}
    joined = {r: u for r, u in used.items() if not traced or r in traced}
    on_late = late is not None and str(late.rank) in used and len(per_rank) > 1
    if on_late:
        # the others wait for the straggler inside their collectives: its lateness, not their collectives' cost,
        # which its own step says (a new-user trial's rank 2 of 4, sleeping 150 ms before each forward, read
        # "communication-bound (76% of the step: exposed all-gather (forward) 51%, ...)", its own step 54% outside
        # the model)
        joined = {str(late.rank): used[str(late.rank)]}
    job_parts = {k: sum(p[k] for p, _ in joined.values()) for k in BREAKDOWN_PARTS}
    job_total = sum(t for _, t in joined.values())
    devices = {per_rank[r].device for r in joined}
    job = _entry(job_parts, job_total, None, ", ".join(sorted({per_rank[r].source for r in joined})),
                 "gpu" if "gpu" in devices else "cpu", hsdp=hsdp)
    # a window far slower than the steady steps: the records' split is the reading, and which of its steps ran
    # slower than the others is the profiler's cost too (both once stood in a Mamba trial's verdict, 2.5x and 2.3x)
    slow = _slow_window_clause(overlap, run, [r for r in joined if r in traced])
    job.summary += slow or _atypical_clause(odd, joined, overlap, run, _labels(job.device, job.source, hsdp),
                                            job.bound, hsdp, name_ranks=len(joined) > 1)
    if on_late:
        job.summary += "; " + read_on_straggler(late.rank, late.excess_ms_per_step, "straggler.rank")
        job.read_on = int(late.rank)
    elif traced and len(traced) < len(per_rank):
        job.summary += (f" (from the traces of {ranks_phrase(sorted(traced, key=int))}; "
                        "the others' from their records)")
    ranks = run.ranks if run is not None else {}
    said = {int(st) for r in joined for st in odd.get(r, {})}  # (their reason said in the clause above)
    saves = sorted({st for r in traced if int(r) in ranks for st in profiled_saves(ranks[int(r)].steps)} - said)
    if saves:  # the trace's steps hold a checkpoint save, which the step statistics leave out
        job.summary += (f" (the profiler window's step{'s' * (len(saves) > 1)} {', '.join(map(str, saves))} saved a "
                        "checkpoint: the save is in these shares, as time outside the model)")
    if run is not None and run.has_records and overlap is not None and \
            any(0 in (overlap.per_rank[r].steps or []) for r in traced if r in overlap.per_rank) and 0 not in said:
        # (a window from step 0 on a compiled model read "compute-bound (97% of the step)": its compilation, the
        # only step that does it, unsaid: a new-user trial)
        job.summary += (" (the profiler window holds step 0, the first: FSDP's lazy initialization and any "
                        "torch.compile compilation run in it, as in no later step)")
    # (the records time such a unit's forward with its all-gather wait inside: a compiled model without a trace read
    # compute-bound with 0 ms of exposed forward all-gather, unsaid; the units named: "1 unit run through a registered
    # forward method" left the reader to find which, a new-user trial; a model compiled whole after sharding: its
    # units' backward waits are inside their backward too, which "the forward all-gather waits" left unsaid)
    job.summary += _waits_inside_clause(*_waits_inside(run, [r for r in joined if r not in traced]))
    if job.bound == "input" and (methods := _root_methods(run, [r for r in joined if r not in traced])):
        # (tests/test_outside_unit_call.py's VAE-shaped model, the whole model one unit, encode() registered, read
        # "input-bound (55% of the step)" from its records: decode(), which the loop calls itself, is outside the
        # model's forward; a diffusers VAE so sharded, _encode() registered, kept 218 of its 376 ms outside the model
        # in its records, and its trace said compute-bound, 89%)
        job.summary += (f" (from the records, the model runs through {', '.join(f'{m}()' for m in methods)}, "
                        "registered as its forward: its other methods the loop calls run outside it, in these "
                        "shares as input; a profiler window tells them apart)")
    if job.bound == "host" and job.device == "gpu":
        job.summary += _host_optimizer_clause(run, list(joined), job.groups_pct["host"] / 100)
    if job_parts.get("reducescatter", 0.0) > 0 and _no_backward_of_its_own(run):
        # (a frozen teacher watched with its student's optimizer read "exposed reduce-scatter 26%": the student's,
        # whose units FSDP's trace labels name as the teacher's, a new-user trial)
        job.summary += (" (the watched model ran no backward in its steps and reduce-scatters no gradients: the "
                        "forward and backward of another FSDP model run in its steps are in these shares, the "
                        "reduce-scatter and the backward's all-gathers all of them; watch that model for its own "
                        "bound)")
    by_bound: dict[str, list[int]] = {}
    for r, v in per_rank.items():
        by_bound.setdefault(v.bound, []).append(int(r))
    job.ranks_by_bound = {b: sorted(rs) for b, rs in sorted(by_bound.items())}
    job.ranks = len(per_rank)
    return Verdict(job=job, per_rank=dict(sorted(per_rank.items(), key=lambda kv: int(kv[0]))))

