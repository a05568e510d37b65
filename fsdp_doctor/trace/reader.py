"""Finding and decoding Kineto (torch.profiler) trace files.

Only the fields the analyses use are decoded, into typed msgspec Structs; everything else in the
trace is skipped by the decoder. A ``.gz`` file is decompressed in memory.

Two decoders: the fast one (the default) decodes complete ("X") events as XEvent with LeanArgs, instants as
IEvent (name and the ``[memory]`` figures) and every other event (flow arrows, metadata) as a mark holding only
``ts``; whatever it refuses is decoded
by the plain one (Event with full Args), which ``decode(path, full=True)`` also gives. The analyses read the
same fields from both, so results do not depend on which decoded a file (tests/test_trace_fast_path.py).
"""

from __future__ import annotations

import gzip
import os
import re
import zlib
from pathlib import Path
from typing import Any, Optional, Union

import msgspec

from ..store.layout import find_trace_files, open_regular, read_regular, trace_rank  # noqa: F401  (the store finds the files)


class TraceError(Exception):
    """A file that cannot be read as a Kineto trace; ``str()`` is one line naming the problem."""


class EmptyLastStep(TraceError):
    """A window of one ``ProfilerStep`` in which nothing ran (``rank``, ``step``: its rank and that step's number):
    what torch.profiler saves at its exit where its schedule was recording when the loop ended, the step the
    loop's last ``prof.step()`` began, closed by the exit (a schedule's ``repeat=0``, its default, repeats it to
    the loop's end). Measured over 12 loops on 1 gloo rank (torch 2.13; wait/warmup/active/repeat and the loop's
    length varied): every such file was the rank's last, its step the loop's ``prof.step()`` count; every other
    window, one step (``active=1``) or several, ran the loop's operators. ``trace.analysis`` keeps it apart from a
    bad file by the rank's other windows (none of them holds a later step)."""

    def __init__(self, msg: str, rank: Optional[int] = None, step: Optional[int] = None):
        super().__init__(msg)
        self.rank, self.step = rank, step


class LeanArgs(msgspec.Struct, gc=False):
    """The args the analyses read from every event (the fast decoder's; see XEvent)."""
    correlation: Optional[int] = None
    stream: Union[int, str, None] = None
    in_nelems: Optional[int] = msgspec.field(default=None, name="In msg nelems")
    out_nelems: Optional[int] = msgspec.field(default=None, name="Out msg nelems")
    dtype: Optional[str] = None
    group_size: Optional[int] = msgspec.field(default=None, name="Group size")
    collective: Optional[str] = msgspec.field(default=None, name="Collective name")


class Args(LeanArgs, gc=False):
    # kept undecoded: only read for the few c10d ops of a CPU/gloo trace (record_shapes=True gives message
    # sizes). Two objects per operator, ~20% of a GPU trace's decode time, so the fast decoder leaves them out
    # and a CPU trace that needs them is decoded again in full (see build._Shapes).
    input_dims: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw, name="Input Dims")
    input_type: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw, name="Input type")
    # a "[memory]" instant's (profile_memory=True), as MemArgs
    total_allocated: Any = msgspec.field(default=None, name="Total Allocated")
    device_type: Any = msgspec.field(default=None, name="Device Type")
    device_id: Any = msgspec.field(default=None, name="Device Id")
    nbytes: Any = msgspec.field(default=None, name="Bytes")
    addr: Any = msgspec.field(default=None, name="Addr")


class MemArgs(msgspec.Struct, gc=False):
    """The args of a ``[memory]`` instant (torch.profiler ``profile_memory=True``): the allocator's total on
    the device after the allocation or free, the block's size (``Bytes``: negative for a free) and address;
    Device Type 0 is the CPU, 1 CUDA. Typed loosely: an odd value in an event the analyses barely read must not
    make the file unreadable (steps_detail reads numbers only)."""
    total_allocated: Any = msgspec.field(default=None, name="Total Allocated")
    device_type: Any = msgspec.field(default=None, name="Device Type")
    device_id: Any = msgspec.field(default=None, name="Device Id")
    nbytes: Any = msgspec.field(default=None, name="Bytes")
    addr: Any = msgspec.field(default=None, name="Addr")


