"""Explicit prefetch lists set against the order the run ran its units (``prefetch.wrong_order``), and the prefetch
chain the doctor prints clearing the lists it does not overwrite (``snippets.prefetch_code``).

A new-user trial set each block's forward list to the PREVIOUS block and its backward list to the NEXT one: 12
all-gathers per step against 9 (one per unit and pass), the peak 4.54 MiB against 4.16, and no finding. The chain
printed elsewhere, pasted on top of those lists, left 10: it never reset the last unit's forward list nor the last
backward unit's backward list."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from conftest import record_two_ranks
from fsdp_doctor.diagnose import RULES
from fsdp_doctor.diagnose import snippets as S
from test_diagnose_rules import BLOCK, _chain, _pairs, build, memory, run_rule, unit

LAYERS = [f"layers.{i}" for i in range(4)]


def _units(forward=None, backward=None, root_forward=None, root_backward=None):
    """A root holding the embedding and head, four blocks; ``forward``/``backward``: {block: its explicit list}."""
    us = [unit("", reshard_after_forward=False, n_params=3, param_count=34_944, sharded_bytes=69_888,
               unsharded_bytes=139_776, orig_dtypes=["float32"], forward_prefetch=root_forward or [],
               backward_prefetch=root_backward or [], timing=dict(fwd_ms=2.0, ag_wait_fwd_ms=1.4, bwd_ms=16.0))]
    for name in LAYERS:
        us.append(unit(name, **BLOCK, forward_prefetch=(forward or {}).get(name, []),
                       backward_prefetch=(backward or {}).get(name, []),
                       timing=dict(fwd_ms=5.0, ag_wait_fwd_ms=4.0, bwd_ms=5.0, ag_wait_bwd_ms=3.0)))
    return us


def _wrong():
    """The trial's lists: forward the previous block, backward the next."""
    return ({b: [a] for a, b in zip(LAYERS, LAYERS[1:])}, {a: [b] for a, b in zip(LAYERS, LAYERS[1:])})


def _right():
    return ({a: [b] for a, b in zip(LAYERS, LAYERS[1:])}, {b: [a] for a, b in zip(LAYERS, LAYERS[1:])})


def _ag_overlap(counts: dict[tuple[str, str], int]):
    """A CPU trace's all-gather rows, one profiled step, both ranks alike: {(unit, phase): calls}."""
    rows = [{"rank": r, "unit": u, "collective": "all_gather", "phase": ph, "count": n, "comm_us": 1000.0 * n,
             "exposed_us": 1000.0 * n} for r in (0, 1) for (u, ph), n in counts.items()]
    return {"per_rank": {str(r): {"comm_us": 1.0, "steps": [6], "device": "cpu"} for r in (0, 1)}, "per_unit": rows}


# what the trial's trace counted per step (12), and what one per unit and pass is (9)
TRIAL_COUNTS = {("(root)", "forward"): 1, ("layers.0", "forward"): 2, ("layers.1", "forward"): 2,
                ("layers.2", "forward"): 2, ("layers.3", "forward"): 1, ("layers.3", "backward"): 2,
                ("layers.2", "backward"): 1, ("layers.1", "backward"): 1}


def _applied(code: str, before: dict) -> dict:
    """The lists after ``code`` runs on a model whose units hold ``before`` ({(pass, fqn): [fqns]})."""
    after = dict(before)
    after.update(_chain(code, ["tok", *LAYERS, "norm", "head"]))
    return {k: v for k, v in after.items() if v}


def _lists(forward, backward, root_forward=None, root_backward=None) -> dict:
    out = {("forward", k): v for k, v in forward.items()} | {("backward", k): v for k, v in backward.items()}
    if root_forward:
        out[("forward", "")] = root_forward
    if root_backward:
        out[("backward", "")] = root_backward
    return out


def test_wrong_order_fires_with_the_lists_and_the_extra_allgathers():
    fwd, bwd = _wrong()
    ctx, _ = build(units=_units(fwd, bwd), overlap=_ag_overlap(TRIAL_COUNTS), memory=memory(4_758_000))
    (f,) = run_rule("prefetch.wrong_order", ctx)
    assert f.severity == "warning"
    ev = f.evidence
    assert len(ev["wrong_lists"]) == 6
    assert "layers.1 forward prefetches [layers.0]: layers.0 ran its forward before it" in ev["wrong_lists"]
    assert "layers.0 backward prefetches [layers.1]: layers.1 ran its backward before it" in ev["wrong_lists"]
    assert ev["run_order_forward"] == ["(root)", *LAYERS] and ev["run_order_backward"] == ["(root)", *LAYERS[::-1]]
    assert ev["allgathers_per_step"] == 12 and ev["allgathers_one_per_unit"] == 9
    assert ev["extra_allgathers_per_step"] == 3
    assert "layers.0 forward: 2 per step" in ev["gathered_again"] and "3 extra all-gathers" in f.title
    # the fix: both chains in run order, and the two lists the chain does not reach cleared
    after = _applied(f.recommendation.code, _lists(fwd, bwd))
    assert after == {k: v for k, v in _pairs(LAYERS).items()}, f.recommendation.code


