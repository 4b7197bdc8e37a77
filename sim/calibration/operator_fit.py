"""Fit a GPU's hardware profile from per-operator kernel timings (Vidur's profiling tables).

Input: a directory laid out as Vidur's `data/profiling` (`compute/<gpu>/<org>/<model>/mlp.csv`,
optionally `attention*.csv` beside it, and `network/<gpu>_dgx/all_reduce.csv`); kvsim ships the
A100-80GB, H100 and A40 tables (median columns) in `sim/data/gpu-operators/vidur/` under Vidur's MIT
licence. Each row is one transformer layer's operators at `num_tokens` rows and a TP degree, GPU
kernel time only.

Every row becomes the cost model's own quantities through a one-layer `ModelSpec` of the profiled
shape, so what is fitted is exactly what `CostModel` multiplies (docs/gpu-profiles.md):

- matmuls (QKV, O, gate/up, down; 4 kernels): on rows of at most 8 tokens, time = 4 * gemm_latency_s
  + weight bytes / (peak bandwidth * mem_bw_eff) by least squares; then at each token count the
  compute efficiency that explains the compute-bound rows (median over models and TP degrees),
  tabulated on a geometric grid of token counts (`gemm_efficiency`);
- norms, RoPE, activation, residual add: time = latency + bytes / (peak bandwidth * elementwise_bw_eff);
- attention (where measured): decode time = latency + KV bytes / (bandwidth * attn_bw_eff); prefill
  time = latency + FLOPs / (peak * attn_compute_eff); the decode latency joins the elementwise one in
  `layer_latency_s`. A GPU without attention rows takes these from a reference GPU's fit (named in
  the profile's meta);
- all-reduce per TP degree (single-node rows): latency = median time of messages <= 64 KiB; bw_eff =
  median bus bandwidth of messages >= 16 MiB over the catalog's link bandwidth.

Errors are measured on rows the fit did not see: `holdout` leaves one model out of the fit, and the
report gives per-operator and per-step (a layer's sum, i.e. a step's model time / layers) errors on
its rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from kvsim.sim.calibration.errors import CalibrationError
from kvsim.sim.model.catalog import DATA_DIR, GPUSpec, ModelSpec, get_gpu
from kvsim.sim.core.step import BatchShape
from kvsim.sim.model.cost_model import AllReduceTerms, CostModel, GemmEfficiency, HardwareProfile, load_profile

SHIPPED_OPERATORS = DATA_DIR / "gpu-operators" / "vidur"
LINEAR_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
ELEMENTWISE_OPS = ("input_layernorm", "post_attention_layernorm", "attn_rope", "mlp_act", "add")
SMALL_M = 8                      # rows of at most this many tokens fit the weight-streaming terms
COMPUTE_MARGIN = 1.02           # a row is compute-bound when it takes this much over its streaming time
MIN_COMPUTE_TOKENS = 32         # below, matmul rows are weight-streaming and latency bound on every profiled GPU
TOKEN_GRID = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
SMALL_MESSAGE, LARGE_MESSAGE = 64 * 1024, 16 * 1024 * 1024
# Vidur's directory names -> catalog GPUs
VIDUR_GPUS = {"a100": "A100-80GB", "h100": "H100-SXM", "a40": "A40"}


@dataclass(frozen=True)
class OperatorTables:
    """One GPU's operator timings (seconds), one row per (model, TP degree, token count)."""
    gpu: GPUSpec
    layers: pd.DataFrame               # model, tp, num_tokens, shape columns, linear_s, elementwise_s
    attention: pd.DataFrame | None     # batch_size, prefill_chunk_size, kv_cache_size, is_prefill, shape, time_s
    allreduce: pd.DataFrame | None     # num_workers, size (bytes), time_s
    source: str


