"""A corpus of hostile inputs to ``fsdp-doctor analyze``, each with the answer it must get.

Every case builds its input under a fresh folder (corrupt, truncated, foreign or hostile JSON, impossible values,
duplicated ranks, mixed runs and jobs, FIFOs, symlink loops, small gzip bombs, wrong versions, ...) and says:

* ``error``: nothing usable: exit 2, exactly one line on stderr (``fsdp-doctor: ...``) that contains ``needle``
  (the file or the problem), nothing on stdout;
* ``partial``: a report of what could be read: exit 3, and one of the report's ``problems`` contains ``needle``;
* ``ok``: a sane report: exit 0.

``run_case`` runs ``analyze`` in this process (with ``--json`` to read the problems back) under an alarm, so
that a hang is a failure, not a stuck suite; an exception escaping ``main`` is a traceback. Run as a script,
it prints one line per case: ``python tests/bad_inputs.py``.
"""

from __future__ import annotations

import contextlib
import copy
import gzip
import io
import json
import os
import shutil
import signal
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from trace_fixtures import fsdp_gpu_trace, gloo_known_trace, gpu_known_trace  # noqa: E402

SAMPLE = HERE.parent / "traces" / "sample"
TIMEOUT_S = 20


@dataclass
class Case:
    name: str
    build: Callable[[Path], object]  # -> the path to analyse, or (path, extra CLI args)
    expect: str  # "error" | "partial" | "ok"
    needle: str = ""  # must appear in the error line / one of the problems (case-insensitive)
    check: Optional[Callable[[dict], None]] = None  # on the JSON report: figures still true


@dataclass
class Outcome:
    rc: Optional[int]
    stdout: str
    stderr: str
    report: Optional[dict]
    traceback: str = ""
    hung: bool = False


# ------------------------------------------------------------------------------------------ building blocks
def gpu_doc(rank=0, **kw) -> dict:
    return gpu_known_trace(rank=rank, **kw).document()


def write_json(path: Path, doc, gz=False) -> Path:
    data = json.dumps(doc).encode() if not isinstance(doc, (bytes, str)) else (
        doc.encode() if isinstance(doc, str) else doc)
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def two_ranks(d: Path) -> Path:
    """A healthy folder of plain traces: two GPU ranks."""
    for r in (0, 1):
        write_json(d / f"rank{r}.1.pt.trace.json", gpu_doc(r))
    return d


def one_file(d: Path, content, name="trace.json", gz=False) -> Path:
    return write_json(d / name, content, gz=gz)


def sample_run(d: Path, traces=True) -> Path:
    """A copy of the recorded sample run (records and, with ``traces``, its two profiler windows)."""
    run = d / "run"
    shutil.copytree(SAMPLE, run, ignore=shutil.ignore_patterns("tb", "report.json", *([] if traces else ["profiler"])))
    return run


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def write_lines(path: Path, recs: list) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in recs))


def edit_stream(run: Path, rank: int, fn) -> Path:
    p = run / f"rank{rank}.records.jsonl"
    write_lines(p, fn(lines(p)))
    return run


def edit_manifest(run: Path, **kv) -> Path:
    p = run / "manifest.json"
    m = json.loads(p.read_text())
    m.update(kv)
    p.write_text(json.dumps(m))
    return run


def with_event(doc: dict, **fields) -> dict:
    doc = copy.deepcopy(doc)
    ev = {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 100, "tid": 100, "ts": 1_000_000_000_100.0,
          "dur": 10.0}
    ev.update(fields)
    doc["traceEvents"].append(ev)
    return doc


def base_ts(doc: dict) -> float:
    return min(e["ts"] for e in doc["traceEvents"] if "ts" in e and e.get("cat") != "Trace")


def add(d: Path, fn) -> Path:
    """The healthy two-rank folder plus whatever ``fn(d)`` adds."""
    two_ranks(d)
    fn(d)
    return d


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def symlink(path: Path, target) -> Path:
    os.symlink(target, path)
    return path


def steps_of(report: dict, rank="0") -> list:
    return report["overlap"]["per_rank"][rank]["steps"]


def same_overlap_as_two_ranks(report: dict) -> None:
    """The two healthy ranks' figures, unchanged by what was added (never summed with it)."""
    ref = _reference()
    got = report["overlap"]["per_rank"]
    assert sorted(got) == ["0", "1"], sorted(got)
    for r in ("0", "1"):
        for k in ("comm_us", "exposed_us", "overlap_us"):
            assert abs(got[r][k] - ref[r][k]) < 1e-6, (r, k, got[r][k], ref[r][k])


_REF: dict = {}


def _reference() -> dict:
    if not _REF:
        from fsdp_doctor.trace import analyze_traces

        with tempfile.TemporaryDirectory() as t:
            res = analyze_traces(two_ranks(Path(t)))
        _REF.update({r: {"comm_us": v.comm_us, "exposed_us": v.exposed_us, "overlap_us": v.overlap_us}
                     for r, v in res.per_rank.items()})
    return _REF


def sample_steps(report: dict) -> None:
    """The sample run's step statistics, unchanged: 30 steps per rank, none counted twice."""
    ref = _sample_reference()
    assert report["steps"] is not None
    got = json.dumps(report["steps"], sort_keys=True)
    assert got == ref, "step statistics changed"


_SAMPLE_REF: list = []


def _sample_reference() -> str:
    if not _SAMPLE_REF:
        from fsdp_doctor.pipeline import build_report
        from fsdp_doctor.store import load_run

        rep = build_report(load_run(SAMPLE), traces=False, diagnosis=False)
        _SAMPLE_REF.append(json.dumps(rep.to_builtins()["steps"], sort_keys=True))
    return _SAMPLE_REF[0]