def test_wrong_order_without_a_trace_still_fires():
    fwd, bwd = _wrong()
    (f,) = run_rule("prefetch.wrong_order", build(units=_units(fwd, bwd))[0])
    assert f.evidence["allgathers_per_step"] is None and f.evidence["extra_allgathers_per_step"] is None
    assert "all-gathers per step" not in f.title


def test_wrong_order_forward_only_and_root_lists():
    # one wrong forward list, and a root whose forward list names a block: the root's forward runs first, fine
    ctx, _ = build(units=_units({"layers.2": ["layers.0"]}, root_forward=["layers.0"]))
    (f,) = run_rule("prefetch.wrong_order", ctx)
    assert f.evidence["wrong_lists"] == ["layers.2 forward prefetches [layers.0]: layers.0 ran its forward before it"]
    assert f.title.startswith("Explicit forward prefetch")
    # a block's backward list naming the root (whose backward hook runs first): wrong
    (f,) = run_rule("prefetch.wrong_order", build(units=_units(backward={"layers.1": [""]}))[0])
    assert f.evidence["wrong_lists"] == ["layers.1 backward prefetches [(root)]: (root) ran its backward before it"]


def test_a_target_run_again_later_in_the_pass_is_not_wrong():
    """A unit called twice in one forward (a shared block) may run again after the unit naming it: that prefetch
    can be for its later call, not counted (the recorded order holds its first call only)."""
    ctx, _ = build(units=_units({"layers.2": ["layers.0"]}))
    ctx.memo["micro_batches"] = {"": 1.0, "layers.0": 2.0, "layers.1": 1.0, "layers.2": 1.0, "layers.3": 1.0}
    rule = next(c for c in RULES if c.code == "prefetch.wrong_order")()
    assert rule.match(ctx) == []


def test_right_order_and_default_are_quiet():
    rule = next(c for c in RULES if c.code == "prefetch.wrong_order")()
    assert rule.match(build(units=_units(*_right()))[0]) == []
    assert rule.why_quiet.startswith("every explicit prefetch list names units that run after")
    rule = next(c for c in RULES if c.code == "prefetch.wrong_order")()
    assert rule.match(build(units=_units())[0]) == []
    assert rule.why_quiet == "no unit has an explicit prefetch list"


def test_exposed_allgather_quiet_reason_names_the_wrong_order():
    """On gloo with explicit prefetch set, prefetch.exposed_allgather is quiet; where the lists are in the wrong
    order its reason said "no prefetch hides them" (the trial's words), not that the lists add all-gathers."""
    fwd, bwd = _wrong()
    rule = next(c for c in RULES if c.code == "prefetch.exposed_allgather")()
    assert rule.match(build(units=_units(fwd, bwd))[0]) == []
    assert "prefetch.wrong_order" in rule.why_quiet


def test_chain_clears_the_lists_it_does_not_reach():
    """The chain pasted on top of the trial's lists: the last unit's forward list and the last backward unit's
    backward list were left (10 all-gathers per step); now cleared, so every list ends in run order."""
    fwd, bwd = _wrong()
    code = S.prefetch_code(build(units=_units(fwd, bwd))[0])
    assert "forward_order[-1].set_modules_to_forward_prefetch([])  # was [layers.2]" in code
    assert "backward_order[-1].set_modules_to_backward_prefetch([])  # was [layers.1]" in code
    assert _applied(code, _lists(fwd, bwd)) == _pairs(LAYERS)
    # the root's own lists, which the chain never sets: cleared too (on the model)
    code = S.prefetch_code(build(units=_units(fwd, bwd, root_forward=["layers.3"], root_backward=["layers.0"]))[0])
    assert "model.set_modules_to_forward_prefetch([])" in code and "model.set_modules_to_backward_prefetch([])" in code
    assert _applied(code, _lists(fwd, bwd, ["layers.3"], ["layers.0"])) == _pairs(LAYERS)


