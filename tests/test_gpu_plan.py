"""What of the GPU path runs without a GPU: how ranks map onto GPUs, the demo's refusal without CUDA, and the GPU
campaign's plan (issue #22). The GPU tier itself is tests/test_gpu.py, marked `gpu`."""

from __future__ import annotations

import argparse

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsdp_doctor.workloads import WorkloadConfig, gpu_plan
from fsdp_doctor.workloads.launch import _rank_env

REPO = Path(__file__).resolve().parents[1]


def test_ranks_share_one_gpu_each_with_its_own_nccl_host_id():
    cfg = WorkloadConfig(device="cuda")
    plan = gpu_plan(cfg, 2, visible=1)
    assert plan.devices == [0, 0] and plan.shared
    assert "NCCL_HOSTID" in plan.describe() and "2 NCCL ranks on 1 GPU" in plan.describe()
    envs = [_rank_env(cfg, r, 2, 29500, visible=1) for r in range(2)]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "0"]  # DeviceMesh sets cuda:LOCAL_RANK: both use cuda:0
    assert [e["FSDP_DOCTOR_CUDA_DEVICE"] for e in envs] == ["0", "0"]
    assert len({e["NCCL_HOSTID"] for e in envs}) == 2  # NCCL then accepts two ranks on one device
    assert [e["RANK"] for e in envs] == ["0", "1"] and envs[1]["MASTER_PORT"] == "29500"


def test_one_gpu_per_rank_when_there_are_enough():
    cfg = WorkloadConfig(device="cuda")
    plan = gpu_plan(cfg, 4, visible=2)
    assert plan.devices == [0, 1, 0, 1] and plan.shared
    plan = gpu_plan(cfg, 2, visible=8)
    assert plan.devices == [0, 1] and not plan.shared
    assert "NCCL_HOSTID" not in _rank_env(cfg, 1, 2, 1, visible=8)
    assert _rank_env(cfg, 1, 2, 1, visible=8)["LOCAL_RANK"] == "1"


def test_cpu_ranks_get_no_gpu_settings():
    cfg = WorkloadConfig()
    assert gpu_plan(cfg, 2) is None
    env = _rank_env(cfg, 1, 2, 1)
    assert "NCCL_HOSTID" not in env and "FSDP_DOCTOR_CUDA_DEVICE" not in env and env["LOCAL_RANK"] == "1"
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        gpu_plan(WorkloadConfig(device="cuda"), 2, visible=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_demo_on_cuda_without_a_gpu_is_one_clear_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fsdp_doctor.cli", "demo", "--device", "cuda", "--nproc", "2",
                           "--out", str(tmp_path / "d")], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "no CUDA device is visible" in lines[0], proc.stderr
    assert not (tmp_path / "d").exists()  # nothing was started


