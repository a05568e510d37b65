"""Doctor-on vs doctor-off step time on the reference workload, interleaved in one run.

Each round trains the same 2-rank FSDP2 workload twice — once plain, once inside ``fsdp_doctor.watch``
with default settings — alternating which goes first. Step times come from the same clock in both
(a timestamp taken by the training loop's ``on_step`` callback after each step), so the doctor's own
bookkeeping inside ``doctor.step()`` is counted against it. Steps inside profiler windows (and the one
carrying the trace export) are excluded from both, as are the first 3 warm-up steps.

    .venv/bin/python benchmarks/overhead.py [--rounds 4] [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fsdp_doctor.record.profiling import ProfileSchedule  # noqa: E402
from fsdp_doctor.workloads import WorkloadConfig, launch  # noqa: E402

WARMUP = 3


class StepClock:
    """on_step callback: records a timestamp after every step and writes them at the last one."""

    def __init__(self, path: str, steps: int):
        self.path, self.steps, self.t = path, steps, []

    def __call__(self, step, model, optimizer, loss):
        self.t.append(time.perf_counter())
        if step == self.steps - 1:
            import torch.distributed as dist

            Path(f"{self.path}.rank{dist.get_rank()}").write_text(json.dumps(self.t))


def excluded_steps(steps: int) -> set[int]:
    sched = ProfileSchedule()
    ex: set[int] = set()
    for s in range(steps):
        if sched(s).name != "NONE":
            ex.update({s, s + 1})  # the window, and the step that carries the export
    return ex | set(range(WARMUP))


def one_run(cfg: WorkloadConfig, with_doctor: bool, tmp: Path, tag: str) -> list[float]:
    clock = StepClock(str(tmp / tag), cfg.steps)
    watch = {"out_dir": str(tmp / f"{tag}-run")} if with_doctor else None
    launch(cfg, nproc=2, watch_kwargs=watch, on_step=clock)
    ex = excluded_steps(cfg.steps)
    out = []
    for r in range(2):
        t = json.loads(Path(f"{clock.path}.rank{r}").read_text())
        out += [1e3 * (t[i] - t[i - 1]) for i in range(1, len(t)) if i not in ex]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--n-layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    a = ap.parse_args()
    cfg = WorkloadConfig(steps=a.steps, n_layers=a.n_layers, d_model=a.d_model, async_unshard=True)
    on, off = [], []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for k in range(a.rounds):
            order = [(False, off), (True, on)] if k % 2 == 0 else [(True, on), (False, off)]
            for with_doctor, bucket in order:
                t0 = time.perf_counter()
                times = one_run(cfg, with_doctor, tmp, f"r{k}-{'on' if with_doctor else 'off'}")
                bucket += times
                print(f"round {k + 1}/{a.rounds} doctor {'on ' if with_doctor else 'off'}: median step "
                      f"{statistics.median(times):.2f} ms over {len(times)} rank-steps ({time.perf_counter() - t0:.0f} s)",
                      flush=True)
    m_on, m_off = statistics.median(on), statistics.median(off)
    print()
    print(f"{'':14}{'median step':>14}{'p90 step':>12}{'rank-steps':>12}")
    for name, xs in (("doctor off", off), ("doctor on", on)):
        xs_sorted = sorted(xs)
        print(f"{name:14}{statistics.median(xs):>11.2f} ms{xs_sorted[int(0.9 * (len(xs) - 1))]:>9.2f} ms{len(xs):>12}")
    print(f"\noverhead: doctor-on / doctor-off median step time = {m_on / m_off:.4f}  ({100 * (m_on / m_off - 1):+.2f}%)")


if __name__ == "__main__":
    main()
