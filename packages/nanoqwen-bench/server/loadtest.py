"""Load test of `nanoqwen-cli serve`: N concurrent streaming clients, and the server's overhead against
`Engine.generate` on the same requests. Loopback only; bounded in request count and time.

    python packages/nanoqwen-bench/server/loadtest.py MODEL.nanoqwen --out bench/out/server \
        [--clients 256] [--max-tokens 128] [--time-limit 300] [--overhead-clients 32] [--kv-memory 16GiB]

Phases (one server subprocess, `--device cuda`, started by this script on a free loopback port):
1. load: `--clients` streaming /v1/completions requests at once (distinct prompts, greedy,
   `ignore_eos` so each wants exactly `--max-tokens` tokens). Every request must end with its
   `[DONE]` and finish_reason "length", or get a 429 with Retry-After; anything else is a failure.
   Reported: aggregate throughput (generated tokens / wall time), TTFT p50/p99 (send -> first content
   chunk), ITL p50/p99 (gaps between successive content chunks of one stream: a chunk carries every
   token that arrived since the last write, so under load one gap may span several tokens), the
   count of 429s, and the KV blocks used once all requests are done (from /metrics; must be 0).
2. overhead: `--overhead-clients` streaming clients with the same kind of requests through HTTP,
   `--overhead-repeats` times with each of two load generators: `lean_client.LeanClient` (raw
   keep-alive streams, connections opened before the timed phase; the goal's figure, as it measures
   the server and not the client) and httpx (each client's connection opened by an untimed 4-token
   stream first; reported beside it), and between them the same requests as the lean runs (same token
   ids and max_tokens, ignore_eos, greedy) through the server's engine built in this process
   (`EngineBaseline`: what `Engine.generate` does), so each round's three runs are seconds apart.
   Ratio = the median over the rounds of (HTTP tokens/s / engine tokens/s of the same round) (goal
   >= 0.95); the ratio of the medians of all runs is kept beside it.
   The server runs its engine in a child process (server/engine_process.py).
   Where the clients run (`--client-cpus`): with `--cpu-placement auto` the server's engine process has
   two CPUs of its own and the engine baseline runs alone on the same two; the load generator (this
   process) is a client, which on a real deployment runs on another host or, on the same host, among
   the HTTP process's CPUs (server/cpu_placement.py). So by default ("http") every client run of this
   process is bound to the HTTP process's CPUs; "any" leaves it where the scheduler puts it (possibly
   on the engine's two CPUs, beside its stepping and sender threads); "both" runs the
   lean clients both ways in every round ("lean" bound, "lean-any" not, each paired with the round's
   engine run) to measure what the binding changes.
   Where the time goes: the engine process records its steps (`NANOQWEN_ENGINE_TRACE`, see
   engine_worker.py) and `step_trace.breakdown` splits each timed run's wall time into the engine's
   prefill and decode steps, the work around them (commands, the step message) and idle waits; the
   baseline's steps are timed the same way. How the submits of every timed HTTP run reached the
   engine is reported too: the pipe messages that carried them, the spread of their arrival (first to
   last message), the engine iterations that applied them (1 when the burst started in one prefill)
   and the prefill steps.

Writes `loadtest.json` and `loadtest.md` to `--out`. Exit code 1 when a load request was lost or
the KV blocks did not return to zero (and, with --require-overhead R, when the ratio is below R).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules, also when loaded by path
from lean_client import LeanClient  # noqa: E402
from step_trace import breakdown, read_trace  # noqa: E402

# prompt ids of the overhead runs (distinct: no prefix hits)
LEAN_OFFSET, HTTPX_OFFSET, LEAN_ANY_OFFSET = 10_000, 20_000, 30_000
PROMPT = '# Python utilities, file {i}\nimport math\n\ndef function_{i}(values):\n    """'


@dataclass
class StreamResult:
    status: int
    t_send: float
    t_first: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    finish_reason: str | None = None
    done: bool = False
    retry_after: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and self.finish_reason is not None