def test_the_gpu_campaign_plans_every_step_and_expects_real_findings(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_campaign

    steps = gpu_campaign.plan(tmp_path, dry=False, steps=10)
    names = [s.name for s in steps]
    # in order of value for a short call: the recorded runs (traces/gpu) and the headline overhead first
    assert names[:7] == ["env", "probe_costs", "scenarios_gpu", "fixture", "overhead_1b", "overhead_1b_b16", "tests"]
    assert {"overhead_2r", "allocator_1r", "allocator_2r", "allocator_2r_offload", "memtracker", "predictions",
            "alloc_retries_probe", "overhead_tiny"} <= set(names) and len(names) == 15  # (scenarios: GPU rows)
    assert all("--device" in s.argv and "cuda" in s.argv for s in steps
               if s.name not in ("env", "probe_costs", "tests"))
    # the planned steps' limits add up to about 37 minutes: a whole campaign spans GPU sessions (15 minutes of device
    # time each now), each call's --budget-s skipping the steps that would overrun and --only / --rows new choosing
    assert sum(s.timeout_s for s in steps) <= 2230
    # the overhead at batch 16 beside batch 4: the same 1-rank ~1B model, a device-bound step
    by = {s.name: s.argv for s in steps}
    b4, w = by["overhead_1b"], gpu_campaign._with
    assert b4[b4.index("--batch-size") + 1] == "4" and b4[b4.index("--nproc") + 1] == "1"
    assert by["overhead_1b_b16"] == w(w(w(b4, "--batch-size", "16"), "--blocks", "8"), "--json",
                                      str(tmp_path / "overhead_1b_b16.json"))
    # the ~1B model of the 1-rank overhead run
    from fsdp_doctor.workloads import total_param_count

    o = gpu_campaign.ONE_B
    cfg = WorkloadConfig(n_layers=int(o[1]), d_model=int(o[3]), n_heads=int(o[5]), n_kv_heads=int(o[7]),
                         vocab=int(o[9]), seq_len=int(o[11]))
    assert 0.9e9 < total_param_count(cfg) < 1.2e9 and cfg.n_kv_heads < cfg.n_heads
    # --only: a step's own name selects it alone, any other name the steps it begins
    picked = gpu_campaign.only_steps(steps, "env,scenarios,overhead_1b,allocator,tests")
    assert [s.name for s in picked] == ["env", "scenarios_gpu", "overhead_1b", "tests", "allocator_1r",
                                        "allocator_2r", "allocator_2r_offload"]


def test_the_campaign_runs_the_matrix_gpu_rows_and_copies_their_table(tmp_path):
    """The scenarios_gpu step: the matrix's GPU rows through benchmarks/scenarios.py on cuda (on the dry run the
    same rows on the CPU), its table and rechecks in the folder, its table copied into summary.md; the tests step
    leaves out the GPU tier's test of the same rows."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    sys.path.insert(0, str(REPO / "tests"))
    import gpu_campaign
    import scenario_matrix as M

    from fsdp_doctor.diagnose import RULES

    for dry, device in ((False, "cuda"), (True, "cpu")):
        steps = {s.name: s for s in gpu_campaign.plan(tmp_path, dry=dry, steps=10)}
        s = steps["scenarios_gpu"]
        assert s.argv[1].endswith("benchmarks/scenarios.py") and s.argv[s.argv.index("--device") + 1] == device
        assert s.argv[s.argv.index("--rows") + 1] == "gpu"
        assert s.outputs == ["scenarios_gpu.md", "scenarios_gpu.json"]
        assert str(tmp_path / "scenarios_gpu.json") in s.argv and 120 <= s.timeout_s <= 420
        assert f"not {gpu_campaign.GPU_ROWS_TEST}" in steps["tests"].argv
    # the rows: every GPU-only rule the brief names planted once, and the issue's recorded GPU scenarios (no
    # prefetch, every Linear its own unit, one unit, CPU offload, ZeRO-2 and ZeRO-3, checkpointing needed and
    # unneeded, the optimizer before sharding, a small batch, accumulation, a straggler), tuned baselines
    codes = {r.code for r in M.GPU_ROWS}
    assert codes >= {None, "offload.costly", "offload.unpinned", "kernels.eager_attention", "comm.small_collectives",
                     "wrap.too_fine", "prefetch.exposed_allgather", "kernels.launch_bound", "wrap.too_coarse",
                     "reshard.zero2_affordable", "ac.unneeded", "ac.recommended", "optim.before_shard",
                     "throughput.low_mfu", "accum.sync_every_micro_batch", "straggler.rank"}
    assert codes - {None} <= {cls.code for cls in RULES}
    assert any(r.code is None and r.knobs.get("reshard_after_forward") is False for r in M.GPU_ROWS)  # ZeRO-2
    assert len({r.name for r in M.GPU_ROWS}) == len(M.GPU_ROWS) and not set(M.BY_NAME) & {"", None}
    assert all(r.gpu and r.profile for r in M.GPU_ROWS) and not any(r.gpu for r in M.ROWS)
    # shrunk on the CPU, without what the CPU cannot do
    spec = M.BY_NAME["gpu_gpt_offload_unpinned"].spec(tmp_path / "x", device="cpu")
    assert "cpu_offload" not in spec["knobs"] and spec["knobs"]["d_model"] == 64
    assert M.BY_NAME["gpu_gpt_offload_unpinned"].spec(tmp_path / "x", device="cuda")["knobs"]["cpu_offload"]
    # summary.md carries the step's table, each row's verdict and the recorded runs (the fixtures) with their sizes
    run = tmp_path / "scenarios_gpu" / "gpu_gpt_whole"
    (run / "profiler").mkdir(parents=True)
    (run / "manifest.json").write_text("{}")
    (run / "profiler" / "rank0.pt.trace.json").write_bytes(b"x" * (3 << 20))
    (tmp_path / "scenarios_gpu" / "gpu_gpt_whole_fixed").mkdir()
    (tmp_path / "scenarios_gpu" / "gpu_gpt_whole_fixed" / "manifest.json").write_text("{}")
    (tmp_path / "scenarios_gpu.md").write_text("| rule | planted on |\n|---|---|\n| offload.costly | 1: gpt |\n")
    (tmp_path / "scenarios_gpu.json").write_text(json.dumps(
        {"gpu_gpt_offload": {"ok": False, "problems": ["offload.costly not found at warning or above"]}}))
    gpu_campaign.summarize(tmp_path, [dict(name="scenarios_gpu", status="ok", seconds=61.0)])
    md = (tmp_path / "summary.md").read_text()
    assert "| offload.costly | 1: gpt |" in md and "gpu_gpt_offload: offload.costly not found" in md
    assert "- scenarios_gpu/gpu_gpt_whole: 3.0 MiB (3.0 MiB of profiler trace)" in md and "_fixed" not in md
    assert json.loads((tmp_path / "summary.json").read_text())["scenarios_gpu"]["gpu_gpt_offload"]["ok"] is False


class FakeEvent:
    """Stands in for torch.cuda.Event: `record()` stamps a fake device clock; `query()` says whether the device
    reached it (the clock the test advances), so the timeline's bookkeeping runs without a GPU."""

    clock = 0.0  # "device time" of the next recorded event (ms)
    done_until = float("inf")

    def __init__(self, enable_timing: bool = True) -> None:
        self.t = None

    def record(self) -> None:
        self.t = FakeEvent.clock

    def query(self) -> bool:
        return self.t <= FakeEvent.done_until

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: "FakeEvent") -> float:
        return other.t - self.t


