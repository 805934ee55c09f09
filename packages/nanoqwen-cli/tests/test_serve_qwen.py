"""`nanoqwen-cli serve --device cpu` on the real Qwen2.5-Coder-0.5B (RTN INT4), driven by the official
`openai` client: chat streaming and not, generated code that parses, 16 concurrent clients, a client
that disconnects mid-stream (its KV blocks come back), and a SIGTERM drain (the engine process is
stopped and reaped too). One server for the module
(loading takes ~15 s on 2 cores; the fp32 reference decodes a few tokens a second), small max_tokens
everywhere except the code answer."""

from __future__ import annotations

import ast
import concurrent.futures as cf
import json
import os
import re
import socket
import threading

import httpx
import openai
import pytest
from nanoqwen_cli.server.testing import ServerProcess

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def server(qwen05b_packed):
    srv = ServerProcess(qwen05b_packed("rtn"), "--model-name", "qwen-coder", "--max-batch", "16")
    srv.start()
    yield srv
    srv.terminate()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_chat_answer_with_code_parses(client):
    r = client.chat.completions.create(
        model="qwen-coder", temperature=0, max_tokens=80,
        messages=[{"role": "user", "content": "Write a Python function is_even(n) that returns whether n is "
                                              "even. Reply with only the code in a ```python block."}])
    text = r.choices[0].message.content
    m = re.search(r"```(?:python)?\n(.*?)```", text, re.S)
    assert m, text
    tree = ast.parse(m.group(1))
    assert any(isinstance(n, ast.FunctionDef) and n.name == "is_even" for n in ast.walk(tree)), text
    assert r.choices[0].finish_reason == "stop"  # the model ended the answer (EOS), within 80 tokens


def test_streaming_equals_non_streaming(client):
    kw = {"model": "qwen-coder", "temperature": 0, "max_tokens": 6,
          "messages": [{"role": "user", "content": "Say hello."}]}
    whole = client.chat.completions.create(**kw)
    parts = list(client.chat.completions.create(**kw, stream=True))
    text = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
    assert text == whole.choices[0].message.content  # greedy: the same tokens either way
    comp = client.completions.create(model="qwen-coder", prompt="def fib(n):", max_tokens=4, temperature=0)
    assert comp.usage.completion_tokens == 4 and comp.choices[0].finish_reason == "length"


def test_sixteen_concurrent_clients(client, server):
    """16 clients at once, half streaming: every one completes with its own greedy answer (the same
    prompt alone and batched give the same tokens: fp32, see nanoqwen-runtime test_generate)."""
    prompts = [f"def f{i}(x):" for i in range(16)]

    def one(i):
        kw = {"model": "qwen-coder", "prompt": prompts[i], "max_tokens": 3, "temperature": 0}
        if i % 2:
            chunks = list(client.completions.create(**kw, stream=True))
            return "".join(c.choices[0].text for c in chunks if c.choices)
        return client.completions.create(**kw).choices[0].text

    before = server.metric('nanoqwen_requests_total{status="length"}') if _has(server, "length") else 0.0
    with cf.ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(one, range(16)))
    assert all(t for t in texts)
    assert server.metric('nanoqwen_requests_total{status="length"}') - before == 16
    assert client.completions.create(model="qwen-coder", prompt=prompts[5], max_tokens=3,
                                      temperature=0).choices[0].text == texts[5]
    assert server.wait_metric("nanoqwen_kv_blocks_used", 0.0) == 0.0


def test_disconnect_mid_stream_frees_kv_blocks(server):
    aborted = server.metrics().get('nanoqwen_requests_total{status="aborted"}', 0.0)
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                      json={"model": "qwen-coder", "prompt": "def long_function():", "max_tokens": 500,
                            "stream": True, "temperature": 0}) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert '"text"' in first
        assert server.metric("nanoqwen_kv_blocks_used") > 0  # it is running
    # the client closed the connection: the request is aborted at the next step, its blocks freed (the
    # counter is counted after the step's gauges are published: wait for it first)
    assert _wait_aborted(server, aborted + 1) == aborted + 1
    assert server.wait_metric("nanoqwen_kv_blocks_used", 0.0) == 0.0
    assert server.metric("nanoqwen_requests_running") == 0


def test_disconnect_while_waiting_for_a_non_streamed_answer(server):
    """A client that goes away while its non-streamed answer is being generated: the server notices
    within DISCONNECT_POLL_S (0.25 s) plus one engine step, aborts it and frees its blocks. The events,
    in order: the request is admitted (running 1), the client closes its socket, the request is
    counted aborted, its blocks are free."""
    aborted = server.metrics().get('nanoqwen_requests_total{status="aborted"}', 0.0)
    assert server.metric("nanoqwen_requests_running") == 0
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps({"model": "qwen-coder", "prompt": "def long_function():", "max_tokens": 500}).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:  # a client we can close at will
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(body), body))
        assert server.wait_metric("nanoqwen_requests_running", 1.0) == 1.0  # admitted: it holds blocks
        assert server.metric("nanoqwen_kv_blocks_used") > 0
    assert _wait_aborted(server, aborted + 1) == aborted + 1
    assert server.wait_metric("nanoqwen_kv_blocks_used", 0.0) == 0.0


def test_sigterm_drains_in_flight_request_and_exits_zero(server):
    """Last test of the module (it stops the server). A streaming request in flight when SIGTERM
    arrives still finishes (within the default 30 s grace); once the server has exited its port is
closed; exit 0 (test_serve_drain.py checks what the server answers while it drains)."""
    result = {}

    def stream():
        with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                          json={"model": "qwen-coder", "prompt": "import os\n", "max_tokens": 8,
                                "stream": True, "temperature": 0}) as r:
            result["lines"] = [line for line in r.iter_lines() if line]

    engine_pid = httpx.get(server.url + "/health").json()["engine_pid"]
    t = threading.Thread(target=stream)
    t.start()
    assert server.wait_metric("nanoqwen_requests_running", 1.0, timeout_s=60) == 1.0  # admitted
    code = server.terminate()
    t.join(60)
    assert code == 0, server.log()
    lines = result["lines"]
    assert lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in lines[-2]
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=5)
    with pytest.raises(ProcessLookupError):  # the engine process was stopped and reaped: no orphan
        os.kill(engine_pid, 0)


def _wait_aborted(server, value: float) -> float:
    return server.wait_metric('nanoqwen_requests_total{status="aborted"}', value)


def _has(server, status: str) -> bool:
    return f'nanoqwen_requests_total{{status="{status}"}}' in server.metrics()
