"""Typed sections of the report (msgspec structs), built by the pipeline and read by the presenters by attribute.

The report itself stays a JSON-ready dict (``msgspec.to_builtins`` of each typed section, so ``--json`` writes the
same keys as before); a presenter reads a section through its ``of`` constructor, which accepts the stored dict.
So far the ``comm`` headline is typed; the other sections are still plain dicts (see the README's code map).
"""

from __future__ import annotations

from typing import Any, Optional

import msgspec


class CommSummary(msgspec.Struct, kw_only=True):
    """``report["comm"]``: the one exposed-communication figure, with its definition and source."""

    source: str  # "trace" (profiled windows) | "records" (the recorder's all-gather waits)
    source_text: str  # e.g. "profiler trace, steps 6–7"
    definition: str
    exposed_ms_per_step: float  # median over ranks (ms per step)
    comm_ms_per_step: Optional[float] = None  # all communication, median over ranks (trace only)
    overlap_pct: Optional[float] = None  # share of communication overlapped by compute (trace only)
    # per rank: {"exposed_ms_per_step"} from records; from traces also "comm_ms_per_step", "overlap_pct", "steps"
    per_rank: dict[str, dict[str, Any]] = {}

    @classmethod
    def of(cls, section) -> Optional["CommSummary"]:
        """The typed section from the report (a dict, as stored and written to JSON) or None."""
        if section is None or isinstance(section, cls):
            return section
        try:
            return msgspec.convert(section, cls)
        except msgspec.ValidationError:  # a report written by another version without the figure: nothing to show
            return None
