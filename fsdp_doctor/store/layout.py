"""The run directory's layout: the one module that knows which file is where. Everyone else asks it.

::

    manifest.json                                  the run manifest (format, version, run id, world size)
    rank{R}.records.jsonl                          one append-only record stream per rank
    profiler/rank{R}.{first_step}.pt.trace.json.gz Kineto traces of the profiled windows (TensorBoard layout)
    tb/rank{R}/events.out.tfevents.*               TensorBoard scalars (``fsdp-doctor tensorboard`` / the demo)
    report.json                                    the demo's saved report
    previous/run-{ID}/                             an earlier run's files, moved aside by a run started here (keep_run)

Where only some ranks of the process group train the watched model (its device mesh leaves the others out), the run
is those ranks' and lies in a folder of its own below ``out_dir``, named by them (``group_dir``: ``ranks2-3/``).

This module imports nothing from the rest of the package (the record schema imports it).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
from pathlib import Path
from typing import BinaryIO, Optional

MANIFEST_NAME = "manifest.json"
PROFILER_DIR = "profiler"
TB_DIR = "tb"
REPORT_NAME = "report.json"
PREVIOUS_DIR = "previous"
STREAM_GLOB = "rank*.records.jsonl"
# JSON files of a run directory that are not Kineto traces.
NON_TRACE_NAMES = frozenset({MANIFEST_NAME, REPORT_NAME})

_STREAM_RE = re.compile(r"^rank(\d+)\.records\.jsonl$")
_TRACE_RANK_RE = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)


def stream_name(rank: int) -> str:
    return f"rank{rank}.records.jsonl"


def group_dir(world_ranks: list[int]) -> str:
    """The folder below ``out_dir`` of the run of the process group's ``world_ranks`` where only they train:
    ``ranks2-3`` (a range), ``ranks0_2`` (others). Groups of one job that share ``out_dir`` number their ranks 0..n-1
    alike: in one folder, a new-user trial's two groups of 2 of 4 ranks wrote the same files, one group's overwrite
    wiped the other's and the report read 2 ranks."""
    r = sorted(world_ranks)
    return f"ranks{r[0]}-{r[-1]}" if r == list(range(r[0], r[-1] + 1)) else "ranks" + "_".join(map(str, r))


def runs_below(path: Path) -> list[Path]:
    """The folders right below ``path`` that hold record streams, where ``path`` itself holds none (sorted); []
    where ``path`` holds streams or is not a folder."""
    try:
        if not path.is_dir() or any(path.glob(STREAM_GLOB)):
            return []
        return sorted(d for d in path.iterdir() if d.is_dir() and any(d.glob(STREAM_GLOB)))
    except OSError:
        return []


def records_below(path: Path) -> Optional[Path]:
    """The one folder right below ``path`` that holds record streams, where ``path`` itself holds none: a
    framework's output folder with the doctor's records in a folder of their own (torchtitan's dump folder and its
    ``fsdp_doctor``; a new-user trial passed the dump folder and got a report of its profiler traces alone). None
    where ``path`` holds streams, is not a folder, or holds none or several such folders."""
    below = runs_below(path)
    return below[0] if len(below) == 1 else None


def stream_rank(name: str) -> Optional[int]:
    """The rank of a record stream's file name, None for any other file."""
    m = _STREAM_RE.match(name)
    return int(m.group(1)) if m else None


def streams(run_dir: Path | str) -> dict[int, Path]:
    """The record streams in a run directory, by rank."""
    p = Path(run_dir)
    if not p.is_dir():
        return {}
    out = {}
    for q in sorted(p.iterdir()):
        r = stream_rank(q.name)
        if r is not None:
            out[r] = q
    return out


def manifest_path(run_dir: Path | str) -> Path:
    return Path(run_dir) / MANIFEST_NAME


def profiler_dir(run_dir: Path | str) -> Path:
    return Path(run_dir) / PROFILER_DIR


def profiler_trace_name(rank: int, first_step: int) -> str:
    """A profiled window's trace, relative to the run directory (torch-tb-profiler's worker.span layout)."""
    return f"{PROFILER_DIR}/rank{rank}.{first_step}.pt.trace.json.gz"


