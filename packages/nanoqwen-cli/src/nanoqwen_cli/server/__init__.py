"""The HTTP server of `nanoqwen-cli serve`: OpenAI-compatible routes over one engine.

Modules: protocol (request bodies -> GenerationSpec, the OpenAI error shape), engine_spec (what the
engine process builds, what it reports), engine_worker (the engine process's loop), engine_process
(the HTTP side of it: per-request queues, aborts, drain, the child's death), metrics (Prometheus
collectors), app (the FastAPI routes), runner (uvicorn, lifecycle, SIGTERM); testing (a server as a
subprocess) and fake_engine (a model-free engine) serve tests and benchmarks only. Imported only by
`serve` (fastapi, uvicorn and prometheus_client stay out of the other commands' start-up).
"""
