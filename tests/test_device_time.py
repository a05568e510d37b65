"""The device's view of the steps on CUDA (issue #22, item 1), read on the CPU: the recorder's idle and
outside-the-model brackets (record/gpu_timing.py, with events that a fake device clock stamps), the step
statistics' ``device`` view and ``jitter.data_wait`` on the recorded H100 runs under ``traces/gpu/`` (recorded
with the brackets at 9457136), whose loop waits for the GPU once per step (``loss.item()``, a pageable
``.to(device)``) and has no slow loader: the host's time outside the model there holds the GPU's backlog, 3.5% to
81.5% of the step, which fires the rule on the host's clock alone on 18 of the 20 runs, while the device idles
0.1-6.2% of its period between ``optimizer.step()`` and the forward on every rank but the planted straggler's;
the fallback for files written before the brackets (a copy of one run with them stripped); and the two 2-rank
runs under ``traces/gpu_device_time/``, recorded with the device's brackets."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

GPU = REPO / "traces" / "gpu"
RUNS = [GPU / "fixture"] + sorted(p for p in (GPU / "scenarios").glob("*") if (p / "manifest.json").exists())
# the runs recorded on the H100 (2026-11-23/24), whose hosts waited for the GPU's backlog outside the model (3.5-81.5%
# of the step). The H200's rows (2026-11-28, the same loop, this tree's recorder) put 0.3-2.5% of the step outside
# the model on the host's clock, under the device's own idle before the forward (1.1-3.9%): no backlog to wait for
# there, so the host-against-device comparisons below hold for the H100's runs alone
H100_RUNS = [p for p in RUNS if (p / "rank0.records.jsonl").exists()
             and '"device_name":"NVIDIA H100' in (p / "rank0.records.jsonl").read_text()[:20000]]
recorded = pytest.mark.skipif(not (GPU / "fixture" / "manifest.json").exists(), reason="traces/gpu/ not recorded")


class _Clock:
    now = 0.0  # ms on the fake device's clock at which the next recorded event completes
    records = 0  # events recorded


class FakeEvent:
    """torch.cuda.Event's surface that GpuTimeline uses, stamped by ``_Clock``: recorded, complete, timed."""

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self):
        self.t = _Clock.now
        _Clock.records += 1

    def query(self):
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return other.t - self.t


def test_the_timeline_times_the_device_outside_the_model(monkeypatch):
    """Three steps on a fake device clock: the idle from one step's end to the next one's start, the time from the
    start to the first forward and from the optimizer's end to the step's end, each read from the events of the
    brackets the host timings use, a step later; the first step has no idle before it."""
    from fsdp_doctor.record.gpu_timing import GpuTimeline

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    tl = GpuTimeline(rank=0, n_units=2, names=["", "layers.0"])
    out = []

    def at(t, fn, *args):
        _Clock.now = t
        return fn(*args)

    t0 = 0.0
    for step, (idle, wait) in enumerate([(0.0, 5.0), (2.0, 30.0), (0.5, 1.0)]):
        t0 += idle
        at(t0, tl.begin_step)
        at(t0 + wait, tl.open, 0, 0)      # the batch arrives: the root's forward
        at(t0 + wait + 1, tl.open, 1, 0)
        at(t0 + wait + 9, tl.close, 1, 0)
        at(t0 + wait + 10, tl.close, 0, 0)
        at(t0 + wait + 12, tl.open, 0, 1)  # loss between: 2 ms
        at(t0 + wait + 30, tl.close, 0, 1)
        at(t0 + wait + 34, tl.optimizer_begin)  # 4 ms between backward and the optimizer
        at(t0 + wait + 38, tl.optimizer_end)
        t0 += wait + 41  # zero_grad and the loop's code: 3 ms
        out += at(t0, tl.end_step, step)
    out += tl.flush()
    assert [g.step for g in out] == [0, 1, 2]
    assert [g.idle_before_ms for g in out] == [None, 2.0, 0.5]
    assert [g.before_forward_ms for g in out] == [5.0, 30.0, 1.0]
    assert [g.after_model_ms for g in out] == [3.0, 3.0, 3.0]
    assert [g.step_ms for g in out] == [46.0, 71.0, 42.0]
    g = out[1]
    assert (g.forward_ms, g.backward_ms, g.optimizer_ms) == (10.0, 18.0, 4.0)
    assert out[0].units == [["", 10.0, 18.0], ["layers.0", 8.0, 0.0]]  # each unit: every UNIT_EVERY-th step
    assert g.units == []
    # without an optimizer hook pair, the step's last phase is its backward
    at(t0, tl.begin_step)
    at(t0 + 1, tl.open, 0, 0)
    at(t0 + 2, tl.close, 0, 0)
    at(t0 + 3, tl.open, 0, 1)
    at(t0 + 4, tl.close, 0, 1)
    (last,) = at(t0 + 10, tl.end_step, 3)
    assert (last.idle_before_ms, last.before_forward_ms, last.after_model_ms) == (0.0, 1.0, 6.0)