@dataclass
class OperatorFit:
    profile: HardwareProfile
    errors: dict[str, dict[str, float]]           # operator group / "step" -> count, mape, p90_ape, max_ape, bias
    holdout: str | None
    models: list[str] = field(default_factory=list)   # models the fit saw

    def table(self) -> str:
        lines = [f"{'rows':<22} {'count':>6} {'MAPE':>7} {'p90':>7} {'max':>7} {'bias':>7}"]
        for kind, e in self.errors.items():
            lines.append(f"{kind:<22} {e['count']:>6d} {e['mape']:>6.1%} {e['p90_ape']:>6.1%} "
                         f"{e['max_ape']:>6.1%} {e['bias']:>+6.1%}")
        return "\n".join(lines)


# ---- loading ------------------------------------------------------------------------------------
def _median_ms(df: pd.DataFrame, op: str) -> pd.Series:
    column = f"time_stats.{op}.median"
    return df[column] if column in df.columns else pd.Series(0.0, index=df.index)


def _read_csv(path: Path) -> pd.DataFrame:
    try:
        return pd.read_csv(path)
    except (OSError, ValueError) as exc:
        raise CalibrationError(f"{path}: cannot read an operator table ({exc})") from exc


def _require(df: pd.DataFrame, path: Path, columns: tuple[str, ...]) -> None:
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise CalibrationError(f"{path}: missing column(s) {', '.join(missing)} (expected Vidur's profiling format)")


def _gpu_dir(root: Path, gpu: str) -> tuple[str, GPUSpec]:
    spec = get_gpu(gpu)
    for name, catalog in VIDUR_GPUS.items():
        if get_gpu(catalog).name == spec.name and (root / "compute" / name).is_dir():
            return name, spec
    if (root / "compute" / gpu.lower()).is_dir():
        return gpu.lower(), spec
    available = sorted(p.name for p in (root / "compute").glob("*") if p.is_dir())
    raise CalibrationError(f"{root}: no compute/<gpu> folder for {spec.name}; found: {', '.join(available) or 'none'}")


def load_operator_tables(root: str | Path, gpu: str) -> OperatorTables:
    root = Path(root)
    if not (root / "compute").is_dir():
        raise CalibrationError(f"{root}: expected Vidur's profiling layout (compute/<gpu>/<org>/<model>/mlp.csv)")
    name, spec = _gpu_dir(root, gpu)
    frames = []
    for path in sorted((root / "compute" / name).glob("*/*/mlp.csv")):
        df = _read_csv(path)
        _require(df, path, ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "use_gated_mlp",
                            "num_tokens", "num_tensor_parallel_workers", "time_stats.attn_pre_proj.median"))
        frames.append(pd.DataFrame({
            "model": path.parent.name, "tp": df["num_tensor_parallel_workers"].astype(int),
            "num_tokens": df["num_tokens"].astype(int), "n_head": df["n_head"], "n_kv_head": df["n_kv_head"],
            "n_embd": df["n_embd"], "n_expanded_embd": df["n_expanded_embd"],
            "use_gated_mlp": df["use_gated_mlp"].astype(str).str.lower() == "true",
            "linear_s": sum(_median_ms(df, op) for op in LINEAR_OPS) * 1e-3,
            "elementwise_s": sum(_median_ms(df, op) for op in ELEMENTWISE_OPS) * 1e-3,
        }))
    if not frames:
        raise CalibrationError(f"{root / 'compute' / name}: no <org>/<model>/mlp.csv tables")
    return OperatorTables(spec, pd.concat(frames, ignore_index=True), _load_attention(root, name),
                          _load_allreduce(root, name), str(root))


