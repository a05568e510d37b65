"""jitter.level_shift: a step time that changed once mid-run and stayed (fake quantization switched on, longer
sequences, a loader past its cache, a thread or process on one rank's host), or grew steadily (work over everything
so far), which the step statistics and every finding's figures would mix unsaid; and ``analyze --steps`` that reads
one part alone. Known answers on constructed runs; four recorded 2-rank runs (tests/fixtures/level_shift, recorded by
its record.py: the change at step 20 of 40, or 3 ms more with every step); no false alarm on any other run recorded
in this repository."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

import fsdp_doctor
from fsdp_doctor.analyze.steps import level_shift, usable_steps
from fsdp_doctor.present.fmt import apart_texts
from fsdp_doctor.records import RunConfig, StepRecord, UnitStep
from fsdp_doctor.store import Run, load_run
from fsdp_doctor.store.reader import RankData

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "level_shift"
CODE = "jitter.level_shift"


def _run(n: int = 30, at: int = 15, *, outside: dict | None = None, own: dict | None = None, noise: float = 0.05,
         wall=None, seed: int = 0) -> Run:
    """Two ranks of ~100 ms steps (33 forward, 50 backward, 15 optimizer, 2 outside), ``noise`` their relative
    spread; from step ``at`` on, ``outside`` (rank -> ms) more outside the model, or ``own`` (rank -> ms) more in one
    rank's forward while the others wait that long for its all-gathers; ``wall(k)`` a step's base time instead."""
    rng = random.Random(seed)
    run = Run(path="constructed")
    for r in (0, 1):
        steps = []
        for k in range(n):
            base = (wall(k) if wall else 100.0) * (1 + noise * (2 * rng.random() - 1))
            out = (outside or {}).get(r, 0.0) if k >= at else 0.0
            mine = (own or {}).get(r, 0.0) if k >= at else 0.0
            theirs = sum(v for o, v in (own or {}).items() if o != r) if k >= at else 0.0
            f = base * 0.33 + mine + theirs
            steps.append(StepRecord(rank=r, step=k, start_ns=k, wall_ms=base + out + mine + theirs, forward_ms=f,
                                    backward_ms=base * 0.5, optimizer_ms=base * 0.15, outside_ms=base * 0.02 + out,
                                    units=[UnitStep(name="layers.0", fwd_ms=f, ag_wait_fwd_ms=theirs)]))
        run.ranks[r] = RankData(rank=r, steps=steps, config=RunConfig(rank=r, world_size=2, backend="gloo",
                                                                      device="cpu"))
    return run


def _finding(run: Run):
    rep = fsdp_doctor.build_report(run)
    found = [f for f in rep.findings if f.code == CODE]
    return (found[0] if found else None), next(s for s in rep.rules if s.code == CODE), rep


def test_every_rank_spending_more_outside_the_model_from_a_step_on():
    """+50 ms outside the model from step 15 on both ranks: 100 -> 150 ms (1.5x), a warning naming that phase and
    the loader; the statistics mix both parts, and jitter.data_wait says its time came with the change."""
    f, _, rep = _finding(_run(outside={0: 50.0, 1: 50.0}))
    assert f is not None and f.severity == "warning" and f.ranks == [0, 1], f
    e = f.evidence
    assert (e["first_step_after"], e["last_step_before"], e["steps_before"], e["steps_after"]) == (15, 14, 14, 15)
    assert 1.45 <= e["ratio"] <= 1.55 and e["rank"] is None and 48 <= e["outside_change_ms"] <= 52, e
    assert f.title.startswith("Step time rose from ") and f.title.endswith(" at step 15 and stayed"), f.title
    text = f.recommendation.text
    assert "on every rank (rank " in text and "outside the model +" in text and "data loader" in text, text
    assert "`fsdp-doctor analyze constructed --steps 15-` reads the last part alone" in text, text
    assert not f.recommendation.code
    assert rep.steps.level_shift.first_after == 15
    wait = next(x for x in rep.findings if x.code == "jitter.data_wait")
    assert "Most of this time came with the change of step time at step 15 (jitter.level_shift)" in \
        wait.recommendation.text


def test_one_rank_slower_from_a_step_on_is_that_rank_the_others_waiting():
    """Rank 1's own forward +80 ms from step 15, rank 0 waiting as long for its all-gathers: the change is rank 1's,
    its all-gather waits not named as its own; straggler.intermittent, whose late steps are the same, stays quiet."""
    f, _, rep = _finding(_run(own={1: 80.0}))
    assert f is not None and f.severity == "warning" and f.ranks == [1], f
    assert f.title.endswith("at step 15 and stayed, on rank 1"), f.title
    text = f.recommendation.text
    assert "The change is on rank 1 (its own time +" in text and "forward and backward compute +" in text, text
    assert "the other ranks wait for it in their collectives (all-gather waits: rank 0 +8" in text, text
    assert "Something on rank 1's host or in its code started then" in text
    status = next(s for s in rep.rules if s.code == "straggler.intermittent")
    assert status.status == "quiet" and "(jitter.level_shift)" in status.reason, status


def test_the_models_own_work_growing_is_a_note_and_a_fall_is_said_as_one():
    """The step's own compute x1.6 from step 15 on every rank: a note (what it trains or reads changed, said as
    such); the same run backwards reads a fall, a note."""
    f, _, _ = _finding(_run(wall=lambda k: 160.0 if k >= 15 else 100.0))
    assert f is not None and f.severity == "info" and "The model's own work grew" in f.recommendation.text, f
    f, _, _ = _finding(_run(wall=lambda k: 100.0 if k >= 15 else 160.0))
    assert f is not None and f.severity == "info" and f.title.startswith("Step time fell from "), f.title
    assert "The model's own work shrank" in f.recommendation.text


@pytest.mark.parametrize("name, wall, noise", [
    ("noise of 20% either way", None, 0.2),
    ("one long step", lambda k: 400.0 if k == 12 else 100.0, 0.05),
    ("an episode that ended (steps 10-16 slower, then back)", lambda k: 160.0 if 10 <= k <= 16 else 100.0, 0.05),
    ("a change with 3 steps after it", lambda k: 160.0 if k >= 27 else 100.0, 0.05),
    ("a change of 20%", lambda k: 120.0 if k >= 15 else 100.0, 0.02),
])
def test_no_level_shift_where_none_stayed(name, wall, noise):
    f, status, rep = _finding(_run(wall=wall, noise=noise))
    assert f is None and rep.steps.level_shift is None, name
    assert status.status == "quiet" and "no cut of the steady steps" in status.reason


def test_two_changes_the_same_way_are_dated_from_the_first():
    """100 ms, then 200 ms from step 12, then 400 ms from step 24: three levels, dated from step 12."""
    run = _run(n=36, wall=lambda k: 400.0 if k >= 24 else 200.0 if k >= 12 else 100.0, noise=0.03)
    ls = level_shift({r: usable_steps(rd.steps) for r, rd in run.ranks.items()})
    assert ls is not None and ls.first_after == 12 and [lv[0] for lv in ls.levels] == [1, 12, 24], ls
    f, _, _ = _finding(run)
    assert f.title.endswith("at step 12 and stayed, in 2 changes"), f.title
    assert "3 levels, each a step time that stayed:" in f.recommendation.text
    assert "--steps 24-` reads the last part alone" in f.recommendation.text


@pytest.mark.parametrize("seed", range(5))
def test_a_steady_drift_is_said_as_one_not_as_levels(seed):
    """The step's own work growing 4 ms every step (10% noise): a drift, said with its rate and without a date or a
    --steps flag (a loop whose work grew 2 ms a step read "4 levels, each a step time that stayed" and the flag for
    its last "part"); a change in one step under 15% noise stays a change in levels."""
    run = _run(n=40, wall=lambda k: 100.0 + 4.0 * k, noise=0.1, seed=seed)
    ls = level_shift({r: usable_steps(rd.steps) for r, rd in run.ranks.items()})
    assert ls is not None and ls.drift_line and 3.0 <= ls.drift_ms_per_step() <= 5.0, ls
    f, _, rep = _finding(run)
    assert f.severity == "info" and f.title.startswith("Step time grew steadily from "), f.title
    assert f.title.endswith(" over steps 1-39, +" + f"{ls.drift_ms_per_step():.2f} ms a step"), f.title
    assert "The model's own work grows with the run" in f.recommendation.text and "--steps" not in \
        f.recommendation.text, f.recommendation.text
    assert "changed" not in dict(apart_texts(rep.steps))["level-shift"]
    f, _, _ = _finding(_run(n=40, wall=lambda k: 260.0 - 4.0 * k, noise=0.1, seed=seed))  # (the same, falling)
    assert f.severity == "info" and f.title.startswith("Step time fell steadily from "), f.title
    assert "every step, not at one step: it fell within each stretch" in f.recommendation.text
    step = _run(n=40, wall=lambda k: 100.0 if k < 20 else 150.0, noise=0.15, seed=seed)
    ls = level_shift({r: usable_steps(rd.steps) for r, rd in step.ranks.items()})
    assert ls is not None and ls.first_after == 20 and not ls.drift_line, ls


def test_a_long_run_is_read():
    """20,000 steps (a cut tried at each): found where it is."""
    run = _run(n=20000, at=12000, wall=lambda k: 130.0 if k >= 12000 else 100.0, noise=0.05)
    ls = level_shift({r: usable_steps(rd.steps) for r, rd in run.ranks.items()})
    assert ls is not None and ls.first_after == 12000 and ls.separation == 1.0, ls


# ------------------------------------------------------------------------------------------- recorded runs


def _analyze(path: Path, *args) -> tuple[subprocess.CompletedProcess, dict | None]:
    r = subprocess.run([sys.executable, "-m", "fsdp_doctor.cli", "analyze", str(path), "--json", "-", *args],
                       capture_output=True, text=True, timeout=180, cwd=REPO)
    return r, (json.loads(r.stdout) if r.returncode in (0, 3) else None)


def _rep(path: Path):
    return fsdp_doctor.build_report(load_run(path))


def test_recorded_slower_loader_from_step_20():
    rep = _rep(FIXTURES / "outside")
    f = next(f for f in rep.findings if f.code == CODE)
    assert f.severity == "warning" and f.ranks == [0, 1] and f.evidence["first_step_after"] == 20, f
    assert 28 <= f.evidence["outside_change_ms"] <= 40 and 1.5 <= f.evidence["ratio"] <= 2.2, f.evidence
    assert "data loader" in f.recommendation.text


def test_recorded_longer_sequences_from_step_20():
    """Step 20 was counted op by op (left out of the statistics): dated between 19 and 21."""
    rep = _rep(FIXTURES / "seq")
    f = next(f for f in rep.findings if f.code == CODE)
    assert f.severity == "info" and f.ranks == [0, 1], f
    assert (f.evidence["last_step_before"], f.evidence["first_step_after"]) == (19, 21)
    assert "between steps 19 and 21" in f.title and "The model's own work grew" in f.recommendation.text
    assert f.evidence["compute_change_ms"] > 0.5 * (f.evidence["step_ms_after"] - f.evidence["step_ms_before"])


def test_recorded_thread_on_one_rank_from_step_20():
    """Rank 1's thread spinning in Python from step 20 (the GIL): its steps ~250 ms, then ~3 s from step 26; the change
    is rank 1's, dated from step 20; the intermittent straggler rule, which read "late in 20 of 37 steps" with advice for
    work done now and then, stays quiet."""
    rep = _rep(FIXTURES / "busy")
    f = next(f for f in rep.findings if f.code == CODE)
    assert f.severity == "warning" and f.ranks == [1] and f.evidence["first_step_after"] == 20, f
    assert f.evidence["level_first_steps"][:2] == [3, 20] and len(f.evidence["level_first_steps"]) >= 3, f.evidence
    assert not any(x.code == "straggler.intermittent" for x in rep.findings)


def _recorded_runs() -> list[Path]:
    dirs = {p.parent for base in (REPO / "traces", REPO / "tests" / "fixtures") for p in base.rglob("manifest.json")}
    return sorted(d for d in dirs if FIXTURES not in d.parents)


def test_no_level_shift_in_any_other_recorded_run():
    """Every other run recorded in this repository (CPU and H100, tuned and planted, the samples): none."""
    runs = _recorded_runs()
    assert len(runs) >= 30, runs
    hit = []
    for d in runs:
        run = load_run(d)
        if run.ranks and (ls := level_shift({r: usable_steps(rd.steps) for r, rd in run.ranks.items()})):
            hit.append((d.relative_to(REPO), ls.first_after, ls.ms_before, ls.ms_after))
    assert not hit, hit


# ----------------------------------------------------------------------------------------- analyze --steps


def test_analyze_steps_reads_the_later_part_alone():
    r, rep = _analyze(FIXTURES / "outside", "--steps", "20-")
    assert r.returncode == 0, r.stderr
    assert rep["run"]["steps_window"] == [20, None]
    assert rep["run"]["notes"][0] == "steps 20 to the end only (--steps): 20 of the 40 steps a rank recorded"
    assert rep["steps"]["job"]["count"] == 40 and rep["steps"].get("level_shift") is None  # 20 a rank
    assert not any(f["code"] == CODE for f in rep["findings"])
    r, rep = _analyze(FIXTURES / "outside", "--steps", "3-19")
    assert r.returncode == 0 and rep["run"]["steps_window"] == [3, 19]
    assert rep["steps"]["per_rank"]["0"]["count"] == 17 and rep["steps"]["job"]["p50_ms"] < 60


def test_analyze_steps_leaves_out_the_traces_of_windows_outside():
    """The sample run's profiler window is steps 6-7: --steps 10- reads no trace, --steps 5-12 reads it."""
    r, rep = _analyze(REPO / "traces" / "sample", "--steps", "10-")
    assert r.returncode == 0, r.stderr
    assert rep["run"]["trace_files"] == 0 and rep.get("overlap") is None
    assert rep["run"]["notes"][0].endswith("; 0 of 1 profiler window(s) inside, the others' traces left out")
    r, rep = _analyze(REPO / "traces" / "sample", "--steps", "5-12")
    assert r.returncode == 0 and rep["run"]["trace_files"] == 2 and rep["overlap"] is not None