class Event(msgspec.Struct, gc=False):
    # no "ph": every event with a "dur" is analysed whatever its phase, so it is not decoded (one string fewer
    # per event); nor "id"/"bp" of flow events or any other field
    name: str = ""
    cat: Optional[str] = None
    pid: Union[int, str] = 0
    tid: Union[int, str] = 0
    ts: Union[int, float, None] = None
    dur: Union[int, float, None] = None
    args: Optional[Args] = None


# The fast decoder reads an event as a tagged union on "ph": a complete event ("X") as an XEvent (an Event
# whose args are LeanArgs), any other phase (flow arrows, instants, counters, metadata: in a GPU trace ~40% of
# the events) as only its "ts", which is far cheaper. A non-X event with a numeric "dur", an event without
# "ph", or a phase outside the Trace Event Format fails that decode and the file is read again with the plain
# decoder, so results never depend on it.
class XEvent(msgspec.Struct, gc=False, tag_field="ph", tag="X"):
    name: str = ""
    cat: Optional[str] = None
    pid: Union[int, str] = 0
    tid: Union[int, str] = 0
    ts: Union[int, float, None] = None
    dur: Union[int, float, None] = None
    args: Optional[LeanArgs] = None


class _Mark(msgspec.Struct, gc=False, tag_field="ph"):
    ts: Union[int, float, None] = None
    dur: None = None  # a duration outside a complete event: validation fails, see above


class IEvent(msgspec.Struct, gc=False, tag_field="ph", tag="i"):
    """An instant event: its name and, for a ``[memory]`` one, the allocator's figures (the only instants read)."""
    name: str = ""
    pid: Union[int, str] = 0
    tid: Union[int, str] = 0
    ts: Union[int, float, None] = None
    dur: None = None
    args: Optional[MemArgs] = None


_PHASES = "BEICbneSTpFstfPONDMVvRc()"  # the Trace Event Format's phases other than X and i
_MARKS = (IEvent, *(msgspec.defstruct(f"_Mark{ord(ph)}", [], bases=(_Mark,), tag=ph) for ph in _PHASES))
MEMORY_EVENT = "[memory]"


class ProcessGroupInfo(msgspec.Struct, gc=False):
    pg_size: Optional[int] = None


class DistributedInfo(msgspec.Struct, gc=False):
    rank: Optional[int] = None
    world_size: Optional[int] = None
    backend: Optional[str] = None
    pg_config: Optional[list[ProcessGroupInfo]] = None  # the process groups (a 2-D mesh's each of its dims)


class KinetoTrace(msgspec.Struct):
    traceEvents: Optional[list[Event]] = None
    distributedInfo: Optional[DistributedInfo] = None
    displayTimeUnit: Optional[str] = None
    baseTimeNanoseconds: Optional[int] = None


class _TaggedKinetoTrace(msgspec.Struct):
    traceEvents: Optional[list[Union[(XEvent, *_MARKS)]]] = None
    distributedInfo: Optional[DistributedInfo] = None
    displayTimeUnit: Optional[str] = None
    baseTimeNanoseconds: Optional[int] = None


_DECODER = msgspec.json.Decoder(KinetoTrace)
_FAST_DECODER = msgspec.json.Decoder(_TaggedKinetoTrace)


def rank_from_name(path: Path) -> Optional[int]:
    return trace_rank(path)


# A gzip member inflating to more than this is refused (real Kineto traces inflate 9-20x): a small file that
# inflates to gigabytes is a bomb, not a trace.
GZIP_MAX_RATIO = 200
GZIP_MIN_CAP = 64 << 20  # below this much inflated JSON, no ratio is refused


def inflate_cap(compressed: int) -> int:
    return max(GZIP_MIN_CAP, GZIP_MAX_RATIO * compressed)


