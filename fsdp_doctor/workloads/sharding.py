"""Activation checkpointing and FSDP2 wrapping of the reference GPT, by policy.

The wrap policy is first turned into a *unit plan* (`fsdp_units`): which modules form each FSDP unit,
its name, its reshard_after_forward and its parameter count by formula. `apply_fsdp` executes the
plan on a real model; `analytic_param_counts` reads the counts off the plan without touching a model.

Unit names are module fully-qualified names as FSDP2 itself reports them (`FSDPParamGroup._module_fqn`
after lazy init): "layers.3", "" for the root, and for a unit made of several modules the member
names joined by ", " in module-registration order, e.g. "norm, lm_head". Activation checkpointing is
applied first, so modules inside a checkpointed block carry the `_checkpoint_wrapped_module.` prefix.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from ..record import fsdp2 as F2
from .config import ReshardValue, WorkloadConfig
from .gpt import block_leaf_counts, block_param_count, top_level_counts

CKPT_PREFIX = "_checkpoint_wrapped_module"
ROOT = ""
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
_CHECKPOINTED_CHILDREN = ("attn", "mlp")


@dataclass(frozen=True)
class UnitSpec:
    """One planned FSDP unit.

    `paths`: module fqns passed to `fully_shard` (after activation checkpointing), one per module;
    `name`: the unit name FSDP2 reports (paths joined by ", "); `param_count`: parameter elements the
    unit manages (its modules' parameters minus those of units nested inside); `reshard`: the
    `reshard_after_forward` argument (None = FSDP's default); `block`: the block index for a block unit.
    """

    name: str
    paths: tuple[str, ...]
    param_count: int
    reshard: Optional[ReshardValue]
    block: Optional[int] = None

    @property
    def is_root(self) -> bool:
        return self.paths == (ROOT,)


# ---------------------------------------------------------------------------------------------------
# Activation checkpointing
# ---------------------------------------------------------------------------------------------------

def checkpointed_blocks(cfg: WorkloadConfig) -> list[int]:
    """Indices of the blocks touched by activation checkpointing (torchtitan's every-K counting)."""
    every = cfg.ac_every()
    if every == 0:
        return []
    return [i for i in range(cfg.n_layers) if (i + 1) % every == 0]


def apply_activation_checkpointing(model: nn.Module, cfg: WorkloadConfig) -> None:
    """Wrap blocks (or, for ac="children", each block's attn and mlp) in a non-reentrant checkpoint; for
    ac="selective", under a policy that saves the matmuls' outputs, as torchtitan's default (its op-level
    ``SelectiveAC``, a checkpoint_wrapper with a ``context_fn``) does."""
    for i in checkpointed_blocks(cfg):
        if cfg.ac == "children":
            block = model.layers[i]
            for child in _CHECKPOINTED_CHILDREN:
                setattr(block, child, _checkpoint(getattr(block, child)))
        else:
            model.layers[i] = _checkpoint(model.layers[i], selective=cfg.ac == "selective")


def _checkpoint(module: nn.Module, selective: bool = False) -> nn.Module:
    kw = {"context_fn": _save_matmuls} if selective else {}
    return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kw)


def _save_matmuls():
    """Selective checkpointing's contexts: the matmuls' outputs saved, every other operator recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    save = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def block_leaf_path(cfg: WorkloadConfig, block: int, leaf: str) -> str:
    """Fqn of a block's leaf (e.g. "attn.qkv") once activation checkpointing has been applied."""
    prefix = f"layers.{block}"
    if block not in checkpointed_blocks(cfg):
        return f"{prefix}.{leaf}"
    if cfg.ac == "children":
        head, _, rest = leaf.partition(".")
        if head in _CHECKPOINTED_CHILDREN and rest:
            return f"{prefix}.{head}.{CKPT_PREFIX}.{rest}"
        return f"{prefix}.{leaf}"
    return f"{prefix}.{CKPT_PREFIX}.{leaf}"


# ---------------------------------------------------------------------------------------------------
# The unit plan
# ---------------------------------------------------------------------------------------------------

def fsdp_units(cfg: WorkloadConfig) -> list[UnitSpec]:
    """The FSDP units of `cfg.wrap`, in the order `fully_shard` is applied (innermost first).

    Parameter counts come from the layer shapes by formula, never from a model. Reshard overrides
    are resolved here, and an override naming no unit raises ValueError.
    """
    planners = {
        "block": _plan_block,
        "whole": _plan_whole,
        "leaf": _plan_leaf,
        "blocks_only": _plan_blocks_only,
        "no_root": _plan_no_root,
    }
    units = planners[cfg.wrap](cfg)
    return _apply_reshard_overrides(units, cfg)


def analytic_param_counts(cfg: WorkloadConfig) -> dict[str, int]:
    """Parameter elements per FSDP unit name for `cfg`'s wrap policy, computed from the shapes.

    Keys are the names FSDP2 uses (`_module_fqn`): module fqns, "" for the root, ", "-joined member
    names for grouped units ("tok_emb, pos_emb", "norm, lm_head"). Every unit is listed, including
    a root that manages no parameter (0 under wrap="block" or "leaf"; FSDP2 gives such a unit no
    parameter group, hence no `_module_fqn` of its own). The values sum to the model's parameter count
    except for wrap="no_root", whose embeddings, final norm and head belong to no unit. Under "no_root"
    every block is its own FSDP root, so FSDP2 itself names each of them "" - the keys here stay the
    blocks' fqns in the whole model.
    """
    return {unit.name: unit.param_count for unit in fsdp_units(cfg)}


def _unit(paths: list[str], count: int, cfg: WorkloadConfig, *, default_reshard=None,
          block: Optional[int] = None) -> UnitSpec:
    """A non-root unit; an explicit cfg.reshard_after_forward replaces the policy's default."""
    reshard = cfg.reshard_after_forward if cfg.reshard_after_forward is not None else default_reshard
    return UnitSpec(", ".join(paths), tuple(paths), count, reshard, block)


def _root(count: int) -> UnitSpec:
    return UnitSpec(ROOT, (ROOT,), count, None)


def _block_units(cfg: WorkloadConfig) -> list[UnitSpec]:
    count = block_param_count(cfg)
    return [_unit([f"layers.{i}"], count, cfg, block=i) for i in range(cfg.n_layers)]


def _embedding_paths(cfg: WorkloadConfig) -> list[str]:
    return ["tok_emb", "pos_emb"] if cfg.pos_emb else ["tok_emb"]


def _plan_block(cfg: WorkloadConfig) -> list[UnitSpec]:
    """torchtitan layout: embeddings, each block, [norm, lm_head] (kept unsharded), then the root."""
    top = top_level_counts(cfg)
    emb = _embedding_paths(cfg)
    head = ["norm", "lm_head"]
    return [
        _unit(emb, sum(top[p] for p in emb), cfg),
        *_block_units(cfg),
        _unit(head, sum(top[p] for p in head), cfg, default_reshard=False),
        _root(0),
    ]


def _plan_whole(cfg: WorkloadConfig) -> list[UnitSpec]:
    return [_root(sum(top_level_counts(cfg).values()) + cfg.n_layers * block_param_count(cfg))]


def _plan_leaf(cfg: WorkloadConfig) -> list[UnitSpec]:
    """Every Linear, LayerNorm and Embedding its own unit; the root manages nothing."""
    units = []
    for i in range(cfg.n_layers):
        for leaf, count in block_leaf_counts(cfg).items():
            units.append(_unit([block_leaf_path(cfg, i, leaf)], count, cfg))
    for path, count in top_level_counts(cfg).items():
        units.append(_unit([path], count, cfg))
    return units + [_root(0)]


def _plan_blocks_only(cfg: WorkloadConfig) -> list[UnitSpec]:
    """Blocks wrapped; embeddings, final norm and head stay in the root."""
    return _block_units(cfg) + [_root(sum(top_level_counts(cfg).values()))]


def _plan_no_root(cfg: WorkloadConfig) -> list[UnitSpec]:
    """Blocks wrapped, root never wrapped (misconfiguration: each block becomes its own FSDP root)."""
    return _block_units(cfg)


def _apply_reshard_overrides(units: list[UnitSpec], cfg: WorkloadConfig) -> list[UnitSpec]:
    """Replace `reshard` of the units named in cfg.reshard_overrides (by unit name or member fqn)."""
    lookup = {}
    for index, unit in enumerate(units):
        lookup[unit.name] = index
        for path in unit.paths:
            lookup[path] = index
    resolved = list(units)
    for name, value in cfg.reshard_overrides.items():
        if name not in lookup:
            known = ", ".join(repr(u.name) for u in units)
            raise ValueError(f"reshard override {name!r} names no FSDP unit of wrap={cfg.wrap!r}; "
                             f"units: {known}")
        index = lookup[name]
        u = resolved[index]
        resolved[index] = UnitSpec(u.name, u.paths, u.param_count, value, u.block)
    return resolved


# ---------------------------------------------------------------------------------------------------
# Applying the plan
# ---------------------------------------------------------------------------------------------------

def mixed_precision_policy(cfg: WorkloadConfig) -> Optional[MixedPrecisionPolicy]:
    """MixedPrecisionPolicy for cfg.param_dtype / cfg.reduce_dtype, or None when neither is set."""
    if cfg.param_dtype is None and cfg.reduce_dtype is None:
        return None
    return MixedPrecisionPolicy(
        param_dtype=DTYPES[cfg.param_dtype] if cfg.param_dtype else None,
        reduce_dtype=DTYPES[cfg.reduce_dtype] if cfg.reduce_dtype else None,
    )


def offload_policy(cfg: WorkloadConfig) -> Optional[CPUOffloadPolicy]:
    """CPUOffloadPolicy when cfg.cpu_offload; refused (ValueError) unless the device is a GPU."""
    if not cfg.cpu_offload:
        return None
    if cfg.device != "cuda":
        raise ValueError("cpu_offload needs device='cuda': on the CPU the parameters already live in host "
                         "memory")
    return CPUOffloadPolicy(pin_memory=cfg.offload_pin_memory)


def default_mesh(cfg: WorkloadConfig) -> DeviceMesh:
    """A 1-D mesh over every rank of the default process group."""
    return init_device_mesh(cfg.device, (dist.get_world_size(),))


def apply_fsdp(model: nn.Module, cfg: WorkloadConfig, mesh: Optional[DeviceMesh] = None) -> nn.Module:
    """Apply activation checkpointing, then `fully_shard` per `cfg.wrap`, then prefetch and async unshard.

    Requires an initialised process group. Returns `model` (now an FSDPModule unless wrap="no_root").
    """
    preflight(cfg)  # refuse a bad config before touching the model
    if cfg.device == "cpu":
        F2.enable_cpu_fsdp()  # torch 2.6: FSDP2 cannot train on CPU without these back-ports
    offload = offload_policy(cfg)
    apply_activation_checkpointing(model, cfg)
    mesh = mesh if mesh is not None else default_mesh(cfg)
    common = {"mesh": mesh}
    mp_policy = mixed_precision_policy(cfg)
    if mp_policy is not None:
        common["mp_policy"] = mp_policy
    if offload is not None:
        common["offload_policy"] = offload
    units = fsdp_units(cfg)
    for unit in units:
        modules = [model.get_submodule(path) for path in unit.paths]
        # None (auto: True, the root False) is fully_shard's default; torch 2.6 refuses it spelled out
        reshard = {} if unit.reshard is None else {"reshard_after_forward": unit.reshard}
        fully_shard(modules[0] if len(modules) == 1 else modules, **reshard, **common)
    _set_explicit_prefetch(model, units, cfg)
    if cfg.async_unshard and units and set_unshard_async(model) == 0:
        warnings.warn("async_unshard ignored: this torch has no FSDPModule._set_unshard_async_op",
                      stacklevel=2)
    return model


def preflight(cfg: WorkloadConfig) -> None:
    """Raise ValueError for what can be refused without a process group: unknown reshard override
    names, explicit prefetch without block units, CPU offload without a GPU."""
    fsdp_units(cfg)
    _check_prefetch_supported(cfg)
    offload_policy(cfg)


def _check_prefetch_supported(cfg: WorkloadConfig) -> None:
    has_blocks = cfg.wrap in ("block", "blocks_only", "no_root")
    if (cfg.forward_prefetch or cfg.backward_prefetch or cfg.prefetch_reversed) and not has_blocks:
        raise ValueError(f"explicit prefetch works over block units; wrap={cfg.wrap!r} has none "
                         "(use wrap=block, blocks_only or no_root, or prefetch depth 0)")


def _set_explicit_prefetch(model: nn.Module, units: list[UnitSpec], cfg: WorkloadConfig) -> None:
    """torchtitan-style: block i prefetches i+1..i+depth in forward and i-1..i-depth in backward."""
    blocks = [model.get_submodule(u.paths[0]) for u in units if u.block is not None]
    if cfg.prefetch_reversed:  # the wrong order (prefetch.wrong_order's scenario)
        for i, block in enumerate(blocks):
            if i > 0:
                block.set_modules_to_forward_prefetch([blocks[i - 1]])
            if i + 1 < len(blocks):
                block.set_modules_to_backward_prefetch([blocks[i + 1]])
        return
    for i, block in enumerate(blocks):
        if cfg.forward_prefetch:
            block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + cfg.forward_prefetch])
        if cfg.backward_prefetch:
            block.set_modules_to_backward_prefetch(blocks[max(0, i - cfg.backward_prefetch):i][::-1])


def set_unshard_async(model: nn.Module) -> int:
    """`_set_unshard_async_op(True)` on every FSDP unit (private API; skipped on torch without it).

    Returns how many units were switched.
    """
    switched = 0
    for module in model.modules():
        # recurses into nested units; harmless to repeat
        if isinstance(module, FSDPModule) and F2.set_unshard_async_op(module, True):
            switched += 1
    return switched
