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
    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(lambda d: cond(d), message=what)


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
    has_memory = bool(srv.app._fsdp_state.snapshot().report.get("memory"))
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
    findings = srv.app._fsdp_state.snapshot().report["findings"]
    assert any(f["code"] == "jitter.gc" for f in findings), [f["code"] for f in findings]
    driver.set_window_size(1366, 768)
    driver.get(srv.url)
    card = _wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, ".finding-warning, .finding-critical"),
                 what="finding card")[0]
    text = card.text
    assert "GC pauses" in text
    assert "Evidence" in text and "gc ms per step" in text
    assert "12.0" in text or "12.00" in text  # the evidence value, formatted
    assert card.find_elements(By.CSS_SELECTOR, ".fix-code") and "gc.freeze()" in card.find_element(By.CSS_SELECTOR, ".fix-code").text
    assert card.find_elements(By.CSS_SELECTOR, ".copy-btn")
    assert "Expected: step" in text
    _screenshot(driver, "overview-finding-1366x768")
    _screenshot(driver, "overview-finding-full", full=True)
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
        _wait(driver, lambda d: n_points() == 20, timeout=10, what="20 steps drawn without reload")
        seen_after = time.monotonic() - t0
        assert seen_after < 2.5, seen_after
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
    note = _wait(driver, lambda d: d.find_elements(By.ID, "empty-note"), what="empty note")[0]
    assert "No fsdp-doctor records" in note.text
    for key in PAGES:
        _open_tab(driver, key)
        _wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#page .note"), what=f"{key} note")
    assert not _severe(driver)
