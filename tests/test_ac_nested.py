"""Checkpointing nested in checkpointing: transformers' ``gradient_checkpointing_enable()`` switches every
GradientCheckpointingLayer on, and a Swin nests them (its stages hold its blocks). A new-user trial (transformers 5.25,
a tiny ``SwinForImageClassification`` at 64 x 64, each block a unit, 2 gloo ranks): each block's attention ran three
times a step (forward, the stage's recompute, the block's own), and ac.fewer_units' fix turned 6 blocks' switches off
for "26.26 -> 32.52 MiB": pasted, the peak stayed at 26.11 MiB (the stages still re-ran them).

ac.nested names the stages (from RunConfig.checkpoint_layers, read off the model) and turns their switch off; the rerun
keeps each block checkpointing itself, trains the same, and the rule is quiet. ac.fewer_units leaves nested units
alone. The same with each stage a unit, as accelerate's FSDP2 plugin makes them (Swin's _no_split_modules), and with
checkpoint wrappers on the stages and the blocks inside them, as the plugin's activation_checkpointing makes them (a
new-user trial's ConvNeXt under the Trainer, its stages and layers both in _no_split_modules: 208.7 -> 180.6 ms a
step with the stages' wrappers off, 11.2 ms predicted)."""

from __future__ import annotations

import json
import textwrap

import msgspec
import pytest

import fsdp_doctor
from fsdp_doctor.diagnose import snippets as S

from conftest import gloo_worker, record_two_ranks

pytest.importorskip("transformers")

_SCRIPT = textwrap.dedent(
    """
    import json
    import os
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    """
) + gloo_worker(
    """
    import warnings
    warnings.filterwarnings("ignore", category=FutureWarning)  # (gradient_checkpointing_enable: renamed in v6)
    from transformers import (ConvNextConfig, ConvNextForImageClassification, SwinConfig,
                              SwinForImageClassification)
    if os.environ.get("MODEL") == "convnext":  # stages of layers, both in its _no_split_modules
        model = ConvNextForImageClassification(ConvNextConfig(hidden_sizes=[64] * 4, depths=[3] * 4, image_size=64,
                                                              num_labels=10, drop_path_rate=0.0))
        stages, inner, classes = model.convnext.encoder.stages, "layers", ("ConvNextStage", "ConvNextLayer")
    else:
        cfg = SwinConfig(image_size=64, patch_size=4, embed_dim=32, depths=[2, 2, 2, 2], num_heads=[2, 2, 4, 4],
                         window_size=2, num_labels=10, drop_path_rate=0.0)
        model = SwinForImageClassification(cfg)
        stages, inner, classes = model.swin.encoder.layers, "blocks", ("SwinStage", "SwinLayer")
    if os.environ.get("CKPT") == "wrappers":  # accelerate's plugin's checkpointing: a wrapper on every policy class
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            apply_activation_checkpointing, checkpoint_wrapper)
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,
                                       check_fn=lambda m: type(m).__name__ in classes)
    else:
        model.gradient_checkpointing_enable()
    for stage in stages:
        if os.environ.get("WRAP") == "stages":  # accelerate's plugin's policy: Swin's _no_split_modules
            fully_shard(stage)
            continue
        for block in getattr(stage, inner):
            fully_shard(block)
        if os.environ.get("WRAP") == "both":  # each stage a unit too, around its blocks' (the plugin's policy)
            fully_shard(stage)
    fully_shard(model)
    if fix:  # after the user's sharding and checkpointing, as printed
        exec(open(fix).read(), {"model": model})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1 + rank)
    losses = []
    with fsdp_doctor.watch(model, opt, out_dir=out, profile=False, capacity_bytes=64 << 20) as doc:
        for _ in range(5):
            x, y = torch.randn(4, 3, 64, 64, generator=g), torch.randint(0, 10, (4,), generator=g)
            loss = model(pixel_values=x, labels=y).loss
            loss.backward()
            opt.step(), opt.zero_grad(), doc.step()
            losses.append(loss.item())
    open(f"{out}.losses{rank}.json", "w").write(json.dumps(losses))
    dist.destroy_process_group()
    """
)

