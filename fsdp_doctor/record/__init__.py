"""Record: the live side: the Doctor (record/tracker.py) and its collaborators (hooks, memory probe, config snapshot,
sinks, profiler windows, run device; see the README's code map)."""

from .profiling import ProfileSchedule
from .tracker import Doctor, WatchError, watch

__all__ = ["Doctor", "ProfileSchedule", "WatchError", "watch"]
