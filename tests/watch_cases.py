"""Run as a script (one gloo rank in a fresh process): exercises watch()'s entry checks and its
step-aside-on-error path, printing one JSON object with what happened. Used by test_recorder.py."""

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

import fsdp_doctor
from fsdp_doctor.workloads import WorkloadConfig, free_port
from fsdp_doctor.workloads.train import build_training
from fsdp_doctor.workloads.train import next_token_loss
from fsdp_doctor.workloads.data import batches


def train_losses(cfg, out_dir=None, sabotage=False, evaluate=None, **watch_kwargs):
    """The reference GPT's losses, under watch() into ``out_dir`` if given; ``evaluate``: {step: "no_grad" |
    "eval_mode"}, an evaluation of 2 batches after that step, under torch.no_grad() or with model.eval() only."""
    torch.manual_seed(0)
    model, opt = build_training(cfg)
    losses = []
    watch_kwargs.setdefault("profile", False)
    ctx = fsdp_doctor.watch(model, opt, out_dir=out_dir, **watch_kwargs) if out_dir else None
    doctor = ctx.__enter__() if ctx else None
    for step, (tok, tgt) in zip(range(cfg.steps), batches(cfg, 0)):
        if sabotage and step == 2:
            doctor._acc[1] = None  # the next hook that touches it raises inside the doctor
        loss = next_token_loss(model(tok), tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if doctor:
            doctor.step()
        losses.append(loss.item())
        how = (evaluate or {}).get(step)
        if how:
            model.eval()
            with torch.no_grad() if how == "no_grad" else contextlib.nullcontext():
                [next_token_loss(model(tok), tgt).item() for _ in range(2)]
            model.train()
    if ctx:
        ctx.__exit__(None, None, None)
    return losses


def main():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    out = {}
    tmp = tempfile.mkdtemp()

    def refused(fn):
        try:
            fn()
        except fsdp_doctor.WatchError as e:
            return str(e)
        return None

    plain = nn.Linear(4, 4)
    out["no_fsdp"] = refused(lambda: fsdp_doctor.watch(plain, out_dir=tmp).__enter__())
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(m[0])
    fully_shard(m)
    blocker = os.path.join(tmp, "a_file")
    open(blocker, "w").close()
    out["bad_dir"] = refused(lambda: fsdp_doctor.watch(m, out_dir=os.path.join(blocker, "sub")).__enter__())
    with fsdp_doctor.watch(m, out_dir=os.path.join(tmp, "w1"), profile=False):
        out["double"] = refused(lambda: fsdp_doctor.watch(m, out_dir=os.path.join(tmp, "w2")).__enter__())

    cfg = WorkloadConfig(steps=5, n_layers=2, d_model=64)
    base = train_losses(cfg)
    run_dir = os.path.join(tmp, "sabotaged")
    out["sabotaged_losses_equal"] = train_losses(cfg, run_dir, sabotage=True) == base
    out["sabotaged_dir"] = run_dir
    # a run directory holds one run: watching into it again moves the earlier run aside (it reads as before from
    # previous/run-ID), overwrite=True replaces it
    kept = shutil.copytree(run_dir, os.path.join(tmp, "kept"))
    old = fsdp_doctor.load_run(kept)
    with fsdp_doctor.watch(m, out_dir=kept, profile=False) as doc:
        m(torch.randn(2, 4)).sum().backward()
        doc.step()
    new, moved = fsdp_doctor.load_run(kept), fsdp_doctor.load_run(os.path.join(kept, "previous", f"run-{old.run_id}"))
    out["rerun"] = [old.run_id, moved.run_id, [s.step for s in old.ranks[0].steps],
                    [s.step for s in moved.ranks[0].steps], new.run_id, [s.step for s in new.ranks[0].steps],
                    new.notes, sorted(os.listdir(kept))]
    copy = shutil.copytree(run_dir, os.path.join(tmp, "rerun"))
    old_id = fsdp_doctor.load_run(copy).run_id
    with fsdp_doctor.watch(m, out_dir=copy, profile=False, overwrite=True) as doc:
        m(torch.randn(2, 4)).sum().backward()
        doc.step()
    again = fsdp_doctor.load_run(copy)
    out["overwritten"] = [old_id, again.run_id, again.ranks[0].header.run_id, [s.step for s in again.ranks[0].steps],
                          os.path.exists(os.path.join(copy, "previous"))]
    # activation checkpointing: the re-run in backward is timed per unit
    ac_dir = os.path.join(tmp, "ac")
    train_losses(WorkloadConfig(steps=3, n_layers=2, d_model=64, ac="block"), ac_dir)
    last = fsdp_doctor.load_run(ac_dir).ranks[0].steps[-1]
    out["recompute_ms"] = {u.name: u.recompute_ms for u in last.units}
    # the user's own optimizer pre-hook (registered before watch) sleeping 30 ms, and an evaluation of 2 batches
    # under torch.no_grad() after step 1: optimizer time and no-grad forwards, not time outside the model; after
    # step 2 an evaluation of 2 batches with model.eval() and autograd on, and the last step trained in eval mode
    torch.manual_seed(0)
    model, opt = build_training(WorkloadConfig(steps=4, n_layers=2, d_model=64))
    opt.register_step_pre_hook(lambda *a: time.sleep(0.03))
    hook_dir = os.path.join(tmp, "hooked")
    with fsdp_doctor.watch(model, opt, out_dir=hook_dir, profile=False) as doctor:
        for step, (tok, tgt) in zip(range(4), batches(cfg, 0)):
            next_token_loss(model(tok), tgt).backward()
            opt.step()
            opt.zero_grad()
            doctor.step()
            if step == 1:
                with torch.no_grad():
                    for _ in range(2):
                        model(tok)
            if step == 2:  # (and the model stays in eval mode for the last step's training)
                model.eval()
                [next_token_loss(model(tok), tgt).item() for _ in range(2)]
    out["hooked"] = [[s.optimizer_ms, s.outside_ms, s.no_grad_forwards, s.no_grad_ms, [u.fwd_calls for u in s.units],
                      s.autograd_eval_forwards, s.forward_ms, [u.ag_wait_bwd_ms > 0 for u in s.units]]
                     for s in fsdp_doctor.load_run(hook_dir).ranks[0].steps]
    # the doctor's own work at a step's end (its records, here made 25 ms slow) is in the next step's wall as its
    # doctor_ms, not the user's time outside the model
    from fsdp_doctor.record.sinks import Sinks

    on_step = Sinks.on_step
    Sinks.on_step = lambda self, rec: (time.sleep(0.025), on_step(self, rec))[1]
    slow_dir = os.path.join(tmp, "slow_sink")
    try:
        train_losses(WorkloadConfig(steps=4, n_layers=2, d_model=64), slow_dir)
    finally:
        Sinks.on_step = on_step
    out["slow_sink"] = [[s.doctor_ms, s.outside_ms] for s in fsdp_doctor.load_run(slow_dir).ranks[0].steps]
    # an evaluation in eval mode (autograd on) after step 4 adds marks that step 5's replay of the last full memory
    # step does not line up with, so the next step is measured in full; steps 5-7 are the profiler's window
    traced_dir = os.path.join(tmp, "traced")
    train_losses(WorkloadConfig(steps=10, n_layers=2, d_model=64), traced_dir, evaluate={4: "eval_mode"},
                 profile=fsdp_doctor.ProfileSchedule(first=6, active=2, warmup=1, every=0), memory=True)
    out["traced_memory"] = [[s.step, s.profiled, s.memory.transients]
                            for s in fsdp_doctor.load_run(traced_dir).ranks[0].steps]
    # a 6-step run ends where the default schedule's first window opens (step 6): no trace of a step that never
    # ran, and the rules that need a trace say why there is none and how to take one; the schedule they print
    # records one
    short = {}
    for name, profile in (("default", True), ("advised", None)):
        d = os.path.join(tmp, f"short_{name}")
        if profile is None:
            reason = short["default"]["reason"]
            profile = eval(reason[reason.index("profile=") + 8:reason.index(")) records") + 1],  # noqa: S307
                           {"fsdp_doctor": fsdp_doctor})
        train_losses(WorkloadConfig(steps=6, n_layers=2, d_model=64), d, profile=profile)
        report = fsdp_doctor.build_report(fsdp_doctor.load_run(d))
        short[name] = {"files": sorted(os.listdir(os.path.join(d, "profiler"))),
                       # (a rule that needs a trace: accum.sync_every_micro_batch reads the records without one)
                       "reason": next(r.reason for r in report.rules if r.code == "optim.step_comm"),
                       "problems": list(report.problems),
                       "traced": bool(report.overlap is not None and report.overlap.per_rank)}
    out["short"] = short
    dist.destroy_process_group()
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
