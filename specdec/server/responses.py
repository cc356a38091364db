"""OpenAI's Responses API on the Chat Completions machinery: ``POST /v1/responses`` and
``GET``/``DELETE /v1/responses/{id}``.

A request is translated into the chat request it is equivalent to (:mod:`specdec.server.responses_input`),
which runs exactly as on ``/v1/chat/completions`` (``start_chat`` of :func:`specdec.server.app.create_app`:
the same template rendering, tool grammar, structured outputs, limits, scheduler, tenancy and metrics). Its
answer is read as chat reads it (:class:`~specdec.tools.ToolCallStream`) into output items
(:class:`AnswerItems`): returned in a response object, or streamed as Responses' semantic events (SSE with
``event:`` lines, each with a ``sequence_number``): ``response.created``, ``response.in_progress``, then per
item ``response.output_item.added``, for a message ``response.content_part.added``,
``response.output_text.delta``... ``.done``, ``response.content_part.done``, for a call
``response.function_call_arguments.delta``... ``.done``, then ``response.output_item.done``; last
``response.completed`` (``response.incomplete`` when cut by ``max_output_tokens``), or ``error`` and
``response.failed``. With ``store`` the response and its conversation are kept per tenant
(:mod:`specdec.server.response_store`) for ``previous_response_id``.

It knows the Responses shapes; not the engine, nor how a chat request is checked or rendered.
"""

from __future__ import annotations

import copy
import itertools
import json
import secrets
import time
from typing import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from specdec.server import serving
from specdec.server.access import tenant_of
from specdec.server.errors import APIError
from specdec.server.protocol import ChatCompletionRequest, ErrorResponse
from specdec.server.response_store import ResponseStore, StoredResponse
from specdec.server.responses_input import Turn, normalize, translate
from specdec.server.responses_protocol import (
    DeletedResponse, IncompleteDetails, InputTokensDetails, ResponseErrorOut, ResponseObject, ResponsesRequest,
    ResponseUsage,
)
from specdec.tools import ToolCallStream
from specdec.types import GenerationResult

_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)}


