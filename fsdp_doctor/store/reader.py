"""Reader: loads a run directory into the shared model, or follows it while it grows."""

from __future__ import annotations

import fnmatch
import statistics

from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from . import layout
from ..units import RUN_END_TAIL, ranks_phrase
from ..records import (
    FORMAT_NAME,
    FORMAT_VERSION,
    DoctorError,
    End,
    GpuTimes,
    Header,
    Manifest,
    ProfileWindow,
    RunConfig,
    StepRecord,
    collective_wait_ms,
    manifest_decoder,
    record_decoder,
)


class RunRefused(ValueError):
    """A run directory this version cannot read at all; ``str()`` is one line naming the file and why."""


@dataclass
class RankData:
    """Everything one rank recorded."""

    rank: int
    header: Header | None = None
    config: RunConfig | None = None
    steps: list[StepRecord] = field(default_factory=list)
    profiles: list[ProfileWindow] = field(default_factory=list)
    lost_profiles: list[ProfileWindow] = field(default_factory=list)  # windows whose trace was not saved
    errors: list[DoctorError] = field(default_factory=list)
    end: End | None = None
    gpu: dict[int, GpuTimes] = field(default_factory=dict)  # step -> device-side times (CUDA only)

    def add(self, rec) -> None:
        if isinstance(rec, StepRecord):
            self.steps.append(rec)
        elif isinstance(rec, RunConfig):
            self.config = rec
        elif isinstance(rec, ProfileWindow):
            (self.lost_profiles if rec.lost else self.profiles).append(rec)
        elif isinstance(rec, DoctorError):
            self.errors.append(rec)
        elif isinstance(rec, Header):
            self.header = rec
        elif isinstance(rec, End):
            self.end = rec
        elif isinstance(rec, GpuTimes):
            self.gpu[rec.step] = rec


#: the last step of a steps window that runs to the end of the run (``analyze --steps FIRST-``)
STEPS_END = 1 << 62


def window_words(window: tuple[int, int]) -> str:
    """A steps window in words: "steps 20-39", "steps 20 to the end"."""
    lo, hi = window
    return f"steps {lo}-{hi}" if hi < STEPS_END else f"steps {lo} to the end"


