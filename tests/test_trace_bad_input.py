"""Bad input is one line per file in ``skipped``; the other files are still analysed."""

import gzip
import json
from pathlib import Path

import pytest

from fsdp_doctor.report_sections import SkippedFile
from fsdp_doctor.trace import analyze_traces, find_trace_files
from trace_fixtures import TraceBuilder, fsdp_gpu_trace, gpu_known_trace


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
    assert "1 trace file" in facts and "1 left out (listed at the end)" in facts and "traces of rank 0" in facts


# ---------------------------------------------------------------- another job: other FSDP units
def _units_trace(rank, units_by_step: dict, world_size=4) -> TraceBuilder:
    """A CPU trace whose ProfilerSteps (1000 µs each, plus one the analysis cuts) run the FSDP units named for
    them: each unit's forward is its pre_forward and post_forward labels around an aten::mm ("" is the root)."""
    b = TraceBuilder(rank=rank, world_size=world_size)
    steps = list(units_by_step) + [max(units_by_step) + 1]
    for i, n in enumerate(steps):
        T = 1000.0 * i
        b.step(n, T, 1000.0)
        for j, u in enumerate(units_by_step.get(n, [])):
            t, fqn = T + 10 + 100 * j, f" ({u})" if u else ""
            b.label(f"FSDP::pre_forward{fqn}", t, 5)
            b.op("aten::mm", t + 10, 50)
            b.label(f"FSDP::post_forward{fqn}", t + 70, 5)
    return b


def _mixed_runs(d, first_units=4, second_units=1, world_size=2):
    """rank0.json from a run whose model has ``first_units`` FSDP units, rank1.json from one with
    ``second_units``: the same world size, the same steps at the same time."""
    for rank, units in ((0, first_units), (1, second_units)):
        fsdp_gpu_trace(units=units, rank=rank, world_size=world_size, bwd_us=50, rs_us=20, prefetch=True).write(
            d / f"rank{rank}.json")
    return d


def test_a_rank_of_another_job_with_other_fsdp_units_is_skipped(tmp_path):
    """Two runs of other models (4 units, 1 unit), each rank's trace taken from one: the second file (a tie: the
    first file's units win) is named with its units and the others', and rank 0 is analysed alone, its figures those
    of its file read by itself."""
    r = analyze_traces(_mixed_runs(tmp_path))
    assert r.skipped == [SkippedFile(
        file="rank1.json", error="another job (its step 1's FSDP units: 1, named layers.0; the other files': 4, "
                                 "named layers.0, layers.1, layers.2, layers.3); skipped")]
    _one_line(r.skipped)
    alone = analyze_traces(tmp_path / "rank0.json")
    assert list(r.per_rank) == ["0"] and r.files == [str(tmp_path / "rank0.json")]
    assert r.per_rank["0"].comm_us == 2 * 4 * (50 + 50 + 20)  # 2 steps of 4 units: all-gathers 50 + 50, RS 20
    for k in ("comm_us", "exposed_us", "overlap_us"):
        assert getattr(r.per_rank["0"], k) == getattr(alone.per_rank["0"], k) > 0, k
    # the unit rows are rank 0's: its 4 units, 2 complete steps each, nothing of the other model's
    assert [(u.name, u.samples) for u in r.units] == [(f"layers.{i}", 2) for i in range(4)]


def test_the_units_most_files_ran_win_over_the_first_files(tmp_path):
    fsdp_gpu_trace(units=1, rank=0, world_size=4, bwd_us=50).write(tmp_path / "rank0.json")
    for rank in (1, 2):
        fsdp_gpu_trace(units=5, rank=rank, world_size=4, bwd_us=50).write(tmp_path / f"rank{rank}.json")
    r = analyze_traces(tmp_path)
    assert r.skipped == [SkippedFile(
        file="rank0.json", error="another job (its step 1's FSDP units: 1, named layers.0; the other files': 5, "
                                 "named layers.0, layers.1 … layers.4); skipped")]
    assert sorted(r.per_rank) == ["1", "2"]


