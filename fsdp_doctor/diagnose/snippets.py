"""Fix snippets, written from the run's own module tree: the one place that turns unit and module names into
code. Rules ask it; none writes a module expression itself.

The tree comes from the unit snapshot (every unit's modules, its parent, the modules holding its own
parameters, tied ones) or, for a plain trace, from the FSDP labels' fqns. Every snippet

- names the real modules (``model.model.embed_tokens``, ``model.get_submodule('layer2.0')``, a grouped
  ``[model.norm, model.output]``), the root as ``model``, never by a display label such as ``(root)``;
- covers all of them: every block of every block container (``layer1..layer3``), every unit;
- defines what it uses: ``complete`` adds the imports and the mesh it needs; the only names it takes from the
  user's code are ``model`` (and ``optimizer``), the objects ``watch(model, optimizer)`` was given;
- is valid Python for that model (tests/test_fixes_applied.py applies each one and reruns).

Two kinds of fix: a *sharding plan* (``shard_plan``) replaces the user's ``fully_shard`` calls and is applied to
the unsharded model; a *setting* (``unit_list``, ``set_on_units``) acts on the sharded model.
"""

from __future__ import annotations

import ast
import re
import shlex
import textwrap
from dataclasses import dataclass, field
from typing import Iterable, Optional

import msgspec

from ..records import ALLOC_CONF_VARS, FSDP_MODULE_METHODS, SET_RESHARD_AFTER_FORWARD
from ..units import fmt_bytes, fmt_mesh, fmt_share, unit_label
from . import thresholds as T

ROOT = "model"
#: the words that say a snippet is pasted where the model is built, before any fully_shard (a sharding plan,
#: checkpoint wrappers); every other snippet acts on the sharded model
BEFORE_SHARDING = "apply to the unsharded model"
#: the line of a two-part snippet (FIX_PLACES "around") where the user's own fully_shard calls go
SHARDING_GOES_HERE = "# ... your fully_shard calls ..."
#: display labels of the root unit (trace rows, evidence): the module they name is the model itself
ROOT_LABELS = ("", "(root)")

_CKPT = "._checkpoint_wrapped_module"
# a numbered module: under a named container ("layers.2") or, where no name holds the number, a child of the root
# itself ("2": an nn.Sequential model's embedding, blocks and head); group 1 is None for the root's
_IDX = re.compile(r"^(?:(.*?)\.)?(\d+)(?:\.|$)")
_DEEP = re.compile(r"^(?:(.*?)\.)?(\d+)\.")
_NUMBERED = re.compile(r"^(?:(.*)\.)?(\d+)$")  # a numbered module itself: "layers.2", "2"; group 1 its container


# ---------------------------------------------------------------------------------------------- names
def strip_ckpt(fqn: str) -> str:
    return fqn.replace(_CKPT, "").replace("_checkpoint_wrapped_module.", "")


def module_expr(fqn: Optional[str], root: str = ROOT) -> str:
    """Python expression for a module fqn: "layers.0.attn" -> ``model.get_submodule('layers.0.attn')``,
    "norm" -> ``model.norm``; the root ("" or its label "(root)") -> ``model``."""
    if fqn is None or fqn in ROOT_LABELS:
        return root
    if fqn == _CKPT[1:]:
        # a block's unit inside its CheckpointWrapper (accelerate's plugin wraps each layer, then shards the layer
        # inside): the inner module while wrapped, the block itself once unwrapped (as an older ac.unneeded fix did:
        # named ``block._checkpoint_wrapped_module``, a prefetch fix pasted beside that one raised AttributeError)
        return f"getattr({root}, {fqn!r}, {root})"
    if all(part.isidentifier() for part in fqn.split(".")):
        return f"{root}.{fqn}"
    # a numbered child: get_submodule works for ModuleList and ModuleDict alike (model.layers[0] fails on a
    # ModuleDict, whose keys are strings, as torchtitan's llama has)
    return f"{root}.get_submodule({fqn!r})"


def members(name: str) -> list[str]:
    """The module fqns of a unit label: "norm, output" -> ["norm", "output"]; the root -> [""]."""
    return [m for m in name.split(", ")] if name not in ROOT_LABELS else [""]


def group_expr(mods: list[str]) -> str:
    """One module, or a grouped unit's list: ``model.norm`` / ``[model.norm, model.output]``."""
    exprs = [module_expr(m) for m in mods]
    return exprs[0] if len(exprs) == 1 else "[" + ", ".join(exprs) + "]"


def root_expr(t: "Tree") -> str:
    """The run's root unit as code: ``model``, or the module of the watched model that was the root where watch() was
    given a module holding it (a LightningModule, whose configure_model shards ``self.model``: the plans' last line
    sharded the LightningModule itself, a new-user trial)."""
    root = t.root()
    return ROOT if root is None or root.name in ROOT_LABELS else unit_expr(root)


def on_root_unit(rec, root: str) -> None:
    """A fix whose lines call FSDPModule's methods on ``model`` (``model.set_reshard_after_forward(False)``), where the
    watched model is not the root unit but holds it (``root``, ``root_expr``): those calls made on the root unit
    (``Recommendation``, changed in place). A LightningModule's validation kept gathered by eval.regather's fix read
    ``model.set_reshard_after_forward(False)``: a LightningModule has no such method, its ``self.model`` has (a
    new-user trial)."""
    if rec.code and root != ROOT:
        names = "|".join(sorted(map(re.escape, FSDP_MODULE_METHODS)))
        rec.code = re.sub(rf"(?<![\w.]){ROOT}\.({names})\(", rf"{root}.\1(", rec.code)


def unit_expr(u) -> str:
    """The unit's module(s) as code (a UnitConfig)."""
    return group_expr(list(u.modules) or members(u.name))


def children_expr(fqn: str, idx: Iterable[int] = (), named: bool = False, as_list: bool = False) -> str:
    """Code iterating a block container's modules: ``model.layers.children()`` (iterating a ModuleDict itself
    would give its keys); ``named``: ``named_children()``; ``as_list``: a list. The root's (fqn "") are its
    numbered children ``idx`` only: an nn.Sequential model's blocks between its embedding and its head,
    ``list(model.children())[1:5]`` (``model.children()`` would wrap the embedding and the head as blocks)."""
    call = "named_children()" if named else "children()"
    idx = list(idx)
    if fqn or not idx:
        return f"list({module_expr(fqn)}.{call})" if as_list else f"{module_expr(fqn)}.{call}"
    if idx == list(range(idx[0], idx[-1] + 1)):
        return f"list({ROOT}.{call})[{idx[0]}:{idx[-1] + 1}]"
    # (not consecutive: one get_submodule each read 118 columns for four blocks, a new-user trial)
    item = f"(str(i), {ROOT}.get_submodule(str(i)))" if named else f"{ROOT}.get_submodule(str(i))"
    return f"[{item} for i in {tuple(idx)!r}]"


def block_containers(names: Iterable[str]) -> dict[str, list[int]]:
    """Repeated-block containers among module names, outermost numbered level: {"layers": [0, 1, 2, 3]} for
    "layers.0.attn.qkv", ...; {"layer1": [0, 1], "layer2": [0, 1]} for a ResNet's stages; {"": [1, 2, 3, 4]} for
    an nn.Sequential model's "1.self_attn", ..., "4.linear2", the root's numbered children counted only where a
    module inside them is named (its blocks, not its embedding "0" and head "5")."""
    out: dict[str, set[int]] = {}
    for n in names:
        m = _IDX.match(strip_ckpt(n))
        if m and (m.group(1) is not None or _DEEP.match(strip_ckpt(n))):
            out.setdefault(m.group(1) or "", set()).add(int(m.group(2)))
    # a numbered module whose numbered children holding parameters leave gaps is a block of layers, some without
    # parameters (an nn.Sequential(Linear, ReLU, Linear) block reads "1.0", "1.2"): it is a block of its parent, not
    # a container, whose children() would make a unit of each layer and of each ReLU
    for c, idx in list(out.items()):
        m = _NUMBERED.match(c)
        if m and len(idx) >= 2 and sorted(idx) != list(range(min(idx), max(idx) + 1)):
            del out[c]
            out.setdefault(m.group(1) or "", set()).add(int(m.group(2)))
    return {k: sorted(v) for k, v in out.items() if len(v) >= 2}


def block_of(name: str) -> Optional[str]:
    """The repeated block a module belongs to: "layers.2.mlp.fc1" -> "layers.2"; "2.linear1" (a child of an
    nn.Sequential model) -> "2"."""
    m = _IDX.match(strip_ckpt(name))
    return (f"{m.group(1)}.{m.group(2)}" if m.group(1) is not None else m.group(2)) if m else None


def container_of(name: str, conts: dict[str, list[int]]) -> Optional[str]:
    """The container among ``conts`` whose blocks hold module ``name``: "layers" for "layers.2.mlp", "" for
    "2.linear1" where the root's children 1..4 are its blocks (not for its embedding "0"); else None."""
    blk = block_of(name)
    if blk is None:
        return None
    c, _, i = blk.rpartition(".")
    return c if c in conts and (c or int(i) in conts[c]) else None


def in_container(name: str, c: str, conts: dict[str, list[int]]) -> bool:
    """Whether module ``name`` is container ``c`` or inside one of its blocks."""
    return (bool(c) and name == c) or container_of(name, conts) == c


# ---------------------------------------------------------------------------------------------- the tree
@dataclass
class Tree:
    """The run's module tree as far as the snapshot (or the trace's labels) shows it."""

    units: list = field(default_factory=list)  # UnitConfig-like rows, snapshot (forward) order
    names: list[str] = field(default_factory=list)  # unit labels where no snapshot exists (plain traces)
    # unit labels in the order the run started their forward and their backward (``run_order``); [] and None where
    # it recorded none (a trace records the forward only)
    forward: list[str] = field(default_factory=list)
    backward: Optional[list[str]] = None

    @classmethod
    def of(cls, units=None, names: Iterable[Optional[str]] = (), forward: Iterable[str] = (),
           backward: Optional[Iterable[str]] = None) -> "Tree":
        return cls(units=list(units or []), names=[n for n in names if n is not None], forward=list(forward),
                   backward=None if backward is None else list(backward))

    def labels(self) -> list[str]:
        """Every unit's label, the snapshot's first, then the trace's, in order, no duplicates."""
        seen = dict.fromkeys([u.name for u in self.units] + self.names)
        return list(seen)

    def non_root(self) -> list:
        return [u for u in self.units if not u.is_root]

    def root(self):
        return next((u for u in self.units if u.is_root), None)

    def module_names(self) -> list[str]:
        """Every module fqn the tree knows: units' modules and, inside a numbered child, the modules holding
        their own parameters (``layer1.0.conv1`` says ``layer1.0`` is a block; ``stem.0``, a Conv2d holding
        parameters itself, is a leaf of a Sequential, not a block)."""
        own = [m for u in self.units for m in getattr(u, "own_modules", []) or [] if _DEEP.match(strip_ckpt(m))]
        out = [m for u in self.units for m in u.modules] + own
        out += [m for n in self.names if n not in ROOT_LABELS for m in members(n)]
        return out

    def containers(self) -> dict[str, list[int]]:
        """Every repeated-block container, outermost first (a container inside a block is not one)."""
        found = block_containers(self.module_names())
        # numbered siblings that are units are the blocks (the run's own, whatever is inside them): units "1", "2",
        # "3" of nn.Sequential blocks are the root's blocks 1-3, and "1" no container of blocks "1.0", "1.1", "1.2"
        # (a new-user trial's plan split each block into its Linear and ReLU layers: 12 units for 6)
        numbered: dict[str, set[int]] = {}
        for u in self.non_root():
            inner = [o for o in getattr(u, "own_modules", []) or [] for m in u.modules if o.startswith(m + ".")]
            for m in u.modules if inner else ():  # (a leaf unit, a Linear "0" of its own, holds no layers to split)
                if (n := _NUMBERED.match(strip_ckpt(m))) is not None:
                    numbered.setdefault(n.group(1) or "", set()).add(int(n.group(2)))
        for c, idx in numbered.items():
            if len(idx) < 2:
                continue
            blocks = [f"{c}.{i}" if c else str(i) for i in idx]
            found = {k: v for k, v in found.items() if not any(k == b or k.startswith(b + ".") for b in blocks)}
            found.setdefault(c, sorted(idx))
        # in the model's order, each where its first block comes (outermost first; the unit containers above were put
        # first each in turn once: a diffusers Flux's plans read single_transformer_blocks before transformer_blocks,
        # T5's decoder before its encoder)
        names = [strip_ckpt(n) for n in self.module_names()]
        at = {c: next((i for i, n in enumerate(names) if (n.startswith(c + ".") if c else
                                                          (b := block_of(n)) is not None and "." not in b)),
                      len(names)) for c in found}
        found = dict(sorted(found.items(), key=lambda kv: at[kv[0]]))
        # (inside a numbered child of the root, "1.layers" of an nn.Sequential holding a TransformerEncoder, only
        # where the root's numbered children are blocks themselves)
        return {c: idx for c, idx in found.items()
                if (b := block_of(c)) is None or ("." not in b and "" not in found)}

    def split_blocks(self) -> dict[str, tuple[str, float]]:
        """Blocks too large to be one unit: {block: (its own block container, relative; its share of the model's
        parameter bytes)} for each block of a container holding T.COARSE_SHARE_MIN of them or more whose own modules
        hold two or more numbered blocks of their own, none of them a unit yet (a ConvNeXt's ``stages.3`` ->
        ``blocks``: ``stages.3.blocks.0``, ``stages.3.blocks.1``; "" where they are the block's numbered children). A
        plan making a unit of each stage left 55% of a ConvNeXt's parameters in its last, and wrap.too_coarse fired
        again on it (a new-user trial)."""
        own = [(m, b) for u in self.units for m, b in zip(getattr(u, "own_modules", []) or [],
                                                          getattr(u, "own_bytes", []) or [])]
        total = sum(b for _, b in own)
        if not total:
            return {}
        conts = self.containers()
        by_block: dict[str, list[tuple[str, int]]] = {}
        for m, b in own:
            blk = block_of(m)
            if blk is not None and container_of(m, conts) is not None:
                by_block.setdefault(blk, []).append((strip_ckpt(m)[len(blk) + 1:], b))
        units = [m for u in self.non_root() for m in u.modules]
        out = {}
        for blk, mods in by_block.items():
            size = sum(b for _, b in mods)
            if size < T.COARSE_SHARE_MIN * total:
                continue
            inner = block_containers(m for m, _ in mods if m)
            # the one holding the most (a ConvNeXt stage's blocks, not its downsample's numbered layers), half the
            # block or more
            held = {c: sum(b for m, b in mods if container_of(m, inner) == c) for c in inner}
            sub = max(held, key=held.get, default=None)
            if sub is not None and 2 * held[sub] >= size and not any(u.startswith(blk + ".") for u in units):
                out[blk] = (sub, size / total)
        return out

    def unit_labels(self) -> list[str]:
        """The non-root units in forward order (snapshot order; a trace's labels sorted by block)."""
        if self.units:
            return [u.name for u in self.non_root() if u.param_count != 0]
        return [n for n in self.names if n not in ROOT_LABELS]


def block_bytes(u, split: Optional[dict[str, tuple[str, float]]] = None) -> dict[str, int]:
    """A unit's repeated blocks (``layer1.0``, ...) in module order, with the bytes of their parameters (the
    snapshot's own modules and their sizes); {} where the snapshot has no sizes. ``split`` (Tree.split_blocks): those
    blocks' own blocks apart, each block's other modules under its name."""
    out: dict[str, int] = {}
    for m, b in zip(getattr(u, "own_modules", []) or [], getattr(u, "own_bytes", []) or []):
        blk = block_of(m) if _DEEP.match(strip_ckpt(m)) else None
        if blk is not None and split and blk in split:
            rest = strip_ckpt(m)[len(blk) + 1:]
            inner = block_of(rest) if _DEEP.match(rest) else None
            if inner is not None and inner.rpartition(".")[0] == split[blk][0]:
                blk = f"{blk}.{inner}"
        if blk is not None:
            out[blk] = out.get(blk, 0) + b
    return out


def per_chunk(config, root) -> list[str]:
    """The root's own modules the model calls once per chunk of the sequence: torchtune's TransformerDecoder with
    num_output_chunks above 1 (RunConfig.output_chunks; its recipes set it for CEWithChunkedOutputLoss) calls its
    ``output`` head on each chunk, as many times as each rank's sequence splits into: a unit of its own would issue
    its collectives per call, a different count on each rank (wrap.params_in_root says it); [] for none."""
    if (getattr(config, "output_chunks", None) or 0) < 2:
        return []
    return [m for m in root.own_modules or [] if m == "output" and m not in root.tied_modules]


def read_outside_forward(root) -> list[str]:
    """The root's own modules whose parameters the run's first step read outside their forward, or whose forward it
    never ran (UnitConfig.read_outside_modules; not the tied ones): a GPT's logits reading its embedding's weight
    (``F.linear(h, self.wte.weight)``), DeBERTa's encoder reading ``rel_embeddings.weight``. A unit of their own, or
    one holding them, would not be gathered where they are read (new-user trials' plans for both, pasted: "mixed
    torch.Tensor and DTensor" on both ranks): they stay in the root as tied modules do, in every plan."""
    tied = set(root.tied_modules or [])
    return [m for m in getattr(root, "read_outside_modules", None) or [] if m and m not in tied]


def _staying_in_root(cfg, root):
    """The root's row with what stays in the root in every plan among its tied modules: an output head called once per
    chunk (per_chunk) and modules read without their forward (read_outside_forward), which its read_outside_modules
    then names alone: a tied module whose forward never runs (BART's ``shared``) is said to be tied, not read outside
    (a new-user trial's plan said it twice)."""
    chunked = per_chunk(cfg, root)
    if not chunked and not getattr(root, "read_outside_modules", None):
        return root
    unread = read_outside_forward(root)
    return msgspec.structs.replace(root, tied_modules=[*root.tied_modules, *chunked, *unread],
                                   read_outside_modules=None if root.read_outside_modules is None else unread)


def tree(ctx) -> Tree:
    """The tree of a diagnosis context: the run's unit snapshot, else the report's unit rows, and the trace's
    unit labels."""
    cfg = getattr(ctx.run, "config", None)
    rows = list(cfg.units) if cfg is not None and cfg.units else list(ctx.report.units or [])
    rows = [_staying_in_root(cfg, r) if r.is_root else r for r in rows]
    ov = ctx.report.overlap
    # a plain trace: the units its collectives and its FSDP labels name (a trace without collectives: labels)
    named = ([r.unit for r in ov.per_unit] + [r.name for r in ov.units or []]) if ov is not None else []
    labels = [n for n in named if n and not n.startswith("(")]
    return Tree.of(rows, [] if rows else sorted(set(labels), key=_label_order), *run_order(ctx))


def run_order(ctx) -> tuple[list[str], Optional[list[str]]]:
    """(forward, backward): the unit labels in the order the run started their forward and their backward, as
    the recorder marked them on a rank's memory timeline (a unit's ``forward_start`` after FSDP's pre-forward,
    its ``backward_start`` at FSDP's pre-backward; the step's first forward and first backward), else a trace's
    units in the order they first ran forward (its backward None); ([], None) where the run has neither."""
    mem = ctx.report.memory
    for pm in mem.per_rank.values() if mem is not None else ():
        fwd: dict[str, None] = {}
        bwd: dict[str, None] = {}
        for r in pm.timeline:
            unit, phase = r.get("unit"), r.get("phase")
            if unit is not None and phase == "backward_start":
                bwd[unit] = None
            elif unit is not None and phase == "forward_start" and not bwd:  # not a recompute in backward
                fwd[unit] = None
        if fwd and bwd:
            return list(fwd), list(bwd)
    ov = ctx.report.overlap
    return ([r.name for r in ov.units] if ov is not None else []), None


def _label_order(name: str):
    m = _IDX.match(name or "")
    return (m.group(1) or "", int(m.group(2))) if m else (name or "", -1)


# ---------------------------------------------------------------------------------------------- sharding plans
#: the name a plan gives its MixedPrecisionPolicy (``root_mp_policy``, ``mp_policy2``, ... where units differ):
#: ``mp`` was bound in the user's code where a script imported torch.multiprocessing as mp (PyTorch's FSDP
#: tutorial does, and spawns with mp.spawn), which a pasted plan rebound; torchtitan names it so too
MP = "mp_policy"


def _unit_kwargs(u, inherit: bool = False, mp: Optional[dict] = None) -> str:
    """The unit's own fully_shard options as the run had them (what a plan must keep: mixed precision, a
    ``reshard_after_forward`` other than the default, False or an int, and offload). ``inherit``: for modules
    the unit held that become units of their own (the blocks of a whole-model unit): its mixed precision and
    offload, which they must share (a bf16 input meets fp32 weights otherwise), not its resharding nor its
    output_dtype (``_policy``). ``mp``: the plan's variable for each policy (``_policy_vars``; none: ``MP``)."""
    kw = ""
    if (pol := _policy(u, inherit)) is not None:
        kw += f", mp_policy={(mp or {}).get(pol, MP)}"
    raf = getattr(u, "reshard_after_forward", True)  # True, False or an int (reshard to that many ranks)
    if not u.is_root and not inherit and raf is not None and raf is not True:
        kw += f", reshard_after_forward={raf}"
    if getattr(u, "offload", None) == "cpu":
        kw += f", offload_policy=CPUOffloadPolicy(pin_memory={bool(getattr(u, 'offload_pin_memory', False))})"
    if getattr(u, "shard_dims", None):  # (a plan dropped the user's shard_placement_fn: a new-user trial)
        kw += f", shard_placement_fn={SHARD_PLACEMENT_FN}"
    return kw


