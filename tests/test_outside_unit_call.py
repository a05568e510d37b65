"""A module of one FSDP unit called from another unit's forward, outside its own unit's forward: diffusers'
DiTTransformer2DModel computes its final layer's conditioning in the root's forward with
``self.transformer_blocks[0].norm1.emb(...)``, so with each block a unit (as users shard it) that module's parameters
are still sharded there and the first step raises "aten.addmm.default got mixed torch.Tensor and DTensor". A new-user
trial read only torch's words, from the traceback and from ``fsdp-doctor analyze``. The recorder names the module,
its unit and the caller from the traceback, with the fix (the module a unit of its own), in a warning at the exit and
in the analysis' line.

Run as a user would: 2 gloo ranks, a DiT-shaped model; the printed fix pasted before the blocks' fully_shard calls,
the run trains, and its losses are those of the unsharded model on the same data."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO, TWO_RANKS, child_pythonpath, gloo_worker

_MODEL = textwrap.dedent(
    """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class AdaNorm(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.emb = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, d))
            self.norm = nn.LayerNorm(d, elementwise_affine=False)

        def forward(self, x, t):
            return self.norm(x) * (1 + self.emb(t)[:, None])

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.norm1, self.ff = AdaNorm(d), nn.Linear(d, d)

        def forward(self, x, t):
            return x + self.ff(self.norm1(x, t))

    class DiT(nn.Module):  # diffusers' DiTTransformer2DModel: the root reads block 0's embedding for its last layer
        def __init__(self, d=16):
            super().__init__()
            self.proj_in = nn.Linear(4, d)
            self.transformer_blocks = nn.ModuleList(Block(d) for _ in range(2))
            self.proj_out = nn.Linear(d, 4)

        def forward(self, x, t):
            h = self.proj_in(x)
            for blk in self.transformer_blocks:
                h = blk(h, t)
            cond = self.transformer_blocks[0].norm1.emb(t)
            return self.proj_out(h * (1 + cond[:, None]))

    def batches(n):
        g = torch.Generator().manual_seed(0)  # the same batches on every rank and in the reference
        return [(torch.randn(2, 8, 4, generator=g), torch.randn(2, 16, generator=g)) for _ in range(n)]
    """
)

_SCRIPT = _MODEL + textwrap.dedent(
    """
    import json
    import os
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    """
) + gloo_worker(
    """
    model = DiT()
    if fix:
        exec(fix, {"model": model, "fully_shard": fully_shard})  # before the blocks, as printed
    for blk in model.transformer_blocks:
        fully_shard(blk)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    try:
        with fsdp_doctor.watch(model, opt, out_dir=out, profile=False) as doc:
            for x, t in batches(4):
                loss = F.mse_loss(model(x, t), x)
                loss.backward()
                opt.step(), opt.zero_grad(), doc.step()
                losses.append(loss.item())
    except RuntimeError as e:
        print(f"rank {rank} raised: {e}", flush=True)
    if rank == 0:
        open(out + ".losses", "w").write(json.dumps(losses))
    dist.destroy_process_group()
    """
)


def _run(tmp_path, name: str, fix: str = "") -> subprocess.CompletedProcess:
    path = tmp_path / "dit.py"
    path.write_text(_SCRIPT + TWO_RANKS.replace('sys.argv[2] if len(sys.argv) > 2 else ""',
                                                'open(sys.argv[2]).read() if len(sys.argv) > 2 else ""'))
    env = {**os.environ, "PYTHONPATH": child_pythonpath(REPO), "OMP_NUM_THREADS": "1"}
    args = [sys.executable, str(path), str(tmp_path / name)]
    if fix:
        (tmp_path / "fix.py").write_text(fix)
        args.append(str(tmp_path / "fix.py"))
    r = subprocess.run(args, env=env, timeout=300, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.mark.slow
def test_a_blocks_module_called_from_the_root_is_named_with_its_fix(tmp_path):
    import torch
    import torch.nn.functional as F

    r = _run(tmp_path, "broken")
    assert "got mixed torch.Tensor and DTensor" in r.stdout, r.stdout
    said = ("transformer_blocks.0.norm1.emb, inside FSDP unit transformer_blocks.0, was called from the root's "
            "forward, outside transformer_blocks.0's own, where FSDP2 had not gathered its parameters: make it a unit "
            "of its own, fully_shard(model.get_submodule('transformer_blocks.0.norm1.emb')) before your "
            "fully_shard(...) of transformer_blocks.0")
    assert f"fsdp_doctor: {said}" in r.stderr, r.stderr[-3000:]  # at the exit, under the user's traceback
    a = subprocess.run([sys.executable, "-m", "fsdp_doctor.cli", "analyze", str(tmp_path / "broken")],
                       env={**os.environ, "PYTHONPATH": child_pythonpath(REPO)}, capture_output=True, text=True)
    line = a.stdout + a.stderr
    assert a.returncode != 0 and len(line.strip().splitlines()) == 1 and "Traceback" not in line, line
    assert "before its first doctor.step(), so no step was recorded: RuntimeError: aten.addmm" in line, line
    assert said in line, line

    fix = re.search(r"fully_shard\(model\.get_submodule\('[^']+'\)\)", line).group(0)
    fixed = _run(tmp_path, "fixed", fix)
    assert "raised" not in fixed.stdout, fixed.stdout
    losses = json.loads((tmp_path / "fixed.losses").read_text())
    # the unsharded model on the same batches: the nested unit, called twice a step, trains as the plain module does
    scope: dict = {}
    exec(_MODEL, scope)
    torch.manual_seed(0)
    ref = scope["DiT"]()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = []
    for x, t in scope["batches"](4):
        loss = F.mse_loss(ref(x, t), x)
        loss.backward()
        opt.step(), opt.zero_grad()
        want.append(loss.item())
    assert losses == pytest.approx(want, rel=1e-5), (losses, want)
    import fsdp_doctor

    rep = fsdp_doctor.build_report(fsdp_doctor.load_run(tmp_path / "fixed"))
    assert "transformer_blocks.0.norm1.emb" in {u.name for u in rep.units}