def test_units_are_compared_only_in_steps_both_files_hold_whole(tmp_path):
    """One job, nothing skipped: rank 0's window holds a third step that ran one more unit (an evaluation head),
    rank 1's file holds only steps 1 and 2; rank 2's window has no profiler step (it may hold part of one: its units
    are not known); rank 3's steps carry no FSDP2 label. Then a unit set of the same size but other names is told
    apart by the names only each has."""
    _units_trace(0, {1: ["", "a", "b"], 2: ["", "a", "b"], 3: ["", "a", "b", "head"]}).write(tmp_path / "rank0.json")
    _units_trace(1, {1: ["", "a", "b"], 2: ["", "a", "b"]}).write(tmp_path / "rank1.json")
    part = _units_trace(2, {1: ["b"]})
    part.events = [e for e in part.events if not e["name"].startswith("ProfilerStep")]
    part.write(tmp_path / "rank2.json")
    unlabelled = _units_trace(3, {1: [], 2: []})
    unlabelled.op("aten::mm", 10, 50)
    unlabelled.write(tmp_path / "rank3.json")
    r = analyze_traces(tmp_path)
    assert r.skipped == [] and sorted(r.per_rank) == ["0", "1", "2", "3"]
    # rank 0's step 3: one unit more; in a folder with a file of that step ran without it, it is another job's
    _units_trace(1, {1: ["", "a", "b"], 2: ["", "a", "b"], 3: ["", "a", "b"]}).write(tmp_path / "rank1.json")
    r = analyze_traces(tmp_path)
    assert [(s.file, s.error) for s in r.skipped] == [("rank1.json", "another job (its step 3's FSDP units: 3, "
                                                       "named (root), a, b; the other files': 4, named (root), a, b, "
                                                       "head); skipped")]
    # as many units, named otherwise, with short forms that read the same
    for rank, mid in ((0, "x"), (1, "y")):
        _units_trace(rank, {1: ["", "a", mid, "b", "c"]}).write(tmp_path / f"rank{rank}.json")
    (tmp_path / "rank2.json").unlink()
    (tmp_path / "rank3.json").unlink()
    r = analyze_traces(tmp_path)
    assert [(s.file, s.error) for s in r.skipped] == [("rank1.json", "another job (its step 1's FSDP units: 5, "
                                                       "among them y; the other files': 5, among them x); skipped")]


def test_the_cli_names_another_jobs_file_in_one_line_and_exits_3(tmp_path, capsys, monkeypatch):
    from fsdp_doctor import cli

    monkeypatch.setenv("COLUMNS", "80")  # narrower than the line: it is never folded
    rc = cli.main(["analyze", str(_mixed_runs(tmp_path))])
    out = capsys.readouterr().out
    assert rc == cli.EXIT_PARTIAL == 3
    assert [ln for ln in out.splitlines() if "rank1" in ln] == [
        "skipped: rank1.json: another job (its step 1's FSDP units: 1, named layers.0; the other files': 4, named "
        "layers.0, layers.1, layers.2, layers.3)"]  # (it read "...); skipped" after "skipped:")
    # the header counts it left out
    assert "1 trace file · 1 left out (listed at the end)" in out, out


def test_pipeline_stages_of_one_job_are_not_another_job(tmp_path):
    """Pipeline stages hold different units: ranks whose FSDP collectives run on a group smaller than the world
    (PP 2 x FSDP 2: all-gathers over 2 of 4 ranks), or that send and receive point-to-point, are not compared; the
    same CPU traces without their sends are another job's."""
    import re

    for rank in range(4):
        stage = rank // 2
        doc = fsdp_gpu_trace(units=2, rank=rank, world_size=2, bwd_us=50, prefetch=True).document()
        doc["distributedInfo"]["world_size"] = 4  # the NCCL args say "Group size": 2
        text = re.sub(r"layers\.(\d)", lambda m: f"layers.{2 * stage + int(m.group(1))}", json.dumps(doc))
        (tmp_path / "gpu" / f"rank{rank}.json").parent.mkdir(exist_ok=True)
        (tmp_path / "gpu" / f"rank{rank}.json").write_text(text)
    r = analyze_traces(tmp_path / "gpu")
    assert r.skipped == [] and sorted(r.per_rank) == ["0", "1", "2", "3"]
    assert {u.name for u in r.units} == {"layers.0", "layers.1", "layers.2", "layers.3"}

    def stage(rank, p2p):
        b = _units_trace(rank, {1: ["", f"layers.{2 * rank}", f"layers.{2 * rank + 1}"], 2: []}, world_size=2)
        if p2p:  # stage 0 sends its activations to stage 1
            b.gloo("send" if rank == 0 else "recv", 500, 20)
        b.write(tmp_path / f"cpu{int(p2p)}" / f"rank{rank}.json")

    for p2p in (True, False):
        for rank in (0, 1):
            stage(rank, p2p)
    assert analyze_traces(tmp_path / "cpu1").skipped == []
    assert [s.error for s in analyze_traces(tmp_path / "cpu0").skipped] == [
        "another job (its step 1's FSDP units: 3, named (root), layers.2, layers.3; the other files': 3, named (root), "
        "layers.0, layers.1); skipped"]


