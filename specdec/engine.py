"""The engine: a target model, any number of draft models, prompt encoding, and the loop that drives one
request through :func:`~specdec.step.speculative_step`.

The engine knows token ids and backends; it does not know text formats beyond the tokenizer, nor HTTP.
Callers (CLI, server, ``specdec check``) use its public methods, never its backends.
"""

from __future__ import annotations

import functools
import json

import operator
from typing import Iterator, Sequence

from specdec.policy.cost import CostModel
from specdec.backends.base import Backend
from specdec.backends.chat_template import chat_pieces, encode_pieces, template_roles
from specdec.backends.vocab_map import mapped
from specdec.grammar import GrammarSpec, vocabulary_of
from specdec.output import StreamChunk
from specdec.params import SamplingParams, SpecConfig
from specdec.proposers import Proposer, ProposerContext
from specdec.proposers.suffix_index import SuffixCache
from specdec.request import Request, new_request, plan_speculation
from specdec.step import speculative_step
from specdec.types import GenerationResult, ModelInfo

__all__ = ["ChatInputError", "Engine", "StreamChunk", "check_vocab_compatible"]


class ChatInputError(ValueError):
    """Chat input the engine refuses, naming the field that holds the problem (OpenAI's ``param``).

    Attributes:
        field: ``"tools"``, ``"messages.{i}.tool_calls"`` or ``"messages.{i}.tool_call_id"``.
    """

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


