"""Trainable parameters the optimizer does not hold (RunConfig.untrained, optim.untrained_params): three real 2-rank
runs of the reference GPT (gloo, CPU), the optimizer built over the last block and the head only:

* ``top``: the rest keeps requires_grad=True and nothing updates it: counted exactly, its gradient shards kept,
  unchanged by the third step; the rule fires, its frozen prefix the units before the last block;
* ``two``: a second optimizer (not given to watch()) steps the rest: its values change, and the rule stays quiet
  saying why (a finding there would be a false alarm);
* ``fixed``: the rule's own code pasted after the optimizer: nothing outside it is trainable any more;
* ``sync_off``: the optimizer over every parameter, FSDP2's gradient sync switched off and never back on: no gradient
  reaches the optimizer (optim.no_gradients, critical; quiet on the others, whose optimizer holds state).

The matrix rows gpt_top_optimizer and hf_llama_top_optimizer recheck the fix's peak and step (tests/scenario_matrix.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import async_gather_slack, child_pythonpath, run_one_rank

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

_SCRIPT = textwrap.dedent(
    """
    import os, socket, sys
    import torch, torch.distributed as dist, torch.multiprocessing as mp, torch.nn.functional as F

    def main(rank, port, variant, out, fix):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=2)
        import fsdp_doctor
        from fsdp_doctor.workloads import WorkloadConfig, build_model
        from fsdp_doctor.workloads.data import batches
        from fsdp_doctor.workloads.sharding import apply_fsdp

        cfg = WorkloadConfig(steps=5, async_unshard=True)
        torch.manual_seed(0)
        model = build_model(cfg)
        apply_fsdp(model, cfg)
        top = [p for n, p in model.named_parameters()
               if variant == "sync_off" or n.startswith(("layers.3.", "norm.", "lm_head."))]
        optimizer = torch.optim.AdamW(top, lr=1e-3, foreach=True)
        others = [p for p in model.parameters() if all(p is not q for q in top)]
        rest = torch.optim.SGD(others, lr=1e-2) if others else None
        if variant == "fixed":
            exec(fix, {"model": model, "optimizer": optimizer})
        if variant == "sync_off":
            model.set_requires_gradient_sync(False)
        data = batches(cfg, rank)
        with fsdp_doctor.watch(model, optimizer, out_dir=out, profile=False) as doctor:
            for step in range(cfg.steps):
                tok, tgt = next(data)
                F.cross_entropy(model(tok).float().flatten(0, 1), tgt.flatten()).backward()
                optimizer.step()
                optimizer.zero_grad()
                if variant == "two":
                    rest.step()
                    rest.zero_grad()
                doctor.step()
        dist.barrier()  # (every rank past its last collective before either tears gloo down)
        dist.destroy_process_group()
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(0)  # (no interpreter teardown: gloo's threads abort it now and then, "terminate called without...")

    if __name__ == "__main__":
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        fix = open(sys.argv[3]).read() if len(sys.argv) > 3 else ""
        mp.spawn(main, args=(port, sys.argv[1], sys.argv[2], fix), nprocs=2)
    """
)


def _run(tmp: Path, variant: str, fix: str = ""):
    from fsdp_doctor import build_report, load_run

    script, out = tmp / "run.py", tmp / variant
    script.write_text(_SCRIPT)
    args = [sys.executable, str(script), variant, str(out)]
    if fix:
        (tmp / "fix.py").write_text(fix)
        args.append(str(tmp / "fix.py"))
    env = {**os.environ, "PYTHONPATH": child_pythonpath(REPO), "OMP_NUM_THREADS": "1"}
    for attempt in range(2):  # (the free port the script picked may be taken before its ranks bind it: once more)
        done = subprocess.run(args, env=env, timeout=300, capture_output=True, text=True)
        if done.returncode == 0 or "in use" not in done.stderr or attempt:
            break
    assert done.returncode == 0, done.stderr[-3000:]
    run = load_run(out)
    return run, build_report(run)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("untrained")
    top = _run(tmp, "top")
    (f,) = [f for f in top[1].findings if f.code == "optim.untrained_params"]
    return {"top": top, "two": _run(tmp, "two"), "fixed": _run(tmp, "fixed", f.recommendation.code), "finding": f,
            "sync_off": _run(tmp, "sync_off")}


def test_parameters_outside_the_optimizer_counted_exactly(runs):
    from fsdp_doctor.workloads import WorkloadConfig, build_model

    model = build_model(WorkloadConfig())
    rest = {n: p for n, p in model.named_parameters() if not n.startswith(("layers.3.", "norm.", "lm_head."))}
    for rank, rd in runs["top"][0].ranks.items():
        ut = rd.config.untrained
        assert ut.tensors == ut.with_grad == len(rest) and ut.param_count == sum(p.numel() for p in rest.values())
        assert ut.names[:3] == list(rest)[:3] and ut.changed is False
        # the gradient shards kept: a rank's shards of every such parameter, fp32 (dim-0 shards of 2 ranks)
        local = sum(4 * (p.shape[0] // 2 if rank == 0 else p.shape[0] - p.shape[0] // 2) * p[0].numel()
                    for p in rest.values())
        assert abs(ut.grad_bytes - local) <= 4 * 2 * len(rest) * 512  # (uneven rows: a row each at most)
        assert set(ut.units) == {"tok_emb, pos_emb", "layers.0", "layers.1", "layers.2"}
        assert all(trained == 0 for _, trained in ut.units.values())


def test_the_rule_fires_with_its_frozen_prefix_and_a_ceiling(runs):
    f = runs["finding"]
    assert f.severity == "warning" and f.recommendation.where == "optimizer"
    # the share in the title as it is: 99.6% read "100%", as if the optimizer trained nothing (a new-user trial)
    share = f.evidence["share_of_trainable"]
    assert 0 < share < 1 and f.title.startswith(f"{100 * share:.0f}% of the trainable parameters" if share < 0.995
                                                  else f"{100 * share:.1f}% of the trainable parameters"), f.title
    assert f.evidence["frozen_prefix_units"] == ["tok_emb, pos_emb", "layers.0", "layers.1", "layers.2"]
    assert f.evidence["frozen_prefix_activation_bytes"] > 0 and f.predicted.at_most
    assert f.predicted.peak_bytes_after < f.predicted.peak_bytes_before - f.evidence["grad_bytes_kept"]
    # memory.grads_kept leaves these gradients to this rule (its zero_grad fix would not free them)
    assert "memory.grads_kept" not in {x.code for x in runs["top"][1].findings}


def test_parameters_another_optimizer_steps_are_no_finding(runs):
    run, rep = runs["two"]
    assert all(rd.config.untrained.changed is True for rd in run.ranks.values())
    why = next(s.reason for s in rep.rules if s.code == "optim.untrained_params")
    assert "change between steps" in why and "optim.untrained_params" not in {x.code for x in rep.findings}
    # the memory section says its optimizer state is the watched optimizer's only (a new-user trial's second
    # optimizer's momentum was missing from it, said only under --explain)
    ut = run.config.untrained
    for pr in rep.memory.per_rank.values():
        assert any(n.startswith(f"optimizer state is the watched optimizer's ({run.config.optimizer}): {ut.tensors} "
                                f"trainable parameter(s) ({ut.param_count:,} elements) outside it change") for n in
                   pr.notes or []), pr.notes


def test_the_fix_leaves_nothing_outside_the_optimizer(runs):
    run, rep = runs["fixed"]
    assert all(rd.config.untrained.tensors == 0 for rd in run.ranks.values())
    assert "optim.untrained_params" not in {x.code for x in rep.findings}
    # frozen, the prefix runs no backward: the fix also takes the last frozen unit out of the first trained unit's
    # backward prefetch (FSDP2's default gathered layers.2 in every backward for nothing: prefetch.frozen_gathered,
    # a warning on the H200's rerun of gpu_gpt_top_optimizer)
    assert ("unit = model.get_submodule('layers.3')\n# itself: gathered already, nothing to gather\n"
            "unit.set_modules_to_backward_prefetch([unit])") in runs["finding"].recommendation.code
    assert "prefetch.frozen_gathered" not in {x.code for x in rep.findings}
    why = next(s.reason for s in rep.rules if s.code == "prefetch.frozen_gathered")
    assert "layers.3's explicit list leaves them out" in why, why
    # at or under the ceiling, to one unit's gathered parameters (gloo's asynchronous all-gather buffers)
    assert rep.memory.peak_bytes <= runs["finding"].predicted.peak_bytes_after + async_gather_slack(run)


def test_no_gradient_reaching_the_optimizer_is_critical(runs):
    run, rep = runs["sync_off"]
    for rd in run.ranks.values():
        assert rd.config.optimizer_state_tensors == 0 and len(rd.config.gradient_sync_off) == len(rd.config.units) - 1
    (f,) = [f for f in rep.findings if f.code == "optim.no_gradients"]
    assert f.severity == "critical" and f.recommendation.where == "loop"
    assert "model.set_requires_gradient_sync(is_last_micro_batch)" in f.recommendation.code
    assert f.evidence["unsharded_grads_held_bytes"] > 0
    assert "memory.grads_kept" not in {x.code for x in rep.findings}  # those gradients are this finding's
    for name in ("top", "two", "fixed"):  # their optimizer holds state: quiet
        assert "optim.no_gradients" not in {x.code for x in runs[name][1].findings}


_UNSHARDED_SCRIPT = textwrap.dedent('''
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 8))
    for m in model[:2]:
        fully_shard(m)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters())  # after fully_shard: it holds the sharded parameters
    model.set_reshard_after_backward(False)  # every unit stays gathered after its backward ...
    units = [m for m in model.modules() if hasattr(m, "reshard")]
    with fsdp_doctor.watch(model, opt, out_dir=sys.argv[1], profile=False) as doctor:
        for step in range(5):
            for u in units:  # ... until the loop reshards it before the next forward
                u.reshard()
            model(torch.randn(4, 32)).sum().backward()
            opt.step()
            opt.zero_grad()
            doctor.step()
''')


def test_an_optimizer_over_sharded_parameters_read_while_units_are_gathered(tmp_path):
    """With set_reshard_after_backward(False) the units are gathered when the doctor reads the configuration, the
    model's parameters the unsharded ones: an optimizer made after fully_shard read as holding none of them, a
    CRITICAL optim.before_shard ("53 of its 53 parameters are not the model's", "nothing is trained") on a run
    that trained right (a new-user trial). FSDP's unsharded parameters stand for their sharded ones."""
    from fsdp_doctor import build_report, load_run

    run_one_rank(tmp_path, _UNSHARDED_SCRIPT)
    run = load_run(tmp_path / "run")
    cfg = run.config
    assert cfg.optimizer_params == 6 and cfg.optimizer_foreign_params == 0, cfg
    assert cfg.untrained is not None and cfg.untrained.tensors == 0, cfg.untrained
    codes = {f.code for f in build_report(run).findings}
    assert not codes & {"optim.before_shard", "optim.untrained_params"}, codes


