"""The memory peak reconciles: the high-water between marks (fsdp_doctor.record.memory.transients) and the loss
phase, against FSDPMemTracker and an independent saved-tensor count on the reference GPT and HF Llama (SiLU)
at vocabulary 512 and 8192 (2 gloo ranks, through benchmarks/memory_vs_memtracker.py), plus in-process
known answers of the counter."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode, _len_torch_dispatch_stack

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def _probe(model=None, **opts):
    from fsdp_doctor.record.memory import MemoryProbe

    return MemoryProbe(model if model is not None else nn.Linear(4, 4), None, [], opts or True)


def _nothing_left(probe):
    probe.detach()
    assert _len_torch_dispatch_stack() == 0
    assert torch.UntypedStorage.resize_ is _ORIG_RESIZE
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


_ORIG_RESIZE = torch.UntypedStorage.resize_


def test_a_temporary_between_two_marks_is_the_peak():
    probe = _probe()
    probe.mark(None, "forward_start")
    x = torch.ones(1000, 1000)  # 4,000,000 bytes alive only between the two marks
    x.add_(1)  # in place: no new storage
    del x
    probe.mark(None, "loss_start")
    out = probe.step_end(0)
    assert out.transients == "exact"
    assert out.peak.phase == "in_forward" and out.peak.unit is None
    assert out.peak.breakdown["temporaries"] == 4_000_000
    assert out.peak.bytes == sum(out.peak.breakdown.values())
    cols = out.timeline.columns
    assert [r[cols.index("phase")] for r in out.timeline.rows] == ["forward_start", "in_forward", "loss_start"]
    assert out.end["temporaries"] == 0  # freed by the next mark
    _nothing_left(probe)


def test_a_high_water_after_a_units_end_belongs_to_the_unit_around_it():
    """After the last block's forward_end the step is back in the root's forward (its head and, where the model
    computes it, the loss): a temporary there is the root's, not the block's; after the root's own end, outside
    every unit. A Hugging Face Llama's loss in its forward read "model.layers.1 in_forward" (a new-user trial)."""
    probe = _probe()
    rows = []
    for unit, phase, size in (("", "forward_start", 1000), ("layers.0", "forward_start", 0),
                              ("layers.0", "forward_end", 3000), ("", "forward_end", 2000), (None, "loss_start", 0)):
        probe.mark(unit, phase)
        if size:
            x = torch.ones(size, 250)  # (size * 1000 bytes, freed before the next mark)
            del x
    out = probe.step_end(0)
    cols = out.timeline.columns
    rows = [(r[cols.index("unit")], r[cols.index("phase")], r[cols.index("temporaries")]) for r in out.timeline.rows]
    assert [(u, ph, t) for u, ph, t in rows if ph.startswith("in_")] == [
        ("", "in_forward", 1_000_000), ("", "in_forward", 3_000_000), (None, "in_forward", 2_000_000)], rows
    assert out.peak.unit == "" and out.peak.breakdown["temporaries"] == 3_000_000
    _nothing_left(probe)


def test_alive_at_a_mark_is_temporaries_there_and_saved_is_activations():
    lin = nn.Linear(256, 256)
    probe = _probe(lin)
    probe.mark(None, "forward_start")
    x = torch.randn(64, 256)  # made inside the step: the counter sees it
    h = torch.relu(lin(x))  # relu saves its output (64 KiB); lin saves x (64 KiB); h is alive
    probe.mark(None, "loss_start")
    loss = (h * 2).sum()
    loss.backward()
    probe.mark(None, "backward_end")
    out = probe.step_end(0)
    cols = out.timeline.columns
    rows = {r[cols.index("phase")]: dict(zip(cols, r)) for r in out.timeline.rows}
    assert rows["loss_start"]["activations"] == 2 * 64 * 256 * 4  # x and relu's output
    assert rows["loss_start"]["temporaries"] == 0  # the linear's output died inside relu: nothing else alive
    # after backward x and h are still held here but no longer saved: temporaries, with the 4-byte loss; the
    # gradients of the (unmanaged) weight and bias are sharded_grads, not temporaries
    assert rows["backward_end"]["activations"] == 0
    assert rows["backward_end"]["sharded_grads"] == (256 * 256 + 256) * 4
    assert rows["backward_end"]["temporaries"] == 2 * 64 * 256 * 4 + 4
    del x, h
    _nothing_left(probe)


