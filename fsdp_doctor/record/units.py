"""Finding FSDP2 units and taking their configuration snapshot.

Every read of FSDP2's private state goes through :mod:`fsdp_doctor.record.fsdp2` (the adapter): a field
that torch version does not have becomes ``None`` in the snapshot ("unknown"), with one line saying so.
"""

from __future__ import annotations

import itertools
import sys

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn

from ..records import CompiledModule, UnitConfig
from . import fsdp2 as F2

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
    # (fqn, module) of each CheckpointWrapper whose inner module is one of the unit's (the unit applied to a wrapper's
    # inner module: "layers.0._checkpoint_wrapped_module", accelerate's plugin, or checkpoint_wrapper after fully_shard)
    around: list[tuple[str, nn.Module]] = field(default_factory=list)

    @property
    def param_groups(self) -> list:
        """The unit's FSDPParamGroups ([] when this torch's groups cannot be read: see ``groups_known``)."""
        return F2.param_groups(self.state) or []

    @property
    def groups_known(self) -> bool:
        return F2.param_groups(self.state) is not None

    @property
    def params(self) -> list:
        """The unit's FSDPParams, every group."""
        return [fp for pg in self.param_groups for fp in F2.group_params(pg)]


def naming_root(model: nn.Module) -> nn.Module:
    """The module whose tree names the units and parameters: the model, or where watch() was given
    ``torch.compile(model)``'s wrapper of a sharded model (``model = torch.compile(model)`` after the fully_shard
    calls), the model inside it: the user's fixes go in place of their fully_shard calls, on that model (named
    through the wrapper, every name began "_orig_mod.", and a printed fix raised AttributeError: a new-user trial).
    Lightning Fabric's wrapper (``fabric.setup(model)``) likewise: the model inside it."""
    model = fabric_wrapped(model) or model
    inner = wrapped_module(model)
    if inner is not None and not F2.is_fsdp_module(model):
        return inner
    return model


def no_forward_of_its_own(model: nn.Module) -> bool:
    """Whether the watched module defines no forward() of its own: a container of models called one by one (a
    teacher and its student in an ``nn.ModuleDict``, each its own FSDP root), whose hooks never run; its units'
    forwards are the step's forward. ``torch.compile``'s wrapper sets its ``forward`` on the instance: the wrapped
    module's is the one it runs (fully_shard applied to the wrapper, as Hugging Face's Trainer does with
    torch_compile=True, keeps the wrapper as the naming root: its report read "watch() was given a module with no
    forward() of its own", a new-user trial)."""
    root = naming_root(model)
    inner = wrapped_module(root)
    return no_forward(root if inner is None else inner)


def no_forward(m: nn.Module) -> bool:
    """The module has no forward of its own (a ModuleList, a ModuleDict, a plain container): fully_shard refuses a
    ModuleList's or ModuleDict's, and nothing calls one, so hooks on it would never run."""
    return type(m).forward is nn.Module.forward


#: torch's words when an operator meets a sharded parameter (a DTensor) beside plain tensors: a module ran while its
#: unit's parameters were not gathered
MIXED_DTENSOR = "mixed torch.Tensor and DTensor"


def _module_frames(units: list[Unit], root: nn.Module, tb) -> tuple[list[tuple[str, nn.Module]], dict, dict]:
    """The frames of a traceback (``tb``) that run a method of one of ``root``'s modules, outermost first, as (the
    method's name, the module); with each unit by its modules' ids and each module's name by its id."""
    fqn = {id(m): n for n, m in root.named_modules()}
    frames = []
    while tb is not None:
        me = tb.tb_frame.f_locals.get("self")
        if isinstance(me, nn.Module) and id(me) in fqn:
            frames.append((tb.tb_frame.f_code.co_name, me))
        tb = tb.tb_next
    return frames, {id(m): u for u in units for m in u.modules}, fqn


def _holding_unit(units: list[Unit], name: str) -> Unit | None:
    """The innermost unit whose modules hold the module named ``name`` (the root's, "", holds every one)."""
    return max((u for u in units for n in u.module_names if name == n or _is_prefix(n, name)),
               key=lambda u: u.depth, default=None)


