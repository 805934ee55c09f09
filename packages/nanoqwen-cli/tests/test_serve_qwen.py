"""`nanoqwen-cli serve --device cpu` on the real Qwen2.5-Coder-0.5B (RTN INT4), driven by the official
`openai` client: chat streaming and not, generated code that parses, 16 concurrent clients, a client
that disconnects mid-stream (its KV blocks come back), logprobs and echo against a dense forward, n
choices (the prompt prefilled once), and a SIGTERM drain (the engine process is
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


# ---- logprobs, echo, n > 1 (server/choices.py) ------------------------------------------------------
# The CPU server's engine is the fp32 reference engine (paged K/V, chunked prefill, decode one token
# per step). The oracle is an independent plain-torch forward of the same container: one dense causal
# pass over the whole sequence (nanoqwen_model.forward with dense_attend). Both are fp32 and differ only
# in summation order: ~100 matmul stages of ~sqrt(K) * 2^-24 ~ 4e-6 relative each, a random walk of
# ~4e-5 relative; logits reach ~30: 1.2e-3, bound 2e-3 on a logit (nanoqwen-runtime
# test_engine_real_gpu.py derives the same for fp32 vs HF). A log-softmax moves by at most twice the
# largest logit change (log-sum-exp is 1-Lipschitz in the max norm): LOGPROB_BOUND.
LOGPROB_BOUND = 2 * 2e-3


@pytest.fixture(scope="module")
def dense_logprobs(qwen05b_packed):
    """ids -> f32 [len(ids), V]: the log-softmax of a dense fp32 forward over `ids` at every position."""
    import torch
    from nanoqwen_model.forward import dense_attend, forward
    from nanoqwen_runtime.reference import load_weights

    cfg, w = load_weights(qwen05b_packed("rtn"), dtype=torch.float32)

    def run(ids: list[int]):
        with torch.inference_mode():
            lg = forward(cfg, w, torch.tensor(ids), torch.arange(len(ids)), dense_attend(1, len(ids)))
        return torch.log_softmax(lg, dim=-1)
    return run


def test_echo_logprobs_match_a_dense_forward(server, dense_logprobs):
    """lm-evaluation-harness's loglikelihood request: token-id prompt, echo, logprobs, max_tokens 1 and
    0. The prompt's logprobs (the first null) and the generated token's match the dense forward."""
    ids = [750, 15801, 1445, 982, 262, 470, 308, 353, 2240, 1445, 481, 220, 16, 8, 421, 308, 861, 220, 16]
    want = dense_logprobs(ids)
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": "qwen-coder", "prompt": ids, "echo": True, "logprobs": 2, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for j in range(1, len(ids)):
        assert abs(lp["token_logprobs"][j] - float(want[j - 1, ids[j]])) <= LOGPROB_BOUND, j
        tops = sorted(lp["top_logprobs"][j].values(), reverse=True)[:2]
        assert all(abs(a - b) <= LOGPROB_BOUND for a, b in zip(tops, want[j - 1].topk(2).values.tolist(),
                                                            strict=True))
    last = want[-1]  # greedy: the generated token is the argmax
    assert abs(lp["token_logprobs"][-1] - float(last.max())) <= LOGPROB_BOUND
    assert lp["text_offset"][0] == 0 and body["choices"][0]["text"].startswith(
        "".join(lp["tokens"][:len(ids)]))
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1}
    r0 = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": "qwen-coder", "prompt": ids, "echo": True, "logprobs": 2, "max_tokens": 0}).json()
    lp0 = r0["choices"][0]["logprobs"]
    assert lp0["token_logprobs"] == lp["token_logprobs"][:len(ids)]  # the prompt alone, same values
    assert r0["usage"]["completion_tokens"] == 0 and r0["choices"][0]["finish_reason"] == "length"


def test_chat_logprobs_shape_and_stream(client):
    kw = {"model": "qwen-coder", "temperature": 0, "max_tokens": 4, "logprobs": True, "top_logprobs": 3,
          "messages": [{"role": "user", "content": "Say hi."}]}
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 4
    for e in content:  # greedy: the token is the most likely one
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == e.logprob <= 0
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
    assert "".join(e.token for e in content) == r.choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_n_choices_prefill_the_prompt_once(client, server):
    """n=4 sampled choices: four distinct texts, usage and the metrics count the prompt once (and the
    request once), and the prefix cache shows the prompt's full blocks computed once (choices 1..3
    take them from the cache); the seeds are seed + i (choice 2 alone with seed + 2 repeats it)."""
    prompt = ("# n-choices test: a Python module of small string helpers (slugs, case conversion, padding)\n"
              "import re\nimport unicodedata\n\n\ndef slugify(text: str) -> str:")
    hits = "nanoqwen_prefix_cache_hit_tokens_total"
    queried = "nanoqwen_prefix_cache_queried_tokens_total"
    before = server.metrics()
    kw = {"model": "qwen-coder", "prompt": prompt, "max_tokens": 4, "temperature": 1.0, "seed": 11}
    r = client.completions.create(**kw, n=4)
    after = server.metrics()
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and len(set(texts)) == 4, texts
    n_prompt = r.usage.prompt_tokens
    assert n_prompt > 32 and r.usage.completion_tokens == 4 * 4
    full = (n_prompt - 1) // 16 * 16  # the full blocks a later choice can take (one token is computed)
    assert after[queried] - before.get(queried, 0.0) == 4 * n_prompt
    assert after[hits] - before.get(hits, 0.0) == 3 * full  # choice 0 prefilled it, 1..3 took it
    def grew(name):
        return after[name] - before.get(name, 0.0)

    assert grew('nanoqwen_requests_total{status="length"}') == 1
    assert grew("nanoqwen_prompt_tokens_total") == n_prompt
    assert grew("nanoqwen_generation_tokens_total") == 16
    assert client.completions.create(**{**kw, "seed": 13}).choices[0].text == texts[2]
    chunks = list(client.completions.create(**kw, n=2, stream=True, stream_options={"include_usage": True},
                                            logprobs=1))
    got = {0: "", 1: ""}
    lp: dict[int, list] = {0: [], 1: []}
    for c in chunks:
        for ch in c.choices:
            got[ch.index] += ch.text
            if ch.logprobs is not None:
                lp[ch.index] += ch.logprobs.token_logprobs
    assert [got[0], got[1]] == texts[:2]  # reproducible, streamed or not
    assert len(lp[0]) == len(lp[1]) == 4 and all(x <= 0 for x in lp[0] + lp[1])  # one per token
    assert chunks[-1].usage.prompt_tokens == n_prompt and chunks[-1].usage.completion_tokens == 8


def test_disconnect_aborts_every_choice(server):
    """A client that leaves an n=3 stream aborts its three choices: no KV block stays held, and the
    request counts once as aborted."""
    aborted = server.metrics().get('nanoqwen_requests_total{status="aborted"}', 0.0)
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                      json={"model": "qwen-coder", "prompt": "def long_function():", "max_tokens": 500,
                            "n": 3, "stream": True, "temperature": 1.0}) as r:
        assert r.status_code == 200
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert '"text"' in first
    assert server.wait_metric("nanoqwen_kv_blocks_used", 0.0) == 0.0
    assert server.wait_metric('nanoqwen_requests_total{status="aborted"}', aborted + 1) == aborted + 1
    assert server.metric("nanoqwen_requests_running") == 0


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
