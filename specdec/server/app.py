"""The FastAPI app: OpenAI-compatible endpoints, SSE streaming, health and Prometheus metrics.

``create_app(engine, config)`` serves an already loaded :class:`~specdec.engine.Engine` through a
:class:`~specdec.scheduler.Scheduler` (started and drained by the app's lifespan); ``run_server`` runs
it with uvicorn, whose graceful shutdown on SIGTERM lets in-flight requests finish before the
scheduler drains and the process exits. Models are fixed at start-up; a request only names one.

Streaming follows OpenAI's chunk format exactly: for chat, a first chunk with ``delta.role``, then
``delta.content`` chunks, then one with ``finish_reason`` (and, as an extension, ``speculative``), a
``usage`` chunk with empty ``choices`` when ``stream_options.include_usage``, then ``data: [DONE]``.
A request with ``speculative.provenance`` gets each token's provenance on its content chunks
(:mod:`specdec.server.provenance`). The Responses API (``/v1/responses``) runs on the chat endpoint's
machinery (:mod:`specdec.server.responses`). The playground page (:mod:`specdec.server.playground`) is served at
``/`` and ``/playground``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from specdec.metrics import ServerMetrics
from specdec.prefill import check_chunk_tokens
from specdec.scheduler import Scheduler
from specdec.server import logprobs, playground, provenance, responses, serving
from specdec.server.access import AccessMiddleware, check_metrics_key, tenant_of
from specdec.tools import ToolCallStream, parse_tool_calls
from specdec.server.errors import APIError, error_body, install_error_handlers, refuse_invalid_unicode
from specdec.server.response_store import ResponseStore
from specdec.server.protocol import (
    ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, CompletionChunk,
    CompletionChunkChoice, CompletionRequest, CompletionResponse, Delta, ErrorResponse, ModelCard, ModelList,
)


@dataclass(frozen=True)
class ServerConfig:
    """Settings of one server.

    Attributes:
        model_name: The name clients pass as ``model`` (``GET /v1/models`` lists it).
        api_key: Required Bearer token on every route but ``/health``, the playground and the OpenAPI
            schema; several keys (a tuple) are several tenants, whose requests never share cached prompt
            prefixes; ``None`` disables the check.
        metrics_public: Serve ``/metrics`` to anyone.
        metrics_key: The Bearer token that opens ``/metrics`` (and no other route); ``None``: the API key of a
            server with one key (or anyone on a keyless one), and nobody on a server with several keys, whose
            tenants could read each other's traffic off it (SECURITY.md).
        allowed_hosts: Names accepted in the ``Host`` header besides loopback ones (``example.com``,
            ``*.example.com``; ``*`` for any); see :mod:`specdec.server.access`.
        allowed_origins: Names accepted in the ``Origin`` header (browsers' cross-site requests) besides
            loopback ones and the server's own IP address (``*`` for any).
        max_running: Requests decoded together (the batch size; backends need as many sequences).
        max_waiting: Requests that may wait for a slot; beyond it requests get 429.
        max_body_bytes: Largest request body, bytes (413 beyond).
        max_prompt_tokens: Longest prompt, tokens; ``None``: the context minus one.
        max_tokens: Largest ``max_tokens`` a request may ask for; ``None``: the context.
        max_choices: Most choices (prompts x n) per request.
        prefix_cache_tokens: Tokens of finished requests kept per model as prefixes for later requests
            (multi-turn chats, shared system prompts; :meth:`Engine.enable_prefix_cache`); 0 disables it.
        prefill_chunk_tokens: Prompt tokens per target call, so that running requests wait at most one
            chunk for their next token: 0 = chosen from the measured call costs, ``None`` = whole prompts
            (see :class:`~specdec.scheduler.Scheduler`).
        suffix_cache_tokens: Tokens of earlier outputs kept for suffix decoding across requests
            (:meth:`Engine.enable_suffix_cache`); 0 (the default) disables it: it is a side channel between
            clients (SECURITY.md).
        body_timeout: Seconds a client has to send a request body (408 after).
        header_timeout: Seconds a client has to send a request's headers, after connecting or after its
            previous response; the connection is closed after (:mod:`specdec.server.connections`).
        max_connections: Connections open at once; more are refused (503) as they open; ``None``: twice
            ``max_running + max_waiting``, at least 32.
        stream_buffer: Events (chunks of tokens) a streamed response may have waiting for a client that
            does not read them; beyond it the request is cancelled (the client is too slow, or gone).
        grammar_budget_s: Seconds a request's grammar may take to compile, in a trial process
            (:mod:`specdec.grammar_compile`); over it, or crashing it, is a 400.
        responses_store: Responses of ``/v1/responses`` kept per tenant (``store: true``) for
            ``previous_response_id`` and ``GET /v1/responses/{id}``, the least recently used leaving first;
            0 keeps none (:mod:`specdec.server.response_store`).
        responses_store_bytes: Bytes of those kept per tenant (their JSON, conversations included).
    """

    model_name: str
    api_key: str | tuple[str, ...] | None = None
    metrics_public: bool = False
    metrics_key: str | None = field(default=None, repr=False)
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    max_running: int = 8
    max_waiting: int = 64
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None
    max_tokens: int | None = None
    max_choices: int = 16
    prefix_cache_tokens: int = 8192
    prefill_chunk_tokens: int | None = 0
    suffix_cache_tokens: int = 0
    body_timeout: float = 30.0
    header_timeout: float = 10.0
    max_connections: int | None = None
    stream_buffer: int = 4096
    grammar_budget_s: float = 5.0
    responses_store: int = 256
    responses_store_bytes: int = 64 << 20

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The API keys (none: no check)."""
        return (self.api_key,) if isinstance(self.api_key, str) else tuple(self.api_key or ())

    @property
    def connections(self) -> int:
        """Connections served at once (see ``max_connections``)."""
        return self.max_connections or max(32, 2 * (self.max_running + self.max_waiting))


_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)}


