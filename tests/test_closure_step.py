"""A loop that hands ``optimizer.step`` a closure running the forward and backward, zeroing the gradients between
them: Lightning's Trainer steps every optimizer so (automatic optimization: ``optimizer.step(closure)``, the closure
running ``training_step``, ``zero_grad``, ``backward``). A new-user trial of Lightning's Trainer (2 gloo ranks) read
optim 103.5 ms of a 107.9 ms step (the optimizer's time held the closure's forward and backward), no time outside the
model, memory.grads_kept quiet "inside a function compiled around the model" (its memory timeline began at the
optimizer's start), and, once that was right, the gradients the closure freed read as held through the backward
and the new ones as temporaries (the peak 4.30 MiB where it was 3.86 MiB; memory.outputs_kept fired on 583 KiB of
gradients, and memory.grads_kept said "zeroed in place" and predicted 3.51 MiB).

Run as a user would: 2 gloo ranks, grads_kept's printed fix executed after the optimizer is built in a fresh run;
every run also trains an unwatched copy on the same batches, whose losses the watched one must equal."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from conftest import TINY_LM, gloo_worker, record_two_ranks
from fsdp_doctor import load_run

_SCRIPT = TINY_LM + textwrap.dedent(
    """
    import json
    import os
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard

    import fsdp_doctor


    def train(batches, fix, out=None):
        torch.manual_seed(0)
        model = Net()
        for b in model.blocks:
            fully_shard(b)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if fix:  # after the optimizer is built, as printed
            exec(open(fix).read(), {"optimizer": optimizer})
        losses = []

        def loop(doc=None):
            for x in batches:
                def closure():  # Lightning's order: training_step, zero_grad, backward
                    loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
                    optimizer.zero_grad()
                    loss.backward()
                    return loss
                losses.append(optimizer.step(closure).item())
                if doc is not None:
                    doc.step()

        if out is None:
            loop()
        else:
            with fsdp_doctor.watch(model, optimizer, out_dir=out, profile=False, capacity_bytes=64 << 20) as doc:
                loop(doc)
        return losses
    """
) + gloo_worker(
    """
    g = torch.Generator().manual_seed(1 + rank)
    batches = [torch.randint(0, V, (4, 17), generator=g) for _ in range(8)]
    plain = train(batches, fix)
    watched = train(batches, fix, out)
    if rank == 0:
        with open(out + ".losses.json", "w") as f:
            json.dump({"plain": plain, "watched": watched}, f)
    dist.destroy_process_group()
    """
)


def _losses(tmp_path: Path, name: str) -> dict:
    return json.loads((tmp_path / f"{name}.losses.json").read_text())


@pytest.mark.long
def test_closure_step_times_and_memory_as_the_loop_runs_them(tmp_path):
    before = record_two_ranks(tmp_path, _SCRIPT, "closure")
    losses = _losses(tmp_path, "closure")
    assert losses["watched"] == losses["plain"]

    # the phases do not overlap: the optimizer's time is its own, not the closure's forward and backward (the trial's
    # Trainer: fwd 26.3 + bwd 45.5 + optim 103.5 ms in a 107.9 ms step)
    steps = [s for r in load_run(tmp_path / "closure").ranks.values() for s in r.steps if s.step >= 1]
    assert len(steps) == 2 * 7
    for s in steps:
        assert s.forward_ms > 0 and s.backward_ms > 0 and s.optimizer_ms > 0, s
        assert s.forward_ms + s.backward_ms + s.optimizer_ms <= s.wall_ms, s

    codes = {f.code for f in before.findings}
    assert "memory.outputs_kept" not in codes, codes  # (583 KiB of gradients read as the model's outputs)
    (f,) = [f for f in before.findings if f.code == "memory.grads_kept"]
    assert f.evidence["freed_before_backward"] is True
    assert "freed only after the next step's forward" in f.recommendation.text and "zeroed in place" not in f.recommendation.text
    assert f.predicted.peak_bytes_after < f.predicted.peak_bytes_before

    fix = tmp_path / "fix.py"
    fix.write_text(f.recommendation.code)
    after = record_two_ranks(tmp_path, _SCRIPT, "fixed", str(fix))
    losses = _losses(tmp_path, "fixed")
    assert losses["watched"] == losses["plain"]
    assert "memory.grads_kept" not in {g.code for g in after.findings}
    # within 2%, and the ranks' spread in either run: on gloo a rank now and then holds one block's gathered copy
    # (34,176 B) from a forward into the loss (gloo's async work still holding its output), 1 run in 4 here; that
    # rank's peak, 696,100 B against 661,924 B, predicted 628,196 B where the rerun without it read 613,604 B (and a
    # rerun with it on one rank read 628,196 B where 613,604 B was predicted)
    spread = sum(max(p) - min(p) for p in ([m.peak_bytes for m in r.memory.per_rank.values()] for r in (before, after)))
    assert abs(after.memory.peak_bytes - f.predicted.peak_bytes_after) <= 0.02 * f.predicted.peak_bytes_after + spread, (
        after.memory.peak_bytes, spread, f.predicted)
