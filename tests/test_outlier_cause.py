"""The outlier table names the right cause when another rank was late."""

from __future__ import annotations


def test_outlier_waiting_for_a_rank_late_in_the_previous_step():
    """Rank 1 is late at the end of step 5 (its optimizer step runs 300 ms long, after rank 0 has finished step
    5): rank 0 waits for it in step 6's first all-gather. The outlier table names the late rank, not the
    all-gather wait (issue #23)."""
    from fsdp_doctor.analyze.steps import find_outliers
    from fsdp_doctor.records import StepRecord, UnitStep
    from fsdp_doctor.store import Run
    from fsdp_doctor.store.reader import RankData

    def step(n, *, opt=20.0, wait=5.0):
        fwd, bwd = 40.0 + wait, 40.0
        return StepRecord(rank=0, step=n, start_ns=n, wall_ms=fwd + bwd + opt + 5.0, forward_ms=fwd,
                          backward_ms=bwd, optimizer_ms=opt, outside_ms=5.0,
                          units=[UnitStep(name="layers.0", fwd_ms=fwd, ag_wait_fwd_ms=wait)])

    run = Run(path="constructed")
    run.ranks[0] = RankData(rank=0, steps=[step(n, wait=305.0 if n == 6 else 5.0) for n in range(1, 10)])
    run.ranks[1] = RankData(rank=1, steps=[step(n, opt=320.0 if n == 5 else 20.0) for n in range(1, 10)])
    out = {(o.rank, o.step): o for o in find_outliers(run)}
    assert out[(1, 5)].cause == "compute"  # the late rank's own step
    assert out[(0, 6)].cause == "late_rank" and "rank 1" in out[(0, 6)].detail


def test_an_outlier_with_two_causes_names_both():
    """A step 300 ms longer in compute that also waited 200 ms more outside the model: the table names both; +20 ms
    beside it is not named (a new-user trial's short-run step that counted its memory op by op and evaluated read
    "the doctor" on one rank and "compute" on the other, never the evaluation)."""
    from fsdp_doctor.analyze.steps import find_outliers
    from fsdp_doctor.records import StepRecord
    from fsdp_doctor.store import Run
    from fsdp_doctor.store.reader import RankData

    def step(n, *, extra=0.0, out=0.0):
        return StepRecord(rank=0, step=n, start_ns=n, wall_ms=105.0 + extra + out + 0.1 * (n % 3),
                          forward_ms=40.0 + extra, backward_ms=40.0, optimizer_ms=20.0, outside_ms=5.0 + out)

    def outlier(out):
        run = Run(path="constructed")
        run.ranks[0] = RankData(rank=0, steps=[step(n, extra=300.0 if n == 6 else 0.0, out=out if n == 6 else 0.0)
                                               for n in range(1, 12)])
        (o,) = [o for o in find_outliers(run) if o.step == 6]
        return o

    o = outlier(200.0)
    assert o.cause == "compute" and o.detail == ("compute +300.0 ms in forward/backward/optimizer (of +499.9 ms); also "
                                                 "time outside the model +200.0 ms (data loading or user code)")
    assert outlier(20.0).detail == "compute +300.0 ms in forward/backward/optimizer (of +319.9 ms)"


def _eval_run(eval_steps, *, n=12, eval_ms=300.0, autograd=0):
    """Two ranks of 100 ms steps; the steps in ``eval_steps`` also ran 8 forward passes without gradients
    (``autograd`` of them in eval mode with autograd on)."""
    from fsdp_doctor.records import StepRecord, UnitStep
    from fsdp_doctor.store import Run
    from fsdp_doctor.store.reader import RankData

    def step(rank, k):
        ng = eval_ms if k in eval_steps else 0.0
        return StepRecord(rank=rank, step=k, start_ns=k, wall_ms=100.0 + ng + 0.1 * (k % 3), forward_ms=30.0,
                          backward_ms=50.0, optimizer_ms=15.0, outside_ms=5.0, no_grad_ms=ng,
                          no_grad_forwards=8 if ng else 0, autograd_eval_forwards=autograd if ng else 0,
                          units=[UnitStep(name="layers.0", fwd_ms=30.0, ag_wait_fwd_ms=2.0)])

    run = Run(path="constructed")
    for r in (0, 1):
        run.ranks[r] = RankData(rank=r, steps=[step(r, k) for k in range(n)])
    return run


def test_evaluation_steps_are_left_out_and_named():
    """Evaluation between steps (forward passes without gradients, recorded apart by the hooks) is neither the
    step's forward nor time outside the model: those steps leave the statistics, and the report says so."""
    from fsdp_doctor.analyze.steps import analyze_steps
    from fsdp_doctor.present.fmt import no_grad_text

    sec = analyze_steps(_eval_run({4, 8}))
    for r in ("0", "1"):
        st, ng = sec.per_rank[r], sec.no_grad[r]
        assert st.count == 9 and st.excluded == 3 and st.p90_ms < 101, st  # step 0 and the two evaluation steps
        assert (ng.steps, ng.forwards, ng.ms_p50, ng.excluded) == ([4, 8], 16, 300.0, True), ng
    assert sec.outliers == []
    assert no_grad_text(sec) == ("Forward passes without gradients (evaluation, generation): 16 in 2 steps (4, 8), "
                                 "300.0 ms per step, counted apart from forward and outside; those steps are left "
                                 "out of the step statistics above")
    # an evaluation inside a profiler window is in its trace, whose figures (verdict, exposed communication) are
    # the window's: the line says so
    sec.profiler_steps = {"0": {"window": [7, 8], "export": [8]}, "1": {"window": [7, 8], "export": [8]}}
    assert no_grad_text(sec).endswith("left out of the step statistics above; step 8 of a profiler window: the "
                                      "trace's figures include the evaluation"), no_grad_text(sec)


def test_forwards_without_gradients_in_every_step_are_part_of_it():
    """DPO's reference forward runs through the watched model with its adapters off and without gradients, in every
    step: not an evaluation between steps (a new-user trial's torchtune lora_dpo_distributed read "evaluation,
    generation: 24 in 12 steps" and "the trace's figures include the evaluation")."""
    from fsdp_doctor.analyze.steps import analyze_steps
    from fsdp_doctor.present.fmt import no_grad_text

    sec = analyze_steps(_eval_run(set(range(12)), eval_ms=50.0))
    assert all(ng.every_step and not ng.excluded for ng in sec.no_grad.values()), sec.no_grad
    sec.profiler_steps = {"0": {"window": [7, 8], "export": [8]}, "1": {"window": [7, 8], "export": [8]}}
    assert no_grad_text(sec) == (
        "Forward passes without gradients in every step (a reference forward through the model, as DPO's with its "
        "adapters off; a teacher's): 96 in 12 steps, 50.0 ms per step, counted apart from forward and outside, part "
        "of the step statistics; steps 7, 8 of a profiler window: the trace's figures include them")
    assert not any(ng.every_step for ng in analyze_steps(_eval_run({4, 8})).no_grad.values())


