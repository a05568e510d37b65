"""What ``fsdp_doctor.watch(model, optimizer, **options)`` accepts: one :class:`WatchOptions`, read by the Doctor."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class WatchOptions:
    """Options of :func:`fsdp_doctor.watch`.

    Args:
        out_dir: the run directory; each rank writes its own record stream there.
        capacity_bytes: memory budget per rank the diagnosis compares against (default: the GPU's total
            memory, or the share ``torch.cuda.set_per_process_memory_fraction`` left this process; none on CPU).
        profile: torch.profiler windows: True (default schedule: 2 steps from step 6, then every 1000),
            False, a schedule callable (``torch.profiler.schedule(...)`` or :class:`ProfileSchedule`), or a
            dict of ``torch.profiler.profile`` arguments.
        profile_ranks: the global ranks that record those windows (default: every rank). The others write no
            trace and mark the same steps as window steps, left out of their step statistics as the profiled
            ranks' are (their collectives wait for the profiled ranks' slower steps). A large job's traces (one
            per rank and window) fill a shared file system; its records, on every rank, carry the step times,
            memory and stragglers.
        tokens_per_step: tokens the whole job processes per (optimizer) step, each counted once: the ranks of a
            tensor-parallel group share theirs (enables tokens/s).
        peak_tflops: the device's peak TFLOP/s for MFU (default: a table of common GPUs).
        count_flops: count the FLOPs of step 1 (the operators are observed as they run, never changed) for MFU
            and HFU (default: when tokens_per_step or peak_tflops is given).
        memory: memory by category: True (default: full sampling on steps 0-2, then adaptively within
            0.3% of the step time), False (off), or a dict of options, e.g. {"full_every": 1}
            (see fsdp_doctor.record.memory).
        tensorboard: also write TensorBoard scalars live to ``out_dir/tb/rank{R}`` (step time and split, memory
            at the peak, overlap of profiled steps). Off by default: TensorBoard's event writer costs 2-4% of the
            CPU of a step here (its CRC32C and protobuf work run in Python on a background thread that competes
            with training). ``fsdp-doctor tensorboard OUT_DIR`` writes the same scalars afterwards, at no
            cost to training.
        overwrite: a run directory holds one run: an earlier run's records in ``out_dir`` are moved aside to
            ``previous/run-ID/`` below it (False), or removed (True: manifest, record streams, profiler/, tb/,
            report.json), but kept aside in a process that restarts the job (TORCHELASTIC_RESTART_COUNT > 0).
    """

    out_dir: str | os.PathLike
    capacity_bytes: int | None = None
    profile: Any = True
    profile_ranks: Any = None
    tokens_per_step: int | None = None
    peak_tflops: float | None = None
    count_flops: bool | None = None
    memory: Any = True
    tensorboard: bool = False
    overwrite: bool = False

    def __post_init__(self):
        # a budget or a token count of the wrong type was written into the config record as it came ("8GB", a float
        # from 0.9 * total), which analysis then refused whole: the run lost its units and most of its rules (a
        # new-user trial); a number is taken as a whole count, anything else refused here, in one line
        for name in ("capacity_bytes", "tokens_per_step"):
            object.__setattr__(self, name, _count(name, getattr(self, name)))
        object.__setattr__(self, "profile_ranks", _ranks("profile_ranks", self.profile_ranks))

    @property
    def counts_flops(self) -> bool:
        if self.count_flops is not None:
            return bool(self.count_flops)
        return self.tokens_per_step is not None or self.peak_tflops is not None

    @classmethod
    def from_kwargs(cls, options: dict) -> "WatchOptions":
        """The options from ``watch()``'s keywords; an unknown or missing one is a ``TypeError`` naming it."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise TypeError(f"fsdp_doctor.watch: unknown option(s) {', '.join(unknown)} (options: {', '.join(names)})")
        if "out_dir" not in options:
            raise TypeError("fsdp_doctor.watch: out_dir is required (the run directory)")
        return cls(**options)


def _ranks(name: str, v) -> tuple[int, ...] | None:
    """``v`` (ranks: an int or an iterable of them) as a sorted tuple of distinct ranks, None as None; anything else
    a ``TypeError`` or ``ValueError`` naming the option."""
    import numbers

    if v is None:
        return None
    try:
        items = [v] if isinstance(v, numbers.Integral) else list(v)
    except TypeError:
        raise TypeError(f"fsdp_doctor.watch: {name} takes ranks (an int or a list of ints), not {v!r}") from None
    out = sorted({int(r) for r in items if isinstance(r, numbers.Integral) and not isinstance(r, bool)})
    if not out or len(out) != len(set(items)) or any(r < 0 for r in out):
        raise ValueError(f"fsdp_doctor.watch: {name} takes one or more ranks, ints from 0, not {v!r}")
    return tuple(out)


def _count(name: str, v):
    """``v`` as a positive whole count (a float rounded down: ``0.9 * total_memory``), None as None; anything else a
    ``TypeError`` or ``ValueError`` naming the option."""
    import math
    import numbers

    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"fsdp_doctor.watch: {name} must be a number"
                        f"{' of bytes (e.g. 80 * 2**30)' if name == 'capacity_bytes' else ''}, got {v!r} "
                        f"({type(v).__name__})")
    if not math.isfinite(v) or v < 1:
        raise ValueError(f"fsdp_doctor.watch: {name} must be a positive number, got {v!r}")
    return int(v)
