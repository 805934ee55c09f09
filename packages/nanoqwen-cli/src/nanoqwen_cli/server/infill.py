"""Fill-in-the-middle routes: llama.cpp's `POST /infill`, and `/v1/completions` with `suffix`.

    POST /infill   {"input_prefix", "input_suffix", "input_extra": [{"filename", "text"}], "prompt",
                    "n_predict", "temperature", "top_k", "top_p", "seed", "stop", "t_max_predict_ms",
                    "stream", extensions "max_lines", "trim_suffix_repeat", "infill_way"}
        -> {"content", "stop": true, "stop_type", "stopping_word", "tokens_predicted", "tokens_evaluated",
            "tokens_cached", "truncated", "timings": {"prompt_n", "prompt_ms", "prompt_per_token_ms",
            "prompt_per_second", "predicted_n", "predicted_ms", "predicted_per_token_ms",
            "predicted_per_second"}, "model", "index"}
        streamed: `data: {"content": "...", "stop": false, "index": 0}` lines, then one with
        "stop": true and the fields above (llama-server sends no `[DONE]` on this route)
    POST /v1/completions with "suffix": the same prompt, OpenAI's text_completion answer

The prompt is `nanoqwen_runtime.fim`'s: the FIM tokens, or the chat-template infill for a small
Instruct model (`Pipeline.infill_way`: `fim.choose_way` by the container's variant and size, as
measured); `infill_way` overrides it per request. `prompt` (llama-server: text typed after the
prefix on the cursor's line) is appended to the prefix. Extra files that do not fit the context (less
`n_predict`) are dropped whole, the first given first, before anything else; a prefix and suffix that
do not fit alone are a 400 with both lengths.

The middle is trimmed on its way out (`fim.MiddleTrimmer`): where it starts repeating the suffix (as
editors do; `trim_suffix_repeat: false` turns it off) and at `max_lines` lines. `t_max_predict_ms` (as
llama-server): once that many milliseconds have passed since the first token and a newline has been
generated, the request ends. A trim or a time budget that ends the request aborts it in the engine at
its next step, as a client that goes away does (its KV blocks are freed there); the answer says
`stop_type: "limit"` for the time budget and the line budget, "word" for a stop string, "eos" else.

Fields llama.vim and llama.vscode send that have no meaning here are accepted and not used
(`IGNORED`); any other unknown field is a 400.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from .engine_process import Finish, RequestHandle
from .protocol import APIError, _load_json, _validate
from .routes import ClientGone
from .sse import finish_reason, sse, usage

__all__ = ["IGNORED", "InfillRequest", "InfillRoutes", "InfillJob"]

# sent by llama.vim / llama.vscode / llama-server clients, meaningless here (prefix caching is always on;
# one sampler chain; no slots)
IGNORED = ("samplers", "cache_prompt", "t_max_prompt_ms", "response_fields", "id_slot", "n_indent", "n_probs",
           "model", "min_p", "repeat_penalty", "typical_p", "n_keep", "return_tokens")


class ExtraChunk(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    filename: str = "tmp"
    text: str = ""


class InfillRequest(BaseModel):
    """llama-server's /infill body (the fields this server uses; see IGNORED)."""

    model_config = ConfigDict(extra="allow", strict=True)
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraChunk] = Field(default_factory=list)
    prompt: str = ""
    n_predict: int | None = Field(default=None, ge=-1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_k: int | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-1, lt=2**63)
    stop: list[str] | None = None
    t_max_predict_ms: int | None = Field(default=None, ge=0)
    stream: bool = False
    max_lines: int | None = Field(default=None, ge=1)      # extension: line budget of the middle
    trim_suffix_repeat: bool = True                        # extension: cut where the suffix repeats
    infill_way: str | None = None                          # extension: "fim" | "chat" (default: by model)


@dataclass
class InfillJob:
    """One infill request, from either route."""

    prefix: str
    suffix: str
    extra: list[dict]
    max_tokens: int | None
    temperature: float | None
    top_k: int | None
    top_p: float | None
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    t_max_predict_ms: int | None = None
    max_lines: int | None = None
    trim: bool = True
    way: str | None = None
    include_usage: bool = False


