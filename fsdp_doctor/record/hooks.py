"""The hooks around FSDP2's own, and the timings they take; one collaborator of
:class:`fsdp_doctor.record.tracker.Doctor` (which owns the lifecycle, the steps and the sinks).

It brackets FSDP2's own hooks without patching FSDP:

* forward: for every module of every unit, a forward pre-hook registered with ``prepend=True`` runs
  before FSDP's pre-forward (unit still sharded), a plain one runs after it (unshard waited for); post
  hooks bracket FSDP's post-forward (reshard) the same way.
* backward: FSDP logs ``FSDP::pre_backward (fqn)`` / ``FSDP::post_backward (fqn)`` on the logger
  ``torch.distributed.fsdp.fully_shard`` at DEBUG; the timer intercepts that logger's ``debug`` calls
  (restored at exit; passed on when the user has the logger at DEBUG) and timestamps them. A gradient hook
  registered on each unit's outputs after FSDP's own marks the end of the unit's backward unshard wait, and an
  autograd-engine callback queued from it marks the end of backward.
* optimizer: ``Optimizer.register_step_pre_hook`` / ``register_step_post_hook``; a closure given to
  ``optimizer.step(closure)`` (Lightning's Trainer) is passed on timed, its calls kept out of the optimizer's time.
  Per-parameter optimizers stepped inside the backward (``install_in_backward``) are timed by the same hooks, their
  time the step's optimizer time and out of the backward's.
* garbage collection: ``gc.callbacks``.

At FSDP's natural points the hooks emit *marks* ``(unit, phase)`` to a :class:`MarkSink` (the memory probe);
the per-unit and per-phase times are read at the step's end (``unit_rows``, ``forward_ns`` ...). Every hook body
is guarded: an exception goes to ``fail`` (the Doctor's failure policy) and ``active`` turns off.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch
import torch.nn as nn

from ..fsdp_labels import PREFIX as _FSDP_PREFIX, parse_label
from ..records import UnitStep
from . import fsdp2 as F2
from .param_reads import ParamReads, compile_used
from .phase import in_backward
from .units import (CompiledFrame, Unit, checkpointed_modules, checkpoints_itself, compiled_frames, compiled_module,
                    gathered_bytes, label_to_index, no_forward_of_its_own)

_FSDP_LOGGER = F2.LOGGER_NAME
_now = time.perf_counter_ns
# Inside a region Dynamo traces (a module compiled in place with ``module.compile()`` runs its hooks, and the
# hooks of the modules it calls, in the compiled frame) every hook returns at once: Dynamo folds the check to a
# constant, so the hook leaves no graph break and no host call in the graph. A unit compiled in place itself is
# timed around its compiled call instead (``StepTimer._time_compiled_calls``); the units inside another compiled
# module are timed from FSDP2's own logs (``StepTimer.fsdp_timed``), and so are those inside a compiled frame the doctor
# was not given (``StepTimer.frame_unseen``) (the run's configuration says which units are which).
_compiling = torch.compiler.is_compiling
# FSDP2's hook logs the timer reads (fsdp_labels): every unit's backward; the forward of the units inside another
# module's compiled frame, where the doctor's hooks are not (StepTimer.fsdp_timed), or inside a compiled frame the
# doctor was not given, where they do nothing (StepTimer.frame_unseen)
_FORWARD_KINDS = ("pre_forward", "post_forward")
_LOGGED_KINDS = (*_FORWARD_KINDS, "pre_backward", "post_backward")


def _elements(args, kwargs) -> int:
    """The elements of the tensors among a forward's arguments (top level: a batch's tokens, pixels)."""
    return sum(a.numel() for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor))


def _first_shape(args, kwargs) -> Optional[list[int]]:
    """The shape of the first tensor among a forward's arguments (top level); None: none."""
    return next((list(a.shape) for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)), None)


def _eager(fn):
    """``fn`` run as it is where Dynamo traces a frame calling it (not traced into)."""
    return torch.compiler.disable(fn)


def _timed_closure(closure, pause, resume):
    """``closure`` as ``optimizer.step`` calls it, with the doctor's ``pause`` before and ``resume`` after each call
    (run eagerly where Dynamo traces the step): its arguments and result pass through unchanged."""
    pause, resume = _eager(pause), _eager(resume)

    def closure_timed_by_fsdp_doctor(*args, **kwargs):
        pause()
        out = closure(*args, **kwargs)
        resume()
        return out

    return closure_timed_by_fsdp_doctor


class MarkSink(Protocol):
    """What listens to the hooks' marks: ``mark(unit, phase)`` at FSDP's boundaries (unit None: the whole model;
    phases ``forward_start``/``forward_end``/``loss_start`` (the model's forward returned)/``backward_start``/
    ``backward_end``/``optimizer_start``/``optimizer_end``) and ``step_end(step)`` once per step."""

    def mark(self, unit: Optional[str], phase: str) -> None: ...

    def unit_input(self, unit: str, args: tuple) -> None: ...  # a unit's forward inputs (what a checkpoint keeps)

    def gathered(self) -> None: ...  # a unit's first backward gradient: FSDP's pre-backward gathered it (no mark)

    def model_input(self, elements: int) -> None: ...  # the elements of the model's forward's tensor arguments

    def region(self, start: bool) -> None: ...  # a checkpointed module's forward starts / returns (its region's)

    # a unit compiled in place enters / leaves its compiled call (its saves, counted from outside the frame)
    def compiled_call(self, unit: str, start: bool, args: tuple = ()) -> None: ...

    def step_end(self, step: int) -> Any: ...


@dataclass(frozen=True)
class StepTimings:
    """One step's host-side timings, as the timer measured them (ms)."""

    forward_ms: float
    backward_ms: float
    optimizer_ms: float
    gc_ms: float
    gc_count: int
    units: list[UnitStep]
    gc_full_ms: float = 0.0  # of gc_ms, the full (generation 2) collections'
    gc_collected: int = 0  # objects the collections freed
    # of gc_count and gc_ms, the collections that started with the collector disabled: explicit gc.collect() calls
    gc_disabled_count: int = 0
    gc_disabled_ms: float = 0.0
    no_grad_ms: float = 0.0
    no_grad_forwards: int = 0
    autograd_eval_forwards: int = 0  # of no_grad_forwards: in eval mode with autograd on, no backward after
    # host clock (ns) at the step's first training forward's start and at its last optimizer.step()'s end; 0: none
    first_forward_ns: int = 0
    last_optimizer_end_ns: int = 0
    # of no_grad_ms, forwards without gradients before the first training forward or after the last optimizer.step()
    # (evaluation between steps): the part lying in the time between steps
    no_grad_between_ms: float = 0.0
    # under gradient accumulation: from each backward's end to the next micro-batch's forward, before the step's
    # optimizer.step() (where each micro-batch's data loading lies)
    micro_gap_ms: float = 0.0
    # of no_grad_ms, the units' all-gathers (FSDP's pre-forward hooks, issued and waited for)
    no_grad_gather_ms: float = 0.0
    # in those forwards, the units entered not gathered (each all-gathers then, or was prefetched), and how many
    # units were entered: each unit once where they are kept gathered, once per forward where they are not
    no_grad_gathers: int = 0
    no_grad_units: int = 0
    # a backward through the model began after an optimizer.step() that itself followed a backward, in one step: a
    # second loss through the model after its update (a GAN's generator update through its discriminator)
    backward_after_optimizer: bool = False
    # another FSDP model's forward or backward inside this step (its param groups' pre/post labels, the outermost
    # span of them): a teacher's forward, a GAN's other network, time outside the watched model that is not the data
    other_models_ms: float = 0.0
    # the elements of the tensors the model's training forwards took (0: none seen)
    input_elements: int = 0
    # the shape of the first tensor the step's first training forward took (a batch's tokens: batch x sequence);
    # None: none seen
    input_shape: Optional[list[int]] = None
    # backward passes through the model (backward() calls that reached it, however many forwards each took in; where
    # the model is a unit, those that reached it: torchtitan's chunked loss calls backward() once per chunk of the
    # sequence through its output unit alone, then once through the model, one pass: StepTimer._model_backwards)
    backwards: int = 0
    # of those, the ones that began with FSDP2's gradient sync on (every unit reduce-scattering its gradients)
    synced_backwards: int = 0
    # frames Dynamo compiled inside each unit's compiled call (units compiled in place: name -> frames, those that did)
    unit_compiles: Optional[dict] = None


