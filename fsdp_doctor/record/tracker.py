"""Tracker: the live recorder behind ``fsdp_doctor.watch``.

It brackets FSDP2's own hooks without patching FSDP:

* forward: for every module of every unit, a forward pre-hook registered with ``prepend=True`` runs
  before FSDP's pre-forward (unit still sharded), a plain one runs after it (unshard waited for); post
  hooks bracket FSDP's post-forward (reshard) the same way.
* backward: FSDP logs ``FSDP::pre_backward (fqn)`` / ``FSDP::post_backward (fqn)`` on the logger
  ``torch.distributed.fsdp.fully_shard`` at DEBUG; the doctor intercepts that logger's ``debug`` calls
  (restored at exit; passed on when the user has the logger at DEBUG) and timestamps them. A gradient hook registered on each unit's outputs after FSDP's own marks the end
  of the unit's backward unshard wait, and an autograd-engine callback queued from it marks the end of
  backward (after FSDP's final callback, i.e. after the reduce-scatter waits).
* optimizer: ``Optimizer.register_step_pre_hook`` / ``register_step_post_hook``.
* garbage collection: ``gc.callbacks``.

None of these hooks changes a tensor: losses are bit-identical with and without the doctor. Every hook
body is guarded: an exception is caught, reported once (log + an ``error`` record) and the doctor steps
aside while training continues.
"""

from __future__ import annotations

import gc
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
    UnitStep,
    stream_name,
)
from ..store.writer import RunDirTaken, claim_run_dir, write_manifest
from .profiling import ProfilerWindows, resolve_profile
from .run_device import run_device
from .sinks import FailurePolicy, Sinks
from .config_snapshot import config_snapshot
from .throughput import FlopCounter
from . import fsdp2 as F2
from .units import Unit, checkpointed_modules, find_units, label_to_index

log = logging.getLogger("fsdp_doctor")
_FSDP_LOGGER = F2.LOGGER_NAME
_WATCHED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
_now = time.perf_counter_ns


class WatchError(RuntimeError):
    """``watch`` refused to start; the message is one sentence for the user."""


