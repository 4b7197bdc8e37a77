"""The Streamlit dashboard (`kvsim dashboard`): pages, charts, forms and the run jobs behind them."""
