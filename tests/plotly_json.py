"""For the AppTest-based dashboard tests: opening a page on a run as a new browser session does, and
reading its plotly charts as the browser receives them (their JSON spec)."""
from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
from streamlit.testing.v1 import AppTest

APP = str(Path(__file__).resolve().parents[1] / "dashboard" / "app.py")


def open_page(page: str, run: str) -> AppTest:
    """A new browser session opening `page?run=RUN`."""
    at = AppTest.from_file(APP, default_timeout=60)
    at.query_params["run"] = run
    at.switch_page(f"pages/{page}.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    return at


def figure(at: AppTest, title: str) -> dict:
    found = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    found = [f for f in found if f["layout"].get("title", {}).get("text", "").startswith(title)]
    assert found, f"no chart titled {title!r}"
    return found[0]


def values(array) -> np.ndarray:
    """Plotly JSON arrays arrive as lists or as {'dtype', 'bdata'} (base64)."""
    if isinstance(array, dict):
        return np.frombuffer(base64.b64decode(array["bdata"]), dtype=np.dtype(array["dtype"])).astype(float)
    return np.asarray([np.nan if v is None else v for v in array], dtype=float)


def series(fig: dict, name: str) -> tuple[np.ndarray, np.ndarray]:
    trace = next(t for t in fig["data"] if t.get("name") == name)
    return values(trace["x"]).astype(float), values(trace["y"]).astype(float)


def trace_in(fig: dict, panel: str, name: str) -> np.ndarray:
    """The y values of series `name` in the panel whose title starts with `panel` (subplots share names)."""
    titles = [a for a in fig["layout"]["annotations"] if a["text"].startswith(panel)]
    assert titles, f"no panel {panel!r}"
    axes = sorted((k for k in fig["layout"] if k.startswith("xaxis")), key=lambda k: int(k[5:] or 1))
    x0 = titles[0]["x"]
    y1 = titles[0]["y"]
    for key in axes:       # the subplot whose domain holds the title's position
        ax = fig["layout"][key]
        anchor = ax["anchor"]
        ydom = fig["layout"]["yaxis" + anchor[1:]]["domain"]
        if ax["domain"][0] <= x0 <= ax["domain"][1] and abs(ydom[1] - y1) < 0.05:
            ref = "x" + key[5:]
            trace = next(t for t in fig["data"] if t.get("name") == name and t.get("xaxis", "x") == ref)
            return values(trace["y"]).astype(float)
    raise AssertionError(f"no series {name!r} in panel {panel!r}")
