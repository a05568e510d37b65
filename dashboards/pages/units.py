"""Units: the FSDP unit table (configuration and median per-step timings). Clicking a row selects the unit."""

from __future__ import annotations

from dash import Input, Output, no_update

from fsdp_doctor.present.fmt import UNKNOWN, fmt_ms, fmt_unit_figures, units_hooks_timed_note
from fsdp_doctor.report_sections import TraceUnitRow, UnitRow

from fsdp_doctor.present import figures as F
from .common import Filters, graph, note, section, table, unit_value

# table column -> UnitTiming field: each unit's own time, as the terminal and the HTML show it
TIMING_COLUMNS = (("fwd", "fwd_self_ms"), ("agf", "ag_wait_fwd_ms"), ("bwd", "bwd_self_ms"), ("agb", "ag_wait_bwd_ms"),
                  ("rec", "recompute_ms"))
COLUMNS = [("unit", "unit"), ("params", "params"), ("shard", "shard / rank"), ("gathered", "gathered"),
           ("dtype", "dtype"), ("reshard", "reshard"), ("prefetch", "prefetch"),
           ("async", "async"), ("offload", "offload"), ("ac", "AC"), ("fwd", "fwd (own)"), ("agf", "AG wait"),
           ("bwd", "bwd (own)"), ("agb", "AG wait"), ("rec", "recomp.")]


def unit_rows(units: list[UnitRow]) -> list[dict]:
    """The unit table's rows: display strings (``rid``: the unit filter's value)."""
    rows = []
    for u in units:
        tm = u.timing_p50 or None  # UNSET: no steady step timed the unit ("—")
        pf = []
        if u.forward_prefetch:
            pf.append("fwd: " + ", ".join(u.forward_prefetch))
        if u.backward_prefetch:
            pf.append("bwd: " + ", ".join(u.backward_prefetch))
        rows.append({
            "unit": ("\u2003" * u.depth) + F.unit_label(u.name), "rid": unit_value(u.name),
            **dict(zip(("params", "shard", "gathered", "reshard"), fmt_unit_figures(u))),
            "dtype": u.param_dtype or "/".join(u.orig_dtypes) or "—",
            "prefetch": ("; ".join(pf) or "default") if u.forward_prefetch is not None else UNKNOWN,
            "async": UNKNOWN if u.unshard_async_op is None else "yes" if u.unshard_async_op else "no",
            "offload": u.offload or "—", "ac": u.checkpoint,
            **{col: fmt_ms(getattr(tm, field) if tm else None) for col, field in TIMING_COLUMNS},
        })
    return rows


def trace_unit_rows(units: list[TraceUnitRow]) -> list[dict]:
    """A plain trace's unit rows (times only, no configuration): own and inclusive forward and backward."""
    return [{"unit": ("\u2003" * u.depth) + F.unit_label(u.name), "rid": unit_value(u.name),
             **{col: fmt_ms(getattr(u.timing_p50, field)) for col, field in TRACE_COLUMNS_FIELDS}} for u in units]


TRACE_COLUMNS_FIELDS = (("fwd", "fwd_self_ms"), ("bwd", "bwd_self_ms"), ("fwd_incl", "fwd_ms"), ("bwd_incl", "bwd_ms"))
TRACE_COLUMNS = [("unit", "unit"), ("fwd", "fwd (own)"), ("bwd", "bwd (own)"), ("fwd_incl", "fwd (incl. nested)"),
                 ("bwd_incl", "bwd (incl. nested)")]


def layout(snap, flt: Filters) -> list:
    units = snap.sections(flt.window, flt.rank).units or snap.report.unit_rows()
    if not units:
        return [note("No FSDP unit configuration recorded yet (it is written at the first step), and no FSDP2 "
                     "labels in the profiler traces.", "warning", nid="empty-note")]
    if isinstance(units[0], TraceUnitRow):
        return _trace_layout(units, flt)
    shown = [u for u in units if flt.unit is None or u.name == flt.unit]
    rows = unit_rows(shown)
    hooked = units_hooks_timed_note(shown)  # (why their waits read "—", as under the terminal's table)
    return [
        section(f"FSDP units ({len(shown)} of {len(units)})" + ("" if flt.unit is None else
                                                              " — clear the unit filter (× in the Unit box) to see all"),
                table("tbl-units", rows, columns(rows), left=("unit", "prefetch"), page_size=50, row_id="rid"),
                *([note(hooked, "info", nid="hooks-timed-note")] if hooked else []),
                note("Click a unit's name to filter every page by it.", "info"), sid="sec-units"),
        section("", graph(F.unit_timing_figure(units, flt.unit, who=_who(flt)), "fig-unit-timing")),
    ]


def _trace_layout(units: list[TraceUnitRow], flt: Filters) -> list:
    shown = [u for u in units if flt.unit is None or u.name == flt.unit]
    rows = trace_unit_rows(shown)
    return [
        note(f"From the profiler traces ({units[0].source}): median per step over {units[0].samples} rank-steps, "
             "all ranks and complete steps; the unit configuration and all-gather waits need a run recorded with "
             "fsdp_doctor.watch(...).", "info", nid="trace-units-note"),
        section(f"FSDP units ({len(shown)} of {len(units)})",
                table("tbl-units", rows, TRACE_COLUMNS, left=("unit",), page_size=50, row_id="rid"), sid="sec-units"),
        section("", graph(F.unit_timing_figure(units, flt.unit, who="all ranks, complete profiled steps"),
                          "fig-unit-timing")),
    ]


def columns(rows: list[dict]) -> list[tuple[str, str]]:
    """COLUMNS less offload and recompute when no unit has any (CPU runs, no checkpointing): the table fits."""
    empty = {c for c, blank in (("offload", ("—",)), ("rec", ("0 µs", "—"))) if all(r[c] in blank for r in rows)}
    return [c for c in COLUMNS if c[0] not in empty]


def _who(flt: Filters) -> str:
    who = "all ranks" if flt.rank is None else f"rank {flt.rank}"
    return who + ("" if flt.window is None else f", steps {flt.window[0]}–{flt.window[1]}")


def register(app) -> None:
    @app.callback(Output("flt-unit", "value", allow_duplicate=True), Input("tbl-units", "cellClicked"),
                  prevent_initial_call=True)
    def _select_unit(cell):
        if not cell or cell.get("colId") != "unit" or cell.get("rowId") is None:
            return no_update
        return cell["rowId"]
