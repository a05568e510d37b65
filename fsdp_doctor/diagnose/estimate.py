"""Shared numbers for the rules: the run's step time and peak, per-unit views with defaults filled in, the
trace's per-unit collective rows normalised per step, and the gain estimates that several rules share.

Every estimate here is built from what this run measured (host-side unit timings, trace exposure, the
memory breakdown) plus the few stated assumptions below; a rule that lacks an input gets ``None`` and
leaves that side of its prediction empty rather than guessing.
"""

from __future__ import annotations

import re
import statistics
from typing import Any, Iterable, Optional

from ..records import unit_defaults
from .base import Context

# Defaults of UnitConfig fields that the report omits (msgspec omit_defaults).
_UNIT_DEFAULTS = unit_defaults()  # UnitConfig's defaults (fsdp_doctor.records), the one source
_TIMING_KEYS = ("fwd_ms", "ag_wait_fwd_ms", "bwd_ms", "ag_wait_bwd_ms", "recompute_ms")

# A checkpointed transformer block keeps only its input; without checkpointing it keeps roughly this many
# times the input in saved tensors (Korthikanti et al. 2022: ~34·s·b·h bytes of saved activations per
# layer in 16-bit against 2·s·b·h of input, attention scores aside). Used only where the run cannot measure it.
SAVED_PER_INPUT = 16.0
# The memory target a recommendation aims for: this share of capacity leaves room for fragmentation and
# allocator caching (the CUDA caching allocator rarely runs cleanly above ~90%).
TARGET_CAPACITY_SHARE = 0.85


# ---------------------------------------------------------------------------------------------- run-level
def step_ms(ctx: Context) -> Optional[float]:
    """The job's median step time (ms), or the median of the ranks' medians."""
    steps = ctx.section("steps")
    job = steps.get("job") or {}
    if job.get("p50_ms"):
        return float(job["p50_ms"])
    vals = [st["p50_ms"] for st in (steps.get("per_rank") or {}).values() if st.get("p50_ms")]
    return float(statistics.median(vals)) if vals else None


def phase_ms(ctx: Context, phase: str) -> Optional[float]:
    steps = ctx.section("steps")
    ph = (steps.get("job") or {}).get("phases_p50_ms") or {}
    if phase in ph:
        return float(ph[phase])
    vals = [st["phases_p50_ms"][phase] for st in (steps.get("per_rank") or {}).values()
            if st.get("phases_p50_ms") and phase in st["phases_p50_ms"]]
    return float(statistics.median(vals)) if vals else None


def backend(ctx: Context) -> Optional[str]:
    cfg = ctx.config
    if cfg is not None and cfg.backend:
        return cfg.backend
    return ctx.section("run").get("backend")


def device(ctx: Context) -> str:
    cfg = ctx.config
    if cfg is not None and cfg.device:
        return cfg.device
    return ctx.section("run").get("device") or ""


def on_gpu(ctx: Context) -> bool:
    return device(ctx).startswith("cuda")


# ---------------------------------------------------------------------------------------------- memory
def memory_per_rank(ctx: Context) -> dict[str, dict]:
    """The memory section's ``per_rank``; without one, the same shape derived from the step records'
    memory samples (steady-state steps): the highest peak with its breakdown and the activations each unit
    left at that step."""
    per_rank = ctx.section("memory").get("per_rank")
    if per_rank:
        return per_rank
    out: dict[str, dict] = {}
    run = ctx.run
    cap = ctx.config.capacity_bytes if ctx.config is not None else None
    for r, rd in (getattr(run, "ranks", None) or {}).items():
        best = None
        for s in rd.steps:
            m = s.memory
            if s.step == 0 or m is None or m.peak is None:
                continue
            if best is None or m.peak.bytes > best[1].peak.bytes:
                best = (s.step, m)
        if best is None:
            continue
        step, m = best
        pk = m.peak
        bd = dict(pk.breakdown)
        acts = m.unit_activations or {}
        out[str(r)] = {"peak_bytes": int(pk.bytes),
                       "peak_at": {"step": step, "unit": pk.unit, "phase": pk.phase},
                       "peak_breakdown": bd, "activations_peak_bytes": bd.get("activations"),
                       "capacity_bytes": cap,
                       "per_unit": [{"unit": u, "activation_bytes": int(b)} for u, b in acts.items()]}
    return out