def trace_rank(path: Path | str) -> Optional[int]:
    """The rank a trace file's name says (``rank3.12.pt.trace.json.gz``, ``host_rank-3...``), or None."""
    m = _TRACE_RANK_RE.search(Path(path).name)
    return int(m.group(1)) if m else None


def tb_dir(run_dir: Path | str, rank: int) -> Path:
    return Path(run_dir) / TB_DIR / f"rank{rank}"


def report_path(run_dir: Path | str) -> Path:
    return Path(run_dir) / REPORT_NAME


def is_trace_name(path: Path) -> bool:
    """A file name that can hold a Kineto trace (``*.json``, ``*.json.gz``), known run files excluded."""
    n = path.name
    if n in NON_TRACE_NAMES or n.endswith(".jsonl") or n.endswith(".tmp"):
        return False
    return n.endswith(".json") or n.endswith(".json.gz")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: Path | str) -> BinaryIO:
    """``path`` opened for reading in binary mode, only if it is a regular file (after symlinks): a FIFO, a
    socket or a device would block or never end. Raises OSError whose ``strerror`` is one short phrase
    ("not a regular file (a FIFO)", "symlink loop", ...). The open itself never blocks (O_NONBLOCK)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OSError(e.errno, "symlink loop", str(path)) from None
        if e.errno == errno.ENOENT and os.path.islink(path):
            raise OSError(e.errno, "dangling symlink", str(path)) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, f"not a regular file ({_kind(mode)})", str(path))
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: Path | str) -> bytes:
    """The bytes of a regular file (see :func:`open_regular`)."""
    with open_regular(path) as f:
        return f.read()


def find_trace_files(path: Path | str, problems: Optional[list[tuple[Path, str]]] = None) -> list[Path]:
    """Kineto trace files at ``path``: the file itself, or ``*.json`` / ``*.json.gz`` found recursively under a
    directory (symlinked folders followed once; TensorBoard plugin layout and the ``profiler/`` folder
    included), sorted. Known non-trace JSON (``manifest.json``, ``report.json``, ``*.jsonl``, the doctor's own
    ``--json`` outputs under any name) is left out, and so are earlier runs moved aside below a run's folder
    (``previous/``: ``keep_run``).
    What cannot be read (an unreadable folder, a dangling or looping symlink, a FIFO or other non-regular
    file with a trace's name) is added to ``problems`` as (path, why) and left out, never silently.
    Raises FileNotFoundError for a missing path."""
    p = Path(path)
    problems = [] if problems is None else problems
    if not p.exists() and not p.is_symlink():
        raise FileNotFoundError(f"{p}: no such file or directory")
    if not p.is_dir():
        why = not_readable(p)
        if why:
            problems.append((p, why))
            return []
        return [p]
    found: list[Path] = []
    seen: set[str] = set()

    def walk(d: Path) -> None:
        real = os.path.realpath(d)
        if real in seen:
            problems.append((d, "a folder already read (a symlink loop, or a second link to it); not read again"))
            return
        seen.add(real)
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError as e:
            problems.append((d, f"cannot read folder ({e.strerror or e})"))
            return
        for e in entries:
            q = Path(e.path)
            try:
                is_dir = e.is_dir()  # follows symlinks
            except OSError:
                is_dir = False
            if is_dir:
                if e.name == PREVIOUS_DIR and has_run(d):  # (earlier runs moved aside: keep_run; not this one's)
                    continue
                walk(q)
            elif is_trace_name(q):
                why = not_readable(q)
                if why:
                    problems.append((q, why))
                elif not is_doctor_json(q):
                    found.append(q)

    walk(p)
    return sorted(found)


# what the doctor's own JSON outputs (analyze --json, compare --json) begin with: their schema
_DOCTOR_JSON = re.compile(rb'\A\s*\{\s*"schema"\s*:\s*"fsdp-doctor-')


def is_doctor_json(p: Path) -> bool:
    """A ``*.json`` the doctor wrote (``analyze --json`` or ``compare --json``, under any name: a report saved into
    the run folder as analysis.json was read as a trace, "not a Kineto trace", and the next analyze exited 3)."""
    if not p.name.endswith(".json"):
        return False
    try:
        with open_regular(p) as f:
            return bool(_DOCTOR_JSON.match(f.read(256)))
    except OSError:
        return False


def not_readable(p: Path) -> str:
    """Why ``p`` cannot be opened as a regular file ("" when it can), without opening it."""
    try:
        st = os.stat(p)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "symlink loop"
        if os.path.islink(p):
            return "dangling symlink"
        return e.strerror or str(e)
    if not stat.S_ISREG(st.st_mode):
        return f"not a regular file ({_kind(st.st_mode)})"
    if not os.access(p, os.R_OK):
        return "permission denied"
    return ""


def relative_name(q: Path, root: Path) -> str:
    """``q`` as named under ``root`` (the run directory): relative where it lies inside it, else as it is."""
    try:
        return str(Path(q).relative_to(root))
    except ValueError:
        return str(q)


def unreadable_folder(path: Path | str) -> str:
    """Why the folder ``path`` cannot be read ("" when it can, or when it is no folder): its list of files
    (no read permission), or the files themselves (no search permission: the list reads, every file in it fails)."""
    p = str(path)
    try:
        if not stat.S_ISDIR(os.stat(p).st_mode):
            return ""
        with os.scandir(p) as it:
            first = next(it, None)
    except FileNotFoundError:
        return ""
    except OSError as e:
        return f"cannot read folder ({e.strerror or e})"
    try:
        if first is not None:
            os.lstat(first.path)
        elif not os.access(p, os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
    except OSError as e:
        return f"cannot open the files in the folder ({e.strerror or e}: it lacks search (x) permission)"
    return ""


def has_run(run_dir: Path | str) -> bool:
    """True when ``run_dir`` already holds a run's records (a manifest or a record stream)."""
    p = Path(run_dir)
    return p.is_dir() and (manifest_path(p).exists() or bool(streams(p)))


def clear_run(run_dir: Path | str) -> list[Path]:
    """Removes a previous run's files from ``run_dir`` (manifest, record streams, profiler traces, TensorBoard
    scalars, saved report), nothing else. Returns what was removed."""
    p = Path(run_dir)
    gone: list[Path] = []
    for q in [manifest_path(p), report_path(p), *streams(p).values()]:
        if q.is_file():
            q.unlink(missing_ok=True)  # (gone between the two: another process's)
            gone.append(q)
    for d in (profiler_dir(p), p / TB_DIR):
        if d.is_dir() and not d.is_symlink():
            shutil.rmtree(d)
            gone.append(d)
    return gone


def keep_run(run_dir: Path | str, rank: int, into: Optional[str] = None) -> Optional[Path]:
    """Moves an earlier run's files out of the way of a run starting in ``run_dir``, into
    ``previous/run-{its id}/`` below it, and returns that folder (None where there was nothing of it to move here):
    rank 0 moves the manifest, the saved report, the profiler traces, the TensorBoard scalars and every record
    stream, any other rank its own stream (one left where rank 0 cannot see it: another node's disk). A restarted
    job (torchrun --max-restarts) watched into the folder of its crashed attempt was refused, which ended the
    restart, or with overwrite wiped the records that said how the attempt ended (a new-user trial). The earlier
    run reads as it did, from its new folder. ``into``: the name of the folder rank 0 moved that run's files to (another
    rank's stream joins them in the folder of that name below its ``run_dir``, unless one of its name is there)."""
    p = Path(run_dir)
    mine = (([manifest_path(p), report_path(p), *streams(p).values(), profiler_dir(p), p / TB_DIR]) if rank == 0
            else [p / stream_name(rank)])
    mine = [q for q in mine if q.exists() or q.is_symlink()]
    if not mine:
        return None
    base = dest = p / PREVIOUS_DIR / (into or f"run-{_run_id_in(p, rank) or 'unknown'}")
    n = 1
    while any((dest / q.name).exists() or (dest / q.name).is_symlink() for q in mine):  # (never over another's)
        n += 1
        dest = base.with_name(f"{base.name}-{n}")
    dest.mkdir(parents=True, exist_ok=True)
    for q in mine:
        try:
            os.replace(q, dest / q.name)
        except FileNotFoundError:  # (another rank moved it: its stream, seen by rank 0 on a shared disk)
            pass
    return dest


def _run_id_in(run_dir: Path, rank: int) -> Optional[str]:
    """The run id of the run whose files are in ``run_dir``: its manifest's (rank 0), else the first record stream's
    header's (the rank's own first)."""
    import json

    paths = ([manifest_path(run_dir)] if rank == 0 else []) + [run_dir / stream_name(rank)] \
        + list(streams(run_dir).values())
    for q in paths:
        try:
            with open(q, "rb") as fh:
                first = fh.readline() if q.name != MANIFEST_NAME else fh.read()
            rid = json.loads(first).get("run_id")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(rid, str) and re.fullmatch(r"[0-9a-zA-Z_-]{1,64}", rid):
            return rid
    return None


def previous_runs(run_dir: Path | str) -> list[Path]:
    """The earlier runs moved aside below ``run_dir`` (``keep_run``), oldest first."""
    d = Path(run_dir) / PREVIOUS_DIR
    try:
        runs = [q for q in d.iterdir() if q.is_dir() and (manifest_path(q).exists() or streams(q))]
    except OSError:
        return []
    return sorted(runs, key=lambda q: q.stat().st_mtime)


def write_probe(folder: Path | str, nbytes: int = 0) -> OSError | None:
    """The error a write into ``folder`` raises now (None where it takes one): a file of ``nbytes`` (synced to the
    disk, where any) created there and removed. ``os.access`` says yes to root everywhere (/proc took a whole
    report, then "cannot write"), and a full disk takes an empty file but not its bytes. watch()'s out_dir, the
    report files the CLI writes and a profiler trace that was not written (why) are each checked by it."""
    probe = Path(folder) / f".write-test-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            if nbytes:
                f.write(bytes(nbytes))
                f.flush()
                os.fsync(f.fileno())
        return None
    except OSError as e:
        return e
    finally:
        try:
            probe.unlink(missing_ok=True)
        except OSError:
            pass


def is_replaceable(path: Path | str) -> bool:
    """Whether ``write_atomic`` would write ``path`` by a rename over it: a regular file, a symlink to one, or a
    new name; not a FIFO, device or ``/dev/stdout`` (``os.stat`` follows links, ``/proc/self/fd/N`` included),
    which is opened and written through."""
    import stat

    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:  # not there (or a dangling link): created, by the rename
        return True


def write_atomic(path: Path | str, data: bytes | str) -> Path:
    """Writes ``data`` to ``path`` whole or not at all: into a temporary file in the same folder, then renamed
    over ``path`` (``os.replace``), so that a failed or interrupted write never leaves a truncated file and a
    reader never sees half of one. Text is written as UTF-8. The file gets the permissions a plain ``open`` gives
    (0666 less the umask: ``mkstemp``'s own 0600 would hide a report from the user's group). A symlink's target
    is the file replaced; a path that is not a regular file (``is_replaceable``) is opened and written through."""
    import tempfile

    path = Path(path)
    if not is_replaceable(path):
        # a FIFO, a character device, /dev/stdout: written through, never replaced (a new-user trial's
        # ``--json /dev/full`` exited 0 and turned the device into an 82 KB file; a FIFO's reader got 0 bytes)
        with open(path, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        return path
    # a symlink is followed: its target is replaced, the link stays (the trial's ``--json link.json`` replaced the
    # link with a file and left its target untouched)
    target = Path(os.path.realpath(path))
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        if hasattr(os, "fchmod"):
            os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def _umask() -> int:
    """The process's umask, read without setting it (``os.umask`` sets it, for a moment, for every thread: the
    recorder writes from a thread of its own): from /proc on Linux, else 022."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def new_run_id() -> str:
    """A fresh run id: 12 random hex digits."""
    return os.urandom(6).hex()
