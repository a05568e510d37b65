"""Modules whose parameters the model reads outside their own forward. DeBERTa-v2's ``encoder.rel_embeddings``,
whose weight the encoder reads (``self.rel_embeddings.weight``) and normalizes with its ``LayerNorm``, its own forward
never run; a GPT whose logits read its embedding's weight (``F.linear(h, self.wte.weight)``, as MPT's do). A plan that
makes such a module a unit of its own, or groups it with modules that run, does not gather it where it is read:
pasted, torch's "mixed torch.Tensor and DTensor" on both ranks (new-user trials: wrap.params_in_root's plan for the
GPT on gloo, and for DeBERTa-v2 where collectives are cheap, as on a GPU). The first training forward's probes record
those modules (``UnitConfig.read_outside_modules``: record/param_reads.py) and every plan keeps them in the root, as
it keeps tied modules.

Run as a user would: transformers' DebertaV2ForMaskedLM from a tiny config and a GPT of that shape, 2 gloo ranks, the
plan pasted in place of the user's fully_shard calls in a fresh run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import msgspec
import pytest

from conftest import REPO, SHARD_OR_FIX, TWO_RANKS, child_pythonpath, gloo_worker, record_two_ranks

_SCRIPT = textwrap.dedent(
    """
    import os
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import DebertaV2Config, DebertaV2ForMaskedLM
    """
) + SHARD_OR_FIX + gloo_worker(
    """
    cfg = DebertaV2Config(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=128, max_position_embeddings=128, relative_attention=True,
                          position_buckets=256, max_relative_positions=-1, pos_att_type=["p2c", "c2p"],
                          share_att_key=True, norm_rel_ebd="layer_norm", position_biased_input=False,
                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = DebertaV2ForMaskedLM(cfg)
    shard(model, fix)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1 + rank)
    with fsdp_doctor.watch(model, opt, out_dir=out, profile=False) as doc:
        for _ in range(3):
            ids = torch.randint(5, 100, (2, 16), generator=g)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step(), opt.zero_grad(), doc.step()
    dist.destroy_process_group()
    """
)
_LAYERS = ("from torch.distributed.fsdp import fully_shard\n"
           "for layer in model.deberta.encoder.layer:\n    fully_shard(layer)\nfully_shard(model)\n")


def _plan(tmp_path, report, field=True, name="layers") -> str:
    """wrap.params_in_root's plan for the recorded run, its collectives weighed as nearly free (a GPU's): every
    module of the root's that frees any memory a unit; ``field`` False: the snapshot as recorded before the field."""
    import fsdp_doctor
    from fsdp_doctor.diagnose import snippets as S
    from fsdp_doctor.diagnose.base import Context

    run = fsdp_doctor.load_run(tmp_path / name)
    if not field:
        run.config.units = [msgspec.structs.replace(u, read_outside_modules=None) for u in run.config.units]
    tree = S.tree(Context(run=run, report=report))
    return S.complete(S.shard_plan(tree, root_leftovers=True, leftover_costs=S.LeftoverCosts(
        peak_bytes=1 << 20, step_ms=100.0, call_ms=0.001)))


@pytest.mark.slow
def test_a_module_read_without_its_forward_stays_in_the_root(tmp_path):
    (tmp_path / "layers.py").write_text(_LAYERS)
    base = record_two_ranks(tmp_path, _SCRIPT, "layers", str(tmp_path / "layers.py"))
    root = next(u for u in base.units if u.is_root)
    assert root.read_outside_modules == ["deberta.encoder.rel_embeddings"], root.read_outside_modules
    assert all(u.read_outside_modules == [] for u in base.units if not u.is_root)

    code = _plan(tmp_path, base)
    calls = [ln for ln in code.splitlines() if ln.startswith("fully_shard(")]
    assert any("model.deberta.encoder.LayerNorm" in c for c in calls), code  # the plan moves the others
    assert not any("rel_embeddings" in c for c in calls), code
    (tmp_path / "plan.py").write_text(code)
    fixed = record_two_ranks(tmp_path, _SCRIPT, "plan", str(tmp_path / "plan.py"))
    assert any("deberta.encoder.LayerNorm" in u.name for u in fixed.units), [u.name for u in fixed.units]

    # the snapshot without the field (as recorded before it): the plan grouped rel_embeddings with the encoder's
    # LayerNorm, and its run stopped at the first forward
    old = _plan(tmp_path, base, field=False)
    assert any("rel_embeddings" in ln for ln in old.splitlines() if ln.startswith("fully_shard(")), old
    _assert_crashes(tmp_path, _SCRIPT, old)


def _assert_crashes(tmp_path, script: str, code: str) -> None:
    """``code`` pasted in place of the fully_shard calls stops the run with torch's mixed-tensor error."""
    (tmp_path / "old.py").write_text(code)
    path = tmp_path / "two_ranks.py"
    path.write_text(script + TWO_RANKS)
    r = subprocess.run([sys.executable, str(path), str(tmp_path / "old"), str(tmp_path / "old.py")], timeout=300,
                       env={**os.environ, "PYTHONPATH": child_pythonpath(REPO), "OMP_NUM_THREADS": "1"},
                       capture_output=True, text=True)
    assert r.returncode != 0 and "mixed torch.Tensor and DTensor" in r.stderr, r.stderr[-2000:]


