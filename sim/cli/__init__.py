"""kvsim command line (entry point `kvsim`): the typer app, one module per command group.

Command modules keep heavy imports (torch via kvsim.gpu, streamlit, the calibration fits) inside the
command functions, so `kvsim simulate` never imports torch."""
import sys
import warnings
from contextlib import contextmanager

import typer
from typer.core import TyperGroup

from .calibration import calibrate, crosscheck
from .dashboard import dashboard
from .model import app as model_app
from .options import needs_extras
from .planning import capacity, plan, report, sweep
from .reference import app as reference_app
from .catalog import gpus, models
from .replay import replay
from kvsim.sim.serve.cli import serve
from .simulate import simulate
from .trace import app as trace_app

try:                        # Typer >= 0.22 carries its own copy of click
    from typer._click.exceptions import UsageError as _UsageError
except ImportError:
    from click.exceptions import UsageError as _UsageError


class _OneLineUsageErrors(TyperGroup):
    """Click's usage errors (unknown option or command, missing or bad value) as one `error:` line naming
    the option, as every other user mistake, instead of Typer's usage panel. The root group parses the
    command line and, in `invoke`, every subcommand's, so both hooks see every usage error."""

    def make_context(self, *args, **kwargs):
        with _one_line_usage_error():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx):
        with _one_line_usage_error():
            return super().invoke(ctx)


@contextmanager
def _one_line_usage_error():
    from .options import fail

    try:
        yield
    except _UsageError as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":       # `kvsim` / `kvsim trace` alone: the help
            raise
        hint = f"; see '{exc.ctx.command_path} --help'" if exc.ctx is not None else ""
        fail(" ".join(exc.format_message().split()).rstrip(".") + hint)


app = typer.Typer(help="kvsim: paged KV-cache serving simulator and real backend", no_args_is_help=True,
                  pretty_exceptions_enable=False, cls=_OneLineUsageErrors)


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
for command in (replay, serve, dashboard, sweep, capacity, plan, report, calibrate, crosscheck):
    app.command()(needs_extras(command) if command in (replay, dashboard, calibrate, crosscheck) else command)
app.add_typer(reference_app, name="reference")


def main() -> None:
    """The command line (the `kvsim` console script runs it through kvsim.sim.entry)."""
    app()
