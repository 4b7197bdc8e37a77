"""`kvsim models` and `kvsim gpus`: the catalogs with the figures that size a run."""
from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from kvsim.sim.model.catalog import CatalogError, get_model, list_gpus, list_models

from . import fail, table_console

console = table_console()
GiB = 2**30
AsJson = Annotated[bool, typer.Option("--json", help="print the figures as JSON instead of a table")]


def model_row(m) -> dict:
    active = m.param_count - m.routed_expert_params + m.num_moe_layers * m.experts_per_token * m.expert_params
    return {"name": m.name, "hf_id": m.hf_id, "params_b": m.param_count / 1e9, "active_params_b": active / 1e9,
            "layers": m.num_layers, "heads": m.num_heads, "kv_heads": m.num_kv_heads, "head_dim": m.head_dim,
            "weight_dtype": m.weight_dtype, "expert_dtype": m.expert_dtype, "weight_gib": m.weight_bytes / GiB,
            "kv_dtype": m.kv_dtype, "kv_bytes_per_token": m.kv_bytes_per_token(),
            "kv_bytes_per_token_full_attention": _full_attention_kv_bytes(m), "max_position": m.max_position,
            "max_model_len": m.max_model_len, "experts": m.num_experts, "experts_per_token": m.experts_per_token,
            "shared_experts": m.num_shared_experts, "attention": _attention(m),
            "sliding_window": m.sliding_window, "sliding_window_layers": m.num_sliding_layers}


def _full_attention_kv_bytes(m) -> float:
    """KV bytes per token of the layers that keep every token (what grows with the context): all layers but
    the sliding-window ones, whose KV stops at the window (vLLM's hybrid allocator frees the rest)."""
    return m.kv_bytes_per_token() * (m.num_layers - m.num_sliding_layers) / m.num_layers


def _kv_per_token(row: dict) -> str:
    text = f"{row['kv_bytes_per_token_full_attention'] / 1024:g} KiB {row['kv_dtype']}"
    if row["sliding_window_layers"]:                  # the window layers' KV is bounded, not per token of context
        window = (row["kv_bytes_per_token"] - row["kv_bytes_per_token_full_attention"]) / 1024
        text += f" (+{window:g} KiB in the window)"
    return text


def _max_len(row: dict) -> str:
    """vLLM's default max_model_len; a LongRoPE model's scaled length beside it (what --max-model-len accepts)."""
    default, longest = row["max_model_len"], row["max_position"]
    return f"{default:,}" + (f" (up to {longest:,})" if longest != default else "")


def _attention(m) -> str:
    """MHA / GQA / MLA, and the sliding window (on how many layers)."""
    kind = "MLA" if m.is_mla else "MHA" if m.num_kv_heads == m.num_heads else "GQA"
    if m.sliding_window:
        kind += f", window {m.sliding_window:,} on {m.num_sliding_layers}/{m.num_layers} layers"
    return kind


def models(
    model: Annotated[list[str], typer.Argument(help="catalog names, model YAML files or HF config.json "
                                                    "(default: the whole catalog)")] = None,
    as_json: AsJson = False,
) -> None:
    """List the model catalog (or the given models): parameters, weight bytes, KV bytes per token."""
    specs, problems = [], []
    for name in model or []:
        try:
            specs.append(get_model(name))
        except CatalogError as exc:          # one bad file: its own line, the others still listed
            problems.append(str(exc))
    if not model:
        specs = list_models()
    if problems and not specs:
        fail("; ".join(problems))
    rows = [model_row(m) for m in specs]
    if as_json:
        typer.echo(json.dumps(rows, indent=1))
        _report_problems(problems)
        return
    table = Table(title="models (kvsim simulate --model NAME; aliases and HF ids work too)")
    for col in ("name", "params (active)", "experts", "layers", "heads / KV", "head_dim", "attention", "weights",
                "KV per token", "max len"):
        table.add_column(col, justify="left" if col in ("name", "attention") else "right", no_wrap=col == "name")
    for r in rows:
        params = f"{r['params_b']:.2f} B" + (f" ({r['active_params_b']:.2f})" if r["experts"] else "")
        experts = (f"{r['experts']} top {r['experts_per_token']}" + (f" +{r['shared_experts']}" if r["shared_experts"]
                                                                      else "")) if r["experts"] else ""
        dtype = r["weight_dtype"] + (f"/{r['expert_dtype']}" if r["expert_dtype"] else "")
        table.add_row(r["name"], params, experts, str(r["layers"]), f"{r['heads']} / {r['kv_heads']}",
                      str(r["head_dim"]), r["attention"], f"{r['weight_gib']:.2f} GiB {dtype}",
                      _kv_per_token(r), _max_len(r))
    console.print(table)
    _report_problems(problems)


def _report_problems(problems: list[str]) -> None:
    """The models that could not be read: one `error:` line each, exit status 2 after the others' listing."""
    for problem in problems:
        typer.echo(f"{typer.style('error:', fg='red')} {problem}", err=True)
    if problems:
        raise typer.Exit(2)


def gpus(as_json: AsJson = False) -> None:
    """List the GPU catalog: memory, bandwidth, peak TFLOP/s, links and price."""
    rows = [{"name": g.name, "kind": g.kind, "memory_gib": g.memory_gib, "memory_bw_gbps": g.memory_bw_gbps,
             "tflops": dict(g.tflops), "interconnect_gbps": g.interconnect_gbps, "pcie_gbps": g.pcie_gbps,
             "usd_per_hour": g.usd_per_hour} for g in list_gpus()]
    if as_json:
        typer.echo(json.dumps(rows, indent=1))
        return
    table = Table(title="GPUs (kvsim simulate --gpu NAME)")
    for col in ("name", "memory", "bandwidth", "peak TFLOP/s (dense)", "GPU link", "$/h"):
        table.add_column(col, justify="left" if col in ("name", "peak TFLOP/s (dense)") else "right")
    for r in rows:
        flops = ", ".join(f"{k} {v:g}" for k, v in r["tflops"].items())
        link = f"{r['interconnect_gbps']:g} GB/s" if r["interconnect_gbps"] else f"PCIe {r['pcie_gbps']:g} GB/s"
        table.add_row(r["name"], f"{r['memory_gib']:g} GiB", f"{r['memory_bw_gbps']:g} GB/s", flops, link,
                      f"{r['usd_per_hour']:g}")
    console.print(table)
