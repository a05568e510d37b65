"""The one place fsdp_doctor touches torch's private FSDP2 internals.

Everything below ``FSDPModule``'s public methods is private API and moves between releases. Every read of
it is here, next to a note of what differs between the releases we test (2.6.0, 2.9.1, 2.13.0 pinned,
2.15.0; read from each release's ``torch/distributed/fsdp/_fully_shard/`` and probed on CPU/gloo).
Nothing else in the package reads an ``_fsdp*`` attribute (``tests/test_fsdp2_adapter.py`` greps).

When something the doctor needs cannot be read (a name is missing or has another shape), the accessor
returns ``None`` and :func:`problem` says so once, in one line naming the torch version and what it
could not read; the figure that depends on it is left out (``None`` -> "unknown"), never a silent zero.

Versioned names (first release we saw each form in; lookups go by presence, not by version number, so a
release between two tested ones works whichever form it has):

=============================== ============================================ ==============================
what                            2.6 - 2.9                                    2.13 - 2.15
=============================== ============================================ ==============================
param groups of a state         ``FSDPState._fsdp_param_group`` (one/None)   ``_fsdp_param_groups`` (list;
                                                                             the singular is a property
                                                                             that raises for several)
reduce-scatter buffers kept     ``FSDPCommContext.reduce_scatter_state``     ``reduce_scatter_states``
                                (one ``ReduceScatterState`` or None)         (list, capped by
                                                                             ``reduce_scatter_max_input_
                                                                             buffers``)
all-gather state kept           ``comm_ctx.all_gather_state`` (instance)     same (2.15: class default
                                                                             None until first set)
unsharded accumulated grad      ``FSDPParam.unsharded_accumulated_grad``     same (2.15: a property)
                                (attribute)
CPU streams                     2.6: ``torch.cpu.Stream`` has no             no-op methods present
                                ``record_event``/``wait_event``: FSDP2
                                cannot run on CPU (see
                                :func:`enable_cpu_fsdp`); 2.9: present
hook logs                       2.6: ``logger.debug`` only when compiled     always
                                autograd is off (it is, in eager)
labels                          ``FSDP::post_backward_rs_wait`` absent       present; 2.15 drops
                                                                             ``FSDP::post_backward_
                                                                             accumulate``
saved-tensor hooks reader       2.6: no ``torch._C._autograd._top_saved_     present
                                tensors_default_hooks`` (a probe op tells
                                whether hooks are active: see
                                :func:`saved_hooks_top`); 2.9: present
selective checkpoint cache      ``storage[op]``: a list, popped in backward  2.15: ``storage[key][idx]``
(``torch.utils.checkpoint``)    (:func:`sac_cached_tensors`); no hook mark   (a dict); hooks marked
                                                                             ``_checkpoint_internal`` are
                                                                             not the user's
                                                                             (:func:`not_the_users_hooks`)
all-gather copy-out             2.6: bumps the all-gather outputs' version   2.9+: preserves them
                                counters (see :func:`enable_cpu_fsdp`)
``fully_shard(reshard_after_    2.6 refuses ``None`` (its default is True;   ``None`` (auto) is the
forward=None)``                 the root is set to False at lazy init)       default
=============================== ============================================ ==============================

Unchanged across 2.6 - 2.15 (still read defensively): ``FSDPState._modules``, ``_is_root``,
``_mp_policy``, ``_states_to_forward_prefetch`` / ``_states_to_backward_prefetch``, ``_training_state``;
``FSDPParamGroup.fsdp_params``, ``mesh_info``, ``post_forward_mesh_info``, ``_module_fqn``,
``offload_policy``, ``unshard_async_op``, ``unshard_in_backward``, ``reduce_grads``, ``device``, ``comm_ctx``,
``_all_gather_result`` (an ``AllGatherResult``'s ``all_gather_work``), ``_sharded_state``, ``_is_hsdp``,
``_all_reduce_state``, ``_partial_reduce_output``, ``_post_forward_indices``, ``comm_ctx.post_forward_order``
(FSDP2's default backward prefetch: the group before; 2.13+ alike for a state of one group); ``FSDPParam._orig_size``,
``sharded_param``, ``_sharded_param_data``, ``_unsharded_param``, ``all_gather_outputs``, ``_unsharded_inner_tensors``,
``_sharded_post_forward_param_data``, ``orig_dtype``, ``param_dtype``; ``ShardedState`` in
``_fsdp_param``; ``FSDPModule._set_unshard_async_op``; the logger ``torch.distributed.fsdp.fully_shard``;
torch.distributed.checkpoint's logger and the messages of its ``save`` and ``async_save`` (:data:`DCP_LOGGER_NAME`).

Dynamo's (torch.compile's) state read here too, every tested release alike unless said: the warning its
``convert_frame`` logger logs once per code object that hits a recompile limit ("torch._dynamo hit config.%s (%s)",
its arguments the limit's config name, its value, "'name' (file:line)" of the code, the last guard that failed:
:func:`recompile_limit_hit`); the limits' names in ``torch._dynamo.config`` (2.6: ``cache_size_limit`` and
``accumulated_cache_size_limit``; 2.13 - 2.15: ``recompile_limit`` and ``accumulated_recompile_limit``, the old
names aliases: :func:`dynamo_limits`); ``torch._dynamo.utils.counters``: ``["frames"]["ok"]``, the frames it
compiled (a frame it gave up at the limit is not counted; 2.13's ``_compile.compile_inner`` timer counts it), and
``["unimplemented"]``, one key per limit hit (2.6: "cache_size_limit reached"; 2.13 - 2.15: a paragraph naming
"Limit type: recompile_limit"): :func:`dynamo_limit_hits`.
"""

