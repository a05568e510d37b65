"""What shortens a launch-bound FSDP2 step, measured side by side: kernels.launch_bound's levers on its GPU row.

The row (``gpu_gpt_tiny_launch_bound``: the reference GPT with 4 blocks of width 64, 2 x 32 tokens, one rank) is
bound by its host: the device idles ~80% of the step waiting for launches. Its fix, each block compiled, measured
no faster on the H100 and the H200 (18.9 -> 31.3 ms on the H200's records). This runs each candidate lever in a
process of its own, one rank, no doctor (unless the arm says so), and prints each arm's median step (CUDA events
around each step, read after the run: no sync inside it), its tokens per second, and its ratio to the eager
baseline, in one table:

  eager             the row as recorded
  compile_blocks    each block compiled in place after fully_shard (the fix printed until now)
  whole             one FSDP unit for the whole model (fewer units: fewer hooks, copies and collectives)
  compile_whole     one unit, the model compiled in place
  batch_x4          the row at 4 times the batch (the same launches per step, 4 times the work)
  eager_profiled, compile_profiled   a torch.profiler window (steps 12-14) in the middle of the run: the
                    steps before it against those after it (is a compiled model slower after a profiler window?)
  eager_doctor, compile_doctor       under fsdp_doctor.watch() with its default settings (a profiler window
                    in the first steps): the steps after its window against the arms without it

    python benchmarks/launch_levers.py --device cuda --json /tmp/levers.json        (the GPU machine, ~2 min)
    .venv/bin/python benchmarks/launch_levers.py --device cpu --steps 12 --arms eager,whole   (the plumbing, gloo)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ARMS = ("eager", "compile_blocks", "whole", "compile_whole", "batch_x4", "eager_profiled", "compile_profiled",
        "eager_doctor", "compile_doctor")
TINY = dict(n_layers=4, d_model=64, seq_len=32, batch_size=2)  # tests/scenario_matrix.py's TINY_GPU
WINDOW = (12, 15)  # the profiled arms' window: steps 12, 13 and 14


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def run_arm(arm: str, device: str, steps: int) -> dict:
    """One arm in this process: one rank, ``steps`` steps; per-step device times (ms) and host times (ms)."""
    import torch
    import torch.distributed as dist

    from fsdp_doctor.workloads import WorkloadConfig
    from fsdp_doctor.workloads.data import batches
    from fsdp_doctor.workloads.train import backend_for, build_training, next_token_loss, setup_rank

    knobs = dict(TINY, steps=steps, device=device, async_unshard=device == "cpu")
    if arm.startswith(("whole", "compile_whole")):
        knobs["wrap"] = "whole"
    if arm == "batch_x4":
        knobs["batch_size"] = 4 * TINY["batch_size"]
    cfg = WorkloadConfig(**knobs)
    setup_rank(cfg, 0)
    dist.init_process_group(backend_for(device), rank=0, world_size=1)
    torch.manual_seed(0)
    model, optimizer = build_training(cfg)
    if arm in ("compile_blocks", "compile_profiled", "compile_doctor"):
        for block in model.layers.children():
            block.compile()
    elif arm == "compile_whole":
        model.compile()
    data = batches(cfg, 0)
    cuda = device == "cuda"
    events, host_ms = [], []
    doctor_cm = None
    if arm.endswith("_doctor"):
        import fsdp_doctor

        doctor_cm = fsdp_doctor.watch(model, optimizer, out_dir=tempfile.mkdtemp(prefix="levers-"))
        doctor = doctor_cm.__enter__()
    prof = None
    for step in range(steps):
        if arm.endswith("_profiled") and step == WINDOW[0]:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                          + ([torch.profiler.ProfilerActivity.CUDA] if cuda else []))
            prof.__enter__()
        t0 = time.perf_counter()
        ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
        if ev:
            ev[0].record()
        tokens, targets = next(data)
        tokens, targets = tokens.to(device), targets.to(device)
        next_token_loss(model(tokens), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
        if doctor_cm is not None:
            doctor.step()
        if ev:
            ev[1].record()
            events.append(ev)
        host_ms.append(1e3 * (time.perf_counter() - t0))
        if prof is not None and step == WINDOW[1] - 1:
            prof.__exit__(None, None, None)
            prof = None
    if doctor_cm is not None:
        doctor_cm.__exit__(None, None, None)
    if cuda:
        torch.cuda.synchronize()
    dev_ms = [a.elapsed_time(b) for a, b in events] if cuda else host_ms
    dist.destroy_process_group()
    return dict(arm=arm, step_ms=dev_ms, host_ms=host_ms, tokens_per_step=cfg.batch_size * cfg.seq_len)


def summarise(r: dict, steps: int) -> dict:
    """Medians over the steady steps: after the first 5 (compilation, warm-up); the profiled and doctor arms apart
    before and after their window (steps 5-11, and from 20: the doctor's default window ends by step 5, its
    export a step later)."""
    ms = r["step_ms"]
    out = dict(arm=r["arm"], tokens_per_step=r["tokens_per_step"])
    if r["arm"].endswith("_profiled"):
        out["before_ms"] = statistics.median(ms[5:WINDOW[0]])
        out["after_ms"] = statistics.median(ms[WINDOW[1] + 5:])
        out["step_ms"] = out["after_ms"]
    elif r["arm"].endswith("_doctor"):
        out["step_ms"] = statistics.median(ms[20:])
    else:
        out["step_ms"] = statistics.median(ms[5:])
    out["host_ms"] = statistics.median(r["host_ms"][20:] if r["arm"].endswith(("_doctor", "_profiled"))
                                       else r["host_ms"][5:])
    out["tokens_per_s"] = r["tokens_per_step"] / out["step_ms"] * 1e3
    out["steps_ms"] = [round(x, 3) for x in ms]  # every step, for a second look
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--arm", help=argparse.SUPPRESS)  # one arm, in a child process
    a = ap.parse_args()
    if a.arm:
        print("RESULT " + json.dumps(run_arm(a.arm, a.device, a.steps)), flush=True)
        return 0
    rows, failed = [], {}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1", "KINETO_LOG_LEVEL": "6"}
    for arm in a.arms.split(","):
        t0 = time.time()
        env["MASTER_PORT"] = str(_free_port())
        done = subprocess.run([sys.executable, __file__, "--arm", arm, "--device", a.device, "--steps", str(a.steps)],
                              env=env, capture_output=True, text=True, timeout=300)
        line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
        if done.returncode or line is None:
            failed[arm] = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            print(f"{arm}: failed ({failed[arm][0][:200]})", flush=True)
            continue
        rows.append(summarise(json.loads(line[7:]), a.steps))
        print(f"{arm}: {rows[-1]['step_ms']:.2f} ms a step ({time.time() - t0:.0f} s)", flush=True)
    base = next((r for r in rows if r["arm"] == "eager"), None)
    print(f"\n{'arm':18s} {'step ms':>9s} {'host ms':>9s} {'tokens/s':>10s} {'step/eager':>11s} {'tok/s/eager':>12s}")
    for r in rows:
        ratio = f"{r['step_ms'] / base['step_ms']:.3f}" if base else "-"
        tput = f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}" if base else "-"
        extra = f"  (before its window {r['before_ms']:.2f} ms)" if "before_ms" in r else ""
        print(f"{r['arm']:18s} {r['step_ms']:9.2f} {r['host_ms']:9.2f} {r['tokens_per_s']:10.0f} {ratio:>11s} "
              f"{tput:>12s}{extra}")
    if a.json:
        a.json.write_text(json.dumps(dict(rows=rows, failed=failed), indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
