"""Shared fixtures: one recorded multi-rank run serves many tests (real FSDP2 on gloo, recorded once)."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("FSDP_DOCTOR_SHARED") or REPO.parent / "shared")  # a git worktree elsewhere: set it
HTA_TRACES = SHARED / "reference_traces" / "hta"
SAMPLE_RUN = REPO / "traces" / "sample"

os.environ.setdefault("OMP_NUM_THREADS", "1")

#: what the fork server of the CPU ranks imports once (fsdp_doctor.workloads.launch.forkserver_preload): the main
#: module and the workload's ranks', the rank scripts' own imports (recorder_cases imports clients; torchtitan's
#: ranks fork from a server of their own, tests/titan_zygote.py), the Hugging Face models', and test_clients
#: (``_run_script``). Set before the first launch of the session starts the server, whichever launcher that is
FORKSERVER_PRELOAD = ("__main__", "fsdp_doctor.workloads.launch", "recorder_cases",
                      "transformers.models.llama.modeling_llama", "accelerate", "test_clients")


def pytest_configure(config):
    import multiprocessing

    multiprocessing.set_forkserver_preload(list(FORKSERVER_PRELOAD))


#: the long tier (marker ``long``: ``make test-long``, which CI runs after ``make test``): the tests that read the
#: scenario matrix (its 120 rows' runs and fix reruns), torchtitan's (its llama3 under parallelize_llama, its
#: Trainer under torchrun), the Hugging Face Trainer's and accelerate's plugin runs, the browser's, and the other
#: planted problems whose fix is pasted and rerun in a second real run (these files, and single tests marked
#: ``long`` where they are). They took 707 of the suite's 1,394 s on a slow host of this 2-core kind (2026-12-02),
#: which ran it in 23 min: ``make test`` keeps the rest under the 15 minutes it is given. Marked here, where a new
#: test that reads one of these fixtures joins the tier by itself (the matrix runs only for the rows its selected
#: tests read: none under ``make test``). On 2026-12-06 a host twice as slow again ran ``make test`` in 21-23 min:
#: the quick tier's runs of 10 s or more there, each a real model trained and read (a file of them below, or one
#: marked where it is), joined the tier, about 510 s of its 1,277; the quick tier keeps a real multi-rank run of each
#: way in, the memory reconciliation, training bit-identical, the refusals and a killed run
LONG_FIXTURES = frozenset({"matrix", "trainer_run", "trainer_fixes_run", "accelerate_fixes_run",
                           "clients"})  # (test_clients.py: a transformer, compiled blocks, a titan llama, trained once)
LONG_FILES = frozenset({"test_titan.py", "test_titan_trainer.py", "test_untrained_params.py",
                        "test_wrap_root_sequential.py", "test_wrap_mixed_policies.py",
                        # (2026-12-06: each a few real runs of 10-30 s on a slow host)
                        "test_never_updated.py", "test_wrap_small_leftovers.py", "test_mesh_subsets.py",
                        "test_wrap_nested_blocks.py", "test_late_freed_buffers.py",
                        "test_wrap_forwardless_container.py",
                        "test_outside_unit_call.py", "test_compile_steps.py", "test_backward_gather_wait.py",
                        "test_unshard_in_backward.py", "test_checkpoint_detection.py",
                        "test_trl.py",  # (2 real runs of TRL's SFTTrainer)
                        "test_olmo.py"})  # (3 cases of OLMo-core's Trainer, each run twice)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if (item.get_closest_marker("browser") is not None or item.path.name in LONG_FILES
                or LONG_FIXTURES.intersection(getattr(item, "fixturenames", ()))):
            item.add_marker(pytest.mark.long)


def assert_gc_fixed(f, before, after, after_dir=None) -> None:
    """jitter.gc's finding ``f`` of the report ``before`` gone from ``after``, its run with the fix pasted: the rule
    quiet, the GC's share of the finding's rank under the rule's threshold but for the fix's own collections (with
    the collector off), its mean step down by at least half the predicted gain. ``after_dir``: the fixed run's
    records, where its rank collected with the collector off exactly in the steps after every N-th, N the fix's
    period (a hook collecting after the doctor's step ended is counted in the next; none where the run is shorter)."""
    from fsdp_doctor import load_run
    from fsdp_doctor.diagnose.rules.jitter import GC_SHARE_MIN

    s = next(s for s in after.rules if s.code == "jitter.gc")
    assert s.status == "quiet", (s.status, s.reason)
    st = {n: r.steps.per_rank[str(f.ranks[0])] for n, r in (("before", before), ("after", after))}
    by_hand = st["after"].gc_disabled_ms_total or 0.0  # (UNSET: none)
    assert st["after"].gc_ms_total - by_hand < GC_SHARE_MIN * st["after"].wall_ms_total, st["after"]
    if after_dir is not None:
        every, steps = f.evidence["collect_every_steps"], load_run(after_dir).ranks[f.ranks[0]].steps
        assert [s.step for s in steps if s.gc_disabled_count] == list(range(every, len(steps), every)), every
    p = f.predicted
    gained = (p.step_ms_before if p.step_mean else st["before"].mean_ms) - st["after"].mean_ms
    assert gained >= 0.5 * (p.step_ms_before - p.step_ms_after), (gained, p, st)


def child_pythonpath(*first: str | Path) -> str:
    """PYTHONPATH for a child process of this interpreter: ``first`` (this tree), then the caller's own
    PYTHONPATH, kept: on the GPU machine the dependencies are there (``--target /tmp/site``, no .venv), and a
    child given only the tree cannot import msgspec (the Python 3.12 / torch 2.11 rehearsal found it)."""
    return os.pathsep.join([str(p) for p in first] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


#: the head of a one-rank script (gloo, CPU): the imports most cases use, the process group, a seed; the case's own
#: code follows it (``run_one_rank``), its run directory ``sys.argv[1]``
ONE_RANK = """\
import json, os, sys, time
import torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.fsdp import fully_shard
import fsdp_doctor
from fsdp_doctor.workloads import free_port

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
dist.init_process_group("gloo", rank=0, world_size=1)
torch.manual_seed(0)
"""


def run_one_rank(tmp_path: Path, body: str) -> tuple[Path, str]:
    """Runs ``ONE_RANK`` + ``body`` (dedented) in a fresh process, its run directory ``tmp_path / "run"``; returns
    (that directory, what it printed)."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "case.py"
    script.write_text(ONE_RANK + textwrap.dedent(body) + "\ndist.destroy_process_group()\n")
    env = {**os.environ, "PYTHONPATH": child_pythonpath(REPO), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], check=True, env=env, timeout=300,
                         capture_output=True, text=True).stdout
    return tmp_path / "run", out


#: a tiny language model for a case script's head (``Net``: an embedding, 3 encoder layers in ``blocks``, a head; the
#: vocabulary ``V``): the shape users shard, a unit per block and the root
TINY_LM = """\
import torch.nn as nn

V, D = 128, 32


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(D, 2, 2 * D, batch_first=True, dropout=0.0)
                                    for _ in range(3))
        self.head = nn.Linear(D, V)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)
