"""kvsim command line (entry point `kvsim`). Each area registers its own sub-app here."""
import typer

app = typer.Typer(help="kvsim: paged KV-cache serving simulator and real backend", no_args_is_help=True,
                  pretty_exceptions_enable=False)


def main() -> None:
    app()
