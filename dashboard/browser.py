"""Drive the dashboard in headless Chromium over the DevTools protocol (browser test, docs screenshots).

    python -m dashboard.browser docs/img     # serve, use all five pages, screenshot each, print timings

The page drivers below each return the seconds from the user's action (a click or opening a link)
to the rendered result: the "time to result" of docs/dashboard.md.
"""
from __future__ import annotations

import base64
import io
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
def serve_dashboard(port: int | None = None, timeout: float = 60.0, data_root: str | Path | None = None):
    """Run `kvsim dashboard --port PORT [--data-root DIR]` (bound to 127.0.0.1); yields its URL."""
    port = port or free_port()
    command = [sys.executable, "-c", "from kvsim.sim.cli import main; main()", "dashboard", "--port", str(port)]
    if data_root is not None:
        command += ["--data-root", str(data_root)]
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
            try:
                value = self.eval(expression)
            except RuntimeError:   # the document is being replaced (navigation)
                value = None
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

    def type_into(self, label: str, text: str, timeout: float = 30.0) -> None:
        """Replace the text of the input labelled `label` (as a user would: focus, select all, type, Enter)."""
        self.wait_for(f"(() => {{ const i = document.querySelector('input[aria-label=' + {json.dumps(json.dumps(label))} "
                      "+ ']'); if (i) { i.focus(); i.select(); } return !!i; })()", timeout, f"an input labelled {label!r}")
        self.cdp("Input.insertText", text=text)
        for kind in ("keyDown", "keyUp"):
            self.cdp("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter", windowsVirtualKeyCode=13)

    def screenshot(self, path: str | Path, max_height: int = 3200) -> Path:
        """The whole page (the viewport grown to the app's content height), as a 256-colour PNG."""
        height = min(max_height, int(self.eval(MAIN_HEIGHT) or self.height))
        self.cdp("Emulation.setDeviceMetricsOverride", width=self.width, height=max(height, 600),
                 deviceScaleFactor=1, mobile=False)
        time.sleep(0.5)   # plotly redraws on resize
        data = base64.b64decode(self.cdp("Page.captureScreenshot", format="png")["data"])
        self.cdp("Emulation.setDeviceMetricsOverride", width=self.width, height=self.height,
                 deviceScaleFactor=1, mobile=False)
        path = Path(path)
        path.write_bytes(_small_png(data))
        return path


def _small_png(data: bytes) -> bytes:
    try:
        from PIL import Image
    except ImportError:
        return data
    out = io.BytesIO()
    Image.open(io.BytesIO(data)).convert("RGB").quantize(64, method=Image.Quantize.FASTOCTREE).save(out, format="PNG")
    return out.getvalue()


MAIN_HEIGHT = ("(() => { const m = document.querySelector('[data-testid=\"stMain\"]') || document.body; "
               "return Math.max(m.scrollHeight, document.body.scrollHeight) + 40; })()")

PLOTS_RENDERED = "document.querySelectorAll('.js-plotly-plot .main-svg').length"


def _enabled_button(label: str) -> str:
    return (f"[...document.querySelectorAll('button')].some(b => b.innerText.trim() === {json.dumps(label)} "
            f"&& !b.disabled)")


def _shows(text: str, plots: int) -> str:
    return f"document.body.innerText.includes({json.dumps(text)}) && {PLOTS_RENDERED} >= {plots}"


def click_and_wait(browser: Browser, url: str, button: str, result: str, plots: int, timeout: float) -> float:
    """Open `url`, click `button` once it is enabled; seconds from the click to `result` and `plots` charts."""
    browser.navigate(url)
    browser.wait_for(_enabled_button(button), timeout, f"the {button} button")
    start = time.monotonic()
    browser.click_button(button)
    browser.wait_for(_shows(result, plots), timeout, f"{result!r} and {plots} charts")
    return time.monotonic() - start


def open_and_wait(browser: Browser, url: str, result: str, plots: int, timeout: float) -> float:
    """Seconds from opening `url` to `result` and `plots` charts on the page."""
    start = time.monotonic()
    browser.navigate(url)
    browser.wait_for(_shows(result, plots), timeout, f"{result!r} and {plots} charts")
    return time.monotonic() - start


def run_simulation_in_browser(browser: Browser, url: str, timeout: float = 90.0) -> str:
    """Open the Simulate page, run the default simulation, wait for its charts; the page text."""
    click_and_wait(browser, url, "Run simulation", "Summary:", 6, timeout)
    time.sleep(1.0)   # let plotly finish its transitions before a screenshot
    return browser.text()