@dataclass
class Run:
    """A run as the analyses see it: the same model whether it was just recorded or read from disk."""

    path: Path
    manifest: Manifest | None = None
    ranks: dict[int, RankData] = field(default_factory=dict)
    trace_files: list[Path] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # one line each: the file and what is wrong
    refused: str = ""  # one line: why nothing here can be read (a manifest of another format or a newer version)
    # ranks whose record stream is there but holds no record that could be read (unreadable, or not records): not
    # analysed, never "did not finish"; their profiler windows of this run are analysed all the same
    unread: set[int] = field(default_factory=set)
    # trace files found and left out before analysis (unreadable, another run's, a window its rank never completed),
    # each named in ``problems``: the header counts them as it counts those the trace analysis skips (another run's
    # traces in profiler/ read "2 trace files" alone, beside "2 left out" for the same traces one folder up: a
    # new-user trial)
    trace_files_left_out: int = 0
    # ranks whose stream ends in the middle of a record: a write of the doctor's failed there (a full disk), which a
    # killed process does not leave (each record is one write)
    records_cut: set[int] = field(default_factory=set)
    # one line each: how what was read is to be taken, no problem (a run still being written: load_run)
    notes: list[str] = field(default_factory=list)
    # the recorded steps analysed where only some are (pipeline.window_run: ``analyze --steps``, the dashboard's
    # step filter), inclusive; None: all of them
    steps_window: tuple[int, int] | None = None

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
    killed mid-write); the lines of a poll that do not decode are skipped and reported in one line, by file,
    count and the first one's line number (a file of random bytes gave one line per line of it, 147 of them).
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.offset = 0
        self.line_no = 0
        self.problems: list[str] = []
        self.decoded = 0  # records decoded (before any check)
        self.bad_lines = 0  # lines that did not decode
        self.bad_problems: list[str] = []  # the lines of ``problems`` that report them
        self.first_bad = ""  # "line N (why)" of the first
        self.unreadable = False  # the file could not be opened or read (named in ``problems``)
        self.refused = False  # its header is of another format or a newer version (named in ``problems``)
        self.torn = 0  # bytes the last poll read after the last line end (what ``trailing_bytes`` reports)

    def poll(self) -> list:
        if self.offset >= 1 << 62:  # stopped (a newer version, or not a regular file)
            self.torn = 0
            return []
        try:
            with layout.open_regular(self.path) as f:
                f.seek(self.offset)
                data = f.read()
        except OSError as e:
            self.problems.append(f"{self.path.name}: cannot read ({e.strerror or e}); skipped")
            self.offset = 1 << 62
            self.unreadable = True
            self.torn = 0
            return []
        end = data.rfind(b"\n")
        self.torn = len(data) - (end + 1)
        if end < 0:
            return []
        chunk = data[: end + 1]
        self.offset += len(chunk)
        out = []
        bad: list[tuple[int, str]] = []
        try:
            for line in chunk.splitlines():
                self.line_no += 1
                if not line.strip():
                    continue
                try:
                    rec = record_decoder.decode(line)
                except (msgspec.DecodeError, msgspec.ValidationError) as e:
                    bad.append((self.line_no, _short(e)))
                    continue
                self.decoded += 1
                why = _header_refusal(rec) if isinstance(rec, Header) else ""
                if why:
                    self.problems.append(f"{self.path.name}: {why}; skipped")
                    self.refused = True
                    self.offset = 1 << 62  # stop reading this stream
                    self.torn = 0
                    return out
                out.append(rec)
            return out
        finally:
            self._note_bad(bad)

    def _note_bad(self, bad: list[tuple[int, str]]) -> None:
        """One line for the lines of a poll that did not decode."""
        if not bad:
            return
        self.bad_lines += len(bad)
        if not self.first_bad:
            self.first_bad = f"line {bad[0][0]}: {bad[0][1]}"
        if len(bad) == 1:
            msg = f"{self.path.name}: line {bad[0][0]} is not a valid record ({bad[0][1]}); skipped"
        else:
            nums = ", ".join(str(n) for n, _ in bad[:5]) + (", …" if len(bad) > 5 else "")
            msg = (f"{self.path.name}: {len(bad)} lines are not valid records (lines {nums}; first: line {bad[0][0]}, "
                   f"{bad[0][1]}); skipped")
        self.problems.append(msg)
        self.bad_problems.append(msg)

    def trailing_bytes(self) -> int:
        """Bytes the last poll read after the last complete line (a record cut short by a kill). Only what the poll
        itself read counts, never the file's size now: records appended to a run still writing after the poll read
        it were named "incomplete" (a new-user trial: 2 of 12 analyses of a live run exited 3 on "last record is
        incomplete (1346 bytes ...)", exactly one whole step record written after the read)."""
        return self.torn


def _format_version(x: Header | Manifest) -> tuple[str, int]:
    """The format and version a header or manifest is written in: a file without them (written before they were)
    is version 1 of FORMAT_NAME."""
    return (FORMAT_NAME if x.format is None else x.format), (1 if x.version is None else x.version)


def _header_refusal(h: Header) -> str:
    """Why a stream with this header cannot be read ("" when it can)."""
    fmt, version = _format_version(h)
    if fmt != FORMAT_NAME:
        return f"format {fmt!r} is not an fsdp-doctor record stream ({FORMAT_NAME!r})"
    if version > FORMAT_VERSION:
        return (f"record format version {version} is newer than this fsdp-doctor reads ({FORMAT_VERSION}); "
                "upgrade fsdp-doctor")
    return ""


