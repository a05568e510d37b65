"""Store: the run directory. ``layout`` knows where each file is; the writer appends the record streams; the
readers load or follow a run. Names resolve lazily, so that the record schema can import ``layout``."""

_LAZY = {
    "RankData": "reader", "Run": "reader", "RunFollower": "reader", "StreamReader": "reader", "load_run": "reader",
    "run_trace_files": "reader", "RunRefused": "reader",
    "RecordWriter": "writer", "RunDirTaken": "writer", "claim_run_dir": "writer", "write_manifest": "writer",
}

__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fsdp_doctor.store' has no attribute {name!r}")
