"""Finding and decoding Kineto (torch.profiler) trace files.

Only the fields the analyses use are decoded, into typed msgspec Structs; everything else in the
trace is skipped by the decoder. A ``.gz`` file is decompressed in memory.
"""

from __future__ import annotations

import gzip
import re
import zlib
from pathlib import Path
from typing import Optional, Union

import msgspec

# Not traces although they are JSON: the doctor's run manifest and reports.
NON_TRACE_NAMES = {"manifest.json", "report.json"}


class TraceError(Exception):
    """A file that cannot be read as a Kineto trace; ``str()`` is one line naming the problem."""


class Args(msgspec.Struct, gc=False):
    external_id: Optional[int] = msgspec.field(default=None, name="External id")
    correlation: Optional[int] = None
    stream: Union[int, str, None] = None
    in_nelems: Optional[int] = msgspec.field(default=None, name="In msg nelems")
    out_nelems: Optional[int] = msgspec.field(default=None, name="Out msg nelems")
    dtype: Optional[str] = None
    group_size: Optional[int] = msgspec.field(default=None, name="Group size")
    collective: Optional[str] = msgspec.field(default=None, name="Collective name")
    # kept undecoded: only read for the few c10d ops (record_shapes=True gives message sizes)
    input_dims: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw, name="Input Dims")
    input_type: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw, name="Input type")


class Event(msgspec.Struct, gc=False):
    ph: str = ""
    name: str = ""
    cat: Optional[str] = None
    pid: Union[int, str] = 0
    tid: Union[int, str] = 0
    ts: Union[int, float, None] = None
    dur: Union[int, float, None] = None
    args: Optional[Args] = None


class DistributedInfo(msgspec.Struct, gc=False):
    rank: Optional[int] = None
    world_size: Optional[int] = None
    backend: Optional[str] = None


class KinetoTrace(msgspec.Struct):
    traceEvents: Optional[list[Event]] = None
    distributedInfo: Optional[DistributedInfo] = None
    displayTimeUnit: Optional[str] = None
    baseTimeNanoseconds: Optional[int] = None


_DECODER = msgspec.json.Decoder(KinetoTrace)
_RANK_RE = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)


def is_trace_name(p: Path) -> bool:
    name = p.name
    if name in NON_TRACE_NAMES:
        return False
    return name.endswith(".json") or name.endswith(".json.gz")


def find_trace_files(path) -> list[Path]:
    """Kineto trace files at ``path``: the file itself, or ``*.json`` / ``*.json.gz`` found recursively
    under a directory (TensorBoard plugin layout and the doctor's ``profiler/`` folder included), sorted.
    Known non-trace JSON (``manifest.json``, ``report.json``, ``*.jsonl``) is left out.
    Raises FileNotFoundError for a missing path."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file or directory")
    if p.is_file():
        return [p]
    found = [q for q in p.rglob("*") if q.is_file() and is_trace_name(q)]
    return sorted(found)


def rank_from_name(path: Path) -> Optional[int]:
    m = _RANK_RE.search(path.name)
    return int(m.group(1)) if m else None


def read_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    if path.name.endswith(".gz") or data[:2] == b"\x1f\x8b":
        try:
            return gzip.decompress(data)
        except EOFError:
            raise TraceError("truncated gzip stream") from None
        except (OSError, zlib.error) as e:
            raise TraceError(f"corrupt gzip data ({e})") from None
    return data


def decode(path: Path) -> KinetoTrace:
    """Decode one trace file. Raises TraceError with a one-line reason."""
    path = Path(path)
    try:
        data = read_bytes(path)
    except OSError as e:
        raise TraceError(e.strerror or str(e)) from None
    if not data.strip():
        raise TraceError("empty file")
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
