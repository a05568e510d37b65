"""Memory by category: where every byte of an FSDP2 step goes, per rank, per unit and phase.

The :class:`MemoryProbe` is driven by the :class:`~fsdp_doctor.record.tracker.Doctor`: it calls
``mark(unit, phase)`` at FSDP's own hook boundaries and ``step_end(step)`` once per step. At every mark
the probe samples these categories (bytes on this rank's device):

``sharded_params``
    the local shards FSDP keeps (``FSDPParam._sharded_param_data``, padding included) plus every model
    parameter no FSDP unit manages.
``unsharded_params``
    all-gathered parameters alive now: units whose param group is UNSHARDED (the all-gather output
    storages, measured once per group) or SHARDED_POST_FORWARD (the smaller-world copy).
``sharded_grads`` / ``unsharded_grads``
    the reduce-scattered gradients on the sharded parameters (unique storages: FSDP views them out of one
    flat reduce-scatter output per unit), and the full gradients of unsharded parameters that have not
    been reduced yet (transient in backward; they stay when gradient sync is off).
``optimizer_state``
    every tensor in ``optimizer.state`` of a model parameter (local bytes of DTensors), and of another FSDP2 model's
    that the optimizer holds beside them (one optimizer over a GAN's two networks); an optimizer holding none of the
    model's parameters is another model's, its state not counted.
``stale_optimizer_params``
    tensors an optimizer created *before* ``fully_shard`` holds: its params are the old full tensors the
    model no longer uses (plus their grads and state). Kept apart so the bug is visible.
``activations``
    tensors saved for backward and alive, counted exactly by an outer
    ``torch.autograd.graph.saved_tensors_hooks`` pair: each storage once, parameters and any storage shared
    with a parameter skipped (FSDP2 saves its unsharded weights as views), storages freed by a reshard
    count 0. A saved tensor's bytes are removed when autograd drops its packed handle (the handle's
    ``__del__``), so the running counter is exact during backward too. Under activation checkpointing
    the checkpoint's inner hooks take precedence: only what checkpointing keeps (its inputs) is counted,
    which is what is alive; what a selective checkpoint's policy saves, which it keeps in a cache of its own
    (outside autograd's saved tensors: no hook sees it), is counted from its region's end until it dies.
``comm_buffers``
    FSDP's collective buffers in flight: the all-gather output kept for copy-out overlap
    (``comm_ctx.all_gather_state``), pending (prefetched) all-gather results, reduce-scatter inputs kept
    by ``comm_ctx.reduce_scatter_states``, and HSDP all-reduce / partial-reduce buffers; on CPU full steps also
    the all-gather outputs and reduce-scatter inputs FSDP released and the backend still holds (gloo's worker
    thread drops a finished collective's tensors when it is next scheduled: ``transients.HighWater.comm_alive``).
``buffers``
    the model's registered buffers.
``temporaries``
    everything else alive (autograd's gradient temporaries, op workspaces, unsaved outputs, tensors held by
    user code): on CUDA ``torch.cuda.memory_allocated()`` minus every category above; on CPU, on full steps,
    the high-water counter's (``transients.py``: the step's first mark anchors it), else 0.

Between two marks (a unit's op temporaries, the loss phase from ``loss_start`` to the first backward mark,
the root's reduce-scatter buffer in its post-backward) the high-water counter of full steps keeps the
highest bytes; when they rise above both marks they become a sample of their own (phase ``in_forward``,
``in_loss``, ``in_backward``, ``in_optimizer``, ``after_optimizer``), replayed by light steps. A unit's first
backward gradient (``gathered``: FSDP's pre-backward has gathered it) splits its interval: a high-water after it
takes that moment's named categories.

``offloaded_host`` (host memory, reported apart): tensors of the categories above that live on the host
while the model computes on an accelerator (``CPUOffloadPolicy`` params and grads, optimizer state on the
host). On a CPU run every tensor is "device" memory and ``offloaded_host`` is 0.

On CUDA each step also records ``allocated`` / ``reserved`` / fragmentation (reserved - allocated, the
allocator's inactive split bytes, the largest free cached block from ``torch.cuda.memory_snapshot()`` on
some steps) and the process's device memory outside PyTorch's allocator from NVML (``nvidia-ml-py``,
imported lazily; its absence is normal). Those CUDA/NVML paths are written against the documented APIs but
could not be exercised on the CPU-only machine this was developed on.

Cost: Python code run between large tensor ops runs with cold caches (a mark that takes 2 us in a tight
loop takes 10-30 us inside a training step), and the pack hook adds ~3 us per saved tensor. So the probe
alternates *full* steps, where every figure is measured at every mark and saved tensors are counted
exactly, with *light* steps, where a mark only notes when and where it happened (on CUDA, at a few marks, the
allocator's total: ``sampler.py`` says which) and the figures of the same mark of the last full step are
replayed: FSDP's schedule repeats, so they are the same; a mark that does not line up is reported
(``replay_mismatches``) and forces a full step next. Steps 0-2 are full; then (``full_every="auto"``) the
period is chosen from the measured costs so that the probe costs at most ``budget`` (0.3%) of the median
step time. Within a full step, per-unit byte sizes are cached, gradients are re-measured only for the units
whose backward just ran (and cached by unit after the first steps), the optimizer state only when its size
changes; everything is re-measured every ``refresh_every`` steps.

Options (``watch(memory={...})``): ``full_every`` ("auto", or N: every Nth step; steps 0-2 are always full: step 0 runs FSDP's lazy init
and has no optimizer state yet), ``budget``, ``timeline_every`` (store
every sample of every Nth full step, default 50; full steps 0-2 and every step that raises the running
peak are stored too), ``refresh_every`` (default 50), ``fragmentation_every`` (CUDA memory snapshot for
the largest free block, default 200; 0 = never), ``nvml`` (default True), ``transients`` (the high-water
between marks on full steps, default True).

The step's figures (``StepRecord.memory``) are :class:`fsdp_doctor.records.MemoryStep`.

The probe composes five collaborators behind its two calls (``mark``, ``step_end``): ``FsdpSizes``
(``sizes.py``: FSDP byte sizes through the adapter), ``SavedTensors`` (``activations.py``: the
saved-tensor counter), ``Sampler`` (``sampler.py``: full vs replayed steps, the budget) and
``DeviceStats`` (``device.py``: CUDA/NVML), and ``HighWater`` (``transients.py``: the high-water between marks).
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any

import torch

from ... import memory_categories as MC
from ...records import CastCopies, MemoryPeak, MemoryStep, MemoryTimeline
from .. import fsdp2 as F2
from .activations import SavedTensors
from .device import DeviceStats
from .sampler import UNREAD, Sampler
from .sizes import FsdpSizes
from .transients import HighWater
from ..units import compile_blocker, compiled_module
from ..phase import in_backward
from ..run_device import run_device

log = logging.getLogger("fsdp_doctor")
_now = time.perf_counter_ns

MEMORY_FORMAT = 2  # 2: MemoryStep.autocast and cast_copies are read (their absence then means none)

#: device categories, in the order of every sample row (defined in fsdp_doctor.memory_categories)
CATEGORIES = MC.DEVICE
HOST_CATEGORIES = MC.HOST

_DEFAULTS = {
    "full_every": "auto",
    "budget": 0.003,  # "auto": the probe may cost this fraction of the median step time
    "timeline_every": 50,
    "refresh_every": 50,
    "fragmentation_every": 200,
    "nvml": True,
    "first_timeline_steps": 3,
    "transients": True,  # full steps count what lives between two marks (transients.py)
}
#: a light step whose batch has this many times the elements of every full step's is measured in full
INPUT_GROWTH = 1.25
#: where a peak between two marks lies, by the phase of the mark before it
_INSIDE = {"forward_start": "in_forward", "forward_end": "in_forward", "recompute_start": "in_forward",
           "recompute_end": "in_forward", "loss_start": "in_loss", "backward_start": "in_backward",
           "backward_end": "in_backward", "optimizer_start": "in_optimizer", "optimizer_end": "after_optimizer"}
_ACT = CATEGORIES.index("activations")


def _enclosing(samples) -> list:
    """Per mark, the unit whose forward or backward the interval after it lies in: the mark's own unit after its
    start, the unit still open around it after its end (after the last block's forward_end, the root's forward: its
    head and, where the model computes it, the loss; a high-water there read "model.layers.1 in_forward" for an HF
    Llama's loss: a new-user trial), None outside every unit."""
    out, open_ = [], []
    for s in samples:
        unit, phase = s[1], s[2]
        if phase in ("forward_start", "backward_start", "recompute_start"):
            open_.append(unit)
            out.append(unit)
        elif phase in ("forward_end", "backward_end", "recompute_end"):
            for j in range(len(open_) - 1, -1, -1):  # (the innermost open span of that unit)
                if open_[j] == unit:
                    del open_[j]
                    break
            out.append(open_[-1] if open_ else None)
        else:  # loss_start, optimizer marks: outside every unit
            open_.clear()
            out.append(unit)
    return out


def _options(option: Any) -> dict:
    opts = dict(_DEFAULTS)
    if isinstance(option, dict):
        unknown = set(option) - set(_DEFAULTS)
        if unknown:
            raise ValueError(f"watch(memory=...): unknown option(s) {sorted(unknown)}; known: {sorted(_DEFAULTS)}")
        opts.update(option)
    for k in ("timeline_every", "refresh_every", "fragmentation_every", "first_timeline_steps"):
        opts[k] = max(0, int(opts[k]))
    if opts["full_every"] != "auto":
        opts["full_every"] = max(1, int(opts["full_every"]))
    opts["budget"] = float(opts["budget"])
    return opts


def _never(step: int) -> bool:
    return False


def _ignore_mark(unit, phase) -> None:
    """A detached probe's ``mark``."""


class MemoryProbe:
    """Samples memory by category at the hooks' marks; one instance per watched rank: the model, its optimizer
    (or None) and its FSDP units (:class:`fsdp_doctor.record.units.Unit`)."""

    def __init__(self, model, optimizer, units, option):
        self.opts = opts = _options(option)
        self.model = model
        self.units = list(units)
        self.unit_names = [u.name for u in self.units]
        self.unit_index = {u.name: i for i, u in enumerate(self.units)}
        self.device = run_device(self.units)  # the process group's device (a GPU under CPUOffloadPolicy)
        self.is_cuda = self.device.type == "cuda"
        host_is_device = self.device.type == "cpu"
        self.sizes = FsdpSizes(model, optimizer, self.units, host_is_device)
        self.acts = SavedTensors(self.sizes.param_keys, host_is_device, self.sizes.unsharded_keys)
        self.live = self.acts.live  # the running saved-bytes counter
        self.sampler = Sampler(opts["full_every"], opts["budget"], self.is_cuda)
        self.dev = DeviceStats(self.device, opts["fragmentation_every"], opts["nvml"])
        self._allocated = self.dev.allocated  # the allocator's total at a mark (CUDA; 0 elsewhere)
        self._model = weakref.ref(model)  # read at each full step: compile_blocker
        self.hw = HighWater(self.device, self.live) if opts["transients"] else None
        self._hw_note = None
        self._hw_used = False  # the high-water ran this step
        self._anchor: int | None = None  # this step's total minus the counter, at its first counted mark
        # (sample index, anchor, total) of the last counted mark, and the named categories of the last point inside
        # the interval it opens (None: the mark's own)
        self._open: tuple[int, int, int, list | None] | None = None
        self._segs: list[tuple] = []  # the high-waters of the interval's parts before its last point (see gathered)
        # (after sample index, t, bytes, saved bytes, left, right) between two marks; left / right: the named
        # categories at the points around it (None: the marks')
        self._transients: list[tuple] = []
        self._later = None  # detach() inside backward: the global forward pre-hook that finishes it
        self._full = True  # this step measures everything (else: replays the last full step)
        self._input_full = 0  # the largest batch a full step's forward took (elements; see model_input)
        self._step_input = 0
        self.step_idx = 0
        self._samples: list[tuple] = []
        self._t0 = _now()
        self._cost_ns = 0
        self._running_peak = -1
        self.traced = _never  # whether a step is inside a profiler window (the recorder sets it)
        self._begin(0)

    # ------------------------------------------------------------------ probe interface
    def unit_input(self, unit: str, args: tuple) -> None:
        """A unit's forward inputs on a full step (not a recompute): the bytes of their tensors' storages, each once,
        parameters aside: what checkpointing the unit would keep of its forward (ac.recommended's prediction; a
        conv block keeps a quarter of its activations as input where a transformer layer's 1/16 was assumed)."""
        if not self._full or in_backward():
            return
        t = _now()
        try:
            idx = self.unit_index.get(unit)
            if idx is not None:
                seen, n = set(), 0
                for a in args:
                    if isinstance(a, torch.Tensor) and not isinstance(a, torch.nn.Parameter):
                        st = a.untyped_storage()
                        k = st._cdata
                        if k not in seen:
                            seen.add(k)
                            n += st.nbytes()
                self.acts.unit_input(idx, n)
        except Exception:  # noqa: BLE001 - a DTensor or subclass input: that unit's figure is left out
            pass
        self._cost_ns += _now() - t

    def mark(self, unit: str | None, phase: str) -> None:
        t = _now()
        if not self._full:
            # light step: when and where only (+ the allocator total on CUDA); the figures are replayed
            if phase[0] == "f" and in_backward():
                phase = "recompute_start" if phase == "forward_start" else "recompute_end"
            elif phase == "optimizer_start" and self.acts.pushed:
                self.acts.pop()
            samples = self._samples
            samples.append((t, unit, phase, self._allocated() if len(samples) in self._reads_at else UNREAD))
            self._cost_ns += _now() - t
            return
        sizes = self.sizes
        idx = self.unit_index.get(unit) if unit is not None else None
        if phase == "forward_start":
            if idx is None:
                self._on_step_forward()
            elif in_backward():
                phase = "recompute_start"
                # the unit re-running its forward owns what the recompute saves: a reentrant checkpoint(block, x)
                # called from the root's forward recomputes the block before the block's own backward starts, and
                # every block's recompute was booked on the root (ac.unneeded then estimated 3x the peak without
                # checkpointing: a new-user trial)
                if self.hw is not None:
                    self.hw.recompute_of(idx)
            else:
                if not self._fwd_seen:
                    # the step's first unit forward with no forward of the watched module before it: a container of
                    # models called one by one (a teacher and its student), whose forward never runs. The step's
                    # forward starts here: without it the gradients the optimizer's zero_grad freed read as kept (a
                    # new-user trial's 129.50 KiB of the student's, memory.grads_kept on a loop calling
                    # opt.zero_grad()), and no activations were counted ("activations off", a 703 KiB peak where
                    # the student alone peaked at 909 KiB with 537 KiB of activations)
                    self._on_step_forward()
                if not sizes.static_done:
                    sizes.refresh_static(final=False)
                if idx not in sizes.keys_built:
                    sizes.add_unit_param_keys(idx)
                self.acts.unit_forward_start(idx)
        elif phase == "forward_end":
            if in_backward():
                phase = "recompute_end"
            elif idx is not None:
                self.acts.unit_forward_end(idx)
        elif phase == "backward_start":
            self.acts.backward_start()
            if sizes.pending:
                sizes.flush_pending()
            if self._fwd_seen and not self._bwd_seen and sizes.static_done:
                self._grads_freed_in_forward()
            self._bwd_seen = self._step_bwd = True
            if idx is not None:
                self._in_bwd.append(idx)
                self._own_recompute()
        elif phase == "backward_end":
            if sizes.pending:
                sizes.flush_pending()
            if idx in self._in_bwd:
                self._in_bwd.remove(idx)
                self._own_recompute()
            if idx is not None:
                sizes.before_post_backward(idx)
            elif sizes.unmanaged:
                sizes.measure_unmanaged_grads()
        elif phase == "optimizer_start":
            if sizes.pending:
                sizes.flush_pending()
            self.acts.pop()
        elif phase == "optimizer_end":
            sizes.refresh_optimizer(force=self.step_idx < 2)
        self._sample(t, unit, phase)
        if phase == "optimizer_end" and self.hw is not None and self.hw.active:
            # inert from here, and popped at the step's end: this mark runs inside optimizer.step(), which the user
            # may compile (torch.compile(optimizer.step)); a dispatch mode popped inside a compiled frame left
            # torch's dispatch state for the frame's exit to restore, and the next operator without a tensor
            # (zero_grad's record_function) raised an INTERNAL ASSERT: training stopped (a new-user trial's case)
            self.hw.stop(pop=False)
            self._open = None
        self._cost_ns += _now() - t

    def compiled_call(self, unit: str, start: bool, args: tuple = ()) -> None:
        """A unit compiled in place enters (``start``, its positional inputs ``args``) or leaves its compiled call,
        on a full step: its forward's saves counted from outside the frame, where its own marks do not run (the
        blocks' activations read "—" and the root's own held all of them, 1.58 MiB against its 66 KiB in the eager
        run: a new-user trial). No mark goes to the timeline (hooks.py's _time_compiled_calls says why). The unit's
        unsharded parameters' storages are noted first: FSDP's pre-forward, inside the frame, runs no mark either."""
        if not self._full or in_backward():
            return
        t = _now()
        idx = self.unit_index.get(unit)
        if idx is not None:
            sizes = self.sizes
            if not sizes.static_done:
                sizes.refresh_static(final=False)
            if idx not in sizes.keys_built:  # (none before FSDP's first unshard: then at the call's end)
                sizes.add_unit_param_keys(idx)
            if start:
                self.acts.unit_forward_start(idx)
                self._cost_ns += _now() - t
                self.unit_input(unit, args)
                return
            self.acts.unit_forward_end(idx)
        self._cost_ns += _now() - t

    def region(self, start: bool) -> None:
        """A checkpointed module's forward starts (``start``) or returns, inside its checkpoint's region, on a full
        step: a selective checkpoint's cache counts as activations (activations.SavedTensors.region_start)."""
        if not self._full or in_backward():
            return
        t = _now()
        if start:
            self.acts.region_start()
        else:
            self.acts.region_end()
        self._cost_ns += _now() - t

    def model_input(self, elements: int) -> None:
        """The model's forward starts on a batch of ``elements`` (its tensor arguments'): a light step whose batch
        is larger than every full step's by INPUT_GROWTH is measured in full from here (its forward's start, where
        a full step starts counting), outside profiler windows: variable sequence lengths made a light step of
        1024 tokens replay the 64-token full steps' figures (6.80 MiB reported, 87.82 MiB measured in full: a
        new-user trial)."""
        self._step_input = max(self._step_input, elements)
        if (not self._full and self._input_full and elements > INPUT_GROWTH * self._input_full
                and not self._samples and not self.traced(self.step_idx)):
            self._full = True

    def gathered(self) -> None:
        """A unit's backward gradient arrived: FSDP's pre-backward, which runs between the unit's ``backward_start``
        mark and here, has gathered the unit's parameters and issued the next unit's prefetch. On a counted step this
        point splits the interval between two marks: a high-water after it takes the named categories of this point
        (or of the next mark), not of ``backward_start``, where the unit was still sharded. Before this point, the
        peak inside a unit's backward read the unit's gathered parameters as temporaries: ``blocks.1 in_backward``
        of a 2-block GPT (hidden 64, 2 gloo ranks) had unsharded params 129.50 KiB (the root's) and 483.23 KiB of
        temporaries where FSDPMemTracker read 324.75 KiB (the root's and blocks.1's) and 289.0 KiB (a new-user
        trial). No row of its own: the timeline keeps its marks."""
        hw = self.hw
        if not self._full or hw is None or not hw.active or self._open is None:
            return
        t = _now()
        if self.sizes.pending:
            self.sizes.flush_pending()
        self._sample(t, None, "", point=True)
        self._cost_ns += _now() - t

    def _own_recompute(self) -> None:
        """The unit whose backward runs now owns the recomputes that start in it (children checkpointed inside a
        unit recompute between its backward marks; a checkpointed unit, after its own backward_start)."""
        if self.hw is not None:
            self.hw.owner = self._in_bwd[-1] if self._in_bwd else None

    def _grads_freed_in_forward(self) -> None:
        """The backward's first unit: gradients freed since the forward began (a zero_grad between the forward and the
        backward, as Lightning's Trainer zeroes inside its closure) are gone. Noticed at the forward only, they read as
        still held through the backward, and the new ones as temporaries (a new-user trial: 455 KiB twice at the
        peak, 4.30 MiB where it was 3.86 MiB, and memory.outputs_kept fired on the 583 KiB that were gradients). On
        the CPU the step's first mark anchors the counter, which counts only what the step allocates: gradients
        of an earlier step freed before the step's first backward come off the anchor."""
        sizes = self.sizes
        before = sizes.sg_total + sizes.ug_total + sizes.unmanaged_sgrad
        sizes.quick_grads()
        freed = before - (sizes.sg_total + sizes.ug_total + sizes.unmanaged_sgrad)
        if freed > 0 and not self._step_bwd and self._anchor is not None and not self.is_cuda:
            self._anchor -= freed

    def _on_step_forward(self) -> None:
        """The whole model's forward starts (once per micro-batch)."""
        if self.sizes.static_done and not self._fwd_seen:
            self.sizes.quick_grads()
        self._fwd_seen = True
        self._bwd_seen = False  # (this micro-batch's backward has not begun)
        model = self._model()
        if model is not None and compiled_module(model):
            # autograd would call the pack hook inside the compiled frame, where Dynamo traces it and compiles it
            # again for each dtype it meets, until its recompile limit (a warning in the user's log)
            self.acts.note = "the model's forward is compiled as a whole; saved activations not counted"
        else:
            self.acts.push()
        if self._autocast is None:
            self._autocast = F2.autocast_dtype(self.device.type)
        self.acts.autocast = self._autocast is not None  # (only then the pack hook looks for its copies)
        hw = self.hw
        if hw is not None and not hw.active and self._anchor is None:
            why = (compile_blocker(model) if model is not None else None) or hw.start()
            if why is None:
                self._hw_used = True
            else:
                self._hw_note = why

    def _stop_hw(self) -> None:
        if not self.hw.stop():
            log.warning("fsdp_doctor: another TorchDispatchMode sits above the memory high-water mode; it stays "
                        "inert until that mode exits")
        self._open = None

    def _sample(self, t: int, unit, phase: str, point: bool = False) -> None:
        """One sample: the per-mark figures; the static ones (sharded params, buffers) are referenced. A ``point``
        (:meth:`gathered`) only splits the high-water's interval: no sample."""
        sz = self.sizes
        act = self.live.bytes if self.acts.mode == "exact" else 0
        usp = sz.unsharded_bytes()
        sg = sz.sg_total + sz.unmanaged_sgrad
        hw = self.hw
        counted: set | None = set() if hw is not None and hw.active and not self.is_cuda else None
        comm = sz.comm_bytes(counted)
        if counted is not None:  # (and those the backend still holds after FSDP released them: gloo's)
            comm += hw.comm_alive(counted)
        tmp = 0
        st = sz.static_t
        known = st[0] + st[1] + usp + sg + sz.ug_total + sz.opt_bytes + sz.stale_bytes + act + comm
        if self.is_cuda:
            try:
                tmp = max(0, self._allocated() - known)
            except Exception:  # noqa: BLE001
                pass
        if hw is not None and hw.active:
            named = [st[0], usp, sg, sz.ug_total, sz.opt_bytes, sz.stale_bytes, act, comm, st[1], 0] if point else None
            tmp = self._count(known, tmp, named)
        if point:
            return
        self._samples.append((t, unit, phase, sz.static_t, usp, sg, sz.ug_total, sz.opt_bytes,
                              sz.stale_bytes, act, comm, tmp, self.live.cast if act else 0))

    def _count(self, known: int, tmp: int, point: list | None = None) -> int:
        """A mark on a counted step: closes the interval since the previous mark (its high-water is kept when
        it rises above both marks) and returns the temporaries at this mark. On CUDA the allocator total
        anchors every mark; on CPU the first mark of the step does (its temporaries are taken as 0: the
        user's input batch) and the counter carries it: temporaries = anchor + counter - named categories.
        ``point``: the named categories at a point inside the interval (:meth:`gathered`), which closes the part
        of the interval before it; the interval's high-water is the highest of its parts, with the named
        categories of the points (or marks) around that part."""
        live, high, saved, t_high = self.hw.read()
        if self._anchor is None:
            self._anchor = known + tmp - live
        elif not self.is_cuda:
            tmp = max(0, self._anchor + live - known)
        total = known + tmp
        if self._open is not None:
            i, anchor, prev_total, left = self._open
            part = (anchor + high, t_high, saved, left, point)
            if point is not None:
                self._segs.append(part)
                self._open = (i, total - live, prev_total, point)
                return tmp
            peak, t_high, saved, left, right = max([*self._segs, part], key=lambda x: x[0])
            if peak > max(prev_total, total):
                self._transients.append((i, t_high, peak, saved, left, right))
        self._segs = []
        self._open = (len(self._samples), total - live, total, None)
        return tmp

    def _transient_rows(self, samples, rows) -> list[tuple]:
        """(after sample index, t, unit, phase, row) of each high-water between two marks: the named
        categories of the neighbouring mark (or point, :meth:`gathered`) with fewer of them, the saved bytes of
        that moment, and the rest as temporaries (the op temporaries, the loss, the reduce-scatter buffer in the
        root's post-backward)."""
        out = []
        exact = self.acts.mode == "exact"
        inside = _enclosing(samples)
        for i, t, peak, saved, left, right in self._transients:
            best = None
            for j, named in ((i, left), (i + 1, right)):
                if named is None and j >= len(rows):
                    continue
                r = list(rows[j] if named is None else named)
                if exact:
                    r[_ACT] = saved
                r[-1] = 0
                r[-1] = max(0, peak - sum(r))
                if best is None or r[-1] > best[-1]:
                    best = r
            out.append((i, t, inside[i], _INSIDE.get(samples[i][2], "in_step"), best))
        return out

    @staticmethod
    def _row(s) -> list[int]:
        """A sample as bytes per category, in CATEGORIES order."""
        st = s[3]
        return [st[0], s[4], s[5], s[6], s[7], s[8], s[9], s[10], st[1], s[11]]

    def _fallback_row(self, tmp: int) -> list[int]:
        sz = self.sizes
        st = sz.static_t
        return [st[0], 0, sz.sg_total + sz.unmanaged_sgrad, 0, sz.opt_bytes, sz.stale_bytes, 0, 0, st[1], tmp]

    def _begin(self, step: int) -> None:
        self.step_idx = step
        self._samples = []
        self._cost_ns = 0
        self._fwd_seen = self._bwd_seen = False
        self._step_bwd = False  # a backward has begun in this step
        re = self.opts["refresh_every"]
        self.sizes.refresh_step = step < 2 or bool(re and step % re == 0)
        self._full = self.sampler.is_full(step, traced=self.traced(step))
        self._step_input = 0  # the largest batch the model's forward took this step (elements)
        self._reads_at = self.sampler.reads_at  # the marks a light step reads the allocator at (CUDA)
        self.acts.begin()
        self._anchor = self._open = None
        self._segs = []
        self._transients = []
        self._hw_used = False
        self._autocast: str | None = None  # autocast's dtype at the model's forward (full steps)
        self._in_bwd: list[int] = []  # units whose backward has started and not ended, innermost last
        self._t0 = _now()

    def step_end(self, step: int) -> MemoryStep:
        """Closes the step; returns ``StepRecord.memory`` (:class:`fsdp_doctor.records.MemoryStep`). Breakdown
        figures add up to ``peak.bytes``; ``t_ms`` counts from the previous step's end."""
        t_end = _now()
        sizes, acts, sampler = self.sizes, self.acts, self.sampler
        sampler.step_wall(t_end)
        full = self._full
        if full and sizes.pending:
            sizes.flush_pending()
        acts.pop()
        if acts.error is not None and acts.mode == "exact":
            acts.mode = "off"
        hw = self.hw
        if hw is not None and (hw.active or hw.parked):
            self._stop_hw()
        if hw is not None and hw.error:
            self._hw_note = hw.error
        samples = self._samples
        opts = self.opts
        mismatched = 0
        if full:
            if not samples:  # no mark this step (e.g. a step without forward): one sample now
                self._sample(t_end, None, "step_end")
            rows = [self._row(s) for s in samples]
            act_mode = acts.mode
            extra = self._transient_rows(samples, rows)
            tr_mode = "exact" if self._hw_used and hw.error is None else "off"
        else:
            rows, mismatched, extra = sampler.replay(samples, self._fallback_row)
            act_mode = "replayed" if sampler.last_full is not None else "off"
            tr_mode = "replayed" if extra or sampler.last_transients else "off"
            if not rows:
                rows = [self._fallback_row(0)]
                samples = [(t_end, None, "step_end", 0)]
        # the marks and, after each, the high-water that rose above it before the next one
        points = [(s[0], s[1], s[2], r) for s, r in zip(samples, rows)]
        casts = [s[12] if full else 0 for s in samples]  # autocast's copies alive at each point (in activations)
        for k, (i, t, unit, phase, r) in enumerate(extra):
            points.insert(i + 1 + k, (t, unit, phase, r))
            casts.insert(i + 1 + k, min(casts[i + k], r[_ACT]))
        totals = [sum(p[3]) for p in points]
        pi = max(range(len(points)), key=totals.__getitem__)
        pt, punit, pphase, pv = points[pi]
        t0 = self._t0
        out = MemoryStep(
            v=MEMORY_FORMAT, device=str(self.device), categories=list(CATEGORIES),
            sampling="full" if full else "replayed", samples=len(samples),
            peak=MemoryPeak(bytes=totals[pi], t_ms=round((pt - t0) * 1e-6, 3), unit=punit, phase=pphase,
                            breakdown=dict(zip(CATEGORIES, pv))),
            end=dict(zip(CATEGORIES, rows[-1])), offloaded_host=sizes.host_bytes(), activations=act_mode,
            stale_optimizer_param_tensors=sizes.stale_params, saved_tensors=self.live.packs,
            replay_mismatches=mismatched,  # marks that did not line up with the last full step
            activations_note=acts.error or acts.note or None, comm_note=sizes.comm_note,
            unknown=list(sizes.unknown),  # categories not measured on this torch (their 0 is not a figure)
            transients=tr_mode, transients_note=self._hw_note if tr_mode == "off" else None)
        if full:
            self._input_full = max(self._input_full, self._step_input)
            out.autocast = self._autocast
            if act_mode == "exact":
                out.activations_high = int(self.live.high)
                out.unit_activations = {self.unit_names[i]: int(b) for i, b in sorted(acts.unit_act.items())}
                out.unit_activations_own = {self.unit_names[i]: int(b) for i, b in sorted(acts.unit_own.items())}
                if acts.unit_in:
                    out.unit_inputs = {self.unit_names[i]: int(b) for i, b in sorted(acts.unit_in.items())}
                if any(casts):
                    out.cast_copies = CastCopies(
                        dtype=self.live.cast_dtype or "", peak=int(casts[pi]), most=int(max(casts)),
                        units={self.unit_names[i]: int(b) for i, b in sorted(acts.unit_cast.items())})
            rec = {i: b for i, b in hw.recompute_saved.items() if i is not None} if tr_mode == "exact" else {}
            if rec:  # a recompute outside every unit's backward (owner None) belongs to no unit
                out.unit_recompute_saved = {self.unit_names[i]: int(b) for i, b in sorted(rec.items())}
            sampler.remember(samples, rows, extra)
        new_peak = totals[pi] > self._running_peak
        if new_peak:
            self._running_peak = totals[pi]
        te = opts["timeline_every"]
        if full and (step < opts["first_timeline_steps"] or new_peak or (te and step % te == 0)):
            out.timeline = MemoryTimeline(
                columns=["t_ms", "unit", "phase", *CATEGORIES],
                rows=[[round((p[0] - t0) * 1e-6, 3), p[1], p[2], *p[3]] for p in points])
            if out.cast_copies is not None:
                out.cast_copies.rows = [int(c) for c in casts]
        if self.is_cuda:
            out.cuda = self.dev.stats(step)
        if full:
            re = opts["refresh_every"]
            if step < 2 or (re and step % re == 0):
                sizes.refresh_static()
                sizes.refresh_optimizer(force=True)
            else:
                sizes.refresh_optimizer()
        # marks, step_end and each pack hook are timed; handle releases (run by autograd) are estimated
        at_end = _now() - t_end
        total = self._cost_ns + at_end + acts.cost_ns() + (hw.cost_ns if self._hw_used else 0)
        sampler.step_cost(step, full, total, mismatched)
        out.full_every = sampler.every
        out.probe_us = round(total * 1e-3, 1)
        out.probe_pack_us = round(acts.pack_ns * 1e-3, 1)
        out.probe_end_us = round(at_end * 1e-3, 1)
        self._begin(step + 1)
        return out

    def detach(self) -> None:
        """Removes our saved-tensor hooks and the high-water mode and wrapper (watch exit, stepping aside);
        later marks are ignored (a hook that outlives the doctor pushes nothing again). Inside backward
        autograd runs on a copy of this thread's hook and mode stacks (what is popped there comes back when
        backward returns): the counting stops now, and the pops happen at the next module call after it."""
        self.mark = _ignore_mark
        if self.hw is not None:
            self.hw.stop(pop=False)
        if in_backward():
            if self._later is None:
                self._later = torch.nn.modules.module.register_module_forward_pre_hook(self._detach_later)
            return
        self._detach_now()

    def _detach_later(self, module, args) -> None:
        if not in_backward() and self._later is not None:
            self._later.remove()
            self._later = None
            self._detach_now()

    def _detach_now(self) -> None:
        try:
            self.acts.pop()
        except Exception:  # noqa: BLE001
            pass
        if self.hw is not None:
            self._stop_hw()
        if self.acts.pushed:
            log.warning("fsdp_doctor: could not remove the activation-counting hooks (another saved_tensors_hooks "
                        "context is above them); they stay until the thread ends")
        self.sampler.last_full = None
