"""torchtitan 0.3.0, a real client (tests/titan_cases.py, 2 gloo ranks): its llama3 sharded by its own
parallelize_llama from a job config its ConfigManager parsed. The doctor leaves its training and hooks as they
were, records its units as torchtitan cut them and knows torchtitan sharded the model; a fix whose lever is a
setting of torchtitan's job config is that setting on its command line, and run as printed (the flags in place of
the same settings of the user's command line) it removes the finding, the peak the predicted one within 10%:
activation checkpointing off and on (``activation-checkpoint:none`` / ``:full``), every unit kept gathered
(``--parallelism.fsdp-reshard-after-forward never``)."""

from __future__ import annotations

import re

import pytest

from fsdp_doctor.diagnose import snippets as S
from recorder_cases import PEAK_WITHIN, fixed_pair
from test_clients import _launch
from titan_cases import TITAN_SITE, with_fix


def _case(tmp_path_factory, case: str, world: int = 2) -> list[dict]:
    if not (TITAN_SITE / "torchtitan").is_dir():
        pytest.skip(f"torchtitan is not installed in {TITAN_SITE} (make setup installs it: make titan-site)")
    return _launch(case, world, tmp_path_factory.mktemp(case), script="titan_cases.py")[0]


@pytest.fixture(scope="module")
def titan_run(tmp_path_factory):
    return _case(tmp_path_factory, "titan")


@pytest.fixture(scope="module")
def titan_fixes(tmp_path_factory):
    return _case(tmp_path_factory, "titan_fixes")


@pytest.mark.slow
def test_titan_training_unchanged_units_as_torchtitan_cut_them(titan_run):
    """Watched, torchtitan's run has the same losses and parameter shards as without the doctor, and its hooks
    are as before watch(); the units are torchtitan's (the embeddings, each block, [norm, lm_head] kept gathered
    after forward, the root), the run says torchtitan 0.3.0 sharded the model, and the optimizer read is the AdamW
    inside torchtitan's OptimizersContainer (before, its empty shell: no optimizer state at the peak), or with two
    in it (an optimizer name per parameter pattern) both of them."""
    for res in titan_run:
        assert res["identical"] and res["left"] == [] and res["errors"] == 0 and res["steps"] == 5, res
        assert (res["sharded_by"], res["version"]) == ("torchtitan", "0.3.0")
        assert res["units"] == [["", [""], False, "none"], ["tok_embeddings", ["tok_embeddings"], True, "none"],
                                *[[f"layers.{i}", [f"layers.{i}"], True, "none"] for i in range(4)],
                                # its chunked loss sets the output head's reshard_after_forward back to True after
                                # its chunks (parallelize_llama kept it gathered): what backward then finds
                                ["norm, lm_head", ["norm", "lm_head"], True, "none"]], res["units"]
        # torchtitan's OptimizersContainer, passed to watch(): its AdamW read (its groups' options, its state:
        # exp_avg and exp_avg_sq as large as the sharded parameters, and a 4-byte step per parameter tensor)
        assert res["optimizer"] == "AdamW" and res["groups"] == [
            {"lr": 0.0008, "betas": [0.9, 0.95], "eps": 1e-08, "weight_decay": 0.1}], (res["optimizer"], res["groups"])
        steady = res["steady"]
        assert steady["optimizer_state"] == 2 * steady["sharded_params"] + 4 * res["param_tensors"], steady
        # two optimizers in its container (Adam for the embeddings and lm_head, AdamW for the rest): both read
        two = res["two"]
        assert res["two_left"] == [] and two["optimizer"] == "Adam+AdamW", two
        assert two["params"] == res["param_tensors"] and two["groups"] == [[2, 0.001], [res["param_tensors"] - 2,
                                                                                        0.0008]], two
        assert two["steady"]["optimizer_state"] == 2 * two["steady"]["sharded_params"] + 4 * res["param_tensors"]


@pytest.fixture(scope="module")
def titan_default(tmp_path_factory):
    return _case(tmp_path_factory, "titan_default")


