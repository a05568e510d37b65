"""What stands between the network and the dashboard's callbacks: the ``Host:`` check, the callback request's
shape, and the page-response cache.

* **Host header**: a page served to a name other than the one the server was bound to is refused (403). A web
  page on another site whose name was made to resolve to 127.0.0.1 (DNS rebinding) sends its own name in
  ``Host:``, so it cannot read the report. Allowed: ``localhost``, ``127.0.0.1``, ``::1``, and the bound
  address; bound to every interface (``0.0.0.0``), also this machine's host names and interface addresses. The
  port is not compared: an SSH tunnel (``ssh -L 9000:localhost:8050``) sends its own local port.
* **Callback requests** (``POST /_dash-update-component``): a body that is not the JSON object Dash's renderer
  sends for one of this app's callbacks (its inputs and states, in order) is a 400 with one log line; so is a
  request whose values make a callback raise (a hand-made post). No traceback reaches the log.
* **Page responses**: the page callback's answer depends only on the request and the run state's version, so
  each answer is kept (keyed by both) and served again to every client that asks the same; one client computes
  a missing answer while the others wait for it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import threading
from collections import OrderedDict
from typing import Callable, Optional

from flask import Response, g, request

log = logging.getLogger("fsdp_doctor.dashboard")

LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD = frozenset({"0.0.0.0", "::", ""})
UPDATE_ROUTE = "_dash-update-component"
CACHE_ENTRIES = 256


def allowed_hosts(bound: str) -> frozenset[str]:
    """The names a ``Host:`` header may carry for a server bound to ``bound`` (lower case, no port)."""
    names = set(LOCAL_NAMES)
    if bound not in WILDCARD:
        names.add(bound.lower().strip("[]"))
        return frozenset(names)
    for n in (socket.gethostname(), socket.getfqdn()):
        if n:
            names.add(n.lower())
    try:
        import psutil

        for addrs in psutil.net_if_addrs().values():
            for a in addrs:
                if a.family in (socket.AF_INET, socket.AF_INET6):
                    names.add(a.address.split("%")[0].lower())
    except (ImportError, OSError):
        pass
    return frozenset(names)


def host_name(header: str) -> str:
    """The host of a ``Host:`` header without its port: ``[::1]:8050`` -> ``::1``, ``a.b:80`` -> ``a.b``."""
    h = (header or "").strip().lower()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h
    if h.count(":") == 1:
        return h.split(":")[0]
    return h


def callback_problem(body: bytes, callback_map: dict) -> str:
    """What is wrong with a callback request's body for this app ("" when it is well formed)."""
    try:
        req = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return "the body is not JSON"
    if not isinstance(req, dict):
        return "the body is not a JSON object"
    out = req.get("output")
    if not isinstance(out, str) or out not in callback_map:
        return "no such callback output"
    if not isinstance(req.get("outputs"), (dict, list)):
        return "no outputs"
    if not isinstance(req.get("changedPropIds", []), list):
        return "changedPropIds is not a list"
    spec = callback_map[out]
    for key in ("inputs", "state"):
        got, want = req.get(key, []), spec.get(key) or []
        if not isinstance(got, list) or len(got) != len(want):
            return f"its {key} do not match the callback's"
        for a, b in zip(got, want):
            if not isinstance(a, dict) or a.get("id") != b["id"] or a.get("property") != b["property"]:
                return f"its {key} do not match the callback's"
    return ""


class _PageCache:
    """Responses of the cached callbacks, keyed by (run-state version, request body); at most CACHE_ENTRIES."""

    def __init__(self):
        self._lock = threading.Lock()
        self._done: OrderedDict[tuple, bytes] = OrderedDict()
        self._busy: dict[tuple, threading.Event] = {}

    def claim(self, key: tuple) -> Optional[bytes]:
        """The cached answer; or None, and then the caller computes it (others asking meanwhile wait)."""
        while True:
            with self._lock:
                hit = self._done.get(key)
                if hit is not None:
                    self._done.move_to_end(key)
                    return hit
                ev = self._busy.get(key)
                if ev is None:
                    self._busy[key] = threading.Event()
                    return None
            ev.wait(30)

    def put(self, key: tuple, data: Optional[bytes]) -> None:
        with self._lock:
            if data is not None:
                self._done[key] = data
                while len(self._done) > CACHE_ENTRIES:
                    self._done.popitem(last=False)
            ev = self._busy.pop(key, None)
        if ev is not None:
            ev.set()


def install(app, hosts: frozenset[str], version: Callable[[], int], cached_outputs: tuple[str, ...] = ()) -> None:
    """Adds the Host check, the callback-request check and the response cache of ``cached_outputs`` (callback
    output ids whose answer depends only on the request and ``version()``) to a Dash app's server."""
    server = app.server
    update = app.config.routes_pathname_prefix + UPDATE_ROUTE
    cache = _PageCache()

    @server.before_request
    def _check():
        name = host_name(request.host)
        if name not in hosts:
            log.warning("fsdp-doctor: refused a request for host %r (serving %s)", name[:80], ", ".join(sorted(hosts)))
            return Response(f"host {name[:80]!r} is not served here\n", 403, mimetype="text/plain")
        if request.path != update or request.method != "POST":
            return None
        body = request.get_data(cache=True)
        why = callback_problem(body, app.callback_map)
        if why:
            log.warning("fsdp-doctor: rejected a malformed callback request (%s)", why)
            return Response(f"malformed callback request: {why}\n", 400, mimetype="text/plain")
        out = json.loads(body)["output"]
        if out in cached_outputs:
            key = (version(), hashlib.sha1(body).digest())
            hit = cache.claim(key)
            if hit is not None:
                return Response(hit, 200, mimetype="application/json")
            g.fsdp_cache_key = key
        return None

    @server.after_request
    def _store(resp):
        key = g.pop("fsdp_cache_key", None)
        if key is not None:
            cache.put(key, resp.get_data() if resp.status_code == 200 else None)
        return resp

    @server.teardown_request
    def _release(_exc):  # an answer that failed: let the next asker compute it
        key = g.pop("fsdp_cache_key", None)
        if key is not None:
            cache.put(key, None)

    @server.errorhandler(Exception)
    def _bad_values(e):
        from werkzeug.exceptions import HTTPException

        if isinstance(e, HTTPException):
            return e
        if request.path != update:
            raise e
        # the request had this app's shape but values no renderer sends (a hand-made post)
        log.warning("fsdp-doctor: rejected a callback request (%s: %s)", type(e).__name__, str(e)[:200])
        return Response(f"malformed callback request ({type(e).__name__})\n", 400, mimetype="text/plain")
