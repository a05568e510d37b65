"""Number formatting with units, shared by every presenter (terminal, HTML, dashboard, TensorBoard tags).

One convention everywhere: memory and message sizes in binary units (B, KiB, MiB, GiB: powers of 1024);
bandwidth in decimal units (MB/s, GB/s: powers of 1000, as NCCL's and nccl-tests' bus bandwidth); times in
µs below a millisecond, then ms, then s; a missing value is "—"; the root FSDP unit is "(root)".
"""

from __future__ import annotations

import re
import statistics
from typing import NamedTuple, Optional

from msgspec import UNSET

from ..report_sections import (FIX_LANGUAGES, FIX_PLACES, Blocking, Breakdown, CommSummary, CommUnitRow, Finding,
                               MemorySection, Outlier, OverlapSection, Report, RunFacts, StepsSection, Straggler, ThroughputJob,
                               ThroughputRank, ThroughputSection, UnitRow, Verdict, VerdictEntry, UnitTiming)
from ..trace.model import OTHER_UNIT
from ..units import (CODE_WIDTH, MISSING, ROOT_LABEL, RUN_END_TAIL, WRAPPER_SEGMENTS, fit_comments, fmt_bw, fmt_bytes, fmt_list,  # noqa: F401  (re-exported)
                     fmt_mesh, fmt_ms, fmt_pct, fmt_share, evidence_label, evidence_labels, evidence_rows, fmt_us,
                     fmt_value, memory_peak_where, module_path, printable, ranges_text, ranks_phrase, shift_at,
                     steps_phrase, unit_label)


SKIPPED_TAIL = "; skipped"  # the store's and the trace admission's own ending of a problem that left a file out


def problem_text(p: str) -> str:
    """One of ``report.problems`` under a heading or prefix that says "skipped" already: without its own "; skipped"
    ending (a new-user trial's "skipped: rank1.json: another job (...); skipped")."""
    return p.removesuffix(SKIPPED_TAIL)


def problem_line(p: str, side: str = "") -> str:
    """One of ``report.problems`` as the CLI prints it, one line each: "skipped: ...", or "run ended: ..." for how a
    run ended where not every rank finished (nothing skipped: "skipped: rank 1 stopped first, after step 69", a
    new-user trial's first reading). ``side``: compare's "(A, PATH)"."""
    lead = "run ended" if p.endswith(RUN_END_TAIL) else "skipped"
    return f"{lead}{f' {side}' if side else ''}: {problem_text(p)}"


_RANK_IN_TEXT = re.compile(r"(?<![A-Za-z])(rank ?)(\d+)")  # "rank 3", "rank3.6.pt.trace.json.gz"


def folded_problems(problems: list[str], least: int = 3) -> list[str]:
    """``report.problems`` with those that differ only in the rank they name (each naming one rank, as many times as
    it likes) folded into the first of them, from ``least`` such on: "... rank 1 ... (the same for ranks 2–15)". A
    16-rank run traced on rank 0 only listed 15 "skipped: profiler/rankN.6.pt.trace.json.gz: ... missing" lines,
    a 512-rank job's would be 511; the JSON keeps each."""
    groups: dict[object, list[tuple[int, str]]] = {}
    for i, p in enumerate(problems):
        ranks = {int(m.group(2)) for m in _RANK_IN_TEXT.finditer(p)}
        if len(ranks) == 1:
            groups.setdefault(_RANK_IN_TEXT.sub(lambda m: m.group(1) + "#", p), []).append((ranks.pop(), p))
        else:  # (naming no rank or several: a line of its own)
            groups[i] = [(-1, p)]
    out = []
    for members in groups.values():
        if len(members) < least:
            out += [p for _, p in members]
            continue
        out.append(f"{members[0][1]} (the same for ranks {ranges_text(r for r, _ in members[1:])})")
    return out


def printable_report(report: Report) -> Report:
    """The report with every text (keys included) stripped of control characters, for a terminal: module, file
    and host names come from the user's run and may carry escape sequences (``units.printable``)."""
    import msgspec

    def clean(v):
        if isinstance(v, str):
            return printable(v)
        if isinstance(v, dict):
            return {clean(k): clean(x) for k, x in v.items()}
        if isinstance(v, list):
            return [clean(x) for x in v]
        return v

    data = report.to_builtins()
    cleaned = clean(data)
    return report if cleaned == data else msgspec.convert(cleaned, Report)


def short_unit_labels(names) -> dict:
    """Display names for a set of FSDP unit names: each dotted name shortened to its shortest suffix that no other
    unit shares, never from an index ("model.layers.3" -> "layers.3", "model.norm" -> "norm"; a diffusers UNet's
    "down_blocks.0.attentions.0" beside "down_blocks.1.attentions.0" stays whole, not "0.attentions.0"); grouped units
    ("a, b") shorten each member, and of more than two the first and the last are shown ("experts.0, … experts.3
    (4 modules)": at 80 columns the whole list wrapped to column 0, out of the tree); the root is "(root)". A unit
    inside a wrapper is named by its module path (``module_path``: "layers.0._checkpoint_wrapped_module" read
    "0._checkpoint_wrapped_module", the layer's name dropped: a new-user trial), and the wrapper's own unit, where
    it is one too, as the call that made it ("checkpoint_wrapper(layers.0)": one word, which the unit column does
    not wrap out of the tree); the fixes name the real paths."""
    names = [n for n in dict.fromkeys(names) if n is not None]
    raw = {p.strip() for n in names if n for p in str(n).split(",")}
    members = {module_path(m) for m in raw}

    def short(m: str) -> str:
        path = module_path(m)
        if not path:  # the root, or a module inside the root's wrapper (its own name)
            return m or ROOT_LABEL
        parts, label = path.split("."), path
        for k in range(2 if parts[-1].isdigit() and len(parts) > 1 else 1, len(parts) + 1):
            if parts[-k].isdigit() and k < len(parts):  # never from an index: "0.attentions.0" of down_blocks.0's
                continue
            suffix = ".".join(parts[-k:])
            if sum(1 for o in members if o == suffix or o.endswith("." + suffix)) == 1:
                label = suffix
                break
        wrapper = next((w for seg, w in WRAPPER_SEGMENTS.items() if f"{m}.{seg}" in raw), None)
        return f"{wrapper}({label})" if wrapper else label

    def group(n: str) -> str:
        parts = [short(p.strip()) for p in str(n).split(",")]
        return ", ".join(parts) if len(parts) <= 2 else f"{parts[0]}, … {parts[-1]} ({len(parts)} modules)"

    return {n: group(n) for n in names}


UNKNOWN = "unknown"  # a figure this torch's FSDP2 internals did not let the recorder read (None in the records)


def fmt_unit_figures(u: UnitRow) -> tuple[str, str, str, str]:
    """(params, shard, gathered, reshard) of a unit-table row; ``unknown`` where the record has None."""
    pc, raf = u.param_count, u.reshard_after_forward
    return (UNKNOWN if pc is None else f"{pc / 1e6:.2f} M",
            *(UNKNOWN if b is None else fmt_bytes(b) for b in (u.sharded_bytes, u.unsharded_bytes)),
            UNKNOWN if raf is None else str(raf).lower())


def fmt_checkpoint(u: UnitRow) -> str:
    """A unit-table row's AC cell: what checkpointing wraps ("unit", "children", ...), "sel" before it where the
    checkpointing is selective (its policy saves some operators' outputs: torchtitan's default)."""
    return f"sel {u.checkpoint}" if getattr(u, "checkpoint_selective", False) else u.checkpoint


