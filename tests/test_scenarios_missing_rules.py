"""The rules issue #23 found missing, each planted in a real 2-rank gloo run of the reference workload (or read
from the real GPU traces under shared/reference_traces/hta), with evidence, fix and prediction checked against
what the run measured."""

from __future__ import annotations

import pytest

from conftest import HTA_TRACES, record

pytestmark = pytest.mark.slow

MiB = 1 << 20
_ORDER = {"info": 0, "warning": 1, "critical": 2}


def _report(tmp_path, name, *, profile=False, steps=6, watch_extra=None, **knobs):
    from fsdp_doctor import ProfileSchedule
    from fsdp_doctor.pipeline import build_report

    extra = {"profile": ProfileSchedule(first=3, active=1, warmup=1, every=0) if profile else False}
    extra.update(watch_extra or {})
    _, run = record(tmp_path / name, watch_extra=extra, steps=steps, async_unshard=True, **knobs)
    report = build_report(run)
    print(f"\n[{name}] " + ", ".join(f"{f.code}:{f.severity}" for f in report.findings))
    return report


def _finding(report, code, min_sev="warning"):
    hits = [f for f in report.findings if f.code == code and _ORDER[f.severity] >= _ORDER[min_sev]]
    assert hits, f"expected {code}, got {[(f.code, f.severity) for f in report.findings]}; " + \
        next((f"{s.status}: {s.reason}" for s in report.rules if s.code == code), "")
    return hits[0]


def _status(report, code):
    return next(s for s in report.rules if s.code == code)


def test_grad_accumulation_without_no_sync(tmp_path):
    """4 micro-batches per optimizer step, gradient sync on for each: 4 reduce-scatters per unit per step in the
    trace; the fix (sync on the last micro-batch only) is predicted to save 3/4 of the reduce-scatters' exposed
    time and to hold the unsharded gradients. With the fix applied the rule counts 1 and is quiet."""
    report = _report(tmp_path, "accum", profile=True, grad_accum=4)
    f = _finding(report, "accum.sync_every_micro_batch")
    ev = f.evidence
    assert ev["reducescatters_per_unit_per_step"] == 4 and ev["micro_batches_per_step"] == 4
    assert ev["units"] == 6  # tok_emb+pos_emb, 4 blocks, norm+lm_head (the root holds no parameters)
    assert ev["saved_ms_per_step"] == pytest.approx(0.75 * ev["reducescatter_exposed_ms_per_step"], rel=1e-3)
    rec = f.recommendation
    assert "model.set_requires_gradient_sync(is_last_micro_batch)" in rec.code and "(4 per optimizer step" in rec.code
    assert rec.where == "loop" and list(rec.inputs) == ["is_last_micro_batch"]
    p = f.predicted
    assert p.step_ms_delta < 0 and p.peak_bytes_delta == ev["unsharded_grads_bytes"] > 0
    fixed = _report(tmp_path, "accum_no_sync", profile=True, grad_accum=4, accum_no_sync=True)
    st = _status(fixed, "accum.sync_every_micro_batch")
    assert st.status == "quiet" and st.reason.startswith("1 reduce-scatter per unit per step over 4 micro-batches")


def test_zero_grad_not_to_none_keeps_gradients(tmp_path, recorded_run):
    """zero_grad(set_to_none=False): every gradient shard is allocated when the next step starts. The predicted
    peak with set_to_none=True is checked against the same workload run that way (the shared recorded run)."""
    report = _report(tmp_path, "zero_grad", zero_grad_to_none=False, watch_extra={"capacity_bytes": 18 * MiB})
    f = _finding(report, "memory.grads_kept")
    assert f.evidence["grads_kept_bytes"] == 1_865_216  # the model's sharded fp32 parameters' size, per rank
    assert "set_to_none=True" in f.recommendation.code
    from fsdp_doctor.pipeline import build_report

    run, _, _ = recorded_run
    base = build_report(run, traces=False)
    measured = base.memory.peak_bytes
    assert f.predicted.peak_bytes_after == pytest.approx(measured, rel=0.02)
    assert f.predicted.peak_bytes_after < f.predicted.peak_bytes_before
    assert _status(base, "memory.grads_kept").status == "quiet"