def peak_rank(ctx: Context) -> Optional[tuple[str, dict]]:
    """(rank, its memory record) of the rank with the highest measured peak."""
    per_rank = memory_per_rank(ctx)
    best = None
    for r, m in per_rank.items():
        if m.get("peak_bytes") is None:
            continue
        if best is None or m["peak_bytes"] > best[1]["peak_bytes"]:
            best = (str(r), m)
    return best


def peak_bytes(ctx: Context) -> Optional[int]:
    pr = peak_rank(ctx)
    return int(pr[1]["peak_bytes"]) if pr else None


def capacity_bytes(ctx: Context) -> Optional[int]:
    pr = peak_rank(ctx)
    if pr and pr[1].get("capacity_bytes"):
        return int(pr[1]["capacity_bytes"])
    cfg = ctx.config
    if cfg is not None and cfg.capacity_bytes:
        return int(cfg.capacity_bytes)
    cap = ctx.section("run").get("capacity_bytes")
    return int(cap) if cap else None


def breakdown(ctx: Context) -> dict[str, int]:
    pr = peak_rank(ctx)
    return dict((pr[1].get("peak_breakdown") or {})) if pr else {}


def memory_units(ctx: Context) -> dict[str, dict]:
    """Per-unit memory rows of the peak rank, by unit name."""
    pr = peak_rank(ctx)
    if not pr:
        return {}
    return {u["unit"]: u for u in (pr[1].get("per_unit") or []) if "unit" in u}


def headroom_share(ctx: Context) -> Optional[float]:
    """peak / capacity, or None when either is unknown."""
    p, c = peak_bytes(ctx), capacity_bytes(ctx)
    if p is None or not c:
        return None
    return p / c


# ---------------------------------------------------------------------------------------------- units
def units(ctx: Context) -> list[dict]:
    """The report's unit rows with omitted defaults filled in and ``timing_p50`` always present.

    Falls back to the run's config when the report has no unit table."""
    rows = ctx.report.get("units")
    if not rows and ctx.config is not None:
        import msgspec

        rows = [msgspec.to_builtins(u) for u in ctx.config.units]
    out = []
    for u in rows or []:
        d = dict(_UNIT_DEFAULTS)
        d.update({k: v for k, v in u.items() if v is not None or k not in _UNIT_DEFAULTS})
        t = dict(u.get("timing_p50") or {})
        d["timing_p50"] = {k: float(t.get(k, 0.0) or 0.0) for k in _TIMING_KEYS}
        d["has_timing"] = bool(u.get("timing_p50"))
        out.append(d)
    return out


def param_units(ctx: Context) -> list[dict]:
    return [u for u in units(ctx) if u["param_count"] > 0]


def non_root(us: Iterable[dict]) -> list[dict]:
    return [u for u in us if not u["is_root"]]


def roots(us: Iterable[dict]) -> list[dict]:
    return [u for u in us if u["is_root"]]


def total_params(us: Iterable[dict]) -> int:
    return sum(u["param_count"] for u in us)


def mib(n: Optional[float]) -> Optional[float]:
    return None if n is None else round(n / (1 << 20), 2)


# ---------------------------------------------------------------------------------------------- trace rows
def trace_rows(ctx: Context, collective: Optional[str] = None) -> list[dict]:
    """The trace's per-unit collective rows with per-step values (``*_per_step``): counts and µs are divided
    by the number of steps the rank's profiler windows covered."""
    ov = ctx.section("overlap")
    per_rank = ov.get("per_rank") or {}
    out = []
    for row in ov.get("per_unit") or []:
        if collective is not None and row.get("collective") != collective:
            continue
        n = max(1, len((per_rank.get(str(row.get("rank"))) or {}).get("steps") or [None]))
        r = dict(row)
        r["steps"] = n
        r["count_per_step"] = row.get("count", 0) / n
        r["comm_ms_per_step"] = (row.get("comm_us") or 0.0) / n / 1e3
        r["exposed_ms_per_step"] = (row.get("exposed_us") or 0.0) / n / 1e3
        out.append(r)
    return out