@pytest.mark.slow
def test_titan_defaults_and_loop_raise_no_false_alarm(titan_default):
    """torchtitan's defaults and its own loop (automatic GC off and a collection every 10 steps, the job's token
    count all-reduced and its gradient clipping every step), 30 steps with the doctor's defaults (a profiler
    window): the clipping's all-reduce, issued inside a norm operator, is the gradient norm's; neither it nor the
    token count is taken for removable loop code (optim.step_comm is quiet), and torchtitan's collections are not
    the user's GC jitter. gloo's synchronous unshard is the warning.

    Its chunked loss runs the output head and the cross-entropy once per chunk from the loss, between forward and
    backward: there the head's calls are the model's forward, and the rest of that loss is not the time between
    optimizer.step() and the next forward, where data loading is (before: "19% of each step is spent outside the
    model (data loading or user code)", a warning with a DataLoader fix). It also sets the head's
    reshard_after_forward back to True after its chunks, so reshard.last_unit's fix would be undone every step:
    quiet, saying why (before: an info with that fix)."""
    for res in titan_default:
        assert "prefetch.sync_unshard" in res["findings"], res["findings"].keys()
        assert "jitter.data_wait" not in res["findings"] and "reshard.last_unit" not in res["findings"]
        assert res["between_ms"] < 0.5 * res["outside_ms"], (res["between_ms"], res["outside_ms"])
        assert "torchtitan's chunked loss" in res["quiet"]["reshard.last_unit"], res["quiet"]["reshard.last_unit"]
        assert "optim.step_comm" not in res["findings"] and "jitter.gc" not in res["findings"], res["findings"].keys()
        # per profiled step the token count's all-reduce, then the clipping's; the window's two steps both used (its
        # last, complete on the CPU, was dropped as HTA drops a GPU window's last before)
        assert res["other"] == [["all_reduce", "grad_norm", 2], ["all_reduce", None, 2]], res["other"]
        assert res["sharded_by"] == "torchtitan"


@pytest.mark.slow
def test_titan_mixture_of_experts_recorded(tmp_path_factory):
    """torchtitan 0.3's Qwen3 mixture of experts keeps its routed experts under ``moe.routed_experts`` (a
    GroupedExperts inside) and top_k / num_experts on ``moe.router``: the run records them (before, only children
    named ``experts`` were read: no MoE, every expert counted as run by every token). Known answer: 2 layers of
    8 experts, each three 64x64 matrices."""
    for res in _case(tmp_path_factory, "titan_moe"):
        ex = res["experts"]
        assert (ex["top_k"], ex["num_experts"]) == (2, 8), ex
        assert ex["param_count"] == res["routed"] == 2 * 8 * 3 * 64 * 64, (ex, res["routed"])
        assert ex["trainable_param_count"] == ex["grad_path_param_count"] == ex["param_count"]
        assert 0 < ex["param_count"] < res["params"]


def _fixed(res: dict, name: str, code: str, flag: str, within: float = PEAK_WITHIN) -> tuple[dict, dict, dict]:
    """(the run ``name``, its rerun with the fix's command line, the finding): recorder_cases.fixed_pair's checks
    (the finding gone, the peak the predicted one within ``within``, no new warning) for a fix that is torchtitan's
    command line holding ``flag``, and the rerun ran it (its arguments are the user's with the fix's in place)."""
    before, after, f = fixed_pair(res, name, code, "torchtitan", "torchtitan", within)
    assert flag in f["code"].splitlines() and "torchtitan 0.3.0 sharded this model" in f["text"], f
    assert all(len(ln) <= 100 for ln in f["code"].splitlines()), f["code"]
    assert res[f"{name}_fixed_args"] == with_fix(res[f"{name}_args"], f["code"])
    assert flag in " ".join(res[f"{name}_fixed_args"]), res[f"{name}_fixed_args"]
    return before, after, f