def test_the_steps_highest_saved_bytes_are_counted_between_marks():
    """What the loss saves lives between two marks (loss_start and backward_end here): the marks never see it;
    ``activations_high`` counts it at the save."""
    lin = nn.Linear(256, 256)
    probe = _probe(lin, transients=False)
    probe.mark(None, "forward_start")
    x = torch.randn(64, 256)
    h = torch.relu(lin(x))  # x and relu's output saved: 2 x 64 KiB
    probe.mark(None, "loss_start")
    loss = torch.log_softmax(h, -1).sum()  # log_softmax saves its output: 64 KiB more, until backward
    loss.backward()
    probe.mark(None, "backward_end")
    out = probe.step_end(0)
    cols = out.timeline.columns
    sampled = [r[cols.index("activations")] for r in out.timeline.rows]
    assert max(sampled) == 2 * 64 * 256 * 4
    assert out.activations_high == 3 * 64 * 256 * 4
    del x, h
    _nothing_left(probe)


def test_storage_resizes_are_counted():
    probe = _probe()
    st = torch.empty(0).untyped_storage()  # made before the step: only its resizes count
    probe.mark(None, "forward_start")
    st.resize_(1 << 20)
    st.resize_(0)
    probe.mark(None, "loss_start")
    out = probe.step_end(0)
    assert out.peak.phase == "in_forward" and out.peak.breakdown["temporaries"] == 1 << 20
    _nothing_left(probe)


def test_steps_aside_under_another_dispatch_mode():
    class Users(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    probe = _probe()
    with Users():
        probe.mark(None, "forward_start")
        torch.ones(10).sum()
        probe.mark(None, "loss_start")
        out = probe.step_end(0)
    assert out.transients == "off" and "TorchDispatchMode" in out.transients_note
    _nothing_left(probe)


def test_steps_aside_for_what_torch_compile_runs_in_the_forward():
    """torch.compile does not trace under the high-water's dispatch mode: it runs the frame eagerly, and a compile
    with fullgraph=True raises ("found no compiled frames"), as flex_attention's own does; the GPU row of a Hugging
    Face model switched to flex_attention died so on the H200. The probe reads the model at each full step and
    stays off, saying why: a compiled function on a module (as torchtitan keeps torch.compile(flex_attention)), a
    model switched to flex_attention after the probe attached; the function runs compiled, its result unchanged."""
    class Sin(nn.Module):
        fn = torch.compile(torch.sin, fullgraph=True, backend="eager")

        def forward(self, x):
            return Sin.fn(x)  # as torchtitan calls FlexAttention.flex_attn

    model = nn.Sequential(nn.Linear(8, 8), Sin())
    x = torch.randn(4, 8)
    want = model(x)
    probe = _probe(model)
    probe.mark(None, "forward_start")
    got = model(x)  # raised RuntimeError with the mode on the stack
    probe.mark(None, "loss_start")
    out = probe.step_end(0)
    assert torch.equal(got, want)
    assert out.transients == "off" and out.transients_note == "compiled functions in the model: not counted"
    _nothing_left(probe)

    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, attn_implementation="sdpa"))
    probe = _probe(llama)
    probe.mark(None, "forward_start")
    probe.mark(None, "loss_start")
    assert probe.step_end(0).transients == "exact"
    llama.set_attn_implementation("flex_attention")  # after the probe attached: read at the next full step
    probe.mark(None, "forward_start")
    probe.mark(None, "loss_start")
    out = probe.step_end(1)
    assert out.transients == "off" and out.transients_note == "flex_attention (compiled by torch): not counted"
    _nothing_left(probe)


def test_higher_order_operators_run_through_the_mode():
    """A higher-order operator (torch.cond here; flex_attention under torch.compile) meets the mode's
    __torch_dispatch__ and runs unchanged, its output counted: without supports_higher_order_operators torch
    raised NotImplementedError for each of them under the mode."""
    probe = _probe()
    x = torch.ones(1000)
    probe.mark(None, "forward_start")
    y = torch.cond(x.sum() > 0, lambda v: v * 2, lambda v: v - 1, (x,))
    probe.mark(None, "loss_start")
    out = probe.step_end(0)
    assert torch.equal(y, x * 2)
    assert out.transients == "exact" and out.peak.breakdown["temporaries"] >= 4000
    del y
    _nothing_left(probe)


