"""The configuration snapshot written at the first step (``RunConfig``): the units, the job, the optimizer and
what this torch's FSDP2 could not tell. One collaborator of :class:`fsdp_doctor.record.tracker.Doctor`."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace
from typing import Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..records import (ALLOC_CONF_VARS, FRAME_UNSEEN_START, Experts, OptimizerGroup, RunConfig, Untrained,
                       optimizer_model_params, optimizer_of_another_model)
from ..units import fmt_list
from . import fsdp2 as F2
from .memory.device import allocator_limit
from .optimizers import optimizer_name
from .throughput import device_peak_tflops
from .units import (Unit, checkpointing_layer, compiled_frames, compiled_modules, consistency_problem,
                    managed_param_ids, naming_root, no_forward_of_its_own, sharded_of, snapshot_units,
                    unmanaged_param_bytes, unmanaged_summary)

log = logging.getLogger("fsdp_doctor")
# what the run says when the model's forward ran in a compiled frame the doctor was not given (its hooks do nothing
# there): what it was, how the step and its units were timed instead (from FSDP2's logs: StepTimer.frame_unseen), and
# the fix (unseen_note: from the step it was seen in)
_UNSEEN_WHAT = ("the compiled wrapper of torch.compile(model) trained instead of the model passed to watch(), or a "
                "function compiled around the model's call (torch.compile of a step or loss function that calls it); "
                "its hooks do nothing there")
_UNSEEN_FIX = ("Pass the compiled model to watch(), or compile the model in place (model.compile()) and call it from "
               "an uncompiled step function")
FRAME_UNSEEN = (f"{FRAME_UNSEEN_START}: {_UNSEEN_WHAT}, so the step's forward and backward and its units are timed "
                "from FSDP2's own hooks, which run outside compiled code: the forward from its units' first "
                "pre-forward to their last post-forward (the model's own code outside its units not in it), the "
                "backward from their first pre-backward to autograd's end; forwards without gradients (evaluation) "
                "likewise, counted apart. Dynamo compiles the doctor's hooks on the model itself there as frames of "
                f"their own, which do nothing: the step's compiles count them. {_UNSEEN_FIX}")
# ... where FSDP2 logged no forward there either (tracker: _forward_unseen), and the steps before
FRAME_UNSEEN_UNTIMED = (f"{FRAME_UNSEEN_START}: {_UNSEEN_WHAT}, so the step's forward, backward and every unit's time "
                        f"are not recorded. {_UNSEEN_FIX}")


def unseen_note(timed: bool, from_step: int = 0) -> str:
    """The run's FRAME_UNSEEN note: ``timed``, its forward timed from FSDP2's logs (else FRAME_UNSEEN_UNTIMED); seen
    first in step ``from_step``, where the steps before ran no training forward there (the doctor's own hooks timed
    them; the units table's medians hold both)."""
    note = FRAME_UNSEEN if timed else FRAME_UNSEEN_UNTIMED
    if not from_step:
        return note
    before = "step 0" if from_step == 1 else f"steps 0-{from_step - 1}"
    return note.replace(f"{FRAME_UNSEEN_START}:", f"{FRAME_UNSEEN_START} from step {from_step} on ({before} ran "
                        "their forward outside it, timed by the doctor's own hooks):", 1)


def config_snapshot(model: nn.Module, optimizer, units: list[Unit], *, rank: int, world_size: int,
                    device: torch.device, capacity_bytes: int | None, tokens_per_step: int | None,
                    peak_tflops: float | None, flops_per_step: float | None, profile_schedule,
                    hardware_flops_per_step: float | None = None,
                    runtime_checkpointed: Iterable[int], consistency: str | None,
                    runtime_checkpointed_children: Iterable[int] = (),
                    timed_compiled: Iterable[int] = (), frame_unseen: bool = False,
                    selective: Iterable[int] = (), fsdp_timed: Iterable[int] = (), unseen: Iterable[int] = (),
                    unseen_from: int = 0, read_outside: Optional[frozenset] = None) -> tuple[RunConfig, str]:
    """(the snapshot, the consistency check). ``device``: the run's (fsdp_doctor.record.run_device);
    ``runtime_checkpointed``: units seen re-running their forward in backward (functional
    ``torch.utils.checkpoint(unit, ...)``); ``runtime_checkpointed_children``: units whose submodules re-ran
    (``checkpoint(self.mlp, h)`` inside the unit's forward); ``consistency``: the first snapshot's check ("" when
    it passed; None: not run yet, run and logged now); ``selective``: units seen checkpointing selectively
    (StepTimer.selective); ``timed_compiled``: units compiled in place that the timer
    times around their compiled call (StepTimer.timed_compiled); ``frame_unseen``: the forward ran in a compiled
    frame the doctor was not given (FRAME_UNSEEN), first seen in step ``unseen_from``; ``fsdp_timed``: units inside
    another module's compiled frame that the timer times from FSDP2's own logs (StepTimer.fsdp_timed); ``unseen``: units
    inside a compiled frame the doctor was not given that it times from them (StepTimer.frame_unseen; none: every unit
    untimed there); ``read_outside``: the ids of the submodules the first step read outside their
    forward, or never ran (StepTimer.read_outside)."""
    dev = device
    backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else "none"
    dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    capacity = capacity_bytes
    if capacity is None and dev.type == "cuda":  # the device, or what a memory fraction leaves this process of it
        capacity = allocator_limit(dev) or torch.cuda.get_device_properties(dev).total_memory
    peak = peak_tflops
    if peak is None and dev.type == "cuda":
        peak = device_peak_tflops(dev_name, _compute_dtype(units))
    sched = profile_schedule
    unit_cfgs = snapshot_units(units, read_outside)
    for idx in runtime_checkpointed:
        if unit_cfgs[idx].checkpoint == "none":
            unit_cfgs[idx].checkpoint = "unit"
    for idx in runtime_checkpointed_children:
        if unit_cfgs[idx].checkpoint == "none":
            unit_cfgs[idx].checkpoint = "children"
    for idx in selective:
        unit_cfgs[idx].checkpoint_selective = unit_cfgs[idx].checkpoint != "none"
    compiled, timed_compiled, unseen = _compiled_in_place(model, units), set(timed_compiled), set(unseen)
    if frame_unseen:
        compiled, timed_compiled = list(range(len(units))), set()
    compiled = sorted(set(compiled) | unseen)
    for idx in compiled:  # (the first step's probes see no recompute in a compiled frame: a layer's own flag says it)
        if unit_cfgs[idx].checkpoint == "none" and unit_cfgs[idx].checkpoint_flag:
            # transformers' layers checkpoint themselves with gradient_checkpointing on, which Dynamo keeps (its
            # checkpoint operator recomputes them): a Trainer with torch_compile=True and gradient_checkpointing
            # read AC "none" on every layer (a new-user trial)
            unit_cfgs[idx].checkpoint = "unit"
    timed = [i for i in compiled if i in timed_compiled]
    in_place = [i for i in compiled if i not in timed_compiled]
    logged = (set() if frame_unseen else set(fsdp_timed)) | unseen
    for idx in in_place:
        unit_cfgs[idx].compiled_in_place = True
        unit_cfgs[idx].fsdp_hooks_timed = idx in logged
    for idx in timed:
        unit_cfgs[idx].compiled_call_timed = True
    named = naming_root(model)  # (the model inside a compiled wrapper: the names of the user's fully_shard calls)
    compiled_mods = compiled_modules(model)  # (torch.compile's frames: where Dynamo's recompile limit applies)
    _, ign_names, ign_bytes = unmanaged_summary(named, units)
    if consistency is None:
        consistency = consistency_problem(model, units, unit_cfgs) or ""
        if consistency:
            log.warning("fsdp_doctor: %s", consistency)
    unavailable = F2.problems() + ([consistency] if consistency else [])

    def names(ids: list[int]) -> str:  # (a grouped unit in brackets: "tok_emb, pos_emb, layers.0" read as 3 units)
        return fmt_list([unit_cfgs[i].name for i in ids], 4)

    # (the forward in a compiled frame the doctor was not given: what it could not time, first, as a note in the
    # report's header; it was a problem, the report's last line, and exit 3, which says files or lines were skipped)
    notes: list[str] = [unseen_note(bool(unseen), unseen_from)] if frame_unseen else []
    if timed:
        notes.append(
            f"{len(timed)} unit(s) compiled by torch.compile ({names(timed)}): timed around their compiled call, so "
            "their forward's all-gather wait is inside their forward time, not apart")
    # (inside a frame the doctor was given its hooks stay out; inside one it was not, they are there and do nothing)
    kinds = {"the doctor's hooks stay out of it": [i for i in in_place if i in logged and i not in unseen],
             "the doctor was not given it, its hooks do nothing there": [i for i in in_place if i in unseen]}
    for where, hooked in kinds.items():
        if hooked:
            notes.append(
                f"{len(hooked)} unit(s) run inside a compiled frame ({names(hooked)}): {where}; these units are timed "
                "from FSDP2's own hooks, which run outside compiled code (the units table says which times that "
                "leaves unknown)")
    unhooked = [i for i in in_place if i not in logged]
    if unhooked and not (frame_unseen and not unseen):  # (FRAME_UNSEEN_UNTIMED says so of every unit)
        # (the root of a model whose parameters are all in its blocks: no param group, so no hook of FSDP2's logs)
        bare = frame_unseen and not any(units[i].param_groups for i in unhooked)
        notes.append(
            f"{len(unhooked)} unit(s) run inside a compiled frame ({names(unhooked)}): the doctor's hooks do nothing "
            "there, so these units' timings are not recorded" + (
                " (no parameters of their own: FSDP2 logs no forward of theirs to time it from)" if bare else ""))
    return RunConfig(
        rank=rank, world_size=world_size, backend=str(backend), device=str(dev), device_name=dev_name,
        torch_version=str(torch.__version__),
        optimizer=optimizer_name(optimizer),
        **optimizer_params(optimizer, model, units),
        optimizer_groups=optimizer_groups(optimizer), attn_implementation=attn_implementation(model),
        attn_implementations=attn_implementations(model), no_split_modules=no_split_modules(model),
        checkpoint_layers=checkpoint_layers(model),
        kv_cache=kv_cache(model), vision_feature_layer=vision_feature_layer(model),
        units=unit_cfgs, **parallel_mesh(units), unmanaged_param_bytes=unmanaged_param_bytes(named, units),
        **_param_counts(model),
        capacity_bytes=capacity, alloc_conf=alloc_conf(dev), tokens_per_step=tokens_per_step, peak_tflops=peak,
        flops_per_step=flops_per_step, hardware_flops_per_step=hardware_flops_per_step,
        profile_schedule=sched.as_dict() if hasattr(sched, "as_dict") else None,
        unmanaged_trainable_names=ign_names or None, unmanaged_trainable_bytes=ign_bytes or None,
        untrained=untrained_params(named, optimizer, units), unavailable=unavailable,
        model_has_forward=not no_forward_of_its_own(model),
        measured_notes=notes,
        torch_lacks=F2.features_unavailable(),
        compiled_modules=compiled_mods, compile_limits=F2.dynamo_limits() if compiled_mods else {},
    ), consistency


def parallel_mesh(units: list[Unit]) -> dict:
    """RunConfig.mesh and fsdp_dims (or fsdp_mesh_parent and fsdp_mesh_dim): the mesh of the first dense parameter (of the param groups with the largest
    FSDP mesh: a mixture of experts' experts under expert parallelism have their own, smaller one; Experts.mesh)
    that has dims beyond FSDP's (FSDP's dims first, then the model-parallel ones: tensor parallelism's "tp"; a
    tensor-parallel model's embeddings can have none), or FSDP's own mesh where it is 2-D (HSDP: replicate,
    shard); else, where FSDP's 1-D mesh is cut from a larger mesh, that one; {} when none has (a 1-D FSDP mesh)."""
    groups = [(fps, fsdp) for u in units for pg in F2.param_groups(u.state) or []
              if (fsdp := F2.fsdp_mesh(pg)) is not None and (fps := F2.group_params(pg))]
    largest = max((fsdp.size() for _, fsdp in groups), default=0)
    for fps, fsdp in groups:
        if fsdp.size() != largest:
            continue
        for fp in fps:
            mesh = getattr(F2.sharded_param(fp), "device_mesh", None)
            if mesh is not None and (mesh.ndim > fsdp.ndim or fsdp.ndim > 1):
                return {"mesh": mesh_dims(mesh), "fsdp_dims": int(fsdp.ndim)}
    for _, fsdp in groups:  # a 1-D FSDP mesh cut from a larger one: the classic mesh2["shard"] for HSDP's mesh2
        root = F2.root_mesh(fsdp)
        if root is not None and root is not fsdp and root.ndim > 1 and fsdp.ndim == 1 and root.size() > fsdp.size():
            return {"fsdp_mesh_parent": mesh_dims(root), "fsdp_mesh_dim": (fsdp.mesh_dim_names or ("",))[0] or ""}
    return {}


def mesh_dims(mesh) -> dict[str, int]:
    """A device mesh's dims, name -> size in mesh order ("dim<i>" for a dim without a name): RunConfig.mesh,
    Experts.mesh."""
    names = mesh.mesh_dim_names or ()
    return {(names[i] if i < len(names) else None) or f"dim{i}": int(n) for i, n in enumerate(mesh.shape)}


def alloc_conf(dev: torch.device) -> dict[str, str]:
    """The CUDA caching allocator's settings from the environment: each of ``ALLOC_CONF_VARS`` that is set, with
    its value ({} off CUDA)."""
    if dev.type != "cuda":
        return {}
    return {v: os.environ[v] for v in ALLOC_CONF_VARS if os.environ.get(v)}


def _param_counts(model: nn.Module) -> dict:
    """The model's parameters (DTensor numel: global), in one walk; what the backward works on (the analytic FLOP
    estimate's): the trainable parameters (weight gradients), and the parameters from the first trainable one on in
    module order, those input gradients flow back through (a frozen prefix, such as the embeddings and frozen
    blocks below a trainable tail, gets none); and of each, a mixture of experts' routed experts (:func:`_experts`),
    of which a token runs top_k of num_experts."""
    expert_ids, top_k, num_experts = _experts(model)
    total = trainable = path = 0
    ex = [0, 0, 0]  # the experts': every one, trainable, from the first trainable parameter on
    meshes = {}  # the experts' and the others' parameter meshes (dim -> size), the first of each seen
    for p in model.parameters():
        n, on_path = p.numel(), bool(p.requires_grad or path)
        total += n
        path += n * on_path
        trainable += n * p.requires_grad
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None and (id(p) in expert_ids) not in meshes:
            meshes[id(p) in expert_ids] = mesh_dims(mesh)
        if id(p) in expert_ids:
            ex = [ex[0] + n, ex[1] + n * p.requires_grad, ex[2] + n * on_path]
    # expert parallelism: the experts on a mesh of their own (torchtitan's efsdp x ep)
    own = meshes.get(True) or {}
    experts = Experts(param_count=ex[0], trainable_param_count=ex[1], grad_path_param_count=ex[2], top_k=top_k,
                      num_experts=num_experts,
                      mesh=own if own and own != meshes.get(False) else {}) if expert_ids else None
    return {"model_param_count": total, "model_trainable_param_count": trainable,
            "model_grad_path_param_count": path, "experts": experts}


def _experts(model: nn.Module) -> tuple[set[int], int | None, int | None]:
    """The ids of the parameters under every child module named ``experts`` (a mixture of experts' routed experts;
    a layer's shared expert, router and attention are dense; torchtitan 0.3 names it ``routed_experts``), and the
    top_k and num_experts every such layer shares (None where a layer's cannot be read, or layers differ). Each is read where the public source keeps it:
    the MoE block (HF Mixtral's ``top_k``; HF v4's blocks also ``num_experts``), its router (``gate`` in HF
    Mixtral, Qwen2-MoE, OLMoE and DeepSeek; ``router`` in torchtitan's MoE and gpt-oss: ``top_k``,
    ``num_experts``), the experts (``num_experts``, or a ModuleList's length), then HF's ``model.config``
    (``num_experts_per_tok``; ``num_local_experts``, ``num_experts`` or ``n_routed_experts``)."""
    ids: set[int] = set()
    found = set()
    config = [getattr(model, "config", None)]
    for m in model.modules():
        children = dict(m.named_children())
        experts = children.get("experts")
        if experts is None:  # torchtitan 0.3's MoE: moe.routed_experts (its GroupedExperts inside), moe.router
            experts = children.get("routed_experts")
        params = [p for p in experts.parameters() if id(p) not in ids] if experts is not None else []
        if not params:
            continue
        ids.update(id(p) for p in params)
        where = [m, children.get("gate"), children.get("router"), experts]
        listed = len(experts) if isinstance(experts, (nn.ModuleList, nn.ModuleDict)) else None
        found.add((_first_int(where, "top_k") or _first_int(config, "num_experts_per_tok"),
                   _first_int(where, "num_experts") or listed
                   or _first_int(config, "num_local_experts", "num_experts", "n_routed_experts")))
    top_k, num_experts = found.pop() if len(found) == 1 else (None, None)
    return ids, top_k, num_experts


def _first_int(objs: list, *names: str) -> int | None:
    """The first positive int attribute ``names`` gives on ``objs`` (None where none has one)."""
    for o in objs:
        for name in names:
            v = getattr(o, name, None) if o is not None else None
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def _compute_dtype(units: list[Unit]) -> str:
    for u in units:
        dt = getattr(F2.mp_policy(u.state), "param_dtype", None)
        if dt is not None:
            return str(dt).replace("torch.", "")
    return "float32"


def another_models_optimizer(optimizer, model: nn.Module, units: list[Unit]) -> str:
    """What watch() says at entry where the optimizer holds none of the model's parameters and another FSDP2 model's
    (records.optimizer_of_another_model); "" otherwise (one optimizer over two models is said in the report only)."""
    counts = SimpleNamespace(optimizer=optimizer_name(optimizer), **optimizer_params(optimizer, model, units))
    return optimizer_of_another_model(counts) if not optimizer_model_params(counts) else ""


def optimizer_params(optimizer, model: nn.Module, units: list[Unit] = ()) -> dict[str, int]:
    """RunConfig's counts of the optimizer's parameter tensors: all of them, those that are not the model's (left
    from before fully_shard) and another FSDP2 model's (sharded, outside the model), with their local bytes."""
    out = dict(optimizer_params=0, optimizer_foreign_params=0, optimizer_foreign_bytes=0, optimizer_other_params=0,
               optimizer_other_bytes=0)
    if optimizer is None:
        return out
    model_ids = {id(p) for p in model.parameters()} | managed_param_ids(units)
    for g in optimizer.param_groups:
        for p in g["params"]:
            out["optimizer_params"] += 1
            if id(p) in model_ids:
                continue
            kind = "other" if F2.is_sharded(p) else "foreign"
            lt = getattr(p, "_local_tensor", p)
            out[f"optimizer_{kind}_params"] += 1
            out[f"optimizer_{kind}_bytes"] += lt.numel() * lt.element_size()
    return out


def untrained_rows(model: nn.Module, optimizer, held: set[int] | None = None,
                   units: list[Unit] = ()) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of each trainable parameter of the model that the optimizer does not hold ([]: none, or no
    optimizer); ``held``: the ids it holds, where the caller has them (``_held``); ``units``: the FSDP units, whose
    unsharded parameters, registered while a unit is unsharded, stand for their sharded ones (``sharded_of``)."""
    held = _held(optimizer) if held is None else held
    sharded = sharded_of(units)
    rows = [(n, sharded.get(id(p), p)) for n, p in model.named_parameters()]
    return [(n, p) for n, p in rows if p.requires_grad and id(p) not in held]


def _held(optimizer) -> set[int]:
    """The ids of the tensors the optimizer holds (none without one)."""
    return {id(p) for g in optimizer.param_groups for p in g["params"]} if optimizer is not None else set()


def untrained_params(model: nn.Module, optimizer, units: list[Unit]) -> Untrained | None:
    """The model's trainable parameters the optimizer does not hold, and what they hold now (RunConfig.untrained;
    ``changed`` is the doctor's later check); none (``tensors`` 0) where it holds them all; None without an
    optimizer."""
    if optimizer is None:
        return None
    held = _held(optimizer)
    rows = untrained_rows(model, optimizer, held, units)
    if not rows:
        return Untrained(tensors=0, param_count=0)
    grads = [getattr(p.grad, "_local_tensor", p.grad) for _, p in rows if p.grad is not None]
    out = Untrained(tensors=len(rows), param_count=sum(p.numel() for _, p in rows), with_grad=len(grads),
                    grad_bytes=sum(g.numel() * g.element_size() for g in grads), names=[n for n, _ in rows[:20]])
    sharded, holder = sharded_of(units), {}  # parameter id -> the first module holding it
    for fqn, m in model.named_modules():
        for p in m.parameters(recurse=False):
            holder.setdefault(id(sharded.get(id(p), p)), fqn)
    out.trained_modules = []
    for u in units:
        ps = [p for pg in u.param_groups for fp in F2.group_params(pg)
              if (p := F2.sharded_param(fp)) is not None and p.requires_grad]
        counts = [sum(p.numel() for p in ps if id(p) not in held), sum(p.numel() for p in ps if id(p) in held)]
        if counts[0]:
            out.units[u.name] = counts
        if counts[0] and counts[1]:  # which of its modules stay trainable once the rest is frozen
            out.trained_modules += list(dict.fromkeys(holder[id(p)] for p in ps if id(p) in held and id(p) in holder))
    return out


def optimizer_groups(optimizer) -> list[OptimizerGroup]:
    """The optimizer's parameter groups: their sizes and numeric hyper-parameters (a tensor learning rate read
    as its number; flags, None and other values left out), and the implementation switches it holds (foreach,
    fused). Per-parameter optimizers stepped in the backward (one
    group each, hundreds in a real model) are read as the groups their options make."""
    out: list[OptimizerGroup] = []
    for g in getattr(optimizer, "param_groups", None) or []:
        opts: dict = {}
        for k, v in g.items():
            if isinstance(v, torch.Tensor) and v.numel() == 1:
                v = v.item()
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                opts[k] = float(v)
            elif isinstance(v, (tuple, list)) and v and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                             for x in v):
                opts[k] = [float(x) for x in v]
        flags = {k: g[k] for k in ("foreach", "fused") if k in g and (g[k] is None or isinstance(g[k], bool))}
        same = next((o for o in out if o.options == opts and o.flags == flags), None) if getattr(
            optimizer, "in_backward", False) else None
        if same is not None:
            same.params += len(g["params"])
        else:
            out.append(OptimizerGroup(params=len(g["params"]), options=opts, flags=flags))
    return out


def attn_implementation(model: nn.Module) -> str | None:
    """A Hugging Face model's attention implementation (its config's ``_attn_implementation``: "eager", "sdpa",
    "flash_attention_2", ...) where the model can switch it with ``set_attn_implementation`` (what
    kernels.eager_attention's fix calls); None for any other model."""
    if not callable(getattr(model, "set_attn_implementation", None)):
        return None
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return impl if isinstance(impl, str) else None


#: the fused attention implementations a Hugging Face model can be switched to, each with the class flags that say
#: it supports it (transformers 5's names first, then 4.x's)
_ATTN_FLAGS = (("sdpa", ("_supports_sdpa",)), ("flex_attention", ("_supports_flex_attn",)),
               ("flash_attention_2", ("_supports_flash_attn", "_supports_flash_attn_2")))


def attn_implementations(model: nn.Module) -> list[str] | None:
    """Of ``_ATTN_FLAGS``' implementations, those the Hugging Face ``model`` says it supports (what
    kernels.eager_attention's fix may switch it to); None for any other model, or where it has none of the flags."""
    if attn_implementation(model) is None:
        return None
    out, seen = [], False
    for name, flags in _ATTN_FLAGS:
        for flag in flags:
            try:
                v = getattr(model, flag, None)
            except Exception:  # noqa: BLE001 - a property of the user's model
                v = None
            seen = seen or isinstance(v, bool)
            if v is True:
                out.append(name)
                break
    return out if seen else None


def no_split_modules(model: nn.Module) -> list[str] | None:
    """A Hugging Face model's ``_no_split_modules`` (its blocks' class names, which accelerate's transformer-based
    wrap policy shards by default); None where it has none."""
    names = getattr(model, "_no_split_modules", None)
    if not isinstance(names, (list, tuple, set)) or not names or not all(isinstance(n, str) for n in names):
        return None
    return sorted(names) if isinstance(names, set) else list(names)


def checkpoint_layers(model: nn.Module) -> list[str]:
    """The fqns of transformers' layers checkpointing their own forward (``units.checkpointing_layer``), in module
    order (RunConfig.checkpoint_layers)."""
    return [n for n, m in model.named_modules() if checkpointing_layer(m)]


def kv_cache(model: nn.Module) -> bool:
    """Whether a Hugging Face config under ``model`` has ``use_cache`` on (what snippets.no_kv_cache turns off)."""
    return any(getattr(getattr(m, "config", None), "use_cache", False) is True for m in model.modules())


def vision_feature_layer(model: nn.Module) -> int | None:
    """The watched model's Hugging Face config's ``vision_feature_layer`` where it is one layer (an int) of the vision
    tower its ``vision_config`` counts the layers of (what optim.never_updated's fix changes)."""
    cfg = getattr(model, "config", None)
    v = getattr(cfg, "vision_feature_layer", None)
    layers = getattr(getattr(cfg, "vision_config", None), "num_hidden_layers", None)
    return v if isinstance(v, int) and not isinstance(v, bool) and isinstance(layers, int) else None


def _compiled_in_place(model: nn.Module, units: list[Unit]) -> list[int]:
    """Units whose modules' hooks run inside a compiled frame (``m.compile()`` on them or on an ancestor; the
    module of ``torch.compile(m)``'s wrapper, or below it)."""
    _, inside = compiled_frames(model)
    return [i for i, u in enumerate(units) if any(id(m) in inside for m in u.modules)]
