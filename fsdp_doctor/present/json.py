"""JSON presenter: the report as JSON (``--json FILE``, the demo's ``report.json``), the typed contract of
:mod:`fsdp_doctor.report_sections` encoded by msgspec. ``Report.of`` reads it back to the same struct."""

from __future__ import annotations

from pathlib import Path

import msgspec

from ..report_sections import Report


def render_json(report: Report | dict) -> bytes:
    """The report (a Report, or its JSON form) as indented JSON bytes."""
    return render_struct(Report.of(report))


def render_struct(struct: msgspec.Struct) -> bytes:
    """Any of the typed contracts (a ``Report``, a compare ``Comparison``) as indented JSON bytes."""
    return msgspec.json.format(msgspec.json.encode(struct), indent=1)


def write_struct_json(struct: msgspec.Struct, path: Path | str) -> Path:
    """Writes a typed contract as JSON to ``path`` atomically; returns it."""
    from ..store.layout import write_atomic

    return write_atomic(Path(path), render_struct(struct))


def write_json(report: Report | dict, path: Path | str) -> Path:
    """Writes the report as JSON to ``path`` atomically (a reader never sees half a file); returns it."""
    return write_struct_json(Report.of(report), path)
