"""Who may call the server, and with how much: the ASGI middleware in front of every route.

- **Host and Origin** (DNS rebinding, cross-site requests): a web page in the user's browser can make its
  own host name resolve to the server's address and then drive the server as its "own origin"; the browser
  still sends that name in ``Host`` and ``Origin``. Requests whose ``Host`` is not an allowed name are
  refused (400), and so are requests whose ``Origin`` (sent by browsers, never by API clients) is not an
  allowed origin (403). Always allowed: :data:`LOOPBACK_NAMES` and loopback IP literals; besides them, the
  configured names (``example.com``, ``*.example.com``; ``*`` for any) -- one list for ``Host``, another
  for ``Origin``, so that a server that accepts any ``Host`` (a non-loopback address, whose names clients
  choose) still refuses every web origin it was not told about. An ``Origin`` naming the very IP address
  and port of the ``Host`` (a page this server served, opened by its IP address) is same-origin and
  passes: no other site can have that origin. A browser's request (Fetch Metadata, ``Sec-Fetch-*``) must also
  name the server by a loopback name, an IP address or a name of ``allowed_hosts`` other than ``*``: a
  same-origin GET carries no ``Origin``, and after DNS rebinding an attacker's page is same-origin with its
  own name. A request without these headers is not from a browser.
- **API key** (one or several, one per tenant): ``Authorization: Bearer KEY`` on every route but the
  public ones (:data:`PUBLIC_ROUTES`: ``/health``, the playground, the OpenAPI schema). The route is the one
  the app resolves (Starlette's own matching, which honours ``root_path``: an app mounted under ``/p``, or
  served by Ray Serve with a ``route_prefix``, is guarded the same); a path that names no route needs the
  key too. The key's tenant is put in the request scope (:func:`tenant_of`), for the prefix cache's salt.
- **Metrics** (``/metrics``: every tenant's traffic, counted exactly, so one tenant could read another's off
  it): with a ``metrics_key``, that key and no other; else on a server of one tenant (no key, or one), its
  key as any route; with several tenants, nobody. ``metrics_public`` serves it to anyone instead.
- **Request body**: read only for routes that take one (``POST``), up front, at most ``max_body_bytes + 1``
  bytes (413 beyond, whether or not a ``Content-Length`` was declared) and within ``body_timeout``
  seconds (408 after: a client that sends slowly holds no memory for long), then replayed to the app.
  Other requests are passed on unread.

Refusals happen before the body is read. Plain ASGI (not ``BaseHTTPMiddleware``, which breaks streaming
and disconnect detection), and not Starlette's ``TrustedHostMiddleware``, whose refusals are plain text
rather than OpenAI's error shape. This module knows HTTP headers and routes, not the engine.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import secrets
import time
from typing import Sequence
from urllib.parse import urlsplit

from starlette.routing import Match

from specdec.server.errors import APIError, send_error

LOOPBACK_NAMES = ("localhost",)
"""Host names always allowed, besides loopback IP literals (``127.0.0.1``, ``[::1]``): no web page can
make a browser send them for a host it controls."""

PUBLIC_ROUTES = frozenset({"/health", "/", "/playground", "/openapi.json"})
"""Route paths served without the API key (and the playground's static files, ``/playground/...``): they
hold no data. ``/metrics`` joins them with ``metrics_public``."""

METRICS_ROUTE = "/metrics"
"""The route that counts every tenant's traffic: its own rule (see the module docstring)."""

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
"""Methods whose routes read a request body."""

TENANT_KEY = "specdec_tenant"
"""Where :class:`AccessMiddleware` puts the caller's tenant in the ASGI scope's ``state``."""


def tenant_of(scope: dict) -> str:
    """The caller's tenant: a digest of the API key it presented (16 hex digits), ``""`` on a server without
    keys. Requests of different tenants never share cached prompt prefixes (see :mod:`specdec.server.app`)."""
    return scope.get("state", {}).get(TENANT_KEY, "")


def key_tenant(key: str) -> str:
    """The tenant id of an API key: not the key (it ends up in memory next to cached prompts)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


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


def _from_browser(headers: dict[str, str]) -> bool:
    """Whether a request comes from a web browser: browsers send Fetch Metadata (``Sec-Fetch-*``) on every
    request, API clients none."""
    return "sec-fetch-site" in headers or "sec-fetch-mode" in headers


def is_ip_literal(host: str) -> bool:
    """Whether ``host`` is an IP address (``10.0.0.5``, ``::1``, ``[::1]``), not a name."""
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return False


def _same_ip_origin(origin: str, host_header: str | None) -> bool:
    """Whether ``origin`` is ``http(s)://IP:PORT`` with the IP literal and port of the ``Host`` header: a
    page this server served itself at that address (no other site can have an IP origin of this host)."""
    if host_header is None:
        return False
    try:
        o, h = urlsplit(origin), urlsplit("//" + host_header)
        ipaddress.ip_address(o.hostname or "")
        default = {"http": 80, "https": 443}.get(o.scheme)
        return o.hostname == h.hostname and (o.port or default) == (h.port or default)
    except ValueError:
        return False


class AccessMiddleware:
    """ASGI middleware: Host/Origin names, Bearer API keys, request bodies (see the module docstring).

    Args:
        app: The wrapped ASGI app.
        api_key: Required ``Authorization: Bearer`` token, several (one per tenant), or ``None``.
        max_body_bytes: Largest accepted request body.
        allowed_hosts: Names accepted in ``Host`` besides loopback ones (``*`` for any).
        metrics_public: Serve ``/metrics`` to anyone.
        metrics_key: The one ``Bearer`` token that opens ``/metrics`` (``None``: the API key of a server with
            one tenant; nobody with several; see the module docstring).
        allowed_origins: Names accepted in ``Origin`` besides loopback ones, same-origin IP addresses and
            the names of ``allowed_hosts`` but ``*`` (``*`` for any).
        router: The app's router (``app.router``), whose routes decide which requests need the key and
            which have a body; ``None``: every request needs the key and has its body read.
        body_timeout: Seconds a client has to send its whole body (408 after).
    """

    def __init__(self, app, api_key: str | Sequence[str] | None, max_body_bytes: int,
                 allowed_hosts: Sequence[str] = (), metrics_public: bool = False,
                 allowed_origins: Sequence[str] = (), router=None, body_timeout: float = 30.0,
                 metrics_key: str | None = None):
        self.app, self.max_body_bytes, self.router, self.body_timeout = app, max_body_bytes, router, body_timeout
        keys = (api_key,) if isinstance(api_key, str) else tuple(api_key or ())
        check_metrics_key(metrics_key, keys, metrics_public)
        self.keys = [(k.encode(), key_tenant(k)) for k in keys]
        self.metrics_key = None if metrics_key is None else metrics_key.encode()
        self.allowed_hosts, self.metrics_public = tuple(allowed_hosts), metrics_public
        # the Host names given are web origins of this server too; not a "*" (a server on a network address
        # accepts any Host, since clients choose its names, but a web page it was not told about stays out)
        self.allowed_origins = (*allowed_origins, *(h for h in self.allowed_hosts if h.rstrip(".") != "*"))
        self.named_hosts = tuple(h for h in self.allowed_hosts if h.rstrip(".") != "*")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        route, has_body = self._route(scope)
        refusal = self._refusal(scope, route, headers)
        if refusal is not None:
            return await send_error(send, refusal)
        if not has_body:
            return await self.app(scope, receive, send)
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return await send_error(send, self._too_large())
        parts, size, more = [], 0, True
        deadline = time.monotonic() + self.body_timeout
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return await send_error(send, APIError(
                    408, f"the request body did not arrive within {self.body_timeout:g} s", code="request_timeout"))
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

    def _route(self, scope) -> tuple[str | None, bool]:
        """The path template of the route this request resolves to (``None``: none), and whether it reads a
        body (a route of a body method; every request when no router was given)."""
        if self.router is None:
            return None, True
        partial = None
        for route in self.router.routes:
            match, _ = route.matches(dict(scope))
            path = getattr(route, "path", None)
            if match == Match.FULL:
                return path, scope["method"] in BODY_METHODS
            if match == Match.PARTIAL and partial is None:
                partial = path  # the path exists, the method does not: 405 from the app, no body read
        return partial, False

    def _public(self, route: str | None) -> bool:
        if route is None:
            return False
        return (route in PUBLIC_ROUTES or route.startswith("/playground/")
                or (route == METRICS_ROUTE and self.metrics_public))

    def _metrics_refusal(self, scheme: str, token: bytes, tenant: str | None) -> APIError | None:
        """Why a request for ``/metrics`` (not public) is refused, or None: only the metrics key opens it
        where there is one, and no tenant's key where there are several tenants."""
        if self.metrics_key is not None:
            if scheme.lower() == "bearer" and secrets.compare_digest(token, self.metrics_key):
                return None
        elif len(self.keys) <= 1:  # one tenant (or none): all the traffic it shows is its own
            return None if tenant is not None or not self.keys else _invalid_key()
        if tenant is None:
            return _invalid_key()
        hint = ("send the metrics key" if self.metrics_key is not None
                else "start the server with a metrics key (metrics_key) to read it")
        return APIError(403, f"/metrics counts every tenant's traffic: an API key does not open it; {hint}",
                        code="metrics_not_allowed")

    def _refusal(self, scope, route: str | None, headers: dict[str, str]) -> APIError | None:
        """Why this request is refused before its body is read, or None; records the caller's tenant."""
        hint = "start the server with this name allowed"
        if "host" in headers:
            host = _hostname(headers["host"])
            if host is None or not host_allowed(host, self.allowed_hosts):
                return APIError(400, f"the Host header {headers['host']!r} is not a name of this server; {hint} "
                                "(allowed_hosts)", code="host_not_allowed")
        if _from_browser(headers) and "host" in headers:
            # a page's own requests carry no Origin on a same-origin GET: after DNS rebinding, an attacker's page
            # is "same-origin" with its own name. A browser may name this server only by a name it was told
            host = _hostname(headers["host"]) or ""
            if not (host_allowed(host, self.named_hosts) or is_ip_literal(host)):
                return APIError(403, f"browser requests to {headers['host']!r} are not allowed: open the server by "
                                f"its IP address or a name it was given; {hint} (allowed_hosts)",
                                code="origin_not_allowed")
        if "origin" in headers:
            origin = headers["origin"]
            host = urlsplit(origin).hostname if origin.startswith(("http://", "https://")) else None
            if host is None or not (host_allowed(host, self.allowed_origins)
                                    or _same_ip_origin(origin, headers.get("host"))):
                return APIError(403, f"requests from the web origin {origin!r} are not allowed; {hint} "
                                "(allowed_origins)", code="origin_not_allowed")
        scheme, _, token = headers.get("authorization", "").partition(" ")
        token = token.strip().encode()
        tenant = None
        for key, name in self.keys:  # every key compared, in constant time each
            if secrets.compare_digest(token, key) and scheme.lower() == "bearer":
                tenant = name
        if tenant is not None:
            scope.setdefault("state", {})[TENANT_KEY] = tenant
        if route == METRICS_ROUTE and not self.metrics_public:
            return self._metrics_refusal(scheme, token, tenant)
        if self.keys and tenant is None and not self._public(route):
            return _invalid_key()
        return None

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body exceeds {self.max_body_bytes} bytes", code="request_too_large")


def _invalid_key() -> APIError:
    return APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")


def check_metrics_key(metrics_key: str | None, api_keys: Sequence[str], metrics_public: bool) -> None:
    """Refuse a metrics key that is empty, is also an API key (a tenant would hold it), or comes with
    ``metrics_public`` (which of the two is meant?).

    Raises:
        ValueError: saying which.
    """
    if metrics_key is None:
        return
    if not metrics_key:
        raise ValueError("the metrics key is empty; give a key, or none")
    if metrics_key in api_keys:
        raise ValueError("the metrics key is also an API key: a tenant would read every tenant's traffic; give "
                         "/metrics a key of its own")
    if metrics_public:
        raise ValueError("a metrics key and a public /metrics contradict each other; choose one")
