"""``hybrid``: n-gram prompt lookup first (free), the first draft model when the lookup has no good match;
choices by acceptance statistics alone (``auto``, :mod:`specdec.policy.auto`, prices them instead).

The n-gram continuation when its first-position acceptance estimate is at least :data:`RULE_THRESHOLD`, else
the first draft model; k = the number of leading positions whose estimate is at least the threshold (at least
1).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from specdec.backends.cache import SequenceCache
from specdec.params import SamplingParams, SpecConfig
from specdec.policy.acceptance import expected_tokens
from specdec.policy.cost import CostModel
from specdec.policy.pricing import Choice
from specdec.types import ALONE, Load
from specdec.policy.sources import Sources
from specdec.proposers.base import EMPTY_PROPOSAL, Draws, Proposal, ProposerContext
from specdec.proposers.draft_model import DraftModelProposer

RULE_THRESHOLD = 0.5
"""``hybrid`` drafts while the estimated acceptance of the next position is at least this."""


def leading(accept: np.ndarray, threshold: float) -> int:
    """Number of leading entries of ``accept`` (``[K] float64``) at or above ``threshold``."""
    below = np.flatnonzero(accept < threshold)
    return int(below[0]) if len(below) else len(accept)


class HybridProposer(Sources):
    """N-gram lookup first, the first draft model otherwise; see the module docstring.

    Args:
        draft: The draft-model proposer (prefilled lazily), or None.
        ngram_max: Longest suffix n-gram matched.
        ngram_min: Shortest suffix n-gram matched.
        cost_model: The engine's cost model (its pooled acceptance statistics seed the request's).
        drafts: Drafter kind -> draft-model proposer instead of ``draft``; the rule uses the first.
    """

    def __init__(self, draft: DraftModelProposer | None = None, ngram_max: int = 3, ngram_min: int = 1,
                 cost_model: CostModel | None = None, drafts: dict[str, DraftModelProposer] | None = None):
        super().__init__(cost_model, adaptive=False, ngram_max=ngram_max, ngram_min=ngram_min, drafts=drafts,
                         draft=draft)

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, draws: Draws,
                load: Load = ALONE) -> Proposal:
        """Draft up to ``k`` tokens from the n-gram index or the first draft model (possibly none); the
        proposal's ``kind`` is ``ngramN`` or ``draft``. ``load`` (what else shares the call) only prices the
        prediction logged for the bench."""
        if k <= 0:
            return EMPTY_PROPOSAL
        match, order, catchup = self.lookup(context, k)
        choice = self.choose(match, order, k)
        self._log(choice, order, catchup, params.greedy, load)
        if choice.source == "ngram":
            return Proposal(tokens=match[: choice.k], kind=f"ngram{order}")
        if choice.source in self.drafts:
            p = self.drafts[choice.source].propose(context, choice.k, params, draws, kind=choice.source)
            return dataclasses.replace(p, expected=math.nan) if p.tokens else p
        return EMPTY_PROPOSAL

    def _log(self, choice: Choice, order: int, catchup: dict[str, int], greedy: bool, load: Load) -> None:
        """The step's prediction (at the estimates of its kind, without slow start or calibration) in the log."""
        if choice.source is None or not choice.k:
            return self.log_choice(choice, greedy, load)
        tokens = float(expected_tokens(self.estimates.accept(choice.source, order, choice.k, load))[-1])
        drafter = choice.source if choice.source in self.drafts else None
        seconds = self.cost.draft_seconds(choice.k, catchup[drafter], greedy, drafter=drafter) if drafter else 0.0
        self.log_choice(choice, greedy, load, tokens, seconds)

    def choose(self, match: list[int], order: int, k: int) -> Choice:
        """The rule: the n-gram match while its first position is estimated at :data:`RULE_THRESHOLD` or
        more (or no drafter exists), else the first drafter; k by the leading positions above it."""
        first = next(iter(self.drafts), None)  # hybrid's rule knows one drafter: the first
        if match:
            accept = self.stats(f"ngram{order}").conditional(len(match))
            if accept[0] >= RULE_THRESHOLD or first is None:
                return Choice("ngram", max(1, leading(accept, RULE_THRESHOLD)), math.nan, math.nan)
        if first is not None:
            accept = self.stats(first).conditional(k)
            return Choice(first, max(1, leading(accept, RULE_THRESHOLD)), math.nan, math.nan)
        return Choice(None, 0, 1.0, math.nan)


def hybrid_factory(ctx: ProposerContext, spec: SpecConfig) -> HybridProposer:
    """``hybrid``: n-gram lookup or the first draft model."""
    drafts = {kind: DraftModelProposer(SequenceCache(b, salt=ctx.cache_salt), ctx.vocab_size, p_min=spec.draft_p_min,
                                       lazy_prefill=True, drafter=kind, cascade=spec.cascade,
                                       ngram_max=spec.ngram_max, ngram_min=spec.ngram_min)
              for kind, b in zip(ctx.draft_kinds, ctx.drafts[:1])}  # hybrid's rule knows one drafter
    return HybridProposer(ngram_max=spec.ngram_max, ngram_min=spec.ngram_min, cost_model=ctx.cost, drafts=drafts)
