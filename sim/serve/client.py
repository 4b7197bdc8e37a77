"""A lean streaming client of kvsim serve (or any OpenAI-compatible server): raw HTTP/1.1 over asyncio,
server-sent events parsed as they arrive, the receive time of every chunk kept. Thousands of them run
in one process (bench/serve_clients.py) without a client library's per-chunk cost blurring the times;
tests/test_serve.py measures TTFT/TPOT/E2E with it as `vllm bench serve` does."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field


@dataclass
class StreamResult:
    """One streamed request as the client saw it (times: time.monotonic())."""
    sent: float
    chunk_times: list[float] = field(default_factory=list)     # chunks carrying text
    text: str = ""
    response_id: str = ""
    finish_reason: str | None = None
    usage: dict | None = None
    status: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.sent

    @property
    def e2e(self) -> float:
        return self.chunk_times[-1] - self.sent

    @property
    def tpot(self) -> float:
        n = len(self.chunk_times)
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else 0.0


async def stream_completion(host: str, port: int, body: dict, path: str = "/v1/completions") -> StreamResult:
    """POST `body` (stream: true is set) and read its event stream to [DONE]."""
    payload = json.dumps({**body, "stream": True}).encode()
    reader, writer = await asyncio.open_connection(host, port)
    result = StreamResult(sent=time.monotonic())
    try:
        # HTTP/1.0: the body is the event stream itself, to the connection's end (no chunked framing)
        writer.write(b"POST %s HTTP/1.0\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                     b"\r\n" % (path.encode(), host.encode(), len(payload)) + payload)
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        result.status = int(head.split(b" ", 2)[1])
        if result.status != 200:
            result.error = (await reader.read()).decode(errors="replace")
            return result
        await _read_events(reader, result)
    finally:
        writer.close()
    return result


async def _read_events(reader: asyncio.StreamReader, result: StreamResult) -> None:
    buffer = b""
    while True:
        data = await reader.read(65536)
        if not data:
            result.error = result.error or "the stream ended before [DONE]"
            return
        now = time.monotonic()
        buffer += data
        *events, buffer = buffer.split(b"\n\n")
        for event in events:
            line = event.removeprefix(b"data: ").strip()
            if line == b"[DONE]":
                return
            _take(json.loads(line), now, result)


def _take(chunk: dict, now: float, result: StreamResult) -> None:
    if "error" in chunk:
        result.error = chunk["error"].get("message")
        return
    result.response_id = chunk.get("id", result.response_id)
    if chunk.get("usage"):
        result.usage = chunk["usage"]
    for choice in chunk.get("choices", []):
        text = choice.get("text")
        if text is None:
            text = (choice.get("delta") or {}).get("content")
        if text:
            result.chunk_times.append(now)
            result.text += text
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]