_JOINT_SCRIPT = textwrap.dedent('''
    a, b = (nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)) for _ in range(2))
    for net in (a, b):
        for m in net:
            fully_shard(m)
        fully_shard(net)
    opt = torch.optim.AdamW([*a.parameters(), *b.parameters()])  # one optimizer over both, built after fully_shard
    with fsdp_doctor.watch(a, opt, out_dir=sys.argv[1], profile=False) as doctor:
        for step in range(4):
            (a(torch.randn(4, 16)).sum() + b(torch.randn(4, 16)).sum()).backward()
            opt.step()
            opt.zero_grad()
            doctor.step()
''')


def test_an_optimizer_over_two_sharded_models_holds_no_stale_tensor(tmp_path):
    """One optimizer over two sharded models (a shared-embedding pair, a GAN stepped together), the first watched:
    the other model's sharded parameters read as tensors left from before fully_shard, a CRITICAL
    optim.before_shard ("15 of its 29 parameters are not the model's") and 777 KiB of "stale optimizer params", with a
    fix that changed nothing (a new-user trial). Another FSDP model's DTensors are not stale: their state is the
    optimizer's."""
    from fsdp_doctor import build_report, load_run

    run_one_rank(tmp_path, _JOINT_SCRIPT)
    run = load_run(tmp_path / "run")
    assert run.config.optimizer_params == 8 and run.config.optimizer_foreign_params == 0, run.config
    state = 4 * 2 * 2 * 2 * (16 * 16 + 16) + 8 * 4  # AdamW's 2 moments, fp32, of 2 models' 2 Linears; 8 steps
    for s in run.ranks[0].steps[1:]:
        assert s.memory.end["stale_optimizer_params"] == 0, s.memory.end
        assert s.memory.end["optimizer_state"] == state, (s.memory.end, state)
    rep = build_report(run)
    assert "optim.before_shard" not in {f.code for f in rep.findings}
    # and the report's head says whose parameters it holds (4 tensors of b beside 4 of a's: 2 Linears each)
    assert (run.config.optimizer_other_params, run.config.optimizer_other_bytes) == (4, 4 * 2 * (16 * 16 + 16))
    assert "The optimizer given to watch() (AdamW) holds 4 parameter tensor(s) of another FSDP2 model (2.12 KiB per " \
        "rank) beside 4 of the watched model's: its step updates both models, and both models' state is this " \
        "model's optimizer state in the memory figures" in rep.run.notes, rep.run.notes


