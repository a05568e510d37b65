"""Reader: loads a run directory into the shared model, or follows it while it grows."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from . import layout
from ..records import (
    FORMAT_VERSION,
    DoctorError,
    End,
    GpuTimes,
    Header,
    Manifest,
    ProfileWindow,
    RunConfig,
    StepRecord,
    manifest_decoder,
    record_decoder,
)


@dataclass
class RankData:
    """Everything one rank recorded."""

    rank: int
    header: Header | None = None
    config: RunConfig | None = None
    steps: list[StepRecord] = field(default_factory=list)
    profiles: list[ProfileWindow] = field(default_factory=list)
    errors: list[DoctorError] = field(default_factory=list)
    end: End | None = None
    gpu: dict[int, GpuTimes] = field(default_factory=dict)  # step -> device-side times (CUDA only)

    def add(self, rec) -> None:
        if isinstance(rec, StepRecord):
            self.steps.append(rec)
        elif isinstance(rec, RunConfig):
            self.config = rec
        elif isinstance(rec, ProfileWindow):
            self.profiles.append(rec)
        elif isinstance(rec, DoctorError):
            self.errors.append(rec)
        elif isinstance(rec, Header):
            self.header = rec
        elif isinstance(rec, End):
            self.end = rec
        elif isinstance(rec, GpuTimes):
            self.gpu[rec.step] = rec


@dataclass
class Run:
    """A run as the analyses see it: the same model whether it was just recorded or read from disk."""

    path: Path
    manifest: Manifest | None = None
    ranks: dict[int, RankData] = field(default_factory=dict)
    trace_files: list[Path] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # one line each: the file and what is wrong

    @property
    def config(self) -> RunConfig | None:
        """The configuration of the lowest rank that recorded one."""
        for r in sorted(self.ranks):
            if self.ranks[r].config is not None:
                return self.ranks[r].config
        return None

    @property
    def world_size(self) -> int:
        if self.manifest is not None:
            return self.manifest.world_size
        cfg = self.config
        return cfg.world_size if cfg else len(self.ranks)

    @property
    def has_records(self) -> bool:
        return any(rd.steps or rd.config for rd in self.ranks.values())

    @property
    def run_id(self) -> str:
        """The run's id (manifest, else the lowest rank's header); "" for runs recorded before run ids."""
        if self.manifest is not None and self.manifest.run_id:
            return self.manifest.run_id
        for r in sorted(self.ranks):
            h = self.ranks[r].header
            if h is not None and h.run_id:
                return h.run_id
        return ""


class StreamReader:
    """Reads one rank's record stream incrementally, from a remembered byte offset.

    A final line without its newline is left for the next poll (the writer may be mid-write, or was
    killed mid-write); a line that does not decode is reported once, by file and line number, and
    skipped.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.offset = 0
        self.line_no = 0
        self.problems: list[str] = []

    def poll(self) -> list:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError as e:
            self.problems.append(f"{self.path}: cannot read ({e.strerror or e})")
            return []
        end = data.rfind(b"\n")
        if end < 0:
            return []
        chunk = data[: end + 1]
        self.offset += len(chunk)
        out = []
        for line in chunk.splitlines():
            self.line_no += 1
            if not line.strip():
                continue
            try:
                rec = record_decoder.decode(line)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                self.problems.append(f"{self.path.name}: line {self.line_no} is not a valid record ({_short(e)}); skipped")
                continue
            if isinstance(rec, Header) and rec.version > FORMAT_VERSION:
                self.problems.append(
                    f"{self.path.name}: record format version {rec.version} is newer than this "
                    f"fsdp-doctor reads ({FORMAT_VERSION}); upgrade fsdp-doctor"
                )
                self.offset = 1 << 62  # stop reading this stream
                return out
            out.append(rec)
        return out

    def trailing_bytes(self) -> int:
        """Bytes after the last complete line (a record cut short by a kill)."""
        try:
            return max(0, self.path.stat().st_size - self.offset)
        except OSError:
            return 0


def _short(e: Exception) -> str:
    s = str(e).splitlines()[0] if str(e) else type(e).__name__
    return s[:120]


