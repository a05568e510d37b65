"""The FSDP2 adapter (fsdp_doctor/record/fsdp2.py): the only reader of torch's private FSDP2 state; what it
cannot read is said once, in one line naming the torch version, and left out as unknown (None)."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from fsdp_doctor.record import fsdp2 as F2

PKG = Path(__file__).resolve().parents[1] / "fsdp_doctor"
# private FSDP2 names (attributes of FSDPState / FSDPParamGroup / FSDPParam / FSDPCommContext / FSDPModule)
PRIVATE = {"_fsdp_param_group", "_fsdp_param_groups", "_get_fsdp_state", "_orig_size", "_sharded_param_data",
           "_mp_policy", "_states_to_forward_prefetch", "_states_to_backward_prefetch", "post_forward_mesh_info",
           "_training_state", "_all_gather_result", "comm_ctx", "all_gather_state", "reduce_scatter_states",
           "reduce_scatter_state", "_module_fqn", "_set_unshard_async_op", "unshard_async_op", "unshard_in_backward",
           "_sharded_state", "_unsharded_param", "all_gather_outputs", "_unsharded_inner_tensors",
           "unsharded_accumulated_grad", "_sharded_post_forward_param_data", "_is_hsdp", "_all_reduce_state",
           "_partial_reduce_output", "fsdp_params", "offload_policy", "reduce_grads",
           "_top_saved_tensors_default_hooks", "_is_root", "_modules", "_param_fqn", "_comm_ctx",
           "_post_forward_indices", "all_gather_work"}


def _imports_torch(tree: ast.AST) -> bool:
    return any(isinstance(n, ast.Import) and any(a.name.split(".")[0] == "torch" for a in n.names)
               or isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "torch" for n in ast.walk(tree))


def _private_reads(path: Path) -> list[str]:
    """Attribute reads (``x.name``) and ``getattr``/``hasattr`` string names of private FSDP2 fields. A module
    that imports no torch holds no FSDP2 object: there a name that is also a field of our own unit record
    (``UnitConfig.unshard_async_op``, read by the rules) is that field."""
    from fsdp_doctor.records import UnitConfig

    out = []
    tree = ast.parse(path.read_text())
    ours = set() if _imports_torch(tree) else set(UnitConfig.__struct_fields__)
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "F2":
                continue  # the adapter's own functions (F2.unshard_async_op(pg))
            name = node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            name = node.args[1].value
        if name is not None and name not in ours and (name in PRIVATE or name.startswith("_fsdp_param")):
            out.append(f"{path.relative_to(PKG.parent)}:{node.lineno}: {name}")
    return out


def test_no_module_but_the_adapter_reads_private_fsdp2_state():
    offenders = [r for p in sorted(PKG.rglob("*.py")) if p.name != "fsdp2.py" for r in _private_reads(p)]
    assert offenders == []


def test_the_adapter_does_read_them():
    assert len(_private_reads(PKG / "record" / "fsdp2.py")) > 20  # the grep above can see what it looks for


class _State:
    """An FSDPState of a torch that renamed everything: no param groups, no policy, no prefetch lists."""


def test_unreadable_field_is_one_line_once_and_none(caplog, monkeypatch):
    monkeypatch.setattr(F2, "_problems", {})
    with caplog.at_level(logging.WARNING, logger="fsdp_doctor"):
        assert F2.param_groups(_State()) is None
        assert F2.param_groups(_State()) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert f"torch {F2.TORCH_STR}" in lines[0] and "_fsdp_param_groups" in lines[0]
    assert F2.problems() == [lines[0].removeprefix("fsdp_doctor: ")]


def test_old_and_new_param_group_layouts():
    class Old:  # torch 2.6-2.9
        _fsdp_param_group = "pg"

    class OldEmpty:
        _fsdp_param_group = None

    class New:  # torch 2.13+
        _fsdp_param_groups = ["a", "b"]

    assert F2.param_groups(Old()) == ["pg"]
    assert F2.param_groups(OldEmpty()) == []
    assert F2.param_groups(New()) == ["a", "b"]


def test_comm_reader_handles_both_reduce_scatter_layouts():
    class Buf:
        def __init__(self, n):
            self.reduce_scatter_input = torch.zeros(n)

    class Ctx:
        all_gather_state = None

    class Pg:
        _all_gather_result = None

    old, new = Ctx(), Ctx()
    old.reduce_scatter_state = Buf(10)  # 2.6-2.9: one state or None
    new.reduce_scatter_states = [Buf(10), Buf(6)]  # 2.13+: a list
    for ctx, want in ((old, 40), (new, 64)):
        pg = Pg()
        pg.comm_ctx = ctx
        r = F2.CommReader([pg])
        assert r.ok and r.bytes() == want


def test_unrecognised_comm_state_is_unknown_not_zero(monkeypatch):
    monkeypatch.setattr(F2, "_problems", {})

    class Pg:
        comm_ctx = object()  # no all_gather_state, no reduce_scatter_state(s)

    r = F2.CommReader([Pg()])
    assert not r.ok and r.bytes() is None
    assert any("comm_buffers unknown" in p for p in F2.problems())


def test_snapshot_marks_unknown_fields_none(monkeypatch):
    from fsdp_doctor.record.units import Unit, snapshot_units

    monkeypatch.setattr(F2, "_problems", {})
    u = Unit(state=_State(), modules=[nn.Linear(2, 2)], module_names=["lin"], name="lin")
    (cfg,) = snapshot_units([u])
    assert cfg.param_count is None and cfg.sharded_bytes is None and cfg.unsharded_bytes is None
    assert cfg.reshard_after_forward is None and cfg.unshard_async_op is None and cfg.forward_prefetch is None
    assert cfg.unshard_in_backward is None
    assert cfg.param_groups is None
    assert len(F2.problems()) >= 1 and all(p.startswith(f"torch {F2.TORCH_STR}: cannot read ") for p in F2.problems())


def test_unknown_survives_the_record_round_trip():
    import msgspec

    from fsdp_doctor.records import UnitConfig

    u = UnitConfig(name="x", modules=["x"], is_root=False, param_count=None, n_params=None, sharded_bytes=None,
                   unsharded_bytes=None, orig_dtypes=[], reshard_after_forward=None, unshard_async_op=None)
    d = msgspec.json.decode(msgspec.json.encode(u))
    assert d["param_count"] is None and d["reshard_after_forward"] is None and d["unshard_async_op"] is None
    back = msgspec.json.decode(msgspec.json.encode(u), type=UnitConfig)
    assert back.sharded_bytes is None and back.unshard_async_op is None


@pytest.mark.compat
def test_this_torch_is_supported_and_has_what_we_read():
    assert F2.unsupported_reason() is None
    assert F2.TORCH[:2] >= F2.MIN_TORCH
    assert F2.ShardedStates().ok
    assert F2.FSDPModule is not None and hasattr(F2.FSDPModule, "_set_unshard_async_op")


@pytest.mark.compat
def test_checkpoint_logger_is_the_one_dcp_logs_its_saves_to():
    """The recorder finds torch.distributed.checkpoint's saves on its logger, by name before DCP is imported (the
    import then configures that same logger) and by object after; its save and async_save log through it."""
    import logging

    from fsdp_doctor.record import fsdp2 as F2

    by_name = F2.dcp_logger()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import logger as dcp_log

    assert by_name is dcp_log._dcp_logger is F2.dcp_logger() is logging.getLogger(F2.DCP_LOGGER_NAME)
    for fn in (dcp.save, dcp.async_save):
        assert fn.__code__.co_name == "wrapper" and "msg_dict" in fn.__code__.co_varnames, fn  # _dcp_method_logger


def test_merged_saves_count_a_save_inside_another_once():
    """A DCP save inside doctor.checkpointing() (or a driver's save) is one save, asynchronous where DCP says so."""
    from fsdp_doctor.record.tracker import merged_saves

    assert merged_saves([(0, 100, None), (10, 90, True)]) == [(0, 100, True)]
    assert merged_saves([(10, 90, False), (0, 100, None)]) == [(0, 100, False)]
    assert merged_saves([(0, 50, True), (40, 120, False)]) == [(0, 120, False)]  # one sync inside: not asynchronous
    assert merged_saves([(0, 50, None), (60, 70, True)]) == [(0, 50, None), (60, 70, True)]
    # one after another with none of the model's work between them (accelerate's save_state: the model's and the
    # optimizer's torch.distributed.checkpoint saves, counted as 2 saves each time by a new-user trial): one save;
    # after the last optimizer step (100) or before the first forward (1000)
    assert merged_saves([(200, 300, None), (310, 400, None)], 1000, 100) == [(200, 400, None)]
    assert merged_saves([(10, 20, None), (30, 40, None)], 1000, 500) == [(10, 40, None)]
    # the model ran between them (a save before the forward, another after the optimizer step): two saves
    assert merged_saves([(10, 20, None), (600, 700, None)], 100, 500) == [(10, 20, None), (600, 700, None)]


def test_labels_this_torch_lacks_are_listed():
    lacking = F2.labels_unavailable()
    assert set(lacking) <= set(F2.LABELS_MISSING_IN)
    if F2.TORCH[:2] == (2, 13):
        assert lacking == []  # the pinned torch has both


def test_unknown_reaches_the_report_the_terminal_and_the_dashboard(sample_run_path):
    """A run recorded on a torch whose sizes could not be read: the report lists why, the rules that need
    them stay quiet with a reason, and the unit tables say unknown instead of 0."""
    from rich.console import Console

    from dashboards.pages.units import unit_rows
    from fsdp_doctor import load_run
    from fsdp_doctor.analyze import build_report
    from fsdp_doctor.present.terminal import render_units

    run = load_run(sample_run_path)
    line = "torch 9.9.9: cannot read FSDPParam._orig_size; parameter counts unknown"
    for rd in run.ranks.values():
        for u in rd.config.units:
            u.param_count = u.sharded_bytes = u.unsharded_bytes = u.unshard_async_op = None
        rd.config.unavailable = [line]
    report = build_report(run, traces=False)
    assert line in report.problems
    skipped = [p for p in report.problems if " not checked: " in p]
    assert any(p.startswith("prefetch.sync_unshard not checked") for p in skipped)
    assert not [f for f in report.findings if f.code.startswith(("wrap.", "prefetch.", "reshard."))]
    con = Console(width=100, record=True)
    con.print(render_units(report.units))
    text = con.export_text()
    assert "unknown" in text and "0.00 M" not in text
    rows = unit_rows(report.units)
    assert all(r["params"] == "unknown" and r["shard"] == "unknown" and r["async"] == "unknown" for r in rows)


def test_consistency_check_names_the_mismatch():
    from fsdp_doctor.record.units import consistency_problem
    from fsdp_doctor.records import UnitConfig

    model = nn.Linear(2, 2)  # 6 parameters, no unit manages them

    def cfg(n):
        return UnitConfig(name="u", modules=["u"], is_root=True, param_count=n, n_params=0, sharded_bytes=0,
                          unsharded_bytes=0, orig_dtypes=[])

    assert consistency_problem(model, [], [cfg(0)]) is None
    line = consistency_problem(model, [], [cfg(5)])
    assert line.startswith(f"torch {F2.TORCH_STR}: unit parameter counts do not add up") and "\n" not in line
    assert "5 + unmanaged 6 != model 6" in line
    assert consistency_problem(model, [], [cfg(None)]) is None  # unknown counts are reported as unknown, once


def test_unmeasured_memory_category_is_unknown_not_zero(sample_run_path):
    from rich.console import Console

    from fsdp_doctor import load_run
    from fsdp_doctor.analyze.memory import analyze_memory
    from fsdp_doctor.present.memory import render_memory

    run = load_run(sample_run_path)
    for rd in run.ranks.values():
        for s in rd.steps:
            if s.memory:
                s.memory.unknown = ["comm_buffers"]  # what the probe writes when CommReader is not ok
    mem = analyze_memory(run)
    assert all(pr.unknown_categories == ["comm_buffers"] for pr in mem.per_rank.values())
    con = Console(width=100, record=True)
    con.print(render_memory(mem))
    row = next(line for line in con.export_text().splitlines() if line.strip().startswith("comm buffers"))
    assert "unknown" in row and "B" not in row.replace("buffers", "")


def test_unsupported_torch_is_one_sentence_from_watch(monkeypatch, tmp_path, caplog):
    """One logged sentence, and the doctor steps aside: nothing raised into the loop, nothing written (it raised
    WatchError, ending a new-user trial's job before its first step; training on is tests/test_record_seams.py's)."""
    import fsdp_doctor

    monkeypatch.setattr(F2, "TORCH", (2, 5, 1))
    monkeypatch.setattr(F2, "TORCH_STR", "2.5.1")
    with caplog.at_level("WARNING", logger="fsdp_doctor"):
        with fsdp_doctor.watch(nn.Linear(2, 2), out_dir=tmp_path / "run") as doc:
            doc.step()
    (msg,) = [m for m in caplog.messages if "not supported" in m]
    assert "torch 2.5.1 is not supported" in msg and "2.6" in msg and "\n" not in msg
    assert msg.endswith("watch() records nothing and training goes on") and not (tmp_path / "run").exists()


@pytest.mark.compat
def test_autocast_copies_of_parameters_are_told_apart_on_this_torch():
    """What the memory probe reads of torch.autocast: its dtype at the forward, and its cast of a parameter saved
    for backward (a _to_copy node whose input is the parameter's gradient accumulator), counted once; none for the
    activations, and none for a parameter that is not one of FSDP's unsharded ones."""
    import torch
    import torch.nn as nn

    from fsdp_doctor.record.memory.activations import SavedTensors

    # (the first layer's input needs no gradient: autograd saves its input, not its weight's copy)
    first, lin, other = nn.Linear(16, 32), nn.Linear(32, 48), nn.Linear(48, 8)
    assert F2.autocast_dtype("cpu") is None
    acts = SavedTensors(set(), True, {lin.weight.untyped_storage()._cdata})  # `other` stands for an unmanaged one
    acts.autocast = True
    acts.push()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert F2.autocast_dtype("cpu") == "bfloat16"
            y = other(lin(first(torch.randn(4, 16)).relu()).relu())
    finally:
        acts.pop()
    assert acts.live.cast == 2 * lin.weight.numel() and acts.live.cast_dtype == "bfloat16"
    assert acts.live.bytes > acts.live.cast  # the activations besides
    y.float().sum().backward()
    assert acts.live.cast == 0 and acts.live.bytes == 0  # released by the backward
