"""Command: ``fsdp-doctor demo | analyze | dashboard``."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import threading
import time
from pathlib import Path

from rich.console import Console

EXIT_OK = 0
EXIT_BAD_INPUT = 2  # nothing could be analyzed
EXIT_PARTIAL = 3  # analyzed, but some files were skipped


def _console() -> Console:
    return Console(width=min(shutil.get_terminal_size((100, 40)).columns, 100), highlight=False)


def _err(msg: str) -> None:
    print(f"fsdp-doctor: {msg}", file=sys.stderr)


def _load(path: Path):
    """The run at ``path``, or None after one line on stderr saying why not."""
    from .store import load_run

    try:
        return load_run(path)
    except FileNotFoundError as e:
        _err(str(e))
    except (NotADirectoryError, PermissionError) as e:
        _err(f"{path}: cannot be read as a run directory or trace file ({e.strerror or e})")
    return None


# ----------------------------------------------------------------------------------------- analyze
def cmd_analyze(ns: argparse.Namespace) -> int:
    from .analyze import build_report

    console = _console()
    path = Path(ns.path)
    run = _load(path)
    if run is None:
        return EXIT_BAD_INPUT
    if not run.has_records and not run.trace_files:
        _err(f"{path}: no fsdp-doctor records and no Kineto traces (*.json, *.json.gz) found")
        for p in run.problems:
            _err(p)
        return EXIT_BAD_INPUT
    report = _build_with_progress(run, console, build_report)
    _emit(report, ns, console)
    usable = run.has_records or bool((report.get("overlap") or {}).get("per_rank"))
    if not usable:
        return EXIT_BAD_INPUT
    return EXIT_PARTIAL if report.get("problems") else EXIT_OK


def _build_with_progress(run, console: Console, build_report):
    n = len(run.trace_files)
    if n < 2 or not console.is_terminal:
        return build_report(run)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("reading traces"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as prog:
        task = prog.add_task("traces", total=n)
        return build_report(run, progress=lambda done, total: prog.update(task, completed=done, total=total))


def _emit(report: dict, ns: argparse.Namespace, console: Console) -> None:
    from .present.terminal import render_report

    render_report(report, console)
    if getattr(ns, "json", None):
        Path(ns.json).write_text(json.dumps(report, indent=1, default=str))
        console.print(f"JSON report written to {ns.json}")
    if getattr(ns, "html", None):
        from .present.html import write_html

        write_html(report, Path(ns.html))
        console.print(f"HTML report written to {ns.html}")


# ----------------------------------------------------------------------------------------- demo
def cmd_demo(ns: argparse.Namespace) -> int:
    from .analyze import build_report
    from .store import RunFollower, load_run
    from .workloads import WorkloadError, config_from_args, launch

    console = _console()
    try:
        cfg = config_from_args(ns)
    except ValueError as e:
        _err(str(e))
        return EXIT_BAD_INPUT
    out = Path(ns.out)
    watch_kwargs = {"out_dir": str(out), "tokens_per_step": cfg.tokens_per_step(ns.nproc)}
    if ns.capacity_mib:
        watch_kwargs["capacity_bytes"] = int(ns.capacity_mib * (1 << 20))
    console.print(f"[bold]fsdp-doctor demo[/]: GPT {cfg.n_layers}×{cfg.d_model} (wrap={cfg.wrap}) on {ns.nproc} "
                  f"gloo ranks, {cfg.steps} steps → {out}")
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

    with Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
                  TimeElapsedColumn(), console=console, transient=True) as prog:
        task = prog.add_task("train", total=cfg.steps)
        follower = None
        while th.is_alive():
            th.join(0.5)
            if follower is None and out.exists():
                follower = RunFollower(out)
            if follower is not None:
                run, _ = follower.poll()
                done = min((len(rd.steps) for rd in run.ranks.values()), default=0)
                prog.update(task, completed=done)
    if "error" in result:
        e = result["error"]
        _err(f"the demo workload failed: {e}" if isinstance(e, WorkloadError) else f"the demo workload failed: {type(e).__name__}: {e}")
        return 1
    losses = result["losses"]
    console.print(f"trained {cfg.steps} steps in {time.perf_counter() - t0:.1f} s; loss {losses[0][0]:.3f} → {losses[0][-1]:.3f}")
    run = load_run(out)
    report = build_report(run)
    from .record.tensorboard import export_tensorboard

    export_tensorboard(run, out)  # TensorBoard scalars written after training, at no cost to it
    report_path = out / "report.json"
    report_path.write_text(json.dumps(report, indent=1, default=str))
    ns.json = None
    _emit(report, ns, console)
    console.print(f"\nJSON report: {report_path}\nAnalyze again: fsdp-doctor analyze {out}\n"
                  f"Dashboard:   fsdp-doctor dashboard {out}\nTensorBoard: tensorboard --logdir {out}")
    return EXIT_OK


# ----------------------------------------------------------------------------------------- dashboard
def cmd_dashboard(ns: argparse.Namespace) -> int:
    path = Path(ns.path)
    if not path.exists():
        _err(f"{path}: no such run directory")
        return EXIT_BAD_INPUT
    try:
        from fsdp_doctor.dashboards.app import serve
    except ImportError as e:
        _err(f"the dashboard is not available ({e})")
        return 1
    return serve(path, host=ns.host, port=ns.port) or EXIT_OK


# ----------------------------------------------------------------------------------------- tensorboard
def cmd_tensorboard(ns: argparse.Namespace) -> int:
    from .record.tensorboard import export_tensorboard

    path = Path(ns.path)
    run = _load(path)
    if run is None:
        return EXIT_BAD_INPUT
    if not run.has_records:
        _err(f"{path}: no fsdp-doctor records (rank*.records.jsonl) to convert")
        return EXIT_BAD_INPUT
    out = Path(ns.out) if ns.out else path
    dirs = export_tensorboard(run, out, traces=not ns.no_traces)
    for d in dirs:
        print(f"wrote {d}")
    print(f"open with: tensorboard --logdir {out}")
    return EXIT_OK


def build_parser(with_workload: bool = True) -> argparse.ArgumentParser:
    """``with_workload``: add the demo's workload flags (importing torch); skipped for the other commands."""
    p = argparse.ArgumentParser(prog="fsdp-doctor", description="Profiling and diagnostics for PyTorch FSDP2 training.")
    from . import __version__

    p.add_argument("--version", action="version", version=f"fsdp-doctor {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)

    a = sub.add_parser("analyze", help="analyze a run directory or Kineto traces (.json / .json.gz)")
    a.add_argument("path")
    a.add_argument("--json", metavar="FILE", help="write the JSON report here")
    a.add_argument("--html", metavar="FILE", help="write a self-contained HTML report here")
    a.set_defaults(fn=cmd_analyze)

    d = sub.add_parser("demo", help="train the reference FSDP2 workload with the doctor attached, then analyze it")
    d.add_argument("--out", default="traces/demo", help="run directory (default: traces/demo)")
    d.add_argument("--nproc", type=int, default=2, help="gloo ranks (default: 2)")
    d.add_argument("--capacity-mib", type=float, default=None, help="memory budget per rank for the diagnosis")
    if with_workload:
        from .workloads import add_cli_args

        add_cli_args(d)
    d.set_defaults(fn=cmd_demo)

    s = sub.add_parser("dashboard", help="serve the live dashboard over a run directory")
    s.add_argument("path")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8050)
    s.set_defaults(fn=cmd_dashboard)

    t = sub.add_parser("tensorboard", help="write TensorBoard scalars (tb/rank{R}) for a recorded run")
    t.add_argument("path")
    t.add_argument("--out", default=None, help="log directory (default: the run directory)")
    t.add_argument("--no-traces", action="store_true", help="skip the overlap scalars from the profiler traces")
    t.set_defaults(fn=cmd_tensorboard)
    return p


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    first = next((a for a in args if not a.startswith("-")), None)
    ns = build_parser(with_workload=first == "demo" or "-h" in args or "--help" in args).parse_args(args)
    try:
        return ns.fn(ns)
    except KeyboardInterrupt:
        _err("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
