"""The recorder's typed seams: FSDP2's label grammar (one torch-free parser for the hooks and the trace builder),
WatchOptions (watch()'s options in one place) and the optimizer unwrapping."""

from __future__ import annotations

import contextlib
import statistics
from pathlib import Path

import pytest

import torch

from fsdp_doctor.fsdp_labels import FsdpLabel, parse_label
from fsdp_doctor.units import fmt_bytes


@pytest.mark.parametrize("name,parsed", [
    ("FSDP::pre_forward (layers.0)", FsdpLabel("pre_forward", "layers.0")),
    ("FSDP::pre_backward ()", FsdpLabel("pre_backward", "")),
    ("FSDP::root_pre_forward", FsdpLabel("root_pre_forward", None)),
    ("FSDP::all_gather (layers.1) [pg=3]", FsdpLabel("all_gather", "layers.1", 3)),
    ("FSDP::post_backward_reduce (norm, lm_head)", FsdpLabel("post_backward_reduce", "norm, lm_head")),
    ("FSDP::backward_prefetch for layers.2", FsdpLabel("backward_prefetch", "layers.2")),
    ("FSDP::forward_prefetch for ", FsdpLabel("forward_prefetch", "")),
    ("aten::mm", None),
    ("FSDP::", None),
])
def test_label_grammar(name, parsed):
    assert parse_label(name) == parsed


def test_the_hooks_and_the_trace_builder_share_the_grammar():
    import fsdp_doctor.fsdp_labels as labels
    import fsdp_doctor.record.hooks as hooks
    import fsdp_doctor.trace.build as build
    import fsdp_doctor.trace.ops as ops

    assert hooks.parse_label is labels.parse_label
    assert build.parse_label is labels.parse_label and ops.parse_label is labels.parse_label
    assert not hasattr(build, "LABEL_RE") and not hasattr(build, "PREFETCH_RE")  # no second copy of the grammar


def test_watch_options_in_one_place():
    from fsdp_doctor.record.options import WatchOptions

    o = WatchOptions.from_kwargs({"out_dir": "x", "tokens_per_step": 8})
    assert o.counts_flops and not WatchOptions(out_dir="x").counts_flops
    assert not WatchOptions(out_dir="x", peak_tflops=1.0, count_flops=False).counts_flops
    with pytest.raises(TypeError, match="unknown option.*tokens_per_stepp.*options: out_dir"):
        WatchOptions.from_kwargs({"out_dir": "x", "tokens_per_stepp": 8})
    with pytest.raises(TypeError, match="out_dir is required"):
        WatchOptions.from_kwargs({})


def test_optimizer_wrappers_unwrapped_and_misuse_refused_in_one_sentence():
    from fsdp_doctor.record.tracker import WatchError, unwrap_optimizer, unwrap_optimizers

    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)

    class Wrapper(torch.optim.Optimizer):  # accelerate's shape: an Optimizer subclass without Optimizer.__init__
        def __init__(self, optimizer):
            self.optimizer = optimizer

    class Plain:
        def __init__(self, optimizer):
            self.optimizer = optimizer

    assert unwrap_optimizer(opt) is opt and unwrap_optimizer(None) is None
    assert unwrap_optimizer(Wrapper(Plain(opt))) is opt

    class Container(torch.optim.Optimizer):  # torchtitan's shape: an Optimizer shell stepping those it holds
        def __init__(self, optimizers):
            self.optimizers = optimizers
            torch.optim.Optimizer.__init__(self, [p for o in optimizers for g in o.param_groups for p in g["params"]],
                                           {})

        def step(self, closure=None):
            for o in self.optimizers:
                o.step()

    assert unwrap_optimizer(Container([opt])) is opt  # the one it holds: its state and groups are the real ones
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    two = Container([opt, other])
    assert unwrap_optimizer(two) is two  # (several: the container, whose step hooks still time them all)
    with pytest.raises(WatchError) as e:
        unwrap_optimizer(object())
    assert "not a torch.optim.Optimizer" in str(e.value) and "\n" not in str(e.value)
    # a list of optimizers the loop steps: each (a new-user trial's [adamw, sgd] was told to "pass the Optimizer
    # itself", then refused with "pass the one each step ends with"); a list inside it, or an empty one: one sentence
    assert unwrap_optimizers([opt, Wrapper(Plain(other)), opt]) == [opt, other] and unwrap_optimizers(None) == []
    for bad, said in (([opt, [other]], "a list of 1 inside the optimizers' list"), ((), "an empty tuple")):
        with pytest.raises(WatchError) as e:
            unwrap_optimizers(bad)
        assert said in str(e.value) and "\n" not in str(e.value), str(e.value)
    # an object of the user's own that holds and steps them (a Muon user's MultiOptimizer(muon, adamw) was refused,
    # and watch() ended the run before its first step): those it holds, in a tuple, a list, a dict or alone
    class Multi:
        def __init__(self, *opts, **named):
            self.opts, self.named, self.lr = opts, named, 0.1

    assert unwrap_optimizers(Multi(opt, other)) == [opt, other]
    assert unwrap_optimizers(Multi(muon=opt, adamw=other)) == [opt, other]
    assert unwrap_optimizers(Multi(opt, adamw=opt)) == [opt]
    with pytest.raises(WatchError):
        unwrap_optimizers(Multi())  # (holds none: refused as before)


