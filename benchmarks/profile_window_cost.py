"""What recording memory and shapes costs in the doctor's profiler windows (reference workload, 2 ranks).

Alternates runs with the profiler windows recording neither (``record_shapes=False, profile_memory=False``),
memory only (the default: TensorBoard's Memory view; the message sizes come from NCCL's args or the unit snapshot)
and both ("shapes", the default until a model of many small operators ran its profiled steps 17x its plain ones with
them), each run with a window of 2 recorded steps every 10 steps. Per kind: the median step time of the recorded
steps against the median of the plain steps of the same run (the window's cost, as a ratio, so that this shared VM's
drift between runs cancels), the step that carries the trace export, and the trace size per window.

A third kind, "on, no collect", is the default window without the collection the doctor runs once a window
is saved (``ProfilerWindows.collect_after_window``): beside "on" it shows what that collection costs in the
export step and what it saves the user's steps after the window (their GC pauses, ms per window, in the
6 steps that follow the export step).

    .venv/bin/python benchmarks/profile_window_cost.py [--pairs 3] [--steps 44]   (about a minute)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

KINDS = {"off": {"record_shapes": False, "profile_memory": False},
         "on": {"record_shapes": False, "profile_memory": True},
         "on, no collect": {"record_shapes": False, "profile_memory": True},
         "shapes": {"record_shapes": True, "profile_memory": True}}
# steps after the export step whose GC pauses count as the window's aftermath
AFTER = 6
_NO_COLLECT = "FSDP_DOCTOR_BENCH_NO_WINDOW_COLLECT"
if os.environ.get(_NO_COLLECT) == "1":  # read again by every spawned rank, which re-imports this module
    from fsdp_doctor.record.profiling import ProfilerWindows

    ProfilerWindows.collect_after_window = False


def one_run(kind: str, steps: int, out: Path) -> dict:
    from fsdp_doctor import ProfileSchedule, load_run
    from fsdp_doctor.workloads import WorkloadConfig, launch

    cfg = WorkloadConfig(steps=steps, async_unshard=True)
    sched = ProfileSchedule(first=4, active=2, warmup=1, every=10)
    os.environ[_NO_COLLECT] = "1" if kind == "on, no collect" else "0"
    launch(cfg, nproc=2, watch_kwargs={"out_dir": str(out), "profile": {"schedule": sched, **KINDS[kind]}})
    run = load_run(out)
    recorded, export, plain, after_gc = [], [], [], []
    for rank in run.ranks.values():
        windows = [w.steps for w in rank.profiles]
        rec = {s for w in windows for s in w}
        exp = {w[-1] + 1 for w in windows}
        warm = {w[0] - 1 for w in windows}
        by_step = {s.step: s for s in rank.steps}
        for e in exp:
            after = [by_step[e + k] for k in range(1, AFTER + 1) if e + k in by_step]
            if len(after) == AFTER:
                after_gc.append(sum(s.gc_ms for s in after))
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
            "plain_ms": base, "trace_kib": sum(f.stat().st_size for f in files) / len(files) / 1024,
            "after_gc_ms": statistics.mean(after_gc) if after_gc else 0.0,
            "after_gc_max_ms": max(after_gc) if after_gc else 0.0}


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
                print(f"pair {i} {kind}: plain step {r['plain_ms']:.1f} ms, window steps x{r['window_ratio']:.3f}, "
                      f"export +{r['export_ms']:.1f} ms, GC in the {AFTER} steps after {r['after_gc_ms']:.2f} ms/window "
                      f"(max {r['after_gc_max_ms']:.2f}), trace {r['trace_kib']:.0f} KiB/window", flush=True)
    med = {k: {f: statistics.median(r[f] for r in v) for f in v[0]} for k, v in got.items()}
    for k, m in med.items():
        print(f"{k} (median of {a.pairs}): window steps x{m['window_ratio']:.3f} of a plain step, export "
              f"+{m['export_ms']:.1f} ms, GC pauses in the {AFTER} steps after the export {m['after_gc_ms']:.2f} ms "
              f"per window, trace {m['trace_kib']:.0f} KiB per window (gzip)")
    for k, what in (("on", "memory (the default)"), ("shapes", "memory and shapes")):
        print(f"recording {what}: window step time x{med[k]['window_ratio'] / med['off']['window_ratio']:.3f}, "
              f"export {med[k]['export_ms'] - med['off']['export_ms']:+.1f} ms, "
              f"trace x{med[k]['trace_kib'] / med['off']['trace_kib']:.2f}")
    on, nc = med["on"], med["on, no collect"]
    print(f"collecting the window's garbage in the export step: export {on['export_ms'] - nc['export_ms']:+.1f} ms, "
          f"GC pauses in the user's {AFTER} steps after it {nc['after_gc_ms']:.2f} -> {on['after_gc_ms']:.2f} ms per window")


if __name__ == "__main__":
    main()
