"""A loop fix of a run PyTorch Lightning's Trainer drove is said in its LightningModule's training_step (without
Lightning installed: tests/test_lightning.py pastes it into a real Trainer where it is).

traces/cpu/lightning_trainer_accumulate: a LightningModule (a tiny LM as ``self.model``, its blocks and itself sharded
in configure_model) trained by Lightning's Trainer under ModelParallelStrategy on 2 gloo ranks, accumulate_grad_batches=2,
20 batches, watched by the README's four-line callback (a profiler window at steps 6-7). Each unit reduce-scatters
every micro-batch (Lightning's block_backward_sync is DDP's), and both accumulation fixes read
``model.model.set_...(is_last_micro_batch)`` for the user's loop, which the Trainer owns."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch.nn as nn

import fsdp_doctor
from fsdp_doctor.diagnose import snippets as S
from fsdp_doctor.record.tracker import _lightning_accumulate
from fsdp_doctor.records import LIGHTNING_DRIVER
from fsdp_doctor.report_sections import FIX_PLACES, Recommendation

RUN = Path(__file__).resolve().parents[1] / "traces" / "cpu" / "lightning_trainer_accumulate"


def test_the_trainer_is_read_from_the_watched_lightning_module():
    lm_cls = type("LightningModule", (nn.Module,), {"__module__": "lightning.pytorch.core.module"})
    user_cls = type("MyModule", (lm_cls,), {"__module__": "__main__"})
    m = user_cls()
    assert _lightning_accumulate(m) is None  # no Trainer attached (its .trainer property would raise)
    m._trainer = types.SimpleNamespace(accumulate_grad_batches=4)
    assert _lightning_accumulate(m) == 4
    plain = nn.Linear(2, 2)
    plain._trainer = types.SimpleNamespace(accumulate_grad_batches=4)
    assert _lightning_accumulate(plain) is None  # not a LightningModule: the user's own loop


def test_recorded_trainer_run_says_its_accumulation_fixes_in_training_step():
    run = fsdp_doctor.load_run(RUN)
    assert (run.config.driver, run.config.lightning_accumulate) == (LIGHTNING_DRIVER, 2)
    report = fsdp_doctor.build_report(run)
    got = {f.code: f.recommendation for f in report.findings if f.code.startswith("accum.")}
    assert set(got) == {"accum.sync_every_micro_batch", "accum.regather"}, set(got)
    for code, call in (("accum.sync_every_micro_batch", "self.model.set_requires_gradient_sync(is_last_micro_batch)"),
                       ("accum.regather", "self.model.set_reshard_after_backward(is_last_micro_batch)")):
        rec = got[code]
        assert rec.where == "training_step" and set(rec.inputs) == {"batch_idx"}, (code, rec.where, rec.inputs)
        assert call in rec.code and "model.model" not in rec.code, rec.code
        assert "every 2 batches" in rec.code and "training_step" in rec.text, rec
        assert max(map(len, rec.code.splitlines())) <= 80, rec.code
    assert "training_step(self, batch, batch_idx)" in FIX_PLACES["training_step"]


def test_optimizer_fix_said_in_on_train_start_and_run_on_the_trainers_optimizer():
    """traces/cpu/lightning_trainer_unfused: the Trainer of tests/test_lightning.py without accumulation, AdamW from
    configure_optimizers as torch picks it on the CPU (for-loop: 6.1 ms of a 30.6 ms step). optim.unfused_step's fix
    named ``optimizer`` "after your optimizer is built", which a LightningModule has not: it is said as its
    on_train_start, on the Trainer's optimizer. Run as printed on a stand-in Trainer holding a real AdamW, every
    group steps fused (a real Trainer: tests/test_lightning.py, 1.26 ms against 1.07 predicted)."""
    import torch

    report = fsdp_doctor.build_report(fsdp_doctor.load_run(RUN.parent / "lightning_trainer_unfused"))
    (f,) = [f for f in report.findings if f.code == "optim.unfused_step"]
    rec = f.recommendation
    assert (rec.where, rec.inputs) == ("lightning_module", {}), (rec.where, rec.inputs)
    assert "optimizer = self.trainer.optimizers[0]" in rec.code and "on_train_start" in rec.text, rec
    assert "pass fused=True where you build it, in configure_optimizers." in rec.text, rec.text
    assert max(map(len, rec.code.splitlines())) <= 80, rec.code
    params = [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))]
    opt = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "lr": 0.1}])
    hooks = {}
    exec(rec.code, hooks)
    hooks["on_train_start"](types.SimpleNamespace(trainer=types.SimpleNamespace(optimizers=[opt])))
    assert [(g["fused"], g["foreach"]) for g in opt.param_groups] == [(True, False)] * 2
    sum(p.sum() for p in params).backward()
    opt.step()  # (torch's fused CPU kernel)
    assert params[1].detach().tolist() == pytest.approx([(1 - 0.1 * 0.01) - 0.1] * 2)  # (AdamW's first step: lr)


def test_pasted_fix_syncs_where_the_trainer_steps_the_optimizer():
    """The printed lines run in training_step: gradient sync on for the batches after which Lightning's training
    epoch loop steps the optimizer (its _should_accumulate: the batch count in the epoch a multiple of
    accumulate_grad_batches, or the epoch's last batch), off for the others. 7 batches, accumulate_grad_batches=3."""
    rec = Recommendation(text="t", code="# before each micro-batch's backward:\n"
                                        "model.model.set_requires_gradient_sync(is_last_micro_batch)",
                         where="loop", inputs={"is_last_micro_batch": "..."})
    S.for_lightning(rec, 3)
    calls = []
    for batch_idx in range(7):
        trainer = types.SimpleNamespace(accumulate_grad_batches=3, num_training_batches=7, is_last_batch=batch_idx == 6)
        me = types.SimpleNamespace(trainer=trainer, model=types.SimpleNamespace(set_requires_gradient_sync=calls.append))
        exec(rec.code, {"self": me, "batch_idx": batch_idx})
    assert calls == [False, False, True, False, False, True, True], calls
    # a fix neither keyed to the last micro-batch nor on the model nor naming the optimizer is left as it was
    for code in ("gc.freeze()  # optimizer built", "optimizer = torch.optim.AdamW(model.parameters())"):
        other = Recommendation(text="t", code=code, where="optimizer")  # (a rebinding: the hook's name only)
        S.for_lightning(other, 3)
        assert (other.code, other.where) == (code, "optimizer")
    # one on the sharded model goes into configure_model, on self (tests/test_lightning.py pastes two there), where
    # the records say the root; where only Lightning's profiler's trace says who drove the run, it is left as it was
    on_model = Recommendation(text="t", code="model.set_reshard_after_forward(False)", where="sharded")
    S.for_lightning(on_model, 3)
    assert (on_model.code, on_model.where) == ("self.set_reshard_after_forward(False)", "configure_model")
    traced = Recommendation(text="t", code="model.set_reshard_after_forward(False)", where="sharded")
    S.for_lightning(traced, 3, root_known=False)
    assert (traced.code, traced.where) == ("model.set_reshard_after_forward(False)", "sharded")


def test_trace_units_read_as_the_records_units_under_a_module_holding_the_root():
    """The trace names units from the FSDP root ("blocks.0", "(root)"), the records from the watched LightningModule
    ("model.blocks.0", "model"): accum.sync_every_micro_batch read no unit's gradients and predicted its fix's peak
    unchanged (716,872 B in this recording), where the fix pasted into this run's training_step measured 763,664 B (the unsharded
    gradients held between micro-batches in place of their shards). It now counts them: 784,776 B."""
    from fsdp_doctor.units import ROOT_LABEL, fsdp_label

    assert [fsdp_label(n, ["model"]) for n in ("model", "model.blocks.0", "other.x")] == [ROOT_LABEL, "blocks.0", "other.x"]
    assert [fsdp_label(n) for n in ("", "blocks.0")] == [ROOT_LABEL, "blocks.0"]
    report = fsdp_doctor.build_report(fsdp_doctor.load_run(RUN))
    (f,) = [f for f in report.findings if f.code == "accum.sync_every_micro_batch"]
    assert (f.evidence["unsharded_grads_bytes"], f.evidence["sharded_grads_freed_bytes"]) == (135_808, 67_904)
    assert f.predicted.peak_bytes_before == 716_872 and f.predicted.peak_bytes_after == 784_776, f.predicted
    assert abs(f.predicted.peak_bytes_after - 763_664) <= 0.1 * 763_664
    # Lightning's 8-byte broadcast between each forward and its backward is the loop's, not a model-parallel
    # collective: the run's groups are the world's and ModelParallelStrategy's tensor-parallel dimension of 1 rank
    # (before: "exposed model-parallel collectives 1%")
    for rank, v in report.verdict.per_rank.items():
        assert v.shares_pct["model_comm"] == 0 and v.shares_pct["other_comm"] > 0, (rank, v.shares_pct)


#: eval.regather's fix as printed for a Lightning Trainer's run before it was said in hooks (a trial's: validation
#: through self.model every 5 steps, the LightningModule holding the root as ``model``)
_EVAL_FIX = """# imports: at the top of your file, not in a function using these names
import torch
from torch.distributed.fsdp import FSDPModule

# every unit gathered once for the whole evaluation, not once per forward pass
model.model.set_reshard_after_forward(False)
with torch.no_grad():
    evaluate()
# the training steps' setting back, and the gathered parameters released
names = ['model.blocks.0', 'model.blocks.1', 'model.blocks.2']
for name in names:
    unit = model.get_submodule(name)
    unit.set_reshard_after_forward(True, recurse=False)
for module in model.modules():
    if isinstance(module, FSDPModule):
        module.reshard()"""


def test_evaluation_fix_said_as_validation_hooks():
    """The lines before the user's evaluation go into on_validation_start, those after it into on_validation_end, on
    ``self``; the unit names in the list stay the LightningModule's paths, and torch, no longer used, is not imported.
    tests/test_lightning.py pastes them into a real Trainer where Lightning is installed."""
    rec = Recommendation(text="t", code=_EVAL_FIX, where="evaluation", inputs={"evaluate": "..."})
    S.for_lightning(rec, 1)
    assert (rec.where, rec.inputs) == ("lightning_module", {}) and rec.where in FIX_PLACES
    assert "import torch\n" not in rec.code and "from torch.distributed.fsdp import FSDPModule" in rec.code
    hooks: dict = {}
    exec(rec.code, hooks)
    calls = []

    class Unit:
        def __init__(self, name):
            self.name = name

        def set_reshard_after_forward(self, on, recurse=True):
            calls.append((self.name, on, recurse))

    class Stand:
        model = Unit("model")

        def get_submodule(self, name):
            return Unit(name)

        def modules(self):
            return []

    hooks["on_validation_start"](Stand())
    assert calls == [("model", False, True)]
    hooks["on_validation_end"](Stand())
    assert calls[1:] == [(f"model.blocks.{i}", True, False) for i in range(3)], calls


def test_units_kept_gathered_between_micro_batches_read_from_the_roots_marks():
    """traces/cpu/lightning_regather_fixed: the same Trainer with accum.regather's fix pasted at the top of
    training_step (tests/test_lightning.py pastes it: 3 all-gathers per block a step in place of 4). The rule read
    the units kept gathered from the watched model's own forward_start marks, which a LightningModule's training_step
    never makes (it calls self.model), found none, and fired again ("8.3 ms/step faster"); the second micro-batch now
    starts at the first forward_start after a backward_end, the root's: 135,808 B unsharded there, every unit."""
    from fsdp_doctor.diagnose import estimate as E

    fixed = RUN.parent / "lightning_regather_fixed"
    report = fsdp_doctor.build_report(fsdp_doctor.load_run(fixed))
    tl = report.memory.per_rank["0"].timeline
    assert not [r for r in tl if r.get("unit") is None and r.get("phase") == "forward_start"]
    assert E.kept_between_micro_batches(tl) == 135_808
    s = next(s for s in report.rules if s.code == "accum.regather")
    assert s.status == "quiet" and s.reason.startswith("the units are kept gathered between micro-batches already "
                                                       "(132.62 KiB unsharded"), (s.status, s.reason)
    # the run without the fix: resharded after each micro-batch's backward, the root's own copy alone held
    before = fsdp_doctor.build_report(fsdp_doctor.load_run(RUN))
    assert E.kept_between_micro_batches(before.memory.per_rank["0"].timeline) == 33_280
    assert "accum.regather" in {f.code for f in before.findings}


def test_the_roots_forward_is_the_models_and_the_loss_follows_it():
    """The FSDP root inside the watched LightningModule (``self.model``) runs outside the watched module's own
    forward, which never runs: its forward (the embedding, the head, its all-gather) read as time outside the model,
    each block's forward as the model's, and the loss's high-water as the last block's forward ("blocks.2
    in_forward" before the root's forward_end). The root's forward is the step's now, and the loss phase starts
    where it ends: each micro-batch's rows run root forward_start ... root forward_end, loss_start, in_loss,
    root backward_start."""
    report = fsdp_doctor.build_report(fsdp_doctor.load_run(RUN))
    tl = report.memory.per_rank["0"].timeline
    marks = [(r.get("unit"), r.get("phase")) for r in tl]
    ends = [i for i, m in enumerate(marks) if m == ("model", "forward_end")]
    assert len(ends) == 2, marks  # (2 micro-batches)
    for i in ends:
        assert marks[i + 1:i + 4] == [(None, "loss_start"), (None, "in_loss"), ("model", "backward_start")], marks[i:i + 4]
    assert marks.count((None, "loss_start")) == 2, marks
    # the step's forward holds the root's own: at least every block's forward, and the step's time outside the
    # model is under a fifth of it
    for rd in fsdp_doctor.load_run(RUN).ranks.values():
        for s in rd.steps[1:-1]:
            blocks = sum(u.fwd_ms for u in s.units if u.name.startswith("model.blocks."))
            assert s.forward_ms >= blocks and s.outside_ms < 0.2 * s.wall_ms, (s.forward_ms, blocks, s.outside_ms)
