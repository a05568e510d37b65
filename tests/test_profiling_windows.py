"""The doctor's profiler windows: memory and shapes recorded; stepping aside beside the user's own profiler."""

from __future__ import annotations

import gzip
import json
import logging

import pytest
import torch

from fsdp_doctor.record.profiling import ProfilerWindows, ProfileSchedule, other_profiler, resolve_profile

STEPPED_ASIDE = "the doctor records no profiler windows in this run"


def _work():
    a = torch.randn(64, 64, requires_grad=True)
    (a @ a).sum().backward()


def _drive(windows: ProfilerWindows, steps: int, user=None) -> None:
    for _ in range(steps):
        _work()
        windows.step()
        if user is not None:
            user.step()
    windows.stop()


@pytest.mark.parametrize("shapes", [None, True])
def test_window_records_memory_not_shapes_and_leaves_no_profiler_behind(tmp_path, shapes):
    """Memory (TensorBoard's Memory view), and no shapes unless asked for: the collectives' sizes come from NCCL's own
    args or the unit snapshot, and with shapes a model of many small operators ran its profiled steps 17x its plain
    ones (a new-user trial's Mamba); ``profile={"record_shapes": True, ...}`` records them."""
    saved = []
    sched = ProfileSchedule(first=2, active=1, warmup=1, every=0)
    w = ProfilerWindows(tmp_path, 0, resolve_profile(sched if shapes is None else {"schedule": sched,
                                                                                   "record_shapes": shapes}),
                        lambda steps, path: saved.append((steps, path)))
    w.start()
    _drive(w, 5)
    assert [s for s, _ in saved] == [[2]]
    trace = json.loads(gzip.open(tmp_path / saved[0][1]).read())
    events = trace["traceEvents"]
    assert any(e.get("name") == "[memory]" for e in events)  # profile_memory: TensorBoard's Memory view
    mm = [e for e in events if e.get("name") == "aten::mm"]
    assert mm and any("Input Dims" in (e.get("args") or {}) for e in mm) == bool(shapes)
    assert w.stepped_aside is None
    assert other_profiler() is None  # our profile object unregistered itself from Kineto's step tracker


def test_a_window_step_that_evaluated_is_taken_again(tmp_path):
    """A window step that also evaluated would put the evaluation in the trace: the window is dropped unsaved and
    taken again from the next step (warm-up, then its steps), twice at most; the third time it stays. Every trace
    written names the steps it holds, and ProfilerStep#N are those steps."""
    saved = []
    w = ProfilerWindows(tmp_path, 0, resolve_profile(ProfileSchedule(first=2, active=2, warmup=1, every=0)),
                        lambda steps, path: saved.append((steps, path)))
    w.start()
    evaluated = {2, 4, 6}  # the window's first step each time: 2, then 4 (after warm-up 3), then 6 (kept)
    acts = []
    for step in range(12):
        _work()
        acts.append(w.action(step).name)
        w.step(evaluated=step in evaluated)
    w.stop()
    assert acts == ["NONE", "WARMUP", "RECORD", "WARMUP", "RECORD", "WARMUP", "RECORD", "RECORD_AND_SAVE",
                    *["NONE"] * 4], acts
    assert [s for s, _ in saved] == [[6, 7]]
    assert [p.name for p in tmp_path.glob("profiler/*")] == ["rank0.6.pt.trace.json.gz"]
    names = {e.get("name") for e in json.loads(gzip.open(tmp_path / saved[0][1]).read())["traceEvents"]}
    assert {"ProfilerStep#6", "ProfilerStep#7"} <= names and "ProfilerStep#2" not in names
    assert other_profiler() is None