class AnswerItems:
    """The output items of one answer as its text arrives, and the stream events (without
    ``sequence_number``) that build them.

    The text outside calls is one message item, opened at its first character that is not whitespace
    (whitespace before it is held: an answer that is calls and whitespace has no message, as chat's content
    is null then) and closed at the end (``incomplete`` when the answer was cut); each call is a
    ``function_call`` item, opened when its name is read, its arguments streamed as written, closed when
    complete (``incomplete`` if the answer ended inside it). Items keep the order they opened in, so fed a
    whole answer at once it gives the items its stream ends with, but for an answer whose text outside calls
    all comes after a call (a stream opens the message after that call; a whole answer, first).

    Args:
        tools: The request's tools; the answer is read for calls when ``tools.calls``, else it is all text.
    """

    def __init__(self, tools: serving.ToolPlan | None):
        self.parser = ToolCallStream(names=tools.names) if tools is not None and tools.calls else None
        self.items: list[dict] = []  # in output_index order
        self._message: int | None = None  # the message item's index, once opened
        self._held = ""  # whitespace before the message opens
        self._calls: dict[int, int] = {}  # the parser's call index -> output index, for calls still open

    def feed(self, text: str) -> list[dict]:
        """Add text of the answer; the events it makes."""
        if self.parser is None:
            return self._text(text)
        content, deltas = self.parser.feed(text)
        return self._text(content) + self._call_deltas(deltas)

    def finish(self, reason: str) -> list[dict]:
        """The end of the answer (its ``finish_reason``): what was held back, and every item closed."""
        events = []
        if self.parser is not None:
            content, deltas = self.parser.finish()
            events += self._text(content) + self._call_deltas(deltas)
            for i in list(self._calls):
                events += self._close_call(i, "incomplete")
        if self._message is None and not self.items:  # an answer without calls is a message, even empty
            events += self._open_message()
        if self._message is not None:
            events += self._close_message("incomplete" if reason == "length" else "completed")
        return events

    def _text(self, text: str) -> list[dict]:
        if not text:
            return []
        if self._message is None:
            self._held += text
            return self._open_message() if self._held.strip() else []
        return [self._delta(text)]

    def _open_message(self) -> list[dict]:
        self._message = len(self.items)
        self.items.append({"type": "message", "id": f"msg_{secrets.token_hex(16)}", "status": "in_progress",
                           "role": "assistant", "content": []})
        events = [self._item_event("added", self._message)]
        part = {"type": "output_text", "text": "", "annotations": []}
        self.items[-1]["content"].append(part)
        events.append({**self._where(self._message), "type": "response.content_part.added", "content_index": 0,
                       "part": dict(part)})
        held, self._held = self._held, ""
        return events + ([self._delta(held)] if held else [])

    def _delta(self, text: str) -> dict:
        self.items[self._message]["content"][0]["text"] += text
        return {**self._where(self._message), "type": "response.output_text.delta", "content_index": 0,
                "delta": text, "logprobs": []}

    def _close_message(self, status: str) -> list[dict]:
        i = self._message
        item, part = self.items[i], self.items[i]["content"][0]
        item["status"] = status
        return [{**self._where(i), "type": "response.output_text.done", "content_index": 0, "text": part["text"],
                 "logprobs": []},
                {**self._where(i), "type": "response.content_part.done", "content_index": 0, "part": dict(part)},
                self._item_event("done", i)]

    def _call_deltas(self, deltas: list[dict]) -> list[dict]:
        events = []
        for d in deltas:
            if "id" in d:  # a call's first delta: its id and name
                self._calls[d["index"]] = len(self.items)
                self.items.append({"type": "function_call", "id": f"fc_{secrets.token_hex(16)}", "call_id": d["id"],
                                   "name": d["function"]["name"], "arguments": "", "status": "in_progress"})
                events.append(self._item_event("added", len(self.items) - 1))
            piece = d["function"].get("arguments")
            if piece:
                out = self._calls[d["index"]]
                self.items[out]["arguments"] += piece
                events.append({**self._where(out), "type": "response.function_call_arguments.delta", "delta": piece})
        for i in list(self._calls):
            if self.parser.calls[i].complete:
                events += self._close_call(i, "completed")
        return events

    def _close_call(self, i: int, status: str) -> list[dict]:
        out = self._calls.pop(i)
        item = self.items[out]
        item["status"] = status
        return [{**self._where(out), "type": "response.function_call_arguments.done", "arguments": item["arguments"]},
                self._item_event("done", out)]

    def _where(self, out: int) -> dict:
        return {"item_id": self.items[out]["id"], "output_index": out}

    def _item_event(self, what: str, out: int) -> dict:
        return {"type": f"response.output_item.{what}", "output_index": out, "item": copy.deepcopy(self.items[out])}


def finished(head: dict, answer: AnswerItems, result: GenerationResult, run: serving.ChatRun) -> ResponseObject:
    """The response object of a finished answer (``head``: its id, creation time, model and echoed settings)."""
    u = serving.usage(run.prompts, [result])
    cut = result.finish_reason == "length"
    return ResponseObject(
        **head, status="incomplete" if cut else "completed", output=answer.items,
        incomplete_details=IncompleteDetails(reason="max_output_tokens") if cut else None,
        usage=ResponseUsage(input_tokens=u.prompt_tokens, output_tokens=u.completion_tokens, total_tokens=u.total_tokens,
                            input_tokens_details=InputTokensDetails(cached_tokens=u.prompt_tokens_details.cached_tokens)),
        speculative=serving.speculative_stats(run.spec, [result]))


