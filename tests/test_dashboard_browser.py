"""The dashboard in a real headless Chromium (selenium): every page renders its graphs without console errors,
a finding card shows its evidence, and a run still being written shows new steps without a reload.

Screenshots of every page land in tests/artifacts/dashboard/ (or $FSDP_DOCTOR_ARTIFACTS)."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "traces" / "sample"
ARTIFACTS = Path(os.environ.get("FSDP_DOCTOR_ARTIFACTS", ROOT / "tests" / "artifacts")) / "dashboard"
PAGES = ("overview", "memory", "communication", "steps", "units")
# graphs each page must draw for the sample run (memory has no section in the sample: a note instead)
MIN_GRAPHS = {"overview": 0, "memory": 0, "communication": 3, "steps": 4, "units": 1}


def _find(names, dirs=("/usr/bin", "/usr/local/bin", "/usr/lib/chromium")):
    for n in names:
        p = shutil.which(n)
        if p:
            return p
        for d in dirs:
            if os.access(os.path.join(d, n), os.X_OK):
                return os.path.join(d, n)
    return None


CHROMIUM = _find(("chromium", "chromium-browser", "google-chrome"))
CHROMEDRIVER = _find(("chromedriver",))

if CHROMIUM is None or CHROMEDRIVER is None:
    pytest.skip("chromium / chromedriver not found (run `bash .ci/browser-deps.sh`)", allow_module_level=True)
selenium = pytest.importorskip("selenium")
from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.common.exceptions import ElementClickInterceptedException, StaleElementReferenceException  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


# ------------------------------------------------------------------ fixtures

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    def __init__(self, path: Path):
        from werkzeug.serving import make_server

        from fsdp_doctor.dashboards.app import create_app

        self.app = create_app(path)
        self.port = _free_port()
        self.srv = make_server("127.0.0.1", self.port, self.app.server, threaded=True)
        self.thread = threading.Thread(target=self.srv.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.port}/"

    def stop(self):
        self.srv.shutdown()
        self.thread.join(5)


@pytest.fixture
def serve():
    servers = []

    def start(path):
        s = _Server(path)
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def driver():
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="fsdp-doctor-chromium-")
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              "--disable-dev-shm-usage", "--window-size=1366,768", f"--user-data-dir={profile}", "--hide-scrollbars",
              "--force-device-scale-factor=1"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    try:
        d = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    except Exception as e:  # noqa: BLE001
        shutil.rmtree(profile, ignore_errors=True)
        pytest.skip(f"headless chromium could not start ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
    d.set_page_load_timeout(30)
    yield d
    d.quit()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def browser(driver, serve):
    """The shared browser for one test; leaves the page (and drains the log) before the test's server stops."""
    driver.get("about:blank")
    _severe(driver)
    driver.set_window_size(1366, 768)
    yield driver
    driver.get("about:blank")
    _severe(driver)


def _severe(driver) -> list[str]:
    try:
        logs = driver.get_log("browser")
    except Exception:  # noqa: BLE001  (a driver without the log endpoint: nothing to check)
        return []
    return [e["message"] for e in logs if e.get("level") == "SEVERE"]


def _wait(driver, cond, timeout=20.0, what="condition"):
    """Waits until ``cond(driver)`` is truthy; an element re-rendered while the condition read it (stale, as Dash
    replaces components under load) only makes the condition run again, on freshly found elements."""
    return WebDriverWait(driver, timeout, poll_frequency=0.1,
                         ignored_exceptions=(StaleElementReferenceException,)).until(lambda d: cond(d), message=what)


def _act(driver, act, what="action"):
    """Runs ``act(driver)`` (which finds its elements itself) until it goes through: a click or a key press on an
    element Dash replaced meanwhile is retried on the new one."""
    def go(d):
        try:
            act(d)
        except (StopIteration, ElementClickInterceptedException):  # not rendered yet, or covered for a moment
            return False
        return True

    return _wait(driver, go, what=what)


def _graphs_drawn(driver) -> int:
    return driver.execute_script(
        "return document.querySelectorAll('#page .js-plotly-plot .main-svg').length > 0 ? "
        "document.querySelectorAll('#page .js-plotly-plot').length : 0;")


