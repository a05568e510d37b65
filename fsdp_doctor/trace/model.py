"""The typed intermediate model: one profiler window of one rank, reduced to interval arrays and a short
list of collective calls. ``fsdp_doctor.trace.build`` builds it from a decoded trace (its docstring says how:
clocks, complete steps, GPU and CPU classes); the analyses in ``fsdp_doctor.trace.analysis`` are plain
functions over it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from . import intervals as iv

OTHER_UNIT = "(other)"
ROOT_UNIT = "(root)"


@dataclass(slots=True)
class CollectiveCall:
    """One collective (one NCCL kernel, or one gloo-thread event). Slotted: a window may hold a million."""

    unit: str  # FSDP unit fqn, "(root)", or "(other)" when no FSDP label launched it
    collective: str  # all_gather | reduce_scatter | all_reduce | ...
    # forward | backward; not FSDP's: optimizer (issued inside optimizer.step()), model, grad_norm, loss (between
    # the passes: build.LOSS_PHASE) or None (the loop around them)
    phase: Optional[str]
    start: float
    end: float
    issue: float  # host time the collective was issued (launch / c10d op start)
    bytes: Optional[int] = None  # message size S (NCCL-tests convention: the full, unsharded size)
    group_size: Optional[int] = None
    # element type from the NCCL args ("Float", "BFloat16", ...) or a gloo c10d op's record_shapes args ("float",
    # "c10::BFloat16"), where present
    dtype: Optional[str] = None
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
    # the window's step left out of them -> why (trace.build.window_steps: its last, where it may be cut)
    steps_dropped: dict = field(default_factory=dict)
    step_us: dict = field(default_factory=dict)  # complete step -> its wall time (its start to the next step's)
    comm: iv.Intervals = field(default_factory=lambda: iv.EMPTY)  # union of communication
    compute: iv.Intervals = field(default_factory=lambda: iv.EMPTY)  # union of compute
    h2d: iv.Intervals = field(default_factory=lambda: iv.EMPTY)  # union of Memcpy HtoD
    d2h: iv.Intervals = field(default_factory=lambda: iv.EMPTY)  # union of Memcpy DtoH
    stream_busy: iv.Intervals = field(default_factory=lambda: iv.EMPTY)  # compute stream / main thread busy
    span: tuple[float, float] = (0.0, 0.0)  # first start, last end of the compute stream / main thread
    calls: list[CollectiveCall] = field(default_factory=list)
    # CPU/gloo: the main thread's spans inside collectives, (start, end, the call it waited for or None), in ``comm``
    # with the gloo events (build's _collective_waits): the verdict gives each to its call's part
    comm_waits: list = field(default_factory=list)
    # the verdict's timeline (see the module docstring)
    # the complete steps' host span; on GPU moved by device_lag_us where the host ran that far ahead of the device
    # (build._follow_the_device)
    window: Optional[tuple[float, float]] = None
    device_lag_us: float = 0.0
    gpu_busy: iv.Intervals = field(default_factory=lambda: iv.EMPTY)  # union of every device event
    other_dev: iv.Intervals = field(default_factory=lambda: iv.EMPTY)  # memset, D2D copies, syncs
    host_wait: iv.Intervals = field(default_factory=lambda: iv.EMPTY)  # GPU idle, next work not yet launched
    outside: iv.Intervals = field(default_factory=lambda: iv.EMPTY)  # host time outside the model
    sync: iv.Intervals = field(default_factory=lambda: iv.EMPTY)  # host inside a device sync (SYNC_NAMES)
    model_delimited: bool = False  # FSDP labels marked where the model runs
    # the file's identity, for telling ranks and jobs apart (trace.admit)
    rank_known: bool = True  # the rank came from distributedInfo or the file name (else read as 0)
    backend: Optional[str] = None  # distributedInfo.backend
    # every process group spans the world (distributedInfo.pg_config; True where not known): a collective whose
    # trace names no group is then over the world (gloo's; on a 2-D mesh its group is not known)
    world_groups: bool = True
    # a process group of more than one rank and fewer than the world (distributedInfo.pg_config; True where not
    # known): a model-parallel mesh dimension (tensor, context, expert parallelism, or HSDP's) whose collectives the
    # model may issue outside its units (a vocabulary-parallel loss's all-reduce). Without one, a collective inside
    # the model's region but outside every unit's forward and backward is the loop's own (Lightning's
    # self.log(sync_dist=True) between forward and backward, a token count all-reduced between micro-batches)
    model_groups: bool = True
    # what drove the training loop, where the trace says (records.LIGHTNING_DRIVER: Lightning's profiler labels,
    # ``[pl][profile]...``, ``[pl][module]...``, its PyTorchProfiler's record_functions, the loop's code its hooks and
    # training_step; records.OLMO_DRIVER: OLMo-core's Trainer in the Python frames its ProfilerCallback records,
    # with_stack being its default); None: the user's own loop, or a trace that does not say
    driver: Optional[str] = None
    clock_us: float = 0.0  # add to a time to get µs since the epoch (baseTimeNanoseconds; 0: ts are absolute)
    kernels: dict = field(default_factory=dict)  # GPU: compute kernels by class (fsdp_doctor.trace.kernels)
    # per complete step (fsdp_doctor.trace.steps_detail): unit -> [forward µs, backward µs] from FSDP2's labels,
    # and the allocator's peak and curve from the [memory] events (profile_memory=True)
    unit_us: dict = field(default_factory=dict)
    # per phase ("forward", "backward"): unit -> the units whose spans run directly inside its own
    # (steps_detail.time_nesting), by which a unit's own time leaves out what ran inside it: FSDP2 brackets a grouped
    # unit from its first module's pre-hook to its last's post-hook, so a tied [embedding, head] unit's holds the
    # blocks between them, which the module tree does not nest in it
    unit_nesting: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    # per complete step: the FSDP units its FSDP2 labels name ("" the root), in the order first named (the ranks of
    # one job shard one model: they name the same units in a step; trace.admit); a step without such labels: absent
    step_units: dict = field(default_factory=dict)
    # host µs of the loop's code that issued collectives no FSDP unit issued, outside optimizer.step(), and of that
    # the first calls' (their wait for the other ranks), over the complete steps (build's _loop_comm_us)
    loop_comm_us: float = 0.0
    loop_comm_wait_us: float = 0.0
    # of loop_comm_us, that between optimizer.step() and the next forward (a step's start to its first root
    # pre-forward, its last optimizer.step()'s end to its end): where data loading is
    between_comm_us: float = 0.0
    # host µs inside the DataLoader's ``enumerate(DataLoader)#...`` labels (its next batch: the wait for its workers,
    # or the loading itself without them) over the complete steps; None: the window holds no such label (the loop
    # feeds its batches otherwise)
    loader_us: Optional[float] = None
    # host µs inside FSDP2's labels (its hooks, nested labels once) over the complete steps (build's _outside_model)
    fsdp_host_us: float = 0.0
    # FSDP roots per forward: FSDP::root_pre_forward labels with no backward between them (their median run in the
    # complete steps; None: none seen). One root runs that label once a forward; fully_shard applied to the blocks
    # and not the model makes each block a root of its own, each labelled (FSDP's labels name no root)
    roots_per_forward: Optional[float] = None
    # per complete step: forward passes without a backward (steps_detail.nograd_forwards; none: absent)
    nograd_forwards: dict = field(default_factory=dict)
    # complete steps whose ProfilerStep holds no optimizer.step() (a loop calling prof.step() per micro-batch of
    # gradient accumulation); steps cut at optimizer.step() calls hold one each
    steps_without_optimizer: list = field(default_factory=list)
    # backward passes through the model (FSDP2's ``FSDP::root_post_backward_callback``, one each) ending in the
    # complete steps, and between two optimizer.step() calls (the median over the trace's pairs of consecutive calls,
    # the optimizer's own part of each: build._optimizer_own; None under two calls): the micro-batches per optimizer
    # step however the profiler stepped (per micro-batch, or mid-pass as Lightning's profiler does)
    step_backwards: int = 0
    backwards_per_optimizer_step: Optional[float] = None
    # the units FSDP2 all-gathered ahead in forward (its ``FSDP::forward_prefetch for <unit>`` labels, "(root)" for the
    # root's): FSDP2 prefetches in forward only where set_modules_to_forward_prefetch set a list (in backward its
    # implicit prefetch is labelled too)
    forward_prefetched: list = field(default_factory=list)
