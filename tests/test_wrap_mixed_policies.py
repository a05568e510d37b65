"""wrap.params_in_root's plan on a model whose units had different MixedPrecisionPolicies, as a new-user trial's
knob had it: every block (and the embedding) ``MixedPrecisionPolicy(bf16, fp32)``, the root the same with
``output_dtype=float32``, and the root holding only the final norm and head, after its last unit. The plan gave every
unit one ``mp``, the root's (its output cast on every block), and put the norm and head under "a new unit before the
blocks": the recorder had read no trailing module where the root held nothing before its first unit.

Run as a user would: 2 gloo ranks, the printed plan executed in place of the fully_shard calls in a fresh run, each
unit's policy read back from its FSDP state (the recorder's snapshot of it)."""

from __future__ import annotations

import textwrap

import pytest

from conftest import record_two_ranks

_SCRIPT = textwrap.dedent(
    """
    import os
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln, self.fc1, self.fc2 = nn.LayerNorm(48), nn.Linear(48, 144), nn.Linear(144, 48)

        def forward(self, x):
            return x + self.fc2(torch.relu(self.fc1(self.ln(x))))

    class Model(nn.Module):  # (the trial's knobs.py)
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(101, 48)
            self.blocks = nn.ModuleList(Block() for _ in range(3))
            self.shared = Block()
            self.norm = nn.LayerNorm(48)
            self.head = nn.Linear(48, 101, bias=False)

        def forward(self, tok):
            x = self.emb(tok)
            for b in self.blocks:
                x = b(x)
            return self.head(self.norm(self.shared(x)))

    def sharded(fix):  # the trial's sharding, or the fix printed for it in its place
        torch.manual_seed(0)
        model = Model()
        if fix:
            exec(open(fix).read(), {"model": model})
            return model
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for m in [model.emb, *model.blocks, model.shared]:
            fully_shard(m, mp_policy=mp)
        return fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                 reduce_dtype=torch.float32,
                                                                 output_dtype=torch.float32))

    def worker(rank, port, out, fix):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=2)
        import fsdp_doctor
        model = sharded(fix)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1 + rank)
        with fsdp_doctor.watch(model, opt, out_dir=out, profile=False) as doc:
            for _ in range(4):
                tok = torch.randint(0, 101, (2, 25), generator=g)
                logits = model(tok[:, :-1]).float()
                nn.functional.cross_entropy(logits.flatten(0, 1), tok[:, 1:].flatten()).backward()
                opt.step(), opt.zero_grad(), doc.step()
        dist.destroy_process_group()
    """
)


def _policies(report) -> dict[str, tuple]:
    """Each module a unit was applied to (the root ""), with its unit's (param, reduce, output) dtypes."""
    return {m: (u.param_dtype, u.reduce_dtype, u.output_dtype) for u in report.units for m in u.modules}


@pytest.mark.slow
def test_params_in_root_plan_keeps_each_units_policy_and_trails_the_head(tmp_path):
    run = record_two_ranks(tmp_path, _SCRIPT, "run")
    root = next(u for u in run.units if u.is_root)
    # the norm and head come after the root's last unit (read as none: the root holds nothing before its first)
    assert (root.own_modules, root.leading_modules, root.trailing_modules) == (["norm", "head"], [], ["norm", "head"])
    (f,) = [f for f in run.findings if f.code == "wrap.params_in_root"]
    code = f.recommendation.code
    assert "# last in forward, first in backward: one unit, kept gathered after forward\n" \
        "fully_shard([model.norm, model.head], mesh=mesh,\n            mp_policy=mp_policy,\n" in code, code
    assert "before the blocks" not in code, code

    fix = tmp_path / "fix.py"
    fix.write_text(code)
    fixed = record_two_ranks(tmp_path, _SCRIPT, "fixed", str(fix))
    kid, top = ("bfloat16", "float32", None), ("bfloat16", "float32", "float32")
    # the blocks keep theirs (no float32 output cast), the norm and head split off the root take the root's dtypes
    # (its output cast stays on the model's output), and the root keeps its own, output_dtype included
    assert _policies(run) == {"": top, "emb": kid, "blocks.0": kid, "blocks.1": kid, "blocks.2": kid, "shared": kid}
    assert _policies(fixed) == {**_policies(run), "norm": kid, "head": kid}
    assert "wrap.params_in_root" not in {g.code for g in fixed.findings}
