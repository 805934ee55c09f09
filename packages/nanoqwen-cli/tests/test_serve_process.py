"""The engine in its own process (server/engine_process.py, engine_worker.py): what happens when it dies,
fails to load, or is stopped, and that no engine process outlives the server.

In-process tests drive `EngineProcess` with the model-free `FakeEngineSpec` (a spawned child that loads
in ~1 s); the CLI tests run `nanoqwen-cli serve` on the tiny random container."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import httpx
import pytest
from nanoqwen_cli.server.app import AppConfig, create_app
from nanoqwen_cli.server.engine_process import EngineProcess, Finish, NotReady
from nanoqwen_cli.server.fake_engine import TOKEN_TEXT, FakeEngineSpec
from nanoqwen_cli.server.metrics import Metrics
from nanoqwen_cli.server.sse import Framer, sse
from nanoqwen_cli.server.testing import ServerProcess
from nanoqwen_runtime.engine.sequence import Request
from nanoqwen_runtime.sampling import SamplingParams
from nanoqwen_runtime.testing import write_tiny_container

NAME = "tiny"


def gone(pid: int) -> bool:
    """True when no process `pid` exists (not even a zombie: the server reaped it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def request(rid: str, max_tokens: int) -> Request:
    return Request([1, 2, 3], SamplingParams(max_tokens=max_tokens), request_id=rid)


async def started(spec: FakeEngineSpec, max_waiting: int = 8) -> EngineProcess:
    loop = EngineProcess(spec, Metrics(), max_waiting=max_waiting)
    loop.start(asyncio.get_running_loop())
    await asyncio.to_thread(loop.ready.wait, 120)
    assert loop.info is not None and loop.load_error is None, loop.load_error
    assert loop.info.description.startswith("fake engine (test only)")  # the spec's engine runs
    return loop


async def drain_queue(handle) -> list:
    evs = [await asyncio.wait_for(handle.queue.get(), 30)]
    while type(evs[-1]) is not Finish:
        evs.append(await asyncio.wait_for(handle.queue.get(), 30))
    return evs


def test_requests_stream_and_drain_stops_the_child():
    """Two requests run to their max_tokens (one str per token, then Finish "length"); a third, still
    running when the drain's grace (0 s) ends, is aborted; the child exits 0 and is reaped."""

    async def main():
        loop = await started(FakeEngineSpec(busy_s=0.0, sleep_s=0.001))
        a, b = loop.submit(request("a", 5)), loop.submit(request("b", 7))
        ea, eb = await drain_queue(a), await drain_queue(b)
        assert ea[:-1] == [TOKEN_TEXT] * 5 and ea[-1].reason == "length" and ea[-1].num_generated == 5
        assert eb[:-1] == [TOKEN_TEXT] * 7 and eb[-1].num_generated == 7 and eb[-1].num_prompt_tokens == 3
        long = loop.submit(request("c", 10**6))
        assert type(await asyncio.wait_for(long.queue.get(), 30)) is str  # it runs
        pid = loop.engine_pid
        await loop.drain(0.0)
        rest = await drain_queue(long)
        assert rest[-1].reason == "aborted" and loop.failure is None
        assert loop._proc.exitcode == 0 and gone(pid)

    asyncio.run(main())


def test_child_death_ends_live_requests_with_an_error_and_health_says_why():
    """SIGKILL to the engine process: the running request's last event is an error Finish naming the
    signal, `on_failure` runs once, /health answers 503 with the reason, new requests get NotReady."""

    async def main():
        loop = await started(FakeEngineSpec(busy_s=0.0, sleep_s=0.001))
        failures = []
        loop.on_failure = failures.append
        app = create_app(AppConfig(model_name=NAME, pipeline=None), loop)
        h = loop.submit(request("x", 10**6))
        assert type(await asyncio.wait_for(h.queue.get(), 30)) is str
        pid = loop.engine_pid
        os.kill(pid, signal.SIGKILL)
        last = (await drain_queue(h))[-1]
        assert last.reason == "error" and "killed by SIGKILL" in last.detail, last
        await asyncio.sleep(0)  # on_failure runs in the same callback, after the events are queued
        assert failures == [loop.failure] and "the engine process died (killed by SIGKILL)" == loop.failure
        with pytest.raises(NotReady, match="killed by SIGKILL"):
            loop.submit(request("y", 1))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
            r = await c.get("/health")
        assert r.status_code == 503 and r.json() == {"status": "error", "message": loop.failure,
                                                     "engine_pid": pid}
        await loop.drain(0.0)
        assert gone(pid)

    asyncio.run(main())


def test_waiting_count_includes_submits_in_the_pipe():
    """max_waiting 2: two submits fill the waiting count at once, before the engine has applied them
    (they are counted while in the pipe), so the third is refused (QueueFull)."""
    from nanoqwen_cli.server.engine_process import QueueFull

    async def main():
        loop = await started(FakeEngineSpec(busy_s=0.0, sleep_s=0.001, max_batch=1), max_waiting=2)
        hs = [loop.submit(request(f"r{i}", 10**6)) for i in range(2)]
        with pytest.raises(QueueFull):
            loop.submit(request("r2", 1))
        assert loop.waiting() == 2
        await loop.drain(0.0)
        for h in hs:
            assert (await drain_queue(h))[-1].reason == "aborted"

    asyncio.run(main())


@pytest.mark.parametrize("text", ["", "plain", 'quo"te\\', "ünïcödé 字", "line\nbreak\ttab", "\x00\x1f",
                                  "\x00nanoqwen-slot\x00"])
def test_framer_bytes_equal_the_whole_chunk_encoded(text):
    """The streamed chunk framed around the JSON-encoded text is byte for byte the chunk encoded whole,
    also when the model name holds the slot's characters."""
    model = "m\x00nanoqwen-slot\x00"
    for choice in ({"index": 0, "delta": {"content": Framer.SLOT}, "logprobs": None, "finish_reason": None},
                   {"index": 0, "text": Framer.SLOT, "logprobs": None, "finish_reason": None}):
        template = {"id": "x", "object": "o", "created": 1, "model": model, "choices": [choice]}
        whole = json.loads(json.dumps(template).replace(json.dumps(Framer.SLOT), json.dumps(text)))
        whole["model"] = model
        assert Framer(template)(text) == sse(whole)


# ---- through the CLI ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_container(tmp_path_factory.mktemp("serve-proc") / f"{NAME}.nanoqwen", method="rtn",
                                seed=5)