def test_reduce_dtype_narrower_than_params(tmp_path, recorded_run):
    report = _report(tmp_path, "bf16_reduce", reduce_dtype="bf16")
    f = _finding(report, "numerics.reduce_dtype")
    assert f.evidence["reduce_dtype"] == "bfloat16" and f.evidence["param_dtypes"] == ["float32"]
    assert f.evidence["units_narrow"] == 6 and f.evidence["reduce_dtype_explicit"] is True
    assert "reduce_dtype=torch.float32" in f.recommendation.code
    from fsdp_doctor.pipeline import build_report

    run, _, _ = recorded_run  # fp32 reduction: quiet
    assert _status(build_report(run, traces=False), "numerics.reduce_dtype").status == "quiet"


def test_near_capacity_with_no_dominant_category(tmp_path):
    """reshard_after_forward=False on every unit, one sequence per rank, a budget 5% above the peak: no category
    holds 40% of the peak, so only the reshard lever is left; its predicted peak (from the timeline) is checked
    against the same run with the default resharding."""
    knobs = dict(batch_size=1, reshard_after_forward=False)
    probe = _report(tmp_path, "raf_probe", steps=4, **knobs)
    cap = int(probe.memory.peak_bytes / 0.95)
    report = _report(tmp_path, "raf_tight", steps=4, watch_extra={"capacity_bytes": cap}, **knobs)
    f = _finding(report, "memory.near_capacity_spread")
    assert f.evidence["largest_category_pct"] < 40
    assert f.units and "norm, lm_head" not in f.units  # the last unit of forward stays gathered
    assert all(".set_reshard_after_forward(True, recurse=False)" in line
               for line in f.recommendation.code.splitlines())
    fixed = _report(tmp_path, "raf_default", steps=4, batch_size=1, watch_extra={"capacity_bytes": cap})
    assert f.predicted.peak_bytes_after == pytest.approx(fixed.memory.peak_bytes, rel=0.02)
    assert _status(fixed, "memory.near_capacity_spread").status == "quiet"


@pytest.mark.parametrize("name,bound", [("cpu_only_gloo", "communication"), ("a100_sendrecv_16rank_rank0", "idle")])
def test_severe_verdict_is_a_finding_on_real_traces(name, bound):
    """The real traces the issue saw reported "Healthy: no findings." under 85% communication and 70% idle (the
    73% host-bound one: kernels.launch_bound, test_kernel_rules): the verdict is now the finding, with the
    levers for that bound and the bound as its prediction."""
    from fsdp_doctor.pipeline import build_report
    from fsdp_doctor.present.fmt import findings_headline
    from fsdp_doctor.store import load_run

    path = HTA_TRACES / name
    if not path.exists():
        pytest.skip(f"{path} is missing")
    report = build_report(load_run(path))
    f = _finding(report, "verdict.severe")
    assert f.evidence["bound"] == bound and f.evidence["bound_pct"] >= 50
    assert f.predicted.step_ms_after == pytest.approx(f.evidence["step_ms"] - f.evidence["bound_ms_per_step"], abs=1e-3)
    # neither trace shows an FSDP module tree (a gloo all-reduce run, DDP send/recv): the levers in words only
    assert f.recommendation.text and f.recommendation.code == ""
    assert not findings_headline(report.findings).startswith("Healthy")


def test_intermittent_straggler(tmp_path):
    """Rank 1 stalls 300 ms before the forward of steps 3, 5 and 7 of 9: late in 3 of the 7 steady steps, not a
    consistent straggler; the finding names the rank, the steps and the phase (outside the model). (A stall
    must clear 30% of the median step's own time to count: on this loaded host steps take 400-700 ms, where
    150 ms stalls were borderline.)"""
    # memory counted op by op leaves its steps out of step statistics (record/memory/transients.py): in a 9-step
    # run that would be 3 of them; this test is about the timing rule, so every step stays in
    report = _report(tmp_path, "intermittent", steps=9, sleep_rank=1, sleep_ms=300.0, sleep_steps=[3, 5, 7],
                     watch_extra={"memory": {"transients": False}})
    f = _finding(report, "straggler.intermittent", "info")
    ev = f.evidence
    assert ev["rank"] == 1 and f.ranks == [1]
    late = dict(zip(ev["late_steps"], ev["late_excess_ms"]))
    planted = {st: x for st, x in late.items() if st in (3, 5, 7)}
    assert len(planted) >= 2 and len(late) - len(planted) <= 1, late  # host noise may add one step
    assert ev["phase"] == "outside"
    assert all(x >= 200 for x in planted.values()), late  # each planted step carries most of the 300 ms stall
    assert f.predicted.step_ms_delta == pytest.approx(-ev["cost_ms_per_step"], abs=1e-3)
    assert "straggler.rank" not in {g.code for g in report.findings}  # 3 of 7 steps: not consistent