_STAGES = [f"swin.encoder.layers.{i}" for i in range(4)]


def _pasted(tmp_path, f, checkpoint: str | set[str]):
    """The run again with ``f``'s fix pasted after the sharding, as printed: every unit checkpoints as
    ``checkpoint`` says (one way, or any of a set), ac.nested is quiet and each rank's losses are the base run's;
    returns its Report."""
    fix = tmp_path / "fix.py"
    fix.write_text(f.recommendation.code)
    fixed = record_two_ranks(tmp_path, _SCRIPT, "fixed", str(fix))
    assert all(u.checkpoint in ({checkpoint} if isinstance(checkpoint, str) else checkpoint)
               for u in fixed.units if not u.is_root), \
        [(u.name, u.checkpoint, u.checkpoint_flag) for u in fixed.units]
    (st,) = [s for s in fixed.rules if s.code == "ac.nested"]
    assert st.status == "quiet", (st.status, st.reason)
    for rank in (0, 1):
        assert json.loads((tmp_path / f"base.losses{rank}.json").read_text()) == \
            json.loads((tmp_path / f"fixed.losses{rank}.json").read_text())
    return fixed


def _fewer_units_leave_them(tmp_path, base) -> None:
    """ac.fewer_units never offers the nested blocks: their checkpointing off would leave them re-run by their stage
    (the base run's peak at 60% of a budget, as the trial's: the rule weighs which units fit)."""
    run = fsdp_doctor.load_run(tmp_path / "base")
    peak = max(m.peak_bytes for m in base.memory.per_rank.values())
    for rd in run.ranks.values():
        rd.config = msgspec.structs.replace(rd.config, capacity_bytes=int(peak / 0.6))
    (fu,) = [s for s in fsdp_doctor.build_report(run).rules if s.code == "ac.fewer_units"]
    assert fu.status == "quiet" and "(ac.nested)" in fu.reason, (fu.status, fu.reason)


@pytest.mark.slow
def test_stages_switched_off_leave_each_block_checkpointing_itself_once(tmp_path):
    base = record_two_ranks(tmp_path, _SCRIPT, "base")
    blocks = [u for u in base.units if not u.is_root]
    assert len(blocks) == 8 and all(u.checkpoint == "unit" for u in blocks)
    (f,) = [f for f in base.findings if f.code == "ac.nested"]
    assert f.evidence["outer_layers"] == _STAGES, f.evidence
    assert f.evidence["inner_layers"] == [u.name for u in blocks] and f.units == [u.name for u in blocks]
    assert "layers = ['swin.encoder.layers.0', 'swin.encoder.layers.1'," in f.recommendation.code
    assert f.predicted.step_ms_after < f.predicted.step_ms_before
    _fewer_units_leave_them(tmp_path, base)

    fixed = _pasted(tmp_path, f, "unit")
    # the units' inputs now held from forward to backward: the peak rises by them at least (the stages' patch
    # merging saves its own besides, not measured apart)
    peak = max(m.peak_bytes for m in fixed.memory.per_rank.values())
    assert f.predicted.peak_bytes_after <= peak <= f.predicted.peak_bytes_after * 1.06, (peak, f.predicted)