def create_app(engine, config: ServerConfig) -> FastAPI:
    """The ASGI app serving ``engine``; the scheduler starts with the app's lifespan.

    Raises:
        ValueError: when the engine's backends hold fewer sequences than ``config.max_running``, or the
            metrics key is empty, an API key, or given with ``metrics_public``, or a bound of the response
            store is negative.
    """
    Scheduler.check_capacity(engine, config.max_running, config.max_waiting)
    check_metrics_key(config.metrics_key, config.api_keys, config.metrics_public)
    check_chunk_tokens(config.prefill_chunk_tokens)
    engine.enable_prefix_cache(config.max_running if config.prefix_cache_tokens else 0, config.prefix_cache_tokens)
    engine.enable_suffix_cache(config.suffix_cache_tokens)
    limits = serving.Limits(
        max_prompt_tokens=min(config.max_prompt_tokens or engine.n_ctx - 1, engine.n_ctx - 1),
        max_tokens=config.max_tokens or engine.n_ctx, max_choices=config.max_choices,
    )
    created = int(time.time())
    state: dict = {}
    store = ResponseStore(config.responses_store, config.responses_store_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # app.state.on_fatal: set by run_server to stop uvicorn when the scheduler thread dies
        scheduler = Scheduler(engine, config.max_running, config.max_waiting,
                              on_death=lambda e: (getattr(app.state, "on_fatal", None) or (lambda e: None))(e),
                              prefill_chunk_tokens=config.prefill_chunk_tokens)
        metrics = ServerMetrics(lambda: scheduler.num_waiting, lambda: scheduler.num_running, engine.cost)
        scheduler.metrics = metrics
        state.update(scheduler=scheduler, metrics=metrics)
        await asyncio.to_thread(engine.grammar_vocabularies)  # not while serving: it holds the GIL for a while
        yield
        state["draining"] = True
        await asyncio.to_thread(scheduler.close, True)

    # no /docs or /redoc: FastAPI's pages load unpinned scripts from a CDN into this origin; the schema
    # (/openapi.json) opens in any OpenAPI viewer
    app = FastAPI(title="specdec", summary="OpenAI-compatible speculative decoding server", lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    install_error_handlers(app)
    playground.add_routes(app)
    app.add_middleware(AccessMiddleware, api_key=config.api_keys, max_body_bytes=config.max_body_bytes,
                       allowed_hosts=config.allowed_hosts, metrics_public=config.metrics_public,
                       allowed_origins=config.allowed_origins, router=app.router, body_timeout=config.body_timeout,
                       metrics_key=config.metrics_key)

    @app.get("/health")
    async def health():
        error = state["scheduler"].error if "scheduler" in state else None
        if error is not None:  # the process is about to exit (specdec.scheduler); the log has the details
            return JSONResponse({"status": "error", "message": "the server hit an internal error and is "
                                 "restarting; retry shortly"}, 503)
        if state.get("draining"):
            return JSONResponse({"status": "draining"}, 503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state["metrics"].render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList)
    async def models():
        return ModelList(data=[ModelCard(id=config.model_name, created=created)])

    def check_request(req) -> None:
        """The checks that need nothing built: text fields, the model's name."""
        refuse_invalid_unicode(req.model_dump())
        if req.model is not None and req.model != config.model_name:
            shown = req.model if len(req.model) <= 100 else req.model[:100] + "\u2026"
            raise APIError(404, f"the model '{shown}' does not exist; this server serves "
                           f"'{config.model_name}'", param="model", code="model_not_found")

    async def admit(req, tools: serving.ToolPlan | None = None) -> tuple:
        serving.refuse_unsupported(req)
        # a grammar's bounds are linear in its text, but its text may be a megabyte: off the event loop
        grammar_field, grammar = await asyncio.to_thread(serving.grammar_of, req, tools) or (None, None)
        spec = await asyncio.to_thread(serving.spec_for, engine, req)  # (a prediction is tokenized)
        return ({**serving.sampling_kwargs(req), **serving.logprob_kwargs(req), "grammar": grammar},
                spec, grammar_field)

    async def start(req, raw: Request, prompts: list[list[int]], kwargs: dict, spec, default_max: int | None,
                    grammar_field: str | None = None, label: str = ""):
        if len(prompts) * req.n > limits.max_choices:
            raise APIError(400, f"at most {limits.max_choices} choices (prompts x n) per request", param="n")
        items = []
        for ids in prompts:
            ids = serving.check_prompt(engine, ids, limits)
            max_tokens = serving.max_tokens_for(req, len(ids), engine.n_ctx, limits, default_max)
            try:
                params = serving.SamplingParams(**kwargs, max_tokens=max_tokens, seed=req.seed, n=req.n)
                items.extend((ids, params.for_sample(j), spec) for j in range(req.n))
            except (ValueError, TypeError) as e:
                raise APIError(400, str(e), param=serving.param_of(str(e))) from None
            serving.check_logit_bias(engine, params)
        if kwargs["grammar"] is not None:  # every cheap check passed: compile (once for all choices, per tenant)
            grammar = await serving.compile_grammar(engine, kwargs["grammar"], grammar_field, config.grammar_budget_s,
                                                    tenant_of(raw.scope))
            items = [(ids, params.replace(grammar=grammar), spec) for ids, params, spec in items]
        # the prefix cache's salt: the caller's tenant (API key) and its own cache_salt; see specdec.backends.prefix
        salt = f"{tenant_of(raw.scope)}:{req.cache_salt or ''}"
        try:
            return serving.Choices(state["scheduler"], items, cache_salt=salt, buffer=config.stream_buffer,
                                   grammar_field=grammar_field, label=label)
        except APIError as e:
            state["metrics"].rejected.labels(reason=e.code or str(e.status)).inc()
            raise

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS)
    async def completions(req: CompletionRequest, raw: Request):
        check_request(req)
        kwargs, spec, grammar_field = await admit(req)
        prompts = await asyncio.to_thread(serving.tokenize_completion_prompts, engine, req.prompt)
        rid = f"cmpl-{secrets.token_hex(12)}"
        choices = await start(req, raw, prompts, kwargs, spec, default_max=16, grammar_field=grammar_field, label=rid)
        head = {"id": rid, "created": int(time.time()), "model": config.model_name}
        offsets = [logprobs.TextOffsets() for _ in choices.jobs]
        prov = provenance.wanted(req)

        def choice(i: int, text: str, lps, finish: str | None, toks=None) -> CompletionChunkChoice:
            lp = logprobs.completion_logprobs(engine, lps, offsets[i])
            return CompletionChunkChoice(index=i, text=text, logprobs=lp, finish_reason=finish,
                                         provenance=provenance.wire(toks) if prov and toks is not None else None)

        if req.stream:
            return _sse(_stream(choices, req, lambda **kw: CompletionChunk(**head, **kw), prompts, spec,
                                content=lambda i, ev: choice(i, ev.text, ev.logprobs, None, ev.provenance),
                                final=lambda i, reason: choice(i, "", None, reason), first=None))
        results = await _collect(choices, raw)
        return CompletionResponse(
            **head, usage=serving.usage(prompts, results), speculative=serving.speculative_stats(spec, results),
            choices=[choice(i, r.text, r.logprobs, r.finish_reason, r.provenance).model_dump()
                     for i, r in enumerate(results)],
        )

    async def start_chat(req: ChatCompletionRequest, raw: Request, label: str = "") -> serving.ChatRun:
        """Check, render and submit a chat request: Chat Completions' own, or the one a Responses request
        translates to (:mod:`specdec.server.responses`), named ``label`` (its response id) in log lines.
        Raises APIError (4xx, 429, 503)."""
        check_request(req)
        tools = await asyncio.to_thread(serving.tool_plan, req)  # schemas checked: off the event loop
        kwargs, spec, grammar_field = await admit(req, tools)
        prompts = [await asyncio.to_thread(serving.tokenize_chat, engine, req.messages, tools)]
        choices = await start(req, raw, prompts, kwargs, spec, default_max=None, grammar_field=grammar_field,
                              label=label)
        return serving.ChatRun(choices, prompts, spec, tools)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS)
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        rid = f"chatcmpl-{secrets.token_hex(12)}"
        run = await start_chat(req, raw, rid)
        choices, prompts, spec, tools = run.choices, run.prompts, run.spec, run.tools
        head = {"id": rid, "created": int(time.time()), "model": config.model_name}
        prov = provenance.wanted(req)
        calls = tools is not None and tools.calls  # the answers are parsed for tool calls
        parsers = [ToolCallStream(names=tools.names) for _ in choices.jobs] if calls else None

        def delta(i: int, d: Delta, lps=None, finish: str | None = None, toks=None) -> ChatChunkChoice:
            return ChatChunkChoice(index=i, delta=d, logprobs=logprobs.chat_logprobs(engine, lps), finish_reason=finish,
                                   provenance=provenance.wire(toks) if prov and toks is not None else None)

        def content(i: int, ev) -> ChatChunkChoice | None:
            if parsers is None:
                return delta(i, Delta(content=ev.text), ev.logprobs, None, ev.provenance)
            text, deltas = parsers[i].feed(ev.text)
            if not (text or deltas or ev.logprobs or (prov and ev.provenance)):
                return None  # all held back (a tag may be starting)
            return delta(i, Delta(content=text or None, tool_calls=deltas or None), ev.logprobs, None, ev.provenance)

        def final(i: int, reason: str) -> ChatChunkChoice:
            if parsers is None:
                return delta(i, Delta(), None, reason)
            text, deltas = parsers[i].finish()
            return delta(i, Delta(content=text or None, tool_calls=deltas or None), None,
                         _tool_finish(reason, parsers[i].calls))

        if req.stream:
            return _sse(_stream(choices, req, lambda **kw: ChatCompletionChunk(**head, **kw), prompts, spec,
                                content=content, final=final,
                                first=lambda i: delta(i, Delta(role="assistant", content=""))))
        results = await _collect(choices, raw)

        def message(r) -> tuple[dict, str]:
            if not calls:
                return {"content": r.text}, r.finish_reason
            text, found = parse_tool_calls(r.text, names=tools.names)
            return ({"content": text, "tool_calls": [c.wire() for c in found] or None},
                    _tool_finish(r.finish_reason, found))

        answers = [message(r) for r in results]
        return ChatCompletionResponse(
            **head, usage=serving.usage(prompts, results),
            speculative=serving.speculative_stats(spec, results),
            choices=[{"index": i, "message": msg, "finish_reason": finish,
                      "logprobs": logprobs.chat_logprobs(engine, r.logprobs),
                      **({"provenance": provenance.wire(r.provenance)} if prov else {})}
                     for i, (r, (msg, finish)) in enumerate(zip(results, answers))],
        )

    responses.add_routes(app, start_chat, _collect, config.model_name, store)
    return app


