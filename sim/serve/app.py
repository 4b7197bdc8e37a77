"""The HTTP server: OpenAI's /v1/completions, /v1/chat/completions (server-sent events when streaming),
/v1/models, vLLM's /health, /version and /metrics, on Starlette (served by uvicorn)."""
from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio.lowlevel  # noqa: F401 - Starlette's streaming imports it lazily: 0.3 s of the first stream's TTFT
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvsim.sim.engine.resolved_run import ResolvedRun

from kvsim.sim.simulator.executor import replica_parts

from .live import EngineFailed, LiveEngine, LiveRequest, SimClock, TraceRecorder, check_kv_events_manager, warm_up
from .metrics import EngineState, RequestMetrics, cache_config_info
from .protocol import (ApiError, ChatBody, CompletionBody, Generation, chat_messages, check_model, completion_prompt,
                       generation, parse)
from .kv_events import KVEventPublisher, KVEventsConfig
from .tokens import FILLER_WORDS, PromptTokenizer, filler


THREAD_TOKENIZE_BYTES = 4096      # about 1,000 tokens of text
# the largest request body read: BODY_BYTES_PER_TOKEN bytes a token of the model's context (a token id in a JSON
# list is at most 8 bytes, a token of text rarely over 10) plus 1 MiB of other fields; a larger body is
# answered 413 as its bytes arrive, before it is held in memory or tokenized
BODY_BYTES_PER_TOKEN = 64
BODY_BASE_BYTES = 1 << 20


@dataclass(frozen=True)
class ServeOptions:
    served_model_name: str
    time_scale: float = 1.0
    eos_tokens: int = 128           # output tokens of a request without ignore_eos (protocol.py)
    tokenizer: str | None = None    # a tokenizer.json (or its directory); None: the shipped SmolLM2 one
    record_trace: Path | None = None
    stream_interval: int = 1        # tokens per streamed batch (vLLM's --stream-interval)
    kv_events: KVEventsConfig | None = None     # vLLM's ZMQ KV-event publisher (kv_events.py); None: off


