"""The OpenAI request bodies the server accepts, validated into one `GenerationSpec`, and its errors.

    body bytes --json.loads--> dict --pydantic (ChatCompletionRequest | CompletionRequest)--> checks
               --> GenerationSpec(prompt text or token ids, SamplingParams fields, stream, include_usage)

Every failure is an `APIError(status, message, type, param, code)`, which the app renders in the
OpenAI error shape `{"error": {"message", "type", "param", "code"}}`:
- not JSON, not an object, a wrong type, a value out of range, a missing field: 400
  `invalid_request_error` naming the parameter;
- an OpenAI parameter this server does not implement (`best_of`, `functions`, ...) or any
  parameter it does not know: 400 `unsupported_parameter`, never silently ignored;
- logprobs: chat `logprobs: true` with `top_logprobs` 0..20; completions `logprobs` 0..20 (an int;
  OpenAI allows 5) and `echo`; `top_logprobs` over 20, a wrong type, `top_logprobs` without
  `logprobs`: 400. `n`: 1..MAX_N choices. `max_tokens: 0` only with `echo` on completions (the
  prompt's logprobs alone, as vLLM).
- `tools`, `tool_choice`, `parallel_tool_calls`, tool messages and `response_format` are checked in
  tools.py (a schema that does not compile: 400 `invalid_schema` or `unsupported_schema_feature`,
  `param` naming the field and, after '#', the JSON pointer inside the schema);
- another model than the one served: 404 `model_not_found`.

Extensions (as vLLM): `top_k`, and `ignore_eos` (generate exactly `max_tokens`, for benchmarks).
`max_tokens` (or `max_completion_tokens`) left out takes the container's default (`generation.
max_new_tokens`, else 256). A `max_tokens` past the context is capped: generation stops when the
context is full and reports `finish_reason: "length"` (documented in the README). A prompt longer
than the context is refused by the app (it needs the tokenizer), with both lengths.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from . import tools

__all__ = ["APIError", "GenerationSpec", "parse_chat", "parse_completion", "error_body"]

_TYPE_TAG = re.compile(r"^(str|int|float|bool|.*\[.*\])$")
MAX_STOP = 4  # as OpenAI: at most 4 stop sequences
MAX_TOP_LOGPROBS = 20  # as OpenAI's top_logprobs (nanoqwen_runtime.logprobs.MAX_TOP_LOGPROBS)
# n choices run as n engine sequences (one batch slot each): 16 bounds what one request can take of
# the batch (the CPU server's default max_batch is 16) and of the KV pool
MAX_N = 16


class APIError(Exception):
    """A request the server refuses: HTTP `status` with the OpenAI error fields."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The OpenAI error shape."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None  # None: an assistant message of tool calls only
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant (checked in tools.template_messages)
    tool_call_id: str | None = None  # tool

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class _Common(BaseModel):
    """Fields of both endpoints. strict: "1" is not an int, 1 is not a bool (a wrong type is a 400)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    max_tokens: int | None = Field(default=None, ge=0)  # 0: only with echo (completions)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)  # extension (as vLLM, llama.cpp)
    ignore_eos: bool = False  # extension (as vLLM): generate exactly max_tokens (benchmarks)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, not used (it only labels the request at OpenAI)
    # parameters refused unless left at the value that means "off" (see UNSUPPORTED)
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    logprobs: bool | int | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None


# parameter -> (value(s) that mean "off", what to say). Anything else is refused with a 400.
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "best_of": ((None, 1), "best_of is not supported"),
    "functions": ((None,), "the deprecated `functions` are not supported: send `tools`"),
    "function_call": ((None, "none"), "the deprecated `function_call` is not supported: send `tool_choice`"),
    "presence_penalty": ((None, 0, 0.0), "presence_penalty is not supported (only 0)"),
    "frequency_penalty": ((None, 0, 0.0), "frequency_penalty is not supported (only 0)"),
    "logit_bias": ((None,), "logit_bias is not supported"),
}


@dataclass(frozen=True)
class GenerationSpec:
    """One validated request. `prompt` is text (chat: the rendered template) or token ids; `messages`
    (chat only) are (role, text) pairs for the chat template. Sampling fields are None where left out
    (the container's defaults apply)."""

    kind: Literal["chat", "completion"]
    model: str
    prompt: str | tuple[int, ...] | None
    messages: tuple[tuple[str, str], ...] | None
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    ignore_eos: bool = False
    n: int = 1                      # choices
    logprobs: int | None = None     # None: off; else the top alternatives per token (0..20)
    echo: bool = False              # completions: the prompt comes back (with its logprobs if asked)
    # chat: the messages as the template takes them (tool calls, tool results), the tools
    # (tools.ToolPlan) and the grammar of a response_format (nanoqwen_runtime.grammar.Grammar)
    chat_messages: tuple[dict[str, Any], ...] | None = None
    tool_plan: Any = None
    grammar: Any = None
    suffix: str | None = None  # completion only: the text after the cursor (fill-in-the-middle, infill.py)


def _load_json(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}",
                       code="invalid_json")
    return data