def test_another_job_by_its_steps_time_says_how_far_apart_in_its_unit(tmp_path):
    """The same model's traces from two runs 11 minutes apart (the same units, the same steps): rank 1's step 1 ran
    11 min after rank 0's, past JOB_SKEW_S (600 s), so it is another job's, said in minutes (it read "0.2 h")."""
    import json

    from fsdp_doctor.trace.admit import JOB_SKEW_S

    for rank, shift_s in ((0, 0.0), (1, 660.0)):
        doc = _units_trace(rank, {1: ["", "layers.0"], 2: ["", "layers.0"]}, world_size=2).document()
        doc["baseTimeNanoseconds"] += int(shift_s * 1e9)
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(doc))
    assert 660.0 > JOB_SKEW_S
    r = analyze_traces(tmp_path)
    assert [(s.file, s.error) for s in r.skipped] == [
        ("rank1.json", "another job (its step 1 ran 11 min from the other files' step 1); skipped")], r.skipped
    assert sorted(r.per_rank) == ["0"]


def test_a_rank_of_another_run_issuing_other_collectives_is_skipped(tmp_path):
    """A new-user trial reran their loop with a fix (reduce-scatter once per optimizer step) into the same
    tensorboard_trace_handler folder two minutes later: rank 0's file of the first run and rank 1's of the second
    were read as one job, 2 reduce-scatters per unit on one rank and 1 on the other. The ranks of one job issue the
    same collectives in the same steps: a file whose steps issue other counts of one kind is another run's."""
    fsdp_gpu_trace(units=4, rank=0, world_size=2, bwd_us=50, rs_us=20).write(tmp_path / "rank0.json")
    fsdp_gpu_trace(units=4, rank=1, world_size=2, bwd_us=50, rs_us=0).write(tmp_path / "rank1.json")
    r = analyze_traces(tmp_path)
    assert r.skipped == [SkippedFile(file="rank1.json", error="another job (its steps 1–2 issue 0 reduce-scatters "
                                                              "per step where the other files' issue 4 "
                                                              "reduce-scatters); skipped")]
    _one_line(r.skipped)
    fsdp_gpu_trace(units=4, rank=1, world_size=2, bwd_us=50, rs_us=20).write(tmp_path / "rank1.json")
    assert analyze_traces(tmp_path).skipped == []