def _manifest_refusal(m: Manifest) -> str:
    """Why a run directory with this manifest cannot be read at all ("" when it can)."""
    fmt, version = _format_version(m)
    if fmt != FORMAT_NAME:
        return f"format {fmt!r} is not an fsdp-doctor run ({FORMAT_NAME!r})"
    if version > FORMAT_VERSION or version < 1:
        return (f"format version {version} is not one this fsdp-doctor reads (1 to {FORMAT_VERSION})"
                + ("; upgrade fsdp-doctor" if version > FORMAT_VERSION else ""))
    return ""


# a step time beyond this is no measurement (ms): a day
MAX_STEP_MS = 86_400_000.0
_STEP_TIMES = ("wall_ms", "forward_ms", "backward_ms", "optimizer_ms", "gc_ms")


def _implausible_step(rec: StepRecord) -> str:
    """Why a step record's times cannot be true ("" when they can)."""
    for f in _STEP_TIMES:
        v = getattr(rec, f)
        if not (0.0 <= v <= MAX_STEP_MS):  # NaN included
            return f"{f} {v!r}"
    return ""


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
        self._seen_steps: dict[str, set[int]] = {}
        self._run_id = ""  # without a manifest: the run id of the first stream read (the lowest rank's)

    def poll(self) -> tuple[Run, int]:
        """Reads new records; returns the run and how many records were new. Streams of another run (their
        header's run id differs from the manifest's, or their rank is outside the manifest's world size) are
        never mixed in: each is named once in ``run.problems`` and left unread."""
        run = self.run
        mpath = layout.manifest_path(self.path)
        if run.manifest is None and (mpath.exists() or mpath.is_symlink()):
            self._read_manifest(mpath)
        if run.refused:
            return run, 0
        new = 0
        for rank, p in layout.streams(self.path).items():
            if rank not in self._streams:
                self._streams[rank] = StreamReader(p)
        for rank, sr in sorted(self._streams.items()):
            if rank in self._foreign:
                continue
            rd = run.ranks.setdefault(rank, RankData(rank=rank))
            for rec in self._checked(sr, sr.poll()):
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
        if new:
            _mark_others_saved(run)
            _mark_others_compiled(run)
        return run, max(new, 0)

    def _read_manifest(self, mpath: Path) -> None:
        name = layout.MANIFEST_NAME
        try:
            data = layout.read_regular(mpath)
            m = manifest_decoder.decode(data)
        except OSError as e:
            self.note_problem(f"{name}: cannot read ({e.strerror or e}); the streams are read without it")
            return
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            # the typed decoder stops at the first field of the wrong type: a manifest cut short after '{"format": 3'
            # read "Expected `str`, got `int`" (a new-user trial); where the JSON itself is broken, that is said
            try:
                msgspec.json.decode(data)
                what = "not a valid fsdp-doctor manifest"
            except msgspec.DecodeError as j:
                what, e = "not valid JSON", j
            self.note_problem(f"{name}: {what} ({_short(e)}); the streams are read without it")
            return
        why = _manifest_refusal(m)
        if why:
            self.run.refused = f"{self.path / name}: {why}"
            self.note_problem(self.run.refused)
        elif m.world_size < 1:
            self.note_problem(f"{name}: world size {m.world_size} is not valid; the manifest is ignored and the "
                              "streams are told apart by their headers' run ids")
        else:
            self.run.manifest = m

    def _checked(self, sr: StreamReader, records: list) -> list:
        """The records of one poll that can be used: a step recorded twice (its later copy) or with impossible
        times is named and left out; a config's world size below 1 is named and not used."""
        seen = self._seen_steps.setdefault(sr.path.name, set())
        out, dup, bad = [], [], []
        for rec in records:
            if isinstance(rec, StepRecord):
                why = _implausible_step(rec)
                if why:
                    bad.append(f"step {rec.step} ({why})")
                    continue
                if rec.step in seen:
                    dup.append(rec.step)
                    continue
                seen.add(rec.step)
            elif isinstance(rec, RunConfig) and rec.world_size < 1:
                self.note_problem(f"{sr.path.name}: configuration with world size {rec.world_size}; not used "
                                  "(the run's world size comes from the manifest or the streams)")
                rec = msgspec.structs.replace(rec, world_size=max(1, len(self._streams)))
            out.append(rec)
        if dup:
            more = f" and {len(dup) - 3} more" if len(dup) > 3 else ""
            self.note_problem(f"{sr.path.name}: {len(dup)} step record(s) repeated (step "
                              f"{', '.join(map(str, dup[:3]))}{more}); the repeats are skipped, never counted twice")
        if bad:
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            self.note_problem(f"{sr.path.name}: {len(bad)} step record(s) with impossible times "
                              f"({'; '.join(bad[:3])}{more}); skipped")
        return out

    def _foreign_reason(self, rank: int, rd: RankData) -> str:
        m = self.run.manifest
        if m is None:
            h = rd.header
            if h is None or not h.run_id:
                return ""
            if not self._run_id:
                self._run_id = h.run_id
                return ""
            if h.run_id != self._run_id:
                return (f"records of another run (run id {h.run_id}; the lowest rank's stream is run {self._run_id}, "
                        f"and there is no {layout.MANIFEST_NAME} to say which is this directory's)")
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


