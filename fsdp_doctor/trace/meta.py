"""A Kineto trace's own metadata: the top-level fields torch.profiler writes before ``traceEvents``
(``distributedInfo``: backend, rank, world size, NCCL version; ``deviceProperties``: the GPUs), read from the
file's head only, so the run facts of a folder of plain traces cost a few KiB per file whatever their size."""

from __future__ import annotations

import re
import zlib
from pathlib import Path
from typing import Optional

import msgspec

from ..store.layout import open_regular

HEAD_BYTES = 256 << 10  # Kineto writes the metadata first; a GPU list of 8 devices is ~4 KiB
_EVENTS = re.compile(rb'"traceEvents"\s*:')


class DistributedInfo(msgspec.Struct):
    backend: Optional[str] = None
    rank: Optional[int] = None
    world_size: Optional[int] = None
    nccl_version: Optional[str] = None


class DeviceProperties(msgspec.Struct):
    name: Optional[str] = None
    totalGlobalMem: Optional[int] = None


class TraceMeta(msgspec.Struct):
    distributedInfo: Optional[DistributedInfo] = None
    deviceProperties: list[DeviceProperties] = []


def _head(path: Path) -> bytes:
    try:
        f = open_regular(path)  # a FIFO or a device is never opened for reading (it would block)
    except OSError:
        return b""  # the reader names the file and why
    with f:
        raw = f.read(HEAD_BYTES // 4 if path.name.endswith(".gz") else HEAD_BYTES)
    if path.name.endswith(".gz"):
        try:
            return zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(raw, HEAD_BYTES)
        except zlib.error:
            return b""
    return raw


def read_meta(path) -> Optional[TraceMeta]:
    """The metadata before ``traceEvents`` (None where the file has none there or is not JSON): the head of the
    file is closed after the last complete field and decoded."""
    head = _head(Path(path))
    m = _EVENTS.search(head)
    if m is None:
        return None
    text = head[:m.start()].rstrip().rstrip(b",") + b"}"
    try:
        return msgspec.json.decode(text, type=TraceMeta)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def meta_facts(paths) -> dict:
    """Run facts from the traces' metadata: ``backend``, ``world_size``, ``nccl_version``, ``device_name`` (each GPU
    model the traces list, once) and ``trace_ranks`` (the ranks the files say they are). Fields no trace carries
    are absent."""
    out: dict = {}
    ranks: set[int] = set()
    names: list[str] = []
    for p in paths:
        meta = read_meta(p)
        if meta is None:
            continue
        d = meta.distributedInfo
        if d is not None:
            if d.backend and "backend" not in out:
                out["backend"] = d.backend
            if d.world_size:
                out["world_size"] = max(out.get("world_size", 0), d.world_size)
            if d.nccl_version and "nccl_version" not in out:
                out["nccl_version"] = str(d.nccl_version)
            if d.rank is not None:
                ranks.add(int(d.rank))
        for dp in meta.deviceProperties:
            if dp.name and dp.name not in names:
                names.append(dp.name)
    if names:
        out["device_name"] = " + ".join(names)
    if ranks:
        out["trace_ranks"] = sorted(ranks)
    return out

