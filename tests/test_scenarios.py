"""Scenario suite: real 2-rank runs of the reference workload, each with one deliberate problem, diagnosed
end to end (recorder -> report -> rules). Each problem must yield its code at warning level or above; the
tuned baseline must yield no warning at all.

The runs are short (8-12 steps) and most skip the profiler (the rules they exercise read host timings,
memory and the config); the baseline and the synchronous-unshard runs are profiled so that the trace-based
evidence is exercised too. Thresholds are meant to hold on a noisy shared 2-core host.
"""

from __future__ import annotations

import pytest

from conftest import record

pytestmark = pytest.mark.slow

MiB = 1 << 20
STEPS = 8
_ORDER = {"info": 0, "warning": 1, "critical": 2}
# The step-jitter family reads timing differences between ranks and steps, which a shared host produces by
# itself now and then; the baseline counts such a warning only if it shows up in a second run too.
NOISE_CODES = {"straggler.rank", "straggler.intermittent", "jitter.gc", "jitter.data_wait", "prefetch.exposed_allgather"}


def _profile():
    from fsdp_doctor import ProfileSchedule

    return ProfileSchedule(first=4, active=1, warmup=1, every=0)


def _diagnose(tmp_path, name, *, profile=False, watch_extra=None, steps=STEPS, **knobs):
    from fsdp_doctor.analyze import build_report

    extra = {"profile": _profile() if profile else False}
    extra.update(watch_extra or {})
    losses, run = record(tmp_path / name, watch_extra=extra, steps=steps, **knobs)
    assert all(len(x) == steps for x in losses)
    report = build_report(run)
    print(f"\n[{name}] " + ", ".join(f"{f.code}:{f.severity}" for f in report.findings))
    return report


def _codes(report, min_sev="warning"):
    return {f.code for f in report.findings if _ORDER[f.severity] >= _ORDER[min_sev]}


def _finding(report, code):
    return next(f for f in report.findings if f.code == code)


SCENARIOS = {
    # name: (knobs, watch_extra, expected code)
    "whole": (dict(wrap="whole", async_unshard=True), None, "wrap.too_coarse"),
    "leaf": (dict(wrap="leaf", async_unshard=True), None, "wrap.too_fine"),
    "blocks_only": (dict(wrap="blocks_only", async_unshard=True), None, "wrap.params_in_root"),
    "no_root": (dict(wrap="no_root", async_unshard=True), None, "wrap.root_not_sharded"),
    "optimizer_before_shard": (dict(optimizer_before_shard=True, async_unshard=True), None, "optim.before_shard"),
    "tight_capacity": (dict(batch_size=8, async_unshard=True), {"capacity_bytes": 12 * MiB}, "ac.recommended"),
    "ac_ample_capacity": (dict(ac="block", async_unshard=True), {"capacity_bytes": 8 << 30}, "ac.unneeded"),
    "straggler": (dict(async_unshard=True, sleep_rank=1, sleep_ms=150.0), None, "straggler.rank"),
    "gc_garbage": (dict(async_unshard=True, gc_garbage=200_000), None, "jitter.gc"),
    "slow_loader": (dict(async_unshard=True, loader_ms=150.0), None, "jitter.data_wait"),
}


# ac.unneeded's severity follows the measured recompute share of the step (warning from 5%): on this CPU workload
# the blocks' recompute is ~7% of the step, so a loaded host can put it under the line; the finding is the point
MIN_SEVERITY = {"ac_ample_capacity": "info"}


# the scenarios whose findings need few steps and no timing luck also run on the ends of the torch range
COMPAT = {"whole", "blocks_only", "no_root", "optimizer_before_shard"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.compat) if n in COMPAT else n for n in SCENARIOS])
def test_scenario_yields_its_code(tmp_path, name):
    knobs, extra, code = SCENARIOS[name]
    report = _diagnose(tmp_path, name, watch_extra=extra, **knobs)
    assert code in _codes(report, MIN_SEVERITY.get(name, "warning")), \
        f"{name}: expected {code}, got {[(f.code, f.severity) for f in report.findings]}"
    f = _finding(report, code)
    assert f.evidence and f.recommendation.text
    if code.startswith(("wrap.", "ac.", "optim.", "prefetch.")):
        assert f.recommendation.code, code


@pytest.mark.compat
def test_sync_unshard_on_gloo(tmp_path):
    report = _diagnose(tmp_path, "sync", profile=True, async_unshard=False)
    assert "prefetch.sync_unshard" in _codes(report)
    f = _finding(report, "prefetch.sync_unshard")
    assert f.evidence["units_sync"] == 6
    assert f.evidence["blocking_calls"], "the trace should show the host blocked in all-gathers"
    assert "_set_unshard_async_op(True)" in f.recommendation.code
    # the exposed all-gathers are reported, but point at the synchronous unshard first
    for g in report.findings:
        if g.code == "prefetch.exposed_allgather":
            assert g.severity == "info"


def test_specific_evidence(tmp_path):
    """Names from the model itself end up in the recommendations (one run, several checks)."""
    report = _diagnose(tmp_path, "leaf2", wrap="leaf", async_unshard=True, steps=6)
    f = _finding(report, "wrap.too_fine")
    assert "model.layers" in f.recommendation.code
    assert f.evidence["units"] >= 24


def test_tuned_baseline_is_healthy(tmp_path):
    report = _diagnose(tmp_path, "baseline", profile=True, steps=12, async_unshard=True, wrap="block")
    warned = _codes(report)
    if warned and warned <= NOISE_CODES:  # host noise: it must reproduce to count
        again = _diagnose(tmp_path, "baseline_again", profile=True, steps=12, async_unshard=True, wrap="block")
        warned &= _codes(again)
    assert warned == set(), [(f.code, f.severity, f.title) for f in report.findings]
    # the terminal presenter then says so plainly
    from io import StringIO

    from rich.console import Console

    from fsdp_doctor.present.terminal import render_findings

    buf = StringIO()
    Console(file=buf, width=100).print(render_findings([f for f in report.findings if f.code not in warned]))
    # "Healthy" only with no finding at all; notes (info) are announced as such, never as "healthy" (issue #13)
    assert buf.getvalue().startswith(("Healthy: no findings.", "No warnings; "))