def _mark_others_saved(run: Run) -> None:
    """``StepRecord.others_saved`` on each rank's steps in which another rank saved a checkpoint and this one did
    not: a save on rank 0 only is a step of the whole job (the others wait for it), which the other ranks' statistics
    kept (a new-user trial's rank 1: p50 371.7 ms against rank 0's 228.3 ms, its save steps' waits in them)."""
    saved = {s.step for rd in run.ranks.values() for s in rd.steps if s.checkpoints}
    for rd in run.ranks.values():
        for s in rd.steps:
            s.others_saved = s.step in saved and not s.checkpoints


#: a step after another rank's compile step waited for it when its collective wait is above the rank's median by this
#: share of its median step
COMPILE_WAIT_SHARE = 0.25


def _mark_others_compiled(run: Run) -> None:
    """``StepRecord.others_compiled`` on each rank's steps that did not compile where another rank compiled: in the
    same step (the others wait for it in its collectives), or in the step before, where this step's collective
    wait is above the rank's median by a quarter of its median step (the compiling rank arrived late at this step's
    first all-gather). A new-user trial's compiled optimizer step: rank 1 compiled ~1.1 s longer in step 0, and
    rank 0's step 1 read "all-gather wait +1092.3 ms", kept in its statistics (p99 1107.7 ms, cv 186%)."""
    compiled = {r: {s.step for s in rd.steps if s.compiles} for r, rd in run.ranks.items()}
    for r, rd in run.ranks.items():
        others = set().union(*(st for r2, st in compiled.items() if r2 != r))
        if not others or not rd.steps:
            continue
        waits = {s.step: collective_wait_ms(s) for s in rd.steps}
        late = statistics.median(waits.values()) + COMPILE_WAIT_SHARE * statistics.median(s.wall_ms for s in rd.steps)
        for s in rd.steps:
            s.others_compiled = not s.compiles and (
                s.step in others or (s.step - 1 in others and waits[s.step] > late))


