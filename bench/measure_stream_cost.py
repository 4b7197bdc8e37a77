"""Time, on this machine, what vLLM's API server does per streaming request and engine step, on a real
asyncio loop (issue 54; docs/gpu-profiles.md "The frontend", `handler_yields`):

- an output-handler task (vLLM V1 `AsyncLLM.output_handler`) gets one step's outputs, detokenizes one
  new token per request (incremental, as vLLM's `FastIncrementalDetokenizer` does: one
  `tokenizers.decoders.DecodeStream.step` per request, primed with the prompt; the shipped SmolLM2
  tokenizer) and puts each request's output into its queue;
- each request's stream task (`generate()` and the OpenAI serving generator) wakes on its queue, builds
  an OpenAI `chat.completion.chunk` and serializes it into an SSE line (`--chunk pydantic`, the default:
  pydantic models of the chunk's shape and `model_dump_json(exclude_unset=True)`, as vLLM's serving
  generator does; `--chunk json`: a dict and `json.dumps`), then writes it to a transport (a socket pair
  whose other end is drained by a thread).

Not included (so this is a lower bound of the real server's cost): the RequestOutput objects, the
engine-core IPC (msgpack decode), Starlette/uvicorn's ASGI send and HTTP chunk framing.

    python bench/measure_stream_cost.py [--streams 1,4,16,64] [--steps 2000] [--chunk pydantic|json]

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
from pydantic import BaseModel
from tokenizers.decoders import DecodeStream

from kvsim.traces.tokenizer import load_tokenizer


class Delta(BaseModel):
    role: str | None = None
    content: str | None = None


class Choice(BaseModel):
    index: int
    delta: Delta
    logprobs: dict | None = None
    finish_reason: str | None = None


class Chunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[Choice]


def _sse_pydantic(i: int, text: str) -> str:
    chunk = Chunk(id=f"chatcmpl-{i}", created=1733616000, model="qwen2.5-0.5b",
                  choices=[Choice(index=0, delta=Delta(content=text), logprobs=None, finish_reason=None)])
    return f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"


def _sse_json(i: int, text: str) -> str:
    chunk = {"id": f"chatcmpl-{i}", "object": "chat.completion.chunk", "created": 1733616000,
             "model": "qwen2.5-0.5b", "choices": [{"index": 0, "delta": {"content": text},
                                                    "logprobs": None, "finish_reason": None}]}
    return f"data: {json.dumps(chunk)}\n\n"


def _drain(sock: socket.socket) -> None:
    try:
        while sock.recv(1 << 16):
            pass
    except OSError:          # closed by the measuring side
        pass


async def _run(streams: int, steps: int, tok, ids: list[int], sse) -> float:
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
            writer.write(sse(i, text).encode())
            left[0] -= 1
            if not left[0]:
                done.set()

    n = len(ids)
    decoders = [DecodeStream(skip_special_tokens=True) for _ in range(streams)]
    for i, d in enumerate(decoders):          # primed with a few prompt tokens, as vLLM's detokenizer is
        for t in ids[i % 50:i % 50 + 4]:
            d.step(tok, t)

    async def output_handler() -> None:
        for step in range(steps):
            for i in range(streams):
                text = decoders[i].step(tok, ids[(step + i * 13 + 4) % n]) or ""
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
    ap.add_argument("--chunk", choices=["pydantic", "json"], default="pydantic")
    args = ap.parse_args()
    tok = load_tokenizer()
    text = ("The quick brown fox jumps over the lazy dog while the scheduler batches decode steps; "
            "each request streams one token per step through the API server's event loop. ") * 20
    ids = tok.encode(text, add_special_tokens=False).ids
    counts = [int(s) for s in args.streams.split(",")]
    wall0 = time.perf_counter()
    sse = _sse_pydantic if args.chunk == "pydantic" else _sse_json
    per_step = [asyncio.run(_run(c, args.steps, tok, ids, sse)) for c in counts]
    for c, s in zip(counts, per_step, strict=True):
        print(f"streams {c:4d}: {s * 1e3:8.3f} ms CPU per step, {s / c * 1e6:7.1f} us per stream")
    slope, intercept = np.polyfit(np.array(counts, float), np.array(per_step), 1)
    print(f"chunk {args.chunk}: per-stream cost (slope): {slope * 1e6:.1f} us; per-step intercept {intercept * 1e6:.1f} us; "
          f"load average {os.getloadavg()[0]:.1f}; {time.perf_counter() - wall0:.1f} s wall")


if __name__ == "__main__":
    main()
