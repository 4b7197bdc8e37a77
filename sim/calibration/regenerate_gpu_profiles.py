"""Regenerate the shipped GPU profiles (`sim/data/profiles/<gpu>.yaml`) from the shipped operator
tables: `python -m kvsim.sim.calibration.regenerate_gpu_profiles [--check]`.

- Fitted (`kvsim calibrate --operators`): A100-80GB, H100-SXM and A40, each on every profiled model
  but Llama-2-7B, whose rows measure the error (`meta.fit_errors`). Only the A100 has attention rows;
  the H100 and A40 take its attention efficiencies and kernel floor.
- Derived: every other catalog GPU takes the efficiencies of the fitted GPU of its architecture class
  (fractions of peak; its own peaks from the catalog): A100-40GB <- A100-80GB, H200 <- H100-SXM,
  L4 / L40 / T4 <- A40 (GDDR6, PCIe cards). Their transfer error is unmeasured here: the published
  runs in tests/data/published_runs check what can be checked.
- Power-limited: the GPUs of sim/data/sustained_compute.yaml (the 72 W L4, the 70 W T4) cannot hold
  their boost clock under continuous matmuls; their derived matmul and attention compute efficiencies
  are capped at the sustained fraction of peak measured there (published matmul benchmarks), checked
  against MLPerf Inference (`sustained_checks`; docs/gpu-profiles.md "Power-limited cards").
- Not measured by kernel timings: the engine's CPU time per step and the client-side terms, fitted to
  published `vllm bench serve` runs (STEP_OVERHEAD_S, CLIENT below); the per-sequence and
  block-table overheads, copy and PCIe efficiencies are the hand-set `default` profile's.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Literal

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvsim.sim.calibration.errors import CalibrationError
from kvsim.sim.calibration.operator_fit import SHIPPED_OPERATORS, OperatorFit, fit_operator_profile, load_operator_tables
from kvsim.sim.model.catalog import CatalogError, format_validation_error, get_gpu, yaml_load_with_lines
from kvsim.sim.model.cost_model import PROFILES_DIR, ClientLatency, HardwareProfile

HOLDOUT = "Llama-2-7b-hf"
FITTED = ("A100-80GB", "H100-SXM", "A40")
ATTENTION_FROM = "A100-80GB"
DERIVED = {"A100-40GB": "A100-80GB", "H200": "H100-SXM", "L40": "A40", "L4": "A40", "T4": "A40",
           # added 2026-12-07: no kernel timings of these here; each takes the nearest fitted class
           "H20": "H100-SXM", "B200": "H100-SXM", "GB200": "H100-SXM", "MI300X": "H100-SXM", "MI325X": "H100-SXM",
           "L40S": "A40", "A10G": "A40", "RTX-4090": "A40", "RTX-PRO-6000": "A40"}
NEW_DERIVED = ("H20", "B200", "GB200", "MI300X", "MI325X", "L40S", "A10G", "RTX-4090", "RTX-PRO-6000")
# what the transfer adds to the source's measured error, by how far the target is from the source
TRANSFER = {
    "A100-40GB": "same chip as the source (less memory): the source's error applies",
    "H200": "same Hopper chip as the source (more, faster HBM): the source's error applies",
    "H20": "a cut-down Hopper (fewer SMs, same kernels): the source's error plus an unmeasured transfer error",
    "L40": "Ada GDDR6 PCIe card from an Ampere GDDR6 fit: unmeasured transfer error (published runs: "
           "docs/gpu-profiles.md)",
    "L4": "Ada GDDR6 PCIe card from an Ampere GDDR6 fit: error of the published L4 runs in docs/gpu-profiles.md",
    "T4": "Turing from an Ampere fit: unmeasured transfer error",
    "L40S": "Ada GDDR6 PCIe card from an Ampere GDDR6 fit: unmeasured transfer error, as the L40's",
    "A10G": "the same Ampere GA102 class as the source: the source's error plus an unmeasured transfer error",
    "RTX-4090": "a consumer Ada card from an Ampere fit: unmeasured transfer error",
    "RTX-PRO-6000": "a Blackwell GDDR7 card from an Ampere fit (datasheet lists FP4 only): unmeasured, likely "
                    "large transfer error",
    "B200": "Blackwell from a Hopper fit: unmeasured transfer error (new tensor cores, kernels still maturing)",
    "GB200": "Blackwell from a Hopper fit: unmeasured transfer error (new tensor cores, kernels still maturing)",
    "MI300X": "AMD CDNA3 (ROCm kernels) from an NVIDIA Hopper fit: unmeasured, likely large transfer error",
    "MI325X": "AMD CDNA3 (ROCm kernels) from an NVIDIA Hopper fit: unmeasured, likely large transfer error",
}
# Not in kernel timings; fitted by bench/fit_client_terms.py to published `vllm bench serve` runs
# (tests/data/published_runs; docs/gpu-profiles.md): they describe the hosts those runs used.
# - the engine's CPU time per step (scheduling, input preparation, sampling): h100-qwen3-0.6b, the only
#   run whose steps are CPU-bound (TPOT at 16 req/s); every GPU profile
STEP_OVERHEAD_S = 0.00226
# - the client side (API server, tokenization, detokenization): the L4 host's from l4-qwen2.5-0.5b,
#   the H100 host's from h100-qwen3-0.6b, which every other profile takes (a datacenter server)
CLIENT = {"L4": ClientLatency(request_s=0.0282, request_serial_s=0.000705, output_token_s=0.0002)}
DEFAULT_CLIENT = ClientLatency(request_s=0.0237, request_serial_s=0.008, output_token_s=2.11e-05)
SUSTAINED_FILE = PROFILES_DIR.parent / "sustained_compute.yaml"
HEADER = ("# Generated by `python -m kvsim.sim.calibration.regenerate_gpu_profiles` from the operator tables in\n"
          "# sim/data/gpu-operators (Vidur's measurements, MIT). Do not edit by hand: see docs/gpu-profiles.md.\n")


def profile_file(gpu: str) -> Path:
    return PROFILES_DIR / f"{get_gpu(gpu).name.lower()}.yaml"


def fitted_profiles(operators: Path = SHIPPED_OPERATORS) -> dict[str, OperatorFit]:
    reference = load_operator_tables(operators, ATTENTION_FROM)
    fits = {}
    for gpu in FITTED:
        tables = reference if gpu == ATTENTION_FROM else load_operator_tables(operators, gpu)
        fit = fit_operator_profile(tables, holdout=HOLDOUT, name=get_gpu(gpu).name.lower(), attention_from=reference)
        fits[gpu] = fit
    return fits


def derived_profile(gpu: str, source: HardwareProfile) -> HardwareProfile:
    meta = {"derived_from": source.name,
            "transfer": "the source GPU's efficiencies (fractions of peak) and latencies, this GPU's catalog peaks",
            "fit_errors": source.meta.get("fit_errors", {}),
            "fit_errors_of": source.name}
    if get_gpu(gpu).name in NEW_DERIVED:      # the older files stay as they were (their text is checked)
        meta["error_band"] = (f"step times within the source's measured MAPE "
                              f"({100 * source.meta['fit_errors']['step']['mape']:.1f}%) on the source; "
                              f"{TRANSFER[get_gpu(gpu).name]}")
    return source.model_copy(update={
        "name": get_gpu(gpu).name.lower(),
        "description": f"{get_gpu(gpu).name}: derived from the {source.name} fit (efficiencies transferred)",
        "meta": meta})


# ---- power-limited cards: sustained compute (sim/data/sustained_compute.yaml) ------------------------

class RatioCheck(BaseModel):
    """A published throughput ratio of this GPU over another on the same compute-bound benchmark and
    software: what the capped profile predicts is checked against it (never fitted to it)."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["mlperf_ratio"]
    what: str
    against: str
    dtype: str
    tokens: int = Field(gt=0)           # rows of the benchmark's matmuls (the table's row it reads)
    weight_mib: float = Field(gt=0)     # one layer's matmul weights (the table's column it reads)
    measured: dict[str, tuple[float, float]]    # round -> (this GPU, the other GPU), same unit
    source: str


