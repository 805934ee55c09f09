"""Constrained decoding (grammar.py, token_mask.py) on the CPU: the bitmask against a brute-force check
of every token on a tiny vocabulary, the torch mask op against a bit-by-bit loop, schema errors that
name the feature and the path, and both engines (the reference engine and the CUDA engine's code on
the torch backend) running constrained and unconstrained rows in one batch, never speculating, taking
the masks of a step planned ahead after its forward, stopping when the grammar is complete and ending
with "length" when it cannot complete."""

from __future__ import annotations

import json

import pytest
import torch
from engine_testkit import cpu_config
from nanoqwen_runtime.engine import Engine, FinishEvent, Request
from nanoqwen_runtime.grammar import (
    GrammarError,
    GrammarMatcher,
    compile_json_schema,
    lark_grammar,
    matcher_tokenizer,
)
from nanoqwen_runtime.reference_engine import ReferenceEngine, ReferenceEngineConfig
from nanoqwen_runtime.sampling import SamplingParams
from nanoqwen_runtime.speculative import SpeculationConfig
from nanoqwen_runtime.testing import engine_events, tiny_config, tiny_tokenizer_json, write_tiny_container
from nanoqwen_runtime.token_mask import allowed_tokens, apply_token_bitmask_, bitmask_words, full_bitmask
from nanoqwen_runtime.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 22]}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny_tok():
    cfg = tiny_config()
    eos = tuple(cfg["eos_token_id"]) if isinstance(cfg["eos_token_id"], list) else (cfg["eos_token_id"],)
    tj = tiny_tokenizer_json()
    return Tokenizer.from_json(tj), matcher_tokenizer(tj, cfg["vocab_size"], eos), cfg["vocab_size"], eos


def _brute_force_allowed(m: GrammarMatcher, vocab: int) -> list[int]:
    """Every token whose consumption a copy of the matcher accepts."""
    out = []
    for t in range(vocab):
        c = m._m.deep_copy()
        if c.consume_token(t) and not c.is_error():
            out.append(t)
    return out


def test_bitmask_matches_brute_force_on_a_tiny_vocabulary(tiny_tok):
    tok, lt, vocab, eos = tiny_tok
    m = GrammarMatcher(compile_json_schema(SCHEMA), lt)
    doc = '{"ok": true, "n": 22}'
    for step, t in enumerate([*tok.encode(doc), eos[0]]):
        row = full_bitmask(1, vocab)[0]
        m.fill_bitmask(row)
        allowed = allowed_tokens(row, vocab)
        assert allowed == _brute_force_allowed(m, vocab), step
        assert t in allowed, (step, t)
        if t in eos:
            assert m.is_accepting() and set(allowed) <= set(eos)  # complete: only EOS
        else:
            assert m.accept(t), m.error
    assert m.num_masks == len(tok.encode(doc)) + 1


def test_apply_token_bitmask_against_a_bit_loop():
    g = torch.Generator().manual_seed(0)
    for B, V in ((1, 1), (3, 31), (2, 33), (5, 100), (4, 1001)):
        W = bitmask_words(V) + (1 if V == 100 else 0)  # a wider mask than needed is fine
        masks = torch.randint(-2**31, 2**31 - 1, (B, W), generator=g, dtype=torch.int64).to(torch.int32)
        masks[0] = -1  # an unconstrained row is left as it is
        logits = torch.randn(B, V, generator=g)
        want = logits.clone()
        for b in range(B):
            ok = set(allowed_tokens(masks[b], V))
            for t in range(V):
                if t not in ok:
                    want[b, t] = float("-inf")
        got = apply_token_bitmask_(logits.clone(), masks)
        assert torch.equal(got, want), (B, V)
        assert torch.equal(got[0], logits[0])
    strided = torch.randn(2, 40, generator=g)
    apply_token_bitmask_(strided[:, :37], torch.zeros(2, 2, dtype=torch.int32))
    assert torch.isinf(strided[:, :37]).all() and torch.isfinite(strided[:, 37:]).all()
    with pytest.raises(ValueError, match="does not cover"):
        apply_token_bitmask_(torch.zeros(1, 65), torch.zeros(1, 2, dtype=torch.int32))