def load_run(path: Path | str) -> Run:
    """Loads a run directory (records and profiler traces), a directory of plain Kineto traces, or one
    trace file. Problems with individual files are collected in ``run.problems``; a path that does not
    exist raises ``FileNotFoundError`` with one clear sentence."""
    p = Path(path)
    if not p.exists():
        # (a link that loops or points nowhere is named so, as inside a folder: a self-link given alone read "no such
        # file or directory", a new-user trial)
        why = layout.not_readable(p) if p.is_symlink() else ""
        raise FileNotFoundError(f"{p}: {why if why else 'no such file or directory'}")
    if not p.is_dir():
        if fnmatch.fnmatch(p.name, layout.STREAM_GLOB) or p.name == layout.MANIFEST_NAME:
            # (read as a trace: "invalid JSON (... trailing characters)" and "not a Kineto trace", a new-user trial)
            what = "one rank's fsdp-doctor records" if p.name != layout.MANIFEST_NAME else "a run's manifest"
            raise RunRefused(f"{p}: {what}, not a trace: give the run directory, {p.parent}")
        return Run(path=p.parent, trace_files=[p])
    follower = RunFollower(p)
    run, _ = follower.poll()
    if run.refused:
        raise RunRefused(run.refused)
    going = _still_going(run)
    lines, replaced, unread = closing_problems(follower, run, going=going)
    run.problems[:] = [q for q in run.problems if q not in replaced] + lines
    for rank in unread:
        run.ranks.pop(rank, None)
        run.unread.add(rank)
    said = len(run.problems)
    run.trace_files = run_trace_files(run, run.problems)
    run.trace_files_left_out = len(run.problems) - said  # (one line per file left out)
    _leave_out_unfinished_windows(run)
    run.records_cut = set(_cut_bytes(follower))
    if going:
        run.notes.append(_still_going_note(run))
    if note := previous_runs_note(p):
        run.notes.append(note)
    return run


def previous_runs_note(run_dir: Path) -> str:
    """"earlier runs started in this folder are kept below it: previous/run-3f2a..., previous/run-9c1d... (watch()
    moved each aside when the next started): fsdp-doctor analyze one of them"; "" where there is none."""
    kept = layout.previous_runs(run_dir)
    if not kept:
        return ""
    names = [f"{layout.PREVIOUS_DIR}/{q.name}" for q in kept]
    said = ", ".join(names[-3:]) + (f" and {len(names) - 3} older" if len(names) > 3 else "")
    return (f"{'an earlier run' if len(kept) == 1 else f'{len(kept)} earlier runs'} started in this folder "
            f"{'is' if len(kept) == 1 else 'are'} kept below it, {said} (watch() moves a run aside when another "
            f"starts there): fsdp-doctor analyze {'it' if len(kept) == 1 else 'one of them'} there")


def closing_problems(follower: "RunFollower", run: Run, going: bool = False) -> tuple[list[str], set[str], set[int]]:
    """What the record streams of a run that stopped writing say beyond their records: (one line each, the lines
    those replace, the ranks not analysed). An empty or unreadable stream (its rank not analysed, never "did not
    finish": a file of random bytes was said to be a rank that was killed; nor one refused for its format or version),
    a rank the manifest lists without a stream, and how the ranks stopped where not every one finished
    (``run_end_line``; not where the run is still ``going``). ``load_run`` applies them; the dashboard shows them once
    the run is no longer live (it showed none of them: a new-user trial). Reads only."""
    lines: list[str] = []
    replaced: set[str] = set()
    unread: set[int] = set()
    for rank, sr in follower._streams.items():
        rd = run.ranks.get(rank)
        if rd is not None and sr.refused:  # (named already; read as a rank that "did not finish", a new-user trial)
            unread.add(rank)
            continue
        if rd is not None and sr.offset == 0 and not sr.trailing_bytes():
            lines.append(f"{sr.path.name}: empty (no records); skipped")
            unread.add(rank)
        elif rd is not None and not sr.decoded and (sr.unreadable or sr.offset < 1 << 62):
            # one line for the file, its lines' own folded into it (one that cannot be opened is named already)
            if not sr.unreadable:
                replaced |= set(sr.bad_problems)
                lines.append(_unreadable_stream(sr, rank))
            unread.add(rank)
            continue
    for rank in missing_stream_ranks(run):
        lines.append(f"{layout.stream_name(rank)}: listed in {layout.MANIFEST_NAME} but missing: rank {rank} is not "
                     "analysed (its records were deleted or never copied, or watch() ran on some ranks only)")
    if not going and (said := run_end_line(run, _cut_bytes(follower), unread)):
        lines.append(said)
    return lines, replaced, unread


