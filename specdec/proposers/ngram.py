"""N-gram prompt lookup (Saxena 2023, "Prompt Lookup Decoding"; llama.cpp's lookup, vLLM's ngram).

Matches the last ``n`` tokens of the context, ``n`` from ``ngram_max`` down to ``ngram_min``,
anywhere earlier in prompt + output, newest match first, and proposes up to ``k`` tokens that followed
the match. The proposal is a point mass (``probs=None``): the verifier accepts draft token x with
probability p(x). It costs no model call, so proposing nothing simply falls back to a plain step.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specdec.proposers.base import EMPTY_PROPOSAL, Proposal, register
from specdec.types import SamplingParams


def find_ngram_continuation(context: np.ndarray, k: int, ngram_max: int, ngram_min: int) -> list[int]:
    """The up-to-``k`` tokens that followed the newest earlier occurrence of the context's suffix.

    Args:
        context: ``[L] int64`` token ids.
        k: Most tokens to return.
        ngram_max: Longest suffix tried first.
        ngram_min: Shortest suffix tried.

    Returns:
        Draft token ids (possibly empty).
    """
    n_ctx = len(context)
    for n in range(min(ngram_max, n_ctx - 1), ngram_min - 1, -1):
        suffix = context[n_ctx - n :]
        # windows starting at 0..L-n-1: each has at least one token after it
        windows = sliding_window_view(context[:-1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return context[start : start + k].tolist()
    return []


@register("ngram")
class NgramProposer:
    """Prompt-lookup proposer.

    Args:
        ngram_max: Longest suffix n-gram to match.
        ngram_min: Shortest suffix n-gram to match.
    """

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1, **_: object):
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min

    def prepare(self, context: Sequence[int]) -> None:
        """Nothing to prefill."""

    def propose(
        self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator
    ) -> Proposal:
        """Propose the continuation of the newest suffix match (a point mass, ``probs=None``)."""
        if k <= 0:
            return EMPTY_PROPOSAL
        tokens = find_ngram_continuation(np.asarray(context, dtype=np.int64), k, self.ngram_max, self.ngram_min)
        return Proposal(tokens=tokens) if tokens else EMPTY_PROPOSAL

    def observe(self, context: Sequence[int], num_proposed: int, num_accepted: int) -> None:
        """No state to update."""

    def close(self) -> None:
        """Nothing held."""
