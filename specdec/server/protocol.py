"""Pydantic models of the OpenAI-compatible HTTP API (requests, responses, stream chunks, errors).

Requests follow OpenAI's Completions and Chat Completions APIs. Fields of
:class:`~specdec.types.SamplingParams` that OpenAI does not define (``top_k``, and whatever the engine
adds) are accepted by name as extra fields and validated against the dataclass's type hints, so new
sampling parameters reach the engine without changes here. The extension object ``speculative``
(request: method, num_speculative_tokens, provenance; response: proposed, accepted, mean accepted
length) and the per-choice ``provenance`` list (:class:`TokenProvenanceOut`, only when asked for) are
ignored by clients that do not know them.

This module knows the wire format only; it does not know the engine or the scheduler.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from specdec.params import MAX_SPECULATIVE_TOKENS


class _Lenient(BaseModel):
    """Unknown fields are kept (and later mapped onto SamplingParams or ignored); NaN/inf are refused,
    and so are numbers sent as strings or booleans (strict types, as OpenAI's API: ``"0.5"`` is not a
    temperature; an integer is accepted where a float is expected)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)


class StreamOptions(_Lenient):
    """``stream_options``: ``include_usage`` adds a last chunk with ``usage`` and empty ``choices``."""

    include_usage: bool = False


class SpeculativeOptions(BaseModel):
    """Request extension: per-request proposer settings (default: the server's)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    method: str | None = Field(None, description="A SpecConfig method: draft, ngram, suffix, hybrid, auto or none.")
    num_speculative_tokens: int | None = Field(None, ge=0, le=MAX_SPECULATIVE_TOKENS)
    cascade: bool | None = Field(None, description="Draft models draft as a cascade (prompt lookup guesses, "
                                 "one draft call checks each guess); default: the server's setting.")
    provenance: bool = Field(False, description="Add per-token provenance to each choice (see TokenProvenanceOut).")


class _GenerationRequest(_Lenient):
    """Fields shared by both endpoints. ``None`` means "not given": the server's default applies."""

    model: str | None = Field(None, description="Served model name (see GET /v1/models); default: the served model.")
    max_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    temperature: float | None = Field(None, ge=0, description="0 = greedy; default 1.0 as in OpenAI's API.")
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, description="Independent choices per prompt (SamplingParams.for_sample seeds).")
    stop: str | list[str] | None = Field(None, description="Up to 16 stop strings; the text is cut before them.")
    seed: int | None = Field(None, ge=0, lt=2**64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256, description=(
        "Prefix-cache salt (vLLM's): the request reuses cached prompt prefixes only of requests with the same "
        "salt and API key, so that clients who do not share a salt cannot learn each other's prompts from "
        "cached_tokens or timing."))
    speculative: SpeculativeOptions | None = None
    prediction: "Prediction | None" = Field(None, description=(
        "OpenAI's Predicted Outputs: {\"type\": \"content\", \"content\": text or text parts}, the likely "
        "output (the file being edited, a previous answer). Drafted from by `auto` as one more free source; "
        "the output is the same with or without it, only faster when it is right."))
    response_format: dict[str, Any] | None = Field(None, description=(
        "OpenAI's: {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": \"json_schema\", "
        "\"json_schema\": {\"name\": ..., \"schema\": {...}, \"strict\": true}}: the output is constrained to it "
        "(speculation stays lossless with respect to the constrained distribution)."))
    guided_json: dict[str, Any] | str | None = Field(None, description="Extension (vLLM's): a JSON schema the output matches.")
    guided_regex: str | None = Field(None, description="Extension (vLLM's): a regular expression the output matches.")
    guided_grammar: str | None = Field(None, description="Extension (vLLM's): a grammar the output matches, in "
                                       "llama.cpp's GBNF or Lark (llguidance's dialect).")


class TextPart(_Lenient):
    """A content part of a chat message; only ``type="text"`` is supported."""

    type: str
    text: str | None = None


class Prediction(BaseModel):
    """``prediction`` (OpenAI's Predicted Outputs): the predicted output as text, or as text parts."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["content"]
    content: str | list[TextPart]


class FunctionCallIn(_Lenient):
    """A call an assistant made earlier in the conversation: ``arguments`` is JSON text (OpenAI's)."""

    name: str
    arguments: str = "{}"


class ToolCallIn(_Lenient):
    """An item of an assistant message's ``tool_calls``."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Lenient):
    """One chat message. ``content`` may be null (or absent) only in an assistant message with
    ``tool_calls``, as in OpenAI's API (refused with the content's ``param`` when the messages are
    rendered); a ``role: "tool"`` message answers a call (``tool_call_id``, checked as the template's
    markup: no control token's text); ``role: "developer"`` (newer clients' name of the system role) is
    rendered as the template's system turn. Other extra fields (``name``) are accepted and ignored."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class FunctionDef(_Lenient):
    """A tool's function: its name, what it does, and the JSON schema of its arguments."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(None, description="Accepted; arguments always match the schema here.")


class ToolDef(_Lenient):
    """An item of ``tools``: only functions exist."""

    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(_Lenient):
    """``tool_choice`` naming the one function to call."""

    type: Literal["function"]
    function: dict[str, str]


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``: plain completion of a prompt (no chat template)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20, description="Top alternatives per token (and the token's own).")
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``: messages rendered with the target's chat template."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="Alias of max_tokens.")
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolDef] | None = Field(None, max_length=128, description=(
        "Functions the model may call, shown to it by its chat template; every call it makes is valid JSON "
        "matching the function's parameters (a grammar)."))
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(None, description=(
        "none: text only; auto (the default with tools): text or calls; required: at least one call; "
        '{"type": "function", "function": {"name": ...}}: that function.'))
    parallel_tool_calls: bool = Field(True, description="Whether an answer may hold several calls.")


# -- responses -------------------------------------------------------------------------------------

class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="Prompt tokens served from the prefix cache (not evaluated).")


class CompletionTokensDetails(BaseModel):
    accepted_prediction_tokens: int = Field(0, description=(
        "Tokens of the request's prediction accepted into the answer (drafted from it and verified)."))
    rejected_prediction_tokens: int = Field(0, description=(
        "Tokens of the request's prediction drafted and rejected by verification (they cost target rows, "
        "never text)."))


class Usage(BaseModel):
    """Token counts: prompt tokens once per prompt, completion tokens summed over choices."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails = Field(default_factory=CompletionTokensDetails)


