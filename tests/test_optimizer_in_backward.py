"""An optimizer stepped inside the backward (torchtune's optimizer_in_bwd: each parameter's own optimizer, stepped by a
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


@pytest.mark.slow
def test_watched_with_the_map_training_unchanged_state_and_time_counted(tmp_path):
    results, _ = _launch("in_backward", 2, tmp_path, script="recorder_cases.py")
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
