"""Requests with n > 1 choices, logprobs or echo: the fan-out into engine requests and the answers.

    spec (n, logprobs k, echo) --> n engine Requests: request i has seed + i (when a seed is given; else
       each draws its own), logprobs k, and (echo with logprobs, choice 0 only) prompt_logprobs
    submit choice 0, wait for its first event --> its prompt's full KV blocks are in the prefix cache
       (the engine registers them when the prefill's last chunk commits, before that token is sent)
    submit choices 1..n-1 --> each takes the prompt's full blocks from the cache (only the partial
       last block, < block_size tokens, and the token that samples are computed again per choice)
    one task per choice moves its events into one queue, tagged with the choice index
    --> one JSON answer (`complete`) or one SSE stream (`stream`) with choices[i].index = i

So the prompt is prefilled once (the prefix-cache counters show it: n - 1 hits of its full blocks),
and the KV blocks are shared through the cache's reference counts, not copied. With the prefix cache
off (`serve --no-prefix-caching`) each choice prefills the prompt. Usage counts the prompt once and
the choices' generated tokens summed; so do the metrics, which count the request once when its last
choice ends, with the first of aborted, error, length, stop that a choice ended with. A client that
goes away aborts every choice.

Logprobs (nanoqwen_runtime.logprobs: the log-softmax of the raw logits, before temperature, top-k and
top-p) take the OpenAI shapes:
- chat: `choices[i].logprobs.content = [{token, logprob, bytes, top_logprobs: [{token, logprob,
  bytes}]}]`, one per generated token (an EOS token ends the answer and is not listed);
- completions: `{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`; the
  top_logprobs dict also holds the sampled token (as vLLM); `text_offset` is the running sum of the
  token strings' lengths from 0 (the position in the returned text wherever tokens hold whole
  characters; a token that splits a UTF-8 character is shown with U+FFFD). With `echo` the prompt's
  tokens come first, the first with a null logprob and null alternatives; `max_tokens: 0` with echo
  returns the prompt alone (one token is generated and dropped: the engine always samples one).
Streamed, every chunk carries the logprobs of its token.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from .disconnect import CLIENT_GONE, DISCONNECT_POLL_S, ClientGone
from .engine_process import Finish, RequestHandle
from .engine_worker import TokenOut
from .protocol import APIError, GenerationSpec, error_body
from .sse import finish_reason, sse

__all__ = ["generate", "wants_choices"]


def wants_choices(spec: GenerationSpec) -> bool:
    """Whether a request takes this path (the plain one-choice path stays as fast as it was)."""
    return spec.n > 1 or spec.logprobs is not None or spec.echo


@dataclass
class _Choice:
    """What one choice has produced so far."""

    handle: RequestHandle
    text: list[str] = field(default_factory=list)
    tokens: list[tuple[int, Any]] = field(default_factory=list)  # (token id, TokenLogprobs)
    prompt_logprobs: tuple | None = None
    finish: Finish | None = None


class _Group:
    """The n handles of one request and the queue their events arrive on as (choice index, event)."""

    def __init__(self, routes, request: Request, handles: list[RequestHandle], first):
        self.routes = routes
        self.request = request
        self.choices = [_Choice(h) for h in handles]
        self.queue: asyncio.Queue = asyncio.Queue()
        self.queue.put_nowait((0, first))
        self.tasks = [asyncio.ensure_future(self._pump(i, h, skip_first=i == 0 and type(first) is Finish))
                      for i, h in enumerate(handles)]
        self.t_checked = time.monotonic()
        self.counted = False  # the request has been counted in the metrics

    async def _pump(self, i: int, h: RequestHandle, skip_first: bool) -> None:
        if skip_first:  # choice 0 already ended with its first event
            return
        while True:
            ev = await h.queue.get()
            self.queue.put_nowait((i, ev))
            if type(ev) is Finish:
                return

    @property
    def live(self) -> bool:
        return any(c.finish is None for c in self.choices)

    async def next(self, poll: bool) -> tuple[int, Any]:
        """The next event of any choice; with `poll`, the client is looked at every DISCONNECT_POLL_S
        (routes.next_event) and a client that left aborts every choice (ClientGone)."""
        while True:
            if poll and time.monotonic() - self.t_checked >= DISCONNECT_POLL_S:
                self.t_checked = time.monotonic()
                if await self.request.is_disconnected():
                    self.abort()
                    raise ClientGone
            try:
                return await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_S if poll else None)
            except TimeoutError:
                continue

    def finished(self, c: _Choice, ev: Finish) -> None:
        """Record that choice c ended; the last choice to end counts the request in the metrics."""
        c.finish = ev
        if not self.live and not self.counted:
            self.counted = True
            status = min((_status(x.finish) for x in self.choices), key=_STATUS_ORDER.index)
            self.routes.metrics.finished(status, max(x.finish.num_prompt_tokens for x in self.choices),
                                         sum(x.finish.num_generated for x in self.choices))

    def abort(self) -> None:
        """End every choice that has not finished (as aborted)."""
        for c in self.choices:
            if c.finish is None:
                c.handle.abort()
                self.finished(c, Finish(c.handle.request_id, "aborted"))
        self.close()

    def close(self) -> None:
        for t in self.tasks:
            t.cancel()


_STATUS_ORDER = ("aborted", "error", "length", "stop")


def _status(ev: Finish) -> str:
    """The metrics status of one choice's end."""
    return ev.reason if ev.reason in ("error", "aborted") else finish_reason(ev.reason)


