"""optim.foreach_temporaries: a peak near capacity in the optimizer step, where AdamW's foreach implementation (torch's
default for FSDP2's DTensor parameters on CUDA; asked for here on the CPU, where the default loops) makes an
intermediate as large as a moment of its state. Its fix, applied to the optimizer as printed, runs the fused one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

#: 8 blocks of 256 x 256 + 256: a block's parameter bytes (fp32)
_BLOCK = 4 * (256 * 256 + 256)


class AdamW(torch.optim.Optimizer):
    """An AdamW of another library's (bitsandbytes' is named so too): torch's foreach update through its functional
    API, its groups without torch's implementation switches (no 'fused' to set)."""

    def __init__(self, params, lr=1e-3):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        from torch.optim.adam import adam

        for g in self.param_groups:
            ps = [p for p in g["params"] if p.grad is not None]
            for p in ps:
                if not self.state[p]:
                    self.state[p] = {"m": torch.zeros_like(p), "v": torch.zeros_like(p), "step": torch.tensor(0.0)}
            st = [self.state[p] for p in ps]
            adam(ps, [p.grad for p in ps], [s["m"] for s in st], [s["v"] for s in st], [], [s["step"] for s in st],
                 foreach=True, decoupled_weight_decay=True, amsgrad=False, beta1=0.9, beta2=0.999, lr=g["lr"],
                 weight_decay=0.01, eps=1e-8, maximize=False)


def _run(out, fix: str = "", foreach: bool | None = True, copies: int | None = 5, opt_class=None, steps: int = 4):
    """The blocks sharded one unit each on one gloo rank, AdamW(foreach=``foreach``) (or ``opt_class``) with ``fix``
    run on it as its code reads (``optimizer`` the user's), ``steps`` steps; a budget 8% above ``copies`` of the
    parameters (in the optimizer step: parameters, gradients, 2 moments and the foreach intermediate), none for None:
    (run read back, losses)."""
    from torch.distributed.fsdp import fully_shard

    import fsdp_doctor

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
    for block in model:
        fully_shard(block)
    fully_shard(model)
    optimizer = (opt_class(model.parameters(), lr=1e-3) if opt_class else
                 torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach))
    if fix:
        exec(fix, {"optimizer": optimizer, "torch": torch})  # noqa: S102 (the fix as the doctor printed it)
    x, losses = torch.randn(2, 256), []
    with fsdp_doctor.watch(model, optimizer, out_dir=out, profile=False,
                           **({"capacity_bytes": int(copies * 8 * _BLOCK / 0.92)} if copies else {})) as doctor:
        for _ in range(steps):
            loss = model(x).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            doctor.step()
    return fsdp_doctor.load_run(out), losses


def _findings(run, statuses: list | None = None):
    """(the run's report, its findings by code); the rules' statuses into ``statuses``."""
    import fsdp_doctor
    from fsdp_doctor.diagnose import diagnose

    report = fsdp_doctor.build_report(run)
    return report, {f.code: f for f in diagnose(run, report, statuses=statuses)}


def test_foreach_intermediates_at_an_optimizer_peak_are_fused_away(tmp_path, gloo_one_rank):
    """The peak lies in AdamW's step: parameters, gradients, two moments and foreach's square root of the second
    moment, one block's worth per block (8 x 263,168 B = 2,105,344 B of temporaries and a 4-byte scalar, 20% of the
    peak). The finding
    says so, its fix (every group switched to fused before the first step) applied as printed leaves the same losses
    and no temporaries there: the peak falls to the predicted one and the finding is gone."""
    run, losses = _run(tmp_path / "foreach")
    statuses = []
    report, found = _findings(run, statuses)
    f = found["optim.foreach_temporaries"]
    assert report.memory.per_rank["0"].peak_at.phase == "in_optimizer"
    # (and a scalar of the step's: 4 B)
    assert 8 * _BLOCK <= f.evidence["temporaries_bytes"] <= 8 * _BLOCK + 16, f.evidence
    assert f.evidence["optimizer"] == "AdamW", f.evidence
    # (no more than the temporaries: the next highest mark, outside the step, sets the peak then)
    p = f.predicted
    assert p.peak_bytes_before - f.evidence["temporaries_bytes"] <= p.peak_bytes_after < p.peak_bytes_before, p
    assert "group['foreach'], group['fused'] = False, True" in f.recommendation.code
    assert run.ranks[0].config.optimizer_groups[0].flags == {"foreach": True, "fused": None}
    # the state, 40% of this peak, is judged on the peak the fused step leaves: under optim.state_dominates' 80%
    # of capacity there, so its bf16 lever, a numerics trade-off, is not offered for what the fused step frees
    (sd,) = [s for s in statuses if s.code == "optim.state_dominates"]
    assert sd.status == "quiet" and sd.reason.endswith("(fires from 80%) once the fused step frees foreach's "
                                                       "intermediates"), sd
    fixed, fixed_losses = _run(tmp_path / "fused", f.recommendation.code)
    after, found_after = _findings(fixed)
    assert fixed_losses == pytest.approx(losses, rel=1e-6, abs=1e-7)
    assert "optim.foreach_temporaries" not in found_after
    assert after.memory.peak_bytes == pytest.approx(f.predicted.peak_bytes_after, rel=0.01), (
        after.memory.peak_bytes, f.predicted)
    new = {c for c, g in found_after.items() if g.severity != "info"} - {c for c, g in found.items()
                                                                         if g.severity != "info"}
    assert not new, new
    # fsdp-doctor compare reads the fix as the job setting it changed, and checks its prediction (before: "no
    # configuration change found")
    from fsdp_doctor.analyze import compare as C
    from fsdp_doctor.pipeline import compare_side

    assert (report.run.optimizer_impl, after.run.optimizer_impl) == ("foreach", "fused")
    cmp = C.compare(compare_side(run), compare_side(fixed))
    assert [(c.key, c.a, c.b) for c in cmp.config] == [("optimizer_impl", "foreach", "fused")], cmp.config
    (p,) = [p for p in cmp.predictions if p.code == "optim.foreach_temporaries"]
    assert p.recognised_by == "config diff: optimizer_impl" and p.peak_held, p


