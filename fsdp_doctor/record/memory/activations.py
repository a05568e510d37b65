"""Saved-tensor counting for the memory probe: the ``activations`` category, exactly.

An outer ``torch.autograd.graph.saved_tensors_hooks`` pair (pushed on full steps only) counts every tensor
autograd saves for backward, each storage once, parameters and storages shared with them skipped; a saved
tensor's bytes leave the running counter when autograd drops its packed handle. One collaborator of
:class:`fsdp_doctor.record.memory.MemoryProbe`."""

from __future__ import annotations

import logging
import time
import weakref

import torch
import torch.nn as nn

from .. import fsdp2 as F2

log = logging.getLogger("fsdp_doctor")
_now = time.perf_counter_ns
RELEASE_NS = 600  # one _Saved.__del__ + the unpack call (measured ~0.5 us on a 2-core CPU box)


_LOW = (torch.bfloat16, torch.float16)


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
        _release(self.live, self.k)


def _release(live: "_Live", k: int) -> None:
    """One saved reference to the storage ``k`` is gone: its bytes leave the count with the last one."""
    e = live.entries.get(k)
    if e is None:
        return
    e[0] -= 1
    if e[0] <= 0:
        del live.entries[k]
        live.bytes -= e[1]
        if e[2]:
            live.cast -= e[1]


class _Live:
    """Running count of saved-for-backward storages (shared with the _Saved handles)."""

    __slots__ = ("entries", "bytes", "high", "packs", "cast", "cast_dtype")

    def __init__(self):
        self.entries: dict[int, list[int]] = {}  # storage key -> [saved references alive, bytes, autocast's copy]
        self.bytes = 0
        self.high = 0  # the highest ``bytes`` since the step began, between marks too
        self.packs = 0
        self.cast = 0  # of ``bytes``, autocast's copies of FSDP's unsharded parameters
        self.cast_dtype: str | None = None


