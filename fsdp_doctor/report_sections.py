"""The report's contract: msgspec structs for every section, built by the pipeline and read by the analyses, the
rules and the presenters by attribute.

:class:`Report` is what :func:`fsdp_doctor.pipeline.build_report` returns. ``--json`` writes
``msgspec.to_builtins(report)`` (the keys are the field names; a section that was not computed is absent), and
``Report.of`` reads such a file back, section by section, so a report written by another version still shows
what it can. Mappings keyed by rank (``"0"``), by memory category or by breakdown part stay mappings; everything
else is a field.
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar, Literal, Optional

import msgspec
from msgspec import UNSET, UnsetType

from .records import Experts, OptimizerGroup, UnitConfig


class _Section(msgspec.Struct, kw_only=True):
    @classmethod
    def of(cls, section):
        """The typed section from the report (a dict, as stored and written to JSON) or None."""
        if section is None or isinstance(section, cls):
            return section
        try:
            return msgspec.convert(section, cls)
        except msgspec.ValidationError:  # a report written by another version without the figure: nothing to show
            return None


class SteppedAside(_Section):
    """The doctor stepped aside on a rank: where, why, at which step."""

    rank: int
    where: str
    message: str
    step: Optional[int] = None


class RunFacts(_Section):
    """``report["run"]``: what was analysed. The fields after ``trace_files`` come from the configuration record
    and are absent (UNSET, not written) for a run without one; a recorded None (no capacity) is written."""

    path: str = ""  # the run directory, or the one trace file given
    ranks: list[int] = []  # ranks with records
    world_size: Optional[int] = None
    run_id: Optional[str] = None
    trace_files: int = 0  # Kineto trace files read
    trace_files_unread: int = 0  # trace files found and left out: unreadable, or another job's (each in problems)
    backend: str | UnsetType = UNSET
    device: str | UnsetType = UNSET  # the run's device ("cpu", "cuda:0")
    device_name: str | UnsetType = UNSET
    torch_version: str | UnsetType = UNSET
    optimizer: Optional[str] | UnsetType = UNSET
    optimizer_groups: list[OptimizerGroup] | UnsetType = UNSET  # its parameter groups (sizes, hyper-parameters)
    optimizer_in_backward: int | UnsetType = UNSET  # per-parameter optimizers stepped in the backward (RunConfig's)
    units: int | UnsetType = UNSET  # FSDP units
    # the units' parameter mesh where it has dims beyond FSDP's: dim -> size, FSDP's first (RunConfig.mesh)
    mesh: dict[str, int] | UnsetType = UNSET
    model_param_count: int | UnsetType = UNSET
    model_trainable_param_count: Optional[int] | UnsetType = UNSET  # requires_grad ones (None: not read)
    experts: Optional[Experts] | UnsetType = UNSET  # a mixture of experts' routed experts (None: none found)
    capacity_bytes: Optional[int] | UnsetType = UNSET  # memory budget per rank (bytes)
    tokens_per_step: Optional[int] | UnsetType = UNSET
    # a Hugging Face model's attention implementation ("eager", "sdpa", ...; RunConfig.attn_implementation)
    attn_implementation: str | UnsetType = UNSET
    # the chunks the model's output and loss are computed in (torchtune's num_output_chunks; a loss that runs the
    # head per chunk from outside the model's forward, torchtitan's ChunkedLossWrapper: analyze.steps.loss_chunks)
    loss_chunks: int | UnsetType = UNSET
    # how torch's optimizer steps ("fused", "foreach", "for-loop"; "mixed" where its groups differ), as its groups'
    # switches and the device make it (analyze.report.optimizer_impl); unset where they are not recorded
    optimizer_impl: str | UnsetType = UNSET
    torch_lacks: list[str] | UnsetType = UNSET  # FSDP2 features this torch release does not have
    # the units' MixedPrecisionPolicy ("params bfloat16, reduce float32"; "mixed" where units differ) and CPU
    # offload ("CPU offload" or "CPU offload, 3 of 9 units"), where any unit has one
    mixed_precision: str | UnsetType = UNSET
    offload: str | UnsetType = UNSET
    # gradient accumulation: the backward passes through the model per optimizer step (its micro-batches) and, of
    # them, those run with FSDP2's gradient sync on (reduce-scattering; set_requires_gradient_sync turns it off), in
    # the steady steps (the most common pair; StepRecord.synced_backwards); absent with one backward per step, and
    # for records before that field
    backwards_per_step: int | UnsetType = UNSET
    synced_backwards_per_step: int | UnsetType = UNSET
    # how some figures were measured (units compiled by torch.compile): notes, not problems (RunConfig.measured_notes)
    notes: list[str] | UnsetType = UNSET
    nccl_version: str | UnsetType = UNSET  # from the traces' distributedInfo, where torch wrote it
    trace_ranks: list[int] | UnsetType = UNSET  # the ranks the trace files say they are (distributedInfo)
    facts_source: str | UnsetType = UNSET  # "trace metadata" where no configuration record gave the facts
    doctor_errors: list[SteppedAside] | UnsetType = UNSET  # the doctor stepped aside
    steps_recorded: dict[str, int] = {}  # per rank
    complete: dict[str, bool] = {}  # per rank: the stream ended cleanly
    # ranks whose records end in the middle of a record (a write of the doctor's failed: a full disk), not killed
    records_cut: list[str] | UnsetType = UNSET
    # per rank: the exception the training loop raised through watch() (the run stopped there; not complete)
    stopped_on: dict[str, str] | UnsetType = UNSET
    # where they differ: the rank whose exception ended its run first, and by how long (ms) before the next (the
    # others' errors, a peer's connection closed, follow from it)
    stopped_first: str | UnsetType = UNSET
    stopped_first_by_ms: float | UnsetType = UNSET
    # the steps analysed where ``analyze --steps`` chose them: [first, last] (inclusive; last None: to the end)
    steps_window: list[Optional[int]] | UnsetType = UNSET


class CommRank(_Section, omit_defaults=True):
    """One rank's exposed communication (ms per step). From the records only the waits: the trace-only
    figures are then absent from the JSON."""

    exposed_ms_per_step: float
    comm_ms_per_step: Optional[float] = None
    overlap_pct: Optional[float] = None
    steps: Optional[list[int]] = None  # the profiled steps


class CommSummary(_Section):
    """``report["comm"]``: the one exposed-communication figure, with its definition and source."""

    source: str  # "trace" (profiled windows) | "records" (the recorder's all-gather waits)
    source_text: str  # e.g. "profiler trace, steps 6–7"
    definition: str
    exposed_ms_per_step: float  # median over ranks (ms per step)
    comm_ms_per_step: Optional[float] = None  # all communication, median over ranks (trace only)
    overlap_pct: Optional[float] = None  # 1 - exposed/comm of the two medians above, in % (trace only)
    per_rank: dict[str, CommRank] = {}


class MemoryPeakAt(_Section):
    step: Optional[int] = None
    unit: Optional[str] = None  # "" the root unit; None outside every unit
    phase: Optional[str] = None
    t_ms: Optional[float] = None  # from the step's start


class MemoryUnitRow(_Section):
    unit: str = ""
    sharded_bytes: Optional[int] = None
    unsharded_bytes: Optional[int] = None
    activation_bytes: Optional[int] = None  # what the unit's forward left saved (nested units included)
    activation_self_bytes: int | UnsetType = UNSET  # without the nested units' (where activation_bytes is known)
    # its forward's inputs (the bytes checkpointing it keeps), where a full memory step counted them
    input_bytes: int | UnsetType = UNSET
    # activation checkpointing: what the unit's recomputes saved for backward in one step (its own, nested units'
    # apart), i.e. what its forward would keep saved on top of what it keeps now (where a recompute was measured)
    recompute_saved_bytes: int | UnsetType = UNSET


class MemoryRank(_Section):
    """``report["memory"]["per_rank"][rank]`` (fsdp_doctor.analyze.memory); bytes unless named otherwise."""

    peak_bytes: int = 0  # device bytes at the highest sampled mark
    peak_at: MemoryPeakAt = msgspec.field(default_factory=MemoryPeakAt)
    peak_breakdown: dict[str, int] = {}  # category -> bytes; adds up to peak_bytes (device categories)
    peak_share: dict[str, float] = {}  # category -> fraction of the peak
    offloaded_host_bytes: int = 0  # host memory of CPU-offloaded state, apart from the peak
    # the highest saved-for-backward bytes of any step: counted at every save (MemoryStep.activations_high), else
    # the highest sampled at the marks and high-water rows (runs recorded before that field, replayed steps)
    activations_peak_bytes: int = 0
    capacity_bytes: Optional[int] = None
    capacity_fraction: Optional[float] = None
    steady_bytes: dict[str, int] = {}  # what stays between steps: at a step's first mark, before its forward
    stale_optimizer_params_bytes: int = 0
    steps: int = 0
    full_steps: int = 0
    activations: str = "off"  # "exact" | "replayed" | "off"
    probe_us_median: float = 0.0
    timeline_step: Optional[int] = None  # the step the timeline comes from (the peak step when it has one)
    timeline: list[dict[str, Any]] = []  # {"t_ms", "unit", "phase", "total", category...}
    per_unit: list[MemoryUnitRow] = []
    cuda: dict[str, Any] | UnsetType = UNSET  # the peak step's CudaMemory (CUDA only)
    unknown_categories: list[str] | UnsetType = UNSET  # not measurable on this torch: their 0 is no figure
    notes: list[str] | UnsetType = UNSET
    replay_mismatches: int | UnsetType = UNSET
    # a trace's (fsdp_doctor.trace.steps_detail.kept_from_forward), median over its complete steps: the bytes its
    # forward allocated still allocated when optimizer.step() starts, and those allocated before the step that
    # were freed between its first forward and its first backward; over how many steps
    forward_kept_bytes: int | UnsetType = UNSET
    pre_step_freed_bytes: int | UnsetType = UNSET
    forward_kept_steps: int | UnsetType = UNSET
    # torch.autocast's dtype where the model's forward ran inside an autocast region (records: any full step); "":
    # none did; unset: not recorded (runs recorded before the doctor read it)
    autocast: str | UnsetType = UNSET
    # autocast's copies of FSDP's unsharded parameters saved for backward (part of activations), of the timeline's step
    # (else the latest step that has them): fsdp_doctor.records.CastCopies as a dict ("rows" along ``timeline``)
    cast_copies: dict[str, Any] | UnsetType = UNSET


class MemorySection(_Section):
    """``report["memory"]``: memory by category per rank (step 0, FSDP's lazy init, left out when later steps
    exist)."""

    categories: list[str] = []  # device categories, in order
    source: str = "records"  # or, from a plain trace's [memory] events, fsdp_doctor.trace.steps_detail.MEMORY_SOURCE
    peak_rank: str = ""  # the rank with the highest peak
    peak_bytes: int = 0
    per_rank: dict[str, MemoryRank] = {}
    # what these figures cannot see, said once (CPU_UNSEEN on a CPU run, whose allocator has no total to read); ""
    unseen: str = ""


class DeviceSteps(_Section):
    """The device's view of the same steady steps on CUDA: medians (ms) of the ``GpuTimes`` the recorder's CUDA
    events measured (record/gpu_timing.py). On a GPU the host runs ahead and any wait for the device (a
    ``loss.item()``, a pageable ``.to(device)``) lands in the host's time outside the model; here is what the
    device did.

    ``step_ms`` is the device's step (its start event to its end event); ``idle_between_ms`` the device's time
    between one step's end event and the next one's start, with ``idle_source``: ``"events"`` (measured), or
    ``"host wall - device step"`` for files written before it was (over steady steps the host's and the device's
    periods are equal; clamped at 0). Those two events bracket the doctor's own bookkeeping at ``doctor.step()``,
    so this time is the doctor's, as the host's ``doctor_ms`` is. ``period_ms`` is their sum. ``outside_phases_ms``
    is the device step less its forward, backward and optimizer: the time before the forward, the loss, the wait
    for the last reduce-scatters after backward and the loop's code between the phases together (None under
    gradient accumulation, where the phases, first micro-batch to last, span each other). ``outside_ms`` is
    the device's time between ``optimizer.step()`` and the next forward: ``before_forward_ms`` (the step's start to
    its first forward: the device waiting for the batch) plus ``after_model_ms`` (the last phase's end to the
    step's end), per step; None where the recorder did not time those brackets (files written before it did)."""

    count: int = 0  # steady steps with device times
    step_ms: Optional[float] = None
    forward_ms: Optional[float] = None
    backward_ms: Optional[float] = None
    optimizer_ms: Optional[float] = None
    outside_phases_ms: Optional[float] = None
    idle_between_ms: Optional[float] = None
    idle_source: str = ""  # "events" | "host wall - device step"
    period_ms: Optional[float] = None
    before_forward_ms: Optional[float] = None
    after_model_ms: Optional[float] = None
    outside_ms: Optional[float] = None


class StepStats(_Section):
    """Step-time statistics of one rank or the job over its steady steps (ms); only ``count`` and the percentiles
    (None) when there is none. ``recorded`` / ``excluded`` per rank only. ``device``: the device's view of the same
    steps, on CUDA where the recorder's events timed them."""

    count: int = 0
    p50_ms: Optional[float] = None
    p90_ms: Optional[float] = None
    p99_ms: Optional[float] = None
    max_ms: Optional[float] = None
    mean_ms: float | UnsetType = UNSET
    cv: Optional[float] = None  # coefficient of variation (fraction)
    # forward, backward, optimizer, outside, gc; "between": of outside, the time between optimizer.step() and the
    # next forward (StepRecord.between_ms), where every step timed it
    phases_p50_ms: dict[str, float] | UnsetType = UNSET
    gc_ms_total: float | UnsetType = UNSET
    gc_count_total: int | UnsetType = UNSET
    # of gc_ms_total, the full collections' (generation 2), and the objects the collections freed (the loop's
    # reference cycles); where every step recorded them
    gc_full_ms_total: float | UnsetType = UNSET
    gc_collected_total: int | UnsetType = UNSET
    # of gc_count_total and gc_ms_total, the collections made with the collector disabled: explicit gc.collect()
    # calls; where any step recorded one
    gc_disabled_count_total: int | UnsetType = UNSET
    gc_disabled_ms_total: float | UnsetType = UNSET
    wall_ms_total: float | UnsetType = UNSET
    recorded: int | UnsetType = UNSET  # steps recorded
    excluded: int | UnsetType = UNSET  # of those, left out (first step, profiled steps, no-grad steps)
    device: DeviceSteps | UnsetType = UNSET


class Outlier(_Section):
    rank: int
    step: int
    ms: float
    median_ms: float
    excess_ms: float
    # "late_rank" | "gc" | "outside" | "no_grad" | "checkpoint" | "allgather_wait" | "doctor" | "compute" |
    # "compilation" (torch.compile compiling in the step, on this rank or another it waited for) | "unrecorded"
    # (forward, backward or outside the model, where the forward and backward were not recorded) | "micro_batches"
    # (twice the usual micro-batches: doctor.step() calls with no step of the watched optimizer between them)
    cause: str
    detail: str


class Straggler(_Section):
    rank: int
    phase: str  # where its excess goes
    steps_slower: int
    steps: int
    own_ms_p50: float  # step minus collective waits and GC
    others_own_ms_p50: float
    excess_ms_per_step: float
    phase_excess_ms_per_step: float
    # on CUDA, where the others' hosts do not wait in the collectives (their devices do): the others' device
    # time waiting in the step's collectives for this rank, per step (median); None where the host times showed it
    device_wait_ms_per_step: Optional[float] = None


class LevelShift(_Section):
    """The job's step time that changed mid-run and stayed (``analyze.steps.level_shift``, over the steady steps
    every rank has, each step's median over the ranks): the steps before and after the change, each part's median
    step, and per rank each part's phases' medians (ms: forward, backward, optimizer, outside (the model, without GC),
    gc, ag_wait (all-gather waits, inside forward and backward), own (the step without all-gather waits and GC))."""

    first_after: int  # the first steady step after the (first) change
    last_before: int  # the last steady step before it (steps between them were left out of the statistics)
    steps_before: int  # steady steps before it, and from it on
    steps_after: int
    ms_before: float  # median step before the first change, and after the last
    ms_after: float
    # of each part's steps, the lesser share lying on its side of the two medians' midpoint (the main cut's)
    separation: float = 1.0
    # where it changed in more than one step the same way: each part's [first step, last step, median ms], in order
    # (the first part's median is ms_before, the last's ms_after); empty with one change
    levels: list[list[float]] = []
    # per rank, the first part's phases and the last part's
    phases_before_ms: dict[str, dict[str, float]] = {}
    phases_after_ms: dict[str, dict[str, float]] = {}
    # where it grew or fell steadily, not in levels (the phase that moved grows within the parts as across them:
    # analyze.steps.SHIFT_DRIFT_SHARE): the step time's line, [[first steady step, ms], [last steady step, ms]]; the
    # parts above then only split it; empty where it changed in levels
    drift_line: list[list[float]] = []

    def last_from(self) -> int:
        """The first steady step of the last part (after the last change): where ``--steps N-`` reads it alone."""
        return int(self.levels[-1][0]) if self.levels else self.first_after

    def drift_ms_per_step(self) -> Optional[float]:
        """The drift's change per step (ms; None: it changed in levels)."""
        if not self.drift_line:
            return None
        (a, ya), (b, yb) = self.drift_line
        return (yb - ya) / (b - a)

    def drift_verb(self) -> str:
        """Which way the step time drifted, "grew" or "fell" (its line's ends; "" where it changed in levels)."""
        return "" if not self.drift_line else "grew" if self.drift_line[1][1] > self.drift_line[0][1] else "fell"


class NoGradSteps(_Section):
    """One rank's steps whose time holds forward passes of the model without gradients (``torch.no_grad`` or
    ``inference_mode``: evaluation, generation; or in eval mode with no backward after them), which are not
    training and are kept out of its phases."""

    steps: list[int]
    forwards: int  # in those steps, all together
    ms_p50: float  # their time per such step (median)
    excluded: bool  # those steps are left out of the steady-state statistics (kept when too few steps remain)
    # of the forwards, those in eval mode with autograd on (no backward followed: torch.no_grad() forgotten)
    with_autograd: int = 0
    # every step of the rank ran them: part of the training step (DPO's reference forward through the model with its
    # adapters off), not an evaluation between steps
    every_step: bool = False


class CompileSteps(_Section):
    """One rank's steps in which torch.compile compiled (its own graphs: ``StepRecord.compiles``), and those in which
    it waited for another rank compiling (``StepRecord.others_compiled``)."""

    steps: list[int]
    graphs: int  # compiles in those steps, all together (Dynamo's frames, lazily compiled backwards; not unique graphs)
    ms_total: float  # their compile time
    # the graph breaks Dynamo met compiling them (StepRecord.graph_breaks), and of them those at FSDP2's hooks: at a
    # call of torch._dynamo.disable (StepRecord.disable_breaks) where units run inside a compiled frame
    graph_breaks: int = 0
    fsdp_hook_breaks: int = 0
    waited: list[int] = []  # steps it waited for another rank's compile in
    excluded: bool = True  # those steps are left out of the steady-state statistics (kept when too few steps remain)


class SkippedSteps(_Section):
    """One rank's steps that ran a backward and dropped its gradients with no step of the watched optimizer
    (``StepRecord.optimizer_skipped``: a NaN/inf guard, GradScaler's skipped step), shorter by the update skipped."""

    steps: list[int]
    recorded: int  # the rank's recorded steps
    excluded: bool  # those steps are left out of the steady-state statistics (kept when too few steps remain)


class CheckpointSteps(_Section):
    """One rank's steps that saved a checkpoint (torch.distributed.checkpoint's ``save`` and ``async_save``;
    ``doctor.checkpointing()``; torchtitan's Trainer's saves under ``python -m fsdp_doctor.titan``, a Hugging Face
    Trainer's under ``DoctorCallback``), whose save time is kept out of the time outside the model."""

    steps: list[int]
    saves: int  # in those steps, all together
    # the save time and the wall time below are the steps' outside profiler windows (``counted_steps``; all steps
    # where every save fell in one): a window slows a save as it slows the step
    ms_p50: float  # a save step's save time (median)
    ms_total: float  # every save's time, all together
    wall_ms_total: float  # the recorded steps' wall time, all together (the saves' share of the run)
    excluded: bool  # those steps are left out of the steady-state statistics (kept when too few steps remain)
    async_saves: int = 0  # of the saves, torch.distributed.checkpoint.async_save calls (their time: the staging)
    counted_steps: int = 0  # the steps the figures above count (0: a report written before this field: all)
    profiled: list[int] = []  # save steps left out of the figures above (in a profiler window)
    # the first counted save step's save time: a process's first save also sets up (an async_save its staging
    # buffers: 45-68 ms against 31 ms for the next ones in torchtitan's), once however often it saves
    first_ms: float = 0.0
    # of the save times above, the save steps' time outside the model beyond the other counted steps' median, all
    # together: work around the saves outside their marks (a state dict gathered on every rank before rank 0's
    # torch.save in the mark), counted where at least the marked time (0 otherwise)
    unmarked_ms: float = 0.0
    # of the saves, those in the steps counted (the others in profiler windows); 0: a report written before it
    counted_saves: int = 0


class StepsSection(_Section):
    """``report["steps"]`` (fsdp_doctor.analyze.steps)."""

    per_rank: dict[str, StepStats] = {}
    job: Optional[StepStats] = None
    outliers: list[Outlier] = []  # worst first
    stragglers: list[Straggler] = []
    # per rank: {"window": steps inside profiled windows, "export": the steps that exported a window}
    profiler_steps: dict[str, dict[str, list[int]]] = {}
    no_grad: dict[str, NoGradSteps] = {}  # per rank that ran any
    checkpoints: dict[str, CheckpointSteps] = {}  # per rank that saved any
    compiled: dict[str, CompileSteps] = {}  # per rank that compiled in any step, or waited for another's compile
    skipped: dict[str, SkippedSteps] = {}  # per rank that skipped any optimizer step
    # per rank that called doctor.step() again with nothing run since the call before: the steps after which, once per
    # such call (analyze.steps.repeated_calls)
    repeated: dict[str, list[int]] = {}
    # per rank: the steps whose memory the doctor counted op by op that the statistics keep (too few without)
    counted_kept: dict[str, list[int]] = {}
    # per rank: [the doctor's own ms over the recorded steps, those steps' ms, its ms on an ordinary step (median),
    # the median step's ms, of its ms the part in its own steps]: its work between steps (doctor_ms) and its own
    # steps' time over the median step (its profiler windows, its memory counted op by op); reports before the last
    # three hold the first two, before the last one the first four
    doctor_own_ms: dict[str, list[float]] = {}
    # the job's step time changed once mid-run and stayed (analyze.steps.level_shift)
    level_shift: Optional[LevelShift] = None


# ---------------------------------------------------------------- units (fsdp_doctor.analyze.report.unit_table)


class UnitTiming(_Section):
    """A unit's median per-step timings across ranks (ms). ``fwd_ms``/``bwd_ms`` include nested units (as
    recorded); ``fwd_self_ms``/``bwd_self_ms`` are the unit's own time (None: FSDP never brackets its backward);
    ``ag_wait_fwd_ms`` None: a unit compiled in place, whose forward's all-gather wait is inside its forward;
    ``ag_wait_bwd_ms`` None: a unit inside another module's compiled frame, timed from FSDP2's own hooks, whose
    backward's wait is inside its backward; ``recompute_ms`` None: such a unit checkpointed (its recompute inside
    the compiled backward, not timed)."""

    fwd_ms: float = 0.0
    ag_wait_fwd_ms: Optional[float] = 0.0
    bwd_ms: float = 0.0
    ag_wait_bwd_ms: Optional[float] = 0.0
    recompute_ms: Optional[float] = 0.0
    fwd_self_ms: Optional[float] = None
    bwd_self_ms: Optional[float] = None
    # of the steady (rank, step)s, those in which the unit did not run (an MoE expert no token reached, a dropped
    # layer), left out of the medians above, and those they are over (the records' unit rows; 0: not counted)
    not_run: int = 0
    samples: int = 0
    # of those it ran in, the ones with no backward of it (its output reached no gradient: optim.never_updated); 0
    # for a root
    no_backward: int = 0


class UnitRow(UnitConfig, omit_defaults=False):
    """``report.units[i]``: a unit's configuration snapshot (every field written, so JSON rows are whole) and,
    where it has steady steps, its timings."""

    timing_p50: UnitTiming | UnsetType = UNSET  # UNSET (absent): no steady step timed the unit


class TraceUnitRow(_Section):
    """``report.overlap.units[i]``: a unit's median per-step times from a plain trace's FSDP2 labels
    (``fsdp_doctor.trace.steps_detail``), over every rank's complete steps; no configuration (that needs
    records). ``source`` says what was timed."""

    name: str  # FSDP's fqn ("" the root)
    parent: Optional[str] = None
    depth: int = 0
    samples: int = 0  # (rank, step) pairs the medians are over
    source: str = ""
    timing_p50: UnitTiming = msgspec.field(default_factory=UnitTiming)


# ---------------------------------------------------------------- throughput (fsdp_doctor.analyze.throughput)


class ThroughputRank(_Section, omit_defaults=True):  # a figure not known is absent from the JSON
    step_p50_ms: float
    tokens_per_s: Optional[float] = None
    flops_per_step: Optional[float] = None
    flops_source: Optional[str] = None  # "counted" | "analytic" (6 x parameters x tokens)
    # analytic: which parameters it counts (a mixture of experts' active ones); counted on batches that vary: scaled
    flops_note: Optional[str] = None
    achieved_tflops: Optional[float] = None
    peak_tflops: Optional[float] = None
    mfu_pct: Optional[float] = None  # model FLOPs (no activation-checkpointing recompute) / step / peak
    hardware_flops_per_step: Optional[float] = None  # model FLOPs + the recompute (counted only)
    hfu_pct: Optional[float] = None  # hardware FLOPs / step / peak


class ThroughputJob(_Section, omit_defaults=True):  # a figure not known is absent from the JSON
    tokens_per_s: Optional[float] = None  # the slowest rank paces the job
    paced_by: Optional[str] = None  # that rank: tokens_per_s is every rank's tokens over its time
    achieved_tflops: Optional[float] = None  # model FLOPs: every rank's per step over paced_by's step
    mfu_pct: Optional[float] = None
    hfu_pct: Optional[float] = None


class ThroughputSection(_Section):
    per_rank: dict[str, ThroughputRank] = {}
    job: ThroughputJob = msgspec.field(default_factory=ThroughputJob)


# ---------------------------------------------------------------- trace overlap (fsdp_doctor.trace.analysis)


class OverlapRank(_Section):
    """One rank's communication over its profiled windows. ``comm_us``, ``overlap_us``, ``exposed_us`` and
    ``overlap_pct`` are over the whole windows (µs; HTA's ``get_comm_comp_overlap``); the ``*_per_step`` figures
    and ``step_ms`` are over the complete steps only (the verdict's window, see ``Breakdown``), divided by
    ``step_count``: the report's per-step figures (``report.comm``, the verdict's step) are these, and they never
    exceed the step. None where the windows hold no complete ``ProfilerStep``."""

    comm_us: float = 0.0  # union of collectives
    overlap_us: float = 0.0  # of that, while compute ran
    exposed_us: float = 0.0  # comm_us - overlap_us
    overlap_pct: Optional[float] = None  # None without communication
    steps: list[int] = []  # profiler steps in the windows
    step_count: int = 0  # complete steps analysed, over all windows
    # profiler step left out of them -> why: the last of its window, where it may be cut (trace.build.window_steps);
    # empty: none, or a report written before it
    steps_left_out: dict[str, str] = {}
    step_ms: Optional[float] = None  # mean wall time of a complete step
    comm_ms_per_step: Optional[float] = None  # union of collectives inside the complete steps, per step
    exposed_ms_per_step: Optional[float] = None  # of that, while no compute ran (the verdict's communication)
    hidden_ms_per_step: Optional[float] = None  # of that, while compute ran
    step_overlap_pct: Optional[float] = None  # hidden / comm inside the complete steps
    step_times_ms: dict[str, float] = {}  # complete step -> its wall time (ProfilerStep start to the next's)
    # complete step -> its exposed communication (ms; the verdict's communication parts in that step: the step less
    # it is the rank's own work, estimate.trace_straggler's); empty: a report written before it
    step_exposed_ms: dict[str, float] = {}
    # complete step unlike the rank's others (trace.analysis.ATYPICAL_STEP_FACTOR times their median or more) -> its
    # breakdown's parts (ms; ``Breakdown``'s, which hold it): the verdict says what its shares read without it;
    # empty: none, or a report written before it
    atypical_steps: dict[str, dict[str, float]] = {}
    # host time per step of the loop's code that issued collectives no FSDP unit issued, outside the model and
    # optimizer.step(): from the first such call's issue to the last one's end, the code between them included;
    # of that, the first calls' own time (their wait for the other ranks, which the step keeps without them)
    loop_comm_ms_per_step: Optional[float] = None
    loop_comm_wait_ms_per_step: Optional[float] = None
    # of loop_comm_ms_per_step, that between optimizer.step() and the next forward (where data loading is)
    between_comm_ms_per_step: Optional[float] = None
    # host time per step inside the DataLoader's ``enumerate(DataLoader)#...`` labels (its next batch: the wait for its
    # workers, or the loading itself without them). None: no complete step held one (the loop feeds batches
    # otherwise), or a report written before it
    dataloader_ms_per_step: Optional[float] = None
    # the loop that drove the run as the trace's own labels show it: records.LIGHTNING_DRIVER where Lightning's
    # profiler labelled its hooks (``[pl][profile]...``); None: not shown, or a report written before it
    driver: Optional[str] = None
    # host time per step inside FSDP2's labels (record_function ``FSDP::...``: its hooks, the all-gather copy-in and
    # copy-out, the reduce-scatter's copies, resharding; nested labels once): FSDP's own host work, which grows with
    # the number of units and parameters, not with the batch. None: no complete step, or a report written before it
    fsdp_host_ms_per_step: Optional[float] = None
    # FSDP roots per forward (trace.model.WindowTrace.roots_per_forward; the rank's windows' largest): more than one
    # where fully_shard was applied to blocks and not to the model. None: not seen, or a report written before it
    roots_per_forward: Optional[float] = None
    # the units FSDP2 all-gathered ahead in forward (trace.model.WindowTrace.forward_prefetched: its
    # FSDP::forward_prefetch labels, which only set_modules_to_forward_prefetch's lists issue); empty: none, or a report
    # written before it
    forward_prefetched: list[str] = []
    # complete step -> the forward passes it ran without a backward (trace.model.WindowTrace.nograd_forwards:
    # evaluation or generation inside a profiled step); empty: none, or a report written before it
    nograd_forwards: dict[str, int] = {}
    # complete steps whose ProfilerStep holds no optimizer.step() (trace.model.WindowTrace.steps_without_optimizer: a
    # loop calling prof.step() per micro-batch); empty: none, or a report written before it
    steps_without_optimizer: list[int] = []
    # backward passes through the model per complete step, and per optimizer step as the pairs of consecutive
    # optimizer.step() calls in the windows count them (trace.model.WindowTrace.step_backwards,
    # backwards_per_optimizer_step; the windows' median): None where not counted (no FSDP2 root's post-backward
    # label, fewer than two optimizer steps in a window), or a report written before them
    backwards_per_step: Optional[float] = None
    backwards_per_optimizer_step: Optional[float] = None
    device: str = "cpu"  # "gpu" | "cpu"
    comm_calls: int = 0
    comm_calls_on_compute_stream: int = 0
    # GPU: the time per complete step that collectives' kernels hold the compute stream (union inside the complete
    # steps): compute queued behind them waits for them, the other ranks' arrival included. Since torch 2.8 a
    # synchronous collective (async_op=False) is launched on the current stream by design; None: no complete step
    comm_ms_on_compute_stream_per_step: Optional[float] = None
    # GPU: how far the device ran behind the host when the window's first step started (the host runs ahead where
    # the loop does not sync): the window's figures follow the device by that much (trace.build._follow_the_device);
    # None: no lag (the largest of the rank's windows)
    device_lag_ms: Optional[float] = None


class CommUnitRow(_Section):
    """One (rank, unit, collective, phase) group of collective calls (µs unless named otherwise)."""

    rank: int
    unit: str
    collective: str  # "all_gather" | "reduce_scatter" | "all_reduce" | ...
    # "forward" | "backward"; a collective no FSDP unit issued: "optimizer" (inside optimizer.step()), "model" (inside
    # the model: its own parallelism's, e.g. tensor parallelism's), "grad_norm" (inside a norm operator) or None
    phase: Optional[str] = None
    count: int = 0
    comm_us: float = 0.0
    exposed_us: float = 0.0
    bytes_per_call: Optional[float] = None
    bytes_source: str | UnsetType = UNSET  # "unit snapshot" where the trace carries no message sizes
    busbw_gbps: Optional[float] = None  # bus bandwidth (decimal GB/s)
    # ranks in the calls' group, where the trace says it (NCCL's args, gloo's record_shapes, else the world where every
    # process group spans it): a reduce-scatter's output is its input over it (a unit's gradient shard)
    group_size: Optional[int] = None
    slack_us: Optional[float] = None  # mean time from the collective's end to its first use
    held_us: Optional[float] = None  # the same, negative slack counted as 0
    dtype: Optional[str] = None
    # per complete step of the rank's windows (``steps``, at least 1): fsdp_doctor.trace.analysis.per_step_row;
    # None in a section written without them (an older report, a hand-built one)
    steps: Optional[int] = None
    count_per_step: Optional[float] = None
    comm_ms_per_step: Optional[float] = None
    exposed_ms_per_step: Optional[float] = None


class Copies(_Section):
    h2d_us: float = 0.0
    d2h_us: float = 0.0
    exposed_us: float = 0.0  # copies while no compute ran


class DeviceIdle(_Section):
    idle_us: float = 0.0
    kernel_us: float = 0.0


class Blocking(_Section):
    count: int = 0  # collectives that blocked the host
    us: float = 0.0


class Breakdown(_Section):
    """A rank's profiled window split into exclusive parts (µs) that add up to ``window_us``; see
    ``fsdp_doctor.trace.analysis.breakdown``."""

    PARTS: ClassVar[tuple[str, ...]] = ("compute", "allgather_fwd", "allgather_bwd", "reducescatter", "model_comm",
                                        "other_comm", "offload", "other_gpu", "host", "sync", "input", "idle")
    #: the exposed communication parts, in the order an instant is given to (fsdp_doctor.trace.analysis.breakdown)
    COMM_PARTS: ClassVar[tuple[str, ...]] = ("allgather_fwd", "allgather_bwd", "reducescatter", "model_comm",
                                             "other_comm")
    #: of them, FSDP's own collectives'
    FSDP_COMM_PARTS: ClassVar[tuple[str, ...]] = ("allgather_fwd", "allgather_bwd", "reducescatter")

    compute: float = 0.0
    allgather_fwd: float = 0.0
    allgather_bwd: float = 0.0
    reducescatter: float = 0.0
    # collectives no FSDP unit issued, issued inside the model (tensor parallelism's, a vocab-parallel loss's, ...)
    model_comm: float = 0.0
    other_comm: float = 0.0
    offload: float = 0.0
    other_gpu: float = 0.0
    host: float = 0.0
    sync: float = 0.0  # the device idle while the host waits in a device sync (cudaDeviceSynchronize, .item())
    input: float = 0.0
    idle: float = 0.0
    window_us: float = 0.0
    comm_us: float = 0.0  # union of collectives inside the window, hidden or not (not a part)

    def parts(self) -> dict[str, float]:
        """part -> µs, in ``PARTS`` order (``window_us`` aside)."""
        return {k: getattr(self, k) for k in self.PARTS}


class KernelStats(_Section):
    """A GPU rank's compute kernels over its windows, by class (fsdp_doctor.trace.kernels): counts and µs."""

    count: float = 0.0
    busy_us: float = 0.0
    small_count: float = 0.0  # shorter than SMALL_KERNEL_US (10 µs): about a launch's cost
    small_us: float = 0.0
    softmax_count: float = 0.0  # forward softmax outside the loss: eager attention's
    softmax_us: float = 0.0
    fused_attention_count: float = 0.0  # flash / memory-efficient / cuDNN SDPA kernels
    fused_attention_us: float = 0.0
    gemm_count: float = 0.0
    gemm_us: float = 0.0
    launched_count: float = 0.0  # with their launch call in the trace
    launch_waited_count: float = 0.0  # of those, started within LAUNCH_WAIT_US (50 µs) of it: the device waited


class SkippedFile(_Section):
    file: str
    error: str  # one line


class OverlapSection(_Section):
    """``report.overlap``: what the Kineto traces say (``fsdp_doctor.trace.analysis.analyze_traces``)."""

    per_rank: dict[str, OverlapRank] = {}
    per_unit: list[CommUnitRow] = []  # most exposed first
    copies: dict[str, Copies] = {}
    idle: dict[str, DeviceIdle] = {}
    blocking: dict[str, Blocking] = {}
    breakdown: dict[str, Breakdown] = {}
    kernels: dict[str, KernelStats] = {}  # GPU ranks: compute kernels by class
    files: list[str] = []  # trace files read
    skipped: list[SkippedFile] = []  # trace files that could not be read
    # rank -> its trace files whose every complete step ran forwards without a backward or an optimizer step (an
    # evaluation's own profiler window: Lightning's PyTorchProfiler writes one for validation_step), left out of the
    # training figures beside that rank's training windows (trace.analysis.training_windows)
    evaluation_windows: dict[str, list[str]] = {}
    # trace files whose one profiler step ran nothing, each its rank's last: the window torch.profiler saves at its
    # exit where its schedule was recording (trace.reader.EmptyLastStep); not analysed, and no problem (a note)
    exit_windows: list[SkippedFile] = []
    units: list[TraceUnitRow] = []  # per-unit times from FSDP2's labels (fsdp_doctor.trace.steps_detail)
    memory: Optional[MemorySection] = None  # from the [memory] events (profile_memory=True), source "trace: ..."


# ---------------------------------------------------------------- verdict (fsdp_doctor.analyze.verdict)


class VerdictEntry(_Section, omit_defaults=True):  # a figure not known is absent from the JSON
    """What bounds the step: ``bound`` is the group with the largest share (``shares_pct`` by part,
    ``groups_pct`` by group: communication, compute, host, input, offload, idle)."""

    bound: str
    shares_pct: dict[str, float] = {}
    groups_pct: dict[str, float] = {}
    summary: str = ""
    source: str = ""  # "trace" | "records" | "records (host clock)" (the job: those of its ranks, joined)
    device: str = "cpu"  # "gpu" | "cpu"
    step_ms: Optional[float] = None  # per rank: the mean step of the window the shares come from
    steps: Optional[int] = None  # per rank
    ranks_by_bound: Optional[dict[str, list[int]]] = None  # the job only
    ranks: Optional[int] = None  # the job only
    read_on: Optional[int] = None  # the job only: the straggler rank whose own step it is (the others wait for it)


class Verdict(_Section):
    job: VerdictEntry
    per_rank: dict[str, VerdictEntry] = {}


# ---------------------------------------------------------------- findings (fsdp_doctor.diagnose)


#: where a fix's code goes in the user's script (``Recommendation.where``), as the presenters say it
FIX_PLACES = {
    "startup": "at the top of your training script, before anything allocates CUDA memory (or exported in the "
               "environment that launches it)",
    "unsharded": "in place of your fully_shard calls, on the unsharded model",
    "before_shard": "before your fully_shard calls, on the unsharded model",
    "sharded": "after your fully_shard calls",
    "prepared": "after accelerator.prepare(...) returns the sharded model",  # "sharded", where accelerate sharded it
    # "sharded", where torchtitan's parallelize function sharded it in the user's own loop (no fully_shard calls of
    # theirs: "after your fully_shard calls" read on a trial's torchtitan run)
    "parallelized": "after torchtitan's parallelize function (parallelize_llama) returns the sharded model",
    "around": "around your fully_shard calls (your calls where the code says)",
    "optimizer": "after your optimizer is built",
    "model": "after your model is built (and wrapped), before the training loop",  # a run without fully_shard
    "loop": "in your training loop",
    "backward": "in your training loop, between the loss and its backward",
    "after_backward": "in your training loop, after the backward and before optimizer.step(), in place of the code "
                      "it replaces",
    "evaluation": "around your evaluation (where the model runs without a backward after it)",
    "trainer": "with your Trainer built, before trainer.train()",
    # TRL's reference model, built and sharded by the user (rules/wrap.ReferenceOneUnit)
    "trl_reference": "before you build the TRL trainer, with your policy model built",
    # a loop fix where PyTorch Lightning's Trainer runs the loop (snippets.for_lightning)
    "training_step": "in your LightningModule's training_step(self, batch, batch_idx), before it returns the loss",
    "lightning_module": "in your LightningModule's class body",
    # a fix on the model where Lightning's Trainer built it (snippets.LIGHTNING_MODEL_PLACES)
    "configure_model": "in your LightningModule's configure_model(self), after your fully_shard calls",
    "configure_model_plan": "in your LightningModule's configure_model(self), in place of your fully_shard calls",
    "accelerate": "with your Accelerator built, before accelerator.prepare(model)",
    "torchtitan": "torchtitan's job config",
    "titan_registry": "in your torchtitan config_registry function, on the Trainer.Config it returns",
    # a setting the processes read at their start where torchtitan's Trainer runs them (snippets.launch_env)
    "launch_env": "in the environment that starts torchrun",
    "transformers": "after from_pretrained(..., distributed_config=...) returns the sharded model",
    # where one of torchtune's recipes drove the run (snippets.for_torchtune): the user's copy of it (tune cp), its
    # _setup_model sharding the model with training.shard_model (the model is `model` there), its train() the loop
    "torchtune_setup": "in your torchtune recipe's _setup_model, after training.shard_model(...)",
    "torchtune_plan": "in your torchtune recipe's _setup_model, in place of training.shard_model(...)",
    "torchtune_train": "in your torchtune recipe's train(), in its loop over the batches",
    "torchtune_backward": "in your torchtune recipe's train(), before its backward (current_loss.backward(); "
                          "loss.backward() in its DPO recipes)",
    "torchtune_optimizer": "in your torchtune recipe's setup(), after self._optimizer = self._setup_optimizer(...)",
    "torchtune_recipe": "in your torchtune recipe (your copy of it, tune cp), where the code's comments say",
    "torchtune_config": "in your torchtune config: the YAML tune run --config reads, or KEY=VALUE after it",
    # where OLMo-core's Trainer drove the run (snippets.for_olmo): the config its train module is built from, or
    # that train module once built (it holds the sharded model and the optimizer)
    "olmo_config": "in your OLMo-core configs, before train_module_config.build(model)",
    "olmo_built": "after train_module = train_module_config.build(model), before trainer.fit()",
    "olmo_trainer": "after trainer = trainer_config.build(train_module, data_loader), before trainer.fit()",
}
#: what a fix's code is, by where it goes, where it is not Python
FIX_LANGUAGES = {"torchtitan": "command line", "torchtune_config": "YAML", "launch_env": "shell"}


class Recommendation(_Section):
    text: str
    code: str = ""  # a fix the user can paste ("" where the text is the advice)
    where: str = ""  # where the code goes: a FIX_PLACES key ("" without code)
    # names a loop fix reads from the user's loop, each with what it must hold (e.g. is_last_micro_batch)
    inputs: dict[str, str] = {}


class Predicted(_Section):
    """What a finding's fix is predicted to change, in the run's units: the median step (ms) and the peak rank's
    device memory (bytes), before and after; a side the rule cannot tell is None. The deltas (after - before,
    negative: a gain) are filled in from them. ``at_most``: the after-figures are ceilings, the part of the gain the
    rule can count (the fix gains at least the deltas; what it leaves uncounted it says in its text).
    ``peak_at_most``: the peak after alone is a ceiling ("the peak may rise by up to one unit's parameters": its
    rerun at a lower peak read "missed", a new-user trial)."""

    step_ms_before: Optional[float] = None
    step_ms_after: Optional[float] = None
    peak_bytes_before: Optional[int] = None
    peak_bytes_after: Optional[int] = None
    step_ms_delta: Optional[float] = None
    peak_bytes_delta: Optional[int] = None
    at_most: bool = False
    peak_at_most: bool = False
    # the step figures are the mean step's, not the median's (a cost paid in some steps only: an intermittent
    # straggler's, which the median leaves out); shown as "mean step" (the summary quoted "step 105.9 ms" beside
    # the other findings' 83.0 ms median, unexplained: a new-user trial)
    step_mean: bool = False

    def __post_init__(self):
        if self.step_ms_before is not None and self.step_ms_after is not None:
            self.step_ms_delta = round(self.step_ms_after - self.step_ms_before, 3)
        if self.peak_bytes_before is not None and self.peak_bytes_after is not None:
            self.peak_bytes_delta = int(self.peak_bytes_after - self.peak_bytes_before)

    def __getitem__(self, field: str):  # read by field name, as the JSON form is
        return getattr(self, field)

    def get(self, field: str, default=None):
        return getattr(self, field, default)

    def __bool__(self) -> bool:  # predicts something
        return self.step_ms_after is not None or self.peak_bytes_after is not None


class RuleStatus(_Section):
    """``report.rules[i]``: one rule checked on this run and what came of it."""

    code: str
    status: Literal["fired", "quiet", "skipped", "failed"]  # quiet: ran, found nothing; skipped: a need not met
    reason: str = ""  # quiet/skipped/failed: why; fired: the findings' titles
    findings: int = 0


class Finding(_Section):
    """One finding of a rule: its evidence in numbers (units in the keys: ``_ms``, ``_bytes``, ``_pct``), a fix
    the user can paste and, where the rule can tell, the predicted gain."""

    code: str
    severity: Literal["info", "warning", "critical"]  # diagnose.base.SEVERITIES, least first
    title: str
    evidence: dict[str, Any]
    recommendation: Recommendation
    predicted: Predicted | UnsetType = UNSET
    ranks: list[int] = []
    units: list[str] = []

    def __post_init__(self):
        if self.predicted is None:
            self.predicted = UNSET
        elif isinstance(self.predicted, dict):  # the same figures by field name
            self.predicted = msgspec.convert(self.predicted, Predicted)

    def as_dict(self) -> dict:
        return msgspec.to_builtins(self)


# ---------------------------------------------------------------- the report


SCHEMA = "fsdp-doctor-report/1"


class Report(msgspec.Struct, kw_only=True):
    """The whole report. A section is None (``null`` in the JSON) where nothing fed it: ``steps``, ``units``,
    ``throughput`` and ``memory`` need records, ``overlap`` needs traces. Every key is always written, so that
    ``r["findings"]`` works on any report; the JSON schema is published with the package
    (``fsdp_doctor/report.schema.json``, ``fsdp-doctor schema``)."""

    schema: str = SCHEMA
    doctor_version: str = ""
    run: RunFacts = msgspec.field(default_factory=RunFacts)
    steps: Optional[StepsSection] = None
    # a run known only from its traces: step times of the complete ProfilerSteps (no phases, outliers or
    # stragglers: those need records; the rules read ``steps`` only)
    trace_steps: Optional[StepsSection] = None
    units: Optional[list[UnitRow]] = None
    throughput: Optional[ThroughputSection] = None
    memory: Optional[MemorySection] = None
    overlap: Optional[OverlapSection] = None
    comm: Optional[CommSummary] = None  # the one exposed-communication figure
    verdict: Optional[Verdict] = None
    findings: list[Finding] = []
    rules: list[RuleStatus] = []  # every rule checked: fired, quiet, skipped or failed, with the reason
    # one line each: files skipped, figures this torch could not give, rules not checked, how the ranks stopped where
    # not every one finished (store.reader.run_end_line)
    problems: list[str] = []

    def unit_rows(self) -> list:
        """The unit table the views show: the records' (``units``, with configuration), else a plain trace's
        times (``overlap.units``, ``TraceUnitRow``), else empty."""
        return self.units or (self.overlap.units if self.overlap is not None else []) or []

    def memory_section(self) -> Optional[MemorySection]:
        """The memory the views show: the records' (``memory``), else a plain trace's (``overlap.memory``)."""
        return self.memory or (self.overlap.memory if self.overlap is not None else None)

    def to_builtins(self) -> dict:
        """The JSON-ready form (what ``--json`` writes)."""
        return msgspec.to_builtins(self)

    @classmethod
    def json_schema(cls) -> dict:
        """The JSON schema of the ``--json`` form (``msgspec.json.schema``), as published in
        ``fsdp_doctor/report.schema.json``: descriptions cleaned as ``inspect.cleandoc`` cleans a docstring, which
        msgspec 0.23 does itself and 0.22 did not (the same schema from either). Every key of the report is
        required, as every one is always written (``{}`` validated against a schema that required none: a new-user
        trial's CI check)."""
        out = _cleaned(msgspec.json.schema(cls))
        mine = out["$defs"][cls.__name__]
        mine["required"] = sorted(mine["properties"])
        return out

    @classmethod
    def of(cls, report) -> "Report":
        """The typed report from a report or its JSON form. A section this version cannot read (a report
        written by another version) is left out and named under ``problems``, never an error."""
        if isinstance(report, cls):
            return report
        try:
            return msgspec.convert(report, cls)
        except msgspec.ValidationError:
            pass
        ok, bad = {}, []
        for name in cls.__struct_fields__:
            if name not in report:
                continue
            try:
                msgspec.convert({name: report[name]}, cls)
                ok[name] = report[name]
            except msgspec.ValidationError as e:
                bad.append(f"report section {name!r} unreadable by this version ({e})")
        out = msgspec.convert(ok, cls)
        out.problems = list(out.problems) + bad
        return out


def _cleaned(node):
    """A JSON schema with every ``description`` cleaned (``inspect.cleandoc``)."""
    if isinstance(node, dict):
        return {k: inspect.cleandoc(v) if k == "description" and isinstance(v, str) else _cleaned(v)
                for k, v in node.items()}
    if isinstance(node, list):
        return [_cleaned(x) for x in node]
    return node
