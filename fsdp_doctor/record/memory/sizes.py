"""FSDP byte sizes for the memory probe: parameters (sharded, unsharded), gradients, optimizer state, buffers and
communication buffers, read through the FSDP2 adapter (``fsdp_doctor.record.fsdp2``) and cached where FSDP's
schedule repeats. One collaborator of :class:`fsdp_doctor.record.memory.MemoryProbe`; its figures are device bytes
unless named ``host``."""

from __future__ import annotations

import torch
import torch.nn as nn

from .. import fsdp2 as F2

# Property reads (``.grad``) on DTensor parameters go through __torch_function__ (~1 us each); inside this
# context they are plain C reads.
_NoTF = getattr(torch._C, "DisableTorchFunctionSubclass", None)


def _storage(t: torch.Tensor):
    """(storage key, storage bytes) of a plain tensor or a DTensor's local tensor; (None, 0) if it has none."""
    lt = t if type(t) is torch.Tensor or isinstance(t, nn.Parameter) else getattr(t, "_local_tensor", t)
    try:
        st = lt.untyped_storage()
        return st._cdata, st.nbytes()
    except Exception:  # noqa: BLE001 - tensor subclasses without a storage (fake, nested, sparse)
        return None, 0


def _is_grad_storage(pg, t: torch.Tensor) -> bool:
    """Whether ``t`` is the storage of the group's sharded gradients: with reduce dtype = param dtype FSDP
    all-reduces (HSDP) in place in the buffer its sharded gradients are views of, already counted as
    sharded_grads (counting it again as a comm buffer double-counts it)."""
    k, _ = _storage(t)
    if k is None:
        return False
    for fp in F2.group_params(pg):
        gr = getattr(F2.sharded_param(fp), "grad", None)
        if gr is not None:
            return _storage(gr)[0] == k
    return False


def _is_host(t: torch.Tensor) -> bool:
    lt = getattr(t, "_local_tensor", t)
    return lt.device.type == "cpu"



class _GroupInfo:
    """One FSDPParamGroup with its cached sizes."""

    __slots__ = ("pg", "unit", "fps", "unsharded_bytes", "post_fwd_bytes")

    def __init__(self, pg, unit: int):
        self.pg = pg
        self.unit = unit
        self.fps = F2.group_params(pg)
        self.unsharded_bytes: int | None = None
        self.post_fwd_bytes: int | None = None


