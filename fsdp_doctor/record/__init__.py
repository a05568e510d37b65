"""Record: the live side (Tracker hooks, profiler windows, unit snapshots)."""

from .profiling import ProfileSchedule
from .tracker import Doctor, WatchError, watch

__all__ = ["Doctor", "ProfileSchedule", "WatchError", "watch"]
