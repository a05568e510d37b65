"""optim.before_shard's fix applied in this process (one gloo rank): the optimizer the user built before sharding,
with its groups and an LR scheduler, pointed at the sharded parameters. (Apart from tests/test_diagnose_rules.py,
whose findings tests/test_clients.py replays on the reference GPT: this test's own real run has findings of its
own model.)"""

from __future__ import annotations

import msgspec
import pytest

from fsdp_doctor.diagnose.snippets import SHARDING_GOES_HERE
from fsdp_doctor.records import OptimizerGroup
from test_diagnose_rules import build, run_rule


def test_optimizer_before_shard_fix_keeps_groups_and_scheduler(tmp_path):
    """The fix, pasted around fully_shard on a model whose optimizer (two groups, weight decay off for 1-D
    parameters) and LR scheduler were built before sharding: the same optimizer object then holds the sharded
    parameters, group by group, trains them, and the scheduler still drives it. Rebuilding the optimizer from
    model.parameters() (the old fix) lost the groups and left the scheduler on the stale optimizer."""
    import os

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from fsdp_doctor.record.config_snapshot import optimizer_groups
    from fsdp_doctor.workloads import free_port

    groups = [OptimizerGroup(params=2, options={"lr": 1e-3, "weight_decay": 0.1}),
              OptimizerGroup(params=3, options={"lr": 1e-3, "weight_decay": 0.0})]
    ctx, _ = build(optimizer_foreign_params=5, optimizer_foreign_bytes=4_000, optimizer_groups=groups)
    (f,) = run_rule("optim.before_shard", ctx)
    assert "keeping its 2 parameter groups (weight_decay 0.1 and 0)" in f.recommendation.text
    before, after = f.recommendation.code.split(SHARDING_GOES_HERE)
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
        ps = list(model.parameters())
        optimizer = torch.optim.AdamW([{"params": [p for p in ps if p.ndim >= 2], "weight_decay": 0.1},
                                       {"params": [p for p in ps if p.ndim < 2], "weight_decay": 0.0}], lr=1e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
        assert msgspec.to_builtins(optimizer_groups(optimizer)) == [
            {"params": 2, "options": {"lr": 1e-3, "weight_decay": 0.1, "betas": [0.9, 0.999], "eps": 1e-8,
                                      "initial_lr": 1e-3}, "flags": {"foreach": None, "fused": None}},
            {"params": 4, "options": {"lr": 1e-3, "weight_decay": 0.0, "betas": [0.9, 0.999], "eps": 1e-8,
                                      "initial_lr": 1e-3}, "flags": {"foreach": None, "fused": None}}]
        ns = {"model": model, "optimizer": optimizer}
        exec(before, ns)
        fully_shard(model[0])
        fully_shard(model)
        exec(after, ns)
        assert ns["optimizer"] is optimizer and scheduler.optimizer is optimizer
        own = dict(model.named_parameters())
        assert [[id(p) for p in g["params"]] for g in optimizer.param_groups] == [
            [id(own[n]) for n in ("0.weight", "2.weight")], [id(own[n]) for n in ("0.bias", "1.weight", "1.bias", "2.bias")]]
        assert all(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"])
        assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
        w = own["0.weight"].detach().clone()
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        scheduler.step()
        assert not torch.equal(w.full_tensor(), own["0.weight"].detach().full_tensor())  # the model trains
        assert [g["lr"] for g in optimizer.param_groups] == [5e-4, 5e-4]  # the scheduler drives it
        # the run records the groups: the header and the dashboard's facts name them
        import fsdp_doctor
        from fsdp_doctor.dashboards.pages.overview import run_facts as dash_facts
        from fsdp_doctor.present.fmt import run_facts

        with fsdp_doctor.watch(model, optimizer, out_dir=tmp_path / "run", profile=False, memory=False) as doctor:
            for _ in range(2):
                model(torch.randn(4, 8)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
                doctor.step()
        facts = fsdp_doctor.build_report(fsdp_doctor.load_run(tmp_path / "run")).run
        assert [(g.params, g.options["weight_decay"], g.options["lr"]) for g in facts.optimizer_groups] == [
            (2, 0.1, 5e-4), (4, 0.0, 5e-4)]
        assert "AdamW for-loop (2 param groups)" in run_facts(facts)  # (the CPU's default)
        assert "AdamW for-loop (2 param groups)" in str(dash_facts(facts))
    finally:
        dist.destroy_process_group()


def test_optimizer_before_shard_fix_under_checkpoint_wrapper(gloo_one_rank):
    """The fix pasted around a loop that checkpoint_wraps each layer and fully_shards it (a new-user trial:
    KeyError 'layers.0.attn_norm.weight', the names after the wrapper being 'layers.0._checkpoint_wrapped_module.
    attn_norm.weight'): the optimizer then holds the model's sharded parameters, in order, and trains them."""
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    ctx, _ = build(optimizer_foreign_params=4, optimizer_foreign_bytes=4_000)
    (f,) = run_rule("optim.before_shard", ctx)
    before, after = f.recommendation.code.split(SHARDING_GOES_HERE)
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 8))
                                       for _ in range(2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ns = {"model": model, "optimizer": optimizer}
    exec(before, ns)
    for i, layer in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(layer)
        fully_shard(model.layers[i])
    fully_shard(model)
    names = [n for n, _ in model.named_parameters()]
    assert names[0] == "layers.0._checkpoint_wrapped_module.0.weight"  # the names the old fix looked up failed
    exec(after, ns)
    (group,) = optimizer.param_groups
    assert [id(p) for p in group["params"]] == [id(p) for p in model.parameters()]
    assert all(isinstance(p, DTensor) for p in group["params"])
    w = model.layers[1]._checkpoint_wrapped_module[1].weight
    before_step = w.detach().full_tensor().clone()
    x = torch.randn(4, 8)
    for layer in model.layers:
        x = layer(x)
    x.sum().backward()
    optimizer.step()
    assert not torch.equal(before_step, w.detach().full_tensor())  # the model trains