class FsdpSizes:
    """Byte sizes of one rank's FSDP state, by category; ``host_is_device``: a CPU run (every tensor is device
    memory). The probe asks for per-mark figures and tells it where FSDP is (forward start, a unit's
    post-backward, the optimizer step)."""

    def __init__(self, model: nn.Module, optimizer, units, host_is_device: bool):
        self.model = model
        self.optimizer = optimizer
        self.units = units
        self.host_is_device = host_is_device
        self.groups: list[_GroupInfo] = []
        self.unit_groups: list[list[_GroupInfo]] = [[] for _ in units]
        for i, u in enumerate(units):
            for pg in u.param_groups:
                g = _GroupInfo(pg, i)
                self.groups.append(g)
                self.unit_groups[i].append(g)
        self._ss = F2.ShardedStates()
        # categories this torch's FSDP internals do not let us measure: reported as unknown, not as 0
        self.unknown: list[str] = []
        if not all(u.groups_known for u in units):
            self.unknown = ["unsharded_params", "unsharded_grads", "comm_buffers"]
        # cached figures (device bytes, host bytes)
        self.static_t = (0, 0)  # (sharded_params, buffers)
        self.host_static = 0
        self.unit_sgrad = [0] * len(units)
        self.unit_ugrad = [0] * len(units)
        self.unit_host_grad = [0] * len(units)
        self.unmanaged_sgrad = 0
        self.unmanaged_host_grad = 0
        self.opt_bytes = 0
        self.opt_host = 0
        self.opt_len = -1
        self.stale_bytes = 0
        self.stale_params = 0
        self.unmanaged: list[nn.Parameter] = []
        self.param_keys: set[int] = set()  # storages of parameters (shared with the activation counter)
        self.unsharded_keys: set[int] = set()  # of those, FSDP's unsharded parameters' (shared with it too)
        self.keys_built: set[int] = set()
        self._comm: F2.CommReader | None = None
        self.comm_note: str | None = None
        self.sg_total = 0
        self.ug_total = 0
        # unit -> (which of its params hold a gradient, unsharded grad bytes) before its post-backward
        self._ugrad_cache: dict[int, tuple[tuple, int]] = {}
        # unit -> (which of its params hold a gradient, sharded grad bytes, host grad bytes) after it
        self._sgrad_cache: dict[int, tuple[tuple, int, int]] = {}
        self._probe_fps: list[list] = []
        for gs in self.unit_groups:
            fps = []
            for g in gs:
                trainable = [fp for fp in g.fps if getattr(F2.sharded_param(fp), "requires_grad", False)]
                if trainable:
                    fps.append(trainable[0])
            self._probe_fps.append(fps)
        # units with trainable parameters the optimizer does not hold (refresh_optimizer): its zero_grad frees only
        # its own gradients, so one probe cannot tell what the unit keeps
        self._part_held = [False] * len(units)
        self.static_done = False
        self.pending: list[int] = []  # units whose post-backward ran since their grads were measured
        self.refresh_step = True  # this step re-measures every cached size
        self.unmanaged_static()
        self.refresh_optimizer(force=True)

    # ------------------------------------------------------------------ static sizes
    def unmanaged_static(self) -> None:
        """The model's parameters no FSDP unit manages, and their gradients. A unit unsharded now (the root, whose
        forward is running when the first unit's forward starts) has its unsharded parameters on the modules: they
        are FSDP's too (counted as unmanaged, a root holding parameters read its gradients as kept between steps)."""
        managed = self._managed_ids()
        self.unmanaged = [p for p in self.model.parameters() if id(p) not in managed]
        self.measure_unmanaged_grads()

    def _managed_ids(self) -> set[int]:
        """The parameters FSDP manages: each one's sharded DTensor and its unsharded parameter where FSDP made one."""
        return {id(p) for g in self.groups for fp in g.fps
                for p in (F2.sharded_param(fp), F2.unsharded_param(fp)) if p is not None}

    def refresh_static(self, final: bool = True) -> None:
        """Sharded params, unmanaged params, buffers, parameter storage keys (after FSDP's lazy init). ``final``
        False: at the first unit's forward, where roots not reached yet have not run their lazy init."""
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
        self.unmanaged_static()
        for p in self.unmanaged:
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
        self.static_t = (dev, buf)  # (sharded_params, buffers)
        self.host_static = host
        self.param_keys.clear()
        self.param_keys.update(keys)
        self.unsharded_keys.clear()
        self.keys_built = set()
        # the comm fields read at every mark (private FSDP API): checked once by the adapter
        self._comm = F2.CommReader((g.pg for g in self.groups), final=final)
        if not self._comm.ok and final:
            self.comm_note = (f"torch {F2.TORCH_STR}: FSDP's comm state is not recognised: comm_buffers unknown")
            if "comm_buffers" not in self.unknown:
                self.unknown.append("comm_buffers")
        elif self._comm.ok and self.comm_note is not None:  # the roots' lazy init has run since
            self.comm_note = None
            self.unknown = [u for u in self.unknown if u != "comm_buffers"]
        self.static_done = True

    def add_unit_param_keys(self, idx: int) -> None:
        """Storage keys of a unit's unsharded parameters (persist across reshards: FSDP resizes them)."""
        added = False
        for g in self.unit_groups[idx]:
            for fp in g.fps:
                up = F2.unsharded_param(fp)
                if up is not None:
                    k, _ = _storage(up)
                    if k is not None:
                        self.param_keys.add(k)
                        self.unsharded_keys.add(k)
                        added = True
                for t in F2.unsharded_tensors(fp):
                    k, _ = _storage(t)
                    if k is not None:
                        self.param_keys.add(k)
        if added:
            self.keys_built.add(idx)

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
            if F2.sharded_param(fp).grad is not None or F2.holds_unreduced_grad(fp):
                return True
        return False

    def _with_grads(self, idx: int, sharded: bool) -> tuple:
        """Which of the unit's parameters hold a gradient now (their sharded one, or else an unsharded or accumulated
        one), what a cached gradient size holds for: a unit that did not run in a step (an MoE expert no token
        reached, a dropped layer) has FSDP's post-backward run on no gradient, and its 0 cached then read every later
        step's gradients as temporaries (a new-user trial: 194 KiB of six experts' gradients, as memory.outputs_kept).
        Attribute reads, no storage access."""
        if sharded:
            return tuple(F2.sharded_param(fp).grad is not None for g in self.unit_groups[idx] for fp in g.fps)
        return tuple(F2.holds_unreduced_grad(fp) for g in self.unit_groups[idx] for fp in g.fps)

    def measure_unit_grads(self, idx: int) -> None:
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

    def quick_grads(self) -> None:
        """At the forward start: notice gradients freed (zero_grad) or kept since the last backward. A unit the
        optimizer holds only part of is measured: its zero_grad() frees some of the unit's gradients and keeps the
        rest (a new-user trial's last block, fc2 left out of AdamW: its probe, the LayerNorm's weight, had none, and
        the 49,920 B fc2's gradient kept, the unit's whole reduce-scatter output of an earlier step, read 0)."""
        for idx in range(len(self.units)):
            if self.unit_sgrad[idx] or self.unit_ugrad[idx] or self.unit_host_grad[idx] or self.refresh_step:
                if self.refresh_step or self._part_held[idx]:
                    self.measure_unit_grads(idx)
                elif not self._has_grads(idx):
                    self._set_grads(idx, 0, 0, 0)
        if self.unmanaged:
            self.measure_unmanaged_grads()

    def measure_unmanaged_grads(self) -> None:
        dev = host = 0
        seen: set[int] = set()
        for p in self.unmanaged:
            gr = p.grad
            if gr is not None:
                d, h = self._grad_bytes(gr, seen)
                dev += d
                host += h
        self.unmanaged_sgrad = dev
        self.unmanaged_host_grad = host

    def refresh_optimizer(self, force: bool = False) -> None:
        opt = self.optimizer
        if opt is None:
            return
        state = getattr(opt, "state", None)
        n = len(state) if state is not None else 0
        if not force and n == self.opt_len:
            return
        self.opt_len = n
        # the model's parameters, and FSDP's sharded ones where a unit is unsharded now (its unsharded parameters
        # on the modules in their place: the optimizer's read as stale after a forward without gradients)
        model_ids = {id(p) for p in self.model.parameters()} | self._managed_ids()
        seen: set[int] = set()
        held: set[int] = set()
        dev = host = 0
        stale = 0
        stale_n = 0
        own = False  # whether it holds any of the model's parameters
        for group in opt.param_groups:
            for p in group.get("params", ()):
                held.add(id(p))
                own = own or id(p) in model_ids
                if id(p) in model_ids or F2.is_sharded(p):  # (another FSDP model's: its state is optimizer state)
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
            is_stale = id(p) not in model_ids and not F2.is_sharded(p)
            if not own and id(p) not in model_ids and not is_stale:
                # an optimizer of another FSDP2 model only: its state is that model's memory, as its parameters and
                # gradients are (a distillation's teacher watched with its student's AdamW read 259 KiB of state beside
                # 195 KiB of parameters, a new-user trial); one optimizer over both models keeps both's
                continue
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
        self._part_held = [any(getattr(sp := F2.sharded_param(fp), "requires_grad", False) and id(sp) not in held
                               for g in gs for fp in g.fps) for gs in self.unit_groups]
        self.opt_bytes = dev
        self.opt_host = host
        self.stale_bytes = stale
        self.stale_params = stale_n

    # ------------------------------------------------------------------ per-mark figures
    def unsharded_bytes(self) -> int:
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

    def comm_bytes(self, keys: set | None = None) -> int:
        """FSDP's collective buffers in flight (0 while unknown: the step says ``unknown``); ``keys``: a set the
        counted buffers' storages are added to."""
        c = self._comm
        return (c.bytes(exclude=_is_grad_storage, keys=keys) or 0) if c is not None else 0

    def _set_grads(self, idx: int, sg: int, ug: int, host: int) -> None:
        self.sg_total += sg - self.unit_sgrad[idx]
        self.ug_total += ug - self.unit_ugrad[idx]
        self.unit_sgrad[idx] = sg
        self.unit_ugrad[idx] = ug
        self.unit_host_grad[idx] = host

    def before_post_backward(self, idx: int) -> None:
        """FSDP's post-backward of the unit starts: its unsharded gradients are all there, unreduced.
        Their size repeats every step: measured on refresh steps and first sightings, cached otherwise."""
        hit = self._ugrad_cache.get(idx)
        which = self._with_grads(idx, sharded=False)
        if hit is None or self.refresh_step or hit[0] != which:
            self.measure_unit_grads(idx)
            self._ugrad_cache[idx] = (which, self.unit_ugrad[idx])
        else:
            self._set_grads(idx, self.unit_sgrad[idx], hit[1], self.unit_host_grad[idx])
        self.pending.append(idx)

    def flush_pending(self) -> None:
        """Units whose post-backward ran since the last mark: with gradient sync, FSDP dropped the
        unsharded gradients and left sharded ones (one flat reduce-scatter output per unit, the same size
        every step: cached like the unsharded ones); without sync, the unsharded ones stay (measured)."""
        for i in self.pending:
            reduce = True
            for g in self.unit_groups[i]:
                if not F2.reduce_grads(g.pg):
                    reduce = False
            hit = self._sgrad_cache.get(i)
            which = self._with_grads(i, sharded=True) if reduce else ()
            if not reduce or hit is None or self.refresh_step or hit[0] != which:
                self.measure_unit_grads(i)
                if reduce:
                    self._sgrad_cache[i] = (which, self.unit_sgrad[i], self.unit_host_grad[i])
            else:
                self._set_grads(i, hit[1], 0, hit[2])
        self.pending.clear()

    def host_bytes(self) -> int:
        return self.host_static + sum(self.unit_host_grad) + self.unmanaged_host_grad + self.opt_host
