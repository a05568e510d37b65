"""The Dash app: ``fsdp-doctor dashboard PATH [--host 127.0.0.1] [--port 8050]``.

One server-side :class:`~fsdp_doctor.dashboards.state.RunState` follows the run directory; a ``dcc.Interval``
polls it every second and bumps a version number when something new was read, and only then are the filters
and the current page re-rendered. Each page has its own URL (``/overview``, ``/memory``, ...) and the filters
live in its query string (``?rank=1&steps=5-20&unit=layers.0``): a link opens the same view, and the back
button undoes a page change or a filter change. The app serves its own assets and Dash's bundled scripts, never a file of the run
directory, and runs without debug mode.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

from typing import Optional

from dash import Dash, Input, Output, State, ctx, dcc, html, no_update

from . import guard
from .pages import PAGES, page_key
from .pages.common import ALL, Query, run_state, unit_label, unit_value
from .state import RunState

POLL_MS = 1000  # new steps appear within two seconds


def _ranks(snap) -> list[int]:
    return sorted(snap.steps) or sorted({w.rank for w in snap.windows})  # plain Kineto traces: their ranks


def _rank_options(snap) -> list[dict]:
    return [{"label": "all ranks", "value": ALL}] + [{"label": f"rank {r}", "value": str(r)} for r in _ranks(snap)]


def _unit_options(snap) -> list[dict]:
    names = [u.name for u in snap.report.unit_rows()]  # the records' units, else the trace's FSDP2 labels
    ov = snap.report.overlap
    if not names and ov is not None:  # plain Kineto traces: the units their collectives were attributed to
        names = list(dict.fromkeys(r.unit for r in ov.per_unit if r.unit is not None))
    return [{"label": "all units", "value": ALL}] + [{"label": unit_label(n), "value": unit_value(n)} for n in names]


def _step_bounds(snap) -> tuple[int, int]:
    lo = min((c["step"][0] for c in snap.steps.values() if c["step"]), default=0)
    hi = max((c["step"][-1] for c in snap.steps.values() if c["step"]), default=0)
    return lo, max(hi, lo)


def _marks(lo: int, hi: int) -> dict:
    if hi <= lo:
        return {lo: str(lo)}
    n = 6
    stepw = max(1, (hi - lo) // n)
    marks = {s: str(s) for s in range(lo, hi + 1, stepw)}
    marks[hi] = str(hi)
    return marks


def _status(snap) -> str:
    return _run_status(snap) + (" · the run changed: read again from scratch" if snap.notice else "")


def _run_status(snap) -> str:
    run = snap.report.run
    if not snap.has_records:
        if snap.windows:
            return f"{len(snap.windows)} profiler trace(s), no fsdp-doctor records"
        return f"waiting for records in {snap.path} …"
    counts = run.steps_recorded.values()
    lo, hi = min(counts, default=0), max(counts, default=0)
    n = f"{hi} steps" if lo == hi else f"{lo}-{hi} steps"
    # when the records last grew, not now: a run whose ranks died stays at its last record
    return (f"{run_state(snap.report, snap.updated)} · {n} × {len(run.ranks)} ranks · last record "
            f"{time.strftime('%H:%M:%S', time.localtime(snap.updated))}")


def _nav(app: Dash, pathname: Optional[str], search: Optional[str]) -> list:
    """The page links: each keeps the current filters (the query string); the current page is marked."""
    cur = page_key(app.strip_relative_path(pathname or "/"))
    return [dcc.Link(label, href=app.get_relative_path(f"/{key}") + (search or ""), id=f"tab-{key}",
                     className="tab tab--selected" if key == cur else "tab")
            for key, (label, _) in PAGES.items()]


def _answers_version(state: RunState) -> tuple:
    """What a cached page answer depends on besides the request: the run state's version and whether the run is
    live. A run whose ranks died writes nothing more, so its version stays: the Overview answered while it was
    "live" (its warnings held back) was served for good (a new-user trial's killed rank, minutes later)."""
    snap = state.snapshot()
    return state.version, run_state(snap.report, snap.updated)


def create_app(path: Path | str, *, state: RunState | None = None, poll_ms: int = POLL_MS,
               host: str = "127.0.0.1", cache_pages: bool = True) -> Dash:
    """The app over ``path``; ``host`` is the address it will be bound to (the ``Host:`` headers it accepts,
    :mod:`fsdp_doctor.dashboards.guard`). ``cache_pages=False`` computes every page answer (the benchmark's
    baseline)."""
    path = Path(path)
    state = state or RunState(path)
    app = Dash(__name__, title=f"fsdp-doctor · {path.name or path}", suppress_callback_exceptions=True,
               update_title=None, assets_folder=str(Path(__file__).parent / "assets"), serve_locally=True)
    app._fsdp_state = state  # for tests and the benchmark

    def serve_layout():
        state.refresh()
        snap = state.snapshot()
        lo, hi = _step_bounds(snap)
        return html.Div([
            dcc.Location(id="url", refresh=False),
            html.Header([
                html.Div([html.Span("fsdp-doctor", className="brand"), html.Span(str(path), className="run-path")]),
                html.Span(_status(snap), id="status", className="status"),
            ], className="topbar"),
            html.Div([
                html.Div([html.Label("Rank", htmlFor="flt-rank"),
                          dcc.Dropdown(id="flt-rank", options=_rank_options(snap), value=ALL, clearable=False,
                                       searchable=False)], className="flt flt-rank"),
                html.Div([html.Label("Steps", htmlFor="flt-lo"),
                          html.Div([
                              dcc.Input(id="flt-lo", type="number", value=lo, debounce=True, min=0, step=1,
                                        className="step-box", placeholder="first"),
                              html.Div(dcc.RangeSlider(id="flt-steps", min=lo, max=hi, step=1, value=[lo, hi],
                                                       marks=_marks(lo, hi), allowCross=False, allow_direct_input=False,
                                                       tooltip={"placement": "bottom", "always_visible": False}),
                                       className="step-slider"),
                              dcc.Input(id="flt-hi", type="number", value=hi, debounce=True, min=0, step=1,
                                        className="step-box", placeholder="last"),
                          ], className="step-row")], className="flt flt-steps"),
                html.Div([html.Label("Unit", htmlFor="flt-unit"),
                          dcc.Dropdown(id="flt-unit", options=_unit_options(snap), value=ALL, clearable=True,
                                       placeholder="all units", maxHeight=420, optionHeight=32)],
                         className="flt flt-unit"),
            ], className="filters"),
            html.Nav(_nav(app, "/", ""), id="nav", className="tabs"),
            html.Main(id="page", className="page"),
            dcc.Interval(id="tick", interval=poll_ms),
            dcc.Store(id="version", data=snap.version),
        ], className="app")

    app.layout = serve_layout

    @app.callback(Output("version", "data"), Output("status", "children"), Input("tick", "n_intervals"),
                  State("version", "data"), prevent_initial_call=True)
    def _poll(_n, version):
        state.refresh(throttle=True)
        snap = state.snapshot()
        if snap.version == version:  # (the status still moves: a run that stopped writing says so)
            return no_update, _status(snap)
        return snap.version, _status(snap)

    @app.callback(Output("flt-rank", "options"), Output("flt-unit", "options"), Output("flt-steps", "min"),
                  Output("flt-steps", "max"), Output("flt-steps", "value", allow_duplicate=True),
                  Output("flt-steps", "marks"), Input("version", "data"), State("flt-steps", "value"),
                  State("flt-steps", "max"), prevent_initial_call=True)
    def _filters(_version, value, old_max):
        snap = state.snapshot()
        lo, hi = _step_bounds(snap)
        if not value or len(value) != 2:
            value = [lo, hi]
        elif old_max is None or value[1] >= old_max:  # the window followed the newest step: keep following
            value = [max(lo, value[0]), hi]
        return _rank_options(snap), _unit_options(snap), lo, hi, value, _marks(lo, hi)

    @app.callback(Output("url", "search"), Output("flt-rank", "value"), Output("flt-steps", "value"),
                  Output("flt-lo", "value"), Output("flt-hi", "value"), Output("flt-unit", "value"),
                  Input("url", "search"), Input("flt-rank", "value"), Input("flt-steps", "value"),
                  Input("flt-lo", "value"), Input("flt-hi", "value"), Input("flt-unit", "value"),
                  State("flt-steps", "min"), State("flt-steps", "max"))
    def _sync(search, rank, steps, lo_box, hi_box, unit, lo, hi):
        """The URL's query string is the filters' state: a change of a control writes it (a history entry, so
        the back button works), a change of the URL (a link, back/forward) sets the controls."""
        lo = 0 if lo is None else lo
        hi = lo if hi is None else hi
        trig = ctx.triggered_id
        if trig in (None, "url"):
            q = Query.parse(search)
            w = q.slider(lo, hi)
            return no_update, q.rank_value(), w, w[0], w[1], q.unit_value()
        if trig in ("flt-lo", "flt-hi"):
            cur = list(steps or [lo, hi])
            a, b = (lo_box, cur[1]) if trig == "flt-lo" else (cur[0], hi_box)
            if a is None or b is None:  # an empty or invalid box: keep the window
                return no_update, no_update, no_update, cur[0], cur[1], no_update
            a, b = sorted((min(max(int(a), lo), hi), min(max(int(b), lo), hi)))
            steps = [a, b]
        q = Query.from_controls(rank, steps, unit, lo, hi)
        new = q.search()
        out_search = no_update if new == (search or "") else new
        s = list(steps or [lo, hi])
        if trig in ("flt-lo", "flt-hi"):
            return out_search, no_update, s, s[0], s[1], no_update
        if trig == "flt-steps":
            return out_search, no_update, no_update, s[0], s[1], no_update
        return out_search, no_update, no_update, no_update, no_update, no_update

    @app.callback(Output("nav", "children"), Input("url", "pathname"), Input("url", "search"))
    def _links(pathname, search):
        return _nav(app, pathname, search)

    @app.callback(Output("page", "children"), Input("url", "pathname"), Input("url", "search"),
                  Input("version", "data"))
    def _page(pathname, search, _version):
        snap = state.snapshot()
        lo, hi = _step_bounds(snap)
        flt = Query.parse(search).filters(lo, hi)
        ranks = _ranks(snap)
        unknown = flt.rank if flt.rank is not None and ranks and flt.rank not in ranks else None
        if unknown is not None:  # (a link from another run, a typo): every rank, and say so, not "no steps recorded"
            flt = dataclasses.replace(flt, rank=None)
        _, mod = PAGES[page_key(app.strip_relative_path(pathname or "/"))]
        try:
            out = list(mod.layout(snap, flt))
        except Exception as e:  # noqa: BLE001  (a presenter bug must not blank the whole app)
            out = [html.Div(f"This page could not be drawn ({type(e).__name__}: {e}).", className="note note-error")]
        if unknown is not None:
            out.insert(0, html.Div(f"This run has no rank {unknown} (its ranks: "
                                   f"{', '.join(map(str, ranks))}): showing all ranks.", className="note note-warning",
                                   id="rank-note"))
        if snap.notice:  # the run was replaced: say so on every page
            out.insert(0, html.Div(f"Reloaded: {snap.notice}.", className="note note-warning", id="reload-note"))
        return out

    for _, mod in PAGES.values():
        if hasattr(mod, "register"):
            mod.register(app)
    guard.install(app, guard.allowed_hosts(host), lambda: _answers_version(state),
                  cached_outputs=("page.children", "nav.children") if cache_pages else ())
    return app


def serve(path: Path | str, host: str = "127.0.0.1", port: int = 8050) -> int:
    """Serves the dashboard until interrupted; prints the URL. Returns the exit code."""
    path = Path(path)
    if not path.exists() and not path.parent.is_dir():
        print(f"fsdp-doctor: {path}: no such run directory (nor its parent, {path.parent})", file=sys.stderr)
        return 2
    if path.exists() and not path.is_dir():
        print(f"fsdp-doctor: {path}: not a directory (the dashboard serves a run directory written by "
              "fsdp_doctor.watch; for a single trace file use `fsdp-doctor analyze`)", file=sys.stderr)
        return 2
    state = RunState(path)
    state.refresh()
    if state.refused:  # (the store decides, as for analyze and compare: one line, exit 2)
        print(f"fsdp-doctor: {state.refused}", file=sys.stderr)
        return 2
    if not path.exists():  # started before the run: watch(out_dir=...) creates it
        print(f"fsdp-doctor: {path} does not exist yet; the dashboard shows the run as soon as its records appear "
              "there", file=sys.stderr)
    elif not state.snapshot().has_records:
        # (plain profiler traces: the pages show them; "records ... yet" read as a wait for records that never come,
        # a new-user trial)
        try:
            n = len(state._trace_files())  # (decoded on a background thread: counted as files here)
        except OSError:
            n = 0
        print(f"fsdp-doctor: {path}: {n} profiler trace file(s), no fsdp-doctor records: the pages show the traces"
              if n else f"fsdp-doctor: {path}: no fsdp-doctor records (rank*.records.jsonl) yet; the dashboard "
              "shows the run as soon as they appear", file=sys.stderr)
    app = create_app(path, state=state, host=host)
    import logging

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per poll request in the terminal
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    print(f"fsdp-doctor dashboard for {path}: http://{shown}:{port}/  (Ctrl+C to stop)", flush=True)
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"fsdp-doctor: listening on {host}: anyone who can reach this machine can read the report",
              file=sys.stderr)
    try:
        app.run(host=host, port=port, debug=False, dev_tools_ui=False, dev_tools_hot_reload=False)
    except OSError as e:
        print(f"fsdp-doctor: cannot listen on {host}:{port} ({e.strerror or e}); choose another --port", file=sys.stderr)
        return 1
    return 0
