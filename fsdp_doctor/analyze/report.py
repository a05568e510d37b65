"""The report: one JSON document built from a Run by plain analysis functions, then diagnosed."""

from __future__ import annotations

import statistics
from typing import Callable

import msgspec

from .. import __version__
from ..store import Run
from .steps import analyze_steps, usable_steps
from .throughput import analyze_throughput

SCHEMA = "fsdp-doctor-report/1"


def run_facts(run: Run) -> dict:
    cfg = run.config
    facts = {"path": str(run.path), "ranks": sorted(run.ranks), "world_size": run.world_size,
             "trace_files": len(run.trace_files)}
    if cfg is not None:
        facts.update(backend=cfg.backend, device=cfg.device, device_name=cfg.device_name,
                     torch_version=cfg.torch_version, optimizer=cfg.optimizer, units=len(cfg.units),
                     model_param_count=cfg.model_param_count, capacity_bytes=cfg.capacity_bytes,
                     tokens_per_step=cfg.tokens_per_step)
        if cfg.torch_lacks:  # FSDP2 features this torch release does not have (labels, private APIs)
            facts["torch_lacks"] = list(cfg.torch_lacks)
    errs = [{"rank": e.rank, "where": e.where, "message": e.message, "step": e.step}
            for rd in run.ranks.values() for e in rd.errors]
    if errs:
        facts["doctor_errors"] = errs
    facts["steps_recorded"] = {str(r): len(rd.steps) for r, rd in sorted(run.ranks.items())}
    facts["complete"] = {str(r): rd.end is not None for r, rd in sorted(run.ranks.items())}
    return facts


def unit_table(run: Run) -> list[dict]:
    """The configuration snapshot of each unit (lowest rank), with median per-step timings across ranks."""
    cfg = run.config
    if cfg is None:
        return []
    timings: dict[str, dict[str, list[float]]] = {}
    for rd in run.ranks.values():
        for s in usable_steps(rd.steps):
            for u in s.units:
                t = timings.setdefault(u.name, {k: [] for k in ("fwd_ms", "ag_wait_fwd_ms", "bwd_ms", "ag_wait_bwd_ms", "recompute_ms")})
                for k in t:
                    t[k].append(getattr(u, k))
    out = []
    for u in cfg.units:
        d = msgspec.to_builtins(u)
        d.setdefault("forward_prefetch", [])
        d.setdefault("backward_prefetch", [])
        t = timings.get(u.name)
        if t:
            d["timing_p50"] = {k: round(statistics.median(v), 3) for k, v in t.items() if v}
        out.append(d)
    return out


_ITEMSIZE = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float64": 8, "float8_e4m3fn": 1,
             "float8_e5m2": 1}


def fill_sizes_from_units(overlap: dict, run: Run) -> None:
    """Bytes per call and bus bandwidth from the unit snapshot where the trace has no message sizes
    (gloo traces carry none): an all-gather moves the unit's unsharded parameters in param dtype, a
    reduce-scatter its unsharded gradients in reduce dtype."""
    from ..trace.analysis import busbw_factor

    cfg = run.config
    if cfg is None:
        return
    units = {u.name: u for u in cfg.units}
    for row in overlap.get("per_unit", []):
        u = units.get(row["unit"])
        if u is None or row.get("bytes_per_call") is not None or not u.param_count:
            continue
        if row["collective"] == "all_gather":
            nbytes = u.unsharded_bytes
        elif row["collective"] == "reduce_scatter":
            dt = u.reduce_dtype or (u.orig_dtypes[0] if u.orig_dtypes else "float32")
            nbytes = u.param_count * _ITEMSIZE.get(dt, 4)
        else:
            continue
        row["bytes_per_call"] = float(nbytes)
        row["bytes_source"] = "unit snapshot"
        f = busbw_factor(row["collective"], cfg.world_size)
        if f is not None and row["comm_us"] > 0:
            row["busbw_gbps"] = nbytes * row["count"] * f / row["comm_us"] / 1e3


def build_report(run: Run, *, progress: Callable[[int, int], None] | None = None, traces: bool = True) -> dict:
    report: dict = {"schema": SCHEMA, "doctor_version": __version__, "run": run_facts(run)}
    problems = list(run.problems)
    if run.has_records:
        report["steps"] = analyze_steps(run)
        report["units"] = unit_table(run)
        tp = analyze_throughput(run)
        if tp:
            report["throughput"] = tp
        try:
            from .memory import analyze_memory
        except ImportError:
            analyze_memory = None
        if analyze_memory is not None:
            mem = analyze_memory(run)
            if mem:
                report["memory"] = mem
    if traces and run.trace_files:
        from ..trace import analyze_traces

        ov = analyze_traces(run.trace_files, progress=progress)
        fill_sizes_from_units(ov, run)
        report["overlap"] = ov
        problems.extend(f"{s['file']}: {s['error']}" for s in ov.get("skipped", []))
    from ..diagnose import diagnose

    report["findings"] = diagnose(run, report)
    if run.config is not None:  # what this torch's FSDP2 did not let the recorder read (one line each)
        problems.extend(n for n in run.config.unavailable if n not in problems)
    problems.extend(report.pop("rules_skipped", []))
    report["problems"] = problems
    return report
