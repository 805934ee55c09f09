"""TEST AND BENCHMARK ONLY: an engine without a model whose step costs a fixed host time.

`FakeEngineSpec(busy_s, sleep_s)` builds a `FakeEngine` with the engine surface the server drives
(submit / abort / step / has_work / stats / generate / num_steps, max_model_len, geom.vocab_size, name).
Its decode step spins in pure Python for `busy_s` (holding the GIL, as the CUDA engine's scheduling and
launch code does) and then sleeps `sleep_s` (GIL released, as a GPU sync does), and emits one token
per running request: token id = index % vocab_size, text " t" (two characters), `max_tokens` tokens
then finish reason "length". Up to `max_batch` requests run; the rest wait in arrival order.

Prefill: with `prefill_s` = 0 (the default) a waiting request joins the running ones at the start of a
decode step and gets its first token from it. With `prefill_s` > 0 a prefill is a step of its own, as
in the CUDA engine's scheduler: when requests wait and the last step was a decode (or none runs), the
step admits them (up to `max_batch` running), spins for `prefill_s` and emits each admitted request's
first token; the running ones get none. The cost is fixed, whatever the number of prompts: on the
0.5B on a Hopper GPU a prefill is ~9-14 ms of mostly host work, nearly the same for 1 prompt as for
32, so a burst that reaches the engine in two parts pays it twice.
`num_steps` counts the "prefill" and "decode" steps, like the CUDA engine's (the step trace reads it).

`gate`: a file path; while no file is there, a request holds back its last token (it stays running,
one step per `sleep_s`), so that a test can keep a request in flight until it has checked what it
wants (the server draining) and then let it finish by creating the file: an event, not a time.

The busy parts are a fixed amount of work (a loop whose length is calibrated when the engine is built
to take `busy_s` or `prefill_s` on an idle core), not a spin until a deadline: when another thread
takes the GIL in the middle of it, the step gets longer, as the real engine's does.

It exists so that packages/nanoqwen-bench/server/overhead_sim.py can measure the server's overhead on a
machine without a GPU, with a step cost like the CUDA engine's on the 0.5B (~3 ms, about half of it
host-bound). Nothing in the CLI can select it: only `run_server(FakeEngineSpec(...), ...)` does.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from nanoqwen_runtime.engine.sequence import FinishReason
from nanoqwen_runtime.events import TokenEvent
from nanoqwen_runtime.request_stream import FinishEvent
from nanoqwen_runtime.stats import EngineStats

__all__ = ["FakeEngineSpec", "FakeEngine", "calibrate"]

TOKEN_TEXT = " t"


@dataclass(frozen=True)
class FakeEngineSpec:
    """busy_s: seconds of GIL-holding Python per decode step; sleep_s: seconds of GIL-free sleep per
    decode step; prefill_s: seconds of GIL-holding Python per prefill step (0: no prefill steps, see
    the module header). spins, prefill_spins: the busy loops' lengths; None calibrates them to busy_s
    and prefill_s where the engine is built (give the values of `calibrate(...)` to compare two engines
    in different processes on the same work)."""

    busy_s: float = 0.0015
    sleep_s: float = 0.0015
    max_batch: int = 64
    max_model_len: int = 4096
    vocab_size: int = 1000
    spins: int | None = None
    prefill_s: float = 0.0
    prefill_spins: int | None = None
    gate: str | None = None

    def build(self) -> FakeEngine:
        return FakeEngine(self)


@dataclass
class _Seq:
    request: Any
    generated: int = 0


class FakeEngine:
    def __init__(self, spec: FakeEngineSpec):
        self.spec = spec
        self.max_model_len = spec.max_model_len
        self.geom = SimpleNamespace(vocab_size=spec.vocab_size)
        prefill = f", {spec.prefill_s * 1e3:.2f} ms busy per prefill" if spec.prefill_s > 0 else ""
        self.name = (f"fake engine (test only): {spec.busy_s * 1e3:.2f} ms busy + "
                     f"{spec.sleep_s * 1e3:.2f} ms sleep per step{prefill}, max_batch {spec.max_batch}")
        self._spins = spec.spins if spec.spins is not None else calibrate(spec.busy_s)
        self._prefill_spins = (spec.prefill_spins if spec.prefill_spins is not None
                               else calibrate(spec.prefill_s))
        self._waiting: deque[_Seq] = deque()
        self._running: dict[str, _Seq] = {}
        self._last_kind = "decode"
        self.steps = 0
        self.num_steps = {"prefill": 0, "decode": 0}

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def submit(self, request: Any) -> FinishEvent | None:
        """Queue `request`; a refusal event for an empty prompt or one that does not fit the context."""
        n = len(request.prompt_tokens)
        if n == 0 or n >= self.max_model_len:
            return FinishEvent(request.request_id, FinishReason.REFUSED,
                               detail=f"the prompt has {n} tokens (1..{self.max_model_len - 1} fit)")
        self._waiting.append(_Seq(request))
        return None

    def abort(self, request_id: str) -> FinishEvent | None:
        seq = self._running.pop(request_id, None)
        if seq is None:
            for s in self._waiting:
                if s.request.request_id == request_id:
                    seq = s
                    self._waiting.remove(s)
                    break
        if seq is None:
            return None
        return FinishEvent(request_id, FinishReason.ABORTED, num_prompt_tokens=len(seq.request.prompt_tokens),
                           num_generated=seq.generated)

    def step(self, side_work=None) -> list:
        """One prefill step (separate prefills, requests waiting, after a decode or with none running)
        or one decode step; the events of its tokens and of the requests that ended. `side_work()` runs
        where the CUDA engine runs it (EngineBase.step): before a prefill's host work, and between a
        decode step's host work and its device wait."""
        self.steps += 1
        spec = self.spec
        can_admit = self._waiting and len(self._running) < spec.max_batch
        if spec.prefill_s > 0 and can_admit and (self._last_kind == "decode" or not self._running):
            self._last_kind = "prefill"
            self.num_steps["prefill"] += 1
            if side_work is not None:
                side_work()
            _spin(self._prefill_spins)  # a prefill's fixed host cost
            return self._emit(self._admit())
        self._last_kind = "decode"
        self.num_steps["decode"] += 1
        _spin(self._spins)             # host work that holds the GIL (up to the graph's launch)
        if side_work is not None:
            side_work()
        time.sleep(spec.sleep_s)       # a device sync: the GIL is free
        if spec.prefill_s <= 0:
            self._admit()
        return self._emit(list(self._running.values()))

    def _admit(self) -> list[_Seq]:
        """Move waiting requests to the running ones, up to max_batch; the ones moved."""
        admitted = []
        while self._waiting and len(self._running) < self.spec.max_batch:
            s = self._waiting.popleft()
            self._running[s.request.request_id] = s
            admitted.append(s)
        return admitted

    def _emit(self, seqs: list[_Seq]) -> list:
        """One token for each of `seqs`, and the finish of those that reach their max_tokens."""
        events: list = []
        gated = self.spec.gate is not None and not os.path.exists(self.spec.gate)
        for s in seqs:
            if gated and s.generated + 1 >= s.request.params.max_tokens:
                continue  # the last token waits for the gate file (the module header)
            rid, idx = s.request.request_id, s.generated
            s.generated += 1
            done = s.generated >= s.request.params.max_tokens
            events.append(TokenEvent(rid, idx % self.spec.vocab_size, idx, TOKEN_TEXT,
                                     FinishReason.LENGTH.value if done else None))
            if done:
                del self._running[rid]
                events.append(FinishEvent(rid, FinishReason.LENGTH,
                                          num_prompt_tokens=len(s.request.prompt_tokens),
                                          num_generated=s.generated))
        return events

    def generate(self, requests: Iterable[Any]) -> Iterator:
        """Submit `requests` and step until every one is done (the engines' `generate`)."""
        for r in requests:
            ev = self.submit(r)
            if ev is not None:
                yield ev
        while self.has_work:
            yield from self.step()

    def stats(self) -> EngineStats:
        return EngineStats(running=len(self._running), waiting=len(self._waiting), kv_blocks_total=1024,
                           kv_blocks_used=len(self._running))


def _spin(n: int) -> int:
    x = 0
    for i in range(n):
        x += i
    return x


def calibrate(busy_s: float) -> int:
    """Loop iterations of `_spin` that take `busy_s` on an idle core (the fastest of 5 timings)."""
    if busy_s <= 0:
        return 0
    n = 100_000
    best = min(_timed(n) for _ in range(5))
    return max(1, round(n * busy_s / best))


def _timed(n: int) -> float:
    t = time.perf_counter()
    _spin(n)
    return time.perf_counter() - t
