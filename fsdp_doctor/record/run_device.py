"""The device a run computes on: from the process group and FSDP's mesh, never from where a parameter lives.

With ``CPUOffloadPolicy`` every sharded parameter sits on the host while FSDP computes on the GPU; a device read
off a parameter would call that run a CPU run, skip its GPU timeline and silence the offload rules, the very
runs they exist for. The order: a NCCL process group computes on ``cuda:<current device>``; otherwise FSDP's own
compute device (its mesh's device type, which offloading does not change); otherwise a gloo group (or none)
computes on the CPU.
"""

from __future__ import annotations

import datetime
import itertools
import os
import pickle
import time
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


def watching_ranks(units: Iterable) -> list[int] | None:
    """The global ranks that train the watched model: those of the mesh its units' FSDP meshes are cut from (a 1-D
    ``mesh2["shard"]``'s 2-D ``mesh2``), where that mesh leaves ranks of the world out; None where it spans the world
    or cannot be read. (Their run is recorded apart, numbered 0..n-1; a collective over the default group hung
    watch() where only some ranks train: a new-user trial's ranks 0-1 on ``DeviceMesh.from_group(new_group([0,
    1]))``, ranks 2-3 waiting in a barrier, killed after 120 s with nothing written. The doctor makes none now:
    share_from_rank0.)"""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    for u in units:
        for pg in u.param_groups:
            mesh = F2.fsdp_mesh(pg)
            root = F2.root_mesh(mesh) if mesh is not None else None
            if root is None:
                continue
            ranks = sorted(int(r) for r in root.mesh.flatten().tolist())
            return None if len(ranks) == dist.get_world_size() else ranks
    return None


#: how long a rank waits at watch() for rank 0's value (s): past it, rank 0 is taken not to watch (watch() on some
#: ranks only) and this rank's doctor steps aside, training going on (the process group's timeout, 30 min, held it)
LEAD_WAIT_S = 300.0
#: watch() entries of this process that shared a value from their rank 0 (every rank of a job enters watch() as
#: often, in the same order: the n-th entry's key is the same on each)
_SHARES = itertools.count()


def share_from_rank0(rank: int, ranks: Optional[list[int]]) -> Callable:
    """A function that returns rank 0's value on every rank that calls it (rank 0 gives it, the others wait for it):
    through the job's c10d store, never a collective. ``rank``: this rank among those that train the model; ``ranks``:
    their global ranks where they are some of the world's (run_device.watching_ranks), None for all.

    A collective at watch() (all_gather_object, as before) crashed the job where only rank 0 watched (``if rank ==
    0: watch(...)``, a new-user trial): its all-gather met the other rank's FSDP all-gather ("Received data size
    doesn't match expected size" on gloo; on NCCL a hang or worse). The store's keys are outside the collectives'
    sequence: rank 0 writes its value and goes on, a rank that watches reads it. The key names the elastic attempt (a
    restarted job's store can hold the attempt before's), the ranks and this process's count of such entries."""
    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    attempt = (os.environ.get("TORCHELASTIC_RUN_ID", ""), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    who = "all" if ranks is None else "-".join(map(str, ranks))
    key = f"fsdp_doctor/lead/{attempt[0]}/{attempt[1]}/{who}/{next(_SHARES)}"

    def share(value):
        if rank == 0:
            store.set(key, pickle.dumps(value))
            return value
        began = time.monotonic()
        try:
            store.wait([key], datetime.timedelta(seconds=LEAD_WAIT_S))
        except Exception as e:  # noqa: BLE001  (c10d's timeout error; its type differs across torch releases)
            if time.monotonic() - began < LEAD_WAIT_S / 2:  # not the wait's timeout: the store itself failed
                # (rank 0's loop raised at once and its process ended, taking the store it held, as
                # torch.multiprocessing.spawn's rank 0 does: "did not enter watch() within 300 s" was said at once,
                # a new-user trial's VAE)
                why = (str(e).strip().splitlines() or [""])[0][:200]
                raise ConnectionError(f"the job's store could not be read ({type(e).__name__}: {why}): the process "
                                      "holding it (rank 0's, where torch.multiprocessing.spawn started the job) may "
                                      "have ended first") from None
            raise TimeoutError(f"rank 0 did not enter watch() within {LEAD_WAIT_S:.0f} s (watch() on some ranks "
                               f"only?): {type(e).__name__}") from None
        return pickle.loads(store.get(key))

    return share
