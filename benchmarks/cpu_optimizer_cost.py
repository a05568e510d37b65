"""What an optimizer step costs on the CPU, as CPUOffloadPolicy runs it: FSDP2's sharded DTensor parameters on the
host, one thread (torchrun sets OMP_NUM_THREADS=1 for each rank).

1. Per parameter element, torch's default (for-each off on the CPU) implementation, for the matrix's GPU-shaped GPT
   (4 layers, 512 wide, vocabulary 8192) on one gloo rank, beside offload.recommended's table
   (CPU_OPTIMIZER_NS_PER_ELEMENT in fsdp_doctor/diagnose/rules/offload.py), which predicts the step after offloading.
2. Adam's and AdamW's implementations (for-loop, foreach, fused): ns per element and us per tensor, fitted from 400
   tensors of 256 elements and 20 of 1 M, beside optim.unfused_step's table (CPU_STEP_COST in
   fsdp_doctor/diagnose/thresholds.py); then that rule's prediction checked on the GPT: its fused step predicted
   from the loop's measured time scaled by the table, against the fused step measured, side by side.

    python benchmarks/cpu_optimizer_cost.py [--reps 5]

The GPU machine's host measured its offloaded optimizer phase at 82 ms for 9.73 M elements per rank (the H100
row gpu_gpt_offload: 8.4 ns per element), which AdamW's 8.0 here predicts within 5%. The host's speed varies (this
VM looped at 5.0 and 8.05 ns per element in two sessions): optim.unfused_step scales the step's own time by the
table's ratio, so that it cancels."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

IMPLS = ("for-loop", "foreach", "fused")


def _kwargs(impl: str) -> dict:
    return {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}


def _time(opt, reps: int) -> float:
    """The median step (ms) of ``reps``, after one that makes the state."""
    opt.step()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        opt.step()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main() -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from fsdp_doctor.diagnose.rules.offload import CPU_OPTIMIZER_NS_PER_ELEMENT
    from fsdp_doctor.diagnose.estimate import cpu_step_ratio
    from fsdp_doctor.diagnose.thresholds import CPU_STEP_COST
    from fsdp_doctor.workloads import WorkloadConfig, build_model, free_port

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = build_model(WorkloadConfig(n_layers=4, d_model=512, n_heads=8, n_kv_heads=2, vocab=8192, seq_len=512))
        mesh = init_device_mesh("cpu", (1,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        params = list(model.parameters())
        n = sum(p.numel() for p in params)
        for p in params:
            p.grad = DTensor.from_local(torch.randn_like(p.to_local()), mesh, p.placements)
        print(f"1. {n / 1e6:.2f} M elements in {len(params)} DTensor parameters, 1 thread, {a.reps} steps each")
        print(f"{'optimizer':10} {'ms/step':>8} {'ns/element':>11} {'table':>6}")
        gpt = {}
        for name, opt in (("AdamW", torch.optim.AdamW(params, lr=1e-3)), ("Adam", torch.optim.Adam(params, lr=1e-3)),
                          ("SGD", torch.optim.SGD(params, lr=1e-3, momentum=0.9))):
            dt = _time(opt, a.reps)
            gpt[name] = dt
            print(f"{name:10} {dt:8.1f} {dt / n * 1e6:11.2f} {CPU_OPTIMIZER_NS_PER_ELEMENT[name]:6.1f}")

        shapes = ((400, 256), (20, 1_000_000))  # (tensors, elements each): the per-tensor cost, then the per-element

        def flat(k: int, numel: int) -> list:
            ps = [torch.nn.Parameter(distribute_tensor(torch.randn(numel), mesh, [Shard(0)])) for _ in range(k)]
            for p in ps:
                p.grad = distribute_tensor(torch.randn(numel), mesh, [Shard(0)])
            return ps

        flats = [flat(*s) for s in shapes]
        print(f"\n2. Adam and AdamW by implementation: {shapes[0][0]} x {shapes[0][1]} and {shapes[1][0]} x "
              f"{shapes[1][1]:,} elements;\n   fitted ns/element and us/tensor (the table's in brackets)")
        print(f"{'optimizer':10} {'impl':9} {'small ms':>9} {'large ms':>9} {'ns/element':>16} {'us/tensor':>16}")
        for name in ("AdamW", "Adam"):
            for impl in IMPLS:
                (k1, e1), (k2, e2) = shapes
                t1, t2 = (_time(getattr(torch.optim, name)(ps, lr=1e-3, **_kwargs(impl)), a.reps) for ps in flats)
                # t = k * (e * ns / 1e6 + us / 1e3), two shapes, two unknowns
                ns = (t2 / k2 - t1 / k1) / (e2 - e1) * 1e6
                us = (t1 / k1 - e1 * ns / 1e6) * 1e3
                tns, tus = CPU_STEP_COST[impl]
                print(f"{name:10} {impl:9} {t1:9.2f} {t2:9.2f} {ns:9.2f} ({tns:4.2f}) {us:9.1f} ({tus:4.1f})")
        fused = _time(torch.optim.AdamW(params, lr=1e-3, fused=True), a.reps)
        predicted = gpt["AdamW"] * cpu_step_ratio("fused", "for-loop", n, len(params))
        print(f"\noptim.unfused_step on the GPT: AdamW for-loop {gpt['AdamW']:.1f} ms measured; fused "
              f"{predicted:.1f} ms predicted, {fused:.1f} ms measured ({predicted / fused:.2f}x)")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
