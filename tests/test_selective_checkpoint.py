"""Selective activation checkpointing (torch.utils.checkpoint's ``create_selective_checkpoint_contexts``,
torchtitan's default ``selective`` mode) under watch(): what its policy saves lives in a cache of its own, outside
autograd's saved tensors, so no saved-tensor hook sees it. The memory probe counts that cache as activations (it
read as temporaries), keeps nothing of it alive, and the doctor's own hooks no longer make torch 2.15 warn the user
about saved-tensor hooks around every selective region. Real FSDP2 runs on one gloo rank, in fresh processes."""

import os
import sys
from pathlib import Path

import pytest

from conftest import run_one_rank

MIB = 1 << 20
ROWS, DIM, HIDDEN, BLOCKS = 512, 256, 1024, 4

BODY = f"""
import functools
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts, CheckpointPolicy
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

AC, HOW, WATCH = os.environ["AC"], os.environ["HOW"], os.environ["WATCH"] == "1"
SAVE = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)

def policy(ctx, op, *args, **kwargs):  # the matmuls' outputs saved, the rest recomputed
    return CheckpointPolicy.MUST_SAVE if op in SAVE else CheckpointPolicy.PREFER_RECOMPUTE

def context_fn():
    return create_selective_checkpoint_contexts(policy)

def ckpt(fn, *args):
    return checkpoint(fn, *args, use_reentrant=False, **({{"context_fn": context_fn}} if AC == "sac" else {{}}))

class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear({DIM}, {HIDDEN}), nn.GELU(), nn.Linear({HIDDEN}, {DIM}), nn.GELU())

    def forward(self, x):
        return self.mlp(x)

class Block(nn.Module):  # functional: checkpoint(self.inner, x) in the block's forward
    def __init__(self):
        super().__init__()
        self.inner = Inner()

    def forward(self, x):
        return x + (ckpt(self.inner, x) if HOW == "functional" else self.inner(x))

from fsdp_doctor.record.fsdp2 import enable_cpu_fsdp
enable_cpu_fsdp()  # (torch 2.6: FSDP2 trains on CPU with its back-ports; nothing on later releases)
blocks = [Block() for _ in range({BLOCKS})]
if HOW == "wrapper":  # torchtitan's way: each block wrapped, then sharded
    blocks = [checkpoint_wrapper(b, **({{"context_fn": context_fn}} if AC == "sac" else {{}})) for b in blocks]
model = nn.Sequential(*blocks)
for b in model:
    fully_shard(b)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ctx = fsdp_doctor.watch(model, opt, out_dir=sys.argv[1], profile=False, memory={{"full_every": 1}},
                       capacity_bytes=1 << 30) if WATCH else None  # (ample: ac.unneeded's case)
doc = ctx.__enter__() if ctx else None
losses = []
for step in range(4):
    g = torch.Generator().manual_seed(step)
    loss = model(torch.randn({ROWS}, {DIM}, generator=g)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    if doc:
        doc.step()
    losses.append(loss.item())
if ctx:
    ctx.__exit__(None, None, None)
print(json.dumps(losses))
"""


def _run(tmp_path, ac: str, how: str, watch: bool = True):
    os.environ.update(AC=ac, HOW=how, WATCH=str(int(watch)))
    (d := tmp_path / f"{ac}_{how}_{int(watch)}").mkdir()
    try:
        path, out = run_one_rank(d, BODY)
    finally:
        for k in ("AC", "HOW", "WATCH"):
            os.environ.pop(k)
    return path, [float(x) for x in out.strip().splitlines()[-1].strip("[]").split(",")]


def _timeline(path, step: int) -> list[dict]:
    from fsdp_doctor import load_run

    tl = load_run(path).ranks[0].steps[step].memory.timeline
    return [dict(zip(tl.columns, r)) for r in tl.rows]


