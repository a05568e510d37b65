"""The bad-input corpus (tests/bad_inputs.py): every hostile input gets its answer: no misleading report, no
traceback, no hang; and the outputs' own guarantees (atomic writes, a closed pipe, a FIFO in a run directory)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import bad_inputs as B
from conftest import child_pythonpath

CASES = B.cases()


def test_corpus_is_large_and_varied():
    assert len(CASES) >= 100
    kinds = {c.expect for c in CASES}
    assert kinds == {"error", "partial", "ok"}
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input(case, tmp_path):
    outcome = B.run_case(case, tmp_path / "in")
    assert B.verdict(case, outcome) == ""


def test_tensorboard_export_does_not_hang_on_fifos(tmp_path, capsys):
    from fsdp_doctor import cli

    run = B.sample_run(tmp_path, traces=True)
    (run / "rank1.records.jsonl").unlink()
    os.mkfifo(run / "rank1.records.jsonl")
    (run / "profiler" / "rank0.6.pt.trace.json.gz").unlink()
    os.mkfifo(run / "profiler" / "rank0.6.pt.trace.json.gz")
    (run / "manifest.json").unlink()
    os.mkfifo(run / "manifest.json")
    import signal

    def hang(*_):
        raise TimeoutError("tensorboard export hung")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(B.TIMEOUT_S)
    try:
        rc = cli.main(["tensorboard", str(run), "--out", str(tmp_path / "tb")])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert rc == 3  # (rank 1's records, a profiler window and the manifest skipped, each named)
    assert [p.name for p in (tmp_path / "tb" / "tb").iterdir()] == ["rank0"]
    assert [x for x in capsys.readouterr().out.splitlines() if x.startswith("skipped: ")] == [
        "skipped: manifest.json: cannot read (not a regular file (a FIFO)); the streams are read without it",
        "skipped: rank1.records.jsonl: cannot read (not a regular file (a FIFO))",
        "skipped: profiler/rank0.6.pt.trace.json.gz: not a regular file (a FIFO)"]  # (not "...; skipped" again)


@pytest.mark.parametrize("command", ["analyze", "compare"])
def test_closed_pipe_exits_0_and_still_writes_the_files(tmp_path, command):
    """``fsdp-doctor analyze ... --json r.json --html r.html | head``: the reader went away; exit 0, no "Exception
    ignored" noise, and the report files asked for are written all the same (they were lost before), with the
    permissions a plain ``open`` gives (``mkstemp``'s 0600 hid them from the user's group)."""
    env = {**os.environ, "PYTHONPATH": child_pythonpath(Path(B.HERE).parent)}
    inputs = [str(B.SAMPLE)] * (2 if command == "compare" else 1)
    files = [tmp_path / "r.json", tmp_path / "r.html"]
    p = subprocess.Popen([sys.executable, "-m", "fsdp_doctor.cli", command, *inputs, "--json", str(files[0]),
                          "--html", str(files[1])], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                         preexec_fn=lambda: os.umask(0o022))
    p.stdout.close()  # before anything is written: every write meets a broken pipe
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 0, err
    assert "BrokenPipe" not in err and "Traceback" not in err
    assert json.loads(files[0].read_text()) and "</html>" in files[1].read_text()[-200:].lower()
    assert [oct(f.stat().st_mode & 0o777) for f in files] == [oct(0o644)] * 2
    assert not list(tmp_path.glob(".*.tmp"))


def test_failed_write_leaves_the_previous_file_whole(tmp_path, monkeypatch):
    """A write that fails half-way (disk full) leaves the previous file as it was and no temporary file."""
    from fsdp_doctor.store import layout

    target = tmp_path / "report.html"
    target.write_text("previous report")
    real_fdopen = os.fdopen

    class HalfWrite:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[: len(data) // 2])
            self.f.flush()
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fdopen", lambda fd, mode: HalfWrite(real_fdopen(fd, mode)))
    with pytest.raises(OSError):
        layout.write_atomic(target, "new report " * 1000)
    monkeypatch.undo()
    assert target.read_text() == "previous report"
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]  # no temporary file left behind
    layout.write_atomic(target, "new")
    assert target.read_text() == "new"


def test_a_report_file_follows_a_link_and_writes_through_a_fifo_or_device(tmp_path, monkeypatch):
    """A new-user trial: ``--json link.json`` (a symlink) replaced the link with a file and left its target as it
    was; ``--json /dev/full`` exited 0 and turned the device into an 82 KB file; a FIFO's reader got 0 bytes and the
    FIFO became a file. The link's target is what is written, the link stays; a FIFO or device is written through
    and stays what it was; a device that refuses the write (ENOSPC, as /dev/full: simulated here, on a FIFO of
    this test's own) is one line and exit 2."""
    import stat
    import threading

    from fsdp_doctor.store import layout

    target = tmp_path / "target.json"
    target.write_text("old")
    (tmp_path / "link.json").symlink_to(target)
    fifo = tmp_path / "fifo.html"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    rc, out, err = _in_process("analyze", B.SAMPLE, "--json", tmp_path / "link.json", "--html", fifo)
    reader.join(timeout=30)
    assert rc == 0, err
    assert (tmp_path / "link.json").is_symlink() and os.readlink(tmp_path / "link.json") == str(target)
    assert json.loads(target.read_text())["verdict"]
    assert stat.S_ISFIFO(fifo.lstat().st_mode) and got and b"</html>" in got[0][-200:].lower()
    assert not list(tmp_path.glob(".*.tmp"))

    full = tmp_path / "full"
    os.mkfifo(full)
    real_open = open

    class Full:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def write(self, data):
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(layout, "open", lambda p, *a, **k: Full() if Path(p) == full else real_open(p, *a, **k),
                        raising=False)
    rc, out, err = _in_process("analyze", B.SAMPLE, "--json", full)
    assert rc == 2
    assert err.strip() == f"fsdp-doctor: --json {full}: cannot write (No space left on device)"
    assert stat.S_ISFIFO(full.lstat().st_mode)


# ------------------------------------------------------------------------------------------ a new-user trial's finds
def _cli(*args: str, prefix=(), timeout=120) -> subprocess.CompletedProcess:
    """``fsdp-doctor ARGS`` in a child process (``prefix``: ``B.unprivileged()``'s, for the permission cases)."""
    env = {**os.environ, "PYTHONPATH": child_pythonpath(Path(B.HERE).parent), "COLUMNS": "200"}
    return subprocess.run([*prefix, sys.executable, "-m", "fsdp_doctor.cli", *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=timeout)


def _in_process(*args: str) -> tuple[int, str, str]:
    import contextlib
    import io

    from fsdp_doctor import cli

    so, se = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(so), contextlib.redirect_stderr(se):
        rc = cli.main([str(a) for a in args])
    return rc, so.getvalue(), se.getvalue()


@pytest.fixture
def unprivileged():
    prefix = B.unprivileged()
    if prefix is None:
        pytest.skip("file permissions cannot bind this user (root without a working setpriv)")
    return prefix


@pytest.fixture
def locked():
    """``locked(path, mode)``: chmods ``path``; every mode is given back at the end (the folder can be removed)."""
    done = []

    def lock(path: Path, mode: int) -> Path:
        done.append((path, path.stat().st_mode & 0o7777))
        path.chmod(mode)
        return path

    yield lock
    for path, mode in reversed(done):
        path.chmod(mode)


def test_an_unreadable_profiler_folder_loses_no_record(tmp_path, unprivileged, locked):
    """One ``profiler/`` a user cannot read (chmod 000) lost the whole run: "cannot be read as a run directory or
    trace file (Permission denied)", exit 2, from analyze, compare and tensorboard alike (``Path.exists`` raised on
    a window listed in the records). The records are read, the folder named, exit 3."""
    run = B.sample_run(tmp_path, traces=True)
    locked(run / "profiler", 0)
    r = _cli("analyze", run, "--json", tmp_path / "r.json", prefix=unprivileged)
    assert r.returncode == 3, r.stderr
    assert "Traceback" not in r.stderr and r.stderr == ""
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["problems"] == ["profiler: cannot read folder (Permission denied); skipped"]
    assert "skipped: profiler: cannot read folder (Permission denied)" in r.stdout.splitlines()
    B.sample_steps(rep)  # every step record of both ranks
    assert rep["run"]["ranks"] == [0, 1]

    c = _cli("compare", B.SAMPLE, run, "--json", tmp_path / "c.json", prefix=unprivileged)
    assert c.returncode == 3, c.stderr
    assert f"skipped (B, {run}): profiler: cannot read folder (Permission denied)" in c.stdout.splitlines()
    cmp = json.loads((tmp_path / "c.json").read_text())
    assert cmp["b"]["problems"] == ["profiler: cannot read folder (Permission denied); skipped"]
    assert "problems" not in cmp["a"]

    t = _cli("tensorboard", run, "--out", tmp_path / "tb", prefix=unprivileged)
    assert t.returncode == 3, t.stderr
    assert sorted(p.name for p in (tmp_path / "tb" / "tb").iterdir()) == ["rank0", "rank1"]
    assert "skipped: profiler: cannot read folder (Permission denied)" in t.stdout.splitlines()


@pytest.mark.parametrize("mode,why", [(0o000, "cannot read folder (Permission denied)"),
                                      (0o644, "cannot open the files in the folder (Permission denied")])
def test_dashboard_on_an_unreadable_folder_says_so_in_one_line(tmp_path, unprivileged, locked, mode, why):
    """``fsdp-doctor dashboard`` on a folder the user cannot list (000) or cannot open the files of (644, no x):
    a traceback (PermissionError from listing it, or from manifest.json). One line naming it, exit 2, nothing
    served."""
    run = B.sample_run(tmp_path, traces=False)
    locked(run, mode)
    r = _cli("dashboard", run, "--port", "1", prefix=unprivileged, timeout=60)
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr.splitlines() == [f"fsdp-doctor: {run}: {why}" + ("" if mode == 0 else
                                                                    ": it lacks search (x) permission)")]


@pytest.mark.parametrize("where", ["run", "tb"])
def test_tensorboard_into_a_read_only_folder_says_so_in_one_line(tmp_path, unprivileged, locked, where):
    """``fsdp-doctor tensorboard RUN`` where the run folder is read-only (PermissionError from mkdir of tb/), or only
    its tb/ is (from tempfile.mkdtemp, naming a temporary folder): a traceback. One line naming the folder, exit 2."""
    run = B.sample_run(tmp_path, traces=False)
    folder = run if where == "run" else run / "tb"
    folder.mkdir(exist_ok=True)
    locked(folder, 0o555)
    r = _cli("tensorboard", run, prefix=unprivileged)
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr.splitlines() == [f"fsdp-doctor: {folder}: cannot write the TensorBoard events there (Permission "
                                     "denied); --out DIR writes them elsewhere"]
    assert [p.name for p in folder.iterdir()] == ([] if where == "tb" else sorted(p.name for p in folder.iterdir()))


def _foreign_rank1(run: Path) -> Path:
    B.edit_manifest(run, run_id="aaaa")
    B.edit_stream(run, 0, lambda x: [{**y, "run_id": "aaaa"} if y.get("t") == "header" else y for y in x])
    return B.edit_stream(run, 1, lambda x: [{**y, "run_id": "bbbb"} if y.get("t") == "header" else y for y in x])


FOREIGN = ("rank1.records.jsonl: records of another run (run id bbbb, manifest.json says aaaa); skipped (a run "
           "directory holds one run)")
GARBAGE = ("rank1.records.jsonl: unreadable: no valid record in it (", "; it is not fsdp-doctor records, or is "
           "damaged: rank 1 is not analysed")


@pytest.mark.parametrize("damage", ["another-run", "garbage"])
def test_compare_names_what_it_skipped(tmp_path, damage):
    """``fsdp-doctor compare A B`` exited 3 when files of B were skipped, and no line said which. Each side's
    problems are named as analyze names them, on the terminal and in --json (``RunSide.problems``)."""
    run = B.sample_run(tmp_path, traces=True)
    if damage == "another-run":
        _foreign_rank1(run)
    else:
        B.random_bytes(run / "rank1.records.jsonl")
    rc, out, err = _in_process("compare", B.SAMPLE, run, "--json", tmp_path / "c.json")
    assert (rc, err) == (3, "")
    rc_a, _, _ = _in_process("analyze", run, "--json", tmp_path / "r.json")
    problems = json.loads((tmp_path / "r.json").read_text())["problems"]
    assert rc_a == 3
    if damage == "another-run":  # (and its profiler window, another run's too)
        assert problems == [FOREIGN, "profiler/rank1.6.pt.trace.json.gz: a profiler window of another run (not "
                                     "recorded by run aaaa); skipped"]
    else:
        assert len(problems) == 1 and problems[0].startswith(GARBAGE[0]) and problems[0].endswith(GARBAGE[1])
    lines = [f"skipped (B, {run}): {p.removesuffix('; skipped')}" for p in problems]  # (the word said once)
    assert [x for x in out.splitlines() if x.startswith("skipped")] == lines
    cmp = json.loads((tmp_path / "c.json").read_text())
    assert cmp["b"]["problems"] == problems and "problems" not in cmp["a"]
    # --json -: the JSON alone on standard output, the lines on standard error
    r = _cli("compare", B.SAMPLE, run, "--json", "-")
    assert r.returncode == 3 and json.loads(r.stdout)["b"]["problems"] == problems
    assert r.stderr.splitlines() == [f"fsdp-doctor: {x}" for x in lines]


@pytest.mark.parametrize("damage", ["garbage", "empty", "another-run"])
def test_tensorboard_names_what_it_skipped(tmp_path, damage):
    """``fsdp-doctor tensorboard RUN`` where a rank's records were skipped printed only ``wrote .../tb/rank0`` and
    exited 0. The problems are named, one line each (as analyze's), exit 3."""
    run = B.sample_run(tmp_path, traces=True)
    if damage == "garbage":
        B.random_bytes(run / "rank1.records.jsonl")
    elif damage == "empty":
        (run / "rank1.records.jsonl").write_text("")
    else:
        _foreign_rank1(run)
    rc, out, err = _in_process("tensorboard", run, "--out", tmp_path / "tb")
    assert (rc, err) == (3, "")
    lines = out.splitlines()
    assert lines[0] == f"wrote {tmp_path / 'tb' / 'tb' / 'rank0'}"
    skipped = [x for x in lines if x.startswith("skipped: ")]
    want = {"empty": ["skipped: rank1.records.jsonl: empty (no records)"],
            "another-run": [f"skipped: {FOREIGN}", "skipped: profiler/rank1.6.pt.trace.json.gz: a profiler window of "
                            "another run (not recorded by run aaaa)"]}
    if damage == "garbage":
        assert len(skipped) == 1
        assert skipped[0].startswith("skipped: " + GARBAGE[0]) and skipped[0].endswith(GARBAGE[1])
    else:
        assert skipped == want[damage]
    assert [p.name for p in (tmp_path / "tb" / "tb").iterdir()] == ["rank0"]


def test_tensorboard_names_a_profiler_window_it_cannot_decode(tmp_path):
    """A corrupt profiler window: its overlap scalars are left out, and said so (analyze names it the same way)."""
    run = B.sample_run(tmp_path, traces=True)
    (run / "profiler" / "rank1.6.pt.trace.json.gz").write_bytes(b"\x1f\x8bxx")
    rc, out, err = _in_process("tensorboard", run, "--out", tmp_path / "tb")
    assert (rc, err) == (3, "")
    skipped = [x for x in out.splitlines() if x.startswith("skipped: ")]
    assert len(skipped) == 1 and skipped[0].startswith("skipped: profiler/rank1.6.pt.trace.json.gz: ")
    assert skipped[0].endswith("; its overlap scalars are not written")


def test_a_record_file_of_random_bytes_is_one_line_and_not_a_killed_rank(tmp_path):
    """20 KB of random bytes as rank 1's records gave 147 lines "line N is not a valid record", and the header said
    "rank 1 did not finish (run still going, or killed)": the wrong cause. One line for the file; rank 1 is not
    analysed (its records are unreadable), rank 0's are, unchanged."""
    run = B.sample_run(tmp_path, traces=True)
    B.random_bytes(run / "rank1.records.jsonl")
    rc, out, err = _in_process("analyze", run, "--json", tmp_path / "r.json")
    assert (rc, err) == (3, "")
    rep = json.loads((tmp_path / "r.json").read_text())
    assert len(rep["problems"]) == 1, rep["problems"]
    p = rep["problems"][0]
    assert p.startswith(GARBAGE[0]) and p.endswith(GARBAGE[1])
    assert "lines that are not records, the first line 1: " in p
    assert rep["run"]["ranks"] == [0] and rep["run"]["complete"] == {"0": True}
    assert "did not finish" not in out and sum(x.startswith("skipped: ") for x in out.splitlines()) == 1
    from fsdp_doctor.store import load_run

    ref, got = load_run(B.SAMPLE), load_run(run)
    assert [s.step for s in got.ranks[0].steps] == [s.step for s in ref.ranks[0].steps]
    assert got.unread == {1} and list(got.ranks) == [0]


def test_a_served_folder_that_becomes_unreadable_keeps_what_was_read(tmp_path, monkeypatch):
    """The dashboard's refresh, once the folder cannot be listed (its permissions changed while served): a
    PermissionError from listing it went up through every poll. What was read is kept, and the folder named."""
    pytest.importorskip("dash")
    from fsdp_doctor.dashboards import state as S
    from fsdp_doctor.store import layout

    run = B.sample_run(tmp_path, traces=False)
    st = S.RunState(run, background_traces=False)
    st.refresh()
    steps = {r: list(c["step"]) for r, c in st.snapshot().steps.items()}
    assert sorted(steps) == [0, 1] and all(steps.values())

    def denied(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(S, "streams", denied)
    monkeypatch.setattr(layout, "streams", denied)
    assert st.refresh() is True  # (the problem is news)
    snap = st.snapshot()
    assert {r: list(c["step"]) for r, c in snap.steps.items()} == steps
    assert f"{run}: cannot read folder (Permission denied); the records read before are shown" in snap.report.problems
    assert not snap.notice  # nothing was "replaced": the run is not read again from scratch


@pytest.mark.parametrize("target, why", [("self", "symlink loop"), ("nowhere.json", "dangling symlink")])
def test_a_broken_link_given_alone_is_named_as_in_a_folder(tmp_path, target, why):
    """A self-link given alone read "no such file or directory", the same link inside a folder "symlink loop" (a
    new-user trial): one wording, naming the link."""
    link = tmp_path / "rank1.trace.json"
    link.symlink_to(link if target == "self" else tmp_path / target)
    rc, out, err = _in_process("analyze", link)
    assert rc == 2 and err.strip().splitlines() == [f"fsdp-doctor: {link}: {why}"], (rc, err)
