"""Run the app under uvicorn with the engine process's lifecycle and a graceful SIGTERM.

Lifecycle:
    startup    the engine process is spawned and starts loading (`EngineProcess.start`); the port is
               open at once and /health answers 503 "loading" until the engine is ready. A failed load
               stops the server and `run_server` returns the error (the CLI prints it, exit 1).
    SIGTERM    (or SIGINT) drains, the server still listening: the engine process takes no new request
               (new requests get 503 in the OpenAI error shape, GET /health 503 {"status": "draining"})
               while the running ones go on, until they have all ended or `drain_timeout_s` has
               passed; those still running then are aborted (their clients get the end of an aborted
               request). One line on stderr says that draining started, one how it ended ("all N
               finished" or "timed out: N aborted"). Only then is uvicorn told to exit: it closes its
               sockets and the open connections, the engine process is stopped and joined. uvicorn
               re-raises the signal it caught once done: for SIGTERM a no-op handler installed before
               makes that harmless (exit 0); SIGINT ends as a KeyboardInterrupt (exit 130). A second
               signal during the drain aborts what runs and exits at once. Before the model is loaded
               there is nothing to drain: the signal stops the server directly.
    engine died  (crash, OOM kill, fatal CUDA error) its requests end with an error, /health answers
               503 with the reason, the server shuts down and `run_server` returns the error (exit 1).
Whatever happens, the engine process is joined (or killed) before `run_server` returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from typing import Any

import uvicorn

from ..errors import CliError
from . import cpu_placement
from .app import AppConfig, create_app
from .engine_process import EngineProcess
from .engine_worker import freeze_startup_objects
from .metrics import Metrics

__all__ = ["run_server"]

# The event loop and the reader thread share this process's GIL. The reader, back from `recv` with a
# step's events, waits until the event loop drops the GIL, at the latest after the switch interval
# (5 ms by default, longer than a decode step of the 0.5B); 0.5 ms bounds that wait.
SWITCH_INTERVAL_S = 0.0005


# After the drain, what aborted requests still need to deliver their last event, at most.
ABORT_GRACE_S = 10.0
# How often the drain looks at the live requests (each ends on the engine process's step message).
DRAIN_POLL_S = 0.02


class _Server(uvicorn.Server):
    """uvicorn's server whose SIGTERM/SIGINT drains the engine process first (the module header)."""

    engine: EngineProcess | None = None
    drain_timeout_s: float = 30.0
    loop: asyncio.AbstractEventLoop | None = None
    _draining = False
    _drain: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame) -> None:
        """The signal handler (Python's, on the main thread, which runs the event loop)."""
        engine, loop = self.engine, self.loop
        if self._draining:  # a second signal: stop waiting, abort what runs, exit
            engine.abort_all()
            super().handle_exit(sig, frame)
            return
        if engine is None or loop is None or not engine.can_serve() or self.should_exit:
            if engine is not None:
                engine.begin_drain()
            super().handle_exit(sig, frame)  # nothing to drain: uvicorn's own exit
            return
        self._captured_signals.append(sig)  # re-raised by uvicorn once it has exited (module header)
        self._draining = True
        engine.begin_drain()
        # the handler may have interrupted the loop itself: the task is created from its next turn
        loop.call_soon_threadsafe(self._start_drain, signal.Signals(sig).name)

    def _start_drain(self, name: str) -> None:
        self._drain = asyncio.ensure_future(self._drain_then_exit(name))

    async def _drain_then_exit(self, name: str) -> None:
        engine, t0 = self.engine, time.monotonic()
        running = engine.live()
        what = "1 running request gets" if running == 1 else f"{running} running requests get"
        _log(f"{name}: draining: {what} up to {self.drain_timeout_s:g} s to finish; new requests get 503")
        deadline = t0 + self.drain_timeout_s
        while engine.live() and engine.can_serve() and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        left = engine.live()
        took = time.monotonic() - t0
        if not left:
            _log(f"drained: all {running} request{'s' * (running != 1)} finished in {took:.1f} s; stopping")
        elif not engine.can_serve():
            _log(f"drain ended after {took:.1f} s: the engine stopped ({engine.failure or 'exited'}) with "
                 f"{left} request{'s' * (left != 1)} running; stopping")
        else:
            engine.abort_all()
            _log(f"drain timed out after {self.drain_timeout_s:g} s: {left} request{'s' * (left != 1)} "
                 "aborted; stopping")
            end = time.monotonic() + ABORT_GRACE_S
            while engine.live() and engine.can_serve() and time.monotonic() < end:
                await asyncio.sleep(DRAIN_POLL_S)
        self.should_exit = True