def _validate(cls: type[BaseModel], data: dict[str, Any]):
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        # union members add their type to the location ('prompt', 'list[int]', 1): leave those out
        param = ".".join(str(x) for x in err["loc"] if not _TYPE_TAG.match(str(x))) or None
        more = f" (and {e.error_count() - 1} more errors)" if e.error_count() > 1 else ""
        raise APIError(400, f"invalid parameter {param}: {err['msg']}{more}", param=param,
                       code="invalid_value") from None


def _check_supported(req: _Common, served_model: str) -> None:
    extra = sorted((req.model_extra or {}).keys())
    if extra:
        raise APIError(400, f"unknown or unsupported parameter {extra[0]!r}", param=extra[0],
                       code="unsupported_parameter")
    for name, (off, why) in UNSUPPORTED.items():
        value = getattr(req, name, None)
        if name == "logit_bias" and value == {}:
            continue
        if not any(value is o or (type(value) is type(o) and value == o) for o in off):
            raise APIError(400, f"{why} (got {name}={value!r})", param=name, code="unsupported_parameter")
    if req.model != served_model:
        raise APIError(404, f"the model {req.model!r} does not exist; this server serves {served_model!r} "
                       "(GET /v1/models)", param="model", code="model_not_found")


def _stop(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOP:
        raise APIError(400, f"at most {MAX_STOP} stop sequences, got {len(stops)}", param="stop",
                       code="invalid_value")
    if any(not s for s in stops):
        raise APIError(400, "stop sequences must be non-empty strings", param="stop", code="invalid_value")
    return stops


def parse_chat(body: bytes, served_model: str) -> GenerationSpec:
    """Validate a /v1/chat/completions body (see the module header for the errors)."""
    req = _validate(ChatCompletionRequest, _load_json(body))
    _check_supported(req, served_model)
    try:
        plan = tools.check_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
        grammar = tools.response_format_grammar(req.response_format)
        messages = tools.template_messages(req.messages)
    except tools.ToolError as e:
        raise APIError(400, e.message, param=e.param, code=e.code) from None
    if grammar is not None and plan is not None and plan.forced:
        raise APIError(400, "response_format and a forced tool_choice both constrain the answer; give one",
                       param="response_format", code="invalid_value")
    if (grammar is not None or (plan is not None and plan.forced)) and req.logprobs:
        raise APIError(400, "logprobs are not supported on a constrained answer (response_format or a forced "
                       "tool_choice)", param="logprobs", code="unsupported_parameter")
    if req.max_tokens == 0:
        raise APIError(400, "max_tokens must be >= 1", param="max_tokens", code="invalid_value")
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        raise APIError(400, "max_tokens and max_completion_tokens disagree; give one", param="max_tokens",
                       code="invalid_value")
    return GenerationSpec(
        "chat", req.model, None, tuple((m.role if m.role != "developer" else "system", m.text())
                                       for m in req.messages),
        req.max_completion_tokens or req.max_tokens, req.temperature, req.top_p, req.top_k, req.seed,
        _stop(req.stop), req.stream, bool(req.stream_options and req.stream_options.include_usage),
        req.ignore_eos, req.n or 1, _chat_logprobs(req), False, messages, plan, grammar)


def parse_completion(body: bytes, served_model: str) -> GenerationSpec:
    """Validate a /v1/completions body. `prompt`: a string, a list of one string, or token ids."""
    req = _validate(CompletionRequest, _load_json(body))
    if req.suffix and req.echo:
        raise APIError(400, "echo cannot be combined with suffix: a fill-in-the-middle answer is the middle "
                       "alone (the prompt is the text before the cursor, the suffix the text after it)",
                       param="echo", code="unsupported_parameter")
    _check_supported(req, served_model)
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], str):
        if len(p) != 1:
            raise APIError(400, f"a list of {len(p)} prompts is a batch; send one prompt per request",
                           param="prompt", code="unsupported_parameter")
        p = p[0]
    if isinstance(p, list):
        if not p:
            raise APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
        p = tuple(p)
    elif not p and not req.suffix:
        raise APIError(400, "the prompt is empty" + (" (and so is the suffix: nothing to fill in)"
                                                     if req.suffix == "" else ""), param="prompt",
                       code="invalid_value")
    if req.suffix and not isinstance(p, str):
        raise APIError(400, "suffix needs the prompt as text (the text before the cursor), not token ids",
                       param="prompt", code="invalid_value")
    if req.suffix and req.ignore_eos:
        raise APIError(400, "ignore_eos cannot be combined with suffix (a middle ends at its end token)",
                       param="ignore_eos", code="unsupported_parameter")
    lp = _completion_logprobs(req)
    if req.suffix and ((req.n or 1) > 1 or lp is not None):
        which = "n" if (req.n or 1) > 1 else "logprobs"
        raise APIError(400, f"{which} cannot be combined with suffix: a fill-in-the-middle answer is one "
                       "trimmed middle", param=which, code="unsupported_parameter")
    if req.echo and req.stream:
        raise APIError(400, "echo is not supported with stream", param="echo", code="unsupported_parameter")
    if req.max_tokens == 0 and not req.echo:
        raise APIError(400, "max_tokens 0 is only for echo (the prompt's logprobs alone)", param="max_tokens",
                       code="invalid_value")
    return GenerationSpec("completion", req.model, p, None, req.max_tokens, req.temperature, req.top_p,
                          req.top_k, req.seed, _stop(req.stop), req.stream,
                          bool(req.stream_options and req.stream_options.include_usage), req.ignore_eos,
                          n=req.n or 1, logprobs=lp, echo=bool(req.echo), suffix=req.suffix or None)


def _chat_logprobs(req: ChatCompletionRequest) -> int | None:
    """Chat: `logprobs` a boolean, `top_logprobs` (0..20) only with it. The alternatives asked, or None."""
    if req.logprobs is not None and type(req.logprobs) is not bool:
        raise APIError(400, f"logprobs must be a boolean on chat completions, got {req.logprobs!r} (the "
                       "number of alternatives is top_logprobs)", param="logprobs", code="invalid_value")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
    return (req.top_logprobs or 0) if req.logprobs else None


def _completion_logprobs(req: CompletionRequest) -> int | None:
    """Completions: `logprobs` the number of alternatives (an int, 0..20); `top_logprobs` is chat's."""
    if req.top_logprobs is not None:
        raise APIError(400, "top_logprobs is a chat completions parameter; on completions logprobs is "
                       "the number of alternatives", param="top_logprobs", code="unsupported_parameter")
    lp = req.logprobs
    if lp is None:
        return None
    if type(lp) is not int or not 0 <= lp <= MAX_TOP_LOGPROBS:
        raise APIError(400, f"logprobs must be an integer in 0..{MAX_TOP_LOGPROBS} on completions, got "
                       f"{lp!r}", param="logprobs", code="invalid_value")
    return lp
