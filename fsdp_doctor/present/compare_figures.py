"""Plotly figures of a :class:`~fsdp_doctor.compare_sections.Comparison` (run A against run B, grouped bars),
drawn by the HTML compare report and the dashboard's Compare page. Bar traces only (plotly.js's basic bundle)."""

from __future__ import annotations

from typing import Optional

import plotly.graph_objects as go

from ..compare_sections import Comparison
from ..memory_categories import label as category_label
from .compare import PHASE_LABELS
from .fmt import unit_label

RUN_COLORS = {"A": "#9DA5B0", "B": "#4C78A8"}
MIB = float(1 << 20)


def _bars(title: str, labels: list[str], a: list, b: list, axis: str, height: int = 320) -> Optional[go.Figure]:
    if not labels:
        return None
    fig = go.Figure([go.Bar(name=f"run {k}", x=labels, y=v, marker_color=RUN_COLORS[k],
                            hovertemplate=f"run {k}<br>%{{x}}: %{{y:.3f}} {axis}<extra></extra>")
                     for k, v in (("A", a), ("B", b))])
    fig.update_layout(title={"text": title, "x": 0.01, "xanchor": "left", "font": {"size": 15}}, barmode="group",
                      template="plotly_white", height=height, margin={"l": 60, "r": 20, "t": 56, "b": 60},
                      yaxis_title=axis,
                      legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "xanchor": "right", "x": 1.0})
    return fig


def phases_figure(c: Comparison) -> Optional[go.Figure]:
    items = [(PHASE_LABELS.get(k, k), d) for k, d in c.phases.items() if d.a or d.b]
    return _bars(f"Phase split per step (from the {c.phases_source})", [k for k, _ in items],
                 [d.a for _, d in items], [d.b for _, d in items], "ms")


def memory_figure(c: Comparison) -> Optional[go.Figure]:
    items = [(category_label(k), d) for k, d in c.memory.items() if d.a or d.b]
    return _bars("Memory at the peak by category (highest rank)", [k for k, _ in items],
                 [None if d.a is None else d.a / MIB for _, d in items],
                 [None if d.b is None else d.b / MIB for _, d in items], "MiB")


def comm_figure(c: Comparison) -> Optional[go.Figure]:
    rows = c.comm
    labels = [f"{unit_label(r.unit)} {r.collective} {r.phase or ''}".rstrip() for r in rows]
    return _bars(f"Exposed communication per unit and phase (from the {c.comm_source})", labels,
                 [r.a_ms for r in rows], [r.b_ms for r in rows], "ms per step")


FIGURES = (phases_figure, memory_figure, comm_figure)