def test_a_campaign_split_over_device_calls_keeps_every_step_in_the_summary(tmp_path):
    """A GPU session may run the campaign in several device calls into one folder (``--only``): each call's summary
    keeps the earlier calls' steps; a step run again replaces its result, a budget skip never hides an earlier run."""
    import gpu_campaign as G

    first = [dict(name="env", status="ok", seconds=1.0), dict(name="overhead_1b", status="ok", seconds=90.0),
             dict(name="allocator_1r", status="skipped (budget)", seconds=0.0)]
    G.summarize(tmp_path, G.merged(G.previous_steps(tmp_path), first))
    second = [dict(name="overhead_1b", status="skipped (budget)", seconds=0.0),
              dict(name="allocator_1r", status="ok", seconds=40.0), dict(name="memtracker", status="exit 1", seconds=5.0)]
    G.summarize(tmp_path, G.merged(G.previous_steps(tmp_path), second))
    steps = {r["name"]: r["status"] for r in json.loads((tmp_path / "summary.json").read_text())["steps"]}
    assert steps == {"env": "ok", "overhead_1b": "ok", "allocator_1r": "ok", "memtracker": "exit 1"}
    md = (tmp_path / "summary.md").read_text()
    assert "| overhead_1b | ok | 90 |" in md and "| allocator_1r | ok | 40 |" in md


def test_gpu_timeline_phases_and_units_read_a_step_later(monkeypatch):
    """Forward, backward and optimizer phases and per-unit times come out of the events' own clock, a step later
    (never waiting), and no event is reused while a pending step still needs it."""
    from fsdp_doctor.record import gpu_timing

    monkeypatch.setattr(gpu_timing.torch.cuda, "Event", FakeEvent)
    tl = gpu_timing.GpuTimeline(rank=0, n_units=2, names=["", "layers.0"], unit_every=1)  # each unit every step

    def at(t):
        FakeEvent.clock = t

    def one_step(t0: float, step: int):
        at(t0); tl.begin_step()
        at(t0 + 1); tl.open(0, 0)          # root forward
        at(t0 + 2); tl.open(1, 0)          # block forward
        at(t0 + 5); tl.close(1, 0)
        at(t0 + 6); tl.close(0, 0)
        at(t0 + 7); tl.open(0, 1)          # root backward
        at(t0 + 8); tl.open(1, 1)
        at(t0 + 14); tl.close(1, 1)
        at(t0 + 15); tl.close(0, 1)
        at(t0 + 16); tl.optimizer_begin()
        at(t0 + 19); tl.optimizer_end()
        at(t0 + 20)
        return tl.end_step(step)

    FakeEvent.done_until = 10.0  # the device is still in step 0's forward when the host ends step 0
    assert one_step(0.0, 0) == []  # nothing waits: step 0 stays pending
    FakeEvent.done_until = 110.0  # step 0 done on the device, step 1 not yet
    out = one_step(100.0, 1)
    assert [r.step for r in out] == [0]
    FakeEvent.done_until = float("inf")
    out += one_step(200.0, 2) + tl.flush()
    by_step = {r.step: r for r in out}
    assert sorted(by_step) == [0, 1, 2]
    for r in by_step.values():
        assert r.step_ms == 20.0
        assert (r.forward_ms, r.backward_ms, r.optimizer_ms) == (5.0, 8.0, 3.0)
        assert r.units == [["", 5.0, 8.0], ["layers.0", 3.0, 6.0]]


