"""The memory categories, defined once: name, label, colour and what each one counts.

The recorder (``fsdp_doctor.record.memory``) samples the device categories in :data:`DEVICE` order (each sample
row and ``StepRecord.memory``'s breakdowns use it); the analysis, the terminal, the HTML report, the dashboard
and the TensorBoard scalars read names, labels and colours from here. No torch import (the presenters load
without it).
"""

from __future__ import annotations

import msgspec


class Category(msgspec.Struct, frozen=True, kw_only=True):
    name: str  # the key in the records and the report
    label: str  # how a table or a legend names it
    colour: str  # plotly colour in every figure (HTML report and dashboard)
    description: str
    host: bool = False  # host memory, reported apart from the device total


ALL: tuple[Category, ...] = (
    Category(name="sharded_params", label="sharded params", colour="#1F77B4",
             description="local shards FSDP keeps (padding included) plus parameters no unit manages"),
    Category(name="unsharded_params", label="unsharded params", colour="#AEC7E8",
             description="all-gathered parameters alive now"),
    Category(name="sharded_grads", label="sharded grads", colour="#FF7F0E",
             description="reduce-scattered gradients on the sharded parameters"),
    Category(name="unsharded_grads", label="unsharded grads", colour="#FFBB78",
             description="full gradients of unsharded parameters not reduced yet"),
    Category(name="optimizer_state", label="optimizer state", colour="#2CA02C",
             description="every tensor in optimizer.state of a model parameter (local bytes)"),
    Category(name="stale_optimizer_params", label="stale optimizer params", colour="#E377C2",
             description="full-size tensors kept alive by an optimizer created before fully_shard"),
    Category(name="activations", label="activations", colour="#D62728",
             description="tensors saved for backward and alive, each storage once, parameters excluded"),
    Category(name="comm_buffers", label="comm buffers", colour="#9467BD",
             description="all-gather and reduce-scatter buffers in flight"),
    Category(name="buffers", label="buffers", colour="#BCBD22", description="the model's registered buffers"),
    Category(name="temporaries", label="temporaries", colour="#8C564B",
             description="CUDA: memory_allocated minus every category above; 0 on CPU"),
    Category(name="offloaded_host", label="offloaded (host)", colour="#7F7F7F", host=True,
             description="host bytes of CPU-offloaded parameters, gradients and optimizer state"),
)

BY_NAME: dict[str, Category] = {c.name: c for c in ALL}
#: device categories, in the order of every sample row; they add up to the sample's total
DEVICE: tuple[str, ...] = tuple(c.name for c in ALL if not c.host)
#: host categories, reported apart from the device total
HOST: tuple[str, ...] = tuple(c.name for c in ALL if c.host)
NAMES: tuple[str, ...] = DEVICE + HOST
COLOURS: dict[str, str] = {c.name: c.colour for c in ALL}
LABELS: dict[str, str] = {c.name: c.label for c in ALL}


def label(name: str) -> str:
    c = BY_NAME.get(name)
    return c.label if c is not None else name
