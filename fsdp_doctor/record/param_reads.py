"""Which modules' parameters the first training forward reads outside their own forward.

A plan that makes such a module a unit of its own never gathers it where its parameters are read: torch raises
"mixed torch.Tensor and DTensor" at the first forward (a GPT whose logits read the embedding's weight,
``F.linear(h, self.wte.weight)``, as MPT's do; DeBERTa-v2's encoder reading ``rel_embeddings.weight``: new-user
trials). During the first training forward alone (the model's forward pre-hook to its post-hook, where the step's
checkpointing probes are on: never in a compiled frame, nor in a process that called torch.compile: see
``compile_used``) a ``TorchFunctionMode`` looks at each call's tensor arguments
for a watched module's parameter while that module's forward is not running. Metadata reads (``.dtype``,
``.shape``, ``size()``) and FSDP2's own calls (its hooks unshard and reshard every unit's parameters) are not reads.
It only looks; each call runs unchanged. One collaborator of :class:`fsdp_doctor.record.hooks.StepTimer`."""

from __future__ import annotations

import sys
from typing import Iterable

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

#: tensor methods that read metadata only: they work on a sharded parameter as well
_METADATA = frozenset({"__get__", "size", "dim", "numel", "nelement", "element_size", "stride", "data_ptr",
                       "is_contiguous", "is_floating_point", "is_complex", "get_device", "type", "__len__",
                       "__repr__", "__format__", "__hash__", "__eq__", "untyped_storage", "_typed_storage",
                       "storage_offset", "has_names", "is_pinned"})
#: calls from FSDP2's own code (its hooks) are not the model's reads
_FSDP_DIR = "/torch/distributed/fsdp/"


class ParamReads(TorchFunctionMode):
    """Counts, per watched module, its forward's nesting depth (``enter``/``leave`` from its forward hooks) and
    records the modules whose parameters a call reads while that depth is 0 (``outside``: module ids)."""

    def __init__(self, modules: Iterable[nn.Module]):
        super().__init__()
        self.depth: dict[int, int] = {}
        self.owners: dict[int, set[int]] = {}  # id(parameter tensor) -> ids of the modules holding it
        self.outside: set[int] = set()
        for m in modules:
            self.own(m)

    def own(self, m: nn.Module) -> None:
        """Notes the tensors ``m`` holds as parameters now (FSDP2 swaps its sharded and unsharded ones)."""
        for p in m._parameters.values():
            if p is not None:
                self.owners.setdefault(id(p), set()).add(id(m))

    def enter(self, m: nn.Module) -> None:
        self.own(m)
        self.depth[id(m)] = self.depth.get(id(m), 0) + 1

    def leave(self, m: nn.Module) -> None:
        if self.depth.get(id(m)):
            self.depth[id(m)] -= 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # (inside a frame Dynamo compiles, a function the forward calls: folded to True, nothing traced but the call)
        if self.owners and not torch.compiler.is_compiling() and getattr(func, "__name__", "") not in _METADATA:
            try:
                self._look(args)
                self._look(kwargs.values())
            except Exception:  # noqa: BLE001 - never break the user's forward
                pass
        return func(*args, **kwargs)

    def _look(self, xs) -> None:
        for x in xs:
            if isinstance(x, (list, tuple)):
                self._look(x)
                continue
            mods = self.owners.get(id(x))
            if mods and not any(self.depth.get(i) for i in mods) and not mods <= self.outside:
                if not _from_fsdp():
                    self.outside.update(mods)


def compile_used() -> bool:
    """Whether this process has called torch.compile (a backend in Dynamo's cache; not imported: never). A mode on
    the stack enters the guards of every frame Dynamo compiles under it: a compiled function the forward calls (a
    compiled flex_attention) would compile again once the mode is off (1 graph became 3 in a test). Where compile
    was used, the reads are not looked at."""
    ef = sys.modules.get("torch._dynamo.eval_frame")
    if ef is None:
        return False
    backends = getattr(ef, "cached_backends", None)
    return backends is None or any(b is not None for b in backends.values())


def _from_fsdp() -> bool:
    """Whether FSDP2's own code made this call (a frame of torch.distributed.fsdp on the stack)."""
    f = sys._getframe(2)
    while f is not None:
        if _FSDP_DIR in f.f_code.co_filename.replace("\\", "/"):
            return True
        f = f.f_back
    return False
