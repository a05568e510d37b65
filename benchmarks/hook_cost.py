"""Time spent inside the doctor's own hooks per training step (one gloo rank, in process).

Wraps each of the Doctor's hook methods with a timer, trains the reference workload for 60 steps and
reports, over steps 20-59, the microseconds per step spent in each hook body and in ``doctor.step()``
(the hooks' dispatch by PyTorch is not included; the timers themselves add a little). This is the
stable, noise-free part of the overhead; ``overhead.py`` measures the whole effect on step time.

    .venv/bin/python benchmarks/hook_cost.py [--default]   (default: timing hooks only; --default: watch() defaults)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
import tempfile

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

HOOKS = ["_model_pre", "_model_post", "_fwd_outer_pre", "_fwd_inner_pre", "_fwd_inner_post", "_fwd_outer_post",
         "_on_unit_grad", "_on_fsdp_log", "_on_backward_end", "_end_step"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--default", action="store_true", help="watch() with default settings (memory, TensorBoard, profiler)")
    a = ap.parse_args()
    import torch
    import torch.distributed as dist

    import fsdp_doctor
    from fsdp_doctor.record import hooks, tracker
    from fsdp_doctor.workloads import WorkloadConfig, free_port
    from fsdp_doctor.workloads.data import batches
    from fsdp_doctor.workloads.train import build_training, next_token_loss

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    acc: dict[str, int] = {}

    def timed(name, fn):
        def wrapper(*args, **kw):
            t = time.perf_counter_ns()
            try:
                return fn(*args, **kw)
            finally:
                acc[name] = acc.get(name, 0) + time.perf_counter_ns() - t
        return wrapper

    for n in HOOKS:  # the hook bodies live on the Doctor's StepTimer (record/hooks.py); _end_step on the Doctor
        cls = hooks.StepTimer if hasattr(hooks.StepTimer, n) else tracker.Doctor
        setattr(cls, n, timed(n, getattr(cls, n)))
    cfg = WorkloadConfig(steps=60, async_unshard=True)
    model, opt = build_training(cfg)
    kw = {} if a.default else dict(memory=False, tensorboard=False, profile=False)
    data = batches(cfg, 0)
    with tempfile.TemporaryDirectory() as tmp, fsdp_doctor.watch(model, opt, out_dir=tmp, **kw) as doctor:
        for i in range(cfg.steps):
            if i == 20:
                acc.clear()
                t0 = time.perf_counter()
            tok, tgt = next(data)
            loss = next_token_loss(model(tok), tgt)
            loss.backward()
            opt.step()
            opt.zero_grad()
            doctor.step()
        n = cfg.steps - 20
        step_ms = (time.perf_counter() - t0) / n * 1e3
    total = sum(acc.values())  # the hooks never call each other, so nothing is counted twice
    print(f"{'settings':22}{'defaults' if a.default else 'timing hooks only'}")
    print(f"{'step (mean)':22}{step_ms:.2f} ms")
    for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
        print(f"{k:22}{v / n / 1e3:8.1f} µs/step")
    print(f"{'total in hooks':22}{total / n / 1e3:8.1f} µs/step = {100 * total / n / 1e6 / step_ms:.2f}% of the step")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
