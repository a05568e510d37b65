"""Builders of Kineto-format traces whose analysis results are known exactly by construction, and a
plain-torch.profiler hook for real FSDP2 runs.

Times in the builders are µs relative to a base; ``write`` serializes a trace as ``.json`` or
``.json.gz`` (optionally with integer-nanosecond timestamps).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

BASE_US = 1_700_000_000_000.0  # a realistic absolute µs clock


@dataclass
class TraceBuilder:
    rank: Optional[int] = 0
    world_size: int = 2
    pid: int = 100
    main_tid: int = 100
    bwd_tid: int = 101  # the autograd thread on GPU
    events: list = field(default_factory=list)
    _corr: int = 1000

    # ------------------------------------------------------------------ generic
    def x(self, name, ts, dur, cat="cpu_op", tid=None, pid=None, **args):
        ev = {"ph": "X", "cat": cat, "name": name, "pid": self.pid if pid is None else pid,
              "tid": self.main_tid if tid is None else tid, "ts": BASE_US + ts, "dur": dur}
        if args:
            ev["args"] = args
        self.events.append(ev)
        return ev

    def step(self, n, ts, dur):
        return self.x(f"ProfilerStep#{n}", ts, dur, cat="user_annotation")

    def label(self, name, ts, dur, tid=None):
        return self.x(name, ts, dur, cat="user_annotation", tid=tid)

    # ------------------------------------------------------------------ GPU
    def kernel(self, name, ts, dur, stream=7, launch_ts=None, tid=None, cat="kernel", **args):
        """A device event plus its cudaLaunchKernel (at launch_ts on the host thread tid)."""
        self._corr += 1
        corr = self._corr
        lt = ts - 5.0 if launch_ts is None else launch_ts
        self.x("cudaLaunchKernel" if cat == "kernel" else "cudaMemcpyAsync", lt, 2.0, cat="cuda_runtime",
               tid=tid, correlation=corr)
        a = {"device": 0, "stream": stream, "correlation": corr, "External id": corr}
        a.update(args)
        return self.x(name, ts, dur, cat=cat, pid=0, tid=stream, **a)

    def backlog(self, name, ts, dur, stream=7):
        """A device event whose launch the trace does not hold: launched before the profiler's active steps (during
        its warm-up) and run in them, where the host runs ahead of the device."""
        self._corr += 1
        return self.x(name, ts, dur, cat="kernel", pid=0, tid=stream, device=0, stream=stream,
                      correlation=self._corr)

    def compute(self, ts, dur, launch_ts=None, tid=None, stream=7):
        return self.kernel("void at::native::elementwise_kernel<128, 4>(int)", ts, dur, stream=stream,
                           launch_ts=launch_ts, tid=tid)

    def nccl(self, coll, ts, dur, launch_ts, tid=None, nelems=None, dtype="Float", stream=20):
        camel = {"all_gather": "AllGather", "reduce_scatter": "ReduceScatter", "all_reduce": "AllReduce"}[coll]
        args = {}
        if nelems is not None:
            shard = nelems // self.world_size
            i, o = (shard, nelems) if coll == "all_gather" else (nelems, shard)
            if coll == "all_reduce":
                i = o = nelems
            args = {"In msg nelems": i, "Out msg nelems": o, "Group size": self.world_size, "dtype": dtype,
                    "Collective name": coll}
        return self.kernel(f"ncclDevKernel_{camel}_RING_LL(ncclDevKernelArgsStorage<4096ul>)", ts, dur,
                           stream=stream, launch_ts=launch_ts, tid=tid, **args)

    def device_sync(self, ts, dur, tid=None):
        """A host ``cudaDeviceSynchronize`` (torch.profiler calls one as it stops a CUDA trace)."""
        self._corr += 1
        return self.x("cudaDeviceSynchronize", ts, dur, cat="cuda_runtime", tid=tid, correlation=self._corr)

    def memcpy(self, kind, ts, dur, launch_ts=None, stream=7):
        name = {"h2d": "Memcpy HtoD (Pinned -> Device)", "d2h": "Memcpy DtoH (Device -> Pinned)"}[kind]
        return self.kernel(name, ts, dur, stream=stream, launch_ts=launch_ts, cat="gpu_memcpy")

    # ------------------------------------------------------------------ CPU / gloo
    def gloo(self, name, ts, dur, tid=200):
        return self.x(f"gloo:{name}", ts, dur, cat="user_annotation", tid=tid)

    def op(self, name, ts, dur, tid=None, **args):
        return self.x(name, ts, dur, cat="cpu_op", tid=tid, **args)

    # ------------------------------------------------------------------ memory (profile_memory=True)
    def memory(self, ts, total, device_type=0, device_id=-1):
        """A ``[memory]`` instant: the allocator's total after it (device type 0: the CPU's)."""
        self.events.append({"ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]", "pid": self.pid,
                            "tid": self.main_tid, "ts": BASE_US + ts,
                            "args": {"Total Reserved": 0, "Total Allocated": total, "Bytes": 1, "Device Id": device_id,
                                     "Device Type": device_type, "Addr": 1, "Ev Idx": len(self.events)}})

    # ------------------------------------------------------------------ output
    def document(self):
        doc = {"schemaVersion": 1, "traceEvents": list(self.events), "displayTimeUnit": "ms",
               "baseTimeNanoseconds": 1_700_000_000_000_000_000}
        doc["traceEvents"].append({"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans",
                                   "tid": "PyTorch Profiler", "ts": BASE_US - 100, "dur": 1e9})
        doc["traceEvents"].append({"ph": "M", "name": "thread_name", "pid": self.pid, "tid": self.main_tid,
                                   "args": {"name": "python"}})
        if self.rank is not None:
            doc["distributedInfo"] = {"backend": "nccl", "rank": self.rank, "world_size": self.world_size}
        return doc

    def write(self, path, ns=False):
        doc = self.document()
        if ns:  # integer nanoseconds, as some exporters write them
            for e in doc["traceEvents"]:
                for k in ("ts", "dur"):
                    if k in e:
                        e[k] = int(round(e[k] * 1000))
            doc["displayTimeUnit"] = "ns"
        data = json.dumps(doc).encode()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
        return path


# ====================================================================== known-answer GPU trace
# One rank, 3 steps (the last is dropped as incomplete), units "layers.0" and "layers.1", NCCL on
# stream 20, compute on stream 7, backward launched from the autograd thread. µs, T = 1000·step_index:
#   forward:  AG(layers.0) [T+0, T+100) with no compute under it: exposed 100; copy-out at T+10 → slack -90
#             compute [T+100, T+300)
#             prefetch=True:  AG(layers.1) [T+150, T+250) issued in FSDP::forward_prefetch: hidden;
#                             copy-out at T+260, compute stream busy until T+300 → need T+300, slack +50;
#                             layers.1 compute [T+300, T+400)
#             prefetch=False: AG(layers.1) [T+300, T+400) issued at its pre_forward: exposed 100;
#                             need T+300 → slack -100; layers.1 compute [T+400, T+420)
#   backward: AG(layers.1) [T+450, T+550), compute [T+500, T+600): exposed 50; copy-out T+430 → slack -120
#             RS(layers.1) [T+600, T+700), compute [T+640, T+800): exposed 40
#             RS(layers.0) [T+800, T+900): exposed 100
#   copies:   Memcpy HtoD [T+900, T+950) exposed 50; DtoH [T+960, T+980) under compute [T+950, T+990)
# Per step, prefetch on: comm 500, overlap 210; prefetch off: comm 500, overlap 110.
# extra_unit_events adds a non-FSDP all_reduce [T+990, T+995) (exposed 5) attributed to "(other)".


def gpu_known_trace(rank=0, steps=(1, 2), prefetch=True, extra_unit_events=False, world_size=2,
                    optimizer=False) -> TraceBuilder:
    """``optimizer``: each step also holds torch.optim's ``Optimizer.step#AdamW.step`` label [T+860, T+880) on the
    main thread."""
    b = TraceBuilder(rank=rank, world_size=world_size)
    M, B = b.main_tid, b.bwd_tid
    all_steps = list(steps) + [steps[-1] + 1]
    for i, n in enumerate(all_steps):
        T = 1000.0 * i
        b.step(n, T, 1000.0)
        b.label("FSDP::root_pre_forward", T + 0.5, 1.0)
        b.label("FSDP::pre_forward (layers.0)", T + 1, 20)
        b.label("FSDP::all_gather (layers.0)", T + 2, 5)
        b.nccl("all_gather", T + 0, 100, launch_ts=T + 3, nelems=1_000_000)
        b.label("FSDP::all_gather_copy_out (layers.0)", T + 10, 5)  # needed at T+10 → slack -90
        b.compute(T + 100, 200, launch_ts=T + 11)
        if prefetch:  # issued early by FSDP::forward_prefetch: runs under layers.0's compute
            b.label("FSDP::forward_prefetch for layers.1", T + 20, 10)
            b.label("FSDP::all_gather (layers.1)", T + 21, 8)
            b.nccl("all_gather", T + 150, 100, launch_ts=T + 22, nelems=2_000_000)
            b.label("FSDP::pre_forward (layers.1)", T + 255, 10)
            b.label("FSDP::all_gather_copy_out (layers.1)", T + 260, 2)  # compute stream ready at T+300
            b.compute(T + 300, 100, launch_ts=T + 262)
        else:  # issued at layers.1's pre_forward: runs alone, layers.1's compute waits for it
            b.label("FSDP::pre_forward (layers.1)", T + 255, 10)
            b.label("FSDP::all_gather (layers.1)", T + 256, 2)
            b.nccl("all_gather", T + 300, 100, launch_ts=T + 257, nelems=2_000_000)
            b.label("FSDP::all_gather_copy_out (layers.1)", T + 260, 2)
            b.compute(T + 400, 20, launch_ts=T + 262)
        # backward, on the autograd thread
        b.label("FSDP::pre_backward (layers.1)", T + 420, 30, tid=B)
        b.label("FSDP::all_gather (layers.1)", T + 421, 5, tid=B)
        b.nccl("all_gather", T + 450, 100, launch_ts=T + 422, tid=B, nelems=2_000_000)
        b.label("FSDP::all_gather_copy_out (layers.1)", T + 430, 5, tid=B)
        b.compute(T + 500, 100, launch_ts=T + 431, tid=B)
        b.label("FSDP::post_backward_reduce (layers.1)", T + 590, 5, tid=B)
        b.nccl("reduce_scatter", T + 600, 100, launch_ts=T + 591, tid=B, nelems=2_000_000)
        b.compute(T + 640, 160, launch_ts=T + 596, tid=B)
        b.label("FSDP::post_backward_reduce (layers.0)", T + 795, 5, tid=B)
        b.nccl("reduce_scatter", T + 800, 100, launch_ts=T + 796, tid=B, nelems=1_000_000)
        b.memcpy("h2d", T + 900, 50, launch_ts=T + 850)
        b.compute(T + 950, 40, launch_ts=T + 851)
        b.memcpy("d2h", T + 960, 20, launch_ts=T + 852, stream=8)
        if extra_unit_events:  # a non-FSDP collective (e.g. a user all_reduce): attributed to "(other)"
            b.nccl("all_reduce", T + 990, 5, launch_ts=T + 853, nelems=10)
        if optimizer:
            b.label("Optimizer.step#AdamW.step", T + 860, 20)
    return b


# ====================================================================== known-answer CPU/gloo trace
# One rank, steps 5, 6 (+7 dropped). Main thread 100, gloo thread 200. Per step (offset T = 10000*i):
#   forward, synchronous all-gather of "0": label [T+10, T+1190) ⊃ c10d op [T+20, T+100);
#       gloo:all_gather [T+50, T+1050) — host blocked: overlap 0 (the label/wait is not compute)
#   compute aten::mm [T+1200, T+2200) (with a child aten::empty [T+1300, T+1310): still compute)
#   forward, async all-gather of "1": label [T+2300, T+2396) ⊃ c10d op [T+2310, T+2390);
#       gloo:all_gather [T+2350, T+3350); compute aten::addmm [T+2400, T+3000) → overlap 600, exposed 400;
#       copy-out label [T+3000, T+3400) (wait inside): needed at T+3000 → slack -350
#   backward: label FSDP::pre_backward (1) at T+3500; reduce-scatter of "1": label
#       FSDP::post_backward_reduce (1) [T+3600, T+3700) ⊃ c10d::_reduce_scatter_base_ [T+3610, T+3690);
#       gloo:all_reduce [T+3650, T+4650); compute autograd op [T+3700, T+4300) → overlap 600
# comm per step 3000, overlap 1200.


def gloo_known_trace(rank=0, steps=(5, 6), tp_wait=False, optimizer=False) -> TraceBuilder:
    """``optimizer``: each step also holds torch.optim's ``Optimizer.step#AdamW.step`` label [T+4700, T+4900), over
    an ``aten::add_`` [T+4710, T+4890).

    ``tp_wait``: tensor parallelism's all-reduce in the forward, between the units, as torch issues it on gloo: a
    functional all-reduce [T+2200, T+2210) over its c10d op, then its ``_c10d_functional::wait_tensor``
    [T+2210, T+2280) on the main thread, under which the gloo event [T+2205, T+2225) ends early (the gloo worker ran
    late on a loaded host: 55 µs of the wait under no gloo event)."""
    b = TraceBuilder(rank=rank)
    b.pid = b.main_tid = 100
    all_steps = list(steps) + [steps[-1] + 1]
    for i, n in enumerate(all_steps):
        T = 10000.0 * i
        b.step(n, T, 9000.0)
        b.label("FSDP::root_pre_forward", T + 1, 2)
        b.label("FSDP::pre_forward (0)", T + 5, 1190)
        b.label("FSDP::all_gather (0)", T + 10, 1180)
        b.op("c10d::_allgather_base_", T + 20, 80, **{"Input Dims": [[200], [100]], "Input type": ["float", "float"]})
        b.gloo("all_gather", T + 50, 1000)
        b.op("aten::mm", T + 1200, 1000)
        b.op("aten::empty", T + 1300, 10)
        if tp_wait:
            b.op("_c10d_functional::all_reduce", T + 2200, 10)
            b.op("c10d::allreduce_", T + 2202, 6, **{"Input Dims": [[[2, 16, 32]], [], []],
                                                    "Input type": ["TensorList", "", ""]})
            b.x("gloo:all_reduce", T + 2205, 20, cat="user_annotation", tid=202,
                **{"Input Dims": [[2, 16, 32]], "Input type": ["float"]})
            b.op("_c10d_functional::wait_tensor", T + 2210, 70)
        b.label("FSDP::pre_forward (1)", T + 2290, 108)
        b.label("FSDP::all_gather (1)", T + 2300, 96)
        b.op("c10d::_allgather_base_", T + 2310, 80)
        b.gloo("all_gather", T + 2350, 1000, tid=201)
        b.op("aten::addmm", T + 2400, 600)
        b.label("FSDP::all_gather_copy_out (1)", T + 3000, 400)
        b.label("FSDP::pre_backward (1)", T + 3500, 50)
        b.label("FSDP::post_backward_reduce (1)", T + 3600, 100)
        b.op("c10d::_reduce_scatter_base_", T + 3610, 80)
        b.gloo("all_reduce", T + 3650, 1000)
        b.op("autograd::engine::evaluate_function: AddmmBackward0", T + 3700, 600)
        if optimizer:
            b.label("Optimizer.step#AdamW.step", T + 4700, 200)
            b.op("aten::add_", T + 4710, 180)
    return b


def gloo_gather_trace(sync: bool, prefetch: bool, steps=(5, 6), dtype: Optional[str] = None,
                      gathered: int = 198272) -> TraceBuilder:
    """A gloo forward of units "0" and "1", each all-gathered for 1000 µs with no compute under it, then computing
    1000 µs (steps 10,000 µs apart, 9,000 long; the last cut). ``sync``: the host sits in each all-gather (its
    ``FSDP::all_gather`` label and c10d op hold it to the end, the synchronous unshard), else it issues it and goes on
    (the label and op end 80 µs in, the copy-out comes after it: async unshard). ``prefetch``: unit "1"'s all-gather is
    issued under ``FSDP::forward_prefetch for 1`` (explicit forward prefetch), else under its own pre-forward. The
    same times either way: per step 2000 µs of exposed all-gather (20% of 10,000), 2 all-gathers, both blocking the
    host where ``sync``. ``dtype``: the c10d ops carry record_shapes args (``record_shapes=True``), each all-gather
    ``gathered`` elements of ``dtype`` as the trace names it ("float", "c10::BFloat16": 774.50 KiB and 387.25 KiB at
    the default size, a new-user trial's blocks), from a shard of half as many; without it, no args."""
    b = TraceBuilder(rank=0)
    shapes = {} if dtype is None else {"Input Dims": [[gathered], [gathered // 2]], "Input type": [dtype, dtype]}
    b.pid = b.main_tid = 100
    for i, n in enumerate(list(steps) + [steps[-1] + 1]):
        T = 10000.0 * i
        b.step(n, T, 9000.0)
        b.label("FSDP::root_pre_forward", T + 1, 2)
        for unit, t in (("0", T + 10), ("1", T + 2210)):
            b.label(f"FSDP::forward_prefetch for {unit}" if (prefetch and unit == "1") else
                    f"FSDP::pre_forward ({unit})", t - 5, 1090 if sync else 100)
            b.label(f"FSDP::all_gather ({unit})", t, 1080 if sync else 90)
            b.op("c10d::_allgather_base_", t + 10, 1070 if sync else 80, **shapes)
            b.gloo("all_gather", t + 40, 1000)
            if not sync:
                b.label(f"FSDP::all_gather_copy_out ({unit})", t + 1045, 40)
            b.op("aten::mm", t + 1100, 1000)
    return b


# ====================================================================== real runs
class ProfileWindow:
    """``on_step`` hook for ``fsdp_doctor.workloads.train``: plain torch.profiler with a schedule writing
    ``rank{R}.{step}.pt.trace.json.gz`` into ``out_dir`` (module-level, so it pickles to spawned ranks)."""

    def __init__(self, out_dir, warmup=1, active=3, profile_memory=False, record_shapes=False):
        self.out_dir = str(out_dir)
        self.warmup = warmup
        self.active = active
        self.profile_memory = profile_memory  # [memory] instant events (Total Allocated, Bytes)
        self.record_shapes = record_shapes  # operators' input dims and types (the collectives' sizes and dtypes)
        self._prof = None

    def __call__(self, step, model=None, optimizer=None, loss=None):
        import torch
        import torch.distributed as dist

        if self._prof is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
            out = self.out_dir

            def ready(p):
                p.export_chrome_trace(f"{out}/rank{rank}.{p.step_num}.pt.trace.json.gz")

            self._prof = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU],
                schedule=torch.profiler.schedule(wait=0, warmup=self.warmup, active=self.active, repeat=1),
                on_trace_ready=ready,
                profile_memory=self.profile_memory,
                record_shapes=self.record_shapes,
            )
            self._prof.start()
            self._calls = 0
            return
        self._prof.step()
        self._calls += 1
        if self._calls == self.warmup + self.active:
            self._prof.stop()

    def steps_needed(self) -> int:
        return 1 + self.warmup + self.active


class WholeRunProfile:
    """``on_step`` hook: plain torch.profiler without a schedule, started after the first step and stopped after
    ``steps`` more, one ``export_chrome_trace`` per rank (``rank{R}.json``): no ``ProfilerStep`` markers, and the
    profile starts mid-loop (at the hook, after optimizer.step())."""

    def __init__(self, out_dir, steps=4):
        self.out_dir, self.steps, self._prof, self._calls = str(out_dir), steps, None, 0

    def __call__(self, step, model=None, optimizer=None, loss=None):
        import torch
        import torch.distributed as dist

        if self._prof is None:
            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self._prof.start()
            return
        self._calls += 1
        if self._calls == self.steps:
            self._prof.stop()
            self._prof.export_chrome_trace(f"{self.out_dir}/rank{dist.get_rank() if dist.is_initialized() else 0}.json")

    def steps_needed(self) -> int:
        return 1 + self.steps


class TensorBoardProfile:
    """``on_step`` hook: plain torch.profiler as its tutorial has it, ``schedule(wait=1, warmup=1, active=2)`` (repeating)
    with ``tensorboard_trace_handler(out_dir)``, stepped after every step and stopped after ``steps``: at the stop the
    schedule's second cycle has begun recording, and the handler writes one more file per rank holding only that
    cycle's ``ProfilerStep`` marker."""

    def __init__(self, out_dir, steps=6):
        self.out_dir, self.steps, self._prof, self._calls = str(out_dir), steps, None, 0

    def __call__(self, step, model=None, optimizer=None, loss=None):
        import torch

        if self._prof is None:
            self._prof = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU],
                schedule=torch.profiler.schedule(wait=1, warmup=1, active=2),
                on_trace_ready=torch.profiler.tensorboard_trace_handler(self.out_dir))
            self._prof.start()
            return
        self._prof.step()
        self._calls += 1
        if self._calls == self.steps:
            self._prof.stop()

    def steps_needed(self) -> int:
        return 1 + self.steps


