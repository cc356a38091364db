"""From a Responses request to the Chat Completions request it is equivalent to, and back for its errors.

:func:`translate` checks a :class:`~specdec.server.responses_protocol.ResponsesRequest` and builds the chat
request that says the same: ``instructions`` a first system message; the conversation (a previous
response's, then ``input``) as chat messages: a message item a message of its role and text, a
``function_call`` item a call in an assistant message's ``tool_calls`` (joining the assistant message just
before it, as one answer's text and calls are one chat message), a ``function_call_output`` item a ``tool``
message; flat function tools chat's nested ones; ``text.format`` ``response_format``;
``max_output_tokens`` ``max_tokens``. Rendered by the chat template, it gives the prompt the equivalent
chat request gives. Errors the chat machinery raises for it are renamed into the Responses request's terms
(:meth:`Turn.error`): ``messages.3.content`` becomes the item it came from, ``response_format``
``text.format``, ``max_tokens`` ``max_output_tokens``.

It knows both requests' shapes; not the engine or how a chat is rendered.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pydantic import BaseModel, ValidationError

from specdec.server.errors import APIError, refuse_invalid_unicode, validation_param
from specdec.server.protocol import ChatCompletionRequest
from specdec.server.responses_protocol import (
    INPUT_ITEMS, REFUSED, TEXT_FORMATS, FunctionCallItem, FunctionCallOutputItem, FunctionTool, MessageItem,
    NamedFunction, ResponsesRequest,
)


@dataclass(frozen=True)
class Source:
    """Where a chat message came from: the request field (``instructions``, ``input``, ``input.N``, or
    ``previous_response_id.N``: item N of the stored conversation continued), the name of its text there
    (``content``, ``output``; None: the field is the text), and the fields of the calls in its ``tool_calls``."""

    field: str
    text: str | None = None
    calls: tuple[str, ...] = ()


@dataclass(frozen=True)
class Turn:
    """A Responses request as the chat request it is equivalent to.

    Attributes:
        chat: The chat request.
        items: The conversation it answers, as input items (normalized: :func:`normalize`): the previous
            response's conversation, then this request's input; not its instructions.
        sources: Per chat message, where it came from.
        echo: The request's settings, as the response object repeats them.
    """

    chat: ChatCompletionRequest
    items: tuple[dict, ...]
    sources: tuple[Source, ...]
    echo: dict

    def error(self, e: APIError) -> APIError:
        """``e``, raised by the chat machinery for :attr:`chat`, in the Responses request's terms (an item of
        the conversation ``previous_response_id`` continues is named in the message; ``param`` is
        ``previous_response_id``)."""
        param = {"messages": "input", "prompt": "input"}.get(e.param, e.param)
        message = _STORED_ITEM.sub(_stored_item, self._rename(e.message))
        if message.endswith("is not JSON") and "previous_response_id's conversation" in message:
            message += (" (a function call cut short by max_output_tokens: that conversation cannot be continued; "
                        "send its items as input, the call completed or left out)")
        param = param and _STORED_ITEM.sub("previous_response_id", self._rename(param))
        return APIError(e.status, message, param, e.code, e.type)

    def _rename(self, text: str) -> str:
        text = _MESSAGE_FIELD.sub(self._message_field, text)
        for pattern, name in _CHAT_FIELDS:
            text = pattern.sub(name, text)
        return text

    def _message_field(self, m: re.Match) -> str:
        i, rest = int(m.group(1)), m.group(2).strip(".").split(".") if m.group(2) else []
        if i >= len(self.sources):
            return "input"
        src = self.sources[i]
        if rest[:1] == ["tool_calls"] and len(rest) > 1 and rest[1].isdigit() and int(rest[1]) < len(src.calls):
            return src.calls[int(rest[1])] + (".arguments" if rest[-1] == "arguments" else "")
        if rest[:1] == ["content"] and src.text is not None:
            return f"{src.field}.{src.text}"
        if rest[:1] == ["tool_call_id"]:
            return f"{src.field}.call_id"
        return src.field


def _stored_item(m: re.Match) -> str:
    what = f"the {m.group(2)} of item {m.group(1)}" if m.group(2) else f"item {m.group(1)}"
    return f"{what} of previous_response_id's conversation"


_STORED_ITEM = re.compile(r"\bprevious_response_id\.(\d+)(?:\.(\w+))?")
_MESSAGE_FIELD = re.compile(r"\bmessages\.(\d+)((?:\.[A-Za-z_]\w*|\.\d+)*)")
_CHAT_FIELDS = [(re.compile(r"\bresponse_format(?:\.json_schema)?\b"), "text.format"),
                (re.compile(r"\bmax_tokens\b"), "max_output_tokens"),
                (re.compile(r"\btools\.(\d+)\.function\b"), r"tools.\1")]


def translate(req: ResponsesRequest, previous: tuple[dict, ...] = ()) -> Turn:
    """The chat request equivalent to ``req``, continuing the conversation ``previous`` (a stored
    response's :attr:`~specdec.server.response_store.StoredResponse.items`).

    Raises:
        APIError: 400 naming the field: an unsupported feature (:data:`REFUSED`, ``truncation: "auto"``,
            ``text.verbosity``, obfuscation), empty ``input``, an item of an unknown type or a part that is
            not text, a ``function_call_output`` whose ``call_id`` no earlier ``function_call`` has, a tool
            that is not a function, a bad ``tool_choice`` or ``text.format``, metadata over OpenAI's bounds,
            invalid Unicode anywhere.
    """
    refuse_unsupported(req)
    refuse_invalid_unicode(req.model_dump())
    if req.input in ("", []):
        raise APIError(400, "input is empty: give text or at least one item", param="input")
    if isinstance(req.input, str):
        new, fields = [{"type": "message", "role": "user", "content": req.input}], ["input"]
    else:
        new, fields = [_item(i, raw) for i, raw in enumerate(req.input)], [f"input.{i}" for i in range(len(req.input))]
    items = (*previous, *new)
    _check_call_outputs(items, len(previous), fields)
    messages, sources = chat_messages(items, [f"previous_response_id.{k}" for k in range(len(previous))] + fields,
                                      req.instructions)
    tools = [_validated(FunctionTool, raw, f"tools.{i}") for i, raw in enumerate(req.tools or [])]
    fmt = req.text.format if req.text is not None else None
    body = {
        "model": req.model, "messages": messages, "max_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed, "speculative": req.speculative,
        "cache_salt": req.cache_salt, "parallel_tool_calls": req.parallel_tool_calls,
        "tools": [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                  for t in tools] or None,
        "tool_choice": _tool_choice(req.tool_choice), "response_format": _response_format(fmt),
    }
    try:
        chat = ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:  # checked above, field by field: not expected
        raise APIError(400, f"input: {e.errors()[0]['msg']}", param="input") from None
    echo = {
        "instructions": req.instructions, "tools": [t.model_dump() for t in tools],
        "tool_choice": req.tool_choice or "auto", "parallel_tool_calls": req.parallel_tool_calls,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p, "max_output_tokens": req.max_output_tokens,
        "previous_response_id": req.previous_response_id, "text": {"format": fmt or {"type": "text"}},
        "metadata": req.metadata or {}, "store": req.store, "user": req.user,
    }
    return Turn(chat, items, tuple(sources), echo)


def _check_call_outputs(items, first: int, fields: list[str]) -> None:
    """400 for a ``function_call_output`` item of ``items[first:]`` (the request's input, from field
    ``fields[i - first]``) whose ``call_id`` no earlier ``function_call`` item of the conversation has (as
    OpenAI's API refuses it)."""
    calls: set[str] = set()
    for i, item in enumerate(items):
        if item["type"] == "function_call":
            calls.add(item["call_id"])
        elif item["type"] == "function_call_output" and i >= first and item["call_id"] not in calls:
            param = f"{fields[i - first]}.call_id"
            shown = item["call_id"] if len(item["call_id"]) <= 100 else item["call_id"][:100] + "\u2026"
            raise APIError(400, f"{param}: no function_call item with the call_id {shown!r} comes before this "
                           "output in the conversation (the input, after previous_response_id's)", param=param)


def refuse_unsupported(req: ResponsesRequest) -> None:
    """400 naming the field for a feature this server does not implement, rather than ignoring it."""
    for name, nothing in REFUSED.items():
        value = getattr(req, name)
        if isinstance(value, dict):  # {"effort": null}: nothing asked
            value = {k: v for k, v in value.items() if v is not None}
        if value is not None and not any(type(value) is type(x) and value == x for x in nothing):
            raise APIError(400, f"{name} is not supported by this server", param=name)
    if req.truncation == "auto":
        raise APIError(400, "truncation 'auto' is not supported by this server: a conversation longer than the "
                       "context gets a 400 (truncation 'disabled')", param="truncation")
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        raise APIError(400, "text.verbosity is not supported by this server", param="text.verbosity")
    if req.stream_options is not None and req.stream_options.include_obfuscation:
        raise APIError(400, "stream_options.include_obfuscation is not supported by this server",
                       param="stream_options.include_obfuscation")
    for key, value in (req.metadata or {}).items():
        if len(key) > 64 or len(value) > 512:
            raise APIError(400, "metadata: keys are at most 64 characters, values at most 512", param="metadata")


def chat_messages(items, fields: list[str], instructions: str | None) -> tuple[list[dict], list[Source]]:
    """The chat messages of a conversation of (normalized) input items, each item coming from the request
    field ``fields[i]``; ``instructions`` first, as a system message. Returns the messages and their sources."""
    messages: list[dict] = []
    sources: list[Source] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
        sources.append(Source("instructions"))
    for item, field in zip(items, fields):
        kind = item["type"]
        if kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant":  # the same answer's text, or calls
                messages[-1].setdefault("tool_calls", []).append(call)
                sources[-1] = Source(sources[-1].field, sources[-1].text, (*sources[-1].calls, field))
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                sources.append(Source(field, None, (field,)))
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item["output"])})
            sources.append(Source(field, "output"))
        else:
            messages.append({"role": item["role"], "content": _text(item["content"])})
            sources.append(Source(field, "content" if field != "input" else None))
    return messages, sources


