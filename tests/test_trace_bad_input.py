"""Bad input is one line per file in ``skipped``; the other files are still analysed."""

import gzip
import json

import pytest

from fsdp_doctor.report_sections import SkippedFile
from fsdp_doctor.trace import analyze_traces, find_trace_files
from trace_fixtures import gpu_known_trace


@pytest.fixture
def good(tmp_path):
    gpu_known_trace(rank=0).write(tmp_path / "rank0.1.pt.trace.json.gz")
    return tmp_path


def _one_line(skipped):
    for s in skipped:
        assert isinstance(s, SkippedFile)  # file, error
        assert "\n" not in s.error and "Traceback" not in s.error and len(s.error) < 300


def test_truncated_gzip(good):
    data = gzip.compress(json.dumps(gpu_known_trace(rank=1).document()).encode())
    (good / "rank1.5.pt.trace.json.gz").write_bytes(data[: len(data) // 2])
    r = analyze_traces(good)
    assert r.skipped == [SkippedFile(file="rank1.5.pt.trace.json.gz", error="truncated gzip stream")]
    assert list(r.per_rank) == ["0"] and r.per_rank["0"].overlap_pct == pytest.approx(42.0)


def test_corrupt_gzip_and_corrupt_json(good):
    (good / "rank2.json.gz").write_bytes(b"\x1f\x8b\x08\x00garbage-not-deflate")
    text = json.dumps(gpu_known_trace(rank=3).document())
    (good / "rank3.json").write_text(text[: len(text) - 40])  # cut mid-document
    (good / "rank4.json").write_text('{"traceEvents": [ {"ph": "X", ] }')
    r = analyze_traces(good)
    _one_line(r.skipped)
    errs = {s.file: s.error for s in r.skipped}
    assert set(errs) == {"rank2.json.gz", "rank3.json", "rank4.json"}
    assert errs["rank2.json.gz"].startswith("corrupt gzip data")
    assert errs["rank3.json"].startswith("invalid JSON")
    assert errs["rank4.json"].startswith("invalid JSON")
    assert list(r.per_rank) == ["0"]


def test_foreign_json(good):
    (good / "other.json").write_text('{"a": 1}')
    (good / "list.json").write_text("[1, 2, 3]")
    (good / "empty.json").write_text("")
    r = analyze_traces(good)
    _one_line(r.skipped)
    errs = {s.file: s.error for s in r.skipped}
    assert errs == {"other.json": "not a Kineto trace (no traceEvents)",
                    "list.json": "not a Kineto trace (top level is not an object)",
                    "empty.json": "empty file"}
    assert list(r.per_rank) == ["0"]


def test_empty_directory(tmp_path):
    (tmp_path / "manifest.json").write_text("{}")  # not a trace: ignored, not an error
    assert find_trace_files(tmp_path) == []
    r = analyze_traces(tmp_path)
    assert r.per_rank == {} and r.files == []
    assert len(r.skipped) == 1 and "no Kineto trace files" in r.skipped[0].error


def test_missing_path(tmp_path, good):
    missing = tmp_path / "nope"
    r = analyze_traces([missing, good])
    assert r.skipped == [SkippedFile(file=str(missing), error="no such file or directory")]
    assert list(r.per_rank) == ["0"]
    with pytest.raises(FileNotFoundError):
        find_trace_files(missing)


def test_a_truncated_ranks_file_is_counted_apart_in_the_run_facts(good):
    """One rank's trace cut mid-events (its head still names rank 1 and a world of 2): the run facts count the
    file read and the unreadable one apart, and speak for rank 0 only; the header said "2 trace files" and its
    JSON "trace_ranks": [0, 1] over rank 0's figures alone (a new-user trial)."""
    from fsdp_doctor.pipeline import build_report
    from fsdp_doctor.present.fmt import run_facts
    from fsdp_doctor.store import load_run

    def torch_layout(rank):  # torch writes distributedInfo before the events
        d = gpu_known_trace(rank=rank).document()
        return json.dumps({"distributedInfo": d.pop("distributedInfo"), **d})

    (good / "rank0.1.pt.trace.json.gz").unlink()
    (good / "rank0.1.pt.trace.json").write_text(torch_layout(0))
    text = torch_layout(1)
    (good / "rank1.1.pt.trace.json").write_text(text[: int(len(text) * 0.8)])
    report = build_report(load_run(good))
    f = report.run
    assert (f.trace_files, f.trace_files_unread, f.trace_ranks) == (1, 1, [0])
    assert [p.split(":")[0] for p in report.problems] == ["rank1.1.pt.trace.json"]
    facts = run_facts(f)
    assert "1 trace file" in facts and "1 unreadable (listed at the end)" in facts and "traces of rank 0" in facts
