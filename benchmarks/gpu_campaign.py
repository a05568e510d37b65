"""The whole GPU campaign of issue #22 in one command, for a one-GPU machine, writing every figure to one folder.

    python benchmarks/gpu_campaign.py --out /tmp/campaign                 # on the GPU machine (~8 min)
    .venv/bin/python benchmarks/gpu_campaign.py --out /tmp/c --dry-run    # the same steps on CPU, tiny shapes

Steps, in order of value (each a subprocess with its own time limit; a step that would overrun the budget is
skipped and listed as such, and the summary is rewritten after every step, so a cut-off call still returns what
ran):

  env          GPU, driver, torch, CUDA and NCCL versions (env.json)
  probe_costs  benchmarks/gpu_call_costs.py: microseconds a call of the doctor's per-mark and per-step CUDA calls
  tests        `pytest -m gpu`: the GPU tier (tests/test_gpu.py, tests/test_gpu_timing.py) as JUnit XML, less the
               GPU rows' test (the next step runs those rows)
  scenarios_gpu  the scenario matrix's GPU rows (benchmarks/scenarios.py --device cuda): the GPU rules' planted
               problems and the issue's GPU scenarios (no prefetch, every Linear its own unit, one unit, CPU offload,
               ZeRO-2 and ZeRO-3 with memory to spare, checkpointing needed and unneeded, the optimizer before
               sharding, a small batch, accumulation syncing every micro-batch, a straggler, a tuned baseline), all
               recorded in a launch of 2 NCCL ranks per 5 rows, each finding's fix applied and rechecked in a
               second (scenarios_gpu.md, scenarios_gpu.json, rewritten after every 5 rows, so a step cut off keeps
               the rows it finished; the runs in scenarios_gpu/NAME/ are the GPU fixtures)
  overhead_1b  benchmarks/overhead.py on a ~1B-parameter Llama-style GPT with grouped-query attention, 1 rank
  overhead_1b_b16  the same at batch 16 (4x the tokens): a device-bound step, where the host's work runs ahead of
               the device (at batch 4 the step is host-bound, and every microsecond of the doctor's shows)
  overhead_2r  the same on 2 NCCL ranks sharing the GPU (NCCL_HOSTID per rank)
  overhead_tiny  the launch-bound tiny GPT of kernels.launch_bound's row, 1 rank: the doctor's hooks against a step
               that is all host work (the worst case), with the memory probe, the profiler window, or both off
  allocator    benchmarks/memory_vs_allocator.py: the doctor's per-step peak against max_memory_allocated(),
               1 rank, 2 ranks, and 2 ranks with CPU offload
  memtracker   benchmarks/memory_vs_memtracker.py --device cuda: categories at every matched point against
               torch's FSDPMemTracker (reference GPT, HF Llama), 2 NCCL ranks (memtracker.log)
  fixture      a 2-rank run recorded by watch() with one profiler window (`fsdp-doctor demo`), for traces/
  predictions  benchmarks/predictions.py --device cuda on the cases no GPU row reruns (a slow loader, ZeRO-2 under a
               budget): the rows' rechecks are the other fixes' predicted against measured step and peak

The folder then holds summary.md (the figures, for the README, and the recorded runs with their sizes: the
fixtures to commit), summary.json, one log per step, and the run directories (fixture/, scenarios_gpu/NAME/). On
the device machine, tar the folder under $OUT; back here, `--adopt --out FOLDER` copies its recorded runs into
traces/gpu/, which tests/test_gpu_fixtures.py then reads on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable

# ~1.0e9 parameters: 20 blocks of width 2048, 16 query heads over 4 key/value heads, a 32k vocabulary
ONE_B = ["--n-layers", "20", "--d-model", "2048", "--n-heads", "16", "--n-kv-heads", "4", "--vocab", "32000",
         "--seq-len", "1024", "--batch-size", "4", "--param-dtype", "bf16"]
MID = ["--n-layers", "8", "--d-model", "1024", "--n-heads", "16", "--n-kv-heads", "4", "--vocab", "32000",
       "--seq-len", "512", "--batch-size", "4", "--param-dtype", "bf16"]
# tests/scenario_matrix.py's TINY_GPU: the launch-bound row's GPT (the workload's defaults: 4 heads, a 512 vocabulary)
TINY_GPT = ["--n-layers", "4", "--d-model", "64", "--n-heads", "4", "--vocab", "512", "--seq-len", "32",
            "--batch-size", "2"]
TINY_ARMS = {"on": {}, "no_memory": {"memory": False}, "no_profile": {"profile": False},
             "timing_only": {"memory": False, "profile": False}}
TINY = ["--n-layers", "2", "--d-model", "64", "--n-heads", "4", "--n-kv-heads", "2", "--vocab", "512",
        "--seq-len", "32", "--batch-size", "2", "--param-dtype", "fp32"]


def _with(argv: list[str], flag: str, value: str) -> list[str]:
    """``argv`` with ``flag``'s value replaced."""
    i = argv.index(flag)
    return [*argv[:i + 1], value, *argv[i + 2:]]