def normalize(item: dict) -> dict:
    """An input or output item (a validated dict) as the conversation keeps it: its type and what the chat
    template renders, without ids, statuses or annotations."""
    return _normal(INPUT_ITEMS[item.get("type", "message")].model_validate(item))


def _normal(model: BaseModel) -> dict:
    if isinstance(model, FunctionCallItem):
        return {"type": "function_call", "call_id": model.call_id, "name": model.name, "arguments": model.arguments}
    if isinstance(model, FunctionCallOutputItem):
        return {"type": "function_call_output", "call_id": model.call_id, "output": _parts(model.output)}
    assert isinstance(model, MessageItem)
    return {"type": "message", "role": model.role, "content": _parts(model.content)}


def _parts(content):
    return content if isinstance(content, str) else [{"type": p.type, "text": p.text} for p in content]


def _text(content):
    """Chat's content of an item's text: the text, or its parts as chat's text parts (joined when rendered)."""
    return content if isinstance(content, str) else [{"type": "text", "text": p["text"]} for p in content]


def _item(i: int, raw: dict) -> dict:
    """Input item ``i``, checked and normalized."""
    param = f"input.{i}"
    kind = raw.get("type", "message" if "role" in raw else None)
    if kind is None:
        raise APIError(400, f"{param}: an item needs a type (message, function_call or function_call_output), or "
                       "a role for a message", param=param)
    if not isinstance(kind, str) or kind not in INPUT_ITEMS:  # (a list or object is no dict key: check first)
        hint = " (send the item itself, or use previous_response_id)" if kind == "item_reference" else ""
        raise APIError(400, f"{param}: items of type {kind!r} are not supported by this server; send message, "
                       f"function_call and function_call_output items{hint}", param=param)
    name = {"message": "content", "function_call_output": "output"}.get(kind)
    parts = raw.get(name) if name else None
    for j, part in enumerate(parts if isinstance(parts, list) else []):
        if not isinstance(part, dict):
            raise APIError(400, f"{param}.{name}.{j}: a part is an object ({{\"type\": \"input_text\", \"text\": "
                           f"...}}), not {type(part).__name__}", param=f"{param}.{name}.{j}")
        t = part.get("type")
        if t not in ("input_text", "output_text"):
            raise APIError(400, f"{param}.{name}.{j}: {t!r} parts are not supported by this server (text only: "
                           "input_text)", param=f"{param}.{name}.{j}")
        if t == "output_text" and raw.get("role") != "assistant":
            raise APIError(400, f"{param}.{name}.{j}: output_text parts belong to assistant messages; use "
                           "input_text", param=f"{param}.{name}.{j}")
    return _normal(_validated(INPUT_ITEMS[kind], raw, param))