from __future__ import annotations

import logging
import math
import re
import sys
from typing import Iterable

import torch
import torch.nn as nn

from ..records import SET_RESHARD_AFTER_FORWARD

log = logging.getLogger("fsdp_doctor")

#: The oldest torch whose FSDP2 (``torch.distributed.fsdp.fully_shard``) the doctor reads.
MIN_TORCH = (2, 6)
#: Releases the test matrix runs (``make test`` on the pinned one, ``make test-compat`` on the ends).
TESTED_TORCH = ("2.6.0", "2.9.1", "2.13.0", "2.15.0")
#: The logger FSDP2 writes its per-unit hook logs to (``FSDP::pre_backward (fqn)``), every tested release.
LOGGER_NAME = "torch.distributed.fsdp.fully_shard"
#: The logger torch.distributed.checkpoint logs each call of ``save`` and ``async_save`` to (start and end, a dict
#: message: ``torch.distributed.checkpoint.logger._dcp_method_logger``), every tested release: ``c10d_logger``'s
#: ``"c10d-" + handler class + "-" + destination``, its handler a NullHandler. By name, so that watching does not
#: import torch.distributed.checkpoint (:func:`dcp_logger`).
DCP_LOGGER_NAME = "c10d-NullHandler-dcp_logger"

_MISSING = object()


def torch_version(v: str | None = None) -> tuple[int, int, int]:
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", v or torch.__version__)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)) if m else (0, 0, 0)


TORCH = torch_version()
TORCH_STR = torch.__version__.split("+")[0]

try:  # public since 2.6
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - torch < 2.6: unsupported_reason() says so
    FSDPModule = None  # type: ignore[assignment,misc]


def unsupported_reason() -> str | None:
    """One sentence when this torch is too old (or has no FSDP2) for the doctor; None when supported."""
    if TORCH[:2] < MIN_TORCH or FSDPModule is None:
        return (f"torch {TORCH_STR} is not supported: fsdp_doctor reads FSDP2 (fully_shard) internals of "
                f"torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]}")
    return None


# ------------------------------------------------------------------------------------------- problems
_problems: dict[str, str] = {}


def dcp_logger() -> logging.Logger:
    """torch.distributed.checkpoint's logger (:data:`DCP_LOGGER_NAME`): its own object where the user's code has
    imported it, else the logger of that name, which the import then configures and logs to."""
    mod = sys.modules.get("torch.distributed.checkpoint.logger")
    lg = getattr(mod, "_dcp_logger", None) if mod is not None else None
    return lg if isinstance(lg, logging.Logger) else logging.getLogger(DCP_LOGGER_NAME)


#: The logger Dynamo warns on when a frame hits a recompile limit (``torch._dynamo.convert_frame``'s own), every
#: tested release; and the start of that warning's format string (its arguments: :func:`recompile_limit_hit`).
DYNAMO_LOGGER_NAME = "torch._dynamo.convert_frame"
RECOMPILE_LIMIT_WARNING = "torch._dynamo hit config."
#: Dynamo's two limits on a code object's compiled variants: the specific one (per set of guarded module
#: instances: every variant where modules are inlined, as since 2.4) and the accumulated one (every variant), by
#: name, newest first
DYNAMO_LIMITS = (("recompile_limit", "accumulated_recompile_limit"),
                 ("cache_size_limit", "accumulated_cache_size_limit"))
_FUNC_INFO = re.compile(r"'(?P<name>[^']*)' \((?P<file>.*):(?P<line>\d+)\)$")
_LIMIT_NAME = re.compile(r"\b((?:accumulated_)?(?:recompile|cache_size)_limit)\b")
_LIMIT_TYPE = re.compile(r"Limit type: (\w+)")


def dynamo_logger() -> logging.Logger:
    """Dynamo's ``convert_frame`` logger (:data:`DYNAMO_LOGGER_NAME`): the same object Dynamo logs to, imported
    or not (a name is all a logger is until then)."""
    return logging.getLogger(DYNAMO_LOGGER_NAME)


def recompile_limit_hit(record: logging.LogRecord) -> dict | None:
    """The fields of a ``RecompileLimit`` from Dynamo's warning that a frame hit a recompile limit, else None: its
    arguments are (the limit's config name, its value, "'name' (file:line)" of the code object, the last reason,
    a URL), in 2.6 - 2.15 alike. The reason is its first line (2.13 appends the user's stack to it)."""
    msg, args = record.msg, record.args
    if not isinstance(msg, str) or not msg.startswith(RECOMPILE_LIMIT_WARNING) or not isinstance(args, tuple) \
            or len(args) < 4:
        return None
    out = {"limit_type": str(args[0]), "limit": args[1] if isinstance(args[1], int) else None,
           "reason": str(args[3]).strip().splitlines()[0][:300] if args[3] else ""}
    m = _FUNC_INFO.match(str(args[2]))
    if m is not None:
        out.update(function=m.group("name"), file=m.group("file"), line=int(m.group("line")))
    return out


