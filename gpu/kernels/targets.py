"""Compile the Triton kernels for real GPU targets without a GPU, and read their resource use.

The triton wheel carries ptxas and cuobjdump, so `triton.compile` builds a cubin for sm_80 (A100),
sm_89 (L4/L40) or sm_90 (H100/H200) on any machine. Each kernel is compiled exactly as its Python
wrapper launches it: the wrapper runs on small CPU tensors shaped like a catalog model's cache
(`LaunchCase`), the launches are recorded instead of executed, and each one's arguments are turned
into a signature the way Triton's launcher specializes them (unit strides become constants,
multiples of 16 get the divisibility hint, tensors are 16-byte aligned). `cuobjdump
--dump-resource-usage` then gives registers, stack (spills and local arrays), local and shared memory.

Compiling needs TRITON_INTERPRET=0 before the kernels are defined, so it runs in a child process
(`compile_cases`); the parent's interpreter setting is untouched. Triton's on-disk cache makes a
repeated compile of unchanged kernels cheap.

    python -m kvsim.gpu.kernels.targets [--arch 80 89 90] [--cases suite|catalog] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

ARCHS = (80, 89, 90)
# Shared memory one block may use (opt-in maximum), bytes: A100 163 KiB, L4/L40 99 KiB, H100 227 KiB.
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
REGISTERS_PER_SM = 65536
MAX_THREADS_PER_SM = {80: 2048, 86: 1536, 89: 1536, 90: 2048}


@dataclass(frozen=True)
class LaunchCase:
    """One wrapper call at a catalog shape; every kernel launch it makes is compiled."""
    name: str                  # e.g. decode/llama-3.1-8b/bs16
    op: str                    # decode | decode_stats | quant_decode | quant_stats | cache_write | copy_slots
    head_dim: int
    kv_heads: int
    group: int
    dtype: str = "bfloat16"
    block_size: int = 16
    layout: str = "shared"
    num_splits: int = 1
    select: bool = False
    group_max: bool = False


@dataclass(frozen=True)
class Resources:
    case: str
    kernel: str
    arch: int
    registers: int
    stack: int          # bytes of stack frame per thread (register spills and local arrays)
    local: int          # bytes of local memory per thread
    shared: int         # bytes of shared memory per block (static + dynamic, as launched)
    num_warps: int
    constants: str      # the launch's shape constants, e.g. HEAD_DIM=128 GROUP=4 TILE=64

    @property
    def spills(self) -> bool:
        return self.stack > 0 or self.local > 0

    @property
    def shared_ok(self) -> bool:
        return self.shared <= SHARED_LIMIT[self.arch]

    def blocks_per_sm(self) -> int:
        """Resident blocks per SM allowed by registers, threads and shared memory."""
        threads = 32 * self.num_warps
        by_regs = REGISTERS_PER_SM // max(1, self.registers * threads)
        by_threads = MAX_THREADS_PER_SM[self.arch] // threads
        by_shared = SHARED_LIMIT[self.arch] // self.shared if self.shared else by_threads
        return max(0, min(by_regs, by_threads, by_shared, 32))


def catalog_shapes() -> list[tuple[str, int, int, int, str]]:
    """(model, head_dim, kv_heads, group, kv dtype) of every GPU-sized catalog model."""
    from kvsim.sim.model.catalog import list_models
    out = []
    for m in list_models():
        dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(m.kv_dtype, "bfloat16")
        out.append((m.name.lower(), m.head_dim, m.num_kv_heads, m.num_heads // m.num_kv_heads, dtype))
    return out


def suite_cases() -> list[LaunchCase]:
    """What the test suite compiles: every kernel, both head dims, GQA groups 1-8, block sizes
    16/32, fp16/bf16, both layouts, split and unsplit, selection masks, both quantized statistics."""
    return [
        LaunchCase("decode/llama-3.1-8b/bs16", "decode", 128, 8, 4),
        LaunchCase("decode/llama-3.1-70b/bs32/split", "decode", 128, 8, 8, block_size=32, num_splits=4),
        LaunchCase("decode/llama-2-7b/fp16/per_head", "decode", 128, 32, 1, dtype="float16", layout="per_head"),
        LaunchCase("decode/llama-3.2-1b/bs32/select", "decode", 64, 8, 4, block_size=32, select=True),
        LaunchCase("decode_stats/qwen2.5-7b/split", "decode_stats", 128, 4, 7, num_splits=4),
        LaunchCase("decode_stats/smollm2-135m/bs32", "decode_stats", 64, 3, 3, block_size=32),
        LaunchCase("quant_decode/llama-3.1-8b/split", "quant_decode", 128, 8, 4, num_splits=4),
        LaunchCase("quant_stats/llama-3.2-1b/fp16/max", "quant_stats", 64, 8, 4, dtype="float16", group_max=True),
        LaunchCase("cache_write/llama-3.1-8b", "cache_write", 128, 8, 4),
        LaunchCase("cache_write/opt-1.3b/fp16/per_head", "cache_write", 64, 32, 1, dtype="float16",
                   layout="per_head"),
        LaunchCase("copy_slots/llama-3.1-8b", "copy_slots", 128, 8, 4),
    ]


def catalog_cases() -> list[LaunchCase]:
    """Every catalog model shape x block size 16/32: decode (with split-KV), statistics, quantized
    decode and statistics, cache write (the docs table)."""
    cases = []
    for model, D, H, group, dtype in catalog_shapes():
        for bs in (16, 32):
            base = dict(head_dim=D, kv_heads=H, group=group, dtype=dtype, block_size=bs)
            cases += [LaunchCase(f"decode/{model}/bs{bs}", "decode", num_splits=4, **base),
                      LaunchCase(f"decode_stats/{model}/bs{bs}", "decode_stats", **base),
                      LaunchCase(f"cache_write/{model}/bs{bs}", "cache_write", **base)]
        base = dict(head_dim=D, kv_heads=H, group=group, dtype=dtype)
        cases += [LaunchCase(f"quant_decode/{model}", "quant_decode", num_splits=4, **base),
                  LaunchCase(f"quant_stats/{model}", "quant_stats", group_max=True, **base)]
    return cases


# ---- child process: run the wrappers on CPU tensors, record the launches, compile them ----

def _run_case(case: LaunchCase) -> None:
    """Call the op's wrapper with backend="triton" on tiny CPU tensors of the case's shape."""
    import torch
    dtype = getattr(torch, case.dtype)
    D, H, G, bs = case.head_dim, case.kv_heads, case.group, case.block_size
    B, M, NB = 2, 8, 64
    if case.op in ("decode", "decode_stats"):
        from kvsim.gpu.kernels.paged_attention import PagedKV, paged_decode_attention
        if case.layout == "shared":
            k = torch.zeros(NB, bs, H, D, dtype=dtype)
            v = torch.zeros_like(k)
        else:
            k = torch.zeros(NB * H, bs, D, dtype=dtype)[:, :, None, :].expand(NB * H, bs, H, D)
            v = k.clone().as_strided(k.shape, k.stride())
        tables = torch.zeros(B, H, M, dtype=torch.int32)
        live = torch.zeros(k.shape[0], bs, dtype=torch.bool)
        sel = torch.ones(B, H, M * bs, dtype=torch.bool) if case.select else None
        paged_decode_attention(torch.zeros(B, H * G, D, dtype=dtype), PagedKV(k, v, live), tables, 0.1,
                               want_scores=case.op == "decode_stats", backend="triton", slot_mask=sel,
                               num_splits=case.num_splits)
    elif case.op in ("quant_decode", "quant_stats"):
        from kvsim.gpu.quant import MixedPrecisionKVCache
        from kvsim.gpu.kernels.quant_attention import mixed_decode_attention
        cache = MixedPrecisionKVCache(NB, bs * D * 2, D, precisions=("K8V4", "K4V2"))
        tables = torch.zeros(B * H, M, dtype=torch.int32)
        mixed_decode_attention(cache, torch.zeros(B * H, G, D, dtype=dtype), tables, 0.1,
                               want_scores=case.op == "quant_stats", backend="triton", group_max=case.group_max,
                               num_splits=case.num_splits)
    elif case.op == "cache_write":
        from kvsim.gpu.kernels.cache_ops import reshape_and_cache
        T = 4
        if case.layout == "shared":
            kc = torch.zeros(NB, bs, H, D, dtype=dtype)
            slots = torch.zeros(T, dtype=torch.long)
        else:
            kc = torch.zeros(NB * H, bs, D, dtype=dtype)
            slots = torch.zeros(T, H, dtype=torch.long)
        reshape_and_cache(torch.zeros(T, H, D, dtype=dtype), torch.zeros(T, H, D, dtype=dtype), kc, kc.clone(),
                          slots, torch.zeros(kc.shape[0], bs, dtype=torch.bool), backend="triton")
    elif case.op == "copy_slots":
        from kvsim.gpu.kernels.cache_ops import copy_slots
        pool = torch.zeros(4, NB, bs, H, D, dtype=dtype)
        copy_slots(pool, pool.clone(), torch.zeros(NB, bs, dtype=torch.bool), torch.tensor([0, 1]),
                   torch.tensor([2, 3]), backend="triton")
    else:
        raise ValueError(f"unknown op {case.op!r}")


_TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "int32": "i32", "int64": "i64",
          "uint8": "u8", "int8": "i8"}


def _signature(fn, args: tuple, kwargs: dict):
    """(signature, constexprs, attrs, options) as Triton's launcher specializes these arguments."""
    import torch
    names = fn.arg_names
    values = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}      # args bind the leading names; the rest come by keyword
    options = {k: v for k, v in kwargs.items() if k not in names}
    sig, const, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(names, fn.params, strict=True)):
        value = values[name]
        if param.is_constexpr:
            sig[name], const[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            sig[name] = "*" + _TYPES[str(value.dtype).removeprefix("torch.")]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            sig[name] = "i1"
        elif isinstance(value, int):
            if value == 1:
                sig[name], const[name] = "constexpr", 1
                continue
            sig[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: cannot specialize argument {name}={value!r}")
    shape = " ".join(f"{k}={v}" for k, v in const.items() if k.isupper())
    return sig, const, attrs, options, shape


def _resource_usage(cubin: bytes, kernel: str) -> dict[str, int]:
    import triton
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    line = next(ln for ln in text.splitlines()[text.splitlines().index(f" Function {kernel}:"):]
                if "REG:" in ln)
    return {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", line)}


def _compile_worker(cases: list[LaunchCase], archs: list[int]) -> list[Resources]:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("0", ""):
        raise RuntimeError("compiling for GPU targets needs TRITON_INTERPRET=0 before the kernels are imported")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    launches = []
    JITFunction.run = lambda self, *args, grid, warmup, **kwargs: launches.append((self, args, kwargs))
    out = []
    for case in cases:
        launches.clear()
        _run_case(case)
        for fn, args, kwargs in launches:
            sig, const, attrs, options, shape = _signature(fn, args, kwargs)
            for arch in archs:
                compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                                          target=GPUTarget("cuda", arch, 32), options=options)
                use = _resource_usage(compiled.asm["cubin"], fn.__name__)
                out.append(Resources(case.name, fn.__name__, arch, use["REG"], use["STACK"], use["LOCAL"],
                                     max(use["SHARED"], compiled.metadata.shared), compiled.metadata.num_warps,
                                     shape))
    return out


# ---- parent side ----

def compile_cases(cases: list[LaunchCase], archs=ARCHS, timeout: float = 1800) -> list[Resources]:
    """Compile every launch of `cases` for each arch in a child process; resource use per launch."""
    payload = json.dumps({"cases": [asdict(c) for c in cases], "archs": list(archs)})
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-m", "kvsim.gpu.kernels.targets", "--worker"], input=payload,
                          capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"compiling for sm_{'/'.join(map(str, archs))} failed:\n{proc.stderr[-4000:]}")
    return [Resources(**r) for r in json.loads(proc.stdout.splitlines()[-1])]


def markdown_table(rows: list[Resources]) -> str:
    lines = ["| case | kernel | shape constants | warps | " + " | ".join(
        f"sm_{a} REG/STACK/SHARED" for a in sorted({r.arch for r in rows})) + " |"]
    lines.append("|" + "---|" * (4 + len({r.arch for r in rows})))
    by_key: dict[tuple, dict[int, Resources]] = {}
    for r in rows:
        by_key.setdefault((r.case, r.kernel, r.constants, r.num_warps), {})[r.arch] = r
    for (case, kernel, shape, warps), per_arch in by_key.items():
        cells = [f"{r.registers}/{r.stack}/{r.shared}" for _, r in sorted(per_arch.items())]
        lines.append(f"| {case} | `{kernel}` | {shape} | {warps} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvsim.gpu.kernels.targets", description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=list(ARCHS), choices=sorted(SHARED_LIMIT),
                        help="SM versions (default 80 89 90)")
    parser.add_argument("--cases", choices=("suite", "catalog"), default="suite",
                        help="suite: the test suite's launches; catalog: every catalog model x block size")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        spec = json.loads(sys.stdin.read())
        rows = _compile_worker([LaunchCase(**c) for c in spec["cases"]], spec["archs"])
        print(json.dumps([asdict(r) for r in rows]))
        return 0
    rows = compile_cases(suite_cases() if args.cases == "suite" else catalog_cases(), args.arch)
    print(markdown_table(rows))
    bad = [r for r in rows if r.spills or not r.shared_ok]
    for r in bad:
        print(f"sm_{r.arch} {r.case} {r.kernel}: stack {r.stack} B, local {r.local} B, shared {r.shared} B "
              f"(limit {SHARED_LIMIT[r.arch]})", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
