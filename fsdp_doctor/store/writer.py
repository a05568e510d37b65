"""Writer: one append-only JSON-lines stream per rank, plus the run manifest."""

from __future__ import annotations

import os
from pathlib import Path

from ..records import MANIFEST_NAME, Manifest, Record, record_encoder, stream_name


class RecordWriter:
    """Appends records to ``rank{R}.records.jsonl``.

    Each record is encoded to one line and handed to the OS with a single unbuffered ``write`` so that
    a process killed at any moment leaves only whole lines behind (at worst one cut-short last line,
    which readers skip). Nothing is held in Python buffers between steps.
    """

    def __init__(self, out_dir: Path, rank: int, fresh: bool = True):
        """``fresh``: a run directory holds one run; watching into it again replaces this rank's stream."""
        self.path = Path(out_dir) / stream_name(rank)
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
    path = Path(out_dir) / MANIFEST_NAME
    tmp = path.with_suffix(".json.tmp")
    tmp.write_bytes(record_encoder.encode(manifest))
    os.replace(tmp, path)
    return path
