"""The request validation of `nanoqwen-cli serve` (server/protocol.py), without a server: every bad
body gets its status code, the OpenAI error shape and the parameter it names."""

from __future__ import annotations

import json

import pytest
from nanoqwen_cli.server.protocol import APIError, parse_chat, parse_completion

MODEL = "m"
MSG = [{"role": "user", "content": "hi"}]


def chat(**kw) -> bytes:
    return json.dumps({"model": MODEL, "messages": MSG, **kw}).encode()


def completion(**kw) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "def f(", **kw}).encode()


# (body, status, param, code)
BAD = [
    (b"{not json", 400, None, "invalid_json"),
    (b"\xff\xfe", 400, None, "invalid_json"),
    (b"[1, 2]", 400, None, "invalid_json"),
    (json.dumps({"messages": MSG}).encode(), 400, "model", "invalid_value"),
    (json.dumps({"model": MODEL}).encode(), 400, "messages", "invalid_value"),
    (chat(messages=[]), 400, "messages", "invalid_value"),
    (chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages.0.role", "invalid_value"),
    (chat(max_tokens="10"), 400, "max_tokens", "invalid_value"),
    (chat(max_tokens=0), 400, "max_tokens", "invalid_value"),
    (chat(temperature=-0.5), 400, "temperature", "invalid_value"),
    (chat(temperature=3), 400, "temperature", "invalid_value"),
    (chat(top_p=0), 400, "top_p", "invalid_value"),
    (chat(top_k=-1), 400, "top_k", "invalid_value"),
    (chat(seed=-1), 400, "seed", "invalid_value"),
    (chat(stream="yes"), 400, "stream", "invalid_value"),
    (chat(stop=["a", "b", "c", "d", "e"]), 400, "stop", "invalid_value"),
    (chat(stop=[""]), 400, "stop", "invalid_value"),
    (chat(max_tokens=5, max_completion_tokens=6), 400, "max_tokens", "invalid_value"),
    (chat(n=0), 400, "n", "invalid_value"),
    (chat(n=17), 400, "n", "invalid_value"),  # MAX_N
    (chat(n="2"), 400, "n", "invalid_value"),
    (chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", "invalid_value"),
    (chat(logprobs=True, top_logprobs=-1), 400, "top_logprobs", "invalid_value"),
    (chat(top_logprobs=3), 400, "top_logprobs", "invalid_value"),  # without logprobs: true
    (chat(logprobs=3), 400, "logprobs", "invalid_value"),  # chat's logprobs is a boolean
    (chat(logprobs="yes"), 400, "logprobs", "invalid_value"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objet"}}}]), 400,
     "tools[0].function.parameters", "invalid_schema"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array", "items": {
        "type": "array", "uniqueItems": True}}}}]), 400, "tools[0].function.parameters#/items",
     "unsupported_schema_feature"),
    (chat(tools=[{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {
        "name": "f"}}]), 400, "tools[1].function.name", "invalid_value"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "typo": 1}}]), 400, "tools[0].function.typo",
     "invalid_value"),
    (chat(tool_choice="auto"), 400, "tool_choice", "invalid_value"),
    (chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={
        "type": "function", "function": {"name": "g"}}), 400, "tool_choice", "invalid_value"),
    (chat(messages=[{"role": "user", "content": "a"},
                    {"role": "tool", "tool_call_id": "call_1", "content": "2"}]), 400,
     "messages[1].tool_call_id", "invalid_value"),
    (chat(messages=[{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "{not json"}}]}]), 400, "messages[0].tool_calls[0].function.arguments",
     "invalid_value"),
    (chat(functions=[{"name": "f"}]), 400, "functions", "unsupported_parameter"),
    (chat(messages=[{"role": "user"}]), 400, "messages[0].content", "invalid_value"),
    (chat(messages=[{"role": "assistant", "content": None}]), 400, "messages[0].content", "invalid_value"),
    (chat(logprobs=True, response_format={"type": "json_object"}), 400, "logprobs", "unsupported_parameter"),
    (chat(presence_penalty=0.5), 400, "presence_penalty", "unsupported_parameter"),
    (chat(logit_bias={"1": 5}), 400, "logit_bias", "unsupported_parameter"),
    (chat(response_format={"type": "yaml"}), 400, "response_format", "invalid_value"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "properties": {"a": {"if": {}, "then": {}}}}}}), 400,
     "response_format.json_schema.schema#/properties/a", "unsupported_schema_feature"),
    (chat(frobnicate=1), 400, "frobnicate", "unsupported_parameter"),
    (chat(model="gpt-4"), 404, "model", "model_not_found"),
]

