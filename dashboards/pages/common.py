"""Shared page pieces: the filter selection, small layout helpers and value formatting (no analysis)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

import dash_ag_grid as dag  # imported with the app: Dash refuses a component library first imported in a callback
from dash import dcc, html

from fsdp_doctor.present.fmt import ROOT_LABEL, exception_kinds, unit_label
from fsdp_doctor.present.fmt import fmt_value as _fmt_value
# whether a run is live: the rule analyze applies (a run none of whose ranks ended, without a record for STALE_S or 10
# of its slowest steps, stopped writing: a rank killed, or the job, leaves no end record)
from fsdp_doctor.store.reader import STALE_S, still_going  # noqa: F401 (STALE_S: the pages' and tests' name)


def run_state(report, updated: float, now: Optional[float] = None) -> str:
    """"finished", "stopped on KeyboardInterrupt" (a rank's loop raised through watch(): the run is not live, whatever
    the others wrote since), "live" (store.reader.still_going), "stopped" (a rank ended normally or fell behind the
    others, which wrote nothing since) or "no new record for N min" (``updated``: when the records last grew,
    time.time())."""
    done = report.run.complete
    if report.run.stopped_on:  # (UNSET: none)
        return f"stopped on {', '.join(exception_kinds(report.run))}"
    if done and all(done.values()):
        return "finished"
    steps = report.steps.per_rank.values() if report.steps is not None else []
    slowest = max((st.max_ms or 0.0 for st in steps), default=0.0)
    idle = (time.time() if now is None else now) - updated
    counts = report.run.steps_recorded.values()  # (ranks more than a step apart: one stopped)
    if still_going(idle, slowest, any(done.values()), max(counts, default=0) - min(counts, default=0)):
        return "live"
    if any(done.values()) or idle < STALE_S:  # (a rank ended normally, or the ranks are steps apart)
        return "stopped"
    return f"no new record for {idle / 60:.0f} min" if idle < 7200 else f"no new record for {idle / 3600:.1f} h"


ALL = "__all__"
ROOT = ROOT_LABEL  # the root unit's name is "", which a dropdown cannot hold (no module path has parentheses)
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
        u = None if unit in (None, ALL, "") else ("" if unit == ROOT else str(unit))
        return cls(rank=r, window=w, unit=u)

    def describe(self) -> str:
        bits = [f"rank {self.rank}" if self.rank is not None else "all ranks"]
        if self.window is not None:
            bits.append(f"steps {self.window[0]}–{self.window[1]}")
        if self.unit is not None:
            bits.append(f"unit {unit_label(self.unit)}")
        return " · ".join(bits)


@dataclass(frozen=True)
class Query:
    """The filters as the URL's query string holds them: ``?rank=1&steps=5-20&unit=layers.0``.

    ``steps=5-`` is open-ended (follows a live run's newest step); no ``steps`` is every step; the root unit is
    ``unit=(root)``. Anything unreadable is ignored (the filter stays unset)."""

    rank: Optional[int] = None
    lo: Optional[int] = None  # None: from the first step
    hi: Optional[int] = None  # None: up to the newest step
    unit: Optional[str] = None  # FSDP unit name ("" is the root)

    @classmethod
    def parse(cls, search: Optional[str]) -> "Query":
        from urllib.parse import parse_qs

        q = parse_qs((search or "").lstrip("?"), keep_blank_values=False)

        def one(k):
            v = q.get(k)
            return v[-1].strip() if v else None

        def num(x):
            try:
                return int(x) if x not in (None, "") else None
            except ValueError:
                return None

        rank = num(one("rank"))
        lo = hi = None
        st = one("steps")
        if st:
            a, sep, b = st.partition("-")
            lo, hi = num(a), (num(b) if sep else num(a))
            if lo is not None and hi is not None and lo > hi:
                lo, hi = hi, lo
        u = one("unit")
        unit = None if u in (None, ALL) else ("" if u == ROOT else u)
        return cls(rank=rank if rank is None or rank >= 0 else None, lo=lo, hi=hi, unit=unit)

    @classmethod
    def from_controls(cls, rank: Any, steps: Any, unit: Any, first: int, last: int) -> "Query":
        f = Filters.from_controls(rank, steps, unit)
        lo = hi = None
        if f.window is not None:
            lo = f.window[0] if f.window[0] > first else None
            hi = f.window[1] if f.window[1] < last else None
        return cls(rank=f.rank, lo=lo, hi=hi, unit=f.unit)

    def search(self) -> str:
        from urllib.parse import urlencode

        q = {}
        if self.rank is not None:
            q["rank"] = str(self.rank)
        if self.lo is not None or self.hi is not None:
            q["steps"] = f"{'' if self.lo is None else self.lo}-{'' if self.hi is None else self.hi}"
        if self.unit is not None:
            q["unit"] = unit_value(self.unit)
        return ("?" + urlencode(q, safe="(),-")) if q else ""

    def slider(self, first: int, last: int) -> list[int]:
        """The slider's [lo, hi] within the run's steps ``first..last``."""
        a = first if self.lo is None else min(max(self.lo, first), last)
        b = last if self.hi is None else min(max(self.hi, first), last)
        return [min(a, b), max(a, b)]

    def rank_value(self) -> str:
        return ALL if self.rank is None else str(self.rank)

    def unit_value(self) -> str:
        return ALL if self.unit is None else unit_value(self.unit)

    def filters(self, first: int, last: int) -> "Filters":
        """What the pages apply; no window when it spans every step recorded."""
        w = None
        if self.lo is not None or self.hi is not None:
            a = first if self.lo is None else self.lo
            b = max(last, a) if self.hi is None else self.hi
            if a > first or b < last:
                w = (a, b)
        return Filters(rank=self.rank, window=w, unit=self.unit)


def graph(fig, gid: str, **style) -> dcc.Graph:
    kw = {"style": style} if style else {}
    return dcc.Graph(id=gid, figure=fig, config=GRAPH_CONFIG, className="graph", **kw)


def section(title: str, *children, cls: str = "", sid: Optional[str] = None) -> html.Section:
    kw = {"id": sid} if sid else {}
    return html.Section([html.H3(title), *children], className=f"panel {cls}".strip(), **kw)


def note(text: str, kind: str = "info", nid: Optional[str] = None) -> html.Div:
    kw = {"id": nid} if nid else {}
    return html.Div(text, className=f"note note-{kind}", **kw)


def kpi(label: str, value: str, sub: str = "", kid: Optional[str] = None, title: str = "") -> html.Div:
    kw = {"id": kid} if kid else {}
    if title:
        kw["title"] = title  # what the figure means, on hover
    return html.Div([html.Div(label, className="kpi-label"), html.Div(value, className="kpi-value"),
                     html.Div(sub, className="kpi-sub")], className="kpi", **kw)


def grid(*children, cols: int = 2) -> html.Div:
    return html.Div(list(children), className=f"grid grid-{cols}")


def fmt_value(key: str, v: Any) -> str:
    """An evidence value formatted by its unit (fsdp_doctor.present.fmt), unit names shown as on screen."""
    if isinstance(v, (list, tuple)) and key.startswith("unit"):
        v = [unit_label(x) if isinstance(x, str) else x for x in v]
    return _fmt_value(key, v)


MAX_COL_PX = 360  # a column's text wraps beyond this width


def table(tid: str, rows: list[dict], columns: list[tuple[str, str]], left: tuple[str, ...] = (), page_size: int = 25,
          sort_keys: Optional[dict[str, str]] = None, row_id: Optional[str] = None, **grid_kw) -> Any:
    """An AG Grid table of display strings (formatted by fsdp_doctor.present.fmt). ``sort_keys`` maps a column
    to a row field holding its raw number, so "9.43 ms" sorts below "13.3 ms"; ``row_id`` names the field
    that identifies a row (``cellClicked`` then reports it)."""
    sort_keys = sort_keys or {}
    defs = []
    for c, name in columns:
        longest = max([len(str(r.get(c, ""))) + str(r.get(c, "")).count("\u2003") for r in rows] + [len(name) + 2])
        px = 26 + round(7.2 * longest)
        d = {"field": c, "headerName": name, "type": "leftAligned" if c in left else "rightAligned",
             "minWidth": min(MAX_COL_PX, px)}  # fits its text; a wider table scrolls
        if px > MAX_COL_PX:
            d.update(wrapText=True, autoHeight=True)
        if c in sort_keys:
            d["valueGetter"] = {"function": f"params.data[{sort_keys[c]!r}]"}
            d["valueFormatter"] = {"function": f"params.data[{c!r}]"}
        defs.append(d)
    opts = {"domLayout": "autoHeight", "suppressCellFocus": True, "enableCellTextSelection": True,
            "rowHeight": 30, "headerHeight": 34}
    if len(rows) > page_size:
        opts.update(pagination=True, paginationPageSize=page_size, paginationPageSizeSelector=False)
    kw = {"getRowId": f"params.data[{row_id!r}]"} if row_id else {}
    kw.update(grid_kw)
    return dag.AgGrid(id=tid, rowData=rows, columnDefs=defs, defaultColDef={"sortable": True, "resizable": True},
                      columnSize="responsiveSizeToFit", dashGridOptions=opts, className="ag-theme-quartz grid-table",
                      style={"width": "100%"}, **kw)


def unit_value(name: str) -> str:
    """The filter dropdown's value for a unit name."""
    return ROOT if name == "" else name