def test_option_off():
    probe = _probe(transients=False)
    probe.mark(None, "forward_start")
    x = torch.ones(1000)
    probe.mark(None, "loss_start")
    out = probe.step_end(0)
    assert out.transients == "off" and out.peak.breakdown["temporaries"] == 0
    del x
    _nothing_left(probe)


def test_light_steps_replay_the_high_water():
    probe = _probe(full_every=4)
    outs = []
    for step in range(5):
        probe.mark(None, "forward_start")
        x = torch.ones(1000, 1000)
        del x
        probe.mark(None, "loss_start")
        outs.append(probe.step_end(step))
    assert [o.sampling for o in outs] == ["full", "full", "full", "replayed", "full"]
    assert outs[3].transients == "replayed" and outs[3].peak.phase == "in_forward"
    assert outs[3].peak.bytes == outs[2].peak.bytes
    _nothing_left(probe)


def test_gloos_copy_of_a_reduce_scatter_input_is_left_out(gloo_one_rank):
    """gloo's reduce-scatter all-reduces a copy of its input that gloo allocates off the dispatcher; the wait splits it
    to copy this rank's chunk out, and FSDPMemTracker counts the copy from that split on (Temp). A bf16 run with fp32
    reduce (2 gloo ranks) read the tracker's peak 2-7% above ours: 1,780,884 B against 1,743,476 B (a new-user
    trial), the fp32 copy of blocks.1's reduce-scatter input. NCCL makes no such copy, and the CPU run stands in for a
    device: counted (adopted at the split), the trial's peak met the tracker's within 1,056 B, but the reruns of the
    fixes' predictions broke (accelerate's bf16 reduce fixed to fp32: 72.66 MB measured, 63.38 MB predicted). Here:
    the input (1 MB) and the output (1 MB); gloo's copy (1 MB) is not in the figure."""
    import torch.distributed as dist

    probe = _probe()
    probe.mark(None, "forward_start")
    inp = torch.ones(250_000)
    out = torch.empty(250_000)
    dist.reduce_scatter_tensor(out, inp)  # one rank: the output is the whole input, through gloo's copy all the same
    del inp, out
    probe.mark(None, "loss_start")
    step = probe.step_end(0)
    assert step.peak.phase == "in_forward" and step.peak.breakdown["temporaries"] == 2_000_000
    _nothing_left(probe)


