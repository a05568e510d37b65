"""The training loop of the reference workload, for one rank of an initialised process group.

`train` builds the model, shards it per the config, and runs `cfg.steps` AdamW steps on synthetic
batches, with the fault-injection knobs (a sleeping rank, garbage for the cyclic GC) applied inside
the step, outside the model. With `watch_kwargs` it runs the loop under `fsdp_doctor.watch` exactly
as a user would. `train_from_env` does the same under torchrun.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .config import WorkloadConfig
from .data import batches
from .gpt import build_model
from .sharding import DTYPES, apply_fsdp

# on_step(step, model, optimizer, loss) runs at the end of every step; `loss` is a detached scalar.
OnStep = Callable[[int, nn.Module, torch.optim.Optimizer, torch.Tensor], Any]


def make_optimizer(model: nn.Module, cfg: WorkloadConfig) -> torch.optim.Optimizer:
    """AdamW over `model.parameters()` at `cfg.lr` (torch's default implementation choice).

    Under wrap="no_root" the model mixes DTensor (sharded) and plain (never wrapped) parameters,
    which the foreach kernels refuse ("got mixed torch.Tensor and DTensor"), so the single-tensor
    implementation is forced there.
    """
    foreach = False if cfg.wrap == "no_root" else None
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, foreach=foreach)


def backend_for(device: str) -> str:
    """The process-group backend for a device type: gloo on CPU, nccl on CUDA."""
    return "nccl" if device == "cuda" else "gloo"


def setup_rank(cfg: WorkloadConfig, cuda_index: int) -> Optional[torch.device]:
    """Per-process settings before the process group: intra-op threads and the CUDA device (returned; None on CPU).

    `cuda_index` is the rank's device (`launch.gpu_plan`: several ranks may share one).
    """
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    if cfg.device != "cuda":
        return None
    if not torch.cuda.is_available():
        raise ValueError("device='cuda' requested but torch.cuda.is_available() is False")
    torch.cuda.set_device(cuda_index)
    return torch.device("cuda", cuda_index)


def build_training(cfg: WorkloadConfig) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The sharded model and its optimizer, created after sharding unless cfg.optimizer_before_shard.

    With optimizer_before_shard (a deliberate bug) AdamW holds the original full parameters, which
    `fully_shard` replaces by sharded DTensor parameters: the optimizer steps tensors the model no
    longer uses, so training changes nothing.
    """
    model = build_model(cfg)
    optimizer = make_optimizer(model, cfg) if cfg.optimizer_before_shard else None
    apply_fsdp(model, cfg)
    if optimizer is None:
        optimizer = make_optimizer(model, cfg)
    return model, optimizer


def train(cfg: WorkloadConfig, rank: int, world_size: int, watch_kwargs: Optional[dict] = None,
          on_step: Optional[OnStep] = None) -> list[float]:
    """Train this rank for `cfg.steps` steps; returns the loss of every step as Python floats.

    Needs an initialised default process group of `world_size` ranks. With `watch_kwargs` (a dict,
    possibly empty) the loop runs inside `fsdp_doctor.watch(model, optimizer, **watch_kwargs)` and
    calls `doctor.step()` after each optimizer step. `on_step(step, model, optimizer, loss)` runs last
    in every step.
    """
    _check_process_group(world_size)
    model, optimizer = build_training(cfg)
    if watch_kwargs is None:
        return _run_steps(cfg, rank, model, optimizer, None, on_step)
    import fsdp_doctor  # lazily: the workload itself does not need the doctor

    with fsdp_doctor.watch(model, optimizer, **watch_kwargs) as doctor:
        return _run_steps(cfg, rank, model, optimizer, doctor.step, on_step)


def _check_process_group(world_size: int) -> None:
    if not dist.is_initialized():
        raise RuntimeError("train() needs an initialised process group; use launch() or train_from_env()")
    if dist.get_world_size() != world_size:
        raise RuntimeError(f"world_size={world_size} but the process group has {dist.get_world_size()} ranks")


def _run_steps(cfg: WorkloadConfig, rank: int, model: nn.Module, optimizer: torch.optim.Optimizer,
               doctor_step: Optional[Callable[[], Any]], on_step: Optional[OnStep]) -> list[float]:
    """The user's loop: inject faults, forward, loss, backward, step, zero_grad, doctor.step()."""
    losses = []
    data = batches(cfg, rank)
    for step in range(cfg.steps):
        inject_step_faults(cfg, rank, step)
        for micro in range(cfg.grad_accum):
            tokens, targets = next(data)
            tokens, targets = tokens.to(cfg.device), targets.to(cfg.device)
            if cfg.grad_accum > 1 and cfg.accum_no_sync:  # reduce-scatter on the last micro-batch only
                model.set_requires_gradient_sync(micro == cfg.grad_accum - 1)
            with autocast(cfg):
                loss = next_token_loss(model(tokens), targets)
            (loss / cfg.grad_accum if cfg.grad_accum > 1 else loss).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=cfg.zero_grad_to_none)
        if doctor_step is not None:
            doctor_step()
        losses.append(loss.detach())
        if on_step is not None:
            on_step(step, model, optimizer, losses[-1])
    return [float(x) for x in losses]  # one host sync at the end, not one per step