@pytest.mark.slow
def test_titan_checkpointing_unneeded_fix_is_its_command_line(titan_fixes):
    """torchtitan's default, selective checkpointing of every block, under an ample budget: ac.unneeded's fix is
    ``activation-checkpoint:none`` on torchtitan's command line (its config_registry form beside it); run so, no
    block is checkpointed."""
    for res in titan_fixes:
        before, after, f = _fixed(res, "sel_ample", "ac.unneeded", "activation-checkpoint:none")
        assert "#   config.activation_checkpoint = None" in f["code"], f["code"]
        assert [u[1] for u in before["units"] if u[0].startswith("layers.")] == ["unit"] * 4, before["units"]
        assert after["quiet"]["ac.unneeded"] == "no unit is checkpointed", after["quiet"]
        assert after["peak"] > before["peak"], (after["peak"], before["peak"])


@pytest.mark.slow
def test_titan_checkpointing_recommended_fix_checkpoints_every_block(titan_fixes):
    """Without checkpointing, activations dominating a peak 5% under the budget: torchtitan checkpoints every block
    or none, so ac.recommended names all four and its fix is ``activation-checkpoint:full`` in place of the user's
    ``activation-checkpoint:none``; run so, every block is checkpointed and the peak falls."""
    for res in titan_fixes:
        before, after, f = _fixed(res, "tight", "ac.recommended", "activation-checkpoint:full")
        assert res["tight_fixed_args"].count("activation-checkpoint:none") == 0, res["tight_fixed_args"]
        assert "all 4 here" in f["text"], f["text"]
        assert [u[1] for u in after["units"] if u[0].startswith("layers.")] == ["unit"] * 4, after["units"]
        assert after["peak"] < 0.85 * before["peak"], (after["peak"], before["peak"])


@pytest.mark.slow
def test_titan_selective_checkpointing_near_capacity_fix_is_full(titan_fixes):
    """torchtitan's default, selective checkpointing of every block (its policy saves the matmuls' outputs), under
    a budget 5% above the peak: ac.selective_to_full names all four blocks and its fix is
    ``activation-checkpoint:full``; run so, the blocks checkpoint fully (no longer selectively), the finding is
    gone and the peak falls to the predicted one."""
    for res in titan_fixes:
        before, after, f = _fixed(res, "tight_sel", "ac.selective_to_full", "activation-checkpoint:full")
        assert "all 4 here" in f["text"], f["text"]
        assert before["quiet"]["ac.recommended"].endswith("full checkpointing would recompute instead: "
                                                          "ac.selective_to_full)"), before["quiet"]["ac.recommended"]
        layers = [u[0] for u in before["units"] if u[0].startswith("layers.")]
        assert len(layers) == 4 and before["selective"] == layers and after["selective"] == [], (before, after)
        assert [u[1] for u in after["units"] if u[0].startswith("layers.")] == ["unit"] * 4, after["units"]
        assert after["peak"] < 0.9 * before["peak"], (after["peak"], before["peak"])


@pytest.mark.slow
def test_titan_zero2_fix_is_its_resharding_setting(titan_fixes):
    """torchtitan's default resharding (every unit but [norm, lm_head]) under an ample budget: keeping all of them
    gathered fits, so reshard.zero2_affordable's fix is torchtitan's ``--parallelism.fsdp-reshard-after-forward
    never`` (before the user's subcommand), predicted for all five units; run so, none is resharded."""
    for res in titan_fixes:
        before, after, f = _fixed(res, "zero2", "reshard.zero2_affordable",
                                  "--parallelism.fsdp-reshard-after-forward never")
        assert res["zero2_fixed_args"] == ["--parallelism.fsdp-reshard-after-forward", "never",
                                           "activation-checkpoint:none"], res["zero2_fixed_args"]
        assert "all 5 here" in f["text"], f["text"]
        assert after["quiet"]["reshard.zero2_affordable"] == "no resharded unit waits for a backward all-gather"


