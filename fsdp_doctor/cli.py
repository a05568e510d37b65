"""Command: ``fsdp-doctor analyze | compare | rules | demo | dashboard | tensorboard | schema``."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

if TYPE_CHECKING:
    from .report_sections import Report

EXIT_OK = 0
EXIT_BAD_INPUT = 2  # nothing could be analyzed
EXIT_PARTIAL = 3  # analyzed, but some files were skipped, or a rank did not finish
EXIT_FINDINGS = 4  # analyzed, and a finding at --fail-on's severity or above


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """A closed pipe (``analyze ... | head``) is no failure: rich's default exits 1, which this CLI's
        exit codes reserve for a failed demo. Output stops; ``main`` exits 0."""
        self.quiet = True
        _quiet_stdout()
        raise BrokenPipeError


def _console() -> Console:
    return _Console(width=shutil.get_terminal_size((100, 40)).columns, highlight=False)  # $COLUMNS, else the tty


def _err(msg: str) -> None:
    from .units import printable

    print(f"fsdp-doctor: {printable(msg)}", file=sys.stderr)


def _busy(text: str):
    """A spinner with the time elapsed while ``text``'s work runs (reading and analysing a 20,000-step run's records
    takes seconds), on standard error and only where it is a terminal; gone when the work ends."""
    from contextlib import nullcontext

    err = _Console(stderr=True, highlight=False)
    if not err.is_terminal:
        return nullcontext()
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    prog = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err,
                    transient=True)
    prog.add_task(_markup_safe(text), total=None)
    return prog


def _markup_safe(text: str) -> str:
    from rich.markup import escape

    from .units import printable

    return escape(printable(text))


def _records_path(path: Path) -> Path:
    """``path``, or the folder right below it holding the doctor's records, said in one line on stderr."""
    from .store.layout import records_below

    below = records_below(path)
    if below is not None:
        _err(f"{path} holds no fsdp-doctor records; reading the ones in {below}")
        return below
    return path


def _load(path: Path):
    """The run at ``path`` (or the folder right below it that holds the doctor's records), or None after one line on
    stderr saying why not."""
    from .store import RunRefused, load_run
    from .store.layout import runs_below

    if len(below := runs_below(path)) > 1:  # (read as one folder of traces, one job's were picked and the others'
        # skipped as "rank 0 again", exit 3: a new-user trial passed the folder of its runs)
        names = ", ".join(d.name for d in below[:6]) + (f", … {len(below) - 6} more" if len(below) > 6 else "")
        _err(f"{path} holds {len(below)} runs' records, each in a folder of its own ({names}): give one of them "
             "(fsdp-doctor compare A B sets two side by side)")
        return None
    try:
        where = _records_path(path)
        with _busy(f"reading {where}"):
            return load_run(where)
    except (FileNotFoundError, RunRefused) as e:
        _err(str(e))
    except (NotADirectoryError, PermissionError) as e:
        _err(f"{path}: cannot be read as a run directory or trace file ({e.strerror or e})")
    return None


# ----------------------------------------------------------------------------------------- analyze
def cmd_analyze(ns: argparse.Namespace) -> int:
    from .pipeline import build_report, has_input, unusable_reason

    console = _console()
    path = Path(ns.path)
    outputs = _check_outputs(ns)
    if outputs is None:
        return EXIT_BAD_INPUT
    run = _load(path)
    if run is None:
        return EXIT_BAD_INPUT
    if _onto_input(outputs, path, run, "analysed"):
        return EXIT_BAD_INPUT
    if not has_input(run):
        from .present.fmt import folded_problems

        _err(unusable_reason(path, run, None))
        for p in folded_problems(run.problems):
            _err(p)
        return EXIT_BAD_INPUT
    note = None
    if ns.steps is not None:
        if (got := _windowed(ns.steps, path, run, "--steps")) is None:
            return EXIT_BAD_INPUT
        run, note = got
    report = _build_with_progress(run, console, build_report)
    if (why := unusable_reason(path, run, report)) is not None:
        _err(why)
        return EXIT_BAD_INPUT
    if run.steps_window is not None:
        from .store.reader import STEPS_END

        lo, hi = run.steps_window
        report.run.notes = [note, *(report.run.notes or [])]
        report.run.steps_window = [lo, None if hi >= STEPS_END else hi]
    if not _emit(report, outputs, console):
        return EXIT_BAD_INPUT
    if ns.explain:
        from .present.rules import render_rule_statuses

        # (with the JSON on standard output, on standard error: the JSON's own ``rules`` holds the same list, and a
        # table after it made the output invalid JSON, a new-user trial's CI script)
        (_Console(stderr=True, highlight=False) if outputs.get("json") == STDOUT else console).print(
            render_rule_statuses(report.rules))
    if ns.fail_on and (hit := failing(report.findings, ns.fail_on)):
        _err(f"{len(hit)} finding{'s' * (len(hit) != 1)} at {ns.fail_on} or above ({', '.join(hit)}): exit "
             f"{EXIT_FINDINGS} (--fail-on {ns.fail_on})")
        return EXIT_FINDINGS
    return EXIT_PARTIAL if report.problems else EXIT_OK