async def one_stream(
    client: httpx.AsyncClient, url: str, model: str, i: int, max_tokens: int
) -> StreamResult:
    body = {
        "model": model,
        "prompt": PROMPT.format(i=i),
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    res = StreamResult(0, time.perf_counter())
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            res.status = r.status_code
            if r.status_code != 200:
                res.retry_after = r.headers.get("retry-after")
                res.error = (await r.aread()).decode()[:300]
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    res.done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = obj["error"]["message"]
                    continue
                if obj.get("usage"):
                    res.completion_tokens = obj["usage"]["completion_tokens"]
                for ch in obj.get("choices", []):
                    if ch.get("text"):
                        now = time.perf_counter()
                        if res.t_first is None:
                            res.t_first = now
                        res.chunk_times.append(now)
                    if ch.get("finish_reason"):
                        res.finish_reason = ch["finish_reason"]
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_clients(
    url: str, model: str, n: int, max_tokens: int, time_limit: float, offset: int = 0, warm: bool = False
) -> tuple[list[StreamResult], float, float]:
    """`n` concurrent streams; `warm`: first one 4-token stream per client on the same connection pool,
    untimed, so that the timed streams do not pay for opening `n` TCP connections."""
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(time_limit), limits=limits) as client:
        if warm:
            await asyncio.gather(*(one_stream(client, url, model, 80_000 + i, 4) for i in range(n)))
        t0 = time.perf_counter()
        tasks = [
            asyncio.create_task(one_stream(client, url, model, offset + i, max_tokens)) for i in range(n)
        ]
        done, pending = await asyncio.wait(tasks, timeout=time_limit)
        for t in pending:
            t.cancel()
        wall = time.perf_counter() - t0
    results = [t.result() for t in tasks if t in done]
    results += [
        StreamResult(0, t0, error=f"not finished within {time_limit} s") for t in tasks if t in pending
    ]
    return results, wall, t0


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def summarize(results: list[StreamResult], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.t_first - r.t_send for r in ok if r.t_first is not None]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    tokens = sum(r.completion_tokens for r in ok)
    lost = [r for r in results if not r.ok and r.status != 429]
    return {
        "requests": len(results),
        "completed": len(ok),
        "rejected_429": sum(r.status == 429 for r in results),
        "lost": len(lost),
        "lost_examples": [asdict(r) | {"chunk_times": len(r.chunk_times)} for r in lost[:3]],
        "retry_after_present": all(r.retry_after for r in results if r.status == 429),
        "generated_tokens": tokens,
        "wall_s": round(wall, 3),
        "throughput_tok_s": round(tokens / wall, 1),
        "ttft_p50_ms": _ms(pct(ttft, 50)),
        "ttft_p99_ms": _ms(pct(ttft, 99)),
        "itl_p50_ms": _ms(pct(itl, 50)),
        "itl_p99_ms": _ms(pct(itl, 99)),
        "mean_stream_tok_s": round(
            statistics.mean(
                [
                    (r.completion_tokens - 1) / (r.chunk_times[-1] - r.t_first)
                    for r in ok
                    if r.completion_tokens > 1 and r.chunk_times and r.chunk_times[-1] > r.t_first
                ]
                or [0.0]
            ),
            1,
        ),
    }


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 2)


