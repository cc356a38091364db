"""From an OpenAI request to scheduler jobs and back: prompts, sampling parameters, limits, responses.

Fields are mapped onto :class:`~specdec.types.SamplingParams` by name (``max_completion_tokens`` is an
alias of ``max_tokens``), so a sampling parameter added to the engine is served without changes here;
an OpenAI field the engine lacks is refused with 400 when set, never silently ignored. ``n`` choices are
``n`` independent requests (choice ``i`` runs with ``SamplingParams.for_sample(i)``: derived seeds). Unknown
fields that are neither OpenAI's nor SamplingParams' are ignored, as vLLM does. Each choice streams its chunks through an
asyncio queue fed by the scheduler thread; leaving the stream (client gone) cancels every choice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import math
import typing
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields

from pydantic import ConfigDict, TypeAdapter, ValidationError

from specdec.output import StreamChunk
from specdec.grammar import GrammarError
from specdec.scheduler import QueueFullError, RequestError, SchedulerClosedError, SchedulerDiedError
from specdec.server.errors import APIError
from specdec.server.protocol import (
    ChatCompletionRequest, CompletionRequest, CompletionTokensDetails, PromptTokensDetails, SpeculativeStats, Usage,
)
from specdec.params import SamplingParams, SpecConfig
from specdec.proposers.prediction import KIND as PREDICTION
from specdec.stats import acceptance_rate, mean_accepted_length
from specdec.backends.chat_template import unshown
from specdec.tools import EMPTY_PARAMETERS, Function, HermesFormat, template_arguments
from specdec.types import GenerationResult

log = logging.getLogger(__name__)

SERVER_FIELDS = frozenset({
    "model", "prompt", "messages", "n", "stream", "stream_options", "user", "speculative", "echo", "suffix",
    "best_of", "logprobs", "top_logprobs", "tools", "tool_choice", "response_format", "max_tokens",
    "max_completion_tokens", "stop", "seed", "parallel_tool_calls", "metadata", "store", "service_tier", "cache_salt",
    "guided_json", "guided_regex", "guided_grammar", "guided_choice", "guided_decoding_backend", "guided_whitespace_pattern",
    "structural_tag", "prediction",
})
"""Request fields the server handles itself (or refuses) instead of passing them to SamplingParams."""

MAX_STOP_STRINGS = 16


@dataclass(frozen=True)
class Limits:
    """Per-request limits of the server.

    Attributes:
        max_prompt_tokens: Longest prompt, tokens (chat template included).
        max_tokens: Largest ``max_tokens`` a request may ask for.
        max_choices: Most choices (prompts x n) in one request.
    """

    max_prompt_tokens: int
    max_tokens: int
    max_choices: int = 16


@functools.lru_cache(maxsize=None)
def _adapter(name: str) -> TypeAdapter:
    hint = typing.get_type_hints(SamplingParams)[name]
    try:
        # strict: numbers sent as strings or booleans are refused; logit_bias's keys are JSON strings
        # (checked strictly, values too, by the request model) that become token ids here
        return TypeAdapter(hint, config=ConfigDict(allow_inf_nan=False, strict=name != "logit_bias"))
    except Exception:  # pydantic refuses a config for some types (e.g. dataclasses); validate without
        return TypeAdapter(hint)


def sampling_kwargs(req: CompletionRequest | ChatCompletionRequest) -> dict:
    """SamplingParams keyword arguments from the request's fields, by name (max_tokens and seed excluded).

    Raises:
        APIError: 400 for a value of the wrong type or a set field the engine does not support.
    """
    names = {f.name for f in fields(SamplingParams)}
    kwargs: dict = {"temperature": 1.0}  # OpenAI's default
    for name, value in req.model_dump(exclude_none=True).items():
        if name in SERVER_FIELDS:
            continue
        if name in names:
            try:
                kwargs[name] = _adapter(name).validate_python(value)
            except ValidationError as e:
                raise APIError(400, f"{name}: {e.errors()[0]['msg']}", param=name) from None
        elif name in type(req).model_fields and value not in (0, 0.0, False, {}, [], ""):
            raise APIError(400, f"{name} is not supported by this server yet", param=name)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings are allowed", param="stop")
    kwargs["stop"] = tuple(stop)
    return kwargs


def refuse_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    """400 for OpenAI features this server does not implement, rather than ignoring them."""
    if isinstance(req, CompletionRequest):
        best_of = req.best_of not in (None, 1, req.n) and req.best_of
        bad = [("echo", req.echo), ("suffix", req.suffix), ("best_of", best_of)]
    else:
        bad = []
    for name, value in bad:
        if value:
            raise APIError(400, f"{name} is not supported by this server yet", param=name)


@dataclass(frozen=True)
class ToolPlan:
    """A chat request's tools.

    Attributes:
        functions: The functions, in the request's order.
        choice: ``"none"``, ``"auto"``, ``"required"`` or a function's name.
        parallel: ``parallel_tool_calls``.
    """

    functions: tuple[Function, ...]
    choice: str
    parallel: bool

    @property
    def calls(self) -> bool:
        """Whether the answer may hold calls (and is parsed for them)."""
        return self.choice != "none"

    def tools(self) -> list[dict] | None:
        """The tools the chat template shows the model (none for ``tool_choice="none"``, as vLLM's
        ``--exclude-tools-when-tool-choice-none``: a model shown tools may call them anyway)."""
        return [f.tool() for f in self.functions] if self.calls else None

    @property
    def names(self) -> frozenset[str]:
        """The functions the answer may call (the parser reads calls to these only): the one
        ``tool_choice`` names, else all."""
        if self.choice in ("auto", "required", "none"):
            return frozenset(f.name for f in self.functions)
        return frozenset({self.choice})


def tool_plan(req: ChatCompletionRequest) -> ToolPlan | None:
    """The request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked; None without tools.

    Raises:
        APIError: 400 naming the field: a function with a bad name or schema, two functions of one name,
            ``tool_choice`` without tools or naming a function that is not one of them.
    """
    choice = req.tool_choice
    if not req.tools:
        if choice is not None and choice != "none":
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    functions = []
    for i, tool in enumerate(req.tools):
        fn = tool.function
        try:
            functions.append(Function(fn.name, EMPTY_PARAMETERS if fn.parameters is None else fn.parameters,
                                      fn.description or ""))
        except ValueError as e:
            raise APIError(400, f"tools.{i}.function: {e}", param=f"tools.{i}.function") from None
    names = [f.name for f in functions]
    if len(set(names)) < len(names):
        raise APIError(400, "tools: two functions have the same name", param="tools")
    if choice is None:
        choice = "auto"
    elif not isinstance(choice, str):
        name = choice.function.get("name")
        if name not in names:
            raise APIError(400, f"tool_choice names the function {name!r}, which is not one of the tools",
                           param="tool_choice")
        choice = name
    return ToolPlan(tuple(functions), choice, req.parallel_tool_calls)


def grammar_of(req: CompletionRequest | ChatCompletionRequest, tools: ToolPlan | None = None):
    """The request's structured-output constraint (:class:`~specdec.grammar.GrammarSpec`) from OpenAI's
    ``response_format``, its ``tools`` (calls valid against their schemas: :mod:`specdec.tools`) or vLLM's
    ``guided_json`` / ``guided_regex`` / ``guided_grammar``, with the field that gave it:
    ``(field, spec)``; ``None`` for free text. Only the cheap checks run here (:class:`GrammarSpec`'s
    bounds); :func:`compile_grammar` compiles it.

    Raises:
        APIError: 400 naming the field, for an unknown format, a missing or invalid schema or grammar, or
            more than one constraint.
    """
    from specdec.grammar import GrammarSpec

    given = []
    fmt = req.response_format
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            given.append(("response_format", lambda: GrammarSpec("json_object")))
        elif kind == "json_schema":
            inner = fmt.get("json_schema")
            schema = inner.get("schema") if isinstance(inner, dict) else None
            if not isinstance(schema, dict):
                raise APIError(400, "response_format.json_schema.schema must be a JSON schema (an object)",
                               param="response_format")
            given.append(("response_format", lambda: GrammarSpec.json_schema(schema)))
        elif kind != "text":
            raise APIError(400, f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                           param="response_format")
    if req.guided_json is not None:
        given.append(("guided_json", lambda: GrammarSpec.json_schema(req.guided_json)))
    if req.guided_regex is not None:
        given.append(("guided_regex", lambda: GrammarSpec("regex", req.guided_regex)))
    if req.guided_grammar is not None:
        given.append(("guided_grammar", lambda: _grammar_text(req.guided_grammar)))
    extra = req.model_extra or {}
    if "guided_choice" in extra:
        given.append(("guided_choice", lambda: _choice(extra["guided_choice"])))
    for name in UNSUPPORTED_GUIDED:
        if extra.get(name) is not None:
            raise APIError(400, f"{name} is not supported by this server", param=name)
    if tools is not None and tools.calls:
        given.insert(0, ("tools", lambda: HermesFormat().grammar(tools.functions, tools.choice, tools.parallel)))
    if len(given) > 1:
        raise APIError(400, f"give one constraint, not {' and '.join(n for n, _ in given)}", param=given[1][0])
    if not given:
        return None
    name, build = given[0]
    try:
        return name, build()
    except ValueError as e:
        raise APIError(400, f"{name}: {e}", param=name) from None
    except RecursionError:
        raise APIError(400, f"{name}: nested too deeply", param=name) from None


_COMPILERS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")
"""Where grammars compile: off the event loop and the scheduler thread (each waits for a trial process)."""


async def compile_grammar(engine, grammar, field: str, budget_s: float, salt: str):
    """Compile a request's grammar for the engine's models (:meth:`~specdec.engine.Engine.compile_grammar`:
    a trial in a child process under ``budget_s`` seconds, then cached per ``salt``, the tenant), off the
    event loop; a grammar the tenant sent before is answered from the cache at once, never waiting behind
    other compilations.

    Returns:
        The grammar carrying its compiled matchers (for the request's SamplingParams).

    Raises:
        APIError: 400 naming ``field`` for a grammar that does not compile, crashes the grammar engine or
            runs over the budget; 503 when no trial process can start.
    """
    cached = engine.cached_grammar(grammar, salt)
    if cached is not None:
        return cached
    try:
        return await asyncio.get_running_loop().run_in_executor(_COMPILERS, engine.compile_grammar, grammar,
                                                                budget_s, salt)
    except GrammarError as e:
        raise APIError(400, f"{field}: {e}", param=field) from None
    except RuntimeError as e:  # the trial process itself: the server's problem, not the request's
        log.error("grammar trial process: %s", e)
        raise APIError(503, "the server cannot check grammars right now; retry shortly",
                       code="grammar_unavailable") from None


def _grammar_text(text: str):
    """A Lark grammar (llguidance's dialect) or else a GBNF one (``root ::= ...``)."""
    from specdec.grammar import GrammarSpec

    return GrammarSpec.from_text(text)


UNSUPPORTED_GUIDED = ("guided_decoding_backend", "guided_whitespace_pattern", "structural_tag")
"""vLLM's structured-output fields this server does not take (a 400 rather than silence)."""


def _choice(options) -> "GrammarSpec":
    """vLLM's ``guided_choice``: the output is one of the strings."""
    from specdec.grammar import GrammarSpec

    if not isinstance(options, list) or not options or not all(isinstance(o, str) and o for o in options):
        raise ValueError("guided_choice must be a list of non-empty strings")
    return GrammarSpec("lark", "start: " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options))


def logprob_kwargs(req: CompletionRequest | ChatCompletionRequest) -> dict:
    """SamplingParams ``logprobs``/``top_logprobs`` from OpenAI's two conventions: chat has a flag and a
    count, completions one count (``logprobs=N``: the token's own logprob and N alternatives)."""
    if isinstance(req, CompletionRequest):
        return {"logprobs": True, "top_logprobs": req.logprobs} if req.logprobs is not None else {}
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    return {"logprobs": True, "top_logprobs": req.top_logprobs or 0} if req.logprobs else {}


def max_tokens_for(req, prompt_len: int, n_ctx: int, limits: Limits, default: int | None) -> int:
    """The request's ``max_tokens`` checked against the limits and the context.

    Args:
        default: Used when the request gives none (``None``: whatever fits the context, up to the limit).

    Raises:
        APIError: 400 when over the limit or when prompt + max_tokens exceed the context.
    """
    asked = getattr(req, "max_completion_tokens", None) or req.max_tokens
    room = n_ctx - prompt_len
    if asked is None:
        return max(1, min(limits.max_tokens, room, default or room))
    if asked > limits.max_tokens:
        raise APIError(400, f"max_tokens is {asked}, over this server's limit of {limits.max_tokens}",
                       param="max_tokens")
    if asked > room:
        raise APIError(400, f"this model's context holds {n_ctx} tokens; the prompt has {prompt_len} and "
                       f"max_tokens asks for {asked}: shorten the prompt or lower max_tokens",
                       param="max_tokens", code="context_length_exceeded")
    return asked


def check_prompt(engine, ids: list[int], limits: Limits) -> list[int]:
    """Validate prompt token ids (range, emptiness, length).

    Raises:
        APIError: 400 with ``context_length_exceeded`` for a prompt that is too long.
    """
    if len(ids) > limits.max_prompt_tokens:
        raise APIError(400, f"the prompt is {len(ids)} tokens, over the limit of {limits.max_prompt_tokens}",
                       param="prompt", code="context_length_exceeded")
    try:
        return engine.encode_prompt(ids)
    except ValueError as e:
        code = "context_length_exceeded" if "context" in str(e) else None
        raise APIError(400, str(e), param="prompt", code=code) from None


def check_logit_bias(engine, params: SamplingParams) -> None:
    """Refuse ``logit_bias`` ids outside the real vocabulary with a 400 before a stream starts (the
    scheduler would find them too, but only after the 200 of a streamed answer went out).

    Raises:
        APIError: 400 naming the first such id.
    """
    bad = [t for t in params.logit_bias if not 0 <= t < engine.info.vocab_size]
    if bad:
        raise APIError(400, f"logit_bias token id {bad[0]} is outside the vocabulary "
                       f"(0..{engine.info.vocab_size - 1})", param="logit_bias")


def param_of(message: str) -> str | None:
    """The request field a :class:`SamplingParams` error message starts with, or None."""
    first = message.split(" ", 1)[0]
    return first if first in SamplingParams.__dataclass_fields__ else None


def tokenize_completion_prompts(engine, prompt) -> list[list[int]]:
    """``prompt`` (text, texts, ids or lists of ids) to token id lists; control tokens are parsed."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "the prompt is empty", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    out = []
    for p in prompt:
        out.append(list(p) if isinstance(p, list) else _tokenize(engine, p))
    return out


def tokenize_chat(engine, messages, tools: ToolPlan | None = None) -> list[int]:
    """Render the messages (and the tools the model is shown) with the target's chat template and tokenize:
    control tokens are parsed in the template's markup only, never in a message's content, and tools,
    earlier calls or their ids holding a control token's text are refused (:meth:`Engine.encode_chat`). A
    ``developer`` message is rendered as the template's system turn, where it stands (as vLLM does).

    Raises:
        APIError: 400 naming the field for a message without content, a call whose arguments are not JSON,
            a template that fails, a system or developer message the template leaves out, or tools with a
            model whose chat template has no tool-call format this server knows.
    """
    rendered = []
    for i, m in enumerate(messages):
        content = m.content
        if content is None and not (m.role == "assistant" and m.tool_calls):
            raise APIError(400, f"messages.{i}.content: a {m.role} message needs content (null only in an "
                           "assistant message with tool_calls)", param=f"messages.{i}.content")
        if isinstance(content, list):
            if any(p.type != "text" or p.text is None for p in content):
                raise APIError(400, "only text content parts are supported", param="messages")
            content = "".join(p.text for p in content)
        _check_unicode(content or "", "messages")
        message: dict = {"role": m.role, "content": content or ""}
        if m.tool_calls:
            try:
                message["tool_calls"] = template_arguments([c.model_dump(exclude_none=True) for c in m.tool_calls])
            except ValueError as e:
                raise APIError(400, f"messages.{i}.{e}", param=f"messages.{i}.tool_calls") from None
            _check_unicode(json.dumps(message["tool_calls"], ensure_ascii=False), f"messages.{i}.tool_calls")
        if m.tool_call_id is not None:
            _check_unicode(m.tool_call_id, f"messages.{i}.tool_call_id")
            message["tool_call_id"] = m.tool_call_id
        rendered.append(message)
    shown = tools.tools() if tools is not None else None
    if shown:
        _check_unicode(json.dumps(shown, ensure_ascii=False), "tools")
    try:
        known = not shown or HermesFormat.detect(engine.render_chat([{"role": "user", "content": "?"}], tools=shown))
        left_out = unshown(rendered, functools.partial(engine.render_chat, tools=shown), ("system", "developer"))
        ids = engine.encode_chat(rendered, tools=shown)
    except ValueError as e:
        raise APIError(400, str(e), param=getattr(e, "field", "messages")) from None
    except Exception as e:  # a template may raise anything on odd input
        raise APIError(400, f"the chat template failed on these messages: {e}", param="messages") from None
    if left_out:
        i = left_out[0]
        raise APIError(400, f"messages.{i}: this model's chat template leaves this {messages[i].role} message out "
                       "(a developer message is a system one); send it first, or as user text",
                       param=f"messages.{i}")
    if not known:
        raise APIError(400, "tools: this model's chat template does not show tools in a format this server "
                       "knows (Qwen2.5's and Hermes' <tool_call>)", param="tools")
    return ids


def _check_unicode(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "the text contains invalid Unicode (lone surrogates)", param=param) from None


def _tokenize(engine, text: str) -> list[int]:
    _check_unicode(text, "prompt")
    return engine.tokenize(text, special=True)  # a raw prompt is the client's own: control tokens parsed


def spec_for(engine, req) -> SpecConfig:
    """The request's proposer settings: the server's default overridden by ``speculative`` (without
    ``num_speculative_tokens``, the server's k for its own method, else the method's default).

    Raises:
        APIError: 400 for an unknown method, or the draft method when no draft model is loaded.
    """
    base, opt = engine.spec, req.speculative
    predicted = prediction_ids(engine, req.prediction)
    if predicted:
        base = dataclasses.replace(base, prediction=predicted)
    if opt is None:
        return base
    method = opt.method or base.method
    k = opt.num_speculative_tokens
    if k is None and method == base.method:
        k = base.num_speculative_tokens
    try:
        cascade = base.cascade if opt.cascade is None else opt.cascade
        spec = dataclasses.replace(base, method=method, num_speculative_tokens=k, cascade=cascade)
    except ValueError as e:
        raise APIError(400, f"speculative: {e}", param="speculative") from None
    try:
        engine.check_spec(spec)
    except ValueError as e:
        raise APIError(400, f"speculative.method: {e} (start the server with a draft model)",
                       param="speculative.method") from None
    return spec


def prediction_ids(engine, prediction) -> tuple[int, ...]:
    """The token ids of a request's ``prediction`` (its text, or its text parts joined), tokenized as output
    text (control tokens' names stay text); ``()`` for none or an empty one.

    Raises:
        APIError: 400 naming ``prediction`` for a part that is not text, invalid Unicode, or a prediction
            longer than the context.
    """
    if prediction is None:
        return ()
    if isinstance(prediction.content, str):
        text = prediction.content
    else:
        for i, part in enumerate(prediction.content):
            if part.type != "text" or not isinstance(part.text, str):
                raise APIError(400, f"prediction.content[{i}]: only text parts are supported (type 'text' with "
                               "'text')", param="prediction")
        text = "".join(part.text for part in prediction.content)
    _check_unicode(text, "prediction")
    ids = engine.tokenize(text, special=False)
    if len(ids) > engine.n_ctx:
        raise APIError(400, f"prediction is {len(ids)} tokens, longer than the context ({engine.n_ctx})",
                       param="prediction")
    return tuple(ids)


def speculative_stats(spec: SpecConfig, results: list[GenerationResult]) -> SpeculativeStats:
    """The response's ``speculative`` object, summed over choices."""
    proposed = sum(r.stats.proposed for r in results)
    accepted = sum(r.stats.accepted for r in results)
    calls = sum(r.stats.target_calls for r in results)
    committed = sum(r.stats.committed for r in results)
    rate, mal = acceptance_rate(accepted, proposed), mean_accepted_length(committed, calls)
    return SpeculativeStats(
        method=spec.method if spec.k else "none", num_speculative_tokens=spec.k, proposed=proposed,
        accepted=accepted, acceptance_rate=None if math.isnan(rate) else rate,
        mean_accepted_length=None if math.isnan(mal) else mal, target_calls=calls,
    )


def usage(prompts: list[list[int]], results: list[GenerationResult]) -> Usage:
    """Prompt tokens once per prompt, completion tokens summed over the choices; cached prompt tokens
    (OpenAI's ``prompt_tokens_details.cached_tokens``) from the first choice of each prompt."""
    p = sum(len(x) for x in prompts)
    c = sum(len(r.token_ids) for r in results)
    per_prompt = len(results) // max(1, len(prompts))
    cached = sum(r.stats.cached_prompt_tokens for r in results[::per_prompt]) if per_prompt else 0
    predicted = [r.stats.by_drafter.get(PREDICTION, {"proposed": 0, "accepted": 0}) for r in results]
    accepted = sum(d["accepted"] for d in predicted)
    return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
                 completion_tokens_details=CompletionTokensDetails(
                     accepted_prediction_tokens=accepted,
                     rejected_prediction_tokens=sum(d["proposed"] for d in predicted) - accepted))


class StreamOverflowError(RuntimeError):
    """A client left more than :attr:`Choices.buffer` events unread: its request was cancelled."""


class Choices:
    """The jobs of one HTTP request, and the asyncio queue their events arrive on.

    Args:
        scheduler: Where the jobs run.
        items: ``(prompt_ids, params, spec)`` per choice, in choice order.
        cache_salt: The requests' prefix-cache salt (:class:`~specdec.scheduler.Job`).
        buffer: Most events waiting in the queue: a client that reads none (stopped reading a stream, or
            gone without the server noticing yet) while more arrive has its choices cancelled, and the
            queue ends with a :class:`StreamOverflowError`, instead of growing without bound.
        grammar_field: The request's field that gave its grammar (``response_format``, ``tools``, ...): an
            error the grammar raises while generating names it.
        label: The response's id: each job's name in log lines (``serve --explain``), with ``/i`` for
            choice ``i`` when there are several.

    Raises:
        APIError: 429 when the queue is full, 503 while the server shuts down.
    """

    def __init__(self, scheduler, items: list[tuple[list[int], SamplingParams, SpecConfig]], cache_salt: str = "",
                 buffer: int = 4096, grammar_field: str | None = None, label: str = ""):
        self.grammar_field = grammar_field  # the request field a GrammarError found while generating names
        loop = asyncio.get_running_loop()
        self.events: asyncio.Queue[tuple[int, StreamChunk | BaseException]] = asyncio.Queue()
        self.buffer, self.overflowed = buffer, False

        def put(item) -> None:  # on the event loop
            if self.overflowed:
                return
            if self.events.qsize() >= self.buffer:
                self.overflowed = True
                self.cancel()
                item = (item[0], StreamOverflowError(f"the client read none of the last {self.buffer} chunks"))
            self.events.put_nowait(item)

        def emitter(i: int):
            return lambda ev: loop.call_soon_threadsafe(put, (i, ev))

        self.scheduler = scheduler
        try:
            names = [label if len(items) == 1 else f"{label}/{i}" for i in range(len(items))] if label else [""] * len(items)
            self.jobs = scheduler.submit_many([(p, s, spec, emitter(i), cache_salt, names[i])
                                               for i, (p, s, spec) in enumerate(items)])
        except QueueFullError as e:
            raise APIError(429, str(e), code="queue_full") from None
        except SchedulerClosedError as e:
            raise APIError(503, str(e), code="shutting_down" if scheduler.error is None else "server_dead") from None

    def cancel(self) -> None:
        """Cancel every choice still running (no-op for finished ones)."""
        for job in self.jobs:
            self.scheduler.cancel(job)

    async def results(self) -> list[GenerationResult]:
        """Wait for every choice to finish.

        Raises:
            APIError: 500 when a choice failed in the engine.
        """
        out: list[GenerationResult | None] = [None] * len(self.jobs)
        while any(r is None for r in out):
            i, ev = await self.events.get()
            if isinstance(ev, BaseException):
                raise engine_error(ev, self.grammar_field)
            if ev.result is not None:
                out[i] = ev.result
        return out  # type: ignore[return-value]


@dataclass(frozen=True)
class ChatRun:
    """A chat request admitted to the scheduler, as both chat-shaped endpoints (Chat Completions and
    Responses) read its answers.

    Attributes:
        choices: Its jobs and the queue of their events.
        prompts: The rendered prompt's token ids (one prompt).
        spec: The proposer settings it runs with.
        tools: Its tools (None: none); answers are read for calls when ``tools.calls``.
    """

    choices: Choices
    prompts: list[list[int]]
    spec: SpecConfig
    tools: ToolPlan | None


def engine_error(e: BaseException, grammar_field: str | None = None) -> APIError:
    """An error raised in the scheduler thread as an API error: 400 for a request the engine refused at
    admission (:class:`~specdec.scheduler.RequestError`, its message written for clients), 503 when the
    scheduler died or the client's stream overflowed, else 500 saying only that generation failed (a
    ``ValueError`` of a library during a step too); the details go to the log, not to the client."""
    if isinstance(e, GrammarError) and grammar_field:  # found impossible while generating: the client's grammar
        return APIError(400, f"{grammar_field}: {e}", param=grammar_field)
    if isinstance(e, (RequestError, GrammarError)):
        return APIError(400, str(e))
    if isinstance(e, StreamOverflowError):
        return APIError(503, f"request cancelled: {e}", code="client_too_slow")
    log.error("request failed in the engine", exc_info=e)
    if isinstance(e, SchedulerDiedError):
        return APIError(503, "the server hit an internal error and is restarting; retry shortly",
                        code="server_dead")
    return APIError(500, "generation failed: internal error (the server's log has the details)",
                    type="server_error")

