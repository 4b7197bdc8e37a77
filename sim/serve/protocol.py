"""OpenAI's request bodies (the fields a load generator or a gateway sends) and vLLM's rules for them:
what a request asks the engine for, or the error vLLM answers with.

Output length: a request with `ignore_eos` generates `max_tokens` tokens (vLLM's default when absent:
the rest of the context). Without it the simulated model emits its end-of-sequence token after
`eos_tokens` tokens (a server option: kvsim has no model to decide), so a request generates
min(max_tokens, max(eos_tokens, min_tokens)) tokens, finishing with "length" when max_tokens stopped it
and "stop" otherwise."""
from __future__ import annotations

from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class ApiError(Exception):
    """An OpenAI-style error response: HTTP status, error type and message (and the offending field)."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")      # OpenAI clients send more than the engine needs
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    n: int = Field(1, ge=1)


class CompletionBody(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[TextPart] | None = None


class ChatBody(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class Generation(NamedTuple):
    """What one request asks of the engine, and how to answer it."""
    prompt_ids: list[int]
    max_tokens: int                 # the request's max_tokens (or vLLM's default)
    output_tokens: int              # tokens the simulated model generates
    finish_reason: str              # "length" | "stop"
    stream: bool
    include_usage: bool
    continuous_usage: bool


def parse(model_cls: type[BaseModel], body) -> BaseModel:
    """The validated body, or a 400 naming the first bad field and what was expected."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "body"
        raise ApiError(400, f"{field}: {err['msg']}", param=field) from None


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise ApiError(404, f"The model `{requested}` does not exist.", "NotFoundError", "model")


def completion_prompt(body: CompletionBody, encode, vocab_size: int) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, str):
        return encode(prompt)
    if prompt and all(isinstance(x, int) for x in prompt):
        return _token_ids(prompt, vocab_size)
    if len(prompt) == 1:
        return encode(prompt[0]) if isinstance(prompt[0], str) else _token_ids(prompt[0], vocab_size)
    raise ApiError(400, f"prompt: a batch of {len(prompt)} prompts; kvsim serve takes one prompt a request "
                        "(send them as separate requests)", param="prompt")


def _token_ids(ids, vocab_size: int) -> list[int]:
    """A prompt given as token ids, each an id of the model's vocabulary (vLLM: "Token id ... is out of
    vocabulary")."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ApiError(400, f"prompt: token id {bad} is out of vocabulary; expected ids 0..{vocab_size - 1}",
                       param="prompt")
    return list(ids)


def chat_messages(body: ChatBody) -> list[tuple[str, str]]:
    out = []
    for m in body.messages:
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
        out.append((m.role, content))
    return out


def generation(body: _Common, prompt_ids: list[int], max_model_len: int, eos_tokens: int,
               max_tokens: int | None = None) -> Generation:
    """The engine's part of a request, checked as vLLM checks it against the context length."""
    if body.n != 1:
        raise ApiError(400, f"n: {body.n} choices; kvsim serve generates one choice a request (n=1)", param="n")
    n_prompt = len(prompt_ids)
    if n_prompt == 0:
        raise ApiError(400, "The prompt is empty; expected at least one token.", param="prompt")
    if n_prompt >= max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, your "
                            f"request has {n_prompt} input tokens. Please reduce the length of the input messages.")
    asked = max_tokens if max_tokens is not None else body.max_tokens
    if asked is not None and n_prompt + asked > max_model_len:
        raise ApiError(400, f"'max_tokens' or 'max_completion_tokens' is too large: {asked}. This model's maximum "
                            f"context length is {max_model_len} tokens and your request has {n_prompt} input "
                            f"tokens ({asked} > {max_model_len} - {n_prompt}).", param="max_tokens")
    if asked is not None and body.min_tokens > asked:       # vLLM's SamplingParams check
        raise ApiError(400, f"min_tokens must be less than or equal to max_tokens={asked}, got {body.min_tokens}.",
                       param="min_tokens")
    limit = asked if asked is not None else max_model_len - n_prompt
    out = limit if body.ignore_eos else min(limit, max(eos_tokens, body.min_tokens))
    opts = body.stream_options
    if opts is not None and not body.stream:
        raise ApiError(400, "stream_options: only with stream: true", param="stream_options")
    return Generation(prompt_ids, limit, out, "length" if out == limit else "stop", body.stream,
                      bool(opts and opts.include_usage), bool(opts and opts.continuous_usage_stats))
