"""How well do the doctor's predicted gains hold? For several scenarios: run the reference workload with
the problem, take the finding's prediction, apply its recommendation to the workload, run again, and compare
predicted with measured step time (median) and peak memory (the memory probe's peak, largest rank).

    .venv/bin/python benchmarks/predictions.py                 # every case, 12 steps each
    .venv/bin/python benchmarks/predictions.py --steps 8 --only whole_to_block,sync_to_async
    .venv/bin/python benchmarks/predictions.py --json out.json

Step times on a shared CPU host are noisy: the "before" and "after" runs are interleaved per case (``--reps``
pairs) and each figure is the median over the pairs of each run's median step; treat differences under ~10%
as noise. Peaks come from the memory probe and are deterministic on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("OMP_NUM_THREADS", "1")

MiB = 1 << 20

# name: (code, fix in words, knobs before, knobs after (or a function of the "before" run's finding), watch extras)
CASES = {
    "whole_to_block": ("wrap.too_coarse", "wrap whole -> block", dict(wrap="whole", async_unshard=True),
                       dict(wrap="block", async_unshard=True), {}),
    "sync_to_async": ("prefetch.sync_unshard", "_set_unshard_async_op(True)", dict(async_unshard=False),
                      dict(async_unshard=True), {}),
    "ac_off": ("ac.unneeded", "ac block -> none", dict(ac="block", async_unshard=True),
               dict(ac="none", async_unshard=True), {"capacity_bytes": 8 << 30}),
    "ac_on": ("ac.recommended", "ac none -> checkpoint the chosen blocks", dict(batch_size=8, async_unshard=True),
              dict(batch_size=8, ac="block", async_unshard=True), {"capacity_bytes": 12 * MiB}),
    # ZeRO-2 per unit: the "after" run keeps exactly the units the finding chose gathered after forward
    "zero2": ("reshard.zero2_affordable", "flip the chosen units (ample memory)", dict(async_unshard=True),
              lambda f: dict(async_unshard=True, reshard_overrides=_flipped(f)), {"capacity_bytes": 8 << 30}),
    # ... and with a budget (0.8 x 21 MB) that holds only part of them: the best time saved per byte
    "zero2_tight": ("reshard.zero2_affordable", "flip the chosen units (tight budget)", dict(async_unshard=True),
                    lambda f: dict(async_unshard=True, reshard_overrides=_flipped(f)), {"capacity_bytes": 21_000_000}),
    "root_params": ("wrap.params_in_root", "blocks_only -> block", dict(wrap="blocks_only", async_unshard=True),
                    dict(wrap="block", async_unshard=True), {}),
    "optimizer_order": ("optim.before_shard", "optimizer after fully_shard",
                        dict(optimizer_before_shard=True, async_unshard=True), dict(async_unshard=True), {}),
    "prefetch": ("prefetch.exposed_allgather", "explicit prefetch depth 1", dict(async_unshard=True),
                 dict(async_unshard=True, forward_prefetch=1, backward_prefetch=1), {}),
    "loader": ("jitter.data_wait", "loader_ms 100 -> 0", dict(async_unshard=True, loader_ms=100.0),
               dict(async_unshard=True), {}),
}


def _flipped(finding) -> dict:
    """reshard_overrides keeping the units a reshard.zero2_affordable finding (a Finding, or None) chose gathered
    after forward."""
    return {n: False for n in (finding.evidence if finding else {}).get("units_flipped", [])}


def run_once(out: Path, steps: int, knobs: dict, extra: dict):
    """The report (a ``Report``) of the workload run with ``knobs`` and the doctor's ``extra`` watch options."""
    from fsdp_doctor import load_run
    from fsdp_doctor.analyze import build_report
    from fsdp_doctor.workloads import WorkloadConfig, launch

    cfg = WorkloadConfig(steps=steps, **knobs)
    watch = {"out_dir": str(out), "tokens_per_step": cfg.tokens_per_step(2), "profile": False}
    watch.update(extra)
    launch(cfg, nproc=2, watch_kwargs=watch)
    return build_report(load_run(out), traces=False)


def measured(report) -> tuple[float | None, int | None]:
    from fsdp_doctor.diagnose import Context
    from fsdp_doctor.diagnose import estimate as E
    from fsdp_doctor.store import load_run

    ctx = Context(run=load_run(report.run.path), report=report)
    return E.step_ms(ctx), E.peak_bytes(ctx)


def _err(pred, meas):
    if pred is None or meas is None or not meas:
        return None
    return 100.0 * (pred - meas) / meas