"""


#: the tail of a two-rank script (``record_two_ranks``): its ``worker(rank, port, out, fix)`` spawned on 2 ranks, the
#: run directory ``sys.argv[1]``, a fix file for the worker to execute ``sys.argv[2]`` ("" for none)
TWO_RANKS = """
def _worker_then_exit(*args):
    # the rank's work done and recorded: skip the interpreter's teardown, where gloo's threads abort now and then
    # ("terminate called without an active exception", SIGABRT after the run was written: a fresh clone's suite)
    import os
    import sys
    worker(*args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    import sys
    import torch.multiprocessing as mp
    from fsdp_doctor.workloads import free_port
    mp.spawn(_worker_then_exit, args=(free_port(), sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else ""), nprocs=2)
"""


#: ``shard(model, fix)`` for a TWO_RANKS script: the printed plan (the file ``fix``) executed in place of the script's
#: ``fully_shard(model)``, as a user pastes it; that call where there is none (the script imports fully_shard)
SHARD_OR_FIX = textwrap.dedent(
    """
    def shard(model, fix):
        if fix:  # in place of the fully_shard call, as printed
            exec(open(fix).read(), {"model": model})
        else:
            fully_shard(model)
    """
)


#: ``gloo_worker`` body parts for a tiny Hugging Face Llava (a CLIP vision tower of 4 layers at 64x64, patch 8, and a
#: Llama of 4 layers; 1.85 M parameters): TINY_LLAVA builds ``model``; LLAVA_LOOP trains it 6 steps on 64 image and 64
#: text tokens, watched into ``out`` (no profiler window), each rank's losses to ``{out}.losses{rank}.json``
TINY_LLAVA = textwrap.dedent(
    """
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration
    vision = CLIPVisionConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                              image_size=64, patch_size=8)
    text = LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=2048, tie_word_embeddings=False)
    model = LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text, image_token_index=2000))
    model.config.use_cache = False
    """
)
LLAVA_LOOP = textwrap.dedent(
    """
    import json
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1 + rank)
    losses = []
    with fsdp_doctor.watch(model, opt, out_dir=out, profile=False) as doc:
        for _ in range(6):
            ids = torch.cat([torch.full((2, 64), 2000), torch.randint(0, 1900, (2, 64), generator=g)], 1)
            labels = ids.clone()
            labels[:, :64] = -100
            loss = model(input_ids=ids, pixel_values=torch.randn(2, 3, 64, 64, generator=g), labels=labels).loss
            loss.backward()
            opt.step(), opt.zero_grad(), doc.step()
            losses.append(loss.item())
    with open(f"{out}.losses{rank}.json", "w") as fh:
        json.dump(losses, fh)
    dist.destroy_process_group()
    """
)


def gloo_worker(body: str) -> str:
    """``worker(rank, port, out, fix)`` for ``TWO_RANKS``: the rank joins a 2-rank gloo group on one thread, seeded,
    then runs ``body`` (dedented; ``fsdp_doctor`` imported). The script imports os, torch and torch.distributed as
    dist."""
    return ("\ndef worker(rank, port, out, fix):\n"
            "    os.environ.update(MASTER_ADDR=\"127.0.0.1\", MASTER_PORT=str(port))\n"
            "    torch.set_num_threads(1)\n"
            "    dist.init_process_group(\"gloo\", rank=rank, world_size=2)\n"
            "    import fsdp_doctor\n"
            "    torch.manual_seed(0)\n" + textwrap.indent(textwrap.dedent(body), "    "))


def record_two_ranks(tmp_path: Path, script: str, name: str, fix: str = ""):
    """Runs ``script`` + ``TWO_RANKS`` in a fresh process into ``tmp_path / name`` (``fix``: the path of a fix file);
    returns the run's Report."""
    import subprocess
    import sys

    import fsdp_doctor

    path = tmp_path / "two_ranks.py"
    path.write_text(script + TWO_RANKS)
    env = {**os.environ, "PYTHONPATH": child_pythonpath(REPO), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(path), str(tmp_path / name), *([fix] if fix else [])], env=env,
                       timeout=300, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return fsdp_doctor.build_report(fsdp_doctor.load_run(tmp_path / name))


