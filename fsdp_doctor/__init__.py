"""fsdp_doctor: profiling and diagnostics for PyTorch FSDP2 (``fully_shard``) training.

    with fsdp_doctor.watch(model, optimizer, out_dir="traces/run1") as doctor:
        for batch in loader:
            ...
            doctor.step()

Data flows one way: record (fsdp_doctor.record) -> store (fsdp_doctor.store) -> analyze
(fsdp_doctor.analyze, fsdp_doctor.trace) -> diagnose (fsdp_doctor.diagnose) -> present (fsdp_doctor.present).
"""

__version__ = "0.1.0"

from .record import Doctor, ProfileSchedule, WatchError, watch  # noqa: E402
from .store import Run, load_run  # noqa: E402

__all__ = ["Doctor", "ProfileSchedule", "Run", "WatchError", "__version__", "load_run", "watch"]
