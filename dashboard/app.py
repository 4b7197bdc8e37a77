"""kvsim dashboard entry point: `kvsim dashboard` (or `streamlit run dashboard/app.py`)."""
from pathlib import Path

import streamlit as st

from kvsim.dashboard.server import exposure_warning, is_local_address
from kvsim.dashboard.data import data_root

PAGES = Path(__file__).resolve().parent / "pages"

st.set_page_config(page_title="kvsim", layout="wide")
address = st.get_option("server.address") or ""
if not is_local_address(address):
    st.warning(exposure_warning(address, data_root()), icon="⚠️")
page = st.navigation([
    st.Page(PAGES / "simulate.py", title="Simulate", default=True),
    st.Page(PAGES / "memory.py", title="Memory"),
    st.Page(PAGES / "timeseries.py", title="Time series", url_path="timeseries"),
    st.Page(PAGES / "compare.py", title="Compare"),
    st.Page(PAGES / "capacity.py", title="Capacity"),
    st.Page(PAGES / "fidelity.py", title="Fidelity"),
])
page.run()