def _fake_campaign(out: Path, *runs: str) -> int:
    """A campaign folder whose recorded runs (and a fix's rerun and a capacity probe beside them, which the campaign
    never adopts) are copies of traces/sample, with the rows' rechecks; returns one run's bytes."""
    import shutil

    sample = REPO / "traces" / "sample"
    for d in (*runs, "scenarios_gpu/gpu_gpt_whole_fixed", "scenarios_gpu/gpu_gpt_tight_capacity_probe"):
        shutil.copytree(sample, out / d)
    (out / "scenarios_gpu.json").write_text(json.dumps({Path(d).name: {"ok": True} for d in runs if d != "fixture"}))
    return sum(f.stat().st_size for f in sample.rglob("*") if f.is_file())


def test_adopting_a_campaign_copies_its_recorded_runs_into_traces_gpu(tmp_path, monkeypatch):
    """``gpu_campaign.py --adopt``: the fixture and each GPU row's before-run (not the fixes' reruns nor the
    capacity probes) land where tests/test_gpu_fixtures.py reads them, with the rows' rechecks and the machine."""
    import shutil

    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_campaign as G

    out = tmp_path / "c"
    size = _fake_campaign(out, "fixture", "scenarios_gpu/gpu_gpt_whole")
    (out / "env.json").write_text('{"gpu": "NVIDIA H100 80GB HBM3"}')
    dest = tmp_path / "repo" / "traces" / "gpu"
    monkeypatch.setattr(G, "REPO", tmp_path / "repo")  # where the lines are relative to
    lines = G.adopt(out, dest)
    assert sorted(p.relative_to(dest).as_posix() for p in dest.glob("**/manifest.json")) == \
        ["fixture/manifest.json", "scenarios/gpu_gpt_whole/manifest.json"]
    assert (dest / "fixture" / "report.json").exists() and (dest / "env.json").exists()
    assert lines[-1] == (f"2 runs adopted, {2 * size / 2**20:.1f} MiB; 2 in traces/gpu, "
                         f"{sum(f.stat().st_size for f in dest.rglob('*') if f.is_file()) / 2**20:.1f} MiB in all")
    with pytest.raises(SystemExit, match="no recorded run"):
        G.adopt(tmp_path / "empty", tmp_path / "d2")
    # a campaign untarred inside traces/gpu would be deleted by its own adoption: refused, nothing touched
    inside = dest / "campaign"
    shutil.copytree(out, inside)
    with pytest.raises(SystemExit, match="overlap"):
        G.adopt(inside, dest)
    assert (inside / "fixture" / "manifest.json").exists() and (dest / "scenarios" / "gpu_gpt_whole").is_dir()
    # adopting again replaces the earlier copy, leaving no temporary folder beside it
    shutil.rmtree(inside)
    G.adopt(out, dest)
    assert sorted(p.name for p in dest.parent.iterdir()) == ["gpu"]


