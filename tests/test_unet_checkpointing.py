"""A diffusers U-Net checkpointed by its own switch: ``enable_gradient_checkpointing()`` sets ``gradient_checkpointing``
on every block and transformer model, and each block then checkpoints its resnets and its transformer blocks (not
itself). A new-user trial (diffusers 0.42, a tiny Stable-Diffusion-style ``UNet2DConditionModel``, each down, mid and
up block a unit, 2 gloo ranks):

- the blocks read AC "unit" (their flag taken for transformers' layers that checkpoint themselves) and their recompute
  31.4 ms a step where turning checkpointing off saved ~300 ms: the hooks timing each re-run sat on modules inside
  the transformer blocks too (a ModuleList's items read "outermost"), and a re-run that checkpointing stops early
  never reached its post-hook; ac.unneeded predicted 2% for a measured 20%;
- ac.wrong_granularity's fix checkpointed the blocks whole with their children's switches left on (each resnet and
  transformer block re-run inside the block's re-run), and checkpointing them whole raises the peak here (58.52 ->
  86.79 MiB): a block's recompute holds at once what its children's hold one at a time.

Now the blocks read "children" with their recompute timed in full, ac.unneeded's prediction holds when pasted, and
ac.wrong_granularity is quiet, saying by how much the peak would rise at least: the blocks checkpointed whole (its
fix's lines, the children's switches off) measure at or above that floor."""

from __future__ import annotations

import json
import textwrap

import pytest

from conftest import gloo_worker, record_two_ranks

pytest.importorskip("diffusers")

_SCRIPT = textwrap.dedent(
    """
    import json
    import os
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard
    """
) + gloo_worker(
    """
    from diffusers import UNet2DConditionModel
    model = UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(32, 64, 64),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
        norm_num_groups=8, attention_head_dim=4)
    model.enable_gradient_checkpointing()
    if fix:  # before sharding, as printed
        exec(open(fix).read(), {"model": model})
    for block in [*model.down_blocks, model.mid_block, *model.up_blocks]:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1 + rank)
    losses = []
    with fsdp_doctor.watch(model, opt, out_dir=out, profile=False, capacity_bytes=256 << 20) as doc:
        for _ in range(5):
            lat, noise = torch.randn(2, 4, 16, 16, generator=g), torch.randn(2, 4, 16, 16, generator=g)
            t, ctx = torch.randint(0, 1000, (2,), generator=g), torch.randn(2, 8, 32, generator=g)
            loss = F.mse_loss(model(lat + noise, t, encoder_hidden_states=ctx).sample, noise)
            loss.backward()
            opt.step(), opt.zero_grad(), doc.step()
            losses.append(loss.item())
    open(f"{out}.losses{rank}.json", "w").write(json.dumps(losses))
    dist.destroy_process_group()
    """
)

_BLOCKS = ["down_blocks.0", "down_blocks.1", "down_blocks.2", "up_blocks.0", "up_blocks.1", "up_blocks.2"]


def _peak(report) -> int:
    return max(m.peak_bytes for m in report.memory.per_rank.values())


@pytest.mark.slow
def test_unet_blocks_checkpointing_their_children(tmp_path):
    from fsdp_doctor.diagnose.rules import ac

    base = record_two_ranks(tmp_path, _SCRIPT, "base")
    blocks = [u for u in base.units if not u.is_root]
    assert all(u.checkpoint == "children" and not u.checkpoint_flag for u in blocks), \
        [(u.name, u.checkpoint, u.checkpoint_flag) for u in blocks]
    # each unit's class as the user wrote it (what a policy by class matches), not FSDP's subclass
    assert [u.module_classes for u in blocks[:2]] == [["CrossAttnDownBlock2D"]] * 2, blocks[0].module_classes
    # each block's recompute timed in full: its checkpointed resnets and transformer blocks are nearly all of its
    # forward (31.4 ms of ~300 read before, a tenth)
    timing = {r.name: r.timing_p50 for r in base.units}
    fwd = sum(timing[u.name].fwd_ms - timing[u.name].ag_wait_fwd_ms for u in blocks)
    recompute = sum(timing[u.name].recompute_ms for u in blocks)
    assert 0.5 * fwd <= recompute <= 1.2 * fwd, (recompute, fwd)

    (wg,) = [s for s in base.rules if s.code == "ac.wrong_granularity"]
    assert wg.status == "quiet" and "whole would raise the peak from " in wg.reason, (wg.status, wg.reason)
    floor = _bytes_in(wg.reason.split(" to ")[1].split(" at least")[0])

    # the blocks checkpointed whole as the rule's fix would (their children's switches off): one recompute each,
    # no nested one, and the peak at or above the floor, above the run's
    whole = tmp_path / "whole.py"
    whole.write_text(ac._granularity_code([], _BLOCKS, _BLOCKS, kv_cache=False))
    after = record_two_ranks(tmp_path, _SCRIPT, "whole", str(whole))
    units = {u.name: u for u in after.units}
    assert all(units[b].checkpoint == "unit" for b in _BLOCKS), [(b, units[b].checkpoint) for b in _BLOCKS]
    assert _peak(after) >= floor * 0.98 and _peak(after) > _peak(base), (_peak(after), floor, _peak(base))

    # ac.unneeded (the peak far below the budget): its recompute is the blocks' (as timed above), and pasted, its
    # fix turns every block's checkpointing off at the peak it predicted
    (un,) = [f for f in base.findings if f.code == "ac.unneeded"]
    assert un.evidence["recompute_ms_per_step"] >= 0.5 * fwd, (un.evidence, fwd)
    fix = tmp_path / "off.py"
    fix.write_text(un.recommendation.code)
    off = record_two_ranks(tmp_path, _SCRIPT, "off", str(fix))
    assert all(u.checkpoint == "none" for u in off.units)
    want = un.predicted.peak_bytes_after
    assert abs(_peak(off) - want) <= 0.1 * want, (_peak(off), want)
    for rank in (0, 1):
        assert json.loads((tmp_path / f"base.losses{rank}.json").read_text()) == \
            json.loads((tmp_path / f"off.losses{rank}.json").read_text())


def _bytes_in(text: str) -> float:
    """``"76.68 MiB"`` in bytes."""
    value, unit = text.split()
    return float(value) * {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[unit]
