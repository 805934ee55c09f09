"""What happens to one request's generated tokens on their way out of an engine: stop rules and text.

Both engines (the reference engine that the CPU server runs, and the CUDA `Engine`) turn each sampled
token into `events.TokenEvent`s and end the request with one `FinishEvent` the same way:

    token --> EOS id (unless ignore_eos)?          --> TokenEvent(text "", "eos")   + FinishEvent(EOS)
          --> StreamDecoder.push (never half a UTF-8 character) --> StopMatcher.push
              stop string matched?                  --> TokenEvent(text before it, "stop") + FinishEvent
              num_generated >= max_tokens?          --> "length";  len(tokens) >= max_model_len? "context"

At a finish other than "stop", the decoder's and the matcher's held-back text is flushed into
`FinishEvent.text`. `RequestStream` holds that per-request state (decoder, matcher, timestamps); the
engine owns the scheduler `Sequence` it reads tokens from.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .engine.sequence import FinishReason, Sequence
from .events import TokenEvent
from .sampling import StopMatcher

__all__ = ["RequestStream", "FinishEvent", "Event"]


@dataclass
class FinishEvent:
    """The last event of a request: why it ended and its statistics."""

    request_id: str
    reason: FinishReason
    detail: str = ""                 # refusal or error reason (one line)
    text: str = ""                   # held-back text flushed at the end
    num_prompt_tokens: int = 0
    num_generated: int = 0
    num_preemptions: int = 0
    ttft_s: float = 0.0              # submit -> first token
    decode_tok_s: float = 0.0        # generated tokens after the first / time after the first
    tokens: list[int] = field(default_factory=list)


Event = TokenEvent | FinishEvent


@dataclass
class RequestStream:
    """Output state of one request. `decoder` is a `tokenizer.StreamDecoder`, or None (no text)."""

    seq: Sequence
    decoder: object | None
    stop: StopMatcher
    t_submit: float
    t_first: float = 0.0

    @classmethod
    def open(cls, seq: Sequence, tokenizer) -> RequestStream:
        """Stream of `seq`: a decoder when the request asks for text and a tokenizer exists."""
        dec = None
        if seq.request.detokenize and tokenizer is not None:
            dec = tokenizer.stream_decoder(skip_special_tokens=True)
        return cls(seq, dec, StopMatcher(seq.request.params.stop), time.perf_counter())

    def on_token(self, default_eos: tuple[int, ...], max_model_len: int
                 ) -> tuple[TokenEvent, FinishReason | None]:
        """Event of the token just appended to `seq.tokens`, and the finish reason it triggers (or None)."""
        seq = self.seq
        tok = seq.tokens[-1]
        idx = seq.num_generated - 1
        if idx == 0:
            self.t_first = time.perf_counter()
        rid = seq.request.request_id
        eos = seq.request.eos_ids if seq.request.eos_ids is not None else default_eos
        if tok in eos and not seq.request.ignore_eos:
            return TokenEvent(rid, tok, idx, "", FinishReason.EOS.value), FinishReason.EOS
        text = self.decoder.push(tok) if self.decoder is not None else ""
        shown, stopped = self.stop.push(text)
        reason = None
        if stopped:
            reason = FinishReason.STOP
        elif seq.num_generated >= seq.request.params.max_tokens:
            reason = FinishReason.LENGTH
        elif len(seq.tokens) >= max_model_len:
            reason = FinishReason.CONTEXT
        return TokenEvent(rid, tok, idx, shown, reason.value if reason else None), reason

    def emit_committed(self, default_eos: tuple[int, ...], max_model_len: int
                       ) -> tuple[list[TokenEvent], FinishReason | None]:
        """Events of the tokens the scheduler's last commit appended to `seq` (`num_new_tokens`, > 1
        after a verify step), one at a time, and the finish reason if one of them ends the request:
        that token is the last one kept, and accepted drafts after it are dropped from `seq.tokens`."""
        seq = self.seq
        n = seq.num_new_tokens
        new = seq.tokens[len(seq.tokens) - n:]
        del seq.tokens[len(seq.tokens) - n:]
        events: list[TokenEvent] = []
        for tok in new:
            seq.tokens.append(tok)
            ev, reason = self.on_token(default_eos, max_model_len)
            events.append(ev)
            if reason is not None:
                return events, reason
        return events, None

    def finish_event(self, reason: FinishReason, detail: str = "") -> FinishEvent:
        """The request's last event (call once, after the scheduler has finished the sequence)."""
        seq = self.seq
        tail = ""
        if reason is not FinishReason.STOP:
            if self.decoder is not None:
                tail, _ = self.stop.push(self.decoder.flush())
            tail += self.stop.flush()
        now = time.perf_counter()
        n = seq.num_generated
        dec = (n - 1) / (now - self.t_first) if n > 1 and now > self.t_first else 0.0
        return FinishEvent(seq.request.request_id, reason, detail, text=tail,
                           num_prompt_tokens=seq.num_prompt, num_generated=n,
                           num_preemptions=seq.num_preemptions,
                           ttft_s=(self.t_first - self.t_submit) if self.t_first else 0.0, decode_tok_s=dec,
                           tokens=seq.tokens[seq.num_prompt:])
