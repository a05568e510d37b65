"""Number formatting with units, shared by every presenter (terminal, HTML, dashboard, TensorBoard tags).

One convention everywhere: memory and message sizes in binary units (B, KiB, MiB, GiB: powers of 1024);
bandwidth in decimal units (MB/s, GB/s: powers of 1000, as NCCL's and nccl-tests' bus bandwidth); times in
µs below a millisecond, then ms, then s; a missing value is "—"; the root FSDP unit is "(root)".
"""

from __future__ import annotations


from ..report_sections import CommSummary, Finding, RunFacts, UnitRow, Verdict, VerdictEntry
from ..units import MISSING, fmt_bw, fmt_bytes, fmt_ms, fmt_pct, fmt_us, fmt_value  # noqa: F401  (re-exported)

ROOT_LABEL = "(root)"


def unit_label(name) -> str:
    """Display name of an FSDP unit: "" is the root; None (outside every unit) is "—"."""
    if name is None:
        return MISSING
    return ROOT_LABEL if name == "" else str(name)


def short_unit_labels(names) -> dict:
    """Display names for a set of FSDP unit names: each dotted name shortened to its shortest suffix that no other
    unit shares, never a bare index ("model.layers.3" -> "layers.3", "model.norm" -> "norm"); grouped units
    ("a, b") shorten each member; the root is "(root)"."""
    names = [n for n in dict.fromkeys(names) if n is not None]
    members = {m for n in names if n for m in (p.strip() for p in str(n).split(","))}

    def short(m: str) -> str:
        parts = m.split(".")
        for k in range(2 if parts[-1].isdigit() and len(parts) > 1 else 1, len(parts) + 1):
            suffix = ".".join(parts[-k:])
            if sum(1 for o in members if o == suffix or o.endswith("." + suffix)) == 1:
                return suffix
        return m

    return {n: unit_label(n) if not n else ", ".join(short(p.strip()) for p in str(n).split(",")) for n in names}


UNKNOWN = "unknown"  # a figure this torch's FSDP2 internals did not let the recorder read (None in the records)


def fmt_unit_figures(u: UnitRow) -> tuple[str, str, str, str]:
    """(params, shard, gathered, reshard) of a unit-table row; ``unknown`` where the record has None."""
    pc, raf = u.param_count, u.reshard_after_forward
    return (UNKNOWN if pc is None else f"{pc / 1e6:.2f} M",
            *(UNKNOWN if b is None else fmt_bytes(b) for b in (u.sharded_bytes, u.unsharded_bytes)),
            UNKNOWN if raf is None else str(raf).lower())


def run_facts(run: RunFacts) -> list[str]:
    """The short facts of a run for a header line: ranks, units, parameters, backend, device, versions
    (``run``: ``report.run``)."""
    r = run
    facts = []
    if r is None:
        return facts
    if r.world_size:
        facts.append(f"{r.world_size} ranks")
    if r.units:
        facts.append(f"{r.units} FSDP units")
    if r.model_param_count:
        facts.append(f"{r.model_param_count / 1e6:.2f} M params")
    for v in (r.backend, r.device_name, r.torch_version, r.optimizer):
        if v:
            facts.append(str(v))
    if r.nccl_version:
        facts.append(f"NCCL {r.nccl_version}")
    if r.trace_ranks and len(r.trace_ranks) != (r.world_size or 0):
        facts.append(f"traces of rank{'s' if len(r.trace_ranks) > 1 else ''} "
                     f"{', '.join(map(str, r.trace_ranks[:8]))}{' …' if len(r.trace_ranks) > 8 else ''}")
    if r.facts_source:
        facts.append(f"read from the {r.facts_source}")
    return facts


