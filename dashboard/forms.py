"""Input widgets that build a validated SimConfig, the same one `kvsim simulate` builds.

Sections of SimConfig the dashboard has no hand-made widgets for (for example a `kv:` section
with an eviction policy and slot strategy) get widgets generated from their pydantic fields, so
new engine options appear here without dashboard changes.
"""
from __future__ import annotations

import hashlib
import tempfile
import types
import typing
from pathlib import Path
from typing import Any, Literal

import streamlit as st
from pydantic import BaseModel

from sim.config import ConfigError, SimConfig, load_config
from traces import DATA_TRACES, TraceError

DEFAULT_MAX_REQUESTS = 200
BLOCK_SIZES = (8, 16, 32, 64, 128)
# Fields with hand-made widgets below; every other field gets a generated one.
_HANDLED = {"trace", "trace_options", "model", "gpu", "tp", "replicas", "engine", "slo", "seed"}
_HANDLED_ENGINE = {"block_size", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens",
                   "enable_prefix_caching", "enable_chunked_prefill", "preemption_mode", "scheduling_policy"}
_SECTION_TITLES = {"kv": "KV eviction policy and slot strategy"}


# ---- pydantic field introspection ---------------------------------------------------------------
def _unwrap(annotation) -> tuple[Any, bool]:
    """(inner type, optional?) for `X | None` / Optional[X]."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else annotation), True
    return annotation, False


def _is_model(annotation) -> bool:
    inner, _ = _unwrap(annotation)
    return isinstance(inner, type) and issubclass(inner, BaseModel)


def field_choices(annotation) -> list | None:
    """The finite set of values a field takes (Literal, bool), or None."""
    inner, optional = _unwrap(annotation)
    if typing.get_origin(inner) is Literal:
        return list(typing.get_args(inner)) + ([None] if optional else [])
    if inner is bool:
        return [False, True]
    return None


def extra_sections() -> dict[str, type[BaseModel]]:
    """SimConfig sub-models the dashboard has no hand-made widgets for (e.g. `kv`)."""
    return {name: _unwrap(f.annotation)[0] for name, f in SimConfig.model_fields.items()
            if name not in _HANDLED and _is_model(f.annotation)}


def config_axes() -> dict[str, list | None]:
    """Dotted config keys a comparison can vary -> their choices (None: numeric, typed in)."""
    axes: dict[str, list | None] = {}

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, f in model.model_fields.items():
            key = f"{prefix}{name}"
            if _is_model(f.annotation):
                walk(_unwrap(f.annotation)[0], f"{key}.")
                continue
            choices = field_choices(f.annotation)
            inner, _ = _unwrap(f.annotation)
            if choices is not None:
                axes[key] = choices
            elif inner in (int, float):
                axes[key] = None

    walk(SimConfig, "")
    from sim.catalog import list_gpus, list_models
    axes["model"] = [m.name for m in list_models()]
    axes["gpu"] = [g.name for g in list_gpus()]
    for skip in ("seed", "check_invariants", "fast_forward", "slo.ttft", "slo.tpot"):
        axes.pop(skip, None)
    return dict(sorted(axes.items(), key=lambda kv: (not kv[0].startswith(tuple(extra_sections())), kv[0])))


def parse_axis_values(key: str, text: str) -> list:
    """'8, 16, 32' -> [8, 16, 32] for a numeric config key; ConfigError names the bad item."""
    model: type[BaseModel] = SimConfig
    *parents, leaf = key.split(".")
    for p in parents:
        model = _unwrap(model.model_fields[p].annotation)[0]
    inner, _ = _unwrap(model.model_fields[leaf].annotation)
    values = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        try:
            values.append(inner(item) if inner is float else int(item))
        except ValueError:
            raise ConfigError(f"{key}: {item!r} is not {'a number' if inner is float else 'an integer'}") from None
    if not values:
        raise ConfigError(f"{key}: give at least one value, comma-separated (e.g. 8, 16, 32)")
    return values


def _field_widget(key: str, name: str, f, prefix: str):
    choices = field_choices(f.annotation)
    inner, optional = _unwrap(f.annotation)
    help_text = f.description or None
    wkey = f"{prefix}{key}"
    if choices is not None and inner is not bool:
        default = f.default if f.default in choices else choices[0]
        return st.selectbox(name, choices, index=choices.index(default), key=wkey, help=help_text,
                            format_func=lambda v: "(none)" if v is None else str(v))
    if inner is bool and optional:          # null = the engine's default for this GPU / policy
        options = [None, True, False]
        return st.selectbox(name, options, index=options.index(f.default), key=wkey, help=help_text,
                            format_func=lambda v: {None: "default", True: "on", False: "off"}[v])
    if inner is bool:
        return st.checkbox(name, value=bool(f.default), key=wkey, help=help_text)
    if inner in (int, float):
        default = f.default if isinstance(f.default, (int, float)) else None
        return st.number_input(name, value=inner(default) if default is not None else None, key=wkey,
                               step=1 if inner is int else None, help=help_text,
                               placeholder="default" if optional else None)
    if inner is str:
        value = st.text_input(name, value="" if f.default is None else str(f.default), key=wkey, help=help_text)
        return value or None
    return None


def model_widgets(section: str, model: type[BaseModel], prefix: str, skip: set[str] = frozenset()) -> dict:
    """Generated widgets for a pydantic section -> dotted overrides."""
    out = {}
    for name, f in model.model_fields.items():
        if name in skip or _is_model(f.annotation):
            continue
        value = _field_widget(f"{section}.{name}", name, f, prefix)
        if value is not None:
            out[f"{section}.{name}"] = value
    return out


# ---- trace source ------------------------------------------------------------------------------
def _save_upload(upload) -> Path:
    """Keep an uploaded trace on disk for the loaders (one copy per distinct content)."""
    data = upload.getvalue()
    digest = hashlib.sha256(data).hexdigest()[:16]
    root = Path(tempfile.gettempdir()) / "kvsim-dashboard-uploads" / digest
    root.mkdir(parents=True, exist_ok=True)
    path = root / Path(upload.name).name
    if not path.exists():
        path.write_bytes(data)
    return path


@st.cache_data(show_spinner=False, max_entries=32)
def _trace_info(source: str, mtime: float) -> tuple[str, dict]:
    from traces import load_trace
    from traces.loaders import detect_format, resolve_trace_path
    from traces.stats import trace_stats

    path, _ = resolve_trace_path(source)
    return detect_format(path), trace_stats(load_trace(source))


def trace_info(source: str) -> tuple[str, dict]:
    """(format, stats) of a trace; raises TraceError with the loader's message."""
    from traces.loaders import resolve_trace_path

    path, _ = resolve_trace_path(source)
    return _trace_info(source, path.stat().st_mtime)


