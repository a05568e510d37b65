"""Presenting a :class:`~fsdp_doctor.compare_sections.Comparison`: the tables every presenter shows (title,
header, rows of formatted strings), drawn by the terminal (rich, here), the HTML compare report and the
dashboard's Compare page. Formats only; the figures come from ``fsdp_doctor.analyze.compare``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from rich.console import Console
from rich.markup import escape

from ..compare_sections import Comparison, Delta, PredictionCheck
from ..memory_categories import label as category_label
from .fit import Col, fitted_table
from .fmt import MISSING, fmt_bytes, fmt_list, fmt_ms, fmt_us, unit_label

# ("between": the part of the time outside the model between optimizer.step() and the next forward, not a phase
# beside it: read as one, the phases added up to more than the step)
PHASE_LABELS = {"forward": "forward", "backward": "backward", "optimizer": "optimizer", "outside": "outside model",
                "between": "  of which between steps", "gc": "GC"}
# the settings' values are text (unit names, lists of them): wrapped, never dropped (at 80 columns A and B were left
# out and the units cut: a new-user trial)
CONFIG_HEADER = ("setting", "where", "in A", "in B")
THROUGHPUT_LABELS = {"tokens_per_s": ("tokens/s", "{:,.0f}"), "achieved_tflops": ("TFLOP/s", "{:.3g}"),
                     "mfu_pct": ("MFU", "{:.1f}%")}


@dataclass
class CompareTable:
    title: str
    header: tuple[str, ...]
    rows: list[tuple[str, ...]] = field(default_factory=list)
    note: str = ""


def _signed_bytes(n) -> str:
    """"+421.75 KiB", "-195.25 KiB": the ASCII minus of every other figure (its Δ% beside it read "-100.0%")."""
    if n is None:
        return MISSING
    return ("+" if n >= 0 else "") + fmt_bytes(n)


def _pct(d: Delta) -> str:
    return MISSING if d.pct is None else f"{d.pct:+.1f}%"


def _row(name: str, d: Delta, fmt: Callable, signed: Callable) -> tuple[str, ...]:
    return (name, fmt(d.a), fmt(d.b), signed(d.delta), _pct(d))


def _ms_signed(x) -> str:
    return fmt_ms(x, signed=True)


def _value(v) -> str:
    if isinstance(v, list):  # the units a unit prefetches: the root's name is "" (a new-user trial read
        # "backward_prefetch (root) none none" for the root set to prefetch itself)
        return fmt_list(v, len(v)) or "none"
    return MISSING if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def _units(names: list[str], n: int = 4) -> str:
    return fmt_list(names, n) if names else "job"


def _units_differ(names: list[str]) -> str:
    """The wrapping row's units, in one side only: how many, and which ("2 units differ" alone named none: a new-user
    trial)."""
    return f"{'1 unit differs' if len(names) == 1 else f'{len(names)} units differ'}: {_units(names, 3)}"


def tables(c: Comparison) -> list[CompareTable]:
    """Every section of the comparison as a table (empty sections left out)."""
    out: list[CompareTable] = []
    if c.config:
        out.append(CompareTable("Configuration changed", CONFIG_HEADER,
                                [(ch.key, _units(ch.units) if ch.key != "wrapping" else
                                  _units_differ(ch.units), _value(ch.a), _value(ch.b)) for ch in c.config]))
    else:
        traces = "trace" in (c.a.source, c.b.source)
        out.append(CompareTable("Configuration", CONFIG_HEADER, [],
                                note="no difference in the units and the prefetching the traces show, nor in the "
                                     "all-gathers' dtypes and sizes (where their args give them) and the host's "
                                     "blocking in them (a plain trace holds no settings: reshard_after_forward, the "
                                     "reduce dtype and offload are not read)"
                                if traces else "no difference in the unit snapshots and the job"))
    rows = []
    for name, s in (("p50", c.step_p50), ("p90", c.step_p90)):
        if s is not None:
            ci = MISSING if s.ci_low is None else f"{fmt_ms(s.ci_low, True)} … {fmt_ms(s.ci_high, True)}"
            rows.append((f"step {name}", fmt_ms(s.a), fmt_ms(s.b), _ms_signed(s.delta), _pct(s), ci,
                         "yes" if s.significant else s.reason or "within noise"))
    if rows:
        n = c.step_p50
        out.append(CompareTable("Step time", ("", "A", "B", "Δ", "Δ%", f"{round(100 * n.confidence)}% CI of Δ",
                                              "significant"), rows,
                                note=f"bootstrap over steps, each step's times on every rank kept together "
                                     f"({n.samples_a} rank-steps in A, {n.samples_b} in B): it covers the "
                                     "step-to-step noise within each run, not the variation between two runs (host "
                                     "load, clocks)"))
    if c.phases:
        src = f"the {c.phases_source}" if c.phases_source != "mixed" else f"A's {c.a.source}, B's {c.b.source}"
        out.append(CompareTable(f"Phase split (ms per step, from {src})", ("phase", "A", "B", "Δ", "Δ%"),
                                [_row(PHASE_LABELS.get(k, k), d, fmt_ms, _ms_signed) for k, d in c.phases.items()
                                 if d.a or d.b]))
    if c.memory_peak is not None:
        rows = [_row("peak", c.memory_peak, fmt_bytes, _signed_bytes)]
        rows += [_row(category_label(k), d, fmt_bytes, _signed_bytes) for k, d in c.memory.items() if d.a or d.b]
        out.append(CompareTable("Memory at the peak (highest rank)", ("category", "A", "B", "Δ", "Δ%"), rows))
    if c.comm_exposed is not None or c.comm:
        rows = [_row("exposed, all", c.comm_exposed, fmt_ms, _ms_signed)] if c.comm_exposed is not None else []
        rows += [(f"{unit_label(r.unit)} {r.collective} {r.phase or ''}".rstrip(), fmt_ms(r.a_ms), fmt_ms(r.b_ms),
                  _ms_signed(r.delta_ms), MISSING if r.pct is None else f"{r.pct:+.1f}%") for r in c.comm]
        # (rows are unit x collective x phase: "the 12 of 14 units' rows" read as units, of which there were 5)
        shown = "; ".join(
            ([f"the {len(c.comm)} of {c.comm_rows} rows (unit, collective, phase) that changed most"]
             if c.comm_rows > len(c.comm) else [])
            + (["Δ% of A's figure: — where A has no such row"] if any(r.pct is None for r in c.comm) else []))
        out.append(CompareTable(f"Exposed communication (ms per step, from the {c.comm_source or 'reports'})",
                                ("unit, collective, phase", "A", "B", "Δ", "Δ%"), rows, note=shown))
    if c.throughput:
        rows = []
        for k, d in c.throughput.items():
            name, f = THROUGHPUT_LABELS.get(k, (k, "{}"))
            scale = 1.0
            if k == "achieved_tflops" and max(abs(x or 0) for x in (d.a, d.b)) < 1:  # (a CPU run's read "0  0  -0")
                name, scale = "GFLOP/s", 1e3
            fm = (lambda x, f=f, scale=scale: MISSING if x is None else f.format(x * scale))
            # (Δ in the figures' own format, signed: "+1.01e+03" tokens/s, a new-user trial)
            rows.append((name, fm(d.a), fm(d.b), MISSING if d.delta is None else f.replace("{:", "{:+").format(
                d.delta * scale),
                         _pct(d)))
        out.append(CompareTable("Throughput", ("", "A", "B", "Δ", "Δ%"), rows))
    if c.cost is not None:
        k = c.cost
        fm = (lambda x: MISSING if x is None else f"{x:,.2f}")
        out.append(CompareTable(f"Cost per billion tokens at {k.gpu_hour_price:g} per GPU-hour",
                                ("", "A", "B", "Δ", "Δ%"),
                                [("cost", fm(k.a), fm(k.b), MISSING if k.delta is None else f"{k.delta:+,.2f}",
                                  _pct(Delta(pct=k.pct)))], note=k.note))
    f = c.findings
    rows = [(kind, x.code, x.severity, x.title + (f" ({said}{x.why})" if x.why else ""))
            for kind, said, xs in (("resolved", "", f.resolved), ("not resolved", "", f.below_threshold),
                                   ("not checked in B", "B: ", f.unchecked), ("new", "", f.new),
                                   ("persisting", "", f.persisting)) for x in xs]
    out.append(CompareTable("Findings", ("", "code", "severity", "title"), rows,
                            note="" if rows else "no finding in either run"))
    if c.predictions:
        # three columns, one figure a line (six columns split "predicted" and "315.5 ms" at 80 columns: a new-user
        # trial); a line break reads as a space in the HTML
        rows = []
        for p in c.predictions:
            held = {True: "held", False: "missed", None: "not checked"}
            step = (f"{fmt_ms(p.step_ms_predicted)} ({p.step_pct_predicted:+.0f}%)\n→ {fmt_ms(p.step_ms_measured)} "
                    f"({p.step_pct_measured:+.0f}%):\n{p.step_verdict or MISSING}"
                    if p.step_ms_predicted is not None else
                    # (a fix whose gain the step statistics leave out: its share of the time, e.g. the saves')
                    share_cell(p) if p.share_pct_measured is not None else MISSING)
            # a miss says which side of the prediction the peak landed (a saving larger than predicted read "missed"
            # as if the fix had failed: a new-user trial)
            verdict = (held[p.peak_held] if p.peak_held is not False else
                       f"missed: {'lower' if (p.peak_pct_error or 0) > 0 else 'higher'} than predicted")
            # (the prediction's error, said as one: "(+1.31%)" beside a measured peak 4% under A's read as its change,
            # a new-user trial)
            # (with the other fixes' peak changes it counts: B's peak is theirs too)
            peak = (f"{fmt_bytes(p.peak_bytes_predicted)}"
                    + (f" with the fix{'es' * (len(p.peak_with) > 1)} of {', '.join(p.peak_with)}"
                       if p.peak_with else "")
                    + f"\n→ {fmt_bytes(p.peak_bytes_measured)} "
                    f"({peak_error(p.peak_pct_error)}):\n{verdict}"
                    if p.peak_bytes_predicted is not None else MISSING)  # (5.04: missed)
            rows.append((f"{p.code} ({p.recognised_by})", step, peak))
        # (the peak's figure in parentheses is the prediction's error, not a change: "(+1.31%)" beside a measured peak
        # 4% under A's read as its change, a new-user trial)
        out.append(CompareTable("Predictions of A's findings, checked against B",
                                ("fix", "step: predicted → measured", "peak: predicted → measured"), rows,
                                note="step: each figure's change from A's step in parentheses; peak: the prediction's "
                                     "error against the measured peak (+: predicted above it)"
                                     + (SHARE_CHECK_NOTE if any(p.share_pct_measured is not None
                                                                for p in c.predictions) else "")))
    if c.ops:
        out.append(CompareTable("Kernels and operators whose time changed most (per step and rank)",
                                ("phase, kind: name", "A", "B", "Δ"),  # (one name column: it fits 80 columns)
                                [(f"{o.phase} {o.kind}: {o.name}", fmt_us(o.a_us), fmt_us(o.b_us),
                                  fmt_us(o.delta_us, True)) for o in c.ops]))
    return out


#: the predictions table's note where a share is checked (its cell: ``share_cell``)
SHARE_CHECK_NOTE = ("; share: the saves' share of the recorded time (checkpoint.blocking), held where it fell by "
                    "at least half the predicted drop, for async_save half of A's share (the most it gains is all of "
                    "it, less the copy to host memory)")


def share_cell(p: PredictionCheck) -> str:
    """A share check's cell (checkpoint.blocking's, by the alternative B took: its saves asynchronous, or less
    often, at B's interval, the advised one named where it differs), or what B did where nothing was checked."""
    held = {True: "held", False: "missed", None: "not checked"}
    share, got = f"share {p.share_pct_before:.1f}%", f"{p.share_pct_measured:.1f}%"
    if p.share_fix == "async_save":
        return (f"async_save: {share}\n→ the copy's only (held at\nhalf of it or under)\n→ {got}: "
                f"{held[p.share_held]}\n({fmt_ms(p.gain_ms_per_step_measured)} of at most "
                f"{fmt_ms(p.gain_ms_per_step_at_most)} per step gained)"
                + (f"\n({p.share_why})" if p.share_why else ""))
    if p.share_pct_predicted is not None:
        every, advised, n = p.share_every_b, p.share_every_advised, p.share_saves_b
        head = ("" if every is None else (f"1 save in {every:g} steps" if n == 1 else
                                           f"{n} saves, every {every:g} steps" if n else f"every {every:g} steps")
                + ("" if advised is None else ", as advised" if advised == every else f" (advised: every {advised})")
                + ":\n")
        return f"{head}{share} → {p.share_pct_predicted:.1f}%\n→ {got}:\n{held[p.share_held]}"
    return f"{share} → {got}:\nnot checked: {p.share_why}"


