"""`kvsim dashboard`: serve the Streamlit app on localhost, reading and writing under one data directory."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from kvsim.dashboard import DATA_ROOT_ENV


def dashboard(
    port: Annotated[int, typer.Option(min=1, max=65535, help="TCP port on localhost")] = 8501,
    address: Annotated[str, typer.Option(help="address to bind; the default serves this machine only")] = "127.0.0.1",
    data_root: Annotated[Path, typer.Option(
        "--data-root", envvar=DATA_ROOT_ENV,
        help=f"the only directory the dashboard reads run results, traces and stores from and writes uploads and "
             f"stores to (also ${DATA_ROOT_ENV})")] = Path("runs"),
    open_browser: Annotated[bool, typer.Option("--open/--no-open", help="open a browser tab")] = False,
) -> None:
    """Start the kvsim dashboard (Streamlit) at http://ADDRESS:PORT; Ctrl-C stops it."""
    import importlib.util

    from kvsim.dashboard.server import exposure_warning, is_local_address, streamlit_command

    if importlib.util.find_spec("streamlit") is None:       # the server runs in a new process: check here
        raise ModuleNotFoundError("No module named 'streamlit'", name="streamlit")

    root = data_root.expanduser().resolve()
    if root.exists() and not root.is_dir():
        from .options import fail
        fail(f"--data-root {data_root}: not a directory; expected the directory of run results, traces and "
             f"stores (created if missing)")
    os.environ[DATA_ROOT_ENV] = str(root)
    if not is_local_address(address):
        typer.secho(exposure_warning(address, root), fg="red", bold=True, err=True)
    typer.echo(f"kvsim dashboard on http://{address}:{port} (data directory {root})")
    command = streamlit_command(port, address, headless=not open_browser)
    sys.stdout.flush()
    os.execv(command[0], command)   # become the server: signals and exit code are streamlit's