@pytest.mark.slow
def test_titan_compiled_blocks_checkpointing(titan_fixes):
    """Blocks torchtitan compiles, each in place (the doctor's hooks inside return at once; the doctor times each
    block around its compiled call instead; no forward marks of theirs in the memory timeline, and the recompute,
    inside the compiled backward, is not seen apart).

    Full checkpointing under an ample budget: ac.unneeded quotes the recompute as the blocks' forward compute (it
    said "not measured" and predicted no step time while the blocks were not timed), and what it would add, 16x
    the input (a transformer layer's ratio; this tiny block saves 10.5x): the rerun's peak is under the prediction,
    by less than 20%.

    No checkpointing, activations dominating a peak 5% under the budget: ac.recommended checkpoints every block
    (each block's activations read from what its backward freed), and the rerun peaks at the prediction within
    10%."""
    for res in titan_fixes:
        before, after, f = _fixed(res, "compiled", "ac.unneeded", "activation-checkpoint:none", within=0.20)
        p = f["predicted"]
        assert re.search(r"during backward \(~\d+\.\d ms per step\)", f["text"]), f["text"]
        assert p["step_ms_after"] is not None and p["step_ms_after"] < p["step_ms_before"], p
        assert after["peak"] < p["peak_bytes_after"]
        assert res["compiled_fixed_args"][:3] == ["--compile.enable", "--compile.backend", "aot_eager"]
        before, after, f = _fixed(res, "tight_compiled", "ac.recommended", "activation-checkpoint:full")
        assert re.search(r"for ~\d+\.\d ms more per step \(their forward compute\)", f["text"]), f["text"]
        assert [u[1] for u in after["units"] if u[0].startswith("layers.")] == ["unit"] * 4, after["units"]
        assert after["peak"] < 0.5 * before["peak"], (after["peak"], before["peak"])


def test_titan_settings_by_version():
    """torchtitan's settings as the command line of the version that takes them; a version the table does not
    know gets none (the finding then keeps its code of the user's own and says the setting in words)."""
    code = S.titan_settings("0.3.0", fsdp_reshard_after_forward="never", activation_checkpoint="none")
    flags = [ln for ln in code.splitlines() if not ln.startswith("#")]
    assert flags == ["--parallelism.fsdp-reshard-after-forward never activation-checkpoint:none"], code
    assert "#   config.parallelism.fsdp_reshard_after_forward = 'never'" in code
    assert with_fix(["--parallelism.fsdp-reshard-after-forward", "always", "--x", "1", "activation-checkpoint:full"],
                    code) == ["--x", "1", "--parallelism.fsdp-reshard-after-forward", "never",
                              "activation-checkpoint:none"]
    # flags go before the user's subcommand, which stays where the fix has none
    assert with_fix(["--x", "1", "activation-checkpoint:full"], S.titan_settings(
        "0.3.0", fsdp_reshard_after_forward="never")) == ["--x", "1", "--parallelism.fsdp-reshard-after-forward",
                                                          "never", "activation-checkpoint:full"]
    assert S.titan_settings("0.2.1", activation_checkpoint="none") is None
    assert S.titan_settings("", activation_checkpoint="none") is None
    assert S.titan_settings("0.3.1", activation_checkpoint="selective") is None  # (not a value a fix sets)


