"""The OpenAI-compatible route handlers, one method each, over one `EngineProcess`.

`Routes` holds what every handler needs (the app config, the engine loop, the metrics) and owns the
path of a generation request: parse (protocol.py) -> tokens and sampling parameters (`engine_request`)
-> submit to the engine (`generate`) -> one JSON answer (`complete`) or an SSE stream (`stream`).
Requests with n > 1 choices, logprobs or echo take choices.py's path instead.
app.py wires the methods to paths; the module docstring there lists the routes and their checks.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from . import choices
from .disconnect import CLIENT_GONE, DISCONNECT_POLL_S, ClientGone
from .engine_process import Draining, EngineProcess, Finish, NotReady, QueueFull, RequestHandle
from .engine_spec import EngineInfo
from .protocol import APIError, GenerationSpec, error_body, parse_chat, parse_completion
from .sse import Framer, finish_reason, sse, usage
from .tools import ToolStream, parse_tool_calls, tool_grammar

__all__ = ["CLIENT_GONE", "DISCONNECT_POLL_S", "Routes"]


class Routes:
    """The handlers of one app. `cfg` is an `app.AppConfig`; `loop` the engine process."""

    def __init__(self, cfg, loop: EngineProcess):
        self.cfg = cfg
        self.loop = loop
        self.metrics = loop.metrics
        self.created = int(time.time())
        self._key = cfg.api_key.encode() if cfg.api_key else None
        self.suffix_completions = None  # /v1/completions with a suffix (app.py sets infill.py's handler)

    # ---- checks shared by the routes --------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        if self._key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._key):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                           type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    async def read_body(self, request: Request) -> bytes:
        limit = self.cfg.max_body_bytes
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

    def ready_engine(self) -> EngineInfo:
        loop = self.loop
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

    # ---- routes -----------------------------------------------------------------------------------
    async def health(self):
        loop = self.loop
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

    async def prometheus(self):
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request):
        self.authorize(request)
        entry = {"id": self.cfg.model_name, "object": "model", "created": self.created,
                 "owned_by": "nanoqwen"}
        if self.loop.info is not None:
            entry["max_model_len"] = self.loop.info.max_model_len
        return {"object": "list", "data": [entry]}

    async def chat_completions(self, request: Request):
        self.authorize(request)
        spec = parse_chat(await self.read_body(request), self.cfg.model_name)
        return await self.generate(request, spec)

    async def completions(self, request: Request):
        self.authorize(request)
        spec = parse_completion(await self.read_body(request), self.cfg.model_name)
        if spec.suffix:  # fill-in-the-middle: infill.InfillRoutes, set by app.py
            return await self.suffix_completions(request, spec)
        return await self.generate(request, spec)

    # ---- generation -------------------------------------------------------------------------------
    def prompt_ids(self, spec: GenerationSpec, info: EngineInfo) -> list[int]:
        """The prompt's token ids: the chat template over the messages, the text encoded, or the ids
        given (checked against the vocabulary)."""
        pipe = self.cfg.pipeline
        if spec.kind == "chat":
            plan = spec.tool_plan
            try:
                if pipe.template is None:
                    raise ValueError("this container has no chat template")
                text = pipe.template.render(list(spec.chat_messages), add_generation_prompt=True,
                                            tools=plan.tools if plan is not None and plan.active else None)
            except Exception as e:  # noqa: BLE001 - a template error is the request's fault
                raise APIError(400, f"the chat template failed on these messages: {e}", param="messages",
                               code="invalid_value") from None
            return pipe.tokenizer.encode(text)
        if isinstance(spec.prompt, str):
            return pipe.tokenizer.encode(spec.prompt)
        vocab = info.vocab_size
        bad = [t for t in spec.prompt if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"prompt token ids must be in 0..{vocab - 1}, got {bad[:3]}",
                           param="prompt", code="invalid_value")
        return list(spec.prompt)

    def engine_request(self, spec: GenerationSpec, info: EngineInfo):
        """The engine `Request` of a parsed spec: prompt ids within the context, sampling parameters."""
        from nanoqwen_runtime.engine.scheduler import Request as EngineRequest
        from nanoqwen_runtime.sampling import SamplingError

        pipe = self.cfg.pipeline
        ids = self.prompt_ids(spec, info)
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
        grammar = spec.grammar
        if spec.tool_plan is not None and spec.tool_plan.forced:
            grammar = tool_grammar(spec.tool_plan, pipe.tokenizer)
        if grammar is not None and spec.ignore_eos:
            raise APIError(400, "ignore_eos cannot be combined with response_format or a forced tool_choice",
                           param="ignore_eos", code="invalid_value")
        return EngineRequest(ids, params, request_id=f"{prefix}-{uuid.uuid4().hex}",
                             eos_ids=pipe.eos_ids, ignore_eos=spec.ignore_eos, detokenize=True,
                             grammar=grammar)

    def submit(self, ereq) -> RequestHandle:
        """Hand a request to the engine; the engine's refusals become 429 / 503."""
        try:
            return self.loop.submit(ereq)
        except QueueFull as e:
            raise APIError(429, str(e), type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(self.cfg.retry_after_s)}) from None
        except (Draining, NotReady) as e:
            raise APIError(503, str(e), type="server_error", code="unavailable") from None

    async def generate(self, request: Request, spec: GenerationSpec):
        if choices.wants_choices(spec):  # n > 1, logprobs, echo: choices.py
            return await choices.generate(self, request, spec)
        handle = self.submit(self.engine_request(spec, self.ready_engine()))
        try:
            first = await self.first_event(handle, request)
        except ClientGone:
            return Response(status_code=CLIENT_GONE)
        if spec.stream:
            return StreamingResponse(self.stream(handle, spec, first), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self.complete(request, handle, spec, first)

    async def first_event(self, handle: RequestHandle, request: Request):
        """A submitted request's first event. The engine's refusal of it before it ran is the request's
        error: 400 (it cannot run) or 503 (it was ended). Raises ClientGone as `next_event_or_abort`."""
        first = await self.next_event_or_abort(handle, request)
        if type(first) is Finish and first.reason in ("refused", "aborted"):
            self.metrics.finished("aborted" if first.reason == "aborted" else "400")
            if first.reason == "aborted":
                raise APIError(503, f"the request was ended before it ran: {first.detail}",
                               type="server_error", code="aborted")
            raise APIError(400, f"the request cannot run: {first.detail}", code="invalid_value")
        return first

    async def next_event(self, handle: RequestHandle, request: Request):
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

    async def next_event_or_abort(self, handle: RequestHandle, request: Request):
        """`next_event` for the non-streamed paths: when it fails (the client left: ClientGone; the
        handler was cancelled or broke) the request is aborted in the engine, counted as aborted, and
        the exception goes on."""
        try:
            return await self.next_event(handle, request)
        except ClientGone:  # next_event has aborted it
            self.metrics.finished("aborted")
            raise
        except BaseException:
            handle.abort()
            self.metrics.finished("aborted")
            raise

    def count(self, ev: Finish) -> None:
        status = ev.reason if ev.reason in ("error", "aborted") else finish_reason(ev.reason)
        self.metrics.finished(status, ev.num_prompt_tokens, ev.num_generated)

    async def complete(self, request: Request, handle: RequestHandle, spec: GenerationSpec, ev):
        """The non-streamed answer: every token's text, then the finish."""
        parts: list[str] = []
        try:
            while type(ev) is str:
                parts.append(ev)
                ev = await self.next_event_or_abort(handle, request)
        except ClientGone:
            return Response(status_code=CLIENT_GONE)
        parts.append(ev.text)
        self.count(ev)
        if ev.reason == "error":
            raise APIError(500, f"the model failed on this request: {ev.detail}", type="server_error",
                           code="model_error")
        if ev.reason == "aborted":
            raise APIError(503, f"the request was ended: {ev.detail or 'aborted'}", type="server_error",
                           code="aborted")
        text, reason = "".join(parts), finish_reason(ev.reason)
        base = {"id": handle.request_id, "created": int(time.time()), "model": self.cfg.model_name,
                "usage": usage(ev)}
        if spec.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if spec.tool_plan is not None and spec.tool_plan.active and reason == "stop":
                content, calls = parse_tool_calls(text, spec.tool_plan)
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": calls}
                    reason = "tool_calls"
            return {**base, "object": "chat.completion", "choices": [{
                "index": 0, "message": message, "logprobs": None, "finish_reason": reason}]}
        return {**base, "object": "text_completion", "choices": [{
            "index": 0, "text": text, "logprobs": None, "finish_reason": reason}]}

    async def stream(self, handle: RequestHandle, spec: GenerationSpec, first) -> AsyncIterator[bytes]:
        """The streamed answer: a chunk per batch of tokens that arrived since the last write, the
        finish chunk, the usage chunk if asked for, `[DONE]`."""
        chat = spec.kind == "chat"
        base = {"id": handle.request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.cfg.model_name}

        def chunk(text: str | None, reason: str | None, role: bool = False) -> bytes:
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
                if text:
                    delta["content"] = text
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
            return sse({**base, "choices": [choice]})

        text_chunk = Framer({**base, "choices": [
            {"index": 0, "delta": {"content": Framer.SLOT}, "logprobs": None, "finish_reason": None} if chat
            else {"index": 0, "text": Framer.SLOT, "logprobs": None, "finish_reason": None}]})
        tool_stream = ToolStream(spec.tool_plan) if chat and spec.tool_plan is not None \
            and spec.tool_plan.active else None

        def deltas(text: str, reason: str | None = None) -> list[bytes]:
            """Tool mode: the chunks of `text` (content and tool-call deltas) and of the finish."""
            out = [sse({**base, "choices": [{"index": 0, "delta": d, "logprobs": None,
                                              "finish_reason": None}]}) for d in tool_stream.push(text)]
            if reason is not None:
                out += [sse({**base, "choices": [{"index": 0, "delta": d, "logprobs": None,
                                                  "finish_reason": None}]}) for d in tool_stream.flush()]
                if reason == "stop" and tool_stream.num_calls:
                    reason = "tool_calls"
                out.append(chunk(None, reason))
            return out

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
                    self.count(ev)
                    if ev.reason in ("error", "aborted"):
                        kind = "model_error" if ev.reason == "error" else "aborted"
                        yield sse(error_body(f"the request ended early: {ev.detail or ev.reason}",
                                             "server_error", None, kind))
                    elif tool_stream is not None:
                        for b in deltas("".join(texts), finish_reason(ev.reason)):
                            yield b
                    else:
                        yield chunk("".join(texts), finish_reason(ev.reason))
                        if spec.include_usage:
                            yield sse({**base, "choices": [], "usage": usage(ev)})
                    yield b"data: [DONE]\n\n"
                    return
                text = "".join(texts)
                if text and tool_stream is not None:
                    for b in deltas(text):
                        yield b
                elif text:
                    yield text_chunk(text)
                ev = await handle.queue.get()
        finally:
            if not done:  # the client went away (the response task was cancelled) or a write failed
                handle.abort()
                self.metrics.finished("aborted")