def parse_infill(body: bytes) -> InfillJob:
    req = _validate(InfillRequest, _load_json(body))
    unknown = sorted(k for k in (req.model_extra or {}) if k not in IGNORED)
    if unknown:
        raise APIError(400, f"unknown or unsupported parameter {unknown[0]!r}", param=unknown[0],
                       code="unsupported_parameter")
    if req.infill_way not in (None, "fim", "chat"):
        raise APIError(400, f"infill_way must be 'fim' or 'chat', got {req.infill_way!r}", param="infill_way",
                       code="invalid_value")
    if req.n_predict == 0:
        raise APIError(400, "n_predict must be >= 1, or -1 for the default", param="n_predict",
                       code="invalid_value")
    return InfillJob(req.input_prefix + req.prompt, req.input_suffix,
                     [{"filename": c.filename, "text": c.text} for c in req.input_extra],
                     None if req.n_predict in (None,
                                               -1) else req.n_predict, req.temperature, req.top_k, req.top_p,
                     None if req.seed in (None, -1) else req.seed, tuple(req.stop or ()), req.stream,
                     req.t_max_predict_ms or None, req.max_lines, req.trim_suffix_repeat, req.infill_way)


@dataclass
class _Outcome:
    reason: str            # engine finish reason, or "trim" (suffix repeat) / "lines" / "time" (the server's)
    n_prompt: int
    n_generated: int
    t_submit: float
    t_first: float | None
    t_end: float


