"""The HTML report in a real browser: it renders, draws its charts, stays self-contained and quiet.

Opens a merged page of three documents (numpy, torch, jax) in headless Chromium, driven by Selenium
through Debian's chromedriver (the driver built for that Chromium), and saves a screenshot to
reports/browser/report.png, or under $CONFORMANCE_ARTIFACTS.  Without Chromium, its driver or
Selenium the tests skip, except under CI (CI set), where they fail: CI installs them, and says why
when it cannot (CONFORMANCE_NO_BROWSER), which makes them skip with that reason.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import shutil
import time
from pathlib import Path

import pytest
from PIL import Image  # installed with matplotlib

from gemma4_conformance import report
from gemma4_conformance.report.formatting import COLOURS
from tests.test_report import ROPE_COMMAND, make_document

BACKENDS = ("numpy", "torch", "jax")
# Per op, the cell classes of make_recorder()'s results in each dtype (float32, bfloat16), as in test_report.
CELLS = {"sigmoid": ("fail", "none"), "silu": ("ok", "none"), "softcap": ("known", "none"),
         "rmsnorm_unit": ("none", "cr"), "rope": ("warn", "fail"), "linear": ("none", "unsup"),
         "softmax": ("none", "ok"), "forward": ("fail", "ok"), "trace": ("none", "fail"), "serving": ("fail", "ok")}
WHITE = ("rgb(255, 255, 255)", "rgba(0, 0, 0, 0)")  # white, or transparent over the white page
WIDTH = 1400
FLAGS = ["--headless", "--no-sandbox",  # no display; the sandbox cannot start as root
         "--disable-gpu", f"--window-size={WIDTH},900",
         # The machine has no internet: stop Chromium reaching for it (its requests would only time out).
         "--disable-quic", "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync"]


def _unavailable(reason: str):
    why_not = os.environ.get("CONFORMANCE_NO_BROWSER")  # set by .ci/run when apt-get could not install it
    if os.environ.get("CI") and not why_not:
        pytest.fail(f"{reason}; CI installs it, so its absence there is a defect", pytrace=False)
    pytest.skip(f"{reason}; {why_not}" if why_not else reason)


def _executable(name: str) -> str:
    path = next((p for p in (f"/usr/bin/{name}", shutil.which(name)) if p and os.access(p, os.X_OK)), None)
    if path is None:
        _unavailable(f"{name} is not installed (on Debian or Ubuntu: apt-get install chromium chromium-driver)")
    return path


@pytest.fixture(scope="module")
def chromium():
    """A factory of headless Chromium sessions, each quit when the module's tests are done; skips (fails
    under CI) when Chromium, its driver or Selenium is missing."""
    binary, driver = _executable("chromium"), _executable("chromedriver")
    if importlib.util.find_spec("selenium") is None:
        _unavailable("selenium is not installed (pip install -e '.[test]')")
    from selenium import webdriver  # here: it is checked just above

    sessions = []

    def start():
        options = webdriver.ChromeOptions()
        options.binary_location = binary
        for flag in FLAGS:
            options.add_argument(flag)
        # The console (errors, warnings, uncaught exceptions) and the network events, read from the logs.
        options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
        sessions.append(webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver)))
        return sessions[-1]

    yield start
    for session in sessions:
        session.quit()


def console(driver) -> list[str]:
    """The console errors and warnings (uncaught exceptions included) logged since the last call."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]


def requests(driver) -> list[str]:
    """The URLs the page requested since the last call, other than the page itself."""
    events = (json.loads(e["message"])["message"] for e in driver.get_log("performance"))
    return [e["params"]["request"]["url"] for e in events
            if e["method"] == "Network.requestWillBeSent" and e["params"]["request"]["url"] != driver.current_url]


def evaluate(driver, expression: str):
    return driver.execute_script(f"return {expression};")


