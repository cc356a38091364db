"""One speculative step and the per-request loop: stop conditions, rollback, stats.

A step (gpt-fast's shape): the proposer drafts k tokens; the target scores [last committed token] +
drafts in ONE backend call, giving ``[k+1, V]`` logits; the verifier accepts a prefix and adds one
recovered or bonus token; the caller commits 1..k+1 tokens. KV caches are rolled back lazily by
:class:`~specdec.backends.base.SequenceCache` at the next call, which keeps the longest common prefix.

The engine knows token ids and backends; it does not know text formats beyond the tokenizer, nor HTTP.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from specdec.backends.base import Backend, SequenceCache
from specdec.proposers import EMPTY_PROPOSAL, PROPOSERS, Proposer
from specdec.sampling import greedy_tokens, make_rng, probs_from_logits
from specdec.text import TextAssembler
from specdec.types import GenerationResult, GenerationStats, SamplingParams, SpecConfig
from specdec.verify import verify_greedy, verify_speculative


@dataclass
class StreamChunk:
    """A piece of a streamed generation.

    Attributes:
        text: New text since the previous chunk (may be empty while a stop string might be forming
            or a UTF-8 character is incomplete).
        token_ids: Tokens committed in this chunk.
        accepted: One flag per token of ``token_ids``: True where a draft token was accepted.
        finish_reason: Set on the last chunk only: ``"stop"`` or ``"length"``.
        result: Set on the last chunk only: the whole generation.
    """

    text: str
    token_ids: list[int] = field(default_factory=list)
    accepted: list[bool] = field(default_factory=list)
    finish_reason: str | None = None
    result: GenerationResult | None = None


class Engine:
    """A target model, an optional draft model, and the speculative decoding loop over them.

    Args:
        target: The target model's backend.
        draft: The draft model's backend (needed for ``method="draft"``); must share the target's
            vocabulary.
        spec: Default proposer settings; a request may override them.

    Raises:
        ValueError: when the draft's vocabulary differs from the target's.
    """

    def __init__(self, target: Backend, draft: Backend | None = None, spec: SpecConfig | None = None):
        self.target = target
        self.draft = draft
        self.spec = spec or SpecConfig(method="draft" if draft is not None else "ngram")
        if draft is not None:
            check_vocab_compatible(target, draft)
        if self.spec.method == "draft" and draft is None:
            raise ValueError("method 'draft' needs a draft model; pass one or choose ngram/none")
        self.n_ctx = min(target.n_ctx, draft.n_ctx) if draft is not None else target.n_ctx

    # -- prompts -------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        """Prompt text (or ids) to token ids, rendering the chat template when ``chat``.

        Raises:
            ValueError: for an empty prompt or one that leaves no room in the context.
        """
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("the prompt is empty")
            if chat:
                prompt = self.target.apply_chat_template([{"role": "user", "content": prompt}])
            ids = self.target.tokenize(prompt, special=chat)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.n_ctx:
            raise ValueError(
                f"the prompt is {len(ids)} tokens but the context holds {self.n_ctx}; shorten it or raise --n-ctx"
            )
        return ids

    def _make_proposer(self, spec: SpecConfig) -> Proposer | None:
        if spec.k == 0:
            return None
        if spec.method == "draft" and self.draft is None:
            raise ValueError("method 'draft' needs a draft model")
        return PROPOSERS[spec.method](
            draft=self.draft, vocab_size=self.target.n_vocab, ngram_max=spec.ngram_max, ngram_min=spec.ngram_min
        )

    # -- generation ----------------------------------------------------------------------------
    def stream(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        spec: SpecConfig | None = None,
        chat: bool = False,
        proposer: Proposer | None = None,
    ) -> Iterator[StreamChunk]:
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
        req = self.new_request(prompt, params, spec, chat=chat, proposer=proposer)
        try:
            while not req.finished:
                new, n_logits = req.plan()
                logits = self.target.eval({req.seq_id: (new, n_logits)})[req.seq_id]
                yield req.commit(new, logits)
        finally:
            req.close()

    def new_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        spec: SpecConfig | None = None,
        chat: bool = False,
        proposer: Proposer | None = None,
    ) -> "Request":
        """Validate a prompt and create its :class:`Request` (reserves a target sequence).

        Raises:
            ValueError: for bad prompts (see :meth:`encode_prompt`) or a proposer that cannot run.
        """
        params = params or SamplingParams()
        spec = spec or self.spec
        prompt_ids = self.encode_prompt(prompt, chat=chat)
        k_max = spec.k if proposer is None else spec.num_speculative_tokens
        if proposer is None:
            proposer = self._make_proposer(spec)
        return Request(self, prompt_ids, params, k_max, proposer)

    def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        spec: SpecConfig | None = None,
        chat: bool = False,
        proposer: Proposer | None = None,
    ) -> GenerationResult:
        """Generate to completion; see :meth:`stream` for the arguments."""
        for chunk in self.stream(prompt, params, spec, chat, proposer):
            if chunk.result is not None:
                return chunk.result
        raise AssertionError("stream ended without a result")


def check_vocab_compatible(target: Backend, draft: Backend) -> None:
    """Refuse a draft whose vocabulary differs from the target's beyond padding rows.

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


