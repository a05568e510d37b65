"""Page-callback latency of the dashboard under concurrent clients, with and without the page-answer cache.

Serves the sample run (``traces/sample``) on a local port (werkzeug, threaded, as ``fsdp-doctor dashboard``
does), then ``--clients`` threads each post every page's callback to ``/_dash-update-component`` as the browser
does (``--rounds`` times over the five pages, each client starting on another page; a third of the clients
with ``?rank=0``, a third ``?rank=1``, the rest unfiltered), plus the one-second poll. Reports p50 and p99 per
page, measured side by side in one run: first with the cache off (every answer computed), then on (the
dashboard as shipped: one answer per request and run-state version, computed once). Also the cold cost of each
page (one client, nothing cached).

Goal: every page callback under 300 ms p50 at 20 concurrent clients. Usage::

    python benchmarks/dashboard_callbacks.py [--clients 20] [--rounds 4] [--run traces/sample]
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PAGES = ("overview", "memory", "communication", "steps", "units")
GOAL_MS = 300.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def page_body(page: str, search: str, version: int) -> bytes:
    return json.dumps({"output": "page.children", "outputs": {"id": "page", "property": "children"},
                       "inputs": [{"id": "url", "property": "pathname", "value": f"/{page}"},
                                  {"id": "url", "property": "search", "value": search},
                                  {"id": "version", "property": "data", "value": version}],
                       "changedPropIds": ["url.pathname"]}).encode()


def poll_body(n: int, version: int) -> bytes:
    return json.dumps({"output": "..version.data...status.children..",
                       "outputs": [{"id": "version", "property": "data"}, {"id": "status", "property": "children"}],
                       "inputs": [{"id": "tick", "property": "n_intervals", "value": n}],
                       "state": [{"id": "version", "property": "data", "value": version}],
                       "changedPropIds": ["tick.n_intervals"]}).encode()


class Served:
    def __init__(self, run: Path, cache: bool):
        from werkzeug.serving import make_server

        from fsdp_doctor.dashboards.app import create_app
        from fsdp_doctor.dashboards.state import RunState

        state = RunState(run, background_traces=False)
        state.refresh()
        self.app = create_app(run, state=state, cache_pages=cache)
        self.version = state.version
        self.port = _free_port()
        self.srv = make_server("127.0.0.1", self.port, self.app.server, threaded=True)
        self.thread = threading.Thread(target=self.srv.serve_forever, daemon=True)
        self.thread.start()

    def post(self, conn: http.client.HTTPConnection, body: bytes) -> float:
        t0 = time.perf_counter()
        conn.request("POST", "/_dash-update-component", body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()
        if r.status not in (200, 204):
            raise RuntimeError(f"HTTP {r.status}: {data[:200]!r}")
        return (time.perf_counter() - t0) * 1e3

    def stop(self):
        self.srv.shutdown()
        self.thread.join(5)


def cold(run: Path) -> dict[str, float]:
    """Each page once, one client, nothing cached: the cost of computing an answer."""
    s = Served(run, cache=False)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=120)
        s.post(conn, page_body("overview", "", s.version))  # first request: imports, template copy
        return {p: s.post(conn, page_body(p, "", s.version)) for p in PAGES}
    finally:
        s.stop()


def load(run: Path, clients: int, rounds: int, cache: bool) -> dict[str, list[float]]:
    s = Served(run, cache=cache)
    times: dict[str, list[float]] = {p: [] for p in PAGES}
    times["poll"] = []
    errors: list[str] = []
    start = threading.Barrier(clients)

    def client(i: int):
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=300)
        search = ("", "?rank=0", "?rank=1")[i % 3]
        try:
            start.wait()
            for k in range(rounds * len(PAGES)):
                page = PAGES[(i + k) % len(PAGES)]
                times[page].append(s.post(conn, page_body(page, search, s.version)))
                if k % len(PAGES) == 0:
                    times["poll"].append(s.post(conn, poll_body(k, s.version)))
        except Exception as e:  # noqa: BLE001
            errors.append(f"client {i}: {e}")
        finally:
            conn.close()

    th = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    s.stop()
    if errors:
        raise RuntimeError("; ".join(errors[:3]))
    return times


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--run", default=str(ROOT / "traces" / "sample"))
    ns = ap.parse_args(argv)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    run = Path(ns.run)
    c = cold(run)
    print(f"{run}: one client, nothing cached (the cost of one answer):")
    print("  " + ", ".join(f"{p} {v:.0f} ms" for p, v in c.items()))
    res = {}
    for cache in (False, True):
        res[cache] = load(run, ns.clients, ns.rounds, cache)
    print(f"{ns.clients} concurrent clients × {ns.rounds} rounds of the five pages (+ the poll), ms:")
    print(f"  {'callback':<14} {'no cache p50':>12} {'p99':>8}   {'cache p50':>10} {'p99':>8}   {'p50 ratio':>9}")
    ok = True
    for p in (*PAGES, "poll"):
        a, b = res[False][p], res[True][p]
        a50, b50 = statistics.median(a), statistics.median(b)
        print(f"  {p:<14} {a50:12.0f} {pct(a, 0.99):8.0f}   {b50:10.0f} {pct(b, 0.99):8.0f}   {a50 / b50:8.1f}x")
        ok = ok and (p == "poll" or b50 < GOAL_MS)
    print(f"goal: every page callback p50 < {GOAL_MS:.0f} ms with the cache: " + ("OK" if ok else "MISSED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
