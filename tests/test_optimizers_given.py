"""Optimizers given to watch() beyond one torch Optimizer. Several stepped one after the other in the loop (Muon
beside AdamW) as a list: each timed, their states counted. An optimizer stepped inside the backward (torchtune's optimizer_in_bwd: each parameter's own optimizer, stepped by a
post-accumulate-grad hook as FSDP2 reduce-scatters its gradient) given to watch() as the map of them that torchtune's
recipe keeps (self._optim_ckpt_wrapper.optim_map): their state is the optimizer state, their steps' time the
optimizer's, out of the backward's, and training is unchanged. Given None (the README's earlier advice), the state
went unseen: the peak of the trial below read 7.98 MiB with 2.31 MiB of AdamW's moments missing, and the header now
says why and what to pass."""

from __future__ import annotations

from pathlib import Path

import pytest

import fsdp_doctor
from fsdp_doctor.present.fmt import optimizer_fact
from test_clients import _launch

#: torchtune 0.6.1's full_finetune_distributed with optimizer_in_bwd: True (tests/test_torchtune_words.py's recipe,
#: 2 gloo ranks, a 2-layer Llama-2-shaped decoder, activation checkpointing, chunked output loss, 14 steps, a profiler
#: window at steps 6-7), watched with watch(self._model, self._optim_ckpt_wrapper, ...) (the README's line gives it
#: where the recipe has it), doctor.step() before self.global_step += 1
RUN = Path(__file__).resolve().parents[1] / "traces" / "cpu" / "torchtune_optimizer_in_bwd"


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("optimizers")
    return _launch("optimizers", 2, out, script="recorder_cases.py")[0], out


@pytest.mark.slow
def test_watched_with_the_map_training_unchanged_state_and_time_counted(launched):
    results, tmp_path = [r["in_backward"] for r in launched[0]], launched[1]
    for rank, res in enumerate(results):
        for given in ("wrapper", "none"):
            got = res[given]
            assert got["identical"] and got["left"] == [], (rank, given, got)
        got = res["wrapper"]
        assert got["optimizers"] == 29 and got["in_backward_steps"] == 5 * 29, got  # each parameter's, each step
    run = fsdp_doctor.load_run(tmp_path / "wrapper")
    report = fsdp_doctor.build_report(run)
    assert optimizer_fact(report.run) == "AdamW in backward (29 per-parameter optimizers)"
    for rank, rd in run.ranks.items():
        # the state as the optimizers hold it, to the byte, at the peak and between steps
        want = results[int(rank)]["wrapper"]["state_bytes"]
        mr = report.memory.per_rank[str(rank)]
        assert mr.peak_breakdown["optimizer_state"] == mr.steady_bytes["optimizer_state"] == want, (rank, want)
        assert all(s.optimizer_ms > 0 and s.backward_ms > 0 for s in rd.steps), [s.optimizer_ms for s in rd.steps]
    assert not [f.code for f in report.findings if f.code.startswith(("optim.", "memory."))]
    # given None: the state not counted, and the header says why
    none = fsdp_doctor.load_run(tmp_path / "none")
    assert none.config.optimizer is None and none.config.optimizer_in_backward == 0
    note = next(n for n in none.config.measured_notes if "post-accumulate-grad hooks" in n)
    assert "29 parameter(s)" in note and "self._optim_ckpt_wrapper" in note, note
    assert fsdp_doctor.build_report(none).memory.per_rank["0"].peak_breakdown["optimizer_state"] == 0


def test_recorded_torchtune_run_counts_adamws_state_and_time():
    run = fsdp_doctor.load_run(RUN)
    cfg = run.config
    assert (cfg.optimizer, cfg.optimizer_in_backward, cfg.optimizer_params) == ("AdamW", 21, 21)
    # 21 one-parameter groups with the same options read as the one group they make
    assert [g.params for g in cfg.optimizer_groups] == [21], cfg.optimizer_groups
    report = fsdp_doctor.build_report(run)
    assert optimizer_fact(report.run) == "AdamW in backward (21 per-parameter optimizers)"
    for rank, mr in report.memory.per_rank.items():
        bd = mr.peak_breakdown
        # AdamW's two moments of each fp32 shard, and its step, a 4-byte scalar, per parameter
        assert bd["optimizer_state"] == 2 * bd["sharded_params"] + 4 * 21, (rank, bd)
        assert bd["sharded_grads"] == 0, bd  # each stepped and zeroed as it was reduced
    phases = report.steps.job.phases_p50_ms
    assert phases["optimizer"] > 1.0 and phases["backward"] > phases["optimizer"], phases
    steps = run.ranks[0].steps
    assert all(s.optimizer_ms > 0 for s in steps), [s.optimizer_ms for s in steps]
    fired = {f.code for f in report.findings}
    assert fired == {"wrap.params_in_root", "reshard.last_unit", "prefetch.sync_unshard",
                     "prefetch.exposed_allgather"}, fired


@pytest.mark.slow
def test_two_optimizers_stepped_in_the_loop_watched_as_a_list(launched):
    """Muon on the blocks' matrices beside AdamW on the rest, each stepped in the loop (a new-user trial's list of two
    optimizers was refused: "pass the one each step ends with", the other's state then uncounted): both timed, one
    step record per loop step, both states counted to the byte, training unchanged, nothing left behind."""
    results, out = [r["two"] for r in launched[0]], launched[1]
    for rank, res in enumerate(results):
        assert res["identical"] and res["left"] == [], (rank, res)
        assert (res["optimizer_steps"], res["steps"]) == (2 * 5, 5), res
    run = fsdp_doctor.load_run(out / "two")
    assert run.config.optimizer == "Muon+AdamW" and run.config.optimizer_params == 29, run.config.optimizer
    report = fsdp_doctor.build_report(run)
    for rank, rd in run.ranks.items():
        want = results[int(rank)]["state_bytes"]
        mr = report.memory.per_rank[str(rank)]
        assert mr.steady_bytes["optimizer_state"] == want, (rank, mr.steady_bytes, want)
        assert all(s.optimizer_ms > 0 for s in rd.steps), [s.optimizer_ms for s in rd.steps]
    assert not [f.code for f in report.findings if f.code.startswith(("optim.", "memory."))]


@pytest.mark.slow
def test_watch_on_rank_0_only_leaves_the_other_rank_training(launched):
    """``if rank == 0: watch(...)``: the doctor's entry made a collective (all_gather_object) that met the other
    rank's FSDP all-gather, and both ranks crashed ("Received data size doesn't match expected size"). Rank 0's
    run id now goes through the job's store: both ranks train as without the doctor, rank 0's steps are recorded, and
    the reader says rank 1's records are missing, watch() perhaps run on some ranks only."""
    results, out = [r["rank0_only"] for r in launched[0]], launched[1]
    for rank, res in enumerate(results):
        assert res["identical"] and res["ranks"] == [0] and res["world_size"] == 2 and res["steps"] == 5, (rank, res)
    problems = fsdp_doctor.build_report(fsdp_doctor.load_run(out / "rank0")).problems
    assert any("rank 1 is not analysed" in ln and "watch() ran on some ranks only" in ln for ln in problems), problems
