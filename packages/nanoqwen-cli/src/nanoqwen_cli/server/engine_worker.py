"""The engine process: builds the engine from its spec, then submits, aborts and steps it for the server.

It runs `worker_main(spec, conn)` in a child started with multiprocessing's "spawn" context, so the
engine's Python (scheduling, graph replay, token read-back, detokenization) never waits for the
HTTP process's GIL. `conn` is one end of a `multiprocessing.Pipe`; the messages, all tuples:

    HTTP process -> engine process
        ("submit", Request)               an engine `Request` (prompt ids, SamplingParams, request_id)
        ("abort", request_id)             end it at the next step, free its KV blocks
        ("stop",)                         abort every live request, send their events, exit
    engine process -> HTTP process
        ("ready", EngineInfo, EngineStats)          once, after loading (and CUDA graph capture)
        ("load_error", message)                     instead, one line; then the process exits
        ("step", n_submits, tokens, finishes, EngineStats)
                                                    one per step (or per batch of commands applied)

`tokens` is a list of `(request_id, text)`, one per generated token in the engine's order (text is
what became printable: '' for EOS, or while a UTF-8 character or a possible stop string is held
back); `finishes` a list of `Finish`, the last event of each request that ended (by the engine, an
abort, a refusal at submit, or a failed step). All of a request's tokens in a message come before its
`Finish`. `n_submits` counts the submits applied, so the server can count requests in flight in the
pipe. Plain tuples and a NamedTuple keep a step of 32 tokens at ~1.5 KB and a few microseconds of
pickling (the engine's dataclass events cost ten times more).

The loop: while the engine has work, take every pending command without blocking (`conn.poll(0)`),
then step; when idle, block in `recv`. The process ignores SIGINT and SIGTERM (the HTTP process owns
shutdown and drains first) and exits when told to stop or when its pipe closes (the HTTP process died).
"""

from __future__ import annotations

import pickle
import signal
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

from nanoqwen_runtime.events import TokenEvent

from .engine_spec import EngineInfo

__all__ = ["Finish", "worker_main"]


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


def worker_main(spec: Any, conn: Connection) -> None:
    """Entry point of the engine process. `spec` has `build() -> engine` (an `EngineSpec`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # the parent starts us with both blocked (so that none lands before the lines above): unblock
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        engine = spec.build()
        info = EngineInfo.of(engine)
        stats = engine.stats()
    except BaseException as e:  # noqa: BLE001 - reported to the server, which exits 1 with it
        _send(conn, ("load_error", _one_line(e)))
        return
    if _send(conn, ("ready", info, stats)):
        _Worker(engine, conn).run()


def _send(conn: Connection, msg: tuple) -> bool:
    """Send `msg` (plain pickle: `Connection.send`'s ForkingPickler costs ~10 us more per message and
    nothing here needs its reducers); False when the HTTP process is gone."""
    try:
        conn.send_bytes(pickle.dumps(msg, pickle.HIGHEST_PROTOCOL))
        return True
    except OSError:
        return False


def _recv(conn: Connection) -> tuple:
    return pickle.loads(conn.recv_bytes())


def _one_line(e: BaseException) -> str:
    from ..errors import describe

    failure = describe(e)
    text = failure.message if failure is not None else f"{type(e).__name__}: {e}"
    return " ".join(text.split()) or type(e).__name__


def _finish(ev: Any) -> Finish:
    """An engine FinishEvent as a `Finish`."""
    return Finish(ev.request_id, str(ev.reason), ev.detail, ev.text, ev.num_prompt_tokens, ev.num_generated)


class _Worker:
    def __init__(self, engine: Any, conn: Connection):
        self.engine = engine
        self.conn = conn
        self.live: dict[str, list[int]] = {}  # request_id -> [prompt tokens, generated tokens]

    def run(self) -> None:
        eng, conn = self.engine, self.conn
        while True:
            try:
                cmds = [] if eng.has_work else [_recv(conn)]  # idle: wait for a command
                while conn.poll(0):
                    cmds.append(_recv(conn))
            except (EOFError, OSError):
                return  # the HTTP process is gone
            tokens: list[tuple[str, str]] = []
            finishes: list[Finish] = []
            n_submits, stop = self._apply(cmds, finishes)
            if stop:
                self._abort_all(finishes)
                _send(conn, ("step", n_submits, tokens, finishes, eng.stats()))
                return
            stepped = eng.has_work
            if stepped:
                self._step(tokens, finishes)
            if (cmds or stepped) and not _send(conn, ("step", n_submits, tokens, finishes, eng.stats())):
                return

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
            events = self.engine.step()
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
                tokens.append((rid, ev.text))
                counts = live.get(rid)
                if counts is not None:
                    counts[1] += 1
            else:
                live.pop(ev.request_id, None)
                finishes.append(_finish(ev))