def _load_attention(root: Path, name: str) -> pd.DataFrame | None:
    frames = []
    for path in sorted((root / "compute" / name).glob("*/*/attention*.csv")):
        df = _read_csv(path)
        _require(df, path, ("n_q_head", "n_kv_head", "n_embd", "batch_size", "prefill_chunk_size", "kv_cache_size",
                            "is_prefill", "num_tensor_parallel_workers"))
        prefill = df["is_prefill"].astype(str).str.lower() == "true"
        frames.append(pd.DataFrame({
            "model": path.parent.name, "tp": df["num_tensor_parallel_workers"].astype(int),
            "n_head": df["n_q_head"], "n_kv_head": df["n_kv_head"], "n_embd": df["n_embd"],
            "batch_size": df["batch_size"], "chunk": df["prefill_chunk_size"], "context": df["kv_cache_size"],
            "is_prefill": prefill,
            "time_s": np.where(prefill, _median_ms(df, "attn_prefill"), _median_ms(df, "attn_decode")) * 1e-3,
        }))
    return pd.concat(frames, ignore_index=True) if frames else None


def _load_allreduce(root: Path, name: str) -> pd.DataFrame | None:
    path = root / "network" / f"{name}_dgx" / "all_reduce.csv"
    if not path.is_file():
        return None
    df = _read_csv(path)
    _require(df, path, ("num_workers", "size", "devices_per_node", "time_stats.all_reduce.median"))
    df = df[df["devices_per_node"] == df["num_workers"]]      # one node: NVLink / NVSwitch
    return pd.DataFrame({"num_workers": df["num_workers"].astype(int), "size": df["size"].astype(float),
                         "time_s": df["time_stats.all_reduce.median"] * 1e-3})


# ---- the cost model's quantities for a profiled layer ---------------------------------------------
def layer_model(row) -> ModelSpec:
    """A one-layer ModelSpec of a profiled shape (fp16, as Vidur profiles)."""
    return ModelSpec(name="profiled-layer", num_layers=1, hidden_size=int(row.n_embd), num_heads=int(row.n_head),
                     num_kv_heads=int(row.n_kv_head), head_dim=int(row.n_embd) // int(row.n_head),
                     intermediate_size=int(getattr(row, "n_expanded_embd", 4 * int(row.n_embd))), vocab_size=1,
                     tied_embeddings=True, max_position=1, weight_dtype="fp16", activation_dtype="fp16",
                     kv_dtype="fp16", mlp_matrices=3 if getattr(row, "use_gated_mlp", True) else 2)


@dataclass(frozen=True)
class _LayerTerms:
    """Per row: seconds at peak of the layer's weight streaming, matmul FLOPs and elementwise bytes, its
    matmul weight size, and (under an operator-form profile) the profile's matmul efficiency there."""
    weights_s: np.ndarray
    flops_s: np.ndarray
    elementwise_s: np.ndarray
    weight_mib: np.ndarray
    gemm_eff: np.ndarray


def _layer_terms(layers: pd.DataFrame, gpu: GPUSpec, profile: HardwareProfile | str = "default") -> _LayerTerms:
    weights, flops, elem, mib, eff = (np.full(len(layers), np.nan) for _ in range(5))
    profile = load_profile(profile)
    keys = ["n_embd", "n_head", "n_kv_head", "n_expanded_embd", "use_gated_mlp", "tp"]
    for key, idx in layers.groupby(keys).groups.items():
        row = pd.Series(dict(zip(keys, key)))
        cost = CostModel(layer_model(row), gpu, profile, tp=int(row.tp))
        tokens = layers.loc[idx, "num_tokens"].to_numpy(dtype=np.float64)
        at = layers.index.get_indexer(idx)
        weights[at] = cost.model.linear_params_per_layer * 2 / cost.tp / gpu.mem_bw
        flops[at] = tokens * cost.matmul_time_per_token
        elem[at] = tokens * cost.elementwise_time_per_token
        mib[at] = cost.layer_weight_mib
        if profile.operator_form:
            eff[at] = cost.gemm_efficiency(tokens)
    return _LayerTerms(weights, flops, elem, mib, eff)


