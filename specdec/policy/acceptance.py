"""Acceptance estimates of the cost model: per kind of proposal, the conditional probability that draft
``i`` is accepted given drafts ``1..i-1`` were (``alpha_i``), learned from verified blocks, decayed so it follows
the text, and shrunk towards the engine's pooled estimate (:class:`AcceptanceStats`); and the calibration of
``auto``'s chosen options (:class:`Calibration`). ``E(k)``, eq. (1) of :mod:`specdec.policy.pricing`, is
:func:`expected_tokens`. This module knows numbers only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TRACKED_POSITIONS = 65
"""Most draft positions the acceptance statistics track, plus one (``MAX_SPECULATIVE_TOKENS`` = 64)."""

ACCEPT_PRIOR = {"draft": 0.7, "ngram1": 0.25, "ngram2": 0.4, "ngram3": 0.55, "prediction": 0.7}
"""Prior acceptance rate per kind of proposal before any is measured; ``ngramN`` = an N-token suffix
match (longer matches are likelier to continue); ``prediction``: the client's predicted output (an edit keeps
most of a file). Unlisted n-gram orders use 0.65; every drafter's kind (``draft:<name>``) starts from
``draft``'s."""


REQUEST_STRENGTH = 1.0
"""Weight, in pseudo-observations, of the engine's pooled acceptance in a request's estimate: one verified
block of this request counts as much as everything the engine has seen of the same kind."""


def expected_tokens(accept: np.ndarray) -> np.ndarray:
    """Expected committed tokens for every k, eq. (1) of the module docstring.

    Args:
        accept: ``[K] float64`` conditional acceptance probabilities ``alpha_1..alpha_K``.

    Returns:
        ``[K+1] float64``: ``E(0) = 1, E(1), ..., E(K)``.
    """
    return np.concatenate(([1.0], 1.0 + np.cumsum(np.cumprod(np.asarray(accept, dtype=np.float64)))))


class AcceptanceStats:
    """Decayed per-position acceptance counts of one kind of proposal.

    ``reached[i]`` counts steps where draft position ``i`` (0-based) was verified with every earlier
    draft accepted, ``accepted[i]`` those where it was accepted too, so ``accepted[i] / reached[i]``
    estimates ``alpha_{i+1}``. Before each update all counts are multiplied by ``decay``. Each position is
    shrunk towards this kind's rate pooled over positions, ``(accepted[i] + strength * pooled) /
    (reached[i] + strength)``, and the pooled rate towards the parent's pooled rate (the engine's
    statistics of the same kind) or a constant prior, so positions never drafted yet inherit what the
    first positions showed: a copy accepted at position 1 earns a try at longer drafts.

    Args:
        prior: Constant prior acceptance, used when there is no parent.
        parent: Statistics to shrink towards (the engine-level pool of the same kind), or None.
        decay: Factor applied to all counts before each observation (1 = no forgetting).
        strength: Weight of the parent/prior, in pseudo-observations.
    """

    def __init__(self, prior: float, parent: "AcceptanceStats | None" = None, decay: float = 0.9,
                 strength: float = 2.0, k_max: int = TRACKED_POSITIONS):
        self.prior = prior
        self.parent = parent
        self.decay = decay
        self.strength = strength
        self.reached = np.zeros(k_max)  # [k_max] float64
        self.accepted = np.zeros(k_max)  # [k_max] float64

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        """Record one verified block: ``num_accepted`` of ``num_proposed`` drafts kept."""
        if num_proposed <= 0:
            return
        self.reached *= self.decay
        self.accepted *= self.decay
        n_reached = min(num_accepted + 1, num_proposed)
        self.reached[:n_reached] += 1.0
        self.accepted[:num_accepted] += 1.0

    def pooled(self) -> float:
        """Acceptance pooled over all positions, shrunk towards the parent's (or the prior)."""
        base = self.parent.pooled() if self.parent is not None else self.prior
        return float((self.accepted.sum() + self.strength * base) / (self.reached.sum() + self.strength))

    def conditional(self, k: int) -> np.ndarray:
        """``[k] float64`` estimates of ``alpha_1..alpha_k``."""
        return (self.accepted[:k] + self.strength * self.pooled()) / (self.reached[:k] + self.strength)


class Calibration:
    """How many of the drafts ``auto`` expected to be accepted were: ``gamma = (accepted + s) / (expected + s)``
    over a kind's recent proposals (sums decayed by ``decay`` each), ``s = strength`` pseudo-tokens of
    ``gamma = 1``, clipped to [:data:`CALIBRATION_MIN`, :data:`CALIBRATION_MAX`].

    The acceptance estimates are fair for a random proposal of their kind, but ``auto`` drafts when they are
    high (a request's few blocks, a long n-gram match) and picks the k whose estimate looks best, so on
    the drafts it takes the estimates run high (the winner's curse; measured in ``docs/bench/README.md``,
    "Drafts in a busy pass"). Multiplying ``alpha_1`` by ``gamma`` multiplies every term of eq. (1) past the
    first, so ``E(k) - 1`` is scaled by ``gamma`` exactly: the expected extra tokens of the choices match
    what such choices earned.
    """

    def __init__(self, strength: float = 8.0, decay: float = 0.98):
        self.strength = strength
        self.decay = decay
        self.expected = 0.0  # decayed sum of the drafts expected to be accepted, tokens
        self.accepted = 0.0  # decayed sum of those accepted, tokens

    def observe(self, expected: float, accepted: int) -> None:
        """One verified proposal: ``expected`` drafts predicted accepted (uncalibrated), ``accepted`` were."""
        if not expected >= 0:
            return
        self.expected = self.decay * self.expected + expected
        self.accepted = self.decay * self.accepted + accepted

    @property
    def gamma(self) -> float:
        """The factor on ``alpha_1`` (and so on ``E(k) - 1``)."""
        g = (self.accepted + self.strength) / (self.expected + self.strength)
        return min(max(g, CALIBRATION_MIN), CALIBRATION_MAX)

    def apply(self, accept: np.ndarray) -> np.ndarray:
        """``[K] float64`` conditional acceptances with ``alpha_1`` scaled by :attr:`gamma` (at most 1)."""
        if len(accept) == 0:
            return accept
        out = np.array(accept, dtype=np.float64)
        out[0] = min(1.0, out[0] * self.gamma)
        return out


CALIBRATION_MIN = 0.25
"""Least factor a :class:`Calibration` applies."""

CALIBRATION_MAX = 1.5
"""Largest factor a :class:`Calibration` applies."""
