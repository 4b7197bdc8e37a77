"""The first thing to run on a lent GPU: every check of the real backend, figures into one folder.

    python -m kvsim.gpu.validate --out runs/gpu-validation        (or bench/gpu_validation.sh OUT)

On CUDA (about 2-5 minutes on an H100, nothing downloaded):
1. kernels.csv: every Triton kernel against its torch twin at Llama-3.1-8B's shape (bf16, head dim
   128, 4 query heads per KV head, block 16): decode attention unsplit and split-KV, with a slot
   mask, its statistics pass, attention over LeanKV mixed-precision pages, cache write, slot copy.
2. decode_bandwidth.csv: decode attention timed (CUDA events, median of repeats) at batch x
   context, bytes moved / time against the GPU's catalog HBM peak and the static estimate
   (`gpu.kernels.estimate`) for the same shape.
3. resources.md: the kernels compiled for this GPU's SM version, registers / stack / shared memory.
4. replay-calibration/, replay-heldout/: `kvsim replay --weights random --device cuda` of a
   calibration workload (closed batches) and of a held-out Poisson trace at Llama-3.1-8B shape;
   profile.yaml: `kvsim calibrate` fitted on the first; crosscheck/: `kvsim crosscheck --real` of
   the simulator with that profile against the second (report.md). The held-out trace is replayed
   twice (replay-heldout-2/, crosscheck-2/): the two cross-checks differ by the backend's own
   replay-to-replay timing noise, and the summary gives each replay's median decode step.
5. summary.md: the figures above in one page.

On CPU (`--tiny`, the default without CUDA) the same steps run at tiny sizes (SmolLM2-135M shape,
Triton interpreter, a few requests) in a minute or two, so the script is exercised by the test
suite and cannot rot; its timings mean nothing.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd


@dataclass(frozen=True)
class Plan:
    model: str
    device: str
    dtype: str
    block_size: int
    num_gpu_blocks: int | None
    kernel_shape: tuple[int, int, int]            # kv heads, group, head dim
    kernel_batch: int
    kernel_context: int
    bench_batches: tuple[int, ...]
    bench_contexts: tuple[int, ...]
    repeats: int
    calibration: tuple[tuple[int, int, int], ...]   # closed batches (n, prompt, output)
    heldout: dict
    compile: bool
    threads: int | None = None                       # torch threads of the replays
    policy_model: str = "llama-3.2-1b"               # random weights for the policy replays
    policy_layers: int | None = None                 # keep only the first N layers there
    policies: dict | None = None                     # their workload and budget
    heldout_replays: int = 2                         # each cross-checked: their spread is the backend's timing noise



FULL = Plan("llama-3.1-8b", "cuda", "bfloat16", 16, None, (8, 4, 128), 8, 4096, (1, 8, 32, 128),
            (1024, 4096, 16384), 20, tuple((b, p, 32) for b in (1, 4, 16, 48) for p in (256, 1024, 2048)),
            dict(n=48, rate=6.0, prompt="uniform:128,2048", output="uniform:16,192", seed=3), True,
            policies=dict(n=12, rate=8.0, prompt="uniform:256,1024", output="uniform:32,96", budget=128,
                          time_limit_s=90, kv_tokens=32768))
# policy replays: a KV pool of kv_tokens, not the device's free memory: per-head blocks of a 1B model on an
# H200 number 30 million, and every invariant check walks the pool
# calibration: batches up to 48 and prompts up to 2,048 tokens, so the held-out trace (up to 48 running,
# contexts up to ~2,200) is interpolated, not extrapolated (with batches <= 16 the fitted per-sequence
# terms overpredicted its batch-48 decode steps 2x on an H100)
# calibration: 2 batches give 2 prefill and 14 decode steps (calibrate needs 14 steps; so few identify
# little, but it fits and writes a profile); one torch thread: the suite runs with -n 2 on 2 cores
TINY = Plan("smollm2-135m", "cpu", "float32", 16, 64, (3, 3, 64), 2, 200, (2,), (160,), 1,
            ((1, 16, 8), (3, 40, 8)), dict(n=3, rate=5.0, prompt="uniform:8,40", output="uniform:2,5", seed=3),
            False, threads=1, policy_model="smollm2-135m", policy_layers=2,
            policies=dict(n=2, rate=5.0, prompt="uniform:24,40", output="uniform:4,8", budget=16,
                          time_limit_s=300))


def _cache(torch, plan: Plan, H: int, D: int, num_blocks: int, seed: int):
    from kvsim.gpu.cache import CacheGeometry, PagedKVCache
    gen = torch.Generator(device=plan.device).manual_seed(seed)
    cache = PagedKVCache(CacheGeometry("shared", 1, H, D, num_blocks), plan.block_size, dtype=getattr(torch, plan.dtype),
                         device=plan.device)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen, device=plan.device))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen, device=plan.device))
    cache.live.copy_(torch.rand(cache.live.shape, generator=gen, device=plan.device) > 0.2)
    return cache


def _tables(torch, plan: Plan, batch: int, H: int, context: int, num_blocks: int, seed: int):
    width = math.ceil(context / plan.block_size)
    gen = torch.Generator().manual_seed(seed)
    t = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in range(batch)]).int()
    return t[:, None, :].expand(batch, H, width).to(plan.device)


def check_kernels(plan: Plan) -> pd.DataFrame:
    """Each Triton kernel against its torch twin on the plan's device; max abs error per output."""
    import torch
    from kvsim.gpu.kernels.cache_ops import copy_slots, reshape_and_cache
    from kvsim.gpu.kernels.paged_attention import PagedKV, paged_decode_attention
    from kvsim.gpu.kernels.quant_attention import mixed_decode_attention
    from kvsim.gpu.quant import MixedPrecisionKVCache
    H, G, D = plan.kernel_shape
    B, ctx = plan.kernel_batch, plan.kernel_context
    dtype = getattr(torch, plan.dtype)
    tol = 2e-2 if dtype != torch.float32 else 1e-4
    num_blocks = B * math.ceil(ctx / plan.block_size) + 8
    cache = _cache(torch, plan, H, D, num_blocks, 0)
    tables = _tables(torch, plan, B, H, ctx, num_blocks, 1)
    q = torch.randn(B, H * G, D, device=plan.device).to(dtype)
    kc, vc = cache.layer_view(0)
    select = torch.rand(B, H, tables.shape[-1] * plan.block_size, device=plan.device) > 0.5
    rows = []

    def record(kernel, variant, got, ref, tolerance):
        err = float((got.float() - ref.float()).abs().max())
        rows.append(dict(kernel=kernel, variant=variant, max_abs_error=err, tolerance=tolerance, ok=err <= tolerance))

    ref_out, (ref_sum, ref_sq) = paged_decode_attention(q, PagedKV(kc, vc, cache.live), tables, D ** -0.5, True, "torch")
    for variant, splits in (("unsplit", 1), ("split-kv x4", 4), ("split-kv auto", None)):
        out, (s, sq) = paged_decode_attention(q, PagedKV(kc, vc, cache.live), tables, D ** -0.5, True, "triton",
                                              num_splits=splits)
        record("paged_decode_attention", variant, out, ref_out, tol)
        record("paged_decode_attention stats (sum)", variant, s, ref_sum, 1e-3)
        record("paged_decode_attention stats (sum sq)", variant, sq, ref_sq, 1e-3)
    sel_ref, _ = paged_decode_attention(q, PagedKV(kc, vc, cache.live), tables, D ** -0.5, False, "torch", select)
    sel_out, _ = paged_decode_attention(q, PagedKV(kc, vc, cache.live), tables, D ** -0.5, False, "triton", select)
    record("paged_decode_attention", "slot mask", sel_out, sel_ref, tol)

    page_tokens = 32
    pages = MixedPrecisionKVCache(B * H * (ctx // page_tokens + 2), page_tokens * D, D, device=plan.device)
    per_row = math.ceil(ctx / pages.max_tokens)
    page_tables = torch.arange(B * H * per_row, device=plan.device, dtype=torch.int32).view(B * H, per_row)
    pages.assign(page_tables[:, ::2].reshape(-1), "K8V4")
    pages.assign(page_tables[:, 1::2].reshape(-1), "K4V2")
    for t, tier in enumerate(pages.tiers):
        ids = (pages.page_tier == t).nonzero().view(-1)
        cap = pages.capacity[t]
        slots = (ids[:, None] * pages.max_tokens + torch.arange(cap, device=plan.device)).view(-1)
        pages.write(slots, torch.randn(len(slots), D, device=plan.device), torch.randn(len(slots), D, device=plan.device))
    qq = q.view(B * H, G, D)
    ref_o, (ref_s, ref_m) = mixed_decode_attention(pages, qq, page_tables, D ** -0.5, True, "torch", group_max=True)
    for variant, splits in (("unsplit", 1), ("split-kv auto", None)):
        out, (s, m) = mixed_decode_attention(pages, qq, page_tables, D ** -0.5, True, "triton", group_max=True,
                                             num_splits=splits)
        record("mixed_decode_attention", variant, out, ref_o, tol)
        record("mixed_decode_attention stats (sum)", variant, s, ref_s, 1e-3)
        record("mixed_decode_attention stats (max)", variant, m, ref_m, 1e-3)

    T = 2 * B
    key, value = torch.randn(T, H, D, device=plan.device).to(dtype), torch.randn(T, H, D, device=plan.device).to(dtype)
    slots = torch.randperm(num_blocks * plan.block_size)[:T].to(plan.device)
    caches = [_cache(torch, plan, H, D, num_blocks, 5) for _ in range(2)]
    for c, backend in zip(caches, ("torch", "triton")):
        reshape_and_cache(key, value, c.k[0], c.v[0], slots, c.live, backend=backend)
    record("reshape_and_cache", "shared", caches[1].k, caches[0].k, 0.0)
    src, dst = slots[:B], slots[B:]
    for c, backend in zip(caches, ("torch", "triton")):
        copy_slots(c.k, c.v, c.live, src, dst, move=True, backend=backend)
    record("copy_slots", "move", caches[1].v, caches[0].v, 0.0)
    record("copy_slots", "move (live)", caches[1].live, caches[0].live, 0.0)
    return pd.DataFrame(rows)


def _time_s(torch, fn, plan: Plan) -> float:
    fn()
    if plan.device != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    return _median_event_time_s(torch, fn, plan.repeats)


def _median_event_time_s(torch, fn, repeats: int) -> float:
    """Median over `repeats` calls of `fn`, each timed between two CUDA events."""
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def _graph_time_s(torch, fn, plan: Plan) -> float:
    """Median time of `fn` captured in a CUDA graph and replayed: the kernels alone, without the host
    work of launching them (as vLLM runs decode steps); NaN off CUDA or where capture fails."""
    if plan.device != "cuda":
        return math.nan
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as exc:
        print(f"  CUDA graph capture failed ({exc}); graph_us left empty")
        return math.nan
    graph.replay()
    return _median_event_time_s(torch, graph.replay, plan.repeats)


def bench_decode(plan: Plan, gpu: str | None) -> pd.DataFrame:
    """Decode attention time and achieved bandwidth at batch x context (one layer)."""
    import torch
    from kvsim.gpu.kernels.estimate import SMS, decode_traffic
    from kvsim.gpu.kernels.paged_attention import PagedKV, paged_decode_attention
    from kvsim.gpu.kernels.split_kv import plan_splits, tile_for
    from kvsim.sim.model.catalog import get_gpu
    H, G, D = plan.kernel_shape
    dtype = getattr(torch, plan.dtype)
    peak = get_gpu(gpu).mem_bw if gpu else None
    sms = SMS.get(get_gpu(gpu).name) if gpu else None
    rows = []
    for batch in plan.bench_batches:
        for context in plan.bench_contexts:
            num_blocks = batch * math.ceil(context / plan.block_size) + 1
            cache_bytes = num_blocks * plan.block_size * H * D * 2 * dtype.itemsize
            if plan.device == "cuda" and 4 * cache_bytes > torch.cuda.mem_get_info()[0]:
                print(f"  batch {batch} x context {context}: skipped, {cache_bytes / 1e9:.1f} GB of cache "
                      f"(x4 while filling it) exceeds the free device memory")
                continue
            cache = kc = vc = live = None      # the previous size's cache is freed before this one is filled
            cache = _cache(torch, plan, H, D, num_blocks, 2)
            tables = _tables(torch, plan, batch, H, context, num_blocks, 3)
            q = torch.randn(batch, H * G, D, device=plan.device).to(dtype)
            kc, vc = cache.layer_view(0)
            live = cache.live
            for label, splits in (("auto", None), ("unsplit", 1)):
                def call(n=splits):
                    return paged_decode_attention(q, PagedKV(kc, vc, live), tables, D ** -0.5, backend="triton", num_splits=n)
                seconds, graph_seconds = _time_s(torch, call, plan), _graph_time_s(torch, call, plan)
                chosen = splits or (plan_splits(batch * H, tables.shape[-1] * plan.block_size, tile_for(D),
                                                sms).splits if sms else 1)
                nbytes, _ = decode_traffic(D, H, G, dtype.itemsize, batch, context, plan.block_size, chosen)
                rows.append(dict(batch=batch, context=context, splits=label, num_splits=chosen, time_us=seconds * 1e6,
                                 graph_us=graph_seconds * 1e6, mbytes=nbytes / 1e6,
                                 achieved_gbps=nbytes / seconds / 1e9, graph_gbps=nbytes / graph_seconds / 1e9,
                                 peak_fraction=(nbytes / seconds / peak) if peak else math.nan,
                                 graph_peak_fraction=(nbytes / graph_seconds / peak) if peak else math.nan))
    return pd.DataFrame(rows)


def _kvsim(args: list[str], log: Path, timeout_s: float | None = None) -> str:
    """Run a kvsim command as a user would (`python -m kvsim.sim.cli`); its output goes to `log`.
    Past `timeout_s` the command is stopped (SIGINT first, so a replay writes its partial result)."""
    cmd = [sys.executable, "-m", "kvsim.sim.cli", *args]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=dict(os.environ, COLUMNS="200")) as proc:
        stopped = False
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stopped = True
            proc.send_signal(signal.SIGINT)
            try:
                stdout, stderr = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, stderr = proc.communicate()
    log.write_text(f"$ kvsim {' '.join(args)}\n{stdout}\n{stderr}")
    if stopped:
        raise RuntimeError(f"kvsim {args[0]} stopped after {timeout_s:.0f} s (time limit); see {log}")
    proc = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    if proc.returncode:
        raise RuntimeError(f"kvsim {args[0]} failed (exit {proc.returncode}); see {log}:\n{proc.stderr[-2000:]}")
    return proc.stdout


def _replay_options(plan: Plan, model: str, num_gpu_blocks: int | None = None) -> list[str]:
    """`kvsim replay` options of the validation's replays of `model` (random weights on plan.device)."""
    # timing replays: no attention statistics (their fp32 pass at the end of each prompt is not engine work)
    args = ["--model", model, "--weights", "random", "--device", plan.device, "--dtype", plan.dtype,
            "--block-size", str(plan.block_size), "--seed", "0", "--quiet", "--no-attention-stats"]
    if num_gpu_blocks or plan.num_gpu_blocks:
        args += ["--num-gpu-blocks", str(num_gpu_blocks or plan.num_gpu_blocks)]
    if plan.threads:
        args += ["--threads", str(plan.threads)]
    return args


def replay_and_crosscheck(plan: Plan, out: Path, gpu: str | None) -> dict:
    from kvsim.traces.synthetic import closed_batch, synthesize
    from kvsim.traces.trace import Trace
    import yaml
    parts = [closed_batch(n, p, o) for n, p, o in plan.calibration]
    for i, t in enumerate(parts):
        t.df["arrival_time_s"] = i * 1000.0                    # one batch at a time (idle gaps are skipped)
    calibration = Trace.concat(parts, how="overlay").save(out / "calibration.jsonl")
    heldout = synthesize(plan.heldout["n"], rate=plan.heldout["rate"], prompt=plan.heldout["prompt"],
                         output=plan.heldout["output"], seed=plan.heldout["seed"], name="heldout").save(out / "heldout.jsonl")
    common = _replay_options(plan, plan.model) + (["--gpu", gpu] if gpu else [])
    # the held-out trace replayed more than once: a replay's step times move between runs (the eager
    # backend's steps are host-bound), and the cross-check of each shows by how much
    replays = [("calibration", calibration)] + [(_numbered("heldout", r), heldout)
                                                for r in range(1, plan.heldout_replays + 1)]
    for name, trace in replays:
        _kvsim(["replay", "--trace", str(trace), *common, "--out", str(out / f"replay-{name}")],
               out / f"replay-{name}.log")
    cfg = yaml.safe_load((out / "replay-heldout" / "config.yaml").read_text())
    gpu_name, blocks = cfg["gpu"], cfg["engine"]["num_gpu_blocks"]
    base = _base_profile(plan, str(gpu_name))
    fit = _kvsim(["calibrate", str(out / "replay-calibration"), "--out", str(out / "profile.yaml"), "--model",
                  plan.model, "--gpu", str(gpu_name), "--base-profile", base], out / "calibrate.log")
    lines = []
    for r in range(1, plan.heldout_replays + 1):
        cc = _kvsim(["crosscheck", "--trace", str(heldout), "--profile", str(out / "profile.yaml"), "--model",
                     plan.model, "--gpu", str(gpu_name), "--device", plan.device, "--num-gpu-blocks", str(blocks),
                     "--block-size", str(plan.block_size), "--real", str(out / f"replay-{_numbered('heldout', r)}"),
                     "--out", str(out / _numbered("crosscheck", r))], out / f"{_numbered('crosscheck', r)}.log")
        lines += [f"held-out replay {r}: {ln}" for ln in cc.splitlines() if "MAPE" in ln]
    medians = ", ".join(f"{name} {_median_decode_ms(_steps_of(out / f'replay-{name}')):.2f}" for name, _ in replays)
    return {"gpu": gpu_name, "num_gpu_blocks": blocks, "calibrate": fit.strip().splitlines()[-12:],
            "crosscheck": lines + [f"median pure-decode step (ms): {medians}"]}


def _steps_of(replay: Path) -> pd.DataFrame:
    return pd.read_parquet(replay / "steps.parquet", columns=["num_prefill_seqs", "duration_s"])


def _numbered(name: str, r: int) -> str:
    """The r-th of a repeated output's names: name, name-2, name-3, ..."""
    return name if r == 1 else f"{name}-{r}"


def _median_decode_ms(steps: pd.DataFrame) -> float:
    """Median duration of a step log's pure-decode steps (no prefill sequence), in ms (NaN without any)."""
    decode = steps.duration_s[steps.num_prefill_seqs == 0]
    return 1e3 * float(decode.median()) if len(decode) else math.nan


def compiled_resources(out: Path) -> str:
    import torch
    from kvsim.gpu.kernels.targets import compile_cases, markdown_table, suite_cases
    major, minor = torch.cuda.get_device_capability()
    rows = compile_cases(suite_cases(), [10 * major + minor])
    table = markdown_table(rows)
    (out / "resources.md").write_text(table + "\n")
    return table


# (label, kvsim replay options): the eviction and compression paths of the real backend, each replayed
# with --check-invariants (the cache's live slots and tiers must equal the KV manager's every step)
POLICY_RUNS = (
    ("h2o free_block", ["--policy", "h2o", "--layout", "per_head", "--slot-strategy", "free_block"]),
    ("h2o slot_reuse", ["--policy", "h2o", "--layout", "per_head", "--slot-strategy", "slot_reuse"]),
    ("streaming", ["--policy", "streaming", "--layout", "per_head"]),
    ("leankv", ["--policy", "leankv", "--layout", "per_head"]),
    ("quest", ["--policy", "quest"]),
)


def replay_policies(plan: Plan, out: Path) -> pd.DataFrame:
    """Each POLICY_RUNS entry replayed on the device (random weights at plan.policy_model; h2o and
    quest keep plan.policies["budget"] tokens, streaming a window of as many): steps, evictions, bytes
    moved, p99 fragmentation, decode step median."""
    from kvsim.traces.synthetic import synthesize
    trace = synthesize(plan.policies["n"], rate=plan.policies["rate"], prompt=plan.policies["prompt"],
                       output=plan.policies["output"], seed=4, name="policies").save(out / "policies.jsonl")
    common = _replay_options(plan, plan.policy_model, _policy_pool_blocks(plan))
    rows = []
    for label, options in POLICY_RUNS:
        budget = ["--budget", str(plan.policies["budget"])] if options[1] in ("h2o", "quest") else []
        run_dir = out / "policies" / label.replace(" ", "-")
        args = ["replay", "--trace", str(trace), *common,
                "--check-invariants", *options, *budget, "--out", str(run_dir)]
        if label.startswith("streaming"):
            window = plan.policies["budget"]
            args += ["--set", f"kv.params.window={window - 4}", "--set", "kv.params.sink=4"]
        if plan.policy_layers:
            args += ["--layers", str(plan.policy_layers)]
        try:
            _kvsim(args, run_dir.with_suffix(".log"), timeout_s=plan.policies["time_limit_s"])
        except RuntimeError as exc:
            rows.append(dict(policy=label, ok=False, error=str(exc).splitlines()[-1][:200]))
            continue
        steps = pd.read_parquet(run_dir / "steps.parquet")
        summary = json.loads((run_dir / "summary.json").read_text())
        rows.append(dict(policy=label, ok=True, error="", steps=len(steps), finished=summary["num_finished"],
                         evicted_tokens=int(steps.evicted_tokens.sum()),
                         mbytes_moved=float(steps.bytes_moved.sum()) / 1e6,
                         fragmentation_p99=float(steps.fragmentation.quantile(0.99)),
                         decode_step_ms=_median_decode_ms(steps)))
    return pd.DataFrame(rows)


def _policy_pool_blocks(plan: Plan) -> int | None:
    """Token blocks holding plan.policies["kv_tokens"] (a per-head layout splits each into layers x KV heads)."""
    tokens = plan.policies.get("kv_tokens")
    return -(-tokens // plan.block_size) if tokens else None


def _gpu_for_device(device: str) -> str | None:
    """The catalog GPU of this CUDA device (longest names first: "L40" before "L4"; A100 by memory)."""
    if device != "cuda":
        return None
    import torch
    from kvsim.sim.model.catalog import get_gpu
    name = torch.cuda.get_device_name().upper()
    gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    labels = (("H200", "h200"), ("H100", "h100"), ("A100", "a100-80gb" if gib > 48 else "a100-40gb"),
              ("L40", "l40"), ("L4", "l4"), ("A40", "a40"), ("T4", "t4"))
    key = next((k for label, k in labels if label in name), None)
    return get_gpu(key).name if key else None


def _base_profile(plan: Plan, gpu_name: str) -> str:
    """The shipped profile of this GPU if there is one (the fit starts from it), else `default`."""
    if plan.device == "cpu":
        return "cpu-2core"
    from kvsim.sim.model.cost_model import list_profiles
    return gpu_name.lower() if gpu_name.lower() in list_profiles() else "default"


def _step(what: str, started: float) -> None:
    print(f"[{time.time() - started:6.1f} s, cpu {time.process_time():6.1f} s] {what} ...", flush=True)


def _versions(device: str) -> str:
    import torch
    import triton
    where = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return f"device {where}; torch {torch.__version__}; triton {triton.__version__}"


def _write_summary(out: Path, sections: list[str], started: float, done: bool) -> None:
    status = "total" if done else "incomplete: still running after"
    (out / "summary.md").write_text("\n".join([*sections, f"{status} {time.time() - started:.0f} s"]) + "\n")


def _markdown(df: pd.DataFrame) -> str:
    """A pipe table (pandas' to_markdown needs tabulate, not a dependency)."""
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)   # noqa: E731
    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


def run(out: Path, plan: Plan, gpu: str | None = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    gpu = gpu or _gpu_for_device(plan.device)
    started = time.time()
    sections = [f"# GPU validation ({'tiny, CPU' if plan.device == 'cpu' else gpu or plan.device})", "",
                f"plan: {plan}", "", _versions(plan.device), ""]
    _step("kernels vs torch twins", started)
    kernels = check_kernels(plan)
    kernels.to_csv(out / "kernels.csv", index=False)
    sections += ["## Kernels vs torch twins", "", _markdown(kernels), ""]
    _write_summary(out, sections, started, done=False)
    _step("decode attention timings", started)
    bench = bench_decode(plan, gpu)
    if gpu and plan.device == "cuda":
        from kvsim.gpu.kernels.estimate import estimate_table
        est = pd.DataFrame([e.__dict__ for e in estimate_table([plan.model], [gpu], list(plan.bench_batches),
                                                               list(plan.bench_contexts), plan.block_size)])
        est.to_csv(out / "estimates.csv", index=False)
        bench = bench.merge(est[["batch", "context", "estimate_us", "unsplit_us"]], on=["batch", "context"], how="left")
    bench.to_csv(out / "decode_bandwidth.csv", index=False)
    sections += ["## Decode attention (one layer)", "", _markdown(bench), ""]
    _write_summary(out, sections, started, done=False)
    if plan.compile:
        _step("compiled resources", started)
        sections += ["## Compiled resources", "", compiled_resources(out), ""]
        _write_summary(out, sections, started, done=False)
    _step("replay, calibrate, cross-check", started)
    cc = replay_and_crosscheck(plan, out, gpu)
    sections += ["## Replay, calibrate, cross-check", "", f"GPU spec {cc['gpu']}, {cc['num_gpu_blocks']} blocks", "",
                 "```", *cc["calibrate"], *cc["crosscheck"], "```", ""]
    _write_summary(out, sections, started, done=False)
    # after the principal figures: a slow policy replay (each has a time limit) cannot starve them
    _step("eviction and compression policies, replayed with invariant checks", started)
    policies = replay_policies(plan, out)
    policies.to_csv(out / "policies.csv", index=False)
    sections += ["## Policies on the real backend (--check-invariants)", "", _markdown(policies), ""]
    _write_summary(out, sections, started, done=True)
    (out / "kernels_ok.json").write_text(json.dumps(bool(kernels.ok.all())))
    if not kernels.ok.all():
        raise SystemExit(f"kernel mismatches: see {out / 'kernels.csv'}")
    if not policies.ok.all():
        raise SystemExit(f"policy replays failed: see {out / 'policies.csv'} and {out / 'policies'}/*.log")
    return out / "summary.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvsim.gpu.validate", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/gpu-validation"))
    parser.add_argument("--tiny", action="store_true", help="CPU sizes (the default when CUDA is unavailable)")
    parser.add_argument("--gpu", help="catalog GPU for peaks and estimates (default: from the device name)")
    args = parser.parse_args(argv)
    import torch
    plan = TINY if args.tiny or not torch.cuda.is_available() else FULL
    if args.gpu is not None:      # before the first step: a misspelt GPU ended in a traceback after the kernels
        from kvsim.sim.model.catalog import CatalogError, get_gpu
        try:
            get_gpu(args.gpu)
        except CatalogError as exc:
            parser.error(f"--gpu: {exc}")
    if plan.device == "cpu":   # Triton runs CPU tensors only interpreted, set before triton is first imported
        os.environ["TRITON_INTERPRET"] = "1"
    print(f"writing {run(args.out, plan, args.gpu)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
