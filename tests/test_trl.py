"""TRL's SFTTrainer and DPOTrainer recorded by fsdp_doctor.DoctorCallback on 2 gloo ranks, as their users run them
(tests/trl_cases.py; the long tier: two real runs of each)."""

from __future__ import annotations

import pytest

from test_clients import _launch
from titan_cases import TITAN_SITE
from trl_cases import MICRO, TRL_SITE

from fsdp_doctor.diagnose.rules.optim import PER_TENSOR_CALLS_MIN


def _case(tmp_path_factory, case: str) -> list[dict]:
    """Each rank's RESULT of tests/trl_cases.py's ``case`` on 2 gloo ranks."""
    if not (TRL_SITE / "trl").is_dir() or not (TITAN_SITE / "datasets").is_dir():
        pytest.skip(f"TRL is not installed in {TRL_SITE} or datasets in {TITAN_SITE} (make setup installs them)")
    return _launch(case, 2, tmp_path_factory.mktemp(f"trl_{case}"), script="trl_cases.py")[0]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    return _case(tmp_path_factory, "sft")


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
            assert f["code"] == "" and "TRL's trainer (trl.SFTConfig) gathers" in f["text"], f
        else:
            why = before["quiet"]["optim.step_comm"]
            assert "one collective per tensor" not in why, why
            assert why.startswith("exposed collectives outside FSDP") or "TRL's trainer (trl.SFTConfig)" in why, why


def test_sft_trainers_sync_unshard_fix_is_a_callback_that_works(sft_run):
    """prefetch.sync_unshard's fix under TRL's trainer is the Trainer callback (trainer.add_callback before train()):
    pasted as printed into a new SFTTrainer, the rule is quiet, no other warning appears, and the losses are the
    same."""
    for res in sft_run:
        before, after = res["sft"], res["sft_fixed"]
        f = before["findings"]["prefetch.sync_unshard"]
        assert f["where"] == "trainer" and "trainer.add_callback(DoctorFix())" in f["code"], f
        assert "prefetch.sync_unshard" not in after["findings"], after["findings"].keys()
        assert not [c for c, g in after["findings"].items() if g["severity"] != "info"], after["findings"]
        assert after["losses"] == before["losses"] and len(before["losses"]) == 10, (before["losses"], after["losses"])


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory):
    return _case(tmp_path_factory, "dpo")


def test_dpo_reference_sharded_whole_by_trl_is_found_and_its_fix_shards_its_blocks(dpo_run):
    """TRL's DPOTrainer shards the reference model it builds with one fully_shard call (prepare_fsdp: no wrap policy
    under FSDP2): each reference forward gathers the whole model. wrap.reference_one_unit says so, with the reference's
    size, and its fix builds the reference as TRL does, shards it block by block as the policy, and passes it:
    pasted as printed (with the policy built), TRL leaves it as it is, the rule is quiet, no other warning appears and
    the losses (the reference's log-probabilities in each) are the same."""
    for res in dpo_run:
        before, after = res["dpo"], res["dpo_fixed"]
        # (FSDPModules: 4 layers, the embedding, the norm and head of one unit, the root; the rule counts 7 units)
        assert before["reference_units"] == 1 and after["reference_units"] == 8, (before, after)
        f = before["findings"]["wrap.reference_one_unit"]
        assert f["where"] == "trl_reference" and "ref_model = AutoModelForCausalLM.from_pretrained(" in f["code"], f
        assert "for block in ref_model.model.layers.children():" in f["code"], f["code"]
        assert "each reference forward all-gathers all of its parameters at once" in f["text"], f["text"]
        assert max(map(len, f["code"].splitlines())) <= 80, f["code"]
        assert "wrap.reference_one_unit" not in after["findings"], after["findings"].keys()
        assert after["quiet"]["wrap.reference_one_unit"].startswith("7 FSDP2 units of another model"), after["quiet"]
        assert not {c for c, g in after["findings"].items() if g["severity"] != "info"} - set(before["findings"])
        assert after["losses"] == before["losses"] and len(before["losses"]) == 10, (before["losses"], after["losses"])
        # the loss code's gathers between the passes (TRL's DPO metrics, after the reference's forward): no norm log
        assert "dist.all_reduce(total)" not in before["findings"].get("optim.step_comm", {}).get("code", "")