@pytest.fixture
def timeline(monkeypatch):
    from fsdp_doctor.record.gpu_timing import GpuTimeline

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    _Clock.now, _Clock.records = 0.0, 0
    return GpuTimeline(0, 3, ["", "layers.0", "layers.1"], unit_every=2)


def _step(tl, root=True):
    """One step: the root (unit 0, if ``root``) around layers 0 and 1, forward 1 ms per layer, backward 2 ms per
    layer, optimizer 3 ms; 0.5 ms idle at the start."""
    tick = lambda ms: setattr(_Clock, "now", _Clock.now + ms)  # noqa: E731
    tl.begin_step()
    tick(0.5)
    for kind, layers, ms in ((0, (1, 2), 1), (1, (2, 1), 2)):  # forward, then backward in reverse
        if root:
            tl.open(0, kind)
        for u in layers:
            tl.open(u, kind)
            tick(ms)
            tl.close(u, kind)
        if root:
            tl.close(0, kind)
    tl.optimizer_begin()
    tick(3)
    tl.optimizer_end()


@pytest.mark.parametrize("root", [True, False])
def test_units_are_timed_every_nth_step_and_the_phases_every_step(timeline, root):
    """Step 0 (and every unit_every-th) times each unit's spans; step 1 only the outermost ones (the root's, or
    each top-level unit's without a root), with the same phases, and fewer events recorded."""
    recs, events = [], []
    for step in range(4):
        before = _Clock.records
        _step(timeline, root)
        recs += timeline.end_step(step)
        events.append(_Clock.records - before)
    assert [r.step for r in recs] == [0, 1, 2, 3]
    for r in recs:
        assert (r.forward_ms, r.backward_ms, r.optimizer_ms, r.step_ms, r.before_forward_ms) == (2, 4, 3, 9.5, 0.5)
    assert [bool(r.units) for r in recs] == [True, False, True, False]
    by = {row[0]: row[1:] for row in recs[2].units}
    assert by["layers.0"] == [1, 2] and by["layers.1"] == [1, 2]
    assert by[""] == ([2, 4] if root else [0, 0])
    # timed steps: step start/end, optimizer pair, 2 per span; untimed ones: the outermost spans' only
    spans = 6 if root else 4
    outer = 2 if root else 4
    assert events == [4 + 2 * spans, 4 + 2 * outer] * 2


def test_events_are_reused_across_untimed_steps(timeline):
    """Untimed steps return the events nobody reads to the pool: the timeline holds a bounded set of them."""
    made = []
    orig = FakeEvent.__init__

    def counting(self, enable_timing=True):
        made.append(1)
        orig(self, enable_timing)

    FakeEvent.__init__ = counting
    try:
        for step in range(30):
            _step(timeline, root=step % 3 == 0)
            timeline.end_step(step)
        first = len(made)
        for step in range(30, 60):
            _step(timeline, root=False)
            timeline.end_step(step)
    finally:
        FakeEvent.__init__ = orig
    assert len(made) == first  # steady state: no new event after the first steps
    pool = timeline._pool
    assert len({id(ev) for ev in pool}) == len(pool)  # none handed out twice