@pytest.mark.slow
def test_titan_tensor_parallel_beside_fsdp(tmp_path_factory):
    """torchtitan's tensor parallelism beside FSDP (fsdp 2 x tp 2, 4 ranks; its sequence parallelism and
    vocab-parallel loss). The run records the mesh; each unit's elements are the model's (they add up to it: before,
    the consistency check failed, "this torch's FSDP internals may have changed") and its gathered bytes its tensor-
    parallel shard's, as each DTensor parameter's placements say; FSDP shards over 2 ranks, not 4. The trace puts
    tensor parallelism's collectives inside the model (before: "51 collectives per step outside FSDP's own", read as a
    per-parameter gradient-norm log, with a fix for one), in the verdict as model-parallel; clipping's norm stays
    clipping's. reshard.zero2_affordable's command line, run as printed, removes it at the predicted peak."""
    res = _case(tmp_path_factory, "titan_tp", world=4)
    for r in res:
        m = r["model"]
        assert (m["mesh"], m["fsdp_dims"], m["unavailable"]) == ({"fsdp": 2, "tp": 2}, 1, []), m
        assert m["header"][0] == "4 ranks (fsdp 2 × tp 2)", m["header"]
        assert sum(u[0] for u in m["units"].values()) == m["model_params"] == 229_952
        for name, (count, gathered, shard, own) in m["units"].items():
            assert [count, gathered] == m["want"][name], (name, m["units"][name], m["want"][name])
            assert own == gathered and shard in ((None,) if not count else (2,)), (name, m["units"][name])
        # a block gathers half its linear layers' 4-byte elements (split over tp 2) and its two norms (64 elements
        # each, replicated over tp) whole
        count, gathered = m["units"]["layers.0"][:2]
        assert gathered == 4 * (count - 128) // 2 + 4 * 128, m["units"]["layers.0"]
        assert m["experts_mesh"] is None and set(m["other"]) == {"model all_gather", "model reduce_scatter",
                                                                 "model all_reduce", "grad_norm all_reduce"}, m
        assert sum(n for k, n in m["other"].items() if k.startswith("model")) >= 40, m["other"]
        assert m["shares"]["model_comm"] > 5 and m["shares"]["other_comm"] < m["shares"]["model_comm"], m["shares"]
        before, after, f = fixed_pair(r, "zero2", "reshard.zero2_affordable", "torchtitan", "torchtitan")
        assert "--parallelism.fsdp-reshard-after-forward never" in f["code"], f["code"]
        assert "optim.step_comm" not in before["findings"] and "comm.bound" not in before["findings"]
        assert "tensor parallelism" in before["quiet"]["optim.step_comm"], before["quiet"]["optim.step_comm"]


@pytest.mark.slow
def test_titan_expert_parallel_beside_fsdp(tmp_path_factory):
    """torchtitan's expert parallelism beside FSDP (its Qwen3 MoE, 2 ranks: the routed experts split over ep 2 on a
    mesh of their own, efsdp 1 x ep 2; the rest fully sharded over fsdp 2). The run records the experts' mesh (the
    header: "MoE: top-2 of 8 experts (efsdp 1 × ep 2)") and no tensor-parallel mesh; each unit's elements are the
    model's and its gathered bytes what FSDP gathers (the experts' ep shard, not gathered: efsdp is 1), as the
    DTensor parameters' placements say. The experts' all-to-alls are the model's collectives (before: the loop's,
    10 per step outside FSDP's own). reshard.zero2_affordable's command line removes it at the predicted peak."""
    res = _case(tmp_path_factory, "titan_ep")
    for r in res:
        m = r["model"]
        assert (m["mesh"], m["experts_mesh"], m["unavailable"]) == ({}, {"efsdp": 1, "ep": 2}, []), m
        assert "MoE: top-2 of 8 experts (efsdp 1 × ep 2)" in m["header"], m["header"]
        assert sum(u[0] for u in m["units"].values()) == m["model_params"], m
        for name, (count, gathered, shard, own) in m["units"].items():
            assert [count, gathered] == m["want"][name], (name, m["units"][name], m["want"][name])
        # (per window: its two profiled steps, 10 all-to-alls and 2 norm all-reduces each)
        assert m["other"] == {"model all_to_all": 20, "grad_norm all_reduce": 4}, m["other"]
        before, _, f = fixed_pair(r, "zero2", "reshard.zero2_affordable", "torchtitan", "torchtitan")
        assert "optim.step_comm" not in before["findings"]


