"""Constrained decoding through llguidance: grammars, per-request matchers, token bitmasks.

Why llguidance (not xgrammar): it is one self-contained abi3 wheel (`llguidance`, Rust, no Python
dependencies; the same wheel installs on CPython 3.11 here and 3.12 on the GPU machine), while
xgrammar's wheel pulls torch, transformers, triton and apache-tvm-ffi. It reads the container's HF
`tokenizer.json` itself (the Rust `tokenizers` crate inside the wheel), so the matcher sees exactly the
model's vocabulary. Its JSON-schema compiler covers what `chat.completions.parse` and tool definitions
send (objects, required, additionalProperties, enum/const, anyOf/oneOf/allOf, $ref/$defs, arrays with
min/maxItems, string patterns and formats, numeric bounds) and names what it does not implement
("Unimplemented keys: ["uniqueItems"]"); its lark front end embeds JSON schemas (`%json {...}`) and
token ids (`<[151657]>`), which the tool-call grammar needs. Its errors carry no location inside the
schema: `compile_json_schema` finds it by compiling the schema's sub-schemas on their own (below).

    grammar = compile_json_schema(schema)       # Grammar, or GrammarError(message, path, feature)
    tok = matcher_tokenizer(tokenizer_json, vocab_size, eos_ids)   # built once per model (cached)
    m = GrammarMatcher(grammar, tok)
    m.fill_bitmask(row)            # int32 [ceil(V/32)] CPU: the tokens allowed next (token_mask.py)
    m.accept(token)                # advance by the sampled token; False: it was not allowed

JSON is compiled without free whitespace (`whitespace_flexible: false`, separators ", " and ": ", as
`json.dumps`): the model cannot stall in a run of blanks until max_tokens, and the output is one line
of ordinary JSON. Once the grammar is complete the mask allows only the EOS ids, so generation stops;
a grammar that cannot complete within max_tokens ends with finish reason "length".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import llguidance as llg
import torch

__all__ = ["Grammar", "GrammarError", "GrammarMatcher", "compile_json_schema", "json_object_grammar",
           "lark_grammar", "json_schema_lark", "matcher_tokenizer", "JSON_OPTIONS"]

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_UNIMPLEMENTED = "Unimplemented keys: "
# keywords whose values are sub-schemas (one, a list, or a name -> schema map): where a path can point
_SUB_ONE = ("items", "additionalProperties", "contains", "not", "if", "then", "else", "propertyNames",
            "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_SUB_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUB_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


class GrammarError(ValueError):
    """A schema or grammar the engine cannot use. `path`: JSON pointer of the failing sub-schema
    ("" = the root); `feature`: the unsupported keyword(s), or None for an invalid schema."""

    def __init__(self, message: str, *, path: str = "", feature: str | None = None):
        super().__init__(message)
        self.message, self.path, self.feature = message, path, feature


@dataclass(frozen=True)
class Grammar:
    """An llguidance grammar (its serialized form, `source`) and what it was made from (`description`,
    for messages). Plain data: it crosses to the engine process inside a `Request`."""

    source: str
    description: str


def _validate(source: str) -> str:
    """'' when llguidance accepts the grammar, else its one-line error (no tokenizer needed)."""
    return llg.LLMatcher.validate_grammar(source)


def _schema_source(schema: Any) -> str:
    s = dict(schema) if isinstance(schema, dict) else schema
    return llg.LLMatcher.grammar_from_json_schema(s, overrides=JSON_OPTIONS)


def compile_json_schema(schema: Any, description: str = "JSON schema") -> Grammar:
    """The grammar of JSON documents valid under `schema` (a dict or a bool). Raises GrammarError with
    the path of the sub-schema at fault and, for a keyword llguidance does not implement, its name."""
    if not isinstance(schema, dict | bool):
        raise GrammarError(f"a JSON schema must be an object or a boolean, got {type(schema).__name__}")
    try:
        source = _schema_source(schema)
    except ValueError as e:
        raise GrammarError(f"invalid JSON schema: {e}") from None
    err = _validate(source)
    if err:
        path = _locate(schema, err)
        feature = None
        if err.startswith(_UNIMPLEMENTED):
            feature = ", ".join(json.loads(err[len(_UNIMPLEMENTED):].splitlines()[0]))
            msg = f"the JSON schema uses {feature}, which this server does not support"
        else:
            msg = f"invalid JSON schema: {' '.join(err.split())}"
        if path:
            msg += f" (at {path})"
        raise GrammarError(msg, path=path, feature=feature)
    return Grammar(source, description)


def _locate(schema: Any, err: str) -> str:
    """JSON pointer of the deepest sub-schema that fails on its own with the root's error (the root's
    $defs/definitions ride along so that references resolve); '' when only the whole schema fails."""
    defs = {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema, dict) and k in schema}
    best = ""

    def walk(node: Any, path: str) -> None:
        nonlocal best
        if not isinstance(node, dict):
            return
        if path:
            try:
                e = _validate(_schema_source({**defs, **node}))
            except ValueError:
                e = err
            if e != err:
                return  # the error does not live under here
            if path.count("/") >= best.count("/"):  # ties: the later (a $defs entry over its $ref)
                best = path
        for k in _SUB_ONE:
            if k in node:
                walk(node[k], f"{path}/{k}")
        for k in _SUB_LIST:
            if isinstance(node.get(k), list):
                for i, sub in enumerate(node[k]):
                    walk(sub, f"{path}/{k}/{i}")
        for k in _SUB_MAP:
            if isinstance(node.get(k), dict):
                for name, sub in node[k].items():
                    walk(sub, f"{path}/{k}/{_escape(name)}")

    walk(schema, "")
    return best


def _escape(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")


def json_object_grammar() -> Grammar:
    """`response_format: {"type": "json_object"}`: any JSON object."""
    return compile_json_schema({"type": "object"}, "JSON object")


def json_schema_lark(schema: Any) -> str:
    """A lark `%json` item for `schema` with this module's JSON options (for grammars that embed JSON)."""
    s = {**schema, "x-guidance": JSON_OPTIONS} if isinstance(schema, dict) else schema
    return "%json " + json.dumps(s, ensure_ascii=False)


