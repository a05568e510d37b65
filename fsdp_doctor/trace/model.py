"""The typed intermediate model: one profiler window of one rank, reduced to interval arrays and a short
list of collective calls. Built from a decoded trace by :func:`build_window`; the analyses in
``fsdp_doctor.trace.analysis`` are plain functions over it.

Semantics (see the module docstring of ``analysis`` for the metrics):

* Time is in µs (float64) on the trace's own clock. Traces whose ``ts`` are integer nanoseconds
  (``displayTimeUnit: "ns"`` with integer timestamps, or timestamps too large to be µs) are divided by 1000.
* Complete steps, as HTA does it: when a window has two or more ``ProfilerStep#N`` markers, the last step is
  dropped. On GPU, a device event is kept when its launch (the CPU event with the same ``correlation``)
  started before the last step's start; on CPU, an event is kept when it starts before it.
* GPU classes follow HTA 0.5.0: communication ``^nccl.*Kernel``; memory ``^Memcpy|^Memset|^dma``; compute:
  every other device event except names containing ``Sync`` or ``Memcpy``.
* The verdict's timeline (``window``, ``gpu_busy``, ``other_dev``, ``host_wait``, ``outside``): the analysis
  window is the complete steps' host span (first kept ``ProfilerStep`` start to the cut; one step: its span);
  ``host_wait`` is where the GPU sat idle before a device event that the host had not launched yet (the
  gap before each run of device activity, up to that event's launch, and the idle tail of the window);
  ``outside`` is host time outside the model: data-loader ``enumerate(DataLoader)#...`` labels and, when FSDP
  labels delimit the model, each step's time before its ``FSDP::root_pre_forward`` and after its last
  ``FSDP::*`` / ``Optimizer.*`` label.
* CPU/gloo: communication = ``gloo:*`` events (they run on gloo threads); compute = time on the main thread
  (the thread carrying the FSDP labels / ProfilerStep markers) whose innermost event is an operator
  (``cpu_op``) that is not a c10d/communication/wait op nor nested inside one. Time inside a bare
  record_function label (``FSDP::all_gather``'s blocking wait, ``FSDP::all_gather_copy_out``'s wait) or
  between operators is not compute.
"""

from __future__ import annotations

import bisect
import gc
import json
import math
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from . import intervals as iv
from .reader import Args, Event, KinetoTrace, TraceError, decode, rank_from_name

NCCL_KERNEL_RE = re.compile(r"^nccl.*Kernel")
MEMORY_KERNEL_RE = re.compile(r"(^Memcpy)|(^Memset)|(^dma)")
NOT_COMPUTE_RE = re.compile(r"(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)")
DATALOADER_PREFIX = "enumerate(DataLoader)"
OPTIMIZER_PREFIX = "Optimizer."
STEP_RE = re.compile(r"ProfilerStep\s*#\s*(\d+)")
LABEL_RE = re.compile(r"^FSDP::(?P<kind>[A-Za-z_]+)(?: \((?P<fqn>.*)\))?(?: \[pg=(?P<pg>\d+)\])?$")
PREFETCH_RE = re.compile(r"^FSDP::(?P<pass>forward|backward)_prefetch for (?P<fqn>.*)$")
COMM_OP_RE = re.compile(r"^(c10d::|c10d_functional::|_c10d_functional::|record_param_comms|nccl:|gloo:)|wait")
NCCL_COLL_RE = re.compile(r"(AllGather|ReduceScatter|AllReduce|Broadcast|SendRecv|AllToAll|Reduce|Send|Recv)")

_CAMEL_TO_SNAKE = {
    "AllGather": "all_gather",
    "ReduceScatter": "reduce_scatter",
    "AllReduce": "all_reduce",
    "Broadcast": "broadcast",
    "SendRecv": "send_recv",
    "AllToAll": "all_to_all",
    "Reduce": "reduce",
    "Send": "send",
    "Recv": "recv",
}