# ---- fit ----------------------------------------------------------------------------------------
def _lstsq_latency(count: float, x: np.ndarray, y: np.ndarray, what: str) -> tuple[float, float]:
    """y = count * latency + x / eff by least squares on relative error; (latency, eff)."""
    w = 1.0 / y
    a = np.column_stack([np.full_like(x, count), x]) * w[:, None]
    (latency, inv_eff), *_ = np.linalg.lstsq(a, y * w, rcond=None)
    if inv_eff <= 0:
        raise CalibrationError(f"{what}: the rows do not determine a bandwidth (fitted 1/eff = {inv_eff:.3g})")
    return max(float(latency), 0.0), min(1.0 / float(inv_eff), 1.0)


def _gemm_table(t_matmul: np.ndarray, streaming_s: np.ndarray, flops_s: np.ndarray, tokens: np.ndarray,
                weight_mib: np.ndarray) -> GemmEfficiency:
    """Median implied efficiency of the compute-bound rows in each (token, size) cell of a geometric
    grid (sizes in powers of two, each cell +/- one power); empty cells filled from their neighbours
    (linearly along sizes, then along tokens; the nearest value beyond)."""
    implied = np.full(len(tokens), np.nan)
    bound = (t_matmul > streaming_s * COMPUTE_MARGIN) & (tokens >= MIN_COMPUTE_TOKENS)
    implied[bound] = flops_s[bound] / t_matmul[bound]
    log_size = np.log2(weight_mib)
    sizes = np.arange(np.floor(log_size.min()), np.ceil(log_size.max()) + 1.0)
    grid = np.full((len(TOKEN_GRID), len(sizes)), np.nan)
    for i, (lo, g, hi) in enumerate(zip((0,) + TOKEN_GRID[:-1], TOKEN_GRID, TOKEN_GRID[1:] + (TOKEN_GRID[-1] * 2,))):
        near = (tokens > (lo + g) / 2) & (tokens <= (g + hi) / 2)
        for j, size in enumerate(sizes):
            cell = near & (np.abs(log_size - size) <= 1.0)
            if cell.any() and g >= MIN_COMPUTE_TOKENS and np.isfinite(implied[cell]).sum() * 2 >= cell.sum():
                grid[i, j] = np.nanmedian(implied[cell])
    keep = ~np.isnan(grid).all(axis=1)
    if not keep.any():
        raise CalibrationError("no compute-bound matmul rows: cannot fit gemm_efficiency")
    filled = pd.DataFrame(grid[keep]).interpolate(axis=1, limit_direction="both") \
        .interpolate(axis=0, limit_direction="both").to_numpy()
    return GemmEfficiency(tokens=[t for t, k in zip(TOKEN_GRID, keep) if k],
                          weight_mib=[round(float(2 ** s), 4) for s in sizes],
                          efficiency=[[round(min(float(e), 1.0), 5) for e in row] for row in filled])


def _fit_attention(att: pd.DataFrame, gpu: GPUSpec) -> dict[str, float]:
    kv_s, flops_s = _attention_terms(att, gpu)
    dec, pre = ~att["is_prefill"].to_numpy(), att["is_prefill"].to_numpy()
    y = att["time_s"].to_numpy()
    lat, bw_eff = _lstsq_latency(1.0, kv_s[dec], y[dec], "attention decode rows")
    _, compute_eff = _lstsq_latency(1.0, flops_s[pre], y[pre], "attention prefill rows")
    return {"attn_latency_s": lat, "attn_bw_eff": bw_eff, "attn_compute_eff": compute_eff}


