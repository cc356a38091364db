"""One request's speculative decoding loop, split at the target call, and its stream chunks.

A step (Leviathan et al. 2023, Algorithm 1; gpt-fast's shape): the proposer drafts k tokens; the target
scores [last committed token] + drafts in ONE backend call, giving ``[k+1, V]`` logits; the verifier
accepts a prefix and adds one recovered or bonus token; 1..k+1 tokens are committed and the stop
conditions applied. KV caches are rolled back lazily by :class:`~specdec.backends.base.SequenceCache`,
which keeps the longest common prefix.

This module knows token ids, backends and the verifier; the loop that calls the target (one request in
:class:`~specdec.engine.Engine`, many in a scheduler) lives outside it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from specdec.backends.base import SequenceCache
from specdec.proposers import EMPTY_PROPOSAL, Proposer
from specdec.sampling import SamplingState, make_rng, token_logprob
from specdec.text import TextAssembler
from specdec.types import GenerationResult, GenerationStats, SamplingParams, TokenLogprob
from specdec.verify import VERIFIERS, verify_greedy

if TYPE_CHECKING:
    from specdec.engine import Engine


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
        logprobs: One entry per token of ``token_ids`` when ``SamplingParams.logprobs``, else None.
    """

    text: str
    token_ids: list[int] = field(default_factory=list)
    accepted: list[bool] = field(default_factory=list)
    finish_reason: str | None = None
    result: GenerationResult | None = None
    logprobs: list[TokenLogprob] | None = None


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
        verify: Sampling verifier, a key of :data:`~specdec.verify.VERIFIERS` (``"token"``/``"block"``).

    Sampling: the target's ``k+1`` rows are processed by :class:`~specdec.sampling.SamplingState`, row
    ``j`` with the history committed tokens + drafts ``1..j`` (penalties, min_tokens), and so is the
    draft model's ``q``. The request's RNG is consumed only by its own proposer and verifier.

    Raises:
        ValueError: for ``params.n > 1`` (one request is one sample: use ``params.for_sample(i)``) or a
            ``logit_bias`` id outside the vocabulary.
    """

    def __init__(self, engine: "Engine", prompt_ids: list[int], params: SamplingParams, k_max: int,
                 proposer: Proposer | None, verify: str = "block"):
        if params.n != 1:
            raise ValueError(f"a request is one sample but n={params.n}; use Engine.generate_n or "
                             "params.for_sample(i) for each sample")
        self.engine = engine
        self.params = params
        self.k_max = k_max if proposer is not None else 0
        self.proposer = proposer
        self.verifier = VERIFIERS[verify]
        self.sampling = SamplingState(params, prompt_ids, engine.vocab_size, engine.target.eog_ids)
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs else None
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
        logits = logits[:, : self.engine.vocab_size]  # drop padding rows (see Engine.vocab_size)
        params, drafts = self.params, self._proposal.tokens
        if params.greedy:
            result = verify_greedy(drafts, self.sampling.argmax(logits, drafts))
        else:
            result = self.verifier(drafts, self._proposal.probs, self.sampling.probs(logits, drafts), self.rng)
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
            self.sampling.extend((tok,))
            if self.logprobs is not None:  # always the target's row i: speculation never changes it
                self.logprobs.append(token_logprob(logits[i], tok, params.top_logprobs))
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
            logprobs=None if self.logprobs is None else self.logprobs[n_before:],
        )
        if self.finished:
            report = getattr(self.proposer, "report", None)  # adaptive proposers: predictions, choices
            if report is not None:
                self.stats.adaptive = report()
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
                logprobs=self.logprobs,
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
