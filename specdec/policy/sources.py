"""The sources of drafts a request has, composed by ``hybrid`` and ``auto``: an incremental n-gram index of the
context, optionally suffix decoding (``auto``), and the draft models, each prefilled lazily (the first time it
drafts, so a request that never needs it never pays its prefill), with the request's acceptance estimates
(:class:`~specdec.policy.estimates.RequestEstimates`) and its log of predictions.

Per step the suffix of the context is looked up in the n-gram index (newest earlier occurrence, longest suffix
first, as :mod:`specdec.proposers.ngram` does), and the acceptance of the kind of proposal at hand is estimated
per draft position: ``ngramN`` for an N-token suffix match (how long matches of this kind have run), ``draft``
for the (first) draft model, ``draft:<name>`` for each further one
(:func:`~specdec.proposers.base.drafter_kinds`). This module knows token ids and proposers; it never sees the
target's logits.
"""

from __future__ import annotations

import math
from typing import Sequence

from specdec.policy.acceptance import AcceptanceStats
from specdec.policy.cost import CostModel
from specdec.policy.pricing import Choice
from specdec.types import ALONE, Load
from specdec.policy.estimates import RequestEstimates
from specdec.policy.schedule import PredictionLog
from specdec.proposers.base import Outcome
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.ngram import NgramIndex
from specdec.proposers.prediction import PredictionIndex
from specdec.proposers.suffix import SuffixProposer


class Sources:
    """A request's sources of drafts and what it learned of them; the base of ``hybrid`` and ``auto``.

    Args:
        cost_model: The engine's :class:`~specdec.policy.cost.CostModel` (timings and pooled acceptance),
            read here and fed by the step's reports; ``None``: a fresh one.
        adaptive: ``auto``'s estimates (slow start, calibration in shared calls) rather than ``hybrid``'s.
        ngram_max: Longest suffix n-gram matched.
        ngram_min: Shortest suffix n-gram matched.
        suffix: A suffix-decoding proposer as one more source, or None.
        drafts: Drafter kind -> draft-model proposer (prefilled lazily), in the engine's order.
        draft: Shorthand for ``drafts={"draft": draft}``.
        prediction: The client's predicted output (token ids; OpenAI's Predicted Outputs): one more free
            source (:mod:`specdec.proposers.prediction`); empty: none.
    """

    def __init__(self, cost_model: CostModel | None, adaptive: bool, ngram_max: int = 3, ngram_min: int = 1,
                 suffix: SuffixProposer | None = None, drafts: dict[str, DraftModelProposer] | None = None,
                 draft: DraftModelProposer | None = None, prediction: Sequence[int] = ()):
        assert draft is None or drafts is None, "pass draft or drafts"
        self.index = NgramIndex(ngram_min, ngram_max)
        self.prediction = PredictionIndex(prediction, ngram_min, ngram_max) if prediction else None
        self.suffix = suffix
        self.drafts = dict(drafts) if drafts is not None else ({} if draft is None else {"draft": draft})
        self.cost = cost_model if cost_model is not None else CostModel()
        self.estimates = RequestEstimates(self.cost, adaptive)
        self.log = PredictionLog()

    @property
    def draft(self) -> DraftModelProposer | None:
        """The first drafter's proposer, or None."""
        return next(iter(self.drafts.values()), None)

    def stats(self, kind: str) -> AcceptanceStats:
        """This request's acceptance statistics of one kind (:meth:`RequestEstimates.stats`)."""
        return self.estimates.stats(kind)

    def slow_start_cap(self, source: str) -> int:
        """Most drafts a source may propose now (:meth:`RequestEstimates.slow_start_cap`)."""
        return self.estimates.slow_start_cap(source)

    def prepare(self, context: Sequence[int]) -> None:
        """Index the prompt (or its next chunk); each draft model is prefilled lazily when it first drafts."""
        self.index.sync(context)
        if self.prediction is not None:
            self.prediction.prepare(len(context))
        if self.suffix is not None:
            self.suffix.prepare(context)
        for d in self.drafts.values():
            d.prepare(context)

    def lookup(self, context: Sequence[int], k: int) -> tuple[list[int], int, dict[str, int]]:
        """The n-gram continuation of ``context`` (at most ``k`` tokens; ``[]`` when none), its order, and each
        drafter's catch-up (tokens of ``context`` its cache lacks)."""
        self.index.sync(context)
        match, order = self.index.lookup(k)
        return match, order, {kind: d.catchup(context) for kind, d in self.drafts.items()}

    def log_choice(self, choice: Choice, greedy: bool, load: Load = ALONE, tokens: float = 1.0,
                   draft_seconds: float = 0.0) -> None:
        """Add the step's prediction to the request's log: ``tokens`` committed (E(k), eq. (1), at the
        non-optimistic estimates; a plain step's defaults: 1 token, no draft) in ``draft_seconds`` (``D(k)``)
        plus the target call of its size in the call's ``load``."""
        cm, b = self.cost, load.tokens
        seconds = draft_seconds + cm.step_seconds(b + choice.k + 1 + choice.tree_tokens, greedy)
        self.log.add(Choice(choice.source, choice.k, tokens, seconds, choice.probe), cm.step_seconds(b + 1, greedy))

    def observe(self, outcome: Outcome) -> None:
        """Update this request's acceptance statistics of the kind just verified (and ``auto``'s slow start)."""
        self.estimates.observe(outcome)

    def report(self) -> dict:
        """Predicted speed-up and the choices taken (see :class:`~specdec.policy.schedule.PredictionLog`)."""
        return self.log.report()

    def close(self) -> None:
        """Free the draft sequences; hand the output to the engine's suffix cache (when it keeps one)."""
        if self.suffix is not None:
            self.suffix.close()
        for d in self.drafts.values():
            d.close()


NAN_CHOICE = Choice(None, 0, 1.0, math.nan)
"""A plain step chosen by a rule (no prediction of its time)."""
