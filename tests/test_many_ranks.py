"""A larger job's per-rank tables in the terminal: a 16-rank run's step, throughput and communication tables and its
peak lines listed every rank, and the memory table dropped all but the first 4 ranks at 100 columns (at a 512-rank
job's scale, pages of rows). Each shows ``fmt.RANKS_SHOWN`` ranks, where a problem shows (the slowest steps, the
highest peaks, the most exposed communication) and the other end, and one line says what the rest span; the JSON
keeps every rank."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from rich.console import Console

from fsdp_doctor.present.fmt import RANKS_SHOWN, fmt_ms, ranks_left_out_line, ranks_shown
from fsdp_doctor.present.terminal import render_report

SAMPLE = Path(__file__).resolve().parent.parent / "traces" / "sample" / "report.json"


def test_ranks_shown_known_answers():
    keys = {str(r): 10.0 + r for r in range(12)} | {"3": 40.0}
    shown, left = ranks_shown(keys)
    # the 7 highest (3, then 11 down to 6) and the lowest (0), each list in rank order
    assert shown == ["0", "3", "6", "7", "8", "9", "10", "11"] and left == ["1", "2", "4", "5"]
    assert ranks_left_out_line(left, keys, "step p50", fmt_ms) == (
        "4 more ranks not shown, step p50 11.0 ms to 15.0 ms (shown: the highest step p50 and the lowest; the JSON "
        "report has every rank)")
    # a rank without a figure (no steady step) stands out: shown before the highest
    assert ranks_shown(keys | {"5": None})[0] == ["0", "3", "5", "7", "8", "9", "10", "11"]
    # a rank pinned (a straggler, whose step the others' equal): shown first of all
    assert ranks_shown(keys | {"5": None}, pin=[2]) == (["0", "2", "3", "5", "8", "9", "10", "11"],
                                                        ["1", "4", "6", "7"])
    assert ranks_shown(keys, most=1) == (["3"], [r for r in map(str, range(12)) if r != "3"])
    few = {"0": 1.0, "1": None}
    assert ranks_shown(few) == (["0", "1"], []) and ranks_left_out_line([], few, "peak", str) == ""
    # equal figures: the left-out line names the one value
    assert ranks_left_out_line(["4", "5"], {"4": 2.0, "5": 2.0}, "peak", fmt_ms) == (
        "2 more ranks not shown, peak 2.00 ms (shown: the highest peak and the lowest; the JSON report has every "
        "rank)")
    assert ranks_left_out_line(["4"], {"4": 2.0}, "step p50", fmt_ms, "and any straggler").endswith(
        "(shown: the highest step p50 and the lowest, and any straggler; the JSON report has every rank)")


def _sixteen_ranks() -> dict:
    """The sample run's report with its rank 0 copied to 16 ranks, rank 13's step the slowest and its peak the
    highest, rank 2's communication the most exposed."""
    rep = json.loads(SAMPLE.read_text())
    for sec, name in (("verdict", "step_ms"), ("steps", "p50_ms"), ("throughput", "step_p50_ms"),
                      ("memory", "peak_bytes"), ("overlap", "exposed_us")):
        base = rep[sec]["per_rank"]["0"]
        rep[sec]["per_rank"] = {}
        for r in range(16):
            row = copy.deepcopy(base)
            v = base[name] * (1 + r / 100) * (2 if (r == 13 and sec != "overlap") or
                                               (r == 2 and sec == "overlap") else 1)
            row[name] = int(v) if isinstance(base[name], int) else v
            rep[sec]["per_rank"][str(r)] = row
    rep["overlap"]["per_rank"]["2"]["exposed_ms_per_step"] = 10 * rep["overlap"]["per_rank"]["2"].get(
        "exposed_ms_per_step", 1.0)
    return rep