class Request:
    """One request's speculative decoding loop, split at the target call so that a scheduler can put
    several requests' target tokens into one batch.

    A step (Leviathan et al. 2023, Algorithm 1; gpt-fast's shape): :meth:`plan` lets the proposer draft
    ``k`` tokens and returns [last committed token] + drafts for the target (the whole prompt on the
    first step, which is a plain step); the caller evaluates them in ONE backend call; :meth:`commit`
    verifies the ``[k+1, V]`` logits, commits 1..k+1 tokens and applies the stop conditions. KV caches
    are rolled back lazily by :class:`~specdec.backends.base.SequenceCache` at the next plan.

    Args:
        engine: The engine whose models serve the request.
        prompt_ids: ``[L] int`` prompt token ids, ``1 <= L < engine.n_ctx``.
        params: Sampling and stopping parameters.
        k_max: Largest number of draft tokens per step (0 = plain decoding).
        proposer: The request's own proposer, or ``None`` for plain decoding.
    """

    def __init__(self, engine: Engine, prompt_ids: list[int], params: SamplingParams, k_max: int,
                 proposer: Proposer | None):
        self.engine = engine
        self.params = params
        self.k_max = k_max if proposer is not None else 0
        self.proposer = proposer
        self.rng = make_rng(params.seed)
        self.context = list(prompt_ids)
        self.generated: list[int] = []
        self.accepted_mask: list[bool] = []
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids))
        self.text = TextAssembler(engine.target.token_bytes, params.stop)
        self.finish_reason: str | None = None
        self.result: GenerationResult | None = None
        self._target = SequenceCache(engine.target)
        self._proposal = EMPTY_PROPOSAL
        self._t0 = time.perf_counter()
        self._t_first: float | None = None

    @property
    def seq_id(self) -> int:
        """The target sequence id this request owns."""
        return self._target.seq_id

    @property
    def finished(self) -> bool:
        """True once a finish reason is set."""
        return self.finish_reason is not None

    def plan(self) -> tuple[list[int], int]:
        """Draft and return what the target must evaluate.

        Returns:
            ``(new_tokens, n_logits)``: tokens to append to :attr:`seq_id` and how many trailing
            positions need logits (``k+1``).
        """
        assert not self.finished
        k = 0
        if self._t_first is None:
            if self.proposer is not None:
                self.proposer.prepare(self.context)
        else:
            # Draft fewer tokens near max_tokens and the end of the context: the target cache holds
            # context + drafts, and at most k+1 tokens are committed.
            room = min(self.params.max_tokens - len(self.generated), self.engine.n_ctx - len(self.context)) - 1
            k = max(0, min(self.k_max, room))
        self._proposal = self.proposer.propose(self.context, k, self.params, self.rng) if k else EMPTY_PROPOSAL
        n_logits = len(self._proposal.tokens) + 1
        return self._target.plan(self.context + self._proposal.tokens, n_logits), n_logits

    def commit(self, new: list[int], logits: np.ndarray) -> StreamChunk:
        """Verify the target's logits and commit the accepted block.

        Args:
            new: The tokens :meth:`plan` returned (now evaluated).
            logits: ``[k+1, V] float32`` target logits for [last committed token] + drafts.

        Returns:
            The chunk of new text and tokens; the last one carries the finish reason and result.
        """
        self._target.commit(new)
        params, drafts = self.params, self._proposal.tokens
        if params.greedy:
            result = verify_greedy(drafts, greedy_tokens(logits))
        else:
            result = verify_speculative(drafts, self._proposal.probs, probs_from_logits(logits, params), self.rng)
        block = result.tokens(drafts)
        n_before = len(self.generated)
        eog = self.engine.target.eog_ids
        kept = 0
        for i, tok in enumerate(block):
            kept += 1
            if tok in eog:
                self.finish_reason = "stop"
                break
            self.generated.append(tok)
            self.accepted_mask.append(i < result.num_accepted)
            if self.text.add(tok):
                self.finish_reason = "stop"
            elif len(self.generated) >= params.max_tokens or len(self.context) + kept >= self.engine.n_ctx:
                self.finish_reason = "length"
            if self.finished:
                break
        self.context.extend(block[:kept])
        self.stats.record_step(len(drafts), result.num_accepted, kept)
        if self.proposer is not None and drafts:
            self.proposer.observe(self.context, len(drafts), result.num_accepted)
        now = time.perf_counter()
        if self._t_first is None:
            self._t_first = now
        if self.finished:
            self.text.finish()
        chunk = StreamChunk(
            text=self.text.take_delta(final=self.finished),
            token_ids=self.generated[n_before:],
            accepted=self.accepted_mask[n_before:],
        )
        if self.finished:
            self.stats.new_tokens = len(self.generated)
            self.stats.prefill_seconds = self._t_first - self._t0
            self.stats.decode_seconds = now - self._t_first
            chunk.finish_reason = self.finish_reason
            chunk.result = self.result = GenerationResult(
                text=self.text.text,
                token_ids=list(self.generated),
                finish_reason=self.finish_reason,  # type: ignore[arg-type]
                stats=self.stats,
                accepted_mask=self.accepted_mask,
            )
        return chunk

    def close(self) -> None:
        """Free the request's sequences (target and proposer); safe to call twice."""
        if self._target is not None:
            self._target.free()
            self._target = None  # type: ignore[assignment]
        if self.proposer is not None:
            self.proposer.close()
            self.proposer = None
