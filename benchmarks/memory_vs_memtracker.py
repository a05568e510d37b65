"""fsdp_doctor's memory categories against PyTorch's FSDPMemTracker, on the same steps of the same run.

    python benchmarks/memory_vs_memtracker.py [--steps 3] [--layers 4]

Two gloo ranks train the reference GPT with ``wrap="blocks_only"`` (each block its own unit, the
embeddings / final norm / head in the root: FSDPMemTracker breaks on grouped units, so the default
``[norm, lm_head]`` group is avoided) with ``fsdp_doctor.watch(memory=
{"full_every": 1})`` and ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` (a
TorchDispatchMode that classifies every storage as it is created; ``reset_mod_stats()`` each step), in two
runs of the same deterministic training (attached together, the tracker's re-registration of FSDP's hooks
changes what the doctor sees). For the last step, rank 0 prints per category the highest value each tool saw at the same points of the
step (our mark (unit, forward_start) = the tracker's "After Pre-Forward" snapshot of that module,
forward_end = "Before Post-Forward", backward_start = "Before Pre-Backward", backward_end = "Before
Post-Backward") and the breakdown at our peak mark, with the differences.

Where the definitions differ, and why:

* activations: ours are the tensors autograd saved for backward (exact, each storage once, parameters
  excluded). The tracker's "Activation" is every storage created during the forward that is still alive,
  saved or not: the block outputs held by the Python frames between modules, the model output (logits)
  and its loss tensors while they live. At module boundaries the two agree up to those unsaved outputs;
  the tracker also counts the forward's transient tensors at its op-level peak.
* temporaries: ours are ``memory_allocated`` minus the named categories, so 0 on CPU; the tracker's
  "Temp" is every storage created during backward (gradients of activations, op workspaces).
* comm_buffers: ours = the tracker's "All Gather" + "Reduce Scatter". The tracker tags the all-gather
  output only in pre-forward / pre-backward, so the copy-out buffer kept until the next unit's unshard is
  still "All Gather" there, as in ours.
* "Inputs" (the token batch) has no counterpart: the doctor does not see the user's data.
* peak: the tracker's true peak is op-level (inside a unit's forward or backward); ours is the highest
  of the marks, i.e. at unit boundaries. The table compares both at the same points; the op-level peak is
  printed alongside.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

OURS_TO_TRACKER = {
    "sharded_params": ("Sharded Param",),
    "unsharded_params": ("Unsharded Param",),
    "buffers": ("Buffer",),
    "sharded_grads": ("Sharded Grad",),
    "unsharded_grads": ("Unsharded Grad",),
    "optimizer_state": ("OptState",),
    "activations": ("Activation",),
    "comm_buffers": ("All Gather", "Reduce Scatter"),
    "temporaries": ("Temp",),
}
PHASE_TO_STATE = {
    "forward_start": "After Pre-Forward",
    "forward_end": "Before Post-Forward",
    "backward_start": "Before Pre-Backward",
    "backward_end": "Before Post-Backward",
}


def _worker(rank: int, port: int, out: str, steps: int, layers: int, mode: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    import fsdp_doctor
    from fsdp_doctor.workloads import WorkloadConfig
    from fsdp_doctor.workloads.data import batches
    from fsdp_doctor.workloads.train import build_training, next_token_loss

    cfg = WorkloadConfig(wrap="blocks_only", n_layers=layers, steps=steps)
    model, opt = build_training(cfg)
    tracker_points = {}
    op_peak = None
    if mode == "ours":
        with fsdp_doctor.watch(model, opt, out_dir=out, profile=False, memory={"full_every": 1}) as doc:
            for step, (x, y) in zip(range(cfg.steps), batches(cfg, rank)):
                loss = next_token_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                doc.step()
        dist.destroy_process_group()
        return
    fmt = FSDPMemTracker(model, opt)
    if True:
        with fmt:
            for step, (x, y) in zip(range(cfg.steps), batches(cfg, rank)):
                fmt.reset_mod_stats()
                if step == cfg.steps - 1:
                    fmt._peak_mem = {}  # the op-level peak of this step only
                loss = next_token_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
            for mod_stat in fmt.memory_tracking.values():
                fqn = mod_stat.mod_fqn.split(".", 1)[1] if "." in mod_stat.mod_fqn else ""
                for state, snaps in mod_stat.snapshots.items():
                    snap = snaps[-1].get(torch.device("cpu")) if snaps else None
                    if snap:
                        tracker_points[f"{fqn}|{state.value}"] = {k: int(v) for k, v in snap.items()}
            op_peak = {k: int(v) for k, v in fmt.get_tracker_snapshot("peak").get(torch.device("cpu"), {}).items()}
    with open(os.path.join(out, f"tracker{rank}.json"), "w") as f:
        json.dump({"points": tracker_points, "op_peak": op_peak}, f)
    dist.destroy_process_group()


def _pct(a: int, b: int) -> str:
    if a == b:
        return "0.0%"
    if b == 0:
        return "n/a"
    return f"{100.0 * (a - b) / b:+.1f}%"


def compare(out: str, rank: int = 0) -> list[tuple]:
    from fsdp_doctor import load_run

    run = load_run(out)
    tr = json.loads(open(os.path.join(out, f"tracker{rank}.json")).read())
    step = run.ranks[rank].steps[-1]
    tl = step.memory.timeline
    if tl is None:
        raise SystemExit("the last step has no timeline; run with more steps")
    cols = tl.columns
    ours_max = {c: 0 for c in OURS_TO_TRACKER}
    theirs_max = {c: 0 for c in OURS_TO_TRACKER}
    matched = 0
    best = None
    for row in tl.rows:
        d = dict(zip(cols, row))
        if d["unit"] is None or d["phase"] not in PHASE_TO_STATE:
            continue
        snap = tr["points"].get(f"{d['unit']}|{PHASE_TO_STATE[d['phase']]}")
        if snap is None:
            continue
        matched += 1
        total = sum(d[c] for c in cols[3:])
        if best is None or total > best[0]:
            best = (total, d, snap)
        for c, keys in OURS_TO_TRACKER.items():
            ours_max[c] = max(ours_max[c], d[c])
            theirs_max[c] = max(theirs_max[c], sum(snap.get(k, 0) for k in keys))
    rows = []
    for c, keys in OURS_TO_TRACKER.items():
        at_o = best[1][c]
        at_t = sum(best[2].get(k, 0) for k in keys)
        rows.append((c, ours_max[c], theirs_max[c], at_o, at_t))
    return rows, matched, best, tr["op_peak"], step.memory


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    out = args.out or tempfile.mkdtemp(prefix="mem_vs_tracker_")
    from fsdp_doctor.workloads import free_port

    # two runs of the same deterministic training: the tools are not attached together (the tracker
    # re-registers FSDP's hooks and wraps its backward methods, which changes what the other one sees)
    mp.spawn(_worker, args=(free_port(), out, args.steps, args.layers, "ours"), nprocs=2)
    mp.spawn(_worker, args=(free_port(), out, args.steps, args.layers, "tracker"), nprocs=2)
    rows, matched, best, op_peak, mem = compare(out)
    mib = 1 << 20
    print(f"run: {out}; last step, rank 0; {matched} matched points")
    print(f"{'category':<18}{'max ours':>11}{'max tracker':>13}{'diff':>8}   "
          f"{'@peak ours':>11}{'@peak tracker':>14}{'diff':>8}")
    for c, mo, mt, ao, at in rows:
        print(f"{c:<18}{mo / mib:>10.3f}M{mt / mib:>12.3f}M{_pct(mo, mt):>8}   {ao / mib:>10.3f}M{at / mib:>13.3f}M"
              f"{_pct(ao, at):>8}")
    d = best[1]
    t_total = sum(v for k, v in best[2].items() if k not in ("Total", "Inputs"))
    print(f"our peak mark: {d['unit'] or '(root)'} {d['phase']}: ours {best[0] / mib:.3f} MiB, tracker at the same "
          f"point {t_total / mib:.3f} MiB without inputs ({best[2].get('Inputs', 0) / mib:.3f} MiB inputs)")
    print("tracker op-level peak of the step: " + ", ".join(f"{k} {v / mib:.3f}M" for k, v in op_peak.items() if v))
    print(f"probe cost this step: {mem.probe_us} us")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
