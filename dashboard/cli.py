"""`kvsim dashboard`: serve the Streamlit app on localhost."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

APP = Path(__file__).resolve().parent / "app.py"


def streamlit_command(port: int, address: str = "127.0.0.1", headless: bool = True) -> list[str]:
    return [sys.executable, "-m", "streamlit", "run", str(APP), "--server.port", str(port),
            "--server.address", address, "--server.headless", str(headless).lower(),
            "--browser.gatherUsageStats", "false", "--global.developmentMode", "false"]


def dashboard(
    port: int = typer.Option(8501, min=1, max=65535, help="TCP port on localhost"),
    address: str = typer.Option("127.0.0.1", help="address to bind; the default serves this machine only"),
    open_browser: bool = typer.Option(False, "--open/--no-open", help="open a browser tab"),
) -> None:
    """Start the kvsim dashboard (Streamlit) at http://ADDRESS:PORT; Ctrl-C stops it."""
    typer.echo(f"kvsim dashboard on http://{address}:{port}")
    command = streamlit_command(port, address, headless=not open_browser)
    sys.stdout.flush()
    os.execv(command[0], command)   # become the server: signals and exit code are streamlit's
