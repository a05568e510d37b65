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


def test_tensorboard_export_does_not_hang_on_fifos(tmp_path):
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
    assert rc == 0
    assert [p.name for p in (tmp_path / "tb" / "tb").iterdir()] == ["rank0"]


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