def run_case(name: str, steps: int, tmp: Path, reps: int = 2) -> dict:
    """Runs before/after ``reps`` times, interleaved (B A B A ...), so that both see the same host load;
    step times are the median over reps of each run's median step, peaks the largest measured."""
    import statistics

    code, fix, before, after, extra = CASES[name]
    sb_l, sa_l, pb_l, pa_l, preds, fired, after_codes = [], [], [], [], [], [], set()
    for i in range(reps):
        rb = run_once(tmp / f"{name}_before{i}", steps, before, extra)
        f = next((x for x in rb.findings if x.code == code), None)
        ra = run_once(tmp / f"{name}_after{i}", steps, after(f) if callable(after) else after, extra)
        fired.append(f)
        if f and f.predicted:
            preds.append(f.predicted)
        (sb, pb), (sa, pa) = measured(rb), measured(ra)
        sb_l.append(sb), sa_l.append(sa), pb_l.append(pb), pa_l.append(pa)
        after_codes |= {x.code for x in ra.findings if x.severity != "info"}

    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    sb, sa, pb, pa = med(sb_l), med(sa_l), med(pb_l), med(pa_l)
    # the prediction is relative to its own "before" run: apply its predicted change to the median before
    step_pred = peak_pred = None
    d_step = med([p["step_ms_after"] / p["step_ms_before"] for p in preds
                  if p.get("step_ms_after") is not None and p.get("step_ms_before")])
    if d_step is not None and sb is not None:
        step_pred = sb * d_step
    d_peak = med([p["peak_bytes_after"] - p["peak_bytes_before"] for p in preds
                  if p.get("peak_bytes_after") is not None and p.get("peak_bytes_before") is not None])
    if d_peak is not None and pb is not None:
        peak_pred = pb + d_peak
    f = next((x for x in fired if x), None)
    return {"case": name, "code": code, "fired": sum(1 for x in fired if x), "reps": reps,
            "severity": f.severity if f else None, "fix": fix,
            "step_before_ms": sb, "step_pred_ms": step_pred, "step_after_ms": sa,
            "step_change_pred_pct": None if step_pred is None or not sb else 100 * (step_pred - sb) / sb,
            "step_change_meas_pct": None if sa is None or not sb else 100 * (sa - sb) / sb,
            "step_err_pct": _err(step_pred, sa),
            "step_runs_ms": {"before": sb_l, "after": sa_l},
            "peak_before": pb, "peak_pred": peak_pred, "peak_after": pa,
            "peak_err_pct": _err(peak_pred, pa), "after_codes": sorted(after_codes),
            "applied": [sorted(after(x)["reshard_overrides"]) for x in fired] if callable(after) else None}


def _f(x, fmt="{:.1f}"):
    return "—" if x is None else fmt.format(x)


def print_table(rows: list[dict]) -> None:
    head = (f"{'case':<16} {'code':<27} {'step ms: before':>15} {'pred':>7} {'after':>7} {'Δpred':>6} "
            f"{'Δmeas':>6}   {'peak MiB: before':>16} {'pred':>7} {'after':>7} {'err':>5}")
    print(head)
    print("-" * len(head))
    for r in rows:
        code = r["code"] + ("" if r["fired"] == r["reps"] else f" ({r['fired']}/{r['reps']})")
        print(f"{r['case']:<16} {code:<27} {_f(r['step_before_ms']):>15} {_f(r['step_pred_ms']):>7} "
              f"{_f(r['step_after_ms']):>7} {_f(r['step_change_pred_pct'], '{:+.0f}%'):>6} "
              f"{_f(r['step_change_meas_pct'], '{:+.0f}%'):>6}   "
              f"{_f(r['peak_before'] and r['peak_before'] / MiB, '{:.2f}'):>16} "
              f"{_f(r['peak_pred'] and r['peak_pred'] / MiB, '{:.2f}'):>7} "
              f"{_f(r['peak_after'] and r['peak_after'] / MiB, '{:.2f}'):>7} {_f(r['peak_err_pct'], '{:+.0f}%'):>5}")
    for r in rows:
        if r.get("applied"):
            print(f"{r['case']}: units flipped per rep: " + "; ".join(", ".join(a) or "none" for a in r["applied"]))
    print("Δpred / Δmeas: predicted / measured change of the median step; err = (predicted - measured) / measured "
          "peak; (k/n) = the finding fired in k of n 'before' runs")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--reps", type=int, default=2, help="interleaved before/after repetitions per case")
    p.add_argument("--only", default="", help="comma-separated case names: " + ", ".join(CASES))
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--keep", default=None, help="keep the run directories under this folder")
    ns = p.parse_args(argv)
    names = [n.strip() for n in ns.only.split(",") if n.strip()] or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        p.error(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    tmp = Path(ns.keep) if ns.keep else Path(tempfile.mkdtemp(prefix="fsdp_doctor_pred_"))
    rows = []
    try:
        for n in names:
            t0 = time.time()
            rows.append(run_case(n, ns.steps, tmp, ns.reps))
            print(f"[{n}: {time.time() - t0:.0f} s]", file=sys.stderr, flush=True)
    finally:
        if not ns.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    print_table(rows)
    if ns.json:
        Path(ns.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