def _attention_terms(att: pd.DataFrame, gpu: GPUSpec) -> tuple[np.ndarray, np.ndarray]:
    """KV bytes read (decode) and attention FLOPs (prefill) per row, at peak, as the cost model prices them."""
    kv_s, flops_s = np.zeros(len(att)), np.zeros(len(att))
    for i, row in enumerate(att.itertuples()):
        cost = CostModel(layer_model(row), gpu, load_profile("default"), tp=int(row.tp))
        b, chunk, ctx = float(row.batch_size), float(row.chunk), float(row.context)
        if row.is_prefill:
            shape = BatchShape(num_seqs=b, num_prefill_tokens=b * chunk,
                               attn_pairs_prefill=b * chunk * (ctx + (chunk + 1) / 2), kv_tokens_read=b * (ctx + chunk))
        else:
            shape = BatchShape(num_seqs=b, num_decode_tokens=b, kv_tokens_read=b * (ctx + 1))
        f = cost.features(shape, padded=False)
        kv_s[i], flops_s[i] = f["attn_memory"], f["attn_compute"]
    return kv_s, flops_s


def _fit_allreduce(ar: pd.DataFrame, gpu: GPUSpec, latency_s: float) -> tuple[dict[int, AllReduceTerms], dict]:
    """Per TP degree: the bus-bandwidth efficiency of large messages, measured (NCCL). The latency is
    not taken from these tables: vLLM runs small all-reduces (decode, small prefills) with its custom
    all-reduce kernel over NVLink P2P, whose latency (`latency_s`, the base profile's) is far below
    NCCL's; the NCCL latencies are kept in the profile's meta for reference."""
    out, nccl_latency = {}, {}
    for n, rows in ar.groupby("num_workers"):
        small, large = rows[rows["size"] <= SMALL_MESSAGE], rows[rows["size"] >= LARGE_MESSAGE]
        if small.empty or large.empty or not gpu.link_bw:
            continue
        nccl = float(np.median(small["time_s"]))
        busbw = 2 * (n - 1) / n * large["size"] / (large["time_s"] - nccl).clip(lower=1e-9)
        out[int(n)] = AllReduceTerms(latency_s=latency_s,
                                     bw_eff=round(min(float(np.median(busbw)) / gpu.link_bw, 1.0), 4))
        nccl_latency[int(n)] = round(nccl, 7)
    return out, nccl_latency


