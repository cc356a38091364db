"""Pydantic models of OpenAI's Responses API (``/v1/responses``): the request, its input items and tools, the
response object and its output items.

The request is strict: a top-level field OpenAI does not define is a 400 (besides the extensions ``seed``,
``speculative`` and ``cache_salt``, as on chat), and the fields OpenAI defines that this server does not
implement are declared here only to be refused by name (:data:`REFUSED`). Input items and tools are typed
loosely here and validated item by item with the models below (:func:`specdec.server.responses.translate`),
so that an error names the item (``input.3``, ``tools.0``) and a built-in tool or an image part is refused in
words rather than as a failed union. Output shapes follow the openai package's ``openai.types.responses``.

This module knows the wire format only.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specdec.server.protocol import SpeculativeOptions, SpeculativeStats


class _Strict(BaseModel):
    """Unknown fields are refused; NaN/inf and numbers sent as strings or booleans too."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


# -- input items and tools (validated one by one) --------------------------------------------------

class TextPartIn(_Strict):
    """A text part of a message's content: ``input_text``, or ``output_text`` in an assistant's (an earlier
    answer sent back; its ``annotations`` and ``logprobs`` are not read)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(_Strict):
    """A message (``type`` may be left out): a chat message of the same role and content."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPartIn]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_Strict):
    """A call the model made earlier: ``arguments`` is JSON text."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    """The result of a call, as text (or text parts)."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[TextPartIn]
    id: str | None = None
    status: str | None = None


INPUT_ITEMS: dict[str, type[_Strict]] = {
    "message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem}
"""The input items served, by ``type``; any other type is a 400 naming the item."""


class FunctionTool(_Strict):
    """A function the model may call (Responses' flat shape: not nested under ``function``)."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(None, description="Accepted; arguments always match the schema here.")


class NamedFunction(_Strict):
    """``tool_choice`` naming the one function to call."""

    type: Literal["function"]
    name: str


class TextFormatText(_Strict):
    type: Literal["text"]


class TextFormatJSONObject(_Strict):
    type: Literal["json_object"]


class TextFormatJSONSchema(_Strict):
    """Structured output matching ``schema`` (its content is checked by the grammar compiler)."""

    type: Literal["json_schema"]
    name: str
    schema_: Any = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TEXT_FORMATS: dict[str, type[_Strict]] = {
    "text": TextFormatText, "json_object": TextFormatJSONObject, "json_schema": TextFormatJSONSchema}
"""``text.format`` by ``type``, validated one by one (a field of another type, or one OpenAI does not define
there, is a 400 naming it); an unknown type is refused by the chat machinery."""


# -- the request -------------------------------------------------------------------------------------

class TextConfig(_Strict):
    """``text``: the output's ``format`` (``{"type": "text"}``, ``{"type": "json_object"}`` or
    ``{"type": "json_schema", "name", "schema", "strict"?, "description"?}``)."""

    format: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesStreamOptions(_Strict):
    include_obfuscation: bool | None = None


REFUSED: dict[str, tuple] = {
    "background": (False,), "include": ([],), "reasoning": ({},), "top_logprobs": (0,), "max_tool_calls": (),
    "conversation": (), "prompt": (), "context_management": ([],), "moderation": (), "image": (),
    "prompt_cache_options": (), "background_options": (), "access_programs": (),
}
"""OpenAI's request fields this server does not implement, each with the values that ask for nothing (and
``null``): any other value is a 400 naming the field."""


class ResponsesRequest(_Strict):
    """``POST /v1/responses``. ``None`` means "not given": the server's default applies."""

    model: str | None = Field(None, description="Served model name (see GET /v1/models); default: the served model.")
    input: str | list[dict[str, Any]] = Field(description=(
        "Text (a user message), or items: messages, function_call and function_call_output items."))
    instructions: str | None = Field(None, description=(
        "A system message put first; not carried over by previous_response_id."))
    tools: list[dict[str, Any]] | None = Field(None, max_length=128, description=(
        "Function tools ({\"type\": \"function\", \"name\", \"description\", \"parameters\", \"strict\"})."))
    tool_choice: str | dict[str, Any] | None = Field(None, description=(
        'none, auto (the default with tools), required, or {"type": "function", "name": ...}.'))
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    temperature: float | None = Field(None, ge=0, description="0 = greedy; default 1.0 as in OpenAI's API.")
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**64, description="Extension: a seeded request gives the same output.")
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool = Field(True, description=(
        "Keep the response (per API key, bounded) for previous_response_id and GET /v1/responses/{id}."))
    previous_response_id: str | None = Field(None, description=(
        "Continue that stored response's conversation (its input and output) with this input."))
    metadata: dict[str, str] | None = Field(None, max_length=16, description="Echoed: up to 16 string pairs.")
    truncation: Literal["auto", "disabled"] | None = Field(None, description="Only disabled (a 400 when too long).")
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    speculative: SpeculativeOptions | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256, description=(
        "Extension: the prefix-cache salt, as on chat."))
    background: bool | None = None
    include: list[Any] | None = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    moderation: Any = None
    image: Any = None
    prompt_cache_options: Any = None
    background_options: Any = None
    access_programs: Any = None


# -- the response --------------------------------------------------------------------------------------

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    """The answer's text: one ``output_text`` part."""

    type: Literal["message"] = "message"
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    """A call the answer makes: send its result back as a ``function_call_output`` item with its ``call_id``."""

    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str = Field(description="JSON text; cut short when the status is incomplete.")
    status: ItemStatus


class InputTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="Prompt tokens served from the prefix cache (not evaluated).")


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class ResponseErrorOut(BaseModel):
    code: str
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """The response: its ``output`` items, ``usage``, and the request's settings repeated."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseErrorOut | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputMessage | OutputFunctionCall]
    usage: ResponseUsage | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    temperature: float
    top_p: float
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    text: dict[str, Any]
    metadata: dict[str, str]
    store: bool
    truncation: Literal["disabled"] = "disabled"
    background: bool = False
    reasoning: None = None
    user: str | None = None
    speculative: SpeculativeStats | None = Field(None, description="Extension, as on chat (terms: specdec.types).")


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
