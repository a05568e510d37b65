"""Units: the FSDP unit table (configuration and median per-step timings). Clicking a row selects the unit."""

from __future__ import annotations

from dash import Input, Output, State, no_update

from fsdp_doctor.present.fmt import UNKNOWN, fmt_ms, fmt_unit_figures

from .. import figures as F
from .common import ALL, Filters, graph, note, section, table, unit_value

COLUMNS = [("unit", "unit"), ("params", "params"), ("shard", "shard / rank"), ("gathered", "gathered"),
           ("dtype", "param dtype"), ("reshard", "reshard after fwd"), ("prefetch", "explicit prefetch"),
           ("async", "async unshard"), ("offload", "offload"), ("ac", "AC"), ("fwd", "fwd"), ("agf", "AG wait fwd"),
           ("bwd", "bwd"), ("agb", "AG wait bwd"), ("rec", "recompute")]


def unit_rows(units: list[dict]) -> list[dict]:
    rows = []
    for u in units:
        tm = u.get("timing_p50") or {}
        pf = []
        if u.get("forward_prefetch"):
            pf.append("fwd: " + ", ".join(u["forward_prefetch"]))
        if u.get("backward_prefetch"):
            pf.append("bwd: " + ", ".join(u["backward_prefetch"]))
        rows.append({
            "unit": ("\u2003" * u.get("depth", 0)) + F.unit_label(u["name"]), "name": u["name"],
            **dict(zip(("params", "shard", "gathered", "reshard"), fmt_unit_figures(u))),
            "dtype": u.get("param_dtype") or "/".join(u.get("orig_dtypes") or []) or "—",
            "prefetch": "; ".join(pf) or "default" if u.get("forward_prefetch") is not None else UNKNOWN,
            "async": UNKNOWN if u.get("unshard_async_op", False) is None else "yes" if u.get("unshard_async_op") else "no", "offload": u.get("offload") or "—",
            "ac": u.get("checkpoint", "none"), "fwd": fmt_ms(tm.get("fwd_ms")), "agf": fmt_ms(tm.get("ag_wait_fwd_ms")),
            "bwd": fmt_ms(tm.get("bwd_ms")), "agb": fmt_ms(tm.get("ag_wait_bwd_ms")), "rec": fmt_ms(tm.get("recompute_ms")),
        })
    return rows


def layout(snap, flt: Filters) -> list:
    units = snap.sections(flt.window).get("units") or snap.report.get("units") or []
    if not units:
        return [note("No FSDP unit configuration recorded yet (it is written at the first step).", "warning",
                     nid="empty-note")]
    shown = [u for u in units if flt.unit is None or u["name"] == flt.unit]
    return [
        section(f"FSDP units ({len(shown)} of {len(units)})" + ("" if flt.unit is None else " — clear the unit filter to see all"),
                table("tbl-units", unit_rows(shown), COLUMNS, left=("unit", "prefetch"), page_size=50,
                      row_selectable=False, cell_selectable=True),
                note("Click a unit's name to filter every page by it.", "info"), sid="sec-units"),
        section("", graph(F.unit_timing_figure(units, flt.unit), "fig-unit-timing")),
    ]


def register(app) -> None:
    @app.callback(Output("flt-unit", "value"), Input("tbl-units", "active_cell"),
                  State("tbl-units", "derived_viewport_data"), prevent_initial_call=True)
    def _select_unit(cell, data):
        if not cell or cell.get("column_id") != "unit" or not data:
            return no_update
        row = cell.get("row", -1)
        if not 0 <= row < len(data):
            return no_update
        name = data[row].get("name")
        return ALL if name is None else unit_value(name)
