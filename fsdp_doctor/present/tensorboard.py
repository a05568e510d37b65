"""TensorBoard export: the scalars of a recorded run (one event per step and rank under ``tb/rank{R}``), written
after the fact from the records and the pipeline's overlap section. The scalars themselves (tags, values) are
defined once in ``fsdp_doctor.tensorboard_scalars``, which the live writer (``fsdp_doctor.record.tensorboard``,
``watch(tensorboard=True)``) uses too. Writing uses TensorBoard's own event writer; torch is not imported
(``fsdp-doctor tensorboard`` starts as fast as ``analyze``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable

from ..records import ProfileWindow
from ..store import layout
from ..tensorboard_scalars import add_scalars, step_scalars, step_walltimes, window_overlap_scalars


EVENTS_GLOB = "events.out.tfevents.*"


class EventsExist(FileExistsError):
    """The TensorBoard folders already hold event files (a live writer's, an earlier export's)."""


def existing_events(run, out: Path | str | None = None) -> list[Path]:
    """The event files already in the ``tb/rank{R}`` folders an export of ``run`` to ``out`` would write: TensorBoard
    reads every file of a folder, so a second export beside them drew each step twice (a new-user trial)."""
    out = Path(out) if out is not None else Path(run.path)
    return sorted(f for rank in run.ranks for f in layout.tb_dir(out, rank).glob(EVENTS_GLOB))


def export_tensorboard(run, out: Path | str | None = None, *, traces: bool = True,
                       overwrite: bool = False, problems: list[str] | None = None) -> list[Path]:
    """Writes the scalars of a recorded :class:`~fsdp_doctor.store.Run` to ``<out>/tb/rank{R}`` (``out`` defaults
    to the run directory); the overlap of each profiled window comes from the pipeline (one window at a time, so
    each window's steps get that window's figures). Returns the directories written. Event files already there
    (``watch(tensorboard=True)``'s, an earlier export's) raise :class:`EventsExist`, or with ``overwrite`` are
    replaced, each folder's once its new file is written. A profiler window that cannot be analysed is named in
    ``problems`` (one line each, unless ``run.problems`` names its file already) and its overlap scalars left out. A
    folder that cannot be written raises OSError whose ``filename`` is that folder (never a temporary one's name)."""
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    out = Path(out) if out is not None else Path(run.path)
    if not overwrite and (old := existing_events(run, out)):
        raise EventsExist(f"{old[0].parent.parent} already holds TensorBoard events ({len(old)} file"
                          f"{'s' * (len(old) != 1)}: written live by watch(tensorboard=True) or by an earlier "
                          "export); TensorBoard would draw every step twice")
    written = []
    for rank, rd in sorted(run.ranks.items()):
        if not rd.steps and not rd.profiles:
            continue
        d = layout.tb_dir(out, rank)
        try:
            d.parent.mkdir(parents=True, exist_ok=True)
            # written whole or not at all: into a temporary folder beside it, the event file then renamed into place
            tmp = Path(tempfile.mkdtemp(dir=d.parent, prefix=f".{d.name}.", suffix=".tmp"))
        except OSError as e:  # (a read-only run folder, or tb/: a traceback from mkdir or mkdtemp)
            raise OSError(e.errno, e.strerror or str(e), str(_nearest_existing(d.parent))) from None
        try:
            w = EventFileWriter(str(tmp), max_queue_size=1000)
            try:
                walltime = step_walltimes(rd.steps)
                seen: set = set()
                for rec in sorted(rd.steps, key=lambda r: r.step):
                    add_scalars(w, step_scalars(rec, seen), rec.step, walltime[rec.step])
                if traces:
                    for step, vals in sorted(_overlap_scalars(run, rank, rd.profiles, problems).items()):
                        add_scalars(w, vals, step, walltime.get(step))
            finally:
                w.close()
            d.mkdir(exist_ok=True)
            for f in d.glob(EVENTS_GLOB):  # (only with overwrite: checked above)
                f.unlink()
            for f in tmp.iterdir():
                os.replace(f, d / f.name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        written.append(d)
    return written


def _nearest_existing(p: Path) -> Path:
    """``p``, or the nearest folder above it that exists: the folder a failed ``mkdir`` could not write into."""
    while not os.path.lexists(p) and p.parent != p:
        p = p.parent
    return p


def _overlap_scalars(run, rank: int, profiles: Iterable[ProfileWindow],
                     problems: list[str] | None) -> dict[int, dict[str, float]]:
    """The overlap scalars of ``rank``'s profiled windows (``tensorboard_scalars.window_overlap_scalars``); one that
    cannot be decoded is named in ``problems`` (as ``analyze`` names it), unless ``run.problems`` names its file."""
    failed: list = []
    out = window_overlap_scalars(rank, _profiles(run, profiles), failed)
    for p, why in failed:
        name = layout.relative_name(p, Path(run.path).resolve())
        if problems is not None and not any(q.startswith(f"{name}:") for q in [*run.problems, *problems]):
            problems.append(f"{name}: {why}; its overlap scalars are not written")
    return out


def _profiles(run, profiles: Iterable[ProfileWindow]) -> list[tuple[Path, list[int]]]:
    """(trace path, the window's steps) of each profiled window inside the run directory that is there (one whose
    folder cannot be read is left out: ``run.problems`` names that folder)."""
    root = Path(run.path).resolve()
    out = []
    for pw in profiles:
        p = (Path(run.path) / pw.path).resolve()
        try:
            there = p.is_relative_to(root) and p.exists()
        except OSError:  # (Path.exists raises PermissionError in a folder that cannot be searched)
            there = False
        if there:
            out.append((p, list(pw.steps)))
    return out
