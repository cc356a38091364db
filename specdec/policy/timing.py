"""Online wall time of a target call by its size: the table behind ``S(n)`` of :mod:`specdec.policy.cost`
(and ``P(m)`` of :mod:`specdec.policy.batch_cost`). Numbers only: it knows nothing of models or tokens."""

from __future__ import annotations

import math

import numpy as np

CALL_N_MAX = 4096
"""Largest target call, in tokens, whose time the cost model records: decode steps of a whole batch and
prompt chunks (:mod:`specdec.prefill`); larger calls (a whole long prompt, unchunked) are ignored."""


class TimingTable:
    """Online wall time of one call by its size ``n`` (tokens), ``n = 1..n_max``, in seconds.

    Each size keeps an exponentially weighted mean (weight ``alpha`` for a new sample). Once a size
    has three samples, a new one is clipped to [0.5x, 2x] of the mean, so a burst of load from another
    process moves the estimate only a little. A lasting change of load is the owner's to notice: each size
    remembers when it was last sampled (``seen``, on the owner's clock) and what a plain call cost then
    (``level``), and the owner forgets (:meth:`forget`) the sizes measured under other conditions
    (:mod:`specdec.policy.refresh`), which are then learned again as if new.

    Args:
        n_max: Largest size tracked; larger calls (prefills) are ignored.
        alpha: Weight of a new sample.
    """

    def __init__(self, n_max: int = CALL_N_MAX, alpha: float = 0.2):
        self.n_max = n_max
        self.alpha = alpha
        self.mean = np.zeros(n_max + 1)  # [n_max+1] float64 seconds; index 0 unused
        self.count = np.zeros(n_max + 1, dtype=np.int64)
        self.seen = np.zeros(n_max + 1, dtype=np.int64)  # [n_max+1] the owner's clock (target calls) at the last sample
        self.level = np.full(n_max + 1, math.nan)  # [n_max+1] seconds of a plain call when last sampled (NaN: unknown)
        self.dropped = np.zeros(n_max + 1)  # [n_max+1] seconds: the mean when last forgotten (0: never forgotten)
        self._measured = False  # any count > 0 (asked several times a step: a 4,096-entry scan each time)

    def observe(self, n: int, seconds: float, now: int = 0, level: float = math.nan) -> bool:
        """Record one call of size ``n`` that took ``seconds``; False when ignored (a size out of range, no
        time). ``now``: the owner's clock (target calls so far); ``level``: seconds of a plain call now (NaN:
        not known, or ``n`` is the plain call itself), both kept for :meth:`stale`."""
        if not 1 <= n <= self.n_max or not seconds > 0:
            return False
        self.seen[n], self.level[n] = now, level
        if self.count[n] == 0:
            self.mean[n] = seconds
        else:
            if self.count[n] >= 3:
                seconds = min(max(seconds, 0.5 * self.mean[n]), 2.0 * self.mean[n])
            self.mean[n] += self.alpha * (seconds - self.mean[n])
        self.count[n] += 1
        self._measured = True
        return True

    def stale(self, now: int, horizon: int, level: float, factor: float, n_age: int) -> tuple[np.ndarray, np.ndarray]:
        """Sizes measured under other conditions: ``(aged, drifted)``, each ``[m] int64``.

        Args:
            now: The owner's clock (target calls so far).
            horizon: A size ``n <= n_age`` not sampled for more than this many calls is aged.
            level: Seconds of a plain call now (NaN: unknown, nothing drifts).
            factor: A size sampled when a plain call cost more than ``factor`` times ``level``, or less than
                ``level / factor``, has drifted.
            n_age: Largest size that ages (larger ones are measured under other conditions only by drift).
        """
        sizes = np.flatnonzero(self.count)
        with np.errstate(invalid="ignore"):
            ratio = self.level[sizes] / level
            drifted = (ratio > factor) | (ratio < 1.0 / factor)  # False where either level is NaN
        aged = ~drifted & (sizes <= n_age) & (now - self.seen[sizes] > horizon)
        return sizes[aged], sizes[drifted]

    def forget(self, sizes: np.ndarray) -> None:
        """Drop ``sizes`` (``[m] int``): estimated from the other sizes until sampled again, then learned as a
        new size (no clipping to the forgotten mean); their last means stay in :attr:`dropped`."""
        self.dropped[sizes] = self.mean[sizes]
        self.count[sizes], self.mean[sizes] = 0, 0.0
        self._measured = bool(self.count.any())

    def inverted(self, n: int, factor: float) -> np.ndarray:
        """``[m] int64``: the sizes below ``n`` with fewer than 3 samples whose mean is above ``factor`` times size
        ``n``'s (scoring fewer tokens never costs that much more: samples that carried one-time costs); empty when
        ``n`` is unmeasured or the smallest size."""
        if not (1 < n <= self.n_max and self.count[n]):
            return np.zeros(0, np.int64)
        smaller = np.flatnonzero(self.count[1:n]) + 1
        return smaller[(self.count[smaller] < 3) & (self.mean[smaller] > factor * self.mean[n])]

    @property
    def measured(self) -> bool:
        """True once any size has a sample."""
        return self._measured or bool(self.count.any())  # (count may be written directly: from_snapshot, tests)

    def snapshot(self) -> dict:
        """``{"S": {n: seconds}, "count": {n: samples}}`` of the measured sizes (JSON-ready)."""
        sizes = [int(n) for n in np.flatnonzero(self.count)]
        return {"S": {n: float(self.mean[n]) for n in sizes}, "count": {n: int(self.count[n]) for n in sizes}}

    @classmethod
    def from_snapshot(cls, snap: dict, n_max: int = CALL_N_MAX) -> "TimingTable":
        """The table a :meth:`snapshot` describes (keys may be strings, as after a JSON round trip)."""
        table = cls(n_max)
        for n, seconds in snap["S"].items():
            table.mean[int(n)], table.count[int(n)] = seconds, snap["count"][n]
        return table

    def estimate(self, n: int, optimistic: bool = False) -> float:
        """Seconds for a call of size ``n``; NaN when nothing is measured.

        A measured size returns its mean; between measured sizes, linear interpolation; below the
        smallest, that size's time scaled by ``n / n_lo``; beyond the largest, with ``optimistic`` its
        time (a lower bound: a call never gets cheaper with more tokens), otherwise extrapolated with
        the slope between the two largest measured sizes (or proportionally when only one is known).
        With ``optimistic``, a size with fewer than 3 samples returns the smaller of its mean and the
        estimate from the other sizes, so one unlucky first sample does not rule it out for good.
        """
        n = min(max(n, 1), self.n_max)
        if self.count[n] and (self.count[n] >= 3 or not optimistic):
            return float(self.mean[n])
        sizes = np.flatnonzero(self.count)
        if self.count[n]:
            sizes = sizes[sizes != n]
            if len(sizes) == 0:
                return float(self.mean[n])
            return min(float(self.mean[n]), self._from_sizes(sizes, n, optimistic))
        if len(sizes) == 0:
            return math.nan
        return self._from_sizes(sizes, n, optimistic)

    def curve(self, optimistic: bool = False, upto: int | None = None) -> np.ndarray:
        """``[upto+1] float64``: :meth:`estimate` of every size ``n = 0..upto`` (default ``n_max``) at once
        (index 0 and every size when nothing is measured: NaN), for decisions that price many sizes per
        step; ``upto`` keeps that cheap when the table tracks thousands of sizes (prompt chunks)."""
        upto = self.n_max if upto is None else min(upto, self.n_max)
        out = np.full(upto + 1, math.nan)
        sizes = np.flatnonzero(self.count)
        if len(sizes) == 0:
            return out
        out[1:] = self._from_sizes_all(sizes, np.arange(1, upto + 1), optimistic)
        inside = sizes[sizes <= upto]
        out[inside] = self.mean[inside]
        if optimistic and len(sizes) > 1:  # a size with < 3 samples: the smaller of its mean and its neighbours'
            few = np.flatnonzero((self.count[sizes] < 3) & (sizes <= upto))  # [f] indices into sizes
            lo, hi = sizes[np.maximum(few - 1, 0)], sizes[np.minimum(few + 1, len(sizes) - 1)]
            n = sizes[few]
            w = np.where(hi > lo, (n - lo) / np.maximum(hi - lo, 1), 0.0)
            between = (1 - w) * self.mean[lo] + w * self.mean[hi]
            others = np.where(few == 0, self.mean[hi] * n / hi,  # below the others: proportional
                              np.where(few == len(sizes) - 1, self.mean[lo], between))  # above: flat
            out[n] = np.minimum(self.mean[n], others)
        return out

    def _from_sizes_all(self, sizes: np.ndarray, n: np.ndarray, optimistic: bool) -> np.ndarray:
        """:meth:`_from_sizes` for ``[m] int`` sizes ``n`` at once; ``[m] float64``."""
        means = self.mean[sizes]
        out = np.interp(n, sizes, means)  # between measured sizes (np.interp is flat beyond them)
        below = n < sizes[0]
        out[below] = means[0] * n[below] / sizes[0]
        above = n > sizes[-1]
        if not optimistic:
            if len(sizes) >= 2:
                slope = max(0.0, (means[-1] - means[-2]) / (sizes[-1] - sizes[-2]))
            else:
                slope = means[-1] / sizes[-1]
            out[above] = means[-1] + slope * (n[above] - sizes[-1])
        return out

    def _from_sizes(self, sizes: np.ndarray, n: int, optimistic: bool) -> float:
        """Estimate of size ``n`` from the measured ``sizes`` (``[m] int``, ascending, without n)."""
        i = int(np.searchsorted(sizes, n))
        if i == 0:
            return float(self.mean[sizes[0]] * n / sizes[0])
        lo = sizes[i - 1]
        if i < len(sizes):
            hi = sizes[i]
            w = (n - lo) / (hi - lo)
            return float((1 - w) * self.mean[lo] + w * self.mean[hi])
        if optimistic:
            return float(self.mean[lo])
        if len(sizes) >= 2:
            lo2 = sizes[-2]
            slope = max(0.0, (self.mean[lo] - self.mean[lo2]) / (lo - lo2))
        else:
            slope = self.mean[lo] / lo
        return float(self.mean[lo] + slope * (n - lo))