_HEAD_ONLY_SCRIPT = textwrap.dedent(
    """
    import os
    import torch, torch.nn as nn, torch.nn.functional as F, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    B, H, W = 4, 16, 8  # batch, image side, stem channels

    def stage(cin, cout):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, 2, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                             nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())

    class Net(nn.Module):  # the trial's ResNet's layout: stem and head in the root, the stages sharded
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, W, 3, 1, 1, bias=False); self.bn1 = nn.BatchNorm2d(W)
            self.layer1, self.layer2 = stage(W, 2 * W), stage(2 * W, 4 * W)
            self.fc = nn.Linear(4 * W, 10)

        def forward(self, x):
            x = F.relu(self.bn1(self.conv1(x)))
            x = self.layer2(self.layer1(x))
            return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))

    def worker(rank, port, out, fix):
        import fsdp_doctor
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2)
        torch.set_num_threads(1); torch.manual_seed(0)
        model = Net()
        for unit in (model.layer1, model.layer2, model):
            fully_shard(unit)
        optimizer = torch.optim.AdamW(model.fc.parameters(), lr=1e-3)  # the head only, nothing frozen
        if fix:
            exec(open(fix).read(), {"model": model, "optimizer": optimizer})
        g = torch.Generator().manual_seed(rank)
        with fsdp_doctor.watch(model, optimizer, out_dir=out, profile=False) as doctor:
            for _ in range(5):
                x, y = torch.randn(B, 3, H, H, generator=g), torch.randint(0, 10, (B,), generator=g)
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
                doctor.step()
        dist.destroy_process_group()
    """
)