# bytes per element by the dtype names found in traces (record_param_comms 'dtype', record_shapes 'Input type')
DTYPE_BYTES = {
    "float": 4, "float32": 4, "float64": 8, "double": 8, "half": 2, "float16": 2, "bfloat16": 2,
    "c10::half": 2, "c10::bfloat16": 2, "int": 4, "int32": 4, "long": 8, "long int": 8, "int64": 8,
    "short": 2, "int16": 2, "char": 1, "signed char": 1, "unsigned char": 1, "uint8": 1, "int8": 1,
    "byte": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "c10::float8_e4m3fn": 1,
    "c10::float8_e5m2": 1, "complexfloat": 8, "c10::complex<float>": 8,
}

OTHER_UNIT = "(other)"
ROOT_UNIT = "(root)"


@dataclass
class CollectiveCall:
    """One collective (one NCCL kernel, or one gloo-thread event)."""

    unit: str  # FSDP unit fqn, "(root)", or "(other)" when no FSDP label launched it
    collective: str  # all_gather | reduce_scatter | all_reduce | ...
    phase: Optional[str]  # forward | backward | None (not an FSDP collective)
    start: float
    end: float
    issue: float  # host time the collective was issued (launch / c10d op start)
    bytes: Optional[int] = None  # message size S (NCCL-tests convention: the full, unsharded size)
    group_size: Optional[int] = None
    dtype: Optional[str] = None  # element type from the NCCL args ("Float", "BFloat16", ...), where present
    need: Optional[float] = None  # when compute needed the gathered params (all_gather only)
    blocking: bool = False  # gloo: the host thread sat in the all-gather for the whole collective
    on_compute_stream: bool = False  # GPU: the NCCL kernel ran on the compute stream (serialised with compute)


@dataclass
class WindowTrace:
    """One trace file (one profiler window of one rank)."""

    file: str
    rank: int
    device: str  # "gpu" | "cpu"
    world_size: Optional[int]
    steps: list[int]  # complete steps analysed
    step_us: dict = field(default_factory=dict)  # complete step -> its wall time (its start to the next step's)
    comm: iv.Intervals = field(default_factory=lambda: iv.EMPTY)  # union of communication
    compute: iv.Intervals = field(default_factory=lambda: iv.EMPTY)  # union of compute
    h2d: iv.Intervals = field(default_factory=lambda: iv.EMPTY)  # union of Memcpy HtoD
    d2h: iv.Intervals = field(default_factory=lambda: iv.EMPTY)  # union of Memcpy DtoH
    stream_busy: iv.Intervals = field(default_factory=lambda: iv.EMPTY)  # compute stream / main thread busy
    span: tuple[float, float] = (0.0, 0.0)  # first start, last end of the compute stream / main thread
    calls: list[CollectiveCall] = field(default_factory=list)
    # the verdict's timeline (see the module docstring)
    window: Optional[tuple[float, float]] = None  # the complete steps' host span
    gpu_busy: iv.Intervals = field(default_factory=lambda: iv.EMPTY)  # union of every device event
    other_dev: iv.Intervals = field(default_factory=lambda: iv.EMPTY)  # memset, D2D copies, syncs
    host_wait: iv.Intervals = field(default_factory=lambda: iv.EMPTY)  # GPU idle, next work not yet launched
    outside: iv.Intervals = field(default_factory=lambda: iv.EMPTY)  # host time outside the model
    sync: iv.Intervals = field(default_factory=lambda: iv.EMPTY)  # host inside a device sync (SYNC_NAMES)
    model_delimited: bool = False  # FSDP labels marked where the model runs


def _snake_collective(name: str) -> Optional[str]:
    m = NCCL_COLL_RE.search(name)
    return _CAMEL_TO_SNAKE[m.group(1)] if m else None


def _c10d_collective(op: str) -> str:
    n = op.split("::", 1)[-1].strip("_").lower()
    if "allgather" in n or "all_gather" in n:
        return "all_gather"
    if "reduce_scatter" in n or "reducescatter" in n:
        return "reduce_scatter"
    if "allreduce" in n or "all_reduce" in n:
        return "all_reduce"
    if "broadcast" in n:
        return "broadcast"
    if "alltoall" in n or "all_to_all" in n:
        return "all_to_all"
    return n


def _gloo_collective(name: str) -> str:
    return name.split(":", 1)[-1].strip().lower().replace("allgather", "all_gather").replace(
        "allreduce", "all_reduce"
    )