def run_facts(run: RunFacts) -> list[str]:
    """The short facts of a run for a header line: ranks, units, parameters, backend, device, versions, the trace
    files read (``run``: ``report.run``)."""
    r = run
    facts = []
    if r is None:
        return facts
    if r.world_size:
        mesh = f" ({fmt_mesh(r.mesh)})" if r.mesh else ""
        facts.append(f"{r.world_size} rank{'s' if r.world_size != 1 else ''}{mesh}")
        if r.ranks and len(r.ranks) < r.world_size:  # a rank's records missing: say whose are read
            facts[-1] += f" (records of rank{'s' if len(r.ranks) > 1 else ''} {', '.join(map(str, r.ranks[:8]))})"
    if r.units:
        facts.append(f"{r.units} FSDP unit{'s' if r.units != 1 else ''}")
    if r.model_param_count:
        facts.append(params_fact(r) + " params")
    if moe := experts_fact(r):
        facts.append("MoE: " + moe)
    for v in (r.backend, r.device_name, r.torch_version, optimizer_fact(r)):
        if v:
            facts.append(str(v))
            if v is r.torch_version and r.torch_lacks:  # what fixes cannot use on it (a new-user trial on 2.6)
                facts[-1] += f" (lacks {', '.join(r.torch_lacks[:3])}{' …' if len(r.torch_lacks) > 3 else ''})"
    if r.mixed_precision:
        facts.append(f"mixed precision: {r.mixed_precision}")
    if r.offload:
        facts.append(str(r.offload))
    if r.nccl_version:
        facts.append(f"NCCL {r.nccl_version}")
    if r.trace_ranks and len(r.trace_ranks) != (r.world_size or 0):
        facts.append(f"traces of rank{'s' if len(r.trace_ranks) > 1 else ''} "
                     f"{', '.join(map(str, r.trace_ranks[:8]))}{' …' if len(r.trace_ranks) > 8 else ''}")
    if r.facts_source:
        facts.append(f"read from the {r.facts_source}")
    if r.trace_files:
        facts.append(f"{r.trace_files} trace file{'s' if r.trace_files > 1 else ''}")
    if r.trace_files_unread:
        facts.append(f"{r.trace_files_unread} left out (listed at the end)")  # unreadable, or another job's
    return facts


def params_fact(r: RunFacts) -> str:
    """"0.18 M (1.5% trainable)": the model's parameters, and the trainable share where some are frozen."""
    if not r.model_param_count:
        return ""
    trainable = r.model_trainable_param_count or None  # UNSET, None (not read) or 0: not shown
    frozen = trainable is not None and trainable < r.model_param_count
    return (f"{r.model_param_count / 1e6:.2f} M"
            + (f" ({100 * trainable / r.model_param_count:.2g}% trainable)" if frozen else ""))


def experts_fact(r: RunFacts) -> str:
    """"top-2 of 4 experts" for a mixture of experts whose routing was read ("" otherwise)."""
    ex = r.experts or None
    return (f"top-{ex.top_k} of {ex.num_experts} experts" + (f" ({fmt_mesh(ex.mesh)})" if ex.mesh else "")
            if ex and ex.top_k and ex.num_experts else "")


def optimizer_fact(r: RunFacts) -> str:
    """"AdamW foreach (2 param groups)": the optimizer's class, how torch steps it where read (RunFacts.optimizer_impl)
    and its groups where there are several; "AdamW in backward (24 per-parameter optimizers)" where it steps inside
    the backward."""
    groups = len(r.optimizer_groups or [])
    if r.optimizer and r.optimizer_in_backward:
        return f"{r.optimizer} in backward ({r.optimizer_in_backward} per-parameter optimizers)"
    name = f"{r.optimizer} {r.optimizer_impl}" if r.optimizer and r.optimizer_impl else r.optimizer or ""
    return f"{name} ({groups} param groups)" if name and groups > 1 else name


SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}  # worst first
SEVERITY_COLORS = {"critical": "#C62828", "warning": "#E0A100", "info": "#1E88E5"}


def severity_count(n: int, severity: str) -> str:
    """``1 warning``, ``2 notes``, ``1 critical``: info findings are notes."""
    word = {"info": "note"}.get(severity, severity)
    return f"{n} {word}" + ("s" if n != 1 and word != "critical" else "")


def severity_counts(items: list[Finding]) -> str:
    """``1 critical, 2 warnings, 1 note`` ("none" without findings)."""
    n = {sev: sum(f.severity == sev for f in items) for sev in SEVERITY_ORDER}
    return ", ".join(severity_count(k, s) for s, k in n.items() if k) or "none"


def findings_headline(items: list[Finding], rules: list | None = None, verdict: Optional[Verdict] = None) -> str:
    """The line above the findings, the same in every presenter: "Healthy" only when nothing was found, at least
    half the rules (``report.rules``, where given) could check the run, and the step (``verdict``, where given) is
    bound by compute; a plain trace lets few of them check (most need the doctor's records), and "Healthy" then
    claimed what was never looked at; and "Healthy" under "Verdict: communication-bound (54% of the step)" (gloo,
    whose overlap levers gain nothing measurable: a new-user trial) read as a clean bill of the step."""
    checked = sum(r.status != "skipped" for r in rules or [])
    few = (f"only {checked} of {len(rules)} rules could check this run: the others need what it lacks (fsdp-doctor "
           "analyze --explain lists them)") if rules and 2 * checked < len(rules) else ""
    if not items:
        job = verdict.job if verdict is not None else None
        if not few and job is not None and job.bound != "compute":
            share = job.groups_pct.get(job.bound)
            return (f"No findings, though the step is {job.bound}-bound"
                    + (f" ({fmt_share(share / 100)})" if share is not None else "")
                    + ": no rule found a lever that gains measurably here (fsdp-doctor analyze --explain says why "
                      "each stayed quiet).")
        return f"No findings, but {few}." if few else "Healthy: no findings."
    if not any(f.severity in ("critical", "warning") for f in items):
        # (a plain trace's "No warnings" read as a clean bill where most rules never looked: a new-user trial)
        return f"No warnings, but {few}; {severity_counts(items)} below." if few else \
            f"No warnings; {severity_counts(items)} below, each with its measured cost."
    return severity_counts(items) + "." + (f" Only {few.removeprefix('only ')}." if few else "")


def fix_heading(rec, inputs: bool = True) -> str:
    """The line above a fix's code: where it goes in the user's script and (``inputs``), for a fix that reads names
    of the user's code, what they are ("Fix (Python, after your fully_shard calls):")."""
    where, lang = FIX_PLACES.get(rec.where, ""), FIX_LANGUAGES.get(rec.where, "Python")
    head = f"Fix ({lang}, {where}):" if where else f"Fix ({lang}):"
    if rec.inputs and inputs:
        head += " " + fix_inputs(rec)
    return head


def fixes_note(findings) -> str:
    """One line over the findings where any fix is Python code: the names it reads of the user's script (a new-user
    trial's model named ``m`` met ``NameError: name 'model' is not defined`` pasting a fix as printed); "" for none."""
    python = [f.recommendation.where for f in findings
              if f.recommendation.code and f.recommendation.where not in FIX_LANGUAGES]
    # (a torchtune recipe's fixes name its own `model` in _setup_model and `self._model` in train())
    if not python or all(w.startswith("torchtune_") for w in python):
        return ""
    if all(w.startswith("olmo_") for w in python):  # (an OLMo-core run's: its configs, train module and Trainer)
        return ("The fixes call OLMo-core's objects as its example scripts do (`train_module_config`, `train_module`, "
                "`trainer`): rename them to yours where you paste.")
    return ("The fixes call your model `model` and your optimizer `optimizer`: rename them "
            "to yours where you paste.")


def fix_inputs(rec) -> str:
    """The names of the user's code a fix reads, and what they are ("mesh: the mesh your fully_shard calls pass");
    "" for none."""
    return "; ".join(f"{k}: {v}" for k, v in (rec.inputs or {}).items())