@pytest.mark.parametrize("clean", [True, False])
@pytest.mark.parametrize("steps, evaluated", [(2, set()), (5, {3})])
def test_a_window_that_completed_no_step_is_not_saved_after_a_clean_end(tmp_path, clean, steps, evaluated):
    """The last step() opened the window's first recorded step (2 steps; or 5, the window retaken at step 4 after
    an evaluation in step 3 and recording from step 5): after a clean end the profiler holds only the doctor's
    exit, so nothing is saved (before, a trace of a step that never ran, which the analysis reported as a rank
    that never completed it: 'it ended in an error'). After an exception, the unfinished step is kept."""
    saved = []
    w = ProfilerWindows(tmp_path, 0, resolve_profile(ProfileSchedule(first=2, active=2, warmup=1, every=0)),
                        lambda s, path: saved.append(s))
    w.start()
    for step in range(steps):
        _work()
        w.step(evaluated=step in evaluated)
    if not clean:
        _work()  # the step that raised
    w.stop(clean=clean)
    first = 2 if not evaluated else 5
    files = [p.name for p in tmp_path.glob("profiler/*")]
    assert (saved, files) == (([], []) if clean else ([[first]], [f"rank0.{first}.pt.trace.json.gz"])), (saved, files)
    assert other_profiler() is None


def test_steps_aside_for_a_scheduled_user_profiler(tmp_path, caplog):
    seen = []
    user = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                  schedule=torch.profiler.schedule(wait=1, warmup=1, active=2, repeat=1),
                                  on_trace_ready=lambda p: seen.append(len(p.events())))
    saved = []
    w = ProfilerWindows(tmp_path, 0, resolve_profile(ProfileSchedule(first=2, active=2, warmup=1, every=0)),
                        lambda steps, path: saved.append(steps))
    with caplog.at_level(logging.WARNING, logger="fsdp_doctor"), user:
        w.start()
        _drive(w, 6, user)
    assert saved == [] and w.stepped_aside  # no window of ours overlapping theirs
    assert seen and seen[0] > 0  # the user's trace is whole
    lines = [r.getMessage() for r in caplog.records if STEPPED_ASIDE in r.getMessage()]
    assert len(lines) == 1 and "rank 0" in lines[0]
    assert other_profiler() is None  # the user's profiler exited: a later run profiles again


def test_steps_aside_for_a_running_user_profiler(tmp_path, caplog):
    w = ProfilerWindows(tmp_path, 0, resolve_profile(ProfileSchedule(first=1, active=1, warmup=0, every=0)),
                        lambda steps, path: None)
    with caplog.at_level(logging.WARNING, logger="fsdp_doctor"), torch.profiler.profile() as user:
        w.start()
        _drive(w, 3)
    assert w.stepped_aside == "a torch.profiler session is running"
    assert any(e.name == "aten::mm" for e in user.events())


@pytest.mark.slow  # the session's recorded 2-rank run
def test_recorded_windows_carry_message_sizes(recorded_run):
    """The doctor's gloo windows record no shapes (their c10d ops carry no sizes): every FSDP collective is sized,
    typed and grouped from the unit snapshot, as a trace with shapes says (the known answer: the gathered block's
    bytes, float32, the 2 ranks), and has its bus bandwidth."""
    import fsdp_doctor

    run, _, _ = recorded_run
    overlap = fsdp_doctor.build_report(run).overlap
    rows = [r for r in overlap.per_unit if r.collective in ("all_gather", "reduce_scatter") and r.unit]
    assert rows
    assert all(r.bytes_per_call and r.bytes_source == "unit snapshot" and r.busbw_gbps for r in rows), rows[:2]
    assert {(r.dtype, r.group_size) for r in rows} == {("float32", 2)}
    units = {u.name: u for u in run.config.units}
    ag = next(r for r in rows if r.collective == "all_gather" and r.unit == "layers.1")
    assert ag.bytes_per_call == units["layers.1"].unsharded_bytes  # the gathered block
    rs = next(r for r in rows if r.collective == "reduce_scatter" and r.unit == "layers.1")
    assert rs.bytes_per_call == units["layers.1"].unsharded_bytes  # its float32 gradients


