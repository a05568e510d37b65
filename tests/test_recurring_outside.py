"""jitter.recurring_outside: work outside the model in some steps only, on every rank at once (a save the doctor
was not told of, an upload, a loader falling behind now and then), which the median step hides and the outlier
table's threshold lets pass on a noisy host. Known answers on constructed runs; the planted run is the scenario
matrix's gpt_periodic_pause row (tests/test_scenario_matrix.py)."""

from __future__ import annotations

import random

import fsdp_doctor
from fsdp_doctor.records import GpuTimes, RunConfig, StepRecord
from fsdp_doctor.store import Run
from fsdp_doctor.store.reader import RankData

CODE = "jitter.recurring_outside"


def _run(extra: dict[int, dict[int, float]], *, n: int = 16, device: str = "cpu",
         device_extra: dict[int, dict[int, float]] | None = None) -> Run:
    """Ranks of 100 ms steps with 2 ms outside the model; ``extra``: rank -> {step: ms more outside}. On
    ``device`` "cuda" each step also has device times, the device's time outside the model 2 ms plus
    ``device_extra``'s."""
    run = Run(path="constructed")
    for r in (0, 1):
        steps, gpu = [], {}
        for k in range(n):
            x = extra.get(r, {}).get(k, 0.0)
            steps.append(StepRecord(rank=r, step=k, start_ns=k, wall_ms=100.0 + x + 0.1 * (k % 3), forward_ms=33.0,
                                    backward_ms=50.0, optimizer_ms=15.0, outside_ms=2.0 + x, between_ms=1.5 + x))
            if device == "cuda":
                dx = (device_extra or {}).get(r, {}).get(k, 0.0)
                gpu[k] = GpuTimes(rank=r, step=k, step_ms=100.0 + dx, forward_ms=33.0, backward_ms=50.0,
                                  optimizer_ms=15.0, idle_before_ms=0.1, before_forward_ms=1.0 + dx, after_model_ms=1.0)
        run.ranks[r] = RankData(rank=r, steps=steps, gpu=gpu,
                                config=RunConfig(rank=r, world_size=2, backend="gloo" if device == "cpu" else "nccl",
                                                 device=device if device == "cpu" else "cuda:0"))
    return run


def _rule(run: Run):
    rep = fsdp_doctor.build_report(run)
    status = next(s for s in rep.rules if s.code == CODE)
    return [f for f in rep.findings if f.code == CODE], status, rep


def test_every_rank_stopping_every_four_steps_is_a_warning_with_its_share():
    """+150 ms outside the model in steps 3, 7, 11, 15 on both ranks: 600 ms of the 15 steady steps' 2,100 ms
    (28.6%), 40 ms per step; the median step (100 ms) and jitter.data_wait do not show it."""
    found, _, rep = _rule(_run({r: {3: 150.0, 7: 150.0, 11: 150.0, 15: 150.0} for r in (0, 1)}))
    assert len(found) == 1, found
    f = found[0]
    assert f.severity == "warning" and f.ranks == [0, 1], f
    assert f.title == "Every rank stops 150 ms outside the model in 4 of 15 steady steps, every 4 steps (29% of the time)"
    e = f.evidence
    assert (e["steps"], e["every_n_steps"], e["excess_ms"], e["share_pct"], e["cost_ms_per_step"]) == (
        [3, 7, 11, 15], 4, [150.0] * 4, 28.6, 40.0), e
    assert f.recommendation.text.startswith("In steps 3, 7, 11, 15 every rank spends 150 ms more outside the model "
                                            "than in the other steps, on every rank at once: 40.0 ms per step over "
                                            "the run, 29% of the time (rank 0)."), f.recommendation.text
    assert "doctor.checkpointing()" in f.recommendation.text and not f.recommendation.code
    # a period: the data loader restarting its workers at every epoch is one cause, and its lever is named (a new-user
    # trial's 3-batch epochs without persistent workers: 154 ms a step, 42 ms with them)
    assert "if 4 steps is your epoch, DataLoader(..., persistent_workers=True) keeps them" in f.recommendation.text
    assert not [x for x in rep.findings if x.code == "jitter.data_wait"]


def test_a_period_survives_a_step_left_out():
    """A step of the period left out of the statistics (a profiled one) keeps the period: 3, 11, 15 every 4."""
    run = _run({r: {3: 150.0, 7: 150.0, 11: 150.0, 15: 150.0} for r in (0, 1)})
    for rd in run.ranks.values():
        rd.steps[7].profiled = True
    f = _rule(run)[0][0]
    assert f.evidence["steps"] == [3, 11, 15] and f.evidence["every_n_steps"] == 4, f.evidence
    # irregular steps: no period claimed
    f = _rule(_run({r: {2: 150.0, 7: 150.0, 9: 150.0} for r in (0, 1)}))[0][0]
    assert f.evidence["every_n_steps"] is None and "every" not in f.title.split("(")[0].split("steps,")[-1], f.title