class _UnitAcc:
    """Per-step accumulators of one unit (ns)."""

    __slots__ = ("fwd", "ag_fwd", "bwd", "ag_bwd", "recompute", "calls", "t_outer", "t_inner",
                 "t_pre_bwd", "bwd_hooked", "fwd_depth", "t_recompute", "recompute_runs", "grad_seen")

    def __init__(self):
        self.reset()

    def reset(self):
        self.fwd = self.ag_fwd = self.bwd = self.ag_bwd = self.recompute = 0
        self.calls = 0
        self.t_outer = self.t_inner = self.t_pre_bwd = 0
        self.bwd_hooked = False
        self.fwd_depth = 0
        self.t_recompute = 0
        self.recompute_runs = 0
        self.grad_seen = False


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
        self.active = False
        self.steps_done = 0
        self._failures = FailurePolicy(self._step_aside, self._safe_write)
        self._handles: list[Any] = []
        self._units: list[Unit] = []
        self._acc: dict[int, _UnitAcc] = {}
        self._runtime_ckpt: set[int] = set()  # units seen re-running their forward in backward
        self._unit_of_label: dict[str, int] = {}
        self._consistency: str | None = None  # the first step's consistency check ("" when it passed)
        self._sinks: Sinks | None = None  # the record stream and the live TensorBoard writer
        self._profiler: ProfilerWindows | None = None
        self._memory = None
        self._flops: FlopCounter | None = None
        self.flops_per_step: float | None = None
        self._config_written = False
        self._entered = False
        self._gc_ns = self._gc_count = self._gc_start = 0
        self._gpu = None  # GpuTimeline on CUDA
        self._tap = self._tap_prev = None  # the FSDP logger interception
        self._grad_hooks: dict[int, Any] = {}
        self._log_cache: dict[str, tuple[bool, int] | None] = {}

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

            self._gpu = GpuTimeline(self.rank, len(self._units), [u.name for u in self._units])
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
            self._uninstall()
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
    def _install(self) -> None:
        h = self._handles
        for idx, u in enumerate(self._units):
            self._acc[idx] = _UnitAcc()
            for m in u.modules:
                h.append(m.register_forward_pre_hook(self._mk(self._fwd_outer_pre, idx), prepend=True))
                h.append(m.register_forward_pre_hook(self._mk(self._fwd_inner_pre, idx)))
                h.append(m.register_forward_hook(self._mk(self._fwd_inner_post, idx), prepend=True))
                h.append(m.register_forward_hook(self._mk(self._fwd_outer_post, idx)))
            # Activation checkpointing re-runs the wrapped inner module in backward, not the unit's own
            # module: time those re-runs as the unit's recompute.
            for inner in checkpointed_modules(u, self._units):
                h.append(inner.register_forward_pre_hook(self._mk(self._recompute_pre, idx)))
                h.append(inner.register_forward_hook(self._mk(self._recompute_post, idx)))
        h.append(self.model.register_forward_pre_hook(self._model_pre, prepend=True))
        h.append(self.model.register_forward_hook(self._model_post))
        if self.optimizer is not None:
            h.append(self.optimizer.register_step_pre_hook(self._opt_pre))
            h.append(self.optimizer.register_step_post_hook(self._opt_post))
        gc.callbacks.append(self._gc_cb)
        self._tap_fsdp_log()
        self._init_memory()

    def _uninstall(self) -> None:
        for hd in self._handles:
            try:
                hd.remove()
            except Exception:  # noqa: BLE001
                pass
        self._handles.clear()
        if self._gc_cb in gc.callbacks:
            gc.callbacks.remove(self._gc_cb)
        lg = logging.getLogger(_FSDP_LOGGER)
        if self._tap is not None and lg.__dict__.get("debug") is self._tap:
            if self._tap_prev is None:
                del lg.debug
            else:
                lg.debug = self._tap_prev
        self._tap = None

    def _tap_fsdp_log(self) -> None:
        """Time-stamps FSDP2's per-unit hook logs (``FSDP::pre_backward (fqn)``...) by intercepting its
        logger's ``debug`` calls: about a microsecond each, against ~25 µs for a logging.Handler, whose
        LogRecord and caller lookup would cost ~1 ms per step. FSDP's code is untouched, and the call is
        passed on unchanged when the user has that logger at DEBUG."""
        lg = logging.getLogger(_FSDP_LOGGER)
        prev = lg.__dict__.get("debug")  # someone else's interception, kept and chained
        orig = prev if prev is not None else lg.debug
        now, enabled = _now, lg.isEnabledFor

        def debug(msg, *args, **kwargs):
            if self.active:
                label = args[0] if args and msg == "%s" else msg
                if isinstance(label, str) and label.startswith("FSDP::"):
                    try:
                        self._on_fsdp_log(label, now())
                    except Exception as e:  # noqa: BLE001
                        self._fail("fsdp log tap", e)
            if prev is not None or enabled(logging.DEBUG):
                orig(msg, *args, **kwargs)

        self._tap, self._tap_prev = debug, prev
        lg.debug = debug

    def _init_memory(self) -> None:
        if not self._memory_opt:
            return
        try:
            from .memory import MemoryProbe
        except ImportError:
            return
        try:
            self._memory = MemoryProbe(self, self._memory_opt)
        except Exception as e:  # noqa: BLE001
            self._memory = None
            self._fail("memory probe", e, stop=False)

    def _mk(self, fn, idx):
        def hook(module, *args):
            if self.active:
                try:
                    fn(idx, args)
                except Exception as e:  # noqa: BLE001
                    self._fail(fn.__name__, e)
        return hook

    @staticmethod
    def _in_backward() -> bool:
        return torch._C._current_graph_task_id() != -1

    def _recompute_pre(self, idx, args):
        if self._in_backward():
            a = self._acc[idx]
            a.t_recompute = _now()
            a.recompute_runs += 1

    def _recompute_post(self, idx, args):
        a = self._acc[idx]
        if self._in_backward() and a.t_recompute:
            a.recompute += _now() - a.t_recompute
            a.t_recompute = 0

    @staticmethod
    def _recompute_ns(a: "_UnitAcc") -> int:
        """Measured re-run time; when the re-run was cut short (non-reentrant checkpoint stops early once
        it has rebuilt the saved tensors, so its forward hook never fires) the unit's forward compute time,
        which is what checkpointing re-runs."""
        if a.recompute or not a.recompute_runs:
            return a.recompute
        return max(0, a.fwd - a.ag_fwd)

    def _fwd_outer_pre(self, idx, args):
        a = self._acc[idx]
        if self._in_backward() and a.fwd_depth == 0:
            # the unit re-runs in backward: torch.utils.checkpoint.checkpoint(unit, ...) around it. The
            # non-reentrant re-run stops early (no post-hook), so nothing here may wait for one.
            a.t_recompute = _now()
            a.recompute_runs += 1
            self._runtime_ckpt.add(idx)
            return
        if a.fwd_depth == 0:  # grouped units: only the first module's entry opens the unit
            a.t_outer = _now()
            if self._gpu is not None and not self._in_backward():
                self._gpu.open(idx, 0)
        a.fwd_depth += 1

    def _fwd_inner_pre(self, idx, args):
        a = self._acc[idx]
        if a.fwd_depth == 1 and a.t_inner == 0:
            a.t_inner = _now()
            if not self._in_backward():
                a.ag_fwd += a.t_inner - a.t_outer
        if self._memory is not None:
            self._memory.mark(self._units[idx].name, "forward_start")

    def _fwd_inner_post(self, idx, args):
        if self._memory is not None:
            self._memory.mark(self._units[idx].name, "forward_end")

    def _fwd_outer_post(self, idx, args):
        a = self._acc[idx]
        if self._in_backward() and a.fwd_depth == 0:
            if a.t_recompute:
                a.recompute += _now() - a.t_recompute
                a.t_recompute = 0
            return
        a.fwd_depth = max(0, a.fwd_depth - 1)
        if a.fwd_depth:
            return
        t = _now()
        dt = t - a.t_outer
        a.t_inner = 0
        if self._in_backward():
            a.recompute += dt
            return
        a.fwd += dt
        a.calls += 1
        if self._gpu is not None:
            self._gpu.close(idx, 0)
        output = args[1] if len(args) > 1 else None
        if not a.bwd_hooked and output is not None:
            self._hook_outputs(idx, output)

    def _hook_outputs(self, idx: int, output) -> None:
        """Marks the unit's outputs so that the first gradient reaching them (after FSDP's own pre-backward
        hook, registered before ours) tells when the unit's backward unshard was waited for."""
        hook = self._grad_hooks.get(idx)
        if hook is None:
            hook = self._grad_hooks[idx] = self._make_grad_hook(idx)
        if isinstance(output, torch.Tensor):
            tensors = (output,)
        else:
            tensors = []
            _collect_tensors(output, tensors)
        for t in tensors:
            if t.requires_grad:
                t.register_hook(hook)
                self._acc[idx].bwd_hooked = True

    def _make_grad_hook(self, idx: int):
        acc = self._acc[idx]

        def grad_hook(grad):
            if self.active and not acc.grad_seen:
                acc.grad_seen = True
                try:
                    self._on_unit_grad(idx)
                except Exception as e:  # noqa: BLE001
                    self._fail("grad hook", e)
            return None

        return grad_hook

    def _on_unit_grad(self, idx: int) -> None:
        t = _now()
        a = self._acc[idx]
        if a.t_pre_bwd:
            a.ag_bwd += t - a.t_pre_bwd
        if self._bwd_start == 0:
            self._bwd_start = t
        if not self._bwd_cb_queued:
            self._bwd_cb_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

    def _on_backward_end(self) -> None:
        if not self.active:
            return
        try:
            t = _now()
            if self._bwd_start:
                self._backward_ns += t - self._bwd_start
            self._bwd_start = 0
            self._bwd_cb_queued = False
            for a in self._acc.values():
                a.bwd_hooked = a.grad_seen = False
            if self._memory is not None:
                self._memory.mark(None, "backward_end")
        except Exception as e:  # noqa: BLE001
            self._fail("backward end", e)

    def _parse_fsdp_log(self, msg: str) -> tuple[bool, int] | None:
        """("FSDP::pre_backward (layers.0)" -> (True, unit index)); None for labels the doctor does not use."""
        kind, _, rest = msg.partition(" (")
        if kind not in ("FSDP::pre_backward", "FSDP::post_backward"):
            return None
        fqn = rest.rsplit(")", 1)[0] if rest else ""
        if fqn not in self._unit_of_label:
            self._unit_of_label = label_to_index(self._units)
        idx = self._unit_of_label.get(fqn)
        return None if idx is None else (kind == "FSDP::pre_backward", idx)

    def _on_fsdp_log(self, msg: str, t: int) -> None:
        # The same few label strings recur every step: parse each once.
        try:
            parsed = self._log_cache[msg]
        except KeyError:
            parsed = self._log_cache[msg] = self._parse_fsdp_log(msg)
        if parsed is None:
            return
        is_pre, idx = parsed
        a = self._acc[idx]
        if is_pre:
            if self._bwd_start == 0:
                self._bwd_start = t
            if not a.t_pre_bwd:
                a.t_pre_bwd = t
                if self._gpu is not None:
                    self._gpu.open(idx, 1)
            if self._memory is not None:
                self._memory.mark(self._units[idx].name, "backward_start")
        else:
            if a.t_pre_bwd:
                a.bwd += t - a.t_pre_bwd
                a.t_pre_bwd = 0
                if self._gpu is not None:
                    self._gpu.close(idx, 1)
            if self._memory is not None:
                self._memory.mark(self._units[idx].name, "backward_end")

    def _model_pre(self, module, args):
        if self.active and not self._in_backward():
            self._fwd_start = _now()
            if self._memory is not None:
                self._safe(lambda: self._memory.mark(None, "forward_start"), "memory")

    def _model_post(self, module, args, output):
        if self.active and not self._in_backward() and self._fwd_start:
            self._forward_ns += _now() - self._fwd_start
            self._fwd_start = 0

    def _opt_pre(self, optimizer, args, kwargs):
        if self.active:
            self._opt_start = _now()
            if self._memory is not None:
                self._safe(lambda: self._memory.mark(None, "optimizer_start"), "memory")

    def _opt_post(self, optimizer, args, kwargs):
        if self.active and self._opt_start:
            self._optimizer_ns += _now() - self._opt_start
            self._opt_start = 0
            if self._memory is not None:
                self._safe(lambda: self._memory.mark(None, "optimizer_end"), "memory")

    def _gc_cb(self, phase, info):
        if not self.active:
            return
        if phase == "start":
            self._gc_start = _now()
        elif self._gc_start:
            self._gc_ns += _now() - self._gc_start
            self._gc_count += 1
            self._gc_start = 0

    # ------------------------------------------------------------------ steps
    def _begin_step(self, t: int) -> None:
        self._step_t0 = t
        self._step_wall_ns = time.time_ns()
        self._forward_ns = self._backward_ns = self._optimizer_ns = self._gc_ns = 0
        self._gc_count = 0
        self._fwd_start = self._bwd_start = self._opt_start = self._gc_start = 0
        self._bwd_cb_queued = False
        for a in self._acc.values():
            a.reset()
        if self._gpu is not None:
            self._gpu.begin_step()

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
        units = [
            UnitStep(name=u.name, fwd_ms=_ms(a.fwd), ag_wait_fwd_ms=_ms(a.ag_fwd), bwd_ms=_ms(a.bwd),
                     ag_wait_bwd_ms=_ms(a.ag_bwd), recompute_ms=_ms(self._recompute_ns(a)), fwd_calls=a.calls)
            for u, a in ((self._units[i], self._acc[i]) for i in range(len(self._units)))
        ]
        fwd, bwd, opt = _ms(self._forward_ns), _ms(self._backward_ns), _ms(self._optimizer_ns)
        profiled = self._profiler is not None and self._profiler.is_profiled(step)
        profiled = profiled or self._spill_profiled or self._flops is not None
        self._spill_profiled = False
        mem = self._memory.step_end(step) if self._memory is not None else None
        rec = StepRecord(
            rank=self.rank, step=step, start_ns=self._step_wall_ns, wall_ms=_ms(wall),
            forward_ms=fwd, backward_ms=bwd, optimizer_ms=opt, outside_ms=max(0.0, round(_ms(wall) - fwd - bwd - opt, 3)),
            gc_ms=_ms(self._gc_ns), gc_count=self._gc_count, profiled=profiled, units=units, memory=mem,
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
        self._unit_of_label = label_to_index(self._units)
        self._sinks.write(self._config())

    def _config(self) -> RunConfig:
        cfg, self._consistency = config_snapshot(
            self.model, self.optimizer, self._units, rank=self.rank, world_size=self.world_size, device=self.device,
            capacity_bytes=self.capacity_bytes, tokens_per_step=self.tokens_per_step, peak_tflops=self.peak_tflops,
            flops_per_step=self.flops_per_step, profile_schedule=getattr(self._profiler, "schedule", None),
            runtime_checkpointed=self._runtime_ckpt, consistency=self._consistency)
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
        self.active = False

    def _fail(self, where: str, exc: BaseException, stop: bool = True) -> None:
        """Reports a failure inside the doctor once and, if ``stop``, steps aside for the rest of the run
        (the one failure policy: fsdp_doctor.record.sinks.FailurePolicy)."""
        self._failures.fail(where, exc, rank=getattr(self, "rank", "?"), step=self.steps_done, stop=stop)


def _ms(ns: int) -> float:
    """Nanoseconds to milliseconds, kept to the microsecond."""
    return round(ns * 1e-6, 3)


def _collect_tensors(obj, out: list, depth: int = 0) -> None:
    if depth > 4:
        return
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _collect_tensors(x, out, depth + 1)
    elif isinstance(obj, dict):
        for x in obj.values():
            _collect_tensors(x, out, depth + 1)
    elif hasattr(obj, "__dataclass_fields__"):
        for k in obj.__dataclass_fields__:
            _collect_tensors(getattr(obj, k, None), out, depth + 1)


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