def test_old_device_records_read_without_the_new_brackets():
    """A GpuTimes line written before the brackets existed reads with None for them (the format is unchanged)."""
    import msgspec

    from fsdp_doctor.records import AnyRecord

    line = b'{"t":"gpu","rank":0,"step":4,"step_ms":269.4,"forward_ms":96.4,"backward_ms":143.4,"optimizer_ms":4.8}'
    g = msgspec.json.decode(line, type=AnyRecord)
    assert (g.idle_before_ms, g.before_forward_ms, g.after_model_ms) == (None, None, None)


@recorded
def test_the_device_view_of_a_recorded_h100_run():
    """gpu_gpt_tuned (2 NCCL ranks on one H100, recorded with the device's brackets): the device's medians over the
    same 5 steady steps as the host's, its idle between steps measured by its events, and its time between
    ``optimizer.step()`` and the forward: 2.7 ms of rank 0's 75.6 ms period (2.4 before the forward, 0.3 after the
    model), where the host's clock puts 30.9 ms (41% of its step, the GPU's backlog) and the device step's time
    outside its phases (the reduce-scatters' tail and the loss with it) is 15.7 ms."""
    import fsdp_doctor
    from fsdp_doctor.analyze.steps import IDLE_MEASURED

    report = fsdp_doctor.build_report(fsdp_doctor.load_run(GPU / "scenarios" / "gpu_gpt_tuned"))
    st = report.steps.per_rank["0"]
    dev = st.device
    assert dev.count == st.count == 5
    assert (dev.step_ms, dev.forward_ms, dev.backward_ms, dev.optimizer_ms) == (73.521, 16.712, 34.424, 6.092)
    assert dev.outside_phases_ms == 15.684
    assert dev.idle_source == IDLE_MEASURED
    assert (dev.idle_between_ms, dev.period_ms) == (2.393, 75.618)
    assert abs(dev.period_ms - st.p50_ms) < 0.1 and st.p50_ms == 75.547  # the host's and the device's periods
    assert (dev.before_forward_ms, dev.after_model_ms, dev.outside_ms) == (2.396, 0.274, 2.669)  # median of sums
    assert st.phases_p50_ms["outside"] == 30.915  # the host's: 41% of its step, the GPU's backlog
    assert report.steps.per_rank["1"].device.outside_ms == 0.903
    assert report.steps.job.device.count == 10 and report.steps.job.device.idle_source == IDLE_MEASURED
    # gradient accumulation: forward (first micro-batch to last) spans backward, so no time outside the phases;
    # the brackets before the first forward and after the model still time the device's idle there
    acc = fsdp_doctor.build_report(fsdp_doctor.load_run(GPU / "scenarios" / "gpu_gpt_accum")).steps.per_rank["0"]
    assert acc.device.count == 5 and acc.device.outside_phases_ms is None
    assert (acc.device.before_forward_ms, acc.device.after_model_ms, acc.device.outside_ms) == (2.394, 0.332, 2.514)
    assert acc.phases_p50_ms["outside"] == 151.201  # the host's, of its 282.2 ms step


_BRACKETS = ("idle_before_ms", "before_forward_ms", "after_model_ms")


def _without_brackets(src: Path, dst: Path) -> Path:
    """A copy of the recorded run ``src`` as the recorder wrote it before it timed the device's brackets: its
    GpuTimes lines without ``_BRACKETS``, all else (steps, profiler traces) the same."""
    import json
    import shutil

    shutil.copytree(src, dst)
    stripped = 0
    for f in dst.glob("rank*.records.jsonl"):
        lines = []
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("t") == "gpu":
                stripped += sum(rec.pop(k, None) is not None for k in _BRACKETS)
            lines.append(json.dumps(rec, separators=(",", ":")))
        f.write_text("\n".join(lines) + "\n")
    assert stripped  # the recording had them
    return dst