def cancel_in_browser(browser: Browser, url: str, requests: int, timeout: float = 90.0) -> float:
    """Start a simulation of `requests` requests on the Simulate page, click Cancel as soon as the
    progress bar shows; seconds from the click to the page saying the run was cancelled."""
    browser.navigate(url)
    browser.wait_for(_enabled_button("Run simulation"), timeout, "the Run simulation button")
    browser.type_into("Max requests (first N)", str(requests))
    browser.wait_for(f"document.querySelector('input[aria-label=\"Max requests (first N)\"]')?.value === '{requests}'",
                     timeout, "the typed number of requests")
    time.sleep(1.0)   # the rerun that takes the new value
    browser.wait_for(_enabled_button("Run simulation"), timeout, "the Run simulation button")
    browser.click_button("Run simulation")
    browser.wait_for(_enabled_button("Cancel") + " && document.body.innerText.includes('tokens')", timeout,
                     "the progress bar and Cancel")
    start = time.monotonic()
    browser.click_button("Cancel")
    browser.wait_for("document.body.innerText.includes('Simulation cancelled.')", timeout, "the cancel message")
    return time.monotonic() - start


def tour(browser: Browser, url: str, run_dir: str, crosscheck_dir: str, shots: Path | None = None,
         timeout: float = 90.0, inspect=None) -> dict[str, float]:
    """Use all five pages as a user would; seconds to result per page. Memory opens `run_dir` and
    Fidelity `crosscheck_dir` (paths relative to the data root) by link; Simulate, Compare and
    Capacity run their defaults (Capacity on the sidebar's first N requests, not the representative
sample, to stay quick). With `shots`, a screenshot of each page lands there as PAGE.png;
    `inspect(page)` runs on each page once it shows its result."""
    steps = {
        "simulate": lambda: click_and_wait(browser, url, "Run simulation", "Summary:", 6, timeout),
        "memory": lambda: open_and_wait(browser, f"{url}memory?run={run_dir}", "Block pool over time", 4, timeout),
        "compare": lambda: click_and_wait(browser, f"{url}compare", "Run 3 simulations", "TTFT by configuration",
                                          9, timeout),
        "capacity": lambda: click_and_wait(browser, f"{url}capacity?load=first", "Search capacity", "Best configuration", 3,
                                           timeout),
        "fidelity": lambda: open_and_wait(browser, f"{url}fidelity?path={crosscheck_dir}", "Per-step time MAPE", 1,
                                          timeout),
    }
    seconds = {}
    for page, use in steps.items():
        seconds[page] = use()
        if inspect is not None:
            inspect(page)
        if shots is not None:
            browser.screenshot(shots / f"{page}.png")
    return seconds


def prepare_data_root(root: Path) -> tuple[str, str]:
    """A per-head eviction run (H2O + slot_reuse, fast mode, 100 ShareGPT requests on an L4) and a
    small real cross-check (3 requests replayed on SmolLM2 on CPU) under `root`; their relative paths."""
    from kvsim.sim.config import load_config
    from kvsim.sim.simulate import run_simulation

    run_simulation(load_config(None, {"trace": "sharegpt-8k-filtered", "gpu": "l4", "trace_options.max_requests": 100,
                                      "kv.policy": "h2o", "kv.budget": 128, "kv.layout": "per_head",
                                      "kv.slot_strategy": "slot_reuse", "kv.mode": "fast"}), root / "per-head")
    if not (root / "cc" / "crosscheck.json").exists():
        from kvsim.traces.synthetic import synthesize
        synthesize(3, rate=5.0, prompt="uniform:8,40", output="uniform:2,5", seed=3).save(root / "tiny.jsonl")
        subprocess.run([sys.executable, "-c", "from kvsim.sim.cli import main; main()", "crosscheck", "--trace",
                        str(root / "tiny.jsonl"), "--profile", "cpu-2core", "--num-gpu-blocks", "64", "--threads", "1",
                        "--clock", "cpu", "--no-warmup", "--out", str(root / "cc")], check=True,
                       stdout=subprocess.DEVNULL)
    return "per-head", "cc"


def main(argv: list[str]) -> int:
    shots = Path(argv[0] if argv else "docs/img")
    shots.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvsim-dashboard-") as tmp:
        run_dir, cc_dir = prepare_data_root(Path(tmp))
        with serve_dashboard(data_root=tmp) as url, Browser(1400, 1400) as browser:
            seconds = tour(browser, url, run_dir, cc_dir, shots)
    for page, s in seconds.items():
        print(f"{page:9s} {s:5.1f} s to result   {shots / (page + '.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
