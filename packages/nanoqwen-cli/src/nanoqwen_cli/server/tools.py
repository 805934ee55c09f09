"""Tool calling and structured output on /v1/chat/completions: the request fields, the grammars that
constrain decoding, and the tool calls parsed out of the model's text (whole and streamed).

Request side (checked at parse time; every failure a `ToolError`, which protocol.py answers with a 400
naming the parameter):
- `tools` (functions with a JSON-schema `parameters`: each schema is compiled, so an invalid one or an
  unsupported keyword is refused with its path), `tool_choice` ("none", "auto", "required" or
  {"type": "function", "function": {"name": ...}}), `parallel_tool_calls`;
- `role: "tool"` messages (their `tool_call_id` must name a call of an earlier assistant message) and
  assistant messages with `tool_calls`, handed to the container's chat template as transformers does
  (the arguments as objects: Qwen2.5's template writes them with `tojson`);
- `response_format`: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema":
  {"name", "schema", "strict"?, "description"?}} -> a `Grammar` (nanoqwen_runtime.grammar).

Qwen2.5's hermes format: the template lists the tools in the system prompt and the model answers
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` (`<tool_call>` and `</tool_call>` are
tokens of their own). With tool_choice "required" or a named function the answer is constrained by
a grammar: one call (or, with parallel_tool_calls, one or more separated by "\n") of a declared
function (the named one) whose arguments follow its `parameters` schema. With "auto" the model is
free and the calls it writes are parsed; text that is not a well-formed call of a declared function
stays content. With "none" the tools are not shown to the model.

Response side: `parse_tool_calls` (whole answers) and `ToolStream` (streamed deltas in OpenAI's shape:
{"tool_calls": [{"index", "id", "type", "function": {"name", "arguments"}}]}, the name in the first
delta of a call and the arguments in the next). A call gets an id `call_<24 hex>`, and `arguments`
is the JSON text of the arguments object. The finish reason is "tool_calls" when the answer holds a
call and ended by itself (EOS), never for an answer cut by max_tokens ("length": what was cut is not
presented as a call).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

if TYPE_CHECKING:  # nanoqwen_runtime.grammar (llguidance) is imported by the requests that use it
    from nanoqwen_runtime.grammar import Grammar

__all__ = ["ToolError", "ToolDef", "ToolCallIn", "NamedToolChoice", "ToolPlan", "check_tools",
           "template_messages", "response_format_grammar", "tool_grammar", "parse_tool_calls", "ToolStream"]

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class _CallFunction(_Strict):
    name: str
    arguments: str


class ToolCallIn(_Strict):
    id: str
    type: Literal["function"]
    function: _CallFunction


class _Named(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: _Named


@dataclass(frozen=True)
class ToolPlan:
    """The tools of one request: `tools` as the template takes them, `params` each function's
    parameters schema, `choice` ("auto", "none", "required" or a function name), `parallel`."""

    tools: tuple[dict[str, Any], ...]
    params: dict[str, dict[str, Any]]
    choice: str
    parallel: bool

    @property
    def active(self) -> bool:
        return self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.choice not in ("auto", "none")


class ToolError(ValueError):
    """A tools / tool message / response_format field the server refuses: protocol.py answers it with a
    400 naming `param`, with `code` ("invalid_value", "invalid_schema", "unsupported_schema_feature")."""

    def __init__(self, message: str, param: str, code: str):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def _bad(msg: str, param: str, code: str = "invalid_value") -> ToolError:
    return ToolError(msg, param, code)


def _compile(schema: Any, param: str, what: str) -> Grammar:
    from nanoqwen_runtime.grammar import GrammarError, compile_json_schema

    try:
        return compile_json_schema(schema, what)
    except GrammarError as e:
        code = "unsupported_schema_feature" if e.feature else "invalid_schema"
        raise _bad(f"{param}: {e.message}", param + (f"#{e.path}" if e.path else ""), code) from None


def _model(cls: type[BaseModel], data: Any, param: str):
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        where = ".".join(str(x) for x in err["loc"])
        where = f"{param}.{where}" if where else param
        raise _bad(f"invalid parameter {where}: {err['msg']}", where) from None


def check_tools(raw_tools: list[Any] | None, raw_choice: Any, parallel: bool | None) -> ToolPlan | None:
    """The request's tools, checked: unique names, compilable parameter schemas, a tool_choice naming
    a declared function. None when the request has no tools (then tool_choice may only be "none")."""
    tools = [_model(ToolDef, t, f"tools[{i}]") for i, t in enumerate(raw_tools or [])]
    choice: str | NamedToolChoice | None = raw_choice
    if raw_choice is not None and raw_choice not in ("none", "auto", "required"):
        if not isinstance(raw_choice, dict):
            raise _bad(f"tool_choice must be 'none', 'auto', 'required' or a function, got {raw_choice!r}",
                       "tool_choice")
        choice = _model(NamedToolChoice, raw_choice, "tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise _bad("tool_choice needs tools", "tool_choice")
        if parallel is not None:
            raise _bad("parallel_tool_calls needs tools", "parallel_tool_calls")
        return None
    params: dict[str, dict[str, Any]] = {}
    for i, t in enumerate(tools):
        f = t.function
        if f.name in params:
            raise _bad(f"two tools are named {f.name!r}", f"tools[{i}].function.name")
        schema = f.parameters if f.parameters is not None else {"type": "object", "properties": {}}
        _compile(schema, f"tools[{i}].function.parameters", f"the parameters of {f.name}")
        params[f.name] = schema
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in params:
            raise _bad(f"tool_choice names {name!r}, which is not among the tools ({sorted(params)})",
                       "tool_choice")
        choice = name
    rendered = tuple({"type": "function", "function": t.function.model_dump(exclude_none=True)}
                     for t in tools)
    return ToolPlan(rendered, params, choice or "auto", True if parallel is None else parallel)


def template_messages(messages) -> tuple[dict[str, Any], ...]:
    """The chat messages as the template takes them; assistant `tool_calls` with their arguments as
    objects. A tool message must answer a call id of an earlier assistant message (else a 400)."""
    out, ids = [], set()
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        if m.content is None and not (role == "assistant" and m.tool_calls):
            raise _bad(f"messages[{i}]: content is required (only an assistant message of tool_calls may "
                       "leave it out)", f"messages[{i}].content")
        d: dict[str, Any] = {"role": role, "content": m.text()}
        if m.tool_calls:
            if role != "assistant":
                raise _bad(f"messages[{i}]: only assistant messages carry tool_calls",
                           f"messages[{i}].tool_calls")
            calls = []
            for j, raw in enumerate(m.tool_calls):
                c = _model(ToolCallIn, raw, f"messages[{i}].tool_calls[{j}]")
                try:
                    args = json.loads(c.function.arguments)
                except json.JSONDecodeError as e:
                    raise _bad(f"messages[{i}].tool_calls[{j}].function.arguments is not JSON: {e}",
                               f"messages[{i}].tool_calls[{j}].function.arguments") from None
                calls.append({"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": args}})
                ids.add(c.id)
            d["tool_calls"] = calls
        if role == "tool":
            if not m.tool_call_id:
                raise _bad(f"messages[{i}]: a tool message needs tool_call_id", f"messages[{i}].tool_call_id")
            if m.tool_call_id not in ids:
                raise _bad(f"messages[{i}].tool_call_id {m.tool_call_id!r} names no tool call of an earlier "
                           "assistant message", f"messages[{i}].tool_call_id")
        elif m.tool_call_id is not None:
            raise _bad(f"messages[{i}]: only tool messages carry tool_call_id", f"messages[{i}].tool_call_id")
        out.append(d)
    return tuple(out)


def response_format_grammar(rf: dict[str, Any] | None) -> Grammar | None:
    """The grammar of a `response_format`, None for text."""
    if rf is None:
        return None
    kind = rf.get("type")
    if kind == "text" and len(rf) == 1:
        return None
    if kind == "json_object" and len(rf) == 1:
        return _compile({"type": "object"}, "response_format", "JSON object")
    if kind == "json_schema" and set(rf) == {"type", "json_schema"}:
        js = rf["json_schema"]
        allowed = {"name", "schema", "strict", "description"}
        if not isinstance(js, dict) or not isinstance(js.get("name"), str) or set(js) - allowed:
            raise _bad("response_format.json_schema must be an object with a string 'name' and only "
                       f"{sorted(allowed)}", "response_format.json_schema")
        if "strict" in js and not isinstance(js["strict"], bool | None):
            raise _bad("response_format.json_schema.strict must be a boolean", "response_format.json_schema")
        return _compile(js.get("schema", {}), "response_format.json_schema.schema",
                        f"JSON schema {js['name']}")
    raise _bad(f"response_format must be {{'type': 'text'}}, {{'type': 'json_object'}} or {{'type': "
               f"'json_schema', 'json_schema': {{...}}}}, got {rf!r}", "response_format")


def tool_grammar(plan: ToolPlan, tokenizer) -> Grammar:
    """The grammar of a forced answer: `<tool_call>\\n{"name": N, "arguments": A}\\n</tool_call>`, N a
    declared function (the named one) and A valid under its parameters; several calls joined by "\\n"
    when parallel calls are allowed. `<tool_call>` / `</tool_call>` are the tokenizer's own ids."""
    from nanoqwen_runtime.grammar import json_schema_lark, lark_grammar

    names = [plan.choice] if plan.choice in plan.params else list(plan.params)
    variants = [{"type": "object", "properties": {"name": {"const": n}, "arguments": plan.params[n]},
                 "required": ["name", "arguments"], "additionalProperties": False} for n in names]
    body = json_schema_lark(variants[0] if len(variants) == 1 else {"anyOf": variants})
    tok_open, tok_close = (tokenizer.token_to_id(t) for t in (OPEN, CLOSE))
    o = f"<[{tok_open}]>" if tok_open is not None else json.dumps(OPEN)
    c = f"<[{tok_close}]>" if tok_close is not None else json.dumps(CLOSE)
    start = 'start: call ("\\n" call)*' if plan.parallel else "start: call"
    return lark_grammar(f'{start}\ncall: {o} "\\n" {body} "\\n" {c}\n', "tool-call grammar")