def dynamo_limits() -> dict[str, int]:
    """Dynamo's recompile limits as set now, this torch's names -> value ({} where Dynamo was never imported: then
    nothing compiled)."""
    config = sys.modules.get("torch._dynamo.config")
    if config is None:
        return {}
    for names in DYNAMO_LIMITS:
        values = {n: getattr(config, n, None) for n in names}
        if all(isinstance(v, int) for v in values.values()):
            return values
    return {}


def dynamo_counters() -> dict:
    """Dynamo's ``torch._dynamo.utils.counters`` (category -> key -> count; {} where Dynamo was never imported),
    read without adding a key: it is a defaultdict."""
    utils = sys.modules.get("torch._dynamo.utils")
    c = getattr(utils, "counters", None)
    return c if isinstance(c, dict) else {}


def dynamo_frames_compiled() -> int:
    """Frames Dynamo has compiled in this process (its ``counters["frames"]["ok"]``; 0 where never imported). Read
    without adding a key: ``counters`` is a defaultdict."""
    frames = dynamo_counters().get("frames")
    return int(frames.get("ok", 0)) if isinstance(frames, dict) else 0


def dynamo_limit_hits() -> dict[str, int]:
    """The recompile limits hit in this process so far, by config name -> times (Dynamo's ``counters
    ["unimplemented"]``, whose key names the limit): what its warning says where this process's logging keeps
    Dynamo's warnings quiet."""
    out: dict[str, int] = {}
    unimpl = dynamo_counters().get("unimplemented")
    for key, n in (unimpl.items() if isinstance(unimpl, dict) else ()):
        key = str(key)
        m = None if "limit reached" not in key and "recompile limit" not in key else \
            _LIMIT_TYPE.search(key) or _LIMIT_NAME.search(key)
        if m is not None and isinstance(n, int) and n > 0:
            out[m.group(1)] = out.get(m.group(1), 0) + n
    return out


def problem(what: str, consequence: str) -> None:
    """Say once per process that ``what`` could not be read on this torch, and what is left out."""
    if what in _problems:
        return
    line = f"torch {TORCH_STR}: cannot read {what}; {consequence}"
    _problems[what] = line
    log.warning("fsdp_doctor: %s", line)


def problems() -> list[str]:
    """Every :func:`problem` line of this process, in order (written to ``RunConfig.notes``)."""
    return list(_problems.values())


def _read(obj, name: str, owner: str, consequence: str, default=None):
    v = getattr(obj, name, _MISSING)
    if v is _MISSING:
        problem(f"{owner}.{name}", consequence)
        return default
    return v


# ------------------------------------------------------------------------------------------- states
def is_fsdp_module(m: nn.Module) -> bool:
    return FSDPModule is not None and isinstance(m, FSDPModule)


def other_fsdp_units(model: nn.Module) -> int | None:
    """How many FSDP2 units are alive in this process outside ``model`` (a frozen teacher, a GAN's other network),
    from torch's registry of composable states (``torch.distributed._composable_state._module_state_mapping``,
    private): units, not modules, one state each (``fully_shard([norm, output])`` registers both modules under one);
    None where that registry cannot be read. Where some are found, the cyclic garbage is collected once and they are
    read again: a model of an earlier run in the process, its process group destroyed, lingers in reference cycles
    (FSDP's hooks) until the collector frees it (the caller reads it once, at watch()'s exit, outside every step)."""
    try:
        from torch.distributed import _composable_state as cs
    except Exception:  # noqa: BLE001 - a release without it: not known
        return None
    mine = {id(m) for m in model.modules()}

    def read() -> int:
        states = set()
        for m, ref in list(cs._module_state_mapping.items()):
            if is_fsdp_module(m) and id(m) not in mine:
                state = ref() if callable(ref) else ref  # (a weak reference to the state; older releases: the state)
                states.add(id(state) if state is not None else id(m))
        return len(states)

    try:
        if read():
            import gc

            gc.collect()
        return read()
    except Exception:  # noqa: BLE001
        return None


def registered_forward_methods(module: nn.Module) -> list[str]:
    """The names of ``module``'s methods that ``register_fsdp_forward_method`` made forward methods (its instance
    attributes that wrap FSDP2's pre- and post-forward around the method: ``wrapped_method`` in ``_fully_shard.py``),
    [] for none."""
    out = []
    for name, v in vars(module).items():
        v = getattr(v, "__wrapped__", v) if callable(v) and not hasattr(v, "__func__") else v  # (the doctor's timing)
        code = getattr(getattr(v, "__func__", None), "__code__", None)
        if code is not None and code.co_name == "wrapped_method" and code.co_filename.endswith("_fully_shard.py"):
            out.append(name)
    return out


def calling_param_group(depth: int):
    """The FSDPParamGroup whose method is ``depth`` frames above the caller (the one that called FSDP2's logger:
    ``logger.debug("%s", self._with_fqn("FSDP::pre_backward"))``), None where that frame is no param group's. Its
    label names the unit by its name in its own model alone: two models with a ``blocks.0`` each (a GAN, a teacher
    and its student) log the same string. About 0.3 µs."""
    try:
        f = sys._getframe(depth + 1)
    except ValueError:
        return None
    # (a second doctor's tap chained in front of this one, a nested watch(), sits between: a few frames up at most)
    for _ in range(4):
        if f is None:
            return None
        obj = f.f_locals.get("self")
        if type(obj).__name__ == "FSDPParamGroup":
            return obj
        if f.f_code.co_name != "debug":  # (only the logger taps' own frames are looked through)
            return None
        f = f.f_back
    return None