def _windowed(text: str, path: Path, run, flag: str):
    """(the run with only the recorded steps ``text`` names, the note saying what that left out): ``analyze
    --steps``, ``compare --steps-a`` and ``--steps-b`` (``flag``); None after one line on stderr."""
    if (window := _steps_window(text, path, run, flag)) is None:
        return None
    from .pipeline import steps_window_note, window_run

    sub = window_run(run, window)
    return sub, steps_window_note(run, sub, window, flag)


def _steps_window(text: str, path: Path, run, flag: str) -> tuple[int, int] | None:
    """``flag``'s FIRST-LAST, FIRST- or -LAST (or one step) as an inclusive window over a run's recorded steps, or
    None after one line on stderr saying why not (a malformed window, a run without records, no recorded step
    inside)."""
    from .store.reader import STEPS_END

    first, dash, last = text.strip().partition("-")
    try:
        lo = int(first) if first.strip() else 0
        hi = (int(last) if last.strip() else STEPS_END) if dash else lo
    except ValueError:
        lo = hi = -1
    if lo < 0 or hi < lo:
        _err(f"{flag} {text}: give FIRST-LAST, FIRST- (to the end) or -LAST, steps numbered from 0 as the report "
             "numbers them")
        return None
    if not run.has_records:
        _err(f"{flag} {text}: {path} holds no fsdp-doctor records, only profiler traces, which are read whole")
        return None
    steps = sorted({s.step for rd in run.ranks.values() for s in rd.steps})
    if not any(lo <= st <= hi for st in steps):
        _err(f"{flag} {text}: no recorded step there; {path}'s ranks recorded steps "
             + (f"{steps[0]}-{steps[-1]}" if steps else "none"))
        return None
    return lo, hi


def failing(findings, level: str) -> list[str]:
    """The codes of ``findings`` at severity ``level`` or above (``--fail-on``), in the report's order."""
    from .present.fmt import SEVERITY_ORDER  # (worst first)

    worst = SEVERITY_ORDER[level]
    return list(dict.fromkeys(f.code for f in findings if SEVERITY_ORDER.get(f.severity, worst + 1) <= worst))


STDOUT = "-"  # ``--json -``: the JSON on standard output


def _check_outputs(ns: argparse.Namespace) -> dict | None:
    """The report files asked for (``--json``, ``--html``), checked before any work: each one's directory must
    exist and take a file. None after one line on stderr when one cannot be written."""
    from .store import layout

    out = {}
    for kind in ("json", "html"):
        f = getattr(ns, kind, None)
        if not f:
            continue
        if f == STDOUT and kind == "json":  # the JSON on standard output, alone (no terminal report)
            out[kind] = STDOUT
            continue
        p = Path(f)
        parent = p.parent if str(p.parent) else Path(".")
        if p.is_dir():
            _err(f"--{kind} {p}: is a directory; give a file name")
            return None
        if parent.exists() and not parent.is_dir():
            _err(f"--{kind} {p}: {parent} is a file, not a directory")
            return None
        if not parent.is_dir():
            _err(f"--{kind} {p}: directory {parent} does not exist")
            return None
        if not layout.is_replaceable(p):  # a FIFO, a device, /dev/stdout: written through, no file created
            out[kind] = p
            continue
        # (a file created there, as the atomic write will: /proc took the whole report printed before "cannot
        # write", exit 2: a new-user trial; a symlink's target's folder is where the write goes)
        if (e := layout.write_probe(Path(os.path.realpath(p)).parent)) is not None:
            _err(f"--{kind} {p}: directory {parent} is not writable ({e.strerror or e})")
            return None
        out[kind] = p
    return out