def findings_headline(items: list[Finding]) -> str:
    """The line above the findings, the same in every presenter: "Healthy" only when nothing was found."""
    if not items:
        return "Healthy: no findings."
    n = {sev: sum(f.severity == sev for f in items) for sev in ("critical", "warning", "info")}
    if not n["critical"] and not n["warning"]:
        return f"No warnings; {n['info']} note{'s' if n['info'] > 1 else ''} below, each with its measured cost."
    parts = [f"{n[s]} {s}{'s' if n[s] > 1 else ''}" for s in ("critical", "warning") if n[s]]
    if n["info"]:
        parts.append(f"{n['info']} note{'s' if n['info'] > 1 else ''}")
    return ", ".join(parts) + "."


def predicted_text(pred) -> str:
    """A finding's expected change, e.g. "step 110.0 ms → 130.0 ms, peak 24.00 MiB → 10.00 MiB"; "" when it predicts
    neither (``pred``: ``Finding.predicted``, a free-form mapping, or UNSET)."""
    if not pred:
        return ""
    bits = []
    if pred.get("step_ms_before") is not None and pred.get("step_ms_after") is not None:
        bits.append(f"step {fmt_ms(pred['step_ms_before'])} → {fmt_ms(pred['step_ms_after'])}")
    if pred.get("peak_bytes_before") is not None and pred.get("peak_bytes_after") is not None:
        bits.append(f"peak {fmt_bytes(pred['peak_bytes_before'])} → {fmt_bytes(pred['peak_bytes_after'])}")
    return ", ".join(bits)


def comm_headline(comm: CommSummary | None) -> str | None:
    """The report's one exposed-communication figure with its source, the same text in every presenter
    (``comm``: ``report.comm``)."""
    c = comm
    if c is None or c.exposed_ms_per_step is None:
        return None
    txt = f"Exposed communication: {fmt_ms(c.exposed_ms_per_step)} per step"
    if c.comm_ms_per_step is not None:
        txt += f" of {fmt_ms(c.comm_ms_per_step)} ({fmt_pct(c.overlap_pct)} overlapped)"
    return txt + f"; source: {c.source_text or c.source}, median over ranks"


# --- the verdict (report.verdict, fsdp_doctor.analyze.verdict): one sentence and one table in every presenter
# Each column is a sum of the verdict's ``shares_pct`` parts (% of the step); "other comm" is drawn in the bar only
# (the table's "comm" holds it), "comm" in the table only (the bar shows its parts).
VERDICT_PARTS: dict[str, tuple[str, ...]] = {
    "compute": ("compute", "other_gpu"),
    "comm": ("allgather_fwd", "allgather_bwd", "reducescatter", "other_comm"),
    "AG fwd": ("allgather_fwd",), "AG bwd": ("allgather_bwd",), "RS": ("reducescatter",),
    "other comm": ("other_comm",), "offload": ("offload",), "host": ("host", "sync"), "input": ("input",), "idle": ("idle",),
}
VERDICT_COLUMNS = tuple(k for k in VERDICT_PARTS if k != "other comm")  # the table's share columns
VERDICT_SEGMENTS = tuple(k for k in VERDICT_PARTS if k != "comm")  # the bar's segments (they add up to 100%)
VERDICT_MAX_RANKS = 8  # ranks listed one by one; the rest are counted


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


VERDICT_HEADER = ("rank", "bound", "step", *VERDICT_COLUMNS)


def verdict_rows(section: Verdict, max_ranks: int = VERDICT_MAX_RANKS) -> list[tuple[str, ...]]:
    """The verdict's table rows (VERDICT_HEADER's columns, as text): the first ``max_ranks`` ranks, a "+N more
    ranks" row, and the job's row (first cell "job") when there is more than one rank."""
    def row(name, v: VerdictEntry):
        return (name, v.bound, fmt_ms(v.step_ms) if v.step_ms is not None else "",
                *(f"{verdict_share(v, c):.1f}" for c in VERDICT_COLUMNS))

    sec = section
    ranks = list(sec.per_rank.items())
    out = [row(str(r), v) for r, v in ranks[:max_ranks]]
    if len(ranks) > max_ranks:
        out.append((f"+{len(ranks) - max_ranks}", "more ranks", *[""] * (len(VERDICT_HEADER) - 2)))
    if len(ranks) > 1:
        out.append(row("job", sec.job))
    return out
