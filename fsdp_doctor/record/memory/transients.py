"""The exact high-water mark between two marks, on full steps: what lives only inside a unit's forward or
backward, the loss and its gradients, the root's reduce-scatter buffer.

The probe's marks sit at FSDP's hook boundaries; what is allocated and freed between two of them (a unit's
op temporaries, the logits' log-softmax and gradients, the reduce-scatter input FSDP allocates in the root's
post-backward) is invisible there. On a full step :class:`HighWater` runs a ``TorchDispatchMode`` that keeps a
running count of the bytes of the storages the step's ops create (each storage once, taken off when it dies:
a weak reference's callback) and of storage resizes (FSDP's unshard / reshard resize its unsharded parameters'
storages in place: ``torch.UntypedStorage.resize_`` is wrapped while the mode is on, as FSDPMemTracker does).
At each mark the probe reads the counter and the highest value it reached since the previous mark (with the
saved-for-backward bytes at that moment); the mark's own figures anchor it, so the high-water between two
marks is ``total at the mark - counter at the mark + highest counter``.

Numerics: the mode only observes; every op runs ``func(*args, **kwargs)`` unchanged, below the Python key, on
the kernel it would have run (nothing is decomposed; DTensor ops are handed back to DTensor first, as
FSDPMemTracker does, and seen as their local ops). Tested: losses bit-identical with and without it on SiLU
and GELU models. It steps aside for the step when another dispatch mode is on the stack (the user's own, a
checkpoint's selective-recompute mode is pushed and popped above it) and never runs on models with compiled
modules. One collaborator of :class:`fsdp_doctor.record.memory.MemoryProbe`.

Activation checkpointing's recompute (ops run in backward with grad mode on, ``phase.in_recompute``) is counted
apart as well: the storages one recompute creates and still holds when it ends, at the first backward op after
it, are exactly the tensors it saved for backward, i.e. what the un-checkpointed forward would have kept saved on
top of what is saved now (its inputs existed before it and are not counted). Views and record_function labels
with grad mode off do not end it (the checkpoint's pack hook detaches what it saves). Per unit (``owner``, set by
the probe from its backward marks), summed over the step: ``recompute_saved``.

Cost: every op of a counted step passes through Python (tens of microseconds per op on a CPU box), so it runs
on full steps only, and its cost (the handler's time plus an estimated ``DISPATCH_NS`` per op) is part of the
probe's, which sizes the period of full steps (``full_every="auto"``).
"""

from __future__ import annotations

import functools
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode, _len_torch_dispatch_stack

from ..phase import in_recompute

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without DTensor
    DTensor = None

_now = time.perf_counter_ns
_Tensor = torch.Tensor
# Entering a Python dispatch mode from C++ costs more than the handler's own body and cannot be timed from
# inside it: a trivial mode added 16-60 us per small op on a 2-core CPU box (min of 15 runs of 500 ops: 2.0 us
# per op without a mode, 18-21 us with one). Counted per op at the low end.
DISPATCH_NS = 16_000


def _tensors(x, out: list) -> None:
    """The tensors of an op's arguments or results (tensors, lists of them, lists of lists)."""
    if isinstance(x, _Tensor):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            if isinstance(y, _Tensor):
                out.append(y)
            elif isinstance(y, (list, tuple)):
                _tensors(y, out)


@functools.lru_cache(maxsize=None)
def _passive(func) -> bool:
    """An op that allocates nothing and may run with grad mode off inside a recompute (the checkpoint's pack hook
    detaches what it saves; record_function labels): it does not end the recompute."""
    return bool(getattr(func, "is_view", False)) or getattr(func, "namespace", "") == "profiler"