def _cut_bytes(follower: "RunFollower") -> dict[int, int]:
    """Per rank whose stream the last poll read to the middle of a record: the bytes after its last line end."""
    return {rank: sr.trailing_bytes() for rank, sr in follower._streams.items() if sr.trailing_bytes()}


def _unreadable_stream(sr: StreamReader, rank: int) -> str:
    """The one line for a record stream of which no line is a record."""
    tail = sr.trailing_bytes()
    if sr.bad_lines:
        lines = f"{sr.bad_lines} line{'s' * (sr.bad_lines != 1)}"
        what = (f"no valid record in it ({lines} that are not records, the first {sr.first_bad})"
                + (f", and {tail:,} bytes after its last line end" if tail else ""))
    elif not tail:
        return f"{sr.path.name}: empty (no records, blank lines only); skipped"
    else:
        what = f"no complete record ({tail:,} bytes without a line end: cut off in its first record, or not records)"
    return (f"{sr.path.name}: unreadable: {what}; it is not fsdp-doctor records, or is damaged: rank {rank} is not "
            "analysed")


def _leave_out_unfinished_windows(run: Run) -> None:
    """A profiler window saved while its rank was failing (the doctor saves what was recorded when training
    raises, e.g. on a collective error after another rank died) holds a step the rank never completed: it is
    left out and named, never analysed as a complete step. So are windows the records list but whose file is
    missing."""
    drop = set()
    for r, rd in sorted(run.ranks.items()):
        done = {s.step for s in rd.steps}
        for pw in rd.lost_profiles:  # (said during training only, before: a new-user trial's full 80 KiB disk)
            run.problems.append(f"{pw.path}: the profiler window of rank {r} at steps {_span(pw.steps)} was not saved "
                                f"({pw.lost})")
        for pw in rd.profiles:
            f = (run.path / pw.path)
            gone = _missing(f)
            if gone is None:  # cannot tell (its folder cannot be read): named by ``run_trace_files``, not analysed
                continue
            if gone:
                run.problems.append(f"{pw.path}: the profiler window of rank {r}, steps {_span(pw.steps)}, is listed "
                                    "in its records but the file is missing; not analysed")
                continue
            unfinished = [n for n in pw.steps if n not in done]
            if unfinished and rd.steps:
                drop.add(f.resolve())
                run.problems.append(f"{pw.path}: rank {r} never completed step {_span(unfinished)} of this profiler "
                                    "window (it ended in an error: a collective failed, or a rank was killed); "
                                    "not analysed")
    if drop:
        kept = [f for f in run.trace_files if f.resolve() not in drop]
        run.trace_files_left_out += len(run.trace_files) - len(kept)
        run.trace_files = kept


def _missing(f: Path) -> bool | None:
    """Whether ``f`` is gone (no file, no link); None when that cannot be told (a folder on its way that cannot be
    searched: ``Path.exists`` raised PermissionError there, and one unreadable ``profiler/`` lost the whole run)."""
    import errno
    import os

    try:
        os.lstat(f)
    except OSError as e:
        return True if e.errno in (errno.ENOENT, errno.ENOTDIR) else None
    return False


def _span(steps: list[int]) -> str:
    return str(steps[0]) if len(steps) == 1 else f"{min(steps)}–{max(steps)}"


#: how a rank's stream ended, in the order ranks stopped after the same step: without an end record (a rank killed
#: writes none: before one whose end record holds the error that followed), on an exception, normally
_STOP_ORDER = {"killed": 0, "cut": 0, "raised": 1, "finished": 2}


def _last_step(rd: RankData) -> int:
    """The last step the rank recorded (-1: none)."""
    return max((s.step for s in rd.steps), default=-1)


