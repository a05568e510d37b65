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
    every tensor in ``optimizer.state`` of a model parameter (local bytes of DTensors).
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
    which is what is alive.
``comm_buffers``
    FSDP's collective buffers in flight: the all-gather output kept for copy-out overlap
    (``comm_ctx.all_gather_state``), pending (prefetched) all-gather results, reduce-scatter inputs kept
    by ``comm_ctx.reduce_scatter_states``, and HSDP all-reduce / partial-reduce buffers.
``buffers``
    the model's registered buffers.
``temporaries``
    on CUDA: ``torch.cuda.memory_allocated()`` minus every category above (autograd's gradient
    temporaries, op workspaces, tensors held by user code). On CPU there is no allocator total to subtract
    from, so it is 0.

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
exactly, with *light* steps, where a mark only notes when and where it happened (plus
``torch.cuda.memory_allocated`` on CUDA) and the figures of the same mark of the last full step are replayed:
FSDP's schedule repeats, so they are the same; a mark that does not line up is reported
(``replay_mismatches``) and forces a full step next. Steps 0-2 are full; then (``full_every="auto"``) the
period is chosen from the measured costs so that the probe costs at most ``budget`` (0.3%) of the median
step time. Within a full step, per-unit byte sizes are cached, gradients are re-measured only for the units
whose backward just ran (and cached by unit after the first steps), the optimizer state only when its size
changes; everything is re-measured every ``refresh_every`` steps.

Options (``watch(memory={...})``): ``full_every`` ("auto", or N: every Nth step; steps 0-2 are always full: step 0 runs FSDP's lazy init
and has no optimizer state yet), ``budget``, ``timeline_every`` (store
every sample of every Nth full step, default 50; full steps 0-2 and every step that raises the running
peak are stored too), ``refresh_every`` (default 50), ``fragmentation_every`` (CUDA memory snapshot for
the largest free block, default 200; 0 = never), ``nvml`` (default True).

The step's figures (``StepRecord.memory``) are :class:`fsdp_doctor.records.MemoryStep`.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import msgspec
import torch
import torch.nn as nn

from .. import memory_categories as MC
from ..records import CudaMemory, MemoryPeak, MemoryStep, MemoryTimeline
from . import fsdp2 as F2

log = logging.getLogger("fsdp_doctor")
# Property reads (``.grad``) on DTensor parameters go through __torch_function__ (~1 us each); inside this
# context they are plain C reads.
_NoTF = getattr(torch._C, "DisableTorchFunctionSubclass", None)
_now = time.perf_counter_ns

MEMORY_FORMAT = 1

#: device categories, in the order of every sample row (defined in fsdp_doctor.memory_categories)
CATEGORIES = MC.DEVICE
HOST_CATEGORIES = MC.HOST
(_SP, _USP, _SG, _UG, _OPT, _STALE, _ACT, _COMM, _BUF, _TMP) = range(len(CATEGORIES))

_DEFAULTS = {
    "full_every": "auto",
    "budget": 0.003,  # "auto": the probe may cost this fraction of the median step time
    "timeline_every": 50,
    "refresh_every": 50,
    "fragmentation_every": 200,
    "nvml": True,
    "first_timeline_steps": 3,
}


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


def _storage(t: torch.Tensor):
    """(storage key, storage bytes) of a plain tensor or a DTensor's local tensor; (None, 0) if it has none."""
    lt = t if type(t) is torch.Tensor or isinstance(t, nn.Parameter) else getattr(t, "_local_tensor", t)
    try:
        st = lt.untyped_storage()
        return st._cdata, st.nbytes()
    except Exception:  # noqa: BLE001 - tensor subclasses without a storage (fake, nested, sparse)
        return None, 0


def _is_host(t: torch.Tensor) -> bool:
    lt = getattr(t, "_local_tensor", t)
    return lt.device.type == "cpu"


class _Saved:
    """What the pack hook leaves in the autograd graph: the detached tensor and its storage key.

    When autograd drops the saved variable (after the node ran in backward, or with the graph), this
    object dies and ``__del__`` takes the storage's bytes off the running counter once its last saved
    reference is gone.
    """

    __slots__ = ("t", "k", "live")

    def __init__(self, t, k, live):
        self.t = t
        self.k = k
        self.live = live

    def __del__(self):
        live = self.live
        e = live.entries.get(self.k)
        if e is None:
            return
        e[0] -= 1
        if e[0] <= 0:
            del live.entries[self.k]
            live.bytes -= e[1]