def test_a_sixteen_rank_report_shows_eight_ranks_per_table():
    console = Console(width=100, record=True, color_system=None)
    render_report(_sixteen_ranks(), console)
    text = console.export_text()
    # the step table: 8 ranks and the job, rank 13 (the slowest) among them, rank 1 (among the fastest) not
    steps = text[text.index("Step time per rank"):text.index("Throughput")]
    ranks = [ln.split()[0] for ln in steps.splitlines()
             if ln.strip() and ln.split()[0].isdigit() and "ranks" not in ln]
    assert len(ranks) == RANKS_SHOWN and "13" in ranks and "1" not in ranks and "0" in ranks, steps
    assert "8 more ranks not shown, step p50 " in steps, steps
    # the memory table's columns and peak lines: rank 13's highest peak shown
    memory = text[text.index("Memory at the peak"):text.index("Per unit")]
    assert "rank 13" in memory and "8 more ranks not shown, peak " in memory, memory
    assert sum(ln.startswith("rank ") and ": peak " in ln for ln in memory.splitlines()) == RANKS_SHOWN, memory
    assert "rank 4: peak" not in memory, memory
    # the communication table: rank 2, the most exposed
    comm = text[text.index("Communication per complete profiled step"):]
    rows = [ln.split()[0] for ln in comm.splitlines()[:30]
            if ln.strip() and ln.split()[0].isdigit() and "ranks" not in ln]
    assert "2" in rows[:RANKS_SHOWN] and "8 more ranks not shown, exposed " in comm, comm
    # no line past the terminal's width
    assert max(map(len, text.splitlines())) <= 100


def test_the_figures_of_sixteen_ranks_draw_eight():
    """The HTML report's and the dashboard's per-rank figures: the step summary grew 46 px a rank (a 512-rank job's,
    23,652 px), the memory peaks one bar a rank; each draws the ranks the terminal's table shows, and says so."""
    from fsdp_doctor.present import figures as F
    from fsdp_doctor.report_sections import Report

    rep = Report.of(_sixteen_ranks())
    steps = F.step_summary_figure(rep.steps)
    assert len(steps.data[0].y) == RANKS_SHOWN and "rank 13 · p50 310.5 ms" in steps.data[0].y, steps.data[0].y
    assert steps.layout.title.text.endswith(", 8 of 16 ranks (the slowest and the fastest)")
    peaks = F.memory_peaks_figure(rep.memory)
    assert len(peaks.data[0].x) == RANKS_SHOWN and any(x.startswith("rank 13<br>") for x in peaks.data[0].x)
    assert peaks.layout.title.text.startswith("Memory at the peak, by category, 8 of 16 ranks (the highest peaks and "
                                              "the lowest)")


def test_a_straggler_is_shown_whatever_its_step():
    """In a synchronous job every rank's step is as long as the straggler's (the others wait for it): a 16-rank gloo
    run's rank 11, late by 300 ms a step, had the 6th-highest step p50 of the 16 (a table keyed by the step alone can
    leave it out). The stragglers are pinned in the step, throughput and verdict tables and the figures."""
    from fsdp_doctor.present import figures as F
    from fsdp_doctor.report_sections import Report

    rep = _sixteen_ranks()
    rep["steps"]["stragglers"] = [{"rank": 1, "phase": "outside", "steps_slower": 5, "steps": 5, "own_ms_p50": 907.9,
                                   "others_own_ms_p50": 598.9, "excess_ms_per_step": 309.1,
                                   "phase_excess_ms_per_step": 302.0}]
    rep["verdict"]["job"]["read_on"] = 1
    console = Console(width=100, record=True, color_system=None)
    render_report(rep, console)
    text = console.export_text()
    for start, end in (("Verdict: % of the step", "Exposed communication"), ("Step time per rank", "Throughput"),
                       ("Throughput", "FSDP units")):
        part = text[text.index(start):text.index(end, text.index(start))]
        ranks = [ln.split()[0] for ln in part.splitlines() if ln.strip() and ln.split()[0].isdigit()
                 and "ranks" not in ln]
        assert "1" in ranks and "13" in ranks and len(ranks) == RANKS_SHOWN, (start, part)
    r = Report.of(rep)
    assert "rank 1 · p50 138.8 ms" in F.step_summary_figure(r.steps).data[0].y
    assert any(y.startswith("rank 1 ·") for y in F.verdict_figure(r.verdict).data[0].y)


