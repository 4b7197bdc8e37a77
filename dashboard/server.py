"""How the dashboard is served: the Streamlit command line, and whether (and how loudly to say that) the
bound address reaches beyond this machine."""
from __future__ import annotations

import ipaddress
import sys
from pathlib import Path

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