def _onto_input(outputs: dict, path: Path, run, verb: str) -> bool:
    """Whether a report file asked for (``outputs``) would overwrite one of ``path``'s inputs: then one line on
    stderr ("... is one of the inputs being {verb}")."""
    for kind, p in outputs.items():
        if p != STDOUT and _is_input(p, path, run):
            _err(f"--{kind} {p}: is one of the inputs being {verb}; give another file name")
            return True
    return False


def _is_input(out: Path, path: Path, run) -> bool:
    """Whether writing ``out`` would overwrite something ``analyze`` reads: the trace file given, a trace, a
    record stream or the manifest of the run directory."""
    from .store import layout

    try:
        o = out.resolve()
    except OSError:
        return False
    inputs = {f.resolve() for f in run.trace_files} | {path.resolve()}
    if path.is_dir():
        inputs |= {q.resolve() for q in layout.streams(path).values()} | {layout.manifest_path(path).resolve()}
    return o in inputs


def _build_with_progress(run, console: Console, build_report):
    """The report of ``run``, a bar of the traces read (two or more) or a spinner meanwhile, on standard error and
    only where it is a terminal (on standard output, ``FORCE_COLOR=1`` put the bar into ``--json -``'s JSON: a
    new-user trial's CI job)."""
    n = len(run.trace_files)
    err = _Console(stderr=True, highlight=False)
    if n < 2 or not err.is_terminal:
        with _busy(_analysing(run)):
            return build_report(run)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn(_markup_safe(_analysing(run))), BarColumn(), MofNCompleteColumn(), TextColumn("traces"),
                  TimeElapsedColumn(), console=err, transient=True) as prog:
        task = prog.add_task("traces", total=n)
        return build_report(run, progress=lambda done, total: prog.update(task, completed=done, total=total))


def _analysing(run) -> str:
    """What the spinner says while a run is analysed: its step records and traces."""
    steps = sum(len(rd.steps) for rd in run.ranks.values())
    traces = len(run.trace_files)
    bits = [f"{steps:,} step records of {len(run.ranks)} rank{'s' * (len(run.ranks) != 1)}"] if steps else []
    bits += [f"{traces} trace{'s' * (traces != 1)}"] if traces else []
    return "analysing " + (" and ".join(bits) or str(run.path))


def _emit(report: Report, outputs: dict, console: Console) -> bool:
    """Prints the report and writes the files asked for; False after one line on stderr if a write failed."""
    from .present.terminal import render_report

    def html(p):
        from .present.html import write_html

        write_html(report, p)

    return _print_and_write(render_report, report, html, outputs, console, "report")


def _print_and_write(render, struct, write_html, outputs: dict, console: Console, what: str) -> bool:
    """``render(struct, console)``, then the files asked for (``_write_outputs``). A reader that closes the pipe
    (``analyze ... --json r.json | head``) stops the printing, never the files: they are written, then the
    BrokenPipeError goes on to ``main`` (exit 0), unless a write failed (False, its line on stderr)."""
    if outputs.get("json") == STDOUT:  # the JSON is the output: nothing else on standard output
        from .present.json import render_struct

        sys.stdout.buffer.write(render_struct(struct))
        sys.stdout.flush()
        return _write_outputs(struct, write_html, {k: p for k, p in outputs.items() if p != STDOUT},
                              Console(stderr=True), what)
    try:
        render(struct, console)
    except BrokenPipeError:
        if not _write_outputs(struct, write_html, outputs, console, what):
            return False
        raise
    return _write_outputs(struct, write_html, outputs, console, what)


def _write_outputs(struct, write_html, outputs: dict, console: Console, what: str) -> bool:
    """Writes ``--json`` (the msgspec ``struct`` as JSON) and ``--html`` (``write_html(path)``), each atomically;
    False after one line on stderr if a write failed."""
    for kind, p in outputs.items():
        try:
            if kind == "json":
                from .present.json import write_struct_json

                write_struct_json(struct, p)
            else:
                write_html(p)
        except OSError as e:
            _err(f"--{kind} {p}: cannot write ({e.strerror or e})")
            return False
        console.print(f"{kind.upper()} {what} written to {p}", soft_wrap=True)  # a path to copy: never wrapped
    return True


