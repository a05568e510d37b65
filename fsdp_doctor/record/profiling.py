"""Profiler windows: torch.profiler with a schedule, traces written in TensorBoard's plugin layout."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import re
import threading
import time
import warnings
import weakref
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch.profiler import ProfilerAction

from ..records import PROFILER_DIR
from ..store.layout import write_probe

log = logging.getLogger("fsdp_doctor")
# torch.profiler.profile registers this name with Kineto's step tracker from its construction until it exits
_PROFILER_STEP_NAME = "ProfilerStep"


def _step_tracker() -> dict | None:
    try:
        from torch.autograd.profiler import KinetoStepTracker

        return KinetoStepTracker._step_dict
    except (ImportError, AttributeError):  # pragma: no cover - other torch layouts
        return None


def profiler_recording() -> bool:
    """Whether a torch.profiler session records now (the doctor's own window, or a profiler of the user's or of
    their trainer: torchtitan's --profiler.enable-profiling); one attribute read where torch has it."""
    enabled = getattr(torch.autograd.profiler, "_is_profiler_enabled", False)
    probe = getattr(torch._C._autograd, "_profiler_enabled", None)
    return bool(enabled or (probe is not None and probe()))


def other_profiler() -> str | None:
    """Why another torch.profiler is in play in this process (None if none is): a profiling session running
    now, or a ``torch.profiler.profile`` object alive (entered with a schedule that has not started yet).
    Two Kineto sessions in one process do not nest: the second one's stop ends the first one's session and
    the first one's stop then crashes the process (SIGSEGV in torch 2.13) or leaves its trace empty."""
    if profiler_recording():
        return "a torch.profiler session is running"
    tracker = _step_tracker()
    if tracker is not None and _PROFILER_STEP_NAME in tracker:
        return "a torch.profiler.profile object is alive (e.g. with a schedule not started yet)"
    return None


@dataclass(frozen=True)
class ProfileSchedule:
    """When profiler windows run, as a pure function of the step (like ``torch.profiler.schedule``).

    The first window records ``active`` steps starting at step ``first`` (after ``warmup`` warm-up
    steps); later windows start every ``every`` steps after it (0: only the first window).
    """

    first: int = 6
    active: int = 2
    warmup: int = 1
    every: int = 1000

    def __call__(self, step: int) -> ProfilerAction:
        if step < self.first - self.warmup:
            return ProfilerAction.NONE
        k = step - self.first
        if self.every > 0 and k >= self.every - self.warmup:
            k = (step - self.first + self.warmup) % self.every - self.warmup
        if -self.warmup <= k < 0:
            return ProfilerAction.WARMUP
        if 0 <= k < self.active - 1:
            return ProfilerAction.RECORD
        if k == self.active - 1:
            return ProfilerAction.RECORD_AND_SAVE
        return ProfilerAction.NONE

    def as_dict(self) -> dict[str, int]:
        return {"first": self.first, "active": self.active, "warmup": self.warmup, "every": self.every}


def resolve_profile(profile: Any) -> dict[str, Any] | None:
    """Normalises ``watch(profile=...)``: False/None (off), True (default schedule), a ProfileSchedule,
    any callable(step) -> ProfilerAction (e.g. ``torch.profiler.schedule(...)``), or a dict of
    ``torch.profiler.profile`` keyword arguments (``schedule``, ``activities``, ``record_shapes``,
    ``profile_memory``, ``with_stack``, ...)."""
    if profile is None or profile is False:
        return None
    if profile is True:
        return {"schedule": ProfileSchedule()}
    if isinstance(profile, dict):
        kw = dict(profile)
        kw.setdefault("schedule", ProfileSchedule())
        kw.pop("on_trace_ready", None)  # the doctor owns where traces go
        return kw
    if callable(profile):
        return {"schedule": profile}
    raise TypeError(f"profile= must be True, False, a schedule callable or a dict of torch.profiler.profile arguments, not {type(profile).__name__}")


#: the doctors' profilers of this process, until each stops
_LIVE: "weakref.WeakSet[ProfilerWindows]" = weakref.WeakSet()


class ProfilerWindows:
    """Drives ``torch.profiler.profile`` from ``step()``; writes each finished window to
    ``<out_dir>/profiler/rank{R}.{first_step}.pt.trace.json.gz`` and reports it to ``on_saved(steps, path)``; a
    window whose trace could not be written at all, as ``on_saved(steps, path, why)``.

    A profiler object exists only around a window: it is created and started at the step before the
    window's warm-up and dropped once the window is saved, so steps between windows pay nothing (a live
    ``torch.profiler.profile`` enters a ``ProfilerStep#N`` record function at every step, even idle). Its
    ``step_num`` starts at the global step, so ``ProfilerStep#N`` in the traces are training steps.

    The window's cost stays the doctor's: once a window is saved and its profiler dropped, one full
    collection clears the garbage the profiler and its export left (hundreds of thousands of event objects);
    left to Python's collector it came back as a 67-215 ms generation-0 pause 3-6 steps later, inside the
    user's steps, where it read as the user's GC problem. The collection runs in the step that already holds
    the export (recorded ``profiled`` and left out of the step statistics with the window); its time is
    ``last_collect_ms`` (benchmarks/profile_window_cost.py measures both, with and without it).

    The export writes Kineto's JSON (torch's C++ writer) beside the trace as ``NAME.part`` and gzips it on a
    thread; the trace is reported (``on_saved``) once its ``.json.gz`` is complete, at a later ``step()`` or at
    ``stop()``, which waits for it. torch's own ``.gz`` export re-reads the JSON line by line into gzip at level 9
    in the step: 1.3 s of a 16 MB trace here (the C++ export itself 0.1 s), and most of the 2.3 s a window's
    export took on the H100's 1B-parameter model; level 6 on the whole file takes 0.11 s, and zlib releases the
    GIL while it compresses.
    """

    #: collect the window's garbage when it closes (off only to measure what it saves)
    collect_after_window = True
    #: a window step that also ran the model without gradients (evaluation, generation) puts that work in the
    #: trace, where the verdict and the exposed communication would read it as the step's: the window is dropped
    #: unsaved and taken again from the next step, at most this many times in a run (a loop that evaluates in
    #: every step keeps its window, and the report says the trace includes the evaluation)
    retakes = 2

    def __init__(self, out_dir: Path, rank: int, kwargs: dict[str, Any],
                 on_saved: Callable[..., None], dry: bool = False):
        self.dir = Path(out_dir) / PROFILER_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        for old in self.dir.glob(f"rank{rank}.*.pt.trace.json*"):  # a previous run's windows of this rank
            old.unlink(missing_ok=True)
        self.rank = rank
        # a rank outside watch(profile_ranks=...): its windows open and close, and are taken again, as the profiled
        # ranks' do (the same steps marked profiled, left out of its statistics), with no profiler and no trace
        self.dry = dry
        self._dry_open = False
        self.schedule = kwargs["schedule"]
        self._offset = 0  # steps the schedule runs late by: the windows taken again (``retake``)
        self._opened_at = 0  # the step the open profiler started at
        self._discard = False
        self.on_saved = on_saved
        self._step = 0
        self._window: list[int] = []
        self._saved = 0
        kw = dict(kwargs)
        if "activities" not in kw:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            kw["activities"] = acts
        # Memory gives TensorBoard's Memory view. Shapes are not recorded: the collectives' message sizes come from
        # NCCL's own args (record_param_comms, recorded without them) and, on gloo, from the unit snapshot
        # (analyze.report.fill_sizes_from_units); with them a new-user trial's Mamba (the selective scan's reference
        # path, 62,000 operators a step) ran its profiled steps 7.3, 18.0 and 18.4 s against 1.1 s plain steps (1.1,
        # 1.1 and 2.5 s without: the last one stops the profiler). Cost, measured by
        # benchmarks/profile_window_cost.py on the 2-rank CPU reference workload: see the README. Window steps are
        # left out of the step statistics. On the H100's host-bound 1B-parameter model a window (its 2 steps, the
        # warm-up and the export) cost ~1.0 s over plain steps: every 200 steps that was 5 ms a step (3%), hence a
        # window every 1000 by default.
        kw.setdefault("record_shapes", False)
        kw.setdefault("profile_memory", True)
        kw.setdefault("with_stack", False)
        kw["schedule"] = self.action  # torch's profiler steps through the same, shifted, schedule
        # each window is a profiler of its own, one cycle: nothing to keep across cycles, and without acc_events torch
        # builds no Python event at the window's stop (the export is its C++ writer's). With it, set to silence
        # torch 2.11's "clears events at the end of each cycle ... set acc_events=True" (a one-cycle profiler warned,
        # fixed in pytorch#180387), every stop parsed the window's events in Python: a new-user trial's Mamba (62,000
        # operators a step) spent 10.8 s in its export step. That warning is hidden in the doctor's own calls only
        # (_quiet_profiler)
        kw.setdefault("acc_events", False)
        self._kw = kw
        self.prof: torch.profiler.profile | None = None
        self._gzips: list[tuple[threading.Thread, list[int], list[Path]]] = []  # traces being compressed, in order
        self.stepped_aside: str | None = None  # why the doctor left profiling to the user's own profiler
        _LIVE.add(self)  # (until stop(): a second watch() in the process, nested, names this one, not "yours")
        self._owns_tracker_key = False
        self.last_collect_ms = 0.0

    def action(self, step: int) -> ProfilerAction:
        return self.schedule(step - self._offset)

    def is_profiled(self, step: int) -> bool:
        return self.action(step) != ProfilerAction.NONE

    def start(self) -> None:
        self._maybe_open(self._step)

    @property
    def is_open(self) -> bool:
        """Whether a window is open: its profiler recording, or on a dry rank the window it stands in for."""
        return self.prof is not None or self._dry_open

    def _maybe_open(self, step: int) -> None:
        if self.is_open or self.stepped_aside or self.action(step) == ProfilerAction.NONE:
            return
        other = ("another fsdp_doctor.watch() in this process records profiler windows (a nested watch(): one "
                 "profiler per process)" if any(w is not self and w.prof is not None for w in list(_LIVE))
                 else other_profiler())
        if other is not None:  # the user profiles this run: leave it to them for the rest of the run
            self.stepped_aside = other  # (a dry rank too, as the traced ranks beside it do)
            log.warning("fsdp_doctor: %s on rank %s; the doctor records no profiler windows in this run so as "
                        "not to disturb it (everything else is recorded)", other, self.rank)
            return
        if self.dry:
            self._dry_open, self._opened_at = True, step
            return
        tracker = _step_tracker()
        self._owns_tracker_key = tracker is not None and _PROFILER_STEP_NAME not in tracker
        with _quiet_profiler():
            prof = torch.profiler.profile(on_trace_ready=self._ready, **self._kw)
            prof.step_num = step  # the schedule sees global steps; ProfilerStep#N labels are training steps
            prof.current_action = self.action(step)
            prof.start()
        self.prof = prof
        self._opened_at = step

    def step(self, evaluated: bool = False, retake: bool = True) -> bool:
        """Advances past the step just finished (``evaluated``: it also ran the model without gradients; ``retake``
        False: so did the step before, the loop evaluates in every step and the window keeps it); True if a trace
        was written."""
        if self.action(self._step) in (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE):
            if evaluated and retake and self.is_open and self.retakes > 0:
                self._retake()
                return False
            self._window.append(self._step)
        saved_before = self._saved
        self._report_compressed()
        self._step += 1
        if self.is_open:
            if self.prof is not None:
                with _quiet_profiler():
                    self.prof.step()
            if self.action(self._step) == ProfilerAction.NONE:  # the window is over (and was saved)
                self._close()
                self._collect()
        self._maybe_open(self._step)
        return self._saved != saved_before

    def _retake(self) -> None:
        """Drops the open window unsaved and shifts the schedule so that it opens again at the next step as it
        opened at ``_opened_at``."""
        self.retakes -= 1
        self._discard = True
        try:
            self._close()
        finally:
            self._discard = False
        self._window = []
        self._collect()
        self._step += 1
        self._offset += self._step - self._opened_at
        self._maybe_open(self._step)

    def _collect(self) -> None:
        """The window's garbage collected now, in the doctor's own (profiled) step, not in the user's."""
        if not self.collect_after_window or self.dry:  # (a dry window leaves no garbage)
            return  # (even with the collector disabled: the user's own scheduled collections would pay for it)
        t0 = time.perf_counter()
        gc.collect()
        self.last_collect_ms = (time.perf_counter() - t0) * 1e3

    def _ready(self, prof) -> None:
        if self._discard:
            return
        steps = self._window or [self._step]
        name = f"rank{self.rank}.{steps[0]}.pt.trace.json.gz"
        part = self.dir / f"{name}.part"
        prof.export_chrome_trace(str(part))  # plain JSON: torch's writer, in C++
        self._window = []
        self._saved += 1
        done: list[Path] = []  # the file the thread leaves: the .json.gz, or the plain .json if it failed
        lost: list[str] = []  # or why there is none
        job = threading.Thread(target=_gzip_file, args=(part, self.dir / name, done, lost),
                               name="fsdp_doctor-trace-gzip", daemon=True)
        job.start()
        self._gzips.append((job, steps, done, lost))

    def _report_compressed(self, wait: bool = False) -> None:
        """Reports the traces whose compression finished (all of them, waiting, with ``wait``), in order."""
        while self._gzips and (wait or not self._gzips[0][0].is_alive()):
            job, steps, done, lost = self._gzips.pop(0)
            job.join()
            if done:
                self.on_saved(steps, f"{PROFILER_DIR}/{done[0].name}")
            elif lost:  # (the name it would have had, and why it has none)
                self.on_saved(steps, f"{PROFILER_DIR}/{lost[0]}", lost[1])

    def stop(self, clean: bool = False) -> None:
        """Closes an open window and waits for the traces being compressed. Stopping mid-window saves what was
        recorded so far (torch calls on_trace_ready), except after a ``clean`` end (the loop's last ``step()``
        returned and nothing raised) of a window that completed no step: it would hold only the doctor's exit
        (a run of 6 steps opens the default window at step 6), which the analysis would read as a step that never
        finished, so it is dropped unsaved. After an exception, the incomplete step is kept: it shows where the run
        stopped."""
        try:
            if self.is_open:
                self._discard = clean and not self._window
                self._close()
        finally:
            _LIVE.discard(self)
            self._discard = False
            self._report_compressed(wait=True)

    def _close(self) -> None:
        if self.prof is None:  # (a dry window: nothing recorded or written)
            # counted as saved where the profiled ranks save theirs: their export runs into the next step, whose
            # collectives this rank waits in for it (a 2-rank run's rank 1 took 338 ms in it, not marked: an outlier)
            self._saved += not self._discard and bool(self._window)
            self._dry_open = False
            self._window = []
            return
        prof, self.prof = self.prof, None
        try:
            prof.stop()
        finally:
            # our profile object registered itself with Kineto's step tracker and is never exited as a
            # context manager: unregister it, so that neither a user profiler nor our next window sees it
            tracker = _step_tracker()
            if self._owns_tracker_key and tracker is not None:
                tracker.pop(_PROFILER_STEP_NAME, None)
            self._owns_tracker_key = False


#: the warning torch 2.11 (and versions before it, not 2.6) gives a one-cycle profiler without acc_events, which has
#: no cycles to clear
_CYCLE_WARNING = r"Warning: Profiler clears events at the end of each cycle"
#: its whole text as torch writes it, which torch warns once a process (profiler._WARNINGS_SHOWN): 2.11's sentences
#: run together, 2.13's spaced
_CYCLE_WARNING_TEXTS = tuple(sep.join(["Warning: Profiler clears events at the end of each cycle.",
                                       "Only events from the current cycle will be reported.",
                                       "To keep events across cycles, set acc_events=True."]) for sep in ("", " "))


@contextlib.contextmanager
def _quiet_profiler():
    """The doctor's own calls into its window's profiler, without torch's cycle warning (``_CYCLE_WARNING``) and
    nothing else hidden or changed. No warnings filter is added: changing ``warnings.filters`` (catch_warnings does)
    resets every module's record of the warnings it has shown, so the user's own once-only warnings printed again
    after each of these calls (FSDP2's "returned a view tensor" under a new-user trial's ModernBERT and Trainer: 10
    lines a rank, 2 without the doctor). torch is told it has given the warning already (its once-a-process record,
    ``_WARNINGS_SHOWN``, holding its known texts for these calls, then as it was, so that the user's own profiler
    still says it): nothing to filter, even where warnings are errors (``-W error``); a text not known is dropped
    where it is shown (``warnings.showwarning``, the hook Python calls once its filters let a warning through;
    others go on to the hook that was there)."""
    import torch.profiler.profiler as tp

    shown = getattr(tp, "_WARNINGS_SHOWN", None)
    before = set(shown) if isinstance(shown, set) else None
    if before is not None:
        shown.update(_CYCLE_WARNING_TEXTS)
    hook = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if not (issubclass(category, UserWarning) and re.match(_CYCLE_WARNING, str(message))):
            hook(message, category, filename, lineno, file, line)
    warnings.showwarning = show
    try:
        yield
    finally:
        if warnings.showwarning is show:
            warnings.showwarning = hook
        if before is not None:
            shown.difference_update({m for m in shown - before if re.match(_CYCLE_WARNING, m)})


#: bytes read and compressed at a time
_GZIP_CHUNK = 4 << 20


#: bytes a write into the profiler folder tries when torch's writer left no trace: more than a full disk's last blocks
_PROBE_BYTES = 64 << 10


def _write_failure(folder: Path) -> str:
    """Why a write into ``folder`` fails now ("[Errno 28] No space left on device"), "" when it does not: a probe
    of _PROBE_BYTES (layout.write_probe)."""
    e = write_probe(folder, _PROBE_BYTES)
    if e is None:
        return ""
    return f"[Errno {e.errno}] {e.strerror}" if e.errno else str(e)


def _gzip_file(src: Path, dst: Path, done: list[Path], lost: list[str] | None = None) -> None:
    """Compresses ``src`` into ``dst`` (gzip, level 6), removes ``src`` and appends ``dst`` to ``done``; ``dst``
    appears complete or not at all (written beside it, then renamed). If that fails, ``src`` becomes the plain
    trace (``dst`` less ``.gz``: the reader takes both), appended instead, and one line says so. Where there is no
    trace at all, ``dst``'s name and why go to ``lost``."""
    tmp = dst.with_name(dst.name + ".tmp")
    try:
        # (zlib's stream in gzip's container, not gzip.GzipFile: on Python 3.12 and 3.13 until CPython's fix of
        # gh-129726 a GzipFile written to is a reference cycle with its write buffer, and this thread ends after the
        # window's step collected the window's garbage: 6 objects left for the user's collector on 3.13.0)
        z = zlib.compressobj(6, zlib.DEFLATED, 31)
        with open(src, "rb") as fin, open(tmp, "wb") as fout:
            while chunk := fin.read(_GZIP_CHUNK):
                fout.write(z.compress(chunk))
            fout.write(z.flush())
        os.replace(tmp, dst)
        src.unlink()
        done.append(dst)
    except OSError as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        if not src.exists():  # (a full disk: the profiler wrote nothing; "it stays as plain JSON" said of nothing)
            # torch's writer says nothing of why (Kineto logs "Failed to write to log file!") and leaves its empty
            # NAME.tmp: the cause is the folder's own, read by a write of ours (a new-user trial's 40 KiB disk, full,
            # read "[Errno 2] No such file or directory", the missing file, with two empty .part.tmp files left)
            with contextlib.suppress(OSError):
                src.with_name(src.name + ".tmp").unlink(missing_ok=True)
            why = _write_failure(src.parent) or f"torch's profiler wrote no file: {e}"
            log.warning("fsdp_doctor: the profiler trace %s was not written (%s): that window is lost", dst.name, why)
            if lost is not None:
                lost += [dst.name, why]
            return
        plain = dst.with_suffix("")
        try:
            os.replace(src, plain)
            done.append(plain)
        except OSError:
            plain = src
        log.warning("fsdp_doctor: could not compress the profiler trace %s (%s); it stays as plain JSON", plain, e)
