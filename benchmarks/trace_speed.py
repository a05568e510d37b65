"""Trace engine speed and memory against Holistic Trace Analysis (HTA 0.5.0).

Builds a multi-rank set of GPU-shaped FSDP2 Kineto traces (NCCL all-gather / reduce-scatter kernels on
their own stream, compute kernels with cudaLaunchKernel correlation, FSDP record_function labels,
realistic args and flow events), then runs, each in its own fresh subprocess so that peak memory is
measured separately:

  * HTA:  TraceAnalysis(trace_dir=...).get_comm_comp_overlap(visualize=False)
  * ours: fsdp_doctor.trace.analyze_traces(trace_dir)   (checked not to import torch)

and prints load+analysis wall and CPU seconds for each (imports excluded, reported apart; CPU summed over
worker processes), the speed ratios, the peak RSS of each process tree (psutil, sampled every 20 ms; summed
over worker processes) and the per-rank overlap percentages of both. The contenders run in rounds (ours
``--repeat`` times, HTA in the first ``--hta-repeat`` rounds; medians reported) so that on a shared machine
they see the same load: compare ratios rather than seconds.

    python benchmarks/trace_speed.py                 # --size default: 8 ranks x ~22 MB (~180 MB of JSON)
    python benchmarks/trace_speed.py --size small    # 4 ranks x ~12 MB
    python benchmarks/trace_speed.py --ranks 4 --mb-per-rank 30
    python benchmarks/trace_speed.py --baseline /path/to/old/checkout   # also time another fsdp_doctor tree
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# ranks, MB (uncompressed) per rank; "default" is the measurement: 181 MB of Kineto JSON over 8 ranks
SIZES = {"small": (4, 12), "default": (8, 24), "medium": (8, 40), "large": (8, 100)}

KERNEL = ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
          "at::detail::Array<char*, 3> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, "
          "at::detail::Array<char*, 3>)")
GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off"
OPS = ["aten::linear", "aten::addmm", "aten::gelu", "aten::add", "aten::layer_norm", "aten::mul"]


# ---------------------------------------------------------------------------- synthesis
class _Gen:
    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.ev: list = []
        self.ext = 0
        self.corr = 1_800_000  # real correlation ids are large counters (HTA+pandas 3 also need > int16)
        self.pid, self.main, self.bwd = 1000 + rank, 1000 + rank, 1100 + rank

    def x(self, name, ts, dur, cat, tid, pid=None, args=None):
        self.ev.append({"ph": "X", "cat": cat, "name": name, "pid": self.pid if pid is None else pid, "tid": tid,
                        "ts": round(ts, 3), "dur": round(dur, 3), "args": args or {}})

    def op(self, name, ts, dur, tid, dims=None):
        self.ext += 1
        self.x(name, ts, dur, "cpu_op", tid, args={
            "External id": self.ext, "Record function id": 0, "Ev Idx": len(self.ev),
            "Input Dims": dims or [[4096, 4096], [4096], []], "Input type": ["c10::BFloat16", "c10::BFloat16", ""],
            "Input Strides": [[4096, 1], [1], []], "Concrete Inputs": ["", "", "1"]})

    def label(self, name, ts, dur, tid):
        self.ext += 1
        self.x(name, ts, dur, "user_annotation", tid, args={"External id": self.ext, "Record function id": 0,
                                                              "Ev Idx": len(self.ev)})

    def launch(self, ts, tid, kname, kts, kdur, stream, extra=None):
        self.corr += 1
        c = self.corr
        self.x("cudaLaunchKernel", ts, 4.0, "cuda_runtime", tid,
               args={"External id": self.ext, "cbid": 211, "correlation": c})
        self.ev.append({"ph": "s", "id": c, "pid": self.pid, "tid": tid, "ts": round(ts, 3), "cat": "ac2g",
                        "name": "ac2g"})
        args = {"External id": self.ext, "queued": 0, "device": self.rank % 8, "context": 1, "stream": stream,
                "correlation": c, "registers per thread": 128, "shared memory": 49152, "blocks per SM": 1.2,
                "warps per SM": 4.8, "grid": [132, 1, 1], "block": [128, 1, 1], "est. achieved occupancy %": 6}
        if extra:
            args.update(extra)
        self.x(kname, kts, kdur, "kernel", stream, pid=self.rank % 8, args=args)
        self.ev.append({"ph": "f", "id": c, "pid": self.rank % 8, "tid": stream, "ts": round(kts, 3),
                        "cat": "ac2g", "name": "ac2g", "bp": "e"})

    def collective(self, coll, unit, c, tid, n_free, nelems, dur):
        self.op("record_param_comms", c, 12, tid)
        shard = nelems // self.world
        i, o = (shard, nelems) if coll == "AllGather" else (nelems, shard)
        extra = {"In msg nelems": i, "Out msg nelems": o, "Group size": self.world, "dtype": "BFloat16",
                 "Collective name": "_allgather_base" if coll == "AllGather" else "_reduce_scatter_base",
                 "Process Group Name": "0"}
        kts = max(n_free, c + 8)
        self.launch(c + 4, tid, f"ncclDevKernel_{coll}_RING_LL(ncclDevKernelArgsStorage<4096ul>)", kts, dur, 20,
                    extra)
        return kts + dur


def synth_rank(rank: int, world: int, target_mb: float, units: int = 24, ops_per_unit: int = 12) -> dict:
    g = _Gen(rank, world)
    c = 0.0  # host cursor
    gc = 0.0  # compute stream free at
    nc = 0.0  # nccl stream free at
    bytes_per_step_est = units * (2 * ops_per_unit * 4 + 30) * 330
    steps = max(3, int(target_mb * 1e6 / bytes_per_step_est) + 1)
    extra_ops = rank % 3  # ranks differ in event counts
    for step in range(steps):
        s0 = c
        g.label(f"ProfilerStep#{100 + step}", c, 0, g.main)  # dur patched below
        step_idx = len(g.ev) - 1
        g.label("FSDP::root_pre_forward", c + 1, 5, g.main)
        c += 10
        ag_end = {}
        for u in range(units):  # forward
            fqn = f"layers.{u}"
            g.label(f"FSDP::pre_forward ({fqn})", c, 30, g.main)
            g.label(f"FSDP::all_gather ({fqn})", c + 1, 20, g.main)
            ag_end[u] = nc = g.collective("AllGather", fqn, c + 2, g.main, nc, 50_000_000 + rank, 180.0 + (u % 5))
            g.label(f"FSDP::all_gather_copy_out ({fqn})", c + 22, 6, g.main)
            c += 32
            for k in range(ops_per_unit + extra_ops):
                g.op(OPS[k % len(OPS)], c, 9, g.main)
                kts = max(gc, c + 12, ag_end[u] if k == 0 else 0)
                kd = 35.0 if k % 3 else 60.0
                g.launch(c + 3, g.main, GEMM if k % 2 else KERNEL, kts, kd, 7)
                gc = kts + kd
                c += 11
            g.label(f"FSDP::post_forward ({fqn})", c, 4, g.main)
            c += 5
        for u in reversed(range(units)):  # backward, autograd thread
            fqn = f"layers.{u}"
            g.label(f"FSDP::pre_backward ({fqn})", c, 30, g.bwd)
            g.label(f"FSDP::all_gather ({fqn})", c + 1, 20, g.bwd)
            end = nc = g.collective("AllGather", fqn, c + 2, g.bwd, nc, 50_000_000, 185.0)
            g.label(f"FSDP::all_gather_copy_out ({fqn})", c + 22, 6, g.bwd)
            c += 32
            for k in range(ops_per_unit):
                g.op(OPS[k % len(OPS)] + "_backward", c, 9, g.bwd)
                kts = max(gc, c + 12, end if k == 0 else 0)
                g.launch(c + 3, g.bwd, GEMM, kts, 70.0, 7)
                gc = kts + 70.0
                c += 11
            g.label(f"FSDP::post_backward_reduce ({fqn})", c, 25, g.bwd)
            nc = g.collective("ReduceScatter", fqn, c + 2, g.bwd, max(nc, gc), 50_000_000, 200.0)
            c += 26
        c = max(c, gc, nc) + 50
        g.ev[step_idx]["dur"] = round(c - s0, 3)
    doc = {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3"}],
           "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": world},
           "traceEvents": g.ev, "displayTimeUnit": "ms", "baseTimeNanoseconds": 1_700_000_000_000_000_000}
    base = 4_455_000_000_000.0 + rank * 3.7
    for e in g.ev:
        e["ts"] = round(e["ts"] + base, 3)
    return doc


def build_set(out: Path, ranks: int, mb: float) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for r in range(ranks):
        p = out / f"rank{r}.100.pt.trace.json.gz"
        if not p.exists():
            data = json.dumps(synth_rank(r, ranks, mb)).encode()
            tmp = p.with_suffix(".tmp")
            tmp.write_bytes(gzip.compress(data, compresslevel=3))
            tmp.rename(p)
            print(f"  built {p.name}: {len(data) / 1e6:.1f} MB JSON, {p.stat().st_size / 1e6:.1f} MB gz", flush=True)
        paths.append(p)
    return paths


def write_large(path: Path, target_mb: float) -> Path:
    """One rank's trace of about ``target_mb`` MB of JSON, written step by step (never whole in memory): the
    steps of ``synth_rank`` repeated, shifted in time, with fresh correlation ids. Plain JSON (no gzip)."""
    if path.exists():
        return path
    step = synth_rank(0, 2, 4)  # a few steps, ~4 MB
    ev = step["traceEvents"]
    t0 = min(e["ts"] for e in ev)
    span = max(e["ts"] + e.get("dur", 0) for e in ev) - t0 + 100.0
    corr = [e.get("args", {}).get("correlation") if "args" in e else None for e in ev]
    ids = [e.get("id") for e in ev]
    step_n = [e["name"] for e in ev]
    head = {k: v for k, v in step.items() if k != "traceEvents"}
    tmp = path.with_suffix(".tmp")
    written = 0
    with open(tmp, "w") as f:
        f.write('{"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 2}, '
                '"traceEvents": [\n')
        rep = 0
        while written < target_mb * 1e6:
            shift, cshift = rep * span, rep * 10_000_000
            for e, c, i, n in zip(ev, corr, ids, step_n):
                e["ts"] = round(e["ts"] + (shift - (rep - 1) * span if rep else 0), 3)
                if c is not None:
                    e["args"]["correlation"] = c + cshift
                if i is not None:
                    e["id"] = i + cshift
                if n.startswith("ProfilerStep#"):
                    e["name"] = f"ProfilerStep#{100 + rep * 1000 + int(n.split('#')[1])}"
            chunk = (",\n" if rep else "") + ",\n".join(json.dumps(e) for e in ev)
            f.write(chunk)
            written += len(chunk)
            rep += 1
        f.write('\n], "displayTimeUnit": "ms", "baseTimeNanoseconds": %d}' % head["baseTimeNanoseconds"])
    tmp.rename(path)
    print(f"  built {path.name}: {path.stat().st_size / 1e6:.0f} MB JSON", flush=True)
    return path


CHILD_RSS = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[2])
from fsdp_doctor.trace import analyze_traces
t1 = time.perf_counter()
r = analyze_traces(sys.argv[1], workers=1)
print(json.dumps({"run_s": time.perf_counter() - t1, "skipped": [s.error for s in r.skipped],
                  "steps": len(r.per_rank["0"].steps) if "0" in r.per_rank else 0,
                  "overlap": {k: v.overlap_pct for k, v in r.per_rank.items()}}))
"""


