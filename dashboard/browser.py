"""Drive the dashboard in headless Chromium over the DevTools protocol (browser test, docs screenshots).

    python -m dashboard.browser docs/img     # serve, use all six pages, screenshot each, print timings

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
                raise RuntimeError(f"{proc.args[0]} exited with code {proc.returncode} before serving {url}") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing answered at {url} within {timeout:.0f}s") from None
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

    def __enter__(self) -> Browser:
        self.profile = tempfile.mkdtemp(prefix="kvsim-chromium-")
        port = self.debug_port = free_port()
        self.proc = subprocess.Popen(
            [self.binary, *CHROMIUM_FLAGS, f"--remote-debugging-port={port}", f"--user-data-dir={self.profile}",
             f"--window-size={self.width},{self.height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_http(f"http://127.0.0.1:{port}/json/version", 30, self.proc)
            targets = json.loads(_wait_http(f"http://127.0.0.1:{port}/json/list", 10, self.proc))
            page = next(t for t in targets if t["type"] == "page")
            self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=90, suppress_origin=True)
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

    def reload(self) -> None:
        self.cdp("Page.reload", ignoreCache=True)

    @contextmanager
    def new_tab(self, url: str):
        """A second tab of the same browser opened on `url` (its own Streamlit session); yields a
        Browser driving it (closed at the end)."""
        port = self.debug_port
        req = urllib.request.Request(f"http://127.0.0.1:{port}/json/new?{url}", method="PUT")
        with urllib.request.urlopen(req, timeout=10) as r:
            target = json.loads(r.read())
        tab = object.__new__(Browser)
        tab.binary, tab.width, tab.height, tab.proc = self.binary, self.width, self.height, self.proc
        tab.debug_port, tab._ids = port, itertools.count(1)
        tab.ws = websocket.create_connection(target["webSocketDebuggerUrl"], timeout=30, suppress_origin=True)
        try:
            tab.cdp("Emulation.setDeviceMetricsOverride", width=self.width, height=self.height, deviceScaleFactor=1,
                    mobile=False)
            yield tab
        finally:
            tab.ws.close()
            urllib.request.urlopen(f"http://127.0.0.1:{port}/json/close/{target['id']}", timeout=10).close()

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
        return self.wait_for("document.body && document.body.innerText", 30, "the page's text")

    def click_button(self, label: str) -> None:
        clicked = self.eval(
            "(() => { const b = [...document.querySelectorAll('button')].find(b => b.innerText.trim() === "
            f"{json.dumps(label)} && !b.disabled); if (b) b.click(); return !!b; }})()")
        if not clicked:
            raise RuntimeError(f"no enabled button {label!r} on the page")

    def focus(self, selector: str, timeout: float, what: str) -> None:
        """Focus the element `selector` (JS) with a real mouse click at its centre: after another field
        had the focus, a script's focus() does not always take in headless Chromium."""
        opened = (f"(() => {{ const i = {selector}; if (!i) return false; let closed = false; "   # inside a collapsed expander
                  "for (let a = i; a; a = a.parentElement) if (a.tagName === 'DETAILS' && !a.open) "
                  "{ a.querySelector('summary').click(); closed = true; } return !closed; })()")
        self.wait_for(opened, timeout, f"{what} in an open expander")
        rect = self.wait_for(f"(() => {{ const i = {selector}; if (!i) return null; i.scrollIntoView({{block: 'center'}}); "
                             "const r = i.getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()",
                             timeout, what)
        for kind in ("mousePressed", "mouseReleased"):
            self.cdp("Input.dispatchMouseEvent", type=kind, x=rect[0], y=rect[1], button="left", clickCount=1)
        self.wait_for(f"(() => {{ const i = {selector}; if (document.activeElement !== i) i.focus(); "
                      "return document.activeElement === i; })()", timeout, f"{what} focused")

    def type_into(self, label: str, text: str, timeout: float = 90.0) -> None:
        """Replace the text of the input labelled `label` as a user would (focus, select all, type,
        Enter), again if a rerun of the page redrew the input meanwhile and dropped what was typed."""
        selector = "document.querySelector('input[aria-label=' + " + json.dumps(json.dumps(label)) + " + ']')"
        for _ in range(5):
            settle(self, timeout)
            self.focus(selector, timeout, f"an input labelled {label!r}")
            self.eval(f"{selector}.select()")
            if text:
                self.cdp("Input.insertText", text=text)
            else:        # clearing a field: delete the selection
                for kind in ("keyDown", "keyUp"):
                    self.cdp("Input.dispatchKeyEvent", type=kind, key="Backspace", code="Backspace",
                             windowsVirtualKeyCode=8)
            for kind in ("keyDown", "keyUp"):
                self.cdp("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter", windowsVirtualKeyCode=13)
            time.sleep(1.0)
            if self.eval(f"{selector}?.value") == text:
                return
        raise RuntimeError(f"typing {text!r} into {label!r} did not stick")

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


