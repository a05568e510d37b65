"""Each unit's backward all-gather wait (``UnitStep.ag_wait_bwd_ms``) is its own. FSDP2's pre-backward gathers the unit
(unless it is gathered or prefetched already) and then prefetches the next unit of backward; on gloo that prefetch
blocks the host, and the recorder, timing from the unit's pre-backward to its first gradient, charged the prefetched
unit's all-gather to the unit that issued it. A new-user trial: a root kept gathered (reshard_after_forward=False),
which gathers nothing in backward, read 13.6-14.9 ms of backward all-gather wait, prefetch.exposed_allgather named
"(root) backward 14.9 ms" its largest stall, and the trace had no backward all-gather of the root at all: it was
blocks.3's, prefetched from the root's pre-backward; blocks.0's held the frozen encoder's, which it prefetches.

Run as the trial's layout (2 gloo ranks, a frozen encoder unit, 4 blocks, the head in a root kept gathered) with a
profiler window: FSDP2's own labels in the trace say which units are gathered in backward, and the recorder's waits
fall on those units, the root's none. With the root resharded after forward, its pre-backward gathers the root and
then blocks.3 in one span: the span is split between them by the bytes each gathers, its total kept."""

from __future__ import annotations

import textwrap

import pytest

from conftest import record_two_ranks

pytestmark = pytest.mark.slow

_SCRIPT = textwrap.dedent(
    """
    import os
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard

    import fsdp_doctor

    H = 256

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.Linear(H, H)
            self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(H, 2 * H), nn.ReLU(), nn.Linear(2 * H, H))
                                          for _ in range(4)))
            self.head = nn.Linear(H, 10)

        def forward(self, x):
            return self.head(self.blocks(self.encoder(x)))

    def worker(rank, port, out, fix):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=2)
        torch.manual_seed(0)
        model = Net()
        model.encoder.requires_grad_(False)  # frozen: never runs backward, yet blocks.0 prefetches it
        fully_shard(model.encoder)
        for b in model.blocks:
            fully_shard(b)
        fully_shard(model, reshard_after_forward=ROOT_RESHARD)  # False: the root (the head) gathers nothing in backward
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        gen = torch.Generator().manual_seed(rank)
        schedule = fsdp_doctor.ProfileSchedule(first=3, active=2, warmup=1, every=0)
        with fsdp_doctor.watch(model, opt, out_dir=out, profile=schedule) as doc:
            for _ in range(7):
                x, y = torch.randn(4, H, generator=gen), torch.randint(0, 10, (4,), generator=gen)
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                doc.step()
        dist.destroy_process_group()
    """
)


@pytest.mark.parametrize("root_reshard", [False, True])
def test_a_units_backward_wait_is_its_own_gather_not_the_one_it_prefetches(tmp_path, root_reshard):
    import fsdp_doctor
    from fsdp_doctor.analyze.steps import usable_steps

    report = record_two_ranks(tmp_path, _SCRIPT.replace("ROOT_RESHARD", str(root_reshard)), "run")
    run = fsdp_doctor.load_run(tmp_path / "run")
    # FSDP2's labels in the profiled window: which units it all-gathers in backward (under the pre-backward of the
    # unit that prefetches them): every block and the frozen encoder; the root only where resharded after forward
    traced = {"" if r.unit == "(root)" else r.unit for r in report.overlap.per_unit
              if r.collective == "all_gather" and r.phase == "backward"}
    assert traced == {"encoder", "blocks.0", "blocks.1", "blocks.2", "blocks.3"} | ({""} if root_reshard else set())
    for rank, rd in run.ranks.items():
        gathered = {u.name: u.unsharded_bytes for u in rd.config.units}
        steps = usable_steps(rd.steps)
        assert steps
        for s in steps:
            wait = {u.name: u.ag_wait_bwd_ms for u in s.units}
            if not root_reshard:
                # the root, gathered since forward, waits for no all-gather of its own: its pre-backward's time is
                # blocks.3's prefetch, blocks.3's wait
                assert wait[""] == 0.0, (rank, s.step, wait)
            else:
                # the root's span holds its own all-gather and blocks.3's (prefetched, blocks.3's whole wait): shared
                # by their bytes (each figure rounded to the microsecond)
                ratio = gathered[""] / gathered["blocks.3"]
                assert abs(wait[""] - ratio * wait["blocks.3"]) <= 0.002, (rank, s.step, wait, ratio)
            # each unit gathered in backward waits for its own all-gather: the frozen encoder's too (blocks.0
            # prefetched it; it has no backward of its own)
            assert all(wait[n] > 0 for n in traced), (rank, s.step, wait)
    units = {u.name: u for u in report.units}
    assert (units[""].timing_p50.ag_wait_bwd_ms == 0.0) is not root_reshard
    g = next((f for f in report.findings if f.code == "prefetch.exposed_allgather"), None)
    if g is not None and not root_reshard:  # the stalls it names are the gathered units', never the root's backward
        assert not any(w.startswith("(root) (backward)") for w in g.evidence["worst_units"]), g.evidence
