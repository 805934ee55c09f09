"""Run the app under uvicorn with the engine loop's lifecycle and a graceful SIGTERM.

Lifecycle:
    startup    the engine thread starts loading (`EngineLoop.start`); the port is open at once and
               /health answers 503 "loading" until the engine is ready. A failed load stops the
               server and `run_server` returns the error (the CLI prints it, exit 1).
    SIGTERM    uvicorn stops accepting connections and the loop marks itself draining (new requests
               on open connections get 503); uvicorn waits up to `drain_timeout_s` for running
               responses, then cancels the rest, whose requests are aborted; the engine thread stops.
               uvicorn re-raises the SIGTERM it caught once done: a no-op handler installed before
               makes that harmless, so the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Callable
from typing import Any

import uvicorn

from .app import AppConfig, create_app
from .engine_loop import EngineLoop
from .metrics import Metrics

__all__ = ["run_server"]

SWITCH_INTERVAL_S = 0.0005


class _Server(uvicorn.Server):
    """uvicorn's server that also tells the engine loop to drain when a signal asks it to exit."""

    engine_loop: EngineLoop | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if self.engine_loop is not None:
            self.engine_loop._draining = True
        super().handle_exit(sig, frame)


def run_server(factory: Callable[[], Any], pipeline: Any, model_name: str, *, host: str, port: int,
               api_key: str | None, max_body_bytes: int, max_waiting: int, drain_timeout_s: float,
               log_level: str = "info") -> BaseException | None:
    """Serve until SIGTERM/SIGINT. Returns the engine's load error, if loading failed."""
    metrics = Metrics()
    loop = EngineLoop(factory, metrics, max_waiting=max_waiting)
    holder: dict[str, _Server] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop.start(asyncio.get_running_loop())
        watcher = asyncio.create_task(_watch_load(loop, holder, host, port))
        try:
            yield
        finally:
            watcher.cancel()
            await loop.drain(0.0)  # uvicorn has already waited drain_timeout_s for open responses

    app = create_app(AppConfig(model_name=model_name, pipeline=pipeline, api_key=api_key,
                               max_body_bytes=max_body_bytes), loop)
    app.router.lifespan_context = lifespan
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=drain_timeout_s, access_log=False)
    server = _Server(config)
    server.engine_loop = loop
    holder["server"] = server
    if sys.platform != "win32":
        signal.signal(signal.SIGTERM, lambda *_: None)  # see the module header (exit 0 after the drain)
    # The engine thread and the event loop share the GIL. A thread that wants it back (the engine after
    # a GPU sync) waits until the holder drops it, at the latest after the switch interval: 5 ms by
    # default, longer than a whole decode step of the 0.5B. 0.5 ms bounds that stall per step.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    server.run()
    return loop.load_error


async def _watch_load(loop: EngineLoop, holder: dict, host: str, port: int) -> None:
    await asyncio.to_thread(loop.ready.wait)
    if loop.load_error is not None:
        print(f"error: the model failed to load: {loop.load_error}", file=sys.stderr, flush=True)
        holder["server"].should_exit = True
        return
    eng = loop.engine
    bound = port
    server = holder["server"]
    for s in getattr(server, "servers", []):
        for sock in s.sockets:
            bound = sock.getsockname()[1]
    print(f"nanoqwen serve: {describe_engine(eng)}; context "
          f"{eng.max_model_len} tokens; ready on http://{host}:{bound}/v1", file=sys.stderr, flush=True)


def describe_engine(eng) -> str:
    """What runs, in words: the reference engine's `name`, or the CUDA engine's op backend and mode."""
    if hasattr(eng, "name"):
        return eng.name
    c = eng.config
    return (f"CUDA engine ({c.backend} ops, {c.mode} mode) on {eng.device}, {eng.num_blocks} KV blocks of "
            f"{c.block_size} tokens")
