"""Known-answer traces (tests/trace_fixtures.py): every number is fixed by construction."""

import gzip
import json

import pytest
from msgspec.structs import asdict

from fsdp_doctor.trace import analyze_traces, build_window, find_trace_files
from fsdp_doctor.trace import intervals as iv
from trace_fixtures import BASE_US, gloo_known_trace, gpu_known_trace


def rows_by(result, rank=0):
    return {(r.unit, r.collective, r.phase): r for r in result.per_unit if r.rank == rank}


# ------------------------------------------------------------------ interval arithmetic
def test_union_and_intersection():
    u = iv.union([5, 0, 2, 10, 10], [6, 3, 4, 10, 12])  # [0,4) [5,6) [10,12); empty interval dropped
    assert u[0].tolist() == [0, 5, 10] and u[1].tolist() == [4, 6, 12]
    assert iv.measure(u) == 7
    other = iv.union([3, 11], [5.5, 20])
    assert iv.intersection_measure(u, other) == pytest.approx(1 + 0.5 + 1)
    inter = iv.intersect(u, other)
    assert inter[0].tolist() == [3, 5, 11] and inter[1].tolist() == [4, 5.5, 12]
    sub = iv.subtract(u, other)
    assert iv.measure(sub) == pytest.approx(7 - 2.5)
    assert iv.overlap_each([0, 4, 9], [12, 5, 10.5], u).tolist() == [7, 0, 0.5]
    assert iv.measure(iv.union([], [])) == 0.0


# ------------------------------------------------------------------ GPU
def test_gpu_known_answer_prefetch_on(tmp_path):
    gpu_known_trace(prefetch=True).write(tmp_path / "rank0.1.pt.trace.json.gz")
    r = analyze_traces(tmp_path)
    assert r.skipped == [] and len(r.files) == 1
    pr = r.per_rank["0"]
    assert pr.device == "gpu" and pr.steps == [1, 2]  # step 3 is incomplete: dropped
    assert pr.comm_us == pytest.approx(1000.0)
    assert pr.overlap_us == pytest.approx(420.0)
    assert pr.exposed_us == pytest.approx(580.0)
    assert pr.overlap_pct == pytest.approx(42.0)
    rows = rows_by(r)
    assert set(rows) == {("layers.0", "all_gather", "forward"), ("layers.1", "all_gather", "forward"),
                         ("layers.1", "all_gather", "backward"), ("layers.1", "reduce_scatter", "backward"),
                         ("layers.0", "reduce_scatter", "backward")}
    ag0 = rows[("layers.0", "all_gather", "forward")]
    assert (ag0.count, ag0.comm_us, ag0.exposed_us) == (2, pytest.approx(200), pytest.approx(200))
    assert ag0.bytes_per_call == 4_000_000
    assert ag0.busbw_gbps == pytest.approx(4e6 * 0.5 / 100e-6 / 1e9)  # 20 GB/s
    assert ag0.slack_us == pytest.approx(-90) and ag0.held_us == pytest.approx(0)
    ag1f = rows[("layers.1", "all_gather", "forward")]
    assert ag1f.exposed_us == pytest.approx(0) and ag1f.comm_us == pytest.approx(200)
    assert ag1f.slack_us == pytest.approx(50) and ag1f.held_us == pytest.approx(50)
    assert ag1f.busbw_gbps == pytest.approx(40.0)
    ag1b = rows[("layers.1", "all_gather", "backward")]
    assert ag1b.exposed_us == pytest.approx(100) and ag1b.slack_us == pytest.approx(-120)
    rs1 = rows[("layers.1", "reduce_scatter", "backward")]
    assert rs1.exposed_us == pytest.approx(80) and rs1.slack_us is None and rs1.held_us is None
    assert rs1.bytes_per_call == 8_000_000 and rs1.busbw_gbps == pytest.approx(40.0)
    rs0 = rows[("layers.0", "reduce_scatter", "backward")]
    assert rs0.exposed_us == pytest.approx(200)
    # worst exposure first
    assert [r.exposed_us for r in r.per_unit] == sorted((x.exposed_us for x in r.per_unit), reverse=True)
    assert asdict(r.copies["0"]) == {"h2d_us": pytest.approx(100), "d2h_us": pytest.approx(40),
                                        "exposed_us": pytest.approx(100)}
    # compute stream 7: busy 650 per step, span [100, 1990)
    assert asdict(r.idle["0"]) == {"idle_us": pytest.approx(1890 - 1300), "kernel_us": pytest.approx(1300)}
    assert asdict(r.blocking["0"]) == {"count": 0, "us": 0.0}


