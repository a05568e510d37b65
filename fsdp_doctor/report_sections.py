"""Typed sections of the report (msgspec structs), built by the pipeline and read by the presenters by attribute.

The report itself stays a JSON-ready dict (``msgspec.to_builtins`` of each typed section, so ``--json`` writes the
same keys as before); a presenter reads a section through its ``of`` constructor, which accepts the stored dict.
So far the run facts (``run``) and the ``comm`` headline are typed; the other sections are still plain dicts (see the README's code map).
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
