"""The pipeline: the one place that turns a run (records and/or Kineto traces, a step window) into the report,
message sizes and diagnosis included. The CLI (terminal, JSON, HTML), the dashboard and the TensorBoard export
all call it, so every presenter shows the same figures.

    from fsdp_doctor.pipeline import build_report
    report = build_report(load_run("traces/run1"))

Stages: records -> ``steps``, ``units``, ``throughput``, ``memory`` (``record_sections``); traces ->
``overlap`` with bytes and bus bandwidth filled from the unit snapshot where the trace has no message sizes
(``trace_section``); both -> ``comm``, the one exposed-communication figure (``comm_summary``); then the
diagnosis. Does not import torch.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Callable, Iterable, Optional

from . import __version__
from .analyze.report import fill_sizes_from_units, name_groups_as_records, run_facts, unit_table
from .analyze.steps import analyze_steps, usable_steps
from .analyze.throughput import analyze_throughput
from .records import config_unavailable
from .report_sections import CommRank, CommSummary, OverlapSection, Report
from .store import Run
from .store.reader import window_words
from .units import fmt_ms, ranks_phrase, steps_phrase

StepWindow = Optional[tuple[int, int]]

# What the headline exposed-communication figure means, shown next to it by every presenter.
COMM_DEFINITION_TRACE = ("communication time during which no compute ran (union of collectives minus its overlap "
                         "with compute) inside the complete profiled steps, per step, median over ranks: the "
                         "verdict's communication share of the step")
# a device this far behind the host at the window's start is said beside the figure's source (the window follows it)
LAG_SAID_MS = 1.0
COMM_DEFINITION_RECORDS = ("time compute waited for all-gathers (the recorder's unshard waits, forward and "
                           "backward), per step, median over ranks; reduce-scatters need a profiler trace")


def window_run(run: Run, window: StepWindow) -> Run:
    """The same run with only the steps inside ``window`` (inclusive), or ``run`` itself when None; of its profiler
    windows those whose steps all lie inside, and of its trace files theirs (a file no window of the records names,
    a plain trace beside them, is kept)."""
    if window is None:
        return run
    from .store.reader import RankData

    lo, hi = window
    inside = {r: [pw for pw in rd.profiles if pw.steps and lo <= min(pw.steps) and max(pw.steps) <= hi]
              for r, rd in run.ranks.items()}
    named = {(run.path / pw.path).resolve() for rd in run.ranks.values() for pw in rd.profiles}
    kept = {(run.path / pw.path).resolve() for pws in inside.values() for pw in pws}
    files = [f for f in run.trace_files if f.resolve() in kept or f.resolve() not in named]
    sub = Run(path=run.path, manifest=run.manifest, trace_files=files, problems=list(run.problems),
              trace_files_left_out=run.trace_files_left_out, steps_window=window)
    for r, rd in run.ranks.items():
        sub.ranks[r] = RankData(rank=r, header=rd.header, config=rd.config, profiles=inside[r],
                                errors=list(rd.errors), end=rd.end, gpu=dict(rd.gpu),
                                steps=[s for s in rd.steps if lo <= s.step <= hi])
    return sub


def steps_window_note(run: Run, sub: Run, window: tuple[int, int], flag: str = "--steps") -> str:
    """What ``analyze --steps`` (``flag``: compare's ``--steps-a``, ``--steps-b``) left out, in one line: the steps
    each rank recorded against those analysed, and the profiler windows outside."""
    span = window_words(window)
    had = max((len(rd.steps) for rd in run.ranks.values()), default=0)
    kept = max((len(rd.steps) for rd in sub.ranks.values()), default=0)
    windows = {tuple(pw.steps) for rd in run.ranks.values() for pw in rd.profiles}
    inside = {tuple(pw.steps) for rd in sub.ranks.values() for pw in rd.profiles}
    return (f"{span} only ({flag}): {kept} of the {had} steps a rank recorded"
            + (f"; {len(inside)} of {len(windows)} profiler window(s) inside, the others' traces left out"
               if windows else ""))


def record_sections(run: Run, window: StepWindow = None, *, memory: bool = True) -> dict:
    """The sections computed from the records, by the report's field name: ``steps`` (a ``StepsSection``),
    ``units`` (a list of ``UnitRow``), ``throughput`` (a ``ThroughputSection``) and ``memory`` (a
    ``MemorySection``), the last two only where the records give them (over the steps inside ``window`` only
    when given). Empty when the run has no records."""
    if not run.has_records:
        return {}
    sub = window_run(run, window)
    out: dict = {"steps": analyze_steps(sub), "units": unit_table(sub)}
    tp = analyze_throughput(sub)
    if tp:
        out["throughput"] = tp
    if memory:
        from .analyze.memory import analyze_memory

        mem = analyze_memory(sub)
        if mem:
            out["memory"] = mem
    return out


def trace_section(run: Run, *, windows: Optional[Iterable] = None,
                  progress: Optional[Callable[[int, int], None]] = None) -> Optional[OverlapSection]:
    """The ``overlap`` section: from already decoded ``windows`` (the dashboard caches them) or by reading
    ``run.trace_files``; bytes per call and bus bandwidth filled from the unit snapshot where the trace has
    no message sizes. None when there is nothing to analyse."""
    from .trace import analyze_traces, analyze_windows

    # (a trace that started after its rank's End record, or ended before its header, is another run's: trace.admit)
    ended = {r: rd.end.ended_ns / 1e9 for r, rd in run.ranks.items() if rd.end is not None}
    started = {r: rd.header.started_ns / 1e9 for r, rd in run.ranks.items() if rd.header and rd.header.started_ns}
    # the traces number the process group's ranks; where only some train, the run numbers them 0..n-1
    world_ranks = run.config.world_ranks if run.config is not None else []
    ranks = {g: i for i, g in enumerate(world_ranks)} or None
    if windows is not None:
        windows = list(windows)
        if not windows:
            return None
        ov = analyze_windows(windows, ended, started, ranks)
    elif run.trace_files:
        ov = analyze_traces(run.trace_files, progress=progress, ended=ended, started=started, ranks=ranks)
    else:
        return None
    name_groups_as_records(ov, run)
    fill_sizes_from_units(ov, run)
    return ov


def comm_summary(overlap: Optional[OverlapSection],
                 ag_waits: Optional[dict[str, float]] = None) -> Optional[CommSummary]:
    """The one exposed-communication figure of the report, with its definition and source: from the profiled
    windows' traces (the ``overlap`` section) when there are any, else from the recorder's all-gather waits
    (``ag_waits``: per rank, ms per step, see ``recorded_ag_waits``)."""
    rows: dict[str, CommRank] = {}
    for r, pr in (overlap.per_rank if overlap is not None else {}).items():
        if pr.exposed_ms_per_step is not None:  # per step over the complete steps (trace.analysis._per_step)
            rows[str(r)] = CommRank(exposed_ms_per_step=round(pr.exposed_ms_per_step, 3),
                                    comm_ms_per_step=round(pr.comm_ms_per_step, 3),
                                    overlap_pct=None if pr.step_overlap_pct is None else round(pr.step_overlap_pct, 1),
                                    steps=sorted(pr.steps))
    if rows:
        steps = sorted({s for v in rows.values() for s in v.steps})
        span = steps_phrase(steps)
        lags = [pr.device_lag_ms for pr in overlap.per_rank.values() if pr.device_lag_ms]
        if lags and max(lags) >= LAG_SAID_MS:  # the host ran ahead: the window followed the device
            span += f", the device {fmt_ms(statistics.median(lags))} behind the host"
        # the share overlapped is that of the two medians shown beside it (a median of the ranks' own shares
        # would not be 1 - exposed/collectives of the figures the headline prints)
        exposed = round(statistics.median(v.exposed_ms_per_step for v in rows.values()), 3)
        comm = round(statistics.median(v.comm_ms_per_step for v in rows.values()), 3)
        return CommSummary(
            source="trace", source_text=f"profiler trace, {span}", definition=COMM_DEFINITION_TRACE, per_rank=rows,
            exposed_ms_per_step=exposed, comm_ms_per_step=comm,
            overlap_pct=round(100.0 * (comm - exposed) / comm, 1) if comm > 0 else None)
    waits = ag_waits or {}
    if waits:
        return CommSummary(source="records", source_text="recorded all-gather waits",
                           definition=COMM_DEFINITION_RECORDS,
                           exposed_ms_per_step=round(statistics.median(waits.values()), 3),
                           per_rank={r: CommRank(exposed_ms_per_step=round(v, 3)) for r, v in waits.items()})
    return None


def recorded_ag_waits(run: Run) -> dict[str, float]:
    """Per rank, the median over steady steps of the all-gather waits the recorder measured (ms per step)."""
    out = {}
    for r, rd in sorted(run.ranks.items()):
        per_step = [sum(u.ag_wait_fwd_ms + u.ag_wait_bwd_ms for u in s.units) for s in usable_steps(rd.steps)]
        if per_step:
            out[str(r)] = statistics.median(per_step)
    return out


def build_report(run: Run, *, progress: Optional[Callable[[int, int], None]] = None, traces: bool = True,
                 windows: Optional[Iterable] = None, diagnosis: bool = True) -> Report:
    """The :class:`~fsdp_doctor.report_sections.Report` of ``run``: run facts, the record sections, the trace
    section (``traces=False`` skips it; ``windows`` gives pre-decoded trace windows instead of reading
    ``run.trace_files``), the exposed-communication headline (``comm``), the verdict, the findings and the
    problems met on the way."""
    report = Report(doctor_version=__version__, run=run_facts(run))
    problems = list(run.problems)
    for name, section in record_sections(run).items():
        setattr(report, name, section)
    if windows is not None or traces:
        report.overlap = trace_section(run, windows=windows, progress=progress)
        if report.overlap is not None:
            problems.extend(f"{s.file}: {s.error}" for s in report.overlap.skipped)
            _count_unread(report.run, report.overlap, run)
            if report.overlap.exit_windows:  # (torch.profiler's window at its exit, part of a normal folder: a
                # note, not a problem; as a skipped file it made analyze exit 3 under schedule(..., repeat=0), which
                # failed a new-user trial's CI check of the exit code)
                report.run.notes = [*(report.run.notes or []), *_exit_window_notes(report.overlap.exit_windows)]
            if report.overlap.evaluation_windows:  # (a note: the files are read, their steps are not training's)
                report.run.notes = [*(report.run.notes or []), _evaluation_windows_note(report.overlap)]
            if not run.has_records and (note := _nograd_note(report.overlap)):  # (records: eval.regather's)
                report.run.notes = [*(report.run.notes or []), note]
            if not run.has_records and (note := _micro_batch_note(report.overlap)):  # (records count optimizer steps)
                report.run.notes = [*(report.run.notes or []), note]
    if report.steps is None and report.overlap is not None:  # plain traces: the complete ProfilerSteps
        from .analyze.steps import trace_steps

        report.trace_steps = trace_steps(report.overlap)
    report.comm = comm_summary(report.overlap, recorded_ag_waits(run))
    from .analyze.steps import late_straggler
    from .analyze.verdict import verdict  # what bounds the step, per rank and for the job

    report.verdict = verdict(report.overlap, run, late_straggler(report.steps.stragglers if report.steps else []))
    if (gpu_blind := _no_device_activity(run, report)) is not None:
        # (a new-user trial's A100 trace without its device events read "host-bound 53%: 53% faster", exit 0)
        problems.append(gpu_blind)
        report.verdict = None
    skipped: list[str] = []
    if diagnosis:
        from .diagnose import diagnose

        statuses: list = []
        report.findings = diagnose(run, report, skipped=skipped, statuses=statuses)
        report.rules = statuses
    if run.config is not None:  # what this torch's FSDP2 did not let the recorder read (one line each)
        problems.extend(n for n in config_unavailable(run.config) if n not in problems)
    problems.extend(skipped)
    if not has_input(run):  # (the CLI says this line and stops; a script calling this got a healthy-looking report
        # of nothing, no finding and no problem: a new-user trial)
        problems.insert(0, unusable_reason(run.path, run, None))
    report.problems = problems
    return report


def _no_device_activity(run: Run, report: Report) -> Optional[str]:
    """Where plain traces name a GPU (deviceProperties) yet hold no device event: the profiler did not record CUDA
    activity, and what is left is the host's side of a GPU run, which no verdict reads as a CPU run's."""
    per_rank = report.overlap.per_rank if report.overlap is not None else {}
    if run.has_records or report.run.device != "cuda" or not per_rank or any(
            pr.device == "gpu" for pr in per_rank.values()):
        return None
    return (f"{report.run.path}: the traces name a GPU ({report.run.device_name}) but hold no device event (kernel, "
            "memcpy): the profiler did not record CUDA activity (torch.profiler.profile(activities="
            "[ProfilerActivity.CPU, ProfilerActivity.CUDA])); what the step waits for on the GPU cannot be read, so no "
            "verdict is given")


def _nograd_note(overlap) -> Optional[str]:
    """What the traces' figures hold where profiled steps ran forward passes without a backward (evaluation or
    generation between training steps: a new-user trial's 3 no-grad forwards a step read as 41% of the step in
    exposed forward all-gathers, with nothing saying the step held them)."""
    per = {r: pr.nograd_forwards for r, pr in sorted(overlap.per_rank.items()) if pr.nograd_forwards}
    if not per:
        return None
    rank, steps = max(per.items(), key=lambda kv: (len(kv[1]), sum(kv[1].values())))
    counts = sorted(set(steps.values()))
    n = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    of = sorted(overlap.per_rank[rank].step_times_ms, key=int)
    return (f"{len(steps)} of {len(of)} profiled steps ran {n} forward pass(es) without a backward (rank {rank}: "
            "evaluation or generation inside them): their all-gathers and compute are in these figures, the units' "
            "forward times, the exposed all-gathers and the verdict (watch()'s records tell them apart: "
            "eval.regather)")


def _evaluation_windows_note(overlap) -> str:
    """What became of the trace files whose every step only evaluated, beside their rank's training windows
    (``OverlapSection.evaluation_windows``)."""
    files = [f for fs in overlap.evaluation_windows.values() for f in fs]
    ranks = ", ".join(sorted(overlap.evaluation_windows, key=int))
    return (f"{len(files)} trace file(s) of rank(s) {ranks} hold only forward passes without a backward or an "
            f"optimizer step (an evaluation's own profiler window, as Lightning's profiler writes for validation_step: "
            f"{files[0]}{', ...' if len(files) > 1 else ''}): left out of the training figures")


def _micro_batch_note(overlap) -> Optional[str]:
    """What the traces' step figures are where the loop called prof.step() per micro-batch of gradient accumulation
    (most profiled steps without an optimizer.step(): trace.analysis.steps_per_optimizer_step): a new-user trial's
    report read its micro-batches as steps everywhere but in accum.sync_every_micro_batch's finding."""
    from .trace.analysis import MICRO_BATCH_STEPS_MIN, steps_per_optimizer_step

    per = {r: n for r, pr in sorted(overlap.per_rank.items(), key=lambda kv: int(kv[0]))
           if (n := steps_per_optimizer_step(pr)) is not None and n >= MICRO_BATCH_STEPS_MIN}
    if not per:
        return None
    rank, n = next(iter(per.items()))
    pr = overlap.per_rank[rank]
    return (f"the profiled steps are micro-batches: {len(pr.steps_without_optimizer)} of {pr.step_count} hold no "
            f"optimizer.step() (rank {rank}: prof.step() called per micro-batch, one optimizer step per {n:.0f} of "
            "them), so the step times, the verdict's step and the per-step figures are per micro-batch, not per "
            "optimizer step")


