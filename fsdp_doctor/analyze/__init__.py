"""Analyze: stateless functions over a Run (the same model for live and recorded runs)."""

from .report import SCHEMA, build_report
from .steps import analyze_steps

__all__ = ["SCHEMA", "analyze_steps", "build_report"]
