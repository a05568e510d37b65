"""The memory probe's CUDA figures (fsdp_doctor/record/memory/device.py) without a GPU: the allocator's nested
statistics read once a call, and NVML / mem_get_info read again only when the reservation changed or
DEVICE_EVERY steps later. torch.cuda's two calls are replaced by a fake allocator (the GPU campaign measures the
real calls' cost: benchmarks/gpu_call_costs.py)."""

from __future__ import annotations

import torch

from fsdp_doctor.record.memory import device as D


class FakeAllocator:
    def __init__(self):
        self.allocated, self.reserved, self.peak = 3 << 20, 8 << 20, 5 << 20
        self.device_reads = 0

    def nested(self, idx):
        assert idx == 0
        stat = lambda cur, peak=0: {"all": {"current": cur, "peak": peak}}  # noqa: E731
        return {"allocated_bytes": stat(self.allocated, self.peak), "reserved_bytes": stat(self.reserved),
                "inactive_split_bytes": stat(1 << 20), "num_alloc_retries": 2, "num_ooms": 0}

    def mem_get_info(self, dev):
        self.device_reads += 1
        return 70 << 30, 80 << 30


def _stats(monkeypatch):
    fake = FakeAllocator()
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", fake.nested)
    monkeypatch.setattr(torch.cuda, "mem_get_info", fake.mem_get_info)
    ds = D.DeviceStats(torch.device("cuda", 0), fragmentation_every=0, nvml=True)
    monkeypatch.setattr(ds, "_nvml_process_bytes", lambda: fake.reserved + (600 << 20))
    return fake, ds


def test_the_step_figures_come_from_one_read_of_the_allocator(monkeypatch):
    fake, ds = _stats(monkeypatch)
    c = ds.stats(0)
    assert (c.allocated, c.reserved, c.fragmentation, c.max_allocated) == (3 << 20, 8 << 20, 5 << 20, 5 << 20)
    assert (c.inactive_split_bytes, c.alloc_retries, c.ooms) == (1 << 20, 2, 0)
    assert (c.device_free, c.device_total, c.nvml_process_bytes, c.outside_allocator) == (
        70 << 30, 80 << 30, (8 << 20) + (600 << 20), 600 << 20)
    assert c.error is None
    assert D.allocated_reader(torch.device("cuda", 0))() == 3 << 20
    assert D.allocated_reader(torch.device("cpu"))() == 0


def test_device_figures_are_read_again_when_the_reservation_changes_or_every_device_every_steps(monkeypatch):
    fake, ds = _stats(monkeypatch)
    ds.stats(0)
    for step in range(1, 10):  # the allocator's total moves, its reservation does not: no new device read
        fake.allocated += 1 << 10
        assert ds.stats(step).nvml_process_bytes == (8 << 20) + (600 << 20)
    assert fake.device_reads == 1
    fake.reserved += 2 << 20  # the allocator reserved a segment: the process's device memory changed
    c = ds.stats(10)
    assert fake.device_reads == 2 and c.outside_allocator == 600 << 20 and c.reserved == 10 << 20
    ds.stats(10 + D.DEVICE_EVERY - 1)
    assert fake.device_reads == 2
    ds.stats(10 + D.DEVICE_EVERY)  # other processes on the device: read again at the latest every DEVICE_EVERY
    assert fake.device_reads == 3


def test_a_failing_allocator_call_is_one_error_figure_not_a_crash(monkeypatch):
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda idx: {})  # CUDA not initialized
    c = D.DeviceStats(torch.device("cuda", 0), fragmentation_every=0, nvml=False).stats(0)
    assert c.error.startswith("KeyError") and c.allocated is None
