"""A model compiled whole after sharding (``model = torch.compile(model)`` after ``fully_shard``), trained on one rank
under watch(), and what its device timeline must show (tests/test_gpu_timing.py on CUDA, tests/test_compile_steps.py on
the CPU).

Every unit but the root runs inside the model's compiled frame, where the doctor puts none of its hooks; each one's
forward is timed from FSDP2's own pre- and post-forward logs (``StepTimer._logged_forward``), which on CUDA open and
close a span of CUDA events on the rank's ``GpuTimeline`` (``record/gpu_timing.py``), the root's around its compiled
call. On the CPU ``torch.cuda.Event`` is stood in for by the host's clock (``HostEvent``) and the timeline attached
where ``Doctor.__enter__`` attaches it on CUDA, so everything but CUDA itself runs: the spans' opening and closing
from FSDP2's logs, the nested units' spans on every ``UNIT_EVERY``-th step, the ``GpuTimes`` records and their
reading back.

Run as a script: ``python tests/compiled_whole.py OUT_DIR cpu|cuda BACKEND STEPS`` (one rank: gloo, or NCCL on
``cuda:0``). Dynamo's backend is the test's: ``aot_eager`` on CUDA (what the doctor meets is Dynamo's frames, its
graph breaks at FSDP2's hooks and AOT autograd's runtime wrappers, as under inductor, without the tier paying for
Triton's compiles), ``eager`` on the CPU (no C++ toolchain needed).
"""

from __future__ import annotations

import os
import sys
import time

#: the model per device: on CUDA a step the device sets (tests/test_gpu.py's SMALL, 2 blocks); on the CPU seconds a run
SHAPE = {"cuda": dict(n_layers=2, d_model=512, n_heads=8, n_kv_heads=2, vocab=8192, seq_len=512, batch_size=4,
                      param_dtype="bf16"),
         "cpu": dict(n_layers=2, d_model=64)}
#: the units inside the compiled frame (the reference GPT's expert plan: embeddings, each block, [norm, head])
INNER = ["tok_emb, pos_emb", "layers.0", "layers.1", "norm, lm_head"]


class HostEvent:
    """torch.cuda.Event's surface that GpuTimeline uses, stamped by the host's clock: recorded, complete, timed."""

    def __init__(self, enable_timing: bool = True) -> None:
        self.ns = 0

    def record(self) -> None:
        self.ns = time.perf_counter_ns()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: "HostEvent") -> float:
        return (other.ns - self.ns) / 1e6


def host_timeline(doctor) -> None:
    """On the CPU: the device timeline a Doctor starts on CUDA, its events the host's clock, attached as
    ``Doctor.__enter__`` attaches it (to the doctor and its step timer) and its first step begun (``__enter__`` began
    the doctor's before this)."""
    import torch

    from fsdp_doctor.record.gpu_timing import GpuTimeline

    torch.cuda.Event = HostEvent
    units = doctor._units
    doctor._gpu = doctor._timer.gpu = GpuTimeline(doctor.rank, len(units), [u.name for u in units])
    doctor._gpu.begin_step()


def inner_units(run) -> list[str]:
    """The units the run timed from FSDP2's logs (inside the model's compiled frame)."""
    return [u.name for u in run.config.units if u.compiled_in_place and u.fsdp_hooks_timed]


def check_device_unit_times(run, host_clock: bool = False) -> list[int]:
    """What the device timeline of such a run must show, on each step whose units it timed (every UNIT_EVERY-th):
    each unit inside the frame a device forward and backward of its own; its forward within the root's; their
    forwards, one after the other, within the root's together, and the root's span the step's forward phase (the
    first forward span opened and the last closed); their backwards within the backward phase together. With
    ``host_clock`` (the CPU's stand-in events) the device spans are the host's own at the same logs: each unit's
    forward as the host timed it. Returns the steps checked."""
    from fsdp_doctor.record.gpu_timing import UNIT_EVERY

    inner = inner_units(run)
    assert inner == INNER, inner
    rd = run.ranks[0]
    assert sorted(rd.gpu) == list(range(len(rd.steps))), sorted(rd.gpu)  # every step resolved, the last at exit
    timed = [g for _, g in sorted(rd.gpu.items()) if g.units]
    assert [g.step for g in timed] == [s for s in sorted(rd.gpu) if s % UNIT_EVERY == 0], [g.step for g in timed]
    host = {s.step: {u.name: u for u in s.units} for s in rd.steps}
    for g in timed:
        by = {row[0]: (row[1], row[2]) for row in g.units}
        root_fwd = by[""][0]
        fwd = [by[n][0] for n in inner]
        bwd = [by[n][1] for n in inner]
        where = (g.step, by, g.forward_ms, g.backward_ms)
        assert all(f > 0 for f in fwd) and all(b > 0 for b in bwd), where
        assert all(f <= root_fwd for f in fwd), where
        # (each rounded to 0.001 ms)
        assert sum(fwd) <= root_fwd + 0.005 and abs(root_fwd - g.forward_ms) <= 0.002, where
        assert sum(bwd) <= g.backward_ms + 0.005, where
        # the host's records of the same step: each unit's forward once, from FSDP2's logs
        assert all(host[g.step][n].fwd_calls == 1 and host[g.step][n].fwd_ms > 0 for n in inner), host[g.step]
        if host_clock:  # the same spans on one clock: within the microseconds between the log and the event
            for n, f in zip(inner, fwd):
                h = host[g.step][n].fwd_ms
                assert abs(f - h) <= 0.1 * h + 1.0, (g.step, n, f, h)
    return [g.step for g in timed]


def main(out: str, device: str, backend: str, steps: int) -> None:
    import torch
    import torch.distributed as dist

    import fsdp_doctor
    from fsdp_doctor.workloads import WorkloadConfig, free_port
    from fsdp_doctor.workloads.data import batches
    from fsdp_doctor.workloads.train import build_training, next_token_loss

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if device == "cuda":
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1)
    else:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=0, world_size=1)
    cfg = WorkloadConfig(steps=steps, device=device, **SHAPE[device])
    model, opt = build_training(cfg)
    model = torch.compile(model, backend=backend)
    data = batches(cfg, 0)
    with fsdp_doctor.watch(model, opt, out_dir=out, profile=False) as doctor:
        if device == "cpu":
            host_timeline(doctor)
        for _ in range(cfg.steps):
            tokens, targets = next(data)
            loss = next_token_loss(model(tokens.to(device)), targets.to(device))
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss.item()  # (the loop's log line: one wait for the device a step)
            doctor.step()
    dist.destroy_process_group()


def record(out, device: str, backend: str, steps: int = 12):
    """Runs this script in a fresh process into ``out``; returns the loaded run."""
    import subprocess
    from pathlib import Path

    from conftest import child_pythonpath

    from fsdp_doctor import load_run

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": child_pythonpath(repo), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, __file__, str(out), device, backend, str(steps)], env=env, timeout=400,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return load_run(out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