class EngineBaseline:
    """The requests of the lean runs (token ids of the same prompts) through the engine in this process:
    `run(offset)` submits them at once, then steps until done (what `Engine.generate` does), each step
    timed, and returns the run with its step breakdown.

    The engine is the server's: `EngineSpec` with the options this script gives `serve` (and serve's
    defaults for the rest: graph mode, prefix caching, no speculation, no dense bf16 copy), so both
    sides run the same kernels. (A baseline built with other
    options measures other kernels: a bf16 copy of the linears on cuBLAS ran a batch-32 step of the
    0.5B in 2.9 ms against the server's 3.45 ms on the INT4 GEMM, which a ratio would count as server
    overhead.) It is built while the server runs (both
    engines fit the GPU; each waits while the other works), so that its runs can alternate with the
    HTTP runs: the host has been seen to drift by +-10% within one load test, which a baseline timed
    after the server had exited counted as overhead or as a gain."""

    def __init__(self, model: Path, kv_memory: str, device: str = "cuda",
                 engine_cpus: tuple[int, ...] | None = None):
        from nanoqwen_cli.server.engine_spec import EngineSpec, describe_engine
        from nanoqwen_cli.server.engine_worker import freeze_startup_objects
        from nanoqwen_runtime.engine import parse_bytes
        from nanoqwen_runtime.generate import Pipeline

        self.engine_cpus = engine_cpus
        self.pipe = Pipeline.from_container(model, backend=None)
        spec = EngineSpec(path=str(model), device=device, kv_memory_bytes=parse_bytes(kv_memory))
        self.engine = spec.build()
        self.description = describe_engine(self.engine)
        for _ in self.engine.generate(self.requests("warm", 90_000, 4, 8)):
            pass
        # as both server processes do once loaded: without it, a 38-47 ms full collection of the loaded
        # pipeline's objects lands in some runs of one side only
        freeze_startup_objects()

    def requests(self, tag: str, offset: int, count: int, tokens: int):
        from nanoqwen_runtime.engine import Request
        from nanoqwen_runtime.sampling import SamplingParams

        return [
            Request(
                self.pipe.tokenizer.encode(PROMPT.format(i=offset + i)),
                SamplingParams(max_tokens=tokens, temperature=0.0),
                request_id=f"{tag}{i}",
                eos_ids=self.pipe.eos_ids,
                ignore_eos=True,
            )
            for i in range(count)
        ]

    def run(self, n: int, max_tokens: int, offset: int) -> dict:
        engine = self.engine
        reqs = self.requests(f"b{offset}-", offset, n, max_tokens)
        rows: list[dict] = []
        tokens = 0
        with pinned(self.engine_cpus):
            wall, t0, tokens = self._run(engine, reqs, rows)
        return {"requests": n, "generated_tokens": tokens, "wall_s": round(wall, 3),
                "throughput_tok_s": round(tokens / wall, 1), "breakdown": breakdown(rows, t0, t0 + wall)}

    @staticmethod
    def _run(engine, reqs: list, rows: list[dict]) -> tuple[float, float, int]:
        tokens = 0
        t0 = time.perf_counter()
        for r in reqs:
            if engine.submit(r) is not None:
                raise RuntimeError(f"the engine refused {r.request_id}")
        while engine.has_work:
            before = dict(engine.num_steps)
            t_step = time.perf_counter()
            events = engine.step()
            t_done = time.perf_counter()
            kind = next(k for k, v in engine.num_steps.items() if v != before[k])
            rows.append({"t_wake": t_step, "n_cmds": 0, "n_submits": 0, "t_step": t_step, "t_done": t_done,
                         "kind": kind, "n_tokens": 0, "t_sent": t_done})
            tokens += sum(ev.num_generated for ev in events if hasattr(ev, "num_generated"))
        return time.perf_counter() - t0, t0, tokens


def placement(mode: str, device: str):
    """The server's `CpuPlacement` under `--cpu-placement mode` (the same plan, made from this process's
    affinity, which the server inherits); None: no placement."""
    if mode != "auto":
        return None
    from nanoqwen_cli.server import cpu_placement

    return cpu_placement.plan(mode, slot=cpu_placement.device_slot(device))


def baseline_cpus(mode: str, device: str) -> tuple[int, ...] | None:
    """The CPUs of the server's engine process, for the baseline's runs: the engine alone gets the same
    CPUs the server's engine process has. None: no placement."""
    p = placement(mode, device)
    return p.engine if p is not None else None


