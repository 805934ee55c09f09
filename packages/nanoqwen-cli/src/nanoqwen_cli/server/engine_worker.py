"""The engine process: builds the engine from its spec, then submits, aborts and steps it for the server.

It runs `worker_main(spec, conn)` in a child started with multiprocessing's "spawn" context, so the
engine's Python (scheduling, graph replay, token read-back, detokenization) never waits for the
HTTP process's GIL. `conn` is one end of a `multiprocessing.Pipe`; the messages, all tuples:

    HTTP process -> engine process
        ("submit", Request)               an engine `Request` (prompt ids, SamplingParams, request_id)
        ("abort", request_id)             end it at the next step, free its KV blocks
        ("stop",)                         abort every live request, send their events, exit
        ("batch", [command, ...])         the commands the writer thread found queued at once, in order
    engine process -> HTTP process
        ("ready", EngineInfo, EngineStats)          once, after loading (and CUDA graph capture)
        ("load_error", message)                     instead, one line; then the process exits
        ("step", n_submits, tokens, finishes, EngineStats)
                                                    one per step (or per batch of commands applied)

`tokens` is a list of `(request_id, text)`, one per generated token in the engine's order (text is
what became printable: '' for EOS, or while a UTF-8 character or a possible stop string is held back);
for a request that asked for logprobs, `(request_id, TokenOut)` instead (text, token id, logprobs, and
on its first token the prompt's logprobs); `finishes` a list of `Finish`, the last event of each
request that ended (by the engine, an abort, a refusal at submit, or a failed step). All of a
request's tokens in a message come before its `Finish`. `n_submits` counts the submits applied, so the
server can count requests in flight in the pipe. Plain tuples and a NamedTuple keep a step of 32
tokens at ~1.5 KB and a few microseconds of pickling (the engine's dataclass events cost ten times
more).

The loop: while the engine has work, take every pending command without blocking, then step; when
idle, block in `recv`. A submit that wakes an idle engine opens a short admission window: commands are
taken as long as the next arrives within ADMIT_QUIET_S, for at most ADMIT_MAX_S, so that a burst of
requests (32 clients at once reach the engine over ~10 ms, one HTTP request after another) starts in
one prefill instead of a small prefill followed by a large one; a lone request waits ADMIT_QUIET_S.
A step's message is sent during the next step: `engine.step(side_work=...)` calls back right after
a captured decode graph is launched, and the loop's own thread pickles and sends the message there,
while the host would otherwise wait for the read-back (~3 ms per decode step of the 0.5B at batch 32;
pickling and sending a 32-token message takes tens of microseconds); before an eager step (a prefill
chunk), whose host-bound launches would delay the message, it is sent first. When no step follows (the
engine goes idle, or the step had nothing to run) the message is sent at once. One thread does
everything, so nothing competes with the step for the GIL: with a sender thread, each hand-over of
the GIL between the two threads (one CPU waking the other) would land on the step's critical path
(measured slower: packages/nanoqwen-cli/DESIGN.md).
Tokens reach the HTTP process one step's host preparation later (about 0.1-0.3 ms), the last ones of
a burst at once. The process ignores SIGINT and SIGTERM (the HTTP process owns shutdown and drains
first) and exits when told to stop or when its pipe closes (the HTTP process died).

With `NANOQWEN_ENGINE_TRACE=PATH` in its environment the process records one row per loop iteration
(`StepTrace`: when it woke, the commands and submits it applied, when the step started and ended, the
step's kind and tokens, when the iteration ended; `time.perf_counter`, which
is CLOCK_MONOTONIC and so comparable with other processes' on the host) and writes them to PATH as
JSON lines when it exits. The load test reads them to split the server's overhead between the
engine's steps and what lies around them (packages/nanoqwen-bench/server/loadtest.py).
"""

from __future__ import annotations

import gc
import json
import os
import pickle
import select
import signal
import time
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

from nanoqwen_runtime.events import TokenEvent

from . import cpu_placement
from .engine_spec import EngineInfo

__all__ = ["Finish", "StepTrace", "TokenOut", "TRACE_ENV", "worker_main"]

TRACE_ENV = "NANOQWEN_ENGINE_TRACE"
# An idle engine woken by a submit takes commands while they come ADMIT_QUIET_S apart or closer, for at
# most ADMIT_MAX_S, then steps. The HTTP process hands a burst's requests over ~0.45 ms apart
# (measured on a 16-CPU GPU host: 32 in 14-17 ms); a burst split in two costs a second
# prefill (12-30 ms, host-bound at the 0.5B) and a decode step. So: a lone request pays 2 ms of TTFT,
# the first of a 32-request burst up to ~17 ms, and the other 31 no longer wait behind its prefill.
ADMIT_QUIET_S = 0.002
ADMIT_MAX_S = 0.020