@pytest.mark.parametrize("schema,feature,path", [
    ({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}, "uniqueItems",
     "/properties/tags"),
    ({"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "strin"}}}}},
     None, "/properties/a/properties/b"),
    ({"properties": {"x": {"$ref": "#/$defs/A"}}, "$defs": {"A": {"if": {"type": "string"}, "then": {}}}},
     "if, then", "/$defs/A"),
])
def test_schema_errors_name_the_feature_and_the_path(schema, feature, path):
    with pytest.raises(GrammarError) as e:
        compile_json_schema(schema)
    assert e.value.feature == feature and e.value.path == path, e.value.message
    assert path in e.value.message and (feature is None or feature in e.value.message)


def _engines(tmp_path, speculation=None):
    path = write_tiny_container(tmp_path / "tiny.nanoqwen", seed=1)
    ref = ReferenceEngine.from_file(path, ReferenceEngineConfig(kv_memory_bytes=8 << 20,
                                                                speculation=speculation))
    eng = Engine.from_file(path, cpu_config(max_model_len=256, speculation=speculation))
    return ref, eng


def _requests(grammar, prompt, max_tokens=24):
    return [Request(list(prompt), SamplingParams(max_tokens=max_tokens), request_id="free"),
            Request(list(prompt), SamplingParams(max_tokens=max_tokens), request_id="json", grammar=grammar),
            Request(list(prompt), SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=5),
                    request_id="json-sampled", grammar=grammar)]


def test_constrained_and_unconstrained_rows_share_a_batch(tmp_path):
    """Both engines: one free row and two constrained rows (greedy, sampled) in the same steps. The
    constrained outputs are valid JSON under the schema and end with EOS (the grammar completes);
    the free row's tokens are those it gets alone (the mask left its logits alone); every constrained
    token was sampled under a mask. The CUDA engine's code kept overlapping: its steps with constrained
    rows went ahead, each masked after the step before it was committed, and gave the tokens of the
    same engine without overlap."""
    grammar = compile_json_schema({"type": "object", "properties": {"ok": {"type": "boolean"}},
                                   "required": ["ok"], "additionalProperties": False})
    ref, eng = _engines(tmp_path)
    sync = Engine.from_file(tmp_path / "tiny.nanoqwen", cpu_config(max_model_len=256, overlap=False))
    tok = ref.tokenizer
    prompt = tok.encode("def f(x):\n    return")
    outputs = {}
    for name, engine in (("ref", ref), ("overlap", eng), ("sync", sync)):
        alone, _ = engine_events(engine, [Request(list(prompt), SamplingParams(max_tokens=24),
                                                  request_id="a")])
        toks, fins = engine_events(engine, _requests(grammar, prompt))
        assert toks["free"] == alone["a"]
        for rid in ("json", "json-sampled"):
            assert fins[rid].reason == "eos", (rid, fins[rid])
            text = tok.decode(toks[rid][:-1])
            assert set(json.loads(text)) == {"ok"} and isinstance(json.loads(text)["ok"], bool), text
        masked = sum(len(toks[r]) for r in ("json", "json-sampled"))
        assert engine.num_masked_rows == masked  # every constrained token was sampled under a mask
        engine.check_accounting()
        outputs[name] = toks
    assert outputs["overlap"] == outputs["sync"]
    assert eng.num_steps_ahead_masked > 0 and sync.num_steps_ahead_masked == 0


def test_a_grammar_that_cannot_finish_ends_with_length(tmp_path):
    grammar = lark_grammar('start: "ab" "c"* "d"')
    ref, eng = _engines(tmp_path)
    for engine in (ref, eng):
        toks, fins = engine_events(engine, [Request(ref.tokenizer.encode("x"), SamplingParams(max_tokens=6),
                                                    request_id="r", grammar=grammar)])
        text = ref.tokenizer.decode(toks["r"])
        assert fins["r"].reason == "length" and len(toks["r"]) == 6
        assert text.startswith("ab") and set(text[2:]) <= {"c", "d"} and "d" not in text[:-1]


def test_constrained_requests_are_not_speculated(tmp_path):
    spec = SpeculationConfig(k=4)
    ref, eng = _engines(tmp_path, speculation=spec)
    grammar = lark_grammar('start: ("ab")+ "."')
    prompt = ref.tokenizer.encode("abababababababab")
    for engine in (ref, eng):
        toks, fins = engine_events(engine, [Request(list(prompt), SamplingParams(max_tokens=8),
                                                    request_id="g", grammar=grammar)])
        assert engine.stats().spec_drafted_tokens == 0
        assert ref.tokenizer.decode(toks["g"]).startswith("ab")


def test_refusals(tmp_path):
    ref, eng = _engines(tmp_path)
    grammar = lark_grammar('start: "a"')
    for engine in (ref, eng):
        ev = engine.submit(Request([1, 2], SamplingParams(max_tokens=2), ignore_eos=True, grammar=grammar))
        assert isinstance(ev, FinishEvent) and ev.reason == "refused" and "ignore_eos" in ev.detail
    path = write_tiny_container(tmp_path / "t2.nanoqwen", seed=1)
    off = Engine.from_file(path, cpu_config(token_mask=False))
    ev = off.submit(Request([1, 2], SamplingParams(max_tokens=2), grammar=grammar))
    assert ev.reason == "refused" and "token mask" in ev.detail