def _holder(t: Tree, fqn: str):
    """The unit that held module ``fqn`` in the run: the innermost unit applied to it or to an ancestor, else
    the root."""
    def depth(u) -> int:  # how deep the unit's module that contains fqn is
        return max((len(m) for m in u.modules if fqn == m or fqn.startswith(m + ".")), default=-1)

    held = [u for u in t.non_root() if depth(u) >= 0]
    return max(held, key=depth, default=None) or t.root()


def policy_line(var: str, param_dtype: str, reduce_dtype: str = "float32", output_dtype: str = "",
                note: str = "") -> str:
    """``var = MixedPrecisionPolicy(param_dtype=torch.X, ...)`` (dtype names without ``torch.``), its arguments on
    continuation lines past 80 columns (the one-line form read 81-103 columns in 80-column terminals)."""
    args = [f"{k}=torch.{v}" for k, v in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype),
                                          ("output_dtype", output_dtype)) if v]
    head = f"{var} = MixedPrecisionPolicy("
    one = head + ", ".join(args) + ")"
    if len(one) > 80:
        one = head + (",\n" + " " * len(head)).join(args) + ")"
    return (f"# {note}\n" if note else "") + one


def _policy(u, inherit: bool = False) -> Optional[tuple[str, str, str]]:
    """A unit's MixedPrecisionPolicy as the snapshot has it, (param_dtype, reduce_dtype, output_dtype), "" where
    unset; None without one. ``inherit``: for modules it held that become units of their own, without its
    output_dtype, which casts the unit's own output (the unit still does): on them it casts outputs the run never
    had, and a norm split off a root with output_dtype=float32 fed float32 to the head left in that root, whose
    weights were bf16 (RuntimeError: expected m1 and m2 to have the same dtype)."""
    pol = tuple(getattr(u, k, None) or "" for k in ("param_dtype", "reduce_dtype", "output_dtype"))
    pol = pol[:2] + ("",) if inherit else pol
    return pol if any(pol) else None


def _policy_vars(units, one: bool = False) -> dict[tuple, str]:
    """The plan's variable for each distinct policy of the run's units (``_policy``, with the ones the modules a
    unit held take), so that each unit keeps its own: ``MP`` where they are all the same (``one``: a rule's own
    ``MP`` for all of them); else ``root_MP`` for a root's that no other unit had, ``MP``, ``MP2``, ... for the
    others, the non-root units' first. (One policy from the first unit with a policy, the root, gave every block the
    root's output_dtype=float32, a cast of each block's output the run never had: a new-user trial.)"""
    ordered = sorted(units, key=lambda u: bool(u.is_root))
    pols = list(dict.fromkeys(p for inherit in (False, True) for u in ordered
                              if (p := _policy(u, inherit)) is not None))
    if one or len(pols) < 2:
        return {p: MP for p in pols}
    others = {_policy(u, inherit) for u in units for inherit in (False, True) if inherit or not u.is_root}
    rest = [p for p in pols if p in others]
    return {p: f"root_{MP}" if p not in others else MP if p == rest[0] else f"{MP}{rest.index(p) + 1}" for p in pols}


def _policy_lines(mp: dict, code: str) -> list[str]:
    """``var = MixedPrecisionPolicy(...)`` for each policy of ``mp`` (``_policy_vars``) that ``code`` passes."""
    used = [(p, v) for p, v in mp.items() if re.search(rf"\bmp_policy={v}\b", code)]
    note = "as your run had it" if len(used) == 1 else "as your run had them: each unit keeps its own"
    return [(f"# {note}\n" if i == 0 else "") + policy_line(v, *p) for i, (p, v) in enumerate(used)]


def _options(kw: str) -> dict[str, str]:
    """``, a=1, b=2`` (a call's options as the snippets write them) as {"a": "1", "b": "2"}."""
    return dict(p.split("=", 1) for p in kw.split(", ") if "=" in p)


def _merge(kw: str, extra: str, drop: tuple[str, ...] = ()) -> str:
    """``, a=1, b=2`` with ``extra``'s options replacing the same keys, the ``drop`` keys left out."""
    return "".join(f", {k}={v}" for k, v in _options(kw + extra).items() if k not in drop)


def shard_plan(t: Tree, *, blocks: bool = True, root_leftovers: bool = False, group: int = 1,
               extra_kwargs: str = "", note: str = "", mp_line: Optional[str] = None,
               drop: tuple[str, ...] = (), nested: bool = True, only: Optional[set[str]] = None,
               leftover_costs: Optional[LeftoverCosts] = None, split: bool = False, split_held: bool = True) -> str:
    """The whole sharding of the model, to paste in place of your ``fully_shard`` calls (on the unsharded
    model): every block of every container (``blocks``; ``group`` consecutive blocks per unit), the run's other
    units as they were, with ``root_leftovers`` the modules holding the root's own parameters (tied ones stay
    in the root: FSDP refuses a parameter another unit manages), the root last. Each unit keeps the options
    the run gave it (``_unit_kwargs``: mixed precision, a reshard_after_forward other than True, offload);
    ``extra_kwargs`` adds one to all.
    Units inside a block (a mixture of experts' ``mlp.experts``) stay units, sharded before their block
    (``nested``; dropped by plans that replace them with whole blocks: leaf wrapping, grouped blocks).
    ``only``: the names of the run's units that take ``extra_kwargs`` (the modules they held, when they become
    several units); the others keep their options as they were. ``mp_line``: a rule's own policy ``mp``, for every
    unit that had one; without it each keeps its own (the modules a unit held, that unit's). ``leftover_costs``: the
    run's figures that decide which of the root's modules stay in a root kept for tied modules (``leftover_stays``).
    ``split``: a block too large to be one unit (``Tree.split_blocks``) has its own blocks sharded before it, each a
    unit (wrap.too_coarse's plan; the others keep the run's granularity). ``split_held``: the blocks of a container
    that a unit other than the root held whole (a Qwen2.5-VL's vision tower, ``fully_shard(model.model.visual)``)
    units of their own too; False: that unit stays as the run had it (wrap.params_in_root's plan, which moves the
    root's own modules and predicts that alone: it split the tower unasked, a new-user trial)."""
    lines = ([f"# {note}"] if note else []) + [f"# replaces your fully_shard calls ({BEFORE_SHARDING})"]
    extra_of = lambda u: extra_kwargs if only is None or (u is not None and u.name in only) else ""  # noqa: E731
    mp = _policy_vars(t.units, one=mp_line is not None)
    head = len(lines)
    conts = t.containers() if blocks else {}
    split_ = t.split_blocks() if split and blocks and nested and group == 1 else {}
    in_block = lambda m: any(in_container(m, c, conts) for c in conts)  # noqa: E731
    is_block = lambda m, c: block_of(m) == m and container_of(m, conts) == c  # noqa: E731
    by_cont = {c: next((u for u in t.non_root() if any(is_block(m, c) for m in u.modules)),
                       next((u for u in t.non_root() if any(container_of(m, conts) == c for m in u.modules)),
                            None)) for c in conts}
    if not split_held:  # (the containers whose blocks had no unit of their own: those the root held)
        conts = {c: i for c, i in conts.items() if by_cont[c] is not None or (h := _holder(t, c)) is None or h.is_root}
    for c in conts:
        if by_cont[c] is not None:  # the options of the container's block units
            own, ex = _unit_kwargs(by_cont[c], mp=mp), extra_of(by_cont[c])
        else:  # blocks without units of their own: those of the unit that held them (a whole-model unit)
            held = _holder(t, c)
            own, ex = (_unit_kwargs(held, inherit=True, mp=mp) if held is not None else ""), extra_of(held)
        kw = _merge(own, ex, drop)
        inner = _nested_lines(t, c, ex, drop, mp) if nested and group == 1 else ([], [])
        lines += inner[0]
        for blk, (sub, share) in split_.items():
            if container_of(blk, conts) == c:  # (a block of this container)
                lines += [f"# {blk} holds {fmt_share(share)} of the parameters: its own blocks units of their own,",
                          "# sharded before it",
                          f"for block in {children_expr(f'{blk}.{sub}' if sub else blk)}:",
                          "    " + _call("block", kw, indent=4)]
        per = _per_block_kwargs(t, c, is_block, extra_of, drop, mp) if group == 1 else None
        if group > 1:
            lines += [f"blocks = {children_expr(c, conts[c], as_list=True)}",
                      f"for start in range(0, len(blocks), {group}):  # {group} consecutive blocks per unit",
                      f"    fully_shard(blocks[start:start + {group}], mesh=mesh{kw})"]
        elif per is not None:  # blocks the run sharded with options of their own: each keeps its own
            common, opts = per
            lines += ["# your blocks' own options, as the run had them",
                      f"block_options = {{{', '.join(f'{k!r}: dict({v})' for k, v in opts.items())}}}",
                      f"for name, block in {children_expr(c, conts[c], named=True)}:", *inner[1],
                      "    " + _call("block", common + ", **block_options.get(name, {})", indent=4)]
        else:
            lines += [f"for block in {children_expr(c, conts[c])}:", *inner[1],
                      "    " + _call("block", kw, indent=4)]
    units = t.non_root() if t.units else [None] * 0
    labels = [u.name for u in units] if t.units else t.unit_labels()
    for i, name in enumerate(labels):
        mods = list(units[i].modules) if t.units else members(name)
        if not mods or all(in_block(m) for m in mods):
            continue
        kw = _merge(_unit_kwargs(units[i], mp=mp) if t.units else "",
                    extra_of(units[i]) if t.units else extra_kwargs, drop)
        lines.append(_call(group_expr(mods), kw))
    root = t.root()
    groups = _leftover_groups(t, root, in_block, leftover_costs) if root_leftovers and root is not None else None
    if groups is not None:
        rafs = {getattr(u, "reshard_after_forward", True) for u in t.non_root()} if t.units else set()
        # every unit of the run resharded alike, otherwise than the default a new leading unit takes: say so
        raf = rafs.pop() if len(rafs) == 1 else None
        lines += _leftover_lines(t, root, in_block, _merge(_unit_kwargs(root, inherit=True, mp=mp), extra_of(root),
                                                           drop),
                                 raf if raf is not True else None, leftover_costs, groups)
    rkw = _merge(_unit_kwargs(root, mp=mp) if root is not None else "", extra_of(root), drop)
    lines += ["# the root last: it keeps what no unit holds", _call(root_expr(t), rkw), *_async_unshard_lines(t)]
    if root is not None and (group == 1 or not conts):
        lines += _frozen_front_prefetch(t, root, conts, groups, split_)
    lines[head:head] = [mp_line] if mp_line else _policy_lines(mp, "\n".join(lines))
    return "\n".join(lines)


def holders(t: Tree) -> dict[str, list]:
    """Where the run's units are single modules of a model without repeated blocks (a U-Net's ``enc1.conv1``,
    ``enc1.bn``): each module holding two or more of them (``enc1``), the deepest first, with those units; a unit in
    a repeated block, or alone in its parent, is left out."""
    by_parent: dict[str, list] = {}
    for u in t.non_root():
        if len(u.modules) == 1 and "." in (m := strip_ckpt(u.modules[0])) and block_of(m) is None:
            by_parent.setdefault(m.rsplit(".", 1)[0], []).append(u)
    return dict(sorted(((p, us) for p, us in by_parent.items() if len(us) >= 2), key=lambda kv: -kv[0].count(".")))


def holder_plan(t: Tree, note: str) -> str:
    """The sharding with each module of ``holders`` a unit in place of the units it holds, the run's other units as
    they were, the root last (each with the options the run gave it); to paste in place of the user's calls."""
    groups = holders(t)
    held = {u.name for us in groups.values() for u in us}
    lines = [f"# {note}", f"# replaces your fully_shard calls ({BEFORE_SHARDING})"]
    mp = _policy_vars(t.units)
    lines += [_call(module_expr(p), _unit_kwargs(us[0], mp=mp)) for p, us in groups.items()]
    lines += [_call(unit_expr(u), _unit_kwargs(u, mp=mp)) for u in t.non_root() if u.name not in held]
    root = t.root()
    lines += ["# the root last: it keeps what no unit holds",
              _call(root_expr(t), _unit_kwargs(root, mp=mp) if root else ""), *_async_unshard_lines(t)]
    lines[2:2] = _policy_lines(mp, "\n".join(lines))
    return "\n".join(lines)


def _per_block_kwargs(t: Tree, c: str, is_block, extra_of, drop,
                      mp: Optional[dict] = None) -> Optional[tuple[str, dict[str, str]]]:
    """Where the run's units of container ``c``'s blocks had different options (``reshard_after_forward=False`` on
    the first and the last block only): (the options all share, as ``, k=v``; each block's others by its name in
    the container, as ``k=v, ...``, the blocks with none left out); None where they were alike. A plan that gave
    every block the first one's undid the user's per-block choice (a new-user trial: its peak rose 4.38 -> 4.63 MiB
    where 4.31 was predicted)."""
    kws: dict[str, dict[str, str]] = {}
    for u in t.non_root():
        blocks = [m for m in u.modules if is_block(m, c)]
        if len(blocks) == 1 and len(u.modules) == 1:
            kws[blocks[0][len(c) + 1:] if c else blocks[0]] = _options(_merge(_unit_kwargs(u, mp=mp), extra_of(u),
                                                                              drop))
    if len({tuple(sorted(d.items())) for d in kws.values()}) < 2:
        return None
    first = next(iter(kws.values()))
    common = {k: v for k, v in first.items() if all(d.get(k) == v for d in kws.values())}
    opts = {name: ", ".join(f"{k}={v}" for k, v in d.items() if k not in common) for name, d in kws.items()}
    return "".join(f", {k}={v}" for k, v in common.items()), {n: o for n, o in opts.items() if o}


def _frozen_front_prefetch(t: Tree, root, conts: dict, groups: Optional["_Leftovers"], split: dict) -> list[str]:
    """A plan that makes units of frozen modules the model runs before anything that trains: FSDP2's default backward
    prefetch would gather the last of them in every backward of the first unit after them, which trains, though they
    never run backward (prefetch.frozen_gathered on the reruns of new-user trials' plans: a Wav2Vec2's feature encoder
    split out of a whole-model unit, a DETR's frozen backbone stages and a peft Mixtral's embedding taken out of the
    root). That unit's own list, itself, turns the default off. The root's modules before its first unit
    (``leading_modules``; all of them in a whole-model unit) stand in module order for forward order, the run's units
    in the order it gathered them: a wrong guess only loses that unit one prefetch. ``conts``: the containers whose
    blocks the plan shards (``split``: blocks it splits further: no such guess); ``groups``: where the plan makes units
    of the root's other modules too, how it groups them (``_leftover_groups``)."""
    own = [m for m in root.own_modules or [] if m]
    recorded = getattr(root, "frozen_modules", None)
    frozen = set(recorded) if recorded is not None else \
        set(own) if getattr(root, "trainable_sharded_bytes", None) == 0 else set()  # (runs before frozen_modules)
    if not frozen:
        return []
    unit_of: dict[str, str] = {}  # the root's modules that the plan moves -> the name of the unit they land in
    for mods in [*groups.lead.values(), groups.tail] if groups is not None else []:
        unit_of.update({m: ", ".join(mods) for m, h in groups.head_of.items() if h in mods})
    leading, whole = getattr(root, "leading_modules", None), not t.non_root()
    front = own if whole else \
        [m for m in own if m in leading] if leading is not None else [m for m in own if m not in root.trailing_modules]
    units: list[tuple[str, bool]] = []  # the plan's units in forward order as far as they matter: (name, frozen)
    for m in front:
        c = next((c for c in conts if in_container(m, c, conts)), None)
        if c is not None and block_of(m) in split:
            return []
        name = block_of(m) if c is not None else unit_of.get(m)
        if name is None:  # stays in the root: not in FSDP2's order of units
            continue
        if units and units[-1][0] == name:
            units[-1] = (name, units[-1][1] and m in frozen)
        elif all(n != name for n, _ in units):
            units.append((name, m in frozen))
    if not whole and units:  # the run's first unit in forward, as the plan shards it
        fwd = gather_order(t)[0]
        by = {u.name: u for u in t.units}
        run_first = by.get(fwd[0]) if fwd else None
        if run_first is None or getattr(run_first, "backward_prefetch", None):
            return []  # (no order known, or the user's own list: kept)
        m = members(run_first.name)[0]
        c = next((c for c in conts if in_container(m, c, conts)), None)
        if c is not None and (block_of(m) in split or block_of(m) != m):
            return []  # (a unit inside a block the plan makes a unit: not the first unit any longer)
        units.append((run_first.name, not _trains(t, run_first.name, fwd)))
    first = next((i for i, (_, fz) in enumerate(units) if not fz), None)
    if not first:  # (None: nothing trains; 0: no frozen unit before the first that trains)
        return []
    name = units[first][0]
    return [*comment(f"the {first} unit(s) before {unit_label(name)} in forward hold no trainable parameter and never "
                     f"run backward: without a list of its own {unit_label(name)} would all-gather the last of them "
                     "in every backward for nothing (FSDP2's default prefetch)"), backward_prefetch_lists({name: []})]


def comment(text: str, indent: str = "", width: int = 80) -> list[str]:
    """``text`` as comment lines of ``width`` columns at most (``indent`` before each "# "), one paragraph wrapped
    at its spaces: a fix's lines fit 80 columns as written, in the JSON, the HTML and the dashboard too (which show
    the code as the rule wrote it; only the terminal wrapped it, and a paragraph the rule had broken too late left
    a stray line there: "# without the", a new-user trial). A number stays on the line of its unit ("900.00 KiB")."""
    head = f"{indent}# "
    glued = re.sub(r"(\d) (B|KiB|MiB|GiB|TiB|ms|us|s)\b", "\\1\0\\2", text)
    return [ln.replace("\0", " ") for ln in textwrap.wrap(glued, width, initial_indent=head, subsequent_indent=head,
                                                            break_long_words=False, break_on_hyphens=False)] \
        or [head.rstrip()]


def assign(target: str, value: str, width: int = 80) -> str:
    """``target = value``, the value in parentheses on a line of its own where the line would pass ``width`` columns
    (the Trainer's plugin lines read 85, an allocator setting 88: a new-user trial's JSON showed them whole)."""
    one = f"{target} = {value}"
    return one if len(one) <= width else f"{target} = (\n    {value})"


def _async_unshard_lines(t: Tree) -> list[str]:
    """A plan in place of the user's fully_shard calls keeps the run's asynchronous unshard, which fully_shard does
    not take (``FSDPModule._set_unshard_async_op``, set on the units after it): on every unit, where any of the run's
    had it (a new-user trial's gloo run lost it with the plan, and its all-gathers blocked the host again)."""
    if not any(getattr(u, "unshard_async_op", False) for u in t.units):
        return []
    return [*comment("asynchronous unshard, as your run had it (fully_shard does not take it: set on the units "
                     "after it)"), *async_unshard_code().splitlines()]


def one_unit_plan(t: Tree, note: str = "") -> str:
    """The whole model as one FSDP unit, to paste in place of your ``fully_shard`` calls (on the unsharded model):
    the root alone, with the mixed precision and offload the run's units had (they must agree: a bf16 input meets
    fp32 weights otherwise), the root's own where it had them."""
    lines = ([f"# {note}"] if note else []) + [f"# replaces your fully_shard calls ({BEFORE_SHARDING})"]
    mp = _policy_vars(t.units)
    root = t.root()
    held = next((u for u in t.non_root() if _unit_kwargs(u, inherit=True)), None)
    kw = _merge(_unit_kwargs(held, inherit=True, mp=mp) if held else "",
                _unit_kwargs(root, mp=mp) if root is not None else "")
    return "\n".join(lines + _policy_lines(mp, kw) + [_call(root_expr(t), kw), *_async_unshard_lines(t)])


def _nested_lines(t: Tree, c: str, extra_kwargs: str, drop: tuple[str, ...],
                  mp: Optional[dict] = None) -> tuple[list[str], list[str]]:
    """The run's units inside container ``c``'s blocks (not blocks themselves), each sharded before its block:
    (lines before the blocks' loop, lines inside it). The same submodule a unit in every block (each layer's
    ``mlp.experts``): one line in the loop, ``fully_shard(block.mlp.experts, ...)``; otherwise each by name."""
    rel: dict[tuple[str, str], list[str]] = {}  # (path inside its block, options) -> blocks
    conts = t.containers()
    for u in t.non_root():
        if len(u.modules) != 1:
            continue
        m = u.modules[0]
        blk = block_of(m)
        if blk is None or blk == m or container_of(m, conts) != c:
            continue
        rel.setdefault((m[len(blk) + 1:], _merge(_unit_kwargs(u, mp=mp), extra_kwargs, drop)), []).append(blk)
    n_blocks = len(conts.get(c, []))
    before, inside = [], []
    for (path, kw), blks in rel.items():
        if len(blks) == n_blocks and len(set(blks)) == n_blocks:
            inside.append("    " + _call(module_expr(path, root="block"), kw, indent=4))
        else:
            before += [_call(module_expr(f"{b}.{path}"), kw) for b in blks]
    # said once: on each of GPT-2's four Conv1D units a block read "a unit of its own, as in your run" four times
    # (a new-user trial)
    # (above the call: after it, a Mixtral's "    fully_shard(block.mlp.experts, mesh=mesh)  # a unit of its own, as
    # in your run" read 82 columns, past the 80 the JSON and HTML show a fix in: a new-user trial)
    if inside:
        inside.insert(0, f"    # {'each ' if len(inside) > 1 else ''}a unit of its own, as in your run")
    return before, inside


