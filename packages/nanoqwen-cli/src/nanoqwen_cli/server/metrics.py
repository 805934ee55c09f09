"""Prometheus metrics of the server (`GET /metrics`, text exposition format, `prometheus_client`).

    nanoqwen_requests_total{status}          requests ended, by status: the finish reason (stop, length),
                                             aborted (client went away, shutdown), error, or the HTTP
                                             code of a refused request (400, 401, 404, 413, 429, 503)
    nanoqwen_prompt_tokens_total             prompt tokens of requests the engine ran
    nanoqwen_generation_tokens_total         tokens generated
    nanoqwen_time_to_first_token_seconds     histogram: request accepted -> first token received
    nanoqwen_inter_token_latency_seconds     histogram: between successive tokens of one request
    nanoqwen_requests_running                gauge: sequences holding KV blocks
    nanoqwen_requests_waiting                gauge: admitted by the server, not yet running
    nanoqwen_kv_blocks_used / _free / _total gauges: the engine's KV pool (EngineStats)
    nanoqwen_preemptions_total               sequences preempted since start
    nanoqwen_kv_blocks_cached                gauge: unreferenced blocks kept for their prefix (evictable,
                                             so also counted in _free)
    nanoqwen_prefix_cache_queried_tokens_total  prompt tokens looked up in the prefix cache at admission
    nanoqwen_prefix_cache_hit_tokens_total   of those, taken from the cache instead of prefilled
    nanoqwen_prefix_cache_hit_rate           gauge: hit tokens / queried tokens since start (0 before any)
    nanoqwen_spec_verify_steps_total         decode steps that verified drafted tokens (--speculate)
    nanoqwen_spec_drafted_tokens_total       tokens proposed by prompt lookup
    nanoqwen_spec_accepted_tokens_total      of those, accepted by the model

The gauges come from the `EngineStats` snapshot the engine process sends with every step
(`publish`), read by a custom collector at scrape time: a scrape never touches the engine. Each server
has its own `CollectorRegistry` (no process-global state).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["Metrics"]

# Token latencies span ~1 ms (GPU decode) to seconds (CPU prefill under load).
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.0)


class _EngineCollector:
    def __init__(self, owner: Metrics):
        self.owner = owner

    def collect(self):
        s = self.owner.stats
        if s is None:
            return
        waiting = self.owner.waiting_fn() if self.owner.waiting_fn else s.waiting
        for name, doc, value in (
                ("nanoqwen_requests_running", "Sequences running (holding KV blocks)", s.running),
                ("nanoqwen_requests_waiting", "Requests accepted, waiting for a batch slot", waiting),
                ("nanoqwen_kv_blocks_used", "KV blocks referenced by live sequences", s.kv_blocks_used),
                ("nanoqwen_kv_blocks_free", "KV blocks free", s.kv_blocks_free),
                ("nanoqwen_kv_blocks_total", "KV blocks in the pool", s.kv_blocks_total),
                ("nanoqwen_kv_blocks_cached", "KV blocks kept for their prefix, unreferenced (evictable)",
                 s.kv_blocks_cached),
                ("nanoqwen_prefix_cache_hit_rate", "Prompt tokens taken from the prefix cache / looked up",
                 s.prefix_hit_rate)):
            yield GaugeMetricFamily(name, doc, value=value)
        # prometheus_client appends _total to counter families
        for name, doc, value in (
                ("nanoqwen_preemptions", "Sequences preempted since start", s.preemptions),
                ("nanoqwen_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache",
                 s.prefix_queried_tokens),
                ("nanoqwen_prefix_cache_hit_tokens", "Prompt tokens taken from the prefix cache",
                 s.prefix_hit_tokens),
                ("nanoqwen_prefix_cache_reused_tokens", "Prompt tokens past the cached prefix copied from "
                 "cached blocks at a shifted position (--cache-reuse)", s.prefix_reused_tokens),
                ("nanoqwen_spec_verify_steps", "Decode steps that verified drafted tokens", s.spec_steps),
                ("nanoqwen_spec_drafted_tokens", "Tokens drafted by prompt lookup", s.spec_drafted_tokens),
                ("nanoqwen_spec_accepted_tokens", "Drafted tokens the model accepted",
                 s.spec_accepted_tokens)):
            yield CounterMetricFamily(name, doc, value=value)


class Metrics:
    """The server's collectors in one registry. `stats`: the last `EngineStats` published."""

    def __init__(self):
        disable_created_metrics()  # no `*_created` series: they double the output and nobody reads them
        self.registry = CollectorRegistry()
        self.stats = None
        self.waiting_fn = None  # the server's waiting count (inbox + engine queue), set by the app
        r = self.registry
        self.requests = Counter("nanoqwen_requests", "Requests ended, by status", ["status"], registry=r)
        self.prompt_tokens = Counter("nanoqwen_prompt_tokens", "Prompt tokens of requests run", registry=r)
        self.generation_tokens = Counter("nanoqwen_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("nanoqwen_time_to_first_token_seconds", "Request accepted to first token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("nanoqwen_inter_token_latency_seconds", "Time between tokens of one request",
                             buckets=_ITL_BUCKETS, registry=r)
        r.register(_EngineCollector(self))

    def publish(self, stats) -> None:
        """Called by the engine process's reader thread after each step (an atomic reference swap)."""
        self.stats = stats

    def finished(self, status: str, prompt_tokens: int = 0, generated: int = 0) -> None:
        self.requests.labels(status=status).inc()
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
        if generated:
            self.generation_tokens.inc(generated)
