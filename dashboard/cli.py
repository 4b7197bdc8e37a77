"""`kvsim dashboard`: serve the Streamlit app on localhost, reading and writing under one data directory."""
from __future__ import annotations

import ipaddress
import os
import sys
from pathlib import Path

import typer

from .data import DATA_ROOT_ENV

APP = Path(__file__).resolve().parent / "app.py"


def streamlit_command(port: int, address: str = "127.0.0.1", headless: bool = True) -> list[str]:
    return [sys.executable, "-m", "streamlit", "run", str(APP), "--server.port", str(port),
            "--server.address", address, "--server.headless", str(headless).lower(),
            "--browser.gatherUsageStats", "false", "--global.developmentMode", "false",
            "--client.toolbarMode", "minimal", "--client.showErrorDetails", "type"]


def is_local_address(address: str) -> bool:
    if address in ("localhost", ""):
        return address == "localhost"
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:   # a host name other than localhost
        return False


def exposure_warning(address: str, root: Path) -> str:
    return (f"WARNING: the dashboard is bound to {address or 'all interfaces'}, not this machine only. Anyone who "
            f"can reach this address can run simulations on this machine and read and write files under {root}. "
            f"It has no login. Use --address 127.0.0.1 (the default) unless that is what you want.")


def dashboard(
    port: int = typer.Option(8501, min=1, max=65535, help="TCP port on localhost"),
    address: str = typer.Option("127.0.0.1", help="address to bind; the default serves this machine only"),
    data_root: Path = typer.Option(Path("runs"), "--data-root", help=f"the only directory the dashboard reads run "
                                   f"results, traces and stores from and writes uploads and stores to (also "
                                   f"${DATA_ROOT_ENV})", envvar=DATA_ROOT_ENV),
    open_browser: bool = typer.Option(False, "--open/--no-open", help="open a browser tab"),
) -> None:
    """Start the kvsim dashboard (Streamlit) at http://ADDRESS:PORT; Ctrl-C stops it."""
    root = data_root.expanduser().resolve()
    os.environ[DATA_ROOT_ENV] = str(root)
    if not is_local_address(address):
        typer.secho(exposure_warning(address, root), fg="red", bold=True, err=True)
    typer.echo(f"kvsim dashboard on http://{address}:{port} (data directory {root})")
    command = streamlit_command(port, address, headless=not open_browser)
    sys.stdout.flush()
    os.execv(command[0], command)   # become the server: signals and exit code are streamlit's