def client_cpus(mode: str, device: str, clients: str) -> tuple[int, ...] | None:
    """The CPUs of the client runs: the server's HTTP CPUs unless `clients` is "any" (or there is no
    placement); None: unbound."""
    p = placement(mode, device)
    return p.http if p is not None and clients != "any" else None


@contextlib.contextmanager
def pinned(cpus: tuple[int, ...] | None):
    """Every thread of this process on `cpus` for the block (nothing when None), then back."""
    if cpus is None:
        yield
        return
    from nanoqwen_cli.server import cpu_placement

    before = os.sched_getaffinity(0)
    cpu_placement.apply(cpus)
    try:
        yield
    finally:
        cpu_placement.apply(before)


def paired_ratios(http_runs: list[dict], engine_runs: list[dict]) -> list[float]:
    """HTTP tok/s over engine tok/s of the runs made one after the other (repeat i of each)."""
    return [round(h["throughput_tok_s"] / e["throughput_tok_s"], 4)
            for h, e in zip(http_runs, engine_runs, strict=True)]


ARRIVAL_KEYS = ("submit_msgs", "submit_spread_ms", "submit_rows", "prefill_steps", "first_submit_ms",
                "last_submit_ms")


def arrival(b: dict) -> dict:
    """How a run's submits reached the engine, from its `step_trace.breakdown`."""
    return {k: b.get(k) for k in ARRIVAL_KEYS}