def _call(expr: str, kw: str, indent: int = 0, width: int = 80) -> str:
    """``fully_shard(expr, mesh=mesh, ...)``, its options on continuation lines past ``width`` columns."""
    one = f"fully_shard({expr}, mesh=mesh{kw})"
    if indent + len(one) <= width:
        return one
    pad = " " * (indent + len("fully_shard("))
    if expr.startswith("[") and indent + len(f"fully_shard({expr}, mesh=mesh") > width:  # a group: a module a line
        # (BERT's three embeddings' group read 130 columns)
        expr = "[" + f",\n{pad} ".join(expr[1:-1].split(", ")) + "]"
    return f"fully_shard({expr}, mesh=mesh" + "".join(f",\n{pad}{p}" for p in kw.split(", ") if p) + ")"


@dataclass(frozen=True)
class LeftoverCosts:
    """The run's figures a plan weighs a module of the root's against where the root stays gathered for tied modules
    anyway (``leftover_stays``): ``peak_bytes``, the step's peak (None: the root's own bytes stand for it, which the
    peak holds, so a share of them is at most overstated); ``step_ms`` and ``call_ms``, the step and one
    collective's cost in this run (None: the collectives are not weighed)."""
    peak_bytes: Optional[int] = None
    step_ms: Optional[float] = None
    call_ms: Optional[float] = None


class Stays(str):
    """``leftover_stays``' reason, a clause, with its parts apart (``parts``: the gathered bytes, their share, what
    the share is of, and the rest: the collectives' cost or the threshold), by which several modules' reasons with
    the same cost are said once (wrap.params_in_root's quiet reason named the cost of Whisper's six small modules six
    times, 20 lines of ``--explain``)."""

    parts: tuple[str, str, str, str]

    def __new__(cls, parts: tuple[str, str, str, str]):
        nbytes, share, of, rest = parts
        obj = super().__new__(cls, f"would free at most {nbytes}, {share} of {of}{rest}")
        obj.parts = parts
        return obj


def leftover_stays(root, nbytes: int, trailing: bool, costs: Optional[LeftoverCosts] = None) -> str:
    """Why modules of the root's holding ``nbytes`` of parameters (their stored dtype) stay in a root that is gathered
    for tied modules anyway, "" where a unit of their own gains more than it costs (thresholds
    LEFTOVER_PEAK_SHARE_PER_STEP_SHARE): it frees at most their gathered copy, which the root held through the step,
    and adds its collectives, an all-gather in forward, one in backward unless it is the trailing unit (kept gathered
    after forward) and a reduce-scatter where the root trains, each at the run's ``costs.call_ms``. (A 512 B norm's
    unit cost Gemma3 19.3 ms of exposed all-gather a step on gloo; GPT-2's wpe, given a unit of its own because it
    held more than 1% of the tied modules' bytes, the plan's rule until then, 6.3 ms of exposed reduce-scatter a
    step for at most its 64 KiB: new-user trials.)"""
    stored = root.sharded_bytes * (root.shard_size or 0)  # the root's parameters, stored dtype, padding aside
    gathered = int(nbytes * root.unsharded_bytes / stored) if stored > 0 and root.unsharded_bytes else nbytes
    c = costs or LeftoverCosts()
    held = sum(root.own_bytes or []) or nbytes  # without a peak: of the root's own bytes, which the peak holds
    gain = gathered / c.peak_bytes if c.peak_bytes else nbytes / held
    calls = (2 if trailing else 3) - (root.trainable_unsharded_bytes == 0)
    cost = calls * c.call_ms / c.step_ms if c.call_ms is not None and c.step_ms else None
    if gain >= T.MEMORY_ONLY_MIN_PEAK_SHARE and (cost is None or gain >= T.LEFTOVER_PEAK_SHARE_PER_STEP_SHARE * cost):
        return ""
    frees = (fmt_bytes(gathered), fmt_share(gain, 1, T.MEMORY_ONLY_MIN_PEAK_SHARE),
             f"the {fmt_bytes(c.peak_bytes)} peak" if c.peak_bytes else f"the root's {fmt_bytes(held)}")
    if cost is None or gain < T.MEMORY_ONLY_MIN_PEAK_SHARE and cost <= gain:
        return Stays((*frees, f" (worth it from {100 * T.MEMORY_ONLY_MIN_PEAK_SHARE:g}%)"))
    return Stays((*frees, f", for {calls} collectives a step of ~{c.call_ms:.1f} ms each, {fmt_share(cost, 1)} of "
                          f"the {c.step_ms:.1f} ms step"))


@dataclass
class _Leftovers:
    """The root's own modules as a plan groups them (``_leftover_groups``)."""
    lead: dict  # each leading unit (the module a tie kept the group out of, else its one module) -> its modules
    tail: list  # the trailing unit's modules
    small: list  # (modules, why) of each group that stays in the root (``leftover_stays``)
    skip: list  # tied modules: they stay in the root
    head_of: dict  # each module the plan moves -> the module it collapses to
    heads: dict  # each collapsed module -> [trailing, the group it joins]
    nbytes: object  # the bytes of collapsed modules, their stored dtype
    anyway: bool = False  # the root is gathered anyway: it keeps tied modules or parameters of its own


def _leftover_groups(t: Tree, root, in_block, costs: Optional[LeftoverCosts] = None) -> _Leftovers:
    """``_leftover_lines``' groups of the root's own modules."""
    own = [m for m in root.own_modules or [] if m]
    tied = set(root.tied_modules or [])
    trailing = set(root.trailing_modules or [])
    if not trailing and t.non_root() and getattr(root, "leading_modules", None) is None:
        # recorded before leading_modules: that recorder left trailing_modules empty exactly where no own module
        # came before the root's last nested unit, so all of them come after it (the final norm and head of a
        # root whose embedding was a unit: a new-user trial's plan called them "a new unit before the blocks")
        trailing = set(own)
    if not trailing:  # a whole-model unit: its own modules in module order, the blocks' among them
        last = max((i for i, m in enumerate(own) if in_block(m)), default=None)
        trailing = set(own[last + 1:]) if last is not None else set()
    busy = [m for u in t.non_root() for m in u.modules] + [c for c in t.containers()]
    inside = lambda names, cand: any(b == cand or b.startswith(cand + ".") for b in names)  # noqa: E731
    # a module with no forward of its own is no unit (fully_shard refuses a ModuleList: diffusers' UNet's
    # mid_block.attentions, a new-user trial's pasted plan raised ValueError): what it holds collapses below it
    no_fwd = set(getattr(root, "no_forward_modules", None) or [])

    def top(m: str) -> tuple[str, str]:
        """(the module ``m`` collapses to, the ancestor a tied module kept it out of, else "")."""
        parts, kept_out = m.split("."), ""
        for i in range(1, len(parts)):
            cand = ".".join(parts[:i])
            if inside(busy, cand) or cand in no_fwd:
                continue
            if not inside(tied, cand):
                return cand, ""
            kept_out = cand
        return m, kept_out
    heads: dict[str, list] = {}  # collapsed module -> [trailing, the group it joins]
    head_of: dict[str, str] = {}  # each module the plan moves -> the module it collapses to
    for m in own:
        if in_block(m) or m in tied:
            continue
        h, group = top(m)
        head_of[m] = h
        tr = heads.get(h, [True])[0] and m in trailing
        heads[h] = [tr, group]
    lead: dict[str, list[str]] = {}  # each leading unit: its modules
    for h, (tr, group) in heads.items():
        if not tr:
            lead.setdefault(group or h, []).append(h)
    tail = [h for h, (tr, _) in heads.items() if tr]
    skip = [m for m in own if m in tied and not in_block(m)]
    sizes = dict(zip(root.own_modules or [], root.own_bytes or []))
    nbytes = lambda hs: sum(sizes.get(m, 0) for m, h in head_of.items() if h in hs)  # noqa: E731
    # the root stays gathered for the tied modules anyway: a group whose unit would free less than it costs stays
    # there (Gemma3's final model.norm: 19.3 ms of exposed all-gather a step on gloo; T5's encoder.final_layer_norm,
    # 256 B between the two stacks: 1.50 ms forward + 0.74 ms backward of a 54.2 ms step, pasted; GPT-2's wpe: 6.3 ms
    # of exposed reduce-scatter for at most 64 KiB; new-user trials)
    groups = [hs for hs in [*lead.values(), tail] if hs and sizes]
    anyway = bool(skip or sizes.get(""))  # the root is gathered for its tied modules or its own parameters anyway
    if anyway:
        small = [(hs, w) for hs in groups if (w := leftover_stays(root, nbytes(hs), hs is tail, costs))]
    elif not any(sizes.values()):  # (sizes not recorded)
        small = []
    else:
        # a root left with no parameters has no collectives: what stays there brings them back, an all-gather and a
        # reduce-scatter a step, against each unit's three. Two groups or more stay where each, and all of them
        # together, would free less than MEMORY_ONLY_MIN_PEAK_SHARE of the peak, whatever the collectives cost (a
        # new-user trial's Llava: its vision tower's embeddings, its two norms and its projector made four units of
        # 0.4% of the peak or less, 12 collectives a step)
        mem = LeftoverCosts(peak_bytes=(costs or LeftoverCosts()).peak_bytes)
        few = [hs for hs in groups if leftover_stays(root, nbytes(hs), hs is tail, mem)]
        why = leftover_stays(root, sum(map(nbytes, few)), False, mem)
        small = [(hs, why) for hs in few] if len(few) > 1 and why else []
    stay = [h for hs, _ in small for h in hs]
    return _Leftovers({g: hs for g, hs in lead.items() if hs[0] not in stay}, [h for h in tail if h not in stay], small,
                      skip, head_of, heads, nbytes, anyway)


def kept_in_root(t: Tree, costs: Optional[LeftoverCosts] = None) -> tuple[list[tuple[list[str], str]], dict]:
    """The groups of the root's own modules (tied ones aside) that ``shard_plan(t, root_leftovers=True,
    leftover_costs=costs)`` keeps in the root, each (its modules, why: ``leftover_stays``), [] where it makes units
    of them all; and the module each of the root's modules collapses to in the plan (``model.vision_tower.embeddings``
    for its ``patch_embedding``), by which words name them as the plan does."""
    g = leftover_groups(t, costs)
    if g is None:
        return [], {}
    return [([m for m, h in g.head_of.items() if h in hs], why) for hs, why in g.small], g.head_of


def leftover_groups(t: Tree, costs: Optional[LeftoverCosts] = None) -> Optional["_Leftovers"]:
    """The root's own modules as ``shard_plan(t, root_leftovers=True, leftover_costs=costs)`` groups them (each
    leading unit, the trailing one, those kept in the root and why, the tied ones); None without a root."""
    root, conts = t.root(), t.containers()
    if root is None:
        return None
    return _leftover_groups(t, root, lambda m: any(in_container(m, c, conts) for c in conts), costs)


def as_planned(mods: Iterable[str], conts: dict, head_of: dict) -> list[str]:
    """The root's modules named as the plans name them, once each: a block by its container ("each block of
    model.layers"), any other module by the one it collapses to (``kept_in_root``'s map)."""
    return list(dict.fromkeys(f"each block of {module_expr(c)}" if (c := container_of(m, conts)) is not None
                              else module_expr(head_of.get(m, m)) for m in mods))


def _leftover_lines(t: Tree, root, in_block, kw: str, lead_raf=None,
                    costs: Optional[LeftoverCosts] = None, groups: Optional["_Leftovers"] = None) -> list[str]:
    """fully_shard for the modules holding the root's own parameters, each collapsed to its outermost ancestor
    that holds no unit and no tied module (``stem`` for ``stem.0``, ``stem.1``; ``model.embed_tokens`` under a
    ``model`` that holds the blocks); those after the last block (the final norm and head) grouped and kept
    gathered after forward as torchtitan does: they run last in forward and first in backward. Tied modules stay
    in the root, alone: what a tie kept from collapsing into a common ancestor (BERT's position and token-type
    embeddings and their LayerNorm beside the word embeddings tied to the MLM decoder) is one unit, grouped.
    ``lead_raf``: the run's units' reshard_after_forward where all had the same one other than FSDP's default,
    which the leading units take: a comment above them says so, and where they are. Where the root keeps tied
    modules, a group whose unit gains less than it costs (``leftover_stays``, from the run's ``costs``) stays there,
    and a comment says why; where it keeps none (nor parameters of its own), two groups or more stay where each and
    all of them together would free under MEMORY_ONLY_MIN_PEAK_SHARE of the peak (``_leftover_groups``)."""
    g = groups or _leftover_groups(t, root, in_block, costs)  # (``groups``: the caller's, computed already)
    lead, tail, small, head_of, heads, nbytes = g.lead, g.tail, g.small, g.head_of, g.heads, g.nbytes
    stay, skip = [h for hs, _ in small for h in hs], g.skip
    # what stays in the root alone: tied modules, and modules read outside their forward (read_outside_forward)
    outside = set(getattr(root, "read_outside_modules", None) or [])
    tied, unread = [m for m in skip if m not in outside], [m for m in skip if m in outside]
    said = ", ".join(module_expr(h) for h in stay)  # (as the code names them: a Llava's model.model.vision_tower...)
    lines = _lead_note(t, root, [m for m, h in head_of.items() if not heads[h][0] and h not in stay], len(lead),
                       lead_raf) if lead and lead_raf is not None else []
    lines += [_call(group_expr(mods), kw) for mods in lead.values()]
    if small:  # said once, with the largest group's figures
        big, why = max(small, key=lambda g: nbytes(g[0]))
        one = len(stay) == 1
        if g.anyway:
            lines += comment(f"{said} {'stays' if one else 'stay'} in the root with "
                             + ("the tied modules: " if tied else "modules read outside their forward: " if unread
                                else "its own parameters: ")
                             + (f"{'a unit of its' if one else 'units of their'} own {why}" if len(small) == 1 else
                                "units of their own gain less than they cost: the largest"
                                + (f", {module_expr(big[0])}," if len(big) == 1 else
                                   f" group ({', '.join(module_expr(h) for h in big)})") + f" {why}"))
        else:  # (_leftover_groups: all of them together)
            lines += comment(f"{said} stay in the root, which then has an all-gather and a reduce-scatter "
                             f"a step of its own: each a unit, {len(small)} units would add {3 * len(small)} "
                             f"collectives, and one unit of them all {why}")
    if tail:
        lines += ["# last in forward, first in backward: one unit, kept gathered after forward",
                  _call(group_expr(tail), _merge(kw, ", reshard_after_forward=False"))]
    if tied:
        lines += comment(f"{', '.join(module_expr(m) for m in sorted(tied))} share a parameter (tied weights): "
                         "they stay in the root")
    if unread:
        one = len(unread) == 1
        lines += comment(f"{', '.join(module_expr(m) for m in sorted(unread))}: the run read "
                         f"{'its' if one else 'their'} parameters outside {'its' if one else 'their'} forward (or "
                         f"never ran it), where a unit of {'its' if one else 'their'} own would not be gathered: "
                         f"{'it stays' if one else 'they stay'} in the root")
    return lines


def _lead_note(t: Tree, root, own: list[str], units: int, raf) -> list[str]:
    """The comment above a plan's ``units`` new leading units (of the root's modules ``own``, before its last unit)
    where the run's units all passed ``reshard_after_forward=raf`` and these take FSDP's default: where they are,
    before the first unit (the blocks, where it is one), between units, or both (runs before ``leading_modules``
    did not record it: "below")."""
    leading = getattr(root, "leading_modules", None)
    first = t.non_root()[0]
    first_words = ("the blocks" if container_of((first.modules or [first.name])[0], t.containers()) is not None
                   else f"your first unit ({unit_label(first.name)})")
    where = ("below" if leading is None else f"before {first_words}" if all(m in leading for m in own)
             else "between your units" if not any(m in leading for m in own) else "before and between your units")
    say = (f"{'the' if leading is None else 'a'} new unit {where} reshards" if units == 1 else
           f"the new units {where} reshard")
    return textwrap.wrap(f"{say} after forward, FSDP's default (your units pass reshard_after_forward={raf}); the "
                         "predicted peak assumes it", width=80, initial_indent="# ", subsequent_indent="# ")


# ---------------------------------------------------------------------------------------------- checkpointing
_APPLY_CKPT = ("from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (\n"
               "    apply_activation_checkpointing, checkpoint_wrapper)\n")


def checkpoint_modules(names: list[str], note: str, kv_cache: bool = True, then: str = "") -> str:
    """Activation checkpointing on exactly the named modules (fqns, checkpoint wrappers' own names dropped), on
    the unsharded model; ``then``: lines after it that read its list ``names`` (switches_off_inside's); ``kv_cache``:
    with no_kv_cache's lines, last (a Hugging Face config under the model has use_cache on, or may: not recorded)."""
    names = list(dict.fromkeys(strip_ckpt(n) for n in names))
    return (_APPLY_CKPT + f"# {BEFORE_SHARDING} (before fully_shard): {note}\n"
            + name_list("names", names) + "\n"
            "targets = {model.get_submodule(name) for name in names}\n"
            "apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,\n"
            "                               check_fn=lambda m: m in targets)"
            + ("\n" + then if then else "") + ("\n" + _NO_KV_CACHE if kv_cache else ""))


def checkpoint_in_place(names: list[str], note: str, kv_cache: bool = True) -> str:
    """Activation checkpointing on exactly the named modules (fqns, checkpoint wrappers' own names dropped; the
    root, which a wrapper cannot replace in place, left out), on the sharded model: each replaced where it is by a
    CheckpointWrapper around it, a unit or inside one (checkpoint_wrapper around a sharded unit works: FSDP's
    pre-backward gathers its parameters before the recompute; tests/test_ac_fix_where_wrapped.py's "after" shape).
    After the user's fully_shard calls a loop that wraps each block's children and shards the block in the same pass
    has run: before them (``checkpoint_modules``), the loop set its children's wrappers on the blocks' wrappers,
    where nothing calls them, nested them inside, or, checking its blocks' type, found none and sharded none
    (tests/test_ac_granularity_fix_where_wrapped.py)."""
    names = [n for n in dict.fromkeys(strip_ckpt(n) for n in names) if n]
    return "\n".join(
        ["from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (", "    checkpoint_wrapper)"]
        + comment(f"{note}: after your fully_shard calls (and the lines above), each wrapped where it is, around "
                  "its unit")
        + ["# (or wrap these, not their children, where you call checkpoint_wrapper)",
           name_list("blocks", names), "for name in blocks:",
           "    parent, _, child = name.rpartition('.')",
           "    holder = model.get_submodule(parent)",
           "    setattr(holder, child, checkpoint_wrapper(getattr(holder, child)))",
           *([_NO_KV_CACHE] if kv_cache else [])])


# a Hugging Face model fills its KV cache in a training forward where use_cache is on (T5's decoder): a recomputed
# block then finds it filled, saves other tensors and checkpoint raises; gradient_checkpointing_enable() turns it off
# (its comment on lines of its own: as trailing comments past 80 columns the terminal split it around the code, a
# new-user trial)
def no_kv_cache(root: str = ROOT) -> str:
    """use_cache off on every Hugging Face config under ``root`` (the model as the fix names it)."""
    return ("# Hugging Face configs: no KV cache under checkpointing\n"
            "# (transformers' own checkpointing turns it off too)\n"
            f"for module in {root}.modules():\n"
            "    if getattr(getattr(module, 'config', None), 'use_cache', False):\n"
            "        module.config.use_cache = False")


_NO_KV_CACHE = no_kv_cache()


def full_checkpointing(wrappers: list[str]) -> str:
    """Full activation checkpointing in place of a selective policy on the named CheckpointWrappers (fqns): each
    one's checkpoint function without its ``context_fn`` (torch's CheckpointWrapper calls ``self.checkpoint_fn``, a
    partial holding the keyword arguments it was built with, torch 2.6 to 2.15); on the model sharded or not (the
    wrappers are the same modules)."""
    return "\n".join([
        "import functools",
        "# full activation checkpointing in place of the selective policy: each wrapper's checkpoint",
        "# without its context_fn (or leave context_fn= out where you call checkpoint_wrapper)",
        name_list("wrappers", wrappers), "for name in wrappers:", "    wrapper = model.get_submodule(name)",
        "    fn = wrapper.checkpoint_fn",
        "    kw = {k: v for k, v in fn.keywords.items() if k != 'context_fn'}",
        "    wrapper.checkpoint_fn = functools.partial(fn.func, *fn.args, **kw)"])


def switches_off_inside(var: str, note: str) -> str:
    """The checkpointing switches (``gradient_checkpointing`` on) of every module inside the modules whose fqns the
    snippet's list ``var`` holds off (the list printed before, by checkpoint_modules: its ``names``): diffusers'
    blocks and transformer models checkpoint their resnets and transformer blocks while it is on
    (``enable_gradient_checkpointing()`` sets it on each), so a block checkpointed whole would re-run them inside its
    own re-run, nested (ac.nested's case); the model's other modules keep theirs. On the model sharded or not, a
    block wrapped or not (a CheckpointWrapper's modules hold the block's)."""
    return "\n".join([*comment(f"checkpointing off {note}: their own modules' switches (diffusers' blocks and "
                                "transformer models, gradient_checkpointing)"),
                       "# (your own checkpoint(...) calls in their forward: remove them in your code)",
                       f"for name in {var}:", "    for sub in model.get_submodule(name).modules():",
                       "        if getattr(sub, 'gradient_checkpointing', None) is True:",
                       "            sub.gradient_checkpointing = False"])


def checkpoint_flags_off(layers: list[str], note: str) -> str:
    """Activation checkpointing off on the named modules (fqns) by their own ``gradient_checkpointing`` flag
    (transformers' layers, UnitConfig.checkpoint_flag), the model's other layers left checkpointing; on the model
    sharded or not (the flag is the module's own attribute)."""
    return "\n".join([*comment(f"activation checkpointing off {note} (transformers' layers checkpoint themselves "
                              "while their own flag, gradient_checkpointing, is on)"), name_list("layers", layers),
                      "for name in layers:", "    model.get_submodule(name).gradient_checkpointing = False"])