def is_usable(run: Run, report: Report) -> bool:
    """Whether anything could be analysed: records with steps or a configuration, or a trace window holding a
    profiler step or communication (an empty ``traceEvents`` is not a run)."""
    per_rank = report.overlap.per_rank if report.overlap is not None else {}
    return run.has_records or any(pr.steps or pr.comm_us for pr in per_rank.values())


#: exceptions a torch release's own FSDP2 raises before the first step, and what gets such a run going (a new-user
#: trial on torch 2.6 read only the AttributeError)
TORCH_BUGS = (("'Stream' object has no attribute 'record_event'",
               "torch 2.6's FSDP2 cannot train on the CPU (torch.cpu.Stream has no record_event; torch 2.7 added it): "
               "call fsdp_doctor.record.fsdp2.enable_cpu_fsdp() before training, which adds torch 2.7's and 2.9's "
               "CPU fixes, or use torch >= 2.7"),)


def unusable_reason(path, run: Run, report: Optional[Report]) -> Optional[str]:
    """None when ``report`` analysed something; else one line naming ``path`` and why nothing could be (``report``
    None: there was nothing to read, no records and no traces). The CLI's ``analyze`` and ``compare`` and
    ``compare_runs`` (the dashboard's Compare page) all say this."""
    if report is None:
        begun = sorted(r for r, rd in run.ranks.items() if rd.header is not None)
        ended = [r for r in begun if run.ranks[r].end is not None and not run.ranks[r].end.exception]
        who = ranks_phrase(begun)
        if begun and ended == begun:  # watch() exited normally, and no doctor.step() was called in it
            return (f"{path}: watch() ended normally on {who} without a doctor.step() "
                    "call, so no step was recorded: call doctor.step() once per optimizer step inside the with block")
        failed = {r: run.ranks[r].end.exception for r in begun
                  if run.ranks[r].end is not None and run.ranks[r].end.exception}
        if failed:  # the loop raised through watch() before its first doctor.step(): say so, with the exception
            first = failed[min(failed)]
            hint = next((f" ({fix})" for known, fix in TORCH_BUGS if known in first), "")
            # (a module of a unit called outside its unit's forward: the recorder named it, End.exception_hint)
            hint = hint or next((f" ({h})" for r in sorted(failed)
                                 if (h := run.ranks[r].end.exception_hint)), "")
            return (f"{path}: the training loop raised an exception on {ranks_phrase(sorted(failed))} before its "
                    f"first doctor.step(), so no step was recorded: {first}"[:600] + hint)
        if begun:  # streams began (a header) but hold no step: still in step 0, or killed during FSDP's lazy init
            return (f"{path}: the records of {who} hold a header and no step yet: the run is still in its first "
                    "step (analyze it again later), or stopped before its first doctor.step() and left no profiler "
                    "trace")
        return f"{path}: no fsdp-doctor records and no Kineto traces (*.json, *.json.gz) found"
    if is_usable(run, report):
        return None
    skipped = [*report.overlap.skipped, *report.overlap.exit_windows] if report.overlap is not None else []
    if Path(path).is_file() and len(skipped) == 1:
        return f"{path}: {skipped[0].error}"
    why = [f"{s.file}: {s.error}" for s in skipped]
    if not why:
        why = list(report.problems) or ["no profiler step and no communication in the trace(s)"]
    more = f" (and {len(why) - 1} more)" if len(why) > 1 else ""
    return f"{path}: nothing to analyse: {why[0]}{more}"