def run_end_line(run: Run, cut: dict[int, int], leave_out=frozenset()) -> str:
    """How the run ended where not every rank finished, in one line ("" where every rank did): each rank's last
    recorded step and how it stopped (on the exception of its end record; without an end record: killed, or hung;
    its records cut in the middle of one, ``cut`` giving the bytes after its last line end: a write of the doctor's
    failed there, and the rank may have trained on), the one that stopped first named first and the others' errors
    said to follow from it. The one telling of it: the problems carry it, every presenter shows it as it is (the
    header said "rank 1 did not finish (run still going, or killed)" with no step, "run still going" though rank 0's
    end record held the job's error, and the JSON nothing: a new-user trial). ``leave_out``: ranks not analysed."""
    ranks = {r: rd for r, rd in run.ranks.items() if r not in leave_out}
    if all(rd.end is not None and not rd.end.exception for rd in ranks.values()) or not any(
            rd.steps for rd in ranks.values()):  # (no step: nothing analysed, pipeline.unusable_reason says why)
        return ""
    stops = []  # (last step, how, detail, end time, rank)
    for r, rd in ranks.items():
        last = _last_step(rd)
        if rd.end is not None:
            how, detail = ("raised", _one_line(rd.end.exception)) if rd.end.exception else ("finished", "")
        else:
            how, detail = ("cut", f"{cut[r]:,} bytes at the end of {layout.stream_name(r)}") if r in cut else (
                "killed", "")
        stops.append((last, how, detail, rd.end.ended_ns if rd.end is not None else 0, r))
    stops.sort(key=lambda s: (s[0], _STOP_ORDER[s[1]], s[3], s[4]))
    groups: list[tuple[tuple, list]] = []  # ((last step, how, detail), its stops), in the order they stopped
    for s in stops:
        if groups and groups[-1][0] == s[:3]:
            groups[-1][1].append(s)
        else:
            groups.append((s[:3], [s]))
    (last0, how0, _), _ = groups[0]
    first = len(groups) > 1 and how0 in ("killed", "raised") and (
        (last0, _STOP_ORDER[how0]) < (groups[1][0][0], _STOP_ORDER[groups[1][0][1]]) or groups[1][0][1] == "raised")
    cuts = [i for i, ((_, how, _), _) in enumerate(groups) if how == "cut"]
    clauses = []
    for i, ((last, how, detail), group) in enumerate(groups):
        who = ranks_phrase(s[4] for s in group)
        at = f"after step {last}" if last >= 0 else f"before {'their' if len(group) > 1 else 'its'} first step"
        if how == "finished":
            clauses.append(f"{who} finished {at}")
        elif how == "cut":  # (the cause once, after the last)
            clauses.append(f"{who}'s records stop {at} in the middle of a record ({detail})" + (
                f": a write of the doctor's failed there (a full disk?), the rank{'s' * (len(cuts) > 1)} may have "
                "trained on" if i == cuts[-1] else ""))
        else:
            what = "without an end record (killed, or hung)" if how == "killed" else f"on {detail}"
            if i == 0 and first:
                then = groups[1][1]
                ahead = (f" ({round((then[0][3] - group[-1][3]) / 1e6, 1):g} ms before "
                         f"{ranks_phrase(s[4] for s in then)})"
                         if how == then[0][1] == "raised" and then[0][3] > group[-1][3] else "")
                clauses.append(f"{who} stopped first, {at}, {what}{ahead}")
            else:
                clauses.append(f"{who} stopped {at} {what}" + (", likely following from it" if first else ""))
    return "; ".join(clauses) + RUN_END_TAIL


def _one_line(message: str, most: int = 160) -> str:
    """An exception's message on one line of at most ``most`` characters, without its own full stop."""
    one = " ".join(message.split()).rstrip(". ")
    return one if len(one) <= most else one[: most - 1] + "…"


#: a run none of whose ranks has ended is still going while its newest record is younger than this, or than 10 of its
#: slowest steps if longer (a rank killed, or the whole job, writes no end record)
STALE_S = 120.0
#: where a rank has ended normally, the others write their end records within this long (seconds)
LIVE_WRITE_S = 5.0


