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


UNKNOWN = "unknown"  # a figure this torch's FSDP2 internals did not let the recorder read (None in the records)


def fmt_unit_figures(u: dict) -> tuple[str, str, str, str]:
    """(params, shard, gathered, reshard) of a unit-table row; ``unknown`` where the record has None."""
    pc = u.get("param_count", 0)
    raf = u.get("reshard_after_forward", True)
    return (UNKNOWN if pc is None else f"{pc / 1e6:.2f} M",
            *(UNKNOWN if u.get(k, 0) is None else fmt_bytes(u.get(k, 0)) for k in ("sharded_bytes", "unsharded_bytes")),
            UNKNOWN if raf is None else str(raf).lower())


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


def fmt_value(key: str, v, max_items: int = 8) -> str:
    """An evidence value formatted by the unit its key names (``_bytes``, ``_ms``, ``_us``, ``_pct``,
    ``_gbps``); lists are shortened, dicts formatted item by item. Shared by every presenter."""
    if isinstance(v, bool) or v is None:
        return "—" if v is None else str(v).lower()
    if isinstance(v, (int, float)):
        if key.endswith("_bytes") or key == "bytes":
            return fmt_bytes(v)
        if key.endswith("_ms") or "_ms_" in key:
            return fmt_ms(v)
        if key.endswith("_us"):
            return fmt_ms(v / 1e3)
        if key.endswith("_pct"):
            return f"{v:.1f}%"
        if key.endswith("_gbps"):
            return f"{v:.2f} GB/s"
        return f"{v:,.4g}" if isinstance(v, float) else f"{v:,}"
    if isinstance(v, (list, tuple)):
        s = ", ".join(str(x) for x in v[:max_items])
        return s + (f" … (+{len(v) - max_items})" if len(v) > max_items else "")
    if isinstance(v, dict):
        return ", ".join(f"{k}: {fmt_value(k, x)}" for k, x in v.items())
    return str(v)


def run_facts(run: dict) -> list[str]:
    """The short facts of a run for a header line: ranks, units, parameters, backend, device, versions."""
    facts = []
    if run.get("world_size"):
        facts.append(f"{run['world_size']} ranks")
    if run.get("units"):
        facts.append(f"{run['units']} FSDP units")
    if run.get("model_param_count"):
        facts.append(f"{run['model_param_count'] / 1e6:.2f} M params")
    for k in ("backend", "device_name", "torch_version", "optimizer"):
        if run.get(k):
            facts.append(str(run[k]))
    return facts