class Finish(NamedTuple):
    """The last event of a request. reason: the engine's FinishReason value ("eos", "stop", "length",
    "context", "refused", "aborted", "error"); detail: why (refusal, error), one line; text: held-back
    text flushed at the end."""

    request_id: str
    reason: str
    detail: str = ""
    text: str = ""
    num_prompt_tokens: int = 0
    num_generated: int = 0


class TokenOut(NamedTuple):
    """A generated token of a request that asked for logprobs (the others get its text alone, a str).
    logprobs: a `nanoqwen_runtime.logprobs.TokenLogprobs`; prompt_logprobs: on the first token of a
    request that asked for them, one entry per prompt token (None first)."""

    text: str
    token_id: int
    logprobs: Any
    prompt_logprobs: tuple | None = None


class StepTrace:
    """One row per loop iteration of the engine process, written as JSON lines to `path` by `close`.

    Row keys: t_wake (the commands were received), n_cmds, n_submits, t_step (the step started; None
    when the iteration did not step), t_done (it ended), kind ("prefill"/"decode", from the engine's
    `num_steps` counters; None when the engine has none), n_tokens, t_sent (the iteration ended: its
    message sent, or kept for the next step's device time)."""

    def __init__(self, path: str):
        self.path = path
        self.rows: list[dict] = []

    @classmethod
    def from_env(cls) -> StepTrace | None:
        path = os.environ.get(TRACE_ENV)
        return cls(path) if path else None

    def close(self) -> None:
        tmp = f"{self.path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            for row in self.rows:
                f.write(json.dumps(row) + "\n")
        os.replace(tmp, self.path)