def test_a_looping_optimizer_step_is_left_alone(tmp_path, gloo_one_rank):
    """AdamW's single-tensor loop (the CPU's default) makes one tensor's intermediates at a time: its step (4 copies
    of the parameters and one block's) stays under the backward's high-water (a block gathered and its gradient,
    the gradients before it), where the rule names no lever of the optimizer's; the quiet reason says so."""
    run, _ = _run(tmp_path / "loop", foreach=False, copies=4)
    statuses = []
    _, found = _findings(run, statuses)
    assert "optim.foreach_temporaries" not in found
    (row,) = [r for r in statuses if r.code == "optim.foreach_temporaries"]
    assert (row.status, row.reason) == ("quiet", "the peak lies in_backward, not in the optimizer step"), row


def test_another_librarys_adamw_is_not_told_to_fuse(tmp_path, gloo_one_rank):
    """An optimizer of another library named AdamW (bitsandbytes' is), stepping foreach: the same intermediates at
    the same peak, but its groups hold no 'fused' switch, which the fix would set for nothing. Quiet, and why."""
    run, _ = _run(tmp_path / "other", opt_class=AdamW)
    statuses = []
    report, found = _findings(run, statuses)
    assert report.memory.per_rank["0"].peak_at.phase == "in_optimizer"
    assert run.ranks[0].config.optimizer == "AdamW" and run.ranks[0].config.optimizer_groups[0].flags == {}
    assert "optim.foreach_temporaries" not in found
    (row,) = [r for r in statuses if r.code == "optim.foreach_temporaries"]
    assert row.status == "quiet" and row.reason.startswith("AdamW's groups hold no 'fused' switch: not torch's own"), row


def test_sgd_is_not_told_to_fuse_what_dtensor_cannot_run(tmp_path, gloo_one_rank):
    """SGD with momentum and weight decay, foreach: the decayed gradients are an intermediate as large as the
    gradients, at a peak in its step. torch has a fused SGD, but DTensor has no sharding rule for its kernel: the fix
    would raise on FSDP2's parameters, so the rule stays quiet and says why."""
    def sgd(params, lr):
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=0.01, foreach=True)

    run, _ = _run(tmp_path / "sgd", opt_class=sgd, copies=4)
    statuses = []
    report, found = _findings(run, statuses)
    assert report.memory.per_rank["0"].peak_at.phase == "in_optimizer" and run.ranks[0].config.optimizer == "SGD"
    assert "optim.foreach_temporaries" not in found
    (row,) = [r for r in statuses if r.code == "optim.foreach_temporaries"]
    assert row.status == "quiet" and row.reason.startswith(
        "SGD's fused kernel has no DTensor sharding rule in torch: fused=True raises"), row