def has_input(run: Run) -> bool:
    """Whether the run holds anything to build a report from: records, or Kineto trace files."""
    return bool(run.has_records or run.trace_files)


# The step records as columns, for the dashboard's step figures (which draw them and compute nothing).
STEP_COLUMNS = ("step", "wall_ms", "forward_ms", "backward_ms", "optimizer_ms", "outside_ms", "gc_ms", "profiled",
                "no_grad_ms", "checkpoint_ms")


def steps_columns(run: Run) -> dict[int, dict[str, list]]:
    """The per-step records of each rank as columns (plain lists), the input of the step figures. Column
    ``profiler_export`` is True on a step that wrote a profiler window's trace (its "outside" time is that
    export, not data loading); ``steady`` is True on the steps the analyses use for statistics (the one
    steady-state rule, ``fsdp_doctor.analyze.steps.usable_steps``: figures need not re-implement it). Columns
    ``peak_bytes`` (the step's memory peak, StepRecord.memory) and, on CUDA, ``allocated_end`` (the allocator's
    bytes at its end, what memory.growing reads) are None where not recorded."""
    from .analyze.steps import profiler_export_steps

    out: dict[int, dict[str, list]] = {}
    for r, rd in sorted(run.ranks.items()):
        cols: dict[str, list] = {k: [] for k in STEP_COLUMNS}
        for s in rd.steps:
            for k in STEP_COLUMNS:
                cols[k].append(getattr(s, k))
        mem = [s.memory for s in rd.steps]
        cols["peak_bytes"] = [m.peak.bytes if m is not None and m.peak is not None else None for m in mem]
        cols["allocated_end"] = [m.cuda.allocated if m is not None and m.cuda is not None else None for m in mem]
        export = set(profiler_export_steps(rd))
        cols["profiler_export"] = [st in export for st in cols["step"]]
        steady = {s.step for s in usable_steps(rd.steps)}
        cols["steady"] = [st in steady for st in cols["step"]]
        out[r] = cols
    return out