class Engine:
    """A target model, draft models (none, one or several), and the speculative decoding loop over them.

    Args:
        target: The target model's backend.
        draft: The draft model's backend, or a sequence of them (several drafters); each must share the
            target's vocabulary, or map its own into it (``Backend.vocab_map``, FR-Spec drafters of
            ``specdec make-draft --top-tokens``: :mod:`specdec.backends.vocab_map`). ``method="auto"`` weighs
            every drafter each step; single-drafter methods (``draft``, ``hybrid``) use the first.
        spec: Default proposer settings; a request may override them.

    Raises:
        ValueError: when a draft's vocabulary differs from the target's (or its map is malformed), or ``spec``
            needs a draft model and there is none.
    """

    def __init__(self, target: Backend, draft: Backend | Sequence[Backend] | None = None,
                 spec: SpecConfig | None = None):
        self.target = target
        drafts = () if draft is None else tuple(draft) if isinstance(draft, (list, tuple)) else (draft,)
        # a drafter over part of the target's vocabulary (FR-Spec) is used in the target's ids
        self.drafts: tuple[Backend, ...] = tuple(mapped(target, d) for d in drafts)
        self.draft = self.drafts[0] if self.drafts else None  # the first drafter (single-drafter methods)
        self.spec = spec or SpecConfig()  # auto: n-gram lookup, the draft models if any, k by cost
        for d in self.drafts:
            check_vocab_compatible(target, d)
        self.check_spec(self.spec)
        self.cost = CostModel()  # timings of these models on this machine, fed by every step's report
        self.suffix_cache: SuffixCache | None = None  # earlier outputs for suffix decoding: off by default
        n_ctx = min(b.n_ctx for b in (target, *self.drafts))
        # The real vocabulary, shared by target and drafts (checked above); see ModelInfo.vocab_size.
        vocab_size = min(target.n_vocab, target.vocab_fingerprint()[0])
        # An end-of-generation id among the padding rows can never be sampled (its row is sliced off),
        # and masking it (min_tokens) would index past the sliced logits.
        eog_ids = frozenset(i for i in target.eog_ids if i < vocab_size)
        self.info = ModelInfo(vocab_size=vocab_size, n_ctx=n_ctx, eog_ids=eog_ids)
        self._vocabularies: list = []  # grammar vocabularies built for this engine's backends (their trial processes)

    # -- facts ---------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The target model's name."""
        return self.target.name

    @property
    def draft_name(self) -> str | None:
        """The (first) draft model's name, or None."""
        return None if self.draft is None else self.draft.name

    @property
    def draft_names(self) -> tuple[str, ...]:
        """Every draft model's name, in order."""
        return tuple(d.name for d in self.drafts)

    @property
    def n_ctx(self) -> int:
        """Context window per sequence, tokens."""
        return self.info.n_ctx

    @property
    def vocab_size(self) -> int:
        """The real vocabulary size (valid token ids are ``0..vocab_size-1``)."""
        return self.info.vocab_size

    @property
    def capacity(self) -> int:
        """Requests the backends can hold at once (one target sequence and one per draft model each; with
        exact numerics, one target context each)."""
        return min(b.capacity for b in (self.target, *self.drafts))

    def close(self) -> None:
        """Close the target and draft backends (their models and KV caches are freed); safe to call twice."""
        for backend in (self.target, *self.drafts):
            backend.close()
        for vocab in self._vocabularies:
            vocab.close()

    def compile_grammar(self, grammar: GrammarSpec, budget_s: float | None = None, salt: str = "") -> GrammarSpec:
        """Compile ``grammar`` for the target and draft models ahead of a request, building their vocabularies
        on first use (~1 s). A server calls it off its event loop and scheduler thread; without it, a request
        compiles its grammar when it is built.

        Args:
            grammar: The constraint.
            budget_s: Seconds the compilation may take, tried first in a separate process
                (:meth:`specdec.grammar.Vocabulary.compile`); ``None``: compiled here, unbounded.
            salt: Whose cache entries (a server's tenant): see :meth:`specdec.grammar.Vocabulary.compile`.

        Returns:
            ``grammar`` carrying its compiled matchers: a request given it copies them.

        Raises:
            specdec.grammar.GrammarError: a grammar llguidance refuses, that matches no text, that crashes
                the grammar engine or runs over the budget.
        """
        return grammar.with_compiled([(v, v.compile(grammar, budget_s, salt)) for v in self.grammar_vocabularies()])

    def cached_grammar(self, grammar: GrammarSpec, salt: str = "") -> GrammarSpec | None:
        """:meth:`compile_grammar`'s answer when every vocabulary has ``grammar`` cached for ``salt`` (dictionary
        look-ups only: no waiting), else None."""
        if len(self._vocabularies) < 1:
            return None
        pairs = [(v, v.cached(grammar, salt)) for v in self._vocabularies]
        return grammar.with_compiled(pairs) if all(m is not None for _, m in pairs) else None

    def grammar_vocabularies(self) -> list:
        """The :class:`~specdec.grammar.Vocabulary` of the target and of each draft model (one shared by
        those with the same tokens), built on first use (~2 s for 151,936 tokens, ~0.7 s of it holding the
        GIL: a server builds them before it serves)."""
        target = vocabulary_of(self.target, self.vocab_size)
        for backend in (self.target, *self.drafts):
            vocab = vocabulary_of(backend, self.vocab_size, like=target)  # a draft with the same tokens shares it
            if vocab not in self._vocabularies:
                self._vocabularies.append(vocab)
        return list(self._vocabularies)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def enable_prefix_cache(self, max_sequences: int, max_tokens: int) -> None:
        """Keep finished requests' KV (target and drafts) as prefixes for later requests: up to
        ``max_sequences`` sequences and ``max_tokens`` tokens per model, least recently used first to go
        (:class:`~specdec.backends.prefix.PrefixCache`; 0 turns parking off). Running requests are
        always offered as prefixes."""
        for backend in (self.target, *self.drafts):
            backend.prefix.configure(max_sequences, max_tokens)

    def enable_suffix_cache(self, max_tokens: int) -> None:
        """Keep the outputs of finished requests (up to ``max_tokens`` tokens, oldest first to go) for
        suffix decoding in later requests (``method="suffix"``): repeated tasks then draft from each
        other's answers. 0 turns it off and forgets them.

        This is a side channel between the engine's users: how fast a request decodes shows whether an
        earlier output contained the text it generates (see SECURITY.md). Off unless called.

        Raises:
            ValueError: for a negative ``max_tokens``.
        """
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.suffix_cache = SuffixCache(max_tokens) if max_tokens else None

    def check_spec(self, spec: SpecConfig) -> None:
        """Raise ValueError when ``spec`` cannot run on this engine (a draft method without a draft): the
        check :func:`specdec.request.plan_speculation` makes when a request is admitted, made early."""
        plan_speculation(spec, self.draft is not None)

    # -- text ----------------------------------------------------------------------------------
    def tokenize(self, text: str, special: bool = False) -> list[int]:
        """Text to token ids with the target's tokenizer; ``special`` parses control tokens."""
        return self.target.tokenize(text, special=special)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (may be part of a UTF-8 character)."""
        return self.target.token_bytes(token_id)

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """Render chat messages with the target's chat template, ending with the assistant prompt.

        Args:
            messages: ``[{"role", "content", ...}]``; an assistant message may hold ``tool_calls`` (their
                ``arguments`` objects, :func:`specdec.tools.template_arguments`). A ``developer`` message
                is the template's ``system`` one (:func:`~specdec.backends.chat_template.template_roles`).
            tools: OpenAI's ``tools`` shown to the model (the template's ``tools`` variable), or None.

        Raises:
            ValueError: when the model has no chat template or the template fails.
        """
        return self.target.apply_chat_template(template_roles(messages), tools=tools)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Chat messages to token ids (not validated: see :meth:`encode_prompt`): the template's markup
        with control tokens parsed, each message's content as plain text, so that a content holding
        ``<|im_end|>`` cannot end its turn (:mod:`specdec.backends.chat_template`). Tools and earlier tool
        calls (and their ids) are rendered inside the markup, so one holding a control token's text is refused.

        Raises:
            ValueError: when the model has no chat template or the template fails; when a tool, tool
                call or tool call id holds the text of a control token (:class:`ChatInputError`, naming the field); or when the template rewrites contents so that
                they cannot be told from its markup and a content holds the text of a control token.
        """
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content", ""), str)
                   for m in messages):
            raise ValueError('messages must be dicts {"role": str, "content": str}')
        control = self.target.control_token_texts()
        markups = [("tools", "a tool", tools)]
        for i, m in enumerate(messages):
            markups += [(f"messages.{i}.tool_calls", "a tool call", m.get("tool_calls")),
                        (f"messages.{i}.tool_call_id", "a tool call's id", m.get("tool_call_id"))]
        for field, what, markup in markups:
            text = json.dumps(markup, ensure_ascii=False) if markup else ""
            found = next((t for t in control if t and t in text), None)
            if found is not None:
                raise ChatInputError(f"{field}: {what} contains the control token text {found!r}; remove it", field)
        render = functools.partial(self.render_chat, tools=tools)
        pieces = chat_pieces(messages, render)
        if pieces is not None:
            return encode_pieces(pieces, self.tokenize, control)
        # No certain split: the whole rendering is safe only if no content can make a control token.
        for i, m in enumerate(messages):
            found = next((t for t in control if t and t in (m.get("content") or "")), None)
            if found is not None:
                raise ValueError(f"message {i} contains the control token text {found!r}, and this model's chat "
                                 "template rewrites message contents, so it cannot be kept plain text; remove it")
        return self.tokenize(render(messages), special=True)

    # -- prompts -------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        """Prompt text (or ids) to validated token ids. With ``chat``, the text is one user message in
        the chat template (:meth:`encode_chat`: control tokens in it stay text); without, control tokens
        written in the text are not parsed either (token ids can say anything a raw prompt needs).

        Raises:
            ValueError: for an empty prompt, an id outside ``0..vocab_size-1``, or a prompt that leaves
                no room in the context (``n_ctx``).
        """
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("the prompt is empty")
            ids = self.encode_chat([{"role": "user", "content": prompt}]) if chat else self.tokenize(prompt)
        else:
            try:  # int() would truncate 1.5 and read "7"; bytes would pass as their byte values
                if isinstance(prompt, (bytes, bytearray)):
                    raise TypeError
                ids = [operator.index(t) for t in prompt]
            except TypeError:
                raise ValueError("the prompt must be a string or a list of integer token ids") from None
        if not ids:
            raise ValueError("the prompt is empty")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary; ids must lie in 0..{self.vocab_size - 1}")
        if len(ids) >= self.n_ctx:
            raise ValueError(f"the prompt is {len(ids)} tokens but the context holds {self.n_ctx} (n_ctx); "
                             "shorten the prompt or load the engine with a larger n_ctx")
        return ids

    # -- generation ----------------------------------------------------------------------------
    def new_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    spec: SpecConfig | None = None, chat: bool = False,
                    proposer: Proposer | None = None) -> Request:
        """Validate a prompt and create its :class:`~specdec.request.Request` (reserves its sequences).

        Raises:
            ValueError: for bad prompts (see :meth:`encode_prompt`) or settings the engine cannot run.
        """
        return self.admit(self.encode_prompt(prompt, chat=chat), params, spec, proposer=proposer)

    def admit(self, prompt_ids: list[int], params: SamplingParams | None = None, spec: SpecConfig | None = None,
              proposer: Proposer | None = None, cache_salt: str = "", label: str = "") -> Request:
        """:meth:`new_request` for prompt ids already validated by :meth:`encode_prompt` (the scheduler's
        admission: the server validated them when the request arrived). ``cache_salt``: the request copies
        cached prefixes only from requests of the same salt, and only they copy from it (a server gives each
        tenant its own; :class:`~specdec.backends.prefix.PrefixCache`). ``label``: the request's name in the
        proposer's log lines (``--explain``; a server passes its response id).

        Raises:
            ValueError: for settings the engine cannot run (see :func:`specdec.request.new_request`).
        """
        params = params or SamplingParams()
        spec = spec or self.spec
        if proposer is None:
            self.check_spec(spec)
        target = self.target
        # a token tree's branches need sequences that share the context's cells: not where each sequence has
        # a context of its own (exact numerics), where a branch would copy the whole context every step
        trees = target.numerics != "exact"
        context = ProposerContext(drafts=self.drafts, vocab_size=self.info.vocab_size, cost=self.cost,
                                  suffix_cache=self.suffix_cache, cache_salt=cache_salt,
                                  free_sequences=lambda: target.free_sequences if trees else 0,
                                  padded_steps=getattr(target, "pads_one_token", False), label=label)
        return new_request(self.info, self.target, prompt_ids, params, spec, context, proposer)

    def step(self, requests: Sequence[Request], prefill_chunk: int | None = None):
        """One speculative step for several requests (oldest first), feeding the cost model; see
        :func:`~specdec.step.speculative_step`, which also explains ``prefill_chunk`` (prompt tokens per
        call: ``None`` = whole prompts, 0 = chosen from the cost model). Returns its
        :class:`~specdec.step.StepReport`."""
        return speculative_step(self.target, [r.seq for r in requests], self.cost, prefill_chunk)

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
               spec: SpecConfig | None = None, chat: bool = False,
               proposer: Proposer | None = None) -> Iterator[StreamChunk]:
        """Generate, yielding a chunk after each committed block.

        Args:
            prompt: Text, or token ids.
            params: Sampling and stopping parameters.
            spec: Proposer settings for this request (default: the engine's).
            chat: Render ``prompt`` as a user message with the target's chat template.
            proposer: Use this proposer instead of the one ``spec.method`` names (tests, custom
                proposers); ``spec.num_speculative_tokens`` still bounds k.

        Yields:
            :class:`StreamChunk`; the last has ``finish_reason`` and ``result`` set.

        Raises:
            ValueError: for bad prompts (see :meth:`encode_prompt`).
        """
        with self.new_request(prompt, params, spec, chat=chat, proposer=proposer) as req:
            while not req.finished:
                self.step([req]).raise_failure()
                yield req.chunk()

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                 spec: SpecConfig | None = None, chat: bool = False,
                 proposer: Proposer | None = None) -> GenerationResult:
        """Generate to completion; see :meth:`stream` for the arguments."""
        for chunk in self.stream(prompt, params, spec, chat, proposer):
            if chunk.result is not None:
                return chunk.result
        raise AssertionError("stream ended without a result")

    def generate_n(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                   spec: SpecConfig | None = None, chat: bool = False) -> list[GenerationResult]:
        """``params.n`` independent samples for one prompt (OpenAI's ``n``), one after another.

        Sample ``i`` runs with ``params.for_sample(i)``: with a seed, each sample has its own derived
        seed (reproducible, distinct); without one, each draws fresh entropy.

        Returns:
            ``params.n`` results, in sample order.
        """
        params = params or SamplingParams()
        return [self.generate(prompt, params.for_sample(i), spec, chat) for i in range(params.n)]


def check_vocab_compatible(target: Backend, draft: Backend) -> None:
    """Refuse a draft whose vocabulary differs from the target's beyond padding rows (every drafter of
    an engine is checked).

    Raises:
        ValueError: naming both models, when token texts or special ids differ.
    """
    t_n, t_digest = target.vocab_fingerprint()
    d_n, d_digest = draft.vocab_fingerprint()
    if (t_n, t_digest) != (d_n, d_digest) or target.eog_ids != draft.eog_ids:
        raise ValueError(
            f"draft model {draft.name} ({d_n} tokens) and target model {target.name} ({t_n} tokens) "
            "have different vocabularies; speculative decoding needs identical token texts and special ids"
        )
