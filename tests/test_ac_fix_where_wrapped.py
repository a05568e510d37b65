"""ac.unneeded's (and ac.fewer_units') fix turns CheckpointWrappers off where the user's code made them, however it
made them. A new-user trial's loop wrapped and sharded each layer in turn::

    for i, layer in enumerate(model.layers):
        layer = checkpoint_wrapper(layer)
        model.layers[i] = layer
        fully_shard(layer, mesh=mesh)

The fix replaced each wrapper by its module "before your fully_shard calls", where these wrappers do not exist yet:
it did nothing, and the finding came back unchanged on the rerun (2 gloo ranks: recompute ~1.4 ms per block per
step, peak 1,255,856 B, as before). After the loop, replacing a wrapper that is itself the unit leaves its module's
parameters sharded outside any unit ("aten.addmm.default got mixed torch.Tensor and DTensor"). The fix now leaves
each wrapper in place calling its module as it is (its ``checkpoint_fn``), after the user's fully_shard calls, where
every wrapper exists: wrapped before sharding, after it, or in one loop with it."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import BLOCKS_NET, pasted_fix_script, record_two_ranks
import scenario_matrix as M

# timing-driven codes a shared 2-core host produces by itself now and then (as in tests/test_ac_prediction.py)
NOISE = M.NOISE | {"prefetch.sync_unshard"}

SHAPES = ("loop", "first", "after")


# the user's code (after conftest.BLOCKS_NET, which builds ``model``): each block checkpointed and sharded as
# ``shape`` says; ``before_shard`` runs where "before your fully_shard calls" is in that code
USER_CODE = """
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing


def checkpoint_and_shard(model, shape, mesh=None, before_shard=lambda: None):
    if shape == "loop":  # each block wrapped and sharded in one loop
        before_shard()
        for i, layer in enumerate(model.layers):
            layer = checkpoint_wrapper(layer)
            model.layers[i] = layer
            fully_shard(layer, mesh=mesh)
    elif shape == "first":  # every block wrapped, then sharded
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,
                                       check_fn=lambda m: isinstance(m, Block))
        before_shard()
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
    else:  # "after": every block sharded, then wrapped (around the unit)
        before_shard()
        for i, layer in enumerate(model.layers):
            fully_shard(layer, mesh=mesh)
            model.layers[i] = checkpoint_wrapper(layer)
    fully_shard(model, mesh=mesh)
