"""Hostile clients against a real `kvsim serve` process (issue 50): malformed and oversized requests get
one OpenAI-style error naming the field (never a 500 or a dropped connection), and 200 clients that open
a stream and read it slowly all get every token while the server's memory stays bounded (uvicorn's
flow control pauses a stream its client does not read; the engine keeps only its token times)."""
from __future__ import annotations

import asyncio
import json
import re
import socket
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

from kvsim.sim.serve.client import ServerDidNotStart, free_port, launch_server  # noqa: E402

MODEL = "llama-3.1-8b"
MAX_MODEL_LEN = 4096
BODY_LIMIT = (1 << 20) + 64 * MAX_MODEL_LEN         # sim/serve/app.py: 1 MiB + 64 bytes a token of the context


def _request(port: int, path: str, data: bytes | None = None, headers: dict | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _rss_mb(pid: int, key: str = "VmRSS") -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith(key + ":"))) / 1024


@pytest.fixture(scope="module")
def server():
    port = free_port()
    try:
        proc = launch_server(port, ["--model", MODEL, "--time-scale", "10", "--eos-tokens", "16",
                                    "--max-model-len", str(MAX_MODEL_LEN), "--set=engine.num_gpu_blocks=4000"])
    except ServerDidNotStart as exc:
        pytest.fail(str(exc))
    yield {"port": port, "proc": proc}
    proc.kill()
    proc.wait()


def _json(body) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