_GPT = textwrap.dedent(
    """
    import os
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard

    V, D = 4096, 64

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln, self.fc1, self.fc2 = nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

        def forward(self, x):
            return x + self.fc2(F.gelu(self.fc1(self.ln(x))))

    class GPT(nn.Module):  # no lm_head: the logits read the embedding's weight
        def __init__(self):
            super().__init__()
            self.wte, self.blocks, self.ln_f = nn.Embedding(V, D), nn.ModuleList([Block() for _ in range(4)]), \
                nn.LayerNorm(D)

        def forward(self, ids):
            h = self.wte(ids)
            for b in self.blocks:
                h = b(h)
            return F.linear(self.ln_f(h), self.wte.weight)
    """
) + SHARD_OR_FIX + gloo_worker(
    """
    model = GPT()
    shard(model, fix)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1 + rank)
    with fsdp_doctor.watch(model, opt, out_dir=out, profile=False, capacity_bytes=64 << 20) as doc:
        for _ in range(4):
            ids = torch.randint(0, V, (4, 32), generator=g)
            F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
            opt.step(), opt.zero_grad(), doc.step()
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_an_embedding_whose_weight_the_logits_read_stays_in_the_root(tmp_path):
    """wrap.params_in_root fired on gloo with a plan making ``wte`` a unit (66% of the parameters in the root, its
    peak 10.58 -> 9.58 MiB predicted): pasted, the logits read the resharded weight. Now it stays quiet, saying why."""
    blocks = tmp_path / "blocks.py"
    blocks.write_text("from torch.distributed.fsdp import fully_shard\n"
                      "for b in model.blocks:\n    fully_shard(b)\nfully_shard(model)\n")
    base = record_two_ranks(tmp_path, _GPT, "blocks", str(blocks))
    root = next(u for u in base.units if u.is_root)
    assert root.read_outside_modules == ["wte"], root.read_outside_modules
    (pr,) = [s for s in base.rules if s.code == "wrap.params_in_root"]
    assert pr.status == "quiet" and "wte, whose parameters the run read outside their forward" in pr.reason, \
        (pr.status, pr.reason)
    code = _plan(tmp_path, base, name="blocks")
    assert not any("wte" in ln for ln in code.splitlines() if ln.startswith("fully_shard(")), code
    (tmp_path / "plan.py").write_text(code)
    record_two_ranks(tmp_path, _GPT, "plan", str(tmp_path / "plan.py"))
    old = _plan(tmp_path, base, field=False, name="blocks")  # (the plan the rule printed before)
    assert "fully_shard(model.wte, mesh=mesh)" in old, old
    _assert_crashes(tmp_path, _GPT, old)


_COMPILED = textwrap.dedent(
    """
    import os, sys
    import torch, torch.nn as nn, torch.distributed as dist
    import torch._dynamo.utils as du
    from torch.distributed.fsdp import fully_shard
    import fsdp_doctor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)

    @torch.compile(backend="eager")  # a compiled function the eager forward calls (a compiled flex_attention's place)
    def mix(a, b):
        return torch.tanh(a) * torch.sigmoid(b) + a

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

        def forward(self, x):
            return x + mix(self.a(x), self.b(x))

    model = nn.Sequential(Block(), Block())
    for b in model:
        fully_shard(b)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters())
    doc = fsdp_doctor.watch(model, opt, out_dir=sys.argv[1], profile=False) if sys.argv[1] != "-" else None
    if doc:
        doc.__enter__()
    for _ in range(4):
        model(torch.randn(4, 32)).sum().backward()
        opt.step(), opt.zero_grad()
        if doc:
            doc.step()
    if doc:
        doc.__exit__(None, None, None)
    print("graphs", du.counters["stats"]["unique_graphs"])
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_no_look_at_reads_where_torch_compile_is_used(tmp_path):
    """The reads' TorchFunctionMode enters the guards of a frame Dynamo compiles under it: a compiled function the
    forward calls compiled 3 graphs with the doctor on the first step, 1 without (it recompiled once the mode was
    off). In a process that called torch.compile the reads are not looked at: the same graphs either way."""
    path = tmp_path / "compiled.py"
    path.write_text(_COMPILED)
    env = {**os.environ, "PYTHONPATH": child_pythonpath(REPO), "OMP_NUM_THREADS": "1"}
    graphs = []
    for i, out in enumerate(("-", str(tmp_path / "run"))):
        r = subprocess.run([sys.executable, str(path), out, str(29650 + i + os.getpid() % 200)], env=env, timeout=300,
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        graphs.append(r.stdout.split("graphs")[-1].strip())
    assert graphs[0] == graphs[1] == "1", graphs
