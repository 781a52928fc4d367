"""A headless Chromium driven over the Chrome DevTools Protocol (CDP), for testing the HTML report.

    with Chromium("/usr/bin/chromium") as browser:
        browser.open(path)                          # a file, loaded; console and requests watched from here
        browser.evaluate("document.title")          # a JavaScript expression's value
        browser.screenshot("page.png")              # the whole page as PNG
        browser.console, browser.requests           # error/warning messages, requests for anything but the page

It talks to the browser over one websocket (websocket-client) and drives one tab through a flat
CDP session.  The browser runs in its own process group with a fresh profile; leaving the ``with``
block kills the group and deletes the profile.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Self

import websocket

FLAGS = [
    "--headless", "--no-sandbox",  # no display; the sandbox cannot start as root
    "--disable-gpu",
    # The machine has no internet: stop Chromium reaching for it (its requests would only time out).
    "--disable-quic", "--no-first-run", "--disable-background-networking", "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-port=0",  # any free port, printed on stderr
]
_LISTENING = re.compile(r"DevTools listening on (ws://\S+)")


class BrowserError(RuntimeError):
    """The browser did not start, answered a command with an error, or did not answer in time."""


class JavaScriptError(BrowserError):
    """An evaluated expression threw."""


class Chromium:
    def __init__(self, executable: str = "/usr/bin/chromium", width: int = 1400, height: int = 900,
                 timeout: float = 20.0):
        self.executable, self.width, self.height, self.timeout = executable, width, height, timeout
        self.console: list[str] = []  # "level: text" of console errors and warnings, and uncaught exceptions
        self.requests: list[str] = []  # URLs requested other than the page itself
        self.url: str | None = None
        self._ids = itertools.count(1)
        self._process = self._socket = self._session = self._profile = None
        self._loaded = False

    # ------------------------------------------------------------------------------------ lifetime

    def __enter__(self) -> Self:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        self._profile = tempfile.mkdtemp(prefix="chromium-profile-")
        # stderr goes to a file, not a pipe: Chromium logs a lot and would block on a pipe nobody reads.
        log_path = Path(self._profile, "stderr.log")
        with open(log_path, "wb") as log:
            self._process = subprocess.Popen(
                [self.executable, *FLAGS, f"--user-data-dir={self._profile}", "about:blank"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                start_new_session=True)  # its own process group, so close() can end every child process
        deadline = time.monotonic() + self.timeout
        while not (found := _LISTENING.search(log_path.read_text(errors="replace"))):
            if self._process.poll() is not None or time.monotonic() > deadline:
                raise BrowserError(f"{self.executable} did not start (exit status {self._process.poll()}):\n"
                                   + log_path.read_text(errors="replace")[-3000:])
            time.sleep(0.05)
        # No Origin header: Chromium refuses websocket clients that send one it was not told to allow.
        self._socket = websocket.create_connection(found.group(1), timeout=self.timeout, suppress_origin=True)
        target = self._send("Target.createTarget", url="about:blank", session=False)["targetId"]
        self._session = self._send("Target.attachToTarget", targetId=target, flatten=True,
                                   session=False)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self._send(f"{domain}.enable")
        self._send("Emulation.setDeviceMetricsOverride", width=self.width, height=self.height,
                   deviceScaleFactor=1, mobile=False)

    def close(self) -> None:
        """Kill the browser and every process it started, and delete its profile."""
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        if self._process is not None:
            try:
                os.killpg(self._process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._process.wait(timeout=self.timeout)
            self._process = None
        if self._profile is not None:
            shutil.rmtree(self._profile, ignore_errors=True)
            self._profile = None

    # ------------------------------------------------------------------------------------ the protocol

    def _send(self, method: str, session: bool = True, **params) -> dict:
        """Send a command and return its result, handling the events that arrive meanwhile."""
        message = {"id": next(self._ids), "method": method, "params": params}
        if session:
            message["sessionId"] = self._session
        self._socket.send(json.dumps(message))
        reply = self._receive(lambda m: m.get("id") == message["id"], f"the reply to {method}")
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error'].get('message')} {reply['error'].get('data', '')}".strip())
        return reply["result"]

    def _receive(self, wanted, what: str, timeout: float | None = None) -> dict | None:
        """Read messages until ``wanted(message)``, recording events; after ``timeout`` seconds raise,
        or, when a timeout is given, return None (that is how ``wait`` lets events arrive)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while (left := deadline - time.monotonic()) > 0:
            self._socket.settimeout(left)
            try:
                message = json.loads(self._socket.recv())
            except websocket.WebSocketTimeoutException:
                break
            if "method" in message:
                self._event(message["method"], message.get("params", {}))
            if wanted(message):
                return message
        if timeout is None:
            raise BrowserError(f"no {what} within {self.timeout} s")
        return None

    def _event(self, method: str, params: dict) -> None:
        if method == "Page.loadEventFired":
            self._loaded = True
        elif method == "Runtime.consoleAPICalled" and params["type"] in ("error", "warning", "assert"):
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
            self.console.append(f"console.{params['type']}: {text}")
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text", "")
            self.console.append(f"uncaught exception: {text}")
        elif method == "Log.entryAdded" and params["entry"]["level"] in ("error", "warning"):
            entry = params["entry"]
            self.console.append(f"{entry['level']} ({entry.get('source')}): {entry['text']} {entry.get('url', '')}")
        elif method == "Network.requestWillBeSent" and params["request"]["url"] != self.url:
            self.requests.append(params["request"]["url"])

    # ------------------------------------------------------------------------------------ the page

    def open(self, path) -> None:
        """Load a local file (path or file:// URL) and wait for its load event."""
        self.url = path if str(path).startswith("file://") else Path(path).resolve().as_uri()
        self._loaded = False
        result = self._send("Page.navigate", url=self.url)
        if result.get("errorText"):
            raise BrowserError(f"cannot open {self.url}: {result['errorText']}")
        if not self._loaded:
            self._receive(lambda m: m.get("method") == "Page.loadEventFired", f"load event from {self.url}")

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (JSON-like values only); awaits a promise."""
        result = self._send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise JavaScriptError(details.get("exception", {}).get("description") or details.get("text"))
        return result["result"].get("value")

    def click(self, x: float, y: float) -> None:
        """A left mouse click at viewport coordinates, as a user's (a real input event, not element.click())."""
        for kind in ("mousePressed", "mouseReleased"):
            self._send("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def wait(self, seconds: float) -> None:
        """Let the page run for a while, recording what it logs and requests."""
        self._receive(lambda m: False, "nothing", timeout=seconds)

    def screenshot(self, path) -> Path:
        """Save the whole page as PNG. The viewport is first resized to the page's size (so it stays so:
        afterwards viewport coordinates are page coordinates, and pixels of the image)."""
        size = self._send("Page.getLayoutMetrics")["cssContentSize"]
        width, height = max(self.width, round(size["width"])), max(1, round(size["height"]))
        self._send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        data = self._send("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path