def _validated(model: type[BaseModel], data, param: str):
    """``data`` validated as ``model``; a 400 naming the field within ``param`` otherwise."""
    if isinstance(data, dict) and model is FunctionTool:
        if data.get("type") != "function":
            raise APIError(400, f"{param}: {data.get('type')!r} tools are not supported by this server; only "
                           "function tools", param=param)
        if "function" in data:
            raise APIError(400, f"{param}: a function tool is flat here ({{\"type\": \"function\", \"name\": ..., "
                           "\"parameters\": ...}), not nested under 'function' as in Chat Completions", param=param)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(x for x in (param, validation_param(first)) if x)
        raise APIError(400, f"{where}: {first.get('msg', 'invalid value')}", param=where) from None


def _tool_choice(choice):
    """Chat's ``tool_choice`` of a Responses one."""
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, str):
        raise APIError(400, f"tool_choice must be none, auto, required or a function, got {choice!r}",
                       param="tool_choice")
    if choice.get("type") != "function":
        raise APIError(400, f"tool_choice: {choice.get('type')!r} is not supported by this server; name a function "
                       '({"type": "function", "name": ...})', param="tool_choice")
    return {"type": "function", "function": {"name": _validated(NamedFunction, choice, "tool_choice").name}}


def _response_format(fmt: dict | None) -> dict | None:
    """Chat's ``response_format`` of ``text.format`` (its type checked by the chat machinery)."""
    kind = fmt.get("type") if fmt is not None else None
    if isinstance(kind, str) and kind in TEXT_FORMATS:
        _validated(TEXT_FORMATS[kind], fmt, "text.format")
    if fmt is None or kind == "text":
        return None
    if fmt.get("type") == "json_schema":
        inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": inner}
    return {"type": fmt.get("type")}