# ----------------------------------------------------------------------------------------- compare
def cmd_compare(ns: argparse.Namespace) -> int:
    """Two runs side by side (B against A): the comparison is ``analyze.compare``'s, presenters format it."""
    from .pipeline import build_report, compare_side, has_input, unusable_reason
    from .present.compare import render_comparison

    outputs = _check_outputs(ns)
    if outputs is None:
        return EXIT_BAD_INPUT
    if ns.gpu_hour_price is not None and not ns.gpu_hour_price > 0:
        _err(f"--gpu-hour-price {ns.gpu_hour_price}: must be a positive price per GPU-hour")
        return EXIT_BAD_INPUT
    sides, windowed = [], []
    for name, path, spec, flag in (("A", Path(ns.run_a), ns.steps_a, "--steps-a"),
                                   ("B", Path(ns.run_b), ns.steps_b, "--steps-b")):
        run = _load(path)
        if run is None:
            return EXIT_BAD_INPUT
        if _onto_input(outputs, path, run, "compared"):
            return EXIT_BAD_INPUT
        if spec is not None:  # (as analyze --steps: one part of a run whose step time changed mid-run)
            if (got := _windowed(spec, path, run, flag)) is None:
                return EXIT_BAD_INPUT
            run, note = got
            windowed.append(f"{name}: {note}")
        with _busy(_analysing(run)):
            report = build_report(run) if has_input(run) else None
        if (why := unusable_reason(path, run, report)) is not None:
            _err(why)
            return EXIT_BAD_INPUT
        sides.append(compare_side(run, report))
    from .analyze.compare import compare

    cmp = compare(*sides, applied=ns.applied or (), gpu_hour_price=ns.gpu_hour_price, path_a=ns.run_a,
                  path_b=ns.run_b)
    cmp.notes[:0] = windowed
    # what each side skipped, named (exit 3 said something was, and nothing said what: a new-user trial)
    from .present.fmt import folded_problems, problem_line

    skipped = [problem_line(p, f"({name}, {side.path})") for name, side in (("A", cmp.a), ("B", cmp.b))
               for p in folded_problems(side.problems)]

    def html(p):
        from .present.compare_html import write_compare_html

        write_compare_html(cmp, p)

    def render(c, console):
        from rich.text import Text

        from .units import printable

        render_comparison(c, console)
        for line in skipped:  # one line each, never folded: a copy or a grep gets it whole (as analyze's)
            console.print(Text(printable(line), style="yellow"), soft_wrap=True)

    if not _print_and_write(render, cmp, html, outputs, _console(), "comparison"):
        return EXIT_BAD_INPUT
    if outputs.get("json") == STDOUT:  # (standard output holds the JSON alone: the lines go to standard error)
        for line in skipped:
            _err(line)
    return EXIT_PARTIAL if skipped else EXIT_OK


def cmd_rules(ns: argparse.Namespace) -> int:
    """The rule catalogue: code, severity, needs, what it checks (``--markdown``: the README's table)."""
    from .diagnose import NEEDS, catalogue
    from .present.rules import catalogue_markdown, render_catalogue

    rows, needs = catalogue(), {k: n.text for k, n in NEEDS.items()}
    if ns.markdown:
        print(catalogue_markdown(rows, needs))
    else:
        _console().print(render_catalogue(rows, needs))
    return EXIT_OK


