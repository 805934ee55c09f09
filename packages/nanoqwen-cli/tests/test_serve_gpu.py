"""`nanoqwen-cli serve --device cuda` on the real 0.5B (RTN), and where it was carried the real 1.5B-Instruct
(RTN; the module's server tests run on both): the CPU smoke against the CUDA engine, and the load test
(packages/nanoqwen-bench/server/loadtest.py) with 256 concurrent streaming clients: every request
completes or gets a 429 with Retry-After, the KV blocks end at zero, the server exits 0."""

from __future__ import annotations

import ast
import concurrent.futures as cf
import importlib.util
import json
import re
import sys
from pathlib import Path

import httpx
import pytest
from nanoqwen_cli.server.testing import ServerProcess

pytestmark = [pytest.mark.gpu, pytest.mark.model]

ROOT = Path(__file__).resolve().parents[3]
NAME = "qwen-coder"


@pytest.fixture(scope="module", params=["0.5b", "1.5b"])
def server(request, qwen05b_packed, qwen15b_packed):
    packed = qwen05b_packed if request.param == "0.5b" else qwen15b_packed
    srv = ServerProcess(packed("rtn"), "--device", "cuda", "--model-name", NAME, "--kv-memory", "8GiB")
    srv.start()
    yield srv
    assert srv.terminate() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    """Plain httpx against the OpenAI routes. The official `openai` client drives the same routes in
    the CPU tests (test_serve_qwen.py, in CI); on the H200 image its `httpcore2` module read back with
    NUL bytes after installation from the carried wheel (as the image's own numpy.testing does), so
    this GPU test speaks the wire format itself."""
    with httpx.Client(base_url=server.url + "/v1", timeout=120) as c:
        yield c


def sse_deltas(client, route: str, body: dict) -> list[dict]:
    """The JSON chunks of a streamed answer (SSE `data:` lines up to `[DONE]`)."""
    chunks = []
    with client.stream("POST", route, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                if line == "data: [DONE]":
                    return chunks
                chunks.append(json.loads(line[len("data: "):]))
    raise AssertionError("stream ended without data: [DONE]")


def test_health_reports_the_cuda_engine(server):
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["engine_pid"] != server.proc.pid  # a process of its own
    assert "CUDA engine (kernels ops, graph mode)" in server.log(), server.log()


def test_code_answer_parses_streamed_and_not(client):
    kw = {"model": NAME, "temperature": 0, "max_tokens": 120,
          "messages": [{"role": "user", "content": "Write a Python function is_prime(n). Reply with only the "
                                                    "code in a ```python block."}]}
    r = client.post("/chat/completions", json=kw)
    assert r.status_code == 200, r.text
    whole = r.json()["choices"][0]["message"]["content"]
    streamed = "".join(c["choices"][0]["delta"].get("content") or ""
                       for c in sse_deltas(client, "/chat/completions", kw) if c["choices"])
    for text in (whole, streamed):
        m = re.search(r"```(?:python)?\n(.*?)```", text, re.S)
        assert m, text
        assert any(isinstance(n, ast.FunctionDef) for n in ast.walk(ast.parse(m.group(1)))), text


def test_sixteen_concurrent_clients_and_disconnect(client, server):
    def one(i):
        r = client.post("/completions", json={"model": NAME, "prompt": f"def f{i}(x):", "max_tokens": 16,
                                              "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()
    with cf.ThreadPoolExecutor(16) as pool:
        rs = list(pool.map(one, range(16)))
    assert all(r["usage"]["completion_tokens"] == 16 and r["choices"][0]["finish_reason"] == "length"
               for r in rs)
    aborted = server.metrics().get('nanoqwen_requests_total{status="aborted"}', 0.0)
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"model": NAME, "prompt": "def g():", "max_tokens": 4000, "stream": True,
                            "ignore_eos": True}) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))
    # the aborted counter is counted after the step's gauges are published: wait for it first
    assert server.wait_metric('nanoqwen_requests_total{status="aborted"}', aborted + 1) == aborted + 1
    assert server.wait_metric("nanoqwen_kv_blocks_used", 0.0) == 0.0