def screenshot(driver, path: Path) -> Path:
    """The whole page as PNG: the viewport is first made the page's size (and stays so: afterwards an
    element's box is where it is in the image)."""
    size = driver.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": max(WIDTH, round(size["width"])), "height": round(size["height"]), "deviceScaleFactor": 1,
        "mobile": False})
    png = driver.execute_cdp_cmd("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(base64.b64decode(png["data"]))
    return path


def _artifacts() -> Path:
    """Where the screenshot goes: $CONFORMANCE_ARTIFACTS, else reports/browser/ in the repository."""
    folder = os.environ.get("CONFORMANCE_ARTIFACTS")
    return Path(folder) if folder else Path(__file__).resolve().parents[1] / "reports" / "browser"


def _rgb(hex_colour: str) -> str:
    """A #rrggbb colour as the browser's computed style writes it."""
    r, g, b = (int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))
    return f"rgb({r}, {g}, {b})"


def _rgb_of_class(browser, cls: str) -> str:
    """The background the matrix gives cells of class ``cls``."""
    return evaluate(browser, f"getComputedStyle(document.querySelector('#matrix-table td.cell.{cls}')).backgroundColor")


def _rerun(backend: str) -> str:
    return ROPE_COMMAND.replace("torch", backend)


@pytest.fixture(scope="module")
def documents():
    return [make_document(backend) for backend in BACKENDS]


@pytest.fixture(scope="module")
def browser(documents, tmp_path_factory, chromium):
    page = report.write_html(tmp_path_factory.mktemp("page") / "report.html", documents, labels=list(BACKENDS))
    driver = chromium()
    driver.get(page.resolve().as_uri())  # returns once the page has loaded
    time.sleep(0.2)  # messages logged just after the load event
    return driver


def _box(selector: str) -> str:
    """JavaScript: the bounding box of an element as {x, y, width, height}."""
    return (f"(() => {{ const r = document.querySelector({json.dumps(selector)}).getBoundingClientRect(); "
            "return {x: r.x, y: r.y, width: r.width, height: r.height}; })()")


def test_the_page_loads_without_errors_or_requests(browser):
    assert evaluate(browser, "document.readyState") == "complete"
    assert evaluate(browser, "document.title") == "Gemma 4 conformance report"
    assert console(browser) == []
    assert requests(browser) == []  # the page is self-contained: nothing but itself is loaded


def test_the_matrix_is_visible_with_a_row_per_op_and_coloured_cells(browser, documents):
    box = evaluate(browser, _box("#matrix-table"))
    assert box["width"] > 0 and box["height"] > 0
    rows = evaluate(browser, """[...document.querySelectorAll('#matrix-table tbody tr')].map(tr => ({
        op: tr.dataset.op,
        cells: [...tr.querySelectorAll('td.cell')].map(td => ({
            cls: td.className.replace('cell', '').trim(), background: getComputedStyle(td).backgroundColor}))}))""")
    ops = list(dict.fromkeys(r["op"] for r in documents[0]["results"]))
    assert [row["op"] for row in rows] == [*ops, "forward", "trace", "serving"]
    backgrounds = {}
    for row in rows:
        # Columns: each dtype, then each backend within it.
        assert [c["cls"] for c in row["cells"]] == [cls for cls in CELLS[row["op"]] for _ in BACKENDS], row["op"]
        for c in row["cells"]:
            backgrounds.setdefault(c["cls"], set()).add(c["background"])
    assert all(len(colours) == 1 for colours in backgrounds.values()), backgrounds  # one colour per class
    coloured = {cls: colours.pop() for cls, colours in backgrounds.items()}
    assert coloured["none"] in WHITE
    verdicts = ("fail", "known", "cr", "warn", "ok", "unsup")
    assert all(coloured[cls] not in WHITE for cls in verdicts)
    assert len({coloured[cls] for cls in verdicts}) == len(verdicts)  # told apart by colour


def test_the_theorem_matrix_is_visible_with_held_and_violated_cells(browser):
    box = evaluate(browser, _box("#theorem-table"))
    assert box["width"] > 0 and box["height"] > 0
    cells = evaluate(browser, """[...document.querySelectorAll('#theorem-table td.cell')]
        .filter(td => td.textContent.trim()).map(td => [td.textContent.trim(), getComputedStyle(td).backgroundColor])""")
    colours = dict(cells)
    assert set(colours) == {"held", "violated"}
    assert colours["violated"] == _rgb_of_class(browser, "fail") != colours["held"]


