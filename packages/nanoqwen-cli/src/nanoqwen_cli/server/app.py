"""The FastAPI app: OpenAI-compatible routes over one `EngineProcess`.

    POST /v1/chat/completions   messages -> the container's chat template -> tokens -> engine
    POST /v1/completions        prompt (text or token ids) -> engine; with `suffix`: fill-in-the-middle
    POST /infill                llama.cpp's fill-in-the-middle route (infill.py)
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

The handlers are `routes.Routes`' methods. A request's queue holds the text of each generated token
(`str`), then one `Finish` (engine_worker.py). A streamed chunk is framed from bytes prepared once per
request around the JSON-encoded text (`sse.Framer`): the per-token work of the event loop is one
`json.dumps` of a string.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine_process import EngineProcess
from .infill import InfillRoutes
from .protocol import APIError, error_body
from .routes import Routes

__all__ = ["AppConfig", "create_app"]


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


def create_app(cfg: AppConfig, loop: EngineProcess) -> FastAPI:
    """The FastAPI app: `Routes`' handlers on their paths, and the error handlers."""
    app = FastAPI(title="nanoqwen", docs_url=None, redoc_url=None, openapi_url=None)
    routes = Routes(cfg, loop)
    loop.metrics.waiting_fn = loop.waiting

    async def api_error(request: Request, exc: APIError):
        routes.metrics.finished(str(exc.status))
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error", None, None),
                            status_code=exc.status_code)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/metrics", routes.prometheus, methods=["GET"])
    app.add_api_route("/v1/models", routes.models, methods=["GET"])
    app.add_api_route("/v1/chat/completions", routes.chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
    infill = InfillRoutes(routes)
    routes.suffix_completions = infill.completions_with_suffix
    app.add_api_route("/infill", infill.infill, methods=["POST"])  # llama.cpp's FIM route
    return app
