"""Where autograd is now, for the hooks and the counters: the one definition of "in backward" and of "in
activation checkpointing's recompute"."""

from __future__ import annotations

import torch


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (hooks firing there are backward's,
    or checkpointing's re-run of a forward)."""
    return torch._C._current_graph_task_id() != -1


def in_recompute() -> bool:
    """Whether a forward now running is activation checkpointing's re-run inside backward: the engine is running
    a backward and grad mode is on (the engine runs backward kernels with it off; both checkpoint flavours
    re-run the forward under ``enable_grad``)."""
    return in_backward() and torch.is_grad_enabled()