def test_every_chart_is_an_svg_with_its_data_drawn(browser):
    charts = evaluate(browser, """[...document.querySelectorAll('.chart')].map(chart => {
        const svg = chart.querySelector('svg');
        if (!svg) return {title: chart.textContent.slice(0, 60)};
        const box = svg.getBoundingClientRect();
        const drawn = [...svg.querySelectorAll('path')].filter(p => {
            const b = p.getBBox();
            return b.width > 0 || b.height > 0;
        });
        return {title: chart.querySelector('h3').textContent, width: box.width, height: box.height,
                paths: drawn.length,
                colours: drawn.flatMap(p => [getComputedStyle(p).fill, getComputedStyle(p).stroke])};
    })""")
    # A histogram per backend x dtype and a forward chart per backend x dtype.
    assert len(charts) == 2 * 2 * len(BACKENDS)
    data_colours = {_rgb(COLOURS[cls]) for cls in ("fail", "warn", "ok")}
    for chart in charts:
        assert "width" in chart, f"chart without an svg: {chart['title']}"
        assert chart["width"] > 0 and chart["height"] > 0, chart["title"]
        assert chart["paths"] > 0, chart["title"]
        assert data_colours & set(chart["colours"]), f"{chart['title']}: no bar or line in a verdict's colour"


def test_the_failures_section_lists_the_failing_op_and_its_rerun_command(browser):
    failures = evaluate(browser, """[...document.querySelectorAll('.failure')].map(f => ({
        head: f.querySelector('.head').textContent.replace(/\\s+/g, ' '),
        command: f.querySelector('pre') ? f.querySelector('pre').textContent : null,
        height: f.getBoundingClientRect().height}))""")
    for backend in BACKENDS:
        rope = [f for f in failures if f["head"].startswith(f"{backend} · bfloat16 · rope — failed")]
        assert len(rope) == 1, [f["head"] for f in failures]
        assert rope[0]["command"] == _rerun(backend) and rope[0]["height"] > 0
    assert evaluate(browser, _box("#failures"))["y"] < evaluate(browser, _box("#matrix-table"))["y"]  # failures first


def test_the_screenshot_shows_the_page_in_colour(browser):
    path = screenshot(browser, _artifacts() / "report.png")
    with Image.open(path) as image:
        assert image.size == tuple(evaluate(
            browser, "[document.documentElement.scrollWidth, document.documentElement.scrollHeight]"))
        # The viewport now covers the page, so an element's box is where it is in the image: the first
        # failing and correctly rounded cells' corners (clear of their text) have the cells' colours.
        for cls in ("fail", "cr"):
            cell = evaluate(browser, _box(f"#matrix-table td.cell.{cls}"))
            pixel = image.convert("RGB").getpixel((round(cell["x"]) + 3, round(cell["y"]) + 3))
            assert f"rgb({pixel[0]}, {pixel[1]}, {pixel[2]})" == _rgb_of_class(browser, cls)


def test_a_copy_button_copies_or_selects_the_command_without_errors(browser):
    from selenium.webdriver.common.by import By  # the browser fixture has checked it is installed

    browser.find_element(By.CSS_SELECTOR, ".failure button.copy").click()  # a user's click, as input events
    time.sleep(0.3)
    # Copied to the clipboard ("copied"), or where the browser forbids that, selected to copy by hand.
    state = evaluate(browser, """(() => {
        const button = document.querySelector('.failure button.copy');
        return {label: button.textContent, selected: getSelection().toString(),
                command: document.getElementById(button.dataset.target).textContent}; })()""")
    assert state["label"] == "copied" or state["selected"] == state["command"], state
    assert state["command"].startswith("pytest -p gemma4_conformance.plugin --pyargs")
    assert f"--backend={BACKENDS[0]}" in state["command"]  # the first failure is the first backend's
    assert console(browser) == []


def test_the_browser_checks_see_errors_and_stray_requests(tmp_path, chromium):
    """The checks above can fail: a page that logs, throws and loads another file is caught."""
    page = tmp_path / "bad.html"
    page.write_text("<!DOCTYPE html><html><body><img src='missing.png'>"
                    "<script>console.error('boom'); notDefined();</script></body></html>")
    driver = chromium()
    driver.get(page.as_uri())
    time.sleep(0.2)
    assert requests(driver) == [(tmp_path / "missing.png").as_uri()]
    messages = console(driver)
    assert any("boom" in m for m in messages)
    assert any("notDefined" in m for m in messages)
    assert evaluate(driver, "1 + 1") == 2
