"""Doctor-on vs doctor-off step time on the reference workload, interleaved within one run.

One 2-rank FSDP2 training run alternates blocks of steps with the doctor attached (``fsdp_doctor.watch``
with default settings, entered and exited around each block) and blocks without it, so both see the same
processes, the same memory layout and the same background load. Step times come from one clock in both
(a timestamp after each step, ``doctor.step()`` included), so the doctor's own bookkeeping is counted
against it. Excluded from both kinds of block alike: the first ``--skip`` steps of each block (warm-up after
attaching) and the steps the default profiler schedule records (and the one that carries the trace export).

    .venv/bin/python benchmarks/overhead.py [--blocks 40] [--block-steps 30]   (about 2 minutes)
    python benchmarks/overhead.py --device cuda --nproc 1 --n-layers 16 --d-model 2048 ...   (the GPU campaign's runs)

Prints the median step time of each kind and their ratio (the figure the README quotes), the spread of the
per-block-pair ratios (this shared 2-core VM's noise is about ±5%), and the process CPU time per step
(all threads: the doctor's hooks, its memory probe and its TensorBoard writer thread) over the same steps.
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


def excluded(block_steps: int, skip: int) -> set[int]:
    from fsdp_doctor.record.profiling import ProfileSchedule

    sched = ProfileSchedule()
    ex = set(range(skip))
    for s in range(block_steps):
        if sched(s).name != "NONE":
            ex.update({s, s + 1})  # the window, and the step whose wall time carries the export
    return ex


def workload(a: argparse.Namespace):
    from fsdp_doctor.workloads import WorkloadConfig

    return WorkloadConfig(n_layers=a.n_layers, d_model=a.d_model, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads,
                          vocab=a.vocab, seq_len=a.seq_len, batch_size=a.batch_size, param_dtype=a.param_dtype,
                          device=a.device, num_threads=1, async_unshard=a.device == "cpu",
                          steps=a.blocks * a.block_steps)


def rank_main(rank: int, world: int, port: int, a: argparse.Namespace, tmp: str) -> None:
    import torch
    import torch.distributed as dist

    import fsdp_doctor
    from fsdp_doctor.workloads import WorkloadConfig
    from fsdp_doctor.workloads.data import batches
    from fsdp_doctor.workloads.train import build_training, next_token_loss

    from fsdp_doctor.workloads.launch import _rank_env
    from fsdp_doctor.workloads.train import backend_for, setup_rank

    cfg = workload(a)
    os.environ.update(_rank_env(cfg, rank, world, port))
    device = setup_rank(cfg, int(os.environ.get("FSDP_DOCTOR_CUDA_DEVICE", 0)))
    dist.init_process_group(backend_for(cfg.device), rank=rank, world_size=world,
                            **({"device_id": device} if device is not None else {}))
    model, opt = build_training(cfg)
    data = ((tok.to(cfg.device), tgt.to(cfg.device)) for tok, tgt in batches(cfg, rank))
    # On a GPU the host runs ahead: both kinds of block wait for the device at the end of each step (as a loop
    # that logs `loss.item()` does), so a step's time is the device's when it is the longer one.
    sync = torch.cuda.synchronize if device is not None else (lambda: None)
    times: dict[str, list[list[float]]] = {"on": [], "off": []}
    cpu: dict[str, list[list[float]]] = {"on": [], "off": []}  # process CPU ms of each step (all threads)
    for b in range(a.blocks):
        on = b % 2 == 1  # off first: the very first block also warms the allocator and caches
        ctx = fsdp_doctor.watch(model, opt, out_dir=f"{tmp}/block{b}", **json.loads(a.watch)) if on else None
        doctor = ctx.__enter__() if ctx else None
        dist.barrier()
        t_prev, ts, c_prev, cs = time.perf_counter(), [], time.process_time(), []
        for _ in range(a.block_steps):
            tok, tgt = next(data)
            loss = next_token_loss(model(tok), tgt)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if doctor:
                doctor.step()
            sync()
            t, c = time.perf_counter(), time.process_time()
            ts.append(1e3 * (t - t_prev))
            cs.append(1e3 * (c - c_prev))
            t_prev, c_prev = t, c
        cpu["on" if on else "off"].append(cs)
        if ctx:
            ctx.__exit__(None, None, None)
        times["on" if on else "off"].append(ts)
        if rank == 0:
            print(f"block {b + 1}/{a.blocks} doctor {'on ' if on else 'off'}: median step "
                  f"{statistics.median(ts):.2f} ms", flush=True)
    Path(f"{tmp}/times.rank{rank}.json").write_text(json.dumps({**times, "cpu": cpu}))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=40, help="blocks of steps, alternating off/on (even)")
    ap.add_argument("--block-steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=3, help="warm-up steps left out at the start of each block")
    ap.add_argument("--nproc", type=int, default=2, help="ranks (gloo on cpu, NCCL on cuda; more ranks than GPUs share)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--n-layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--n-heads", type=int, default=4)
    ap.add_argument("--n-kv-heads", type=int, default=None, help="fewer than --n-heads: grouped-query attention")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--param-dtype", choices=("bf16", "fp32", "fp16"), default=None, help="MixedPrecisionPolicy param_dtype")
    ap.add_argument("--json", default=None, help="also write the figures here (JSON)")
    ap.add_argument("--per-step", action="store_true", help="print rank 0's median time at each step of a block")
    ap.add_argument("--watch", default="{}", help='extra watch() arguments as JSON, e.g. \'{"memory": false}\'')
    a = ap.parse_args()
    import torch.multiprocessing as mp

    from fsdp_doctor.workloads import free_port

    ex = excluded(a.block_steps, a.skip)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        mp.start_processes(rank_main, args=(a.nproc, free_port(), a, tmp), nprocs=a.nproc, start_method="spawn")
        per_kind = {"on": [], "off": []}
        block_medians = {"on": [], "off": []}
        cpu_steps = {"on": [], "off": []}
        for r in range(a.nproc):
            times = json.loads(Path(f"{tmp}/times.rank{r}.json").read_text())
            cpu = times.pop("cpu")
            for kind, blocks in cpu.items():
                for cs in blocks:
                    cpu_steps[kind] += [c for s, c in enumerate(cs) if s not in ex]
            for kind, blocks in times.items():
                for i, ts in enumerate(blocks):
                    kept = [t for s, t in enumerate(ts) if s not in ex]
                    per_kind[kind] += kept
                    if r == 0:
                        block_medians[kind].append(statistics.median(kept))
        if a.per_step:
            raw = json.loads(Path(f"{tmp}/times.rank0.json").read_text())
            print("step  " + "  ".join(f"{s:>5}" for s in range(a.block_steps)))
            for kind in ("off", "on"):
                med = [statistics.median(b[s] for b in raw[kind]) for s in range(a.block_steps)]
                print(f"{kind:5} " + "  ".join(f"{m:5.0f}" for m in med))
    m_on, m_off = statistics.median(per_kind["on"]), statistics.median(per_kind["off"])
    pair = [on / off for on, off in zip(block_medians["on"], block_medians["off"])]
    print(f"\n{a.blocks} blocks x {a.block_steps} steps, {a.nproc} ranks, {time.perf_counter() - t0:.0f} s; "
          f"{len(ex)} steps per block excluded (warm-up, profiler window)")
    print(f"{'':14}{'median step':>14}{'rank-steps':>12}")
    for name, xs in (("doctor off", per_kind["off"]), ("doctor on", per_kind["on"])):
        print(f"{name:14}{statistics.median(xs):>11.2f} ms{len(xs):>12}")
    print(f"per block pair (on/off, rank 0): min {min(pair):.3f}  median {statistics.median(pair):.3f}  max {max(pair):.3f}")
    c_on, c_off = statistics.mean(cpu_steps["on"]), statistics.mean(cpu_steps["off"])
    print(f"process CPU time per step (all threads, mean over the same steps): off {c_off:.2f} ms, on {c_on:.2f} ms, "
          f"ratio {c_on / c_off:.4f} ({100 * (c_on / c_off - 1):+.2f}%)")
    print(f"\noverhead: doctor-on / doctor-off median step time = {m_on / m_off:.4f}  ({100 * (m_on / m_off - 1):+.2f}%)")
    if a.json:
        from fsdp_doctor.workloads import total_param_count

        cfg = workload(a)
        Path(a.json).write_text(json.dumps({
            "device": a.device, "nproc": a.nproc, "workload": {k: v for k, v in vars(a).items() if k != "json"},
            "params": total_param_count(cfg), "median_step_ms": {"off": m_off, "on": m_on}, "ratio": m_on / m_off,
            "pair_ratio": {"min": min(pair), "median": statistics.median(pair), "max": max(pair)},
            "cpu_ms_per_step": {"off": c_off, "on": c_on}, "excluded_steps_per_block": len(ex),
        }, indent=1))


if __name__ == "__main__":
    main()