class DcpSaves:
    """``on_step`` hook: the model's and the optimizer's state saved with torch.distributed.checkpoint every ``every``
    steps (after the step's ``doctor.step()``: the recorder counts it in the next step), as users write it:
    ``dcp.save``, or with ``asynchronous`` ``dcp.async_save`` on a gloo group of its own made once (on the default
    group gloo's collectives and training's interleave), its future waited on before the next save and after the
    last step. No save after the last step (the recorder would count it in no step)."""

    def __init__(self, out_dir, every, steps, asynchronous=False):
        self.out_dir, self.every, self.steps, self.asynchronous = str(out_dir), every, steps, asynchronous
        self._group = self._future = None

    def __call__(self, step, model=None, optimizer=None, loss=None):
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        if (step + 1) % self.every == 0 and step < self.steps - 1:
            if self._future is not None:
                self._future.result()
            where = f"{self.out_dir}/step{step + 1}"
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            if not self.asynchronous:
                dcp.save(state, checkpoint_id=where)
                return
            if self._group is None:
                self._group = dist.new_group(backend="gloo")
            self._future = dcp.async_save(state, checkpoint_id=where, process_group=self._group)
        elif step == self.steps - 1 and self._future is not None:
            self._future.result()
            self._future = None


# ====================================================================== FSDP2-shaped GPU traces
EPS = 0.01  # µs: the width of a host label around one launch