def test_an_object_stepping_two_optimizers_is_watched(tmp_path, gloo_one_rank):
    """A loop that steps Muon and AdamW through an object of its own, given to watch(): both optimizers' steps are
    timed and their state read, one record per step."""
    from torch.distributed.fsdp import fully_shard

    import fsdp_doctor

    class MultiOptimizer:
        def __init__(self, *opts):
            self.optimizers_ = list(opts)

        def step(self):
            for o in self.optimizers_:
                o.step()

        def zero_grad(self):
            for o in self.optimizers_:
                o.zero_grad()

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    fully_shard(m[0])
    fully_shard(m)
    weights = [p for p in m.parameters() if p.ndim == 2]
    opt = MultiOptimizer(torch.optim.SGD(weights, lr=0.01),
                         torch.optim.Adam([p for p in m.parameters() if p.ndim == 1], lr=0.01))
    with fsdp_doctor.watch(m, opt, out_dir=tmp_path, profile=False) as doc:
        for _ in range(4):
            m(torch.randn(8, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
            doc.step()
    rd = fsdp_doctor.load_run(tmp_path).ranks[0]
    assert rd.config.optimizer == "SGD+Adam" and len(rd.steps) == 4, (rd.config.optimizer, len(rd.steps))
    assert all(s.optimizer_ms > 0 for s in rd.steps), [s.optimizer_ms for s in rd.steps]


def test_micro_batches_and_an_optimizer_that_never_steps(tmp_path, monkeypatch, caplog):
    """doctor.step() per micro-batch: one record per optimizer step with its micro-batch count. An optimizer that
    never steps (the user steps another one) cannot hold the records back forever: after MICRO_BATCH_LIMIT calls
    each call is a step, said in one line; where the loop zeroes the gradients (set_to_none) after each backward, each
    call is a step at once, one that skipped the step of the optimizer given to watch()."""
    import logging
    import os

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import fsdp_doctor
    from fsdp_doctor.record.tracker import Doctor
    from fsdp_doctor.workloads import free_port

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        fully_shard(m[0])
        fully_shard(m)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        with fsdp_doctor.watch(m, opt, out_dir=tmp_path / "micro", profile=False) as doc:
            for _ in range(3):
                for mb in range(2):
                    m(torch.randn(2, 4)).sum().backward()
                    if mb == 1:
                        opt.step()
                        opt.zero_grad()
                    doc.step()
        rd = fsdp_doctor.load_run(tmp_path / "micro").ranks[0]
        assert [(s.step, s.micro_batches) for s in rd.steps] == [(0, 2), (1, 2), (2, 2)]
        assert all(s.optimizer_ms > 0 for s in rd.steps)

        monkeypatch.setattr(Doctor, "MICRO_BATCH_LIMIT", 5)
        other = torch.optim.SGD(m.parameters(), lr=0.1)
        with caplog.at_level(logging.WARNING, logger="fsdp_doctor"):
            with fsdp_doctor.watch(m, opt, out_dir=tmp_path / "never", profile=False) as doc:
                for _ in range(8):
                    m(torch.randn(2, 4)).sum().backward()
                    other.step()  # (no zero_grad: the gradients add up, as under accumulation)
                    doc.step()
        rd = fsdp_doctor.load_run(tmp_path / "never").ranks[0]
        assert [s.micro_batches for s in rd.steps] == [5, 1, 1, 1]
        assert len([r for r in caplog.records if "without a step of the optimizer" in r.getMessage()]) == 1
        other.zero_grad()
        with fsdp_doctor.watch(m, opt, out_dir=tmp_path / "zeroed", profile=False) as doc:
            for _ in range(8):
                m(torch.randn(2, 4)).sum().backward()
                other.step()
                other.zero_grad()
                doc.step()
        rd = fsdp_doctor.load_run(tmp_path / "zeroed").ranks[0]
        assert [(s.micro_batches, s.optimizer_skipped) for s in rd.steps] == [(1, True)] * 8

        # doctor.step() twice per optimizer step: the second call, with nothing run since the first, is no step (a
        # new-user trial: 20 steps recorded for 10, every other one empty and read "10 of 20 steps skipped the
        # optimizer step ... a NaN/inf guard, GradScaler", and every step number doubled)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fsdp_doctor"):
            with fsdp_doctor.watch(m, opt, out_dir=tmp_path / "twice", profile=False) as doc:
                for _ in range(4):
                    m(torch.randn(2, 4)).sum().backward()
                    opt.step()
                    opt.zero_grad()
                    doc.step()
                    doc.step()
        run = fsdp_doctor.load_run(tmp_path / "twice")
        rd = run.ranks[0]
        assert [(s.step, s.repeated_calls, s.optimizer_skipped) for s in rd.steps] == [
            (0, 0, False), (1, 1, False), (2, 1, False), (3, 1, False)]
        assert rd.end.steps == 4 and rd.end.repeated_calls == 1
        assert len([r for r in caplog.records if "called again with nothing run" in r.getMessage()]) == 1
        from fsdp_doctor.present.fmt import apart_texts

        apart = dict(apart_texts(fsdp_doctor.build_report(run, traces=False).steps))
        assert "skipped" not in apart and apart["repeated"] == (
            "doctor.step() was called again after steps 0, 1, 2, 3 with nothing run since the call before (no "
            "forward, backward or optimizer step): 4 calls not counted as steps; call it once per optimizer step")
    finally:
        dist.destroy_process_group()


def test_the_step_timer_counts_what_the_collector_frees_and_its_full_collections():
    """The gc callback's record of a step: every collection's time (gc_ms), of it the full ones' (gc_full_ms), and
    the objects they freed (gc_collected): 1,000 two-dict cycles made and dropped, then one full collection and one
    young one (automatic young collections may free some first: the count is the same)."""
    import gc

    from fsdp_doctor.record.hooks import StepTimer

    timer = StepTimer(lambda *a: None)
    timer.active = True
    timer.begin_step()
    # what was garbage before the step is not the step's: collected to a fixed point, as finalizers of what a
    # collection frees can make garbage of their own (after test_compile_steps' compiled runs in the same process,
    # 2,845 objects more were counted in the step)
    while gc.collect():
        pass
    gc.callbacks.append(timer._gc_cb)
    try:
        for _ in range(1000):
            a: dict = {}
            b = {"peer": a}
            a["peer"] = b
        del a, b
        gc.collect()
        gc.collect(0)
    finally:
        gc.callbacks.remove(timer._gc_cb)
    tm = timer.timings()
    assert tm.gc_collected == 2000 and tm.gc_count >= 2
    assert 0 < tm.gc_full_ms <= tm.gc_ms
    assert tm.gc_disabled_count == 0 and tm.gc_disabled_ms == 0.0  # the collector on: none made with it off


def test_the_step_timer_counts_the_collections_made_with_the_collector_off():
    """With the collector disabled every collection is an explicit gc.collect() call (the loop's own, or jitter.gc's
    collect_between_steps): the gc callback counts those of a step and their time apart (gc_disabled_count,
    gc_disabled_ms, of gc_count and gc_ms), the collector's state read at each collection's start."""
    import gc

    from fsdp_doctor.record.hooks import StepTimer

    timer = StepTimer(lambda *a: None)
    timer.active = True
    timer.begin_step()
    gc.callbacks.append(timer._gc_cb)
    try:
        gc.collect()  # the collector on
        gc.disable()
        try:
            gc.collect()
            gc.collect(1)
        finally:
            gc.enable()
    finally:
        gc.callbacks.remove(timer._gc_cb)
    tm = timer.timings()
    assert tm.gc_disabled_count == 2 and tm.gc_count >= 3
    assert 0 < tm.gc_disabled_ms < tm.gc_ms


def _cycles_run(out, steps: int, collect_every: int, cycles: int = 180_000):
    """A one-rank run with the collector disabled, ``cycles`` one-list reference cycles made a step and an explicit
    gc.collect() every ``collect_every`` steps, before doctor.step(): its records and report."""
    import gc

    from torch.distributed.fsdp import fully_shard

    import fsdp_doctor
    from fsdp_doctor.pipeline import build_report

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    fully_shard(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x = torch.randn(8, 16)
    gc.collect()
    gc.disable()
    try:
        with fsdp_doctor.watch(m, opt, out_dir=out, profile=False, memory=False) as doc:
            for step in range(steps):
                m(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
                for _ in range(cycles):
                    c: list = []
                    c.append(c)
                del c
                if step % collect_every == collect_every - 1:
                    gc.collect()
                doc.step()
    finally:
        gc.enable()
    run = fsdp_doctor.load_run(out)
    return run.ranks[0].steps, build_report(run)


def test_explicit_collections_with_the_collector_off_are_not_told_to_disable_it(tmp_path, gloo_one_rank):
    """A new-user trial pasted jitter.gc's fix (set-up frozen, gc.disable(), collect_between_steps every 50 steps)
    beside its own gc.collect() every 20 steps: the rule read the explicit calls' pauses (12.2% of step time, one
    every 15 steps) as the collector's and printed the same gc.freeze()/gc.disable() snippet again. With the
    collector off the recorder counts the collections apart; the rule says they are the loop's explicit calls, how
    often and how long, and to call it every N steps (here 180k objects of cycles a step: every 5), with no switch
    of the collector's in the fix; at that period it stays quiet, saying why."""
    from fsdp_doctor.diagnose import snippets as S

    steps, rep = _cycles_run(tmp_path / "often", 11, 2)
    # steps 1, 3, ..., 9 collected (1 call each, the collector off); 0, 2, ... none; every collection counted
    assert [s.gc_disabled_count for s in steps] == [i % 2 for i in range(11)]
    assert all(s.gc_count == s.gc_disabled_count and s.gc_disabled_ms == s.gc_ms for s in steps)
    assert all(s.gc_collected >= 2 * 180_000 for s in steps if s.gc_disabled_count)
    (f,) = [f for f in rep.findings if f.code == "jitter.gc"]
    st = rep.steps.per_rank["0"]
    assert st.gc_disabled_count_total == 5 and st.count == 10  # (step 0 left out)
    assert f.title.startswith("Explicit gc.collect() calls take ") and f.title.endswith("(the collector is off)")
    assert f.evidence["gc_disabled_collections"] == 5 and f.evidence["collect_every_steps"] == 5
    assert f.evidence["gc_disabled_ms_each"] == pytest.approx(st.gc_disabled_ms_total / 5, abs=1e-3)
    assert ("every pause here is an explicit gc.collect() call in the loop: 5 in 10 steps (one every 2 steps), "
            f"{st.gc_disabled_ms_total / 5:.1f} ms each. Call it less often: every 5 steps") in f.recommendation.text
    assert f.recommendation.code.endswith(S.gc_collect_every(5))
    assert "gc.disable" not in f.recommendation.code and "gc.freeze" not in f.recommendation.code
    # ... the collections at the period advised: quiet, with the reason
    steps, rep = _cycles_run(tmp_path / "period", 11, 5)
    assert [s.gc_disabled_count for s in steps] == [int(i % 5 == 4) for i in range(11)]
    assert not [f for f in rep.findings if f.code == "jitter.gc"]
    (why,) = [r.reason for r in rep.rules if r.code == "jitter.gc"]
    assert "are explicit gc.collect() calls with the collector off, 2 in 10 steps (one every 5 steps)" in why
    assert "at the period advised (every 5 steps) or rarer" in why, why


def test_a_grouped_unit_kept_gathered_waits_for_no_all_gather_in_backward(tmp_path, gloo_one_rank):
    """A new-user trial (accelerate, a Mistral's [model.norm, lm_head] kept gathered after forward): 99-112 ms of
    "backward all-gather wait" per step for a unit that gathers nothing in backward, prefetch.exposed_allgather's
    largest. The recorder hooked the outputs of the group's first module (norm) only, and the first gradient
    reaches lm_head's: lm_head's backward was timed as the wait. Every call's outputs are hooked now. Here a head
    of 64 x 16384 makes lm_head's backward the step's largest: the wait stays a small part of the unit's backward."""
    from torch.distributed.fsdp import fully_shard

    import fsdp_doctor

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 16384))
    fully_shard(m[0])
    fully_shard([m[1], m[2]], reshard_after_forward=False)  # the head: norm and lm_head, one unit
    fully_shard(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(256, 64)
    with fsdp_doctor.watch(m, opt, out_dir=tmp_path / "head", profile=False, memory=False) as doc:
        for _ in range(6):
            m(x).float().logsumexp(-1).mean().backward()
            opt.step()
            opt.zero_grad()
            doc.step()
    rd = fsdp_doctor.load_run(tmp_path / "head").ranks[0]
    head = [[u for u in s.units if u.name == "1, 2"][0] for s in rd.steps[2:]]
    assert all(u.bwd_ms > 1.0 for u in head)  # lm_head's backward: a 256 x 64 x 16384 matmul pair
    assert sum(u.ag_wait_bwd_ms for u in head) < 0.3 * sum(u.bwd_ms for u in head), \
        [(u.ag_wait_bwd_ms, u.bwd_ms) for u in head]


@pytest.mark.parametrize("where", ["per_micro_batch", "per_step", "both"])
def test_doctor_step_per_micro_batch_before_the_optimizer_step_records_the_same_steps(tmp_path, gloo_one_rank, where):
    """The README says doctor.step() may be called per micro-batch or per optimizer step. A new-user trial called it
    after each micro-batch's backward, the last one's before optimizer.step(): each recorded step then ran from the
    first micro-batch's call to the next step's first one, and the next step's first micro-batch (forward and
    backward, ~90 ms of ~390) read as time outside the model: jitter.data_wait warned of "23% of each step between
    optimizer.step() and the next forward", and memory.grads_kept of gradients the loop freed. The step now ends where
    the next one's first forward starts (the last at its optimizer step): both ways record every step, 4
    micro-batches each, every forward inside its step, and the time outside the model is the loop's own (zero_grad
    and the batch), not a micro-batch."""
    from torch.distributed.fsdp import fully_shard

    import fsdp_doctor
    from fsdp_doctor.pipeline import build_report

    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(3)])
    for layer in m:
        fully_shard(layer)
    fully_shard(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x = torch.randn(512, 256)
    with fsdp_doctor.watch(m, opt, out_dir=tmp_path / where, profile=False) as doc:
        for _ in range(8):
            for _mb in range(4):
                m(x).square().mean().backward()
                if where in ("per_micro_batch", "both"):
                    doc.step()
            opt.step()
            opt.zero_grad()
            if where in ("per_step", "both"):  # (both: a call after each micro-batch and one after the optimizer
                doc.step()  # step, 5 for 4 micro-batches, read "5 micro-batches": a new-user trial)
    run = fsdp_doctor.load_run(tmp_path / where)
    steps = run.ranks[0].steps
    # (the last ends at its optimizer step, at watch()'s exit: it was lost, no forward after it to end it)
    assert len(steps) == 8
    for s in steps:
        assert all(u.fwd_calls == 4 for u in s.units), [u.fwd_calls for u in s.units]
        assert s.micro_batches == (1 if where == "per_step" else 4)  # (doctor.step() calls after a forward)
        assert s.backwards == 4 and not s.optimizer_skipped, s  # (no zero_grad between micro-batches: none skipped)
    # (the median step's shares: one step preempted on a loaded 2-core host read 14.9 ms outside of 65.8)
    outside = statistics.median(s.outside_ms / s.wall_ms for s in steps)
    model = statistics.median((s.forward_ms + s.backward_ms) / s.wall_ms for s in steps)
    assert outside < 0.2 and model > 0.6, (outside, model)
    codes = {f.code for f in build_report(run).findings}
    assert not codes & {"jitter.data_wait", "memory.grads_kept"}, codes


class _SkipsItsHead(torch.nn.Module):
    """torchtitan's llama under its chunked loss, in small: the model's forward skips its output head, which the loss
    calls per chunk of the hidden states."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(64, 64)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(2))
        self.output = torch.nn.Linear(64, 128)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h).relu()
        return h


def _chunked_loss(model, h, chunks=4):
    """torchtitan 0.3.0's ChunkedCELoss (components/loss.py) as its loop runs it: the hidden states detached, the
    head and the loss per chunk, each chunk's backward() through the head alone with its gradient sync off but on the
    last chunk, then the model's backward from the chunks' accumulated gradient."""
    hd = h.detach().requires_grad_()
    model.output.set_requires_gradient_sync(False, recurse=False)
    for i, c in enumerate(hd.chunk(chunks)):
        if i == chunks - 1:
            model.output.set_requires_gradient_sync(True, recurse=False)
        model.output(c).square().mean().backward()
    h.backward(hd.grad)


def _watched_chunked_loss(out, steps: int, micro: int = 1):
    """_SkipsItsHead trained under _chunked_loss for ``steps`` steps of ``micro`` micro-batches (the gradients synced
    in the last), watched into ``out``: the run read back."""
    from torch.distributed.fsdp import fully_shard

    import fsdp_doctor

    torch.manual_seed(0)
    m = _SkipsItsHead()
    for layer in m.layers:
        fully_shard(layer)
    fully_shard(m.output)
    fully_shard(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x = torch.randn(32, 64)
    with fsdp_doctor.watch(m, opt, out_dir=out, profile=False) as doc:
        for _ in range(steps):
            for k in range(micro):
                m.set_requires_gradient_sync(k == micro - 1)
                _chunked_loss(m, m(x))
            opt.step()
            opt.zero_grad()
            doc.step()
    return fsdp_doctor.load_run(out)


@pytest.mark.parametrize("micro", [1, 2])
def test_a_chunked_loss_counts_one_backward_pass_per_micro_batch(tmp_path, gloo_one_rank, micro):
    """torchtitan's Trainer (its chunked loss) recorded 9 backward passes a step, 2 with gradient sync on, for one
    forward: every backward() call through any unit was counted, and each chunk's runs through the output head
    alone. The compare's gradient-sync row and the run's facts read "9 backward passes per optimizer step, 2 with
    gradient sync on". Only the calls that reach the model's own unit are its backward passes: one per micro-batch,
    synced as the loop set it (the last micro-batch's alone, with set_requires_gradient_sync(is_last))."""
    from msgspec import UNSET

    from fsdp_doctor.analyze.report import run_facts

    run = _watched_chunked_loss(tmp_path, 4, micro)
    assert [(s.backwards, s.synced_backwards) for s in run.ranks[0].steps] == [(micro, 1)] * 4
    assert [s.input_shape for s in run.ranks[0].steps] == [[32, 64]] * 4  # the model's input (each step's first)
    facts = run_facts(run)
    assert (facts.backwards_per_step, facts.synced_backwards_per_step) == ((2, 1) if micro == 2 else (UNSET, UNSET))
    # the head run 4 times a micro-batch from the loss: its chunks (compare's job setting)
    assert facts.loss_chunks == 4


def test_a_chunked_loss_is_the_loss_phase_through_every_chunk(tmp_path, gloo_one_rank):
    """Each chunk's backward runs through the output head alone, before the next chunk's head forward: the loss
    phase went on only until the first of them, and the next chunks' high-waters read "outside the units, in_forward"
    (a new-user trial's torchtitan peak, in its 2nd of 8 chunks: memory.temporaries named no lever for it). A
    backward that does not reach the root leaves the loss phase open: each chunk's high-water is in the loss."""
    import fsdp_doctor

    tl = fsdp_doctor.build_report(_watched_chunked_loss(tmp_path, 3)).memory.per_rank["0"].timeline
    rows = [(r["unit"], r["phase"]) for r in tl]
    start, back = rows.index((None, "loss_start")), rows.index(("", "backward_start"))  # (the model's backward)
    loss = rows[start:back]
    # (the loss starts where the model returns, and again where each chunk's head has run)
    assert loss.count((None, "in_loss")) == 4 and loss.count((None, "loss_start")) == 5, loss
    assert not [r for r in loss if r[1] == "in_forward" and r[0] != "output"], loss


def test_a_unit_called_several_times_a_pass_is_no_chunked_head_and_kept_gathered_saves_calls(tmp_path, gloo_one_rank):
    """ALBERT applies one shared layer group once per layer: one unit called 6 times inside the model's forward. Its
    calls beyond one a pass read as an output head that a loss outside the model runs per chunk (torchtitan's
    ChunkedLossWrapper): the run's facts said a loss in 6 chunks (a new-user trial). The memory timeline shows where
    each call starts: inside the root's forward, so none; the chunked loss's head, after it (the test above)."""
    from msgspec import UNSET
    from torch.distributed.fsdp import fully_shard

    import fsdp_doctor
    from fsdp_doctor.analyze.report import run_facts
    from fsdp_doctor.analyze.steps import called_outside_forward
    from fsdp_doctor.diagnose import estimate as E
    from fsdp_doctor.diagnose.base import Context

    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.shared, self.output = (torch.nn.Linear(64, 64) for _ in range(3))

        def forward(self, x):
            h = self.embed(x)
            for _ in range(3):
                h = self.shared(h).relu()
            return self.output(h)

    torch.manual_seed(0)
    m = Shared()
    fully_shard(m.shared)
    fully_shard(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    with fsdp_doctor.watch(m, opt, out_dir=tmp_path, profile=False) as doc:
        for _ in range(4):
            m(torch.randn(32, 64)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            doc.step()
    run = fsdp_doctor.load_run(tmp_path)
    assert {u.fwd_calls for s in run.ranks[0].steps for u in s.units if u.name == "shared"} == {3}
    assert called_outside_forward(run.ranks) == set()
    assert run_facts(run).loss_chunks is UNSET
    # kept gathered after forward, it is gathered once a pass instead of 3 times, and twice in backward instead of 3
    # times: what that saves is its backward all-gather wait's third and its forward wait's two thirds
    ctx = Context(run=run, report=fsdp_doctor.build_report(run))
    (u,) = [u for u in E.units(ctx) if u.name == "shared"]
    assert E.calls_per_pass(ctx, "shared") == 3 and E.calls_per_pass(ctx, "") == 1
    assert E.kept_gathered_saves_ms(ctx, u)[0] == pytest.approx(E.ag_wait_ms(u, "backward") / 3
                                                                 + E.ag_wait_ms(u, "forward") * 2 / 3)
    assert "shared, called 3 times a forward pass, is all-gathered once a pass instead of 3 times, and 2 times in " \
           "backward instead of 3" in E.repeated_words(ctx, [u])
    chunked = _watched_chunked_loss(tmp_path / "chunked", 2)
    assert called_outside_forward(chunked.ranks) == {"output"}
    ctx = Context(run=chunked, report=fsdp_doctor.build_report(chunked))
    assert E.calls_per_pass(ctx, "output") == 1 and E.repeated_words(ctx, E.units(ctx)) == ""


def test_a_loop_that_raises_through_watch_reads_as_stopped_on_that_exception(tmp_path, gloo_one_rank):
    """A Ctrl-C (KeyboardInterrupt) or an error raised through the with-block left no end record: the report said
    "did not finish (run still going, or killed)" (a new-user trial). The end record now says the exception; the
    report's problems say the rank stopped on it after its last step, and its completed steps are used. The exception
    reaches the caller."""
    from torch.distributed.fsdp import fully_shard

    import fsdp_doctor
    from fsdp_doctor.pipeline import build_report
    from fsdp_doctor.present.fmt import run_warnings

    m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    fully_shard(m[0])
    fully_shard(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(KeyboardInterrupt):
        with fsdp_doctor.watch(m, opt, out_dir=tmp_path, profile=False) as doc:
            for i in range(5):
                m(torch.randn(4, 16)).sum().backward()
                opt.step()
                opt.zero_grad()
                doc.step()
                if i == 3:
                    raise KeyboardInterrupt
    run = fsdp_doctor.load_run(tmp_path)
    assert run.ranks[0].end.exception == "KeyboardInterrupt" and run.ranks[0].end.steps == 4
    report = build_report(run)
    facts = report.run
    assert facts.complete == {"0": False} and facts.stopped_on == {"0": "KeyboardInterrupt"}
    # (one line, with its step, in the problems the terminal prints and the JSON holds: store.reader.run_end_line)
    assert report.problems == ["rank 0 stopped after step 3 on KeyboardInterrupt; the completed steps of every rank "
                               "are used"], report.problems
    assert run_warnings(facts) == []
    # a rank killed (no end record) beside one that raised after it: the killed one first, the other's message said
    # (a new-user trial's header named rank 1's RuntimeError first and dropped its message)
    from fsdp_doctor.records import End
    from fsdp_doctor.store.reader import run_end_line

    run.ranks[1] = type(run.ranks[0])(rank=1, config=run.ranks[0].config, steps=list(run.ranks[0].steps))
    run.ranks[0].end = None
    run.ranks[1].end = End(rank=1, steps=4, ended_ns=1, exception="RuntimeError: pair.cc:537] Read error: Connection "
                                                                   "reset by peer")
    assert run_end_line(run, {}) == (
        # (the kind said once: "(RuntimeError): RuntimeError: ..." read twice, a new-user trial)
        "rank 0 stopped first, after step 3, without an end record (killed, or hung); rank 1 stopped after step 3 on "
        "RuntimeError: pair.cc:537] Read error: Connection reset by peer, likely following from it; the completed "
        "steps of every rank are used")
    # both raised, different errors: the first to stop, with its message (a new-user trial's header dropped the
    # planted error for the others' "Connection closed by peer", with no message at all)
    for r, (ns, why) in {0: (2_575_000_000, "RuntimeError: [gloo] Connection closed by peer"),
                         1: (2_000_000_000, "RuntimeError: planted failure at step 50")}.items():
        run.ranks[r].end = End(rank=r, steps=4, ended_ns=ns, exception=why)
    assert run_end_line(run, {}) == (
        "rank 1 stopped first, after step 3, on RuntimeError: planted failure at step 50 (575 ms before rank 0); rank 0 "
        "stopped after step 3 on RuntimeError: [gloo] Connection closed by peer, likely following from it; the "
        "completed steps of every rank are used")


def test_a_trainer_that_did_not_shard_is_told_so_in_its_own_terms():
    """Under the Hugging Face Trainer a model with no FSDP2 unit is one the Trainer did not shard: a new-user trial
    asked for FSDP2 on CPU, accelerate ran DDP, and the doctor's line said to apply fully_shard, which a Trainer's
    user does not call. The line names what the Trainer was asked and what it did."""
    from types import SimpleNamespace

    from fsdp_doctor.record.hf_trainer import _trainer_refusal
    from fsdp_doctor.record.tracker import WatchError

    e = WatchError("fsdp_doctor.watch: Qwen2ForCausalLM has no FSDP2 unit; apply torch.distributed.fsdp.fully_shard "
                   "to its blocks and to the model before watching it")
    model = torch.nn.Linear(2, 2)
    asked = _trainer_refusal(e, SimpleNamespace(fsdp=[], fsdp_config={"fsdp_version": 2}), model)
    assert "the Trainer did not shard Linear with FSDP2" in asked and "TrainingArguments.fsdp asks for it" in asked
    assert "fully_shard" not in asked
    plain = _trainer_refusal(e, SimpleNamespace(fsdp=[], fsdp_config={}), model)
    assert "set TrainingArguments(fsdp=" in plain and "fully_shard" not in plain
    other = WatchError("fsdp_doctor.watch: cannot write to out_dir x (Permission denied)")
    assert _trainer_refusal(other, SimpleNamespace(fsdp=[]), model) == str(other)


def test_watch_takes_a_budget_as_a_whole_number_of_bytes_or_refuses_it_in_one_line():
    """capacity_bytes="8GB" or 0.9 * total_memory (a float) went into the config record as given; analysis then
    refused the record whole ("Expected 'int | null', got 'float'") and the run lost its units and most rules (a
    new-user trial). A number is taken as whole bytes; anything else is refused at watch(), in one line."""
    import numpy as np

    from fsdp_doctor.record.options import WatchOptions

    def opts(**kw):
        return WatchOptions.from_kwargs({"out_dir": "unused", **kw})

    assert opts(capacity_bytes=0.9 * 32e6).capacity_bytes == 28_800_000
    assert opts(capacity_bytes=np.int64(1 << 30), tokens_per_step=4096.0).tokens_per_step == 4096
    assert opts().capacity_bytes is None
    with pytest.raises(TypeError, match=r"^fsdp_doctor.watch: capacity_bytes must be a number of bytes \(e.g. "
                                        r"80 \* 2\*\*30\), got '8GB' \(str\)$"):
        opts(capacity_bytes="8GB")
    with pytest.raises(TypeError, match="got True"):
        opts(capacity_bytes=True)
    with pytest.raises(ValueError, match="tokens_per_step must be a positive number, got 0"):
        opts(tokens_per_step=0)
    # profile_ranks: an int or ints (any iterable, a generator's too), as a sorted tuple; anything else one line
    assert opts(profile_ranks=3).profile_ranks == (3,)
    assert opts(profile_ranks=(r for r in [8, 0])).profile_ranks == (0, 8) and opts().profile_ranks is None
    for bad in ("0", [], [-1], [0.5], [True]):
        with pytest.raises(ValueError, match=r"^fsdp_doctor.watch: profile_ranks takes one or more ranks, ints from "
                                             r"0, not "):
            opts(profile_ranks=bad)
    with pytest.raises(TypeError, match=r"^fsdp_doctor.watch: profile_ranks takes ranks \(an int or a list of "
                                        r"ints\), not 1.0$"):
        opts(profile_ranks=1.0)


def test_a_root_unsharded_at_the_first_forward_holds_no_unmanaged_parameters(gloo_one_rank):
    """A new-user trial (accelerate's FSDP2 plugin with no_wrap and bf16: a Qwen2's decoder layers in the root unit)
    read 1.13 MiB of "sharded grads" alive when every step started, and memory.grads_kept told them to free gradients
    their zero_grad() had freed. The memory probe looks for parameters no unit manages at the first unit's forward,
    while the root's forward runs: the root's unsharded parameters were on its modules then and read as unmanaged,
    their bf16 gradients (alive when that run's backward ended) were measured once, and never again. They are FSDP's
    unsharded parameters: managed, and the unmanaged gradients are measured again whenever that list is."""
    from torch.distributed.fsdp import fully_shard

    from fsdp_doctor.record.memory.sizes import FsdpSizes
    from fsdp_doctor.record.units import find_units

    m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 256), torch.nn.Linear(256, 64))
    fully_shard(m[0])
    fully_shard(m)  # the root: m[1] and m[2]
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m(torch.randn(4, 64)).sum().backward()  # FSDP's lazy init; gradients on the sharded parameters
    opt.step()
    opt.zero_grad()
    sizes = FsdpSizes(m, opt, find_units(m), host_is_device=True)
    m.unshard()  # as during the root's forward: its unsharded parameters are the modules' now
    assert not isinstance(m[1].weight, torch.distributed.tensor.DTensor)
    for p in m[1:].parameters():
        p.grad = torch.zeros_like(p)  # unreduced gradients, as before the root's post-backward
    sizes.refresh_static(final=False)
    assert sizes.unmanaged == [] and sizes.unmanaged_sgrad == 0, [tuple(p.shape) for p in sizes.unmanaged]
    for p in m[1:].parameters():
        p.grad = None
    m.reshard()


def test_a_loop_that_never_calls_step_is_told_at_exit(tmp_path, gloo_one_rank, caplog):
    """A new-user trial forgot doctor.step(): training ran 10 optimizer steps without a word, and analyze said the
    run "stopped before its first doctor.step()". watch() now says at its exit that no step was recorded, with the
    optimizer steps that ran, and analyze that watch() ended normally without a doctor.step() call."""
    import logging

    from torch.distributed.fsdp import fully_shard

    import fsdp_doctor
    from fsdp_doctor.pipeline import unusable_reason

    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    fully_shard(m[0])
    fully_shard(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="fsdp_doctor"):
        with fsdp_doctor.watch(m, opt, out_dir=tmp_path / "never", profile=False):
            for _ in range(3):
                m(torch.randn(2, 8)).sum().backward()
                opt.step()
                opt.zero_grad()
    said = [r.getMessage() for r in caplog.records if "without a doctor.step() call" in r.getMessage()]
    assert said == ["fsdp_doctor: watch() ended without a doctor.step() call (3 optimizer steps ran): nothing was "
                    "recorded; call doctor.step() once per optimizer step inside the with block"], caplog.text
    run = fsdp_doctor.load_run(tmp_path / "never")
    assert "watch() ended normally on rank 0 without a doctor.step() call" in unusable_reason(tmp_path, run, None)


def test_watch_before_accelerate_prepares_the_model_says_to_watch_after_prepare(tmp_path, monkeypatch):
    """A new-user trial called watch() before accelerator.prepare() (accelerate set to FSDP): the refusal told them
    to apply fully_shard, which their accelerate loop never calls. Where accelerate's state is set to FSDP the line
    says to watch after prepare; accelerate's state is read, never initialised."""
    accelerate_state = pytest.importorskip("accelerate.state")
    from accelerate.utils import DistributedType

    import fsdp_doctor
    from fsdp_doctor.record.tracker import WatchError

    model = torch.nn.Linear(4, 4)
    monkeypatch.setattr(accelerate_state.AcceleratorState, "_shared_state", {})  # accelerate not set up
    with pytest.raises(WatchError, match="has no FSDP2 unit; apply torch.distributed.fsdp.fully_shard"):
        fsdp_doctor.watch(model, None, out_dir=tmp_path / "a").__enter__()
    assert accelerate_state.AcceleratorState._shared_state == {}  # not initialised by the doctor
    accelerate_state.AcceleratorState._shared_state.update(distributed_type=DistributedType.FSDP)
    with pytest.raises(WatchError, match=r"accelerate shards it with FSDP: call watch\(\) after "
                                         r"accelerator.prepare\(...\), on the model and optimizer it returns"):
        fsdp_doctor.watch(model, None, out_dir=tmp_path / "b").__enter__()


def test_an_evaluation_before_doctor_step_leaves_the_root_gathered_and_its_parameters_fsdps(tmp_path, gloo_one_rank):
    """A loop that evaluates at the end of a step, before doctor.step() (``if step % N == 0: evaluate()``): FSDP keeps
    the root gathered after a forward without gradients, its unsharded parameters on the modules in place of the
    sharded ones, when the first step's snapshot is taken. They are FSDP's: no "unit parameter counts do not add up"
    line, no unmanaged parameters, the optimizer's state counted as state and none of its parameters stale (a
    new-user trial read 275 KiB of "stale optimizer params", 390 KiB of state for 528, and exit code 3)."""
    from torch.distributed.fsdp import fully_shard

    import fsdp_doctor
    from fsdp_doctor.pipeline import build_report

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 128), torch.nn.Linear(128, 64))
    fully_shard(m[1])
    fully_shard(m)  # m[0] and m[2] the root's own
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x = torch.randn(32, 64)
    with fsdp_doctor.watch(m, opt, out_dir=tmp_path / "run", profile=False) as doc:
        for _ in range(5):
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                m(x)
            doc.step()
    run = fsdp_doctor.load_run(tmp_path / "run")
    cfg = run.ranks[0].config
    assert cfg.unmanaged_param_bytes == 0 and sum(u.param_count for u in cfg.units) == cfg.model_param_count
    report = build_report(run)
    assert not [p for p in report.problems if "do not add up" in p], report.problems
    bd = report.memory.per_rank["0"].peak_breakdown
    n = sum(p.numel() for p in m.parameters())
    # AdamW's two moments of every fp32 element, and each parameter's step count (a 4-byte scalar)
    assert bd.get("stale_optimizer_params", 0) == 0 and bd["optimizer_state"] == 2 * 4 * n + 4 * 6, bd


@pytest.mark.parametrize("loop", ["gan", "accumulation"])
def test_a_backward_after_the_update_is_not_a_micro_batch(tmp_path, gloo_one_rank, loop):
    """A GAN's discriminator watched: its loss backward, its optimizer.step(), then the generator's loss backward
    through it, each step. Its backward passes are not micro-batches of one update: the records say a backward ran
    after the update, and the accumulation rules stay quiet saying so (a new-user trial's accum.sync_every_micro_batch
    warned, and its fix, pasted, changed the losses and the finding stayed). Real accumulation (two micro-batches,
    then the update) records none, and accum.regather looks at it."""
    from torch.distributed.fsdp import fully_shard

    import fsdp_doctor
    from fsdp_doctor.pipeline import build_report

    torch.manual_seed(0)
    G = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16))
    D = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 1))
    for m in (G, D):
        fully_shard(m[0])
        fully_shard(m)
    oG, oD = torch.optim.Adam(G.parameters()), torch.optim.Adam(D.parameters())
    with fsdp_doctor.watch(D, oD, out_dir=tmp_path / loop, profile=False, capacity_bytes=1 << 30) as doc:
        for _ in range(5):
            fake = G(torch.randn(8, 16))
            (D(torch.randn(8, 16)).mean() - D(fake.detach()).mean()).backward()
            if loop == "gan":
                oD.step()
                oD.zero_grad()
            D(fake).mean().backward()  # the generator's loss (a second micro-batch where loop is "accumulation")
            oG.step()
            oG.zero_grad()
            if loop == "accumulation":
                oD.step()
            oD.zero_grad()
            doc.step()
    run = fsdp_doctor.load_run(tmp_path / loop)
    assert [s.backward_after_optimizer for s in run.ranks[0].steps] == [loop == "gan"] * 5
    (st,) = [s for s in build_report(run).rules if s.code == "accum.regather"]
    said = "a backward through the model runs after its optimizer.step() within a step on rank(s) 0"
    assert (st.status == "quiet" and st.reason.startswith(said)) == (loop == "gan"), st