def _disabled_button(label: str) -> str:
    return (f"[...document.querySelectorAll('button')].some(b => b.innerText.trim() === {json.dumps(label)} "
            f"&& b.disabled)")


def settle(browser: Browser, timeout: float = 90.0) -> None:
    """Wait until the app's script is no longer running (a page can rerun itself right after showing
    a result, e.g. when a run ends) and plotly has drawn."""
    quiet = "!document.querySelector('[data-testid=\"stStatusWidget\"]')"
    for _ in range(2):    # twice, a moment apart: a rerun may start just after the first look
        browser.wait_for(quiet, timeout, "the page to finish running")
        time.sleep(0.5)


def click_and_wait(browser: Browser, url: str, button: str, result: str, plots: int, timeout: float) -> float:
    """Open `url`, click `button` once it is enabled; seconds from the click to `result` and `plots`
    charts. The button must be disabled while its run goes."""
    browser.navigate(url)
    browser.wait_for(_enabled_button(button), timeout, f"the {button} button")
    start = time.monotonic()
    browser.click_button(button)
    browser.wait_for(f"({_disabled_button(button)}) || ({_shows(result, plots)})", timeout,
                     f"the {button} button disabled while it runs")
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


def reopen_run(browser: Browser, timeout: float = 90.0) -> dict[str, str]:
    """After a run on the Simulate page: its link (the page's address names the run), the page text
    after a reload, and the text of a new tab opened on the link; seconds to each."""
    link = browser.wait_for("location.search.includes('run=') && location.href", timeout, "the run's link")
    shown = browser.eval("document.querySelector('h3') ? document.querySelector('h3').innerText : ''")
    browser.eval("window.kvsimBeforeReload = true")
    start = time.monotonic()
    browser.reload()
    reloaded = browser.wait_for(f"!window.kvsimBeforeReload && {_shows(shown, 6)} && document.body.innerText",
                                timeout, f"{shown!r} after the reload")
    reload_s = time.monotonic() - start
    start = time.monotonic()
    with browser.new_tab(link) as tab:
        in_tab = tab.wait_for(f"{_shows(shown, 6)} && document.body.innerText", timeout, f"{shown!r} in a new tab")
        tab_s = time.monotonic() - start
    return {"link": link, "summary": shown, "reloaded": reloaded, "new_tab": in_tab, "reload_s": reload_s,
            "new_tab_s": tab_s}