def test_evaluation_with_autograd_on_is_named_and_diagnosed():
    """Forwards in eval mode with autograd on that no backward reached (torch.no_grad() forgotten) are evaluation
    like the others, and said to be: the line under the step table counts them, and memory.eval_autograd fires
    with the counts and the fix that wraps the user's evaluation; without them the rule says why it is quiet."""
    import fsdp_doctor
    from fsdp_doctor.present.fmt import no_grad_text

    rep = fsdp_doctor.build_report(_eval_run({4, 8}, autograd=8))
    assert rep.steps.no_grad["1"].with_autograd == 16 and rep.steps.per_rank["1"].count == 9
    assert no_grad_text(rep.steps).startswith("Forward passes without gradients (evaluation, generation): 16 (16 in "
                                              "eval mode with autograd on) in 2 steps (4, 8)"), no_grad_text(rep.steps)
    f = next(f for f in rep.findings if f.code == "memory.eval_autograd")
    assert (f.severity, f.evidence["forwards"], f.evidence["steps"], f.ranks) == ("info", 16, [4, 8], [0, 1]), f
    assert f.recommendation.where == "evaluation" and list(f.recommendation.inputs) == ["evaluate"]
    assert "with torch.no_grad():" in f.recommendation.code and "evaluate()" in f.recommendation.code
    # generation under no_grad in other steps (an RL loop's): neither its steps nor its time are the finding's (a
    # new-user trial read "10 step(s)" for the 5 that ran the eval-mode forwards, at the generation's time)
    run = _eval_run({2, 4, 6, 8}, autograd=8)
    for rd in run.ranks.values():
        for k in (2, 6):
            rd.steps[k].autograd_eval_forwards, rd.steps[k].no_grad_ms = 0, 500.0
    f = next(f for f in fsdp_doctor.build_report(run).findings if f.code == "memory.eval_autograd")
    assert (f.evidence["steps"], f.evidence["ms_per_step_p50"]) == ([4, 8], 300.0), f.evidence
    assert "In 2 step(s) (4, 8)" in f.recommendation.text
    quiet = fsdp_doctor.build_report(_eval_run({4, 8}))
    assert not [f for f in quiet.findings if f.code == "memory.eval_autograd"]
    assert next(s.reason for s in quiet.rules if s.code == "memory.eval_autograd").startswith("no forward in eval")


def test_evaluation_in_most_steps_stays_and_is_the_outliers_cause():
    """With too few steps without evaluation the statistics keep them; a step whose evaluation ran long is an
    outlier whose cause is that evaluation, not data loading or another rank."""
    from fsdp_doctor.analyze.steps import analyze_steps

    run = _eval_run(set(range(1, 12)) - {5}, eval_ms=20.0)
    for rd in run.ranks.values():
        rd.steps[9].no_grad_ms += 200.0
        rd.steps[9].wall_ms += 200.0
    sec = analyze_steps(run)
    assert sec.no_grad["0"].excluded is False and sec.per_rank["0"].count == 11
    causes = {(o.rank, o.step): o for o in sec.outliers}
    assert set(causes) == {(0, 9), (1, 9)}
    assert causes[(0, 9)].cause == "no_grad" and causes[(0, 9)].detail.startswith("8 forward passes without"), causes


def test_evaluation_fix_of_a_trainer_run_stays_the_users_code():
    """Under a Trainer (whose own evaluation runs under no_grad) memory.eval_autograd points at the user's own
    evaluation code, a callback's say: its fix stays as printed, not a TrainerCallback, nor "use fsdp_config"."""
    import fsdp_doctor
    from fsdp_doctor.records import TRAINER_DRIVER, RunConfig

    run = _eval_run({4, 8}, autograd=8)
    for rd in run.ranks.values():
        rd.config = RunConfig(rank=rd.rank, world_size=2, backend="gloo", device="cpu", driver=TRAINER_DRIVER)
    plain = next(f for f in fsdp_doctor.build_report(_eval_run({4, 8}, autograd=8)).findings
                 if f.code == "memory.eval_autograd")
    f = next(f for f in fsdp_doctor.build_report(run).findings if f.code == "memory.eval_autograd")
    assert f.recommendation == plain.recommendation and f.recommendation.where == "evaluation"


def test_the_doctors_own_counting_step_is_named_as_the_doctors():
    """A short run keeps the memory probe's op-by-op step (step 2) in the statistics (fewer than 3 steps would be
    left without it): its excess is the probe's cost inside the forward and backward (probe_us). The table names the
    doctor, not the user's compute; the same step slow by its own compute stays "compute". The layout of a 6-step
    run of the 2-rank CPU GPT (step 1 counts FLOPs, step 5 warms the profiler up: both profiled): 137 ms against
    94 ms, 33.1 ms of probe."""
    from fsdp_doctor.analyze.steps import find_outliers
    from fsdp_doctor.records import MemoryStep, StepRecord, UnitStep
    from fsdp_doctor.store import Run
    from fsdp_doctor.store.reader import RankData

    def step(n, *, probe_ms=0.2, extra=0.0, exact=False):
        fwd, bwd = 32.0 + 0.4 * probe_ms + extra, 54.0 + 0.6 * probe_ms
        return StepRecord(rank=0, step=n, start_ns=n, wall_ms=fwd + bwd + 11.0 + 1.5 + 0.4, forward_ms=fwd,
                          backward_ms=bwd, optimizer_ms=11.0, outside_ms=1.5, doctor_ms=0.4, profiled=n in (1, 5),
                          memory=MemoryStep(probe_us=probe_ms * 1e3, sampling="full" if exact else "replayed",
                                            transients="exact" if exact else "replayed"),
                          units=[UnitStep(name="layers.0", fwd_ms=fwd, ag_wait_fwd_ms=3.0)])

    for slow, cause, detail in ((dict(probe_ms=33.1, exact=True), "doctor",
                                 "the doctor: +32.9 ms counting this step's memory op by op"),
                                (dict(extra=40.0), "compute",
                                 "compute +40.0 ms in forward/backward/optimizer (of +40.0 ms)")):
        run = Run(path="constructed")
        run.ranks[0] = RankData(rank=0, steps=[step(n, **(slow if n == 2 else {})) for n in range(1, 6)])
        out = {o.step: o for o in find_outliers(run)}
        assert list(out) == [2] and (out[2].cause, out[2].detail) == (cause, detail), out