@pytest.mark.long  # (the long tier: real runs of 10-30 s on a slow host, tests/conftest.py)
def test_a_scenarios_step_cut_off_keeps_the_rows_it_finished(tmp_path, monkeypatch):
    """benchmarks/scenarios.py --chunk N writes its table and rechecks after every N rows: the campaign's GPU step,
    killed at its time limit in its second chunk, keeps the first chunk's rows (a real tuned row on gloo here; the
    second chunk is cut off in its launch). Adopted, only rows with a recheck join traces/gpu: a row recorded when
    the step was cut may be half-written."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    sys.path.insert(0, str(REPO / "tests"))
    import gpu_campaign as G
    import scenario_matrix as M
    import scenarios

    steps = {s.name: s for s in G.plan(tmp_path, dry=False, steps=10, rows="new,gpu_gpt_whole")}
    argv = steps["scenarios_gpu"].argv
    assert argv[argv.index("--chunk") + 1] == str(G.SCENARIO_CHUNK)
    real, calls = M.run_matrix, []

    def run_matrix(tmp, rows, device="cpu"):
        calls.append([r.name for r in rows])
        if len(calls) == 2:
            raise KeyboardInterrupt("the campaign's time limit")  # (SIGKILL leaves what was written, as this does)
        return real(tmp, rows, device=device)

    monkeypatch.setattr(M, "run_matrix", run_matrix)
    out = tmp_path / "c"
    (out / "scenarios_gpu").mkdir(parents=True)
    table, rechecks = out / "scenarios_gpu.md", out / "scenarios_gpu.json"
    with pytest.raises(KeyboardInterrupt):
        scenarios.main(["--only", "gpt_tuned,hf_llama_tuned", "--chunk", "1", "--markdown", "--out",
                        str(out / "scenarios_gpu"), "--table", str(table), "--json", str(rechecks)])
    assert calls == [["gpt_tuned"], ["hf_llama_tuned"]]
    assert list(json.loads(rechecks.read_text())) == ["gpt_tuned"]
    assert json.loads(rechecks.read_text())["gpt_tuned"]["ok"] is True
    assert table.read_text().rstrip().endswith("; not run yet: hf_llama_tuned")
    # the cut-off row's folder, as a killed launch leaves it
    (out / "scenarios_gpu" / "hf_llama_tuned").mkdir()
    (out / "scenarios_gpu" / "hf_llama_tuned" / "manifest.json").write_text("{}")
    dest = tmp_path / "repo" / "traces" / "gpu"
    monkeypatch.setattr(G, "REPO", tmp_path / "repo")
    lines = G.adopt(out, dest)
    assert [p.parent.name for p in dest.glob("scenarios/*/manifest.json")] == ["gpt_tuned"]
    assert lines[0] == ("not adopted, their rows unfinished (no recheck in scenarios_gpu.json): "
                        "scenarios_gpu/hf_llama_tuned")


def test_a_campaign_of_the_new_rows_adds_them_beside_those_recorded_earlier(tmp_path, monkeypatch):
    """``--rows new``: the scenarios step runs only the GPU rows traces/gpu/ has not recorded (a short device call);
    adopted, they join the earlier recordings, which stay (the fixture too), their rechecks merged and their table
    added after the earlier one."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    sys.path.insert(0, str(REPO / "tests"))
    import gpu_campaign as G
    import scenario_matrix as M

    # (which rows traces/gpu/ holds changes with each GPU session: two taken out of those recorded here)
    unrecorded = [M.GPU_ROWS[1].name, M.GPU_ROWS[-1].name]
    monkeypatch.setattr(M, "recorded_gpu_rows", lambda: [r for r in M.GPU_ROWS if r.name not in unrecorded])
    new = G.new_gpu_rows()
    assert new == unrecorded
    steps = {s.name: s for s in G.plan(tmp_path, dry=False, steps=10, rows="new")}
    argv = steps["scenarios_gpu"].argv
    assert argv[argv.index("--only") + 1] == ",".join(new)
    assert "--only" not in {s.name: s for s in G.plan(tmp_path, dry=False, steps=10)}["scenarios_gpu"].argv
    # rows by name beside the new ones (a recorded row whose rerun a later session repeats), each once
    named = {s.name: s for s in G.plan(tmp_path, dry=False, steps=10, rows=f"new,gpu_gpt_whole,{unrecorded[0]}")}
    argv = named["scenarios_gpu"].argv
    assert argv[argv.index("--only") + 1] == ",".join(unrecorded + ["gpu_gpt_whole"])
    with pytest.raises(argparse.ArgumentTypeError, match="not a GPU row: gpu_gpt_nope"):
        G._rows_arg("new,gpu_gpt_nope")
    monkeypatch.setattr(G, "new_gpu_rows", lambda: [])  # every row recorded: no scenarios step at all
    assert "scenarios_gpu" not in {s.name for s in G.plan(tmp_path, dry=False, steps=10, rows="new")}

    first, later = tmp_path / "c1", tmp_path / "c2"
    _fake_campaign(first, "fixture", "scenarios_gpu/gpu_gpt_whole", "scenarios_gpu/gpu_gpt_accum")
    (first / "scenarios_gpu.json").write_text(json.dumps({"gpu_gpt_whole": {"ok": True}, "gpu_gpt_accum": {"ok": True}}))
    (first / "scenarios_gpu.md").write_text("| rule | planted on |\n|---|---|\n| wrap.too_coarse | 1: gpt |\n")
    _fake_campaign(later, "scenarios_gpu/gpu_gpt_accum", "scenarios_gpu/gpu_gpt_loss_allreduce")
    (later / "scenarios_gpu.json").write_text(json.dumps({"gpu_gpt_accum": {"ok": False},
                                                          "gpu_gpt_loss_allreduce": {"ok": True}}))
    (later / "scenarios_gpu.md").write_text("| rule | planted on |\n|---|---|\n| accum.sync_every_micro_batch | 1: gpt |\n")
    dest = tmp_path / "repo" / "traces" / "gpu"
    monkeypatch.setattr(G, "REPO", tmp_path / "repo")
    G.adopt(first, dest)
    (dest / "scenarios" / "gpu_gpt_accum" / "old").write_text("the earlier recording's")
    lines = G.adopt(later, dest)
    assert sorted(p.parent.relative_to(dest).as_posix() for p in dest.glob("**/manifest.json")) == [
        "fixture", "scenarios/gpu_gpt_accum", "scenarios/gpu_gpt_loss_allreduce", "scenarios/gpu_gpt_whole"]
    assert not (dest / "scenarios" / "gpu_gpt_accum" / "old").exists()  # a row recorded again replaces its folder
    assert lines[-1].startswith("2 runs adopted") and "; 4 in traces/gpu" in lines[-1]
    assert json.loads((dest / "scenarios_gpu.json").read_text()) == {
        "gpu_gpt_whole": {"ok": True}, "gpu_gpt_accum": {"ok": False}, "gpu_gpt_loss_allreduce": {"ok": True}}
    md = (dest / "scenarios_gpu.md").read_text()
    assert md.index("| wrap.too_coarse |") < md.index("Recorded later (gpu_gpt_accum, gpu_gpt_loss_allreduce)") \
        < md.index("| accum.sync_every_micro_batch |")
    assert sorted(p.name for p in dest.parent.iterdir()) == ["gpu"]


