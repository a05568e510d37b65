"""Tracker: the live recorder behind ``fsdp_doctor.watch``: the :class:`Doctor` owns the lifecycle (entry checks,
the run directory, install and uninstall, ``step()``) and fans the work out to its collaborators:

* :class:`~fsdp_doctor.record.hooks.StepTimer` (``hooks.py``): the hooks around FSDP2's own (forward, the FSDP
  log tap for backward, gradient hooks, optimizer, gc), the per-unit and per-phase timings, and the marks it
  emits to the memory probe;
* :class:`~fsdp_doctor.record.memory.MemoryProbe` (``memory.py`` and its collaborators): memory by category;
* :func:`~fsdp_doctor.record.config_snapshot.config_snapshot`: the ``RunConfig`` written at the first step;
* :class:`~fsdp_doctor.record.sinks.Sinks` (record stream, live TensorBoard) and
  :class:`~fsdp_doctor.record.profiling.ProfilerWindows` (torch.profiler windows), under one
  :class:`~fsdp_doctor.record.sinks.FailurePolicy`;
* :func:`~fsdp_doctor.record.run_device.run_device`: the run's device, from the process group.

None of the hooks changes a tensor: losses are bit-identical with and without the doctor. Every hook
body is guarded: an exception is caught, reported once (log + an ``error`` record) and the doctor steps
aside while training continues.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import __version__
from ..records import (
    End,
    Header,
    Manifest,
    ProfileWindow,
    RunConfig,
    StepRecord,
    stream_name,
)
from ..store.writer import RunDirTaken, claim_run_dir, write_manifest
from .profiling import ProfilerWindows, resolve_profile
from .run_device import run_device
from .sinks import FailurePolicy, Sinks
from .config_snapshot import config_snapshot
from .throughput import FlopCounter
from . import fsdp2 as F2
from .hooks import StepTimer, _ms
from .units import Unit, find_units

log = logging.getLogger("fsdp_doctor")
_WATCHED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
_now = time.perf_counter_ns


class WatchError(RuntimeError):
    """``watch`` refused to start; the message is one sentence for the user."""


class Doctor:
    """Records one rank of an FSDP2 training run. Create it with :func:`fsdp_doctor.watch`."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        out_dir: str | os.PathLike,
        capacity_bytes: int | None = None,
        profile: Any = True,
        tokens_per_step: int | None = None,
        peak_tflops: float | None = None,
        count_flops: bool | None = None,
        memory: Any = True,
        tensorboard: bool = False,
        overwrite: bool = False,
    ):
        self.model = model
        self._overwrite = overwrite
        self.optimizer = optimizer
        self.out_dir = Path(out_dir)
        self.capacity_bytes = capacity_bytes
        self.tokens_per_step = tokens_per_step
        self.peak_tflops = peak_tflops
        self.count_flops = (tokens_per_step is not None or peak_tflops is not None) if count_flops is None else count_flops
        self._profile_kwargs = resolve_profile(profile)
        self._memory_opt = memory
        self._tb_opt = tensorboard
        self._timer = StepTimer(self._fail)  # the hooks around FSDP's, their marks and timings
        self.active = False
        self.steps_done = 0
        self._failures = FailurePolicy(self._step_aside, self._safe_write)
        self._units: list[Unit] = []
        self._consistency: str | None = None  # the first step's consistency check ("" when it passed)
        self._sinks: Sinks | None = None  # the record stream and the live TensorBoard writer
        self._profiler: ProfilerWindows | None = None
        self._memory = None
        self._flops: FlopCounter | None = None
        self.flops_per_step: float | None = None
        self._config_written = False
        self._entered = False
        self._gpu = None  # GpuTimeline on CUDA

    # ------------------------------------------------------------------ entry / exit
    def __enter__(self) -> "Doctor":
        self._check_entry()
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.run_id = self._claim_out_dir()
        self.started_ns = time.time_ns()
        self._sinks = Sinks(self.out_dir, self.rank)
        self._sinks.write(
            Header(rank=self.rank, world_size=self.world_size, pid=os.getpid(), host=socket.gethostname(),
                   started_ns=self.started_ns, doctor_version=__version__, run_id=self.run_id)
        )
        if self.rank == 0:
            write_manifest(
                self.out_dir,
                Manifest(world_size=self.world_size, started_ns=self.started_ns, doctor_version=__version__,
                         streams=[stream_name(r) for r in range(self.world_size)], command=list(sys.argv),
                         run_id=self.run_id),
            )
        self._install()
        if self._tb_opt:
            try:
                self._sinks.open_tensorboard(self.rank)
            except Exception as e:  # noqa: BLE001  (no tensorboard installed, unwritable dir: record without it)
                self._fail("tensorboard", e, stop=False)
        self.device = run_device(self._units)  # the process group's device, a GPU under CPUOffloadPolicy
        if self.device.type == "cuda":
            from .gpu_timing import GpuTimeline

            self._gpu = self._timer.gpu = GpuTimeline(self.rank, len(self._units), [u.name for u in self._units])
        _WATCHED.add(self.model)
        self._entered = True
        self.active = True
        if self._profile_kwargs is not None:
            try:
                self._profiler = ProfilerWindows(self.out_dir, self.rank, self._profile_kwargs, self._on_trace_saved)
                self._profiler.start()
            except Exception as e:  # noqa: BLE001
                self._profiler = None
                self._fail("profiler start", e, stop=False)
        self._begin_step(_now())
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            if self._profiler is not None:
                try:
                    self._profiler.stop()
                except Exception as e:  # noqa: BLE001
                    self._fail("profiler stop", e, stop=False)
            if self._flops is not None:
                self._flops.abort()
                self._flops = None
            self._timer.uninstall()
            if self._memory is not None:
                self._memory.detach()
            if self._sinks is not None:
                try:
                    self._sinks.close_tensorboard()
                except Exception as e:  # noqa: BLE001
                    self._fail("tensorboard close", e, stop=False)
            if self._gpu is not None and self.active:
                try:
                    self._sinks.write(*self._gpu.flush())
                except Exception as e:  # noqa: BLE001
                    self._fail("gpu timing", e, stop=False)
            if self._sinks is not None:
                if exc_type is None:
                    self._safe_write(End(rank=self.rank, steps=self.steps_done, ended_ns=time.time_ns()))
                self._sinks.close()
        finally:
            _WATCHED.discard(self.model)
            self._timer = StepTimer(self._fail)  # the hooks around FSDP's, their marks and timings
        self.active = False
        return False  # never swallow the user's exception

    def _check_entry(self) -> None:
        if self.model in _WATCHED:
            raise WatchError("fsdp_doctor.watch: this model is already being watched; exit the first watch() before starting another")
        reason = F2.unsupported_reason()
        if reason is not None:
            raise WatchError(f"fsdp_doctor.watch: {reason}")
        units = find_units(self.model)
        if not units:
            raise WatchError(
                f"fsdp_doctor.watch: {type(self.model).__name__} has no FSDP2 unit; apply "
                "torch.distributed.fsdp.fully_shard to its blocks and to the model before watching it"
            )
        self._units = units
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            probe = self.out_dir / f".write-test-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise WatchError(f"fsdp_doctor.watch: cannot write to out_dir {self.out_dir} ({e.strerror or e})") from None

    def _claim_out_dir(self) -> str:
        """A run directory holds one run: refuse one holding another run's records (unless ``overwrite``); all
        ranks agree on the verdict and the run id before any writes (one all_gather_object at entry)."""
        exchange = None
        if self.world_size > 1:
            def exchange(v):
                got = [None] * self.world_size
                dist.all_gather_object(got, v)
                return got
        try:
            return claim_run_dir(self.out_dir, self.rank, overwrite=self._overwrite, exchange=exchange)
        except RunDirTaken as e:
            raise WatchError(f"fsdp_doctor.watch: {e}") from None

    # ------------------------------------------------------------------ hooks
    # ------------------------------------------------------------------ collaborators
    @property
    def active(self) -> bool:
        return self._timer.active

    @active.setter
    def active(self, value: bool) -> None:
        self._timer.active = value

    @property
    def _acc(self):
        """Per-unit accumulators of the step (the timer's)."""
        return self._timer._acc

    def _install(self) -> None:
        self._timer.install(self._units, self.model, self.optimizer)
        self._init_memory()
        self._timer.marks = self._memory

    def _init_memory(self) -> None:
        if not self._memory_opt:
            return
        try:
            from .memory import MemoryProbe
        except ImportError:
            return
        try:
            self._memory = MemoryProbe(self.model, self.optimizer, self._units, self._memory_opt)
        except Exception as e:  # noqa: BLE001
            self._memory = None
            self._fail("memory probe", e, stop=False)

    # ------------------------------------------------------------------ steps
    def _begin_step(self, t: int) -> None:
        self._step_t0 = t
        self._step_wall_ns = time.time_ns()
        self._timer.begin_step()

    def step(self) -> None:
        """Marks the end of one training step. Call it once per step, after ``optimizer.step()``."""
        t_end = _now()
        if not self.active:
            self.steps_done += 1
            return
        try:
            self._end_step(t_end)
        except Exception as e:  # noqa: BLE001
            self._fail("step", e)
        self.steps_done += 1
        if self.active:
            self._begin_step(t_end)

    def _end_step(self, t_end: int) -> None:
        step = self.steps_done
        if not self._config_written:
            self._write_config()
        wall = t_end - self._step_t0
        tm = self._timer
        units = tm.unit_rows()
        fwd, bwd, opt = _ms(tm._forward_ns), _ms(tm._backward_ns), _ms(tm._optimizer_ns)
        profiled = self._profiler is not None and self._profiler.is_profiled(step)
        profiled = profiled or self._spill_profiled or self._flops is not None
        self._spill_profiled = False
        mem = self._memory.step_end(step) if self._memory is not None else None
        rec = StepRecord(
            rank=self.rank, step=step, start_ns=self._step_wall_ns, wall_ms=_ms(wall),
            forward_ms=fwd, backward_ms=bwd, optimizer_ms=opt, outside_ms=max(0.0, round(_ms(wall) - fwd - bwd - opt, 3)),
            gc_ms=_ms(tm._gc_ns), gc_count=tm._gc_count, profiled=profiled, units=units, memory=mem,
        )
        self._sinks.on_step(rec)
        if self._gpu is not None:
            done = self._gpu.end_step(step)
            if done:
                self._sinks.write(*done)
        self._flops_tick(step)
        if self._profiler is not None:
            try:
                if self._profiler.step():
                    self._spill_profiled = True  # the trace export ran inside the next step's wall time
            except Exception as e:  # noqa: BLE001
                self._profiler = None
                self._fail("profiler", e, stop=False)

    _spill_profiled = False

    def _flops_tick(self, step: int) -> None:
        """Counts FLOPs over one whole step (step 1, after FSDP's lazy init) with FlopCounterMode."""
        if not self.count_flops:
            return
        if self._flops is not None:
            self.flops_per_step = self._flops.finish()
            self._flops = None
            self._safe_write(self._config())
        elif step == 0 and self.flops_per_step is None:
            self._flops = FlopCounter()
            self._flops.start()

    def _write_config(self) -> None:
        self._config_written = True
        self._timer.index_labels()
        self._timer.end_child_watch()  # the first step has shown which submodules checkpointing re-runs
        self._sinks.write(self._config())

    def _config(self) -> RunConfig:
        cfg, self._consistency = config_snapshot(
            self.model, self.optimizer, self._units, rank=self.rank, world_size=self.world_size, device=self.device,
            capacity_bytes=self.capacity_bytes, tokens_per_step=self.tokens_per_step, peak_tflops=self.peak_tflops,
            flops_per_step=self.flops_per_step, profile_schedule=getattr(self._profiler, "schedule", None),
            runtime_checkpointed=self._timer._runtime_ckpt,
            runtime_checkpointed_children=self._timer.checkpointed_children, consistency=self._consistency)
        return cfg

    def _on_trace_saved(self, steps: list[int], rel_path: str) -> None:
        self._sinks.on_profile(ProfileWindow(rank=self.rank, steps=steps, path=rel_path))

    # ------------------------------------------------------------------ failure handling
    def _safe(self, fn, where: str) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            self._fail(where, e)

    def _safe_write(self, rec) -> None:
        if self._sinks is not None:
            self._sinks.safe_write(rec)

    def _step_aside(self) -> None:
        self._timer = StepTimer(self._fail)  # the hooks around FSDP's, their marks and timings
        self.active = False
        if self._memory is not None:  # its dispatch mode, resize_ wrapper and saved-tensor hooks go at once
            self._memory.detach()

    def _fail(self, where: str, exc: BaseException, stop: bool = True) -> None:
        """Reports a failure inside the doctor once and, if ``stop``, steps aside for the rest of the run
        (the one failure policy: fsdp_doctor.record.sinks.FailurePolicy)."""
        self._failures.fail(where, exc, rank=getattr(self, "rank", "?"), step=self.steps_done, stop=stop)