def test_engine_death_mid_stream_error_chunk_and_exit_1(model):
    """Kill the engine process while a stream runs: the client gets an error chunk in the OpenAI shape
    and [DONE], the server exits 1 by itself with one line saying how the engine died, and the engine
    process is gone (reaped). The request wants 250 tokens, ~0.4 s of decode on this model; the kill
    comes right after its first chunk."""
    srv = ServerProcess(model, "--threads", "1").start()
    try:
        health = httpx.get(srv.url + "/health").json()
        assert health["status"] == "ok"
        pid = health["engine_pid"]
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                          json={"model": NAME, "prompt": [5], "max_tokens": 250, "ignore_eos": True,
                                "stream": True}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: ")).startswith('data: {"id"')
            os.kill(pid, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        err = json.loads(rest[-2][6:])["error"]
        assert err["code"] == "model_error" and "killed by SIGKILL" in err["message"], rest[-2]
        code = srv.proc.wait(60)
    finally:
        srv.terminate()
    assert code == 1, srv.log()
    errors = [line for line in srv.log().splitlines() if line.startswith("error:")]
    assert errors == ["error: the engine process died (killed by SIGKILL); the server stopped"], srv.log()
    assert gone(pid)


def test_load_error_is_one_line_and_exit_1(model, tmp_path):
    """A container whose tensor data is corrupt opens (the HTTP process reads only its metadata and
    tokenizer) but fails the checksum in the engine process: one line, exit 1, no engine left."""
    bad = tmp_path / "bad.nanoqwen"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the tensor data (the metadata and tokenizer come first)
    bad.write_bytes(bytes(data))
    r = subprocess.run([sys.executable, "-m", "nanoqwen_cli.main", "serve", str(bad), "--port", "0",
                        "--log-level", "warning"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr
    assert errors[0].startswith("error: the model failed to load: ChecksumError"), r.stderr
    assert "Traceback" not in r.stderr


# ---- the engine process's loop: step trace, admission window, sends inside the next step -------------
def test_step_trace_rows_account_for_every_submit_and_token(tmp_path, monkeypatch):
    """With NANOQWEN_ENGINE_TRACE set, the child writes one row per loop iteration when it stops: the
    submits and tokens in the rows add up to what was sent and generated, and each row's times are in
    order (woke <= step start <= step end <= message handed over)."""
    from nanoqwen_cli.server.engine_worker import TRACE_ENV

    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv(TRACE_ENV, str(path))  # the spawned child inherits the environment

    async def main():
        loop = await started(FakeEngineSpec(busy_s=0.0, sleep_s=0.001))
        handles = [loop.submit(request(f"r{i}", 3 + i)) for i in range(4)]
        for h in handles:
            await drain_queue(h)
        await loop.drain(1.0)

    asyncio.run(main())
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert sum(r["n_submits"] for r in rows) == 4
    assert sum(r["n_tokens"] for r in rows) == 3 + 4 + 5 + 6
    for r in rows:
        assert r["t_wake"] <= r["t_done"] <= r["t_sent"]
        if r["t_step"] is not None:
            assert r["t_wake"] <= r["t_step"] <= r["t_done"]
    assert all(a["t_sent"] <= b["t_wake"] for a, b in zip(rows, rows[1:], strict=False))


def _pipe_worker():
    import multiprocessing

    from nanoqwen_cli.server import engine_worker

    here, there = multiprocessing.Pipe(duplex=True)
    return engine_worker, engine_worker._Worker(engine=None, conn=here), there


def _submit_bytes(i: int) -> bytes:
    import pickle

    return pickle.dumps(("submit", i), pickle.HIGHEST_PROTOCOL)


def test_admission_window_takes_a_burst_and_stops_when_quiet(monkeypatch):
    """Commands already in the pipe are all taken; then the window closes after ADMIT_QUIET_S without
    a command, long before ADMIT_MAX_S."""
    import time

    ew, worker, there = _pipe_worker()
    monkeypatch.setattr(ew, "ADMIT_QUIET_S", 0.05)
    monkeypatch.setattr(ew, "ADMIT_MAX_S", 30.0)
    for i in range(1, 6):
        there.send_bytes(_submit_bytes(i))
    cmds = [("submit", 0)]
    t0 = time.perf_counter()
    worker._admit_burst(cmds)
    elapsed = time.perf_counter() - t0
    assert cmds == [("submit", i) for i in range(6)]
    assert 0.05 <= elapsed < 10.0


def test_admission_window_closes_at_its_maximum_while_commands_keep_coming(monkeypatch):
    """A feeder sends a command every 10 ms for 2 s; with a quiet gap of 0.5 s and a maximum of 0.3 s
    the window closes at the maximum, with the commands that came until then, in order."""
    import threading
    import time

    ew, worker, there = _pipe_worker()
    monkeypatch.setattr(ew, "ADMIT_QUIET_S", 0.5)
    monkeypatch.setattr(ew, "ADMIT_MAX_S", 0.3)
    stop = threading.Event()

    def feed():
        i = 1
        while not stop.is_set() and i < 200:
            there.send_bytes(_submit_bytes(i))
            i += 1
            time.sleep(0.01)

    feeder = threading.Thread(target=feed)
    cmds = [("submit", 0)]
    feeder.start()
    t0 = time.perf_counter()
    try:
        worker._admit_burst(cmds)
        elapsed = time.perf_counter() - t0
    finally:
        stop.set()
        feeder.join()
    assert 0.3 <= elapsed < 1.5, elapsed
    assert 2 <= len(cmds) < 199
    assert cmds == [("submit", i) for i in range(len(cmds))]


def test_worker_sends_each_step_message_during_the_next_step(monkeypatch):
    """The engine process's loop sends a step's message from inside the next step (`side_work`: after
    a decode step's host work, before its device wait), in order, and the last one at once when the
    engine goes idle: every token arrives, each message once, the last before the loop waits for
    commands."""
    import pickle
    import threading

    ew, worker, there = _pipe_worker()
    engine = FakeEngineSpec(busy_s=0.0, sleep_s=0.002).build()
    worker.engine = engine
    sent = []  # (engine steps begun when the message was sent, message kind, tokens in it)
    real_send = ew._send

    def send(conn, msg):
        sent.append((engine.steps, msg[0], len(msg[2]) if msg[0] == "step" else None))
        return real_send(conn, msg)

    monkeypatch.setattr(ew, "_send", send)
    loop = threading.Thread(target=worker.run)
    there.send_bytes(pickle.dumps(("batch", [("submit", request("a", 4)), ("submit", request("b", 6))]),
                                  pickle.HIGHEST_PROTOCOL))
    loop.start()
    msgs, finished = [], set()
    while finished != {"a", "b"}:
        msgs.append(pickle.loads(there.recv_bytes()))
        finished |= {f.request_id for f in msgs[-1][3]}
    there.send_bytes(pickle.dumps(("stop",), pickle.HIGHEST_PROTOCOL))
    msgs.append(pickle.loads(there.recv_bytes()))
    loop.join(30)
    assert not loop.is_alive()
    steps = [m for m in msgs if m[0] == "step"]
    assert sum(len(m[2]) for m in steps) == 4 + 6
    assert [rid for m in steps for rid, _ in m[2]].count("a") == 4
    assert msgs[0][1] == 2  # the two submits, counted in the first step's message
    # message k (of step k) went out while step k + 1 ran; the last step's as soon as nothing followed
    step_msgs = [s for s in sent if s[1] == "step" and s[2]]
    assert [s[0] for s in step_msgs] == list(range(2, engine.steps + 1)) + [engine.steps]


def test_worker_stops_when_the_pipe_is_closed():
    """The HTTP process gone (its end of the pipe closed): the loop returns, and a send that fails marks
    the worker broken (the loop checks it before every iteration) and drops the message."""
    import pickle

    ew, worker, there = _pipe_worker()
    worker.engine = FakeEngineSpec(busy_s=0.0, sleep_s=0.0).build()
    there.send_bytes(pickle.dumps(("submit", request("a", 50)), pickle.HIGHEST_PROTOCOL))
    there.close()
    worker.run()  # returns: the pipe's end of file
    worker.pending = ("step", 0, [("a", "x")], [], None)
    worker.flush()
    assert worker.broken and worker.pending is None


def test_fake_engine_prefill_is_a_step_of_its_own():
    """With prefill_s > 0 the fake engine schedules like the CUDA engine: a prefill step (after a decode,
    or with nothing running) emits only the admitted requests' first tokens; decode steps emit one
    token per running request. With prefill_s = 0 new requests get their first token in a decode."""

    def step(eng):
        return [(ev.request, ev.index) for ev in eng.step() if hasattr(ev, "index")]

    eng = FakeEngineSpec(busy_s=0.0, sleep_s=0.0, prefill_s=1e-4).build()
    eng.submit(request("a", 3))
    eng.submit(request("b", 3))
    assert step(eng) == [("a", 0), ("b", 0)]
    eng.submit(request("c", 3))
    assert step(eng) == [("a", 1), ("b", 1)]            # a decode comes first after a prefill
    assert step(eng) == [("c", 0)]                      # then c's prefill: the others wait
    assert step(eng) == [("a", 2), ("b", 2), ("c", 1)]  # a and b end
    assert eng.num_steps == {"prefill": 2, "decode": 2}
    legacy = FakeEngineSpec(busy_s=0.0, sleep_s=0.0).build()
    legacy.submit(request("a", 3))
    assert step(legacy) == [("a", 0)] and legacy.num_steps == {"prefill": 0, "decode": 1}


def test_writer_sends_what_is_queued_as_one_batch():
    """Commands queued while the writer thread waited go out as one ("batch", [...]) message, in order,
    and the worker reads it back as those commands; a lone command goes as itself; None ends it."""
    import multiprocessing
    import pickle

    from nanoqwen_cli.server import engine_worker as ew

    here, there = multiprocessing.Pipe(duplex=True)
    loop = EngineProcess(FakeEngineSpec(), Metrics(), max_waiting=8)
    loop._conn = here
    cmds = [("submit", i) for i in range(5)] + [("abort", "r1")]
    for c in cmds:
        loop._outbox.put(c)
    loop._outbox.put(None)
    loop._write()  # runs until the None: everything before it in one message
    msg = pickle.loads(there.recv_bytes())
    assert msg == ("batch", cmds)
    assert not there.poll(0.1)
    there.send_bytes(pickle.dumps(msg))
    assert ew._recv(here) == cmds
    there.send_bytes(pickle.dumps(("stop",)))
    assert ew._recv(here) == [("stop",)]