# ----------------------------------------------------------------------------------------- demo
def cmd_demo(ns: argparse.Namespace) -> int:
    import os

    from .pipeline import build_report
    from .store import RunFollower, layout, load_run
    from .workloads import WorkloadError, config_from_args, gpu_plan, launch

    console = _console()
    out = Path(ns.out)
    # Kineto prints "USDT: ... profiler_start/stop" lines (its highest level, 5) from every rank, through the progress
    # bar: above its last level nothing is printed. The demo only; a user's own run keeps Kineto's defaults.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    # torch's C++ warning "Memory block of unknown size was allocated before the profiling started" (one per rank
    # and window, from the windows' memory profiling) cuts through it the same way: errors only, the demo only
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    try:
        cfg = config_from_args(ns)
    except ValueError as e:
        _err(str(e))
        return EXIT_BAD_INPUT
    if layout.has_run(out):
        if not ns.overwrite:
            _err(f"{out} already holds a run's records; add --overwrite to replace them, or choose a new --out")
            return EXIT_BAD_INPUT
        try:
            layout.clear_run(out)  # before training starts: nothing of the old run is read as the new one's
        except OSError as e:
            _err(f"{out}: cannot remove the previous run ({e.strerror or e})")
            return EXIT_BAD_INPUT
    watch_kwargs = {"out_dir": str(out), "tokens_per_step": cfg.tokens_per_step(ns.nproc), "overwrite": ns.overwrite}
    if ns.capacity_mib:
        watch_kwargs["capacity_bytes"] = int(ns.capacity_mib * (1 << 20))
    try:
        plan = gpu_plan(cfg, ns.nproc)
    except ValueError as e:
        _err(str(e))
        return EXIT_BAD_INPUT
    ranks = f"{ns.nproc} gloo ranks" if plan is None else f"{ns.nproc} NCCL ranks"
    console.print(f"[bold]fsdp-doctor demo[/]: GPT {cfg.n_layers}×{cfg.d_model} (wrap={cfg.wrap}) on {ranks}, "
                  f"{cfg.steps} steps → {out}")
    if plan is not None and plan.shared:
        console.print(plan.describe())
    result: dict = {}

    def target():
        try:
            result["losses"] = launch(cfg, nproc=ns.nproc, watch_kwargs=watch_kwargs)
        except BaseException as e:  # noqa: BLE001
            result["error"] = e

    th = threading.Thread(target=target, daemon=True)
    t0 = time.perf_counter()
    th.start()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
                  TimeElapsedColumn(), console=console, transient=True) as prog:
        task = prog.add_task(f"starting {ns.nproc} ranks", total=cfg.steps)
        follower = None
        while th.is_alive():
            th.join(0.5)
            if follower is None and out.exists():
                follower = RunFollower(out)  # the directory was emptied above: only this run's records
            if follower is not None:
                run, _ = follower.poll()
                done = min((len(rd.steps) for rd in run.ranks.values()), default=0) if len(run.ranks) == ns.nproc else 0
                prog.update(task, completed=done, description="training" if run.ranks else f"starting {ns.nproc} ranks")
    if "error" in result:
        e = result["error"]
        _err(f"the demo workload failed: {e}" if isinstance(e, WorkloadError) else f"the demo workload failed: {type(e).__name__}: {e}")
        return 1
    losses = result["losses"]
    console.print(f"trained {cfg.steps} steps in {time.perf_counter() - t0:.1f} s; loss {losses[0][0]:.3f} → {losses[0][-1]:.3f}")
    run = load_run(out)
    report = build_report(run)
    from .present.tensorboard import export_tensorboard

    export_tensorboard(run, out)  # TensorBoard scalars written after training, at no cost to it
    report_path = layout.report_path(out)
    from .present.json import write_json

    write_json(report, report_path)
    _emit(report, {}, console)
    fd, tb = _command("fsdp-doctor", module="fsdp_doctor.cli"), _command("tensorboard")
    console.print(f"\nJSON report: {report_path}\nAnalyze again: {fd} analyze {out}\n"
                  f"Dashboard:   {fd} dashboard {out}\nTensorBoard: {tb} --logdir {out}", soft_wrap=True)
    if "/" in fd and fd.endswith("fsdp-doctor"):
        console.print(f"(to type them without the path: source {Path(fd).parent}/activate)", soft_wrap=True)
    return EXIT_OK


def _command(name: str, module: str | None = None) -> str:
    """How to run ``name`` from this shell: the bare name when PATH finds this environment's copy, else its path
    (relative to the current directory when inside it), so that the printed commands work as printed. Where this
    environment has no such script and PATH none either (the package on PYTHONPATH, not installed: the GPU
    machine's layout), ``PYTHON -m module`` when ``module`` is given."""
    bindir = Path(sys.executable).parent
    exe = bindir / name
    found = shutil.which(name)
    if found and Path(found).resolve() == exe.resolve():
        return name
    if not exe.exists():
        if found or module is None:
            return name
        py = shutil.which(Path(sys.executable).name)  # unresolved: every venv's python links to the same base
        here = Path(sys.executable).name if py and os.path.abspath(py) == os.path.abspath(sys.executable) else sys.executable
        return f"{here} -m {module}"
    try:
        return str(exe.relative_to(Path.cwd()))
    except ValueError:
        return str(exe)


