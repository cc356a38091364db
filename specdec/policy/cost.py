"""The cost model of adaptive speculation (``method="auto"``): what the engine has MEASURED, turned into the
inputs that :mod:`specdec.policy.pricing` prices options with (eqs. (1)-(3) are there).

``S(n)``, the wall time of one target call scoring ``n`` tokens, verification included, is learned per engine
and decoding mode from the report of every step (:meth:`CostModel.observe_step`, :class:`TimingTable`), because
on a compute-bound CPU scoring 4 tokens costs several times one token (``docs/bench/README.md``); each
drafter's seconds per drafted token and per catch-up token are timed on their own (``D(k)``); the engine's
pooled acceptance per kind of proposal (:class:`AcceptanceStats`) and the calibration of ``auto``'s choices
(:class:`Calibration`) are kept here too, for the requests' estimates (:mod:`specdec.policy.estimates`).

Unmeasured sizes: between measured sizes ``S`` is interpolated; beyond the largest measured size it is
bounded below by that size's time (scoring more tokens never costs less). Decisions use this optimistic
bound, so a size that could pay is tried once and then known (optimism in the face of uncertainty).
Timings taken under other conditions (the plain step's cost has since moved by a large factor, or a size has
not been measured for a while) are forgotten and so become unmeasured sizes again, explored as by a fresh
engine (:mod:`specdec.policy.refresh`): what was learned while the machine was busy does not outlive the busy
spell.

Under batching (the server's scheduler) one call scores several sequences; it is recorded as ``S(n)`` with ``n``
the call's TOTAL tokens, decode steps and prompt chunks alike (on a compute-bound CPU a call's cost follows its
token count whatever the split), and what a draft token adds to a shared call is measured apart
(:mod:`specdec.policy.batch_cost`, :meth:`CostModel.shared_curve`); how a shared call is priced, and why prompt
chunks are left out of its load: :mod:`specdec.policy.pricing`.

This module knows numbers only: no models, tokens or arrays of logits. Nothing writes the cost model but
:meth:`CostModel.observe_step`; the policies only read it, and get the call's load as an argument. The
acceptance estimates are :mod:`specdec.policy.acceptance`; the timing tables :mod:`specdec.policy.timing`
and :mod:`specdec.policy.batch_cost`.
"""

from __future__ import annotations

import math
import numpy as np

from specdec.policy.acceptance import ACCEPT_PRIOR, REQUEST_STRENGTH, AcceptanceStats, Calibration
from specdec.policy.batch_cost import SharedCallCost
from specdec.policy.pricing import Choice, plain_step
from specdec.policy import pricing
from specdec.policy.refresh import AGE_N_MAX, RefreshSchedule, plain_level
from specdec.policy.timing import CALL_N_MAX, TimingTable
from specdec.types import ALONE, Load

INVERSION_FACTOR = 4.0
"""A size of fewer than 3 samples measured at more than this many times a larger size was taken under other
conditions, and is forgotten (:meth:`CostModel._forget_inverted`): more than sharing the cores explains (one
core taken by another process halves a step's speed here: docs/bench/contention), as a first call that
carried one-time costs does (measured: 2.6 s against ~0.11 s)."""

CURVE_TOLERANCE = 0.01
"""Relative move of a measured size's mean that makes the cost model recompute its priced curve."""

