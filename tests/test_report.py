"""The report document built from the recorded sample run (fast: no training)."""

from __future__ import annotations

import msgspec
import json
import re
import subprocess
import sys

from fsdp_doctor import build_report, load_run
from fsdp_doctor.analyze.steps import percentile, usable_steps
from fsdp_doctor.records import UnitStep


def test_report_shape_and_step_stats(sample_run_path):
    run = load_run(sample_run_path)
    rep = build_report(run)
    assert rep.schema == "fsdp-doctor-report/1"
    for key in ("run", "steps", "units", "memory", "overlap", "findings", "problems"):
        assert getattr(rep, key) is not None, key
    for r, rd in run.ranks.items():
        st = rep.steps.per_rank[str(r)]
        xs = [s.wall_ms for s in usable_steps(rd.steps)]
        assert st.count == len(xs) == len(rd.steps) - 1 - sum(1 for s in rd.steps[1:] if s.profiled)
        assert st.p50_ms == round(percentile(xs, 50), 3) and st.max_ms == round(max(xs), 3)
        assert st.p50_ms <= st.p90_ms <= st.p99_ms <= st.max_ms
    for f in rep.findings:
        assert f.severity in ("info", "warning", "critical")
        assert set(f.as_dict()) >= {"code", "severity", "title", "evidence", "recommendation"}
    js = json.loads(json.dumps(rep.to_builtins()))  # one JSON document
    from fsdp_doctor.report_sections import Report

    assert Report.of(js) == rep  # ... that reads back into the same typed report, every section whole


def test_gloo_collective_sizes_come_from_the_unit_snapshot(sample_run_path):
    run = load_run(sample_run_path)
    rep = build_report(run)
    units = {u.name: u for u in run.config.units}
    rows = [r for r in rep.overlap.per_unit if r.unit in units and units[r.unit].param_count]
    assert rows
    for r in rows:
        u = units[r.unit]
        expected = u.unsharded_bytes if r.collective == "all_gather" else 4 * u.param_count
        assert r.bytes_per_call == expected and r.bytes_source == "unit snapshot"
        # NCCL's bus-bandwidth convention for 2 ranks: bytes x (n-1)/n per second of collective time
        assert abs(r.busbw_gbps - expected * r.count * 0.5 / r.comm_us / 1e3) < 1e-9