def test_chain_unchanged_without_lists_and_where_it_overwrites_them():
    """A default run's chain (no lists set) has no reset line; nor one whose lists the chain overwrites all."""
    plain = S.prefetch_code(build(units=_units())[0])
    assert "([])" not in plain and "reached" not in plain
    assert S.prefetch_code(build(units=_units(*_right()))[0]) == plain
    # a frozen first block (never runs backward): the last that runs backward prefetches itself, so the chain sets
    # every backward list; the frozen block's own list is never read: no reset
    us = _units(backward={"layers.0": ["layers.1"], "layers.1": ["layers.2"]})
    for u, _ in us:
        u["trainable_unsharded_bytes"] = 0 if u["name"] in ("", "layers.0") else u["unsharded_bytes"]
        u["trainable_sharded_bytes"] = 0 if u["name"] in ("", "layers.0") else u["sharded_bytes"]
    code = S.prefetch_code(build(units=us)[0])
    assert "set_modules_to_backward_prefetch([])" not in code, code


# ------------------------------------------------------------------------------------------------ real run
_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch, torch.nn as nn, torch.nn.functional as F
    import torch.distributed as dist, torch.multiprocessing as mp
    from torch.distributed.fsdp import fully_shard

    H, L, V, S, B = 32, 4, 64, 16, 2

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(H); self.fc1 = nn.Linear(H, 4 * H); self.fc2 = nn.Linear(4 * H, H)

        def forward(self, x):
            return x + self.fc2(F.gelu(self.fc1(self.ln(x))))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(V, H)
            self.layers = nn.ModuleList(Block() for _ in range(L))
            self.head = nn.Linear(H, V, bias=False)

        def forward(self, idx):
            x = self.tok(idx)
            for l in self.layers:
                x = l(x)
            return self.head(x)

    def worker(rank, port, out, fix):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=2)
        import fsdp_doctor
        torch.manual_seed(0)
        model = Model()
        for l in model.layers:
            fully_shard(l)
        fully_shard(model)
        layers = list(model.layers)
        for i, l in enumerate(layers):  # the trial's lists: the previous block in forward, the next in backward
            if i > 0:
                l.set_modules_to_forward_prefetch([layers[i - 1]])
            if i + 1 < L:
                l.set_modules_to_backward_prefetch([layers[i + 1]])
        if fix:
            exec(open(fix).read(), {"model": model})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(rank)
        with fsdp_doctor.watch(model, opt, out_dir=out) as doc:
            for _ in range(10):
                idx = torch.randint(0, V, (B, S + 1), generator=g)
                loss = F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
                loss.backward()
                opt.step()
                opt.zero_grad()
                doc.step()
        dist.destroy_process_group()
    """
)


def _record(tmp_path: Path, name: str, fix: str = ""):
    return record_two_ranks(tmp_path, _SCRIPT, name, fix)


def _ag_per_step(report) -> dict[str, float]:
    per: dict[str, float] = {}
    for r in report.overlap.per_unit:
        if r.collective == "all_gather":
            per[str(r.rank)] = per.get(str(r.rank), 0.0) + r.count_per_step
    return per


@pytest.mark.slow
@pytest.mark.long  # (the long tier, tests/conftest.py: a fix pasted and rerun in a second real run)
def test_real_run_wrong_order_found_and_its_fix_restores_one_gather_per_unit(tmp_path):
    """2 gloo ranks, a root and four blocks with the trial's lists: the finding fires with the trace's extra
    all-gathers; its printed fix, pasted after the user's lists, leaves one all-gather per unit and pass (the root
    once, each block once in forward and once in backward: 9) and no finding."""
    before = _record(tmp_path, "wrong")
    (f,) = [f for f in before.findings if f.code == "prefetch.wrong_order"]
    assert set(_ag_per_step(before).values()) == {12.0}, _ag_per_step(before)
    assert f.evidence["allgathers_per_step"] == 12 and f.evidence["extra_allgathers_per_step"] == 3
    assert f.recommendation.where == "sharded"
    fix = tmp_path / "fix.py"
    fix.write_text(f.recommendation.code)
    after = _record(tmp_path, "fixed", str(fix))
    assert not [f for f in after.findings if f.code == "prefetch.wrong_order"]
    assert set(_ag_per_step(after).values()) == {9.0}, _ag_per_step(after)
    status = {r.code: r for r in after.rules}["prefetch.wrong_order"]
    assert status.status == "quiet", status
