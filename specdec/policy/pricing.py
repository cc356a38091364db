"""What each option of a speculative step is worth: pure functions of explicit inputs (a priced curve of target
call times, acceptance estimates, draft times, the call's load). The cost model (:mod:`specdec.policy.cost`)
measures and supplies those inputs; ``auto`` (:mod:`specdec.policy.auto`) asks these functions and takes the
best answer. To change how ``k`` is chosen, this module is the one to read.

One speculative step drafts ``k`` tokens and scores ``k+1`` in one target call. With
``alpha_i = P(draft i accepted | drafts 1..i-1 accepted)`` the expected number of committed tokens is

    E(k) = 1 + sum_{j=1..k} prod_{i=1..j} alpha_i                                          (1)

which for a constant ``alpha`` is ``(1 - alpha^(k+1)) / (1 - alpha)``, Leviathan et al. 2023 (arXiv
2211.17192), eq. 1 (:func:`~specdec.policy.acceptance.expected_tokens`). Their Theorem 3.8 gives the wall-time
improvement ``E(k) / (k c + 1)`` with ``c`` the draft/target cost ratio, assuming the target scores ``k+1``
tokens as fast as one. That holds on a GPU and fails on a compute-bound CPU, where scoring 4 tokens costs
1.4-2.1x one token, so the times are measured instead of assumed:

    rate(k) = E(k) / (D(k) + S(k+1)),    plain decoding: rate(0) = 1 / S(1)                  (2)

``S(n)``: seconds of one target call scoring ``n`` tokens (the cost model's priced curve); ``D(k)``: the
proposer's seconds for ``k`` drafts (a draft model's; ~0 for n-gram lookup, suffix decoding, a prediction).
In a call shared with other sequences (the server's scheduler), with ``B`` their tokens and ``Y`` their expected
committed tokens (:class:`~specdec.types.Load`), the rate is the whole call's (SmartSpec's goodput, Liu et al.
2024, arXiv 2406.14066):

    rate(k) = (E(k) + Y) / (D(k) + S(B + k + 1)),    rate(0) = (1 + Y) / S(B + 1)            (3)

which is (2) for a lone request (``B = Y = 0``). Prompt chunks riding in the call are left out of ``B``
and ``Y`` (a prompt's last chunk counts as one plain decode token): they are work the server does whatever
the proposals, and a draft pass delays them as much as it delays the decodes, so the time it costs is worth
what the decodes commit per second. Counting a 32-token chunk in ``B`` (and its zero commits in ``Y``) made a
call look slow and cheap to extend: ``auto`` then drafted in nearly every call that carried a chunk, each
draft pass delaying every request in the call to gain one of them about a token, and served less than plain
decoding (measured: ``docs/bench/README.md``, section "Serving", "Prompt chunks in the load"). On a flat,
GPU-like curve ``S(B + k + 1) ~ S(B + 1)`` and cheap drafts pay at any batch size (a draft model's ``D(k)``
delays the whole call, so it is weighed against what the whole call commits); on a compute-bound curve
``S(n) ~ a + b n`` the drafts' marginal cost ``b k`` stays while the plain call's rate
``(1 + Y) / (a + b (B + 1))`` grows with the batch (the fixed cost ``a`` is shared), so beyond some batch no
k pays and speculation switches itself off: the rule vLLM hard-codes as a batch-size threshold
(``speculative_disable_by_batch_size``), here derived from the measured curve.

Two corrections apply in a shared call. (a) The
table prices a call by its total tokens, but its sizes ``B + k + 1`` are learned mostly from plain calls of
that many sequences, and a draft token was measured to cost more than another sequence's token: drafts are
priced at no less than ``beta`` a token, the measured seconds a draft token adds to a shared call
(:mod:`specdec.policy.batch_cost`, :meth:`~specdec.policy.cost.CostModel.shared_curve`). (b) The acceptance estimates are scaled by what
the choices of their kind earned (:class:`~specdec.policy.acceptance.Calibration`): choosing the option that looks best makes the chosen
ones' estimates run high, and a few percent of overrating decides whether a draft in a busy call pays (alone,
the same correction applied to the pool's share of an estimate lost more on copying answers than it saved on
prose: ``docs/bench/policy/README.md``).

Each step takes the option of highest rate, a plain step (``k = 0``) included, so speculation switches itself
off where it does not pay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from specdec.policy.acceptance import expected_tokens
from specdec.types import ALONE, Load


@dataclass(frozen=True)
class Choice:
    """One step's decision: draft ``k`` tokens from ``source`` (``k = 0``: a plain step), with its price.

    Attributes:
        source: A drafter's kind (``"draft"``, ``"draft:<name>"``), ``"ngram"``, ``"suffix"``, ``"prediction"``
            or ``None`` for a plain step.
        k: Draft tokens to propose.
        tokens: Predicted committed tokens of this request, E(k), eq. (1).
        seconds: Predicted wall time of the step, D(k) + S(B + k + 1) (``B = 0`` alone).
        probe: True when taken to refresh statistics rather than because it was best.
        others: Predicted committed tokens of the other sequences in the call, ``Y`` (0 alone).
        tree_tokens: Tokens that alternative candidates (a token tree) add to the call; 0 for a chain.
    """

    source: str | None
    k: int
    tokens: float
    seconds: float
    probe: bool = False
    others: float = 0.0
    tree_tokens: int = 0

    @property
    def rate(self) -> float:
        """Predicted committed tokens per second of the whole call, eq. (3) (this request's alone)."""
        return (self.tokens + self.others) / self.seconds if self.seconds > 0 else math.inf


def plain_step(seconds: float, load: Load = ALONE) -> Choice:
    """A plain step taking ``seconds`` (``S(1)`` alone, ``S(B + 1)`` in a shared call; NaN: unmeasured)."""
    return Choice(None, 0, 1.0, seconds, others=load.committed if load.tokens else 0.0)


def best_k(accept: np.ndarray, draft_seconds: Callable[[np.ndarray], np.ndarray], curve: np.ndarray,
           load: Load = ALONE, max_seconds: float = math.inf) -> Choice | None:
    """The best ``k >= 1`` for one source by eq. (3) (eq. (2) alone); the first best on ties.

    Args:
        accept: ``[K] float64`` conditional acceptance estimates ``alpha_1..alpha_K``.
        draft_seconds: ``D``: ``[m] int64`` k's -> ``[m] float64`` seconds (or a scalar), the source's cost.
        curve: ``[B + k_max + 2] float64`` priced ``S(n)`` for ``n = 0..B + k_max + 1`` (index 0 unused); its
            length sets ``k_max``, the most drafts a call may add (the cost model's size limit).
        load: The other sequences in the call (``B`` tokens, ``Y`` committed).
        max_seconds: Only steps predicted to take at most this long (a probe's budget).

    Returns:
        The source's best choice (``source`` unset), or None when ``K == 0`` or no k fits ``max_seconds``.
    """
    b = load.tokens
    k_max = min(len(accept), len(curve) - b - 2)
    if k_max < 1:
        return None
    ks = np.arange(1, k_max + 1)
    e = expected_tokens(accept[:k_max])[1:]  # [k_max] E(1..k_max)
    t = draft_seconds(ks) + curve[b + 2: b + 2 + k_max]  # [k_max] seconds a step
    rate = np.where(t <= max_seconds, (e + load.committed) / t, -np.inf)
    i = int(np.argmax(rate))
    if not rate[i] > -np.inf:
        return None
    return Choice(None, i + 1, float(e[i]), float(t[i]), others=load.committed)


def reach_thresholds(curve: np.ndarray, plain: Choice, load: Load = ALONE) -> np.ndarray:
    """``[x_max] float64``: entry ``x - 1`` is the largest acceptance ``p`` of every scored draft at which no
    option scoring at most ``x`` more tokens beats ``plain`` (with free drafts; a draft model's time only
    lowers its rate). Such an option commits at most ``1 + x' p`` of this request's tokens in at least
    ``S(B + 1 + x')`` seconds (``x' <= x``), so by eq. (3) it wins only if
    ``p > min_{x' <= x} ((1 + Y) S(B + 1 + x') / T0 - 1 - Y) / x'`` (``T0 = plain.seconds``).

    Args:
        curve: ``[x_max] float64`` priced ``S(B + 1 + x)`` for ``x = 1..x_max``.
        plain: The plain step's choice (:func:`plain_step`).
        load: The other sequences in the call.

    Returns:
        The thresholds, non-increasing in ``x`` (negative where a free draft would pay, above 1 where none
        can); NaN when ``plain.seconds`` is unknown.
    """
    x = np.arange(1, len(curve) + 1)
    y = load.committed
    return np.minimum.accumulate(((1 + y) * curve / plain.seconds - 1 - y) / x)


def gain(choice: Choice, plain: Choice) -> float:
    """How much ``choice`` raises the call's predicted rate over ``plain``, in units of this request's own
    plain rate (``1 / plain.seconds``): alone, ``choice.rate / plain.rate - 1``; in a shared call the
    others' tokens are in both rates and do not dilute the comparison."""
    return (choice.rate - plain.rate) * plain.seconds