def test_analyze_cli_writes_json(sample_run_path, tmp_path):
    out = tmp_path / "r.json"
    res = subprocess.run([sys.executable, "-m", "fsdp_doctor.cli", "analyze", str(sample_run_path), "--json", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    rep = json.loads(out.read_text())
    assert rep["run"]["world_size"] == 2 and set(rep["steps"]["per_rank"]) == {"0", "1"}
    assert max(len(line) for line in res.stdout.splitlines()) <= 100  # fits a terminal


def test_a_rank_where_the_doctor_stepped_aside_is_named_in_the_json_and_the_terminal(sample_run_path):
    """The store keeps the error record; the report carries it typed and the terminal says it in one line."""
    import io

    from rich.console import Console, Group

    from fsdp_doctor.present.terminal import render_report
    from fsdp_doctor.records import DoctorError
    from fsdp_doctor.report_sections import Report

    run = load_run(sample_run_path)
    run.ranks[1].errors.append(DoctorError(rank=1, where="fsdp log tap", message="KeyError: 7", step=3))
    rep = build_report(run)
    (e,) = rep.run.doctor_errors
    assert (e.rank, e.where, e.message, e.step) == (1, "fsdp log tap", "KeyError: 7", 3)
    js = rep.to_builtins()
    assert js["run"]["doctor_errors"] == [{"rank": 1, "where": "fsdp log tap", "message": "KeyError: 7", "step": 3}]
    assert Report.of(json.loads(json.dumps(js))).run.doctor_errors == [e]
    buf = io.StringIO()
    render_report(rep, Console(file=buf, width=200, color_system=None))
    assert "doctor stepped aside on rank 1 at step 3 (fsdp log tap): KeyError: 7" in buf.getvalue()


def test_a_run_too_short_to_time_says_so_instead_of_a_table_of_dashes(sample_run_path):
    """A 2-step run: step 0 is FSDP's lazy initialisation and step 1 the doctor's FLOP count, so no step is a
    steady one. The step table used to list each rank's 2 steps with dashes under a title naming the traces
    (there were none); the terminal and the HTML report now say what was left out and how long a run must be."""
    import io

    from rich.console import Console, Group

    from fsdp_doctor.present.html import render_html
    from fsdp_doctor.present.terminal import render_report

    run = load_run(sample_run_path)
    for rd in run.ranks.values():
        rd.steps = rd.steps[:2]
        rd.profiles = []
    assert [s.profiled for s in run.ranks[0].steps] == [False, True]
    rep = build_report(run)
    assert all(st.count == 0 and st.recorded == 2 for st in rep.steps.per_rank.values()), rep.steps.per_rank
    line = ("Step time: no steady step to time. Each rank recorded 2 steps, all left out of the statistics (step 0 "
            "is FSDP's lazy initialisation; the doctor's FLOP-counting and profiler steps are its own): a run of 3 "
            "steps or more gives step times and the verdict.")
    buf = io.StringIO()
    render_report(rep, Console(file=buf, width=400, color_system=None))
    text = buf.getvalue()
    assert line in text and "the traces' complete profiler steps" not in text and "Step time per rank" not in text
    html = render_html(rep)
    assert line.replace("'", "&#x27;") in html and "steps-table" not in html


def test_message_sizes_from_the_snapshot_are_fsdp2s_padded_shards():
    """Where a trace carries no message sizes (gloo), the unit snapshot gives them as FSDP2 sends them: each
    parameter's dim 0 padded to a multiple of the shard group. A new-user trial's HSDP 2 x 2 root of 22,800 fp32
    elements (91,200 B; 46,000 B a shard, padded) read 45,600 B for the replicas' all-reduce of the reduce-scatter's
    46,000 B output; its all-gather and reduce-scatter move 92,000 B."""
    from types import SimpleNamespace

    from fsdp_doctor.analyze.report import fill_sizes_from_units
    from fsdp_doctor.records import UnitConfig
    from fsdp_doctor.report_sections import CommUnitRow, OverlapSection

    unit = UnitConfig(name="", modules=[""], is_root=True, param_count=22800, n_params=2, sharded_bytes=46000,
                      unsharded_bytes=91200, orig_dtypes=["float32"], shard_size=2)
    cfg = SimpleNamespace(units=[unit], world_size=4, fsdp_dims=2, mesh={"replicate": 2, "shard": 2})
    rows = [CommUnitRow(rank=0, unit="(root)", collective=c, phase=p, count=1, comm_us=100.0)
            for c, p in (("all_gather", "forward"), ("reduce_scatter", "backward"), ("all_reduce", "backward"))]
    ov = OverlapSection(per_unit=rows)
    fill_sizes_from_units(ov, SimpleNamespace(config=cfg))
    assert {r.collective: r.bytes_per_call for r in ov.per_unit} == {
        "all_gather": 92000.0, "reduce_scatter": 92000.0, "all_reduce": 46000.0}
    assert all(r.bytes_source == "unit snapshot" for r in ov.per_unit)
    # bf16 parameters and reduction of fp32 ones (the snapshot's unsharded bytes in the param dtype): half of each
    unit.param_dtype, unit.reduce_dtype, unit.unsharded_bytes = "bfloat16", "bfloat16", 45600
    ov = OverlapSection(per_unit=[CommUnitRow(**{**msgspec.structs.asdict(r), "bytes_per_call": None}) for r in rows])
    fill_sizes_from_units(ov, SimpleNamespace(config=cfg))
    assert {r.collective: r.bytes_per_call for r in ov.per_unit} == {
        "all_gather": 46000.0, "reduce_scatter": 46000.0, "all_reduce": 23000.0}


def test_the_line_right_above_a_fix_in_the_terminal_is_its_heading_alone():
    """A fix that reads names of the user's code (an HSDP user's mesh) had them after its heading: wrapped at 100
    columns, the continuation ("fully_shard calls pass: your replicate 2 × shard 2 mesh (HSDP)") sat right above
    the code, unindented, and copied with it raised SyntaxError on every rank (a new-user trial). They come on a line
    of their own before the heading; the heading, right above the code, fits 80 columns."""
    import io

    from rich.console import Console, Group

    from fsdp_doctor.present.terminal import finding_details
    from fsdp_doctor.report_sections import Finding, Recommendation

    f = Finding(code="wrap.too_coarse", severity="warning", title="One unit holds the whole model", evidence={},
                recommendation=Recommendation(
                    text="Shard each block.", code="for block in model.layers:\n    fully_shard(block, mesh=mesh)",
                    where="unsharded",
                    inputs={"mesh": "the mesh your fully_shard calls pass: your replicate 2 × shard 2 mesh (HSDP)"}))
    for width in (80, 100, 160):
        buf = io.StringIO()
        Console(file=buf, width=width, color_system=None).print(Group(*finding_details(f)))
        lines = buf.getvalue().splitlines()
        i = next(k for k, ln in enumerate(lines) if ln.startswith("for block in model.layers"))
        assert lines[i - 1] == "Fix (Python, in place of your fully_shard calls, on the unsharded model):", lines
        assert lines[i - 2].endswith("mesh (HSDP)") or lines[i - 3].startswith("The fix uses from your code: mesh: ")
        assert any(ln.startswith("The fix uses from your code: mesh: the mesh your") for ln in lines), lines


def test_a_grouped_units_backward_own_time_leaves_out_what_runs_inside_it():
    """A tied [embedding, head] unit (``fully_shard([model.tok_emb, model.lm_head])``): FSDP brackets its backward from
    the head's to the embedding's, around the root's and every block's, so its own time held theirs (25.2 ms of an
    85.5 ms backward counted twice) and the root's own read 0.00 ms (a new-user trial). Own backward time leaves out
    the units whose backward marks lie inside the unit's, by the memory timeline's order."""
    from types import SimpleNamespace

    from fsdp_doctor.analyze.report import unit_table
    from fsdp_doctor.records import MemoryTimeline, UnitConfig, UnitStep
    from fsdp_doctor.store import Run
    from fsdp_doctor.store.reader import RankData

    names = ["", "tok_emb, lm_head", "blocks.0", "blocks.1"]
    cfg_units = [UnitConfig(name=n, modules=n.split(", ") if n else [""], is_root=not n, param_count=1, n_params=1,
                            sharded_bytes=4, unsharded_bytes=8, orig_dtypes=["float32"], parent=None if not n else "")
                 for n in names]
    order = [("tok_emb, lm_head", "backward_start"), ("", "backward_start"), ("blocks.1", "backward_start"),
             ("blocks.1", "backward_end"), ("blocks.0", "backward_start"), ("blocks.0", "backward_end"),
             ("", "backward_end"), ("tok_emb, lm_head", "backward_end")]
    tl = MemoryTimeline(columns=["t_ms", "unit", "phase"], rows=[[float(i), u, p] for i, (u, p) in enumerate(order)])
    bwd = {"": 40.0, "tok_emb, lm_head": 50.0, "blocks.0": 10.0, "blocks.1": 12.0}

    def step(k):
        return SimpleNamespace(step=k, profiled=False, no_grad_forwards=0, checkpoints=0, memory=SimpleNamespace(
            timeline=tl, transients=None), units=[UnitStep(name=n, fwd_ms=1.0, bwd_ms=bwd[n]) for n in names])

    run = Run(path="constructed")
    run.ranks[0] = RankData(rank=0, steps=[step(k) for k in range(5)])
    run.ranks[0].config = SimpleNamespace(units=cfg_units)
    rows = {r.name: r.timing_p50 for r in unit_table(run)}
    assert rows["tok_emb, lm_head"].bwd_self_ms == 10.0  # 50 - the root's 40
    assert rows[""].bwd_self_ms == 18.0  # 40 - 10 - 12
    assert rows["blocks.0"].bwd_self_ms == 10.0


def test_a_unit_that_did_not_run_in_some_steps_is_timed_over_the_steps_it_ran(sample_run_path):
    """An MoE expert masked in 2 of 4 steady steps read 0.67 ms forward, its zeros counted, against 4.44 ms where it
    ran (a new-user trial). A unit's step row with no call and no time is left out of its medians, counted apart,
    and the terminal's unit table says which units and how often they ran."""
    import statistics

    import msgspec

    from fsdp_doctor.analyze.report import unit_table
    from fsdp_doctor.analyze.steps import usable_steps
    from fsdp_doctor.present.fmt import units_not_run_note
    from fsdp_doctor.store import load_run

    run = load_run(sample_run_path)
    name = "layers.1"
    steady = {r: [s.step for s in usable_steps(rd.steps)] for r, rd in run.ranks.items()}
    off = {r: set(st[::2]) for r, st in steady.items()}  # every other steady step: not run
    for r, rd in run.ranks.items():
        rd.steps = [msgspec.structs.replace(s, units=[UnitStep(name=u.name) if u.name == name else u for u in s.units])
                    if s.step in off[r] else s for s in rd.steps]
    ran = [u.fwd_ms - sum(c.fwd_ms for c in s.units if c.name.startswith(name + ".")) for rd in run.ranks.values()
           for s in usable_steps(rd.steps) for u in s.units if u.name == name and u.fwd_ms]
    row = next(u for u in unit_table(run) if u.name == name)
    t = row.timing_p50
    assert t.not_run == sum(map(len, off.values())) and t.samples == len(ran), t
    assert t.fwd_self_ms == round(statistics.median(ran), 3) > 0, (t, ran)
    others = [u for u in unit_table(run) if u.name != name and u.timing_p50]
    assert all(u.timing_p50.not_run == 0 for u in others)
    note = units_not_run_note(unit_table(run))
    assert note.startswith("1 unit did not run in every step") and f"layers.1 ({t.samples} of " \
        f"{t.samples + t.not_run})" in note, note


def test_small_figures_and_messages_read_right(sample_run_path):
    """A tiny CPU run's TFLOP/s read "0.000"; an exception message's own full stop read ".;" before "; their
    completed steps"; a straggler's title read "per step in outside the model" (new-user trials)."""
    from fsdp_doctor.present.fmt import fmt_tflops
    from fsdp_doctor.records import End
    from fsdp_doctor.store.reader import run_end_line

    assert (fmt_tflops(0.00041), fmt_tflops(0.0192), fmt_tflops(0.5), fmt_tflops(312.4)) == \
        ("0.00041", "0.0192", "0.500", "312.400")
    why = "RuntimeError: DataLoader worker (pid 7) exited in worker process 1."
    run = load_run(sample_run_path)
    for r, rd in run.ranks.items():
        rd.end = End(rank=r, steps=30, ended_ns=1, exception=why)
    line = run_end_line(run, {})
    assert "worker process 1; the completed steps of every rank are used" in line, line


def test_a_watched_container_without_forward_is_said_in_the_header(sample_run_path):
    """A teacher and its student in a plain nn.Module, given to watch(): each model its own root, called one by one,
    their steps and units mixed in one report without a word (a new-user trial). The header says so, and what to
    watch instead."""
    from fsdp_doctor.analyze.report import run_facts

    run = load_run(sample_run_path)
    assert not any("no forward() of its own" in n for n in (run_facts(run).notes or []))
    run.config.model_has_forward = False
    assert any(n.startswith("watch() was given a module with no forward() of its own") and
               "give watch() the model you train" in n for n in run_facts(run).notes), run_facts(run).notes


def test_a_cpu_runs_memory_section_says_once_what_its_figures_cannot_see(sample_run_path):
    """On the CPU the figures are the model's, its optimizer's and the step's own allocations: an EMA copy of the
    weights cloned before the loop and updated in place (a new-user trial's, 162 KiB, +10% of the peak) left the
    report the same, with no word. The memory section says so once, under the ranks' lines; a CUDA run, whose
    temporaries are the allocator's total less the categories, does not."""
    from fsdp_doctor.analyze.memory import CPU_UNSEEN, analyze_memory
    from fsdp_doctor.present.fmt import memory_lines
    from fsdp_doctor.present.memory import render_memory
    from rich.console import Console

    run = load_run(sample_run_path)
    sec = analyze_memory(run)
    assert sec.unseen == CPU_UNSEEN and "an EMA copy of the weights" in CPU_UNSEEN
    lines = [t for t, _ in memory_lines(sec)]
    assert lines.count(CPU_UNSEEN) == 1 and lines[-1] == CPU_UNSEEN, lines
    con = Console(width=400, record=True)
    con.print(render_memory(sec, width=400))
    assert con.export_text().count(CPU_UNSEEN) == 1
    for rd in run.ranks.values():
        for s in rd.steps:
            if s.memory is not None:
                s.memory.device = "cuda:0"
    assert analyze_memory(run).unseen == ""


def test_units_inside_checkpoint_wrappers_are_named_by_their_module_path(checkpoint_wrapped_pair):
    """accelerate's FSDP2 plugin with activation checkpointing shards each layer inside its checkpoint_wrapper
    ("layers.0._checkpoint_wrapped_module") and the wrapper too (an empty unit "layers.0"): the unit tree and the
    per-unit memory table printed "0._checkpoint_wrapped_module" and "1._checkpoint_wrapped_module", the layer's
    name dropped (a new-user trial). The wrapper's segment is left out of the tables' short names, the wrapper's own
    unit named as the call that made it."""
    import io

    from rich.console import Console

    from fsdp_doctor.present.terminal import render_report

    rep = build_report(load_run(checkpoint_wrapped_pair[1]))
    buf = io.StringIO()
    render_report(rep, Console(file=buf, width=100, color_system=None))
    text = buf.getvalue()
    for title in ("FSDP units (", "Per unit (rank 0)"):  # the unit tree, the memory per unit
        table = re.split(r"\n *─+ *\n", text.split(title)[1], maxsplit=1)[1]  # its rows, under the header's rule
        names = [re.match(r"\s*(.*?)\s{2,}", ln).group(1) for ln in table.splitlines()[:7]]
        assert names == ["(root)", *(f"{w}layers.{i}{w and ')'}" for i in range(3) for w in ("checkpoint_wrapper(", ""))], \
            (title, names)
    assert max(map(len, text.split("─ Diagnosis ─")[0].splitlines())) <= 100
