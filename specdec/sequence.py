"""The per-sequence state the speculative step needs, and its small named calls.

A :class:`SequenceState` holds one request's committed context, sampling state, RNG, proposer, verifier
and KV-cache mirror(s), and counts its statistics. :func:`specdec.step.speculative_step` drives it: first
:meth:`~SequenceState.plan_prefill` once per chunk of the prompt (the last chunk's logits give the first
token), then every step :meth:`~SequenceState.propose` -> :meth:`~SequenceState.plan` (what the target must
score) -> :meth:`~SequenceState.record_call` (after the call) -> the verifier -> :meth:`~SequenceState.commit`.
Committed tokens go to the request's output stage through the narrow :class:`TokenSink` protocol, which
answers whether a stop string ended the text.

This module knows token ids, backends (through :class:`~specdec.backends.base.SequenceCache`), proposers
and verifiers; it knows nothing about text, HTTP, or other sequences.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from specdec.backends.cache import SequenceCache
from specdec.params import SamplingParams
from specdec.proposers.base import EMPTY_PROPOSAL, Outcome, Proposal, Proposer
from specdec.proposers.prediction import KIND as PREDICTION
from specdec.sampling import SamplingState, make_rng
from specdec.stats import GenerationStats
from specdec.types import ALONE, Load, ModelInfo, TokenKind, TokenSource
from specdec.verify import Draft, NoiseDraws, PositionNoise, RandomDraws, TargetRows, Verifier, VerifyResult


RECENT_WEIGHT = 0.5
"""Weight of the last call in :attr:`SequenceState.committed_per_call`."""


class TokenSink(Protocol):
    """Where committed generated tokens go (the request's :class:`~specdec.output.Output`)."""

    def add(self, token_id: int, source: TokenSource, logits: np.ndarray) -> bool:
        """Take one token; True when a stop string ended the text."""


@dataclass(frozen=True)
class ScorePlan:
    """What one sequence asks of this step's target call.

    Attributes:
        proposal: The proposal being verified.
        candidates: ``[c]`` the candidates scored (the proposal's, minus alternatives that found no
            free sequence); one empty candidate on a plain step or the prefill.
        caches: ``[c]`` the KV mirror scoring each candidate (``caches[0]``: the main one).
        new: ``[c]`` tokens each cache appends in the call.
        partial: True for a chunk of the prompt that is not its last: evaluated without logits, nothing
            verified or committed.
    """

    proposal: Proposal
    candidates: tuple[Draft, ...]
    caches: tuple[SequenceCache, ...]
    new: tuple[list[int], ...]
    partial: bool = False

    def batch(self) -> dict[int, tuple[list[int], int]]:
        """``seq_id -> (new tokens, n_logits)`` for the backend: ``k_j + 1`` logits per candidate (none
        for a partial prompt chunk)."""
        return {cache.seq_id: (new, 0 if self.partial else len(c.tokens) + 1)
                for cache, new, c in zip(self.caches, self.new, self.candidates)}

    @property
    def n_tokens(self) -> int:
        """Tokens the plan adds to the call, all candidates together."""
        return sum(len(new) for new in self.new)


class SequenceState:
    """One sequence's state for the speculative step.

    Args:
        model: Vocabulary size, context window and end-of-generation ids of the models.
        prompt_ids: ``[L] int`` prompt token ids, ``1 <= L < model.n_ctx``.
        params: Sampling and stopping parameters (``n == 1``).
        sampling: The sequence's history-dependent processing (built from ``params`` and the prompt).
        target: The main KV mirror in the target model (owned: :meth:`release` frees it).
        proposer: The sequence's own proposer (owned), or ``None`` for plain decoding.
        verifier: The verifier of single-candidate steps (:func:`specdec.verify.select_verifier`).
        k: Most draft tokens per step (:class:`~specdec.request.SpecPlan`; 0 = plain decoding, ``proposer``
            then None).
        sink: Receives committed tokens (the output stage).

    Randomness is owned: the sequence's generator (seeded by ``params.seed``) is consumed only by its own
    proposer and verifier, so the same seed gives the same tokens alone or in a batch. With a
    drafter-invariant verifier (``verifier.noise``) the randomness belongs to output positions instead
    (:class:`~specdec.verify.gumbel.PositionNoise` keyed by the seed): the same seed gives the same tokens
    whatever the proposer and k.
    """

    def __init__(self, model: ModelInfo, prompt_ids: Sequence[int], params: SamplingParams, sampling: SamplingState,
                 target: SequenceCache, proposer: Proposer | None, verifier: Verifier, k: int, sink: TokenSink):
        self.model = model
        self.params = params
        self.sampling = sampling
        self.target = target
        self.proposer = proposer
        self.verifier = verifier
        assert (proposer is None) == (k == 0), "a proposer speculates (k > 0), plain decoding has none"
        self.k = k
        self.sink = sink
        self.rng = make_rng(params.seed)
        self.noise = PositionNoise(params.seed, model.vocab_size) if verifier.noise else None
        self.context = list(prompt_ids)  # prompt + committed tokens (an ending end-of-generation token too)
        self.n_generated = 0
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids))
        self.finish_reason: str | None = None
        self._aux: list[SequenceCache] = []  # sequences of alternative candidates, during a step
        self.call_tokens = 1  # tokens this sequence added to its last decode step's target call
        self._recent_committed = 1.0
        self._t0 = time.perf_counter()
        self._t_first: float | None = None

    @property
    def finished(self) -> bool:
        """True once a finish reason is set."""
        return self.finish_reason is not None

    @property
    def prefilled(self) -> bool:
        """True once the prompt's prefill (its last chunk) committed the first token."""
        return self._t_first is not None

    @property
    def committed_per_call(self) -> float:
        """Tokens this sequence is expected to commit in its next target call: a moving average over its
        last calls (weight :data:`RECENT_WEIGHT` on the last; 1 before any), the ``Y`` it brings to other
        sequences' choices (:class:`~specdec.policy.cost.Load`). Recent, not the mean of its life: when the
        batch starts drafting, the others must see what drafting now commits, or each would price its
        own drafts against a stale, too slow call and all keep drafting where none pays."""
        return self._recent_committed

    # -- 0. prefill --------------------------------------------------------------------------------
    def prompt_lacking(self) -> int | None:
        """Prompt tokens the next prefill chunks still have to evaluate (after the longest prefix the prefix
        cache would copy, before the first chunk), for sharing a call's budget
        (:func:`specdec.prefill.share_budget`); None while waiting to copy a prefix another sequence is
        prefilling (see :meth:`plan_prefill`). No side effects."""
        assert not self.prefilled
        if self.target.should_wait(self.context, 1):
            return None
        return self.target.lacking(self.context, 1)

    def plan_prefill(self, limit: int | None = None) -> ScorePlan | None:
        """The prompt's next chunk: at most ``limit`` tokens (``None``: all) of what the target cache does
        not hold yet (the prefix cache may have copied a prefix); the last chunk asks for the logits of
        the prompt's last position, which give the first token. The proposer prepares on the prompt up
        to the chunk's end (a draft model prefills chunk by chunk too). None, before the first chunk, while
        another sequence is still prefilling a longer part of this prompt than any donor holds: it waits to
        copy it (:meth:`~specdec.backends.cache.SequenceCache.should_wait`).

        Raises:
            BackendError: from the prefix cache's copy.
        """
        assert not self.prefilled and (limit is None or limit >= 1)
        if self.target.should_wait(self.context, 1):
            return None
        new = self.target.plan(self.context, 1)
        partial = limit is not None and len(new) > limit
        if partial:
            new = new[:limit]
        if self.proposer is not None:
            self.proposer.prepare(self.context[: len(self.target.tokens) + len(new)])
        return ScorePlan(EMPTY_PROPOSAL, (Draft([]),), (self.target,), (new,), partial=partial)

    def prefill_chunk_done(self, plan: ScorePlan) -> None:
        """Record that a partial prompt chunk (``plan.partial``) was evaluated."""
        assert plan.partial
        self.target.commit(plan.new[0])

    # -- 1. propose --------------------------------------------------------------------------------
    def draft_budget(self) -> int:
        """Drafts allowed this step: ``k``, fewer near ``max_tokens`` and the end of the context (the
        target cache holds context + drafts, and at most k+1 tokens are committed)."""
        room = min(self.params.max_tokens - self.n_generated, self.model.n_ctx - len(self.context)) - 1
        return max(0, min(self.k, room))

    def propose(self, load: Load = ALONE) -> Proposal:
        """This step's proposal (after the prefill: :meth:`plan_prefill`); ``load``: what else shares the
        step's target call (the proposer prices its drafts in it)."""
        assert not self.finished and self.prefilled
        k = self.draft_budget()
        if not k:
            return EMPTY_PROPOSAL
        draws = RandomDraws(self.rng) if self.noise is None else NoiseDraws(self.noise, self.n_generated)
        proposal = self.proposer.propose(self.context, k, self.params, draws, load=load)
        return proposal if self.sampling.constraint is None else self._within_grammar(proposal, k)

    def _within_grammar(self, proposal: Proposal, k: int) -> Proposal:
        """The proposal cut where the request's grammar refuses a draft (such a draft could never be accepted:
        the target's row gives it no mass), and, when nothing is left, the tokens the grammar forces
        (:meth:`~specdec.grammar.Constraint.forced`) as a point-mass proposal of kind ``"forced"``: certain
        drafts that cost no drafting."""
        c = self.sampling.constraint
        n = c.valid_prefix(proposal.tokens)
        alts = tuple(Draft(a.tokens[:m], None if a.probs is None else a.probs[:m])
                     for a in proposal.alternatives if (m := c.valid_prefix(a.tokens)))
        if n < len(proposal.tokens) or len(alts) < len(proposal.alternatives) or any(
                len(a.tokens) < len(b.tokens) for a, b in zip(alts, proposal.alternatives)):
            proposal = dataclasses.replace(
                proposal, tokens=list(proposal.tokens[:n]), alternatives=alts if n else (),
                probs=None if proposal.probs is None else proposal.probs[:n], confidence=proposal.confidence[:n])
        if proposal.tokens:
            return proposal
        forced = c.forced(k)
        return Proposal(tokens=forced, kind="forced", expected=float(len(forced))) if forced else EMPTY_PROPOSAL

    # -- 2. score ----------------------------------------------------------------------------------
    def plan(self, proposal: Proposal) -> ScorePlan:
        """Roll the KV mirrors back and say what the target must score: [last committed token] + drafts
        for each candidate. An alternative candidate is scored in a sequence that shares the committed
        prefix (copied KV cells); it is dropped when no sequence is free or the backend cannot copy."""
        if proposal.empty:
            return ScorePlan(proposal, (Draft([]),), (self.target,), (self.target.plan(self.context, 1),))
        candidates, caches = [proposal.candidates[0]], [self.target]
        for alt in proposal.alternatives:
            cache = self._alternative_cache()
            if cache is None:
                break
            candidates.append(alt)
            caches.append(cache)
        new = tuple(cache.plan(self.context + list(c.tokens), len(c.tokens) + 1) for cache, c in zip(caches, candidates))
        return ScorePlan(proposal, tuple(candidates), tuple(caches), new)

    def _alternative_cache(self) -> SequenceCache | None:
        """A sequence holding the committed context but its last token, for one alternative candidate."""
        backend = self.target.backend
        if backend.free_sequences < 1:
            return None
        cache = SequenceCache(backend, salt=self.target.salt)
        self._aux.append(cache)
        n = min(len(self.context) - 1, len(self.target.tokens))
        if not cache.fork(self.target, n):
            return None
        return cache

    def record_call(self, plan: ScorePlan, logits: dict[int, np.ndarray]) -> list[TargetRows]:
        """Record what the target call evaluated (each KV mirror now holds its ``plan.new`` tokens) and wrap
        each candidate's ``[k_j+1, V]`` logits (padding rows sliced off) for the verifier."""
        for cache, new in zip(plan.caches, plan.new):
            cache.commit(new)
        self.call_tokens = plan.n_tokens if self.prefilled else 1  # the prompt's last chunk: a plain step next
        v = self.model.vocab_size
        return [TargetRows(logits[cache.seq_id][:, :v], c.tokens, self.sampling, self.noise, self.n_generated)
                for cache, c in zip(plan.caches, plan.candidates)]

    # -- 4. commit ---------------------------------------------------------------------------------
    def commit(self, plan: ScorePlan, result: VerifyResult, rows: Sequence[TargetRows]) -> Outcome:
        """Commit the verified block: accepted drafts of the chosen candidate, then the recovered or bonus
        token; stop at an end-of-generation token, a stop string, ``max_tokens`` or the context's end.

        Returns:
            What the proposal earned (handed to the proposer and the cost model).
        """
        j = result.candidate
        drafts = plan.candidates[j].tokens
        if j:  # the accepted path lives in an alternative's sequence: it becomes the main one
            self._aux[self._aux.index(plan.caches[j])] = self.target
            self.target = plan.caches[j]
        self._release_aux()
        block = result.tokens(drafts)
        kept = 0
        step, kind = self.stats.target_calls, plan.proposal.kind if drafts else None
        for i, tok in enumerate(block):
            kept += 1
            self.context.append(tok)
            if tok in self.model.eog_ids:
                self._finish("stop")
                break
            self.n_generated += 1
            self.sampling.extend((tok,))
            source = TokenSource(_token_kind(i, result.num_accepted, len(drafts)), kind, step, len(drafts))
            if self.sink.add(tok, source, rows[j].logits[i]):
                self._finish("stop")
            elif self.n_generated >= self.params.max_tokens or len(self.context) >= self.model.n_ctx:
                self._finish("length")
            if self.finished:
                break
        self.stats.record_step(len(drafts), result.num_accepted, kept)
        if (cost := plan.proposal.draft_cost) is not None:
            self.stats.record_drafter(cost.drafter, len(drafts), result.num_accepted, cost.seconds,
                                      cost.calls or cost.evals)
        elif kind in ("forced", PREDICTION):  # the grammar's own drafts, the client's prediction: no model ran
            self.stats.record_drafter(kind, len(drafts), result.num_accepted, 0.0, 0)
        self._recent_committed += RECENT_WEIGHT * (kept - self._recent_committed)
        if self.noise is not None:
            self.noise.forget_before(self.n_generated)
        if self._t_first is None:
            self._t_first = time.perf_counter()
            self.stats.cached_prompt_tokens = self.target.reused
        outcome = Outcome(plan.proposal, j, len(drafts), result.num_accepted, len(self.context))
        if self.proposer is not None and not plan.proposal.empty and plan.proposal.kind != "forced":
            self.proposer.observe(outcome)  # forced drafts are the grammar's, not the proposer's
        if self.finished:
            self._close_stats()
        return outcome

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason

    def _close_stats(self) -> None:
        now = time.perf_counter()
        report = getattr(self.proposer, "report", None)  # adaptive proposers: predictions, choices
        if report is not None:
            self.stats.adaptive = report()
        self.stats.new_tokens = self.n_generated
        self.stats.prefill_seconds = self._t_first - self._t0
        self.stats.decode_seconds = now - self._t_first

    def _release_aux(self) -> None:
        for cache in self._aux:
            cache.free()
        self._aux = []

    def release(self) -> None:
        """Release the sequence's KV sequences and its proposer's (the prefix cache may keep them as
        donors for later requests: :meth:`SequenceCache.finish`); safe to call twice."""
        self._release_aux()
        if self.target is not None:
            self.target.finish()
            self.target = None  # type: ignore[assignment]
        if self.proposer is not None:
            self.proposer.close()
            self.proposer = None


def _token_kind(i: int, accepted: int, proposed: int) -> TokenKind:
    """The kind of the ``i``-th token (0-based) of a committed block that accepted ``accepted`` of
    ``proposed`` drafts: the accepted drafts, then the target's own token."""
    if i < accepted:
        return "accepted"
    if not proposed:
        return "plain"
    return "bonus" if accepted == proposed else "recovered"