def state_of(module: nn.Module):
    """The module's ``FSDPState`` (grouped units share one)."""
    get = getattr(module, "_get_fsdp_state", None)
    if get is not None:
        return get()
    from torch.distributed.fsdp import fully_shard

    return fully_shard.state(module)


def state_modules(state) -> list[nn.Module] | None:
    mods = _read(state, "_modules", "FSDPState", "unit members taken from the module found")
    return list(mods) if mods is not None else None


def param_groups(state) -> list | None:
    """The state's ``FSDPParamGroup`` list; None when unreadable. 2.13+: ``_fsdp_param_groups`` (list);
    2.6-2.9: ``_fsdp_param_group`` (one group, or None for a unit without parameters)."""
    pgs = getattr(state, "_fsdp_param_groups", _MISSING)
    if pgs is not _MISSING:
        return list(pgs or [])
    try:
        pg = getattr(state, "_fsdp_param_group", _MISSING)
    except Exception:  # noqa: BLE001 - 2.13+'s compatibility property raises for several groups
        pg = _MISSING
    if pg is not _MISSING:
        return [pg] if pg is not None else []
    problem("FSDPState._fsdp_param_groups (or 2.6-2.9's _fsdp_param_group)",
            "unit sizes, dtypes and settings unknown")
    return None


def is_root(state) -> bool | None:
    return _read(state, "_is_root", "FSDPState", "root unit unknown")


def mp_policy(state):
    return _read(state, "_mp_policy", "FSDPState", "mixed-precision dtypes unknown")


def prefetch_targets(state, direction: str) -> list | None:
    """The states explicitly prefetched after this one (``set_modules_to_{forward,backward}_prefetch``)."""
    v = _read(state, f"_states_to_{direction}_prefetch", "FSDPState", f"explicit {direction} prefetch unknown")
    return list(v) if v is not None else None


def backward_gathers(state, sharded: "ShardedStates") -> tuple[list, list] | None:
    """At a unit's ``FSDP::pre_backward`` log (the start of FSDP2's ``FSDPParamGroup.pre_backward``: ``unshard();
    wait_for_unshard(); _backward_prefetch()``, then ``FSDPState._pre_backward``'s explicit prefetches), the param
    groups whose all-gathers the host waits for from there to the unit's first gradient: ``(own, prefetched)``.
    ``own``: the unit's group where its all-gather is issued there, or was prefetched asynchronously and is waited
    for there (prefetched synchronously, gathered since forward, or ``unshard_in_backward`` False: nothing of its
    own). ``prefetched``: the groups its backward prefetch all-gathers there synchronously (``unshard_async_op``
    False: on gloo the host blocks for the whole collective; an asynchronous one is only issued there): the states
    of ``_states_to_backward_prefetch`` (each one's groups), else FSDP2's default, the group before it in
    ``comm_ctx.post_forward_order`` (at ``_post_forward_indices[-1] - 1``; popped after the log), in 2.6 - 2.15
    alike. None where not modelled: a unit of several param groups (2.13+'s per-group prefetch), a field not
    readable. Attribute reads only (called in the hook)."""
    groups = param_groups(state)
    explicit = getattr(state, "_states_to_backward_prefetch", None)
    if not groups or len(groups) != 1 or explicit is None:
        return None
    (pg,) = groups
    agr = getattr(pg, "_all_gather_result", _MISSING)
    if agr is _MISSING:
        return None
    own = [pg] if _gathers_now(pg, sharded) or getattr(agr, "all_gather_work", None) is not None else []
    if explicit:
        targets = [t for s in explicit for t in reversed(param_groups(s) or [])]
    else:
        idx = getattr(pg, "_post_forward_indices", None)
        order = getattr(getattr(pg, "comm_ctx", None), "post_forward_order", None)
        if idx is None or order is None:
            return None
        targets = [order[idx[-1] - 1]] if idx and 0 < idx[-1] <= len(order) else []
    return own, [t for t in targets if t is not pg and not getattr(t, "unshard_async_op", False)
                 and _gathers_now(t, sharded)]


def _gathers_now(pg, sharded: "ShardedStates") -> bool:
    """Whether ``FSDPParamGroup.unshard`` called now in backward all-gathers the group: no all-gather pending, not
    gathered, ``unshard_in_backward``, more than one rank to gather from."""
    return (getattr(pg, "_all_gather_result", None) is None and sharded.of(pg) != "unsharded"
            and bool(getattr(pg, "unshard_in_backward", True)) and shard_mesh_size(pg) != 1)


def training_state(state) -> str | None:
    """``IDLE`` / ``FORWARD`` / ``PRE_BACKWARD`` / ``POST_BACKWARD`` (the ``TrainingState`` member name)."""
    v = _read(state, "_training_state", "FSDPState", "training state unknown")
    return getattr(v, "name", None) if v is not None else None