@pytest.mark.long  # (the long tier: real runs of 10-30 s on a slow host, tests/conftest.py)
def test_selective_checkpointings_cache_counts_as_activations(tmp_path):
    """Known answer: the policy keeps each block's two matmul outputs, 512 x 1024 and 512 x 256 float32 (2.5 MiB a
    block): after the forward the activations exceed full checkpointing's by exactly 4 x 2.5 MiB, and each block's
    backward takes its 2.5 MiB off again; checkpointed in the block's forward (``checkpoint(self.inner, x,
    context_fn=...)``) or by torchtitan's wrapper around the block. They read as temporaries before (activations
    1.5 MiB and temporaries 12.5 MiB at a peak whose activations hold 5 MiB of cache). The peak is what it was:
    nothing of the cache is kept longer (a reference cycle of the doctor's held it until a garbage collection: 44.07
    MiB became 58.58 MiB from the second step on), and training is unchanged."""
    from fsdp_doctor import load_run

    full, _ = _run(tmp_path, "full", "wrapper")
    _, plain_losses = _run(tmp_path, "sac", "wrapper", watch=False)
    block = (HIDDEN + DIM) * ROWS * 4
    for how in ("functional", "wrapper"):
        sac, sac_losses = _run(tmp_path, "sac", how)
        if how == "wrapper":
            assert sac_losses == plain_losses
        for step in (1, 2):  # (the steps whose timeline is kept)
            s, f = _timeline(sac, step), _timeline(full, step)
            at = next(i for i, r in enumerate(s) if r["phase"] == "loss_start")
            assert s[at]["activations"] - f[at]["activations"] == BLOCKS * block, (how, step, s[at], f[at])
            # each block's backward ends with its cache gone: the difference falls by a block at each backward end
            ends = [r["activations"] for r in s if r["phase"] == "backward_end" and r["unit"] is not None]
            full_ends = [r["activations"] for r in f if r["phase"] == "backward_end" and r["unit"] is not None]
            assert [a - b for a, b in zip(ends, full_ends)] == [block * n for n in range(BLOCKS - 1, -1, -1)], ends
        peaks = [st.memory.peak.bytes for st in load_run(sac).ranks[0].steps[1:]]
        assert len(set(peaks)) == 1, (how, peaks)
        _selective_advice(sac, full)


def _selective_advice(sac, full):
    """The units say their checkpointing is selective, and ac.unneeded (the budget is ample) says what it re-runs:
    only the operators the policy does not save, its time not taken from the units' whole forward (read as 19.9 ms
    "measured" in a new-user trial where turning selective checkpointing off saved 2-5 ms), so no step-time gain is
    promised; full checkpointing's recompute is measured and its gain predicted as before."""
    from fsdp_doctor import build_report, load_run
    from rich.console import Console

    from fsdp_doctor.present.terminal import render_units

    blocks = [str(i) for i in range(BLOCKS)]
    for path, selective in ((sac, True), (full, False)):
        run = load_run(path)
        assert {u.name: u.checkpoint_selective for u in run.config.units} == {"": False, **dict.fromkeys(
            blocks, selective)}
        rep = build_report(run)
        f = next(f for f in rep.findings if f.code == "ac.unneeded")
        if selective:
            assert f.severity == "info" and f.predicted.step_ms_after is None, f
            assert f.evidence["recompute_source"].startswith("not timed (selective checkpointing: at most the units' "
                                                             "forward compute"), f.evidence
            assert f.recommendation.text.startswith("Selective checkpointing re-runs the operators its policy does not "
                                                    "save in 4 unit(s) during backward (its time not measured")
            assert all(s.recompute_ms == 0 for st in run.ranks[0].steps for s in st.units)
            # near capacity (89%) with every unit checkpointed, ac.recommended is quiet, and says what full
            # checkpointing would spare: the 4 blocks' cached matmul outputs (10 MiB a forward)
            # (the budget: full checkpointing's peak at 84% of it, the sac peak near it)
            full_peak = load_run(full).ranks[0].steps[-1].memory.peak.bytes
            for rd in run.ranks.values():
                rd.config.capacity_bytes = int(full_peak / 0.84)
            tight = build_report(run)
            why = next(r.reason for r in tight.rules if r.code == "ac.recommended")
            assert why.endswith(" (4 selectively: what their policy saves beyond their inputs, 10.00 MiB a forward, "
                                "full checkpointing would recompute instead: ac.selective_to_full)"), why
            # ... and ac.selective_to_full takes that lever: the peak full checkpointing measured, predicted; its fix
            # the wrappers' checkpoint without the policy, or words for checkpoint(..., context_fn=) calls
            g = next((f for f in tight.findings if f.code == "ac.selective_to_full"), None)
            assert g, next(r.reason for r in tight.rules if r.code == "ac.selective_to_full")
            assert g.evidence["saved_beyond_inputs_bytes"] == BLOCKS * (HIDDEN + DIM) * ROWS * 4, g.evidence
            assert abs(g.predicted.peak_bytes_after - full_peak) <= 0.03 * full_peak, (g.predicted, full_peak)
            functional = not run.config.units[1].checkpoint_wrappers
            assert (g.recommendation.code == "") == functional, g.recommendation
            assert ("leave context_fn out there (0, 1, 2, 3)" in g.recommendation.text) == functional, g.recommendation
            # the peak in a block's backward: the activations its recompute holds are temporaries, the ones it
            # recomputed and the cached ones it took (2 + 2.5 MiB), as many as full checkpointing's recompute makes
            note = next(n for n in rep.memory.per_rank["0"].notes if "recomputes its forward" in n)
            assert "(selective activation checkpointing): up to 4.50 MiB of the " in note, note
            console = Console(width=100, record=True)
            console.print(render_units(rep.units))
            assert " sel unit " in console.export_text()
        else:
            assert f.evidence["recompute_source"] == "measured" and f.predicted.step_ms_after < f.predicted.step_ms_before
            note = next(n for n in rep.memory.per_rank["0"].notes if "recomputes its forward" in n)
            assert "(activation checkpointing): up to 4.50 MiB of the " in note, note