def test_gpu_known_answer_prefetch_off(tmp_path):
    gpu_known_trace(prefetch=False).write(tmp_path / "rank0.1.pt.trace.json")
    r = analyze_traces(tmp_path / "rank0.1.pt.trace.json")
    pr = r.per_rank["0"]
    assert pr.comm_us == pytest.approx(1000.0) and pr.overlap_us == pytest.approx(220.0)
    assert pr.overlap_pct == pytest.approx(22.0)
    ag1f = rows_by(r)[("layers.1", "all_gather", "forward")]
    assert ag1f.exposed_us == pytest.approx(200) and ag1f.slack_us == pytest.approx(-100)
    assert ag1f.held_us == pytest.approx(0)
    assert r.idle["0"].kernel_us == pytest.approx(1140)


def test_gpu_two_ranks_different_event_counts_ns_and_name_rank(tmp_path):
    gpu_known_trace(rank=0).write(tmp_path / "rank0.1.pt.trace.json.gz")
    b = gpu_known_trace(rank=None, extra_unit_events=True)  # no distributedInfo: rank from the name
    b.write(tmp_path / "worker_rank-1.1.pt.trace.json.gz", ns=True)
    raw = json.loads(gzip.decompress((tmp_path / "worker_rank-1.1.pt.trace.json.gz").read_bytes()))
    assert all(isinstance(e["ts"], int) and e["ts"] > 1e15 for e in raw["traceEvents"] if "ts" in e)
    r = analyze_traces(tmp_path)
    assert set(r.per_rank) == {"0", "1"}
    assert r.per_rank["0"].overlap_pct == pytest.approx(42.0)
    p1 = r.per_rank["1"]
    assert p1.comm_us == pytest.approx(1010.0) and p1.overlap_us == pytest.approx(420.0)
    other = rows_by(r, 1)[("(other)", "all_reduce", None)]
    assert other.count == 2 and other.exposed_us == pytest.approx(10)
    # the same per-unit exposure as rank 0 for the FSDP units, despite ns timestamps
    for key, row in rows_by(r, 0).items():
        assert rows_by(r, 1)[key].exposed_us == pytest.approx(row.exposed_us)


def test_several_windows_per_rank_aggregate(tmp_path):
    gpu_known_trace(steps=(1, 2)).write(tmp_path / "profiler" / "rank0.1.pt.trace.json.gz")
    gpu_known_trace(steps=(10, 11)).write(tmp_path / "profiler" / "rank0.10.pt.trace.json.gz")
    (tmp_path / "manifest.json").write_text("{}")
    (tmp_path / "rank0.records.jsonl").write_text("{}\n")
    (tmp_path / "report.json").write_text("{}")
    assert [p.name for p in find_trace_files(tmp_path)] == ["rank0.1.pt.trace.json.gz", "rank0.10.pt.trace.json.gz"]
    r = analyze_traces(tmp_path)
    assert r.skipped == []
    pr = r.per_rank["0"]
    assert pr.steps == [1, 2, 10, 11]
    assert pr.comm_us == pytest.approx(2000) and pr.overlap_us == pytest.approx(840)
    assert rows_by(r)[("layers.0", "all_gather", "forward")].count == 4


def test_no_profiler_steps_keeps_everything(tmp_path):
    b = gpu_known_trace()
    b.events = [e for e in b.events if not e["name"].startswith("ProfilerStep")]
    b.write(tmp_path / "t.json")
    r = analyze_traces(tmp_path)
    pr = r.per_rank["0"]
    assert pr.steps == [] and pr.comm_us == pytest.approx(1500) and pr.overlap_us == pytest.approx(630)


def test_progress_callback(tmp_path):
    for k in range(3):
        gpu_known_trace(rank=k, world_size=3).write(tmp_path / f"rank{k}.json")
    seen = []
    analyze_traces(tmp_path, progress=lambda d, t: seen.append((d, t)))
    assert seen[0] == (0, 3) and seen[-1] == (3, 3)


def test_parallel_load_matches_serial(tmp_path):
    from fsdp_doctor.trace import analyze_windows, load_windows

    paths = []
    for k in range(3):
        paths.append(gpu_known_trace(rank=k, prefetch=bool(k % 2), world_size=3).write(tmp_path / f"rank{k}.json.gz"))
    import fsdp_doctor.trace.loader as an

    old = an.PARALLEL_MIN_BYTES
    an.PARALLEL_MIN_BYTES = 0
    try:
        par, _ = load_windows(paths, workers=2)
    finally:
        an.PARALLEL_MIN_BYTES = old
    ser, _ = load_windows(paths, workers=1)
    assert analyze_windows(par) == analyze_windows(ser)