# the GPU rows run this many at a time, their table and rechecks written after each: a step cut off at its time limit
# keeps the rows it finished (the fourth GPU round took most of a 307 s call for 5 rows; a launch costs ~10 s more)
SCENARIO_CHUNK = 5

# tests/test_gpu.py's test of the GPU rows: the scenarios_gpu step runs the same rows, the tests step leaves it out
GPU_ROWS_TEST = "test_scenario_matrix_gpu_rows"


@dataclass
class Step:
    name: str
    argv: list[str]
    timeout_s: int
    outputs: list[str] = field(default_factory=list)  # files (relative to the folder) the step writes
    env: dict[str, str] = field(default_factory=dict)


def _rows_arg(value: str) -> str:
    """--rows: "all", or "new" and GPU row names, comma-separated; an unknown name is an error naming it."""
    if value == "all":
        return value
    sys.path.insert(0, str(REPO / "tests"))
    import scenario_matrix as M

    names = {r.name for r in M.GPU_ROWS} | {"new"}
    bad = [p.strip() for p in value.split(",") if p.strip() and p.strip() not in names]
    if bad or not value.strip():
        raise argparse.ArgumentTypeError(f"not a GPU row: {', '.join(bad) or repr(value)} (the rows: "
                                         "tests/scenario_matrix.py GPU_ROWS; or all, new)")
    return value


def new_gpu_rows() -> list[str]:
    """The matrix's GPU rows that traces/gpu/scenarios/ has no recording of yet (added since the last GPU session)."""
    sys.path.insert(0, str(REPO / "tests"))
    import scenario_matrix as M

    recorded = {r.name for r in M.recorded_gpu_rows()}
    return [r.name for r in M.GPU_ROWS if r.name not in recorded]


