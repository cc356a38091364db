"""The web playground: a static page served at ``/`` and ``/playground`` that drives the server's own
streaming API and shows speculation happening (each token marked by where it came from, live figures,
a comparison with plain decoding).

Static files shipped inside the package (``static/``: HTML, JavaScript, CSS), no build step, nothing
fetched from elsewhere at run time; the page talks to ``/v1/chat/completions`` and ``/v1/completions``
with ``"speculative": {"provenance": true}`` (:mod:`specdec.server.provenance`). The routes need no API
key (the page holds no data); the page asks for the key when the API answers 401. A Content-Security-Policy
confines the page to this server. This module knows file names and HTTP responses only.
"""

from __future__ import annotations

import functools
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

FILES = {
    "run.js": "text/javascript; charset=utf-8",
    "playground.js": "text/javascript; charset=utf-8",
    "playground.css": "text/css; charset=utf-8",
}
"""Static files besides the page, by name, with their media types."""

HEADERS = {
    # only this server's own scripts, styles and API; no inline script, no framing by other sites
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}

def add_routes(app: FastAPI) -> None:
    """Serve the page at ``/`` and ``/playground``, and its files at ``/playground/NAME``, on ``app``
    (routes of the app itself, not an included router: :class:`~specdec.server.access.AccessMiddleware`
    resolves requests against the app's routes)."""

    async def page() -> Response:
        """The playground's page (HTML)."""
        return Response(static_text("index.html"), media_type="text/html; charset=utf-8", headers=HEADERS)

    for path in ("/", "/playground"):
        app.get(path, include_in_schema=False)(page)
    for name, media_type in FILES.items():
        _static_route(app, name, media_type)


@functools.lru_cache(maxsize=None)
def static_text(name: str) -> str:
    """The text of one of the page's files (``index.html`` or a key of :data:`FILES`).

    Raises:
        FileNotFoundError: when the package was installed without its data files.
    """
    return resources.files(__package__).joinpath("static", name).read_text(encoding="utf-8")


def _static_route(app: FastAPI, name: str, media_type: str) -> None:
    """Serve ``static/NAME`` at ``/playground/NAME`` (a fixed list of names: no path from the request
    reaches the file system)."""
    @app.get(f"/playground/{name}", include_in_schema=False)
    async def static() -> Response:
        return Response(static_text(name), media_type=media_type, headers=HEADERS)