def trace_steps_columns(overlap: Optional[OverlapSection]) -> dict[int, dict[str, list]]:
    """A plain trace's complete ``ProfilerStep``s as the step figures' columns (``steps_columns``' form): the
    wall time of each step (``OverlapRank.step_times_ms``, what ``report.trace_steps`` summarises); the phase
    columns are None (a trace brackets no phases), every step steady and none a doctor's profiled step."""
    out: dict[int, dict[str, list]] = {}
    for r, pr in sorted((overlap.per_rank if overlap is not None else {}).items(), key=lambda kv: int(kv[0])):
        steps = sorted((int(k), v) for k, v in pr.step_times_ms.items())
        if not steps:
            continue
        cols: dict[str, list] = {k: [None] * len(steps) for k in STEP_COLUMNS}
        cols["step"] = [n for n, _ in steps]
        cols["wall_ms"] = [v for _, v in steps]
        cols["profiled"] = cols["profiler_export"] = [False] * len(steps)
        cols["peak_bytes"] = cols["allocated_end"] = [None] * len(steps)
        cols["steady"] = [True] * len(steps)
        out[int(r)] = cols
    return out


def _exit_window_notes(files: list) -> list[str]:
    """One line per message of the files torch.profiler saved at its exit (``OverlapSection.exit_windows``; the
    ranks' files say the same step), naming them: the first 4, then how many more."""
    by: dict[str, list[str]] = {}
    for f in files:
        by.setdefault(f.error, []).append(f.file)
    return [", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "") + f": {why}"
            for why, names in by.items()]


