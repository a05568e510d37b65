"""Real CPU/gloo FSDP2 runs of the reference workload, profiled with plain torch.profiler."""

from pathlib import Path

import pytest

from fsdp_doctor.trace import analyze_traces
from trace_fixtures import ProfileWindow

workloads = pytest.importorskip("fsdp_doctor.workloads")

pytestmark = pytest.mark.slow


def _all_gather_overlap_pct(result, rank):
    rows = [r for r in result.per_unit if r.rank == rank and r.collective == "all_gather"]
    comm = sum(r.comm_us for r in rows)
    exposed = sum(r.exposed_us for r in rows)
    return 100.0 * (comm - exposed) / comm, rows


def _profile(tmp_path, async_unshard):
    hook = ProfileWindow(tmp_path, warmup=1, active=3)
    cfg = workloads.WorkloadConfig(steps=hook.steps_needed(), async_unshard=async_unshard, d_model=256,
                                   n_layers=4, seq_len=128)
    workloads.launch(cfg, nproc=2, on_step=hook, timeout_s=120)
    return analyze_traces(tmp_path)


@pytest.mark.parametrize("async_unshard", [False, True], ids=["sync", "async"])
def test_gloo_all_gather_overlap(tmp_path, async_unshard):
    r = _profile(tmp_path, async_unshard)
    assert r.skipped == [] and len(r.files) == 2
    assert sorted(r.per_rank) == ["0", "1"]
    for rank in (0, 1):
        pr = r.per_rank[str(rank)]
        assert pr.device == "cpu" and len(pr.steps) == 3 and pr.comm_us > 0  # the window's last step whole too
        pct, rows = _all_gather_overlap_pct(r, rank)
        units = {row.unit for row in rows}
        assert {"layers.0", "layers.1", "layers.2", "layers.3"} <= units or len(units) >= 4, units
        assert {row.phase for row in rows} == {"forward", "backward"}
        assert all(row.slack_us is not None for row in rows)
        rs = [x for x in r.per_unit if x.rank == rank and x.collective == "reduce_scatter"]
        assert rs and all(x.phase == "backward" for x in rs)
        blocking = r.blocking[str(rank)]
        n_ag = sum(row.count for row in rows)
        if async_unshard:
            assert pct > 10.0, pct
            assert blocking.count < n_ag / 2
        else:
            assert pct < 5.0, pct
            assert blocking.count >= n_ag - 1  # the host sat in (nearly) every all-gather


def _run(out, wrap):
    """A tiny 2-rank gloo run wrapped by ``wrap``, profiled for 2 steps (both complete: the schedule saved the window
    as its last step ended): ``out`` holds its traces."""
    out.mkdir()
    hook = ProfileWindow(out, warmup=1, active=2)
    cfg = workloads.WorkloadConfig(steps=hook.steps_needed(), wrap=wrap, d_model=32, n_layers=2, n_heads=2,
                                   seq_len=16, vocab=64, batch_size=2)
    workloads.launch(cfg, nproc=2, on_step=hook, timeout_s=120)
    return out


def test_traces_of_two_runs_with_other_wrapping_are_not_read_as_one_job(tmp_path):
    """Rank 0's trace from a run of 4 FSDP units, rank 1's from a run wrapping the whole model as one (the same
    world size, seconds apart): rank 1's file is skipped, named with both unit sets; rank 0 is analysed alone."""
    from fsdp_doctor.report_sections import SkippedFile

    block, whole = _run(tmp_path / "block", "block"), _run(tmp_path / "whole", "whole")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "rank0.3.pt.trace.json.gz").write_bytes((block / "rank0.3.pt.trace.json.gz").read_bytes())
    (mixed / "rank1.3.pt.trace.json.gz").write_bytes((whole / "rank1.3.pt.trace.json.gz").read_bytes())
    for run in (block, whole):  # each run alone is one job
        assert analyze_traces(run).skipped == []
    r = analyze_traces(mixed)
    assert r.skipped == [SkippedFile(
        file="rank1.3.pt.trace.json.gz",
        error="another job (its step 1's FSDP units: 1, named (root); the other files': 4, named [tok_emb, pos_emb], "
              "layers.0, layers.1, [norm, lm_head]); skipped")]
    assert list(r.per_rank) == ["0"] and r.per_rank["0"].steps == [1, 2]
    assert [u.name for u in r.units] == ["tok_emb, pos_emb", "layers.0", "layers.1", "norm, lm_head"]


