"""TensorBoard scalars for a run: live from the Doctor, or post-hoc from a recorded run.

``tensorboard --logdir RUN_DIR`` then shows

* run ``profiler`` (PyTorch Profiler tab, torch-tb-profiler): the Kineto windows the Doctor already writes in the
  plugin's layout, ``RUN_DIR/profiler/rank{R}.{step}.pt.trace.json.gz`` (workers ``rank0``, ``rank1``, …; span = the
  window's first step);
* runs ``tb/rank{R}`` (Scalars tab), one per rank, x axis = training step:

  ==============================  =====================================================================
  ``step/wall_ms``                step wall time; ``step/forward_ms``, ``step/backward_ms``,
                                  ``step/optimizer_ms``, ``step/outside_ms``, ``step/gc_ms``: its split
  ``step/profiled``               1 on steps inside a profiler window (their times include the tool's cost)
  ``memory/peak_mib``             the step's memory peak (``StepRecord.memory``), and at that peak
                                  ``memory/<category>_mib`` for each category (sharded_params, activations, …);
                                  ``memory/offloaded_host_mib``; on CUDA ``memory/cuda_<field>_mib``
  ``overlap/overlap_pct``         share of communication overlapped by compute in the profiled step
  ``overlap/exposed_comm_ms``     communication not hidden by compute, per profiled step
  ``overlap/comm_ms``             all communication, per profiled step
  ==============================  =====================================================================

Cost per step: ``on_step`` only queues the record (~1-2 µs); a writer thread turns it into one event holding
all the step's scalars (a Summary proto built directly, ~1 µs a value) and ``SummaryWriter`` writes the event
file on its own thread. The overlap of a saved window is computed on a background thread
(``fsdp_doctor.trace.analyze_traces`` over that one file), never in the training loop.
"""

from __future__ import annotations

import logging
import collections
import threading
from pathlib import Path
from typing import Any, Iterable, Optional

from ..records import ProfileWindow, StepRecord

log = logging.getLogger("fsdp_doctor")

TB_DIR = "tb"
MIB = float(1 << 20)
STEP_FIELDS = ("wall_ms", "forward_ms", "backward_ms", "optimizer_ms", "outside_ms", "gc_ms")


def tb_dir(out_dir: Path | str, rank: int) -> Path:
    return Path(out_dir) / TB_DIR / f"rank{rank}"


def step_scalars(rec: StepRecord) -> dict[str, float]:
    """The scalars written for one step record (tag -> value)."""
    out = {f"step/{f}": float(getattr(rec, f)) for f in STEP_FIELDS}
    out["step/profiled"] = 1.0 if rec.profiled else 0.0
    out.update(memory_scalars(rec.memory))
    return out


def memory_scalars(mem: Optional[dict]) -> dict[str, float]:
    """Memory by category at the step's peak, in MiB, from ``StepRecord.memory`` (see fsdp_doctor.record.memory)."""
    if not isinstance(mem, dict):
        return {}
    out: dict[str, float] = {}
    peak = mem.get("peak")
    if isinstance(peak, dict):
        if _num(peak.get("bytes")):
            out["memory/peak_mib"] = peak["bytes"] / MIB
        for cat, v in (peak.get("breakdown") or {}).items():
            if _num(v):
                out[f"memory/{cat}_mib"] = v / MIB
    if _num(mem.get("offloaded_host")):
        out["memory/offloaded_host_mib"] = mem["offloaded_host"] / MIB
    cuda = mem.get("cuda")
    if isinstance(cuda, dict):
        for k, v in cuda.items():
            if _num(v) and ("bytes" in k or k in ("allocated", "reserved", "fragmentation", "max_allocated",
                                                  "max_reserved", "largest_free_block", "nvml_used", "non_torch")):
                out[f"memory/cuda_{k.removesuffix('_bytes')}_mib"] = v / MIB
    return out