@pytest.mark.parametrize("collect", [True, False])
def test_window_leaves_no_garbage_for_the_users_steps(tmp_path, collect, monkeypatch):
    """The profiler and its export leave cyclic garbage; the doctor collects it in the step that closes the window
    (its own, profiled), so none is left for the collector to find in the user's next steps. Without the
    collection (the "before"), the same window leaves it behind."""
    import gc

    monkeypatch.setattr(ProfilerWindows, "collect_after_window", collect)
    w = ProfilerWindows(tmp_path, 0, resolve_profile(ProfileSchedule(first=2, active=1, warmup=1, every=0)),
                        lambda steps, path: None)
    gc.collect()
    gc.disable()  # so that nothing collects between the window and the count below
    try:
        w.start()
        for _ in range(4):  # warm-up 1, record 2, close at the end of step 2
            _work()
            w.step()
        left = gc.collect()  # the unreachable objects the window left for the user's steps
    finally:
        gc.enable()
        w.stop()
    if collect:
        assert left == 0 and w.last_collect_ms > 0
    else:  # measured: a process's first window ~1,600-1,900 objects, a later one 116 (torch 2.13) or 88 (2.11)
        assert left > 50, left


def test_the_trace_is_compressed_off_the_step_and_reported_once_complete(tmp_path, monkeypatch, caplog):
    """The export writes torch's plain JSON and gzips it on a thread: the window is reported once its .json.gz is
    complete (stop() waits for it), and nothing half-written stays. If compressing fails, the plain JSON is the
    trace, reported under its own name, and the reader takes it."""
    from fsdp_doctor.record import profiling
    from fsdp_doctor.trace.reader import read_bytes

    saved = []
    w = ProfilerWindows(tmp_path, 0, resolve_profile(ProfileSchedule(first=1, active=1, warmup=0, every=0)),
                        lambda steps, path: saved.append((steps, path)))
    w.start()
    _drive(w, 3)
    assert saved == [([1], "profiler/rank0.1.pt.trace.json.gz")]
    assert sorted(p.name for p in (tmp_path / "profiler").iterdir()) == ["rank0.1.pt.trace.json.gz"]
    assert any(e.get("name") == "ProfilerStep#1" for e in json.loads(gzip.open(tmp_path / saved[0][1]).read())["traceEvents"])

    def broken(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(profiling.zlib, "compressobj", broken)
    saved.clear()
    w = ProfilerWindows(tmp_path / "b", 0, resolve_profile(ProfileSchedule(first=1, active=1, warmup=0, every=0)),
                        lambda steps, path: saved.append((steps, path)))
    w.start()
    with caplog.at_level(logging.WARNING, logger="fsdp_doctor"):
        _drive(w, 3)
    assert saved == [([1], "profiler/rank0.1.pt.trace.json")]
    assert sorted(p.name for p in (tmp_path / "b" / "profiler").iterdir()) == ["rank0.1.pt.trace.json"]
    assert "could not compress the profiler trace" in caplog.text and "disk full" in caplog.text
    assert any(e.get("name") == "ProfilerStep#1"
               for e in json.loads(read_bytes(tmp_path / "b" / saved[0][1]))["traceEvents"])


def test_a_trace_the_profiler_never_wrote_is_said_lost_not_kept_plain(tmp_path, caplog):
    """A full disk: the profiler wrote no trace, and the compression step said "it stays as plain JSON" of a file that
    did not exist (a new-user trial). One line says the window is lost; nothing is listed as saved."""
    import logging

    from fsdp_doctor.record.profiling import _gzip_file

    done: list = []
    src = tmp_path / "rank0.3.pt.trace.json"  # never written
    with caplog.at_level(logging.WARNING, logger="fsdp_doctor"):
        _gzip_file(src, tmp_path / "rank0.3.pt.trace.json.gz", done)
    assert done == [] and "was not written" in caplog.text and "that window is lost" in caplog.text, caplog.text
    assert "plain JSON" not in caplog.text and list(tmp_path.iterdir()) == []
    src.write_text('{"traceEvents": []}')  # written, and compressed
    _gzip_file(src, tmp_path / "rank0.3.pt.trace.json.gz", done)
    assert [p.name for p in done] == ["rank0.3.pt.trace.json.gz"] and not src.exists()


def test_a_trace_lost_to_a_full_disk_names_the_disk_and_leaves_no_temp_file(tmp_path, caplog, monkeypatch):
    """torch's writer on a full disk (a new-user trial's 40 KiB tmpfs) writes nothing, says nothing of why and leaves
    its empty NAME.tmp: the line said "[Errno 2] No such file or directory" (the trace it did not write) and two
    empty .part.tmp files stayed in profiler/. The cause is read by a write of the doctor's own (here it fails
    with ENOSPC), and torch's leftover is removed."""
    import builtins
    import errno

    import fsdp_doctor.record.profiling as P
    from fsdp_doctor.store import layout

    def full_disk(path, *a, **kw):
        if ".write-test-" in str(path):
            builtins.open(path, *a, **kw).close()  # (created, then no space for its bytes)
            raise OSError(errno.ENOSPC, "No space left on device")
        return builtins.open(path, *a, **kw)

    monkeypatch.setattr(layout, "open", full_disk, raising=False)  # (the probe's: layout.write_probe)
    src = tmp_path / "rank1.6.pt.trace.json.gz.part"  # never written
    (tmp_path / "rank1.6.pt.trace.json.gz.part.tmp").write_bytes(b"")  # torch's, left empty
    done: list = []
    with caplog.at_level(logging.WARNING, logger="fsdp_doctor"):
        P._gzip_file(src, tmp_path / "rank1.6.pt.trace.json.gz", done)
    assert done == [] and list(tmp_path.iterdir()) == []
    assert caplog.messages == ["fsdp_doctor: the profiler trace rank1.6.pt.trace.json.gz was not written ([Errno 28] "
                               "No space left on device): that window is lost"], caplog.messages
    monkeypatch.undo()  # a folder that takes the probe: the missing file is what is said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fsdp_doctor"):
        P._gzip_file(src, tmp_path / "rank1.6.pt.trace.json.gz", done)
    assert "(torch's profiler wrote no file: [Errno 2] No such file or directory" in caplog.text, caplog.text
    assert list(tmp_path.iterdir()) == []


def test_a_second_doctor_in_the_process_names_the_first_not_the_user(tmp_path, caplog):
    """A nested watch() (the README's two-model recipe): the second doctor stepped aside saying "a
    torch.profiler.profile object is alive", blaming a profiler of the user's (a new-user trial). It names the other
    doctor; once that one stops, a doctor profiles again."""
    sched = resolve_profile(ProfileSchedule(first=2, active=2, warmup=1, every=0))
    outer = ProfilerWindows(tmp_path / "outer", 0, sched, lambda s, p: None)
    inner = ProfilerWindows(tmp_path / "inner", 0, sched, lambda s, p: None)
    with caplog.at_level(logging.WARNING, logger="fsdp_doctor"):
        outer.start()
        inner.start()
        for _ in range(4):
            _work()
            outer.step()
            inner.step()
    inner.stop()
    outer.stop()
    assert inner.stepped_aside and not outer.stepped_aside
    (line,) = [r.getMessage() for r in caplog.records if STEPPED_ASIDE in r.getMessage()]
    assert "another fsdp_doctor.watch() in this process records profiler windows" in line, line
    assert other_profiler() is None


@pytest.mark.compat
@pytest.mark.parametrize("action", ["always", "error"])
def test_a_window_makes_torch_warn_nothing(tmp_path, action):
    """A window is a profiler of its own, one cycle: torch 2.11 (the GPU machine's) warned on every rank of every
    watched run that the profiler "clears events at the end of each cycle ... set acc_events=True", a flag the
    user does not hold (a new-user trial). acc_events=True silenced it but made every window's stop build its events in
    Python (a Mamba's export step 10.8 s): the window runs without it and the doctor hides that one warning in its
    own calls. Checked under torch 2.11 (fails there without the filter), 2.6 and 2.15 (never warn). Where warnings
    are errors (``-W error``) a window runs all the same."""
    import warnings

    import torch.profiler.profiler as tp

    getattr(tp, "_WARNINGS_SHOWN", set()).clear()  # (torch warns once a process)
    saved = []
    w = ProfilerWindows(tmp_path, 0, resolve_profile(ProfileSchedule(first=2, active=2, warmup=1, every=0)),
                        on_saved=lambda steps, rel: saved.append(steps))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter(action)
        _drive(w, 6)
    assert saved == [[2, 3]]
    assert not [str(c.message) for c in caught if "profiler" in c.filename], [str(c.message) for c in caught]



def _users_once_only_warning() -> None:
    import warnings

    warnings.warn("the user's own warning, shown once at this line", UserWarning)


@pytest.mark.compat
def test_a_window_shows_the_users_once_only_warnings_once(tmp_path):
    """Python shows a warning once per place under its default filter and forgets what it showed whenever the
    filters change: the doctor's calls into its window's profiler hid torch's cycle warning with a filter of their
    own (catch_warnings), and a new-user trial's ModernBERT under the Trainer printed FSDP2's "returned a view tensor"
    warning on 10 steps a rank, 2 without the doctor. A warning given at every step, with and without torch's cycle
    warning to hide (the test of that warning above), shows once, and the filters are as they were."""
    import warnings

    import torch.profiler.profiler as tp

    getattr(tp, "_WARNINGS_SHOWN", set()).clear()
    w = ProfilerWindows(tmp_path, 0, resolve_profile(ProfileSchedule(first=1, active=2, warmup=1, every=3)),
                        on_saved=lambda steps, rel: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        filters = list(warnings.filters)
        for _ in range(8):
            _work()
            _users_once_only_warning()
            w.step()
        w.stop()
        assert warnings.filters == filters
    mine = [c for c in caught if "the user's own warning" in str(c.message)]
    assert len(mine) == 1, [str(c.message) for c in caught]
    assert not [c for c in caught if "clears events" in str(c.message)], [str(c.message) for c in caught]


_EVERY_STEP_EVAL = """
from fsdp_doctor import ProfileSchedule
model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(3)])
for m in model:
    fully_shard(m)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
with fsdp_doctor.watch(model, opt, out_dir=sys.argv[1], tokens_per_step=64,
                       profile=ProfileSchedule(first=3, active=1, warmup=1, every=0)) as doc:
    for step in range(8):
        with torch.no_grad():  # a generation before every step's update (an RL loop)
            for _ in range(3):
                model(torch.randn(4, 64))
        model(torch.randn(16, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        doc.step()
"""


def test_a_loop_that_evaluates_in_every_step_keeps_its_window_and_flop_count(tmp_path):
    """A loop that generates (or evaluates) in every step: moving the FLOP count or the profiler window on to the
    next step only meets another evaluation. A new-user trial's RL loop had steps 1-9 all set aside (FLOPs recounted
    four times, windows dropped) at 5.5-8.4 s of the doctor's time per dropped window, and no trace kept. Now the
    count stands at step 1 and the window is kept at its step; the other steps are timed."""
    from conftest import run_one_rank
    from fsdp_doctor import load_run

    run = load_run(run_one_rank(tmp_path, _EVERY_STEP_EVAL)[0])
    steps = run.ranks[0].steps
    assert all(s.no_grad_forwards == 3 for s in steps)
    # (step 1 counts the FLOPs; 2 is the window's warm-up, 3 its step, 4 holds its export)
    assert [s.step for s in steps if s.profiled] == [1, 2, 3, 4], [(s.step, s.profiled) for s in steps]
    assert run.config.flops_per_step and run.trace_files, (run.config.flops_per_step, run.trace_files)


def test_a_window_lost_to_a_full_disk_is_recorded_and_said_in_the_report(tmp_path, monkeypatch):
    """A new-user trial's 80 KiB disk: "...rank0.6.pt.trace.json.gz was not written ([Errno 28] No space left on
    device): that window is lost" during training, and nothing of it in the report. The window is recorded as lost
    (why), and the run read back says it in one line. The full disk is simulated: torch's export writes nothing and
    the doctor's probe fails with ENOSPC."""
    import errno
    import shutil

    from fsdp_doctor.record import profiling
    from fsdp_doctor.records import ProfileWindow, record_encoder
    from fsdp_doctor.store import load_run
    from conftest import SAMPLE_RUN as SAMPLE

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", lambda self, path: None)
    monkeypatch.setattr(profiling, "_write_failure", lambda folder: f"[Errno {errno.ENOSPC}] No space left on device")
    saved = []
    w = ProfilerWindows(tmp_path, 0, resolve_profile(ProfileSchedule(first=1, active=2, warmup=0, every=0)),
                        lambda *a: saved.append(a))
    w.start()
    _drive(w, 4)
    assert saved == [([1, 2], "profiler/rank0.1.pt.trace.json.gz", "[Errno 28] No space left on device")]

    run_dir = shutil.copytree(SAMPLE, tmp_path / "run")
    with open(run_dir / "rank0.records.jsonl", "ab") as f:
        f.write(record_encoder.encode(ProfileWindow(rank=0, steps=[9, 10], path="profiler/rank0.9.pt.trace.json.gz",
                                                    lost="[Errno 28] No space left on device")) + b"\n")
    run = load_run(run_dir)
    assert ("profiler/rank0.9.pt.trace.json.gz: the profiler window of rank 0 at steps 9–10 was not saved ([Errno 28] "
            "No space left on device)") in run.problems, run.problems
    assert [pw.steps for pw in run.ranks[0].profiles] == [[6, 7]]  # (the lost one is no trace to analyse)


def test_a_run_whose_only_window_was_lost_says_so_where_trace_rules_are_skipped(tmp_path):
    """The same trial's run had one window, lost to the full disk: --explain said of every trace rule "needs a
    torch.profiler trace; this run has none". It now says which window was not saved, and why."""
    import shutil

    from fsdp_doctor.pipeline import build_report
    from fsdp_doctor.store import load_run
    from conftest import SAMPLE_RUN as SAMPLE

    run_dir = shutil.copytree(SAMPLE, tmp_path / "run")
    shutil.rmtree(run_dir / "profiler")
    for f in run_dir.glob("rank*.records.jsonl"):  # each rank's window recorded as lost
        f.write_text(f.read_text().replace('"path":"profiler/',
                                           '"lost":"[Errno 28] No space left on device","path":"profiler/'))
    run = load_run(run_dir)
    assert all(not rd.profiles and rd.lost_profiles for rd in run.ranks.values())
    rep = build_report(run)
    reasons = {r.reason for r in rep.rules if r.status == "skipped" and r.reason.startswith("needs a torch.profiler")}
    assert reasons == {"needs a torch.profiler trace; this run has none: its profiler window at steps 6-7 was not "
                       "saved ([Errno 28] No space left on device)"}, reasons


def test_a_rank_outside_profile_ranks_marks_the_same_window_steps_with_no_profiler(tmp_path):
    """watch(profile_ranks=[0]): rank 1's windows open, close and are taken again as rank 0's do (its steps in them
    left out of its statistics: it waits in its collectives for rank 0's slower steps), the export's step after each
    window counted as rank 0's is, with no profiler started and no trace written."""
    sched = ProfileSchedule(first=2, active=2, warmup=1, every=6)
    evaluated = {2, 4}  # the first window taken again twice, as in the test above; the second, from step 12, kept
    runs = {}
    for rank, dry in ((0, False), (1, True)):
        saved, marked, exported = [], [], []
        w = ProfilerWindows(tmp_path, rank, resolve_profile(sched), lambda s, path: saved.append(s), dry=dry)
        w.start()
        for step in range(16):
            _work()
            if w.is_profiled(step):
                marked.append(step)
            if dry:
                assert w.prof is None and other_profiler() is None
            if w.step(evaluated=step in evaluated):
                exported.append(step)
        w.stop()
        runs[rank] = (marked, exported, saved)
    assert runs[0][:2] == runs[1][:2], runs  # the same steps marked, the same export steps
    assert runs[0][0] == [1, 2, 3, 4, 5, 6, 7, 11, 12, 13] and runs[0][1] == [7, 13], runs[0]
    assert runs[0][2] == [[6, 7], [12, 13]] and runs[1][2] == []
    assert sorted(p.name for p in tmp_path.glob("profiler/*")) == ["rank0.12.pt.trace.json.gz",
                                                                   "rank0.6.pt.trace.json.gz"]
