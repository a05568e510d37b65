"""``set_unshard_in_backward(False)`` on a unit whose parameters are needed in forward only (an embedding): FSDP2
never all-gathers it in backward. A new-user trial's run of it (2 gloo ranks, an embedding, 3 blocks and a shared
block as units, the norm and head in the root) read from reshard.zero2_affordable "emb: -0.04 ms for 18.94 KiB held
(+18.94 KiB at the peak alone) = 2.16 ms/MiB: flip" and a fix keeping the embedding gathered: the 0.04 ms was the
recorder's span from its pre-backward to its first gradient (its hooks' own), no all-gather, and the snapshot did not
record the setting. Run as the user did (its layout: an embedding and MLP blocks as units, the norm and head in the
root): the unit snapshot records the setting, and the rules leave that unit out, saying so."""

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
    from torch.distributed.fsdp import fully_shard

    V, H = 101, 48

    def worker(rank, port, out, fix):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=2)
        import fsdp_doctor
        torch.manual_seed(0)
        # the trial's layout: the embedding and 4 MLP blocks as units, the final norm and head in the root
        mlp = lambda: nn.Sequential(nn.LayerNorm(H), nn.Linear(H, 3 * H), nn.ReLU(), nn.Linear(3 * H, H))
        model = nn.Sequential(nn.Embedding(V, H), *(mlp() for _ in range(4)), nn.LayerNorm(H), nn.Linear(H, V))
        for unit in model[:5]:
            fully_shard(unit)
        fully_shard(model)
        model[0].set_unshard_in_backward(False)  # the embedding's weight is not needed in backward
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(rank)
        with fsdp_doctor.watch(model, opt, out_dir=out, profile=False, capacity_bytes=64 << 20) as doc:
            for tok in torch.randint(0, V, (10, 2, 25), generator=gen):
                nn.functional.cross_entropy(model(tok[:, :-1]).transpose(1, 2), tok[:, 1:]).backward()
                opt.step()
                opt.zero_grad()
                doc.step()
        dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_a_unit_never_gathered_in_backward_is_not_kept_gathered(tmp_path):
    report = record_two_ranks(tmp_path, _SCRIPT, "run")
    units = {u.name: u for u in report.units}
    assert units["0"].unshard_in_backward is False
    assert all(u.unshard_in_backward is True for n, u in units.items() if n != "0")
    # the recorder still times a span there (the trial's 0.04 ms): what the rules read as a backward all-gather wait
    assert units["0"].timing_p50.ag_wait_bwd_ms > 0
    status = {r.code: r for r in report.rules}
    (f,) = [f for f in report.findings if f.code == "reshard.zero2_affordable"]
    ev = f.evidence
    # the blocks' synchronous backward all-gathers on gloo (ms each) are still weighed; the embedding is left out
    assert ev["units_not_gathered_in_backward"] == ["0"] and set(ev["units_flipped"]) <= {"1", "2", "3", "4"}, ev
    assert not any(r.startswith("0:") for r in ev["per_unit"]), ev["per_unit"]
    assert "get_submodule('0')" not in f.recommendation.code, f.recommendation.code
    assert "Left out: 0 is never all-gathered in backward" in f.recommendation.text
    # no rule quotes a backward all-gather of it
    g = next((g for g in report.findings if g.code == "prefetch.exposed_allgather"), None)
    if g is not None:
        assert not any(w.startswith("0 (backward)") for w in g.evidence["worst_units"]), g.evidence["worst_units"]
    assert status["reshard.last_unit"].status != "fired"  # (the root holds the head: not this case)