#: what a CheckpointWrapper calls in place of its checkpoint once ac.unneeded's (ac.fewer_units', ...) fix turns it
#: off: the module as it is; torch builds ``checkpoint_fn`` as a functools.partial of its checkpoint, and the recorder
#: reads a wrapper holding a plain function there as not checkpointing (record/units.py ``wrapper_off``)
NO_CHECKPOINT_FN = "without_checkpoint"


def remove_checkpointing(wrappers: list[str], functional: list[str], note: str = "", header: str = "") -> str:
    """Activation checkpointing off: every CheckpointWrapper (fqns) left in place, calling the module it wraps as it
    is (its ``checkpoint_fn``, torch 2.6 to 2.15; one already unwrapped is left as it is), on the model sharded or
    not: after the user's checkpoint_wrapper and fully_shard calls, where every wrapper exists, however they were
    made. (Replaced by its module before fully_shard, the old fix did nothing where a loop wraps and shards each
    layer in turn, the wrappers made after it: a new-user trial; after fully_shard, a wrapper that is itself the
    unit cannot be replaced: its module's parameters stay sharded outside any unit, "mixed torch.Tensor and
    DTensor".) Units checkpointed by ``checkpoint(...)`` calls in code (``functional``): Hugging Face's
    ``gradient_checkpointing_enable()`` is undone by its ``gradient_checkpointing_disable()`` (diffusers'
    ``enable_gradient_checkpointing()`` by ``disable_gradient_checkpointing()``, timm's
    ``set_grad_checkpointing()`` by ``set_grad_checkpointing(False)``), other
    ``checkpoint(...)`` calls are named in a comment, since only their code can change; alone, the lines go before
    the user's fully_shard calls, beside the enable call. ``note``: the header's words where checkpointing stays on
    elsewhere (ac.wrong_granularity's, on the blocks' children: checkpoint_in_place wraps the blocks next, after
    the same calls). ``header``: the wrappers' lines headed by these words alone (wrapped to 70 columns: the lines
    also go inside a Trainer callback's method)."""
    if wrappers and header:
        lines = textwrap.wrap(header, width=70, initial_indent="# ", subsequent_indent="# ")
    elif wrappers:
        lines = textwrap.wrap("activation checkpointing off" + (f" {note}" if note else "") + ": after your "
                              "checkpoint_wrapper (apply_activation_checkpointing) and fully_shard calls, where "
                              "every wrapper exists (a loop that wraps and shards each layer makes them there); "
                              "each wrapper stays, calling its module as it is", width=80, initial_indent="# ",
                              subsequent_indent="# ")
        lines.append("# (or leave out your checkpoint_wrapper calls" + (" for these)" if note else ")"))
    else:
        # (a header over 80 columns wrapped: ac.fewer_units' read 111; "apply_activation_checkpointing" named to a run
        # with checkpoint(...) calls only, which never called it: new-user trials)
        # (the header its own line: "...: activation checkpointing off" read 84 columns, "# off" alone below it)
        lines = [f"# {BEFORE_SHARDING}, before fully_shard:",
                 *textwrap.wrap("activation checkpointing off" + (f" {note}" if note else ""), width=80,
                                initial_indent="# ", subsequent_indent="# ")]
        lines.append("# (or leave out your checkpoint(...) calls, or the call that enables it)" if not wrappers
                     else "# (or build the model without apply_activation_checkpointing)" if not note else
                     "# (or leave these out of your apply_activation_checkpointing)")
    if functional:
        lines += ["# checkpointed by checkpoint(...) calls in their forward:",
                  textwrap.fill(", ".join(n or "(root)" for n in functional), width=80, initial_indent="#   ",
                                subsequent_indent="#   ", break_long_words=False, break_on_hyphens=False),
                  *model_switch_off(ROOT),
                  "# (your own checkpoint(...) calls: remove them in your code)"]
    if wrappers:
        lines += [f"def {NO_CHECKPOINT_FN}(function, *args, **kwargs):",
                  "    return function(*args, **kwargs)  # in place of checkpoint(function, ...)",
                  "",
                  "",
                  # ('': the model itself, wrapped)
                  name_list("wrappers", wrappers), "for name in wrappers:",
                  "    wrapper = model.get_submodule(name)",
                  "    if hasattr(wrapper, 'checkpoint_fn'):  # (a wrapper still: not unwrapped)",
                  f"        wrapper.checkpoint_fn = {NO_CHECKPOINT_FN}"]
    return "\n".join(lines)


def model_switch_off(model: str) -> list[str]:
    """The lines that turn off a model's own checkpointing switch (``model``: its expression) by its own method,
    whichever library's it is."""
    # (diffusers' models name it the other way round: transformers' names alone found no method on a
    # UNet2DConditionModel, and the pasted fix left its checkpointing on, a new-user trial)
    # (and timm's set_grad_checkpointing(): the others' names found nothing on a timm ViT, whose
    # pasted fix left its checkpointing on, a new-user trial)
    return ["# a Hugging Face model's (transformers' activation_checkpointing_enable(),",
            "# gradient_checkpointing_enable() before 5.25; diffusers'",
            "# enable_gradient_checkpointing()) or a timm model's (set_grad_checkpointing()):",
            "# turned off by its own method (transformers' newer name, its older, diffusers')",
            f"off = (getattr({model}, 'activation_checkpointing_disable', None)",
            f"       or getattr({model}, 'gradient_checkpointing_disable', None)",
            f"       or getattr({model}, 'disable_gradient_checkpointing', None))",
            "if off is not None:",
            "    off()",
            f"elif hasattr({model}, 'set_grad_checkpointing'):  # timm's",
            f"    {model}.set_grad_checkpointing(False)"]


def unit_list(t: Tree, var: str = "units") -> str:
    """``units = [...]``: every non-root unit of the run (the first module of a grouped unit, which is an
    FSDPModule too), in forward order, on the sharded model."""
    labels = t.unit_labels()
    mods = [members(n)[0] for n in labels]
    short = f"{var} = [" + ", ".join(module_expr(m) for m in mods) + "]"
    if len(short) <= 80:
        return "# every FSDP unit, in forward order\n" + short
    return ("# every FSDP unit, in forward order\n" + name_list("unit_names", mods) + "\n"
            f"{var} = [model.get_submodule(name) for name in unit_names]")


def _inside(a: str, b: str) -> bool:
    """Whether unit ``a``'s modules are nested in unit ``b``'s (labels)."""
    return any(x.startswith(y + ".") for x in members(a) for y in members(b) if y)


def _trains(t: Tree, name: str, order: list[str]) -> bool:
    """Whether a unit, or a unit nested in it, has trainable parameters (unknown: it has)."""
    by = {u.name: u for u in t.units}
    return any(getattr(by.get(n), "trainable_unsharded_bytes", 1) != 0 for n in order
               if n == name or _inside(n, name))


def never_ran(ctx) -> set[str]:
    """The units no steady step ran, where the report timed others (an MoE expert no token reached: its rows say
    "—"), less those the doctor cannot time (compiled in place: they ran unseen)."""
    rows = getattr(ctx.report, "units", None) or []
    if not any(getattr(r, "timing_p50", None) for r in rows):
        return set()
    return {r.name for r in rows if not r.is_root and not getattr(r, "timing_p50", None)
            and not getattr(r, "compiled_in_place", False)}


def gather_order(t: Tree, skip: Iterable[str] = ()) -> tuple[list[str], list[str], bool]:
    """(forward, backward, recorded): the non-root units in the order FSDP2 gathers them, each list in the order
    the units' pre-forward (pre-backward) hooks run: as the run recorded them (``Tree.forward``/``backward``), else
    the tree's order (snapshot, a trace's first forward) with the backward derived as FSDP2 runs it, in reverse
    post-forward order (a block before the units nested in it), less the frozen units before the first that
    trains (their outputs need no gradient: FSDP2 never gathers them in backward). In such orders the unit after
    another is never one it is nested in (gathered already). ``skip``: units left out (the units that did not run
    in every step, absent from a recorded order: with them in, the recorded order read as none)."""
    skip = set(skip)
    labels = [n for n in t.unit_labels() if n not in skip]
    known = set(labels)
    recorded = bool(labels) and known <= set(t.forward)
    fwd = [n for n in t.forward if n in known] if recorded else labels
    if recorded and t.backward is not None:
        return fwd, [n for n in t.backward if n in known], True
    post: list[str] = []
    stack: list[str] = []
    for n in fwd:  # pre-order -> post-order: a unit's post-forward after those nested in it
        while stack and not _inside(n, stack[-1]):
            post.append(stack.pop())
        stack.append(n)
    post += stack[::-1]
    first = next((i for i, n in enumerate(fwd) if _trains(t, n, fwd)), len(fwd))
    return fwd, [n for n in post[::-1] if n not in fwd[:first]], recorded


def _wrapped(head: str, items: list[str], width: int = 80) -> str:
    """``head[a, b, ...]`` wrapped to ``width`` columns."""
    if not items:
        return head + "[]"

    def fill(w: int) -> str:
        return textwrap.fill(", ".join(items), width=w, initial_indent=head + "[",
                             subsequent_indent=" " * (len(head) + 1), break_long_words=False,
                             break_on_hyphens=False) + "]"

    out = fill(width)
    # (the closing bracket counted: ac.wrong_granularity's "blocks = [...]" on the ResNet read 81 columns)
    return out if len(out.splitlines()[-1]) <= width else fill(width - 1)


def _block_run(t: Tree, labels: list[str], i: int):
    """The labels from ``i`` on that run over every block of one container, in order or reversed, each block with
    the same units inside it: ((container, reversed, paths inside a block), end), else None."""
    conts = t.containers()

    def split(n: str):  # (container, block index, path inside the block) of the unit's first module
        fqn = members(n)[0]
        m = _IDX.match(fqn)
        c = container_of(fqn, conts)
        return (m.group(1) or "", int(m.group(2)), fqn[m.end(2) + 1:]) if c is not None else None

    first = split(labels[i])
    if first is None:
        return None
    blocks: list[tuple[int, list[str]]] = []
    j = i
    while j < len(labels) and (s := split(labels[j])) is not None and s[0] == first[0]:
        if not blocks or blocks[-1][0] != s[1]:
            blocks.append((s[1], []))
        blocks[-1][1].append(s[2])
        j += 1
    idx, want = [b for b, _ in blocks], conts[strip_ckpt(first[0])]
    if idx not in (want, want[::-1]) or any(p != blocks[0][1] for _, p in blocks):
        return None
    return (first[0], idx != want, blocks[0][1]), j


def _order_lines(t: Tree, var: str, labels: list[str]) -> list[str]:
    """``var = [...]``: the units ``labels``, in that order, as modules of the sharded model (a grouped unit by its
    first module); a run over every block of a container (each with the same units inside it) as a loop."""
    lines: list[str] = []
    single: list[str] = []

    def flush():
        if single:
            lines.append(_wrapped(f"{var} {'+=' if lines else '='} ", single))
        single.clear()

    i = 0
    while i < len(labels):
        run = _block_run(t, labels, i)
        if run is None:
            single.append(module_expr(members(labels[i])[0]))
            i += 1
            continue
        (c, rev, paths), i = run
        flush()
        idx = t.containers()[strip_ckpt(c)]
        if paths == [""]:  # the blocks themselves
            rev_ = "[::-1]" if rev else ""
            lines.append(f"{var} {'+=' if lines else '='} {children_expr(c, idx, as_list=True)}{rev_}")
            continue
        blocks = f"reversed({children_expr(c, idx, as_list=True)})" if rev else children_expr(c, idx)
        lines += ([] if lines else [f"{var} = []"]) + [
            f"for block in {blocks}:",
            _wrapped(f"    {var} += ", [module_expr(p, root="block") if p else "block" for p in paths])]
    flush()
    return lines or [f"{var} = []"]


def prefetch_code(ctx, backward: bool = True) -> str:
    """Explicit prefetch, one unit ahead, over every unit of the run (on the sharded model), in the order FSDP2
    gathers them (``gather_order``): in forward each unit prefetches the one whose forward starts next, in
    backward the one whose backward starts next (a block's nested units after it; frozen units left out: the last
    unit that runs backward then prefetches itself, a no-op, since an empty list is FSDP's implicit prefetch, which
    would gather the frozen unit before it). The lists the run had set that the chain does not overwrite (the last
    unit's in forward, the last's in backward, the root's) are cleared (``_prefetch_resets``): pasted on top of
    lists set in the wrong order, the chain alone left them, and the all-gathers they add (a new-user trial: 10 per
    step where 9 are one per unit). "" where fewer than two units are not the root (every unit its own root:
    wrap.root_not_sharded's fix comes first)."""
    t = tree(ctx)
    if sum(1 for u in t.units if getattr(u, "is_root", False)) > 1:
        # several FSDP roots in the watched module (a wrapper holding a teacher and its student): one chain over all
        # their units prefetched the student's first block from the teacher's last, before the student's lazy
        # initialization, and the pasted code crashed training (a new-user trial); wrap.root_not_sharded first
        return ""
    # units that did not run in every step (an MoE expert no token reached, a dropped layer) stay out of the chains:
    # prefetched, each was gathered in the steps it did not run, for nothing (a new-user trial's per-expert units:
    # +59 KiB at the peak against "unchanged"); gathered when they run, as without a list. A unit no step ran has
    # no timing to count them in: a trial's never-routed expert stayed in, closing the chain over all 4 experts
    # (``model.moe.experts.children()``), gathered in every forward (+64.75 KiB at the peak, 14 blocked all-gathers
    # per step for 13)
    sometimes = {u.name for u in (getattr(ctx.report, "units", None) or [])
                 if getattr(getattr(u, "timing_p50", None), "not_run", 0)} | never_ran(ctx)
    fwd, bwd, recorded = gather_order(t, skip=sometimes)
    if len(fwd) < 2:  # no unit besides the root (or one): nothing to prefetch ahead of another; no code
        return ""
    how = "as your run ran them" if recorded else "module order"
    # (one text a line, however long: Rule.finding wraps each alone, units.fit_comments, never joining two)
    lines = [f"# FSDP units in forward order ({how}): each prefetches the next",
             *([f"# (not {len(sometimes)} unit(s) that did not run in every step: gathered when they run)"]
               if sometimes else []),
             *_order_lines(t, "forward_order", fwd)]
    if backward and bwd == fwd[::-1]:
        lines.append("backward_order = forward_order[::-1]  # backward starts them in reverse")
    elif backward:
        why = (["a block before the units nested in it"] if any(_inside(a, b) for a in fwd for b in fwd) else []) + (
            [f"not the {len(fwd) - len(bwd)} frozen unit(s) that never run it"] if len(bwd) < len(fwd) else [])
        lines += [f"# and in the order their backward starts ({'; '.join(why) or how})",
                  *_order_lines(t, "backward_order", bwd)]
        if bwd and len(bwd) < len(fwd):
            lines += ["# the last prefetches itself, gathered already: with no list FSDP's default would gather the "
                      "unit before it in forward, which never runs backward",
                      "backward_order.append(backward_order[-1])"]
    lines += ["for unit, nxt in zip(forward_order, forward_order[1:]):",
              "    unit.set_modules_to_forward_prefetch([nxt])"]
    if backward:
        lines += ["for unit, nxt in zip(backward_order, backward_order[1:]):",
                  "    unit.set_modules_to_backward_prefetch([nxt])"]
    # (with the frozen units' self-append every unit that runs backward is given a list by the chain)
    lines += _prefetch_resets(t, fwd, bwd if backward else None, appended=bool(bwd) and len(bwd) < len(fwd))
    return "\n".join(lines)


def prefetch_resets(t: Tree) -> dict[tuple[str, str], list[str]]:
    """The explicit prefetch lists the run had set that ``prefetch_code``'s chain does not overwrite:
    {("forward" | "backward", unit label): the list}. The chain sets every unit's forward list but the last's in
    forward order, and every backward list but the last's in backward order (none left where frozen units are
    left out: the last then prefetches itself); the root's it never sets. A backward list on a unit that never runs
    backward (a frozen unit before every trainable one) is never read: not listed."""
    fwd, bwd, _ = gather_order(t)
    if len(fwd) < 2:
        return {}
    return _unreached(t, fwd, bwd, appended=bool(bwd) and len(bwd) < len(fwd))


def _unreached(t: Tree, fwd: list[str], bwd: Optional[list[str]], appended: bool) -> dict[tuple[str, str], list[str]]:
    by = {u.name: u for u in t.units}
    out: dict[tuple[str, str], list[str]] = {}
    root = t.root()
    f_left = [fwd[-1]] + ([root.name] if root is not None else [])
    for name in f_left:
        got = list(getattr(by.get(name), "forward_prefetch", None) or [])
        if got:
            out[("forward", name)] = got
    if bwd is not None:
        b_left = ([bwd[-1]] if bwd and not appended else []) + ([root.name] if root is not None else [])
        for name in b_left:
            got = list(getattr(by.get(name), "backward_prefetch", None) or [])
            if got:
                out[("backward", name)] = got
    return out


def _prefetch_resets(t: Tree, fwd: list[str], bwd: Optional[list[str]], appended: bool) -> list[str]:
    """Lines clearing the lists ``_unreached`` finds (none where the run set none: a default run's chain is
    unchanged). In forward an empty list prefetches nothing (FSDP2 has no implicit forward prefetch); in backward
    an empty list is FSDP2's default (``FSDPState._pre_backward``: ``default_prefetch = len(...) == 0``), the unit
    before it in post-forward order: none for the last unit of backward, the first of forward, and for the root the
    last unit of forward, the first of backward: what the chain wants."""
    left = _unreached(t, fwd, bwd, appended)
    if not left:
        return []
    root = t.root()
    lines = ["# lists your run set that the chain does not reach, cleared: in forward an empty list prefetches",
             "# nothing; in backward it is FSDP's default (the unit before it in forward, none for the last)"]
    for (kind, name), got in left.items():
        if root is not None and name == root.name:
            who = ROOT
        elif kind == "forward":
            who = "forward_order[-1]"
        else:
            who = "backward_order[-1]"
        was = ", ".join(unit_label(n) for n in got)
        lines.append(f"{who}.set_modules_to_{kind}_prefetch([])  # was [{was}]")
    return lines


def backward_prefetch_lists(lists: dict[str, list[str]]) -> str:
    """An explicit backward prefetch list on each named unit of the sharded model ({unit: the units it is to
    prefetch}). An empty one names the unit itself: any non-empty list turns FSDP2's default backward prefetch off
    for that unit (``set_modules_to_backward_prefetch([])`` does not: an empty list means the default), and the unit
    is gathered already when its own pre-backward prefetches, so nothing is all-gathered."""
    lines = []
    for name, targets in lists.items():
        unit = module_expr(members(name)[0])
        if targets:
            listed = ", ".join(module_expr(members(t)[0]) for t in targets)
            line = f"{unit}.set_modules_to_backward_prefetch([{listed}])"
            if len(line) > 80:  # a unit a line (a Qwen2's read 90 columns)
                line = (f"{unit}.set_modules_to_backward_prefetch([\n    "
                        + ",\n    ".join(module_expr(members(t)[0]) for t in targets) + "])")
            lines.append(line)
        else:
            lines += [f"unit = {unit}", "# itself: gathered already, nothing to gather",
                      "unit.set_modules_to_backward_prefetch([unit])"]
    return "\n".join(lines)


def async_unshard_code() -> str:
    """Asynchronous unshard on every FSDP unit, the root included (private API, torch >= 2.4): on gloo the
    all-gathers then run on gloo's threads instead of blocking the host."""
    return ("from torch.distributed.fsdp import FSDPModule\n"
            "for module in model.modules():\n"
            "    if isinstance(module, FSDPModule):\n"
            "        module._set_unshard_async_op(True)")


def compile_code(t: Tree) -> str:
    """torch.compile, in place and after fully_shard (the FSDP hooks and module names stay), on every repeated
    block of every container (what torchtitan compiles); on every unit where the tree shows no container; the whole
    model where the run names no unit (a trace of DDP or of a single device: a list of units would be empty)."""
    conts = t.containers()
    if conts:
        return "\n".join(f"for block in {children_expr(c, idx)}:\n    block.compile()  # in place, after fully_shard"
                          for c, idx in conts.items())
    if not t.unit_labels():
        return ("# the run names no FSDP unit: the whole model, in place (torch >= 2.2);\n"
                "# on an FSDP2 model compile each repeated block after fully_shard instead,\n"
                "# so that the FSDP hooks stay between them\n"
                "model.compile()")
    return unit_list(t) + "\nfor unit in units:\n    unit.compile()  # in place, after fully_shard"


def recompile_limit_code(limits: dict[str, int], note: str) -> str:
    """Dynamo's recompile limits raised (``limits``: this torch's config names -> values, ``recompile_limit`` on 2.13,
    ``cache_size_limit`` on 2.6), set before the model's first forward: Dynamo reads them each time it compiles a
    frame, so the compiled-in-place modules keep a variant each instead of running eager past the limit."""
    return "\n".join(comment(note) + [f"torch._dynamo.config.{name} = {value}" for name, value in limits.items()])


def hf_layout(t: Tree) -> bool:
    """A Hugging Face decoder's tree: its blocks are ``model.layers.N`` (the base model under a task head such
    as ``lm_head``), the names a plain trace's units carry too."""
    return any(re.match(r"model\.layers\.\d+$", strip_ckpt(n)) for n in t.module_names() + t.labels())


def name_list(var: str, names: list[str], width: int = 80) -> str:
    """``var = ['a', 'b', ...]`` wrapped to ``width`` columns."""
    return _wrapped(f"{var} = ", [repr(n) for n in names], width)


