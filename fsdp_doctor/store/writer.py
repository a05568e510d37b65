"""Writer: one append-only JSON-lines stream per rank, plus the run manifest."""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple, Optional

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

def write_manifest(out_dir: Path, manifest: Manifest) -> Path:
    """Writes ``manifest.json`` atomically (temp file then rename)."""
    return layout.write_atomic(layout.manifest_path(out_dir), record_encoder.encode(manifest))


class RunDirTaken(Exception):
    """The run directory cannot be made this run's; ``str()`` is one line saying why."""


class Claim(NamedTuple):
    """What :func:`claim_run_dir` did: the run's id, and the earlier run's files in the directory, moved aside to
    ``kept`` (rank 0's folder for them) or ``removed``."""

    run_id: str
    kept: Optional[Path] = None
    removed: bool = False


def restarted() -> bool:
    """Whether this process is a restart of a job torchrun's elastic agent runs (``--max-restarts``)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0")


def claim_run_dir(out_dir: Path | str, rank: int, *, overwrite: bool = False, share=None) -> Claim:
    """Makes ``out_dir`` this run's own before anything is written (a run directory holds one run).

    An earlier run's files there (a manifest or a record stream) are moved aside, below it in
    ``previous/run-{its id}/`` (``layout.keep_run``), or with ``overwrite`` removed (nothing else in the directory is
    touched) but where this process is an elastic restart of the job (``restarted``): its crashed attempt's records
    say how it ended. Refusing the directory ended the user's training where a job restarted (torchrun
    --max-restarts) into the folder of its crashed attempt, and overwrite wiped that attempt's records, unsaid (a
    new-user trial). Rank 0 goes first, with the shared files and every stream it sees; then each other rank with
    what is left of its own stream (one on another node's disk), into rank 0's folder. (All at once, two ranks moved
    or removed the same stream under each other: "No such file or directory" ended a 2-rank run at watch().)
    ``share`` (given when there are several ranks) returns rank 0's value on every rank (rank 0 gives it, the others
    wait for it: run_device.share_from_rank0): the ranks take rank 0's run id, and its error, before they write; a
    rank's own error is its own."""
    out = Path(out_dir)
    remove = overwrite and not restarted()

    def act(verdict: dict, mine: bool, into: Optional[str] = None) -> dict:
        try:
            if mine and remove:
                if rank == 0:
                    layout.clear_run(out)
                else:
                    (out / layout.stream_name(rank)).unlink(missing_ok=True)
                verdict["removed"] = True
            elif mine:
                kept = layout.keep_run(out, rank, into=None if into is None else Path(into).name)
                verdict["kept"] = None if kept is None else str(kept)
        except OSError as e:
            verdict["error"] = f"cannot prepare {out} ({e.strerror or e})"
        return verdict

    lead = {"error": None, "run_id": layout.new_run_id() if rank == 0 else None, "kept": None, "removed": False}
    if rank == 0:
        lead = act(lead, layout.has_run(out))
    lead = share(lead) if share is not None else lead
    mine = {"error": lead["error"], "kept": None, "removed": False}
    if rank != 0 and not mine["error"]:
        mine = act(mine, (out / layout.stream_name(rank)).exists(), into=lead["kept"])
    if mine["error"]:
        raise RunDirTaken(mine["error"])
    kept = lead["kept"] or mine["kept"]
    return Claim(lead["run_id"] or layout.new_run_id(), None if kept is None else Path(kept),
                 lead["removed"] or mine["removed"])
