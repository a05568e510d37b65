"""Typed sections of the report (msgspec structs), built by the pipeline and read by the presenters by attribute.

The report itself stays a JSON-ready dict (``msgspec.to_builtins`` of each typed section, so ``--json`` writes the
same keys as before); a presenter reads a section through its ``of`` constructor, which accepts the stored dict.
So far the run facts (``run``), the ``steps`` and ``memory`` sections and the ``comm`` headline are typed; the other sections are still plain dicts (see the README's code map).
"""

from __future__ import annotations

from typing import Any, Optional

import msgspec
from msgspec import UNSET, UnsetType


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


class RunFacts(_Section):
    """``report["run"]``: what was analysed. The fields after ``trace_files`` come from the configuration record
    and are absent (UNSET, not written) for a run without one; a recorded None (no capacity) is written."""

    path: str = ""  # the run directory, or the one trace file given
    ranks: list[int] = []  # ranks with records
    world_size: Optional[int] = None
    run_id: Optional[str] = None
    trace_files: int = 0  # Kineto trace files read
    backend: str | UnsetType = UNSET
    device: str | UnsetType = UNSET  # the run's device ("cpu", "cuda:0")
    device_name: str | UnsetType = UNSET
    torch_version: str | UnsetType = UNSET
    optimizer: Optional[str] | UnsetType = UNSET
    units: int | UnsetType = UNSET  # FSDP units
    model_param_count: int | UnsetType = UNSET
    capacity_bytes: Optional[int] | UnsetType = UNSET  # memory budget per rank (bytes)
    tokens_per_step: Optional[int] | UnsetType = UNSET
    torch_lacks: list[str] | UnsetType = UNSET  # FSDP2 features this torch release does not have
    doctor_errors: list[dict[str, Any]] | UnsetType = UNSET  # the doctor stepped aside: rank, where, message, step
    steps_recorded: dict[str, int] = {}  # per rank
    complete: dict[str, bool] = {}  # per rank: the stream ended cleanly


class CommSummary(_Section):
    """``report["comm"]``: the one exposed-communication figure, with its definition and source."""

    source: str  # "trace" (profiled windows) | "records" (the recorder's all-gather waits)
    source_text: str  # e.g. "profiler trace, steps 6–7"
    definition: str
    exposed_ms_per_step: float  # median over ranks (ms per step)
    comm_ms_per_step: Optional[float] = None  # all communication, median over ranks (trace only)
    overlap_pct: Optional[float] = None  # share of communication overlapped by compute (trace only)
    # per rank: {"exposed_ms_per_step"} from records; from traces also "comm_ms_per_step", "overlap_pct", "steps"
    per_rank: dict[str, dict[str, Any]] = {}


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


class MemoryRank(_Section):
    """``report["memory"]["per_rank"][rank]`` (fsdp_doctor.analyze.memory); bytes unless named otherwise."""

    peak_bytes: int = 0  # device bytes at the highest sampled mark
    peak_at: MemoryPeakAt = msgspec.field(default_factory=MemoryPeakAt)
    peak_breakdown: dict[str, int] = {}  # category -> bytes; adds up to peak_bytes (device categories)
    peak_share: dict[str, float] = {}  # category -> fraction of the peak
    offloaded_host_bytes: int = 0  # host memory of CPU-offloaded state, apart from the peak
    activations_peak_bytes: int = 0  # highest activation figure sampled on any step
    capacity_bytes: Optional[int] = None
    capacity_fraction: Optional[float] = None
    steady_bytes: dict[str, int] = {}  # after the last optimizer step (what stays between steps)
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


class MemorySection(_Section):
    """``report["memory"]``: memory by category per rank (step 0, FSDP's lazy init, left out when later steps
    exist)."""

    categories: list[str] = []  # device categories, in order
    peak_rank: str = ""  # the rank with the highest peak
    peak_bytes: int = 0
    per_rank: dict[str, MemoryRank] = {}


class StepStats(_Section):
    """Step-time statistics of one rank or the job over its steady steps (ms); only ``count`` and the percentiles
    (None) when there is none. ``recorded`` / ``excluded`` per rank only."""

    count: int = 0
    p50_ms: Optional[float] = None
    p90_ms: Optional[float] = None
    p99_ms: Optional[float] = None
    max_ms: Optional[float] = None
    mean_ms: float | UnsetType = UNSET
    cv: Optional[float] = None  # coefficient of variation (fraction)
    phases_p50_ms: dict[str, float] | UnsetType = UNSET  # forward, backward, optimizer, outside, gc
    gc_ms_total: float | UnsetType = UNSET
    gc_count_total: int | UnsetType = UNSET
    wall_ms_total: float | UnsetType = UNSET
    recorded: int | UnsetType = UNSET  # steps recorded
    excluded: int | UnsetType = UNSET  # of those, left out (first step, profiled steps)


class Outlier(_Section):
    rank: int
    step: int
    ms: float
    median_ms: float
    excess_ms: float
    cause: str  # "late_rank" | "gc" | "outside" | "allgather_wait" | "compute"
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


class StepsSection(_Section):
    """``report["steps"]`` (fsdp_doctor.analyze.steps)."""

    per_rank: dict[str, StepStats] = {}
    job: Optional[StepStats] = None
    outliers: list[Outlier] = []  # worst first
    stragglers: list[Straggler] = []
    # per rank: {"window": steps inside profiled windows, "export": the steps that exported a window}
    profiler_steps: dict[str, dict[str, list[int]]] = {}
