"""Text generation on top of any `Backend`: prompts in, streamed text and statistics out.

`Pipeline.load(path, device=...)` reads everything from one `.nanoqwen` container (tokenizer, chat
template, EOS ids, generation defaults) and builds the backend. `Pipeline.stream(prompts)` yields
`TextEvent`s as tokens arrive: the text of each token is produced by a `StreamDecoder` (never half a
UTF-8 character) and passed through a `StopMatcher` (text from a stop string on is never shown).
EOS tokens end a request without adding text. Every request ends with a `GenerationResult` carrying
its statistics. A request the model fails at run time (its logits hold NaN/Inf: a backend's
`events.ErrorEvent`) ends with `finish_reason == "error"` and `GenerationResult.error`, a one-line
message; no token is sampled from such logits, so nothing garbled is shown. `stream`/`generate` do
not raise for it (the other prompts of the call go on); the caller decides (`nanoqwen-cli`: one line
on stderr, exit code 1).

    prompt_tokens, generated_tokens
    ttft_s        start of the call -> first generated token (tokenizing excluded, prefill included)
    decode_tok_s  (generated_tokens - 1) / (time from the first to the last token)
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from os import PathLike
from typing import Any

import nanoqwen_format as nqf
import torch

from .backend import Backend, ReferenceBackend, TokenRequest
from .chat import ChatTemplate, special_tokens_of
from .container import opened
from .events import FINISH_ERROR, FINISH_STOP, ErrorEvent
from .fim import Way, choose_way, model_variant
from .sampling import SamplingParams, StopMatcher
from .tokenizer import Tokenizer

__all__ = ["Pipeline", "TextEvent", "GenerationResult", "generation_defaults"]


@dataclass
class GenerationResult:
    index: int
    prompt_tokens: int
    token_ids: list[int]
    text: str
    finish_reason: str           # "eos", "length", "context", "stop" or "error"
    ttft_s: float
    decode_s: float
    error: str | None = None     # finish_reason "error": what failed, one line

    @property
    def generated_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def decode_tok_s(self) -> float:
        n = self.generated_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else float("nan")

    def stats(self) -> dict[str, Any]:
        out = {"prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens,
               "ttft_s": round(self.ttft_s, 4), "decode_tok_s": round(self.decode_tok_s, 3),
               "finish_reason": self.finish_reason}
        if self.error is not None:
            out["error"] = self.error
        return out


@dataclass
class TextEvent:
    index: int
    text: str                    # new text to show (may be "")
    token_id: int | None         # None on the last event of a request that ended with an error
    result: GenerationResult | None = None  # set on the request's last event


def generation_defaults(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The container's `generation` map (temperature, top_p, top_k, max_new_tokens, eos_token_ids)."""
    return dict(metadata.get("generation") or {})


@dataclass
class _Track:
    prompt_tokens: int
    decoder: Any
    stop: StopMatcher
    eos_ids: frozenset[int] = frozenset()
    ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    t_first: float | None = None