@recorded
def test_runs_recorded_before_the_brackets_fall_back_to_a_bound(tmp_path):
    """Files written before the recorder timed the device's brackets (gpu_gpt_tuned with them stripped): the same
    device medians, its idle between steps from the host's period, no device time between ``optimizer.step()``
    and the forward, and jitter.data_wait's share bounded by the device step's time outside its phases, which
    holds the loss and the reduce-scatters' tail: 15.7 ms, 20.8% of rank 0's 75.5 ms step (15.6% on rank 1), over
    the rule's 15% where the brackets say 3.5%; a bound is never a finding: quiet, asking for a new recording."""
    import fsdp_doctor
    from fsdp_doctor.analyze.steps import IDLE_FROM_PERIOD
    from fsdp_doctor.diagnose.base import Context
    from fsdp_doctor.diagnose.rules import jitter as J

    src = GPU / "scenarios" / "gpu_gpt_tuned"
    exact_run = fsdp_doctor.load_run(src)
    exact = fsdp_doctor.build_report(exact_run)
    exact_ctx = Context(run=exact_run, report=exact)
    run = fsdp_doctor.load_run(_without_brackets(src, tmp_path / "gpu_gpt_tuned"))
    report = fsdp_doctor.build_report(run)
    ctx = Context(run=run, report=report)
    for r, st in report.steps.per_rank.items():
        dev, was = st.device, exact.steps.per_rank[r].device
        assert dev.count == was.count == 5
        assert (dev.step_ms, dev.forward_ms, dev.backward_ms, dev.optimizer_ms, dev.outside_phases_ms) == (
            was.step_ms, was.forward_ms, was.backward_ms, was.optimizer_ms, was.outside_phases_ms)
        assert dev.idle_source == IDLE_FROM_PERIOD
        assert dev.idle_between_ms == round(st.p50_ms - dev.step_ms, 3) and dev.period_ms == st.p50_ms
        assert dev.outside_ms is None and dev.before_forward_ms is None and dev.after_model_ms is None
        sh = J._share(ctx, r, st)
        assert sh.clock == J.CLOCK_BOUND and sh.outside_ms == dev.outside_phases_ms
        assert sh.share > J._share(exact_ctx, r, exact.steps.per_rank[r]).share  # an upper bound: 20.8% vs 3.5%
    st0 = report.steps.per_rank["0"]
    assert (st0.device.idle_between_ms, st0.device.period_ms, st0.device.outside_phases_ms) == (2.026, 75.547, 15.684)
    status = next(s for s in report.rules if s.code == "jitter.data_wait")
    assert status.status == "quiet" and "jitter.data_wait" not in {f.code for f in report.findings}
    assert "bound it at 21% of the step (rank 0)" in status.reason and "record again" in status.reason
    exact_status = next(s for s in exact.rules if s.code == "jitter.data_wait")
    assert exact_status.reason == ("time between optimizer.step() and the next forward is at most 4% of the step "
                                   "(rank 0, device clock; fires from 15%)")


