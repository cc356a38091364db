"""Connections: what a client may hold of the server before it has even sent a request.

uvicorn (0.55) closes a keep-alive connection 5 s after a response, but not one that never sends a request
(or sends its headers a byte at a time), its httptools parser buffers headers of any size, and its
``limit_concurrency`` answers in plain text. :func:`protocol` makes the HTTP protocol class the server
runs with, on uvicorn's h11 implementation:

- **headers are bounded**: h11 refuses a request whose headers exceed uvicorn's
  ``h11_max_incomplete_event_size`` (16 KB by default) instead of buffering them;
- **each request's headers have a deadline**: a connection that has not completed a request's headers
  within ``header_timeout`` seconds of opening, or of its previous response, is closed;
- **connections are bounded**: beyond ``max_connections`` open at once, a new connection gets a 503 in
  OpenAI's error shape and is closed before anything of it is read.

This module knows uvicorn's protocol class and bytes on the wire, nothing of the app.
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT = 10.0
"""Seconds a client has to send a request's headers (after connecting, or after its previous response)."""


def refusal(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response with an OpenAI-shaped error body, closing the connection."""
    body = json.dumps({"error": {"message": message, "type": "service_unavailable", "param": None,
                                 "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode() + body


def protocol(max_connections: int, header_timeout: float = HEADER_TIMEOUT) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with a connection bound and a header deadline (see the module docstring).

    Args:
        max_connections: Connections served at once; more are refused (503) as they open.
        header_timeout: Seconds to complete a request's headers.

    Returns:
        A protocol class for ``uvicorn.Config(http=...)``.
    """
    full = refusal(503, "Service Unavailable", f"the server holds {max_connections} connections, its limit; "
                   "retry shortly", "too_many_connections")

    class BoundedH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.write(full)
                transport.close()
                return
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def _arm(self) -> None:
            """Close the connection unless a new request's headers are complete within the deadline."""
            self.loop.call_later(header_timeout, self._deadline, self.cycle)

        def _deadline(self, armed) -> None:
            if self.cycle is armed and not self.transport.is_closing():
                if armed is None or armed.response_complete:
                    self.transport.close()

    return BoundedH11Protocol