def _log(line: str) -> None:
    print(f"nanoqwen serve: {line}", file=sys.stderr, flush=True)


def run_server(spec: Any, pipeline: Any, model_name: str, *, host: str, port: int, api_key: str | None,
               max_body_bytes: int, max_waiting: int, drain_timeout_s: float,
               log_level: str = "info", placement: cpu_placement.CpuPlacement | None = None
               ) -> CliError | None:
    """Serve until SIGTERM/SIGINT. `spec`: picklable, `build()` makes the engine in the engine process
    (an `EngineSpec`). `placement`: the CPUs of the two processes (cpu_placement.py; None: the
    scheduler's choice). Returns the error that stopped the server (the engine failed to load or died,
    or the CPUs of `placement` were refused)."""
    if placement is not None:
        try:  # this process first: the engine process, spawned later, inherits it and then moves itself
            cpu_placement.apply(placement.http)
        except OSError as e:
            return CliError(f"cannot bind the server to CPUs {cpu_placement.format_cpus(placement.http)} "
                            f"({e.strerror or e}); start it with --cpu-placement off")
    metrics = Metrics()
    engine = EngineProcess(spec, metrics, max_waiting=max_waiting,
                           engine_cpus=placement.engine if placement is not None else None)
    holder: dict[str, _Server] = {}

    def on_failure(reason: str) -> None:
        holder["server"].should_exit = True

    engine.on_failure = on_failure

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.loop = asyncio.get_running_loop()
        engine.start(server.loop)
        watcher = asyncio.create_task(_watch_load(engine, holder, host, port, placement))
        try:
            yield
        finally:
            watcher.cancel()
            await engine.drain(0.0)  # the drain (_Server) is over: stop the engine process

    app = create_app(AppConfig(model_name=model_name, pipeline=pipeline, api_key=api_key,
                               max_body_bytes=max_body_bytes), engine)
    app.router.lifespan_context = lifespan
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=ABORT_GRACE_S, access_log=False)
    server = _Server(config)
    server.engine = engine
    server.drain_timeout_s = drain_timeout_s
    holder["server"] = server
    if sys.platform != "win32":
        signal.signal(signal.SIGTERM, lambda *_: None)  # see the module header (exit 0 after the drain)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        server.run()
    finally:
        engine.stop()  # no-ops after the lifespan's drain; here for a server that failed to start
        engine.join(30.0)
    if engine.load_error is not None:
        return CliError(f"the model failed to load: {engine.load_error}")
    if engine.failure is not None:
        return CliError(f"{engine.failure}; the server stopped")
    return None


async def _watch_load(engine: EngineProcess, holder: dict, host: str, port: int,
                      placement: cpu_placement.CpuPlacement | None) -> None:
    await asyncio.to_thread(engine.ready.wait)
    server = holder["server"]
    if engine.load_error is not None:
        server.should_exit = True
        return
    if engine.info is None:  # stopped while loading
        return
    freeze_startup_objects()  # the pipeline and the app, loaded by now (engine_worker.py)
    while not server.started:  # the lifespan starts before uvicorn binds its sockets (port 0: which one)
        if server.should_exit:
            return
        await asyncio.sleep(0.01)
    bound = port
    for s in getattr(server, "servers", []):
        for sock in s.sockets:
            bound = sock.getsockname()[1]
    where = placement.describe() if placement is not None else "CPUs as the scheduler places them"
    _log(f"{engine.info.description}; context {engine.info.max_model_len} tokens; "
         f"engine process {engine.engine_pid}; {where}; {_http_stack()}; ready on http://{host}:{bound}/v1")


def _http_stack() -> str:
    """The event loop and HTTP parser uvicorn runs on ("auto" takes uvloop and httptools when installed:
    the package depends on both where they build)."""
    try:
        import uvloop  # noqa: F401
        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    try:
        import httptools  # noqa: F401
        http = "httptools"
    except ImportError:
        http = "h11"
    return f"{loop} + {http}"
