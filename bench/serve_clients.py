"""`kvsim serve` under many concurrent streaming clients: no request lost, its memory at steady state.

Starts a `kvsim serve` process, then N closed-loop clients in one process (sim/serve/client.py: raw
HTTP/1.0, server-sent events): each streams a completion (a prompt of --prompt-words words, --max-tokens
tokens with ignore_eos) and sends its next one when it ends, for --duration seconds. All N streams are
open at once from the start. Prints what the clients saw (completed, lost: an HTTP error, a stream
that ended early or with the wrong token count; client TTFT/TPOT percentiles), what /metrics says at
the end (requests, engine lag), and the server's RSS sampled every --sample seconds with the growth
over the second half of the run (steady state: bounded memory shows no growth).

    python bench/serve_clients.py [--clients 1000] [--duration 120] [--time-scale 1] [-- SERVE OPTIONS]

Pin both processes to two cores with `taskset -c 0,1` to measure the 2-core case.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import psutil

from kvsim.sim.serve.client import ServerDidNotStart, free_port, launch_server, stream_completion

WORDS = ("cache", "block", "token", "prefill", "decode", "batch", "request", "engine", "memory", "latency",
         "throughput", "scheduler", "queue", "router", "replica", "model", "weight", "layer", "head",
         "attention")


def _metrics(port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    out: dict = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            key = name.split("{", 1)[0]
            out[key] = out.get(key, 0.0) + float(value)
    return out


def start_server(port: int, args, extra: list[str]) -> subprocess.Popen:
    try:
        return launch_server(port, ["--time-scale", str(args.time_scale), *extra], timeout=180)
    except ServerDidNotStart as exc:
        sys.exit(str(exc))


async def run_clients(port: int, args, rss: list) -> tuple[list, int, float]:
    rng = np.random.default_rng(0)
    prompt = " ".join(rng.choice(WORDS, args.prompt_words))
    body = {"model": args.model, "prompt": prompt, "max_tokens": args.max_tokens, "ignore_eos": True}
    results, lost = [], []
    open_streams = 0
    end = time.monotonic() + args.duration

    async def client(i: int):
        nonlocal open_streams
        await asyncio.sleep(i * args.ramp / args.clients)
        while time.monotonic() < end:
            open_streams += 1
            try:
                r = await stream_completion("127.0.0.1", port, body)
            except OSError as exc:
                lost.append(f"connection: {exc}")
                continue
            finally:
                open_streams -= 1
            if r.status != 200 or r.error or len(r.chunk_times) != args.max_tokens:
                lost.append(r.error or f"HTTP {r.status}, {len(r.chunk_times)} tokens")
            else:
                results.append(r)

    async def sampler(proc: psutil.Process):
        peak = 0
        while time.monotonic() < end:
            rss.append((time.monotonic(), proc.memory_info().rss, open_streams))
            peak = max(peak, open_streams)
            await asyncio.sleep(args.sample)
        return peak

    sampling = asyncio.create_task(sampler(psutil.Process(args.server_pid)))
    await asyncio.gather(*(client(i) for i in range(args.clients)))
    peak = await sampling
    return results, lost, peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of load (wall)")
    ap.add_argument("--ramp", type=float, default=5.0, help="seconds over which the clients open their first stream")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--prompt-words", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--sample", type=float, default=5.0, help="seconds between RSS samples")
    ap.add_argument("--kv-events", action="store_true",
                    help="serve with --kv-events-endpoint and count the KV events a ZMQ subscriber receives")
    args, extra = ap.parse_known_args()
    extra = [x for x in extra if x != "--"]
    port = free_port()
    t0 = time.monotonic()
    trace = Path(tempfile.mkdtemp()) / "served.jsonl"
    events = KVEventCounter(free_port()) if args.kv_events else None
    kv_opts = ["--kv-events-endpoint", events.endpoint] if events else []
    proc = start_server(port, args, ["--model", args.model, "--record-trace", str(trace), *kv_opts, *extra])
    if events:
        events.start()
    print(f"kvsim serve up in {time.monotonic() - t0:.1f} s (pid {proc.pid}); {args.clients} clients for "
          f"{args.duration:g} s at time scale {args.time_scale:g}", flush=True)
    args.server_pid = proc.pid
    rss: list = []
    t0 = time.monotonic()
    try:
        server_cpu0 = sum(psutil.Process(proc.pid).cpu_times()[:2])
        client_cpu0 = sum(psutil.Process().cpu_times()[:2])
        results, lost, peak = asyncio.run(run_clients(port, args, rss))
        wall = time.monotonic() - t0
        m = _metrics(port)
        server_cpu = sum(psutil.Process(proc.pid).cpu_times()[:2]) - server_cpu0
        client_cpu = sum(psutil.Process().cpu_times()[:2]) - client_cpu0
        print(f"CPU seconds (user + sys) during the load: server {server_cpu:.1f}, clients {client_cpu:.1f}; "
              f"server {server_cpu / max(len(results) * args.max_tokens, 1) * 1e6:.0f} us per streamed token")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    report(args, results, lost, peak, wall, m, rss)
    if events:
        events.stop()
        print(events.summary())
    if results and not extra:
        lateness(results, trace, args)


class KVEventCounter:
    """A ZMQ subscriber (a thread) to the server's KV events: batches, events by kind, sequence gaps."""

    def __init__(self, port: int):
        self.endpoint = f"tcp://*:{port}"              # the server binds it; this subscriber connects
        self.address = f"tcp://127.0.0.1:{port}"
        self.batches = self.stored = self.removed = self.gaps = 0
        self.last_seq = -1
        self._stop = False

    def start(self) -> None:
        import threading
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import msgspec
        import zmq
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.connect(self.address)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        while not self._stop:
            if not sub.poll(200):
                continue
            _topic, seq, payload = sub.recv_multipart()
            n = int.from_bytes(seq, "big")
            self.gaps += n != self.last_seq + 1 and self.last_seq >= 0
            self.last_seq = n
            self.batches += 1
            for event in msgspec.msgpack.decode(payload)[1]:      # [ts, events, rank]; events [tag, ...]
                if event[0] == "BlockStored":
                    self.stored += len(event[1])
                else:
                    self.removed += len(event[1])
        sub.close(linger=0)
        ctx.term()

    def stop(self) -> None:
        self._stop = True
        self.thread.join(timeout=5)

    def summary(self) -> str:
        return (f"KV events: {self.batches} batches (last sequence {self.last_seq}, {self.gaps} gaps), "
                f"{self.stored} blocks stored, {self.removed} removed")