def test_arguments_a_hurried_user_gets_wrong_get_one_sentence():
    """watch() with a list of models (a GAN's), with its arguments swapped, and with out_dir passed second: one
    sentence each, before anything is touched (a new-user trial read a traceback about weak references of a list,
    "not a torch.optim.Optimizer" of swapped arguments, and "out_dir is required" of an out_dir given)."""
    import fsdp_doctor
    from fsdp_doctor.record.tracker import WatchError

    m = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    cases = [(([m, m], [opt, opt]), "the model argument (list) is not a torch.nn.Module: watch() takes one model"),
             ((opt, m), "the model and the optimizer are swapped: watch(model, optimizer, out_dir=...)"),
             ((m, "runs/x"), "'runs/x' came second, where the optimizer goes")]
    for args, said in cases:
        with pytest.raises(WatchError) as e:
            fsdp_doctor.watch(*args, out_dir="unused") if args[1] != "runs/x" else fsdp_doctor.watch(*args)
        assert str(e.value).startswith("fsdp_doctor.watch: " + said), str(e.value)


def test_doctor_step_on_a_watch_never_entered_says_so_once(caplog):
    """``doctor = fsdp_doctor.watch(...)`` without ``with``: nothing is recorded, and the first doctor.step() says so
    in one line (a new-user trial's run exited 0 with no run directory and no word)."""
    import logging

    import fsdp_doctor

    m = torch.nn.Linear(4, 4)
    doctor = fsdp_doctor.watch(m, torch.optim.SGD(m.parameters(), lr=0.1), out_dir="never-written")
    with caplog.at_level(logging.WARNING, logger="fsdp_doctor"):
        for _ in range(3):
            doctor.step()
    said = [r.getMessage() for r in caplog.records if "never entered" in r.getMessage()]
    assert said == ["fsdp_doctor: doctor.step() on a watch() that was never entered records nothing: use `with "
                    "fsdp_doctor.watch(model, optimizer, out_dir=...) as doctor:` around the loop"], said
    assert not Path("never-written").exists()


