"""What recording memory and shapes costs in the doctor's profiler windows (reference workload, 2 ranks).

Alternates runs with the profiler windows recording neither (``record_shapes=False, profile_memory=False``)
and both (the default since TensorBoard's Memory view and message sizes need them), each run with a window
of 2 recorded steps every 8 steps. Per kind: the median step time of the recorded steps against the median
of the plain steps of the same run (the window's cost, as a ratio, so that this shared VM's drift between
runs cancels), the step that carries the trace export, and the trace size per window.

    .venv/bin/python benchmarks/profile_window_cost.py [--pairs 3] [--steps 44]   (about a minute)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

KINDS = {"off": {"record_shapes": False, "profile_memory": False},
         "on": {"record_shapes": True, "profile_memory": True}}


def one_run(kind: str, steps: int, out: Path) -> dict:
    from fsdp_doctor import ProfileSchedule, load_run
    from fsdp_doctor.workloads import WorkloadConfig, launch

    cfg = WorkloadConfig(steps=steps, async_unshard=True)
    sched = ProfileSchedule(first=4, active=2, warmup=1, every=8)
    launch(cfg, nproc=2, watch_kwargs={"out_dir": str(out), "profile": {"schedule": sched, **KINDS[kind]}})
    run = load_run(out)
    recorded, export, plain = [], [], []
    for rank in run.ranks.values():
        windows = [w.steps for w in rank.profiles]
        rec = {s for w in windows for s in w}
        exp = {w[-1] + 1 for w in windows}
        warm = {w[0] - 1 for w in windows}
        for s in rank.steps:
            if s.step < 3:
                continue
            if s.step in rec:
                recorded.append(s.wall_ms)
            elif s.step in exp:
                export.append(s.wall_ms)
            elif s.step not in warm:
                plain.append(s.wall_ms)
    files = list((out / "profiler").glob("*.pt.trace.json*"))
    base = statistics.median(plain)
    return {"window_ratio": statistics.median(recorded) / base, "export_ms": statistics.median(export) - base,
            "plain_ms": base, "trace_kib": sum(f.stat().st_size for f in files) / len(files) / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=44)
    a = ap.parse_args()
    got: dict[str, list[dict]] = {k: [] for k in KINDS}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.pairs):
            for kind in KINDS:
                r = one_run(kind, a.steps, Path(tmp) / f"{kind}{i}")
                got[kind].append(r)
                print(f"pair {i} {kind:3}: plain step {r['plain_ms']:.1f} ms, window steps x{r['window_ratio']:.3f}, "
                      f"export +{r['export_ms']:.1f} ms, trace {r['trace_kib']:.0f} KiB/window", flush=True)
    med = {k: {f: statistics.median(r[f] for r in v) for f in v[0]} for k, v in got.items()}
    for k, m in med.items():
        print(f"{k:3} (median of {a.pairs}): window steps x{m['window_ratio']:.3f} of a plain step, export "
              f"+{m['export_ms']:.1f} ms, trace {m['trace_kib']:.0f} KiB per window (gzip)")
    print(f"recording memory and shapes: window step time x{med['on']['window_ratio'] / med['off']['window_ratio']:.3f}, "
          f"export {med['on']['export_ms'] - med['off']['export_ms']:+.1f} ms, "
          f"trace x{med['on']['trace_kib'] / med['off']['trace_kib']:.2f}")


if __name__ == "__main__":
    main()