def tour(browser: Browser, url: str, run_dir: str, crosscheck_dir: str, shots: Path | None = None,
         timeout: float = 90.0, inspect=None, series_dir: str | None = None) -> dict[str, float]:
    """Use all six pages as a user would; seconds to result per page. Memory opens `run_dir`, Time
    series `series_dir` (default `run_dir`) and Fidelity `crosscheck_dir` (paths relative to the data
    root) by link; Simulate, Compare and Capacity run their defaults (Capacity on the sidebar's first N
    requests, not the representative sample, to stay quick). With `shots`, a screenshot of
    each page lands there as PAGE.png; `inspect(page)` runs on each page once it shows its result."""
    series_dir = series_dir or run_dir
    steps = {
        "simulate": lambda: click_and_wait(browser, url, "Run simulation", "Summary:", 6, timeout),
        "memory": lambda: open_and_wait(browser, f"{url}memory?run={run_dir}", "Block pool over time", 4, timeout),
        "timeseries": lambda: open_and_wait(browser, f"{url}timeseries?run={series_dir}", "over time", 1, timeout),
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
        settle(browser, timeout)
        if inspect is not None:
            inspect(page)
        if shots is not None:
            browser.screenshot(shots / f"{page}.png")
    return seconds


HALF_S = 60.0


def doubling_load_trace(path: Path) -> Path:
    """A trace whose load doubles halfway: 2 requests/s for 60 s, then 4 requests/s for 60 s (evenly
    spaced), 200-400 prompt and 100-200 output tokens. An L4 with 800 KV blocks serving Llama-3.1-8B
    keeps up with the first half, not with the second."""
    import numpy as np

    from kvsim.traces.synthetic import synthesize
    from kvsim.traces.trace import Trace

    lengths = synthesize(360, prompt="uniform:200,400", output="uniform:100,200", seed=1).df
    arrivals = np.concatenate([np.arange(120) / 2.0, HALF_S + np.arange(240) / 4.0])
    Trace.from_columns(arrival_time_s=arrivals, prompt_tokens=lengths["prompt_tokens"],
                       output_tokens=lengths["output_tokens"], name="doubling").save(path)
    return path


def simulate_doubling_load(root: Path) -> str:
    """The doubling-load trace simulated under `root` (as `kvsim simulate --out root/doubling`)."""
    from kvsim.sim.config import load_config
    from kvsim.sim.simulator.simulate import run_simulation

    trace = doubling_load_trace(root / "doubling.jsonl")
    run_simulation(load_config(None, {"trace": str(trace), "gpu": "l4", "engine.num_gpu_blocks": 800}),
                   root / "doubling")
    return "doubling"


def prepare_data_root(root: Path) -> tuple[str, str]:
    """A per-head eviction run (H2O + slot_reuse, fast mode, 100 ShareGPT requests on an L4), a run
    of the doubling-load trace and a small real cross-check (3 requests replayed on SmolLM2 on CPU)
    under `root`; the first and last's relative paths."""
    from kvsim.sim.config import load_config
    from kvsim.sim.simulator.simulate import run_simulation

    simulate_doubling_load(root)
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
            seconds = tour(browser, url, run_dir, cc_dir, shots, series_dir="doubling")
    for page, s in seconds.items():
        print(f"{page:9s} {s:5.1f} s to result   {shots / (page + '.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


# ---- widgets and layout checks used by the browser tests ------------------------------------------
def _widget(testid: str, label: str) -> str:
    """JS: the Streamlit widget container `testid` whose label reads `label`."""
    return (f"[...document.querySelectorAll('[data-testid=\"{testid}\"]')].find(w => "
            f"(w.querySelector('[data-testid=\"stWidgetLabel\"]')?.textContent || '').trim() === {json.dumps(label)})")


def choose(browser: Browser, label: str, option: str, testid: str = "stSelectbox", timeout: float = 90.0) -> None:
    """Pick `option` in the selectbox (or multiselect) labelled `label` as a user does: focus its
    input, type the option's text and press Enter on the highlighted match."""
    for _ in range(3):      # again if a rerun redrew the widget meanwhile
        settle(browser, timeout)
        browser.focus(f"({_widget(testid, label)})?.querySelector('input')", timeout, f"a {testid} {label!r}")
        browser.cdp("Input.insertText", text=option)
        time.sleep(0.5)
        for kind in ("keyDown", "keyUp"):
            browser.cdp("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter", windowsVirtualKeyCode=13)
        time.sleep(1.0)
        settle(browser, timeout)
        if testid != "stSelectbox" or shown_choice(browser, label) == option:
            return
    raise RuntimeError(f"choosing {option!r} in {label!r} did not stick")


def shown_choice(browser: Browser, label: str) -> str:
    """The text a selectbox labelled `label` shows (its value, or the placeholder when it has none)."""
    return browser.wait_for(f"(() => {{ const w = {_widget('stSelectbox', label)}; return w ? "
                            "(w.querySelector('input').value || w.querySelector('input').placeholder) : null; })()", 60,
                            f"a selectbox labelled {label!r}")


def go_to(browser: Browser, page: str, timeout: float = 60.0) -> None:
    """Switch page with the sidebar's navigation link (the same session, as a user clicks it)."""
    here = (f"[...document.querySelectorAll('[data-testid=\"stMain\"] h1')].some(h => h.innerText.trim() === "
            f"{json.dumps(page)})")
    for _ in range(3):      # a rerun of the page left (a run just ended) can swallow the click
        settle(browser, timeout)
        browser.wait_for(f"(() => {{ const a = [...document.querySelectorAll('[data-testid=\"stSidebarNav\"] a')]"
                         f".find(a => a.innerText.trim() === {json.dumps(page)}); if (a) a.click(); return !!a; }})()",
                         timeout, f"the {page!r} link")
        try:
            browser.wait_for(here, 20, f"the {page} page")
            break
        except TimeoutError:
            continue
    time.sleep(1.0)
    settle(browser, timeout)


# Words of the sidebar's widget labels that the browser breaks across lines ("max_num_se" / "qs").
BROKEN_LABEL_WORDS = """(() => {
  const broken = [];
  for (const label of document.querySelectorAll('[data-testid="stSidebar"] [data-testid="stWidgetLabel"] p')) {
    const node = label.firstChild;
    if (!node || node.nodeType !== 3) continue;
    const text = node.textContent;
    for (const m of text.matchAll(/\\S+/g)) {
      const r = document.createRange(); r.setStart(node, m.index); r.setEnd(node, m.index + m[0].length);
      const tops = new Set([...r.getClientRects()].map(x => Math.round(x.top)));
      if (tops.size > 1) broken.push(m[0]);
    }
  }
  return broken;
})()"""

# Metric tiles whose value the page cuts ("100.…"): wider than their box.
CUT_METRICS = """[...document.querySelectorAll('[data-testid="stMetricValue"]')]
  .filter(v => { const d = v.querySelector('div') || v; return d.scrollWidth > d.clientWidth + 1; })
  .map(v => v.innerText)"""


def chart_spec(browser: Browser, title: str, timeout: float = 60.0) -> dict:
    """The chart titled `title` (prefix) as plotly holds it in the page, once drawn: its traces' names,
    colours, axes, marker symbols and hover templates, and its layout's axes, legends and shapes."""
    return browser.wait_for(
        "(() => { const p = [...document.querySelectorAll('.js-plotly-plot')].find(p => "
        f"(p.layout.title.text || '').replace(/<[^>]+>/g, '').startsWith({json.dumps(title)})); if (!p) return null; "
        "const L = p._fullLayout; const keys = Object.keys(L); return {"
        "traces: p._fullData.map(t => ({name: t.name, type: t.type, color: t.line ? t.line.color : null, "
        "yaxis: t.yaxis, legend: t.legend, hovertemplate: t.hovertemplate, visible: t.visible, "
        "symbols: t.marker && Array.isArray(t.marker.symbol) ? Array.from(t.marker.symbol) : null, "
        "y: Array.from(t.y || []).slice(0, 2000)})), "
        "yaxes: Object.fromEntries(keys.filter(k => k.startsWith('yaxis')).map(k => [k, {range: L[k].range, "
        "title: L[k].title && L[k].title.text}])), "
        "legends: keys.filter(k => /^legend\\d*$/.test(k)).length, "
        "annotations: (L.annotations || []).map(a => a.text), "
        "shapes: (L.shapes || []).map(s => ({y0: s.y0, y1: s.y1, dash: s.line && s.line.dash})), "
        "xhover: L.xaxis && L.xaxis.hoverformat}; })()", timeout, f"a chart titled {title!r}")