"""


def _build(shape: str):
    """conftest.BLOCKS_NET's three blocks and head, checkpointed and sharded as ``shape`` says (``USER_CODE``):
    (the model, the blocks' class)."""
    import torch
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard

    ns = {"torch": torch, "nn": nn, "fully_shard": fully_shard}
    exec(BLOCKS_NET + USER_CODE, ns)
    ns["checkpoint_and_shard"](ns["model"], shape)
    # (popped: fully_shard caches its FSDP class of Net for the process, whose methods hold ns as their globals: a
    # model left in ns outlived the test, and a later test's watch() read its units as another model's)
    return ns.pop("model"), ns["Block"]


@pytest.mark.parametrize("shape", SHAPES)
def test_the_fix_pasted_after_sharding_turns_every_wrapper_off(gloo_one_rank, shape):
    """One gloo rank, in this process: the recorder reads each block checkpointed, with its wrapper; the fix built
    from those wrappers, run after the fully_shard calls, leaves the units as they were, each block's forward runs
    once a step (twice while checkpointed: the recompute), and the recorder reads nothing checkpointed."""
    import torch

    from fsdp_doctor.diagnose import snippets as S
    from fsdp_doctor.record.units import find_units, snapshot_units

    model, block = _build(shape)
    forwards = []
    for m in model.modules():
        if isinstance(m, block):
            m.register_forward_pre_hook(lambda *_: forwards.append(1))
    before = {c.name: (c.checkpoint, c.checkpoint_wrappers) for c in snapshot_units(find_units(model))}
    inner = "._checkpoint_wrapped_module" if shape == "after" else ""
    assert before == {"": ("none", []), **{f"layers.{i}{inner}": ("unit", [f"layers.{i}"]) for i in range(3)}}
    model(torch.ones(2, 64)).sum().backward()
    assert len(forwards) == 6  # checkpointed: each block again in the recompute
    code = S.remove_checkpointing([w for _, ws in before.values() for w in ws], [])
    assert S.fix_place(code) == "sharded"
    exec(compile(S.complete(code), "<ac.unneeded fix>", "exec"), {"model": model})
    after = {c.name: (c.checkpoint, c.checkpoint_wrappers) for c in snapshot_units(find_units(model))}
    assert after == {n: ("none", []) for n in before}
    forwards.clear()
    model(torch.ones(2, 64)).sum().backward()
    assert len(forwards) == 3


def test_a_wrapper_keeps_checkpointing_under_any_checkpoint_function_torch_builds(gloo_one_rank):
    """What the recorder reads as a wrapper turned off is a plain function in place of its checkpoint_fn: a wrapper
    given its own checkpoint function (a partial of it, as torch builds every one) still checkpoints, and so does
    one whose selective policy ac.selective_to_full's fix took out (a partial again)."""
    import torch.utils.checkpoint as C
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from fsdp_doctor.diagnose import snippets as S
    from fsdp_doctor.record.units import checkpointing

    model, _ = _build("first")
    model.layers[1] = checkpoint_wrapper(model.layers[1]._checkpoint_wrapped_module, checkpoint_fn=C.checkpoint,
                                         use_reentrant=False)
    exec(compile(S.complete(S.full_checkpointing(["layers.2"])), "<full>", "exec"), {"model": model})
    assert [checkpointing(m) for m in model.layers] == [True, True, True]
    exec(compile(S.complete(S.remove_checkpointing(["layers.0"], [])), "<off>", "exec"), {"model": model})
    assert [checkpointing(m) for m in model.layers] == [False, True, True]


@pytest.mark.slow
@pytest.mark.long  # (the long tier, tests/conftest.py: a fix pasted and rerun in a second real run)
@pytest.mark.parametrize("shape", ["loop", "first"])
def test_unneeded_fix_pasted_where_it_says_ends_the_checkpointing(tmp_path, shape):
    """2 gloo ranks, 8 GiB budget: ac.unneeded fires on the three checkpointed blocks; its fix, pasted where it says,
    ends their checkpointing in the rerun: nothing checkpointed nor recomputed, the finding gone, no new warning, and
    the peak the one predicted without checkpointing (1,288,624 B measured and predicted here, against 1,255,856 B
    checkpointed). Before, on the loop, the rerun was the first run again."""
    # the user's script, 2 gloo ranks: SHAPE's checkpointing and sharding, the fix pasted where it says
    script = pasted_fix_script(USER_CODE, shape)
    before = record_two_ranks(tmp_path, script, "before")
    f = next(f for f in before.findings if f.code == "ac.unneeded")
    assert {u.name: u.checkpoint for u in before.units} == {"": "none", **{f"layers.{i}": "unit" for i in range(3)}}
    assert all(u.timing_p50.recompute_ms > 0 for u in before.units if u.name)
    fix = tmp_path / "fix.py"
    fix.write_text(f.recommendation.code)
    Path(f"{fix}.where").write_text(f.recommendation.where)
    after = record_two_ranks(tmp_path, script, "after", str(fix))
    assert {u.name: u.checkpoint for u in after.units} == {u.name: "none" for u in before.units}
    assert all(u.timing_p50.recompute_ms == 0 for u in after.units), [u.timing_p50 for u in after.units]
    codes = {x.code for x in after.findings}
    assert "ac.unneeded" not in codes and "ac.fewer_units" not in codes, codes
    new = {x.code for x in after.findings if x.severity != "info"} - {x.code for x in before.findings} - NOISE \
        - M.HEADROOM
    assert not new, new
    assert after.memory.peak_bytes == pytest.approx(f.predicted.peak_bytes_after, rel=0.10)
