"""Power-limited cards' sustained compute (sim/data/sustained_compute.yaml; docs/gpu-profiles.md
"Power-limited cards"): what was fitted (the cap: the median sustained matmul rate over the catalog's
dense peak) and what it is checked against (never fitted to it).

    python bench/bench_sustained_compute.py

Prints, per capped GPU, its sustained measurements, the cap and its band, and the matmul rate the
source GPU's efficiencies gave at 4,096 rows before the cap; the tool check (the same benchmark on an
unthrottled A40 beside the A40 fit's top efficiencies); the MLPerf ratio checks with the capped and the
uncapped (source-derived) profiles.
"""
from __future__ import annotations

import time

import numpy as np

from kvsim.sim.calibration import regenerate_gpu_profiles as regen
from kvsim.sim.model.catalog import get_gpu
from kvsim.sim.model.cost_model import load_profile


def main() -> None:
    t0 = time.process_time()
    caps, tool = regen.load_sustained_compute()
    print(f"{'gpu':<6}{'power':>7}{'sustained TFLOP/s (n >= min size)':>44}{'cap':>9}{'band':>18}"
          f"{'TFLOP/s':>9}{'uncapped at 4096':>18}")
    for gpu, sc in caps.items():
        m = sc.measurements
        values = [f"{v:g}" for by in m.measured_tflops.values() for n, v in by.items() if n >= m.sustained_min_size]
        source = load_profile(regen.DERIVED[gpu].lower()).gemm_efficiency
        top = float(np.max(source.efficiency[-1])) if source else float("nan")
        peak = get_gpu(gpu).tflops[get_gpu(gpu).compute_dtype("bf16")]
        print(f"{gpu:<6}{m.power_w or 0:>6g}W{', '.join(values):>44}{sc.cap:>9.4f}{f'{sc.low:.4f}-{sc.high:.4f}':>18}"
              f"{sc.tflops:>9.1f}{f'{top * peak:.1f} ({top:.3f})':>18}")
    if tool is not None:
        fit = np.array(load_profile(tool.gpu.lower()).gemm_efficiency.efficiency[-1])
        print(f"\ntool check, {tool.gpu} (unthrottled) with the same benchmark: sustained {tool.cap:.4f} of peak "
              f"(band {tool.low:.4f}-{tool.high:.4f}, {tool.count} figures); the {tool.gpu} fit at 4,096 rows: "
              f"{fit.min():.4f}-{fit.max():.4f} ({tool.cap / fit.max() - 1:+.1%} / {tool.cap / fit.min() - 1:+.1%})")
    uncapped = {gpu: regen.derived_profile(gpu, load_profile(regen.DERIVED[gpu].lower())) for gpu in caps}
    uncapped.update({g: load_profile("auto", gpu=g) for c in caps.values() for k in c.measurements.checks
                     for g in [get_gpu(k.against).name]})
    before = {(r.gpu, r.round): r for r in regen.sustained_checks(uncapped)}
    print(f"\n{'check (held out)':<62}{'round':>6}{'measured':>10}{'capped':>10}{'error':>8}{'uncapped':>10}{'error':>8}")
    for r in regen.sustained_checks():
        b = before[(r.gpu, r.round)]
        print(f"{r.what[:60]:<62}{r.round:>6}{r.measured:>10.4f}{r.predicted:>10.4f}{r.error:>+8.1%}"
              f"{b.predicted:>10.4f}{b.error:>+8.1%}")
    print(f"\n{time.process_time() - t0:.1f} s CPU")


if __name__ == "__main__":
    main()
