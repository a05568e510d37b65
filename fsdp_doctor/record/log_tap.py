"""A handler of the doctor's on one of torch's loggers while it watches (torch.distributed.checkpoint's saves,
Dynamo's recompile limit): added at entry, removed when the doctor steps aside; the logger's messages and its other
handlers are left as they are."""

from __future__ import annotations

import logging
import threading
from typing import Callable, Optional


class LoggerTap(logging.Handler):
    """Subclasses do their work in ``handle`` (no handler lock: the records of the thread that built the tap, the
    training thread's, are taken: :meth:`ours`), return False, and emit nothing."""

    def __init__(self, level: int, logger: Callable[[], logging.Logger]):
        super().__init__(level)
        self._get = logger
        self._thread = threading.get_ident()
        self._logger: Optional[logging.Logger] = None

    def install(self) -> None:
        self._logger = self._get()
        self._logger.addHandler(self)

    def uninstall(self) -> None:
        if self._logger is not None:
            self._logger.removeHandler(self)
        self._logger = None

    def ours(self, record: logging.LogRecord) -> bool:
        """The record was logged from the thread that built the tap."""
        return record.thread is None or record.thread == self._thread

    def emit(self, record: logging.LogRecord) -> None:  # (handle() does the work)
        pass
