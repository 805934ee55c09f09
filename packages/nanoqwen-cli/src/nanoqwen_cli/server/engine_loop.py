"""The one owner of the engine: a thread that submits, aborts and steps, and hands events to asyncio.

    HTTP handler (event loop)                  engine thread (owns the engine; nothing else touches it)
    loop.submit(request) -> RequestHandle ---> inbox: ("submit", handle) / ("abort", request_id)
                                               drain inbox -> engine.submit / engine.abort
                                               events = engine.step()     (continuous batching)
    await handle.queue.get() <---------------- call_soon_threadsafe(deliver, {handle: [events]})

Each request gets an `asyncio.Queue` of engine events (`events.TokenEvent` ..., then one
`FinishEvent`); one `call_soon_threadsafe` per step carries the events of every request, so the event
loop wakes once per step, not once per token. `RequestHandle.abort()` (a client that disconnected)
queues an abort that the thread applies before its next step, which frees the request's KV blocks.

Admission control: `submit` raises `QueueFull` when the requests waiting for a batch slot (not yet
handed to the engine, plus the engine's own waiting queue as of the last step) reach `max_waiting`;
the app answers 429 with Retry-After. `drain(grace_s)` stops taking requests (`Draining`), lets
running ones finish for up to `grace_s`, aborts what is left and stops the thread.

The engine is built inside the thread by `factory()` (CUDA graphs are captured and replayed on that
thread); `ready` is set once it is loaded and captured, `load_error` holds the failure otherwise.
Both engines fit: the CUDA `Engine` and `nanoqwen_runtime.reference_engine.ReferenceEngine` share
submit/step/abort/has_work/stats (stats.py).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nanoqwen_runtime.events import TokenEvent

from .metrics import Metrics

__all__ = ["EngineLoop", "RequestHandle", "QueueFull", "Draining", "NotReady"]


class QueueFull(Exception):
    """The waiting queue is full: answer 429 with Retry-After."""


class Draining(Exception):
    """The server is shutting down and takes no new requests: answer 503."""


class NotReady(Exception):
    """The engine is still loading (or failed to load): answer 503."""


@dataclass(eq=False)
class RequestHandle:
    """One request's side of the loop: its engine `Request`, its event queue and timings."""

    request: Any                       # nanoqwen_runtime.engine.Request
    queue: asyncio.Queue
    t_arrival: float                   # perf_counter when the HTTP request was accepted
    t_last: float = 0.0                # perf_counter of the last token (engine thread)
    t_client_checked: float = field(default_factory=time.monotonic)  # last look at the HTTP client (app)
    num_tokens: int = 0
    finished: bool = False
    _loop: EngineLoop | None = field(default=None, repr=False)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def abort(self) -> None:
        """End the request in the engine at its next step (idempotent; nothing if already finished)."""
        if not self.finished and self._loop is not None:
            self._loop._post(("abort", self))