def _gunzip(data: bytes) -> bytes:
    """gzip.decompress, with the output in one buffer sized from the gzip trailer (ISIZE): gzip.decompress
    grows its output in blocks and joins them, which writes (and page-faults) twice the memory; ~40% faster
    on a fresh process. Taken only when the inflated first member has the trailer's length and CRC, i.e. the
    file is one member as torch.profiler writes it (or, absurdly, its first and last members are identical);
    anything else is inflated member by member, never past ``inflate_cap`` (TraceError beyond)."""
    cap = inflate_cap(len(data))
    if len(data) >= 18:
        crc = int.from_bytes(data[-8:-4], "little")
        isize = int.from_bytes(data[-4:], "little")
        if isize <= min(1032 * len(data), cap):  # deflate cannot expand more than that: a trailer to trust
            try:
                out = zlib.decompress(data, 31, max(isize, 1))
            except (zlib.error, MemoryError):
                out = None
            if out is not None and len(out) == isize and zlib.crc32(out) == crc:
                return out
    try:
        return _inflate_capped(data, cap)
    except (zlib.error, EOFError):  # the gzip module words the error (it stops at the same member: within the cap)
        return gzip.decompress(data)


def _inflate_capped(data: bytes, cap: int) -> bytes:
    out: list[bytes] = []
    n = 0
    while data:
        d = zlib.decompressobj(31)
        chunk = d.decompress(data, cap - n + 1)
        n += len(chunk)
        if n > cap:
            raise _bomb(cap)
        out.append(chunk)
        if not d.eof:
            raise EOFError
        data = d.unused_data.lstrip(b"\x00")  # members follow one another; zero padding at the end is allowed
        if data and data[:2] != b"\x1f\x8b":
            raise EOFError  # trailing junk: worded by the gzip module
    return b"".join(out)


def read_bytes(path: Path) -> bytes:
    data = read_regular(path)
    if path.name.endswith(".gz") or data[:2] == b"\x1f\x8b":
        try:
            return _gunzip(data)
        except EOFError:
            raise TraceError("truncated gzip stream") from None
        except (OSError, zlib.error) as e:
            raise TraceError(f"corrupt gzip data ({e})") from None
    return data


def decode(path: Path, *, full: bool = False):
    """Decode one trace file. Raises TraceError with a one-line reason.

    By default with the fast decoder: complete events are XEvents (no record_shapes fields in their args)
    and the other events carry only ``ts``; ``full=True`` gives Events with every field above. A file whose
    JSON is larger than ``STREAM_MIN_BYTES`` is not decoded whole: a :class:`StreamedTrace` is returned,
    whose events come in batches as the file is read (peak memory bounded by the batch, not the file)."""
    path = Path(path)
    try:
        if _json_size_estimate(path) > STREAM_MIN_BYTES:
            return StreamedTrace(path, full)
        data = read_bytes(path)
    except OSError as e:
        raise TraceError(e.strerror or str(e)) from None
    if not data or data.isspace():  # (not strip(): that copies the whole buffer)
        raise TraceError("empty file")
    return _decode_bytes(data, full)


# ---------------------------------------------------------------------------------------- streaming
STREAM_MIN_BYTES = 64 << 20  # JSON larger than this is decoded in batches
BATCH_BYTES = 8 << 20  # JSON per batch of events
READ_BYTES = 4 << 20  # bytes read (or inflated) at a time
_HEAD_MAX = 16 << 20  # the top-level fields before "traceEvents" (device properties...) fit in this
_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
_WS = b" \t\r\n"


def _is_gzip(path: Path) -> bool:
    if path.name.endswith(".gz"):
        return True
    with open_regular(path) as f:
        return f.read(2) == b"\x1f\x8b"