def plan(out: Path, dry: bool, steps: int, rows: str = "all") -> list[Step]:
    """The campaign's steps; ``rows`` "new": its scenarios step runs only the GPU rows not recorded yet (none: no
    such step), for a short device call that adds them to traces/gpu/ (``--adopt`` keeps the others)."""
    device = "cpu" if dry else "cuda"
    big, mid = (TINY, TINY) if dry else (ONE_B, MID)
    bench = lambda name: str(REPO / "benchmarks" / name)  # noqa: E731
    # 3 steps skipped after attaching: the memory probe's full steps 0-2 (its high-water mode runs every operator
    # through Python; later full steps come every ``full_every`` steps, up to 500 apart), like the profiler window
    oh = ["--device", device, "--blocks", "4" if dry else "10", "--block-steps", "7" if dry else "13", "--skip", "3"]
    # None: every GPU row; "new": those not recorded; else row names, "new" among them or not
    asked = [p.strip() for p in rows.split(",") if p.strip()]
    only = None if rows == "all" else list(dict.fromkeys(
        n for p in asked for n in (new_gpu_rows() if p == "new" else [p])))
    todo = [
        Step("env", [PY, str(Path(__file__)), "--env", str(out / "env.json")], 60, ["env.json"]),
        *([] if dry else [Step("probe_costs", [PY, bench("gpu_call_costs.py"), "--json", str(out / "probe_costs.json")],
                               60, ["probe_costs.json"])]),
        # (157 s for 7 tests on the H100; 10 now, a model compiled whole among them: a step cut off writes no XML)
        Step("tests", [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-rs", "-k",
                       f"not {GPU_ROWS_TEST}", f"--junitxml={out / 'gpu_tests.xml'}", str(REPO / "tests")], 300,
             ["gpu_tests.xml"]),
        # the GPU rows (on the dry run: shrunk, on gloo, their rules quiet: the plumbing only)
        *([] if only == [] else [
            Step("scenarios_gpu", [PY, bench("scenarios.py"), "--device", device, "--rows", "gpu", "--markdown",
                                   *(["--only", ",".join(only)] if only else []), "--chunk", str(SCENARIO_CHUNK),
                                   "--out", str(out / "scenarios_gpu"), "--table", str(out / "scenarios_gpu.md"),
                                   "--json", str(out / "scenarios_gpu.json")], 420,
                 ["scenarios_gpu.md", "scenarios_gpu.json"])]),
        Step("overhead_1b", [PY, bench("overhead.py"), *oh, "--nproc", "1", *big, "--json", str(out / "overhead_1b.json")],
             150, ["overhead_1b.json"]),
        # the same model with a batch 4 times larger (on the dry run: twice the tiny one), fewer blocks: a longer step
        Step("overhead_1b_b16", [PY, bench("overhead.py"), *_with(oh, "--blocks", "4" if dry else "8"),
                                 "--nproc", "1", *_with(big, "--batch-size", "4" if dry else "16"),
                                 "--json", str(out / "overhead_1b_b16.json")], 150, ["overhead_1b_b16.json"]),
        Step("overhead_2r", [PY, bench("overhead.py"), *oh, "--nproc", "2", *mid, "--json", str(out / "overhead_2r.json")],
             120, ["overhead_2r.json"]),
        # the worst case for the doctor's hooks: the launch-bound tiny GPT of kernels.launch_bound's row, one rank, a
        # ~30 ms step all host (1.080 on the H200, 2026-11-30: the goal is not met there), with the settings that
        # say where it goes: the memory probe off, the profiler window off, both (the timing hooks alone)
        Step("overhead_tiny", [PY, bench("overhead.py"), "--device", device, "--blocks", "8" if dry else "32",
                               "--block-steps", "7" if dry else "25", "--skip", "3", "--nproc", "1", *TINY_GPT,
                               "--arms", json.dumps(TINY_ARMS), "--json", str(out / "overhead_tiny.json")], 120,
             ["overhead_tiny.json"]),
    ]
    for tag, extra in (("1r", ["--nproc", "1"]), ("2r", ["--nproc", "2"]),
                       ("2r_offload", ["--nproc", "2"] + ([] if dry else ["--cpu-offload"]))):
        todo.append(Step(f"allocator_{tag}", [PY, bench("memory_vs_allocator.py"), "--device", device, *extra,
                                              "--steps", "6" if dry else "10", *mid,
                                              "--json", str(out / f"allocator_{tag}.json")], 90,
                         [f"allocator_{tag}.json"]))
    # what removes memory.alloc_retries' retries: its GPU row under caps of 1.1-1.6 times its peak, with the
    # allocator's defaults and with expandable segments (the fix left 4 of 6 retries on the H200)
    todo.append(Step("alloc_retries_probe", [PY, bench("alloc_retries_probe.py"), "--device", device,
                                             *(["--caps", "1.1"] if dry else []),
                                             "--json", str(out / "alloc_retries_probe.json")], 150,
                     ["alloc_retries_probe.json"]))
    # categories at every matched point against torch's FSDPMemTracker (its output is the step's log)
    todo.append(Step("memtracker", [PY, bench("memory_vs_memtracker.py"), "--device", device, "--models",
                                    "gpt,llama512", "--steps", "3"], 120))
    demo = [PY, "-m", "fsdp_doctor.cli", "demo", "--device", device, "--nproc", "2", "--steps", str(steps),
            "--overwrite", *mid] + (["--async-unshard"] if dry else [])  # gloo blocks without it; NCCL never does
    todo.append(Step("fixture", [*demo, "--out", str(out / "fixture")], 150, ["fixture/report.json"]))
    # the cases the GPU rows do not rerun (the rows' rechecks are the other fixes' predicted vs measured)
    todo.append(Step("predictions", [PY, bench("predictions.py"), "--device", device, "--steps", str(steps),
                                     "--reps", "1", "--only", "loader,zero2_tight",
                                     "--json", str(out / "predictions.json")], 150,
                     ["predictions.json"]))
    # in order of value for a short call: what the fixtures and the README's figures need first
    first = ("env", "probe_costs", "scenarios_gpu", "fixture", "overhead_1b", "overhead_1b_b16", "tests")
    return sorted(todo, key=lambda s: first.index(s.name) if s.name in first else len(first))


