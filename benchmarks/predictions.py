"""How well do the doctor's predicted gains hold? For several scenarios: run the reference workload with
the problem, take the finding's prediction, apply its recommendation to the workload, run again, and compare
predicted with measured step time (median) and peak memory (the memory probe's peak, largest rank): each
before/after pair goes through ``fsdp-doctor compare --applied CODE`` (fsdp_doctor.analyze.compare), whose
prediction check is the table's source.

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


# the device of every run (--device): "cuda" runs the cases on NCCL ranks (several ranks share a GPU when fewer
# are visible: fsdp_doctor.workloads.gpu_plan)
DEVICE = {"device": "cpu"}
# gloo-only cases (synchronous unshard blocks the host on gloo only; NCCL's all-gathers are asynchronous)
CPU_ONLY = {"sync_to_async"}


def run_once(out: Path, steps: int, knobs: dict, extra: dict):
    """The run (a ``Run``) of the workload with ``knobs`` and the doctor's ``extra`` watch options."""
    from fsdp_doctor import load_run
    from fsdp_doctor.workloads import WorkloadConfig, launch

    cfg = WorkloadConfig(steps=steps, **{**knobs, **DEVICE})
    watch = {"out_dir": str(out), "tokens_per_step": cfg.tokens_per_step(2), "profile": False}
    watch.update(extra)
    launch(cfg, nproc=2, watch_kwargs=watch)
    return load_run(out)


def run_case(name: str, steps: int, tmp: Path, reps: int = 2) -> dict:
    """Runs before/after ``reps`` times, interleaved (B A B A ...), so that both see the same host load; each
    pair goes through ``fsdp-doctor compare`` (``pipeline.compare_runs`` with ``--applied CODE``), whose
    prediction check gives the predicted and measured step and peak. Figures are the medians over the pairs."""
    import statistics

    from fsdp_doctor.analyze.compare import Side, compare
    from fsdp_doctor.pipeline import compare_side

    code, fix, before, after, extra = CASES[name]
    checks, fired, applied, after_codes, changes, meas = [], [], [], set(), set(), []
    for i in range(reps):
        a: Side = compare_side(run_once(tmp / f"{name}_before{i}", steps, before, extra))
        f = next((x for x in a.report.findings if x.code == code), None)
        knobs = after(f) if callable(after) else after
        b: Side = compare_side(run_once(tmp / f"{name}_after{i}", steps, knobs, extra))
        cmp = compare(a, b, applied=[code])
        fired.append(f)
        applied.append(sorted(knobs.get("reshard_overrides", {})) if callable(after) else None)
        checks += [p for p in cmp.predictions if p.code == code]
        after_codes |= {x.code for x in b.report.findings if x.severity != "info"}
        changes |= {c.key for c in cmp.config}
        meas.append((cmp.step_p50.pct if cmp.step_p50 else None, cmp.memory_peak.b if cmp.memory_peak else None,
                     cmp.step_p50.significant if cmp.step_p50 else None))

    def med(key, i=None):
        xs = [m[i] for m in meas] if i is not None else [getattr(p, key) for p in checks]
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    def held(key, yes=True):
        xs = [getattr(p, key) for p in checks if getattr(p, key) is not None]
        return f"{sum(x == yes for x in xs)}/{len(xs)}" if xs else None

    f = next((x for x in fired if x), None)
    return {"case": name, "code": code, "fired": sum(1 for x in fired if x), "reps": reps,
            "severity": f.severity if f else None, "fix": fix, "config_changed": sorted(changes),
            "step_pred_pct": med("step_pct_predicted"), "step_meas_pct": med("", 0),
            "step_significant": f"{sum(1 for m in meas if m[2])}/{len(meas)}",
            "step_pred_ms": med("step_ms_predicted"), "step_meas_ms": med("step_ms_measured"),
            "step_held": held("step_verdict", "held"), "step_inconclusive": held("step_verdict", "inconclusive"),
            "peak_pred": med("peak_bytes_predicted"), "peak_meas": med("", 1),
            "peak_err_pct": med("peak_pct_error"), "peak_held": held("peak_held"),
            "after_codes": sorted(after_codes), "applied": applied if callable(after) else None}


def _f(x, fmt="{:.1f}"):
    return "—" if x is None else fmt.format(x)


COLUMNS = ("case", "code", "step Δ pred", "step Δ meas", "signif.", "held", "inconcl.", "peak pred MiB", "peak meas MiB", "peak err", "held")


def table_rows(rows: list[dict]) -> list[tuple[str, ...]]:
    out = []
    for r in rows:
        code = r["code"] + ("" if r["fired"] == r["reps"] else f" ({r['fired']}/{r['reps']})")
        out.append((r["case"], code, _f(r["step_pred_pct"], "{:+.0f}%"), _f(r["step_meas_pct"], "{:+.0f}%"),
                    r["step_significant"], r["step_held"] or "—",
                    r["step_inconclusive"] or "—", _f(r["peak_pred"] and r["peak_pred"] / MiB, "{:.2f}"),
                    _f(r["peak_meas"] and r["peak_meas"] / MiB, "{:.2f}"), _f(r["peak_err_pct"], "{:+.1f}%"),
                    r["peak_held"] or "—"))
    return out


def print_table(rows: list[dict], markdown: bool = False) -> None:
    body = table_rows(rows)
    if markdown:
        print("| " + " | ".join(COLUMNS) + " |")
        print("|" + "---|" * len(COLUMNS))
        for r in body:
            print("| " + " | ".join(x.replace("|", "/") for x in r) + " |")
    else:
        widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(COLUMNS)]
        print("  ".join(h.ljust(w) for h, w in zip(COLUMNS, widths)))
        print("-" * (sum(widths) + 2 * len(widths)))
        for r in body:
            print("  ".join(x.ljust(w) for x, w in zip(r, widths)))
    for r in rows:
        if r.get("applied"):
            print(f"{r['case']}: units flipped per rep: " + "; ".join(", ".join(a) or "none" for a in r["applied"]))
    print("From fsdp-doctor compare --applied CODE, per before/after pair, median over pairs: step Δ = change of the "
          "median step (predicted by A's finding / measured); signif. = pairs where compare called the measured "
          "change significant; held = pairs where the prediction held (step: inside the "
          "bootstrap interval or within 10%; peak: within 5%); inconcl. = pairs whose interval held both the predicted "
          "change and none; (k/n) = the finding fired in k of n 'before' runs")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--reps", type=int, default=2, help="interleaved before/after repetitions per case")
    p.add_argument("--only", default="", help="comma-separated case names: " + ", ".join(CASES))
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--keep", default=None, help="keep the run directories under this folder")
    p.add_argument("--markdown", action="store_true", help="print the table in Markdown (the README's)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: NCCL ranks on the GPU(s); the gloo-only cases are left out")
    ns = p.parse_args(argv)
    DEVICE["device"] = ns.device
    names = [n.strip() for n in ns.only.split(",") if n.strip()] or [
        n for n in CASES if ns.device == "cpu" or n not in CPU_ONLY]
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
    print_table(rows, markdown=ns.markdown)
    if ns.json:
        Path(ns.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
