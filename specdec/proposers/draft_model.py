"""Draft-model proposer: a small model sharing the target's vocabulary samples k tokens one by one.

Each draft token is drawn from q, the draft's logits processed by the SAME rules as the target's p
(:class:`~specdec.sampling.SamplingState`: penalties, logit_bias, min_tokens, then temperature, min-p,
top-k, top-p), with the SAME history: draft i follows the committed tokens and drafts 1..i-1, exactly
like the target's row i. Losslessness needs only that q is the distribution the drafts were drawn from;
matching the target's processing is what keeps acceptance high. A drafter over part of the target's
vocabulary (FR-Spec, :mod:`specdec.backends.vocab_map`) gives ``-inf`` logits outside it, so its q is zero
there; a row with nothing allowed ends the proposal. At temperature 0 the draft takes the
argmax of its processed logits and no q is returned. The draft's KV cache is rolled back through
:class:`~specdec.backends.base.SequenceCache`, which also covers the all-accepted case where the draft
never evaluated its own last draft token.

**Cascade** (staged speculation, Spector & Re 2023, arXiv 2308.04623; cascade speculative drafting, Chen
et al. 2023, arXiv 2312.11462): with ``cascade`` on, prompt lookup (:class:`~specdec.proposers.ngram.
NgramIndex` over the committed tokens) guesses the draft's next ``m`` tokens and the draft model scores
them in ONE call of ``m+1`` positions instead of ``m+1`` calls of one. Row ``j`` of that call is the
draft's distribution after the guess's first ``j`` tokens, so the draft picks its token from row ``j``
exactly as it would have one call at a time (the same ``draws``, the same processing) and keeps reading
rows while its pick equals the guess; at the first difference it has its own token and asks the lookup
again. The drafts are therefore the tokens plain drafting would have drawn (point-mass guesses verified
by drawing from q: a guess ``g`` survives with probability ``q(g)``, what speculative sampling's
``min(1, q(g)/1)`` gives), and the target-level verification is unchanged: the cascade only makes
drafting cheaper when the text repeats, never changes what is proposed (up to batched-kernel near-ties in
the draft's logits). A call of a few tokens costs a draft model far less than that many calls of one, even
on a CPU (measured: ``docs/bench/README.md``, section "Cascade"), so each guessed token the draft confirms
saves most of a draft call; a wrong guess costs the extra positions of one call.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from specdec.backends.cache import SequenceCache
from specdec.params import SamplingParams, SpecConfig
from specdec.proposers.base import EMPTY_PROPOSAL, DraftCost, Draws, Outcome, Proposal, ProposerContext, register
from specdec.proposers.ngram import NgramIndex
from specdec.backends.prefix import common_prefix
from specdec.grammar import vocabulary_of
from specdec.sampling import NoValidTokenError, SamplingState
from specdec.types import ALONE, Load


class DraftModelProposer:
    """Samples drafts from a draft model.

    Args:
        cache: The draft sequence this proposer drafts in (it frees it on :meth:`close`).
        vocab_size: Rows of the target's vocabulary; draft logits are sliced to it, so a padded
            draft vocabulary never proposes a token the target cannot score.
        p_min: Early stop (llama.cpp's ``--draft-p-min``): stop before a draft token whose probability
            under the draft (softmax of its logits; q when sampling) is below ``p_min``; 0 disables it.
        lazy_prefill: Do not prefill in :meth:`prepare`; the first :meth:`propose` catches up instead
            (for proposers that may never use the draft model).
        drafter: This drafter's kind (:func:`~specdec.proposers.base.drafter_kinds`), which labels its
            drafting costs for the cost model.
        cascade: Let prompt lookup guess the draft's tokens and score each guess in one draft call (see
            the module docstring); the drafts are the same, their cost lower where the text repeats.
        ngram_max: Longest suffix the cascade's lookup matches.
        ngram_min: Shortest suffix the cascade's lookup matches.
    """

    def __init__(self, cache: SequenceCache, vocab_size: int | None = None, p_min: float = 0.0,
                 lazy_prefill: bool = False, drafter: str = "draft", cascade: bool = False,
                 ngram_max: int = 3, ngram_min: int = 1):
        self.cache = cache
        self.index = NgramIndex(ngram_min, ngram_max) if cascade else None
        self.drafter = drafter
        self.vocab_size = vocab_size or cache.backend.n_vocab
        self.p_min = p_min
        self.lazy_prefill = lazy_prefill
        self._prompt: list[int] = []
        self._state: SamplingState | None = None

    def prepare(self, context: Sequence[int]) -> None:
        """Prefill the draft with the prompt, or its next chunk (and remember it: penalties count prompt
        tokens; the last call has the whole prompt)."""
        self._prompt = list(context)
        self._state = None
        if not self.lazy_prefill:
            self.cache.score(list(context), 1)

    def _sampling_state(self, context: Sequence[int], params: SamplingParams) -> SamplingState:
        """The request's processing state, synced to ``context`` (prompt + committed tokens)."""
        if self._state is None or self._state.params != params:
            prompt = self._prompt if list(context[: len(self._prompt)]) == self._prompt else list(context)
            eog = [i for i in self.cache.backend.eog_ids if i < self.vocab_size]  # padding rows are sliced off
            vocabulary = vocabulary_of(self.cache.backend, self.vocab_size) if params.grammar is not None else None
            self._state = SamplingState(params, prompt, self.vocab_size, eog, vocabulary)
        self._state.sync(context)
        return self._state

    def catchup(self, context: Sequence[int]) -> int:
        """Tokens of ``context`` the draft's cache lacks (what the next :meth:`propose` evaluates first)."""
        held = self.cache.tokens
        return len(context) - common_prefix(held, context, min(len(held), len(context)))

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, draws: Draws,
                kind: str | None = None, load: Load = ALONE) -> Proposal:
        """Draft ``k`` tokens autoregressively, each picked from ``q`` by ``draws`` (the argmax when greedy);
        ``probs`` is ``[k, V] float64`` when ``draws.needs_probs``, else None.

        ``kind`` labels the proposal for pooled acceptance statistics (adaptive proposers pass the
        drafter's kind); the proposal's ``draft_cost`` says what drafting took.
        """
        if k <= 0:
            return EMPTY_PROPOSAL
        t0, catchup = time.perf_counter(), self.catchup(context)
        state = self._sampling_state(context, params)
        if self.index is not None:
            self.index.sync(context)
        seq = list(context)
        tokens: list[int] = []
        rows: list[np.ndarray] = []
        calls, stopped = 0, False
        while len(tokens) < k and not stopped:
            # a cascade's guess of the next tokens (at most k-1 more: the call's last row gives one more)
            guess = self.index.continuation(seq, k - len(tokens) - 1) if self.index is not None else []
            block = self.cache.score(seq + guess, len(guess) + 1)[:, : self.vocab_size]  # [m+1, V] float32
            calls += 1
            for j in range(len(guess) + 1):  # row j: the draft's next token after guess[:j]
                logits = block[j : j + 1]
                try:
                    if params.greedy:
                        tok = int(state.argmax(logits, tokens)[0])
                        unsure = self.p_min > 0 and _top_probability(logits[0]) < self.p_min
                    else:
                        q = state.probs(logits, tokens)[0]  # [V] float64, history: context + tokens so far
                        unsure = self.p_min > 0 and q.max() < self.p_min
                except NoValidTokenError:  # nothing allowed within the draft's vocabulary (an FR-Spec drafter
                    unsure = True  # under a grammar): the proposal ends here, the target goes on
                if unsure:
                    stopped = True
                    break
                if not params.greedy:
                    tok = draws.pick(q, len(tokens))
                    if draws.needs_probs:
                        rows.append(q)
                tokens.append(tok)
                seq.append(tok)
                if j == len(guess) or tok != guess[j] or len(tokens) == k:
                    break  # past the guess, or off it: the next call starts from the draft's own token
        evals = min(k, len(tokens) + 1) if stopped else len(tokens)  # an early stop read one more position
        return Proposal(tokens=tokens, probs=np.stack(rows) if rows else None, kind=kind if tokens else None,
                        draft_cost=DraftCost(evals, catchup, time.perf_counter() - t0, self.drafter, calls))

    def observe(self, outcome: Outcome) -> None:
        """Nothing to do: the next :meth:`propose` rolls the cache back to the committed context."""

    def close(self) -> None:
        """Release the draft sequence (the draft's prefix cache may keep it for later requests)."""
        self.cache.finish()


def _top_probability(logits: np.ndarray) -> float:
    """Largest softmax probability of one row of logits (``[V] float32``)."""
    return float(1.0 / np.exp(logits - logits.max()).sum())


@register("draft", default_k=4, needs_draft=True)
def _draft(ctx: ProposerContext, spec: SpecConfig) -> DraftModelProposer:
    """``draft``: the (first) draft model with a fixed k."""
    return DraftModelProposer(SequenceCache(ctx.draft, salt=ctx.cache_salt), ctx.vocab_size, p_min=spec.draft_p_min,
                              cascade=spec.cascade, ngram_max=spec.ngram_max, ngram_min=spec.ngram_min)
