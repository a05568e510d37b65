"""The optimizer as the recorder reads it: its state and parameter groups, and its name, where a container of
several optimizers steps them (torchtitan's OptimizersContainer) and holds only empty shells itself, or where each
parameter's own optimizer steps inside the backward (torchtune's optimizer_in_bwd: in_backward_optimizers)."""

from __future__ import annotations

import torch


class OptimizerParts:
    """Several optimizers read as one: a container that steps them (torchtitan's OptimizersContainer holding one
    per optimizer name, Muon beside AdamW, or per pipeline stage), whose own state and groups are empty shells.
    Their state and parameter groups in order, named by theirs ("DistMuon+AdamW"); its step hooks stay the
    container's."""

    def __init__(self, optimizers: list, in_backward: bool = False):
        self.optimizers = optimizers
        # per-parameter optimizers that step inside the backward (in_backward_optimizers), not a container's
        self.in_backward = in_backward

    @property
    def state(self) -> dict:
        return {p: st for o in self.optimizers for p, st in o.state.items()}

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def name(self) -> str:
        return "+".join(dict.fromkeys(type(o).__name__ for o in self.optimizers))


def held_optimizers(opt) -> list | None:
    """The optimizers a container steps and holds as ``.optimizers`` (torchtitan's OptimizersContainer, itself an
    Optimizer whose own state and groups are empty shells), or None where ``opt`` is no such container."""
    inner = getattr(opt, "optimizers", None)
    if has_step_hooks(opt) and isinstance(inner, list) and inner and all(has_step_hooks(o) for o in inner):
        return inner
    return None


def wrapped_optimizers(obj) -> list | None:
    """The optimizers an object of the user's own holds and steps together where it is no optimizer (a Muon user's
    ``MultiOptimizer(muon, adamw)`` whose step() steps both: a new-user trial's was refused, and watch() ended the
    run before its first step): each optimizer among its attributes, alone or in a list, tuple or dict, in order,
    each once; None where it holds none (or is an optimizer, or wraps one as ``.optimizer``)."""
    if has_step_hooks(obj) or getattr(obj, "optimizer", None) is not None or not hasattr(obj, "__dict__"):
        return None
    found = []
    for v in vars(obj).values():
        items = list(v.values()) if isinstance(v, dict) else list(v) if isinstance(v, (list, tuple)) else [v]
        if items and all(has_step_hooks(o) for o in items):
            found += items
    return list({id(o): o for o in found}.values()) or None


def in_backward_optimizers(obj) -> list | None:
    """The per-parameter optimizers of an optimizer stepped inside the backward, given to watch() as the object that
    maps each parameter's name to its optimizer (``.optim_map``: torchtune's OptimizerInBackwardWrapper, which its
    recipes keep as ``self._optim_ckpt_wrapper`` under ``optimizer_in_bwd: True``; a post-accumulate-grad hook on
    each parameter steps its optimizer as FSDP2 reduce-scatters the gradient), in order, each once; None where
    ``obj`` is no such map."""
    optim_map = getattr(obj, "optim_map", None)
    if has_step_hooks(obj) or not isinstance(optim_map, dict) or not optim_map:
        return None
    opts = list({id(o): o for o in optim_map.values()}.values())
    return opts if all(has_step_hooks(o) for o in opts) else None


def optimizer_reads(stepped: list):
    """What the (unwrapped) optimizers the loop steps have their state and groups read from: the one itself, or
    where there are several, or a container of several (unwrap_optimizer kept it), their OptimizerParts; None for
    none."""
    parts = [o for s in stepped for o in held_optimizers(s) or [s]]
    return OptimizerParts(parts) if len(parts) > 1 else (stepped[0] if stepped else None)


def optimizer_name(opt) -> str | None:
    """The name a run records for its optimizer (RunConfig.optimizer)."""
    if opt is None:
        return None
    return opt.name if isinstance(opt, OptimizerParts) else type(opt).__name__


def has_step_hooks(opt) -> bool:
    """A torch Optimizer whose step hooks work (its Optimizer.__init__ ran: not accelerate's wrapper)."""
    return isinstance(opt, torch.optim.Optimizer) and isinstance(opt.__dict__.get("_optimizer_step_pre_hooks"), dict)
