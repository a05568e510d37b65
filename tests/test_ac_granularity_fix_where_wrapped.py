"""ac.wrong_granularity's fix checkpoints whole blocks where the user's code checkpointed their children, however it
did so. Its lines went "before your fully_shard calls" (the children's wrappers turned off, the blocks wrapped by
apply_activation_checkpointing), before a loop that wraps each block's children and shards the block in the same
pass, whose wrappers did not exist yet there::

    for layer in model.layers:
        layer.attn = checkpoint_wrapper(layer.attn)
        layer.mlp = checkpoint_wrapper(layer.mlp)
        fully_shard(layer, mesh=mesh)

Measured (1 and 2 gloo ranks, three blocks and a head): that loop then set the children's wrappers on the blocks'
new wrappers, where nothing calls them (the blocks checkpointed whole by chance, dead wrappers in the tree); over
``model.modules()`` by type it nested them, still on, in the blocks' wrappers; over ``model.layers`` checking its
blocks' type it found none, so sharded none: the rerun read the whole model one unit, its blocks "children",
wrap.too_coarse new, peak 1,478,952 B for 1,255,856 B checkpointed by hand. The fix now goes after the user's
checkpoint_wrapper and fully_shard calls, where every wrapper exists: it turns the children's wrappers off in place
(as ac.unneeded's does) and wraps each whole block where it is, around its sharded unit."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from conftest import BLOCKS_NET, pasted_fix_script, record_two_ranks
import scenario_matrix as M

# timing-driven codes a shared 2-core host produces by itself now and then (as in tests/test_ac_prediction.py)
NOISE = M.NOISE | {"prefetch.sync_unshard"}

SHAPES = ("loop", "typed", "checked", "first", "after")


# the user's code (after conftest.BLOCKS_NET, which builds ``model``): each block's children (fc1, fc2) checkpointed
# and the blocks sharded as ``shape`` says, or ("blocks") the whole blocks checkpointed by hand; ``before_shard`` runs
# where "before your fully_shard calls" is in that code
USER_CODE = """
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing


