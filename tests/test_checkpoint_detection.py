"""Functional activation checkpointing inside a unit (``checkpoint(self.mlp, h)`` in a block's forward) is
detected at run time and its recompute timed, like a checkpoint_wrapper on the block's children; training is
unchanged. Real FSDP2 runs on one gloo rank (tests/checkpoint_cases.py)."""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    env = {**os.environ, "CHECKPOINT_CASES_DIR": str(tmp_path_factory.mktemp("ckpt"))}
    r = subprocess.run([sys.executable, str(REPO / "tests" / "checkpoint_cases.py")], capture_output=True,
                       text=True, timeout=300, cwd=REPO, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_functional_checkpoint_of_a_submodule_reads_children_and_its_recompute_is_timed(cases):
    c = cases["children"]
    assert c["errors"] == []
    assert c["checkpoint"] == {"": "none", "layers.0": "children", "layers.1": "children", "layers.2": "children"}
    for i in range(3):  # every timed step re-ran the MLP in backward
        assert all(ms > 0 for ms in c["recompute_ms"][f"layers.{i}"])
    assert c["recompute_ms"][""] == [0.0] * 4
    # the watch, for the first step only: a pre-hook on each submodule of a unit, of the blocks' (3 x norm, attn,
    # mlp and its 3) and of the root's (the list of blocks, the head); no global hook
    assert c["watch_hooks_first_step"] == 20 and c["watch_hooks_after_first_step"] == 0
    assert c["global_hooks_at_entry"] == 0


def test_checkpointing_the_whole_unit_still_reads_unit_and_nothing_reads_none(cases):
    assert set(cases["block"]["checkpoint"].values()) == {"none", "unit"}
    assert cases["block"]["checkpoint"][""] == "none"
    assert all(v == "none" for v in cases["none"]["checkpoint"].values())
    assert all(ms == 0.0 for v in cases["none"]["recompute_ms"].values() for ms in v)


def test_blocks_compiled_in_place_are_timed_around_their_compiled_call_without_a_graph_break(cases):
    """``block.compile()`` runs the block's hooks in the compiled frame: Dynamo would trace the doctor's hooks (and
    the checkpoint watch's global hook) as graph breaks that outlive them. The doctor's hooks return at once there;
    the block's compiled call is timed from outside instead (its forward, backward and backward all-gather wait;
    its forward's all-gather wait, FSDP's pre-forward inside the frame, reads unknown rather than zero), and the
    compiled call is the block's own again once the doctor steps aside."""
    from fsdp_doctor import load_run
    from fsdp_doctor.pipeline import build_report

    c = cases["compiled"]
    assert c["errors"] == [] and c["global_hooks_at_entry"] == c["watch_hooks_first_step"] == 0
    assert c["graph_breaks"] == c["plain_graph_breaks"] == 0 and c["losses"] == c["plain_losses"]
    # no frame of the doctor's compiled: its hooks on the blocks, called by Module.__call__ inside the frame (which
    # Dynamo does not trace), were compiled as a frame of their own, guarded on the doctor's state and the grad
    # mode (a new-user trial's Llama: 5 frames for 4 graphs, "5 graphs" in the report, a recompile at an
    # evaluation under no_grad); now the blocks get none of them
    assert c["frames"] == c["plain_frames"], (c["frames"], c["plain_frames"])
    assert c["compiled_in_place"] == [] and c["compiled_call_timed"] == ["layers.0", "layers.1", "layers.2"]
    assert c["compiled_calls_restored"]
    # the blocks compiled in the first step (one frame for the three, and its backward), never again; nothing
    # compiled where nothing is compiled
    assert c["compiles"][0] >= 2 and c["compile_ms"][0] > 0 and c["compiles"][1:] == [0] * 4, c["compiles"]
    assert cases["none"]["compiles"] == [0] * 5 and cases["none"]["compile_ms"] == [0.0] * 5
    rep = build_report(load_run(c["out_dir"]))
    assert rep.steps.compiled["0"].steps == [0]
    units = {u.name: u for u in rep.units}
    for i in range(3):
        t = units[f"layers.{i}"].timing_p50
        assert t.fwd_ms > 0 and t.bwd_ms > 0 and t.ag_wait_bwd_ms > 0 and t.ag_wait_fwd_ms is None, t
    root = units[""].timing_p50
    # the root's forward holds the blocks' compiled calls, step by step (the medians of each need not add up: under
    # load the root's p50 read 24.7 ms beside the blocks' p50s summing to 27.8)
    for s in load_run(c["out_dir"]).ranks[0].steps[1:]:
        fwd = {u.name: u.fwd_ms for u in s.units}
        assert fwd[""] > sum(fwd[f"layers.{i}"] for i in range(3)), fwd
    assert root.fwd_self_ms > 0
    # how the compiled blocks were timed is a note of the header, not a problem: analyze exits 0 (it exited 3, "some
    # files or lines were skipped", on every compiled run)
    assert any("3 unit(s) compiled by torch.compile (layers.0, layers.1, layers.2): timed around their compiled "
               "call" in n for n in rep.run.notes)
    assert not any("compiled" in p for p in rep.problems), rep.problems
    # the verdict from the records (no profiler window) says where the blocks' forward all-gather waits went
    assert ("the forward all-gather waits of 3 units compiled by torch.compile (layers.0, layers.1, layers.2) are "
            "inside their forward: counted as compute here" in rep.verdict.job.summary), rep.verdict.job.summary
    plain = build_report(load_run(cases["none"]["out_dir"]))
    assert plain.verdict.job.source == "records" and "all-gather waits" not in plain.verdict.job.summary
    from fsdp_doctor.cli import EXIT_OK, main

    assert main(["analyze", c["out_dir"]]) == EXIT_OK


@pytest.mark.parametrize("mode", ["compiled_model", "compiled_wrapper"])
def test_a_model_compiled_whole_has_its_step_timed_and_no_false_data_wait(cases, mode):
    """The whole sharded model compiled: in place (``model.compile()``: every hook of the doctor's, the model's
    own included, runs in the compiled frame; the model's forward read 0 ms, its time fell outside the model, and
    jitter.data_wait blamed data loading for it), or by ``model = torch.compile(model)`` (the wrapper's hooks run
    outside, its module's inside: every unit read 0 ms, as if measured, and the step's backward 0 ms). The call that
    enters the frame is now bracketed from outside by the hooks that would have run there (the step's forward, the
    root unit's: its outputs' gradient hook times the backward); the units inside read unknown, saying so; the saved
    activations are not counted (autograd's pack hook would run inside the frame, where Dynamo compiles it again for
    each dtype until its recompile limit); the user's calls are theirs again when the doctor steps aside. The units
    are named from the model inside the wrapper, which the user's fully_shard calls shard (through the wrapper every
    name began "_orig_mod.", and a printed fix raised AttributeError: a new-user trial)."""
    from fsdp_doctor import load_run
    from fsdp_doctor.pipeline import build_report

    c = cases[mode]
    root = ""
    inner = [f"layers.{i}" for i in range(3)]
    assert c["errors"] == [] and c["losses"] == c["plain_losses"] and c["compiled_calls_restored"]
    assert c["graph_breaks"] == c["plain_graph_breaks"] and c["frames"] == c["plain_frames"]
    assert c["compiled_call_timed"] == [root] and c["compiled_in_place"] == inner
    assert all(ms > 0 for ms in c["forward_ms"]) and all(ms > 0 for ms in c["fwd_ms"][root]), c
    run = load_run(c["out_dir"])
    rep = build_report(run)
    assert "jitter.data_wait" not in {f.code for f in rep.findings}
    steps = run.ranks[0].steps[1:]
    assert all(s.backward_ms > 0 for s in steps)
    # the forward's time is the model's, not outside it (it all fell outside: outside >= forward). What is outside
    # here, the batch's randn, the loss, zero_grad, reads a quarter of the forward in the uncompiled model's case too
    # (0.20-0.30 on a quiet host; 0.28 in a CI run), so the bound is half
    assert statistics.median(s.outside_ms for s in steps) < 0.5 * statistics.median(s.forward_ms for s in steps)
    # the units inside get none of the doctor's hooks: timed from FSDP2's own (its pre/post-forward and backward logs,
    # which run outside compiled code), their all-gather waits unknown, not a measured zero (every unit read 0 ms, and
    # then "—" for all four times, though the records held each one's backward)
    units = {u.name: u for u in rep.units}
    for name in inner:
        t = units[name].timing_p50
        assert units[name].fsdp_hooks_timed and t.fwd_ms > 0 and t.bwd_ms > 0, (name, t)
        assert t.ag_wait_fwd_ms is None and t.ag_wait_bwd_ms is None, (name, t)
    for s in steps:  # inside the model's forward, one call each; their backwards inside the step's
        fwd = {u.name: u for u in s.units}
        assert sum(fwd[n].fwd_ms for n in inner) < fwd[root].fwd_ms <= s.forward_ms, s
        assert all(fwd[n].fwd_calls == 1 for n in inner), s
        assert sum(fwd[n].bwd_ms for n in inner) < s.backward_ms, s
    assert "the model's forward is compiled as a whole; saved activations not counted" in {  # (full steps)
        s.memory.activations_note for s in run.ranks[0].steps if s.memory}
    assert any(f"3 unit(s) run inside a compiled frame ({', '.join(inner)}): the doctor's hooks stay out of it; these "
               "units are timed from FSDP2's own hooks" in n for n in rep.run.notes), rep.run.notes
    assert not any("compiled" in p for p in rep.problems), rep.problems


def test_a_compiled_wrapper_the_doctor_was_not_given_is_timed_from_fsdps_own_hooks(cases):
    """watch(model) while training ``torch.compile(model)``: the doctor's hooks run inside the wrapper's frame, where
    they do nothing, and it cannot wrap a call it does not know. Every step read forward and backward 0 ms, the
    step's time outside the model, and jitter.data_wait warned (53% outside the model, no loader); then the first
    step whose backward FSDP logged said so, and every unit and the step's phases read unknown. Now the first
    pre-forward FSDP2 logs with none of the doctor's hooks around it says so (in the first step's config, with the
    fix): from there each unit's forward is timed from FSDP2's own pre/post-forward logs, as inside a compiled frame
    the doctor was given, and the step's forward from the same logs; this model's root holds the head's parameters, so
    its span, the whole forward, is the step's forward. The backward, from the units' pre-backward logs to autograd's
    end. jitter.data_wait stays quiet; Dynamo compiles the same graphs as without the doctor."""
    from fsdp_doctor import load_run
    from fsdp_doctor.pipeline import build_report
    from fsdp_doctor.record.config_snapshot import FRAME_UNSEEN

    c = cases["compiled_hidden"]
    assert c["errors"] == [] and c["losses"] == c["plain_losses"]
    # the checkpoint watch, inside a frame the doctor cannot see: per-module hooks that return at once there (a
    # global hook was traced as 7 graph breaks, kept for the whole run, and torch.compile warned about it)
    assert c["graph_breaks"] == c["plain_graph_breaks"] == 0 and c["global_hooks_at_entry"] == 0
    # nor ever put on: inside the compiled frame a probe made Dynamo compile each hooked submodule's forward as a
    # frame of its own where the model's graph broke, and, taken off after the first step, recompile (a new-user
    # trial's model: 1 graph became 5, other kernels, its losses an ulp apart); Dynamo compiles as without the doctor
    assert c["watch_hooks_first_step"] == 0 and c["unique_graphs"] == c["plain_unique_graphs"], c
    assert c["compiled_in_place"] == ["", "layers.0", "layers.1", "layers.2"] and c["compiled_call_timed"] == []
    inner = ["layers.0", "layers.1", "layers.2"]
    for k, fwd in enumerate(c["forward_ms"]):  # (steps 1-4) the root's span from FSDP2's logs is the step's forward
        root = c["fwd_ms"][""][k]
        assert fwd > 0 and abs(root - fwd) <= 0.001, (k, fwd, root)
        # the blocks one after the other inside it: all of it but the root's own (the head) and the hooks between
        assert 0 < sum(c["fwd_ms"][n][k] for n in inner) < root, (k, c["fwd_ms"])
    run = load_run(c["out_dir"])
    assert all(s.backward_ms > 0 for s in run.ranks[0].steps)
    rep = build_report(run)
    for u in rep.units:  # every unit's forward and backward, their all-gather waits inside them: unknown, "—"
        t = u.timing_p50
        assert u.compiled_in_place and u.fsdp_hooks_timed and t.fwd_ms > 0 and t.bwd_ms > 0, (u.name, t)
        assert t.ag_wait_fwd_ms is None and t.ag_wait_bwd_ms is None, (u.name, t)
    # said first, in the header's notes, and the run exits 0: it was the report's last line, a problem, and exit 3
    # ("some files or lines were skipped"), where nothing was
    assert rep.run.notes[0] == FRAME_UNSEEN and FRAME_UNSEEN not in rep.problems, rep.problems
    assert ("4 unit(s) run inside a compiled frame ((root), layers.0, layers.1, layers.2): the doctor was not given "
            "it, its hooks do nothing there; these units are timed from FSDP2's own hooks") in rep.run.notes[1]
    assert len(rep.run.notes) == 2, rep.run.notes
    from fsdp_doctor.cli import EXIT_OK, main

    assert main(["analyze", c["out_dir"]]) == EXIT_OK
    phases = [st.phases_p50_ms for st in rep.steps.per_rank.values()]
    assert all(ph["forward"] > 0 and ph["backward"] > 0 for ph in phases), phases
    assert "jitter.data_wait" not in {f.code for f in rep.findings}


def test_a_compiled_optimizer_step_compiles_as_without_the_doctor(cases):
    """torch.compile(optimizer.step): the doctor's optimizer hooks run as they are, Dynamo stepping round them, and
    the step compiles as without the doctor (traced, the memory marks' calls broke the graph inside them: a
    new-user trial read 3 graph breaks, 11 frames became 31); the optimizer's time is still recorded. The memory
    high-water's mode is popped at the step's end, not inside the compiled optimizer.step() (there it left torch's
    dispatch state wrong: zero_grad() raised an INTERNAL ASSERT on the first full memory step, training stopped)."""
    from fsdp_doctor import load_run

    c = cases["compiled_step"]
    assert c["errors"] == [] and c["losses"] == c["plain_losses"], c
    # (no graph break of the doctor's: Dynamo steps round its hooks, where torch's own optimizer wrapper counts one)
    assert c["graph_breaks"] <= c["plain_graph_breaks"] and c["unique_graphs"] == c["plain_unique_graphs"], c
    assert all(s.optimizer_ms > 0 for s in load_run(c["out_dir"]).ranks[0].steps)


@pytest.mark.parametrize("mode", ["children", "block", "none"])
def test_losses_bit_identical_with_and_without_the_doctor(cases, mode):
    assert cases[mode]["losses"] == cases[mode]["plain_losses"]


def test_the_diagnosis_sees_the_children_granularity(cases):
    from fsdp_doctor import load_run
    from fsdp_doctor.pipeline import build_report

    codes = {m: {f.code for f in build_report(load_run(cases[m]["out_dir"])).findings} for m in cases}
    assert "ac.wrong_granularity" in codes["children"]
    assert "ac.wrong_granularity" not in codes["block"] and "ac.wrong_granularity" not in codes["none"]


def test_a_sharded_compiled_wrapper_is_a_compiled_frame():
    """fully_shard applied to ``torch.compile(module)``'s wrapper makes FSDP2's subclass of it, an
    FSDPOptimizedModule (Hugging Face's Trainer with torch_compile=True and FSDP2 trains one): a test of the class
    name alone missed it, and every unit inside read 0 ms as if measured. It is a compiled frame: its module's
    hooks, and everything below, run inside."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    from fsdp_doctor.record.units import compiled_frames, compiled_module, compiled_wrapper, no_forward_of_its_own

    inner = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    wrapper = torch.compile(inner, backend="eager")
    wrapper.__class__ = type(f"FSDP{type(wrapper).__name__}", (FSDPModule, type(wrapper)), {})  # as fully_shard does
    assert type(wrapper).__name__ == "FSDPOptimizedModule" and compiled_wrapper(wrapper) and compiled_module(wrapper)
    frames, inside = compiled_frames(wrapper)
    assert [(f.top, f.owner, f.attr) for f in frames] == [(inner, wrapper, "forward")]
    assert inside == {id(m) for m in inner.modules()} and not compiled_wrapper(inner)
    # (its forward is set on the instance: the compiled module's own, not "a container of models" without one)
    assert not no_forward_of_its_own(wrapper) and no_forward_of_its_own(torch.nn.ModuleDict({"a": inner}))


def test_each_unit_lists_its_own_modules_that_keep_running_statistics(gloo_one_rank):
    """What the snapshot lists as keeping running statistics (BatchNorm, InstanceNorm with track_running_stats) is
    what a training step updates (their running mean moves): a batch norm without tracking, an InstanceNorm's default, a
    GroupNorm keep none. Each unit lists its own (a nested unit's are its), inside a CheckpointWrapper too, where
    the step updates them twice (the recompute runs them in training mode)."""
    import torch
    import torch.nn as nn
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    from fsdp_doctor.record.units import find_units, snapshot_units

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(nn.Conv1d(4, 4, 1), nn.BatchNorm1d(4)),
        nn.Sequential(nn.Conv1d(4, 4, 1), nn.InstanceNorm1d(4, affine=True, track_running_stats=True),
                      nn.BatchNorm1d(4, track_running_stats=False), nn.InstanceNorm1d(4), nn.GroupNorm(2, 4)),
        checkpoint_wrapper(nn.Sequential(nn.Conv1d(4, 4, 1), nn.BatchNorm1d(4))))
    fully_shard(model[1])
    fully_shard(model)
    got = {c.name: c.running_stats_modules for c in snapshot_units(find_units(model))}
    assert got == {"": ["0.1", "2._checkpoint_wrapped_module.1"], "1": ["1.1"]}
    model(torch.randn(2, 4, 5)).sum().backward()
    moved = [n for n, m in model.named_modules() if getattr(m, "running_mean", None) is not None
             and m.running_mean.abs().sum() > 0]  # (they start at zero)
    assert moved == ["0.1", "1.1", "2._checkpoint_wrapped_module.1"]
    # (InstanceNorm counts no batches)
    assert {n: int(m.num_batches_tracked) for n, m in model.named_modules() if isinstance(m, nn.BatchNorm1d)
            and m.track_running_stats} == {"0.1": 1, "2._checkpoint_wrapped_module.1": 2}