@recorded
@pytest.mark.parametrize("path", RUNS, ids=[p.name for p in RUNS])
def test_data_wait_reads_the_device_on_every_recorded_gpu_run(path):
    """On every recorded H100 run the host's clock alone puts 3.5-81.5% of the step outside the model (the GPU's
    backlog, waited for once per step) and fires the rule wherever it reaches 15% (18 of the 20 runs); the
    device's brackets time its own idle between ``optimizer.step()`` and the forward, 0.1-6.2% of its period, on
    every rank but one, and the rule is quiet on the device's clock. The one: gpu_gpt_straggler's rank 1, which
    sleeps 30 ms before each forward, a real idle of its device: 33.3 ms of its 105.2 ms period (32.1%) before the
    forward, over the rule's 15%; the rule leaves it to straggler.rank (+30.3 ms per step outside the model)."""
    import msgspec

    import fsdp_doctor
    from fsdp_doctor.analyze.steps import IDLE_MEASURED
    from fsdp_doctor.diagnose.base import Context
    from fsdp_doctor.diagnose.rules import jitter as J
    from test_diagnose_rules import run_rule

    run = fsdp_doctor.load_run(path)
    report = fsdp_doctor.build_report(run)
    status = next(s for s in report.rules if s.code == "jitter.data_wait")
    assert status.status == "quiet" and "jitter.data_wait" not in {f.code for f in report.findings}
    ctx = Context(run=run, report=report)
    shares = {r: J._share(ctx, r, st) for r, st in report.steps.per_rank.items()}
    assert all(sh.clock == J.CLOCK_DEVICE for sh in shares.values()), shares
    assert all(st.device.idle_source == IDLE_MEASURED for st in report.steps.per_rank.values())
    host = {r: J._outside_ms(ctx, r, st) / st.p50_ms for r, st in report.steps.per_rank.items()}
    if path in H100_RUNS:  # the host waited for the device's backlog there: its clock read more outside
        assert all(sh.share <= host[r] for r, sh in shares.items()), (shares, host)
    over = {r for r, sh in shares.items() if sh.share >= J.OUTSIDE_SHARE_MIN}
    if path.name == "gpu_gpt_straggler":
        # rank 1's 30 ms sleep before the forward: its device idles 33.3 ms of its 105.2 ms period there
        dev = report.steps.per_rank["1"].device
        assert over == {"1"} and round(100 * shares["1"].share, 1) == 32.1, shares
        assert (dev.before_forward_ms, dev.period_ms) == (33.318, 105.227)
        assert status.reason == "the time outside the model is rank(s) 1' own delay: straggler.rank reports it"
        (strag,) = [f for f in report.findings if f.code == "straggler.rank"]
        assert strag.evidence["rank"] == 1 and strag.evidence["phase"] == "outside"
        assert " ms per step outside the model (data loading" in strag.title, strag.title  # (read "in outside")
    else:
        assert not over and max(sh.share for sh in shares.values()) < 0.065, shares
        assert status.reason.endswith(", device clock; fires from 15%)"), status.reason
    # the same report without the device's view: the host's clock, as before the recorder timed the device
    for st in report.steps.per_rank.values():
        st.device = msgspec.UNSET
    fired = run_rule("jitter.data_wait", Context(run=run, report=report))
    assert bool(fired) == (max(host.values()) >= J.OUTSIDE_SHARE_MIN), (fired, host)
    if fired:
        assert fired[0].evidence["clock"] == J.CLOCK_HOST


@recorded
def test_the_host_clock_alone_would_fire_on_most_recorded_gpu_runs():
    """The host's clock alone fires jitter.data_wait on 18 of the 19 recorded H100 runs (its largest share 81.5%,
    the fixture's rank 1); the quiet one is gpu_gpt_offload_unpinned (3.9%, rank 0). (The one-rank
    gpu_gpt_tiny_launch_bound, 6.8% there and quiet, was recorded again on the H200 on 2026-11-30.) On the
    device's clock it fires on none."""
    import msgspec

    import fsdp_doctor
    from fsdp_doctor.diagnose.base import Context
    from fsdp_doctor.diagnose.rules import jitter as J
    from test_diagnose_rules import run_rule

    host_fired, device_fired, top = [], [], 0.0
    for path in H100_RUNS:
        run = fsdp_doctor.load_run(path)
        report = fsdp_doctor.build_report(run)
        if any(f.code == "jitter.data_wait" for f in report.findings):
            device_fired.append(path.name)
        ctx = Context(run=run, report=report)
        top = max([top] + [J._outside_ms(ctx, r, st) / st.p50_ms for r, st in report.steps.per_rank.items()])
        for st in report.steps.per_rank.values():
            st.device = msgspec.UNSET
        if run_rule("jitter.data_wait", Context(run=run, report=report)):
            host_fired.append(path.name)
    assert len(H100_RUNS) == 19 and device_fired == []
    assert sorted({p.name for p in H100_RUNS} - set(host_fired)) == ["gpu_gpt_offload_unpinned"]
    assert round(100 * top, 1) == 81.5


