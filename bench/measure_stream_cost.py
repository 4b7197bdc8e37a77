"""Time, on this machine, what vLLM's API server does per streaming request and engine step, on a real
asyncio loop (issue 54; docs/gpu-profiles.md "The frontend", `handler_yields`):

- an output-handler task (vLLM V1 `AsyncLLM.output_handler`) gets one step's outputs, detokenizes one
  new token per request (incremental: the text of the last tokens, as `tokenizers` decodes them; the
  shipped SmolLM2 tokenizer) and puts each request's output into its queue;
- each request's stream task (`generate()` and the OpenAI serving generator) wakes on its queue, builds
  an OpenAI `chat.completion.chunk`, `json.dumps` it into an SSE line and writes it to a transport (a
  socket pair whose other end is drained by a thread).

    python bench/measure_stream_cost.py [--streams 1,4,16,64] [--steps 2000]

Prints the loop's CPU time per step and per stream (user + sys of this process: the drain thread's
reads included, the socket's kernel work too) for each number of streams; the per-stream slope of a
least-squares line through them is `stream_s` on this machine.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import threading
import time

import numpy as np

from kvsim.traces.tokenizer import load_tokenizer


def _drain(sock: socket.socket) -> None:
    try:
        while sock.recv(1 << 16):
            pass
    except OSError:          # closed by the measuring side
        pass


async def _run(streams: int, steps: int, tok, ids: list[int]) -> float:
    a, b = socket.socketpair()
    threading.Thread(target=_drain, args=(b,), daemon=True).start()
    _, writer = await asyncio.open_connection(sock=a)
    queues = [asyncio.Queue() for _ in range(streams)]
    done = asyncio.Event()
    left = [streams * steps]

    async def stream(i: int) -> None:
        q = queues[i]
        for _step in range(steps):
            text = await q.get()
            chunk = {"id": f"chatcmpl-{i}", "object": "chat.completion.chunk", "created": 1733616000,
                     "model": "qwen2.5-0.5b", "choices": [{"index": 0, "delta": {"content": text},
                                                            "logprobs": None, "finish_reason": None}]}
            writer.write(f"data: {json.dumps(chunk)}\n\n".encode())
            left[0] -= 1
            if not left[0]:
                done.set()

    async def output_handler() -> None:
        n = len(ids)
        for step in range(steps):
            for i in range(streams):
                k = (step * 7 + i * 13) % (n - 4)
                # incremental detokenization: the new text of token k given the few before it
                prev = tok.decode(ids[k:k + 3])
                text = tok.decode(ids[k:k + 4])[len(prev):]
                queues[i].put_nowait(text)
            await asyncio.sleep(0)           # the engine's next step: outputs come from a socket

    tasks = [asyncio.create_task(stream(i)) for i in range(streams)]
    t0 = time.process_time()
    await output_handler()
    await done.wait()
    t1 = time.process_time()
    await asyncio.gather(*tasks)
    writer.close()
    b.close()
    return (t1 - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", default="1,4,16,64")
    ap.add_argument("--steps", type=int, default=2000)
    args = ap.parse_args()
    tok = load_tokenizer()
    text = ("The quick brown fox jumps over the lazy dog while the scheduler batches decode steps; "
            "each request streams one token per step through the API server's event loop. ") * 20
    ids = tok.encode(text, add_special_tokens=False).ids
    counts = [int(s) for s in args.streams.split(",")]
    wall0 = time.perf_counter()
    per_step = [asyncio.run(_run(c, args.steps, tok, ids)) for c in counts]
    for c, s in zip(counts, per_step, strict=True):
        print(f"streams {c:4d}: {s * 1e3:8.3f} ms CPU per step, {s / c * 1e6:7.1f} us per stream")
    slope, intercept = np.polyfit(np.array(counts, float), np.array(per_step), 1)
    print(f"per-stream cost (slope): {slope * 1e6:.1f} us; per-step intercept {intercept * 1e6:.1f} us; "
          f"load average {os.getloadavg()[0]:.1f}; {time.perf_counter() - wall0:.1f} s wall")


if __name__ == "__main__":
    main()