def _json_size_estimate(path: Path) -> int:
    """The JSON bytes ``path`` holds, or a lower bound: a gzip's trailer (ISIZE, modulo 4 GiB) or 8x its size."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if not (path.name.endswith(".gz") or f.read(2) == b"\x1f\x8b") or size < 18:
            return size
        f.seek(size - 4)
        return max(int.from_bytes(f.read(4), "little"), GZIP_RATIO_ESTIMATE * size)


GZIP_RATIO_ESTIMATE = 8


def _chunks(path: Path):
    """The file's bytes (inflated when gzip), about ``READ_BYTES`` at a time, inflation capped as in
    ``_gunzip``. Raises TraceError."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        gz = path.name.endswith(".gz") or f.read(2) == b"\x1f\x8b"
        f.seek(0)
        if not gz:
            while b := f.read(READ_BYTES):
                yield b
            return
        cap, total, fed = inflate_cap(size), 0, False
        d = zlib.decompressobj(31)
        try:
            while raw := f.read(READ_BYTES):
                data = raw
                while True:
                    out = d.decompress(data, READ_BYTES)
                    fed = True
                    total += len(out)
                    if total > cap:
                        raise _bomb(cap)
                    if out:
                        yield out
                    if d.eof:  # a member ended; another may follow, zero padding may end the file
                        data = d.unused_data.lstrip(b"\x00")
                        d, fed = zlib.decompressobj(31), False
                        if data and data[:2] != b"\x1f\x8b":
                            raise TraceError("corrupt gzip data (not a gzip member after the first)")
                        if not data:
                            break
                        continue
                    data = d.unconsumed_tail
                    if not data and not out:
                        break
        except zlib.error as e:
            raise TraceError(f"corrupt gzip data ({e})") from None
        if fed and not d.eof:
            raise TraceError("truncated gzip stream")


def _bomb(cap: int) -> TraceError:
    return TraceError(f"gzip data inflates past {cap >> 20} MiB ({GZIP_MAX_RATIO}x its size, more than any trace): "
                      "refused as a decompression bomb")


class _Meta(msgspec.Struct):
    """The top-level fields other than the events (read from around the events array when streaming)."""
    traceEvents: Optional[list[msgspec.Raw]] = None
    distributedInfo: Optional[DistributedInfo] = None
    displayTimeUnit: Optional[str] = None
    baseTimeNanoseconds: Optional[int] = None


_META_DECODER = msgspec.json.Decoder(_Meta)
_FAST_LIST = msgspec.json.Decoder(list[Union[(XEvent, *_MARKS)]])
_FULL_LIST = msgspec.json.Decoder(list[Event])


class StreamedTrace:
    """A trace decoded in batches of events as the file is read (``batches()`` reads it again at each call):
    only a batch of events is in memory at once. ``distributedInfo`` is known at once (torch writes it before
    the events); ``displayTimeUnit`` and ``baseTimeNanoseconds`` (written after them) once a pass has ended.
    ``traceEvents`` is None. Raises TraceError (at construction, or from a batch) with a one-line reason."""

    traceEvents = None

    def __init__(self, path: Path, full: bool = False):
        self.path, self.full = Path(path), full
        self.distributedInfo = self.displayTimeUnit = self.baseTimeNanoseconds = None
        chunks = _chunks(self.path)
        head, _ = self._head(chunks)
        chunks.close()
        self._set(head)

    def _set(self, meta: _Meta) -> None:
        for k in ("distributedInfo", "displayTimeUnit", "baseTimeNanoseconds"):
            v = getattr(meta, k)
            if v is not None:
                setattr(self, k, v)

    def _head(self, chunks) -> tuple[_Meta, bytes]:
        buf = b""
        for chunk in chunks:
            buf += chunk
            m = _EVENTS_KEY.search(buf)
            if m:
                break
            if len(buf) > _HEAD_MAX:
                raise TraceError(f"not a Kineto trace (no traceEvents in its first {_HEAD_MAX >> 20} MiB)")
        else:
            if not buf.strip():
                raise TraceError("empty file")
            raise TraceError("not a Kineto trace (no traceEvents)")
        try:
            meta = _META_DECODER.decode(buf[:m.start()] + b'"traceEvents": []}')
        except msgspec.DecodeError as e:
            raise TraceError(f"not a Kineto trace (its fields before traceEvents do not decode: {e})") from None
        return meta, buf[m.end():]

    def batches(self, full: Optional[bool] = None):
        """The events, a list at a time (fast decoder unless ``full``; see ``decode``)."""
        full = self.full if full is None else full
        chunks = _chunks(self.path)
        _, pending = self._head(chunks)
        parts, size = [pending], len(pending)
        for chunk in chunks:
            parts.append(chunk)
            size += len(chunk)
            if size < BATCH_BYTES:
                continue
            buf = b"".join(parts)
            got = _whole_events(buf, full)
            if got is None:
                if size > 4 * BATCH_BYTES:  # no event is that large: a run of padding, or no JSON array
                    raise TraceError(f"invalid JSON (no complete event in {size:,} bytes)")
                parts = [buf]
                continue
            events, cut = got
            parts, size = [buf[cut:]], len(buf) - cut
            yield events
        events, tail = _last_events(b"".join(parts), full)
        self._set(tail)
        if events:
            yield events


