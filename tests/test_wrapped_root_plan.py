"""watch() given a module holding the sharded network (a LightningModule: its configure_model shards ``self.model``,
its training_step calls ``self.model(...)``): the run's root unit is ``model.model``, and the sharding plans' last
line, ``fully_shard(model)``, sharded the holder itself. Pasted into a Lightning Trainer's configure_model (a new-user
trial, 2 gloo ranks), the holder's forward never ran: 6 independent FSDP roots (wrap.root_not_sharded), the peak
4.65 MiB where 3.93 MiB was predicted. The plan now shards the root the run had; pasted as printed, wrap.params_in_root
and wrap.root_not_sharded are quiet and the root unit is ``model``."""

from __future__ import annotations

import textwrap

import pytest

from conftest import TINY_LM, gloo_worker, record_two_ranks
from fsdp_doctor import load_run

_SCRIPT = TINY_LM + textwrap.dedent(
    """
    import os
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard


    class Holder(nn.Module):  # a LightningModule's shape
        def __init__(self):
            super().__init__()
            self.model = Net()

        def configure_model(self, fix):
            if fix:  # in place of the fully_shard calls, as printed
                exec(open(fix).read(), {"model": self})
            else:
                for b in self.model.blocks:
                    fully_shard(b)
                fully_shard(self.model)

        def training_step(self, x):
            return F.cross_entropy(self.model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
    """
) + gloo_worker(
    """
    module = Holder()
    module.configure_model(fix)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1 + rank)
    with fsdp_doctor.watch(module, opt, out_dir=out, profile=False, capacity_bytes=64 << 20) as doc:
        for x in torch.randint(0, V, (6, 4, 17), generator=g):
            module.training_step(x).backward()
            opt.step(), opt.zero_grad(), doc.step()
    dist.destroy_process_group()
    """
)


@pytest.mark.long
def test_plan_shards_the_runs_root_not_the_module_holding_it(tmp_path):
    before = record_two_ranks(tmp_path, _SCRIPT, "holder")
    (f,) = [f for f in before.findings if f.code == "wrap.params_in_root"]
    code = f.recommendation.code
    assert code.rstrip().endswith("fully_shard(model.model, mesh=mesh)"), code

    fix = tmp_path / "fix.py"
    fix.write_text(code)
    after = record_two_ranks(tmp_path, _SCRIPT, "fixed", str(fix))
    assert {"model", "model.emb", "model.head", "model.blocks.0"} <= {u.name for u in after.units}
    assert not {"wrap.params_in_root", "wrap.root_not_sharded"} & {g.code for g in after.findings}


_EVAL_SCRIPT = TINY_LM + textwrap.dedent(
    """
    import os
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.fsdp import FSDPModule, fully_shard


    class Holder(nn.Module):  # a LightningModule's shape: a forward of its own, which the steps do not call
        def __init__(self):
            super().__init__()
            self.model = Net()

        def forward(self, x):
            return self.model(x)

        def step_loss(self, x):  # training_step and validation_step call self.model
            return F.cross_entropy(self.model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
    """
) + gloo_worker(
    """
    module = Holder()
    for b in module.model.blocks:
        fully_shard(b)
    fully_shard(module.model)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1 + rank)
    val = torch.randint(0, V, (3, 4, 17), generator=torch.Generator().manual_seed(99))
    fixed = open(fix).read().split("with torch.no_grad():\\n    evaluate()\\n") if fix else None
    with fsdp_doctor.watch(module, opt, out_dir=out, profile=False, capacity_bytes=64 << 20) as doc:
        for i, x in enumerate(torch.randint(0, V, (8, 4, 17), generator=g)):
            if i in (3, 6):  # Lightning's validation loop: inference_mode, self.model per batch
                if fixed:  # the fix around the evaluation, as printed (on_validation_start / _end)
                    exec(fixed[0], {"model": module})
                with torch.inference_mode():
                    for v in val:
                        module.step_loss(v)
                if fixed:
                    exec(fixed[0].split("# every unit")[0] + fixed[1], {"model": module})
            module.step_loss(x).backward()
            opt.step(), opt.zero_grad(), doc.step()
    dist.destroy_process_group()
    """
)


@pytest.mark.long
def test_evaluation_through_the_held_root_is_counted_apart_and_its_fix_runs_on_that_root(tmp_path):
    """A LightningModule's validation_step calls ``self.model`` under inference_mode, the watched module's own forward
    never running: its forwards read as time outside the model (a new-user trial's Lightning Trainer: 41.8 ms outside
    at the step after each validation, jitter.data_wait at 16%). Now each is a forward without gradients, counted
    apart (3 per evaluation, steps 3 and 6), and eval.regather's fix keeps the root it names gathered: pasted around
    the evaluation it read ``model.set_reshard_after_forward(False)``, which a LightningModule has not; now
    ``model.model.set_...``, and rerun as printed the finding is gone and no other one is new."""
    before = record_two_ranks(tmp_path, _EVAL_SCRIPT, "eval")
    for rank, ng in before.steps.no_grad.items():
        assert ng.steps == [3, 6] and ng.forwards == 6, (rank, ng)
    (f,) = [f for f in before.findings if f.code == "eval.regather"]
    code = f.recommendation.code
    assert "\nmodel.model.set_reshard_after_forward(False)\n" in code, code
    # the evaluations' time is theirs, not time outside the model (which read 41.8 ms at the trial's steps after each
    # validation); jitter.data_wait itself is not asserted on: this 30 ms step's own loop (the loss, the batch's
    # slicing) sits at 13-17% outside the model from run to run, either side of the 15% it fires from
    for rank, rd in load_run(tmp_path / "eval").ranks.items():
        for s in rd.steps:
            if s.step in (3, 6):
                assert s.outside_ms < s.no_grad_ms / 4, (rank, s.step, s.outside_ms, s.no_grad_ms)

    fix = tmp_path / "fix.py"
    fix.write_text(code)
    after = record_two_ranks(tmp_path, _EVAL_SCRIPT, "fixed", str(fix))
    assert "eval.regather" not in {g.code for g in after.findings}
    new = {g.code for g in after.findings if g.severity != "info"} - {g.code for g in before.findings}
    assert not new - {"jitter.gc", "straggler.rank", "straggler.intermittent", "jitter.data_wait"}, new
