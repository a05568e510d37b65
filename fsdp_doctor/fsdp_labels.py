"""FSDP2's label grammar, in one place and without torch: the names FSDP2 gives its ``record_function`` ranges
(in Kineto traces) and its hook logs (logger ``torch.distributed.fsdp.fully_shard`` at DEBUG), e.g.
``FSDP::pre_forward (layers.0)``, ``FSDP::all_gather (layers.0) [pg=1]``, ``FSDP::post_backward_reduce``,
``FSDP::backward_prefetch for layers.1``. Used by the recorder's hooks (record/hooks.py) and the trace builder
(fsdp_doctor/trace/)."""

from __future__ import annotations

import re
from typing import NamedTuple, Optional

PREFIX = "FSDP::"
#: ``FSDP::<kind>[ (<fqn>)][ [pg=<n>]]``
LABEL_RE = re.compile(r"^FSDP::(?P<kind>[A-Za-z_]+)(?: \((?P<fqn>.*)\))?(?: \[pg=(?P<pg>\d+)\])?$")
#: ``FSDP::<forward|backward>_prefetch for <fqn>``
PREFETCH_RE = re.compile(r"^FSDP::(?P<pass>forward|backward)_prefetch for (?P<fqn>.*)$")


class FsdpLabel(NamedTuple):
    kind: str  # "pre_forward", "all_gather", "post_backward_reduce", "forward_prefetch" ...
    fqn: Optional[str]  # the unit's module path ("" for the root), None when the label names none
    pg: Optional[int] = None  # the process group's index FSDP appends to some collectives' labels


def parse_label(name: str) -> Optional[FsdpLabel]:
    """``"FSDP::pre_backward (layers.0)"`` -> ``FsdpLabel("pre_backward", "layers.0")``; None when the name is
    not an FSDP2 label."""
    if not name.startswith(PREFIX):
        return None
    m = LABEL_RE.match(name)
    if m is not None:
        pg = m.group("pg")
        return FsdpLabel(m.group("kind"), m.group("fqn"), int(pg) if pg is not None else None)
    m = PREFETCH_RE.match(name)
    if m is not None:
        return FsdpLabel(m.group("pass") + "_prefetch", m.group("fqn"))
    return None