def test_the_unit_in_backward_at_the_peak_is_gathered(tmp_path, gloo_one_rank):
    """The high-water inside a unit's backward took its categories from the unit's backward_start mark, before
    FSDP's pre-backward gathers it: the unit's gathered parameters were read as temporaries (a new-user trial:
    blocks.1 in_backward, unsharded params 129.50 KiB, the root's, where FSDPMemTracker read 324.75 KiB, the root's
    and blocks.1's). The unit's first gradient, after FSDP's pre-backward, now splits that interval. Against
    FSDPMemTracker on the same model: the peak to the byte, the gathered parameters (the root's and block 2's);
    the gradients still being computed are temporaries in both until the unit's post-backward."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import fully_shard

    import fsdp_doctor

    class Block(nn.Module):
        def __init__(self, h):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

        def forward(self, x):
            return x + self.fc2(torch.relu(self.fc1(x)))

    def build():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(64, 64), Block(64), Block(64), nn.Linear(64, 8))
        fully_shard(m[1])
        fully_shard(m[2])
        fully_shard(m)
        return m, torch.optim.SGD(m.parameters(), lr=0.1)

    x = torch.randn(512, 64)

    def step(m, opt):
        m(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    m, opt = build()
    with fsdp_doctor.watch(m, opt, out_dir=tmp_path / "run", profile=False, memory={"full_every": 1}) as doc:
        for _ in range(3):
            step(m, opt)
            doc.step()
    rd = fsdp_doctor.load_run(tmp_path / "run").ranks[0]
    peak = rd.steps[-1].memory.peak
    m, opt = build()
    fmt = FSDPMemTracker(m, opt)
    with fmt:
        for i in range(3):
            fmt.reset_mod_stats()
            if i == 2:
                fmt._peak_mem = {}  # the op-level peak of the last step
            step(m, opt)
    theirs = {str(k).rsplit(".", 1)[-1]: v for k, v in fmt.get_tracker_snapshot("peak")[torch.device("cpu")].items()}
    gathered = {u.name: u.unsharded_bytes for u in rd.config.units}
    assert (peak.unit, peak.phase) == ("2", "in_backward")
    assert peak.bytes == theirs["Total"] == 2_992_744
    assert peak.breakdown["unsharded_params"] == gathered[""] + gathered["2"] == theirs["UNSHARDED_PARAM"] == 151_072
    assert peak.breakdown["unsharded_grads"] == theirs["UNSHARDED_GRAD"] == 0


# ------------------------------------------------------------------------------ 2 ranks against FSDPMemTracker
@pytest.fixture(scope="module")
def reconciled(tmp_path_factory):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import memory_vs_memtracker as bench

    out = bench.measure(bench.MODELS, steps=3, layers=2, root=str(tmp_path_factory.mktemp("vs_tracker")))
    # gloo's worker thread frees a finished collective's buffers when the OS schedules it: under CI's load one run
    # read llama512's peak 184,832 B high (6.156 against the tracker's 5.982 MiB), one layer's all-gather output
    # (46,208 fp32 parameters) still alive in the loss phase; 12 runs here beside 4 busy loops read 0.9997 each
    # time. As the scenario matrix does (scenario_matrix.run_matrix), a model whose peak misses is measured again,
    # once: a wrong peak misses twice.
    again = [n for n, r in out.items() if abs(r["peak"] / r["tracker_peak"] - 1) > PEAK_TOLERANCE]
    if again:
        out.update(bench.measure(again, steps=3, layers=2, root=str(tmp_path_factory.mktemp("vs_tracker_again"))))
    return out


PEAK_TOLERANCE = 0.02


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "llama512", "llama8192"])
def test_peak_reconciles_with_fsdp_mem_tracker(reconciled, name):
    r = reconciled[name]
    assert r["transients"] == "exact"
    assert r["matched"] >= 10 and r["mismatched"] == []  # the categories both tools measure: equal at every point
    assert abs(r["peak"] / r["tracker_peak"] - 1) <= PEAK_TOLERANCE, (r["peak"] / MiB, r["tracker_peak"] / MiB)
    # the step's highest, counted at every save: 1.0000 on all three
    assert abs(r["activations"] / r["saved_high"] - 1) <= 0.002, (r["activations"] / MiB, r["saved_high"] / MiB)
    # the marks and high-water rows sample moments: never above the step's highest. The loss's saved log-softmax
    # lives between two marks and is seen only where the loss's high-water row falls; CI once read the sampled
    # highest 10% under (4.27 of 4.77 MiB on the GPT, not reproduced here in 20 runs): likely two all-gather
    # outputs that gloo's worker thread freed late, inside the loss's window, so that its high-water never rose
    # above the window's start and no row was kept (tests/scenario_matrix.run_matrix: gloo frees late under load)
    assert 0.85 * r["activations"] <= r["activations_sampled"] <= r["activations"]
    assert r["losses_identical"]  # the dispatch mode and the saved-tensor hooks change nothing (SiLU and GELU)
    if name == "gpt":
        # the peak is inside the last block's backward: that block is gathered (its all-gather copied out, the next
        # block's prefetched), as FSDPMemTracker sees it (1.289 MiB, 0.756 MiB); its gradients are temporaries in both
        assert r["peak_at"][1] == "in_backward"
        tb, pb = r["tracker_breakdown"], r["peak_breakdown"]
        assert pb["unsharded_grads"] == tb["Unsharded Grad"]
        # (under the full suite's load the high-water once fell inside FSDP's pre-backward, before the split point
        # where the block is gathered: its 793,088 B read as temporaries there, the total the tracker's)
        block = 793_088
        if pb["unsharded_params"] == tb["Unsharded Param"]:
            assert pb["comm_buffers"] == tb["All Gather"] + tb["Reduce Scatter"]
        else:
            assert pb["unsharded_params"] == tb["Unsharded Param"] - block, (pb, tb)
    if name == "llama8192":
        # the logits' loss and its gradients are the peak at a large vocabulary: the loss phase of its own
        assert r["peak_at"] == (None, "in_loss")
        assert r["peak_breakdown"]["temporaries"] >= 3 * 2 * 64 * 8192 * 4 * 0.99  # logits-sized, three of them


_ASIDE_SCRIPT = """
import os, sys, torch, torch.distributed as dist
from torch.utils._python_dispatch import _len_torch_dispatch_stack
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
import fsdp_doctor
from fsdp_doctor.record.memory import probe as P
from fsdp_doctor.workloads import WorkloadConfig
from fsdp_doctor.workloads.data import batches
from fsdp_doctor.workloads.train import build_training, next_token_loss