def set_on_units(names: Iterable[str], call: str, loop_over: int = 6, width: int = 80) -> str:
    """``<module>.<call>`` on each named unit of the sharded model (a loop over their names past ``loop_over``), in
    ``width`` columns.
    A unit inside a CheckpointWrapper ("layers.0._checkpoint_wrapped_module": accelerate's plugin) is reached through
    the wrapper's place: the module inside it while wrapped, the unit itself once unwrapped (as an older ac.unneeded
    fix did: named inside the wrapper, that fix pasted beside this one raised AttributeError; named by the wrapper
    alone, the call went to the wrapper, which accelerate shards too, as a unit of no parameters: both new-user
    trials)."""
    mods = [members(n)[0] for n in names]
    if any(strip_ckpt(m) != m for m in mods):
        return units_loop([strip_ckpt(m) for m in mods], call, width=width, inside_wrapper=True)
    # (a loop too where a line would pass 80 columns: an HF layer's
    # "model.get_submodule('model.layers.1').set_reshard_after_forward(False, recurse=False)" read 85)
    if len(mods) > loop_over or any(len(f"{module_expr(m)}.{call}") > width for m in mods):
        return units_loop(mods, call, width=width)
    return "\n".join(f"{module_expr(m)}.{call}" for m in mods)


def units_loop(names: list[str], call: str, base: str = "model", width: int = 80,
               inside_wrapper: bool = False) -> str:
    """``<call>`` on each unit of ``base`` that ``names`` names, as a loop over the names wrapped to ``width``
    columns (``inside_wrapper``: each reached inside its CheckpointWrapper, where it has one)."""
    return (name_list("names", names, width) + f"\nfor name in names:\n    unit = {base}.get_submodule(name)\n"
            + ("    unit = getattr(unit, '_checkpoint_wrapped_module', unit)  # inside a checkpoint wrapper\n"
               if inside_wrapper else "")
            + f"    unit.{call}")


def repoint_optimizer() -> str:
    """The user's optimizer, built before sharding, pointed at the sharded parameters: each tensor it holds is
    named before the fully_shard calls (``SHARDING_GOES_HERE`` splits the two parts) and replaced by the
    parameter of that name after them. Its groups, hyper-parameters and any LR scheduler built on it are kept
    (rebuilding the optimizer from ``model.parameters()`` dropped the groups, weight-decay exclusions and
    per-group learning rates among them, and left a scheduler driving the old one). Names are matched without
    the wrappers' segments (checkpoint_wrapper's ``_checkpoint_wrapped_module.``, torch.compile's ``_orig_mod.``,
    FSDP1's ``_fsdp_wrapped_module.``): a user who checkpoint_wrapped each layer inside the pasted region got
    KeyError 'layers.0.attn_norm.weight', the name after it being 'layers.0._checkpoint_wrapped_module.
    attn_norm.weight' (a new-user trial)."""
    return ("\n".join(comment("before your fully_shard calls: the name of each parameter the optimizer holds, "
                             "without the wrappers' segments (checkpoint_wrapper, torch.compile) that the calls "
                             "may add")) + "\n"
            "def plain_name(name):\n"
            "    for seg in ('_checkpoint_wrapped_module.', '_orig_mod.',\n"
            "                '_fsdp_wrapped_module.'):\n"
            "        name = name.replace(seg, '')\n"
            "    return name\n"
            "param_names = {id(p): plain_name(name) for name, p in model.named_parameters()}\n"
            f"{SHARDING_GOES_HERE}\n"
            + "\n".join(comment("after them: the same optimizer (groups, hyper-parameters, LR scheduler) on the "
                               "sharded parameters")) + "\n"
            "sharded = {plain_name(name): p for name, p in model.named_parameters()}\n"
            "for group in optimizer.param_groups:\n"
            "    group['params'] = [sharded[param_names[id(p)]] if id(p) in param_names\n"
            "                       else p for p in group['params']]\n"
            "optimizer.state.clear()  # state of the old tensors, if it has stepped")


def fused_optimizer() -> str:
    """The user's optimizer (torch's Adam or AdamW, whose fused kernels DTensor runs) switched to its fused
    implementation, every group, before its first step: the flags its step reads from each group, and a step count
    restored from a checkpoint moved to the parameter's device (the fused step wants it there, as a tensor; the
    foreach one keeps it on the host)."""
    return ("\n".join(comment("after building the optimizer, before its first step: its fused implementation, one "
                              "kernel per update, no foreach intermediates")) + "\n"
            "for group in optimizer.param_groups:\n"
            "    group['foreach'], group['fused'] = False, True\n"
            "    for param in group['params']:  # a step count restored from a checkpoint\n"
            "        param_state = optimizer.state.get(param, {})\n"
            "        if torch.is_tensor(param_state.get('step')):\n"
            "            param_state['step'] = param_state['step'].to(param.device,\n"
            "                                                         torch.float32)")


def root_mesh(config=None) -> str:
    """The mesh the user's own units were sharded on, read from the sharded model (DTensor parameters); where their
    mesh has model-parallel dims beside FSDP's (``config``: RunConfig.mesh), FSDP's dims of it. Two lines, broken
    before the generator's condition: in one, with ``['dp']``, it ran past 80 columns, and code_width could break it
    only at the comma inside ``isinstance(p, DTensor)``."""
    return "mesh = next(p.device_mesh for p in model.parameters()\n            if isinstance(p, DTensor))" + (
        fsdp_submesh(config) if model_parallel(config) else "")


def model_parallel(config) -> bool:
    """Whether the run's parameters' mesh has dims beyond FSDP's (RunConfig.mesh: tensor parallelism), not only
    FSDP's own (a 2-D one: HSDP)."""
    return config is not None and len(getattr(config, "mesh", None) or {}) > (getattr(config, "fsdp_dims", 0) or 1)


def fsdp_submesh(config) -> str:
    """``["fsdp"]`` (``[("dp_replicate", "fsdp")]`` for HSDP): the FSDP dims of RunConfig.mesh, by name."""
    dims = list(config.mesh)[: config.fsdp_dims or 1]
    return f"[{dims[0]!r}]" if len(dims) == 1 else f"[{tuple(dims)!r}]"


#: the name a plan passes for the user's shard_placement_fn (Recommendation.inputs says what it is)
SHARD_PLACEMENT_FN = "shard_placement_fn"


def placement_input(config) -> str:
    """Where some unit's parameters are sharded on a dim other than 0 (a ``shard_placement_fn``), what a plan passing
    ``shard_placement_fn`` reads from the user's code; "" otherwise."""
    dims = sorted({d for u in (getattr(config, "units", None) or []) for d in (getattr(u, "shard_dims", None) or [])})
    if not dims:
        return ""
    return (f"the shard_placement_fn your fully_shard calls pass (your run shards parameters on dim "
            f"{', '.join(map(str, dims))})")


#: where a fix passes the user's FSDP mesh (``fully_shard(..., mesh=mesh)``): the name it passes
FSDP_MESH_USE = re.compile(r"(?<=\bmesh=)mesh\b")


def mesh_input(config) -> str:
    """Where the run's parameters' mesh has model-parallel dims beside FSDP's (RunConfig.mesh: tensor parallelism)
    or FSDP's mesh is 2-D (HSDP), what a fix using ``mesh`` reads from the user's code (``Recommendation.inputs``):
    their FSDP mesh (a 1-D one over all ranks would turn HSDP into FSDP over the world); so too where FSDP's 1-D mesh
    leaves ranks out (:func:`partial_mesh`); "" otherwise."""
    if config is None:
        return ""
    if not getattr(config, "mesh", None):
        return partial_mesh(config)
    if not model_parallel(config):
        return f"the mesh your fully_shard calls pass: your {fmt_mesh(config.mesh)} mesh (HSDP)"
    return f"the mesh your fully_shard calls pass: {fsdp_submesh(config)} of your {fmt_mesh(config.mesh)} mesh"


def partial_mesh(config) -> str:
    """Where FSDP's 1-D mesh spans some of the ranks only (``mesh2["shard"]`` of a 2-D mesh; a mesh from a group that
    leaves ranks out), that mesh, in words, for a fix that passes it: a mesh over all ranks in its place shards over
    all of them (a new-user trial's 2 x 2 mesh, ``mesh=mesh2["shard"]``: a pasted wrap fix sharded over 4 ranks and
    the losses changed); "" where it spans them all (or nothing says otherwise)."""
    parent, dim = getattr(config, "fsdp_mesh_parent", None) or {}, getattr(config, "fsdp_mesh_dim", "")
    world = getattr(config, "world_size", 0) or 0
    if parent:
        return (f"the mesh your fully_shard calls pass: {f'[{dim!r}]' if dim else 'a 1-D sub-mesh'} of your "
                f"{fmt_mesh(parent)} mesh")
    ranks = getattr(config, "world_ranks", None) or []
    if ranks:
        return f"the mesh your fully_shard calls pass: over ranks {', '.join(map(str, ranks))} of the process group"
    shard = max((u.shard_size for u in getattr(config, "units", None) or [] if u.shard_size), default=0)
    if 0 < shard < world:
        return f"the mesh your fully_shard calls pass: {shard} of the {world} ranks"
    return ""


#: optim.step_comm's fix for a per-parameter gradient-norm log (full_tensor() per parameter: a collective each, every
#: step): the same norms from the local shards, one all-reduce for all of them, every LOG_EVERY steps
GRAD_NORMS_CODE = """\
LOG_EVERY = 50  # optimizer steps between gradient-norm logs
# in place of your per-parameter norms: each gradient's squared norm from
# this rank's shard, one all-reduce for all of them
if step % LOG_EVERY == 0:
    world = dist.get_world_size()
    names, squares = [], []
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        # a whole gradient: the same on every rank
        grad, copies = param.grad, world
        # a shard of it, on each replica of the shard (HSDP)
        if isinstance(grad, DTensor):
            shards = math.prod(grad.device_mesh.size(i)
                               for i, pl in enumerate(grad.placements)
                               if pl.is_shard())
            grad, copies = grad.to_local(), world // shards
        names.append(name)
        squares.append(grad.detach().float().square().sum() / copies)
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend() == "nccl" else "cpu")
    total = torch.stack([x.to(device) for x in squares])
    dist.all_reduce(total)
    # name -> norm, as param.grad.full_tensor().norm()
    grad_norms = dict(zip(names, total.sqrt().tolist()))"""


def expandable_segments_code(conf: dict[str, str]) -> str:
    """The allocator setting for expandable segments, in each variable of ``conf`` (RunConfig.alloc_conf: the
    user's settings, kept) or in PYTORCH_CUDA_ALLOC_CONF when none is set; torch reads it when CUDA's allocator
    starts, so it goes before anything allocates CUDA memory."""
    lines = ["# at the top of your training script, before anything allocates CUDA memory",
             "# (or export the same in the environment that launches training)"]
    for name in [v for v in ALLOC_CONF_VARS if v in conf] or [ALLOC_CONF_VARS[0]]:
        kept = [t.strip() for t in conf.get(name, "").split(",")
                if t.strip() and not t.strip().lower().startswith("expandable_segments")]
        lines.append(assign(f"os.environ[{name!r}]", repr(','.join(kept + ['expandable_segments:True']))))
    return "\n".join(lines)


_REBINDS = re.compile(r"^\s*(model|optimizer)\s*=", re.M)
TRAINER_ELSEWHERE = (" Under the Trainer, which shards the model through accelerate's FSDP2 plugin and runs the loop "
                     "itself, this code is for a loop of your own: with the Trainer, make the same change through "
                     "its TrainingArguments or fsdp_config where they have the option.")


#: what a finding says when its lever is the user's data pipeline, which the doctor does not see
NO_PIPELINE_CODE = "The data pipeline is your code, which the doctor does not see: no code is offered."
#: ... when its lever is code of the user's loop (their metric reductions)
NO_LOOP_CODE = "They are your loop's code, which the doctor does not see: no code is offered."
#: ... and when its lever is the user's checkpoint save
NO_SAVE_CODE = "The save is your code, which the doctor does not see: no code is offered."
#: findings whose lever is a Trainer argument that train() reads when it builds what the argument sets (its
#: DataLoader): under a Trainer-driven run the fix sets it on trainer.args. Finding code -> (text, code)
#: (on a GPU: ``gpu``). Pinned memory only where there is a device to copy to (a new-user trial's CPU run read it)
TRAINER_ARGS_FIXES = {
    "jitter.data_wait": lambda gpu: (
        "Under the Trainer, which builds its DataLoader in train() from its arguments, set them on trainer.args "
        "before trainer.train() (or pass them to TrainingArguments); keep the workers within the CPU cores each "
        "rank has.",
        "trainer.args.dataloader_num_workers = 4  # batches made in background processes\n"
        + ("trainer.args.dataloader_pin_memory = True\n" if gpu else "")
        + "trainer.args.dataloader_persistent_workers = True\n"
        "trainer.args.dataloader_prefetch_factor = 4"),
}


#: what a fix on accelerate's FSDP2 plugin reads from the user's code (``Recommendation.inputs``), by where it goes:
#: on the Trainer's plugin ("trainer") or on the user's Accelerator's ("accelerate")
PLUGIN_INPUTS = {"trainer": {"trainer": "your transformers Trainer"},
                 "accelerate": {"accelerator": "your accelerate Accelerator"}}
TRAINER_INPUTS = PLUGIN_INPUTS["trainer"]
#: a loop fix's inputs in a loop of the user's own around accelerate's ``prepare``: what its names are there
PREPARED_INPUTS = {"is_last_micro_batch": "accelerator.sync_gradients inside `with accelerator.accumulate(model):` "
                                          "(True on the micro-batch whose backward precedes optimizer.step())"}
_PLUGIN = {"trainer": ("trainer.accelerator.state.fsdp_plugin", "trainer.train()",
                       "in your TrainingArguments: fsdp_config={{..., 'activation_checkpointing': {on}}}"),
           "accelerate": ("accelerator.state.fsdp_plugin", "accelerator.prepare(model)",
                          "FullyShardedDataParallelPlugin(..., activation_checkpointing={on})")}


def plugin_says(lever: str) -> tuple[str, str]:
    """(how a finding's text names the setting's owner, the call that applies it) for a ``lever``."""
    return ({"trainer": "Under the Trainer", "accelerate": "With accelerate's FSDP2 plugin"}[lever],
            _PLUGIN[lever][1])


def plugin_checkpointing(on: bool, lever: str, plugin: bool = True, hf: bool = False, kv_cache: bool = True) -> str:
    """Activation checkpointing on or off where accelerate's FSDP2 plugin sharded the model (``lever``: "trainer",
    set on the built Trainer before ``trainer.train()``; "accelerate", on the user's Accelerator before
    ``accelerator.prepare(model)``), which reads the settings as it prepares the model: FSDP's own (the plugin's
    ``activation_checkpointing``: it wraps each layer it shards in a CheckpointWrapper; what transformers advises
    under FSDP) when ``plugin``, and under the Trainer Hugging Face's (the ``activation_checkpointing`` training
    argument, named ``gradient_checkpointing`` before transformers 5, and turned off, the model's own switch too) when
    ``hf``; ``kv_cache``: with no_kv_cache's lines (a Hugging Face config under the model has use_cache on, or may:
    not recorded)."""
    holder, prepares, option = _PLUGIN[lever]
    lines = []
    if plugin:
        lines += [f"# FSDP's own checkpointing, which {prepares} applies as it shards the model",
                  f"# (or {option.format(on=on)})",
                  f"{holder}.activation_checkpointing = {on}"]
        # (the plugin's wrapper, unlike gradient_checkpointing_enable(), leaves use_cache on: each recompute appended
        # its keys and values again to the cache the output holds; a new-user trial's Qwen2 under accelerate peaked at
        # 18.83 MiB against 16.29 MiB predicted, 16.30 MiB with the cache off)
        if on and kv_cache:
            lines += no_kv_cache("trainer.model" if lever == "trainer" else ROOT).splitlines()
    if hf and lever == "trainer":
        lines += [*comment("Hugging Face's, which trainer.train() applies from its arguments "
                           "(activation_checkpointing; gradient_checkpointing before transformers 5)"),
                  "for name in ('activation_checkpointing', 'gradient_checkpointing'):",
                  "    if hasattr(trainer.args, name):",
                  f"        setattr(trainer.args, name, {on})"]
        # off: the model's own switch too, which the user's code may have turned on before building the Trainer (the
        # Trainer turns it on from its arguments, never off: a new-user trial's ModernBERT, its
        # gradient_checkpointing_enable() called on the model, pasted the argument lines alone and checkpointed on)
        if not on:
            lines += ["# and the model's own switch, where your code turned it on",
                      *model_switch_off("trainer.model")]
    return "\n".join(lines)


def plugin_wrap(lever: str, classes: list[str]) -> str:
    """accelerate's FSDP2 plugin wrapping each block whole (its transformer-based policy over the blocks' class
    names ``classes``: the model's _no_split_modules), in place of the policy that cut the run's units (size-based,
    or none), set where ``lever`` says (plugin_checkpointing)."""
    holder, prepares, _ = _PLUGIN[lever]
    option = ({"trainer": ["in your TrainingArguments, without min_num_params:",
                           "#   fsdp_config={..., 'auto_wrap_policy': 'TRANSFORMER_BASED_WRAP',",
                           f"#                'transformer_layer_cls_to_wrap': {classes!r}}})"],
               "accelerate": ["FullyShardedDataParallelPlugin(..., auto_wrap_policy='transformer_based_wrap',",
                              f"#   transformer_cls_names_to_wrap={classes!r}))"]}[lever])
    return "\n".join(["from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy", "",
                      f"# each block a unit of its own, by class, as {prepares} shards the model",
                      f"# (or {option[0]}", *option[1:],
                      assign(f"{holder}.auto_wrap_policy", "transformer_auto_wrap_policy"),
                      assign(f"{holder}.transformer_cls_names_to_wrap", repr(classes))])


def plugin_leftovers(t: Tree, lever: str, costs: Optional[LeftoverCosts] = None) -> str:
    """Where accelerate's FSDP2 plugin sharded the model and its policy matched every block, the root's other modules
    that gain as units of their own (a Qwen2.5-VL's vision merger, between its two block stacks), each sharded by the
    user before the plugin shards the model, with the root's options: ``prepare()`` leaves a module already sharded as
    it is and shards the rest around it (its policy, then the input embedding and the final norm and head it carves,
    then the root). Set where ``lever`` says (plugin_checkpointing); a plan of every fully_shard call (shard_plan)
    would take the plugin's sharding from it, and the user has no fully_shard calls to replace."""
    root = t.root()
    conts = t.containers()
    mp = _policy_vars(t.units)
    in_block = lambda m: any(in_container(m, c, conts) for c in conts)  # noqa: E731
    g = _leftover_groups(t, root, in_block, costs)
    lines = _leftover_lines(t, root, in_block, _unit_kwargs(root, inherit=True, mp=mp), None, costs, g)
    _, prepares, _ = _PLUGIN[lever]
    if (getattr(root, "param_dtype", None) or "float32") != "float32" and "float32" in (root.orig_dtypes or []):
        # under the plugin's mixed precision prepare() upcasts trainable parameters to float32 before it shards, but
        # not a module's already sharded: pasted on a model loaded in bfloat16, its sharded parameters stayed bfloat16
        # under float32 ones and AdamW's first step raised "expected dtype c10::BFloat16" (a new-user trial)
        mods = [*(m for ms in g.lead.values() for m in ms), *g.tail]
        lines = ["# in float32, as prepare() keeps trainable parameters under mixed precision (a",
                 "# model loaded in bfloat16 is upcast there; a module sharded first is not)",
                 _wrapped("for module in ", [module_expr(m) for m in mods], 79) + ":",
                 "    for param in module.parameters():",
                 "        if param.requires_grad and param.dtype != torch.float32:",
                 "            param.data = param.data.float()", *lines] if mods else lines
    # (the Trainer builds its optimizer in train(), after this)
    head = comment(f"the root's modules as units of their own; {prepares} then shards the rest around them (a module "
                   "already sharded keeps its unit)" + ("; before you build the optimizer, which must hold their "
                                                        "sharded parameters" if lever == "accelerate" else ""))
    code = "\n".join([*head, *lines])
    code = "\n".join([*_policy_lines(mp, code), code])
    return "\n".join(renamed(code, {ROOT: "trainer.model"})) if lever == "trainer" else code


def plugin_offload(lever: str, on: bool) -> str:
    """accelerate's FSDP2 plugin sharding with CPU offload (pinned host memory) or without, set where ``lever`` says
    (plugin_checkpointing): ``prepare()`` passes the plugin's ``cpu_offload`` to fully_shard as its offload_policy."""
    holder, prepares, _ = _PLUGIN[lever]
    option = {"trainer": f"in your TrainingArguments: fsdp_config={{..., 'cpu_offload': {on}}}",
              "accelerate": f"FullyShardedDataParallelPlugin(..., cpu_offload={on})"}[lever]
    policy = "CPUOffloadPolicy(pin_memory=True)" if on else "OffloadPolicy()"
    line = assign(f"{holder}.cpu_offload", policy)
    return "\n".join([*([] if on else ["from torch.distributed.fsdp import OffloadPolicy", ""]),
                      f"# the offload policy {prepares} shards the model with",
                      f"# (or {option})",
                      *([] if on else ["# none: the state stays on the device"]), line])


def plugin_mp_policy(mp_line: str, lever: str) -> str:
    """The mixed-precision policy accelerate's FSDP2 plugin shards with (accelerate makes it from the
    mixed_precision setting, the Trainer's bf16/fp16, reducing in that dtype; TrainingArguments have no option
    for it), set where ``lever`` says (plugin_checkpointing): ``mp_line`` assigns ``MP``."""
    holder, prepares, _ = _PLUGIN[lever]
    return (f"{mp_line}\n"
            f"# the policy {prepares} shards the model with (accelerate made it from mixed_precision)\n"
            f"{holder}.mixed_precision_policy = {MP}")


