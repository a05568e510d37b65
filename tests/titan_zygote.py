"""A fork server for torchtitan Trainer runs (tests/test_titan_trainer.py): imports ``torchtitan.train`` and
``fsdp_doctor.titan`` once, then forks the ranks of each run it is asked for, as torchrun would start them (its
environment: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT ...), each running ``python -m MODULE ARGS`` in
the run's folder with its output in a file. A spawned rank spends 12.6 s importing ``torchtitan.train`` and torchrun
another process importing torch: 7 launches of the test file spent ~200 of its ~290 core-seconds there.

Protocol, one JSON line each way: the server prints {"ready": true} once imported; a request
{"module", "args", "cwd", "env", "world", "port", "logs", "timeout_s"} is answered {"codes": [...]} once every rank
exited (a rank past the timeout is killed: -9). Only the first launch of the test file runs under torchrun itself,
as its users start it.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import time
import traceback


def _rank(req: dict, rank: int) -> None:
    """In the forked child: the rank's environment, folder, output and command line, then the module as __main__."""
    code = 1
    try:
        fd = os.open(req["logs"][rank], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.chdir(req["cwd"])
        world = req["world"]
        os.environ.clear()
        os.environ.update(req["env"])
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), ROLE_WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(req["port"]), TORCHELASTIC_RUN_ID="zygote")
        sys.argv = [req["module"], *req["args"]]
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _serve(req: dict) -> list[int]:
    pids = []
    for rank in range(req["world"]):
        pid = os.fork()
        if pid == 0:
            _rank(req, rank)
        pids.append(pid)
    codes: dict[int, int] = {}
    deadline = time.monotonic() + req.get("timeout_s", 420)
    while len(codes) < len(pids):
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
        if len(codes) < len(pids):
            if time.monotonic() > deadline:
                for pid in pids:
                    if pid not in codes:
                        os.kill(pid, signal.SIGKILL)
                        os.waitpid(pid, 0)
                        codes[pid] = -9
            time.sleep(0.05)
    return [codes[p] for p in pids]


def main() -> None:
    proto = os.fdopen(os.dup(1), "w")  # answers on a copy of stdout; stdout itself goes to stderr (imports log)
    os.dup2(2, 1)
    import torchtitan.train  # noqa: F401  (once: the ranks fork with it imported)

    import fsdp_doctor.titan  # noqa: F401

    print(json.dumps({"ready": True}), file=proto, flush=True)
    for line in sys.stdin:
        if line.strip():
            print(json.dumps({"codes": _serve(json.loads(line))}), file=proto, flush=True)


if __name__ == "__main__":
    main()
