"""A fork server for torchtitan's ranks (tests/test_titan_trainer.py's Trainer runs, tests/test_titan.py's cases):
imports ``torchtitan.train``, ``fsdp_doctor.titan`` and ``titan_cases`` once, then forks the ranks of each run it
is asked for, as torchrun would start them (its environment: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
...), each running ``python -m MODULE ARGS`` in the run's folder with its output in a file. A spawned rank spends
12.6 s importing ``torchtitan.train`` (a test case's rank 4.6 s importing torchtitan's llama3) and torchrun
another process importing torch: 7 launches of the Trainer's test file spent ~200 of its ~290 core-seconds there.

Protocol, one JSON line each way: the server prints {"ready": true} once imported; a request
{"module", "args" (or "argv": each rank's), "cwd", "env", "world", "port", "logs" (each rank's output: stdout and
stderr, or stdout only where "errs" names the stderr files), "timeout_s"} is answered {"codes": [...]} once every
rank exited (a rank past the timeout is killed: -9). ``forked`` is the tests' side: one server a session, started
on the first run. Only the first Trainer launch of the test file runs under torchrun itself, as its users start it.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path


def _rank(req: dict, rank: int) -> None:
    """In the forked child: the rank's environment, folder, output and command line, then the module as __main__."""
    code = 1
    try:
        for fds, path in (((1, 2), req["logs"][rank]),) if not req.get("errs") else \
                (((1,), req["logs"][rank]), ((2,), req["errs"][rank])):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            for to in fds:
                os.dup2(fd, to)
            os.close(fd)
        os.chdir(req["cwd"])
        world = req["world"]
        os.environ.clear()
        os.environ.update(req["env"])
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), ROLE_WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(req["port"]), TORCHELASTIC_RUN_ID="zygote")
        sys.argv = [req["module"], *(req["argv"][rank] if "argv" in req else req["args"])]
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
    import titan_cases  # noqa: F401  (tests/test_titan.py's ranks: torchtitan's llama3 and qwen3, parallelized)

    print(json.dumps({"ready": True}), file=proto, flush=True)
    for line in sys.stdin:
        if line.strip():
            print(json.dumps({"codes": _serve(json.loads(line))}), file=proto, flush=True)


_SERVER: list = []  # the tests' fork server, started on the first run of the session


def forked(module: str, argv, *, cwd: Path, env: dict[str, str], world: int, port: int, logs: list[str],
           errs: list[str] | None = None, timeout_s: float = 420) -> list[int]:
    """Runs ``python -m MODULE`` on ``world`` ranks forked from the session's server (``argv``: the arguments, or a
    list of each rank's), each rank's output in ``logs`` (stderr in ``errs`` if given); each rank's exit code."""
    if not _SERVER:
        here = Path(__file__).resolve().parent
        from titan_cases import TITAN_SITE

        path = [str(TITAN_SITE), str(here), str(here.parent)]
        path += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in path]
        z = subprocess.Popen([sys.executable, str(here / "titan_zygote.py")], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=cwd,
                             env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(path)})
        ready = z.stdout.readline()
        assert ready.strip() == '{"ready": true}', f"titan_zygote did not start: {ready!r}"
        _SERVER.append(z)
        atexit.register(_stop)
    z = _SERVER[0]
    req = {"module": module, "cwd": str(cwd), "env": env, "world": world, "port": port, "logs": logs,
           "timeout_s": timeout_s, **({"errs": errs} if errs else {})}
    req.update({"argv": argv} if argv and isinstance(argv[0], list) else {"args": list(argv)})
    z.stdin.write(json.dumps(req) + "\n")
    z.stdin.flush()
    answer = z.stdout.readline()
    assert answer, f"{module}: titan_zygote exited ({z.poll()}) without an answer"
    return json.loads(answer)["codes"]


def _stop() -> None:
    while _SERVER:
        z = _SERVER.pop()
        z.stdin.close()
        try:
            z.wait(timeout=30)
        except subprocess.TimeoutExpired:
            z.kill()


if __name__ == "__main__":
    main()
