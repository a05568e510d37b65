"""FSDP's collective buffers that the backend still holds after FSDP released them are comm buffers, not the loop's
tensors. gloo's worker thread drops a finished collective's work, and the tensors in it, when it is next scheduled:
on a 2-core host a block's reduce-scatter input or all-gather output can outlive the backward. A new-user trial's
tied Qwen2 under accelerate's plugin read such a block's 710.00 KiB, alive when the optimizer step started, as the
loop keeping the model's outputs: memory.outputs_kept warned (its loop kept only the loss), in one run of two.

The race is made certain here: each all-gather's output and each reduce-scatter's input is held until the step's end,
as gloo's thread holds them when it runs late. Known answer: each is one unit's whole (unsharded) parameters or
gradients, in float32."""

from __future__ import annotations

import textwrap

import pytest

from conftest import gloo_worker, record_two_ranks

_SCRIPT = "import os\nimport torch\nimport torch.distributed as dist\n" + gloo_worker(textwrap.dedent(
    """
    from torch.distributed.fsdp import fully_shard
    held = []  # (what gloo's worker thread holds until it is next scheduled)

    def late(collective, keep):
        def call(*args, **kwargs):
            held.append(kwargs[keep] if keep in kwargs else args[0 if keep == "output" else 1])
            return collective(*args, **kwargs)
        return call
    # (FSDP2's collectives: all_gather_single and reduce_scatter_single where torch has them, else
    # all_gather_into_tensor and reduce_scatter_tensor)
    for name, old, keep in (("all_gather_single", "all_gather_into_tensor", "output"),
                            ("reduce_scatter_single", "reduce_scatter_tensor", "input")):
        name = name if hasattr(dist, name) else old
        if fix != "on time":
            setattr(dist, name, late(getattr(dist, name), keep))
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    with fsdp_doctor.watch(model, opt, out_dir=out, profile=False) as doc:
        for _ in range(6):
            loss = model(torch.randn(64, 256, generator=g)).square().mean()
            loss.backward()
            opt.step(), opt.zero_grad(), doc.step()
            held.clear()
    dist.destroy_process_group()
    """
))


@pytest.mark.slow
def test_buffers_the_backend_still_holds_are_comm_buffers(tmp_path):
    late = record_two_ranks(tmp_path, _SCRIPT, "late")
    on_time = record_two_ranks(tmp_path, _SCRIPT, "on_time", "on time")
    st = {r.code: r for r in late.rules}["memory.outputs_kept"]
    assert st.status == "quiet" and "of the step's tensors besides gradients are alive" in st.reason, st.reason
    # at the optimizer step's start: the four layers' all-gather outputs, in forward and again in backward, and their
    # reduce-scatter inputs (weight and bias, float32), held late
    layer = (256 * 256 + 256) * 4
    opt_at = {}
    for name, rep in (("late", late), ("on_time", on_time)):
        pm = rep.memory.per_rank["0"]
        (row,) = [r for r in pm.timeline if r.get("unit") is None and r.get("phase") == "optimizer_start"]
        opt_at[name] = row
    assert opt_at["late"]["comm_buffers"] - opt_at["on_time"]["comm_buffers"] == (8 + 4) * layer, opt_at
    assert opt_at["late"]["temporaries"] == opt_at["on_time"]["temporaries"], opt_at
