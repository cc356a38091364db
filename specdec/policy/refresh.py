"""When the cost model forgets timings measured under other conditions, so that ``auto`` measures them again.

The timing tables (:mod:`specdec.policy.timing`) clip each new sample to [0.5x, 2x] of a size's mean, so a
burst of load from another process moves an estimate only a little; the price is that timings learned while
the machine was busy outlive the busy spell. A size is measured only when ``auto`` chooses it, and ``auto``
does not choose a size it believes dear: an engine started while another process shared its cores learned
``S(2)`` and up at several times a quiet ``S(1)``, re-measured ``S(1)`` on every plain step once the machine was
quiet, and never drafted again (issue 40), since a probe may cost at
most :data:`~specdec.policy.schedule.PROBE_COST` plain steps and the stale ``S(2)`` was priced above that.
Likewise a drafter timed while busy is ruled out and never runs again.

Two signals make a timing stale, and a stale timing is forgotten (:meth:`TimingTable.forget`): the size is then
estimated from the sizes still known, optimistically as an unmeasured size is (:mod:`specdec.policy.cost`), and
:meth:`CostModel.size_limit` grows again by doubling, so ``auto`` explores as a fresh engine would.

- Drift: the plain call ``S(1)`` is measured on every plain step, so it follows the machine. A timing taken
  when ``S(1)`` was more than :data:`CHANGE_FACTOR` times what it is now (or less than ``1 / CHANGE_FACTOR``)
  was taken under other conditions. This is the quick path: on a machine that just went quiet, ``S(1)``
  falls within a dozen plain steps and every size and drafter timed before goes with it.
- Age (exponential back-off, as a bandit keeps exploring an arm it believes worse): a decode-step size not
  measured for :attr:`RefreshSchedule.horizon` target calls is forgotten, and so is a drafter's timing. The
  horizon doubles with each such round, from :data:`HORIZON_MIN` to :data:`HORIZON_MAX` calls, and falls back
  to :data:`HORIZON_MIN` on a drift or when a forgotten size's first new sample differs from its forgotten mean
  by :data:`CHANGE_FACTOR`: re-probing never stops, and costs little where nothing changes. This catches load
  that slowed large calls more than ``S(1)``.

This module knows clocks and tables only: no proposers, tokens or requests.
"""

from __future__ import annotations

import math

import numpy as np

from specdec.policy.timing import TimingTable

CHANGE_FACTOR = 1.5
"""A plain call's cost moving by this factor (either way) since a timing was taken makes that timing stale; a
re-measured size moving by it resets the horizon. Well above the few percent a quiet machine's timings jitter."""

HORIZON_MIN = 256
"""Target calls after which an unmeasured decode size or drafter timing is first forgotten (and again after a
change): a few hundred plain steps, about one reply's worth."""

HORIZON_MAX = 4096
"""Most target calls between two rounds of forgetting when nothing changes."""

AGE_N_MAX = 65
"""Largest call size (tokens) forgotten by age: a lone request's decode steps (64 drafts and the last token).
Prompt chunks and batches past it are re-learned on drift only, so chunked prefill keeps its budget."""

REVIEW_EVERY = 16
"""Target calls between two checks for stale timings (a check scans every measured size)."""


class RefreshSchedule:
    """The clock (target calls observed) and the age horizon of one cost model; see the module docstring.

    Attributes:
        now: Target calls observed so far.
        horizon: Target calls without a sample after which a decode size or drafter timing is forgotten.
    """

    def __init__(self) -> None:
        self.now = 0
        self.horizon = HORIZON_MIN
        self._next_review = REVIEW_EVERY

    def tick(self) -> bool:
        """Count one target call; True when a check for stale timings is due."""
        self.now += 1
        if self.now < self._next_review:
            return False
        self._next_review = self.now + REVIEW_EVERY
        return True

    def remeasured(self, table: TimingTable, n: int, seconds: float) -> None:
        """Before ``table`` records ``seconds`` for size ``n``: when ``n`` was forgotten and this first new sample
        is :data:`CHANGE_FACTOR` away from its forgotten mean, conditions changed: probe soon again."""
        old = table.dropped[n] if 1 <= n <= table.n_max and table.count[n] == 0 else 0.0
        if old > 0 and not 1.0 / CHANGE_FACTOR <= seconds / old <= CHANGE_FACTOR:
            self.horizon = HORIZON_MIN

    def review(self, tables: list[tuple[TimingTable, float, int]]) -> list[tuple[TimingTable, np.ndarray]]:
        """Forget the stale sizes of ``tables`` and back off (or reset) the horizon.

        Args:
            tables: ``(table, level, n_age)``: a timing table, seconds of a plain call now (NaN: unknown), the
                largest of its sizes that ages (:meth:`TimingTable.stale`).

        Returns:
            ``(table, [m] int64 sizes)`` of each table that forgot something.
        """
        out, aged_any, drifted_any = [], False, False
        for table, level, n_age in tables:
            aged, drifted = table.stale(self.now, self.horizon, level, CHANGE_FACTOR, n_age)
            if len(aged) or len(drifted):
                sizes = np.concatenate((aged, drifted))
                table.forget(sizes)
                out.append((table, sizes))
            aged_any, drifted_any = aged_any or len(aged) > 0, drifted_any or len(drifted) > 0
        if drifted_any:
            self.horizon = HORIZON_MIN
        elif aged_any:
            self.horizon = min(2 * self.horizon, HORIZON_MAX)
        return out


def plain_level(table: TimingTable) -> float:
    """Seconds of a plain call (``S(1)``) by ``table``, NaN when it has none: the level timings are taken at."""
    return float(table.mean[1]) if table.count[1] else math.nan
