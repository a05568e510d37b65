"""Server-side state of the dashboard: one run directory followed while it grows.

``RunState.refresh()`` is called by the polling callback (and when a page is served). It reads only the new
bytes of each record stream (:class:`fsdp_doctor.store.RunFollower`), rebuilds the record analyses when
something new arrived with the same pipeline as the CLI (``fsdp_doctor.pipeline.build_report``, given the
decoded trace windows, which are cached per trace file: each profiler window is decoded once, on a background
thread, and only the cheap combination is redone). Every change bumps ``version``;
pages are re-rendered only when it changes.

A run directory holds one run, but the run in it may be replaced while it is followed (``fsdp-doctor demo
--overwrite`` removes the old run's files and writes a new one; a stream may be truncated or swapped). Each
refresh compares the manifest's bytes and each stream's identity (device, inode, first line, size never
shrinking) with what was read: on any difference everything read so far is dropped, the directory is read
from scratch, and the snapshot's ``notice`` says what happened and when.

Nothing here analyses anything: it calls the analyses and keeps their results.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import msgspec

from fsdp_doctor.pipeline import build_report, record_sections, steps_columns, trace_steps_columns, window_run
from fsdp_doctor.report_sections import Report
from fsdp_doctor.store import RunFollower, run_trace_files
from fsdp_doctor.store.reader import closing_problems
from fsdp_doctor.store.layout import MANIFEST_NAME, manifest_path, streams

# A trace file that fails to decode and was modified this recently may still be being written: retry it.
TRACE_SETTLE_S = 10.0
# The report's sections computed from the records, which a step window (and a rank) recompute.
RECORD_SECTIONS = ("steps", "units", "throughput", "memory")
HEAD_BYTES = 4096  # a stream's header line (its run id) lies within its first bytes; a manifest is smaller
# The report is rebuilt from every record read (build_report over the whole run): its cost grows with the run (0.2 s
# of CPU at 2,500 steps x 2 ranks, ~2 s at 20,000). Rebuilt on every poll with new records, a new-user trial's
# dashboard answered its one-second poll in 5-9 s at 15,000 steps, a quarter of a core spent on it. The poll
# (``refresh(throttle=True)``) rebuilds for new records at most this share of the time: after a rebuild of t seconds
# the next waits (1/share - 1)·t (0.8 s after a 0.2 s one). A replaced run or a new problem rebuilds at once.
REBUILD_SHARE = 0.2


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
    notice: str = ""  # the run was replaced or truncated and read again from scratch: what and when
    trace_errors: list[str] = field(default_factory=list)  # "file: why" for each trace that did not decode
    # what the record streams say once the run stopped writing (store.closing_problems): the lines, and those they
    # replace; the pages show them where the run is no longer live
    closing: tuple[list[str], set[str]] = field(default_factory=lambda: ([], set()))

    def problems(self, live: bool) -> list[str]:
        """The report's problems and, where the run is no longer ``live``, the streams' closing lines."""
        if live:
            return list(self.report.problems)
        lines, replaced = self.closing
        got = [p for p in self.report.problems if p not in replaced]
        return got + [p for p in lines if p not in got]

    def sections(self, window: Optional[tuple[int, int]], rank: Optional[int] = None) -> Report:
        """The report with its record sections (``RECORD_SECTIONS``) recomputed by the same analyses over the
        steps inside ``window`` only and, with ``rank``, that rank only; a section with nothing there is None.
        The report itself when both are None."""
        if (window is None and rank is None) or self.window_fn is None:
            return self.report
        return self.window_fn(window, rank)


def _first_line(data: bytes) -> Optional[bytes]:
    end = data.find(b"\n")
    return data[: end + 1] if end >= 0 else None


def _stream_identity(path: Path) -> Optional[tuple]:
    """(device, inode, size, first line or None while it is being written) of a record stream; None when gone."""
    try:
        if not path.is_file():  # a FIFO would block the open
            return None
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            head = f.read(HEAD_BYTES)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, _first_line(head)


def replaced_reason(old: dict, new: dict) -> str:
    """Why the run directory no longer holds the run that was read (``old`` and ``new``: file name -> identity,
    the manifest's as its bytes); "" when it still does (files may only appear and grow)."""
    for name, was in old.items():
        now = new.get(name)
        if now is None:
            return f"{name} was removed"
        if name == MANIFEST_NAME:
            if now != was:
                return f"{name} was rewritten"
            continue
        if was[:2] != now[:2]:
            return f"{name} was replaced by another file"
        if now[2] < was[2]:
            return f"{name} was truncated ({was[2]:,} → {now[2]:,} bytes)"
        if was[3] is not None and now[3] is not None and was[3] != now[3]:
            return f"{name} now starts with another run's header"
    return ""


class RunState:
    def __init__(self, path: Path | str, *, background_traces: bool = True):
        self.path = Path(path)
        self._follower = RunFollower(self.path)
        self._identity: dict[str, Any] = {}
        self._generation = 0  # bumped when the run is read again from scratch
        self._notice = ""
        self._problems_seen = 0
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
        self._stale = False  # records read but not yet in the snapshot (a throttled poll)
        self._next_rebuild = 0.0  # time.monotonic() from which a throttled poll may rebuild

    # ------------------------------------------------------------------ polling
    def refresh(self, throttle: bool = False) -> bool:
        """Reads what is new; returns True when the snapshot changed. ``throttle`` (the dashboard's poll): new
        records rebuild the report at most REBUILD_SHARE of the time; until then they wait, read."""
        with self._lock:
            ident = self._read_identity()
            why = replaced_reason(self._identity, ident)
            if why:
                self._restart(why)
            self._identity = ident
            try:
                run, new = self._follower.poll()
            except OSError as e:  # (the folder made unreadable while served: named, what was read is kept)
                self._follower.note_problem(f"{self.path}: cannot read folder ({e.strerror or e}); the records read "
                                            "before are shown")
                run, new = self._follower.run, 0
            scanned = self._scan_traces()
            problems = len(run.problems) != self._problems_seen  # shown as they appear, even without a record
            self._problems_seen = len(run.problems)
            fresh = bool(new or scanned or self._traces_dirty or self._stale)
            if not (fresh or problems or why) and self._snapshot is not None:
                return False
            if throttle and not (problems or why) and self._snapshot is not None and \
                    time.monotonic() < self._next_rebuild:
                self._stale = True
                return False
            self._traces_dirty = self._stale = False
            t0 = time.monotonic()
            self._rebuild(run)
            self._next_rebuild = time.monotonic() + (time.monotonic() - t0) * (1 / REBUILD_SHARE - 1)
            return True

    def snapshot(self) -> Snapshot:
        with self._lock:
            if self._snapshot is None:
                self.refresh()
            return self._snapshot

    @property
    def version(self) -> int:
        return self._version

    @property
    def refused(self) -> str:
        """Why the store refuses the run directory ("" when it reads it): the line ``analyze`` exits on. (A new-user
        trial's manifest of format version 7: analyze refused it, the dashboard showed its traces and a verdict.)"""
        return self._follower.run.refused

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
    def _read_identity(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        mp = manifest_path(self.path)
        try:
            if mp.is_file():
                with open(mp, "rb") as f:
                    out[MANIFEST_NAME] = f.read(HEAD_BYTES)
        except OSError:
            pass
        try:
            found = streams(self.path)
        except OSError:  # the folder cannot be listed now (its permissions changed): nothing seen to have changed
            return dict(self._identity)
        for p in found.values():
            ident = _stream_identity(p)
            if ident is not None:
                out[p.name] = ident
        return out

    def _restart(self, why: str) -> None:
        """Forgets everything read so far: the next poll reads the directory from scratch."""
        self._follower = RunFollower(self.path)
        self._traces.clear()
        self._pending.clear()
        self._generation += 1
        self._problems_seen = 0
        self._notice = (f"{time.strftime('%H:%M:%S')}: the run in {self.path} changed ({why}); "
                        "everything was read again from scratch")

    def _rebuild(self, run) -> None:
        run.trace_files = sorted(self._traces)
        windows = [w for _, w in self._traces.values() if not isinstance(w, str)]
        skipped = [f"{p.name}: {w}" for p, (k, w) in sorted(self._traces.items()) if isinstance(w, str) and k[0] >= 0]
        failed = [f"{p.name}: {w}" for p, (_, w) in sorted(self._traces.items()) if isinstance(w, str)]
        report = build_report(run, traces=False, windows=windows or None)  # the CLI's pipeline, sizes included
        if skipped:
            report.problems = [*report.problems, *skipped]
        self._report = report
        self._steps = steps_columns(run) or trace_steps_columns(report.overlap)  # plain traces: ProfilerSteps
        self._version += 1
        frozen = window_run(run, (-1, 1 << 62))  # the steps of this version
        self._window_cache: dict = {}
        self._snapshot = Snapshot(version=self._version, path=self.path, report=report, steps=self._steps,
                                  updated=self._last_written(),
                                  windows=sorted(windows, key=lambda w: (w.rank, w.steps[:1], w.file)),
                                  has_records=run.has_records, traces_pending=len(self._pending),
                                  notice=self._notice, trace_errors=failed,
                                  closing=closing_problems(self._follower, run)[:2],
                                  window_fn=lambda w, r=None, _f=frozen, _rep=report: self._window_sections(_f, _rep, w, r))

    def _last_written(self) -> float:
        """When the run's records last grew (their files' newest modification time), not when they were read: a run
        that crashed minutes before the dashboard opened read "live", its last record the moment of loading (a
        new-user trial); now where there are none."""
        times = []
        try:
            found = streams(self.path)
        except OSError:
            found = {}
        for p in found.values():
            try:
                times.append(p.stat().st_mtime)
            except OSError:
                pass
        return max(times, default=time.time())

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
        if not self.path.is_dir() or self.refused:  # (a refused run is not read: its traces neither)
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
                gen = self._generation
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
                if gen != self._generation:  # the run was replaced meanwhile: this file is read again
                    continue
                self._traces[p] = (key, res)
                self._pending.discard(p)
                self._traces_dirty = True
