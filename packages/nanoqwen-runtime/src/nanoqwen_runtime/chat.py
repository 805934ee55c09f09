"""Chat template: render the container's jinja2 template exactly as transformers does.

transformers' `apply_chat_template` compiles the template in an `ImmutableSandboxedEnvironment` with
`trim_blocks=True, lstrip_blocks=True` and the `loopcontrols` extension, replaces the `tojson` filter
by a plain `json.dumps` (no HTML escaping, `ensure_ascii=False`), adds the globals `raise_exception`
(raises `TemplateError`) and `strftime_now`, and passes the special tokens (`bos_token`,
`eos_token`, ...) plus `messages`, `tools`, `documents` and `add_generation_prompt`. This module does the
same with jinja2 alone, so the rendered prompt is byte-identical (tests compare with transformers).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from os import PathLike
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplate", "ChatTemplateError"]

_ROLES = ("system", "user", "assistant", "tool")


class ChatTemplateError(ValueError):
    """Malformed messages, or the template itself raised (`raise_exception`) or failed to compile."""


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may reference."""

    def __init__(self, template: str, special_tokens: Mapping[str, str] | None = None):
        if not isinstance(template, str) or not template:
            raise ChatTemplateError("the chat template is empty")
        try:
            self._template = _environment().from_string(template)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template does not compile: {e} (line {e.lineno})") from None
        self.source = template
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_file(cls, path: str | PathLike) -> ChatTemplate:
        """From a `.nanoqwen` container (`chat_template`, special tokens from `config` + `tokenizer`)."""
        import nanoqwen_format as nqf

        with nqf.open(path) as f:
            return cls(f.chat_template, special_tokens_from(f.config, f.tokenizer_json))

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...])."""
        checked = []
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or "role" not in m:
                raise ChatTemplateError(f"message {i} must be a mapping with 'role' and 'content', got {m!r}")
            if m["role"] not in _ROLES:
                raise ChatTemplateError(f"message {i}: unknown role {m['role']!r} (expected one of {_ROLES})")
            if m["role"] != "assistant" and not isinstance(m.get("content"), str):
                raise ChatTemplateError(f"message {i}: content must be a string")
            checked.append(dict(m))
        if not checked:
            raise ChatTemplateError("no messages to render")
        ctx = {**self.special_tokens, **kwargs}
        try:
            return self._template.render(messages=checked, tools=list(tools) if tools else None,
                                         documents=None, add_generation_prompt=add_generation_prompt, **ctx)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e}") from None


def special_tokens_from(config: Mapping[str, Any], tokenizer_json: str) -> dict[str, str]:
    """`bos_token`, `eos_token`, `pad_token` strings from the container config's ids."""
    spec = json.loads(tokenizer_json)
    by_id = {t["id"]: t["content"] for t in spec.get("added_tokens") or []}
    vocab = spec.get("model", {}).get("vocab", {})
    missing = _wanted_ids(config) - by_id.keys()
    if missing:
        by_id.update({i: t for t, i in vocab.items() if i in missing})
    out = {}
    for key, cfg_key in (("bos_token", "bos_token_id"), ("pad_token", "pad_token_id")):
        tid = config.get(cfg_key)
        if isinstance(tid, int) and tid in by_id:
            out[key] = by_id[tid]
    eos = config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if isinstance(eos, int) and eos in by_id:
        out["eos_token"] = by_id[eos]
    return out


def special_tokens_of(config: Mapping[str, Any], tokenizer: Any) -> dict[str, str]:
    """`special_tokens_from` with a built `tokenizer.Tokenizer` (its `id_to_token`) instead of the
    tokenizer JSON, which is then not parsed a second time."""
    out = {}
    keys = (("bos_token", "bos_token_id"), ("pad_token", "pad_token_id"), ("eos_token", "eos_token_id"))
    for key, cfg_key in keys:
        tid = config.get(cfg_key)
        tid = tid[0] if isinstance(tid, list) and tid else tid
        if isinstance(tid, int) and not isinstance(tid, bool):
            try:
                out[key] = tokenizer.id_to_token(tid)
            except KeyError:
                pass
    return out


def _wanted_ids(config: Mapping[str, Any]) -> set[int]:
    ids = set()
    for k in ("bos_token_id", "pad_token_id", "eos_token_id"):
        v = config.get(k)
        ids.update(v if isinstance(v, list) else [v] if isinstance(v, int) else [])
    return ids