def outside_unit_call(units: list[Unit], root: nn.Module, tb) -> str:
    """Where a traceback (``tb``, the loop's exception) passes from a unit's forward into a module of another unit
    nested in it without that unit's forward (diffusers' DiTTransformer2DModel: the root's forward calls
    ``self.transformer_blocks[0].norm1.emb``, and with each block a unit its parameters were still sharded, "aten.addmm
    got mixed torch.Tensor and DTensor": a new-user trial), one sentence naming the module, its unit, the caller and
    the fix (the module a unit of its own, which FSDP2 gathers wherever it runs); "" where it does not. ``root``: the
    module the units' names are read from (``naming_root``)."""
    frames, unit_of, fqn = _module_frames(units, root, tb)
    called = []  # the modules whose forward the traceback passes through, outermost first
    for name, me in frames:
        if name == "forward" and (not called or called[-1] is not me):
            called.append(me)
    active = max((i for i, m in enumerate(called) if id(m) in unit_of), default=None)
    if active is None or active + 1 >= len(called) or id(called[active + 1]) in unit_of:
        return ""
    caller, callee = unit_of[id(called[active])], fqn[id(called[active + 1])]
    # the unit whose module holds the callee: not the caller's (whose parameters are gathered), nor one on the stack
    owner = _holding_unit(units, callee)
    on_stack = {id(c) for c in called}
    if owner is None or owner is caller or any(id(m) in on_stack for m in owner.modules):
        return ""
    where = "the root's" if caller.name == "" else f"{caller.name}'s"
    return (f"{callee}, inside FSDP unit {owner.name}, was called from {where} forward, outside {owner.name}'s own, "
            f"where FSDP2 had not gathered its parameters: make it a unit of its own, "
            f"fully_shard(model.get_submodule({callee!r})) before your fully_shard(...) of {owner.name}, so that "
            "FSDP2 gathers it wherever it runs")


def method_call(units: list[Unit], root: nn.Module, tb) -> str:
    """Where a traceback (``tb``, the loop's exception) passes through a method of a unit's module other than its
    forward, which ran the unit's own modules without FSDP2's pre-forward (a diffusers AutoencoderKL trained with
    ``model.encode(x)`` then ``model.decode(z)``: the root's ``encoder.conv_in`` raised "aten.convolution got mixed
    torch.Tensor and DTensor", a new-user trial), one sentence naming the method, the module that raised and the fix,
    ``register_fsdp_forward_method``; "" where it does not.

    Which method: FSDP2 hooks a registered method's backward to the tensors it returns. The VAE's ``encode`` returns
    an object holding a distribution, so with ``encode`` registered FSDP2's backward never ran for the root: with the
    whole model one unit nothing trained (its gradients stayed on the gathered parameters), and with ``decode``
    registered too, ``decode``'s post-backward resharded the root before ``encode``'s backward ("setStorage: ...
    storage of size 0"). ``_encode``, which ``encode`` calls, returns the tensor: registered, the VAE trains as a
    whole unit or with its blocks units. So for the root, which stays gathered after it for the rest of the step, the
    innermost method of its module on the traceback; for another unit, resharded after each, the outermost, the one
    the loop called. Passed over: a decorator's wrapper (a name not of the module's class), nn.Module's own methods,
    a LightningModule's training_step (a loop's step: then no sentence)."""
    mods, unit_of, fqn = _module_frames(units, root, tb)
    first = next((i for i, (_, me) in enumerate(mods) if id(me) in unit_of), None)
    if first is None:
        return ""
    me = mods[first][1]
    own = []  # (position, name): the unit module's methods on the traceback, outermost first
    for i, (name, m) in enumerate(mods):
        if m is not me:
            if id(m) in unit_of:  # another unit's frame inside: not this case
                return ""
            continue
        if name == "forward" or name in F2.registered_forward_methods(me) or name.endswith("_step"):
            return ""
        if callable(getattr(type(me), name, None)) and not hasattr(nn.Module, name):
            own.append((i, name))
    unit, callee = unit_of[id(me)], fqn[id(mods[-1][1])]
    # the module that raised is the unit's own, not inside a unit of its own nested in it
    if not own or _holding_unit(units, callee) is not unit:
        return ""
    public = [n for _, n in own if not n.startswith("_")]
    name = own[-1][1] if not unit.name else (public or [own[-1][1]])[0]
    where = fqn[id(me)]
    expr = "model" if not where else f"model.get_submodule({where!r})"
    called = public[0] if public and public[0] != name else None
    whose = "the root unit's" if not unit.name else f"FSDP unit {unit.name}'s"
    return ((f"{expr}.{called}() calls {expr}.{name}(), which" if called else f"{expr}.{name}()")
            + f" ran {whose} modules ({callee or 'the root'} raised) outside its forward, where FSDP2 gathers their "
            f"parameters. After your fully_shard calls, register_fsdp_forward_method({expr}, {name!r}) (from "
            f"torch.distributed.fsdp) gathers them for {name}() too"
            + (" (the innermost: FSDP2 hooks its backward to the tensors the method returns, and the root stays "
               "gathered for the calls after it)" if not unit.name else ""))


