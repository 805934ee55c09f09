"""A client that went away: how often a waiting handler looks (`DISCONNECT_POLL_S`), the exception that
ends its handler (`ClientGone`, after the request is aborted in the engine), and the status it is
logged with (`CLIENT_GONE`). Shared by routes.py and choices.py."""

from __future__ import annotations

__all__ = ["CLIENT_GONE", "DISCONNECT_POLL_S", "ClientGone"]

DISCONNECT_POLL_S = 0.25  # how often a request waiting for a token (not streaming yet) checks its client
CLIENT_GONE = 499  # nginx's "client closed request": logged only, nobody is there to read it


class ClientGone(Exception):
    """The client disconnected before its answer was sent (the request has been aborted)."""
