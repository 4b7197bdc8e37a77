"""Input widgets that build a validated SimConfig, the same one `kvsim simulate` builds.

Sections of SimConfig the dashboard has no hand-made widgets for (for example a `kv:` section
with an eviction policy and slot strategy) get widgets generated from their pydantic fields, so
new engine options appear here without dashboard changes.
"""
from __future__ import annotations

import hashlib
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import numpy as np
import streamlit as st
from pydantic import BaseModel

from kvsim.sim.config import ConfigError, SimConfig, load_config, registry_choices
from kvsim.traces import DATA_TRACES, TraceError

from .data import DataError, data_root, redact_content, redact_file_text, resolve_user_path
from .guard import confine_overrides, confine_value, upload_name

DEFAULT_MAX_REQUESTS = 100
# One base configuration for every page (its widgets' key prefix): edited once on any page's sidebar,
# simulated on Simulate, varied on Compare, searched on Capacity.
BASE = "cfg_"
BLOCK_SIZES = (8, 16, 32, 64, 128)
# Fields with hand-made widgets below; every other field gets a generated one.
_HANDLED = {"trace", "trace_options", "model", "gpu", "tp", "replicas", "engine", "slo", "seed"}
_HANDLED_ENGINE = {"block_size", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens",
                   "enable_prefix_caching", "enable_chunked_prefill", "preemption_mode", "scheduling_policy"}
_SECTION_TITLES = {"kv": "KV eviction policy and slot strategy"}
# The simulator keeps state per pool block (per (layer, KV head) page in per_head layouts): bound the
# typed pool size so a slip of the keyboard cannot exhaust the server's memory (~25-100 bytes a page).
MAX_POOL_PAGES = 4_000_000
INVALID_FIELDS = "Some fields are invalid; see the message under each."
# Config keys and CLI options as the page names them (messages speak the page's language).
FIELD_LABELS = {
    "trace_options.max_requests": "Max requests", "trace_options.rate_scale": "Arrival-rate scale",
    "trace_options.rate": "Arrival rate", "engine.block_size": "Block size", "engine.num_gpu_blocks": "KV pool",
    "engine.max_num_seqs": "max_num_seqs", "engine.max_num_batched_tokens": "max_num_batched_tokens",
    "engine.enable_prefix_caching": "Prefix caching", "engine.preemption_mode": "Preemption",
    "slo.ttft": "TTFT SLO", "slo.tpot": "TPOT SLO", "tp": "Tensor parallel", "replicas": "Replicas",
    "--max-num-batched-tokens": "max_num_batched_tokens", "--max-num-seqs": "max_num_seqs", "--slo": "SLO", "--max-evals": "Max simulations per GPU", "--store": "Store directory",
}


def gui_message(message: str) -> str:
    """A config/CLI error in the page's words: dotted keys and option flags become field labels."""
    message = message.removeprefix("config: ").replace("Value error, ", "")
    for key in sorted(FIELD_LABELS, key=len, reverse=True):
        message = re.sub(rf"(?<![\w.-]){re.escape(key)}(?![\w-])", FIELD_LABELS[key], message)
    message = re.sub(r"(?<![\w-])--([a-z][\w-]*)", lambda m: m.group(1).replace("-", " "), message)
    message = re.sub(r"(?<![\w.])(?:kv|engine|trace_options|slo)\.(?!params\b)(\w+)", r"\1",   # generated widgets'
                     message)                                   # labels; kv.params.NAME stays as on the CLI
    return re.sub(r"^([^:]+): \1: ", r"\1: ", message)      # "TTFT SLO: TTFT SLO: ..." -> once


def number_field(container, label: str, key: str, value, *, low=None, high=None, integer: bool = True,
                 problems: list | None = None, placeholder: str | None = None, help: str | None = None,
                 low_reason: str | None = None, **_):
    """A number typed as text and parsed by the page (scientific notation and decimals read as such,
    anything else refused with the reason under the field, added to `problems`); returns the number,
    or None when the field is empty and `placeholder` says what empty means."""
    text = container.text_input(label, value=format_number(value), key=key, placeholder=placeholder, help=help)
    number, problem = parse_number(text, integer=integer, optional=placeholder is not None)
    problem = problem or number_problem(number, low, high, optional=placeholder is not None)
    if problem and low_reason and number is not None and low is not None and number < low:
        problem = f"{problem} ({low_reason})"
    if problem:
        container.error(f"{label}: {problem}")
        if problems is not None:
            problems.append(label)
        return None
    return number