def _tool_finish(reason: str, calls) -> str:
    """OpenAI's ``finish_reason`` of an answer that may hold calls: ``tool_calls`` when it ended by itself
    after calling a tool."""
    return "tool_calls" if calls and reason == "stop" else reason


async def _collect(choices: serving.Choices, raw: Request):
    """All choices' results; a client that disconnects first cancels them."""

    async def disconnected():
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    done = asyncio.ensure_future(choices.results())
    gone = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        done.cancel()
        choices.cancel()  # no-op for finished choices; stops the others when one failed
    if not done.done() or done.cancelled():
        raise APIError(499, "client disconnected")
    return done.result()


def _sse(events: AsyncIterator[dict | str]) -> StreamingResponse:
    async def encode():
        async for ev in events:
            yield f"data: {ev if isinstance(ev, str) else json.dumps(ev, ensure_ascii=False)}\n\n"


    return StreamingResponse(encode(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _stream(choices: serving.Choices, req, chunk, prompts, spec, content, final, first):
    """The SSE events of one request; leaving early (client gone) cancels its choices.

    Args:
        chunk: ``(**fields) -> ChatCompletionChunk | CompletionChunk`` with the response's id and model.
        content: ``(index, chunk) -> choice`` for a chunk with text or tokens (None: nothing to send yet).
        final: ``(index, finish_reason) -> choice`` for the last chunk of a choice.
        first: ``index -> choice`` sent before anything else (chat's role delta), or ``None``.
    """
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    prov = provenance.wanted(req)
    extra = {"usage": None} if include_usage else {}
    results = [None] * len(choices.jobs)
    try:
        if first is not None:
            for i in range(len(results)):
                yield chunk(choices=[first(i)], **extra).wire()
        while any(r is None for r in results):
            i, ev = await choices.events.get()
            if isinstance(ev, BaseException):
                e = serving.engine_error(ev, choices.grammar_field)
                yield error_body(e.status, e.message, e.param, e.code, e.type)
                break
            # logprobs and provenance of tokens whose text is held back still go out
            if ev.text or ev.logprobs or (prov and ev.provenance):
                choice = content(i, ev)
                if choice is not None:
                    yield chunk(choices=[choice], **extra).wire()
            if ev.finish_reason is not None:
                results[i] = ev.result
                yield chunk(choices=[final(i, ev.finish_reason)], **extra,
                            speculative=serving.speculative_stats(spec, [ev.result])).wire()
        else:
            if include_usage:
                yield chunk(choices=[], usage=serving.usage(prompts, results),
                            speculative=serving.speculative_stats(spec, results)).wire()
        yield "[DONE]"
    finally:
        choices.cancel()


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening (SO_REUSEADDR, as uvicorn binds); the caller closes
    it (or hands it to uvicorn).

    Raises:
        ValueError: when the address cannot be bound (port in use, a host this machine has not, a name that
            does not resolve), with the reason in one line.
    """
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise ValueError(f"cannot listen on {host}:{port}: {getattr(e, 'strerror', None) or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def uvicorn_config(app, config: ServerConfig, log_level: str = "info", drain_timeout: float | None = 120.0):
    """uvicorn's settings for ``app``: h11 with bounded headers, a deadline for each request's headers and a
    bound on open connections (:func:`specdec.server.connections.protocol`), idle keep-alive connections
    closed after 5 s, and ``drain_timeout`` seconds for in-flight requests at shutdown."""
    import uvicorn

    from specdec.server.connections import protocol

    return uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=drain_timeout, timeout_keep_alive=5,
                          http=protocol(config.connections, config.header_timeout))


def run_server(engine, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
               drain_timeout: float | None = 120.0, log_level: str = "info") -> None:
    """Serve with uvicorn until SIGINT/SIGTERM; in-flight requests finish (up to ``drain_timeout``
    seconds), then the scheduler drains and the function returns.

    Prints ``specdec: serving MODEL on http://HOST:PORT/v1`` to stderr once listening (the real port
    when ``port`` is 0).

    Raises:
        ValueError: when the address cannot be bound (port in use, unknown host).
        specdec.scheduler.SchedulerDiedError: after the server stopped because its scheduler thread died
            (every request got an error; the caller should exit non-zero for a supervisor to restart it).
    """
    import signal
    import sys
    import threading

    import uvicorn

    app = create_app(engine, config)
    dead: list[BaseException] = []
    sock = listen_socket(host, port)
    bound = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, config, log_level=log_level, drain_timeout=drain_timeout))

    def on_fatal(error: BaseException) -> None:  # every request has its error already: stop serving
        dead.append(error)
        server.should_exit = True

    app.state.on_fatal = on_fatal
    print(f"specdec: serving {config.model_name} on http://{host}:{bound}/v1 "
          f"(method {engine.spec.method}, k={engine.spec.k}, {config.max_running} concurrent)", file=sys.stderr,
          flush=True)
    if threading.current_thread() is threading.main_thread():
        # uvicorn re-raises SIGTERM after its graceful shutdown; a no-op handler lets the drained
        # process exit 0 instead of dying by the signal
        signal.signal(signal.SIGTERM, lambda *_: None)
    server.run(sockets=[sock])
    if dead:
        raise dead[0]