def worker_main(spec: Any, conn: Connection, cpus: tuple[int, ...] | None = None) -> None:
    """Entry point of the engine process. `spec` has `build() -> engine` (an `EngineSpec`); `cpus`: bind
    the process to these CPUs first, so that every thread the engine starts runs there too."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # the parent starts us with both blocked (so that none lands before the lines above): unblock
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        if cpus:
            try:
                cpu_placement.apply(cpus)
            except OSError as e:
                raise OSError(f"cannot bind the engine process to CPUs {cpu_placement.format_cpus(cpus)} "
                              f"({e.strerror or e}); start the server with --cpu-placement off") from None
        engine = spec.build()
        info = EngineInfo.of(engine)
        stats = engine.stats()
    except BaseException as e:  # noqa: BLE001 - reported to the server, which exits 1 with it
        _send(conn, ("load_error", _one_line(e)))
        return
    freeze_startup_objects()
    if _send(conn, ("ready", info, stats)):
        trace = StepTrace.from_env()
        try:
            _Worker(engine, conn, trace).run()
        finally:
            if trace is not None:
                trace.close()


def freeze_startup_objects() -> None:
    """Move every object alive now (a loaded engine or pipeline: the tokenizer's vocabulary and merges
    alone are ~173,000 tracked objects for the 0.5B) out of the garbage collector's generations, for
    the life of the process (`gc.freeze`, as vLLM does after its graph capture). A full collection then
    walks only what serving allocates: 2 us instead of 38-47 ms, which otherwise lands in a step (engine
    process) or an event-loop turn (HTTP process) every time the objects promoted since the last one
    pass a quarter of the old ones."""
    gc.collect()
    gc.freeze()


def _send(conn: Connection, msg: tuple) -> bool:
    """Send `msg` (plain pickle: `Connection.send`'s ForkingPickler costs ~10 us more per message and
    nothing here needs its reducers); False when the HTTP process is gone."""
    try:
        conn.send_bytes(pickle.dumps(msg, pickle.HIGHEST_PROTOCOL))
        return True
    except OSError:
        return False


def _recv(conn: Connection) -> list[tuple]:
    """The commands of one message: a command, or ("batch", [command, ...]) from the writer thread."""
    msg = pickle.loads(conn.recv_bytes())
    return msg[1] if msg[0] == "batch" else [msg]


def _one_line(e: BaseException) -> str:
    from ..errors import describe

    failure = describe(e)
    text = failure.message if failure is not None else f"{type(e).__name__}: {e}"
    return " ".join(text.split()) or type(e).__name__


def _finish(ev: Any) -> Finish:
    """An engine FinishEvent as a `Finish`."""
    return Finish(ev.request_id, str(ev.reason), ev.detail, ev.text, ev.num_prompt_tokens, ev.num_generated)


class _Worker:
    def __init__(self, engine: Any, conn: Connection, trace: StepTrace | None = None):
        self.engine = engine
        self.conn = conn
        self.trace = trace
        self.live: dict[str, list[int]] = {}  # request_id -> [prompt tokens, generated tokens]
        self.pending: tuple | None = None     # the last step's message, not sent yet
        self.broken = False                   # a send failed: the HTTP process is gone

    def run(self) -> None:
        try:
            self._loop()
        finally:
            self.flush()

    def flush(self) -> None:
        """Send the pending message, if any (in order: there is at most one)."""
        msg, self.pending = self.pending, None
        if msg is not None and not self.broken and not _send(self.conn, msg):
            self.broken = True

    def _loop(self) -> None:
        eng, conn, trace = self.engine, self.conn, self.trace
        readable = select.poll()  # a registered poll object: ~10x cheaper per check than conn.poll(0)
        readable.register(conn.fileno(), select.POLLIN)
        while True:
            if self.broken:
                return  # the HTTP process is gone
            try:
                if eng.has_work:
                    cmds = []
                else:  # idle: send the last step's message (no step follows to carry it), wait for a command
                    self.flush()
                    cmds = _recv(conn)
                    if any(c[0] == "submit" for c in cmds):
                        self._admit_burst(cmds)
                while readable.poll(0):
                    cmds += _recv(conn)
            except (EOFError, OSError):
                return  # the HTTP process is gone
            t_wake = time.perf_counter() if trace is not None else 0.0
            tokens: list[tuple[str, str]] = []
            finishes: list[Finish] = []
            n_submits, stop = self._apply(cmds, finishes)
            if stop:
                self._abort_all(finishes)
                self.flush()
                self.pending = ("step", n_submits, tokens, finishes, eng.stats())
                return
            stepped = eng.has_work
            t_step = kind = None
            if stepped:
                if trace is not None:
                    t_step, before = time.perf_counter(), dict(getattr(eng, "num_steps", {}))
                    if hasattr(eng, "last_step_kind"):
                        eng.last_step_kind = None
                self._step(tokens, finishes)  # sends the pending message during the step
                if trace is not None:
                    # the step whose tokens this call returned (with the CUDA engine's overlap, the step
                    # it queued is the next one); else the kind whose count moved
                    kind = getattr(eng, "last_step_kind", None) or next(
                        (k for k, v in getattr(eng, "num_steps", {}).items() if v != before.get(k)), None)
            t_done = time.perf_counter() if trace is not None else 0.0
            self.flush()  # still pending when the step launched nothing (or failed)
            if cmds or stepped:
                self.pending = ("step", n_submits, tokens, finishes, eng.stats())
            if trace is not None:
                trace.rows.append({"t_wake": t_wake, "n_cmds": len(cmds), "n_submits": n_submits,
                                   "t_step": t_step, "t_done": t_done, "kind": kind,
                                   "n_tokens": len(tokens), "t_sent": time.perf_counter()})

    def _admit_burst(self, cmds: list[tuple]) -> None:
        """Take the commands that follow within ADMIT_QUIET_S of each other, for ADMIT_MAX_S at most."""
        fd = self.conn.fileno()
        deadline = time.perf_counter() + ADMIT_MAX_S
        while (left := deadline - time.perf_counter()) > 0:
            if not select.select([fd], [], [], min(ADMIT_QUIET_S, left))[0]:
                return
            cmds += _recv(self.conn)

    def _apply(self, cmds: list[tuple], finishes: list[Finish]) -> tuple[int, bool]:
        n_submits, stop = 0, False
        for cmd in cmds:
            kind = cmd[0]
            if kind == "submit":
                n_submits += 1
                req = cmd[1]
                refusal = self.engine.submit(req)
                if refusal is not None:
                    finishes.append(_finish(refusal))
                else:
                    self.live[req.request_id] = [len(req.prompt_tokens), 0]
            elif kind == "abort":
                rid = cmd[1]
                if rid in self.live:
                    finishes.append(self._abort(rid, "aborted by the client"))
            elif kind == "stop":
                stop = True
            else:
                raise ValueError(f"unknown engine command {kind!r}")
        return n_submits, stop

    def _abort(self, rid: str, detail: str) -> Finish:
        n_prompt, n_gen = self.live.pop(rid)
        ev = self.engine.abort(rid)
        return _finish(ev) if ev is not None else Finish(rid, "aborted", detail, "", n_prompt, n_gen)

    def _abort_all(self, finishes: list[Finish]) -> None:
        for rid in list(self.live):
            finishes.append(self._abort(rid, "the server is shutting down"))

    def _step(self, tokens: list[tuple[str, str]], finishes: list[Finish]) -> None:
        live = self.live
        try:
            events = self.engine.step(side_work=self.flush)
        except Exception as e:  # noqa: BLE001 - an engine bug: end every request, keep serving
            detail = " ".join(f"engine step failed: {e!r}".split())
            for rid, (n_prompt, n_gen) in list(live.items()):
                try:
                    self.engine.abort(rid)
                except Exception:  # noqa: BLE001, S110 - the request ends with the error either way
                    pass
                finishes.append(Finish(rid, "error", detail, "", n_prompt, n_gen))
            live.clear()
            return
        for ev in events:
            if type(ev) is TokenEvent:
                rid = ev.request
                if ev.logprobs is None:
                    tokens.append((rid, ev.text))
                else:
                    tokens.append((rid, TokenOut(ev.text, ev.token_id, ev.logprobs, ev.prompt_logprobs)))
                counts = live.get(rid)
                if counts is not None:
                    counts[1] += 1
            else:
                live.pop(ev.request_id, None)
                finishes.append(_finish(ev))