# which gloo-thread event names a c10d op's collective can show up as
_GLOO_NAMES_FOR = {
    "all_gather": ("all_gather",),
    "reduce_scatter": ("reduce_scatter", "all_reduce"),
    "all_reduce": ("all_reduce",),
    "broadcast": ("broadcast",),
    "all_to_all": ("all_to_all", "alltoall"),
}


def dtype_bytes(name: Optional[str]) -> Optional[int]:
    """Bytes per element of a dtype named as in traces or torch ("bfloat16", "c10::Half"); None if unknown.
    The one dtype-size table (``DTYPE_BYTES``) of the package."""
    if not name:
        return None
    return DTYPE_BYTES.get(name.strip().lower())


def _numel(dims) -> Optional[int]:
    if isinstance(dims, list) and all(isinstance(d, int) for d in dims):
        return math.prod(dims) if dims else 1
    return None


def _bytes_from_shapes(args) -> Optional[int]:
    """Message size from record_shapes args of a c10d op: the larger of its first two tensors."""
    if args is None or not args.input_dims or not args.input_type:
        return None
    try:
        dims = json.loads(bytes(args.input_dims))
        types = json.loads(bytes(args.input_type))
    except ValueError:
        return None
    best = None
    for d, t in list(zip(dims, types))[:2]:
        n = _numel(d)
        if n is None and isinstance(d, list):  # a tensor list: sum its tensors
            ns = [_numel(x) for x in d]
            n = sum(ns) if ns and all(x is not None for x in ns) else None
        b = dtype_bytes(t if isinstance(t, str) else None)
        if n is not None and b is not None:
            best = max(best or 0, n * b)
    return best


def _bytes_from_msg(args) -> Optional[int]:
    if args is None:
        return None
    n = max(args.in_nelems or 0, args.out_nelems or 0)
    b = dtype_bytes(args.dtype)
    return n * b if n and b else None


@dataclass
class _Label:
    ts: float
    end: float
    name: str


class _LabelIndex:
    """FSDP record_function labels per (pid, tid), for 'innermost label containing t' queries."""

    def __init__(self, labels: dict):
        self._by_thread = {}
        for key, lst in labels.items():
            lst.sort(key=lambda x: x.ts)
            self._by_thread[key] = ([x.ts for x in lst], lst)
        self._by_name: Optional[dict] = None

    def innermost(self, key, t: float, pred) -> Optional[_Label]:
        entry = self._by_thread.get(key)
        if entry is None:
            return None
        starts, lst = entry
        i = bisect.bisect_right(starts, t) - 1
        best = None
        # labels nest, so the innermost container is the latest-starting one that still contains t
        for j in range(i, max(i - 64, -1), -1):
            lab = lst[j]
            if lab.end >= t and pred(lab.name):
                best = lab
                break
        return best

    def first_after(self, t: float, name: str) -> Optional[_Label]:
        """The earliest label called ``name`` starting at or after ``t`` on any thread (on a tie, the one
        on the thread seen first)."""
        if self._by_name is None:
            by_name: dict = {}
            for _, lst in self._by_thread.values():  # threads in order, each sorted by start
                for lab in lst:
                    by_name.setdefault(lab.name, []).append(lab)
            for k, lst in by_name.items():
                lst.sort(key=lambda x: x.ts)  # stable: ties keep thread order
                by_name[k] = ([x.ts for x in lst], lst)
            self._by_name = by_name
        entry = self._by_name.get(name)
        if entry is None:
            return None
        starts, lst = entry
        i = bisect.bisect_left(starts, t)
        return lst[i] if i < len(lst) else None


def _unit_of(fqn: Optional[str], pg: Optional[str] = None) -> str:
    u = fqn if fqn else ROOT_UNIT
    return f"{u} [pg={pg}]" if pg else u


def _attribution(lab: Optional[_Label]):
    """(unit, kind, label suffix) from an FSDP label: kind is 'all_gather' or 'reduce'."""
    if lab is None:
        return None
    m = PREFETCH_RE.match(lab.name)
    if m:
        fqn = m.group("fqn")
        return _unit_of(fqn), "all_gather", (f" ({fqn})" if fqn else "")
    m = LABEL_RE.match(lab.name)
    if not m:
        return None
    kind = m.group("kind")
    suffix = lab.name[len("FSDP::" + kind):]
    if kind == "all_gather":
        return _unit_of(m.group("fqn"), m.group("pg")), "all_gather", suffix
    if kind == "post_backward_reduce":
        return _unit_of(m.group("fqn"), m.group("pg")), "reduce", suffix
    return None


