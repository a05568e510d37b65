"""wrap.too_fine on a model without repeated blocks: a U-Net whose every layer is an FSDP unit (``enc1.conv1``,
``enc1.bn``, ...). Its plan grouped the units by repeated block, found none, kept every leaf its unit ("18 units ->
~18") and, pasted, changed nothing (a new-user trial). The modules holding two or more of the units (``enc1``,
``enc2``, ...) become the units; a layer alone in its parent (``up2``, ``out``) stays one. Run as a user would: one
gloo rank, the fix executed as printed in place of the leaf wrapping, the model sharded by it and trained again."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class ConvBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv1, self.bn, self.conv2 = nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), \
            nn.Conv2d(cout, cout, 3, padding=1)

    def forward(self, x):
        return F.relu(self.conv2(F.relu(self.bn(self.conv1(x)))))


class UNet(nn.Module):
    def __init__(self, c=8):
        super().__init__()
        self.enc1, self.enc2, self.mid = ConvBlock(3, c), ConvBlock(c, 2 * c), ConvBlock(2 * c, 4 * c)
        self.up2 = nn.ConvTranspose2d(4 * c, 2 * c, 2, stride=2)
        self.dec2 = ConvBlock(4 * c, 2 * c)
        self.up1 = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        self.dec1 = ConvBlock(2 * c, c)
        self.out = nn.Conv2d(c, 3, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        m = self.mid(F.max_pool2d(e2, 2))
        d2 = self.dec2(torch.cat([self.up2(m), e2], 1))
        return self.out(self.dec1(torch.cat([self.up1(d2), e1], 1)))


def _train(model, out):
    import fsdp_doctor

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with fsdp_doctor.watch(model, opt, out_dir=out, profile=False, memory=False) as doc:
        for _ in range(6):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            doc.step()
    return fsdp_doctor.build_report(fsdp_doctor.load_run(out))


def test_too_fine_on_a_unet_groups_the_layers_by_the_modules_holding_them(tmp_path, gloo_one_rank):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    leaves = UNet()
    for m in leaves.modules():  # every module holding parameters of its own a unit
        if m is not leaves and any(True for _ in m.parameters(recurse=False)):
            fully_shard(m)
    fully_shard(leaves)
    rep = _train(leaves, tmp_path / "leaves")
    f = next(f for f in rep.findings if f.code == "wrap.too_fine")
    code = f.recommendation.code
    assert "(18 units -> 8)" in code, code
    calls = [ln for ln in code.splitlines() if ln.startswith("fully_shard(")]
    assert calls == [f"fully_shard(model.{n}, mesh=mesh)" for n in
                     ("enc1", "enc2", "mid", "dec2", "dec1", "up2", "up1", "out")] + ["fully_shard(model, mesh=mesh)"]
    torch.manual_seed(0)
    fixed = UNet()
    exec(code, {"model": fixed})  # in place of the leaf wrapping, as printed
    rep = _train(fixed, tmp_path / "fixed")
    assert len(rep.units) == 9 and "wrap.too_fine" not in {g.code for g in rep.findings}, [u.name for u in rep.units]