def record(out_dir: Path, nproc: int = 2, watch_extra: dict | None = None, **knobs):
    """Runs the reference workload with the doctor attached; returns (losses per rank, Run)."""
    from fsdp_doctor import load_run
    from fsdp_doctor.workloads import WorkloadConfig, launch

    cfg = WorkloadConfig(**knobs)
    watch_kwargs = {"out_dir": str(out_dir), "tokens_per_step": cfg.tokens_per_step(nproc)}
    watch_kwargs.update(watch_extra or {})
    losses = launch(cfg, nproc=nproc, watch_kwargs=watch_kwargs)
    return losses, load_run(out_dir)


def async_gather_slack(run) -> int:
    """Bytes a measured peak of an asynchronous-unshard gloo run may hold or not beyond a prediction: one unit's
    gathered parameters. The high-water between marks (record/memory/transients.py) sees gloo's asynchronous
    all-gather buffers appear by the unshard thread's timing, so a peak may or may not hold one unit's (seen:
    exact on one run, +263,168 B on another, the reference GPT's largest unit)."""
    return max(u.unsharded_bytes or 0 for rd in run.ranks.values() for u in rd.config.units)


@pytest.fixture(scope="session")
def recorded_run(tmp_path_factory):
    """A 2-rank run of the default workload, 16 steps, async unshard on, one profiler window (steps 6-7).

    Returns ``(run, losses, cfg_knobs)``. Treat it as read-only: many tests share it.
    """
    knobs = dict(steps=16, async_unshard=True)
    losses, run = record_again(tmp_path_factory.mktemp("recorded_run"), knobs)
    return run, losses, knobs


def record_again(out: Path, knobs: dict):
    """(losses, run) of ``recorded_run``'s workload, recorded in ``out``."""
    from fsdp_doctor import ProfileSchedule

    return record(out, watch_extra={"profile": ProfileSchedule(first=6, active=2, warmup=1, every=0)}, **knobs)


@pytest.fixture(scope="session")
def sample_run_path():
    if not (SAMPLE_RUN / "manifest.json").exists():
        pytest.skip("traces/sample is missing")
    return SAMPLE_RUN