@pytest.mark.parametrize("before, after", [
    ({"units": 4, "rs_us": 20}, {"units": 4, "rs_us": 0}),  # the fix changed the counts of a collective
    ({"units": 1, "rs_us": 20}, {"units": 4, "rs_us": 20}),  # the fix wrapped the model per block
])
def test_a_rerun_with_a_fix_into_the_same_folder_is_kept(tmp_path, before, after):
    """A new-user trial profiled gradient accumulation without set_requires_gradient_sync(False) (24
    reduce-scatters a step), pasted the fix and reran into the same tensorboard_trace_handler folder 89 s later (6 a
    step): the two runs tied 2 files to 2 as "another job" by their counts, the first by name (the first run's,
    whose pids were lower) was kept, and the report still warned of the problem the rerun had fixed. Where every
    rank holds the same steps twice, the files are two runs of the folder: the newest is kept, the first named."""
    for run, (kw, shift_s) in enumerate(((before, 0.0), (after, 89.0))):
        for rank in (0, 1):
            doc = fsdp_gpu_trace(rank=rank, world_size=2, bwd_us=50, **kw).document()
            doc["baseTimeNanoseconds"] += int(shift_s * 1e9)
            (tmp_path / f"vm_{2120 + 300 * run + rank}.pt.trace.json").write_text(json.dumps(doc))
    r = analyze_traces(tmp_path)
    assert [(s.file, s.error) for s in r.skipped] == [
        (f"vm_{n}.pt.trace.json", "another run (its step 1 ran 89 s before the step 1 of the 2 files kept: profiled "
                                  "into the same folder again?); skipped") for n in (2120, 2121)], r.skipped
    assert sorted(r.per_rank) == ["0", "1"]
    assert len(r.units) == after["units"], r.units
    # each run in a folder of its own, the folder above them analysed: not "the same folder again"
    for run, name in enumerate(("run_accum", "run_fixed")):
        (tmp_path / name).mkdir()
        for rank in (0, 1):
            f = tmp_path / f"vm_{2120 + 300 * run + rank}.pt.trace.json"
            f.rename(tmp_path / name / f.name)
    r = analyze_traces(tmp_path)
    assert [(s.file, s.error) for s in r.skipped] == [
        (f"run_accum/vm_{n}.pt.trace.json", "another run (its step 1 ran 89 s before the step 1 of the 2 files kept "
                                            "in run_fixed: another run's folder beside it; analyze one run's "
                                            "folder); skipped") for n in (2120, 2121)], r.skipped
    assert len(r.units) == after["units"], r.units


def test_a_trace_without_fsdp_collectives_beside_fsdp_ones_is_another_job(good):
    """A folder holding an FSDP run's trace of rank 0 and a DDP run's trace of rank 1 (whole-loop exports, no
    ProfilerStep markers to compare): read as one job, rank 1's all-reduce became the FSDP job's "3 collectives per
    step outside FSDP's own" (a new-user trial). A file issuing no FSDP2 collective among files that do is another
    job's, named."""
    ddp = TraceBuilder(rank=1)
    for i in range(3):
        T = 1000.0 * i
        ddp.compute(T + 10, 300, launch_ts=T + 5)
        ddp.nccl("all_reduce", T + 400, 100, launch_ts=T + 390, nelems=1_000_000)
    ddp.write(good / "rank1.trace.json")
    r = analyze_traces(good)
    assert list(r.per_rank) == ["0"], r.per_rank
    assert [s.file for s in r.skipped] == ["rank1.trace.json"] and "no FSDP2 collective in it" in r.skipped[0].error
    _one_line(r.skipped)


@pytest.mark.skipif(not (__import__("conftest").HTA_TRACES / "v100_rank1_of_2").is_dir(),
                    reason="reference traces not found")
def test_one_rank_on_two_gpu_models_is_two_jobs():
    """HTA's reference folder holds rank 1 of two V100 runs recorded months apart (32 GB and 16 GB): they were read
    as one rank's two windows, and the header, from every file's metadata, read "300 ranks" and five GPU models (a
    new-user trial). The second is another job; the header's facts are the files read."""
    from conftest import HTA_TRACES

    from fsdp_doctor import build_report, load_run

    rep = build_report(load_run(HTA_TRACES))
    assert any(s.file.startswith("v100_rank1_of_2/") and "rank 1 ran on a Tesla V100-SXM2-16GB here" in s.error
               for s in rep.overlap.skipped), rep.overlap.skipped
    assert list(rep.overlap.per_rank) == ["1"]
    assert rep.run.device_name == "Tesla V100-SXM2-32GB" and rep.run.world_size == 2, rep.run


# ---------------------------------------------------------------- a foreign file named like a rank's
FOREIGN = Path(__file__).parent / "fixtures" / "foreign_rank_file" / "rank1.100.pt.trace.json"


