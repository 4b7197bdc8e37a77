"""`kvsim trace`: statistics, synthesis and conversion of request traces."""
from __future__ import annotations

import functools
import json
import warnings
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from kvsim.traces.errors import TraceError, TraceWarning
from kvsim.traces.loaders import DATA_TRACES, FORMATS, GENERIC_FORMATS, load_trace, resolve_trace_path
from kvsim.traces.stats import trace_stats
from kvsim.traces.synthetic import synthesize
from kvsim.traces.trace import Trace

from .options import TimeUnit, Tokenizer, TraceColumns, TraceFormat, output_path, table_console

app = typer.Typer(help="Inspect, synthesize and convert request traces. Shipped traces: "
                       + ", ".join(DATA_TRACES), no_args_is_help=True)

RATE_HELP = "Arrival rate (req/s) for length-only traces (ShareGPT, arXiv); without it they arrive at t=0."
CV_HELP = "Inter-arrival coefficient of variation with --rate: 1 = Poisson, >1 = bursty Gamma."


def _console(stderr: bool = False) -> Console:
    return table_console(stderr, highlight=False)


class _OptionError(ValueError):
    """An option given that this command cannot use: 'error: --option ...', exit status 2."""


def _exits_cleanly(command):
    """Bad input ends with 'error: path:line: reason' on stderr and exit status 2, not a traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TraceWarning)  # notices are printed from trace.notices
            try:
                return command(*args, **kwargs)
            except (TraceError, _OptionError, OSError) as exc:
                _console(stderr=True).print(f"[bold red]error:[/] {exc}", markup=True, soft_wrap=True)
                raise typer.Exit(2) from None

    return wrapper


def _reader_options(trace_format: str | None, trace_columns: str | None, time_unit: str | None,
                    tokenizer: str | None) -> dict:
    """load_trace's format options, refused where they would be ignored (as `simulate` refuses them)."""
    generic = trace_format in GENERIC_FORMATS
    if trace_format is not None and trace_format not in FORMATS:
        raise _OptionError(f"--trace-format {trace_format!r}; expected one of {', '.join(FORMATS)}")
    for option, value in (("--trace-columns", trace_columns), ("--time-unit", time_unit)):
        if value is not None and not generic:
            raise _OptionError(f"{option} reads a csv, jsonl or parquet log; give --trace-format csv|jsonl|parquet")
    options = {"format": trace_format} if trace_format else {}
    if generic:
        options.update(columns=trace_columns, time_unit=time_unit or "s")
    if tokenizer is not None:
        options["tokenizer"] = tokenizer
    return options


def _print_notices(trace: Trace, console: Console) -> None:
    for notice in trace.notices:
        console.print(f"note ({trace.name}): {notice}", markup=False, soft_wrap=True)


def _fmt(value, kind: str = "num") -> str:
    if value is None:
        return "-"
    if kind == "int":
        return f"{value:,}"
    if kind == "pct":
        return f"{100 * value:.1f}%"
    if kind == "tokens":
        return f"{value:,.0f}"
    return f"{value:,.2f}"


STAT_ROWS = [
    ("requests", "requests", "int"),
    ("span (s)", "span_s", "num"),
    ("mean rate (req/s)", "mean_rate_rps", "num"),
    ("inter-arrival CV", "interarrival_cv", "num"),
    *[(f"{label} {q}", f"{label}_{q}", "tokens") for label in ("prompt", "output")
      for q in ("mean", "p50", "p90", "p99", "max")],
    ("prefix blocks", "prefix_blocks", "int"),
    ("prefix block tokens", "prefix_block_tokens", "int"),
    ("prefix blocks seen before", "prefix_repeat_share", "pct"),
    ("sessions", "sessions", "int"),
    ("clipped", "num_clipped", "int"),
    ("output 0 -> 1", "num_output_clamped", "int"),
    ("reordered", "num_reordered", "int"),
]


@app.command()
@_exits_cleanly
def stats(files: list[str] = typer.Argument(..., help="Trace files or shipped short names."),
          rate: float | None = typer.Option(None, help=RATE_HELP),
          cv: float | None = typer.Option(None, help=CV_HELP),
          seed: int = typer.Option(0, help="Seed for synthesized arrivals."),
          as_json: bool = typer.Option(False, "--json", help="Print the figures as JSON instead of a table."),
          trace_format: TraceFormat = None, trace_columns: TraceColumns = None, time_unit: TimeUnit = None,
          tokenizer: Tokenizer = None):
    """Count, time span, mean rate, inter-arrival CV, prompt/output length percentiles and prefix reuse."""
    reader = _reader_options(trace_format, trace_columns, time_unit, tokenizer)
    traces = [load_trace(f, rate=rate, cv=cv, seed=seed, **reader) if _is_length_only(f, trace_format)
              else load_trace(f, **reader) for f in files]
    figures = [trace_stats(t) for t in traces]
    console = _console()
    if as_json:
        console.print_json(json.dumps(figures))
        return
    table = Table(title="trace statistics")
    table.add_column("")
    for t in traces:
        table.add_column(t.name, justify="right", no_wrap=True)
    for label, key, kind in STAT_ROWS:
        if all(f[key] is None for f in figures) and key.startswith(("prefix", "sessions")):
            continue
        table.add_row(label, *(_fmt(f[key], kind) for f in figures))
    console.print(table)
    for t in traces:
        _print_notices(t, console)