@pytest.mark.parametrize("accum_no_sync", [None, True, False], ids=["no_accum", "accum_no_sync", "accum_syncs"])
def test_whole_run_profile_steps_are_its_optimizer_steps(tmp_path, accum_no_sync):
    """A profile without a schedule (``export_chrome_trace`` of the whole loop) has no ProfilerStep markers: it was
    read as one step, and a new-user trial's 5 plain steps read as "5 reduce-scatters per unit per optimizer step:
    gradient accumulation syncs every micro-batch" (a warning on the gzipped copy), and a run that accumulated with
    sync off as 2 per step. Its steps are now its optimizer.step() calls', from one call's end to the next (the step
    the profile started in left out): 3 complete steps of 4 recorded here, 1 reduce-scatter per unit per step
    without accumulation or with sync off, 2 with accumulation over 2 micro-batches syncing each."""
    from fsdp_doctor import build_report, load_run
    from trace_fixtures import WholeRunProfile

    hook = WholeRunProfile(tmp_path, steps=4)
    knobs = {} if accum_no_sync is None else {"grad_accum": 2, "accum_no_sync": accum_no_sync}
    cfg = workloads.WorkloadConfig(steps=hook.steps_needed(), d_model=32, n_layers=2, n_heads=2, seq_len=16, vocab=64,
                                   batch_size=2, async_unshard=True, **knobs)
    workloads.launch(cfg, nproc=2, on_step=hook, timeout_s=120)
    report = build_report(load_run(tmp_path))
    ov = report.overlap
    assert ov.skipped == [] and sorted(ov.per_rank) == ["0", "1"]
    for pr in ov.per_rank.values():
        assert pr.step_count == 3 and len(pr.steps) == 3, (pr.step_count, pr.steps)
    want = 2.0 if accum_no_sync is False else 1.0
    rs = [r for r in ov.per_unit if r.collective == "reduce_scatter" and r.unit not in ("(other)", None)]
    assert rs and {r.count_per_step for r in rs} == {want}, [(r.rank, r.unit, r.count_per_step) for r in rs]
    codes = {f.code for f in report.findings}
    assert ("accum.sync_every_micro_batch" in codes) == (accum_no_sync is False), codes


def test_the_window_tensorboard_handler_writes_at_exit_is_named_not_read_as_a_step(tmp_path):
    """torch.profiler as its tutorial has it (schedule(wait=1, warmup=1, active=2), tensorboard_trace_handler) over 6
    steps: at the stop the second cycle had begun, and the handler wrote one more file per rank with one ProfilerStep
    marker (#6, 50 µs) and nothing else. A new-user trial's report read it as a step (2 steps a rank, p50 halved, the
    units' calls 0.5 a step), and alone it read "host-bound 100% of the step". Each such file is named in a note and
    left out now (not a skipped input: a normal part of the folder); alone, it is one line and no report."""
    from fsdp_doctor import build_report, load_run
    from fsdp_doctor.pipeline import unusable_reason
    from trace_fixtures import TensorBoardProfile

    hook = TensorBoardProfile(tmp_path, steps=6)
    cfg = workloads.WorkloadConfig(steps=hook.steps_needed(), d_model=32, n_layers=2, n_heads=2, seq_len=16, vocab=64,
                                   batch_size=2, async_unshard=True)
    workloads.launch(cfg, nproc=2, on_step=hook, timeout_s=120)
    report = build_report(load_run(tmp_path))
    ov = report.overlap
    assert ov.skipped == [] and report.problems == []
    ends = ov.exit_windows
    assert len(ends) == 2 and all("nothing ran in its profiler step (#6)" in s.error for s in ends)
    assert [n for n in report.run.notes if "(#6)" in n] == [
        f"{', '.join(s.file for s in ends)}: {ends[0].error}"]
    assert {r: pr.steps for r, pr in ov.per_rank.items()} == {"0": [2, 3], "1": [2, 3]}
    assert {r.count_per_step for r in ov.per_unit if r.collective == "all_gather" and r.unit != "(other)"} == {1.0}
    tail = tmp_path / Path(ends[0].file).name
    alone = load_run(tail)
    why = unusable_reason(tail, alone, build_report(alone))
    assert why is not None and "nothing ran in its profiler step (#6)" in why, why