def number_problem(value, low=None, high=None, optional: bool = False) -> str | None:
    if value is None:
        return None if optional else "enter a number"
    if low is not None and value < low:
        return f"must be at least {low:,}"
    if high is not None and value > high:
        return f"must be at most {high:,}"
    return None


def format_number(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return f"{value:.1f}"
    return str(value)


def parse_number(text, integer: bool = False, optional: bool = False) -> tuple[float | int | None, str | None]:
    """'1e9' -> 1000000000, '2.5' -> 2.5, '1_000' -> 1000; (None, reason) for 'abc', '2.5' where a
    whole number is needed, inf and nan. Empty: (None, None) when `optional`."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):   # a value set programmatically
        text = repr(text)
    text = (text or "").strip()
    if not text:
        return None, None if optional else "enter a number"
    try:
        value = float(text)
    except ValueError:
        return None, f"{text!r} is not a number (digits, a decimal point, or e.g. 1e9)"
    if not np.isfinite(value):
        return None, f"{text!r} is not a finite number"
    if integer:
        if not value.is_integer():
            return None, f"{text} is not a whole number"
        return int(value), None
    return value, None


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


def field_choices(annotation, key: str | None = None) -> list | None:
    """The finite set of values a field (dotted config `key`) takes (a registry's names, Literal, bool), or None."""
    registered = registry_choices(key) if key else None
    if registered is not None:
        return registered
    inner, optional = _unwrap(annotation)
    if typing.get_origin(inner) is Literal:
        return list(typing.get_args(inner)) + ([None] if optional else [])
    if inner is bool:
        return [False, True]
    return None


def extra_sections() -> dict[str, type[BaseModel]]:
    """SimConfig sub-models the dashboard has no hand-made widgets for (e.g. `kv`)."""
    return {name: _unwrap(f.annotation)[0] for name, f in SimConfig.model_fields.items()
            if name not in _HANDLED and _is_model(f.annotation) and not _off_unless_given(f)}


def _off_unless_given(field) -> bool:
    """An optional section that is off unless given (`kv_offload`, `fleet`, `router_options`): a form of
    its fields would turn it on (half-filled where it has required fields, or changing the run's label
    where it has none), so the dashboard leaves it to config files."""
    return field.default is None


def config_axes(base: SimConfig | None = None) -> dict[str, list | None]:
    """Dotted config keys a comparison can vary -> their choices (None: typed in, numbers; a policy
    parameter's values are read as `--set` reads them). With `base`, its policy's parameters
    (kv.params.NAME, from the policy's declaration) are axes too."""
    axes: dict[str, list | None] = {}

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, f in model.model_fields.items():
            key = f"{prefix}{name}"
            if _is_model(f.annotation):
                walk(_unwrap(f.annotation)[0], f"{key}.")
                continue
            choices = field_choices(f.annotation, key)
            inner, _ = _unwrap(f.annotation)
            if choices is not None:
                axes[key] = choices
            elif inner in (int, float):
                axes[key] = None

    walk(SimConfig, "")
    from kvsim.sim.model.catalog import list_gpus, list_models
    axes["model"] = [m.name for m in list_models()]
    axes["gpu"] = [g.name for g in list_gpus()]
    for skip in ("seed", "check_invariants", "fast_forward", "slo.ttft", "slo.tpot"):
        axes.pop(skip, None)
    if base is not None:
        from kvsim.sim.kv.policy import policy_parameter_specs

        axes.update({f"kv.params.{p.name}": None for p in policy_parameter_specs(base.kv.policy) if p.name != "budget"})
    return dict(sorted(axes.items(), key=lambda kv: (not kv[0].startswith(tuple(extra_sections())), kv[0])))


def parse_axis_values(key: str, text: str) -> list:
    """'8, 16, 32' -> [8, 16, 32] for a numeric config key, each item read as the form's number fields
    read theirs (parse_number: 5e2, 1_000, 2.0 for a whole number); ConfigError names the bad item. A
    policy parameter's items (kv.params.NAME) are read as `--set kv.params.NAME=ITEM` reads its value."""
    if key.startswith("kv.params."):
        from kvsim.sim.config import parse_set_option

        values = [parse_set_option(f"{key}={item.strip()}")[1] for item in text.split(",") if item.strip()]
        if not values:
            raise ConfigError(f"{key}: give at least one value, comma-separated (e.g. 64, 128)")
        return values
    model: type[BaseModel] = SimConfig
    *parents, leaf = key.split(".")
    for p in parents:
        model = _unwrap(model.model_fields[p].annotation)[0]
    inner, _ = _unwrap(model.model_fields[leaf].annotation)
    values = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        number, problem = parse_number(item, integer=inner is int)
        if problem:
            raise ConfigError(f"{key}: {problem}")
        values.append(number)
    if not values:
        raise ConfigError(f"{key}: give at least one value, comma-separated (e.g. 8, 16, 32)")
    return values


def _field_widget(key: str, name: str, f, prefix: str):
    choices = field_choices(f.annotation, key)
    inner, optional = _unwrap(f.annotation)
    help_text = f.description or None
    wkey = f"{prefix}{key}"
    if choices is not None and inner is not bool:
        default = f.default if f.default in choices else choices[0]
        return st.selectbox(name, choices, index=choices.index(default), key=wkey, help=help_text,
                            format_func=lambda v: "(none)" if v is None else str(v))
    if inner is bool and optional:          # null = the engine's default for this GPU / policy
        # named options, not None/True/False: a selectbox whose state is None shows no choice at all
        # ("Choose an option") once the form is restored on another page
        names = {"default": None, "on": True, "off": False}
        default = next(k for k, v in names.items() if v is f.default)
        choice = st.selectbox(name, list(names), index=list(names).index(default), key=wkey, help=help_text)
        return names.get(choice)
    if inner is bool:
        return st.checkbox(name, value=bool(f.default), key=wkey, help=help_text)
    if inner in (int, float):
        default = f.default if isinstance(f.default, (int, float)) else None
        low, high = field_bounds(f)
        problems: list[str] = []
        value = number_field(st, name, wkey, inner(default) if default is not None else None, low=low, high=high,
                             integer=inner is int, problems=problems, help=help_text,
                             placeholder="default" if optional else None)
        if problems:
            raise FieldProblem(name)
        return value
    if inner is str:
        value = st.text_input(name, value="" if f.default is None else str(f.default), key=wkey, help=help_text)
        return value or None
    return None


class FieldProblem(ValueError):
    """A generated widget holds an invalid value (its message is shown under it)."""


def field_bounds(f) -> tuple[float | None, float | None]:
    """The smallest and largest value a pydantic field accepts (Field(gt=, ge=, lt=, le=)); for
    exclusive integer bounds, the nearest integer inside."""
    low = high = None
    for m in f.metadata:
        step = 1 if _unwrap(f.annotation)[0] is int else 0
        if getattr(m, "ge", None) is not None:
            low = m.ge
        if getattr(m, "gt", None) is not None:
            low = m.gt + step if step else m.gt
        if getattr(m, "le", None) is not None:
            high = m.le
        if getattr(m, "lt", None) is not None:
            high = m.lt - step if step else m.lt
    return low, high


def model_widgets(section: str, model: type[BaseModel], prefix: str, skip: set[str] = frozenset(),
                  problems: list | None = None) -> dict:
    """Generated widgets for a pydantic section -> dotted overrides; invalid numbers go to `problems`."""
    out = {}
    for name, f in model.model_fields.items():
        if name in skip or _is_model(f.annotation):
            continue
        try:
            value = _field_widget(f"{section}.{name}", name, f, prefix)
        except FieldProblem:
            if problems is not None:
                problems.append(name)
            continue
        if value is not None:
            out[f"{section}.{name}"] = value
    return out


# ---- trace source ------------------------------------------------------------------------------
def _save_upload(upload) -> Path:
    """Keep an uploaded trace on disk for the loaders (one copy per distinct content)."""
    data = upload.getvalue()
    digest = hashlib.sha256(data).hexdigest()[:16]
    root = data_root() / "uploads" / digest
    root.mkdir(parents=True, exist_ok=True)
    path = root / upload_name(upload.name)
    if not path.exists():
        from kvsim.sim.io.safe_io import atomic_output

        with atomic_output(path) as tmp:
            tmp.write_bytes(data)
    return path


@st.cache_data(show_spinner=False, max_entries=32)
def _trace_info(source: str, mtime: float) -> tuple[str, dict]:
    from kvsim.traces import load_trace
    from kvsim.traces.loaders import detect_format, resolve_trace_path
    from kvsim.traces.stats import trace_stats

    path, _ = resolve_trace_path(source)
    return detect_format(path), trace_stats(load_trace(source))


def trace_info(source: str) -> tuple[str, dict]:
    """(format, stats) of a trace; raises TraceError with the loader's message."""
    from kvsim.traces.loaders import resolve_trace_path

    path, _ = resolve_trace_path(source)
    return _trace_info(source, path.stat().st_mtime)


def trace_input(prefix: str, problems: list) -> tuple[str | None, dict, str | None]:
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
        text = st.text_input(f"Trace file path (under {data_root()})", key=f"{prefix}trace_path").strip()
        if not text:
            return None, {}, "enter the path of a trace file"
        try:
            source, shown = str(resolve_user_path(text)), text
        except DataError as exc:
            return None, {}, str(exc)
    try:
        fmt, stats = trace_info(source)
    except TraceError as exc:   # name the file as the user did, not our copy; never show its content
        return None, {}, redact_content(str(exc).replace(source, shown or source))
    except OSError as exc:
        return None, {}, f"{shown or source}: {exc.strerror or 'cannot be read'}"
    st.caption(f"{fmt} format, {stats['requests']:,} requests over {stats['span_s']:.0f} s; prompt p50 "
               f"{stats['prompt_p50']:.0f}, output p50 {stats['output_p50']:.0f} tokens")
    opts = {}
    if fmt == "lengths":
        rate = number_field(st, "Arrival rate (req/s) for this length-only trace; 0 = all at t=0", f"{prefix}rate",
                            0.0, low=0.0, integer=False, problems=problems)
        opts["trace_options.rate"] = rate or None
    return source, opts, None


# ---- the whole config --------------------------------------------------------------------------
def config_form(prefix: str, max_requests: int = DEFAULT_MAX_REQUESTS) -> tuple[SimConfig | None, str | None]:
    """Widgets for one simulation -> (validated SimConfig, None) or (None, readable error). A number
    out of range shows its message under its field and blocks the run."""
    restore_form(prefix)
    problems: list[str] = []
    source, overrides, error = trace_input(prefix, problems)
    _workload_fields(prefix, max_requests, overrides, problems)
    _hardware_fields(prefix, overrides, problems)
    with st.expander("Engine", expanded=False):
        _engine_fields(prefix, overrides, problems)
    sections = extra_sections()
    for name, model in sections.items():
        with st.expander(_SECTION_TITLES.get(name, f"{name} options"), expanded=True):
            overrides.update(model_widgets(name, model, prefix, problems=problems))
            if name == "kv":
                overrides.update(policy_param_widgets(prefix, overrides.get("kv.policy"), problems))
    with st.expander("SLO, seed and other options", expanded=False):
        _other_fields(prefix, overrides, problems)
    _check_pool_size(overrides, problems)
    _check_cross_fields(overrides, problems)
    remember_form(prefix)
    if error or problems:
        return None, error or INVALID_FIELDS
    overrides["trace"] = source
    try:
        cfg = load_config(None, confine_overrides(overrides))
    except (ConfigError, DataError) as exc:
        return None, gui_message(str(exc))
    problem = engine_problem(cfg) or policy_problem(cfg) or pool_problem(cfg) or length_problem(cfg)
    if problem:
        return None, problem
    rejected, total, _ = rejected_by_length(cfg)
    if rejected:
        st.warning(f"max_model_len: {rejected:,} of the {total:,} requests have prompts that leave no room for output "
                   f"within {cfg.engine.max_model_len:,} tokens; the engine will reject them (rejected requests are "
                   "in no latency figure)")
    return cfg, None


# ---- the policy's own parameters (kv.params) ---------------------------------------------------
def policy_param_widgets(prefix: str, policy: str | None, problems: list) -> dict:
    """A text field per parameter the selected policy's constructor declares (budget aside: it is
    kv.budget), read as `--set kv.params.NAME=VALUE` reads its value (YAML: 8, 0.5, true, a word);
    empty = the policy's default, not written. -> {'kv.params.NAME': value} of the fields filled in."""
    from kvsim.sim.kv.policy import PolicyError, policy_parameter_specs

    try:
        specs = [p for p in policy_parameter_specs(policy or "") if p.name != "budget"]
    except PolicyError:           # a broken plug-in: the config check reports it
        return {}
    if not specs:
        return {}
    st.caption(f"Parameters of {policy} (kv.params; empty: the policy's default)")
    out = {}
    for spec in specs:
        key = f"kv.params.{spec.name}"
        text = st.text_input(spec.name, key=f"{prefix}{key}@{policy}", placeholder=_param_placeholder(spec),
                             help=_param_help(spec)).strip()
        if not text:
            continue
        try:
            value = _param_value(key, text, spec.is_file)
        except (ConfigError, DataError) as exc:
            st.error(f"{spec.name}: {exc}")
            problems.append(spec.name)
            continue
        out[key] = value
    return out


def _param_value(key: str, text: str, is_file: bool):
    """The value `--set key=text` gives; a file parameter's path confined to the data root."""
    from kvsim.sim.config import parse_set_option

    _, value = parse_set_option(f"{key}={text}")
    return confine_value(key, value, always_path=True) if is_file and isinstance(value, str) else value


def _param_placeholder(spec) -> str:
    if spec.required:
        return "required"
    return "default: none" if spec.default is None else f"default: {spec.default}"


def _param_help(spec) -> str:
    kind = f" ({spec.annotation})" if spec.annotation else ""
    default = "required" if spec.required else f"default {spec.default!r}" if spec.default is not None else "no default"
    where = f" A path under the data directory {data_root()}." if spec.is_file else ""
    head = f"{spec.help}. " if spec.help else ""
    return f"{head}kv.params.{spec.name}{kind}, {default}; the CLI's --set kv.params.{spec.name}=VALUE.{where}"


def policy_problem(cfg: SimConfig) -> str | None:
    """The command line's check of the KV policy before a run: its parameters (the policy is built)
    and options it would ignore, with the CLI's message; text read from a parameter's file is not shown."""
    from kvsim.sim.cli.simulate import refuse_ineffective_kv

    try:
        refuse_ineffective_kv(cfg.kv)           # the command line's check, with its messages
    except (ConfigError, ValueError) as exc:
        return redact_file_text(str(exc), policy_files(cfg))
    return None


def policy_files(cfg: SimConfig) -> list[str]:
    """The paths the run's policy parameters name (its file parameters' values)."""
    from kvsim.sim.kv.policy import PolicyError, policy_parameter_specs

    try:
        specs = policy_parameter_specs(cfg.kv.policy)
    except PolicyError:
        return []
    paths = [str(cfg.kv.params[p.name]) for p in specs if p.is_file and isinstance(cfg.kv.params.get(p.name), str)]
    return paths + [str(Path(p).parent) for p in paths]      # a loader may name a file beside the one given


_NOT_RESTORED = ("trace_upload", "run", "pick", "label", "_x", "_y", "_group")   # uploads, buttons, page widgets


def remember_form(prefix: str) -> None:
    """Keep the form's values and the page that drew them, so that they survive a visit to another
    page (Streamlit drops the state of widgets a page run did not draw)."""
    st.session_state[f"_form_{prefix}"] = {
        k: v for k, v in st.session_state.items() if isinstance(k, str) and k.startswith(prefix)
        and not k.endswith(_NOT_RESTORED) and isinstance(v, (str, int, float, bool, type(None)))}
    st.session_state[f"_form_page_{prefix}"] = _page()


def restore_form(prefix: str) -> None:
    """Put back the remembered values. On the page that drew them, a key still set is the user's
    latest edit; on another page it is the previous page's widget, which the same key on this page
    does not take over (its widget id includes the page), so the remembered value is written."""
    switched = st.session_state.get(f"_form_page_{prefix}") != _page()
    for key, value in st.session_state.get(f"_form_{prefix}", {}).items():
        if switched or key not in st.session_state:
            st.session_state[key] = value


def _page() -> str:
    from streamlit.runtime.scriptrunner import get_script_run_ctx

    ctx = get_script_run_ctx()
    return ctx.page_script_hash if ctx is not None else ""


def _workload_fields(prefix: str, max_requests: int, overrides: dict, problems: list) -> None:
    c1, c2 = st.columns(2)
    overrides["trace_options.max_requests"] = number_field(
        c1, "Max requests (first N)", f"{prefix}max_requests", max_requests, low=1, step=50, problems=problems)
    overrides["trace_options.rate_scale"] = number_field(
        c2, "Arrival-rate scale", f"{prefix}rate_scale", 1.0, low=0.01, integer=False, step=0.25, problems=problems,
        help="2 = requests arrive twice as fast")


def _hardware_fields(prefix: str, overrides: dict, problems: list) -> None:
    from kvsim.sim.model.catalog import list_gpus, list_models

    defaults = SimConfig()
    models = [m.name for m in list_models()]
    gpus = [g.name for g in list_gpus() if g.kind == "gpu"] + [g.name for g in list_gpus() if g.kind != "gpu"]
    overrides["model"] = st.selectbox("Model", models, index=_index_of(models, defaults.model), key=f"{prefix}model")
    overrides["gpu"] = st.selectbox("GPU", gpus, index=_index_of(gpus, defaults.gpu), key=f"{prefix}gpu")
    c1, c2 = st.columns(2)
    overrides["tp"] = number_field(c1, "Tensor parallel", f"{prefix}tp", 1, low=1, high=64, problems=problems)
    overrides["replicas"] = number_field(c2, "Replicas", f"{prefix}replicas", 1, low=1, high=64, problems=problems)


def _engine_fields(prefix: str, overrides: dict, problems: list) -> None:
    e = SimConfig().engine
    a, b = st.columns(2)
    overrides["engine.block_size"] = a.selectbox("Block size (tokens)", BLOCK_SIZES,
                                                 index=BLOCK_SIZES.index(e.block_size), key=f"{prefix}block_size")
    overrides["engine.num_gpu_blocks"] = number_field(
        b, "KV pool (blocks)", f"{prefix}num_gpu_blocks", None, low=2, high=MAX_POOL_PAGES, problems=problems,
        low_reason="one block is vLLM's reserved null block",
        placeholder="from GPU memory",
        help=f"empty: sized from GPU memory, weights and activations like vLLM. At most {MAX_POOL_PAGES:,} pool "
             "pages: blocks, or blocks x layers x KV heads with the per_head layout")
    # full width: in half the sidebar these one-word labels break mid-word ("max_num_se qs")
    overrides["engine.max_num_seqs"] = number_field(
        st, "max_num_seqs", f"{prefix}max_num_seqs", e.max_num_seqs, low=1, high=65_536, problems=problems,
        placeholder="vLLM default", help="empty: vLLM's default for the GPU and entry point")
    overrides["engine.max_num_batched_tokens"] = number_field(
        st, "max_num_batched_tokens", f"{prefix}max_batched", e.max_num_batched_tokens, low=1, high=1_048_576,
        problems=problems, placeholder="vLLM default", help="empty: vLLM's default for the GPU and entry point")
    overrides["engine.enable_prefix_caching"] = _field_widget(
        "engine.enable_prefix_caching", "Prefix caching", type(e).model_fields["enable_prefix_caching"], prefix)
    overrides["engine.enable_chunked_prefill"] = b.checkbox("Chunked prefill", value=e.enable_chunked_prefill,
                                                            key=f"{prefix}chunked")
    overrides["engine.preemption_mode"] = a.selectbox("Preemption", ["recompute", "swap"], key=f"{prefix}preempt")
    overrides["engine.scheduling_policy"] = b.selectbox("Scheduling", ["fcfs", "priority"], key=f"{prefix}sched")
    st.caption("More engine options")
    overrides.update(model_widgets("engine", type(e), prefix, skip=_HANDLED_ENGINE, problems=problems))


def _other_fields(prefix: str, overrides: dict, problems: list) -> None:
    defaults = SimConfig()
    a, b = st.columns(2)
    for col, name, key in ((a, "TTFT SLO", "ttft"), (b, "TPOT SLO", "tpot")):
        text = col.text_input(name, value=getattr(defaults.slo, key) or "", key=f"{prefix}slo_{key}").strip()
        problem = duration_problem(text)
        if problem:
            col.error(f"{name}: {problem}")
            problems.append(name)
        overrides[f"slo.{key}"] = text or None
    overrides["seed"] = number_field(a, "Seed", f"{prefix}seed", 0, low=0, high=MAX_SEED, problems=problems)
    top = {n: f for n, f in SimConfig.model_fields.items() if n not in _HANDLED and not _is_model(f.annotation)}
    for name, f in top.items():
        try:
            value = _field_widget(name, name, f, prefix)
        except FieldProblem:
            problems.append(name)
            continue
        if value is not None:
            overrides[name] = value


MAX_SEED = 2**63 - 1           # the config's bound (a 64-bit signed integer)


def duration_problem(text: str) -> str | None:
    """Why an SLO duration the config would refuse is wrong, in words a user can act on (a negative
    or zero limit is not 'a duration without a unit'); None when it parses or is empty."""
    from kvsim.sim.config import parse_duration

    if not text:
        return None
    try:
        value = parse_duration(text, "SLO")
    except (ConfigError, ValueError):
        if text.lstrip().startswith("-"):
            return f"{text} is negative; expected a positive duration such as 2s, 200ms or 500us"
        return f"{text} is not a duration with a unit; expected e.g. 2s, 200ms or 500us (a bare number is ambiguous)"
    return None if value > 0 else f"{text} is zero; expected a positive duration such as 2s or 200ms"


def pool_rows(overrides: dict) -> int:
    """Pool pages per block: layers x KV heads per GPU with the per_head layout, else 1."""
    if overrides.get("kv.layout") != "per_head":
        return 1
    from kvsim.sim.model.catalog import get_model

    try:
        model = get_model(overrides["model"])
    except Exception:  # an unknown model is reported by the config check
        return 1
    return model.num_layers * max(1, model.num_kv_heads // int(overrides.get("tp") or 1))   # as kv_heads_per_gpu


def _check_pool_size(overrides: dict, problems: list) -> None:
    blocks = overrides.get("engine.num_gpu_blocks")
    rows = pool_rows(overrides)
    if blocks is not None and blocks * rows > MAX_POOL_PAGES and "KV pool (blocks)" not in problems:
        st.error(f"KV pool (blocks): at most {MAX_POOL_PAGES // rows:,} blocks for this model and "
                         f"layout ({rows} per-(layer, head) pages per block; the simulator keeps state per page)"
                         if rows > 1 else f"KV pool (blocks): must be at most {MAX_POOL_PAGES:,}")
        problems.append("KV pool (blocks)")


def _check_cross_fields(overrides: dict, problems: list) -> None:
    """Tensor parallelism against the model's heads, checked before Run (the KV pool against the GPU's
    memory: pool_problem, once the config is built)."""
    from kvsim.sim.model.catalog import get_model
    from kvsim.sim.model.cost_model import check_tp

    try:
        model = get_model(overrides["model"])
    except Exception:  # the config check names an unknown model or GPU
        return
    tp = overrides.get("tp")
    if tp is None:
        return
    try:
        check_tp(model, tp)
    except ValueError:
        fits = [t for t in (1, 2, 4, 8, 16, 32, 64) if t <= 64 and _tp_fits(model, t)]
        st.error(f"Tensor parallel: {tp} does not split {model.name}'s {model.num_heads} attention heads and "
                 f"{model.num_kv_heads} KV heads evenly across GPUs; use one of {', '.join(map(str, fits))}")
        problems.append("Tensor parallel")
        return


def engine_problem(cfg: SimConfig) -> str | None:
    """The engine limits as the simulator resolves them for this GPU (vLLM's defaults filled in), with
    the simulator's message when they contradict each other (max_num_batched_tokens below max_num_seqs)."""
    from kvsim.sim.model.defaults import resolve_engine

    try:
        resolve_engine(cfg)
    except ConfigError as exc:
        return gui_message(str(exc))
    except (ValueError, KeyError):   # an unknown model or GPU: the config check names it
        return None
    return None


@st.cache_data(show_spinner=False, max_entries=16)
def _prompt_lengths(trace: str, mtime: float, max_requests: int | None) -> np.ndarray:
    from kvsim.traces import load_trace

    df = load_trace(trace).df
    return df["prompt_tokens"].to_numpy()[:max_requests] if max_requests else df["prompt_tokens"].to_numpy()


def length_problem(cfg: SimConfig) -> str | None:
    """A max_model_len that leaves no room for any request's output: the scheduler would reject every
    request of the workload (prompt + 1 token above max_model_len, as sim/core/scheduler.py decides).
    Some rejected: allowed (a user may mean it), and said under the form (length_note)."""
    rejected, total, shortest = rejected_by_length(cfg)
    if total and rejected == total:
        return (f"max_model_len: {cfg.engine.max_model_len:,} leaves no room for output in any of the {total:,} "
                f"requests (the shortest prompt is {shortest:,} tokens): the engine would reject every one; "
                f"raise it above {shortest:,} or leave it empty (the model's length)")
    return None


def rejected_by_length(cfg: SimConfig) -> tuple[int, int, int]:
    """(requests whose prompt leaves no room for output within engine.max_model_len, requests, the
    shortest prompt) of the workload's first max_requests; (0, 0, 0) without a max_model_len or when
    the trace cannot be read here (the run reports it)."""
    limit = cfg.engine.max_model_len
    if limit is None:
        return 0, 0, 0
    from kvsim.traces.loaders import resolve_trace_path

    try:
        path, _ = resolve_trace_path(cfg.trace)
        prompts = _prompt_lengths(cfg.trace, path.stat().st_mtime, cfg.trace_options.max_requests)
    except Exception:  # noqa: BLE001 - any loader error is the run's to report, with its message
        return 0, 0, 0
    if not len(prompts):
        return 0, 0, 0
    return int((prompts + 1 > limit).sum()), len(prompts), int(prompts.min())


def pool_problem(cfg: SimConfig) -> str | None:
    """A typed KV pool larger than the GPU's memory holds after weights and activations (sized as
    the simulator sizes it, with the engine defaults resolved for this GPU), or None."""
    from kvsim.sim.model.catalog import get_gpu, get_model
    from kvsim.sim.model.defaults import resolve_engine
    from kvsim.sim.model.memory import ModelDoesNotFitError, PoolSizing, num_gpu_blocks

    blocks = cfg.engine.num_gpu_blocks
    if blocks is None:
        return None
    try:
        eng = resolve_engine(cfg)
        model, gpu = get_model(cfg.model), get_gpu(cfg.gpu)
        if cfg.kv_dtype or cfg.weight_dtype:
            model = model.with_dtypes(kv_dtype=cfg.kv_dtype, weight_dtype=cfg.weight_dtype)
        size = num_gpu_blocks(model, gpu, PoolSizing.of_engine(eng, tp=cfg.tp))
    except ModelDoesNotFitError as exc:
        return f"GPU: {exc}"
    except (ValueError, KeyError):   # the simulator's own checks report these
        return None
    if blocks <= size.num_blocks:
        return None
    return (f"KV pool (blocks): {blocks:,} blocks do not fit in {gpu.name}'s memory with {model.name} (tp={cfg.tp}): "
            f"at most {size.num_blocks:,} blocks remain after weights and activations at gpu_memory_utilization "
            f"{eng.gpu_memory_utilization:g}; leave it empty to size the pool like vLLM")


def _tp_fits(model, tp: int) -> bool:
    from kvsim.sim.model.cost_model import check_tp
    try:
        check_tp(model, tp)
        return True
    except ValueError:
        return False


def _index_of(names: list[str], wanted: str) -> int:
    from kvsim.sim.model.catalog import get_gpu, get_model

    for getter in (get_model, get_gpu):
        try:
            name = getter(wanted).name
        except Exception:  # not this catalog
            continue
        if name in names:
            return names.index(name)
    return 0


def label_for(cfg: SimConfig) -> str:
    """'sharegpt-8k-filtered Llama-3.1-8B L4: kv.policy=h2o, kv.budget=128': what it ran and what
    differs from the default configuration (the trace, model and GPU named first). A label already
    taken gets a counter when the run is saved (data.new_run_dir)."""
    from kvsim.dashboard.data import config_diff

    diff = config_diff(cfg.model_dump(mode="json"), SimConfig().model_dump(mode="json"))
    for k in ("trace", "model", "gpu"):
        diff.pop(k, None)
    head = f"{Path(cfg.trace).name} {cfg.model} {cfg.gpu}"
    rest = ", ".join(f"{k.removeprefix('trace_options.').removeprefix('engine.')}={v}" for k, v in diff.items())
    return f"{head}: {rest}"[:120] if rest else head


def for_policy(data: dict, policy: str) -> dict:
    """The config `data` (model_dump) with its KV options made to fit `policy` when a comparison
    varies kv.policy: the base's budget and parameters belong to the base's policy, so a policy that
    takes no budget (`none`, the baseline) runs without it, a parameter the policy does not declare is
    dropped, and the baseline keeps no slot strategy or fast mode (nothing is evicted)."""
    from kvsim.sim.config import KVConfig
    from kvsim.sim.kv.policy import PolicyError, policy_parameter_specs

    try:
        accepted = {p.name for p in policy_parameter_specs(policy)} if policy != "none" else set()
    except PolicyError:          # an unknown policy: the config check names it
        return data
    kv = dict(data.get("kv") or {})
    if "budget" not in accepted:
        kv["budget"] = None
    kv["params"] = {k: v for k, v in (kv.get("params") or {}).items() if k in accepted}
    if policy == "none":
        for name in ("slot_strategy", "mode"):
            kv[name] = KVConfig.model_fields[name].default
    return {**data, "kv": kv}


def with_value(cfg: SimConfig, key: str, value) -> SimConfig:
    """A copy of `cfg` with one dotted key changed, validated; ConfigError names key=value. Varying
    kv.policy fits the base's KV options to each policy (for_policy)."""
    from .guard import policy_file_keys

    data = cfg.model_dump(mode="json")
    if key == "kv.policy":
        data = for_policy(data, str(value))
    try:
        changed = load_config(None, {**data, key: confine_value(key, value,
                                                               always_path=key in policy_file_keys(cfg.kv.policy))})
    except (ConfigError, DataError) as exc:
        raise ConfigError(f"{key}={value}: {str(exc).removeprefix('config: ')}") from None
    problem = policy_problem(changed) if key.startswith("kv.") else None
    if problem:
        raise ConfigError(f"{key}={value}: {problem}")
    return changed
