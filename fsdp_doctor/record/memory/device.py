"""CUDA allocator and NVML figures for the memory probe (``StepRecord.memory.cuda``), and the device the probe
measures. One collaborator of :class:`fsdp_doctor.record.memory.MemoryProbe`. The CUDA/NVML paths are written
against the documented APIs; every call is guarded (they cannot run on a CPU-only machine)."""

from __future__ import annotations

import os
from typing import Any

import msgspec
import torch

from ...records import CudaMemory


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

    def allocated(self) -> int:
        """``torch.cuda.memory_allocated`` (0 off CUDA)."""
        return torch.cuda.memory_allocated(self.device) if self.is_cuda else 0

    def stats(self, step: int) -> CudaMemory:
        """Allocator and device figures. Written against torch.cuda / NVML's documented APIs; not run on
        the CPU-only development machine, so every call is guarded."""
        dev = self.device
        out: dict[str, Any] = {}
        try:
            alloc = torch.cuda.memory_allocated(dev)
            reserved = torch.cuda.memory_reserved(dev)
            out.update(allocated=alloc, reserved=reserved, fragmentation=max(0, reserved - alloc),
                       max_allocated=torch.cuda.max_memory_allocated(dev))
            stats = torch.cuda.memory_stats(dev)
            out["inactive_split_bytes"] = int(stats.get("inactive_split_bytes.all.current", 0))
            out["alloc_retries"] = int(stats.get("num_alloc_retries", 0))
            out["ooms"] = int(stats.get("num_ooms", 0))
            free, total = torch.cuda.mem_get_info(dev)
            out["device_free"] = int(free)
            out["device_total"] = int(total)
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
        if self.nvml and not self._nvml_failed:
            used = self._nvml_process_bytes()
            if used is not None:
                out["nvml_process_bytes"] = used
                if "reserved" in out:
                    out["outside_allocator"] = max(0, used - out["reserved"])
        return msgspec.convert(out, CudaMemory)

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
