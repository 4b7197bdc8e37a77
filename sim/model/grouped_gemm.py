"""The routed experts' fused kernels (grouped GEMM) and router skew: what a MoE layer's experts cost.

A MoE layer runs its routed experts as one fused call (vLLM's `fused_experts`: top-k, token alignment,
two grouped GEMMs, activation, weighted sum). Each expert multiplies only the rows routed to it, about
T * k / E of a step's T tokens, so at decode batch sizes an expert's GEMM has a few rows and runs far
below the dense matmul's efficiency at T rows. Per GPU and step (docs/models.md, "Expert kernels"):

    moe(T) = [T > 0] * M * fixed_s
             + max( sum_i distinct_i(T) * expert_bytes_gpu / (bandwidth * bw_eff),
                    sum_i rows_i(T) * 2 * expert_params_gpu / (peak * compute_scale * eff(rows_i, expert MiB)) )

over the experts i on the GPU, M MoE layers, with rows_i = T * k * p_i and distinct_i = 1 - (1 - k p_i)^T
(the chance that expert i gets at least one of T tokens), p_i the router's share of expert i
(`expert_popularity`: uniform at skew 0, Zipf-like p_i ~ i^-skew otherwise), eff the GPU profile's dense
GEMM efficiency table read at the expert's rows and its weight size on the GPU, peak the expert format's
matmul peak. Tensor parallelism gives each GPU a 1/tp slice of every expert; expert parallelism whole
experts, dealt by popularity rank round-robin (the GPU priced holds ranks 0, tp, 2 tp, ...: the
most-loaded one; the placement a load balancer such as vLLM's EPLB aims at, so a lower bound on imbalance).

`fixed_s`, `bw_eff` and `compute_scale` are per weight format (bf16, fp8, fp8-block, mxfp4) and fitted to published
kernel times of these fused calls (sim/data/moe_kernels.yaml; the fit: sim/model/moe_kernels.py). At skew 0 the distinct experts
are E (1 - (1 - k/E)^T), the uniform-routing count the cost model used before.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvsim.sim.model.catalog import (DATA_DIR, DTYPE_BYTES, CatalogError, GPUSpec, ModelSpec,
                                     format_validation_error, yaml_load_with_lines)

MOE_KERNELS_FILE = DATA_DIR / "moe_kernels.yaml"

# expert storage dtype -> the kernel format whose fitted terms price it
FORMAT_OF_DTYPE = {"bf16": "bf16", "fp16": "bf16", "fp32": "bf16", "tf32": "bf16", "fp8": "fp8", "int8": "fp8",
                   "mxfp4": "mxfp4", "int4": "mxfp4"}
FORMATS = ("bf16", "fp8", "fp8-block", "mxfp4")


def kernel_format(dtype: str, block_size: int = 0) -> str:
    """The fused-MoE format of experts stored as `dtype` (fp8 with square-block scales: fp8-block)."""
    fmt = FORMAT_OF_DTYPE.get(dtype, "bf16")
    return "fp8-block" if fmt == "fp8" and block_size > 0 else fmt


class MoEKernelTerms(BaseModel):
    """One weight format's fused-MoE terms: fixed time per MoE layer, the fraction of peak bandwidth its
    expert-weight streaming reaches, and its compute efficiency relative to the dense GEMM table."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    fixed_s: float = Field(ge=0, le=1e-2)
    bw_eff: float = Field(gt=0, le=1)
    compute_scale: float = Field(gt=0, le=2)
    fitted_to: list[str] = Field(default_factory=list)     # the runs' names; empty: taken from `same_as`
    same_as: str | None = None                             # no published run of this format: that format's terms
    compute_scale_from: str | None = None                  # its runs never reach compute-bound rows: that format's
    fit_mape: float | None = None                          # mean |relative error| over the runs fitted to


def load_section(path: Path, section: str, model: type[BaseModel], *, keyed: bool) -> Any:
    """`section` of a MoE kernel file validated as `model` (a mapping by name, or a list); a bad entry stops
    with `file:line: field 'x': message`."""
    data, lines = yaml_load_with_lines(path)
    if not isinstance(data, dict) or not isinstance(data.get(section), dict if keyed else list):
        raise CatalogError(f"{path}: expected a mapping with a '{section}' {'mapping' if keyed else 'list'}")
    items = data[section].items() if keyed else enumerate(data[section])
    out = {}
    for key, entry in items:
        try:
            out[key] = model.model_validate(entry)
        except ValidationError as exc:
            raise CatalogError(format_validation_error(exc, str(path), lines, prefix=(section, key))) from None
    return out if keyed else tuple(out.values())


@lru_cache(maxsize=1)
def shipped_terms() -> dict[str, MoEKernelTerms]:
    """The fitted terms of every format (sim/data/moe_kernels.yaml `formats`)."""
    return load_section(MOE_KERNELS_FILE, "formats", MoEKernelTerms, keyed=True)


def format_terms(dtype: str, block_size: int = 0) -> tuple[str, MoEKernelTerms]:
    """(format name, fitted terms) that price experts stored as `dtype` (with square-block scales)."""
    formats = shipped_terms()
    fmt = kernel_format(dtype, block_size)
    terms = formats[fmt]
    if terms.same_as is not None:
        terms = formats[terms.same_as]
    return fmt, terms