C, CHAT = "/v1/completions", "/v1/chat/completions"
# (path, body, status, error param, fragment of the message)
MALFORMED = {
    "bad JSON": (C, b'{"prompt": "hi", ', 400, None, "not valid JSON"),
    "a body that is not UTF-8": (C, b"\xff\xfe\x00\x01", 400, None, "not valid JSON"),
    "JSON nested 100k deep": (C, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None, "not valid JSON"),
    "a JSON list": (C, [1, 2], 400, None, "must be a JSON object, got list"),
    "max_tokens text": (C, {"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens", "valid integer"),
    "max_tokens negative": (C, {"model": MODEL, "prompt": "hi", "max_tokens": -5}, 400, "max_tokens",
                            "greater than or equal to 1"),
    "max_tokens 1e30": (C, {"model": MODEL, "prompt": "hi", "max_tokens": 10**30}, 400, "max_tokens",
                        f"maximum context length is {MAX_MODEL_LEN}"),
    "max_completion_tokens huge (chat)": (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                 "max_completion_tokens": 10**9}, 400, "max_tokens", "is too large"),
    "prompt a number": (C, {"model": MODEL, "prompt": 5, "max_tokens": 2}, 400, "prompt.str", "valid string"),
    "stream text": (C, {"model": MODEL, "prompt": "hi", "stream": "maybe"}, 400, "stream", "valid boolean"),
    "chat content a number": (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400,
                              "messages.0.content.str", "valid string"),
    "chat message without role": (CHAT, {"model": MODEL, "messages": [{"content": "x"}]}, 400, "messages.0.role",
                                  "Field required"),
    "prompt over the model length": (C, {"model": MODEL, "prompt": "cache " * 5000, "max_tokens": 2}, 400, None,
                                     "maximum context length is 4096 tokens. However, your request has 5001"),
    "unknown model": (C, {"model": "gpt-9", "prompt": "hi", "max_tokens": 2}, 404, "model", "`gpt-9` does not exist"),
    # new (issue 50): was run as max_tokens tokens, min_tokens ignored (vLLM refuses it)
    "min_tokens over max_tokens": (C, {"model": MODEL, "prompt": "hi", "max_tokens": 4, "min_tokens": 10}, 400,
                                   "min_tokens", "min_tokens must be less than or equal to max_tokens=4, got 10"),
    # new (issue 50): were accepted and run as a prompt of those ids
    "token id past the vocabulary": (C, {"model": MODEL, "prompt": [1, 10**30], "max_tokens": 2}, 400, "prompt",
                                     "token id 1000000000000000000000000000000 is out of vocabulary"),
    "negative token id": (C, {"model": MODEL, "prompt": [[5, -1]], "max_tokens": 2}, 400, "prompt",
                          "token id -1 is out of vocabulary; expected ids 0..128255"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_request_gets_one_openai_error_naming_the_field(server, case):
    path, body, status, param, fragment = MALFORMED[case]
    got, raw = _request(server["port"], path, _json(body))
    error = json.loads(raw)["error"]
    assert (got, error["param"]) == (status, param), error
    assert fragment in error["message"], error["message"]
    assert error["code"] == status


def _raw_http(port: int, head: str, chunks: list[bytes], chunked: bool = True) -> tuple[int, bytes]:
    """An HTTP/1.1 request sent as `chunks`, with chunked transfer encoding (no Content-Length) or as they are."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head.encode())
        try:
            for chunk in chunks:
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
            if chunked:
                s.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass                     # the server answered and closed before the rest was sent
        data = b""
        while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + _length(data):
            more = s.recv(65536)
            if not more:
                break
            data += more
    return int(data.split()[1]), data.split(b"\r\n\r\n", 1)[1]


def _length(data: bytes) -> int:
    m = re.search(rb"content-length: (\d+)", data, re.I)
    return int(m.group(1)) if m else 0


def test_a_body_over_the_limit_is_refused_by_its_content_length_before_it_is_read(server):
    """New (issue 50): was read whole into memory, then tokenized. The answer comes before the body is sent."""
    port, size = server["port"], BODY_LIMIT + 10
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {size}\r\n\r\n")
    status, body = _raw_http(port, head, [b'{"prompt": "' + b"a" * (size - 14) + b'"}'], chunked=False)
    error = json.loads(body)["error"]
    assert (status, error["type"]) == (413, "RequestEntityTooLarge"), body
    assert f"over {BODY_LIMIT:,} bytes (got {size:,} so far)" in error["message"]
    # a body just under the limit is read (and refused for its length in tokens, as vLLM does)
    status, body = _request(port, "/v1/completions", json.dumps({"prompt": "a " * 600_000}).encode())
    assert status == 400 and "maximum context length" in json.loads(body)["error"]["message"]


def test_a_chunked_body_over_the_limit_is_refused_as_it_streams_in(server):
    """No Content-Length to check first: the server counts the bytes as they arrive and answers 413 without
    holding the 64 MB the client goes on to send (its resident memory grows by far less)."""
    pid, port = server["proc"].pid, server["port"]
    before = _rss_mb(pid)
    head = ("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n")
    status, body = _raw_http(port, head, [b'{"prompt": "'] + [b"a" * (1 << 20)] * 64)
    assert status == 413, body
    assert "over 1,310,720 bytes" in json.loads(body)["error"]["message"]
    assert _rss_mb(pid) - before < 40
    assert _request(port, "/health")[0] == 200


# ---- many slow clients -----------------------------------------------------------------------------
CLIENTS, TOKENS = 200, 200


async def _slow_stream(port: int, i: int) -> int:
    """Open a streaming completion and read it 512 bytes every 20 ms through a 4 KiB receive buffer (the
    server's writes stall on it); the number of tokens received, -1 without the final [DONE]."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
    body = json.dumps({"model": MODEL, "prompt": f"client {i} " * 20, "max_tokens": TOKENS, "ignore_eos": True,
                       "stream": True}).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    data = b""
    while not data.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
        chunk = await asyncio.wait_for(reader.read(512), 60)
        if not chunk:
            break
        data += chunk
        await asyncio.sleep(0.02)
    writer.close()
    tokens = data.count(b'"text": "')
    return tokens if b"data: [DONE]" in data else -1


def test_200_slow_streaming_clients_get_every_token_in_bounded_server_memory(server):
    pid, port = server["proc"].pid, server["port"]
    before = _rss_mb(pid)
    peak = [before]

    async def sample():
        while True:
            peak.append(_rss_mb(pid))
            await asyncio.sleep(0.05)

    async def all_clients():
        sampler = asyncio.create_task(sample())
        try:
            return await asyncio.gather(*(_slow_stream(port, i) for i in range(CLIENTS)))
        finally:
            sampler.cancel()

    started = time.monotonic()
    got = asyncio.run(all_clients())
    wall = time.monotonic() - started
    assert got == [TOKENS] * CLIENTS, f"{sum(g != TOKENS for g in got)} of {CLIENTS} streams incomplete"
    grew = max(peak) - before
    # 200 streams x 200 tokens of about 190 bytes each: 7.6 MB of events if the server buffered them all
    assert grew < 60, f"server peak RSS grew {grew:.0f} MB"
    assert wall < 60
    assert _request(port, "/health")[0] == 200
    print(f"\n{CLIENTS} slow clients: {wall:.1f} s wall, server peak RSS +{grew:.0f} MB")
