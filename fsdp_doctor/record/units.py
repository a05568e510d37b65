"""Finding FSDP2 units and taking their configuration snapshot.

Everything below ``FSDPModule``'s public methods is private API; it is read defensively here (getattr with
fallbacks) so that a torch version that moved a field degrades to a missing value, not a crash.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..records import UnitConfig

try:  # torch >= 2.6 exposes FSDPModule here
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - older layouts
    from torch.distributed._composable.fsdp import FSDPModule  # type: ignore

_CKPT_PREFIX = "_checkpoint_wrapped_module"


@dataclass
class Unit:
    """One FSDP unit: an FSDPState and the modules it was applied to, named from the watched model."""

    state: object
    modules: list[nn.Module]
    module_names: list[str]
    name: str
    depth: int = 0
    parent: str | None = None
    children: list[str] = field(default_factory=list)

    @property
    def param_groups(self) -> list:
        return list(getattr(self.state, "_fsdp_param_groups", None) or [])

    @property
    def fsdp_params(self) -> list:
        return [fp for pg in self.param_groups for fp in getattr(pg, "fsdp_params", [])]


def _state_of(module: nn.Module):
    get = getattr(module, "_get_fsdp_state", None)
    if get is not None:
        return get()
    from torch.distributed.fsdp import fully_shard

    return fully_shard.state(module)


def find_units(model: nn.Module) -> list[Unit]:
    """All FSDP units under ``model`` (itself included), in module order; grouped units appear once."""
    names = {id(m): n for n, m in model.named_modules()}
    by_state: dict[int, Unit] = {}
    order: list[int] = []
    for mod_name, m in model.named_modules():
        if not isinstance(m, FSDPModule):
            continue
        state = _state_of(m)
        key = id(state)
        if key not in by_state:
            mods = list(getattr(state, "_modules", None) or [m])
            mnames = [names.get(id(x), mod_name) for x in mods]
            by_state[key] = Unit(state=state, modules=mods, module_names=mnames, name=", ".join(mnames))
            order.append(key)
    units = [by_state[k] for k in order]
    _link_nesting(units)
    return units


def _is_prefix(parent: str, child: str) -> bool:
    return parent == "" or child.startswith(parent + ".")


def _link_nesting(units: list[Unit]) -> None:
    """Sets depth and parent: the enclosing unit is the deepest unit whose module contains this one."""
    for u in units:
        best: Unit | None = None
        for v in units:
            if v is u:
                continue
            if any(_is_prefix(pn, cn) for pn in v.module_names for cn in u.module_names if pn != cn):
                if best is None or max(len(n) for n in v.module_names) > max(len(n) for n in best.module_names):
                    best = v
        u.parent = best.name if best else None
    by_name = {u.name: u for u in units}
    for u in units:
        d, p = 0, u.parent
        while p is not None and d < 64:
            d += 1
            p = by_name[p].parent
        u.depth = d
        if u.parent is not None:
            by_name[u.parent].children.append(u.name)


def _dtype_name(dt) -> str | None:
    return None if dt is None else str(dt).replace("torch.", "")


def _reshard_after_forward(pg) -> bool | int:
    mi = getattr(pg, "mesh_info", None)
    pfmi = getattr(pg, "post_forward_mesh_info", "missing")
    if pfmi == "missing":
        return True
    if pfmi is None:
        return False
    if pfmi is mi:
        return True
    return int(getattr(pfmi, "shard_mesh_size", 0) or 0) or True


def _checkpoint_kind(unit: Unit, all_units: list[Unit]) -> str:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    try:
        from torch.distributed._composable.contract import _get_registry
    except ImportError:  # pragma: no cover
        _get_registry = lambda m: None  # noqa: E731

    def is_ckpt(m: nn.Module) -> bool:
        reg = _get_registry(m) or {}
        return isinstance(m, CheckpointWrapper) or "checkpoint" in reg

    if any(is_ckpt(m) for m in unit.modules) or any(n.endswith(_CKPT_PREFIX) for n in unit.module_names):
        return "unit"
    other_unit_mods = {id(m) for u in all_units if u is not unit for m in u.modules}
    found = 0
    stack = [c for m in unit.modules for c in m.children()]
    while stack:
        m = stack.pop()
        if id(m) in other_unit_mods:
            continue
        if is_ckpt(m):
            found += 1
            continue
        stack.extend(m.children())
    return "children" if found else "none"


def checkpointed_modules(unit: Unit, all_units: list[Unit]) -> list[nn.Module]:
    """The modules activation checkpointing re-runs during backward for this unit: the inner module of
    every CheckpointWrapper that is the unit itself or lies inside it (not inside a nested unit)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    other = {id(m) for u in all_units if u is not unit for m in u.modules}
    out, stack = [], list(unit.modules)
    while stack:
        m = stack.pop()
        if isinstance(m, CheckpointWrapper):
            out.append(m._checkpoint_wrapped_module)
            continue
        stack.extend(c for c in m.children() if id(c) not in other)
    return out