def trace_exposed_by_unit(ctx: Context, collective: str = "all_gather") -> dict[tuple[str, str], float]:
    """Exposed ms per step per (unit, phase), the median over ranks."""
    acc: dict[tuple[str, str], list[float]] = {}
    for r in trace_rows(ctx, collective):
        acc.setdefault((r["unit"], r.get("phase") or ""), []).append(r["exposed_ms_per_step"])
    return {k: statistics.median(v) for k, v in acc.items()}


def steps_in_windows(ctx: Context, rank: str) -> int:
    pr = (ctx.section("overlap").get("per_rank") or {}).get(str(rank)) or {}
    return max(1, len(pr.get("steps") or [None]))


# ---------------------------------------------------------------------------------------------- estimates
def predicted(step_before=None, step_after=None, peak_before=None, peak_after=None) -> dict[str, Any]:
    def r(x, nd):
        return None if x is None else round(float(x), nd)

    return {"step_ms_before": r(step_before, 3), "step_ms_after": r(step_after, 3),
            "peak_bytes_before": None if peak_before is None else int(peak_before),
            "peak_bytes_after": None if peak_after is None else int(max(0, peak_after))}


def ag_wait_ms(u: dict, phase: str) -> float:
    return u["timing_p50"]["ag_wait_fwd_ms" if phase == "forward" else "ag_wait_bwd_ms"]


def compute_fwd_ms(u: dict) -> float:
    """A unit's forward time minus its own all-gather wait (still inclusive of nested units)."""
    t = u["timing_p50"]
    return max(0.0, t["fwd_ms"] - t["ag_wait_fwd_ms"])


# ---------------------------------------------------------------------------------------------- code names
_CKPT = "._checkpoint_wrapped_module"
_IDX = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


def strip_ckpt(fqn: str) -> str:
    return fqn.replace(_CKPT, "").replace("_checkpoint_wrapped_module.", "")


def module_expr(fqn: str, root: str = "model") -> str:
    """Python expression for a module fqn: "layers.0.attn" -> ``model.get_submodule('layers.0.attn')``,
    "norm" -> ``model.norm``; "" -> ``model``."""
    if not fqn:
        return root
    if all(part.isidentifier() for part in fqn.split(".")):
        return f"{root}.{fqn}"
    # a numbered child: get_submodule works for ModuleList and ModuleDict alike (model.layers[0] fails on a
    # ModuleDict, whose keys are strings, as torchtitan's llama has)
    return f"{root}.get_submodule({fqn!r})"


def root_last(us: list[dict]) -> list[dict]:
    """Units in the order fully_shard must be applied: nested ones first, the root last."""
    return sorted(us, key=lambda u: bool(u.get("is_root")))


def children_expr(fqn: str, root: str = "model") -> str:
    """Code iterating a block container's modules: ``model.layers.children()`` (iterating a ModuleDict itself
    would give its keys)."""
    return f"{module_expr(fqn, root)}.children()"


def unit_expr(u: dict, root: str = "model") -> str:
    mods = u.get("modules") or [u.get("name", "")]
    exprs = [module_expr(m, root) for m in mods]
    return exprs[0] if len(exprs) == 1 else "[" + ", ".join(exprs) + "]"


def block_containers(names: Iterable[str]) -> dict[str, list[int]]:
    """Repeated-block containers among module names: {"layers": [0, 1, 2, 3]} for "layers.0.attn.qkv", ..."""
    out: dict[str, set[int]] = {}
    for n in names:
        m = _IDX.match(strip_ckpt(n))
        if m:
            out.setdefault(m.group(1), set()).add(int(m.group(2)))
    return {k: sorted(v) for k, v in out.items() if len(v) >= 2}


def blocks_expr(ctx: Context, default: str = "model.layers.children()") -> str:
    """Iteration over the model's repeated blocks as code (``model.layers.children()``), from the unit names."""
    blocks = block_containers(m for u in units(ctx) for m in u["modules"])
    if not blocks:
        return default
    return children_expr(max(blocks.items(), key=lambda kv: len(kv[1]))[0])