def test_problems_that_differ_only_in_their_rank_are_one_line():
    """A 16-rank run traced on rank 0 only listed 15 "skipped: profiler/rankN.6.pt.trace.json.gz: ... missing"
    lines (a 512-rank job's: 511). Lines naming one rank each, alike but for it, fold from three on; the rest stay."""
    from fsdp_doctor.present.fmt import folded_problems

    missing = [f"profiler/rank{r}.6.pt.trace.json.gz: the profiler window of rank {r}, steps 6–7, is listed in its "
               "records but the file is missing; not analysed" for r in (1, 2, 3, 5, 6, 9)]
    other = "rank 4 stopped first, after step 69"
    both = "rank0.records.jsonl: rank 0 and rank 1 disagree"
    assert folded_problems([missing[0], other, *missing[1:], both]) == [
        missing[0] + " (the same for ranks 2–3, 5–6, 9)", other, both]
    assert folded_problems(missing[:2]) == missing[:2]  # (two stay two)
    assert folded_problems([both] * 3) == [both] * 3  # (naming two ranks: never folded)


def test_the_dashboards_step_figures_of_sixteen_ranks_draw_eight_unless_filtered():
    """The Steps and Memory pages' per-rank lines: every rank of a job drawn (a 512-rank job: 512 lines) where the
    rank filter is empty; the ranks fmt.ranks_shown picks by their median step (or peak) instead, the title saying
    so, every rank the filter names; the rank × step heatmap keeps every row."""
    from fsdp_doctor.pipeline import steps_columns
    from fsdp_doctor.store import load_run
    from fsdp_doctor.present import figures as F

    base = steps_columns(load_run(SAMPLE.parent))[0]
    steps = {}
    for r in range(16):  # rank 6's steps the slowest and its peaks the highest, rank 2's the fastest and lowest
        cols = copy.deepcopy(base)
        f = 3.0 if r == 6 else 0.5 if r == 2 else 1 + r / 100
        cols["wall_ms"] = [v * f for v in cols["wall_ms"]]
        cols["peak_bytes"] = [None if v is None else int(v * f) for v in cols["peak_bytes"]]
        steps[r] = cols
    fig = F.step_time_figure(steps)
    names = [t.name for t in fig.data]
    assert len(names) == RANKS_SHOWN and "rank 6" in names and "rank 2" in names and "rank 1" not in names, names
    assert ", 8 of 16 ranks (the slowest and the fastest); the rank filter draws others" in fig.layout.title.text
    assert [t.name for t in F.step_time_figure(steps, ranks=[1, 3]).data] == ["rank 1", "rank 3"]
    assert "of 16 ranks" not in F.step_time_figure(steps, ranks=[1, 3]).layout.title.text
    mem = F.memory_per_step_figure(steps)
    assert {t.name.split(" peak")[0] for t in mem.data if t.name.endswith("peak")} >= {"rank 6", "rank 2"}
    assert len({t.name.split(" ")[1] for t in mem.data}) == RANKS_SHOWN
    assert len(F.jitter_histogram(steps).data) == RANKS_SHOWN
    assert len(F.step_heatmap(steps).data[0].y) == 16