class SustainedMeasurements(BaseModel):
    """Published square-matmul throughputs of one GPU (TFLOP/s by dtype and size n)."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    gpu: str | None = None              # the tool check names its GPU; under `gpus:` the key does
    power_w: float | None = Field(default=None, gt=0)
    sustained_min_size: int = Field(gt=0)
    measured_tflops: dict[str, dict[int, float]] = Field(min_length=1)
    source: str
    read: date
    how: str = ""
    checks: list[RatioCheck] = Field(default_factory=list)


class SustainedComputeFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    gpus: dict[str, SustainedMeasurements]
    tool_check: SustainedMeasurements | None = None


@dataclass(frozen=True)
class SustainedCompute:
    """One GPU's sustained matmul rate as a fraction of its catalog's dense peak: the median (`cap`),
    lowest and highest of its measurements at the sustained sizes."""
    gpu: str
    cap: float
    low: float
    high: float
    count: int
    measurements: SustainedMeasurements

    @property
    def tflops(self) -> float:
        """The cap in TFLOP/s of the catalog's bf16 (else fp16) dense peak."""
        spec = get_gpu(self.gpu)
        return self.cap * spec.tflops[spec.compute_dtype("bf16")]


def sustained_fractions(m: SustainedMeasurements, gpu: str, where: str) -> list[float]:
    """Each measurement at a sustained size over the catalog's dense peak of its dtype."""
    spec = get_gpu(gpu)
    out = []
    for dtype, by_size in m.measured_tflops.items():
        if dtype not in spec.tflops:
            raise CalibrationError(f"{where}: measured_tflops.{dtype}: the catalog's {spec.name} has no {dtype} peak "
                                   f"(it has {', '.join(spec.tflops)})")
        out += [v / spec.tflops[dtype] for n, v in by_size.items() if n >= m.sustained_min_size]
    if not out:
        raise CalibrationError(f"{where}: measured_tflops: no size at or above sustained_min_size "
                               f"({m.sustained_min_size})")
    if not all(0 < f <= 1 for f in out):
        raise CalibrationError(f"{where}: measured_tflops: a value outside (0, the catalog's peak]")
    return out