def trace_input(prefix: str) -> tuple[str | None, dict, str | None]:
    """Trace picker -> (trace source or None, trace_options overrides, error message)."""
    kind = st.radio("Trace", ["Shipped trace", "Upload a file", "Path on this machine"], key=f"{prefix}trace_kind",
                    horizontal=True)
    source, shown = None, None
    if kind == "Shipped trace":
        source = st.selectbox("Shipped trace", list(DATA_TRACES), key=f"{prefix}trace_name")
    elif kind == "Upload a file":
        upload = st.file_uploader("Trace file (Azure/BurstGPT/Vidur/length CSV, Mooncake JSONL, kvsim native)",
                                  key=f"{prefix}trace_upload")
        if upload is None:
            return None, {}, "upload a trace file, or pick a shipped trace"
        source, shown = str(_save_upload(upload)), upload.name
    else:
        text = st.text_input("Trace file path", key=f"{prefix}trace_path").strip()
        if not text:
            return None, {}, "enter the path of a trace file"
        source = text
    try:
        fmt, stats = trace_info(source)
    except TraceError as exc:
        message = str(exc)
        if shown:   # name the file the user uploaded, not our temporary copy
            message = message.replace(source, shown)
        return None, {}, message
    except OSError as exc:
        return None, {}, f"{shown or source}: {exc.strerror or exc}"
    st.caption(f"{fmt} format, {stats['requests']:,} requests over {stats['span_s']:.0f} s; prompt p50 "
               f"{stats['prompt_p50']:.0f}, output p50 {stats['output_p50']:.0f} tokens")
    opts = {}
    if fmt == "lengths":
        rate = st.number_input("Arrival rate (req/s) for this length-only trace; 0 = all at t=0", min_value=0.0,
                               value=0.0, key=f"{prefix}rate")
        opts["trace_options.rate"] = rate or None
    return source, opts, None