@pytest.mark.slow
def test_stage_units_switched_off_leave_their_blocks_checkpointing(tmp_path, monkeypatch):
    """Each stage a unit (accelerate's policy over _no_split_modules): the nesting is inside the units. The fix turns
    the stages' switch off; the rerun's stages no longer checkpoint as a whole, their blocks still do (the stages'
    checkpointing reads "children"), the losses the same, and the rule quiet."""
    monkeypatch.setenv("WRAP", "stages")
    base = record_two_ranks(tmp_path, _SCRIPT, "base")
    assert [u.name for u in base.units if not u.is_root] == _STAGES
    assert all(u.checkpoint == "unit" and u.checkpoint_flag for u in base.units if not u.is_root)
    (f,) = [f for f in base.findings if f.code == "ac.nested"]
    assert f.evidence["outer_layers"] == _STAGES and len(f.evidence["inner_layers"]) == 8, f.evidence
    assert f.units == _STAGES and f.predicted.peak_bytes_after is None, (f.units, f.predicted)
    assert f.predicted.step_ms_after < f.predicted.step_ms_before
    fixed = _pasted(tmp_path, f, "children")
    assert not any(u.checkpoint_flag for u in fixed.units if not u.is_root), fixed.units
    # nor does ac.wrong_granularity ask for the stages checkpointed again (its fix did, the blocks' switches left on:
    # the nesting back): the blocks are transformers' own layers, whole blocks of the model
    (wg,) = [s for s in fixed.rules if s.code == "ac.wrong_granularity"]
    assert wg.status == "quiet" and "transformers' own layers checkpointing themselves (8: " in wg.reason, wg


@pytest.mark.slow
@pytest.mark.parametrize("wrap", ["blocks", "both"])
def test_stage_wrappers_turned_off_leave_their_blocks_wrappers_checkpointing(tmp_path, monkeypatch, wrap):
    """Checkpoint wrappers on the stages and on the blocks inside them (apply_activation_checkpointing over both
    classes, as accelerate's plugin does over a model's _no_split_modules), each block a unit: no switch is on, and
    ac.nested reads the wrappers. Its fix, pasted after the sharding as printed, turns the stages' wrappers off (each
    stays, calling its stage as it is); the rerun's blocks still checkpoint, the rule is quiet, the recompute falls
    and the losses are the same. A ConvNeXt with each stage a unit too (``both``, its layout under the plugin, as
    the trial's): the peak after is read off the timeline, the layers' inputs held longer from each stage's forward
    to its backward, where its recompute regrew them anyway (within 10% of the rerun's; every input added at the
    peak read 16.12 MiB for the trial's 13.99, and fails it)."""
    monkeypatch.setenv("CKPT", "wrappers")
    monkeypatch.setenv("WRAP", wrap)
    stages = _STAGES
    if wrap == "both":
        monkeypatch.setenv("MODEL", "convnext")
        stages = [f"convnext.encoder.stages.{i}" for i in range(4)]
    n = 8 if wrap == "blocks" else 12
    base = record_two_ranks(tmp_path, _SCRIPT, "base")
    blocks = [u for u in base.units if not u.is_root and S.strip_ckpt(u.name) not in stages]
    assert len(blocks) == n and all(u.checkpoint == "unit" and u.checkpoint_wrappers for u in blocks)
    assert len(base.units) == 1 + n + (4 if wrap == "both" else 0), [u.name for u in base.units]
    (f,) = [f for f in base.findings if f.code == "ac.nested"]
    assert f.evidence["outer_layers"] == stages, f.evidence
    assert len(f.evidence["inner_layers"]) == n, f.evidence
    assert f.units == [*(stages if wrap == "both" else []), *[u.name for u in blocks]], f.units
    assert f"wrappers = ['{stages[0]}', '{stages[1]}'," in f.recommendation.code
    assert f.recommendation.where == "sharded" and f.predicted.step_ms_after < f.predicted.step_ms_before
    _fewer_units_leave_them(tmp_path, base)
    fixed = _pasted(tmp_path, f, {"unit"} if wrap == "blocks" else {"unit", "none"})
    recompute = [sum(u.timing_p50.recompute_ms or 0.0 for u in r.units if not u.is_root) for r in (base, fixed)]
    assert recompute[1] < 0.85 * recompute[0], recompute
    if wrap == "both":
        peak = max(m.peak_bytes for m in fixed.memory.per_rank.values())
        assert abs(peak - f.predicted.peak_bytes_after) <= 0.10 * peak, (peak, f.predicted)