def test_the_probes_step_end_work_counts_once_in_the_next_step():
    """The probe's work at a step's end (a full step's refresh: probe_end_us) runs after doctor.step() was called:
    it is in the next step's wall, as that step's doctor_ms, not in this step's. A step slow by its own compute,
    whose probe spent 10 ms at its end, is "compute +40.0 ms" (before, the 10 ms were taken out of its compute as
    the doctor's: "+30.0 ms"); the next step holds them as its doctor_ms."""
    from fsdp_doctor.analyze.steps import find_outliers
    from fsdp_doctor.records import MemoryStep, StepRecord
    from fsdp_doctor.store import Run
    from fsdp_doctor.store.reader import RankData

    def step(n, *, extra=0.0, end_ms=0.0, doctor=0.4):
        fwd, bwd = 32.0 + extra, 54.0
        return StepRecord(rank=0, step=n, start_ns=n, wall_ms=fwd + bwd + 11.0 + 1.5 + doctor, forward_ms=fwd,
                          backward_ms=bwd, optimizer_ms=11.0, outside_ms=1.5, doctor_ms=doctor,
                          memory=MemoryStep(probe_us=(0.2 + end_ms) * 1e3, probe_end_us=end_ms * 1e3))

    steps = [step(n) for n in range(1, 9)]
    steps[3] = step(4, extra=40.0, end_ms=10.0)  # slow compute; its probe's step-end work: 10 ms
    steps[4] = step(5, doctor=10.4)  # which the next step's wall holds, as its doctor_ms
    run = Run(path="constructed")
    run.ranks[0] = RankData(rank=0, steps=steps)
    out = {o.step: o for o in find_outliers(run)}
    assert (out[4].cause, out[4].detail) == ("compute", "compute +40.0 ms in forward/backward/optimizer (of +40.0 ms)")


def _save_run(save_steps, *, n=12, save_ms=250.0, asynchronous=False, sync_ms=None):
    """Two ranks of 100 ms steps; the steps in ``save_steps`` also saved a checkpoint (``doctor.checkpointing()``;
    with ``asynchronous``, torch.distributed.checkpoint.async_save's, from its log; ``asynchronous`` a set: those
    steps' saves) taking ``save_ms`` (``sync_ms``: a synchronous one's, where some are asynchronous), kept out of
    their time outside the model by the recorder."""
    from fsdp_doctor.records import StepRecord
    from fsdp_doctor.store import Run
    from fsdp_doctor.store.reader import RankData

    def step(rank, k):
        is_async = k in asynchronous if isinstance(asynchronous, (set, frozenset)) else asynchronous
        ck = (save_ms if is_async or sync_ms is None else sync_ms) if k in save_steps else 0.0
        return StepRecord(rank=rank, step=k, start_ns=k, wall_ms=100.0 + ck + 0.1 * (k % 3), forward_ms=30.0,
                          backward_ms=50.0, optimizer_ms=15.0, outside_ms=5.0, between_ms=4.0, checkpoint_ms=ck,
                          checkpoints=1 if ck else 0, async_saves=1 if ck and is_async else 0)

    run = Run(path="constructed")
    for r in (0, 1):
        run.ranks[r] = RankData(rank=r, steps=[step(r, k) for k in range(n)])
    return run


def test_checkpoint_steps_are_left_out_and_named():
    """Checkpoint saves (torchtitan's Trainer's under python -m fsdp_doctor.titan) are neither time outside the
    model nor a wait for data: those steps leave the statistics, the line under the step table gives their count,
    time and share of the run (3 x 250 ms of 1,951.2 ms recorded: 38.4%), and with too few steps without a save a
    long save is the outlier's cause."""
    import fsdp_doctor
    from fsdp_doctor.analyze.steps import analyze_steps
    from fsdp_doctor.present.fmt import apart_texts

    sec = analyze_steps(_save_run({3, 6, 9}))
    for r in ("0", "1"):
        st, ck = sec.per_rank[r], sec.checkpoints[r]
        assert st.count == 8 and st.p90_ms < 101, st  # step 0 and the three save steps out
        assert (ck.steps, ck.saves, ck.ms_p50, ck.ms_total, ck.excluded) == ([3, 6, 9], 3, 250.0, 750.0, True), ck
    assert sec.outliers == []
    assert apart_texts(sec) == [("checkpoint", "Checkpoint saves: 3 in steps (3, 6, 9), 250.0 ms each, 38.4% of "
                                               "the recorded time; counted apart from outside; those steps are left "
                                               "out of the step statistics above")]
    rep = fsdp_doctor.build_report(_save_run({3, 6, 9}))
    assert not [f for f in rep.findings if f.code == "jitter.data_wait"]
    # checkpoint.blocking: 38.4% of the recorded time (a warning from 15%), 750 ms over 12 steps at most to gain
    f = next(f for f in rep.findings if f.code == "checkpoint.blocking")
    assert (f.severity, f.evidence["share_pct"], f.evidence["steps_between_saves"],
            f.evidence["gain_ms_per_step_at_most"]) == ("warning", 38.4, 3, 62.5), f.evidence
    assert not f.recommendation.code and "async_save" in f.recommendation.text
    # ranks whose saves differ: the line gives the time and share of the rank the finding quotes, and names it (it
    # gave the ranks' median time beside the largest share: 93.2 ms there, 97.5 ms in the finding, on torchtitan)
    from fsdp_doctor.present.fmt import checkpoint_text

    run = _save_run({3, 6, 9})
    for s in run.ranks[1].steps:
        if s.checkpoint_ms:
            s.checkpoint_ms += 30.0
            s.wall_ms += 30.0
    rep = fsdp_doctor.build_report(run)
    f = next(f for f in rep.findings if f.code == "checkpoint.blocking")
    assert f.recommendation.text.startswith("Each of the 3 saves stops training for 280.0 ms, one every 3 steps: "
                                            "840.0 ms over the 12 steps counted, 70.0 ms per step (rank 1)."), \
        f.recommendation.text
    assert checkpoint_text(rep.steps).startswith(
        f"Checkpoint saves: 3 in steps (3, 6, 9), 280.0 ms each, {f.evidence['share_pct']}% of the recorded time "
        "(rank 1); "), checkpoint_text(rep.steps)
    quiet = fsdp_doctor.build_report(_save_run({6}, save_ms=30.0))  # 30 ms of 1,231.2 ms: 2.4%
    assert next(s.reason for s in quiet.rules if s.code == "checkpoint.blocking") == (
        "checkpoint saves take 2.4% of the recorded time (rank 0; fires from 5%)")
    # saves in most steps: kept, and one that ran long is its step's cause
    run = _save_run(set(range(1, 12)) - {5}, save_ms=20.0)
    for rd in run.ranks.values():
        rd.steps[9].checkpoint_ms += 200.0
        rd.steps[9].wall_ms += 200.0
    sec = analyze_steps(run)
    assert sec.checkpoints["0"].excluded is False
    # kept, they count without their saves (a 10-step resumed run's p50 held its saves, compared with a run whose
    # statistics left them out: a new-user trial), and the line says so
    assert sec.per_rank["0"].p50_ms < 101 and sec.per_rank["0"].max_ms < 101, sec.per_rank["0"]
    assert apart_texts(sec)[0][1].endswith("kept in the step statistics above (too few steps without), their saves' "
                                           "time taken out"), apart_texts(sec)
    causes = {(o.rank, o.step): o for o in sec.outliers}
    assert set(causes) == {(0, 9), (1, 9)} and causes[(0, 9)].cause == "checkpoint", causes
    assert causes[(0, 9)].detail == "checkpoint save +200.0 ms"


