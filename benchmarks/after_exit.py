"""Step time after the doctor is gone vs a model it never watched, side by side in one run.

Three copies of the reference model train in the same 2-rank processes: ``never`` is never watched; ``exited`` is
watched (default settings) for ``--watched-steps`` steps and then ``watch()`` exits; ``aside`` is watched until
the doctor steps aside (an exception inside its hook, as a bug would raise) and then trains on with the doctor
still entered. Afterwards the three alternate in blocks of steps (same processes, same memory layout, same
background load); the first ``--skip`` steps of each block are left out.

    .venv/bin/python benchmarks/after_exit.py [--blocks 6] [--block-steps 15]   (1-2 minutes idle)

Prints each model's median step time and the ratios exited/never and aside/never (1.00 when nothing of the
doctor remains; this shared 2-core VM's noise is a few percent), and the hooks left on each model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
KINDS = ("never", "exited", "aside")


def hook_count(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def rank_main(rank: int, world: int, port: int, a: argparse.Namespace, tmp: str) -> None:
    import torch
    import torch.distributed as dist

    import fsdp_doctor
    from fsdp_doctor.workloads import WorkloadConfig
    from fsdp_doctor.workloads.data import batches
    from fsdp_doctor.workloads.train import build_training, next_token_loss

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = WorkloadConfig(n_layers=a.n_layers, d_model=a.d_model, async_unshard=True)
    data = batches(cfg, rank)
    runs = {}
    for kind in KINDS:
        torch.manual_seed(0)
        runs[kind] = build_training(cfg)

    def step(kind, doctor=None):
        model, opt = runs[kind]
        tok, tgt = next(data)
        next_token_loss(model(tok), tgt).backward()
        opt.step()
        opt.zero_grad()
        if doctor is not None:
            doctor.step()

    for _ in range(a.watched_steps):
        step("never")
    with fsdp_doctor.watch(*runs["exited"], out_dir=f"{tmp}/exited", profile=False) as doc:
        for _ in range(a.watched_steps):
            step("exited", doc)
    aside = fsdp_doctor.watch(*runs["aside"], out_dir=f"{tmp}/aside", profile=False)
    doc = aside.__enter__()
    for i in range(a.watched_steps):
        if i == a.watched_steps // 2:
            doc._acc[1] = None  # the next hook that touches it raises inside the doctor: it steps aside
        step("aside", doc)
    hooks = {k: hook_count(runs[k][0]) for k in KINDS}
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    for b in range(a.blocks):
        for kind in KINDS[b % 3:] + KINDS[:b % 3]:  # rotate the order: none always runs first
            dist.barrier()
            t_prev = time.perf_counter()
            for s in range(a.block_steps):
                step(kind, doc if kind == "aside" else None)
                t = time.perf_counter()
                if s >= a.skip:
                    times[kind].append(1e3 * (t - t_prev))
                t_prev = t
    aside.__exit__(None, None, None)
    Path(f"{tmp}/times.rank{rank}.json").write_text(json.dumps({"times": times, "hooks": hooks}))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=6, help="rounds of one block per model")
    ap.add_argument("--block-steps", type=int, default=15)
    ap.add_argument("--skip", type=int, default=2, help="steps left out at the start of each block")
    ap.add_argument("--watched-steps", type=int, default=8)
    ap.add_argument("--nproc", type=int, default=2, help="gloo ranks")
    ap.add_argument("--n-layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    a = ap.parse_args()
    import torch.multiprocessing as mp

    from fsdp_doctor.workloads import free_port

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(rank_main, args=(a.nproc, free_port(), a, tmp), nprocs=a.nproc, start_method="spawn")
        per_rank = [json.loads(Path(f"{tmp}/times.rank{r}.json").read_text()) for r in range(a.nproc)]
    med = {k: statistics.median([t for pr in per_rank for t in pr["times"][k]]) for k in KINDS}
    print(f"{a.blocks} rounds x {a.block_steps} steps per model, {a.nproc} ranks, {time.perf_counter() - t0:.0f} s")
    print(f"{'':10}{'median step':>14}{'forward hooks left':>20}")
    for k in KINDS:
        print(f"{k:10}{med[k]:>11.2f} ms{per_rank[0]['hooks'][k]:>20}")
    for k in KINDS[1:]:
        print(f"{k} / never = {med[k] / med['never']:.4f}  ({100 * (med[k] / med['never'] - 1):+.2f}%)")


if __name__ == "__main__":
    main()
