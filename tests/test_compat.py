"""Every supported torch gives the same numbers: the recorded 2-rank run (conftest's ``recorded_run``)
against the analytic sizes and a known-answer fixture recorded with the pinned torch.

These tests are marked ``compat``: ``make test`` runs them on the pinned torch (so the fixture cannot go
stale) and ``make test-compat`` runs them on torch 2.6.0 and 2.15.0 (each in its own environment). The
fixture is rewritten, on the pinned torch only, by ``python tests/test_compat.py --write``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.compat

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "compat_known_answer.json"
PINNED = "2.13.0"
# fields of UnitConfig compared field for field with the pinned torch
UNIT_FIELDS = ("name", "modules", "is_root", "param_count", "n_params", "sharded_bytes", "unsharded_bytes",
               "orig_dtypes", "param_dtype", "reduce_dtype", "reshard_after_forward", "forward_prefetch",
               "backward_prefetch", "unshard_async_op", "offload", "checkpoint", "param_groups", "depth", "parent")
# memory categories at the peak agree within this share of the pinned figure (kernels of another release
# may save a slightly different set of tensors for backward)
CATEGORY_TOLERANCE = 0.03


def _units(run) -> list[dict]:
    cfg = run.ranks[0].config
    return [{k: getattr(u, k) for k in UNIT_FIELDS} for u in cfg.units]


def _peak(run) -> dict:
    from fsdp_doctor.analyze.memory import analyze_memory

    pr = analyze_memory(run).per_rank["0"]
    return {"peak_bytes": pr.peak_bytes, "breakdown": pr.peak_breakdown, "at": [pr.peak_at.unit, pr.peak_at.phase]}


def _trace_rows(run) -> dict:
    from fsdp_doctor.trace import analyze_traces

    ov = analyze_traces(run.trace_files)
    rows = sorted({(r.unit, r.collective) for r in ov.per_unit})
    return {"ranks": sorted(ov.per_rank), "unit_collectives": [list(r) for r in rows],
            "skipped": [s.file for s in ov.skipped]}


def known_answer(run) -> dict:
    import torch

    return {"torch": torch.__version__.split("+")[0], "units": _units(run), "rank0_peak": _peak(run),
            "trace": _trace_rows(run)}


def _fixture() -> dict:
    return json.loads(FIXTURE.read_text())


def test_no_unreadable_internals(recorded_run):
    """Every private field the doctor reads exists on this torch: nothing is reported unknown."""
    from fsdp_doctor.record import fsdp2 as F2
    from fsdp_doctor.records import SET_RESHARD_AFTER_FORWARD

    run, _, _ = recorded_run
    cfg = run.ranks[0].config
    assert cfg.unavailable == []
    assert set(cfg.torch_lacks) <= {f"label {lab}" for lab in F2.LABELS_MISSING_IN} | {
        "torch._C._autograd._top_saved_tensors_default_hooks (saved-tensor hooks found by a probe op)",
        SET_RESHARD_AFTER_FORWARD}
    # torch 2.6's FSDPModule has no public set_reshard_after_forward (eval.regather's switch): listed where missing
    assert (SET_RESHARD_AFTER_FORWARD in cfg.torch_lacks) == (not hasattr(F2.FSDPModule, "set_reshard_after_forward"))
    for rd in run.ranks.values():
        assert all(not (s.memory and s.memory.unknown) for s in rd.steps)


def test_units_match_analytic_sizes(recorded_run):
    from fsdp_doctor.workloads import WorkloadConfig
    from fsdp_doctor.workloads.sharding import analytic_param_counts

    run, _, knobs = recorded_run
    world = run.world_size
    expected = analytic_param_counts(WorkloadConfig(**knobs))
    units = {u["name"]: u for u in _units(run)}
    assert {n: u["param_count"] for n, u in units.items()} == expected
    cfg = run.ranks[0].config
    assert cfg.model_param_count == sum(expected.values())
    assert cfg.unmanaged_param_bytes == 0
    for name, u in units.items():
        assert u["unsharded_bytes"] == 4 * expected[name]  # fp32, gathered
        # this rank's shard: 1/world of the gathered bytes plus FSDP's dim-0 padding (< one row per param)
        assert u["unsharded_bytes"] / world <= u["sharded_bytes"] < u["unsharded_bytes"] / world + 4 * 1024 * 8
    assert units["layers.0"]["reshard_after_forward"] is True and units["norm, lm_head"]["reshard_after_forward"] is False
    assert units["layers.0"]["unshard_async_op"] is True


def test_unit_snapshot_matches_pinned_torch(recorded_run):
    run, _, _ = recorded_run
    assert _units(run) == _fixture()["units"]


def _peak_misses(run) -> list:
    """How rank 0's peak differs from the pinned one (where it lies, a category or the total past the tolerance)."""
    got, want = _peak(run), _fixture()["rank0_peak"]
    miss = [("at", got["at"], want["at"])] if got["at"] != want["at"] else []
    if set(got["breakdown"]) != set(want["breakdown"]):
        miss.append(("categories", sorted(got["breakdown"]), sorted(want["breakdown"])))
    for cat, w in want["breakdown"].items():
        if abs(got["breakdown"].get(cat, 0) - w) > CATEGORY_TOLERANCE * max(w, 1):
            miss.append((cat, got["breakdown"].get(cat), w))
    if abs(got["peak_bytes"] - want["peak_bytes"]) > CATEGORY_TOLERANCE * want["peak_bytes"]:
        miss.append(("peak_bytes", got["peak_bytes"], want["peak_bytes"]))
    return miss


def test_peak_memory_matches_pinned_torch(recorded_run, tmp_path):
    """Rank 0's peak: where it lies, and each category within 3% of the pinned figures. A miss records the run once
    more: gloo's worker thread can free a finished all-gather's output past FSDP's release of it, which a full
    memory step on a loaded host counts (tests/scenario_matrix.py run_matrix); a real difference misses twice."""
    from conftest import record_again

    run, _, knobs = recorded_run
    miss = _peak_misses(run)
    if miss:
        again = _peak_misses(record_again(tmp_path, knobs)[1])
        assert not again, (again, "first run:", miss)


def test_kineto_traces_of_this_torch_analyze_like_pinned(recorded_run):
    """``analyze`` of the Kineto traces this torch wrote: every rank read, the same units' collectives."""
    run, _, _ = recorded_run
    assert run.trace_files, "the recorded run has no profiler window"
    got = _trace_rows(run)
    assert got == _fixture()["trace"]


if __name__ == "__main__" and "--write" in sys.argv:
    import tempfile

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from conftest import record

    from fsdp_doctor import ProfileSchedule

    assert torch.__version__.split("+")[0] == PINNED, f"write the fixture with the pinned torch {PINNED}"
    with tempfile.TemporaryDirectory() as d:  # the same run as conftest's recorded_run
        _, run = record(Path(d), watch_extra={"profile": ProfileSchedule(first=6, active=2, warmup=1, every=0)},
                        steps=16, async_unshard=True)
        FIXTURE.parent.mkdir(exist_ok=True)
        FIXTURE.write_text(json.dumps(known_answer(run), indent=1) + "\n")
    print(f"wrote {FIXTURE}")