def overlap_scalars(result: dict, rank: int) -> dict[int, dict[str, float]]:
    """Per analysed step of one trace window: overlap %, exposed and total communication (ms per step)."""
    per_rank = result.get("per_rank") or {}
    pr = per_rank.get(str(rank))
    if pr is None and len(per_rank) == 1:
        pr = next(iter(per_rank.values()))
    if pr is None or not pr.get("steps"):
        return {}
    n = len(pr["steps"])
    vals: dict[str, float] = {"overlap/exposed_comm_ms": pr["exposed_us"] / 1e3 / n,
                              "overlap/comm_ms": pr["comm_us"] / 1e3 / n}
    if pr.get("overlap_pct") is not None:
        vals["overlap/overlap_pct"] = float(pr["overlap_pct"])
    return {int(s): dict(vals) for s in pr["steps"]}


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class TensorBoardWriter:
    """Writes a rank's scalars under ``<out_dir>/tb/rank{R}``. Hooks: ``on_step(rec)`` after each step record,
    ``on_profile(window, trace_path)`` when a profiler window's trace is saved, ``close()`` at the end.

    ``background=False`` analyses traces in ``on_profile`` itself (post-hoc export)."""

    def __init__(self, out_dir: Path | str, rank: int, *, background: bool = True, flush_secs: int = 10):
        from torch.utils.tensorboard import SummaryWriter

        self.rank = rank
        self.dir = tb_dir(out_dir, rank)
        self.writer = SummaryWriter(log_dir=str(self.dir), max_queue=1000, flush_secs=flush_secs)
        self._background = background
        self._jobs: "collections.deque[tuple]" = collections.deque()  # append/popleft are atomic: no lock, no wake-up
        self._worker: Optional[threading.Thread] = None
        self._walltime: dict[int, float] = {}  # step -> wall-clock end (s), to place overlap points in time
        self._closed = False
        self._stop = threading.Event()
        self.poll_s = 1.0

    # ------------------------------------------------------------------ hooks
    def on_step(self, rec: StepRecord) -> None:
        """Queues the step's scalars (about a microsecond); the writer's thread turns them into events."""
        if self._closed:
            return
        if self._background:
            self._submit(("step", rec))
        else:
            self._write_step(rec)

    def on_profile(self, window: Optional[ProfileWindow], trace_path: Path | str) -> None:
        """Queues the overlap analysis of one saved trace window (run on the writer's thread)."""
        if self._closed:
            return
        if self._background:
            self._submit(("profile", window, Path(trace_path)))
        else:
            self._analyze(window, Path(trace_path))

    def close(self, timeout: float = 60.0) -> None:
        """Waits (up to ``timeout`` s) for queued steps and trace analyses, then flushes and closes the event file."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._worker is not None and self._worker.is_alive():
            self._worker.join(timeout)
        self._drain()  # whatever the worker had not picked up
        self.writer.close()

    # ------------------------------------------------------------------ internals
    def _submit(self, job) -> None:
        self._jobs.append(job)
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name=f"fsdp-doctor-tb-rank{self.rank}", daemon=True)
            self._worker.start()

    def _work(self) -> None:
        """Wakes up every ``poll_s`` and writes what queued up meanwhile: the training thread never signals it."""
        while not self._stop.wait(self.poll_s):
            self._drain()

    def _drain(self) -> None:
        while self._jobs:
            job = self._jobs.popleft()
            try:
                if job[0] == "step":
                    self._write_step(job[1])
                else:
                    self._analyze(job[1], job[2])
            except Exception as e:  # noqa: BLE001  (TensorBoard output must never disturb training)
                log.warning("fsdp_doctor: TensorBoard writer: %s: %s", type(e).__name__, e)

    def _write_step(self, rec: StepRecord) -> None:
        wt = (rec.start_ns + rec.wall_ms * 1e6) / 1e9 if rec.start_ns else None
        if wt is not None:
            self._walltime[rec.step] = wt
            if len(self._walltime) > 4096:
                for k in sorted(self._walltime)[:2048]:
                    del self._walltime[k]
        self._add_many(step_scalars(rec), rec.step, wt)

    def _add_many(self, values: dict[str, float], step: int, walltime: Optional[float]) -> None:
        """One event holding every scalar of the step: what ``add_scalar`` writes, one value each, built
        straight as a Summary proto (~1 µs a value instead of ~30 µs through ``add_scalar``)."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=t, simple_value=float(v)) for t, v in values.items()])
        self.writer._get_file_writer().add_summary(summary, step, walltime)

    def _analyze(self, window: Optional[ProfileWindow], path: Path) -> None:
        try:
            from ..trace import analyze_traces

            result = analyze_traces([path], workers=1)
            for step, vals in sorted(overlap_scalars(result, self.rank).items()):
                self._add_many(vals, step, self._walltime.get(step))
            for s in result.get("skipped", []):
                log.info("fsdp_doctor: TensorBoard overlap skipped %s (%s)", s.get("file"), s.get("error"))
        except Exception as e:  # noqa: BLE001  (TensorBoard output must never disturb training)
            log.warning("fsdp_doctor: TensorBoard overlap for %s failed (%s: %s)", path, type(e).__name__, e)


def export_tensorboard(run, out: Path | str | None = None, *, traces: bool = True) -> list[Path]:
    """Writes the same scalars post-hoc from a recorded :class:`~fsdp_doctor.store.Run` to ``<out>/tb/rank{R}``
    (``out`` defaults to the run directory). Returns the directories written."""
    out = Path(out) if out is not None else Path(run.path)
    written = []
    for rank, rd in sorted(run.ranks.items()):
        if not rd.steps and not rd.profiles:
            continue
        w = TensorBoardWriter(out, rank, background=False)
        try:
            for rec in rd.steps:
                w.on_step(rec)
            if traces:
                for pw in _profiles(run, rd.profiles):
                    w.on_profile(pw, Path(run.path) / pw.path)
        finally:
            w.close()
        written.append(w.dir)
    return written


def _profiles(run, profiles: Iterable[ProfileWindow]) -> list[ProfileWindow]:
    root = Path(run.path).resolve()
    out = []
    for pw in profiles:
        p = (Path(run.path) / pw.path).resolve()
        if p.is_relative_to(root) and p.exists():
            out.append(pw)
    return out