def median_run(runs: list[dict]) -> dict:
    """The run with the median throughput, with every run's throughput beside it."""
    ranked = sorted(runs, key=lambda r: r["throughput_tok_s"])
    return {**ranked[(len(ranked) - 1) // 2], "runs_tok_s": [r["throughput_tok_s"] for r in runs]}


async def lean_run(url: str, model: str, n: int, max_tokens: int, time_limit: float,
                   offset: int) -> tuple[list[StreamResult], float, float]:
    """`n` concurrent LeanClient streams (connections opened first, untimed); results as StreamResults
    (a read time stands for a chunk time), the wall time, and its start (perf_counter)."""
    client = LeanClient(url, model)
    await client.open(n)
    t0 = time.perf_counter()
    done = await asyncio.wait_for(
        asyncio.gather(*(client.stream(PROMPT.format(i=offset + i), max_tokens) for i in range(n))),
        time_limit,
    )
    wall = time.perf_counter() - t0
    await client.close()
    results = [
        StreamResult(r.status, r.t_send, r.t_first, r.read_times, r.completion_tokens,
                     "length" if r.done else None, r.done, error=r.error)
        for r in done
    ]
    return results, wall, t0


def overhead_phase(srv, name: str, args: argparse.Namespace, baseline: EngineBaseline,
                   client_cpus: tuple[int, ...] | None) -> dict:
    """The timed runs of the overhead phase, `--overhead-repeats` rounds of: the lean HTTP run, the
    engine baseline on the same requests, (with `--client-cpus both`: the lean HTTP run with the clients
    unbound,) the httpx HTTP run. The client runs are bound to `client_cpus` (None: unbound). Each
    round's HTTP/engine ratio is taken from runs seconds apart, so host drift between rounds cancels;
    the headline ratio is their median."""
    kinds = ("lean", "lean-any", "httpx") if args.client_cpus == "both" else ("lean", "httpx")
    runs: dict[str, list[dict]] = {kind: [] for kind in (*kinds, "engine")}

    def lean(offset: int, cpus: tuple[int, ...] | None) -> dict:
        with pinned(cpus):
            res, wall, t0 = asyncio.run(lean_run(srv.url, name, args.overhead_clients,
                                                 args.overhead_max_tokens, args.time_limit, offset))
        return {**summarize(res, wall), "window": [t0, t0 + wall]}

    for rep in range(args.overhead_repeats):
        offset = LEAN_OFFSET + 1000 * rep
        runs["lean"].append(lean(offset, client_cpus))
        runs["engine"].append(baseline.run(args.overhead_clients, args.overhead_max_tokens, offset))
        if "lean-any" in runs:
            runs["lean-any"].append(lean(LEAN_ANY_OFFSET + 1000 * rep, None))
        with pinned(client_cpus):
            res, wall, t0 = asyncio.run(
                run_clients(srv.url, name, args.overhead_clients, args.overhead_max_tokens, args.time_limit,
                            offset=HTTPX_OFFSET + 1000 * rep, warm=True)
            )
        runs["httpx"].append({**summarize(res, wall), "window": [t0, t0 + wall]})
    out = {kind: {**median_run(runs[kind]), "windows": [r["window"] for r in runs[kind]]} for kind in kinds}
    out["paired_ratios"] = {kind: paired_ratios(runs[kind], runs["engine"]) for kind in kinds}
    out["engine"] = {**median_run(runs["engine"]), "engine": baseline.description}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--clients", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--time-limit", type=float, default=300.0, help="seconds for each phase at most")
    ap.add_argument("--overhead-clients", type=int, default=32, help="0 skips the overhead phase")
    ap.add_argument("--overhead-max-tokens", type=int, default=256)
    ap.add_argument("--overhead-repeats", type=int, default=5)
    ap.add_argument("--kv-memory", default="16GiB")
    ap.add_argument("--max-waiting", type=int, default=256)
    ap.add_argument("--require-overhead", type=float, default=None)
    ap.add_argument("--cpu-placement", choices=("auto", "off", "unset"), default="auto",
                    help="the server's --cpu-placement; with auto the engine baseline runs on the engine "
                         "process's CPUs too (unset: the flag is not passed, for servers older than it)")
    ap.add_argument("--client-cpus", choices=("http", "any", "both"), default="http",
                    help="where the client runs go with --cpu-placement auto: on the server's HTTP CPUs "
                         "(the default), unbound, or both ways in every overhead round (lean-any)")
    args = ap.parse_args(argv)
    if not 1 <= args.clients <= 1024:
        ap.error("--clients must be in 1..1024")

    from nanoqwen_cli.server.engine_worker import TRACE_ENV
    from nanoqwen_cli.server.testing import ServerProcess

    name = "bench"
    report: dict = {
        "model": str(args.model.name),
        "device": args.device,
        "clients": args.clients,
        "max_tokens": args.max_tokens,
        "kv_memory": args.kv_memory,
        "overhead_clients": args.overhead_clients,
        "overhead_max_tokens": args.overhead_max_tokens,
        "cpu_placement": args.cpu_placement,
        "client_cpus_mode": args.client_cpus,
    }
    clients_on = client_cpus(args.cpu_placement, args.device, args.client_cpus)
    report["client_cpus"] = list(clients_on) if clients_on else None
    args.out.mkdir(parents=True, exist_ok=True)
    trace_path = args.out / "engine-trace.jsonl"
    srv = ServerProcess(
        args.model,
        "--device",
        args.device,
        "--model-name",
        name,
        "--kv-memory",
        args.kv_memory,
        "--max-waiting",
        str(args.max_waiting),
        *(["--cpu-placement", args.cpu_placement] if args.cpu_placement != "unset" else []),
        env={TRACE_ENV: str(trace_path)},
    )
    srv.start()
    try:
        with pinned(clients_on):  # warm the HTTP path, then the load phase
            asyncio.run(run_clients(srv.url, name, 4, 8, args.time_limit, offset=90_000))
            results, wall, _ = asyncio.run(
                run_clients(srv.url, name, args.clients, args.max_tokens, args.time_limit)
            )
        load = summarize(results, wall)
        load["kv_blocks_used_after"] = srv.wait_metric("nanoqwen_kv_blocks_used", 0.0, timeout_s=30)
        m = srv.metrics()
        load["server_preemptions"] = m.get("nanoqwen_preemptions_total")
        report["load"] = load
        if args.overhead_clients:
            baseline = EngineBaseline(args.model, args.kv_memory, args.device,
                                      engine_cpus=baseline_cpus(args.cpu_placement, args.device))
            report["baseline_cpus"] = list(baseline.engine_cpus) if baseline.engine_cpus else None
            report["overhead_http"] = overhead_phase(srv, name, args, baseline, clients_on)
            del baseline
    finally:
        report["server_exit_code"] = srv.terminate()
        server_log = srv.log()
    failures_early: list[str] = []
    if args.overhead_clients:
        trace = read_trace(trace_path)
        report["overhead_engine"] = report["overhead_http"].pop("engine")
        paired = report["overhead_http"].pop("paired_ratios")
        for run in report["overhead_http"].values():
            run["breakdown"] = breakdown(trace, *run.pop("window"))
            run["arrival"] = [arrival(breakdown(trace, *w)) for w in run.pop("windows")]
        report["server_line"] = next((ln for ln in server_log.splitlines() if "nanoqwen serve: " in ln), None)
        report["server_engine"] = next(
            (ln.split("nanoqwen serve: ", 1)[1].split(";")[0] for ln in server_log.splitlines()
             if "nanoqwen serve: " in ln), None)
        if report["server_engine"] != report["overhead_engine"]["engine"]:
            failures_early.append(f"the baseline's engine ({report['overhead_engine']['engine']}) is not the "
                                  f"server's ({report['server_engine']})")
        # the goal's figure: the median of the rounds' paired ratios (overhead_phase); the ratio of the
        # medians of all runs is kept beside it
        report["overhead_paired_ratios"] = paired
        report["overhead_ratio"] = statistics.median(paired["lean"])
        report["overhead_ratio_httpx"] = statistics.median(paired["httpx"])
        if "lean-any" in paired:
            report["overhead_ratio_lean_any"] = statistics.median(paired["lean-any"])
        engine_tok_s = report["overhead_engine"]["throughput_tok_s"]
        report["overhead_ratio_of_medians"] = round(
            report["overhead_http"]["lean"]["throughput_tok_s"] / engine_tok_s, 4)
    load = report["load"]
    failures = failures_early
    if load["lost"]:
        failures.append(f"{load['lost']} requests neither completed nor got a 429")
    if not load["retry_after_present"]:
        failures.append("a 429 without Retry-After")
    if load["kv_blocks_used_after"] != 0:
        failures.append(f"KV blocks used after the load: {load['kv_blocks_used_after']}")
    if report["server_exit_code"] != 0:
        failures.append(f"server exit code {report['server_exit_code']} after SIGTERM")
    if args.require_overhead is not None and report.get("overhead_ratio", 0) < args.require_overhead:
        failures.append(f"overhead ratio {report.get('overhead_ratio')} < {args.require_overhead}")
    report["failures"] = failures
    (args.out / "loadtest.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "loadtest.md").write_text(markdown(report))
    print(markdown(report))
    return 1 if failures else 0


def markdown(r: dict) -> str:
    ld = r["load"]
    lines = [
        f"# nanoqwen-cli serve load test ({r['model']}, {r['device']})",
        "",
        f"{ld['requests']} concurrent streaming clients, {r['max_tokens']} tokens each (ignore_eos, greedy)",
        "",
        f"Server: `{(r.get('server_line') or '').strip()}` (`--cpu-placement {r.get('cpu_placement')}`; the "
        f"engine baseline on CPUs {r.get('baseline_cpus') or 'as the scheduler places it'}; the clients "
        f"on CPUs {r.get('client_cpus') or 'as the scheduler places them'})",
        "",
        "| completed | 429 | lost | tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | KV blocks after |",
        "|---|---|---|---|---|---|---|",
        f"| {ld['completed']} | {ld['rejected_429']} | {ld['lost']} | {ld['throughput_tok_s']} | "
        f"{ld['ttft_p50_ms']} / {ld['ttft_p99_ms']} | {ld['itl_p50_ms']} / {ld['itl_p99_ms']} | "
        f"{ld['kv_blocks_used_after']} |",
        "",
    ]
    if "overhead_ratio" in r:
        e = r["overhead_engine"]
        lines += [
            f"Overhead: {r['overhead_clients']} streaming clients x {r['overhead_max_tokens']} tokens, "
            f"{len(e['runs_tok_s'])} rounds of (lean HTTP run, engine run, httpx HTTP run). Ratio = the "
            "median over the rounds of HTTP tok/s / engine tok/s of the same round, same requests: "
            f"**{r['overhead_ratio']}** with the lean client (goal >= 0.95), {r['overhead_ratio_httpx']} "
            "with httpx clients. Rounds (lean): "
            f"{', '.join(str(x) for x in r.get('overhead_paired_ratios', {}).get('lean', []))}; "
            f"ratio of the medians of all runs: {r.get('overhead_ratio_of_medians')}."
            + (f" With the lean clients unbound (`--client-cpus both`, run after the engine in each round): "
               f"**{r['overhead_ratio_lean_any']}**; rounds: "
               f"{', '.join(str(x) for x in r['overhead_paired_ratios']['lean-any'])}."
               if "overhead_ratio_lean_any" in r else ""),
            "",
            "| run | tok/s (runs) | wall s | TTFT p50 / p99 ms | read gap p50 / p99 ms | decode steps | "
            "decode step ms | prefill steps | prefill ms | around steps ms | idle ms |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        rows = [(f"HTTP, {k} client", v) for k, v in r["overhead_http"].items()] + [("engine", e)]
        for label, v in rows:
            b = v["breakdown"]
            lines.append(
                f"| {label} | {v['throughput_tok_s']} ({', '.join(map(str, v['runs_tok_s']))}) | "
                f"{v['wall_s']} | {v.get('ttft_p50_ms', '-')} / {v.get('ttft_p99_ms', '-')} | "
                f"{v.get('itl_p50_ms', '-')} / {v.get('itl_p99_ms', '-')} | {b['decode_steps']} | "
                f"{b['decode_step_ms']} | {b['prefill_steps']} | {b['prefill_ms']} | {b['around_ms']} | "
                f"{b['idle_ms']} |"
            )
        lines += ["", "decode step ms: the mean; prefill ms, around steps ms and idle ms: totals within "
                  "the run's wall time (see step_trace.py).", ""]
        lines += submit_arrival(r)
    lines += [f"Failures: {', '.join(r['failures']) or 'none'}", ""]
    return "\n".join(lines)


def submit_arrival(r: dict) -> list[str]:
    """The table of how each timed HTTP run's submits reached the engine (step_trace.breakdown's keys;
    an older report has only its median runs' breakdowns)."""
    lines = [
        f"Submit arrival: how the {r['overhead_clients']} submits of each timed run reached the engine "
        "(pipe messages with a submit; first to last message; engine iterations that applied submits, "
        "each then stepped: 1 = the burst started in one prefill).",
        "",
        "| run | submit messages | first to last message ms | engine iterations with submits | "
        "prefill steps | first / last submit ms from start |",
        "|---|---|---|---|---|---|",
    ]
    for kind, v in r["overhead_http"].items():
        for i, a in enumerate(v.get("arrival") or [arrival(v["breakdown"])]):
            label = f"HTTP, {kind} client, run {i + 1}" if "arrival" in v else f"HTTP, {kind} client (median)"
            lines.append(f"| {label} | {a['submit_msgs']} | {a['submit_spread_ms']} | {a['submit_rows']} | "
                         f"{a['prefill_steps']} | {a['first_submit_ms']} / {a['last_submit_ms']} |")
    return lines + [""]


if __name__ == "__main__":
    sys.exit(main())