def test_logprobs_echo_and_n_choices_on_cuda(client, server):
    """The CUDA engine behind serve: chat logprobs (greedy: the token is the top alternative), echo with
    max_tokens 0 (a logprob per prompt token after the first), and n=4 sampled choices whose prompt is
    prefilled once (choices 1..3 take its full blocks from the prefix cache). Agreement of the values
    with the fp32 reference: nanoqwen-runtime tests/test_logprobs_gpu.py."""
    r = client.post("/chat/completions", json={
        "model": NAME, "temperature": 0, "max_tokens": 8, "ignore_eos": True, "logprobs": True,
        "top_logprobs": 5,
        "messages": [{"role": "user", "content": "Write a haiku about GPUs."}]})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 8
    for e in content:
        assert e["top_logprobs"][0]["token"] == e["token"] and e["top_logprobs"][0]["logprob"] == e["logprob"]
        tops = [t["logprob"] for t in e["top_logprobs"]]
        assert tops == sorted(tops, reverse=True) and len(tops) == 5 and tops[0] <= 0
    ids = [750, 15801, 1445, 982, 262, 470, 308, 353, 2240, 1445, 481, 220, 16, 8, 421, 308, 861, 220, 16]
    r = client.post("/completions", json={"model": NAME, "prompt": ids, "echo": True, "logprobs": 1,
                                          "max_tokens": 0})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(ids)
    assert all(x <= 0 for x in lp["token_logprobs"][1:])
    prompt = ("# a GPU test of n choices: helpers for parsing simple INI files into dictionaries\n"
              "import re\n\ndef")
    before = server.metrics()
    r = client.post("/completions", json={"model": NAME, "prompt": prompt, "n": 4, "max_tokens": 16,
                                          "temperature": 1.0, "seed": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert len({c["text"] for c in body["choices"]}) == 4
    n_prompt = body["usage"]["prompt_tokens"]
    hits = "nanoqwen_prefix_cache_hit_tokens_total"
    assert server.metrics()[hits] - before.get(hits, 0.0) == 3 * 16 * ((n_prompt - 1) // 16)


def test_loadtest_256_clients_no_loss(qwen05b_packed, tmp_path):
    path = ROOT / "packages" / "nanoqwen-bench" / "server" / "loadtest.py"
    spec = importlib.util.spec_from_file_location("loadtest", path)
    loadtest = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = loadtest  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(loadtest)
    code = loadtest.main([str(qwen05b_packed("rtn")), "--out", str(tmp_path), "--clients", "256",
                          "--max-tokens", "64", "--time-limit", "240", "--overhead-clients", "0",
                          "--kv-memory", "8GiB"])
    report = (tmp_path / "loadtest.md").read_text()
    print(report)
    assert code == 0, report


COPY_PROMPT = '''def clamp(x, lo, hi):
    return max(lo, min(x, hi))


# The same function again, unchanged:
def clamp(x, lo, hi):
'''


def test_speculation_and_prefix_cache_metrics_on_cuda(qwen05b_packed):
    """`serve --speculate ngram:4` on the CUDA engine: a greedy answer that copies the prompt accepts
    drafts (the body is in the prompt, so prompt lookup proposes it), the answer equals the one of a
    server without speculation up to where it stops copying (the engine's greedy is exact until a
    near-tie), and a second request sharing the prompt hits the prefix cache (>= 16 * (n - 1) // 16
    tokens of its n-token prompt: every full 16-token block but a last token)."""
    body = {"model": NAME, "prompt": COPY_PROMPT, "max_tokens": 12, "temperature": 0}
    texts = {}
    for flags in ((), ("--speculate", "ngram:4")):
        with ServerProcess(qwen05b_packed("rtn"), "--device", "cuda", "--model-name", NAME,
                           "--kv-memory", "2GiB", *flags) as srv:
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            texts[flags] = r.json()["choices"][0]["text"]
            n_prompt = r.json()["usage"]["prompt_tokens"]
            m = srv.metrics()
            if flags:
                assert m["nanoqwen_spec_accepted_tokens_total"] > 0, m
                hit0 = m["nanoqwen_prefix_cache_hit_tokens_total"]
                r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
                assert r.status_code == 200, r.text
                want = hit0 + 16 * ((n_prompt - 1) // 16)
                assert srv.wait_metric("nanoqwen_prefix_cache_hit_tokens_total", want) == want
            assert srv.terminate() == 0, srv.log()
    assert texts[()].startswith("    return max(lo, min(x, hi))"), texts
    assert texts[("--speculate", "ngram:4")] == texts[()]
