"""Qwen2 byte-level BPE tokenizer in pure Python (no Rust `tokenizers`).

It reads the HF `tokenizer.json` that the container stores under the metadata key `tokenizer` and
reproduces what HF `tokenizers` does with it, step by step:

1. **Added tokens** (`<|im_start|>`, `<|endoftext|>`, `<tool_call>`, ...) are cut out of the raw text
   first, leftmost-longest, and map straight to their ids; they are never split by BPE.
2. **Normalizer**: `null` or `NFC` (Qwen2's own files use NFC; the GGUF conversion stores none).
3. **Pre-tokenizer**: the Split regex from the file (Qwen2's pattern, `Isolated`), then ByteLevel:
   every UTF-8 byte of a piece becomes one printable character of the GPT-2 byte alphabet.
4. **BPE** on each piece with the merge ranks (lowest rank first, left to right on ties). The ids of a
   piece are cached, so repeated words (most of source code) cost one dict lookup.

Decoding maps tokens back to bytes through the inverse byte alphabet and decodes UTF-8 with
replacement characters, as HF's ByteLevel decoder does. `StreamDecoder` does the same incrementally
and never emits half a UTF-8 character: bytes of an incomplete character wait for the next token.
"""

from __future__ import annotations

import codecs
import json
import unicodedata
from collections.abc import Iterable
from os import PathLike

import regex

__all__ = ["Tokenizer", "StreamDecoder", "TokenizerError", "bytes_to_unicode"]

# Words longer than this are not cached (a 10 kB run of spaces would pollute the cache for nothing).
_MAX_CACHED_WORD = 64
_MAX_CACHE_ENTRIES = 1 << 20


class TokenizerError(ValueError):
    """The tokenizer description is malformed or uses a feature this tokenizer does not implement."""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (256 entries)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


_BYTE_TO_CHAR = bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}
# str.translate table applied to `utf8_bytes.decode("latin-1")`: byte value -> byte-level char.
_LATIN1_TO_BYTELEVEL = {b: c for b, c in _BYTE_TO_CHAR.items()}


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise TokenizerError(msg)


