"""A lean streaming client of kvsim serve (or any OpenAI-compatible server): raw HTTP/1.1 over asyncio,
server-sent events parsed as they arrive, the receive time of every chunk kept. Thousands of them run
in one process (bench/serve_clients.py) without a client library's per-chunk cost blurring the times;
tests/test_serve.py measures TTFT/TPOT/E2E with it as `vllm bench serve` does."""
from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
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


def free_port() -> int:
    """A TCP port free on this machine now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerDidNotStart(RuntimeError):
    """`kvsim serve` exited, or did not answer /health in time; the message holds its output."""


def launch_server(port: int, args: list[str], timeout: float = 120.0) -> subprocess.Popen:
    """`kvsim serve --port PORT ARGS` in a child process, returned once its /health answers 200. Its
    output goes to a temporary file (a pipe nobody reads would stall a server that logs), read back
    into ServerDidNotStart when it exits or does not answer within `timeout` seconds."""
    with tempfile.TemporaryFile("w+") as log:          # the child keeps its own descriptor of it
        proc = subprocess.Popen([sys.executable, "-m", "kvsim.sim.cli", "serve", "--port", str(port), *args],
                                stdout=log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        return proc
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                log.seek(0)
                raise ServerDidNotStart(f"kvsim serve did not start: {log.read()}")
            time.sleep(0.2)