def test_quiet_where_it_is_not_every_rank_or_not_a_pattern_or_small():
    # one rank only: straggler.intermittent's (the other ranks wait for it in their collectives)
    found, st, rep = _rule(_run({1: {3: 150.0, 7: 150.0, 11: 150.0}}))
    assert not found and st.reason == ("rank(s) 1 only spend much longer outside the model in some steps, not every "
                                       "rank at once (straggler.intermittent weighs one rank's late steps)"), st
    # one event
    found, st, _ = _rule(_run({r: {7: 400.0} for r in (0, 1)}))
    assert not found and st.reason.endswith("(step 7 only: one event is not a pattern)"), st
    # spikes under 30% of a step: host noise
    found, st, _ = _rule(_run({r: {3: 25.0, 7: 25.0, 11: 25.0} for r in (0, 1)}))
    assert not found and st.reason.startswith("no 2 steps in which every rank spends 30% of a step longer"), st
    # two stops of 35 ms in 15 steps: 70 of 1,570 ms, 4.5% (steps 5 and 10, but not 15: no period)
    found, st, _ = _rule(_run({r: {5: 35.0, 10: 35.0} for r in (0, 1)}))
    assert not found and st.reason == ("every rank spends 35 ms longer outside the model in 2 of 15 steady steps: "
                                       "4.5% of the time (rank 0; fires from 5%)"), st
    # two stops of 100 ms: 200 of 1,700 ms (11.8%), a note (a warning from 15% and 3 stops)
    found, _, _ = _rule(_run({r: {5: 100.0, 10: 100.0} for r in (0, 1)}))
    assert [(f.severity, f.evidence["share_pct"]) for f in found] == [("info", 11.8)], found


def test_on_cuda_the_device_decides():
    """On CUDA a loss.item() every 4 steps spends the device's backlog on the host in that step: the host's time
    outside spikes while the device never idles. Only the device's idle before the forward counts."""
    host_only = {r: {3: 150.0, 7: 150.0, 11: 150.0, 15: 150.0} for r in (0, 1)}
    found, st, _ = _rule(_run(host_only, device="cuda"))
    assert not found and st.reason.startswith("no 2 steps in which every rank"), st
    found, _, _ = _rule(_run(host_only, device="cuda", device_extra=host_only))
    assert len(found) == 1 and found[0].evidence["measured_by"] == "device", found
    run = _run(host_only, device="cuda")
    for rd in run.ranks.values():
        for g in rd.gpu.values():
            g.before_forward_ms = None  # recorded before the device timed that window
    found, st, _ = _rule(run)
    assert not found and st.reason.startswith("on CUDA the time outside the model is the device's"), st


def test_one_ranks_late_steps_claim_a_period_from_three_on():
    """straggler.intermittent, the one-rank case (same constructed runs): rank 1 late by 150 ms outside the model in
    steps 3, 7, 11, 15 is late every 4 steps; in steps 4 and 11 only, two events are one interval, not a period (a
    trial on a shared host read "every 7 steps" from two noise spikes)."""
    def late(extra):
        rep = fsdp_doctor.build_report(_run({1: extra}))
        return next(f for f in rep.findings if f.code == "straggler.intermittent").evidence

    ev = late({3: 150.0, 7: 150.0, 11: 150.0, 15: 150.0})
    assert (ev["rank"], ev["late_steps"], ev["every_n_steps"]) == (1, [3, 7, 11, 15], 4), ev
    ev = late({4: 150.0, 11: 150.0})
    assert (ev["late_steps"], ev["every_n_steps"]) == ([4, 11], None), ev
    # a long run late now and then: the prose lists 12 steps and the evidence 50, the count beside (a 20,000-step
    # run printed all 1,230 late steps: 74 lines of one finding)
    rng = random.Random(0)
    hit = sorted(rng.sample(range(1, 2000), 120))
    rep = fsdp_doctor.build_report(_run({1: {k: 150.0 for k in hit}}, n=2000))
    f = next(f for f in rep.findings if f.code == "straggler.intermittent")
    assert f.evidence["late_steps"] == hit[:50] and f.evidence["late_step_count"] == 120
    assert len(f.evidence["late_excess_ms"]) == 50
    assert f.recommendation.text.startswith("In steps " + ", ".join(map(str, hit[:12])) + " … (+108) rank 1 spends")


