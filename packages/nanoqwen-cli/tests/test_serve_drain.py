"""SIGTERM drains a real server process (server/runner.py): it keeps listening, /health answers 503
"draining", new requests get a 503 in the OpenAI error shape, the running stream completes (or is
aborted at --drain-timeout), one log line says that draining started and one how it ended, exit 0.

The server is `run_server` in a subprocess with the fake engine (server/fake_engine.py), whose `gate`
file holds a request's last token back: the stream stays in flight until the test has checked the
drain, then the test creates the file and the request finishes. Every wait is for an event: a line of
the server's stderr, the stream's next chunk, the process's exit."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from nanoqwen_runtime.testing import write_tiny_container

NAME = "tiny"
WAIT_S = 60.0  # an upper bound on any one event (a busy 2-core machine), never a wait in itself

SERVER = """
import sys
from nanoqwen_cli.server.fake_engine import FakeEngineSpec
from nanoqwen_cli.server.runner import run_server
from nanoqwen_runtime.generate import Pipeline

model, gate, drain_timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
pipeline = Pipeline.from_container(model, backend=None)
error = run_server(FakeEngineSpec(busy_s=0.0, sleep_s=0.002, gate=gate), pipeline, "tiny", host="127.0.0.1",
                   port=0, api_key=None, max_body_bytes=1 << 20, max_waiting=8, drain_timeout_s=drain_timeout,
                   log_level="warning")
sys.exit(1 if error is not None else 0)
"""


class Server:
    """The server subprocess; its stderr lines arrive on a queue (a reader thread)."""

    def __init__(self, model: Path, gate: Path, drain_timeout_s: float):
        cmd = [sys.executable, "-c", SERVER, str(model), str(gate), str(drain_timeout_s)]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        ready = self.wait_line("ready on http://")
        self.url = ready.split("ready on ")[1].removesuffix("/v1")

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_line(self, text: str) -> str:
        """The next stderr line holding `text` (the lines before it are kept in `log`)."""
        while True:
            line = self.lines.get(timeout=WAIT_S)
            if line is None:
                raise AssertionError(f"the server exited before printing {text!r}:\n" + "\n".join(self.log))
            self.log.append(line)
            if text in line:
                return line

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(WAIT_S)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_container(tmp_path_factory.mktemp("drain") / f"{NAME}.nanoqwen", method="rtn", seed=5)


def _stream(url: str, max_tokens: int):
    return httpx.stream("POST", url + "/v1/completions", timeout=WAIT_S,
                        json={"model": NAME, "prompt": [5], "max_tokens": max_tokens, "stream": True})


def _data(lines) -> str:
    return next(line for line in lines if line.startswith("data: "))


def test_sigterm_drains_a_running_stream_then_exits_0(model, tmp_path):
    gate = tmp_path / "gate"
    srv = Server(model, gate, drain_timeout_s=300.0)
    try:
        with _stream(srv.url, 20) as r:
            lines = r.iter_lines()
            first = json.loads(_data(lines)[6:])["choices"][0]["text"]  # admitted, running
            assert first and set(first.split()) == {"t"}, first
            srv.proc.send_signal(signal.SIGTERM)
            started = srv.wait_line("draining")
            want = "SIGTERM: draining: 1 running request gets up to 300 s to finish; new requests get 503"
            assert want in started, started
            health = httpx.get(srv.url + "/health", timeout=WAIT_S)  # still listening
            assert health.status_code == 503 and health.json()["status"] == "draining"
            new = httpx.post(srv.url + "/v1/completions", timeout=WAIT_S,
                             json={"model": NAME, "prompt": [5], "max_tokens": 2})
            assert new.status_code == 503
            err = new.json()["error"]
            assert set(err) >= {"message", "type", "code"} and err["type"] == "server_error", err
            assert "shutting down" in err["message"]
            gate.touch()  # the running request may finish now
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in rest[:-1]]
        text = first + "".join(c["choices"][0]["text"] for c in chunks)
        assert text == " t" * 20 and chunks[-1]["choices"][0]["finish_reason"] == "length"
        ended = srv.wait_line("drained")
        assert "drained: all 1 request finished in" in ended, ended
        assert srv.proc.wait(WAIT_S) == 0
    finally:
        srv.stop()
    assert sum("draining" in line for line in srv.log) == 1 and sum("drain" in line for line in srv.log) == 2


def test_drain_timeout_aborts_what_still_runs_and_says_so(model, tmp_path):
    srv = Server(model, tmp_path / "never", drain_timeout_s=0.5)
    try:
        with _stream(srv.url, 20) as r:
            lines = r.iter_lines()
            _data(lines)
            srv.proc.send_signal(signal.SIGTERM)
            srv.wait_line("draining")
            ended = srv.wait_line("drain timed out")
            assert "drain timed out after 0.5 s: 1 request aborted" in ended, ended
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"  # the client's stream ends (with the abort's error chunk)
        assert "error" in json.loads(rest[-2][6:]), rest[-2]
        assert srv.proc.wait(WAIT_S) == 0
    finally:
        srv.stop()
