"""A lean load generator for the server benchmarks: streaming /v1/completions over raw asyncio streams.

The server's overhead goal compares the server's throughput with `Engine.generate` on the same
requests, so the client must not be the bottleneck. An `httpx.AsyncClient` that parses every SSE line
costs ~50-100 us of client CPU per chunk and ~2-5 ms to start each request: with 32 streams at
~10,000 tokens/s it is the slowest party, and starting 32 streams takes it longer than the engine
takes for several steps. This client needs about a fifth of that: one keep-alive HTTP/1.1 connection
per stream (`LeanClient.open` makes them before the timed phase), the request written as bytes, and
the chunked body read without parsing until its terminal chunk; the usage chunk at the end gives the
token count.

It records, per stream (`LeanResult`): the send time, the time the response head arrived (the server
answers a stream only once its first token is there, so this is the time to first token), the time of
every read that brought data (one read may hold several SSE chunks: these are read gaps, not
per-token gaps), and the completion tokens from the usage chunk. Only what a benchmark needs: no TLS,
no redirects, no proxies, loopback.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

__all__ = ["LeanClient", "LeanResult"]

_TERMINAL = b"data: [DONE]\n\n\r\n0\r\n\r\n"  # the last SSE event, then the zero-length chunk


@dataclass
class LeanResult:
    status: int
    t_send: float
    t_first: float | None = None
    read_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    done: bool = False
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done


class LeanClient:
    """Keep-alive connections to `url` ("http://HOST:PORT"); `stream` takes one from the pool (or opens
    one) and gives it back after the terminal chunk."""

    def __init__(self, url: str, model: str):
        host, port = url.removeprefix("http://").rstrip("/").split(":")
        self.host, self.port, self.model = host, int(port), model
        self._pool: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def open(self, n: int) -> None:
        """Open `n` connections now, so that the timed streams do not pay for TCP set-up."""
        for _ in range(n - len(self._pool)):
            self._pool.append(await asyncio.open_connection(self.host, self.port))

    async def stream(self, prompt: str | list[int], max_tokens: int) -> LeanResult:
        """One streaming completion (greedy, ignore_eos, usage included)."""
        conn = self._pool.pop() if self._pool else await asyncio.open_connection(self.host, self.port)
        reader, writer = conn
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "stream": True, "ignore_eos": True,
                           "stream_options": {"include_usage": True}}).encode()
        res = LeanResult(0, time.perf_counter())
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (self.host.encode(), len(body), body))
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            res.t_first = time.perf_counter()
            res.status = int(head[9:12])
            if res.status != 200 or b"chunked" not in head.lower():
                res.error = f"unexpected response: {head[:300]!r}"
                writer.close()
                return res
            parts: list[bytes] = []
            while True:
                data = await reader.read(1 << 16)
                if not data:
                    res.error = "connection closed mid-stream"
                    return res
                res.read_times.append(time.perf_counter())
                parts.append(data)
                if data.endswith(b"0\r\n\r\n") and b"".join(parts[-2:]).endswith(_TERMINAL):
                    break
        except (OSError, asyncio.IncompleteReadError) as e:
            res.error = f"{type(e).__name__}: {e}"
            return res
        self._pool.append(conn)
        text = b"".join(parts)
        at = text.rfind(b'"usage":')
        if at < 0:
            res.error = "no usage chunk in the stream"
            return res
        usage = text[at + len(b'"usage":'):]
        res.completion_tokens = json.loads(usage[:usage.index(b"}") + 1])["completion_tokens"]
        res.done = True
        return res

    async def close(self) -> None:
        for _, writer in self._pool:
            writer.close()
        self._pool.clear()