def block_of(name: str) -> Optional[str]:
    """The repeated block a module belongs to: "layers.2.mlp.fc1" -> "layers.2"."""
    m = _IDX.match(strip_ckpt(name))
    return f"{m.group(1)}.{m.group(2)}" if m else None


def fmt_list(items: list[str], n: int = 6) -> str:
    items = [i if i else "(root)" for i in items]
    return ", ".join(items[:n]) + (f" … (+{len(items) - n})" if len(items) > n else "")


# ---------------------------------------------------------------------------------------------- ZeRO-2 per unit
def held_window(timeline: list[dict], name: str) -> Optional[tuple[int, int]]:
    """Rows [start, end) of the peak step's memory timeline during which unit ``name`` would hold its
    unsharded parameters if it were not resharded after forward, and does not now: from after its (last)
    forward_end to the point its backward all-gather is issued. FSDP2 issues it one unit early (implicit
    backward prefetch, at the pre-backward of the unit that runs backward just before it), so the window
    ends with that unit's backward_start row; a unit with no predecessor in backward ends at its own.
    None when the timeline does not show the unit's forward and backward."""
    bs = next((i for i, r in enumerate(timeline) if r.get("unit") == name and r.get("phase") == "backward_start"),
              None)
    if bs is None:
        return None
    fe = max((i for i in range(bs) if timeline[i].get("unit") == name and timeline[i].get("phase") == "forward_end"),
             default=None)
    if fe is None:
        return None
    prev = max((i for i in range(fe + 1, bs) if timeline[i].get("phase") == "backward_start"
                and timeline[i].get("unit") not in (None, "", name)), default=None)
    return fe + 1, (prev if prev is not None else bs) + 1


def zero2_peak(ctx: Context, us: list[dict]) -> Optional[int]:
    """The peak (bytes, peak rank) with reshard_after_forward=False on the units ``us``.

    Each such unit keeps its unsharded parameters (``unsharded_bytes``: FSDP2 keeps the sharded ones too)
    from its forward to its backward all-gather; they are added at every mark of the peak step's timeline
    that falls in that window (``held_window``), and the new peak is the highest mark. Without a timeline,
    or for a unit the timeline does not show, its bytes are added at the peak (the start of backward holds
    every such unit)."""
    pr = peak_rank(ctx)
    if not pr:
        return None
    peak = int(pr[1]["peak_bytes"])
    tl = pr[1].get("timeline") or []
    totals = [int(r.get("total") or 0) for r in tl]
    added = [0] * len(tl)
    flat = 0
    for u in us:
        w = held_window(tl, u["name"]) if tl else None
        if w is None:
            flat += u["unsharded_bytes"]
            continue
        for i in range(*w):
            added[i] += u["unsharded_bytes"]
    if not totals:
        return peak + flat
    return peak + flat + max(t + a for t, a in zip(totals, added)) - max(totals)


def backward_allgather_ms(ctx: Context, u: dict) -> tuple[Optional[float], str]:
    """(ms per step that compute waits for this unit's backward all-gather, source): on a GPU with a trace the
    trace's exposed time (the host runs ahead of the device there), else the recorder's ``ag_wait_bwd_ms``."""
    if on_gpu(ctx):
        tr = trace_exposed_by_unit(ctx, "all_gather")
        if tr:
            return tr.get((u["name"], "backward"), 0.0), "trace"
    return (ag_wait_ms(u, "backward"), "host") if u["has_timing"] else (None, "")


def backward_allgather_comm_ms(ctx: Context, name: str) -> Optional[float]:
    """The trace's whole backward all-gather time for a unit (ms per step, median over ranks), exposed or
    not: what keeping it gathered removes at most (on gloo its copies share the cores with compute)."""
    vals = [r["comm_ms_per_step"] for r in trace_rows(ctx, "all_gather")
            if r["unit"] == name and r.get("phase") == "backward"]
    return statistics.median(vals) if vals else None
