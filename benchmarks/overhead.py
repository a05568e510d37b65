"""Doctor-on vs doctor-off step time on the reference workload, interleaved within one run.

One 2-rank FSDP2 training run alternates blocks of steps with the doctor attached (``fsdp_doctor.watch``
with default settings, entered and exited around each block) and blocks without it, so both see the same
processes, the same memory layout and the same background load. Step times come from one clock in both
(a timestamp after each step, ``doctor.step()`` included), so the doctor's own bookkeeping is counted
against it. Excluded from both kinds of block alike: the first ``--skip`` steps of each block (warm-up after
attaching) and the steps the default profiler schedule records (and the one that carries the trace export).

    .venv/bin/python benchmarks/overhead.py [--blocks 40] [--block-steps 30] [--compile inductor]   (about 2 minutes)
    python benchmarks/overhead.py --device cuda --nproc 1 --n-layers 16 --d-model 2048 ...   (the GPU campaign's runs)

Prints the median step time of each kind and their ratio (the figure the README quotes), the spread of the
per-block-pair ratios (this shared 2-core VM's noise is about ±5%), and the process CPU time per step
(all threads: the doctor's hooks, its memory probe and its TensorBoard writer thread) over the same steps.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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


def arms_of(a: argparse.Namespace) -> dict:
    """The doctor-on kinds of block: {name: watch() arguments} (--arms, else one "on" block of --watch)."""
    return json.loads(a.arms) if a.arms else {"on": json.loads(a.watch)}


def amortised_ms(arm: dict, off: dict, skip: int, off_median: float, profiled: bool) -> dict:
    """What the steps left out of the steady figure cost, amortised (rank 0's blocks, ms over the off median): the
    profiler window's steps and the step carrying its export, every ``ProfileSchedule.every`` steps, and a full
    memory step (steps 1-2 of each block over the off blocks' same steps; step 0 also attaches the doctor), every
    ``full_every`` steps as the probe's records said at the block's end (None: memory off). ``profiled``: the
    arm's watch() takes profiler windows."""
    from fsdp_doctor.record.profiling import ProfileSchedule

    sched = ProfileSchedule()
    n = len(arm["wall"][0])
    med = lambda blocks, s: statistics.median(b[s] for b in blocks)  # noqa: E731
    window = sorted(s for s in excluded(n, 0) if s < n)
    window_ms = sum(max(0.0, med(arm["wall"], s) - off_median) for s in window)
    periods = [p for p in arm["full_every"] if p]
    full_every = statistics.median(periods) if periods else None
    full_ms = statistics.median(med(arm["wall"], s) - med(off["wall"], s) for s in (1, 2)) if full_every and skip >= 3 else 0.0
    per_step = (window_ms / sched.every if profiled else 0.0) + (max(0.0, full_ms) / full_every if full_every else 0.0)
    return {"window_ms": window_ms if profiled else 0.0, "window_every": sched.every if profiled else None,
            "full_ms": full_ms, "full_every": full_every, "per_step_ms": per_step}


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
    if a.compile:  # each block compiled in place after fully_shard, as torchtitan and kernels.launch_bound's fix do
        for block in model.layers:
            block.compile(backend=a.compile)
    data = ((tok.to(cfg.device), tgt.to(cfg.device)) for tok, tgt in batches(cfg, rank))
    # On a GPU the host runs ahead: both kinds of block wait for the device at the end of each step (as a loop
    # that logs `loss.item()` does), so a step's time is the device's when it is the longer one.
    sync = torch.cuda.synchronize if device is not None else (lambda: None)
    # each step's device time: a CUDA event pair around it, in both kinds of block, read after the block
    event = (lambda: torch.cuda.Event(enable_timing=True)) if device is not None else None
    arms = arms_of(a)
    # arm -> {"wall", "host", "cpu", "device": per block, per step; "full_every": per block, the probe's period}
    out: dict[str, dict[str, list]] = {}
    for b in range(a.blocks):
        arm = "off" if b % 2 == 0 else list(arms)[(b // 2) % len(arms)]  # off first: it also warms the caches
        run_dir = f"{tmp}/block{b}"
        ctx = fsdp_doctor.watch(model, opt, out_dir=run_dir, **arms[arm]) if arm != "off" else None
        doctor = ctx.__enter__() if ctx else None
        kind = out.setdefault(arm, {m: [] for m in ("wall", "host", "cpu", "device", "full_every")})
        dist.barrier()
        t_prev, c_prev = time.perf_counter(), time.process_time()
        ts, hs, cs, evs = [], [], [], []
        for _ in range(a.block_steps):
            ev = (event(), event()) if event else None
            if ev:
                ev[0].record()
            tok, tgt = next(data)
            loss = next_token_loss(model(tok), tgt)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if doctor:
                doctor.step()
            if ev:
                ev[1].record()
                evs.append(ev)
            h = time.perf_counter()  # the host's part of the step: everything launched, before the wait
            sync()
            t, c = time.perf_counter(), time.process_time()
            ts.append(1e3 * (t - t_prev))
            hs.append(1e3 * (h - t_prev))
            cs.append(1e3 * (c - c_prev))
            t_prev, c_prev = t, c
        if ctx:
            ctx.__exit__(None, None, None)
            periods = [(json.loads(line).get("memory") or {}).get("full_every") for line in
                       Path(run_dir, f"rank{rank}.records.jsonl").read_text().splitlines() if '"wall_ms"' in line]
            kind["full_every"].append(next((x for x in reversed(periods) if x), None))
            if a.keep:
                keep = Path(a.keep) / f"block{b:02d}_{arm}"
                for f in Path(run_dir).glob("*"):
                    if f.is_file():
                        keep.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(f, keep / f.name)
        sync()
        kind["wall"].append(ts)
        kind["host"].append(hs)
        kind["cpu"].append(cs)
        kind["device"].append([e0.elapsed_time(e1) for e0, e1 in evs])
        if rank == 0:
            print(f"block {b + 1}/{a.blocks} {'doctor off' if arm == 'off' else arm:>10}: median step "
                  f"{statistics.median(ts):.2f} ms", flush=True)
    Path(f"{tmp}/times.rank{rank}.json").write_text(json.dumps(out))
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
    ap.add_argument("--compile", default=None, metavar="BACKEND",
                    help="torch.compile each block in place after sharding (inductor, aot_eager, ...)")
    ap.add_argument("--json", default=None, help="also write the figures here (JSON)")
    ap.add_argument("--per-step", action="store_true", help="print rank 0's median time at each step of a block")
    ap.add_argument("--watch", default="{}", help='extra watch() arguments as JSON, e.g. \'{"memory": false}\'')
    ap.add_argument("--arms", default=None,
                    help='several doctor-on kinds of block, JSON {name: watch() arguments}, e.g. \'{"on": {}, '
                         '"no_memory": {"memory": false}}\': blocks alternate off and each in turn (--watch ignored)')
    ap.add_argument("--keep", default=None, help="copy each doctor-on block's records (not its profiler traces) here")
    a = ap.parse_args()
    import torch.multiprocessing as mp

    from fsdp_doctor.workloads import free_port

    ex = excluded(a.block_steps, a.skip)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        mp.start_processes(rank_main, args=(a.nproc, free_port(), a, tmp), nprocs=a.nproc, start_method="spawn")
        ranks = [json.loads(Path(f"{tmp}/times.rank{r}.json").read_text()) for r in range(a.nproc)]
    kept = lambda xs: [x for s, x in enumerate(xs) if s not in ex]  # noqa: E731
    # every rank's kept steps, per arm and measure; rank 0's block medians of the wall for the pair ratios
    pooled = {arm: {m: [x for r in ranks for blk in r[arm][m] for x in kept(blk)] for m in ("wall", "host", "cpu", "device")}
              for arm in ranks[0]}
    block_med = {arm: [statistics.median(kept(blk)) for blk in ranks[0][arm]["wall"]] for arm in ranks[0]}
    if a.per_step:
        print("step        " + "  ".join(f"{s:>5}" for s in range(a.block_steps)))
        for arm, kind in ranks[0].items():
            for m in ("wall", "host", "device"):
                if kind[m] and kind[m][0]:
                    med = [statistics.median(blk[s] for blk in kind[m]) for s in range(a.block_steps)]
                    print(f"{arm[:6]:6} {m:6}" + "  ".join(f"{x:5.0f}" for x in med))
    arms = [arm for arm in ranks[0] if arm != "off"]
    print(f"\n{a.blocks} blocks x {a.block_steps} steps, {a.nproc} ranks, {time.perf_counter() - t0:.0f} s; "
          f"{len(ex)} steps per block excluded (warm-up, profiler window)")
    has_dev = bool(pooled["off"]["device"])
    print(f"{'':14}{'median step':>14}{'host part':>12}" + (f"{'device':>12}" if has_dev else "") + f"{'rank-steps':>12}")
    for arm in ["off", *arms]:
        p = pooled[arm]
        print(f"{'doctor off' if arm == 'off' else arm:14}{statistics.median(p['wall']):>11.2f} ms"
              f"{statistics.median(p['host']):>9.2f} ms" + (f"{statistics.median(p['device']):>9.2f} ms" if has_dev else "")
              + f"{len(p['wall']):>12}")
    m_off = statistics.median(pooled["off"]["wall"])
    c_off = statistics.mean(pooled["off"]["cpu"])
    figures = {}
    for arm in arms:
        m_on = statistics.median(pooled[arm]["wall"])
        pair = [on / off for on, off in zip(block_med[arm], block_med["off"][arms.index(arm)::len(arms)])]
        c_on = statistics.mean(pooled[arm]["cpu"])
        print(f"{arm}: per block pair (on/off, rank 0): min {min(pair):.3f}  median {statistics.median(pair):.3f}  "
              f"max {max(pair):.3f}; process CPU per step (all threads) off {c_off:.2f} ms, on {c_on:.2f} ms, "
              f"ratio {c_on / c_off:.4f}")
        label = "doctor-on" if arm == "on" else f"doctor ({arm})"
        print(f"overhead: {label} / doctor-off median step time = {m_on / m_off:.4f}  ({100 * (m_on / m_off - 1):+.2f}%)")
        watch_args = arms_of(a)[arm]
        amortised = amortised_ms(ranks[0][arm], ranks[0]["off"], a.skip, m_off,
                                 profiled=watch_args.get("profile", True) not in (False, None))
        if amortised["window_every"] or amortised["full_every"]:
            print(f"{arm}: amortised, besides the steady steps: {amortised['window_ms']:.0f} ms per profiler window "
                  f"(its steps and export over the off median) every {amortised['window_every']} steps, "
                  f"{amortised['full_ms']:.0f} ms per full memory step every {amortised['full_every']} steps: "
                  f"{amortised['per_step_ms']:.2f} ms a step; overhead with them "
                  f"{(m_on + amortised['per_step_ms']) / m_off:.4f}")
        figures[arm] = {"median_step_ms": m_on, "ratio": m_on / m_off, "amortised": amortised,
                        "ratio_amortised": (m_on + amortised["per_step_ms"]) / m_off,
                        "pair_ratio": {"min": min(pair), "median": statistics.median(pair), "max": max(pair)},
                        "cpu_ms_per_step": c_on, "host_ms": statistics.median(pooled[arm]["host"]),
                        "device_ms": statistics.median(pooled[arm]["device"]) if has_dev else None}
    if a.json:
        from fsdp_doctor.workloads import total_param_count

        cfg = workload(a)
        first = figures[arms[0]]
        Path(a.json).write_text(json.dumps({
            "device": a.device, "nproc": a.nproc, "workload": {k: v for k, v in vars(a).items() if k != "json"},
            "params": total_param_count(cfg), "median_step_ms": {"off": m_off, "on": first["median_step_ms"]},
            "ratio": first["ratio"], "pair_ratio": first["pair_ratio"],
            "cpu_ms_per_step": {"off": c_off, "on": first["cpu_ms_per_step"]}, "excluded_steps_per_block": len(ex),
            "off": {"host_ms": statistics.median(pooled["off"]["host"]),
                    "device_ms": statistics.median(pooled["off"]["device"]) if has_dev else None},
            "arms": figures, "steps_rank0": ranks[0],
        }, indent=1))

if __name__ == "__main__":
    main()
