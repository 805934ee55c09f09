"""The one owner of the engine: a child process that submits, aborts and steps it (engine_worker.py),
and the HTTP process's side of it, which hands the engine's events to asyncio.

    HTTP process                                          engine process (spawn; owns the engine)
    event loop: loop.submit(request) -> RequestHandle
                handle.abort()
        |  outbox (SimpleQueue)
    writer thread ----- ("submit", Request) / ("abort", id) / ("stop",) ----> commands, then step()
    reader thread <---- ("step", n_submits, [(id, text)], [Finish], stats) -- one message per step
        | TTFT/ITL observed on receipt, stats published to Metrics
        | call_soon_threadsafe(put)      one per message
    event loop: await handle.queue.get()  -> str (one token's text; a TokenOut with logprobs when the
                                             request asked for them) ... then one Finish

Why a process: the engine's step is host-bound at small models (Python scheduling, graph replay, token
read-back) and the HTTP work (JSON, SSE framing for every stream) would take the same GIL, adding to
every step. Here the reader thread blocks in `recv` (GIL released), and unpickling a step costs a few
microseconds; the writer thread keeps a full pipe from ever blocking the event loop.

Each request gets an `asyncio.Queue`: a `str` per generated token (its new text), then one `Finish`
(engine_worker.py). `RequestHandle.abort()` (a client that went away) sends an abort the engine
applies before its next step, which frees the request's KV blocks.

Admission control: `submit` raises `QueueFull` when the requests waiting for a batch slot (sent but not
yet applied by the engine, plus the engine's own waiting queue as of its last step) reach
`max_waiting`; the app answers 429 with Retry-After. `drain(grace_s)` stops taking requests
(`Draining`), lets running ones finish for up to `grace_s`, then stops the engine process (which aborts
what is left and exits) and joins it.

Lifecycle: `ready` is set once the engine is loaded and its graphs captured (`info` then holds its
`EngineInfo`), or when loading failed (`load_error`, one line). When the engine process dies after
that (crash, OOM kill, a fatal CUDA error), every live request ends with an error `Finish`, `failure`
says why, new requests get `NotReady`, and `on_failure(reason)` is called on the event loop (the runner
stops the server, exit 1). The child process is always joined (or killed) by `join`; it also exits by
itself when this process dies (its pipe closes).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import pickle
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .engine_spec import EngineInfo
from .engine_worker import Finish, worker_main
from .metrics import Metrics

__all__ = ["EngineProcess", "RequestHandle", "Finish", "QueueFull", "Draining", "NotReady"]

_JOIN_AFTER_EOF_S = 10.0  # the child closed its pipe: it is exiting (or dead); wait this long for its code


class QueueFull(Exception):
    """The waiting queue is full: answer 429 with Retry-After."""


class Draining(Exception):
    """The server is shutting down and takes no new requests: answer 503."""


class NotReady(Exception):
    """The engine is still loading, failed to load, or died: answer 503."""


@dataclass(eq=False)
class RequestHandle:
    """One request's side of the loop: its engine `Request`, its event queue and timings."""

    request: Any                       # nanoqwen_runtime.engine.Request (sent to the engine process)
    queue: asyncio.Queue
    t_arrival: float                   # perf_counter when the HTTP request was accepted
    t_last: float = 0.0                # perf_counter when its last token arrived (reader thread)
    t_client_checked: float = field(default_factory=time.monotonic)  # last look at the HTTP client (app)
    num_tokens: int = 0
    finished: bool = False
    _loop: EngineProcess | None = field(default=None, repr=False)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def abort(self) -> None:
        """End the request in the engine at its next step (idempotent; nothing if already finished)."""
        if not self.finished and self._loop is not None:
            self._loop._outbox.put(("abort", self.request_id))


