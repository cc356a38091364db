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
from specdec.proposers import EMPTY_PROPOSAL, PROPOSERS, Proposal, Proposer
from specdec.sampling import greedy_tokens, make_rng, probs_from_logits
from specdec.text import TextAssembler
from specdec.types import GenerationResult, GenerationStats, SamplingParams, SpecConfig
from specdec.verify import VerifyResult, verify_greedy, verify_speculative


def speculative_step(
    target: SequenceCache,
    proposer: Proposer,
    context: list[int],
    k: int,
    params: SamplingParams,
    rng: np.random.Generator,
) -> tuple[Proposal, VerifyResult]:
    """Draft, score in one target call, verify (Leviathan et al. 2023, Algorithm 1).

    Args:
        target: The request's target sequence; it holds a prefix of ``context`` (or more).
        proposer: Drafts up to ``k`` tokens.
        context: ``[L] int`` prompt + committed tokens.
        k: Largest number of draft tokens (0 = a plain decoding step).
        params: Sampling parameters shared by draft and target.
        rng: The request's generator.

    Returns:
        The proposal and the verification result; the committed block is
        ``result.tokens(proposal.tokens)``.
    """
    proposal = proposer.propose(context, k, params, rng) if k > 0 else EMPTY_PROPOSAL
    drafts = proposal.tokens
    logits = target.score(context + drafts, len(drafts) + 1)  # [k+1, V] float32
    if params.greedy:
        result = verify_greedy(drafts, greedy_tokens(logits))
    else:
        result = verify_speculative(drafts, proposal.probs, probs_from_logits(logits, params), rng)
    return proposal, result


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
        params = params or SamplingParams()
        spec = spec or self.spec
        prompt_ids = self.encode_prompt(prompt, chat=chat)
        rng = make_rng(params.seed)
        stats = GenerationStats(prompt_tokens=len(prompt_ids))
        text = TextAssembler(self.target.token_bytes, params.stop)
        target = SequenceCache(self.target)
        k_max = spec.k if proposer is None else spec.num_speculative_tokens
        if proposer is None:
            proposer = self._make_proposer(spec)
        context = list(prompt_ids)
        generated: list[int] = []
        accepted_mask: list[bool] = []
        finish: str | None = None
        t0 = time.perf_counter()
        t_first: float | None = None
        try:
            if proposer is not None:
                proposer.prepare(context)
            while finish is None:
                # Draft fewer tokens near max_tokens and the end of the context: the target cache
                # holds context + drafts, and at most k+1 tokens are committed.
                room = min(params.max_tokens - len(generated), self.n_ctx - len(context)) - 1
                k = max(0, min(k_max, room)) if t_first is not None else 0
                proposal, result = speculative_step(target, proposer, context, k, params, rng)
                block = result.tokens(proposal.tokens)
                n_before = len(generated)
                kept = 0
                for i, tok in enumerate(block):
                    kept += 1
                    if tok in self.target.eog_ids:
                        finish = "stop"
                        break
                    generated.append(tok)
                    accepted_mask.append(i < result.num_accepted)
                    if text.add(tok):
                        finish = "stop"
                    elif len(generated) >= params.max_tokens or len(context) + kept >= self.n_ctx:
                        finish = "length"
                    if finish:
                        break
                new = block[:kept]
                context.extend(new)
                stats.record_step(len(proposal.tokens), result.num_accepted, kept)
                if proposer is not None and k > 0:
                    proposer.observe(context, len(proposal.tokens), result.num_accepted)
                if t_first is None:
                    t_first = time.perf_counter()
                if finish:
                    text.finish()
                chunk = StreamChunk(
                    text=text.take_delta(final=finish is not None),
                    token_ids=generated[n_before:],
                    accepted=accepted_mask[n_before:],
                )
                if finish:
                    t_end = time.perf_counter()
                    stats.new_tokens = len(generated)
                    stats.prefill_seconds = t_first - t0
                    stats.decode_seconds = t_end - t_first
                    chunk.finish_reason = finish
                    chunk.result = GenerationResult(
                        text=text.text,
                        token_ids=list(generated),
                        finish_reason=finish,  # type: ignore[arg-type]
                        stats=stats,
                        accepted_mask=accepted_mask,
                    )
                yield chunk
        finally:
            target.free()
            if proposer is not None:
                proposer.close()

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