@pytest.mark.slow
def test_titan_hsdp_beside_tensor_parallel(tmp_path_factory):
    """HSDP beside tensor parallelism (torchtitan's dp_replicate 2 x fsdp 1 x tp 2, 4 ranks): the run records the
    3-D mesh, FSDP's two dims of it (a fix's mesh is mesh[("dp_replicate", "fsdp")] of it), each unit as its
    parameters' placements say and sharded over one rank (its all-gathers local copies: reshard.zero2_affordable
    and prefetch.sync_unshard are skipped, saying why; before, the second warned that the host blocks in every
    all-gather). The replicas' gradient all-reduce is FSDP's (the verdict's reduce-scatter part), tensor
    parallelism's collectives the model's."""
    res = _case(tmp_path_factory, "titan_hsdp_tp", world=4)
    for r in res:
        m = r["model"]
        assert (m["mesh"], m["fsdp_dims"]) == ({"dp_replicate": 2, "fsdp": 1, "tp": 2}, 2), m
        assert m["mesh_input"] == ("the mesh your fully_shard calls pass: [('dp_replicate', 'fsdp')] of your "
                                   "dp_replicate 2 × fsdp 1 × tp 2 mesh"), m["mesh_input"]
        for name, (count, gathered, shard, own) in m["units"].items():
            assert [count, gathered] == m["want"][name] and shard in (None, 1), (name, m["units"][name])
        assert "zero2_fixed" not in r and not {"reshard.zero2_affordable", "prefetch.sync_unshard"} & set(
            r["zero2"]["findings"]), r["zero2"]["findings"].keys()
        assert m["shares"]["reducescatter"] > 0 and m["shares"]["other_comm"] < 3, m["shares"]
        assert {k.split()[0] for k in m["other"]} == {"model", "grad_norm"}, m["other"]


def test_titans_flex_attention_keeps_the_doctors_modes_aside(monkeypatch):
    """torchtitan 0.3.0's FlexAttention holds torch.compile(flex_attention) on its class (``_compiled_flex_attn``,
    called as ``FlexAttention._compiled_flex_attn``): under the doctor's dispatch modes that compile would raise
    (fullgraph), so a model holding one keeps the memory high-water and the FLOP count off, saying why; its SDPA
    attention holds none."""
    import torch.nn as nn

    from fsdp_doctor.record.units import compile_blocker

    if not (TITAN_SITE / "torchtitan").is_dir():
        pytest.skip(f"torchtitan is not installed in {TITAN_SITE} (make setup installs it: make titan-site)")
    monkeypatch.syspath_prepend(str(TITAN_SITE))
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    flex = nn.Sequential(nn.Linear(4, 4), FlexAttention(FlexAttention.Config()))
    assert compile_blocker(flex) == "compiled functions in the model: not counted"
    assert compile_blocker(nn.Sequential(nn.Linear(4, 4), ScaledDotProductAttention(
        ScaledDotProductAttention.Config()))) is None


@pytest.mark.slow
def test_titan_chunked_loss_temporaries_fix_is_more_chunks(titan_fixes):
    """torchtitan's chunked loss (its ChunkedLossWrapper, 2 chunks on the user's command line) over an 8,192-token
    vocabulary, each chunk's logits filling a peak 5% under the budget: memory.temporaries places the peak in the
    loss (a chunk's backward through lm_head alone leaves the loss phase open), says the loss is chunked already
    (never advising a chunked loss) and raises the chunks on torchtitan's command line to a number that divides the
    sequence (twice as many raised "sequence length must be divisible by num_chunks" when pasted); run so, the
    finding is gone and the peak is the predicted one."""
    for res in titan_fixes:
        # twice the chunks, 4, would not divide the 130-token sequences (torchtitan raises): 5 chunks of 26 tokens
        before, after, f = _fixed(res, "tight_chunks", "memory.temporaries", "--loss.num-chunks 5")
        assert res["tight_chunks_fixed_args"][:2] == ["--loss.num-chunks", "5"], res["tight_chunks_fixed_args"]
        assert "in 2 chunks already" in f["text"] and "Liger" not in f["text"], f["text"]
        assert "5 divides the sequence length, 130 tokens" in f["text"], f["text"]
        assert "#   config.loss.num_chunks = 5" in f["code"], f["code"]
        assert after["peak"] < 0.8 * before["peak"], (after["peak"], before["peak"])
        # read from the head's forward calls (3, then 6, of [norm, lm_head] for one pass), as compare reads them
        assert (before["loss_chunks"], after["loss_chunks"]) == (2, 5)


