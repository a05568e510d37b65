"""Number formatting with units, shared by every presenter."""

from __future__ import annotations


def fmt_bytes(n) -> str:
    if n is None:
        return "—"
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{sign}{n / div:.2f} {unit}"
    return f"{sign}{n:.0f} B"


def fmt_ms(ms) -> str:
    if ms is None:
        return "—"
    ms = float(ms)
    if abs(ms) >= 1000:
        return f"{ms / 1000:.2f} s"
    if abs(ms) >= 10:
        return f"{ms:.1f} ms"
    if abs(ms) >= 0.1:
        return f"{ms:.2f} ms"
    return f"{ms * 1000:.0f} µs"


def fmt_pct(x) -> str:
    return "—" if x is None else f"{x:.1f}%"