class RunFollower:
    """Follows a run directory while it is written: each ``poll()`` reads only what is new."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.run = Run(path=self.path)
        self._streams: dict[int, StreamReader] = {}
        self._foreign: set[int] = set()
        self._reported: set[str] = set()

    def poll(self) -> tuple[Run, int]:
        """Reads new records; returns the run and how many records were new. Streams of another run (their
        header's run id differs from the manifest's, or their rank is outside the manifest's world size) are
        never mixed in: each is named once in ``run.problems`` and left unread."""
        run = self.run
        mpath = layout.manifest_path(self.path)
        if run.manifest is None and mpath.exists():
            try:
                run.manifest = manifest_decoder.decode(mpath.read_bytes())
            except (msgspec.DecodeError, msgspec.ValidationError, OSError) as e:
                self.note_problem(f"{mpath}: not a valid fsdp-doctor manifest ({_short(e)})")
        new = 0
        for rank, p in layout.streams(self.path).items():
            if rank not in self._streams:
                self._streams[rank] = StreamReader(p)
        for rank, sr in sorted(self._streams.items()):
            if rank in self._foreign:
                continue
            rd = run.ranks.setdefault(rank, RankData(rank=rank))
            for rec in sr.poll():
                rd.add(rec)
                new += 1
            for pr in sr.problems:
                self.note_problem(pr)
            why = self._foreign_reason(rank, rd)
            if why:
                self._foreign.add(rank)
                new -= len(rd.steps)
                del run.ranks[rank]
                self.note_problem(f"{sr.path.name}: {why}; skipped (a run directory holds one run)")
        return run, max(new, 0)

    def _foreign_reason(self, rank: int, rd: RankData) -> str:
        m = self.run.manifest
        if m is None:
            return ""
        if rank >= m.world_size:
            return f"rank {rank} is outside this run's {m.world_size} ranks ({layout.MANIFEST_NAME}): left from another run"
        h = rd.header
        if m.run_id and h is not None and h.run_id != m.run_id:
            return f"records of another run (run id {h.run_id or 'none'}, {layout.MANIFEST_NAME} says {m.run_id})"
        return ""

    def note_problem(self, msg: str) -> None:
        """Adds one line to ``run.problems``, once."""
        if msg not in self._reported:
            self._reported.add(msg)
            self.run.problems.append(msg)


def load_run(path: Path | str) -> Run:
    """Loads a run directory (records and profiler traces), a directory of plain Kineto traces, or one
    trace file. Problems with individual files are collected in ``run.problems``; a path that does not
    exist raises ``FileNotFoundError`` with one clear sentence."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file or directory")
    if p.is_file():
        return Run(path=p.parent, trace_files=[p])
    follower = RunFollower(p)
    run, _ = follower.poll()
    for rank, sr in follower._streams.items():
        if sr.trailing_bytes():
            run.problems.append(
                f"{sr.path.name}: last record is incomplete ({sr.trailing_bytes()} bytes, the run was "
                "cut off mid-write); every complete step before it is used"
            )
    run.trace_files = run_trace_files(run, run.problems)
    return run


def run_trace_files(run: Run, problems: list[str] | None = None) -> list[Path]:
    """The Kineto traces that belong to ``run``: every trace file under its directory, except profiler
    windows of another run (a trace in ``profiler/`` of a run with a run id that no accepted rank recorded
    and that is older than the run, or of a rank outside it), each named once in ``problems``."""
    from ..trace import find_trace_files

    p = Path(run.path)
    found = find_trace_files(p)
    m = run.manifest
    if m is None or not m.run_id or not run.ranks:
        return found
    pdir = layout.profiler_dir(p).resolve()
    recorded = {(p / pw.path).resolve() for rd in run.ranks.values() for pw in rd.profiles}
    out = []
    for f in found:
        rf = f.resolve()
        if rf.parent != pdir or rf in recorded:
            out.append(f)
            continue
        rank = layout.trace_rank(f)
        try:
            fresh = f.stat().st_mtime_ns >= m.started_ns
        except OSError:
            fresh = False
        if rank in run.ranks and fresh:
            out.append(f)  # written by this run, its record not (yet) there: a window being saved, or cut off
        elif problems is not None:
            problems.append(f"{layout.PROFILER_DIR}/{f.name}: a profiler window of another run (not recorded by "
                            f"run {m.run_id}); skipped")
    return out
