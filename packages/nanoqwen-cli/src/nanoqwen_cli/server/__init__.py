"""The HTTP server of `nanoqwen-cli serve`: OpenAI-compatible routes over one engine.

Modules: protocol (request bodies -> GenerationSpec, the OpenAI error shape), engine_loop (the thread
that owns the engine; per-request queues, aborts, drain), metrics (Prometheus collectors), app (the
FastAPI routes), runner (uvicorn, lifecycle, SIGTERM). Imported only by `serve` (fastapi, uvicorn and
prometheus_client stay out of the other commands' start-up).
"""