class _UnitAcc:
    """Per-step accumulators of one unit (ns)."""

    __slots__ = ("fwd", "ag_fwd", "bwd", "ag_bwd", "recompute", "calls", "t_outer", "t_inner",
                 "t_pre_bwd", "fwd_depth", "t_recompute", "recompute_runs", "grad_seen",
                 "t_child", "child_fwd", "loose", "bwd_split")

    def __init__(self):
        self.reset()

    def reset(self):
        self.fwd = self.ag_fwd = self.bwd = self.ag_bwd = self.recompute = 0
        self.calls = 0
        self.t_outer = self.t_inner = self.t_pre_bwd = 0
        self.fwd_depth = 0
        self.t_recompute = 0
        self.recompute_runs = 0
        self.grad_seen = False
        self.t_child = self.child_fwd = 0  # forward time of the unit's functionally checkpointed submodules
        self.loose = False  # its forward runs outside the model's (StepTimer._loose_open)
        # the all-gathers between its pre-backward and its first gradient, [(unit, bytes)], its own first; None: all
        # its own (StepTimer._backward_split)
        self.bwd_split: Optional[list[tuple[int, int]]] = None


class StepTimer:
    """Host-side timings of one rank's steps, per unit and per phase, from hooks around FSDP2's own."""

    def __init__(self, fail: Callable[[str, BaseException], None]):
        self._units: list[Unit] = []
        self._fail = fail
        self.active = False  # the Doctor turns it on at entry and off when it steps aside
        self.train_forwards = 0  # the model's forwards with autograd on, since entry
        # backward passes that reached the model, since entry: the micro-batches' count, where forwards are not
        # (a GAN's generator run twice into one loss is one backward, one micro-batch)
        self.backwards = 0
        # the step's backward() calls: [whether it reached the model's own unit, whether it began with gradient sync
        # on (gradient_sync)], the last the one running or last run (_model_backwards)
        self._step_bwds: list[list[bool]] = []
        # where accelerate prepared the model: its GradientState's sync_gradients (accelerator.accumulate(model)'s
        # per-call switch), read as each backward begins; and the backwards so far that began with it off
        self.accelerate_sync: Optional[Callable[[], bool]] = None
        self.accelerate_unsynced = 0
        self.marks: Optional[MarkSink] = None  # the memory probe
        self.gpu = None  # GpuTimeline on CUDA
        self._handles: list[Any] = []
        self._acc: dict[int, _UnitAcc] = {}
        self._runtime_ckpt: set[int] = set()  # units seen re-running their forward in backward
        # functional checkpointing of a unit's submodules, watched for during the first step (see _watch_children)
        self._child_owner: dict[int, tuple[int, nn.Module, Optional[int]]] = {}  # id -> (unit, module, parent id)
        self._child_seen: dict[int, set[int]] = {}  # unit -> ids of its submodules seen running in backward
        # the first step's probes also see which submodules run a forward: the ids of those watched whose forward
        # never ran, or whose parameters the first training forward read outside it (ParamReads); None where no
        # probe was on (a compiled model; units with a CheckpointWrapper inside are not watched)
        self.read_outside: Optional[frozenset] = None
        self._child_ran: set[int] = set()
        self._reads = None  # the first training forward's ParamReads, while it is on the mode stack
        self._reads_outside: frozenset = frozenset()
        # the watch's forward pre-hooks, one on each watched submodule, while it watches (None: not watching). Not
        # one global hook: inside a compiled frame the doctor was not given (watch(model), torch.compile(model)
        # trained) Dynamo traced it as a graph break for the whole run (7 in a 3-block model), and
        # torch.compile(module) warns about global hooks
        self._child_probe: Optional[list] = None
        self._child_pending = False  # probes to put on at the first training forward outside a compiled frame
        self.checkpointed_children: set[int] = set()  # units whose submodules re-run in backward
        # units whose checkpointing is selective (torch's selective checkpoint mode seen in their region's forward,
        # looked for in the first step: end_child_watch ends it)
        self.selective: set[int] = set()
        self._selective_watch = True
        self._unit_of_label: dict[str, int] = {}
        self._unit_of_group: dict[int, int] | None = None  # id(FSDPParamGroup) -> unit index
        self._kinds: dict[str, str] = {}  # another model's FSDP label -> its kind ("pre_forward", ...)
        self._other_open: set[int] = set()  # another model's param groups inside their forward or backward now
        self._other_t0 = 0
        self._tap = self._tap_prev = None  # the FSDP logger interception
        self._grad_hooks: dict[int, Any] = {}
        self._log_cache: dict[str, tuple[bool, int] | None] = {}
        self.optimizer_steps = 0  # optimizer.step() calls seen (micro-batches: several doctor.step() per one)
        self.in_backward_steps = 0  # steps of per-parameter optimizers inside the backward (install_in_backward)
        self._ib_start = self._ib_ns = 0  # ... the one running's start, and their time inside this step's backward
        # units compiled (``module.compile()``, or the module of ``torch.compile(module)``'s wrapper) timed around
        # the call that enters their compiled frame, and each such call, put back when the doctor steps aside
        self.timed_compiled: set[int] = set()
        # the unit whose compiled call is running (None: none), and the frames Dynamo compiled inside each unit's
        # compiled calls this step (unit -> frames): which units compiled and which ran eager, where Dynamo hit its
        # recompile limit (compile_time.RecompileLimitTap)
        self.in_compiled_call: Optional[int] = None
        self._unit_compiles: dict[int, int] = {}
        # (module, the attribute, its compiled call or registered forward method, the doctor's)
        self._compiled_calls: list[tuple[nn.Module, str, Any, Any]] = []
        # units inside another module's compiled frame (``model = torch.compile(model)`` after sharding: every unit
        # but the root), which get none of the doctor's hooks: their forward is timed from FSDP2's own pre- and
        # post-forward logs instead, as every unit's backward is (_logged_forward)
        self.fsdp_timed: set[int] = set()
        # units whose forward FSDP2 logged with none of the doctor's hooks around it, in a training forward: their hooks
        # ran inside a compiled frame the doctor was not given (watch(model) while torch.compile(model)'s wrapper
        # trains, or a compiled function around the model's call), where they return at once. Timed from FSDP2's logs
        # from then on, as fsdp_timed units are (_unseen_forward); forward_unseen: the model's own forward was among
        # them (its hooks did not run either), the step's forward timed from those logs too
        self.frame_unseen: set[int] = set()
        self.forward_unseen = False
        self._root: Optional[int] = None  # the unit the watched model itself belongs to (install)
        # the model's forward entered without gradients (evaluation, generation): its start, 0 outside one. Its
        # units' hooks and marks stay quiet inside it: no training forward, no backward to follow
        self._no_grad_t0 = 0
        # the unit that opened such a forward itself, called without gradients outside the model's forward (a
        # LightningModule's validation_step calls self.model, the FSDP root inside the watched module): None otherwise
        self._ng_opener: Optional[int] = None
        self._ng_gather_t0: dict[int, int] = {}
        self._sharded_states = F2.ShardedStates()
        self._gathered_bytes: dict[int, int] = {}  # id(FSDPParamGroup) -> the bytes it all-gathers
        # the Doctor's: a training forward starts after an optimizer.step() (its ns); it ends the step there when
        # doctor.step() is called per micro-batch, before optimizer.step() (see Doctor._forward_after_optimizer)
        self.step_boundary: Optional[Callable[[int], None]] = None
        # the Doctor's: a doctor.step() call without an optimizer step, after a backward, found the gradients kept;
        # whether they are by the next forward (zero_grad at the loop's top) tells a skipped step from a micro-batch
        self.zeroed_check = False
        self._container = False  # the watched module has no forward of its own (install)
        self.begin_step()

    def install(self, units: list[Unit], model: nn.Module, optimizers: list) -> None:
        self._units = units
        self._container = no_forward_of_its_own(model)
        self._root = next((i for i, u in enumerate(units) if any(m is model for m in u.modules)), None)
        h = self._handles
        # A module whose hooks run inside a compiled frame (compiled in place, or inside a module that is) gets
        # none of the doctor's: there they would return at once, and Dynamo, which traces neither Module.__call__
        # nor FSDP's hooks, compiled the doctor's hook as a frame of its own, guarded on the doctor's state and the
        # grad mode (a new-user trial, Llama blocks compiled in place: 5 frames compiled for 4 graphs, "5 graphs"
        # in the report, and the hook recompiled at an evaluation under no_grad; the model compiled in place: 8
        # frames for 5, its own hooks too). Such a unit is timed around its compiled call (_time_compiled_calls);
        # the units inside another one's frame are not timed.
        _, in_frame = compiled_frames(model)
        for idx, u in enumerate(self._units):
            self._acc[idx] = _UnitAcc()
            for m in u.modules:
                if id(m) in in_frame:
                    continue
                h.append(m.register_forward_pre_hook(self._mk(self._fwd_outer_pre, idx, self._ng_outer_pre),
                                                     prepend=True))
                h.append(m.register_forward_pre_hook(self._mk(self._fwd_inner_pre, idx, self._ng_inner_pre)))
                h.append(m.register_forward_hook(self._mk(self._fwd_inner_post, idx), prepend=True))
                h.append(m.register_forward_hook(self._mk(self._fwd_outer_post, idx, self._ng_outer_post)))
            # Activation checkpointing re-runs the wrapped inner module in backward, not the unit's own
            # module: time those re-runs as the unit's recompute.
            for inner in checkpointed_modules(u, self._units):
                if id(inner) in in_frame:
                    continue
                h.append(inner.register_forward_pre_hook(self._mk(self._recompute_pre, idx)))
                # always_call: a non-reentrant re-run stops early (an exception) once it has rebuilt what backward
                # needs, and its time to there is the recompute's
                h.append(inner.register_forward_hook(self._mk(self._recompute_post, idx), always_call=True))
        self._time_compiled_calls(model)
        self.fsdp_timed = {i for i, u in enumerate(self._units)
                           if any(id(m) in in_frame for m in u.modules)} - self.timed_compiled
        self._time_forward_methods(model)
        self._watch_children(model)
        if id(model) not in in_frame:  # (the model compiled in place: its call is bracketed by them instead)
            h.append(model.register_forward_pre_hook(self._model_pre, prepend=True, with_kwargs=True))
            h.append(model.register_forward_hook(self._model_post))
        for optimizer in optimizers:  # (several: Muon beside AdamW, stepped one after the other in the loop)
            # run as they are where the user compiles optimizer.step (torch.compile(optimizer.step)): traced, the
            # memory marks' calls broke the graph inside them (a new-user trial: 3 graph breaks, 11 frames became
            # 31); disabled, Dynamo steps round each at the start and the end of the step
            pre = optimizer.register_step_pre_hook(_eager(self._opt_pre))
            h.append(pre)
            h.append(optimizer.register_step_post_hook(_eager(self._opt_post)))
            # first of the pre-hooks: the user's own (a fix's all-reduce of replicated parameters, a gradient
            # check) run inside optimizer.step() and are its time, not time outside the model
            hooks = getattr(optimizer, "_optimizer_step_pre_hooks", None)
            if hasattr(hooks, "move_to_end"):
                hooks.move_to_end(pre.id, last=False)
        gc.callbacks.append(self._gc_cb)
        self._tap_fsdp_log()

    def install_in_backward(self, optimizers: list) -> None:
        """Times per-parameter optimizers stepped inside the backward (torchtune's optimizer_in_bwd: a hook on each
        parameter steps its own optimizer as FSDP2 reduce-scatters its gradient): their steps add up to the step's
        optimizer time, taken out of the backward's, which held them. They neither end nor split a step (the
        loop's doctor.step() calls do): no optimizer_steps, no marks."""
        for o in optimizers:
            self._handles.append(o.register_step_pre_hook(_eager(self._ib_pre)))
            self._handles.append(o.register_step_post_hook(_eager(self._ib_post)))

    def _ib_pre(self, optimizer, args, kwargs):
        if self.active:
            self._ib_start = _now()

    def _ib_post(self, optimizer, args, kwargs):
        if self.active and self._ib_start:
            dt = _now() - self._ib_start
            self._ib_start = 0
            self._optimizer_ns += dt
            if self._bwd_start:
                self._ib_ns += dt
            self.in_backward_steps += 1

    def _time_compiled_calls(self, model: nn.Module) -> None:
        """A unit compiled in place (``module.compile()``: torchtitan 0.3's blocks, kernels.launch_bound's fix) runs
        its hooks, the doctor's among them, in the compiled frame, where they return at once; so does the module
        of ``torch.compile(module)``'s wrapper (an OptimizedModule; ``model = torch.compile(model)`` after sharding:
        the units read 0 ms, the step's backward 0 ms). The call that enters the frame (the module's
        ``_compiled_call_impl`` that ``Module.__call__`` calls; the wrapper's ``forward``) is wrapped instead until
        the doctor steps aside, and bracketed there by the outer hooks of an eager unit: its forward (and its CUDA
        events), its outputs' gradient hook (the backward's all-gather wait); its backward comes from FSDP's logs
        as for any unit. FSDP's pre-forward runs inside the frame, so the forward's all-gather wait is inside its
        forward, not apart. The activations its forward saved are counted around the call (the probe's
        ``compiled_call``), but no forward marks go to the memory timeline from outside it: the memory rules place
        such a unit from its backward's marks, as before (torchtitan's compiled blocks checkpointed peaked within
        10% of that prediction; from marks around the call it came out 29% over the rerun's peak). Units
        inside another unit's frame stay untimed (that frame calls them). The model compiled whole has its own
        hooks brought out of the frame the same way (``_wrap_call``)."""
        frames, _ = compiled_frames(model)
        for f in frames:
            # the unit whose module opens the frame (of a grouped unit: each of its modules its own frame)
            idx = next((i for i, u in enumerate(self._units) if any(m is f.top for m in u.modules)), None)
            if idx is None and f.top is not model:  # (a wrapper's module inside a unit, torch.compile then fully_shard:
                continue                            # the unit's hooks, on the wrapper, run outside)
            self._wrap_call(f, idx, model)
            if idx is not None:
                self.timed_compiled.add(idx)

    def _time_forward_methods(self, model: nn.Module) -> None:
        """A method ``register_fsdp_forward_method`` made a forward method (a ``score()`` or ``generate()`` that calls
        ``self.forward`` directly) runs FSDP2's pre- and post-forward but no module hook, the doctor's none: the step
        read no forward (its time outside the model), no activations, and memory.grads_kept fired on a loop freeing
        its gradients (a new-user trial). Such a method of the model or of a unit's module is wrapped, until the
        doctor steps aside, in the hooks its ``forward`` would run: the model's and the unit's outer ones."""
        targets = [(model, next((i for i, u in enumerate(self._units) if any(m is model for m in u.modules)), None))]
        targets += [(m, i) for i, u in enumerate(self._units) for m in u.modules if m is not model]
        for module, idx in targets:
            for name in F2.registered_forward_methods(module):
                self._wrap_method(module, name, idx, whole=module is model)

    def _wrap_method(self, module: nn.Module, name: str, idx: Optional[int], whole: bool) -> None:
        call = vars(module)[name]
        timed_method = self._bracketed(call, module, idx, whole)
        timed_method.__wrapped__ = call  # (still FSDP's registered forward method to fsdp2.registered_forward_methods)
        setattr(module, name, timed_method)
        self._compiled_calls.append((module, name, call, timed_method))

    def _bracketed(self, call, module: nn.Module, idx: Optional[int], whole: bool, frame: bool = False):
        """``call`` bracketed by the doctor's outer forward hooks of unit ``idx`` (None: no unit) and, ``whole``, by
        its model hooks, in the order the hooks run: the model's pre-hook first and its post-hook last; ``frame``
        (the call enters the unit's compiled frame), by the memory probe's count of its saves too. Each is guarded
        as a hook is; inside a frame Dynamo traces, the call alone."""
        pre = self._mk(self._fwd_outer_pre, idx) if idx is not None else None
        post = self._mk(self._fwd_outer_post, idx) if idx is not None else None
        saves = self._mk(self._compiled_saves, idx) if frame and idx is not None else None
        compiles = frame and idx is not None  # (the frames Dynamo compiles in the call: the unit's, unit_compiles)

        def timed(*args, **kwargs):
            if _compiling():
                return call(*args, **kwargs)
            if whole:
                self._model_pre(module, args, kwargs)
            if pre is not None:
                pre(module, args)
            if saves is not None:
                saves(module, True, args)
            if compiles:
                outer, self.in_compiled_call = self.in_compiled_call, idx
                n0 = F2.dynamo_frames_compiled()
                try:
                    out = call(*args, **kwargs)
                finally:
                    self.in_compiled_call = outer
                if self.active and (n := F2.dynamo_frames_compiled() - n0) > 0:
                    self._unit_compiles[idx] = self._unit_compiles.get(idx, 0) + n
            else:
                out = call(*args, **kwargs)
            if saves is not None:
                saves(module, False, args)
            if post is not None:
                post(module, args, out)
            if whole:
                self._model_post(module, args, out)
            return out

        return timed

    def _wrap_call(self, frame: CompiledFrame, idx: Optional[int], model: nn.Module) -> None:
        """Puts a timed call in place of the call that enters ``frame``: bracketed by the doctor's outer forward
        hooks of unit ``idx`` (None: no unit) and, where the model itself is compiled in place (``model.compile()``),
        by its model hooks (the step's forward: without them it read 0 ms, and the forward's time fell outside the
        model, where jitter.data_wait blamed data loading for it), in the order the hooks run: the model's pre-hook
        first and its post-hook last. Each is guarded as a hook is; inside a frame Dynamo traces, the call alone."""
        module, call = frame.owner, getattr(frame.owner, frame.attr)
        # (the model's hooks run outside a wrapper's frame, as a wrapper's own do)
        timed_call = self._bracketed(call, module, idx, whole=frame.top is model, frame=True)
        setattr(module, frame.attr, timed_call)
        self._compiled_calls.append((module, frame.attr, call, timed_call))

    def uninstall(self) -> None:
        for m, attr, call, timed in self._compiled_calls:
            if vars(m).get(attr) is timed:  # (compiled again since: the user's stays)
                setattr(m, attr, call)
        self._compiled_calls.clear()
        self._stop_child_probe()
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
            if self.active and not _compiling():
                label = args[0] if args and msg == "%s" else msg
                if isinstance(label, str) and label.startswith(_FSDP_PREFIX):
                    try:
                        self._on_fsdp_log(label, now(), F2.calling_param_group(1))
                    except Exception as e:  # noqa: BLE001
                        self._fail("fsdp log tap", e)
            if prev is not None or enabled(logging.DEBUG):
                orig(msg, *args, **kwargs)

        self._tap, self._tap_prev = debug, prev
        lg.debug = debug


    def _mk(self, fn, idx, no_grad=None):
        """A guarded hook running ``fn``; inside a forward without gradients ``no_grad`` instead (the pre-forward
        hooks': FSDP's all-gather timed between them), else nothing."""
        def hook(module, *args):
            if self.active and not _compiling():
                if self._no_grad_t0:
                    if no_grad is not None:
                        no_grad(idx)
                    return
                try:
                    fn(idx, args)
                except Exception as e:  # noqa: BLE001
                    self._fail(fn.__name__, e)
        return hook

    def _ng_outer_pre(self, idx) -> None:
        """A unit entered inside a forward without gradients: before FSDP's pre-forward (the all-gather), which
        gathers it unless it is gathered already (a unit of several modules: at its first)."""
        self._ng_units.add(idx)
        of = self._sharded_states.of
        if any(of(pg) != "unsharded" for pg in self._units[idx].param_groups):
            self._ng_gathers += 1
        self._ng_gather_t0[idx] = _now()

    def _ng_outer_post(self, idx) -> None:
        """A unit left inside a forward without gradients: where it opened that forward itself (_fwd_outer_pre), the
        forward ends here, counted as the model's post-hook counts one (_model_post)."""
        if idx == self._ng_opener:
            self._count_no_grad(_now() - self._no_grad_t0)
            self._no_grad_t0, self._ng_opener = 0, None

    def _ng_inner_pre(self, idx) -> None:
        """... and after it: its time is the unit's all-gather, issued and waited for (nothing when kept gathered)."""
        t0 = self._ng_gather_t0.pop(idx, 0)
        if t0:
            self._ng_gather_ns += _now() - t0

    def _safe(self, fn, where: str) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            self._fail(where, e)

    # ------------------------------------------------------------------ functional checkpointing of submodules
    # ``h = h + checkpoint(self.mlp, h)`` inside a block's forward leaves no wrapper to see in the module tree.
    # During the first step a forward pre-hook on each submodule of a unit (not in a unit of its own) watches for
    # one running its forward during backward, which is checkpointing's recompute. It does nothing in forward but
    # one C call, returns at once in a compiled frame, and it is removed when the first step ends
    # (``end_child_watch``, at the configuration snapshot); the outermost submodules seen then get recompute
    # hooks like a CheckpointWrapper's inner module, and the unit's ``checkpoint`` reads "children".

    def _watch_children(self, model: nn.Module) -> None:
        if any(compiled_module(m) for m in model.modules()):
            # the recompute of a compiled module's submodules is inside its graph (and a hook there does nothing)
            return
        for idx, u in enumerate(self._units):
            if checkpointed_modules(u, self._units):  # a CheckpointWrapper inside: already timed
                continue
            other = {id(m) for v in self._units if v is not u for m in v.modules}
            stack = [(c, None) for m in u.modules for c in m.children() if id(c) not in other]
            while stack:
                m, parent = stack.pop()
                self._child_owner[id(m)] = (idx, m, parent)
                stack.extend((c, id(m)) for c in m.children() if id(c) not in other)
        # the probes go on at the model's first training forward that runs outside a compiled frame
        # (_model_pre): a model trained through torch.compile(model) or a compiled step function, watched
        # itself, runs its submodules in compiled frames, where a probe does nothing but make Dynamo compile each
        # hooked submodule's forward as a frame of its own (other kernels: a new-user trial's losses moved by an
        # ulp, 1 graph became 5) and, removed after the first step, recompile
        self._child_pending = bool(self._child_owner)

    def _probe_children(self, model: nn.Module) -> None:
        """Puts the first step's probes on (see _watch_children), and for this forward a look at the parameters its
        calls read (ParamReads: off at the model's forward's end, raised or not)."""
        self._child_pending = False
        self._child_probe = [m.register_forward_pre_hook(self._probe_child) for _, m, _ in self._child_owner.values()]
        if compile_used():  # (the reads not looked at: compile_used says why)
            return
        held = [m for _, m, _ in self._child_owner.values() if m._parameters]
        self._child_probe += [m.register_forward_hook(self._probe_child_post, always_call=True) for m in held]
        self._reads = ParamReads(held)
        self._child_probe.append(model.register_forward_hook(self._reads_off, always_call=True))
        self._reads.__enter__()

    def _probe_child_post(self, module, args, output):
        if self._reads is not None:
            self._reads.leave(module)

    def _reads_off(self, module, args, output) -> None:
        """The first training forward ended: its parameter reads taken, the mode off the stack (where it is on top;
        under a mode the forward left on, it stays, inert)."""
        reads, self._reads = self._reads, None
        if reads is None:
            return
        try:
            self._reads_outside = frozenset(reads.outside)
            n = torch._C._len_torch_function_stack()
            if n and torch._C._get_function_stack_at(n - 1) is reads:
                reads.__exit__(None, None, None)
            else:
                reads.owners.clear()
        except Exception as e:  # noqa: BLE001
            self._fail("parameter reads", e)

    def _probe_child(self, module, args):
        if _compiling():  # (folded to a constant by Dynamo: no graph break)
            return
        try:
            if self.active and in_backward():
                hit = self._child_owner.get(id(module))
                if hit is not None:
                    self._child_seen.setdefault(hit[0], set()).add(id(module))
            elif self.active:  # in forward: inside a selective checkpoint's region, the unit checkpoints selectively
                hit = self._child_owner.get(id(module))
                if hit is not None:
                    self._child_ran.add(id(module))
                    if self._reads is not None:
                        self._reads.enter(module)
                    self._see_selective(hit[0])
        except Exception as e:  # noqa: BLE001
            self._fail("checkpoint watch", e)

    def _stop_child_probe(self) -> None:
        if self._child_probe is not None:
            for h in self._child_probe:
                h.remove()
            self._child_probe = None
        if self._reads is not None:  # (removed inside the first forward: the doctor stepping aside there)
            self._reads_off(None, (), None)

    def end_child_watch(self) -> None:
        """Ends the first step's watch: hooks the outermost submodules seen re-running in backward (of units
        that did not re-run as a whole, whose submodules re-run with them) and records their units."""
        self._child_pending = False  # (never put on: the model ran in compiled frames)
        self._selective_watch = False
        if self._child_probe is None:
            return
        self._stop_child_probe()
        self.read_outside = frozenset(self._child_owner.keys() - self._child_ran) | self._reads_outside
        self._child_ran = set()
        for idx, ids in sorted(self._child_seen.items()):
            if idx in self._runtime_ckpt:
                continue
            unit_mods = {id(m) for v in self._units for m in v.modules}
            direct = {id(c) for m in self._units[idx].modules for c in m.children() if id(c) not in unit_mods}
            whole = bool(direct) and direct <= ids  # every child re-ran: the unit's forward is checkpointed
            # or the unit is a layer that checkpoints its own forward (transformers' GradientCheckpointingLayer with
            # gradient_checkpointing on): a non-reentrant recompute stops once it has what backward needs, so a
            # last child that saves nothing never re-runs (GPT-NeoX's post_mlp_dropout: read "children", and a
            # false ac.wrong_granularity whose fix changed nothing)
            whole = whole or checkpoints_itself(self._units[idx])
            for i in ids:
                _, m, parent = self._child_owner[i]
                # outermost: no module above it re-ran, its parent or one above a container that never runs (a
                # ModuleList): a diffusers transformer block's to_out.0 and ff.net.0, each "outermost" under its
                # ModuleList, took hooks inside the block's, and their re-runs, timed alone, replaced the block's
                # (a U-Net's recompute read 58 ms for ~300)
                while parent is not None and parent not in ids:
                    parent = self._child_owner[parent][2] if parent in self._child_owner else None
                if parent is None:
                    self._handles.append(m.register_forward_pre_hook(self._mk(self._child_pre, idx)))
                    # (always_call: a re-run stopped early inside it is timed to there, as _recompute_post's; with
                    # the hooks above, a diffusers U-Net's blocks, each checkpointing its resnets and transformer
                    # blocks, read 31.4 ms of recompute where turning checkpointing off saved ~290 ms, now 251 ms)
                    self._handles.append(m.register_forward_hook(self._mk(self._child_post, idx), always_call=True))
            # HF's GradientCheckpointingLayer checkpoints the layer's forward with its hooks outside: the whole
            # unit is recomputed ("unit"), not some of its children (checkpoint(self.mlp, h): "children")
            (self._runtime_ckpt if whole else self.checkpointed_children).add(idx)
        self._child_owner.clear()
        self._child_seen.clear()

    def _child_pre(self, idx, args):
        """In backward the submodule's recompute; in forward its forward time (the recompute's stand-in when
        a non-reentrant re-run stops early)."""
        if in_backward():
            self._recompute_pre(idx, args)
        else:
            self._acc[idx].t_child = _now()
            self._region(True, idx)

    def _child_post(self, idx, args):
        a = self._acc[idx]
        if in_backward():
            self._recompute_post(idx, args)
        else:
            self._region(False, idx)
            if a.t_child:
                a.child_fwd += _now() - a.t_child
                a.t_child = 0

    def _region(self, start: bool, idx: int) -> None:
        """A checkpointed module's forward starts or returns (in forward): whether its checkpoint is selective, noted
        once a unit; the memory probe notes its region."""
        if _compiling():
            return
        if start and self._selective_watch:
            self._see_selective(idx)
        if self.marks is not None:
            self._safe(lambda: self.marks.region(start), "memory")

    def _see_selective(self, idx: int) -> None:
        """The unit ``idx`` checkpoints selectively where torch's selective checkpoint mode is on the dispatch stack
        here (inside its region's forward)."""
        if idx not in self.selective and F2.sac_cache() is not None:
            self.selective.add(idx)

    def _recompute_pre(self, idx, args):
        if in_backward():
            a = self._acc[idx]
            a.t_recompute = _now()
            a.recompute_runs += 1
        else:
            self._region(True, idx)

    def _recompute_post(self, idx, args):
        a = self._acc[idx]
        if in_backward():
            if a.t_recompute:
                a.recompute += _now() - a.t_recompute
                a.t_recompute = 0
        else:
            self._region(False, idx)

    @staticmethod
    def _recompute_ns(a: "_UnitAcc", selective: bool = False) -> int:
        """Measured re-run time (the checkpointed submodules' re-runs, timed to their end or to where a
        non-reentrant checkpoint stopped them early, once it had rebuilt the saved tensors: their post-hooks are
        always called); where only the unit itself re-ran (its own forward hook never fires on the early stop)
        the forward time of what checkpointing re-runs: the checkpointed submodules', or the unit's forward
        compute. Not for a selective checkpoint: it re-runs only the operators its policy did not save (the
        forward's time read 19.9 ms of recompute where turning checkpointing off saved 2-5 ms: a new-user trial),
        so 0, not timed (its re-run, timed to its stop since the post-hooks are always called, is left unread as
        before: the rules say it is not measured)."""
        if selective:
            return 0
        if a.recompute or not a.recompute_runs:
            return a.recompute
        return a.child_fwd or max(0, a.fwd - a.ag_fwd)

    def _fwd_outer_pre(self, idx, args):
        a = self._acc[idx]
        if in_backward() and a.fwd_depth == 0:
            # the unit re-runs in backward: torch.utils.checkpoint.checkpoint(unit, ...) around it. The
            # non-reentrant re-run stops early (no post-hook), so nothing here may wait for one.
            a.t_recompute = _now()
            a.recompute_runs += 1
            self._runtime_ckpt.add(idx)
            return
        if a.fwd_depth == 0 and not self._fwd_start and not self._container and not torch.is_grad_enabled():
            # a unit called without gradients outside the model's forward (Lightning's validation_step runs
            # self.model, the FSDP root inside the watched LightningModule, under inference_mode): a forward without
            # gradients, its units' hooks quiet inside it, as when the model's own forward runs so. A new-user
            # trial's validation read as time outside the model (41.8 ms at the step after it) and
            # jitter.data_wait fired at 16%
            self._no_grad_t0, self._ng_opener = _now(), idx
            self._ng_outer_pre(idx)
            return
        if a.fwd_depth == 0:  # grouped units: only the first module's entry opens the unit
            a.t_outer = _now()
            if self.gpu is not None and not in_backward():
                self.gpu.open(idx, 0)
            unit = self._units[idx]
            if not self._fwd_start and (self._container or (unit.depth or unit.name) and torch.is_grad_enabled()):
                # a unit the training step runs outside the model's forward (torchtitan's chunked loss runs lm_head
                # from the loss): the model's forward all the same, not time outside the model; the outermost
                # such unit's time counts (the units it calls are inside it). In a container whose forward never
                # runs, every unit forward, a teacher's without gradients too: its models' forwards read as time
                # outside the model (a new-user trial's teacher and student: 37% of the step, jitter.data_wait).
                # An FSDP root that is not the watched module (a LightningModule's self.model) is such a unit: its
                # own forward (the embedding, the head, its all-gather) read as time outside the model, each
                # block's forward as the model's, and the loss as the last block's
                if not self._loose_open:
                    self._loose_t0 = a.t_outer
                    if torch.is_grad_enabled():
                        # the step's first forward, or the next micro-batch's, where the watched module's own forward
                        # never runs: a LightningModule's training_step calls self.model, the FSDP root inside it
                        # (between_ms was never measured there, and jitter.data_wait read the loss and Lightning's
                        # optimizer closure, 16% of a step, as data loading)
                        self._forward_begins(a.t_outer)
                    elif self._container and not self._first_fwd:
                        self._first_fwd = a.t_outer  # (the step's first forward: between_ms counts from it)
                self._loose_open += 1
                a.loose = True
        a.fwd_depth += 1

    def _fwd_inner_pre(self, idx, args):
        a = self._acc[idx]
        if a.fwd_depth == 1 and a.t_inner == 0:
            a.t_inner = _now()
            if not in_backward():
                a.ag_fwd += a.t_inner - a.t_outer
        if self.marks is not None:
            self.marks.mark(self._units[idx].name, "forward_start")
            self.marks.unit_input(self._units[idx].name, args[0] if args else ())  # (the module's positional inputs)

    def _compiled_saves(self, idx, args):
        """A unit compiled in place enters (``args[0]``) or leaves its compiled call: its inner hooks, which count its
        saves, do nothing inside the frame."""
        if self.marks is not None:
            start, inputs = args
            self.marks.compiled_call(self._units[idx].name, start, inputs if start else ())

    def _fwd_inner_post(self, idx, args):
        if self.marks is not None:
            self.marks.mark(self._units[idx].name, "forward_end")

    def _fwd_outer_post(self, idx, args):
        a = self._acc[idx]
        if in_backward() and a.fwd_depth == 0:
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
        if in_backward():
            a.recompute += dt
            return
        a.fwd += dt
        a.calls += 1
        if a.loose:
            a.loose = False
            self._loose_open -= 1
            if not self._loose_open:
                self._forward_ns += t - self._loose_t0
                if (self._returned or not self.train_forwards and torch.is_grad_enabled()) and self.marks is not None:
                    # a unit run after the model's forward returned (its forward a registered forward method, the
                    # head a unit the loop calls after it; a chunked loss's lm_head): the loss phase starts again
                    # when it has resharded. From the model's return alone, a new-user trial's peak in the loss read
                    # "head in_forward" with only the root's 64.50 KiB gathered, the head's 64 KiB resharded. Where
                    # the watched module's own forward never runs (a LightningModule's training_step calling
                    # self.model; a container's student), the loss starts where its outermost unit's forward ends:
                    # without the mark, the loss's high-water read as that unit's forward
                    self._safe(lambda: self.marks.mark(None, "loss_start"), "memory")
        if self.gpu is not None:
            self.gpu.close(idx, 0)
        output = args[1] if len(args) > 1 else None
        # every forward call's outputs (each module of a grouped unit, each call of a unit run twice): FSDP2 hooks
        # its pre-backward on each of them, and the first gradient reaches the last one; hooking the first call's
        # only (norm of [norm, lm_head]) timed lm_head's backward as the unit's all-gather wait
        if output is not None and not a.grad_seen:
            self._hook_outputs(idx, output)

    def _hook_outputs(self, idx: int, output) -> None:
        """Marks the unit's outputs so that the first gradient reaching them (after FSDP's own pre-backward
        hook, registered before ours) tells when the unit's backward unshard was waited for."""
        hook = self._grad_hooks.get(idx)
        if hook is None:
            hook = self._grad_hooks[idx] = self._make_grad_hook(idx)
        _hook_grads(output, hook)

    def _make_grad_hook(self, idx: int):
        acc = self._acc[idx]

        def grad_hook(grad):
            if self.active and not acc.grad_seen and not _compiling():
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
            gap = own = t - a.t_pre_bwd
            split, a.bwd_split = a.bwd_split, None
            if split:
                # the gap holds the unit's own all-gather (if any) and, serially, the synchronous ones its backward
                # prefetch issued, which are the targets' waits (the trace's FSDP::all_gather (target) under
                # FSDP::backward_prefetch): no timestamp between them without patching FSDP, so the gap is split in
                # proportion to the bytes each gathers (one link, one collective after the other; on CUDA the host
                # only issues them, the same split of a short span: bwd_ms and the GpuTimeline's backward spans keep
                # their pre- to post-backward brackets); the unit keeps the rest of the integer division, so the gap's
                # total stays whole
                total = sum(w for _, w in split)
                for j, w in split[1:] if total else ():
                    share = gap * w // total
                    self._acc[j].ag_bwd += share
                    own -= share
            a.ag_bwd += own
        if self._bwd_start == 0:
            self._backward_begins(t)
        if idx == self._root:
            self._step_bwds[-1][0] = True
        self._end_backward_with_engine()
        if self.marks is not None:
            self._safe(self.marks.gathered, "memory")

    def _end_backward_with_engine(self) -> None:
        """Queues the autograd engine's callback that ends this backward (_on_backward_end), once per backward:
        called from inside it (a unit's first gradient, or FSDP2's pre-backward log of a unit the doctor's hooks did
        not see)."""
        if not self._bwd_cb_queued:
            self._bwd_cb_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

    def _backward_split(self, idx: int) -> Optional[list[tuple[int, int]]]:
        """At the unit's pre-backward log: the all-gathers the host waits for from there to its first gradient (see
        F2.backward_gathers), each unit's bytes: ``[(idx, its own), (target, its), ...]``; None where the whole span is
        the unit's (nothing prefetched there synchronously, or not modelled): a prefetched unit's own is nothing, the
        span its targets' all-gathers (a root kept gathered read 14.9 ms of backward all-gather wait, all of it the
        prefetch of blocks.3: a new-user trial)."""
        got = F2.backward_gathers(self._units[idx].state, self._sharded_states)
        if not got or not got[1]:
            return None
        of = self._group_units()
        split = [(idx, sum(self._bytes_of(pg) for pg in got[0]))]
        for pg in got[1]:
            j = of.get(id(pg))
            if j is not None and j != idx:  # (another model's group: its share stays here)
                split.append((j, self._bytes_of(pg)))
        return split if len(split) > 1 else None

    def _group_units(self) -> dict[int, int]:
        """id(FSDPParamGroup) -> the index of the watched unit it belongs to (read at the first use after
        index_labels)."""
        if self._unit_of_group is None:
            self._unit_of_group = {id(pg): i for i, u in enumerate(self._units) for pg in u.param_groups}
        return self._unit_of_group

    def _bytes_of(self, pg) -> int:
        n = self._gathered_bytes.get(id(pg))
        if n is None:
            n = self._gathered_bytes[id(pg)] = gathered_bytes(pg)
        return n

    def _backward_begins(self, t: int) -> None:
        # one per backward() call through the model, ended by its engine callback (_on_backward_end): not per graph
        # task id, as reentrant checkpointing runs each unit's recompute and backward in a graph task of its own
        self._close_unseen_forward()  # (a forward timed from FSDP2's logs ends before its backward)
        self._close_unseen_no_grad()
        self._bwd_start = t
        # (kept for the backward's end: one that never reaches the root, a chunked loss's backward through the head
        # alone, leaves the loss phase open)
        self._returned_before, self._returned = self._returned, False
        self.backwards += 1
        # (sync set before the backward: FSDP2's post-backward reads it as it reduces)
        self._step_bwds.append([False, self.gradient_sync()])
        if self.accelerate_sync is not None and not self.accelerate_sync():
            self.accelerate_unsynced += 1
        if self._opt_end and self._opt_after_bwd:  # after an update that followed a backward: not a micro-batch
            self._bwd_after_opt = True

    def _on_backward_end(self) -> None:
        if not self.active:
            return
        try:
            t = _now()
            if self._bwd_start:
                self._backward_ns += t - self._bwd_start
            self._bwd_start = 0
            self._bwd_end = t
            self._bwd_cb_queued = False
            # the eval-mode forwards this backward reached were training (with dropout off, say)
            self._eval_pending = [e for e in self._eval_pending if not e[2][0]]
            for a in self._acc.values():
                a.grad_seen = False
            if self._step_bwds and not self._step_bwds[-1][0]:
                # a backward that did not reach the model's root: torchtitan's chunked loss runs each chunk's backward
                # through lm_head alone, then the next chunk's lm_head forward. The loss phase goes on (a new-user
                # trial's peak in the 2nd of 8 chunks read "outside the units, in_forward", and memory.temporaries
                # named no lever for it)
                self._returned = self._returned_before
            if self.marks is not None:
                self.marks.mark(None, "backward_end")
        except Exception as e:  # noqa: BLE001
            self._fail("backward end", e)

    def _parse_fsdp_log(self, msg: str) -> tuple[str, int] | None:
        """("FSDP::pre_backward (layers.0)" -> ("pre_backward", unit index)); None for labels the doctor does not
        use."""
        lab = parse_label(msg)
        if lab is None or lab.kind not in _LOGGED_KINDS:
            return None
        fqn = lab.fqn or ""
        if fqn not in self._unit_of_label:
            self._unit_of_label = label_to_index(self._units)
        idx = self._unit_of_label.get(fqn)
        return None if idx is None else (lab.kind, idx)

    def _other_model_log(self, msg: str, t: int, group: int) -> None:
        """Another FSDP model's label: its forward and backward spans (the outermost of its open units) add up as
        ``other_models_ms``, its work inside the watched model's step."""
        kind = self._kinds.get(msg)
        if kind is None:
            lab = parse_label(msg)
            kind = self._kinds[msg] = lab.kind if lab is not None else ""
        if kind in ("pre_forward", "pre_backward"):
            if not self._other_open:
                self._other_t0 = t
            self._other_open.add(group)
        elif kind in ("post_forward", "post_backward") and group in self._other_open:
            self._other_open.discard(group)
            if not self._other_open:
                self._other_ns += t - self._other_t0

    def _on_fsdp_log(self, msg: str, t: int, group=None) -> None:
        mine = None
        if group is not None:  # the param group that logged it: one of the watched model's units, or another model's
            # (a GAN's discriminator's blocks.0 logs the label of the generator's blocks.0: its backward was booked to
            # the generator's units, a new-user trial)
            mine = self._group_units().get(id(group))
            if mine is None:
                self._other_model_log(msg, t, id(group))
                return
        # The same few label strings recur every step: parse each once.
        try:
            parsed = self._log_cache[msg]
        except KeyError:
            parsed = self._log_cache[msg] = self._parse_fsdp_log(msg)
        if parsed is None:
            return
        kind, idx = parsed
        if mine is not None:
            idx = mine
        if kind in _FORWARD_KINDS:
            if idx in self.fsdp_timed:
                self._logged_forward(kind == "pre_forward", idx, t)
            elif not self._acc[idx].fwd_depth and idx not in self.timed_compiled:  # (none of the doctor's hooks ran)
                self._unseen_forward(kind == "pre_forward", idx, t)
            return
        a = self._acc[idx]
        if kind == "pre_backward":
            if self._bwd_start == 0:
                self._backward_begins(t)
            if idx == self._root:
                self._step_bwds[-1][0] = True
            if idx in self.frame_unseen:
                # no gradient hook of the doctor's on such a unit's outputs (its post-forward hook did nothing) queues
                # the engine callback that ends the backward: queued here, inside the backward, as FSDP2 queues its own
                self._end_backward_with_engine()
            if not a.t_pre_bwd:
                a.t_pre_bwd = t
                a.bwd_split = self._backward_split(idx)
                if self.gpu is not None:
                    self.gpu.open(idx, 1)
            if self.marks is not None:
                self.marks.mark(self._units[idx].name, "backward_start")
        else:
            if a.t_pre_bwd:
                a.bwd += t - a.t_pre_bwd
                a.t_pre_bwd = 0
                if self.gpu is not None:
                    self.gpu.close(idx, 1)
            if self.marks is not None:
                self.marks.mark(self._units[idx].name, "backward_end")

    def _logged_forward(self, start: bool, idx: int, t: int) -> None:
        """FSDP2 logged a unit's pre-forward (``start``) or post-forward, where the unit runs inside another module's
        compiled frame (``fsdp_timed``). FSDP2's hooks run outside compiled code (Dynamo does not trace them: the
        graph breaks at each), so the span from the first log to the second is the unit's forward as it ran: its
        all-gather, issued and waited for at the start of the pre-forward, and its compute, up to its reshard; the
        wait is not known apart (nothing of FSDP's marks its end). A grouped unit's modules each open and close it.
        Training forwards only, as the unit hooks' are: not inside a forward without gradients, nor a recompute."""
        if self._no_grad_t0 or in_backward():
            return
        a = self._acc[idx]
        if start:
            if not a.t_outer:
                a.t_outer = t
                if self.gpu is not None:
                    self.gpu.open(idx, 0)
        elif a.t_outer:
            a.fwd += t - a.t_outer
            a.calls += 1
            a.t_outer = 0
            if self.gpu is not None:
                self.gpu.close(idx, 0)

    def _unseen_forward(self, start: bool, idx: int, t: int) -> None:
        """FSDP2 logged a unit's pre-forward (``start``) or post-forward with none of the doctor's hooks around it: the
        unit's hooks, the doctor's among them, ran inside a compiled frame the doctor was not given, where its hooks
        return at once (``frame_unseen``). In a training forward (not one without gradients, nor a recompute in
        backward) the unit is timed from FSDP2's logs from its first such pre-forward on, as an ``fsdp_timed`` unit is
        (_logged_forward). Where the model's forward is not timed by its own hooks either (``forward_unseen``), the
        step's forward is timed from the same logs: from the first unit's pre-forward to the last post-forward before
        the backward begins (the root's post-forward, where the root holds parameters and logs one: its span is the
        whole forward), the forward counted and its start taken as the model's hooks would (_forward_begins). A
        forward without gradients there (evaluation through the compiled wrapper) is timed as one (_unseen_no_grad)."""
        if self._no_grad_t0 or in_backward():
            return
        if not torch.is_grad_enabled():
            self._unseen_no_grad(start, idx, t)
            return
        if start:
            self._close_unseen_no_grad()
            self.frame_unseen.add(idx)
            if not self._unseen_t0 and not self._fwd_start:  # (the model's own hooks did not open its forward)
                self.forward_unseen = True
                self._unseen_t0 = t
                self.train_forwards += 1
                self._forward_begins(t)
        elif idx not in self.frame_unseen:
            return
        elif self._unseen_t0:
            self._unseen_end = t
        self._logged_forward(start, idx, t)
        if not start and idx == self._root:
            self._close_unseen_forward()

    def _unseen_no_grad(self, start: bool, idx: int, t: int) -> None:
        """FSDP2 logged a unit's pre-forward (``start``) or post-forward without gradients, none of the doctor's hooks
        around it, in a unit already seen training in a compiled frame the doctor was not given (``frame_unseen``):
        a forward without gradients there, which the model's hooks would have timed apart from the step's forward
        and the time outside the model (an evaluation through the compiled wrapper read "time outside the model
        +26.4 ms (data loading or user code)" and a recurring stop outside the model: a new-user trial). Each such
        forward runs from its first unit's pre-forward to the last post-forward before the next one (the root's,
        where the root holds parameters); the next begins where that first unit logs its pre-forward again after
        another unit's logs. The time between them (the evaluation's own batches) stays outside."""
        if idx not in self.frame_unseen:  # (not yet seen training there: a unit called on its own, say)
            return
        if start:
            if self._ng_unseen_t0 and idx == self._ng_unseen_entry and self._ng_unseen_last != idx:
                self._close_unseen_no_grad()  # the next forward begins
            if not self._ng_unseen_t0:
                self._ng_unseen_t0, self._ng_unseen_entry = t, idx
        elif self._ng_unseen_t0:
            self._ng_unseen_end = t
            if idx == self._root:
                self._close_unseen_no_grad()
        self._ng_unseen_last = idx

    def _close_unseen_no_grad(self) -> None:
        """The forward without gradients timed from FSDP2's logs (_unseen_no_grad) ends at its last post-forward: its
        time is counted as the model's post-hook counts one (_model_post)."""
        if self._ng_unseen_t0 and self._ng_unseen_end > self._ng_unseen_t0:
            self._count_no_grad(self._ng_unseen_end - self._ng_unseen_t0)
        self._ng_unseen_t0 = self._ng_unseen_end = 0
        self._ng_unseen_entry = self._ng_unseen_last = None

    def _close_unseen_forward(self) -> None:
        """The forward timed from FSDP2's logs (_unseen_forward) ends at the last post-forward logged in it."""
        if self._unseen_t0 and self._unseen_end > self._unseen_t0:
            self._forward_ns += self._unseen_end - self._unseen_t0
        self._unseen_t0 = self._unseen_end = 0

    def _forward_begins(self, t: int) -> None:
        """A training forward of the model starts at ``t``: the step's first, or the next micro-batch's (the gap since
        the last backward)."""
        if not self._first_fwd:
            self._first_fwd = t
        elif self._bwd_end and not self._opt_end:  # the next micro-batch: the gap since the last backward
            self._micro_gap_ns += t - self._bwd_end
        self._bwd_end = 0

    def _model_pre(self, module, args, kwargs=None):
        if self.active and not _compiling() and not in_backward():
            if not torch.is_grad_enabled():  # evaluation or generation, between training steps or inside one
                self._no_grad_t0 = _now()
                return
            self._no_grad_t0 = 0  # (one that raised never reached its post-hook)
            self._returned = False
            self.train_forwards += 1
            if self._child_pending:
                self._safe(lambda: self._probe_children(module), "checkpoint watch")
            # a new step's first forward, maybe
            if (self._opt_end or self.zeroed_check) and self.step_boundary is not None:
                self._safe(lambda: self.step_boundary(_now()), "step")
            try:  # the batch's size: FLOPs counted on one step scale by it, the memory probe reads it (variable shapes)
                elements = _elements(args, kwargs)
            except Exception as e:  # noqa: BLE001
                elements = 0
                self._fail("throughput", e)
            if module.training:
                self._eval_open = None
                self._settle_eval()  # the eval-mode forwards before this one had no backward: evaluation
                self._input_elems += elements
                if self._input_shape is None:  # the step's first: the length a chunked loss splits
                    self._input_shape = _first_shape(args, kwargs)
            else:
                self._eval_open = self._unit_figures()
            self._fwd_start = _now()
            self._forward_begins(self._fwd_start)
            if self.marks is not None:
                # the batch's size first: a light memory step whose input outgrows the full steps' is measured in
                # full (variable sequence lengths: a new-user trial's 1024-token steps among 64-token ones replayed
                # the short steps' 6.80 MiB where 87.82 MiB was the peak)
                self._safe(lambda: self.marks.model_input(elements), "memory")
                self._safe(lambda: self.marks.mark(None, "forward_start"), "memory")

    def _count_no_grad(self, dt: int) -> None:
        """A forward without gradients of ``dt`` ns: counted apart from the step's forward and the time outside."""
        self._no_grad_ns += dt
        self._no_grad_count += 1
        if not self._first_fwd:  # before the step's first training forward
            self._ng_pre_ns += dt
        elif self._opt_end:  # after an optimizer.step() (until the next one)
            self._ng_post_ns += dt

    def _model_post(self, module, args, output):
        if self._no_grad_t0:
            if self.active:
                self._count_no_grad(_now() - self._no_grad_t0)
            self._no_grad_t0 = 0
            return
        if self.active and not _compiling() and not in_backward() and self._fwd_start:
            dt = _now() - self._fwd_start
            self._forward_ns += dt
            self._fwd_start = 0
            if self._eval_open is not None:
                try:
                    reached = self._watch_output(output)
                except Exception as e:  # noqa: BLE001 - then it stays a training forward
                    reached = [True]
                    self._fail("eval-mode forward", e)
                self._eval_pending.append((dt, self._unit_delta(self._eval_open), reached))
                self._eval_open = None
            self._returned = True
            if self.marks is not None:  # the loss phase: from here to the first backward mark
                self._safe(lambda: self.marks.mark(None, "loss_start"), "memory")

    def _unit_figures(self) -> list[tuple]:
        """What a forward adds to each unit's accumulators: forward time, all-gather wait, calls, checkpointed
        submodules' forward time."""
        return [(a.fwd, a.ag_fwd, a.calls, a.child_fwd) for a in self._acc.values()]

    def _unit_delta(self, before: list[tuple]) -> list[tuple]:
        """Per unit, what the forward since ``before`` added to its figures."""
        return [tuple(x1 - x0 for x0, x1 in zip(b, a)) for b, a in zip(before, self._unit_figures())]

    @staticmethod
    def _watch_output(output) -> list[bool]:
        """A flag that turns True when a backward reaches the forward's output (it stays False when nothing in
        the output can take a gradient)."""
        reached = [False]

        def hook(grad):
            reached[0] = True

        _hook_grads(output, hook)
        return reached

    def _settle_eval(self) -> None:
        """The eval-mode forwards no backward reached were evaluation: their time leaves the step's forward and
        the units' figures and counts as forwards without gradients."""
        for dt, delta, _ in self._eval_pending:
            self._forward_ns -= dt
            self._no_grad_ns += dt
            self._no_grad_count += 1
            self._autograd_eval_count += 1
            for i, (f, w, c, k) in enumerate(delta):
                a = self._acc[i]
                a.fwd -= f
                a.ag_fwd -= w
                a.calls -= c
                a.child_fwd -= k
        self._eval_pending.clear()

    def _opt_pre(self, optimizer, args, kwargs):
        if not self.active:
            return None
        at = 1 if args and args[0] is optimizer else 0  # (torch passes the step's own arguments, self first)
        closure = kwargs.get("closure") if "closure" in kwargs else (args[at] if len(args) > at else None)
        if callable(closure):
            # optimizer.step(closure): the closure runs the forward and backward inside the step (Lightning's
            # Trainer steps every optimizer so; LBFGS). The optimizer's time starts when it returns, and each call
            # of it (LBFGS calls it again) pauses that time: timed from the step's entry, a new-user trial's
            # Trainer read optim 103.5 ms of a 107.9 ms step (its forward and backward twice over), no time
            # outside the model, and a memory timeline whose optimizer_start came before the forward
            timed = _timed_closure(closure, self._opt_pause, self._opt_begin)
            if "closure" in kwargs:
                return args, {**kwargs, "closure": timed}
            return (*args[:at], timed, *args[at + 1:]), kwargs
        self._opt_begin()
        return None

    def _opt_begin(self) -> None:
        """The optimizer's own work starts: at ``optimizer.step()``'s entry, or as the closure it was given returns."""
        if self.active:
            self._opt_start = _now()
            if self.gpu is not None:
                self.gpu.optimizer_begin()
            if self.marks is not None:
                self._safe(lambda: self.marks.mark(None, "optimizer_start"), "memory")

    def _opt_pause(self) -> None:
        """The step's closure is called: the time until it returns is its forward's, backward's and the loop's."""
        if self.active and self._opt_start:
            self._optimizer_ns += _now() - self._opt_start
            self._opt_start = 0

    def _opt_post(self, optimizer, args, kwargs):
        if self.active and self._opt_start:
            self._opt_end = _now()
            self._ng_post_ns = 0
            self._optimizer_ns += self._opt_end - self._opt_start
            self._opt_start = 0
            self._opt_after_bwd = self._opt_after_bwd or self._backward_ns > 0
            self.optimizer_steps += 1
            if self.gpu is not None:
                self.gpu.optimizer_end()
            if self.marks is not None:
                self._safe(lambda: self.marks.mark(None, "optimizer_end"), "memory")

    def _gc_cb(self, phase, info):
        if not self.active:
            return
        if phase == "start":
            self._gc_start = _now()
            # the collector off (gc.disable()), only the loop's own gc.collect() calls collect: a new-user trial
            # that pasted jitter.gc's fix was told to disable the collector again for them
            self._gc_disabled = not gc.isenabled()
        elif self._gc_start:
            dt = _now() - self._gc_start
            self._gc_ns += dt
            self._gc_count += 1
            self._gc_start = 0
            if info.get("generation") == 2:
                self._gc_full_ns += dt
            self._gc_collected += info.get("collected", 0)
            if self._gc_disabled:
                self._gc_disabled_ns += dt
                self._gc_disabled_count += 1


    def begin_step(self) -> None:
        self._forward_ns = self._backward_ns = self._optimizer_ns = self._gc_ns = self._no_grad_ns = 0
        self._ib_start = self._ib_ns = 0
        self._gc_count = self._no_grad_count = self._autograd_eval_count = 0
        self._gc_full_ns = self._gc_collected = self._gc_disabled_ns = self._gc_disabled_count = 0
        self._gc_disabled = False
        self._ng_gather_ns = 0  # FSDP's pre-forward all-gathers inside forwards without gradients
        self._ng_gathers, self._ng_units = 0, set()  # ... the units entered not gathered, and those entered
        # the model's forward entered in eval mode with autograd on: evaluation that forgot torch.no_grad(), unless
        # a backward follows (training with model.eval()). Recorded like a training forward; once the loop moves on
        # (a training forward, the step's end) without a backward, it is taken out of forward_ms and the units'
        # figures and counted as a forward without gradients. The units' figures at its start:
        self._eval_open: Optional[list[tuple]] = None
        # such forwards no backward has reached yet: (ns, units' deltas, [reached by a backward])
        self._eval_pending: list[tuple[int, list[tuple], list[bool]]] = []
        self._fwd_start = self._bwd_start = self._opt_start = self._gc_start = 0
        self._first_fwd = self._opt_end = self._bwd_end = self._micro_gap_ns = 0
        self._input_elems = 0  # the elements of the training forwards' tensor arguments
        self._input_shape: Optional[list[int]] = None  # the first one's first tensor's shape
        self._step_bwds = []
        self._opt_after_bwd = self._bwd_after_opt = False
        self._ng_pre_ns = self._ng_post_ns = 0  # no-grad forwards' time before the first forward, after the last step
        self._loose_open = self._loose_t0 = 0  # units open outside the model's forward, and the outermost's start
        self._returned = False  # the model's training forward returned and no backward has begun since
        self._returned_before = False  # ... as it was when the backward now running began
        # a forward timed from FSDP2's logs (_unseen_forward): its first pre-forward, its last post-forward so far
        self._unseen_t0 = self._unseen_end = 0
        # ... and one without gradients (_unseen_no_grad): its start, its last post-forward so far, the unit whose
        # pre-forward opened it, the unit logged last
        self._ng_unseen_t0 = self._ng_unseen_end = 0
        self._ng_unseen_entry: Optional[int] = None
        self._ng_unseen_last: Optional[int] = None
        self._bwd_cb_queued = False
        self._other_ns = 0  # another FSDP model's forward and backward in this step (its spans that ended in it)
        self._other_open.clear()  # (a span left open, its post label never logged, never spans the steps after)
        for a in self._acc.values():
            a.reset()
        self._unit_compiles = {}
        if self.gpu is not None:
            self.gpu.begin_step()

    @property
    def last_optimizer_end_ns(self) -> int:
        """When the step's last optimizer.step() ended (0: none yet)."""
        return self._opt_end or 0

    def timings(self) -> StepTimings:
        """The step's timings: the phases' and, per unit, forward, backward, their unshard waits, recompute."""
        self._close_unseen_forward()
        self._close_unseen_no_grad()
        self._settle_eval()  # the step ends: eval-mode forwards no backward followed were evaluation
        units = [
            UnitStep(name=u.name, fwd_ms=_ms(a.fwd), ag_wait_fwd_ms=_ms(a.ag_fwd), bwd_ms=_ms(a.bwd),
                     ag_wait_bwd_ms=_ms(a.ag_bwd), recompute_ms=_ms(self._recompute_ns(a, i in self.selective)),
                     fwd_calls=a.calls)
            for i, u, a in ((i, self._units[i], self._acc[i]) for i in range(len(self._units)))
        ]
        return StepTimings(forward_ms=_ms(self._forward_ns), backward_ms=_ms(max(0, self._backward_ns - self._ib_ns)),
                           optimizer_ms=_ms(self._optimizer_ns), gc_ms=_ms(self._gc_ns), gc_count=self._gc_count,
                           gc_full_ms=_ms(self._gc_full_ns), gc_collected=self._gc_collected,
                           gc_disabled_count=self._gc_disabled_count, gc_disabled_ms=_ms(self._gc_disabled_ns),
                           units=units, no_grad_ms=_ms(self._no_grad_ns), no_grad_forwards=self._no_grad_count,
                           no_grad_gather_ms=_ms(self._ng_gather_ns), no_grad_gathers=self._ng_gathers,
                           no_grad_units=len(self._ng_units),
                           autograd_eval_forwards=self._autograd_eval_count, first_forward_ns=self._first_fwd,
                           last_optimizer_end_ns=self._opt_end, micro_gap_ms=_ms(self._micro_gap_ns),
                           no_grad_between_ms=_ms(self._ng_pre_ns + (self._ng_post_ns if self._opt_end else 0)),
                           backward_after_optimizer=self._bwd_after_opt, other_models_ms=_ms(self._other_ns),
                           input_elements=self._input_elems, input_shape=self._input_shape,
                           **self._model_backwards(),
                           unit_compiles={self._units[i].name: n for i, n in sorted(self._unit_compiles.items())})

    def _model_backwards(self) -> dict[str, int]:
        """The step's backward passes through the model and those begun with gradient sync on: where the watched
        model is a unit, the backward() calls that reached it (torchtitan's chunked loss calls backward() once per
        chunk of the sequence through its [norm, output] unit alone, gradient sync off but on the last, then once
        through the model: 9 backward passes, 2 synced, read for one micro-batch's 1 and 1); else, or where none
        reached it (its hooks unseen), every call."""
        through = [synced for root, synced in self._step_bwds if root] or [synced for _, synced in self._step_bwds]
        return {"backwards": len(through), "synced_backwards": sum(through)}

    def gradient_sync(self) -> bool:
        """Whether every unit reduce-scatters its gradients in backward (FSDP2's gradient sync on, which
        ``set_requires_gradient_sync`` turns off): attribute reads only."""
        return all(F2.reduce_grads(pg) for u in self._units for pg in u.param_groups)

    def index_labels(self) -> None:
        """(Re)reads which FSDP label names which unit (after FSDP's lazy init, at the first step)."""
        self._unit_of_label = label_to_index(self._units)
        self._unit_of_group = None


def _ms(ns: int) -> float:
    """Nanoseconds to milliseconds, kept to the microsecond."""
    return round(ns * 1e-6, 3)


def _hook_grads(output, hook) -> None:
    """Registers ``hook`` on every tensor of ``output`` (nested in tuples, lists, dicts, dataclasses) that can take
    a gradient."""
    tensors: list = []
    _collect_tensors(output, tensors)
    for t in tensors:
        if t.requires_grad:
            t.register_hook(hook)


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
