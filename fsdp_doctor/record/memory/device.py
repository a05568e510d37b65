"""CUDA allocator and NVML figures for the memory probe (``StepRecord.memory.cuda``), and the device the probe
measures. One collaborator of :class:`fsdp_doctor.record.memory.MemoryProbe`.

Cost, measured on the H100 (benchmarks/gpu_campaign.py's ``probe_costs`` step prints it): the public
``torch.cuda.memory_allocated()`` is ``memory_stats()`` flattened into a sorted dict in Python, about
100-250 us a call inside a training step; the probe reads the allocator at every mark (each FSDP unit's forward
and backward, twice) and its per-step figures called it four times more, which made the probe 6-16 ms of a 75 ms
step on the GPU rows and the doctor's overhead 1.26 on a 1B-parameter model. Here the allocator is read once
per call as the nested dict ``memory_stats`` is built from (``torch.cuda.memory_stats_as_nested_dict``), at every
mark of a full step but at a few marks of a light one (``sampler.py``),
and NVML's process list and ``cudaMemGetInfo`` only when the allocator's reservation changed (the process's device
memory then changed) or every ``DEVICE_EVERY`` steps (other processes on the device). Every call is guarded."""

from __future__ import annotations

import os
from typing import Any, Callable

import msgspec
import torch

from ...records import CudaMemory

#: steps between NVML / mem_get_info reads while the allocator's reservation is unchanged
DEVICE_EVERY = 50


def stats_reader(device: torch.device) -> Callable[[], dict]:
    """A callable returning the allocator's statistics of ``device`` as torch builds them, nested
    (``torch.cuda.memory_stats_as_nested_dict``: ``{"allocated_bytes": {"all": {"current": ...}}, ...}``)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    nested = torch.cuda.memory_stats_as_nested_dict
    return lambda: nested(idx)


def allocated_reader(device: torch.device) -> Callable[[], int]:
    """``torch.cuda.memory_allocated(device)`` without its flattening (see the module's docstring); 0 off CUDA
    (and before CUDA is initialized)."""
    if device.type != "cuda":
        return lambda: 0
    read = stats_reader(device)

    def allocated() -> int:
        s = read()
        return s["allocated_bytes"]["all"]["current"] if s else 0
    return allocated


def allocator_limit(dev: torch.device) -> int | None:
    """The bytes this process's CUDA caching allocator may reserve on ``dev`` where
    ``torch.cuda.set_per_process_memory_fraction`` capped it below the device; None for the whole device (or a torch
    without ``get_per_process_memory_fraction``)."""
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    try:  # (an allocator backend without fractions, cudaMallocAsync's, may raise: then none is known)
        fraction = float(get(dev)) if get is not None else 1.0
    except Exception:  # noqa: BLE001 - the other allocator figures are still read
        return None
    if fraction >= 1.0:
        return None
    return int(fraction * torch.cuda.get_device_properties(dev).total_memory)


class DeviceStats:
    """Allocator and device figures of one CUDA device (``fragmentation_every``: steps between allocator
    snapshots for the largest free block, 0 = never; ``nvml``: read this process's device memory from NVML)."""

    def __init__(self, device: torch.device, fragmentation_every: int, nvml: bool):
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.fragmentation_every = fragmentation_every
        self.nvml = nvml
        self._nvml = None
        self._nvml_failed = False
        self._read = stats_reader(device) if self.is_cuda else None
        self.allocated = allocated_reader(device)  # the allocator's total (the probe's marks read it); 0 off CUDA
        self._dev: tuple[int, int, dict] | None = None  # (reserved, step) at the last device read, its figures

    def stats(self, step: int) -> CudaMemory:
        """Allocator and device figures: one read of the allocator's statistics; NVML and mem_get_info when the
        reservation changed since their last read or ``DEVICE_EVERY`` steps later (the figures of that read are
        repeated in between: the process's device memory did not change with the reservation unchanged)."""
        dev = self.device
        out: dict[str, Any] = {}
        try:
            s = self._read()
            alloc, reserved = int(s["allocated_bytes"]["all"]["current"]), int(s["reserved_bytes"]["all"]["current"])
            out.update(allocated=alloc, reserved=reserved, fragmentation=max(0, reserved - alloc),
                       max_allocated=int(s["allocated_bytes"]["all"]["peak"]),
                       inactive_split_bytes=int(s["inactive_split_bytes"]["all"]["current"]),
                       alloc_retries=int(s.get("num_alloc_retries", 0)), ooms=int(s.get("num_ooms", 0)),
                       allocator_limit=allocator_limit(dev))
            last = self._dev
            if last is None or last[0] != reserved or step - last[1] >= DEVICE_EVERY:
                self._dev = (reserved, step, self._device_figures(reserved))
            out.update(self._dev[2])
        except Exception as exc:  # noqa: BLE001
            out["error"] = f"{type(exc).__name__}: {exc}"[:200]
        fe = self.fragmentation_every
        if fe and step % fe == 0:
            try:
                largest = 0
                for seg in torch.cuda.memory_snapshot():
                    if seg.get("device") not in (None, dev.index):
                        continue
                    for blk in seg.get("blocks", ()):
                        if blk.get("state") == "inactive":
                            largest = max(largest, int(blk.get("size", 0)))
                out["largest_free_block"] = largest
            except Exception as exc:  # noqa: BLE001
                out["snapshot_error"] = f"{type(exc).__name__}: {exc}"[:200]
        return msgspec.convert(out, CudaMemory)

    def _device_figures(self, reserved: int) -> dict[str, int]:
        out: dict[str, int] = {}
        free, total = torch.cuda.mem_get_info(self.device)
        out["device_free"], out["device_total"] = int(free), int(total)
        if self.nvml and not self._nvml_failed:
            used = self._nvml_process_bytes()
            if used is not None:
                out["nvml_process_bytes"] = used
                out["outside_allocator"] = max(0, used - reserved)
        return out

    def _nvml_process_bytes(self) -> int | None:
        try:
            if self._nvml is None:
                import pynvml  # nvidia-ml-py; absent is normal

                pynvml.nvmlInit()
                uuid = str(getattr(torch.cuda.get_device_properties(self.device), "uuid", ""))
                if uuid and not uuid.startswith("GPU-"):
                    uuid = "GPU-" + uuid
                handle = pynvml.nvmlDeviceGetHandleByUUID(uuid) if uuid else pynvml.nvmlDeviceGetHandleByIndex(
                    self.device.index or 0)
                self._nvml = (pynvml, handle)
            pynvml, handle = self._nvml
            pid = os.getpid()
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == pid and proc.usedGpuMemory is not None:
                    return int(proc.usedGpuMemory)
            return None
        except Exception:  # noqa: BLE001 - no NVML, no permission, containers hiding pids: normal
            self._nvml_failed = True
            return None
