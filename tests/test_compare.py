"""``fsdp-doctor compare``: two runs side by side (fsdp_doctor.analyze.compare).

Known answers first: the GPU trace pair with and without forward prefetch (tests/trace_fixtures.py), whose
exposure per unit is known to the µs. Then real 2-rank gloo runs of the reference workload: two runs of one
configuration say "no significant change"; ZeRO-3 against the ZeRO-2 run that applies the finding's fix shows
the configuration change, the memory change the finding predicted, and the finding resolved.
"""

from __future__ import annotations

import json
import os

import msgspec
import numpy as np
import pytest

from conftest import HTA_TRACES, async_gather_slack, record
from fsdp_doctor import load_run
from fsdp_doctor.analyze import compare as C
from fsdp_doctor.cli import main
from fsdp_doctor.compare_sections import Comparison
from fsdp_doctor.pipeline import build_report, compare_runs, compare_side
from trace_fixtures import ProfileWindow, gloo_gather_trace, gpu_known_trace


@pytest.fixture(scope="module")
def prefetch_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("prefetch_pair")
    for name, prefetch in (("off", False), ("on", True)):
        for rank in (0, 1):
            gpu_known_trace(rank=rank, steps=(1, 2, 3, 4), prefetch=prefetch).write(d / name / f"rank{rank}.json")
    return d / "off", d / "on"


def _row(cmp, unit, collective, phase):
    return next(r for r in cmp.comm if (r.unit, r.collective, r.phase) == (unit, collective, phase))


def test_plain_trace_pair_shows_the_exposure_removed_per_unit(prefetch_pair):
    a, b = prefetch_pair
    cmp = compare_runs(load_run(a), load_run(b))
    assert (cmp.a.source, cmp.b.source) == ("trace", "trace")
    # the configuration change read from FSDP2's labels: layers.1 prefetched in forward
    assert [(c.key, c.a, c.b, c.units) for c in cmp.config] == [("forward_prefetch", False, True, ["layers.1"])]
    # per unit and phase (ms per step): layers.1's forward all-gather went from 100 µs exposed to hidden;
    # nothing else moved
    assert (_row(cmp, "layers.1", "all_gather", "forward").a_ms, _row(cmp, "layers.1", "all_gather", "forward").b_ms) \
        == (0.1, 0.0)
    assert all(r.delta_ms == 0.0 for r in cmp.comm if (r.unit, r.phase) != ("layers.1", "forward"))
    assert (cmp.comm_exposed.a, cmp.comm_exposed.b) == (0.39, 0.29)  # comm 500 − overlap 110 / 210 µs
    assert cmp.phases["allgather_fwd"].delta == pytest.approx(-0.1)
    # the fix A's report recommended, recognised from the config diff; the step (1 ms by construction) did
    # not move, so the predicted −10% lands inside the 10% tolerance
    (p,) = cmp.predictions
    assert p.code == "prefetch.exposed_allgather" and p.recognised_by == "config diff: forward_prefetch"
    assert p.step_ms_measured == 1.0 and p.step_ms_predicted < 1.0
    # kernels per phase: layers.1's forward compute is 20 µs without prefetch, 100 µs with it
    (k,) = [o for o in cmp.ops if o.phase == "forward"]
    assert (k.kind, k.a_us, k.b_us) == ("kernel", 220.0, 300.0)
    # steps: 1000 µs each on both sides, 4 complete steps × 2 ranks (the 5th, last, is dropped)
    assert cmp.step_p50.samples_a == cmp.step_p50.samples_b == 8 and not cmp.step_p50.significant
    assert "no significant change" in cmp.summary
    assert {f.code for f in cmp.findings.persisting} >= {"prefetch.exposed_allgather"}


