"""The FastAPI app: OpenAI-compatible routes over one `EngineProcess`.

    POST /v1/chat/completions   messages -> the container's chat template -> tokens -> engine
    POST /v1/completions        prompt (text or token ids) -> engine
    GET  /v1/models             the one model served
    GET  /health                200 {"status": "ok", "engine_pid": PID} once the model is loaded (and
                                CUDA graphs captured); 503 {"status": "loading" | "draining" | "error",
                                "engine_pid": PID} otherwise ("error" with a "message": the model failed
                                to load, or the engine process died)
    GET  /metrics               Prometheus text format (metrics.py)

Both completions routes stream Server-Sent Events (`data: {chunk}` ... `data: [DONE]`) when
`stream` is true, else answer one JSON object; `usage` is in every non-streamed answer and, with
`stream_options.include_usage`, in a last chunk with empty `choices`. `finish_reason` is "stop"
(EOS or a stop string) or "length" (max_tokens, or the context is full).

Checks, in order: API key (401; /v1/* only, `Authorization: Bearer KEY`, compared in constant time),
body size (413), JSON and parameters (400/404, protocol.py), prompt length against the context (400
with both lengths), waiting queue (429 + Retry-After), then the engine. The response headers of a
streamed request are sent with its first token, so an engine refusal is still a 400. A client that
goes away (mid-stream, or while waiting for a non-streamed answer) aborts its request in the engine
at the next step, which frees its KV blocks.

A request's queue holds the text of each generated token (`str`), then one `Finish` (engine_worker.py).
A streamed chunk is framed from bytes prepared once per request around the JSON-encoded text (`_Framer`):
the per-token work of the event loop is one `json.dumps` of a string.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine_process import Draining, EngineProcess, Finish, NotReady, QueueFull, RequestHandle
from .engine_spec import EngineInfo
from .protocol import APIError, GenerationSpec, error_body, parse_chat, parse_completion

__all__ = ["AppConfig", "create_app"]

DISCONNECT_POLL_S = 0.25  # how often a request waiting for a token (not streaming yet) checks its client
CLIENT_GONE = 499  # nginx's "client closed request": logged only, nobody is there to read it


class ClientGone(Exception):
    """The client disconnected before its answer was sent (the request has been aborted)."""


@dataclass(frozen=True)
class AppConfig:
    """What the routes need besides the engine loop.

    pipeline: a `generate.Pipeline` used for its text side only (tokenizer, chat template, EOS ids,
      generation defaults of the container); its backend is not used.
    retry_after_s: the Retry-After of a 429 (seconds).
    """

    model_name: str
    pipeline: Any
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    retry_after_s: int = 1


def _finish_reason(reason: str) -> str:
    """Engine finish reason -> OpenAI's: EOS and stop strings are "stop"; max_tokens and a full context
    are "length"."""
    return "stop" if reason in ("eos", "stop") else "length"


def create_app(cfg: AppConfig, loop: EngineProcess) -> FastAPI:
    app = FastAPI(title="nanoqwen", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = loop.metrics
    metrics.waiting_fn = loop.waiting
    created = int(time.time())
    key = cfg.api_key.encode() if cfg.api_key else None

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        metrics.finished(str(exc.status))
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error", None, None),
                            status_code=exc.status_code)

    def authorize(request: Request) -> None:
        if key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                           type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    async def read_body(request: Request) -> bytes:
        limit = cfg.max_body_bytes
        too_big = APIError(413, f"the request body is larger than the limit of {limit} bytes",
                           code="request_too_large")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    def ready_engine() -> EngineInfo:
        if loop.load_error is not None:
            raise APIError(503, f"the model failed to load: {loop.load_error}", type="server_error",
                           code="model_load_failed")
        if loop.failure is not None:
            raise APIError(503, f"the engine failed: {loop.failure}", type="server_error",
                           code="engine_failed")
        if loop.info is None:
            raise APIError(503, "the model is loading; retry when GET /health answers 200",
                           type="server_error", code="loading", headers={"Retry-After": "5"})
        return loop.info

    @app.get("/health")
    async def health():
        pid = {"engine_pid": loop.engine_pid}
        if loop.load_error is not None:
            return JSONResponse({"status": "error", "message": f"the model failed to load: {loop.load_error}",
                                 **pid}, status_code=503)
        if loop.failure is not None:
            return JSONResponse({"status": "error", "message": loop.failure, **pid}, status_code=503)
        if loop.info is None:
            return JSONResponse({"status": "loading", **pid}, status_code=503)
        if loop.draining:
            return JSONResponse({"status": "draining", **pid}, status_code=503)
        return {"status": "ok", **pid}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        entry = {"id": cfg.model_name, "object": "model", "created": created, "owned_by": "nanoqwen"}
        if loop.info is not None:
            entry["max_model_len"] = loop.info.max_model_len
        return {"object": "list", "data": [entry]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        authorize(request)
        spec = parse_chat(await read_body(request), cfg.model_name)
        return await run(request, spec)

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        spec = parse_completion(await read_body(request), cfg.model_name)
        return await run(request, spec)

    # ---- generation -------------------------------------------------------------------------------
    def engine_request(spec: GenerationSpec, info: EngineInfo):
        from nanoqwen_runtime.engine.scheduler import Request as EngineRequest
        from nanoqwen_runtime.sampling import SamplingError

        pipe = cfg.pipeline
        if spec.kind == "chat":
            try:
                text = pipe.chat_prompt([{"role": r, "content": c} for r, c in spec.messages])
            except Exception as e:  # noqa: BLE001 - a template error is the request's fault
                raise APIError(400, f"the chat template failed on these messages: {e}", param="messages",
                               code="invalid_value") from None
            ids = pipe.tokenizer.encode(text)
        elif isinstance(spec.prompt, str):
            ids = pipe.tokenizer.encode(spec.prompt)
        else:
            vocab = info.vocab_size
            bad = [t for t in spec.prompt if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"prompt token ids must be in 0..{vocab - 1}, got {bad[:3]}",
                               param="prompt", code="invalid_value")
            ids = list(spec.prompt)
        limit = info.max_model_len
        if len(ids) >= limit:
            raise APIError(400, f"the prompt has {len(ids)} tokens but the context window is {limit} tokens "
                           "(prompt plus at least one generated token must fit); shorten the prompt",
                           param="messages" if spec.kind == "chat" else "prompt",
                           code="context_length_exceeded")
        try:
            params = pipe.sampling_params(temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k,
                                          seed=spec.seed, max_tokens=spec.max_tokens, stop=spec.stop or None)
        except SamplingError as e:
            raise APIError(400, str(e), code="invalid_value") from None
        prefix = "chatcmpl" if spec.kind == "chat" else "cmpl"
        return EngineRequest(ids, params, request_id=f"{prefix}-{uuid.uuid4().hex}",
                             eos_ids=pipe.eos_ids, ignore_eos=spec.ignore_eos, detokenize=True)

    async def next_event(handle: RequestHandle, request: Request):
        """The handle's next event; aborts the request (and raises ClientGone) if the client left.

        The client is looked at every DISCONNECT_POLL_S, also while events keep arriving (a request
        that streams tokens faster than the poll interval would otherwise never be checked)."""
        while True:
            if time.monotonic() - handle.t_client_checked >= DISCONNECT_POLL_S:
                handle.t_client_checked = time.monotonic()
                if await request.is_disconnected():
                    handle.abort()
                    raise ClientGone
            try:
                return await asyncio.wait_for(handle.queue.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                continue

    async def next_event_or_abort(handle: RequestHandle, request: Request):
        """`next_event` for the non-streamed paths: when it fails (the client left: ClientGone; the
        handler was cancelled or broke) the request is aborted in the engine, counted as aborted, and
        the exception goes on."""
        try:
            return await next_event(handle, request)
        except ClientGone:  # next_event has aborted it
            metrics.finished("aborted")
            raise
        except BaseException:
            handle.abort()
            metrics.finished("aborted")
            raise

    async def run(request: Request, spec: GenerationSpec):
        ereq = engine_request(spec, ready_engine())
        try:
            handle = loop.submit(ereq)
        except QueueFull as e:
            raise APIError(429, str(e), type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(cfg.retry_after_s)}) from None
        except (Draining, NotReady) as e:
            raise APIError(503, str(e), type="server_error", code="unavailable") from None
        try:
            first = await next_event_or_abort(handle, request)
        except ClientGone:
            return Response(status_code=CLIENT_GONE)
        if _is_finish(first) and first.reason in ("refused", "aborted"):
            status = "aborted" if first.reason == "aborted" else "400"
            metrics.finished(status)
            if first.reason == "aborted":
                raise APIError(503, f"the request was ended before it ran: {first.detail}",
                               type="server_error", code="aborted")
            raise APIError(400, f"the request cannot run: {first.detail}", code="invalid_value")
        if spec.stream:
            return StreamingResponse(stream(handle, spec, first), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await complete(request, handle, spec, first)

    async def complete(request: Request, handle: RequestHandle, spec: GenerationSpec, ev):
        parts: list[str] = []
        try:
            while type(ev) is str:
                parts.append(ev)
                ev = await next_event_or_abort(handle, request)
        except ClientGone:
            return Response(status_code=CLIENT_GONE)
        parts.append(ev.text)
        _count(ev)
        if ev.reason == "error":
            raise APIError(500, f"the model failed on this request: {ev.detail}", type="server_error",
                           code="model_error")
        if ev.reason == "aborted":
            raise APIError(503, f"the request was ended: {ev.detail or 'aborted'}", type="server_error",
                           code="aborted")
        text, reason = "".join(parts), _finish_reason(ev.reason)
        base = {"id": handle.request_id, "created": int(time.time()), "model": cfg.model_name,
                "usage": _usage(ev)}
        if spec.kind == "chat":
            return {**base, "object": "chat.completion", "choices": [{
                "index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": reason}]}
        return {**base, "object": "text_completion", "choices": [{
            "index": 0, "text": text, "logprobs": None, "finish_reason": reason}]}

    async def stream(handle: RequestHandle, spec: GenerationSpec, first) -> AsyncIterator[bytes]:
        chat = spec.kind == "chat"
        base = {"id": handle.request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": cfg.model_name}

        def chunk(text: str | None, reason: str | None, role: bool = False) -> bytes:
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
                if text:
                    delta["content"] = text
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
            return _sse({**base, "choices": [choice]})

        text_chunk = _Framer({**base, "choices": [
            {"index": 0, "delta": {"content": _Framer.SLOT}, "logprobs": None, "finish_reason": None} if chat
            else {"index": 0, "text": _Framer.SLOT, "logprobs": None, "finish_reason": None}]})
        ev = first
        done = False
        get_nowait, empty = handle.queue.get_nowait, handle.queue.empty
        try:
            if chat:
                yield chunk(None, None, role=True)
            while True:
                # everything that arrived since the last write goes out as one chunk
                texts = []
                while type(ev) is str:
                    texts.append(ev)
                    if empty():
                        break
                    ev = get_nowait()
                if type(ev) is Finish:
                    done = True
                    texts.append(ev.text)
                    _count(ev)
                    if ev.reason in ("error", "aborted"):
                        kind = "model_error" if ev.reason == "error" else "aborted"
                        yield _sse(error_body(f"the request ended early: {ev.detail or ev.reason}",
                                              "server_error", None, kind))
                    else:
                        yield chunk("".join(texts), _finish_reason(ev.reason))
                        if spec.include_usage:
                            yield _sse({**base, "choices": [], "usage": _usage(ev)})
                    yield b"data: [DONE]\n\n"
                    return
                text = "".join(texts)
                if text:
                    yield text_chunk(text)
                ev = await handle.queue.get()
        finally:
            if not done:  # the client went away (the response task was cancelled) or a write failed
                handle.abort()
                metrics.finished("aborted")

    def _count(ev) -> None:
        status = ev.reason if ev.reason in ("error", "aborted") else _finish_reason(ev.reason)
        metrics.finished(status, ev.num_prompt_tokens, ev.num_generated)

    return app


def _is_finish(ev) -> bool:
    return type(ev) is Finish


class _Framer:
    """`data: {chunk}` bytes of a chunk whose only varying field is one string, framed from a head and a
    tail encoded once: `framer(text)` == `_sse(template with SLOT replaced by text)`, for ~1/5 of the cost
    of encoding the whole chunk per token. The slot is the template's last string field (rpartition:
    the model name or id could hold the same characters, never after it)."""

    SLOT = "\x00nanoqwen-slot\x00"

    def __init__(self, template: dict[str, Any]):
        head, slot, tail = _sse(template).rpartition(json.dumps(self.SLOT).encode())
        if not slot:
            raise ValueError("the chunk template has no slot")
        self.head, self.tail = head, tail

    def __call__(self, text: str) -> bytes:
        return self.head + json.dumps(text, ensure_ascii=False).encode() + self.tail


def _usage(ev) -> dict[str, int]:
    return {"prompt_tokens": ev.num_prompt_tokens, "completion_tokens": ev.num_generated,
            "total_tokens": ev.num_prompt_tokens + ev.num_generated}


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