GOOD = gpu_doc(0)


# ------------------------------------------------------------------------------------------ the cases
def _trace_file_cases() -> list[Case]:
    """One file given as the path: it is the whole input, so a bad one is an error naming it."""
    t = []

    def E(name, content, needle="", gz=False, fname="trace.json"):
        t.append(Case(f"file/{name}", lambda d, c=content, g=gz, f=fname: one_file(d, c, name=f, gz=g), "error",
                      needle))

    E("empty", b"", "empty file")
    E("whitespace", b"   \n\t  ", "empty file")
    E("object-without-events", {}, "no traceEvents")
    E("foreign-object", {"a": 1, "b": [1, 2]}, "no traceEvents")
    E("top-level-list", [1, 2, 3], "top level is not an object")
    E("top-level-null", b"null", "not a Kineto trace")
    E("top-level-string", b'"hello"', "not a Kineto trace")
    E("top-level-number", b"42", "not a Kineto trace")
    E("events-empty", {"traceEvents": []}, '"traceEvents" is empty')
    E("events-null", {"traceEvents": None}, "no traceEvents")
    E("events-object", {"traceEvents": {}}, "not a Kineto trace")
    E("events-numbers", {"traceEvents": [1, 2, 3]}, "not a Kineto trace")
    E("events-strings", {"traceEvents": ["x", "y"]}, "not a Kineto trace")
    E("event-ts-string", with_event(GOOD, ts="soon"), "not a Kineto trace")
    E("event-dur-string", with_event(GOOD, dur="long"), "not a Kineto trace")
    E("event-name-number", with_event(GOOD, name=12), "not a Kineto trace")
    E("truncated-half", json.dumps(GOOD)[: len(json.dumps(GOOD)) // 2], "invalid JSON")
    E("truncated-one-byte", b"{", "invalid JSON")
    E("invalid-utf8", b'{"traceEvents": [{"name": "\xff\xfe"}]}', "invalid")
    E("binary-garbage", bytes(range(256)) * 4, "invalid JSON")
    E("utf16", json.dumps(GOOD).encode("utf-16"), "invalid JSON")
    E("text", b"hello, world\n", "invalid JSON")
    E("html", b"<html><body>not a trace</body></html>", "invalid JSON")
    E("gzip-garbage", b"\x1f\x8b\x08\x00garbage-not-deflate" + bytes(20), "gzip", fname="trace.json.gz")
    E("gzip-truncated", gzip.compress(json.dumps(GOOD).encode())[:300], "truncated gzip", fname="trace.json.gz")
    E("gzip-of-nothing", gzip.compress(b""), "empty file", fname="trace.json.gz")
    E("gzip-of-garbage-json", gzip.compress(b"{{{{"), "invalid JSON", fname="trace.json.gz")
    E("plain-json-named-gz", json.dumps(GOOD).encode(), "gzip", fname="trace.json.gz")
    E("negative-duration", with_event(GOOD, dur=-5.0), "negative")
    E("duration-1e300", with_event(GOOD, dur=1e300), "implausible duration")
    E("duration-two-days", with_event(GOOD, dur=2 * 86_400e6), "implausible duration")
    E("duration-infinite", json.dumps(with_event(GOOD, dur=1.0)).replace('"dur": 1.0}', '"dur": 1e999}'),
      "out of range")
    E("timestamp-1e300", with_event(GOOD, ts=1e300), "implausible timestamp")
    E("timestamp-minus-1e300", with_event(GOOD, ts=-1e300), "implausible timestamp")
    E("rank-negative", {**GOOD, "distributedInfo": {"rank": -1, "world_size": 2}}, "not a rank")
    E("world-size-zero", {**GOOD, "distributedInfo": {"rank": 0, "world_size": 0}}, "not a rank")
    E("world-size-negative", {**GOOD, "distributedInfo": {"rank": 0, "world_size": -5}}, "not a rank")
    E("distributed-info-string", {**GOOD, "distributedInfo": "rank0"}, "not a Kineto trace")
    E("rank-string", {**GOOD, "distributedInfo": {"rank": "zero"}}, "not a Kineto trace")
    E("huge-integer-ts", json.dumps(with_event(GOOD, ts=1)).replace('"ts": 1,', '"ts": ' + "9" * 400 + ","),
      "trace")
    E("deep-nesting", '{"traceEvents": [{"name": "x", "args": ' + "[" * 100_000 + "]" * 100_000 + "}]}", "")
    E("no-complete-events", {"traceEvents": [{"ph": "i", "name": "x", "ts": 1, "pid": 1, "tid": 1}]},
      "nothing to analyse")
    E("events-without-ts", {"traceEvents": [{"ph": "X", "name": "ProfilerStep#1", "cat": "user_annotation",
                                             "dur": 5, "pid": 1, "tid": 1}]}, "nothing to analyse")
    t.append(Case("file/fifo", lambda d: fifo(d / "trace.json"), "error", "not a regular file"))
    t.append(Case("file/dangling-symlink", lambda d: symlink(d / "trace.json", d / "gone.json"), "error",
                  "dangling symlink"))
    t.append(Case("file/symlink-loop", lambda d: (symlink(d / "a.json", d / "b.json"), symlink(d / "b.json",
                                                                                              d / "a.json"))[0],
                  "error", "a.json"))
    t.append(Case("path/missing", lambda d: d / "nothing-here", "error", "no such file"))
    t.append(Case("path/empty-folder", lambda d: (d / "empty").mkdir() or d / "empty", "error",
                  "no fsdp-doctor records and no Kineto traces"))
    t.append(Case("path/folder-of-text", lambda d: (d / "notes.txt").write_text("hi") and d, "error",
                  "no fsdp-doctor records and no Kineto traces"))
    # a run that stopped in step 0 (an error in its first forward): each rank's stream began, nothing after it
    header = ('{"t":"header","world_size":2,"pid":1,"host":"vm","started_ns":1,"doctor_version":"0.1.0",'
              '"run_id":"9c96528e1799","rank":%d}\n')
    t.append(Case("path/records-header-only",
                  lambda d: [one_file(d, (header % r).encode(), f"rank{r}.records.jsonl") for r in (0, 1)] and d,
                  "error", "hold a header and no step yet: the run is still in its first step (analyze it again "
                  "later), or stopped before its first doctor.step()"))
    # a run whose loop never called doctor.step(): watch() exited normally with 0 steps (a new-user trial read
    # "the run stopped before its first doctor.step()" of a run that had trained 10 optimizer steps)
    end = '{"t":"end","steps":0,"ended_ns":2,"rank":%d}\n'
    t.append(Case("path/records-never-stepped",
                  lambda d: [one_file(d, (header % r + end % r).encode(), f"rank{r}.records.jsonl")
                             for r in (0, 1)] and d,
                  "error", "watch() ended normally on ranks 0, 1 without a doctor.step() call"))
    # a loop that raised in step 0 (a dtype error in its first forward): the end record holds the exception; the run
    # read "still in its first step (analyze it again later)" (a new-user trial)
    failed = '{"t":"end","steps":0,"ended_ns":2,"exception":"RuntimeError: expected scalar type BFloat16","rank":%d}\n'
    t.append(Case("path/records-failed-in-step-0",
                  lambda d: [one_file(d, (header % r + failed % r).encode(), f"rank{r}.records.jsonl")
                             for r in (0, 1)] and d,
                  "error", "the training loop raised an exception on ranks 0, 1 before its first doctor.step(), so "
                  "no step was recorded: RuntimeError: expected scalar type BFloat16"))
    # torch 2.6's FSDP2 on the CPU without the back-ports: the line says how to get it going (a new-user trial read
    # only the AttributeError)
    stream = ('{"t":"end","steps":0,"ended_ns":2,"exception":"AttributeError: \'Stream\' object has no attribute '
              '\'record_event\'","rank":%d}\n')
    t.append(Case("path/records-torch-2.6-cpu-stream",
                  lambda d: [one_file(d, (header % r + stream % r).encode(), f"rank{r}.records.jsonl")
                             for r in (0, 1)] and d,
                  "error", "no attribute 'record_event' (torch 2.6's FSDP2 cannot train on the CPU (torch.cpu.Stream "
                  "has no record_event; torch 2.7 added it): call fsdp_doctor.record.fsdp2.enable_cpu_fsdp() before "
                  "training"))
    t.append(Case("path/all-files-unreadable", lambda d: (one_file(d, b"", "a.json"), one_file(d, b"{", "b.json"))
                  and d, "error", "nothing to analyse"))
    t.append(Case("path/two-files-without-rank",
                  lambda d: (one_file(d, gpu_known_trace(rank=None).document(), "a.json"),
                             one_file(d, gpu_known_trace(rank=None).document(), "b.json")) and d,
                  "error", "no rank"))
    return t


def _trace_folder_cases() -> list[Case]:
    """Two healthy ranks plus something bad: the bad file is named, the healthy ranks' figures unchanged."""
    t = []

    def P(name, fn, needle, check=same_overlap_as_two_ranks):
        t.append(Case(f"folder/{name}", lambda d, f=fn: add(d, f), "partial", needle, check))

    def shifted(doc, seconds):
        doc = copy.deepcopy(doc)
        doc["baseTimeNanoseconds"] += int(seconds * 1e9)
        return doc

    P("corrupt-third-rank", lambda d: one_file(d, b"{not json", "rank2.1.pt.trace.json"), "rank2.1.pt.trace.json")
    P("empty-events-third", lambda d: one_file(d, {"traceEvents": []}, "rank2.json"), "rank2.json")
    P("empty-file-third", lambda d: one_file(d, b"", "rank2.json"), "rank2.json")
    P("truncated-gzip-third", lambda d: one_file(d, gzip.compress(json.dumps(gpu_doc(2)).encode())[:200],
                                                 "rank2.json.gz"), "truncated gzip")
    P("foreign-json", lambda d: one_file(d, {"name": "package", "version": "1.0"}, "package.json"), "package.json")
    P("dangling-symlink", lambda d: symlink(d / "rank2.json", d / "missing.json"), "dangling symlink")
    P("symlink-loop-file", lambda d: (symlink(d / "rank2.json", d / "rank3.json"),
                                      symlink(d / "rank3.json", d / "rank2.json")), "symlink loop")
    P("symlink-loop-folder", lambda d: (d / "sub").mkdir() or symlink(d / "sub" / "loop", d), "not read again")
    P("fifo-trace", lambda d: fifo(d / "rank2.json"), "not a regular file (a FIFO)")
    P("fifo-gz-trace", lambda d: fifo(d / "rank2.pt.trace.json.gz"), "not a regular file (a FIFO)")
    P("socket-named-trace", lambda d: _socket(d / "rank2.json"), "not a regular file")
    P("duplicate-rank-copy", lambda d: shutil.copy(d / "rank0.1.pt.trace.json", d / "rank0.copy.json"),
      "rank 0 again")
    P("duplicate-rank-other-name", lambda d: one_file(d, gpu_doc(1), "worker-b.json"), "rank 1 again")
    P("duplicate-rank-gz", lambda d: one_file(d, gpu_doc(0), "rank0.2.pt.trace.json.gz", gz=True), "rank 0 again")
    P("no-rank-among-several", lambda d: one_file(d, gpu_known_trace(rank=None).document(), "worker.json"),
      "no rank")
    P("another-job-world-size", lambda d: one_file(d, gpu_known_trace(rank=2, world_size=8).document(),
                                                   "job2-rank2.json"), "another job (world size 8")
    P("another-job-backend", lambda d: one_file(d, {**gpu_doc(2), "distributedInfo": {
        "rank": 2, "world_size": 2, "backend": "gloo"}}, "rank2.json"), "another job (backend gloo")
    P("another-job-other-units", lambda d: one_file(d, fsdp_gpu_trace(units=1, rank=2, world_size=2).document(),
                                                    "rank2.json"),
      "rank2.json: another job (its step 1's FSDP units: 1, named layers.0; the other files': 2, named layers.0, "
      "layers.1); skipped")
    # profiled into the same folder again (tensorboard_trace_handler adds files): the rerun's two files are kept, the
    # first run's named (a new-user trial's rerun with a fix was skipped as "rank 0 again", the first run analysed)
    P("rerun-into-the-folder", lambda d: [one_file(d, shifted(gpu_doc(r), 30), f"rank{r}.2.pt.trace.json")
                                          for r in (0, 1)],
      "rank0.1.pt.trace.json: another run (its step 1 ran 30 s before the step 1 of the 2 files kept: profiled into "
      "the same folder again?); skipped")
    # one rank's file of a later run beside both of the first: the first run's own rank 1 kept, not the later one's
    P("one-rank-of-a-later-run", lambda d: one_file(d, shifted(gpu_doc(1), 98), "rank1.later.json"),
      "rank1.later.json: another run (its step 1 ran 98 s after the step 1 of the 2 files kept")
    P("another-job-hours-later", lambda d: one_file(d, shifted(gpu_doc(2, world_size=2), 3 * 3600),
                                                    "rank2.json"), "another job (its step")
    P("negative-duration-third", lambda d: one_file(d, with_event(gpu_doc(2), dur=-3.0), "rank2.json"),
      "negative")
    P("absurd-duration-third", lambda d: one_file(d, with_event(gpu_doc(2), dur=1e300), "rank2.json"),
      "implausible duration")
    P("absurd-ts-third", lambda d: one_file(d, with_event(gpu_doc(2), ts=1e300), "rank2.json"),
      "implausible timestamp")
    P("gzip-bomb", lambda d: one_file(d, _bomb(), "rank2.json.gz"), "decompression bomb")
    P("escape-in-file-name", lambda d: one_file(d, b"{", "rank2\x1b]0;pwned\x07.json"), "pwned")
    P("subfolder-bad", lambda d: (d / "more").mkdir() or one_file(d / "more", b"[1]", "rank5.json"),
      "more/rank5.json")
    t.append(Case("folder/report-and-jsonl-ignored", lambda d: add(d, lambda d: (
        one_file(d, {"schema": "x"}, "report.json"), (d / "x.jsonl").write_text("{}\n"))), "ok", "",
        same_overlap_as_two_ranks))
    t.append(Case("folder/gzip-named-json", lambda d: (one_file(d, gpu_doc(0), "rank0.json", gz=True),
                                                       one_file(d, gpu_doc(1), "rank1.json")) and d, "ok", "",
                  same_overlap_as_two_ranks))
    t.append(Case("folder/ns-timestamps", lambda d: (gpu_known_trace(rank=0).write(d / "rank0.json", ns=True),
                                                     gpu_known_trace(rank=1).write(d / "rank1.json", ns=True))
                  and d, "ok", "", same_overlap_as_two_ranks))
    t.append(Case("folder/rank-from-name-only", lambda d: (
        one_file(d, gpu_known_trace(rank=None).document(), "rank0.json"),
        one_file(d, gpu_known_trace(rank=None).document(), "rank1.json")) and d, "ok", ""))
    t.append(Case("folder/gloo-two-ranks", lambda d: [gloo_known_trace(rank=r).write(d / f"rank{r}.json")
                                                      for r in (0, 1)] and d, "ok", ""))
    t.append(Case("folder/escape-in-label", lambda d: one_file(d, _escaped_label(), "rank0.json") and d, "ok", ""))
    t.append(Case("folder/long-name", lambda d: one_file(d, with_event(gpu_doc(0), name="x" * 1_000_000),
                                                         "rank0.json") and d, "ok", ""))
    return t


def _socket(path: Path) -> Path:
    import socket

    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()
    return path


def _bomb() -> bytes:
    """A small gzip (~300 KiB) of 100 MiB of one event repeated: far past 200x its size."""
    ev = b'{"ph": "X", "cat": "cpu_op", "name": "a", "pid": 1, "tid": 1, "ts": 1, "dur": 1},'
    return gzip.compress(b'{"traceEvents": [' + ev * ((100 << 20) // len(ev)) + b"{}]}", 9)


def _escaped_label() -> dict:
    doc = gpu_doc(0)
    for e in doc["traceEvents"]:
        if isinstance(e.get("name"), str) and e["name"].startswith("FSDP::") and "(" in e["name"]:
            e["name"] = e["name"].replace("(", "(\x1b]0;pwned\x07\x1b[2J", 1)
    return doc


def _record_cases() -> list[Case]:
    t = []

    def C(name, fn, expect, needle="", check=None, traces=False):
        t.append(Case(f"run/{name}", lambda d, f=fn, tr=traces: f(sample_run(d, traces=tr)), expect, needle, check))

    def drop_steps(recs, keep):
        return [r for r in recs if r.get("t") != "step" or keep(r["step"])]

    def set_first(recs, tag, **kv):
        for r in recs:
            if r.get("t") == tag:
                r.update(kv)
                break
        return recs

    def rank0_only(report: dict) -> None:
        assert report["run"]["ranks"] == [0] and list(report["steps"]["per_rank"]) == ["0"]
        assert report["steps"]["per_rank"]["0"]["count"] > 0

    # a rank's stream the manifest lists, deleted: named, the other rank analysed (its header said 2 ranks before,
    # and its profiler window was called another run's)
    C("stream-missing", lambda r: (r / "rank1.records.jsonl").unlink() or r, "partial",
      "rank1.records.jsonl: listed in manifest.json but missing: rank 1 is not analysed", rank0_only, traces=True)
    # plain torch.profiler traces made 4 min after the run (it ended) by another process, into its folder or its
    # profiler/ folder: read with the run's own window as one job, their step 2 beside its step 6, exit 0 (a
    # new-user trial); only traces older than the run were told apart
    C("traces-after-the-run", lambda r: _later_traces(r, r), "partial", "rank0.later.pt.trace.json: another run (it "
      "started 4 min after rank 0's records ended: profiled into the same folder after the run?); skipped",
      sample_steps, traces=True)
    C("traces-after-the-run-in-profiler", lambda r: _later_traces(r, r / "profiler", gz=True), "partial",
      "rank1.later.pt.trace.json.gz: another run (it started 4 min after rank 1's records ended", sample_steps,
      traces=True)
    # and made before the run: a process 26 s before a run that profiled nothing (PROF=0), its traces copied into
    # the run's folder, read as the run's own ("source: profiler trace, step 2", exit 0: a new-user trial)
    C("traces-before-the-run", lambda r: _later_traces(r, r, before=True), "partial", "rank0.later.pt.trace.json: "
      "another run (it ended 4 min before rank 0's records started: profiled into the same folder before the run?); "
      "skipped", sample_steps, traces=True)
    # one of the run's own files given instead of its folder: read as a trace, it was "invalid JSON (... trailing
    # characters)" and "not a Kineto trace" (a new-user trial)
    C("given-a-records-file", lambda r: r / "rank0.records.jsonl", "error",
      "rank0.records.jsonl: one rank's fsdp-doctor records, not a trace: give the run directory")
    C("given-the-manifest", lambda r: r / "manifest.json", "error",
      "manifest.json: a run's manifest, not a trace: give the run directory")
    # the manifest
    C("manifest-version-99", lambda r: edit_manifest(r, version=99), "error", "format version 99")
    C("manifest-version-0", lambda r: edit_manifest(r, version=0), "error", "format version 0")
    C("manifest-foreign-format", lambda r: edit_manifest(r, format="chrome-trace"), "error", "chrome-trace")
    C("manifest-version-string", lambda r: edit_manifest(r, version="one"), "partial", "not a valid fsdp-doctor manifest",
      sample_steps)
    C("manifest-world-size-0", lambda r: edit_manifest(r, world_size=0), "partial", "world size 0", sample_steps)
    C("manifest-world-size-negative", lambda r: edit_manifest(r, world_size=-5), "partial", "world size -5",
      sample_steps)
    C("manifest-world-size-1", lambda r: edit_manifest(r, world_size=1), "partial", "outside this run")
    C("manifest-truncated", lambda r: (r / "manifest.json").write_text('{"world_size": 2,') and r, "partial",
      "manifest.json: not valid JSON (Input data was truncated)", sample_steps)
    # cut short after a field of the wrong type: the JSON's break said, not the field's type ("Expected `str`, got
    # `int` - at `$.format`" told a new-user trial nothing of a manifest cut short)
    C("manifest-truncated-after-a-field", lambda r: (r / "manifest.json").write_text('{"format": 3') and r,
      "partial", "manifest.json: not valid JSON (Input data was truncated)", sample_steps)
    C("manifest-empty", lambda r: (r / "manifest.json").write_text("") or r, "partial", "manifest.json",
      sample_steps)
    C("manifest-list", lambda r: (r / "manifest.json").write_text("[]") and r, "partial", "manifest.json",
      sample_steps)
    C("manifest-fifo", lambda r: ((r / "manifest.json").unlink(), fifo(r / "manifest.json")) and r, "partial",
      "not a regular file (a FIFO)", sample_steps)
    C("manifest-dangling-symlink", lambda r: ((r / "manifest.json").unlink(),
                                              symlink(r / "manifest.json", r / "gone")) and r, "partial",
      "manifest.json", sample_steps)
    C("manifest-is-folder", lambda r: ((r / "manifest.json").unlink(), (r / "manifest.json").mkdir()) and r,
      "partial", "manifest.json", sample_steps)
    # the streams
    C("stream-fifo", lambda r: ((r / "rank1.records.jsonl").unlink(), fifo(r / "rank1.records.jsonl")) and r,
      "partial", "not a regular file (a FIFO)")
    C("stream-dangling-symlink", lambda r: ((r / "rank1.records.jsonl").unlink(),
                                            symlink(r / "rank1.records.jsonl", r / "gone")) and r, "partial",
      "rank1.records.jsonl")
    C("stream-is-folder", lambda r: ((r / "rank1.records.jsonl").unlink(), (r / "rank1.records.jsonl").mkdir())
      and r, "partial", "rank1.records.jsonl")
    C("stream-empty", lambda r: (r / "rank1.records.jsonl").write_text("") or r, "partial", "empty")
    C("stream-garbage-line", lambda r: edit_stream(r, 1, lambda x: x[:5] + ["{not json"] + x[5:]), "partial",
      "line 6")
    C("stream-array-line", lambda r: edit_stream(r, 1, lambda x: x[:5] + ["[1, 2]"] + x[5:]), "partial",
      "not a valid record")
    C("stream-unknown-tag", lambda r: edit_stream(r, 1, lambda x: x + [{"t": "zzz", "rank": 1}]), "partial",
      "not a valid record")
    # a stream of random bytes: one line for the file (not one per line of it), and the rank not analysed, never "did
    # not finish (run still going, or killed)" nor "stopped ... without an end record"
    C("stream-random-bytes", lambda r: random_bytes(r / "rank1.records.jsonl") and r, "partial",
      "rank1.records.jsonl: unreadable: no valid record in it", lambda rep: (
          rank0_only(rep), _one_line_for(rep, "rank1.records.jsonl")))
    C("stream-garbage-lines", lambda r: edit_stream(r, 1, lambda x: x[:5] + ["{not json"] * 3 + x[5:]), "partial",
      "rank1.records.jsonl: 3 lines are not valid records (lines 6, 7, 8;", lambda rep: _one_line_for(
          rep, "rank1.records.jsonl"))
    # (left a minute: rank 0's end record written, rank 1's stream, cut, is not being written)
    C("stream-cut-mid-line", lambda r: (r / "rank1.records.jsonl").write_bytes(
        (r / "rank1.records.jsonl").read_bytes()[:-40]) and _aged(r), "partial",
      "rank 1's records stop after step 29 in the middle of a record (")
    # a stream refused (a newer record version, another format): its rank not analysed, never said to be one that
    # "did not finish (run still going, or killed); its completed steps are used" (a new-user trial)
    C("stream-header-version-99", lambda r: edit_stream(r, 1, lambda x: set_first(x, "header", version=99)),
      "partial", "rank1.records.jsonl: record format version 99 is newer than this fsdp-doctor reads", _refused_rank1)
    C("stream-header-foreign-format", lambda r: edit_stream(r, 1, lambda x: set_first(x, "header", format="other")),
      "partial", "'other'", _refused_rank1)
    C("steps-duplicated", lambda r: edit_stream(r, 0, lambda x: x + [y for y in x if y.get("t") == "step"]),
      "partial", "repeated", sample_steps)
    C("steps-duplicated-both", lambda r: [edit_stream(r, k, lambda x: x + [y for y in x if y.get("t") == "step"])
                                          for k in (0, 1)] and r, "partial", "never counted twice", sample_steps)
    C("step-negative-wall", lambda r: edit_stream(r, 0, lambda x: x + [{**[y for y in x if y.get("t") == "step"][-1],
                                                                         "step": 999, "wall_ms": -50.0}]),
      "partial", "impossible times", sample_steps)
    C("step-absurd-wall", lambda r: edit_stream(r, 0, lambda x: x + [{**[y for y in x if y.get("t") == "step"][-1],
                                                                       "step": 999, "wall_ms": 1e300}]),
      "partial", "impossible times", sample_steps)
    C("step-negative-forward", lambda r: edit_stream(r, 1, lambda x: x + [
        {**[y for y in x if y.get("t") == "step"][-1], "step": 999, "forward_ms": -1.0}]), "partial",
      "forward_ms -1.0", sample_steps)
    C("config-world-size-0", lambda r: edit_stream(r, 0, lambda x: set_first(x, "config", world_size=0)), "partial",
      "world size 0")
    C("config-world-size-negative", lambda r: [edit_stream(r, k, lambda x: set_first(x, "config", world_size=-3))
                                               for k in (0, 1)] and r, "partial", "world size -3")
    C("stream-of-another-run", lambda r: [edit_manifest(r, run_id="aaaa"),
                                          edit_stream(r, 0, lambda x: set_first(x, "header", run_id="aaaa")),
                                          edit_stream(r, 1, lambda x: set_first(x, "header", run_id="bbbb"))] and r,
      "partial", "another run")
    C("no-manifest-two-runs", lambda r: [(r / "manifest.json").unlink(),
                                         edit_stream(r, 0, lambda x: set_first(x, "header", run_id="aaaa")),
                                         edit_stream(r, 1, lambda x: set_first(x, "header", run_id="bbbb"))] and r,
      "partial", "another run")
    C("rank-outside-world", lambda r: shutil.copy(r / "rank1.records.jsonl", r / "rank5.records.jsonl") and r,
      "partial", "outside this run")
    C("escape-in-unit-name", lambda r: edit_stream(r, 0, lambda x: [_escape_units(y) for y in x]), "ok", "",
      traces=True)
    C("no-manifest-is-fine", lambda r: (r / "manifest.json").unlink() or r, "ok", "", sample_steps, traces=True)
    # the profiler windows
    C("window-listed-but-missing", lambda r: (r / "profiler" / "rank1.6.pt.trace.json.gz").unlink() or r,
      "partial", "file is missing", traces=True)
    C("window-corrupt", lambda r: (r / "profiler" / "rank1.6.pt.trace.json.gz").write_bytes(b"\x1f\x8bxx") and r,
      "partial", "rank1.6.pt.trace.json.gz", traces=True)
    C("window-fifo", lambda r: ((r / "profiler" / "rank1.6.pt.trace.json.gz").unlink(),
                                fifo(r / "profiler" / "rank1.6.pt.trace.json.gz")) and r, "partial",
      "not a regular file", traces=True)
    C("window-empty-events", lambda r: write_json(r / "profiler" / "rank1.6.pt.trace.json.gz",
                                                  {"traceEvents": []}, gz=True) and r, "partial", "is empty",
      traces=True)
    C("window-unfinished", lambda r: [edit_stream(r, k, lambda x: [y for y in x if y.get("t") != "end" and not (
        y.get("t") == "step" and y["step"] >= 7)]) for k in (0, 1)] and r, "partial", "never completed step",
      traces=True)
    C("killed-rank-named", lambda r: [edit_stream(r, 0, lambda x: [y for y in x if y.get("t") != "end"]),
                                      edit_stream(r, 1, lambda x: [y for y in x if y.get("t") not in ("end",) and not (
                                          y.get("t") == "step" and y["step"] > 20)])] and r, "partial",
      "rank 1 stopped first")
    # both streams cut in the middle of a record, rank 1's earlier (a full disk: the doctor's writes failed, the ranks
    # trained on): a write cut short is no killed process, never "it died or hung" (a new-user trial's 40 KiB disk)
    C("records-cut-mid-write", lambda r: [_cut_mid_record(edit_stream(r, k, lambda x, k=k: [
        y for y in x if y.get("t") != "end" and not (y.get("t") == "step" and y["step"] > 20 - 3 * k)]), k)
        for k in (0, 1)] and r, "partial",
      "rank 1's records stop after step 17 in the middle of a record (16 bytes at the end of rank1.records.jsonl)",
      _cut_not_killed, traces=True)
    C("profiler-folder-dangling", lambda r: symlink(r / "profiler" / "old", r / "nowhere") and r, "ok", "",
      traces=True)
    C("profiler-trace-dangling-symlink", lambda r: symlink(r / "profiler" / "rank0.20.pt.trace.json.gz",
                                                           r / "nowhere") and r, "partial", "dangling symlink",
      traces=True)
    # outputs onto inputs
    t.append(Case("out/json-onto-trace", lambda d: (two_ranks(d), ["--json", str(d / "rank0.1.pt.trace.json")])[1:]
                  and (d, ["--json", str(d / "rank0.1.pt.trace.json")]), "error", "is one of the inputs"))
    t.append(Case("out/html-onto-the-trace-file", lambda d: (one_file(d, GOOD, "t.json"),
                                                             ["--html", str(d / "t.json")]), "error",
                  "is one of the inputs"))
    t.append(Case("out/json-onto-manifest", lambda d: (sample_run(d), ["--json", str(d / "run" / "manifest.json")]),
                  "error", "is one of the inputs"))
    t.append(Case("out/json-onto-stream", lambda d: (sample_run(d), ["--json", str(d / "run" / "rank0.records.jsonl")]),
                  "error", "is one of the inputs"))
    t.append(Case("out/json-into-missing-dir", lambda d: (two_ranks(d), ["--json", str(d / "no" / "r.json")]),
                  "error", "does not exist"))
    t.append(Case("out/json-onto-folder", lambda d: (two_ranks(d), ["--json", str(d)]), "error", "is a directory"))
    # checked before the work: /proc takes no file (root passes os.access there: the whole report was printed, then
    # "cannot write", exit 2), and a file where the folder should be read "directory afile does not exist" (a new-user
    # trial)
    t.append(Case("out/json-into-proc", lambda d: (two_ranks(d), ["--json", "/proc/x.json"]), "error",
                  "--json /proc/x.json: directory /proc is not writable ("))
    t.append(Case("out/html-under-a-file", lambda d: (two_ranks(d), (d / "afile").write_text("x"),
                                                      ["--html", str(d / "afile" / "x.html")])[::2], "error",
                  "afile is a file, not a directory"))
    return t


def _later_traces(run: Path, into: Path, gz: bool = False, before: bool = False) -> Path:
    """The run's own profiler windows (steps 6-7) made another run's: 4 min after the run ended, as steps 2-3
    (``before``: starting 4 min before its records started)."""
    end = max(x["ended_ns"] for r in (0, 1) for x in lines(run / f"rank{r}.records.jsonl") if x.get("t") == "end")
    if before:
        end = min(x["started_ns"] for r in (0, 1) for x in lines(run / f"rank{r}.records.jsonl")
                  if x.get("t") == "header") - 480 * 10**9
    for r in (0, 1):
        text = gzip.decompress((run / "profiler" / f"rank{r}.6.pt.trace.json.gz").read_bytes()).decode()
        text = text.replace('"ProfilerStep#6"', '"ProfilerStep#2"').replace('"ProfilerStep#7"', '"ProfilerStep#3"')
        doc = json.loads(text)
        first = min(e["ts"] for e in doc["traceEvents"] if e.get("name") == "ProfilerStep#2")
        doc["baseTimeNanoseconds"] += end + 240 * 10**9 - (doc["baseTimeNanoseconds"] + int(first * 1e3))
        write_json(into / f"rank{r}.later.pt.trace.json{'.gz' * gz}", doc, gz=gz)
    return run


def random_bytes(path: Path, n: int = 20_000, seed: int = 7) -> Path:
    """``n`` random bytes (a file overwritten by a disk error, or not records at all), the same ones every run."""
    import random

    path.write_bytes(random.Random(seed).randbytes(n))
    return path


def _escape_units(rec: dict) -> dict:
    if rec.get("t") == "config":
        for u in rec.get("units", []):
            u["name"] = u["name"] + "\x1b]0;pwned\x07\x1b[31m" if u["name"] else u["name"]
    return rec


def _aged(run: Path, s: float = 60.0) -> Path:
    """The run with its record streams last written ``s`` seconds ago."""
    import os
    import time

    for f in run.glob("rank*.records.jsonl"):
        os.utime(f, (time.time() - s,) * 2)
    return run


def _cut_mid_record(run: Path, rank: int) -> Path:
    """The rank's stream with the start of one more record after its last, as a write that failed leaves it."""
    with open(run / f"rank{rank}.records.jsonl", "ab") as f:
        f.write(b'{"t":"step","ste')
    return run


def _not_said(report: dict, words: str) -> None:
    assert not [p for p in report["problems"] if words in p], report["problems"]


def _cut_not_killed(report: dict) -> None:
    """Records that stop mid-record (a failed write: a full disk) are no killed rank, in the problems or the header
    (a new-user trial's header said "ranks 0, 1 did not finish (run still going, or killed)"): one line says it of
    both ranks, with their steps."""
    _not_said(report, "killed")
    assert report["run"]["records_cut"] == ["0", "1"], report["run"]
    said = [p for p in report["problems"] if "step" in p]
    assert said == ["rank 1's records stop after step 17 in the middle of a record (16 bytes at the end of "
                    "rank1.records.jsonl); rank 0's records stop after step 20 in the middle of a record (16 bytes at "
                    "the end of rank0.records.jsonl): a write of the doctor's failed there (a full disk?), the ranks may "
                    "have trained on; the completed steps of every rank are used"], said


def _refused_rank1(report: dict) -> None:
    """Rank 1's stream refused: rank 0 analysed alone, rank 1 named once, nowhere read as unfinished."""
    assert report["run"]["ranks"] == [0] and list(report["run"]["complete"]) == ["0"], report["run"]
    _one_line_for(report, "rank1.records.jsonl")


def _one_line_for(report: dict, name: str) -> None:
    said = [p for p in report["problems"] if p.startswith(f"{name}:")]
    assert len(said) == 1, said


# ------------------------------------------------------------------------------------------ permissions
# root reads every file whatever its mode: its commands run without those capabilities (util-linux's setpriv)
_SETPRIV = ["setpriv", "--inh-caps=-dac_override,-dac_read_search", "--bounding-set=-dac_override,-dac_read_search"]
_UNPRIVILEGED: list = []


def unprivileged() -> Optional[list[str]]:
    """The prefix of a command that file permissions bind: [] for a user they bind already, setpriv's for root;
    None where neither works (root without setpriv, or in a container that refuses it): permission tests skip."""
    if not _UNPRIVILEGED:
        _UNPRIVILEGED.append(_probe_unprivileged())
    return _UNPRIVILEGED[0]


def _probe_unprivileged() -> Optional[list[str]]:
    import subprocess

    prefix = [] if os.geteuid() != 0 else _SETPRIV
    if prefix and not shutil.which(prefix[0]):
        return None
    with tempfile.TemporaryDirectory() as t:
        f = Path(t) / "locked"
        f.write_text("x")
        f.chmod(0)
        try:
            r = subprocess.run([*prefix, "cat", str(f)], capture_output=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return prefix if r.returncode != 0 else None


def cases() -> list[Case]:
    return _trace_file_cases() + _trace_folder_cases() + _record_cases()


# ------------------------------------------------------------------------------------------ running one
class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang()


def run_case(case: Case, where: Path) -> Outcome:
    """Builds the case under ``where`` and runs ``fsdp-doctor analyze`` on it in this process."""
    from fsdp_doctor import cli

    where.mkdir(parents=True, exist_ok=True)
    built = case.build(where)
    path, extra = built if isinstance(built, tuple) else (built, [])
    out_json = where.parent / f"{where.name}.report.json"
    args = ["analyze", str(path), *extra]
    if "--json" not in extra:
        args += ["--json", str(out_json)]
    so, se = io.StringIO(), io.StringIO()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(TIMEOUT_S)
    rc, tb, hung = None, "", False
    try:
        with contextlib.redirect_stdout(so), contextlib.redirect_stderr(se):
            rc = cli.main(args)
    except _Hang:
        hung = True
    except BaseException:  # noqa: BLE001  (a traceback is what the corpus looks for)
        tb = traceback.format_exc()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    report = None
    if out_json.exists() and "--json" not in extra:
        report = json.loads(out_json.read_text())
    return Outcome(rc=rc, stdout=so.getvalue(), stderr=se.getvalue(), report=report, traceback=tb, hung=hung)


def verdict(case: Case, o: Outcome) -> str:
    """'' when the case got its answer, else what went wrong (one line)."""
    if o.hung:
        return "hang"
    if o.traceback:
        return "traceback: " + o.traceback.strip().splitlines()[-1]
    if "\x1b" in o.stdout or "\x1b" in o.stderr or "\x07" in o.stdout:
        return "control characters reached the terminal"
    want = {"error": 2, "partial": 3, "ok": 0}[case.expect]
    if o.rc != want:
        kind = "misleading report" if o.rc == 0 else f"exit {o.rc}"
        return f"{kind}, expected exit {want}: {(o.stderr.strip().splitlines() or [''])[-1][:200]}"
    needle = case.needle.lower()
    if case.expect == "error":
        errs = [x for x in o.stderr.splitlines() if x.strip()]
        if len(errs) != 1 or not errs[0].startswith("fsdp-doctor: "):
            return f"not one error line: {errs[:3]}"
        if needle not in errs[0].lower():
            return f"error line lacks {case.needle!r}: {errs[0][:200]}"
        if o.stdout.strip():
            return "a report printed with the error"
    elif case.expect == "partial":
        problems = (o.report or {}).get("problems", [])
        if not any(needle in p.lower() for p in problems):
            return f"no problem names {case.needle!r}: {problems[:4]}"
    if case.check is not None and o.report is not None:
        try:
            case.check(o.report)
        except AssertionError as e:
            return f"figures wrong: {e}"
    return ""


def main() -> int:
    bad = 0
    with tempfile.TemporaryDirectory() as t:
        for i, c in enumerate(cases()):
            o = run_case(c, Path(t) / f"c{i}")
            v = verdict(c, o)
            bad += bool(v)
            print(f"{'FAIL' if v else 'ok  '} {c.name:45s} exit {o.rc}  {v}")
    print(f"{len(cases())} cases, {bad} wrong")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
