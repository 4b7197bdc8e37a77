"""Dashboard pages; each is a Streamlit script run by dashboard/app.py's navigation."""