class InfillRoutes:
    """The FIM handlers over a `routes.Routes` (its checks, engine loop, disconnect handling)."""

    def __init__(self, routes):
        self.routes = routes

    # ---- routes -----------------------------------------------------------------------------------
    async def infill(self, request: Request):
        r = self.routes
        r.authorize(request)
        job = parse_infill(await r.read_body(request))
        return await self.run(request, job, llama=True)

    async def completions_with_suffix(self, request: Request, spec) -> Any:
        """`/v1/completions` whose body has a non-empty `suffix` (`spec`: protocol.GenerationSpec)."""
        job = InfillJob(spec.prompt, spec.suffix, [], spec.max_tokens, spec.temperature, spec.top_k,
                        spec.top_p,
                        spec.seed, spec.stop, spec.stream, include_usage=spec.include_usage)
        return await self.run(request, job, llama=False)

    # ---- the request ------------------------------------------------------------------------------
    def engine_request(self, job: InfillJob, info):
        from nanoqwen_runtime import fim
        from nanoqwen_runtime.engine.scheduler import Request as EngineRequest
        from nanoqwen_runtime.sampling import SamplingError

        pipe = self.routes.cfg.pipeline
        way = job.way or pipe.infill_way
        limit = info.max_model_len
        try:
            params = pipe.sampling_params(temperature=job.temperature, top_p=job.top_p, top_k=job.top_k,
                                          seed=job.seed, max_tokens=job.max_tokens)
        except SamplingError as e:
            raise APIError(400, str(e), code="invalid_value") from None
        budget = max(1, limit - min(params.max_tokens, limit // 2))
        try:
            prompt = fim.build_prompt(way, pipe.tokenizer, pipe.template, job.prefix, job.suffix, job.extra,
                                      budget=budget)
        except fim.ContextOverflowError as e:
            if e.prompt_tokens < limit:  # fits the context, leaving fewer tokens to generate than asked
                prompt = fim.build_prompt(way, pipe.tokenizer, pipe.template, job.prefix, job.suffix, [],
                                          budget=limit - 1)
            else:
                raise APIError(400,
                               f"the infill prompt has {e.prompt_tokens} tokens (prefix {e.n_prefix}, suffix "
                               f"{e.n_suffix}; extra files dropped) but the context window is {limit} tokens "
                               "(prompt plus at least one generated token must fit); send less prefix or "
                               "suffix",
                               param="input_prefix", code="context_length_exceeded") from None
        except fim.FIMError as e:
            raise APIError(400, str(e), code="invalid_value") from None
        try:
            params = params.with_(stop=tuple(job.stop) + prompt.stop)
        except SamplingError as e:
            raise APIError(400, str(e), param="stop", code="invalid_value") from None
        ereq = EngineRequest(prompt.ids, params, request_id=f"infill-{uuid.uuid4().hex}",
                             eos_ids=frozenset(pipe.eos_ids) | prompt.stop_ids, detokenize=True)
        return ereq, prompt

    async def run(self, request: Request, job: InfillJob, llama: bool):
        from nanoqwen_runtime.fim import FIMError, MiddleTrimmer

        r = self.routes
        info = r.ready_engine()
        ereq, prompt = self.engine_request(job, info)
        try:
            trimmer = MiddleTrimmer(job.suffix, max_lines=job.max_lines, suffix_repeat=job.trim)
        except FIMError as e:
            raise APIError(400, str(e), param="max_lines", code="invalid_value") from None
        t_submit = time.perf_counter()
        handle = r.submit(ereq)
        out = _Outcome("", len(prompt.ids), 0, t_submit, None, t_submit)
        pieces = self.pieces(request, handle, job, trimmer, out)
        if job.stream:
            try:
                first = await pieces.__anext__()
            except StopAsyncIteration:
                first = None
            except _Refused as e:
                raise APIError(400, f"the request cannot run: {e}", code="invalid_value") from None
            except APIError:
                raise
            except BaseException as e:  # the client left (next_event aborted it), or a cancelled handler
                handle.abort()
                r.metrics.finished("aborted")
                if isinstance(e, _ClientGone):
                    return Response(status_code=499)
                raise
            gen = self.llama_stream(handle, pieces, first, out, prompt) if llama else \
                self.openai_stream(handle, pieces, first, out, job)
            return StreamingResponse(gen, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        parts = []
        try:
            async for piece in pieces:
                parts.append(piece)
        except _Refused as e:
            raise APIError(400, f"the request cannot run: {e}", code="invalid_value") from None
        except _ClientGone:
            return Response(status_code=499)
        text = "".join(parts)
        if llama:
            return self.llama_final(text, out, prompt)
        return {"id": handle.request_id, "object": "text_completion", "created": int(time.time()),
                "model": r.cfg.model_name, "usage": _usage(out),
                "choices": [{"index": 0, "text": text, "logprobs": None,
                             "finish_reason": _openai_reason(out)}]}

    async def pieces(self, request: Request, handle: RequestHandle, job: InfillJob, trimmer, out: _Outcome
                     ) -> AsyncIterator[str]:
        """The middle's text as it becomes safe to show; fills `out` (why it ended, counts, times). Ends
        the engine request early on a trim or the time budget; a client that goes away aborts it
        (routes.Routes.next_event)."""
        r = self.routes
        # streamed: the response's generator aborts and counts a request the client left; else this does
        next_event = r.next_event if job.stream else r.next_event_or_abort
        seen_newline = False
        budget_s = job.t_max_predict_ms / 1000 if job.t_max_predict_ms else None
        while True:
            try:
                ev = await next_event(handle, request)
            except ClientGone:
                raise _ClientGone from None
            if type(ev) is Finish:
                if ev.reason in ("refused", "aborted", "error"):
                    if ev.reason == "refused":
                        r.metrics.finished("400")
                        raise _Refused(ev.detail)
                    r.count(ev)
                    raise APIError(500 if ev.reason == "error" else 503,
                                   f"the request ended early: {ev.detail or ev.reason}", type="server_error",
                                   code="model_error" if ev.reason == "error" else "aborted")
                piece, _ = trimmer.push(ev.text)
                piece += trimmer.flush()
                out.reason = ("lines" if trimmer.cut_by == "lines" else "trim") if trimmer.trimmed \
                    else ev.reason
                out.n_prompt, out.n_generated = ev.num_prompt_tokens, ev.num_generated
                out.t_end = time.perf_counter()
                r.count(ev)
                if piece:
                    yield piece
                return
            now = time.perf_counter()
            out.n_generated += 1
            if out.t_first is None:
                out.t_first = now
            seen_newline = seen_newline or "\n" in ev
            piece, done = trimmer.push(ev)
            over_time = budget_s is not None and seen_newline and now - out.t_first >= budget_s
            if done or over_time:
                if not done:
                    piece += trimmer.flush()
                handle.abort()  # freed at the engine's next step
                out.reason = ("lines" if trimmer.cut_by == "lines" else "trim") if done else "time"
                out.t_end = now
                r.metrics.finished("stop", out.n_prompt, out.n_generated)
                if piece:
                    yield piece
                return
            if piece:
                yield piece

    # ---- answers ----------------------------------------------------------------------------------
    def llama_final(self, text: str, out: _Outcome, prompt) -> dict[str, Any]:
        t_first = out.t_first if out.t_first is not None else out.t_end
        prompt_ms = (t_first - out.t_submit) * 1000
        predicted_ms = (out.t_end - t_first) * 1000
        n_pred = out.n_generated
        stop_type = {"eos": "eos", "stop": "word", "trim": "eos"}.get(out.reason, "limit")
        return {
            "index": 0, "content": text, "stop": True, "model": self.routes.cfg.model_name,
            "stop_type": stop_type, "stopping_word": "", "tokens_predicted": n_pred,
            "tokens_evaluated": out.n_prompt, "tokens_cached": out.n_prompt + n_pred,
            "truncated": prompt.extras_dropped > 0,  # (llama-server: the input was cut to fit)
            "infill_way": prompt.way, "extra_files_used": prompt.extras_used,
            "extra_files_dropped": prompt.extras_dropped,
            "timings": {"prompt_n": out.n_prompt, "prompt_ms": round(prompt_ms, 3),
                        "prompt_per_token_ms": round(prompt_ms / max(1, out.n_prompt), 3),
                        "prompt_per_second": round(out.n_prompt / prompt_ms * 1000,
                                                   3) if prompt_ms > 0 else 0.0,
                        "predicted_n": n_pred, "predicted_ms": round(predicted_ms, 3),
                        "predicted_per_token_ms": round(predicted_ms / max(1, n_pred - 1), 3),
                        "predicted_per_second": round((n_pred - 1) / predicted_ms * 1000, 3)
                        if predicted_ms > 0 and n_pred > 1 else 0.0},
        }

    async def llama_stream(self, handle, pieces, first, out: _Outcome, prompt) -> AsyncIterator[bytes]:
        done = False
        try:
            if first:
                yield sse({"index": 0, "content": first, "stop": False})
            try:
                async for piece in pieces:
                    yield sse({"index": 0, "content": piece, "stop": False})
            except _ClientGone:  # aborted by next_event; counted below
                return
            except (APIError, _Refused) as e:
                done = True
                yield sse({"error": {"message": str(e), "type": "server_error"}})
                return
            done = True
            yield sse({**self.llama_final("", out, prompt)})
        finally:
            if not done:
                handle.abort()
                self.routes.metrics.finished("aborted")

    async def openai_stream(self, handle, pieces, first, out: _Outcome,
                            job: InfillJob) -> AsyncIterator[bytes]:
        r = self.routes
        base = {"id": handle.request_id, "object": "text_completion", "created": int(time.time()),
                "model": r.cfg.model_name}

        def chunk(text: str, reason: str | None) -> bytes:
            return sse({**base, "choices": [{"index": 0, "text": text, "logprobs": None,
                                             "finish_reason": reason}]})

        done = False
        try:
            if first:
                yield chunk(first, None)
            try:
                async for piece in pieces:
                    yield chunk(piece, None)
            except _ClientGone:  # aborted by next_event; counted below
                return
            except (APIError, _Refused) as e:
                done = True
                yield sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
                yield b"data: [DONE]\n\n"
                return
            done = True
            yield chunk("", _openai_reason(out))
            if job.include_usage:
                yield sse({**base, "choices": [], "usage": _usage(out)})
            yield b"data: [DONE]\n\n"
        finally:
            if not done:
                handle.abort()
                r.metrics.finished("aborted")


class _Refused(Exception):
    """The engine refused the request at submit (its reason is the message)."""


class _ClientGone(Exception):
    """The client went away (the request has been aborted)."""


def _openai_reason(out: _Outcome) -> str:
    return "stop" if out.reason in ("trim", "lines", "time") else finish_reason(out.reason)


def _usage(out: _Outcome) -> dict[str, int]:
    return usage(Finish("", out.reason, num_prompt_tokens=out.n_prompt, num_generated=out.n_generated))
