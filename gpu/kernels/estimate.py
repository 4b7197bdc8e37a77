"""Static time estimate of decode attention at catalog shapes, before any GPU has run it.

Per (model, GPU, batch, context): the bytes the kernels move (every slot of the listed blocks, K and
V, as the cost model charges paged attention), the tensor-core FLOPs of the padded query group,
the roofline time max(bytes / peak HBM bandwidth, FLOPs / peak tensor FLOP/s) from the catalog,
and the share of the GPU the launch can use, from the compiled kernel (`gpu.kernels.targets`):
programs = rows x splits (the split plan the wrapper would pick for the GPU's SM count), and
whether a block fits on an SM at all (registers, shared memory), so

    estimate = roofline / sm_balance(programs, SMs) + launches x LAUNCH_S

where `sm_balance` (gpu.kernels.split_kv) is the share of SM time a launch of equal memory-bound
programs keeps busy. It is an upper bound on speed; docs/gpu.md lists what it leaves out and the
first GPU run measures the rest.

    python -m kvsim.gpu.kernels.estimate [--gpus h100 a100-80gb l4] [--batches 1 8 64] [--contexts 4096] [--out F]
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from kvsim.gpu.kernels.split_kv import group_pad, plan_splits, sm_balance, tile_for
from kvsim.gpu.kernels.targets import LaunchCase, Resources, catalog_shapes, compile_cases

# Streaming multiprocessors and compile target of the catalog GPUs (the catalog carries neither).
# T4 (sm_75, no bf16) is left out: the kernels are compiled and checked for sm_80 and newer.
SMS = {"H100-SXM": 132, "H200": 132, "A100-80GB": 108, "A100-40GB": 108, "A40": 84, "L4": 58, "L40": 142}
ARCH = {"H100-SXM": 90, "H200": 90, "A100-80GB": 80, "A100-40GB": 80, "A40": 86, "L4": 89, "L40": 89}
LAUNCH_S = 4e-6            # per kernel launch (a split adds the reduction kernel's)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Estimate:
    model: str
    gpu: str
    batch: int
    context: int
    block_size: int
    splits: int
    programs: int
    blocks_per_sm: int
    registers: int
    mbytes: float            # MB read and written
    roofline_us: float
    estimate_us: float
    unsplit_us: float        # the same kernel with one program per row (no split-KV)

    @property
    def achieved_fraction(self) -> float:
        """Share of the HBM peak the estimate implies."""
        return self.roofline_us / self.estimate_us


def decode_traffic(head_dim: int, kv_heads: int, group: int, dtype_bytes: int, batch: int, context: int,
                   block_size: int, splits: int) -> tuple[float, float]:
    """(bytes, tensor-core FLOPs) of one decode-attention call over one layer."""
    slots = math.ceil(context / block_size) * block_size          # whole blocks are read
    rows = batch * kv_heads
    kv = rows * slots * head_dim * 2 * dtype_bytes                 # K and V
    side = rows * slots + rows * math.ceil(context / block_size) * 4   # live mask bytes, block table
    qo = 2 * rows * group * head_dim * dtype_bytes
    partial = rows * splits * group * (head_dim + 1) * 4 * 2 if splits > 1 else 0   # written, read back
    flops = 2 * 2 * rows * group_pad(group) * slots * head_dim
    return kv + side + qo + partial, flops


def estimate_decode(model: str, gpu: str, batch: int, context: int, block_size: int,
                    resources: Resources) -> Estimate:
    from kvsim.sim.model.catalog import get_gpu, get_model
    spec, hw = get_model(model), get_gpu(gpu)
    sms = SMS[hw.name]
    if resources.blocks_per_sm() < 1:
        raise ValueError(f"{resources.kernel} at {model} does not fit an sm_{resources.arch} SM: {resources}")
    H, D = spec.num_kv_heads, spec.head_dim
    group = spec.num_heads // H
    dtype_bytes = 2

    def time_us(splits: int) -> tuple[float, float, float, int]:
        nbytes, flops = decode_traffic(D, H, group, dtype_bytes, batch, context, block_size, splits)
        roofline = max(nbytes / hw.mem_bw, flops / hw.peak_flops(spec.kv_dtype))
        programs = batch * H * splits
        efficiency = sm_balance(programs, sms)
        launches = 1 if splits == 1 else 2
        return nbytes, roofline * 1e6, (roofline / efficiency + launches * LAUNCH_S) * 1e6, programs

    plan = plan_splits(batch * H, math.ceil(context / block_size) * block_size, tile_for(D), sms)
    nbytes, roofline, est, programs = time_us(plan.splits)
    return Estimate(spec.name, hw.name, batch, context, block_size, plan.splits, programs,
                    resources.blocks_per_sm(), resources.registers, round(nbytes / 1e6, 3), round(roofline, 2),
                    round(est, 2), round(time_us(1)[2], 2))


def decode_resources(models: list[str], archs: list[int], block_size: int) -> dict[tuple[str, int], Resources]:
    """The compiled decode kernel's resources per (model, arch)."""
    shapes = {m: (D, H, g, dt) for m, D, H, g, dt in catalog_shapes()}
    cases = [LaunchCase(f"decode/{m}", "decode", shapes[m][0], shapes[m][1], shapes[m][2], dtype=shapes[m][3],
                        block_size=block_size) for m in models]
    rows = compile_cases(cases, archs)
    return {(r.case.removeprefix("decode/"), r.arch): r for r in rows if r.kernel == "_paged_decode_kernel"}


