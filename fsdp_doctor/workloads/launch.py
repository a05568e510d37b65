"""Run the reference workload on N local processes, one command, no torchrun.

`launch` starts `nproc` ranks with torch.multiprocessing, each initialising the default process group
(gloo on CPU, nccl on CUDA) over 127.0.0.1 and a free port, and returns every rank's losses. A rank
that raises, dies or outlives `timeout_s` turns into a `WorkloadError` naming the rank and its error;
the other ranks are terminated rather than left hanging.

On the CPU the ranks are forked from multiprocessing's fork server (start method "forkserver"), which
imports torch and this package once, on the first launch: a later launch in the same process starts
its ranks in a fraction of a second instead of the ~2.5 s each spawned rank spends importing torch
(a 1-step launch of the reference workload: 5.0 s spawned, 1.3 s forked). CUDA ranks are spawned, as
before: nothing that might have initialised the driver is ever forked. Each rank takes the caller's
environment as it is at the launch (a forked rank would otherwise see the server's). Scripts that
call `launch` at import time need the usual `if __name__ == "__main__":` guard, since the ranks (or
the server) import the main module.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
import traceback
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from .config import WorkloadConfig
from .sharding import preflight
from .train import OnStep, backend_for, setup_rank, train

MASTER_ADDR = "127.0.0.1"
# what the fork server imports before it forks any rank: the main module (as a spawned rank would), and
# this module with torch, torch.distributed and FSDP behind it
_PRELOAD = ("__main__", __name__)
_TERMINATE_GRACE_S = 5.0
_PORT_ATTEMPTS = 3
_FAILURE_GRACE_S = 1.0  # after a rank fails, the others get this long to report their own errors


class WorkloadError(RuntimeError):
    """A rank of a launched workload failed; `rank` is the failing rank (None if unknown)."""

    def __init__(self, message: str, rank: Optional[int] = None) -> None:
        super().__init__(message)
        self.rank = rank


class WorkloadTimeout(WorkloadError, TimeoutError):
    """The launched workload did not finish within its time limit."""


def free_port(host: str = MASTER_ADDR) -> int:
    """A TCP port that was free on `host` a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class GpuPlan:
    """Which CUDA device each rank uses, and whether ranks share one (NCCL then needs a host id per rank)."""

    def __init__(self, devices: list[int], visible: int) -> None:
        self.devices = devices
        self.visible = visible

    @property
    def shared(self) -> bool:
        return len(set(self.devices)) < len(self.devices)

    def describe(self) -> str:
        """One line for the user: how the ranks map onto the visible GPUs."""
        n = len(self.devices)
        if not self.shared:
            return f"{n} NCCL rank{'s' if n > 1 else ''}, one GPU each (cuda:{', cuda:'.join(map(str, self.devices))})"
        return (f"{n} NCCL ranks on {self.visible} GPU{'s' if self.visible > 1 else ''}: ranks share a device, "
                f"each with its own NCCL_HOSTID so NCCL accepts them; they talk over loopback sockets, so "
                f"communication is slower than NVLink/InfiniBand and compute is shared")


def gpu_plan(cfg: WorkloadConfig, nproc: int, visible: Optional[int] = None) -> Optional[GpuPlan]:
    """The CUDA device of every rank (None on CPU): rank r uses cuda:(r mod visible).

    With fewer GPUs than ranks the ranks share devices; NCCL refuses two ranks of one host on one device
    ("Duplicate GPU detected"), so each such rank gets its own ``NCCL_HOSTID`` (see `_rank_env`).
    """
    if cfg.device != "cuda":
        return None
    visible = torch.cuda.device_count() if visible is None else visible
    if visible < 1:
        raise ValueError("device='cuda' requested but no CUDA device is visible (torch.cuda.device_count() == 0)")
    return GpuPlan([rank % visible for rank in range(nproc)], visible)


def _rank_env(cfg: WorkloadConfig, rank: int, world_size: int, port: int,
              visible: Optional[int] = None) -> dict[str, str]:
    """The environment of one spawned rank: the rendezvous and, where ranks share a GPU, its NCCL host id."""
    env = dict(MASTER_ADDR=MASTER_ADDR, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
               LOCAL_RANK=str(rank))
    plan = gpu_plan(cfg, world_size, visible)
    if plan is not None:
        # LOCAL_RANK names the device too: DeviceMesh picks it up when it sets a device itself
        env["FSDP_DOCTOR_CUDA_DEVICE"] = env["LOCAL_RANK"] = str(plan.devices[rank])
        if plan.shared:
            env["NCCL_HOSTID"] = f"fsdp-doctor-rank-{rank}"
    return env


def launch(cfg: WorkloadConfig, nproc: int = 2, watch_kwargs: Optional[dict] = None,
           timeout_s: float = 600, on_step: Optional[OnStep] = None) -> list[list[float]]:
    """Train `cfg` on `nproc` spawned ranks and return the per-step losses of every rank (rank order).

    `watch_kwargs` and `on_step` go to `train` in every rank, so they must be picklable (`on_step` a
    module-level function or an instance of a module-level class). Raises `WorkloadError` when a rank
    fails and `WorkloadTimeout` after `timeout_s` seconds.
    """
    preflight(cfg)
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    gpu_plan(cfg, nproc)  # raises with one line when CUDA is asked for and none is visible
    for attempt in range(_PORT_ATTEMPTS):
        try:
            return _launch_once(cfg, nproc, watch_kwargs, timeout_s, on_step)
        except WorkloadError as exc:
            # The free port can be taken by another process before rank 0 binds it: pick another.
            if attempt + 1 == _PORT_ATTEMPTS or not _is_port_clash(exc):
                raise
    raise AssertionError("unreachable")


