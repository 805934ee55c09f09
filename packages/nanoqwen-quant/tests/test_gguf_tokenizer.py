"""`sources.with_gguf_added_tokens`: a GGUF's control and user-defined tokens end up among the packed
tokenizer's added tokens at their GGUF ids, whatever transformers' conversion kept (one version on the
device left out the FIM tokens, so its containers could not infill). No model needed: the conversion's
output is made up here."""

from __future__ import annotations

import json
import re

import pytest
from nanoqwen_quant.sources import SourceError, with_gguf_added_tokens

TOKENS = ["a", "b", "<|endoftext|>", "<tool_call>", "<|fim_prefix|>", "[PAD5]"]
KINDS = [1, 1, 3, 4, 3, 5]  # normal, normal, control, user-defined, control, unused


def converted(*added: tuple[int, str]) -> str:
    return json.dumps({"model": {"type": "BPE"}, "added_tokens": [
        {"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": True} for i, c in added]})


def test_missing_control_and_user_defined_tokens_are_added_at_their_ids():
    got = json.loads(with_gguf_added_tokens(converted((2, "<|endoftext|>")), TOKENS, KINDS))
    assert [(t["id"], t["content"], t["special"]) for t in got["added_tokens"]] == [
        (2, "<|endoftext|>", True), (3, "<tool_call>", False), (4, "<|fim_prefix|>", True)]
    assert got["model"] == {"type": "BPE"}  # nothing else touched; unused tokens never added


def test_a_complete_conversion_comes_back_byte_for_byte():
    full = converted((2, "<|endoftext|>"), (3, "<tool_call>"), (4, "<|fim_prefix|>"))
    assert with_gguf_added_tokens(full, TOKENS, KINDS) is full


def test_an_added_token_at_another_id_is_refused():
    with pytest.raises(SourceError, match=re.escape("'<|fim_prefix|>' at id 3, the GGUF at 4")):
        with_gguf_added_tokens(converted((3, "<|fim_prefix|>")), TOKENS, KINDS)