def test_a_campaign_packs_into_tarballs_the_device_tool_returns(tmp_path, monkeypatch):
    """``--pack DIR``: the results (summaries, figures, logs) in one tarball, the recorded runs ``--adopt`` takes
    in parts under the size the device tool returns (the fixes' reruns and the probes left out), the rest listed;
    untarred into one folder they adopt as the campaign folder itself does."""
    import tarfile

    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_campaign as G

    out = tmp_path / "c"
    run = _fake_campaign(out, "fixture", "scenarios_gpu/gpu_gpt_whole", "scenarios_gpu/gpu_gpt_accum")
    (out / "summary.md").write_text("# GPU campaign\n")
    monkeypatch.setattr(G, "PACK_PART", int(2.5 * run))  # two runs a part
    monkeypatch.setattr(G, "PACK_PARTS", 2)  # the results and one part of runs: one run left out
    lines = G.pack(out, tmp_path / "OUT")
    got = sorted(p.name for p in (tmp_path / "OUT").iterdir())
    assert got == ["campaign-results.tgz", "campaign-runs-1.tgz"], lines
    packed = json.loads((out / "packed.json").read_text())
    assert packed["parts"] == [["fixture", "scenarios_gpu/gpu_gpt_accum"]]
    assert packed["left_out"] == ["scenarios_gpu/gpu_gpt_whole"] and "left out" in lines[-1]
    back = tmp_path / "back"
    for t in got:
        with tarfile.open(tmp_path / "OUT" / t) as tar:
            tar.extractall(back, filter="data")
    assert (back / "summary.md").exists() and (back / "packed.json").exists()
    assert not list(back.glob("scenarios_gpu/*_fixed")) and not list(back.glob("scenarios_gpu/*_probe"))
    monkeypatch.setattr(G, "REPO", tmp_path)
    G.adopt(back, tmp_path / "traces" / "gpu")
    assert (tmp_path / "traces" / "gpu" / "scenarios" / "gpu_gpt_accum" / "manifest.json").exists()


