"""Traces decoded in batches (reader.StreamedTrace, for files past STREAM_MIN_BYTES) give the same windows as
decoded whole, whatever the cuts; a bad streamed file is one line, like a whole one."""

import gzip
import json

import pytest

from fsdp_doctor.trace import analyze_traces, build_window, reader
from fsdp_doctor.trace.reader import StreamedTrace, TraceError
from trace_fixtures import fsdp_gpu_trace, gloo_known_trace, gpu_known_trace

SAMPLE = __import__("pathlib").Path(__file__).resolve().parent.parent / "traces" / "sample" / "profiler"


@pytest.fixture
def tiny_batches(monkeypatch):
    """Every file streamed, in batches of a few events, read a few hundred bytes at a time."""
    def apply():
        monkeypatch.setattr(reader, "STREAM_MIN_BYTES", 0)
        monkeypatch.setattr(reader, "BATCH_BYTES", 1500)
        monkeypatch.setattr(reader, "READ_BYTES", 333)
    return apply


def _hostile_names(doc):
    """Event names holding what the batch cutter looks for: '},', ']' and quotes."""
    for i, e in enumerate(doc["traceEvents"]):
        if e.get("cat") == "cpu_op" and i % 3 == 0:
            e["name"] = 'aten::x }, {"ph": "X"} ] \\" },\n{' + e["name"]
    return doc


CASES = {
    "gpu": lambda p: gpu_known_trace(rank=0).write(p / "rank0.json"),
    "gpu-gz": lambda p: gpu_known_trace(rank=1).write(p / "rank1.json.gz"),
    "gpu-ns": lambda p: gpu_known_trace(rank=0).write(p / "rank0.json", ns=True),
    "gloo": lambda p: gloo_known_trace(rank=0).write(p / "rank0.json"),
    "fsdp-gpu": lambda p: fsdp_gpu_trace(units=4, steps=3, bwd_us=50, rs_us=30).write(p / "rank0.json"),
    "hostile-names": lambda p: _write(p / "rank0.json", _hostile_names(gpu_known_trace(rank=0).document())),
    "indented": lambda p: _write(p / "rank0.json", gpu_known_trace(rank=0).document(), indent=2),
    "meta-after-events": lambda p: _write(p / "rank0.json", _meta_last(gloo_known_trace(rank=0).document())),
}


def _write(path, doc, indent=None):
    path.write_text(json.dumps(doc, indent=indent))
    return path


def _meta_last(doc):
    events = doc.pop("traceEvents")
    return {"traceEvents": events, **doc}


@pytest.mark.parametrize("name", sorted(CASES))
def test_streamed_equals_whole(name, tmp_path, tiny_batches):
    f = CASES[name](tmp_path)
    whole = build_window(f)
    tiny_batches()
    trace = reader.decode(f)
    assert isinstance(trace, StreamedTrace)
    assert sum(len(b) for b in trace.batches()) > 10
    streamed = build_window(f)
    assert repr(streamed) == repr(whole)


def test_streamed_sample_run_traces(tiny_batches, monkeypatch):
    whole = analyze_traces(SAMPLE, workers=1)
    tiny_batches()
    monkeypatch.setattr(reader, "BATCH_BYTES", 200_000)
    monkeypatch.setattr(reader, "READ_BYTES", 65_536)
    assert analyze_traces(SAMPLE, workers=1) == whole


@pytest.mark.parametrize("content, message", [
    (b'{"traceEvents": [{"ph": "X", "name": "a", "ts": 1, "dur": 2}, {"ph": "X", "na', "invalid JSON"),
    (b'{"traceEvents": [{"ph": "X", "name": "a", "ts": 1, "dur": 2}]', "invalid JSON"),
    (b'{"traceEvents": [1, 2, 3]}', "not a Kineto trace"),
    (b'{"traceEvents": []}', "is empty"),
    (b'{"a": 1}', "no traceEvents"),
    (b"", "empty file"),
    (b'{"x": [}, "traceEvents": []}', "not a Kineto trace"),
])
def test_streamed_bad_files_are_one_line(content, message, tmp_path, tiny_batches):
    f = tmp_path / "t.json"
    f.write_bytes(content)
    tiny_batches()
    with pytest.raises(TraceError) as e:
        build_window(f)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_streamed_gzip_members_truncation_and_bomb(tmp_path, tiny_batches, monkeypatch):
    doc = json.dumps(gpu_known_trace(rank=0).document()).encode()
    two = tmp_path / "two.json.gz"
    two.write_bytes(gzip.compress(doc[:700]) + gzip.compress(doc[700:]))
    whole = build_window(two)
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(gzip.compress(doc)[:-30])
    bomb = tmp_path / "bomb.json.gz"
    bomb.write_bytes(gzip.compress(b'{"traceEvents": [' + b" " * (4 << 20) + b"]}"))
    tiny_batches()
    monkeypatch.setattr(reader, "GZIP_MIN_CAP", 1 << 20)
    assert repr(build_window(two)) == repr(whole)
    with pytest.raises(TraceError, match="truncated gzip stream"):
        build_window(cut)
    monkeypatch.setattr(reader, "BATCH_BYTES", 1 << 20)
    with pytest.raises(TraceError, match="decompression bomb"):
        build_window(bomb)


@pytest.mark.parametrize("name", sorted(CASES))
def test_compare_reads_streamed_traces_as_whole_ones(name, tmp_path, tiny_batches):
    """``fsdp-doctor compare``'s step samples and per-phase kernel and operator times (trace/ops.py) are the same
    from a streamed file: they read no step at all before (a with_stack trace past 64 MiB compared as
    "0 steps", while analyze read its 4)."""
    from fsdp_doctor.trace.ops import op_times

    f = CASES[name](tmp_path)
    whole = op_times([f])
    tiny_batches()
    assert isinstance(reader.decode(f), StreamedTrace)
    streamed = op_times([f])
    assert whole.steps_ms and all(whole.steps_ms.values()), whole
    assert streamed.steps_ms == whole.steps_ms and streamed.prefetched == whole.prefetched
    assert streamed.us_per_step == pytest.approx(whole.us_per_step) and whole.us_per_step