# ----------------------------------------------------------------------------------------- dashboard
def cmd_dashboard(ns: argparse.Namespace) -> int:
    path = _records_path(Path(ns.path))
    if not path.exists() and not path.parent.is_dir():  # (one that does not exist yet is waited for: serve)
        _err(f"{path}: no such run directory (nor its parent, {path.parent})")
        return EXIT_BAD_INPUT
    from .store.layout import unreadable_folder

    if why := unreadable_folder(path):  # (a traceback from the first refresh, before anything was served)
        _err(f"{path}: {why}")
        return EXIT_BAD_INPUT
    busy = _port_in_use(ns.host, ns.port)
    if busy:
        _err(f"cannot serve on {ns.host}:{ns.port} ({busy}); choose another --port")
        return EXIT_BAD_INPUT
    try:
        from fsdp_doctor.dashboards.app import serve
    except ImportError as e:
        _err(f"the dashboard is not available ({e})")
        return 1
    return serve(path, host=ns.host, port=ns.port) or EXIT_OK


def _port_in_use(host: str, port: int) -> str:
    """Why ``host:port`` cannot be bound right now ("" when it can), checked before anything is announced."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        return f"unknown host: {e}"
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # what Werkzeug sets: TIME_WAIT is no conflict
        try:
            s.bind(addr)
        except OSError as e:
            return "port already in use" if e.errno in (98, 48, 10048) else (e.strerror or str(e))
    return ""


# ----------------------------------------------------------------------------------------- schema
SCHEMA_FILE = Path(__file__).with_name("report.schema.json")


def schema_text() -> str:
    """The JSON schema of the ``--json`` report, as published in ``fsdp_doctor/report.schema.json``."""
    from .report_sections import Report

    return json.dumps(Report.json_schema(), indent=1, sort_keys=True) + "\n"


def cmd_schema(ns: argparse.Namespace) -> int:
    sys.stdout.write(schema_text())
    return EXIT_OK


# ----------------------------------------------------------------------------------------- tensorboard
def cmd_tensorboard(ns: argparse.Namespace) -> int:
    from .present.tensorboard import EventsExist, export_tensorboard

    path = Path(ns.path)
    run = _load(path)
    if run is None:
        return EXIT_BAD_INPUT
    if not run.has_records:
        from .store.layout import STREAM_GLOB

        _err(f"{path}: no fsdp-doctor records ({STREAM_GLOB}) to convert")
        return EXIT_BAD_INPUT
    out = Path(ns.out) if ns.out else path
    problems = list(run.problems)  # (what load_run skipped: a rank's records, a trace; named as analyze names them)
    try:
        with _busy(f"writing TensorBoard events of {_analysing(run).removeprefix('analysing ')}"):
            dirs = export_tensorboard(run, out, traces=not ns.no_traces, overwrite=ns.overwrite, problems=problems)
    except EventsExist as e:
        _err(f"{e}: --overwrite replaces them")
        return EXIT_BAD_INPUT
    except OSError as e:  # (a read-only run folder, or its tb/: a traceback from mkdir / mkdtemp)
        _err(f"{e.filename or out}: cannot write the TensorBoard events there ({e.strerror or e}); --out DIR writes "
             "them elsewhere")
        return EXIT_BAD_INPUT
    from .present.fmt import folded_problems, problem_line
    from .units import printable

    for d in dirs:
        print(f"wrote {d}")
    for p in folded_problems(problems):  # one line each, as analyze's
        print(printable(problem_line(p)))
    print(f"open with: {_command('tensorboard')} --logdir {out}")
    return EXIT_PARTIAL if problems else EXIT_OK


EXIT_REASONS = {  # every command's codes (the top-level --help); each command's --help gives its own reasons
    0: "everything read and analysed",
    1: "the demo workload failed",
    2: "nothing usable (no such path, no records or traces, an output file that cannot be written, port in use, a "
       "run directory holding another run)",
    3: "analysed, but some files or lines were skipped, or a rank did not finish (each named in the report)",
    4: "analyze --fail-on LEVEL: a finding at LEVEL or above (checked before 3)",
    130: "interrupted",
}


def epilog(*codes: int, **own: str) -> str:
    """The exit-code table of a command: the codes it returns (compare's, schema's and dashboard's listed analyze's
    4, which they never return), each with the reasons this command returns it (``own``: "c2" is code 2's; analyze's
    and compare's 2 named "port in use, a run directory holding another run", the dashboard's and the demo's: a
    new-user trial), wrapped within 80 columns."""
    import textwrap

    return "exit codes:\n" + "\n".join(
        textwrap.fill(own.get(f"c{c}", EXIT_REASONS[c]), 78, initial_indent=f"  {c:<2} ", subsequent_indent=" " * 5,
                      break_on_hyphens=False)
        for c in codes)


EPILOG = epilog(*EXIT_REASONS)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The epilog's exit-code table as written (indented lines), every other paragraph of a description filled to
    the terminal (analyze's and compare's read 192 and 299 columns at COLUMNS=80: a new-user trial)."""

    def _fill_text(self, text, width, indent):
        import textwrap

        return "\n".join(line if line.startswith(" ") else textwrap.fill(line, width, initial_indent=indent,
                                                                           subsequent_indent=indent)
                         for line in text.splitlines())