class Pipeline:
    """Tokenizer + chat template + backend, read from one container."""

    def __init__(self, backend: Backend | None, tokenizer: Tokenizer, template: ChatTemplate | None,
                 eos_ids: Sequence[int], defaults: Mapping[str, Any] | None = None,
                 variant: tuple[str, str] | None = None, hidden_size: int | None = None):
        self.backend = backend
        # ("base" | "instruct", why): fim.model_variant of the container; None when not from one
        self.variant = variant
        self.hidden_size = hidden_size  # the model's (config hidden_size); None when not from a container
        self.tokenizer = tokenizer
        self.template = template
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        self.defaults = dict(defaults or {})

    @classmethod
    def load(cls, path: str | PathLike, device: str = "cpu", dtype: torch.dtype = torch.float32, *,
             verify: bool = True, **backend_kwargs) -> Pipeline:
        """Open a container and build the reference backend on `device` ('cpu' or 'cuda').

        verify (default): every tensor's checksum and finite weights are checked as they load
        (`nanoqwen_format.ChecksumError` / `integrity.NonFiniteWeightError`, naming the tensor);
        `verify=False` skips both (the index and metadata checksums are always checked)."""
        with opened(path) as f:
            return cls.from_file(f, ReferenceBackend.from_file(f, device=device, dtype=dtype, verify=verify,
                                                               **backend_kwargs))

    @classmethod
    def from_container(cls, path: str | PathLike, backend: Backend | None) -> Pipeline:
        """Tokenizer, chat template, EOS ids and generation defaults from `path`, around any backend
        (None: the text side only; set `backend` before streaming)."""
        with opened(path) as f:
            return cls.from_file(f, backend)

    @classmethod
    def from_file(cls, f: nqf.NanoqwenFile, backend: Backend | None) -> Pipeline:
        """`from_container` on a container already open (container.py): its metadata is read, the
        tokenizer JSON parsed once (the chat template's special tokens come from that tokenizer)."""
        tok = Tokenizer.from_json(f.tokenizer_json)
        template = (ChatTemplate(f.chat_template, special_tokens_of(f.config, tok)) if f.chat_template
                    else None)
        defaults = generation_defaults(f.metadata)
        eos = defaults.get("eos_token_ids") or f.config.get("eos_token_id") or []
        eos = eos if isinstance(eos, list) else [eos]
        return cls(backend, tok, template, eos, defaults, model_variant(f.metadata),
                   int(f.config["hidden_size"]))

    @property
    def infill_way(self) -> Way:
        """How this model is prompted to fill in the middle unless a request says (fim.choose_way): a
        pipeline not read from a container is taken as a base model."""
        if self.variant is None or self.hidden_size is None:
            return "fim"
        return choose_way(self.variant[0], self.hidden_size)

    def sampling_params(self, **overrides: Any) -> SamplingParams:
        """SamplingParams from the container defaults, overridden by the non-None `overrides`."""
        d = self.defaults
        base = {"temperature": d.get("temperature", 0.0), "top_p": d.get("top_p", 1.0),
                "top_k": d.get("top_k", 0), "max_tokens": d.get("max_new_tokens", 256)}
        base.update({k: v for k, v in overrides.items() if v is not None})
        return SamplingParams(**base)

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]]) -> str:
        if self.template is None:
            raise ValueError("this container has no chat template")
        return self.template.render(messages, add_generation_prompt=True)

    def stream(self, prompts: Sequence[str | Sequence[int]],
               params: SamplingParams | Sequence[SamplingParams],
               eos_ids: Sequence[Iterable[int]] | None = None) -> Iterator[TextEvent]:
        """Generate for several prompts at once (text, or token ids); yields events as tokens arrive.
        `eos_ids`: per prompt, the ids that end it (their text is not shown) instead of the container's
        (fill-in-the-middle adds its own end tokens: fim.py)."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        eos = [frozenset(int(t) for t in e) for e in eos_ids] if eos_ids is not None \
            else [self.eos_ids] * len(prompts)
        if len(eos) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(eos)} eos_ids sets")
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        requests = [TokenRequest(tuple(i), p, e) for i, p, e in zip(ids, params, eos, strict=True)]
        tracks = [_Track(len(i), self.tokenizer.stream_decoder(), StopMatcher(p.stop), e)
                  for i, p, e in zip(ids, params, eos, strict=True)]
        t0 = time.perf_counter()
        run = self.backend.start(requests)
        open_requests = set(range(len(requests)))
        try:
            yield from self._events(run, tracks, open_requests, t0)
        finally:
            # closed early (the caller stopped iterating, Ctrl-C): end what is still running, so the
            # backend holds nothing of this call and is ready for the next
            for i in sorted(open_requests):
                run.finish(i)

    def _events(self, run, tracks: list[_Track], open_requests: set[int], t0: float) -> Iterator[TextEvent]:
        for events in run:
            now = time.perf_counter()
            for ev in events:
                tr = tracks[ev.request]
                if tr.t_first is None:
                    tr.t_first = now
                reason = ev.finish_reason
                if isinstance(ev, ErrorEvent):  # no token: flush the text held back so far, then end
                    token, piece = None, tr.decoder.flush()
                else:
                    token = ev.token_id
                    tr.ids.append(token)
                    piece = "" if token in tr.eos_ids else tr.decoder.push(token)
                    if reason is not None:
                        piece += tr.decoder.flush()
                shown, stopped = tr.stop.push(piece)
                if stopped and reason is None:
                    reason = FINISH_STOP
                    run.finish(ev.request)
                if reason is not None and not stopped:
                    shown += tr.stop.flush()
                tr.text.append(shown)
                result = None
                if reason is not None:
                    open_requests.discard(ev.request)
                    error = ev.message if reason == FINISH_ERROR else None
                    result = GenerationResult(ev.request, tr.prompt_tokens, tr.ids, "".join(tr.text), reason,
                                              ttft_s=tr.t_first - t0, decode_s=now - tr.t_first, error=error)
                yield TextEvent(ev.request, shown, token, result)

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams],
                 eos_ids: Sequence[Iterable[int]] | None = None) -> list[GenerationResult]:
        """Like `stream`, collecting one result per prompt (in prompt order)."""
        results: list[GenerationResult | None] = [None] * len(prompts)
        for ev in self.stream(prompts, params, eos_ids):
            if ev.result is not None:
                results[ev.index] = ev.result
        return results  # type: ignore[return-value]