def predicted_text(pred) -> str:
    """A finding's expected change, e.g. "step 110.0 ms → 130.0 ms, peak 24.00 MiB → 10.00 MiB"; "" when it predicts
    neither (``pred``: ``Finding.predicted``, a ``Predicted`` or UNSET)."""
    if not pred:
        return ""
    bits = []
    most = "≤ " if getattr(pred, "at_most", False) else ""  # ceilings: the fix gains at least this much
    if pred.step_ms_delta is not None:
        b, a = pred.step_ms_before, pred.step_ms_after
        step = "mean step" if getattr(pred, "step_mean", False) else "step"
        if b and abs(b - a) < 0.005 * b:  # under 0.5%: "0% faster" read as a gain of nothing, a warning's included
            bits.append(f"{step} {fmt_ms(b)} unchanged")
        else:
            # (a ceiling on the step after: a gain of at least, a slowdown of at most, that share)
            bound = ("≥ " if a <= b else "≤ ") if most else ""
            pct = f" ({bound}{abs(100 * (b - a) / b):.0f}% {'faster' if a <= b else 'slower'})" if b else ""
            bits.append(f"{step} {fmt_ms(b)} → {most}{fmt_ms(a)}{pct}")
    if pred.peak_bytes_delta is not None:
        if pred.peak_bytes_delta == 0:
            bits.append(f"peak {fmt_bytes(pred.peak_bytes_before)} unchanged")
        else:
            peak_most = "≤ " if most or getattr(pred, "peak_at_most", False) else ""
            bits.append(f"peak {fmt_bytes(pred.peak_bytes_before)} → {peak_most}{fmt_bytes(pred.peak_bytes_after)}")
    return ", ".join(bits)


def comm_headline(comm: CommSummary | None) -> str | None:
    """The report's one exposed-communication figure with its source, the same text in every presenter
    (``comm``: ``report.comm``)."""
    c = comm
    if c is None or c.exposed_ms_per_step is None:
        return None
    txt = f"Exposed communication: {fmt_ms(c.exposed_ms_per_step)} per step"
    if c.comm_ms_per_step is not None:
        txt += f" of {fmt_ms(c.comm_ms_per_step)} in collectives ({fmt_pct(c.overlap_pct)} overlapped)"
    return txt + f"; source: {c.source_text or c.source}, median over ranks"


# --- the communication tables (report.overlap): the terminal's and the HTML's columns and titles, one definition
# (the HTML's per-rank table had 5 of the terminal's 10 columns, under the heading "Collectives per unit": a new-user
# trial)
OVERLAP_RANKS_TITLE = "Communication per complete profiled step, per rank (overlap %: whole window, as HTA)"
OVERLAP_RANKS_HEADER = ("rank", "dev", "steps", "step", "comm", "hidden", "exposed", "overlap", "blocked AG",
                        "copies exp.")


def overlap_keys(sec: OverlapSection) -> dict:
    """Each rank's exposed communication per profiled step (ms): the key ``ranks_shown`` picks the overlap table's
    ranks by."""
    return {r: pr.exposed_ms_per_step for r, pr in sec.per_rank.items()}


def overlap_rank_rows(sec: OverlapSection, ranks: Optional[list] = None) -> list[tuple[str, ...]]:
    """Per rank (of ``ranks`` only where given), per complete profiled step (OverlapRank's ``*_per_step``
    figures); the overlap % is HTA's, over the whole window; host-blocking all-gathers in the window; exposed
    host-device copies (only where there are any)."""
    rows = []
    for rank in sorted(sec.per_rank if ranks is None else ranks, key=int):
        pr = sec.per_rank[rank]
        blk = sec.blocking.get(rank) or Blocking()
        cp = sec.copies.get(rank)
        rows.append((
            str(rank), pr.device, f"{pr.step_count}" if pr.step_count else "–", fmt_ms(pr.step_ms),
            fmt_ms(pr.comm_ms_per_step), fmt_ms(pr.hidden_ms_per_step), fmt_ms(pr.exposed_ms_per_step),
            fmt_pct(pr.overlap_pct), f"{blk.count} in window" if blk.count else "0",
            fmt_us(cp.exposed_us) if cp is not None and (cp.h2d_us or cp.d2h_us) else "–"))
    return rows


def comm_units_title(rows: list[CommUnitRow], top: int) -> str:
    """The per-unit collectives table's title: "FSDP units, worst exposure first, per profiled step (top 15 of
    34)"."""
    fsdp = any(r.unit != OTHER_UNIT for r in rows)  # (a DDP trace's all-reduces read "FSDP units": a new-user trial)
    title = ("FSDP units" if fsdp else "Collectives (no FSDP unit in the traces)") + \
        ", worst exposure first, per profiled step"
    return title + (f" (top {top} of {len(rows)})" if len(rows) > top else "")


COMM_UNITS_HEADER = ("rank", "unit", "op", "calls", "comm", "exposed", "size", "bus BW", "slack", "held")
_COLL = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "broadcast": "BC",
         "send_recv": "SR", "all_to_all": "A2A"}
# (a phase not here was cut to its first 3 letters: a gradient norm's all-reduce read "AR gra", a new-user trial)
_PHASE = {"forward": "fwd", "backward": "bwd", "grad_norm": "norm", "model": "model", "loss": "loss"}


def comm_unit_rows(rows: list[CommUnitRow], top: int, names=()) -> list[tuple[str, ...]]:
    """The per-unit collectives' first ``top`` rows, the terminal's and the HTML's cells (the HTML had its own
    columns and full unit names, "model.layers.2.mlp.down_proj" beside the terminal's "2.mlp.down_proj": a new-user
    trial). ``names``: every unit's name the run knows, so a label is unambiguous among all the units, not only
    among those with collectives in this table (an MoE's ``experts.2`` of one layer read as if the only one)."""
    labels = short_unit_labels([*(r.unit for r in rows), *names])
    out = []
    for r in rows[:top]:
        op = _COLL.get(r.collective, r.collective[:4])
        if r.phase:
            op += " " + _PHASE.get(r.phase, r.phase[:3])
        out.append((str(r.rank), labels[r.unit], op, MISSING if r.count_per_step is None else f"{r.count_per_step:.3g}",
                    fmt_ms(r.comm_ms_per_step), fmt_ms(r.exposed_ms_per_step), fmt_bytes(r.bytes_per_call),
                    fmt_bw(r.busbw_gbps), fmt_us(r.slack_us, signed=True), fmt_us(r.held_us)))
    return out


def left_out_note(sec: OverlapSection | None) -> str | None:
    """Under the per-rank communication: the profiler steps the trace figures leave out (``steps_left_out``: a
    window's last, where it may be cut), with why; None where none is."""
    by: dict[str, dict[str, set]] = {}  # why -> step -> ranks
    for r, pr in (sec.per_rank if sec is not None else {}).items():
        for step, why in pr.steps_left_out.items():
            by.setdefault(why, {}).setdefault(step, set()).add(r)
    parts = []
    for why, steps in by.items():
        ranks = set().union(*steps.values())
        where = "" if ranks == set(sec.per_rank) else f" on {ranks_phrase(sorted(ranks, key=int))}"
        parts.append(f"{steps_phrase(steps)}{where}, the last of {'its' if len(steps) == 1 else 'each'} profiler "
                     f"window ({why})")
    return ("Left out of the complete steps: " + "; ".join(parts)) if parts else None


def slack_note(sec: OverlapSection) -> str | None:
    """Under the per-unit collectives, what their all-gathers' slack and held columns mean (None without FSDP
    units' rows)."""
    if any(r.unit != OTHER_UNIT for r in sec.per_unit):
        return ("Slack: need − finish of the all-gather (negative: compute waited). Held: gathered params unused "
                "before need.")
    return None