def expert_popularity(num_experts: int, skew: float) -> np.ndarray:
    """The router's share of each expert, most popular first (sums to 1): p_i ~ (i + 1)^-skew."""
    if skew == 0:
        return np.full(num_experts, 1.0 / num_experts)
    w = np.arange(1, num_experts + 1, dtype=np.float64) ** -float(skew)
    return w / w.sum()


def hot_expert_load(num_experts: int, top_k: int, skew: float) -> float:
    """Rows of the most-loaded expert over the mean expert's (1 at skew 0): min(1, k p_0) / (k / E)."""
    p = expert_popularity(num_experts, skew)
    return float(min(1.0, top_k * p[0]) / (top_k / num_experts))


def distinct_experts(num_experts: int, top_k: int, tokens, skew: float = 0.0):
    """Expected experts a step of `tokens` tokens reads, sum_i 1 - (1 - k p_i)^T; at skew 0 exactly the
    uniform count E * (1 - (1 - k/E)^T)."""
    t = tokens.astype(np.float64, copy=False) if isinstance(tokens, np.ndarray) else float(tokens)
    if skew == 0:
        return num_experts * (1.0 - (1.0 - top_k / num_experts) ** t)
    q = 1.0 - np.minimum(1.0, top_k * expert_popularity(num_experts, skew))
    if isinstance(t, np.ndarray):
        return (1.0 - q[None, :] ** t[..., None]).sum(axis=-1)
    return float((1.0 - q ** t).sum())


class GroupedGemm:
    """Per-GPU seconds of a step's routed-expert kernels (module docstring) for `model` on `gpu`, the
    experts split over `gpus` GPUs (tensor slices, or whole experts with `expert_parallel`)."""

    def __init__(self, model: ModelSpec, gpu: GPUSpec, gemm_table, gpus: int, *, expert_parallel: bool = False,
                 terms: MoEKernelTerms | None = None, skew: float | None = None):
        if not model.is_moe:
            raise ValueError(f"{model.name} has no routed experts")
        dtype = model.expert_dtype or model.weight_dtype
        if terms is None:
            self.format, terms = format_terms(dtype, model.weight_block_size)
        else:
            self.format = kernel_format(dtype, model.weight_block_size)
        self.terms = terms
        self.skew = model.expert_skew if skew is None else skew
        E, k = model.num_experts, model.experts_per_token
        p = expert_popularity(E, self.skew)
        if expert_parallel and gpus > 1:
            p, part = p[0::gpus], 1.0         # whole experts; the GPU holding popularity ranks 0, gpus, ...
        else:
            part = 1.0 / gpus                 # a slice of every expert
        self._k = float(k)
        self._p = p
        self._q = 1.0 - np.minimum(1.0, k * p)
        self._uniform = self.skew == 0
        layers = model.num_moe_layers
        self.expert_mib = model.expert_bytes * part / 2**20
        self._byte_s = layers * model.expert_bytes * part / gpu.mem_bw / self.terms.bw_eff
        self._row_s = (layers * 2 * model.expert_params * part / gpu.peak_flops(dtype) / self.terms.compute_scale)
        self._fixed_s = layers * self.terms.fixed_s
        self._log_t, eff = gemm_table.at_size(self.expert_mib)
        # The table was measured on 16-bit weights: at few rows its efficiency is the weights' streaming time.
        # A format that streams fewer bytes per weight than its matmul peak gains (weight-only 4-bit, or fp8
        # where the GPU has no fp8 tensor cores) reaches that efficiency sooner: scale by the ratio, up to
        # the table's best (an assumption, docs/models.md; bf16 and fp8 on fp8 tensor cores: ratio 1).
        self.stream_ratio = min(1.0, DTYPE_BYTES[dtype] / 2.0 * gpu.peak_flops(dtype) / gpu.peak_flops("bf16")
                                if "bf16" in gpu.tflops else 1.0)
        self._eff = eff if self.stream_ratio == 1.0 else np.minimum(eff / self.stream_ratio, eff.max())
        self._memo: dict[float, float] = {}

    def _rows_over_eff(self, rows: np.ndarray) -> np.ndarray:
        return rows / np.interp(np.log(np.maximum(rows, 1.0)), self._log_t, self._eff)

    def seconds(self, tokens):
        """Seconds of a step of `tokens` tokens (a scalar, or an array of steps)."""
        if isinstance(tokens, np.ndarray):
            t = tokens.astype(np.float64, copy=False)
            rows = t[..., None] * (self._k * self._p)
            compute = self._rows_over_eff(rows).sum(axis=-1) * self._row_s
            memory = (1.0 - self._q[None, :] ** t[..., None]).sum(axis=-1) * self._byte_s
            return np.where(t > 0, self._fixed_s + np.maximum(compute, memory), 0.0)
        t = float(tokens)
        out = self._memo.get(t)
        if out is None:
            if t <= 0:
                out = 0.0
            else:
                rows = t * (self._k * self._p)
                compute = float(self._rows_over_eff(rows).sum()) * self._row_s
                memory = float((1.0 - self._q ** t).sum()) * self._byte_s
                out = self._fixed_s + (compute if compute >= memory else memory)
            self._memo[t] = out
        return out