def test_a_root_holding_the_stem_and_the_trained_head_freezes_what_runs_before_the_head(tmp_path):
    """The optimizer over a conv net's head (``fc``, in the root with the stem ``conv1``, ``bn1``; the stages
    sharded), nothing frozen: the root, holding a trained module and running first, ended the frozen prefix before it
    began, and the prediction counted the gradient shards only (the ResNet trial: peak 16.00 MiB -> <= 14.67 MiB
    predicted, 6.50 MiB measured with the fix, its 8.48 MiB of activations gone). The root trains only a module
    after its nested units: its stem and the stages are frozen, and everything the forward saved but the head's
    input goes."""
    from conftest import record_two_ranks

    from fsdp_doctor import load_run

    before = record_two_ranks(tmp_path, _HEAD_ONLY_SCRIPT, "head")
    assert load_run(tmp_path / "head").config.untrained.trained_modules == ["fc"]
    (f,) = [x for x in before.findings if x.code == "optim.untrained_params"]
    ev = f.evidence
    assert ev["frozen_root_modules"] == ["conv1", "bn1"] and ev["frozen_prefix_units"] == ["layer1", "layer2"]
    rank = before.memory.per_rank[before.memory.peak_rank]
    saved = next(r["activations"] for r in rank.timeline if r["unit"] == "" and r["phase"] == "forward_end")
    head_input = 4 * 4 * 8 * 4  # fc's input: B x 4W float32, what autograd still saves with the rest frozen
    assert ev["frozen_prefix_activation_bytes"] == saved - head_input
    (fix := tmp_path / "fix.py").write_text(f.recommendation.code)
    after = record_two_ranks(tmp_path, _HEAD_ONLY_SCRIPT, "fixed", str(fix))
    codes = {x.code for x in after.findings}
    assert not codes & {"optim.untrained_params", "prefetch.frozen_gathered"}, codes
    fixed = after.memory.per_rank[after.memory.peak_rank]
    assert [r["activations"] for r in fixed.timeline if r["unit"] == "" and r["phase"] == "forward_end"] == \
        [head_input]
    # a ceiling, and near the measured peak (the saves gone, what the forward passed on kept to its end)
    measured, predicted = after.memory.peak_bytes, f.predicted.peak_bytes_after
    assert f.predicted.at_most and measured <= predicted <= 1.25 * measured, (measured, predicted)
