"""Peak RSS of `kvsim simulate` on the full Mooncake conversation trace (12,031 requests) with prefix
caching, Llama-3.1-8B on 1x H100, and on its first 3,000 requests: the difference over the extra
9,031 finished requests shows whether memory grows with the number of finished requests.

Runs `python -m sim.cli simulate` as a child process from a checkout (default: this one; pass
another checkout's root to measure it, e.g. the code before a change) and reads the child's peak
RSS. Usage: python bench/bench_memory_prefix_caching.py [CHECKOUT]
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

FULL, PART = None, 3000


def peak_rss_mib(checkout: Path, max_requests: int | None) -> tuple[float, int]:
    """(peak RSS in MiB, requests finished) of one run."""
    out = tempfile.mkdtemp(prefix="kvsim-bench-mem-")
    cmd = [sys.executable, "-m", "kvsim.sim.cli", "simulate", "--trace", "mooncake-conversation",
           "--model", "llama-3.1-8b", "--gpu", "h100", "--prefix-caching", "--out", out, "--quiet"]
    if max_requests:
        cmd += ["--max-requests", str(max_requests)]
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    pid = subprocess.Popen(cmd, cwd=checkout, env=env, stdout=subprocess.DEVNULL).pid
    _, status, usage = os.wait4(pid, 0)
    if status:
        raise SystemExit(f"{' '.join(cmd)} failed with status {status}")
    finished = json.loads(Path(out, "summary.json").read_text())["num_finished"]
    return usage.ru_maxrss / 1024, finished


def main() -> None:
    checkout = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]).resolve()
    part_mib, part_n = peak_rss_mib(checkout, PART)
    full_mib, full_n = peak_rss_mib(checkout, FULL)
    per_request_kib = (full_mib - part_mib) * 1024 / max(full_n - part_n, 1)
    print(f"checkout {checkout}")
    print(f"{'requests':>9} {'peak RSS MiB':>13}")
    print(f"{part_n:9d} {part_mib:13.0f}")
    print(f"{full_n:9d} {full_mib:13.0f}")
    print(f"growth: {per_request_kib:.1f} KiB per extra finished request")


if __name__ == "__main__":
    main()