def _call(name: str, args: Any) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def _parse_one(body: str, plan: ToolPlan) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in plan.params or not isinstance(
            obj.get("arguments", {}), dict):
        return None
    return _call(obj["name"], obj.get("arguments", {}))


def parse_tool_calls(text: str, plan: ToolPlan) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a whole answer: the text outside the well-formed calls (None when
    empty), and the calls in order. A malformed block stays in the content."""
    calls, content, pos = [], [], 0
    for m in _CALL.finditer(text):
        call = _parse_one(m.group(1), plan)
        if call is None:
            continue
        content.append(text[pos:m.start()])
        pos = m.end()
        calls.append(call)
    content.append(text[pos:])
    rest = "".join(content).strip() if calls else "".join(content)
    return (rest or None), calls


class ToolStream:
    """Streamed answer -> OpenAI deltas. `push(text)` returns the deltas that text completes: content
    outside calls ({"content": ...}, held back while it could be the start of `<tool_call>`), and per
    finished call two deltas ({"tool_calls": [{index, id, type, function: {name, arguments: ""}}]},
    then the arguments). A block that is not a well-formed call is released as content. `flush()` at
    the end gives what is held back (an unfinished call: as content)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.buf = ""
        self.num_calls = 0

    def _content(self, text: str) -> list[dict[str, Any]]:
        if self.num_calls and not text.strip():
            return []  # the newlines between calls
        return [{"content": text}] if text else []

    def push(self, text: str) -> list[dict[str, Any]]:
        self.buf += text
        out: list[dict[str, Any]] = []
        while True:
            start = self.buf.find(OPEN)
            if start < 0:
                keep = max((n for n in range(1, len(OPEN)) if self.buf.endswith(OPEN[:n])), default=0)
                out += self._content(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                return out
            end = self.buf.find(CLOSE, start)
            if end < 0:
                out += self._content(self.buf[:start])
                self.buf = self.buf[start:]
                return out
            out += self._content(self.buf[:start])
            call = _parse_one(self.buf[start + len(OPEN):end].strip(), self.plan)
            block, self.buf = self.buf[start:end + len(CLOSE)], self.buf[end + len(CLOSE):]
            if call is None:
                out += self._content(block)
                continue
            i, f = self.num_calls, call["function"]
            self.num_calls += 1
            out.append({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                        "function": {"name": f["name"], "arguments": ""}}]})
            out.append({"tool_calls": [{"index": i, "function": {"arguments": f["arguments"]}}]})

    def flush(self) -> list[dict[str, Any]]:
        rest, self.buf = self.buf, ""
        return self._content(rest)