def test_late_steps_spread_over_the_ranks_are_no_ones_pattern():
    """A slow DataLoader on both ranks made each rank late now and then (a new-user trial: "Rank 0 is late in 96 of
    243 steps", a warning beside jitter.data_wait's finding of the same cause, the rank named changing from one
    analysis to the next): one rank's pattern is late at least twice as often as any other."""
    both = {0: {2: 150.0, 5: 150.0, 9: 150.0}, 1: {3: 150.0, 7: 150.0, 12: 150.0, 14: 150.0}}
    rep = fsdp_doctor.build_report(_run(both))
    assert not [f for f in rep.findings if f.code == "straggler.intermittent"]
    st = next(s for s in rep.rules if s.code == "straggler.intermittent")
    assert st.reason.startswith("late steps spread over the ranks (rank 0 in 3, rank 1 in 4 of 15 steps)"), st
    # rank 1 late in 4 steps, rank 0 in 2: rank 1's pattern
    both[0] = {2: 150.0, 5: 150.0}
    f = next(f for f in fsdp_doctor.build_report(_run(both)).findings if f.code == "straggler.intermittent")
    assert f.evidence["rank"] == 1 and f.evidence["late_steps"] == [3, 7, 12, 14], f.evidence


def test_late_steps_within_the_others_spread_are_host_noise():
    """A clean 2-rank run on a shared host (a new-user trial's, its records in tests/fixtures/noisy_clean_run, no
    straggler planted) read "Rank 1 is late in 3 of 33 steps (+4 to +10 ms)": +4.0 ms in the median late step, the
    other rank's own time varying by 2.9 ms (standard deviation) from step to step. A late step stands at least twice
    that spread out of it; the constructed +150 ms stalls above stand far out (0.08 ms)."""
    from pathlib import Path

    rep = fsdp_doctor.build_report(fsdp_doctor.load_run(Path(__file__).parent / "fixtures" / "noisy_clean_run"))
    assert not [f for f in rep.findings if f.code.startswith("straggler.")]
    st = next(s for s in rep.rules if s.code == "straggler.intermittent")
    assert st.reason == ("rank 1 late in 3 of 33 steps by +4.0 ms (median), within 2x the other ranks' step-to-step "
                         "spread of their own time (2.9 ms): host noise, not a pattern"), st.reason
    # late steps that differ say their range, not one "each" (+18.5 and +200.9 ms read "+110 ms each")
    rep = fsdp_doctor.build_report(_run({1: {3: 40.0, 7: 150.0, 11: 40.0}}))
    (f,) = [f for f in rep.findings if f.code == "straggler.intermittent"]
    assert f.title == "Rank 1 is late in 3 of 15 steps (+40 to +150 ms)", f.title
    assert "lives in your loop" in f.recommendation.text
    # under a Hugging Face Trainer the loop is the Trainer's (a new-user trial read "your loop" there)
    from fsdp_doctor.records import TRAINER_DRIVER

    run = _run({1: {3: 40.0, 7: 150.0, 11: 40.0}})
    for rd in run.ranks.values():
        rd.config.driver = TRAINER_DRIVER
    (f,) = [f for f in fsdp_doctor.build_report(run).findings if f.code == "straggler.intermittent"]
    assert "lives in the Trainer's loop or your callbacks" in f.recommendation.text, f.recommendation.text


def test_one_spike_among_late_steps_is_not_the_patterns_cost():
    """Rank 1 late by 40 ms in four steps and by 800 ms in one (a host hiccup): the cost per step and the predicted
    gain came from the mean, the spike's (a new-user trial: +5 ms late steps and one of 101 ms, a warning of 9%).
    Each late step counts up to 3x the median late step's excess: 4 x 40 + 120 ms over the steps, not 960."""
    rep = fsdp_doctor.build_report(_run({1: {3: 40.0, 6: 40.0, 9: 800.0, 12: 40.0, 15: 40.0}}))
    f = next(f for f in rep.findings if f.code == "straggler.intermittent")
    n = f.evidence["steps_checked"]
    assert abs(f.evidence["cost_ms_per_step"] - 280.0 / n) < 0.05, f.evidence
    assert abs(f.evidence["spikes_capped_at_ms"] - 120.0) < 0.5, f.evidence


def test_one_stretch_of_consecutive_steps_is_no_work_done_every_few_steps():
    """Steps 5-10 of 16 each 60 ms longer outside the model on every rank, and no others (a loader that slowed for a
    while, a trial's run: "work done every few steps does this: a checkpoint save ..."): said as one stretch that
    recovered, with what does that; two steps in a row, or stops apart, keep the recurring words."""
    found, _, _ = _rule(_run({r: {k: 60.0 for k in range(5, 11)} for r in (0, 1)}))
    (f,) = found
    assert f.title.startswith("Every rank spent 60 ms more outside the model in steps 5-10 (6 in a row), then no "
                              "longer"), f.title
    assert f.evidence["consecutive"] is True and f.evidence["every_n_steps"] is None, f.evidence
    assert "Not work done every few steps" in f.recommendation.text and "checkpoint save" not in f.recommendation.text
    assert f.severity == "warning"  # (360 of 1,960 ms: 18%, six stops)
    for extra in ({5: 100.0, 6: 100.0}, {3: 100.0, 7: 100.0, 11: 100.0}):
        (g,) = _rule(_run({r: extra for r in (0, 1)}))[0]
        assert "consecutive" not in g.evidence and "Work done every few steps" in g.recommendation.text, g.title