@pytest.mark.parametrize("arg, says", [
    ("x", "--steps x: give FIRST-LAST, FIRST- (to the end) or -LAST"),
    ("12-3", "--steps 12-3: give FIRST-LAST"),
    ("50-", "--steps 50-: no recorded step there; "),
])
def test_analyze_steps_refuses_in_one_line(arg, says):
    r = subprocess.run([sys.executable, "-m", "fsdp_doctor.cli", "analyze", str(FIXTURES / "outside"),
                        f"--steps={arg}"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2 and r.stdout == "", r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], r.stderr
    if arg == "50-":
        assert lines[0].endswith("ranks recorded steps 0-39")


def test_analyze_steps_on_plain_traces_is_refused(tmp_path):
    trace = next((REPO / "traces" / "sample" / "profiler").glob("*.json*"))
    (tmp_path / trace.name).write_bytes(trace.read_bytes())
    r = subprocess.run([sys.executable, "-m", "fsdp_doctor.cli", "analyze", str(tmp_path), "--steps", "3-"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2 and "holds no fsdp-doctor records, only profiler traces" in r.stderr, r


# ------------------------------------------------------------------------------------------------ presenters


def test_recorded_loop_whose_work_grows_every_step():
    """A loop doing 3 ms more before each forward with every step (work over everything so far), 2 ranks: a drift of
    the time outside the model, a warning; jitter.data_wait says its time grew with the run, and
    jitter.recurring_outside, which read the latest steps as "every rank stops N ms outside the model in 7 of 33
    steps", stays quiet; the step table's line, the figure's dotted line and the compare note say it grew."""
    from fsdp_doctor.pipeline import steps_columns
    from fsdp_doctor.present import figures as F

    run = load_run(FIXTURES / "drift")
    rep = fsdp_doctor.build_report(run)
    f = next(f for f in rep.findings if f.code == CODE)
    assert f.severity == "warning" and f.ranks == [0, 1] and f.evidence["rank"] is None, f
    assert 2.5 <= f.evidence["drift_ms_per_step"] <= 4.5 and f.evidence["outside_change_ms"] > 60, f.evidence
    assert "The time outside the model grows with the run" in f.recommendation.text
    wait = next(x for x in rep.findings if x.code == "jitter.data_wait")
    assert "This time grew with the run, as the step time did (jitter.level_shift)" in wait.recommendation.text
    quiet = next(s for s in rep.rules if s.code == "jitter.recurring_outside")
    assert quiet.status == "quiet" and "the latest of a step time that grew steadily" in quiet.reason, quiet
    assert dict(apart_texts(rep.steps))["level-shift"].startswith("The step time grew steadily, +3.")
    fig = F.step_time_figure(steps_columns(run), shift=rep.steps.level_shift)
    (line,) = fig.layout.shapes
    assert line.line.dash == "dot" and (line.x0, line.x1) == (3, 39) and line.y1 > 2 * line.y0, line
    assert [a.text for a in fig.layout.annotations] == [f"grew {f.evidence['drift_ms_per_step']:.2f} ms a step"]
    r = subprocess.run([sys.executable, "-m", "fsdp_doctor.cli", "compare", str(FIXTURES / "drift"),
                        str(FIXTURES / "outside"), "--json", "-"], capture_output=True, text=True, timeout=180, cwd=REPO)
    assert r.returncode == 0, r.stderr
    notes = [n for n in json.loads(r.stdout)["notes"] if "jitter.level_shift" in n]
    assert notes[0] == (f"A's step time grew steadily (+{f.evidence['drift_ms_per_step']:.2f} ms a step: "
                        "jitter.level_shift): its times mix its early and late steps"), notes


def test_the_step_table_and_the_dashboards_figure_say_it():
    from fsdp_doctor.pipeline import steps_columns
    from fsdp_doctor.present import figures as F

    run = load_run(FIXTURES / "outside")
    rep = fsdp_doctor.build_report(run)
    lines = dict(apart_texts(rep.steps))
    assert lines["level-shift"].startswith("The step time changed at step 20 and stayed: "), lines
    fig = F.step_time_figure(steps_columns(run), shift=rep.steps.level_shift)
    assert any(s.type == "line" and s.x0 == 19.5 == s.x1 for s in fig.layout.shapes), fig.layout.shapes
    assert [a.text for a in fig.layout.annotations] == ["changed at step 20"]
    # a window of steps before the change: no line drawn past its steps (plotly's axis would stretch to it)
    fig = F.step_time_figure(steps_columns(run), window=(3, 15), shift=rep.steps.level_shift)
    assert not fig.layout.shapes and not fig.layout.annotations
    # the dashboard's Steps page: the figure and the line under it
    from fsdp_doctor.dashboards.pages import PAGES
    from fsdp_doctor.dashboards.pages.common import Filters
    from fsdp_doctor.dashboards.state import RunState
    from test_dashboard_figures import _walk

    st = RunState(FIXTURES / "outside", background_traces=False)
    st.refresh()
    page = PAGES["steps"][1].layout(st.snapshot(), Filters())
    notes = [c for c in _walk(page) if getattr(c, "id", None) == "level-shift-note"]
    assert len(notes) == 1 and "The step time changed at step 20 and stayed" in str(notes[0].children)


def test_compare_says_a_side_mixes_two_parts():
    r = subprocess.run([sys.executable, "-m", "fsdp_doctor.cli", "compare", str(FIXTURES / "seq"),
                        str(FIXTURES / "outside"), "--json", "-"], capture_output=True, text=True, timeout=180, cwd=REPO)
    assert r.returncode == 0, r.stderr
    notes = json.loads(r.stdout)["notes"]
    said = [n for n in notes if "step time changed" in n]
    assert said == ["A's step time changed between steps 19 and 21 and stayed (48.4 ms before, 91.2 ms after: "
                    "jitter.level_shift): its times mix the parts; --steps-a 21- compares its last part alone",
                    "B's step time changed at step 20 and stayed (44.6 ms before, 78.6 ms after: jitter.level_shift): "
                    "its times mix the parts; --steps-b 20- compares its last part alone"], notes
    # each side's last part alone: no such note, each side's window said, B's p50 its last part's
    r = subprocess.run([sys.executable, "-m", "fsdp_doctor.cli", "compare", str(FIXTURES / "seq"),
                        str(FIXTURES / "outside"), "--steps-a", "21-", "--steps-b=20-", "--json", "-"],
                       capture_output=True, text=True, timeout=180, cwd=REPO)
    assert r.returncode == 0, r.stderr
    cmp = json.loads(r.stdout)
    assert cmp["notes"][:2] == ["A: steps 21 to the end only (--steps-a): 19 of the 40 steps a rank recorded",
                                "B: steps 20 to the end only (--steps-b): 20 of the 40 steps a rank recorded"], cmp
    assert not any("step time changed" in n for n in cmp["notes"])
    assert cmp["step_p50"]["steps_b"] == 20 and 70 < cmp["step_p50"]["b"] < 90, cmp["step_p50"]
    r = subprocess.run([sys.executable, "-m", "fsdp_doctor.cli", "compare", str(FIXTURES / "seq"),
                        str(FIXTURES / "outside"), "--steps-b", "99-"], capture_output=True, text=True, timeout=180,
                       cwd=REPO)
    assert r.returncode == 2 and r.stderr.strip().endswith("--steps-b 99-: no recorded step there; " + str(
        FIXTURES / "outside") + "'s ranks recorded steps 0-39"), r.stderr