def lark_grammar(lark: str, description: str = "grammar") -> Grammar:
    """A grammar in llguidance's lark dialect (token ids as `<[id]>`, JSON as `%json {...}`)."""
    source = llg.LLMatcher.grammar_from_lark(lark)
    err = _validate(source)
    if err:
        raise GrammarError(f"invalid {description}: {' '.join(err.split())}")
    return Grammar(source, description)


@lru_cache(maxsize=4)
def matcher_tokenizer(tokenizer_json: str, vocab_size: int, eos_ids: tuple[int, ...]) -> llg.LLTokenizer:
    """llguidance's view of the model's vocabulary (~1.6 s for Qwen2's 151k tokens: cached per model).
    `vocab_size`: the logits' width (ids past the tokenizer's are never allowed); `eos_ids`: the ids the
    mask allows once the grammar is complete."""
    return llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_ids))


class GrammarMatcher:
    """One request's position in its grammar. Not thread-safe (one per sequence)."""

    def __init__(self, grammar: Grammar, tokenizer: llg.LLTokenizer):
        self.grammar = grammar
        self.vocab_size = tokenizer.vocab_size
        self._m = llg.LLMatcher(tokenizer, grammar.source, log_level=0)
        if self._m.is_error():
            raise GrammarError(f"{grammar.description}: {self._m.get_error()}")
        self.num_masks = 0  # bitmasks computed (tests assert the constrained path ran)

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write the allowed-next-token bits into `row`: int32 [ceil(V/32)], contiguous, on the CPU."""
        if row.dtype != torch.int32 or row.device.type != "cpu" or not row.is_contiguous() or row.dim() != 1:
            raise ValueError(f"bitmask row must be a contiguous int32 CPU vector, got {row.dtype} "
                             f"{tuple(row.shape)} on {row.device}")
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
        self.num_masks += 1

    def accept(self, token: int) -> bool:
        """Advance by `token`; False (and an error state) if the grammar did not allow it."""
        return self._m.consume_token(int(token))

    @property
    def error(self) -> str:
        return self._m.get_error()

    def is_accepting(self) -> bool:
        """The text so far is a complete sentence of the grammar."""
        return self._m.is_accepting()