def _summarize(gpu: str, m: SustainedMeasurements, where: str) -> SustainedCompute:
    f = sustained_fractions(m, gpu, where)
    return SustainedCompute(get_gpu(gpu).name, round(statistics.median(f), 5), round(min(f), 5), round(max(f), 5),
                            len(f), m)


def load_sustained_compute(path: Path = SUSTAINED_FILE) -> tuple[dict[str, SustainedCompute], SustainedCompute | None]:
    """The power-limited GPUs' sustained compute (catalog name -> SustainedCompute) and the tool check's
    unthrottled GPU. Bad input: CalibrationError naming the file, line and field."""
    try:
        data, lines = yaml_load_with_lines(Path(path))
    except CatalogError as exc:
        raise CalibrationError(str(exc)) from None
    try:
        parsed = SustainedComputeFile.model_validate(data if isinstance(data, dict) else {})
    except ValidationError as exc:
        raise CalibrationError(format_validation_error(exc, str(path), lines).splitlines()[0]) from None
    out = {}
    for gpu, m in parsed.gpus.items():
        try:
            name = get_gpu(gpu).name
        except CatalogError as exc:
            raise CalibrationError(f"{path}:{lines.get(('gpus', gpu), 1)}: gpus.{gpu}: {exc}") from None
        out[name] = _summarize(name, m, f"{path}:{lines.get(('gpus', gpu), 1)}: gpus.{gpu}")
    tool = None
    if parsed.tool_check is not None:
        if parsed.tool_check.gpu is None:
            raise CalibrationError(f"{path}:{lines.get(('tool_check',), 1)}: tool_check: field 'gpu' is required")
        tool = _summarize(parsed.tool_check.gpu, parsed.tool_check, f"{path}: tool_check")
    return out, tool


