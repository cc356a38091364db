"""What a draft token costs in a target call shared with other sequences.

:class:`specdec.policy.cost.CostModel` prices a call by its total tokens, ``S(n)``, whatever the split between
sequences and drafts. On the default pair on a 2-core CPU that is not so (``docs/bench/README.md``, "Drafts
in a busy pass"): a draft token added more to a shared call than another sequence's token, and ``S(n)`` for
the sizes drafts land on is learned mostly from plain calls of ``n`` sequences (a bigger batch), rarely
measured and noisy, so ``S(B + k + 1) - S(B + 1)`` priced the drafts of a busy batch below their cost and
``auto`` drafted where it lost.

This module measures the draft tokens' cost itself, from the calls that carry them: with ``P(m)`` the
mean seconds of a call of ``m`` sequences with one token each (every plain step of a batch measures it) and
``d`` the call's other tokens (drafts and token-tree alternatives), a call that took ``y`` seconds gives
``y - P(m) = beta d + noise``, and ``beta`` is the least-squares slope through the origin over recent calls
(sums decayed by :data:`DECAY` a call). The cost model prices a shared call's drafts at no less than
``beta`` a token (:meth:`specdec.policy.cost.CostModel.shared_curve`); a lone request's calls are not
affected (``S(n)`` there is measured at its own sizes). Calls with prompt chunks are left out: chunk tokens
need no logits and come in large runs, so they cost a call differently from drafts.

It knows numbers only: no sequences, models or tokens.
"""

from __future__ import annotations

import math

from specdec.policy.timing import TimingTable

DECAY = 0.98
"""Weight of the evidence so far before each new call that carries drafts (~50 calls' memory)."""

MIN_EVIDENCE = 8.0
"""Decayed ``sum(d^2)`` (draft tokens squared) before ``beta`` is used: a few calls' worth, so that one noisy
call does not price every draft."""

SEQUENCES_MAX = 256
"""Largest number of sequences in a call whose plain cost is tracked."""


class SharedCallCost:
    """Online ``P(m)`` (plain call of ``m`` sequences, seconds) and ``beta`` (seconds a draft token adds to a
    shared call), for one decoding mode; see the module docstring."""

    def __init__(self) -> None:
        self.plain = TimingTable(n_max=SEQUENCES_MAX)  # m sequences, one token each -> seconds
        self._sdd = 0.0  # decayed sum of d^2 (tokens^2)
        self._sdy = 0.0  # decayed sum of d * (y - P(m)) (tokens x seconds)

    def observe(self, n_tokens: int, n_sequences: int, n_prompt: int, seconds: float) -> None:
        """One target call: ``n_tokens`` in all, of ``n_sequences`` sequences, ``n_prompt`` of them prompt
        tokens, ``seconds`` of wall time. Only calls of two or more decoding sequences and no prompt count."""
        if n_sequences < 2 or n_prompt or not seconds > 0:
            return
        extra = n_tokens - n_sequences
        if extra <= 0:
            self.plain.observe(n_sequences, seconds)
            return
        if n_sequences > self.plain.n_max or self.plain.count[n_sequences] < 3:
            return  # no reliable plain cost of this batch to subtract yet
        base = float(self.plain.mean[n_sequences])
        self._sdd = DECAY * self._sdd + extra * extra
        self._sdy = DECAY * self._sdy + extra * (seconds - base)

    def extension_seconds(self) -> float:
        """``beta``: seconds one more draft token adds to a shared call (>= 0); NaN before
        :data:`MIN_EVIDENCE` is gathered."""
        if self._sdd < MIN_EVIDENCE:
            return math.nan
        return max(0.0, self._sdy / self._sdd)