class Tokenizer:
    """Qwen2 byte-level BPE tokenizer.

    Build it with `Tokenizer.from_file(path_of_a_nanoqwen_container)` or
    `Tokenizer.from_json(tokenizer_json_string)`.
    """

    def __init__(self, tokenizer_json: str):
        try:
            spec = json.loads(tokenizer_json)
        except json.JSONDecodeError as e:
            raise TokenizerError(f"tokenizer.json is not valid JSON: {e}") from None
        model = spec.get("model") or {}
        _check(model.get("type") == "BPE", f"only BPE models are supported, got {model.get('type')!r}")
        _check(not model.get("dropout"), "BPE dropout is not supported")
        _check(not model.get("continuing_subword_prefix") and not model.get("end_of_word_suffix"),
               "continuing_subword_prefix / end_of_word_suffix are not supported")
        _check(not model.get("byte_fallback"), "byte_fallback is not supported")
        self._normalizer = self._parse_normalizer(spec.get("normalizer"))
        self._pattern = regex.compile(self._parse_pre_tokenizer(spec.get("pre_tokenizer")))
        dec = spec.get("decoder") or {}
        _check(dec.get("type") == "ByteLevel", f"only the ByteLevel decoder is supported, got {dec!r}")

        self.vocab: dict[str, int] = dict(model["vocab"])
        self._ranks: dict[tuple[str, str], int] = {}
        for rank, m in enumerate(model["merges"]):
            a, b = m.split(" ", 1) if isinstance(m, str) else m
            self._ranks[(a, b)] = rank
        self._id_to_token: dict[int, str] = {i: t for t, i in self.vocab.items()}

        self.added_tokens: dict[str, int] = {}
        self.special_ids: set[int] = set()
        for t in spec.get("added_tokens") or []:
            _check(not t.get("lstrip") and not t.get("rstrip") and not t.get("single_word"),
                   f"added token {t['content']!r}: lstrip/rstrip/single_word are not supported")
            self.added_tokens[t["content"]] = t["id"]
            self._id_to_token[t["id"]] = t["content"]
            if t.get("special"):
                self.special_ids.add(t["id"])
        # Leftmost-longest matching of added tokens: longer alternatives first.
        if self.added_tokens:
            alts = sorted(self.added_tokens, key=len, reverse=True)
            self._added_re = regex.compile("|".join(regex.escape(a) for a in alts))
        else:
            self._added_re = None
        self._cache: dict[str, tuple[int, ...]] = {}
        self.vocab_size = max(self._id_to_token) + 1
        self.source_json = tokenizer_json  # the HF tokenizer.json text (grammar.matcher_tokenizer reads it)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_json(cls, tokenizer_json: str) -> Tokenizer:
        """Build from the text of an HF `tokenizer.json`."""
        return cls(tokenizer_json)

    @classmethod
    def from_file(cls, path: str | PathLike) -> Tokenizer:
        """Build from a `.nanoqwen` container (metadata key `tokenizer`)."""
        import nanoqwen_format as nqf

        with nqf.open(path) as f:
            return cls(f.tokenizer_json)

    @staticmethod
    def _parse_normalizer(spec) -> str | None:
        if spec is None:
            return None
        if spec.get("type") == "NFC":
            return "NFC"
        if spec.get("type") == "Sequence" and not spec.get("normalizers"):
            return None
        raise TokenizerError(f"unsupported normalizer {spec!r}")

    @staticmethod
    def _parse_pre_tokenizer(spec) -> str:
        _check(spec is not None, "a pre_tokenizer is required")
        parts = spec["pretokenizers"] if spec.get("type") == "Sequence" else [spec]
        pattern = None
        saw_byte_level = False
        for p in parts:
            if p["type"] == "Split":
                _check(pattern is None, "only one Split pre-tokenizer is supported")
                _check(p.get("behavior") == "Isolated" and not p.get("invert"),
                       f"unsupported Split pre-tokenizer {p!r}")
                pat = p["pattern"]
                pattern = pat["Regex"] if "Regex" in pat else regex.escape(pat["String"])
            elif p["type"] == "ByteLevel":
                _check(not p.get("add_prefix_space"), "ByteLevel add_prefix_space is not supported")
                if p.get("use_regex", True):
                    _check(pattern is None, "ByteLevel regex after a Split is not supported")
                    pattern = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+"
                               r"|\s+(?!\S)|\s+")
                saw_byte_level = True
            else:
                raise TokenizerError(f"unsupported pre-tokenizer {p['type']!r}")
        _check(saw_byte_level and pattern is not None, "expected a Split + ByteLevel pre-tokenizer")
        return pattern

    # ------------------------------------------------------------------ encoding
    def _bpe(self, word: str) -> tuple[int, ...]:
        """Ids of one pre-tokenized piece (raw text); BPE over its byte-level characters."""
        symbols = list(word.encode("utf-8").decode("latin-1").translate(_LATIN1_TO_BYTELEVEL))
        ranks = self._ranks
        while len(symbols) > 1:
            best_rank = None
            best_i = -1
            for i in range(len(symbols) - 1):
                r = ranks.get((symbols[i], symbols[i + 1]))
                if r is not None and (best_rank is None or r < best_rank):
                    best_rank, best_i = r, i
            if best_rank is None:
                break
            a, b = symbols[best_i], symbols[best_i + 1]
            merged = a + b
            out = symbols[:best_i]
            i = best_i
            n = len(symbols)
            while i < n:
                if i < n - 1 and symbols[i] == a and symbols[i + 1] == b:
                    out.append(merged)
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            symbols = out
        vocab = self.vocab
        try:
            return tuple(vocab[s] for s in symbols)
        except KeyError as e:
            raise TokenizerError(f"BPE produced a symbol missing from the vocabulary: {e}") from None

    def _encode_ordinary(self, text: str, out: list[int]) -> None:
        if self._normalizer:
            text = unicodedata.normalize(self._normalizer, text)
        cache = self._cache
        for word in self._pattern.findall(text):
            ids = cache.get(word)
            if ids is None:
                ids = self._bpe(word)
                if len(word) <= _MAX_CACHED_WORD:
                    if len(cache) >= _MAX_CACHE_ENTRIES:
                        cache.clear()
                    cache[word] = ids
            out.extend(ids)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`. Added/special tokens written in the text are recognised as such."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        out: list[int] = []
        if self._added_re is None:
            self._encode_ordinary(text, out)
            return out
        pos = 0
        for m in self._added_re.finditer(text):
            if m.start() > pos:
                self._encode_ordinary(text[pos:m.start()], out)
            out.append(self.added_tokens[m.group()])
            pos = m.end()
        if pos < len(text):
            self._encode_ordinary(text[pos:], out)
        return out

    def encode_text(self, text: str) -> list[int]:
        """Token ids of `text` as plain text: added/special tokens written in it (`<|fim_prefix|>`,
        `<|im_end|>`, ...) are encoded as the characters they are made of, never as control tokens.
        For text a user supplies inside a prompt the caller builds (fill-in-the-middle, fim.py)."""
        if not isinstance(text, str):
            raise TypeError(f"encode_text() takes a str, got {type(text).__name__}")
        out: list[int] = []
        self._encode_ordinary(text, out)
        return out

    # ------------------------------------------------------------------ decoding
    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (added tokens: their UTF-8 text)."""
        try:
            tok = self._id_to_token[token_id]
        except KeyError:
            raise TokenizerError(f"token id {token_id} is not in the vocabulary "
                                 f"(0..{self.vocab_size - 1} with gaps)") from None
        try:
            return bytes(_CHAR_TO_BYTE[c] for c in tok)
        except KeyError:
            # HF's ByteLevel decoder keeps a token's UTF-8 bytes when a char is outside the byte alphabet.
            return tok.encode("utf-8")

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 becomes U+FFFD (as HF's ByteLevel decoder)."""
        special = self.special_ids
        data = b"".join(self.token_bytes(int(i)) for i in ids
                        if not (skip_special_tokens and int(i) in special))
        return data.decode("utf-8", errors="replace")

    def id_to_token(self, token_id: int) -> str:
        return self._id_to_token[token_id]

    def token_to_id(self, token: str) -> int | None:
        return self.added_tokens.get(token, self.vocab.get(token))

    def stream_decoder(self, skip_special_tokens: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens)


class StreamDecoder:
    """Incremental detokenizer: `push(id) -> str` returns only complete UTF-8 characters.

    The concatenation of every `push` plus `flush()` equals `Tokenizer.decode` of all the ids.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if self._skip and token_id in self._tok.special_ids:
            return ""
        return self._dec.decode(self._tok.token_bytes(token_id), final=False)

    def flush(self) -> str:
        """Whatever bytes remain (an incomplete character at the end becomes U+FFFD)."""
        return self._dec.decode(b"", final=True)