def watch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    out_dir: str | os.PathLike,
    capacity_bytes: int | None = None,
    profile: Any = True,
    tokens_per_step: int | None = None,
    peak_tflops: float | None = None,
    count_flops: bool | None = None,
    memory: Any = True,
    tensorboard: bool = False,
    overwrite: bool = False,
) -> Doctor:
    """Watches an FSDP2 training loop; use as ``with fsdp_doctor.watch(model, opt, out_dir=...) as doctor``
    and call ``doctor.step()`` once per step.

    Args:
        model: the model with ``fully_shard`` applied (to its blocks and to itself).
        optimizer: its optimizer (for optimizer-step timing, state memory and the optimizer checks).
        out_dir: the run directory; each rank writes its own record stream there.
        capacity_bytes: memory budget per rank the diagnosis compares against (default: the GPU's total
            memory; none on CPU).
        profile: torch.profiler windows: True (default schedule: 2 steps from step 6, then every 200),
            False, a schedule callable (``torch.profiler.schedule(...)`` or :class:`ProfileSchedule`), or a
            dict of ``torch.profiler.profile`` arguments.
        tokens_per_step: tokens the whole job processes per step (enables tokens/s).
        peak_tflops: the device's peak TFLOP/s for MFU (default: a table of common GPUs).
        count_flops: count FLOPs of step 1 with FlopCounterMode (default: when tokens_per_step or
            peak_tflops is given).
        memory: memory by category: True (default: full sampling on steps 0-2, then adaptively within
            0.3% of the step time), False (off), or a dict of options, e.g. {"full_every": 1}
            (see fsdp_doctor.record.memory).
        tensorboard: also write TensorBoard scalars live to ``out_dir/tb/rank{R}`` (step time and split, memory
            at the peak, overlap of profiled steps). Off by default: TensorBoard's event writer costs 2-4% of the
            CPU of a step here (its CRC32C and protobuf work run in Python on a background thread that competes
            with training). ``fsdp-doctor tensorboard OUT_DIR`` writes the same scalars afterwards, at no
            cost to training.
        overwrite: ``out_dir`` already holding another run's records is refused (a run directory holds one
            run); True removes that run's files first (manifest, record streams, profiler/, tb/, report.json).
    """
    return Doctor(model, optimizer, out_dir=out_dir, capacity_bytes=capacity_bytes, profile=profile,
                  tokens_per_step=tokens_per_step, peak_tflops=peak_tflops, count_flops=count_flops, memory=memory,
                  tensorboard=tensorboard, overwrite=overwrite)