def still_going(idle_s: float, slowest_step_ms: float, some_ended: bool = False, apart: int = 0) -> bool:
    """Whether a run whose ranks have not all ended, none on an exception (an end record with one: the run is not
    live), is being written: its newest record ``idle_s`` seconds old, its ranks' last steps ``apart`` steps apart
    (more than one: a rank stopped, as FSDP's ranks meet in every step's collectives; one: a run read one stream
    after the other while it writes, which read "rank 0 stopped first ... it died or hung", exit 3, in 1 of a
    new-user trial's 12 analyses of a live run). The one rule of ``analyze`` and the dashboard (which said "live" for
    two minutes after torchrun exited, rank 0's end record holding the job's error: a new-user trial)."""
    return apart <= 1 and idle_s < (LIVE_WRITE_S if some_ended else max(STALE_S, 10 * slowest_step_ms / 1e3))


def _still_going(run: Run) -> bool:
    """``still_going`` of a run read now: the ranks that began (a header or a step), its streams' newest write."""
    import time

    ends = [rd.end for rd in run.ranks.values() if rd.header is not None or rd.steps]
    if not ends or all(e is not None for e in ends) or any(e is not None and e.exception for e in ends):
        return False
    try:
        newest = max((Path(run.path) / layout.stream_name(r)).stat().st_mtime for r in run.ranks)
    except (OSError, TypeError):
        return False
    slowest = max((s.wall_ms for rd in run.ranks.values() for s in rd.steps), default=0.0)
    lasts = [_last_step(rd) for rd in run.ranks.values() if rd.steps]
    return still_going(time.time() - newest, slowest, any(e is not None for e in ends),
                       max(lasts, default=0) - min(lasts, default=0))


def _still_going_note(run: Run) -> str:
    """The note on a run still being written: each rank's last recorded step."""
    by: dict[int, list[int]] = {}
    for r, rd in sorted(run.ranks.items()):
        if rd.steps:
            by.setdefault(_last_step(rd), []).append(r)
    lasts = ", ".join(f"step {n} on {ranks_phrase(rs)}" for n, rs in sorted(by.items()))
    return f"the run is still going (no rank has ended; last records: {lasts or 'no step yet'})"


def missing_stream_ranks(run: Run) -> list[int]:
    """The ranks whose record stream the manifest lists but the directory lacks."""
    m = run.manifest
    if m is None or not run.path:
        return []
    listed = [r for r in (layout.stream_rank(n) for n in m.streams) if r is not None]
    return sorted(r for r in listed if r not in run.ranks and not (Path(run.path) / layout.stream_name(r)).exists())


def run_trace_files(run: Run, problems: list[str] | None = None) -> list[Path]:
    """The Kineto traces that belong to ``run``: every trace file under its directory, except profiler
    windows of another run (a trace in ``profiler/`` of a run with a run id that no accepted rank recorded
    and that is older than the run, or of a rank outside it), each named once in ``problems``."""
    p = Path(run.path)
    unreadable: list = []
    found = layout.find_trace_files(p, unreadable)
    if problems is not None:
        for q, why in unreadable:
            problems.append(f"{layout.relative_name(q, p)}: {why}; skipped")
    m = run.manifest
    if m is None or not m.run_id or not run.ranks:
        return found
    pdir = layout.profiler_dir(p).resolve()
    recorded = {(p / pw.path).resolve() for rd in run.ranks.values() for pw in rd.profiles}
    missing: list[int] | None = None  # read at the first trace not the run's, once (the dashboard polls this)
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
        if (rank in run.ranks or rank in run.unread) and fresh:
            out.append(f)  # written by this run, its record not (yet) there: a window being saved, or cut off
            continue
        if missing is None:
            missing = missing_stream_ranks(run)
        if problems is not None and fresh and rank in missing:
            problems.append(f"{layout.PROFILER_DIR}/{f.name}: a profiler window of rank {rank}, whose records "
                            f"({layout.stream_name(rank)}) are missing")
        elif problems is not None:
            problems.append(f"{layout.PROFILER_DIR}/{f.name}: a profiler window of another run (not recorded by "
                            f"run {m.run_id}); skipped")
    return out
