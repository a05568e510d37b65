"""Finding and decoding Kineto (torch.profiler) trace files.

Only the fields the analyses use are decoded, into typed msgspec Structs; everything else in the
trace is skipped by the decoder. A ``.gz`` file is decompressed in memory.

Two decoders: the fast one (the default) decodes complete ("X") events as XEvent with LeanArgs and every
other event (flow arrows, instants, metadata) as a mark holding only ``ts``; whatever it refuses is decoded
by the plain one (Event with full Args), which ``decode(path, full=True)`` also gives. The analyses read the
same fields from both, so results do not depend on which decoded a file (tests/test_trace_fast_path.py).
"""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path
from typing import Optional, Union

import msgspec

from ..store.layout import find_trace_files, read_regular, trace_rank  # noqa: F401  (the store finds the files)


class TraceError(Exception):
    """A file that cannot be read as a Kineto trace; ``str()`` is one line naming the problem."""


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


_PHASES = "BEiICbneSTpFstfPONDMVvRc()"  # the Trace Event Format's phases other than X
_MARKS = tuple(msgspec.defstruct(f"_Mark{ord(ph)}", [], bases=(_Mark,), tag=ph) for ph in _PHASES)


class DistributedInfo(msgspec.Struct, gc=False):
    rank: Optional[int] = None
    world_size: Optional[int] = None
    backend: Optional[str] = None


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
            raise TraceError(f"gzip data inflates past {cap >> 20} MiB ({GZIP_MAX_RATIO}x its size, more than any "
                             "trace): refused as a decompression bomb")
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


def decode(path: Path, *, full: bool = False) -> KinetoTrace:
    """Decode one trace file. Raises TraceError with a one-line reason.

    By default with the fast decoder: complete events are XEvents (no record_shapes fields in their args)
    and the other events carry only ``ts``; ``full=True`` gives Events with every field above."""
    path = Path(path)
    try:
        data = read_bytes(path)
    except OSError as e:
        raise TraceError(e.strerror or str(e)) from None
    if not data or data.isspace():  # (not strip(): that copies the whole buffer)
        raise TraceError("empty file")
    return _decode_bytes(data, full)


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
