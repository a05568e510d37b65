"""The trace engine: communication/compute overlap, per-FSDP-unit exposure and prefetch timing from
Kineto (torch.profiler) traces, GPU/NCCL and CPU/gloo.

    from fsdp_doctor.trace import analyze_traces
    result = analyze_traces("runs/run1/profiler")   # a file, a folder (recursive) or a list
    result.per_rank["0"].overlap_pct                 # an OverlapSection (fsdp_doctor.report_sections)

This package does not import torch.
"""

from .analysis import (
    analyze_traces,
    analyze_windows,
    blocking,
    breakdown,
    call_exposure,
    copies,
    gpu_overlap_pct,
    idle,
    overlap,
    temporal_breakdown,
    unit_rows,
)
from .build import build_window
from .loader import load_window, load_windows
from .model import CollectiveCall, WindowTrace
from .reader import TraceError, decode, find_trace_files

__all__ = [
    "CollectiveCall",
    "TraceError",
    "WindowTrace",
    "analyze_traces",
    "analyze_windows",
    "blocking",
    "breakdown",
    "build_window",
    "call_exposure",
    "copies",
    "decode",
    "find_trace_files",
    "gpu_overlap_pct",
    "idle",
    "load_window",
    "load_windows",
    "overlap",
    "temporal_breakdown",
    "unit_rows",
]
