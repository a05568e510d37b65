"""Collectives as traces name them: NCCL kernel, c10d op and gloo-thread names to one snake_case name, and
message sizes (bytes per element by dtype name, record_shapes dims, NCCL message args)."""

from __future__ import annotations

import json
import math
import re
from typing import Optional

NCCL_COLL_RE = re.compile(r"(AllGather|ReduceScatter|AllReduce|Broadcast|SendRecv|AllToAll|Reduce|Send|Recv)")

_CAMEL_TO_SNAKE = {
    "AllGather": "all_gather",
    "ReduceScatter": "reduce_scatter",
    "AllReduce": "all_reduce",
    "Broadcast": "broadcast",
    "SendRecv": "send_recv",
    "AllToAll": "all_to_all",
    "Reduce": "reduce",
    "Send": "send",
    "Recv": "recv",
}

# bytes per element by the dtype names found in traces (record_param_comms 'dtype', record_shapes 'Input type')
DTYPE_BYTES = {
    "float": 4, "float32": 4, "float64": 8, "double": 8, "half": 2, "float16": 2, "bfloat16": 2,
    "c10::half": 2, "c10::bfloat16": 2, "int": 4, "int32": 4, "long": 8, "long int": 8, "int64": 8,
    "short": 2, "int16": 2, "char": 1, "signed char": 1, "unsigned char": 1, "uint8": 1, "int8": 1,
    "byte": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "c10::float8_e4m3fn": 1,
    "c10::float8_e5m2": 1, "complexfloat": 8, "c10::complex<float>": 8,
}


def _snake_collective(name: str) -> Optional[str]:
    m = NCCL_COLL_RE.search(name)
    return _CAMEL_TO_SNAKE[m.group(1)] if m else None


def _c10d_collective(op: str) -> str:
    n = op.split("::", 1)[-1].strip("_").lower()
    if "allgather" in n or "all_gather" in n:
        return "all_gather"
    if "reduce_scatter" in n or "reducescatter" in n:
        return "reduce_scatter"
    if "allreduce" in n or "all_reduce" in n:
        return "all_reduce"
    if "broadcast" in n:
        return "broadcast"
    if "alltoall" in n or "all_to_all" in n:
        return "all_to_all"
    return n


def _gloo_collective(name: str) -> str:
    return name.split(":", 1)[-1].strip().lower().replace("allgather", "all_gather").replace(
        "allreduce", "all_reduce"
    )


# which gloo-thread event names a c10d op's collective can show up as
_GLOO_NAMES_FOR = {
    "all_gather": ("all_gather",),
    "reduce_scatter": ("reduce_scatter", "all_reduce"),
    "all_reduce": ("all_reduce",),
    "broadcast": ("broadcast",),
    "all_to_all": ("all_to_all", "alltoall"),
}


def dtype_bytes(name: Optional[str]) -> Optional[int]:
    """Bytes per element of a dtype named as in traces or torch ("bfloat16", "c10::Half"); None if unknown.
    The one dtype-size table (``DTYPE_BYTES``) of the package."""
    if not name:
        return None
    return DTYPE_BYTES.get(name.strip().lower())


def dtype_name(name: Optional[str]) -> Optional[str]:
    """A dtype as torch names it ("float32", "bfloat16") from its name in a trace: NCCL's args ("Float", "BFloat16")
    or record_shapes' ("float", "c10::BFloat16"); None where not given."""
    if not name:
        return None
    n = name.strip().lower().removeprefix("c10::")
    return {"float": "float32", "double": "float64", "half": "float16", "long": "int64", "long int": "int64",
            "int": "int32", "short": "int16", "char": "int8", "signed char": "int8", "unsigned char": "uint8",
            "byte": "uint8"}.get(n, n)


def _numel(dims) -> Optional[int]:
    if isinstance(dims, list) and all(isinstance(d, int) for d in dims):
        return math.prod(dims) if dims else 1
    return None


def _shapes(args) -> list[tuple]:
    """The (dims, type) of the first two tensors in record_shapes args of a c10d op; [] where absent or unreadable."""
    if args is None or not args.input_dims or not args.input_type:
        return []
    try:
        return list(zip(json.loads(bytes(args.input_dims)), json.loads(bytes(args.input_type))))[:2]
    except ValueError:
        return []


def _bytes_from_shapes(args) -> Optional[int]:
    """Message size from record_shapes args of a c10d op: the larger of its first two tensors."""
    best = None
    for d, t in _shapes(args):
        n = _numel_nested(d)  # (a tensor list: its tensors' sum)
        b = dtype_bytes(t if isinstance(t, str) else None)
        if n is not None and b is not None:
            best = max(best or 0, n * b)
    return best


def _dtype_from_shapes(args) -> Optional[str]:
    """The element type of a c10d op's tensors from its record_shapes args, as the trace names it ("float",
    "c10::BFloat16"); None where they give none (a tensor list's "TensorList")."""
    return next((t for _, t in _shapes(args) if isinstance(t, str) and dtype_bytes(t)), None)


def _group_from_shapes(args, collective: str) -> Optional[int]:
    """The group size of an all-gather or reduce-scatter from record_shapes args of its c10d op: the gathered
    tensor's elements over the shard's (gloo's ops carry no group: HSDP's and tensor parallelism's meshes made 4
    ranks' all-gathers read as over 4 where FSDP's group is 2, their bus bandwidth 1.5x); None otherwise."""
    if collective not in ("all_gather", "reduce_scatter") or args is None or not args.input_dims:
        return None
    try:
        dims = json.loads(bytes(args.input_dims))[:2]
    except ValueError:
        return None
    ns = [_numel_nested(d) for d in dims]  # (allgather_'s: lists of tensors, their elements summed)
    if len(ns) != 2 or None in ns or min(ns) <= 0 or max(ns) % min(ns):
        return None
    return max(ns) // min(ns) if max(ns) > min(ns) else None


def _numel_nested(d) -> Optional[int]:
    """The elements of a tensor's dims, or of a (nested) list of tensors' (None where one is not a tensor's)."""
    n = _numel(d)
    if n is not None or not isinstance(d, list):
        return n
    ns = [_numel_nested(x) for x in d]
    return sum(ns) if ns and None not in ns else None


def _bytes_from_msg(args) -> Optional[int]:
    if args is None:
        return None
    n = max(args.in_nelems or 0, args.out_nelems or 0)
    b = dtype_bytes(args.dtype)
    return n * b if n and b else None