def _decode_list(body: bytes, full: bool) -> list:
    """``[body]`` decoded as events; msgspec.DecodeError when it is not a list of whole events."""
    data = b"[" + body + b"]"
    if not full:
        try:
            return _FAST_LIST.decode(data)
        except msgspec.ValidationError:
            pass  # decoded by the plain decoder below (the fast one refuses some valid traces)
    try:
        return _FULL_LIST.decode(data)
    except msgspec.ValidationError as e:
        raise TraceError(f"not a Kineto trace ({e})") from None


def _whole_events(buf: bytes, full: bool):
    """(events, bytes used) for the longest run of whole events at the start of ``buf`` (cut after a ``}``
    followed by a comma: a cut inside a string or a nested object does not decode and an earlier one is
    tried), or None."""
    end = len(buf)
    for _ in range(16):
        i = buf.rfind(b"}", 0, end)
        if i < 0:
            return None
        k = i + 1
        while k < len(buf) and buf[k] in _WS:
            k += 1
        if k < len(buf) and buf[k] == 0x2C:  # ","
            try:
                return _decode_list(buf[:i + 1], full), k + 1
            except msgspec.DecodeError:
                pass
        end = i
    return None


def _last_events(buf: bytes, full: bool) -> tuple[list, _Meta]:
    """The events left before the array's ``]`` and the top-level fields after it."""
    end = len(buf)
    err = "invalid JSON (truncated)"
    for _ in range(64):
        i = buf.rfind(b"]", 0, end)
        if i < 0:
            break
        end = i
        try:
            tail = _META_DECODER.decode(b'{"traceEvents": []' + buf[i + 1:])
        except msgspec.DecodeError:
            continue
        body = buf[:i]
        if not body.strip():
            return [], tail
        try:
            return _decode_list(body, full), tail
        except msgspec.DecodeError as e:
            err = f"invalid JSON ({e})"
    raise TraceError(err)


def _decode_bytes(data: bytes, full: bool = False):
    """KinetoTrace (or the same fields, events as XEvent / marks) from JSON bytes. Raises TraceError."""
    trace = None
    if not full:
        try:
            trace = _FAST_DECODER.decode(data)
        except msgspec.DecodeError:  # validation errors included: decoded again below, for the plain
            pass                     # decoder's result or its error message
    if trace is not None:
        if trace.traceEvents is None:
            raise TraceError("not a Kineto trace (no traceEvents)")
        return trace
    try:
        trace = _DECODER.decode(data)
    except msgspec.ValidationError as e:
        if " - at `" not in str(e):  # the top level itself has the wrong type
            raise TraceError("not a Kineto trace (top level is not an object)") from None
        raise TraceError(f"not a Kineto trace ({e})") from None
    except msgspec.DecodeError as e:
        msg = str(e)
        if "truncated" in msg.lower():
            raise TraceError("invalid JSON (truncated)") from None
        raise TraceError(f"invalid JSON ({msg})") from None
    if trace.traceEvents is None:
        raise TraceError("not a Kineto trace (no traceEvents)")
    return trace
