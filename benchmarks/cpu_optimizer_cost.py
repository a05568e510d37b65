"""What an optimizer step costs on the CPU, per parameter element, as CPUOffloadPolicy runs it: FSDP2's sharded
DTensor parameters on the host, one thread (torchrun sets OMP_NUM_THREADS=1 for each rank), torch's default
(for-each off on the CPU) implementation. offload.recommended predicts the step after offloading with these
figures (CPU_OPTIMIZER_NS_PER_ELEMENT in fsdp_doctor/diagnose/rules/offload.py); this prints them again on this
machine, beside the table, for the matrix's GPU-shaped GPT (4 layers, 512 wide, vocabulary 8192) on one gloo rank.

    python benchmarks/cpu_optimizer_cost.py [--reps 5]

The GPU machine's host measured its offloaded optimizer phase at 82 ms for 9.73 M elements per rank (the H100
row gpu_gpt_offload: 8.4 ns per element), which AdamW's 8.0 here predicts within 5%."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from fsdp_doctor.diagnose.rules.offload import CPU_OPTIMIZER_NS_PER_ELEMENT
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
        print(f"{n / 1e6:.2f} M elements in {len(params)} DTensor parameters, 1 thread, {a.reps} steps each")
        print(f"{'optimizer':10} {'ms/step':>8} {'ns/element':>11} {'table':>6}")
        for name, opt in (("AdamW", torch.optim.AdamW(params, lr=1e-3)), ("Adam", torch.optim.Adam(params, lr=1e-3)),
                          ("SGD", torch.optim.SGD(params, lr=1e-3, momentum=0.9))):
            opt.step()  # the state made
            t = time.perf_counter()
            for _ in range(a.reps):
                opt.step()
            dt = (time.perf_counter() - t) / a.reps
            print(f"{name:10} {dt * 1e3:8.1f} {dt / n * 1e9:11.2f} {CPU_OPTIMIZER_NS_PER_ELEMENT[name]:6.1f}")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
