"""A request's acceptance estimates: per kind of proposal (``ngramN``, ``suffix``, a drafter's kind), what its
drafts have earned at each position, capped by a slow start, and calibrated in a shared call.

``hybrid`` reads them to decide by acceptance alone; ``auto`` prices them with the cost model
(:mod:`specdec.policy.pricing`, eq. (3)). This module knows kinds of proposals, not proposers.
"""

from __future__ import annotations

import numpy as np

from specdec.policy.acceptance import AcceptanceStats
from specdec.policy.cost import CostModel
from specdec.types import ALONE, Load
from specdec.proposers.base import Outcome, Proposal, is_draft_kind
from specdec.proposers.prediction import KIND as PREDICTION

START_K = 2
"""``auto``'s first cap on drafts per step for each kind of proposal in a request (see
:meth:`RequestEstimates.slow_start_cap`)."""


def kind_of(source: str, order: int) -> str:
    """The kind of proposal whose acceptance is pooled: ``ngram{order}``, ``suffix``, ``prediction`` or a
    drafter's kind."""
    return f"ngram{order}" if source == "ngram" else source


class RequestEstimates:
    """One request's acceptance statistics per kind, seeded from the engine's pooled ones, and its caps.

    Args:
        cost: The engine's cost model: pooled statistics (:meth:`CostModel.stats`) and calibrations.
        adaptive: ``auto``: caps grow by slow start, and estimates are calibrated in shared calls;
            ``hybrid``: caps stay at :data:`START_K`, no calibration.
    """

    def __init__(self, cost: CostModel, adaptive: bool):
        self.cost, self.adaptive = cost, adaptive
        self._stats: dict[str, AcceptanceStats] = {}
        self._cap: dict[str, int] = {}  # per source (draft, ngram, suffix): most drafts allowed now (slow start)

    def stats(self, kind: str) -> AcceptanceStats:
        """This request's acceptance statistics of one kind (a drafter's, ``ngramN``, ``suffix``)."""
        if kind not in self._stats:
            self._stats[kind] = self.cost.stats(kind)
        return self._stats[kind]

    def slow_start_cap(self, source: str) -> int:
        """Most drafts ``auto`` may propose now from a source (a drafter's kind, ``"ngram"``, ``"suffix"``,
        ``"prediction"``):
        :data:`START_K` at first in a request, doubling each time a block is accepted whole (slow start).
        Estimates for positions this request has not reached come from other requests; a long block on their
        word alone can cost a dozen plain steps on a CPU, so k grows only as this text earns it."""
        return self._cap.get(source, START_K)

    def shared(self, load: Load) -> bool:
        """True when ``auto`` is planning a call shared with other sequences: only there are its estimates
        calibrated (:class:`~specdec.policy.cost.Calibration`). Alone, a draft that disappoints costs this
        request alone and its own statistics correct it within a few steps; in a busy call the gain is a few
        percent at best and the whole batch pays for the error."""
        return self.adaptive and load.sequences > 0

    def accept(self, source: str, order: int, available: int, load: Load = ALONE,
               calibrated: bool = True) -> np.ndarray:
        """``[min(available, cap)] float64`` conditional acceptance estimates of ``source`` (``"ngram"``,
        whose kind is ``ngram{order}``, ``"suffix"``, ``"prediction"`` or a drafter's kind), capped by
        :meth:`slow_start_cap`; with
        ``calibrated`` in a call shared under ``load`` (:meth:`shared`), scaled by what the engine's choices
        of that kind earned."""
        kind = kind_of(source, order)
        accept = self.stats(kind).conditional(min(available, self.slow_start_cap(source)))
        return self.cost.calibration(kind).apply(accept) if calibrated and self.shared(load) else accept

    def suffix_accept(self, proposal: Proposal, load: Load = ALONE, calibrated: bool = True) -> np.ndarray:
        """``[min(k', cap)] float64``: per draft of a suffix path, the smaller of its count confidence and what
        suffix proposals have earned at that position (then calibrated, as :meth:`accept`)."""
        learned = self.accept("suffix", 0, len(proposal.tokens), calibrated=False)
        accept = np.minimum(learned, np.asarray(proposal.confidence[: len(learned)], dtype=np.float64))
        return self.cost.calibration("suffix").apply(accept) if calibrated and self.shared(load) else accept

    def observe(self, outcome: Outcome) -> None:
        """Update the statistics of the kind just verified, and (``auto``) its slow start. The engine's pooled
        statistics are fed by the step's report, not here."""
        kind = outcome.proposal.kind
        if kind is None:
            return
        proposed, accepted = outcome.main  # a tree's branches are priced from the main path's estimates
        self.stats(kind).observe(proposed, accepted)
        source = kind if kind in ("suffix", PREDICTION) or is_draft_kind(kind) else "ngram"
        if self.adaptive and accepted == proposed:
            self._cap[source] = 2 * self.slow_start_cap(source)
