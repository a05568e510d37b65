"""What starting the ranks costs: `fsdp_doctor.workloads.launch` of the reference workload (2 gloo ranks), its ranks
spawned (each imports torch and the package again) against forked from multiprocessing's fork server (which
imported them once, at the first launch), alternating, in one process. Also the tests' rank scripts
(tests/test_clients.py ``_launch``: tests/clients.py's Hugging Face Llama client) both ways: a process per rank
(``python tests/clients.py ...``) against forked from the same server.

    python benchmarks/launch_start.py [--rounds 5] [--steps 1]

The first forked launch of each kind starts the server and is reported apart (it pays the imports once)."""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=1, help="steps of the reference workload per launch")
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from fsdp_doctor.workloads import WorkloadConfig, launch

    L = importlib.import_module("fsdp_doctor.workloads.launch")
    import test_clients as TC

    own = L.start_method

    def timed(method: str, run) -> float:
        L.start_method = lambda device: method  # (read by both launchers at each launch)
        try:
            t = time.perf_counter()
            run()
            return time.perf_counter() - t
        finally:
            L.start_method = own

    def workload(method: str) -> float:
        return timed(method, lambda: launch(WorkloadConfig(steps=a.steps), nproc=2))

    def script(method: str, tmp: Path, k: int) -> float:
        return timed(method, lambda: TC._launch("llama", 2, tmp / f"{method}{k}"))

    L.forkserver_preload(TC.FORKSERVER_PRELOAD)  # (as the test session sets it before its first launch)
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as d:
        first = {"workload": workload("forkserver"), "llama script": script("forkserver", Path(d), -1)}
        for k in range(a.rounds):
            for kind, run in (("workload", lambda m: workload(m)), ("llama script", lambda m: script(m, Path(d), k))):
                for method in (("spawn", "forkserver") if k % 2 == 0 else ("forkserver", "spawn")):
                    times.setdefault(f"{kind} {method}", []).append(run(method))
                    print(f"round {k + 1}/{a.rounds}: {kind} {method} {times[f'{kind} {method}'][-1]:.2f} s", flush=True)
    print(f"\nmedian launch time over {a.rounds} alternating rounds ({a.steps} step(s), 2 gloo ranks):")
    for kind in ("workload", "llama script"):
        spawned, forked = (statistics.median(times[f"{kind} {m}"]) for m in ("spawn", "forkserver"))
        print(f"  {kind:13s} a process per rank {spawned:6.2f} s   forked {forked:6.2f} s   ratio {forked / spawned:.2f}"
              f"   (first forked launch, server start included: {first[kind]:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
