"""TRL's SFTTrainer recorded by fsdp_doctor.DoctorCallback on 2 gloo ranks, as its user runs it (tests/trl_cases.py;
the long tier: two real runs)."""

from __future__ import annotations

import pytest

from test_clients import _launch
from titan_cases import TITAN_SITE
from trl_cases import MICRO, TRL_SITE

from fsdp_doctor.diagnose.rules.optim import PER_TENSOR_CALLS_MIN


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    if not (TRL_SITE / "trl").is_dir() or not (TITAN_SITE / "datasets").is_dir():
        pytest.skip(f"TRL is not installed in {TRL_SITE} or datasets in {TITAN_SITE} (make setup installs them)")
    return _launch("sft", 2, tmp_path_factory.mktemp("trl"), script="trl_cases.py")[0]


def test_sft_trainers_metric_gathers_are_its_loss_codes_not_a_grad_norm_log(sft_run):
    """SFTTrainer's compute_loss gathers 4 metrics over the ranks at every micro-batch (the token counts, entropy,
    accuracy), between the forward and its backward; the Trainer's loop 3 more around the passes and clipping its total
    norm. optim.step_comm read the 11 a step as one collective per tensor, "a gradient-norm log", and offered its
    per-parameter norm code for a loop the user does not write. The trace now marks the 8 between the passes as the
    loss's code's (phase "loss"); the rule counts only those around the passes as a possible per-tensor log, and says
    what TRL's do (its arguments' class recorded: trl.SFTConfig)."""
    for res in sft_run:
        before = res["sft"]
        assert before["trainer_args"] == "trl.SFTConfig", before["trainer_args"]
        other = {(c, p): n for c, p, n in before["other"]}
        assert other[("all_gather", "loss")] == 4 * MICRO, before["other"]
        assert other[("all_reduce", "grad_norm")] == 1, before["other"]
        around = sum(n for (c, p), n in other.items() if p is None)
        assert 0 < around <= PER_TENSOR_CALLS_MIN, before["other"]
        f = before["findings"].get("optim.step_comm")
        if f is not None:  # (its exposure near the rule's 2% of the step: a finding or quiet, by the host's load)
            assert f["code"] == "" and "TRL's trainer (trl.SFTConfig)" in f["text"], f
        else:
            why = before["quiet"]["optim.step_comm"]
            assert "one collective per tensor" not in why, why
            assert why.startswith("exposed collectives outside FSDP") or "TRL's trainer (trl.SFTConfig)" in why, why


def test_sft_trainers_sync_unshard_fix_is_a_callback_that_works(sft_run):
    """prefetch.sync_unshard's fix under TRL's trainer is the Trainer callback (trainer.add_callback before train()):
    pasted as printed into a new SFTTrainer, the rule is quiet, no other warning appears, and the losses are the same."""
    for res in sft_run:
        before, after = res["sft"], res["sft_fixed"]
        f = before["findings"]["prefetch.sync_unshard"]
        assert f["where"] == "trainer" and "trainer.add_callback(DoctorFix())" in f["code"], f
        assert "prefetch.sync_unshard" not in after["findings"], after["findings"].keys()
        assert not [c for c, g in after["findings"].items() if g["severity"] != "info"], after["findings"]
        assert after["losses"] == before["losses"] and len(before["losses"]) == 10, (before["losses"], after["losses"])
