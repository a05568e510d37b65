"""What removes the cudaMalloc retries of memory.alloc_retries' GPU row (gpu_gpt_alloc_retries: sequence lengths that
vary per step, the caching allocator capped at 1.1 times the longest step's peak). On the H200 its fix, expandable
segments, left 4 of the 6 retries. This trains the row under caps of 1.1, 1.3 and 1.6 times that peak, each with the
allocator's defaults and with expandable segments (one launch per setting: the allocator reads it when it starts),
and prints, per run, the retries the doctor counts (the finding's evidence; 0 where it stayed quiet), the steps
they came in, and the reserved and allocated bytes of its worst step.

    python benchmarks/alloc_retries_probe.py --device cuda [--json FILE] [--caps 1.1,1.3,1.6]

On the CPU (--device cpu) it checks its own plumbing: no cap and no retries there."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
EXPANDABLE = {"code": "import os\nos.environ['PYTORCH_CUDA_ALLOC_CONF'] = 'expandable_segments:True'",
              "where": "startup", "inputs": {}, "finding": "memory.alloc_retries"}


def main() -> int:
    import scenario_matrix as M

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--caps", default="1.1,1.3,1.6")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--out", type=Path, help="where the runs go (default: a temporary folder)")
    a = ap.parse_args()
    row = M.BY_NAME["gpu_gpt_alloc_retries"]
    out = a.out or Path(tempfile.mkdtemp(prefix="alloc_retries_probe_"))
    out.mkdir(parents=True, exist_ok=True)
    caps = [float(c) for c in a.caps.split(",")]
    results = []
    for setting, fix in (("default", None), ("expandable_segments", EXPANDABLE)):
        rows = [dataclasses.replace(row, name=f"cap{c:g}_{setting}", alloc_limit=c) for c in caps]
        t0 = time.monotonic()
        got = M.launch([r.spec(out / f"{r.name}_probe", fix, None, a.device) for r in rows], out, setting,
                       a.device)
        print(f"{setting}: {len(rows)} runs in {time.monotonic() - t0:.0f} s", flush=True)
        for c, r in zip(caps, rows):
            res = got.get(r.name, {"error": "not run"})
            if "error" in res:
                results.append({"cap": c, "setting": setting, "error": res["error"]})
                continue
            report = M.diagnosis(out / f"{r.name}_probe")[1]
            f = next((x for x in report.findings if x.code == row.code), None)
            ev = f.evidence if f is not None else {}
            results.append({"cap": c, "setting": setting, "alloc_conf": res.get("alloc_conf"),
                            "retries": ev.get("retries", 0), "retry_steps": ev.get("retry_steps", []),
                            "severity": f.severity if f is not None else None,
                            "reserved_bytes": ev.get("reserved_bytes"), "allocated_bytes": ev.get("allocated_bytes"),
                            "allocator_limit_bytes": ev.get("allocator_limit_bytes"),
                            "peak_bytes": report.memory.peak_bytes, "step_p50_ms": M._step_ms(report)})
    print(f"{'cap':>4} {'allocator':20} {'retries':>7}  steps        peak MiB  limit MiB  step ms")
    for r in results:
        if "error" in r:
            print(f"{r['cap']:>4g} {r['setting']:20} error: {r['error']}")
            continue
        lim = r["allocator_limit_bytes"]
        print(f"{r['cap']:>4g} {r['setting']:20} {r['retries']:>7}  {str(r['retry_steps']):12} "
              f"{(r['peak_bytes'] or 0) / 2**20:8.1f}  {'-' if lim is None else f'{lim / 2**20:9.1f}'}  "
              f"{r['step_p50_ms'] or 0:7.1f}")
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