def find_units(model: nn.Module) -> list[Unit]:
    """All FSDP units under ``model`` (itself included), in module order; grouped units appear once; named from
    ``naming_root(model)``."""
    names = {id(m): n for n, m in naming_root(model).named_modules()}
    by_state: dict[int, Unit] = {}
    order: list[int] = []
    for mod_name, m in model.named_modules():
        if not F2.is_fsdp_module(m):
            continue
        state = F2.state_of(m)
        key = id(state)
        if key not in by_state:
            mods = F2.state_modules(state) or [m]
            mnames = [names.get(id(x), mod_name) for x in mods]
            by_state[key] = Unit(state=state, modules=mods, module_names=mnames, name=", ".join(mnames))
            order.append(key)
    units = [by_state[k] for k in order]
    root = naming_root(model)
    tail = "." + _CKPT_PREFIX
    for u in units:
        outer = [n[: -len(tail)] if n.endswith(tail) else "" for n in u.module_names
                 if n.endswith(tail) or n == _CKPT_PREFIX]
        u.around = [(n, w) for n in outer if (w := _submodule(root, n)) is not None]
    _link_nesting(units)
    return units


def _submodule(root: nn.Module, fqn: str) -> nn.Module | None:
    try:
        return root.get_submodule(fqn)
    except AttributeError:
        return None


def checkpointing(m: nn.Module) -> bool:
    """Whether ``m`` checkpoints its forward: a CheckpointWrapper (unless turned off: ``wrapper_off``), or a module
    under the composable ``checkpoint(module)`` API."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    try:
        from torch.distributed._composable.contract import _get_registry
    except ImportError:  # pragma: no cover
        _get_registry = lambda m: None  # noqa: E731
    if isinstance(m, CheckpointWrapper):
        return not wrapper_off(m)
    return "checkpoint" in (_get_registry(m) or {})


def wrapper_off(wrapper: nn.Module) -> bool:
    """A CheckpointWrapper whose checkpointing was turned off in place (ac.unneeded's fix: its ``checkpoint_fn`` a
    plain function calling the module as it is, snippets.remove_checkpointing): torch builds ``checkpoint_fn`` as a
    functools.partial of its checkpoint function (or of the one given to checkpoint_wrapper), torch 2.6 to 2.15, and
    ac.selective_to_full's fix keeps one; any plain function put in its place is read as not checkpointing (a
    checkpoint of the user's own assigned so, not a partial, would be misread). Without the attribute: on."""
    import functools

    fn = vars(wrapper).get("checkpoint_fn")  # (not through the wrapper's __getattr__, which asks its module)
    return fn is not None and not isinstance(fn, functools.partial)


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


def _checkpoint_kind(unit: Unit, all_units: list[Unit]) -> str:
    is_ckpt = checkpointing  # (a wrapper turned off in place: not checkpointing, its modules looked into)
    if any(is_ckpt(m) for m in unit.modules) or any(is_ckpt(w) for _, w in unit.around):
        return "unit"
    other_unit_mods = {id(m) for u in all_units if u is not unit for m in u.modules}
    found = 0
    stack = [c for m in unit.modules for c in m.children()]
    while stack:
        m = stack.pop()
        if id(m) in other_unit_mods or _wraps_unit(m, other_unit_mods):
            continue
        if is_ckpt(m):
            found += 1
            continue
        stack.extend(m.children())
    return "children" if found else "none"


def compiled_in_place(module: nn.Module) -> bool:
    """``module.compile()`` was called: its calls, hooks included, run in a compiled frame."""
    return getattr(module, "_compiled_call_impl", None) is not None