def _choice_requests(routes, spec: GenerationSpec, info) -> list:
    """The engine requests of the n choices: seeds seed + i (mod 2^63) when a seed is given."""
    run_spec = dataclasses.replace(spec, max_tokens=1) if spec.max_tokens == 0 else spec
    base = routes.engine_request(run_spec, info)
    base.logprobs = spec.logprobs
    reqs = []
    for i in range(spec.n):
        r = copy.copy(base)
        if spec.n > 1:
            r.request_id = f"{base.request_id}-{i}"
            if spec.seed is not None:
                r.params = base.params.with_(seed=(spec.seed + i) % 2**63)
        r.prompt_logprobs = spec.echo and spec.logprobs is not None and i == 0
        reqs.append(r)
    return reqs


async def generate(routes, request: Request, spec: GenerationSpec):
    """The route's answer for a request that `wants_choices` (see the module header)."""
    reqs = _choice_requests(routes, spec, routes.ready_engine())
    response_id = reqs[0].request_id.rsplit("-", 1)[0] if spec.n > 1 else reqs[0].request_id
    first_handle = routes.submit(reqs[0])
    try:
        first = await routes.first_event(first_handle, request)
    except ClientGone:
        return Response(status_code=CLIENT_GONE)
    handles = [first_handle]
    try:
        for r in reqs[1:]:  # choice 0's prompt blocks are in the prefix cache by now
            handles.append(routes.submit(r))
    except APIError:
        for h in handles:
            h.abort()
        routes.metrics.finished("aborted")
        raise
    group = _Group(routes, request, handles, first)
    answer = _Answer(routes, spec, response_id, reqs[0].prompt_tokens)
    if spec.stream:
        return StreamingResponse(answer.stream(group), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        return await answer.complete(group)
    except ClientGone:
        return Response(status_code=CLIENT_GONE)


class _Answer:
    """The response bodies of one request (see the module header for the shapes)."""

    def __init__(self, routes, spec: GenerationSpec, response_id: str, prompt_ids: list[int]):
        self.routes = routes
        self.spec = spec
        self.id = response_id
        self.prompt_ids = prompt_ids
        self.chat = spec.kind == "chat"
        self.drop = spec.max_tokens == 0  # echo of the prompt alone: the one generated token is dropped
        pipe = routes.cfg.pipeline
        self.tokenizer = pipe.tokenizer
        self.eos = set() if spec.ignore_eos else set(pipe.eos_ids)
        self.created = int(time.time())
        self._token_cache: dict[int, tuple[str, list[int]]] = {}

    # ---- events ---------------------------------------------------------------------------------
    def take(self, group: _Group, c: _Choice, ev) -> tuple[str, list[tuple[int, Any]]]:
        """Record one event of choice c: the text it adds and the (token id, logprobs) it lists."""
        if type(ev) is Finish:
            group.finished(c, ev)
            text, new = ("" if self.drop else ev.text), []
        elif type(ev) is TokenOut:
            if ev.prompt_logprobs is not None:
                c.prompt_logprobs = ev.prompt_logprobs
            text = "" if self.drop else ev.text
            new = [] if self.drop or ev.token_id in self.eos else [(ev.token_id, ev.logprobs)]
        else:
            text, new = ("" if self.drop else ev), []
        c.text.append(text)
        c.tokens.extend(new)
        return text, new

    @staticmethod
    def failure(ev: Finish) -> APIError | None:
        if ev.reason == "error":
            return APIError(500, f"the model failed on this request: {ev.detail}", type="server_error",
                            code="model_error")
        if ev.reason == "aborted":
            return APIError(503, f"the request was ended: {ev.detail or 'aborted'}", type="server_error",
                            code="aborted")
        return None

    def usage(self, choices: list[_Choice]) -> dict[str, int]:
        gen = 0 if self.drop else sum(c.finish.num_generated for c in choices)
        n = len(self.prompt_ids)
        return {"prompt_tokens": n, "completion_tokens": gen, "total_tokens": n + gen}

    def reason(self, c: _Choice) -> str:
        return "length" if self.drop else finish_reason(c.finish.reason)

    # ---- logprob shapes -------------------------------------------------------------------------
    def token(self, tid: int) -> tuple[str, list[int]]:
        """A token's text (its bytes as UTF-8, U+FFFD where they split a character) and bytes."""
        hit = self._token_cache.get(tid)
        if hit is None:
            try:
                b = self.tokenizer.token_bytes(tid)
            except ValueError:  # an id past the tokenizer's vocabulary (the model's padded rows)
                b = f"<|token_{tid}|>".encode()
            hit = self._token_cache[tid] = (b.decode("utf-8", errors="replace"), list(b))
        return hit

    def chat_entry(self, tid: int, lp) -> dict[str, Any]:
        s, b = self.token(tid)
        tops = []
        for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True):
            ts, tb = self.token(i)
            tops.append({"token": ts, "logprob": v, "bytes": tb})
        return {"token": s, "logprob": lp.logprob, "bytes": b, "top_logprobs": tops}

    def completion_logprobs(self, entries: list[tuple[int, Any]], offset: int) -> dict[str, Any]:
        """`entries`: (token id, TokenLogprobs or None); offsets from `offset`."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, lp in entries:
            s = self.token(tid)[0]
            out["tokens"].append(s)
            out["text_offset"].append(offset)
            offset += len(s)
            if lp is None:  # the prompt's first token
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(lp.logprob)
            tops = {self.token(i)[0]: v for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)}
            tops.setdefault(s, lp.logprob)
            out["top_logprobs"].append(tops)
        return out

    def prompt_text(self) -> str:
        spec = self.spec
        return spec.prompt if isinstance(spec.prompt, str) else self.tokenizer.decode(self.prompt_ids)

    # ---- answers --------------------------------------------------------------------------------
    async def complete(self, group: _Group) -> dict[str, Any]:
        """Every choice's text and logprobs, then one JSON body."""
        try:
            while group.live:
                i, ev = await group.next(poll=True)
                c = group.choices[i]
                self.take(group, c, ev)
                if type(ev) is Finish and (err := self.failure(ev)) is not None:
                    group.abort()
                    raise err
        except BaseException:
            group.abort()
            raise
        group.close()
        choices = []
        prompt_lp = group.choices[0].prompt_logprobs
        for i, c in enumerate(group.choices):
            text = "".join(c.text)
            lp = None
            if self.chat:
                if self.spec.logprobs is not None:
                    lp = {"content": [self.chat_entry(t, x) for t, x in c.tokens]}
                choices.append({"index": i, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                                "finish_reason": self.reason(c)})
                continue
            entries = c.tokens
            if self.spec.echo:
                text = self.prompt_text() + text
                if self.spec.logprobs is not None:
                    entries = list(zip(self.prompt_ids, prompt_lp, strict=True)) + entries
            if self.spec.logprobs is not None:
                lp = self.completion_logprobs(entries, 0)
            choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": self.reason(c)})
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.routes.cfg.model_name, "choices": choices,
                "usage": self.usage(group.choices)}

    async def stream(self, group: _Group) -> AsyncIterator[bytes]:
        """One chunk per event of any choice (its index), each choice's finish chunk, the usage chunk if
        asked for, `[DONE]`. A client that goes away (the task is cancelled) aborts every choice."""
        base = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.routes.cfg.model_name}
        offsets = [0] * len(group.choices)
        done = False
        try:
            if self.chat:
                for i in range(len(group.choices)):
                    yield sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None}]})
            while group.live:
                i, ev = await group.next(poll=False)
                c = group.choices[i]
                text, new = self.take(group, c, ev)
                if type(ev) is Finish and (err := self.failure(ev)) is not None:
                    group.abort()
                    yield sse(error_body(f"the request ended early: {err.message}", "server_error", None,
                                         err.code))
                    break
                reason = self.reason(c) if type(ev) is Finish else None
                if not text and not new and reason is None:
                    continue
                lp = None
                if self.spec.logprobs is not None:
                    if self.chat:
                        lp = {"content": [self.chat_entry(t, x) for t, x in new]}
                    else:
                        lp = self.completion_logprobs(new, offsets[i])
                        offsets[i] += sum(len(s) for s in lp["tokens"])
                if self.chat:
                    choice = {"index": i, "delta": {"content": text} if text else {}, "logprobs": lp,
                              "finish_reason": reason}
                else:
                    choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": reason}
                yield sse({**base, "choices": [choice]})
            else:
                if self.spec.include_usage:
                    yield sse({**base, "choices": [], "usage": self.usage(group.choices)})
            yield b"data: [DONE]\n\n"
            done = True
        finally:
            if not done:
                group.abort()
            group.close()