def capped_profile(profile: HardwareProfile, sc: SustainedCompute) -> HardwareProfile:
    """`profile` with its matmul efficiencies (and the attention's compute efficiency) capped at the
    GPU's sustained fraction of peak: min(source efficiency, cap), the source's below the cap."""
    g = profile.gemm_efficiency
    assert g is not None, "capped_profile needs an operator-form profile"
    table = [[min(e, sc.cap) for e in row] for row in g.efficiency]
    m = sc.measurements
    source = profile.meta.get("fit_errors", {}).get("step", {}).get("mape")
    meta = dict(profile.meta, sustained_compute={
        "cap": sc.cap, "band": [sc.low, sc.high], "tflops": round(sc.tflops, 2), "measurements": sc.count,
        "power_w": m.power_w, "source": m.source, "read": m.read.isoformat(),
        "mechanism": "power-limited card: matmul efficiency = min(source's efficiency, sustained fraction of peak)"})
    meta["error_band"] = (f"steps whose matmuls stay below the cap: the source's measured step MAPE "
                          f"({100 * source:.1f}%) plus an unmeasured Ampere-to-{sc.gpu} transfer error; "
                          f"compute-bound matmuls at the cap: {100 * (sc.low / sc.cap - 1):+.1f}% / "
                          f"{100 * (sc.high / sc.cap - 1):+.1f}% (the spread of {sc.count} sustained measurement"
                          f"{'s' if sc.count > 1 else ''}); sim/data/sustained_compute.yaml")
    return profile.model_copy(update={
        "description": (f"{sc.gpu}: derived from the {meta['derived_from']} fit, matmul compute capped at the "
                        f"sustained {sc.tflops:.1f} TFLOP/s measured at its {m.power_w:g} W power limit"),
        "gemm_efficiency": g.model_copy(update={"efficiency": table}),
        "attn_compute_eff": min(profile.attn_compute_eff, sc.cap),
        "meta": meta})


def table_efficiency(profile: HardwareProfile, tokens: int, weight_mib: float) -> float:
    """The profile's matmul efficiency at `tokens` rows and `weight_mib` of layer weights (as the cost
    model interpolates it)."""
    assert profile.gemm_efficiency is not None
    log_t, eff = profile.gemm_efficiency.at_size(weight_mib)
    return float(np.interp(np.log(tokens), log_t, eff))


@dataclass(frozen=True)
class CheckResult:
    gpu: str
    what: str
    round: str
    measured: float
    predicted: float

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1


def sustained_checks(profiles: dict[str, HardwareProfile] | None = None,
                     path: Path = SUSTAINED_FILE) -> list[CheckResult]:
    """Each published ratio check of sustained_compute.yaml: the measured ratio (this GPU over the other)
    beside the one the profiles predict, eff x peak(dtype) over eff x peak(dtype) at the check's table
    cell. `profiles`: catalog name -> profile (default: the shipped ones)."""
    from kvsim.sim.model.cost_model import load_profile
    sustained, _ = load_sustained_compute(path)
    out = []
    for gpu, sc in sustained.items():
        for check in sc.measurements.checks:
            pair = (gpu, get_gpu(check.against).name)
            effs = [table_efficiency(profiles[g] if profiles else load_profile("auto", gpu=g), check.tokens,
                                     check.weight_mib) for g in pair]
            peaks = [get_gpu(g).peak_flops(check.dtype) for g in pair]
            predicted = effs[0] * peaks[0] / (effs[1] * peaks[1])
            out += [CheckResult(gpu, check.what, rnd, a / b, predicted) for rnd, (a, b) in check.measured.items()]
    return out


def all_profiles(operators: Path = SHIPPED_OPERATORS) -> dict[str, HardwareProfile]:
    fits = fitted_profiles(operators)
    profiles = {gpu: fit.profile for gpu, fit in fits.items()}
    sustained, _ = load_sustained_compute()
    for gpu, source in DERIVED.items():
        profiles[gpu] = derived_profile(gpu, profiles[source])
        if gpu in sustained:
            profiles[gpu] = capped_profile(profiles[gpu], sustained[gpu])
    return {gpu: with_host_terms(gpu, p) for gpu, p in profiles.items()}


def with_host_terms(gpu: str, profile: HardwareProfile) -> HardwareProfile:
    meta = dict(profile.meta, host_terms="step_overhead_s and client fitted to published vLLM runs "
                                         "(bench/fit_client_terms.py)")
    return profile.model_copy(update={"step_overhead_s": STEP_OVERHEAD_S,
                                      "client": CLIENT.get(gpu, DEFAULT_CLIENT), "meta": meta})


def profile_text(profile: HardwareProfile) -> str:
    return HEADER + yaml.safe_dump(profile.model_dump(mode="json"), sort_keys=False, default_flow_style=None, width=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with the shipped files instead of writing them")
    ap.add_argument("--operators", type=Path, default=SHIPPED_OPERATORS, help="operator tables (Vidur layout)")
    args = ap.parse_args(argv)
    stale = []
    for gpu, profile in all_profiles(args.operators).items():
        path, text = profile_file(gpu), profile_text(profile)
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path))
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print("stale: " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