def compiled_wrapper(module: nn.Module) -> bool:
    """``torch.compile(module)``'s wrapper: an OptimizedModule, or a subclass of it (fully_shard applied to the wrapper
    makes an FSDPOptimizedModule, as Hugging Face's Trainer with torch_compile=True and FSDP2 does: a test of the
    class name alone missed it). Without Dynamo imported there is none (and it is not imported for the question)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    wrapper = getattr(eval_frame, "OptimizedModule", None)
    return wrapper is not None and isinstance(module, wrapper)


def wrapped_module(module: nn.Module) -> nn.Module | None:
    """The module inside ``torch.compile(module)``'s wrapper (an OptimizedModule, sharded or not); None for any other
    module."""
    inner = getattr(module, "_orig_mod", None)
    return inner if compiled_wrapper(module) and isinstance(inner, nn.Module) else None


#: where Lightning defines Fabric's module wrapper (the ``lightning`` package, and ``lightning_fabric`` on its own)
_FABRIC_WRAPPERS = ("lightning.fabric.wrappers", "lightning_fabric.wrappers")


def fabric_wrapped(module: nn.Module) -> nn.Module | None:
    """The module inside Lightning Fabric's wrapper (``fabric.setup(model)`` returns a ``_FabricModule`` holding the
    model it sharded, its ``parallelize_fn``'s, as ``_forward_module``); None for any other module. Named through
    the wrapper, every unit began "_forward_module." (a new-user trial), which the user's ``parallelize_fn``, given
    the model itself, does not have: wrap.params_in_root's fix pasted there raised AttributeError. Without Lightning
    imported there is none (and it is not imported for the question)."""
    for name in _FABRIC_WRAPPERS:
        wrapper = getattr(sys.modules.get(name), "_FabricModule", None)
        if wrapper is not None and isinstance(module, wrapper):
            inner = dict(module.named_children()).get("_forward_module")
            return inner if isinstance(inner, nn.Module) else None
    return None


@dataclass(frozen=True)
class CompiledFrame:
    """A compiled frame the model's forward runs: ``top``, the outermost module whose forward hooks run inside it
    (where the doctor's return at once), and the call that enters it, ``owner.<attr>``: ``_compiled_call_impl`` of a
    module compiled in place (``module.compile()``: its own hooks inside), or the ``forward`` of
    ``torch.compile(module)``'s wrapper, an OptimizedModule (its module's hooks inside, the wrapper's outside)."""

    top: nn.Module
    owner: nn.Module
    attr: str


def compiled_frames(model: nn.Module) -> tuple[list[CompiledFrame], set[int]]:
    """(the outermost compiled frames of ``model``'s forward, the ids of every module whose hooks run inside one:
    each frame's top and all below it)."""
    frames = []
    for m in model.modules():
        if compiled_in_place(m):
            frames.append(CompiledFrame(m, m, "_compiled_call_impl"))
        elif (inner := wrapped_module(m)) is not None and "forward" in vars(m):
            frames.append(CompiledFrame(inner, m, "forward"))
    below = {id(x) for f in frames for x in f.top.modules() if x is not f.top}
    return [f for f in frames if id(f.top) not in below], below | {id(f.top) for f in frames}


def user_class(module: nn.Module) -> type:
    """The module's own class, not the FSDP subclass ``fully_shard`` gives it (FSDPLlamaDecoderLayer)."""
    fsdp = F2.FSDPModule
    return next((c for c in type(module).__mro__ if fsdp is None or not issubclass(c, fsdp)), type(module))


def compiled_modules(model: nn.Module) -> list[CompiledModule]:
    """The modules whose forward is a compiled frame of its own (the outermost: ``compiled_frames``), in module order:
    each one's name in the model (through a compiled wrapper, the name the user gave: ``layers.0``, not
    ``layers.0._orig_mod``), its class, and the code Dynamo caches its compiled variants on, its forward's (Dynamo
    starts the frame there: ``Module._call_impl`` is not traced as a frame of its own)."""
    root = naming_root(model)
    names = {id(m): n for n, m in root.named_modules()}
    out = []
    for f in compiled_frames(model)[0]:
        name = names.get(id(f.owner), names.get(id(f.top), ""))
        fwd = getattr(f.top, "forward", None)
        code = getattr(getattr(fwd, "__func__", fwd), "__code__", None)
        out.append(CompiledModule(name=name, cls=user_class(f.top).__name__,
                                  **({} if code is None else dict(function=code.co_name, file=code.co_filename,
                                                                  line=code.co_firstlineno))))
    return out


def compiled_module(module: nn.Module) -> bool:
    """The module's forward is one compiled frame (``module.compile()``, or ``torch.compile(module)``'s wrapper)."""
    return compiled_in_place(module) or compiled_wrapper(module)


def compile_blocker(model: nn.Module) -> str | None:
    """Why the doctor's dispatch modes (the memory high-water, the FLOP count) must not run under this model's
    forward (None: they may). torch.compile does not trace with a dispatch mode of ours on the stack: it runs the
    frame eagerly, and a compile with fullgraph=True raises instead ("found no compiled frames"), as
    flex_attention's own does. So: compiled modules (OptimizedModule, ``module.compile()``), compiled functions
    held by a module (torchtitan's FlexAttention keeps ``torch.compile(flex_attention)`` on its class), and a
    Hugging Face model set to flex_attention. Read each time a mode would start: a model switched or compiled
    after watch() attached is seen."""
    for m in model.modules():
        if compiled_module(m):
            return "compiled modules: not counted"
        if getattr(getattr(m, "config", None), "_attn_implementation", None) == "flex_attention":
            return "flex_attention (compiled by torch): not counted"
        for v in itertools.chain(vars(type(m)).values(), vars(m).values()):
            try:
                if callable(v) and hasattr(v, "_torchdynamo_orig_callable"):
                    return "compiled functions in the model: not counted"
            except Exception:  # noqa: BLE001 - a user's attribute whose lookup raises is not compiled code
                continue
    return None


def checkpoint_wrappers(unit: Unit, all_units: list[Unit]) -> list[tuple[str, nn.Module]]:
    """(fqn, wrapper) of every CheckpointWrapper that is the unit itself or lies inside it (not inside a nested
    unit), in module order."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    def on(m: nn.Module) -> bool:  # (one turned off: no checkpointing, its modules the unit's as any others)
        return isinstance(m, CheckpointWrapper) and not wrapper_off(m)

    return [(fqn, m) for fqn, m in _unit_tree(unit, all_units, stop=on) if on(m)]


def running_stats_modules(unit: Unit, all_units: list[Unit]) -> list[str]:
    """fqns of the unit's modules (not inside a nested unit) that update running statistics in training: BatchNorm,
    SyncBatchNorm, InstanceNorm with ``track_running_stats`` (torch's ``_NormBase``). Checkpointing re-runs them in
    training mode during backward, updating them twice per step (a Conv-BN-ReLU under checkpoint_wrapper ends a step
    with ``num_batches_tracked`` 2; a new-user trial's ResNet buffers moved, its parameters identical)."""
    from torch.nn.modules.batchnorm import _NormBase

    return [fqn for fqn, m in _unit_tree(unit, all_units)
            if isinstance(m, _NormBase) and getattr(m, "track_running_stats", False)]


def _unit_tree(unit: Unit, all_units: list[Unit], stop=lambda m: False):
    """(fqn, module) of the unit's modules and every module inside them, in module order, neither nested units
    nor a CheckpointWrapper around another unit; below a module ``stop`` holds for, nothing."""
    other = {id(m) for u in all_units if u is not unit for m in u.modules}
    stack = list(zip(unit.module_names, unit.modules))[::-1]
    while stack:
        fqn, m = stack.pop()
        if _wraps_unit(m, other):  # (another unit's own wrapper: its checkpointing, not this unit's children's)
            continue
        yield fqn, m
        if not stop(m):
            stack.extend(reversed([(f"{fqn}.{n}" if fqn else n, c) for n, c in m.named_children()
                                   if id(c) not in other]))


def _wraps_unit(m: nn.Module, unit_modules: set[int]) -> bool:
    """``m`` is a CheckpointWrapper around another unit's module (checkpoint_wrapper applied after fully_shard, or
    accelerate's plugin): that unit is checkpointed whole, not the children of the unit holding the wrapper (the
    root read "children" checkpointed, its fix checkpointing the root, and pasted after fully_shard it removed every
    block's checkpointing: +79% peak, a new-user trial)."""
    return id(getattr(m, "_checkpoint_wrapped_module", None)) in unit_modules


def enclosing_wrapper(unit: Unit) -> list[str]:
    """The fqn of the CheckpointWrapper around the unit, when the unit was applied to a wrapper's inner module
    (``layers.0._checkpoint_wrapped_module``: accelerate's FSDP2 plugin with ``activation_checkpointing`` wraps
    each layer, then shards the layer inside) and the wrapper checkpoints; [] otherwise."""
    return [n for n, w in unit.around if checkpointing(w)]


def checkpointing_layer(m: nn.Module) -> bool:
    """``m`` checkpoints its own forward: transformers' GradientCheckpointingLayer (by class name: no transformers
    import) with its ``gradient_checkpointing`` on. Not any module with that flag: diffusers sets it on its blocks
    too, which then checkpoint their resnets and transformer blocks, not themselves (a U-Net's blocks read AC "unit"
    where their children re-ran)."""
    return getattr(m, "gradient_checkpointing", None) is True and any(
        c.__name__ == "GradientCheckpointingLayer" for c in type(m).__mro__)


def checkpoints_itself(u: Unit) -> bool:
    """The unit's module checkpoints its own forward (``checkpointing_layer``; UnitConfig.checkpoint_flag)."""
    return any(checkpointing_layer(m) for m in u.modules)


def checkpointed_modules(unit: Unit, all_units: list[Unit]) -> list[nn.Module]:
    """The modules activation checkpointing re-runs during backward for this unit: the inner module of
    every CheckpointWrapper that is the unit itself or lies inside it (not inside a nested unit)."""
    return [w._checkpoint_wrapped_module for _, w in checkpoint_wrappers(unit, all_units)]


def _param_bytes(fp) -> tuple[int | None, int | None, int | None, list[str]]:
    """(the model's elements (global: with tensor parallelism more than FSDP gathers), local sharded bytes incl.
    padding, bytes FSDP all-gathers (in param dtype), dtypes); None for what this torch does not let us read."""
    gathered = F2.param_numel(fp)
    orig = F2.orig_dtype(fp)
    pdt = F2.param_dtype(fp)
    data = F2.sharded_data(fp)
    local = data.numel() * data.element_size() if data is not None else None
    unsharded = (gathered * torch.empty((), dtype=pdt).element_size() if gathered is not None and pdt is not None
                 else None)
    return F2.global_numel(fp), local, unsharded, [_dtype_name(orig)] if orig is not None else []


def gathered_bytes(pg) -> int:
    """The bytes FSDP all-gathers for a param group (in param dtype; what this torch does not let us read: 0)."""
    return sum(_param_bytes(fp)[2] or 0 for fp in F2.group_params(pg))


def _add(total: int | None, v: int | None) -> int | None:
    return None if total is None or v is None else total + v


def _names(states: list | None, names: dict[int, str]) -> list[str] | None:
    return None if states is None else [names.get(id(s), "?") for s in states]


def snapshot_units(units: list[Unit], read_outside: Optional[frozenset] = None) -> list[UnitConfig]:
    """One UnitConfig per unit. A figure this torch does not let us read is None ("unknown"). ``read_outside``: the
    ids of the submodules the first step watched and saw read outside their forward, or never run
    (StepTimer.read_outside); None before the first step ends, or where none was watched."""
    names = {id(u.state): u.name for u in units}
    # elements FSDP gathers of each parameter (with tensor parallelism its tensor-parallel shard: the bytes a module
    # adds to its unit's all-gather)
    gathered = {id(sp): n for u in units for fp in u.params
                if (sp := F2.sharded_param(fp)) is not None and (n := F2.param_numel(fp)) is not None}
    owns, tied, leads, trails, sizes, no_fwd, frozen, outside = _own_modules(units, gathered, read_outside)
    out = []
    for u, own, leading, trailing, nf in zip(units, owns, leads, trails, no_fwd):
        pgs = F2.param_groups(u.state)
        known = pgs is not None
        pgs = pgs or []
        numel: int | None = 0 if known else None
        local, unsharded = numel, numel
        t_local, t_unsharded = numel, numel  # the trainable parameters' (requires_grad)
        dtypes: set[str] = set()
        fps = u.params
        for fp in fps:
            n, lb, ub, dts = _param_bytes(fp)
            numel, local, unsharded = _add(numel, n), _add(local, lb), _add(unsharded, ub)
            trainable = getattr(F2.sharded_param(fp), "requires_grad", None)
            if trainable is None:
                t_local = t_unsharded = None
            elif trainable:
                t_local, t_unsharded = _add(t_local, lb), _add(t_unsharded, ub)
            dtypes.update(d for d in dts if d)
        mp = F2.mp_policy(u.state)
        pg0 = pgs[0] if pgs else None
        offload = F2.offload_policy(pg0) if pg0 is not None else None
        is_cpu_offload = type(offload).__name__ == "CPUOffloadPolicy"
        root = F2.is_root(u.state)
        out.append(
            UnitConfig(
                name=u.name,
                modules=u.module_names,
                module_classes=[user_class(m).__name__ for m in u.modules],
                is_root=bool(root),
                param_count=numel,
                n_params=len(fps) if known else None,
                sharded_bytes=local,
                unsharded_bytes=unsharded,
                trainable_sharded_bytes=t_local,
                trainable_unsharded_bytes=t_unsharded,
                orig_dtypes=sorted(dtypes),
                param_dtype=_dtype_name(getattr(mp, "param_dtype", None)),
                reduce_dtype=_dtype_name(getattr(mp, "reduce_dtype", None)),
                output_dtype=_dtype_name(getattr(mp, "output_dtype", None)),
                # a unit without parameters has nothing to reshard; unknown when the groups are
                reshard_after_forward=F2.reshard_after_forward(pg0) if pg0 is not None else (False if known else None),
                forward_prefetch=_names(F2.prefetch_targets(u.state, "forward"), names),
                backward_prefetch=_names(F2.prefetch_targets(u.state, "backward"), names),
                unshard_async_op=F2.unshard_async_op(pg0) if pg0 is not None else (False if known else None),
                unshard_in_backward=F2.unshard_in_backward(pg0) if pg0 is not None else (True if known else None),
                offload="cpu" if is_cpu_offload else None,
                offload_pin_memory=bool(getattr(offload, "pin_memory", False)) if is_cpu_offload else None,
                checkpoint=_checkpoint_kind(u, units),
                checkpoint_wrappers=[n for n, _ in checkpoint_wrappers(u, units)] or enclosing_wrapper(u),
                checkpoint_flag=checkpoints_itself(u),
                running_stats_modules=running_stats_modules(u, units),
                forward_methods=sorted({n for m in u.modules for n in F2.registered_forward_methods(m)}),
                shard_dims=sorted({d for fp in fps if (d := F2.shard_dim(fp))}),
                param_groups=len(pgs) if known else None,
                depth=u.depth,
                parent=u.parent,
                own_modules=own,
                own_bytes=[sizes[n] for n in own],
                tied_modules=[n for n in own if n in tied],
                frozen_modules=[n for n in own if n in frozen],
                read_outside_modules=None if outside is None else [n for n in own if n in outside],
                leading_modules=leading,
                trailing_modules=trailing,
                no_forward_modules=nf,
                shard_size=_shard_size(pg0, fps),
            )
        )
    return out


def _own_modules(units: list[Unit], gathered: dict[int, int], read_outside: Optional[frozenset] = None) -> tuple[
        list[list[str]], set[str], list[list[str]], list[list[str]], dict[str, int], list[list[str]], set[str],
        Optional[set[str]]]:
    """Per unit, the fqns of the modules that hold its own parameters (nested units' subtrees left out); the
    fqns of modules sharing a parameter with another module (tied weights); per unit, its own modules before its
    first nested unit and those after its last one, in module order; each such module's parameter bytes as FSDP
    gathers them (``gathered``: elements per parameter id; a parameter not there counts its global elements); per
    unit, the modules of its tree with no forward of their own that hold own modules (``no_forward``); the fqns of
    the modules none of whose own parameters requires a gradient (frozen); those of the modules ``read_outside``
    names (their ids; None: not watched). Public module API only."""
    unit_mods = {id(m) for u in units for m in u.modules}
    holders: dict[int, list[str]] = {}
    out, leads, trails, sizes, no_fwd = [], [], [], {}, []
    frozen: set[str] = set()
    outside: Optional[set[str]] = set() if read_outside is not None else None
    for u in units:
        own: list[str] = []
        empty: list[str] = []  # modules without a forward of their own (a ModuleList), in module order
        # len(own) when the first and the last nested unit were passed, None before any (0 is a nested unit first:
        # read as "none", a root holding only the final norm and head after its units recorded no trailing module
        # and its plan called them "a new unit before the blocks", a new-user trial)
        before_nested: int | None = None
        after_nested: int | None = None
        for base, top in zip(u.module_names, u.modules):
            stack = [(base, top)]
            while stack:
                fqn, m = stack.pop()
                if m is not top and id(m) in unit_mods:  # a nested unit: not ours, but it marks the order
                    before_nested = len(own) if before_nested is None else before_nested
                    after_nested = len(own)
                    continue
                if m is not top and no_forward(m):
                    empty.append(fqn)
                if any(True for _ in m.parameters(recurse=False)):
                    own.append(fqn)
                    sizes[fqn] = sum(gathered.get(id(p), p.numel()) * p.element_size()
                                     for p in m.parameters(recurse=False))
                    for p in m.parameters(recurse=False):
                        holders.setdefault(id(p), []).append(fqn)
                    if not any(p.requires_grad for p in m.parameters(recurse=False)):
                        frozen.add(fqn)
                    if outside is not None and id(m) in read_outside:
                        outside.add(fqn)
                stack.extend(reversed([(f"{fqn}.{n}" if fqn else n, c) for n, c in m.named_children()]))
        out.append(own)
        no_fwd.append([e for e in empty if any(o.startswith(e + ".") for o in own)])
        leads.append(own[:before_nested] if before_nested is not None else [])
        trails.append(own[after_nested:] if after_nested is not None else [])
    tied = {n for names in holders.values() if len(set(names)) > 1 for n in names}
    return out, tied, leads, trails, sizes, no_fwd, frozen, outside



def _shard_size(pg, fps) -> int | None:
    """Ranks FSDP shards a unit's parameters over: its mesh's shard dimension, else from the sharded DTensor's mesh
    and placements (the FSDP mesh's dims come first; with tensor parallelism the model-parallel ones follow, and
    their shards are not FSDP's)."""
    n = F2.shard_mesh_size(pg) if pg is not None else None
    if n is not None:
        return n
    fsdp_dims = getattr(F2.fsdp_mesh(pg), "ndim", None) if pg is not None else None
    for fp in fps:
        sp = F2.sharded_param(fp)
        mesh, places = getattr(sp, "device_mesh", None), getattr(sp, "placements", None)
        if mesh is None or places is None:
            continue
        try:
            size = 1
            for dim, pl in enumerate(places[:fsdp_dims]):
                if pl.is_shard():
                    size *= mesh.size(dim)
            return size
        except Exception:  # noqa: BLE001 - a DTensor layout this code does not know: unknown
            return None
    return None


def managed_param_ids(units: list[Unit]) -> set[int]:
    """The parameters FSDP manages: each one's sharded DTensor and, where its unit is unsharded now, the unsharded
    parameter FSDP registered on the module in its place (a root kept gathered after a forward without gradients
    run before the first doctor.step(): its parameters read as unmanaged, "counts do not add up" and the
    optimizer's as stale, a new-user trial's evaluation at the end of a step)."""
    return {id(p) for u in units for fp in u.params
            for p in (F2.sharded_param(fp), F2.unsharded_param(fp)) if p is not None}


def sharded_of(units: list[Unit]) -> dict[int, nn.Parameter]:
    """id of each FSDP-managed parameter as the model may register it now (sharded, or unsharded while its unit is)
    -> the sharded parameter an optimizer holds: while a unit is unsharded (after a backward with
    ``set_reshard_after_backward(False)``, between a manual ``unshard()`` and ``reshard()``) the model's parameters
    are the unsharded ones, and an optimizer made after fully_shard held none of them (a new-user trial: a CRITICAL
    optim.before_shard, "53 of its 53 parameters are not the model's", on a run that trained right)."""
    out: dict[int, nn.Parameter] = {}
    for u in units:
        for fp in u.params:
            sp = F2.sharded_param(fp)
            if sp is None:
                continue
            out[id(sp)] = sp
            up = F2.unsharded_param(fp)
            if up is not None:
                out[id(up)] = sp
    return out


def unmanaged_params(model: nn.Module, units: list[Unit]) -> list[nn.Parameter]:
    """Model parameters no unit manages (the DTensor parameters FSDP put on the modules are managed)."""
    managed = managed_param_ids(units)
    return [p for p in model.parameters() if id(p) not in managed]


def unmanaged_param_bytes(model: nn.Module, units: list[Unit]) -> int | None:
    if not all(u.groups_known for u in units):
        return None
    total = 0
    for p in unmanaged_params(model, units):
        lt = getattr(p, "_local_tensor", p)
        total += lt.numel() * lt.element_size()
    return total


def unmanaged_summary(model: nn.Module, units: list[Unit]) -> tuple[int, list[str], int]:
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


def consistency_problem(model: nn.Module, units: list[Unit], cfgs: list[UnitConfig]) -> str | None:
    """At the first step: the units' parameter counts plus the unmanaged ones must equal the model's
    parameter count (global elements), and each unit's sharded bytes must be the local shards of its
    parameters (padding included, so at least ``ceil(numel / world)`` elements each). One line when not."""
    counts = [c.param_count for c in cfgs]
    if any(c is None for c in counts):
        return None  # already reported as unknown
    model_count = sum(p.numel() for p in model.parameters())  # DTensor numel is global
    unmanaged = sum(p.numel() for p in unmanaged_params(model, units))
    if sum(counts) + unmanaged != model_count:
        return (f"torch {F2.TORCH_STR}: unit parameter counts do not add up: units {sum(counts):,} + unmanaged "
                f"{unmanaged:,} != model {model_count:,}; this torch's FSDP internals may have changed")
    for u, c in zip(units, cfgs):
        if c.sharded_bytes is None:
            continue
        local = 0
        for fp in u.params:
            sp = F2.sharded_param(fp)
            lt = getattr(sp, "_local_tensor", sp)
            if lt is not None:
                local += lt.numel() * lt.element_size()
        if c.sharded_bytes < local:
            return (f"torch {F2.TORCH_STR}: unit {u.name or '(root)'} sharded bytes {c.sharded_bytes:,} are less than "
                    f"its local shards {local:,}; this torch's FSDP internals may have changed")
    return None


def label_to_index(units: list[Unit]) -> dict[str, int]:
    """Maps the fqn FSDP puts in its labels and logs (``FSDP::pre_backward (fqn)``) to the unit's index in
    ``units`` (our own unit names map too)."""
    out: dict[str, int] = {}
    for i, u in enumerate(units):
        for pg in u.param_groups:
            fqn = F2.group_fqn(pg)
            if fqn is not None:
                out[fqn] = i
        out.setdefault(u.name, i)
    return out
