"""Server-side state of the dashboard: one run directory followed while it grows.

``RunState.refresh()`` is called by the polling callback (and when a page is served). It reads only the new
bytes of each record stream (:class:`fsdp_doctor.store.RunFollower`), rebuilds the record analyses when
something new arrived with the same pipeline as the CLI (``fsdp_doctor.pipeline.build_report``, given the
decoded trace windows, which are cached per trace file: each profiler window is decoded once, on a background
thread, and only the cheap combination is redone). Every change bumps ``version``;
pages are re-rendered only when it changes.

Nothing here analyses anything: it calls the analyses and keeps their results.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import msgspec

from fsdp_doctor.pipeline import build_report, record_sections, window_run
from fsdp_doctor.report_sections import Report
from fsdp_doctor.store import RunFollower, run_trace_files

# A trace file that fails to decode and was modified this recently may still be being written: retry it.
TRACE_SETTLE_S = 10.0
# The report's sections computed from the records, which a step window (and a rank) recompute.
RECORD_SECTIONS = ("steps", "units", "throughput", "memory")


@dataclass
class Snapshot:
    """What the pages render: an immutable view taken under the lock."""

    version: int
    path: Path
    report: Report
    steps: dict[int, dict[str, list]]  # rank -> columns (see steps_columns)
    windows: list[Any]  # fsdp_doctor.trace WindowTrace, one per analysed profiler window
    has_records: bool
    traces_pending: int = 0
    updated: float = field(default_factory=time.time)
    window_fn: Optional[Callable[..., Report]] = field(default=None, repr=False, compare=False)

    def sections(self, window: Optional[tuple[int, int]], rank: Optional[int] = None) -> Report:
        """The report with its record sections (``RECORD_SECTIONS``) recomputed by the same analyses over the
        steps inside ``window`` only and, with ``rank``, that rank only; a section with nothing there is None.
        The report itself when both are None."""
        if (window is None and rank is None) or self.window_fn is None:
            return self.report
        return self.window_fn(window, rank)


STEP_COLUMNS = ("step", "wall_ms", "forward_ms", "backward_ms", "optimizer_ms", "outside_ms", "gc_ms", "profiled")


def steps_columns(run) -> dict[int, dict[str, list]]:
    """The per-step records of each rank as columns (plain lists), the input of the step figures. Column
    ``profiler_export`` is True on a step that wrote a profiler window's trace (its "outside" time is that
    export, not data loading); ``steady`` is True on the steps the analyses use for statistics (the one
    steady-state rule, ``fsdp_doctor.analyze.steps.usable_steps``: figures need not re-implement it)."""
    from fsdp_doctor.analyze.steps import profiler_export_steps, usable_steps

    out: dict[int, dict[str, list]] = {}
    for r, rd in sorted(run.ranks.items()):
        cols: dict[str, list] = {k: [] for k in STEP_COLUMNS}
        for s in rd.steps:
            for k in STEP_COLUMNS:
                cols[k].append(getattr(s, k))
        export = set(profiler_export_steps(rd))
        cols["profiler_export"] = [st in export for st in cols["step"]]
        steady = {s.step for s in usable_steps(rd.steps)}
        cols["steady"] = [st in steady for st in cols["step"]]
        out[r] = cols
    return out


class RunState:
    def __init__(self, path: Path | str, *, background_traces: bool = True):
        self.path = Path(path)
        self._follower = RunFollower(self.path)
        self._lock = threading.RLock()
        self._version = 0
        self._report: Report | None = None
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
        windows = [w for _, w in self._traces.values() if not isinstance(w, str)]
        skipped = [f"{p.name}: {w}" for p, (k, w) in sorted(self._traces.items()) if isinstance(w, str) and k[0] >= 0]
        report = build_report(run, traces=False, windows=windows or None)  # the CLI's pipeline, sizes included
        if skipped:
            report.problems = [*report.problems, *skipped]
        self._report = report
        self._steps = steps_columns(run)
        self._version += 1
        frozen = window_run(run, (-1, 1 << 62))  # the steps of this version
        self._window_cache: dict = {}
        self._snapshot = Snapshot(version=self._version, path=self.path, report=report, steps=self._steps,
                                  windows=sorted(windows, key=lambda w: (w.rank, w.steps[:1], w.file)),
                                  has_records=run.has_records, traces_pending=len(self._pending),
                                  window_fn=lambda w, r=None, _f=frozen, _rep=report: self._window_sections(_f, _rep, w, r))

    def _window_sections(self, frozen, report: Report, window: Optional[tuple[int, int]],
                         rank: Optional[int] = None) -> Report:
        key = (id(report), None if window is None else tuple(window), rank)  # the report of one version
        hit = self._window_cache.get(key)
        if hit is not None:
            return hit
        if rank is not None:  # that rank only (the Units page's per-rank timings)
            frozen = dataclasses.replace(frozen, ranks={r: rd for r, rd in frozen.ranks.items() if r == rank})
        # the record sections over the window (memory too: the Memory page); a section the window lacks is None
        secs = record_sections(frozen, None if window is None else tuple(window))
        out = msgspec.structs.replace(report, **{k: secs.get(k) for k in RECORD_SECTIONS})
        if len(self._window_cache) > 32:
            self._window_cache.clear()
        self._window_cache[key] = out
        return out

    def _trace_files(self) -> list[Path]:
        if not self.path.is_dir():
            return []
        root = self.path.resolve()
        out = []
        problems: list[str] = []
        found = run_trace_files(self._follower.run, problems)  # the store knows which traces are this run's
        for msg in problems:
            self._follower.note_problem(msg)
        for p in found:
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
        from fsdp_doctor.trace import load_window  # errors as values

        while True:
            with self._lock:
                if not self._pending:
                    return
                p = sorted(self._pending)[0]
            try:
                st = p.stat()
                key = (st.st_mtime_ns, st.st_size)
                res = load_window(str(p))
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
