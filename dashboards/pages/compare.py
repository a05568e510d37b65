"""Compare: two runs chosen from the parent folder of the served run (its sibling run directories and
plain-trace folders), side by side. The comparison is ``fsdp_doctor.pipeline.compare_runs``'s (the same as
``fsdp-doctor compare``); this page formats it with the terminal's tables and the HTML report's figures."""

from __future__ import annotations

import threading
from pathlib import Path

from dash import Input, Output, dcc, html

from fsdp_doctor.present.compare import tables
from fsdp_doctor.present.compare_figures import FIGURES

from .common import Filters, graph, note, section, table

MAX_CANDIDATES = 200  # folders listed from the parent folder
_CACHE: dict = {}  # (a, b, stamps) -> Comparison: a pair is compared once until either run changes
_LOCK = threading.Lock()


def _is_run(p: Path) -> bool:
    from fsdp_doctor.store import layout

    if layout.has_run(p):
        return True
    try:
        return any(layout.is_trace_name(f) for f in p.iterdir() if f.is_file())
    except OSError:
        return False


def candidates(served: Path) -> list[Path]:
    """The runs to choose from: the served run and its siblings (folders of the parent holding records or
    traces), and the served folder's own sub-folders that do (a folder of runs)."""
    served = Path(served).resolve()
    out: list[Path] = []
    for parent in (served.parent, served):
        try:
            subs = sorted(p for p in parent.iterdir() if p.is_dir())[:MAX_CANDIDATES]
        except OSError:
            continue
        out += [p for p in subs if p not in out and _is_run(p)]
    if _is_run(served) and served not in out:
        out.insert(0, served)
    return out


def _stamp(p: Path) -> tuple:
    try:
        return tuple(sorted((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in p.iterdir() if f.is_file()))
    except OSError:
        return ()


def comparison(a: Path, b: Path):
    """The comparison of ``b`` against ``a``, cached while neither run's files change."""
    from fsdp_doctor import load_run
    from fsdp_doctor.pipeline import compare_runs

    key = (str(a), str(b), _stamp(a), _stamp(b))
    with _LOCK:
        if key not in _CACHE:
            _CACHE.clear()
            _CACHE[key] = compare_runs(load_run(a), load_run(b))
        return _CACHE[key]


def layout(snap, flt: Filters) -> list:
    runs = candidates(snap.path)
    if len(runs) < 2:
        return [note(f"Compare needs two runs: put run directories (or plain-trace folders) side by side in "
                     f"{Path(snap.path).resolve().parent} and open any of them.", "warning", nid="cmp-empty")]
    opts = [{"label": p.name, "value": str(p)} for p in runs]
    here = str(Path(snap.path).resolve())
    # Run A by default: a sibling holding records before a folder that only has *.json files (which may be traces)
    from fsdp_doctor.store import layout as store_layout

    others = [o["value"] for o in opts if o["value"] != here]
    first = next((v for v in others if store_layout.has_run(Path(v))), others[0] if others else opts[0]["value"])
    pick = [html.Div([html.Label(f"Run {k}", htmlFor=f"cmp-{k.lower()}"),
                      dcc.Dropdown(id=f"cmp-{k.lower()}", options=opts, value=v, clearable=False, persistence=True)],
                     className="flt") for k, v in (("A", first), ("B", here if here in {o["value"] for o in opts}
                                                                         else opts[1]["value"]))]
    return [section("Compare two runs", html.Div(pick, className="filters"),
                    note("B against A: Δ = B − A. Step-time changes carry a bootstrap 95% interval.", "info"),
                    sid="sec-compare-pick"),
            dcc.Loading(html.Div(id="cmp-body"))]


def body(a: str, b: str) -> list:
    if not a or not b:
        return [note("Choose two runs.", "info")]
    if a == b:
        return [note("A and B are the same run: choose another.", "warning", nid="cmp-same")]
    try:
        c = comparison(Path(a), Path(b))
    except ValueError as e:  # nothing to compare in a folder: its one line
        return [note(f"cannot compare: {e}", "error", nid="cmp-error")]
    except Exception as e:  # noqa: BLE001  (a run that cannot be read: one line, not a blank page)
        return [note(f"cannot compare: {type(e).__name__}: {e}", "error", nid="cmp-error")]
    out = [html.Div(c.summary, id="cmp-summary", className="verdict")]
    out += [note(n, "warning") for n in c.notes]
    for i, t in enumerate(tables(c)):
        cols = [(f"c{j}", h or " ") for j, h in enumerate(t.header)]
        rows = [{f"c{j}": x for j, x in enumerate(r)} for r in t.rows]
        kids = [table(f"tbl-cmp-{i}", rows, cols, left=("c0", "c1", "c2") if t.title == "Findings" else ("c0",))
                ] if rows else []
        if t.note:
            kids.append(note(t.note, "info"))
        out.append(section(t.title, *kids))
    for build in FIGURES:
        fig = build(c)
        if fig is not None:
            out.append(section("", graph(fig, f"fig-cmp-{build.__name__}")))
    return out


def register(app) -> None:
    state = getattr(app, "_fsdp_state", None)

    def offered(a: str, b: str) -> list:
        # only the runs the dropdowns offer (the served run's siblings): a request naming another path reads nothing
        if state is not None and a and b:
            runs = {str(p) for p in candidates(state.path)}
            if a not in runs or b not in runs:
                return [note("Choose two runs from the lists.", "warning", nid="cmp-unknown")]
        return body(a, b)

    app.callback(Output("cmp-body", "children"), Input("cmp-a", "value"), Input("cmp-b", "value"))(offered)
