"""Shared page pieces: the filter selection, small layout helpers and value formatting (no analysis)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from dash import dash_table, dcc, html

from fsdp_doctor.present.fmt import fmt_bytes, fmt_ms
from fsdp_doctor.present.fmt import fmt_value as _fmt_value

from ..figures import unit_label

ALL = "__all__"
ROOT = "__root__"  # the root unit's name is "", which a dropdown cannot hold
GRAPH_CONFIG = {"displaylogo": False, "responsive": True, "displayModeBar": "hover",
                "modeBarButtonsToRemove": ["lasso2d", "select2d", "autoScale2d"]}


@dataclass(frozen=True)
class Filters:
    """What the user selected in the filter bar; every page applies it."""

    rank: Optional[int] = None  # None: all ranks
    window: Optional[tuple[int, int]] = None  # inclusive step window; None: every step
    unit: Optional[str] = None  # FSDP unit name ("" is the root); None: all units

    @property
    def ranks(self) -> Optional[list[int]]:
        return None if self.rank is None else [self.rank]

    @classmethod
    def from_controls(cls, rank: Any, window: Any, unit: Any) -> "Filters":
        r = None if rank in (None, ALL, "") else int(rank)
        w = tuple(int(x) for x in window) if isinstance(window, (list, tuple)) and len(window) == 2 else None
        u = None if unit in (None, ALL) else ("" if unit == ROOT else str(unit))
        return cls(rank=r, window=w, unit=u)

    def describe(self) -> str:
        bits = [f"rank {self.rank}" if self.rank is not None else "all ranks"]
        if self.window is not None:
            bits.append(f"steps {self.window[0]}–{self.window[1]}")
        if self.unit is not None:
            bits.append(f"unit {unit_label(self.unit)}")
        return " · ".join(bits)


def graph(fig, gid: str, **style) -> dcc.Graph:
    kw = {"style": style} if style else {}
    return dcc.Graph(id=gid, figure=fig, config=GRAPH_CONFIG, className="graph", **kw)


def section(title: str, *children, cls: str = "", sid: Optional[str] = None) -> html.Section:
    kw = {"id": sid} if sid else {}
    return html.Section([html.H3(title), *children], className=f"panel {cls}".strip(), **kw)


def note(text: str, kind: str = "info", nid: Optional[str] = None) -> html.Div:
    kw = {"id": nid} if nid else {}
    return html.Div(text, className=f"note note-{kind}", **kw)


def kpi(label: str, value: str, sub: str = "", kid: Optional[str] = None) -> html.Div:
    kw = {"id": kid} if kid else {}
    return html.Div([html.Div(label, className="kpi-label"), html.Div(value, className="kpi-value"),
                     html.Div(sub, className="kpi-sub")], className="kpi", **kw)


def grid(*children, cols: int = 2) -> html.Div:
    return html.Div(list(children), className=f"grid grid-{cols}")


def fmt_value(key: str, v: Any) -> str:
    """An evidence value formatted by its unit (fsdp_doctor.present.fmt), unit names shown as on screen."""
    if isinstance(v, (list, tuple)) and key.startswith("unit"):
        v = [unit_label(x) if isinstance(x, str) else x for x in v]
    return _fmt_value(key, v)


TABLE_STYLE = dict(
    style_table={"overflowX": "auto"},
    style_cell={"fontFamily": "inherit", "fontSize": "13px", "padding": "4px 8px", "textAlign": "right",
                "whiteSpace": "nowrap", "height": "auto", "maxWidth": "360px"},
    style_header={"fontWeight": "600", "backgroundColor": "#F3F5F8", "textAlign": "right"},
    style_data_conditional=[{"if": {"row_index": "odd"}, "backgroundColor": "#FAFBFC"}],
    page_action="native", page_size=25, sort_action="native",
)


def table(tid: str, rows: list[dict], columns: list[tuple[str, str]], left: tuple[str, ...] = (), **kw) -> dash_table.DataTable:
    style = dict(TABLE_STYLE)
    style.update(kw)
    style["style_cell_conditional"] = [{"if": {"column_id": c}, "textAlign": "left", "whiteSpace": "normal"} for c in left]
    style["style_header_conditional"] = [{"if": {"column_id": c}, "textAlign": "left"} for c in left]
    style["style_header"] = dict(style["style_header"], whiteSpace="normal")
    return dash_table.DataTable(id=tid, data=rows, columns=[{"name": n, "id": c} for c, n in columns], **style)


def unit_value(name: str) -> str:
    """The filter dropdown's value for a unit name."""
    return ROOT if name == "" else name