def _two_windows_per_rank(d):
    """A 2-rank run profiled in two windows per rank (steps 2-3, then 7-8 48 s later), named as
    tensorboard_trace_handler names them, beside a new user's one-event file named like rank 1's
    (tests/fixtures/foreign_rank_file: no rank metadata, no profiler step, nothing on a main thread)."""
    from trace_fixtures import gloo_known_trace

    for rank in (0, 1):
        for k, (steps, shift_s) in enumerate((((2, 3), 0.0), ((7, 8), 48.0))):
            doc = gloo_known_trace(rank=rank, steps=steps).document()
            doc["baseTimeNanoseconds"] += int(shift_s * 1e9)
            (d / f"rank{rank}.17961569{k}4210685823.pt.trace.json").write_text(json.dumps(doc))
    (d / FOREIGN.name).write_bytes(FOREIGN.read_bytes())
    return d


def test_a_foreign_file_named_like_a_rank_does_not_push_out_its_traces(tmp_path, capsys, monkeypatch):
    """A new-user trial put a one-event file named rank1.100.pt.trace.json beside a 2-rank run's four traces: it
    sorts first, so it was kept as rank 1 and both of rank 1's real files were skipped as "rank 1 again (the same
    time span also in rank1.100.pt.trace.json)" (its time is not known: nothing overlaps); rank 0 was analysed
    alone. A file with no profiler step and no FSDP2 collective beside files of its rank that hold them is not a
    trace of the run: named in one line (within 100 columns), left out, both ranks analysed."""
    from fsdp_doctor import cli

    d = _two_windows_per_rank(tmp_path)
    r = analyze_traces(d)
    assert [s.file for s in r.skipped] == [FOREIGN.name], r.skipped
    assert r.skipped[0].error == "not a trace of this run (no profiler step, no FSDP2 collective); skipped"
    _one_line(r.skipped)
    assert sorted(r.per_rank) == ["0", "1"]
    assert r.per_rank["1"].steps == [2, 3, 7, 8] == r.per_rank["0"].steps
    # the figures are those of the run's four files read without it
    alone = analyze_traces(sorted(p for p in d.iterdir() if p.name != FOREIGN.name))
    for rank in ("0", "1"):
        for k in ("comm_us", "exposed_us", "overlap_us"):
            assert getattr(r.per_rank[rank], k) == getattr(alone.per_rank[rank], k) > 0, (rank, k)

    monkeypatch.setenv("COLUMNS", "100")
    assert cli.main(["analyze", str(d)]) == cli.EXIT_PARTIAL
    out = capsys.readouterr().out
    line, = [ln for ln in out.splitlines() if "rank1" in ln]
    assert line == f"skipped: {FOREIGN.name}: not a trace of this run (no profiler step, no FSDP2 collective)"
    assert len(line) <= 100
    assert "no trace of rank 1" not in out and "4 trace files" in out, out


def test_a_foreign_file_named_like_a_rank_without_traces_of_its_own_is_left_out(tmp_path, capsys):
    """The foreign one-event file named like rank 1 beside rank 0's traces alone (rank 1 not profiled): it was kept as
    rank 1, said nowhere ("2 trace files" over a table of rank 0 only). It holds neither a profiler step nor an FSDP2
    collective where another file does: left out in one line, rank 0 analysed as without it."""
    from trace_fixtures import gloo_known_trace

    from fsdp_doctor import cli

    (tmp_path / "rank0.179615690.pt.trace.json").write_text(
        json.dumps(gloo_known_trace(rank=0, steps=(2, 3)).document()))
    (tmp_path / FOREIGN.name).write_bytes(FOREIGN.read_bytes())
    r = analyze_traces(tmp_path)
    assert [(s.file, s.error) for s in r.skipped] == [
        (FOREIGN.name, "not a trace of this run (no profiler step, no FSDP2 collective); skipped")]
    assert sorted(r.per_rank) == ["0"]
    alone = analyze_traces([tmp_path / "rank0.179615690.pt.trace.json"])
    assert r.per_rank["0"].exposed_us == alone.per_rank["0"].exposed_us > 0
    assert cli.main(["analyze", str(tmp_path)]) == cli.EXIT_PARTIAL
    out = capsys.readouterr().out
    assert "1 trace file · 1 left out" in out and "2 trace files" not in out, out
    assert f"skipped: {FOREIGN.name}: not a trace of this run (no profiler step, no FSDP2 collective)" in out