# ------------------------------------------------------------------------------------------- param groups
def group_params(pg) -> list:
    return list(getattr(pg, "fsdp_params", None) or [])


def group_fqn(pg) -> str | None:
    """The name FSDP puts in its labels and logs (set at lazy init; ", "-joined for a grouped unit)."""
    return getattr(pg, "_module_fqn", None)


def reshard_after_forward(pg) -> bool | int | None:
    """``post_forward_mesh_info``: None -> False; the group's ``mesh_info`` -> True; another mesh -> its
    shard size (reshard to a smaller world). None when unreadable."""
    pfmi = _read(pg, "post_forward_mesh_info", "FSDPParamGroup", "reshard_after_forward unknown", _MISSING)
    if pfmi is _MISSING:
        return None
    if pfmi is None:
        return False
    if pfmi is getattr(pg, "mesh_info", None):
        return True
    return int(getattr(pfmi, "shard_mesh_size", 0) or 0) or True


def offload_policy(pg):
    return _read(pg, "offload_policy", "FSDPParamGroup", "CPU offload unknown")


def unshard_async_op(pg) -> bool | None:
    v = _read(pg, "unshard_async_op", "FSDPParamGroup", "async unshard unknown")
    return None if v is None else bool(v)


def unshard_in_backward(pg) -> bool | None:
    """False where ``FSDPModule.set_unshard_in_backward(False)`` was called: FSDP2 never all-gathers the group in
    backward (its parameters needed in forward only, an embedding's); None when unreadable."""
    v = _read(pg, "unshard_in_backward", "FSDPParamGroup", "backward all-gather setting unknown")
    return None if v is None else bool(v)


def reduce_grads(pg) -> bool:
    return bool(getattr(pg, "reduce_grads", True))


def compute_device(pg) -> torch.device | None:
    dev = getattr(pg, "device", None)
    return dev if isinstance(dev, torch.device) else None


def fsdp_mesh(pg):
    """The mesh FSDP shards and replicates over (``mesh_info.mesh``: 1-D, or 2-D for HSDP); a parameter's own
    mesh can be larger (with tensor parallelism: this mesh's dims, then the model-parallel ones). None when
    unreadable."""
    return getattr(getattr(pg, "mesh_info", None), "mesh", None)


def root_mesh(mesh):
    """The device mesh ``mesh`` was cut from (``mesh2["shard"]``'s 2-D ``mesh2``), else ``mesh`` itself; None when
    unreadable. 2.13: ``DeviceMesh._get_root_mesh``; before: ``_mesh_resources.get_root_mesh``."""
    try:
        get = getattr(mesh, "_get_root_mesh", None)
        if get is None:
            from torch.distributed.device_mesh import _mesh_resources

            get = lambda: _mesh_resources.get_root_mesh(mesh)  # noqa: E731
        return get()
    except Exception:  # noqa: BLE001
        return None


def shard_mesh_size(pg) -> int | None:
    """Ranks FSDP shards each parameter over (``mesh_info.shard_mesh_size``); None when unreadable."""
    n = getattr(getattr(pg, "mesh_info", None), "shard_mesh_size", None)
    return int(n) if isinstance(n, int) else None


def is_hsdp(pg) -> bool:
    try:
        return bool(getattr(pg, "_is_hsdp", False)) or getattr(pg, "_partial_reduce_output", None) is not None
    except Exception:  # noqa: BLE001
        return False


class ShardedStates:
    """``ShardedState.UNSHARDED`` / ``SHARDED_POST_FORWARD`` (``_fsdp_param``) and the reader of a group's
    ``_sharded_state``; ``ok`` False when either is missing (then ``is_unsharded`` is used)."""

    def __init__(self):
        self.unsharded = self.post_forward = None
        try:
            from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

            self.unsharded = ShardedState.UNSHARDED
            self.post_forward = ShardedState.SHARDED_POST_FORWARD
        except Exception:  # noqa: BLE001
            pass
        self.ok = self.unsharded is not None

    def of(self, pg) -> str:
        """"unsharded" | "post_forward" | "sharded"."""
        if self.ok:
            s = getattr(pg, "_sharded_state", None)
            if s is not None:
                return "unsharded" if s is self.unsharded else "post_forward" if s is self.post_forward else "sharded"
        return "unsharded" if getattr(pg, "is_unsharded", False) else "sharded"


# ------------------------------------------------------------------------------------------- FSDPParam
def sharded_param(fp):
    return getattr(fp, "sharded_param", None)


def is_sharded(p) -> bool:
    """A DTensor parameter (its local shard in ``_local_tensor``): held by an optimizer and not the watched model's, it
    is another FSDP model's (one optimizer over a GAN's two networks), not a tensor left from before fully_shard."""
    return hasattr(p, "_local_tensor")


def global_numel(fp) -> int | None:
    """Elements of the model's parameter: the DTensor's global shape (with tensor parallelism larger than what FSDP
    gathers), else what FSDP gathers."""
    sp = sharded_param(fp)
    return sp.numel() if sp is not None else param_numel(fp)  # (a DTensor's numel is the global one)


