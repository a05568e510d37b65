"""The dashboard's pages: each module has ``layout(snapshot, filters)`` (and ``register(app)`` for its own
callbacks, where it has any)."""

from . import communication, compare, memory, overview, steps, units

PAGES = {
    "overview": ("Overview", overview),
    "memory": ("Memory", memory),
    "communication": ("Communication", communication),
    "steps": ("Steps", steps),
    "units": ("Units", units),
    "compare": ("Compare", compare),
}



def page_key(path: str) -> str:
    """The page a URL path names (``/memory`` -> ``memory``); the overview for ``/`` or an unknown path."""
    key = (path or "").strip("/").split("/")[0]
    return key if key in PAGES else "overview"


__all__ = ["PAGES", "page_key"]