def _open_tab(driver, key: str):
    driver.find_element(By.ID, f"tab-{key}").click()
    _wait(driver, lambda d: d.execute_script(
        "var l = document.querySelector('#_dash-app-content, #react-entry-point');"
        "return !document.querySelector('[data-dash-is-loading=\"true\"]');"), what="page settled")


def _screenshot(driver, name: str, full: bool = False, width: int = 1366, height: int = 768):
    """A PNG of the page at a ``width``×``height`` viewport (``full``: the whole page at that width)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    metrics = {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
    time.sleep(0.4)  # responsive graphs re-layout
    if full:
        h = driver.execute_script("return document.documentElement.scrollHeight")
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", dict(metrics, height=max(height, min(h, 6000))))
        time.sleep(0.4)
    try:
        driver.save_screenshot(str(ARTIFACTS / f"{name}.png"))
    finally:
        driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def _copy_sample(dst: Path, mutate=None) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(SAMPLE / "manifest.json", dst / "manifest.json")
    shutil.copytree(SAMPLE / "profiler", dst / "profiler")
    for src in sorted(SAMPLE.glob("rank*.records.jsonl")):
        lines = src.read_bytes().splitlines(keepends=True)
        if mutate is not None:
            lines = [mutate(ln) for ln in lines]
        (dst / src.name).write_bytes(b"".join(lines))
    return dst


# ------------------------------------------------------------------ tests

def test_every_page_renders_without_console_errors(browser, serve, tmp_path):
    driver = browser
    srv = serve(_copy_sample(tmp_path / "run"))
    driver.set_window_size(1366, 768)
    driver.get(srv.url)
    _wait(driver, lambda d: d.find_elements(By.ID, "kpi-p50"), what="overview KPIs")
    srv.app._fsdp_state.wait_traces(60)
    has_memory = srv.app._fsdp_state.snapshot().report.memory is not None
    need = dict(MIN_GRAPHS, memory=2 if has_memory else 0)
    for key in PAGES:
        _open_tab(driver, key)
        if need[key]:
            _wait(driver, lambda d: _graphs_drawn(d) >= need[key], timeout=30,
                  what=f"{key}: {need[key]} graphs drawn")
        else:
            _wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#page > *"), what=f"{key}: content")
        time.sleep(0.3)
        _screenshot(driver, f"{key}-1366x768")
        _screenshot(driver, f"{key}-full", full=True)
        errs = _severe(driver)
        assert not errs, f"{key}: browser console errors: {errs}"
    # memory: without a memory section in the report the page says so clearly
    _open_tab(driver, "memory")
    _wait(driver, lambda d: d.find_elements(By.ID, "fig-mem-timeline" if has_memory else "memory-absent"),
          what="memory page")
    # filters: selecting rank 1 narrows the steps page to one trace
    _open_tab(driver, "steps")
    _wait(driver, lambda d: _graphs_drawn(d) >= 4, what="steps graphs")
    n_all = driver.execute_script("return document.getElementById('fig-step-time').querySelectorAll('.scatterlayer .trace').length")
    driver.find_element(By.CSS_SELECTOR, "#flt-rank").click()
    opt = _wait(driver, lambda d: [e for e in d.find_elements(By.XPATH, "//*[contains(@class,'option') or @role='option']")
                                   if e.text.strip() == "rank 1"], what="rank 1 option")
    opt[0].click()
    _wait(driver, lambda d: d.execute_script(
        "return document.getElementById('fig-step-time') && document.getElementById('fig-step-time')"
        ".querySelectorAll('.scatterlayer .trace').length") == 1, what="one rank drawn")
    assert n_all == 2
    # a large monitor too
    _open_tab(driver, "communication")
    _wait(driver, lambda d: _graphs_drawn(d) >= 3, what="communication graphs")
    _screenshot(driver, "communication-2560x1440-rank1", width=2560, height=1440)
    assert not _severe(driver)


def _more_gc(line: bytes) -> bytes:
    """Every steady step spends 12 ms in GC (the sample spends none): the GC rule must fire."""
    if not line.startswith(b'{"t":"step"'):
        return line
    d = msgspec.json.decode(line)
    if d["step"] > 0:
        d["gc_ms"] = d.get("gc_ms", 0.0) + 12.0
        d["gc_count"] = d.get("gc_count", 0) + 2
        d["wall_ms"] += 12.0
        d["outside_ms"] = d.get("outside_ms", 0.0) + 12.0
    return msgspec.json.encode(d) + b"\n"


def test_finding_card_shows_evidence_and_fix(browser, serve, tmp_path):
    driver = browser
    srv = serve(_copy_sample(tmp_path / "gc-run", mutate=_more_gc))
    findings = srv.app._fsdp_state.snapshot().report.findings
    assert any(f.code == "jitter.gc" for f in findings), [f.code for f in findings]
    driver.set_window_size(1366, 768)
    driver.get(srv.url)
    card = _wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, ".finding-warning, .finding-critical"),
                 what="finding card")[0]
    text = card.text
    assert "GC pauses" in text
    assert "Evidence" in text and "gc per step" in text and "gc ms per step" not in text  # (the unit in the value)
    assert "12.0" in text or "12.00" in text  # the evidence value, formatted
    assert card.find_elements(By.CSS_SELECTOR, ".fix-code") and "gc.freeze()" in card.find_element(By.CSS_SELECTOR, ".fix-code").text
    assert card.find_elements(By.CSS_SELECTOR, ".copy-btn")
    assert "Expected: step" in text
    _screenshot(driver, "overview-finding-1366x768")
    _screenshot(driver, "overview-finding-full", full=True)
    assert not _severe(driver)


def _comm_buffers_unknown(line: bytes) -> bytes:
    """Every step's memory probe could not read the communication buffers (a torch without the internals): it
    names the category unknown."""
    if not line.startswith(b'{"t":"step"'):
        return line
    d = msgspec.json.decode(line)
    if d.get("memory"):
        d["memory"]["unknown"] = ["comm_buffers"]
    return msgspec.json.encode(d) + b"\n"


def test_memory_category_not_measured_reads_unknown(browser, serve, tmp_path):
    driver = browser
    srv = serve(_copy_sample(tmp_path / "unknown-run", mutate=_comm_buffers_unknown))
    mem = srv.app._fsdp_state.snapshot().report.memory
    assert mem is not None and all(m.unknown_categories == ["comm_buffers"] for m in mem.per_rank.values())
    driver.get(srv.url.rstrip("/") + "/memory")
    note = _wait(driver, lambda d: d.find_elements(By.ID, "mem-unknown-note"), what="unknown-category note")[0]
    assert "comm buffers" in note.text and "unknown" in note.text
    # the breakdown's bar for the category is labelled "unknown" on screen (no length: no bytes are claimed)
    _wait(driver, lambda d: "unknown" in d.execute_script(
        "var t = document.querySelectorAll('#fig-mem-breakdown .bartext');"
        "return Array.prototype.map.call(t, function(e){ return e.textContent; }).join('|');").split("|"),
        what="'unknown' drawn on the breakdown")
    legend = driver.execute_script("return Array.prototype.map.call(document.querySelectorAll("
                                   "'#fig-mem-timeline .legendtext'), function(e){ return e.textContent; });")
    assert legend and "comm buffers" not in legend and "activations" in legend  # not stacked as a measured 0
    _screenshot(driver, "memory-unknown-category-full", full=True)
    assert not _severe(driver)


def test_live_run_shows_new_steps_without_reload(browser, serve, tmp_path):
    driver = browser
    run = tmp_path / "live"
    run.mkdir()
    srcs = sorted(SAMPLE.glob("rank*.records.jsonl"))
    lines = {s.name: s.read_bytes().splitlines(keepends=True) for s in srcs}
    shutil.copy(SAMPLE / "manifest.json", run / "manifest.json")
    # header, config and the first steps exist when the dashboard opens
    files = {name: open(run / name, "ab") for name in lines}
    pos = {name: 0 for name in lines}

    def write_until(n_steps: int):
        for name, ls in lines.items():
            f = files[name]
            while pos[name] < len(ls):
                ln = ls[pos[name]]
                if ln.startswith(b'{"t":"step"') and msgspec.json.decode(ln)["step"] >= n_steps:
                    break
                if ln.startswith(b'{"t":"profile"'):  # the traces are not copied in this test
                    pos[name] += 1
                    continue
                f.write(ln)
                f.flush()
                pos[name] += 1

    try:
        write_until(5)
        srv = serve(run)
        driver.set_window_size(1366, 768)
        driver.get(srv.url)
        _wait(driver, lambda d: d.find_elements(By.ID, "kpi-steps"), what="overview")
        assert driver.find_element(By.ID, "kpi-steps").text.splitlines()[1] == "5"
        _open_tab(driver, "steps")
        _wait(driver, lambda d: _graphs_drawn(d) >= 4, what="steps graphs")
        marker = driver.execute_script("window.__no_reload = 1; return window.__no_reload;")
        assert marker == 1

        def n_points():
            return driver.execute_script(
                "var g = document.querySelector('#fig-step-time .js-plotly-plot'); if (!g || !g.data) return -1;"
                "return Math.max.apply(null, g.data.map(function(t){ return t.x.length; }));")

        assert n_points() == 5
        # the training "continues": one step per rank every 100 ms, a line at a time
        for n in range(6, 21):
            write_until(n)
            time.sleep(0.1)
        t0 = time.monotonic()
        # within a few polls (liveness, not a timing goal: a loaded CI host slows the browser, not the design)
        _wait(driver, lambda d: n_points() == 20, timeout=10, what="20 steps drawn without reload")
        print(f"\nlive dashboard: the last written step drawn {time.monotonic() - t0:.2f} s after it was written")
        assert driver.execute_script("return window.__no_reload;") == 1  # same page: no reload happened
        write_until(10 ** 6)
        _wait(driver, lambda d: n_points() == 30, timeout=10, what="all 30 steps")
        assert "finished" in driver.find_element(By.ID, "status").text
        _screenshot(driver, "steps-live-1366x768")
        assert not _severe(driver)
    finally:
        for f in files.values():
            f.close()


def test_empty_directory_says_so(browser, serve, tmp_path):
    driver = browser
    empty = tmp_path / "empty"
    empty.mkdir()
    srv = serve(empty)
    driver.get(srv.url)
    # (its text read inside the wait: the note found, then re-rendered by a poll, went stale under load)
    text = _wait(driver, lambda d: [e.text for e in d.find_elements(By.ID, "empty-note")], what="empty note")[0]
    assert "No fsdp-doctor records" in text
    for key in PAGES:
        _open_tab(driver, key)
        _wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#page .note"), what=f"{key} note")
    assert not _severe(driver)


# ------------------------------------------------------------------ filters and URLs (one server for all checks)

def _url_query(driver) -> dict:
    from urllib.parse import parse_qs, urlparse

    return {k: v[-1] for k, v in parse_qs(urlparse(driver.current_url).query).items()}


def _path(driver) -> str:
    from urllib.parse import urlparse

    return urlparse(driver.current_url).path


def _text(driver, eid: str) -> str:
    """The element's text, found afresh ("" while it is absent); retried while Dash re-renders it."""
    for _ in range(50):
        try:
            els = driver.find_elements(By.ID, eid)
            return els[0].text if els else ""
        except StaleElementReferenceException:
            time.sleep(0.05)
    raise AssertionError(f"#{eid} kept being re-rendered")