# ---- the whole config --------------------------------------------------------------------------
def config_form(prefix: str, max_requests: int = DEFAULT_MAX_REQUESTS) -> tuple[SimConfig | None, str | None]:
    """Widgets for one simulation -> (validated SimConfig, None) or (None, readable error)."""
    from sim.catalog import list_gpus, list_models

    source, overrides, error = trace_input(prefix)
    defaults = SimConfig()
    c1, c2 = st.columns(2)
    overrides["trace_options.max_requests"] = c1.number_input(
        "Max requests (first N)", min_value=1, value=max_requests, step=50, key=f"{prefix}max_requests")
    overrides["trace_options.rate_scale"] = c2.number_input(
        "Arrival-rate scale", min_value=0.01, value=1.0, step=0.25, key=f"{prefix}rate_scale",
        help="2 = requests arrive twice as fast")
    models = [m.name for m in list_models()]
    gpus = [g.name for g in list_gpus() if g.kind == "gpu"] + [g.name for g in list_gpus() if g.kind != "gpu"]
    overrides["model"] = st.selectbox("Model", models, index=_index_of(models, defaults.model), key=f"{prefix}model")
    overrides["gpu"] = st.selectbox("GPU", gpus, index=_index_of(gpus, defaults.gpu), key=f"{prefix}gpu")
    c1, c2 = st.columns(2)
    overrides["tp"] = c1.number_input("Tensor parallel", min_value=1, value=1, key=f"{prefix}tp")
    overrides["replicas"] = c2.number_input("Replicas", min_value=1, value=1, key=f"{prefix}replicas")

    with st.expander("Engine", expanded=False):
        e = defaults.engine
        a, b = st.columns(2)
        overrides["engine.block_size"] = a.selectbox("Block size (tokens)", BLOCK_SIZES,
                                                     index=BLOCK_SIZES.index(e.block_size), key=f"{prefix}block_size")
        overrides["engine.num_gpu_blocks"] = b.number_input(
            "KV pool (blocks)", min_value=1, value=None, placeholder="from GPU memory", key=f"{prefix}num_gpu_blocks",
            help="empty: sized from GPU memory, weights and activations like vLLM")
        overrides["engine.max_num_seqs"] = a.number_input(
            "max_num_seqs", min_value=1, value=e.max_num_seqs, key=f"{prefix}max_num_seqs",
            placeholder="vLLM default", help="empty: vLLM's default for the GPU and entry point")
        overrides["engine.max_num_batched_tokens"] = b.number_input(
            "max_num_batched_tokens", min_value=1, value=e.max_num_batched_tokens, key=f"{prefix}max_batched",
            placeholder="vLLM default", help="empty: vLLM's default for the GPU and entry point")
        overrides["engine.enable_prefix_caching"] = _field_widget(
            "engine.enable_prefix_caching", "Prefix caching", type(e).model_fields["enable_prefix_caching"], prefix)
        overrides["engine.enable_chunked_prefill"] = b.checkbox("Chunked prefill", value=e.enable_chunked_prefill,
                                                                key=f"{prefix}chunked")
        overrides["engine.preemption_mode"] = a.selectbox("Preemption", ["recompute", "swap"], key=f"{prefix}preempt")
        overrides["engine.scheduling_policy"] = b.selectbox("Scheduling", ["fcfs", "priority"], key=f"{prefix}sched")
        st.caption("More engine options")
        overrides.update(model_widgets("engine", type(e), prefix, skip=_HANDLED_ENGINE))

    sections = extra_sections()
    for name, model in sections.items():
        with st.expander(_SECTION_TITLES.get(name, f"{name} options"), expanded=True):
            overrides.update(model_widgets(name, model, prefix))
    if "kv" not in sections:
        st.caption("Eviction policies and slot strategies appear here once the engine config has a `kv` section.")

    with st.expander("SLO, seed and other options", expanded=False):
        a, b = st.columns(2)
        overrides["slo.ttft"] = a.text_input("TTFT SLO", value=defaults.slo.ttft or "", key=f"{prefix}slo_ttft") or None
        overrides["slo.tpot"] = b.text_input("TPOT SLO", value=defaults.slo.tpot or "", key=f"{prefix}slo_tpot") or None
        overrides["seed"] = a.number_input("Seed", min_value=0, value=0, key=f"{prefix}seed")
        top = {n: f for n, f in SimConfig.model_fields.items() if n not in _HANDLED and not _is_model(f.annotation)}
        for name, f in top.items():
            value = _field_widget(name, name, f, prefix)
            if value is not None:
                overrides[name] = value
    if error:
        return None, error
    overrides["trace"] = source
    try:
        return load_config(None, overrides), None
    except ConfigError as exc:
        return None, str(exc)


def _index_of(names: list[str], wanted: str) -> int:
    from sim.catalog import get_gpu, get_model

    for getter in (get_model, get_gpu):
        try:
            name = getter(wanted).name
        except Exception:  # not this catalog
            continue
        if name in names:
            return names.index(name)
    return 0


def with_value(cfg: SimConfig, key: str, value) -> SimConfig:
    """A copy of `cfg` with one dotted key changed, validated; ConfigError names key=value."""
    data = cfg.model_dump(mode="json")
    try:
        return load_config(None, {**data, key: value})
    except ConfigError as exc:
        raise ConfigError(f"{key}={value}: {exc}") from None