def unit_exposed_note(sec: OverlapSection | None, rank=None) -> str | None:
    """Beside the per-unit collectives, on gloo (CPU ranks): why their exposed times add up to less than the rank's
    and the verdict's. A unit row's is its collective as gloo's thread ran it, not under compute; the rank's also
    counts the main thread's waits around each call (issuing it, waiting for gloo's thread, waking after it): a
    new-user trial's rank 0 read 30.1 ms over its rows beside 66.1 ms exposed (its verdict's 48% of 137.9 ms), on 2
    shared cores. Its figures are ``rank``'s (else the first CPU rank's). None on a GPU, where both count the
    collectives' kernels, or without rows."""
    if sec is None or not sec.per_unit:
        return None
    rows: dict[str, float] = {}
    for u in sec.per_unit:
        if u.exposed_ms_per_step is not None:
            rows[str(u.rank)] = rows.get(str(u.rank), 0.0) + u.exposed_ms_per_step
    cpu = sorted((r for r, pr in sec.per_rank.items() if pr.device == "cpu" and r in rows
                  and pr.exposed_ms_per_step is not None), key=int)
    if not cpu:
        return None
    r = str(rank) if str(rank) in cpu else cpu[0]
    return (f"Exposed per unit (gloo): the collective on gloo's thread; the rank's exposed time and the verdict also "
            f"count the main thread's waits around each call (rank {r}: {fmt_ms(rows[r])} over all its rows, "
            f"{fmt_ms(sec.per_rank[r].exposed_ms_per_step)} exposed).")


# --- the verdict (report.verdict, fsdp_doctor.analyze.verdict): one sentence and one table in every presenter
# Each column is a sum of the verdict's ``shares_pct`` parts (% of the step); "model comm" and "other comm" are drawn
# in the bar only
# (the table's "comm" holds it), "comm" in the table only (the bar shows its parts).
VERDICT_PARTS: dict[str, tuple[str, ...]] = {
    "compute": ("compute", "other_gpu"),
    "comm": Breakdown.COMM_PARTS,
    "AG fwd": ("allgather_fwd",), "AG bwd": ("allgather_bwd",), "RS": ("reducescatter",),
    "model comm": ("model_comm",), "other comm": ("other_comm",), "offload": ("offload",), "host": ("host", "sync"),
    "input": ("input",), "idle": ("idle",),
}
VERDICT_COLUMNS = tuple(k for k in VERDICT_PARTS if k not in ("model comm", "other comm"))  # the table's columns
VERDICT_SEGMENTS = tuple(k for k in VERDICT_PARTS if k != "comm")  # the bar's segments (they add up to 100%)
#: a larger job's per-rank tables (and the verdict's bars) show this many ranks: those where a problem shows (the
#: slowest steps, the highest peaks, the most exposed communication) and the other end beside them; one line says
#: how many are left out and what their figures span. The JSON report keeps every rank.
RANKS_SHOWN = 8


def rank_order(rank) -> int:
    """A rank's place in rank order (its key as a number; a key that is none first)."""
    return int(rank) if str(rank).isdigit() else -1


def ranks_shown(keys: dict, most: int = RANKS_SHOWN, pin=()) -> tuple[list, list]:
    """(shown, left out), each in rank order, of the ranks ``keys`` gives a figure for (None: none known): every rank
    where there are ``most`` or fewer; else the ranks of ``pin`` (a straggler: in a synchronous job every rank's step
    is as long as its, a 16-rank run's rank 11 late by 300 ms a step had the 6th-highest p50), the ranks without a
    figure (a rank that recorded no steady step stands out), the ``most - 1`` with the highest figure, and the one
    with the lowest (``most`` 1: the highest). A 16-rank run's step, throughput and communication tables and peak
    lines listed every rank, and its memory table at 100 columns kept ranks 0-3, naming the other 12: at a 512-rank
    job's scale, pages of rows."""
    ranks = sorted(keys, key=rank_order)
    if len(ranks) <= most:
        return ranks, []
    known = sorted((r for r in ranks if keys[r] is not None), key=lambda r: -keys[r])  # (ties: in rank order)
    pinned = {str(p) for p in pin}
    pick = [r for r in ranks if str(r) in pinned][:most]
    pick += [r for r in ranks if keys[r] is None and r not in pick][:most - len(pick)]
    known = [r for r in known if r not in pick]
    pick += known[:max(0, most - (1 if most > 1 else 0) - len(pick))]
    if len(pick) < most and known and known[-1] not in pick:
        pick.append(known[-1])
    chosen = set(pick)
    return [r for r in ranks if r in chosen], [r for r in ranks if r not in chosen]


def ranks_shown_words(shown: int, total: int, high: str, low: str) -> str:
    """A figure's title's words for the ranks it draws of a larger job (``ranks_shown``): ", 8 of 16 ranks (the
    slowest steps and the fastest)"; "" where it draws them all."""
    if shown >= total:
        return ""
    return f", {shown} of {total} ranks ({high}" + (f" and {low})" if shown > 1 else ")")


def ranks_left_out_line(left: list, keys: dict, what: str, fmt, also: str = "") -> str:
    """The line under a table that leaves ``left`` ranks out (``ranks_shown``): how many, and what their ``what``
    figures (``keys``, formatted by ``fmt``) span; ``also``: the ranks pinned, in words; "" where none is left
    out."""
    if not left:
        return ""
    vals = [keys[r] for r in left if keys[r] is not None]
    lo, hi = (min(vals), max(vals)) if vals else (None, None)
    span = "" if lo is None else f", {what} {fmt(lo)}" + ("" if fmt(lo) == fmt(hi) else f" to {fmt(hi)}")
    return (f"{len(left)} more ranks not shown{span} (shown: the highest {what} and the lowest"
            + (f", {also}" if also else "") + "; the JSON report has every rank)")


def verdict_share(entry: VerdictEntry, column: str) -> float:
    """% of the step in ``column`` (a key of VERDICT_PARTS) for one verdict entry (a rank or the job)."""
    sh = entry.shares_pct if entry is not None else {}
    return sum(sh.get(k, 0.0) for k in VERDICT_PARTS[column])


def verdict_headline(section: Verdict, rank=None) -> str:
    """The verdict's sentence: the job's (or, with ``rank``, that rank's) summary (``section``: ``report.verdict``)."""
    v = section
    entry = v.per_rank.get(str(rank)) if rank is not None else None
    return f"Verdict, rank {rank}: {entry.summary}" if entry is not None else f"Verdict: {v.job.summary}"


def verdict_title(section: Verdict) -> str:
    return f"Verdict: % of the step ({section.job.source})"


def verdict_steps(section: Verdict) -> str:
    """What the verdict's step column is, after its title: the mean of the profiled (or steady) steps each rank's
    entry covers, not the step table's p50 (a new-user trial read 962.0 ms there, 898.7 ms in the step table and
    948.5 ms in a finding, none of them said); "" where no entry counts its steps."""
    counts = sorted({v.steps for v in section.per_rank.values() if v.steps})
    if not counts:
        return ""
    kind = "profiled" if section.job.source.startswith("trace") else "steady"
    if counts == [1]:
        return f"; step: its one {kind} step"
    return f"; step: the mean of {counts[0] if len(counts) == 1 else 'its'} {kind} steps"


VERDICT_HEADER = ("rank", "bound", "step", *VERDICT_COLUMNS)