def add_routes(app: FastAPI, start_chat: Callable[[ChatCompletionRequest, Request, str], Awaitable[serving.ChatRun]],
               collect: Callable[[serving.Choices, Request], Awaitable[list[GenerationResult]]], model_name: str,
               store: ResponseStore) -> None:
    """Serve the Responses API on ``app``.

    Args:
        start_chat: Checks, renders and submits a chat request named by the response's id (raises
            :class:`APIError`).
        collect: Waits for a run's results (raises :class:`APIError`; the client leaving cancels them).
        model_name: The served model's name, as responses give it.
        store: Where responses with ``store`` are kept.
    """

    @app.post("/v1/responses", response_model=ResponseObject, responses=_ERRORS)
    async def create_response(req: ResponsesRequest, raw: Request):
        tenant = tenant_of(raw.scope)
        previous = ()
        if req.previous_response_id is not None:
            stored = store.get(tenant, req.previous_response_id)
            if stored is None:
                raise _not_found(req.previous_response_id, "previous_response_id", "previous_response_not_found")
            previous = stored.items
        turn = translate(req, previous)
        rid = f"resp_{secrets.token_hex(24)}"
        try:
            run = await start_chat(turn.chat, raw, rid)
        except APIError as e:
            raise turn.error(e) from None
        head = {"id": rid, "created_at": int(time.time()), "model": model_name,
                **turn.echo}

        def keep(response: ResponseObject, answer: AnswerItems) -> None:
            if req.store:
                items = (*turn.items, *(normalize(item) for item in answer.items))
                store.put(tenant, response.id, StoredResponse.of(response.model_dump(), items))

        if req.stream:
            return _sse(_events(run, turn, head, keep))
        try:
            result = (await collect(run.choices, raw))[0]
        except APIError as e:
            raise turn.error(e) from None
        answer = AnswerItems(run.tools)
        answer.feed(result.text)
        answer.finish(result.finish_reason)
        response = finished(head, answer, result, run)
        keep(response, answer)
        return response

    @app.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=_ERRORS)
    async def get_response(response_id: str, raw: Request, stream: bool = False):
        if stream:
            raise APIError(400, "stream is not supported when retrieving a response: it is returned whole",
                           param="stream")
        stored = store.get(tenant_of(raw.scope), response_id)
        if stored is None:
            raise _not_found(response_id, "response_id", "response_not_found")
        return stored.response

    @app.delete("/v1/responses/{response_id}", response_model=DeletedResponse, responses=_ERRORS)
    async def delete_response(response_id: str, raw: Request):
        if not store.delete(tenant_of(raw.scope), response_id):
            raise _not_found(response_id, "response_id", "response_not_found")
        return DeletedResponse(id=response_id)


def _not_found(rid: str, param: str, code: str) -> APIError:
    """404 for a response this tenant does not have (never issued, evicted, deleted, not stored, or another
    tenant's: the same answer for each)."""
    shown = rid if len(rid) <= 100 else rid[:100] + "\u2026"
    return APIError(404, f"no stored response has the id {shown!r} (responses are kept with store: true, per API "
                    "key, for a bounded number)", param=param, code=code)


async def _events(run: serving.ChatRun, turn: Turn, head: dict,
                  keep: Callable[[ResponseObject, AnswerItems], None]) -> AsyncIterator[dict]:
    """The stream's events, numbered; leaving early (client gone) cancels the run."""
    numbers = itertools.count()
    answer = AnswerItems(run.tools)

    def numbered(event: dict) -> dict:
        return {"type": event["type"], "sequence_number": next(numbers), **event}

    try:
        started = ResponseObject(**head, status="in_progress", output=[]).model_dump()
        yield numbered({"type": "response.created", "response": started})
        yield numbered({"type": "response.in_progress", "response": started})
        while True:
            _, chunk = await run.choices.events.get()
            if isinstance(chunk, BaseException):
                e = turn.error(serving.engine_error(chunk, run.choices.grammar_field))
                yield numbered({"type": "error", "code": e.code or e.type, "message": e.message, "param": e.param})
                failed = ResponseObject(**head, status="failed", output=answer.items,
                                        error=ResponseErrorOut(code=e.code or e.type, message=e.message))
                yield numbered({"type": "response.failed", "response": failed.model_dump()})
                return
            for event in answer.feed(chunk.text):
                yield numbered(event)
            if chunk.finish_reason is not None:
                for event in answer.finish(chunk.finish_reason):
                    yield numbered(event)
                response = finished(head, answer, chunk.result, run)
                keep(response, answer)  # before the last event: a client may continue from it at once
                yield numbered({"type": f"response.{response.status}", "response": response.model_dump()})
                return
    finally:
        run.choices.cancel()


def _sse(events: AsyncIterator[dict]) -> StreamingResponse:
    """Server-sent events as OpenAI sends the Responses API's: ``event: TYPE`` and ``data: JSON``."""

    async def encode():
        async for ev in events:
            yield f"event: {ev['type']}\ndata: {json.dumps(ev, ensure_ascii=False)}\n\n"

    return StreamingResponse(encode(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