class SpeculativeStats(BaseModel):
    """Response extension; terms as in :mod:`specdec.types`."""

    method: str
    num_speculative_tokens: int
    proposed: int = Field(description="Draft tokens handed to the verifier.")
    accepted: int = Field(description="Draft tokens the verifier kept.")
    acceptance_rate: float | None = Field(description="accepted / proposed; null when nothing was proposed.")
    mean_accepted_length: float | None = Field(
        description="Tokens committed per target call, the recovered or bonus token included (plain decoding: 1)."
    )
    target_calls: int


class TokenProvenanceOut(BaseModel):
    """Extension: where one generated token came from (terms as in :mod:`specdec.types`)."""

    token_id: int
    source: Literal["accepted", "recovered", "bonus", "plain"] = Field(
        description="accepted: a draft token the target accepted; recovered: the target's token after a "
        "rejection; bonus: the target's token after a fully accepted block; plain: the target's token of a "
        "step without drafts.")
    drafter: str | None = Field(description="The kind of proposal of its step (draft for the first draft model, "
                                "draft:<name> for another, ngram3, suffix, ...), "
                                "null when unnamed or on a plain step.")
    step: int = Field(description="The target call that committed it, 0-based; one step's tokens arrive together.")
    proposed: int = Field(description="Drafts its step verified.")
    offset: int = Field(description="Index in the choice's whole text, Unicode code points, of its first character.")
    length: int = Field(description="Characters (code points) it completed; spans cut by a stop string "
                        "reach past the text's end.")


class _ChoiceBase(BaseModel):
    """A choice whose ``provenance`` (extension) is left out unless the request asked for it."""

    provenance: list[TokenProvenanceOut] | None = None

    @model_serializer(mode="wrap")
    def _drop_unasked(self, handler):
        data = handler(self)
        provenance = data.pop("provenance", None)
        if provenance is not None:
            data["provenance"] = provenance  # last, after OpenAI's own fields
        return data


class CompletionChoice(_ChoiceBase):
    index: int
    text: str
    logprobs: Any = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    speculative: SpeculativeStats | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str = Field(description="JSON text; cut short when finish_reason is length.")


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    """The answer: ``content`` (null when the answer is tool calls only) and ``tool_calls`` (left out
    when there are none)."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler):
        data = handler(self)
        if data.get("tool_calls") is None:
            data.pop("tool_calls", None)
        return data


class ChatChoice(_ChoiceBase):
    index: int
    message: AssistantMessage
    logprobs: Any = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    speculative: SpeculativeStats | None = None


# -- stream chunks ---------------------------------------------------------------------------------

class Delta(BaseModel):
    """A streamed message delta: ``{"role": "assistant", "content": ""}`` first, then ``{"content": ...}``
    and ``{"tool_calls": [...]}`` (a call's ``index``, ``id``, ``type`` and name first, then pieces of its
    ``arguments``), ``{}`` with the finish reason. Absent keys are left out, as OpenAI does."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer
    def _drop_none(self) -> dict[str, Any]:
        return {k: v for k, v in (("role", self.role), ("content", self.content), ("tool_calls", self.tool_calls))
                if v is not None}


class ChatChunkChoice(_ChoiceBase):
    index: int
    delta: Delta
    logprobs: Any = None
    finish_reason: str | None = None


class CompletionChunkChoice(_ChoiceBase):
    index: int
    text: str
    logprobs: Any = None
    finish_reason: str | None = None


class _Chunk(BaseModel):
    """One SSE event of a streamed response. ``usage`` is present (null until the last event) only when
    the client asked for it (``stream_options.include_usage``); ``speculative`` only on the last chunk of
    each choice and on the usage event."""

    id: str
    created: int
    model: str
    usage: Usage | None = None
    speculative: SpeculativeStats | None = None

    def wire(self) -> dict:
        """The JSON object as sent: ``usage`` and ``speculative`` left out unless set."""
        data = self.model_dump()
        for name in ("usage", "speculative"):
            if name not in self.model_fields_set:
                del data[name]
        return data


class ChatCompletionChunk(_Chunk):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class CompletionChunk(_Chunk):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChunkChoice]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape, used for every 4xx and 5xx."""

    error: ErrorBody


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specdec"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


for _model in (CompletionRequest, ChatCompletionRequest):  # ``prediction`` names a class defined after theirs
    _model.model_rebuild()