def param_numel(fp) -> int | None:
    """Elements of the parameter as FSDP all-gathers it (``_orig_size``: with tensor parallelism this rank's
    tensor-parallel shard; the DTensor's global shape otherwise)."""
    size = getattr(fp, "_orig_size", None)
    if size is not None:
        return math.prod(size)
    sp = sharded_param(fp)
    if sp is not None:
        return sp.numel()  # a DTensor's numel is the global one
    problem("FSDPParam._orig_size", "parameter counts unknown")
    return None


def sharded_data(fp) -> torch.Tensor | None:
    """This rank's padded local shard (``_sharded_param_data``), else the DTensor's local tensor."""
    data = getattr(fp, "_sharded_param_data", None)
    if data is None:
        data = getattr(sharded_param(fp), "_local_tensor", None)
    if data is None:
        problem("FSDPParam._sharded_param_data", "sharded bytes unknown")
    return data


def orig_dtype(fp) -> torch.dtype | None:
    sp = sharded_param(fp)
    return getattr(fp, "orig_dtype", None) or (sp.dtype if sp is not None else None)


def param_dtype(fp) -> torch.dtype | None:
    """The all-gather dtype (None in the policy means no cast: the original dtype)."""
    return getattr(fp, "param_dtype", None) or orig_dtype(fp)


def shard_dim(fp) -> int | None:
    """The dim FSDP shards the parameter on (``shard_placement_fn``'s ``Shard(dim)``; 0 by default), None unknown."""
    pl = getattr(fp, "fsdp_placement", None)
    if pl is None:
        return 0 if hasattr(fp, "fsdp_placement") else None
    return getattr(pl, "dim", None)


def unsharded_param(fp):
    return getattr(fp, "_unsharded_param", None)


def unsharded_tensors(fp) -> list:
    """The storages of the gathered parameter: all-gather outputs and inner tensors (tensor subclasses),
    else the unsharded parameter itself."""
    ts = list(getattr(fp, "all_gather_outputs", ()) or ()) + list(getattr(fp, "_unsharded_inner_tensors", ()) or ())
    if not ts:
        up = unsharded_param(fp)
        if up is not None:
            ts = [up]
    return ts


def post_forward_data(fp):
    """The smaller-world copy kept after forward (``reshard_after_forward=int``)."""
    return getattr(fp, "_sharded_post_forward_param_data", None)


def accumulated_grad(fp):
    """The unsharded gradient kept across micro-batches without sync (attribute in 2.6-2.13, property in
    2.15; None when absent)."""
    try:
        return getattr(fp, "unsharded_accumulated_grad", None)
    except Exception:  # noqa: BLE001 - a property on a param whose unsharded storage is freed
        return None


def holds_unreduced_grad(fp) -> bool:
    """Whether the parameter holds a gradient not reduce-scattered yet: on its unsharded parameter, or the one
    accumulated across micro-batches without sync (attribute reads only)."""
    up = unsharded_param(fp)
    return (up is not None and up.grad is not None) or accumulated_grad(fp) is not None


# ------------------------------------------------------------------------------------------- comm buffers
class CommReader:
    """FSDP's collective buffers in flight, read from the groups' shared ``comm_ctx`` and the groups'
    pending all-gather results. ``ok`` False (and :meth:`bytes` returns None) when this torch's comm state
    is not recognised."""

    def __init__(self, groups: Iterable, final: bool = True):
        """``final``: a step has ended, so every root that runs has run FSDP's lazy init. Before that (the first
        unit's forward), a root not reached yet still holds the comm context of its own that lazy init replaces
        (2.13+ sets its fields there): pending, not a torch this adapter does not know; where no context is
        ready at all, ``ok`` is False without saying so until ``final``."""
        self.groups = list(groups)
        ctxs = {}
        for pg in self.groups:
            c = getattr(pg, "comm_ctx", None)
            if c is not None:
                ctxs[id(c)] = c
        # a context is ready once lazy init set its fields; several FSDP roots (fully_shard never applied to the
        # model) each run their own lazy init at their first forward
        self.ctxs = [c for c in ctxs.values() if hasattr(c, "all_gather_state")]
        self.rs_list = all(hasattr(c, "reduce_scatter_states") for c in self.ctxs)  # 2.13+
        rs_one = all(hasattr(c, "reduce_scatter_state") for c in self.ctxs)  # 2.6-2.9
        self.ok = (bool(self.ctxs) or not self.groups) and (self.rs_list or rs_one)
        self.ok = self.ok and all(hasattr(pg, "_all_gather_result") for pg in self.groups)
        if not self.ok and final:
            problem("FSDPCommContext.all_gather_state / reduce_scatter_states (2.6-2.9: reduce_scatter_state) / "
                    "FSDPParamGroup._all_gather_result", "comm_buffers unknown")
        self.hsdp = [pg for pg in self.groups if is_hsdp(pg)]

    def bytes(self, exclude=None, keys: set | None = None) -> int | None:
        """They are standalone tensors, so ``nbytes`` is their size. ``exclude(pg, tensor)``: an HSDP
        all-reduce input the caller already counts elsewhere (see ``FsdpSizes.comm_bytes``). ``keys``: a set the
        counted all-gather outputs' and reduce-scatter inputs' storages (``_cdata``) are added to."""
        if not self.ok:
            return None
        seen: list[int] = []
        total = 0

        def add(t) -> int:
            if keys is not None:
                keys.add(t.untyped_storage()._cdata)
            return t.nbytes
        for c in self.ctxs:
            ags = c.all_gather_state
            if ags is not None:
                t = ags.all_gather_result.all_gather_output
                seen.append(id(t))
                total += add(t)
            if self.rs_list:
                for rs in c.reduce_scatter_states:
                    total += add(rs.reduce_scatter_input)
            else:
                rs = c.reduce_scatter_state
                if rs is not None:
                    total += add(rs.reduce_scatter_input)
        for pg in self.groups:
            agr = pg._all_gather_result
            if agr is not None:
                t = agr.all_gather_output
                if id(t) not in seen:
                    total += add(t)
        for pg in self.hsdp:
            ars = getattr(pg, "_all_reduce_state", None)
            if ars is not None and isinstance(getattr(ars, "all_reduce_input", None), torch.Tensor):
                if exclude is None or not exclude(pg, ars.all_reduce_input):
                    total += ars.all_reduce_input.nbytes
            pro = getattr(pg, "_partial_reduce_output", None)
            if isinstance(pro, torch.Tensor):
                total += pro.nbytes
        return total