#: torchtitan's job-config settings a fix changes, by the torchtitan version (major, minor) whose command line
#: takes them: setting -> value -> (the argument of its command line, the same set in a config_registry function
#: on the Trainer.Config it returns). 0.3 parses its command line with tyro: activation checkpointing is a
#: subcommand (last on the line), a flag is --section.key with dashes. A version not here gets the fix in words.
TITAN_SETTINGS = {
    (0, 3): {
        "activation_checkpoint": {
            "none": ("activation-checkpoint:none", "config.activation_checkpoint = None"),
            "full": ("activation-checkpoint:full", "from torchtitan.distributed.activation_checkpoint import FullAC\n"
                                                   "config.activation_checkpoint = FullAC.Config()"),
        },
        "fsdp_reshard_after_forward": {
            v: (f"--parallelism.fsdp-reshard-after-forward {v}", f"config.parallelism.fsdp_reshard_after_forward = "
                                                                 f"{v!r}") for v in ("never", "always", "default")},
        "enable_cpu_offload": {
            True: ("--training.enable-cpu-offload", "config.training.enable_cpu_offload = True"),
            False: ("--training.no-enable-cpu-offload", "config.training.enable_cpu_offload = False"),
        },
        # (any count: its ChunkedLossWrapper's; a setting whose values are numbers is a function of the value)
        "loss_num_chunks": lambda n: (f"--loss.num-chunks {n}", f"config.loss.num_chunks = {n}"),
        "optimizer_implementation": {
            "fused": ("--optimizer.implementation fused", "config.optimizer.implementation = 'fused'")},
    },
}


def titan_table(tables: dict, version: str) -> Optional[dict]:
    """The entry of a table by torchtitan version (major, minor) for ``version`` ("0.3.0"); None where the table
    does not know it (or the version does not parse)."""
    try:
        return tables.get(tuple(int(x) for x in version.split(".")[:2]))
    except ValueError:
        return None


def titan_settings(version: str, **settings) -> Optional[str]:
    """torchtitan's job-config ``settings`` (TITAN_SETTINGS' names and values) as its ``version``'s command line
    takes them, with the same in a config_registry function in comments; None where the table does not know
    that version (or a setting of it)."""
    table = titan_table(TITAN_SETTINGS, version)
    try:
        args = [table[k](v) if callable(table[k]) else table[k][v] for k, v in settings.items()]
    except (KeyError, TypeError):  # (a setting the table lacks; no table for that version)
        return None
    flags = [a for a, _ in args if a.startswith("--")] + [a for a, _ in args if not a.startswith("--")]
    return "\n".join([_titan_line(f"torchtitan {version}") + "in place of the same settings (after",
                      "# --module/--config; a subcommand, activation-checkpoint:..., last: one only)",
                      " ".join(flags),
                      "# or set it in your config_registry function, on the Trainer.Config it returns:",
                      *(f"#   {ln}" for _, py in args for ln in py.splitlines())])


def _titan_line(said: str) -> str:
    """The head of a fix that is torchtitan's command line (within 80 columns: a new-user trial's read 114)."""
    return f"# {said}: on the command line that runs fsdp_doctor.titan or\n# torchtitan.train, "


def titan_says(version: str) -> str:
    """How a finding's text names where torchtitan's setting lives."""
    return f"torchtitan{' ' + version if version else ''} sharded this model from its job config"


#: what torchtitan's own Trainer (python -m fsdp_doctor.titan) takes where a fix acts on its built model or
#: optimizers, by torchtitan version (major, minor): the ModelSpec field of a function it calls once the model is
#: sharded and the optimizers built (its args), and the command-line levers of findings whose lever is the loop the
#: Trainer runs (finding code -> (text, command line, words the finding's text must hold for it: one branch of the
#: rule)). A version not here gets the fix in words.
TITAN_TRAINER = {
    (0, 3): {
        "hook": "post_optimizer_build_fn",
        # jitter.gc's collections between steps: the Trainer's own (GarbageCollection: the collector off, a
        # collection every gc_freq steps, every step under gc_debug)
        "gc": "--training.gc-freq {every} --training.no-gc-debug",
        "levers": {
            "memory.grads_kept": (
                "torchtitan's train step zeroes the gradients in place (set_to_none=False) while its CUDA graphs are "
                "on, which replay into gradients at fixed addresses; this run captured none (the doctor watches "
                "torchtitan only without them), so turning them off frees the gradients between steps and costs "
                "nothing here.",
                "--training.disable-cuda-graphs"),
            "jitter.data_wait": (
                "torchtitan's Trainer builds its DataLoader from the job config: load the batches in background "
                "processes with its dataloader settings (keep the workers within the CPU cores each rank has).",
                "--dataloader.num-workers 4 --dataloader.persistent-workers --dataloader.pin-memory "
                "--dataloader.prefetch-factor 4"),
            # (the loop's metric reductions: its --metrics.log-freq; the optimizer's own collectives have none)
            "optim.step_comm": (
                "torchtitan's Trainer reduces its logged metrics (the loss's sum and maximum, the tokens seen) over "
                "the ranks on every step it logs: log every 10 steps.",
                "--metrics.log-freq 10", NO_LOOP_CODE),
            # (saves made synchronously: the rule's words for them; asynchronous ones already: how often, its own)
            "checkpoint.blocking": (
                "torchtitan saves with torch.distributed.checkpoint: its async mode copies the state to host memory "
                "and writes it from a background thread (async_with_pinned_mem copies a GPU's state into pinned "
                "memory, faster).",
                "--checkpoint.async-mode async", "Save asynchronously"),
        },
    },
}
#: what a fix that torchtitan's Trainer gives no place for adds
TITAN_TRAINER_ELSEWHERE = (" torchtitan's Trainer runs the loop and its parallelize function shards the model, so "
                           "this code has no place in your command line: make the change in a parallelize function "
                           "of your own (ModelSpec.parallelize_fn) or a Trainer subclass (its train_step).")


#: what jitter.gc's fix adds under torchtitan's Trainer
TITAN_GC = (" torchtitan's Trainer turns the collector off at its start and collects between steps itself, every "
            "training.gc_freq steps (50 by default; every step under training.gc_debug).")


def launch_env(code: str) -> str:
    """A fix that sets environment variables in Python (``os.environ[NAME] = VALUE``, as expandable_segments_code
    writes it) as the shell lines that export them where torchrun is started."""
    names = {}
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Assign) and isinstance(t := node.targets[0], ast.Subscript) \
                and ast.unparse(t.value) == "os.environ" and isinstance(node.value, ast.Constant):
            names[ast.literal_eval(t.slice)] = node.value.value
    return "\n".join(["# in the environment of the processes torchrun starts: your launch script, before torchrun",
                      *(f"export {k}={shlex.quote(v)}" for k, v in names.items())])


def titan_command_line(version: str, flags: str) -> str:
    """A fix that is flags of torchtitan's command line (``Recommendation.where`` "torchtitan")."""
    said = f"torchtitan {version}" if version else "torchtitan"
    return f"{_titan_line(said)}after --module/--config\n{flags}"


def for_titan_trainer(rec, finding: str, version: str) -> None:
    """A fix of a run torchtitan's own Trainer drove (``Recommendation``, changed in place). A finding whose lever
    the job config has (TITAN_TRAINER's levers) gets its command line; a fix for the sharded model or its optimizers
    becomes a function torchtitan calls once it built them, set in the user's config_registry function (the model's
    own such function, a mixture of experts' load balancing, still runs first); a command line stays as it is; any
    other fix (one that rebinds the model or the optimizer, replaces the sharding or edits the loop) says where such
    a change goes. A setting the process reads at its start is its launch's environment (launch_env)."""
    table = titan_table(TITAN_TRAINER, version)
    said = f"torchtitan {version}" if version else "torchtitan"
    lever = table["levers"].get(finding) if table is not None else None
    if lever is not None and all(said_ in rec.text for said_ in lever[2:]):  # (a lever for one branch: its words)
        text, flags = lever[:2]
        for words in (NO_PIPELINE_CODE, NO_SAVE_CODE, NO_LOOP_CODE):
            rec.text = rec.text.replace(words, "")
        rec.text = re.sub(r" {2,}", " ", f"{rec.text.rstrip()} {text}")
        rec.code, rec.where, rec.inputs = titan_command_line(version, flags), "torchtitan", {}
        return
    if not rec.code or rec.where in ("torchtitan", "evaluation"):
        return
    if rec.where == "startup":  # the environment torchrun gives the Trainer's processes
        rec.code, rec.where = launch_env(rec.code), "launch_env"
        rec.text += (f" {said}'s Trainer runs in the processes torchrun starts: set it in their environment, as "
                     "torchtitan's run_train.sh does (PYTORCH_ALLOC_CONF=\"expandable_segments:True\").")
        return
    if (gc_fix := gc_parts(rec.code)) is not None and table is not None:  # jitter.gc's: the Trainer collects itself
        rec.text += TITAN_GC
        if not gc_fix[0]:  # its period alone: the Trainer's
            rec.code, rec.where = titan_command_line(version, table["gc"].format(every=gc_fix[1])), "torchtitan"
            return
        rec.code = complete("\n".join(gc_fix[0]), define_mesh=False)  # set-up frozen, in the hook below
    # (a setting of the process, ``model``: the hook runs before the first forward)
    if table is None or rec.where not in ("sharded", "optimizer", "model") or _REBINDS.search(rec.code):
        rec.text += TITAN_TRAINER_ELSEWHERE
        return
    hook = table["hook"]
    imports, code = _imports_apart(rec.code)
    body = textwrap.indent(code, " " * 4)
    rec.code = ("".join(f"{ln}\n" for ln in imports) + ("\n\n" if imports else "")
                + f"# {said} calls this once it has sharded the model and built its optimizers\n"
                "def doctor_fix(optimizers, model_parts, parallel_dims,\n"
                f"               previous=config.model_spec.{hook}):\n"
                "    if previous is not None:  # the model's own (a mixture of experts' load balancing)\n"
                "        previous(optimizers, model_parts, parallel_dims)\n"
                "    model, optimizer = model_parts[0], optimizers\n"
                f"{body}\n\n\n"
                f"config.model_spec.{hook} = doctor_fix")
    rec.where = "titan_registry"
    rec.inputs = {"config": "the Trainer.Config your config_registry function returns (the --module/--config you run)"}


#: OLMo-core's names where a fix goes into a run its Trainer drove: the train module it built (the model and the
#: optimizer it holds) and the config the user builds it from (``Recommendation.inputs``)
OLMO_NAMES = {ROOT: "train_module.model", "optimizer": "train_module.optim"}
OLMO_CONFIG_INPUT = {"train_module_config": "your TransformerTrainModuleConfig, before its build(model) (config."
                                            "train_module in OLMo-core's example scripts)"}
#: what a fix's text adds where it goes on the built train module (place "olmo_built")
OLMO_BUILT = (" OLMo-core's train module shards the model and builds the optimizer when it is built: the lines go "
              "after train_module = train_module_config.build(model), before trainer.fit(), where the model is "
              "train_module.model and the optimizer train_module.optim.")
#: ... and where OLMo-core has no place for it (its loop is its train module's train_batch, its sharding its
#: Transformer.apply_fsdp)
OLMO_ELSEWHERE = (" OLMo-core's train module runs the loop (its train_batch) and shards the model (Transformer."
                  "apply_fsdp, from TransformerDataParallelConfig): this code has no place in your configs; make the "
                  "change in a subclass of the train module or of the model.")


def _olmo_setting(head: str, lines: list[str], override: str) -> str:
    """A fix that is settings of the user's train-module config, with their command-line form for OLMo-core's
    example scripts (which merge ``--key=value`` overrides into their config)."""
    return "\n".join([*comment(f"{head}: set on your train module's config before train_module_config.build(model) "
                               f"(in OLMo-core's example scripts, {override} on the command line)"), *lines])


def _to_config(rec, code: str, text: str) -> None:
    """``rec`` made a setting of the user's train-module config (place "olmo_config"): its code, its input, and
    ``text`` said after the finding's own."""
    rec.code, rec.where, rec.inputs = code, "olmo_config", dict(OLMO_CONFIG_INPUT)
    rec.text += text


def olmo_prefetch() -> str:
    """prefetch.exposed_allgather's fix as OLMo-core's setting: Transformer.apply_fsdp sets each block to prefetch
    the next ``prefetch_factor`` blocks in forward (the last block the LM head), from its data-parallel config."""
    return _olmo_setting("each block prefetches the next in forward",
                         ["train_module_config.dp_config.prefetch_factor = 1"],
                         "--train_module.dp_config.prefetch_factor=1")


#: the head of a loop fix run before each micro-batch by OLMo-core's train module, which runs each inside its
#: _train_microbatch_context (on FSDP it sets only set_is_last_backward there: every micro-batch reduce-scatters and
#: reshards). The method it wraps is bound as a default, so that two such fixes pasted one after the other nest.
_OLMO_MICRO_BATCH = """\
import contextlib

# OLMo-core's train module runs each micro-batch inside this method of its own
# (private; OLMo-core 3.0.0): wrapped, the lines run before each micro-batch
@contextlib.contextmanager
def before_micro_batch(micro_batch_idx, num_micro_batches,
                       inner=train_module._train_microbatch_context):
    is_last_micro_batch = micro_batch_idx == num_micro_batches - 1
{body}
    with inner(micro_batch_idx, num_micro_batches):
        yield


train_module._train_microbatch_context = before_micro_batch"""
_MODEL_CALL = re.compile(rf"^{ROOT}\.\w+\(.*\)$")


def olmo_micro_batch(code: str) -> Optional[str]:
    """A loop fix keyed to the last micro-batch (its lines calls on the model, before each micro-batch's backward)
    run where OLMo-core's train module starts each micro-batch; None for any other code."""
    lines = [ln for ln in code.splitlines() if ln.strip()]
    if not any(_MODEL_CALL.match(ln) for ln in lines) or not all(
            _MODEL_CALL.match(ln) or ln.startswith("#") for ln in lines):
        return None
    return complete(_OLMO_MICRO_BATCH.format(body=textwrap.indent("\n".join(renamed(code, OLMO_NAMES)), " " * 4)))


#: OLMo-core's wrapping strategies (TransformerDataParallelConfig.wrapping_strategy) that shard each block as one unit,
#: by the modules its Transformer.apply_fsdp shards beside them and the root (untied embeddings: a tied pair stays in
#: the root under every strategy), the fewest first; "fine_grained" also shards modules inside each block
OLMO_STRATEGIES = {"blocks": {"model.embeddings"},
                   "full": {"model.embeddings", "model.embedding_norm", "model.lm_head"}}
_SHARDED = re.compile(r"\bfully_shard\(\s*([\w.]+)")
_EACH_BLOCK = re.compile(r"^for (\w+) in model\.blocks\.(?:children|values)\(\):$", re.M)


def olmo_strategy(plan: str) -> Optional[str]:
    """The wrapping strategy of OLMo-core's that shards the model as a sharding ``plan`` does (its fully_shard
    calls: each block in a loop over ``model.blocks``, the embedding and some of the modules beside the blocks, the
    root last), or None where none does (a module the strategies never shard, a block's part, a block left out)."""
    loops = set(_EACH_BLOCK.findall(plan))
    named = set(_SHARDED.findall(plan)) - loops
    if len(loops) != 1 or ROOT not in named:
        return None
    named.discard(ROOT)
    return next((k for k, mods in OLMO_STRATEGIES.items() if "model.embeddings" in named <= mods), None)


def olmo_wrapping(strategy: str) -> str:
    """A wrapping strategy of OLMo-core's as its train module's setting."""
    return _olmo_setting(f"OLMo-core's '{strategy}' wrapping",
                         [f"train_module_config.dp_config.wrapping_strategy = '{strategy}'"],
                         f"--train_module.dp_config.wrapping_strategy={strategy}")


def _olmo_ac(rec, finding: str, t: Tree) -> bool:
    """ac.recommended's fix (the modules it checkpoints: its ``names``, ``blocks`` where it wraps them in place) or
    ac.unneeded's (the checkpoint wrappers it turns off), as OLMo-core's ac_config over the modules the run
    checkpointed (``t``'s wrapped modules) and those: True where it made it so."""
    wrapped = sorted({m.split(_CKPT)[0] for m in t.module_names() if _CKPT in m})
    conts = t.containers()
    blocks = [m for u in t.non_root() for m in map(strip_ckpt, u.modules) if container_of(m, conts) is not None
              and block_of(m) == m]
    if finding == "ac.recommended" and (names := _listed(rec.code, "names") or _listed(rec.code, "blocks")):
        modules, said = sorted(set(wrapped) | {strip_ckpt(n) for n in names}), "checkpoints"
    elif finding == "ac.unneeded" and (wrappers := _listed(rec.code, "wrappers")) is not None:
        modules = [m for m in wrapped if m not in wrappers]
        said = "checkpoints" if modules else "turns off checkpointing of"
    else:
        return False
    _to_config(rec, complete(olmo_checkpointing(modules, blocks), define_mesh=False),
               f" OLMo-core's train module {said} the modules its ac_config names before it shards the model: the "
               "setting replaces your train module's ac_config.")
    return True


def _listed(code: str, var: str) -> Optional[list[str]]:
    """The strings of the list a snippet assigns to ``var`` (``names = ['blocks.0', ...]``), None where it has none."""
    try:
        tree_ = ast.parse(code)
    except SyntaxError:
        return None
    for node in ast.walk(tree_):
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == [var]:
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                return None
            return [str(v) for v in value] if isinstance(value, list) else None
    return None


def olmo_checkpointing(modules: list[str], blocks: list[str]) -> str:
    """Activation checkpointing on exactly ``modules`` (fqns in the model) as OLMo-core's setting, which wraps them
    before sharding: every block (``blocks``) is its "full" mode, any other set its "selected_modules" (fnmatch
    patterns: each name matches itself only); none, its ac_config off."""
    if not modules:
        return _olmo_setting("activation checkpointing off", ["train_module_config.ac_config = None"],
                             "--train_module.ac_config=null")
    if set(modules) == set(blocks):
        args, said, head = "mode='full'", "{mode: full}", "every block"
    else:
        args = f"mode='selected_modules',\n    modules={modules!r}"
        said, head = f"{{mode: selected_modules, modules: [{', '.join(modules)}]}}", ", ".join(modules)
    return _olmo_setting(f"activation checkpointing on {head}",
                         ["from olmo_core.train.train_module import (",
                          "    TransformerActivationCheckpointingConfig)",
                          f"train_module_config.ac_config = TransformerActivationCheckpointingConfig(\n    {args})"],
                         f"--train_module.ac_config='{said}'")


#: what checkpoint.blocking's text adds where OLMo-core's Trainer saved
OLMO_CHECKPOINTER = (" OLMo-core's Trainer saves from its checkpointer callback (CheckpointerCallback: save_interval, "
                     "ephemeral_save_interval, save_async), which the lines set on the built Trainer.")


def olmo_checkpointer(every: Optional[int]) -> str:
    """checkpoint.blocking's fix on OLMo-core's built Trainer: its checkpointer callback saving at most every
    ``every`` steps (its permanent and ephemeral intervals), or (``every`` None) asynchronously."""
    if every is None:
        head, body = "OLMo-core's checkpointer: asynchronous saves", ["        callback.save_async = True"]
    else:
        head = f"OLMo-core's checkpointer: a save every {every} steps at the most often"
        body = [f"        callback.save_interval = max(callback.save_interval, {every})",
                "        if callback.ephemeral_save_interval:",
                "            callback.ephemeral_save_interval = max(",
                f"                callback.ephemeral_save_interval, {every})"]
    return "\n".join(["from olmo_core.train.callbacks import CheckpointerCallback", "", f"# {head}",
                      "for callback in trainer.callbacks.values():",
                      "    if isinstance(callback, CheckpointerCallback):", *body])  # (completed by the finding)


_POLICY_DTYPE = re.compile(r"\bparam_dtype=torch\.(\w+)")
#: the fixes that set a dtype of the train module's FSDP policy (TransformerDataParallelConfig's param_dtype and
#: reduce_dtype, OLMo-core's DType): finding -> (the setting's lines, its command line), by the dtype the fix's
#: policy gathers in
OLMO_DTYPES = {
    "numerics.reduce_dtype": lambda dt: (["train_module_config.dp_config.reduce_dtype = DType.float32"],
                                         "--train_module.dp_config.reduce_dtype=float32"),
    # (its autocast_precision kept, as the rule's own fix keeps the user's autocast: nothing left for its matmuls to
    # cast, the operators it runs in float32 as before)
    "precision.autocast_fp32_params": lambda dt: ([f"train_module_config.dp_config.param_dtype = DType.{dt}"],
                                                  f"--train_module.dp_config.param_dtype={dt}"),
}