def test_cli_compare_writes_json_and_html(prefetch_pair, tmp_path, capsys):
    a, b = prefetch_pair
    rc = main(["compare", str(a), str(b), "--json", str(tmp_path / "c.json"), "--html", str(tmp_path / "c.html"),
               "--gpu-hour-price", "2.5", "--applied", "comm.exposed_reducescatter"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "Configuration changed" in out and "forward_prefetch" in out and "within noise" in out
    back = msgspec.convert(json.loads((tmp_path / "c.json").read_text()), Comparison)
    assert back == C.compare(compare_side(load_run(a)), compare_side(load_run(b)), gpu_hour_price=2.5,
                             applied=["comm.exposed_reducescatter"], path_a=str(a), path_b=str(b))
    assert {p.code: p.recognised_by for p in back.predictions}["comm.exposed_reducescatter"] == "--applied"
    assert back.cost.gpu_hour_price == 2.5 and back.cost.a is None and "tokens/s unknown" in back.cost.note
    html = (tmp_path / "c.html").read_text()
    assert "fsdp-doctor-compare" in html and "Exposed communication" in html and "layers.1" in html


def test_cli_compare_bad_input_is_one_line(prefetch_pair, tmp_path, capsys):
    a, _ = prefetch_pair
    assert main(["compare", str(a), str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope" in err[0]
    assert main(["compare", str(a), str(a), "--gpu-hour-price", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--gpu-hour-price" in err[0]
    (tmp_path / "empty").mkdir()
    assert main(["compare", str(tmp_path / "empty"), str(a)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "empty" in err[0]
    # a report file onto a file of either run is refused before anything is written (a new-user trial's --html
    # onto B's record stream replaced it)
    _, b = prefetch_pair
    for side in (a, b):
        target = side / "rank0.json"
        before = target.read_bytes()
        assert main(["compare", str(a), str(b), "--html", str(target)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"fsdp-doctor: --html {target}: is one of the inputs being compared; give another file name"], err
        assert target.read_bytes() == before


def test_bootstrap_interval_known_answers():
    """A shift of 10 ms on 40 steps with 1 ms jitter is significant and its interval covers 10 ms; the same
    samples on both sides give an interval of exactly zero; a 2% shift is never a change (noise floor)."""
    rng = np.random.default_rng(1)
    base = [[100 + x, 100 + x] for x in rng.normal(0, 1, 40)]
    slower = [[v + 10 for v in s] for s in base]
    d = C._step_delta(base, slower, 50, np.random.default_rng(C.SEED))
    assert d.significant and d.delta == pytest.approx(10, abs=1e-9) and d.ci_low <= 10 <= d.ci_high
    same = C._step_delta(base, base, 50, np.random.default_rng(C.SEED))
    assert not same.significant and same.delta == 0
    tiny = C._step_delta(base, [[v + 2 for v in s] for s in base], 50, np.random.default_rng(C.SEED))
    assert tiny.ci_low > 0 and not tiny.significant  # outside the interval of zero, inside the noise floor
    assert "no significant change" in C.step_summary(tiny) and "noise floor" in C.step_summary(tiny)
    assert "within noise" in C.step_summary(same) and "slower" in C.step_summary(d)
    # A with slow outlier steps, B 72% faster: the interval is of B's step over A's, never below -100% (the
    # difference's interval set against A's p50 read "-72.3% (95% CI -103.4% to -41.2%)", a new-user trial's)
    a = [[500.0 + 10 * i] for i in range(5)] + [[1500.0 + 50 * i] for i in range(4)]
    b = [[222.0 + i] for i in range(9)]
    fast = C._step_delta(a, b, 50, np.random.default_rng(C.SEED))
    assert fast.a == 540.0 and fast.significant
    assert -fast.a < fast.ci_low < fast.delta < fast.ci_high < 0, fast
    assert " to -" in C.step_summary(fast) and "-10" not in C.step_summary(fast).split("CI")[1][:9]


def test_one_step_a_side_is_too_few_to_call_a_change():
    """A new-user trial compared two plain-trace runs of one profiled step each: "+84.4% (95% CI +84.4% to +84.4%):
    slower ... significant: yes" and a predicted gain "missed", from a zero-width interval. Under MIN_STEPS steps a
    side the change is said, never called significant, and a prediction against it is inconclusive; from 3 steps a
    side the interval decides again."""
    one_a, one_b = [[400.0, 401.0]], [[738.0, 739.0]]
    d = C._step_delta(one_a, one_b, 50, np.random.default_rng(C.SEED))
    # no interval from so few steps (it read "+7.44 ms … +89.6 ms" in the table under a summary saying 3 or more
    # steps a side give one: a new-user trial)
    assert (d.ci_low, d.ci_high) == (None, None) and not d.significant and d.reason == C.FEW_STEPS
    assert (d.steps_a, d.steps_b) == (1, 1)
    assert "too few steps to tell (A 1 step, B 1 step" in C.step_summary(d) and "slower" not in C.step_summary(d)
    assert C._step_verdict(-24.0, d, 376.0) == "inconclusive"
    three = C._step_delta(one_a * 3, one_b * 3, 50, np.random.default_rng(C.SEED))
    assert three.significant and three.steps_a == 3


def test_step_prediction_verdicts():
    """Against a measured change of −10 ms ± 2 ms on a 100 ms step: −10 held, −30 missed; against a measured
    interval of −12 … +12 ms, a predicted −10 ms is inconclusive and a predicted −1 ms (no change) held."""
    from fsdp_doctor.compare_sections import StepDelta

    m = StepDelta(a=100.0, b=90.0, delta=-10.0, pct=-10.0, ci_low=-12.0, ci_high=-8.0)
    assert C._step_verdict(-10.0, m, 90.0) == "held" and C._step_verdict(-30.0, m, 70.0) == "missed"
    wide = StepDelta(a=100.0, b=100.0, delta=0.0, pct=0.0, ci_low=-12.0, ci_high=12.0)
    assert C._step_verdict(-10.0, wide, 90.0) == "inconclusive" and C._step_verdict(-1.0, wide, 99.0) == "held"
    # a predicted -4.6% (under the floor, over half of it) in an interval of -55% ... +6%: no telling it from no
    # change (it read "held": a new-user trial)
    noisy = StepDelta(a=49.7, b=36.8, delta=-12.9, pct=-26.0, ci_low=-27.2, ci_high=2.8)
    assert C._step_verdict(-2.3, noisy, 47.4) == "inconclusive" and C._step_verdict(-1.0, noisy, 48.7) == "held"
    # a predicted -7.2% against a measured +1.9% (interval -2.0% … +8.5%): within 10% of B's step, but the other way
    # and outside the interval: missed (it read "held": a new-user trial); a predicted -2% (under the 5% noise floor)
    # within the tolerance still holds
    up = StepDelta(a=100.0, b=101.9, delta=1.9, pct=1.9, ci_low=-2.0, ci_high=8.5)
    assert C._step_verdict(-7.2, up, 92.8) == "missed" and C._step_verdict(-2.0, up, 98.0) == "held"
    # a predicted no change against +26% in an interval of -38% ... +119%: it tells neither a 20% slowdown nor a 20%
    # speedup from none (it read "held": a new-user trial); -12 ... +12 and -55% ... +6% still tell one side
    blind = StepDelta(a=141.1, b=177.1, delta=36.0, pct=25.5, ci_low=-53.6, ci_high=167.9)
    assert C._step_verdict(0.0, blind, 141.1) == "inconclusive"


# ------------------------------------------------------------------------------ real runs (2 gloo ranks)
def _half(src, dst, keep) -> None:
    """A copy of the run directory ``src`` holding only the steps ``keep`` accepts (every other record kept; the
    profiler windows left out, since their steps would be split between the halves)."""
    import shutil

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("profiler", "tb", "report.json"))
    for stream in dst.glob("rank*.records.jsonl"):
        lines = []
        for line in stream.read_bytes().splitlines(keepends=True):
            rec = json.loads(line)
            if rec.get("t") == "profile" or (rec.get("t") in ("step", "gpu") and not keep(rec["step"])):
                continue
            lines.append(line)
        stream.write_bytes(b"".join(lines))


def test_two_samples_of_one_config_say_no_significant_change(sample_run_path, tmp_path):
    """Two runs of one configuration: the even and the odd steps of one recorded run (step 0, the warm-up, left
    out of both), so that both saw the same host load. The run is the committed sample (traces/sample, 30 steps on
    2 gloo ranks), not one trained here: a 95% interval excludes zero for about 1 in 20 pairs of samples of one
    distribution (measured: 3-6% at 4 to 20 steps a side), so a test on a fresh run fails at random (it did once in
    CI, +38% on 4 and 5 steady steps under load), while on recorded steps the answer is fixed. Two runs trained one
    after the other differ by whatever else the host ran meanwhile (-24% and +29% were seen here under load): a
    difference of the host, which compare, finding no configuration change, calls run-to-run variation (the next
    test)."""
    _half(sample_run_path, tmp_path / "even", lambda n: n > 0 and n % 2 == 0)
    _half(sample_run_path, tmp_path / "odd", lambda n: n % 2 == 1)
    a, b = load_run(tmp_path / "even"), load_run(tmp_path / "odd")
    assert [s.step for s in a.ranks[0].steps] == list(range(2, 30, 2))
    cmp = compare_runs(a, b)
    print(f"\ntwo samples of one configuration: {cmp.summary}")
    assert cmp.config == []  # same snapshot, same job
    assert not cmp.step_p50.significant, cmp.summary
    assert cmp.summary.startswith("no configuration change found, and no significant change in step time")
    assert cmp.memory_peak.delta == 0  # CPU memory is deterministic per configuration
    # findings from the configuration and memory do not move; those from timings may cross a threshold
    timing = ("jitter.", "straggler.", "prefetch.", "comm.", "throughput.")
    moved = [x.code for x in cmp.findings.new + cmp.findings.resolved if not x.code.startswith(timing)]
    assert moved == [] and cmp.findings.persisting
    assert cmp.predictions == []  # nothing applied


def test_one_config_on_a_drifting_host_is_not_called_a_change(sample_run_path, tmp_path):
    """The sample's steady steps before step 10 (2, 3, 4 and 9) against those from 10 to 29: one configuration, one
    process, but the shared host's load moved (steady steps of 72 to 260 ms), so the later steps' p50 is 27.6% under
    the earlier ones' and the bootstrap interval (over steps within each side) excludes zero. compare called that "faster" and significant; with no
    configuration change it now says so, and that the difference is run-to-run variation of the host. Declaring a
    change (--applied one of A's findings) gives the statistical verdict back."""
    _half(sample_run_path, tmp_path / "early", lambda n: 0 < n < 10)
    _half(sample_run_path, tmp_path / "late", lambda n: n >= 10)
    a, b = compare_side(load_run(tmp_path / "early")), compare_side(load_run(tmp_path / "late"))
    cmp = C.compare(a, b)
    print(f"\nearly against late steps of one run: {cmp.summary}")
    s = cmp.step_p50
    assert cmp.config == [] and (s.pct, s.samples_a, s.samples_b) == (-27.6, 8, 40)
    assert s.ci_high < 0  # the interval excludes zero: the step-to-step noise alone does not explain it
    assert not s.significant and s.reason == C.NO_CHANGE
    assert cmp.summary.startswith("no configuration change found: step time p50 -27.6% (95% CI ")
    assert "run-to-run variation" in cmp.summary and "faster" not in cmp.summary
    assert cmp.predictions == []  # nothing changed: no fix to check
    from fsdp_doctor.present.compare import tables

    (step,) = [t for t in tables(cmp) if t.title == "Step time"]
    assert step.rows[0][-1] == C.NO_CHANGE and "8 rank-steps in A, 40 in B" in step.note
    assert "not the variation between two runs" in step.note
    # declaring a change (--applied one of A's findings): the optimizer step, which that change does not touch,
    # moved -55% (26.8 -> 12.1 ms) beside it: the host's speed changed, so the step's change is not the fix's alone
    # and its prediction is inconclusive (a new-user trial's rewrap read "+308%: slower", its prediction "missed",
    # while its optimizer step went 29.4 -> 79.8 ms)
    code = a.report.findings[0].code
    declared = C.compare(a, b, applied=[code])
    assert not declared.step_p50.significant and declared.step_p50.reason == C.HOST_CHANGED
    assert declared.summary.startswith("step time p50 -27.6% (95% CI ") and "not the change's alone: the optimizer " \
        "step, which this change does not touch, moved -55% too (26.8 -> 12.1 ms)" in declared.summary
    assert [(p.recognised_by, p.step_verdict) for p in declared.predictions] == [("--applied", "inconclusive")]
    # a fix in the user's loop leaves no configuration change to read (a new-user trial's accumulation fix read "no
    # configuration change found" beside the finding resolved): the summary names the warning gone and the flag
    import msgspec

    f0 = a.report.findings[0]
    a.report.findings.append(msgspec.structs.replace(f0, code="jitter.data_wait", severity="warning"))
    hinted = C.compare(a, b)
    assert hinted.summary.startswith(cmp.summary) and hinted.summary.endswith(
        "; A's jitter.data_wait is gone in B: for a fix applied in your loop (which compare cannot "
        "read), pass --applied jitter.data_wait to check its prediction"), hinted.summary
    a.report.findings.pop()
    # ... and a note's, where it predicted something (memory.grads_kept, an info finding fixed in the loop, read "no
    # configuration change found" alone); a note predicting nothing is not offered
    from fsdp_doctor.report_sections import Predicted

    a.report.findings.append(msgspec.structs.replace(f0, code="memory.grads_kept", severity="info",
                                                     predicted=Predicted(peak_bytes_before=100, peak_bytes_after=90)))
    assert C.compare(a, b).summary.endswith("pass --applied memory.grads_kept to check its prediction")
    a.report.findings[-1] = msgspec.structs.replace(a.report.findings[-1], predicted=Predicted())
    assert C.compare(a, b).summary == cmp.summary
    a.report.findings.pop()
    # one B could not look for (optim.step_comm reads a trace, and B has none) is not "gone"
    a.report.findings.append(msgspec.structs.replace(f0, code="optim.step_comm", severity="warning"))
    unchecked = C.compare(a, b)
    assert unchecked.summary == cmp.summary and [f.code for f in unchecked.findings.unchecked] == [
        "optim.step_comm"]
    a.report.findings.pop()
    # an --applied code A's report does not hold is no change: the verdict stays run-to-run variation
    bogus = C.compare(a, b, applied=["not.a.rule"])
    assert bogus.step_p50.reason == C.NO_CHANGE and bogus.summary == cmp.summary
    assert bogus.notes == ["--applied not.a.rule: A's report has no such finding, so no prediction to check"]


@pytest.mark.slow
def test_zero3_against_zero2_checks_the_prediction(recorded_run, tmp_path):
    run, _, knobs = recorded_run
    a = load_run(run.path)
    for rd in a.ranks.values():
        rd.config.capacity_bytes = 8 << 30  # a declared budget: the rule needs one
    side_a = compare_side(a)
    f = next(x for x in side_a.report.findings if x.code == "reshard.zero2_affordable")
    flipped = f.evidence["units_flipped"]
    _, b = record(tmp_path / "zero2", watch_extra={"profile": False, "capacity_bytes": 8 << 30}, steps=8,
                  async_unshard=knobs["async_unshard"], reshard_overrides={n: False for n in flipped})
    cmp = C.compare(side_a, compare_side(b))
    ch = next(c for c in cmp.config if c.key == "reshard_after_forward")
    assert (ch.a, ch.b) == (True, False) and set(ch.units) == set(flipped)
    (p,) = [p for p in cmp.predictions if p.code == "reshard.zero2_affordable"]
    assert p.recognised_by == "config diff: reshard_after_forward"
    pred = C.predicted_of(f)
    # the memory change equals the prediction, to one unit's gathered parameters (conftest.async_gather_slack)
    assert abs(cmp.memory_peak.delta - (pred["peak_bytes_after"] - pred["peak_bytes_before"])) \
        <= async_gather_slack(a)
    assert p.peak_held and abs(p.peak_pct_error) < 2.0
    assert "reshard.zero2_affordable" in {x.code for x in cmp.findings.resolved}
    assert cmp.memory["unsharded_params"].delta > 0


def test_dashboard_compare_page(prefetch_pair):
    """The Compare page lists the served run's siblings and draws the same comparison as the CLI."""
    from types import SimpleNamespace

    from fsdp_doctor.dashboards.app import create_app
    from fsdp_doctor.dashboards.pages import PAGES
    from fsdp_doctor.dashboards.pages import compare as page

    a, b = prefetch_pair
    assert set(page.candidates(b)) == {a.resolve(), b.resolve()}
    app = create_app(b)
    assert "cmp-body.children" in app.callback_map and PAGES["compare"][1] is page
    lay = page.layout(SimpleNamespace(path=b), None)
    pickers = lay[0].children[1].children  # one Div per run: its label and its dropdown
    dropdowns = {d.id: d.value for div in pickers for d in div.children if getattr(d, "id", None)}
    assert dropdowns == {"cmp-a": str(a.resolve()), "cmp-b": str(b.resolve())}
    out = page.body(str(a.resolve()), str(b.resolve()))
    cmp = compare_runs(load_run(a.resolve()), load_run(b.resolve()))
    assert out[0].children == cmp.summary
    titles = [s.children[0].children for s in out[1:] if s.children[0].children]
    assert "Configuration changed" in titles and any(t.startswith("Exposed communication") for t in titles)
    assert page.body(str(a), str(a))[0].id == "cmp-same"
    # served: /compare lays out the pickers, and the pickers' callback answers over HTTP
    c = app.server.test_client()

    def update(output: str, **inputs) -> str:
        """What the served app answers to a change of ``inputs`` ({"component.prop": value})."""
        cid, prop = output.split(".")
        body = {"output": output, "outputs": {"id": cid, "property": prop}, "state": [],
                "inputs": [{"id": k.split(".")[0], "property": k.split(".")[1], "value": v} for k, v in inputs.items()],
                "changedPropIds": [next(iter(inputs))]}
        r = c.post("/_dash-update-component", json=body)
        assert r.status_code == 200, r.data[:300]
        return r.get_data(as_text=True)

    text = update("page.children", **{"url.pathname": "/compare", "url.search": "", "version.data": 1})
    assert "cmp-a" in text and "cmp-body" in text
    text = update("cmp-body.children", **{"cmp-a.value": str(a.resolve()), "cmp-b.value": str(b.resolve())})
    assert "cmp-summary" in text and "forward_prefetch" in text


def test_plain_trace_times_read_the_same_from_nanosecond_traces(prefetch_pair, tmp_path):
    """The same traces with integer-nanosecond timestamps give the same step samples and kernel times."""
    from fsdp_doctor.trace.ops import op_times

    for name, prefetch in (("off", False), ("on", True)):
        gpu_known_trace(rank=0, steps=(1, 2, 3, 4), prefetch=prefetch).write(tmp_path / name / "rank0.json", ns=True)
    us, ns = op_times([prefetch_pair[0] / "rank0.json"]), op_times([tmp_path / "off" / "rank0.json"])
    assert ns.steps_ms == us.steps_ms == {"0": [1.0, 1.0, 1.0, 1.0]}
    assert ns.us_per_step == pytest.approx(us.us_per_step) and ns.prefetched == us.prefetched == {}
    assert op_times([tmp_path / "on" / "rank0.json"]).prefetched == {"forward": {"layers.1"}}


@pytest.mark.parametrize("run, kernel", [
    ("sample", None),  # CPU, 2 gloo ranks: the loss's backward on the main thread
    ("gpu/scenarios/gpu_gpt_whole", "nll_loss_backward_reduce_cuda_kernel_2d"),  # GPU: on autograd's own thread
])
def test_the_loss_backward_is_counted_in_backward(run, kernel):
    """Recorded FSDP2 runs: autograd runs the loss's backward (NllLossBackward0, LogSoftmaxBackward0, ...) before
    the root unit's FSDP::pre_backward fires, so phases taken from FSDP's labels alone counted it as forward (the
    sample's NllLossBackward0 and aten::_log_softmax_backward_data sat in the forward rows). Backward now starts at
    autograd's first function after the forward; the loss's forward operators stay in forward. (The sample's steps
    6 and 7 per rank, per step: 8.52 µs and 983.94 µs, the latter 62-65 µs a step but rank 1's step 7, 3.74 ms.)"""
    import re
    from pathlib import Path

    from fsdp_doctor.trace.ops import op_times

    prof = Path(__file__).resolve().parents[1] / "traces" / run / "profiler"
    us = op_times(sorted(prof.glob("*.pt.trace.json.gz"))).us_per_step
    phase = {}
    for (ph, kind, name) in us:
        phase.setdefault((kind, name), set()).add(ph)
    for name in ("NllLossBackward0", "LogSoftmaxBackward0", "aten::nll_loss_backward",
                 "aten::_log_softmax_backward_data", "autograd::engine::evaluate_function: NllLossBackward0"):
        assert phase[("operator", name)] == {"backward"}, name
    for name in ("aten::nll_loss_forward", "aten::_log_softmax"):
        assert phase[("operator", name)] == {"forward"}, name
    # no autograd backward function is left in forward (FSDP's forward-time RegisterPostBackwardFunction is forward)
    assert [n for ph, kind, n in us if ph == "forward" and re.search(r"Backward\d+$", n)] == []
    if run == "sample":
        assert us[("backward", "operator", "NllLossBackward0")] == pytest.approx(8.52, abs=0.01)
        assert us[("backward", "operator", "aten::_log_softmax_backward_data")] == pytest.approx(983.94, abs=0.01)
    if kernel:  # the loss's backward kernel, placed by its launch on autograd's thread
        ((ph, us_k),) = [(k[0], v) for k, v in us.items() if k[1] == "kernel" and kernel in k[2]]
        assert ph == "backward" and us_k == pytest.approx(10.08, abs=0.01)


@pytest.mark.parametrize("width", [80, 120])
def test_comparison_fits_the_terminal_and_no_figure_wraps(width):
    """Two recorded GPU runs (the whole model one unit, then 7 units): at 80 and 120 columns no line is wider
    than the terminal, and every figure (a time, a size, a change) stands whole on one line; the names and
    sentences wrap between words instead (before, "32.7 ms" broke into "32.7" and "ms", and the predictions
    table's last column was cropped to one character)."""
    import io
    from pathlib import Path

    from rich.cells import cell_len
    from rich.console import Console

    from fsdp_doctor.present.compare import _columns, render_comparison, tables

    gpu = Path(__file__).resolve().parents[1] / "traces" / "gpu" / "scenarios"
    cmp = compare_runs(load_run(gpu / "gpu_gpt_whole"), load_run(gpu / "gpu_gpt_tuned"))
    # recognised as a new-user trial's was, its step check inconclusive: the widest cells the table holds
    cmp.predictions = [msgspec.structs.replace(p, recognised_by="config diff: reshard_after_forward",
                                               step_verdict="inconclusive") for p in cmp.predictions]
    buf = io.StringIO()
    render_comparison(cmp, Console(file=buf, width=width, force_terminal=False, color_system=None))
    lines = buf.getvalue().splitlines()
    assert all(cell_len(line) <= width for line in lines), max(lines, key=cell_len)
    shown = [t for t in tables(cmp) if t.rows]
    # (the kernels' and operators' table from both runs' profiler windows: at 80 columns its phase and kind were
    # columns of their own, squeezed to 6 cells, "backwa" / "rd", and its change cut off)
    assert {"Step time", "Memory at the peak (highest rank)", "Predictions of A's findings, checked against B",
            "Kernels and operators whose time changed most (per step and rank)"} <= {t.title for t in shown}
    figures = [cell for t in shown for row in t.rows for col, cell in zip(_columns(t.header), row)
               if not col.wrap and not col.drop and cell != "—"]
    assert len(figures) > 40
    for cell in figures:
        assert any(cell in line for line in lines), (width, cell)
    # the predictions' figures, in sentences, stand whole too (six columns at 80 split "predict" / "ed vs" and
    # "315.5" / "ms": a new-user trial)
    from fsdp_doctor.present.compare import peak_error
    from fsdp_doctor.present.fmt import fmt_bytes, fmt_ms

    assert cmp.predictions
    for p in cmp.predictions:
        figs = [fmt_ms(p.step_ms_predicted), fmt_ms(p.step_ms_measured)] if p.step_ms_predicted is not None else []
        if p.peak_bytes_predicted is not None:
            figs += [fmt_bytes(p.peak_bytes_predicted), fmt_bytes(p.peak_bytes_measured), f"({peak_error(p.peak_pct_error)})"]
        assert figs
        for fig in figs:
            assert any(fig in line for line in lines), (width, fig)
    assert not any(ln.rstrip().endswith(("predict", "measure")) for ln in lines)


def test_plain_trace_pair_without_a_difference_says_what_a_trace_cannot_show(prefetch_pair):
    """Two plain-trace folders with the same units and prefetching: the configuration table says the traces show
    no difference in what they hold, and that they hold no settings (it claimed "no difference in the unit
    snapshots", which a plain trace has none of, on a pair whose reshard_after_forward differed)."""
    from fsdp_doctor.present.compare import tables

    a = prefetch_pair[0]
    # (the title says "changed" only above changes: a new-user trial read "Configuration changed: no difference")
    (config,) = [t for t in tables(compare_runs(load_run(a), load_run(a))) if t.title.startswith("Configuration")]
    assert config.title == "Configuration" and not config.rows and "snapshots" not in config.note
    assert config.note.startswith("no difference in the units and the prefetching the traces show")
    assert "reshard_after_forward" in config.note


def test_records_against_their_own_trace_are_not_timed_against_each_other(sample_run_path):
    """A run's records against its own profiler traces (a new-user trial: "-40.1% ... faster", significant): the
    profiled steps run slower with the profiler on, so the two sides' step times are not set against each other;
    the phase table says where each side's split comes from; a setting one side cannot read (a trace holds no
    reshard_after_forward) is no change."""
    from fsdp_doctor.present.compare import tables

    cmp = compare_runs(load_run(sample_run_path), load_run(sample_run_path / "profiler"))
    assert (cmp.a.source, cmp.b.source) == ("records", "trace")
    assert not cmp.step_p50.significant and cmp.step_p50.reason == C.OTHER_SOURCES
    assert cmp.summary.startswith("step times not set against each other: one run's come from its records")
    assert [c.key for c in cmp.config] == [], cmp.config  # (unknown on one side is not a change)
    titles = [t.title for t in tables(cmp)]
    assert "Phase split (ms per step, from A's records, B's trace)" in titles, titles


def test_a_unit_without_parameters_has_no_settings_to_change():
    """The root left without parameters by a rewrap (every module in a unit of its own) records its unshard setting
    as False whatever the script set: compare listed "unshard_async_op (root) true false", as if the fix had turned
    async unshard off. A unit without parameters gathers nothing: its settings are not compared."""
    from types import SimpleNamespace

    from fsdp_doctor.records import UnitConfig

    def side(root_params, root_async, layer_async=True):
        units = [UnitConfig(name="", modules=[""], is_root=True, param_count=root_params, n_params=1,
                            sharded_bytes=0, unsharded_bytes=0, orig_dtypes=["float32"], unshard_async_op=root_async),
                 UnitConfig(name="layers.0", modules=["layers.0"], is_root=False, param_count=10, n_params=1,
                            sharded_bytes=0, unsharded_bytes=0, orig_dtypes=["float32"], unshard_async_op=layer_async)]
        return C.Side(report=SimpleNamespace(units=units, run=SimpleNamespace()), samples=[], source="records")

    assert C.config_diff(side(100, True), side(0, False)) == []
    (ch,) = C.config_diff(side(100, True), side(100, False))
    assert (ch.key, ch.a, ch.b, ch.units) == ("unshard_async_op", True, False, ["(root)"])
    assert C.config_diff(side(100, True), side(100, True, layer_async=None)) == []  # unknown on one side
    # set_unshard_in_backward(False) on a unit (recorded since a new-user trial's embedding): a setting compared too
    a, b = side(100, True), side(100, True)
    b.report.units[1] = msgspec.structs.replace(b.report.units[1], unshard_in_backward=False)
    (ch,) = C.config_diff(a, b)
    assert (ch.key, ch.a, ch.b, ch.units) == ("unshard_in_backward", True, False, ["layers.0"])


def test_a_setting_another_fix_made_does_not_check_a_third_findings_prediction():
    """optim.untrained_params' fix freezes what the optimizer never steps and sets the first trained unit's backward
    prefetch: compare credited that prefetch change to prefetch.exposed_allgather, which B still raised ("missed:
    lower than predicted", a new-user trial). A setting a recognised fix's own code changes is that fix's."""
    from types import SimpleNamespace

    from fsdp_doctor.compare_sections import ConfigChange
    from fsdp_doctor.report_sections import Finding, Recommendation

    def finding(code, fix):
        return Finding(code=code, severity="warning", title="t", evidence={},
                       recommendation=Recommendation(text="", code=fix),
                       predicted={"step_ms_before": 100.0, "step_ms_after": 90.0})

    untrained = finding("optim.untrained_params", "param.requires_grad_(False)\n"
                        "model.set_modules_to_backward_prefetch([])")
    exposed = finding("prefetch.exposed_allgather", "unit.set_modules_to_backward_prefetch([nxt])")
    a = SimpleNamespace(report=SimpleNamespace(findings=[untrained, exposed]))
    b = SimpleNamespace(report=SimpleNamespace(findings=[exposed]))
    changes = [ConfigChange(key="trainable", a="100%", b="58.3%", units=["(root)"]),
               ConfigChange(key="backward_prefetch", a=[], b=[""], units=["(root)"])]
    got = C._predictions(a, b, changes, [], None, None, None)
    assert [(p.code, p.recognised_by) for p in got] == [("optim.untrained_params", "config diff: trainable")]
    # the prefetch fix applied too (named): checked as well
    got = C._predictions(a, b, changes, ["prefetch.exposed_allgather"], None, None, None)
    assert [p.code for p in got] == ["optim.untrained_params", "prefetch.exposed_allgather"]
    # alone, a backward prefetch change is the prefetch fix's
    a = SimpleNamespace(report=SimpleNamespace(findings=[exposed]))
    got = C._predictions(a, SimpleNamespace(report=SimpleNamespace(findings=[])), changes[1:], [], None, None, None)
    assert [(p.code, p.recognised_by) for p in got] == [("prefetch.exposed_allgather", "config diff: backward_prefetch")]


def test_bf16_parameters_check_optimizer_state_dominates_prediction():
    """optim.state_dominates' fix is bf16 parameters: the config diff read param_dtype float32 -> bfloat16 and no
    prediction was checked without --applied (a new-user trial)."""
    from types import SimpleNamespace

    from fsdp_doctor.compare_sections import ConfigChange
    from fsdp_doctor.report_sections import Finding, Recommendation

    f = Finding(code="optim.state_dominates", severity="warning", title="t", evidence={},
                recommendation=Recommendation(text="", code="mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)"),
                predicted={"peak_bytes_before": 100, "peak_bytes_after": 80})
    a = SimpleNamespace(report=SimpleNamespace(findings=[f]))
    b = SimpleNamespace(report=SimpleNamespace(findings=[]))
    changes = [ConfigChange(key="param_dtype", a="float32", b="bfloat16", units=["(root)"])]
    got = C._predictions(a, b, changes, [], None, 100, 81)
    assert [(p.code, p.recognised_by, p.peak_held) for p in got] == [
        ("optim.state_dominates", "config diff: param_dtype", True)]


def test_mixed_precision_and_offload_turned_on_are_configuration_changes():
    """No MixedPrecisionPolicy records its dtypes as None and no offload policy as None, which compare took for
    unknown: turning bf16 or CPU offload on read "no configuration change found: step time p50 +243.7% ... is
    run-to-run variation of the host" (a new-user trial). Unset, they are the parameters' dtype and "none"."""
    from types import SimpleNamespace

    from fsdp_doctor.records import UnitConfig

    def side(**kw):
        units = [UnitConfig(name=n, modules=[n], is_root=not n, param_count=10, n_params=1, sharded_bytes=40,
                            unsharded_bytes=80, orig_dtypes=["float32"], **kw) for n in ("", "blocks.0")]
        return C.Side(report=SimpleNamespace(units=units, run=SimpleNamespace()), samples=[], source="records")

    plain = side()
    got = {c.key: (c.a, c.b, c.units) for c in C.config_diff(plain, side(param_dtype="bfloat16",
                                                                          reduce_dtype="float32"))}
    assert got == {"param_dtype": ("float32", "bfloat16", ["(root)", "blocks.0"])}, got  # (reduce: fp32 both)
    got = {c.key: (c.a, c.b) for c in C.config_diff(plain, side(param_dtype="bfloat16"))}
    assert got == {"param_dtype": ("float32", "bfloat16"), "reduce_dtype": ("float32", "bfloat16")}, got
    got = {c.key: (c.a, c.b) for c in C.config_diff(plain, side(offload="cpu", offload_pin_memory=False))}
    assert got == {"offload": ("none", "cpu")}, got
    unread = side(reshard_after_forward=None)  # groups this torch did not let the snapshot read: unknown
    assert C.config_diff(unread, side(param_dtype="bfloat16", offload="cpu")) == []
    # selective checkpointing to full (ac.selective_to_full's fix, torchtitan's --activation-checkpoint.mode full):
    # the snapshots differ only in checkpoint_selective, which read "no configuration change found" (a new-user trial)
    got = {c.key: (c.a, c.b) for c in C.config_diff(side(checkpoint="unit", checkpoint_selective=True),
                                                     side(checkpoint="unit"))}
    assert got == {"checkpoint": ("unit (selective)", "unit")}, got


def test_a_finding_the_other_side_cannot_check_is_not_called_resolved(sample_run_path):
    """A run against a plain trace (here its own profiler window): a finding of A whose rule needs what a trace lacks
    (wrap.params_in_root: the unit snapshot) was "resolved", and the summary asked for --applied for a fix never
    made (a new-user trial). It is "not checked in B", with B's reason, and never offered for --applied."""
    from fsdp_doctor.analyze.compare import compare
    from fsdp_doctor.present.compare import tables
    from fsdp_doctor.report_sections import Finding, Recommendation

    a = compare_side(load_run(sample_run_path))
    b = compare_side(load_run(sample_run_path / "profiler"))
    a.report.findings.append(Finding(code="wrap.params_in_root", severity="warning", title="31% in the root",
                                     evidence={}, recommendation=Recommendation(text="")))
    cmp = compare(a, b)
    (u,) = cmp.findings.unchecked
    assert u.code == "wrap.params_in_root" and u.why == "needs the FSDP unit snapshot (fsdp_doctor.watch records it)"
    assert "wrap.params_in_root" not in {f.code for f in cmp.findings.resolved}
    assert "--applied wrap.params_in_root" not in cmp.summary
    (t,) = [t for t in tables(cmp) if t.title == "Findings"]
    assert ("not checked in B", "wrap.params_in_root", "warning",
            "31% in the root (B: needs the FSDP unit snapshot (fsdp_doctor.watch records it))") in t.rows


def test_an_unfinished_side_and_another_world_size_are_said(sample_run_path, tmp_path):
    """compare said nothing of a run killed mid-way (analyze warns of it) nor of a world size that changed between
    the sides (a new-user trial: 1 rank against 2 read "+79.6% slower"); both are notes now. The exposed-communication
    table says how many of its rows it shows."""
    import shutil

    from fsdp_doctor.present.compare import tables

    shutil.copytree(sample_run_path, tmp_path / "killed", ignore=shutil.ignore_patterns("report.json"))
    s = tmp_path / "killed" / "rank1.records.jsonl"
    s.write_bytes(b"".join(ln for ln in s.read_bytes().splitlines(keepends=True) if not ln.startswith(b'{"t":"end"')))
    cmp = compare_runs(load_run(sample_run_path), load_run(tmp_path / "killed"))
    assert cmp.a.unfinished == [] and cmp.b.unfinished == ["1"]
    assert ("B: rank 1 did not finish (killed, still going, or stopped on an exception): its figures are those of "
            "the steps completed") in cmp.notes
    # the files two minutes old: no longer "still going", B's problems tell how it ended, and the note points there
    # instead of guessing beside it
    import os
    import time

    for f in (tmp_path / "killed").rglob("*"):
        os.utime(f, (time.time() - 600,) * 2)
    old = compare_runs(load_run(sample_run_path), load_run(tmp_path / "killed"))
    assert any(p.startswith("rank 1 stopped first") for p in old.b.problems), old.b.problems
    assert ('B: rank 1 did not finish (how: its "run ended" line): its figures are those of the steps completed'
            in old.notes), old.notes
    (t,) = [t for t in tables(cmp) if t.title.startswith("Exposed communication")]
    assert cmp.comm_rows == 17 and len(cmp.comm) == 12, (cmp.comm_rows, len(cmp.comm))
    # rows, not units (a new-user trial read "the 12 of 14 units' rows" with 5 units); each row's Δ% of A's
    assert t.note == "the 12 of 17 rows (unit, collective, phase) that changed most", t.note
    for r, row in zip(cmp.comm, t.rows[1:]):
        assert row[4] == (f"{100 * ((r.b_ms or 0) - r.a_ms) / r.a_ms:+.1f}%" if r.a_ms else "—"), (r, row)
    assert sum(row[4] != "—" for row in t.rows[1:]) >= 10, t.rows
    a, b = compare_side(load_run(sample_run_path)), compare_side(load_run(sample_run_path))
    b.report.run.world_size = 4
    cmp = C.compare(a, b)
    assert any(n.startswith("world size 2 in A, 4 in B: a step does not do the same work") for n in cmp.notes)


@pytest.mark.parametrize("after, measured, held", [(0.966, 1.0, False), (0.966, 0.968, True), (1.0, 1.0, True),
                                                   (0.966, 0.99, False), (0.966, 1.02, False),
                                                   # +0.17% predicted, nothing moved: "about unchanged" both (it read
                                                   # "missed": ZeRO-2 under checkpointing, a new-user trial)
                                                   (1.0017, 1.0, True), (1.0017, 0.97, False),
                                                   # gloo ranks' own spread (1.38%): "unchanged" held
                                                   (1.0, 0.9862, True),
                                                   # "may rise by up to" (peak_at_most): prefetch.sync_unshard's fix
                                                   # rerun 4.4% under it read "missed: lower than predicted"
                                                   ("ceiling 1.044", 1.0, True), ("ceiling 1.044", 1.12, False)])
def test_a_peak_prediction_holds_only_where_the_change_happened(sample_run_path, after, measured, held):
    """A run compared with itself and a fix --applied whose finding predicted the peak 3.4% lower "held" (inside the
    5% tolerance, no change at all passes: a new-user trial). A predicted change holds where the error is within the
    tolerance and at least half of it happened, in its direction; a predicted "unchanged" (under 1%) where the peak
    moved under 1% too."""
    from fsdp_doctor.analyze.compare import compare
    from fsdp_doctor.report_sections import Finding, Predicted, Recommendation

    a = compare_side(load_run(sample_run_path))
    b = compare_side(load_run(sample_run_path))
    peak = a.report.memory.per_rank[a.report.memory.peak_rank].peak_bytes
    a.report.findings.append(Finding(
        code="wrap.params_in_root", severity="warning", title="t", evidence={}, recommendation=Recommendation(text=""),
        predicted=Predicted(peak_bytes_before=peak, peak_bytes_after=round(peak * ceiling), peak_at_most=True)
        if isinstance(after, str) and (ceiling := float(after.split()[1])) else
        Predicted(peak_bytes_before=peak, peak_bytes_after=round(peak * after))))
    m = b.report.memory.per_rank[b.report.memory.peak_rank]
    m.peak_bytes = round(peak * measured)
    cmp = compare(a, b, applied=["wrap.params_in_root"])
    (p,) = cmp.predictions
    assert p.peak_bytes_measured == round(peak * measured) and p.peak_held is held, p
    # the table says which side of the prediction a miss landed on (a larger saving than predicted read "missed")
    from fsdp_doctor.present.compare import tables

    (t,) = [t for t in tables(cmp) if t.title.startswith("Predictions")]
    # the figure in parentheses is the prediction's error, said under the table (read as a change: a new-user trial)
    assert "peak: the prediction's error against the measured peak (+: predicted above it)" in t.note
    said = t.rows[0][2].rsplit("\n", 1)[1]
    assert said == ("held" if held else "missed: lower than predicted" if not isinstance(after, str)
                    and measured < after else "missed: higher than predicted"), said


@pytest.mark.skipif(not (HTA_TRACES / "v100_allreduce_rank1").is_dir(), reason="reference traces not found")
def test_a_run_against_a_plain_trace_reads_both_traces_and_both_peaks(sample_run_path, prefetch_pair):
    """A recorded run (with its profiler window) against a plain trace: the kernels' and operators' times of A came
    from nowhere and read "0 µs" on every row, and B's peak (its memory events, which analyze prints) read "—" (a
    new-user trial). A's times are its window's, B's peak its trace's; only the categories both split into are rows."""
    from fsdp_doctor.trace.ops import op_times

    run_a = load_run(sample_run_path)
    cmp = compare_runs(run_a, load_run(prefetch_pair[0]))
    ops_a = op_times(run_a.trace_files).us_per_step
    assert cmp.ops and all(o.a_us == round(ops_a.get((o.phase, o.kind, o.name), 0.0), 2) for o in cmp.ops)
    assert any(o.a_us > 0 for o in cmp.ops)
    assert compare_runs(run_a, load_run(sample_run_path / "profiler")).ops == []  # its own window: no change
    run_b = load_run(HTA_TRACES / "v100_allreduce_rank1")  # (recorded with profile_memory)
    cmp = compare_runs(run_a, run_b)
    peak_b = build_report(run_b).memory_section()
    assert cmp.memory_peak.b == max(m.peak_bytes for m in peak_b.per_rank.values()) > 0
    assert cmp.memory == {}  # the trace's peak has no categories: no category row of one side only


def test_exposed_total_only_where_it_has_the_rows_source(sample_run_path, tmp_path):
    """The exposed-communication table's total came from each report's headline whatever its source, beside rows of
    another (recorded all-gather waits against a trace's exposure, under "from the records": a new-user trial). A
    recorded run without a profiler window against a plain trace: rows from the records, no total; two runs whose
    headlines are the trace's: the total, from the trace, as the rows."""
    _half(sample_run_path, tmp_path / "no_window", lambda n: n > 0)
    a, b = load_run(tmp_path / "no_window"), load_run(sample_run_path / "profiler")
    cmp = compare_runs(a, b)
    assert (cmp.comm_source, build_report(a).comm.source, build_report(b).comm.source) == ("records", "records",
                                                                                          "trace")
    assert cmp.comm_exposed is None and cmp.comm
    cmp = compare_runs(load_run(sample_run_path), b)
    assert cmp.comm_source == "trace" and cmp.comm_exposed is not None


def test_throughput_of_a_cpu_run_reads_in_gflops(sample_run_path):
    """A CPU run's achieved FLOP/s is a few hundredths of a TFLOP/s: the compare table gives it in GFLOP/s, from the
    report's four significant figures (a new-user trial's read "TFLOP/s  0  0  -0  -10.0%"; at four decimals
    another's Δ% read 140.0 beside tokens/s' 141.0), its Δ in the figures' own format, signed (tokens/s' read
    "+1.01e+03")."""
    from fsdp_doctor.present.compare import tables

    run = load_run(sample_run_path)
    tf = build_report(run).throughput.job.achieved_tflops
    assert 0 < tf < 1
    cmp = compare_runs(run, run)
    assert cmp.throughput["achieved_tflops"].a == tf == float(f"{tf:.4g}") and tf != round(tf, 4), tf
    (tp,) = [t for t in tables(cmp) if t.title == "Throughput"]
    row = next(r for r in tp.rows if r[0].endswith("FLOP/s"))
    assert row[:4] == ("GFLOP/s", f"{tf * 1e3:.3g}", f"{tf * 1e3:.3g}", "+0") and float(row[1]) > 0
    cmp.throughput["tokens_per_s"] = C.delta(720.0, 1734.0, 2)
    (tp,) = [t for t in tables(cmp) if t.title == "Throughput"]
    assert next(r for r in tp.rows if r[0] == "tokens/s")[1:] == ("720", "1,734", "+1,014", "+140.8%")


def test_activations_moving_with_no_setting_changed_say_the_batch_did(sample_run_path):
    """Two runs alike in every setting compare reads, B's activations at the peak twice A's: the summary says the
    batch or the sequence length differs (a new-user trial's batch of 4 against 2 read "no configuration change
    found" beside +99.7% of activations); 10% more is not said to be one."""
    import copy

    run = load_run(sample_run_path)
    a = compare_side(run)
    summaries = {}
    for factor in (2.0, 1.1):
        rep = copy.deepcopy(a.report)
        m = rep.memory_section()
        pr = m.per_rank.get(m.peak_rank) or next(iter(m.per_rank.values()))
        pr.peak_breakdown["activations"] = int(pr.peak_breakdown["activations"] * factor)
        b = C.Side(report=rep, samples=a.samples, source=a.source, ops=a.ops)
        summaries[factor] = C.compare(a, b).summary
    assert summaries[2.0].startswith("no configuration change found")
    assert summaries[2.0].endswith("; but the peak's activations moved +100% with no setting changed: the batch or "
                                   "the sequence length differs, which compare reads only as watch()'s "
                                   "tokens_per_step"), summaries[2.0]
    assert "activations moved" not in summaries[1.1]


def test_a_mesh_changed_is_a_configuration_change(sample_run_path):
    """4 ranks sharding 1-D against HSDP on a 2 x 2 mesh (or FSDP beside tensor parallelism) read "no configuration
    change found", the step time's change as the host's and the activations' as the batch's (a new-user trial):
    the mesh is a job setting compare reads, from the records' facts; a trace-only side has none to read."""
    import copy

    run = load_run(sample_run_path)
    a = compare_side(run)
    rep = copy.deepcopy(a.report)
    rep.run.mesh = {"replicate": 1, "shard": 2}
    b = C.Side(report=rep, samples=a.samples, source=a.source, ops=a.ops)
    got = {c.key: (c.a, c.b, c.units) for c in C.config_diff(a, b)}
    assert got == {"mesh": ("1-D", "replicate 1 × shard 2", [])}, got
    assert not C.compare(a, b).summary.startswith("no configuration change")
    assert C.config_diff(a, C.Side(report=copy.deepcopy(a.report), samples=a.samples, source=a.source)) == []
    rep = copy.deepcopy(a.report)
    rep.run.units = msgspec.UNSET  # (no snapshot: a plain trace's facts) unknown, not a change
    rep.run.mesh = {"replicate": 1, "shard": 2}
    assert C.config_diff(a, C.Side(report=rep, samples=a.samples, source=a.source)) == []


def test_units_compiled_are_a_configuration_change():
    """A U-Net's blocks compiled (``block.compile()``) against the same run eager read "no configuration change found"
    though B's header said 7 units compiled (a new-user trial): a unit compiled in place, or timed around its
    compiled call, is a setting compare reads."""
    from types import SimpleNamespace

    from fsdp_doctor.records import UnitConfig

    def side(**kw):
        units = [UnitConfig(name=n, modules=[n], is_root=not n, param_count=10, n_params=1, sharded_bytes=40,
                            unsharded_bytes=80, orig_dtypes=["float32"], **(kw if n else {})) for n in ("", "downs.0")]
        return C.Side(report=SimpleNamespace(units=units, run=SimpleNamespace()), samples=[], source="records")

    for flag in ("compiled_in_place", "compiled_call_timed"):
        got = {c.key: (c.a, c.b, c.units) for c in C.config_diff(side(), side(**{flag: True}))}
        assert got == {"compiled": (False, True, ["downs.0"])}, got
    assert C.config_diff(side(), side()) == []


def test_a_change_that_resolved_one_finding_is_not_checked_as_another_still_raised(sample_run_path):
    """A rewrap (every Linear its own unit -> one unit per block) resolved wrap.too_fine; wrap.params_in_root, also
    of the "wrapping" key and still raised by B, was checked as applied: "3.95 MiB -> 4.27 MiB: missed" (a new-user
    trial). A finding B still raises whose fix changes only what a resolved finding's fix changed is not checked;
    named with --applied, or with nothing resolved beside it, it is."""
    from fsdp_doctor.compare_sections import ConfigChange
    from fsdp_doctor.report_sections import Finding, Predicted, Recommendation

    def finding(code, after):
        return Finding(code=code, severity="warning", title=code, evidence={}, recommendation=Recommendation(text=""),
                       predicted=Predicted(peak_bytes_before=1000, peak_bytes_after=after))

    a, b = compare_side(load_run(sample_run_path)), compare_side(load_run(sample_run_path))
    a.report.findings = [finding("wrap.too_fine", 900), finding("wrap.params_in_root", 800)]
    b.report.findings = [finding("wrap.params_in_root", 800)]
    rewrap = [ConfigChange(key="wrapping", a=["a"], b=["b"])]
    checked = C._predictions(a, b, rewrap, [], None, 1000, 950)
    assert [p.code for p in checked] == ["wrap.too_fine"], checked
    assert [p.code for p in C._predictions(a, b, rewrap, ["wrap.params_in_root"], None, 1000, 950)] == [
        "wrap.too_fine", "wrap.params_in_root"]
    b.report.findings = a.report.findings[:]  # nothing resolved: the change may have been either's fix
    assert [p.code for p in C._predictions(a, b, rewrap, [], None, 1000, 950)] == [
        "wrap.too_fine", "wrap.params_in_root"]


def test_the_configuration_table_keeps_both_sides_at_80_columns(sample_run_path):
    """A per-expert prefetch change at 80 columns: the "Configuration changed" table showed only setting and where,
    A and B left out and the unit names cut (a new-user trial). The values are text columns: wrapped, never dropped."""
    from rich.console import Console

    from fsdp_doctor.compare_sections import ConfigChange
    from fsdp_doctor.present.compare import render_comparison

    cmp = compare_runs(load_run(sample_run_path), load_run(sample_run_path))
    cmp.config = [ConfigChange(key="forward_prefetch", a="none", b="model.layers.0.mlp.experts.experts.1",
                               units=["model.layers.0.mlp.experts.experts.0"])]
    con = Console(width=80, record=True, force_terminal=False)
    render_comparison(cmp, con)
    out = con.export_text()
    table = out[out.index("Configuration changed"):out.index("Step time")]
    flat = "".join(table.split())
    assert "inA" in flat and "inB" in flat and "none" in table, table
    lines = [ln for ln in table.splitlines() if "model.layers" in ln or "ts.experts" in ln]
    assert lines[0].rstrip().endswith("model.layers.0.mlp.exper") and lines[1].rstrip().endswith("ts.experts.1"), \
        table  # B's value whole, folded in its own column
    assert "not shown at 80 columns" not in table, table


def test_a_change_outside_the_model_is_said_to_be_the_loops_not_the_hosts(sample_run_path):
    """A DataLoader given 4 workers: no setting compare reads changed, the time outside the model went 32.9 -> 1.4 ms
    and the step -59.5%, which compare called run-to-run variation of the host (a new-user trial). Where the time
    outside the model makes most of the change, the summary says data loading or the loop changed."""
    import copy

    a = compare_side(load_run(sample_run_path))
    b = copy.deepcopy(a)
    extra = 60.0  # B's steps: each 60 ms longer, all of it outside the model
    b.samples = [[x + extra for x in step] for step in b.samples]
    job = b.report.steps.job
    job.phases_p50_ms = {**job.phases_p50_ms, "outside": job.phases_p50_ms["outside"] + extra}
    cmp = C.compare(a, b)
    oa, ob = a.report.steps.job.phases_p50_ms["outside"], job.phases_p50_ms["outside"]
    assert cmp.step_p50.reason == C.NO_CHANGE
    assert f"most of it the time outside the model ({oa:.1f} -> {ob:.1f} ms): data loading or your loop changed" \
        in cmp.summary and "run-to-run variation" not in cmp.summary, cmp.summary
    # the same change with the phases alike: host variation, as before
    job.phases_p50_ms = dict(a.report.steps.job.phases_p50_ms)
    assert "run-to-run variation" in C.compare(a, b).summary


def test_parameters_frozen_are_a_configuration_change():
    """optim.untrained_params' fix (requires_grad_(False) on the parameters the optimizer never steps) read "no
    configuration change found ... Configuration: no difference in the unit snapshots and the job" though the
    headers said 0.70 M params against 0.70 M (0.18% trainable) (a new-user trial's ResNet, whose optimizer held
    only fc): the trainable share of each unit's gathered bytes is a setting compare reads, else the model's."""
    from types import SimpleNamespace

    from fsdp_doctor.records import UnitConfig

    # the trial's units (gathered bytes): the root 7016 (fc trainable in B: 5160), layer1 37376, layer2 132352
    def side(root_trainable, layers_trainable, model_trainable=None):
        units = [UnitConfig(name=n, modules=[n], is_root=not n, param_count=size // 4, n_params=1,
                            sharded_bytes=size // 2, unsharded_bytes=size, orig_dtypes=["float32"],
                            trainable_unsharded_bytes=(root_trainable if not n else
                                                       None if layers_trainable is None else layers_trainable * size))
                 for n, size in (("", 7016), ("layer1", 37376), ("layer2", 132352))]
        run = SimpleNamespace(model_param_count=701466, model_trainable_param_count=model_trainable)
        return C.Side(report=SimpleNamespace(units=units, run=run), samples=[], source="records")

    got = [(c.key, c.a, c.b, c.units) for c in C.config_diff(side(7016, 1), side(5160, 0))]
    assert got == [("trainable", "100%", "73.5%", ["(root)"]), ("trainable", "100%", "0%", ["layer1", "layer2"])], got
    # one 4-byte bias frozen: in the root 99.9%; in layer2 not all of it either, though 99.997% is 100% at 3 figures
    (ch,) = C.config_diff(side(7016, 1), side(7012, 1))
    assert (ch.a, ch.b) == ("100%", "99.9%"), ch
    assert C._trainable_share(132348, 132352) == "99.997%"
    assert C.config_diff(side(7016, 1), side(7016, 1)) == []
    # a snapshot without the units' trainable bytes (recorded before them): the model's share, for the job
    got = [(c.key, c.a, c.b, c.units) for c in C.config_diff(side(None, None, 701466), side(None, None, 1290))]
    assert got == [("trainable", "100%", "0.184%", [])], got
    assert C.config_diff(side(None, None, 701466), side(None, None, None)) == []  # unknown on one side


def test_a_freeze_is_not_read_as_the_batch_and_checks_its_finding(sample_run_path):
    """The trial's freeze again, through compare(): its activations at the peak -100% were said to be the batch's
    ("with no setting changed: the batch or the sequence length differs") and the --applied hint named
    reshard.zero2_affordable, resolved beside optim.untrained_params. The freeze is the change: the step time is
    set against it, nothing is said of the batch, and optim.untrained_params' prediction is checked."""
    import copy

    from fsdp_doctor.report_sections import Finding, Predicted, Recommendation

    a = compare_side(load_run(sample_run_path))
    b = copy.deepcopy(a)
    for u in a.report.units:
        u.trainable_unsharded_bytes = u.unsharded_bytes
    for u in b.report.units:  # every unit frozen but the last (the head)
        u.trainable_unsharded_bytes = u.unsharded_bytes if u.name == "norm, lm_head" else 0
    m = b.report.memory_section()
    (m.per_rank.get(m.peak_rank) or next(iter(m.per_rank.values()))).peak_breakdown["activations"] = 0
    a.report.findings = [Finding(code=code, severity="warning", title=code, evidence={},
                                 recommendation=Recommendation(text=""),
                                 predicted=Predicted(peak_bytes_before=1000, peak_bytes_after=900))
                         for code in ("reshard.zero2_affordable", "optim.untrained_params")]
    b.report.findings = []
    cmp = C.compare(a, b)
    got = [(c.key, c.a, c.b, c.units) for c in cmp.config]
    assert got == [("trainable", "100%", "0%", ["layers.0", "layers.1", "layers.2", "layers.3", "tok_emb, pos_emb"])], \
        got
    assert not cmp.summary.startswith("no configuration change") and "activations moved" not in cmp.summary \
        and "--applied" not in cmp.summary, cmp.summary
    assert [(p.code, p.recognised_by) for p in cmp.predictions] == [("optim.untrained_params",
                                                                     "config diff: trainable")]
    # a parameter frozen has no gradient, which the optimizer's step skips: its time is no control of the host's
    job = b.report.steps.job
    job.phases_p50_ms = {**job.phases_p50_ms, "optimizer": 2 * job.phases_p50_ms["optimizer"] + C.HOST_MIN_MS}
    assert C.compare(a, b).step_p50.reason != C.HOST_CHANGED


def test_an_optimizer_fix_resolved_in_b_is_no_host_shift(sample_run_path):
    """optim.before_shard's fix makes an optimizer that stepped stale tensors step the model's: its step 0.1 -> 8.4 ms
    beside a rewrap read "the optimizer step, which this change does not touch, moved +10189% too: the host ran at
    another speed", with the finding resolved in the same comparison (a new-user trial comparing its first run with
    its last). An optimizer fix resolved in B touches the optimizer step as one applied does."""
    import copy

    from fsdp_doctor.report_sections import Finding, Recommendation

    a = compare_side(load_run(sample_run_path))
    b = copy.deepcopy(a)
    b.report.units[1].reshard_after_forward = not a.report.units[1].reshard_after_forward  # a change of setting
    job = b.report.steps.job
    job.phases_p50_ms = {**job.phases_p50_ms, "optimizer": 3 * job.phases_p50_ms["optimizer"] + C.HOST_MIN_MS}
    stale = Finding(code="optim.before_shard", severity="critical", title="t", evidence={},
                    recommendation=Recommendation(text=""))
    a.report.findings, b.report.findings = [stale], [stale]
    assert C.compare(a, b).step_p50.reason == C.HOST_CHANGED  # still raised in B: the optimizer is untouched
    b.report.findings = []
    assert C.compare(a, b).step_p50.reason != C.HOST_CHANGED


def test_two_models_are_said_to_do_different_work(sample_run_path):
    """Two different models (6 units and 3, 512 tokens a step and 128) read "step time p50 -40.1% ...: faster,
    significant" with nothing said of the work a step does (a new-user trial): said, as for a world size."""
    import copy

    a = compare_side(load_run(sample_run_path))
    b = copy.deepcopy(a)
    assert not [n for n in C.compare(a, b).notes if "parameters" in n]
    b.report.run.model_param_count = a.report.run.model_param_count // 4
    (note,) = [n for n in C.compare(a, b).notes if "parameters" in n]
    assert note == (f"A trains a model of {a.report.run.model_param_count:,} parameters, B one of "
                    f"{b.report.run.model_param_count:,}: a step does not do the same work on both sides; compare "
                    "throughput, not step times"), note


def test_a_prefetch_of_the_root_names_the_root():
    """prefetch.frozen_gathered's fix (``model.set_modules_to_backward_prefetch([model])``) records the root's name,
    "": the table read "backward_prefetch (root) none none" (a new-user trial)."""
    from fsdp_doctor.compare_sections import ConfigChange, RunSide
    from fsdp_doctor.present.compare import tables

    cmp = Comparison(a=RunSide(path="a", source="records"), b=RunSide(path="b", source="records"),
                     config=[ConfigChange(key="backward_prefetch", a=[], b=[""], units=["(root)"]),
                             ConfigChange(key="forward_prefetch", a=["layers.1"], b=["", "layers.1"],
                                          units=["layers.0"])])
    (t,) = [t for t in tables(cmp) if t.title == "Configuration changed"]
    assert t.rows == [("backward_prefetch", "(root)", "none", "(root)"),
                      ("forward_prefetch", "layers.0", "layers.1", "(root), layers.1")], t.rows


LOADER_PAIR = os.path.join(os.path.dirname(__file__), "fixtures", "loader_pair")


def test_a_peak_that_moved_is_not_read_as_the_batch():
    """A new-user trial's two runs alike but for their DataLoader (num_workers, prefetch_factor, persistent_workers;
    tests/fixtures/loader_pair: their records, steps 0-4 and the end): A's peak fell on rank 0 in the loss (203.53
    KiB of activations), B's in unit 2's backward (155.03 KiB), each step's batch 64 input elements on both. compare
    said "the peak's activations moved -24% with no setting changed: the batch or the sequence length differs". The
    peak moved, and the summary says where; the batch is said to differ only where the peak steps' input elements
    do, or where, not recorded, the peak fell at the same place."""
    import copy

    a, b = (compare_side(load_run(os.path.join(LOADER_PAIR, n))) for n in ("j_loader", "j_loader_fix"))
    assert (a.peak_input_elements, b.peak_input_elements) == (64, 64)
    cmp = C.compare(a, b)
    assert cmp.config == [] and cmp.memory["activations"].a == 208416 and cmp.memory["activations"].b == 158752
    assert "batch or the sequence length" not in cmp.summary, cmp.summary
    assert cmp.summary.endswith(
        "; the memory peak moved, from rank 0, step 2, outside the units, in_loss (A) to rank 0, step 2, 2 in_backward "
        "(B): its activations (-24%) are those of another moment of the step, the batch the same (64 input elements "
        "in the peak step)"), cmp.summary
    # input elements not recorded (a run before the field) on one side: the peak moved all the same, the batch not
    # claimed either way
    a0 = copy.copy(a)
    a0.peak_input_elements = None
    s = C.compare(a0, b).summary
    assert "batch" not in s and s.endswith("its activations (-24%) are those of another moment of the step"), s
    # B's batch twice A's: the batch, whatever the place
    b2 = copy.copy(b)
    b2.peak_input_elements = 128
    assert C.compare(a, b2).summary.endswith(
        "; but the peak's activations moved -24% with no setting changed: the batch or the sequence length differs "
        "(the peak step's input elements 64 -> 128)")
    # the same batch at the same place (A against itself, its activations moved): nothing said of either
    a2 = copy.deepcopy(a)
    _, pr = C._peak_rank(a2.report)
    pr.peak_breakdown["activations"] = int(pr.peak_breakdown["activations"] * 0.7)
    s = C.compare(a, a2).summary
    assert "activations" not in s and "peak moved" not in s, s


def test_comparison_tables_write_minus_in_ascii_and_every_rows_change():
    """Two recorded GPU runs (the whole model one unit, then 7 units). The memory table's Δ column wrote "−" (U+2212)
    beside the Δ% column's "-", every other table ASCII (a new-user trial); the exposed communication table's Δ% was
    "—" on every unit's row, filled on the total's only, and its note called its rows (unit x collective x phase)
    units' rows."""
    from pathlib import Path

    from fsdp_doctor.present.compare import tables

    gpu = Path(__file__).resolve().parents[1] / "traces" / "gpu" / "scenarios"
    cmp = compare_runs(load_run(gpu / "gpu_gpt_whole"), load_run(gpu / "gpu_gpt_tuned"))
    ts = {t.title: t for t in tables(cmp)}
    assert not [c for t in ts.values() for row in t.rows for c in row if "\u2212" in c]
    mem = ts["Memory at the peak (highest rank)"]
    assert ("unsharded params", "37.55 MiB", "8.00 MiB", "-29.54 MiB", "-78.7%") in mem.rows, mem.rows
    comm = ts["Exposed communication (ms per step, from the trace)"]
    assert comm.rows[1] == ("(root) reduce_scatter backward", "21.9 ms", "—", "-21.9 ms", "-100.0%"), comm.rows
    assert ("layers.0 reduce_scatter backward", "—", "4.46 ms", "+4.46 ms", "—") in comm.rows, comm.rows
    assert comm.note == ("the 12 of 19 rows (unit, collective, phase) that changed most; Δ% of A's figure: — where A "
                         "has no such row"), comm.note


def test_a_whole_model_unit_reads_one_unit(sample_run_path):
    """A new-user trial's T5 with only the root sharded against its plan printed "wrapping   5 units differ   1 units
    6 units": one unit is "1 unit"."""
    import copy

    run = load_run(sample_run_path)
    a = compare_side(run)
    rep = copy.deepcopy(a.report)
    rep.units = [u for u in rep.units if not u.name]  # the root alone: one unit
    b = C.Side(report=rep, samples=a.samples, source=a.source, ops=a.ops)
    (ch,) = [c for c in C.config_diff(a, b) if c.key == "wrapping"]
    assert (ch.a, ch.b) == (f"{len(a.report.units)} units", "1 unit"), (ch.a, ch.b)


def test_one_unit_that_differs_reads_one_unit_differs(sample_run_path):
    """The configuration table's wrapping row counted "1 units differ" where one unit was added or removed; and it
    named none of the units that differ ("2 units differ", a new-user trial): the first three, then how many more."""
    import copy

    from fsdp_doctor.present.compare import tables

    run = load_run(sample_run_path)
    a = compare_side(run)
    for keep, where in ((-1, "1 unit differs: [norm, lm_head]"),
                        (2, "5 units differ: layers.0, layers.1, layers.2 … (+2)")):
        rep = copy.deepcopy(a.report)
        rep.units = rep.units[:keep]  # units fewer
        b = C.Side(report=rep, samples=a.samples, source=a.source, ops=a.ops)
        cmp = C.Comparison(a=a, b=b, config=C.config_diff(a, b))
        (row,) = [r for t in tables(cmp) if t.title == "Configuration changed" for r in t.rows if r[0] == "wrapping"]
        assert row[1] == where, row


def test_a_grouped_unit_is_printed_in_its_brackets(sample_run_path):
    """The terminal prints the wrapping row's grouped unit as the table holds it: rich read "[norm, lm_head]" as a
    style tag and dropped it (a new-user trial's Qwen3-MoE, compared with its rerun under wrap.params_in_root's fix,
    printed "2 units differ: model.embed_tokens," where the JSON named model.embed_tokens and [model.norm, lm_head])."""
    import copy
    import io

    from rich.console import Console

    from fsdp_doctor.present.compare import render_comparison

    a = compare_side(load_run(sample_run_path))
    b = copy.deepcopy(a)
    b.report.units = b.report.units[:-1]  # [norm, lm_head] folded into the root
    cmp = C.compare(a, b, path_a="A", path_b="B")
    buf = io.StringIO()
    render_comparison(cmp, Console(file=buf, width=100, force_terminal=False, color_system=None))
    out = buf.getvalue()
    assert "wrapping   1 unit differs: [norm, lm_head]   7 units   6 units" in out, out


def test_a_grouped_unit_listed_in_another_order_is_the_same_unit(sample_run_path):
    """A recorded run names a grouped unit as fully_shard was given it, a plain trace's FSDP2 labels in module-tree
    order: the same modules in another order are one unit, its settings and its collectives' rows matched (they
    read as one unit removed and one new, "7 units -> 7 units")."""
    import copy

    a = compare_side(load_run(sample_run_path))
    b = copy.deepcopy(a)
    (u,) = [u for u in b.report.units if u.name == "norm, lm_head"]
    u.name = "lm_head, norm"
    for r in b.report.overlap.per_unit:
        r.unit = "lm_head, norm" if r.unit == "norm, lm_head" else r.unit
    assert any(r.unit == "lm_head, norm" for r in b.report.overlap.per_unit)
    cmp = C.compare(a, b, path_a="A", path_b="B")
    assert not [c for c in cmp.config if c.key == "wrapping"], cmp.config
    assert cmp.comm and all(r.a_ms is not None and r.b_ms is not None for r in cmp.comm), cmp.comm
    assert not [r for r in cmp.comm if "lm_head, norm" in r.unit]
    # a group of other modules is another unit
    u.name = "lm_head, norm, tok_emb"
    assert [c.key for c in C.compare(a, b, path_a="A", path_b="B").config if c.key == "wrapping"] == ["wrapping"]


def test_a_mesh_change_touches_the_optimizer_step(sample_run_path):
    """4 ranks 1-D against HSDP 2 x 2 (a new-user trial's runs/fsdp4 and runs/hsdp): each rank's shard of the
    parameters doubles, and with it its optimizer step; compare read "the optimizer step, which this change does not
    touch, moved -53%" and the step's change as the host's. A mesh change is no control of the host's speed."""
    import copy

    a = compare_side(load_run(sample_run_path))
    b = copy.deepcopy(a)
    b.report.run.mesh = {"replicate": 2, "shard": 1}
    job = b.report.steps.job
    job.phases_p50_ms = {**job.phases_p50_ms, "optimizer": 3 * job.phases_p50_ms["optimizer"] + C.HOST_MIN_MS}
    cmp = C.compare(a, b)
    assert [(c.key, c.a, c.b) for c in cmp.config] == [("mesh", "1-D", "replicate 2 × shard 1")]
    assert cmp.step_p50.reason != C.HOST_CHANGED and "does not touch" not in cmp.summary, cmp.summary


def test_a_checkpointing_fix_is_checked_only_where_b_went_its_way():
    """ac.unneeded's fix checkpoints fewer units, ac.recommended's more: a B that checkpointed all 8 layers where A
    checkpointed every other one checked A's ac.unneeded ("missed: lower than predicted", a new-user trial). Each is
    checked where B went its way, and not otherwise."""
    from types import SimpleNamespace

    from fsdp_doctor.compare_sections import ConfigChange
    from fsdp_doctor.report_sections import Finding, Recommendation

    def finding(code):
        return Finding(code=code, severity="warning", title="t", evidence={}, recommendation=Recommendation(text=""),
                       predicted={"peak_bytes_before": 100, "peak_bytes_after": 130})

    a = SimpleNamespace(report=SimpleNamespace(findings=[finding("ac.unneeded"), finding("ac.recommended")]))
    b = SimpleNamespace(report=SimpleNamespace(findings=[]))
    more = [ConfigChange(key="checkpoint", a="none", b="unit", units=["layers.1", "layers.3", "layers.5", "layers.7"])]
    fewer = [ConfigChange(key="checkpoint", a="unit", b="none", units=["layers.1", "layers.3"])]
    assert [p.code for p in C._predictions(a, b, more, [], None, 100, 80)] == ["ac.recommended"]
    assert [p.code for p in C._predictions(a, b, fewer, [], None, 100, 130)] == ["ac.unneeded"]
    # one unit's checkpointing moved to its children: neither way, neither checked; --applied still checks it
    kind = [ConfigChange(key="checkpoint", a="unit", b="children", units=["layers.1"])]
    assert C._predictions(a, b, kind, [], None, 100, 100) == []
    assert [p.code for p in C._predictions(a, b, kind, ["ac.unneeded"], None, 100, 100)] == ["ac.unneeded"]


@pytest.mark.slow
@pytest.mark.long  # (the long tier, tests/conftest.py: a fix pasted and rerun in a second real run)
def test_gradient_sync_turned_off_for_all_but_the_last_micro_batch_is_a_configuration_change(tmp_path):
    """Gradient accumulation reduce-scattering every micro-batch (A, accum.sync_every_micro_batch) against the same
    run with the finding's fix, set_requires_gradient_sync(is_last_micro_batch) (B): compare read "no configuration
    change found" (the sync is set in the loop, which no snapshot held), so the step-time change was the host's and
    the finding's prediction went unchecked. The recorder counts the backward passes run with gradient sync on
    (StepRecord.synced_backwards): the config diff says how each run syncs, and the fix is recognised from it. A run
    without accumulation, and records from before that field, have no such key."""
    from fsdp_doctor import ProfileSchedule

    _, a = record(tmp_path / "every", watch_extra={"profile": ProfileSchedule(first=3, active=2, warmup=1, every=0)},
                  steps=10, grad_accum=4)
    _, b = record(tmp_path / "last", watch_extra={"profile": False}, steps=8, grad_accum=4, accum_no_sync=True)
    side_a, side_b = compare_side(a), compare_side(b)
    assert "accum.sync_every_micro_batch" in {f.code for f in side_a.report.findings}
    cmp = C.compare(side_a, side_b)
    assert [(c.key, c.a, c.b, c.units) for c in cmp.config] == [
        ("gradient_sync", "every micro-batch (4 of 4)", "last micro-batch (1 of 4)", [])], cmp.summary
    assert not cmp.summary.startswith("no configuration change found"), cmp.summary
    (p,) = [p for p in cmp.predictions if p.code == "accum.sync_every_micro_batch"]
    assert p.recognised_by == "config diff: gradient_sync"
    print(f"\naccumulation's fix: {cmp.summary}\n{p}")
    for run, synced in ((a, 4), (b, 1)):  # every step's 4 backwards, with gradient sync on in 4 or in the last
        assert {(s.backwards, s.synced_backwards) for rd in run.ranks.values() for s in rd.steps} == {(4, synced)}
    # one backward per step: no accumulation, no key (the batch per optimizer step changed, said as such); a run
    # against itself: no change
    _, one = record(tmp_path / "one", watch_extra={"profile": False}, steps=4)
    assert {s.synced_backwards for rd in one.ranks.values() for s in rd.steps} == {1}
    assert compare_side(one).report.run.backwards_per_step is msgspec.UNSET
    assert [c.key for c in C.compare(compare_side(one), side_b).config] == ["tokens_per_step"]
    assert C.compare(side_b, compare_side(b)).config == []
    # records written before StepRecord.synced_backwards: the fact is unknown, not a change
    for rd in a.ranks.values():
        rd.steps = [msgspec.structs.replace(s, synced_backwards=None) for s in rd.steps]
    old = compare_side(a)
    assert old.report.run.backwards_per_step is msgspec.UNSET
    assert [c.key for c in C.compare(old, side_b).config] == []


@pytest.mark.slow
@pytest.mark.long  # (four real 2-rank runs)
def test_a_checkpoint_fix_is_checked_by_the_alternative_b_took(tmp_path):
    """checkpoint.blocking on synchronous DCP saves offers async_save or a save less often. A new-user trial (a GPT-2
    loop saving with dcp.save every 10 steps, 2 gloo ranks) applied async_save, and compare checked the save-less-often
    prediction, which "held" by chance. Four real runs of the reference GPT, 24 steps, the model's and optimizer's
    state saved by DCP (tests/trace_fixtures.DcpSaves): A dcp.save every 4 steps (~330 ms saves, ~26% of the time
    here), B dcp.async_save every 4 (~60 ms stagings, ~6%), C dcp.save every 8, D dcp.async_save every 8. B's records
    tell which alternative it took, and compare checks that one: B async_save's (held: under half of A's share, its
    gain per step within A's saves' time), C the save less often at its own interval (the advised one named), D both
    and A against itself neither, nothing checked."""
    from fsdp_doctor.present.compare import tables
    from fsdp_doctor.workloads import WorkloadConfig, launch
    from trace_fixtures import DcpSaves

    sides = {}
    for name, every, asynchronous in (("A", 4, False), ("B", 4, True), ("C", 8, False), ("D", 8, True)):
        cfg = WorkloadConfig(steps=24)
        launch(cfg, nproc=2, watch_kwargs={"out_dir": str(tmp_path / name), "profile": False},
               on_step=DcpSaves(tmp_path / f"{name}-checkpoints", every, cfg.steps, asynchronous), timeout_s=300)
        sides[name] = compare_side(load_run(tmp_path / name))
    for name, asynchronous in (("A", False), ("B", True), ("C", False), ("D", True)):
        for c in sides[name].report.steps.checkpoints.values():  # (the save after step 4k: in step 4k's record)
            assert c.steps == ([4, 8, 12, 16, 20] if name in "AB" else [8, 16]), (name, c)
            assert c.async_saves == (c.saves if asynchronous else 0), (name, c)
    f = next(f for f in sides["A"].report.findings if f.code == "checkpoint.blocking")
    assert "Save asynchronously" in f.recommendation.text and f.evidence["save_steps_after"] > 8, f.evidence

    def check(b):
        cmp = C.compare(sides["A"], sides[b], applied=["checkpoint.blocking"])
        (chk,) = cmp.predictions
        (t,) = [t for t in tables(cmp) if t.title.startswith("Predictions")]
        print(f"\nA -> {b}: {chk}\n{t.rows[0][1]}")
        return chk, t.rows[0][1]

    chk, cell = check("B")
    assert chk.share_pct_predicted is None, chk  # (it was the save-less-often prediction's share_pct_after)
    assert (chk.share_fix, chk.share_every_a, chk.share_every_b) == ("async_save", 4, 4), chk
    assert chk.share_pct_before == f.evidence["share_pct"] and chk.share_held is True, chk
    assert chk.share_pct_measured <= 0.5 * chk.share_pct_before, chk
    assert chk.gain_ms_per_step_at_most == f.evidence["gain_ms_per_step_at_most"], (chk, f.evidence)
    assert 0 < chk.gain_ms_per_step_measured <= chk.gain_ms_per_step_at_most, chk
    assert cell.startswith(f"async_save: share {chk.share_pct_before:.1f}%\n→ the copy's only (held at\nhalf of it "
                           f"or under)\n→ {chk.share_pct_measured:.1f}%: held\n("), cell

    chk, cell = check("C")
    assert (chk.share_fix, chk.share_every_b, chk.share_saves_b) == ("less often", 8, 2), chk
    assert chk.share_every_advised == f.evidence["save_steps_after"] and chk.share_held is True, chk
    # A's saves' time with B's 2 saves (A's share_pct_after is for its advised interval, which C did not take)
    ca = next(c for c in sides["A"].report.steps.checkpoints.values()
              if round(100 * c.ms_total / c.wall_ms_total, 1) == chk.share_pct_before)
    step_ms, setup = (ca.wall_ms_total - ca.ms_total) / ca.counted_steps, f.evidence["first_save_setup_ms"]
    saves_ms, steps = setup + 2 * (ca.ms_total - setup) / ca.saves, ca.counted_steps  # (C's too: 23, step 0 out)
    assert chk.share_pct_predicted == pytest.approx(100 * saves_ms / (steps * step_ms + saves_ms), abs=0.06), chk
    assert cell.startswith(f"2 saves, every 8 steps (advised: every {f.evidence['save_steps_after']}):\nshare "
                           f"{chk.share_pct_before:.1f}% → {chk.share_pct_predicted:.1f}%\n→ "), cell

    chk, cell = check("D")
    assert (chk.share_fix, chk.share_held, chk.share_pct_predicted) == ("both", None, None), chk
    assert "not checked: B saved asynchronously every 8 steps, A synchronously every 4 steps: how and how often both " \
           "changed" in cell, cell
    chk, cell = check("A")
    assert (chk.share_fix, chk.share_held) == ("neither", None), chk
    assert cell.endswith("not checked: B saved synchronously every 4 steps, as A: neither of the fix's alternatives "
                         "(async_save, a save less often)"), cell


def test_units_inside_checkpoint_wrappers_are_matched_by_their_module_path(checkpoint_wrapped_pair):
    """Each block checkpointed as accelerate's FSDP2 plugin does it (a new-user trial's runs/cap3 against runs/fix_ac,
    ac.recommended's fix): the block's unit becomes "layers.0._checkpoint_wrapped_module" and the wrapper an empty
    unit "layers.0". compare read "wrapping, 3 units differ, 4 units -> 7 units" and, in the exposed-communication
    table, every block's rows -100% under its old name and new under the wrapped one, hiding the change. Units are
    matched by their module path without the wrapper's segment: the change is the blocks' checkpointing."""
    from fsdp_doctor.present.compare import tables

    a, b = (compare_side(load_run(p)) for p in checkpoint_wrapped_pair)
    assert any(u.name == "layers.0._checkpoint_wrapped_module" for u in b.report.units)  # the shape compared
    cmp = C.compare(a, b)
    blocks = ["layers.0", "layers.1", "layers.2"]
    assert [(c.key, c.a, c.b, c.units) for c in cmp.config] == [("checkpoint", "none", "unit", blocks)]
    rows = {(r.unit, r.collective, r.phase): (r.a_ms, r.b_ms) for r in cmp.comm}
    assert cmp.comm_rows == len(rows) and all(a_ms is not None and b_ms is not None for a_ms, b_ms in rows.values()), \
        rows
    assert {u for u, _, _ in rows} == {u.name or "(root)" for u in a.report.units}, rows
    (config,) = [t for t in tables(cmp) if t.title == "Configuration changed"]
    assert config.rows == [("checkpoint", "layers.0, layers.1, layers.2", "none", "unit")], config.rows


# ------------------------------------------------------------------ what plain traces show of a setting changed
def _gather_folder(root, name, **kw):
    """A folder of one known-answer gloo trace (trace_fixtures.gloo_gather_trace: units "0" and "1", 2 steps)."""
    gloo_gather_trace(**kw).write(root / name / "rank0.5.pt.trace.json.gz")
    return root / name


def test_plain_traces_show_the_allgathers_dtype_size_and_blocking(tmp_path):
    """A new-user trial's plain gloo traces: bf16 parameters (every all-gather 774.50 -> 387.25 KiB, c10::BFloat16 in
    the c10d ops' args) and async unshard (the host blocked in 72 of 72 all-gathers, then in 6) both read "no
    configuration change found", the step's change the host's. Known answers: what a plain trace carries of them is a
    change: the all-gathers' dtype per unit, their size where the dtype is the same, the all-gathers the host sat in
    (sync unshard against async: prefetch.sync_unshard's fix, its prediction checked)."""
    from rich.console import Console

    from fsdp_doctor.present.compare import render_comparison

    base = _gather_folder(tmp_path, "base", sync=False, prefetch=False, dtype="float")
    mp = _gather_folder(tmp_path, "mp", sync=False, prefetch=False, dtype="c10::BFloat16")
    sync = _gather_folder(tmp_path, "sync", sync=True, prefetch=False, dtype="float")
    big = _gather_folder(tmp_path, "big", sync=False, prefetch=False, dtype="float", gathered=2 * 198272)

    def changes(a, b):
        cmp = compare_runs(load_run(a), load_run(b))
        return cmp, [(c.key, c.a, c.b, c.units) for c in cmp.config]

    assert changes(base, base)[1] == []
    cmp, got = changes(base, mp)
    assert got == [("allgather_dtype", "float32", "bfloat16", ["0", "1"])]  # (its bytes halved: said by the dtype)
    assert not cmp.summary.startswith("no configuration change found"), cmp.summary
    con = Console(width=100, record=True, color_system=None, file=open(os.devnull, "w"))
    render_comparison(cmp, con)
    out = con.export_text()
    assert any(ln.split() == ["allgather_dtype", "0,", "1", "float32", "bfloat16"] for ln in out.splitlines()), out
    assert max(len(ln) for ln in out.splitlines()) <= 100
    assert changes(base, big)[1] == [("allgather_bytes", "774.50 KiB", "1.51 MiB", ["0", "1"])]
    cmp, got = changes(sync, base)
    assert got == [("allgathers_blocking_host", "4 of 4", "0 of 4", [])]
    assert [(p.code, p.recognised_by) for p in cmp.predictions] == [
        ("prefetch.sync_unshard", "config diff: allgathers_blocking_host")]
    assert "prefetch.sync_unshard" in {f.code for f in cmp.findings.resolved}
    assert not cmp.summary.startswith("no configuration change found"), cmp.summary


def test_a_finding_under_its_threshold_with_no_change_of_its_fix_is_not_called_resolved(prefetch_pair):
    """A new-user trial's bf16 run listed prefetch.exposed_allgather "resolved" where no prefetch had changed: its
    exposure fell under its threshold. A finding gone in B whose fix's settings were read on both sides and none
    changed is "not resolved": below its threshold in B, no change of its fix found; "resolved" where one was, or
    where --applied names it, or where compare cannot read its fix's setting (a plain trace's
    reshard_after_forward)."""
    from fsdp_doctor.present.compare import tables
    from fsdp_doctor.report_sections import Finding, Recommendation

    off, on = prefetch_pair
    code = "prefetch.exposed_allgather"

    def pair(b_path):
        a, b = compare_side(load_run(off)), compare_side(load_run(b_path))
        a.report.findings.append(Finding(code="reshard.after_forward", severity="warning", title="reshard",
                                         evidence={}, recommendation=Recommendation(text="")))
        b.report.findings = [f for f in b.report.findings if f.code != code]
        return a, b

    cmp = C.compare(*pair(off))
    assert [f.code for f in cmp.findings.below_threshold] == [code]
    assert cmp.findings.below_threshold[0].why == "below its threshold in B; no change of its fix found"
    assert {f.code for f in cmp.findings.resolved} == {"reshard.after_forward"}  # (not read from plain traces)
    (t,) = [t for t in tables(cmp) if t.title == "Findings"]
    (row,) = [r for r in t.rows if r[1] == code]
    assert row[0] == "not resolved" and row[3].endswith("(below its threshold in B; no change of its fix found)"), row
    assert code in {f.code for f in C.compare(*pair(off), applied=[code]).findings.resolved}
    cmp = C.compare(*pair(on))  # forward prefetch set: its fix
    assert code in {f.code for f in cmp.findings.resolved} and not cmp.findings.below_threshold


@pytest.fixture(scope="module")
def plain_gloo_trio(tmp_path_factory):
    """Three real 2-rank gloo runs of the reference workload profiled with plain torch.profiler (record_shapes=True,
    no doctor records): ``base`` (async unshard), ``mp`` (bf16 parameters, gradients reduced in float32, as the
    trial's), ``sync`` (no async unshard)."""
    workloads = pytest.importorskip("fsdp_doctor.workloads")
    root = tmp_path_factory.mktemp("plain_trio")
    for name, knobs in (("base", {}), ("mp", {"param_dtype": "bf16", "reduce_dtype": "fp32"}),
                        ("sync", {"async_unshard": False})):
        (root / name).mkdir()
        hook = ProfileWindow(root / name, warmup=1, active=3, record_shapes=True)
        # (d_model 256: with 128, gloo finished 18-22 of async unshard's 28 all-gathers before the host's call
        # returned on a loaded host, near the synchronous unshard's share)
        cfg = workloads.WorkloadConfig(**{"steps": hook.steps_needed(), "async_unshard": True, "d_model": 256,
                                          "n_layers": 2, "seq_len": 64, **knobs})
        workloads.launch(cfg, nproc=2, on_step=hook, timeout_s=300)
    return root


@pytest.mark.slow
def test_real_plain_traces_show_bf16_allgathers_and_async_unshard(plain_gloo_trio):
    """The trial's two pairs, from real runs: bf16 parameters halve every all-gather (the reduce-scatters stay
    float32) and read as the all-gathers' dtype changed on every unit; the synchronous unshard against async, as the
    all-gathers the host sat in going from (nearly) all to few, prefetch.sync_unshard's fix."""
    base, mp, sync = (plain_gloo_trio / n for n in ("base", "mp", "sync"))
    ra, rb = build_report(load_run(base)), build_report(load_run(mp))

    def sizes(rep, coll):
        return {(r.rank, r.unit, r.phase): r.bytes_per_call for r in rep.overlap.per_unit if r.collective == coll}

    ag_a, ag_b = sizes(ra, "all_gather"), sizes(rb, "all_gather")
    assert ag_a and set(ag_a) == set(ag_b) and all(ag_b[k] == ag_a[k] / 2 for k in ag_a), (ag_a, ag_b)
    assert sizes(ra, "reduce_scatter") == sizes(rb, "reduce_scatter")
    cmp = compare_runs(load_run(base), load_run(mp))
    units = sorted({C._path(r.unit) for r in ra.overlap.per_unit if r.collective == "all_gather"})
    assert [(c.key, c.a, c.b, c.units) for c in cmp.config] == [("allgather_dtype", "float32", "bfloat16", units)]
    assert not cmp.summary.startswith("no configuration change found"), cmp.summary
    cmp = compare_runs(load_run(sync), load_run(base))
    (c,) = cmp.config
    (blocked_a, total_a), (blocked_b, total_b) = (map(int, v.split(" of ")) for v in (c.a, c.b))
    assert c.key == "allgathers_blocking_host" and blocked_a >= 0.9 * total_a > blocked_b and total_a == total_b, c
    # (the rule's share: prefetch.sync_unshard raised in A, not in B, its fix recognised)
    assert "prefetch.sync_unshard" in {f.code for f in cmp.findings.resolved}
    assert ("prefetch.sync_unshard", "config diff: allgathers_blocking_host") in {
        (p.code, p.recognised_by) for p in cmp.predictions}
    assert not cmp.summary.startswith("no configuration change found"), cmp.summary


def test_two_fixes_in_one_rerun_check_each_peak_with_the_others_change():
    """A new-user trial pasted prefetch.exposed_allgather's fix (peak unchanged) and memory.outputs_kept's `del
    outputs` (peak 17.42 -> 16.54 MiB) into one rerun of an HF GPT-2: B's peak 16.54 MiB, as the latter predicted,
    read "missed: lower than predicted" against the prefetch's unchanged peak, with or without --applied naming the
    loop fix. Each fix's peak is checked with the changes of the other fixes B applies on other settings (a loop fix
    B resolved counts, as named or not); a ceiling, a fix of the same settings, or a finding B still raises does not."""
    from types import SimpleNamespace

    from fsdp_doctor.compare_sections import Comparison, ConfigChange, PredictionCheck
    from fsdp_doctor.present.compare import tables
    from fsdp_doctor.report_sections import Finding, Predicted, Recommendation

    def finding(code, after, **kw):
        return Finding(code=code, severity="info", title=code, evidence={}, recommendation=Recommendation(text=""),
                       predicted=Predicted(peak_bytes_before=18_262_184, peak_bytes_after=after, **kw))

    prefetch = finding("prefetch.exposed_allgather", 18_262_184)
    outputs = finding("memory.outputs_kept", 17_346_756)  # the trial's figures: 893.97 KiB freed
    a = SimpleNamespace(report=SimpleNamespace(findings=[prefetch, outputs]))
    b = SimpleNamespace(report=SimpleNamespace(findings=[]))
    changes = [ConfigChange(key="forward_prefetch", a="none", b="transformer.h.1", units=["transformer.h.0"])]
    for applied in ([], ["memory.outputs_kept"]):
        got = {p.code: p for p in C._predictions(a, b, changes, applied, None, 18_262_184, 17_346_752)}
        p = got["prefetch.exposed_allgather"]
        assert (p.peak_with, p.peak_bytes_predicted, p.peak_held) == (["memory.outputs_kept"], 17_346_756, True)
    assert got["memory.outputs_kept"].peak_with == []  # (the prefetch's own change is none)
    assert got["memory.outputs_kept"].peak_held is True
    # the loop fix's finding still raised in B: not applied, the prefetch's peak alone (and that missed)
    b.report.findings = [outputs]
    [p] = C._predictions(a, b, changes, [], None, 18_262_184, 17_346_752)
    assert (p.peak_with, p.peak_bytes_predicted, p.peak_held) == ([], 18_262_184, False)
    # a ceiling ("may rise by up to") is no expected change; a fix of the same settings is not added to its own
    b.report.findings = []
    a.report.findings = [prefetch, finding("memory.outputs_kept", 18_500_000, peak_at_most=True),
                         finding("prefetch.too_early", 17_000_000)]
    got = {p.code: p for p in C._predictions(a, b, changes, ["prefetch.too_early"], None, 18_262_184, 18_262_184)}
    assert got["prefetch.exposed_allgather"].peak_with == []
    # the terminal says which fixes the predicted peak holds
    row = PredictionCheck(code="prefetch.exposed_allgather", recognised_by="config diff: forward_prefetch",
                          peak_bytes_predicted=17_346_756, peak_bytes_measured=17_346_752, peak_pct_error=0.0,
                          peak_held=True, peak_with=["memory.outputs_kept"])
    c = msgspec.convert({"a": {"path": "a", "source": "records", "steps": 9},
                         "b": {"path": "b", "source": "records", "steps": 9}, "summary": "s"}, Comparison)
    c.predictions = [row]
    [t] = [t for t in tables(c) if t.title.startswith("Predictions")]
    assert "16.54 MiB with the fix of memory.outputs_kept\n→ 16.54 MiB (+0.00%):\nheld" in t.rows[0][2]