def memory_bound(out: Path, sizes_mb: list[float], trees: list[tuple[str, Path]]) -> None:
    """Peak RSS of analysing one large trace per size, each tree in a fresh process."""
    print(f"peak RSS of analyze_traces on one large plain-JSON trace (goal: under 500 MB whatever the size)")
    for mb in sizes_mb:
        f = write_large(out / f"large_{mb:g}MB.json", mb)
        for label, tree in trees:
            r = run_child(CHILD_RSS, [str(f), str(tree)])
            print(f"  {f.stat().st_size / 1e6:6.0f} MB  {label:18} peak RSS {r['peak_rss_mb']:6.0f} MB  "
                  f"{r['run_s']:6.1f} s  ({f.stat().st_size / 1e6 / r['run_s']:.0f} MB/s)  steps {r['steps']}  "
                  f"skipped {r['skipped'] or 'none'}", flush=True)


# ---------------------------------------------------------------------------- the two contenders
CHILD_HTA = r"""
import json, sys, time, logging
import os
logging.disable(logging.WARNING)
t0 = time.perf_counter()
from hta.trace_analysis import TraceAnalysis
t1 = time.perf_counter()
c1 = os.times()
a = TraceAnalysis(trace_dir=sys.argv[1])
df = a.get_comm_comp_overlap(visualize=False)
t2 = time.perf_counter()
c2 = os.times()
print(json.dumps({"import_s": t1 - t0, "run_s": t2 - t1, "cpu_s": sum(c2[:4]) - sum(c1[:4]),
                  "overlap": {str(int(r)): float(p) for r, p in zip(df["rank"], df["comp_comm_overlap_pctg"])}}))
"""

