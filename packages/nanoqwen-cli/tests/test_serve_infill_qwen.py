"""Fill-in-the-middle through `nanoqwen-cli serve --device cpu` on the real Qwen2.5-Coder-0.5B-Instruct
(RTN INT4): the `openai` client's `completions.create(prompt=..., suffix=...)` and llama.cpp's
`POST /infill`, streamed and not, fill a function body so that the file compiles; every 400; extra
files dropped to fit the context; the time and line budgets; a client that goes away frees its KV
blocks. The model is an Instruct model, so the server infills through the chat template (the way its
metadata chooses: fim.choose_way); `inspect` says so too. One server for the module, with a context of
1,024 tokens so that the context tests stay small; few tokens everywhere."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from nanoqwen_cli.server.testing import ServerProcess

pytestmark = pytest.mark.model

NAME = "qwen-coder"
CONTEXT = 1024
BEFORE = "def add(a, b):\n"
AFTER = "\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def server(qwen05b_packed):
    srv = ServerProcess(qwen05b_packed("rtn"), "--model-name", NAME, "--max-model-len", str(CONTEXT),
                        "--max-batch", "4")
    srv.start()
    yield srv
    srv.terminate()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def infill(server, **body):
    return httpx.post(server.url + "/infill", json=body, timeout=300)


def sse_events(server, body) -> list[dict]:
    with httpx.stream("POST", server.url + "/infill", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]


def test_openai_client_suffix_fills_a_function_body(client):
    r = client.completions.create(model=NAME, prompt=BEFORE, suffix=AFTER, max_tokens=32, temperature=0)
    middle = r.choices[0].text
    assert middle.strip() and r.choices[0].finish_reason == "stop"
    compile(BEFORE + middle + AFTER, "infilled.py", "exec")
    assert "print(add" not in middle  # the repeat of the suffix was cut
    assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens > len(BEFORE) // 4


def test_infill_llama_shape_streamed_and_not(server):
    body = {"input_prefix": BEFORE, "input_suffix": AFTER, "n_predict": 32, "temperature": 0,
            # what llama.vim sends besides: accepted, not used
            "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "t_max_prompt_ms": 500,
            "n_indent": 0, "response_fields": ["content", "timings/prompt_n"]}
    r = infill(server, **body)
    assert r.status_code == 200, r.text
    out = r.json()
    compile(BEFORE + out["content"] + AFTER, "infilled.py", "exec")
    assert out["stop"] is True and out["infill_way"] == "chat" and out["truncated"] is False
    assert out["tokens_predicted"] >= 1 and out["tokens_evaluated"] == out["timings"]["prompt_n"] > 0
    t = out["timings"]
    assert set(t) >= {"prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
                      "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}
    assert t["predicted_n"] == out["tokens_predicted"] and t["prompt_ms"] > 0
    events = sse_events(server, body)
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == out["content"]  # greedy: the same middle


def test_openai_streamed_suffix_equals_non_streamed(client):
    kw = {"model": NAME, "prompt": BEFORE, "suffix": AFTER, "max_tokens": 32, "temperature": 0}
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_bad_input(server, client):
    def err(r, code):
        assert r.status_code == 400, r.text
        e = r.json()["error"]
        assert e["code"] == code and e["message"]
        return e["message"]

    assert "nothing to fill in" in err(infill(server, input_prefix="", input_suffix=""), "invalid_value")
    assert "unknown or unsupported parameter 'frobnicate'" in err(
        infill(server, input_prefix="a", frobnicate=1), "unsupported_parameter")
    msg = err(httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": NAME, "prompt": "a", "suffix": "b", "echo": True}), "unsupported_parameter")
    assert "echo" in msg and "suffix" in msg
    err(httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": NAME, "prompt": [1, 2], "suffix": "b"}), "invalid_value")
    # over the context even without extra files: 400 with both lengths
    msg = err(infill(server, input_prefix="x = 1\n" * 400, input_suffix="y = 2\n" * 200, n_predict=8),
              "context_length_exceeded")
    assert f"context window is {CONTEXT} tokens" in msg and "prefix" in msg and "suffix" in msg
    with pytest.raises(openai.BadRequestError, match="context window"):
        client.completions.create(model=NAME, prompt="x = 1\n" * 400, suffix="y = 2\n" * 200, max_tokens=8)


def test_extra_files_dropped_first_given_first_to_fit(server, qwen05b_packed):
    """Two extra files of ~390 tokens each and a chat prompt of ~100 tokens in a 1,024 context with
    n_predict 400: the prompt must leave 400 tokens, so the first file goes; both fit with n_predict 1.
    FIM tokens written in a file are text (the request runs as any other)."""
    files = [{"filename": f"m{i}.py", "text": f"# <|fim_middle|><|file_sep|>\nV{i} = [" + "1, " * 120 + "]\n"}
             for i in range(2)]
    small = infill(server, input_prefix=BEFORE, input_suffix=AFTER, input_extra=files, n_predict=1,
                   temperature=0).json()
    assert small["extra_files_used"] == 2 and small["extra_files_dropped"] == 0 and not small["truncated"]
    # the special tokens written in the files were encoded as text: the prompt is the runtime's, to the token
    from nanoqwen_runtime import ChatTemplate, Tokenizer, fim

    container = qwen05b_packed("rtn")
    want = fim.chat_prompt(Tokenizer.from_file(container), ChatTemplate.from_file(container), BEFORE, AFTER,
                           files)
    assert small["tokens_evaluated"] == len(want.ids)
    big = infill(server, input_prefix=BEFORE, input_suffix=AFTER, input_extra=files, n_predict=400,
                 temperature=0, max_lines=1).json()
    assert big["extra_files_used"] == 1 and big["extra_files_dropped"] == 1 and big["truncated"] is True
    assert big["tokens_evaluated"] < small["tokens_evaluated"] - 250


def test_time_and_line_budgets_end_the_request(server):
    r = infill(server, input_prefix="def lines():\n", input_suffix="", n_predict=64, temperature=0,
               max_lines=1).json()
    assert "\n" not in r["content"] and r["stop_type"] == "limit" and r["tokens_predicted"] < 64
    r = infill(server, input_prefix="def lines():\n", input_suffix="", n_predict=64, temperature=0,
               t_max_predict_ms=1).json()
    assert r["stop_type"] == "limit" and r["tokens_predicted"] < 64
    assert server.wait_metric("nanoqwen_kv_blocks_used", 0.0) == 0.0  # the ended requests hold no blocks


def test_disconnect_mid_infill_stream_frees_kv_blocks(server):
    aborted = server.metrics().get('nanoqwen_requests_total{status="aborted"}', 0.0)
    with httpx.stream("POST", server.url + "/infill", timeout=120, json={
            "input_prefix": "def long_function():\n", "input_suffix": "", "n_predict": 500, "stream": True,
            "temperature": 0, "trim_suffix_repeat": False}) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert '"content"' in first
        assert server.metric("nanoqwen_kv_blocks_used") > 0
    assert server.wait_metric("nanoqwen_kv_blocks_used", 0.0) == 0.0
    assert server.metrics()['nanoqwen_requests_total{status="aborted"}'] == aborted + 1


def test_cache_reuse_serves_the_code_below_a_moved_cursor(qwen05b_packed):
    """`serve --cache-reuse 16`: the cursor moves on (the prefix grows), so the code below it sits at
    a new position in the second prompt; the server copies it from the first request's cached blocks
    instead of prefilling it (the metric counts the copied tokens) and still answers."""
    below = "".join(f"def scale_{i}(x):\n    return x * {i}\n\n" for i in range(12))
    with ServerProcess(qwen05b_packed("rtn"), "--model-name", NAME, "--max-model-len", str(CONTEXT),
                       "--cache-reuse", "16") as srv:
        for prefix in ("import math\n\n\ndef area(r):\n", "import math\n\n\ndef area(r):\n    r = abs(r)\n"):
            r = infill(srv, input_prefix=prefix, input_suffix=below, n_predict=4, temperature=0)
            assert r.status_code == 200, r.text
        assert srv.metrics()["nanoqwen_prefix_cache_reused_tokens_total"] >= 16


def test_serve_rejects_bad_cache_reuse(qwen05b_packed):
    from nanoqwen_cli.main import app
    from typer.testing import CliRunner

    for args, words in ((["--cache-reuse", "-1"], ">= 0"), (["--cache-reuse", "64", "--no-prefix-cache"],
                                                            "--no-prefix-cache")):
        r = CliRunner().invoke(app, ["serve", str(qwen05b_packed("rtn")), *args])
        assert r.exit_code == 2 and "--cache-reuse" in r.output and words in r.output, r.output