def lateness(results, trace: Path, args) -> None:
    """The clients' TTFT against the simulated engine's on the arrivals the server recorded (`kvsim simulate`
    on its trace): what the server and the machine added (connection, parsing, a lagging engine, delivery)."""
    from kvsim.sim.config import load_config
    from kvsim.sim.simulator.simulate import run_simulation

    sim = run_simulation(load_config(None, {"model": args.model, "trace": str(trace)}))
    ttft = sim.requests.set_index("request_id")["ttft_s"]
    simulated = np.array([ttft[int(r.response_id.rsplit("-", 1)[1])] for r in results]) / args.time_scale
    late = np.array([r.ttft for r in results]) - simulated
    print("simulated TTFT ms p50/p90/p99 (wall): " + " / ".join(f"{np.percentile(simulated, q) * 1e3:.0f}"
                                                                for q in (50, 90, 99))
          + "; client lateness ms p50/p90/p99: " + " / ".join(f"{np.percentile(late, q) * 1e3:.0f}"
                                                              for q in (50, 90, 99)))


def report(args, results, lost, peak, wall, m, rss) -> None:
    ttft = np.array([r.ttft for r in results]) * 1e3
    tpot = np.array([r.tpot for r in results]) * 1e3
    print(f"completed {len(results)}, lost {len(lost)} ({sorted(set(lost))[:3]}), peak open streams {peak}, "
          f"{len(results) / wall:.1f} req/s and {len(results) * args.max_tokens / wall:.0f} streamed tokens/s over "
          f"{wall:.1f} s")
    if len(results):
        print("client TTFT ms p50/p90/p99: " + " / ".join(f"{np.percentile(ttft, q):.0f}" for q in (50, 90, 99))
              + "; TPOT ms p50/p90/p99: " + " / ".join(f"{np.percentile(tpot, q):.1f}" for q in (50, 90, 99)))
    print(f"/metrics: vllm:request_success_total {m.get('vllm:request_success_total', 0):.0f}, "
          f"vllm:generation_tokens_total {m.get('vllm:generation_tokens_total', 0):.0f}, running "
          f"{m.get('vllm:num_requests_running', 0):.0f}, waiting {m.get('vllm:num_requests_waiting', 0):.0f}, "
          f"kvsim:engine_lag_seconds {m.get('kvsim:engine_lag_seconds', 0):.2f}")
    if len(rss) >= 4:
        t = np.array([x[0] for x in rss]) - rss[0][0]
        mb = np.array([x[1] for x in rss]) / 2**20
        half = t >= t[-1] / 2
        slope = np.polyfit(t[half], mb[half], 1)[0] * 60 if half.sum() >= 2 else float("nan")
        print(f"server RSS MB: start {mb[0]:.0f}, max {mb.max():.0f}, end {mb[-1]:.0f}; second half "
              f"{mb[half].min():.0f}..{mb[half].max():.0f}, trend {slope:+.1f} MB/min")
        print("RSS samples (s: MB, open streams): " + ", ".join(
            f"{ti:.0f}: {m_:.0f}, {x[2]}" for ti, m_, x in zip(t, mb, rss, strict=True)))
    print(json.dumps({"completed": len(results), "lost": len(lost)}))


if __name__ == "__main__":
    main()
