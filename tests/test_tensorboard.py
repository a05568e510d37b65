"""TensorBoard output: scalars read back with EventAccumulator equal the records; the profiler windows are found
by torch-tb-profiler as run "profiler" with workers rank0/rank1; the live writer costs little per step."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import msgspec
import pytest

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from fsdp_doctor.present.tensorboard import export_tensorboard  # noqa: E402
from fsdp_doctor.record.tensorboard import TensorBoardWriter  # noqa: E402
from fsdp_doctor.records import CudaMemory, MemoryStep, StepRecord  # noqa: E402
from fsdp_doctor.store import load_run  # noqa: E402
from fsdp_doctor.tensorboard_scalars import MIB, STEP_FIELDS  # noqa: E402
from fsdp_doctor.trace import analyze_traces  # noqa: E402

SAMPLE = Path(__file__).resolve().parents[1] / "traces" / "sample"


@pytest.fixture
def sample_copy(tmp_path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(SAMPLE, dst, ignore=shutil.ignore_patterns("tb"))  # the scalars the run wrote live
    return dst


def _scalars(logdir: Path) -> dict[str, dict[int, float]]:
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_export_scalars_equal_the_records(sample_copy, tmp_path):
    run = load_run(sample_copy)
    out = tmp_path / "out"
    dirs = export_tensorboard(run, out)
    assert [d.name for d in dirs] == ["rank0", "rank1"]
    for rank, rd in sorted(run.ranks.items()):
        sc = _scalars(out / "tb" / f"rank{rank}")
        for f in STEP_FIELDS:
            got = sc[f"step/{f}"]
            assert sorted(got) == [s.step for s in rd.steps]
            for s in rd.steps:
                assert got[s.step] == pytest.approx(getattr(s, f), rel=1e-6, abs=1e-6), (rank, f, s.step)
        assert {k for k, v in sc["step/profiled"].items() if v == 1.0} == {s.step for s in rd.steps if s.profiled}
        # overlap of the one profiled window: the trace engine's per-step figures for that file, at each of the
        # window's steps (6 and 7: two points draw a line; one point alone TensorBoard does not show)
        (pw,) = rd.profiles
        res = analyze_traces([sample_copy / pw.path]).per_rank[str(rank)]
        assert sorted(sc["overlap/overlap_pct"]) == sorted({*res.steps, *pw.steps}) == [6, 7]
        for st in pw.steps:
            assert sc["overlap/overlap_pct"][st] == pytest.approx(res.step_overlap_pct, rel=1e-6)
            assert sc["overlap/exposed_comm_ms"][st] == pytest.approx(res.exposed_ms_per_step, rel=1e-6)
            assert sc["overlap/comm_ms"][st] == pytest.approx(res.comm_ms_per_step, rel=1e-6)
            assert sc["overlap/exposed_comm_ms"][st] <= sc["step/wall_ms"][st]
        # no flat-zero memory chart: every memory tag written was non-zero at some step
        for tag, pts in sc.items():
            if tag.startswith("memory/"):
                assert any(pts.values()), tag
        assert "memory/activations_mib" in sc and "memory/temporaries_mib" not in sc  # 0 on CPU: no allocator total
        # wall time grows with the step (step 8 exported the window and used to end after step 9)
        acc = EventAccumulator(str(out / "tb" / f"rank{rank}"), size_guidance={"scalars": 0})
        acc.Reload()
        wall = sorted((e.step, e.wall_time) for e in acc.Scalars("step/wall_ms"))
        assert all(a[1] <= b[1] for a, b in zip(wall, wall[1:])), wall


def test_a_second_export_is_refused_or_replaces_the_first(sample_copy):
    """TensorBoard reads every event file of a folder: a second export beside the first drew each step twice (a
    new-user trial read step/wall_ms at 24 points of 12 steps). It is refused, or with ``overwrite`` replaces the
    event files there, whoever wrote them; ``step/doctor_step`` marks the steps the report's statistics leave out
    as the doctor's own (a step whose memory was counted op by op read 0 in step/profiled)."""
    import subprocess
    import sys

    from fsdp_doctor.present.tensorboard import EventsExist
    from fsdp_doctor.records import doctor_step

    run = load_run(sample_copy)
    rd = run.ranks[0]
    s2 = rd.steps[2]  # as a run recorded now counts its memory op by op at step 2 (the sample's predates it)
    assert not s2.profiled and s2.memory is not None
    rd.steps[2] = msgspec.structs.replace(s2, memory=msgspec.structs.replace(s2.memory, transients="exact"))
    export_tensorboard(run, traces=False)
    with pytest.raises(EventsExist, match="already holds TensorBoard events"):
        export_tensorboard(run, traces=False)
    cli = [sys.executable, "-m", "fsdp_doctor.cli", "tensorboard", str(sample_copy), "--no-traces"]
    r = subprocess.run(cli, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--overwrite replaces them" in r.stderr, r.stderr
    (old,) = (sample_copy / "tb" / "rank0").glob("events.out.tfevents.*")
    export_tensorboard(run, traces=False, overwrite=True)
    (f,) = (sample_copy / "tb" / "rank0").glob("events.out.tfevents.*")
    assert f != old
    sc = _scalars(f.parent)
    assert sorted(sc["step/wall_ms"]) == [s.step for s in rd.steps]  # once each
    mine = {k for k, v in sc["step/doctor_step"].items() if v == 1.0}
    assert mine == {s.step for s in rd.steps if doctor_step(s)} == {s.step for s in rd.steps if s.profiled} | {2}
    r = subprocess.run(cli + ["--overwrite"], capture_output=True, text=True)
    assert r.returncode == 0 and len(list(f.parent.glob("events.out.tfevents.*"))) == 1, r.stderr


def test_export_defaults_to_the_run_directory(sample_copy):
    run = load_run(sample_copy)
    export_tensorboard(run, traces=False)
    assert (sample_copy / "tb" / "rank0").is_dir() and (sample_copy / "tb" / "rank1").is_dir()
    assert "overlap/overlap_pct" not in _scalars(sample_copy / "tb" / "rank0")


def _mem_step(step: int, scale: int) -> StepRecord:
    breakdown = {"sharded_params": 3 * scale, "unsharded_params": 5 * scale, "sharded_grads": 3 * scale,
                 "unsharded_grads": 0, "optimizer_state": 6 * scale, "activations": 11 * scale + 7,
                 "comm_buffers": 2 * scale, "temporaries": 123_456_789}
    return StepRecord(rank=0, step=step, start_ns=1_700_000_000_000_000_000 + step * 10**8, wall_ms=100.0 + step,
                      forward_ms=30.0, backward_ms=50.0, optimizer_ms=10.0, outside_ms=10.0 + step, profiled=step == 2,
                      memory=msgspec.convert({"v": 1, "device": "cuda:0", "peak": {"bytes": sum(breakdown.values()), "t_ms": 12.5,
                                                                  "unit": "layers.0", "phase": "backward",
                                                                  "breakdown": breakdown},
                              "offloaded_host": 4096, "cuda": {"allocated": 7 * scale, "reserved": 9 * scale}}, MemoryStep))


def test_memory_by_category_at_the_peak(tmp_path):
    w = TensorBoardWriter(tmp_path, 0)
    recs = [_mem_step(i, (i + 1) << 20) for i in range(4)]
    for r in recs:
        w.on_step(r)
    w.close()
    sc = _scalars(tmp_path / "tb" / "rank0")
    for r in recs:
        peak = r.memory.peak
        assert sc["memory/peak_mib"][r.step] == pytest.approx(peak.bytes / MIB, rel=1e-6)
        for cat, v in peak.breakdown.items():
            if cat == "unsharded_grads":  # 0 at every step: no flat-zero chart
                assert f"memory/{cat}_mib" not in sc
                continue
            assert sc[f"memory/{cat}_mib"][r.step] == pytest.approx(v / MIB, rel=1e-6, abs=1e-9), cat
        assert sc["memory/offloaded_host_mib"][r.step] == pytest.approx(4096 / MIB)
        assert sc["memory/cuda_allocated_mib"][r.step] == pytest.approx(r.memory.cuda.allocated / MIB)
        assert sc["step/outside_ms"][r.step] == pytest.approx(r.outside_ms)


def test_live_writer_is_cheap_and_analyses_windows_in_background(sample_copy, monkeypatch):
    """The training thread only queues: every event write and the window's trace analysis run on the writer's own
    thread (checked by the thread each ran on, not by timing the calls, which a loaded host moves; the cost is
    printed, and benchmarks/overhead.py measures the doctor's cost on the step)."""
    import threading

    run = load_run(sample_copy)
    rd = run.ranks[0]
    w = TensorBoardWriter(sample_copy, 0)
    w.poll_s = 0.2
    ran_on: dict[str, set] = {"step": set(), "profile": set()}
    write_step, analyze = w._write_step, w._analyze
    monkeypatch.setattr(w, "_write_step", lambda rec: (ran_on["step"].add(threading.get_ident()), write_step(rec)))
    monkeypatch.setattr(w, "_analyze", lambda win, p: (ran_on["profile"].add(threading.get_ident()), analyze(win, p)))
    main = threading.get_ident()
    t0 = time.perf_counter()
    n = 0
    for _ in range(10):
        for rec in rd.steps:
            w.on_step(rec)
            n += 1
    per_step_ms = (time.perf_counter() - t0) * 1e3 / n
    (pw,) = rd.profiles
    t1 = time.perf_counter()
    w.on_profile(pw, sample_copy / pw.path)
    hook_ms = (time.perf_counter() - t1) * 1e3
    assert main not in ran_on["step"] | ran_on["profile"]  # the hooks queued; nothing was done inline
    deadline = time.monotonic() + 60
    while (w._jobs or not ran_on["profile"]) and time.monotonic() < deadline:
        time.sleep(0.05)  # the worker wakes every poll_s and drains the queue
    worker = w._worker
    assert worker is not None and worker.name == "fsdp-doctor-tb-rank0"
    assert ran_on["step"] == ran_on["profile"] == {worker.ident}
    t2 = time.perf_counter()
    w.close()
    close_ms = (time.perf_counter() - t2) * 1e3
    print(f"\nTensorBoardWriter.on_step: {per_step_ms * 1e3:.1f} us/step in the training thread; on_profile returns "
          f"in {hook_ms:.2f} ms; close() in {close_ms:.0f} ms after the worker drained {n} steps + 1 window")
    sc = _scalars(sample_copy / "tb" / "rank0")
    assert "overlap/overlap_pct" in sc and "step/wall_ms" in sc


def test_profiler_windows_found_by_torch_tb_profiler(sample_copy):
    tbp = pytest.importorskip("torch_tb_profiler")
    from torch_tb_profiler import consts, io
    from torch_tb_profiler.plugin import TorchProfilerPlugin
    from torch_tb_profiler.profiler.loader import RunLoader

    export_tensorboard(load_run(sample_copy), traces=False)  # scalars next to the traces must not confuse it
    plugin = TorchProfilerPlugin.__new__(TorchProfilerPlugin)  # only the run discovery, no TensorBoard context
    plugin.logdir = io.abspath(str(sample_copy))
    run_dirs = list(plugin._get_run_dirs())
    assert [plugin._get_run_name(d) for d in run_dirs] == ["profiler"]
    names = sorted(p.name for p in (sample_copy / "profiler").iterdir())
    matches = [consts.WORKER_PATTERN.match(n) for n in names]
    assert all(matches)
    assert sorted({m.group(1) for m in matches}) == ["rank0", "rank1"]
    loaded = RunLoader("profiler", run_dirs[0], io.Cache()).load()
    assert set(loaded.workers) >= {"rank0", "rank1"}
    assert loaded.get_profile("rank0", loaded.get_spans("rank0")[0]) is not None
    del tbp


def test_memory_tags_are_exactly_what_the_recorder_writes():
    """The memory tags come from the categories and CudaMemory's byte fields: a step carrying every figure the
    probe writes (every category, every CUDA field) yields every listed tag and nothing else; counts and error
    strings are not scalars."""
    from fsdp_doctor import memory_categories as MC
    from fsdp_doctor.tensorboard_scalars import memory_scalars, memory_tags

    cuda = {f: 1 << 20 for f in CudaMemory.BYTE_FIELDS} | {"alloc_retries": 3, "ooms": 1, "error": "x", "snapshot_error": "y"}
    assert set(cuda) == set(msgspec.structs.asdict(CudaMemory())), "a CudaMemory field is neither bytes nor listed"
    mem = msgspec.convert({"peak": {"bytes": 5, "breakdown": {c: 1 << 20 for c in MC.DEVICE}},
                           "offloaded_host": 1 << 20, "cuda": cuda}, MemoryStep)
    written = memory_scalars(mem)
    assert set(written) == set(memory_tags())
    assert written["memory/cuda_outside_allocator_mib"] == 1.0  # once dropped by a hand-written whitelist
    assert "memory/cuda_nvml_used_mib" not in memory_tags()  # once listed, never written


def test_old_memory_dicts_decode_into_the_typed_step():
    """A step line written when ``StepRecord.memory`` was a dict (format version 1) reads as a MemoryStep."""
    from fsdp_doctor.records import record_decoder

    line = (b'{"t":"step","rank":0,"step":3,"start_ns":1,"wall_ms":9.5,"memory":{"v":1,"device":"cpu",'
            b'"categories":["sharded_params","activations"],"sampling":"replayed","samples":2,'
            b'"peak":{"bytes":30,"t_ms":1,"unit":"","phase":"forward_end","breakdown":{"sharded_params":10,'
            b'"activations":20}},"end":{"sharded_params":10,"activations":0},"offloaded_host":0,'
            b'"activations":"replayed","stale_optimizer_param_tensors":0,"saved_tensors":0,"full_every":4,'
            b'"probe_us":12.5,"probe_pack_us":0.0,"some_future_key":1}}')
    rec = record_decoder.decode(line)
    m = rec.memory
    assert isinstance(m, MemoryStep) and m.sampling == "replayed" and m.full_every == 4
    assert m.peak.bytes == 30 and m.peak.unit == "" and m.peak.t_ms == 1.0 and m.peak.breakdown["activations"] == 20
    assert m.timeline is None and m.cuda is None and m.unknown == []


def test_scalars_are_defined_once_outside_the_presenters():
    """The live writer (record side) and the export both take their scalars from fsdp_doctor.tensorboard_scalars,
    which imports neither torch nor a presenter; the live writer imports no presenter either."""
    import subprocess
    import sys

    code = ("import sys\nimport fsdp_doctor.tensorboard_scalars\n"
            "print('NEUTRAL', 'torch' in sys.modules, any(m.startswith('fsdp_doctor.present') for m in sys.modules))\n"
            "import fsdp_doctor.record.tensorboard as R\n"
            "print('LIVE', any(m.startswith('fsdp_doctor.present') for m in sys.modules))\n"
            "import fsdp_doctor.present.tensorboard as P, fsdp_doctor.tensorboard_scalars as S\n"
            "print('SAME', R.step_scalars is S.step_scalars is P.step_scalars)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.split("\n")[:3] == ["NEUTRAL False False", "LIVE False", "SAME True"], r.stdout + r.stderr