def checkpoint_and_shard(model, shape, mesh=None, before_shard=lambda: None):
    if shape == "loop":  # each block's children wrapped, and the block sharded, in one loop
        before_shard()
        for layer in model.layers:
            layer.fc1 = checkpoint_wrapper(layer.fc1)
            layer.fc2 = checkpoint_wrapper(layer.fc2)
            fully_shard(layer, mesh=mesh)
    elif shape == "typed":  # the same loop over the model's blocks found by type
        before_shard()
        for m in list(model.modules()):
            if isinstance(m, Block):
                m.fc1 = checkpoint_wrapper(m.fc1)
                m.fc2 = checkpoint_wrapper(m.fc2)
                fully_shard(m, mesh=mesh)
    elif shape == "checked":  # the same loop over model.layers, its blocks checked by type
        before_shard()
        for layer in model.layers:
            if isinstance(layer, Block):
                layer.fc1 = checkpoint_wrapper(layer.fc1)
                layer.fc2 = checkpoint_wrapper(layer.fc2)
                fully_shard(layer, mesh=mesh)
    elif shape == "first":  # every block's children wrapped, then the blocks sharded
        children = {m for b in model.layers for m in (b.fc1, b.fc2)}
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,
                                       check_fn=lambda m: m in children)
        before_shard()
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
    elif shape == "after":  # every block sharded, then its children wrapped
        before_shard()
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
            layer.fc1 = checkpoint_wrapper(layer.fc1)
            layer.fc2 = checkpoint_wrapper(layer.fc2)
    else:  # "blocks", by hand: each whole block wrapped, then sharded
        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer)
            fully_shard(model.layers[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
"""


def _build(shape: str, fix=None):
    """conftest.BLOCKS_NET's three blocks and head (seeded), checkpointed and sharded as ``shape`` says
    (``USER_CODE``), ``fix`` (a Recommendation) pasted where it says: (the model, the blocks' class)."""
    import torch
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    ns = {"torch": torch, "nn": nn, "fully_shard": fully_shard}
    exec(BLOCKS_NET + USER_CODE, ns)
    # (popped: fully_shard caches its FSDP class of Net for the process, whose methods hold ns as their globals: a
    # model left in ns outlived the test, and a later test's watch() read its units as another model's)
    model = ns.pop("model")
    paste = lambda: exec(compile(fix.code, "<ac.wrong_granularity fix>", "exec"), {"model": model})  # noqa: E731
    where = fix.where if fix is not None else ""
    assert where in ("", "before_shard", "sharded"), where
    ns["checkpoint_and_shard"](model, shape, before_shard=paste if where == "before_shard" else lambda: None)
    if where == "sharded":  # after the user's fully_shard (and checkpoint_wrapper) calls
        paste()
    return model, ns["Block"]


def _reading(model) -> dict:
    from fsdp_doctor.record.units import find_units, snapshot_units

    return {c.name: (c.checkpoint, c.checkpoint_wrappers) for c in snapshot_units(find_units(model))}


def _rule(model):
    """ac.wrong_granularity on the recorder's reading of ``model`` (its units, as a run records them)."""
    from fsdp_doctor.record.units import find_units, snapshot_units
    from test_diagnose_rules import build, run_rule

    units = [(msgspec.to_builtins(c), dict(fwd_ms=6.0, bwd_ms=6.0)) for c in snapshot_units(find_units(model))]
    return run_rule("ac.wrong_granularity", build(units=units)[0])


def _forwards(model, block):
    """Each step's forward calls: [the blocks', their children's] (lists counting them)."""
    blocks, children = [], []
    for m in model.modules():
        if isinstance(m, block):
            m.register_forward_pre_hook(lambda *_: blocks.append(1))
            for c in (m.fc1, m.fc2):
                c.register_forward_pre_hook(lambda *_: children.append(1))
    return blocks, children


def _losses(model, steps: int = 3) -> list[float]:
    import torch

    model.zero_grad(set_to_none=True)  # (none of a step before)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        loss = model(torch.randn(8, 64, generator=g)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


@pytest.mark.parametrize("shape", SHAPES)
def test_the_fix_pasted_where_it_says_checkpoints_whole_blocks(gloo_one_rank, shape):
    """One gloo rank, in this process: the recorder reads each block's children checkpointed; ac.wrong_granularity's
    fix, built by the rule from that reading and pasted where it says, leaves each block checkpointed whole: its
    forward runs twice a step (once more in the recompute), its children's twice too (not a third time), no wrapper
    checkpoints but the blocks', the recorder reads the blocks checkpointed whole and the rule is quiet, and training
    gives the losses of the whole blocks checkpointed by hand. Before (the fix before fully_shard), the loop left
    its children's wrappers dead on the blocks' wrappers, the loop by type nested them, still on, and the loop
    checking its blocks' type sharded none: the whole model one unit, read "children"."""
    import torch

    model, block = _build(shape)
    blocks = [f"layers.{i}" for i in range(3)]
    assert _reading(model) == {"": ("none", []), **{b: ("children", [f"{b}.fc1", f"{b}.fc2"]) for b in blocks}}
    (f,) = _rule(model)
    fixed, block = _build(shape, f.recommendation)
    ran, children = _forwards(fixed, block)
    fixed(torch.ones(2, 64)).sum().backward()
    assert (len(ran), len(children)) == (6, 12), (f.recommendation.where, len(ran), len(children))
    # the blocks' wrappers, and no other wrapper checkpointing (the loop's set on them, or nested in them)
    from fsdp_doctor.record.units import checkpointing

    assert [n for n, m in fixed.named_modules() if checkpointing(m)] == blocks
    reading = _reading(fixed)
    assert reading == {"": ("none", []), **{f"{b}._checkpoint_wrapped_module": ("unit", [b]) for b in blocks}}, \
        reading
    assert _rule(fixed) == []
    by_hand, _ = _build("blocks")
    assert _losses(fixed) == _losses(by_hand)


def test_the_fix_leaves_checkpoint_calls_alone_and_goes_after_sharding_with_wrappers():
    """The fix's lines: with wrappers, after the fully_shard calls (each child's wrapper turned off, each block
    wrapped around its unit); with checkpoint(...) calls only (no wrapper a loop can make late), the blocks wrapped
    before fully_shard by apply_activation_checkpointing, as before."""
    from test_diagnose_rules import build, healthy_units, run_rule

    units = healthy_units(checkpoint="children", checkpoint_wrappers=[])
    for u, _ in units:
        if u["name"].startswith("layers."):
            u["checkpoint_wrappers"] = [f"{u['name']}.attn", f"{u['name']}.mlp"]
    (f,) = run_rule("ac.wrong_granularity", build(units=units)[0])
    code = f.recommendation.code
    assert f.recommendation.where == "sharded", f.recommendation.where
    assert "wrapper.checkpoint_fn = without_checkpoint" in code and "apply_activation_checkpointing(" not in code
    assert "wrappers = ['layers.0.attn', 'layers.0.mlp'," in code and "blocks = ['layers.0', 'layers.1'," in code
    assert "setattr(holder, child, checkpoint_wrapper(getattr(holder, child)))" in code, code
    assert all(len(ln) <= 80 for ln in code.splitlines()), code
    (g,) = run_rule("ac.wrong_granularity", build(units=healthy_units(checkpoint="children"))[0])
    assert g.recommendation.where == "before_shard" and "apply_activation_checkpointing(" in g.recommendation.code


@pytest.mark.slow
@pytest.mark.long  # (the long tier, tests/conftest.py: a fix pasted and rerun in a second real run)
@pytest.mark.parametrize("shape", ["loop", "checked"])
def test_granularity_fix_pasted_where_it_says_checkpoints_the_blocks(tmp_path, shape):
    """2 gloo ranks, 8 GiB budget: ac.wrong_granularity fires on the three blocks whose children are checkpointed;
    its fix, pasted where it says, leaves them checkpointed whole in the rerun: each block read "unit" with its own
    wrapper, recomputed, the finding gone, no new warning, and each rank's losses those of the same model with its
    whole blocks checkpointed by hand (1,255,856 B peak in both, 1,288,624 B with the children checkpointed).
    Before, the loop checking its blocks' type sharded none of them (the whole model one unit, read "children",
    wrap.too_coarse new, peak 1,478,952 B); the plain loop's rerun read its blocks "unit", named without their
    wrapper (its children's wrappers dead on the blocks' wrappers)."""
    # the user's script, 2 gloo ranks: SHAPE's checkpointing and sharding, the fix pasted where it says
    script = pasted_fix_script(USER_CODE, shape)
    before = record_two_ranks(tmp_path, script, "before")
    f = next(f for f in before.findings if f.code == "ac.wrong_granularity")
    blocks = [f"layers.{i}" for i in range(3)]
    assert {u.name: u.checkpoint for u in before.units} == {"": "none", **{b: "children" for b in blocks}}
    fix = tmp_path / "fix.py"
    fix.write_text(f.recommendation.code)
    Path(f"{fix}.where").write_text(f.recommendation.where)
    after = record_two_ranks(tmp_path, script, "after", str(fix))
    kinds = {u.name: u.checkpoint for u in after.units}
    assert kinds == {"": "none", **{f"{b}._checkpoint_wrapped_module": "unit" for b in blocks}}, kinds
    assert all(u.timing_p50.recompute_ms > 0 for u in after.units if u.name), [u.timing_p50 for u in after.units]
    codes = {x.code for x in after.findings}
    assert "ac.wrong_granularity" not in codes, codes
    new = {x.code for x in after.findings if x.severity != "info"} - {x.code for x in before.findings} - NOISE \
        - M.HEADROOM
    assert not new, new
    by_hand = record_two_ranks(tmp_path, pasted_fix_script(USER_CODE, "blocks"), "by_hand")
    assert after.memory.peak_bytes == pytest.approx(by_hand.memory.peak_bytes, rel=0.01)
    assert after.memory.peak_bytes < before.memory.peak_bytes
    for rank in (0, 1):
        fixed, hand = (json.loads(Path(f"{tmp_path / r}.losses{rank}").read_text()) for r in ("after", "by_hand"))
        assert fixed == hand, (rank, fixed, hand)