def _param_bytes(fp) -> tuple[int, int, int, list[str]]:
    """(elements unsharded, local sharded bytes incl. padding, unsharded bytes in param dtype, dtypes)."""
    orig_size = getattr(fp, "_orig_size", None)
    sp = getattr(fp, "sharded_param", None)
    numel = math.prod(orig_size) if orig_size is not None else (sp.numel() if sp is not None else 0)
    orig_dtype = getattr(fp, "orig_dtype", None) or (sp.dtype if sp is not None else torch.float32)
    param_dtype = getattr(fp, "param_dtype", None) or orig_dtype
    data = getattr(fp, "_sharded_param_data", None)
    if data is not None:
        local = data.numel() * data.element_size()
    elif sp is not None:
        lt = getattr(sp, "_local_tensor", sp)
        local = lt.numel() * lt.element_size()
    else:
        local = 0
    unsharded = numel * torch.empty((), dtype=param_dtype).element_size()
    return numel, local, unsharded, [_dtype_name(orig_dtype)]


def snapshot_units(units: list[Unit]) -> list[UnitConfig]:
    names = {id(u.state): u.name for u in units}
    out = []
    for u in units:
        pgs = u.param_groups
        numel = local = unsharded = 0
        dtypes: set[str] = set()
        for fp in u.fsdp_params:
            n, lb, ub, dts = _param_bytes(fp)
            numel += n
            local += lb
            unsharded += ub
            dtypes.update(d for d in dts if d)
        mp = getattr(u.state, "_mp_policy", None)
        pg0 = pgs[0] if pgs else None
        offload = getattr(pg0, "offload_policy", None) if pg0 is not None else None
        is_cpu_offload = type(offload).__name__ == "CPUOffloadPolicy"
        fps = u.fsdp_params
        out.append(
            UnitConfig(
                name=u.name,
                modules=u.module_names,
                is_root=bool(getattr(u.state, "_is_root", False)),
                param_count=numel,
                n_params=len(fps),
                sharded_bytes=local,
                unsharded_bytes=unsharded,
                orig_dtypes=sorted(dtypes),
                param_dtype=_dtype_name(getattr(mp, "param_dtype", None)),
                reduce_dtype=_dtype_name(getattr(mp, "reduce_dtype", None)),
                output_dtype=_dtype_name(getattr(mp, "output_dtype", None)),
                reshard_after_forward=_reshard_after_forward(pg0) if pg0 is not None else False,
                forward_prefetch=[names.get(id(s), "?") for s in getattr(u.state, "_states_to_forward_prefetch", [])],
                backward_prefetch=[names.get(id(s), "?") for s in getattr(u.state, "_states_to_backward_prefetch", [])],
                unshard_async_op=bool(getattr(pg0, "unshard_async_op", False)) if pg0 is not None else False,
                offload="cpu" if is_cpu_offload else None,
                offload_pin_memory=bool(getattr(offload, "pin_memory", False)) if is_cpu_offload else None,
                checkpoint=_checkpoint_kind(u, units),
                param_groups=len(pgs),
                depth=u.depth,
                parent=u.parent,
            )
        )
    return out


def managed_param_ids(units: list[Unit]) -> set[int]:
    return {id(fp.sharded_param) for u in units for fp in u.fsdp_params if getattr(fp, "sharded_param", None) is not None}


def unmanaged_param_bytes(model: nn.Module, units: list[Unit]) -> int:
    managed = managed_param_ids(units)
    total = 0
    for p in model.parameters():
        if id(p) in managed:
            continue
        lt = getattr(p, "_local_tensor", p)
        total += lt.numel() * lt.element_size()
    return total


def unmanaged_params(model: nn.Module, units: list[Unit]) -> tuple[int, list[str], int]:
    """Parameters no unit manages (``ignored_params``): (elements, names of the trainable ones, their bytes)."""
    managed = managed_param_ids(units)
    numel, names, nbytes = 0, [], 0
    for n, p in model.named_parameters():
        if id(p) in managed:
            continue
        numel += p.numel()
        if p.requires_grad:
            names.append(n)
            lt = getattr(p, "_local_tensor", p)
            nbytes += lt.numel() * lt.element_size()
    return numel, names, nbytes


def label_to_index(units: list[Unit]) -> dict[str, int]:
    """Maps the fqn FSDP puts in its labels and logs (``FSDP::pre_backward (fqn)``) to the unit's index in
    ``units`` (our own unit names map too)."""
    out: dict[str, int] = {}
    for i, u in enumerate(units):
        for pg in u.param_groups:
            fqn = getattr(pg, "_module_fqn", None)
            if fqn is not None:
                out[fqn] = i
        out.setdefault(u.name, i)
    return out
