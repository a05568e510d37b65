"""The trace engine's fast paths give exactly the plain paths' results: the tagged "ph" decoder (and its
fallback to the plain decoder), the lean args (record_shapes read by a second, full decode on CPU traces), and
the forked workers of the parallel loader."""

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

import fsdp_doctor.trace.loader as an
from fsdp_doctor.report_sections import SkippedFile
from fsdp_doctor.trace import analyze_traces, build_window, reader
from fsdp_doctor.trace import analyze_windows, load_windows
from trace_fixtures import gloo_known_trace, gpu_known_trace


def assert_same_window(a, b):
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, tuple) and x and isinstance(x[0], np.ndarray):
            assert all(np.array_equal(u, v) for u, v in zip(x, y)), f.name
        else:
            assert x == y, f.name


CASES = {
    "gpu_prefetch": lambda: gpu_known_trace(prefetch=True, extra_unit_events=True),
    "gpu_no_prefetch": lambda: gpu_known_trace(prefetch=False),
    "gloo": lambda: gloo_known_trace(),
}


@pytest.mark.parametrize("ns", [False, True], ids=["us", "ns"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_fast_decode_matches_full_decode(tmp_path, case, ns):
    p = CASES[case]().write(tmp_path / "rank0.json.gz", ns=ns)
    fast = reader.decode(p)
    full = reader.decode(p, full=True)
    kinds = {type(e) for e in fast.traceEvents}
    assert reader.XEvent in kinds and kinds - {reader.XEvent}  # complete events and marks
    assert {type(e) for e in full.traceEvents} == {reader.Event}
    assert_same_window(build_window(p, fast), build_window(p, full))
    assert_same_window(build_window(p), build_window(p, full))


def _edited(tmp_path, name, edit):
    b = gpu_known_trace()
    doc = b.document()
    edit(doc["traceEvents"])
    p = tmp_path / name
    p.write_text(json.dumps(doc))
    return p


@pytest.mark.parametrize("edit", [
    # a duration on an event that is not "X": every timed event counts whatever its phase, as before
    lambda evs: next(e for e in evs if e.get("cat") == "kernel").update(ph="i"),
    lambda evs: next(e for e in evs if e.get("cat") == "kernel").pop("ph"),  # no phase at all
    lambda evs: next(e for e in evs if e.get("cat") == "kernel").update(ph="Z"),  # not a Trace Event Format phase
], ids=["instant_with_dur", "no_ph", "unknown_ph"])
def test_unusual_events_fall_back_to_the_plain_decoder(tmp_path, edit):
    plain = _edited(tmp_path, "rank0.plain.json", lambda evs: None)
    odd = _edited(tmp_path, "rank0.odd.json", edit)
    t = reader.decode(odd)
    assert {type(e) for e in t.traceEvents} == {reader.Event}  # the fast decode was refused
    w_odd, w_plain = build_window(odd), build_window(plain)
    w_odd.file = w_plain.file
    assert_same_window(w_odd, w_plain)


def test_flow_events_are_marks(tmp_path):
    p = _edited(tmp_path, "rank0.json", lambda evs: evs.extend([
        {"ph": "s", "id": 1, "pid": 100, "tid": 100, "ts": 1.0, "cat": "ac2g", "name": "ac2g"},
        {"ph": "f", "id": 1, "pid": 0, "tid": 7, "ts": 2.0, "cat": "ac2g", "name": "ac2g", "bp": "e"},
        {"ph": "f", "id": 2, "pid": 0, "tid": 7, "ts": 3.0, "dur": None}]))
    marks = [e for e in reader.decode(p).traceEvents if not isinstance(e, reader.XEvent)]
    assert [(e.ts, e.dur) for e in marks[-3:]] == [(1.0, None), (2.0, None), (3.0, None)]


def _parallel(paths, **kw):
    old = an.PARALLEL_MIN_BYTES
    an.PARALLEL_MIN_BYTES = 0
    try:
        return load_windows(paths, workers=2, **kw)
    finally:
        an.PARALLEL_MIN_BYTES = old


def test_parallel_errors_match_serial(tmp_path):
    paths = [gpu_known_trace(rank=k).write(tmp_path / f"rank{k}.json.gz") for k in range(2)]
    paths.append(tmp_path / "rank2.json.gz")
    paths[-1].write_bytes(b"\x1f\x8b\x08\x00garbage-not-deflate")
    paths.append(tmp_path / "rank3.json")
    paths[-1].write_text('{"traceEvents": [ {"ph": "X", ] }')
    paths.append(tmp_path / "rank4.json")
    paths[-1].write_text('{"a": 1}')
    seen = []
    par, par_skipped = _parallel(paths, progress=lambda d, t: seen.append((d, t)))
    ser, ser_skipped = load_windows(paths, workers=1)
    assert par_skipped == ser_skipped and len(par_skipped) == 3
    assert analyze_windows(par) == analyze_windows(ser)
    assert seen[0] == (0, 5) and seen[-1] == (5, 5) and len(seen) == 6


@pytest.mark.skipif(not an._CAN_FORK, reason="no fork on this platform")
def test_parallel_worker_that_dies_is_one_skipped_file(tmp_path, monkeypatch):
    import os

    paths = [gpu_known_trace(rank=k, world_size=3).write(tmp_path / f"rank{k}.json") for k in range(3)]
    real = an.build_window

    def dies_on_rank1(path, trace=None):
        if "rank1" in str(path):
            os._exit(3)  # (runs in the forked child)
        return real(path, trace)

    monkeypatch.setattr(an, "build_window", dies_on_rank1)
    windows, skipped = _parallel(paths)
    assert [w.rank for w in windows] == [0, 2]
    assert skipped == [SkippedFile(file="rank1.json", error="cannot analyze (the worker process died)")]


def test_import_does_not_pull_torch():
    code = "import sys, fsdp_doctor.trace; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_analyze_traces_parallel_equals_serial_on_mixed_set(tmp_path):
    gpu_known_trace(rank=0).write(tmp_path / "rank0.json.gz")
    gpu_known_trace(rank=1, prefetch=False).write(tmp_path / "rank1.json", ns=True)
    gloo_known_trace(rank=2).write(tmp_path / "rank2.json.gz")
    old = an.PARALLEL_MIN_BYTES
    an.PARALLEL_MIN_BYTES = 0
    try:
        par = analyze_traces(tmp_path, workers=2)
    finally:
        an.PARALLEL_MIN_BYTES = old
    assert par == analyze_traces(tmp_path, workers=1)
    assert par.per_unit and par.skipped == []


def test_gunzip_matches_gzip_module():
    import gzip

    doc = json.dumps(gpu_known_trace().document()).encode()
    ok = [gzip.compress(doc), gzip.compress(doc[:100]) + gzip.compress(doc[100:]),  # two members
          gzip.compress(doc) + b"\0\0\0", gzip.compress(b"")]
    for data in ok:
        assert reader._gunzip(data) == gzip.decompress(data)
    full = gzip.compress(doc)
    bad = [full[: len(full) // 2], b"\x1f\x8b\x08\x00garbage-not-deflate" + bytes(20), full + b"junk-after-it",
           full[:-4] + b"\xff\xff\xff\x7f"]  # truncated, corrupt, trailing junk, absurd ISIZE
    for data in bad:
        with pytest.raises(Exception) as ours:
            reader._gunzip(data)
        with pytest.raises(Exception) as theirs:
            gzip.decompress(data)
        assert (type(ours.value), str(ours.value)) == (type(theirs.value), str(theirs.value))