@pytest.mark.slow
def test_titan_foreach_optimizer_at_the_peak_is_fused_on_its_command_line(titan_fixes):
    """torchtitan's optimizer with --optimizer.implementation foreach, its step holding a peak 5% under the budget:
    optim.foreach_temporaries' fix is torchtitan's own setting, 'fused' (its default), on the command line after
    the user's; run so, the finding is gone and the peak is the predicted one (a new-user trial: 58.81 -> 55.35 MiB,
    predicted 55.35, losses equal)."""
    for res in titan_fixes:
        before, after, f = _fixed(res, "tight_foreach", "optim.foreach_temporaries", "--optimizer.implementation fused")
        assert "#   config.optimizer.implementation = 'fused'" in f["code"], f["code"]
        assert after["peak"] < before["peak"], (after["peak"], before["peak"])


@pytest.mark.parametrize("setting, value, field", [
    ("optimizer_implementation", "fused", ("optimizer", "implementation")),
    ("loss_num_chunks", 22, ("loss", "num_chunks"))])
def test_titan_settings_command_lines_parse_as_torchtitan_reads_them(setting, value, field, monkeypatch):
    """Each fix on torchtitan's command line (optim.foreach_temporaries' implementation, memory.temporaries' chunks)
    is parsed by torchtitan 0.3.0's own ConfigManager after the user's arguments, last wins: the job config then
    holds the fix's value."""
    from titan_cases import job_config

    if not (TITAN_SITE / "torchtitan").is_dir():
        pytest.skip(f"torchtitan is not installed in {TITAN_SITE}")
    monkeypatch.syspath_prepend(str(TITAN_SITE))
    code = S.titan_settings("0.3.0", **{setting: value})
    (line,) = [ln for ln in code.splitlines() if ln.startswith("--")]
    config = job_config(["--optimizer.implementation", "foreach", "--loss.num-chunks", "8", *line.split()])
    assert getattr(getattr(config, field[0]), field[1]) == value, (line, config)


def test_titan_gc_fix_is_its_trainers_own_period(monkeypatch):
    """torchtitan's Trainer turns the collector off and collects between steps itself, every training.gc_freq steps
    (every step under training.gc_debug): jitter.gc's explicit-collections fix there, a collect_between_steps its user
    has no loop to call from, is that period on the command line now, gc_debug off; parsed by torchtitan 0.3.0's own
    ConfigManager after the user's arguments, the job config holds it. (Its collections on this CPU, generation 1
    every step at gc_freq 1, took 0.1% of the step: the rule stayed quiet, so no run plants it here.)"""
    from fsdp_doctor.report_sections import Recommendation
    from titan_cases import job_config

    if not (TITAN_SITE / "torchtitan").is_dir():
        pytest.skip(f"torchtitan is not installed in {TITAN_SITE}")
    monkeypatch.syspath_prepend(str(TITAN_SITE))
    rec = Recommendation(text="Call it less often.", code=S.complete(S.gc_collect_every(20)), where="optimizer")
    S.for_titan_trainer(rec, "jitter.gc", "0.3.0")
    assert rec.where == "torchtitan" and rec.text.endswith(S.TITAN_GC), rec
    (line,) = [ln for ln in rec.code.splitlines() if ln.startswith("--")]
    assert line == "--training.gc-freq 20 --training.no-gc-debug", rec.code
    config = job_config(["--training.gc-freq", "1", "--training.gc-debug", *line.split()])
    assert (config.training.gc_freq, config.training.gc_debug) == (20, False), config.training
    # the collector on (set-up frozen and the collector off, as a loop of the user's own would): the Trainer's own
    # collections every gc_freq steps stay, its hook freezes set-up and defines no function nothing calls
    rec = Recommendation(text="Freeze.", code=S.complete(S.gc_between_steps(50)), where="optimizer")
    S.for_titan_trainer(rec, "jitter.gc", "0.3.0")
    assert rec.where == "titan_registry" and "gc.freeze()" in rec.code and "collect_between_steps" not in rec.code
