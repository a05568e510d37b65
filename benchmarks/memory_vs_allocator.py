"""Does the doctor's per-step memory peak reconcile with the CUDA caching allocator?

Runs the reference workload with ``fsdp_doctor.watch`` attached and, beside it, reads the allocator itself: at
the end of every step (after ``doctor.step()``) ``torch.cuda.max_memory_allocated()`` is read and the peak is
reset, so each step's allocator peak covers exactly the stretch the doctor's step record covers. Both are read
on the host with no synchronisation (the allocator books a tensor when its kernel is queued, not when it runs).
Prints, per rank, the doctor's peak against the allocator's for every steady step, the ratio, and the doctor's
breakdown at its peak (which must add up), and writes the rows as JSON with ``--json``.

    python benchmarks/memory_vs_allocator.py --device cuda [--nproc 2] [--json out.json]   (GPU machine)
    .venv/bin/python benchmarks/memory_vs_allocator.py --device cpu --steps 4             (plumbing only)

Goal (issue #22): each step's peak within 1% of ``max_memory_allocated()`` for that step. On the CPU there is
no caching allocator: the allocator column is empty and only the breakdown's sum is checked.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("OMP_NUM_THREADS", "1")

MiB = 1 << 20


class AllocatorPeaks:
    """on_step callback (picklable, module level): the allocator's peak of every step, reset after reading."""

    def __init__(self, out: str, steps: int) -> None:
        self.out, self.steps, self.peaks = out, steps, []

    def __call__(self, step, model, optimizer, loss) -> None:
        import torch
        import torch.distributed as dist

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.peaks.append(torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
        else:
            self.peaks.append(None)
        if step == self.steps - 1:
            Path(self.out, f"allocator.rank{dist.get_rank()}.json").write_text(json.dumps(self.peaks))


def compare(run_dir: Path, peaks_dir: Path, skip: int) -> list[dict]:
    """One row per rank and steady step: the doctor's peak, the allocator's, and the breakdown's sum."""
    from fsdp_doctor import load_run

    run = load_run(run_dir)
    rows = []
    for rank, rd in sorted(run.ranks.items()):
        alloc = json.loads((peaks_dir / f"allocator.rank{rank}.json").read_text())
        for s in rd.steps:
            if s.step < skip or s.memory is None or s.memory.peak is None or s.step >= len(alloc):
                continue
            peak = s.memory.peak
            a = alloc[s.step]
            rows.append(dict(rank=rank, step=s.step, doctor=peak.bytes, allocator=a,
                             ratio=(peak.bytes / a) if a else None, breakdown_sum=sum(peak.breakdown.values()),
                             phase=peak.phase, unit=peak.unit, sampling=s.memory.sampling,
                             breakdown=dict(peak.breakdown)))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--skip", type=int, default=2, help="warm-up steps left out (step 0 also holds the model's creation)")
    ap.add_argument("--n-layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--n-heads", type=int, default=16)
    ap.add_argument("--n-kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--param-dtype", default="bf16")
    ap.add_argument("--cpu-offload", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep", default=None, help="keep the run directory here")
    a = ap.parse_args()

    from fsdp_doctor.workloads import WorkloadConfig, launch

    cfg = WorkloadConfig(n_layers=a.n_layers, d_model=a.d_model, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads,
                         vocab=a.vocab, seq_len=a.seq_len, batch_size=a.batch_size, param_dtype=a.param_dtype,
                         cpu_offload=a.cpu_offload, device=a.device, steps=a.steps,
                         async_unshard=a.device == "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(a.keep) if a.keep else Path(tmp, "run")
        launch(cfg, nproc=a.nproc, on_step=AllocatorPeaks(tmp, a.steps),
               watch_kwargs={"out_dir": str(run_dir), "profile": False, "overwrite": True})
        rows = compare(run_dir, Path(tmp), a.skip)
    print(f"{cfg.n_layers}x{cfg.d_model} GPT, {a.nproc} rank(s) on {a.device}, steps {a.skip}..{a.steps - 1}")
    print(f"{'rank':>4} {'step':>4} {'doctor':>11} {'allocator':>11} {'ratio':>7}  peak at")
    for r in rows:
        alloc = f"{r['allocator'] / MiB:8.1f} MiB" if r["allocator"] else "       —   "
        ratio = f"{r['ratio']:.4f}" if r["ratio"] else "   —  "
        print(f"{r['rank']:>4} {r['step']:>4} {r['doctor'] / MiB:8.1f} MiB {alloc} {ratio:>7}  "
              f"{r['phase']} of {r['unit'] if r['unit'] is not None else 'outside every unit'} ({r['sampling']})")
    ratios = [r["ratio"] for r in rows if r["ratio"]]
    sums_ok = all(r["breakdown_sum"] == r["doctor"] for r in rows)
    summary = dict(device=a.device, nproc=a.nproc, steps=len(rows), breakdown_adds_up=sums_ok,
                   ratio=dict(min=min(ratios), median=statistics.median(ratios), max=max(ratios)) if ratios else None,
                   within_1pct=bool(ratios) and all(abs(x - 1) <= 0.01 for x in ratios))
    print(f"breakdown adds up to the peak on every step: {sums_ok}")
    if ratios:
        print(f"doctor / allocator peak: min {min(ratios):.4f}  median {statistics.median(ratios):.4f}  "
              f"max {max(ratios):.4f}  (goal: within 1%: {summary['within_1pct']})")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(summary=summary, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