def test_another_fsdp_model_in_the_process_is_named_in_the_header(tmp_path, gloo_one_rank):
    """A frozen, sharded teacher beside the watched student (distillation): the header notes that FSDP2 units of
    another model are alive in this process, whose collectives the trace's labels cannot tell from the student's (a
    new-user trial's student report counted the teacher's all-gathers in its units and its verdict). A model of an
    earlier, destroyed process group that the collector has not freed yet is not one; the student alone has none. Units
    are counted, not modules: a unit of several modules (``fully_shard([a, b])``) is one."""
    from torch.distributed.fsdp import fully_shard

    import fsdp_doctor

    def sharded(grouped=False):
        m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 16))
        fully_shard([m[0], m[1]] if grouped else m[0])  # grouped: one unit of two modules
        fully_shard(m)
        return m

    def notes(teacher):
        student = sharded()
        opt = torch.optim.Adam(student.parameters())
        out = tmp_path / ("with" if teacher is not None else "alone")
        with fsdp_doctor.watch(student, opt, out_dir=out, profile=False) as doc:
            for _ in range(3):
                x = torch.randn(8, 16)
                with torch.no_grad():
                    t = teacher(x) if teacher is not None else x
                (student(x) - t).square().mean().backward()
                opt.step()
                opt.zero_grad()
                doc.step()
        run = fsdp_doctor.load_run(out)
        assert run.ranks[0].end.other_fsdp_units == (0 if teacher is None else 2)
        return build_report(run).run.notes or []

    from fsdp_doctor.pipeline import build_report

    assert not [n for n in notes(None) if "another model" in n]
    # two units, counted as units: the teacher's grouped [0, 1] is one (a trial's TRL reference model, its layers
    # grouped, read as one unit per module)
    teacher = sharded(grouped=True).requires_grad_(False)
    (said,) = [n for n in notes(teacher) if "another model" in n]
    assert said.startswith("2 FSDP2 unit(s) of another model are alive in this process (a teacher, "), said