def _is_comm_label(name: str) -> bool:
    return name.startswith("FSDP::all_gather (") or name == "FSDP::all_gather" or name.startswith(
        "FSDP::all_gather [") or name.startswith("FSDP::post_backward_reduce") or "_prefetch for " in name


class _Phases:
    def __init__(self, boundaries: list[tuple[float, str]]):
        boundaries.sort()
        self._ts = [b[0] for b in boundaries]
        self._kind = [b[1] for b in boundaries]

    def at(self, t: float) -> str:
        i = bisect.bisect_right(self._ts, t) - 1
        return self._kind[i] if i >= 0 else "forward"


def _stream_id(args) -> int:
    if args is None or args.stream is None:
        return -1
    s = args.stream
    if isinstance(s, int):
        return s
    try:
        return int(s)
    except ValueError:
        return -1


_SPECIAL_FIRST = frozenset("FPeOcha")  # first letters of the special names: a cheap test before startswith
# host calls that wait for the device: time the host spends in them while the device is idle is a device sync,
# not input or launch overhead (the verdict's ``sync`` part)
SYNC_NAMES = frozenset({"cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize",
                        "hipDeviceSynchronize", "hipStreamSynchronize", "hipEventSynchronize",
                        "aten::item", "aten::_local_scalar_dense"})


