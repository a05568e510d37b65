"""A module of one FSDP unit called from another unit's forward, outside its own unit's forward: diffusers'
DiTTransformer2DModel computes its final layer's conditioning in the root's forward with
``self.transformer_blocks[0].norm1.emb(...)``, so with each block a unit (as users shard it) that module's parameters
are still sharded there and the first step raises "aten.addmm.default got mixed torch.Tensor and DTensor". A new-user
trial read only torch's words, from the traceback and from ``fsdp-doctor analyze``. The recorder names the module,
its unit and the caller from the traceback, with the fix (the module a unit of its own), in a warning at the exit and
in the analysis' line.

So too a method of a unit's module called in place of its forward (a diffusers AutoencoderKL trained with
``model.encode(x)`` then ``model.decode(z)``): the method, the module that raised and register_fsdp_forward_method.

Run as a user would: 2 gloo ranks, a DiT-shaped and a VAE-shaped model; the printed fix pasted where it says, the run
trains, and its losses are those of the unsharded model on the same data."""

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

    def loss_of(model, x, t):
        return F.mse_loss(model(x, t), x)
    """
)


def _script(model: str, setup: str, optimizer: str = "torch.optim.SGD(model.parameters(), lr=0.1)") -> str:
    """A TWO_RANKS script training ``model``'s source (its batches and loss_of) 4 steps under the doctor, the model
    built and sharded by ``setup`` (``fix``: the printed fix to paste), each rank's exception printed."""
    return model + textwrap.dedent(
        """
        import json
        import os
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard
        """
    ) + gloo_worker(textwrap.dedent(setup) + textwrap.dedent(
        """
        opt = OPTIMIZER
        losses = []
        try:
            with fsdp_doctor.watch(model, opt, out_dir=out, profile=False) as doc:
                for batch in batches(4):
                    loss = loss_of(model, *batch)
                    loss.backward()
                    opt.step(), opt.zero_grad(), doc.step()
                    losses.append(loss.item())
        except RuntimeError as e:
            print(f"rank {rank} raised: {e}", flush=True)
        if rank == 0:
            open(out + ".losses", "w").write(json.dumps(losses))
        # (every rank done before rank 0's process, which holds the job's store, ends: rank 0's loop raising at once
        # left rank 1's watch() reading rank 0's run id from a store gone, its records not written)
        dist.barrier()
        dist.destroy_process_group()
        """).replace("OPTIMIZER", optimizer))


def _unsharded_losses(model: str, cls: str) -> list[float]:
    """The losses of ``model``'s source, unsharded in this process, on the same batches."""
    import torch

    scope: dict = {}
    exec(model, scope)
    torch.manual_seed(0)
    ref = scope[cls]()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = []
    for batch in scope["batches"](4):
        loss = scope["loss_of"](ref, *batch)
        loss.backward()
        opt.step(), opt.zero_grad()
        want.append(loss.item())
    return want


def _analyzed(run) -> str:
    """``fsdp-doctor analyze``'s one line on a run that raised before its first step."""
    a = subprocess.run([sys.executable, "-m", "fsdp_doctor.cli", "analyze", str(run)],
                       env={**os.environ, "PYTHONPATH": child_pythonpath(REPO)}, capture_output=True, text=True)
    line = a.stdout + a.stderr
    assert a.returncode != 0 and len(line.strip().splitlines()) == 1 and "Traceback" not in line, line
    return line


_SCRIPT = _script(_MODEL, """
    model = DiT()
    if fix:
        exec(fix, {"model": model, "fully_shard": fully_shard})  # before the blocks, as printed
    for blk in model.transformer_blocks:
        fully_shard(blk)
    fully_shard(model)
    """)


