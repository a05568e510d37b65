"""torch.distributed.checkpoint's saves, seen without the user marking them: DCP logs the start and the end of each
``save`` and ``async_save`` call (a dict message to a logger of its own, whose only handler is a NullHandler). A
handler of the doctor's on that logger, for the training thread's calls only (``async_save`` writes in the
background, whose inner ``save`` logs from another thread), tells the tracker when each save began and ended, as
``with doctor.checkpointing():`` around it would: the step's ``checkpoint_ms``, not time outside the model. The
handler is removed when the doctor steps aside; DCP's messages and its other handlers are left as they are."""

from __future__ import annotations

import logging
import time
from typing import Callable

from . import fsdp2 as F2
from .log_tap import LoggerTap

_now = time.perf_counter_ns

#: DCP's calls that save a checkpoint, and whether each is asynchronous (its time in the step: the staging of the
#: state to host memory; the write goes on in the background)
SAVE_CALLS = {"save": False, "async_save": True}


class DcpSaveTap(LoggerTap):
    """Calls ``on_save(t0_ns, is_async)`` (``t0_ns``: the save's start, a ``time.perf_counter_ns`` reading) when a DCP
    save called from the thread that built the tap has just ended, by return or exception; ``fail(where, exc)`` on an
    error of its own."""

    def __init__(self, on_save: Callable[[int, bool], None], fail: Callable[[str, BaseException], None]):
        super().__init__(logging.DEBUG, F2.dcp_logger)
        self._on_save, self._fail = on_save, fail
        self._open: dict[str, tuple[int, bool]] = {}  # the call's uuid -> (start, asynchronous)

    def uninstall(self) -> None:
        super().uninstall()
        self._open.clear()

    def handle(self, record: logging.LogRecord) -> bool:  # (one thread's calls are counted)
        try:
            msg = record.msg
            if not isinstance(msg, dict) or not self.ours(record):
                return False
            is_async = SAVE_CALLS.get(msg.get("func_name"))
            if is_async is None:
                return False
            key, event = str(msg.get("uuid")), msg.get("event")
            if event == "start":
                self._open[key] = (_now(), is_async)
            elif event in ("end", "exception") and key in self._open:
                self._on_save(*self._open.pop(key))
        except Exception as e:  # noqa: BLE001  (never into the user's save)
            self._fail("checkpoint save tap", e)
        return False