def estimate_table(models: list[str], gpus: list[str], batches: list[int], contexts: list[int],
                   block_size: int = 16) -> list[Estimate]:
    from kvsim.sim.model.catalog import get_gpu, get_model
    models = [get_model(m).name.lower() for m in models]
    gpus = [get_gpu(g).name for g in gpus]
    unknown = [g for g in gpus if g not in SMS]
    if unknown:
        raise ValueError(f"no SM count / compile target for {unknown}; known: {', '.join(SMS)}")
    res = decode_resources(models, sorted({ARCH[g] for g in gpus}), block_size)
    return [estimate_decode(m, g, b, c, block_size, res[(m, ARCH[g])])
            for m in models for g in gpus for b in batches for c in contexts]


def markdown(rows: list[Estimate]) -> str:
    head = ("| model | GPU | batch | context | splits | programs | blocks/SM | regs | MB | roofline µs | "
            "estimate µs | unsplit µs |")
    lines = [head, "|" + "---|" * 12]
    for e in rows:
        lines.append(f"| {e.model} | {e.gpu} | {e.batch} | {e.context} | {e.splits} | {e.programs} | "
                     f"{e.blocks_per_sm} | {e.registers} | {e.mbytes:g} | {e.roofline_us:g} | {e.estimate_us:g} | "
                     f"{e.unsplit_us:g} |")
    return "\n".join(lines)


def _positive(text: str) -> int:
    value = int(text) if text.strip().lstrip("-").isdigit() else None
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def _power_of_two(text: str) -> int:
    value = _positive(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"expected a power of two (tokens per KV block), got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvsim.gpu.kernels.estimate", description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["llama-3.1-8b", "llama-3.1-70b", "llama-2-7b",
                                                        "qwen2.5-7b", "llama-3.2-1b"])
    parser.add_argument("--gpus", nargs="+", default=["h100", "a100-80gb", "l4"])
    parser.add_argument("--batches", type=_positive, nargs="+", default=[1, 8, 64])
    parser.add_argument("--contexts", type=_positive, nargs="+", default=[4096])
    parser.add_argument("--block-size", type=_power_of_two, default=16)
    parser.add_argument("--out", type=Path, help="also write the rows as CSV")
    args = parser.parse_args(argv)
    try:
        rows = estimate_table(args.models, args.gpus, args.batches, args.contexts, args.block_size)
    except ValueError as exc:     # an unknown model or GPU, a GPU without an SM count (catalog errors included)
        parser.error(str(exc))
    print(markdown(rows))
    if args.out:
        import pandas as pd
        pd.DataFrame([asdict(e) for e in rows]).to_csv(args.out, index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