def for_olmo(rec, finding: str, optimizer: str = "", t: Optional[Tree] = None) -> None:
    """A fix of a run OLMo-core's Trainer drove (``Recommendation``, changed in place; ``optimizer``: the recorded
    optimizer's class; ``t``: the run's module tree). A new-user trial (OLMo-core 3.0.0's olmo2 model, 2 gloo
    ranks) read ``model.set_requires_gradient_sync(is_last_micro_batch)`` "in your training loop", where the
    train module runs the loop, and code "after your fully_shard calls", which its Transformer.apply_fsdp makes.
    A fix that is a setting of the train module's config becomes it (the forward prefetch, the wrapping strategy,
    the checkpointed modules); a loop fix keyed to the last micro-batch wraps the train module's micro-batch
    context; a fix for the sharded model or its optimizer goes after the train module is built, where they are
    train_module.model and train_module.optim (the fused optimizer's and compiled blocks' also name its config's
    setting); any other (a plan no strategy makes, another loop edit) says where such a change goes."""
    if finding == "prefetch.exposed_allgather" and "set_modules_to_forward_prefetch" in rec.code:
        _to_config(rec, olmo_prefetch(), " OLMo-core's Transformer.apply_fsdp sets the forward prefetch from your "
                   "data-parallel config's prefetch_factor (each block the next, the last block the LM head); "
                   "backward keeps FSDP2's own prefetch.")
        return
    if finding == "optim.unfused_step" and optimizer in ("Adam", "AdamW"):  # (its config's word beside the code)
        rec.text += (f" OLMo-core builds the optimizer from your train module's config: fused=True on its "
                     f"{optimizer}Config does the same from the start (--train_module.optim.fused=true on the "
                     "command line of OLMo-core's example scripts).")
    if finding in OLMO_DTYPES and (dt := _POLICY_DTYPE.search(rec.code)):  # (its policy's line: the dtype)
        lines, override = OLMO_DTYPES[finding](dt.group(1))
        code = _olmo_setting("the train module's FSDP policy", ["from olmo_core.config import DType", *lines], override)
        _to_config(rec, complete(code, define_mesh=False), " OLMo-core's Transformer.apply_fsdp makes the policy from "
                   "your data-parallel config (param_dtype, reduce_dtype).")
        return
    if finding == "kernels.launch_bound" and ".compile()" in rec.code:  # (its config's word beside the code)
        rec.text += (" OLMo-core compiles each block and the LM head itself, before sharding, with compile_model=True "
                     "on your train module's config (--train_module.compile_model=true).")
    if t is not None and _olmo_ac(rec, finding, t):
        return
    # (a wrapping rule's plan: another's, a mixed-precision policy's, changes more than the units)
    if finding.startswith("wrap.") and rec.where == "unsharded" and (strategy := olmo_strategy(rec.code)):
        _to_config(rec, olmo_wrapping(strategy), f" OLMo-core's Transformer.apply_fsdp shards the model from your "
                   f"data-parallel config: its '{strategy}' wrapping strategy makes these units.")
        return
    if LAST_MICRO_BATCH in rec.inputs and (code := olmo_micro_batch(rec.code)) is not None:
        rec.code, rec.where, rec.inputs = code, "olmo_built", {}
        rec.text += (" OLMo-core's train module runs the micro-batches of each step in its train_batch and has no "
                     "setting for this: the lines wrap its micro-batch context (a private method of OLMo-core's, "
                     "checked on 3.0.0) after train_module = train_module_config.build(model), before trainer.fit().")
        return
    if not rec.code or rec.where in ("olmo_config", "olmo_built", "olmo_trainer", "evaluation", "startup"):
        return
    if rec.where in ("sharded", "optimizer", "model") and not _REBINDS.search(rec.code):
        rec.code = "\n".join(renamed(calls_words(rec.code, OLMO_CALLS), OLMO_NAMES))
        rec.where = "olmo_built"
        rec.text += OLMO_BUILT
        return
    rec.text += OLMO_ELSEWHERE


def lacks_reshard_switch(config) -> bool:
    """This run's torch has no ``FSDPModule.set_reshard_after_forward`` (torch 2.6): a fix that calls it on the
    sharded model raises AttributeError when pasted (a new-user trial on torch 2.6); its lever is the
    ``reshard_after_forward`` argument of the units' fully_shard calls, said in words."""
    return SET_RESHARD_AFTER_FORWARD in (getattr(config, "torch_lacks", None) or [])


def reshard_in_calls_words(names: Iterable[str], value: bool) -> str:
    """What a fix switching ``reshard_after_forward`` says instead of its code on a torch without the switch."""
    mods = [unit_label(n) for n in names]
    shown = ", ".join(mods[:8]) + (f" and {len(mods) - 8} more" if len(mods) > 8 else "")
    return (f" This torch's FSDPModule has no set_reshard_after_forward (torch 2.7 added it): pass "
            f"reshard_after_forward={value} to the fully_shard calls of {shown} instead (a newer torch can switch it "
            "on the sharded model).")


#: the words of a fix for the sharded model that name the user's fully_shard calls (reshard.zero2_affordable's,
#: reshard.last_unit's)
RESHARD_IN_CALLS = "# or pass reshard_after_forward=False to their fully_shard calls"
RESHARD_IN_CALL = "(or pass reshard_after_forward=False to its fully_shard call)"
#: what they say where accelerate's FSDP2 plugin made the fully_shard calls (a Trainer's or the user's prepare(): "their
#: fully_shard calls" read in a Trainer callback, a new-user trial), and where torchtitan's parallelize function did.
#: The plugin's reshard_after_forward went to every fully_shard call before accelerate 1.14; from 1.14 on (its
#: fsdp2_prepare_model) to the layers its wrap policy shards and the input embedding only: its tail unit, the final
#: norm and output head, is sharded with reshard_after_forward=False and the root with torch's default (kept
#: gathered). ("is every unit's" misled a new-user trial whose tail unit accelerate kept gathered by itself)
_PLUGIN_TAIL = ("every unit's before 1.14; from 1.14 on it keeps the root and the [final norm, output head] unit "
                "gathered")
PLUGIN_CALLS = ((RESHARD_IN_CALLS, f"# (accelerate's plugin's reshard_after_forward is all or none: {_PLUGIN_TAIL})"),
                (RESHARD_IN_CALL, f"(accelerate's plugin's reshard_after_forward is {_PLUGIN_TAIL})"))
TITAN_CALLS = ((RESHARD_IN_CALLS, "# (torchtitan's --parallelism.fsdp-reshard-after-forward is every unit's)"),
               (RESHARD_IN_CALL, "(torchtitan's --parallelism.fsdp-reshard-after-forward is every unit's)"))
#: ... where OLMo-core's Transformer.apply_fsdp made the fully_shard calls
OLMO_CALLS = ((RESHARD_IN_CALLS, "# (OLMo-core's apply_fsdp reshards every block after forward: it has no setting)"),
              (RESHARD_IN_CALL, "(OLMo-core's apply_fsdp reshards every block after forward: it has no setting)"))


def calls_words(code: str, words) -> str:
    """The fix's words for the user's fully_shard calls, where someone else made them (PLUGIN_CALLS, TITAN_CALLS,
    _HF_CALLS)."""
    for mine, theirs in words:
        code = code.replace(mine, theirs)
    return code


#: what they say instead for a model transformers sharded itself
_HF_CALLS = ((RESHARD_IN_CALLS,
              "# (its DistributedConfig's fsdp_plan keeps every layer gathered or none: 'keep_full_weight')"),
             (RESHARD_IN_CALL, "(or 'keep_full_weight' for it in its DistributedConfig's fsdp_plan)"))
#: what a fix that replaces fully_shard calls adds under transformers' own sharding
HF_SHARDING = (" transformers sharded this model itself, from its DistributedConfig: its fsdp_plan cuts the units, "
               "by module-name pattern ('free_full_weight': resharded after forward, 'keep_full_weight': kept "
               "gathered). The code replaces fully_shard calls you do not have: load the model with fsdp_size=1 and "
               "shard it with this code, or write the plan as fsdp_plan where its patterns can say it.")


def for_transformers(rec) -> None:
    """A fix of a model transformers sharded itself (from_pretrained(..., distributed_config=DistributedConfig(...));
    ``Recommendation``, changed in place): a fix for the sharded model goes after from_pretrained returns it (its
    words for fully_shard calls become the plan's); one that replaces fully_shard calls says that transformers'
    fsdp_plan made them."""
    if not rec.code:
        return
    if rec.where == "sharded":
        rec.where = "transformers"
        rec.code = calls_words(rec.code, _HF_CALLS)
    elif rec.where in ("unsharded", "before_shard", "around"):
        rec.text += HF_SHARDING


#: every FSDP unit of the model resharded (FSDPModule.reshard() is not recursive): its gathered parameters released
RESHARD_EVERY_UNIT = ("for module in model.modules():\n"
                      "    if isinstance(module, FSDPModule):\n"
                      "        module.reshard()")


#: the user's evaluation in gathered_around_evaluation's code: the lines before it go before, those after it after
EVALUATE_CALL = "with torch.no_grad():\n    evaluate()\n"


def gathered_around_evaluation(restore: list[str]) -> str:
    """Every unit kept gathered around the user's evaluation (``evaluate()``): gathered once for all its forward
    passes, then each unit in ``restore`` (those resharded after forward in training) set back, and every unit
    resharded before training resumes."""
    return ("# every unit gathered once for the whole evaluation, not once per forward pass\n"
            "model.set_reshard_after_forward(False)\n"
            + EVALUATE_CALL + _after_evaluation(restore))


def _after_evaluation(restore: list[str], width: int = 80) -> str:
    """The lines after an evaluation kept gathered: each unit in ``restore`` set back to resharding after forward,
    and every unit resharded (in ``width`` columns)."""
    return ("# the training steps' setting back, and the gathered parameters released\n"
            + (set_on_units(restore, "set_reshard_after_forward(True, recurse=False)", width=width) + "\n"
               if restore else "")
            + RESHARD_EVERY_UNIT)


def trainer_gathered_for_evaluation(restore: list[str]) -> str:
    """gathered_around_evaluation for the evaluations a Hugging Face Trainer runs inside ``train()``
    (``eval_strategy``), which no code of the user's surrounds: a callback turns resharding after forward off at the
    step end (or epoch end) the Trainer evaluates after (``control.should_evaluate``, which its DefaultFlowCallback,
    first in the list, has set by then), and back, every unit resharded, when the evaluation ends
    (``on_evaluate``). ``model`` there is the Trainer's model, the one watched."""
    end = textwrap.indent(_after_evaluation(restore, width=72), " " * 8)  # (within 80 columns once indented)
    return ("from transformers import TrainerCallback\n\n\n"
            "class DoctorFix(TrainerCallback):  # every unit gathered once per evaluation\n"
            "    def on_step_end(self, args, state, control, model=None, **kwargs):\n"
            "        if control.should_evaluate:  # the Trainer evaluates next\n"
            "            model.set_reshard_after_forward(False)\n\n"
            "    on_epoch_end = on_step_end  # (eval_strategy=\"epoch\")\n\n"
            "    def on_evaluate(self, args, state, control, model=None, **kwargs):\n"
            f"{end}\n\n\n"
            "trainer.add_callback(DoctorFix())")


def olmo_gathered_for_evaluation(restore: list[str]) -> str:
    """gathered_around_evaluation for the evaluations OLMo-core's evaluator callbacks run in its Trainer's steps
    (``EvaluatorCallback.perform_eval``, at its eval_interval), which no code of the user's surrounds: each one's
    perform_eval wrapped on the built Trainer (the method it wraps passed in, not looked up when called: pasted
    twice, the second wraps the first)."""
    end = textwrap.indent(_after_evaluation(restore, width=76), " " * 4)
    return ("from olmo_core.train.callbacks import EvaluatorCallback\n\n"
            "model = trainer.train_module.model\n\n\n"
            f"def after_evaluation():\n{end}\n\n\n"
            "# every unit gathered once for each evaluation an evaluator callback runs,\n"
            "# not once per forward pass\n"
            "def gathered_for_evaluation(perform_eval):\n"
            "    def perform_eval_gathered(*args, **kwargs):\n"
            "        model.set_reshard_after_forward(False)\n"
            "        try:\n"
            "            return perform_eval(*args, **kwargs)\n"
            "        finally:\n"
            "            after_evaluation()\n"
            "    return perform_eval_gathered\n\n\n"
            "for callback in trainer.callbacks.values():\n"
            "    if isinstance(callback, EvaluatorCallback):\n"
            "        callback.perform_eval = gathered_for_evaluation(callback.perform_eval)")


#: the objects set-up made (the model, the optimizer, the data loader's) frozen out of the collector's view: the full
#: collections, which traverse every object the collector tracks, then traverse only what the steps made
GC_FROZEN = ("# after building the model, optimizer and data loader: set-up objects leave the\n"
             "# collector's view\n"
             "gc.collect()\ngc.freeze()")


def gc_collect_every(every: int) -> str:
    """A full collection every ``every`` steps between two steps, at the same step on every rank (no rank waits for
    another's pause)."""
    return ("# call after optimizer.step(), at the same step on every rank\n"
            f"def collect_between_steps(step, every={every}):\n"
            "    if step % every == 0:\n        gc.collect()")


def gc_between_steps(every: int) -> str:
    """No collection inside a step: set-up frozen, the collector off, a full collection every ``every`` steps
    between two steps."""
    return GC_FROZEN + "\ngc.disable()  # no collection inside a step\n\n" + gc_collect_every(every)


#: gc_collect_every's function, as its first line reads: the period in steps
_GC_EVERY = re.compile(r"^def collect_between_steps\(step, every=(\d+)\):$", re.M)


def gc_parts(code: str) -> Optional[tuple[list[str], int]]:
    """jitter.gc's fix (gc_between_steps, or gc_collect_every alone) taken apart for a loop a Trainer or a recipe
    runs: (its set-up lines, set-up frozen and the collector off, [] for gc_collect_every's alone; its period in
    steps); None for any other code. Said as it is, a Hugging Face Trainer's user pasted the collector off and a
    collect_between_steps nothing called: the cycles piled up for the whole run."""
    _, body = _imports_apart(code)
    m = _GC_EVERY.search(body)
    if m is None:
        return None
    # (its comments say where it goes in the user's own loop: the hooks' own say it there)
    return [ln for ln in body[:m.start()].splitlines() if ln.strip() and not ln.startswith("#")], int(m.group(1))


def _gc_hooks(setup: list[str], head: list[str], start: str, end: str, step: str, collect_when: str) -> list[str]:
    """jitter.gc's fix as methods a loop's owner calls: ``start`` (a def line) runs ``setup``'s lines once set-up is
    built, ``step`` (a def line) collects ``collect_when`` (a condition) after the optimizer steps, ``end`` (a def
    line) turns the collector back on after training; ``head``: comment lines over them."""
    out = [*head]
    if setup:
        out += [start, *(f"    {ln}" for ln in ["# set-up objects leave the collector's view", *setup]), ""]
    out += [step, f"    if {collect_when}:", "        gc.collect()"]
    if setup:
        out += ["", end, "    gc.enable()  # the collector on again after training"]
    return out


def trainer_gc(setup: list[str], every: int) -> str:
    """jitter.gc's fix where a Hugging Face Trainer runs the loop: a callback that freezes set-up and turns the
    collector off when training begins, collects at every ``every``-th optimizer step's end (on_step_end: the same
    step on every rank) and turns the collector on again when training ends."""
    methods = _gc_hooks(setup, [], "def on_train_begin(self, args, state, control, **kwargs):",
                        "def on_train_end(self, args, state, control, **kwargs):",
                        "def on_step_end(self, args, state, control, **kwargs):  # the step done",
                        f"state.global_step % {every} == 0")
    return complete("\n".join(["from transformers import TrainerCallback", "", "",
                               "class DoctorFix(TrainerCallback):  # collections between steps only",
                               *(f"    {ln}" if ln else "" for ln in methods), "", "",
                               "trainer.add_callback(DoctorFix())"]), define_mesh=False)


def lightning_gc(setup: list[str], every: int) -> str:
    """jitter.gc's fix where Lightning's Trainer runs the loop: the LightningModule's on_train_start freezes set-up
    and turns the collector off, its on_train_batch_end (after the optimizer stepped, the same batch on every rank)
    collects after every ``every``-th optimizer step (accumulate_grad_batches batches each), its on_train_end turns
    the collector on again."""
    return complete("\n".join(_gc_hooks(
        setup, ["# in your LightningModule (merged into your hooks of these names, if any)"],
        "def on_train_start(self):", "def on_train_end(self):",
        "def on_train_batch_end(self, outputs, batch, batch_idx):",
        f"(batch_idx + 1) % ({every} * self.trainer.accumulate_grad_batches) == 0")), define_mesh=False)


def torchtune_gc(setup: list[str], every: int) -> str:
    """jitter.gc's fix in a torchtune recipe: set-up frozen and the collector off at the end of its setup(), a
    collection in its train() after every ``every``-th optimizer step (``self.global_step`` counts them, the same
    on every rank)."""
    lines = []
    if setup:
        lines += ["# in setup(), at its end (the model, optimizer and data loader built):",
                  "# set-up objects leave the collector's view", *setup, ""]
    return complete("\n".join([*lines, "# in train(), after self.global_step += 1 (the optimizer stepped)",
                               f"if self.global_step % {every} == 0:", "    gc.collect()"]), define_mesh=False)


def trainer_micro_batch_switch(calls: str) -> str:
    """A Hugging Face Trainer's loop keyed to the last micro-batch of each optimizer step: ``calls`` (lines on
    ``model``, reading ``is_last_micro_batch``) run before each training micro-batch's forward, from a forward pre-hook
    the callback puts on the model, reading whether the Trainer will step the optimizer after it (its accelerator's
    ``sync_gradients``, which the Trainer sets before each micro-batch: True on the step's last, the short step at an
    epoch's end included). Counting the micro-batches against gradient_accumulation_steps missed that short step: its
    units stayed gathered after its last backward, and the gradient clipping the Trainer runs before any callback
    read the gathered parameters, without gradients (a new-user trial's grad_norm fell from 0.90 to 0.54 on those
    steps, and under max_grad_norm=0.3 the training changed)."""
    body = textwrap.indent(calls, " " * 12)
    return ("import torch\n"
            "from transformers import TrainerCallback\n\n\n"
            "class DoctorFix(TrainerCallback):  # before each micro-batch: whether it is the step's last\n"
            "    def __init__(self, accelerator):\n"
            "        self.accelerator = accelerator  # its sync_gradients: True on a step's last micro-batch\n\n"
            "    def on_train_begin(self, args, state, control, model=None, **kwargs):\n"
            "        def switch(module, inputs):\n"
            "            if not (module.training and torch.is_grad_enabled()):  # (evaluation)\n"
            "                return\n"
            "            is_last_micro_batch = self.accelerator.sync_gradients\n"
            f"{body}\n\n"
            "        model.register_forward_pre_hook(switch)\n\n\n"
            "trainer.add_callback(DoctorFix(trainer.accelerator))")


_OPT_HOOK = re.compile(r"\boptimizer\.register_step_(pre|post)_hook\(")


def for_prepared_optimizer(code: str) -> str:
    """A fix hooking the optimizer in a loop around accelerate's ``prepare()``: the optimizer there is accelerate's
    AcceleratedOptimizer, which subclasses Optimizer without its hook state (a new-user trial pasted
    ``optimizer.register_step_post_hook(...)`` and got AttributeError: '_optimizer_step_post_hooks'). The hook goes
    on the torch optimizer inside it, its ``.optimizer``, whose step the wrapper calls."""
    if not _OPT_HOOK.search(code):
        return code
    return ("# accelerate's prepare() returns its optimizer wrapper: the hook goes on the torch optimizer inside it\n"
            + _OPT_HOOK.sub(lambda m: f'getattr(optimizer, "optimizer", optimizer).register_step_{m.group(1)}_hook(',
                            code))


def for_trainer(rec, finding: str = "", gpu: bool = True) -> None:
    """A fix of a run a Hugging Face Trainer drove (``Recommendation``, changed in place). The Trainer shards the
    model and builds the optimizer inside ``trainer.train()``, so a fix for the sharded model or its optimizer
    runs from a callback's ``on_train_begin``, as fsdp_doctor.DoctorCallback does (``optimizer`` there is
    accelerate's wrapper: the torch optimizer is its ``.optimizer``). A fix that rebinds the model or the optimizer,
    replaces the sharding or edits the loop stays as it is, and its text says why; one for the user's evaluation
    (which the Trainer's own runs under no_grad: this is code of the user's, a callback's say) stays as it is. A
    finding (``finding``: its code) whose lever the Trainer takes as arguments gets them set on trainer.args;
    jitter.gc's, set-up frozen and collections between steps, is a callback's on_train_begin and on_step_end
    (trainer_gc). A setting of the process stays as it is: at the top of the script (``startup``), or with the
    Trainer built, before train() (``model``, where the code does not name the model); both read "this code is for a
    loop of your own" (memory.fragmentation's allocator setting, compiled.recompile_limit's Dynamo limit)."""
    if not rec.code and finding in TRAINER_ARGS_FIXES:  # a lever of the user's code the Trainer has as arguments
        text, rec.code = TRAINER_ARGS_FIXES[finding](gpu)
        rec.text = f"{rec.text.replace(NO_PIPELINE_CODE, '').rstrip()} {text}"
        rec.where, rec.inputs = "trainer", dict(TRAINER_INPUTS)
        return
    if rec.where == "startup":  # a setting the process reads at its start: at the top of the script, as said
        return
    if rec.where == "model" and not _names(rec.code, ROOT):  # a setting of the process: before train() starts
        rec.where = "trainer"
        return
    if (gc_fix := gc_parts(rec.code)) is not None:  # jitter.gc's: the Trainer runs the loop, a callback's hooks
        rec.code, rec.where = trainer_gc(*gc_fix), "trainer"
        rec.text += (" The Trainer runs the loop: the callback below does it, a collection after every "
                     f"{gc_fix[1]} optimizer steps (on_step_end, the same step on every rank).")
        return
    # the user's own evaluation code, wherever it runs, and a fix the rule wrote for the Trainer: as they are
    if not rec.code or rec.where in ("evaluation", "trainer", "trl_reference"):
        return
    if rec.where not in ("sharded", "optimizer") or _REBINDS.search(rec.code):
        rec.text += TRAINER_ELSEWHERE
        return
    imports, code = _imports_apart(calls_words(rec.code, PLUGIN_CALLS))
    body = textwrap.indent(code, " " * 8)
    rec.code = ("\n".join([*imports, "from transformers import TrainerCallback"]) + "\n\n\n"
                "class DoctorFix(TrainerCallback):  # runs once the Trainer has sharded the model and built the optimizer\n"
                "    def on_train_begin(self, args, state, control, model=None,\n"
                "                       optimizer=None, **kwargs):\n"
                + ("        optimizer = getattr(optimizer, \"optimizer\", optimizer)  # the torch optimizer inside "
                   "accelerate's\n" if re.search(r"\boptimizer\b", code) else "")
                + f"{body}\n\n\n"
                "trainer.add_callback(DoctorFix())")
    rec.where = "trainer"
    rec.inputs = {**rec.inputs, **TRAINER_INPUTS}


