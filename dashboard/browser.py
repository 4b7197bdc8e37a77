"""Drive the dashboard in headless Chromium over the DevTools protocol (browser test, README screenshot).

    python -m dashboard.browser dashboard/screenshot.png    # serve, run a small simulation, capture
"""
from __future__ import annotations

import base64
import itertools
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import websocket

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--mute-audio")


def chromium_binary() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, timeout: float, proc: subprocess.Popen) -> bytes:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return r.read()
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args[0]} exited with code {proc.returncode} before serving {url}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing answered at {url} within {timeout:.0f}s")
            time.sleep(0.2)


@contextmanager
def serve_dashboard(port: int | None = None, timeout: float = 60.0):
    """Run `kvsim dashboard --port PORT` (bound to 127.0.0.1); yields its URL."""
    port = port or free_port()
    command = [sys.executable, "-c", "from sim.cli import main; main()", "dashboard", "--port", str(port)]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_http(f"http://127.0.0.1:{port}/_stcore/health", timeout, proc)
        yield f"http://127.0.0.1:{port}/"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Browser:
    """One headless Chromium page driven over CDP."""

    def __init__(self, width: int = 1400, height: int = 2000, binary: str | None = None):
        self.binary = binary or chromium_binary()
        if self.binary is None:
            raise FileNotFoundError("no chromium binary on PATH (apt-get install chromium)")
        self.width, self.height = width, height
        self._ids = itertools.count(1)

    def __enter__(self) -> "Browser":
        self.profile = tempfile.mkdtemp(prefix="kvsim-chromium-")
        port = free_port()
        self.proc = subprocess.Popen(
            [self.binary, *CHROMIUM_FLAGS, f"--remote-debugging-port={port}", f"--user-data-dir={self.profile}",
             f"--window-size={self.width},{self.height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_http(f"http://127.0.0.1:{port}/json/version", 30, self.proc)
            targets = json.loads(_wait_http(f"http://127.0.0.1:{port}/json/list", 10, self.proc))
            page = next(t for t in targets if t["type"] == "page")
            self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=30, suppress_origin=True)
            self.cdp("Emulation.setDeviceMetricsOverride", width=self.width, height=self.height,
                     deviceScaleFactor=1, mobile=False)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        ws = getattr(self, "ws", None)
        if ws is not None:
            ws.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)

    def cdp(self, method: str, **params) -> dict:
        msg_id = next(self._ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:   # skip events until our reply
            reply = json.loads(self.ws.recv())
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def navigate(self, url: str) -> None:
        self.cdp("Page.navigate", url=url)

    def eval(self, expression: str):
        result = self.cdp("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 60.0, what: str | None = None):
        deadline = time.monotonic() + timeout
        while True:
            value = self.eval(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                text = self.eval("document.body ? document.body.innerText.slice(0, 2000) : ''")
                raise TimeoutError(f"waited {timeout:.0f}s for {what or expression}; page shows:\n{text}")
            time.sleep(0.25)

    def text(self) -> str:
        return self.eval("document.body.innerText")

    def click_button(self, label: str) -> None:
        clicked = self.eval(
            "(() => { const b = [...document.querySelectorAll('button')].find(b => b.innerText.trim() === "
            f"{json.dumps(label)} && !b.disabled); if (b) b.click(); return !!b; }})()")
        if not clicked:
            raise RuntimeError(f"no enabled button {label!r} on the page")

    def screenshot(self, path: str | Path) -> Path:
        data = self.cdp("Page.captureScreenshot", format="png")["data"]
        path = Path(path)
        path.write_bytes(base64.b64decode(data))
        return path


PLOTS_RENDERED = "document.querySelectorAll('.js-plotly-plot .main-svg').length"


def run_simulation_in_browser(browser: Browser, url: str, timeout: float = 90.0) -> str:
    """Open the Simulate page, run the default simulation, wait for its charts; the page text."""
    browser.navigate(url)
    browser.wait_for("[...document.querySelectorAll('button')].some(b => b.innerText.trim() === 'Run simulation' "
                     "&& !b.disabled)", timeout, "the Run simulation button")
    browser.click_button("Run simulation")
    browser.wait_for(f"document.body.innerText.includes('Summary:') && {PLOTS_RENDERED} >= 6", timeout,
                     "the summary and six charts")
    time.sleep(1.0)   # let plotly finish its transitions before a screenshot
    return browser.text()


def main(argv: list[str]) -> int:
    out = Path(argv[0] if argv else "dashboard/screenshot.png")
    with serve_dashboard() as url, Browser(1400, 1900) as browser:
        text = run_simulation_in_browser(browser, url)
        browser.screenshot(out)
    print(f"wrote {out}; page shows: {' | '.join(text.splitlines()[:3])}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
