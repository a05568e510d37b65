"""Interval arithmetic on numpy arrays (times in µs, float64).

An *interval set* is a pair ``(starts, ends)`` of equal-length float64 arrays. ``union`` returns the
canonical form: sorted, disjoint, non-touching intervals. Every other function expects canonical sets
where it says so.
"""

from __future__ import annotations

import numpy as np

Intervals = tuple[np.ndarray, np.ndarray]

EMPTY: Intervals = (np.zeros(0), np.zeros(0))


def as_intervals(starts, ends) -> Intervals:
    s = np.asarray(starts, dtype=np.float64).reshape(-1)
    e = np.asarray(ends, dtype=np.float64).reshape(-1)
    if s.shape != e.shape:
        raise ValueError("starts and ends differ in length")
    return s, e


def union(starts, ends) -> Intervals:
    """Merge possibly overlapping intervals into sorted disjoint ones (zero/negative lengths dropped)."""
    s, e = as_intervals(starts, ends)
    keep = e > s
    if not keep.all():
        s, e = s[keep], e[keep]
    del keep
    if s.size == 0:
        return EMPTY
    # (few copies alive at once: a GPU window may hold millions of events)
    order = np.argsort(s, kind="stable")
    s = s[order]
    e_max = e[order]
    del order
    np.maximum.accumulate(e_max, out=e_max)
    # a new group starts where an interval begins after everything before it has ended
    brk = s[1:] > e_max[:-1]
    first = np.concatenate(([True], brk))
    last = np.concatenate((brk, [True]))
    return s[first], e_max[last]


def measure(iv: Intervals) -> float:
    """Total length of a canonical interval set."""
    s, e = iv
    return float(np.sum(e - s)) if s.size else 0.0


def union_many(*sets: Intervals) -> Intervals:
    if not sets:
        return EMPTY
    return union(np.concatenate([s for s, _ in sets]), np.concatenate([e for _, e in sets]))


def _cumulative(iv: Intervals):
    s, e = iv
    return np.concatenate(([0.0], np.cumsum(e - s)))


def covered_before(iv: Intervals, t, cum=None) -> np.ndarray:
    """For each time in ``t``: measure of ``iv`` ∩ (-inf, t]. ``iv`` must be canonical."""
    s, e = iv
    t = np.asarray(t, dtype=np.float64)
    if s.size == 0:
        return np.zeros_like(t)
    if cum is None:
        cum = _cumulative(iv)
    # k = number of intervals that start at or before t
    k = np.searchsorted(s, t, side="right")
    full = cum[np.maximum(k - 1, 0)]  # intervals strictly before interval k-1
    idx = np.maximum(k - 1, 0)
    partial = np.clip(t - s[idx], 0.0, e[idx] - s[idx])
    return np.where(k > 0, full + partial, 0.0)


def overlap_each(starts, ends, iv: Intervals) -> np.ndarray:
    """For each interval [starts[i], ends[i]): its overlap with the canonical set ``iv``."""
    s, e = as_intervals(starts, ends)
    if s.size == 0:
        return np.zeros(0)
    cum = _cumulative(iv)
    return np.maximum(covered_before(iv, e, cum) - covered_before(iv, s, cum), 0.0)


def intersection_measure(a: Intervals, b: Intervals) -> float:
    """Measure of a ∩ b for canonical sets a and b."""
    if a[0].size == 0 or b[0].size == 0:
        return 0.0
    return float(np.sum(overlap_each(a[0], a[1], b)))


def intersect(a: Intervals, b: Intervals) -> Intervals:
    """a ∩ b as a canonical set (a and b canonical)."""
    if a[0].size == 0 or b[0].size == 0:
        return EMPTY
    times = np.concatenate((a[0], a[1], b[0], b[1]))
    delta = np.concatenate(
        (np.ones(a[0].size), -np.ones(a[1].size), 2 * np.ones(b[0].size), -2 * np.ones(b[1].size))
    )
    order = np.lexsort((delta, times))  # ends (-) before starts (+) at equal times
    times, delta = times[order], delta[order]
    running = np.cumsum(delta)
    both = running == 3
    s = times[:-1][both[:-1]]
    e = times[1:][both[:-1]]
    return union(s, e)


def subtract(a: Intervals, b: Intervals) -> Intervals:
    """a minus b for canonical sets."""
    if a[0].size == 0 or b[0].size == 0:
        return a
    times = np.concatenate((a[0], a[1], b[0], b[1]))
    delta = np.concatenate(
        (np.ones(a[0].size), -np.ones(a[1].size), 2 * np.ones(b[0].size), -2 * np.ones(b[1].size))
    )
    order = np.lexsort((delta, times))
    times, delta = times[order], delta[order]
    running = np.cumsum(delta)
    only_a = running == 1
    s = times[:-1][only_a[:-1]]
    e = times[1:][only_a[:-1]]
    return union(s, e)