def _is_length_only(source: str, trace_format: str | None = None) -> bool:
    from kvsim.traces.loaders import LENGTH_ONLY_FORMATS, detect_format, resolve_trace_path

    return (trace_format or detect_format(resolve_trace_path(source)[0])) in LENGTH_ONLY_FORMATS


@app.command()
@_exits_cleanly
def synth(out: Path = typer.Argument(..., parser=output_path("OUT"), help="Output file: .parquet or .jsonl (kvsim native format)."),
          requests: int = typer.Option(1000, "--requests", "-n", help="Number of requests."),
          rate: float | None = typer.Option(None, help="Arrival rate (req/s); omit for a closed batch at t=0."),
          cv: float | None = typer.Option(None, help=CV_HELP),
          prompt: str = typer.Option("lognormal:1024,1.0", help="Prompt length: fixed:L | uniform:LO,HI | lognormal:MEAN,CV[,MAX]."),
          output: str = typer.Option("lognormal:256,1.0", help="Output length spec, as --prompt."),
          lengths: str | None = typer.Option(None, help="Resample (prompt, output) pairs from this trace "
                                                           "(short name or file) instead of --prompt/--output."),
          seed: int = typer.Option(0, help="Random seed; same seed and options give the same trace."),
          name: str | None = typer.Option(None, help="Trace name stored in the file.")):
    """Write a seeded synthetic trace (Poisson/Gamma arrivals or a closed batch)."""
    trace = synthesize(requests, rate=rate, cv=cv, prompt=prompt, output=output, lengths=lengths, seed=seed,
                       name=name or Path(out).stem)
    trace.save(out)
    _console().print(f"wrote {len(trace)} requests to {out}", markup=False, soft_wrap=True)
    _print_notices(trace, _console())


@app.command()
@_exits_cleanly
def convert(source: str = typer.Argument(..., help="Input trace file (any supported format) or shipped short name."),
            out: Path = typer.Argument(..., parser=output_path("OUT"), help="Output file: .parquet or .jsonl (kvsim native format)."),
            rate: float | None = typer.Option(None, help=RATE_HELP),
            cv: float | None = typer.Option(None, help=CV_HELP),
            seed: int = typer.Option(0, help="Seed for synthesized arrivals and --sample."),
            start: float | None = typer.Option(None, help="Keep requests arriving at or after this time (s); "
                                                             "times are shifted so it becomes 0."),
            end: float | None = typer.Option(None, help="Keep requests arriving before this time (s)."),
            scale_rate: float | None = typer.Option(None, help="Multiply the arrival rate (2 = twice as fast)."),
            head: int | None = typer.Option(None, help="Keep the first N requests."),
            sample: int | None = typer.Option(None, help="Keep N requests drawn at random (seeded)."),
            max_model_len: int | None = typer.Option(None, help="Clip prompt+output to this many tokens."),
            name: str | None = typer.Option(None, help="Trace name stored in the file."),
            trace_format: TraceFormat = None, trace_columns: TraceColumns = None, time_unit: TimeUnit = None,
            tokenizer: Tokenizer = None):
    """Convert a trace to kvsim's native format, optionally windowing, rescaling, sampling and clipping.

    Transforms apply in this order: window, scale-rate, head, sample, clip."""
    source_path = resolve_trace_path(source)[0]
    if Path(out).resolve() == source_path.resolve():
        raise TraceError(out, None, "is the source trace; write the converted trace to another file")
    trace = load_trace(source, rate=rate, cv=cv, seed=seed,
                       **_reader_options(trace_format, trace_columns, time_unit, tokenizer))
    if start is not None or end is not None:
        trace = trace.window(start or 0.0, float("inf") if end is None else end)
    if scale_rate is not None:
        trace = trace.scale_rate(scale_rate)
    if head is not None:
        trace = trace.head(head)
    if sample is not None:
        trace = trace.sample(sample, seed=seed)
    if max_model_len is not None:
        trace = trace.clip(max_model_len)
    if name:
        trace.name = name
    if len(trace) == 0:
        raise TraceError(source, None, "no requests left after the transforms; nothing written")
    trace.save(out)
    _console().print(f"wrote {len(trace)} requests to {out}", markup=False, soft_wrap=True)
    _print_notices(trace, _console())
