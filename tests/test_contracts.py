"""The typed contracts between stages: the unit config's defaults, the memory categories, module imports."""

from __future__ import annotations

import msgspec

from fsdp_doctor import memory_categories as MC
from fsdp_doctor.records import UnitConfig, unit_defaults


def test_unit_defaults_come_from_unitconfig():
    """The rules' view of a report row fills omitted fields with UnitConfig's own defaults (one source)."""
    from fsdp_doctor.diagnose import estimate as E

    d = unit_defaults()
    names = {f.name for f in msgspec.structs.fields(UnitConfig)}
    assert set(d) == names - {"name"}
    assert d["reshard_after_forward"] is True and d["checkpoint"] == "none" and d["param_groups"] == 1
    assert d["param_count"] == 0 and d["is_root"] is False
    # a row as the report writes it (msgspec omit_defaults): only what differs from the defaults
    row = msgspec.to_builtins(UnitConfig(name="layers.0", modules=["layers.0"], is_root=False, param_count=10,
                                         n_params=2, sharded_bytes=20, unsharded_bytes=40, orig_dtypes=["float32"],
                                         checkpoint="unit"))
    assert "reshard_after_forward" not in row
    from fsdp_doctor.diagnose.base import Context
    from fsdp_doctor.store import Run

    (u,) = E.units(Context(run=Run(path="."), report={"units": [row]}))
    assert u.reshard_after_forward is True and u.checkpoint == "unit" and u.forward_prefetch == []


def test_memory_categories_once():
    """Every presenter's category order and colours are the one table's."""
    from fsdp_doctor.present import figures
    from fsdp_doctor.analyze import memory as analyze_memory
    from fsdp_doctor.present import html
    from fsdp_doctor.record import memory as record_memory

    assert record_memory.CATEGORIES == analyze_memory.CATEGORIES == MC.DEVICE
    assert figures.MEMORY_COLORS == MC.COLOURS and html.F is figures  # the HTML report draws with the figures
    assert len(set(MC.COLOURS.values())) == len(MC.ALL)  # no two categories share a colour
    assert MC.HOST == ("offloaded_host",) and "offloaded_host" not in MC.DEVICE