@pytest.fixture(scope="session")
def matrix(request, tmp_path_factory):
    """The scenario matrix (tests/scenario_matrix.py), run once per session: only the rows the selected tests
    read (a test's ``row`` parameter or its ``@pytest.mark.rows(...)``), before-runs in one launch, fixes in a
    second. {row name: Outcome}."""
    import scenario_matrix as M

    wanted: set[str] = set()
    for item in request.session.items:
        cs = getattr(item, "callspec", None)
        if cs is not None and cs.params.get("row") in M.BY_NAME:
            wanted.add(cs.params["row"])
        for mark in item.iter_markers("rows"):
            wanted.update(mark.args)
    return M.run_matrix(tmp_path_factory.mktemp("matrix"), [r for r in M.ROWS if r.name in wanted])


@pytest.fixture
def gloo_one_rank():
    """A one-rank gloo process group in this process (FSDP2 on one CPU rank), destroyed after the test; skipped
    where one is initialised already."""
    import os

    import torch.distributed as dist

    from fsdp_doctor.workloads import free_port

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()



#: a one-rank script's model (after ``ONE_RANK``): three MLP blocks in ``model.layers`` and a head, unsharded
BLOCKS_NET = """
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(64, 8)

    def forward(self, x):
        for b in self.layers:
            x = b(x)
        return self.head(x)

model = Net()
"""

def pasted_fix_script(user_code: str, shape: str) -> str:
    """A 2-rank script (``record_two_ranks``): ``BLOCKS_NET``'s model checkpointed and sharded by ``user_code``'s
    ``checkpoint_and_shard(model, shape, mesh, before_shard)``, the fix (its file, and where it goes in the file
    beside it, ``<fix>.where``) pasted where its Recommendation.where says, trained 4 steps under watch() with an
    8 GiB budget; each rank's losses written beside the run (``<out>.losses<rank>``, JSON)."""
    return textwrap.dedent(
        f"""
        import json
        import os

        import torch
        import torch.distributed as dist
        import torch.nn as nn
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        SHAPE = {shape!r}
        """
    ) + BLOCKS_NET + user_code + textwrap.dedent(
        """

        def worker(rank, port, out, fix):
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            torch.set_num_threads(1)
            dist.init_process_group("gloo", rank=rank, world_size=2)
            import fsdp_doctor
            torch.manual_seed(0)
            code, where = (open(fix).read(), open(fix + ".where").read()) if fix else ("", "")
            assert where in ("", "before_shard", "sharded"), where
            model = Net()
            paste = lambda: exec(code, {"model": model})
            checkpoint_and_shard(model, SHAPE, init_device_mesh("cpu", (2,)),
                                 paste if where == "before_shard" else lambda: None)
            if where == "sharded":  # after the fully_shard calls
                paste()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            g = torch.Generator().manual_seed(rank)
            losses = []
            with fsdp_doctor.watch(model, opt, out_dir=out, profile=False, memory={"full_every": 1},
                                   capacity_bytes=8 << 30) as doctor:
                for _ in range(4):
                    loss = model(torch.randn(32, 64, generator=g)).sum()
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    doctor.step()
                    losses.append(loss.item())
            with open(f"{out}.losses{rank}", "w") as f:
                json.dump(losses, f)
            dist.destroy_process_group()
        """
    )


#: ``BLOCKS_NET`` sharded, each block a unit, and trained 6 steps; ``AC``: each block checkpointed as accelerate's
#: FSDP2 plugin does it (the block in a checkpoint_wrapper, the block inside sharded, then the wrapper, which holds no
#: parameters of its own: units "layers.0" and "layers.0._checkpoint_wrapped_module")
_CHECKPOINT_WRAPPED = BLOCKS_NET + """
for i, b in enumerate(model.layers):
    if AC:
        model.layers[i] = w = checkpoint_wrapper(b)
        fully_shard(b)
        fully_shard(w)
    else:
        fully_shard(b)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters())
with fsdp_doctor.watch(model, opt, out_dir=sys.argv[1], profile=False) as doctor:
    for step in range(6):
        model(torch.randn(32, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
        doctor.step()
"""


@pytest.fixture(scope="session")
def checkpoint_wrapped_pair(tmp_path_factory):
    """(A, B): the run directories of ``_CHECKPOINT_WRAPPED`` without checkpointing and with each block checkpointed
    as accelerate's FSDP2 plugin does it (a new-user trial's runs/cap3 and runs/fix_ac)."""
    return tuple(run_one_rank(tmp_path_factory.mktemp(side), f"AC = {ac}\n" + _CHECKPOINT_WRAPPED)[0]
                 for side, ac in (("plain", False), ("wrapped", True)))
