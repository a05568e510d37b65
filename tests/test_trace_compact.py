"""The builder keeps device events compactly (stream ids as indices, collective args interned): the known
answers that depend on the stream ids' values, not their order of appearance."""

from __future__ import annotations

import numpy as np

from fsdp_doctor.trace import build_window
from trace_fixtures import TraceBuilder


def _tied_streams(tmp_path):
    """Steps 1-2 kept (3 is cut). Compute: 100 µs per step on stream 30, seen first, and 100 µs on stream 7
    (a tie: the lower id, 7, is the compute stream). One all-gather per step on stream 7, one on stream 20."""
    b = TraceBuilder()
    for k, n in enumerate((1, 2, 3)):
        t = 1000.0 * k
        b.step(n, t, 1000.0)
        b.compute(t + 10, 100.0, stream=30)
        b.compute(t + 200, 60.0, stream=7)
        b.compute(t + 300, 40.0, stream=7)
        b.nccl("all_gather", t + 400, 50.0, launch_ts=t + 390, stream=7, nelems=1024)
        b.nccl("all_gather", t + 500, 30.0, launch_ts=t + 490, stream=20, nelems=2048)
    return b.write(tmp_path / "rank0.trace.json")


def test_compute_stream_tie_goes_to_the_lowest_id(tmp_path):
    w = build_window(_tied_streams(tmp_path))
    assert w.steps == [1, 2]
    assert [(c.start - w.window[0], c.on_compute_stream, c.bytes) for c in w.calls] == [
        (400.0, True, 4096), (500.0, False, 8192), (1400.0, True, 4096), (1500.0, False, 8192)]
    # stream 7's busy time: its compute and its all-gather, not stream 30's kernels
    s, e = w.stream_busy
    assert np.allclose(np.stack([s, e]) - w.window[0],
                       [[200, 300, 400, 1200, 1300, 1400], [260, 340, 450, 1260, 1340, 1450]])