def _teacher_and_student():
    """A distillation's two sharded models (each a root over one block unit), the teacher frozen, and the student's
    AdamW."""
    from torch.distributed.fsdp import fully_shard

    def sharded():
        m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16))
        fully_shard(m[0])
        fully_shard(m)
        return m

    torch.manual_seed(0)
    teacher, student = sharded().requires_grad_(False), sharded()
    return teacher, student, torch.optim.AdamW(student.parameters(), lr=1e-3)


def _distill(doc, teacher, student, opt, steps=4):
    for _ in range(steps):
        x = torch.randn(8, 16)
        with torch.no_grad():
            t = teacher(x)
        (student(x) - t).square().mean().backward()
        opt.step()
        opt.zero_grad()
        doc.step()


def test_a_teacher_watched_with_its_students_optimizer_is_said_and_its_optimizer_left_out(tmp_path, gloo_one_rank,
                                                                                             caplog):
    """The frozen teacher given to watch() with the student's AdamW (a new-user trial: exit 0, no word, and the memory
    table put 259 KiB of the student's Adam state beside the teacher's 195 KiB of parameters): one line at watch(),
    the same at the head of the report, no optimizer state in the teacher's memory, the optimizer's rules skipped."""
    import logging

    import fsdp_doctor
    from fsdp_doctor.pipeline import build_report

    teacher, student, opt = _teacher_and_student()
    with caplog.at_level(logging.WARNING, logger="fsdp_doctor"):
        with fsdp_doctor.watch(teacher, opt, out_dir=tmp_path / "run", profile=False) as doc:
            said = [r.getMessage() for r in caplog.records if "holds none" in r.getMessage()]
            _distill(doc, teacher, student, opt)
    shard = sum(p.to_local().numel() * 4 for p in student.parameters())  # the student's fp32 shards, 4 tensors
    line = (f"the optimizer given to watch() (AdamW) holds none of the watched model's parameters: its 4 parameter "
            f"tensor(s) ({fmt_bytes(shard)} per rank) are another FSDP2 model's; its state is not counted")
    assert len(said) == 1 and said[0].startswith("fsdp_doctor: " + line), said
    run = fsdp_doctor.load_run(tmp_path / "run")
    cfg = run.ranks[0].config
    assert (cfg.optimizer_params, cfg.optimizer_foreign_params, cfg.optimizer_other_params,
            cfg.optimizer_other_bytes) == (4, 0, 4, shard)
    rep = build_report(run)
    assert [n for n in rep.run.notes if n.startswith("The optimizer given")] == [line[0].upper() + line[1:] + (
        " in this model's memory, its step is that model's update, and the rules on the optimizer are skipped. Give "
        "watch() the model this optimizer trains, with it (README: loops with more than one model)")]
    assert not rep.memory.per_rank["0"].peak_breakdown.get("optimizer_state"), rep.memory.per_rank["0"].peak_breakdown
    status = {st.code: st for st in rep.rules}
    for code in ("optim.before_shard", "optim.untrained_params", "optim.no_gradients"):
        assert status[code].status == "skipped" and "holds none of the watched model's" in status[code].reason


