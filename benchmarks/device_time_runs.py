"""Records the two runs under ``traces/gpu_device_time/`` (GPU machine), which tests/test_device_time.py reads on
the CPU: the GPU tier's small GPT (tests/test_gpu.py ``SMALL``) on 2 NCCL ranks sharing one GPU, 12 steps, no
profiler window, a ``loss.item()`` after every step (the common logging loop: one host sync per step), and

* ``sync_per_step``: no loader beyond the workload's synthetic batches;
* ``slow_loader``: the same with a loader that sleeps 150 ms before each batch.

On CUDA the host's time outside the model holds its waits for the device; the recorder's CUDA events time the
device's own (``GpuTimes.before_forward_ms`` / ``after_model_ms``), which ``jitter.data_wait`` reads. Prints, per
run, the rule's status and the device's figures.

    python3 benchmarks/device_time_runs.py --out traces/gpu_device_time     (GPU machine, ~40 s)

The committed runs were recorded on an H100 (torch 2.11+cu130) by this script's first form (its manifest's
``command``), with the same workload, loop and knobs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

RUNS = {"sync_per_step": {}, "slow_loader": {"loader_ms": 150.0}}
STEPS = 12
FILES = ("manifest.json", "rank0.records.jsonl", "rank1.records.jsonl")


def record(name: str, dest: Path) -> None:
    from test_gpu import SMALL, ItemEveryStep

    from fsdp_doctor.workloads import WorkloadConfig, launch

    cfg = WorkloadConfig(**{**SMALL, "steps": STEPS, **RUNS[name]})
    with tempfile.TemporaryDirectory(prefix="fsdp_doctor_devtime_") as tmp:
        run_dir = Path(tmp) / name
        launch(cfg, nproc=2, on_step=ItemEveryStep(), timeout_s=300,
               watch_kwargs={"out_dir": str(run_dir), "tokens_per_step": cfg.tokens_per_step(2), "profile": False})
        dest.mkdir(parents=True, exist_ok=True)
        for f in FILES:
            shutil.copy(run_dir / f, dest / f)


def describe(path: Path) -> str:
    import fsdp_doctor

    report = fsdp_doctor.build_report(fsdp_doctor.load_run(path))
    status = next(s for s in report.rules if s.code == "jitter.data_wait")
    found = next((f for f in report.findings if f.code == "jitter.data_wait"), None)
    dev = {r: (st.device.outside_ms, st.device.period_ms) for r, st in report.steps.per_rank.items() if st.device}
    return (f"{path.name}: jitter.data_wait {status.status}: {found.title if found else status.reason}; device time "
            "outside the model / period per rank (ms): "
            + ", ".join(f"rank {r} {o} / {p}" for r, (o, p) in sorted(dev.items())))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "traces" / "gpu_device_time")
    a = ap.parse_args()
    for name in RUNS:
        record(name, a.out / name)
        print(describe(a.out / name), flush=True)


if __name__ == "__main__":
    main()
