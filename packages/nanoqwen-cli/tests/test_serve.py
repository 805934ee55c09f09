"""`nanoqwen-cli serve --device cpu` as a subprocess on a tiny random container: the HTTP surface
(auth, limits, the error shape over HTTP, SSE framing, usage, 429), driven by the official `openai`
client and httpx. The real 0.5B is in test_serve_qwen.py."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re

import httpx
import openai
import pytest
from nanoqwen_cli.server.testing import ServerProcess
from nanoqwen_runtime.testing import write_tiny_container

KEY = "s3cret-key"
NAME = "tiny"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_container(tmp_path_factory.mktemp("serve") / f"{NAME}.nanoqwen", method="rtn", seed=5)


@pytest.fixture(scope="module")
def server(model):
    # speculation on: greedy answers are the same with it (nanoqwen-runtime test_speculative_engine), and
    # /metrics must show its counters
    with ServerProcess(model, "--api-key", KEY, "--max-body", "2KiB", "--threads", "1",
                       "--speculate", "ngram:3") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def post(server, path, body, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers["Content-Type"] = "application/json"
    return httpx.post(server.url + path, content=content, headers=headers, timeout=60, **kw)


def assert_error(r, status, code):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code and err["message"]
    return err


def test_start_line_and_metrics_give_the_same_kv_blocks(server):
    """The start line's KV blocks and /metrics' nanoqwen_kv_blocks_total are one figure: the usable
    blocks (the pool less its padding block). The line also says how many CPU threads and why."""
    line = next(x for x in server.log().splitlines() if "ready on http://" in x)
    blocks = int(re.search(r"(\d+) KV blocks of", line).group(1))
    assert server.metric("nanoqwen_kv_blocks_total") == blocks, line
    assert "; 1 CPU thread (--threads);" in line, line  # the fixture's --threads 1


def test_health_models_and_auth(server):
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    r = httpx.get(server.url + "/v1/models")  # no key
    assert_error(r, 401, "invalid_api_key")
    assert r.headers["www-authenticate"] == "Bearer"
    assert_error(httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}x"}), 401,
                 "invalid_api_key")
    models = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert [m["id"] for m in models["data"]] == [NAME] and models["data"][0]["max_model_len"] == 256
    assert_error(post(server, "/v1/completions", {"model": NAME, "prompt": "a"}, key=None), 401,
                 "invalid_api_key")


def test_bad_input_table_over_http(server):
    """Each status of the issue's table, through the real server (protocol.py has the full table)."""
    cases = [
        (b"{oops", 400, "invalid_json"),
        ({"model": NAME, "prompt": "a", "max_tokens": "many"}, 400, "invalid_value"),
        ({"model": NAME, "prompt": "a", "n": 0}, 400, "invalid_value"),
        ({"model": NAME, "prompt": "a", "logprobs": 21}, 400, "invalid_value"),
        ({"model": NAME, "prompt": "a", "best_of": 2}, 400, "unsupported_parameter"),
        ({"model": "gpt-4o", "prompt": "a"}, 404, "model_not_found"),
        ({"model": NAME, "prompt": "x" * 3000}, 413, "request_too_large"),        # --max-body 2KiB
        ({"model": NAME, "prompt": [5] * 300}, 400, "context_length_exceeded"),  # context 256
        ({"model": NAME, "prompt": [10**9]}, 400, "invalid_value"),
    ]
    for body, status, code in cases:
        err = assert_error(post(server, "/v1/completions", body), status, code)
        if code == "context_length_exceeded":
            assert "300 tokens" in err["message"] and "256 tokens" in err["message"]
    err = assert_error(post(server, "/v1/chat/completions",
                            {"model": NAME, "messages": [{"role": "user", "content": "a"}], "tools": [{}]}),
                       400, "invalid_value")
    assert err["param"] == "tools[0].type"
    assert_error(httpx.get(server.url + "/v1/nothing"), 404, None)
    # the server is still fine and counted them
    assert server.metric('nanoqwen_requests_total{status="400"}') >= 6


def test_fill_in_the_middle_refused_without_fim_tokens(server):
    """The tiny test tokenizer has no FIM tokens: `suffix` and /infill are a 400 that says so (the real
    model's infill is in test_serve_infill_qwen.py)."""
    for path, body in (("/v1/completions", {"model": NAME, "prompt": "def f():", "suffix": "\n    return 1"}),
                       ("/infill", {"input_prefix": "def f():", "input_suffix": "x"})):
        err = assert_error(post(server, path, body), 400, "invalid_value")
        assert "no fill-in-the-middle tokens" in err["message"], path
    assert_error(post(server, "/infill", {"input_prefix": "a"}, key=None), 401, "invalid_api_key")


def test_openai_client_chat_and_completion(client, server):
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hello"}],
                                       max_tokens=6, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens <= 6 and r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    c = client.completions.create(model=NAME, prompt="def add(a, b):", max_tokens=12, temperature=0, seed=1)
    again = client.completions.create(model=NAME, prompt="def add(a, b):", max_tokens=12, temperature=0)
    assert c.choices[0].text == again.choices[0].text  # greedy is deterministic
    # a stop string taken from the greedy text ends it there (and is not shown)
    text = c.choices[0].text
    if c.choices[0].finish_reason == "length" and len(text) >= 6:
        s = client.completions.create(model=NAME, prompt="def add(a, b):", max_tokens=12, temperature=0,
                                      stop=[text[3:6]])
        assert s.choices[0].finish_reason == "stop" and s.choices[0].text == text[: text.find(text[3:6])]