def _launch_once(cfg: WorkloadConfig, nproc: int, watch_kwargs: Optional[dict], timeout_s: float,
                 on_step: Optional[OnStep]) -> list[list[float]]:
    with tempfile.TemporaryDirectory(prefix="fsdp_doctor_launch_") as tmp:
        outdir = Path(tmp)
        args = (cfg, nproc, free_port(), str(outdir), watch_kwargs, on_step, dict(os.environ))
        method = start_method(cfg.device)
        if method == "forkserver":
            forkserver_preload(_PRELOAD)
        context = mp.start_processes(_rank_main, args=args, nprocs=nproc, join=False, start_method=method)
        _wait(context, timeout_s, outdir)
        return [_read_losses(outdir, rank) for rank in range(nproc)]


def start_method(device: str) -> str:
    """How ranks on ``device`` start: forked from the fork server on the CPU, spawned on a GPU."""
    return "forkserver" if device == "cpu" else "spawn"


def forkserver_preload(modules) -> None:
    """Adds ``modules`` to what multiprocessing's fork server imports, while it has not started (it starts with
    the first process it forks, and then keeps what it imported)."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if getattr(server, "_forkserver_pid", None) is None:
        mp.set_forkserver_preload(list(dict.fromkeys([*getattr(server, "_preload_modules", []), *modules])))


def take_callers_state(environ: dict[str, str]) -> None:
    """In a rank forked from the fork server: what a process the caller started would have. The caller's
    environment at the launch (not the server's), its OMP_NUM_THREADS (read by torch at import: in the server),
    and the platform's way to start processes (a forked rank would start its own, a DataLoader's workers, from a
    fork server of its own, each importing everything again: 24 s of a Hugging Face Trainer test)."""
    import multiprocessing

    multiprocessing.set_start_method(None, force=True)
    os.environ.clear()
    os.environ.update(environ)
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _is_port_clash(exc: WorkloadError) -> bool:
    text = str(exc).lower()
    return "address already in use" in text or "eaddrinuse" in text


def _rank_main(rank: int, cfg: WorkloadConfig, world_size: int, port: int, outdir: str,
               watch_kwargs: Optional[dict], on_step: Optional[OnStep], environ: dict[str, str]) -> None:
    """Entry point of one rank: the caller's environment, init the group, train, write the losses or the error."""
    take_callers_state(environ)
    os.environ.update(_rank_env(cfg, rank, world_size, port))
    out = Path(outdir)
    try:
        device = setup_rank(cfg, int(os.environ.get("FSDP_DOCTOR_CUDA_DEVICE", rank)))
        kwargs = {"device_id": device} if device is not None else {}
        dist.init_process_group(backend_for(cfg.device), rank=rank, world_size=world_size, **kwargs)
        try:
            losses = train(cfg, rank, world_size, watch_kwargs=watch_kwargs, on_step=on_step)
            # every rank done with every collective before any rank tears gloo down: a peer destroying its
            # group while the other still has a transfer in flight aborted a rank now and then
            # ("terminate called without an active exception", SIGABRT) on a loaded host
            dist.barrier()
        finally:
            dist.destroy_process_group()
    except BaseException as exc:
        _write_json(out / f"error{rank}.json", {
            "rank": rank, "time": time.time(), "type": type(exc).__name__, "message": str(exc),
            "traceback": traceback.format_exc(),
        })
        raise
    _write_json(out / f"losses{rank}.json", losses)


def _write_json(path: Path, payload) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload))
    tmp.replace(path)


def _read_losses(outdir: Path, rank: int) -> list[float]:
    path = outdir / f"losses{rank}.json"
    if not path.exists():
        raise WorkloadError(f"rank {rank} exited without reporting its losses", rank)
    return json.loads(path.read_text())


def _wait(context, timeout_s: float, outdir: Path) -> None:
    """Join every rank; on a failure or timeout, stop the others and raise a WorkloadError."""
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=max(0.0, min(1.0, deadline - time.monotonic())),
                                grace_period=_FAILURE_GRACE_S):
            if time.monotonic() >= deadline:
                alive = [rank for rank, p in enumerate(context.processes) if p.is_alive()]
                _terminate(context)
                raise WorkloadTimeout(f"workload timed out after {timeout_s:g} s; ranks still running: "
                                      f"{alive}", alive[0] if alive else None)
    except ProcessException as exc:
        _terminate(context)
        raise _rank_error(outdir, exc) from None
    except BaseException:  # KeyboardInterrupt and the like: leave no rank behind
        _terminate(context)
        raise


def _terminate(context) -> None:
    for process in context.processes:
        if process.is_alive():
            process.terminate()
    for process in context.processes:
        process.join(_TERMINATE_GRACE_S)
        if process.is_alive():
            process.kill()
            process.join()


def _rank_error(outdir: Path, exc: ProcessException) -> WorkloadError:
    """The earliest error any rank reported (the cause; later ones are usually its echo)."""
    reports = [json.loads(p.read_text()) for p in sorted(outdir.glob("error*.json"))]
    if not reports:
        rank = getattr(exc, "error_index", None)
        return WorkloadError(f"rank {rank} failed: {str(exc).strip()}", rank)
    first = min(reports, key=lambda r: r["time"])
    others = sorted(r["rank"] for r in reports if r is not first)
    also = f" (ranks {others} failed after it)" if others else ""
    message = (f"rank {first['rank']} failed: {first['type']}: {first['message']}{also}\n\n"
               f"--- traceback of rank {first['rank']} ---\n{first['traceback']}")
    return WorkloadError(message, first["rank"])