class EngineProcess:
    """Runs `spec.build()`'s engine in a child process (see the module header).

    spec: picklable, with `build() -> engine` (an `EngineSpec`; tests use `fake_engine.FakeEngineSpec`).
    engine_cpus: the CPUs the engine process binds itself to before it loads (cpu_placement.py); None:
      wherever the scheduler puts it.
    """

    def __init__(self, spec: Any, metrics: Metrics, *, max_waiting: int,
                 engine_cpus: tuple[int, ...] | None = None):
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        self.spec = spec
        self.engine_cpus = engine_cpus  # the engine process binds itself to these (cpu_placement.py)
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.info: EngineInfo | None = None
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.failure: str | None = None
        self.on_failure: Callable[[str], None] | None = None
        self._lock = threading.Lock()
        self._handles: dict[str, RequestHandle] = {}  # live requests, by request id
        self._pending_submits = 0       # sent, not yet applied by the engine (under _lock)
        self._engine_waiting = 0        # the engine's waiting queue after its last step
        self._draining = False
        self._stopping = False
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._conn = None
        self._reader: threading.Thread | None = None
        self._writer: threading.Thread | None = None

    # ---- event-loop side --------------------------------------------------------------------------
    def start(self, aloop: asyncio.AbstractEventLoop) -> None:
        """Spawn the engine process (it starts loading) and the reader and writer threads."""
        self._aloop = aloop
        ctx = multiprocessing.get_context("spawn")  # CUDA does not survive a fork
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=worker_main, args=(self.spec, child_conn, self.engine_cpus),
                                 name="nanoqwen-engine",
                                 daemon=True)
        # SIGINT/SIGTERM blocked while spawning: the child inherits the mask and ignores both before
        # unblocking them (a Ctrl-C to the process group must not kill the engine; we drain it)
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            self._proc.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        child_conn.close()  # so that the child's death is an EOF here
        self._reader = threading.Thread(target=self._read, name="nanoqwen-engine-reader", daemon=True)
        self._writer = threading.Thread(target=self._write, name="nanoqwen-engine-writer", daemon=True)
        self._reader.start()
        self._writer.start()

    @property
    def engine_pid(self) -> int | None:
        """The engine process's pid (None before `start`)."""
        return self._proc.pid if self._proc is not None else None

    @property
    def draining(self) -> bool:
        return self._draining

    def submit(self, request: Any) -> RequestHandle:
        """Send `request` (an engine `Request` with its request_id set) to the engine process."""
        if self.failure is not None:
            raise NotReady(f"the engine failed: {self.failure}")
        if self.load_error is not None or self.info is None:
            raise NotReady("the model is still loading" if self.load_error is None
                           else f"the model failed to load: {self.load_error}")
        if self._draining:
            raise Draining("the server is shutting down")
        handle = RequestHandle(request, asyncio.Queue(), time.perf_counter(), _loop=self)
        with self._lock:
            if self.failure is not None:
                raise NotReady(f"the engine failed: {self.failure}")
            if self._pending_submits + self._engine_waiting >= self.max_waiting:
                raise QueueFull(f"{self._pending_submits + self._engine_waiting} requests are waiting "
                                f"(the limit is {self.max_waiting}); retry later")
            self._pending_submits += 1
            self._handles[request.request_id] = handle
        self._outbox.put(("submit", request))
        return handle

    def begin_drain(self) -> None:
        """Take no new request from now on (`submit` raises `Draining`: 503); running ones go on."""
        self._draining = True

    def live(self) -> int:
        """Requests sent and not finished."""
        with self._lock:
            return len(self._handles)

    def abort_all(self) -> int:
        """Abort every live request (each ends with an "aborted" `Finish` after the engine's next step);
        returns how many."""
        with self._lock:
            handles = list(self._handles.values())
        for h in handles:
            h.abort()
        return len(handles)

    def can_serve(self) -> bool:
        """Loaded, not failed, the engine process's pipe open: requests can run to their end."""
        return self.info is not None and self.failure is None and self._reader_alive()

    def waiting(self) -> int:
        with self._lock:
            return self._pending_submits + self._engine_waiting

    def busy(self) -> bool:
        """Whether a request is live (sent and not finished)."""
        return bool(self._handles)

    async def drain(self, grace_s: float) -> None:
        """Stop accepting, let running requests finish for up to `grace_s`, abort the rest, stop."""
        self._draining = True
        deadline = time.monotonic() + grace_s
        while self.busy() and self._reader_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.stop()
        await asyncio.to_thread(self.join, 30.0)

    def stop(self) -> None:
        """Tell the engine process to abort every live request and exit (idempotent). One still loading
        is killed: it holds no request and a CUDA graph capture can take minutes."""
        with self._lock:
            if self._stopping or self._proc is None:
                return
            self._stopping = True
        if self.ready.is_set():
            self._outbox.put(("stop",))
        else:
            self._proc.kill()

    def join(self, timeout_s: float) -> None:
        """Wait for the engine process to exit after `stop` (SIGKILL past `timeout_s`), and the threads.
        Only the reader thread waits for the process's exit code (two threads reaping one child race)."""
        if self._proc is None:
            return
        self._reader.join(timeout_s)
        if self._reader.is_alive():
            self._proc.kill()  # its pipe closes: the reader sees the EOF and returns
            self._reader.join()
        if self._proc.is_alive():  # it closed the pipe but did not exit within _JOIN_AFTER_EOF_S
            self._proc.kill()
        self._proc.join()
        self._outbox.put(None)
        self._writer.join()

    def _reader_alive(self) -> bool:
        return self._reader is not None and self._reader.is_alive()

    # ---- reader and writer threads ----------------------------------------------------------------
    def _write(self) -> None:
        """Send the outbox's commands, everything queued at once as one message ("batch", [cmd, ...]):
        after each send this thread must take the GIL back from a busy event loop (up to a switch
        interval), so one message per command paced a burst of submits at ~0.5 ms each."""
        conn = self._conn
        while True:
            batch = [self._outbox.get()]
            while True:
                try:
                    batch.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
            last = batch.index(None) if None in batch else None
            cmds = batch[:last]
            try:
                if cmds:
                    msg = cmds[0] if len(cmds) == 1 else ("batch", cmds)
                    conn.send_bytes(pickle.dumps(msg, pickle.HIGHEST_PROTOCOL))
            except OSError:
                return  # the engine process is gone; the reader reports it
            if last is not None:
                return

    def _read(self) -> None:
        conn = self._conn
        recv = conn.recv_bytes
        try:
            msg = pickle.loads(recv())
            if msg[0] == "load_error":
                self.load_error = msg[1]
                self.ready.set()
            else:
                _, self.info, stats = msg
                self.metrics.publish(stats)
                self.ready.set()
                while True:
                    self._on_step(pickle.loads(recv()))
        except (EOFError, OSError):
            pass
        self._on_exit()

    def _on_step(self, msg: tuple) -> None:
        _, n_submits, tokens, finishes, stats = msg
        now = time.perf_counter()
        handles = self._handles
        ttft, itl = self.metrics.ttft, self.metrics.itl
        out: dict[RequestHandle, list] = {}
        for rid, text in tokens:
            h = handles.get(rid)
            if h is None:
                continue
            if h.num_tokens:
                itl.observe(now - h.t_last)
            else:
                ttft.observe(now - h.t_arrival)
            h.t_last = now
            h.num_tokens += 1
            evs = out.get(h)
            if evs is None:
                out[h] = [text]
            else:
                evs.append(text)
        with self._lock:
            for f in finishes:
                h = handles.pop(f.request_id, None)
                if h is not None:
                    out.setdefault(h, []).append(f)
            self._pending_submits -= n_submits
            self._engine_waiting = stats.waiting
        self.metrics.publish(stats)
        if out:
            self._deliver(out)

    def _on_exit(self) -> None:
        """The engine process closed its pipe: it exited after `stop` or a load error, or it died."""
        self._proc.join(_JOIN_AFTER_EOF_S)
        how = _exit_words(self._proc.exitcode)
        with self._lock:
            stopping = self._stopping
            if not self.ready.is_set() and not stopping:
                self.load_error = f"the engine process exited ({how}) while loading the model"
            died = self.ready.is_set() and self.load_error is None and not stopping
            if died:
                self.failure = f"the engine process died ({how})"
            orphans, self._handles = self._handles, {}
            self._pending_submits = 0
        self.ready.set()
        reason, detail = ("error", self.failure) if died else ("aborted", "the server is shutting down")
        out = {h: [Finish(h.request_id, reason, detail, "", len(h.request.prompt_tokens), h.num_tokens)]
               for h in orphans.values()}
        self._deliver(out, on_failure=self.failure if died else None)

    def _deliver(self, out: dict[RequestHandle, list], on_failure: str | None = None) -> None:
        def put() -> None:
            for h, evs in out.items():
                q = h.queue
                for ev in evs:
                    q.put_nowait(ev)
                if type(evs[-1]) is Finish:
                    h.finished = True
            if on_failure is not None and self.on_failure is not None:
                self.on_failure(on_failure)
        aloop = self._aloop
        if aloop is not None and not aloop.is_closed():
            try:
                aloop.call_soon_threadsafe(put)
            except RuntimeError:  # the event loop closed meanwhile: nobody is waiting for these events
                pass


def _exit_words(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