CHILD_OURS = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[2])  # the fsdp_doctor source tree to time (this checkout, or --baseline)
t0 = time.perf_counter()
from fsdp_doctor.trace import analyze_traces
t1 = time.perf_counter()
c1 = os.times()
r = analyze_traces(sys.argv[1])
t2 = time.perf_counter()
c2 = os.times()
import msgspec
r = msgspec.to_builtins(r)  # a dict in a --baseline tree from before the typed report: the same
print(json.dumps({"import_s": t1 - t0, "run_s": t2 - t1, "cpu_s": sum(c2[:4]) - sum(c1[:4]), "skipped": r["skipped"],
                  "torch_imported": "torch" in sys.modules,
                  "overlap": {k: v["overlap_pct"] for k, v in r["per_rank"].items()}}))
"""


def run_child(code: str, args: list[str]) -> dict:
    import psutil

    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    peak = 0
    ps = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            tree = [ps] + ps.children(recursive=True)
            rss = 0
            for p in tree:
                try:
                    rss += p.memory_info().rss
                except psutil.Error:
                    pass
            peak = max(peak, rss)
        except psutil.Error:
            pass
        time.sleep(0.02)
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"child failed ({proc.returncode}):\n{err[-3000:]}")
    res = json.loads(out.strip().splitlines()[-1])
    res["peak_rss_mb"] = peak / 2**20
    return res


def _summary(runs: list[dict]) -> dict:
    """The run with the median time; its CPU time the median of the runs'; the largest peak RSS of all."""
    runs = sorted(runs, key=lambda r: r["run_s"])
    res = dict(runs[len(runs) // 2])
    res["all_s"] = [r["run_s"] for r in runs]
    res["cpu_s"] = statistics.median(r["cpu_s"] for r in runs)
    res["peak_rss_mb"] = max(r["peak_rss_mb"] for r in runs)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=list(SIZES), default="default")
    ap.add_argument("--ranks", type=int, help="override the number of ranks")
    ap.add_argument("--mb-per-rank", type=float, help="override the uncompressed MB per rank")
    ap.add_argument("--dir", type=Path, help="where to keep the generated traces (reused if present)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds; HTA runs in the first --hta-repeat of them")
    ap.add_argument("--hta-repeat", type=int, default=1, help="runs of HTA (median reported)")
    ap.add_argument("--baseline", type=Path, action="append", default=[],
                    help="another fsdp_doctor source tree (a checkout's root) to time the same way; repeatable")
    ap.add_argument("--skip-hta", action="store_true")
    ap.add_argument("--rss", type=float, nargs="*", metavar="MB",
                    help="instead: peak RSS on one large trace of each size (e.g. --rss 300 3000); the traces are "
                    "written under --dir (default: the temp folder) and reused")
    a = ap.parse_args(argv)
    if a.rss is not None:
        out = a.dir or Path(tempfile.gettempdir()) / "fsdp_doctor_trace_rss"
        out.mkdir(parents=True, exist_ok=True)
        memory_bound(out, a.rss or [300, 3000],
                     [("this tree", REPO)] + [(f"baseline {b.name}", b.resolve()) for b in a.baseline])
        return 0
    ranks, mb = SIZES[a.size]
    ranks = a.ranks or ranks
    mb = a.mb_per_rank or mb
    out = a.dir or Path(tempfile.gettempdir()) / f"fsdp_doctor_trace_speed_{ranks}x{mb:g}MB"
    print(f"[1/2] trace set: {ranks} ranks x ~{mb:g} MB (JSON) in {out}", flush=True)
    paths = build_set(out, ranks, mb)
    total = sum(p.stat().st_size for p in paths)
    print(f"      {len(paths)} files, {total / 1e6:.1f} MB gz on disk", flush=True)

    # Rounds, each running every contender once, so that all of them see the same (shared) machine load
    contenders = [("fsdp_doctor.trace", CHILD_OURS, [str(out), str(REPO)])]
    contenders += [(f"baseline {b.name or b}", CHILD_OURS, [str(out), str(b.resolve())]) for b in a.baseline]
    hta_runs = 0 if a.skip_hta else max(1, a.hta_repeat)
    rounds = max(a.repeat, hta_runs)
    runs: dict = {label: [] for label, _, _ in contenders}
    if hta_runs:
        runs["HTA 0.5.0"] = []
    print(f"[2/2] {rounds} rounds of: {', '.join(runs)}", flush=True)
    for k in range(rounds):
        todo = [c for c in contenders if k < a.repeat]
        if k < hta_runs:
            todo.append(("HTA 0.5.0", CHILD_HTA, [str(out)]))
        for label, code, args in todo:
            r = run_child(code, args)
            runs[label].append(r)
            print(f"      round {k + 1}: {label:22} {r['run_s']:6.2f} s wall, {r['cpu_s']:6.2f} s CPU, "
                  f"peak RSS {r['peak_rss_mb']:4.0f} MB", flush=True)
    res = {label: _summary(rs) for label, rs in runs.items()}
    ours = res["fsdp_doctor.trace"]
    if ours["torch_imported"]:
        print("WARNING: fsdp_doctor.trace imported torch")
    if ours["skipped"]:
        print(f"WARNING: files skipped: {ours['skipped']}")
    if not hta_runs:  # (--skip-hta: the trees side by side)
        print("load+analysis: medians over the runs (imports excluded); CPU includes worker processes")
        for label, r in res.items():
            print(f"  {label[:30]:30}{r['run_s']:>7.2f} s wall{r['cpu_s']:>7.2f} s CPU{r['peak_rss_mb']:>7.0f} MB")
        return 0
    hta = res["HTA 0.5.0"]

    print()
    print("load+analysis: medians over the runs (imports excluded); CPU includes worker processes")
    print(f"{'':22}{'wall':>9}{'CPU':>9}{'import':>9}{'peak RSS':>10}{'HTA/this wall':>15}{'CPU':>6}")
    for label in ["HTA 0.5.0"] + [c[0] for c in contenders]:
        r = res[label]
        print(f"{label[:21]:22}{r['run_s']:>7.2f} s{r['cpu_s']:>7.2f} s{r['import_s']:>7.2f} s"
              f"{r['peak_rss_mb']:>7.0f} MB{hta['run_s'] / r['run_s']:>14.1f}x{hta['cpu_s'] / r['cpu_s']:>5.1f}x")
    print(f"speed-up: {hta['run_s'] / ours['run_s']:.1f}x wall, {hta['cpu_s'] / ours['cpu_s']:.1f}x CPU (goal >= 20x); "
          f"peak memory {hta['peak_rss_mb'] / ours['peak_rss_mb']:.1f}x less than HTA (goal: no more)")
    print(f"torch imported by fsdp_doctor.trace: {ours['torch_imported']}")
    print("per-rank overlap % (HTA vs fsdp_doctor.trace):")
    worst = 0.0
    for k in sorted(hta["overlap"], key=int):
        h, o = hta["overlap"][k], ours["overlap"].get(k)
        worst = max(worst, abs(h - o) if o is not None else float("inf"))
        print(f"  rank {k}: {h:.2f} vs {'-' if o is None else f'{o:.2f}'}")
    print(f"largest per-rank overlap difference vs HTA: {worst:.3f} percentage points")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