def test_asynchronous_saves_fix_is_how_often_they_save():
    """Saves by torch.distributed.checkpoint.async_save already (the recorder counts them from DCP's log) are not
    told to save asynchronously: their time is the staging the step waits for, and the lever is how often (250 ms
    stagings between 100.1 ms steps: every 60 steps for 4%, 58.3 ms per step gained). The line under the step table
    says they are asynchronous; one save reads as one."""
    import fsdp_doctor
    from fsdp_doctor.diagnose import snippets as S
    from fsdp_doctor.present.fmt import checkpoint_text

    rep = fsdp_doctor.build_report(_save_run({3, 6, 9}, asynchronous=True))
    f = next(f for f in rep.findings if f.code == "checkpoint.blocking")
    e, text = f.evidence, f.recommendation.text
    assert (e["async_saves"], e["save_steps_after"], e["share_pct_after"], e["gain_ms_per_step"]) == (3, 60, 4.0, 58.333)
    assert "gain_ms_per_step_at_most" not in e, e
    assert text.startswith("Each of the 3 saves stops training for 250.0 ms, one every 3 steps: 750.0 ms over "
                           "the 12 steps counted, 62.5 ms per step (rank 0). The saves are asynchronous already "
                           "(torch.distributed.checkpoint.async_save): the step waits while each one copies the "
                           "state to host memory. Save every 60 steps instead, and the saves take 4.0% of the time "
                           "(58.3 ms per step gained)"), text
    assert "Save asynchronously" not in text and not f.recommendation.code
    # under torchtitan's Trainer (python -m fsdp_doctor.titan, its async mode on) how often it saves is its command
    # line's --checkpoint.interval, not --checkpoint.async-mode async again
    from fsdp_doctor.records import TITAN_DRIVER, TORCHTITAN_SHARDER, RunConfig

    for titan_async in (True, False):
        run = _save_run({3, 6, 9}, asynchronous=titan_async)
        for rd in run.ranks.values():
            rd.config = RunConfig(rank=rd.rank, world_size=2, backend="gloo", device="cpu", driver=TITAN_DRIVER,
                                  sharded_by=TORCHTITAN_SHARDER, sharder_version="0.3.0")
        rec = next(f for f in fsdp_doctor.build_report(run).findings if f.code == "checkpoint.blocking").recommendation
        assert rec.where == "torchtitan" and rec.code.splitlines()[-1] == (
            "--checkpoint.interval 60" if titan_async else "--checkpoint.async-mode async"), rec
        assert S.NO_SAVE_CODE not in rec.text, rec.text
    assert checkpoint_text(rep.steps).startswith("Checkpoint saves: 3 (asynchronous: the staging the step waits "
                                                 "for) in steps (3, 6, 9), 250.0 ms each, 38.4% of"), rep.steps
    # one synchronous save of 250 ms in 12 steps: 20.8 ms per step, 17.2% of the time; said of one save
    f = next(f for f in fsdp_doctor.build_report(_save_run({6})).findings if f.code == "checkpoint.blocking")
    assert f.recommendation.text.startswith("The save stops training for 250.0 ms: 250.0 ms over the 12 steps "
                                            "counted, 20.8 ms per step (rank 0). Save asynchronously"), \
        f.recommendation.text
    # pasted on the training's default gloo group, async_save hung at the second save (a new-user trial; so did a
    # 2-rank FSDP2 check here, its future waited on): the text names a group of its own and the future's wait
    assert 'Give it a process group of its own, made once (process_group=dist.new_group(backend="gloo"))' in \
        f.recommendation.text and "call .result() before the next save" in f.recommendation.text


def test_accelerate_saves_fix_is_how_often_save_state_runs():
    """accelerate's save_state saves synchronously and has no asynchronous option: a new-user trial's accelerate
    loop was told to save asynchronously with torch.distributed.checkpoint, which means replacing save_state. The
    lever said is how often (every 60 steps for 4%; 250 ms saves between 100.1 ms steps), with the sharded state
    dict where the plugin saves whole ones."""
    import fsdp_doctor
    from fsdp_doctor.records import ACCELERATE_SHARDER, RunConfig

    run = _save_run({3, 6, 9})
    for rd in run.ranks.values():
        rd.config = RunConfig(rank=rd.rank, world_size=2, backend="gloo", device="cpu", sharded_by=ACCELERATE_SHARDER,
                              plugin_state_dict_type="FULL_STATE_DICT")
    f = next(f for f in fsdp_doctor.build_report(run).findings if f.code == "checkpoint.blocking")
    e, text = f.evidence, f.recommendation.text
    assert text.startswith("Each of the 3 saves stops training for 250.0 ms, one every 3 steps: 750.0 ms over the "
                           f"12 steps counted, 62.5 ms per step (rank 0). accelerate's save_state saves synchronously: call it every "
                           f"{e['save_steps_after']} optimizer steps instead"), text
    assert "SHARDED_STATE_DICT" in text and "Save asynchronously" not in text and not f.recommendation.code
    assert (e["save_steps_after"], e["share_pct_after"], e["gain_ms_per_step"]) == (60, 4.0, 58.333)