def fit_operator_profile(tables: OperatorTables, *, holdout: str | None = None, name: str | None = None,
                         base_profile: str | HardwareProfile = "default",
                         attention_from: OperatorTables | None = None) -> OperatorFit:
    """Fit `tables.gpu`'s profile on every model but `holdout`; errors on the held-out model's rows
    (or on the training rows when there is none)."""
    layers = tables.layers.reset_index(drop=True)
    models = sorted(layers["model"].unique())
    if holdout is not None and holdout not in models:
        raise CalibrationError(f"holdout model {holdout!r} is not in {tables.source} for {tables.gpu.name}; "
                               f"models: {', '.join(models)}")
    train = layers[layers["model"] != holdout].reset_index(drop=True)
    if train.empty:
        raise CalibrationError("no rows left to fit once the held-out model is removed")
    terms = _layer_terms(train, tables.gpu)
    tokens = train["num_tokens"].to_numpy(dtype=np.float64)
    t_lin = train["linear_s"].to_numpy()
    small = tokens <= SMALL_M
    gemm_latency, mem_eff = _lstsq_latency(4.0, terms.weights_s[small], t_lin[small], "matmul rows")
    streaming = terms.weights_s / mem_eff
    table = _gemm_table(t_lin - 4 * gemm_latency, streaming, terms.flops_s, tokens, terms.weight_mib)
    el_latency, el_eff = _lstsq_latency(1.0, terms.elementwise_s, train["elementwise_s"].to_numpy(), "elementwise rows")

    source = tables if tables.attention is not None else attention_from
    attention = _fit_attention(source.attention, source.gpu) if source is not None and source.attention is not None \
        else None
    base = load_profile(base_profile)
    update = {
        "name": name or f"{tables.gpu.name.lower()}",
        "description": f"{tables.gpu.name}: fitted by kvsim calibrate --operators to measured kernel times",
        "mfu_prefill": 1.0, "mfu_decode": 1.0, "mem_bw_eff": round(mem_eff, 5),
        "gemm_efficiency": table, "gemm_latency_s": round(gemm_latency, 9),
        "elementwise_bw_eff": round(el_eff, 5), "layer_latency_s": round(el_latency, 9),
    }
    if attention:
        update.update(attn_bw_eff=round(attention["attn_bw_eff"], 5),
                      attn_compute_eff=round(attention["attn_compute_eff"], 5),
                      layer_latency_s=round(el_latency + attention["attn_latency_s"], 9))
    nccl_latency = {}
    if tables.allreduce is not None:
        by_tp, nccl_latency = _fit_allreduce(tables.allreduce, tables.gpu, base.allreduce_latency_s)
        if by_tp:
            update["allreduce_by_tp"] = by_tp
    profile = base.model_copy(update=update)
    profile = HardwareProfile.model_validate(profile.model_dump())
    test = layers[layers["model"] == holdout].reset_index(drop=True) if holdout else train
    errors = operator_errors(profile, tables, test, attention)
    meta = {"fitted_on": {"gpu": tables.gpu.name, "operators": "vidur" if "vidur" in tables.source else tables.source,
                          "models": [m for m in models if m != holdout], "holdout": holdout,
                          "attention": (source.gpu.name if source is not None and source.attention is not None
                                        else None),
                          "allreduce": bool(update.get("allreduce_by_tp"))},
            "nccl_allreduce_latency_s": nccl_latency,
            "not_from_kernel_times": ["allreduce latency (vLLM's custom all-reduce)", "step_overhead_s (host)", "per_seq_overhead_s", "per_block_entry_overhead_s", "copy_bw_eff",
                           "pcie_eff", "client (host)"],
            "fit_errors": errors}
    profile = profile.model_copy(update={"meta": meta})
    return OperatorFit(profile, errors, holdout, [m for m in models if m != holdout])


# ---- errors -------------------------------------------------------------------------------------
def _errors(pred: np.ndarray, meas: np.ndarray) -> dict[str, float]:
    rel = (pred - meas) / meas
    ape = np.abs(rel)
    return {"count": int(len(meas)), "mape": round(float(ape.mean()), 5), "p90_ape": round(float(np.quantile(ape, 0.9)), 5),
            "max_ape": round(float(ape.max()), 5), "bias": round(float(rel.mean()), 5)}


def predict_layers(profile: HardwareProfile, layers: pd.DataFrame, gpu: GPUSpec) -> pd.DataFrame:
    """The profile's matmul and elementwise seconds per row of a layer table (the cost model's operator
    form for one layer, without the LM head and the per-layer floor)."""
    t = _layer_terms(layers, gpu, profile)
    linear = np.maximum(t.flops_s / t.gemm_eff, t.weights_s / profile.mem_bw_eff) + 4 * profile.gemm_latency_s
    return pd.DataFrame({"linear_s": linear, "elementwise_s": t.elementwise_s / profile.elementwise_bw_eff},
                        index=layers.index)


def operator_errors(profile: HardwareProfile, tables: OperatorTables, rows: pd.DataFrame,
                    attention: dict[str, float] | None = None) -> dict[str, dict[str, float]]:
    """Per-operator-group and per-step (one layer's matmuls + elementwise kernels) errors on `rows`;
    `attention`: the attention fit the profile took (its latency is part of layer_latency_s), whose
    rows are scored too when they are `tables`' own."""
    pred = predict_layers(profile, rows, tables.gpu)
    # layer_latency_s holds the attention kernel's floor too; the elementwise rows have none of it
    pred_el = pred["elementwise_s"].to_numpy() + profile.layer_latency_s - (attention or {}).get("attn_latency_s", 0.0)
    errors = {"matmul": _errors(pred["linear_s"].to_numpy(), rows["linear_s"].to_numpy()),
              "elementwise": _errors(pred_el, rows["elementwise_s"].to_numpy())}
    errors["step"] = _errors(pred["linear_s"].to_numpy() + pred_el, (rows["linear_s"] + rows["elementwise_s"]).to_numpy())
    if attention is not None and tables.attention is not None:
        errors.update(_attention_errors(profile, tables, attention["attn_latency_s"]))
    return errors


