"""`TokenEvent`: the one event a token generator emits per generated token, on every backend.

The reference backend, the CUDA engine and the engine's `Backend` adapter all speak it:

    TokenEvent(request, token_id, index, text, finish_reason)

- `request`: the key of the request: its index in `Backend.start(requests)`, or the engine's
  `request_id`;
- `index`: 0-based position of the token among the request's generated tokens;
- `text`: newly printable text, where the producer detokenizes (the engine API for a request with
  `detokenize=True`); '' otherwise, and for EOS tokens. Through a `Backend`, text is the caller's job
  (`generate.Pipeline`), so it is decoded exactly once;
- `finish_reason`: set on the request's last token: "eos", "length", "context" or "stop".
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TokenEvent", "FINISH_EOS", "FINISH_LENGTH", "FINISH_CONTEXT", "FINISH_STOP"]

FINISH_EOS = "eos"          # sampled one of the EOS ids (the id is reported, its text is not shown)
FINISH_LENGTH = "length"    # reached max_tokens
FINISH_CONTEXT = "context"  # the context window is full
FINISH_STOP = "stop"        # a stop string matched, or the caller ended the request


@dataclass(frozen=True)
class TokenEvent:
    request: int | str
    token_id: int
    index: int
    text: str = ""
    finish_reason: str | None = None