def _straggler_findings(stragglers: dict[int, float], hosts: dict[int, str]):
    """straggler.rank's findings on the 16-rank report with these stragglers ({rank: ms late a step, outside the
    model}) on these hosts (each rank's header)."""
    from types import SimpleNamespace

    from fsdp_doctor.diagnose import RULES, Context
    from fsdp_doctor.report_sections import Report
    from fsdp_doctor.store import load_run

    rep = _sixteen_ranks()
    rep["steps"]["stragglers"] = [{"rank": r, "phase": "outside", "steps_slower": 10, "steps": 10,
                                   "own_ms_p50": 600.0 + ms, "others_own_ms_p50": 600.0, "excess_ms_per_step": ms,
                                   "phase_excess_ms_per_step": ms} for r, ms in stragglers.items()]
    config = load_run(SAMPLE.parent).config
    run = SimpleNamespace(config=config, path="constructed",
                          ranks={r: SimpleNamespace(header=SimpleNamespace(host=hosts[r])) for r in range(16)})
    rule = next(c for c in RULES if c.code == "straggler.rank")()
    rule.config = config
    return rule.match(Context(run=run, report=Report.of(rep)))


def test_a_slow_hosts_stragglers_are_one_finding():
    """A 16-rank run whose 4 ranks of one host (node-3) loaded their batches 150 ms late read four warnings, one
    per rank. The stragglers on one host are one finding, the whole host named where they are all its ranks; a run on
    one host (or without host names) has its stragglers in one finding; one straggler is as before."""
    nodes = {r: f"node-{r // 4}" for r in range(16)}
    (f,) = _straggler_findings({12: 138.3, 13: 140.2, 14: 140.6, 15: 146.6}, nodes)
    assert f.title == ("Ranks 12–15 are stragglers (all 4 ranks of host node-3): +138.3-146.6 ms per step outside "
                       "the model (data loading or user code)"), f.title
    assert f.evidence["host"] == "node-3" and f.evidence["host_ranks"] == [12, 13, 14, 15]
    # (the step gains the latest one's lateness)
    assert f.predicted["step_ms_before"] - f.predicted["step_ms_after"] == pytest.approx(146.6, abs=1e-3)
    assert "look at that host first" in f.recommendation.text
    # two of node-3's ranks and one of node-1's: a finding per host, not the whole host
    a, b = _straggler_findings({5: 90.0, 12: 138.3, 13: 140.2}, nodes)
    assert a.title.startswith("Rank 5 is a straggler: +90.0 ms") and b.title.startswith(
        "Ranks 12–13 are stragglers (on host node-3, of its 4 ranks): +138.3-140.2 ms"), (a.title, b.title)
    # one host for every rank: the stragglers together, no host named
    (c,) = _straggler_findings({3: 50.0, 9: 50.0}, {r: "vm" for r in range(16)})
    assert c.title == "Ranks 3, 9 are stragglers: +50.0 ms per step outside the model (data loading or user code)"


def test_a_step_one_rank_left_out_stays_in_the_others_straggler_comparison():
    """16 ranks, each leaving out one step of its own (counted op by op: its step's time is the tool's), every step
    left out by some rank: the steps usable on every rank were none, and the 4 ranks 150 ms late each step went
    unnamed. A step counts where 3/4 of the ranks can use it, each rank compared on its own usable steps."""
    from fsdp_doctor.analyze.steps import find_stragglers
    from fsdp_doctor.records import MemoryStep, StepRecord
    from fsdp_doctor.store.reader import RankData, Run

    run = Run(path="constructed")
    for r in range(16):
        late = 150.0 if r >= 12 else 0.0
        steps = [StepRecord(rank=r, step=i, start_ns=0, wall_ms=500.0 + late + (i % 3), forward_ms=200.0,
                            backward_ms=290.0, outside_ms=1.0 + late,
                            memory=MemoryStep(transients="exact" if i == 1 + r % 15 else "replayed"))
                 for i in range(17)]
        run.ranks[r] = RankData(rank=r, steps=steps)
    found = find_stragglers(run)
    assert sorted(s.rank for s in found) == [12, 13, 14, 15], found
    assert all(s.phase == "outside" and 145 < s.excess_ms_per_step < 155 for s in found), found
