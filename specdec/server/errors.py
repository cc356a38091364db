"""Errors in OpenAI's shape.

Every error response is ``{"error": {"message", "type", "param", "code"}}``: FastAPI's validation
errors, malformed JSON or UTF-8, unknown routes, refusals of :mod:`specdec.server.access`, and anything
unexpected (a 500, which the tests treat as a bug). Its strings are one line of at most
:data:`MAX_MESSAGE_CHARS` characters, whatever they quote (a client's text, a library's multi-line
message), and valid UTF-8: a lone surrogate a client sent (``"\\ud800"``) is written as its escape.
"""

from __future__ import annotations

import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

MAX_MESSAGE_CHARS = 1000
"""Longest error message sent to a client (the log has the rest)."""

_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error to send in OpenAI's shape.

    Args:
        status: HTTP status code.
        message: What went wrong and how to fix it.
        param: The offending request field, if any.
        code: A machine-readable code (``model_not_found``, ``context_length_exceeded``, ...).
        type: OpenAI's error type; default from the status (``invalid_request_error`` for 400).
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, one_line(message), code
        self.param = None if param is None else one_line(param, 200)
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


def one_line(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` for an error response: lines joined by a space, control characters and lone surrogates written
    as escapes, clipped to ``limit`` characters (an ellipsis marking the cut)."""
    text = " ".join(part.strip() for part in str(text).splitlines() if part.strip())
    if not text.isprintable():  # lone surrogates are not printable either
        text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
    return text if len(text) <= limit else text[:limit - 1] + "\u2026"


_SURROGATE = re.compile("[\ud800-\udfff]")


def refuse_invalid_unicode(value) -> None:
    """Refuse a request whose text is not valid Unicode: a lone surrogate, which JSON's ``"\\ud800"`` escapes
    carry through parsing, and which no encoder, tokenizer or stop-string match takes. One rule for every
    field, ignored ones (``user``) included, checked before anything reads them.

    Args:
        value: The request as plain data (``model_dump()``): dicts, lists, strings, numbers.

    Raises:
        APIError: 400 naming the first field (``messages.0.content``, ``logit_bias``) that holds one.
    """
    todo = [("", value)]  # a stack, not recursion: a deeply nested schema must not overflow it
    while todo:
        path, v = todo.pop()
        if isinstance(v, str):
            bad = not v.isascii() and _SURROGATE.search(v) is not None
        elif isinstance(v, dict):
            bad = any(isinstance(k, str) and _SURROGATE.search(k) for k in v)
            todo.extend((f"{path}.{k}" if path else str(k), x) for k, x in reversed(v.items()))
        elif isinstance(v, (list, tuple)):
            bad = False
            todo.extend((f"{path}.{i}" if path else str(i), x) for i, x in reversed(list(enumerate(v))))
        else:
            bad = False
        if bad:
            raise APIError(400, f"{path or 'the request'}: the text is not valid Unicode (a lone surrogate, "
                           "\\ud800-\\udfff, outside a pair)", param=path or None)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None,
               type: str | None = None) -> dict:
    """The JSON body of an error response."""
    e = APIError(status, message, param, code, type)
    return {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}


def error_response(e: APIError, headers: dict | None = None) -> JSONResponse:
    """An :class:`APIError` as a JSON response."""
    return JSONResponse(error_body(e.status, e.message, e.param, e.code, e.type), e.status, headers=headers)


def _is_union_member(part) -> bool:
    """Whether ``part`` of an error's location names a member of a union type (pydantic's tags such as
    ``str`` or ``list[str]``: ``stop`` is ``str | list[str]``), not a field, index or key."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "bytes", "none"))


def _field_loc(error: dict) -> list[str]:
    """Where a pydantic error is, as field names and indices: no ``body`` root, no union-member tags."""
    return [str(x) for x in error.get("loc", ()) if x != "body" and not _is_union_member(x)]


def validation_param(error: dict) -> str:
    """The field a pydantic error (an item of ``ValidationError.errors()``) is about, dotted (``content.0.text``;
    ``""`` for the whole value)."""
    return ".".join(_field_loc(error))


def _describe_validation(exc: RequestValidationError, json_sent: bool = False) -> tuple[str, str | None]:
    """``(message, param)`` of a request that failed validation; ``json_sent``: the request said its body is
    JSON (then a body that is no object is not a missing Content-Type)."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = _field_loc(first)
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}", None
    if not loc:
        hint = "" if json_sent else " (send Content-Type: application/json)"
        return f"the request body must be a JSON object{hint}", None
    param = ".".join(loc)
    # a union's members fail at the same place ("stop": 5 is neither a string nor a list): one sentence
    same = [e for e in errors if _field_loc(e) == loc]
    msgs = list(dict.fromkeys(e.get("msg", "invalid value") for e in same))
    lead = "Input should be "
    if len(msgs) > 1 and all(m.startswith(lead) for m in msgs):
        msgs = [msgs[0]] + [m[len(lead):] for m in msgs[1:]]
    msg = f"{param}: {' or '.join(msgs)}"
    if (more := len(errors) - len(same)) > 0:
        msg += f" (and {more} more error{'s' if more > 1 else ''})"
    return msg, param


def install_error_handlers(app: FastAPI) -> None:
    """Make every error response of ``app`` use OpenAI's shape (validation errors become 400)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
        return error_response(exc, headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        msg, param = _describe_validation(exc, "json" in request.headers.get("content-type", "").lower())
        return error_response(APIError(400, msg, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        msg = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 400 and "parsing the body" in msg:  # FastAPI's, raised from json.loads' error
            if isinstance(exc.__cause__, RecursionError):
                msg = "the request body is not valid JSON: nesting too deep"
            else:
                msg = "the request body could not be parsed: it must be UTF-8 encoded JSON"
        return error_response(APIError(exc.status_code, msg), getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error serving %s", request.url.path)
        return error_response(APIError(500, f"internal server error ({type(exc).__name__})"))


async def send_error(send, e: APIError) -> None:
    """Send ``e`` as a whole response through a raw ASGI ``send`` (for middleware)."""
    body = error_response(e).body  # serialized as every other error response is
    await send({"type": "http.response.start", "status": e.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