# ------------------------------------------------------------------ CPU / gloo
def test_gloo_known_answer(tmp_path):
    gloo_known_trace().write(tmp_path / "rank0.5.pt.trace.json.gz")
    r = analyze_traces(tmp_path)
    pr = r.per_rank["0"]
    assert pr.device == "cpu" and pr.steps == [5, 6]
    # in collectives: the gloo events (6000) and the main thread's waits outside them (per step 300: unit 0's
    # all-gather [20,50) and [1050,1190), unit 1's [2310,2350) and its copy-out's [3350,3400), the reduce-scatter's
    # [3610,3650)), which no compute overlaps
    assert pr.comm_us == pytest.approx(6600) and pr.overlap_us == pytest.approx(2400)
    assert pr.overlap_pct == pytest.approx(100 * 2400 / 6600)
    rows = rows_by(r)
    assert set(rows) == {("0", "all_gather", "forward"), ("1", "all_gather", "forward"),
                         ("1", "reduce_scatter", "backward")}
    sync = rows[("0", "all_gather", "forward")]
    assert sync.exposed_us == pytest.approx(2000) and sync.comm_us == pytest.approx(2000)
    assert sync.slack_us == pytest.approx(20 - 1050)  # needed at issue: the host blocked
    assert sync.bytes_per_call == 800 and sync.busbw_gbps == pytest.approx(800 * 0.5 / 1000e-6 / 1e9)
    asy = rows[("1", "all_gather", "forward")]
    assert asy.exposed_us == pytest.approx(800) and asy.slack_us == pytest.approx(-350)
    assert asy.bytes_per_call is None and asy.busbw_gbps is None
    rs = rows[("1", "reduce_scatter", "backward")]
    assert rs.exposed_us == pytest.approx(800) and rs.count == 2
    assert asdict(r.blocking["0"]) == {"count": 2, "us": pytest.approx(2000)}
    assert asdict(r.idle["0"]) == {"idle_us": pytest.approx(19000 - 4400), "kernel_us": pytest.approx(4400)}
    assert asdict(r.copies["0"]) == {"h2d_us": 0.0, "d2h_us": 0.0, "exposed_us": 0.0}


def test_gloo_groups_on_a_2d_mesh(tmp_path):
    """gloo's ops name no process group: on 4 ranks of a 2 x 2 mesh (HSDP, tensor parallelism beside FSDP) FSDP's
    all-gathers and reduce-scatters run on 2, and their bus bandwidth read 1.5x (a new-user trial). An all-gather's
    group is its gathered tensor's elements over its shard's (200 / 100: 2); a collective whose trace says neither
    (an all-reduce) is over the world where every process group spans it, and not known where the trace's
    pg_config lists smaller ones. A tensor-parallel allreduce_ takes a TensorList, whose dtype its args do not
    give: its size is its gloo event's (2 x 16 x 32 floats)."""
    def trace(groups):
        b = gloo_known_trace()
        b.world_size = 4
        for i in range(3):
            T = 10000.0 * i
            b.op("c10d::allreduce_", T + 5000, 200, **{"Input Dims": [[[2, 16, 32]], [], []],
                                                       "Input type": ["TensorList", "", ""]})
            b.x("gloo:all_reduce", T + 5010, 100, cat="user_annotation", tid=200,
                **{"Input Dims": [[2, 16, 32]], "Input type": ["float"]})
        doc = b.document()
        doc["distributedInfo"] = {"backend": "gloo", "rank": 0, "world_size": 4,
                                  **({"pg_config": [{"pg_size": n} for n in groups]} if groups else {})}
        path = tmp_path / ("mesh" if groups else "flat") / "rank0.5.pt.trace.json"
        path.parent.mkdir()
        path.write_text(json.dumps(doc))
        return rows_by(analyze_traces(path.parent))

    mesh = trace([4, 2, 2])
    ag = mesh[("0", "all_gather", "forward")]
    assert ag.bytes_per_call == 800 and ag.busbw_gbps == pytest.approx(800 * (1 / 2) / 1000e-6 / 1e9)  # (not 3/4)
    (tp,) = [r for k, r in mesh.items() if k[0] == "(other)" and k[1] == "all_reduce"]
    assert tp.bytes_per_call == 2 * 16 * 32 * 4 and tp.busbw_gbps is None
    (tp,) = [r for k, r in trace(None).items() if k[0] == "(other)" and k[1] == "all_reduce"]
    assert tp.busbw_gbps == pytest.approx(4096 * (2 * 3 / 4) / 100e-6 / 1e9)


