"""Tokens/s, achieved TFLOP/s and MFU from the recorded step times and the counted FLOPs."""

from __future__ import annotations

from ..store import Run
from .steps import step_stats, usable_steps


def analyze_throughput(run: Run) -> dict | None:
    per_rank = {}
    job_tflops = 0.0
    any_data = False
    for r, rd in sorted(run.ranks.items()):
        cfg = rd.config
        st = step_stats(usable_steps(rd.steps))
        if cfg is None or not st["count"]:
            continue
        p50_s = st["p50_ms"] / 1e3
        row: dict = {"step_p50_ms": st["p50_ms"]}
        if cfg.tokens_per_step:
            row["tokens_per_s"] = round(cfg.tokens_per_step / cfg.world_size / p50_s, 1)
            any_data = True
        if cfg.flops_per_step:
            tf = cfg.flops_per_step / p50_s / 1e12
            row["flops_per_step"] = cfg.flops_per_step
            row["achieved_tflops"] = round(tf, 4)
            job_tflops += tf
            any_data = True
            if cfg.peak_tflops:
                row["peak_tflops"] = cfg.peak_tflops
                row["mfu_pct"] = round(100 * tf / cfg.peak_tflops, 2)
        per_rank[str(r)] = row
    if not any_data:
        return None
    cfg = run.config
    job: dict = {}
    p50s = [v["step_p50_ms"] for v in per_rank.values()]
    if cfg and cfg.tokens_per_step and p50s:
        job["tokens_per_s"] = round(cfg.tokens_per_step / (max(p50s) / 1e3), 1)  # the slowest rank paces the job
    if job_tflops:
        job["achieved_tflops"] = round(job_tflops, 4)
        peaks = [v.get("peak_tflops") for v in per_rank.values()]
        if all(peaks):
            job["mfu_pct"] = round(100 * job_tflops / sum(peaks), 2)
    return {"per_rank": per_rank, "job": job}