def autocast(cfg: WorkloadConfig):
    """``torch.autocast`` on the run's device in ``cfg.autocast``'s dtype, or a context that does nothing."""
    if cfg.autocast is None:
        return contextlib.nullcontext()
    return torch.autocast(cfg.device, dtype=DTYPES[cfg.autocast])


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits [B, T, V] against targets [B, T], computed in fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def inject_step_faults(cfg: WorkloadConfig, rank: int, step: int) -> None:
    """Before the forward: the straggler sleep on `cfg.sleep_rank`, every rank's pause on every `cfg.pause_every`-th
    step, then `cfg.gc_garbage` cycles and `cfg.gc_heap`'s objects."""
    if should_sleep(cfg, rank, step):
        time.sleep(cfg.sleep_ms / 1000.0)
    if cfg.pause_every and step % cfg.pause_every == cfg.pause_every - 1:
        time.sleep(cfg.pause_ms / 1000.0)
    if cfg.gc_garbage:
        make_garbage(cfg.gc_garbage)
    if cfg.gc_heap:
        hold_objects(cfg.gc_heap)


def should_sleep(cfg: WorkloadConfig, rank: int, step: int) -> bool:
    """Whether `rank` sleeps at `step` (every step when cfg.sleep_steps is empty)."""
    if cfg.sleep_rank is None or cfg.sleep_rank != rank or cfg.sleep_ms <= 0:
        return False
    return not cfg.sleep_steps or step in cfg.sleep_steps


#: gc_heap's objects: "heap", kept for the whole run, and "steps", the last steps' records (release_objects drops them)
_HELD: dict = {}


def hold_objects(n: int) -> None:
    """`n` small objects that live for the whole run (made at the first call: a dataset's index, a tokenizer's
    cache), and `n // 4` made each step and kept for 3 steps (the step's records). No cycle among them: the
    collector frees nothing, but the survivors set off full collections, which traverse them all."""
    if _HELD.get("n") != n:
        _HELD.update(n=n, heap=[[i] for i in range(n)], steps=[])  # (lists: the collector tracks them)
    kept = _HELD["steps"]
    kept.append([[j] for j in range(n // 4)])
    del kept[:-3]


def release_objects() -> None:
    """Drops what `hold_objects` keeps."""
    _HELD.clear()


def make_garbage(n_cycles: int) -> None:
    """Allocate and drop `n_cycles` two-object reference cycles: only the cyclic GC can free them.

    The allocations advance the GC's generation-0 counter, so collections fire during the step
    (unless the GC is disabled).
    """
    for _ in range(n_cycles):
        a: dict = {}
        b = {"peer": a}
        a["peer"] = b


def train_from_env(cfg: WorkloadConfig, watch_kwargs: Optional[dict] = None,
                   on_step: Optional[OnStep] = None) -> list[float]:
    """Train one rank under torchrun: RANK, WORLD_SIZE (and LOCAL_RANK, MASTER_ADDR/PORT) from the env.

    Initialises the default process group (env://) unless already initialised, trains, and destroys
    the group it created.
    """
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    setup_rank(cfg, local_rank)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group(backend_for(cfg.device), rank=rank, world_size=world_size)
    try:
        losses = train(cfg, rank, world_size, watch_kwargs=watch_kwargs, on_step=on_step)
        if created:
            dist.barrier()  # all ranks done with every collective before the group is torn down
        return losses
    finally:
        if created:
            dist.destroy_process_group()


def running_under_torchrun() -> bool:
    """True when RANK and WORLD_SIZE are set in the environment (torchrun or similar)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ
