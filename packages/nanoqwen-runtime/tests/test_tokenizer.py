"""Tokenizer: ids identical to HF `tokenizers`, streaming decode, errors.

Unit tests use the hand-built tiny tokenizer (Qwen2 pre-tokenizer, few merges) so they run without
the model; `test_qwen05b_*` use the real Qwen2 tokenizer (transformers' own GGUF conversion as the
oracle) on every Python standard library source file.
"""

from __future__ import annotations

import json
import random
import sysconfig
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nanoqwen_runtime import Tokenizer
from nanoqwen_runtime.testing import tiny_tokenizer_json
from nanoqwen_runtime.tokenizer import TokenizerError
from tokenizers import Tokenizer as HFTokenizer

TRICKY = [
    "", " ", "  ", "\n", "\r\n\r\n", "\t\t x", "a  b   c", "x \n\n  y", "   \n",
    "héllo wörld", "日本語のテキスト", "emoji 😀👍🏽 family 👨‍👩‍👧", "e\u0301 (combining)", "Ǆ ǅ ǆ",
    "it's we're they'll I'M YOU'VE he'd", "12345 3.14159 0x1F 1e-9 ١٢٣",
    "def f(x):\n    return x**2  # comment\n", "if a!=b:\r\n\tpass", "foo(*args, **kwargs)",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|><|endoftext|>",
    "a<|im_end|>b", "<|im_start|", "<tool_call>{}</tool_call>", "\u00a0nbsp\u2003em space",
    "\x00\x01\x1f control", "ſ ﬁ Σσς", "a" * 300, " " * 257 + "x",
]


def stdlib_files(limit: int | None = None) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    return files[:limit] if limit else files


def read_text(p: Path) -> str:
    return p.read_bytes().decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def tiny_pair():
    s = tiny_tokenizer_json()
    return Tokenizer.from_json(s), HFTokenizer.from_str(s)


def test_tiny_matches_hf_on_tricky_text(tiny_pair):
    ours, hf = tiny_pair
    for text in TRICKY:
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False).ids, repr(text)
        assert ours.decode(ours.encode(text)) == text


def test_tiny_matches_hf_on_stdlib_sample(tiny_pair):
    ours, hf = tiny_pair
    files = stdlib_files()
    texts = [read_text(p) for p in random.Random(0).sample(files, 60)]
    want = [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]
    assert [ours.encode(t) for t in texts] == want


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)
       | st.lists(st.sampled_from(["<|im_end|>", " ", "\n", "ab", "'s", "😀", "x1", "\r"]),
                  max_size=12).map("".join))
def test_tiny_matches_hf_fuzz(tiny_pair, text):
    ours, hf = tiny_pair
    assert ours.encode(text) == hf.encode(text, add_special_tokens=False).ids


def test_stream_decoder_never_splits_a_character(tiny_pair):
    ours, _ = tiny_pair
    text = "aé日😀b" * 3 + "<|im_end|>"
    ids = ours.encode(text)
    assert len(ids) > len(text) // 2  # multi-byte characters are several byte tokens here
    dec = ours.stream_decoder()
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == text
    for piece in pieces:
        assert "\ufffd" not in piece
    # a dangling partial character comes out as U+FFFD only at the end, like decode()
    partial = ours.encode("😀")[:2]
    dec = ours.stream_decoder()
    assert [dec.push(i) for i in partial] == ["", ""]
    assert dec.flush() == "\ufffd" == ours.decode(partial)


def test_skip_special_tokens(tiny_pair):
    ours, _ = tiny_pair
    ids = ours.encode("<|im_start|>x<tool_call><|im_end|>")
    assert ours.decode(ids, skip_special_tokens=True) == "x<tool_call>"  # <tool_call> is not special
    dec = ours.stream_decoder(skip_special_tokens=True)
    assert "".join(dec.push(i) for i in ids) == "x<tool_call>"


def test_errors(tiny_pair):
    ours, _ = tiny_pair
    with pytest.raises(TokenizerError, match="not in the vocabulary"):
        ours.decode([10**6])
    with pytest.raises(TypeError):
        ours.encode(b"bytes")
    spec = json.loads(tiny_tokenizer_json())
    spec["model"]["type"] = "Unigram"
    with pytest.raises(TokenizerError, match="only BPE"):
        Tokenizer.from_json(json.dumps(spec))
    with pytest.raises(TokenizerError, match="not valid JSON"):
        Tokenizer.from_json("{")


def test_from_file_reads_the_container(tiny_bf16, tiny_pair):
    tok = Tokenizer.from_file(tiny_bf16)
    assert tok.encode("def self.x <|im_end|>") == tiny_pair[0].encode("def self.x <|im_end|>")


# ---------------------------------------------------------------- the real Qwen2 tokenizer


@pytest.fixture(scope="module")
def qwen_pair(qwen_hf_tokenizer):
    s = qwen_hf_tokenizer.backend_tokenizer.to_str()
    return Tokenizer.from_json(s), HFTokenizer.from_str(s)


@pytest.mark.model
def test_qwen05b_matches_hf_on_all_stdlib_sources(qwen_pair):
    ours, hf = qwen_pair
    files = stdlib_files()
    assert len(files) > 500
    texts = [read_text(p) for p in files]
    want = [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]
    mismatched = [str(p) for p, t, w in zip(files, texts, want, strict=True) if ours.encode(t) != w]
    assert not mismatched, mismatched[:5]


@pytest.mark.model
def test_qwen05b_matches_hf_with_special_tokens(qwen_pair):
    ours, hf = qwen_pair
    extra = ["<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>", "<|repo_name|>x<|file_sep|>a.py\n",
             "<|object_ref_start|>" * 3, "<|im_start|>system\nYou are Qwen.<|im_end|>\n"]
    for text in TRICKY + extra:
        ids = ours.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False).ids, repr(text)
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=False)
    assert ours.encode("<|im_end|>") == [151645]


@pytest.mark.model
def test_qwen05b_container_tokenizer_equals_oracle(qwen_packed_none, qwen_pair):
    tok = Tokenizer.from_file(qwen_packed_none)
    text = read_text(stdlib_files()[0]) + "<|im_start|>assistant\n"
    assert tok.encode(text) == qwen_pair[1].encode(text, add_special_tokens=False).ids


@pytest.mark.model
def test_qwen05b_encode_speed_at_least_1mb_per_s(qwen_pair):
    """>= 1 MB/s of code on one core, from a cold word cache (CPU time, robust to a busy machine)."""
    tok = Tokenizer.from_json(qwen_pair[1].to_str())
    texts = [read_text(p) for p in stdlib_files()[:400]]
    nbytes = sum(len(t.encode()) for t in texts)
    assert nbytes > 3_000_000
    t0 = time.process_time()
    for t in texts:
        tok.encode(t)
    mb_s = nbytes / (time.process_time() - t0) / 1e6
    print(f"encode: {mb_s:.2f} MB/s over {nbytes / 1e6:.1f} MB (cold cache)")
    assert mb_s >= 1.0