#: the name a loop fix keyed to the last micro-batch reads from the user's loop (Recommendation.inputs)
LAST_MICRO_BATCH = "is_last_micro_batch"


def for_lightning(rec, accumulate: int, root_known: bool = True) -> None:
    """A loop fix keyed to the last micro-batch (its input ``is_last_micro_batch``) of a run PyTorch Lightning's
    Trainer drove (``Recommendation``, changed in place): the Trainer runs the loop, so the fix goes into the
    LightningModule's training_step, which runs before each micro-batch's backward, its last micro-batch said as the
    Trainer decides it (its training epoch loop: the batch whose count in the epoch is a multiple of
    accumulate_grad_batches, or the epoch's last), and ``model`` there is ``self``. A new-user trial's Trainer with
    accumulate_grad_batches=2 under ModelParallelStrategy read "model.model.set_requires_gradient_sync(
    is_last_micro_batch)" for the user's loop, which the Trainer owns. Where the run is only the trace of Lightning's
    profiler (``root_known`` False: which module of the LightningModule is the FSDP root the trace does not say), each
    call on the model is made on every FSDP module the LightningModule holds (``recurse=False``); jitter.gc's goes
    into the LightningModule's training hooks (lightning_gc); a fix of other lines is left as it was."""
    if rec.code and rec.where == "evaluation" and EVALUATE_CALL in rec.code and root_known:
        _lightning_validation(rec)
        return
    if (gc_fix := gc_parts(rec.code)) is not None:  # jitter.gc's: the LightningModule's hooks
        rec.code, rec.where = lightning_gc(*gc_fix), "lightning_module"
        rec.text += (" Lightning's Trainer runs the loop: the lines go into your LightningModule's hooks, a "
                     f"collection after every {gc_fix[1]} optimizer steps in on_train_batch_end (the same batch on "
                     "every rank).")
        return
    if rec.code and rec.where in LIGHTNING_MODEL_PLACES and root_known:
        _lightning_configure_model(rec)
        return
    # (one that rebinds the optimizer or the model would rebind the hook's names only: left as it was)
    if rec.code and rec.where == "optimizer" and root_known and _names(rec.code, "optimizer") and \
            not _REBINDS.search(rec.code):
        _lightning_train_start(rec)
        return
    if not rec.code or rec.where != "loop" or LAST_MICRO_BATCH not in rec.inputs:
        return
    lines = _on_self(rec.code) if root_known else _on_fsdp_modules(rec.code)
    if lines is None:
        return
    rec.code = "\n".join([
        *comment(f"Lightning's Trainer steps the optimizer after every {accumulate} batches "
                 "(accumulate_grad_batches) and after the epoch's last"),
        f"{LAST_MICRO_BATCH} = (",
        "    (batch_idx + 1) % self.trainer.accumulate_grad_batches == 0",
        "    or batch_idx + 1 == self.trainer.num_training_batches",
        "    or self.trainer.is_last_batch)",
        *lines])
    if not root_known:
        rec.code = complete(rec.code, define_mesh=False)  # (FSDPModule's import)
    rec.where = "training_step"
    rec.inputs = {"batch_idx": "training_step's argument: the batch's index in the epoch"}
    rec.text += (" Lightning's Trainer runs the loop: the lines go into your LightningModule's training_step, which "
                 "runs before each micro-batch's backward.")


def _on_fsdp_modules(code: str) -> list[str] | None:
    """``code``'s calls on the watched model (``model.METHOD(ARGS)``, each a line of its own) made on every FSDP module
    of a LightningModule (``self``) instead, each with ``recurse=False`` (the loop reaches them all); comment lines as
    they were. None where a line is neither (the fix is left as it was)."""
    out, calls = [], []
    for ln in code.splitlines():
        if ln.lstrip().startswith("#") or not ln.strip():
            out.append(ln)
        elif m := re.fullmatch(rf"{ROOT}\.(\w+)\((.+?)\)(\s*#.*)?", ln.strip()):
            calls.append(f"        module.{m.group(1)}({m.group(2)}, recurse=False){m.group(3) or ''}")
        else:
            return None
    if not calls:
        return None
    return [*out, "for module in self.modules():  # every FSDP unit, as configure_model made them",
            "    if isinstance(module, FSDPModule):", *calls]


def _on_self(code: str) -> list[str]:
    """``code``'s lines with the watched model, ``model``, as ``self`` (inside a LightningModule's method); comment
    lines as they were."""
    return renamed(code, {ROOT: "self"})


def _own_names(names) -> re.Pattern:
    """Any of ``names`` as a name of its own in code: not an attribute, not in a string."""
    return re.compile(rf"(?<![\w.'\"])({'|'.join(map(re.escape, names))})\b")


def _names(code: str, name: str) -> bool:
    """Whether ``code`` uses ``name`` (a name of its own, outside its comments)."""
    pattern = _own_names([name])
    return any(pattern.search(ln.split("#", 1)[0]) for ln in code.splitlines())


def renamed(code: str, names: dict[str, str]) -> list[str]:
    """``code``'s lines with each of ``names``' keys, a name of its own (not an attribute, not in a string), as its
    value; comment lines as they were. Calls on named units that the longer name takes past 80 columns become a loop
    over their names, as set_on_units writes it (``train_module.model.get_submodule('blocks.3').set_reshard_after_
    forward(False, recurse=False)`` read 91, OLMo-core's HSDP trial)."""
    pattern = _own_names(names)
    return _unit_calls_looped([ln if ln.lstrip().startswith("#") else pattern.sub(lambda m: names[m.group(1)], ln)
                               for ln in code.splitlines()])


_UNIT_CALL = re.compile(r"(\s*)(\S+)\.get_submodule\(('[^']*')\)\.(.+)")


def _unit_calls_looped(lines: list[str]) -> list[str]:
    """``lines`` with each run of the same call on named units (``X.get_submodule('n').call``, one a line, one
    indentation) that has a line past 80 columns written as a loop over the names."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        m = _UNIT_CALL.fullmatch(lines[i])
        j = i + 1
        while m and j < len(lines) and (n := _UNIT_CALL.fullmatch(lines[j])) and (
                n.group(1, 2, 4) == m.group(1, 2, 4)):
            j += 1
        if m and any(len(ln) > 80 for ln in lines[i:j]):
            pad = m.group(1)
            loop = units_loop([ast.literal_eval(_UNIT_CALL.fullmatch(ln).group(3)) for ln in lines[i:j]], m.group(4),
                              base=m.group(2), width=80 - len(pad))
            out += [pad + ln for ln in loop.splitlines()]
        else:
            out += lines[i:j]
        i = j
    return out


#: where a fix goes -> where it goes in a torchtune recipe (the user's copy of it): its _setup_model shards the model
#: with training.shard_model (the model is ``model`` there), its train() runs the loop
TORCHTUNE_PLACES = {"sharded": "torchtune_setup", "unsharded": "torchtune_plan", "loop": "torchtune_train",
                    "backward": "torchtune_backward", "optimizer": "torchtune_optimizer"}
#: the names of the model and its optimizer in a torchtune recipe's train()
TORCHTUNE_LOOP_NAMES = {ROOT: "self._model", "optimizer": "self._optimizer"}


def for_torchtune(rec, recipe: str) -> None:
    """A fix of a run one of torchtune's recipes drove (``recipe``: its file), made for that recipe
    (``Recommendation``, changed in place): a fix on the model goes into its _setup_model, after (or, a sharding
    plan, in place of) training.shard_model, where the model is ``model``; a loop fix into its train(), where the
    model is ``self._model`` and the optimizer ``self._optimizer``, and a fix keyed to the last micro-batch reads it
    as the recipe decides it: it steps the optimizer on every gradient_accumulation_steps-th batch (``idx + 1``). A
    new-user trial of full_finetune_distributed with gradient_accumulation_steps: 2 read
    ``model.set_requires_gradient_sync(is_last_micro_batch)`` "in your training loop", whose model is ``self._model``
    and which has no such flag. A fix on the built optimizer (code naming it) goes into its setup(), after the
    optimizer is built, with the train()'s names; jitter.gc's set-up at the end of its setup() and its collections
    in train() (torchtune_gc). A fix of its config (torchtune_config) and any other is left as it was."""
    said = f"torchtune's recipe ({recipe}) "
    if (gc_fix := gc_parts(rec.code)) is not None:  # jitter.gc's: set-up in its setup(), the collection in train()
        rec.code, rec.where = torchtune_gc(*gc_fix), "torchtune_recipe" if gc_fix[0] else "torchtune_train"
        rec.text += (f" {said}runs the loop in its train(): the lines go into your copy of the recipe (tune cp), "
                     f"where their comments say, a collection after every {gc_fix[1]} optimizer steps.")
        return
    if not rec.code or rec.where not in TORCHTUNE_PLACES or (rec.where == "optimizer"
                                                              and not _names(rec.code, "optimizer")):
        return
    if rec.where in ("sharded", "unsharded"):
        rec.where = TORCHTUNE_PLACES[rec.where]
        rec.text += (f" {said}shards the model in its _setup_model (training.shard_model): the lines go there, in your "
                     "copy of the recipe (tune cp), where the model is `model`.")
        return
    lines = renamed(rec.code, TORCHTUNE_LOOP_NAMES)
    if LAST_MICRO_BATCH in rec.inputs:
        head = lines[:1] if lines[0].startswith("#") else []  # (what the lines are for, said first)
        lines = [*head, *comment("torchtune's recipe steps the optimizer on every gradient_accumulation_steps-th "
                                 "batch"),
                 f"{LAST_MICRO_BATCH} = (idx + 1) % self._gradient_accumulation_steps == 0",
                 *lines[len(head):]]
        rec.inputs = {k: v for k, v in rec.inputs.items() if k != LAST_MICRO_BATCH}
        rec.where = "torchtune_backward"
    else:
        rec.where = TORCHTUNE_PLACES[rec.where]
    rec.code = "\n".join(lines)
    rec.text += (f" {said}builds its optimizer in its setup(): the lines go there, after it, in your copy of the "
                 "recipe (tune cp), where the model is self._model and the optimizer self._optimizer."
                 if rec.where == "torchtune_optimizer" else
                 f" {said}runs the loop in its train(): the lines go there, in your copy of the recipe (tune cp), "
                 "where the model is self._model.")


def torchtune_fused_optimizer() -> str:
    """The torchtune config's optimizer switched to its fused implementation: the recipe builds the optimizer from
    its config (``config.instantiate(cfg.optimizer, params)``), so the key is the optimizer's argument."""
    return "\n".join(["# the recipe builds its optimizer from these keys: add fused to yours",
                      "# (or optimizer.fused=True after --config on tune run's command line)",
                      "optimizer:", "  fused: True"])


def torchtune_layers(names: list[str], passed_on: bool = True) -> str:
    """The torchtune config line that makes ``names`` (the model's modules, by their names in it) FSDP units of
    their own: its recipes' training.shard_model shards each ``layers.N`` and each module its custom_sharded_layers
    names, then the root. Where the recipe does not pass the setting on to the model it trains (``passed_on``
    False: knowledge distillation's setup() passes it to its teacher's _setup_model only), the recipe's line too,
    as comments over it: the config line alone changed nothing (a new-user trial)."""
    recipe = ["# your recipe's setup() does not pass this on to the model it trains: add",
              '#     custom_sharded_layers=cfg.get("custom_sharded_layers", None),',
              "# to its self._model = self._setup_model(...) call"] if not passed_on else []
    return "\n".join([*recipe, "# each a unit of its own beside the layers (training.shard_model's shard conditions)",
                      f"custom_sharded_layers: {names!r}"])


#: where a fix on the model goes -> where it goes in a LightningModule: its configure_model builds the units
LIGHTNING_MODEL_PLACES = {"sharded": "configure_model", "unsharded": "configure_model_plan"}


def _lightning_configure_model(rec) -> None:
    """A fix on the sharded model (``sharded``), or a sharding plan in place of the user's fully_shard calls
    (``unsharded``), where Lightning's Trainer drove the run: the LightningModule's configure_model shards its model,
    and ``model`` there is ``self`` (the watched LightningModule, which the units are named from). A new-user trial's
    prefetch.sync_unshard fix read ``for module in model.modules()`` "after your fully_shard calls", where no
    ``model`` exists."""
    rec.code = "\n".join(_on_self(rec.code))
    rec.where = LIGHTNING_MODEL_PLACES[rec.where]
    rec.text += (" Lightning's Trainer builds the model: the lines go into your LightningModule's configure_model, "
                 "where the model is self.")


def _lightning_train_start(rec) -> None:
    """A fix on the built optimizer (``optimizer``; ``model`` beside it), where Lightning's Trainer builds it from
    the LightningModule's configure_optimizers: the LightningModule's on_train_start hook, which the Trainer calls
    with its optimizers built and before the first step, the optimizer there the Trainer's first (the one the
    README's callback watches) and the model ``self``. Said "after your optimizer is built", the lines had no
    ``optimizer`` in a LightningModule, whose configure_optimizers returns it."""
    _, code = _imports_apart(rec.code)
    lines = _on_self(code.strip("\n"))
    while lines and lines[0].startswith("#"):  # (its "after building the optimizer": the hook's comment says when)
        lines.pop(0)
    body = textwrap.indent("\n".join(["optimizer = self.trainer.optimizers[0]  # what configure_optimizers returned",
                                      *lines]), " " * 4)
    rec.code = complete("\n".join(["# in your LightningModule (its Trainer calls this with the optimizer built,",
                                   "# before the first step)", "def on_train_start(self):", body]),
                        define_mesh=False)
    rec.where = "lightning_module"
    rec.text += (" Lightning's Trainer builds the optimizer from configure_optimizers: the lines go into your "
                 "LightningModule's on_train_start hook (merged into yours where you have it), where the optimizer "
                 "is the Trainer's and the model self.")


def _lightning_validation(rec) -> None:
    """eval.regather's fix around the user's evaluation (gathered_around_evaluation), where Lightning's Trainer runs
    the validation: the lines before it in the LightningModule's on_validation_start, those after it in its
    on_validation_end (a trial's Trainer pasted so: the finding went, the losses equal to the bit)."""
    _, code = _imports_apart(rec.code)
    start, end = (textwrap.indent("\n".join(_on_self(part.strip("\n"))), " " * 4)
                  for part in code.split(EVALUATE_CALL, 1))
    # (its imports those the hooks use, as complete() gives any snippet: torch.no_grad went with evaluate())
    rec.code = complete("\n".join(["# in your LightningModule (its Trainer calls these around each validation)",
                                   "def on_validation_start(self):", start, "", "",
                                   "def on_validation_end(self):", end]), define_mesh=False)
    rec.where, rec.inputs = "lightning_module", {}
    rec.text += (" Lightning's Trainer runs the validation: the lines go into your LightningModule's "
                 "on_validation_start and on_validation_end hooks (merged into yours where you have them).")


def _imports_apart(code: str) -> tuple[list[str], str]:
    """(a completed snippet's imports under IMPORTS_NOTE, the rest): a fix that goes into a function (a Trainer
    callback's, torchtitan's hook) keeps its imports at the top of the file (inside the function, the note above
    them read "at the top of your file, not in a function": a new-user trial)."""
    imports, body = _hoist_imports(code.replace(IMPORTS_NOTE + "\n", "", 1))
    return ([IMPORTS_NOTE, *imports] if imports else []), body


#: a Hugging Face model's attention switched to a fused kernel, every layer (kernels.eager_attention,
#: memory.temporaries)
ATTN_SWITCH = {"sdpa": "model.set_attn_implementation('sdpa')  # every attention layer: scaled_dot_product_attention",
               "flex_attention": "model.set_attn_implementation('flex_attention')  # every attention layer: one "
                                 "fused kernel (compiled in the first steps)"}


def fix_place(code: str) -> str:
    """Where a snippet goes (report_sections.FIX_PLACES): one in two parts around the user's fully_shard calls, a
    sharding plan on the unsharded model (a checkpointing change before the user's calls), one that (re)builds or
    hooks the optimizer after it exists, otherwise a setting on the sharded model."""
    if not code:
        return ""
    if SHARDING_GOES_HERE in code:
        return "around"
    if BEFORE_SHARDING in code:  # a sharding plan replaces the user's calls; a checkpointing change goes before them
        return "unsharded" if "fully_shard(" in code else "before_shard"
    if re.search(r"^\s*optimizer\s*=|\boptimizer\.", code, re.M):
        return "optimizer"
    return "sharded"


# ---------------------------------------------------------------------------------------------- completion
# name used in a snippet -> the line that defines it (imports first, then the mesh, in this order)
_DEFINES = (
    (r"\bgc\.", "import gc"),
    (r"\bmath\.", "import math"),
    (r"\bos\.", "import os"),
    (r"\binspect\.", "import inspect"),
    (r"\btorch\.", "import torch"),
    (r"\bnn\.", "import torch.nn as nn"),
    (r"\bdist\.", "import torch.distributed as dist"),
    (r"\bfully_shard\(|\bFSDPModule\b|\bMixedPrecisionPolicy\(|\bCPUOffloadPolicy\(", None),
    (r"\bDTensor\b", "from torch.distributed.tensor import DTensor"),
    (r"\binit_device_mesh\(", "from torch.distributed.device_mesh import init_device_mesh"),
)
_FSDP_NAMES = ("CPUOffloadPolicy", "FSDPModule", "MixedPrecisionPolicy", "fully_shard")
# (no ``device`` of its own: pasted into a script whose ``device`` was "cuda:{local_rank}", it made it "cuda", every
# rank's cuda:0 - a new-user trial's script had one)
_MESH = ("# a mesh over all ranks{}\n"
         "mesh = init_device_mesh('cuda' if torch.cuda.is_available() else 'cpu',\n"
         "                        (dist.get_world_size(),))")
# the mesh's comment where the run's mesh is known (1-D, over all ranks: a mesh of its own is HSDP's or a part of the
# ranks', which the fix reads), and where it is not (a trace without the doctor's records)
_MESH_KNOWN, _MESH_UNKNOWN = ", as your units' (FSDP's default)", " (or the mesh your fully_shard calls pass, if any)"


# heads a snippet's imports, which it gathers at its top: pasted into a function that used one of their names
# before (``dist.init_process_group()`` in the user's main()), an import there makes the name local to the whole
# function, and the earlier use raises UnboundLocalError (a new-user trial pasted a wrap fix into main())
IMPORTS_NOTE = "# imports: at the top of your file, not in a function using these names"


def _hoist_imports(body: str) -> tuple[list[str], str]:
    """(the top-level import statements of ``body``, a parenthesised one whole; the rest of it)."""
    imports: list[str] = []
    rest: list[str] = []
    lines = body.split("\n")
    i = 0
    while i < len(lines):
        ln = lines[i]
        if re.match(r"(import |from \S+ import )", ln):
            stmt = [ln]
            while sum(x.count("(") - x.count(")") for x in stmt) > 0 and i + 1 < len(lines):  # (to its ")")
                i += 1
                stmt.append(lines[i])
            imports.append("\n".join(stmt))
        else:
            rest.append(ln)
        i += 1
    return imports, "\n".join(rest).strip("\n")


def complete(code: str, define_mesh: bool = True, mesh_known: bool = False) -> str:
    """The snippet with the imports and the ``mesh`` it uses and does not define (``define_mesh``: a 1-D mesh over
    all ranks, ``mesh_known``: the run's own; False: the user's, which the fix reads), so that it runs pasted after
    the user's ``model`` (and ``optimizer``) exist. Its imports, its own and those added, come first under
    ``IMPORTS_NOTE``."""
    if not code:
        return code
    body = code
    pre: list[str] = []
    if define_mesh and re.search(r"\bmesh\b(?!=)", body) and not re.search(r"^\s*mesh\s*=", body, re.M):
        body = _MESH.format(_MESH_KNOWN if mesh_known else _MESH_UNKNOWN) + "\n" + body
    uses = re.sub(r"^\s*(from|import) .*$", "", body, flags=re.M)  # what the code uses, its own imports aside
    used_fsdp = [n for n in _FSDP_NAMES if re.search(rf"\b{n}\b", uses)
                 and not re.search(rf"^\s*from \S+ import [^\n]*\b{n}\b", body, re.M)]
    for pat, line in _DEFINES:
        if line is None:
            if used_fsdp:
                line = f"from torch.distributed.fsdp import {', '.join(used_fsdp)}"
            else:
                continue
        if re.search(pat, uses) and not re.search(rf"^{re.escape(line)}$", body, re.M):
            pre.append(line)
    own, body = _hoist_imports(body)
    imports: list[str] = []
    fsdp: list[str] = []  # the names from torch.distributed.fsdp, one line for all
    for ln in dict.fromkeys(pre + own):
        m = re.fullmatch(r"from torch\.distributed\.fsdp import ([\w, ]+)", ln)
        if m is None:
            imports.append(ln)
            continue
        if not fsdp:
            imports.append("<fsdp>")
        fsdp += [n.strip() for n in m.group(1).split(",") if n.strip() not in fsdp]
    imports = [f"from torch.distributed.fsdp import {', '.join(fsdp)}" if ln == "<fsdp>" else ln for ln in imports]
    return "\n".join([IMPORTS_NOTE, *imports, "", body]) if imports else body
