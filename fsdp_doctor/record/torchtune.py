"""What the recorder reads of a torchtune recipe that drives the run (watch() called in one of its recipe class's
methods), without importing torchtune: its file, which the user edits in a copy (`tune cp`), and from its source
(ast) what its train() all-reduces at each optimizer step, whether its setup() passes the config's
custom_sharded_layers to the model it trains, and the names its train() binds a forward's returns to and never reads:
so that the fixes name the recipe's own tensors and lines, as each of its recipes writes them."""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path
from typing import NamedTuple

#: the module of torchtune's recipe base class (FTRecipeInterface), which every recipe of its own subclasses
_TORCHTUNE_RECIPES = "torchtune.recipe_interfaces"


class Recipe(NamedTuple):
    file: str  # the recipe's source file's name (its class name where that has none)
    reduced: list[str]  # the tensors its train() all-reduces, as written, in order (each once; []: none or unread)
    scaled_by: str | None  # of them, the one its gradient scaling (training.scale_grads) divides by (None: none)
    # whether the call that builds the watched model (self._model = self._setup_model(...)) passes the config's
    # custom_sharded_layers on (knowledge distillation's passes it to its teacher's only); None: not read
    custom_layers: bool | None
    # names its train() binds to a forward's returns (a call given self._model) and never reads nor deletes: they keep
    # those returns to the next step (DPO's reference forward's `_`, its logits); [] none, or not read
    unread: list[str]


def torchtune_recipe(frame, depth: int = 4) -> Recipe | None:
    """The torchtune recipe whose method called watch() (``frame``: the caller's, and up to ``depth`` frames out: a
    helper of the recipe's own), read from the class whose method the frame runs; None: no recipe's method called it
    (or it could not be read: what names the fixes' places never stops watch())."""
    for _ in range(depth):
        if frame is None:
            return None
        try:
            cls = _method_class(frame)
        except Exception:  # noqa: BLE001  (an odd module's globals: the fixes keep their generic places)
            return None
        if cls is not None and any(c.__module__ == _TORCHTUNE_RECIPES for c in cls.__mro__):
            # (the file of the method running: the recipe's, as `tune run` ran it)
            return Recipe(Path(frame.f_code.co_filename).name or cls.__name__, *_read_source(cls))
        frame = frame.f_back
    return None


def _method_class(frame) -> type | None:
    """The class of its module whose method runs in ``frame`` (its code object that method's), None: not a method of
    a class at a module's top level. Read from the module's globals, never the frame's locals: ``frame.f_locals``
    snapshots them into a dict the running frame keeps, holding what the loop later drops (a model rebound there
    stayed alive: its FSDP2 units read as another model's)."""
    code = frame.f_code
    for value in list(frame.f_globals.values()):
        if isinstance(value, type) and getattr(value.__dict__.get(code.co_name), "__code__", None) is code:
            return value
    return None


def _read_source(cls: type) -> tuple[list[str], str | None, bool | None, list[str]]:
    """From the recipe's source: what its train() all-reduces (``torch.distributed.all_reduce(x)``: x as written) and
    which of those its gradient scaling divides by (``training.scale_grads(model, world_size / num_tokens)``):
    full_finetune's num_tokens (the scaling) and running_loss (its log); knowledge distillation's running_class_loss
    and running_kd_loss beside num_tokens; DPO's running_loss, num_tokens (for tokens/s alone) and each
    running_metrics[key]. Whether its ``self._model = self._setup_model(...)`` passes custom_sharded_layers. The names
    its train() binds a forward's returns to and never reads (Recipe.unread). ([], None, None, []) where their source
    cannot be read or parsed."""
    reduced: list[str] = []
    scaling: set[str] = set()
    custom: bool | None = None
    unread: list[str] = []
    for method in ("train", "setup"):  # (each method's own source: its class's needs the module in sys.modules)
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(cls, method))))
        except Exception:  # noqa: BLE001  (no such method, or no source: a compiled or generated class)
            continue
        # (a reduction inside a loop within the step, one that runs no backward: DPO's over its running metrics,
        # "each running_metrics[key]"; the epochs' and batches' loops run the backward)
        looped = {id(n) for loop in ast.walk(tree) if isinstance(loop, ast.For) and not _runs_backward(loop)
                  for n in ast.walk(loop)}
        for node in ast.walk(tree):
            if method == "train" and isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr == "all_reduce" and node.args:
                    name = ("each " if id(node) in looped else "") + ast.unparse(node.args[0])
                    if name not in reduced:
                        reduced.append(name)
                elif node.func.attr == "scale_grads" and len(node.args) > 1:
                    scaling |= {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            elif (isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["self._model"]
                  and isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "self._setup_model"):
                custom = any(k.arg == "custom_sharded_layers" for k in node.value.keywords)
        if method == "train":
            unread = _unread_returns(tree)
    return reduced, next((n for n in reduced if n in scaling), None), custom, unread


def _unread_returns(tree) -> list[str]:
    """The names ``tree`` (a train()) binds to the returns of a forward (a call given ``self._model``, as the
    function or an argument) and never reads nor deletes."""
    read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Load, ast.Del))}
    out: list[str] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign) or not isinstance(node.value, ast.Call):
            continue
        call = node.value
        if not any(ast.unparse(a) == "self._model" for a in [call.func, *call.args, *(k.value for k in call.keywords)]):
            continue
        for target in node.targets:
            for n in ast.walk(target):
                if isinstance(n, ast.Name) and n.id not in read and n.id not in out:
                    out.append(n.id)
    return out


def _runs_backward(node) -> bool:
    """Whether ``node``'s code calls ``.backward()`` (a loop over the steps, not one within a step)."""
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "backward"
               for n in ast.walk(node))
