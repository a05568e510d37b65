"""Writer: one append-only JSON-lines stream per rank, plus the run manifest."""

from __future__ import annotations

import os
from pathlib import Path

from . import layout
from ..records import Manifest, Record, record_encoder


class RecordWriter:
    """Appends records to ``rank{R}.records.jsonl``.

    Each record is encoded to one line and handed to the OS with a single unbuffered ``write`` so that
    a process killed at any moment leaves whole lines behind: a cut-short last line comes from a write the OS
    took only part of (a full disk; a kill inside one very large write, rarely), which readers skip and name
    (store.reader.run_end_line). Nothing is held in Python buffers between steps.
    """

    def __init__(self, out_dir: Path, rank: int, fresh: bool = True):
        """``fresh``: a run directory holds one run; watching into it again replaces this rank's stream."""
        self.path = Path(out_dir) / layout.stream_name(rank)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if fresh else 0)
        self._fd = os.open(self.path, flags, 0o644)
        self.bytes_written = 0

    def write(self, *records: Record) -> None:
        buf = b"".join(record_encoder.encode(r) + b"\n" for r in records)
        view = memoryview(buf)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        self.bytes_written += len(buf)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

#: what to do about an out_dir holding a run, in watch()'s words (a command line that takes its options as flags says
#: it in its own: fsdp_doctor.record.titan_trainer)
# (to a user of watch(): a new-user trial resuming a run was told of the demo's flag alone)
TAKEN_ADVICE = ("pass overwrite=True to watch() to replace them (the demo: fsdp-doctor demo --overwrite), or choose a "
                "new out_dir")


def write_manifest(out_dir: Path, manifest: Manifest) -> Path:
    """Writes ``manifest.json`` atomically (temp file then rename)."""
    return layout.write_atomic(layout.manifest_path(out_dir), record_encoder.encode(manifest))


class RunDirTaken(Exception):
    """The run directory already holds another run's records; ``str()`` is one line saying what to do."""


def claim_run_dir(out_dir: Path | str, rank: int, *, overwrite: bool = False, exchange=None) -> str:
    """Makes ``out_dir`` this run's own before anything is written, and returns the run's id.

    A run directory holds one run: one that already holds a run's records (a manifest or a record stream)
    is refused with :class:`RunDirTaken`, or, with ``overwrite``, that run's files are removed (rank 0 the
    shared ones, every rank its own stream; nothing else in the directory is touched). ``exchange`` (given
    when there are several ranks) gathers one picklable value from every rank and returns the list of all of
    them in rank order (``torch.distributed.all_gather_object``): the ranks agree on the verdict and on rank
    0's run id before any of them writes."""
    out = Path(out_dir)
    verdict: dict = {"error": None, "run_id": None}
    try:
        if rank == 0:
            taken = layout.has_run(out)
        else:
            taken = (out / layout.stream_name(rank)).exists()
        if taken and not overwrite:
            verdict["error"] = f"{out} already holds a run's records; {TAKEN_ADVICE}"
        elif taken:
            if rank == 0:
                layout.clear_run(out)
            else:
                (out / layout.stream_name(rank)).unlink(missing_ok=True)
        if rank == 0:
            verdict["run_id"] = layout.new_run_id()
    except OSError as e:
        verdict["error"] = f"cannot prepare {out} ({e.strerror or e})"
    verdicts = exchange(verdict) if exchange is not None else [verdict]
    for v in verdicts:
        if v["error"]:
            raise RunDirTaken(v["error"])
    return verdicts[0]["run_id"] or layout.new_run_id()