def verdict_rows(section: Verdict, max_ranks: int = RANKS_SHOWN) -> list[tuple[str, ...]]:
    """The verdict's table rows (VERDICT_HEADER's columns, as text): ``max_ranks`` ranks (``ranks_shown``: the
    slowest steps and the fastest), a "+N more ranks" row, and the job's row (first cell "job") when there is more
    than one rank."""
    def row(name, v: VerdictEntry):
        return (name, v.bound, fmt_ms(v.step_ms) if v.step_ms is not None else "",
                *(f"{verdict_share(v, c):.1f}" for c in VERDICT_COLUMNS))

    sec = section
    shown, left = ranks_shown({r: v.step_ms for r, v in sec.per_rank.items()}, max_ranks,
                              pin=() if sec.job.read_on is None else [sec.job.read_on])  # (the straggler)
    out = [row(str(r), sec.per_rank[r]) for r in shown]
    if left:
        out.append((f"+{len(left)}", "more ranks", *[""] * (len(VERDICT_HEADER) - 2)))
    if len(sec.per_rank) > 1:
        job = row("job", sec.job)
        if sec.job.read_on is not None:  # the straggler's own step (its row above the same figures, unlabelled)
            job = (job[0], f"{job[1]} (rank {sec.job.read_on})", *job[2:])
        out.append(job)
    return out


# --- the step, throughput and outlier tables: the same cells in the terminal and the HTML report
def fmt_ms_cell(x) -> str:
    """A time in ms in a table whose header names the unit: "12.3", "2.50"; "—" when unknown."""
    if x is None:
        return MISSING
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


STEPS_TITLE = ("Step time per rank, ms (steady state: the first step and the doctor's own steps, its profiler "
               "windows and full memory counts, left out)")
TRACED_STEPS_TITLE = "Step time per rank, ms (the traces' complete profiler steps; the phase split needs records)"
STEPS_HEADER = ("rank", "steps", "p50", "p90", "p99", "max", "cv", "fwd", "bwd", "optim", "outside", "GC")
STEP_PHASES = ("forward", "backward", "optimizer", "outside", "gc")


def steps_traced(section: StepsSection) -> bool:
    """The step figures are the traces' (no records: no phase split). Records always total their steps' GC
    (``gc_ms_total``), which a trace does not time: a recorded run whose forward and backward the doctor did not see
    has no phase split either, and its table read "the traces' complete profiler steps" (a compiled step function's,
    a new-user trial). (Not ``excluded``: a trace's steps leave out a window's last where it may be cut.)"""
    per = section.per_rank
    return bool(per) and all(st.count and not st.phases_p50_ms and st.gc_ms_total is UNSET for st in per.values())


def steps_title(section: StepsSection) -> str:
    if steps_traced(section):
        return TRACED_STEPS_TITLE
    kept = sorted({s for steps in section.counted_kept.values() for s in steps})
    if kept:  # a short run: the doctor's slower memory-counting steps are in the figures
        return ("Step time per rank, ms (the first step and the doctor's profiler windows left out; its full memory "
                f"counts in step{'s' if len(kept) > 1 else ''} {', '.join(map(str, kept))} kept, as fewer than 3 "
                "steps would remain: they run slower)")
    return STEPS_TITLE


def no_steady_text(section: StepsSection) -> str | None:
    """One line where the records hold steps but none is a steady one (a run of 1 or 2 steps: step 0 is FSDP's
    lazy initialisation, step 1 the doctor's FLOP count), in place of a table of dashes; None otherwise."""
    per = section.per_rank
    recorded = sorted({st.recorded or 0 for st in per.values()})
    if not per or any(st.count for st in per.values()) or not any(recorded):
        return None
    n = str(recorded[0]) if len(recorded) == 1 else f"{recorded[0]}-{recorded[-1]}"
    short = recorded[-1] <= 2
    return (f"Step time: no steady step to time. Each rank recorded {n} step{'s' if recorded[-1] > 1 else ''}, "
            f"{'all ' if recorded[-1] > 1 else ''}left out of the statistics (step 0 is FSDP's lazy initialisation; "
            "the doctor's FLOP-counting and profiler steps are its own)"
            + (": a run of 3 steps or more gives step times and the verdict." if short else "."))


def steps_keys(section: StepsSection) -> dict:
    """Each rank's step p50 (ms; None without a steady step): the key ``ranks_shown`` picks the step and throughput
    tables' ranks by (the stragglers pinned: ``steps_ranks``)."""
    return {r: st.p50_ms if st.count else None for r, st in section.per_rank.items()}


def steps_ranks(section: StepsSection) -> tuple[list, list]:
    """The step and throughput tables' ranks, (shown, left out): ``ranks_shown`` by step p50, the stragglers
    always."""
    return ranks_shown(steps_keys(section), pin=[s.rank for s in section.stragglers])


def steps_rows(section: StepsSection, ranks: Optional[list] = None) -> list[tuple[str, ...]]:
    """The step table's rows (STEPS_HEADER's columns, as text), one per rank (``section``: ``report.steps``; those of
    ``ranks`` only where given), and with two ranks or more the job's (every rank's steps together: the step p50 the
    findings and compare quote, which no row showed)."""
    out = []
    rows = [(r, st) for r, st in section.per_rank.items() if ranks is None or r in ranks]
    if len([st for st in section.per_rank.values() if st.count]) > 1 and section.job is not None and section.job.count:
        rows.append(("job", section.job))
    for r, st in rows:
        if not st.count:
            out.append((r, f"{st.recorded or 0}", *[MISSING] * (len(STEPS_HEADER) - 2)))
            continue
        ph = st.phases_p50_ms or {}
        out.append((r, str(st.count), *(fmt_ms_cell(v) for v in (st.p50_ms, st.p90_ms, st.p99_ms, st.max_ms)),
                    f"{100 * st.cv:.1f}%" if st.cv is not None else MISSING,
                    *(fmt_ms_cell(ph.get(k)) for k in STEP_PHASES)))
    return out


OUTLIERS_HEADER = ("rank", "step", "time", "median", "likely cause")
OUTLIERS_SHOWN = 8


def outliers_title(outliers: list[Outlier]) -> str:
    return f"Outlier steps ({len(outliers)}, worst first)"


def outlier_rows(outliers: list[Outlier], top: int = OUTLIERS_SHOWN) -> list[tuple[str, ...]]:
    """The outlier table's rows (OUTLIERS_HEADER's columns): the ``top`` worst steps."""
    return [(str(x.rank), str(x.step), fmt_ms(x.ms), fmt_ms(x.median_ms), x.detail) for x in outliers[:top]]


def _kept_apart(per: dict, saves: bool = False) -> tuple[list[int], str, float, str]:
    """Over the ranks' NoGradSteps or CheckpointSteps (``saves``): their steps, those steps as shown (six at most),
    the median of the ranks' time per such step (ms), and whether the statistics leave them out, in words."""
    steps = sorted({s for x in per.values() for s in x.steps})
    shown = ", ".join(map(str, steps[:6])) + (f", … {len(steps) - 6} more" if len(steps) > 6 else "")
    kept = ("left out of the step statistics above" if all(x.excluded for x in per.values())
            else "kept in the step statistics above (too few steps without)"
            + (", their saves' time taken out" if saves else ""))
    return steps, shown, statistics.median([x.ms_p50 for x in per.values()]), kept


def no_grad_text(section: StepsSection) -> str | None:
    """One line on the steps that also ran the model without gradients (evaluation, generation), over the ranks;
    None when none did."""
    per = section.no_grad
    if not per:
        return None
    steps, shown, ms, kept = _kept_apart(per)
    forwards = max(ng.forwards for ng in per.values())
    autograd = max(ng.with_autograd for ng in per.values())
    autograd_txt = f" ({autograd} in eval mode with autograd on)" if autograd else ""
    traced = sorted(set(steps) & {s for ps in section.profiler_steps.values() for s in ps.get("window", [])})
    every = all(ng.every_step for ng in per.values())
    traced_txt = (f"; step{'s' if len(traced) > 1 else ''} {', '.join(map(str, traced))} of a profiler window: "
                  f"the trace's figures include {'them' if every else 'the evaluation'}" if traced else "")
    if every and len(steps) > 1:  # (part of every step: a reference forward, not an evaluation between steps)
        return (f"Forward passes without gradients in every step (a reference forward through the model, as DPO's "
                f"with its adapters off; a teacher's): {forwards}{autograd_txt} in {len(steps)} steps, "
                f"{fmt_ms(ms)} per step, counted apart from forward and outside, part of the step statistics"
                f"{traced_txt}")
    return (f"Forward passes without gradients (evaluation, generation): {forwards}{autograd_txt} in {len(steps)} "
            f"step{'s' if len(steps) != 1 else ''} ({shown}), {fmt_ms(ms)} per step, counted apart from forward "
            f"and outside; those steps are {kept}{traced_txt}")


