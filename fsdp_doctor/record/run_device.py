"""The device a run computes on: from the process group and FSDP's mesh, never from where a parameter lives.

With ``CPUOffloadPolicy`` every sharded parameter sits on the host while FSDP computes on the GPU; a device read
off a parameter would call that run a CPU run, skip its GPU timeline and silence the offload rules, the very
runs they exist for. The order: a NCCL process group computes on ``cuda:<current device>``; otherwise FSDP's own
compute device (its mesh's device type, which offloading does not change); otherwise a gloo group (or none)
computes on the CPU.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

from . import fsdp2 as F2


def choose_device(backend: Optional[str], fsdp_device: Optional[torch.device],
                  cuda_index: Callable[[], int]) -> torch.device:
    """The decision, on plain inputs: ``backend`` as ``dist.get_backend()`` names it (``"nccl"``, ``"gloo"``,
    ``"cpu:gloo,cuda:nccl"``, None without a process group); ``fsdp_device`` FSDP's compute device (None when
    unknown); ``cuda_index`` the current CUDA device, asked only for a NCCL group."""
    if backend and "nccl" in str(backend).lower():
        return torch.device("cuda", cuda_index())
    if fsdp_device is not None:
        return fsdp_device
    return torch.device("cpu")


def fsdp_compute_device(units: Iterable) -> Optional[torch.device]:
    """FSDP's compute device (``FSDPParamGroup.device``, read by the adapter) of the first unit that has one."""
    for u in units:
        for pg in u.param_groups:
            dev = F2.compute_device(pg)
            if dev is not None:
                return dev
    return None


def run_device(units: Iterable) -> torch.device:
    """The device of this rank's run (see the module's docstring)."""
    backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else None
    return choose_device(backend, fsdp_compute_device(units), torch.cuda.current_device)


def watching_ranks(units: Iterable) -> tuple[list[int] | None, list]:
    """The global ranks that train the watched model, and the process groups the doctor gathers over to hear from
    all of them: those of the mesh its units' FSDP meshes are cut from (a 1-D ``mesh2["shard"]``'s 2-D ``mesh2``,
    every dim's group), where that mesh leaves ranks of the world out; (None, []) where it spans the world or cannot
    be read: the default group, all ranks. A collective over the default group hangs watch() where only some ranks
    train (a new-user trial: ranks 0-1 on ``DeviceMesh.from_group(new_group([0, 1]))``, ranks 2-3 waiting in a
    barrier; killed after 120 s, nothing written)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None, []
    for u in units:
        for pg in u.param_groups:
            mesh = F2.fsdp_mesh(pg)
            root = F2.root_mesh(mesh) if mesh is not None else None
            if root is None:
                continue
            ranks = sorted(int(r) for r in root.mesh.flatten().tolist())
            if len(ranks) == dist.get_world_size():
                return None, []
            return ranks, [root.get_group(d) for d in range(root.ndim)]
    return None, []
