"""The one record model shared by the live recorder and every reader.

A run directory written by :func:`fsdp_doctor.watch` holds::

    manifest.json                       the run manifest (format name and version, world size, files)
    rank{R}.records.jsonl               one append-only record stream per rank (JSON lines)
    profiler/rank{R}.{step}.pt.trace.json.gz   Kineto traces of the profiled windows (TensorBoard layout)

Each line of a record stream is one of the tagged structs below (field ``"t"`` names the type). Lines
are written whole and flushed at the end of each step, so a run killed at any point (even SIGKILL)
leaves every completed step readable; a reader ignores a final line cut short. Readers accept any
stream whose ``Header.version`` is ``<= FORMAT_VERSION``; new optional fields may be added within a
version, renames or removals bump it.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

FORMAT_NAME = "fsdp-doctor-run"
FORMAT_VERSION = 1
# The run directory's layout is known by one module, fsdp_doctor.store.layout; re-exported for the writers.
from .store.layout import MANIFEST_NAME, PROFILER_DIR, stream_name  # noqa: E402,F401


class Record(msgspec.Struct, tag_field="t", kw_only=True, omit_defaults=True):
    """Base of every record: the rank that wrote it."""

    rank: int


class Header(Record, tag="header"):
    """First line of each stream."""

    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION
    world_size: int = 1
    pid: int = 0
    host: str = ""
    started_ns: int = 0  # time.time_ns() at watch() entry
    doctor_version: str = ""
    run_id: str = ""  # the same on every rank of one run and in its manifest ("" in files written before it)


class UnitConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Configuration snapshot of one FSDP unit (one FSDPState; a grouped unit is one unit)."""

    name: str  # FSDP's own module fqn for the unit ("" for the root, "norm, lm_head" for a group)
    modules: list[str]  # fqns of the modules the unit was applied to
    is_root: bool
    # None wherever this torch's FSDP internals could not be read ("unknown"; RunConfig.notes says why)
    param_count: int | None  # elements of the unsharded parameters
    n_params: int | None  # number of parameter tensors
    sharded_bytes: int | None  # this rank's local shards, padding included
    unsharded_bytes: int | None  # bytes when all-gathered (in param_dtype)
    orig_dtypes: list[str]  # distinct dtypes of the unit's parameters
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    output_dtype: str | None = None
    reshard_after_forward: Union[bool, int, None] = True
    forward_prefetch: list[str] | None = []
    backward_prefetch: list[str] | None = []
    unshard_async_op: bool | None = False
    offload: str | None = None  # "cpu" when CPUOffloadPolicy is set
    offload_pin_memory: bool | None = None
    checkpoint: str = "none"  # "none" | "unit" (AC wraps the unit) | "children" | "partial"
    param_groups: int | None = 1
    depth: int = 0  # nesting depth among units (root 0)
    parent: str | None = None  # name of the enclosing unit


class RunConfig(Record, tag="config"):
    """Written once per rank at the first step."""

    world_size: int
    backend: str
    device: str  # "cpu" or "cuda:N"
    device_name: str = ""
    torch_version: str = ""
    optimizer: str | None = None
    optimizer_params: int = 0  # parameter tensors held by the optimizer
    optimizer_foreign_params: int = 0  # of those, tensors that are not the model's parameters
    optimizer_foreign_bytes: int = 0
    units: list[UnitConfig] = []
    unmanaged_param_bytes: int | None = 0  # parameters no FSDP unit manages (None: unknown)
    model_param_count: int = 0
    capacity_bytes: int | None = None
    tokens_per_step: int | None = None
    peak_tflops: float | None = None
    flops_per_step: float | None = None
    profile_schedule: dict[str, int] | None = None
    notes: list[str] = []
    unmanaged_trainable_names: list[str] | None = None  # trainable parameters no unit manages (ignored_params)
    unmanaged_trainable_bytes: int | None = None
    # one line each: what this torch's FSDP2 could not tell the doctor (private state it could not read, a
    # failed consistency check, a label or API this release lacks); the report lists them under problems
    unavailable: list[str] = []
    # features of FSDP2 this torch release does not have (a record_function label, a private API), e.g.
    # "label FSDP::post_backward_rs_wait": facts about the release, not problems of the run
    torch_lacks: list[str] = []


class UnitStep(msgspec.Struct, kw_only=True, omit_defaults=True, array_like=True):
    """Host-side timings of one unit within one step (milliseconds).

    fwd_ms brackets FSDP's own forward hooks (pre-forward all-gather wait through post-forward
    reshard); ag_wait_fwd_ms is the part between entering FSDP's pre-forward hook and leaving it
    (the unshard issued and waited for). bwd_ms runs from FSDP's pre-backward to its post-backward
    for the unit; ag_wait_bwd_ms is the pre-backward unshard wait. recompute_ms is forward time
    re-run under activation checkpointing during backward (measured when the re-run completes; the
    default non-reentrant checkpoint stops its re-run early, and then it is the unit's forward compute
    time fwd_ms - ag_wait_fwd_ms, which is what the re-run repeats). All inclusive of nested units.
    """

    name: str
    fwd_ms: float = 0.0
    ag_wait_fwd_ms: float = 0.0
    bwd_ms: float = 0.0
    ag_wait_bwd_ms: float = 0.0
    recompute_ms: float = 0.0
    fwd_calls: int = 0  # forward calls of the unit's modules (a grouped unit of two modules: 2 per pass)


class StepRecord(Record, tag="step"):
    """One training step of one rank: from the previous ``doctor.step()`` to this one."""

    step: int
    start_ns: int  # wall clock (time.time_ns) at the step's start
    wall_ms: float
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    optimizer_ms: float = 0.0
    outside_ms: float = 0.0  # wall - forward - backward - optimizer: data loading, loss, user code
    gc_ms: float = 0.0
    gc_count: int = 0
    profiled: bool = False  # inside an active torch.profiler window
    units: list[UnitStep] = []
    memory: dict[str, Any] | None = None  # memory by category (see fsdp_doctor.record.memory)


class GpuTimes(Record, tag="gpu"):
    """Device-side times of one step on CUDA, from events read a step later (see record/gpu_timing.py).

    ``units`` rows are ``[name, fwd_ms, bwd_ms]``: the device time between the same brackets the host
    timings use (inclusive of nested units)."""

    step: int
    step_ms: float
    units: list[list[Union[str, float]]] = []


class ProfileWindow(Record, tag="profile"):
    """A torch.profiler window whose Kineto trace was written."""

    steps: list[int]
    path: str  # relative to the run directory


class DoctorError(Record, tag="error"):
    """The doctor caught an exception in its own hooks and stepped aside; training went on."""

    where: str
    message: str
    step: int | None = None


class End(Record, tag="end"):
    """Written when ``watch`` exits normally."""

    steps: int
    ended_ns: int


AnyRecord = Union[Header, RunConfig, StepRecord, GpuTimes, ProfileWindow, DoctorError, End]


class Manifest(msgspec.Struct, kw_only=True, omit_defaults=True):
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION
    world_size: int = 1
    started_ns: int = 0
    streams: list[str] = []
    profiler_dir: str = PROFILER_DIR
    doctor_version: str = ""
    command: list[str] = []
    run_id: str = ""  # see Header.run_id


record_encoder = msgspec.json.Encoder()
record_decoder = msgspec.json.Decoder(AnyRecord)
manifest_decoder = msgspec.json.Decoder(Manifest)