class _Mode(TorchDispatchMode):
    # higher-order operators (flex_attention, torch.cond, ...) pass through __torch_dispatch__ and run unchanged,
    # their outputs counted and their inner operators not; without this torch raises NotImplementedError for any
    # of them under the mode, which broke a full step of a model switched to flex_attention (the H200's GPU row)
    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """torch.compile compiles what the user compiles with the mode on, which it steps aside for while it compiles:
        a mode that does not say so makes Dynamo skip every frame it meets under the mode, for good (a user's
        ``torch.compile(loss_fn)`` first called on the doctor's full memory step was never compiled in the run:
        a new-user trial). Read by torch >= 2.9; an earlier torch skips those frames as before."""
        return True

    def __init__(self, hw: HighWater):
        super().__init__()
        self.hw = hw

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor is not None and DTensor in types:
            return NotImplemented  # DTensor desugars into local ops first; we see those
        hw = self.hw
        if not hw.active:
            return func(*args, **(kwargs or {}))
        t0 = _now()
        rc = in_recompute()
        if rc is not hw.rc_open and (rc or not _passive(func)):
            hw.recompute_edge()
        ins: list = []
        _tensors(args, ins)
        if kwargs:
            _tensors(tuple(kwargs.values()), ins)
        keys = set()
        for t in ins:
            try:
                keys.add(t.untyped_storage()._cdata)
            except Exception:  # noqa: BLE001 - tensors without a storage
                pass
        t1 = _now()
        out = func(*args, **(kwargs or {}))
        t2 = _now()
        try:
            hw.created(out, keys)
            if getattr(func, "namespace", None) == "fsdp":
                hw.fsdp_op(func, out, kwargs)
        except Exception as exc:  # noqa: BLE001 - never break the user's op
            hw.fail(exc)
        hw.cost_ns += t1 - t0 + _now() - t2 + DISPATCH_NS
        return out


