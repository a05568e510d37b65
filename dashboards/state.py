"""Server-side state of the dashboard: one run directory followed while it grows.

``RunState.refresh()`` is called by the polling callback (and when a page is served). It reads only the new
bytes of each record stream (:class:`fsdp_doctor.store.RunFollower`), rebuilds the record analyses when
something new arrived (``build_report(run, traces=False)``: milliseconds for thousands of steps) and merges
the trace analysis, which is cached per trace file: each profiler window is decoded once, on a background
thread, and only the cheap combination (``analyze_windows``) is redone. Every change bumps ``version``;
pages are re-rendered only when it changes.

Nothing here analyses anything: it calls the analyses and keeps their results.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from fsdp_doctor.analyze import build_report
from fsdp_doctor.store import RunFollower

# A trace file that fails to decode and was modified this recently may still be being written: retry it.
TRACE_SETTLE_S = 10.0


@dataclass
class Snapshot:
    """What the pages render: an immutable view taken under the lock."""

    version: int
    path: Path
    report: dict
    steps: dict[int, dict[str, list]]  # rank -> columns (see steps_columns)
    windows: list[Any]  # fsdp_doctor.trace WindowTrace, one per analysed profiler window
    has_records: bool
    traces_pending: int = 0
    updated: float = field(default_factory=time.time)
    window_fn: Optional[Callable[..., dict]] = field(default=None, repr=False, compare=False)

    def sections(self, window: Optional[tuple[int, int]], rank: Optional[int] = None) -> dict:
        """The report's ``steps``, ``units``, ``throughput`` and ``memory`` sections recomputed by the same
        analyses over the steps inside ``window`` only and, with ``rank``, that rank only (the whole report when
        both are None)."""
        if (window is None and rank is None) or self.window_fn is None:
            return {k: self.report.get(k) for k in ("steps", "units", "throughput", "memory")}
        return self.window_fn(window, rank)


STEP_COLUMNS = ("step", "wall_ms", "forward_ms", "backward_ms", "optimizer_ms", "outside_ms", "gc_ms", "profiled")


def steps_columns(run) -> dict[int, dict[str, list]]:
    """The per-step records of each rank as columns (plain lists), the input of the step figures."""
    out: dict[int, dict[str, list]] = {}
    for r, rd in sorted(run.ranks.items()):
        cols: dict[str, list] = {k: [] for k in STEP_COLUMNS}
        for s in rd.steps:
            for k in STEP_COLUMNS:
                cols[k].append(getattr(s, k))
        out[r] = cols
    return out


class RunState:
    def __init__(self, path: Path | str, *, background_traces: bool = True):
        self.path = Path(path)
        self._follower = RunFollower(self.path)
        self._lock = threading.RLock()
        self._version = 0
        self._report: dict | None = None
        self._steps: dict[int, dict[str, list]] = {}
        self._traces: dict[Path, tuple[tuple[int, int], Any]] = {}  # path -> ((mtime_ns, size), window | error str)
        self._pending: set[Path] = set()
        self._loader: Optional[threading.Thread] = None
        self._traces_dirty = False
        self._background = background_traces
        self._snapshot: Snapshot | None = None
        self._window_cache: dict = {}

    # ------------------------------------------------------------------ polling
    def refresh(self) -> bool:
        """Reads what is new; returns True when the snapshot changed."""
        with self._lock:
            run, new = self._follower.poll()
            scanned = self._scan_traces()
            if not new and not scanned and not self._traces_dirty and self._snapshot is not None:
                return False
            self._traces_dirty = False
            self._rebuild(run)
            return True

    def snapshot(self) -> Snapshot:
        with self._lock:
            if self._snapshot is None:
                self.refresh()
            return self._snapshot

    @property
    def version(self) -> int:
        return self._version

    def wait_traces(self, timeout: float = 30.0) -> None:
        """Blocks until every trace file found so far is analysed (tests, benchmarks)."""
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            with self._lock:
                if not self._pending and (self._loader is None or not self._loader.is_alive()):
                    break
            time.sleep(0.02)
        self.refresh()

    # ------------------------------------------------------------------ internals
    def _rebuild(self, run) -> None:
        run.trace_files = sorted(self._traces)
        report = build_report(run, traces=False)
        windows = [w for _, w in self._traces.values() if not isinstance(w, str)]
        skipped = [f"{p.name}: {w}" for p, (k, w) in sorted(self._traces.items()) if isinstance(w, str) and k[0] >= 0]
        if windows:
            from fsdp_doctor.diagnose import diagnose
            from fsdp_doctor.trace import analyze_windows

            ov = analyze_windows(windows)
            ov["files"] = [w.file for w in windows]
            ov["skipped"] = []
            report["overlap"] = ov
            report["findings"] = diagnose(run, report)  # rules over overlap need it in the report
        if skipped:
            report["problems"] = list(report.get("problems", [])) + skipped
        self._report = report
        self._steps = steps_columns(run)
        self._version += 1
        frozen = {r: (rd, list(rd.steps)) for r, rd in run.ranks.items()}  # the steps of this version
        self._window_cache: dict = {}
        self._snapshot = Snapshot(version=self._version, path=self.path, report=report, steps=self._steps,
                                  windows=sorted(windows, key=lambda w: (w.rank, w.steps[:1], w.file)),
                                  has_records=run.has_records, traces_pending=len(self._pending),
                                  window_fn=lambda w, r=None, _f=frozen, _v=self._version: self._window_sections(_f, _v, w, r))

    def _window_sections(self, frozen: dict, version: int, window: Optional[tuple[int, int]],
                         rank: Optional[int] = None) -> dict:
        key = (version, None if window is None else tuple(window), rank)
        hit = self._window_cache.get(key)
        if hit is not None:
            return hit
        from fsdp_doctor.analyze.report import unit_table
        from fsdp_doctor.analyze.steps import analyze_steps
        from fsdp_doctor.analyze.throughput import analyze_throughput
        from fsdp_doctor.store.reader import RankData, Run

        from fsdp_doctor.analyze.memory import analyze_memory

        lo, hi = window if window is not None else (-1, 1 << 62)
        sub = Run(path=self.path, manifest=self._follower.run.manifest)
        for r, (rd, steps) in frozen.items():
            if rank is not None and r != rank:
                continue
            sub.ranks[r] = RankData(rank=r, header=rd.header, config=rd.config, profiles=list(rd.profiles),
                                    errors=list(rd.errors), end=rd.end, steps=[s for s in steps if lo <= s.step <= hi])
        out = {"steps": analyze_steps(sub), "units": unit_table(sub)}
        tp = analyze_throughput(sub)
        if tp:
            out["throughput"] = tp
        out["memory"] = analyze_memory(sub)
        if len(self._window_cache) > 32:
            self._window_cache.clear()
        self._window_cache[key] = out
        return out

    def _trace_files(self) -> list[Path]:
        if not self.path.is_dir():
            return []
        from fsdp_doctor.trace import find_trace_files

        root = self.path.resolve()
        out = []
        for p in find_trace_files(self.path):
            try:
                if p.resolve().is_relative_to(root):  # never follow links out of the run directory
                    out.append(p)
            except OSError:
                continue
        return out

    def _scan_traces(self) -> bool:
        """Notes new or changed trace files; returns True when the set of analysed windows changed."""
        changed = False
        try:
            files = self._trace_files()
        except OSError:
            files = []
        live = set(files)
        for p in list(self._traces):
            if p not in live:
                del self._traces[p]
                changed = True
        for p in files:
            try:
                st = p.stat()
            except OSError:
                continue
            key = (st.st_mtime_ns, st.st_size)
            cached = self._traces.get(p)
            if cached is not None and cached[0] == key:
                continue
            if p in self._pending:
                continue
            self._pending.add(p)
        if self._pending:
            if self._background:
                if self._loader is None or not self._loader.is_alive():
                    self._loader = threading.Thread(target=self._load_pending, name="fsdp-doctor-traces", daemon=True)
                    self._loader.start()
            else:
                self._load_pending()
                changed = True
        return changed

    def _load_pending(self) -> None:
        from fsdp_doctor.trace.analysis import _load  # build_window, errors as values

        while True:
            with self._lock:
                if not self._pending:
                    return
                p = sorted(self._pending)[0]
            try:
                st = p.stat()
                key = (st.st_mtime_ns, st.st_size)
                res = _load(str(p))
                if not hasattr(res, "calls"):
                    res = str(res)
                    if time.time() - st.st_mtime < TRACE_SETTLE_S:
                        key = (-1, -1)  # maybe still being written: retry on a later scan
            except OSError as e:
                key, res = (-1, -1), f"cannot read ({e.strerror or e})"
            with self._lock:
                self._traces[p] = (key, res)
                self._pending.discard(p)
                self._traces_dirty = True