def test_every_module_imports_alone():
    """Each module of the recorder imports on its own in a fresh interpreter: no import loop between the
    collaborators (a loop shows only when the cycle is entered from the wrong end)."""
    import pkgutil
    import subprocess
    import sys

    import fsdp_doctor

    mods = sorted(m.name for m in pkgutil.walk_packages(fsdp_doctor.__path__, "fsdp_doctor."))
    assert "fsdp_doctor.record.memory.sizes" in mods
    # one fresh interpreter imports the third-party packages (torch: seconds) once, then forks a child per
    # module that imports only that module: each child starts with no fsdp_doctor module loaded
    code = ("import importlib, os, sys\n"
            "import numpy, msgspec, torch, torch.distributed.fsdp  # noqa: F401  (shared by the children)\n"
            "bad = []\n"
            "for m in sys.argv[1:]:\n"
            "    r, w = os.pipe()\n"
            "    pid = os.fork()\n"
            "    if pid == 0:\n"
            "        os.close(r)\n"
            "        try:\n"
            "            importlib.import_module(m)\n"
            "        except BaseException as e:\n"
            "            os.write(w, f'{type(e).__name__}: {e}'.encode()[:500])\n"
            "            os._exit(1)\n"
            "        os._exit(0)\n"
            "    os.close(w)\n"
            "    with os.fdopen(r) as f:\n"
            "        msg = f.read()\n"
            "    if os.waitpid(pid, 0)[1]: bad.append(m + ': ' + msg)\n"
            "    assert 'fsdp_doctor' not in sys.modules\n"
            "print('\\n'.join(bad)); sys.exit(1 if bad else 0)\n")
    mods = [m for m in mods if m.startswith(("fsdp_doctor.record", "fsdp_doctor.memory_"))]  # the split rooms
    r = subprocess.run([sys.executable, "-c", code, *mods], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr


def test_run_device_comes_from_the_process_group_not_a_parameter(monkeypatch):
    """With CPUOffloadPolicy the parameters live on the host while FSDP computes on the GPU: the run's device is
    the process group's (NCCL: the current CUDA device) or FSDP's compute device, never a parameter's."""
    from types import SimpleNamespace

    import torch

    from fsdp_doctor.record import run_device as RD

    asked = []

    def cuda_index():
        asked.append(1)
        return 3

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 1)
    assert RD.choose_device("nccl", None, cuda_index) == torch.device("cuda", 3)
    assert RD.choose_device("cpu:gloo,cuda:nccl", cpu, cuda_index) == torch.device("cuda", 3)
    n = len(asked)
    assert RD.choose_device("gloo", None, cuda_index) == cpu and RD.choose_device(None, None, cuda_index) == cpu
    assert RD.choose_device("gloo", gpu, cuda_index) == gpu  # FSDP's mesh says GPU: offloading does not change it
    assert len(asked) == n  # the CUDA device is asked only for a NCCL group (no CUDA init on CPU runs)

    # a CPUOffloadPolicy-like unit: its parameter on the host, FSDP's param group computing on cuda:1
    param = torch.nn.Parameter(torch.zeros(2))
    pg = SimpleNamespace(device=gpu, fsdp_params=[SimpleNamespace(sharded_param=param)])
    unit = SimpleNamespace(param_groups=[pg])
    assert param.device == cpu and RD.fsdp_compute_device([unit]) == gpu
    monkeypatch.setattr(RD.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(RD.dist, "get_backend", lambda *a, **k: "nccl")
    monkeypatch.setattr(RD.torch.cuda, "current_device", lambda: 1)
    assert RD.run_device([unit]) == gpu
    monkeypatch.setattr(RD.dist, "get_backend", lambda *a, **k: "gloo")
    assert RD.run_device([unit]) == gpu
    assert RD.run_device([SimpleNamespace(param_groups=[SimpleNamespace(device=None)])]) == cpu


def test_comm_section_is_typed_and_its_json_unchanged(sample_run_path):
    """The pipeline builds ``comm`` as a CommSummary: the keys of its JSON form are those it always had, that form
    reads back to the same struct, and a presenter shows the same headline from either."""
    from fsdp_doctor.pipeline import build_report, comm_summary
    from fsdp_doctor.present.fmt import comm_headline
    from fsdp_doctor.report_sections import CommSummary
    from fsdp_doctor.store import load_run

    rep = build_report(load_run(sample_run_path), diagnosis=False)
    typed = rep.comm
    comm = msgspec.to_builtins(typed)
    assert set(comm) == {"source", "source_text", "definition", "per_rank", "exposed_ms_per_step", "comm_ms_per_step",
                         "overlap_pct"}
    assert typed.source == "trace" and CommSummary.of(comm) == typed
    assert comm_headline(CommSummary.of(comm)) == comm_headline(typed)  # the JSON form reads back to the same text
    assert comm_headline(typed).startswith("Exposed communication: ")
    rec = comm_summary(None, {"0": 1.5, "1": 2.5})  # from the records: per rank the waits only
    assert msgspec.to_builtins(rec)["per_rank"] == {"0": {"exposed_ms_per_step": 1.5}, "1": {"exposed_ms_per_step": 2.5}}
    assert rec.exposed_ms_per_step == 2.0 and rec.comm_ms_per_step is None and rec.overlap_pct is None


def test_run_facts_typed_and_json_unchanged(sample_run_path, tmp_path):
    """``run`` is built as RunFacts: with a config record every fact is written (a None capacity included); a
    folder of plain traces has no config facts at all (not nulls); the header line reads attributes."""
    from fsdp_doctor.analyze.report import run_facts
    from fsdp_doctor.present.fmt import run_facts as header_facts
    from fsdp_doctor.report_sections import RunFacts
    from fsdp_doctor.store import load_run

    run = load_run(sample_run_path)
    facts = msgspec.to_builtins(run_facts(run))
    assert {"path", "ranks", "world_size", "run_id", "trace_files", "backend", "device", "device_name",
            "torch_version", "optimizer", "units", "model_param_count", "capacity_bytes", "tokens_per_step",
            "steps_recorded", "complete"} <= set(facts)
    assert facts["capacity_bytes"] is None and facts["device"] == "cpu" and facts["ranks"] == [0, 1]
    assert RunFacts.of(facts) == run_facts(run)  # the JSON form reads back to the same facts
    assert header_facts(run_facts(run))[:2] == ["2 ranks", f"{facts['units']} FSDP units"]
    # one rank's records missing: the header says whose it read
    one = msgspec.structs.replace(run_facts(run), ranks=[0])
    assert header_facts(one)[0] == "2 ranks (records of rank 0)"
    traces = load_run(sample_run_path / "profiler")
    bare = msgspec.to_builtins(run_facts(traces))
    # plain traces: the facts their own metadata gives (distributedInfo), none that only a config record has
    assert bare["backend"] == "gloo" and bare["facts_source"] == "trace metadata"
    assert "capacity_bytes" not in bare and "optimizer" not in bare and bare["trace_files"] >= 1
    assert header_facts(RunFacts(world_size=2, backend="gloo")) == ["2 ranks", "gloo"]  # facts without a config
    # what the run's torch lacks, beside its version (torch 2.6: a new-user trial found it in the JSON only)
    old = RunFacts(torch_version="2.6.0+cu124", torch_lacks=["FSDPModule.set_reshard_after_forward"])
    assert header_facts(old) == ["2.6.0+cu124 (lacks FSDPModule.set_reshard_after_forward)"]


def test_memory_section_schema_is_the_struct(sample_run_path):
    """The analysis builds a MemorySection whose JSON form reads back to the same struct (what ``--json`` writes
    and ``Report.of`` reads), and the terminal shows it from either."""
    from rich.console import Console

    from fsdp_doctor.analyze.memory import analyze_memory
    from fsdp_doctor.present.memory import render_memory
    from fsdp_doctor.report_sections import MemorySection
    from fsdp_doctor.store import load_run

    typed = analyze_memory(load_run(sample_run_path))
    mem = msgspec.to_builtins(typed)
    assert isinstance(typed, MemorySection) and MemorySection.of(mem) == typed
    pr = typed.per_rank[typed.peak_rank]
    assert sum(pr.peak_breakdown.values()) == pr.peak_bytes == typed.peak_bytes
    con = Console(width=100, record=True)
    con.print(render_memory(MemorySection.of(mem)))
    assert f"rank {typed.peak_rank}: peak" in con.export_text()


def test_steps_section_schema_is_the_struct(sample_run_path):
    """The analysis builds a StepsSection whose JSON form reads back to the same struct, with outliers and
    stragglers typed too (built here on a run with one slow step), and the terminal reads it by attribute."""
    from rich.console import Console

    from fsdp_doctor.analyze.steps import analyze_steps
    from fsdp_doctor.present.terminal import render_steps
    from fsdp_doctor.report_sections import StepsSection
    from fsdp_doctor.store import load_run

    run = load_run(sample_run_path)
    typed = analyze_steps(run)
    assert StepsSection.of(msgspec.to_builtins(typed)) == typed
    assert typed.job.count == sum(s.count for s in typed.per_rank.values())
    rd = run.ranks[0]
    slow = max((s for s in rd.steps if s.step > 0 and not s.profiled), key=lambda s: s.step)
    slow.wall_ms *= 20
    slow.outside_ms += slow.wall_ms * 0.95
    withoutlier = analyze_steps(run)
    assert withoutlier.outliers and StepsSection.of(msgspec.to_builtins(withoutlier)) == withoutlier
    con = Console(width=100, record=True)
    con.print(render_steps(withoutlier))
    text = con.export_text()
    assert "Outlier steps (1, worst first)" in text and "time outside the model" in text

    for st in run.ranks[1].steps:  # rank 1 slower in forward on every step: a straggler
        st.forward_ms += 60
        st.wall_ms += 60
    strag = analyze_steps(run)
    assert strag.stragglers[0].rank == 1 and StepsSection.of(msgspec.to_builtins(strag)) == strag


def test_an_outlier_step_with_twice_the_micro_batches_says_so(sample_run_path):
    """A NaN guard skipping optimizer.step() once: the doctor records the two iterations as one step of two
    micro-batches (it cannot tell them from gradient accumulation), 2x the time, kept in the statistics and named
    nothing (a new-user trial). The outlier table names it: twice the usual micro-batches, no step of the watched
    optimizer between the calls."""
    from fsdp_doctor.analyze.steps import analyze_steps, usable_steps
    from fsdp_doctor.store import load_run

    run = load_run(sample_run_path)
    s = usable_steps(run.ranks[0].steps)[3]
    s.micro_batches, s.wall_ms, s.forward_ms, s.backward_ms = 2, 2 * s.wall_ms, 2 * s.forward_ms, 2 * s.backward_ms
    (o,) = [o for o in analyze_steps(run).outliers if o.rank == 0 and o.step == s.step]
    assert o.cause == "micro_batches" and o.detail.startswith("2 micro-batches in this step (usually 1): no step of "
                                                              "the watched optimizer between its doctor.step() calls")


def test_a_straggler_is_named_in_the_phase_of_its_own_time(sample_run_path):
    """A rank given 4x the other's rows on gloo was named a straggler "outside the model": its forward took 222 ms
    more of its own, while the other rank's forward held as much waiting for it in its all-gathers, so the phases'
    excess read 23 ms in forward and 17 ms outside. Known answer: rank 1 computes 150 ms more in forward, rank 0
    waits those 150 ms in a forward all-gather, and rank 1 spends 5 ms more outside the model: forward, 150 ms."""
    from fsdp_doctor.analyze.steps import analyze_steps, usable_steps
    from fsdp_doctor.store import load_run

    run = load_run(sample_run_path)
    for r, extra_outside in ((0, 0.0), (1, 5.0)):
        for st in usable_steps(run.ranks[r].steps):
            st.forward_ms += 150
            st.wall_ms += 150 + extra_outside
            st.outside_ms += extra_outside
            if r == 0:
                st.units[1].ag_wait_fwd_ms += 150
    (s,) = analyze_steps(run).stragglers
    assert (s.rank, s.phase) == (1, "forward") and abs(s.phase_excess_ms_per_step - 150.0) <= 1.0, s


def test_comm_headline_share_is_that_of_its_two_figures():
    """The headline's three figures agree: its % overlapped is 1 - exposed/collectives of the two medians it prints,
    not the median of the ranks' own shares (here 3 ranks: shares 50%, 10%, 80%, median 50%; medians 4 of 10 ms)."""
    from fsdp_doctor.pipeline import comm_summary
    from fsdp_doctor.present.fmt import comm_headline
    from fsdp_doctor.report_sections import OverlapRank, OverlapSection

    def rank(comm, exposed):
        return OverlapRank(comm_ms_per_step=comm, exposed_ms_per_step=exposed, steps=[1, 2],
                           step_overlap_pct=100.0 * (comm - exposed) / comm)

    ov = OverlapSection(per_rank={"0": rank(8.0, 4.0), "1": rank(10.0, 9.0), "2": rank(20.0, 4.0)})
    c = comm_summary(ov)
    assert (c.exposed_ms_per_step, c.comm_ms_per_step, c.overlap_pct) == (4.0, 10.0, 60.0)
    assert [c.per_rank[r].overlap_pct for r in "012"] == [50.0, 10.0, 80.0]  # each rank's own share kept
    assert "4.00 ms per step of 10.0 ms in collectives (60.0% overlapped)" in comm_headline(c)


def test_a_prediction_of_no_change_says_unchanged():
    """A new-user trial: a memory warning read "step 760.2 ms → 760.2 ms (0% faster)". Under 0.5% the step is
    "unchanged" (and a peak that does not move too); a change keeps its arrow and percentage."""
    from fsdp_doctor.diagnose.estimate import predicted
    from fsdp_doctor.present.fmt import predicted_text

    assert predicted_text(predicted(760.2, 760.2, 14.05 * 2**20, 13.8 * 2**20)) == \
        "step 760.2 ms unchanged, peak 14.05 MiB → 13.80 MiB"
    assert predicted_text(predicted(100.0, 80.0, 1 << 20, 1 << 20)) == "step 100.0 ms → 80.0 ms (20% faster), peak 1.00 MiB unchanged"
    assert predicted_text(predicted(100.0, 101.0)) == "step 100.0 ms → 101.0 ms (1% slower)"


def test_the_doctors_own_cost_over_the_run_is_said():
    """A long run's doctor_ms summed to 7.1 s of 156 s, its profiler steps' excess to more, and the report said
    neither (a new-user trial weighing whether to leave it on). Known answer: steps 1-9 of 100 ms, 1 ms of the
    doctor's between each; step 5 a profiler window of 400 ms, 50 ms of it the doctor's between steps: 8 x 1 + 50
    + (400 - 100 - 50) = 308 ms of 1,200 ms."""
    from fsdp_doctor.analyze.steps import analyze_steps
    from fsdp_doctor.present.fmt import doctor_text
    from fsdp_doctor.records import RunConfig, StepRecord
    from fsdp_doctor.store import Run
    from fsdp_doctor.store.reader import RankData

    run = Run(path="constructed")
    steps = [StepRecord(rank=0, step=k, start_ns=k, wall_ms=400.0 if k == 5 else 100.0, forward_ms=30.0,
                        backward_ms=50.0, optimizer_ms=10.0, outside_ms=9.0, profiled=k == 5,
                        doctor_ms=50.0 if k == 5 else 1.0) for k in range(10)]
    run.ranks[0] = RankData(rank=0, steps=steps, config=RunConfig(rank=0, world_size=1, backend="gloo", device="cpu"))
    sec = analyze_steps(run)
    assert sec.doctor_own_ms == {"0": [308.0, 1200.0, 1.0, 100.0, 300.0]}
    # what every step costs said first, apart from the one-off windows, the total last (a 12-step run read "79.3%",
    # a 10-step one "86.8%", nearly all one window: new-user trials)
    assert doctor_text(sec) == ("The doctor's own work: 1.00 ms per ordinary step (1.0% of the median step), its "
                                "records between steps; 300.0 ms once per profiler window or full memory count, not "
                                "per step (those steps' time over the median step, left out of the statistics "
                                "above); in all 308.0 ms of the 1.20 s the steps took (25.7%)")
    sec.doctor_own_ms = {"0": [308.0, 1200.0, 1.0, 100.0]}  # a report written before the one-off part
    assert doctor_text(sec).startswith("The doctor's own work: 308.0 ms of the 1.20 s the steps took (25.7%): 1.00 ms ")
    sec.doctor_own_ms = {"0": [308.0, 1200.0]}  # a report written before the split
    assert doctor_text(sec).startswith("The doctor's own work: 308.0 ms of the 1.20 s the steps took (25.7%): its ")


def test_fixes_say_which_names_of_the_script_they_read():
    """A new-user trial's model named ``m`` met ``NameError: name 'model' is not defined`` pasting a fix as printed,
    and its ``device = torch.device(f"cuda:{local_rank}")``-style variable was rebound by the mesh the fix defines.
    The diagnosis says once which names the fixes read; the mesh a fix defines binds no ``device``."""
    import ast
    import json

    from conftest import SAMPLE_RUN as SAMPLE
    from rich.console import Console

    from fsdp_doctor.diagnose.snippets import complete
    from fsdp_doctor.present.fmt import fixes_note
    from fsdp_doctor.present.terminal import render_report
    from fsdp_doctor.report_sections import Report

    report = Report.of(json.loads((SAMPLE / "report.json").read_text()))
    assert any(f.recommendation.code for f in report.findings)
    console = Console(width=100, record=True)
    render_report(report, console)
    out = console.export_text()
    assert out.count("The fixes call your model `model` and your optimizer `optimizer`") == 1
    assert out.index("The fixes call") > out.index("Diagnosis")
    assert fixes_note([f for f in report.findings if not f.recommendation.code]) == ""
    code = complete("fully_shard(model, mesh=mesh)")
    bound = {t.id for n in ast.parse(code).body if isinstance(n, ast.Assign) for t in n.targets
             if isinstance(t, ast.Name)}
    assert bound == {"mesh"}, code