def _of_step(v, k: int) -> float:
    """A per-step knob's value in step ``k``: ``v`` itself, or its k-th value where a list (0 past its end)."""
    return v if isinstance(v, (int, float)) else (v[k] if k < len(v) else 0.0)


def fsdp_gpu_trace(*, units=4, steps=2, ag_us=50.0, fwd_us=100.0, bwd_us=0.0, rs_us=0.0, opt_us=0.0,
                   prefetch=False, h2d_us=0.0, loader_us=0.0, launch_gap_us=0.0, nelems=1_000_000,
                   nccl_stream=20, rank=0, world_size=8, step_skew_us=0.0, first_ag_wait_us=0.0,
                   sync_allreduce_us=0.0, host_ahead_us=0.0) -> TraceBuilder:
    """An FSDP2-shaped GPU trace simulated on two streams (compute 7, NCCL ``nccl_stream``), ``steps``
    complete steps plus one that the analysis cuts. Per step: an optional data-loader label of ``loader_us``
    (nothing launched meanwhile), then forward over ``units`` units (optionally an H2D copy of ``h2d_us`` on
    the compute stream before each all-gather: CPU offload's copy-in), backward in reverse order (when
    ``bwd_us``; a reduce-scatter of ``rs_us`` after each unit's backward), then an optimizer kernel of
    ``opt_us``. Without ``prefetch`` a unit's all-gather starts only once the previous kernel of the compute
    stream is done (nothing hides it); with it, each all-gather is issued when the previous unit's compute
    is launched and runs under it. The host launches one kernel every ``launch_gap_us`` (0: at once), and a
    kernel never starts before its launch. ``step_skew_us`` adds that much host time (a slow rank) before
    each step's forward, inside the model (after the root pre-forward); ``first_ag_wait_us`` lengthens each
    step's first all-gather by that much (this rank waits inside it for a late rank); either a list: one value per
    step (the cut one's 0); ``sync_allreduce_us`` adds,
    after the optimizer, the loop's synchronous all-reduce of one float (a loss for logging) taking that long on the
    compute stream, as torch 2.8+ launches an ``async_op=False`` collective on the current stream;
    ``host_ahead_us``: the host runs that far ahead of the device (no sync in the loop): the device starts the first
    step busy with earlier work whose launch the trace does not hold (the profiler's warm-up step's), and each
    step's host span ends that long before its device work does."""
    b = TraceBuilder(rank=rank, world_size=world_size)
    bwd_tid = b.bwd_tid
    T = 0.0
    names = [f"layers.{i}" for i in range(units)]
    dev_free = 0.0  # when the device is done with the previous step's work
    if host_ahead_us:
        b.backlog("void at::native::elementwise_kernel<128, 4>(int)", 0.0, host_ahead_us)
        dev_free = host_ahead_us
    for k in range(steps + 1):
        host = T
        comp_free = comm_free = max(T, dev_free)

        def launch():
            nonlocal host
            t = host
            host += launch_gap_us if launch_gap_us else EPS
            return t

        if loader_us:
            b.label("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", host, loader_us)
            host += loader_us
            comp_free = comm_free = max(host, comp_free)
        b.label("FSDP::root_pre_forward", host, EPS)  # the first launch is at its start
        skew = _of_step(step_skew_us, k)
        if skew:
            host += skew
            comp_free = comm_free = max(host, comp_free)

        first = [_of_step(first_ag_wait_us, k)]

        def all_gather(unit, tid=None, after=None):
            nonlocal comm_free, comp_free
            t = launch()
            b.label(f"FSDP::all_gather ({unit})", t, EPS, tid=tid)
            start = max(comm_free, t, after if after is not None else comm_free)
            dur = ag_us + first.pop() if first else ag_us
            b.nccl("all_gather", start, dur, launch_ts=t, tid=tid, nelems=nelems, stream=nccl_stream)
            comm_free = start + dur
            if nccl_stream == 7:
                comp_free = comm_free
            return start + ag_us

        def compute(dur, tid=None, after=0.0):
            nonlocal comp_free, comm_free
            t = launch()
            start = max(comp_free, t, after)
            b.compute(start, dur, launch_ts=t, tid=tid)
            comp_free = start + dur
            if nccl_stream == 7:
                comm_free = comp_free
            return comp_free

        # forward
        ready = None
        for i, u in enumerate(names):
            b.label(f"FSDP::pre_forward ({u})", host, EPS)
            if h2d_us:
                t = launch()
                s = max(comp_free, t)
                b.memcpy("h2d", s, h2d_us, launch_ts=t)
                comp_free = comm_free = s + h2d_us
            if ready is None:  # not prefetched: issued now, after the compute stream's previous work
                ready = all_gather(u, after=comp_free)
            compute_launch = host
            b.label(f"FSDP::all_gather_copy_out ({u})", compute_launch, EPS)
            if prefetch and i + 1 < units:
                host += EPS
                b.label(f"FSDP::forward_prefetch for {names[i + 1]}", host, 2 * EPS)
                nxt = all_gather(names[i + 1])
                end = compute(fwd_us, after=ready)
                ready = nxt
            else:
                end = compute(fwd_us, after=ready)
                ready = None
            b.label(f"FSDP::post_forward ({u})", host, EPS)
            host += EPS
        # backward (autograd thread)
        if bwd_us:
            ready = None
            for j, u in enumerate(reversed(names)):
                i = units - 1 - j
                b.label(f"FSDP::pre_backward ({u})", host, EPS, tid=bwd_tid)
                host += EPS
                if ready is None:
                    ready = all_gather(u, tid=bwd_tid, after=comp_free)
                b.label(f"FSDP::all_gather_copy_out ({u})", host, EPS, tid=bwd_tid)
                if prefetch and i > 0:
                    host += EPS
                    b.label(f"FSDP::backward_prefetch for {names[i - 1]}", host, 2 * EPS, tid=bwd_tid)
                    nxt = all_gather(names[i - 1], tid=bwd_tid)
                else:
                    nxt = None
                end = compute(bwd_us, tid=bwd_tid, after=ready)
                ready = nxt
                if rs_us:
                    t = launch()
                    b.label(f"FSDP::post_backward_reduce ({u})", t, EPS, tid=bwd_tid)
                    s = max(comm_free, t, end)
                    b.nccl("reduce_scatter", s, rs_us, launch_ts=t, tid=bwd_tid, nelems=nelems, stream=nccl_stream)
                    comm_free = s + rs_us
                    if nccl_stream == 7:
                        comp_free = comm_free
        if opt_us:
            b.label("Optimizer.step#AdamW.step", host, EPS)
            compute(opt_us, after=max(comp_free, comm_free))
        if sync_allreduce_us:
            t = launch()
            s = max(comp_free, t)
            b.nccl("all_reduce", s, sync_allreduce_us, launch_ts=t, nelems=1, stream=7)
            comp_free = s + sync_allreduce_us
        dev_free = max(comp_free, comm_free)
        end = max(host, dev_free - host_ahead_us)
        b.step(k + 1, T, end - T)
        T = end
    return b