def side_text(side) -> str:
    """A side's line in the header: its path, source and steps (terminal and HTML)."""
    return f"{side.path} ({side.source}, {side.steps} step{'s' * (side.steps != 1)})"


def render_comparison(c: Comparison, console: Optional[Console] = None) -> None:
    """Prints the comparison (the terminal presenter)."""
    console = console or Console()
    # (a path longer than the terminal folds at its width: unwrapped, a checkout 12 characters deeper than CI's took
    # the header past 80 columns, where a run's path has no spaces to wrap at)
    console.print(f"[bold]fsdp-doctor compare[/]\n A: {escape(side_text(c.a))}\n B: {escape(side_text(c.b))}",
                  overflow="fold")
    console.print(f"[bold]{escape(c.summary)}[/]")  # (plain text, as the tables' cells: fit.fitted_table)
    for note in c.notes:
        console.print(f"[yellow]{escape(note)}[/]")
    for t in tables(c):
        if t.rows:
            console.print(fitted_table(t.title, _columns(t.header), t.rows, console.width, caption=t.note or None))
        else:
            console.print(f"[bold]{escape(t.title)}[/]: [dim]{escape(t.note)}[/]")


#: the columns that hold names or sentences (left-aligned, wrapping between words); the others hold figures,
#: which never wrap
TEXT_COLUMNS = {"setting", "where", "in A", "in B", "phase", "phase, kind: name", "title", "code", "severity",
                "unit, collective, phase", "fix", "step: predicted → measured", "peak: predicted → measured",
                "category"}


def peak_error(pct) -> str:
    """How far a predicted peak was from the measured one ("+1.31%": the prediction over it), one figure; the
    table's note says what it is."""
    if pct is None:
        return MISSING
    return f"{pct:+.2f}%"


def _columns(header: tuple[str, ...]) -> list[Col]:
    """The table's columns; where it is wider than the terminal, the step's confidence interval is left out first,
    then the changes in percent (the caption names them)."""
    return [Col(h, justify="left", wrap=True, fold=20 if h in CONFIG_HEADER[1:] else 40)
            if i == 0 or h in TEXT_COLUMNS
            else Col(h, drop=2 if h.endswith("CI of Δ") else 1 if h == "Δ%" else 0) for i, h in enumerate(header)]
