"""Loading trace files into window models (:func:`~fsdp_doctor.trace.build.build_window`), in forked worker
processes when there is enough to read: errors come back as values (a ``TraceError`` each), never raised."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Callable, Iterable, Optional

from ..report_sections import SkippedFile
from .build import _gc_paused, build_window
from .model import WindowTrace
from .reader import EmptyLastStep, TraceError, decode

# Decoding in worker processes pays off once there is this much JSON to read (gzip counted as 8x its size;
# one process decodes and reduces roughly 100-200 MB of trace JSON per second; forking a worker ~10 ms).
PARALLEL_MIN_BYTES = 16 << 20
GZIP_RATIO = 8
_CAN_FORK = "fork" in mp.get_all_start_methods()



def _error_value(e: TraceError) -> TraceError:
    """``e`` as a value to return: a new one of its kind, without the traceback that holds the decoded trace."""
    return EmptyLastStep(str(e), e.rank, e.step) if isinstance(e, EmptyLastStep) else TraceError(str(e))


def load_window(path: str):
    """The window model of one trace file, or a TraceError (returned, not raised) saying in one line why not (an
    EmptyLastStep where its one profiler step ran nothing)."""
    try:
        return build_window(path)
    except TraceError as e:
        return _error_value(e)
    except Exception as e:  # a reader must never take the CLI down with a traceback
        return TraceError(f"cannot analyze ({type(e).__name__}: {e})")


_load = load_window


def _worker(paths: list[str], conn) -> None:
    """A forked worker: receives file indices, sends back (index, window or TraceError), until None. Each file's
    decoded events (hundreds of thousands of objects) are freed only when the next file comes, so the memory
    is reused rather than faulted in afresh; the last file's are never freed: the worker leaves with
    os._exit (nothing of the parent's to flush or finalize)."""
    gc.disable()  # no cycles here; see build._gc_paused
    trace = None
    try:
        while True:
            i = conn.recv()
            if i is None:
                break
            trace = None
            try:
                trace = decode(Path(paths[i]))
                res = build_window(paths[i], trace)
            except TraceError as e:
                res = _error_value(e)
            except Exception as e:  # as in _load
                res = TraceError(f"cannot analyze ({type(e).__name__}: {e})")
            conn.send((i, res))
    except BaseException:  # the parent sees EOF and reports the file as not analysed
        pass
    finally:
        os._exit(0)


def _load_forked(paths: list[Path], n_workers: int, on_result: Callable[[int, object], None]) -> None:
    """Forked workers (at most ``n_workers``) take the files one at a time, largest first. The cyclic GC is
    paused in the parent meanwhile: unpickling a window makes thousands of small objects and no cycles."""
    from multiprocessing.connection import wait

    ctx = mp.get_context("fork")
    names = [str(p) for p in paths]
    sizes = [p.stat().st_size if p.exists() else 0 for p in paths]
    todo = sorted(range(len(paths)), key=lambda i: -sizes[i])
    busy: dict = {}  # parent's end of a worker's pipe -> (file index, process)

    def start_worker() -> bool:
        here, there = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=_worker, args=(names, there), daemon=True)
        try:
            proc.start()
        except (OSError, AssertionError):  # no process to be had (limits; a daemonic parent)
            here.close()
            there.close()
            return False
        there.close()
        i = todo.pop(0)
        here.send(i)
        busy[here] = (i, proc)
        return True

    with _gc_paused():
        try:
            while todo and len(busy) < n_workers and start_worker():
                pass
            while busy:
                for conn in wait(list(busy)):
                    i, proc = busy.pop(conn)
                    try:
                        _, res = conn.recv()
                        alive = True
                    except (EOFError, OSError):
                        res, alive = TraceError("cannot analyze (the worker process died)"), False
                    except Exception as e:
                        res, alive = TraceError(f"cannot analyze ({type(e).__name__}: {e})"), False
                    on_result(i, res)
                    if alive and todo:
                        i = todo.pop(0)
                        conn.send(i)
                        busy[conn] = (i, proc)
                        continue
                    if alive:
                        conn.send(None)
                    conn.close()
                    proc.join()
                    if todo:  # a worker died: replace it
                        start_worker()
            for i in list(todo):  # no worker to be had: in this process
                todo.remove(i)
                on_result(i, _load(names[i]))
        finally:
            for conn, (_, proc) in busy.items():  # only on an error in the parent (e.g. KeyboardInterrupt)
                proc.kill()
                proc.join()
                conn.close()


def _display(path: Path, root: Optional[Path]) -> str:
    if root is not None and root.is_dir():
        try:
            return str(path.relative_to(root))
        except ValueError:
            pass
    return path.name


def load_windows(paths: Iterable[Path], *, progress: Optional[Callable[[int, int], None]] = None,
                 workers: Optional[int] = None, root: Optional[Path] = None, empty_last: Optional[list] = None):
    """Build the model for each file; returns (windows, skipped). Files are decoded in parallel processes
    when there are several and they are large enough to pay for it. With ``empty_last`` (a list), the files whose
    one profiler step ran nothing go there, as (SkippedFile, EmptyLastStep), instead of into skipped."""
    paths = list(paths)
    total = len(paths)
    results: dict[int, object] = {}
    size = sum(p.stat().st_size * (GZIP_RATIO if p.name.endswith(".gz") else 1) for p in paths if p.exists())
    n_workers = workers if workers is not None else min(total, os.cpu_count() or 1)
    done = 0
    if progress:
        progress(0, total)
    parallel = n_workers > 1 and total > 1 and size >= PARALLEL_MIN_BYTES
    if parallel and _CAN_FORK:
        def on_result(i, res):
            nonlocal done
            results[i] = res
            done += 1
            if progress:
                progress(done, total)

        _load_forked(paths, n_workers, on_result)
    elif parallel:  # no fork (Windows): a pool of spawned processes
        with ProcessPoolExecutor(max_workers=n_workers) as pool:
            futs = {pool.submit(_load, str(p)): i for i, p in enumerate(paths)}
            for f in as_completed(futs):
                results[futs[f]] = f.result()
                done += 1
                if progress:
                    progress(done, total)
    else:
        for i, p in enumerate(paths):
            results[i] = _load(str(p))
            done += 1
            if progress:
                progress(done, total)
    windows, skipped = [], []
    for i, p in enumerate(paths):
        r = results[i]
        if isinstance(r, WindowTrace):
            windows.append(r)
        elif empty_last is not None and isinstance(r, EmptyLastStep):
            empty_last.append((SkippedFile(file=_display(p, root), error=str(r)), r))
        else:
            skipped.append(SkippedFile(file=_display(p, root), error=str(r)))
    return windows, skipped
