"""wrap.too_coarse on a diffusers-shaped UNet sharded only at its root: its mid block holds its attentions in an
``nn.ModuleList`` of one (diffusers' ``UNetMidBlock2DCrossAttn.attentions``) beside a ModuleList of two resnets. The
plan made the resnets' list a container of blocks and collapsed the lone attention to its outermost free ancestor,
the ModuleList itself: ``fully_shard(model.mid_block.attentions, mesh=mesh)``, which fully_shard refuses
("ValueError: fully_shard does not support containers that do not implement forward": a new-user trial's tiny
UNet2DConditionModel, its pasted plan crashed on both ranks). The snapshot records the modules with no forward of
their own and the plan shards what they hold (``model.mid_block.attentions.0``).

Run as a user would: 2 gloo ranks, the printed plan executed in place of ``fully_shard(model)`` in a fresh run."""

from __future__ import annotations

import textwrap

import pytest

from conftest import SHARD_OR_FIX, gloo_worker, record_two_ranks

_SCRIPT = textwrap.dedent(
    """
    import os
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard

    C = 32

    class Res(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.norm, self.conv = nn.GroupNorm(4, c), nn.Conv2d(c, c, 3, padding=1)

        def forward(self, x):
            return x + self.conv(F.silu(self.norm(x)))

    class Attn(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.proj_in, self.proj_out = nn.Linear(c, c), nn.Linear(c, c)

        def forward(self, x):
            b, c, h, w = x.shape
            t = x.flatten(2).transpose(1, 2)
            return x + self.proj_out(F.silu(self.proj_in(t))).transpose(1, 2).reshape(b, c, h, w)

    class Mid(nn.Module):  # diffusers' UNetMidBlock2DCrossAttn: one attention between two resnets
        def __init__(self, c):
            super().__init__()
            self.attentions = nn.ModuleList([Attn(c)])
            self.resnets = nn.ModuleList([Res(c), Res(c)])

        def forward(self, x):
            x = self.resnets[0](x)
            for attn, res in zip(self.attentions, self.resnets[1:]):
                x = res(attn(x))
            return x

    class UNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv_in = nn.Conv2d(4, C, 3, padding=1)
            self.down_blocks = nn.ModuleList([Res(C), Res(C)])
            self.up_blocks = nn.ModuleList([Res(C), Res(C)])
            self.mid_block = Mid(C)
            self.conv_norm_out, self.conv_out = nn.GroupNorm(4, C), nn.Conv2d(C, 4, 3, padding=1)

        def forward(self, x):
            x = self.conv_in(x)
            skips = []
            for blk in self.down_blocks:
                x = blk(x)
                skips.append(x)
            x = self.mid_block(x)
            for blk in self.up_blocks:
                x = blk(x + skips.pop())
            return self.conv_out(F.silu(self.conv_norm_out(x)))
    """
) + SHARD_OR_FIX + gloo_worker(
    """
    model = UNet()
    shard(model, fix)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1 + rank)
    with fsdp_doctor.watch(model, opt, out_dir=out, profile=False, capacity_bytes=4 << 20) as doc:
        for x in torch.randn(6, 2, 4, 8, 8, generator=g):
            F.mse_loss(model(x), x).backward()
            opt.step(), opt.zero_grad(), doc.step()
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_too_coarse_plan_shards_what_a_module_list_holds_not_the_list(tmp_path):
    whole = record_two_ranks(tmp_path, _SCRIPT, "whole")
    (root,) = whole.units
    assert root.no_forward_modules == ["down_blocks", "up_blocks", "mid_block.attentions", "mid_block.resnets"], \
        root.no_forward_modules
    (f,) = [f for f in whole.findings if f.code == "wrap.too_coarse"]
    code = f.recommendation.code
    calls = [ln.strip() for ln in code.splitlines() if ln.strip().startswith("fully_shard(")]
    assert "fully_shard(model.get_submodule('mid_block.attentions.0'), mesh=mesh)" in calls, code
    assert not any("model.mid_block.attentions," in c or "model.mid_block.resnets," in c for c in calls), code

    fix = tmp_path / "fix.py"
    fix.write_text(code)
    fixed = record_two_ranks(tmp_path, _SCRIPT, "fixed", str(fix))  # (raised ValueError on both ranks before)
    names = {u.name for u in fixed.units}
    assert {"mid_block.attentions.0", "mid_block.resnets.0", "mid_block.resnets.1", "down_blocks.0",
            "up_blocks.1"} <= names, names
    assert "wrap.too_coarse" not in {g.code for g in fixed.findings}


@pytest.mark.slow
def test_last_unit_in_forward_is_read_from_the_run_not_module_order(tmp_path):
    """diffusers registers a UNet's ``mid_block`` after its ``up_blocks`` (both lists are set before the mid block is
    built), as this tree does: reshard.last_unit's reason for staying quiet named ``mid_block`` as the last unit in
    forward (a new-user trial's UNet2DConditionModel, its blocks units and its convolutions in the root). The order
    is the run's: the up blocks end their forwards after the mid block's on the peak step's timeline."""
    fix = tmp_path / "blocks.py"
    fix.write_text("from torch.distributed.fsdp import fully_shard\n"
                   "for name in ('down_blocks.0', 'down_blocks.1', 'mid_block', 'up_blocks.0', 'up_blocks.1'):\n"
                   "    fully_shard(model.get_submodule(name))\n"
                   "fully_shard(model)\n")
    blocks = record_two_ranks(tmp_path, _SCRIPT, "blocks", str(fix))
    assert [u.name for u in blocks.units if not u.is_root][-1] == "mid_block"  # module order
    (s,) = [s for s in blocks.rules if s.code == "reshard.last_unit"]
    assert s.status == "quiet", (s.status, s.reason)
    assert "which may compute after the last unit (up_blocks.1) in forward" in s.reason, s.reason
