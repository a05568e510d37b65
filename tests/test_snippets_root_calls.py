"""Fixes' calls of FSDPModule's methods made on the root unit where the watched model holds it (snippets.on_root_unit),
from FSDPModule's method names kept as data (records.FSDP_MODULE_METHODS): the diagnosis imports no torch."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

from fsdp_doctor.diagnose.snippets import on_root_unit
from fsdp_doctor.records import FSDP_MODULE_METHODS

DIAGNOSE = Path(__file__).resolve().parents[1] / "fsdp_doctor" / "diagnose"


def test_fsdp_module_methods_are_the_installed_torchs():
    from torch.distributed.fsdp import FSDPModule

    installed = {n for n, v in vars(FSDPModule).items()
                 if callable(v) and not n.startswith("__") and n not in ("_apply", "_get_fsdp_state")}
    assert installed == FSDP_MODULE_METHODS


def test_calls_of_fsdp_methods_on_the_model_go_to_the_root_it_holds_and_nothing_else_moves():
    rec = SimpleNamespace(code="model.set_reshard_after_forward(False)\n"
                               "model.model.unshard()\n"
                               "model.eval()\n"
                               "other_model.set_requires_gradient_sync(False)\n"
                               "model.set_requires_gradient_sync(is_last)")
    on_root_unit(rec, "model.model")
    assert rec.code.splitlines() == ["model.model.set_reshard_after_forward(False)",
                                     "model.model.unshard()",
                                     "model.eval()",
                                     "other_model.set_requires_gradient_sync(False)",
                                     "model.model.set_requires_gradient_sync(is_last)"]
    same = SimpleNamespace(code="model.unshard()")
    on_root_unit(same, "model")
    assert same.code == "model.unshard()"


def test_the_diagnosis_imports_no_torch():
    for path in sorted(DIAGNOSE.rglob("*.py")):  # its rules too
        for node in ast.walk(ast.parse(path.read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(m.split(".")[0] == "torch" for m in mods), f"{path.relative_to(DIAGNOSE)}:{node.lineno}"