class SavedTensors:
    """The running count of saved-for-backward bytes, and what each unit's forward left saved."""

    def __init__(self, param_keys: set, host_is_device: bool, unsharded_keys: set = frozenset()):
        self.param_keys = param_keys  # storages of parameters: never activations (the sizes keep it current)
        self.unsharded_keys = unsharded_keys  # of those, FSDP's unsharded parameters' (autocast's copies are of them)
        self.autocast = False  # the forward runs under torch.autocast: tell its copies of parameters apart
        self.host_is_device = host_is_device
        self.live = _Live()
        self.pushed = False
        self.error: str | None = None  # the pack hook failed once: activations are not counted any more
        self.mode = "off"  # this step: "exact" | "off"
        self.note: str | None = None  # why they are not counted this step
        self.pack_ns = 0
        self.unit_act_start: dict[int, tuple[int, int]] = {}  # unit -> (saved bytes, of which copies) at its start
        # unit -> bytes its forward left saved: summed over the unit's forwards in one pass (a module called twice
        # keeps both calls' tensors), the largest pass of the step (the micro-batches of gradient accumulation
        # each free theirs in their backward: summed, 4 micro-batches read 4x the activations the peak held)
        self.unit_act: dict[int, int] = {}
        self.unit_cast: dict[int, int] = {}  # unit -> of those, autocast's copies of parameters (as unit_act)
        self._pass: dict[int, tuple[int, int]] = {}  # unit -> (saved, copies) in this pass so far
        # unit -> of unit_act, what no unit nested in its forward saved (its own): the nested units' saves are
        # subtracted where they ran inside this unit's forward, not where they ran after it returned (torchtitan's
        # chunked loss calls its [norm, output] unit after the model's forward: the root's own read -32 KiB when
        # the analysis subtracted every child's figure from the root's)
        self.unit_own: dict[int, int] = {}
        self._own_pass: dict[int, int] = {}
        self._open: list[int] = []  # the units whose forward is running, outermost first
        self._nested: dict[int, int] = {}  # unit -> bytes its nested units' forwards saved inside its own, so far
        # unit -> its forward inputs' bytes in the pass unit_act was taken from (what checkpointing it keeps)
        self.unit_in: dict[int, int] = {}
        self._in_pass: dict[int, int] = {}
        # selective activation checkpointing's caches: the regions running now (their caches, None where a region
        # is not selective), and the cached tensors counted, by id, until they die
        self._regions: list = []
        self._held: dict[int, weakref.finalize] = {}
        self._pack_fn = None  # the pack hook pushed (marked as not the user's: fsdp2.not_the_users_hooks)

    def begin(self) -> None:
        self.mode = "off"
        self.note = None
        self.live.packs = 0
        self.live.high = self.live.bytes
        self.pack_ns = 0
        self.unit_act = {}
        self.unit_act_start = {}
        self.unit_cast = {}
        self._pass = {}
        self.unit_own = {}
        self._own_pass = {}
        self._open = []
        self._nested = {}
        self.unit_in = {}
        self._in_pass = {}
        self._regions = []

    def backward_start(self) -> None:
        """A unit's backward began: the forward pass before it has ended (the next forward is another pass)."""
        self._regions = []
        self._pass = {}
        self._own_pass = {}
        self._open = []
        self._nested = {}
        self._in_pass = {}

    def unit_input(self, idx: int, nbytes: int) -> None:
        """A call of the unit's forward took ``nbytes`` of input tensors (summed over its calls in the pass)."""
        self._in_pass[idx] = self._in_pass.get(idx, 0) + nbytes

    def unit_forward_start(self, idx: int) -> None:
        self.unit_act_start[idx] = (self.live.bytes, self.live.cast)
        self._open.append(idx)
        self._nested[idx] = 0

    def unit_forward_end(self, idx: int) -> None:
        start = self.unit_act_start.pop(idx, None)
        if start is not None:
            delta = self.live.bytes - start[0]
            if idx in self._open:  # (the innermost running unit: it is the last one opened)
                del self._open[len(self._open) - 1 - self._open[::-1].index(idx)]
            if self._open:  # the unit it ran in: its saves are that unit's nested ones
                self._nested[self._open[-1]] = self._nested.get(self._open[-1], 0) + delta
            own = self._own_pass.get(idx, 0) + delta - self._nested.pop(idx, 0)
            self._own_pass[idx] = own
            saved, cast = self._pass.get(idx, (0, 0))
            saved, cast = saved + delta, cast + self.live.cast - start[1]
            self._pass[idx] = (saved, cast)
            if saved >= self.unit_act.get(idx, saved):
                self.unit_act[idx] = saved
                self.unit_own[idx] = own
                if idx in self._in_pass:
                    self.unit_in[idx] = self._in_pass[idx]
                if cast or idx in self.unit_cast:
                    self.unit_cast[idx] = cast

    def region_start(self) -> None:
        """A checkpointed module's forward starts, inside its checkpoint's region: a selective one's cache is noted.
        What selective activation checkpointing (torchtitan's default; ``create_selective_checkpoint_contexts``)
        saves for backward it keeps in a cache of its own, not among autograd's saved tensors, so no saved-tensor
        hook sees it: 4 selective blocks' saved matmul outputs (10 MiB) read as temporaries (activations 1.5 MiB,
        temporaries 12.5 MiB at the peak)."""
        if self.mode == "exact":
            self._regions.append(F2.sac_cache())

    def region_end(self) -> None:
        """The checkpointed module's forward returned: what its region's cache holds counts as saved, each storage
        once (with autograd's saved tensors), until the cached tensor dies (the recompute takes it from the cache
        and its backward frees it). Nothing here refers to a cached tensor after this call (a weak reference's
        callback takes it off): a reference cycle holding them would keep them until a garbage collection."""
        if self.mode != "exact" or not self._regions:
            return
        cache = self._regions.pop()
        if cache is not None:
            for t in F2.sac_cached_tensors(cache):
                self._hold(t)

    def _hold(self, t) -> None:
        if id(t) in self._held:
            return
        st = (t if type(t) is torch.Tensor else getattr(t, "_local_tensor", t)).untyped_storage()
        if not self.host_is_device and st.device.type == "cpu":
            return
        k = st._cdata
        nb = st.nbytes()
        if k in self.param_keys or nb == 0:
            return
        live = self.live
        e = live.entries.get(k)
        if e is None:
            live.entries[k] = [1, nb, False]
            live.bytes += nb
            live.high = max(live.high, live.bytes)
        else:
            e[0] += 1
        f = weakref.finalize(t, self._let_go, id(t), k)
        f.atexit = False
        self._held[id(t)] = f

    def _let_go(self, i: int, k: int) -> None:
        self._held.pop(i, None)
        _release(self.live, k)

    def cost_ns(self) -> int:
        """The pack hook's measured time plus the handle releases (run by autograd: estimated)."""
        return self.pack_ns + self.live.packs * RELEASE_NS

    def _pack(self, t):
        t0 = _now()
        r = self._pack_inner(t)
        self.pack_ns += _now() - t0
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
            if k in self.param_keys:
                return d
            e = live.entries.get(k)
            if e is None:
                nb = st.nbytes()
                if nb == 0:  # a freed (resharded) storage holds nothing
                    return d
                cast = self.autocast and t.dtype in _LOW and self._param_cast(t if b is None else b)
                live.entries[k] = [1, nb, cast]
                live.bytes += nb
                if live.bytes > live.high:
                    live.high = live.bytes
                if cast:
                    live.cast += nb
                    live.cast_dtype = str(t.dtype).replace("torch.", "")
            else:
                e[0] += 1
            return _Saved(d, k, live)
        except Exception as exc:  # noqa: BLE001 - never break the user's forward
            if self.error is None:
                self.error = f"{type(exc).__name__}: {exc}"[:200]
                log.warning("fsdp_doctor: activation counting failed (%s); activations are not counted", self.error)
            try:
                return t.detach()
            except Exception:  # noqa: BLE001
                return t

    def _param_cast(self, t) -> bool:
        """Whether ``t`` (a saved tensor's base) is autocast's copy of one of FSDP's unsharded parameters: a
        ``_to_copy`` whose only input is a parameter's gradient accumulator (a matmul under autocast saves the
        16-bit cast of its 32-bit weight, or a view of it, for backward)."""
        g = t.grad_fn
        if g is None or type(g).__name__ != "ToCopyBackward0":
            return False
        nf = g.next_functions
        acc = nf[0][0] if nf else None
        if acc is None or type(acc).__name__ != "AccumulateGrad":
            return False
        return acc.variable.untyped_storage()._cdata in self.unsharded_keys

    @staticmethod
    def _unpack(x):
        return x.t if type(x) is _Saved else x

    def push(self) -> None:
        """Pushes our saved-tensor hooks (a full step's forward starts)."""
        if self.pushed or self.error is not None:
            return
        ag = torch._C._autograd
        try:
            if not ag._saved_tensors_hooks_is_enabled():
                self.note = "saved tensor hooks are disabled here"
                return
            if F2.saved_hooks_top() is not None:
                # the user's own saved_tensors_hooks (e.g. save_on_cpu) are active: ours would override them
                self.note = "the training loop's own saved_tensors_hooks are active; activations not counted"
                return
            if self._pack_fn is None:
                def pack(t):
                    return self._pack(t)

                F2.not_the_users_hooks(pack)
                self._pack_fn = pack
            ag._push_saved_tensors_default_hooks(self._pack_fn, self._unpack)
            self.pushed = True
            self.mode = "exact"
        except Exception as exc:  # noqa: BLE001
            self.note = f"saved tensor hooks unavailable ({type(exc).__name__}: {exc})"[:200]

    def pop(self) -> None:
        """Pops our hooks when they are on top (main thread, outside the forward/backward)."""
        if not self.pushed:
            return
        ag = torch._C._autograd
        top = F2.saved_hooks_top()
        if top is F2.UNKNOWN_HOOKS or (top is not None and top[0] is self._pack_fn):
            # (torch 2.6 cannot show the top: context managers above ours have exited by now)
            ag._pop_saved_tensors_default_hooks()
            self.pushed = False