def _count_unread(facts, overlap, run: Optional[Run] = None) -> None:
    """The run facts count the trace files read, not those found: an unreadable one (truncated, not a trace) is
    counted apart, and the ranks the traces speak for are those read (a truncated rank's file still names its
    rank in its first bytes: the header said "2 ranks ... 2 trace files" over one rank's figures). Facts from the
    traces' metadata are those of the files read (another job's skipped files made the header of HTA's reference
    folder "300 ranks" and list five GPU models: a new-user trial)."""
    unread = len(overlap.skipped)
    if not unread and not overlap.exit_windows:
        return
    facts.trace_files_unread += unread  # (with those the store left out: Run.trace_files_left_out)
    facts.trace_files = max(0, facts.trace_files - unread - len(overlap.exit_windows))  # (those: a note says them)
    if run is not None and facts.facts_source == "trace metadata":
        import msgspec

        from .trace.meta import meta_facts

        gone = {s.file for s in (*overlap.skipped, *overlap.exit_windows)}
        kept = [p for p in run.trace_files if not any(str(p) == g or str(p).endswith(os.sep + g) for g in gone)]
        meta = meta_facts(kept)
        defaults = {f.name: f.default for f in msgspec.structs.fields(facts)}
        for key in ("backend", "world_size", "nccl_version", "device_name", "trace_ranks"):
            setattr(facts, key, meta.get(key, defaults[key]))
    if facts.trace_ranks:
        facts.trace_ranks = [r for r in facts.trace_ranks if str(r) in overlap.per_rank]