def checkpoint_text(section: StepsSection) -> str | None:
    """One line on the steps that saved a checkpoint, over the ranks (the saves' share: the largest rank's of its
    recorded time); None when none did."""
    per = section.checkpoints
    if not per:
        return None
    steps, shown, ms, kept = _kept_apart(per, saves=True)
    saves = max(c.saves for c in per.values())
    # the rank whose saves take the largest share, as checkpoint.blocking quotes it: its share and its save time
    # (the median rank's time beside the largest share read 93.2 ms here and 97.5 ms in the finding)
    timed = [(r, c) for r, c in per.items() if c.wall_ms_total > 0]
    share, which, around = 0.0, "", ""
    if timed:
        rank, top = max(timed, key=lambda rc: rc[1].ms_total / rc[1].wall_ms_total)
        share, ms = 100.0 * top.ms_total / top.wall_ms_total, top.ms_p50
        which = f" (rank {rank})" if len({c.ms_p50 for c in per.values()}) > 1 else ""
        if top.unmarked_ms:  # work around the marked saves, counted as theirs (analyze.steps.checkpoint_steps)
            around = f", {fmt_ms(top.unmarked_ms)} of it outside the saves' marks"
    kind = " (asynchronous: the staging the step waits for)" if all(c.async_saves == c.saves for c in per.values()) \
        else ""
    aside = sorted({st for c in per.values() for st in c.profiled})
    aside_text = f" (step{'s' if len(aside) > 1 else ''} {', '.join(map(str, aside))} profiled: aside)" if aside else ""
    return (f"Checkpoint saves: {saves}{kind} in step{'s' if len(steps) != 1 else ''} ({shown}), {fmt_ms(ms)} each, "
            f"{fmt_share(share / 100, 1)} of the recorded time{which}{around}{aside_text}; counted apart from outside; "
            f"those steps are {kept}")


def compile_text(section: StepsSection) -> str | None:
    """One line on the steps in which torch.compile compiled, over the ranks (the compiles and time of the rank that
    compiled longest), and those in which a rank waited for another's compile; None when none did."""
    per = section.compiled
    if not per:
        return None
    steps = sorted({s for c in per.values() for s in c.steps})
    waited = sorted({s for c in per.values() for s in c.waited} - set(steps))
    kept = ("left out of the step statistics above" if all(c.excluded for c in per.values())
            else "kept in the step statistics above (too few steps without)")
    out = "torch.compile compiled"
    if steps:
        rank, top = max(per.items(), key=lambda rc: rc[1].ms_total)
        which = f" on rank {rank}" if len(per) > 1 else ""
        # (compiles: frames Dynamo compiled and backwards compiled lazily; "5 graphs" read for 2 unique ones)
        out += (f" in step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}: {top.graphs} "
                f"compile{'s' if top.graphs != 1 else ''}{breaks_text(top)}, {fmt_ms(top.ms_total)}{which}")
    if waited:
        out += (f"{';' if steps else ''} a rank waited for another's compile in step{'s' if len(waited) > 1 else ''} "
                f"{', '.join(map(str, waited))}")
    return out + f"; those steps are {kept}"


def breaks_text(c) -> str:
    """", 2 graph breaks (both at FSDP2's hooks ...)": the graph breaks Dynamo met compiling a rank's steps
    (``CompileSteps``), and those at FSDP2's hooks; "" where it met none."""
    n, fsdp = c.graph_breaks, c.fsdp_hook_breaks
    if not n:
        return ""
    which = "" if n == 1 else "both " if n == fsdp == 2 else "all " if n == fsdp else f"{fsdp} "
    cause = (f" ({which}at FSDP2's hooks, which torch.compile runs outside its graphs: FSDP's, not the doctor's)"
             if fsdp else "")
    return f", {n} graph break{'s' if n != 1 else ''}{cause}"


def skipped_text(section: StepsSection) -> str | None:
    """One line on the steps whose optimizer step the loop skipped, over the ranks; None when none did."""
    per = section.skipped
    if not per:
        return None
    steps = sorted({s for k in per.values() for s in k.steps})
    recorded = max(k.recorded for k in per.values())
    kept = ("left out of the step statistics above" if all(k.excluded for k in per.values())
            else "kept in the step statistics above (too few steps without)")
    shown = ", ".join(map(str, steps[:6])) + (f", … {len(steps) - 6} more" if len(steps) > 6 else "")
    return (f"{len(steps)} of {recorded} steps skipped the optimizer step (step{'s' if len(steps) > 1 else ''} "
            f"{shown}): a backward whose gradients were dropped with no step of the optimizer given to watch() (a "
            f"NaN/inf guard, GradScaler); those steps are {kept}")


def repeated_text(section: StepsSection) -> str | None:
    """One line on doctor.step() calls repeated with nothing run since the call before, over the ranks (the rank
    with the most); None when none was."""
    if not section.repeated:
        return None
    after = max(section.repeated.values(), key=len)
    steps = sorted(set(after))
    shown = ", ".join(map(str, steps[:6])) + (f", … {len(steps) - 6} more" if len(steps) > 6 else "")
    n = len(after)
    return (f"doctor.step() was called again after step{'s' if len(steps) > 1 else ''} {shown} with nothing run since "
            f"the call before (no forward, backward or optimizer step): {n} call{'s' if n > 1 else ''} not counted as "
            "steps; call it once per optimizer step")


def apart_texts(section: StepsSection) -> list[tuple[str, str]]:
    """The lines on steps whose extra work the statistics keep apart, each with its key ("compile": torch.compile
    compiling, "skipped": optimizer steps skipped, "no-grad": evaluation, "checkpoint": checkpoint saves), and on
    doctor.step() calls that are no step ("repeated"): what every presenter shows under the step table."""
    return [(key, line) for key, line in (("repeated", repeated_text(section)),
                                          ("compile", compile_text(section)), ("skipped", skipped_text(section)),
                                          ("no-grad", no_grad_text(section)),
                                          ("checkpoint", checkpoint_text(section)),
                                          ("other-models", other_models_text(section)),
                                          ("level-shift", level_shift_text(section)),
                                          ("doctor", doctor_text(section)))
            if line is not None]


def level_shift_text(section: StepsSection) -> Optional[str]:
    """The step time that changed mid-run and stayed: the statistics above hold every part (jitter.level_shift says
    what changed); None where it did not."""
    ls = section.level_shift
    if ls is None:
        return None
    if ls.drift_line:
        (a, ms_a), (b, ms_b) = ls.drift_line
        return (f"The step time {ls.drift_verb()} steadily, {fmt_ms(ls.drift_ms_per_step(), signed=True)} "
                f"a step ({fmt_ms(ms_a)} at step {int(a)} to {fmt_ms(ms_b)} at step {int(b)}, a line through the "
                "steps); the statistics above hold every step (jitter.level_shift)")
    at = shift_at(ls)
    levels = (" -> ".join(f"{fmt_ms(ms)} from step {int(a)}" for a, _, ms in ls.levels[1:]) if ls.levels else
              f"{fmt_ms(ls.ms_after)} after ({ls.steps_after})")
    return (f"The step time changed {at} and stayed: {fmt_ms(ls.ms_before)} before ({ls.steps_before} steps), "
            f"{levels}, medians; the statistics above hold every part (jitter.level_shift)")


