"""The server's overhead without a GPU: HTTP throughput over a fake engine against that engine's own loop.

    python packages/nanoqwen-bench/server/overhead_sim.py [--clients 32] [--max-tokens 512] [--busy-ms 1.5]
        [--sleep-ms 1.5] [--prefill-ms 0] [--repeats 3] [--out FILE.json]
        [--server-package nanoqwen_cli.server --design process]   (default: this checkout's server)
        [--server-package nanoqwen_server_thread --design thread --pythonpath DIR]   (an old copy)

The engine is `nanoqwen_cli.server.fake_engine.FakeEngine` (test only): each step spins `--busy-ms` of
pure Python (holding the GIL, like the CUDA engine's scheduling and launches) and sleeps `--sleep-ms`
(GIL free, like a device sync), and emits one token per running request: on the H200 the 0.5B's decode
step is ~3 ms, about half of it host-bound. `--prefill-ms` > 0 makes prefill a step of its own that
spins that long whatever the number of prompts (the 0.5B's prefill on the H200: ~9-14 ms, mostly fixed
host cost), so that a burst reaching the engine in two parts costs what it costs there; 0 (the
default) starts new requests in a decode step. Two measurements of the same `--clients` requests
(3 prompt ids, `--max-tokens` each, ignore_eos):

1. engine: `FakeEngine.generate(requests)` in this process: tokens / wall time;
2. http: a server subprocess (`run_server` of `--server-package` with the fake engine) and
   `--clients` concurrent streaming httpx clients in this process: tokens (from each stream's usage
   chunk) / wall time from the first send to the last [DONE].

Ratio = http / engine (the issue's goal: >= 0.95 on the H200 with the real engine). Each is the median
of `--repeats` runs. The server's engine process records its step trace (engine_worker.StepTrace); for
each HTTP run the report gives its prefill steps, the engine iterations that applied submits and the
spread of the submits' arrival (first to last pipe message with a submit, ms) from
`step_trace.breakdown`. `--design thread` runs a copy of the server from before the engine moved to its
own process (engine_loop.py's thread; its `run_server` takes a factory, not a spec): see NOTES.md.
`--profile FILE` writes a cProfile of the server's event-loop thread (pstats format).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules, also when loaded by path
from lean_client import LeanClient  # noqa: E402
from step_trace import breakdown, read_trace  # noqa: E402

READY = re.compile(r"ready on (http://[\d.]+:\d+)/v1")
MODEL = "sim"


def prompt(i: int) -> list[int]:
    return [1 + i % 500, 2, 3]


def fake_spec(args: argparse.Namespace):
    """The fake engine of both measurements: the same busy loops (calibrated once, in `main`)."""
    from nanoqwen_cli.server.fake_engine import FakeEngineSpec

    return FakeEngineSpec(busy_s=args.busy_ms / 1e3, sleep_s=args.sleep_ms / 1e3, max_batch=args.clients,
                          spins=args.spins, prefill_s=args.prefill_ms / 1e3, prefill_spins=args.prefill_spins)


# ---- the server subprocess ----------------------------------------------------------------------------
def serve(args: argparse.Namespace) -> None:
    import importlib

    from nanoqwen_runtime.generate import Pipeline
    from nanoqwen_runtime.testing import write_tiny_container

    # the app needs a pipeline for its text side (sampling defaults, EOS ids); prompts are token ids here
    container = write_tiny_container(Path(tempfile.mkdtemp()) / "sim.nanoqwen", method="rtn", seed=5)
    pipeline = Pipeline.from_container(container, backend=None)
    spec = fake_spec(args)
    run_server = importlib.import_module(args.server_package + ".runner").run_server
    engine = spec.build if args.design == "thread" else spec
    kw = dict(host="127.0.0.1", port=0, api_key=None, max_body_bytes=1 << 20, max_waiting=1024,
              drain_timeout_s=5.0, log_level="warning")
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
        error = run_server(engine, pipeline, MODEL, **kw)
        prof.disable()
        prof.dump_stats(args.profile)
    else:
        error = run_server(engine, pipeline, MODEL, **kw)
    if error is not None:
        raise SystemExit(f"error: {error}")


def start_server(args: argparse.Namespace, trace: Path) -> tuple[subprocess.Popen, str, Path]:
    from nanoqwen_cli.server.engine_worker import TRACE_ENV

    log = Path(tempfile.mkstemp(prefix="overhead-sim-", suffix=".log")[1])
    env = dict(os.environ, **{TRACE_ENV: str(trace)})
    if args.pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([args.pythonpath, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, __file__, "--serve", "--server-package", args.server_package, "--design",
           args.design, "--busy-ms", str(args.busy_ms), "--sleep-ms", str(args.sleep_ms), "--clients",
           str(args.clients), "--spins", str(args.spins), "--prefill-ms", str(args.prefill_ms),
           "--prefill-spins", str(args.prefill_spins)]
    if args.profile:
        cmd += ["--profile", args.profile]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        m = READY.search(log.read_text())
        if m:
            return proc, m.group(1), log
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        time.sleep(0.1)
    proc.kill()
    raise TimeoutError(log.read_text())


# ---- the two measurements -----------------------------------------------------------------------------
def engine_run(args: argparse.Namespace) -> dict:
    from nanoqwen_runtime.engine.sequence import Request
    from nanoqwen_runtime.sampling import SamplingParams

    spec = fake_spec(args)
    eng = spec.build()
    reqs = [Request(prompt(i), SamplingParams(max_tokens=args.max_tokens), request_id=f"r{i}",
                    ignore_eos=True) for i in range(args.clients)]
    t0 = time.perf_counter()
    tokens = sum(ev.num_generated for ev in eng.generate(reqs) if hasattr(ev, "num_generated"))
    wall = time.perf_counter() - t0
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "steps": eng.steps,
            "prefill_steps": eng.num_steps["prefill"]}


async def one_stream(client: httpx.AsyncClient, url: str, i: int, max_tokens: int) -> int:
    body = {"model": MODEL, "prompt": prompt(i), "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    parts = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for b in r.aiter_raw():  # no per-line work in the client: it shares this machine's cores
            parts.append(b)
    events = b"".join(parts).split(b"\n\n")
    if events[-2] != b"data: [DONE]":
        raise RuntimeError(f"stream did not end with [DONE]: {events[-3:]!r}")
    usage = json.loads(events[-3][6:])["usage"]
    return usage["completion_tokens"]


async def http_run(url: str, n: int, max_tokens: int, client_kind: str) -> dict:
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        lean = LeanClient(url, MODEL)
        if client_kind == "raw":
            async def one(i: int, m: int) -> int:
                res = await lean.stream(prompt(i), m)
                if not res.ok:
                    raise RuntimeError(f"stream {i}: {res.error}")
                return res.completion_tokens
        else:
            def one(i: int, m: int):
                return one_stream(client, url, i, m)
        # warm: one connection per client (opening 32 TCP connections is client set-up, not serving)
        await asyncio.gather(*(one(90_000 + i, 4) for i in range(n)))
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(i, max_tokens) for i in range(n)))
        wall = time.perf_counter() - t0
        await lean.close()
    if counts != [max_tokens] * n:
        raise RuntimeError(f"streams generated {counts}, not {max_tokens} each")
    return {"tokens": sum(counts), "wall_s": wall, "tok_s": sum(counts) / wall, "window": (t0, t0 + wall)}


def admission(trace: Path, http: list[dict]) -> list[dict] | None:
    """Per HTTP run, from the engine process's step trace (`step_trace.breakdown`): its wall time split
    into prefill and decode steps, the work around them and idle time (ms), when the first submit was
    applied (ms from the first send), the engine iterations that applied submits, the pipe messages
    that carried them and their arrival spread (ms); None without a trace (the server wrote none)."""
    if not trace.exists() or not trace.stat().st_size:
        return None
    rows = read_trace(trace)
    keys = ("prefill_steps", "prefill_ms", "decode_steps", "decode_step_ms", "around_ms", "idle_ms",
            "first_submit_ms", "submit_rows", "submit_msgs", "submit_spread_ms")
    return [{"wall_ms": round(1e3 * r["wall_s"], 1), **{k: b[k] for k in keys}}
            for r, b in ((r, breakdown(rows, *r["window"])) for r in http)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--busy-ms", type=float, default=1.5)
    ap.add_argument("--sleep-ms", type=float, default=1.5)
    ap.add_argument("--prefill-ms", type=float, default=0.0, help="a prefill step's busy time (0: none)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--server-package", default="nanoqwen_cli.server")
    ap.add_argument("--design", choices=("process", "thread"), default="process")
    ap.add_argument("--pythonpath", default=None, help="prepended to the server's PYTHONPATH")
    ap.add_argument("--client", choices=("httpx", "raw"), default="httpx",
                    help="the load generator: httpx.AsyncClient streams, or lean_client.LeanClient")
    ap.add_argument("--profile", default=None)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--spins", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prefill-spins", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve(args)
        return 0
    from nanoqwen_cli.server.fake_engine import calibrate

    args.spins = calibrate(args.busy_ms / 1e3)  # one busy loop for both engines: the same work per step
    args.prefill_spins = calibrate(args.prefill_ms / 1e3)
    engine = [engine_run(args) for _ in range(args.repeats)]
    trace = Path(tempfile.mkstemp(prefix="overhead-sim-trace-", suffix=".jsonl")[1])
    proc, url, log = start_server(args, trace)
    try:
        http = [asyncio.run(http_run(url, args.clients, args.max_tokens, args.client))
                for _ in range(args.repeats)]
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    e = statistics.median(r["tok_s"] for r in engine)
    h = statistics.median(r["tok_s"] for r in http)
    report = {"design": args.design, "server_package": args.server_package, "clients": args.clients,
              "max_tokens": args.max_tokens, "client": args.client, "busy_ms": args.busy_ms,
              "sleep_ms": args.sleep_ms, "prefill_ms": args.prefill_ms, "spins": args.spins,
              "cpu_count": os.cpu_count(), "engine_tok_s": [round(r["tok_s"], 1) for r in engine],
              "http_tok_s": [round(r["tok_s"], 1) for r in http], "ratio": round(h / e, 4),
              "engine_prefill_steps": [r["prefill_steps"] for r in engine],
              "http_admission": admission(trace, http), "server_exit_code": code}
    print(json.dumps(report))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    if code != 0:
        print(log.read_text(), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