def test_saves_in_profiled_steps_are_left_out_of_their_time():
    """A save in a profiler window's step ran under the profiler (the doctor's own window slowed an async staging
    from 31 to 188 ms under torchtitan): the saves' time and share count the other steps, and the line says which
    step was left aside; where every save was profiled, they count as they are."""
    import fsdp_doctor
    from fsdp_doctor.analyze.steps import analyze_steps
    from fsdp_doctor.present.fmt import checkpoint_text

    run = _save_run({3, 6, 9})
    for rd in run.ranks.values():
        rd.steps[6].profiled, rd.steps[6].checkpoint_ms, rd.steps[6].wall_ms = True, 900.0, 1000.0  # 500 ms of 1,501.1
        rd.steps[7].profiled = True
    c = analyze_steps(run).checkpoints["0"]
    assert (c.saves, c.counted_saves, c.ms_total, c.counted_steps, c.profiled) == (3, 2, 500.0, 10, [6]), c
    assert abs(c.wall_ms_total - (10 * 100.0 + 500.0 + sum(0.1 * (k % 3) for k in range(12) if k not in (6, 7)))) < 1e-6
    assert "33.3% of the recorded time (step 6 profiled: aside)" in checkpoint_text(analyze_steps(run)), c
    # the plan prices a save at the counted saves' time each (250 ms: every 60 steps of 100 ms for 4%), not at the
    # counted time over all saves (167 ms: every 40 steps, 5.9% then; a torchtitan run with 2 of its 7 saves
    # profiled was told every 4 steps for 4.5% and measured 6.4%)
    f = next(f for f in fsdp_doctor.build_report(run).findings if f.code == "checkpoint.blocking")
    assert (f.evidence["save_steps_after"], f.evidence["share_pct_after_long_run"]) == (60, 4.0), f.evidence
    for rd in run.ranks.values():
        for k in (3, 9):
            rd.steps[k].profiled = True
    c = analyze_steps(run).checkpoints["0"]
    assert (c.ms_total, c.counted_steps, c.profiled) == (1400.0, 12, []), c


def test_trainer_saves_fix_is_how_often_it_saves():
    """Under a Hugging Face Trainer (DoctorCallback: it saves synchronously, with no asynchronous option) the
    saves' fix is how often it saves, set on trainer.args: 250 ms saves between 100.1 ms steps take 4% of the time
    once every 60 steps (250 x 0.96 / (0.04 x 100.1) = 59.9), 58.3 ms per step gained (62.5 - 250 / 60)."""
    import fsdp_doctor
    from fsdp_doctor.diagnose import snippets as S
    from fsdp_doctor.records import TRAINER_DRIVER, RunConfig

    run = _save_run({3, 6, 9})
    for rd in run.ranks.values():
        rd.config = RunConfig(rank=rd.rank, world_size=2, backend="gloo", device="cpu", driver=TRAINER_DRIVER)
    f = next(f for f in fsdp_doctor.build_report(run).findings if f.code == "checkpoint.blocking")
    e, rec = f.evidence, f.recommendation
    assert (e["save_steps_after"], e["share_pct_after"], e["gain_ms_per_step"]) == (60, 4.0, 58.333), e
    assert rec.where == "trainer" and rec.inputs == {"trainer": "your transformers Trainer"}, rec
    assert rec.code.splitlines() == [  # (each comment above its line: beside it the lines passed 80 columns)
        "# saves by step count (read by trainer.train())", 'trainer.args.save_strategy = "steps"',
        "# optimizer steps between saves: 250 ms each, 4.0% of the time", "trainer.args.save_steps = 60"], rec.code
    assert "async_save" not in rec.text and "no code is offered" not in rec.text, rec.text
    assert "SHARDED_STATE_DICT" not in rec.text  # (the plugin's state_dict_type not recorded)
    for rd in run.ranks.values():
        rd.config.plugin_state_dict_type = "FULL_STATE_DICT"
    f = next(f for f in fsdp_doctor.build_report(run).findings if f.code == "checkpoint.blocking")
    assert f.recommendation.text.endswith("with fsdp_config={..., 'state_dict_type': 'SHARDED_STATE_DICT'} every "
                                          "rank writes its own shards, and the checkpoints hold no model.safetensors "
                                          "(accelerate merge-weights makes one)."), f.recommendation.text
    # (a loop of the user's own around accelerator.save_state: the plugin's own argument, and still no code)
    for rd in run.ranks.values():
        rd.config.driver = None
    f = next(f for f in fsdp_doctor.build_report(run).findings if f.code == "checkpoint.blocking")
    assert ("with FullyShardedDataParallelPlugin(..., state_dict_type='SHARDED_STATE_DICT') every rank writes"
            in f.recommendation.text and f.recommendation.text.endswith(S.NO_SAVE_CODE)), f.recommendation.text
    assert not f.recommendation.code


def test_two_ranks_slow_together_do_not_each_wait_for_the_other():
    """Both ranks' step 6 ran 60 ms of their own longer (a host hiccup on both) and each waited longer in its
    all-gathers: neither is late for the other, so neither outlier names the other as the one it waited for (the
    table named each rank as waiting for the other). Where rank 1's own delay is the larger, rank 0 waits for it."""
    from fsdp_doctor.analyze.steps import find_outliers
    from fsdp_doctor.records import StepRecord, UnitStep
    from fsdp_doctor.store import Run
    from fsdp_doctor.store.reader import RankData

    def step(rank, n, *, own=0.0, wait=5.0):
        fwd = 40.0 + wait + own
        return StepRecord(rank=rank, step=n, start_ns=n, wall_ms=fwd + 40.0 + 20.0 + 5.0, forward_ms=fwd,
                          backward_ms=40.0, optimizer_ms=20.0, outside_ms=5.0,
                          units=[UnitStep(name="layers.0", fwd_ms=fwd, ag_wait_fwd_ms=wait)])

    def run_of(own0, own1):
        run = Run(path="constructed")
        for r, own in ((0, own0), (1, own1)):
            run.ranks[r] = RankData(rank=r, steps=[step(r, n, own=own if n == 6 else 0.0,
                                                        wait=105.0 if n == 6 else 5.0) for n in range(1, 10)])
        return {(o.rank, o.step): o for o in find_outliers(run)}

    out = run_of(60.0, 60.0)
    assert {out[(r, 6)].cause for r in (0, 1)} == {"allgather_wait"}, [out[(r, 6)].detail for r in (0, 1)]
    out = run_of(10.0, 60.0)
    assert out[(0, 6)].cause == "late_rank" and out[(0, 6)].detail == "waiting for rank 1 (late by 60.0 ms)"
    assert out[(1, 6)].cause == "allgather_wait", out[(1, 6)].detail


