"""Analyze: stateless functions over a Run (the same model for live and recorded runs). The report is built by
:func:`fsdp_doctor.pipeline.build_report` (re-exported here lazily: this package does not import the diagnosis)."""

from .report import SCHEMA
from .steps import analyze_steps

__all__ = ["SCHEMA", "analyze_steps", "build_report"]


def __getattr__(name):
    if name == "build_report":
        from ..pipeline import build_report

        return build_report
    raise AttributeError(f"module 'fsdp_doctor.analyze' has no attribute {name!r}")