def test_two_files_of_one_rank_without_a_time_are_not_said_to_share_a_time_span(tmp_path):
    """Two files of rank 1 with no time span to compare (nothing on a main thread): one is left out as rank 1 again,
    but not for "the same time span" (it read so, their spans unknown)."""
    for name in ("rank1.100.pt.trace.json", "rank1.123.pt.trace.json"):
        (tmp_path / name).write_bytes(FOREIGN.read_bytes())
    r = analyze_traces(tmp_path)
    assert [s.file for s in r.skipped] == ["rank1.123.pt.trace.json"], r.skipped
    assert r.skipped[0].error == ("rank 1 again (rank1.100.pt.trace.json too, and no time in either tells the two "
                                  "apart): two files of one rank are never summed; skipped"), r.skipped[0].error
    _one_line(r.skipped)


def test_one_ranks_files_whose_spans_overlap_are_said_to_share_a_time_span(tmp_path):
    """Two copies of rank 1's whole-loop export (no profiler step): the same time span, said so."""
    from trace_fixtures import gloo_known_trace

    for rank, names in ((0, ("rank0.json",)), (1, ("rank1.a.json", "rank1.b.json"))):
        b = gloo_known_trace(rank=rank)
        b.events = [e for e in b.events if not e["name"].startswith("ProfilerStep")]
        for name in names:
            b.write(tmp_path / name)
    r = analyze_traces(tmp_path)
    assert [(s.file, s.error) for s in r.skipped] == [("rank1.b.json", "rank 1 again (the same time span also in "
                                                       "rank1.a.json): two files of one rank are never summed; "
                                                       "skipped")]


def test_of_one_ranks_two_files_the_one_with_steps_is_kept_whatever_the_names(tmp_path):
    """A pipeline stage's rank (it sends point-to-point: it may hold part of the model, not compared with the
    others) with two files over the same time: one with its profiler steps and FSDP2 collectives, one (named
    first) with a send only. The one with steps is kept, the other named as rank 1 again."""
    from trace_fixtures import gloo_known_trace

    gloo_known_trace(rank=0).write(tmp_path / "rank0.json")
    real = gloo_known_trace(rank=1)
    real.gloo("send", 500, 20)
    real.write(tmp_path / "rank1.9.json")
    send = TraceBuilder(rank=1)
    send.op("aten::copy_", 400, 200)
    send.gloo("send", 500, 20)
    send.write(tmp_path / "rank1.0.json")
    r = analyze_traces(tmp_path)
    assert [(s.file, s.error) for s in r.skipped] == [("rank1.0.json", "rank 1 again (the same time span also in "
                                                       "rank1.9.json): two files of one rank are never summed; "
                                                       "skipped")]
    assert r.per_rank["1"].steps == [5, 6]


def test_steps_a_skip_names_are_the_steps_held_not_a_range_over_their_gap(tmp_path):
    """Two files of rank 1 that both hold profiled steps 2, 3, 7 and 8 (two windows each): the skip said "step 2–8
    also in", naming steps 4-6 that neither file holds; it names the runs of steps, as the report does elsewhere."""
    units = {n: ["", "layers.0"] for n in (2, 3, 7, 8)}
    for name, rank in (("rank0.json", 0), ("rank1.json", 1), ("rank1.b.json", 1)):
        _units_trace(rank, units, world_size=2).write(tmp_path / name)
    r = analyze_traces(tmp_path)
    assert [(s.file, s.error) for s in r.skipped] == [
        ("rank1.json", "rank 1 again (steps 2–3, 7–8 also in rank1.b.json): two files of one rank are never summed; "
                       "skipped")]
    _one_line(r.skipped)


def test_collective_counts_of_another_job_are_said_with_their_plural():
    """The counts a skip names read as English ("issue 12 all-gather per step" read a new-user trial's skip)."""
    from fsdp_doctor.trace.admit import _counts_differ

    assert _counts_differ(frozenset({("all_gather", 24)}), frozenset({("all_gather", 6)}), 2) == (
        "issue 12 all-gathers per step where the other files' issue 3 all-gathers")
    assert _counts_differ(frozenset({("reduce_scatter", 1)}), frozenset({("reduce_scatter", 4)}), 1) == (
        "issues 1 reduce-scatter per step where the other files' issue 4 reduce-scatters")
