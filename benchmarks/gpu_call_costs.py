"""What the doctor's per-mark and per-step CUDA calls cost on this GPU, in microseconds a call (median of
``--reps`` rounds of ``--n`` calls, after a warm-up), with a 1B-parameter-like allocator state (a few hundred live
tensors): the public ``torch.cuda.memory_allocated()`` (``memory_stats()`` flattened), the nested statistics the
memory probe reads instead, ``mem_get_info``, NVML's process list, and a timing event's ``record()``.

    python benchmarks/gpu_call_costs.py [--json FILE]     (a CUDA machine; the GPU campaign's probe_costs step)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def per_call_us(fn, n: int, reps: int) -> float:
    for _ in range(n):
        fn()
    rounds = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter_ns() - t0) / n / 1e3)
    return statistics.median(rounds)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    import torch

    from fsdp_doctor.record.memory.device import DeviceStats, allocated_reader, allocator_limit

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 1
    dev = torch.device("cuda", 0)
    keep = [torch.empty(1 << k % 22, device=dev) for k in range(400)]  # a populated allocator
    ev = torch.cuda.Event(enable_timing=True)
    ds = DeviceStats(dev, 0, True)
    costs = {
        "torch.cuda.memory_allocated": lambda: torch.cuda.memory_allocated(dev),
        "allocated_reader (the probe's mark)": allocated_reader(dev),
        "torch.cuda.memory_stats": lambda: torch.cuda.memory_stats(dev),
        "torch.cuda.mem_get_info": lambda: torch.cuda.mem_get_info(dev),
        "NVML process list": lambda: ds._nvml_process_bytes(),
        "allocator_limit (a memory fraction, per step)": lambda: allocator_limit(dev),
        "DeviceStats.stats (per step, cached device figures)": lambda: ds.stats(1),
        "cuda.Event.record": ev.record,
    }
    out = {name: round(per_call_us(fn, a.n, a.reps), 2) for name, fn in costs.items()}
    del keep
    w = max(map(len, out))
    for name, us in out.items():
        print(f"{name:{w}}  {us:9.2f} us/call")
    if a.json:
        a.json.write_text(json.dumps({"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                                      "us_per_call": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