def other_models_text(section: StepsSection) -> Optional[str]:
    """Of the time outside the model, another FSDP2 model's forward and backward inside the steps (a distillation's
    teacher, a DPO reference model, a GAN's other network): model work the verdict counts as compute, not the data
    loading "outside" suggests (a knowledge-distillation trial read 77 of its 249 ms step outside, 41 of them its
    teacher's forward); None where no step ran one."""
    per = {r: (st.phases_p50_ms or {}).get("other_models") for r, st in section.per_rank.items() if st.count}
    per = {r: v for r, v in per.items() if v}
    if not per:
        return None
    r, ms = max(per.items(), key=lambda kv: kv[1])
    outside = (section.per_rank[r].phases_p50_ms or {}).get("outside")
    of = f" of the {fmt_ms(outside)}" if outside else ""
    # (its passes: a teacher's or a DPO reference's forward alone, a GAN's other network's forward and backward)
    return (f"Another FSDP2 model's passes (a teacher's, a reference model's) run inside the steps: "
            f"{fmt_ms(ms)}{of} per step outside the model (p50, rank {r}); model work, counted as compute in the "
            "verdict, not data loading")


def doctor_text(section: StepsSection) -> Optional[str]:
    """The doctor's own cost over the run, the rank where it was largest (a share the user can weigh against leaving
    it on), or None without step records."""
    own = {r: v for r, v in (section.doctor_own_ms or {}).items() if v and v[0] > 0 and v[1] > 0}  # (none: unsaid)
    if not own:
        return None
    ms, total, *every = max(own.values(), key=lambda v: v[0] / v[1])  # (the rank where it was most: a page filtered
    # to another rank reads no rank named)
    head = (f"The doctor's own work: {fmt_ms(ms)} of the {fmt_ms(total)} the steps took ({fmt_share(ms / total, 1)}"
            f"{', the most of any rank' if len(own) > 1 else ''}): ")
    if len(every) == 3 and every[1] > 0:
        # the cost of every step first, the one-off windows' apart, the total last: a 10-step run led with "3.97 s of
        # the 4.57 s the steps took (86.8%)", nearly all one window (torch's profiler stopping 2.5-2.9 s, the
        # window's garbage collected 1.1 s, the export 0.14-0.19 s on a loaded 2-core host), and read as 87% overhead
        # (a new-user trial)
        return (f"The doctor's own work: {fmt_ms(every[0])} per ordinary step ({fmt_share(every[0] / every[1], 1)} of "
                f"the median step), its records between steps; {fmt_ms(every[2])} once per profiler window or full "
                "memory count, not per step (those steps' time over the median step, left out of the statistics "
                f"above); in all {fmt_ms(ms)} of the {fmt_ms(total)} the steps took ({fmt_share(ms / total, 1)}"
                f"{', the most of any rank' if len(own) > 1 else ''})")
    if len(every) == 2 and every[1] > 0:  # (a 12-step run read "79.3%", nearly all one window's export, as a cost
        # per step: a new-user trial)
        return (head + f"{fmt_ms(every[0])} per ordinary step ({fmt_share(every[0] / every[1], 1)} of the median step), "
                "its records between steps; the rest once per profiler window or full memory count (those steps' "
                "time over the median step), left out of the statistics above")
    return (head + "its records between steps, its profiler windows and full memory counts (those steps' time over "
            "the median step), left out of the statistics above")


def straggler_text(s: Straggler) -> str:
    return (f"Straggler: rank {s.rank} spends +{s.excess_ms_per_step:.1f} ms/step in {s.phase} "
            f"({s.steps_slower} of {s.steps} steps)")


THROUGHPUT_HEADER = ("rank", "tokens/s", "TFLOP/s", "MFU", "HFU")


def fmt_tflops(x: float) -> str:
    """TFLOP/s to three significant figures from the thousandths down (a tiny CPU run's 0.00041 read "0.000")."""
    return f"{x:.3f}" if abs(x) >= 0.1 or x == 0 else f"{x:.3g}"


def throughput_cells(x: ThroughputRank | ThroughputJob) -> tuple[str, str, str, str]:
    """MFU: model FLOPs; HFU: with activation checkpointing's recompute (the same without checkpointing)."""
    return (MISSING if x.tokens_per_s is None else f"{x.tokens_per_s:,.0f}",
            MISSING if x.achieved_tflops is None else fmt_tflops(x.achieved_tflops),
            MISSING if x.mfu_pct is None else f"{x.mfu_pct:.1f}%",
            MISSING if x.hfu_pct is None else f"{x.hfu_pct:.1f}%")


def throughput_note(section: ThroughputSection) -> str:
    """Where the FLOPs are the analytic estimate, which parameters it counts; where counted FLOPs were scaled by
    batches that vary, that they were (every rank's distinct sentence); of several ranks, which one paces the job's
    tokens/s and FLOP rate."""
    notes = list(dict.fromkeys(r.flops_note for r in section.per_rank.values() if r.flops_note))
    slow = section.per_rank.get(section.job.paced_by or "")
    rates = " and ".join(what for what, x in (("tokens/s", section.job.tokens_per_s),
                                               ("TFLOP/s", section.job.achieved_tflops)) if x is not None)
    if slow is not None and rates and len(section.per_rank) > 1:
        # (a new-user trial's job read 2,243 tokens/s, 114.1 ms a step, beside the step table's job p50 112.9 ms:
        # the median over every rank's steps)
        notes.append(f"job {rates}: paced by the slowest rank, rank {section.job.paced_by} (step p50 "
                     f"{fmt_ms(slow.step_p50_ms)})")
    return "\n".join(notes)


def throughput_rows(section: ThroughputSection, ranks: Optional[list] = None) -> list[tuple[str, ...]]:
    """The throughput table's rows (THROUGHPUT_HEADER's columns): each rank (of ``ranks`` only where given), then
    the job's (first cell "job") when it knows a figure (``section``: ``report.throughput``)."""
    out = [(r, *throughput_cells(row)) for r, row in section.per_rank.items() if ranks is None or r in ranks]
    job = section.job
    if any(x is not None for x in (job.tokens_per_s, job.achieved_tflops, job.mfu_pct)):
        out.append(("job", *throughput_cells(job)))
    return out


# --- the memory section at the peak: the terminal's table cells and per-rank lines, for the HTML report
def memory_categories_shown(section: MemorySection) -> list[str]:
    """The categories of the breakdown at the peak, in the section's order: those held on some rank, or unknown."""
    from ..memory_categories import DEVICE

    per_rank = section.per_rank
    unknown = {c for pr in per_rank.values() for c in pr.unknown_categories or ()}
    return [c for c in list(section.categories or DEVICE)
            if c in unknown or any(pr.peak_breakdown.get(c) for pr in per_rank.values())]


def memory_keys(section: MemorySection) -> dict:
    """Each rank's peak (bytes): the key ``ranks_shown`` picks the memory table's ranks by."""
    return {r: pr.peak_bytes for r, pr in section.per_rank.items()}


def memory_rows(section: MemorySection, ranks: Optional[list] = None) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """(header, rows) of the breakdown at the peak: per category its bytes and % of the peak on each rank (of
    ``ranks`` only where given; "unknown" where this torch could not measure it), then the peak itself; the
    terminal's and the HTML's. A non-zero share never reads "0.0" (a new-user trial's buffers, 64 B of a 3.2 MiB
    peak: "<0.1")."""
    from ..memory_categories import label

    per_rank = section.per_rank
    ranks = sorted(per_rank if ranks is None else ranks, key=rank_order)
    shown = memory_categories_shown(section)
    header = ("category", *(x for r in ranks for x in (f"rank {r}", "%")))
    rows = []
    for c in shown:
        row = [label(c)]
        for r in ranks:
            pr = per_rank[r]
            v, peak = pr.peak_breakdown.get(c, 0) or 0, pr.peak_bytes or 0
            row += (["unknown", MISSING] if c in (pr.unknown_categories or ()) else
                    [fmt_bytes(v), fmt_share(v / peak, 1).rstrip("%") if peak else MISSING])
        rows.append(tuple(row))
    rows.append(("peak", *(x for r in ranks for x in (fmt_bytes(per_rank[r].peak_bytes), "100"))))
    return header, rows


