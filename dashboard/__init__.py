"""The Streamlit dashboard (`kvsim dashboard`): pages, charts, forms and the run jobs behind them."""

# where the dashboard keeps its runs (read by `kvsim dashboard`'s option without importing the pages' data code)
DATA_ROOT_ENV = "KVSIM_DATA_ROOT"