def _attention_errors(profile: HardwareProfile, tables: OperatorTables, latency: float) -> dict[str, dict[str, float]]:
    """Attention rows priced as the cost model does (latency + roofline max); in-sample: the attention
    rows are few and all of one model."""
    att = tables.attention
    kv_s, flops_s = _attention_terms(att, tables.gpu)
    pred = latency + np.maximum(kv_s / profile.attn_bw_eff, flops_s / profile.attn_compute_eff)
    y, pre = att["time_s"].to_numpy(), att["is_prefill"].to_numpy()
    return {"attention_decode (in-sample)": _errors(pred[~pre], y[~pre]),
            "attention_prefill (in-sample)": _errors(pred[pre], y[pre])}


# ---- whole steps from the operator rows -----------------------------------------------------------
def kernel_step_times(root: str | Path, gpu: str, model: str, steps: list[str]) -> dict[str, tuple[float, float]]:
    """Per step ("prefill N" or "decode B x CONTEXT", TP 1): (measured, predicted) GPU kernel seconds.
    Measured: the profiled model of the catalog model's shape, its layer rows (matmuls, elementwise,
    attention) summed over the layers; predicted: the cost model's device time under the GPU's shipped
    profile without the LM head (not in the rows)."""
    from kvsim.sim.model.catalog import get_model
    tables = load_operator_tables(root, gpu)
    spec = get_model(model)
    layers, att = tables.layers, tables.attention
    same = (layers["n_embd"] == spec.hidden_size) & (layers["n_head"] == spec.num_heads) \
        & (layers["n_kv_head"] == spec.num_kv_heads) & (layers["n_expanded_embd"] == spec.intermediate_size) \
        & (layers["tp"] == 1)
    if not same.any() or att is None:
        raise CalibrationError(f"{tables.source}: no layer and attention rows of {spec.name}'s shape on {tables.gpu.name}")
    att = att[(att["n_embd"] == spec.hidden_size) & (att["n_kv_head"] == spec.num_kv_heads) & (att["tp"] == 1)]
    cost = CostModel(spec.model_copy(update={"vocab_size": 1}), tables.gpu)
    out = {}
    for step in steps:
        words = step.replace("x", " ").split()
        if words[0] == "prefill":
            n = int(words[1])
            tokens, a = n, att[att["is_prefill"] & (att["chunk"] == n) & (att["context"] == 0)]
            shape = BatchShape(num_seqs=1, num_prefill_tokens=n, attn_pairs_prefill=n * (n + 1) / 2, kv_tokens_read=n)
        elif words[0] == "decode":
            b, ctx = int(words[1]), int(words[2])
            tokens, a = b, att[~att["is_prefill"] & (att["batch_size"] == b) & (att["context"] == ctx)]
            shape = BatchShape(num_seqs=b, num_decode_tokens=b, kv_tokens_read=b * (ctx + 1))
        else:
            raise CalibrationError(f"step {step!r}: expected 'prefill N' or 'decode B x CONTEXT'")
        row = layers[same & (layers["num_tokens"] == tokens)]
        if row.empty or a.empty:
            raise CalibrationError(f"step {step!r}: no operator rows at that size")
        measured = spec.num_layers * float(row["linear_s"].median() + row["elementwise_s"].median()
                                           + a["time_s"].median())
        parts = cost.breakdown(shape)
        predicted = float(parts["linear"] + parts["attention"]) - cost.profile.gemm_latency_s   # no LM head
        out[step] = (measured, predicted)
    return out