def test_saves_are_never_told_to_come_more_often():
    """A new-user trial's loop saved every 10 steps, its first save slower than the others (91 ms median, 146 ms mean):
    sized from the median, the interval for 4% of the time came out at 8 steps, "save every 8 steps" to a loop saving
    every 10. The first save's excess over the median is set-up, paid once a process (torchtitan's first async save:
    45-68 ms against 31 ms): the interval comes from the other saves, never under the run's own, and the share
    predicted for a run as long keeps the set-up (a 16-step torchtitan rerun measured 6.7% where 3.8% was predicted
    from the mean of all saves). A finding that is all set-up stays quiet, saying so."""
    import msgspec
    import pytest

    import fsdp_doctor

    def report(first_ms, save_ms, saves, n):
        run = _save_run(saves, n=n, save_ms=save_ms)
        first = min(saves)
        for rd in run.ranks.values():
            s = rd.steps[first]
            rd.steps[first] = msgspec.structs.replace(s, checkpoint_ms=first_ms, wall_ms=s.wall_ms + first_ms - save_ms)
        rep = fsdp_doctor.build_report(run)
        return next((f for f in rep.findings if f.code == "checkpoint.blocking"), None), rep

    # 600 ms then 20 ms saves every 5 steps of 100 ms: 34.8% of the recorded time, 580 ms of it the first save's set-up
    f, rep = report(600.0, 20.0, {1, 6, 11}, 12)
    assert f is None
    why = next(s.reason for s in rep.rules if s.code == "checkpoint.blocking")
    assert "580 ms of it the first save's excess" in why, why
    assert "(set-up, once a process); without it 4.8% (fires from 5%)" in why, why
    # of two saves the set-up is the first's excess over the other: their median, their mean, halved it (OLMo-core's
    # asynchronous saves on 2 gloo ranks, 1,094 ms then 100 ms, warned of 20.3% of the time, 12.9% without 497 ms of
    # set-up). 1,000 ms then 20 ms: 980 ms of set-up, the other save 3.2% of the time (read 30.6% with 490 ms)
    f, rep = report(1000.0, 20.0, {1, 6}, 12)
    why = next(s.reason for s in rep.rules if s.code == "checkpoint.blocking")
    assert f is None and "980 ms of it the first save's excess over the other (set-up" in why, (f, why)
    assert "(set-up, once a process); without it 3.2% (fires from 5%)" in why, why
    # 300 ms then 60 ms saves every 10 steps of 100 ms: the others 7% of the time
    f, _ = report(300.0, 60.0, {1, 11, 21}, 24)
    e = f.evidence
    assert e["steps_between_saves"] == 10 and e["save_ms_p50"] == 60.0 and e["first_save_setup_ms"] == 240.0
    # 60 ms every n steps of 100 ms: 4% from n = 15; over 24 steps 240 + 24 / 15 x 60 ms of saves
    assert e["save_steps_after"] == 15 and e["share_pct_after_long_run"] == pytest.approx(3.8, abs=0.1), e
    assert e["share_pct_after"] == pytest.approx(100 * 336 / (2400 + 336), abs=0.2), e
    assert "Or save every 15 steps" in f.recommendation.text
    assert "3.8% of the time (12.3% in a run as long as this one, whose first save's 240 ms of set-up stays)" in \
        f.recommendation.text, f.recommendation.text

    # a 20-step run of a new-user trial (2 saves of 284 ms, one every 10 steps, over the 14 steps counted: its
    # profiler window's steps are not) read "one every 10 steps: 40.6 ms per step over the run", a wrong division
    # to a reader, and "Or save every 24 steps ... (4.8% in a run as long as this one ...)", a run that would hold no
    # save. Constructed so: a first save of 300 ms, then 60 ms, every 10 steps of 100 ms over 14 steps
    f, _ = report(300.0, 60.0, {1, 11}, 14)
    e, text = f.evidence, f.recommendation.text
    assert (e["steps_counted"], e["steps_between_saves"]) == (14, 10) and e["save_steps_after"] > 14, e
    assert text.startswith("Each of the 2 saves stops training for 180.0 ms, one every 10 steps: 360.0 ms over the "
                           "14 steps counted, 25.7 ms per step (rank 0)."), text
    assert f"Or save every {e['save_steps_after']} steps, and the saves take {e['share_pct_after_long_run']}% of the " \
        "time." in text and "in a run as long as this one" not in text, text


def test_an_all_gather_outlier_names_the_root_by_its_label():
    """A step whose excess is the root's all-gather wait names the unit "(root)", as every table does (a new-user
    trial's outlier table read "largest in unit ''")."""
    from fsdp_doctor.analyze.steps import find_outliers
    from fsdp_doctor.records import StepRecord, UnitStep
    from fsdp_doctor.store import Run
    from fsdp_doctor.store.reader import RankData

    def step(n, wait):
        return StepRecord(rank=0, step=n, start_ns=n, wall_ms=105.0 + wait + 0.1 * (n % 3), forward_ms=40.0 + wait,
                          backward_ms=40.0, optimizer_ms=20.0, outside_ms=5.0,
                          units=[UnitStep(name="", fwd_ms=40.0 + wait, ag_wait_fwd_ms=1.0 + wait),
                                 UnitStep(name="layers.0", fwd_ms=10.0, ag_wait_fwd_ms=1.0)])

    run = Run(path="constructed")
    run.ranks[0] = RankData(rank=0, steps=[step(n, 400.0 if n == 6 else 0.0) for n in range(1, 12)])
    (o,) = [o for o in find_outliers(run) if o.step == 6]
    assert o.cause == "allgather_wait" and "(largest in unit (root): 401.0 ms)" in o.detail, o.detail


