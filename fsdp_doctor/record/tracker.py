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
aside while training continues, removing everything it installed at once (``Doctor._remove``, the same
removal as at exit).
"""

from __future__ import annotations

import contextlib
import logging
import numbers
import os
import socket
import sys
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import __version__
from ..records import (
    ACCELERATE_SHARDER,
    AccelerateAccumulation,
    FORMAT_NAME,
    FORMAT_VERSION,
    LIGHTNING_DRIVER,
    TORCHTITAN_SHARDER,
    TORCHTUNE_DRIVER,
    TRANSFORMERS_SHARDER,
    End,
    Header,
    Manifest,
    ProfileWindow,
    RunConfig,
    StepRecord,
    stream_name,
)
from ..store.layout import group_dir, write_probe
from ..store.writer import RunDirTaken, claim_run_dir, write_manifest
from .options import WatchOptions
from .profiling import ProfilerWindows, profiler_recording, resolve_profile
from .run_device import run_device, share_from_rank0, watching_ranks
from .sinks import FailurePolicy, Sinks
from .config_snapshot import another_models_optimizer, config_snapshot, unseen_note, untrained_rows
from .compile_time import CompileClock, RecompileLimitTap
from .dcp_saves import DcpSaveTap
from .optimizers import (OptimizerParts, has_step_hooks, held_optimizers, in_backward_optimizers, optimizer_reads,
                         wrapped_optimizers)
from .torchtune import Recipe, torchtune_recipe
from .throughput import FlopCounter
from . import fsdp2 as F2
from .hooks import StepTimer, _ms
from .units import (MIXED_DTENSOR, Unit, compile_blocker, find_units, method_call, naming_root, outside_unit_call,
                    unmanaged_params)

log = logging.getLogger("fsdp_doctor")
_WATCHED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
# the FLOP count moves on to the next step at most this many times when the counted step also evaluated
FLOPS_RECOUNTS = 4
# trainable parameters outside the optimizer: how many are sampled, how many values each, and the step (0-based)
# whose end compares them with the first step's
UNTRAINED_SAMPLES, UNTRAINED_VALUES, LATE_CHECK_STEP = 8, 16, 2
_now = time.perf_counter_ns


def _wall_at(t: int) -> int:
    """The wall clock (``time.time_ns``) at ``t`` (``_now``'s): read between two reads of ``_now``, taken again
    where the process was preempted between them (their gap over 0.1 ms). Read once, a preemption between the two
    clocks' reads moved a step's start by its length: under a loaded host a step's start plus its wall time ran past
    the next step's start by more than 2 ms (tests/test_verdict.py, beside a CI run)."""
    for _ in range(4):
        a = _now()
        wall = time.time_ns()
        b = _now()
        if b - a < 100_000:
            break
    return wall - ((a + b) // 2 - t)


def _accelerate_shared(cls: str) -> dict:
    """The shared state of accelerate's ``accelerate.state.<cls>`` (AcceleratorState, GradientState), read without
    creating one (constructing it would initialise accelerate's state where there is none); {} where there is none."""
    state = getattr(getattr(sys.modules.get("accelerate.state"), cls, None), "_shared_state", None)
    return state if isinstance(state, dict) else {}


def _plugin_state_dict_type() -> str | None:
    """The state_dict_type of accelerate's FSDP2 plugin (how its save_state and a Trainer's checkpoints save the
    model: "FULL_STATE_DICT", "SHARDED_STATE_DICT"), read from its shared state without creating one; None: none."""
    kind = getattr(_accelerate_shared("AcceleratorState").get("fsdp_plugin"), "state_dict_type", None)
    return None if kind is None else str(getattr(kind, "name", kind))


def _accelerate_sync() -> bool:
    """accelerate's GradientState.sync_gradients (False inside ``accelerator.accumulate(model)`` on a micro-batch
    before the last of its gradient_accumulation_steps), read from its shared state; True where there is none."""
    return _accelerate_shared("GradientState").get("sync_gradients", True) is not False


def _accelerate_accumulation(unsynced: int) -> AccelerateAccumulation | None:
    """accelerate's gradient accumulation settings (its GradientState's plugin kwargs, AcceleratorState's distributed
    type), read from their shared state without creating one, with ``unsynced``, the backwards seen begun with its
    sync_gradients off; None: no GradientState."""
    grad = _accelerate_shared("GradientState")
    if not grad:
        return None
    kw = grad.get("plugin_kwargs") or {}
    kind = _accelerate_shared("AcceleratorState").get("distributed_type")
    return AccelerateAccumulation(num_steps=int(kw.get("num_steps", 1) or 1),
                                  sync_each_batch=bool(kw.get("sync_each_batch", False)),
                                  distributed_type="" if kind is None else str(getattr(kind, "name", kind)),
                                  unsynced_backwards=unsynced)


class SaveMark:
    """What ``Doctor.checkpointing()`` yields: ``saved`` False drops the call (it saved nothing)."""

    saved = True


class WatchError(RuntimeError):
    """``watch`` refused to start; the message is one sentence for the user."""


def subset_note(world_ranks: list[int], world: int) -> str:
    """The run's note where only some ranks of the process group's ``world`` train (``RunConfig.world_ranks``)."""
    n = len(world_ranks)
    if n == 1:  # (a trial's one-rank group read "ranks 0 of the 3 ... numbered 0-0 here")
        return (f"rank {world_ranks[0]} of the {world} in the process group trains the watched model (its device "
                "mesh), numbered 0 here")
    return (f"ranks {', '.join(map(str, world_ranks))} of the {world} in the process group train the watched model "
            f"(its device mesh), numbered 0-{n - 1} here in that order")


class Doctor:
    """Records one rank of an FSDP2 training run. Create it with :func:`fsdp_doctor.watch`."""

    def __init__(self, model: nn.Module, optimizer=None, options: WatchOptions | None = None, **kwargs):
        opts = options if options is not None else WatchOptions.from_kwargs(kwargs)
        self.options = opts
        self.model = model
        self._entered = False  # (doctor.step() on a doctor never entered says so once: it records nothing)
        self._inside = False  # between __enter__ and __exit__ (a second entry of the same object is refused)
        self._watching = False  # the model is in _WATCHED by this doctor's entry
        # (forward, backward, optimizer step) counts at the doctor.step() call that ended the last step (None: a forward
        # ended it), and the calls repeated since with nothing run (StepRecord.repeated_calls)
        self._closed_by_call: tuple | None = None
        self._repeated = 0
        self._said_repeated = False
        self.optimizer = optimizer  # the torch Optimizer itself, once unwrapped at entry (its step hooks time it)
        self._stepped: list = []  # the optimizers whose steps are timed and end a step (several: Muon beside AdamW)
        self._reads = optimizer  # what its state and groups are read from (optimizer_reads)
        self._in_backward: list | None = None  # per-parameter optimizers stepped in the backward (no step hooks)
        self.out_dir = Path(opts.out_dir)
        self.count_flops = opts.counts_flops
        self._profile_kwargs = resolve_profile(opts.profile)
        self._timer = StepTimer(self._fail)  # the hooks around FSDP's, their marks and timings
        if getattr(model, "_is_accelerate_prepared", False):  # accumulate()'s switch, read per backward
            self._timer.accelerate_sync = _accelerate_sync
        self.active = False
        self.steps_done = 0  # step records ended (optimizer steps, with an optimizer)
        self._failures = FailurePolicy(self._step_aside, self._safe_write)
        self._units: list[Unit] = []
        self._world_ranks: list[int] | None = None  # the global ranks that train, where not all of them do
        self._consistency: str | None = None  # the first step's consistency check ("" when it passed)
        self._sinks: Sinks | None = None  # the record stream and the live TensorBoard writer
        self._profiler: ProfilerWindows | None = None
        self._memory = None
        self._flops: FlopCounter | None = None
        self.flops_per_step: float | None = None  # model FLOPs
        self.hardware_flops_per_step: float | None = None  # model FLOPs + checkpointing's recompute
        self.flops_input_elements: int | None = None  # the counted step's training forwards' input elements
        self._config_written = False
        self._gpu = None  # GpuTimeline on CUDA
        self._micro = 0  # doctor.step() calls since the last step record (micro-batches of one optimizer step)
        self._tokens: int | None = None  # the tokens those calls gave (doctor.step(tokens=N))
        self._bad_tokens = False  # a tokens= value that is no count was said
        self._forwards_at_call = -1  # the timer's training forwards at the last doctor.step() call
        self._backwards_at_call = 0  # the timer's backward passes at the last doctor.step() call
        self._skipped = False  # the step being recorded ran a backward and dropped its gradients without an update
        self._opt_steps_recorded = 0  # the timer's optimizer-step count at the last step record
        self._per_call = False  # the optimizer does not step: every doctor.step() is a step
        self.driver: str | None = None  # what runs the loop when not the user's code (RunConfig.driver)
        self.trainer_args: str | None = None  # a Hugging Face Trainer's arguments' class (RunConfig.trainer_args)
        self.recipe: Recipe | None = None  # the torchtune recipe that runs it (RunConfig.recipe: its file)
        # the step's checkpoint saves (start, end ns, asynchronous: None where not known): checkpointing(), the
        # drivers' saves and torch.distributed.checkpoint's own (its save and async_save: DcpSaveTap)
        self._saves: list[tuple[int, int, bool | None]] = []
        self._dcp_tap = None
        self._limit_tap = None  # Dynamo's recompile limit hit (its warning: RecompileLimitTap)

    # ------------------------------------------------------------------ entry / exit
    def __enter__(self) -> "Doctor":
        """Starts recording. Misuse (no FSDP2 unit, an unwritable out_dir, a second watch of the model,
        an object that is no optimizer) is refused with one sentence (:class:`WatchError`); a torch too old for the
        doctor, and any other exception here, make it step aside with one log line while training goes on."""
        if self._inside:  # (refused before anything is touched: the refusal's _remove() would end the outer session,
            # which then recorded nothing past its header: a new-user trial's `with w:` inside `with w as doctor:`)
            raise WatchError("fsdp_doctor.watch: this watch() is already entered (a `with` of it inside its own); "
                             "the first entry goes on recording")
        self._entered = self._inside = True
        if (reason := F2.unsupported_reason()) is not None:  # (the cluster's torch, not a mistake in the call: a
            # WatchError here ended the user's job before its first step, a new-user trial on an older torch)
            if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
                log.warning("fsdp_doctor: %s; watch() records nothing and training goes on", reason)
            return self
        try:
            if (inside := in_backward_optimizers(self.optimizer)) is not None:
                # (optimizer_in_bwd: no step of an optimizer ends a step, each doctor.step() call does)
                self.optimizer, self._in_backward = None, inside
                self._reads = OptimizerParts(inside, in_backward=True)
            else:
                self._stepped = unwrap_optimizers(self.optimizer)
                self.optimizer = self._stepped[0] if self._stepped else None
                self._reads = optimizer_reads(self._stepped)
            self._check_entry()
            self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            self.world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
            # only some ranks train the model (its mesh leaves the others out): the run is theirs, numbered 0..n-1
            self._world_ranks = watching_ranks(self._units)
            if self._world_ranks is not None:
                self.rank, self.world_size = self._world_ranks.index(self.rank), len(self._world_ranks)
                self._group_dir()
            self.run_id = self._claim_out_dir()
            self._start()
        except WatchError:
            self._inside = False  # (no __exit__ follows a refused __enter__)
            self._remove()
            raise
        except Exception as e:  # noqa: BLE001  (never a dead run: the doctor steps aside, training goes on)
            self._fail("start", e)
        return self

    def _start(self) -> None:
        self.started_ns = time.time_ns()
        self._sinks = Sinks(self.out_dir, self.rank)
        self._sinks.write(
            Header(rank=self.rank, format=FORMAT_NAME, version=FORMAT_VERSION, world_size=self.world_size,
                   pid=os.getpid(), host=socket.gethostname(),
                   started_ns=self.started_ns, doctor_version=__version__, run_id=self.run_id)
        )
        if self.rank == 0:
            write_manifest(
                self.out_dir,
                Manifest(format=FORMAT_NAME, version=FORMAT_VERSION, world_size=self.world_size,
                         started_ns=self.started_ns, doctor_version=__version__,
                         streams=[stream_name(r) for r in range(self.world_size)], command=list(sys.argv),
                         run_id=self.run_id),
            )
        _WATCHED.add(self.model)
        self._watching = True
        self._install()
        if self.options.tensorboard:
            try:
                self._sinks.open_tensorboard(self.rank)
            except Exception as e:  # noqa: BLE001  (no tensorboard installed, unwritable dir: record without it)
                self._fail("tensorboard", e, stop=False)
        self.device = run_device(self._units)  # the process group's device, a GPU under CPUOffloadPolicy
        if self.device.type == "cuda":
            from .gpu_timing import GpuTimeline

            self._gpu = self._timer.gpu = GpuTimeline(self.rank, len(self._units), [u.name for u in self._units])
        self._compiles = CompileClock()
        self.active = True
        if self._profile_kwargs is not None:
            try:
                ranks = self.options.profile_ranks  # (None: every rank records its windows)
                self._profiler = ProfilerWindows(self.out_dir, self.rank, self._profile_kwargs, self._on_trace_saved,
                                                 dry=ranks is not None and self.rank not in ranks)
                self._profiler.start()
            except Exception as e:  # noqa: BLE001
                self._profiler = None
                self._fail("profiler start", e, stop=False)
        self._begin_step(_now())

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._inside = False
        was_active = self.active
        if was_active and exc_type is None and self._micro and self._timer.optimizer_steps != self._opt_steps_recorded:
            # doctor.step() per micro-batch, before optimizer.step(): each step ends where the next one's first forward
            # starts, and the last one at its optimizer step (it was lost: 7 steps recorded of 8, a test of tokens)
            try:
                self._end_step(self._timer.last_optimizer_end_ns or _now())
                self.steps_done += 1
            except Exception as e:  # noqa: BLE001
                self._fail("step", e)
        try:
            self._remove(clean=exc_type is None)
            if self._gpu is not None and was_active:
                try:
                    self._sinks.write(*self._gpu.flush())
                except Exception as e:  # noqa: BLE001
                    self._fail("gpu timing", e, stop=False)
            if self._sinks is not None:
                if was_active:  # (on the loop's exception too: the run stopped there, not "still going")
                    # (its first line whole, up to 1,000 characters: cut at 200, torch's "Parameter ... is shared
                    # ... to place them in the same FSDP" read "in the same FSD", a new-user trial)
                    why = "" if exc_type is None else f"{exc_type.__name__}: {exc}".splitlines()[0][:1000].rstrip(": ")
                    try:  # (read at the exit, not in a step: a run's lingering garbage is collected to tell)
                        others = F2.other_fsdp_units(self.model) or 0
                    except Exception:  # noqa: BLE001
                        others = 0
                    hint = ""
                    if exc_type is not None and MIXED_DTENSOR in str(exc):
                        try:  # (a module of a unit called outside its unit's forward, or a method in place of the
                            # unit's forward: which, and the fix)
                            root = naming_root(self.model)
                            hint = outside_unit_call(self._units, root, tb) or method_call(self._units, root, tb)
                        except Exception:  # noqa: BLE001 - the user's exception goes on unexplained
                            hint = ""
                        if hint and self.rank == 0:
                            log.warning("fsdp_doctor: %s", hint)
                    self._safe_write(End(rank=self.rank, steps=self.steps_done, ended_ns=time.time_ns(),
                                         exception=why, exception_hint=hint, other_fsdp_units=others,
                                         repeated_calls=self._repeated))
                    if not self.steps_done and exc_type is None and self.rank == 0:
                        ran = self._timer.optimizer_steps
                        log.warning("fsdp_doctor: watch() ended without a doctor.step() call%s: nothing was "
                                    "recorded; call doctor.step() once per optimizer step inside the with block",
                                    f" ({ran} optimizer steps ran)" if ran else "")
                self._sinks.close()
        except Exception as e:  # noqa: BLE001
            log.warning("fsdp_doctor: closing the record stream failed (%s: %s)", type(e).__name__, e)
        return False  # never swallow the user's exception

    def _remove(self, clean: bool = False) -> None:
        """Removes everything of the doctor from the model, the optimizer, torch and the loggers, at once: the
        profiler window, the FLOP counter, every hook, the FSDP logger tap, the gc callback, the handlers on
        torch.distributed.checkpoint's logger and Dynamo's, the memory probe's saved-tensor hooks, the live
        TensorBoard writer.
        Idempotent; each part is guarded so that one failing part leaves none of the others behind."""
        self.active = False
        self._untrained = None  # (references to parameters, held until the third step's check)
        parts = (("profiler stop", lambda: self._profiler and self._profiler.stop(clean)),
                 ("flop counter", lambda: self._flops and self._flops.abort()),
                 ("hooks", self._timer.uninstall),
                 ("checkpoint save tap", lambda: self._dcp_tap and self._dcp_tap.uninstall()),
                 ("recompile limit tap", lambda: self._limit_tap and self._limit_tap.uninstall()),
                 ("memory probe", lambda: self._memory and self._memory.detach()),
                 ("tensorboard close", lambda: self._sinks and self._sinks.close_tensorboard()))
        for where, fn in parts:
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                log.warning("fsdp_doctor: removing its %s failed (%s: %s)", where, type(e).__name__, e)
        self._profiler = self._flops = self._memory = self._timer.marks = self._timer.step_boundary = None
        if self._watching:  # (a refused watch() of a watched model leaves the other session's mark: a second watch
            # after one refusal was accepted, two doctors on one model, a new-user trial)
            self._watching = False
            with contextlib.suppress(TypeError):  # (a model that takes no weak reference was refused at entry)
                _WATCHED.discard(self.model)

    def _check_entry(self) -> None:
        if self.model in _WATCHED:
            raise WatchError("fsdp_doctor.watch: this model is already being watched; exit the first watch() before starting another")
        units = find_units(self.model)
        if not units:
            raise WatchError(f"fsdp_doctor.watch: {type(self.model).__name__} has no FSDP2 unit; " + (
                "accelerate shards it with FSDP: call watch() after accelerator.prepare(...), on the model and "
                "optimizer it returns" if _accelerate_fsdp() else
                "apply torch.distributed.fsdp.fully_shard to its blocks and to the model before watching it"))
        self._units = units
        self._writable_out_dir()

    def _writable_out_dir(self) -> None:
        """``out_dir`` made and written to once (layout.write_probe), or WatchError naming it."""
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            e = write_probe(self.out_dir)
        except OSError as err:
            e = err
        if e is not None:
            raise WatchError(f"fsdp_doctor.watch: cannot write to out_dir {self.out_dir} ({e.strerror or e})") from None

    def _group_dir(self) -> None:
        """Where only some ranks train, their run goes in a folder of its own below ``out_dir`` (layout.group_dir):
        another group of the job, numbering its ranks 0..n-1 too, cannot overwrite it (it cannot be asked: the
        groups share no collective)."""
        self.out_dir = self.out_dir / group_dir(self._world_ranks)
        self._writable_out_dir()
        if self.rank == 0:
            log.warning("fsdp_doctor: %s: its run is recorded in %s",
                        subset_note(self._world_ranks, dist.get_world_size()), self.out_dir)

    def _claim_out_dir(self) -> str:
        """A run directory holds one run: an earlier run's records there are moved aside below it (or with
        ``overwrite`` removed: ``store.writer.claim_run_dir``), said in one line; the ranks take rank 0's run id and
        verdict before any of them writes, through the job's store (run_device.share_from_rank0: no collective, so a
        watch() on some ranks only leaves the others' collectives alone)."""
        share = share_from_rank0(self.rank, self._world_ranks) if self.world_size > 1 else None
        try:
            claim = claim_run_dir(self.out_dir, self.rank, overwrite=self.options.overwrite, share=share)
        except RunDirTaken as e:
            raise WatchError(f"fsdp_doctor.watch: {e}") from None
        if self.rank == 0 and claim.kept is not None:
            log.warning("fsdp_doctor: %s held an earlier run's records: moved to %s%s (fsdp-doctor analyze reads "
                        "it there); this run records in %s", self.out_dir, claim.kept,
                        ", though overwrite=True: this process restarts the job (TORCHELASTIC_RESTART_COUNT), and "
                        "they say how the attempt before ended" if self.options.overwrite else "", self.out_dir)
        elif self.rank == 0 and claim.removed:
            log.warning("fsdp_doctor: %s held an earlier run's records: removed (overwrite=True)", self.out_dir)
        return claim.run_id

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

    def _traced(self, step: int) -> bool:
        """Whether ``step`` falls inside a profiler window (its trace is recorded)."""
        # (on a rank outside profile_ranks too: its window steps are the traced ranks', the memory counted in full
        # after them as theirs is, at the same steps)
        return self._profiler is not None and not self._profiler.stepped_aside and self._profiler.is_profiled(step)

    def _install(self) -> None:
        if said := another_models_optimizer(self._reads, self.model, self._units):  # (a warning: training goes on)
            log.warning("fsdp_doctor: %s", said)
        self._timer.install(self._units, self.model, self._stepped)
        if self._in_backward:
            self._timer.install_in_backward(self._in_backward)
        self._timer.step_boundary = self._forward_after_optimizer
        self._init_memory()
        self._timer.marks = self._memory
        def tap_failed(where: str, e: BaseException) -> None:  # (a tap's own error: recording goes on without it)
            self._fail(where, e, stop=False)

        self._dcp_tap = DcpSaveTap(self.saved_since, tap_failed)
        self._dcp_tap.install()
        self._limit_tap = RecompileLimitTap(self._compiled_call_unit, tap_failed)
        self._limit_tap.install()

    def _compiled_call_unit(self) -> str | None:
        """The name of the unit whose compiled call is running (a unit compiled in place; None: none is)."""
        idx = self._timer.in_compiled_call
        return self._units[idx].name if idx is not None else None

    def _init_memory(self) -> None:
        if not self.options.memory:
            return
        try:
            from .memory import MemoryProbe
        except ImportError:
            return
        try:
            self._memory = MemoryProbe(self.model, self._reads, self._units, self.options.memory)
            self._memory.traced = self._traced
        except Exception as e:  # noqa: BLE001
            self._memory = None
            self._fail("memory probe", e, stop=False)

    # ------------------------------------------------------------------ steps
    def _begin_step(self, t: int) -> None:
        self._step_t0 = t
        # a profiler recording as the step starts or ends (the user's, or their trainer's: the doctor's own windows
        # are marked anyway): its cost, and the trace export of a session that stops within the step, are that
        # profiler's, not the loop's, so the step is marked profiled and left out of the statistics
        self._recorded_at_start = profiler_recording()
        self._step_wall_ns = _wall_at(t)  # the wall clock at ``t`` (a profiler export ran since)
        self._timer.begin_step()

    #: doctor.step() calls without an optimizer step after which each call is taken for a step of its own
    MICRO_BATCH_LIMIT = 64

    def step(self, tokens: int | None = None) -> None:
        """Marks the end of one training step: call it after ``optimizer.step()``. One step is one optimizer
        step: calls between two steps of the watched optimizer (``doctor.step()`` per micro-batch under
        gradient accumulation) are micro-batches of one step, recorded together (``StepRecord.micro_batches``).
        A call after a backward whose gradients the loop dropped (zero_grad) with no optimizer step, by the call or
        by the next forward, ends a step of its own whose update was skipped (``StepRecord.optimizer_skipped``: a
        NaN/inf guard, GradScaler's skipped step): accumulation keeps its gradients to the optimizer step.

        ``tokens``: the tokens this rank trained on since the last call (its batch's, padding left out as you count
        them), where they vary from step to step (sequence packing, token budgets, the epoch's short last batch):
        tokens/s then comes from them, step by step, rather than from watch()'s constant ``tokens_per_step``."""
        t_end = _now()
        if not self.active:
            if not self._entered:  # watch() called without `with` (a new-user trial got no records and no word)
                self._entered = True
                log.warning("fsdp_doctor: doctor.step() on a watch() that was never entered records nothing: use "
                            "`with fsdp_doctor.watch(model, optimizer, out_dir=...) as doctor:` around the loop")
            return
        # a call with nothing run since the call that ended the last step (no forward, backward or optimizer step) is
        # that call repeated (a new-user trial called doctor.step() twice per step: 10 of its 20 steps were empty ones
        # read as skipped optimizer steps, and every step's number doubled), not a step
        seen = (self._timer.train_forwards, self._timer.backwards, self._timer.optimizer_steps)
        if seen == self._closed_by_call and self.optimizer is not None:
            self._repeated += 1
            if not self._said_repeated:
                self._said_repeated = True
                log.warning("fsdp_doctor: doctor.step() called again with nothing run since the last call (no "
                            "forward, backward or optimizer step): not a step; call it once per optimizer step")
            return
        if tokens is not None:  # (a value it cannot count is said once and left out: training goes on)
            if isinstance(tokens, bool) or not isinstance(tokens, numbers.Integral) or tokens < 0:
                if not self._bad_tokens:
                    self._bad_tokens = True
                    log.warning("fsdp_doctor: doctor.step(tokens=%r): tokens is a count, an int >= 0 counted on "
                                "the host (a CUDA tensor's .item() would wait for the GPU); not recorded", tokens)
            else:
                self._tokens = (self._tokens or 0) + int(tokens)
        # a call with no forward since the last (doctor.step() after each micro-batch and again after
        # optimizer.step(): 5 calls for 4 micro-batches read "5 micro-batches", a new-user trial) is no micro-batch
        forwards = self._timer.train_forwards
        if not self._micro or not forwards or forwards != self._forwards_at_call:  # (none seen: a compiled frame)
            self._micro += 1
        self._forwards_at_call = forwards
        if self._is_micro_batch():
            backwards, self._backwards_at_call = self._backwards_at_call, self._timer.backwards
            # (sync off: gradients not reduced yet; or held unreduced where the loop's sync was turned back on
            # before this call: accelerate's no_sync restores it in a finally, and the Trainer's and accumulate()'s
            # micro-batches read as skipped optimizer steps, 8 of 16: a new-user trial)
            if backwards == self._timer.backwards or not self._syncing() or self._unreduced():
                return
            if not self._gradients_dropped():
                self._timer.zeroed_check = True  # zero_grad at the top of the loop: read at the next forward
                return
            self._skipped = True
        self._close_step(t_end)
        self._closed_by_call = seen

    def _syncing(self) -> bool:
        """Whether every unit reduce-scatters its gradients in backward (FSDP2's gradient sync on): a backward then
        leaves gradients on the sharded parameters, which gradient accumulation keeps to the optimizer step."""
        return self._timer.gradient_sync()

    def _unreduced(self) -> bool:
        """Whether a unit holds gradients it has not reduced yet (unsharded or accumulated ones: a micro-batch's
        backward under gradient accumulation without sync): attribute reads only."""
        return any(F2.holds_unreduced_grad(fp) for u in self._units for pg in u.param_groups
                   for fp in F2.group_params(pg))

    def _gradients_dropped(self) -> bool:
        """Whether no parameter of the watched optimizer holds a gradient: the loop zeroed them (zero_grad's
        set_to_none, the default) without an optimizer step since they were reduced. Gradient accumulation never
        does: its micro-batches add up into them. (Zeroed in place, set_to_none=False, they cannot be told from
        accumulated ones without reading them: such a skipped step stays a micro-batch of the next.)"""
        return self._reads is not None and not any(p.grad is not None for g in self._reads.param_groups
                                                   for p in g["params"])

    def _forward_after_optimizer(self, t: int) -> None:
        """A training forward starts after an optimizer.step() that no doctor.step() has ended: where doctor.step()
        is called after each micro-batch's backward, the last one's call comes before optimizer.step(), and the next
        call after the next step's first micro-batch. Ended there, the step held that micro-batch, and its time from
        the optimizer step to that call read as time outside the model (a new-user trial: jitter.data_wait's false
        warning, 23% of the step, and memory.grads_kept on gradients the loop freed). The step ends here, where the
        next one's first forward starts; a doctor.step() called after optimizer.step() ended it already."""
        if not self.active or not self._micro:
            return
        if self._timer.optimizer_steps != self._opt_steps_recorded:
            self._close_step(t)
        elif self._timer.zeroed_check:
            # the last doctor.step() call came after a backward, no optimizer step since, and the gradients were
            # dropped before this forward (zero_grad at the loop's top): that call ended a skipped step; it ends here,
            # as one ended by an optimizer step does
            self._timer.zeroed_check = False
            if self._gradients_dropped():
                self._skipped = True
                self._close_step(t)

    def _close_step(self, t_end: int) -> None:
        try:
            self._end_step(t_end)
        except Exception as e:  # noqa: BLE001
            self._fail("step", e)
        self.steps_done += 1
        self._micro = self._repeated = 0
        self._closed_by_call = None  # (step() sets it: a step a forward ended is not repeated by the next call)
        self._tokens = None
        self._skipped = self._timer.zeroed_check = False
        self._opt_steps_recorded = self._timer.optimizer_steps
        if self.active:
            # the next step starts where this one ended: what the doctor did since (its records, the memory
            # figures, a trace export) is in the next step's wall as its doctor_ms, not as the user's time outside
            self._own_ns = _now() - t_end
            self._begin_step(t_end)

    @contextlib.contextmanager
    def checkpointing(self):
        """Marks a checkpoint save, the whole of it and on every rank (a full state dict is gathered by every rank,
        and the others wait for the one that writes)::

            with doctor.checkpointing():
                full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
                if rank == 0:
                    torch.save(full, path)
                dist.barrier()

        Time around a mark in the save step's time outside the model, at least as long as the mark's, is counted as the
        save's too (checkpoint.blocking says so). Its time is recorded
        as the step's ``checkpoint_ms``, apart from the time outside the model, so that a save every N steps reads
        as a save, not as the loop waiting for data; the analyses leave such steps out of the step statistics as
        they do evaluation steps. The save itself runs as it would without the doctor. torch.distributed.checkpoint's
        ``save`` and ``async_save`` need no mark: the doctor reads them from DCP's log (one inside a mark counts
        once). It yields a mark whose ``saved`` the caller may set to False when the call turned out to save nothing
        (a checkpointer called every step that saves every N): that call is then not counted."""
        mark = SaveMark()
        t0 = _now()
        try:
            yield mark
        finally:
            if mark.saved:
                self.saved_since(t0)

    def saved_since(self, t0: int, is_async: bool | None = None) -> None:
        """A checkpoint save that began at ``t0`` (a ``time.perf_counter_ns()`` reading) has just ended: recorded as
        ``checkpointing()`` records one, for a driver that sees the end of a save but not its start (the Hugging
        Face Trainer's ``on_save``, after its last event before the save), and for torch.distributed.checkpoint's
        saves (DcpSaveTap: ``is_async``, whether it was an ``async_save``; None: not known)."""
        if self.active:
            self._saves.append((t0, _now(), is_async))

    def _is_micro_batch(self) -> bool:
        """Whether this doctor.step() call ends a micro-batch rather than an optimizer step."""
        if self.optimizer is None or self._per_call or self._timer.optimizer_steps != self._opt_steps_recorded:
            return False
        if self._micro < self.MICRO_BATCH_LIMIT:
            return True
        self._per_call = True
        log.warning("fsdp_doctor: %d doctor.step() calls without a step of the optimizer given to watch(); each "
                    "call is recorded as a step from now on", self._micro)
        return False

    def _end_step(self, t_end: int) -> None:
        step = self.steps_done
        # the device's step ends here, where the host's does: what the doctor does from now on (its figures, the
        # records, a profiler step) lies between this end event and the next step's start event, the device's
        # idle_before_ms, as the host counts it in doctor_ms and not in its time outside the model
        done = self._gpu.end_step(step) if self._gpu is not None else []
        # the model's forward ran in a compiled frame the doctor was not given, seen in this step's FSDP2 logs (said
        # before the first config is written, in it); the units timed from them said again where more were seen
        seen = len(self._timer.frame_unseen)
        if not self._frame_unseen and self._timer.forward_unseen:
            self._frame_unseen, self._unseen_from = True, step
            log.warning("fsdp_doctor: %s", unseen_note(True, step))
        if not self._config_written:
            self._write_config()
        elif seen != self._unseen_said:
            self._safe_write(self._config())
        self._unseen_said = seen
        wall = _ms(t_end - self._step_t0)
        tm = self._timer.timings()
        if not self._frame_unseen and _forward_unseen(tm):  # (FSDP2 logged no forward there: the units read unknown)
            self._frame_unseen, self._unseen_from = True, step
            log.warning("fsdp_doctor: %s", unseen_note(False, step))
            self._safe_write(self._config())
        profiled = self._profiler is not None and self._profiler.is_profiled(step)
        profiled = profiled or self._spill_profiled or self._flops is not None
        profiled = profiled or self._recorded_at_start or profiler_recording()
        self._spill_profiled = False
        mem = self._memory.step_end(step) if self._memory is not None else None
        compiles, compile_ms = self._compiles.take()
        breaks, disable_breaks = self._compiles.breaks()
        own_ms = _ms(self._own_ns)
        saves, self._saves = merged_saves(self._saves, tm.first_forward_ns or 0, tm.last_optimizer_end_ns or 0), []
        save_ms = _ms(sum(b - a for a, b, _ in saves))
        between = None
        if tm.first_forward_ns and tm.last_optimizer_end_ns and tm.last_optimizer_end_ns <= t_end:
            # (less the saves and the forwards without gradients there: before the first forward or after the last
            # optimizer step)
            in_window = _ms(sum(b - a for a, b, _ in saves
                                if b <= tm.first_forward_ns or a >= tm.last_optimizer_end_ns))
            between = max(0.0, round(_ms(tm.first_forward_ns - self._step_t0) - own_ms
                                     + _ms(t_end - tm.last_optimizer_end_ns) - in_window - tm.no_grad_between_ms
                                     + tm.micro_gap_ms, 3))
        rec = StepRecord(
            rank=self.rank, step=step, start_ns=self._step_wall_ns, wall_ms=wall,
            forward_ms=tm.forward_ms, backward_ms=tm.backward_ms, optimizer_ms=tm.optimizer_ms,
            outside_ms=max(0.0, round(wall - tm.forward_ms - tm.backward_ms - tm.optimizer_ms - tm.no_grad_ms
                                      - own_ms - save_ms, 3)),
            gc_ms=tm.gc_ms, gc_count=tm.gc_count, gc_full_ms=tm.gc_full_ms, gc_collected=tm.gc_collected,
            gc_disabled_count=tm.gc_disabled_count, gc_disabled_ms=tm.gc_disabled_ms,
            profiled=profiled, units=tm.units, memory=mem,
            micro_batches=self._micro, backwards=tm.backwards, synced_backwards=tm.synced_backwards,
            optimizer_skipped=self._skipped,
            repeated_calls=self._repeated,
            no_grad_ms=tm.no_grad_ms, no_grad_forwards=tm.no_grad_forwards,
            no_grad_gather_ms=tm.no_grad_gather_ms if tm.no_grad_forwards else None,
            no_grad_gathers=tm.no_grad_gathers if tm.no_grad_forwards else None,
            no_grad_units=tm.no_grad_units if tm.no_grad_forwards else None,
            autograd_eval_forwards=tm.autograd_eval_forwards, doctor_ms=own_ms, between_ms=between,
            checkpoint_ms=round(save_ms, 3), checkpoints=len(saves), async_saves=sum(k is True for _, _, k in saves),
            backward_after_optimizer=tm.backward_after_optimizer, other_models_ms=tm.other_models_ms,
            compiles=compiles, compile_ms=round(min(compile_ms, wall), 3),
            graph_breaks=breaks, disable_breaks=disable_breaks,
            recompile_limits=self._limit_tap.take() if self._limit_tap is not None else [],
            unit_compiles=tm.unit_compiles or {},
            input_elements=tm.input_elements or None, input_shape=tm.input_shape, tokens=self._tokens,
        )
        self._sinks.on_step(rec)
        if done:
            self._sinks.write(*done)
        if step == LATE_CHECK_STEP and self._config_written:
            self._late_check()
        evaluated = bool(tm.no_grad_forwards)  # the step also ran the model without gradients
        # ... as every step before it did: a loop that evaluates (generates) in every step, where moving the FLOP
        # count or the profiler window on to the next step only finds another (a new-user trial's RL loop: steps
        # 1-9 all set aside, three windows dropped at 5.5-8.4 s of the doctor's time each, no trace kept)
        every = evaluated and self._evaluated_always
        self._evaluated_always = every
        self._flops_tick(step, evaluated and not every, tm.input_elements)
        if self._profiler is not None:
            try:
                if self._profiler.step(evaluated, retake=not every):
                    self._spill_profiled = True  # the trace export ran inside the next step's wall time
            except Exception as e:  # noqa: BLE001
                self._profiler = None
                self._fail("profiler", e, stop=False)

    _spill_profiled = False
    _untrained = None  # [(parameter, its first values)] of trainable parameters outside the optimizer, until checked
    _frame_unseen = False  # the model's forward runs in a compiled frame the doctor was not given (FRAME_UNSEEN)
    _unseen_from = 0  # ... seen first in this step
    _unseen_said = 0  # the units timed from FSDP2's logs there when the config was last written
    _own_ns = 0  # the doctor's own time at the last step's end (ns), inside the next step's wall
    _flops_recounts = 0
    _evaluated_always = True  # every step ended so far also ran the model without gradients

    def _flops_tick(self, step: int, evaluated: bool = False, elements: int = 0) -> None:
        """Counts FLOPs over one whole step (step 1, after FSDP's lazy init; see record/throughput.py). A counted
        step that also ran the model without gradients (evaluation, generation) counted those forwards too: the
        next step is counted instead, up to FLOPS_RECOUNTS times (then the count stands, the evaluation in it)."""
        if not self.count_flops:
            return
        recount = evaluated and self._flops is not None and self._flops_recounts < FLOPS_RECOUNTS
        if recount:
            self._flops.abort()
            self._flops_recounts += 1
        elif self._flops is not None:
            counted = self._flops.finish()
            self._flops = None
            if counted is not None:
                self.flops_per_step, self.hardware_flops_per_step = counted
                self.flops_input_elements = elements or None  # the batch they are of (variable shapes scale them)
            self._safe_write(self._config())
        if recount or (step == 0 and self.flops_per_step is None):
            # compiled code does not run under a dispatch mode (a fullgraph compile raises, flex_attention's
            # included): the report then uses the analytic estimate, and says so
            if (why := compile_blocker(self.model)) is not None:
                log.info("fsdp_doctor: FLOPs not counted (%s)", why.split(":")[0])
                return
            self._flops = FlopCounter()
            self._flops.start()

    def _write_config(self) -> None:
        self._config_written = True
        self._timer.index_labels()
        self._timer.end_child_watch()  # the first step has shown which submodules checkpointing re-runs
        cfg = self._config()
        self._sinks.write(cfg)
        if cfg.untrained is not None and cfg.untrained.tensors:  # a few values, to tell whether anything updates them
            self._untrained = [(p, _head(p)) for _, p in untrained_rows(self.model, self._reads, units=self._units)[:UNTRAINED_SAMPLES]]

    def _late_check(self) -> None:
        """At the third step's end, the config again where it has more to say: whether any trainable parameter
        outside the optimizer changed since the first step (another optimizer, or the loop, updates it); the
        tensors of state the optimizer holds after its steps (none: no gradient ever reached it), and the units
        whose gradient sync is off then."""
        samples, self._untrained = self._untrained, None
        # (after three steps the hooks saw: a step a GradScaler skipped, or an optimizer whose hooks never run, is none)
        # (stepped in the backward: a parameter's optimizer steps when its gradient comes, each step the loop ends)
        ran = self._timer.optimizer_steps if self._in_backward is None else self.steps_done + 1
        stepped = self._reads is not None and ran >= LATE_CHECK_STEP + 1
        state = len(getattr(self._reads, "state", None) or {}) if stepped else None
        sync_off = [u.name for u in self._units if any(not F2.reduce_grads(pg) for pg in u.param_groups)]
        unmanaged = [p for p in unmanaged_params(self.model, self._units) if p.requires_grad]
        if not samples and state != 0 and not sync_off and not unmanaged:
            return
        cfg = self._config()
        if samples and cfg.untrained is not None and cfg.untrained.tensors:
            cfg.untrained.changed = any(not torch.equal(_head(p), v) for p, v in samples)
        cfg.optimizer_state_tensors, cfg.gradient_sync_off = state, sync_off
        if unmanaged:  # (a few small tensors, once: a bias or a positional table passed as ignored_params)
            with torch.no_grad():
                cfg.unmanaged_digest = float(sum(p.detach().double().sum().item() for p in unmanaged))
        self._sinks.write(cfg)

    def _config(self) -> RunConfig:
        cfg, self._consistency = config_snapshot(
            self.model, self._reads, self._units, rank=self.rank, world_size=self.world_size, device=self.device,
            capacity_bytes=self.options.capacity_bytes, tokens_per_step=self.options.tokens_per_step,
            peak_tflops=self.options.peak_tflops, flops_per_step=self.flops_per_step,
            hardware_flops_per_step=self.hardware_flops_per_step, profile_schedule=getattr(self._profiler, "schedule", None),
            runtime_checkpointed=self._timer._runtime_ckpt,
            runtime_checkpointed_children=self._timer.checkpointed_children, consistency=self._consistency,
            timed_compiled=self._timer.timed_compiled, frame_unseen=self._frame_unseen,
            selective=self._timer.selective, fsdp_timed=self._timer.fsdp_timed, unseen=self._timer.frame_unseen,
            unseen_from=self._unseen_from, read_outside=self._timer.read_outside)
        cfg.driver, cfg.trainer_args = self.driver, self.trainer_args
        if self.recipe is not None:
            r = self.recipe
            cfg.recipe, cfg.recipe_reduced, cfg.recipe_scaled_by = r.file, r.reduced, r.scaled_by
            cfg.recipe_custom_layers, cfg.recipe_unread = r.custom_layers, r.unread
        if self._in_backward:
            cfg.optimizer_in_backward = len(self._in_backward)
            cfg.measured_notes.append(
                f"the optimizer steps inside the backward ({len(self._in_backward)} per-parameter optimizers): "
                "their steps' time is the optim column's, taken out of the backward's")
        elif self._reads is None and (hooked := _post_accumulate_hooked(self.model)):
            cfg.measured_notes.append(
                f"no optimizer was given to watch() and {hooked} parameter(s) have post-accumulate-grad hooks (an "
                "optimizer stepped inside the backward?): its state is not counted, nor its time; give watch() an "
                "object whose .optim_map maps each parameter's name to its optimizer (torchtune's "
                "self._optim_ckpt_wrapper)")
        chunks = getattr(self.model, "num_output_chunks", None)  # (torchtune's decoder: its output head per chunk)
        cfg.output_chunks = chunks if isinstance(chunks, int) and chunks > 1 else None
        if cfg.driver is None and (acc := _lightning_accumulate(self.model)) is not None:
            cfg.driver, cfg.lightning_accumulate = LIGHTNING_DRIVER, acc
        if self._world_ranks is not None:
            cfg.world_ranks = list(self._world_ranks)
            cfg.measured_notes.append(subset_note(self._world_ranks, dist.get_world_size()))
        cfg.flops_input_elements = self.flops_input_elements
        # accelerate marks what its prepare() returned (the Trainer's model as well)
        cfg.sharded_by = ACCELERATE_SHARDER if getattr(self.model, "_is_accelerate_prepared", False) else None
        if cfg.sharded_by is not None:
            cfg.plugin_state_dict_type = _plugin_state_dict_type()
            cfg.accelerate = _accelerate_accumulation(self._timer.accelerate_unsynced)
        # a torchtitan model (fully_shard subclasses its class: FSDPLlama3Model)
        if cfg.sharded_by is None and any(c.__module__.split(".")[0] == TORCHTITAN_SHARDER
                                          for c in type(self.model).__mro__):
            cfg.sharded_by, cfg.sharder_version = TORCHTITAN_SHARDER, _version(TORCHTITAN_SHARDER)
        # transformers' own FSDP2 (from_pretrained with a DistributedConfig) marks the model it sharded
        if cfg.sharded_by is None and getattr(self.model, "_is_fsdp_managed_module", False) and getattr(
                getattr(self.model, "config", None), "distributed_config", None) is not None:
            cfg.sharded_by, cfg.sharder_version = TRANSFORMERS_SHARDER, _version(TRANSFORMERS_SHARDER)
        return cfg

    def _on_trace_saved(self, steps: list[int], rel_path: str, lost: str = "") -> None:
        self._sinks.on_profile(ProfileWindow(rank=self.rank, steps=steps, path=rel_path, lost=lost))

    # ------------------------------------------------------------------ failure handling
    def _safe_write(self, rec) -> None:
        if self._sinks is not None:
            self._sinks.safe_write(rec)

    def _step_aside(self) -> None:
        self._remove()

    def _fail(self, where: str, exc: BaseException, stop: bool = True) -> None:
        """Reports a failure inside the doctor once and, if ``stop``, steps aside for the rest of the run
        (the one failure policy: fsdp_doctor.record.sinks.FailurePolicy)."""
        self._failures.fail(where, exc, rank=getattr(self, "rank", "?"), step=self.steps_done, stop=stop)


def merged_saves(saves: list[tuple[int, int, bool | None]], model_start: int = 0,
                 model_end: int = 0) -> list[tuple[int, int, bool | None]]:
    """A step's saves (start, end, asynchronous) with those that overlap made one: torch.distributed.checkpoint's
    save inside ``doctor.checkpointing()``, or inside a driver's save, is one save, timed once; so are saves one
    after another with none of the model's work between them (``model_start``, ``model_end``: the step's first
    forward and its last optimizer step's end, ns; 0: unknown): accelerate's ``save_state`` saves the model and
    the optimizer with a torch.distributed.checkpoint call each, one checkpoint. Asynchronous where every save known
    inside is (None: none known)."""
    def apart(prev_end: int, start: int) -> bool:  # the model ran between the two
        return not (model_start and prev_end <= start <= model_start) and \
            not (model_end and model_end <= prev_end <= start)

    out: list[tuple[int, int, bool | None]] = []
    for a, b, k in sorted(saves, key=lambda x: x[0]):
        if out and (a < out[-1][1] or not apart(out[-1][1], a)):
            a0, b0, k0 = out[-1]
            out[-1] = (a0, max(b0, b), k if k0 is None else k0 if k is None else (k0 and k))
        else:
            out.append((a, b, k))
    return out


def _post_accumulate_hooked(model: nn.Module) -> int:
    """The model's parameters with post-accumulate-grad hooks (what steps an optimizer inside the backward: torchtune's
    register_optim_in_bwd_hooks), counted where no optimizer was given to watch()."""
    return sum(1 for p in model.parameters() if getattr(p, "_post_accumulate_grad_hooks", None))


def unwrap_optimizers(optimizer) -> list:
    """The torch Optimizers whose steps watch() times: none for None, the one an optimizer or a wrapper holds
    (unwrap_optimizer), each of a list or tuple of them (Muon beside AdamW, each stepped in the loop: a new-user
    trial's [adamw, sgd] had been refused) or of an object of the user's own that holds and steps them
    (wrapped_optimizers), each once."""
    if not isinstance(optimizer, (list, tuple)) and (held := wrapped_optimizers(optimizer)) is not None:
        optimizer = held  # (an object of the user's own that steps them: its step() steps each of them)
    if not isinstance(optimizer, (list, tuple)):
        return [] if (opt := unwrap_optimizer(optimizer)) is None else [opt]
    if not optimizer:
        raise WatchError(f"fsdp_doctor.watch: the optimizer argument is an empty {type(optimizer).__name__}; pass "
                         "the optimizer, a list of the optimizers the loop steps, or None")
    return list({id(o): o for o in map(unwrap_optimizer, optimizer) if o is not None}.values())


def unwrap_optimizer(optimizer):
    """The torch Optimizer inside a wrapper that exposes it as ``.optimizer`` (accelerate's AcceleratedOptimizer,
    which subclasses Optimizer without its hook state, and the like), or the one a container holds as
    ``.optimizers`` (torchtitan's); None stays None. Anything else is refused with one sentence."""
    opt, depth = optimizer, 0
    while opt is not None and not has_step_hooks(opt) and getattr(opt, "optimizer", None) is not None and depth < 8:
        opt, depth = opt.optimizer, depth + 1
    # a container holding one optimizer (torchtitan's, with one optimizer name): that one, whose step it calls
    inner = held_optimizers(opt)
    if inner is not None and len(inner) == 1:
        opt = inner[0]
    if isinstance(opt, (list, tuple)):  # (inside the list unwrap_optimizers takes)
        raise WatchError(f"fsdp_doctor.watch: a {type(optimizer).__name__} of {len(opt)} inside the optimizers' list; "
                         "pass the optimizers the loop steps as one flat list")
    if opt is not None and not has_step_hooks(opt):
        raise WatchError(f"fsdp_doctor.watch: the optimizer argument ({type(optimizer).__name__}) is not a "
                         "torch.optim.Optimizer and wraps none as .optimizer; pass the Optimizer itself")
    return opt


#: where PyTorch Lightning defines LightningModule (the ``lightning`` package, and ``pytorch_lightning`` on its own)
_LIGHTNING_MODULES = ("lightning.pytorch.", "pytorch_lightning.")


def _lightning_accumulate(model) -> int | None:
    """The accumulate_grad_batches of the Lightning Trainer the watched model is attached to, where it is a
    LightningModule (its class, read without importing Lightning); None: not one, or no Trainer attached (Fabric's
    loop is the user's own). The Trainer steps the optimizer on every such batch and on the epoch's last: a loop fix
    keyed to the last micro-batch says it so in training_step (snippets.for_lightning)."""
    if not any(c.__module__.startswith(_LIGHTNING_MODULES) for c in type(model).__mro__):
        return None
    trainer = getattr(model, "_trainer", None)  # (its .trainer property raises where none is attached)
    n = getattr(trainer, "accumulate_grad_batches", None) if trainer is not None else None
    return int(n) if isinstance(n, int) and n >= 1 else None


def _accelerate_fsdp() -> bool:
    """Whether accelerate is set to shard with FSDP in this process (its Accelerator was built with an FSDP plugin):
    a model with no FSDP2 unit then is one accelerator.prepare() has not sharded yet (a new-user trial watched
    before prepare and was told to call fully_shard)."""
    state = _accelerate_shared("AcceleratorState")
    return str(state.get("distributed_type", "")).endswith("FSDP") or state.get("fsdp_plugin") is not None


def watch(model: nn.Module, optimizer=None, **options) -> Doctor:
    """Watches an FSDP2 training loop; use as ``with fsdp_doctor.watch(model, opt, out_dir=...) as doctor``
    and call ``doctor.step()`` once per step (after ``optimizer.step()``; with gradient accumulation, per
    micro-batch or per optimizer step alike: a step is one optimizer step).

    ``model``: the model with ``fully_shard`` applied (to its blocks and to itself); ``optimizer``: its
    optimizer, or a wrapper exposing it as ``.optimizer`` (accelerate's), for optimizer-step timing, state
    memory and the optimizer checks; per-parameter optimizers stepped inside the backward as an object whose
    ``.optim_map`` maps each parameter's name to its optimizer (torchtune's ``self._optim_ckpt_wrapper`` under
    ``optimizer_in_bwd: True``; each ``doctor.step()`` call is then a step); ``options``:
    :class:`~fsdp_doctor.record.options.WatchOptions`
    (``out_dir`` required; ``profile``, ``memory``, ``tokens_per_step``, ``peak_tflops``, ``count_flops``,
    ``capacity_bytes``, ``tensorboard``, ``overwrite``).
    """
    _check_arguments(model, optimizer)
    doctor = Doctor(model, optimizer, WatchOptions.from_kwargs(options))
    if (recipe := torchtune_recipe(sys._getframe(1))) is not None:
        doctor.driver, doctor.recipe = TORCHTUNE_DRIVER, recipe
    return doctor


def _check_arguments(model, optimizer) -> None:
    """One sentence for the arguments a hurried user gets wrong (a new-user trial: a list of models read as a
    traceback about weak references; the arguments swapped as "not a torch.optim.Optimizer"; ``out_dir`` given
    second as "out_dir is required")."""
    if isinstance(model, torch.optim.Optimizer) and isinstance(optimizer, nn.Module):
        raise WatchError("fsdp_doctor.watch: the model and the optimizer are swapped: "
                         "watch(model, optimizer, out_dir=...)")
    if isinstance(optimizer, (str, os.PathLike)):
        raise WatchError(f"fsdp_doctor.watch: {str(optimizer)!r} came second, where the optimizer goes: "
                         "watch(model, optimizer, out_dir=...) takes out_dir by name")
    if not isinstance(model, nn.Module):
        raise WatchError(f"fsdp_doctor.watch: the model argument ({type(model).__name__}) is not a torch.nn.Module: "
                         "watch() takes one model and its optimizer; of several models (a GAN's, a teacher and its "
                         "student), watch the one whose training you want diagnosed")


def _version(dist_name: str) -> str | None:
    """An installed distribution's version (None where it is not installed as one: a checkout on the path)."""
    from importlib import metadata  # (only for a model torchtitan or transformers sharded)

    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return None


def _forward_unseen(tm) -> bool:
    """A training step whose backward FSDP logged (its units' backward times) while neither the model's forward
    nor any unit's was seen: the forward ran in a compiled frame the doctor's hooks sit inside of, doing nothing
    (``torch.compile(model)`` called on the model given to watch(), the wrapper trained instead), and FSDP2 logged
    no forward there to time it from (StepTimer.forward_unseen: where it does)."""
    return not tm.forward_ms and not any(u.fwd_calls for u in tm.units) and any(u.bwd_ms > 0 for u in tm.units)


def _head(p) -> torch.Tensor:
    """A copy of a parameter's first local values (its shard's, for a DTensor)."""
    return getattr(p, "_local_tensor", p).detach().reshape(-1)[:UNTRAINED_VALUES].clone()