resize = torch.UntypedStorage.resize_
calls = [0]
count = P.MemoryProbe._count
def failing(self, *a):  # the probe fails in the middle of step 1's forward
    calls[0] += 1
    if calls[0] == 20:
        raise RuntimeError("injected")
    return count(self, *a)
P.MemoryProbe._count = failing
cfg = WorkloadConfig(n_layers=2, steps=3)
model, opt = build_training(cfg)
inside = []
with fsdp_doctor.watch(model, opt, out_dir=sys.argv[1], profile=False, memory={"full_every": 1}) as doc:
    for _, (x, y) in zip(range(cfg.steps), batches(cfg, 0)):
        loss = next_token_loss(model(x), y)
        inside.append((_len_torch_dispatch_stack(), torch.UntypedStorage.resize_ is resize))
        loss.backward()
        opt.step()
        opt.zero_grad()
        doc.step()
print("RESULT", calls[0] >= 20, doc.active, inside)
"""


@pytest.mark.slow
def test_stepping_aside_mid_step_leaves_no_mode_and_no_wrapper(tmp_path):
    """The probe fails inside a counted step: the doctor steps aside and its dispatch mode and resize_ wrapper
    go with it at once, not at a step end that never comes."""
    import subprocess

    from fsdp_doctor.workloads import free_port

    r = subprocess.run([sys.executable, "-c", _ASIDE_SCRIPT, str(tmp_path), str(free_port())], capture_output=True,
                       text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT")][-1]
    assert line == "RESULT True False [(1, False), (0, True), (0, True)]", line


def test_auto_period_counts_what_a_full_step_costs_in_wall_time():
    """Part of a counted step's cost (entering the dispatch mode for every op) cannot be timed from inside the
    probe: the period of full steps also reads the full steps' wall time against the light ones'."""
    from fsdp_doctor.record.memory.sampler import MAX_EVERY, Sampler

    def period(full_extra_ms: float) -> int:
        s = Sampler("auto", 0.003, False)
        t = 0
        for step in range(40):
            full = s.is_full(step)
            t += int((100 + (full_extra_ms if full else 0)) * 1e6)  # 100 ms steps
            s.step_wall(t)
            if full:
                s.remember([(t, None, "forward_start")], [[0]])
            s.step_cost(step, full, 1_000_000 if full else 1_000, 0)  # the probe timed 1 ms / 1 us
        return s.every

    assert period(0) == 4  # 1 ms per full step within 0.3% of 100 ms: every 4th step
    # full steps 30 ms slower in wall time than the light ones: ~30 ms / (0.3% of ~115 ms) steps apart
    assert 60 <= period(30) <= MAX_EVERY


def test_every_rank_counts_memory_in_full_at_the_same_steps():
    """Each rank sizes its own period from its own costs; a power of two, each full step at its next multiple: a
    longer period's full steps are among a shorter one's, so the steps the statistics leave out are the same on every
    rank. Counted where each rank's period took it, a 16-rank run's ranks left out 1-2 steps each, 10 of 14 steps in
    all: 4 steps common to every rank, under the 5 a straggler is judged on, and its 4 slow ranks went unnamed."""
    from fsdp_doctor.record.memory.sampler import Sampler

    def full_steps(full_ms: float, wall_ms: float, steps: int = 200) -> list[int]:
        s, t, out = Sampler("auto", 0.003, False), 0, []
        for step in range(steps):
            full = s.is_full(step)
            t += int(wall_ms * 1e6)
            s.step_wall(t)
            if full:
                out.append(step)
                s.remember([(t, None, "forward_start")], [[0]])
            s.step_cost(step, full, int(full_ms * 1e6) if full else 1_000, 0)
        return out

    a, b, c = full_steps(1.0, 100.0), full_steps(1.7, 97.0), full_steps(5.0, 103.0)
    assert a[:3] == [0, 1, 2] and a[-3:] == [188, 192, 196] and all(x % 4 == 0 for x in a[3:]), a
    assert all(x % 8 == 0 for x in b[3:]) and all(x % 32 == 0 for x in c[3:]), (b, c)
    assert set(c) <= set(b) <= set(a)  # (each longer period's steps among the shorter's)


def test_counted_steps_are_left_out_of_step_statistics():
    """A step whose memory was counted op by op pays for the dispatch mode: its time is the tool's, like a
    profiled step's (unless fewer than 3 steps would remain)."""
    from fsdp_doctor.analyze.steps import usable_steps
    from fsdp_doctor.records import MemoryStep, StepRecord

    def step(i, counted):
        return StepRecord(rank=0, step=i, start_ns=0, wall_ms=100.0, forward_ms=30.0, backward_ms=50.0,
                          memory=MemoryStep(transients="exact" if counted else "replayed"))

    steps = [step(i, i in (0, 2, 7)) for i in range(10)]
    assert [s.step for s in usable_steps(steps)] == [1, 3, 4, 5, 6, 8, 9]
    every = [step(i, True) for i in range(5)]
    assert [s.step for s in usable_steps(every)] == [1, 2, 3, 4]  # full_every=1: nothing else to use
    # the step table's title says which it kept (it said "full memory counts, left out" over a short run's, whose
    # slower steps made its p50: a new-user trial); left out, the usual title
    from fsdp_doctor.analyze.steps import analyze_steps
    from fsdp_doctor.present.fmt import STEPS_TITLE, steps_title
    from fsdp_doctor.store.reader import RankData, Run

    short = Run(path="constructed")
    short.ranks[0] = RankData(rank=0, steps=[step(i, i in (0, 1, 2)) for i in range(5)])
    sec = analyze_steps(short)
    assert sec.counted_kept == {"0": [1, 2]} and sec.per_rank["0"].count == 4
    assert steps_title(sec) == ("Step time per rank, ms (the first step and the doctor's profiler windows left out; "
                                "its full memory counts in steps 1, 2 kept, as fewer than 3 steps would remain: they "
                                "run slower)")
    short.ranks[0] = RankData(rank=0, steps=steps)
    sec = analyze_steps(short)
    assert sec.counted_kept == {} and steps_title(sec) == STEPS_TITLE


