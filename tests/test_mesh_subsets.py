"""Device meshes that leave ranks of the world out, or cut a 1-D mesh from a 2-D one (a new-user trial's
``subgroup.py``, 4 gloo ranks): watch() where only some ranks train, fixes that keep the user's mesh, and the
finding on FSDP groups that never combine."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO, child_pythonpath

#: 3 gloo ranks: ranks 1 and 2 train on ``DeviceMesh.from_group(new_group([1, 2]))`` under watch(); rank 0 goes
#: straight to the barrier. Each rank prints its losses; a doctor that gathers over the default group hangs there
#: (the process group's timeout, 60 s, turns the hang into an error)
#: what both scripts start with: their imports, a gloo rank of ``world`` (the process group's timeout 60 s), the
#: model (an embedding, ``blocks`` nn.Sequential(Linear, ReLU, Linear) blocks, a head), and their spawn
_HEAD = textwrap.dedent(
    """
    import datetime, json, os, sys
    import torch, torch.distributed as dist, torch.nn as nn
    import torch.multiprocessing as mp
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    import fsdp_doctor

    def start(rank, port, world, blocks):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(64, 32), *[nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
                                                     for _ in range(blocks)], nn.Linear(32, 64))

    def spawn(worker, world):
        from fsdp_doctor.workloads import free_port
        mp.spawn(worker, args=(free_port(), sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else ""), nprocs=world)
    """
)

_PART = _HEAD + textwrap.dedent(
    """
    def worker(rank, port, out, watch):
        model = start(rank, port, 3, 1)
        pg = dist.new_group([1, 2])
        if rank in (1, 2):
            mesh = DeviceMesh.from_group(pg, "cpu")
            fully_shard(model[1], mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            g = torch.Generator().manual_seed(rank)
            losses = []
            import contextlib
            ctx = fsdp_doctor.watch(model, opt, out_dir=out, profile=False) if watch == "1" else contextlib.nullcontext()
            with ctx as doc:
                for _ in range(4):
                    t = torch.randint(0, 64, (2, 9), generator=g)
                    loss = nn.functional.cross_entropy(model(t[:, :-1]).flatten(0, 1), t[:, 1:].flatten())
                    loss.backward(); opt.step(); opt.zero_grad(); losses.append(loss.item())
                    if doc:
                        doc.step()
            sys.stdout.write(f"LOSSES {rank} {json.dumps(losses)}\\n")  # (one write: the ranks share the pipe)
            sys.stdout.flush()
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        os._exit(0)

    if __name__ == "__main__":
        spawn(worker, 3)
    """
)


def _losses(stdout: str) -> dict[int, list[float]]:
    import json

    return {int(w[1]): json.loads(w[2]) for w in (ln.split(" ", 2) for ln in stdout.splitlines())
            if w[0] == "LOSSES"}


@pytest.mark.slow
def test_watch_on_ranks_of_a_sub_group_finishes_and_the_run_reads(tmp_path):
    """Ranks 1-2 of 3 watch (their mesh is a group without rank 0): watch() finished (it hung on the default
    group's all_gather_object before, rank 0 waiting in its barrier); the run is theirs, 2 ranks numbered 0-1, with
    a note naming the global ranks; the losses are those of the unwatched run."""
    import fsdp_doctor

    script = tmp_path / "part.py"
    script.write_text(_PART)
    env = {**os.environ, "PYTHONPATH": child_pythonpath(REPO), "OMP_NUM_THREADS": "1"}
    runs = {}
    for watch in ("1", "0"):
        r = subprocess.run([sys.executable, str(script), str(tmp_path / "run"), watch], env=env, timeout=240,
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[watch] = _losses(r.stdout)
    assert runs["1"] == runs["0"] and sorted(runs["1"]) == [1, 2]
    run = fsdp_doctor.load_run(tmp_path / "run" / "ranks1-2")  # (its group's folder)
    assert sorted(run.ranks) == [0, 1] and run.world_size == 2
    report = fsdp_doctor.build_report(run)
    assert not report.problems, report.problems
    assert [u.name for u in report.units] == ["", "1"]
    cfg = run.ranks[1].config
    assert cfg.world_size == 2
    assert ("ranks 1, 2 of the 3 in the process group train the watched model (its device mesh), numbered 0-1 here "
            "in that order") in cfg.measured_notes


#: 4 gloo ranks, a (2, 2) mesh, ``fully_shard(..., mesh=mesh2["shard"])``: two FSDP groups, {0, 1} and {2, 3}, that
#: never combine (the trial's ``VARIANT=two``); a fix file, if given, runs in place of the fully_shard calls with
#: ``mesh`` bound to that same sub-mesh. Each rank prints its parameters' digest (its local shards' sum) and units
_FOUR = _HEAD + textwrap.dedent(
    """
    def worker(rank, port, out, fix):
        model = start(rank, port, 4, 2)
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("grp", "shard"))
        mesh = mesh2["shard"]
        if fix:
            exec(open(fix).read(), {"model": model, "mesh": mesh})
        else:
            for block in model[1:-1]:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(rank)
        with fsdp_doctor.watch(model, opt, out_dir=out, profile=False) as doc:
            for _ in range(3):
                t = torch.randint(0, 64, (2, 9), generator=g)
                nn.functional.cross_entropy(model(t[:, :-1]).flatten(0, 1), t[:, 1:].flatten()).backward()
                opt.step(); opt.zero_grad(); doc.step()
        digest = sum(float(p.to_local().double().sum()) for p in model.parameters())
        units = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
        sys.stdout.write(f"RANK {rank} {json.dumps([digest, units])}\\n")
        sys.stdout.flush()
        dist.barrier()
        dist.destroy_process_group()
        os._exit(0)

    if __name__ == "__main__":
        spawn(worker, 4)
    """
)


def _four(tmp_path, name: str, fix: str = ""):
    """(the run's Report, {rank: (parameter digest, FSDP module names)}) of ``_FOUR`` with the fix code ``fix``."""
    import json

    import fsdp_doctor

    script = tmp_path / "four.py"
    script.write_text(_FOUR)
    args = [sys.executable, str(script), str(tmp_path / name)]
    if fix:
        (tmp_path / f"{name}.fix.py").write_text(fix)
        args.append(str(tmp_path / f"{name}.fix.py"))
    env = {**os.environ, "PYTHONPATH": child_pythonpath(REPO), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(args, env=env, timeout=240, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    got = {int(w[1]): json.loads(w[2]) for w in (ln.split(" ", 2) for ln in r.stdout.splitlines()) if w[0] == "RANK"}
    return fsdp_doctor.build_report(fsdp_doctor.load_run(tmp_path / name)), got


@pytest.mark.slow
@pytest.mark.long  # (the long tier, tests/conftest.py: a fix pasted and rerun in a second real run)
def test_a_one_dim_sub_mesh_gets_uncombined_groups_and_fixes_that_keep_its_mesh(tmp_path):
    """The trial's slip, planted: mesh2["shard"] of a (2, 2) mesh. mesh.uncombined_groups warns with the numbers
    (4 ranks, 2 groups of 2), and its fix (a 2-D mesh, HSDP), pasted, makes the groups' replicas agree (ranks 0 and
    2 hold the same shard: equal parameters after training) and the finding goes. wrap.params_in_root's plan passes
    the user's mesh (it built one over all 4 ranks, with the comment "(HSDP: your 2-D mesh)") and wraps the blocks
    as the run had them (it made a unit of each Linear and ReLU inside the Sequential blocks: 12 units for 6)."""
    report, got = _four(tmp_path, "before")
    (f,) = [f for f in report.findings if f.code == "mesh.uncombined_groups"]
    assert f.severity == "warning"
    assert f.evidence["world size"] == 4 and f.evidence["shard size"] == 2 and f.evidence["groups"] == 2
    assert f.evidence["mesh cut from"] == "grp 2 × shard 2"
    assert got[0][0] != got[2][0]  # the two groups' models drifted apart

    (root,) = [f for f in report.findings if f.code == "wrap.params_in_root"]
    code = root.recommendation.code
    assert "init_device_mesh" not in code and "HSDP: your 2-D mesh" not in code, code
    assert root.recommendation.inputs["mesh"] == "the mesh your fully_shard calls pass: ['shard'] of your grp 2 × shard 2 mesh"
    assert "for block in list(model.children())[1:3]:\n    fully_shard(block, mesh=mesh)" in code, code
    assert ".children():" not in code.replace("list(model.children())", "")  # no block split into its layers

    after, hsdp = _four(tmp_path, "hsdp", f.recommendation.code)
    assert not [f for f in after.findings if f.code == "mesh.uncombined_groups"]
    assert hsdp[0][0] == hsdp[2][0] and hsdp[1][0] == hsdp[3][0]


#: 4 gloo ranks in two FSDP groups, {0, 1} and {2, 3} (``DeviceMesh.from_group`` of each; the trial's ``groups4.py``),
#: both watched into one ``out_dir`` with overwrite, step 2 profiled; global rank 3 sleeps 60 ms before each forward
_GROUPS = _HEAD + textwrap.dedent(
    """
    def worker(rank, port, out, _):
        import time
        model = start(rank, port, 4, 2)
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        mesh = DeviceMesh.from_group(groups[rank // 2], "cpu")
        for block in model[1:-1]:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(rank)
        prof = torch.profiler.schedule(skip_first=1, wait=0, warmup=1, active=1, repeat=1)
        with fsdp_doctor.watch(model, opt, out_dir=out, overwrite=True, profile=prof) as doc:
            for _ in range(6):
                if rank == 3:
                    time.sleep(0.25)  # (0.06 s read "compute" on a loaded host: the input must dominate)
                t = torch.randint(0, 64, (2, 9), generator=g)
                nn.functional.cross_entropy(model(t[:, :-1]).flatten(0, 1), t[:, 1:].flatten()).backward()
                opt.step(); opt.zero_grad(); doc.step()
        dist.barrier()
        dist.destroy_process_group()
        os._exit(0)

    if __name__ == "__main__":
        spawn(worker, 4)
    """
)


@pytest.mark.slow
def test_two_groups_watched_into_one_folder_keep_both_runs_in_one_numbering(tmp_path):
    """The trial's groups4.py: both groups numbered their ranks 0-1 and wrote the same files in out_dir, one group's
    overwrite wiped the other's (a profiler trace lost) and analyze read 2 ranks. Each group's run now lies in a
    folder of its own (ranks0-1, ranks2-3), both whole; analyze of out_dir says it holds 2 runs. The traces, keyed by
    the process group's rank (2, 3), read in the run's numbering (0, 1): the verdict's rows are 0 and 1 (they were
    0, 1, 2, 3: the records' rows and the traces'), global rank 3's sleep (input-bound) in row 1."""
    import fsdp_doctor
    from fsdp_doctor.store.layout import runs_below

    script = tmp_path / "groups.py"
    script.write_text(_GROUPS)
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": child_pythonpath(REPO), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(script), str(out)], env=env, timeout=240, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "was not written" not in r.stderr, r.stderr[-3000:]
    assert [d.name for d in runs_below(out)] == ["ranks0-1", "ranks2-3"]
    for name, ranks in (("ranks0-1", [0, 1]), ("ranks2-3", [2, 3])):
        run = fsdp_doctor.load_run(out / name)
        assert sorted(run.ranks) == [0, 1] and run.config.world_ranks == ranks
        assert len(run.trace_files) == 2, run.trace_files
        report = fsdp_doctor.build_report(run)
        assert not report.overlap.skipped, report.overlap.skipped
        assert sorted(report.overlap.per_rank) == ["0", "1"]
        assert sorted(report.verdict.per_rank) == ["0", "1"]
        assert sorted(report.comm.per_rank) == ["0", "1"]
        (status,) = [s for s in report.rules if s.code == "mesh.uncombined_groups"]
        assert status.status == "quiet" and status.reason == (
            f"the units shard over all 2 ranks that train the watched model (ranks {ranks[0]}, {ranks[1]} of the "
            "process group; the doctor does not see the others)")
        if name == "ranks2-3":  # global rank 3's trace is rank 1's row: its sleep is its input time
            assert report.verdict.per_rank["1"].bound == "input" and report.verdict.per_rank["1"].source == "trace"
            assert report.verdict.per_rank["0"].bound == "communication"
    cli = subprocess.run([sys.executable, "-m", "fsdp_doctor.cli", "analyze", str(out)], env=env, timeout=120,
                         capture_output=True, text=True)
    assert cli.returncode != 0 and "holds 2 runs' records" in cli.stderr, (cli.returncode, cli.stderr)


def test_a_group_s_note_and_folder():
    """A one-rank group's note is singular (a trial's read "ranks 0 of the 3 ... numbered 0-0 here"); the groups'
    folders are named by their ranks."""
    from fsdp_doctor.record.tracker import subset_note
    from fsdp_doctor.store.layout import group_dir

    assert subset_note([0], 3) == ("rank 0 of the 3 in the process group trains the watched model (its device mesh), "
                                   "numbered 0 here")
    assert subset_note([2, 3], 4) == ("ranks 2, 3 of the 4 in the process group train the watched model (its device "
                                      "mesh), numbered 0-1 here in that order")
    assert [group_dir(r) for r in ([2, 3], [1], [0, 2])] == ["ranks2-3", "ranks1-1", "ranks0_2"]