def build_parser(with_workload: bool = True) -> argparse.ArgumentParser:
    """``with_workload``: add the demo's workload flags (importing torch); skipped for the other commands."""
    fmt = _HelpFormatter
    p = argparse.ArgumentParser(prog="fsdp-doctor", description="Profiling and diagnostics for PyTorch FSDP2 training.",
                                epilog=EPILOG, formatter_class=fmt)
    from . import __version__

    p.add_argument("--version", action="version", version=f"fsdp-doctor {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)

    a = sub.add_parser("analyze", help="analyze a run directory or Kineto traces (.json / .json.gz)",
                       description="Reads a run directory written by fsdp_doctor.watch() (records and profiler "
                       "traces), a directory of plain torch.profiler traces (one file per rank), or one trace "
                       "file, and prints the diagnosis.", formatter_class=fmt,
                       epilog=epilog(0, 2, 3, 4, 130, c2="nothing usable (no such path, no records or traces), an "
                                     "output file that cannot be written or would replace an input, or a --steps "
                                     "window that is malformed or holds no recorded step"))
    a.add_argument("path", help="run directory, directory of Kineto traces, or one trace file")
    a.add_argument("--json", metavar="FILE", help="also write the JSON report here (its directory must exist); "
                                                  "'-': the JSON alone on standard output")
    a.add_argument("--html", metavar="FILE",
                   help="also write a self-contained HTML report here (its directory must exist)")
    a.add_argument("--explain", action="store_true",
                   help="also list every rule checked: fired, quiet, skipped (a need not met) or failed, and why "
                   "(on standard error with --json -)")
    from .diagnose.base import SEVERITIES

    a.add_argument("--fail-on", choices=SEVERITIES, default=None, metavar="LEVEL",
                   help="exit 4 when a finding is at LEVEL or above: info, warning or critical (for CI jobs)")
    a.add_argument("--steps", metavar="FIRST-LAST",
                   help="analyse these recorded steps only (inclusive; FIRST- to the end, -LAST from the start), "
                   "with the profiler windows inside them: the part of a run after its step time changed")
    a.set_defaults(fn=cmd_analyze)

    c = sub.add_parser("compare", help="compare two runs: config diff, deltas with noise, predictions checked",
                       description="Compares run B against run A (run directories or plain-trace folders): the "
                       "configuration that changed, step time with a bootstrap confidence interval, phases, memory "
                       "at the peak, exposed communication per unit, throughput, findings resolved / new / "
                       "persisting, and A's predictions checked against B.", formatter_class=fmt,
                       epilog=epilog(0, 2, 3, 130, c0="both runs read and compared",
                                     c2="nothing usable in a run (no such path, no records or traces), an output file "
                                        "that cannot be written or would replace an input, a --gpu-hour-price not "
                                        "above zero, or a --steps-a/--steps-b window that is malformed or holds no "
                                        "recorded step",
                                     c3="compared, but some files or lines of a run were skipped (each named after "
                                        "the comparison)"))
    c.add_argument("run_a", help="the run before (run directory, folder of Kineto traces, or one trace file)")
    c.add_argument("run_b", help="the run after")
    c.add_argument("--json", metavar="FILE", help="also write the comparison as JSON here (its directory must exist); "
                                                  "'-': the JSON alone on standard output")
    c.add_argument("--html", metavar="FILE",
                   help="also write a self-contained HTML comparison here (its directory must exist)")
    c.add_argument("--applied", metavar="CODE", action="append",
                   help="a finding code of A whose fix B applies (repeatable; config changes are recognised anyway)")
    c.add_argument("--gpu-hour-price", type=float, default=None, metavar="PRICE",
                   help="price of one GPU-hour: adds the cost per billion tokens of each run")
    c.add_argument("--steps-a", metavar="FIRST-LAST",
                   help="compare these recorded steps of A only (as analyze --steps: FIRST- to the end)")
    c.add_argument("--steps-b", metavar="FIRST-LAST", help="compare these recorded steps of B only")
    c.set_defaults(fn=cmd_compare)

    r = sub.add_parser("rules", help="the rule catalogue: code, severity, what it needs and checks",
                       epilog=epilog(0, c0="the catalogue printed"), formatter_class=fmt)
    r.add_argument("--markdown", action="store_true", help="as the README's Markdown table")
    r.set_defaults(fn=cmd_rules)

    d = sub.add_parser("demo", help="train the reference FSDP2 workload with the doctor attached, then analyze it",
                       epilog=epilog(0, 1, 2, 130, c0="trained, and the run analysed",
                                     c2="workload options that cannot run, or --out holding another run (without "
                                        "--overwrite) or one that cannot be removed"),
                       formatter_class=fmt)
    d.add_argument("--out", default="traces/demo", help="run directory (default: traces/demo)")
    d.add_argument("--overwrite", action="store_true",
                   help="replace the run already in --out (a run directory holds one run; without this flag "
                   "the demo refuses it)")
    d.add_argument("--nproc", type=int, default=2, help="ranks (default: 2): gloo on --device cpu, NCCL on --device cuda (more ranks than GPUs share them)")
    d.add_argument("--capacity-mib", type=float, default=None, help="memory budget per rank for the diagnosis")
    if with_workload:
        from .workloads import add_cli_args

        add_cli_args(d)
    d.set_defaults(fn=cmd_demo)

    s = sub.add_parser("dashboard", help="serve the live dashboard over a run directory",
                       epilog=epilog(0, 1, 2, 130, c0="served until stopped",
                                     c1="the dashboard's packages are not installed",
                                     c2="no such run directory (nor its parent), an unreadable one, or the port in "
                                        "use"),
                       formatter_class=fmt)
    s.add_argument("path", help="run directory (finished, or still being written)")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: 127.0.0.1, this machine only; 0.0.0.0 serves the network)")
    s.add_argument("--port", type=int, default=8050, help="port to bind (default: 8050)")
    s.set_defaults(fn=cmd_dashboard)

    sc = sub.add_parser("schema", help="print the JSON schema of the --json report",
                        epilog=epilog(0, c0="the schema printed"), formatter_class=fmt)
    sc.set_defaults(fn=cmd_schema)

    t = sub.add_parser("tensorboard", help="write TensorBoard scalars (tb/rank{R}) for a recorded run",
                       epilog=epilog(0, 2, 3, 130, c0="the events written",
                                     c2="nothing to convert (no such path, no records), event files already there "
                                        "(without --overwrite), or a folder that cannot be written",
                                     c3="written, but some files or lines were skipped, or a rank did not finish "
                                        "(each named)"),
                       formatter_class=fmt)
    t.add_argument("path", help="run directory written by fsdp_doctor.watch()")
    t.add_argument("--out", default=None, help="log directory (default: the run directory)")
    t.add_argument("--no-traces", action="store_true", help="skip the overlap scalars from the profiler traces")
    t.add_argument("--overwrite", action="store_true",
                   help="replace the TensorBoard event files already in tb/rank{R} (written live by "
                   "watch(tensorboard=True), or by an earlier export)")
    t.set_defaults(fn=cmd_tensorboard)
    return p


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    first = next((a for a in args if not a.startswith("-")), None)
    ns = build_parser(with_workload=first == "demo").parse_args(args)  # torch only for the demo
    try:
        return ns.fn(ns)
    except KeyboardInterrupt:
        _err("interrupted")
        return 130
    except BrokenPipeError:  # `fsdp-doctor analyze ... | head`: the reader has what it wanted
        _quiet_stdout()
        return EXIT_OK


def _quiet_stdout() -> None:
    """After a broken pipe: stdout pointed at /dev/null, so that the interpreter's final flush has nowhere to
    fail (and exits 0, not 1 with "Exception ignored ... BrokenPipeError")."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
