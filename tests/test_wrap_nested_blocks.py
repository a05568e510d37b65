"""wrap.too_coarse on a ConvNeXt-shaped tree (timm's layout: ``stem``, ``stages.N.downsample`` and
``stages.N.blocks.M``, ``head``) sharded only at its root. The plan made a unit of each stage, the outermost numbered
level: its last stage held 55% of a timm ConvNeXt's parameters (a new-user trial, ``convnext_atto`` on 2 gloo ranks),
and the next diagnosis raised wrap.too_coarse on that stage. A block holding half the parameters or more is split
into its own blocks, each a unit sharded before it (snippets.Tree.split_blocks), and the predicted peak counts them.

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

    DIMS, DEPTHS = (8, 16, 32, 64), (1, 1, 2, 2)

    class Block(nn.Module):  # timm's ConvNeXtBlock: depthwise conv, norm, MLP, residual
        def __init__(self, d):
            super().__init__()
            self.conv_dw = nn.Conv2d(d, d, 7, padding=3, groups=d)
            self.norm = nn.GroupNorm(1, d)
            self.mlp = nn.Sequential(nn.Conv2d(d, 4 * d, 1), nn.GELU(), nn.Conv2d(4 * d, d, 1))

        def forward(self, x):
            return x + self.mlp(self.norm(self.conv_dw(x)))

    class Stage(nn.Module):  # timm's ConvNeXtStage: a downsample (numbered layers) before its blocks
        def __init__(self, c_in, c_out, depth):
            super().__init__()
            self.downsample = (nn.Sequential(nn.GroupNorm(1, c_in), nn.Conv2d(c_in, c_out, 2, stride=2))
                               if c_in != c_out else nn.Identity())
            self.blocks = nn.Sequential(*(Block(c_out) for _ in range(depth)))

        def forward(self, x):
            return self.blocks(self.downsample(x))

    class ConvNeXt(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, DIMS[0], 4, stride=4), nn.GroupNorm(1, DIMS[0]))
            self.stages = nn.Sequential(*(Stage(DIMS[max(0, i - 1)], DIMS[i], DEPTHS[i]) for i in range(4)))
            self.head = nn.Sequential(nn.GroupNorm(1, DIMS[-1]), nn.Flatten(), nn.Linear(DIMS[-1], 10))

        def forward(self, x):
            return self.head(F.adaptive_avg_pool2d(self.stages(self.stem(x)), 1))
    """
) + SHARD_OR_FIX + gloo_worker(
    """
    model = ConvNeXt()
    shard(model, fix)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1 + rank)
    with fsdp_doctor.watch(model, opt, out_dir=out, profile=False, capacity_bytes=4 << 20) as doc:
        for x, y in zip(torch.randn(6, 2, 3, 32, 32, generator=g), torch.randint(0, 10, (6, 2), generator=g)):
            F.cross_entropy(model(x), y).backward()
            opt.step(), opt.zero_grad(), doc.step()
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_too_coarse_plan_splits_a_stage_too_large_to_be_one_unit(tmp_path):
    whole = record_two_ranks(tmp_path, _SCRIPT, "whole")
    (f,) = [f for f in whole.findings if f.code == "wrap.too_coarse"]
    code = f.recommendation.code
    split = code.index("for block in model.get_submodule('stages.3.blocks').children():")
    assert split < code.index("for block in model.stages.children():"), code  # (before the stage: nested in it)
    assert "# stages.3 holds " in code and "stages.2.blocks" not in code, code
    # (stages 0-2, what stages.3 keeps, its 2 blocks)
    assert f.evidence["estimate_assumes"].startswith("its 6 blocks split off"), f.evidence

    fix = tmp_path / "fix.py"
    fix.write_text(code)
    fixed = record_two_ranks(tmp_path, _SCRIPT, "fixed", str(fix))
    shares = {u.name: u.param_count / sum(x.param_count for x in fixed.units) for u in fixed.units}
    assert {"stages.3", "stages.3.blocks.0", "stages.3.blocks.1", "stages.2"} <= set(shares), shares
    assert max(shares.values()) < 0.5, shares  # (the stage whole held 79%: the finding again)
    assert "wrap.too_coarse" not in {g.code for g in fixed.findings}
    predicted = f.predicted.peak_bytes_after
    assert abs(fixed.memory.peak_bytes - predicted) <= 0.1 * predicted, (fixed.memory.peak_bytes, predicted)