def test_a_container_of_teacher_and_student_frees_its_gradients(tmp_path, gloo_one_rank):
    """A module holding the teacher and the student, watched (its forward never runs: the loop calls each model):
    the gradients the loop's opt.zero_grad() freed read as kept at the step's start, a new-user trial's INFO
    memory.grads_kept of 129.50 KiB, the student's gradients. Its first unit forward checks them, as the model's
    forward does."""
    import fsdp_doctor
    from fsdp_doctor.pipeline import build_report

    teacher, student, opt = _teacher_and_student()
    both = torch.nn.Module()
    both.teacher, both.student = teacher, student
    with fsdp_doctor.watch(both, opt, out_dir=tmp_path / "run", profile=False) as doc:
        _distill(doc, teacher, student, opt)
    rep = build_report(fsdp_doctor.load_run(tmp_path / "run"))
    pm = rep.memory.per_rank["0"]
    first = pm.timeline[0]
    assert first["unit"] == "teacher" and first["phase"] == "forward_start" and not first.get("sharded_grads"), first
    assert not rep.memory.per_rank["0"].steady_bytes.get("sharded_grads"), pm.steady_bytes
    assert "memory.grads_kept" not in {f.code for f in rep.findings}


def test_a_container_of_teacher_and_student_times_its_models_forwards_and_counts_their_activations(tmp_path,
                                                                                                    gloo_one_rank):
    """A container of teacher and student watched (its forward never runs): the two models' forwards read as time
    outside the model (a new-user trial's WARNING jitter.data_wait, 37% of the step, with a DataLoader fix, the data a
    tensor in memory) and no activations were counted ("activations off"; the student alone measured 537 KiB). Its
    units' outermost forwards, the teacher's without gradients too, are the step's forward, and the activations are
    counted from the step's first unit forward: the same as the student's watched alone."""
    import fsdp_doctor
    from fsdp_doctor.pipeline import build_report

    teacher, student, opt = _teacher_and_student()
    both = torch.nn.Module()
    both.teacher, both.student = teacher, student
    with fsdp_doctor.watch(both, opt, out_dir=tmp_path / "both", profile=False) as doc:
        _distill(doc, teacher, student, opt)
    teacher, student, opt = _teacher_and_student()
    with fsdp_doctor.watch(student, opt, out_dir=tmp_path / "student", profile=False) as doc:
        _distill(doc, teacher, student, opt)
    run = fsdp_doctor.load_run(tmp_path / "both")
    for st in run.ranks[0].steps:
        fwd = {u.name: u.fwd_ms for u in st.units}
        # the roots' spans, the nested units inside them (the same clock readings: equal to rounding)
        assert st.forward_ms == pytest.approx(fwd["teacher"] + fwd["student"], abs=0.002), (st.forward_ms, fwd)
        assert fwd["teacher"] > 0 and st.between_ms is not None
    rep, alone = build_report(run), build_report(fsdp_doctor.load_run(tmp_path / "student"))
    acts = alone.memory.per_rank["0"].peak_breakdown["activations"]
    assert acts > 0 and rep.memory.per_rank["0"].peak_breakdown["activations"] == acts
    rows = {u.unit: u.activation_bytes for u in rep.memory.per_rank["0"].per_unit}
    own = {u.unit: u.activation_bytes for u in alone.memory.per_rank["0"].per_unit}
    assert (rows["teacher"], rows["teacher.0"]) == (0, 0) and rows["student"] == own[""] > 0, (rows, own)
    assert rows["student.0"] == own["0"] > 0