class _Live:
    """Running count of saved-for-backward storages (shared with the _Saved handles)."""

    __slots__ = ("entries", "bytes", "packs")

    def __init__(self):
        self.entries: dict[int, list[int]] = {}  # storage key -> [saved references alive, bytes]
        self.bytes = 0
        self.packs = 0


class _GroupInfo:
    """One FSDPParamGroup with its cached sizes."""

    __slots__ = ("pg", "unit", "fps", "unsharded_bytes", "post_fwd_bytes")

    def __init__(self, pg, unit: int):
        self.pg = pg
        self.unit = unit
        self.fps = F2.group_params(pg)
        self.unsharded_bytes: int | None = None
        self.post_fwd_bytes: int | None = None


class MemoryProbe:
    """Samples memory by category at the Doctor's marks; one instance per watched rank."""

    def __init__(self, doctor, option):
        self.doctor = doctor
        self.opts = _options(option)
        self.model: nn.Module = doctor.model
        self.optimizer = getattr(doctor, "optimizer", None)
        self.units = list(doctor._units)
        self.unit_names = [u.name for u in self.units]
        self.unit_index = {u.name: i for i, u in enumerate(self.units)}
        self.device = _compute_device(self.units, self.model)
        self.dev_type = self.device.type
        self.host_is_device = self.dev_type == "cpu"
        self.is_cuda = self.dev_type == "cuda"
        self.groups: list[_GroupInfo] = []
        self.unit_groups: list[list[_GroupInfo]] = [[] for _ in self.units]
        for i, u in enumerate(self.units):
            for pg in u.param_groups:
                g = _GroupInfo(pg, i)
                self.groups.append(g)
                self.unit_groups[i].append(g)
        self._ss = F2.ShardedStates()
        # categories this torch's FSDP internals do not let us measure: reported as unknown, not as 0
        self._unknown: list[str] = []
        if not all(u.groups_known for u in self.units):
            self._unknown = ["unsharded_params", "unsharded_grads", "comm_buffers"]
        # cached figures (device bytes, host bytes)
        self._static_t = (0, 0)
        self.host_static = 0
        self.unit_sgrad = [0] * len(self.units)
        self.unit_ugrad = [0] * len(self.units)
        self.unit_host_grad = [0] * len(self.units)
        self.unmanaged_sgrad = 0
        self.unmanaged_host_grad = 0
        self.opt_bytes = 0
        self.opt_host = 0
        self.opt_len = -1
        self.stale_bytes = 0
        self.stale_params = 0
        self._unmanaged: list[nn.Parameter] = []
        self._param_keys: set[int] = set()
        self._keys_built: set[int] = set()
        self._comm: F2.CommReader | None = None
        self._comm_note: str | None = None
        self._sg_total = 0
        self._ug_total = 0
        self._ugrad_cache: dict[int, int] = {}  # unit -> unsharded grad bytes before its post-backward
        self._sgrad_cache: dict[int, tuple[int, int]] = {}  # unit -> (sharded, host) grad bytes after it
        self._probe_fps: list[list] = []
        for gs in self.unit_groups:
            fps = []
            for g in gs:
                trainable = [fp for fp in g.fps if getattr(F2.sharded_param(fp), "requires_grad", False)]
                if trainable:
                    fps.append(trainable[0])
            self._probe_fps.append(fps)
        self._static_done = False
        self._pending: list[int] = []  # units whose post-backward ran since their grads were measured
        # activations
        self.live = _Live()
        self._hooks_pushed = False
        self._act_error: str | None = None
        self._act_mode = "off"  # this step: "exact" | "replayed" | "off"
        self._act_note: str | None = None
        self._pack_ns = 0
        self._every = 1  # current period of full steps
        self._next_full = 0
        self._full = True  # this step measures everything (else: replays the last full step)
        self._last_full: list | None = None  # [(unit, phase, row)] of the last full step
        self._light_ns: list[int] = []
        self._full_ns: list[int] = []
        self._last_step_end = 0
        self._walls: list[int] = []
        self._unit_act_start: dict[int, int] = {}
        self._unit_act: dict[int, int] = {}
        # step state
        self.step_idx = 0
        self._samples: list[tuple] = []
        self._t0 = _now()
        self._cost_ns = 0
        self._running_peak = -1
        self._nvml = None
        self._nvml_failed = False
        self._unmanaged_static()
        self._refresh_optimizer(force=True)
        self._begin(0)

    # ------------------------------------------------------------------ static sizes
    def _unmanaged_static(self) -> None:
        managed = set()
        for g in self.groups:
            for fp in g.fps:
                sp = F2.sharded_param(fp)
                if sp is not None:
                    managed.add(id(sp))
        self._unmanaged = [p for p in self.model.parameters() if id(p) not in managed]

    def _refresh_static(self) -> None:
        """Sharded params, unmanaged params, buffers, parameter storage keys (after FSDP's lazy init)."""
        dev = host = 0
        seen: set[int] = set()
        keys: set[int] = set()
        for g in self.groups:
            for fp in g.fps:
                data = F2.sharded_data(fp)
                if data is None:
                    continue
                k, nb = _storage(data)
                if k is None or k in seen:
                    continue
                seen.add(k)
                keys.add(k)
                nb = data.numel() * data.element_size() if nb == 0 else nb
                if self.host_is_device or not _is_host(data):
                    dev += nb
                else:
                    host += nb
        self._unmanaged_static()
        for p in self._unmanaged:
            k, nb = _storage(p)
            if k is None or k in seen:
                continue
            seen.add(k)
            keys.add(k)
            if self.host_is_device or not _is_host(p):
                dev += nb
            else:
                host += nb
        buf = 0
        for b in self.model.buffers():
            k, nb = _storage(b)
            if k is not None and k not in seen:
                seen.add(k)
                buf += nb
        self._static_t = (dev, buf)  # (sharded_params, buffers)
        self.host_static = host
        self._param_keys = keys
        self._keys_built = set()
        # the comm fields read at every mark (private FSDP API): checked once by the adapter
        self._comm = F2.CommReader(g.pg for g in self.groups)
        if not self._comm.ok:
            self._comm_note = (f"torch {F2.TORCH_STR}: FSDP's comm state is not recognised: comm_buffers unknown")
            if "comm_buffers" not in self._unknown:
                self._unknown.append("comm_buffers")
        self._static_done = True

    def _add_unit_param_keys(self, idx: int) -> None:
        """Storage keys of a unit's unsharded parameters (persist across reshards: FSDP resizes them)."""
        added = False
        for g in self.unit_groups[idx]:
            for fp in g.fps:
                up = F2.unsharded_param(fp)
                if up is not None:
                    k, _ = _storage(up)
                    if k is not None:
                        self._param_keys.add(k)
                        added = True
                for t in F2.unsharded_tensors(fp):
                    k, _ = _storage(t)
                    if k is not None:
                        self._param_keys.add(k)
        if added:
            self._keys_built.add(idx)

    # ------------------------------------------------------------------ gradients and optimizer
    def _grad_bytes(self, t, seen: set) -> tuple[int, int]:
        k, nb = _storage(t)
        if k is None or k in seen:
            return 0, 0
        seen.add(k)
        if self.host_is_device or not _is_host(t):
            return nb, 0
        return 0, nb

    def _has_grads(self, idx: int) -> bool:
        """Whether the unit holds any gradient now, read off one trainable param per param group (FSDP
        treats a group's params together): a few attribute reads, no storage access."""
        for fp in self._probe_fps[idx]:
            if F2.sharded_param(fp).grad is not None:
                return True
            up = F2.unsharded_param(fp)
            if up is not None and up.grad is not None:
                return True
            if F2.accumulated_grad(fp) is not None:
                return True
        return False

    def _measure_unit_grads(self, idx: int) -> None:
        """Sharded / unsharded gradient bytes of one unit, from every param's gradient storages."""
        sg = ug = host = 0
        seen: set[int] = set()
        with _NoTF():
            for g in self.unit_groups[idx]:
                for fp in g.fps:
                    sp = F2.sharded_param(fp)
                    up = F2.unsharded_param(fp)
                    for gr, sharded in ((getattr(sp, "grad", None), True), (getattr(up, "grad", None), False),
                                        (F2.accumulated_grad(fp), False)):
                        if gr is None:
                            continue
                        d, h = self._grad_bytes(gr, seen)
                        if sharded:
                            sg += d
                        else:
                            ug += d
                        host += h
        self._set_grads(idx, sg, ug, host)

    def _quick_grads(self) -> None:
        """At the forward start: notice gradients freed (zero_grad) or kept since the last backward."""
        for idx in range(len(self.units)):
            if self.unit_sgrad[idx] or self.unit_ugrad[idx] or self.unit_host_grad[idx] or self._refresh_step:
                if self._refresh_step:
                    self._measure_unit_grads(idx)
                elif not self._has_grads(idx):
                    self._set_grads(idx, 0, 0, 0)
        if self._unmanaged:
            self._measure_unmanaged_grads()

    def _measure_unmanaged_grads(self) -> None:
        dev = host = 0
        seen: set[int] = set()
        for p in self._unmanaged:
            gr = p.grad
            if gr is not None:
                d, h = self._grad_bytes(gr, seen)
                dev += d
                host += h
        self.unmanaged_sgrad = dev
        self.unmanaged_host_grad = host

    def _refresh_optimizer(self, force: bool = False) -> None:
        opt = self.optimizer
        if opt is None:
            return
        state = getattr(opt, "state", None)
        n = len(state) if state is not None else 0
        if not force and n == self.opt_len:
            return
        self.opt_len = n
        model_ids = {id(p) for p in self.model.parameters()}
        seen: set[int] = set()
        dev = host = 0
        stale = 0
        stale_n = 0
        for group in opt.param_groups:
            for p in group.get("params", ()):
                if id(p) in model_ids:
                    continue
                stale_n += 1
                for t in (p, p.grad):
                    if t is None:
                        continue
                    k, nb = _storage(t)
                    if k is not None and k not in seen:
                        seen.add(k)
                        stale += nb
        for p, st in (state or {}).items():
            is_stale = id(p) not in model_ids
            for v in st.values() if isinstance(st, dict) else ():
                if not isinstance(v, torch.Tensor):
                    continue
                k, nb = _storage(v)
                if k is None or k in seen:
                    continue
                seen.add(k)
                if is_stale:
                    stale += nb
                elif self.host_is_device or not _is_host(v):
                    dev += nb
                else:
                    host += nb
        self.opt_bytes = dev
        self.opt_host = host
        self.stale_bytes = stale
        self.stale_params = stale_n

    # ------------------------------------------------------------------ per-mark figures
    def _unsharded_bytes(self) -> int:
        total = 0
        state_of = self._ss.of
        for g in self.groups:
            s = state_of(g.pg)
            if s == "unsharded":
                b = g.unsharded_bytes
                if b is None:
                    b = g.unsharded_bytes = self._measure_unsharded(g)
                total += b
            elif s == "post_forward":
                b = g.post_fwd_bytes
                if b is None:
                    b = g.post_fwd_bytes = self._measure_post_forward(g)
                total += b
        return total

    @staticmethod
    def _measure_unsharded(g: _GroupInfo) -> int:
        seen: set[int] = set()
        total = 0
        for fp in g.fps:
            for t in F2.unsharded_tensors(fp):
                k, nb = _storage(t)
                if k is not None and k not in seen:
                    seen.add(k)
                    total += nb
        return total

    @staticmethod
    def _measure_post_forward(g: _GroupInfo) -> int:
        total = 0
        for fp in g.fps:
            t = F2.post_forward_data(fp)
            if t is not None:
                total += t.numel() * t.element_size()
        return total

    def _comm_bytes(self) -> int:
        """FSDP's collective buffers in flight (0 while unknown: the step says ``unknown``)."""
        c = self._comm
        return (c.bytes() or 0) if c is not None else 0

    # ------------------------------------------------------------------ activations (saved tensors)
    def _pack(self, t):
        t0 = _now()
        r = self._pack_inner(t)
        self._pack_ns += _now() - t0
        return r

    def _pack_inner(self, t):
        live = self.live
        try:
            live.packs += 1
            if isinstance(t, nn.Parameter):
                return t
            d = t.detach()
            b = t._base
            if b is not None and isinstance(b, nn.Parameter):
                return d
            if type(t) is not torch.Tensor:
                lt = getattr(t, "_local_tensor", None)
                if lt is None:
                    return d
                st = lt.untyped_storage()
            else:
                st = t.untyped_storage()
            if not self.host_is_device and st.device.type == "cpu":
                return d
            k = st._cdata
            if k in self._param_keys:
                return d
            e = live.entries.get(k)
            if e is None:
                nb = st.nbytes()
                if nb == 0:  # a freed (resharded) storage holds nothing
                    return d
                live.entries[k] = [1, nb]
                live.bytes += nb
            else:
                e[0] += 1
            return _Saved(d, k, live)
        except Exception as exc:  # noqa: BLE001 - never break the user's forward
            if self._act_error is None:
                self._act_error = f"{type(exc).__name__}: {exc}"[:200]
                log.warning("fsdp_doctor: activation counting failed (%s); activations are not counted", self._act_error)
            try:
                return t.detach()
            except Exception:  # noqa: BLE001
                return t

    @staticmethod
    def _unpack(x):
        return x.t if type(x) is _Saved else x

    def _push_hooks(self) -> None:
        if self._hooks_pushed or self._act_error is not None or not self._full:
            return
        ag = torch._C._autograd
        try:
            if not ag._saved_tensors_hooks_is_enabled():
                self._act_note = "saved tensor hooks are disabled here"
                return
            if F2.saved_hooks_top() is not None:
                # the user's own saved_tensors_hooks (e.g. save_on_cpu) are active: ours would override them
                self._act_note = "the training loop's own saved_tensors_hooks are active; activations not counted"
                return
            ag._push_saved_tensors_default_hooks(self._pack, self._unpack)
            self._hooks_pushed = True
            self._act_mode = "exact"
        except Exception as exc:  # noqa: BLE001
            self._act_note = f"saved tensor hooks unavailable ({type(exc).__name__}: {exc})"[:200]

    def _pop_hooks(self) -> None:
        """Pops our hooks when they are on top (main thread, outside the forward/backward)."""
        if not self._hooks_pushed:
            return
        ag = torch._C._autograd
        top = F2.saved_hooks_top()
        if top is F2.UNKNOWN_HOOKS or (top is not None and getattr(top[0], "__func__", None) is MemoryProbe._pack
                                       and getattr(top[0], "__self__", None) is self):
            # (torch 2.6 cannot show the top: context managers above ours have exited by now)
            ag._pop_saved_tensors_default_hooks()
            self._hooks_pushed = False

    # ------------------------------------------------------------------ probe interface
    def mark(self, unit: str | None, phase: str) -> None:
        t = _now()
        if not self._full:
            # light step: when and where only (+ the allocator total on CUDA); the figures are replayed
            if phase[0] == "f" and torch._C._current_graph_task_id() != -1:
                phase = "recompute_start" if phase == "forward_start" else "recompute_end"
            elif phase == "optimizer_start" and self._hooks_pushed:
                self._pop_hooks()
            tmp = torch.cuda.memory_allocated(self.device) if self.is_cuda else 0
            self._samples.append((t, unit, phase, tmp))
            self._cost_ns += _now() - t
            return
        idx = self.unit_index.get(unit) if unit is not None else None
        if phase == "forward_start":
            if idx is None:
                self._on_step_forward()
            elif torch._C._current_graph_task_id() != -1:
                phase = "recompute_start"
            else:
                if not self._static_done:
                    self._refresh_static()
                if idx not in self._keys_built:
                    self._add_unit_param_keys(idx)
                self._unit_act_start[idx] = self.live.bytes
        elif phase == "forward_end":
            if torch._C._current_graph_task_id() != -1:
                phase = "recompute_end"
            elif idx is not None:
                s = self._unit_act_start.pop(idx, None)
                if s is not None:
                    self._unit_act[idx] = self._unit_act.get(idx, 0) + self.live.bytes - s
        elif phase == "backward_start":
            if self._pending:
                self._flush_pending()
        elif phase == "backward_end":
            if self._pending:
                self._flush_pending()
            if idx is not None:
                self._before_post_backward(idx)
            elif self._unmanaged:
                self._measure_unmanaged_grads()
        elif phase == "optimizer_start":
            if self._pending:
                self._flush_pending()
            self._pop_hooks()
        elif phase == "optimizer_end":
            self._refresh_optimizer(force=self.step_idx < 2)
        self._sample(t, unit, phase)
        self._cost_ns += _now() - t

    def _set_grads(self, idx: int, sg: int, ug: int, host: int) -> None:
        self._sg_total += sg - self.unit_sgrad[idx]
        self._ug_total += ug - self.unit_ugrad[idx]
        self.unit_sgrad[idx] = sg
        self.unit_ugrad[idx] = ug
        self.unit_host_grad[idx] = host

    def _before_post_backward(self, idx: int) -> None:
        """FSDP's post-backward of the unit starts: its unsharded gradients are all there, unreduced.
        Their size repeats every step: measured on refresh steps and first sightings, cached otherwise."""
        hit = self._ugrad_cache.get(idx)
        if hit is None or self._refresh_step:
            self._measure_unit_grads(idx)
            self._ugrad_cache[idx] = self.unit_ugrad[idx]
        else:
            self._set_grads(idx, self.unit_sgrad[idx], hit, self.unit_host_grad[idx])
        self._pending.append(idx)

    def _flush_pending(self) -> None:
        """Units whose post-backward ran since the last mark: with gradient sync, FSDP dropped the
        unsharded gradients and left sharded ones (one flat reduce-scatter output per unit, the same size
        every step: cached like the unsharded ones); without sync, the unsharded ones stay (measured)."""
        for i in self._pending:
            reduce = True
            for g in self.unit_groups[i]:
                if not F2.reduce_grads(g.pg):
                    reduce = False
            hit = self._sgrad_cache.get(i)
            if not reduce or hit is None or self._refresh_step:
                self._measure_unit_grads(i)
                if reduce:
                    self._sgrad_cache[i] = (self.unit_sgrad[i], self.unit_host_grad[i])
            else:
                self._set_grads(i, hit[0], 0, hit[1])
        self._pending.clear()

    def _on_step_forward(self) -> None:
        """The whole model's forward starts (once per micro-batch)."""
        if self._static_done and not self._fwd_seen:
            self._quick_grads()
        self._fwd_seen = True
        self._push_hooks()

    def _is_full(self, step: int) -> bool:
        every = self.opts["full_every"]
        if every == "auto":
            return step < 3 or step >= self._next_full or self._last_full is None
        return step < 3 or step % every == 0 or self._last_full is None

    def _schedule(self, step: int) -> None:
        """full_every="auto": the next full step comes when the amortised probe cost (a full step's cost
        over the period, plus light steps) stays within ``budget`` of the median step time."""
        every = self.opts["full_every"]
        if every != "auto":
            self._every = every
            return
        walls = sorted(self._walls[-20:])
        if not walls or not self._full_ns:
            return
        wall = walls[len(walls) // 2]
        full = sorted(self._full_ns[-5:])[len(self._full_ns[-5:]) // 2]
        light = sorted(self._light_ns[-20:])[len(self._light_ns[-20:]) // 2] if self._light_ns else full // 10
        room = self.opts["budget"] * wall - light
        n = _MAX_EVERY if room <= 0 else -(-int(full - light) // max(1, int(room)))
        self._every = max(1, min(_MAX_EVERY, n))
        self._next_full = step + self._every

    def _sample(self, t: int, unit, phase: str) -> None:
        """One sample: the per-mark figures; the static ones (sharded params, buffers) are referenced."""
        act = self.live.bytes if self._act_mode == "exact" else 0
        usp = self._unsharded_bytes()
        sg = self._sg_total + self.unmanaged_sgrad
        comm = self._comm_bytes()
        tmp = 0
        if self.is_cuda:
            try:
                st = self._static_t
                known = st[0] + st[1] + usp + sg + self._ug_total + self.opt_bytes + self.stale_bytes + act + comm
                tmp = max(0, torch.cuda.memory_allocated(self.device) - known)
            except Exception:  # noqa: BLE001
                pass
        self._samples.append((t, unit, phase, self._static_t, usp, sg, self._ug_total, self.opt_bytes,
                              self.stale_bytes, act, comm, tmp))

    @staticmethod
    def _row(s) -> list[int]:
        """A sample as bytes per category, in CATEGORIES order."""
        st = s[3]
        return [st[0], s[4], s[5], s[6], s[7], s[8], s[9], s[10], st[1], s[11]]

    def _host_bytes(self) -> int:
        return self.host_static + sum(self.unit_host_grad) + self.unmanaged_host_grad + self.opt_host

    def _begin(self, step: int) -> None:
        self.step_idx = step
        self._samples = []
        self._cost_ns = 0
        self._unit_act = {}
        self._unit_act_start = {}
        self._fwd_seen = False
        re = self.opts["refresh_every"]
        self._refresh_step = step < 2 or bool(re and step % re == 0)
        self._full = self._is_full(step)
        self._act_mode = "off"
        self._act_note = None
        self.live.packs = 0
        self._pack_ns = 0
        self._t0 = _now()

    def step_end(self, step: int) -> MemoryStep:
        """Closes the step; returns ``StepRecord.memory`` (:class:`fsdp_doctor.records.MemoryStep`). Breakdown
        figures add up to ``peak.bytes``; ``t_ms`` counts from the previous step's end."""
        t_end = _now()
        if self._last_step_end:
            self._walls.append(t_end - self._last_step_end)
            if len(self._walls) > 64:
                del self._walls[:32]
        self._last_step_end = t_end
        full = self._full
        if full and self._pending:
            self._flush_pending()
        self._pop_hooks()
        if self._act_error is not None and self._act_mode == "exact":
            self._act_mode = "off"
        samples = self._samples
        opts = self.opts
        mismatched = 0
        if full:
            if not samples:  # no mark this step (e.g. a step without forward): one sample now
                self._sample(t_end, None, "step_end")
            rows = [self._row(s) for s in samples]
            act_mode = self._act_mode
        else:
            rows, mismatched = self._replay(samples)
            act_mode = "replayed" if self._last_full is not None else "off"
            if not rows:
                rows = [self._fallback_row(0)]
                samples = [(t_end, None, "step_end", 0)]
        totals = [sum(r) for r in rows]
        pi = max(range(len(rows)), key=totals.__getitem__)
        pt, punit, pphase = samples[pi][:3]
        pv = rows[pi]
        t0 = self._t0
        out = MemoryStep(
            v=MEMORY_FORMAT, device=str(self.device), categories=list(CATEGORIES),
            sampling="full" if full else "replayed", samples=len(samples),
            peak=MemoryPeak(bytes=totals[pi], t_ms=round((pt - t0) * 1e-6, 3), unit=punit, phase=pphase,
                            breakdown=dict(zip(CATEGORIES, pv))),
            end=dict(zip(CATEGORIES, rows[-1])), offloaded_host=self._host_bytes(), activations=act_mode,
            stale_optimizer_param_tensors=self.stale_params, saved_tensors=self.live.packs,
            replay_mismatches=mismatched,  # marks that did not line up with the last full step
            activations_note=self._act_error or self._act_note or None, comm_note=self._comm_note,
            unknown=list(self._unknown))  # categories not measured on this torch (their 0 is not a figure)
        if full:
            if act_mode == "exact":
                out.unit_activations = {self.unit_names[i]: int(b) for i, b in sorted(self._unit_act.items())}
            self._last_full = [(s[1], s[2], r) for s, r in zip(samples, rows)]
        new_peak = totals[pi] > self._running_peak
        if new_peak:
            self._running_peak = totals[pi]
        te = opts["timeline_every"]
        if full and (step < opts["first_timeline_steps"] or new_peak or (te and step % te == 0)):
            out.timeline = MemoryTimeline(
                columns=["t_ms", "unit", "phase", *CATEGORIES],
                rows=[[round((s[0] - t0) * 1e-6, 3), s[1], s[2], *r] for s, r in zip(samples, rows)])
        if self.is_cuda:
            out.cuda = self._cuda_stats(step)
        if full:
            re = opts["refresh_every"]
            if step < 2 or (re and step % re == 0):
                self._refresh_static()
                self._refresh_optimizer(force=True)
            else:
                self._refresh_optimizer()
        cost = self._cost_ns + _now() - t_end
        # marks, step_end and each pack hook are timed; handle releases (_Saved.__del__, run by autograd)
        # are estimated
        total = cost + self._pack_ns + self.live.packs * _RELEASE_NS
        (self._full_ns if full else self._light_ns).append(total)
        for lst in (self._full_ns, self._light_ns):
            if len(lst) > 64:
                del lst[:32]
        if mismatched:
            self._next_full = step + 1
        elif full and step >= 2:
            self._schedule(step)
        out.full_every = self._every
        out.probe_us = round(total * 1e-3, 1)
        out.probe_pack_us = round(self._pack_ns * 1e-3, 1)
        self._begin(step + 1)
        return out

    def _fallback_row(self, tmp: int) -> list[int]:
        st = self._static_t
        return [st[0], 0, self._sg_total + self.unmanaged_sgrad, 0, self.opt_bytes, self.stale_bytes, 0, 0, st[1], tmp]

    def _replay(self, samples) -> tuple[list, int]:
        """Light step: each mark takes the figures of the same mark of the last full step (same unit and
        phase at the same position); temporaries are this step's own (CUDA)."""
        last = self._last_full or []
        rows = []
        bad = 0
        for i, (t, unit, phase, tmp) in enumerate(samples):
            if i < len(last) and last[i][0] == unit and last[i][1] == phase:
                r = list(last[i][2])
                if self.is_cuda:
                    known = sum(r) - r[_TMP]
                    r[_TMP] = max(0, tmp - known)
                rows.append(r)
            else:
                bad += 1
                rows.append(self._fallback_row(0))
        return rows, bad

    # ------------------------------------------------------------------ CUDA / NVML (untestable on CPU)
    def _cuda_stats(self, step: int) -> CudaMemory:
        """Allocator and device figures. Written against torch.cuda / NVML's documented APIs; not run on
        the CPU-only development machine, so every call is guarded."""
        dev = self.device
        out: dict[str, Any] = {}
        try:
            alloc = torch.cuda.memory_allocated(dev)
            reserved = torch.cuda.memory_reserved(dev)
            out.update(allocated=alloc, reserved=reserved, fragmentation=max(0, reserved - alloc),
                       max_allocated=torch.cuda.max_memory_allocated(dev))
            stats = torch.cuda.memory_stats(dev)
            out["inactive_split_bytes"] = int(stats.get("inactive_split_bytes.all.current", 0))
            out["alloc_retries"] = int(stats.get("num_alloc_retries", 0))
            out["ooms"] = int(stats.get("num_ooms", 0))
            free, total = torch.cuda.mem_get_info(dev)
            out["device_free"] = int(free)
            out["device_total"] = int(total)
        except Exception as exc:  # noqa: BLE001
            out["error"] = f"{type(exc).__name__}: {exc}"[:200]
        fe = self.opts["fragmentation_every"]
        if fe and step % fe == 0:
            try:
                largest = 0
                for seg in torch.cuda.memory_snapshot():
                    if seg.get("device") not in (None, dev.index):
                        continue
                    for blk in seg.get("blocks", ()):
                        if blk.get("state") == "inactive":
                            largest = max(largest, int(blk.get("size", 0)))
                out["largest_free_block"] = largest
            except Exception as exc:  # noqa: BLE001
                out["snapshot_error"] = f"{type(exc).__name__}: {exc}"[:200]
        if self.opts["nvml"] and not self._nvml_failed:
            used = self._nvml_process_bytes()
            if used is not None:
                out["nvml_process_bytes"] = used
                if "reserved" in out:
                    out["outside_allocator"] = max(0, used - out["reserved"])
        return msgspec.convert(out, CudaMemory)

    def _nvml_process_bytes(self) -> int | None:
        try:
            if self._nvml is None:
                import pynvml  # nvidia-ml-py; absent is normal

                pynvml.nvmlInit()
                uuid = str(getattr(torch.cuda.get_device_properties(self.device), "uuid", ""))
                if uuid and not uuid.startswith("GPU-"):
                    uuid = "GPU-" + uuid
                handle = pynvml.nvmlDeviceGetHandleByUUID(uuid) if uuid else pynvml.nvmlDeviceGetHandleByIndex(
                    self.device.index or 0)
                self._nvml = (pynvml, handle)
            pynvml, handle = self._nvml
            pid = os.getpid()
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == pid and proc.usedGpuMemory is not None:
                    return int(proc.usedGpuMemory)
            return None
        except Exception:  # noqa: BLE001 - no NVML, no permission, containers hiding pids: normal
            self._nvml_failed = True
            return None

    def detach(self) -> None:
        """Removes our saved-tensor hooks if they are still pushed (watch exit)."""
        try:
            self._pop_hooks()
        except Exception:  # noqa: BLE001
            pass
        if self._hooks_pushed:
            log.warning("fsdp_doctor: could not remove the activation-counting hooks (another saved_tensors_hooks "
                        "context is above them); they stay until the thread ends")
        self._last_full = None


_RELEASE_NS = 600  # one _Saved.__del__ + the unpack call (measured ~0.5 us on a 2-core CPU box)
_MAX_EVERY = 100


def _compute_device(units, model: nn.Module) -> torch.device:
    """FSDP's compute device (``FSDPParamGroup.device``): CPU-offloaded params live on the host, so the
    parameters' own device is not the answer."""
    for u in units:
        for pg in u.param_groups:
            dev = F2.compute_device(pg)
            if dev is not None:
                return dev
    for p in model.parameters():
        return getattr(p, "_local_tensor", p).device
    return torch.device("cpu")