# ------------------------------------------------------------------------------------------- knobs
def set_unshard_async_op(module: nn.Module, value: bool = True) -> bool:
    """``FSDPModule._set_unshard_async_op`` (private; every tested release has it). False when absent."""
    setter = getattr(module, "_set_unshard_async_op", None)
    if setter is None:
        problem("FSDPModule._set_unshard_async_op", "async unshard not set")
        return False
    setter(value)
    return True


def enable_cpu_fsdp() -> list[str]:
    """Makes FSDP2 train on CPU with torch releases whose CPU path is broken, by back-porting what later
    releases ship; the reference workload calls it on CPU, ``watch`` never does. Returns what was added.

    * torch 2.6: ``torch.cpu.Stream`` lacks the no-op ``record_event`` / ``wait_event`` FSDP2 calls
      (``AttributeError: 'Stream' object has no attribute 'record_event'``); 2.7+ ship them as no-ops (CPU
      has one stream; its events are no-ops).
    * torch 2.6: the all-gather copy-out (``foreach_all_gather_copy_out``) writes into the persistent
      all-gather outputs with an out= op that bumps their version counter, so a parameter re-gathered
      in backward fails autograd's saved-tensor check ("modified by an inplace operation ... is at version
      2; expected version 1"). torch 2.9 wraps that copy in ``_unsafe_preserve_version_counter``; this
      does the same around the call (the data written is identical).
    """
    added = []
    cpu = getattr(torch, "cpu", None)
    stream = getattr(cpu, "Stream", None)
    if stream is not None and not hasattr(stream, "record_event"):
        event = getattr(cpu, "Event", None)
        stream.record_event = lambda self, event_=None: event() if event is not None else None  # type: ignore[attr-defined]
        stream.wait_event = lambda self, event_: None  # type: ignore[attr-defined]
        added.append("torch.cpu.Stream.record_event/wait_event")
    try:
        import inspect

        from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_param_group
    except Exception:  # noqa: BLE001
        return added
    orig = getattr(_fsdp_param_group, "foreach_all_gather_copy_out", None)
    if orig is None or getattr(orig, "_fsdp_doctor_vc", False) or TORCH[:2] >= (2, 9):
        return added  # 2.9+ preserves the counters itself (2.15 moved that code elsewhere)
    try:
        preserves = "_unsafe_preserve_version_counter" in inspect.getsource(_fsdp_collectives.foreach_all_gather_copy_out)
    except Exception:  # noqa: BLE001
        preserves = True
    if preserves:
        return added

    def foreach_all_gather_copy_out(all_gather_result, fsdp_params, group, *args, **kwargs):
        outs = tuple(t for fp in fsdp_params for t in (getattr(fp, "all_gather_outputs", None) or ())
                     if isinstance(t, torch.Tensor) and not t.is_inference())
        versions = [t._version for t in outs]
        try:
            return orig(all_gather_result, fsdp_params, group, *args, **kwargs)
        finally:
            for t, v in zip(outs, versions):
                torch._C._autograd._unsafe_set_version_counter(t, v)

    foreach_all_gather_copy_out._fsdp_doctor_vc = True  # type: ignore[attr-defined]
    _fsdp_param_group.foreach_all_gather_copy_out = foreach_all_gather_copy_out
    added.append("version-counter-preserving all-gather copy-out")
    return added


# ------------------------------------------------------------------------------------------- autograd
#: :func:`saved_hooks_top` on a torch that cannot show the hooks (torch 2.6) while some are active.
UNKNOWN_HOOKS = ("unknown",)


def saved_hooks_top():
    """The saved-tensor default hooks on top of autograd's stack: ``(pack, unpack)``, or None when none are
    active. torch 2.9+ has ``torch._C._autograd._top_saved_tensors_default_hooks``; torch 2.6 has no reader,
    so a tiny probe op tells whether any hooks are active (a saved tensor refuses ``register_hooks`` when
    default hooks already set them) and :data:`UNKNOWN_HOOKS` stands for "some, not known which"."""
    ag = torch._C._autograd
    top = getattr(ag, "_top_saved_tensors_default_hooks", None)
    if top is not None:
        return top(False)
    with torch.enable_grad():
        x = torch.ones(1, requires_grad=True)
        y = x * x  # kept alive: its graph holds the saved tensor
    try:
        y.grad_fn._raw_saved_self.register_hooks(_identity, _identity)
    except RuntimeError as e:
        if "already been set" in str(e):
            return UNKNOWN_HOOKS
    return None


