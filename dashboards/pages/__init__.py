"""The dashboard's pages: each module has ``layout(snapshot, filters)`` (and ``register(app)`` for its own
callbacks, where it has any)."""

from . import communication, memory, overview, steps, units

PAGES = {
    "overview": ("Overview", overview),
    "memory": ("Memory", memory),
    "communication": ("Communication", communication),
    "steps": ("Steps", steps),
    "units": ("Units", units),
}

__all__ = ["PAGES"]
