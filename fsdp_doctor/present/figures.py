"""Pure figure builders: typed report sections (``fsdp_doctor.report_sections``), step columns and trace
intervals in, plotly figures out. The dashboard and the HTML report both draw with them: one palette, one
``unit_label`` (``fsdp_doctor.present.fmt``), one look.

No I/O, no Dash, no analysis: every number drawn comes from the report or the records as given. Each
builder returns a figure with a readable note instead of raising when its data is missing.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import plotly.graph_objects as go
import plotly.io as pio

from fsdp_doctor import memory_categories as MC
from msgspec import UNSET

from fsdp_doctor.present.fmt import (UNKNOWN, RANKS_SHOWN, VERDICT_SEGMENTS, fmt_bytes, fmt_ms, ranks_shown,
                                     ranks_shown_words, unit_label, verdict_share, verdict_steps, verdict_title)
from fsdp_doctor.report_sections import (CommUnitRow, MemoryPeakAt, MemoryRank, MemorySection, OverlapRank,
                                         StepsSection, UnitRow, Verdict)
from fsdp_doctor.units import runs

# ---------------------------------------------------------------- palette and shared layout

PHASE_COLORS = {"forward": "#4C78A8", "backward": "#F58518", "optimizer": "#54A24B", "outside": "#B279A2",
                "gc": "#E45756", "no_grad": "#BAB0AC", "checkpoint": "#9D755D"}
PHASE_NAMES = {"no_grad": "no-grad forwards (evaluation)", "checkpoint": "checkpoint saves"}
COLLECTIVE_COLORS = {"all_gather": "#4C78A8", "reduce_scatter": "#F58518", "all_reduce": "#E45756",
                     "broadcast": "#72B7B2", "compute": "#9D9D9D"}
MEMORY_CATEGORIES = MC.NAMES
MEMORY_COLORS = MC.COLOURS
RANK_COLORS = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#EECA3B", "#9D755D",
               "#FF9DA6", "#BAB0AC")
# the verdict's share kinds (fsdp_doctor.present.fmt.VERDICT_SEGMENTS): communication warm, the device's own work
# blue, the host and input yellow/teal, idle grey; the HTML report and the dashboard draw the same bar
VERDICT_COLORS = {"compute": "#4C78A8", "AG fwd": "#F58518", "AG bwd": "#FFBF79", "RS": "#E45756",
                  "model comm": "#9D755D", "other comm": "#FF9DA6", "offload": "#B279A2", "host": "#EECA3B",
                  "input": "#72B7B2", "idle": "#BAB0AC"}
VERDICT_LABEL_MIN_PCT = 3.0  # narrower segments are labelled on hover only (the text would not fit)
MIB = float(1 << 20)
# a profiled step: the doctor's profiler window or its trace export, its FLOP count (the first steps), or a
# torch.profiler of the user's recording; its time outside the model is that tool's, not a stall
PROFILER_OUTSIDE = "outside: profiling (tool)"
NOT_MEASURED = "not measurable on this torch"  # a memory category's 0 that is no figure (MemoryRank.unknown_categories)
MIB_HOVER = "%{y}: %{x:.1f} MiB<extra></extra>"


# plotly_white's layout only, without the parts for trace types never drawn here (maps, polar, ternary and 3-D
# axes, colour axes and scales: the heatmap names its own): the full template carries per-trace-type defaults
# whose copy costs ~0.3 s per figure, and every figure copies the template it is given.
TEMPLATE = "fsdp_doctor"
_UNUSED_LAYOUT = ("geo", "mapbox", "polar", "scene", "ternary", "coloraxis", "colorscale", "shapedefaults",
                  "annotationdefaults")
if TEMPLATE not in pio.templates:
    pio.templates[TEMPLATE] = go.layout.Template(layout={
        k: v for k, v in pio.templates["plotly_white"].layout.to_plotly_json().items() if k not in _UNUSED_LAYOUT})


def rank_color(rank: int) -> str:
    return RANK_COLORS[int(rank) % len(RANK_COLORS)]


def _layout(fig: go.Figure, title: str, height: int = 340, **kw) -> go.Figure:
    """Shared look: title top-left, legend on its own row just above the plot (never over the title)."""
    fig.update_layout(
        title={"text": title, "x": 0.01, "xanchor": "left", "y": 0.985, "yanchor": "top", "yref": "container",
               "font": {"size": 15}},
        template=TEMPLATE, height=height, margin={"l": 60, "r": 24, "t": 78, "b": 48},
        font={"size": 12}, legend={"orientation": "h", "yanchor": "bottom", "y": 1.01, "xanchor": "left", "x": 0.0},
        hoverlabel={"namelength": -1}, **kw,
    )
    return fig


def empty_figure(message: str, title: str = "", height: int = 260) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper",
                       font={"size": 14, "color": "#666"})
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return _layout(fig, title, height)


def _in_window(step: int, window: Optional[Sequence[int]]) -> bool:
    return window is None or window[0] <= step <= window[1]


def _select_ranks(steps: dict, ranks: Optional[Iterable[int]], key: Optional[str] = None, window=None) -> list[int]:
    """The ranks a per-rank figure draws: ``ranks`` (the dashboard's filter), else every rank; a larger job's, with
    ``key`` (a step column), those fmt.ranks_shown picks by its median over ``window`` (the highest and the lowest:
    a 512-rank job drew 512 lines)."""
    keys = sorted(int(r) for r in steps)
    if ranks is not None:
        want = {int(r) for r in ranks}
        return [r for r in keys if r in want]
    if key is None or len(keys) <= RANKS_SHOWN:
        return keys
    meds = {}
    for r in keys:
        cols = _cols(steps, r)
        col = cols.get(key) or []
        vals = [col[i] for i in _rows(cols, window) if i < len(col) and col[i] is not None]
        meds[r] = _median(vals) if vals else None
    return [int(r) for r in ranks_shown(meds)[0]]


def _ranks_words(sel: list, steps: dict, ranks, high: str, low: str) -> str:
    """A figure's title's words for the ranks ``_select_ranks`` drew of a larger job ("" where every rank or the
    filter's)."""
    if ranks is not None:
        return ""
    words = ranks_shown_words(len(sel), len(steps), high, low)
    return words and words + "; the rank filter draws others"


def _cols(steps: dict, rank) -> dict:
    """A rank's step columns, ``steps`` keyed by int or str rank (a live snapshot's JSON has str keys)."""
    return steps.get(rank) or steps.get(str(rank))


def _rows(cols: dict, window) -> list[int]:
    return [i for i, s in enumerate(cols.get("step", [])) if _in_window(s, window)]


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    if not n:
        return float("nan")
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


# at most this many step positions per step figure: a run followed for 5,000 steps drew every step, 873 KiB of
# figures per Steps page (~17 MB at 100,000 steps) sent again on each refresh while the run writes. A longer
# selection is drawn in groups of k consecutive steps, each by what it must not hide (its slowest step)
STEP_POINTS = 1000
JITTER_BINS = 80  # the jitter histogram's bins where it counts the steps itself (more than STEP_POINTS of them)


def _group_size(steps: Iterable[int]) -> int:
    """k: how many consecutive step numbers one drawn position stands for (1: every step its own)."""
    s = sorted(set(steps))
    return max(1, -(-(s[-1] - s[0] + 1) // STEP_POINTS)) if s else 1


def _groups(cols: dict, idx: list[int], k: int) -> list[list[int]]:
    """``idx`` (rows, in step order) cut where the step number crosses a multiple of ``k``: one list per group."""
    out: list[list[int]] = []
    for i in idx:
        if out and cols["step"][out[-1][0]] // k == cols["step"][i] // k:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _grouped_title(title: str, k: int, how: str) -> str:
    return title if k == 1 else f"{title}<br><sup>{k} steps per point: {how}</sup>"


# ---------------------------------------------------------------- steps


def step_time_figure(steps: dict, ranks=None, window=None, height: int = 340, shift=None) -> go.Figure:
    """Step wall time per rank over steps; profiled steps (tool overhead inside) drawn hollow; ``shift`` (the report's
    ``LevelShift``, None: none) a dashed line where the step time changed and stayed, each part's median across it,
    or, where it grew or fell steadily, a dotted line along it."""
    sel = _select_ranks(steps, ranks, "wall_ms", window)
    k = _group_size(cols["step"][i] for r in sel for cols in [_cols(steps, r)]
                    for i in _rows(cols, window))
    fig = go.Figure()
    for r in sel:
        cols = _cols(steps, r)
        idx = _rows(cols, window)
        if not idx:
            continue
        if k > 1:  # each group by its fastest and its slowest step (a spike stays a spike), profiled ones kept
            idx = sorted({j for g in _groups(cols, idx, k) for j in (
                min(g, key=lambda i: cols["wall_ms"][i]), max(g, key=lambda i: cols["wall_ms"][i]),
                *(i for i in g if cols["profiled"][i]))})
        x = [cols["step"][i] for i in idx]
        y = [cols["wall_ms"][i] for i in idx]
        prof = [bool(cols["profiled"][i]) for i in idx]
        fig.add_trace(go.Scatter(
            x=x, y=y, mode="lines+markers", name=f"rank {r}", line={"color": rank_color(r), "width": 1.5},
            marker={"size": [5 if not p else 8 for p in prof], "symbol": ["circle" if not p else "circle-open" for p in prof]},
            customdata=[["profiled" if p else ""] for p in prof],
            hovertemplate=f"rank {r}<br>step %{{x}}<br>%{{y:.2f}} ms %{{customdata[0]}}<extra></extra>",
        ))
    if not fig.data:
        return empty_figure("No steps recorded in this selection yet.", "Step time per rank", height)
    for a, b in runs(sorted({cols["step"][i] for r in sel for cols in [_cols(steps, r)]
                              for i in _rows(cols, window) if cols["profiled"][i]})):
        fig.add_vrect(x0=a - 0.5, x1=b + 0.5, fillcolor="#BBBBBB", opacity=0.25, line_width=0, layer="below")
    xs = [x for tr in fig.data for x in tr.x]
    cut = None if shift is None or shift.drift_line else (shift.last_before + shift.first_after) / 2
    if shift is not None and shift.drift_line:  # a steady drift: its line, over the steps drawn
        (a, ms_a), (b, ms_b) = shift.drift_line
        x0, x1 = max(a, min(xs)), min(b, max(xs))
        if x0 < x1:
            at = lambda x: ms_a + (ms_b - ms_a) * (x - a) / (b - a)  # noqa: E731
            fig.add_shape(type="line", x0=x0, x1=x1, y0=at(x0), y1=at(x1),
                          line={"color": "#555", "width": 1, "dash": "dot"})
            fig.add_annotation(x=x1, y=at(x1), showarrow=False, xanchor="right", yanchor="bottom", font={"size": 11},
                               text=f"{shift.drift_verb()} {fmt_ms(abs(shift.drift_ms_per_step()))} "
                                    "a step")
    if cut is not None and min(xs) < cut < max(xs):  # (a window of steps on one side of it: not drawn)
        fig.add_vline(x=cut, line={"color": "#555", "width": 1, "dash": "dash"})
        for x0, x1, ms in ((min(xs), cut, shift.ms_before), (cut, max(xs), shift.ms_after)):
            fig.add_shape(type="line", x0=x0, x1=x1, y0=ms, y1=ms, line={"color": "#555", "width": 1, "dash": "dot"})
        fig.add_annotation(x=cut, y=max(shift.ms_before, shift.ms_after), text=f"changed at step {shift.first_after}",
                           showarrow=False, xanchor="left", yanchor="bottom", font={"size": 11})
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text="wall time (ms)", rangemode="tozero")
    return _layout(fig, _grouped_title("Step time per rank (grey band, hollow: profiled steps; their time is the "
                                       "tool's)" + _ranks_words(sel, steps, ranks, "the slowest", "the fastest"), k,
                                       "each group's fastest and slowest step"), height)


def memory_per_step_figure(steps: dict, ranks=None, window=None, height: int = 300) -> go.Figure:
    """Each rank's memory peak per step (solid, MiB) and, on CUDA, what stays allocated at each step's end
    (dotted): flat in a healthy run, rising where the loop keeps something from every step (memory.growing)."""
    title = "Memory per step: each step's peak (solid) and, on CUDA, allocated at its end (dotted)"
    fig = go.Figure()
    sel = _select_ranks(steps, ranks, "peak_bytes", window)
    title += _ranks_words(sel, steps, ranks, "the highest peaks", "the lowest")
    for r in sel:
        cols = _cols(steps, r)
        idx = _rows(cols, window)
        for key, name, dash in (("peak_bytes", "peak", "solid"), ("allocated_end", "allocated at the end", "dot")):
            vals = cols.get(key) or [None] * len(cols["step"])
            pts = [(cols["step"][i], vals[i] / MIB) for i in idx if vals[i] is not None]
            if pts:
                fig.add_trace(go.Scatter(
                    x=[x for x, _ in pts], y=[y for _, y in pts], mode="lines+markers", name=f"rank {r} {name}",
                    line={"color": rank_color(r), "width": 1.5, "dash": dash}, marker={"size": 4},
                    hovertemplate=f"rank {r}<br>step %{{x}}<br>{name}: %{{y:.2f}} MiB<extra></extra>"))
    if not fig.data:
        return empty_figure("No per-step memory recorded in this selection.", title, height)
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text="MiB", rangemode="tozero")
    return _layout(fig, title, height)


def phase_split_figure(steps: dict, rank: int, window=None, height: int = 320) -> go.Figure:
    """Per step of one rank, the wall time split into forward / backward / optimizer / outside (stacked), and the
    model's forward passes without gradients (evaluation, generation) where a step ran any. Time outside the
    model in a profiled step (the profiler starting, stopping and writing its trace) is the tool's, not a
    data-loader stall: it is drawn apart, hatched, under its own legend entry."""
    cols = _cols(steps, rank)
    if not cols:
        return empty_figure("No steps recorded for this rank yet.", "Step phases", height)
    idx = _rows(cols, window)
    if not idx:
        return empty_figure("No steps in the selected window.", "Step phases", height)
    k = _group_size(cols["step"][i] for i in idx)
    groups = _groups(cols, idx, k)  # (k = 1: one step each)
    x = [cols["step"][g[0]] for g in groups]
    label = [[f"step {cols['step'][g[0]]}" if len(g) == 1 else f"steps {cols['step'][g[0]]}–{cols['step'][g[-1]]}, "
              "mean"] for g in groups]
    prof = [[bool(cols["profiled"][i]) for i in g] for g in groups]

    def mean(ph: str, keep=lambda p: True) -> list:
        return [sum(cols[f"{ph}_ms"][i] for i, p in zip(g, ps) if keep(p)) / len(g) for g, ps in zip(groups, prof)]

    fig = go.Figure()
    # the steps' work kept apart from the phases, drawn where any step of the window did it
    apart = [ph for ph in ("no_grad", "checkpoint") if f"{ph}_ms" in cols and any(cols[f"{ph}_ms"][i] for i in idx)]
    for ph in ("forward", "backward", "optimizer", "outside", *apart):
        if ph == "outside":
            y = [None if all(ps) else v for v, ps in zip(mean(ph, lambda p: not p), prof)]
        else:
            y = mean(ph)
        name = PHASE_NAMES.get(ph, ph)
        fig.add_trace(go.Bar(x=x, y=y, name=name, marker_color=PHASE_COLORS[ph], customdata=label,
                             hovertemplate=f"%{{customdata[0]}}<br>{name} %{{y:.2f}} ms<extra></extra>"))
    if any(map(any, prof)):
        tool = mean("outside", lambda p: p)
        some = [j for j, ps in enumerate(prof) if any(ps)]
        fig.add_trace(go.Bar(
            x=[x[j] for j in some], y=[tool[j] for j in some], customdata=[label[j] for j in some],
            name=PROFILER_OUTSIDE, marker={"color": "#D9D9D9", "pattern": {"shape": "/", "fgcolor": "#7F7F7F"}},
            hovertemplate="%{customdata[0]} (profiled)<br>outside %{y:.2f} ms: profiling (a profiler window and its "
                          "trace export, or the doctor's FLOP count), not a stall<extra></extra>"))
    fig.update_layout(barmode="stack", bargap=0.1)
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text="ms")
    return _layout(fig, _grouped_title(f"Where the time goes, rank {rank}", k, "each group's mean"), height)


def _steady(cols: dict, i: int) -> bool:
    """Whether row ``i`` is a step the step statistics use (the ``steady`` column, the analysis's own rule: the
    first step, profiled ones and full memory counts left out); columns without it: not the first, not profiled."""
    if "steady" in cols:
        return bool(cols["steady"][i])
    return cols["step"][i] > 0 and not cols["profiled"][i]


def jitter_histogram(steps: dict, ranks=None, window=None, height: int = 320) -> go.Figure:
    """Distribution of each steady-state step's deviation from its rank's median (the steps the step statistics
    use: the first, profiled ones and full memory counts left out)."""
    sel = _select_ranks(steps, ranks, "wall_ms", window)
    fig = go.Figure()
    for r in sel:
        cols = _cols(steps, r)
        idx = [i for i in _rows(cols, window) if _steady(cols, i)]
        if len(idx) < 2:
            continue
        w = [cols["wall_ms"][i] for i in idx]
        med = _median(w)
        dev = [v - med for v in w]
        if len(dev) <= STEP_POINTS:
            fig.add_trace(go.Histogram(
                x=dev, name=f"rank {r}", marker_color=rank_color(r), opacity=0.7,
                hovertemplate=f"rank {r}<br>%{{x}} ms from median<br>%{{y}} steps<extra></extra>"))
            continue
        # a long run: its counts, not every step's value (the browser bins what it is sent)
        lo, hi = min(dev), max(dev)
        width = (hi - lo) / JITTER_BINS or 1.0
        counts = [0] * JITTER_BINS
        for v in dev:
            counts[min(int((v - lo) / width), JITTER_BINS - 1)] += 1
        fig.add_trace(go.Bar(x=[lo + (j + 0.5) * width for j in range(JITTER_BINS)], y=counts, width=width,
                             name=f"rank {r}", marker_color=rank_color(r), opacity=0.7,
                             hovertemplate=f"rank {r}<br>%{{x:.2f}} ms from median<br>%{{y}} steps<extra></extra>"))
    if not fig.data:
        return empty_figure("Too few steady-state steps for a distribution.", "Step-time jitter", height)
    fig.update_layout(barmode="overlay")
    fig.update_xaxes(title_text="ms from the rank's median step")
    fig.update_yaxes(title_text="steps")
    return _layout(fig, "Step-time jitter" + _ranks_words(sel, steps, ranks, "the slowest", "the fastest"), height)


def step_heatmap(steps: dict, ranks=None, window=None, height: int = 300) -> go.Figure:
    """Rank × step heatmap of wall time: a slow rank is a row, a slow step a column."""
    sel = _select_ranks(steps, ranks)
    all_steps: set[int] = set()
    for r in sel:
        cols = _cols(steps, r)
        all_steps.update(cols["step"][i] for i in _rows(cols, window))
    if not sel or not all_steps:
        return empty_figure("No steps recorded in this selection yet.", "Step time, rank × step", height)
    k = _group_size(all_steps)
    xs = sorted({s // k * k for s in all_steps})  # (k = 1: every step)
    pos = {s: i for i, s in enumerate(xs)}
    z = []
    for r in sel:
        row: list = [None] * len(xs)
        cols = _cols(steps, r)
        for g in _groups(cols, _rows(cols, window), k):  # each cell its group's slowest steady step (else slowest)
            keep = [i for i in g if _steady(cols, i)] or g
            row[pos[cols["step"][g[0]] // k * k]] = max(cols["wall_ms"][i] for i in keep)
        z.append(row)
    steady = [cols["wall_ms"][i] for r in sel for cols in [_cols(steps, r)]
              for i in _rows(cols, window) if _steady(cols, i)]
    zmax = max(steady) if steady else None  # first and profiled steps (tool cost) would wash the scale out
    fig = go.Figure(go.Heatmap(
        z=z, x=xs, y=[f"rank {r}" for r in sel], colorscale="Viridis", zmax=zmax,
        zmin=min(steady) if steady else None, colorbar={"title": {"text": "ms"}},
        hovertemplate=f"%{{y}}<br>step %{{x}}{f' (to +{k - 1})' if k > 1 else ''}<br>%{{z:.2f}} ms<extra></extra>",
        xgap=1 if len(xs) < 120 else 0, ygap=1,
    ))
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(autorange="reversed")
    title = "Step time, rank × step" + (" (colour capped at the slowest steady step)" if zmax is not None else "")
    return _layout(fig, _grouped_title(title, k, f"the slowest steady step of steps N to N+{k - 1}"),
                   max(height, 140 + 22 * len(sel)))


# ---------------------------------------------------------------- memory


def _sample_categories(sample: dict) -> dict:
    """Per-category bytes of one timeline sample: either flat keys or a nested ``bytes``/``categories`` dict."""
    for key in ("bytes", "categories", "breakdown"):
        if isinstance(sample.get(key), dict):
            return sample[key]
    return {k: v for k, v in sample.items() if k not in _SAMPLE_META and isinstance(v, (int, float))
            and not isinstance(v, bool) and "total" not in k and "reserved" not in k}


_SAMPLE_META = {"step", "unit", "phase", "t", "t_ms", "t_us", "ts", "index", "i", "rank", "total"}


def timeline_samples(timeline) -> list[dict]:
    """Timeline samples as dicts, from a list of dicts or a ``{"columns": [...], "rows": [[...], ...]}`` table."""
    if isinstance(timeline, dict) and "columns" in timeline:
        cols = list(timeline["columns"])
        return [dict(zip(cols, row)) for row in timeline.get("rows") or []]
    return [s for s in timeline or [] if isinstance(s, dict)]


def _ordered_categories(keys: Iterable[str]) -> list[str]:
    keys = set(keys)
    out = [c for c in MEMORY_CATEGORIES if c in keys]
    return out + sorted(keys - set(out))


def unknown_categories(mem_rank: Optional[MemoryRank]) -> list[str]:
    """The memory categories this torch could not measure on the rank: their 0 is no figure."""
    return list(mem_rank.unknown_categories or ()) if mem_rank is not None else []


def memory_timeline_figure(mem_rank: Optional[MemoryRank], window=None, capacity_bytes: Optional[int] = None,
                           rank: Optional[int] = None, height: int = 360, categories: Optional[Sequence[str]] = None) -> go.Figure:
    """Stacked area of memory by category along the step (unit and phase on hover), with the capacity line.

    Samples carry ``t_ms`` (time into the step) or a ``step`` each; ``mem_rank.timeline_step`` names the step
    of a one-step timeline. ``categories`` (the section's list) fixes which keys are stacked and in what order.
    A category this torch could not measure is not stacked: its 0 is no figure."""
    mem_rank = mem_rank or MemoryRank()
    tl_step = mem_rank.timeline_step
    title = "Memory by category along the step" + (f" {tl_step}" if tl_step is not None else "") + \
        (f" (rank {rank})" if rank is not None else "")
    samples = timeline_samples(mem_rank.timeline)
    samples = [s for s in samples if s.get("step") is None or _in_window(s["step"], window)]
    if not samples:
        return empty_figure("No memory timeline in the report.", title, height)
    cats_per = [_sample_categories(s) for s in samples]
    present = {k for c in cats_per for k in c} - set(unknown_categories(mem_rank))
    cats = [c for c in categories if c in present] if categories else _ordered_categories(present)
    nonzero = [c for c in cats if any(cp.get(c) for cp in cats_per)]
    cats = nonzero or cats  # categories that stay at 0 along the step only clutter the legend
    use_t = all(isinstance(s.get("t_ms"), (int, float)) for s in samples) and not any("step" in s for s in samples)
    x = [s["t_ms"] for s in samples] if use_t else list(range(len(samples)))
    hover = [[str(s.get("step", tl_step if tl_step is not None else "")), unit_label(s.get("unit")),
              str(s.get("phase", ""))] for s in samples]
    fig = go.Figure()
    for c in cats:
        fig.add_trace(go.Scatter(
            x=x, y=[(cp.get(c) or 0) / MIB for cp in cats_per], name=MC.label(c), stackgroup="mem", mode="lines",
            line={"width": 0.5, "color": MEMORY_COLORS.get(c)}, customdata=hover,
            hovertemplate=f"{MC.label(c)}: %{{y:.2f}} MiB<br>step %{{customdata[0]}} · unit %{{customdata[1]}} · %{{customdata[2]}}<extra></extra>",
        ))
    cap = capacity_bytes if capacity_bytes is not None else mem_rank.capacity_bytes
    if cap:
        fig.add_hline(y=cap / MIB, line={"color": "#D62728", "dash": "dash", "width": 2},
                      annotation_text=f"capacity {fmt_bytes(cap)}", annotation_position="top left")
    if use_t:
        fig.update_xaxes(title_text="ms into the step")
    else:
        ticks, labels, last = [], [], None  # step boundaries as tick labels when samples carry their step
        for i, s in enumerate(samples):
            if s.get("step") is not None and s["step"] != last:
                ticks.append(i)
                labels.append(f"step {s['step']}")
                last = s["step"]
        if ticks and len(ticks) <= 40:
            fig.update_xaxes(tickvals=ticks, ticktext=labels)
        else:
            fig.update_xaxes(title_text="sample (unit hook) along the step")
    fig.update_yaxes(title_text="MiB")
    fig.update_layout(hovermode="x unified")
    return _layout(fig, title, height)


def _peak_where(at: MemoryPeakAt) -> str:
    """Where the peak happened: ``step 4 · unit layers.0 · backward`` (step and phase where known)."""
    return " · ".join([*([f"step {at.step}"] if at.step is not None else []), f"unit {unit_label(at.unit)}",
                       *([str(at.phase)] if at.phase is not None else [])])


def memory_breakdown_figure(mem_rank: Optional[MemoryRank], rank: Optional[int] = None, height: int = 320) -> go.Figure:
    """Memory by category at the peak (horizontal bars), with where the peak happened in the title. A category
    this torch could not measure is labelled "unknown", never a measured 0."""
    bd = mem_rank.peak_breakdown if mem_rank is not None else {}
    title = "Breakdown at the peak" + (f" (rank {rank})" if rank is not None else "")
    if not bd:
        return empty_figure("No peak breakdown in the report.", title, height)
    where = _peak_where(mem_rank.peak_at)
    unknown = set(unknown_categories(mem_rank))
    cats = _ordered_categories(bd)[::-1]
    fig = go.Figure(go.Bar(
        x=[0 if c in unknown else bd[c] / MIB for c in cats], y=[MC.label(c) for c in cats], orientation="h",
        marker_color=[MEMORY_COLORS.get(c, "#888") for c in cats],
        text=[UNKNOWN if c in unknown else fmt_bytes(bd[c]) if bd[c] else "" for c in cats], textposition="outside",
        cliponaxis=False, hovertemplate=[f"%{{y}}: {UNKNOWN} ({NOT_MEASURED})<extra></extra>" if c in unknown else
                                         MIB_HOVER for c in cats] if unknown else MIB_HOVER,
    ))
    title += f": {fmt_bytes(mem_rank.peak_bytes)}"
    fig.update_xaxes(title_text=f"MiB at the peak: {where}" if where else "MiB")
    fig.update_yaxes(automargin=True)
    return _layout(fig, title, height, showlegend=False).update_layout(margin_r=84)  # room for the bar labels


# ---------------------------------------------------------------- communication


def window_timeline_data(win, max_intervals: int = 4000) -> dict:
    """Plain data for :func:`comm_timeline_figure` from one ``fsdp_doctor.trace.WindowTrace``: times in ms
    from the start of the window. Compute intervals closer than the figure can show are merged."""
    t0 = float(win.span[0])
    cs, ce = win.compute
    starts = [(float(s) - t0) / 1e3 for s in cs]
    ends = [(float(e) - t0) / 1e3 for e in ce]
    if len(starts) > max_intervals and starts:
        gap = (ends[-1] - starts[0]) / max_intervals
        ms, me = [starts[0]], [ends[0]]
        for s, e in zip(starts[1:], ends[1:]):
            if s - me[-1] <= gap:
                me[-1] = max(me[-1], e)
            else:
                ms.append(s)
                me.append(e)
        starts, ends = ms, me
    calls = [{"unit": c.unit, "collective": c.collective, "phase": c.phase, "start_ms": (c.start - t0) / 1e3,
              "end_ms": (c.end - t0) / 1e3} for c in win.calls]
    return {"rank": win.rank, "steps": list(win.steps), "file": win.file, "device": win.device,
            "span_ms": (float(win.span[1]) - t0) / 1e3, "compute": (starts, ends), "calls": calls}


def comm_timeline_figure(windows: list[dict], unit: Optional[str] = None, height: Optional[int] = None) -> go.Figure:
    """Per rank, one lane of compute and one per collective kind for one profiled window: what overlaps what.
    ``windows`` are :func:`window_timeline_data` dicts (one per rank). A selected ``unit`` is highlighted."""
    title = "Compute vs communication in a profiled step"
    if not windows:
        return empty_figure("No profiled window in this selection (the run has no Kineto traces yet).", title, 240)
    windows = sorted(windows, key=lambda w: w["rank"])
    lanes: list[str] = []
    fig = go.Figure()
    for w in windows:
        r = w["rank"]
        kinds = sorted({c["collective"] for c in w["calls"]}, key=lambda k: (k != "all_gather", k))
        lane_c = f"rank {r} compute"
        lanes.append(lane_c)
        s, e = w["compute"]
        fig.add_trace(go.Bar(
            y=[lane_c] * len(s), x=[b - a for a, b in zip(s, e)], base=s, orientation="h", name="compute",
            legendgroup="compute", showlegend=r == windows[0]["rank"], marker_color=COLLECTIVE_COLORS["compute"],
            marker_line_width=0, hovertemplate="compute %{base:.2f} → +%{x:.2f} ms<extra></extra>",
        ))
        for k in kinds:
            lane = f"rank {r} {k}"
            lanes.append(lane)
            calls = [c for c in w["calls"] if c["collective"] == k]
            # with a unit selected, its calls in colour and every other unit's in grey, each under its own legend entry
            for name, color, cs in ((k if unit is None else f"{k} ({unit_label(unit)})", COLLECTIVE_COLORS.get(k, "#444"),
                                     [c for c in calls if unit is None or c["unit"] == unit]),
                                    (f"{k} (other units)", "#D8D8D8",
                                     [c for c in calls if unit is not None and c["unit"] != unit])):
                if not cs:
                    continue
                fig.add_trace(go.Bar(
                    y=[lane] * len(cs), x=[c["end_ms"] - c["start_ms"] for c in cs], base=[c["start_ms"] for c in cs],
                    orientation="h", name=name, legendgroup=name, showlegend=not any(t.name == name for t in fig.data),
                    marker={"color": color, "line": {"width": 0.5, "color": "#333"}},
                    customdata=[[unit_label(c["unit"]), c["phase"] or "", c["end_ms"] - c["start_ms"]] for c in cs],
                    hovertemplate=k + " %{customdata[0]} (%{customdata[1]})<br>%{base:.2f} ms, lasts %{customdata[2]:.2f} ms"
                                      "<extra></extra>",
                ))
    steps = sorted({s for w in windows for s in w["steps"]})
    fig.update_layout(barmode="overlay", bargap=0.25)
    fig.update_yaxes(categoryorder="array", categoryarray=lanes[::-1], automargin=True)
    fig.update_xaxes(title_text="ms from the start of the profiled step (each rank on its own clock)")
    h = height or max(220, 80 + 34 * len(lanes))
    return _layout(fig, f"{title} (step {', '.join(map(str, steps))})", h)


def _unit_rows(per_unit: list[CommUnitRow], ranks=None, unit: Optional[str] = None,
               collectives=None) -> list[CommUnitRow]:
    want = None if ranks is None else {int(r) for r in ranks}
    return [r for r in per_unit or []
            if (want is None or int(r.rank) in want) and (unit is None or r.unit == unit)
            and (collectives is None or r.collective in collectives)]


def _agg(rows: list[CommUnitRow], key) -> dict[tuple, tuple[float, float]]:
    """key -> (comm_us, exposed_us) summed over the rows with that key."""
    out: dict = {}
    for r in rows:
        k = key(r)
        comm, exposed = out.get(k, (0.0, 0.0))
        out[k] = (comm + r.comm_us, exposed + r.exposed_us)
    return out


def unit_exposure_figure(per_unit: list[CommUnitRow], ranks=None, unit: Optional[str] = None,
                         height: Optional[int] = None) -> go.Figure:
    """Per unit and collective (summed over the selected ranks): communication time exposed vs overlapped."""
    title = "Communication per unit: exposed vs overlapped"
    rows = _unit_rows(per_unit, ranks, unit)
    if not rows:
        return empty_figure("No per-unit communication in this selection.", title, 240)
    agg = _agg(rows, lambda r: (unit_label(r.unit), r.collective, r.phase or "-"))
    keys = sorted(agg, key=lambda k: agg[k][1])
    labels = [f"{u} · {c} ({p})" for u, c, p in keys]
    exposed = [agg[k][1] / 1e3 for k in keys]
    overlapped = [max(0.0, agg[k][0] - agg[k][1]) / 1e3 for k in keys]
    fig = go.Figure([
        go.Bar(y=labels, x=exposed, name="exposed (compute waited)", orientation="h", marker_color="#E45756",
               hovertemplate="%{y}<br>exposed %{x:.2f} ms<extra></extra>"),
        go.Bar(y=labels, x=overlapped, name="overlapped with compute", orientation="h", marker_color="#54A24B",
               hovertemplate="%{y}<br>overlapped %{x:.2f} ms<extra></extra>"),
    ])
    fig.update_layout(barmode="stack")
    fig.update_xaxes(title_text="ms per profiled window (sum over selected ranks)")
    fig.update_yaxes(automargin=True)
    return _layout(fig, title, height or max(260, 90 + 20 * len(labels)))


def prefetch_slack_figure(per_unit: list[CommUnitRow], ranks=None, unit: Optional[str] = None,
                          height: Optional[int] = None) -> go.Figure:
    """All-gather slack per unit: need − finish. Negative: compute waited for the parameters (prefetch too late);
    positive: the gathered parameters sat unused that long (memory held early)."""
    title = "All-gather slack per unit (ms; < 0 compute waited, > 0 held early)"
    rows = [r for r in _unit_rows(per_unit, ranks, unit, ("all_gather",)) if r.slack_us is not None]
    if not rows:
        return empty_figure("No all-gather timing (slack) in this selection.", title, 240)
    rows = sorted(rows, key=lambda r: (r.phase or "", r.rank, unit_label(r.unit)))
    fig = go.Figure()
    for ph in sorted({r.phase or "-" for r in rows}):
        sub = [r for r in rows if (r.phase or "-") == ph]
        fig.add_trace(go.Bar(
            y=[f"{unit_label(r.unit)} · r{r.rank}" for r in sub], x=[r.slack_us / 1e3 for r in sub], orientation="h",
            name=ph, marker_color=PHASE_COLORS.get(ph, "#888"),
            customdata=[[ph, (r.held_us or 0) / 1e3] for r in sub],
            hovertemplate="%{y} (%{customdata[0]})<br>slack %{x:.2f} ms<br>held %{customdata[1]:.2f} ms<extra></extra>",
        ))
    fig.add_vline(x=0, line={"color": "#333", "width": 1})
    fig.update_layout(barmode="group")
    fig.update_xaxes(title_text="ms (mean over calls)")
    fig.update_yaxes(automargin=True)
    n = len({(r.unit, r.rank) for r in rows})
    return _layout(fig, title, height or max(260, 90 + 22 * n))


def overlap_by_rank_figure(per_rank: dict[str, OverlapRank], ranks=None, height: int = 260) -> go.Figure:
    title = "Communication per rank: exposed vs overlapped"
    keys = sorted((int(k) for k in (per_rank or {})), reverse=True)
    if ranks is not None:
        keys = [k for k in keys if k in {int(r) for r in ranks}]
    if not keys:
        return empty_figure("No trace analysis yet.", title, 200)
    rows = [per_rank[str(k)] for k in keys]
    labels = [f"rank {k}" for k in keys]
    pct = [f"{r.overlap_pct:.0f}% overlapped" if r.overlap_pct is not None else "" for r in rows]
    fig = go.Figure([
        go.Bar(y=labels, x=[r.exposed_us / 1e3 for r in rows], name="exposed", orientation="h", marker_color="#E45756",
               hovertemplate="%{y}<br>exposed %{x:.2f} ms<extra></extra>"),
        go.Bar(y=labels, x=[r.overlap_us / 1e3 for r in rows], name="overlapped", orientation="h", marker_color="#54A24B",
               text=pct, textposition="outside", hovertemplate="%{y}<br>overlapped %{x:.2f} ms<extra></extra>"),
    ])
    fig.update_layout(barmode="stack")
    fig.update_xaxes(title_text="ms per profiled window")
    return _layout(fig, title, max(height, 100 + 30 * len(keys)))


# ---------------------------------------------------------------- verdict


def verdict_figure(section: Optional[Verdict], rank: Optional[int] = None, max_ranks: int = RANKS_SHOWN,
                   height: Optional[int] = None) -> go.Figure:
    """The verdict (``report.verdict``) as one stacked horizontal bar per rank and one for the job: the share
    of the step (%) of each kind, one colour per kind (VERDICT_COLORS), labelled in % (the terminal's figures,
    one decimal), each rank's step time in its label. ``rank``: that rank and the job only. The first
    ``max_ranks`` ranks are drawn, as in the terminal; the title counts the rest. The HTML report draws the
    same bar."""
    if section is None or not section.per_rank:
        return empty_figure("No verdict yet: it needs step records or a profiled window.", "Verdict", 200)
    per_rank, job = section.per_rank, section.job
    keys = [str(rank)] if rank is not None and str(rank) in per_rank else list(per_rank)
    # (the table's: the straggler, the slowest, the fastest)
    shown, _ = ranks_shown({r: per_rank[r].step_ms for r in keys}, max_ranks,
                           pin=() if job.read_on is None else [job.read_on])
    rows = [(f"rank {r} · {fmt_ms(per_rank[r].step_ms)}" if per_rank[r].step_ms is not None
             else f"rank {r}", per_rank[r]) for r in shown]
    if len(per_rank) > 1:
        rows.append((f"job · {len(per_rank) if job.ranks is None else job.ranks} ranks", job))
    labels = [lab for lab, _ in rows]
    fig = go.Figure()
    for seg in VERDICT_SEGMENTS:
        xs = [verdict_share(v, seg) for _, v in rows]
        if not any(xs):
            continue
        fig.add_trace(go.Bar(y=labels, x=xs, name=seg, orientation="h", marker_color=VERDICT_COLORS[seg],
                             text=[f"{x:.1f}%" if x >= VERDICT_LABEL_MIN_PCT else "" for x in xs],
                             textposition="inside", insidetextanchor="middle", textfont={"size": 12},
                             hovertemplate="%{y}<br>" + seg + " %{x:.1f}% of the step<extra></extra>"))
    title = verdict_title(section)
    title += ranks_shown_words(len(shown), len(keys), "the slowest", "the fastest")
    title += verdict_steps(section)  # (over the profiled or steady steps it covers, not the run's p50)
    fig.update_layout(barmode="stack")
    fig.update_xaxes(range=[0, 100], ticksuffix="%", dtick=10)
    fig.update_yaxes(autorange="reversed", automargin=True)
    fig = _layout(fig, title, height or 96 + 30 * len(rows))
    fig.update_layout(margin={"l": 60, "r": 24, "t": 58, "b": 26}, legend={"traceorder": "normal", "y": 1.0})
    return fig


# ---------------------------------------------------------------- units


def unit_timing_figure(units: list[UnitRow], unit: Optional[str] = None, height: Optional[int] = None,
                       who: str = "all ranks") -> go.Figure:
    """Median per-step host timings of each unit: its own forward and backward (nested units excluded, the unit
    tables' figures) and their all-gather waits. ``who`` names the ranks and steps the medians were taken over."""
    title = f"Per-unit host timings (median per step, own time, {who})"
    rows = [u for u in units or [] if u.timing_p50]
    if not rows:
        return empty_figure("No unit timings yet.", title, 240)
    labels = [unit_label(u.name) for u in rows][::-1]
    rows = rows[::-1]
    fig = go.Figure()
    for key, name, color in (("fwd_self_ms", "forward", PHASE_COLORS["forward"]), ("ag_wait_fwd_ms", "AG wait fwd", "#9ECAE9"),
                             ("bwd_self_ms", "backward", PHASE_COLORS["backward"]), ("ag_wait_bwd_ms", "AG wait bwd", "#FFBF79"),
                             ("recompute_ms", "recompute", "#B279A2")):
        vals = [getattr(u.timing_p50, key) for u in rows]
        if not any(vals):
            continue
        op = [1.0 if unit is None or u.name == unit else 0.3 for u in rows]
        fig.add_trace(go.Bar(y=labels, x=vals, name=name, orientation="h", marker={"color": color, "opacity": op},
                             hovertemplate="%{y}<br>" + name + " %{x:.2f} ms<extra></extra>"))
    fig.update_layout(barmode="group")
    fig.update_xaxes(title_text="ms")
    fig.update_yaxes(automargin=True)
    return _layout(fig, title, height or max(280, 90 + 40 * len(rows)))



# ---------------------------------------------------------------- report summaries (the HTML report's figures)


def memory_peaks_figure(memory: Optional[MemorySection], height: int = 340) -> go.Figure:
    """Each rank's peak by category (stacked bars, MiB), with the capacity as a line and where each peak
    happened under its bar."""
    title = "Memory at the peak, by category"
    per_rank = memory.per_rank if memory is not None else {}
    # a larger job's: the highest peaks and the lowest (as the terminal's table: fmt.ranks_shown)
    ranks, _ = ranks_shown({r: per_rank[r].peak_bytes for r in per_rank}, RANKS_SHOWN)
    if not ranks:
        return empty_figure("No memory measurements in the report.", title, 200)
    title += ranks_shown_words(len(ranks), len(per_rank), "the highest peaks", "the lowest")
    xs = [f"rank {r}" + (f"<br>{_peak_where(per_rank[r].peak_at)}" if per_rank[r].peak_at.step is not None else "")
          for r in ranks]
    fig = go.Figure()
    present = {c for r in ranks for c, v in per_rank[r].peak_breakdown.items() if v}
    for c in _ordered_categories(present):
        fig.add_trace(go.Bar(name=MC.label(c), x=xs, marker_color=MEMORY_COLORS.get(c, "#888"),
                             y=[(per_rank[r].peak_breakdown.get(c) or 0) / MIB for r in ranks],
                             hovertemplate=f"{MC.label(c)}: %{{y:.1f}} MiB<extra></extra>"))
    caps = [per_rank[r].capacity_bytes for r in ranks if per_rank[r].capacity_bytes]
    if caps:
        fig.add_hline(y=max(caps) / MIB, line={"color": "#D62728", "dash": "dash", "width": 2},
                      annotation_text=f"capacity {fmt_bytes(max(caps))}", annotation_position="top left")
    fig.update_layout(barmode="stack")
    fig.update_yaxes(title_text="MiB")
    return _layout(fig, title, height)


def memory_units_figure(memory: Optional[MemorySection], height: int = 340) -> go.Figure:
    """Per unit on the rank with the highest peak: sharded and unsharded parameter bytes and the activations it
    left (its own, nested units excluded, so the bars add up; the inclusive figure in reports written before)."""
    title = "Memory per unit"
    best = max((memory.per_rank if memory is not None else {}).items(), key=lambda kv: kv[1].peak_bytes or 0,
               default=None)
    if not best or not best[1].per_unit:
        return empty_figure("No per-unit memory in the report.", title, 200)
    rows = best[1].per_unit
    names = [unit_label(u.unit) for u in rows]
    own = any(u.activation_self_bytes is not UNSET for u in rows)
    fig = go.Figure()
    for label, color, values in (("sharded", "#1F77B4", [u.sharded_bytes for u in rows]),
                                 ("unsharded", "#AEC7E8", [u.unsharded_bytes for u in rows]),
                                 ("activations (own)" if own else "activations", MEMORY_COLORS.get("activations"),
                                  [(u.activation_self_bytes or 0) if own else u.activation_bytes for u in rows])):
        if any(values):
            fig.add_trace(go.Bar(name=label, x=names, y=[(v or 0) / MIB for v in values], marker_color=color,
                                 hovertemplate="%{x}: %{y:.2f} MiB<extra>" + label + "</extra>"))
    fig.update_layout(barmode="group")
    fig.update_yaxes(title_text="MiB")
    return _layout(fig, f"{title} (rank {best[0]}), MiB", height)


STEP_PHASES = ("forward", "backward", "optimizer", "outside")


def step_summary_figure(steps: Optional[StepsSection], height: Optional[int] = None) -> go.Figure:
    """Per rank, its median step split into phases (stacked bars), its p50 as a tick and in the rank's label
    (never written over a bar), and the outlier steps as crosses at their time."""
    title = "Step timeline: median time per phase (ms); | = p50, × = outlier steps"
    per_rank = steps.per_rank if steps is not None else {}
    counted = [r for r in per_rank if per_rank[r].count]
    # a larger job's: the slowest steps and the fastest, and the stragglers (as the terminal's table: fmt.ranks_shown)
    ranks, _ = ranks_shown({r: per_rank[r].p50_ms for r in counted}, RANKS_SHOWN,
                           pin=[s.rank for s in steps.stragglers])
    if not ranks:
        return empty_figure("No step records.", title, 200)
    title += ranks_shown_words(len(ranks), len(counted), "the slowest", "the fastest")
    labels = {r: f"rank {r} · p50 {fmt_ms(per_rank[r].p50_ms)}" for r in ranks}
    ys = [labels[r] for r in ranks]
    fig = go.Figure()
    for ph in STEP_PHASES:
        fig.add_trace(go.Bar(name=ph, y=ys, x=[(per_rank[r].phases_p50_ms or {}).get(ph) or 0 for r in ranks],
                             orientation="h", marker_color=PHASE_COLORS[ph],
                             hovertemplate=f"{ph}: %{{x:.1f}} ms<extra></extra>"))
    p50 = [r for r in ranks if per_rank[r].p50_ms]
    if p50:
        fig.add_trace(go.Scatter(name="p50", mode="markers", x=[per_rank[r].p50_ms for r in p50],
                                 y=[labels[r] for r in p50], marker={"symbol": "line-ns-open", "size": 22,
                                                                     "color": "#222", "line": {"width": 2}},
                                 hovertemplate="p50 %{x:.1f} ms<extra></extra>"))
    outs = [o for o in steps.outliers if str(o.rank) in labels]
    if outs:
        fig.add_trace(go.Scatter(name="outlier steps", mode="markers", x=[o.ms for o in outs],
                                 y=[labels[str(o.rank)] for o in outs],
                                 marker={"symbol": "x", "size": 10, "color": "#C62828"},
                                 customdata=[[o.step, o.detail] for o in outs],
                                 hovertemplate="step %{customdata[0]}: %{customdata[1]}<br>%{x:.1f} ms<extra></extra>"))
    fig.update_layout(barmode="stack")
    fig.update_xaxes(title_text="ms", rangemode="tozero")
    fig.update_yaxes(autorange="reversed", automargin=True)
    return _layout(fig, title, height or max(220, 100 + 46 * len(ranks)))
