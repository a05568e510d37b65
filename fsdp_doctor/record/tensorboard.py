"""TensorBoard scalars written live by the Doctor (``watch(tensorboard=True)``); the after-the-fact export is
``fsdp_doctor.present.tensorboard.export_tensorboard``. Both write the scalars ``fsdp_doctor.tensorboard_scalars``
defines.

``tensorboard --logdir RUN_DIR`` then shows

* run ``profiler`` (PyTorch Profiler tab, torch-tb-profiler): the Kineto windows the Doctor already writes in the
  plugin's layout, ``RUN_DIR/profiler/rank{R}.{step}.pt.trace.json.gz`` (workers ``rank0``, ``rank1``, …; span = the
  window's first step);
* runs ``tb/rank{R}`` (Scalars tab), one per rank, x axis = training step:

  ==============================  =====================================================================
  ``step/wall_ms``                step wall time; ``step/forward_ms``, ``step/backward_ms``,
                                  ``step/optimizer_ms``, ``step/outside_ms``, ``step/gc_ms``: its split
  ``step/profiled``               1 on steps inside a profiler window (their times include the tool's cost)
  ``step/doctor_step``            1 on the doctor's own steps (a profiler window, a memory count op by op),
                                  which the report's step statistics leave out with the first step
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
(the pipeline's trace section over that one file), never in the training loop.
"""

from __future__ import annotations

import logging
import collections
import threading
from pathlib import Path
from typing import Optional

from ..records import ProfileWindow, StepRecord

from ..store.layout import tb_dir
from ..tensorboard_scalars import add_scalars, step_scalars, step_walltime, window_overlap_scalars

log = logging.getLogger("fsdp_doctor")


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
        self._seen: set = set()  # memory tags non-zero so far: a category is written from its first non-zero value
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
        if self._worker is None:  # nothing queued in the background: what is left is written here
            self._drain()
            self.writer.close()
            return
        # the worker drains what is queued and closes the event file itself: one thread writes, never two
        self._worker.join(timeout)
        if self._worker.is_alive():
            log.warning("fsdp_doctor: TensorBoard writer: still busy after %.0f s (a trace analysis); it finishes "
                        "and closes rank %d's event file in the background", timeout, self.rank)

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
        self._drain()  # close() was called: the rest of the queue, then the file
        try:
            self.writer.close()
        except Exception as e:  # noqa: BLE001  (TensorBoard output must never disturb training)
            log.warning("fsdp_doctor: TensorBoard writer: closing: %s: %s", type(e).__name__, e)

    def _drain(self) -> None:
        while True:
            try:
                job = self._jobs.popleft()
            except IndexError:
                return
            try:
                if job[0] == "step":
                    self._write_step(job[1])
                else:
                    self._analyze(job[1], job[2])
            except Exception as e:  # noqa: BLE001  (TensorBoard output must never disturb training)
                log.warning("fsdp_doctor: TensorBoard writer: %s: %s", type(e).__name__, e)

    def _write_step(self, rec: StepRecord) -> None:
        wt = step_walltime(rec)
        if wt is not None:
            self._walltime[rec.step] = wt
            if len(self._walltime) > 4096:
                for k in sorted(self._walltime)[:2048]:
                    del self._walltime[k]
        self._add_many(step_scalars(rec, self._seen), rec.step, wt)

    def _add_many(self, values: dict[str, float], step: int, walltime: Optional[float]) -> None:
        add_scalars(self.writer._get_file_writer(), values, step, walltime)

    def _analyze(self, window: Optional[ProfileWindow], path: Path) -> None:
        try:
            steps = list(window.steps) if window is not None else []
            vals_by_step = window_overlap_scalars(self.rank, [(path, steps)])
            for step, vals in sorted(vals_by_step.items()):
                self._add_many(vals, step, self._walltime.get(step))
            if not vals_by_step:
                log.info("fsdp_doctor: TensorBoard overlap: nothing analysable in %s", path)
        except Exception as e:  # noqa: BLE001  (TensorBoard output must never disturb training)
            log.warning("fsdp_doctor: TensorBoard overlap for %s failed (%s: %s)", path, type(e).__name__, e)
