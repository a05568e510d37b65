"""The command line's edges: each bad input is one line on stderr and exit 2, never a traceback, never "healthy";
help texts name every argument and the exit codes without importing torch; reruns never mix runs."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "traces" / "sample"
PY = sys.executable


def fd(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "fsdp_doctor.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=120, cwd=cwd or REPO)


def one_line_error(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    err = r.stderr.strip()
    assert err.count("\n") == 0 and err.startswith("fsdp-doctor: "), r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert "Healthy" not in r.stdout
    return err


def test_empty_trace_is_not_healthy(tmp_path):
    f = tmp_path / "empty.json"
    f.write_text('{"traceEvents": []}')
    r = fd("analyze", f)
    err = one_line_error(r)
    assert str(f) in err and "traceEvents\" is empty" in err
    assert r.stdout == ""  # no report, no "Healthy: no findings"


def test_text_file_is_one_line_naming_it(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("hello\n")
    r = fd("analyze", f)
    err = one_line_error(r)
    assert err.startswith(f"fsdp-doctor: {f}: invalid JSON") and r.stdout == ""


def test_folder_of_foreign_files_is_one_line(tmp_path):
    (tmp_path / "a.json").write_text('{"a": 1}')
    (tmp_path / "b.json").write_text("[")
    err = one_line_error(fd("analyze", tmp_path))
    assert "nothing to analyse" in err and "(and 1 more)" in err


@pytest.mark.parametrize("kind", ["json", "html"])
def test_report_file_in_missing_directory_fails_before_any_work(tmp_path, kind):
    target = tmp_path / "missing" / "dir" / f"r.{kind}"
    r = fd("analyze", SAMPLE, f"--{kind}", target)
    err = one_line_error(r)
    assert err == f"fsdp-doctor: --{kind} {target}: directory {target.parent} does not exist"
    assert r.stdout == "" and not target.parent.exists()


def test_report_file_that_is_a_directory(tmp_path):
    err = one_line_error(fd("analyze", SAMPLE, "--json", tmp_path))
    assert "is a directory" in err


def test_dashboard_port_in_use_is_checked_before_announcing():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = fd("dashboard", SAMPLE, "--port", port)
    err = one_line_error(r)
    assert f"127.0.0.1:{port}" in err and "choose another --port" in err
    assert r.stdout == "" and "Dash is running" not in r.stderr


def test_help_names_every_argument_and_the_exit_codes_without_torch():
    code = ("import sys\nfrom fsdp_doctor.cli import main\n"
            "for cmd in ('analyze', 'compare', 'dashboard', 'tensorboard'):\n"
            "    try:\n        main([cmd, '--help'])\n    except SystemExit:\n        pass\n"
            "print('TORCH', 'torch' in sys.modules)")
    r = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO,
                       env={**os.environ, "COLUMNS": "80"})
    assert "TORCH False" in r.stdout, r.stdout[-500:] + r.stderr
    # within an 80-column terminal (analyze's description read 192 columns, compare's 299, the exit codes' 108: a
    # new-user trial)
    assert max(map(len, r.stdout.splitlines())) <= 80, [ln for ln in r.stdout.splitlines() if len(ln) > 80]
    out = " ".join(r.stdout.split())  # (argparse wraps the help at its own column)
    assert "run directory, directory of Kineto traces, or one trace file" in out
    assert "address to bind" in out and "port to bind" in out
    for line in ("0 everything read and analysed", "2 nothing usable", "3 analysed, but some files",
                 "4 analyze --fail-on LEVEL"):
        assert line in out


def test_tensorboard_export_does_not_import_torch(tmp_path):
    d = tmp_path / "run"
    shutil.copytree(SAMPLE, d, ignore=shutil.ignore_patterns("tb"))
    code = ("import sys\nfrom fsdp_doctor.cli import main\nrc = main(['tensorboard', sys.argv[1], '--no-traces'])\n"
            "print('RC', rc, 'TORCH', 'torch' in sys.modules)")
    r = subprocess.run([PY, "-c", code, str(d)], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert "RC 0 TORCH False" in r.stdout, r.stdout + r.stderr
    assert sorted(p.name for p in (d / "tb").iterdir()) == ["rank0", "rank1"]


def test_demo_refuses_a_directory_holding_a_run(tmp_path):
    d = tmp_path / "run"
    shutil.copytree(SAMPLE, d)
    before = sorted(p.name for p in d.rglob("*"))
    err = one_line_error(fd("demo", "--out", d, "--steps", "2"))
    assert err == f"fsdp-doctor: {d} already holds a run's records; add --overwrite to replace them, or choose a new --out"
    assert sorted(p.name for p in d.rglob("*")) == before  # nothing touched


def test_clear_run_removes_only_the_runs_files(tmp_path):
    from fsdp_doctor.store import layout

    d = tmp_path / "run"
    shutil.copytree(SAMPLE, d)
    (d / "notes.md").write_text("mine")
    assert layout.has_run(d)
    layout.clear_run(d)
    assert sorted(p.name for p in d.iterdir()) == ["notes.md"] and not layout.has_run(d)


def test_demo_hints_are_commands_that_work_as_printed(monkeypatch, tmp_path):
    from fsdp_doctor import cli

    bindir = Path(PY).parent
    if not (bindir / "fsdp-doctor").exists():
        pytest.skip("no fsdp-doctor script beside this python (the package on PYTHONPATH, e.g. the GPU machine): "
                    "test_demo_hints_without_an_installed_script covers that layout")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # a fresh shell: the venv is not on PATH
    got = cli._command("fsdp-doctor")
    assert Path(got).is_file() and Path(got).resolve() == (bindir / "fsdp-doctor").resolve()
    monkeypatch.setenv("PATH", f"{bindir}:/usr/bin:/bin")
    assert cli._command("fsdp-doctor") == "fsdp-doctor"


def test_demo_hints_without_an_installed_script(monkeypatch, tmp_path):
    """The package on PYTHONPATH, not installed (the GPU machine: --target /tmp/site, no fsdp-doctor script): the
    demo's hints say ``PYTHON -m fsdp_doctor.cli``, the bare interpreter's name where PATH finds this one, and
    they run as printed (the bare name ``fsdp-doctor`` would not: the rehearsal's test above failed so)."""
    from conftest import child_pythonpath

    from fsdp_doctor import cli

    fake = tmp_path / "bin" / "python3"  # an interpreter with no fsdp-doctor script beside it
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\nexec "{PY}" "$@"\n')  # (a link would lose the venv: its pyvenv.cfg is not here)
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    got = cli._command("fsdp-doctor", module="fsdp_doctor.cli")
    assert got == f"{fake} -m fsdp_doctor.cli"
    assert cli._command("fsdp-doctor") == "fsdp-doctor"  # no module to fall back on: the name, as before
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": child_pythonpath(REPO), "HOME": str(tmp_path)}
    r = subprocess.run(f"{got} analyze {SAMPLE}", shell=True, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    monkeypatch.setenv("PATH", f"{fake.parent}:/usr/bin:/bin")
    assert cli._command("fsdp-doctor", module="fsdp_doctor.cli") == "python3 -m fsdp_doctor.cli"


def test_json_report_of_the_sample(tmp_path):
    out = tmp_path / "r.json"
    r = fd("analyze", SAMPLE, "--json", out)
    assert r.returncode == 0 and f"JSON report written to {out}" in r.stdout
    rep = json.loads(out.read_text())
    assert rep["comm"]["source"] == "trace" and rep["run"]["path"] == str(SAMPLE)


def test_saved_json_report_renders_as_the_report(tmp_path):
    """The presenters take a Report or its JSON form (a saved --json file): both show the same text."""
    import io
    import re

    from rich.console import Console

    from fsdp_doctor.pipeline import build_report
    from fsdp_doctor.present.html import render_html
    from fsdp_doctor.present.terminal import render_report
    from fsdp_doctor.store import load_run

    report = build_report(load_run(SAMPLE))
    saved = json.loads(json.dumps(report.to_builtins(), default=str))

    def terminal(r):
        c = Console(file=io.StringIO(), width=100, record=True, color_system=None)
        render_report(r, c)
        return c.export_text()

    def html(r):  # plotly names each figure's div with a fresh uuid
        return re.sub(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", "ID", render_html(r))

    text = terminal(report)
    assert "Step time per rank" in text and "prefetch.exposed_allgather" in text
    assert terminal(saved) == text
    assert html(saved) == html(report)


def test_json_dash_is_the_json_alone_on_standard_output(tmp_path):
    """`--json -` wrote a file named '-' in the working directory and printed the terminal report (a new-user trial).
    It is the JSON alone on standard output now, for `analyze` and `compare`; no file is written."""
    import json
    import subprocess
    import sys

    for args in (["analyze", str(SAMPLE)], ["compare", str(SAMPLE), str(SAMPLE)]):
        p = subprocess.run([sys.executable, "-m", "fsdp_doctor.cli", *args, "--json", "-"], capture_output=True,
                           text=True, cwd=tmp_path, timeout=120)
        assert p.returncode in (0, 3), p.stderr
        out = json.loads(p.stdout)  # (nothing else there)
        assert ("findings" in out) if args[0] == "analyze" else ("step" in json.dumps(out))
        assert not (tmp_path / "-").exists()


def test_a_ci_job_reads_the_json_alone_and_fails_on_findings(tmp_path):
    """A new-user trial's CI job: ``--explain --json -`` put the rules table after the JSON on standard output, and
    with ``FORCE_COLOR=1`` (set by many CI systems) the traces' progress bar went into it: invalid JSON both times.
    The table goes to standard error there, the bar always does; ``--fail-on LEVEL`` exits 4 on a finding at LEVEL
    or above, naming it in one line, and the codes of the JSON's findings are what it counts."""
    import os

    env = {**os.environ, "FORCE_COLOR": "1", "COLUMNS": "40"}
    p = subprocess.run([PY, "-m", "fsdp_doctor.cli", "analyze", SAMPLE, "--explain", "--json", "-"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)  # (nothing else there)
    assert "Rules checked" in p.stderr and len(report["rules"]) > 30
    fired = sorted({f["code"] for f in report["findings"]})
    levels = sorted({f["severity"] for f in report["findings"]})
    assert fired == ["prefetch.exposed_allgather"] and levels == ["info"], (fired, levels)
    r = fd("analyze", SAMPLE, "--fail-on", "info")
    assert r.returncode == 4 and "Diagnosis" in r.stdout, r.stderr
    assert r.stderr.strip() == ("fsdp-doctor: 1 finding at info or above (prefetch.exposed_allgather): exit 4 "
                                 "(--fail-on info)")
    assert fd("analyze", SAMPLE, "--fail-on", "warning").returncode == 0
    assert fd("analyze", SAMPLE, "--fail-on", "severe").returncode == 2  # not a level: argparse's usage line


def test_the_doctors_own_json_saved_in_the_run_folder_is_not_read_as_a_trace(tmp_path):
    """`analyze RUN --json RUN/analysis.json`, then `analyze RUN`: the saved report was read as a trace ("skipped:
    analysis.json: not a Kineto trace") and the second analyze exited 3, failing a CI script (a new-user trial). The
    doctor's own JSON outputs, under any name, are left out as report.json is; a foreign JSON still is not."""
    run = tmp_path / "run"
    shutil.copytree(SAMPLE, run, ignore=shutil.ignore_patterns("report.json"))
    assert fd("analyze", run, "--json", run / "analysis.json").returncode == 0
    assert fd("compare", run, run, "--json", run / "compare.json").returncode == 0
    r = fd("analyze", run)
    assert r.returncode == 0 and "skipped" not in r.stdout + r.stderr, r.stdout[-2000:] + r.stderr
    (run / "notes.json").write_text('{"schema": "mine", "x": 1}')
    r = fd("analyze", run)
    assert r.returncode == 3 and "notes.json: not a Kineto trace" in r.stdout + r.stderr


def test_a_folder_holding_the_records_in_a_folder_of_their_own_is_read_from_there(sample_run_path, tmp_path, capsys):
    """A new-user trial passed torchtitan's dump folder (its profiler traces, and the doctor's records in
    fsdp_doctor/) to analyze: the report was of the traces alone, and the dashboard said "no records yet". The one
    folder right below that holds record streams is read, and one line says so; a folder holding streams is read
    as it is."""
    import shutil

    from fsdp_doctor.cli import main

    dump = tmp_path / "dump"
    shutil.copytree(sample_run_path, dump / "fsdp_doctor", ignore=shutil.ignore_patterns("report.json", "tb"))
    shutil.copytree(sample_run_path / "profiler", dump / "profiling" / "traces")  # torchtitan's own traces
    assert main(["analyze", str(dump), "--json", str(tmp_path / "r.json")]) == 0
    err = capsys.readouterr().err
    assert err == f"fsdp-doctor: {dump} holds no fsdp-doctor records; reading the ones in {dump / 'fsdp_doctor'}\n"
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["run"]["steps_recorded"] and report["memory"]["per_rank"]
    assert main(["analyze", str(dump / "fsdp_doctor"), "--json", str(tmp_path / "s.json")]) == 0
    assert "holds no fsdp-doctor records" not in capsys.readouterr().err


def _stderr_on_a_terminal(*args) -> tuple[int, str, str]:
    """(exit code, stdout, what a terminal on standard error showed) of ``fsdp-doctor ARGS``."""
    import os
    import pty
    import threading

    master, slave = pty.openpty()
    shown = bytearray()

    def drain():
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # the terminal closed
                return
            if not chunk:
                return
            shown.extend(chunk)

    th = threading.Thread(target=drain, daemon=True)
    th.start()
    try:
        p = subprocess.run([PY, "-m", "fsdp_doctor.cli", *map(str, args)], stdout=subprocess.PIPE, stderr=slave,
                           timeout=120, cwd=REPO, text=True)
    finally:
        os.close(slave)
        th.join(5)
        os.close(master)
    return p.returncode, p.stdout, shown.decode(errors="replace")


def test_reading_and_analysing_show_progress_on_a_terminal_and_nothing_in_a_pipe(tmp_path):
    """A 20,000-step run's records take seconds to read and analyse (3 s and 5-8 s here): a spinner on standard
    error says what is read and analysed while it runs, on a terminal; in a pipe (CI, ``2> file``) nothing; the
    report on standard output is the same."""
    code, out, shown = _stderr_on_a_terminal("analyze", SAMPLE)
    assert code == 0 and "Diagnosis" in out
    assert f"reading {SAMPLE}" in shown, shown
    steps = sum(1 for f in ("rank0", "rank1") for ln in (SAMPLE / f"{f}.records.jsonl").read_text().splitlines()
                if ln.startswith('{"t":"step"'))
    assert f"analysing {steps:,} step records of 2 ranks and 2 traces" in shown, shown
    piped = fd("analyze", SAMPLE)
    assert piped.returncode == 0 and "reading" not in piped.stderr and "analysing" not in piped.stderr
    code, _, shown = _stderr_on_a_terminal("tensorboard", SAMPLE, "--out", tmp_path / "tb", "--no-traces")
    assert code == 0 and f"writing TensorBoard events of {steps:,} step records of 2 ranks" in shown, shown


def test_a_folder_of_runs_is_one_line_naming_them(tmp_path):
    """A folder holding several runs' folders (a new-user trial's traces/): read as one folder of traces, one job's
    were picked, the others' skipped as "rank 0 again", exit 3, and nothing said it held runs. One line names them,
    for analyze, compare and tensorboard alike; a folder with one run below it still reads that run."""
    import shutil

    for name in ("run_a", "run_b"):
        shutil.copytree(SAMPLE, tmp_path / "runs" / name, ignore=shutil.ignore_patterns("report.json"))
    for args in (("analyze", tmp_path / "runs"), ("compare", tmp_path / "runs", SAMPLE),
                 ("tensorboard", tmp_path / "runs")):
        err = one_line_error(fd(*args))
        assert err == (f"fsdp-doctor: {tmp_path / 'runs'} holds 2 runs' records, each in a folder of its own (run_a, "
                       "run_b): give one of them (fsdp-doctor compare A B sets two side by side)"), err
    shutil.rmtree(tmp_path / "runs" / "run_b")
    r = fd("analyze", tmp_path / "runs")
    assert r.returncode == 0 and "reading the ones in" in r.stderr


def test_a_quiet_share_never_reads_as_its_threshold():
    """A rule quiet below its threshold said "3% (fires from 3%)" of a 2.96% share (whole-percent rounding): a
    share said beside the threshold it is under gets the decimals that show it under (three at most)."""
    from fsdp_doctor.diagnose.estimate import above_share, below_share
    from fsdp_doctor.units import fmt_share

    assert [fmt_share(x, under=0.03) for x in (0.0296, 0.02999, 0.029999, 0.024, 0.2, 0.004)] == \
        ["2.96%", "2.999%", "3.000%", "2%", "20%", "0.4%"]
    assert [fmt_share(x, 1, 0.05) for x in (0.0499, 0.04, 0.051)] == ["4.99%", "4.0%", "5.1%"]
    assert below_share("activations", 59.7, 100, "the peak", 0.6) == \
        "activations 60 B: 59.7% of the peak 100 B (fires from 60%)"
    assert above_share("peak", 50.2, 100, "capacity", 0.5) == "peak 50 B: 50% of capacity 100 B (fires below 50%)"


def test_a_share_under_one_percent_never_reads_zero(tmp_path):
    """The sample run with a 4 GiB budget (its peak 14.63 MiB: 0.36%): the memory lines and the quiet reasons read
    "0% of 4.00 GiB" while ac.unneeded's title said "0.4% of capacity" (a new-user trial). Every share goes through
    one formatter, which never writes "0%" nor "100%" for one that is neither."""
    from fsdp_doctor.units import fmt_share

    assert [fmt_share(x) for x in (0, 0.0004, 0.00357, 0.014, 0.43, 0.996, 0.99996, 1, 1.19)] == \
        ["0%", "<0.1%", "0.4%", "1%", "43%", "99.6%", ">99.9%", "100%", "119%"]
    assert [fmt_share(x, 1) for x in (0.0004, 0.014, 0.99996)] == ["<0.1%", "1.4%", ">99.9%"]
    run = tmp_path / "run"
    shutil.copytree(SAMPLE, run, ignore=shutil.ignore_patterns("report.json", "tb"))
    for f in run.glob("rank*.records.jsonl"):  # what watch(capacity_bytes=4 << 30) records
        f.write_text(f.read_text().replace('{"t":"config",', '{"t":"config","capacity_bytes":4294967296,'))
    r = subprocess.run([PY, "-m", "fsdp_doctor.cli", "analyze", str(run), "--explain"], capture_output=True,
                       text=True, timeout=120, cwd=REPO, env={**os.environ, "COLUMNS": "200"})
    out = r.stdout + r.stderr
    for rank in (0, 1):
        assert f"rank {rank}: peak 14.63 MiB at step 1, norm, lm_head backward_end; 0.4% of 4.00 GiB" in out, out
    quiet = [ln for ln in out.splitlines() if "peak 14.63 MiB: " in ln]
    assert len(quiet) >= 3 and all("peak 14.63 MiB: 0.4% of capacity 4.00 GiB" in ln for ln in quiet), quiet
    assert not re.search(r"(?<![\d.])0% of (capacity|4.00 GiB)", out), out


def test_each_commands_help_lists_the_exit_codes_it_returns():
    """compare, schema and dashboard --help listed "4 analyze --fail-on LEVEL", which they never return, and compare's
    --json and --html did not say their directory must exist, as analyze's do (a new-user trial)."""
    code = ("from fsdp_doctor.cli import main\n"
            "for cmd in ('analyze', 'compare', 'schema', 'dashboard', 'tensorboard', 'rules', 'demo'):\n"
            "    print('==', cmd)\n    try:\n        main([cmd, '--help'])\n    except SystemExit:\n        pass\n")
    r = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO,
                       env={**os.environ, "COLUMNS": "80"})
    helps = {h.split("\n", 1)[0]: " ".join(h.split()) for h in r.stdout.split("== ")[1:]}
    codes = {cmd: re.findall(r"(?:^| )(\d+) +\S", h.split("exit codes:")[1]) for cmd, h in helps.items()}
    assert codes == {"analyze": ["0", "2", "3", "4", "130"], "compare": ["0", "2", "3", "130"], "schema": ["0"],
                     "dashboard": ["0", "1", "2", "130"], "tensorboard": ["0", "2", "3", "130"], "rules": ["0"],
                     "demo": ["0", "1", "2", "130"]}, codes
    # each code with this command's own reasons: analyze's and compare's 2 named "port in use, a run directory
    # holding another run" (the dashboard's and the demo's), and rules listed no code (a new-user trial)
    two = {cmd: re.search(r" 2 (.*?)(?: 3 | 130 |$)", h.split("exit codes:")[1]).group(1) for cmd, h in helps.items()
           if "2" in codes[cmd]}
    assert all("port" not in two[c] and "another run" not in two[c] for c in ("analyze", "compare", "tensorboard"))
    assert "port in use" in two["dashboard"] and "--out holding another run" in two["demo"], two
    assert "--gpu-hour-price" in two["compare"] and "event files already there" in two["tensorboard"], two
    assert "0 the catalogue printed" in helps["rules"] and "0 both runs read and compared" in helps["compare"]
    assert "4 analyze --fail-on LEVEL" in helps["analyze"]
    assert "1 the dashboard's packages are not installed" in helps["dashboard"]
    for cmd in ("analyze", "compare"):
        assert helps[cmd].count("(its directory must exist)") == 2, helps[cmd]