@pytest.mark.compat
def test_the_doctors_hooks_make_torch_warn_nothing_around_selective_regions(tmp_path):
    """torch 2.15 warns when saved-tensor hooks (a save_on_cpu) surround a selective checkpoint region: the doctor's
    own hooks, on its full memory steps, read as the user's, and every watched run with selective checkpointing
    (torchtitan's default) warned the user to pass respect_saved_tensors_hooks. The doctor's hooks are marked as not
    the user's (fsdp2.not_the_users_hooks): torch looks past them, caches as without the doctor, and says nothing."""
    import subprocess

    from conftest import ONE_RANK, child_pythonpath

    script = tmp_path / "case.py"
    script.write_text(ONE_RANK + BODY + "\ndist.destroy_process_group()\n")
    env = {**os.environ, "PYTHONPATH": child_pythonpath(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1", "AC": "sac",
           "HOW": "wrapper", "WATCH": "1", "PYTHONWARNINGS": "always"}
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "saved_tensors_hooks" not in r.stderr, r.stderr[-2000:]


@pytest.mark.compat
def test_full_checkpointing_fix_drops_the_policy_and_nothing_else():
    """ac.selective_to_full's fix for checkpoint wrappers (snippets.full_checkpointing), run as printed on wrappers
    built as torchtitan builds them (``context_fn`` and ``preserve_rng_state=False``): the policy is no longer asked
    about any operator, the other keyword stays, and the gradients are the selective run's (torch 2.6 to 2.15 keep
    the wrapper's checkpoint in ``checkpoint_fn``)."""
    import torch
    import torch.nn as nn
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    from fsdp_doctor.diagnose import snippets as S

    asked = []

    def policy(ctx, op, *args, **kwargs):
        asked.append(op)
        return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    def build():
        torch.manual_seed(0)
        return nn.Sequential(*[checkpoint_wrapper(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)),
                                                  context_fn=lambda: create_selective_checkpoint_contexts(policy),
                                                  preserve_rng_state=False) for _ in range(2)])

    def grads(model):
        model(torch.ones(4, 8)).pow(2).sum().backward()
        return [p.grad for p in model.parameters()]

    want = grads(build())
    assert asked
    model = build()
    exec(S.full_checkpointing(["0", "1"]), {"model": model})
    asked.clear()
    got = grads(model)
    assert asked == [] and all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(w.checkpoint_fn.keywords.get("preserve_rng_state") is False for w in model)
