"""Device-side unit timings with CUDA events (skipped without a GPU)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SCRIPT = r"""
import os, sys, torch, torch.distributed as dist
import fsdp_doctor
from fsdp_doctor.workloads import WorkloadConfig, free_port
from fsdp_doctor.workloads.train import build_training, next_token_loss
from fsdp_doctor.workloads.data import batches
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=0, world_size=1)
cfg = WorkloadConfig(steps=6, device="cuda")
model, opt = build_training(cfg)
with fsdp_doctor.watch(model, opt, out_dir=sys.argv[1], profile=False) as doc:
    for step, (tok, tgt) in zip(range(cfg.steps), batches(cfg, 0)):
        loss = next_token_loss(model(tok.cuda()), tgt.cuda()); loss.backward(); opt.step(); opt.zero_grad()
        doc.step()
dist.destroy_process_group()
"""


def test_cuda_event_timings_recorded(tmp_path):
    from fsdp_doctor import load_run
    from fsdp_doctor.record.gpu_timing import UNIT_EVERY

    subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], check=True, timeout=300)
    rd = load_run(tmp_path).ranks[0]
    assert sorted(rd.gpu) == list(range(6))  # every step resolved, the last ones at exit
    for g in rd.gpu.values():
        assert g.step_ms > 0 and g.forward_ms > 0 and g.backward_ms > 0 and g.optimizer_ms > 0
        assert bool(g.units) == (g.step % UNIT_EVERY == 0)  # each unit timed on every UNIT_EVERY-th step only
    by = {row[0]: row for row in rd.gpu[0].units}
    assert by["layers.0"][1] > 0 and by["layers.0"][2] > 0
    assert by[""][1] >= by["layers.0"][1]  # the root's forward contains its blocks'


def test_units_inside_a_model_compiled_whole_are_timed_on_the_device(tmp_path):
    """``model = torch.compile(model)`` after fully_shard, one NCCL rank, 12 steps: every unit but the root runs inside
    the compiled frame, timed from FSDP2's own pre/post-forward logs, which open and close each one's CUDA events
    (tests/compiled_whole.py; tests/test_compile_steps.py runs the same on the CPU, the events the host's clock). On
    the steps that time every unit (0, the compiling one, and 10) each inner unit has a device forward and backward,
    each forward within the root's, their sum within it, the root's span the step's forward phase."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import compiled_whole

    run = compiled_whole.record(tmp_path / "run", "cuda", "aot_eager")
    assert str(run.config.device).startswith("cuda"), run.config.device
    assert compiled_whole.check_device_unit_times(run) == [0, 10]