def _option_texts(driver) -> list[str]:
    return driver.execute_script("return Array.from(document.querySelectorAll('[role=listbox] [role=option]'))"
                                 ".map(function(o){ return o.textContent.trim(); });")


def _click_option(driver, name: str) -> None:
    opt = next(o for o in driver.find_elements(By.CSS_SELECTOR, "[role=listbox] [role=option]") if o.text.strip() == name)
    opt.click()


def _fig_title(driver, gid: str) -> str:
    return driver.execute_script(
        "var g = document.querySelector('#' + arguments[0] + ' .js-plotly-plot');"
        "return g && g.layout && g.layout.title ? (g.layout.title.text || '') : '';", gid)


def test_filters_live_in_the_url_and_every_page_applies_them(browser, serve, tmp_path):
    from selenium.webdriver.common.keys import Keys

    from fsdp_doctor.present.fmt import fmt_ms

    driver = browser
    srv = serve(_copy_sample(tmp_path / "run"))
    srv.app._fsdp_state.refresh()  # finds the trace files and starts their analysis
    srv.app._fsdp_state.wait_traces(60)
    report = srv.app._fsdp_state.snapshot().report
    base = srv.url.rstrip("/")

    # a link with filters opens that page filtered: rank 1 on Steps draws one rank
    driver.get(base + "/steps?rank=1")
    _wait(driver, lambda d: _graphs_drawn(d) >= 4, what="steps graphs")
    _wait(driver, lambda d: d.execute_script(
        "var g = document.querySelector('#fig-step-time .js-plotly-plot'); return g && g.data && g.data.length == 1 "
        "&& g.data[0].name == 'rank 1';"), what="only rank 1 drawn")
    assert "rank 1" in _text(driver, "flt-rank")
    assert _wait(driver, lambda d: "tab--selected" in d.find_element(By.ID, "tab-steps").get_attribute("class"),
                 what="steps tab selected")

    # a page link keeps the filters; the back button returns to the previous page with its filters
    _act(driver, lambda d: d.find_element(By.ID, "tab-units").click(), what="open the units tab")
    _wait(driver, lambda d: _path(d) == "/units" and d.find_elements(By.ID, "fig-unit-timing"), what="units page")
    assert _url_query(driver) == {"rank": "1"}
    _wait(driver, lambda d: "rank 1" in _fig_title(d, "fig-unit-timing"), what="unit chart names rank 1")
    assert "all ranks" not in _fig_title(driver, "fig-unit-timing")
    driver.back()
    _wait(driver, lambda d: _path(d) == "/steps" and d.find_elements(By.ID, "fig-step-time"), what="back to steps")
    assert _url_query(driver) == {"rank": "1"}

    # a step typed into the box applies on Enter (the box keeps the focus: no blur needed)
    def type_12(d):
        box = d.find_element(By.ID, "flt-lo")
        box.send_keys(Keys.CONTROL, "a")
        box.send_keys("12", Keys.ENTER)

    _act(driver, type_12, what="type 12 into the step box")
    _wait(driver, lambda d: _url_query(d).get("steps") == "12-", what="steps=12- in the URL after Enter")
    assert driver.execute_script("return document.activeElement.id") == "flt-lo"
    _wait(driver, lambda d: d.execute_script(
        "var g = document.querySelector('#fig-step-time .js-plotly-plot'); return g && g.data && g.data.length"
        " && Math.min.apply(null, g.data[0].x) == 12;"), what="step-time figure starts at step 12")
    # ... and the back button undoes the filter change
    driver.back()
    _wait(driver, lambda d: "steps" not in _url_query(d), what="back: no step window")
    _wait(driver, lambda d: d.find_element(By.ID, "flt-lo").get_attribute("value") == "0", what="box back to 0")

    # memory follows the step window and says which step it draws and why
    driver.get(base + "/memory?steps=10-20")
    note = _wait(driver, lambda d: _text(d, "mem-step-note"), what="memory step note")
    assert "steps 10–20" in note and "measured in full" in note
    peak_sub = _text(driver, "kpi-mem-peak")
    # (a replayed step says so: "step 15 (replayed; the curve is step 1's), unit ...")
    assert any(f"step {s}," in peak_sub or f"step {s} (replayed" in peak_sub for s in range(10, 21)), peak_sub

    # communication says it falls back to a profiled step outside the window
    driver.get(base + "/communication?steps=10-20")
    note = _wait(driver, lambda d: _text(d, "comm-step-note"), what="comm step note")
    assert "outside the selected steps 10–20" in note
    assert "steps 6, 7" in note  # (the sample's window: steps 6 and 7, its last complete step kept)

    # the unit dropdown: every option visible at once, "all units" not under the search box; selecting a unit
    # narrows the communication KPIs to its collectives; the clear button removes the filter
    driver.get(base + "/communication")
    _wait(driver, lambda d: _text(d, "kpi-comm-total"), what="comm KPIs")
    total_all = _text(driver, "kpi-comm-total")
    _act(driver, lambda d: d.find_element(By.ID, "flt-unit").click(), what="open the unit dropdown")
    names = _wait(driver, _option_texts, what="options")
    assert names[0] == "all units" and "layers.1" in names and len(names) == 1 + len(report.units)
    visible = driver.execute_script("""
        return Array.from(document.querySelectorAll('[role=listbox] [role=option]')).map(function(o){
          var r = o.getBoundingClientRect();
          var e = document.elementFromPoint(r.left + r.width / 2, r.top + r.height / 2);
          return !!e && o.contains(e); });""")
    assert all(visible), dict(zip(names, visible))
    _act(driver, lambda d: _click_option(d, "layers.1"), what="pick layers.1")
    _wait(driver, lambda d: _url_query(d).get("unit") == "layers.1", what="unit in the URL")
    mine = [r for r in report.overlap.per_unit if r.unit == "layers.1"]
    want = fmt_ms(sum(r.comm_us for r in mine) / 1e3)
    _wait(driver, lambda d: _text(d, "kpi-comm-total").splitlines()[1:2] == [want], what=f"unit KPI {want}")
    assert "unit layers.1" in _text(driver, "kpi-comm-total") and _text(driver, "kpi-comm-total") != total_all
    _act(driver, lambda d: d.find_element(By.CSS_SELECTOR, "#flt-unit .dash-dropdown-clear").click(), what="clear")
    _wait(driver, lambda d: "unit" not in _url_query(d), what="cleared unit filter")
    _wait(driver, lambda d: _text(d, "kpi-comm-total") == total_all, what="KPIs back to every unit")

    # clicking a unit's name in the Units table selects it
    driver.get(base + "/units")
    _act(driver, lambda d: next(c for c in d.find_elements(By.CSS_SELECTOR, "#tbl-units .ag-cell[col-id=unit]")
                                if c.text.strip() == "layers.2").click(), what="click layers.2 in the units table")
    _wait(driver, lambda d: _url_query(d).get("unit") == "layers.2", what="unit selected from the table")

    # the overview: one exposed-communication figure with its source, an honest headline
    driver.get(base + "/overview")
    head = _wait(driver, lambda d: _text(d, "headline"), what="headline")
    infos = [f for f in report.findings if f.severity == "info"]
    if not any(f.severity in ("warning", "critical") for f in report.findings):
        assert head.startswith(f"No warnings; {len(infos)} note") and infos[0].title in head
    assert "Healthy" not in head
    kpi_text = _text(driver, "kpi-exposed")
    assert "/ step" in kpi_text and ("records" in kpi_text or "trace" in kpi_text)
    assert "per window" not in _wait(driver, lambda d: d.find_element(By.CSS_SELECTOR, ".kpis").text, what="KPIs")
    _screenshot(driver, "overview-1920x1080", width=1920, height=1080)
    assert not _severe(driver)