def test_the_time_between_steps_where_the_watched_modules_forward_never_runs(tmp_path, gloo_one_rank):
    """A LightningModule is watched (the README's callback) but its forward never runs: training_step calls
    self.model, the FSDP root inside it, and Lightning's optimizer closure runs the last micro-batch inside
    optimizer.step(). The time between optimizer.step() and the next forward was never measured there (None), so
    jitter.data_wait read the whole time outside the model, the loss and the closure's own code with it, as data
    loading: a WARNING at 16% with a DataLoader fix on a real Trainer whose loader took 0.5 ms a step. Here the loop
    sleeps 30 ms for its batch and 10 ms between its two micro-batches, and computes its loss outside the model:
    between_ms holds the sleeps, and not the loss."""
    import time

    import fsdp_doctor

    _, student, opt = _teacher_and_student()

    class Module(torch.nn.Module):  # a LightningModule's shape: a forward of its own that nothing calls
        def __init__(self):
            super().__init__()
            self.model = student

        def forward(self, x):
            return self.model(x)

    lm = Module()
    with fsdp_doctor.watch(lm, opt, out_dir=tmp_path / "run", profile=False, memory=False) as doc:
        for _ in range(5):
            time.sleep(0.03)  # the next batch
            for micro in range(2):
                if micro:
                    time.sleep(0.01)
                out = lm.model(torch.randn(8, 16))
                loss = sum(out.square().mean() for _ in range(200))  # the loss, outside the model's forward
                loss.backward()
            opt.step()
            opt.zero_grad()
            doc.step()
    steps = fsdp_doctor.load_run(tmp_path / "run").ranks[0].steps
    for st in steps[1:]:
        assert st.between_ms is not None and 40.0 <= st.between_ms < st.outside_ms, (st.between_ms, st.outside_ms)
        assert st.backwards == 2 and st.forward_ms > 0, st