def test_the_rerun_of_a_fix_whose_advice_was_wrong_comes_back_as_evidence(tmp_path, monkeypatch):
    """A GPU row whose fix's rerun showed the advice wrong (kernels.launch_bound's compiled blocks measured no
    faster): its rerun is packed after the fixtures and adopted into traces/gpu/rechecks/, where a CPU session reads
    why; the reruns of the rows whose advice held stay on the machine. Its advice holding in a later campaign takes
    the evidence away."""
    import shutil
    import tarfile

    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_campaign as G

    out = tmp_path / "c"
    run = _fake_campaign(out, "fixture", "scenarios_gpu/gpu_gpt_whole", "scenarios_gpu/gpu_gpt_accum")
    shutil.copytree(REPO / "traces" / "sample", out / "scenarios_gpu" / "gpu_gpt_accum_fixed")
    (out / "scenarios_gpu.json").write_text(json.dumps({"gpu_gpt_whole": {"ok": False, "problems": ["x"]},
                                                        "gpu_gpt_accum": {"ok": True}}))
    assert [r["path"] for r in G.wrong_reruns(out)] == ["scenarios_gpu/gpu_gpt_whole_fixed"]
    monkeypatch.setattr(G, "PACK_PART", int(2.5 * run))  # two runs a part
    G.pack(out, tmp_path / "OUT")
    packed = json.loads((out / "packed.json").read_text())
    assert packed["parts"] == [["fixture", "scenarios_gpu/gpu_gpt_accum"],
                               ["scenarios_gpu/gpu_gpt_whole", "scenarios_gpu/gpu_gpt_whole_fixed"]]
    back = tmp_path / "back"
    for t in (tmp_path / "OUT").iterdir():
        with tarfile.open(t) as tar:
            tar.extractall(back, filter="data")
    assert not (back / "scenarios_gpu" / "gpu_gpt_accum_fixed").exists()
    dest = tmp_path / "repo" / "traces" / "gpu"
    monkeypatch.setattr(G, "REPO", tmp_path / "repo")
    lines = G.adopt(back, dest)
    assert sorted(p.parent.relative_to(dest).as_posix() for p in dest.glob("**/manifest.json")) == [
        "fixture", "rechecks/gpu_gpt_whole_fixed", "scenarios/gpu_gpt_accum", "scenarios/gpu_gpt_whole"]
    assert "traces/gpu/rechecks/gpu_gpt_whole_fixed" in "\n".join(lines) and lines[-1].startswith("3 runs adopted")
    # a later campaign: the advice holds now
    (back / "scenarios_gpu.json").write_text(json.dumps({"gpu_gpt_whole": {"ok": True}}))
    G.adopt(back, dest)
    assert not (dest / "rechecks").exists() and (dest / "scenarios" / "gpu_gpt_whole" / "manifest.json").exists()


def test_the_alloc_retries_row_runs_its_loop_and_pastes_its_fix_before_the_ranks_start(tmp_path, monkeypatch):
    """memory.alloc_retries' GPU row, shrunk on gloo (its rule needs CUDA's allocator figures: quiet here): the
    loop's sequence lengths vary from step to step, and the rerun's fix, the allocator setting printed for the top
    of the script (``where`` "startup"), is executed in each rank before it starts its device, in a launch of its
    own; the row then trains under that setting. The allocator cap (alloc_limit) is CUDA's and skipped here."""
    sys.path.insert(0, str(REPO / "tests"))
    import clients as C
    import scenario_matrix as M

    from fsdp_doctor.diagnose.snippets import complete, expandable_segments_code

    for v in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):  # the ranks inherit this environment
        monkeypatch.delenv(v, raising=False)
    row = M.BY_NAME["gpu_gpt_alloc_retries"]
    assert row.alloc_limit == 1.1 and row.loop == "varying_lengths" and row.figure == "retries"
    lengths = [C.seq_len_at(512, s) for s in range(12)]
    assert lengths[:2] == [512, 512] and max(lengths) == 512 and min(lengths) == 64 and len(set(lengths)) == 6
    fix = {"code": complete(expandable_segments_code({})), "where": "startup", "inputs": {},
           "finding": "memory.alloc_retries"}
    got = M.launch([row.spec(tmp_path / "fixed", fix, device="cpu")], tmp_path, "after_startup")
    res = got[row.name]
    assert "error" not in res, res
    assert res["alloc_conf"] == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    run, report = M.diagnosis(tmp_path / "fixed")
    assert len(res["losses"]) == len(run.ranks[0].steps) == 10
    st = next(s for s in report.rules if s.code == "memory.alloc_retries")
    assert st.status == "skipped"  # on the CPU: no allocator to retry