def test_plain_kineto_folder_overview_shows_the_traces(browser, serve, tmp_path):
    driver = browser
    run = tmp_path / "kineto"
    shutil.copytree(SAMPLE / "profiler", run)  # traces only, no fsdp-doctor records
    srv = serve(run)
    srv.app._fsdp_state.refresh()
    srv.app._fsdp_state.wait_traces(60)
    driver.get(srv.url)
    note = _wait(driver, lambda d: d.find_elements(By.ID, "traces-only-note"), what="traces-only note")[0]
    assert "Kineto" in note.text
    # what bounds the step comes first, from the traces: the terminal's sentence, then its bar
    from fsdp_doctor.present.fmt import verdict_headline

    verdict = srv.app._fsdp_state.snapshot().report.verdict
    assert verdict.job.source == "trace"
    assert driver.find_element(By.ID, "page").text.startswith(verdict_headline(verdict) + "\n")
    _wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#fig-verdict .main-svg"), what="verdict bar")
    _screenshot(driver, "overview-kineto-1366x768")
    assert "No fsdp-doctor records" not in driver.find_element(By.ID, "page").text
    kpi_text = _text(driver, "kpi-exposed")
    assert "ms / step" in kpi_text and "trace" in kpi_text
    assert "%" in _text(driver, "kpi-overlap")
    assert "profiler trace" in _text(driver, "status")
    # the filters offer the traces' ranks and units
    driver.find_element(By.ID, "flt-unit").click()
    opts = _wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "[role=listbox] [role=option]"), what="unit options")
    assert "layers.1" in [o.text.strip() for o in opts]
    assert not _severe(driver)
    # the Steps and Units pages draw the traces' ProfilerSteps and FSDP2 unit times, not "no records"
    driver.find_element(By.TAG_NAME, "body").click()
    for key, eid in (("steps", "trace-steps-note"), ("units", "trace-units-note")):
        _open_tab(driver, key)
        _wait(driver, lambda d: d.find_elements(By.ID, eid), what=f"{key}: trace note")
        assert "No fsdp-doctor records" not in driver.find_element(By.ID, "page").text, key
    _wait(driver, lambda d: "layers.1" in _text(d, "tbl-units"), what="units table")
    assert not _severe(driver)
