"""wrap.too_coarse on a model whose first blocks are frozen, sharded only at its root: a Wav2Vec2 fine-tuned for
CTC as Hugging Face's recipe does it (``model.freeze_feature_encoder()``: its ``feature_extractor.conv_layers`` frozen,
the encoder's layers trained). The plan made every block a unit, the frozen convolutions too, and FSDP2's default
backward prefetch then all-gathered the last of them in every backward of the first encoder layer, though they never
run backward: the rerun of the pasted plan raised prefetch.frozen_gathered (a new-user trial's tiny
``Wav2Vec2ForCTC``, 12.00 KiB a step). The snapshot records which of the root's modules are frozen, and the plan gives
that first trainable unit a backward prefetch list of its own (itself).

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

    W, C = 64, 16

    class Conv(nn.Module):  # a feature encoder's layer
        def __init__(self, cin, k, s):
            super().__init__()
            self.conv = nn.Conv1d(cin, C, k, stride=s)

        def forward(self, x):
            return F.gelu(self.conv(x))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.fc1, self.fc2 = nn.LayerNorm(W), nn.Linear(W, 4 * W), nn.Linear(4 * W, W)

        def forward(self, x):
            return x + self.fc2(F.gelu(self.fc1(self.norm(x))))

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv_layers = nn.ModuleList([Conv(1, 10, 5), Conv(C, 3, 2), Conv(C, 3, 2)])

        def forward(self, x):
            x = x[:, None]
            for c in self.conv_layers:
                x = c(x)
            return x.transpose(1, 2)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.feature_extractor = Encoder()
            self.projection = nn.Linear(C, W)
            self.layers = nn.ModuleList([Block() for _ in range(3)])
            self.head = nn.Linear(W, 128)

        def forward(self, x):
            h = self.projection(self.feature_extractor(x))
            for blk in self.layers:
                h = blk(h)
            return self.head(h)
    """
) + SHARD_OR_FIX + gloo_worker(
    """
    model = Model()
    model.feature_extractor.requires_grad_(False)  # freeze_feature_encoder()
    shard(model, fix)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    g = torch.Generator().manual_seed(1 + rank)
    with fsdp_doctor.watch(model, opt, out_dir=out, profile=False, capacity_bytes=64 << 20) as doc:
        for x in torch.randn(6, 4, 2000, generator=g):
            model(x).float().pow(2).mean().backward()
            opt.step(), opt.zero_grad(), doc.step()
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_too_coarse_plan_keeps_the_first_trainable_block_from_gathering_frozen_ones(tmp_path):
    whole = record_two_ranks(tmp_path, _SCRIPT, "whole")
    (root,) = whole.units
    assert root.frozen_modules == [f"feature_extractor.conv_layers.{i}.conv" for i in range(3)], root.frozen_modules
    (f,) = [f for f in whole.findings if f.code == "wrap.too_coarse"]
    code = f.recommendation.code
    line = "unit.set_modules_to_backward_prefetch([unit])"
    assert "unit = model.get_submodule('layers.0')" in code and line in code, code

    fix = tmp_path / "fix.py"
    fix.write_text(code)
    fixed = record_two_ranks(tmp_path, _SCRIPT, "fixed", str(fix))
    names = {u.name for u in fixed.units}
    assert {"feature_extractor.conv_layers.2", "layers.0"} <= names, names
    (fg,) = [s for s in fixed.rules if s.code == "prefetch.frozen_gathered"]
    assert fg.status == "quiet", (fg.status, fg.reason)
    by = {u.name: u for u in fixed.units}
    assert by["layers.0"].backward_prefetch == ["layers.0"], by["layers.0"].backward_prefetch

    # the plan without its last lines: the frozen block gathered in every backward, as the trial's rerun said
    bare = tmp_path / "bare.py"
    bare.write_text(code[:code.index("# the 3 unit(s) before")])
    (g,) = [g for g in record_two_ranks(tmp_path, _SCRIPT, "bare", str(bare)).findings
            if g.code == "prefetch.frozen_gathered"]
    assert "feature_extractor.conv_layers.2" in g.title, g.title


@pytest.mark.slow
def test_params_in_root_quiet_without_ties_says_what_stays_and_why(tmp_path):
    """The encoder's layers wrapped, as the trial did: the root keeps the frozen convolutions (under 5% of the
    parameters), the projection and the head, which gain less as units than they cost. wrap.params_in_root's
    reason said "those of tied modules stay there" of a model with no tie."""
    fix = tmp_path / "layers.py"
    fix.write_text("from torch.distributed.fsdp import fully_shard\n"
                   "for layer in model.layers:\n    fully_shard(layer)\nfully_shard(model)\n")
    run = record_two_ranks(tmp_path, _SCRIPT, "layers", str(fix))
    (pr,) = [s for s in run.rules if s.code == "wrap.params_in_root"]
    assert pr.status == "quiet", (pr.status, pr.reason)
    assert "tied" not in pr.reason, pr.reason
    assert pr.reason.startswith("10% of the parameters are in the root: projection, head gain less as units of their "
                                "own than they cost (each a unit, and one unit of them all, would free at most "), \
        pr.reason
    assert "the rest, each block of model.feature_extractor.conv_layers, is 1.57% (fires from 5%)" in pr.reason, \
        pr.reason
