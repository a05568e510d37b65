"""Which decoded windows may be analysed together: one job, one file per rank and window. Traces carry their
identity (``distributedInfo``: rank, world size, backend; ``baseTimeNanoseconds`` and the timestamps: when
each step ran), and a folder may hold more than one job or the same file twice. A window left out is named
with the reason, never summed with another or dropped without a word:

* a file with no rank (no ``distributedInfo.rank``, none in its name) among several: it cannot be told apart
  from the other ranks' files (one file alone is read as rank 0);
* another job: a world size or backend other than the other files' (the most files' wins; on a tie the first
  file's); other FSDP units in a complete step than the other files' same step (the ranks of one job shard one
  model: each step runs the same units on every rank; the most files' wins, on a tie the first file's; a step
  without FSDP2's labels, or not held whole, is not compared, nor a rank that may hold part of the model: one
  that sends point-to-point, or whose FSDP collectives run on a group smaller than the world, as pipeline
  stages do); or the same step run more than ``JOB_SKEW_S`` apart from the other ranks' same step;
* a file without any FSDP2 collective among files that issue them (a DDP or single-process run's trace);
* a file with no profiler step and no FSDP2 collective beside files of its rank that hold them: not a trace of
  this run (a new user's one-event file named like a rank's);
* another run profiled into the same folder (``tensorboard_trace_handler`` adds files): where a rank holds a step
  twice, seconds apart, the files holding that step are split into runs by when they ran it, and the run with the
  most ranks is kept, the newest on a tie;
* a rank claimed twice: two files of one rank whose steps (or, without steps, time spans) overlap, or whose time
  is not known; the file with profiler steps or FSDP2 collectives is kept, then the first by name;
* a window that started after its rank's records ended (``ended``: the run's End record per rank): another run
  profiled into the run's folder later (a rank still running has no End record: nothing is said of its files);
  one that ended before its rank's records started (``started``: their header's): another run profiled earlier.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from ..report_sections import SkippedFile
from ..units import fmt_duration, list_item, printable, steps_phrase, unit_label
from .model import OTHER_UNIT, WindowTrace

# the ranks of one job start a step within this of each other (clocks of one cluster). Not less: a rank that saves
# a checkpoint, stalls in its data loader or compiles its first step starts the step later, and the others wait for
# it in their first collective up to the collective's timeout (NCCL's default: 10 min) before the job fails; two
# runs of different models minutes apart are told apart by their FSDP units instead
JOB_SKEW_S = 600.0
# two files of one rank that ran the same step at least this far apart are two runs (a copy of a file, or a rank's
# file twice, ran it at the same time); no run starts its processes and reaches a profiled step sooner
RERUN_MIN_GAP_S = 1.0


def admit(windows: list[WindowTrace], ended: dict[int, float] | None = None,
          started: dict[int, float] | None = None) -> tuple[list[WindowTrace], list[SkippedFile]]:
    """``(kept, skipped)``: the windows that belong to one job, one per rank and window, in their order.
    ``ended``: when each rank of the run the windows are read with ended (s since the epoch; a rank not in it has
    not, or no run is known); ``started``: when each rank's records started (s since the epoch)."""
    ended, started = ended or {}, started or {}
    if len(windows) < 2 and not ended and not started:
        return list(windows), []
    names = _display_names(windows)
    skipped: dict[int, str] = {}
    order = sorted(range(len(windows)), key=lambda i: windows[i].file)

    # the run's own windows all started before its End record (its profiler stops before the record is written): a
    # later one is another process's (a new-user trial's plain torch.profiler traces, made 4 min after a run into its
    # folder, were read with the run's own window as one job, the foreign step 2 beside the run's step 6, exit 0)
    for i in order:
        w = windows[i]
        end = ended.get(w.rank) if w.rank_known else max(ended.values(), default=None)
        start = _start_s(w)
        if end is not None and start is not None and start - end > RERUN_MIN_GAP_S:
            skipped[i] = (f"another run (it started {fmt_duration(start - end)} after rank {w.rank}'s records ended: "
                          "profiled into the same folder after the run?); skipped")
        # and before them: a window that ended before its rank's records started (watch() entry) is another
        # process's, one profiler wrapping watch() itself is not (a new-user trial's plain torch.profiler traces,
        # made by a process 26 s before a run that profiled nothing, were read as its own: "source: profiler trace,
        # step 2", exit 0)
        began = started.get(w.rank) if w.rank_known else min(started.values(), default=None)
        stop = _end_s(w)
        if i not in skipped and began is not None and stop is not None and began - stop > RERUN_MIN_GAP_S:
            skipped[i] = (f"another run (it ended {fmt_duration(began - stop)} before rank {w.rank}'s records started: "
                          "profiled into the same folder before the run?); skipped")
    if len(windows) - len(skipped) < 2:
        kept = [w for i, w in enumerate(windows) if i not in skipped]
        return kept, [SkippedFile(file=names[i], error=skipped[i]) for i in order if i in skipped]

    for i in order:
        if not windows[i].rank_known:
            skipped[i] = ("no rank (no distributedInfo.rank, none in the file name): among several files it cannot "
                          "be told apart from the other ranks'; skipped")
    for attr, what in (("world_size", "world size"), ("backend", "backend")):
        vals = {i: getattr(windows[i], attr) for i in order if i not in skipped and getattr(windows[i], attr)}
        if len(set(vals.values())) > 1:
            main = _majority(vals)
            for i, v in vals.items():
                if v != main:
                    skipped[i] = f"another job ({what} {v}; the other files' is {main}); skipped"

    by_step: dict[int, list[int]] = {}  # step -> the windows holding it whole, in the files' order
    for i in order:
        if i not in skipped:
            for n in windows[i].steps:
                by_step.setdefault(n, []).append(i)

    # a folder profiled into again: the rerun's files beside the first run's (a new-user trial's rerun with a fix was
    # skipped as "rank 0 again" while the first run's files were analysed; one rank's file of a later run beside
    # both of an earlier one read as one job with it, the earlier run's own file of that rank skipped). Where a rank
    # holds a step twice, seconds apart, the files holding it are split into runs in the order they ran it (the
    # ranks of one run start a step together; a rank already in the run, later, starts another). Before the units
    # and counts are compared: a fix often changes them (set_requires_gradient_sync: 6 reduce-scatters a step where
    # the first run issued 24; a model wrapped per block where it was one unit), and the runs then tied 2 files to
    # 2, the first by name kept, the rerun with the fix skipped as "another job" (a new-user trial)
    for n, idx in sorted(by_step.items()):
        idx = [i for i in idx if i not in skipped]
        starts = {i: _step_start_s(windows[i], n) for i in idx}
        if max(Counter(windows[i].rank for i in idx).values(), default=0) < 2 or None in starts.values():
            continue
        runs: list[list[int]] = []
        for i in sorted(idx, key=starts.get):
            if runs and (all(windows[j].rank != windows[i].rank for j in runs[-1])
                         or starts[i] - starts[runs[-1][0]] < RERUN_MIN_GAP_S):
                runs[-1].append(i)
            else:
                runs.append([i])
        if len(runs) < 2:
            continue
        keep = max(runs, key=lambda r: (len({windows[i].rank for i in r}), starts[r[0]]))
        kept_in = {str(Path(names[i]).parent) for i in keep}
        for r in runs:
            if r is not keep:
                dt = starts[keep[0]] - starts[r[0]]
                # (runs in folders of their own under the one analysed were asked "profiled into the same folder
                # again?": a new-user trial)
                apart = {str(Path(names[i]).parent) for i in r}.isdisjoint(kept_in)
                where = (f" in {', '.join(sorted(kept_in)) if len(kept_in) < 3 else 'their folders'}: another "
                         "run's folder beside it; analyze one run's folder" if apart else
                         ": profiled into the same folder again?")
                for i in r:
                    skipped[i] = (f"another run (its step {n} ran {fmt_duration(abs(dt))} "
                                  f"{'before' if dt > 0 else 'after'} the step {n} of {_files(len(keep))} kept{where}); "
                                  "skipped")

    # the ranks of one job shard one model: the same step runs the same FSDP units on every rank (but where a rank
    # may hold part of the model: pipeline stages hold different units)
    split: dict[int, bool] = {}

    def part(i: int) -> bool:  # _part_of_the_model reads every call of the window: once each
        if i not in split:
            split[i] = _part_of_the_model(windows[i])
        return split[i]
    for n, idx in sorted(by_step.items()):
        units = {i: frozenset(windows[i].step_units[n]) for i in idx
                 if i not in skipped and n in windows[i].step_units}
        if len(set(units.values())) < 2:
            continue
        units = {i: u for i, u in units.items() if not part(i)}
        if len(set(units.values())) < 2:
            continue
        main = _majority(units)
        ran = next(windows[i].step_units[n] for i, u in units.items() if u == main)  # (in the order named)
        for i, u in units.items():
            if u != main:
                skipped[i] = f"another job (its step {n}'s {_units_differ(windows[i].step_units[n], ran)}); skipped"

    # the ranks of one job issue the same FSDP collectives in the same steps (each one is matched on every rank): a
    # rank's file whose steps hold other counts is another run's (a new-user trial reran a loop with a fix into the
    # same folder minutes later: one rank's file of each run read as one job, 2 reduce-scatters per unit on one rank
    # and 1 on the other)
    same_steps: dict[tuple, list[int]] = {}
    for i in order:
        if i not in skipped and windows[i].steps and not part(i):
            same_steps.setdefault(tuple(windows[i].steps), []).append(i)
    for steps, idx in same_steps.items():
        counts = {i: _fsdp_collectives(windows[i]) for i in idx}
        if len(idx) < 2 or len(set(counts.values())) < 2:
            continue
        main = _majority(counts)
        for i, c in counts.items():
            why = _counts_differ(c, main, len(steps))
            if why:
                skipped[i] = f"another job (its {steps_phrase(steps)} {why}); skipped"

    # every rank of an FSDP job issues FSDP2's collectives (but a rank that may hold part of the model): a file with
    # none where the others have them is another run's, a plain DDP or single-process one (a new-user trial's FSDP
    # trace of rank 0 and DDP trace of rank 1, whole-loop exports without ProfilerStep markers, read as one job whose
    # rank 1 all-reduced outside FSDP: optim.step_comm warned of it)
    fsdp = {i: bool(_fsdp_collectives(windows[i])) for i in order if i not in skipped and not part(i)}
    if any(fsdp.values()):
        for i, has in fsdp.items():
            if not has and (windows[i].calls or windows[i].steps):
                skipped[i] = ("another job (no FSDP2 collective in it, where the other files' issue them: a run "
                              "without fully_shard?); skipped")
    # a file with neither a profiler step nor an FSDP2 collective beside files of its rank that hold them is no trace
    # of the run (a new-user trial's one-event file named rank1.100.pt.trace.json, sorted first, was kept as rank 1
    # and both of rank 1's real files skipped as "rank 1 again"); a rank's only file may hold part of a step (FSDP2's
    # labels around operators without a profiler step), but one with no collective and nothing on its main thread,
    # beside other ranks' files that hold the run, is none (that file beside rank 0's alone was kept as rank 1, said
    # nowhere: "2 trace files" over a table of rank 0)
    held = {i: _holds_the_run(windows[i]) for i in order if i not in skipped}
    ranks_held = {windows[i].rank for i, has in held.items() if has}
    for i, has in held.items():
        w = windows[i]
        if not has and not part(i) and (w.rank in ranks_held
                                        or (ranks_held and not w.calls and w.span[1] <= w.span[0])):
            skipped[i] = "not a trace of this run (no profiler step, no FSDP2 collective); skipped"

    # the same step on different ranks runs at the same time: far apart, it is another job's
    for n, idx in sorted(by_step.items()):
        idx = [i for i in idx if i not in skipped]
        if len(idx) < 2:
            continue
        starts = {i: _start_s(windows[i]) for i in idx}
        known = {i: t for i, t in starts.items() if t is not None}
        if len(known) < 2:
            continue
        ts = sorted(known.values())
        mid = ts[(len(ts) - 1) // 2]
        for i, t in known.items():
            if abs(t - mid) > JOB_SKEW_S:
                skipped[i] = (f"another job (its step {n} ran {fmt_duration(abs(t - mid))} from the other files' "
                              f"step {n}); skipped")

    # one file per rank and window: of two, the one holding the run's steps or collectives, then the first by name
    kept_by_rank: dict[int, list[int]] = {}
    for i in sorted((i for i in order if i not in skipped), key=lambda i: not held[i]):
        w = windows[i]
        for j in kept_by_rank.get(w.rank, []):
            why = _same_window(windows[j], w, names[j])
            if why:
                skipped[i] = f"rank {w.rank} again ({why}): two files of one rank are never summed; skipped"
                break
            gpus = (_gpu(windows[j]), _gpu(w))
            if all(gpus) and gpus[0] != gpus[1]:  # one rank on two GPU models: two jobs (HTA's reference folder
                # holds rank 1 of two V100 runs months apart, 32 GB and 16 GB: read as one rank's two windows)
                skipped[i] = (f"another job (rank {w.rank} ran on a {gpus[1]} here, on a {gpus[0]} in {names[j]}); "
                              "skipped")
                break
        else:
            kept_by_rank.setdefault(w.rank, []).append(i)

    kept = [w for i, w in enumerate(windows) if i not in skipped]
    return kept, [SkippedFile(file=names[i], error=skipped[i]) for i in order if i in skipped]


def _gpu(w: WindowTrace) -> str:
    """The GPU model the window's trace names (its first ``deviceProperties``), "" where it names none."""
    from .meta import read_meta

    try:
        meta = read_meta(w.file)
    except Exception:  # noqa: BLE001 - a file the window was decoded from but whose head cannot be read again
        return ""
    return next((dp.name for dp in (meta.deviceProperties if meta is not None else ()) if dp.name), "")


def _fsdp_collectives(w: WindowTrace) -> frozenset:
    """The FSDP collectives the window's complete steps issue, by kind: ``(kind, count)`` pairs."""
    lo, hi = w.window if w.window is not None else (-float("inf"), float("inf"))
    c = Counter(x.collective for x in w.calls if x.unit != OTHER_UNIT and lo <= x.issue < hi)
    return frozenset(c.items())


def _counts_differ(mine: frozenset, theirs: frozenset, steps: int) -> str:
    """Where two windows' FSDP collectives differ by half or more of one kind (a call the profiler dropped is not
    another job): that kind per step, on each side; "" where they do not."""
    a, b = dict(mine), dict(theirs)
    for kind in sorted(set(a) | set(b)):
        x, y = a.get(kind, 0), b.get(kind, 0)
        if abs(x - y) >= 0.5 * max(x, y, 1):
            name = kind.replace("_", "-")
            many = lambda n: f"{n:g} {name}{'' if n == 1 else 's'}"  # noqa: E731 ("issue 12 all-gather": a trial)
            return (f"{'issue' if steps > 1 else 'issues'} {many(x / steps)} per step where the other files' issue "
                    f"{many(y / steps)}")
    return ""


def _part_of_the_model(w: WindowTrace) -> bool:
    """Whether the window's rank may hold only part of the model, its FSDP units not the other ranks': it sends or
    receives point-to-point (a pipeline's stages), or FSDP's collectives run on a group smaller than the world
    (another dimension of parallelism beside FSDP: pipeline stages among them)."""
    world = w.world_size
    for c in w.calls:
        if "send" in c.collective or "recv" in c.collective:
            return True
        if c.unit != OTHER_UNIT and world and c.group_size and c.group_size < world:
            return True
    return False


def _majority(vals: dict):
    """The value most files have (``vals``: window -> value, in the files' order); on a tie the first file's."""
    counts = Counter(vals.values())
    top = max(counts.values())
    return next(v for v in vals.values() if counts[v] == top)


_SHOWN_UNITS = 4  # a step's units named in full up to this many; more: the first two and the last
_NAME_CHARS = 32  # a unit's name shortened to this (the line stays one short line)


def _units_differ(mine, theirs) -> str:
    """Two steps' FSDP units (names in the order first named; "" the root) set against each other in a few words:
    each side's count and names; as many on both sides whose short forms read the same: the names only each has."""
    mine, theirs = list(mine), list(theirs)
    a, b, named = _short(mine), _short(theirs), "named"
    if a == b and len(mine) == len(theirs):
        only_mine, only_theirs = set(mine) - set(theirs), set(theirs) - set(mine)
        a, b = _short([u for u in mine if u in only_mine]), _short([u for u in theirs if u in only_theirs])
        named = "among them"
    return f"FSDP units: {len(mine)}, {named} {a}; the other files': {len(theirs)}, {named} {b}"


def _short(units: list) -> str:
    shown = [_unit_name(u) for u in units]
    if len(shown) > _SHOWN_UNITS:
        return f"{shown[0]}, {shown[1]} … {shown[-1]}"
    return ", ".join(shown)


def _unit_name(unit: str) -> str:
    """A unit's name for one line: the root "(root)", a grouped unit's modules in brackets, shortened."""
    name = printable(unit_label(unit))
    if len(name) > _NAME_CHARS:
        name = name[:_NAME_CHARS - 1] + "…"
    return list_item(name)


def _files(n: int) -> str:
    return "the file" if n == 1 else f"the {n} files"


def _step_start_s(w: WindowTrace, n: int):
    """When the window's step ``n`` started (s since the epoch): its window's start and the steps before ``n``."""
    t = _start_s(w)
    if t is None or w.window is None or any(k not in w.step_us for k in w.steps if k < n):
        return None
    return t + sum(w.step_us[k] for k in w.steps if k < n) / 1e6


def _start_s(w: WindowTrace):
    # (the host's start: a window that follows a device running behind it starts later)
    t = w.window[0] - w.device_lag_us if w.window is not None else (w.span[0] if w.span[1] > w.span[0] else None)
    return None if t is None else (t + w.clock_us) / 1e6


def _end_s(w: WindowTrace):
    """When the window's main thread (or compute stream) last ran (s since the epoch); None without events."""
    return (w.span[1] + w.clock_us) / 1e6 if w.span[1] > w.span[0] else None


def _holds_the_run(w: WindowTrace) -> bool:
    """Whether the window holds a profiler step or an FSDP2 collective."""
    return bool(w.steps or _fsdp_collectives(w))


def _same_window(a: WindowTrace, b: WindowTrace, a_name: str) -> str:
    """Why ``b`` cannot be read beside ``a`` (``a_name``'s) as another window of the same rank: the steps both
    hold, the time span both cover, or no time to tell them apart; "" where they are two windows."""
    if a.steps and b.steps:
        shared = sorted(set(a.steps) & set(b.steps))
        return f"{steps_phrase(shared)} also in {a_name}" if shared else ""
    sa, sb = _start_s(a), _start_s(b)
    if sa is None or sb is None:  # nothing tells them apart
        which = "either" if sa is None and sb is None else "it" if sb is None else a_name
        return f"{a_name} too, and no time in {which} tells the two apart"
    ea = sa + (a.span[1] - a.span[0]) / 1e6
    eb = sb + (b.span[1] - b.span[0]) / 1e6
    return f"the same time span also in {a_name}" if sa <= eb and sb <= ea else ""


def _display_names(windows: list[WindowTrace]) -> list[str]:
    """Each window's file, relative to the folder the files share."""
    paths = [Path(w.file) for w in windows]
    try:
        root = Path(os.path.commonpath([str(p.parent) for p in paths]))
    except ValueError:
        return [str(p) for p in paths]
    out = []
    for p in paths:
        try:
            out.append(str(p.relative_to(root)))
        except ValueError:
            out.append(str(p))
    return out
