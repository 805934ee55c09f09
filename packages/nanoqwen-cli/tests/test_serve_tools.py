"""Tool calling and structured output through `nanoqwen-cli serve`, driven by the official `openai` client,
on two servers: `--device cpu` with the real Qwen2.5-Coder-0.5B (RTN INT4; CI) and `--device cuda` with
the real Qwen2.5-Coder-1.5B-Instruct (RTN INT4; a `gpu` test, where the 1.5B was carried):
`chat.completions.parse` with a pydantic model (20 prompts, all valid: the grammar guarantees it), a
tool-call round trip (call, tool message, final answer) streamed and not, tool_choice="required" always giving
a schema-valid call, and each 400 (bad schemas with their path, an unsupported keyword named, a tool
message for an unknown call, a tool_choice naming no tool, unknown parameters). One server for the module;
short answers (max_tokens <= 40)."""

from __future__ import annotations

import concurrent.futures as cf
import json
from typing import Literal

import httpx
import openai
import pytest
from nanoqwen_cli.server.testing import ServerProcess
from pydantic import BaseModel

pytestmark = pytest.mark.model

MODEL = "qwen-coder"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current temperature in a city, in Celsius.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}


class Pick(BaseModel):
    color: Literal["red", "green", "blue"]
    size: Literal["small", "large"]
    count: int


@pytest.fixture(scope="module", params=[
    pytest.param("cpu", id="cpu-0.5b"),
    pytest.param("cuda", id="cuda-1.5b", marks=pytest.mark.gpu),
])
def server(request, qwen05b_packed, qwen15b_packed):
    if request.param == "cpu":
        srv = ServerProcess(qwen05b_packed("rtn"), "--model-name", MODEL, "--max-batch", "20")
    else:
        srv = ServerProcess(qwen15b_packed("rtn"), "--device", "cuda", "--model-name", MODEL,
                            "--max-batch", "20", "--kv-memory", "8GiB")
    srv.start()
    yield srv
    srv.terminate()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)


def test_parse_with_a_pydantic_model_twenty_prompts(client):
    things = ["apples", "cars", "shirts", "balls", "cups", "pens", "boxes", "hats", "books", "lamps",
              "chairs", "bikes", "kites", "shoes", "rings", "bags", "mugs", "keys", "tiles", "coins"]

    def one(thing):
        r = client.chat.completions.parse(
            model=MODEL, temperature=0, max_tokens=40, response_format=Pick,
            messages=[{"role": "user", "content": f"Describe some {thing} as JSON: color, size, count."}])
        return r.choices[0]

    with cf.ThreadPoolExecutor(20) as pool:
        choices = list(pool.map(one, things))
    for c in choices:
        assert c.finish_reason == "stop", c
        assert isinstance(c.message.parsed, Pick)
        assert Pick.model_validate_json(c.message.content) == c.message.parsed


def _weather_question():
    return [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the weather in Paris, in Celsius?"}]


def _check_weather_call(call):
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "unit"} and isinstance(args["city"], str) and args["unit"] in ("c", "f")
    return args


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_call_round_trip(client, stream):
    kw = {"model": MODEL, "temperature": 0, "tools": [WEATHER, TIME]}
    msgs = _weather_question()
    if stream:
        chunks = list(client.chat.completions.create(**kw, messages=msgs, tool_choice="required",
                                                     parallel_tool_calls=False, max_tokens=40, stream=True))
        calls: dict[int, dict] = {}
        for ch in chunks:
            for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
                c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                c["id"] = tc.id or c["id"]
                if tc.function and tc.function.name:
                    c["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    c["arguments"] += tc.function.arguments
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert list(calls) == [0]
        call = openai.types.chat.ChatCompletionMessageToolCall(
            id=calls[0]["id"], type="function",
            function={"name": calls[0]["name"], "arguments": calls[0]["arguments"]})
    else:
        r = client.chat.completions.create(**kw, messages=msgs, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=40)
        assert r.choices[0].finish_reason == "tool_calls"
        (call,) = r.choices[0].message.tool_calls
    _check_weather_call(call)
    msgs += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
             {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]
    # the final answer (tool_choice "none": a text answer; the 0.5B model, free to call again, repeats
    # the call as text instead of answering)
    if stream:
        chunks = list(client.chat.completions.create(**kw, messages=msgs, max_tokens=16, stream=True,
                                                     tool_choice="none"))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reason = chunks[-1].choices[0].finish_reason
        assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
    else:
        r = client.chat.completions.create(**kw, messages=msgs, max_tokens=16, tool_choice="none")
        text, reason = r.choices[0].message.content, r.choices[0].finish_reason
        assert r.choices[0].message.tool_calls is None
    assert reason in ("stop", "length") and text.strip(), text


def test_required_always_gives_a_schema_valid_call(client):
    questions = ["Is it raining in Oslo?", "Tell me a joke.", "What is 2 + 2?"]

    def one(q):  # one call each (parallel calls may run past max_tokens: then "length", no calls)
        choice = "required" if q != questions[0] else {"type": "function",
                                                       "function": {"name": "get_weather"}}
        return client.chat.completions.create(model=MODEL, temperature=0, max_tokens=40,
                                              tools=[WEATHER, TIME], tool_choice=choice,
                                              parallel_tool_calls=False,
                                              messages=[{"role": "user", "content": q}])

    with cf.ThreadPoolExecutor(3) as pool:
        for r in pool.map(one, questions):
            assert r.choices[0].finish_reason == "tool_calls", r
            (call,) = r.choices[0].message.tool_calls
            if call.function.name == "get_time":
                assert set(json.loads(call.function.arguments)) == {"city"}
            else:
                _check_weather_call(call)


def _post(server, body):
    return httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, **body}, timeout=60)


@pytest.mark.parametrize("body,param,code,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "integr"}}}}}},
     "response_format.json_schema.schema#/properties/a", "invalid_schema", ["integr", "/properties/a"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}},
     "response_format.json_schema.schema", "unsupported_schema_feature", ["uniqueItems"]),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"not": {"type": "string"}}}}}}]},
     "tools[0].function.parameters#/properties/x", "unsupported_schema_feature", ["not"]),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "tool", "tool_call_id": "call_nope", "content": "1"}]},
     "messages[1].tool_call_id", "invalid_value", ["call_nope"]),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice", "invalid_value", ["get_time"]),
    ({"response_format": {"type": "xml"}}, "response_format", "invalid_value", ["json_schema"]),
    ({"tools": [WEATHER], "tool_choice": "required", "bogus": 1}, "bogus", "unsupported_parameter", []),
])
def test_bad_requests_get_a_400_naming_the_problem(server, body, param, code, words):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
    r = _post(server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == code, err
    assert all(w in err["message"] for w in words), err
