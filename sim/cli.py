"""kvsim command line (entry point `kvsim`). Each area registers its own sub-app here."""
import sys
import warnings

import typer

app = typer.Typer(help="kvsim: paged KV-cache serving simulator and real backend", no_args_is_help=True,
                  pretty_exceptions_enable=False)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Notices (trace repairs, mode caveats) as one line on stderr, not Python's warning with source."""
    from kvsim.traces.errors import TraceWarning

    kind = "note" if issubclass(category, TraceWarning) else "warning"
    print(f"{kind}: {message}", file=sys.stderr if file is None else file)


@app.callback()
def _setup() -> None:
    warnings.showwarning = _show_warning


from kvsim.traces.cli import app as trace_app  # noqa: E402
app.add_typer(trace_app, name="trace")

from kvsim.sim.commands import simulate  # noqa: E402

app.command()(simulate)

from kvsim.gpu.cli import app as model_app  # noqa: E402
app.add_typer(model_app, name="model")

from kvsim.gpu.replay_cli import replay  # noqa: E402
app.command()(replay)

from kvsim.dashboard.cli import dashboard  # noqa: E402
app.command()(dashboard)

from kvsim.sim.planning_cli import capacity, report, sweep  # noqa: E402
app.command()(sweep)
app.command()(capacity)
app.command()(report)

from kvsim.sim.calibration_cli import calibrate, crosscheck  # noqa: E402
app.command()(calibrate)
app.command()(crosscheck)

from kvsim.sim.reference_cli import app as reference_app  # noqa: E402
app.add_typer(reference_app, name="reference")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
