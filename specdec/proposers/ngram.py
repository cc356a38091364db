"""N-gram prompt lookup (Saxena 2023, "Prompt Lookup Decoding"; llama.cpp's lookup, vLLM's ngram).

Matches the last ``n`` tokens of the context, ``n`` from ``ngram_max`` down to ``ngram_min``,
anywhere earlier in prompt + output, newest match first, and proposes the tokens that followed the
match: at most ``k`` (a cap) and at most :data:`~specdec.proposers.base.MATCH_FACTOR` per token of the
match's real length (the n-gram compared further back with the context), so a one-token coincidence
earns one draft and a long verbatim copy up to ``k``. :class:`NgramIndex` keeps the newest occurrence
of every n-gram up to date as the context grows, so a step costs O(new tokens + k), not a scan of the
whole context (the tests check it against a full scan). The proposal is a point mass (``probs=None``):
the verifier accepts draft token x with probability p(x). It costs no model call, so proposing nothing
simply falls back to a plain step.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from specdec.params import SamplingParams, SpecConfig
from specdec.proposers.base import (
    EMPTY_PROPOSAL, MATCH_FACTOR, Draws, Outcome, Proposal, ProposerContext, match_cap, register,
)
from specdec.types import ALONE, Load


class NgramIndex:
    """The newest earlier occurrence of every n-gram (``n_min <= n <= n_max``) of a growing sequence.

    Updating costs O(new tokens * n_max) and a lookup O(n_max), instead of a scan of the whole context.

    Args:
        n_min: Shortest suffix matched.
        n_max: Longest suffix matched (tried first).
    """

    def __init__(self, n_min: int = 1, n_max: int = 3):
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self._end: list[dict[tuple, int]] = [{} for _ in range(n_max + 1)]  # n -> n-gram -> end index

    def sync(self, context: Sequence[int]) -> None:
        """Bring the index up to ``context``: append its new tokens (rebuild if it is not an extension)."""
        old = len(self.tokens)
        if old > len(context) or (old and context[old - 1] != self.tokens[-1]):
            self.tokens, self._end, old = [], [{} for _ in range(self.n_max + 1)], 0
        self.tokens.extend(context[old:])
        toks = self.tokens
        # an occurrence ending at e (exclusive) is usable once toks[e] exists: e <= len - 1
        for e in range(max(old, 1), len(toks)):
            for n in range(self.n_min, min(self.n_max, e) + 1):
                self._end[n][tuple(toks[e - n : e])] = e

    def lookup(self, k: int) -> tuple[list[int], int]:
        """Up to ``k`` tokens that followed the newest earlier occurrence of the longest matching suffix.

        Returns:
            ``(tokens, n)``: the continuation and the matched suffix length; ``([], 0)`` for no match.
        """
        tokens, n, _ = self.lookup_match(k)
        return tokens, n

    def lookup_match(self, k: int, extend: int = 0) -> tuple[list[int], int, int]:
        """:meth:`lookup`, and how far the match really reaches: the matched n-gram's occurrence compared
        backwards with the context's end, up to ``extend`` tokens in all (O(extend)).

        Returns:
            ``(tokens, n, match_len)``, ``match_len = max(n, min(extend, common suffix length))``;
            ``([], 0, 0)`` for no match.
        """
        toks, size = self.tokens, len(self.tokens)
        e, n = self._newest(toks, size - 1)
        if e is None:
            return [], 0, 0
        length = n
        while length < extend and e - length > 0 and toks[e - length - 1] == toks[size - length - 1]:
            length += 1
        return toks[e : e + k], n, length

    def _newest(self, tail: Sequence[int], n_top: int) -> tuple[int | None, int]:
        """``(end, n)`` of the newest indexed occurrence of the longest suffix of ``tail`` (``n`` from
        ``min(n_max, n_top)`` down to ``n_min``); ``(None, 0)`` for none."""
        for n in range(min(self.n_max, n_top), self.n_min - 1, -1):
            e = self._end[n].get(tuple(tail[len(tail) - n :]))
            if e is not None:
                return e, n
        return None, 0

    def continuation(self, tail: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the newest occurrence, in the indexed tokens, of the longest
        suffix of ``tail`` (``n_max`` down to ``n_min`` tokens); ``[]`` for no match or ``k <= 0``.

        ``tail`` may run past the indexed tokens (a cascade's own drafts, :class:`~specdec.proposers.
        draft_model.DraftModelProposer`): only its last ``n_max`` tokens are read and the index is not
        changed, so speculative tokens never enter it.
        """
        if k <= 0:
            return []
        e, _ = self._newest(tail, len(tail))
        return [] if e is None else self.tokens[e : e + k]


class NgramProposer:
    """Prompt-lookup proposer.

    Args:
        ngram_max: Longest suffix n-gram to match.
        ngram_min: Shortest suffix n-gram to match.
    """

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1):
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min
        self.index = NgramIndex(ngram_min, ngram_max)

    def prepare(self, context: Sequence[int]) -> None:
        """Nothing to prefill."""

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, draws: Draws,
                load: Load = ALONE) -> Proposal:
        """Propose the continuation of the newest suffix match (a point mass, ``probs=None``), cut to
        ``match_cap(match length, k)`` drafts."""
        if k <= 0:
            return EMPTY_PROPOSAL
        self.index.sync(context)
        tokens, _, length = self.index.lookup_match(k, extend=math.ceil(k / MATCH_FACTOR))
        tokens = tokens[: match_cap(length, k)]
        return Proposal(tokens=tokens) if tokens else EMPTY_PROPOSAL

    def observe(self, outcome: Outcome) -> None:
        """No state to update."""

    def close(self) -> None:
        """Nothing held."""


@register("ngram", default_k=4)
def _ngram(ctx: ProposerContext, spec: SpecConfig) -> NgramProposer:
    """``ngram``: prompt lookup, at most k drafts."""
    return NgramProposer(spec.ngram_max, spec.ngram_min)