class CostModel:
    """Per-engine timings (target ``S(n)`` per decoding mode, each drafter's per-token and catch-up times) and
    pooled acceptance statistics; see the module docstring for the model.

    Fed by the speculative step's reports (:meth:`observe_step`): target calls, draft-model costs and
    what each pooled kind of proposal earned. Proposers read it.
    """

    def __init__(self) -> None:
        self.target = {True: TimingTable(), False: TimingTable()}  # greedy? -> S(n)
        self.draft_timing: dict[str, tuple[TimingTable, TimingTable]] = {}
        """Drafter kind (``draft``, ``draft:<name>``) -> its ``[1]`` tables: seconds per drafted token, seconds
        per catch-up token; each drafter is timed on its own."""
        self.draft_token, self.draft_catchup = self._draft_tables("draft")  # the first drafter's
        self.pool: dict[str, AcceptanceStats] = {}
        self.calibrations: dict[str, Calibration] = {}  # kind -> what auto's chosen drafts earned vs expected
        self._version = 0  # bumped by a target measurement that moves the curve (invalidates ``curve``)
        self._priced: dict[tuple[bool, int], float] = {}  # (greedy, n) -> S(n) when the curve last changed
        self._curves: dict[tuple, np.ndarray] = {}  # (greedy, optimistic) -> [CALL_N_MAX+1] S(n)
        self._curves_version = -1  # the _version they were computed at
        self._limits: dict[bool, int] = {}  # greedy -> size_limit, at _limits_version
        self._limits_version = -1
        self.shared = {True: SharedCallCost(), False: SharedCallCost()}
        """Greedy? -> what a draft token adds to a call shared with other sequences (:mod:`specdec.policy.batch_cost`)."""
        self._priced_extension: dict[bool, float] = {}  # greedy -> beta when the curve last changed
        self._reach: dict[tuple, np.ndarray] = {}  # (greedy, B, shared?) -> [x_max] S(B + 1 + x)
        self._reach_version = -1  # the _version _reach was priced at (reach_thresholds)
        self.refresh = RefreshSchedule()
        """The clock and horizon by which timings taken under other conditions are forgotten
        (:mod:`specdec.policy.refresh`)."""

    # -- feedback -------------------------------------------------------------------------------
    def observe_step(self, report) -> None:
        """Learn from one :class:`specdec.step.StepReport`: the target call's size (total tokens) and
        seconds, each proposal's draft-model cost, and the acceptance of each pooled kind of proposal."""
        if report.call is not None:
            c = report.call
            self.observe_target(c.n_tokens, c.seconds, c.greedy)
            self.observe_shared(c.n_tokens, c.n_sequences, c.n_prompt, c.seconds, c.greedy)
        for outcome in report.outcomes:
            p = outcome.proposal
            if p.draft_cost is not None:
                c = p.draft_cost
                self.observe_draft(c.evals, c.catchup, c.seconds, c.drafter)
            if p.kind is not None:  # the main candidate's: a tree's other branches are priced from it
                self._pool(p.kind).observe(*outcome.main)
                if not math.isnan(p.expected):
                    self.calibration(p.kind).observe(p.expected, outcome.main[1])

    # -- timings --------------------------------------------------------------------------------
    def observe_target(self, n: int, seconds: float, greedy: bool) -> None:
        """One target call that scored ``n`` tokens (and verified them) in ``seconds``. The priced curve
        (:meth:`curve`) is recomputed when a size is new (fewer than 4 samples) or its mean has moved more
        than :data:`CURVE_TOLERANCE` since the curve last saw it: a plain step measures ``S(1)`` every step,
        and recomputing the curve for each tiny move of an average was a sizeable share of ``auto``'s own
        time on a plain step (measured with :mod:`specdec.bench.overhead`: ``docs/bench/README.md``, section
        "What ``auto`` costs when it does not speculate")."""
        table, refresh = self.target[greedy], self.refresh
        due = refresh.tick()
        refresh.remeasured(table, n, seconds)
        if table.observe(n, seconds, refresh.now, math.nan if n == 1 else plain_level(table)):
            self._reprice(greedy, n)
            self._forget_inverted(greedy, n)
        if due:
            self._forget_stale()

    def _forget_inverted(self, greedy: bool, n: int) -> None:
        """Forget the smaller sizes of fewer than 3 samples whose mean is above :data:`INVERSION_FACTOR` times size
        ``n``'s: scoring fewer tokens never costs that much more, so their few samples carried one-time costs,
        and a plain step measures ``S(1)`` again. (A size of 3 samples or more, and smaller inversions, are the
        refresh schedule's to judge: :mod:`specdec.policy.refresh`.) Without
        this, a fresh engine whose first one-token step took 2.6 s against ~0.11 s after (another process busy
        on both cores) priced every plain step at 2.6 s, drafted at every step and never measured ``S(1)``
        again: 0.32x plain decoding on a prose prompt."""
        table = self.target[greedy]
        stale = table.inverted(n, INVERSION_FACTOR)
        if len(stale):
            table.forget(stale)
            self._unprice(greedy, stale)

    def _unprice(self, greedy: bool, sizes) -> None:
        """After ``sizes`` (ints) of the ``greedy`` target table were forgotten: the priced curve follows."""
        for m in sizes:
            self._priced.pop((greedy, int(m)), None)
        self._version += 1

    def _reprice(self, greedy: bool, n: int) -> None:
        """Bump :attr:`version` when size ``n``'s mean is new or moved (see :meth:`observe_target`)."""
        table = self.target[greedy]
        mean, seen = float(table.mean[n]), self._priced.get((greedy, n))
        if seen is None or table.count[n] <= 3 or abs(mean - seen) > CURVE_TOLERANCE * seen:
            self._priced[(greedy, n)] = mean
            self._version += 1

    def _plain_level(self) -> float:
        """Seconds of a plain call now, the level drafters' timings are taken at: greedy ``S(1)`` when measured
        (as :meth:`step_seconds` falls back), else sampling's; NaN before either."""
        level = plain_level(self.target[True])
        return plain_level(self.target[False]) if math.isnan(level) else level

    def _forget_stale(self) -> None:
        """Forget the timings taken under other conditions (:mod:`specdec.policy.refresh`): target sizes
        against their table's ``S(1)``, drafters' against :meth:`_plain_level`; the priced curve follows."""
        level = self._plain_level()
        tables = [(t, plain_level(t), AGE_N_MAX) for t in self.target.values()]
        tables += [(t, level, 1) for pair in self.draft_timing.values() for t in pair]
        forgot = self.refresh.review(tables)
        for greedy, table in self.target.items():
            for t, sizes in forgot:
                if t is table:
                    self._unprice(greedy, sizes)
        if forgot:
            self._version += 1  # (a drafter's timing alone moves the curve's inputs too)

    def observe_shared(self, n_tokens: int, n_sequences: int, n_prompt: int, seconds: float, greedy: bool) -> None:
        """The same call for :attr:`shared` (``n_prompt``: its prompt-chunk tokens). The priced curve is
        recomputed when the draft tokens' cost ``beta`` first becomes known or moves more than
        :data:`CURVE_TOLERANCE`."""
        shared = self.shared[greedy]
        shared.observe(n_tokens, n_sequences, n_prompt, seconds)
        beta, seen = shared.extension_seconds(), self._priced_extension.get(greedy, math.nan)
        if math.isnan(beta):
            return
        if math.isnan(seen) or abs(beta - seen) > CURVE_TOLERANCE * max(seen, 1e-6):
            self._priced_extension[greedy] = beta
            self._version += 1

    def _draft_tables(self, drafter: str) -> tuple[TimingTable, TimingTable]:
        """``drafter``'s (per token, per catch-up token) tables, created on first use."""
        if drafter not in self.draft_timing:
            self.draft_timing[drafter] = (TimingTable(n_max=1), TimingTable(n_max=1))
        return self.draft_timing[drafter]

    def observe_draft(self, k: int, catchup: int, seconds: float, drafter: str = "draft") -> None:
        """The draft model of kind ``drafter`` drafted ``k`` tokens in ``seconds`` after catching up on
        ``catchup`` tokens it had not seen (1 or 2 in steady state: the recovered/bonus token, perhaps the
        last draft)."""
        if k <= 0:
            return
        token, up = self._draft_tables(drafter)
        now, level = self.refresh.now, self._plain_level()
        if catchup <= 2:
            self.refresh.remeasured(token, 1, seconds / k)
            token.observe(1, seconds / k, now, level)
        elif catchup >= 8 and token.measured:
            rest = seconds - k * token.estimate(1)
            if rest > 0:
                up.observe(1, rest / (catchup - 1), now, level)

    def step_seconds(self, n: int, greedy: bool, optimistic: bool = False) -> float:
        """``S(n)``: predicted seconds of one target call scoring ``n`` tokens; NaN if unknown."""
        s = self.target[greedy].estimate(n, optimistic)
        if math.isnan(s) and self.target[not greedy].measured:
            s = self.target[not greedy].estimate(n, optimistic)
        return s

    def draft_seconds(self, k, catchup: int, greedy: bool, horizon: int = 16, drafter: str = "draft"):
        """``D(k)`` of the draft model of kind ``drafter``: ``k`` tokens plus catch-up on ``catchup`` unseen
        tokens, the catch-up amortized over ``horizon`` steps (it is paid once, then drafting stays in sync).
        Before any measurement of this drafter it is assumed to cost half a target token. ``k`` may be an
        int (returns a float) or an ``[m] int64`` array (returns ``[m] float64``), seconds."""
        token, up = self._draft_tables(drafter)
        t_tok = token.estimate(1)
        if math.isnan(t_tok):
            t_tok = 0.5 * self.step_seconds(1, greedy)
        t_up = up.estimate(1)
        if math.isnan(t_up):
            t_up = 0.25 * t_tok
        return k * t_tok + t_up * max(0, catchup - 2) / horizon

    # -- acceptance -----------------------------------------------------------------------------
    def _pool(self, kind: str) -> AcceptanceStats:
        """The engine's pooled statistics of ``kind`` (created on first use)."""
        if kind not in self.pool:
            prior = ACCEPT_PRIOR.get(kind.partition(":")[0], 0.65)  # every drafter starts from draft's prior
            self.pool[kind] = AcceptanceStats(prior, decay=0.98, strength=4.0)
        return self.pool[kind]

    def calibration(self, kind: str) -> Calibration:
        """The engine's :class:`Calibration` of ``kind`` (created on first use)."""
        if kind not in self.calibrations:
            self.calibrations[kind] = Calibration()
        return self.calibrations[kind]

    def stats(self, kind: str) -> AcceptanceStats:
        """A fresh per-request :class:`AcceptanceStats` for ``kind``, shrunk towards the engine's pool
        (which :meth:`observe_step` feeds)."""
        pool = self._pool(kind)
        return AcceptanceStats(pool.prior, parent=pool, strength=REQUEST_STRENGTH)

    # -- the choice -----------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """Bumped whenever the priced curve changes (see :meth:`observe_target`): a decision that depends
        on the curve alone may be reused while it stays."""
        return self._version

    def size_limit(self, greedy: bool) -> int:
        """Largest call size ``n`` a choice may use: twice the largest size measured so far (at least 2).

        Exploration grows the block by doubling, so a size whose cost is only guessed (optimistically,
        see the module docstring) is never far beyond what is known: on a compute-bound CPU, where ``S(17)``
        is many times ``S(1)`` (``docs/bench/README.md``, "What the numbers say"), one optimistic guess must
        not cost that many plain steps.
        """
        if self._limits_version != self._version:
            self._limits, self._limits_version = {}, self._version
        if greedy not in self._limits:
            sizes = np.flatnonzero(self.target[greedy].count)
            if len(sizes) == 0:
                sizes = np.flatnonzero(self.target[not greedy].count)
            self._limits[greedy] = max(2, 2 * int(sizes[-1])) if len(sizes) else 2
        return self._limits[greedy]

    def best_k(self, accept: np.ndarray, prop_seconds, greedy: bool, max_seconds: float = math.inf,
               load: Load = ALONE) -> Choice | None:
        """:func:`specdec.policy.pricing.best_k` on this engine's priced curve (:meth:`shared_curve`), with
        optimistic sizes up to :meth:`size_limit`.

        Args:
            accept: ``[K] float64`` conditional acceptance estimates; K = most drafts available.
            prop_seconds: ``k -> D(k)`` seconds, applied to ``[k_max] int64`` k's (or returning a scalar).
            greedy: Decoding mode (selects the ``S(n)`` table).
            max_seconds: Only steps predicted to take at most this long (a probe's budget).
            load: The other sequences in the call (``B`` tokens, ``Y`` committed).

        Returns:
            The best choice, or None when ``K == 0``, ``S(1)`` is unknown or no k fits ``max_seconds``.
        """
        if len(accept) == 0 or math.isnan(self.step_seconds(1, greedy)):
            return None
        b = load.tokens
        k_max = min(len(accept), max(1, self.size_limit(greedy) - 1 - b))
        return pricing.best_k(accept, prop_seconds, self.shared_curve(b + k_max + 1, greedy, load), load,
                              max_seconds)

    def curve(self, n_max: int, greedy: bool, optimistic: bool = True) -> np.ndarray:
        """``[n_max+1] float64``: ``S(n)`` for ``n = 0..n_max`` (index 0 unused, NaN; sizes past the
        table's last: its last), optimistic by default, computed once per new measurement: a decision
        between plain steps must cost far less than a step."""
        key = (greedy, optimistic)
        if self._curves_version != self._version:
            self._curves, self._curves_version = {}, self._version
        table = self.target[greedy] if self.target[greedy].measured else self.target[not greedy]
        full = self._curves.get(key)
        if full is None or (len(full) <= n_max and len(full) <= table.n_max):
            # sizes up to a power of two >= n_max (64 at least): a step prices a few dozen sizes, a
            # prefill budget a few thousand; computing all CALL_N_MAX every step was a visible part of a plain
            # step's overhead (docs/bench/README.md, "What `auto` costs when it does not speculate")
            upto = max(64, 1 << max(0, n_max).bit_length())
            self._curves[key] = full = table.curve(optimistic, upto)
        if n_max < len(full):
            return full[: n_max + 1]
        return np.concatenate((full, np.full(n_max + 1 - len(full), full[-1])))

    def shared_curve(self, n_max: int, greedy: bool, load: Load = ALONE) -> np.ndarray:
        """``[n_max+1] float64``: :meth:`curve` for a call that other sequences share (``load``), where
        each token past the others' ``B`` and this request's first costs at least ``beta``, what a draft
        token has been measured to add to a shared call (:mod:`specdec.policy.batch_cost`):
        ``S'(n) = max(S(n), S(B + 1) + beta (n - B - 1))`` for ``n > B + 1``. Alone (or before ``beta`` is
        known) it is :meth:`curve` itself. A lower bound only raises the price of drafts: the table's
        ``S(n)`` at those sizes comes mostly from calls of more sequences, not of more drafts."""
        curve = self.curve(n_max, greedy)
        base = load.tokens + 1
        if load.sequences == 0 or base >= n_max:
            return curve
        beta = self.shared[greedy].extension_seconds()
        if math.isnan(beta):  # as step_seconds: the other decoding mode's measurement, if any
            beta = self.shared[not greedy].extension_seconds()
        if math.isnan(beta) or math.isnan(curve[base]):
            return curve
        floor = curve[base] + beta * np.arange(1, n_max - base + 1)  # [n_max-base] sizes base+1..n_max
        return np.concatenate((curve[: base + 1], np.maximum(curve[base + 1:], floor)))

    def reach_thresholds(self, greedy: bool, plain: Choice, load: Load = ALONE) -> np.ndarray:
        """:func:`specdec.policy.pricing.reach_thresholds` on this engine's priced curve (:meth:`shared_curve`)
        for every size a call may add (:meth:`size_limit`), the curve kept while :attr:`version` stays (a few
        ``B``'s a step in a batch). Used by ``auto`` to skip pricing a step that must be plain
        (:meth:`specdec.policy.auto.AutoProposer._out_of_reach`).

        Returns:
            ``[x_max] float64`` thresholds (see :func:`~specdec.policy.pricing.reach_thresholds`).
        """
        b = load.tokens
        if self._reach_version != self._version:
            self._reach, self._reach_version = {}, self._version
        key = (greedy, b, load.sequences > 0)
        if key not in self._reach:
            x_max = max(1, self.size_limit(greedy) - 1 - b)
            self._reach[key] = self.shared_curve(b + 1 + x_max, greedy, load)[b + 2:]  # [x_max] S(B + 1 + x)
        return pricing.reach_thresholds(self._reach[key], plain, load)

    def plain(self, greedy: bool, load: Load = ALONE) -> Choice:
        """A plain step (:func:`~specdec.policy.pricing.plain_step`): ``S(1)`` seconds alone (NaN before any
        measurement); in a shared call ``S(B + 1)``, on the same optimistic curve as :meth:`best_k`'s sizes so
        that a size beyond those measured favours neither."""
        if load.tokens == 0:
            return plain_step(self.step_seconds(1, greedy), load)
        return plain_step(float(self.curve(load.tokens + 1, greedy)[-1]), load)