def memory_lines(section: MemorySection, ranks: Optional[list] = None) -> list[tuple[str, str]]:
    """Per rank (of ``ranks`` only where given): where the peak happened, its share of the capacity, offloaded host
    bytes, tensors the optimizer holds that the model no longer uses, and the section's notes, as (text, kind:
    "info" | "error" | "warning"); the terminal's and the HTML's."""
    out = []
    for r in sorted(section.per_rank if ranks is None else ranks, key=rank_order):
        pr = section.per_rank[r]
        parts = [f"rank {r}: peak {fmt_bytes(pr.peak_bytes)} at {memory_peak_where(pr.peak_at)}"]
        if pr.capacity_bytes:
            parts.append(f"{fmt_share(pr.peak_bytes / pr.capacity_bytes)} of {fmt_bytes(pr.capacity_bytes)}")
        if pr.offloaded_host_bytes:
            parts.append(f"host (offloaded) {fmt_bytes(pr.offloaded_host_bytes)}")
        if pr.activations and pr.activations != "exact":
            parts.append(f"activations {pr.activations}")
        out.append(("; ".join(parts), "info"))
        if pr.stale_optimizer_params_bytes:
            out.append((f"rank {r}: the optimizer holds {fmt_bytes(pr.stale_optimizer_params_bytes)} of tensors the "
                        "model no longer uses (created before fully_shard)", "error"))
        out += [(f"rank {r}: {n}", "warning") for n in pr.notes or []]
    if section.unseen:
        out.append((section.unseen, "info"))
    return out


TRACE_MEMORY_HEADER = ("rank", "peak allocated", "step", "into step", "unit, phase")


def trace_memory_rows(section: MemorySection) -> list[tuple[str, ...]]:
    """A plain trace's memory (``section.source`` not "records"): per rank the allocator's peak over the complete
    steps, its step, its time from the step's start and the unit and phase it fell in (TRACE_MEMORY_HEADER)."""
    return [(r, fmt_bytes(pr.peak_bytes), MISSING if pr.peak_at.step is None else str(pr.peak_at.step),
             fmt_ms(pr.peak_at.t_ms), memory_peak_where(pr.peak_at).split(", ", 1)[-1])
            for r, pr in sorted(section.per_rank.items(), key=lambda kv: rank_order(kv[0]))]


TRACE_UNITS_HEADER = ("unit", "fwd", "bwd")


def units_not_run_note(units) -> str | None:
    """A line under the unit table naming the units that did not run in every steady step, whose medians are over
    the steps they ran; None where every unit ran in each."""
    part = [(u.name, u.timing_p50) for u in units
            if isinstance(getattr(u, "timing_p50", None), UnitTiming) and u.timing_p50.not_run]
    if not part:
        return None
    labels = short_unit_labels(u.name for u in units)
    shown = ", ".join(f"{labels[n]} ({t.samples} of {t.samples + t.not_run})" for n, t in part[:4])
    more = f", … {len(part) - 4} more" if len(part) > 4 else ""
    return (f"{len(part)} unit{'s' * (len(part) != 1)} did not run in every step (an expert no token reached, a "
            f"skipped layer): timed over the rank-steps they ran: {shown}{more}")


def units_hooks_timed_note(units) -> str | None:
    """A line under the unit table saying why the all-gather waits of the units timed from FSDP2's own hooks (inside
    another module's compiled frame: ``model = torch.compile(model)`` after sharding) read "—" beside their times;
    None where no unit is."""
    hooked = [u.name for u in units if getattr(u, "compiled_in_place", False) and getattr(u, "timing_p50", None)]
    if not hooked:
        return None
    return (f"AG wait —: {len(hooked)} unit{'s' * (len(hooked) != 1)} in a compiled frame ({fmt_list(hooked, 2)}) "
            f"timed by FSDP2's own hooks, whose spans hold each wait inside fwd and bwd; the doctor's hooks, which time "
            f"it apart, would break the graph")


def trace_units_title(units) -> str:
    """What a plain trace's unit table shows (``units``: ``TraceUnitRow``s), with its source."""
    # ("in ms": the terminal's cells are bare numbers, a new-user trial read 20.3 and 24.2 without a unit)
    return (f"FSDP units ({len(units)}): per-step medians in ms over {units[0].samples} rank-steps, each unit's own "
            f"time (nested units excluded); {units[0].source}")


MEMORY_UNITS_HEADER = ("unit", "sharded", "unsharded", "activations (own)", "activations (incl. nested)")


def memory_unit_rows(section: MemorySection) -> tuple[str, list[tuple[str, ...]]]:
    """(rank, rows) of the per-unit memory table on the peak rank (MEMORY_UNITS_HEADER's columns)."""
    ranks = sorted(section.per_rank, key=rank_order)
    top_rank = section.peak_rank or ranks[0]
    top = section.per_rank.get(top_rank) or section.per_rank[ranks[0]]
    units = [u for u in top.per_unit if u.activation_bytes is not None or u.sharded_bytes]
    return top_rank, [memory_unit_cells(u) for u in units]


def memory_unit_cells(u) -> tuple[str, ...]:
    """One unit's row of the per-unit memory table (MEMORY_UNITS_HEADER's columns), in every view."""
    return (unit_label(u.unit or ""), fmt_bytes(u.sharded_bytes), fmt_bytes(u.unsharded_bytes),
            fmt_bytes(None if u.activation_self_bytes is UNSET else u.activation_self_bytes),
            fmt_bytes(u.activation_bytes))


def exception_kinds(run: RunFacts) -> list[str]:
    """The kinds of exception the ranks' loops raised through watch() ("KeyboardInterrupt"), sorted; [] for none."""
    return sorted({v.split(":")[0] for v in (run.stopped_on or {}).values()})


class RunWarning(NamedTuple):
    """A line of the header's warnings: ``level`` "error" where the doctor stepped aside (what it recorded stops
    there), "note" for how some figures were measured (compiled units), "warning" otherwise; the terminal and the
    HTML colour it by its level."""
    text: str
    level: str = "warning"


def run_warnings(run: RunFacts) -> list[RunWarning]:
    """What the header warns of: the traces of some ranks only, how some figures were measured (notes), and where the
    doctor stepped aside. How ranks stopped is one of the report's problems (store.reader.run_end_line), printed as
    the others are: the header told it in words of its own, the JSON not at all (a new-user trial)."""
    out = []
    traced = run.trace_ranks if run.trace_ranks is not UNSET else None
    if traced and run.world_size and len(traced) < run.world_size and not run.steps_recorded:
        gone = [r for r in range(run.world_size) if r not in traced]
        whose = f"rank {traced[0]}'s" if len(traced) == 1 else "those ranks'"
        out.append(f"the traces hold {len(traced)} of the job's {run.world_size} ranks (no trace of rank"
                   f"{'s' * (len(gone) > 1)} {', '.join(map(str, gone[:8]))}{' …' if len(gone) > 8 else ''} here): "
                   f"the figures are {whose}, and a straggler among the others cannot be seen")
    out = [RunWarning(w) for w in out]
    out += [RunWarning(n, "note") for n in (run.notes or [])]
    out += [RunWarning(f"doctor stepped aside on rank {e.rank} at step {e.step} ({e.where}): {e.message}", "error")
            for e in run.doctor_errors or []]
    return out