def test_gloo_collective_recorded_twice_counts_once(tmp_path):
    """Under a TorchDispatchMode (the doctor's memory high-water on a full step inside a profiler window, with
    memory={"full_every": 1}) every c10d op shows with a child of the same name. Each collective is still one call
    of its own unit: the inner op once took the next collective's gloo event (a fine-tuning run read 2 reduce-scatters
    on every other unit, none on the rest, and accum.sync_every_micro_batch fired without accumulation)."""
    gloo_known_trace().write(tmp_path / "plain" / "rank0.5.pt.trace.json.gz")
    b = gloo_known_trace()
    for e in [e for e in b.events if e["name"].startswith("c10d::")]:
        b.op(e["name"], e["ts"] - BASE_US + 2, e["dur"] - 4)
    b.write(tmp_path / "twice" / "rank0.5.pt.trace.json.gz")
    plain, twice = rows_by(analyze_traces(tmp_path / "plain")), rows_by(analyze_traces(tmp_path / "twice"))
    assert set(twice) == set(plain)
    for k, r in plain.items():
        assert (twice[k].count, twice[k].comm_us, twice[k].exposed_us) == (r.count, r.comm_us, r.exposed_us), k


def test_gloo_compute_excludes_waits_inside_operators(tmp_path):
    """A wait inside an autograd op (no child op running) is not compute; c10d children are not either."""
    b = gloo_known_trace(steps=(1,))
    b.events = [e for e in b.events if not e["name"].startswith("ProfilerStep")]
    w_path = b.write(tmp_path / "rank0.json")
    base = build_window(w_path)
    b.op("autograd::engine::evaluate_function: Outer", 5000, 2000)
    b.op("c10d::allreduce_", 5100, 1800)        # communication op inside: not compute
    b.op("aten::copy_", 5150, 100)              # nested in the c10d op: not compute either
    b.label("FSDP::post_backward_rs_wait (1)", 6950, 40)  # label self time: not compute
    w = build_window(b.write(tmp_path / "rank0b.json"))
    extra = iv.measure(w.compute) - iv.measure(base.compute)
    # the outer op's self time only: [5000,5100), [6900,6950) and [6990,7000)
    assert extra == pytest.approx(100 + 50 + 10)


def test_gloo_collectives_outside_fsdp_by_where_the_loop_issued_them(tmp_path):
    """Collectives no FSDP unit issued: a grad-norm log's two all-gathers after backward (4500-5320 µs into each
    step) have no phase, and their code's host time is 820 µs per step (code between them included), 320 of it the
    first call's own time (its wait for the other ranks, which stays without the log); an all-reduce
    issued inside optimizer.step() is the optimizer's ("optimizer"), not the loop's."""
    b = gloo_known_trace()
    for T in (0.0, 10000.0):  # steps 5 and 6
        for t in (4500, 5000):
            b.op("c10d::_allgather_base_", T + t, 50)
            b.gloo("all_gather", T + t + 20, 300, tid=202)
        b.label("Optimizer.step#AdamW.step", T + 6000, 1000)
        b.op("c10d::allreduce_", T + 6100, 50)
        b.gloo("all_reduce", T + 6120, 200, tid=202)
    b.write(tmp_path / "rank0.5.pt.trace.json.gz")
    r = analyze_traces(tmp_path)
    rows = rows_by(r)
    log, opt = rows[("(other)", "all_gather", None)], rows[("(other)", "all_reduce", "optimizer")]
    assert (log.count, opt.count) == (4, 2)
    assert log.comm_us == pytest.approx(1200) and opt.comm_us == pytest.approx(400)
    pr = r.per_rank["0"]
    assert (pr.loop_comm_ms_per_step, pr.loop_comm_wait_ms_per_step) == pytest.approx((0.82, 0.32))
    # without the log, no loop time; FSDP's own rows are as they were
    plain = analyze_traces(_written(gloo_known_trace(), tmp_path / "plain"))
    assert plain.per_rank["0"].loop_comm_ms_per_step == 0.0
    assert {k: (v.count, v.exposed_us) for k, v in rows_by(plain).items()} == \
        {k: (v.count, v.exposed_us) for k, v in rows.items() if k[0] != "(other)"}


def _written(builder, folder):
    builder.write(folder / "rank0.5.pt.trace.json.gz")
    return folder
