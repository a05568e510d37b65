"""Where the Doctor's records go, and its one failure policy. Collaborators of
:class:`fsdp_doctor.record.tracker.Doctor`.

:class:`Sinks` fans each record out: the rank's record stream (``RecordWriter``) and, with
``watch(tensorboard=True)``, the live TensorBoard writer (which queues and writes on its own thread).
:class:`FailurePolicy` is the rule for every exception inside the doctor: report it once (a log line and an
``error`` record) and, unless the failure is local to an optional part, step aside for the rest of the run.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from ..records import DoctorError, ProfileWindow, StepRecord
from ..store.writer import RecordWriter

log = logging.getLogger("fsdp_doctor")


class Sinks:
    def __init__(self, out_dir: Path, rank: int):
        self.out_dir = out_dir
        self.writer = RecordWriter(out_dir, rank)
        self.tb = None  # fsdp_doctor.record.tensorboard.TensorBoardWriter

    def open_tensorboard(self, rank: int) -> None:
        from .tensorboard import TensorBoardWriter

        self.tb = TensorBoardWriter(self.out_dir, rank)

    def write(self, *recs) -> None:
        self.writer.write(*recs)

    def safe_write(self, rec) -> None:
        """Writes a record; a failure to write is one log line (never raised: used on the failure path)."""
        try:
            self.writer.write(rec)
        except Exception as e:  # noqa: BLE001
            log.warning("fsdp_doctor: could not write a record (%s)", e)

    def on_step(self, rec: StepRecord) -> None:
        if not self.writer.path.exists():  # one stat a step: writing on into an unlinked file would lose it all
            raise FileNotFoundError(f"the record stream {self.writer.path} was deleted")
        self.writer.write(rec)
        if self.tb is not None:
            self.tb.on_step(rec)  # queues the record; the scalars are written on the writer's thread

    def on_profile(self, window: ProfileWindow) -> None:
        self.safe_write(window)
        if self.tb is not None and not window.lost:  # (a lost window has no trace)
            self.tb.on_profile(window, self.out_dir / window.path)  # overlap analysed on the writer's thread

    def close_tensorboard(self) -> None:
        tb, self.tb = self.tb, None
        if tb is not None:
            tb.close()

    def close(self) -> None:
        self.writer.close()


class FailurePolicy:
    """``fail(where, exc, stop)``: the first failure is logged and written as a ``DoctorError``; with ``stop``
    the doctor steps aside (``step_aside()``) and later failures stay silent. ``write`` never raises."""

    def __init__(self, step_aside: Callable[[], None], write: Callable[[object], None]):
        self._step_aside = step_aside
        self._write = write
        self.failed = False

    def fail(self, where: str, exc: BaseException, *, rank, step: int, stop: bool = True) -> None:
        if self.failed:
            return
        if stop:
            self.failed = True
            self._step_aside()
        msg = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        if stop:
            log.warning("fsdp_doctor: error in %s on rank %s (%s); the doctor stops recording and removes its hooks, "
                        "training continues", where, rank, msg)
        else:
            log.warning("fsdp_doctor: error in %s on rank %s (%s); that part is off, the rest keeps recording",
                        where, rank, msg)
        self._write(DoctorError(rank=rank if isinstance(rank, int) else 0, where=where, message=msg, step=step))
