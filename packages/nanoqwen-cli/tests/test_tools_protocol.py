"""tools.py without a model: accepted tool requests and their plan, the forced-call grammar, the
tool calls parsed out of whole answers, and the streamed deltas (however the text is split)."""

from __future__ import annotations

import json

from nanoqwen_cli.server.protocol import parse_chat
from nanoqwen_cli.server.tools import ToolStream, parse_tool_calls

MODEL = "m"
F = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}


def chat(**kw) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kw}).encode()


def test_tool_requests_are_accepted():
    s = parse_chat(chat(tools=[F], tool_choice="required", parallel_tool_calls=False,
                        messages=[{"role": "user", "content": "1+1"},
                                  {"role": "assistant", "content": None, "tool_calls": [
                                      {"id": "call_1", "type": "function",
                                       "function": {"name": "add", "arguments": "{\"a\": 1}"}}]},
                                  {"role": "tool", "tool_call_id": "call_1", "content": "2"}]), MODEL)
    assert s.tool_plan.forced and not s.tool_plan.parallel and s.tool_plan.choice == "required"
    assert s.chat_messages[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}  # an object for tojson
    assert s.chat_messages[2] == {"role": "tool", "content": "2"}
    named = parse_chat(chat(tools=[F], tool_choice={"type": "function", "function": {"name": "add"}}), MODEL)
    assert named.tool_plan.choice == "add" and named.tool_plan.parallel
    rf = parse_chat(chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "object"}}}), MODEL)
    assert rf.grammar is not None and rf.tool_plan is None


def _plan():
    return parse_chat(chat(tools=[F]), MODEL).tool_plan


def test_parse_tool_calls():
    plan = _plan()
    text = 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'
    content, calls = parse_tool_calls(text, plan)
    assert [c["function"] for c in calls] == [{"name": "add", "arguments": '{"a": 1}'}]
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert content.startswith("Sure.") and '"nope"' in content  # a call of no declared tool stays text
    assert parse_tool_calls("just text", plan) == ("just text", [])


def test_tool_stream_deltas_whatever_the_split():
    plan = _plan()
    text = 'ok <tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>\n<tool_call>\n' \
           '{"name": "add", "arguments": {"a": 3}}\n</tool_call>'
    for step in (1, 3, 7, len(text)):
        ts = ToolStream(plan)
        deltas = []
        for i in range(0, len(text), step):
            deltas += ts.push(text[i:i + step])
        deltas += ts.flush()
        content = "".join(d.get("content", "") for d in deltas)
        calls = {}
        for d in deltas:
            for tc in d.get("tool_calls", []):
                c = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                c["name"] += tc.get("function", {}).get("name", "")
                c["arguments"] += tc["function"]["arguments"]
        assert content == "ok ", step
        assert [json.loads(c["arguments"]) for c in calls.values()] == [{"a": 2}, {"a": 3}]
        assert ts.num_calls == 2
    ts = ToolStream(plan)
    assert ts.push("<tool_") == [] and ts.flush() == [{"content": "<tool_"}]  # held back, then released