def _run(tmp_path, name: str, fix: str = "", script: str = _SCRIPT) -> subprocess.CompletedProcess:
    path = tmp_path / "dit.py"
    path.write_text(script + TWO_RANKS.replace('sys.argv[2] if len(sys.argv) > 2 else ""',
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
    r = _run(tmp_path, "broken")
    assert "got mixed torch.Tensor and DTensor" in r.stdout, r.stdout
    said = ("transformer_blocks.0.norm1.emb, inside FSDP unit transformer_blocks.0, was called from the root's "
            "forward, outside transformer_blocks.0's own, where FSDP2 had not gathered its parameters: make it a unit "
            "of its own, fully_shard(model.get_submodule('transformer_blocks.0.norm1.emb')) before your "
            "fully_shard(...) of transformer_blocks.0")
    assert f"fsdp_doctor: {said}" in r.stderr, r.stderr[-3000:]  # at the exit, under the user's traceback
    line = _analyzed(tmp_path / "broken")
    assert "before its first doctor.step(), so no step was recorded: RuntimeError: aten.addmm" in line, line
    assert said in line, line

    fix = re.search(r"fully_shard\(model\.get_submodule\('[^']+'\)\)", line).group(0)
    fixed = _run(tmp_path, "fixed", fix)
    assert "raised" not in fixed.stdout, fixed.stdout
    losses = json.loads((tmp_path / "fixed.losses").read_text())
    # the unsharded model on the same batches: the nested unit, called twice a step, trains as the plain module does
    want = _unsharded_losses(_MODEL, "DiT")
    assert len(losses) == 4 and losses == pytest.approx(want, rel=1e-5), (losses, want)
    import fsdp_doctor

    rep = fsdp_doctor.build_report(fsdp_doctor.load_run(tmp_path / "fixed"))
    assert "transformer_blocks.0.norm1.emb" in {u.name for u in rep.units}


# a diffusers AutoencoderKL's shape: trained with encode() then decode(), never its forward; encode() returns an object
# holding a distribution, built from _encode()'s tensor; the whole model one unit
_VAE = textwrap.dedent(
    """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Posterior:  # diffusers' DiagonalGaussianDistribution
        def __init__(self, moments):
            self.mean, self.logvar = moments.chunk(2, dim=-1)

        def sample(self, noise):
            return self.mean + torch.exp(0.5 * self.logvar) * noise

        def kl(self):
            return 0.5 * (self.mean ** 2 + self.logvar.exp() - 1 - self.logvar).sum(-1)

    class VAE(nn.Module):
        def __init__(self, d=16):
            super().__init__()
            self.enc_in, self.to_moments = nn.Linear(4, d), nn.Linear(d, 4)
            self.enc_blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(2))
            self.dec_in, self.dec_out = nn.Linear(2, d), nn.Linear(d, 4)
            self.dec_blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(2))

        def _encode(self, x):
            h = self.enc_in(x)
            for blk in self.enc_blocks:
                h = h + torch.tanh(blk(h))
            return self.to_moments(h)

        def encode(self, x):
            return Posterior(self._encode(x))

        def decode(self, z):
            h = self.dec_in(z)
            for blk in self.dec_blocks:
                h = h + torch.tanh(blk(h))
            return self.dec_out(h)

        def forward(self, x, noise):
            return self.decode(self.encode(x).sample(noise))

    def batches(n):
        g = torch.Generator().manual_seed(0)  # the same batches on every rank and in the reference
        return [(torch.randn(2, 8, 4, generator=g), torch.randn(2, 8, 2, generator=g)) for _ in range(n)]

    def loss_of(model, x, noise):
        post = model.encode(x)
        return F.mse_loss(model.decode(post.sample(noise)), x) + 1e-3 * post.kl().mean()
    """
)

_VAE_SCRIPT = _script(_VAE, """
    model = VAE()
    fully_shard(model)
    if fix:
        exec(fix, {"model": model})  # after the fully_shard calls, as printed
    """)


@pytest.mark.slow
def test_a_method_called_in_place_of_forward_is_named_with_its_fix(tmp_path):
    """The root's encode() runs its own enc_in, through _encode(), without FSDP2's pre-forward: named, with
    register_fsdp_forward_method for _encode(), which pasted trains as the unsharded model does (decode() then finds
    the root gathered). encode() registered instead trains nothing: it returns no tensor for FSDP2's backward hooks,
    so the gradients never leave the gathered parameters (its losses would differ here)."""
    r = _run(tmp_path, "broken", script=_VAE_SCRIPT)
    assert "got mixed torch.Tensor and DTensor" in r.stdout, r.stdout
    said = ("model.encode() calls model._encode(), which ran the root unit's modules (enc_in raised) outside its "
            "forward, where FSDP2 gathers their parameters. After your fully_shard calls, "
            "register_fsdp_forward_method(model, '_encode') (from torch.distributed.fsdp) gathers them for _encode() "
            "too (the innermost: FSDP2 hooks its backward to the tensors the method returns, and the root stays "
            "gathered for the calls after it)")
    assert f"fsdp_doctor: {said}" in r.stderr, r.stderr[-3000:]
    line = _analyzed(tmp_path / "broken")
    assert said in line, line

    fix = ("from torch.distributed.fsdp import register_fsdp_forward_method\n"
           + re.search(r"register_fsdp_forward_method\(model, '\w+'\)", line).group(0))
    fixed = _run(tmp_path, "fixed", fix, script=_VAE_SCRIPT)
    assert "raised" not in fixed.stdout, fixed.stdout
    losses = json.loads((tmp_path / "fixed.losses").read_text())
    want = _unsharded_losses(_VAE, "VAE")
    assert len(losses) == 4 and losses == pytest.approx(want, rel=1e-5), (losses, want)


@pytest.mark.slow
def test_the_outer_method_registered_trains_nothing_and_the_diagnosis_says_why(tmp_path):
    """encode() registered instead (it returns an object, no tensor for FSDP2's backward hooks), the whole model one
    unit, AdamW: FSDP2's post-backward never runs, the gradients stay on the gathered parameters and nothing trains.
    optim.no_gradients says so, naming the registered method and the one to register; memory.grads_kept stays quiet
    (it read the unreduced gradients as "zeroed in place instead of freed")."""
    import fsdp_doctor

    script = _script(_VAE, """
        model = VAE()
        fully_shard(model)
        exec(fix, {"model": model})
        """, optimizer="torch.optim.AdamW(model.parameters(), lr=1e-3)")
    _run(tmp_path, "outer", "from torch.distributed.fsdp import register_fsdp_forward_method\n"
                            "register_fsdp_forward_method(model, 'encode')", script=script)
    rep = fsdp_doctor.build_report(fsdp_doctor.load_run(tmp_path / "outer"))
    found = {f.code: f for f in rep.findings}
    f = found["optim.no_gradients"]
    assert f.evidence["unsharded_grads_held_bytes"] > 0, f.evidence
    assert "FSDP2's post-backward, which reduce-scatters them into the sharded parameters the optimizer steps, never " \
           "ran" in f.recommendation.text, f.recommendation.text
    assert "encode() of the model ran as forward (register_fsdp_forward_method)" in f.recommendation.text
    assert "memory.grads_kept" not in found, found["memory.grads_kept"].recommendation.text
