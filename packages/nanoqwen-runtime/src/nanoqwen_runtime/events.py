"""`TokenEvent`: the one event a token generator emits per generated token, on every backend.

The reference backend, the CUDA engine and the engine's `Backend` adapter all speak it:

    TokenEvent(request, token_id, index, text, finish_reason)

- `request`: the key of the request: its index in `Backend.start(requests)`, or the engine's
  `request_id`;
- `index`: 0-based position of the token among the request's generated tokens;
- `text`: newly printable text, where the producer detokenizes (the engine API for a request with
  `detokenize=True`); '' otherwise, and for EOS tokens. Through a `Backend`, text is the caller's job
  (`generate.Pipeline`), so it is decoded exactly once;
- `finish_reason`: set on the request's last token: "eos", "length", "context" or "stop";
- `logprobs`: a `logprobs.TokenLogprobs` when the request asked for logprobs (engines), else None;
  `prompt_logprobs`: on the first token of a request that asked for them, one entry per prompt token.

A request that fails at run time (its logits hold NaN/Inf) ends without a token: backends emit an
`ErrorEvent(request, index, message)` instead of the token (finish reason "error"), and the engine a
`FinishEvent(reason=FinishReason.ERROR, detail=message)`. `nonfinite_logits_message` words it for all.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TokenEvent", "ErrorEvent", "FINISH_EOS", "FINISH_LENGTH", "FINISH_CONTEXT", "FINISH_STOP",
           "FINISH_ERROR", "nonfinite_logits_message"]

FINISH_EOS = "eos"          # sampled one of the EOS ids (the id is reported, its text is not shown)
FINISH_LENGTH = "length"    # reached max_tokens
FINISH_CONTEXT = "context"  # the context window is full
FINISH_STOP = "stop"        # a stop string matched, or the caller ended the request
FINISH_ERROR = "error"      # the model failed at run time; no token (ErrorEvent)


@dataclass(frozen=True)
class TokenEvent:
    request: int | str
    token_id: int
    index: int
    text: str = ""
    finish_reason: str | None = None
    logprobs: object | None = None          # logprobs.TokenLogprobs
    prompt_logprobs: tuple | None = None    # (None, TokenLogprobs, ...) one per prompt token


@dataclass(frozen=True)
class ErrorEvent:
    """Request `request` ended without a token: the model failed at run time. `index` is the position
    the token would have had (= tokens generated before); `message` is one line."""

    request: int | str
    index: int
    message: str
    finish_reason: str = FINISH_ERROR


def nonfinite_logits_message(num_generated: int) -> str:
    """The one-line error of a request whose logits held NaN/Inf after `num_generated` tokens."""
    return (f"the model produced non-finite logits (NaN/Inf) after {num_generated} generated tokens; the "
            "request was ended without emitting a token from them (corrupt or overflowing weights)")
