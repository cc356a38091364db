"""Who may call the server, and with how much: the ASGI middleware in front of every route.

- **Host and Origin** (DNS rebinding, cross-site requests): a web page in the user's browser can make its
  own host name resolve to 127.0.0.1 and then drive a localhost server as its "own origin"; the browser
  still sends that name in ``Host``. Requests whose ``Host`` is not an allowed name are refused (400),
  and so are requests whose ``Origin`` (sent by browsers on cross-site requests, never by API clients)
  is not an allowed name (403). Allowed: :data:`LOOPBACK_NAMES` and IP literals of loopback addresses,
  plus the configured names (``example.com``, ``*.example.com``); ``*`` allows any. A request without
  these headers is not from a browser and passes.
- **API key**: ``Authorization: Bearer KEY`` on ``/v1/*`` and, unless ``metrics_public``, ``/metrics``
  (``/health`` stays open: it says nothing but ok/draining/error, and load balancers probe it).
- **Body size**: read up front (at most ``max_body_bytes + 1`` bytes) and replayed to the app, so an
  oversized body gets 413 whether or not it declares a Content-Length.

Plain ASGI (not ``BaseHTTPMiddleware``, which breaks streaming and disconnect detection), and not
Starlette's ``TrustedHostMiddleware``, whose refusals are plain text rather than OpenAI's error shape.
This module knows HTTP headers only.
"""

from __future__ import annotations

import ipaddress
import secrets
from typing import Sequence
from urllib.parse import urlsplit

from specdec.server.errors import APIError, send_error

LOOPBACK_NAMES = ("localhost",)
"""Host names always allowed, besides loopback IP literals (``127.0.0.1``, ``[::1]``): no web page can
make a browser send them for a host it controls."""


def is_loopback(host: str) -> bool:
    """True for ``localhost`` (and ``*.localhost``, which browsers resolve to loopback themselves) and
    loopback IP literals."""
    host = host.lower().rstrip(".").strip("[]")
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_allowed(host: str, allowed: Sequence[str]) -> bool:
    """Whether the host name ``host`` (no port) is loopback or matches ``allowed`` (names, ``*.suffix``
    patterns, or ``*`` for any)."""
    host = host.lower().rstrip(".")
    if is_loopback(host):
        return True
    for pattern in allowed:
        pattern = pattern.lower().rstrip(".")
        if pattern == "*" or host == pattern or (pattern.startswith("*.") and host.endswith(pattern[1:])):
            return True
    return False


def _hostname(authority: str) -> str | None:
    """The host of a ``Host`` header value (``name``, ``name:port``, ``[v6]:port``); None if malformed."""
    try:
        return urlsplit("//" + authority).hostname
    except ValueError:
        return None


class AccessMiddleware:
    """ASGI middleware: Host/Origin names, Bearer API key, request body size (see the module docstring).

    Args:
        app: The wrapped ASGI app.
        api_key: Required ``Authorization: Bearer`` token, or ``None``.
        max_body_bytes: Largest accepted request body.
        allowed_hosts: Names accepted in ``Host`` and ``Origin`` besides loopback ones (``*`` for any).
        metrics_public: Serve ``/metrics`` without the API key.
    """

    def __init__(self, app, api_key: str | None, max_body_bytes: int, allowed_hosts: Sequence[str] = (),
                 metrics_public: bool = False):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes
        self.allowed_hosts, self.metrics_public = tuple(allowed_hosts), metrics_public

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refusal = self._refusal(scope["path"], headers)
        if refusal is not None:
            return await send_error(send, refusal)
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return await send_error(send, self._too_large())
        parts, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # client gone before sending the whole body
                return
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            more = message.get("more_body", False)
            if size > self.max_body_bytes:
                return await send_error(send, self._too_large())
        body = b"".join(parts)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _refusal(self, path: str, headers: dict[str, str]) -> APIError | None:
        """Why this request is refused before it is read, or None."""
        hint = "start the server with this name allowed (allowed_hosts, --allowed-hosts)"
        if "host" in headers:
            host = _hostname(headers["host"])
            if host is None or not host_allowed(host, self.allowed_hosts):
                return APIError(400, f"the Host header {headers['host']!r} is not a name of this server; {hint}",
                                code="host_not_allowed")
        if "origin" in headers:
            origin = headers["origin"]
            host = urlsplit(origin).hostname if origin.startswith(("http://", "https://")) else None
            if host is None or not host_allowed(host, self.allowed_hosts):
                return APIError(403, f"requests from the web origin {origin!r} are not allowed; {hint}",
                                code="origin_not_allowed")
        guarded = path.startswith("/v1") or (path == "/metrics" and not self.metrics_public)
        if self.api_key is not None and guarded:
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self.api_key.encode()):
                return APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                code="invalid_api_key")
        return None

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body exceeds {self.max_body_bytes} bytes", code="request_too_large")