_BF16_SCRIPT = """
import os, sys, torch, torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import LlamaConfig, LlamaForCausalLM
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
import fsdp_doctor

def run(watch):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=False, hidden_act="silu")
    model = LlamaForCausalLM(cfg)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    doc = fsdp_doctor.watch(model, opt, out_dir=sys.argv[1], profile=False, memory={"full_every": 1}) if watch else None
    if doc is not None:
        doc.__enter__()
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        tok = torch.randint(0, 512, (2, 33), generator=g)
        logits = model(input_ids=tok[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), tok[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if doc is not None:
            doc.step()
    if doc is not None:
        doc.__exit__(None, None, None)
    return losses, [p.to_local().clone() for p in model.parameters()]

l0, p0 = run(False)
l1, p1 = run(True)
print("RESULT", l0 == l1, all(torch.equal(a, b) for a, b in zip(p0, p1)))
"""


@pytest.mark.long  # (the long tier: real runs of 10-30 s on a slow host, tests/conftest.py)
@pytest.mark.slow
def test_bf16_silu_training_bit_identical_with_the_high_water(tmp_path):
    """Every step counted op by op (full_every=1) on an HF Llama (SiLU) under bf16 mixed precision: losses and
    final parameter shards equal to a run without the doctor, bit for bit."""
    import subprocess

    from fsdp_doctor.workloads import free_port

    r = subprocess.run([sys.executable, "-c", _BF16_SCRIPT, str(tmp_path), str(free_port())], capture_output=True,
                       text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    assert [x for x in r.stdout.splitlines() if x.startswith("RESULT")][-1] == "RESULT True True"
    from fsdp_doctor import load_run

    steps = load_run(tmp_path).ranks[0].steps
    assert [s.memory.transients for s in steps] == ["exact"] * 4


def test_light_steps_read_the_allocator_at_few_marks_and_shift_the_rest():
    """On CUDA a light step reads the allocator at the first and last marks and at those nearest the full step's
    peak (a high-water between marks counts for the mark before it); every other mark takes the full step's
    temporaries shifted by what the last read mark found more than the full step (here +5 from a kept tensor)."""
    from fsdp_doctor.record.memory.sampler import PEAK_READS, UNREAD, Sampler

    def row(named, tmp):
        return [named, 0, 0, 0, 0, 0, 0, 0, 0, tmp]

    # a full step of 10 marks: named bytes rise to mark 5 and fall; temporaries 10 each; a high-water of 200
    # between marks 7 and 8 (higher than any mark)
    named = [100, 110, 120, 130, 140, 150, 140, 130, 120, 110]
    marks = [(None if i in (0, 9) else f"u{i}", f"p{i}") for i in range(10)]
    s = Sampler("auto", 0.003, True)
    s.remember([(i, u, p) for i, (u, p) in enumerate(marks)], [row(n, 10) for n in named],
               [(7, 7.5, "u7", "in_backward", row(130, 70))])
    assert PEAK_READS == 4
    assert s.reads_at == {0, 9, 7, 5, 4, 6}  # first, last, the high-water's mark 7, then marks 5, 4/6 (150, 150)
    # a light step: the loop keeps 5 bytes more than the full step from the start
    light = [(i, u, p, named[i] + 10 + 5 if i in s.reads_at else UNREAD) for i, (u, p) in enumerate(marks)]
    rows, bad, extra = s.replay(light, lambda tmp: row(0, tmp))
    assert bad == 0
    assert [r[-1] for r in rows] == [15] * 10  # read marks: their own; the others: the full step's + 5
    assert [(i, r[-1]) for i, _t, _u, _p, r in extra] == [(7, 75)]  # the high-water shifted alike
    assert s.last_full[1][2][-1] == 10  # the full step's rows are left as they were
    # the full step's own totals replay exactly when the allocator reads what it read then
    same = [(i, u, p, named[i] + 10 if i in s.reads_at else UNREAD) for i, (u, p) in enumerate(marks)]
    rows, _, extra = s.replay(same, lambda tmp: row(0, tmp))
    assert [sum(r) for r in rows] == [n + 10 for n in named] and sum(extra[0][-1]) == 200
    # off CUDA the allocator is never read
    cpu = Sampler("auto", 0.003, False)
    cpu.remember([(0, None, "p0")], [row(1, 0)])
    assert cpu.reads_at == frozenset()


def test_all_gather_waits_of_a_short_run_leave_the_counted_steps_out():
    """prefetch.exposed_allgather's figure is the step of median share among the usable steps; a short run keeps
    the steps whose memory was counted op by op in its statistics, but their counting stretches the step and its
    waits: the waits come from the others wherever one remains (a new-user trial's 8-step run read "152.5 ms per
    step" from a 548 ms counted step of a 233 ms run)."""
    from fsdp_doctor.diagnose import estimate as E
    from fsdp_doctor.diagnose.base import Context
    from fsdp_doctor.records import MemoryStep, StepRecord, UnitStep
    from fsdp_doctor.store.reader import RankData, Run

    def step(i, counted):
        wall, wait = (548.0, 152.5) if counted else (233.0 + i, 70.0 + i)  # 28% and 31%
        return StepRecord(rank=0, step=i, start_ns=0, wall_ms=wall, forward_ms=80.0, backward_ms=120.0,
                          units=[UnitStep(name="layers.0", fwd_ms=wait, ag_wait_fwd_ms=wait)],
                          memory=MemoryStep(transients="exact" if counted else "replayed"))

    run = Run(path="constructed")
    run.ranks[0] = RankData(rank=0, steps=[step(i, i in (0, 1, 2)) for i in range(5)])
    ctx = Context(run=run, report={})
    assert E.median_step_ag_waits(ctx) == (73.0, 0.0, 236.0)  # steps 3 and 4: the lower of the two
    run.ranks[0] = RankData(rank=0, steps=[step(i, True) for i in range(4)])  # every step counted: those
    assert E.median_step_ag_waits(ctx) == (152.5, 0.0, 548.0)


_VARLEN = """
model = nn.Sequential(nn.Embedding(64, 32), *[nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
                                             for _ in range(2)], nn.Linear(32, 64))
for m in model[1:3]:
    fully_shard(m)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
with fsdp_doctor.watch(model, opt, out_dir=sys.argv[1], profile=False) as doc:
    for step in range(10):
        seq = 512 if step == 6 else 32  # one long batch among short ones (variable sequence lengths)
        tok = torch.randint(0, 64, (4, seq), generator=torch.Generator().manual_seed(step))
        logits = model(tok)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tok.flatten()).backward()
        opt.step()
        opt.zero_grad()
        doc.step()
"""


def test_a_light_step_on_a_larger_batch_is_measured_in_full(tmp_path):
    """Light memory steps replay the last full step's figures, FSDP's schedule repeating; a batch larger than
    every full step's (variable sequence lengths) does not repeat them: a new-user trial's 1024-token steps among
    64-token ones read the short steps' 6.80 MiB where 87.82 MiB was the peak. A light step whose batch has 1.25x
    the elements of every full step's is measured in full, and the peak is its own."""
    from conftest import run_one_rank
    from fsdp_doctor import build_report, load_run

    run = load_run(run_one_rank(tmp_path, _VARLEN)[0])
    by_step = {s.step: s.memory for s in run.ranks[0].steps}
    assert by_step[6].sampling == "full" and by_step[5].sampling == by_step[7].sampling == "replayed", \
        {k: m.sampling for k, m in by_step.items()}
    assert by_step[6].peak.bytes > 4 * by_step[5].peak.bytes, (by_step[6].peak.bytes, by_step[5].peak.bytes)
    assert build_report(run).memory.per_rank["0"].peak_at.step == 6


_EVAL_MODE_IN_A_FULL_STEP = """
model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) for _ in range(2)])
for m in model:
    fully_shard(m)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
evaluate = int(sys.argv[2])
with fsdp_doctor.watch(model, opt, out_dir=sys.argv[1], profile=False) as doc:
    for step in range(4):  # (steps 0-2 measured in full, the last of them evaluating)
        if evaluate and step == 2:  # an evaluation that forgot torch.no_grad(), its outputs kept
            model.eval()
            kept = [model(torch.randn(16, 32)) for _ in range(4)]
            model.train()
        model(torch.randn(16, 32)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        doc.step()
"""


@pytest.mark.long  # (the long tier: real runs of 10-30 s on a slow host, tests/conftest.py)
def test_units_activations_are_a_training_forwards_beside_an_eval_mode_evaluation(tmp_path):
    """Forwards in eval mode with autograd on (torch.no_grad() forgotten) add their graphs' activations to the units'
    in the full step that ran them: a new-user trial's layers read 1.08 MiB each, four evaluation forwards' worth,
    for 275.5 KiB of one training forward. The per-unit figures come from a full step without them."""
    import os
    import subprocess

    from conftest import ONE_RANK, REPO, child_pythonpath
    from fsdp_doctor import build_report, load_run

    script = tmp_path / "case.py"
    script.write_text(ONE_RANK + _EVAL_MODE_IN_A_FULL_STEP + "\ndist.destroy_process_group()\n")
    acts = {}
    for evaluate in (0, 1):
        out = tmp_path / f"run{evaluate}"
        subprocess.run([sys.executable, str(script), str(out), str(evaluate)], check=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": child_pythonpath(REPO), "OMP_NUM_THREADS": "1"})
        run = load_run(out)
        assert sum(s.autograd_eval_forwards for s in run.ranks[0].steps) == 4 * evaluate
        acts[evaluate] = {u.unit: u.activation_bytes for u in build_report(run).memory.per_rank["0"].per_unit}
    assert acts[1] == acts[0] and acts[0]["0"] > 0, acts