@pytest.mark.compat
@pytest.mark.parametrize("name", ["Adam", "AdamW", "SGD", "Adagrad"])
def test_which_fused_kernels_run_on_fsdp2_parameters(name, gloo_one_rank):
    """The rule's table against this torch: fused=True steps FSDP2's sharded parameters for the optimizers it tells
    to fuse, and raises for the others torch fuses (DTensor has no sharding rule for their kernels)."""
    from torch.distributed.fsdp import fully_shard

    from fsdp_doctor.diagnose.thresholds import FUSED_OPTIMIZERS, UNFUSABLE_OPTIMIZERS
    from fsdp_doctor.record.fsdp2 import enable_cpu_fsdp

    enable_cpu_fsdp()  # (torch 2.6: FSDP2 trains on the CPU with its back-ports; nothing on later releases)
    model = nn.Linear(8, 8)
    fully_shard(model)
    model(torch.randn(2, 8)).sum().backward()
    opt = getattr(torch.optim, name)(model.parameters(), lr=1e-3, fused=True)
    if name in FUSED_OPTIMIZERS:
        opt.step()
        assert all(opt.state[p] for p in model.parameters())
    else:
        assert name in UNFUSABLE_OPTIMIZERS
        # (2.13 - 2.15: "... does not have a sharding strategy registered"; 2.6: "found no DeviceMesh from dtensor
        # args for aten._fused_sgd_.default!")
        with pytest.raises((NotImplementedError, AssertionError), match="sharding strategy|no DeviceMesh"):
            opt.step()


def test_optimizer_impl_resolves_the_groups_switches_as_torch_does():
    """RunFacts.optimizer_impl (compare's job setting): fused where set; foreach where set, or where neither is and
    the parameters are on CUDA (torch's default there, DTensor included); the CPU's default loops, offloaded shards'
    too; groups that differ
    read "mixed"; an optimizer without the switches (another library's) none."""
    from types import SimpleNamespace

    from fsdp_doctor.analyze.report import optimizer_impl
    from fsdp_doctor.records import OptimizerGroup

    def cfg(device, *flags, offload=False):
        return SimpleNamespace(device=device, optimizer_groups=[OptimizerGroup(params=1, flags=f) for f in flags],
                               units=[SimpleNamespace(param_count=8, offload=offload)])

    default = {"foreach": None, "fused": None}
    assert optimizer_impl(cfg("cuda", default)) == "foreach" and optimizer_impl(cfg("cpu", default)) == "for-loop"
    # CPUOffloadPolicy's shards step on the host: the CPU's default
    assert optimizer_impl(cfg("cuda", default, offload=True)) == "for-loop"
    assert optimizer_impl(cfg("cuda", {"foreach": False, "fused": True})) == "fused"
    assert optimizer_impl(cfg("cpu", {"foreach": True, "fused": None})) == "foreach"
    assert optimizer_impl(cfg("cuda", {"foreach": False, "fused": None})) == "for-loop"
    assert optimizer_impl(cfg("cuda", default, {"foreach": False, "fused": True})) == "mixed"
    assert optimizer_impl(cfg("cuda", {})) is None and optimizer_impl(cfg("cuda")) is None


def recorded_as_torch_holds_it(name: str):
    """A recorded H100 row (traces/gpu/scenarios), read with the switches torch's AdamW holds by default (foreach and
    fused None: recorded before the groups' switches were); skipped where not recorded."""
    from conftest import REPO
    from fsdp_doctor import load_run

    path = REPO / "traces" / "gpu" / "scenarios" / name
    if not (path / "manifest.json").exists():
        pytest.skip(f"{path} not recorded")
    run = load_run(path)
    for rd in run.ranks.values():
        for g in rd.config.optimizer_groups:
            g.flags = {"foreach": None, "fused": None}
    return run


def test_the_recorded_h100_run_whose_peak_was_adamws_foreach_step():
    """The GPU row gpu_gpt_offload_needed (recorded on the H100, AdamW as torch defaults it there: foreach on DTensor
    parameters) peaked in the optimizer step at 97% of its budget, with 37.06 MiB of the step's temporaries: one copy
    of its 37.11 MiB of sharded parameters, foreach's intermediate. Recorded before the groups' switches were, it is
    read here with them as torch's AdamW holds them (foreach and fused None): optim.foreach_temporaries fires, and
    offload.recommended (twice the step, for the state on the host) stays quiet, the fused step leaving 90%."""
    from fsdp_doctor.diagnose.estimate import ONCE_FUSED

    statuses = []
    report, found = _findings(recorded_as_torch_holds_it("gpu_gpt_offload_needed"), statuses)
    assert report.run.optimizer_impl == "foreach" and report.memory.per_rank["0"].peak_at.phase == "in_optimizer"
    f = found["optim.foreach_temporaries"]
    params = report.memory.per_rank["0"].peak_breakdown["sharded_params"]
    assert f.evidence["temporaries_bytes"] == pytest.approx(params, rel=0.01), (f.evidence, params)
    # (the next highest mark, outside the step: 90% of the budget, under the 95% offload.recommended fires from)
    assert 0.85 < f.predicted.peak_bytes_after / f.evidence["capacity_bytes"] < 0.95, f.predicted
    (off,) = [s for s in statuses if s.code == "offload.recommended"]
    assert off.status == "quiet" and off.reason.endswith(ONCE_FUSED), off
