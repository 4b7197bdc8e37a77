"""The published fused-MoE kernel times (sim/data/moe_kernels.yaml `runs`) and the fit of each weight
format's terms to them (the terms: sim/model/grouped_gemm.py; docs/models.md, "Expert kernels").

    python -m kvsim.sim.model.moe_kernels      # refit; prints the `formats` section and every run's error
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field

from kvsim.sim.model.catalog import get_gpu, get_model
from kvsim.sim.model.cost_model import load_profile, profile_for_gpu
from kvsim.sim.model.grouped_gemm import (FORMATS, MOE_KERNELS_FILE, GroupedGemm, MoEKernelTerms, kernel_format,
                                          load_section, shipped_terms)


class KernelRun(BaseModel):
    """Published kernel times of one fused-MoE setup (one MoE layer's call at each batch size)."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    source: str
    model: str
    gpu: str
    dtype: str
    block_size: int = Field(0, ge=0)        # fp8 weights with square-block scales (0: per-tensor)
    tp: int = Field(ge=1)
    kernel_us: dict[int, float]


@lru_cache(maxsize=1)
def kernel_runs() -> tuple[KernelRun, ...]:
    return load_section(MOE_KERNELS_FILE, "runs", KernelRun, keyed=False)

# ---- the fit ---------------------------------------------------------------------------------------

def _run_context(run: KernelRun):
    """(model with the run's expert format, GPU, that GPU's shipped profile) of a published run."""
    gpu = get_gpu(run.gpu)
    model = get_model(run.model)
    update: dict[str, Any] = {"expert_dtype": None, "expert_skew": 0.0}
    update["weight_dtype"] = run.dtype
    update["weight_block_size"] = run.block_size
    model = model.model_copy(update=update)
    profile = load_profile(profile_for_gpu(gpu))
    return model, gpu, profile


def _run_parts(run: KernelRun) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(measured seconds, memory side at bw_eff 1, compute side at compute_scale 1) per batch of one layer."""
    model, gpu, profile = _run_context(run)
    unit = MoEKernelTerms(fixed_s=0.0, bw_eff=1.0, compute_scale=1.0)
    one_layer = model.model_copy(update={"num_layers": 1, "first_dense_layers": 0})
    mem = GroupedGemm(one_layer, gpu, profile.gemm_efficiency, run.tp, terms=unit, skew=0.0)
    batches = np.array(sorted(run.kernel_us), dtype=np.float64)
    measured = np.array([run.kernel_us[int(b)] for b in batches]) * 1e-6
    rows = batches[:, None] * (mem._k * mem._p)
    compute = mem._rows_over_eff(rows).sum(axis=-1) * mem._row_s
    memory = (1.0 - mem._q[None, :] ** batches[:, None]).sum(axis=-1) * mem._byte_s
    return measured, memory, compute


def fit_format(runs: list[KernelRun], compute_scale: float | None = None) -> MoEKernelTerms:
    """fixed_s, bw_eff and compute_scale minimising the squared relative error over every batch of `runs`:
    a grid over bw_eff (0.20-1.00 by 0.005) and compute_scale (0.05-2.0, 160 log steps; or the given one);
    fixed_s in closed form for each pair (clipped at 0). Deterministic."""
    parts = [_run_parts(r) for r in runs]
    y = np.concatenate([p[0] for p in parts])
    mem = np.concatenate([p[1] for p in parts])
    comp = np.concatenate([p[2] for p in parts])
    bw = np.round(np.arange(0.20, 1.0 + 1e-9, 0.005), 4)
    cs = np.exp(np.linspace(np.log(0.05), np.log(2.0), 160)) if compute_scale is None else np.array([compute_scale])
    side = np.maximum(mem[None, None, :] / bw[:, None, None], comp[None, None, :] / cs[None, :, None])
    w = 1.0 / y
    # min over t0 of sum ((t0 + side) / y - 1)^2: t0 = sum (y - side) / y^2 / sum 1 / y^2
    t0 = np.clip(((y - side) * w * w).sum(axis=-1) / (w * w).sum(), 0.0, None)
    err = ((t0[..., None] + side) * w - 1.0)
    sse = (err * err).sum(axis=-1)
    i, j = np.unravel_index(int(np.argmin(sse)), sse.shape)
    mape = float(np.abs(err[i, j]).mean())
    return MoEKernelTerms(fixed_s=round(float(t0[i, j]), 9), bw_eff=round(float(bw[i]), 4),
                          compute_scale=round(float(cs[j]), 4), fitted_to=[r.name for r in runs],
                          fit_mape=round(mape, 4))


# the table's first row: below it a GEMM's time is its weight streaming, so runs whose experts never get
# this many rows cannot tell the compute side
COMPUTE_ROWS = 32


def _max_rows(run: KernelRun) -> float:
    m = get_model(run.model)
    return max(run.kernel_us) * m.experts_per_token / m.num_experts


def fit_all() -> dict[str, MoEKernelTerms]:
    """Every format's terms from the shipped runs (formats without a run: `same_as` bf16; a format whose
    runs never give an expert COMPUTE_ROWS rows: the compute_scale of the same precision, fp8-block <- fp8)."""
    runs = kernel_runs()
    out: dict[str, MoEKernelTerms] = {}
    for fmt in FORMATS:
        mine = [r for r in runs if kernel_format(r.dtype, r.block_size) == fmt]
        if mine and max(_max_rows(r) for r in mine) < COMPUTE_ROWS and fmt == "fp8-block" and "fp8" in out:
            out[fmt] = fit_format(mine, compute_scale=out["fp8"].compute_scale).model_copy(
                update={"compute_scale_from": "fp8"})
        elif mine:
            out[fmt] = fit_format(mine)
        else:
            out[fmt] = MoEKernelTerms(fixed_s=0.0, bw_eff=1.0, compute_scale=1.0, same_as="bf16")
    return out


def run_errors(terms_by_format: dict[str, MoEKernelTerms] | None = None) -> list[dict[str, Any]]:
    """Per run and batch: measured and modelled microseconds under the shipped (or given) terms."""
    out = []
    for run in kernel_runs():
        formats = terms_by_format or shipped_terms()
        terms = formats[kernel_format(run.dtype, run.block_size)]
        if terms.same_as is not None:
            terms = formats[terms.same_as]
        y, mem, comp = _run_parts(run)
        model_s = terms.fixed_s + np.maximum(mem / terms.bw_eff, comp / terms.compute_scale)
        for b, meas, mod in zip(sorted(run.kernel_us), y, model_s, strict=True):
            out.append({"run": run.name, "batch": b, "measured_us": float(meas * 1e6), "model_us": float(mod * 1e6),
                        "error": float(mod / meas - 1.0)})
    return out


if __name__ == "__main__":       # python -m kvsim.sim.model.moe_kernels: print the fit (paste into the yaml)
    print(yaml.safe_dump({"formats": {k: v.model_dump(exclude_none=True) for k, v in fit_all().items()}},
                         sort_keys=False, width=110))
    for e in run_errors(fit_all()):
        print(f"{e['run']:40s} {e['batch']:5d} {e['measured_us']:9.1f} {e['model_us']:9.1f} {e['error']:+.1%}")