def _identity(t):
    return t


def not_the_users_hooks(pack) -> None:
    """Marks the doctor's saved-tensor pack hook as torch's checkpoint marks its own (``_checkpoint_internal``, with
    no user hooks below it: the doctor pushes its hooks only where none are active): torch 2.15's selective
    checkpointing looks past such hooks for the user's, so it caches as it does without the doctor. Unmarked, the
    doctor's hooks read as the user's (a ``save_on_cpu``) and every selective checkpoint region warned the user
    ("A saved_tensors_hooks context (e.g. save_on_cpu) is active around a selective activation checkpoint region
    ... pass respect_saved_tensors_hooks"): torchtitan's default checkpointing on torch 2.15. Releases before 2.15
    read no such mark."""
    pack._checkpoint_internal = True
    pack._user_hooks = None


def sac_cache():
    """The cache of the selective activation checkpoint region running now (the storage of torch's
    ``_CachingTorchDispatchMode`` on the dispatch mode stack: what the region's policy saves, outside autograd's
    saved tensors and so outside any saved-tensor hook), or None: no such region, or not readable."""
    try:
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        for mode in reversed(_get_current_dispatch_mode_stack()):
            if type(mode).__name__ == "_CachingTorchDispatchMode":
                cache = getattr(mode, "storage", None)
                return cache if isinstance(cache, dict) else None
    except Exception:  # noqa: BLE001 - another torch: not read
        return None
    return None


def sac_cached_tensors(cache: dict) -> list:
    """The tensors a selective checkpoint region's cache holds now. Its entries by operator: a list of them (2.6 -
    2.13: popped as the recompute takes them) or a dict by call index (2.15: a taken one replaced by a marker); an
    entry is the operator's outputs, each wrapped (``_VersionWrapper.val``)."""
    out: list = []
    try:
        _cached(list(cache.values()), out, 0)
    except Exception:  # noqa: BLE001 - another shape: what was read so far
        pass
    return out


def _cached(x, out: list, depth: int) -> None:
    """(a plain function: a closure calling itself is a reference cycle, and one holding ``out`` kept every cached
    tensor alive until a garbage collection: 14 MiB more at the peak of the next step)"""
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif depth < 4 and isinstance(x, (list, tuple)):
        for y in x:
            _cached(y, out, depth + 1)
    elif depth < 4 and isinstance(x, dict):
        for y in x.values():
            _cached(y, out, depth + 1)
    elif isinstance(getattr(x, "val", None), torch.Tensor):
        out.append(x.val)


def autocast_dtype(device_type: str) -> str | None:
    """torch.autocast's dtype where an autocast region is active for ``device_type`` here ("bfloat16"), else None
    (``torch.is_autocast_enabled(device_type)`` and ``torch.get_autocast_dtype``: torch 2.4+; None where they
    fail)."""
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
        return str(torch.get_autocast_dtype(device_type)).replace("torch.", "")
    except Exception:  # noqa: BLE001 - an older torch, an unknown device type: not read
        return None


# ------------------------------------------------------------------------------------------- labels
#: record_function labels of FSDP2 the analyses use, with the releases that lack them.
LABELS_MISSING_IN = {
    "FSDP::post_backward_rs_wait": ((2, 6), (2, 12)),  # not in 2.6 / 2.9; added by 2.13
    "FSDP::post_backward_accumulate": ((2, 15), (99, 0)),  # gone in 2.15
}


def labels_unavailable() -> list[str]:
    """The labels of :data:`LABELS_MISSING_IN` this torch does not emit (read from its source when possible)."""
    src = _fsdp_source()
    out = []
    for label, (lo, hi) in LABELS_MISSING_IN.items():
        if src is not None:
            if f'"{label}' not in src and f"'{label}" not in src:
                out.append(label)
        elif lo <= TORCH[:2] <= hi:
            out.append(label)
    return out


def features_unavailable() -> list[str]:
    """What this release lacks of what some torch releases have (labels, private APIs), one name each."""
    out = [f"label {lab}" for lab in labels_unavailable()]
    if not hasattr(torch._C._autograd, "_top_saved_tensors_default_hooks"):  # 2.6
        out.append("torch._C._autograd._top_saved_tensors_default_hooks (saved-tensor hooks found by a probe op)")
    if FSDPModule is not None and not hasattr(FSDPModule, "_set_unshard_async_op"):
        out.append("FSDPModule._set_unshard_async_op")
    if FSDPModule is not None and not hasattr(FSDPModule, "set_reshard_after_forward"):  # 2.6
        out.append(SET_RESHARD_AFTER_FORWARD)
    return out


_SRC: list = []


def _fsdp_source() -> str | None:
    if not _SRC:
        try:
            import inspect

            from torch.distributed.fsdp._fully_shard import _fsdp_param_group, _fsdp_state

            _SRC.append(inspect.getsource(_fsdp_param_group) + inspect.getsource(_fsdp_state))
        except Exception:  # noqa: BLE001
            _SRC.append(None)
    return _SRC[0]