class HighWater:
    """Running bytes of the storages created (and resized) while on, with the high-water mark since the last
    ``read()``; ``saved`` is the saved-tensor counter (its ``bytes`` at the high-water moment are kept)."""

    def __init__(self, device: torch.device, saved):
        self.device = device
        self.saved = saved
        self.active = False
        self.live = 0
        self.hw = 0
        self.hw_saved = 0
        self.hw_t = 0
        self.cost_ns = 0  # the handler's own time, plus DISPATCH_NS per op (estimated)
        self.error: str | None = None
        self._refs: dict[int, list] = {}  # storage key -> [weak reference, bytes, recompute number (0: none)]
        self._comm: set[int] = set()  # the keys of FSDP's collective buffers among them (``fsdp_op``)
        self.owner = None  # the unit whose backward runs now (the probe sets it at its backward marks)
        self.rc_open = False  # a recompute is running
        self.rc_n = 0  # recomputes seen this step (the current one's number)
        self.rc_live = 0  # bytes the current recompute created and still holds
        self._rc_owner = None
        self.recompute_saved: dict = {}  # owner -> bytes its recomputes saved for backward (this step)
        self._mode: _Mode | None = None
        self._orig_resize = None

    # ------------------------------------------------------------------ on / off
    def start(self) -> str | None:
        """Turns the counting on for a step; returns why not (None when on)."""
        if self.active:
            return None
        if self.error is not None:
            return self.error
        if _len_torch_dispatch_stack() > 0:
            return "another TorchDispatchMode is active"
        self.live = self.hw = self.hw_saved = 0
        self.rc_open, self.rc_live, self.rc_n, self.recompute_saved = False, 0, 0, {}
        self.hw_t = _now()
        self.cost_ns = 0
        self._mode = _Mode(self)
        self._mode.__enter__()
        orig = self._orig_resize = torch.UntypedStorage.resize_

        @functools.wraps(orig)
        def resize_(st, size):
            old = st.nbytes()
            r = orig(st, size)
            if self.active:
                self.resized(st, old)
            return r

        torch.UntypedStorage.resize_ = resize_
        self._resize = resize_
        self.active = True
        return None

    @property
    def parked(self) -> bool:
        """Stopped without popping its mode (``stop(pop=False)``): inert on the stack until a ``stop()`` pops it."""
        return not self.active and self._mode is not None

    def stop(self, pop: bool = True) -> bool:
        """Turns it off: pops the mode (when it is on top and ``pop``), restores ``resize_``, forgets every
        storage. Returns False when the mode could not be popped (another mode above it; it stays inert)."""
        if not self.active and self._mode is None:
            return True
        if self.rc_open:
            self.recompute_edge()
        self.active = False
        ok = True
        if self._mode is not None and pop:
            if _get_current_dispatch_mode() is self._mode:
                self._mode.__exit__(None, None, None)
                self._mode = None
            else:
                ok = False
        if self._orig_resize is not None and torch.UntypedStorage.resize_ is self._resize:
            torch.UntypedStorage.resize_ = self._orig_resize
            self._orig_resize = None
        self._refs.clear()  # dropped weak references never call back
        self._comm.clear()
        return ok

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = f"transient counting failed ({type(exc).__name__}: {exc})"[:200]
        self.active = False

    # ------------------------------------------------------------------ counting
    def _on_device(self, st) -> bool:
        d = st.device
        return d.type == self.device.type and (d.index is None or self.device.index in (None, d.index))

    def _bump(self) -> None:
        if self.live > self.hw:
            self.hw = self.live
            self.hw_saved = self.saved.bytes
            self.hw_t = _now()

    def _freed(self, k: int, _ref) -> None:
        self._comm.discard(k)
        e = self._refs.pop(k, None)
        if e is not None:
            self.live -= e[1]
            if self.rc_open and e[2] == self.rc_n:
                self.rc_live -= e[1]

    def recompute_edge(self) -> None:
        """A recompute starts, or ends: what it created and still holds is what it saved, added to its unit's."""
        if self.rc_open:
            self.recompute_saved[self._rc_owner] = self.recompute_saved.get(self._rc_owner, 0) + self.rc_live
            self.rc_open = False
        else:
            self.rc_open, self.rc_live, self._rc_owner = True, 0, self.owner
            self.rc_n += 1

    def recompute_of(self, unit) -> None:
        """The recompute under way re-runs ``unit``'s forward (its forward_start mark in backward, after the ops
        FSDP's pre-forward ran for it): it is that unit's, not the one whose backward was running when it began."""
        if self.rc_open:
            self._rc_owner = unit

    def created(self, out, input_keys: set) -> None:
        """An op's results: storages that are neither its inputs' nor already known are new allocations."""
        res: list = []
        _tensors(out, res)
        refs = self._refs
        rc = self.rc_n if self.rc_open else 0
        for t in res:
            if type(t) is not _Tensor and not isinstance(t, torch.nn.Parameter):
                continue
            st = t.untyped_storage()
            k = st._cdata
            if k in input_keys or k in refs or not self._on_device(st):
                continue
            nb = st.nbytes()
            refs[k] = [weakref.ref(st, functools.partial(self._freed, k)), nb, rc]
            self.live += nb
            if rc:
                self.rc_live += nb
        self._bump()

    def fsdp_op(self, func, out, kwargs) -> None:
        """FSDP2's own ops: the all-gather output ``fsdp::all_gather_copy_in`` returns, and the reduce-scatter input
        ``fsdp::chunk_cat`` writes (its ``out``), are its collective buffers, whose storages are tagged."""
        name = func._schema.name
        got: list = []
        if name == "fsdp::all_gather_copy_in":
            _tensors(out, got)
        elif name == "fsdp::chunk_cat" and kwargs:
            _tensors(kwargs.get("out"), got)
        for t in got:
            k = t.untyped_storage()._cdata
            if k in self._refs:
                self._comm.add(k)

    def comm_alive(self, counted: set) -> int:
        """Bytes of FSDP's collective buffers still alive that are not among ``counted`` (the storages FSDP's comm
        state holds): what the backend still holds after FSDP released them. gloo's worker thread drops a finished
        collective's work, and the tensors in it, when it is next scheduled: on a 2-core host a block's all-gather
        output or reduce-scatter input can outlive the backward (a new-user trial's tied Qwen2 read 710.00 KiB, one
        block's, as the loop keeping the model's outputs: memory.outputs_kept warned)."""
        refs = self._refs
        return sum(refs[k][1] for k in self._comm if k in refs and k not in counted)

    def resized(self, st, old: int) -> None:
        if not self._on_device(st):
            return
        new = st.nbytes()
        e = self._refs.get(st._cdata)
        if e is not None:
            e[1] = new
        self.live += new - old
        self._bump()

    def read(self) -> tuple[int, int, int, int]:
        """(counter now, highest since the last read, saved bytes then, when (ns)); restarts the high-water."""
        out = (self.live, self.hw, self.hw_saved, self.hw_t)
        self.hw = self.live
        self.hw_saved = self.saved.bytes
        self.hw_t = _now()
        return out