def compare_side(run: Run, report: Optional[Report] = None):
    """One side of ``fsdp-doctor compare``: the run's report (built here unless given), its per-step samples
    (the records' steady steps, else the traces' complete steps), the kernels' and operators' times per phase from
    its traces and, for a plain-trace folder, the units FSDP prefetched (an ``analyze.compare.Side``)."""
    from .analyze.compare import Side, peak_input_elements, samples_from_ranks, samples_from_records

    report = report if report is not None else build_report(run)
    from .trace.ops import op_times

    if run.has_records:  # (the kernels' and operators' times from its profiler windows, where it has any)
        ops = op_times(run.trace_files).us_per_step if run.trace_files else {}
        return Side(report=report, samples=samples_from_records(run), source="records", ops=ops,
                    peak_input_elements=peak_input_elements(run, report))
    ops = op_times(run.trace_files)
    return Side(report=report, samples=samples_from_ranks(ops.steps_ms), source="trace", ops=ops.us_per_step,
                prefetched=ops.prefetched)


def compare_runs(run_a: Run, run_b: Run, **kw):
    """The :class:`~fsdp_doctor.compare_sections.Comparison` of ``run_b`` against ``run_a`` (keywords: those of
    ``analyze.compare.compare``)."""
    from .analyze.compare import compare

    sides = []
    for run in (run_a, run_b):
        report = build_report(run) if has_input(run) else None
        why = unusable_reason(run.path, run, report)
        if why is not None:  # (the CLI's compare says the same line)
            raise ValueError(why)
        sides.append(compare_side(run, report))
    return compare(*sides, path_a=str(run_a.path), path_b=str(run_b.path), **kw)