def test_streaming_matches_non_streaming(client):
    kw = {"model": NAME, "messages": [{"role": "user", "content": "count"}], "max_tokens": 10,
          "temperature": 0}
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_sse_framing(server):
    with httpx.stream("POST", server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": NAME, "prompt": "x", "max_tokens": 4, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    events = [e for e in body.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    last = json.loads(events[-2][6:])
    assert last["object"] == "text_completion" and last["choices"][0]["finish_reason"] in ("stop", "length")


def test_prefix_cache_hits_and_speculation_counters_in_metrics(server):
    """Two requests whose 101-token prompts share their first 100 tokens: the second takes every full
    16-token block of the shared part from the cache. Its lookup covers at most len - 1 = 100 tokens
    (one token must be computed for logits), so the hit is exactly 16 * (100 // 16) = 96 tokens; both
    prompts are looked up whole (202 queried tokens). No other test's prompt starts with the ids
    100, 101, ... (cache keys chain from the first token), so the first request hits nothing."""
    prefix = list(range(100, 200))
    before = server.metrics()
    hit0 = before["nanoqwen_prefix_cache_hit_tokens_total"]
    queried0 = before["nanoqwen_prefix_cache_queried_tokens_total"]
    for last in (7, 9):
        r = post(server, "/v1/completions", {"model": NAME, "prompt": [*prefix, last], "max_tokens": 2,
                                             "temperature": 0})
        assert r.status_code == 200, r.text
    # metrics are published by the engine thread after each step: wait for the last one
    assert server.wait_metric("nanoqwen_prefix_cache_hit_tokens_total", hit0 + 96) == hit0 + 96
    m = server.metrics()
    assert m["nanoqwen_prefix_cache_queried_tokens_total"] == queried0 + 202
    assert m["nanoqwen_prefix_cache_hit_rate"] == pytest.approx(
        m["nanoqwen_prefix_cache_hit_tokens_total"] / m["nanoqwen_prefix_cache_queried_tokens_total"])
    # the 6 shared full blocks are kept after both requests end (the pool is far from full)
    assert m["nanoqwen_kv_blocks_cached"] >= 6
    spec = [m[f"nanoqwen_spec_{k}_total"] for k in ("verify_steps", "drafted_tokens", "accepted_tokens")]
    assert all(v >= 0 for v in spec) and spec[2] <= spec[1]


@pytest.mark.parametrize("flag,value", [("--speculate", "ngram:9"), ("--speculate", "medusa")])
def test_serve_rejects_bad_speculation(model, flag, value):
    """A bad --speculate value is a usage error (exit 2) before anything is loaded."""
    from nanoqwen_cli.main import app
    from typer.testing import CliRunner

    r = CliRunner().invoke(app, ["serve", str(model), flag, value])
    assert r.exit_code == 2 and "--speculate" in r.output, r.output


def test_serve_dense_weight_cache_is_cuda_only(model):
    """The bf16 weight copy belongs to the CUDA engine: asked for on the CPU it is a usage error (exit 2),
    not an option silently ignored."""
    from nanoqwen_cli.main import app
    from typer.testing import CliRunner

    r = CliRunner().invoke(app, ["serve", str(model), "--device", "cpu", "--dense-weight-cache"])
    assert r.exit_code == 2 and "--dense-weight-cache" in r.output, r.output


def test_bounded_waiting_queue_gives_429(model):
    """One running slot and room for one waiting request: a burst of 12 gets some 429s (Retry-After), the
    rest complete; nothing else. Each accepted request needs ~200 decode steps, far longer than the burst
    takes to arrive, so at most 2 + (requests finished meanwhile) are accepted."""
    with ServerProcess(model, "--max-batch", "1", "--max-waiting", "1", "--threads", "1") as srv:
        body = {"model": NAME, "prompt": "a", "max_tokens": 200, "temperature": 0}

        def one(_):
            return httpx.post(srv.url + "/v1/completions", json=body, timeout=120)

        with cf.ThreadPoolExecutor(12) as pool:
            rs = list(pool.map(one, range(12)))
        codes = sorted(r.status_code for r in rs)
        assert set(codes) <= {200, 429} and codes.count(429) >= 1 and codes.count(200) >= 2, codes
        for r in rs:
            if r.status_code == 429:
                assert_error(r, 429, "queue_full")
                assert int(r.headers["retry-after"]) >= 1
        assert srv.metric('nanoqwen_requests_total{status="429"}') == codes.count(429)
        assert srv.wait_metric("nanoqwen_kv_blocks_used", 0.0) == 0.0
        engine_pid = httpx.get(srv.url + "/health").json()["engine_pid"]
        code = srv.terminate()
    assert code == 0
    with pytest.raises(ProcessLookupError):  # the engine process was stopped and reaped: no orphan
        os.kill(engine_pid, 0)