@contextmanager
def _gc_paused():
    """The cyclic GC off for a while: building a window allocates ~10k small tracked objects (labels, calls),
    and each young-generation collection would walk the freshly decoded event list (~20% of the build time).
    Nothing built here forms cycles; reference counting frees it all the same."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def build_window(path, trace: Optional[KinetoTrace] = None) -> WindowTrace:
    """Decode (unless ``trace`` is given) and reduce one trace file. Raises reader.TraceError."""
    path = Path(path)
    if trace is None:
        trace = decode(path)
    with _gc_paused():
        return _build_window(path, trace)


def _build_window(path: Path, trace) -> WindowTrace:
    events: list[Event] = trace.traceEvents or []
    dist = trace.distributedInfo
    rank = dist.rank if dist is not None and dist.rank is not None else rank_from_name(path)
    rank = 0 if rank is None else rank
    world = dist.world_size if dist is not None else None

    # ---- one pass over everything: device events, launches (host events with a correlation), and the
    # few host events the analyses read (steps, FSDP labels). The CPU path re-reads the host events.
    # (One loop that reads each event once beats several comprehensions: the events are spread over memory.)
    all_int = True
    gpu = _DeviceEvents()
    launches: dict[int, Event] = {}
    special: list[Event] = []
    syncs: list[Event] = []
    gpu_append = gpu.events.append
    g_ts, g_dur, g_corr, g_stream = gpu.ts.append, gpu.dur.append, gpu.corr.append, gpu.stream.append
    special_append = special.append
    first = _SPECIAL_FIRST
    # Events without a category, or of category "Trace" (the profiler's span), take no part; the category is
    # only read where it matters, not for the bulk of operators.
    for e in events:
        d = e.dur
        if d is None:  # flow arrows and other non-complete events (decoded as marks: ts and dur only)
            continue
        ts = e.ts
        if ts is None:
            continue
        if all_int and ts.__class__ is not int and (c := e.cat) is not None and c != "Trace":
            all_int = False
        a = e.args
        if a is not None:
            corr = a.correlation
            if corr is not None and corr >= 0:
                c = e.cat
                if c is None or c == "Trace":
                    continue
                st = a.stream
                if st is not None:
                    if st.__class__ is not int:
                        st = _stream_id(a)
                    if st >= 0:
                        gpu_append(e)
                        g_ts(ts)
                        g_dur(d)
                        g_corr(corr)
                        g_stream(st)
                        continue
                launches[corr] = e
        n = e.name
        if n[:1] in first:
            if n in SYNC_NAMES:
                syncs.append(e)
            elif (c := e.cat) is not None and c != "Trace" and c != "gpu_user_annotation" and (
                    n.startswith("FSDP::") or n.startswith("ProfilerStep") or n.startswith(DATALOADER_PREFIX)
                    or n.startswith(OPTIMIZER_PREFIX)):
                special_append(e)
    scale = 1.0
    if all_int and events and (trace.displayTimeUnit == "ns" or max(
            (e.ts for e in events if e.ts is not None), default=0) > 1e17):
        scale = 1e-3

    # ---- profiler steps and the cut at the last step's start ----
    steps: dict[int, float] = {}
    step_end: dict[int, float] = {}
    for e in special:
        if e.name.startswith("ProfilerStep"):
            m = STEP_RE.match(e.name)
            if m:
                n = int(m.group(1))
                steps[n] = min(steps.get(n, math.inf), e.ts * scale)
                step_end[n] = max(step_end.get(n, -math.inf), (e.ts + e.dur) * scale)
    cutoff = math.inf
    kept_steps = sorted(steps)
    if len(steps) >= 2:
        cutoff = max(steps.values())
        kept_steps = sorted(n for n, s in steps.items() if s < cutoff)

    labels: dict = {}
    boundaries: list[tuple[float, str]] = []
    for e in special:
        n = e.name
        t = e.ts * scale
        if n.startswith("FSDP::") and t < cutoff:
            labels.setdefault((e.pid, e.tid), []).append(_Label(t, (e.ts + e.dur) * scale, n))
            if n == "FSDP::root_pre_forward":
                boundaries.append((t, "forward"))
            elif n.startswith("FSDP::pre_backward"):
                boundaries.append((t, "backward"))
    index = _LabelIndex(labels)
    phases = _Phases(boundaries)

    win = WindowTrace(file=str(path), rank=rank, device="gpu" if gpu.events else "cpu", world_size=world,
                      steps=kept_steps)
    ends = [steps[n] for n in kept_steps[1:]] + [cutoff if cutoff != math.inf else step_end[n] for n in kept_steps[-1:]]
    win.step_us = {n: e - steps[n] for n, e in zip(kept_steps, ends)}  # a kept step ends where the next starts
    if kept_steps:
        win.window = (steps[kept_steps[0]], cutoff if cutoff != math.inf else step_end[kept_steps[-1]])
    _outside_model(win, special, [(steps[n], step_end[n]) for n in kept_steps], scale)
    win.sync = iv.union([e.ts * scale for e in syncs if e.ts * scale < cutoff],
                        [(e.ts + e.dur) * scale for e in syncs if e.ts * scale < cutoff])
    if gpu.events:
        _build_gpu(win, gpu, launches, index, phases, scale, cutoff)
    else:
        host = [e for e in events if e.dur is not None and e.ts is not None and e.cat is not None
                and e.cat != "Trace" and e.ts * scale < cutoff]
        _build_cpu(win, host, labels, index, phases, scale, _Shapes(path, events))
    return win


def _outside_model(win: WindowTrace, special: list, step_spans: list, scale: float) -> None:
    """Host time outside the model: data-loader labels, and with FSDP labels, each step's time before its
    root pre-forward and after its last FSDP / optimizer label."""
    starts, ends = [], []
    fsdp = []
    for e in special:
        n = e.name
        if n.startswith(DATALOADER_PREFIX):
            starts.append(e.ts * scale)
            ends.append((e.ts + e.dur) * scale)
        elif n.startswith("FSDP::") or n.startswith(OPTIMIZER_PREFIX):
            fsdp.append((e.ts * scale, (e.ts + e.dur) * scale, n == "FSDP::root_pre_forward"))
    if fsdp and step_spans:
        fsdp.sort()
        fs = [f[0] for f in fsdp]
        for s0, s1 in step_spans:
            inside = fsdp[bisect.bisect_left(fs, s0):bisect.bisect_left(fs, s1)]
            roots = [f[0] for f in inside if f[2]]
            if not roots:
                continue
            win.model_delimited = True
            starts += [s0, max(f[1] for f in inside)]
            ends += [min(roots), s1]
    win.outside = iv.union(starts, ends)


def _gpu_timeline(win: WindowTrace, ts, te, lts, classified) -> None:
    """``gpu_busy``, ``other_dev`` and ``host_wait`` from the kept device events (start, end, launch)."""
    win.gpu_busy = busy = iv.union(ts, te)
    win.other_dev = iv.union(ts[~classified], te[~classified])
    if win.window is None:
        win.window = (float(busy[0][0]), float(busy[1][-1])) if busy[0].size else None
    if win.window is None:
        return
    w0, w1 = win.window
    # each run of device activity starts with some event; the GPU waited for the host before it while that
    # event was not launched yet: from the end of the previous run (or the window start) to its launch
    order = np.argsort(ts, kind="stable")
    first = order[np.searchsorted(ts[order], busy[0], side="left")]
    launch = lts[first]
    gap_start = np.concatenate(([w0], busy[1][:-1]))
    gap_end = busy[0]
    wait_end = np.minimum(np.where(np.isnan(launch), -np.inf, launch), gap_end)
    s = list(gap_start[wait_end > gap_start])
    e = list(wait_end[wait_end > gap_start])
    tail = max(w0, float(busy[1][-1]))
    if w1 > tail:  # nothing launched runs in the window's idle tail
        s.append(tail)
        e.append(w1)
    win.host_wait = iv.union(s, e)


def _kernel_kind(name: str) -> int:
    """0 other, 1 compute, 2 comm, 3 memory (HTA 0.5.0's classes)."""
    if NCCL_KERNEL_RE.match(name):
        return 2
    if MEMORY_KERNEL_RE.match(name):
        return 3
    if not NOT_COMPUTE_RE.match(name):
        return 1
    return 0


class _DeviceEvents:
    """The device events of a window and, side by side, the fields the arrays are built from."""

    def __init__(self):
        self.events: list[Event] = []
        self.ts: list = []
        self.dur: list = []
        self.corr: list[int] = []
        self.stream: list[int] = []


def _build_gpu(win, dev: _DeviceEvents, launches, index, phases, scale, cutoff):
    gpu = dev.events
    # each device event's launch time (NaN: no launch); with a step cut, launches at or after the last step's
    # start do not count, and neither do the device events they launched
    lget = launches.get
    lts = np.array([ln.ts if (ln := lget(k)) is not None else math.nan for k in dev.corr],
                   dtype=np.float64) * scale
    ts = np.array(dev.ts, dtype=np.float64) * scale
    te = ts + np.array(dev.dur, dtype=np.float64) * scale
    streams = np.array(dev.stream, dtype=np.int64)
    if cutoff != math.inf:
        keep = lts < cutoff  # NaN compares False
        if not keep.all():
            gpu = [gpu[i] for i in np.flatnonzero(keep).tolist()]
            lts, ts, te, streams = lts[keep], ts[keep], te[keep], streams[keep]
        # (the launches dict itself is left whole: every device event kept finds its launch in it)

    # classify each distinct kernel name once
    codes: dict[str, int] = {}
    name_idx = np.array([codes.setdefault(e.name, len(codes)) for e in gpu], dtype=np.intp)
    names = list(codes)
    kind_of = [_kernel_kind(nm) for nm in names]
    kind = np.array(kind_of, dtype=np.int8)[name_idx]
    h2d = np.array([k == 3 and nm.startswith("Memcpy HtoD") for k, nm in zip(kind_of, names)], dtype=bool)[name_idx]
    d2h = np.array([k == 3 and not nm.startswith("Memcpy HtoD") and nm.startswith("Memcpy DtoH")
                    for k, nm in zip(kind_of, names)], dtype=bool)[name_idx]

    comp = kind == 1
    is_comm = kind == 2
    _gpu_timeline(win, ts, te, lts, comp | is_comm | h2d | d2h)
    win.comm = iv.union(ts[is_comm], te[is_comm])
    win.compute = iv.union(ts[comp], te[comp])
    win.h2d = iv.union(ts[h2d], te[h2d])
    win.d2h = iv.union(ts[d2h], te[d2h])
    cs = None
    if comp.any():
        # the compute stream: the stream with the most compute-kernel time
        uniq, inverse = np.unique(streams[comp], return_inverse=True)
        durs = np.bincount(inverse, weights=(te - ts)[comp])
        cs = uniq[int(np.argmax(durs))]
        on = streams == cs
        win.stream_busy = iv.union(ts[on], te[on])
        win.span = (float(ts[on].min()), float(te[on].max()))

    # compute kernels ordered by launch time, for "when did the compute stream need the params"
    ci = np.flatnonzero(comp)
    launch_ts = np.where(np.isnan(lts[ci]), ts[ci], lts[ci])
    order = np.argsort(launch_ts, kind="stable")
    launch_sorted = launch_ts[order].tolist()
    end_prefmax = np.maximum.accumulate(te[ci][order]).tolist() if ci.size else []

    ts_l = ts.tolist()
    te_l = te.tolist()
    attributions: dict = {}
    collectives: dict = {}
    for i in np.flatnonzero(is_comm).tolist():
        e = gpu[i]
        a = e.args
        launch = launches.get(a.correlation)
        issue = launch.ts * scale if launch is not None else ts_l[i]
        lab = None
        if launch is not None:
            lab = index.innermost((launch.pid, launch.tid), issue, _is_comm_label)
        if lab is None:
            att = None
        else:
            att = attributions.get(lab.name, attributions)
            if att is attributions:
                att = attributions[lab.name] = _attribution(lab)
        coll = collectives.get(e.name, collectives)
        if coll is collectives:
            coll = collectives[e.name] = _snake_collective(e.name)
        coll = coll or (a.collective or "unknown")
        call = CollectiveCall(unit=OTHER_UNIT, collective=coll, phase=None, start=ts_l[i], end=te_l[i],
                              issue=issue, bytes=_bytes_from_msg(a), group_size=a.group_size or win.world_size,
                              dtype=a.dtype,
                              on_compute_stream=cs is not None and int(streams[i]) == cs)
        if att is not None:
            unit, k, suffix = att
            call.unit = unit
            if k == "all_gather":
                call.collective = "all_gather" if coll in ("all_gather", "unknown") else coll
                call.phase = phases.at(lab.ts)
                out = index.first_after(issue, "FSDP::all_gather_copy_out" + suffix)
                if out is not None:
                    j = bisect.bisect_left(launch_sorted, out.ts)
                    dev_ready = end_prefmax[j - 1] if j > 0 else -math.inf
                    call.need = max(out.ts, dev_ready)
            else:
                call.phase = "backward"
        win.calls.append(call)


class _Shapes:
    """A host event's args with the record_shapes fields. The fast decoder leaves those out (LeanArgs); the
    first event asked about then has the file decoded again in full, once, and looked up by position."""

    def __init__(self, path: Path, events: list):
        self._path = path
        self._events = events
        self._full: Optional[list] = None
        self._pos: dict = {}

    def args(self, e):
        a = e.args
        if a is None or isinstance(a, Args):
            return a
        if self._full is None:
            try:
                full = decode(self._path, full=True).traceEvents or []
            except TraceError:
                full = []
            self._full = full if len(full) == len(self._events) else []
            self._pos = {id(x): i for i, x in enumerate(self._events)} if self._full else {}
        i = self._pos.get(id(e))
        return self._full[i].args if i is not None else None


def _main_thread(host, labels) -> Optional[tuple]:
    if labels:
        return max(labels, key=lambda k: len(labels[k]))
    counts: dict = {}
    for e in host:
        if e.name.startswith("ProfilerStep"):
            return (e.pid, e.tid)
    gloo = {(e.pid, e.tid) for e in host if e.name.startswith("gloo:")}
    for e in host:
        if e.cat == "cpu_op" and (e.pid, e.tid) not in gloo:
            counts[(e.pid, e.tid)] = counts.get((e.pid, e.tid), 0) + 1
    return max(counts, key=counts.get) if counts else None


def _compute_self_time(evs, scale) -> iv.Intervals:
    """Main-thread compute: self time of operators that are not communication/wait ops (nor nested in one)."""
    items = []
    for e in evs:
        if e.cat == "cpu_op":
            comm = bool(COMM_OP_RE.search(e.name))
            items.append((e.ts * scale, (e.ts + e.dur) * scale, not comm, comm))
        elif e.cat == "user_annotation":
            items.append((e.ts * scale, (e.ts + e.dur) * scale, False, False))
    items.sort(key=lambda x: (x[0], -x[1]))
    starts: list[float] = []
    ends: list[float] = []
    stack: list[list] = []  # [end, is_compute, in_comm]
    cur = 0.0
    for s, e, comp, comm in items:
        while stack and stack[-1][0] <= s:
            top = stack.pop()
            if top[1] and top[0] > cur:
                starts.append(cur)
                ends.append(top[0])
            cur = max(cur, top[0])
        if stack and stack[-1][1] and s > cur:
            starts.append(cur)
            ends.append(s)
        cur = max(cur, s)
        in_comm = comm or (stack[-1][2] if stack else False)
        end = min(e, stack[-1][0]) if stack else e
        stack.append([end, comp and not in_comm, in_comm])
    while stack:
        top = stack.pop()
        if top[1] and top[0] > cur:
            starts.append(cur)
            ends.append(top[0])
        cur = max(cur, top[0])
    return iv.union(starts, ends)


def _build_cpu(win, host, labels, index, phases, scale, shapes):
    main = _main_thread(host, labels)
    gloo = sorted((e for e in host if e.name.startswith("gloo:")), key=lambda e: e.ts)
    win.comm = iv.union([e.ts * scale for e in gloo], [(e.ts + e.dur) * scale for e in gloo])
    if main is None:
        return
    main_evs = [e for e in host if (e.pid, e.tid) == main]
    win.compute = _compute_self_time(main_evs, scale)
    win.stream_busy = win.compute
    ops = [e for e in main_evs if e.cat in ("cpu_op", "user_annotation")]
    if ops:
        win.span = (min(e.ts for e in ops) * scale, max((e.ts + e.dur) for e in ops) * scale)

    # link main-thread c10d ops to gloo-thread events: FIFO per gloo event name, the gloo event
    # starting no earlier than the c10d op (gloo runs its work queue in issue order)
    c10d = sorted((e for e in main_evs if e.cat == "cpu_op" and e.name.startswith("c10d::")
                   and _c10d_collective(e.name) in _GLOO_NAMES_FOR), key=lambda e: e.ts)
    pools: dict[str, list] = {}
    for g in gloo:
        pools.setdefault(_gloo_collective(g.name), []).append(g)
    heads = {k: 0 for k in pools}
    matched = set()
    for op in c10d:
        coll = _c10d_collective(op.name)
        best = None
        for gname in _GLOO_NAMES_FOR[coll]:
            pool = pools.get(gname)
            if not pool:
                continue
            h = heads[gname]
            while h < len(pool) and (id(pool[h]) in matched or pool[h].ts < op.ts):
                h += 1
            heads[gname] = h
            if h < len(pool) and (best is None or pool[h].ts < best.ts):
                best = pool[h]
        if best is None:
            continue
        matched.add(id(best))
        g0, g1 = best.ts * scale, (best.ts + best.dur) * scale
        o0, o1 = op.ts * scale, (op.ts + op.dur) * scale
        lab = index.innermost(main, o0, _is_comm_label)
        att = _attribution(lab)
        call = CollectiveCall(unit=OTHER_UNIT, collective=coll, phase=None, start=g0, end=g1, issue=o0,
                              bytes=_bytes_from_shapes(shapes.args(op)), group_size=win.world_size)
        if att is not None:
            unit, k, suffix = att
            call.unit = unit
            if k == "all_gather":
                call.phase = phases.at(lab.ts)
                # blocking: the host sat in the all-gather (its label, or the c10d op) for the whole collective
                holder_end = max(o1, lab.end if lab.name.startswith("FSDP::all_gather") else o1)
                call.blocking = o0 <= g0 and holder_end >= g1
                if call.blocking:
                    call.need = o0
                else:
                    out = index.first_after(o0, "FSDP::all_gather_copy_out" + suffix)
                    call.need = out.ts if out is not None else None
            else:
                call.phase = "backward"
        else:
            call.blocking = coll == "all_gather" and o1 >= g1
        win.calls.append(call)
    for g in gloo:
        if id(g) not in matched:
            win.calls.append(CollectiveCall(unit=OTHER_UNIT, collective=_gloo_collective(g.name), phase=None,
                                            start=g.ts * scale, end=(g.ts + g.dur) * scale, issue=g.ts * scale,
                                            group_size=win.world_size))