def test_roots_without_the_model_sharded_are_found_in_a_plain_trace(tmp_path):
    """fully_shard on the blocks and not the model (the workload's "no_root"), profiled with plain torch.profiler: a
    new-user trial's report read one "(root)" unit called once per block and "No findings". Each root runs
    FSDP::root_pre_forward once a forward: 2 of them here (the 2 blocks; the embeddings and head stay replicated),
    and wrap.root_not_sharded says so with the records' fix (the one line the scenario matrix pastes
    and reruns on five model trees). With the model sharded: one root, quiet."""
    from fsdp_doctor import build_report, load_run
    from fsdp_doctor.diagnose import snippets as S

    none = build_report(load_run(_run(tmp_path / "no_root", "no_root")))
    assert {pr.roots_per_forward for pr in none.overlap.per_rank.values()} == {2.0}
    (f,) = [f for f in none.findings if f.code == "wrap.root_not_sharded"]
    assert f.severity == "warning" and f.evidence["roots_per_forward"] == 2.0
    assert f.recommendation.code.endswith(f"{S.root_mesh(None)}\nfully_shard(model, mesh=mesh)  # the root: manages "
                                          "the rest and drives lazy init"), f.recommendation.code
    one = build_report(load_run(_run(tmp_path / "block", "block")))
    assert {pr.roots_per_forward for pr in one.overlap.per_rank.values()} == {1.0}
    assert "wrap.root_not_sharded" not in {f.code for f in one.findings}


def test_plain_gloo_trace_of_pasted_prefetch_points_at_the_synchronous_unshard(tmp_path):
    """A new-user trial pasted prefetch.exposed_allgather's fix (explicit forward prefetch) into its gloo run with the
    default synchronous unshard and profiled it with plain torch.profiler: the report printed the same finding and fix
    again. A real 2-rank run so: the trace holds the FSDP::forward_prefetch labels and the host sat in (nearly) every
    all-gather; prefetch.sync_unshard fires from the trace with the async fix, and prefetch.exposed_allgather offers
    no prefetch fix (quiet)."""
    from fsdp_doctor import build_report, load_run

    hook = ProfileWindow(tmp_path, warmup=1, active=3)
    cfg = workloads.WorkloadConfig(steps=hook.steps_needed(), async_unshard=False, forward_prefetch=1, d_model=64,
                                   n_layers=3, n_heads=2, seq_len=32, vocab=64, batch_size=2)
    workloads.launch(cfg, nproc=2, on_step=hook, timeout_s=120)
    rep = build_report(load_run(tmp_path))
    ov = rep.overlap
    assert ov.skipped == [] and sorted(ov.per_rank) == ["0", "1"]
    for pr in ov.per_rank.values():  # each block prefetches the next
        assert pr.forward_prefetched == ["layers.1", "layers.2"]
    n_ag = sum(r.count for r in ov.per_unit if r.collective == "all_gather")
    blocked = sum(b.count for b in ov.blocking.values())
    assert n_ag > 0 and blocked >= n_ag - 2, (blocked, n_ag)
    found = {f.code: f for f in rep.findings}
    assert "_set_unshard_async_op(True)" in found["prefetch.sync_unshard"].recommendation.code
    assert "prefetch.exposed_allgather" not in found
    status = {r.code: r for r in rep.rules}["prefetch.exposed_allgather"]
    assert status.status == "quiet"