def test_work_around_a_marked_save_outside_the_mark_counts_as_the_saves():
    """A new-user trial gathered a full state dict on every rank (~400 ms) and marked only rank 0's torch.save (20 ms)
    with doctor.checkpointing(), as its docstring showed: "4 saves, 20.2 ms each, 2.1% of the recorded time", and no
    rule spoke (the save steps leave the statistics, their time outside the model with them). The save steps' time
    outside the model beyond the other steps' median, when at least the marked time, counts as the saves': the
    finding weighs it and says to put the whole save in the mark; a few ms of noise around a save do not count."""
    import msgspec
    import pytest

    import fsdp_doctor

    def report(around_ms):
        run = _save_run({3, 6, 9}, save_ms=20.0)
        for rd in run.ranks.values():
            rd.steps = [msgspec.structs.replace(s, outside_ms=s.outside_ms + around_ms, wall_ms=s.wall_ms + around_ms)
                        if s.checkpoints else s for s in rd.steps]
        return fsdp_doctor.build_report(run)

    rep = report(400.0)
    assert rep.steps.checkpoints["0"].unmarked_ms == pytest.approx(1200.0)
    f = next(f for f in rep.findings if f.code == "checkpoint.blocking")
    assert f.severity == "warning" and f.evidence["unmarked_ms_total"] == pytest.approx(1200.0)
    assert f.evidence["saves_ms_total"] == pytest.approx(1260.0) and f.evidence["share_pct"] > 45, f.evidence
    assert "Of it, 1200 ms in all ran outside the marks around the saves" in f.recommendation.text
    # counted once (analyze.steps): the report's line quotes the finding's share, and compare checks a fix against it
    from fsdp_doctor.analyze.compare import _share
    from fsdp_doctor.present.fmt import checkpoint_text
    line = checkpoint_text(rep.steps)
    assert f"{f.evidence['share_pct']:.1f}% of the recorded time" in line and "1.20 s of it outside the saves' marks" \
        in line, line
    assert _share(rep) == f.evidence["share_pct"]
    rep = report(4.0)  # noise: 12 ms around 60 ms of saves
    st = next(s for s in rep.rules if s.code == "checkpoint.blocking")
    assert st.status == "quiet" and "4.7% of the recorded time" in st.reason, st
    # one save step slowed, the others not: the host's, not the save's (the typical save step's excess counts: a
    # torchtitan run's one slow save step of two read 40 ms unmarked, its saves 9.6% of the time for 3.8%)
    run = _save_run({3, 6, 9}, save_ms=20.0)
    for rd in run.ranks.values():
        s = rd.steps[6]
        rd.steps[6] = msgspec.structs.replace(s, outside_ms=s.outside_ms + 400.0, wall_ms=s.wall_ms + 400.0)
    assert fsdp_doctor.build_report(run).steps.checkpoints["0"].unmarked_ms == 0.0


def test_a_save_on_rank_0_only_is_a_save_step_of_every_rank(tmp_path, sample_run_path):
    """Rank 0 alone saved (torch.save of a gathered state dict in doctor.checkpointing()) and the other ranks waited
    for it at their next collective: only rank 0's save steps left the statistics, rank 1 kept its waits (p50 371.7
    ms against rank 0's 228.3 ms: a new-user trial). The reader marks a step in which any rank saved on every rank
    (``StepRecord.others_saved``), and every rank's statistics leave it out."""
    import json
    import shutil

    import fsdp_doctor
    from fsdp_doctor.analyze.steps import usable_steps

    run_dir = tmp_path / "run"
    shutil.copytree(sample_run_path, run_dir, ignore=shutil.ignore_patterns("profiler", "tb", "report.json"))
    lines = []
    for ln in (run_dir / "rank0.records.jsonl").read_text().splitlines():
        d = json.loads(ln)
        if d.get("t") == "step" and d["step"] in (5, 10, 15):
            d.update(checkpoints=1, checkpoint_ms=250.0, wall_ms=d["wall_ms"] + 250.0)
        lines.append(json.dumps(d))
    (run_dir / "rank0.records.jsonl").write_text("\n".join(lines) + "\n")
    run = fsdp_doctor.load_run(run_dir)
    r1 = run.ranks[1].steps
    assert [s.step for s in r1 if s.others_saved] == [5, 10, 15]
    assert not any(s.others_saved for s in run.ranks[0].steps)
    for r in (0, 1):
        kept = {s.step for s in usable_steps(run.ranks[r].steps)}
        assert kept and not kept & {5, 10, 15}, (r, kept)
    rep = fsdp_doctor.build_report(run)
    assert rep.steps.per_rank["0"].count == rep.steps.per_rank["1"].count


def test_compare_checks_a_save_interval_fix_by_the_saves_share_not_the_step_p50():
    """``compare --applied checkpoint.blocking``: the fix's gain lies in the save steps, which the step statistics
    leave out, so the p50 cannot show it; the predictions row read "— —" and the applied fix made host noise
    "significant: faster" (a new-user trial). The check is the saves' share: the share A's saves would take with
    B's saves (one 250 ms save in 24 steps of 100.1 ms: 9.4%; the finding's 4.0% is for its advised save every 60
    steps, which B did not take, and the cell says so), held when B's fell by at least half that drop; the
    step-time change stays the host's."""
    import fsdp_doctor
    from fsdp_doctor.analyze import compare as C
    from fsdp_doctor.pipeline import compare_side
    from fsdp_doctor.present.compare import tables

    a_run, b_run = _save_run({3, 6, 9}, n=24), _save_run({11}, n=24)
    a, b = compare_side(a_run), compare_side(b_run)
    f = next(f for f in a.report.findings if f.code == "checkpoint.blocking")
    cmp = C.compare(a, b, applied=["checkpoint.blocking"])
    (chk,) = cmp.predictions
    assert (chk.share_fix, chk.share_pct_before, chk.share_every_a, chk.share_every_b, chk.share_saves_b,
            chk.share_every_advised) == ("less often", f.evidence["share_pct"], 3, 24, 1, 60), chk
    assert chk.share_pct_predicted == round(100 * 250 / (24 * 100.1 + 250), 1) == 9.4, chk
    assert chk.share_pct_measured == round(100 * 250 / b_run_total(b_run), 1) and chk.share_held is True, chk
    assert chk.step_verdict is None and not cmp.step_p50.significant, cmp.step_p50
    text = "\n".join(str(r) for t in tables(cmp) for r in t.rows)
    assert (f"1 save in 24 steps (advised: every 60):\\nshare {chk.share_pct_before:.1f}% → 9.4%\\n→ 9.4%:\\nheld"
            in text), text
    # B saving as A did: neither of the fix's alternatives, nothing checked (it read "missed")
    (chk,) = C.compare(a, compare_side(_save_run({3, 6, 9}, n=24)), applied=["checkpoint.blocking"]).predictions
    assert (chk.share_fix, chk.share_held, chk.share_pct_predicted) == ("neither", None, None), chk
    assert chk.share_why == ("B saved synchronously every 3 steps, as A: neither of the fix's alternatives "
                             "(async_save, a save less often)"), chk.share_why


