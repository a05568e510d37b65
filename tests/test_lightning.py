"""Lightning (optional: skipped where it is not importable). Fabric's ``fabric.setup(model)`` returns a
``_FabricModule`` holding the sharded model as ``_forward_module``; watched through it, every unit was named
"_forward_module.blocks.0" (a new-user trial, 2 gloo ranks, ``ModelParallelStrategy``), and wrap.params_in_root's
plan, pasted in place of the fully_shard calls in the user's ``parallelize_fn`` (given the model itself), read
``model._forward_module.emb``: AttributeError. The units are named from the model inside the wrapper; the plan
printed for it, pasted there, trains and the rule goes quiet. Fabric launches its ranks by running the script again
(its CPU launcher), as its users run it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import assert_gc_fixed, TINY_LM, REPO, child_pythonpath

pytest.importorskip("lightning")

_SCRIPT = TINY_LM + textwrap.dedent(
    """
    import json, sys
    import torch, torch.nn as nn
    from torch.distributed.fsdp import fully_shard
    import lightning as L
    from lightning.fabric.strategies import ModelParallelStrategy
    import fsdp_doctor

    out, fix = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else ""

    def parallelize(model, device_mesh):
        if fix:  # in place of the fully_shard calls, as printed
            exec(open(fix).read(), {"model": model})
        else:
            for b in model.blocks:
                fully_shard(b, mesh=device_mesh["data_parallel"])
            fully_shard(model, mesh=device_mesh["data_parallel"])
        return model

    torch.set_num_threads(1)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(parallelize, 2, 1))
    fabric.launch()
    fabric.seed_everything(0)
    model = fabric.setup(Net())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(1 + fabric.global_rank)
    with fsdp_doctor.watch(model, optimizer, out_dir=out, profile=False, capacity_bytes=64 << 20) as doc:
        for _ in range(6):
            x = torch.randint(0, V, (4, 17), generator=g)
            fabric.backward(nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()))
            optimizer.step()
            optimizer.zero_grad()
            doc.step()
    """
)


def _run(tmp_path, source: str, name: str, *args: str):
    """(the report of the run ``source`` wrote to ``tmp_path / name``, its standard output): the script run as its
    users run it, Lightning launching its second rank by running it again."""
    import fsdp_doctor

    script = tmp_path / "case.py"
    script.write_text(source)
    env = {**os.environ, "PYTHONPATH": child_pythonpath(REPO), "OMP_NUM_THREADS": "1"}
    # (a session of its own: Lightning starts the second rank as a child process, which a timeout killing the first
    # alone left running, orphaned, for hours: the whole group goes)
    p = subprocess.Popen([sys.executable, str(script), str(tmp_path / name), *filter(None, args)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                         start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        stdout, stderr = p.communicate()
        raise AssertionError(f"{name}: no end in 300 s\n{stderr[-3000:]}") from None
    r = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    assert r.returncode == 0, r.stderr[-3000:]
    return fsdp_doctor.build_report(fsdp_doctor.load_run(tmp_path / name)), r.stdout


def _fabric_run(tmp_path, name: str, fix: str = ""):
    return _run(tmp_path, _SCRIPT, name, fix)[0]


@pytest.mark.long
def test_fabric_units_named_as_the_users_model_and_the_plan_pasted_in_parallelize_fn(tmp_path):
    before = _fabric_run(tmp_path, "fabric")
    assert [u.name for u in before.units] == ["", "blocks.0", "blocks.1", "blocks.2"]
    (f,) = [f for f in before.findings if f.code == "wrap.params_in_root"]
    code = f.recommendation.code
    assert "fully_shard(model.emb, mesh=mesh)" in code and "_forward_module" not in code, code

    fix = tmp_path / "fix.py"
    fix.write_text(code)
    after = _fabric_run(tmp_path, "fixed", str(fix))  # (AttributeError '_forward_module' on both ranks before)
    assert {"emb", "head", "blocks.0"} <= {u.name for u in after.units}
    assert not {"wrap.params_in_root", "wrap.root_not_sharded"} & {g.code for g in after.findings}


_TRAINER = TINY_LM + textwrap.dedent(
    """
    import json, sys
    import torch, torch.nn as nn
    from torch.distributed.fsdp import fully_shard
    import lightning as L
    from lightning.pytorch.profilers import PyTorchProfiler
    from lightning.pytorch.strategies import ModelParallelStrategy
    import fsdp_doctor

    # mode: "accumulate" (2 micro-batches a step), "validate", "profiled" (Lightning's own PyTorchProfiler writing
    # its traces to out, a loss logged with sync_dist=True, no doctor), "profiled_accumulate" or "profiled_validate",
    # "gc" (200k objects kept for the run from the module's set-up, 50k a step kept 3 steps, and 35k reference
    # cycles dropped a step: the fix's period 14-15 steps, which the run's 19 pass)
    out, mode = sys.argv[1], sys.argv[2]
    fix = open(sys.argv[3]).read() if len(sys.argv) > 3 else ""
    where = sys.argv[4] if len(sys.argv) > 4 else "training_step"  # where the fix goes, as its report said
    hooks = {}  # a fix of LightningModule hooks, as printed
    if fix and ("validate" in mode or where == "lightning_module"):
        exec(fix, hooks)

    class LM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = Net()
            self.losses = []
            if mode == "gc":
                from fsdp_doctor.workloads.train import hold_objects
                hold_objects(200_000)

        def configure_model(self):
            if fix and where == "configure_model_plan":  # in place of the fully_shard calls, as printed
                exec(fix, {"self": self})
                return
            mesh = self.device_mesh["data_parallel"]
            for b in self.model.blocks:
                fully_shard(b, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
            if fix and where == "configure_model":  # after them, as printed
                exec(fix, {"self": self})

        def training_step(self, batch, batch_idx):
            if fix and "accumulate" in mode and where == "training_step":  # at its top, as printed
                exec(fix, {"self": self, "batch_idx": batch_idx})
            if mode == "gc":
                from fsdp_doctor.workloads.train import hold_objects, make_garbage
                hold_objects(200_000)
                make_garbage(35_000)
            x = batch[0]
            loss = nn.functional.cross_entropy(self.model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
            self.losses.append(loss.item())
            if "profiled" in mode:
                self.log("loss", loss, sync_dist=True)
            return loss

        def validation_step(self, batch, batch_idx):
            x = batch[0]
            return nn.functional.cross_entropy(self.model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())

        def on_validation_start(self):
            if "on_validation_start" in hooks:
                hooks["on_validation_start"](self)

        def on_validation_end(self):
            if "on_validation_end" in hooks:
                hooks["on_validation_end"](self)

        def on_train_start(self):
            if "on_train_start" in hooks:
                hooks["on_train_start"](self)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if "on_train_batch_end" in hooks:
                hooks["on_train_batch_end"](self, outputs, batch, batch_idx)

        def on_train_end(self):
            if "on_train_end" in hooks:
                hooks["on_train_end"](self)

        def configure_optimizers(self):  # ("untrained": the blocks' parameters only, the rest left trainable)
            return torch.optim.AdamW(self.model.blocks.parameters() if "untrained" in mode else self.parameters(),
                                     lr=1e-3)

    class Doctor(L.Callback):  # the README's, with a capacity
        def on_train_start(self, trainer, pl_module):
            self.doctor = fsdp_doctor.watch(pl_module, trainer.optimizers[0], out_dir=out,
                                            capacity_bytes=64 << 20).__enter__()  # (no capacity to read on a CPU)
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.doctor.step()
        def on_train_end(self, trainer, pl_module):
            self.doctor.__exit__(None, None, None)

    torch.set_num_threads(1)
    L.seed_everything(0)
    lm = LM()
    data = torch.utils.data.TensorDataset(torch.randint(0, V, (4 * 2 * 19, 17), generator=torch.Generator().manual_seed(1)))
    how = (dict(accumulate_grad_batches=2, limit_val_batches=0) if "accumulate" in mode else
           dict(val_check_interval=5, num_sanity_val_steps=0) if "validate" in mode else  # 8 batches every 5 steps
           dict(limit_val_batches=0))
    if "profiled" in mode:
        how["profiler"] = PyTorchProfiler(dirpath=out, filename="prof", export_to_chrome=True,
                                          schedule=torch.profiler.schedule(wait=2, warmup=1, active=4, repeat=1))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(2, 1), max_epochs=1,
                        callbacks=[] if "profiled" in mode else [Doctor()], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, **how)
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    trainer.fit(lm, loader, torch.utils.data.DataLoader(torch.utils.data.Subset(data, range(64)), batch_size=4))
    if trainer.global_rank == 0:
        import gc
        print("COLLECTOR " + json.dumps(gc.isenabled()))
        print("LOSSES " + json.dumps(lm.losses))
    """
)


def _trainer_run(tmp_path, name: str, mode: str, fix: str = "", where: str = ""):
    report, out = _run(tmp_path, _TRAINER, name, mode, fix, where)
    return report, json.loads(next(ln for ln in out.splitlines() if ln.startswith("LOSSES "))[len("LOSSES "):])


@pytest.mark.long
def test_trainer_accumulation_fix_said_in_training_step_and_pasted_there(tmp_path):
    """Lightning's Trainer with accumulate_grad_batches=2 under ModelParallelStrategy reduce-scatters every
    micro-batch (its block_backward_sync is DDP's). accum.sync_every_micro_batch's fix read
    ``model.model.set_requires_gradient_sync(is_last_micro_batch)`` for a loop the Trainer owns; it is said in
    training_step, its last micro-batch as the Trainer decides it (19 batches: the epoch's last steps alone), and
    pasted there the units reduce-scatter once per optimizer step, the losses unchanged."""
    _, rec = _accumulation_fix_pasted(tmp_path, "accumulate")
    assert "self.model.set_requires_gradient_sync(is_last_micro_batch)" in rec.code, rec.code
    assert "self.trainer.accumulate_grad_batches" in rec.code and "model.model" not in rec.code, rec.code


def _accumulation_fix_pasted(tmp_path, mode: str):
    """(the first run's report, accum.sync_every_micro_batch's fix): the Trainer run in ``mode`` (2 micro-batches a
    step), the fix said in training_step, then pasted there as printed in a second run: the rule quiet there, the
    losses of both runs equal."""
    before, losses = _trainer_run(tmp_path, "before", mode)
    (f,) = [f for f in before.findings if f.code == "accum.sync_every_micro_batch"]
    rec = f.recommendation
    assert rec.where == "training_step" and set(rec.inputs) == {"batch_idx"}, (rec.where, rec.inputs)
    fix = tmp_path / "fix.py"
    fix.write_text(rec.code)
    after, fixed_losses = _trainer_run(tmp_path, "fixed", mode, str(fix))
    s = next(s for s in after.rules if s.code == "accum.sync_every_micro_batch")
    assert s.status == "quiet" and s.reason.startswith("1 reduce-scatter per unit per step"), (s.status, s.reason)
    assert len(losses) == len(fixed_losses) == 19
    assert fixed_losses == pytest.approx(losses, rel=1e-5), (losses, fixed_losses)
    return before, rec


@pytest.mark.long
def test_trainer_regather_fix_pasted_in_training_step_keeps_the_units_gathered(tmp_path):
    """accum.regather's fix as the recorded Trainer run prints it (traces/cpu/lightning_trainer_accumulate), pasted at
    the top of training_step: each block is all-gathered 3 times a step in place of 4 (its forward once), and the rule
    reads the units kept gathered where the second micro-batch starts (read from the watched model's own marks, which
    a LightningModule's training_step never makes, it fired on the fixed run: traces/cpu/lightning_regather_fixed),
    the losses unchanged."""
    import fsdp_doctor

    run = Path(__file__).resolve().parents[1] / "traces" / "cpu" / "lightning_trainer_accumulate"
    (f,) = [f for f in fsdp_doctor.build_report(fsdp_doctor.load_run(run)).findings if f.code == "accum.regather"]
    assert f.recommendation.where == "training_step" and "self.model.set_reshard_after_backward(is_last_micro_batch)" \
        in f.recommendation.code, f.recommendation
    before, losses = _trainer_run(tmp_path, "trainer", "accumulate")
    fix = tmp_path / "fix.py"
    fix.write_text(f.recommendation.code)
    after, fixed_losses = _trainer_run(tmp_path, "fixed", "accumulate", str(fix))
    s = next(s for s in after.rules if s.code == "accum.regather")
    assert s.status == "quiet" and s.reason.startswith("the units are kept gathered between micro-batches"), s
    gathers = {name: {f"blocks.{i}": sum(r.count for r in rep.overlap.per_unit if r.rank == 0 and r.unit == f"blocks.{i}"
                                         and r.collective == "all_gather") for i in range(3)}
               for name, rep in (("before", before), ("after", after))}
    steps = len(after.overlap.per_rank["0"].steps)
    assert gathers == {"before": {f"blocks.{i}": 4 * steps for i in range(3)},
                       "after": {f"blocks.{i}": 3 * steps for i in range(3)}}, gathers
    assert fixed_losses == pytest.approx(losses, rel=1e-5), (losses, fixed_losses)


@pytest.mark.long
def test_trainer_validation_kept_gathered_by_the_hooks_printed(tmp_path):
    """Validation through ``self.model`` every 5 steps (8 batches): each forward gathered every unit again.
    eval.regather's fix around the user's evaluation is said as the LightningModule's on_validation_start and
    on_validation_end; pasted as printed (the hooks defined from the printed code), the units stay gathered across
    the validation's forwards, the rule is quiet and the training losses are those of the run without it."""
    before, losses = _trainer_run(tmp_path, "validate", "validate")
    (f,) = [f for f in before.findings if f.code == "eval.regather"]
    rec = f.recommendation
    assert rec.where == "lightning_module" and rec.inputs == {}, (rec.where, rec.inputs)
    assert "def on_validation_start(self):\n" in rec.code and "def on_validation_end(self):\n" in rec.code, rec.code
    assert "    self.model.set_reshard_after_forward(False)" in rec.code and "evaluate()" not in rec.code, rec.code

    fix = tmp_path / "fix.py"
    fix.write_text(rec.code)
    after, fixed_losses = _trainer_run(tmp_path, "validate_fixed", "validate", str(fix))
    s = next(s for s in after.rules if s.code == "eval.regather")
    assert s.status == "quiet" and "stay gathered" in s.reason, (s.status, s.reason)
    assert fixed_losses == losses


@pytest.mark.long
def test_trainer_optimizer_fix_said_in_on_train_start_and_pasted_there(tmp_path):
    """The Trainer builds AdamW from configure_optimizers, as torch picks it on the CPU (its for-loop step over the
    DTensor shards): optim.unfused_step's fix read ``for group in optimizer.param_groups`` "after your optimizer is
    built", with no ``optimizer`` in a LightningModule. It is said as the LightningModule's on_train_start, on the
    Trainer's optimizer; pasted there as printed (the hook defined from the printed code), the optimizer steps fused:
    the rule quiet, the optimizer's own time down, the losses those of the loop's step."""
    before, losses = _trainer_run(tmp_path, "loop", "plain")
    (f,) = [f for f in before.findings if f.code == "optim.unfused_step"]
    rec = f.recommendation
    assert rec.where == "lightning_module" and rec.inputs == {}, (rec.where, rec.inputs)
    assert "def on_train_start(self):\n    optimizer = self.trainer.optimizers[0]" in rec.code, rec.code
    assert max(map(len, rec.code.splitlines())) <= 80 and "on_train_start" in rec.text, rec
    fix = tmp_path / "fix.py"
    fix.write_text(rec.code)
    after, fixed_losses = _trainer_run(tmp_path, "fused", "plain", str(fix), "lightning_module")
    s = next(s for s in after.rules if s.code == "optim.unfused_step")
    assert (s.status, s.reason) == ("quiet", "AdamW runs fused already"), (s.status, s.reason)
    assert after.run.optimizer_impl == "fused", after.run.optimizer_impl
    opt = {name: r.steps.job.phases_p50_ms["optimizer"] for name, r in (("loop", before), ("fused", after))}
    predicted = f.evidence["fused_optimizer_ms_est"]
    assert opt["fused"] < opt["loop"] - (opt["loop"] - predicted) / 2, (opt, predicted)
    assert fixed_losses == pytest.approx(losses, rel=1e-4), (losses, fixed_losses)


@pytest.mark.long
def test_trainer_untrained_params_frozen_by_the_hook_printed(tmp_path):
    """configure_optimizers over the blocks only: the embedding and the head train for nothing
    (optim.untrained_params); its fix, on the optimizer and the model, is said as on_train_start too, and pasted
    there as printed the parameters outside the optimizer are frozen: the rule quiet, the losses those of the run
    without it (nothing updated them)."""
    before, losses = _trainer_run(tmp_path, "untrained", "untrained")
    (f,) = [f for f in before.findings if f.code == "optim.untrained_params"]
    rec = f.recommendation
    assert rec.where == "lightning_module" and "for param in self.parameters():" in rec.code, rec.code
    fix = tmp_path / "fix.py"
    fix.write_text(rec.code)
    after, fixed_losses = _trainer_run(tmp_path, "frozen", "untrained", str(fix), "lightning_module")
    s = next(s for s in after.rules if s.code == "optim.untrained_params")
    assert (s.status, s.reason) == ("quiet", "the optimizer holds every trainable parameter"), (s.status, s.reason)
    assert fixed_losses == pytest.approx(losses, rel=1e-5), (losses, fixed_losses)


@pytest.mark.long
def test_lightning_profiler_traces_read_the_closure_and_the_logged_loss_as_the_loops(tmp_path):
    """Lightning's own PyTorchProfiler on its Trainer (2 gloo ranks, a loss logged with sync_dist=True), its traces
    analysed as a user would (``fsdp-doctor analyze`` on its dirpath). The Trainer steps AdamW as
    ``optimizer.step(closure)``, whose label holds the forward, the log's barrier and all-reduce and the backward,
    and its profiler steps between the loss and the backward. The log's collectives read as the optimizer's own
    (optim.step_comm: "inside optimizer.step(): the optimizer issues them ... Muon or Shampoo", on AdamW), and each
    step's backward, before its first forward, as the loop's time outside the model: the trial read input (outside
    the model) 13.5% of the step, host (between operators inside it) 7.8%. Now: no collective of the optimizer's, no
    such attribution, and no backward inside the time outside the model (input 6.7% and host 14.7% then)."""
    from fsdp_doctor.trace import intervals as iv
    from fsdp_doctor.trace import load_window

    report, _ = _run(tmp_path, _TRAINER, "prof", "profiled")
    assert len(report.overlap.per_rank) == 2, report.overlap.per_rank
    assert {pr.driver for pr in report.overlap.per_rank.values()} == {"lightning.Trainer"}  # (its profiler's labels)
    other = [(r.rank, r.collective, r.phase) for r in report.overlap.per_unit if r.unit == "(other)"]
    assert {c for _, c, _ in other} >= {"all_reduce", "barrier"}, other
    assert not [o for o in other if o[2] == "optimizer"], other
    for f in report.findings:
        assert f.code != "optim.step_comm" or "inside optimizer.step()" not in f.evidence["attribution"], f.evidence
    for rank, v in report.verdict.per_rank.items():
        assert v.shares_pct["model_comm"] == 0, (rank, v.shares_pct)
    for path in sorted((tmp_path / "prof").glob("*.pt.trace.json")):
        w = load_window(path)
        events = json.loads(path.read_text())["traceEvents"]
        backward = [e["ts"] for e in events if e.get("name", "").startswith("FSDP::pre_backward")
                    and w.window[0] <= e["ts"] < w.window[1]]
        assert len(backward) >= 3 * 4, (path.name, len(backward))  # (3 steps, 4 units each)
        starts, ends = w.outside
        inside = [t for t in backward if ((starts <= t) & (t < ends)).any()]
        assert not inside and iv.measure(w.outside) > 0, (path.name, inside)


@pytest.mark.long
def test_lightning_profiler_traces_find_accumulation_syncing_and_its_fix_in_training_step(tmp_path):
    """Lightning's own profiler on its Trainer with accumulate_grad_batches=2 (ModelParallelStrategy reduce-scatters
    every micro-batch): its profiler steps per batch, mid-pass, and the optimizer steps in every other one, so a
    window of 3 steps held 1 or 2 optimizer.step() calls as it fell: 1.5 steps per optimizer step, and
    accum.sync_every_micro_batch stayed quiet ("1 reduce-scatter per unit per step", a new-user trial). The backward
    passes between two optimizer steps say 2; the fix is said in training_step on every FSDP unit (the trace does not
    say which module configure_model sharded as the root), and pasted there as printed each unit reduce-scatters once
    per optimizer step: the rule quiet, the losses as before."""
    before, rec = _accumulation_fix_pasted(tmp_path, "profiled_accumulate")
    assert {pr.backwards_per_optimizer_step for pr in before.overlap.per_rank.values()} == {2.0}
    assert "module.set_requires_gradient_sync(is_last_micro_batch, recurse=False)" in rec.code, rec.code
    assert "Lightning's profiler" in rec.text and "your loop calls prof.step()" not in rec.text, rec.text


@pytest.mark.long
def test_trainer_model_fixes_said_and_pasted_in_configure_model(tmp_path):
    """A fix on the sharded model (prefetch.sync_unshard's) and a sharding plan (wrap.params_in_root's) where
    Lightning's Trainer built the model: they read ``for module in model.modules()`` "after your fully_shard calls"
    and ``fully_shard(model.model.emb, ...)`` "in place of your fully_shard calls", with no ``model`` in a
    LightningModule's configure_model. Said there now, on self, and pasted there as printed: each finding gone, the
    plan's units the root's former modules, the losses as before."""
    before, losses = _trainer_run(tmp_path, "before", "accumulate")
    fixes = {f.code: f.recommendation for f in before.findings}
    for code, where, name in (("prefetch.sync_unshard", "configure_model", "async"),
                              ("wrap.params_in_root", "configure_model_plan", "plan")):
        rec = fixes[code]
        assert rec.where == where and "self." in rec.code and "model.model" not in rec.code, (code, rec.where, rec.code)
        fix = tmp_path / f"{name}.py"
        fix.write_text(rec.code)
        after, fixed_losses = _trainer_run(tmp_path, name, "accumulate", str(fix), where)
        assert code not in {f.code for f in after.findings}, (code, [f.code for f in after.findings])
        assert fixed_losses == pytest.approx(losses, rel=1e-5), (code, losses, fixed_losses)
        if name == "plan":
            assert {"model.emb", "model.head"} <= {u.name for u in after.units}, [u.name for u in after.units]


@pytest.mark.long
def test_lightning_profiler_validation_traces_are_left_out_of_the_training_figures(tmp_path):
    """With validation, Lightning's profiler writes a validation_step trace per rank beside training_step's: its
    validation batch read as a profiled micro-batch ("1 of 2 profiled steps hold no optimizer.step(): prof.step()
    called per micro-batch") and the training step as "7x the other profiled steps" (a new-user trial). Those files
    are left out of the training figures, said in one note."""
    report, _ = _run(tmp_path, _TRAINER, "prof", "profiled_validate")
    assert {r: len(fs) for r, fs in report.overlap.evaluation_windows.items()} == {"0": 1, "1": 1}, \
        report.overlap.evaluation_windows
    assert all("validation_step" in f for fs in report.overlap.evaluation_windows.values() for f in fs)
    assert not [n for n in report.run.notes if "micro-batch" in n or "without a backward (rank" in n], report.run.notes
    for pr in report.overlap.per_rank.values():
        assert pr.steps and not pr.steps_without_optimizer and not pr.nograd_forwards, pr


@pytest.mark.long
def test_trainer_gc_fix_said_in_the_modules_hooks_and_pasted_there(tmp_path):
    """A LightningModule that keeps many objects alive (200k from its set-up, 50k a step for 3 steps) and drops 35k
    reference cycles a step: the collector's full collections traverse them inside the steps (jitter.gc). Its fix read
    "after your optimizer is built", a collect_between_steps for a loop the Trainer owns; it is said as the
    LightningModule's on_train_start (set-up frozen, the collector off), on_train_batch_end (a collection every N
    optimizer steps) and on_train_end (the collector on again), and pasted there as printed (the hooks defined from the
    printed code): the rule quiet, the GC's share under its threshold but for the fix's one collection (after optimizer
    step N, its period: the run is longer), the mean step down by at least half the predicted gain, the collector on
    after fit(), the losses those of the run without it."""
    before, losses = _trainer_run(tmp_path, "gc", "gc")
    (f,) = [f for f in before.findings if f.code == "jitter.gc"]
    rec = f.recommendation
    assert rec.where == "lightning_module" and "collect_between_steps" not in rec.code, (rec.where, rec.code)
    assert "def on_train_batch_end(self, outputs, batch, batch_idx):" in rec.code, rec.code
    assert "self.trainer.accumulate_grad_batches) == 0:" in rec.code and "on_train_batch_end" in rec.text, rec
    assert max(map(len, rec.code.splitlines())) <= 80, rec.code
    fix = tmp_path / "fix.py"
    fix.write_text(rec.code)
    after, out = _run(tmp_path, _TRAINER, "gc_fixed", "gc", str(fix), "lightning_module")
    fixed_losses = json.loads(next(ln for ln in out.splitlines() if ln.startswith("LOSSES "))[len("LOSSES "):])
    assert "COLLECTOR true" in out.splitlines(), out[-2000:]
    assert f.evidence["collect_every_steps"] < 18, f.evidence  # (its collection line runs: at step N, once)
    assert_gc_fixed(f, before, after, tmp_path / "gc_fixed")
    assert fixed_losses == losses
