"""What a dashboard page may make the server read or run.

- Path fields (trace, model, gpu, profile, kv.importance, and the KV policy's file parameters:
  kv.params.path and any other its constructor names `*_path`, `*_file`, `*_dir`) hold either a shipped name
  or a path; a path is resolved against the data root and refused when it leads outside it
  (`..`, absolute paths, symbolic links out), before anything reads it. A name is a plain word
  (letters, digits, `.`, `_`, `-`, `+`) that is not also a file in the server's directory.
- Every run a page queues passes the limits of the form (pool pages, replicas, tensor parallel,
  batch sizes) and the command line's host-memory estimate (`sim.engine.run_plan.check_config_memory`),
  whichever way it was built (the form, a Compare axis, a capacity search).
- Uploaded file names are reduced to a safe base name.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from kvsim.sim.config import ConfigError, SimConfig

from .data import DataError, redact_content, redact_file_text, resolve_user_path

PATH_KEYS = ("trace", "model", "gpu", "profile", "kv.importance", "kv.params.path")
MAX_POOL_PAGES = 4_000_000          # the form's KV pool bound (pages of per-head layouts count each)
MAX_RUNS_PER_JOB = 64               # one Compare job; a capacity search has its own max_evals bound
LIMITS = {"replicas": 64, "tp": 64, "engine.max_num_seqs": 65_536, "engine.max_num_batched_tokens": 1_048_576,
          "trace_options.max_requests": 1_000_000}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
_FILE_SUFFIXES = (".yaml", ".yml", ".json", ".jsonl", ".csv", ".parquet")
MAX_UPLOAD_NAME = 100


def _is_name(text: str) -> bool:
    """A shipped name rather than a path (a name-like word that is a file in the cwd is a path)."""
    word = text.partition("#")[0]
    return (bool(_NAME.fullmatch(word)) and not word.lower().endswith(_FILE_SUFFIXES)
            and not Path(word).exists())


def confine_value(key: str, value: Any, *, always_path: bool = False) -> Any:
    """`value` of path field `key` as the server may read it: a name unchanged, a path resolved under
    the data root (DataError naming the field when it leads outside). `always_path`: the field takes
    no names (a policy's file parameter), so a plain word is a path too."""
    if not isinstance(value, (str, Path)) or (not always_path and _is_name(str(value))):
        return value
    text = str(value)
    file_part, sep, entry = text.partition("#") if key in ("model", "gpu") else (text, "", "")
    if "\x00" in file_part:
        raise DataError(f"{key}: the path holds a NUL character")
    try:
        resolved = resolve_user_path(file_part)
    except DataError as exc:
        raise DataError(f"{key}: {exc}") from None
    _refuse_special_file(key, file_part, resolved)
    return f"{resolved}{sep}{entry}"


def _refuse_special_file(key: str, shown: str, path: Path) -> None:
    """A named pipe, device or socket in the data root is refused as the field is filled in: reading one
    would hang the job or never end (a missing file is reported by the run, a directory may be a model's)."""
    import os
    import stat

    from kvsim.sim.io.safe_io import file_kind

    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise DataError(f"{key}: {shown} is {file_kind(mode)}; expected a regular file")


def policy_file_keys(policy: Any) -> tuple[str, ...]:
    """kv.params.NAME of each file parameter of `policy` (PolicyParameter.is_file), kv.params.path always."""
    from kvsim.sim.kv.policy import PolicyError, policy_parameter_specs

    try:
        specs = policy_parameter_specs(policy) if isinstance(policy, str) else []
    except PolicyError:          # a broken plug-in: the config check reports it
        specs = []
    return tuple(dict.fromkeys(["kv.params.path", *(f"kv.params.{p.name}" for p in specs if p.is_file)]))


def path_keys(policy: Any) -> tuple[str, ...]:
    """Every config key of a run of `policy` whose value may name a file the server reads."""
    return tuple(dict.fromkeys(PATH_KEYS + policy_file_keys(policy)))


def confine_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """Dotted overrides with every path field confined to the data root (see confine_value)."""
    out = dict(overrides)
    policy = out.get("kv.policy", (out.get("kv") or {}).get("policy") if isinstance(out.get("kv"), dict) else None)
    files = policy_file_keys(policy)
    for key in path_keys(policy):
        if out.get(key) is not None:
            out[key] = confine_value(key, out[key], always_path=key in files)
    params = out.get("kv.params")
    if isinstance(params, dict):
        out["kv.params"] = {name: confine_value(f"kv.params.{name}", value, always_path=True)
                            if f"kv.params.{name}" in files and value is not None else value
                            for name, value in params.items()}
    return out


def _config_value(cfg: SimConfig, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else getattr(node, part, None)
    return node


def check_run(cfg: SimConfig, label: str = "") -> None:
    """Refuse a run a page is about to queue: a path field outside the data root, a value beyond the
    form's limits, or a host-memory estimate that does not fit (ConfigError naming the field)."""
    where = f"{label}: " if label else ""
    for key, value, file_only in _file_fields(cfg):
        try:
            if confine_value(key, value, always_path=file_only) != str(value):
                raise DataError(f"{key}: {value}: give a path under the data root")
        except DataError as exc:
            raise ConfigError(f"{where}{exc}") from None
    for key, high in LIMITS.items():
        value = _config_value(cfg, key)
        if value is not None and value > high:
            raise ConfigError(f"{where}{key}: at most {high:,} on the dashboard, got {value:,}")
    blocks = cfg.engine.num_gpu_blocks
    if blocks is not None:
        from kvsim.sim.model.catalog import get_model
        from kvsim.sim.model.cost_model import kv_heads_per_gpu

        rows = 1
        if cfg.kv.layout == "per_head":
            model = get_model(cfg.model)
            rows = model.num_layers * kv_heads_per_gpu(model, cfg.tp)
        if blocks * rows > MAX_POOL_PAGES:
            raise ConfigError(f"{where}engine.num_gpu_blocks: at most {MAX_POOL_PAGES // rows:,} blocks on the "
                              f"dashboard ({MAX_POOL_PAGES:,} pool pages), got {blocks:,}")
    from kvsim.sim.engine.run_plan import check_config_memory

    try:
        check_config_memory(cfg)
    except ValueError as exc:   # it reads no trace; only a user's model, GPU, profile or KV file can be quoted
        raise ConfigError(f"{where}{shown_error(cfg, str(exc), skip=('trace',))}") from None


def _file_fields(cfg: SimConfig, skip: tuple[str, ...] = ()) -> list[tuple[str, Any, bool]]:
    """(key, value, takes no names) of each field of a run of `cfg` whose value names a file, not a
    shipped name: trace, model, GPU, profile, KV importance, the policy's file parameters."""
    files = policy_file_keys(cfg.kv.policy)
    out = []
    for key in path_keys(cfg.kv.policy):
        value = _config_value(cfg, key)
        if key not in skip and value is not None and (key in files or not _is_name(str(value))):
            out.append((key, value, key in files))
    return out


def user_files(cfg: SimConfig, skip: tuple[str, ...] = ()) -> list[str]:
    """The files (not shipped names) a run of `cfg` reads (see _file_fields)."""
    return [str(value) for _, value, _ in _file_fields(cfg, skip)]


def shown_error(cfg: SimConfig, message: str, skip: tuple[str, ...] = ()) -> str:
    """An error of a run of `cfg` as a page may show it: when the run reads a user's file, without the
    quoted values, lists and header columns a loader may have copied from it (data.redact_content): after
    the file's name when the message names it (what precedes is the page's or the CLI's own text), else all."""
    files = user_files(cfg, skip)
    if not files:
        return message
    if any(f in message for f in files):
        return redact_file_text(message, files)
    return redact_content(message)


def check_runs(runs: list[tuple[str, SimConfig]]) -> None:
    """check_run for each (label, config) of a job, and the job's size."""
    if len(runs) > MAX_RUNS_PER_JOB:
        raise ConfigError(f"{len(runs)} simulations in one job; at most {MAX_RUNS_PER_JOB} on the dashboard")
    for label, cfg in runs:
        check_run(cfg, label if len(runs) > 1 else "")


def upload_name(name: str) -> str:
    """An uploaded file's name as stored: its base name, printable characters only, at most
    MAX_UPLOAD_NAME characters (keeping the suffix), never empty or a dot name."""
    base = re.sub(r"[^\w.+-]", "_", Path(str(name).replace("\x00", "").replace("\\", "/")).name)
    base = base.lstrip(".") or "upload"
    if len(base) > MAX_UPLOAD_NAME:
        suffix = Path(base).suffix[:16]
        base = base[:MAX_UPLOAD_NAME - len(suffix)] + suffix
    return base