def test_compare_checks_the_alternative_b_took_async_save_or_less_often():
    """checkpoint.blocking offers two fixes for synchronous saves: async_save (the step waits for the copy to host
    memory only; at most the saves' time per step to gain, no figure) or a save less often (its share_pct_after).
    A new-user trial applied async_save, and compare checked the save-less-often prediction, "held" by chance. B's
    records tell them apart (its saves' async_saves, its interval): async_save stagings of 50 ms where A's saves
    took 250 ms, as often, are async_save's check, held (B's share 5.9%, under half A's 23.8%), 31.2 - 6.2 = 25.0 ms
    per step gained of at most 31.2; stagings as long as the saves miss; async and less often, both, check nothing."""
    from fsdp_doctor.analyze import compare as C
    from fsdp_doctor.pipeline import compare_side
    from fsdp_doctor.present.compare import tables

    a = compare_side(_save_run({3, 6, 9}, n=24))
    f = next(f for f in a.report.findings if f.code == "checkpoint.blocking")
    b_run = _save_run({3, 6, 9}, n=24, save_ms=50.0, asynchronous=True)
    cmp = C.compare(a, compare_side(b_run), applied=["checkpoint.blocking"])
    (chk,) = cmp.predictions
    assert chk.share_pct_predicted is None, chk  # (it was the save-less-often prediction's 4.0%, "held")
    assert (chk.share_fix, chk.share_every_a, chk.share_every_b) == ("async_save", 3, 3), chk
    assert chk.share_pct_measured == round(100 * 150 / b_run_total(b_run), 1) == 5.9 and chk.share_held is True, chk
    assert (chk.gain_ms_per_step_at_most, chk.gain_ms_per_step_measured) == (31.25, 25.0), chk
    assert chk.gain_ms_per_step_at_most == f.evidence["gain_ms_per_step_at_most"]
    (t,) = [t for t in tables(cmp) if t.title.startswith("Predictions")]
    assert t.rows[0][1] == ("async_save: share 23.8%\n→ the copy's only (held at\nhalf of it or under)\n→ 5.9%: "
                            "held\n(25.0 ms of at most 31.2 ms per step gained)"), t.rows[0][1]
    assert "for async_save half of A's share" in t.note, t.note
    # stagings as long as the saves: the step did not wait for a copy only
    (chk,) = C.compare(a, compare_side(_save_run({3, 6, 9}, n=24, asynchronous=True)),
                       applied=["checkpoint.blocking"]).predictions
    assert (chk.share_fix, chk.share_held) == ("async_save", False), chk
    # asynchronous and less often: both alternatives at once, neither prediction is for that
    (chk,) = C.compare(a, compare_side(_save_run({5, 11, 17}, n=24, save_ms=50.0, asynchronous=True)),
                       applied=["checkpoint.blocking"]).predictions
    assert (chk.share_fix, chk.share_held, chk.share_pct_measured) == ("both", None, 5.9), chk
    assert chk.share_why.startswith("B saved asynchronously every 6 steps, A synchronously every 3 steps: how and "
                                    "how often both changed"), chk.share_why
    (t,) = [t for t in tables(C.compare(a, compare_side(_save_run(set(), n=24)), applied=["checkpoint.blocking"]))
            if t.title.startswith("Predictions")]
    assert t.rows[0][1] == ("share 23.8% → 0.0%:\nnot checked: B recorded no checkpoint save: no prediction of this "
                            "fix applies"), t.rows


def test_compare_reads_a_mostly_asynchronous_b_as_async_save():
    """torchtitan's async mode saves its last step synchronously (checkpointer/dcp.py, _save_last_step): a B that
    took async_save saves "3 of 4 asynchronously", and read "neither of the fix's alternatives", nothing checked.
    Most of B's saves asynchronous and most of A's not is async_save's check, the synchronous save's time in B's share
    (A: 3 saves of 250 ms, 23.8%; B: 50 ms stagings and a last synchronous 250 ms save, 14.3%: it read "missed" against
    half A's share, 11.9%; held against half the most async_save takes away, A's share less that synchronous save at
    A's 250 ms, 8.9%: 16.4%), the cell saying how B saved; a B mostly synchronous stays "neither"."""
    from fsdp_doctor.analyze import compare as C
    from fsdp_doctor.pipeline import compare_side
    from fsdp_doctor.present.compare import tables

    a = compare_side(_save_run({3, 6, 9}, n=24))
    b_run = _save_run({3, 6, 9, 12}, n=24, save_ms=50.0, asynchronous={3, 6, 9}, sync_ms=250.0)
    cmp = C.compare(a, compare_side(b_run), applied=["checkpoint.blocking"])
    (chk,) = cmp.predictions
    assert (chk.share_fix, chk.share_every_a, chk.share_every_b, chk.share_why) == (
        "async_save", 3, 3, "B saved 3 of 4 asynchronously"), chk
    assert chk.share_pct_measured == round(100 * 400 / b_run_total(b_run), 1) == 14.3 and chk.share_held is True, chk
    # (as B, but its last save as long a share as the async ones took away: missed)
    (chk,) = C.compare(a, compare_side(_save_run({3, 6, 9, 12}, n=24, save_ms=50.0, asynchronous={3, 6, 9},
                                                 sync_ms=600.0)), applied=["checkpoint.blocking"]).predictions
    assert (chk.share_fix, chk.share_held) == ("async_save", False), chk
    (t,) = [t for t in tables(cmp) if t.title.startswith("Predictions")]
    assert t.rows[0][1].startswith("async_save: share 23.8%\n") and t.rows[0][1].endswith(
        "per step gained)\n(B saved 3 of 4 asynchronously)"), t.rows[0][1]
    # one of four asynchronous: not async_save's alternative
    (chk,) = C.compare(a, compare_side(_save_run({3, 6, 9, 12}, n=24, asynchronous={12})),
                       applied=["checkpoint.blocking"]).predictions
    assert (chk.share_fix, chk.share_held) == ("neither", None), chk
    assert chk.share_why.startswith("B saved 1 of 4 asynchronously every 3 steps"), chk.share_why


def b_run_total(run) -> float:
    return sum(s.wall_ms for s in run.ranks[0].steps)


def test_a_long_first_step_is_not_in_the_saves_share():
    """A checkpoint loaded inside watch() before the first step (or FSDP's lazy initialization, a compilation) made
    the first step long, and the saves' share of the recorded time counted it: 13.7% (a note) of a run whose saves
    took 18.9% (a warning) of its steps (a new-user trial). A first step over twice the others' median is left out of
    that share; a first step like the others stays (3 x 250 ms of 1,951.2 ms: 38.4%)."""
    import msgspec

    from fsdp_doctor.analyze.steps import analyze_steps

    run = _save_run({3, 6, 9})
    assert analyze_steps(run).checkpoints["0"].counted_steps == 12
    for rd in run.ranks.values():
        rd.steps[0] = msgspec.structs.replace(rd.steps[0], wall_ms=2000.0, outside_ms=1905.0)
    ck = analyze_steps(run).checkpoints["0"]
    assert ck.counted_steps == 11 and round(100 * ck.ms_total / ck.wall_ms_total, 1) == 40.5, ck