DEVICE_TIME = REPO / "traces" / "gpu_device_time"  # benchmarks/device_time_runs.py on the H100


def _report(name):
    import fsdp_doctor

    run = fsdp_doctor.load_run(DEVICE_TIME / name)
    return run, fsdp_doctor.build_report(run)


def test_a_recorded_sync_per_step_is_not_data_wait_on_the_device_clock():
    """2 NCCL ranks on the H100, a loss.item() after every step and no loader: the device's own brackets say it
    idled 2.0 / 2.2 ms of its 60.2 / 60.4 ms period between optimizer.step() and the forward, while the device
    step's time outside its phases (the reduce-scatters' tail, the loss) was 11.0 / 10.0 ms: quiet, on the device
    clock. The records' verdict takes its input share from the same figure."""
    from fsdp_doctor.analyze.steps import IDLE_MEASURED

    run, report = _report("sync_per_step")
    status = next(s for s in report.rules if s.code == "jitter.data_wait")
    assert status.status == "quiet"
    assert status.reason == ("time between optimizer.step() and the next forward is at most 1% of the step (rank 1, "
                             "device clock; fires from 15%)")
    dev = {r: st.device for r, st in report.steps.per_rank.items()}
    assert {r: (d.count, d.idle_source) for r, d in dev.items()} == {"0": (9, IDLE_MEASURED), "1": (9, IDLE_MEASURED)}
    assert {r: (d.outside_ms, d.period_ms, d.outside_phases_ms) for r, d in dev.items()} == {
        "0": (1.994, 60.234, 11.043), "1": (2.181, 60.36, 9.961)}
    assert {r: (d.before_forward_ms, d.after_model_ms, d.idle_between_ms) for r, d in dev.items()} == {
        "0": (1.992, 0.002, 0.001), "1": (2.178, 0.001, 0.001)}
    # the verdict from the records (host clock, no trace): input is the device's 3.7-4.6% of the steps, not the
    # host's time outside the model, 17.4-17.6% of them
    from fsdp_doctor.analyze.steps import usable_steps

    for r, v in report.verdict.per_rank.items():
        steps = usable_steps(run.ranks[int(r)].steps)
        host = 100 * sum(s.outside_ms for s in steps) / sum(s.wall_ms for s in steps)
        assert v.source == "records (host clock)" and 17 < host < 18, (r, host)
        assert v.groups_pct["input"] == {"0": 4.56, "1": 3.69}[r], (r, v.groups_pct)


def test_a_recorded_slow_loader_is_data_wait_on_the_device_clock():
    """The same run with a loader sleeping 150 ms before each batch: the device idles 152.7 ms of each step
    before the forward, 70% of its 214.5 ms period; the rule fires on the device's clock and predicts the step
    without that wait."""
    _, report = _report("slow_loader")
    (wait,) = [f for f in report.findings if f.code == "jitter.data_wait"]
    ev = wait.evidence
    assert ev["clock"] == "device" and ev["before_forward_ms_p50"] == 152.685 and ev["after_model_ms_p50"] == 0.002
    assert ev["outside_ms_p50"] == 150.978  # less the host's GC pauses (1.7 ms), jitter.gc's
    assert ev["step_p50_ms"] == 214.548 and ev["outside_share_pct"] == 70.4
    assert ev["host_outside_ms_p50"] == 163.188
    assert wait.title.startswith("The device idles 70% of each step") and wait.ranks == [0, 1]
    assert "num_workers=4, pin_memory=True, prefetch_factor=4" in wait.recommendation.text  # a GPU run: pinned
    assert wait.predicted.step_ms_before == 213.558 and wait.predicted.step_ms_after == 62.58
    assert report.verdict.job.bound == "input"