BAD_COMPLETION = [
    (completion(prompt=["a", "b"]), 400, "prompt", "unsupported_parameter"),
    (completion(prompt=""), 400, "prompt", "invalid_value"),
    (completion(prompt=[]), 400, "prompt", "invalid_value"),
    (completion(prompt=[1, "a"]), 400, "prompt", "invalid_value"),
    (completion(echo="yes"), 400, "echo", "invalid_value"),
    (completion(echo=True, stream=True), 400, "echo", "unsupported_parameter"),
    (completion(max_tokens=0), 400, "max_tokens", "invalid_value"),  # 0 only with echo
    (completion(logprobs=21), 400, "logprobs", "invalid_value"),
    (completion(logprobs=True), 400, "logprobs", "invalid_value"),  # an int on completions
    (completion(logprobs=1.5), 400, "logprobs", "invalid_value"),
    (completion(top_logprobs=2), 400, "top_logprobs", "unsupported_parameter"),
    (completion(n=0), 400, "n", "invalid_value"),
    (completion(best_of=3), 400, "best_of", "unsupported_parameter"),
    # fill-in-the-middle (`suffix`, server/infill.py): refused with echo, token ids, ignore_eos; empty both
    (completion(suffix="x", echo=True), 400, "echo", "unsupported_parameter"),
    (completion(prompt=[1, 2], suffix="x"), 400, "prompt", "invalid_value"),
    (completion(suffix="x", ignore_eos=True), 400, "ignore_eos", "unsupported_parameter"),
    (completion(prompt="", suffix=""), 400, "prompt", "invalid_value"),
    (completion(suffix="x", logprobs=2), 400, "logprobs", "unsupported_parameter"),
    (completion(suffix="x", n=2), 400, "n", "unsupported_parameter"),
]


@pytest.mark.parametrize("body,status,param,code", BAD + BAD_COMPLETION)
def test_bad_bodies_are_refused_with_the_openai_error_shape(body, status, param, code):
    parse = parse_completion if b'"prompt"' in body else parse_chat
    with pytest.raises(APIError) as info:
        parse(body, MODEL)
    e = info.value
    assert (e.status, e.code) == (status, code), e.message
    assert e.param == param or (param is None and e.param is None), e.message
    shape = e.body()
    assert set(shape) == {"error"} and set(shape["error"]) == {"message", "type", "param", "code"}
    assert shape["error"]["message"] and shape["error"]["type"]


def test_good_bodies():
    s = parse_chat(chat(max_completion_tokens=7, temperature=0, top_k=5, seed=3, stop="x", stream=True,
                        stream_options={"include_usage": True}, n=1, logprobs=False, presence_penalty=0,
                        user="u", tool_choice="none", response_format={"type": "text"},
                        messages=[{"role": "developer", "content": "be brief"},
                                  {"role": "user", "content": [{"type": "text", "text": "a"},
                                                               {"type": "text", "text": "b"}]}]), MODEL)
    assert s.messages == (("system", "be brief"), ("user", "ab"))
    assert (s.max_tokens, s.temperature, s.top_k, s.seed, s.stop) == (7, 0, 5, 3, ("x",))
    assert s.stream and s.include_usage
    c = parse_completion(completion(prompt=[1, 2, 3], max_tokens=4), MODEL)
    assert c.prompt == (1, 2, 3) and c.max_tokens == 4 and not c.stream and c.temperature is None
    assert parse_completion(completion(prompt=["one"]), MODEL).prompt == "one"
    assert (c.n, c.logprobs, c.echo) == (1, None, False)


def test_logprobs_n_and_echo_bodies():
    s = parse_chat(chat(logprobs=True, top_logprobs=20, n=16), MODEL)
    assert (s.logprobs, s.n) == (20, 16)
    assert parse_chat(chat(logprobs=True), MODEL).logprobs == 0
    assert parse_chat(chat(logprobs=False), MODEL).logprobs is None
    c = parse_completion(completion(logprobs=0, echo=True, max_tokens=0), MODEL)
    assert (c.logprobs, c.echo, c.max_tokens) == (0, True, 0)
    assert parse_completion(completion(logprobs=20, n=3), MODEL).logprobs == 20


def test_suffix_is_fill_in_the_middle():
    spec = parse_completion(completion(suffix="\n    return x\n", max_tokens=8), MODEL)
    assert spec.suffix == "\n    return x\n" and spec.prompt == "def f("
    assert parse_completion(completion(prompt="", suffix="x"), MODEL).prompt == ""  # the cursor at the top
    assert parse_completion(completion(suffix=""), MODEL).suffix is None  # "" is no suffix (plain completion)