def only_steps(steps: list[Step], only: str) -> list[Step]:
    """The steps ``--only`` names: a name that is a step's selects that step alone (overhead_1b, not
    overhead_1b_b16), any other the steps it begins (scenarios: scenarios_gpu; allocator: every allocator_*)."""
    keep = [p.strip() for p in only.split(",") if p.strip()]
    names = {s.name for s in steps}
    return [s for s in steps if any(s.name == k or (k not in names and s.name.startswith(k)) for k in keep)]


def write_env(path: Path) -> None:
    import torch

    facts = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
             "cuda_available": torch.cuda.is_available(), "device_count": torch.cuda.device_count()}
    if torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name(0)
        facts["capability"] = list(torch.cuda.get_device_capability(0))
        facts["memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
        try:
            facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as e:  # noqa: BLE001
            facts["nccl"] = f"unknown ({e})"
    try:
        facts["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                              "--format=csv,noheader"], capture_output=True, text=True,
                                             timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        facts["nvidia_smi"] = f"unavailable ({e})"
    path.write_text(json.dumps(facts, indent=1))


def _run(out: Path, d: Path) -> dict:
    """A recorded run's folder (relative to ``out``) with its sizes."""
    files = [f for f in d.rglob("*") if f.is_file()]
    trace = sum(f.stat().st_size for f in files if "profiler" in f.relative_to(d).parts)
    return dict(path=str(d.relative_to(out)), bytes=sum(f.stat().st_size for f in files), profiler_bytes=trace)


def recorded_runs(out: Path) -> list[dict]:
    """The runs recorded by watch() in the folder (the fixture and each GPU row's before-run; not the fixes' reruns
    nor the capacity probes): the candidates for traces/, with their sizes."""
    manifests = sorted(out.glob("fixture/manifest.json")) + sorted(out.glob("scenarios_gpu/*/manifest.json"))
    return [_run(out, m.parent) for m in manifests if not m.parent.name.endswith(("_fixed", "_probe"))]


def _rechecks(out: Path) -> dict:
    """The campaign's GPU rows' rechecks (scenarios_gpu.json), {} where it has none or cannot be read."""
    try:
        rows = json.loads((out / "scenarios_gpu.json").read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return rows if isinstance(rows, dict) else {}


def wrong_reruns(out: Path) -> list[dict]:
    """The fixes' reruns of the GPU rows whose recheck shows the advice wrong (``ok`` false in scenarios_gpu.json)
    that recorded a run: what a CPU session reads afterwards to see why (kernels.launch_bound's compiled blocks
    measured no faster, and their trace was left on the GPU machine). ``--adopt`` keeps them in
    traces/gpu/rechecks/, apart from the fixtures the tests read."""
    return [_run(out, d) for name, r in sorted(_rechecks(out).items())
            if isinstance(r, dict) and r.get("ok") is False
            and ((d := out / "scenarios_gpu" / f"{name}_fixed") / "manifest.json").exists()]


# where the campaign's recorded runs go in the repository (tests/test_gpu_fixtures.py reads them on the CPU)
FIXTURES = REPO / "traces" / "gpu"
FIXTURE_BUDGET = 24 << 20  # bytes: above this the adoption says so (a clone carries every fixture)


def adopt(out: Path, dest: Path = FIXTURES) -> list[str]:
    """Copies a campaign folder's recorded runs into ``dest`` (traces/gpu/): the 2-rank fixture as ``fixture/``
    (with its report), each GPU row's before-run as ``scenarios/NAME/`` (not the capacity probes, nor the fixes'
    reruns but those whose advice was wrong: ``rechecks/NAME_fixed/``), the rows' rechecks and the machine's facts.
    What the campaign did not record stays as it was: a campaign of some rows (``--rows new``) adds them beside the
    rows recorded earlier, its rechecks merged into scenarios_gpu.json and its table added to scenarios_gpu.md. Returns what it wrote, a line each, sizes in MiB."""
    import shutil
    import tempfile

    o, d = out.resolve(), dest.resolve()
    if o == d or d in o.parents or o in d.parents:
        raise SystemExit(f"{out}: the campaign folder and {dest} overlap: untar the campaign elsewhere")
    lines = []
    runs = recorded_runs(out)
    if not runs:
        raise SystemExit(f"{out}: no recorded run (fixture/ or scenarios_gpu/NAME/ with a manifest.json)")
    # a GPU row is adopted once it finished, its recheck written (the scenarios step writes them every few rows: a
    # step cut off at its limit leaves the rows of its last few recorded, maybe half-way, and unchecked)
    done = _rechecks(out)
    unfinished = [r["path"] for r in runs if r["path"] != "fixture" and Path(r["path"]).name not in done]
    runs = [r for r in runs if r["path"] not in unfinished]
    if unfinished:
        lines.append(f"not adopted, their rows unfinished (no recheck in scenarios_gpu.json): {', '.join(unfinished)}")
    if not runs:
        raise SystemExit(f"{out}: no finished recorded run ({', '.join(unfinished)} have no recheck)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    # copied beside dest (the earlier recordings first), then swapped in: a failure half-way leaves the committed
    # fixtures as they were
    tmp = Path(tempfile.mkdtemp(prefix=".gpu-adopt-", dir=dest.parent))
    try:
        if dest.exists():
            shutil.copytree(dest, tmp, dirs_exist_ok=True)
        total = 0
        for r in runs:
            src = out / r["path"]
            rel = Path("fixture") if r["path"] == "fixture" else Path("scenarios") / src.name
            shutil.rmtree(tmp / rel, ignore_errors=True)
            shutil.copytree(src, tmp / rel)
            total += r["bytes"]
            lines.append(f"{(dest / rel).relative_to(REPO)}: {r['bytes'] / 2**20:.1f} MiB")
        # the reruns whose advice this campaign found wrong, as evidence; a row's earlier one goes once its advice
        # holds (or is wrong again: replaced)
        for name in _rechecks(out):
            shutil.rmtree(tmp / "rechecks" / f"{name}_fixed", ignore_errors=True)
        for r in wrong_reruns(out):
            src = out / r["path"]
            shutil.copytree(src, tmp / "rechecks" / src.name)
            lines.append(f"{(dest / 'rechecks' / src.name).relative_to(REPO)}: {r['bytes'] / 2**20:.1f} MiB "
                         "(the fix's rerun: advice wrong)")
        if (tmp / "rechecks").is_dir() and not any((tmp / "rechecks").iterdir()):
            (tmp / "rechecks").rmdir()
        if (out / "env.json").exists():
            shutil.copy2(out / "env.json", tmp / "env.json")
        _merge_rechecks(out, tmp)
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    kept = sum(1 for _ in dest.glob("scenarios/*/manifest.json")) + (dest / "fixture" / "manifest.json").exists()
    size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    lines.append(f"{len(runs)} runs adopted, {total / 2**20:.1f} MiB; {kept} in {dest.relative_to(REPO)}, "
                 f"{size / 2**20:.1f} MiB in all"
                 + (f" (over {FIXTURE_BUDGET >> 20} MiB: leave out the scenarios whose rule reads no trace, or "
                    "their profiler/ folders)" if size > FIXTURE_BUDGET else ""))
    return lines


def _merge_rechecks(out: Path, into: Path) -> None:
    """The campaign's rows' rechecks into ``into``'s scenarios_gpu.json (a row's replaces its earlier one), and its
    table into scenarios_gpu.md: in place of the earlier table where the campaign ran every row that table had,
    else after it, under a line naming the rows."""
    new = out / "scenarios_gpu.json"
    if not new.exists():
        return
    rows = json.loads(new.read_text() or "{}")
    try:
        before = json.loads((into / "scenarios_gpu.json").read_text())
    except (OSError, ValueError):
        before = {}
    (into / "scenarios_gpu.json").write_text(json.dumps({**before, **rows}, indent=1))
    table = (out / "scenarios_gpu.md").read_text().rstrip() if (out / "scenarios_gpu.md").exists() else ""
    old = (into / "scenarios_gpu.md").read_text().rstrip() if (into / "scenarios_gpu.md").exists() else ""
    if table and (not old or set(before) <= set(rows)):
        (into / "scenarios_gpu.md").write_text(table + "\n")
    elif table:
        (into / "scenarios_gpu.md").write_text(f"{old}\n\nRecorded later ({', '.join(sorted(rows))}):\n\n{table}\n")


PACK_PART = 15 << 20  # bytes per tarball: the device tool returns at most 8 files of 16 MiB from $OUT
PACK_PARTS = 8


def pack(out: Path, dest: Path) -> list[str]:
    """The campaign folder as tarballs the device tool can return: ``campaign-results.tgz`` (summaries, figures,
    logs: everything but the run directories) and ``campaign-runs-N.tgz``, the recorded runs that ``--adopt``
    takes (the fixture, the GPU rows' before-runs, then the reruns of the fixes whose advice was wrong; the other
    reruns and the probes are left: their rechecks are in scenarios_gpu.json), each under 15 MiB, at most 7. Runs
    that do not fit are listed in ``packed.json``. Untar every part into one folder here. Returns a line per tarball."""
    import tarfile

    dest.mkdir(parents=True, exist_ok=True)
    runs = recorded_runs(out)
    extra = wrong_reruns(out)
    wrong = {r["path"] for r in extra}
    runs += extra

    def in_run(f: Path) -> bool:  # inside a run directory (any: the fixes' reruns and probes too)
        dirs = [out / q for q in f.relative_to(out).parents if q != Path(".")]
        return any((d / "manifest.json").exists() or d.name.endswith(("_fixed", "_probe")) for d in dirs)

    small = [f for f in sorted(out.rglob("*")) if f.is_file() and not in_run(f) and f.name != "packed.json"]
    parts: list[list[dict]] = []
    left = []
    # the fixture first, then the before-runs, then the wrong advice's reruns; small first within each
    for r in sorted(runs, key=lambda r: (r["path"] != "fixture", r["path"] in wrong, r["bytes"])):
        fit = next((p for p in parts if sum(x["bytes"] for x in p) + r["bytes"] <= PACK_PART), None)
        if fit is None and len(parts) < PACK_PARTS - 1 and r["bytes"] <= PACK_PART:
            parts.append(fit := [])
        (fit.append(r) if fit is not None else left.append(r["path"]))
    (out / "packed.json").write_text(json.dumps({"parts": [[r["path"] for r in p] for p in parts],
                                                 "left_out": left}, indent=1))
    lines = []
    with tarfile.open(dest / "campaign-results.tgz", "w:gz") as tar:
        for f in small + [out / "packed.json"]:
            tar.add(f, arcname=str(f.relative_to(out)))
    lines.append(f"campaign-results.tgz: {(dest / 'campaign-results.tgz').stat().st_size / 2**20:.1f} MiB")
    for i, part in enumerate(parts, 1):
        name = f"campaign-runs-{i}.tgz"
        with tarfile.open(dest / name, "w:gz") as tar:
            for r in part:
                tar.add(out / r["path"], arcname=r["path"])
        lines.append(f"{name}: {len(part)} runs, {(dest / name).stat().st_size / 2**20:.1f} MiB")
    if left:
        lines.append(f"left out (over {PACK_PART >> 20} MiB or no part left): {', '.join(left)}")
    return lines


def merged(previous: list[dict], results: list[dict]) -> list[dict]:
    """The steps of earlier calls into the same folder (its summary.json) with this call's: a step run now replaces
    its earlier result, except a skip (budget) over an earlier run. A GPU session may split the campaign over
    several device calls with ``--only``; summary.md then shows every step."""
    now = {r["name"]: r for r in results}
    keep = [p for p in previous if p["name"] not in now or now[p["name"]]["status"].startswith("skipped")]
    kept = {p["name"] for p in keep}
    return keep + [r for r in results if not (r["name"] in kept and r["status"].startswith("skipped"))]


def previous_steps(out: Path) -> list[dict]:
    try:
        return list(json.loads((out / "summary.json").read_text()).get("steps") or [])
    except (OSError, ValueError, AttributeError):
        return []


def summarize(out: Path, results: list[dict]) -> None:
    summary = {"steps": results, "runs": recorded_runs(out)}
    if (out / "scenarios_gpu.json").exists():
        try:
            summary["scenarios_gpu"] = json.loads((out / "scenarios_gpu.json").read_text())
        except ValueError:
            summary["scenarios_gpu"] = "unreadable"
    for name in ("env", "probe_costs", "overhead_1b", "overhead_1b_b16", "overhead_2r", "allocator_1r", "allocator_2r", "allocator_2r_offload",
                 "predictions"):
        path = out / f"{name}.json"
        if path.exists():
            try:
                summary[name] = json.loads(path.read_text())
            except ValueError:
                summary[name] = "unreadable"
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    lines = ["# GPU campaign", ""]
    env = summary.get("env") or {}
    lines.append(f"Machine: {env.get('gpu', 'no GPU')}, torch {env.get('torch')}, CUDA {env.get('cuda')}, "
                 f"NCCL {env.get('nccl')}; {env.get('nvidia_smi', '')}")
    lines += ["", "| step | status | seconds |", "|---|---|---|"]
    lines += [f"| {r['name']} | {r['status']} | {r['seconds']:.0f} |" for r in results]
    costs = summary.get("probe_costs")
    if isinstance(costs, dict) and costs.get("us_per_call"):
        lines.append("\nCUDA calls, us a call: " + "; ".join(f"{k} {v:.1f}" for k, v in costs["us_per_call"].items()))
    for key in ("overhead_1b", "overhead_1b_b16", "overhead_2r"):
        o = summary.get(key)
        if isinstance(o, dict):
            lines.append(f"\n{key}: {o['params'] / 1e9:.2f}e9 params, {o['nproc']} rank(s): median step "
                         f"{o['median_step_ms']['off']:.1f} ms off, {o['median_step_ms']['on']:.1f} ms on, "
                         f"ratio {o['ratio']:.4f} (block pairs {o['pair_ratio']['min']:.3f}..{o['pair_ratio']['max']:.3f})")
    for key in ("allocator_1r", "allocator_2r", "allocator_2r_offload"):
        a = summary.get(key)
        if isinstance(a, dict) and a.get("summary"):
            s = a["summary"]
            r = s.get("ratio") or {}
            lines.append(f"\n{key}: doctor/allocator peak min {r.get('min', float('nan')):.4f} median "
                         f"{r.get('median', float('nan')):.4f} max {r.get('max', float('nan')):.4f}; within 1%: "
                         f"{s['within_1pct']}; breakdown adds up: {s['breakdown_adds_up']}")
    if summary["runs"]:
        lines += ["", "Recorded runs (fixtures for traces/; profiler traces apart):", ""]
        lines += [f"- {r['path']}: {r['bytes'] / 2**20:.1f} MiB ({r['profiler_bytes'] / 2**20:.1f} MiB of profiler "
                  f"trace)" for r in summary["runs"]]
    if (out / "scenarios_gpu.md").exists():  # the GPU rows' finding-by-scenario table, as benchmarks/scenarios.py printed it
        lines += ["", "## Scenario matrix, GPU rows (fix applied and rechecked)", "",
                  (out / "scenarios_gpu.md").read_text().rstrip()]
        rows = summary.get("scenarios_gpu")
        if isinstance(rows, dict):
            lines += [""] + [f"- {n}: {'ok' if r['ok'] else '; '.join(r['problems'])}" for n, r in rows.items()]
    (out / "summary.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--dry-run", action="store_true", help="run every step on CPU with tiny shapes (plumbing)")
    ap.add_argument("--budget-s", type=float, default=480, help="skip steps that would end after this (default 8 min)")
    ap.add_argument("--steps", type=int, default=10, help="training steps of the fixture and prediction runs")
    ap.add_argument("--only", default="", help="comma-separated step names (prefixes), e.g. env,overhead,allocator")
    ap.add_argument("--rows", default="all", type=_rows_arg,
                    help="the scenarios step's GPU rows: all, new (those traces/gpu/ has not recorded yet), or row "
                         "names, comma-separated (new among them: those too)")
    ap.add_argument("--list", action="store_true", help="print the steps and exit")
    ap.add_argument("--adopt", action="store_true",
                    help="copy the recorded runs of the --out folder (a finished campaign) into traces/gpu/")
    ap.add_argument("--pack", type=Path, metavar="DIR",
                    help="write the --out folder as tarballs the device tool returns (under 15 MiB each) into DIR")
    ap.add_argument("--env", type=Path, help=argparse.SUPPRESS)  # internal: the env step
    a = ap.parse_args()
    if a.env:
        write_env(a.env)
        return 0
    if a.out is None:
        ap.error("--out is required")
    if a.adopt:
        print("\n".join(adopt(a.out)))
        return 0
    if a.pack:
        print("\n".join(pack(a.out, a.pack)))
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    steps = plan(a.out, a.dry_run, a.steps, a.rows)
    if a.only:
        steps = only_steps(steps, a.only)
    if a.list:
        for s in steps:
            print(f"{s.name:28} ≤{s.timeout_s:>4} s  {shlex.join(s.argv)}")
        return 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "KINETO_LOG_LEVEL": "6"}
    t0 = time.monotonic()
    results: list[dict] = []
    before = previous_steps(a.out)  # an earlier call's steps into this folder stay in the summary
    for i, s in enumerate(steps, 1):
        elapsed = time.monotonic() - t0
        left = a.budget_s - elapsed
        if left < 15:
            results.append(dict(name=s.name, status="skipped (budget)", seconds=0.0))
            print(f"[{elapsed:5.0f} s] {i}/{len(steps)} {s.name}: skipped, the budget is spent", flush=True)
            continue
        limit = int(min(s.timeout_s, left))
        print(f"[{elapsed:5.0f} s] {i}/{len(steps)} {s.name} (≤{limit} s) ...", flush=True)
        ts = time.monotonic()
        with open(a.out / f"{s.name}.log", "w") as log:
            # its own process group: a step that overruns is killed with every rank it launched, which would
            # otherwise keep the GPU busy under the next steps' timings
            proc = subprocess.Popen(s.argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env={**env, **s.env},
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=limit)
                status = "ok" if rc == 0 else f"exit {rc}"
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                status = f"timed out after {limit} s"
        missing = [o for o in s.outputs if not (a.out / o).exists()]
        if missing and status == "ok":
            status = f"ok but missing {', '.join(missing)}"
        results.append(dict(name=s.name, status=status, seconds=time.monotonic() - ts))
        print(f"[{time.monotonic() - t0:5.0f} s]   {status}", flush=True)
        summarize(a.out, merged(before, results))
    summarize(a.out, merged(before, results))
    print(f"\ncampaign done in {time.monotonic() - t0:.0f} s: {a.out / 'summary.md'}")
    print((a.out / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