class EngineLoop:
    """Runs `factory()`'s engine on a dedicated thread (see the module header)."""

    def __init__(self, factory: Callable[[], Any], metrics: Metrics, *, max_waiting: int):
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        self.factory = factory
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.engine: Any = None
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        self._cv = threading.Condition()
        self._inbox: list[tuple[str, RequestHandle]] = []
        self._pending_submits = 0       # submits in the inbox (under _cv)
        self._engine_waiting = 0        # engine's waiting queue after the last step
        self._handles: dict[str, RequestHandle] = {}   # live requests (engine thread only)
        self._draining = False
        self._stop = False
        self._abort_all = False
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="nanoqwen-engine", daemon=True)
        self._ids = 0

    # ---- event-loop side --------------------------------------------------------------------------
    def start(self, aloop: asyncio.AbstractEventLoop) -> None:
        self._aloop = aloop
        self._thread.start()

    @property
    def draining(self) -> bool:
        return self._draining

    def submit(self, request: Any) -> RequestHandle:
        """Queue `request` (an engine `Request` with its request_id set) for the engine thread."""
        if self.load_error is not None or not self.ready.is_set():
            raise NotReady("the model is still loading" if self.load_error is None
                           else f"the model failed to load: {self.load_error}")
        if self._draining:
            raise Draining("the server is shutting down")
        handle = RequestHandle(request, asyncio.Queue(), time.perf_counter(), _loop=self)
        with self._cv:
            if self._pending_submits + self._engine_waiting >= self.max_waiting:
                raise QueueFull(f"{self._pending_submits + self._engine_waiting} requests are waiting "
                                f"(the limit is {self.max_waiting}); retry later")
            self._pending_submits += 1
            self._inbox.append(("submit", handle))
            self._cv.notify()
        return handle

    def _post(self, item: tuple[str, RequestHandle]) -> None:
        with self._cv:
            self._inbox.append(item)
            self._cv.notify()

    def waiting(self) -> int:
        with self._cv:
            return self._pending_submits + self._engine_waiting

    async def drain(self, grace_s: float) -> None:
        """Stop accepting, let running requests finish for up to `grace_s`, abort the rest, stop."""
        self._draining = True
        deadline = time.monotonic() + grace_s
        while self._thread.is_alive() and self.busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.stop()
        await asyncio.to_thread(self._thread.join, 30.0)

    def busy(self) -> bool:
        with self._cv:
            return bool(self._inbox) or bool(self._handles)

    def stop(self) -> None:
        """Abort every live request and end the thread (after its current step)."""
        with self._cv:
            self._abort_all = True
            self._stop = True
            self._cv.notify()

    # ---- engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine = self.factory()
            self.metrics.publish(self.engine.stats())
        except BaseException as e:  # noqa: BLE001 - reported by /health and the CLI (exit 1)
            self.load_error = e
            self.ready.set()
            return
        self.ready.set()
        eng = self.engine
        while True:
            with self._cv:
                while not self._inbox and not eng.has_work and not self._stop:
                    self._cv.wait()
                inbox, self._inbox = self._inbox, []
                stop, abort_all = self._stop, self._abort_all
            out: dict[RequestHandle, list] = {}
            for kind, h in inbox:
                if kind == "submit":
                    with self._cv:
                        self._pending_submits -= 1
                    if abort_all:
                        out.setdefault(h, []).append(_aborted(h))
                        continue
                    refusal = eng.submit(h.request)
                    if refusal is not None:
                        out.setdefault(h, []).append(refusal)
                    else:
                        self._handles[h.request_id] = h
                elif kind == "abort" and h.request_id in self._handles:
                    ev = eng.abort(h.request_id)
                    if ev is not None:
                        out.setdefault(h, []).append(ev)
            if abort_all:
                for rid, h in list(self._handles.items()):
                    ev = eng.abort(rid)
                    out.setdefault(h, []).append(ev if ev is not None else _aborted(h))
            if not (stop and abort_all) and eng.has_work:
                try:
                    events = eng.step()
                except BaseException as e:  # noqa: BLE001 - an engine bug: end every request, keep serving
                    events = []
                    for rid, h in list(self._handles.items()):
                        ev = eng.abort(rid)
                        out.setdefault(h, []).append(_failed(h, f"engine step failed: {e!r}"))
                self._collect(events, out)
            for h, evs in out.items():
                if evs and not isinstance(evs[-1], TokenEvent):
                    self._handles.pop(h.request_id, None)
            stats = eng.stats()
            with self._cv:
                self._engine_waiting = stats.waiting
            self.metrics.publish(stats)
            if out:
                self._deliver(out)
            if stop and abort_all and not self._handles:
                return

    def _collect(self, events: list, out: dict[RequestHandle, list]) -> None:
        now = time.perf_counter()
        for ev in events:
            rid = ev.request if isinstance(ev, TokenEvent) else ev.request_id
            h = self._handles.get(rid)
            if h is None:
                continue
            if isinstance(ev, TokenEvent):
                if h.num_tokens == 0:
                    self.metrics.ttft.observe(now - h.t_arrival)
                else:
                    self.metrics.itl.observe(now - h.t_last)
                h.t_last = now
                h.num_tokens += 1
            out.setdefault(h, []).append(ev)

    def _deliver(self, out: dict[RequestHandle, list]) -> None:
        def put() -> None:
            for h, evs in out.items():
                for ev in evs:
                    h.queue.put_nowait(ev)
                if not isinstance(evs[-1], TokenEvent):
                    h.finished = True
        if self._aloop is not None and not self._aloop.is_closed():
            self._aloop.call_soon_threadsafe(put)


def _aborted(h: RequestHandle):
    from nanoqwen_runtime.engine.engine import FinishEvent
    from nanoqwen_runtime.engine.scheduler import FinishReason

    return FinishEvent(h.request_id, FinishReason.ABORTED, detail="the server is shutting down",
                       num_prompt_tokens=len(h.request.prompt_tokens))


def _failed(h: RequestHandle, detail: str):
    from nanoqwen_runtime.engine.engine import FinishEvent
    from nanoqwen_runtime.engine.scheduler import FinishReason

    return FinishEvent(h.request_id, FinishReason.ERROR, detail=detail,
                       num_prompt_tokens=len(h.request.prompt_tokens), num_generated=h.num_tokens)