class Server:
    """The server's state: the run plan, the live engine (made at startup, on the server's loop), metrics."""

    def __init__(self, plan: ResolvedRun, options: ServeOptions):
        self.plan, self.options = plan, options
        self.tokenizer = PromptTokenizer(options.tokenizer)
        self.registry = CollectorRegistry()
        self.metrics = RequestMetrics(options.served_model_name, plan.max_model_len, plan.cfg.engine_ranks)
        self.registry.register(self.metrics)
        cache_config_info(self.registry, plan)
        self.engine: LiveEngine | None = None
        self.created = int(time.time())
        self.kv_publisher: KVEventPublisher | None = None
        if options.kv_events is not None:      # checked and bound now: a bad option fails before serving
            check_kv_events_manager(replica_parts(plan, 0)[0])
            self.kv_publisher = KVEventPublisher(options.kv_events, plan.cfg.engine.block_size, plan.cfg.engine_ranks,
                                                 lambda req, start, end: self.engine.token_ids(req, start, end))
        self.body_limit = BODY_BASE_BYTES + BODY_BYTES_PER_TOKEN * plan.max_model_len

    def start(self) -> LiveEngine:
        warm_up(self.plan, self.metrics)
        recorder = (TraceRecorder(self.options.record_trace, self.plan.cfg.engine.block_size)
                    if self.options.record_trace else None)
        self.engine = LiveEngine(self.plan, SimClock(self.options.time_scale), self.metrics,
                                 asyncio.get_running_loop(), recorder, self.options.stream_interval)
        engine = self.engine
        if self.kv_publisher is not None:
            engine.publish_kv_events(self.kv_publisher, [self.tokenizer.encode(w)[0] for w in FILLER_WORDS])
        self.registry.register(EngineState(self.options.served_model_name, engine.replicas, lambda: engine.lag_s))
        return self.engine

    # ----- requests -----------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        try:
            raw = await _read_body(request, self.body_limit)
            body = _json_body(raw)
            # a long prompt takes milliseconds to tokenize: off the loop that paces the engine and the streams
            # (a short one in the loop: a thread's hand-offs would cost more)
            gen = (await asyncio.to_thread(self._generation, body, chat) if len(raw) > THREAD_TOKENIZE_BYTES
                   else self._generation(body, chat))
            live = self.engine.submit(gen)
        except ApiError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        answer = Answer(self, live, chat)
        if gen.stream:
            return StreamingResponse(answer.events(), media_type="text/event-stream")
        # a client that hangs up before the whole answer aborts its request (vLLM's with_cancellation)
        wait = asyncio.ensure_future(self._whole(live))
        hang_up = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait((wait, hang_up), return_when=asyncio.FIRST_COMPLETED)
        finally:
            hang_up.cancel()
            if not wait.done():
                wait.cancel()
                self.engine.abort(live)
        if wait.cancelled():
            return Response(status_code=499)          # nobody reads it
        try:
            wait.result()
        except EngineFailed as exc:
            return JSONResponse(ApiError(500, f"the simulated engine failed: {exc}", "InternalServerError").body(),
                                status_code=500)
        return JSONResponse(answer.whole())

    async def _whole(self, live: LiveRequest) -> None:
        async for _ in self.engine.tokens(live):
            pass

    def _generation(self, body, chat: bool) -> Generation:
        opts, max_len = self.options, self.plan.max_model_len
        if chat:
            req = parse(ChatBody, body)
            check_model(req.model, opts.served_model_name)
            ids = self.tokenizer.chat_ids(chat_messages(req))
            return generation(req, ids, max_len, opts.eos_tokens, req.max_completion_tokens or req.max_tokens)
        req = parse(CompletionBody, body)
        check_model(req.model, opts.served_model_name)
        return generation(req, completion_prompt(req, self.tokenizer.encode, self.plan.model.vocab_size), max_len,
                          opts.eos_tokens)

    # ----- the rest of the API ----------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        name = self.options.served_model_name
        return JSONResponse({"object": "list", "data": [{
            "id": name, "object": "model", "created": self.created, "owned_by": "kvsim", "root": name,
            "parent": None, "max_model_len": self.plan.max_model_len, "permission": []}]})

    async def health(self, request: Request) -> Response:
        failure = self.engine.failure if self.engine else "not started"
        return Response(status_code=503 if failure else 200)

    async def version(self, request: Request) -> Response:
        from importlib.metadata import PackageNotFoundError, version
        try:
            v = version("kvsim")
        except PackageNotFoundError:
            v = "unknown"
        return JSONResponse({"version": f"kvsim-{v}"})

    async def prometheus(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


async def _disconnected(request: Request) -> None:
    """Return once the client has closed its connection (the server's next message is http.disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with a 413 once it passes `limit` bytes (its Content-Length, or as it
    streams in without one): a client cannot make the server hold an unbounded body."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        parts.append(chunk)
    return b"".join(parts)


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(413, f"the request body is over {limit:,} bytes (got {size:,} so far); expected at most "
                         f"{BODY_BYTES_PER_TOKEN} bytes a token of the model's context plus 1 MiB",
                    "RequestEntityTooLarge")


def _json_body(raw: bytes):
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        raise ApiError(400, "the request body is not valid JSON; expected a JSON object") from None


class Answer:
    """The response of one request: chunks of filler text as its tokens come, or the whole completion."""

    def __init__(self, server: Server, live: LiveRequest, chat: bool):
        self.server, self.live, self.chat = server, live, chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{live.request.request_id}"
        self.created = int(time.time())
        self.model = server.options.served_model_name
        head = {"id": self.id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": self.created, "model": self.model}
        self._head = json.dumps(head)[:-1]      # the chunk's opening fields; choices follow
        marker = "\x00"                          # where a token's text goes in a plain token chunk
        self._plain = self._chunk(self._choice(marker, None)).split(json.dumps(marker))
        self._plain = [self._plain[0] + '"', '"' + self._plain[1]]

    def _usage(self, produced: int) -> dict:
        p = len(self.live.generation.prompt_ids)
        return {"prompt_tokens": p, "total_tokens": p + produced, "completion_tokens": produced}

    def _chunk(self, choice: dict, usage: dict | None = None) -> str:
        extra = f', "usage": {json.dumps(usage)}' if usage is not None else ""
        return f'data: {self._head}, "choices": [{json.dumps(choice)}]{extra}}}\n\n'

    def _choice(self, text: str, finish: str | None, role: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": text} if role else {"content": text}
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}

    def _token_chunks(self, start: int, end: int) -> list[str]:
        """One event per token; the common ones (not the last, no usage) from a template (a json.dumps
        each is a tenth of the server's time under a thousand streams)."""
        gen = self.live.generation
        last = gen.output_tokens - 1
        if gen.continuous_usage:
            return [self._chunk(self._choice(filler(j, 1), gen.finish_reason if j == last else None),
                                self._usage(j + 1)) for j in range(start, end)]
        plain = self._plain
        out = [plain[0] + filler(j, 1) + plain[1] for j in range(start, min(end, last))]
        if end > last:
            out.append(self._chunk(self._choice(filler(last, 1), gen.finish_reason)))
        return out

    async def events(self):
        gen, live = self.live.generation, self.live
        total = gen.output_tokens
        try:
            async for start, end in self.server.engine.tokens(live):
                parts = []
                if start == 0 and self.chat:
                    parts.append(self._chunk(self._choice("", None, role=True)))
                parts += self._token_chunks(start, end)
                yield "".join(parts)
        except EngineFailed as exc:
            yield f"data: {json.dumps(ApiError(500, f'the simulated engine failed: {exc}', 'InternalServerError').body())}\n\n"
            return
        finally:
            # the client went away mid-stream (the server cancels or closes this generator): vLLM aborts the request
            self.server.engine.abort(live)
        if gen.include_usage:
            yield f'data: {self._head}, "choices": [], "usage": {json.dumps(self._usage(total))}}}\n\n'
        yield "data: [DONE]\n\n"

    def whole(self) -> dict:
        gen = self.live.generation
        text = filler(0, gen.output_tokens)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
                      "logprobs": None, "finish_reason": gen.finish_reason, "stop_reason": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": gen.finish_reason,
                      "stop_reason": None, "prompt_logprobs": None}
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice],
                "usage": self._usage(gen.output_tokens)}


def build_app(server: Server) -> Starlette:
    @asynccontextmanager
    async def lifespan(app):
        engine = server.start()
        try:
            yield
        finally:
            engine.close()

    routes = [
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/version", server.version, methods=["GET"]),
        Route("/metrics", server.prometheus, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)
