"""kvsim command line (entry point `kvsim`): the typer app, one module per command group.

Command modules keep heavy imports (torch via kvsim.gpu, streamlit, the calibration fits) inside the
command functions, so `kvsim simulate` never imports torch."""
import sys
import warnings

import typer

from .calibration import calibrate, crosscheck
from .dashboard import dashboard
from .model import app as model_app
from .planning import capacity, plan, report, sweep
from .reference import app as reference_app
from .catalog import gpus, models
from .replay import replay
from .simulate import simulate
from .trace import app as trace_app

app = typer.Typer(help="kvsim: paged KV-cache serving simulator and real backend", no_args_is_help=True,
                  pretty_exceptions_enable=False)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Notices (trace repairs, mode caveats) as one line on stderr, not Python's warning with source."""
    from kvsim.traces.errors import TraceWarning

    kind = "note" if issubclass(category, TraceWarning) else "warning"
    print(f"{kind}: {message}", file=sys.stderr if file is None else file)


def _version(show: bool) -> None:
    if show:
        from importlib.metadata import PackageNotFoundError, version
        try:
            typer.echo(f"kvsim {version('kvsim')}")
        except PackageNotFoundError:          # an uninstalled checkout (python -m sim.cli)
            typer.echo("kvsim (uninstalled checkout)")
        raise typer.Exit()


@app.callback()
def _setup(show_version: bool = typer.Option(False, "--version", is_eager=True, callback=_version,
                                             help="print kvsim's version and exit")) -> None:
    from kvsim.traces.errors import TraceWarning

    warnings.showwarning = _show_warning
    # a notice is shown whatever filter an embedding process left behind (commands that print notices
    # themselves still silence them inside their own catch_warnings)
    warnings.filterwarnings("default", category=TraceWarning)


# registration order is the order of `kvsim --help`
app.add_typer(trace_app, name="trace")
app.command()(simulate)
app.command()(models)
app.command()(gpus)
app.add_typer(model_app, name="model")
for command in (replay, dashboard, sweep, capacity, plan, report, calibrate, crosscheck):
    app.command()(command)
app.add_typer(reference_app, name="reference")


def main() -> None:
    """The command line (the `kvsim` console script runs it through kvsim.sim.entry)."""
    app()
