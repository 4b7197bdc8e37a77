"""The `kvsim` console script: settings that belong to a whole kvsim process (never to a program
that imports kvsim), then the command line (kvsim.sim.cli)."""
import gc
import os


def main() -> None:
    # numpy asks the kernel for transparent huge pages for every large array; where the kernel
    # compacts memory to supply them (THP "madvise" mode), a run's few large short-lived temporaries
    # (the summary's copies of all token times) cost up to ~0.15 s of system time for no gain. Read
    # when numpy is imported, so set before the CLI's imports; a user's setting wins.
    os.environ.setdefault("NUMPY_MADVISE_HUGEPAGE", "0")
    # pydantic looks for its plug-ins (observers of every validation) on its first model by scanning every
    # installed distribution's entry points (~10 ms a start); kvsim's config needs none (Typer disables
    # them for its own adapters the same way). A user's setting wins.
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    # The commands' modules (pandas, pyarrow, pydantic, ...) create ~10^5 objects that live as long
    # as the process: the cyclic collector, run while they arrive, would only rescan them (~0.1 s a
    # start). Frozen after the imports, later collections skip them.
    enabled = gc.isenabled()
    gc.disable()
    from .cli import main as run_cli
    gc.freeze()
    if enabled:
        gc.enable()
    try:
        run_cli()
    finally:
        # The interpreter's last act would be a cyclic collection over every object the command
        # left (after the main command ~0.2 s for requests and tables the OS frees anyway): skipped.
        gc.freeze()