def test_an_exception_before_the_first_step_is_recorded_whole(tmp_path, gloo_one_rank):
    """torch's error for a tied weight split across units (336 characters: "Parameter 'tok_emb.weight' is shared ...
    to place them in the same FSDP ...") raised at the first forward was recorded cut at 200 characters, and
    analyze's line ended "in the same FSD" (a new-user trial): the end record keeps the first line whole."""
    from torch.distributed.fsdp import fully_shard

    import fsdp_doctor

    m = torch.nn.Linear(4, 4)
    fully_shard(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    msg = "Parameter 'tok_emb.weight' is shared " + "x" * 250 + " to place them in the same FSDP unit"
    with pytest.raises(ValueError):
        with fsdp_doctor.watch(m, opt, out_dir=tmp_path, profile=False):
            raise ValueError(msg)
    run = fsdp_doctor.load_run(tmp_path)
    assert run.ranks[0].end.exception == f"ValueError: {msg}"


def test_no_trace_says_its_windows_met_evaluations(tmp_path, gloo_one_rank):
    """A Trainer evaluating every 2 steps of 9: each profiler window met an evaluation and was dropped unsaved (as a
    window would read the evaluation as the step's), twice, and the report said only "needs a torch.profiler trace;
    this run has none" (a new-user trial). The rules that need a trace say why, with a window that the steps without
    an evaluation hold: here the evaluations run in steps 2, 4, 6 and 8 (4 the window's warm-up), so step 3 alone."""
    from torch.distributed.fsdp import fully_shard

    import fsdp_doctor
    from fsdp_doctor.pipeline import build_report

    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(2)])
    for layer in m:
        fully_shard(layer)
    fully_shard(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x = torch.randn(32, 64)
    with fsdp_doctor.watch(m, opt, out_dir=tmp_path / "run", memory=False,
                           profile=fsdp_doctor.ProfileSchedule(first=5, active=2)) as doc:
        for step in range(9):
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if step % 2 == 0 and step:
                with torch.no_grad():
                    m(x)
            doc.step()
    rep = build_report(fsdp_doctor.load_run(tmp_path / "run"))
    reasons = {r.reason for r in rep.rules if r.status == "skipped" and "profiler trace" in r.reason}
    assert any("windows met steps that also ran the model without gradients (steps 4, 6, 8: an evaluation) and were "
               "dropped unsaved" in r and "ProfileSchedule(first=3, active=1)) records step 3" in r
               for r in reasons), reasons


@pytest.fixture(scope="module")
def loops(tmp_path_factory):
    from test_clients import _launch

    return _launch("loops", 2, tmp_path_factory.mktemp("loops"), script="recorder_cases.py")[0]


def test_forwards_feeding_one_backward_are_not_gradient_accumulation(loops):
    """A new-user trial's GAN: the generator run twice with gradients (D's input, and a cross-entropy term) into one
    backward per step, beside its sharded discriminator. accum.sync_every_micro_batch read "2 reduce-scatters per unit
    per optimizer step: gradient accumulation syncs every micro-batch (2 micro-batches)" and printed
    set_requires_gradient_sync(is_last_micro_batch) "before each micro-batch's backward": there is one backward and no
    micro-batch loop. FSDP2 reduce-scatters the generator's units once a step (a second forward's post-backward finds
    no gradient left); the trace's extra ones are the discriminator's, whose units share the names "2" and the root
    and run two backwards a step. The records count the backward passes (1 a step; micro_batches stays 1), and the
    rule stays quiet saying so. Training is unchanged on both ranks."""
    for rank, res in enumerate(loops):
        gan = res["gan"]
        assert gan["identical"], rank
        assert gan["steps"] == list(range(8)) and gan["micro_batches"] == [1] * 8 and gan["backwards"] == [1] * 8, gan
    gan = loops[0]["gan"]
    # G's own units "1" once a step; "0" is D's alone (twice), "2" and the root both models' (1 + 2)
    assert gan["reduce_scatters"] == [["(root)", 3.0], ["0", 2.0], ["1", 1.0], ["2", 3.0]], gan["reduce_scatters"]
    status, reason = gan["accum"]["accum.sync_every_micro_batch"]
    assert status == "quiet" and reason == (
        "2 reduce-scatters per unit per step in the trace, but 1 backward pass through the model per optimizer step (2 "
        "forward passes feeding it): no gradient accumulation; FSDP2 reduce-scatters a unit once per backward. 3 FSDP2 "
        "units of another model are alive in this process: the trace counts their collectives under same-named units "
        "(its labels do not name the model)"), reason
    assert gan["accum"]["accum.regather"] == [
        "quiet", "2 forward passes per unit per optimizer step feed 1 backward: no micro-batches to gather between"]


@pytest.mark.parametrize("mode", ["skip", "skip_top"])
def test_a_skipped_optimizer_step_is_a_step_of_its_own(loops, mode):
    """A NaN/inf guard skipping optimizer.step() in steps 2 and 5 of 8, doctor.step() every iteration and the
    gradients zeroed all the same (after the guard, or at the loop's top): each skipped step was merged with the next
    as "2 micro-batches" (a new-user trial: 9 records of 12 steps, their numbers no longer the loop's, tokens/s ~25%
    low, nothing said). Each is a step of its own now, numbered as the loop counts, flagged, left out of the step
    statistics and said in one line; training unchanged."""
    for rank, res in enumerate(loops):
        r = res[mode]
        assert r["identical"], rank
        assert r["steps"] == list(range(8)) and r["micro_batches"] == [1] * 8 and r["skipped"] == [2, 5], r
        assert r["backwards"] == [1] * 8, r
    r = loops[0][mode]
    assert r["apart"]["skipped"] == (
        "2 of 8 steps skipped the optimizer step (steps 2, 5): a backward whose gradients were dropped with no step "
        "of the optimizer given to watch() (a NaN/inf guard, GradScaler); those steps are left out of the step "
        "statistics above"), r["apart"]
    for rank, res in enumerate(loops):  # (the steps the statistics keep: the skipped ones out, 3 or more left)
        kept = res[mode]["statistics"]
        assert len(kept) >= 3 and not {2, 5} & set(kept), (rank, kept)


def test_empty_steps_of_an_older_recorder_read_as_repeated_calls():
    """A recorder before StepRecord.repeated_calls recorded doctor.step() twice per step as a step of its own, empty
    (no forward, no backward, no optimizer step) and marked as an update skipped: read as the call repeated after
    the step before, not as a skipped update (a new-user trial: "10 of 20 steps skipped the optimizer step")."""
    from fsdp_doctor.analyze.steps import repeated_calls, skipped_steps
    from fsdp_doctor.records import End, StepRecord
    from fsdp_doctor.store.reader import RankData

    def rec(n, empty, skipped=False):
        return StepRecord(rank=0, step=n, start_ns=0, wall_ms=0.2 if empty else 30.0, forward_ms=0.0 if empty else 9.0,
                          backward_ms=0.0 if empty else 15.0, optimizer_ms=0.0 if empty or skipped else 4.0,
                          backwards=0 if empty else 1, optimizer_skipped=empty or skipped)

    steps = [rec(n, n % 2 == 1, skipped=n == 4) for n in range(6)]
    rd = RankData(rank=0, steps=steps, end=End(rank=0, steps=6, ended_ns=0))
    assert repeated_calls(rd) == [0, 2, 4]
    assert skipped_steps(steps).steps == [4]  # a real skipped update (a backward, its gradients dropped) stays one


def test_manifest_and_headers_say_their_format_and_version(tmp_path, gloo_one_rank, monkeypatch):
    """manifest.json and every stream's header carry the format's name and version: as defaults they were omitted
    (omit_defaults), and a later fsdp-doctor would have read today's files as its own version. Files without them
    (written before) read as version 1."""
    import json

    from torch.distributed.fsdp import fully_shard

    import fsdp_doctor
    import fsdp_doctor.store.reader as reader
    from fsdp_doctor.records import FORMAT_NAME, FORMAT_VERSION

    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    fully_shard(m[0])
    fully_shard(m)
    with fsdp_doctor.watch(m, out_dir=tmp_path / "run", profile=False) as doc:
        m(torch.randn(2, 4)).sum().backward()
        doc.step()
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    header = json.loads((tmp_path / "run" / "rank0.records.jsonl").read_text().splitlines()[0])
    for got in (manifest, header):
        assert (got["format"], got["version"]) == (FORMAT_NAME, FORMAT_VERSION) == ("fsdp-doctor-run", 1), got
    # a reader of version 2: today's files are version 1 to it, as are those written before the fields were
    monkeypatch.setattr(reader, "FORMAT_VERSION", 2)
    for edit in ({}, {"format": None, "version": None}):
        for name, doc in (("manifest.json", manifest), ("rank0.records.jsonl", header)):
            text = json.dumps({k: v for k, v in {**doc, **edit}.items() if v is not None})
            if name == "manifest.json":
                (tmp_path / "run" / name).write_text(text)
            else:
                lines = (tmp_path / "run" / name).read_text().splitlines()
                (tmp_path / "run" / name).write_text("\n".join([text, *lines[1:]]) + "\n")
        run = fsdp_doctor.load_run(tmp_path / "run")
        assert [s.step for s in run.ranks[0].steps] == [0] and not run.problems, run.problems
        assert reader._format_version(run.manifest) == reader._format_version(run.ranks[0].header) == (
            "fsdp-doctor-run", 1)


def test_an_unsupported_torch_steps_aside_and_training_goes_on(tmp_path, gloo_one_rank, monkeypatch, caplog):
    """On a torch the doctor cannot read (older than 2.6), watch() raised WatchError: a new-user trial's job ended
    before its first step. It now says so in one line, records nothing, and the loop trains as it would without it."""
    from torch.distributed.fsdp import fully_shard

    import fsdp_doctor
    from fsdp_doctor.record import fsdp2 as F2

    def train(watch: bool) -> list[float]:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
        fully_shard(m[0])
        fully_shard(m)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        x, losses = torch.randn(8, 16), []
        with (fsdp_doctor.watch(m, opt, out_dir=tmp_path / "run") if watch else contextlib.nullcontext()) as doc:
            for _ in range(3):
                loss = m(x).square().mean()
                losses.append(loss.item())
                loss.backward()
                opt.step()
                opt.zero_grad()
                if watch:
                    doc.step()
        return losses

    monkeypatch.setattr(F2, "unsupported_reason", lambda: "torch 2.5.1 is not supported: fsdp_doctor reads FSDP2 "
                                                          "(fully_shard) internals of torch >= 2.6")
    with caplog.at_level("WARNING", logger="fsdp_doctor"):
        assert train(True) == train(False)
    said = [r.getMessage() for r in caplog.records if "not supported" in r.getMessage()]
    assert said == ["fsdp_doctor: torch 2.5.1 is not supported: fsdp_doctor reads FSDP2 (fully_shard) internals of "
                    "torch >= 2.6; watch() records nothing and training goes on"], caplog.messages
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_the_step_timer_times_a_unit_inside_a_compiled_frame_from_fsdps_forward_logs():
    """A unit inside another module's compiled frame (``model = torch.compile(model)`` after sharding) gets none of
    the doctor's hooks: its forward is FSDP2's pre-forward log to its post-forward log (FSDP2's hooks run outside
    compiled code), each of a grouped unit's modules a span of its own; a unit the doctor's hooks time (the root here)
    keeps its time from them, FSDP's forward logs ignored, and a forward without gradients is no training forward."""
    from types import SimpleNamespace

    from fsdp_doctor.record.hooks import StepTimer, _UnitAcc

    timer = StepTimer(lambda *a: None)
    names = ["", "layers.0", "norm, lm_head"]
    timer._units = [SimpleNamespace(name=n, param_groups=[]) for n in names]
    timer._acc = {i: _UnitAcc() for i in range(3)}
    timer._unit_of_label = {n: i for i, n in enumerate(names)}
    timer.fsdp_timed = {1, 2}
    timer.active = True
    timer.begin_step()
    for label, t_ms in [("FSDP::pre_forward", 0.0), ("FSDP::pre_forward (layers.0)", 1.0),
                        ("FSDP::post_forward (layers.0)", 3.5), ("FSDP::pre_forward (norm, lm_head)", 4.0),
                        ("FSDP::post_forward (norm, lm_head)", 4.5), ("FSDP::pre_forward (norm, lm_head)", 5.0),
                        ("FSDP::post_forward (norm, lm_head)", 6.0), ("FSDP::post_forward", 9.0)]:
        timer._on_fsdp_log(label, int(t_ms * 1e6))
    timer._no_grad_t0 = 1  # (the model's forward under torch.no_grad(): evaluation)
    timer._on_fsdp_log("FSDP::pre_forward (layers.0)", 20_000_000)
    timer._on_fsdp_log("FSDP::post_forward (layers.0)", 29_000_000)
    timer._no_grad_t0 = 0
    got = {u.name: (u.fwd_ms, u.fwd_calls, u.ag_wait_fwd_ms) for u in timer.timings().units}
    assert got == {"": (0.0, 0, 0.0), "layers.0": (2.5, 1, 0.0), "norm, lm_head": (1.5, 2, 0.0)}, got


def test_a_rank_waits_for_rank_0s_value_a_bounded_time(gloo_one_rank, monkeypatch):
    """The ranks take rank 0's run id through the job's store (no collective at watch()): rank 0 gives it and goes on;
    a rank whose rank 0 never enters watch() (watch() on some ranks only) waits LEAD_WAIT_S, then its doctor steps
    aside with one line saying why (the process group's 30 minutes held it), training going on."""
    from fsdp_doctor.record import run_device as RD

    monkeypatch.setattr(RD, "LEAD_WAIT_S", 0.3)
    assert RD.share_from_rank0(0, None)({"run_id": "abc"}) == {"run_id": "abc"}
    with pytest.raises(TimeoutError, match=r"rank 0 did not enter watch\(\) within 0 s \(watch\(\) on some ranks only"):
        RD.share_from_rank0(1, None)({"run_id": None})


def test_a_rank_whose_store_is_gone_says_so_at_once(gloo_one_rank, monkeypatch):
    """A store that fails at once is no timeout: rank 0's loop raised at its first forward and its process ended,
    taking the store it held (torch.multiprocessing.spawn's rank 0 holds it), while rank 1 still read it. Its line
    said "rank 0 did not enter watch() within 300 s" at once (a new-user trial's VAE); it names the store now."""
    from torch.distributed import DistNetworkError
    from torch.distributed import distributed_c10d as c10d

    from fsdp_doctor.record import run_device as RD

    class Gone:  # the store's server ended with rank 0's process
        def wait(self, keys, timeout):
            raise DistNetworkError("failed to recv, got 0 bytes\nException raised from recvBytes")

    monkeypatch.setattr(c10d, "_get_default_store", lambda: Gone())
    with pytest.raises(ConnectionError) as e:
        RD.share_from_rank0(1, None)({"run_id": None})
    assert str(e.value) == ("the job's store could not be read (DistNetworkError: failed to recv, got 0 bytes): the "
                            "process holding it (rank 0's, where torch.multiprocessing.spawn started the job) may "
                            "have ended first"), e.value
